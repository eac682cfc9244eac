"""A layer group's keys and values between attention and the pool (``SlotStore``). With ``value_bits`` values are
quantized once, when stored (per-token scales), and dequantized for attention into reused buffers, the newest
``residual_length`` in full precision (``ResidualValues``); with ``key_bits`` keys are codes a page at a time.
"""

import math
from collections.abc import Callable
from typing import Any

import torch

from hf_kvcache.errors import IncompatibleModelError
from hf_kvcache.layers.exact import ExactSink, ExactTail, ResidualValues, split_tail, stack_tails
from hf_kvcache.layers.keys import KeyPages
from hf_kvcache.memory.dequant import dequantize_joined_into, spread_bytes
from hf_kvcache.memory.page_pool import PagePool
from hf_kvcache.memory.quant import dequantize, join_scales, quantize
from hf_kvcache.memory.storage import PoolStorage

MAX_RUNS = 4
"""Runs of consecutive extents that ``SlotStore.values_in_place`` dequantizes slice by slice (more: gathered)."""

Gather = Callable[[torch.Tensor], torch.Tensor]
"""Reads one layer's slots out of one storage tensor of the pool as ``[batch, heads, n, last_dim]``."""
Put = Callable[[torch.Tensor, torch.Tensor], None]
"""Writes ``[batch, heads, n, last_dim]`` states into one layer's slots of one storage tensor of the pool."""


def _detached(states: torch.Tensor) -> torch.Tensor:
    """The pool holds inference state: what it stores is cut from any autograd graph."""
    return states.detach() if states.requires_grad else states


