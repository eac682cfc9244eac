"""``PagedCache``: every layer grows a page at a time on the shared pool."""

from typing import Any

from hf_kvcache.caches.base import PoolCache
from hf_kvcache.caches.entry import CacheEntry
from hf_kvcache.caches.policy import RowPolicy


class PagedCache(PoolCache):
    """A drop-in for ``DynamicCache`` whose keys and values live in pages of a ``KVPool``.

    On a model with sliding-window layers (Mistral, Gemma 3), those layers keep the model's
    window, so their memory stays bounded; both kinds draw pages from the same pool.

    Args:
        config: the model's config.
        cache_config: a ``PagedConfig`` (or a dict of its settings): the pool, its page size or a budget of the
            cache's own, admission checks, prompt reuse; ``None``: the defaults (the shared default pool).
        dtype / device: bind the pool at construction rather than at the first write.
        placement: where the model's KV lives (a tensor-parallel rank's share of the heads): ``PoolCache``;
            ``generate(cache_implementation=...)`` reads it from the model.
    """

    def _row_policy(self, layer_type: str, layer_kwargs: dict[str, Any]) -> RowPolicy:
        if layer_type == "sliding_attention":
            return RowPolicy(window=layer_kwargs["sliding_window"], is_sliding=True)
        return RowPolicy()


ENTRY = CacheEntry(
    name="paged_pool",
    cache_class=PagedCache,
    example_config={},
    eval_presets={"paged_pool": {}},
)
