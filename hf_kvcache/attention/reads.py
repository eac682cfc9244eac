"""What a layer hands attention beyond the keys and values: how to read them where they lie.

transformers passes an attention layer's kwargs to the cache (``update(..., kwargs=kwargs)``), then to the attention
function, the same dict: a layer puts a ``PagedRead`` or a window's ``KeyLayout`` there (``PAGED_READ`` /
``KEY_LAYOUT``). Where a model passes none, layers return keys and values gathered in time order.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvcache.attention.block_mask import PagedBlockMask

PAGED_READ = "hf_kvcache_paged_read"
KEY_LAYOUT = "hf_kvcache_key_layout"


def attention_kwargs(update_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The attention's kwargs a cache layer's ``update`` got from transformers (``kwargs=``); ``None`` where the model
    passed none."""
    handed = update_kwargs.get("kwargs")
    return handed if isinstance(handed, dict) else None


@dataclass(frozen=True)
class PagedRead:
    """What attention needs to read one layer's keys and values where they lie (``PAGED_READ``).

    Attributes:
        mask: the step's mask over the pool's storage (one decode token per row).
        pads: ``[batch]`` leading padding tokens of each row, which the mask hides.
        num_tokens: keys per row the model's mask is built for (``get_mask_sizes``), the step's new one included.
        gather: the same keys and values gathered, ``[batch, heads, num_tokens, head_dim]`` (the slow twin, for a
            step attention cannot read in place after all).
        kv_offset: the token of the mask's first column (a window's first visible token; ``get_mask_sizes``).
    """

    mask: PagedBlockMask
    pads: torch.Tensor
    num_tokens: int
    gather: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    kv_offset: int = 0


@dataclass(frozen=True)
class KeyLayout:
    """What attention must know of the keys a window returned, beyond the model's mask (``KEY_LAYOUT``): its ``band``
    ``[batch, num_new, num_keys]``, true where a new token of a row may see a key (causality, window, the row's sinks).
    """

    band: torch.Tensor
