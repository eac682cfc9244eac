"""What a layer hands attention beyond the keys and values: how to read them where they lie.

transformers hands an attention layer's keyword arguments to the cache (``cache.update(..., kwargs=kwargs)``) and
then to the attention function (``attention_interface(..., **kwargs)``), the same dict. A layer that returns the
pool's storage in place (``PagedRead``), or a ring's keys out of time order or with a band (``KeyLayout``), puts
what attention must know into that dict under ``PAGED_READ`` / ``KEY_LAYOUT``; ``hf_kvcache.attention.interface``
takes it out. Where a model's attention hands the cache no kwargs (``attention_kwargs`` is ``None``), its layers
return their keys and values gathered in time order, which any attention reads as they are.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvcache.attention.block_mask import PagedBlockMask

PAGED_READ = "hf_kvcache_paged_read"
"""The attention kwarg that carries a ``PagedRead``."""
KEY_LAYOUT = "hf_kvcache_key_layout"
"""The attention kwarg that carries a ``KeyLayout``."""


def attention_kwargs(update_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The attention's keyword arguments that a cache layer's ``update`` got from transformers (``kwargs=``), where
    a layer hands attention its ``PagedRead`` or ``KeyLayout``; ``None`` where the model passed none."""
    handed = update_kwargs.get("kwargs")
    return handed if isinstance(handed, dict) else None


@dataclass(frozen=True)
class PagedRead:
    """What attention needs to read one layer's keys and values where they lie (``PAGED_READ``).

    Attributes:
        mask: the step's mask over the pool's storage (one decode token per row).
        pads: ``[batch]`` leading padding tokens of each row, which the mask hides.
        num_tokens: tokens per row, the step's new one included.
        gather: the same keys and values gathered, ``[batch, heads, num_tokens, head_dim]`` (the slow twin, for a
            step attention cannot read in place after all).
    """

    mask: PagedBlockMask
    pads: torch.Tensor
    num_tokens: int
    gather: Callable[[], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KeyLayout:
    """What attention must know of the keys a ring returned, beyond the model's mask (``KEY_LAYOUT``).

    Attributes:
        band: ``[batch, num_new, num_keys]``, true where a new token of a row may see a key (causality, window and
            the row's sinks; false for a slot that holds no token the step may see).
        mask_columns: ``[batch, num_keys]``, the column of the model's mask (built for the visible tokens in time
            order) that applies to each key of a row; ``None`` when the keys come in that order.
    """

    band: torch.Tensor
    mask_columns: torch.Tensor | None = None
