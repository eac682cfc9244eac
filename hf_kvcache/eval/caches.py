"""The caches an evaluation compares: ours by registered name, and transformers' own.

A ``CacheSpec`` is a label plus how to build a fresh cache for one model, and the attention the model
runs it under; specs are written on the command line as ``LABEL=KIND`` or ``LABEL=KIND:key=value,key=value``
(values parsed as JSON when they can be, e.g. ``quanto-int4=quantized:backend=quanto,nbits=4``), optionally
followed by ``@ATTENTION`` (e.g. ``ring=sliding_ring:window=256@hf_kvcache``).
"""

import copy
import importlib.util
import json
from dataclasses import dataclass, field
from typing import Any

from transformers import Cache, DynamicCache, PreTrainedConfig, PreTrainedModel, QuantizedCache, StaticCache

from hf_kvcache.integration.registry import REGISTRY

TRANSFORMERS_KINDS = ("dynamic", "static", "quantized", "sliding")
"""``dynamic``: DynamicCache (the baseline). ``static``: StaticCache. ``quantized``: QuantizedCache
(settings: backend, nbits, q_group_size, residual_length, ...). ``sliding``: a DynamicCache on the model's
config with ``sliding_window`` set on every layer (setting: ``window``), i.e. only the last tokens are kept."""


@dataclass(frozen=True)
class CacheSpec:
    """One cache of an evaluation.

    Attributes:
        label: the name in tables and plots.
        kind: one of ``TRANSFORMERS_KINDS`` or a registered ``cache_implementation`` name.
        settings: the cache's ``cache_config``.
        attn_implementation: the model's attention while it runs this cache; ``None`` for the evaluation's
            (``--attn-implementation``).
    """

    label: str
    kind: str
    settings: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str | None = None

    def __post_init__(self) -> None:
        known = TRANSFORMERS_KINDS + tuple(REGISTRY)
        if self.kind not in known:
            raise ValueError(f"Unknown cache kind {self.kind!r} for {self.label!r}; choose one of {list(known)}.")

    @property
    def is_baseline(self) -> bool:
        return self.kind == "dynamic" and not self.settings

    def build(self, model: PreTrainedModel, max_cache_len: int) -> Cache:
        """A fresh, empty cache for ``model``; ``max_cache_len`` sizes a static cache."""
        config = model.config.get_text_config(decoder=True)
        settings = dict(self.settings)
        if self.kind == "dynamic":
            return DynamicCache(config=config, **settings)
        if self.kind == "static":
            return StaticCache(config=config, max_cache_len=max_cache_len, **settings)
        if self.kind == "quantized":
            return QuantizedCache(config=config, **settings)
        if self.kind == "sliding":
            window = settings.pop("window", None)
            if not isinstance(window, int) or window < 1 or settings:
                raise ValueError(f"A sliding cache takes exactly one setting, window=<int >= 1>; got {self.settings}.")
            return DynamicCache(config=sliding_window_config(config, window))
        return REGISTRY[self.kind].cache_class(model.config, settings, dtype=model.dtype, device=model.device)


def sliding_window_config(config: PreTrainedConfig, window: int) -> PreTrainedConfig:
    """A copy of a model's decoder config in which every layer is a sliding-window layer of ``window`` tokens.

    transformers' caches built on it get ``DynamicSlidingWindowLayer``/``StaticSlidingWindowLayer`` layers: the
    ``sliding`` kind here, and the benchmarks' ``dynamic_sliding``/``static_sliding`` (``hf_kvcache.bench``).
    """
    windowed = copy.deepcopy(config.get_text_config(decoder=True))
    windowed.sliding_window = window
    windowed.layer_types = ["sliding_attention"] * windowed.num_hidden_layers
    return windowed


def parse_spec(text: str) -> CacheSpec:
    """Parses ``LABEL=KIND[:key=value,...][@ATTENTION]`` (or just ``KIND``, labelled by itself)."""
    text, _, attention = text.partition("@")
    label, _, rest = text.partition("=") if "=" in text.split(":")[0] else (text.split(":")[0], "", text)
    kind, _, options = rest.partition(":")
    settings = {}
    for item in filter(None, options.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"Cache setting {item!r} in {text!r} must look like key=value.")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    return CacheSpec(label, kind, settings, attention or None)


def default_specs() -> list[CacheSpec]:
    """The baseline, every registered cache (each of its entry's ``eval_presets``, under the entry's attention),
    and transformers' int4 quantized cache for each installed backend (quanto, hqq)."""
    specs = [CacheSpec("dynamic", "dynamic")]
    for entry in REGISTRY.values():
        specs += [
            CacheSpec(label, entry.name, dict(settings), entry.attn_implementation)
            for label, settings in entry.eval_presets.items()
        ]
    specs += [
        CacheSpec(f"{backend}-int4", "quantized", {"backend": backend, "nbits": 4})
        for backend in installed_quantized_backends()
    ]
    return specs


def installed_quantized_backends() -> list[str]:
    """The backends of transformers' ``QuantizedCache`` installed here (extras ``.[quanto]``, ``.[hqq]``)."""
    backends = []
    if importlib.util.find_spec("optimum") and importlib.util.find_spec("optimum.quanto"):
        backends.append("quanto")
    if importlib.util.find_spec("hqq"):
        backends.append("hqq")
    return backends


def window_of(spec: CacheSpec) -> int | None:
    """Tokens a query of ``spec``'s cache attends to at most, where the cache imposes a window (``None``: all)."""
    window = spec.settings.get("window")
    return window if isinstance(window, int) else None
