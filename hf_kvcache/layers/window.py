"""The ring's arithmetic (``hf_kvcache.layers.ring`` tells the whole layout): which keys a step's tokens may see
(``band``, ``visible_span``), how many slots a ring holds (``ring_num_slots``), and a step's slot indices
(``RingStep``)."""

import math
from dataclasses import dataclass

import torch

from hf_kvcache.attention.reads import KeyLayout


def band(
    tokens: torch.Tensor,
    start: int,
    num_new: int,
    window: int,
    sink_tokens: int,
    pad_lengths: torch.Tensor,
    step_sees_itself: bool = False,
) -> torch.Tensor:
    """``[batch, num_new, n]``: may new token ``start + i`` of row ``b`` see token ``tokens[b, j]``?

    A row sees its window and its own sinks (its first ``sink_tokens`` real tokens), never padding; ``-1`` in
    ``tokens`` marks a slot that holds no token. A padding query is left to the model's mask.

    Args:
        tokens: ``[batch, n]`` the token each key holds.
        pad_lengths: ``[batch]`` leading padding tokens of each row.
        step_sees_itself: each new token sees the step's earlier tokens and the ``window - 1`` tokens before the step
            (what transformers' sliding layer returns: the model's own mask applies its window among them), rather
            than only the ``window`` tokens up to itself.
    """
    query = torch.arange(start, start + num_new, device=tokens.device).view(1, -1, 1)  # [1, num_new, 1]
    keys = tokens.unsqueeze(1)  # [batch, 1, n]
    pads = pad_lengths.view(-1, 1, 1)  # [batch, 1, 1]
    reach = start if step_sees_itself else query  # the token whose window bounds what a new token sees
    seen = (keys <= query) & ((keys > reach - window) | (keys - pads < sink_tokens))
    return (seen & (keys >= pads)) | (query < pads)


def visible_span(start: int, num_new: int, window: int, sink_tokens: int) -> tuple[int, int]:
    """``(num_sinks, first)``: attention sees tokens ``[0, num_sinks)`` and ``[first, start + num_new)``."""
    first = max(0, start - window + 1)
    if first <= sink_tokens:  # the window reaches back to the sinks: one contiguous span
        return 0, 0
    return sink_tokens, first


def ring_num_slots(window: int, sink_tokens: int, page_size: int) -> int:
    """Logical slots of one row of a ring: the sinks plus the window, rounded up to whole pages, plus a spare page."""
    return page_size * (math.ceil((sink_tokens + window - 1) / page_size) + 1)


@dataclass(frozen=True)
class RingStep:
    """Where one step's tokens ``[start, start + num_new)`` are written and read, in every layer of a layer group.

    Built by the layer group's first layer of the step and reused by the others. A step either reads the rows'
    pages in place (``write_slots`` set; attention gets every slot in slot order, as ``layout`` says) or gathers
    the visible tokens in time order (``write_index`` and ``read`` set). Every new token is written; those a row
    keeps nowhere (its padding, and in a step longer than the ring the tokens it overwrites itself, between the
    row's sinks and its last ``ring_slots`` tokens) go to the null page.

    Attributes:
        start / num_new: the step's first token and its number of new tokens.
        layout: what attention must know beyond the model's mask; ``None`` for a single new token read in time
            order (it sees every key).
        write_slots: in place only: ``[batch * heads * num_new]`` the slot indices (``kernels.slot_indices``) the
            new states go to, in ``(batch, head, token)`` order.
        write_index: gathered only: ``[batch, heads, num_new]`` the new tokens' slot indices (``kernels.slot_indices``).
        read: gathered only: ``[batch * heads * n]`` the visible tokens' slot indices, in time order (flattened
            ``[batch, heads, n]``: ``kernels.read_slots``).
        read_slots: gathered only: ``[batch, n]`` their logical slots (``-1``: none), for keys decoded a page at a time.
    """

    start: int
    num_new: int
    layout: KeyLayout | None
    write_slots: torch.Tensor | None = None
    write_index: torch.Tensor | None = None
    read: torch.Tensor | None = None
    read_slots: torch.Tensor | None = None

    @property
    def in_place(self) -> bool:
        """Attention reads the rows' pages themselves, in slot order."""
        return self.write_slots is not None
