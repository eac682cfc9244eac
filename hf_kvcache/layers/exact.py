"""Tokens a quantized pool's layers keep in full precision beside their codes: the newest values (``ResidualValues``)
and the first tokens' keys and values (``ExactSink``). One row's share of them at a page boundary is an
``ExactTail``, kept beside that page in the prefix index so that rows reusing the prefix continue as its writers would.
"""

from dataclasses import dataclass
from typing import Any

import torch

Tensors = dict[int, torch.Tensor]
"""layer_in_group -> a tensor."""


@dataclass(frozen=True, eq=False)
class ExactTail:
    """What one row of a layer group holds in full precision once its first ``end`` tokens (whole pages) are written:
    per layer, ``[heads, n, head_dim]``, the residual window's tokens ``[end - r, end)`` (``values``, ``r = min(end,
    residual_length)``) and the exact sink's ``[0, s)`` (``sink_keys``, ``sink_values``, ``s = min(end, sink length)``).
    """

    end: int
    values: Tensors
    sink_keys: Tensors
    sink_values: Tensors

    def covers(self, residual_length: int, sink_length: int) -> bool:
        """Whether it holds what rows of this residual window and sink hold at ``end`` (a longer one serves too)."""
        return all(
            not min(self.end, length) or bool(held) and all(t.shape[1] >= min(self.end, length) for t in held.values())
            for held, length in ((self.values, residual_length), (self.sink_keys, sink_length))
        )

    @property
    def nbytes(self) -> int:
        """The bytes it holds (``stats()``'s ``prefix_tail_bytes``)."""
        held = (*self.values.values(), *self.sink_keys.values(), *self.sink_values.values())
        return sum(tensor.numel() * tensor.element_size() for tensor in held)

    def to_tensors(self) -> tuple[torch.Tensor, ...]:
        """Host tensors for a pool's tiers (``from_tensors``): a header (``end``, the counts and ids of the layers of
        values and of the sink), then the values, the sink's keys and its values."""
        header = torch.tensor([self.end, len(self.values), len(self.sink_keys), *self.values, *self.sink_keys])
        held = (*self.values.values(), *self.sink_keys.values(), *self.sink_values.values())
        return header, *(tensor.cpu() for tensor in held)

    @classmethod
    def from_tensors(cls, tensors: tuple[torch.Tensor, ...], device: torch.device) -> "ExactTail | None":
        """The tail ``to_tensors`` gave, on ``device``; ``None`` if the tensors are not one."""
        header = tensors[0].tolist() if tensors and tensors[0].ndim == 1 and tensors[0].numel() >= 3 else [0, -1, 0]
        end, num_values, num_sinks = header[:3]
        layers = header[3:]
        if num_values < 0 or num_sinks < 0 or len(layers) != num_values + num_sinks:
            return None
        if len(tensors) != 1 + num_values + 2 * num_sinks or any(tensor.ndim != 3 for tensor in tensors[1:]):
            return None
        held = [tensor.to(device) for tensor in tensors[1:]]
        values = dict(zip(layers[:num_values], held[:num_values]))
        sink_keys = dict(zip(layers[num_values:], held[num_values : num_values + num_sinks]))
        return cls(end, values, sink_keys, dict(zip(layers[num_values:], held[num_values + num_sinks :])))


def split_tail(end: int, values: Tensors, sink_keys: Tensors, sink_values: Tensors) -> list[ExactTail]:
    """Each row's ``ExactTail`` of a batch's ``[batch, heads, n, head_dim]`` tensors (copies: a row's outlives the
    others)."""
    batch = next(iter((*values.values(), *sink_keys.values()))).shape[0]

    def row_of(held: Tensors, row: int) -> Tensors:
        return {layer: tensor[row].clone() for layer, tensor in held.items()}

    return [
        ExactTail(end, row_of(values, row), row_of(sink_keys, row), row_of(sink_values, row)) for row in range(batch)
    ]


def stack_tails(tails: list[ExactTail], residual_length: int, sink_length: int) -> tuple[Tensors, Tensors, Tensors]:
    """The rows' ``tails`` (each ``covers`` these lengths) as a batch: ``(values, sink_keys, sink_values)``, ``[batch,
    heads, n, head_dim]`` each, cut to these lengths."""
    end = tails[0].end
    count, sinks = min(end, residual_length), min(end, sink_length)

    def stacked(name: str, cut: slice) -> Tensors:
        layers = getattr(tails[0], name)
        return {layer: torch.stack([getattr(tail, name)[layer][:, cut] for tail in tails]) for layer in layers}

    values = stacked("values", slice(-count, None)) if count else {}
    return values, *((stacked(name, slice(0, sinks)) if sinks else {}) for name in ("sink_keys", "sink_values"))


