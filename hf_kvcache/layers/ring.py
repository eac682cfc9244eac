"""The sliding ring: a fixed set of pages per row, reused in a circle; one write per token per layer.

A row keeps its first ``sink_tokens`` real tokens pinned and the rest in a ring of ``ring_slots``
slots, laid out over the row's pages as *logical slots*. Rows of a left-padded batch start at different
tokens: row ``r``'s first ``pad_lengths[r]`` tokens are padding, and its tokens count from its first real one
(``u = t - pad_lengths[r]``)::

    token t of row r  ->  nothing (the null page)                  if u < 0 (padding)
                          logical slot u                           if u < sink_tokens
                          sink_tokens + (u - sink_tokens) % ring_slots    otherwise

    logical slot s  ->  slot s % page_size of page rows[r][s // page_size]

The first ``sink_tokens + ring_slots`` tokens fill the pages in order (the table grows a page at
a time, like the growing layer); after that every new token overwrites the oldest ring slot in
place and no page is ever taken again. ``ring_slots`` is the window rounded up to whole pages
plus one spare page, so a step of up to ``page_size`` new tokens is written before it is read
without overwriting a token it still attends to, and a ``crop`` of as many tokens stays exact.

Attention gets the visible tokens in time order (sinks first), gathered slot by slot:

    visible(start, n) = sinks + [first, start + n),    first = max(0, start - window + 1)

which is what transformers' sliding-window layer returns (``window - 1`` past tokens plus the
new ones), so its sliding mask, padding and chunked prefill apply unchanged. Once the window has left
the sinks behind (``first > sink_tokens``) the model's mask has ``sink_tokens`` columns before the
window (``get_mask_sizes``); they hold each row's own sinks, tokens ``[pad, pad + sink_tokens)``, or where
a padded row's window still reaches its sinks, its tokens ``[first - sink_tokens, first)`` in time order. Both
choices put a real, earlier token under a real, earlier column of the model's mask, so every attention
(``sdpa``, ``eager``) masks a padded row exactly as the row alone.

Attention may also be handed a ``KeyLayout`` (in its kwargs, ``hf_kvcache.attention.reads``), read by
``attn_implementation="hf_kvcache"`` (``hf_kvcache.attention.interface``):

- a step of several new tokens carries its *band* ``[batch, n, num_keys]``: which key each new token may
  see, itself and the ``window - 1`` before it plus the sinks. On a model's sliding layer the
  model's mask says the same; on a full-attention layer, where the ring imposes the window and the
  model's mask is plainly causal, the band makes prefill see exactly what decoding does;
- with that attention, and where each row's pages are consecutive in a pool with full-precision values (a fresh
  pool), nothing is gathered at all: attention gets a view of the rows' pages, every slot in slot order, and the
  layout's band (which slot holds a token the step may see) and ``mask_columns`` (where each slot's token sits in
  the model's time-ordered mask, see ``get_mask_sizes``). The update is then only the write: O(1) per token.
"""

from collections.abc import Callable
from typing import Any

import torch

from hf_kvcache.attention.kernels import read_slots, slot_indices
from hf_kvcache.attention.reads import KEY_LAYOUT, KeyLayout
from hf_kvcache.layers.plan import StepPlan
from hf_kvcache.layers.read_path import IN_PLACE
from hf_kvcache.layers.rows import PagedRows
from hf_kvcache.layers.window import band, ring_num_slots, visible_span
from hf_kvcache.memory.allocator import NULL_PAGE
from hf_kvcache.memory.page_pool import PagePool