def extent_runs(extents: list[int]) -> list[tuple[int, int]]:
    """Ascending ``extents`` as ``(first, end)`` runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for extent in extents:
        if runs and runs[-1][1] == extent:
            runs[-1] = (runs[-1][0], extent + 1)
        else:
            runs.append((extent, extent + 1))
    return runs


class SlotStore:
    """Writes and reads one layer group's slots in a pool.

    Args:
        pool: where the pages live.
        residual_length: newest tokens whose values attention gets in full precision (quantized values only).
        defers_codes: with a residual window, a one-token step's value codes are written for all layers at once,
            after the last (``code_step``).
        exact_tokens: first tokens of a row whose keys and values attention gets in full precision (``ExactSink``).
    """

    def __init__(
        self, pool: PagePool, residual_length: int = 0, defers_codes: bool = False, exact_tokens: int = 0
    ) -> None:
        self.pool = pool
        self.quant = pool.format.value_format
        self.residual = ResidualValues(residual_length) if self.quant is not None and residual_length else None
        self.defers_codes = defers_codes and self.residual is not None
        self._buffers: dict[str, torch.Tensor] = {}  # flat, reused for dequantized values (and float32 work)
        self._views: dict[str, tuple[tuple, torch.Tensor]] = {}  # name -> (shape, dtype, inference mode), its view
        self._spread_bytes: tuple[torch.Tensor, torch.Size, torch.Tensor] | None = None  # (spread, shape, as bytes)
        self.keys = KeyPages(pool.format, self._buffer) if pool.format.key_format is not None else None
        self.sink = ExactSink(exact_tokens) if exact_tokens and pool.format.encodes else None
        self.captures: list[int] = []  # page boundaries whose ExactTail the eager steps crossing them keep
        self.keeps_newest = False  # and the newest page boundary an eager step crosses (taken at the end only)
        self._newest: int | None = None
        self._captured: dict[int, tuple[dict, dict, dict]] = {}  # boundary -> (values, sink keys, sink values)

    def write(
        self,
        layer_in_group: int,
        storage: PoolStorage,
        put: Put,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        code_values: bool = True,
    ) -> None:
        """Stores new states ``[batch, heads, n, head_dim]`` (detached) into their slots with ``put``; not coded keys
        (``KeyPages.write``), nor quantized values with ``code_values=False`` (``code_step``)."""
        shared = storage.values is storage.keys  # values that are the keys: stored once, as the keys (no codes)
        if shared and value_states is not key_states:
            raise IncompatibleModelError(
                "The pool stores the keys as the values (PageFormat.values_are_keys: a model that writes one tensor "
                "as both, such as DeepSeek-V4), but this model writes other values: build the pool for this model "
                "(KVPool.for_model) or with values_are_keys=False."
            )
        key_states, value_states = _detached(key_states), _detached(value_states)
        if self.keys is None:
            put(storage.keys, key_states)
        if self.quant is None and not shared:
            put(storage.values, value_states)
        elif self.quant is not None and code_values:
            codes, scale, zero = quantize(value_states, self.quant)
            put(storage.values, codes)
            put(storage.value_scales, join_scales(scale, zero))

    def code_step(self, storage: PoolStorage, plan: "Any") -> None:
        """After a one-token step's last layer (``defers_codes``): every layer's token, from the residual windows,
        quantized once and stored at ``plan``'s slots (one quantization per step instead of one per layer)."""
        layers, values = self.residual.take_all(plan.window_write)  # [layers, batch, heads, 1, head_dim]
        codes, scale, zero = quantize(values, self.quant)
        layer_index = torch.tensor(layers, device=values.device).view(-1, 1, 1, 1)
        where = (layer_index, plan.heads, plan.write_pages, plan.write_offsets)  # -> [layers, batch, heads, 1]
        for tensor, part in ((storage.values, codes), (storage.value_scales, join_scales(scale, zero))):
            tensor.index_put_(where, part if part.dtype == tensor.dtype else part.to(tensor.dtype))

    def plan_window(self, plan: "Any", start: int, num_new: int, low: int = 0, offset: int = 0) -> None:
        """A step's ``StepPlan.window_write``, ``window_sources`` and ``window_positions`` for tokens ``[start,
        start + n)``: the window's tokens from ``low`` on, position ``p`` holding token ``p + offset``
        (``ResidualValues.reads``); a planned step's tensors are refilled in place."""
        residual = self.residual
        if residual is None:
            return
        end, device = start + num_new, self.pool.device
        residual.first = max(residual.first if start else 0, end - residual.length)  # the step overwrites older ones
        sources, positions = residual.reads(end, low, end, offset, device)
        if not plan.ahead or plan.window_write is None:
            plan.window_write, plan.window_sources = residual.slots(start, end, device), sources
            plan.window_positions = positions
            return
        plan.window_write.fill_(start % residual.length)
        plan.window_sources.copy_(sources)
        plan.window_positions.copy_(positions)

    def _window_over_slots(self, layer_in_group: int, slots: torch.Tensor, plan: "Any") -> None:
        """The residual window's values over their slots of ``slots [heads, pages * page_size, head_dim]``."""
        window = self.residual.buffers.get(layer_in_group) if plan.window_pages is not None else None
        if window is not None:  # [batch, heads, length, head_dim]
            by_page = slots.view(slots.shape[0], -1, self.pool.format.page_size, slots.shape[-1])
            by_page.index_put_((plan.heads, plan.window_pages, plan.window_offsets), window)

    @property
    def residual_bytes(self) -> int:
        """Bytes held outside the pool: residual values, exact sinks, keys of pages still filling."""
        total = self.keys.partial_bytes if self.keys is not None else 0
        total += self.sink.bytes if self.sink is not None else 0
        if self.residual is None:
            return total
        return total + sum(buffer.numel() * buffer.element_size() for buffer in self.residual.buffers.values())

    def remember(self, layer_in_group: int, plan: "Any", key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Keeps a step's values for the residual window and its first tokens for the exact sink (a planned step's at
        ``StepPlan.sink_write``: a graph cannot slice at a start that moves), and the ``ExactTail`` parts it crosses."""
        key_states, value_states = _detached(key_states), _detached(value_states)
        ends = [] if plan.ahead else self._capturing(plan.start, value_states.shape[2])
        captured = [self._captured.setdefault(end, ({}, {}, {})) for end in ends]
        for end, (values, _, _) in zip(ends, captured):
            if self.residual is not None:  # before the step's values overwrite the window's oldest
                values[layer_in_group] = self.residual.capture(layer_in_group, plan.start, value_states, end)
        if self.residual is not None:
            self.residual.write(layer_in_group, value_states, plan.window_write)
        if self.sink is not None and plan.ahead:
            self.sink.write_planned(layer_in_group, plan, key_states, value_states)
        elif self.sink is not None:
            self.sink.write(layer_in_group, plan.start, key_states, value_states)
            for end, (_, sink_keys, sink_values) in zip(ends, captured):
                sink_keys[layer_in_group], sink_values[layer_in_group] = self.sink.capture(layer_in_group, end)

    def _capturing(self, start: int, num_new: int) -> list[int]:
        """The page boundaries whose ``ExactTail`` a step writing tokens ``[start, start + n)`` keeps: its end, or any
        inside the rows' first step (a later step's tail depends on where it ends: it reads the window as of then)."""
        end, page_size = start + num_new, self.pool.format.page_size
        ends = [boundary for boundary in self.captures if start < boundary <= end and (not start or boundary == end)]
        newest = end // page_size * page_size
        if self.keeps_newest and newest > start and (not start or newest == end):
            if self._newest not in (newest, *self.captures):  # the step's first layer: the one before goes
                self._captured.pop(self._newest, None)
            self._newest = newest
            ends += [] if newest in ends else [newest]
        return ends

    def read(
        self,
        layer_in_group: int,
        storage: PoolStorage,
        gather: Gather,
        plan: "Any",
        keys: torch.Tensor | None = None,
        step: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, heads, n, head_dim]`` of the slots ``gather`` reads, for attention, the residual
        window over the values as ``plan`` says; ``keys``: read already (coded keys).

        Args:
            step: a step of several tokens, read last: its ``[batch, heads, n, head_dim]`` states, which attention gets
                exact rather than through their codes (no coding error compounds through a prefill's layers).
        """
        keys = gather(storage.keys) if keys is None else keys
        if storage.values is storage.keys:  # the values are the keys (decoded, where they are codes)
            values = keys
        elif self.quant is None:
            values = gather(storage.values)
        else:
            codes = gather(storage.values)  # [batch, heads, n, code_dim]
            scales = gather(storage.value_scales)  # [batch, heads, n, 2 * num_scale_groups]
            values = self._dequantized(codes, scales, keys.dtype)  # [batch, heads, n, head_dim]
            if plan.window_sources is not None:
                self.residual.overlay(layer_in_group, values, (plan.window_sources, plan.window_positions))
        coded = (keys if self.keys is not None else None, values if self.quant is not None else None)
        if self.sink is not None:  # rows that keep every page: tokens in order from 0
            self.sink.overlay(layer_in_group, *coded)
        if step is not None:  # coded keys and values come in buffers of their own: the step's go over them
            for out, states in zip(coded, step):
                if out is not None:
                    out[:, :, -states.shape[2] :] = _detached(states)
        return keys, values

    def values_in_place(self, layer_in_group: int, storage: PoolStorage, plan: "Any") -> torch.Tensor:
        """One layer's quantized values ``[1, heads, view pages * page_size, head_dim]`` laid out as the storage, for
        attention that reads the keys in place: only the extents the mask visits are dequantized into
        ``StepPlan.value_buffer`` (the rest is never read), then the residual window goes over its slots. An eager
        step's extents in up to ``MAX_RUNS`` runs decode slice by slice; others are gathered and scattered (two more
        passes).
        """
        fmt, quant, buffer = self.pool.format, self.quant, plan.value_buffer
        heads, slots_per_extent = fmt.num_kv_heads, fmt.extent_pages * fmt.page_size
        by_extent = buffer.view(heads, -1, slots_per_extent, quant.head_dim)  # [heads, extents, slots, head_dim]

        def by_extents(tensor: torch.Tensor) -> torch.Tensor:  # [heads, extents, slots, last_dim]
            return tensor[layer_in_group].view(heads, -1, slots_per_extent, tensor.shape[-1])

        codes, scales = by_extents(storage.values), by_extents(storage.value_scales)
        if plan.value_runs is not None and len(plan.value_runs) <= MAX_RUNS:
            for first, end in plan.value_runs:
                self._dequantize(by_extent[:, first:end], codes[:, first:end], scales[:, first:end])
        else:
            extents = plan.value_extents
            values = self._dequantized(codes.index_select(1, extents), scales.index_select(1, extents), buffer.dtype)
            by_extent.index_copy_(1, extents, values)
        self._window_over_slots(layer_in_group, buffer, plan)
        return buffer.unsqueeze(0)

    def in_place_buffer(self, num_pages: int) -> torch.Tensor:
        """An eager step's ``StepPlan.value_buffer``: ``[heads, num_pages * page_size, value_dim]``, reused."""
        fmt = self.pool.format
        return self._buffer("in_place", (fmt.num_kv_heads, num_pages * fmt.page_size, fmt.value_dim), fmt.dtype)

    def _dequantized(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values ``[..., head_dim]`` of ``codes`` and joined ``scales``, in a reused buffer (compiled: the graph's)."""
        if torch.compiler.is_compiling():
            groups = self.quant.num_scale_groups
            return dequantize(codes, scales[..., :groups], scales[..., groups:], self.quant, dtype)
        values = self._buffer("values", (*codes.shape[:-1], self.quant.head_dim), dtype)
        self._dequantize(values, codes, scales)
        return values

    def _dequantize(self, out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """``dequantize_joined_into`` with reused work buffers."""
        work = None if out.dtype == torch.float32 else self._buffer("work", tuple(out.shape), torch.float32)
        spread = None
        if self.quant.bits == 4:
            pair = (self._buffer("spread", codes.shape, torch.int16), self._buffer("high", codes.shape, torch.int16))
            kept = self._spread_bytes
            if kept is None or kept[0] is not pair[0] or kept[1] != out.shape:  # once per buffer and shape
                kept = self._spread_bytes = (pair[0], out.shape, spread_bytes(pair[0], out))
            spread = (*pair, kept[2])
        dequantize_joined_into(out, codes, scales, self.quant, work, spread)

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape`` view of a flat buffer kept under ``name`` and grown (doubling) as needed."""
        key = (shape, dtype, torch.is_inference_mode_enabled())
        kept = self._views.get(name)
        if kept is not None and kept[0] == key:  # a step's layers ask for the same view: no op to make it again
            return kept[1]
        buffer = self._buffers.get(name)
        size = math.prod(shape)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < size:
            capacity = max(size, 2 * buffer.numel() if buffer is not None else 0)
            buffer = self._buffers[name] = torch.empty(capacity, dtype=dtype, device=self.pool.device)
        view = buffer[:size].view(shape)
        self._views[name] = (key, view)
        return view

    def select_rows(self, indices: list[int]) -> None:
        for end, parts in self._captured.items():
            self._captured[end] = tuple({layer: tensor[indices] for layer, tensor in held.items()} for held in parts)
        if self.residual is not None:
            self.residual.select_rows(indices)
        if self.keys is not None:
            self.keys.select_rows(indices)
        if self.sink is not None:
            self.sink.select_rows(indices)

    def crop(self, num_tokens: int) -> None:
        self._captured = {end: parts for end, parts in self._captured.items() if end <= num_tokens}
        self._newest = self._newest if self._newest in self._captured else None
        if self.residual is not None:
            self.residual.crop(num_tokens)

    @property
    def keeps_exact(self) -> bool:
        """Whether the rows hold tokens in full precision beside their codes, which a reused prefix must bring."""
        return self.residual is not None or self.sink is not None

    @property
    def exact_lengths(self) -> tuple[int, int]:
        """``(residual window, exact sink)`` lengths in tokens (0: none)."""
        return self.residual.length if self.residual else 0, self.sink.length if self.sink else 0

    def take_tails(self, final: bool = False) -> list[list[ExactTail]]:
        """Takes each row's ``ExactTail`` at each boundary of ``captures`` crossed since the last call (``final``:
        and the newest boundary's, ``keeps_newest``)."""
        taken = [end for end in self._captured if final or end in self.captures]
        self.captures = [end for end in self.captures if end not in taken]
        return [split_tail(end, *self._captured.pop(end)) for end in taken]

    def attach(self, num_tokens: int, tails: list[ExactTail] | None = None) -> None:
        """The rows start from a reused prefix of ``num_tokens`` tokens, with each row's ``tails`` (``keeps_exact``)."""
        if self.keys is not None:  # whole pages, encoded
            self.keys.attach()
        if not self.keeps_exact:
            return
        values, sink_keys, sink_values = stack_tails(tails, *self.exact_lengths)
        if self.residual is not None:
            self.residual.restore(num_tokens, values)
        if self.sink is not None:
            self.sink.restore(sink_keys, sink_values)

    def release(self) -> None:
        self.captures, self.keeps_newest, self._newest, self._captured = [], False, None, {}
        if self.residual is not None:
            self.residual.release()
        if self.keys is not None:
            self.keys.release()
        if self.sink is not None:
            self.sink.release()
        self._buffers.clear()
        self._views.clear()
        self._spread_bytes = None
