"""The mask of in-place decode attention (``PagedBlockMask``): FlexAttention's ``BlockMask`` lists built from the page
tables, refilled in place step after step, and the storage views it covers (``view_pages``). ``attention.flex`` says
how the lists are laid out."""

import torch

from hf_kvcache.memory.allocator import NULL_PAGE

MIN_VIEW_EXTENTS = 32
"""The smallest view of a storage that in-place attention gets, in extents (4,096 tokens of 16-token pages): fewer
view sizes, fewer compiles."""


def view_pages(num_used: int, extent_pages: int, storage_pages: int) -> int:
    """Page ids ``[0, n)`` of a storage that in-place attention reads: the first ``num_used`` ones, rounded up to a
    power of two extents (at least ``MIN_VIEW_EXTENTS``), at most the storage's ``storage_pages``."""
    num_extents = max(MIN_VIEW_EXTENTS, -(-num_used // extent_pages))
    return min(storage_pages, extent_pages << (num_extents - 1).bit_length())


class PagedBlockMask:
    """A ``BlockMask`` over a pool's storage for ``batch`` rows of one layer group, one decode token each.

    Args:
        num_pages: pages of the storage's view attention gets (``view_pages``, a multiple of ``extent_pages``): every
            page of the rows is below it.
        page_size / extent_pages: the pool's page geometry; a KV block is one extent.
        window: a window's ``(window, sink_tokens)``: a row sees its last ``window`` tokens and its first
            ``sink_tokens`` real ones; ``None``: every token.

    ``update`` refills its ``tensors`` in place from a page table (``advance``: one token on), for every layer of the
    layer group in the step. The compiled function builds the ``BlockMask`` from them, so dynamo guards on a few
    tensors, not on a ``BlockMask`` and its ``mask_mod``'s closure.
    """

    def __init__(
        self,
        batch: int,
        num_pages: int,
        page_size: int,
        extent_pages: int,
        device: torch.device,
        window: tuple[int, int] | None = None,
    ) -> None:
        self.batch = batch
        self.num_pages = num_pages
        self.page_size = page_size
        self.extent_pages = extent_pages
        num_extents = num_pages // extent_pages
        # Every list holds up to all extents: inductor asserts num_pages * page_size <= capacity * block size.
        as_int = {"dtype": torch.int32, "device": device}
        self.kv_num_blocks = torch.zeros(batch, 1, 1, **as_int)  # [batch, heads=1, q blocks=1]
        self.kv_indices = torch.zeros(batch, 1, 1, num_extents, **as_int)  # [batch, 1, 1, extents]
        self.full_kv_num_blocks = torch.zeros(batch, 1, 1, **as_int)
        self.full_kv_indices = torch.zeros(batch, 1, 1, num_extents, **as_int)
        self.page_position = torch.full((batch, num_pages), -1, **as_int)  # [batch, pages]: logical page, or -1
        self.pads = torch.zeros(batch, dtype=torch.int64, device=device)  # [batch] leading padding tokens
        self.num_tokens = torch.zeros(1, dtype=torch.int64, device=device)  # [1] tokens per row, the new one included
        # A window's: [1] its size (rows keeping every token: more than any length), [batch] each row's sinks' end
        self.windowed = window is not None
        self.sink_tokens = window[1] if window is not None else 0
        self.window = torch.full((1,), window[0] if window is not None else 1 << 40, dtype=torch.int64, device=device)
        self.sink_ends = torch.zeros(batch, dtype=torch.int64, device=device)
        for tensor in self.tensors:  # refilled in place: a compiled step reads them where they lie
            torch._dynamo.mark_static_address(tensor)  # CUDA graphs replay over them
            torch._dynamo.mark_static(tensor)  # a shape of the graph: another mask is another graph, never dynamic

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The mask's tensors, in ``_paged_flex``'s argument order."""
        return (
            self.kv_num_blocks,
            self.kv_indices,
            self.full_kv_num_blocks,
            self.full_kv_indices,
            self.page_position,
            self.pads,
            self.num_tokens,
            self.window,
            self.sink_ends,
        )

    @property
    def block_tokens(self) -> int:
        """Tokens per KV block: one extent."""
        return self.extent_pages * self.page_size

    @torch.no_grad()
    def update(self, page_ids: torch.Tensor, num_tokens: int, pads: torch.Tensor) -> list[int]:
        """Refills the mask from the rows' page table, ``page_ids [batch, ceil(num_tokens / page_size)]`` in logical
        order, for ``num_tokens`` per row (the new one included) after ``pads [batch]`` leading padding tokens (hidden).
        Returns the extents the step visits (some row's pages, or fillers), for ``PagePool.foreign_pages``."""
        batch, n = page_ids.shape
        size, device = self.extent_pages, page_ids.device
        first = torch.arange(n, device=device) * self.page_size  # [n] first position of each logical page
        pads = pads.to(device=device, dtype=torch.long).view(-1, 1)  # [batch, 1]
        held = page_ids != NULL_PAGE  # [batch, n]: the null page stands for pages of padding a row does not hold
        seen_any = (first + self.page_size > pads) & held  # [batch, n]: some slot visible
        seen_all = (first >= pads) & (first + self.page_size <= num_tokens)  # [batch, n]: every slot visible
        # The null page's entries stand in for the row's first page held (its logical page), so that its extent is
        # not visited: it holds other rows' pages.
        first_held = held.int().argmax(1, keepdim=True)  # [batch, 1]
        page_ids = torch.where(held, page_ids, page_ids.gather(1, first_held))
        extents, inverse = torch.unique(page_ids // size, return_inverse=True)  # [u], [batch, n]
        any_count = torch.zeros(batch, extents.numel(), dtype=torch.int32, device=device)  # [batch, u]
        any_count.scatter_add_(1, inverse, seen_any.int())
        all_count = torch.zeros_like(any_count).scatter_add_(1, inverse, seen_all.int())
        # [batch, u]: all the extent's pages are the row's, wholly visible (a window's slide: mask_mod always decides)
        full = (all_count == size) & (not self.windowed)
        partial = (any_count > 0) & ~full
        # Equal counts for every row: keep the fewest rows' number of full extents, the rest become partial.
        num_full = int(full.sum(1).min())
        kept = full & (full.cumsum(1) <= num_full)
        partial |= full & ~kept
        # Partial extents first, then fillers (extents of other rows, hidden), the row's full extents last.
        rank = torch.where(partial, 0, torch.where(kept, 2, 1)).to(torch.int8)
        order = torch.sort(rank, dim=1, stable=True).indices  # [batch, u]
        full_order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices
        u = extents.numel()
        self.kv_num_blocks.fill_(int(partial.sum(1).max()))
        self.kv_indices[:, 0, 0, :u] = extents[order].to(torch.int32)
        self.full_kv_num_blocks.fill_(num_full)
        self.full_kv_indices[:, 0, 0, :u] = extents[full_order].to(torch.int32)
        self.page_position.fill_(-1)
        logical = torch.arange(n, dtype=torch.int32, device=device).expand(batch, n)
        self.page_position.scatter_(1, page_ids, torch.where(held, logical, first_held.int()))
        self.pads.copy_(pads.view(-1))
        self.sink_ends.copy_(pads.view(-1) + self.sink_tokens)
        self.num_tokens.fill_(num_tokens)
        return extents.tolist()

    def advance(self, num_tokens: int) -> None:
        """One more token per row in the rows' last pages, nothing else changed: only the end moves (the last page
        is in a partial extent, where ``mask_mod`` bounds what is seen; a window's start with it)."""
        self.num_tokens.fill_(num_tokens)