class RingRows(PagedRows):
    """Page table of one cache's ring layers on one pool (one layer group).

    Args:
        pool: where the pages live.
        window: tokens each query attends to, itself included (transformers' ``sliding_window``).
        sink_tokens: first real tokens of a row kept for good (attention sinks).
        residual_length: as for ``PagedRows``.
        our_attention: whether the model's attention reads a ``KeyLayout`` (``attn_implementation="hf_kvcache"``),
            asked once per step: then keys may come in slot order, as views of the pages.
        process_group: as for ``PagedRows``.
        is_sliding: the model's own mask applies the window (a sliding layer of the model): a step of several tokens
            sees itself and the ``window - 1`` tokens before it, as with transformers' sliding layer, and the model's
            mask decides among them; ``False`` where the ring imposes the window on a full-attention layer.
    """

    defers_codes = False  # a ring's slots wrap around: each token's value codes are written with it

    def __init__(
        self,
        pool: PagePool,
        window: int,
        sink_tokens: int = 0,
        residual_length: int = 0,
        our_attention: Callable[[], bool] = lambda: False,
        process_group: Any = None,
        is_sliding: bool = False,
    ) -> None:
        super().__init__(pool, residual_length, False, our_attention, process_group=process_group)
        self.table.pads_held = False  # a row's slots start at its first real token
        self.is_sliding = is_sliding
        page_size = pool.format.page_size
        if self.store.keys is not None and sink_tokens:
            raise ValueError(
                f"sink_tokens={sink_tokens}: a ring with encoded keys keeps no sinks (its pages must each hold "
                "consecutive tokens); use a pool without key_bits, or sink_tokens=0."
            )
        self.window = window
        self.sink_tokens = sink_tokens
        self.num_slots = ring_num_slots(window, sink_tokens, page_size)  # logical slots per row
        self.ring_slots = self.num_slots - sink_tokens
        self.ring_pages = self.num_slots // page_size
        self._base: int | None = None  # see _first_page
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # see _slot_views

    @property
    def num_tokens(self) -> int:
        return self.total

    @property
    def total(self) -> int:
        """Tokens written per row, evicted ones included: the table's ``num_filled``, which its statistics read."""
        return self.table.num_filled or 0

    @total.setter
    def total(self, value: int) -> None:
        self.table.num_filled = value

    @property
    def max_step(self) -> int:
        """New tokens a step may bring and still be written before the step's tokens are read."""
        return self.ring_slots - self.window + 1

    def update(
        self,
        layer_in_group: int,
        start: int,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        handoff: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes tokens ``[start, start + n)`` of one layer; returns its visible keys and values.

        Args:
            layer_in_group: the layer's index within its layer group.
            key_states / value_states: ``[batch, heads, n, head_dim]``.
            handoff: the attention's kwargs (``attention_kwargs``), where the step's ``KeyLayout`` goes; ``None``:
                the model's attention gets none, so the keys come in time order.

        Returns:
            keys, values ``[batch, heads, num_keys, head_dim]``: the visible tokens in time order (see
            ``visible_span``), or every slot of the rows in slot order (with a ``KeyLayout`` in ``handoff``).
        """
        plan = self.plan_step(layer_in_group, start, key_states, value_states, handoff is not None)
        num_new = plan.num_new
        self.path.reads[plan.mode] += 1
        if plan.mode == IN_PLACE:  # in slot order: the pages themselves (a storage that never moves)
            self.write(plan, layer_in_group, key_states, value_states)
            keys, values = self._slot_views(layer_in_group)
        elif num_new <= self.max_step:  # write first: attention reads the new tokens from their slots
            self.write(plan, layer_in_group, key_states, value_states)
            own = (key_states, value_states) if num_new > 1 else None  # read as given (SlotStore.read)
            keys, values = self._gather(plan, layer_in_group, own)
        else:  # a step longer than the ring: the past it sees, read before the step overwrites it, then its own
            keys, values = self._gather(plan, layer_in_group)
            self.write(plan, layer_in_group, key_states, value_states)  # only its tail stays
            keys, values = torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
        if plan.layout is not None and handoff is not None and self.path.our_attention():  # only our attention reads it
            handoff[KEY_LAYOUT] = plan.layout
        return keys, values

    def _gather(
        self, plan: StepPlan, layer_in_group: int, own: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's visible tokens, gathered in time order as ``plan`` reads them (``own``: the step's states,
        as ``SlotStore.read``'s ``step``)."""
        storage = self.pool.storage
        shape = (plan.slots.shape[0], self.pool.format.num_kv_heads, plan.slots.shape[1])
        gather = lambda tensor: read_slots(storage.slots(tensor, layer_in_group), plan.reads, shape)  # noqa: E731
        keys = self._read_keys(layer_in_group, storage, plan.slots, plan=plan) if self.store.keys is not None else None
        return self.store.read(layer_in_group, storage, gather, plan.window_reads, keys, own)

    def _plan_eager(self, start: int, num_new: int, hands_over: bool) -> StepPlan:
        """What every layer of an eager step writes and reads: each new token's slot (those a row keeps nowhere,
        its padding and in a step longer than the ring the tokens it overwrites itself, go to the null page), and
        either every slot of the rows in slot order (in place: a ``KeyLayout`` handed over, the rows' pages
        consecutive) or the visible tokens in time order (``visible_span``; ``StepPlan.slots`` and ``reads``)."""
        device, batch, end = self.pool.device, self.table.num_rows, start + num_new
        sinks, first = visible_span(start, num_new, self.window, self.sink_tokens)
        new_tokens = torch.arange(start, end, device=device).expand(batch, -1)  # [batch, num_new]
        plan = StepPlan(None, None, *self._write_slots(start, num_new), *self._constants(), 0)
        plan.start, plan.num_new, plan.version = start, num_new, self.table.version
        self._plan_keys(plan)
        pads = self._pad_tensor(batch)
        if num_new <= self.max_step and hands_over and self.path.our_attention() and self._first_page() is not None:
            plan.mode, plan.layout = IN_PLACE, self._slot_layout(start, num_new, sinks, first)
            return plan
        last = end if num_new <= self.max_step else start
        self.store.plan_window(plan, start, num_new, first, last, first - sinks)
        visible = self._visible(start, num_new, last)
        if num_new > 1:  # a single new token sees every visible one
            keys = torch.cat([visible, new_tokens], dim=1) if last == start else visible
            plan.layout = KeyLayout(band(keys, start, num_new, self.window, self.sink_tokens, pads, self.is_sliding))
        plan.slots = self._slots(visible)
        pages, offsets = self._slot_pages(plan.slots)  # [batch, 1, num_keys] each
        fmt, num_pages = self.pool.format, self.pool.storage.num_pages
        plan.reads = slot_indices(pages[:, 0], offsets[:, 0], fmt.num_kv_heads, num_pages, fmt.page_size).view(-1)
        plan.num_keys = visible.shape[1]
        return plan

    def _visible(self, start: int, num_new: int, last: int) -> torch.Tensor:
        """``[batch, n]`` each row's tokens a step at ``start`` sees before token ``last``, in time order
        (``visible_span``): its own sinks, or where its window still reaches them the tokens just before it, then the
        window."""
        device, batch = self.pool.device, self.table.num_rows
        sinks, first = visible_span(start, num_new, self.window, self.sink_tokens)
        window = torch.arange(first, last, device=device).expand(batch, -1)  # [batch, last - first]
        if not sinks:
            return window
        sink_start = self._pad_tensor(batch).clamp(max=first - sinks).unsqueeze(1)  # [batch, 1]
        return torch.cat([sink_start + torch.arange(sinks, device=device), window], dim=1)

    def _write_slots(self, start: int, num_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, 1, n]`` the page and the slot in it of the ring slot each row's tokens ``[start, start + n)``
        take; those a row keeps nowhere (its padding; in a step longer than the ring, the tokens it overwrites itself:
        a row keeps its sinks and its last ``ring_slots`` tokens) go to the null page's first slot."""
        batch, device, end = self.table.num_rows, self.pool.device, start + num_new
        if num_new == 1:  # a decode step: from the host's page table (two small copies, no op on the device)
            page_size, sinks = self.pool.format.page_size, self.sink_tokens
            locals_ = [start - pad for pad in self._pad_list(batch)]  # counted from each row's first real token
            slots = [local if local < sinks else sinks + (local - sinks) % self.ring_slots for local in locals_]
            pages = [row[slot // page_size] if slot >= 0 else NULL_PAGE for row, slot in zip(self.table.rows, slots)]
            offsets = [slot % page_size if slot >= 0 else 0 for slot in slots]
            return tuple(torch.tensor(v, device=device).view(batch, 1, 1) for v in (pages, offsets))
        tokens = torch.arange(start, end, device=device).expand(batch, -1)
        return self._slot_pages(self._slots(tokens, lost_before=end - self.ring_slots))

    def _slot_pages(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The page and the slot in it ``[batch, 1, n]`` of each row's logical slots ``slots [batch, n]`` (``-1``:
        the null page's first slot)."""
        held, page_size = slots >= 0, self.pool.format.page_size
        pages = self._page_ids().gather(1, torch.where(held, slots // page_size, 0)).masked_fill(~held, NULL_PAGE)
        return pages.unsqueeze(1), torch.where(held, slots % page_size, 0).unsqueeze(1)

    def _window_low(self, start: int) -> int:
        return visible_span(start, 1, self.window, self.sink_tokens)[1]

    def _planned_reads(
        self, start: int, batch: int, capacity_pages: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int]:
        """A planned step's visible tokens, each row's in time order as ``update`` gathers them (``visible_span``),
        read slot by slot: ``sink_tokens + window`` keys whatever the step, so that one graph serves the ring as it
        fills and wraps. Before the window has left the sinks behind, keys past the step's token read the null page
        (the causal mask hides them) and the mask starts at token 0; after, every key holds a token."""
        device = self.pool.device
        num_keys = self.sink_tokens + self.window
        sinks, first = visible_span(start, 1, self.window, self.sink_tokens)
        if first:  # the window has left the sinks behind
            tokens = self._visible(start, 1, start + 1)  # [batch, num_keys]
        else:
            tokens = torch.arange(num_keys, device=device).expand(batch, -1)  # [batch, num_keys]
            tokens = tokens.masked_fill(tokens > start, -1)
        slots = self._slots(tokens).masked_fill(tokens < 0, -1)  # [batch, num_keys]; -1: no token
        pages, offsets = self._slot_pages(slots)  # [batch, 1, num_keys] each
        return pages, offsets, tokens, first - sinks

    def check_crop(self, num_tokens: int) -> None:
        """Raises ``ValueError`` if cropping to ``num_tokens`` needs tokens the ring has overwritten."""
        oldest = self.total - self.ring_slots  # oldest ring token still held (of an unpadded row: the strictest)
        needed = max(self.sink_tokens, num_tokens - self.window + 1)
        if needed < oldest and num_tokens > self.sink_tokens:
            raise ValueError(
                f"Cannot crop to {num_tokens} tokens: the ring of window {self.window} has overwritten tokens "
                f"before {oldest}, and token {needed} would be needed. Crop at most {self.max_step} tokens per step."
            )

    def crop(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.total:
            raise ValueError(f"Cannot crop to {num_tokens} tokens: the cache holds {self.total}.")
        self.check_crop(num_tokens)
        if num_tokens < self.table.num_tokens:
            self._apply(lambda: self.table.crop(num_tokens))
        self._crop_keys(num_tokens)
        self.total = num_tokens
        self.written = min(self.written, num_tokens)

    def release(self) -> None:
        super().release()
        self.total = 0

    def prefix_layout(self, num_pages: int) -> list[int | None]:
        """Token page of each ring page after ``num_pages`` full token pages: the sink pages, then the last
        ``ring_pages - 1`` token pages (all the window can see) where the ring puts them; the ring page the next
        token goes to holds none the row needs. Needs ``sink_tokens`` to be whole pages (see ``PrefixTracker``)."""
        sink_pages, ring_pages = self._pages()
        layout: list[int | None] = [None] * min(num_pages, sink_pages + ring_pages)
        for token_page in range(num_pages):
            if token_page < sink_pages or token_page > num_pages - ring_pages:
                layout[self._ring_page(token_page)] = token_page
        return layout

    def token_page_position(self, token_page: int) -> int | None:
        """Where a full token page lies in a row's ring, or ``None`` once the ring has moved past it."""
        sink_pages, _ = self._pages()
        if token_page >= sink_pages and token_page * self.pool.format.page_size + self.ring_slots < self.total:
            return None
        return self._ring_page(token_page)

    def attach(self, pages: list[list[int]], num_tokens: int) -> None:
        super().attach(pages, min(num_tokens, self.num_slots))
        self.total = self.written = num_tokens

    def _pages(self) -> tuple[int, int]:
        """``(sink pages, ring pages)`` of a row whose sinks are whole pages."""
        page_size = self.pool.format.page_size
        return self.sink_tokens // page_size, self.ring_slots // page_size

    def _ring_page(self, token_page: int) -> int:
        sink_pages, ring_pages = self._pages()
        return token_page if token_page < sink_pages else sink_pages + (token_page - sink_pages) % ring_pages

    def _grow(self, batch: int, start: int, num_new: int, identical_rows: list[int] | None) -> None:
        """Takes pages for slots the ring fills for the first time; copies shared pages it overwrites.

        The first write takes the pages of ``planned_tokens`` at once (up to the ring's), so that each row's
        pages follow one another on a fresh pool, as attention reads them in place (``_first_page``).
        """
        end, held = start + num_new, self.table.num_tokens
        planned = self.planned_tokens if held == 0 else 0
        fresh = min(max(end, planned), self.num_slots) - held
        if fresh > 0:
            self._apply(lambda: self.table.grow(batch, fresh, identical_rows))
        # Slots written again (a wrapped ring) or taken ahead (planned) may sit in pages rows share (beams);
        # a prefill's pages are all new, and rows sharing them are identical.
        if start > 0 and (start < held or end > self.num_slots):
            pages = self._pages_taking(batch, max(start, end - self.ring_slots), end)
            self._apply(lambda: self.table.make_private(list(range(batch)), pages))
        self.total = end

    def _pages_taking(self, batch: int, first: int, end: int) -> list[int]:
        """Which of a row's pages (by position) the tokens ``[first, end)`` of any row take (``_slots``'s slots, at
        most ``ring_slots`` tokens after the sinks), ascending: host arithmetic on the rows' padding, so that no
        tensor is read back to the host."""
        page_size, sinks, ring = self.pool.format.page_size, self.sink_tokens, self.ring_slots
        pads = self._pad_list(batch)
        spans = []  # (first slot, end slot) of each row's tokens
        for pad in set(pads):
            low, high = max(first - pad, 0), end - pad  # counted from the row's first real token
            if low < min(high, sinks):
                spans.append((low, min(high, sinks)))
            low = max(low, sinks)
            if high > low:  # ring slots from (low - sinks) % ring on, wrapping once at most
                slot = (low - sinks) % ring
                count = min(high - low, ring)
                spans += [(sinks + slot, sinks + min(slot + count, ring)), (sinks, sinks + slot + count - ring)]
        pages = {page for a, b in spans if b > a for page in range(a // page_size, (b - 1) // page_size + 1)}
        return sorted(pages)

    def _slots(self, tokens: torch.Tensor, lost_before: int | None = None) -> torch.Tensor:
        """``[batch, n]`` logical slot of each row's token ``tokens [batch, n]``; ``-1`` where the row keeps none.

        A row keeps no padding, and (``lost_before``) none of a step's tokens before it past the row's sinks: a
        step longer than the ring overwrites those itself.
        """
        sinks = self.sink_tokens
        local = tokens - self._pad_tensor(tokens.shape[0]).unsqueeze(1)  # [batch, n]: counted from the first real
        slots = torch.where(local < sinks, local, sinks + (local - sinks) % self.ring_slots)
        dropped = local < 0
        if lost_before is not None:
            dropped |= (local >= sinks) & (tokens < lost_before)
        return slots.masked_fill(dropped, -1)

    def _slot_layout(self, start: int, num_new: int, sinks: int, first: int) -> KeyLayout:
        """The layout of every slot the rows hold, read in place: which token each holds, and its mask column."""
        device = self.pool.device
        pads = self._pad_tensor(self._page_ids().shape[0]).unsqueeze(1)  # [batch, 1]
        slots = torch.arange(self._page_ids().shape[1] * self.pool.format.page_size, device=device)  # [num_keys]
        back = (start + num_new - pads) - 1 - slots  # [batch, num_keys]: ring slot s holds s + ring_slots * k
        latest = slots + self.ring_slots * torch.div(back, self.ring_slots, rounding_mode="floor")
        local = torch.where(slots < self.sink_tokens, slots, latest)  # counted from the row's first real token
        tokens = torch.where(back < 0, -1, local + pads)  # [batch, num_keys]; -1: none yet
        offset, num_visible = first - sinks, sinks + start + num_new - first  # the model's mask: get_mask_sizes
        # A row's sinks before the mask's first column stand under its sink columns (real and earlier for the row).
        columns = torch.where(tokens >= offset, tokens - offset, local).clamp(0, num_visible - 1)
        layout_band = band(tokens, start, num_new, self.window, self.sink_tokens, pads.squeeze(1), self.is_sliding)
        return KeyLayout(layout_band, columns)

    def _first_page(self) -> int | None:
        """The rows' first page in a pool of full-precision values, when every row's pages follow one another (row
        after row), so that a view of the pool is all of them in order; ``None`` otherwise."""
        if self._base is None:
            ids = self._page_ids()
            base = int(ids[0, 0])
            consecutive = torch.equal(ids.flatten(), torch.arange(base, base + ids.numel(), device=ids.device))
            if consecutive and not self.pool.format.encodes:
                self._base = base
            else:
                self._base = -1
        return None if self._base < 0 else self._base

    def _slot_views(self, layer_in_group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, heads, num_keys, head_dim]`` of every slot of the rows: views of the pool."""
        views = self._views.get(layer_in_group)
        if views is None:
            pool, ids, base = self.pool, self._page_ids(), self._first_page()
            batch, num_pages = ids.shape
            _, heads, _, page_size, _ = pool.storage.keys.shape

            def view(storage: torch.Tensor) -> torch.Tensor:  # at the keys' or the values' width
                pages = storage[layer_in_group, :, base : base + ids.numel()]  # [heads, rows * pages, page_size, w]
                return pages.view(heads, batch, num_pages * page_size, storage.shape[-1]).permute(1, 0, 2, 3)

            views = self._views[layer_in_group] = (view(pool.storage.keys), view(pool.storage.values))
        return views

    def key_shifts(self, batch: int) -> list[int]:
        """A ring row counts its pages from its first real token (its leading padding is kept nowhere)."""
        pads = self.pad_lengths
        return list(pads) if pads is not None and len(pads) == batch else [0] * batch

    def _apply(self, change) -> None:
        super()._apply(change)
        if self._ids is None:  # page ids changed: the step's indices point at old pages
            self._base = None
            self._views = {}
