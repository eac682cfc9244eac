"""Keys stored as codes a page at a time (``KeyPages``; a format that sets ``key_bits``), encoded once a page fills.

The page still filling is held in full precision (``partial``), which attention reads; an eager step encodes it when
it fills it, a planned step every step (a graph cannot branch on the fill: the codes of the step that fills it are
written last). Every row counts
tokens from 0, its padding included, so token ``t`` lies in token page ``t // page_size`` of every row's table and one
plan serves every row. A ``crop`` into an encoded page decodes it back as the page still filling; nothing else
re-encodes a page.
"""

from collections.abc import Callable
from typing import Any

import torch

from hf_kvcache.layers.key_codes import Buffer, KeyCodes
from hf_kvcache.memory.allocator import NULL_PAGE
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.storage import PoolStorage


class KeyPages:
    """One layer group's keys as codes in the pool (``page_format`` and ``buffer`` as for ``KeyCodes``)."""

    def __init__(self, page_format: PageFormat, buffer: Buffer) -> None:
        self.page_size = page_format.page_size
        self.codes = KeyCodes(page_format, buffer)
        self.partial: dict[int, torch.Tensor] = {}  # layer_in_group -> [batch, heads, page_size, head_dim]
        self.written: dict[int, int] = {}  # layer_in_group -> tokens written (padding included)
        self._partial_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (partial, heads first)

    @property
    def partial_bytes(self) -> int:
        """Bytes of the full-precision pages still filling, held outside the pool."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self.partial.values())

    # ----- an eager step's plan --------------------------------------------------------------

    def plan_eager(self, plan: "Any", start: int, num_new: int, page_ids: torch.Tensor, first_page: int = 0) -> None:
        """An eager step's ``StepPlan.key_ids``, ``key_filling`` and ``key_step`` for tokens ``[start, start + n)``
        over ``page_ids`` (the rows' table from token page ``first_page`` on); ``key_step`` is a one-token step's
        slot in the page still filling and, if it fills that page, the pool pages it is encoded to."""
        (batch, m), device, end = page_ids.shape, page_ids.device, start + num_new
        plan.key_ids = page_ids.reshape(-1)
        if end % self.page_size:
            column = end // self.page_size - first_page
            plan.key_filling = torch.arange(batch, device=device) * m + column
        if num_new != 1:
            return  # the general path of write
        fmt = self.codes.format
        slot = torch.full((batch, fmt.num_kv_heads, 1, fmt.head_dim), start % self.page_size, device=device)
        filled = self._fills(end) and self.codes.store_index(self._filled_targets(page_ids, end, first_page))
        plan.key_step = (slot, filled or None)

    # ----- writing ------------------------------------------------------------------------------

    def write(
        self,
        layer_in_group: int,
        storage: PoolStorage,
        start: int,
        key_states: torch.Tensor,
        page_ids: torch.Tensor,
        plan: "Any" = None,
    ) -> None:
        """Takes tokens ``[start, start + n)`` of every row; encodes and stores the pages they fill.

        Args:
            key_states: ``[batch, heads, n, head_dim]``.
            page_ids: ``[batch, num_pages]`` the rows' pages (their page table; holes: the null page).
            plan: the step's (``plan_eager``); a one-token step writes as it says.
        """
        if key_states.requires_grad:
            key_states = key_states.detach()
        if self._write_in_place(layer_in_group, storage, start, key_states, plan):
            return
        page_size, device, end = self.page_size, key_states.device, start + key_states.shape[2]
        take, first_page, end_page = self._joined(layer_in_group, start, key_states)
        if end_page > first_page:  # pages the step fills
            token_pages = torch.arange(first_page, end_page, device=device).unsqueeze(0)  # [1, m]
            pages = take(self._page_tokens(token_pages))  # [batch, heads, m, page_size, head_dim]
            targets = page_ids[:, first_page:end_page]  # [batch, m]
            self.codes.store(layer_in_group, storage, pages, self.codes.store_index(targets))
        partial = take(self._page_tokens(torch.tensor([[end_page]], device=device))).squeeze(2)
        held = torch.arange(page_size, device=device) < end % page_size  # [page_size]
        self.partial[layer_in_group] = partial = partial.masked_fill(~held.view(1, 1, page_size, 1), 0)
        self._heads_first(layer_in_group, partial)  # made here, where the page changes, once
        self.written[layer_in_group] = end

    def _write_in_place(
        self, layer_in_group: int, storage: PoolStorage, start: int, key_states: torch.Tensor, plan: "Any"
    ) -> bool:
        """A one-token step's key put in its slot of each row's page still filling in one op (``StepPlan.key_step``),
        encoding the page if it fills. ``False``: not such a step, nothing written."""
        partial = self.partial.get(layer_in_group)
        step = plan.key_step if plan is not None else None
        batch, _, num_new, _ = key_states.shape
        if step is None or num_new != 1 or partial is None or partial.shape[0] != batch:
            return False
        if self.written.get(layer_in_group) != start:
            return False
        slot, filled = step
        partial.scatter_(2, slot, key_states.to(partial.dtype))
        self.written[layer_in_group] = start + 1
        if filled is not None:  # every row's page fills: encoded, and its slots are written again before they are read
            self.codes.store(layer_in_group, storage, partial.unsqueeze(2), filled)
            partial.zero_()
        return True

    def _page_tokens(self, token_pages: torch.Tensor) -> torch.Tensor:
        """``[batch, m, page_size]`` the tokens of token pages ``[batch, m]``."""
        return token_pages.unsqueeze(-1) * self.page_size + torch.arange(self.page_size, device=token_pages.device)

    def _joined(
        self, layer_in_group: int, start: int, key_states: torch.Tensor
    ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int, int]:
        """``(take, first_page, end_page)``: ``take`` maps tokens ``[1, *shape]``, from the page still filling before
        the step to the step's last, to keys ``[batch, heads, *shape, head_dim]``; the token page still filling before
        and after the step."""
        batch, heads, num_new, head_dim = key_states.shape
        page_size = self.page_size
        partial = self.partial.get(layer_in_group)
        if partial is None or partial.shape[0] != batch or start == 0:
            partial = key_states.new_zeros(batch, heads, page_size, head_dim)
        first_page, end_page = start // page_size, (start + num_new) // page_size
        # Token t: in the page still filling (at t - its first token) or among the new ones (past it).
        joined = torch.cat([partial, key_states.to(partial.dtype)], dim=2)  # [batch, heads, page_size + n, head_dim]

        def take(tokens: torch.Tensor) -> torch.Tensor:
            flat = tokens.view(1, -1)
            index = torch.where(flat >= start, page_size + flat - start, flat - first_page * page_size)
            index = index.clamp(0, page_size + num_new - 1)
            keys = joined.gather(2, index.view(1, 1, -1, 1).expand(batch, heads, -1, head_dim))
            return keys.view(batch, heads, *tokens.shape[1:], head_dim)

        return take, first_page, end_page

    # ----- reading ------------------------------------------------------------------------------

    def _heads_first(self, layer_in_group: int, partial: torch.Tensor) -> torch.Tensor:
        """A page still filling as ``[heads, batch, page_size, head_dim]`` (a view), kept while it is the same."""
        kept = self._partial_views.get(layer_in_group)
        if kept is None or kept[0] is not partial:
            kept = self._partial_views[layer_in_group] = (partial, partial.transpose(0, 1))
        return kept[1]

    def read(
        self,
        layer_in_group: int,
        storage: PoolStorage,
        page_ids: torch.Tensor,
        dtype: torch.dtype,
        num_tokens: int | None = None,
        plan: "Any" = None,
        first_page: int = 0,
    ) -> torch.Tensor:
        """``[batch, heads, num_tokens, head_dim]`` (a strided view of a reused buffer): the first ``num_tokens`` slots
        (default: all) of the pages ``page_ids [batch, m]`` (the table from token page ``first_page`` on), decoded,
        the pages still filling over theirs."""
        ids = plan.key_ids if plan is not None else None
        pages = self.codes.decode(layer_in_group, storage, page_ids, dtype, ids)  # [heads, batch * m, page_size, hd]
        (heads, _, page_size, head_dim), (batch, m) = pages.shape, page_ids.shape
        partial = self.partial.get(layer_in_group)
        written = self.written.get(layer_in_group, 0)
        # The page still filling is token page written // page_size of every row, and its slots past the tokens
        # held lie past the tokens read. One op puts it over its decoded slots.
        if partial is not None and partial.shape[0] == batch and written % page_size:
            filling = plan.key_filling if plan is not None else None
            if filling is None:
                filling = torch.arange(batch, device=pages.device) * m + written // page_size - first_page
            pages.index_copy_(1, filling, self._heads_first(layer_in_group, partial).to(dtype))
        row = m * page_size * head_dim  # one row's keys of one head, in the buffer
        size = (batch, heads, m * page_size if num_tokens is None else min(num_tokens, m * page_size), head_dim)
        return pages.as_strided(size, (row, batch * row, head_dim, 1))  # one op: [heads, batch, ...] permuted, cut

    # ----- planned decode steps (compiled): tensor operations only ----------------------------------

    def plan_decode(
        self,
        start: int,
        page_ids: torch.Tensor,
        tokens: torch.Tensor | None,
        window: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """Before a planned step at ``start``: counts its token, and returns ``StepPlan``'s ``(key_pages, key_slots,
        filling_page, filling_coded)``.

        Args:
            page_ids: ``[batch, num_pages]`` the rows' pages.
            tokens: ``[batch, num_keys]`` the token of each key attention gets (``-1``: none; read with a ``window``).
            window: a window's ``(first_page, window_pages)`` it reads; ``None``: every page (``key_pages`` and
                ``key_slots`` are then ``None``).
        """
        page_size, device = self.page_size, page_ids.device
        self._advance_planned(start)
        first_page, window_pages = window if window is not None else (0, None)
        filling = (
            torch.tensor([[start // page_size - first_page]], device=device),
            torch.tensor((start + 1) % page_size == 0, device=device).view(1, 1, 1, 1),
        )
        if window_pages is None:
            return None, None, *filling
        pages = torch.full((page_ids.shape[0], 1, window_pages), NULL_PAGE, dtype=torch.long, device=device)
        read = page_ids[:, first_page : first_page + window_pages]
        pages[:, 0, : read.shape[1]] = read
        slots = torch.where(tokens >= 0, tokens - first_page * page_size, 0)  # [batch, num_keys]
        return pages, slots.unsqueeze(1).unsqueeze(-1), *filling

    def replan_decode(self, plan: "Any", start: int) -> None:
        """``plan_decode`` for a step that keeps the step before's plan: only ``filling_coded`` changes (one op)."""
        plan.filling_coded.fill_(self._advance_planned(start))

    def _advance_planned(self, start: int) -> bool:
        """Counts a planned step's token in every layer; returns whether it fills the rows' page."""
        fills = self._fills(start + 1)
        for layer_in_group in self.partial:
            self.written[layer_in_group] = start + 1
        return fills

    def _fills(self, end: int) -> bool:
        return end > 0 and end % self.page_size == 0

    def _filled_targets(self, page_ids: torch.Tensor, end: int, first_page: int = 0) -> torch.Tensor:
        """``[batch, 1]`` the pool page token ``end - 1`` fills (``page_ids``: the table from ``first_page`` on)."""
        column = end // self.page_size - 1 - first_page
        return page_ids[:, column : column + 1]

    def write_planned(self, layer_in_group: int, storage: PoolStorage, plan: "Any", key_states: torch.Tensor) -> None:
        """A planned step's new keys ``[batch, heads, 1, head_dim]`` to their slot of the page still filling, which it
        encodes into its pool page (whole where the step fills it; before, codes nothing reads)."""
        partial = self.partial[layer_in_group]  # [batch, heads, page_size, head_dim]
        partial.index_put_((plan.rows, plan.heads, plan.write_offsets), key_states.detach().to(partial.dtype))
        index = self.codes.store_index(plan.write_pages.view(-1, 1))
        self.codes.store(layer_in_group, storage, partial.unsqueeze(2), index)

    def read_planned(self, layer_in_group: int, storage: PoolStorage, plan: "Any", dtype: torch.dtype) -> torch.Tensor:
        """A planned step's keys ``[batch, heads, num_keys, head_dim]``, the page still filling over its own."""
        index = (plan.layers[layer_in_group], plan.heads, plan.pages if plan.key_pages is None else plan.key_pages)
        decoded = self.codes.decode_indexed(storage, index, dtype)  # [batch, heads, pages, page_size, head_dim]
        batch, heads, num_pages, page_size, head_dim = decoded.shape
        partial = self.partial[layer_in_group].to(dtype)  # [batch, heads, page_size, head_dim]
        filling = (plan.rows.view(-1, 1), plan.heads.view(1, -1), plan.filling_page)
        # The step that fills the page reads it decoded from the codes it wrote, as eager does.
        decoded.index_put_(filling, torch.where(plan.filling_coded, decoded[filling], partial))
        keys = decoded.view(batch, heads, num_pages * page_size, head_dim)
        if plan.key_slots is None:
            return keys
        return keys.gather(2, plan.key_slots.expand(batch, heads, plan.num_keys, head_dim))

    # ----- row changes --------------------------------------------------------------------------

    def select_rows(self, indices: list[int]) -> None:
        for layer_in_group, partial in self.partial.items():
            self.partial[layer_in_group] = partial[torch.tensor(indices, device=partial.device)]

    def crop(self, num_tokens: int, storage: PoolStorage, page_ids: torch.Tensor) -> None:
        """Keeps tokens ``[0, num_tokens)``; a page still filling that moves back to an encoded page is decoded (call
        it after the page table's crop)."""
        for layer_in_group, partial in self.partial.items():
            written = self.written.get(layer_in_group, 0)
            page = num_tokens // self.page_size
            if written // self.page_size != page and page_ids.numel():
                pages = page_ids[:, page : page + 1]  # [batch, 1]
                decoded = self.codes.decode(layer_in_group, storage, pages, partial.dtype).transpose(0, 1)
                self.partial[layer_in_group] = decoded.reshape(partial.shape).clone()  # out of the reused buffer
            self.written[layer_in_group] = min(written, num_tokens)

    def attach(self) -> None:
        """Rows start from a reused prefix: whole pages, encoded."""
        self.release()

    def release(self) -> None:
        self.partial.clear()
        self._partial_views.clear()
        self.written.clear()
        self.codes.release()
