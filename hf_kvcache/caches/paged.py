"""``PagedCache``: every layer grows a page at a time on the shared pool."""

from typing import Any

import torch
from transformers import PreTrainedConfig

from hf_kvcache.caches.base import PoolCache
from hf_kvcache.caches.entry import CacheEntry
from hf_kvcache.caches.options import CacheOptions
from hf_kvcache.caches.policy import RowPolicy
from hf_kvcache.memory.format import DEFAULT_PAGE_SIZE
from hf_kvcache.memory.placement import Placement
from hf_kvcache.memory.pool import KVPool


class PagedCache(PoolCache):
    """A drop-in for ``DynamicCache`` whose keys and values live in pages of a ``KVPool``.

    On a model with sliding-window layers (Mistral, Gemma 3), those layers are rings of the model's
    window, so their memory stays bounded; both kinds draw pages from the same pool.

    Args:
        config: the model's config.
        pool: a ``KVPool`` or a pool's name; ``None`` draws from the default pool of the model's
            geometry, dtype and device.
        page_size: token slots per page of a pool this cache makes (default or ``max_tokens``).
        max_tokens: give this cache a fixed-budget pool of its own for this many tokens.
        admission_check: ``generate`` refuses up front a request whose worst case does not fit (``CacheOptions``;
            default: on wherever the pool is known before the first write; ``False``: off).
        prefix_caching: reuse prompt pages across ``generate`` calls through the pool's prefix index
            (``CacheOptions``; default: where a given pool keeps one).
        prefix_namespace: pages are published and found under this name only (``CacheOptions``).
        dtype / device: bind the pool at construction rather than at the first write.
        placement: where the model's KV lives (a tensor-parallel rank's share of the heads): ``PoolCache``;
            ``generate(cache_implementation=...)`` reads it from the model.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        pool: KVPool | str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        max_tokens: int | None = None,
        admission_check: bool | None = None,
        prefix_caching: bool | None = None,
        prefix_namespace: str = "",
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        placement: Placement | None = None,
    ) -> None:
        options = CacheOptions(
            page_size=page_size,
            pool=pool,
            max_tokens=max_tokens,
            admission_check=admission_check,
            prefix_caching=prefix_caching,
            prefix_namespace=prefix_namespace,
        )
        super().__init__(config, options, dtype, device, placement)

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
