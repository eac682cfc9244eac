"""``PagedCache``: every layer grows a page at a time on the shared pool."""

from typing import Any

import torch
from transformers import PreTrainedConfig

from hf_kvcache.caches.base import PoolCache
from hf_kvcache.config import DEFAULT_PAGE_SIZE, CacheOptions
from hf_kvcache.layers.paged import PagedLayer
from hf_kvcache.pool import KVPool


class PagedCache(PoolCache):
    """A drop-in for ``DynamicCache`` whose keys and values live in pages of a ``KVPool``.

    Sliding-window layers keep their whole history too (the model's mask applies the window).

    Args:
        config: the model's config.
        pool: a ``KVPool`` or a pool's name; ``None`` draws from the default pool of the model's
            geometry, dtype and device.
        page_size: token slots per page of a pool this cache makes (default or ``max_tokens``).
        max_tokens: give this cache a fixed-budget pool of its own for this many tokens.
        dtype / device: bind the pool at construction rather than at the first write.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        pool: KVPool | str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        max_tokens: int | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(config, CacheOptions(page_size, pool, max_tokens), dtype, device)

    def _make_layer(self, layer_idx: int, layer_type: str, layer_kwargs: dict[str, Any]) -> PagedLayer:
        return PagedLayer(layer_idx, self._binder)
