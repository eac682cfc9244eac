"""Our ``transformers.Cache`` subclasses, one file per cache over ``base.PoolCache``; modules, lowest first:
``config`` (``PagedConfig``), ``policy`` (``RowPolicy``), ``fingerprint``, ``state_tails``, ``prefix``
(``PrefixTracker``), ``binder`` (``PoolBinder``), ``state_layers``, ``planned`` (``PlannedDecoding``),
``compressed``, ``admission``, ``base``, ``entry`` (``CacheEntry``), then the four caches: ``paged``, ``quantized``,
``quantized_kv``, ``ring`` (docs/layout.md says what each holds).
"""

from hf_kvcache.caches.config import PagedConfig
from hf_kvcache.caches.paged import PagedCache
from hf_kvcache.caches.quantized import QuantizedValueCache, QuantizedValueConfig
from hf_kvcache.caches.quantized_kv import QuantizedKVCache, QuantizedKVConfig
from hf_kvcache.caches.ring import SlidingRingCache, SlidingRingConfig

__all__ = [
    "PagedCache",
    "PagedConfig",
    "QuantizedKVCache",
    "QuantizedKVConfig",
    "QuantizedValueCache",
    "QuantizedValueConfig",
    "SlidingRingCache",
    "SlidingRingConfig",
]
