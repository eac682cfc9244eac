"""Identical rows of a prefill (a batch of one prompt repeated, as ``num_return_sequences`` makes): found once, so
that their pages are shared, and split again where a layer's states turn out to differ."""

import torch


def find_identical_rows(key_states: torch.Tensor, value_states: torch.Tensor) -> list[int] | None:
    """For each row, the first row with identical keys and values (``None`` if all rows differ).

    Args:
        key_states / value_states: ``[batch, heads, seq_len, head_dim]``.
    """
    batch = key_states.shape[0]
    if batch == 1:
        return None
    signature = (key_states.flatten(1).sum(1) + value_states.flatten(1).sum(1)).tolist()  # [batch]
    firsts = list(range(batch))
    for row in range(1, batch):
        for first in range(row):
            if (
                firsts[first] == first
                and signature[first] == signature[row]
                and torch.equal(key_states[first], key_states[row])
                and torch.equal(value_states[first], value_states[row])
            ):
                firsts[row] = first
                break
    return firsts if firsts != list(range(batch)) else None
