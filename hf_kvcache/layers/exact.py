"""Tokens a quantized pool's layers keep in full precision beside their codes: the newest values
(``ResidualValues``, the residual window) and the first tokens' keys and values (``ExactSink``, attention sinks)."""

from typing import Any

import torch


class ResidualValues:
    """Full-precision values of the newest ``length`` tokens of every row, for each layer of a layer group.

    Token ``t`` of a row sits at index ``t % length`` of its layer's ``[batch, heads, length, head_dim]``
    buffer. Tokens from ``first`` on are held (older ones only as codes, e.g. after a ``crop``).
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self.first = 0
        self.buffers: dict[int, torch.Tensor] = {}
        self._kept: dict[tuple[int, int], torch.Tensor] = {}  # _positions of a step's write and read
        self._last: tuple[tuple[int, int], torch.Tensor] | None = None  # the last positions of a step's read

    def write(self, layer_in_group: int, start: int, value_states: torch.Tensor) -> None:
        """Keeps the newest of tokens ``[start, start + n)``, given as ``[batch, heads, n, head_dim]`` states."""
        batch, heads, num_new, head_dim = value_states.shape
        buffer = self.buffers.get(layer_in_group)
        if buffer is None or buffer.shape[0] != batch:
            buffer = self.buffers[layer_in_group] = value_states.new_zeros(batch, heads, self.length, head_dim)
        if start == 0:
            self.first = 0
        keep = min(num_new, self.length)
        end = start + num_new
        newest = value_states if keep == num_new else value_states[:, :, num_new - keep :]  # no op for a decode step
        buffer.index_copy_(2, self._positions(end - keep, end, buffer.device), newest)
        self.first = max(self.first, end - self.length)

    def overlay(self, layer_in_group: int, values: torch.Tensor, end: int, limit: int, newest: int) -> None:
        """Puts the held full-precision values over the last positions of ``values``.

        Args:
            values: ``[batch, heads, m, head_dim]`` whose last position is token ``end - 1``.
            limit: at most this many positions are replaced (the tokens ``values`` holds in order).
            newest: tokens written so far; the residual window is ``[newest - length, newest)``.
        """
        count = min(end - max(self.first, newest - self.length), limit)
        if count <= 0 or layer_in_group not in self.buffers:
            return
        newest_values = self.buffers[layer_in_group].index_select(2, self._positions(end - count, end, values.device))
        length = values.shape[2]
        if self._last is None or self._last[0] != (length, count):  # once for a step's layers
            self._last = ((length, count), torch.arange(length - count, length, device=values.device))
        values.index_copy_(2, self._last[1], newest_values.to(values.dtype))  # autocast may widen the read

    def _positions(self, first: int, end: int, device: torch.device) -> torch.Tensor:
        """Where tokens ``[first, end)`` lie in the buffers, ``[end - first]``. The two last asked are kept: a step's
        layers ask for its write's and its read's."""
        kept = self._kept.get((first, end))
        if kept is None:
            kept = torch.arange(first, end, device=device) % self.length
            self._kept = {**dict(list(self._kept.items())[-1:]), (first, end): kept}
        return kept

    def take_all(self, first: int, end: int) -> tuple[list[int], torch.Tensor]:
        """Every layer's held tokens ``[first, end)`` at once (all within the window): ``(layers, [layers, batch,
        heads, end - first, head_dim])``, three ops for the layer group."""
        layers = sorted(self.buffers)
        windows = torch.stack([self.buffers[layer] for layer in layers])  # [layers, batch, heads, length, head_dim]
        return layers, windows.index_select(3, self._positions(first, end, windows.device))

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

    def overlay(self, layer_in_group: int, keys: torch.Tensor | None, values: torch.Tensor | None, end: int) -> None:
        """Puts the held tokens over the first positions of ``keys`` / ``values`` ``[batch, heads, n, head_dim]``
        (tokens in order from 0, ``end`` of them written)."""
        count = min(self.length, end)
        if not count or layer_in_group not in self.keys:
            return
        for out, held in ((keys, self.keys), (values, self.values)):
            if out is not None:
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

    def overlay_planned(self, layer_in_group: int, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        """A planned step's read: the sink over the first positions of ``keys`` and ``values`` ``[batch, heads, n,
        head_dim]`` (``None``: full precision already; past the tokens written, the mask hides what it puts)."""
        for out, held in ((keys, self.keys), (values, self.values)):
            if out is not None:
                count = min(self.length, out.shape[2])
                out[:, :, :count] = held[layer_in_group][:, :, :count]

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
