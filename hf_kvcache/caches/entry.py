"""``CacheEntry``: what the registry (``hf_kvcache.integration.registry``) knows of one cache name. The tests, soak,
evaluation and benchmarks take their settings from it, so a new cache is covered the day its entry is registered."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the cache classes import this module
    from hf_kvcache.caches.base import PoolCache
    from hf_kvcache.caches.config import PagedConfig


@dataclass(frozen=True)
class CacheEntry:
    """One registered ``cache_implementation`` name and the settings it runs with everywhere.

    Attributes:
        cache_class: the cache it builds (``cache_class(model.config, cache_config)``).
        example_config: a ``cache_config`` that works on a tiny full-attention model (head_dim 16).
        eval_presets / bench_presets: label -> ``cache_config`` of each run in the default evaluation / the lossy
            decode benchmark (empty for a lossless cache).
        soak_config: the ``cache_config`` the soak runs (default: ``example_config``).
        attn_implementation: the attention docs/caches.md recommends for the cache; ``None``: the model's own.
    """

    name: str
    cache_class: "type[PoolCache]"
    example_config: Mapping[str, Any]
    eval_presets: Mapping[str, Mapping[str, Any]]
    bench_presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    soak_config: Mapping[str, Any] | None = None
    attn_implementation: str | None = None

    def __post_init__(self) -> None:
        if self.soak_config is None:
            object.__setattr__(self, "soak_config", self.example_config)

    def config(self, settings: Mapping[str, Any] | None = None) -> "PagedConfig":
        """The cache's config (``cache_class.config_class``) from ``settings`` (default: ``example_config``), e.g. to
        build a pool it can draw from: ``KVPool.for_model(model, entry.config(), max_tokens=...)``."""
        return self.cache_class.config_class.parse(self.example_config if settings is None else settings)
