"""Keys stored as codes a page at a time (``KeyPages``; a format that sets ``key_bits``), encoded once a page fills.

The page still filling is held in full precision (``partial``) and attention reads it from there. Every row counts
tokens from 0, its padding included, so token ``t`` lies in token page ``t // page_size`` of every row's table and one
plan serves every row. Eager and planned steps go through one ``plan``, ``write`` and ``read``: a step of one token per
row puts its key in the page still filling and encodes the page when it fills it (a planned step, whose graph cannot
branch on the fill, encodes the page still filling every step: the fill's codes are written last); a step of several
tokens encodes the pages it fills. A ``crop`` into an encoded page decodes it back as the page still filling.
"""

from collections.abc import Callable
from typing import Any

import torch

from hf_kvcache.attention.kernels import page_rows
from hf_kvcache.layers.key_codes import KeyCodes
from hf_kvcache.memory.allocator import NULL_PAGE
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.storage import PoolStorage


class KeyPages:
    """One layer group's keys as codes in the pool."""

    def __init__(
        self, page_format: PageFormat, buffer: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]
    ) -> None:
        self.page_size = page_format.page_size
        self.codes = KeyCodes(page_format)
        self._buffer = buffer  # SlotStore._buffer: an eager step decodes into one kept buffer
        self.partial: dict[int, torch.Tensor] = {}  # layer_in_group -> [batch * heads, page_size, head_dim]
        self.end = 0  # tokens every layer holds once the step planned last is written (padding included)

    @property
    def partial_bytes(self) -> int:
        """Bytes of the full-precision pages still filling, held outside the pool."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self.partial.values())

    # ----- a step's plan -------------------------------------------------------------------------

    def plan(
        self,
        page_ids: torch.Tensor,
        start: int,
        num_new: int,
        first_page: int = 0,
        read_pages: int | None = None,
        window_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """A step's ``StepPlan`` ``(key_rows, key_slots, filling_rows, filling_coded)``: it writes tokens ``[start,
        start + n)`` and decodes the pages it reads, its ``StepPlan.reads`` (coded keys are gathered) from token page
        ``first_page`` on; ``key_rows`` comes as pages ``[batch, pages]`` (the caller makes them rows) or ``None``
        (``reads``).

        Args:
            page_ids: ``[batch, num_pages]`` the rows' pages.
            first_page: the first token page the step reads (a window's first visible token's).
            read_pages: a planned step's (one token per row) pages read per row; ``None``: an eager step, which
                reads its rows' pages up to its last token's.
            window_tokens: a planned window's ``[batch, num_keys]`` each key's token (``-1``: none): it decodes
                ``read_pages`` pages (its ``reads`` are slots).
        """
        page_size, device, (batch, _), end = self.page_size, page_ids.device, page_ids.shape, start + num_new
        rows = batch * self.codes.format.num_kv_heads
        held = self.partial and all(partial.shape[0] == rows for partial in self.partial.values())
        token = num_new == 1 and start > 0 and bool(held)  # else the step writes as one of several tokens
        if read_pages is not None and not token:
            raise RuntimeError(
                f"A planned step at token {start} finds no page of coded keys still filling for its {batch} rows: "
                "planned steps follow an eager step (a prefill) of the same rows."
            )
        self.end = end
        # An eager step reads the page still filling after it (none where it filled one: encoded as it wrote), a
        # planned step the one its token goes to, through its codes where the token fills it.
        column = start // page_size if read_pages is not None else end // page_size if end % page_size else None
        num_pages = read_pages or -(-end // page_size) - first_page  # decoded per row (and head)
        filling_rows = None
        if column is not None:  # [batch * heads]: the page still filling, in each row's and head's decoded pages
            filling_rows = torch.arange(column - first_page, rows * num_pages, num_pages, device=device)
        filling_coded = torch.full((1, 1, 1), end % page_size == 0, device=device) if token else None
        if window_tokens is None:
            return None, None, filling_rows, filling_coded
        pages = torch.full((batch, num_pages), NULL_PAGE, dtype=torch.long, device=device)
        read = page_ids[:, first_page : first_page + num_pages]
        pages[:, : read.shape[1]] = read
        slots = torch.where(window_tokens >= 0, window_tokens - first_page * page_size, 0)  # [batch, num_keys]
        return pages, slots.unsqueeze(1).unsqueeze(-1), filling_rows, filling_coded

    def replan(self, plan: "Any", start: int) -> None:
        """``plan`` for a planned step that keeps the step before's plan (the same page still filling): only
        ``filling_coded`` changes (one op)."""
        self.end = start + 1
        plan.filling_coded.fill_(self.end % self.page_size == 0)

    # ----- writing ------------------------------------------------------------------------------

    def write(
        self,
        layer_in_group: int,
        storage: PoolStorage,
        plan: "Any",
        key_states: torch.Tensor,
        page_ids: Callable[[], torch.Tensor],
    ) -> None:
        """Takes the step's tokens ``[batch, heads, n, head_dim]`` of every row: one token per row to its slot of the
        page still filling, several with the pages they fill encoded and stored (``page_ids()``: the rows' pages
        ``[batch, num_pages]``, asked only then)."""
        if key_states.requires_grad:
            key_states = key_states.detach()
        if plan.filling_coded is not None:  # one token per row (plan)
            partial = self.partial[layer_in_group]  # [batch * heads, page_size, head_dim]
            partial.index_put_((plan.partial_index, plan.write_offsets), key_states.to(partial.dtype))
            if plan.ahead or (plan.start + 1) % self.page_size == 0:  # it fills the page (a graph: it may)
                page = partial.view(*plan.partial_index.shape, *partial.shape[1:])  # [batch, heads, 1, ...]
                self.codes.store(storage, page, (plan.layers[layer_in_group], plan.heads, plan.write_pages))
                if not plan.ahead:  # every slot is written again before it is read
                    partial.zero_()
            return
        page_size, device, start = self.page_size, key_states.device, plan.start
        end = start + key_states.shape[2]
        take, first_page, end_page = self._joined(layer_in_group, start, key_states)
        if end_page > first_page:  # pages the step fills
            token_pages = torch.arange(first_page, end_page, device=device).unsqueeze(0)  # [1, m]
            pages = take(self._page_tokens(token_pages))  # [batch, heads, m, page_size, head_dim]
            targets = page_ids()[:, first_page:end_page].unsqueeze(1)  # [batch, 1, m]
            self.codes.store(storage, pages, (plan.layers[layer_in_group], plan.heads, targets))
        partial = take(self._page_tokens(torch.tensor([[end_page]], device=device)))  # [batch, heads, 1, ...]
        held = torch.arange(page_size, device=device) < end % page_size  # [page_size]
        partial = partial.masked_fill(~held.view(1, 1, 1, page_size, 1), 0)
        self.partial[layer_in_group] = partial.flatten(0, 2)  # [batch * heads, page_size, head_dim]

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
        if partial is None or partial.shape[0] != batch * heads or start == 0:
            partial = key_states.new_zeros(batch * heads, page_size, head_dim)
        partial = partial.view(batch, heads, page_size, head_dim)
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

    def read(self, layer_in_group: int, storage: PoolStorage, plan: "Any", dtype: torch.dtype) -> torch.Tensor:
        """A step's keys ``[batch, heads, num_keys, head_dim]`` in ``dtype``: its pages decoded, the page still filling
        over its own."""
        rows = plan.reads if plan.key_rows is None else plan.key_rows  # [batch * heads * pages]
        fmt, (batch, heads, _), out = self.codes.format, plan.partial_index.shape, None
        if fmt.keys_per_channel and not torch.compiler.is_compiling():  # valid until the next layer's read
            out = self._buffer("keys", (rows.numel(), self.page_size, fmt.head_dim), torch.float32)
        decoded = self.codes.decode(storage, layer_in_group, rows, dtype, out)  # [rows, page_size, head_dim]
        if plan.filling_rows is not None:
            partial = self.partial[layer_in_group].to(dtype)  # [batch * heads, page_size, head_dim]
            if plan.ahead:  # where its token fills the page, the codes it wrote, as an eager step reads them
                partial = torch.where(plan.filling_coded, decoded.index_select(0, plan.filling_rows), partial)
            decoded.index_copy_(0, plan.filling_rows, partial)
        row, head_dim = rows.numel() // (batch * heads) * self.page_size, fmt.head_dim  # a row's keys decoded
        if plan.key_slots is not None:  # a planned window's: each key's slot
            keys = decoded.view(batch, heads, row, head_dim)
            return keys.gather(2, plan.key_slots.expand(batch, heads, plan.num_keys, head_dim))
        first = plan.kv_offset % self.page_size  # the first key's slot
        if not first and plan.num_keys == row:  # every slot (a planned step's)
            return decoded.view(batch, heads, row, head_dim)
        # The keys from token kv_offset on in one op: decoded is contiguous (offset 0)
        stride = (heads * row * head_dim, row * head_dim, head_dim, 1)
        return decoded.as_strided((batch, heads, plan.num_keys, head_dim), stride, first * head_dim)

    # ----- row changes --------------------------------------------------------------------------

    def select_rows(self, indices: list[int]) -> None:
        for layer_in_group, partial in self.partial.items():  # [batch * heads, ...]: by row, each row's heads
            rows = partial.unflatten(0, (-1, self.codes.format.num_kv_heads))
            self.partial[layer_in_group] = rows[torch.tensor(indices, device=partial.device)].flatten(0, 1)

    def crop(self, num_tokens: int, storage: PoolStorage, page_ids: torch.Tensor) -> None:
        """Keeps tokens ``[0, num_tokens)``; a page still filling that moves back to an encoded page is decoded (call
        it after the page table's crop)."""
        page = num_tokens // self.page_size
        if self.end // self.page_size != page and page_ids.numel():
            pages = page_ids[:, page : page + 1]  # [batch, 1] (none: the crop ends on a page's end)
            rows = page_rows(pages, self.codes.format.num_kv_heads, storage.num_pages)
            for layer_in_group, partial in self.partial.items():
                if not pages.numel():
                    partial.zero_()
                    continue
                self.partial[layer_in_group] = self.codes.decode(storage, layer_in_group, rows, partial.dtype)
        self.end = min(self.end, num_tokens)

    def attach(self) -> None:
        """Rows start from a reused prefix: whole pages, encoded."""
        self.release()

    def release(self) -> None:
        self.partial.clear()
        self.end = 0
