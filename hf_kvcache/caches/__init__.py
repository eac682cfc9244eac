"""Our ``transformers.Cache`` subclasses, one file per cache over ``base.PoolCache``, each with its registry
``ENTRY`` (``entry.CacheEntry``; collected in ``hf_kvcache.registry``)."""

from hf_kvcache.caches.paged import PagedCache
from hf_kvcache.caches.quantized import QuantizedValueCache
from hf_kvcache.caches.quantized_kv import QuantizedKVCache
from hf_kvcache.caches.ring import SlidingRingCache

__all__ = ["PagedCache", "QuantizedKVCache", "QuantizedValueCache", "SlidingRingCache"]
