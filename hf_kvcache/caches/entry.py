"""``CacheEntry``: what the registry (``hf_kvcache.integration.registry``) knows of one cache name.

Each cache module declares its entry next to its class; the tests, the soak, the evaluation and the
benchmarks take the settings they run a cache with from here, so a new cache is covered by all of them
the day its entry is registered.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hf_kvcache.memory.format import PageFormat

POOL_FORMAT_KEYS = ("value_bits", "value_group_size", "key_bits", "key_group_size", "scale_dtype")
"""The ``PageFormat`` fields a cache's settings choose, beyond the model's geometry (``KVPool.for_model`` keywords)."""

if TYPE_CHECKING:  # the cache classes import this module
    from hf_kvcache.caches.base import PoolCache


@dataclass(frozen=True)
class CacheEntry:
    """One registered ``cache_implementation`` name and the settings it runs with everywhere.

    Attributes:
        name: the ``generate(cache_implementation=...)`` name.
        cache_class: the cache it builds (``cache_class.from_cache_config``).
        example_config: a ``cache_config`` that works on a tiny full-attention model (head_dim 16); the tests run
            every registered name with it.
        eval_presets: label -> ``cache_config`` of each run of the cache in the default evaluation
            (``hf_kvcache.eval``).
        bench_presets: label -> ``cache_config`` of each run of the cache in the lossy decode benchmark (``--suite
            quantized``, next to transformers' ``QuantizedCache``); empty for a lossless cache, which the ``paged``
            and ``sliding`` suites time (``hf_kvcache.bench.catalogue``).
        soak_config: the ``cache_config`` the soak runs it with (``hf_kvcache.bench.soak``); defaults to
            ``example_config``.
        attn_implementation: the attention docs/caches.md recommends running the cache under (the evaluation does),
            ``None`` for the model's own.
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

    def page_format(
        self, model_config: Any, dtype: torch.dtype, cache_config: Mapping[str, Any] | None = None
    ) -> PageFormat:
        """The format of the pool this cache draws from with ``cache_config`` (default: ``example_config``)."""
        settings = self.example_config if cache_config is None else cache_config
        return self.cache_class.options_class.from_dict(settings).page_format(model_config, dtype)

    def pool_kwargs(
        self, model_config: Any, dtype: torch.dtype, cache_config: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The ``KVPool.for_model`` keywords of a pool this cache can draw from with ``cache_config`` (default:
        ``example_config``): its encodings, e.g. ``{"value_bits": 4, "value_group_size": 16, "key_bits": None,
        ...}``."""
        page_format = self.page_format(model_config, dtype, cache_config)
        return {name: getattr(page_format, name) for name in POOL_FORMAT_KEYS}
