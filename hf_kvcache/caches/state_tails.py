"""Prompt reuse on a hybrid model: its state layers' states kept at page boundaries (``StateTail``).

A linear-attention or convolution state exists only where a forward pass ends, so the boundaries a later call is
likely to start from end a pass of the prefill (``PrefixTracker.pass_ends``); the states there are copied, one
``StateTail`` per row, kept beside the index entry of the boundary's page (layer group ``STATE_GROUP``) as an
``ExactTail`` is, and restored into the rows of a lookup that reuses the prefix (``StateTails.attach``).
"""

from dataclasses import dataclass
from typing import Any

import torch

StateKey = tuple[int, int, int]
"""``(layer index, kind: 0 conv / 1 recurrent, state index)``."""
CONV, RECURRENT = 0, 1


@dataclass(frozen=True, eq=False)
class StateTail:
    """One row's states of every state layer once its first ``end`` tokens (whole pages) are written: ``StateKey`` ->
    the row's tensor without its batch dimension (a conv state ``[channels, kernel]``, a recurrent state ``[heads,
    key_dim, value_dim]``)."""

    end: int
    states: dict[StateKey, torch.Tensor]

    def covers(self, *lengths: int) -> bool:
        """Whether it holds what the rows need (``ExactTail.covers``'s question): every state it has is whole."""
        return bool(self.states)

    @property
    def nbytes(self) -> int:
        """The bytes it holds (``stats()``'s ``prefix_tail_bytes``)."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.states.values())

    def to_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tail as host tensors for a pool's tiers: a header (``end``, the count and keys of states), the states."""
        header = torch.tensor([self.end, len(self.states), *(part for key in self.states for part in key)])
        return header, *(tensor.cpu() for tensor in self.states.values())

    @classmethod
    def from_tensors(cls, tensors: tuple[torch.Tensor, ...], device: torch.device) -> "StateTail | None":
        """The tail ``to_tensors`` gave, on ``device``; ``None`` if the tensors are not one."""
        header = tensors[0].tolist() if tensors and tensors[0].ndim == 1 and tensors[0].numel() >= 2 else [0, -1]
        end, count = header[:2]
        parts = header[2:]
        if count <= 0 or len(parts) != 3 * count or len(tensors) != 1 + count:
            return None
        keys = [tuple(parts[3 * i : 3 * i + 3]) for i in range(count)]
        if any(kind not in (CONV, RECURRENT) for _, kind, _ in keys):
            return None
        return cls(end, {key: tensor.to(device) for key, tensor in zip(keys, tensors[1:])})


class StateTails:
    """The state copies a cache's state layers keep for prompt reuse: at the boundaries asked for (``captures``)
    until the tracker takes them (``take_tails``), and at the newest page boundary decoding reached
    (``keeps_newest``); ``attach`` restores a reused prefix's. Its protocol is ``SlotStore``'s for ``ExactTail``s.

    Args:
        layers: the ``StateLayers`` (its ``layers`` change when it is released).
    """

    keeps_exact = True  # a reused prefix must bring the states
    exact_lengths = (0, 0)

    def __init__(self, layers: Any) -> None:
        self._layers = layers
        self.captures: list[int] = []  # page boundaries whose states a pass ending there keeps
        self.keeps_newest = False
        self._newest: int | None = None
        self._captured: dict[int, dict[StateKey, torch.Tensor]] = {}  # boundary -> [batch, ...] copies

    def capture(self, num_tokens: int, page_size: int) -> None:
        """Before a forward pass, the rows' first ``num_tokens`` tokens written: copies the states if ``num_tokens`` is
        a boundary asked for or the newest page boundary (``keeps_newest``); none while layers record their past."""
        newest = self.keeps_newest and num_tokens and num_tokens % page_size == 0
        if not (num_tokens in self.captures or newest) or num_tokens in self._captured:
            return
        states = self._states()
        if states is None:
            return
        if newest and num_tokens not in self.captures:
            self._captured.pop(self._newest, None)  # the one before: a later turn starts from the newest
            self._newest = num_tokens
        self._captured[num_tokens] = {key: tensor.clone() for key, tensor in states.items()}

    def _states(self) -> dict[StateKey, torch.Tensor] | None:
        """Every state the layers hold, ``[batch, ...]`` each; ``None`` if a layer records its past or holds none."""
        states: dict[StateKey, torch.Tensor] = {}
        for layer_idx, layer in self._layers.layers.items():
            if layer.record_past or not any(layer.has_previous_state.values()):
                return None
            for idx in range(layer.number_of_states):
                if layer.is_conv_states_initialized[idx]:
                    states[layer_idx, CONV, idx] = layer.conv_states[idx]
                if layer.is_recurrent_states_initialized[idx]:
                    states[layer_idx, RECURRENT, idx] = layer.recurrent_states[idx]
        return states

    def take_tails(self, final: bool = False) -> list[list[StateTail]]:
        """Each row's ``StateTail`` at each boundary of ``captures`` copied since the last call, with ``final`` the
        newest boundary's too (``keeps_newest``), and forgets them."""
        taken = [end for end in self._captured if final or end in self.captures]
        self.captures = [end for end in self.captures if end not in taken]
        tails = []
        for end in taken:
            states = self._captured.pop(end)
            batch = next(iter(states.values())).shape[0]
            tails.append([StateTail(end, {key: t[row].clone() for key, t in states.items()}) for row in range(batch)])
        return tails

    def attach(self, num_tokens: int, tails: list[StateTail] | None = None) -> None:
        """The rows start from a reused prefix of ``num_tokens`` tokens: each row's states from its ``tails``, written
        through transformers' own updates into the cache's fresh layers."""
        for key in tails[0].states:
            layer_idx, kind, idx = key
            states = torch.stack([tail.states[key] for tail in tails])  # [batch, ...]
            layer = self._layers.layers[layer_idx]
            if kind == CONV:
                layer.update_conv_state(states, idx, conv_kernel_size=states.shape[-1])
            else:
                layer.update_recurrent_state(states, idx)

    def held(self) -> list[torch.Tensor]:
        """The copies not yet taken (``PoolCache.memory_stats``' ``state_bytes``)."""
        return [tensor for states in self._captured.values() for tensor in states.values()]

    def select_rows(self, indices: list[int]) -> None:
        """Row ``i`` of the copies not yet taken becomes old row ``indices[i]`` (beams, repeats)."""
        for states in self._captured.values():
            for key, tensor in states.items():
                states[key] = tensor[torch.tensor(indices, device=tensor.device)]

    def release(self) -> None:
        self.captures, self.keeps_newest, self._newest, self._captured = [], False, None, {}