class ResidualValues:
    """Full-precision values of the newest ``length`` tokens of every row, for each layer of a layer group.

    Token ``t`` of a row sits in slot ``t % length`` of its layer's ``[batch, heads, length, head_dim]`` buffer.
    Tokens from ``first`` on are held (older ones only as codes, e.g. after a ``crop``).
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
        self, newest: int, low: int, high: int, offset: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(sources, positions)``, ``[length]`` each: slot ``sources[i]`` goes over position ``positions[i]`` (token
        ``positions[i] + offset``) of what attention reads, for the held tokens ``[low, high)`` once ``newest`` are
        written (``None``: none). A fixed count, for one graph over every step: a slot holding none repeats the
        newest."""
        tokens = self.tokens(newest, low, high)
        fallback = max(tokens)
        if fallback < 0:
            return None
        sources = [slot if token >= 0 else fallback % self.length for slot, token in enumerate(tokens)]
        positions = [(token if token >= 0 else fallback) - offset for token in tokens]
        return torch.tensor(sources, device=device), torch.tensor(positions, device=device)

    def write(self, layer_in_group: int, value_states: torch.Tensor, slots: torch.Tensor) -> None:
        """Keeps the newest of a step's ``[batch, heads, n, head_dim]`` values in ``slots`` (from ``slots()``)."""
        batch, heads, num_new, head_dim = value_states.shape
        buffer = self.buffers.get(layer_in_group)
        if buffer is None or buffer.shape[0] != batch:
            buffer = self.buffers[layer_in_group] = value_states.new_zeros(batch, heads, self.length, head_dim)
        keep = slots.shape[0]
        newest = value_states if keep == num_new else value_states[:, :, num_new - keep :]  # no op for a decode step
        buffer.index_copy_(2, slots, newest)

    def overlay(self, layer_in_group: int, values: torch.Tensor, reads: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Puts the held tokens over their positions in ``values [batch, heads, n, head_dim]`` (``reads``)."""
        buffer = self.buffers.get(layer_in_group)
        if buffer is not None:
            values.index_copy_(2, reads[1], buffer.index_select(2, reads[0]).to(values.dtype))  # autocast may widen

    def capture(self, layer_in_group: int, start: int, value_states: torch.Tensor, end: int) -> torch.Tensor:
        """A copy of tokens ``[end - r, end)`` (``r = min(end, length)``) of a step writing ``value_states [batch,
        heads, n, head_dim]`` at ``start`` (``start < end <= start + n``), taken before it writes them."""
        low = end - min(end, self.length)
        step = value_states[:, :, max(low, start) - start : end - start]
        if low >= start:
            return step.clone()
        slots = torch.tensor([token % self.length for token in range(low, start)], device=value_states.device)
        return torch.cat([self.buffers[layer_in_group].index_select(2, slots).to(step.dtype), step], dim=2)

    def restore(self, end: int, values: dict[int, torch.Tensor]) -> None:
        """Holds ``values [batch, heads, r, head_dim]`` per layer, tokens ``[end - r, end)`` (``capture``)."""
        low = end - min(end, self.length)
        for layer_in_group, held in values.items():
            batch, heads, _, head_dim = held.shape
            buffer = self.buffers[layer_in_group] = held.new_zeros(batch, heads, self.length, head_dim)
            slots = torch.tensor([token % self.length for token in range(low, end)], device=held.device)
            buffer.index_copy_(2, slots, held)
        self.first = low

    def take_all(self, slots: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Every layer's tokens in ``slots``: ``(layers, [layers, batch, heads, n, head_dim])``, in three ops."""
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

    The first tokens draw much of every query's attention, so their coding error weighs on every step (IntactKV):
    attention reads them exact over their codes. Rows that keep every page only; leading padding counts as tokens.
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self.keys: dict[int, torch.Tensor] = {}  # layer_in_group -> [batch, heads, length, head_dim]
        self.values: dict[int, torch.Tensor] = {}

    def write(self, layer_in_group: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Keeps those of tokens ``[start, start + n)`` (``[batch, heads, n, head_dim]``) among the first ``length``."""
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
        (``None``: full precision already); the model's mask hides those past the tokens written."""
        if layer_in_group not in self.keys:
            return
        for out, held in ((keys, self.keys), (values, self.values)):
            if out is not None:
                count = min(self.length, out.shape[2])
                out[:, :, :count] = held[layer_in_group][:, :, :count]

    def capture(self, layer_in_group: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of tokens ``[0, min(end, length))``, ``[batch, heads, s, head_dim]``."""
        count = min(end, self.length)
        return self.keys[layer_in_group][:, :, :count].clone(), self.values[layer_in_group][:, :, :count].clone()

    def restore(self, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor]) -> None:
        """Holds the first tokens' ``keys`` and ``values`` ``[batch, heads, s, head_dim]`` per layer (``capture``)."""
        self.release()
        for layer_in_group, held_keys in keys.items():
            held_values = values[layer_in_group]
            batch, heads, count, head_dim = held_keys.shape
            self.keys[layer_in_group] = held_keys.new_zeros(batch, heads, self.length, head_dim)
            self.values[layer_in_group] = held_values.new_zeros(batch, heads, self.length, held_values.shape[-1])
            self.keys[layer_in_group][:, :, :count] = held_keys
            self.values[layer_in_group][:, :, :count] = held_values

    def plan(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sink_write [1], sink_writes [1, 1, 1, 1])`` of a planned step at ``start`` (``StepPlan``); the rows'
        first step or their reused prefix wrote the sink."""
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
