"""Planned decode steps of ``PagedRows`` (``PlannedRows``): planned outside the graph, run inside it.

Before a compiled decode step the rows grow their table, encode what filled, and write the step's slots and reads
into a ``StepPlan``'s persistent tensors; inside the graph the layers run the eager step's ``write`` and ``read`` on
them: tensor operations, no host read, nothing dynamo specializes on.
"""

import torch

from hf_kvcache.attention import block_mask
from hf_kvcache.attention.kernels import page_rows, slot_indices
from hf_kvcache.layers.plan import StepPlan
from hf_kvcache.layers.read_path import GATHER, IN_PLACE

KEPT = ("pages", "reads", "write_pages", "write_offsets", "key_rows", "key_slots", "filling_rows", "filling_coded")
KEPT += ("value_extents", "window_pages", "window_offsets", "sink_write", "sink_writes")
"""The ``StepPlan`` tensors a planned step refills in place while their shapes stay."""


def _fresh_copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A copy with a new tensor's strides (a compiled graph guards on them; ``clone()`` keeps a view's)."""
    if tensor is None:
        return None
    return torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor)


def _shape(tensor: torch.Tensor | None) -> torch.Size | None:
    return None if tensor is None else tensor.shape


class PlannedRows:
    """The planned-step half of ``PagedRows`` (which it is a base of): its attributes are ``PagedRows``'."""

    def plan_decode(self, start: int, batch: int, capacity_pages: int, padding_only: bool = True) -> StepPlan:
        """Before a decode step of one token per row at ``start``: grows the table and writes the step's slots and
        reads into ``step_plan``, in place where the shapes are the last step's. Raises ``ValueError`` for another
        batch than the cache's.

        Args:
            capacity_pages: pages read per row (``capacity_bucket``; a window reads its visible tokens instead).
            padding_only: the model's mask hides only each row's leading padding and the keys past its tokens (then
                attention may read in place).
        """
        if self.table.num_rows and batch != self.table.num_rows:
            raise ValueError(
                f"The cache holds {self.table.num_rows} rows but a step feeds {batch}. A cache serves one batch at a "
                "time: reset() it, or use a new cache, before a batch of another size."
            )
        if start != self.num_tokens:
            raise RuntimeError(f"A decode step writes from token {start}; the cache holds {self.num_tokens}.")
        self.written = start  # the steps before have run: every layer holds their tokens
        self._grow(batch, start, 1, None)
        page_size, store = self.pool.format.page_size, self.store
        # Rows that keep every page, with no sink (a window's reads slide, a sink fills: they plan every step anew)
        keeps = self.window is None and store.sink is None
        step_key = (self.table.version, start // page_size, batch, capacity_pages, padding_only) if keeps else None
        plan = self.step_plan
        keep = step_key is not None and plan is not None and plan.ahead and step_key == self._step_key
        if keep and plan.value_buffer is None:
            # The same pages, read and written, as the step before: the slot of the new token moves, and a quantized
            # cache's residual window and whether the step fills the keys' page still filling.
            plan.write_offsets.fill_(start % page_size)
            store.plan_window(plan, start, 1)
            if store.keys is not None:
                store.keys.replan(plan, start)
            # Quantized values read in place plan anew (value_buffer): these gathered, as the step before
            plan.mask = self._planned_mask(start, capacity_pages, padding_only) if store.quant is None else None
            plan.mode = GATHER if plan.mask is None else IN_PLACE
            return plan
        self._step_key = step_key
        pages, offsets, tokens, kv_offset = self._reads(start, 1, capacity_pages)
        num_keys = capacity_pages * page_size if tokens is None else tokens.shape[-1]
        first = self._span(start, 1)[1]
        keys_read = (None,) * 4
        if store.keys is not None:  # a window's coded keys: its pages from the first visible one's (it has no sinks)
            read_pages = capacity_pages if self.window is None else -(-self.window // page_size) + 1
            window_tokens = None if self.window is None else tokens
            key_pages, *keys_read = store.keys.plan(
                self._page_ids(), start, 1, first // page_size, read_pages, window_tokens
            )
            keys_read = (None if key_pages is None else self._read_index(key_pages), *keys_read)
        mask = self._planned_mask(start, capacity_pages, padding_only)
        in_place_values = (None, None, None)
        if mask is not None and store.quant is not None:
            in_place_values = self._plan_values_in_place(start, batch, capacity_pages)
            mask = mask if in_place_values[0] is not None else None
        sink = store.sink.plan(start) if store.sink is not None else (None, None)
        reads, pages = self._read_index(pages, offsets), pages.unsqueeze(1)  # StepPlan.pages: [batch, 1, reads]
        planned = dict(zip(KEPT, (pages, reads, *self._write_slots(start, 1), *keys_read, *in_place_values, *sink)))
        fresh = plan is None or not plan.ahead or plan.slot_reads != (offsets is not None)
        if fresh or any(_shape(getattr(plan, name)) != _shape(tensor) for name, tensor in planned.items()):
            plan = StepPlan(None, None, None, self._heads, self._layers, num_keys, ahead=True)
            plan.partial_index = self._partial_index(batch)
            self.step_plan = plan
            for name, tensor in planned.items():
                setattr(plan, name, _fresh_copy(tensor))
            plan.slot_reads = offsets is not None
            store.plan_window(plan, start, 1, first, kv_offset)
            window = (plan.window_write, plan.window_sources, plan.window_positions)
            held = store.residual.buffers.values() if store.residual is not None else ()
            if store.sink is not None:
                held = (*held, *store.sink.keys.values(), *store.sink.values.values())
            for tensor in (*(getattr(plan, name) for name in KEPT), *window, *self.pool.storage.tensors, *held):
                if tensor is not None:
                    torch._dynamo.mark_static_address(tensor)  # CUDA graphs read them where they lie
        else:
            store.plan_window(plan, start, 1, first, kv_offset)
            for name, tensor in planned.items():
                kept = getattr(plan, name)
                if kept is not None:
                    kept.copy_(tensor)
        plan.num_keys, plan.kv_offset = num_keys, kv_offset
        plan.mask, plan.mode = mask, GATHER if mask is None else IN_PLACE
        plan.value_buffer = self._value_buffer() if in_place_values[0] is not None else None
        return plan

    def _planned_mask(self, start: int, capacity_pages: int, padding_only: bool) -> "block_mask.PagedBlockMask | None":
        """``StepPlan.mask`` of a planned step (``ReadPath.choose`` for its capacity), or ``None``: it gathers, as
        where the model's mask hides more than padding (FlexAttention applies the block mask's rule, not the mask's)."""
        if not padding_only:
            return None
        coded = self.store.keys is not None or self.store.sink is not None
        capacity = capacity_pages * self.pool.format.page_size
        mode = self.path.choose(start + 1, 1, coded, True, self.mask_inputs, capacity)
        return self.path.mask if mode == IN_PLACE else None

    def _plan_values_in_place(
        self, start: int, batch: int, capacity_pages: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``StepPlan.value_extents``, ``window_pages`` and ``window_offsets`` of a step at ``start`` reading in place:
        the extents padded with the last to ``batch x (capacity extents + 1)``, a constant of the graph (``None`` each
        where they are more: the step gathers)."""
        fmt = self.pool.format
        extents, num_pages = self.path.extents[0], self.path.mask.num_pages
        count = min(num_pages // fmt.extent_pages, batch * (-(-capacity_pages // fmt.extent_pages) + 1))
        if extents.numel() > count:
            return None, None, None
        extents = torch.cat([extents, extents[-1:].expand(count - extents.numel())])
        if self.store.residual is None:
            return extents, None, None
        return extents, *self._window_slots(start + 1)

    def _value_buffer(self) -> torch.Tensor:
        """``StepPlan.value_buffer`` for the mask's view, kept while it stays; zeros, as slots no step wrote are read
        under the mask (0 x NaN is NaN)."""
        fmt = self.pool.format
        shape = (fmt.num_kv_heads, self.path.mask.num_pages * fmt.page_size, fmt.value_dim)
        if self._planned_values is None or self._planned_values.shape != shape:
            self._planned_values = torch.zeros(shape, dtype=self.pool.storage.keys.dtype, device=self.pool.device)
            torch._dynamo.mark_static_address(self._planned_values)
        return self._planned_values

    def _read_index(self, pages: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """``StepPlan.reads`` of pages ``[batch, n]``: whole pages, or with ``offsets [batch, n]`` one slot of each."""
        fmt, num_pages = self.pool.format, self.pool.storage.num_pages
        if offsets is None:
            return page_rows(pages, fmt.num_kv_heads, num_pages)
        return slot_indices(pages, offsets, fmt.num_kv_heads, num_pages, fmt.page_size).view(-1)

    def end_planning(self) -> None:
        """The next step is not a planned one (a prefill, a crop): drops the plan."""
        if self.step_plan is not None and self.step_plan.ahead:
            self.written = self.num_tokens
            self.step_plan = None
