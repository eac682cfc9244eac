"""``PagedCache``: every layer on pages of the shared pool, sliding layers keeping the model's window."""

from hf_kvcache.caches.base import PoolCache
from hf_kvcache.caches.entry import CacheEntry


class PagedCache(PoolCache):
    """A drop-in for ``DynamicCache`` whose keys and values live in pages of a ``KVPool``; a model's sliding-window
    layers (Mistral, Gemma 3) keep the model's window. Takes ``PoolCache``'s arguments."""


ENTRY = CacheEntry(
    name="paged_pool",
    cache_class=PagedCache,
    example_config={},
    eval_presets={"paged_pool": {}},
)
