"""The cards we publish: a base model with one cache setting each, and the eval result its numbers come from."""

from dataclasses import dataclass, field
from typing import Any

from hf_kvcache.bundled import BUNDLED_MODEL
from hf_kvcache.errors import MissingExtraError
from hf_kvcache.integration.registry import REGISTRY

try:  # rendering, validating and publishing cards read eval reports: the cards extra (the published cards' runtime,
    # hf_kvcache.cards.generate_with_cache, needs only the core)
    from hf_kvcache.eval import EvalReport, format_spec
except MissingExtraError as error:
    raise MissingExtraError("cards", "hf_kvcache.cards (cards from an eval report)", error.name) from error


@dataclass(frozen=True)
class BaseModel:
    """A Hub model our cards point to.

    Attributes:
        hub_id: the card's ``base_model`` (whose weights users load).
        eval_name: the model name an eval report records for it (``report.config["model"]``).
        license: the base model's license, which the card inherits.
    """

    hub_id: str
    eval_name: str
    license: str


SMOLLM2_135M = BaseModel("HuggingFaceTB/SmolLM2-135M-Instruct", BUNDLED_MODEL, "apache-2.0")


@dataclass(frozen=True)
class CardSetting:
    """One card: a base model with one cache setting, and the eval result its numbers come from.

    Attributes:
        model: the base model.
        cache_implementation: a registered ``generate(cache_implementation=...)`` name.
        cache_config: the ``cache_config`` the card applies; the eval result must have used the same settings.
        result_label: label of the eval result (``--cache LABEL=...``) the card takes its numbers from.
        description: what the setting does, for the card.
    """

    model: BaseModel
    cache_implementation: str
    result_label: str
    description: str
    cache_config: dict[str, Any] = field(default_factory=dict)

    @property
    def folder_name(self) -> str:
        return f"{self.model.hub_id.split('/')[-1].lower()}-{self.cache_implementation}"

    @property
    def eval_spec(self) -> str:
        """The ``--cache`` argument of the eval script that produces this card's result."""
        attention = (
            REGISTRY[self.cache_implementation].attn_implementation if self.cache_implementation in REGISTRY else None
        )
        return format_spec(self.result_label, self.cache_implementation, self.cache_config, attention)


CARD_SETTINGS: tuple[CardSetting, ...] = (
    CardSetting(
        model=SMOLLM2_135M,
        cache_implementation="paged_pool",
        result_label="paged_pool",
        description=(
            "Keeps every token's keys and values, in fixed-size pages of a memory pool allocated once per device "
            "and shared by the caches of every request of the model. Lossless: outputs equal `DynamicCache`'s. "
            "What changes is where the memory lives: a pool you can size and watch, prompt pages shared "
            "copy-on-write between sequences that start alike (beam search, `num_return_sequences`), and a "
            "request that does not fit fails alone with `PoolExhaustedError`."
        ),
    ),
    CardSetting(
        model=SMOLLM2_135M,
        cache_implementation="sliding_ring",
        result_label="ring-256-sink4",
        cache_config={"window": 256, "sink_tokens": 4},
        description=(
            "Keeps the first `sink_tokens` tokens (attention sinks) and the last `window` tokens, in pages reused "
            "in a circle: KV memory stops growing once a sequence is longer than the window, and older tokens are "
            'no longer attended to. Load the model with `attn_implementation="hf_kvcache"` (after `import '
            "hf_kvcache`) so that a prompt longer than the window keeps to it too and the ring's pages are read in "
            "place; under `sdpa` such a prompt attends over itself in full, and the cache warns."
        ),
    ),
    CardSetting(
        model=SMOLLM2_135M,
        cache_implementation="quantized_values",
        result_label="values-int4-r128",
        cache_config={"bits": 4, "residual_length": 128},
        description=(
            "Keeps keys in full precision and stores values as 4-bit integers with an asymmetric scale and zero "
            "per token and group of `group_size` channels, quantized once when stored; attention gets them "
            "dequantized into a reused buffer (the newest `residual_length` tokens in full precision)."
        ),
    ),
    CardSetting(
        model=SMOLLM2_135M,
        cache_implementation="quantized_kv",
        result_label="kv-k4v4",
        cache_config={"key_bits": 4, "value_bits": 4},
        description=(
            "Stores keys and values as 4-bit integers. Keys are encoded per channel over each page of 16 tokens, "
            "once, when the page fills (the page still filling stays in full precision), with a scale and zero "
            "in 3 bytes per channel and page (scale to 7 mantissa bits, zero to 1/16 of a step); values per token "
            "and group of `group_size` channels, the newest "
            "`residual_length` tokens in full precision. Attention gets both decoded into reused buffers."
        ),
    ),
)
"""Every card we publish; a card is rendered only when its cache is registered and its label is in the report."""


def plan_cards(report: EvalReport) -> tuple[list[CardSetting], list[str]]:
    """Splits ``CARD_SETTINGS`` into the cards ``report`` can fill and a skip message for each other one."""
    labels = {result.label for result in report.caches}
    ready, skipped = [], []
    for setting in CARD_SETTINGS:
        name = setting.folder_name
        if setting.cache_implementation not in REGISTRY:
            skipped.append(f"skip {name}: cache {setting.cache_implementation!r} is not registered by hf_kvcache.")
        elif report.config.get("model") != setting.model.eval_name:
            skipped.append(
                f"skip {name}: the report measured {report.config.get('model')!r}, not {setting.model.eval_name!r}."
            )
        elif setting.result_label not in labels:
            skipped.append(
                f"skip {name}: the report has no result labelled {setting.result_label!r} "
                f"(has {sorted(labels)}); run the eval with --cache {setting.eval_spec}."
            )
        else:
            ready.append(setting)
    return ready, skipped
