"""Keys stored as codes a page at a time (a pool whose format sets ``key_bits``): encoded once, when a page fills.

A row's tokens fill its pages in order. The page still filling is held here in full precision (``partial``, one
page per row and layer, counted in ``memory_stats()``) and its slots in the pool stay unwritten; when its last slot
is written the whole page is encoded (``memory.quant``: per token at 8 bits, per channel over the page's tokens
at 4) and its codes written to the pool, once: they never change while the page stays full. Attention gets every
page decoded into a buffer reused from layer to layer, with the page still filling put over its slots.

Rows count tokens from their ``shift`` (a ring's rows: from their first real token, so that a ring page, which
holds ``page_size`` consecutive tokens of its row, fills in order; growing rows: from 0). Token ``u`` of a row (so
counted) lies in its *token page* ``u // page_size``, at position ``u // page_size`` of the row's pages, or for a
ring of ``ring_pages`` pages, ``(u // page_size) % ring_pages``.

A ``crop`` into a page already encoded takes its codes back as the page still filling (decoded: the kept tokens
lose what their encoding lost); when it fills again it is encoded again. Nothing else re-encodes a page.
"""

from collections.abc import Callable
from typing import Any

import torch

from hf_kvcache.layers.key_codes import Buffer, KeyCodes
from hf_kvcache.memory.allocator import NULL_PAGE
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.storage import PoolStorage


