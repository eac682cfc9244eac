"""What a layer hands attention with its keys, beyond the tensors: how to read them where they lie.

A cache's ``update`` returns keys and values as transformers expects; a layer that returns the pool's storage in
place, or a ring's keys out of time order, says so here, on the keys it returns (``paged_read_of``, ``layout_of``),
and ``hf_kvcache.attention.interface`` reads it back. Attention functions get no handle on the cache, so the
returned keys carry it.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_kvcache.attention.block_mask import PagedBlockMask

PAGED_ATTRIBUTE = "hf_kvcache_paged"


@dataclass(frozen=True)
class PagedRead:
    """What attention needs to read one layer's keys and values where they lie (handed over on the keys).

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


def paged_read_of(keys: torch.Tensor) -> PagedRead | None:
    """The ``PagedRead`` a paged layer attached to the keys it returned (``None``: the keys are gathered)."""
    return getattr(keys, PAGED_ATTRIBUTE, None)


LAYOUT_ATTRIBUTE = "hf_kvcache_layout"


@dataclass(frozen=True)
class KeyLayout:
    """What attention must know of the keys a ring returned, beyond the model's mask.

    Attributes:
        band: ``[batch, num_new, num_keys]``, true where a new token of a row may see a key (causality, window and
            the row's sinks; false for a slot that holds no token the step may see).
        mask_columns: ``[batch, num_keys]``, the column of the model's mask (built for the visible tokens in time
            order) that applies to each key of a row; ``None`` when the keys come in that order.
    """

    band: torch.Tensor
    mask_columns: torch.Tensor | None = None


def layout_of(keys: torch.Tensor) -> KeyLayout | None:
    """The layout a ring attached to the keys it returned (``None``: attend as the model's mask says)."""
    return getattr(keys, LAYOUT_ATTRIBUTE, None)
