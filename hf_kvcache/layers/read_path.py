"""How attention reads a layer group's pages at a step, chosen once per step for its plan (``ReadPath.choose``):

- ``GATHER`` (the slow twin; prefill, short contexts, ``sdpa``/``eager``): the rows' pages copied out in token order,
  ``[batch, heads, num_tokens, head_dim]``;
- ``RUN`` (our attention, a single row whose pages are consecutive ids, as a fresh pool places them): the same shape
  as a view of the storage (``kernels.run_view``), which plain sdpa reads with no copy;
- ``IN_PLACE`` (our attention, a decode step where ``batch x tokens`` reaches ``flex.MIN_IN_PLACE_TOKENS``): the
  layer's storage as ``[1, heads, pages * page_size, head_dim]`` views and the step's plan with its
  ``PagedBlockMask`` for compiled FlexAttention; quantized values are dequantized into a buffer of the storage's
  layout (``SlotStore.values_in_place``).

The block mask is kept from step to step and refilled in place (a step that only adds a token moves its end). In
place needs the extents it visits to hold nothing but the rows' pages (``PagePool.foreign_pages``).
"""

from collections.abc import Callable

import torch

from hf_kvcache.attention import block_mask, flex
from hf_kvcache.layers.store import extent_runs
from hf_kvcache.memory.allocator import NULL_PAGE
from hf_kvcache.memory.page_pool import PagePool
from hf_kvcache.memory.page_table import PageTable

GATHER, RUN, IN_PLACE = "gather", "run", "in place"
"""How a step's attention reads a layer's pages."""

MaskInputs = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""``batch -> (page_ids [batch, num_pages], pads [batch])``: the rows' table and leading padding (passed at each call:
the rows own the path, which must not hold them back)."""


class ReadPath:
    """The read path of one layer group's steps, the block mask in place uses, and the reads so far by path.

    Args:
        pool / table: the layer group's pool and page table.
        our_attention: asked once per step: does the model's attention read a step's plan?
    """

    def __init__(self, pool: PagePool, table: PageTable, our_attention: Callable[[], bool]) -> None:
        self.pool, self.table = pool, table
        self.our_attention = our_attention
        self.window: tuple[int, int] | None = None  # a window's (window, sink_tokens): what the mask hides (WindowRows)
        self.mask: block_mask.PagedBlockMask | None = None  # reused from step to step, refilled in place
        # The extents the mask visits, [visited] and as runs (quantized values: what is dequantized).
        self.extents: tuple[torch.Tensor, list[tuple[int, int]]] | None = None
        self.reads = dict.fromkeys((GATHER, RUN, IN_PLACE), 0)  # layer reads so far, by path
        self._fresh = False  # the mask matches the table and the pads (else: refill before use)
        self._usable = False  # the visited extents hold nothing but the rows' pages and zeros
        self._one_run: bool | None = None  # see is_one_run

    def stale(self, table_changed: bool = False) -> None:
        """The table or the rows' padding changed: the next step refills the mask."""
        self._fresh = False
        if table_changed:
            self._one_run = None

    def choose(
        self,
        num_tokens: int,
        num_new: int,
        encoded_keys: bool,
        hands_over: bool,
        inputs: MaskInputs,
        capacity_tokens: int | None = None,
    ) -> str:
        """How a step's attention reads the pages: ``GATHER``, ``RUN`` or ``IN_PLACE``.

        Args:
            encoded_keys: the keys are stored as codes, or an exact sink goes over them (always gathered).
            hands_over: the model's attention hands the cache its kwargs, where an in-place read puts its plan.
            capacity_tokens: a planned step's keys per row (its capacity; ``None``: an eager step). A graph takes a
                run's first page and a window's slots for constants: planned windows and runs gather.
        """
        batch, pool, planned = self.table.num_rows, self.pool, capacity_tokens is not None
        if not batch or not self.our_attention():
            if batch and num_new == 1:
                flex.log_path("attention", "the model's attn_implementation is not 'hf_kvcache'")
            return GATHER
        if encoded_keys:
            flex.log_path("encoded keys", "keys stored as int8/int4 codes are gathered and decoded for attention")
            return GATHER
        if planned and self.window is not None:
            return GATHER
        if not planned and self.window is None and self.is_one_run():
            flex.log_path("in_place:run", "a single row on consecutive pages: sdpa over a view of them")
            return RUN
        num_keys, least = capacity_tokens or num_tokens, flex.MIN_IN_PLACE_TOKENS
        if self.window is not None:
            num_keys, least = min(num_tokens, sum(self.window)), least * flex.WINDOW_IN_PLACE_FACTOR
        if num_new != 1 or batch * num_keys < least:
            return GATHER  # prefill (compute-bound), or a step whose compiled call would cost more than the copy
        reason = flex.unavailable(pool.device)
        if reason is not None:
            flex.log_path("unavailable", reason)
            return GATHER
        if not hands_over:
            flex.log_path("no kwargs", "the model's attention hands the cache no kwargs to put the step's mask in")
            return GATHER
        return IN_PLACE if self.refresh_mask(batch, num_tokens, inputs) else GATHER

    def refresh_mask(self, batch: int, num_tokens: int, inputs: MaskInputs) -> bool:
        """Brings the mask to the table and ``num_tokens`` (a new one where the batch changed or the rows' pages
        passed its view); returns whether the extents it visits hold no other request's pages."""
        pool, fmt = self.pool, self.pool.format
        if self._fresh and self.mask.batch == batch:
            self.mask.advance(num_tokens)
        else:
            held = {NULL_PAGE, *(page for row in self.table.rows for page in row)}  # the null page: finite, hidden
            num_pages = block_mask.view_pages(1 + max(held), fmt.extent_pages, pool.storage.num_pages)
            if self.mask is None or self.mask.batch != batch or self.mask.num_pages < num_pages:
                self.mask = block_mask.PagedBlockMask(
                    batch, num_pages, fmt.page_size, fmt.extent_pages, pool.device, self.window
                )
            page_ids, pads = inputs(batch)
            extents = self.mask.update(page_ids, num_tokens, pads)
            self._usable = not pool.foreign_pages(held, extents)
            self.extents = (torch.tensor(extents, dtype=torch.long, device=pool.device), extent_runs(extents))
            self._fresh = True
        if not self._usable:
            flex.log_path("foreign", "a row's extents hold another request's pages (gathered for those steps)")
        return self._usable

    def is_one_run(self) -> bool:
        """Whether the table holds a single row whose pages are consecutive ids in order (``kernels.run_view``), in
        a storage whose pages follow each other (a view of them is one slice)."""
        if self._one_run is None:
            rows = self.table.rows
            pages = rows[0] if len(rows) == 1 and not any(self.table.row_skips) else []
            consecutive = all(second - first == 1 for first, second in zip(pages, pages[1:]))
            self._one_run = bool(pages) and consecutive and all(t.is_contiguous() for t in self.pool.storage.tensors)
        return self._one_run
