"""The rows of one layer group of a cache on one pool (``PagedRows``), shared by its layers on one device: its page
table, and each step's plan, made once (a page id addresses the same slots in every layer) and executed by every
layer (``write``, ``read``).
"""

import functools
from collections.abc import Callable
from typing import Any

import torch

from hf_kvcache.attention.kernels import read_pages, read_planned_view, read_slots, run_view, write_planned
from hf_kvcache.attention.reads import KEY_LAYOUT, STEP_PLAN
from hf_kvcache.layers.exact import ExactTail
from hf_kvcache.layers.identical import find_identical_rows
from hf_kvcache.layers.plan import StepPlan
from hf_kvcache.layers.planned import PlannedRows
from hf_kvcache.layers.read_path import GATHER, IN_PLACE, RUN, ReadPath
from hf_kvcache.layers.store import SlotStore
from hf_kvcache.memory.allocator import NULL_PAGE
from hf_kvcache.memory.page_pool import PagePool
from hf_kvcache.memory.placement import agree
from hf_kvcache.memory.storage import PoolStorage


class PagedRows(PlannedRows):
    """Page table of one layer group of a cache on one pool, with its index tensors (rebuilt when the table changes).

    Args:
        pool: where the pages live.
        residual_length / exact_tokens: as for ``SlotStore``.
        row_extents: place each row's pages in aligned extents (``PageTable``), so attention can read them in place.
        our_attention: as for ``ReadPath``.
        process_group: a tensor-parallel model's ranks, over which page allocations and identical rows are agreed
            so that their tables stay alike.
    """

    defers_codes = True
    """``SlotStore``'s ``defers_codes``."""

    def __init__(
        self,
        pool: PagePool,
        residual_length: int = 0,
        row_extents: bool = True,
        our_attention: Callable[[], bool] = lambda: False,
        process_group: Any = None,
        exact_tokens: int = 0,
    ) -> None:
        self.pool = pool
        self.process_group = process_group
        self.store = SlotStore(pool, residual_length, self.defers_codes, exact_tokens)
        self.table = pool.new_table(row_extents, process_group)
        self.written = 0  # tokens every layer of the layer group has written (see write)
        self._last_layer = pool.format.num_layers - 1
        self.pad_lengths: list[int] | None = None  # leading padding of each row (``PoolCache.plan``); None: none
        self._pads: torch.Tensor | None = None  # ``pad_lengths`` as a [batch] tensor, see _pad_tensor
        self.fed_tokens: int | None = None  # tokens the first forward pass feeds (``set_plan``); None: not known
        # How attention reads a step's pages, and the block mask in place uses
        self.path = ReadPath(pool, self.table, our_attention)
        self._version = -1  # table version the cached indices below were built for
        self._ids: torch.Tensor | None = None
        fmt = pool.format
        self._heads = torch.arange(fmt.num_kv_heads, device=pool.device).view(1, -1, 1)  # StepPlan.heads
        self._layers = tuple(torch.full((1, 1, 1), layer, device=pool.device) for layer in range(fmt.num_layers))
        self._shared_prefill: tuple[int, list[int]] | None = None  # (num_tokens, identical_rows) of a prefill
        self.window: int | None = None  # tokens a query sees (WindowRows); None: the rows keep every token
        self.reach = 0  # a window's tokens a row keeps behind its end, besides its sinks (WindowRows)
        self.contiguous_keys = False  # coded keys come contiguous (the model's own code reads them, not just attention)
        self.step_plan: StepPlan | None = None  # the step's plan (plan_step; a compiled step's: plan_decode)
        self._step_key: tuple[int, ...] | None = None  # what the step plan was made for, where it can be kept
        self._planned_values: torch.Tensor | None = None  # StepPlan.value_buffer
        self._partial_rows: torch.Tensor | None = None  # StepPlan.partial_index (_partial_index)

    @property
    def num_tokens(self) -> int:
        return self.table.num_tokens

    def plan_step(
        self, layer_in_group: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor, hands_over: bool
    ) -> StepPlan:
        """The plan of an eager step writing ``[batch, heads, n, head_dim]`` states at ``start``, made by the layer
        group's first layer (and again where rows of a shared prefill turn out to differ)."""
        self.begin_step(start, key_states, value_states)
        num_new, plan = key_states.shape[-2], self.step_plan
        made_for = (start, num_new, self.table.version)
        stale = plan is None or plan.ahead or (plan.start, plan.num_new, plan.version) != made_for
        if stale or (plan.mode == IN_PLACE and not hands_over):  # in place needs the kwargs to hand its read over
            plan = self.step_plan = self._plan_eager(start, num_new, hands_over)
        return plan

    def plan_eager_step(self, start: int, batch: int) -> None:
        """Before the forward pass of an eager decode step at ``start``: what ``plan_step`` would do at the first layer
        (a step that is not the table's next is left to the layers, which raise). Unlike ``plan_decode`` it reads
        exactly the rows' tokens, not a capacity bucket."""
        if start != self.num_tokens or not self.table.num_rows or batch != self.table.num_rows:
            return
        self._grow(batch, start, 1, None)
        self.step_plan = self._plan_eager(start, 1, hands_over=True)

    def _plan_eager(self, start: int, num_new: int, hands_over: bool) -> StepPlan:
        """An eager step's plan: the slots of tokens ``[start, start + n)`` and how attention reads the rows'
        tokens (``ReadPath.choose``)."""
        end = start + num_new
        mode = self.path.choose(end, num_new, self.store.keys is not None, hands_over, self.mask_inputs)
        sinks, first = self._span(start, num_new)
        plan = StepPlan(None, *self._write_slots(start, num_new), self._heads, self._layers, sinks + end - first)
        plan.start, plan.num_new, plan.version, plan.mode = start, num_new, self.table.version, mode
        plan.kv_offset = first - sinks
        self.store.plan_window(plan, start, num_new, first, first - sinks)
        if self.store.keys is not None:  # a window's coded keys: its pages from the first visible one's (no sinks)
            first_page = first // self.pool.format.page_size
            key_plan = self.store.keys.plan(self._page_ids(), start, num_new, first_page)
            plan.key_rows, plan.key_slots, plan.filling_rows, plan.filling_coded = key_plan
            plan.partial_index = self._partial_index(self.table.num_rows)
        if mode == GATHER:
            self._plan_gather(plan)
        elif mode == IN_PLACE:  # its pages too, for attention that cannot read in place after all
            pages, offsets, _, _ = self._reads(start, num_new)
            plan.mask, plan.pages = self.path.mask, pages.unsqueeze(1)
            plan.offsets = None if offsets is None else offsets.unsqueeze(1)
            if self.store.quant is not None:  # the visited extents' values, dequantized into a buffer
                plan.value_extents, plan.value_runs = self.path.extents
                plan.value_buffer = self.store.in_place_buffer(plan.mask.num_pages)
            if self.store.residual is not None:  # the window's tokens, over their dequantized slots
                plan.window_pages, plan.window_offsets = self._window_slots(end)
        return plan

    def _partial_index(self, batch: int) -> torch.Tensor:
        """``StepPlan.partial_index`` of ``batch`` rows (kept while the batch is the same)."""
        heads = self.pool.format.num_kv_heads
        if self._partial_rows is None or self._partial_rows.shape[0] != batch:
            self._partial_rows = torch.arange(batch * heads, device=self.pool.device).view(batch, heads, 1)
        return self._partial_rows

    def _span(self, start: int, num_new: int) -> tuple[int, int]:
        """``(num_sinks, first)``: a step writing tokens ``[start, start + n)`` reads tokens ``[0, num_sinks)`` and
        ``[first, start + n)`` (growing rows: all, from 0; a window's: ``visible_span``)."""
        return 0, 0

    def _reads(
        self, start: int, num_new: int, capacity_pages: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
        """What a step writing tokens ``[start, start + n)`` reads: ``(pages [batch, reads], offsets [batch, reads] or
        None, tokens [batch, num_keys] or None, kv_offset)``, whole pages, or with ``offsets`` one slot of each;
        ``tokens`` the token of each key (``-1``: none; ``None``: the rows' tokens from 0, in order). Without a
        capacity (an eager step) exactly the step's keys, as the model's mask is sized; with ``capacity_pages`` a fixed
        count, for one graph over many steps. Growing rows read their pages up to the step's end, or padded with the
        null page to ``capacity_pages``."""
        ids, page_size = self._page_ids(), self.pool.format.page_size  # [batch, pages]
        if capacity_pages is None:
            return ids[:, : -(-(start + num_new) // page_size)], None, None, 0
        if ids.shape[1] > capacity_pages:
            raise ValueError(f"Rows of {ids.shape[1]} pages do not fit a step planned for {capacity_pages}.")
        padded = torch.full((ids.shape[0], capacity_pages), NULL_PAGE, dtype=torch.long, device=ids.device)
        padded[:, : ids.shape[1]] = ids  # [batch, capacity_pages]
        return padded, None, None, 0

    def _plan_gather(self, plan: StepPlan) -> None:
        """A gathered step's ``StepPlan.reads``, ``slot_reads`` and ``slots``: exactly its keys (``_reads``)."""
        pages, offsets, plan.slots, _ = self._reads(plan.start, plan.num_new)
        plan.reads, plan.slot_reads = self._read_index(pages, offsets), offsets is not None

    def _write_slots(self, start: int, num_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``StepPlan.write_pages`` and ``write_offsets`` ``[batch, 1, n]`` of tokens ``[start, start + n)``."""
        page_size = self.pool.format.page_size
        tokens = torch.arange(start, start + num_new, device=self.pool.device)
        pages = self._page_ids()[:, tokens // page_size].unsqueeze(1)
        return pages, (tokens % page_size).expand_as(pages)

    def write(self, plan: StepPlan, layer_in_group: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Stores one layer's ``[batch, heads, n, head_dim]`` new states where ``plan`` puts them: tensor operations
        only, and no lock (the pool's storage never moves and the rows' pages are their own)."""
        storage, deferred, keys = self.pool.storage, self.store.defers_codes and plan.num_new == 1, self.store.keys

        def put(tensor: torch.Tensor, states: torch.Tensor) -> None:
            write_planned(tensor, plan, layer_in_group, states)

        self.store.write(layer_in_group, storage, put, key_states, value_states, code_values=not deferred)
        if keys is not None:
            keys.write(layer_in_group, storage, plan, key_states, self._page_ids)
        self.store.remember(layer_in_group, plan, key_states, value_states)
        if deferred and layer_in_group == self._last_layer:  # every layer's token, coded at once
            self.store.code_step(storage, plan)
        if layer_in_group == self._last_layer and not plan.ahead:  # plan_decode counts a planned step's tokens
            self.written = plan.start + plan.num_new  # every layer holds them: what a prefix index may publish

    def _read_keys(self, layer_in_group: int, storage: PoolStorage, plan: StepPlan) -> torch.Tensor:
        """Coded keys, decoded: the ``[batch, heads, num_keys, head_dim]`` keys ``plan`` reads."""
        keys = self.store.keys.read(layer_in_group, storage, plan, self.pool.format.dtype)
        return keys.contiguous() if self.contiguous_keys else keys  # else a view of the decoded pages

    def read(
        self,
        plan: StepPlan,
        layer_in_group: int,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        handoff: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values for attention after the step's states were written, as ``plan`` says:
        ``[batch, heads, num_keys, head_dim]`` (gathered, or a run's view), or ``[1, heads, view pages * page_size,
        head_dim]`` views of the storage with the plan put in ``handoff``, the attention's kwargs (in place; a model
        that hands none gets the plan's pages gathered).
        """
        step = (key_states, value_states) if plan.num_new > 1 else None
        if not plan.ahead:  # planned steps are not counted (a graph would take the count for a constant)
            self.path.reads[plan.mode] += 1
        if plan.mode == GATHER:
            if plan.layout is not None and handoff is not None and self.path.our_attention():
                handoff[KEY_LAYOUT] = plan.layout  # a window's band (only our attention reads it)
            return self.gather(layer_in_group, plan, step)
        storage = self.pool.storage
        if plan.mode == RUN:
            first_page, num_tokens = self.table.rows[0][0], plan.num_keys
            view = functools.partial(run_view, layer_idx=layer_in_group, first_page=first_page, num_tokens=num_tokens)
            return self.store.read(layer_in_group, storage, view, plan, step=step)
        keys = self._storage_view(storage.keys, layer_in_group)
        if self.store.quant is None:
            values = self._storage_view(storage.values, layer_in_group)
        else:
            values = self.store.values_in_place(layer_in_group, storage, plan)
        if handoff is None:
            return read_planned_view(keys, plan), read_planned_view(values, plan)
        handoff[STEP_PLAN] = plan
        return keys, values

    def _storage_view(self, storage: torch.Tensor, layer_in_group: int) -> torch.Tensor:
        """One layer's first ``mask.num_pages`` pages as ``[1, heads, pages * page_size, width]``."""
        fmt, num_pages = self.pool.format, self.path.mask.num_pages
        shape = (1, fmt.num_kv_heads, num_pages * fmt.page_size, storage.shape[-1])
        return storage[layer_in_group][:, :num_pages].view(shape)

    def gather(
        self, layer_in_group: int, plan: StepPlan, step: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, heads, num_keys, head_dim]`` of one layer, gathered as ``plan`` says (``step``:
        as for ``SlotStore.read``)."""
        storage, fmt = self.pool.storage, self.pool.format
        shape = (self.table.num_rows, fmt.num_kv_heads, plan.num_keys)

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            if plan.slot_reads:
                return read_slots(storage.slots(tensor, layer_in_group), plan.reads, shape)
            pages = storage.slots(tensor, layer_in_group, fmt.page_size)
            return read_pages(pages, plan.reads, (*shape, tensor.shape[-1]), plan.kv_offset % fmt.page_size)

        keys = None if self.store.keys is None else self._read_keys(layer_in_group, storage, plan)
        keys, values = self.store.read(layer_in_group, storage, gather, plan, keys, step)
        if step is not None and self.window is not None and plan.num_new > self.reach:
            for out, states, coded in ((keys, step[0], self.store.keys), (values, step[1], self.store.quant)):
                if coded is None:  # a window's tokens the step kept nowhere: as given (coded ones are, by read)
                    out[:, :, -plan.num_new :] = states.detach()
        return keys, values

    def begin_step(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Makes room for ``[batch, heads, n, head_dim]`` states at ``start``: the first layer of a step grows the
        table; the layers after it check the batch, and in a shared prefill give rows that differ their own pages."""
        batch, _, num_new, _ = key_states.shape
        # Checked first, here: a step may take no new page, so the page table's own check would not run.
        if self.table.num_rows and batch != self.table.num_rows:
            raise ValueError(
                f"The cache holds {self.table.num_rows} rows but a layer got {batch}. A cache serves one batch at a "
                "time: reset() it, or use a new cache, before a batch of another size."
            )
        end = start + num_new
        if end > self.num_tokens:
            if start != self.num_tokens:
                raise RuntimeError(f"A layer writes from token {start}; the cache holds {self.num_tokens}.")
            if start == 0 and self.pad_lengths is not None and self.fed_tokens not in (None, num_new):
                # The model writes other tokens than it was fed (CPM-Ant puts prompt tokens of its own in front): the
                # padding its mask shows is not where the rows hold it, so they skip no page and hide no token.
                self.set_plan(None, None)
            identical_rows = find_identical_rows(key_states, value_states) if start == 0 else None
            if start == 0 and batch > 1 and self.process_group is not None:
                identical_rows = self._agreed_identical_rows(identical_rows, batch)
            self._grow(batch, start, num_new, identical_rows)
            self._shared_prefill = (end, identical_rows) if identical_rows else None
        elif self._shared_prefill is not None and self._shared_prefill[0] == end:
            self._split_differing_rows(key_states, value_states)

    def _grow(self, batch: int, start: int, num_new: int, identical_rows: list[int] | None) -> None:
        self._apply(lambda: self.table.grow(batch, num_new, identical_rows))

    def set_plan(self, pad_lengths: list[int] | None, fed_tokens: int | None) -> None:
        """Each row's leading padding, and the tokens the first forward pass feeds (``None``: not known)."""
        self.pad_lengths, self._pads, self.fed_tokens = pad_lengths, None, fed_tokens
        self.table.pads = list(pad_lengths) if pad_lengths is not None else None
        self.path.stale()

    def mask_inputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``ReadPath``'s ``MaskInputs``: the page table ``[batch, num_pages]`` and the rows' padding ``[batch]``."""
        return self._page_ids(), self._pad_tensor(batch)

    def _pad_list(self, batch: int) -> list[int]:
        """The leading padding of each of ``batch`` rows (zeros where the cache was not told)."""
        return self.pad_lengths if self.pad_lengths is not None and len(self.pad_lengths) == batch else [0] * batch

    def _pad_tensor(self, batch: int) -> torch.Tensor:
        """``_pad_list`` as a ``[batch]`` tensor, kept."""
        if self._pads is None or self._pads.shape[0] != batch:
            self._pads = torch.tensor(self._pad_list(batch), dtype=torch.long, device=self.pool.device)
        return self._pads

    def select_rows(self, indices: list[int]) -> None:
        """Keeps rows ``indices`` in that order, sharing the pages of repeated rows."""
        self._apply(lambda: self.table.select_rows(indices))
        self.store.select_rows(indices)
        if self.pad_lengths is not None:
            self.pad_lengths = [self.pad_lengths[index] for index in indices]
            self._pads = None

    def check_crop(self, num_tokens: int) -> None:
        """Growing rows keep every token, so any crop is exact."""

    def crop(self, num_tokens: int) -> None:
        self._apply(lambda: self.table.crop(num_tokens))
        self.store.crop(num_tokens)
        self._crop_keys(num_tokens)
        self.written = min(self.written, num_tokens)

    def _crop_keys(self, num_tokens: int) -> None:
        """Encoded keys: a row's page still filling moves back to the page the crop ends in (after the table's)."""
        if self.store.keys is not None and self.table.num_rows:
            with self.pool.held() as storage:
                self.store.keys.crop(num_tokens, storage, self._page_ids())

    def release(self) -> None:
        """Returns all pages to the pool."""
        self._apply(self.table.release)
        self.store.release()
        self.written = 0

    # ----- reused prefixes (hf_kvcache.caches.prefix) -------------------------------------------

    def prefix_layout(self, num_pages: int) -> list[int | None]:
        """Which token page each page of a row holds right after its first ``num_pages`` full token pages were
        written (``None``: none the row still needs). Growing rows: all, in order."""
        return list(range(num_pages))

    def token_page_position(self, token_page: int) -> int | None:
        """Where in a row's pages a full token page written earlier lies (``None``: no longer held)."""
        return token_page

    def attach(self, pages: list[list[int]], num_tokens: int, tails: list[ExactTail] | None = None) -> None:
        """Starts the empty rows from a reused prefix: ``pages`` (as ``prefix_layout`` lays them out, already taken
        from the pool) hold each row's first ``num_tokens`` tokens; ``tails`` as for ``SlotStore.attach``."""
        self._apply(lambda: self.table.attach(pages, num_tokens))
        self.written = num_tokens
        self.store.attach(num_tokens, tails)

    def _apply(self, change: Callable[[], list[tuple[int, int]] | None]) -> None:
        """Runs a table change holding the pool, copies the pages it asks for, drops cached indices."""
        self._shared_prefill = None
        self.path.stale()
        with self.pool.held():
            copies = change()
        if copies:
            self.pool.copy_pages(copies)
        if self.table.version != self._version:
            self._version = self.table.version
            self.path.stale(table_changed=True)
            self._ids = None

    def _agreed_identical_rows(self, identical_rows: list[int] | None, batch: int) -> list[int] | None:
        """The identical rows every rank found (each sees only its share of the heads); ``None`` where they differ."""
        firsts = identical_rows or list(range(batch))
        # [min..., -max...]
        extremes = agree(firsts + [-first for first in firsts], self.process_group, self.pool.device)
        same = extremes[:batch] == [-first for first in extremes[batch:]]
        return identical_rows if same else None

    def _split_differing_rows(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """In a shared prefill, gives rows whose states differ (on any rank) private pages."""
        end, firsts = self._shared_prefill
        differs = [
            int(
                first != row
                and not (
                    torch.equal(key_states[row], key_states[first])
                    and torch.equal(value_states[row], value_states[first])
                )
            )
            for row, first in enumerate(firsts)
        ]
        differing = [
            row for row, flag in enumerate(agree(differs, self.process_group, self.pool.device, "max")) if flag
        ]
        if differing:
            self._apply(lambda: self.table.make_private(differing))
            self._shared_prefill = (end, [row if row in differing else first for row, first in enumerate(firsts)])

    def _page_ids(self) -> torch.Tensor:
        """The page table ``[batch, num_pages]``, page ``i`` holding tokens ``[i * page_size, (i + 1) * page_size)``
        (the null page where a row holds only padding)."""
        if self._ids is None:
            rows = [[NULL_PAGE] * skip + row for row, skip in zip(self.table.rows, self.table.row_skips)]
            self._ids = torch.tensor(rows, dtype=torch.long, device=self.pool.device).view(len(rows), -1)
        return self._ids

    def _window_slots(self, newest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``StepPlan.window_pages`` and ``window_offsets`` once ``newest`` tokens are written."""
        page_size = self.pool.format.page_size
        tokens = torch.tensor(self.store.residual.tokens(newest), device=self.pool.device)
        held = tokens >= 0
        pages = torch.where(held, self._page_ids()[:, tokens.clamp(min=0) // page_size], NULL_PAGE)
        offsets = torch.where(held, tokens % page_size, 0).expand_as(pages)
        return pages.unsqueeze(1), offsets.unsqueeze(1)
