"""Our ``transformers.Cache`` subclasses, one file per cache over ``base.PoolCache``.

- ``config``: the settings every cache takes (``PagedConfig``; each cache's config extends it);
- ``policy``: which tokens a layer group keeps (``RowPolicy``); ``prefix``: a cache's side of prompt reuse;
- ``fingerprint``: what computes a model's keys and values, as the prefix index keys it (``model_fingerprint``);
- ``state_tails``: a hybrid model's linear-attention and convolution states kept at page boundaries for prompt reuse
  (``StateTail``);
- ``binder``: the pool a cache's layers write to, found once per device, and its pages returned (``PoolBinder``);
- ``state_layers``: the layers that hold no attention KV we page keep transformers' own layers (``StateLayers``);
- ``planned``: compiled decoding, each decode step planned before the forward pass (``PlannedDecoding``);
- ``compressed``: a compressed-attention layer's window on the pool, its compressor's state beside it
  (``CompressedLayer``);
- ``admission``: a request refused before any compute when its worst case cannot fit the pool (``Admission``);
- ``base``: ``PoolCache``, a cache whose layers draw pages from a pool;
- ``entry``: what the registry knows of a cache (``CacheEntry``; collected in ``hf_kvcache.integration.registry``);
- ``paged``, ``quantized``, ``quantized_kv``, ``ring``: the four caches, each with its ``ENTRY``.
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
