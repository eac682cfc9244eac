"""hf_kvcache: KV caches for transformers on a memory pool you control.

``import hf_kvcache`` registers our cache names with ``generate`` (see ``integration``).
"""

from hf_kvcache.caches import (
    PagedCache,
    PagedConfig,
    QuantizedKVCache,
    QuantizedKVConfig,
    QuantizedValueCache,
    QuantizedValueConfig,
    SlidingRingCache,
    SlidingRingConfig,
)
from hf_kvcache.errors import IncompatibleModelError, MissingExtraError, PoolExhaustedError
from hf_kvcache.integration.seams import is_registered, register, unregister
from hf_kvcache.integration.warmup import WarmedShape, warmup
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.pool import KVPool
from hf_kvcache.memory.pools import KVPoolSet

__all__ = [
    "IncompatibleModelError",
    "KVPool",
    "KVPoolSet",
    "MissingExtraError",
    "PageFormat",
    "PagedCache",
    "PagedConfig",
    "PoolExhaustedError",
    "QuantizedKVCache",
    "QuantizedKVConfig",
    "QuantizedValueCache",
    "QuantizedValueConfig",
    "SlidingRingCache",
    "SlidingRingConfig",
    "is_registered",
    "register",
    "unregister",
    "WarmedShape",
    "warmup",
]
__version__ = "0.1.0"  # the one version: the build reads it (pyproject.toml), cards pin it

register()