class KeyPages:
    """One layer group's keys as codes in the pool, and each row's page still filling in full precision.

    Args:
        page_format: the pool's format (``key_bits`` set).
        buffer: where decoded keys go (reused; a view of it is valid until the next layer's read).
    """

    def __init__(self, page_format: PageFormat, buffer: Buffer) -> None:
        self.page_size = page_format.page_size
        self.codes = KeyCodes(page_format, buffer)
        self.partial: dict[int, torch.Tensor] = {}  # layer_in_group -> [batch, heads, page_size, head_dim]
        self.written: dict[int, int] = {}  # layer_in_group -> tokens written (padding included)
        self.filled_unencoded: int | None = None  # the end of a page the last planned step filled, not yet encoded
        self._partial_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (partial, heads first)

    @property
    def partial_bytes(self) -> int:
        """Bytes of the full-precision pages still filling, held outside the pool."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self.partial.values())

    # ----- where tokens lie ---------------------------------------------------------------------

    def _filled(self, num_tokens: int, row_shifts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token page, tokens held)`` of each row's page still filling after ``num_tokens`` tokens, ``[batch]``."""
        local = (num_tokens - row_shifts).clamp(min=0)
        return local // self.page_size, local % self.page_size

    def _pages_before(self, num_tokens: int, shifts: list[int]) -> list[int]:
        """``_filled``'s token pages, on the host (no data-dependent read of a device's tensor)."""
        return [max(num_tokens - shift, 0) // self.page_size for shift in shifts]

    @staticmethod
    def _position(token_pages: torch.Tensor, ring_pages: int | None) -> torch.Tensor:
        """Where token pages ``[batch, m]`` lie in their rows' pages."""
        return token_pages if ring_pages is None else token_pages % ring_pages

    # ----- an eager step's plan --------------------------------------------------------------

    def plan_eager(
        self,
        plan: "Any",
        start: int,
        num_new: int,
        page_ids: torch.Tensor,
        shifts: list[int],
        ring_pages: int | None = None,
    ) -> None:
        """What every layer of an eager step writing tokens ``[start, start + n)`` does with its keys
        (``StepPlan.key_ids``, ``key_filling``, ``key_step``): the rows' pages ``page_ids`` flattened, to decode;
        where each row's page still filling lies among them once the step has written (rows counted from 0); and for
        a one-token step after the rows' first tokens, where its key goes in each row's page still filling and, if it
        fills that page, the pool pages it is encoded to and which rows fill it."""
        (batch, m), device, end = page_ids.shape, page_ids.device, start + num_new
        plan.key_ids = page_ids.reshape(-1)
        if ring_pages is None and not any(shifts) and end % self.page_size:
            plan.key_filling = torch.tensor([row * m + end // self.page_size for row in range(batch)], device=device)
        if num_new != 1 or min(start - shift for shift in shifts) < 0:
            return  # the general path of write
        fmt = self.codes.format
        slot = torch.tensor([(start - shift) % self.page_size for shift in shifts], device=device)
        fills, filled = self._fills(end, shifts), None
        if any(fills):
            targets, rows = self._filled_targets(page_ids, end, shifts, ring_pages)
            filled = (self.codes.store_index(targets), None if all(fills) else rows.view(-1, 1, 1, 1))
        plan.key_step = (slot.view(batch, 1, 1, 1).expand(batch, fmt.num_kv_heads, 1, fmt.head_dim), filled)

    # ----- writing ------------------------------------------------------------------------------

    def write(
        self,
        layer_in_group: int,
        storage: PoolStorage,
        start: int,
        key_states: torch.Tensor,
        page_ids: torch.Tensor,
        shifts: list[int],
        ring_pages: int | None = None,
        plan: "Any" = None,
    ) -> None:
        """Takes tokens ``[start, start + n)`` of every row; encodes and stores the pages they fill.

        Call it inside ``PagePool.held()``, with the storage it yields.

        Args:
            key_states: ``[batch, heads, n, head_dim]``.
            page_ids: ``[batch, num_pages]`` the rows' pages (their page table).
            shifts: the token each row counts from (``0``, or a ring row's leading padding).
            ring_pages: the ring's pages per row (``None``: growing rows keep every page).
            plan: the step's (``plan_eager``); a one-token step writes as it says.
        """
        if key_states.requires_grad:
            key_states = key_states.detach()
        if self.filled_unencoded is not None and self.filled_unencoded == start:  # the step after a planned one
            self._encode_partial(storage, page_ids, start, shifts, ring_pages)  # that filled a page, not planned
        if self._write_in_place(layer_in_group, storage, start, key_states, plan):
            return
        batch, page_size, device = key_states.shape[0], self.page_size, key_states.device
        firsts, ends = self._pages_before(start, shifts), self._pages_before(start + key_states.shape[2], shifts)
        froms = firsts if ring_pages is None else [max(first, end - ring_pages) for first, end in zip(firsts, ends)]
        most = max([end - done_from for done_from, end in zip(froms, ends)] + [0])  # pages a row fills in the step
        row_shifts = torch.tensor(shifts, device=device)  # [batch]
        take, first_page, end_page = self._joined(layer_in_group, start, key_states, row_shifts)
        done_from = first_page if ring_pages is None else torch.maximum(first_page, end_page - ring_pages)
        num_done = (end_page - done_from).clamp(min=0)  # [batch] pages filled in this step (a ring: the last ones)
        if most:
            steps = torch.arange(most, device=device)
            token_pages = done_from.unsqueeze(1) + steps  # [batch, most]
            pages = take(self._page_tokens(token_pages))  # [batch, heads, most, page_size, head_dim]
            targets = page_ids.gather(1, self._position(token_pages, ring_pages).clamp(max=page_ids.shape[1] - 1))
            targets = targets.masked_fill(steps >= num_done.unsqueeze(1), NULL_PAGE)  # [batch, most]
            self.codes.store(layer_in_group, storage, pages, self.codes.store_index(targets))
        _, end_held = self._filled(start + key_states.shape[2], row_shifts)
        partial = take(self._page_tokens(end_page.unsqueeze(1))).squeeze(2)  # [batch, heads, page_size, head_dim]
        keep = torch.arange(page_size, device=device) < end_held.unsqueeze(1)  # [batch, page_size]
        self.partial[layer_in_group] = partial = partial.masked_fill(~keep.view(batch, 1, page_size, 1), 0)
        self._heads_first(layer_in_group, partial)  # made here, where the page changes, once
        self.written[layer_in_group] = start + key_states.shape[2]

    def _write_in_place(
        self, layer_in_group: int, storage: PoolStorage, start: int, key_states: torch.Tensor, plan: "Any"
    ) -> bool:
        """A one-token step's key put in its slot of each row's page still filling (one op), as ``plan`` says
        (``StepPlan.key_step``); the rows whose page it fills get that page encoded to their pool page, and a page
        still filling of zeros. ``False``: not such a step after the rows' tokens, nothing written."""
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
        if filled is not None:
            index, rows = filled
            self.codes.store(layer_in_group, storage, partial.unsqueeze(2), index)
            if rows is None:  # every slot is written again before it is read
                partial.zero_()
            else:
                partial.masked_fill_(rows, 0)
        return True

    def _page_tokens(self, token_pages: torch.Tensor) -> torch.Tensor:
        """``[batch, m, page_size]`` the tokens of token pages ``[batch, m]``."""
        return token_pages.unsqueeze(-1) * self.page_size + torch.arange(self.page_size, device=token_pages.device)

    def _joined(
        self, layer_in_group: int, start: int, key_states: torch.Tensor, row_shifts: torch.Tensor
    ) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor]:
        """The keys of a step's tokens and of the page still filling before it, by row-counted token.

        Returns:
            ``(take, first_page, end_page)``: ``take`` maps tokens ``[batch, *shape]`` (row counted, from the page
            still filling before the step to the step's last) to keys ``[batch, heads, *shape, head_dim]``;
            ``[batch]`` the page still filling before and after the step.
        """
        batch, heads, num_new, head_dim = key_states.shape
        page_size = self.page_size
        partial = self.partial.get(layer_in_group)
        if partial is None or partial.shape[0] != batch or start == 0:
            partial = key_states.new_zeros(batch, heads, page_size, head_dim)
        first_page, _ = self._filled(start, row_shifts)  # [batch]
        end_page, _ = self._filled(start + num_new, row_shifts)
        # Token u of a row: in the page still filling (at u - its first token) or among the new ones (past it).
        joined = torch.cat([partial, key_states.to(partial.dtype)], dim=2)  # [batch, heads, page_size + n, head_dim]
        local_start = (start - row_shifts).clamp(min=0).view(batch, 1)

        def take(tokens: torch.Tensor) -> torch.Tensor:
            flat = tokens.view(batch, -1)
            new = page_size + flat - (start - row_shifts).view(batch, 1)
            old = flat - (first_page * page_size).view(batch, 1)
            index = torch.where(flat >= local_start, new, old).clamp(0, page_size + num_new - 1)
            keys = joined.gather(2, index.view(batch, 1, -1, 1).expand(-1, heads, -1, head_dim))
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
        shifts: list[int],
        dtype: torch.dtype,
        ring_pages: int | None = None,
        num_tokens: int | None = None,
        plan: "Any" = None,
    ) -> torch.Tensor:
        """Every slot of the rows' pages ``page_ids [batch, m]``, decoded, with the pages still filling over theirs
        (where the step's ``plan`` says, ``plan_eager``; without one: worked out).

        Returns:
            ``[batch, heads, num_tokens, head_dim]`` (a strided view of a reused buffer), in page order: the first
            ``num_tokens`` slots of each row (all ``m * page_size`` if ``None``).
        """
        ids = plan.key_ids if plan is not None else None
        pages = self.codes.decode(layer_in_group, storage, page_ids, dtype, ids)  # [heads, batch * m, page_size, hd]
        (heads, _, page_size, head_dim), (batch, m) = pages.shape, page_ids.shape
        partial = self.partial.get(layer_in_group)
        written = self.written.get(layer_in_group, 0)
        if partial is not None and partial.shape[0] == batch and ring_pages is None and not any(shifts):
            # Rows counted from 0: the page still filling is page written // page_size of every row, and its
            # slots past the tokens held lie past the tokens read. One op puts it over its decoded slots.
            if written % page_size:
                filling = plan.key_filling if plan is not None else None
                if filling is None:
                    filling = torch.arange(batch, device=pages.device) * m + written // page_size
                pages.index_copy_(1, filling, self._heads_first(layer_in_group, partial).to(dtype))
        elif partial is not None and partial.shape[0] == batch:
            keys = pages.view(heads, batch, m * page_size, head_dim)
            row_shifts = torch.tensor(shifts, device=keys.device)  # [batch]
            page, held = self._filled(written, row_shifts)
            slots = self._position(page, ring_pages) * page_size  # [batch]
            offsets = torch.arange(page_size, device=keys.device)
            index = (slots.unsqueeze(1) + offsets).clamp(max=keys.shape[2] - 1)  # [batch, page_size]
            index = index.view(1, -1, page_size, 1).expand(heads, -1, -1, head_dim)
            keep = (offsets < held.unsqueeze(1)).view(1, -1, page_size, 1)
            current = keys.gather(2, index)
            keys.scatter_(2, index, torch.where(keep, partial.transpose(0, 1).to(dtype), current))
        row = m * page_size * head_dim  # one row's keys of one head, in the buffer
        size = (batch, heads, m * page_size if num_tokens is None else min(num_tokens, m * page_size), head_dim)
        return pages.as_strided(size, (row, batch * row, head_dim, 1))  # one op: [heads, batch, ...] permuted, cut

    # ----- planned decode steps (compiled; growing rows): tensor operations only ------------------

    def plan_decode(
        self,
        storage: PoolStorage,
        start: int,
        page_ids: torch.Tensor,
        tokens: torch.Tensor,
        shifts: list[int],
        ring_pages: int | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """Before a planned step at ``start``: encodes the pages planned steps filled (one step late: the step that
        filled a page only wrote its last key to the page still filling), then plans what the step's keys read
        (``StepPlan.keys_read``).

        Args:
            page_ids: ``[batch, num_pages]`` the rows' pages.
            tokens: ``[batch or 1, num_keys]`` the token of each key attention gets (``-1``: none).
            shifts / ring_pages: as for ``write``.

        Returns:
            ``(key_pages, key_slots, filling_page, filling_coded)``: a ring's pages ``[batch, 1, ring_pages]`` (the
            null page where the ring has none yet) and each key's slot among them ``[batch, 1, num_keys, 1]``
            (``None`` both for rows that keep every page: they read ``StepPlan.pages``); where the row's page still
            filling lies among the pages read ``[batch or 1, 1]``, and whether the step fills it ``[batch or 1, 1, 1,
            1]`` (it is then read through its encoding).
        """
        page_size, device = self.page_size, page_ids.device
        if self.filled_unencoded == start:  # the last step, planned, filled pages: encode them from there
            self._encode_partial(storage, page_ids, start, shifts, ring_pages)
        self._advance_planned(start, shifts)
        # Growing rows count from 0 (one plan for every row); a ring's, from their first real token.
        row_shifts = torch.tensor(shifts if ring_pages is not None else [0], device=device).view(-1, 1)
        local_start = start - row_shifts  # [batch or 1, 1]
        filling = (
            self._position(local_start // page_size, ring_pages),
            ((local_start + 1) % page_size == 0).view(-1, 1, 1, 1),
        )
        if ring_pages is None:
            return None, None, *filling
        pages = torch.full((page_ids.shape[0], 1, ring_pages), NULL_PAGE, dtype=torch.long, device=device)
        pages[:, 0, : page_ids.shape[1]] = page_ids
        local = tokens - row_shifts  # [batch, num_keys]
        slots = torch.where((tokens >= 0) & (local >= 0), local % (ring_pages * page_size), 0)
        return pages, slots.unsqueeze(1).unsqueeze(-1), *filling

    def replan_decode(self, plan: "Any", start: int, shifts: list[int]) -> None:
        """``plan_decode`` for a planned step at ``start`` that keeps the step before's plan (growing rows, the same
        page still filling): only whether the step fills that page changes (one op)."""
        plan.filling_coded.fill_(self._advance_planned(start, shifts))

    def _advance_planned(self, start: int, shifts: list[int]) -> bool:
        """A planned step at ``start`` writes its token in every layer; whether it fills a row's page (encoded the
        step after, ``filled_unencoded``)."""
        fills = any(self._fills(start + 1, shifts))
        self.filled_unencoded = start + 1 if fills else None
        for layer_in_group in self.partial:
            self.written[layer_in_group] = start + 1
        return fills

    def _fills(self, end: int, shifts: list[int]) -> list[bool]:
        """Whether each row's token ``end - 1`` is the last of a page (row counted)."""
        return [end - shift > 0 and (end - shift) % self.page_size == 0 for shift in shifts]

    def _filled_targets(
        self, page_ids: torch.Tensor, end: int, shifts: list[int], ring_pages: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool page of the page each row's token ``end - 1`` fills, ``[batch, 1]`` (the null page where it fills
        none), and which rows it fills, ``[batch]``."""
        filled = torch.tensor(self._fills(end, shifts), device=page_ids.device)  # [batch]
        token_pages = torch.tensor([max(end - shift, 1) for shift in shifts], device=page_ids.device) // self.page_size
        position = self._position(token_pages - 1, ring_pages).clamp(max=page_ids.shape[1] - 1).view(-1, 1)
        return page_ids.gather(1, position).masked_fill(~filled.view(-1, 1), NULL_PAGE), filled

    def _encode_partial(
        self, storage: PoolStorage, page_ids: torch.Tensor, end: int, shifts: list[int], ring_pages: int | None
    ) -> None:
        """Encodes the page ending at token ``end`` that the rows whose page it fills (``_fills``) hold whole as their
        page still filling (the page a planned step filled: planned steps encode it one step late, the step that
        filled it only wrote its last key there)."""
        targets, filled = self._filled_targets(page_ids, end, shifts, ring_pages)
        index = self.codes.store_index(targets)
        for layer_in_group, partial in self.partial.items():
            self.codes.store(layer_in_group, storage, partial.unsqueeze(2), index)
            partial.masked_fill_(filled.view(-1, 1, 1, 1), 0)  # every slot is written again before it is read
        self.filled_unencoded = None

    def write_planned(self, layer_in_group: int, plan: "Any", key_states: torch.Tensor) -> None:
        """A planned step's new keys ``[batch, heads, 1, head_dim]`` to their slot of the page still filling."""
        partial = self.partial[layer_in_group]  # [batch, heads, page_size, head_dim]
        partial.index_put_((plan.rows, plan.heads, plan.write_offsets), key_states.detach().to(partial.dtype))

    def read_planned(self, layer_in_group: int, storage: PoolStorage, plan: "Any", dtype: torch.dtype) -> torch.Tensor:
        """A planned step's keys ``[batch, heads, num_keys, head_dim]``: its pages decoded with the page still filling
        over its own (a ring's, then each key's slot among them)."""
        index = (plan.layers[layer_in_group], plan.heads, plan.pages if plan.key_pages is None else plan.key_pages)
        decoded = self.codes.decode_indexed(storage, index, dtype)  # [batch, heads, pages, page_size, head_dim]
        batch, heads, num_pages, page_size, head_dim = decoded.shape
        partial = self.partial[layer_in_group].to(dtype)  # [batch, heads, page_size, head_dim]
        # The step that fills the page reads it encoded, as eager does (which encodes it in that step).
        partial = torch.where(plan.filling_coded, self.codes.through_encoding(partial), partial)
        decoded.index_put_((plan.rows.view(-1, 1), plan.heads.view(1, -1), plan.filling_page), partial)
        keys = decoded.view(batch, heads, num_pages * page_size, head_dim)
        if plan.key_slots is None:
            return keys
        return keys.gather(2, plan.key_slots.expand(batch, heads, plan.num_keys, head_dim))

    # ----- row changes --------------------------------------------------------------------------

    def select_rows(self, indices: list[int]) -> None:
        for layer_in_group, partial in self.partial.items():
            self.partial[layer_in_group] = partial[torch.tensor(indices, device=partial.device)]

    def crop(
        self,
        num_tokens: int,
        storage: PoolStorage,
        page_ids: torch.Tensor,
        shifts: list[int],
        ring_pages: int | None = None,
    ) -> None:
        """Keeps tokens ``[0, num_tokens)``: a row whose page still filling moves back to an encoded page takes that
        page's decoded keys as its page still filling (call it after the page table's crop)."""
        end = self.filled_unencoded
        if end is not None and num_tokens >= end - self.page_size and page_ids.numel():
            self._encode_partial(storage, page_ids, end, shifts, ring_pages)  # a page a planned step filled, kept
        self.filled_unencoded = None
        for layer_in_group, partial in self.partial.items():
            written = self.written.get(layer_in_group, 0)
            if self._pages_before(written, shifts) != self._pages_before(num_tokens, shifts) and page_ids.numel():
                row_shifts = torch.tensor(shifts, device=partial.device)  # [batch]
                before, _ = self._filled(written, row_shifts)
                after, _ = self._filled(num_tokens, row_shifts)
                moved = (after != before).view(-1, 1, 1, 1)  # [batch, 1, 1, 1]
                position = self._position(after, ring_pages).clamp(max=page_ids.shape[1] - 1)
                pages = page_ids.gather(1, position.unsqueeze(1))  # [batch, 1]
                decoded = self.codes.decode(layer_in_group, storage, pages, partial.dtype).transpose(0, 1)
                self.partial[layer_in_group] = torch.where(moved, decoded, partial)
            self.written[layer_in_group] = min(self.written.get(layer_in_group, 0), num_tokens)

    def attach(self) -> None:
        """Rows start from a reused prefix: whole pages, already encoded (none is still filling)."""
        self.release()

    def release(self) -> None:
        self.partial.clear()
        self._partial_views.clear()
        self.written.clear()
        self.filled_unencoded = None
        self.codes.release()
