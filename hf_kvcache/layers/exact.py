"""Tokens a quantized pool's layers keep in full precision beside their codes: the newest values
(``ResidualValues``, the residual window) and the first tokens' keys and values (``ExactSink``, attention sinks)."""

from typing import Any

import torch


class ResidualValues:
    """Full-precision values of the newest ``length`` tokens of every row, for each layer of a layer group.

    Token ``t`` of a row sits in slot ``t % length`` of its layer's ``[batch, heads, length, head_dim]`` buffer.
    Tokens from ``first`` on are held (older ones only as codes, e.g. after a ``crop``). A step's plan says once, for
    all its layers, which slots it writes (``slots``) and where attention reads the held tokens (``reads``,
    ``tokens``).
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self.first = 0
        self.buffers: dict[int, torch.Tensor] = {}

    def slots(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """The slots the newest of tokens ``[start, end)`` go to, ``[min(end - start, length)]``."""
        return torch.tensor([token % self.length for token in range(max(start, end - self.length), end)], device=device)

    def tokens(self, newest: int, low: int = 0, high: int | None = None) -> list[int]:
        """The token each slot holds once ``newest`` tokens are written, ``-1`` where it holds none in ``[low,
        high)`` (default: up to ``newest``)."""
        high = newest if high is None else high
        held_from = max(self.first, newest - self.length, low)
        tokens = [newest - 1 - (newest - 1 - slot) % self.length for slot in range(self.length)]
        return [token if held_from <= token < high else -1 for token in tokens]

    def reads(
        self, newest: int, low: int, high: int, offset: int, device: torch.device, fallback: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where attention gets the held tokens ``[low, high)`` once ``newest`` are written: ``(sources, positions)``,
        ``[length]`` each: slot ``sources[i]``'s values go over position ``positions[i]`` of what attention reads
        (position ``p`` holding token ``p + offset``). A fixed count, so one compiled graph serves every step: a slot
        holding none of those tokens repeats ``fallback``'s (default: the newest of them). ``None``: there is none."""
        tokens = self.tokens(newest, low, high)
        if fallback is None:
            fallback = max(tokens)
            if fallback < 0:
                return None
        sources = [slot if token >= 0 else fallback % self.length for slot, token in enumerate(tokens)]
        positions = [(token if token >= 0 else fallback) - offset for token in tokens]
        return torch.tensor(sources, device=device), torch.tensor(positions, device=device)

    def write(self, layer_in_group: int, value_states: torch.Tensor, slots: torch.Tensor) -> None:
        """Keeps the newest of a step's tokens, given as ``[batch, heads, n, head_dim]`` states, in ``slots``
        (``ResidualValues.slots``; the step's plan moved ``first`` on: ``SlotStore.plan_window``)."""
        batch, heads, num_new, head_dim = value_states.shape
        buffer = self.buffers.get(layer_in_group)
        if buffer is None or buffer.shape[0] != batch:
            buffer = self.buffers[layer_in_group] = value_states.new_zeros(batch, heads, self.length, head_dim)
        keep = slots.shape[0]
        newest = value_states if keep == num_new else value_states[:, :, num_new - keep :]  # no op for a decode step
        buffer.index_copy_(2, slots, newest)

    def overlay(self, layer_in_group: int, values: torch.Tensor, reads: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Puts the held tokens over their positions in ``values`` ``[batch, heads, n, head_dim]`` as ``reads``
        says (``ResidualValues.reads``)."""
        buffer = self.buffers.get(layer_in_group)
        if buffer is not None:
            values.index_copy_(2, reads[1], buffer.index_select(2, reads[0]).to(values.dtype))  # autocast may widen

    def take_all(self, slots: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Every layer's tokens held in ``slots`` at once: ``(layers, [layers, batch, heads, n, head_dim])``, three
        ops for the layer group."""
        layers = sorted(self.buffers)
        windows = torch.stack([self.buffers[layer] for layer in layers])  # [layers, batch, heads, length, head_dim]
        return layers, windows.index_select(3, slots)

    def select_rows(self, indices: list[int]) -> None:
        for layer_in_group, buffer in self.buffers.items():
            self.buffers[layer_in_group] = buffer[torch.tensor(indices, device=buffer.device)]

    def crop(self, num_tokens: int) -> None:
        self.first = min(self.first, num_tokens)

    def release(self) -> None:
        self.buffers.clear()
        self.first = 0


class ExactSink:
    """Full-precision keys and values of the first ``length`` tokens of every row, for each layer of a layer group.

    Attention sinks: the first tokens draw much of every query's attention, so their coding error weighs on every
    step (IntactKV); attention reads them exact over their codes (which the pool still holds). Rows that keep every
    page only (token ``t`` at position ``t`` of what they read); a row's leading padding counts as its first tokens.
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self.keys: dict[int, torch.Tensor] = {}  # layer_in_group -> [batch, heads, length, head_dim]
        self.values: dict[int, torch.Tensor] = {}

    def write(self, layer_in_group: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Keeps those of tokens ``[start, start + n)`` that are among the first ``length``, ``[batch, heads, n,
        head_dim]`` states."""
        if start >= self.length:
            return
        batch, heads, num_new, head_dim = key_states.shape
        if start == 0 or layer_in_group not in self.keys or self.keys[layer_in_group].shape[0] != batch:
            self.keys[layer_in_group] = key_states.new_zeros(batch, heads, self.length, head_dim)
            self.values[layer_in_group] = value_states.new_zeros(batch, heads, self.length, value_states.shape[-1])
        count = min(num_new, self.length - start)
        self.keys[layer_in_group][:, :, start : start + count] = key_states[:, :, :count]
        self.values[layer_in_group][:, :, start : start + count] = value_states[:, :, :count]

    def overlay(self, layer_in_group: int, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        """Puts the held tokens over the first positions of ``keys`` / ``values`` ``[batch, heads, n, head_dim]``
        (tokens in order from 0; ``None``: full precision already). Past the tokens written, the model's mask hides
        what it puts."""
        if layer_in_group not in self.keys:
            return
        for out, held in ((keys, self.keys), (values, self.values)):
            if out is not None:
                count = min(self.length, out.shape[2])
                out[:, :, :count] = held[layer_in_group][:, :, :count]

    def plan(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Before a planned step at ``start``: ``(sink_write [1], sink_writes [1, 1, 1, 1])``, where the step's token
        goes in the sink and whether it is one of the first ``length`` (``StepPlan``). The rows' first step wrote
        the sink (a prefix reused from the index, whose first tokens are codes only, is refused to quantized keys)."""
        if not self.keys:
            raise RuntimeError("A planned step needs the exact sink its rows' first step wrote; this cache has none.")
        write = torch.tensor([min(start, self.length - 1)], device=next(iter(self.keys.values())).device)
        return write, torch.tensor(start < self.length, device=write.device).view(1, 1, 1, 1)

    def write_planned(self, layer_in_group: int, plan: Any, key_states: torch.Tensor, values: torch.Tensor) -> None:
        """A planned step's ``[batch, heads, 1, head_dim]`` states to the sink where its token is among the first."""
        for held, states in ((self.keys, key_states), (self.values, values)):
            buffer = held[layer_in_group]
            kept = buffer.index_select(2, plan.sink_write)
            buffer.index_copy_(2, plan.sink_write, torch.where(plan.sink_writes, states.to(buffer.dtype), kept))

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for held in (self.keys, self.values) for t in held.values())

    def select_rows(self, indices: list[int]) -> None:
        for held in (self.keys, self.values):
            for layer_in_group, tensor in held.items():
                held[layer_in_group] = tensor[torch.tensor(indices, device=tensor.device)]

    def release(self) -> None:
        self.keys.clear()
        self.values.clear()
