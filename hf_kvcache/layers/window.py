"""The ring's arithmetic (``hf_kvcache.layers.ring`` tells the whole layout): which keys a step's tokens may see
(``band``, ``visible_span``) and how many slots a ring holds (``ring_num_slots``)."""

import math

import torch


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
