"""The sliding ring: a fixed set of pages per row, reused in a circle; one write per token per layer.

A row keeps its first ``sink_tokens`` tokens pinned and the rest in a ring of ``ring_slots``
slots, laid out over the row's pages as *logical slots*::

    token t  ->  logical slot t                                  if t < sink_tokens
                 sink_tokens + (t - sink_tokens) % ring_slots    otherwise

    logical slot s  ->  slot s % page_size of page rows[r][s // page_size]

The first ``sink_tokens + ring_slots`` tokens fill the pages in order (the table grows a page at
a time, like the paged layer); after that every new token overwrites the oldest ring slot in
place and no page is ever taken again. ``ring_slots`` is the window rounded up to whole pages
plus one spare page, so a step of up to ``page_size`` new tokens is written before it is read
without overwriting a token it still attends to, and a ``crop`` of as many tokens stays exact.

Attention gets the visible tokens in time order (sinks first), gathered slot by slot:

    visible(start, n) = [0, sink_tokens) + [max(0, start - window + 1), start + n)

which is what transformers' sliding-window layer returns (``window - 1`` past tokens plus the
new ones), so its sliding mask, padding and chunked prefill apply unchanged.

Attention may also be handed a ``KeyLayout`` with the keys (``layout_of(keys)``), read by
``attn_implementation="hf_kvcache"`` (``hf_kvcache.attention``):

- a step of several new tokens carries its *band* ``[n, num_keys]``: which key each new token may
  see, itself and the ``window - 1`` before it plus the sinks. On a model's sliding layer the
  model's mask says the same; on a full-attention layer, where the ring imposes the window and the
  model's mask is plainly causal, the band makes prefill see exactly what decoding does;
- with that attention, and where each row's pages are consecutive in a one-chunk pool with
  full-precision values (a fresh pool), nothing is gathered at all: attention gets a view of the
  rows' pages, every slot in slot order, and the layout's band (which slot holds a token the step may
  see) and ``mask_columns`` (where each slot's token sits in the model's time-ordered mask, see
  ``get_mask_sizes``). The update is then only the write: O(1) per token.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_kvcache.kernels import ChunkIndex, read_slots, split_by_chunk
from hf_kvcache.layers.paged import PagedLayer
from hf_kvcache.layers.rows import PagedRows
from hf_kvcache.pool import KVPool

LAYOUT_ATTRIBUTE = "hf_kvcache_layout"


@dataclass(frozen=True)
class KeyLayout:
    """What attention must know of the keys a ring returned, beyond the model's mask.

    Attributes:
        band: ``[num_new, num_keys]``, true where a new token may see a key (causality, window and sinks;
            false for a slot that holds no token the step may see).
        mask_columns: ``[num_keys]``, the column of the model's mask (built for the visible tokens in time
            order) that applies to each key; ``None`` when the keys come in that order.
    """

    band: torch.Tensor
    mask_columns: torch.Tensor | None = None


def layout_of(keys: torch.Tensor) -> KeyLayout | None:
    """The layout a ring attached to the keys it returned (``None``: attend as the model's mask says)."""
    return getattr(keys, LAYOUT_ATTRIBUTE, None)


def band(tokens: torch.Tensor, start: int, num_new: int, window: int, sink_tokens: int) -> torch.Tensor:
    """``[num_new, n]``: may new token ``start + i`` see token ``tokens[j]`` (its window, the sinks; ``-1``: none)."""
    query = torch.arange(start, start + num_new, device=tokens.device).unsqueeze(1)  # [num_new, 1]
    seen = (tokens <= query) & ((tokens > query - window) | (tokens < sink_tokens))
    return seen & (tokens >= 0)


def visible_span(start: int, num_new: int, window: int, sink_tokens: int) -> tuple[int, int]:
    """``(num_sinks, first)``: attention sees tokens ``[0, num_sinks)`` and ``[first, start + num_new)``."""
    first = max(0, start - window + 1)
    if first <= sink_tokens:  # the window reaches back to the sinks: one contiguous span
        return 0, 0
    return sink_tokens, first


def ring_num_slots(window: int, sink_tokens: int, page_size: int) -> int:
    """Logical slots of one row of a ring: the sinks plus the window, rounded up to whole pages, plus a spare page."""
    return page_size * (math.ceil((sink_tokens + window - 1) / page_size) + 1)


@dataclass(frozen=True)
class RingStep:
    """Where one step's tokens ``[start, start + num_new)`` are written and read, in every layer of a layer group.

    Built by the layer group's first layer of the step and reused by the others. A step either reads the rows'
    pages in place (``write_rows`` set; attention gets every slot in slot order, as ``layout`` says) or gathers
    the visible tokens in time order (``write_parts`` and ``read`` set).

    Attributes:
        start / num_new: the step's first token and its number of new tokens.
        layout: what attention must know beyond the model's mask; ``None`` for a single new token read in time
            order (it sees every key).
        kept: ``[num_kept]`` the new tokens that are written (a step longer than the ring overwrites itself and
            keeps its sinks and its last ``ring_slots`` tokens); ``None``: all of them.
        write_rows: in place only: ``[batch * heads * num_kept]`` rows of the one chunk's flattened layer view the
            kept states go to, in ``(batch, head, token)`` order.
        write_parts: gathered only: the kept tokens' slots, as ``ChunkIndex`` parts over ``(head, batch, token)``.
        read: gathered only: the visible tokens' slots, in time order, as ``ChunkIndex`` parts.
    """

    start: int
    num_new: int
    layout: KeyLayout | None
    kept: torch.Tensor | None = None
    write_rows: torch.Tensor | None = None
    write_parts: list[ChunkIndex] | None = None
    read: list[ChunkIndex] | None = None

    @property
    def in_place(self) -> bool:
        """Attention reads the rows' pages themselves, in slot order."""
        return self.write_rows is not None


class RingRows(PagedRows):
    """Page table of one cache's ring layers on one pool (one layer group).

    Args:
        pool: where the pages live.
        window: tokens each query attends to, itself included (transformers' ``sliding_window``).
        sink_tokens: first tokens of a row kept for good (attention sinks).
        residual_length: as for ``PagedRows``.
        reads_slots: whether the model's attention reads a ``KeyLayout`` (``attn_implementation="hf_kvcache"``),
            asked once per step: then keys may come in slot order, as views of the pages.
    """

    def __init__(
        self,
        pool: KVPool,
        window: int,
        sink_tokens: int = 0,
        residual_length: int = 0,
        reads_slots: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__(pool, residual_length)
        self._reads_slots = reads_slots
        page_size = pool.format.page_size
        self.window = window
        self.sink_tokens = sink_tokens
        self.num_slots = ring_num_slots(window, sink_tokens, page_size)  # logical slots per row
        self.ring_slots = self.num_slots - sink_tokens
        self.total = 0  # tokens written per row, evicted ones included
        self.planned_tokens = 0  # tokens a row is expected to reach (``PoolCache.plan``); see _grow
        self._step: RingStep | None = None  # the current step's, see _step_index
        self._rows: torch.Tensor | None = None  # see _slot_rows
        self._base: int | None = None  # see _first_page
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # see _slot_views

    @property
    def num_tokens(self) -> int:
        return self.total

    @property
    def max_step(self) -> int:
        """New tokens a step may bring and still be written before the step's tokens are read."""
        return self.ring_slots - self.window + 1

    def update(
        self, layer_in_group: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes tokens ``[start, start + n)`` of one layer; returns its visible keys and values.

        Args:
            layer_in_group: the layer's index within its layer group.
            key_states / value_states: ``[batch, heads, n, head_dim]``.

        Returns:
            keys, values ``[batch, heads, num_keys, head_dim]``: the visible tokens in time order (see
            ``visible_span``), or every slot of the rows in slot order; the keys may carry a ``KeyLayout``.
        """
        self.begin_step(start, key_states, value_states)
        num_new = key_states.shape[-2]
        step = self._step_index(start, num_new)
        if step.in_place:  # in slot order: the pages themselves
            keys, values = self._slot_views(layer_in_group)
            head_dim = keys.shape[-1]
            for pages, states in zip(self._flat_views(layer_in_group), (key_states, value_states)):
                pages.index_copy_(0, step.write_rows, states.detach().reshape(-1, head_dim))
        else:
            _, first = visible_span(start, num_new, self.window, self.sink_tokens)
            end, batch = start + num_new, key_states.shape[0]

            def gather(chunks: list[torch.Tensor]) -> torch.Tensor:
                return read_slots(chunks, layer_in_group, step.read, batch)

            if num_new <= self.max_step:  # write first: attention reads the new tokens from their slots
                self._store(layer_in_group, step, key_states, value_states)
                keys, values = self.store.read(layer_in_group, gather, end=end, limit=end - first)
            else:
                keys, values = self.store.read(layer_in_group, gather, end=start, limit=start - first, newest=end)
                self._store(layer_in_group, step, key_states, value_states)  # only its tail stays
                attended = self.store.as_attended(value_states)
                keys, values = torch.cat([keys, key_states], dim=-2), torch.cat([values, attended], dim=-2)
        if step.layout is not None:
            setattr(keys, LAYOUT_ATTRIBUTE, step.layout)
        return keys, values

    def check_crop(self, num_tokens: int) -> None:
        """Raises ``ValueError`` if cropping to ``num_tokens`` needs tokens the ring has overwritten."""
        oldest = self.total - self.ring_slots  # oldest ring token still held
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
        self.total = num_tokens

    def release(self) -> None:
        super().release()
        self.total = 0

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
            first = max(start, end - self.ring_slots)
            pages = {self._slot(token) // self.pool.format.page_size for token in range(first, end)}
            self._apply(lambda: self.table.make_private(list(range(batch)), sorted(pages)))
        self.total = end

    def _slot(self, token: int) -> int:
        return token if token < self.sink_tokens else self.sink_tokens + (token - self.sink_tokens) % self.ring_slots

    def _step_index(self, start: int, num_new: int) -> RingStep:
        """The step's slot indices: built by the layer group's first layer of the step, reused by the rest."""
        if self._step is None or (self._step.start, self._step.num_new) != (start, num_new):
            device = self.pool.device
            end = start + num_new
            sinks, first = visible_span(start, num_new, self.window, self.sink_tokens)
            # A chunk longer than the ring overwrites itself: only its sinks and its last ring_slots tokens stay.
            lost_from, lost_to = max(start, self.sink_tokens), end - self.ring_slots
            written, kept = torch.arange(start, end, device=device), None
            if lost_to > lost_from:
                kept = torch.cat(
                    [
                        torch.arange(lost_from - start, device=device),
                        torch.arange(lost_to - start, num_new, device=device),
                    ]
                )
                written = written[kept]
            if num_new <= self.max_step and self._reads_slots() and self._first_page() is not None:
                slots = self._slots(written)
                rows = self._slot_rows()[:, :, slots].transpose(0, 1).reshape(-1)  # (batch, head, token) order
                layout = self._slot_layout(start, num_new, sinks, first)
                self._step = RingStep(start, num_new, layout, write_rows=rows)
                return self._step
            last = end if num_new <= self.max_step else start
            visible = torch.cat([torch.arange(sinks, device=device), torch.arange(first, end, device=device)])
            read = self._slot_index(visible[: visible.numel() - (end - last)])
            layout = None  # a single new token sees every visible one
            if num_new > 1:
                layout = KeyLayout(band(visible, start, num_new, self.window, self.sink_tokens))
            self._step = RingStep(start, num_new, layout, kept, write_parts=self._slot_index(written), read=read)
        return self._step

    def _slot_layout(self, start: int, num_new: int, sinks: int, first: int) -> KeyLayout:
        """The layout of every slot the rows hold, read in place: which token each holds, and its mask column."""
        end, device = start + num_new, self.pool.device
        slots = torch.arange(self._page_ids().shape[1] * self.pool.format.page_size, device=device)  # [num_keys]
        back = end - 1 - slots  # ring slot s holds tokens s + ring_slots * k: the last one is below end
        latest = slots + self.ring_slots * torch.div(back, self.ring_slots, rounding_mode="floor")
        tokens = torch.where(back < 0, -1, torch.where(slots < self.sink_tokens, slots, latest))  # -1: none yet
        num_visible = sinks + end - first  # the model's mask columns: get_mask_sizes
        columns = torch.where(tokens < sinks, tokens, tokens - first + sinks).clamp(0, num_visible - 1)
        return KeyLayout(band(tokens, start, num_new, self.window, self.sink_tokens), columns)

    def _first_page(self) -> int | None:
        """The rows' first page in a one-chunk pool of full-precision values when every row's pages follow one
        another (row after row), so that a view of the pool is all of them in order; ``None`` otherwise."""
        if self._base is None:
            pool, ids = self.pool, self._page_ids()
            base = int(ids[0, 0])
            in_place = len(pool.chunk_starts) == 1 and self.store.quant is None
            if in_place and torch.equal(ids.flatten(), torch.arange(base, base + ids.numel(), device=ids.device)):
                self._base = base - pool.chunk_starts[0]
            else:
                self._base = -1
        return None if self._base < 0 else self._base

    def _flat_views(self, layer_in_group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-chunk pool's keys and values of one layer as ``[heads * pages * page_size, head_dim]`` rows."""
        head_dim = self.pool.format.head_dim
        return self.pool.keys[0][layer_in_group].view(-1, head_dim), self.pool.values[0][layer_in_group].view(
            -1, head_dim
        )

    def _slot_views(self, layer_in_group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, heads, num_keys, head_dim]`` of every slot of the rows: views of the pool."""
        views = self._views.get(layer_in_group)
        if views is None:
            pool, ids, base = self.pool, self._page_ids(), self._first_page()
            batch, num_pages = ids.shape
            _, heads, _, page_size, head_dim = pool.keys[0].shape

            def view(chunk: torch.Tensor) -> torch.Tensor:
                pages = chunk[
                    layer_in_group, :, base : base + ids.numel()
                ]  # [heads, rows * pages, page_size, head_dim]
                return pages.view(heads, batch, num_pages * page_size, head_dim).permute(1, 0, 2, 3)

            views = self._views[layer_in_group] = (view(pool.keys[0]), view(pool.values[0]))
        return views

    def _slot_index(self, tokens: torch.Tensor) -> list[ChunkIndex]:
        """Where tokens ``[n]`` of every row live, as ``ChunkIndex`` parts over ``(head, batch, n)``."""
        page_size, pool = self.pool.format.page_size, self.pool
        slots = self._slots(tokens)  # [n]
        if len(pool.chunk_starts) == 1:  # the common case: one lookup in the rows of every slot
            return [ChunkIndex(0, self._slot_rows()[:, :, slots].reshape(-1), None)]
        page_ids = self._page_ids()[:, slots // page_size]  # [batch, n]
        offsets = (slots % page_size).expand_as(page_ids)  # [batch, n]
        return split_by_chunk(
            page_ids, pool.chunk_starts, pool.chunk_sizes, pool.format.num_kv_heads, offsets, page_size
        )

    def _slots(self, tokens: torch.Tensor) -> torch.Tensor:
        """The logical slot of each token ``[n]``."""
        sinks = self.sink_tokens
        return torch.where(tokens < sinks, tokens, sinks + (tokens - sinks) % self.ring_slots)

    def _slot_rows(self) -> torch.Tensor:
        """``[heads, batch, slots]``: the row of each logical slot in a one-chunk pool's flattened layer view."""
        if self._rows is None:
            pool = self.pool
            page_size = pool.format.page_size
            heads = torch.arange(pool.format.num_kv_heads, device=pool.device).view(-1, 1, 1, 1)
            pages = self._page_ids().unsqueeze(-1)  # [batch, pages, 1]
            offsets = torch.arange(page_size, device=pool.device)  # [page_size]
            rows = (heads * pool.chunk_sizes[0] + pages) * page_size + offsets  # [heads, batch, pages, page_size]
            self._rows = rows.flatten(2)
        return self._rows

    def _store(self, layer_in_group: int, step: RingStep, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Writes the step's kept states ``[batch, heads, num_new, head_dim]`` into their slots (gathered steps)."""
        self.store.remember(layer_in_group, step.start, value_states)
        if step.kept is not None:
            key_states, value_states = key_states[:, :, step.kept], value_states[:, :, step.kept]
        self.store.write(layer_in_group, step.write_parts, key_states, value_states)

    def _apply(self, change) -> None:
        super()._apply(change)
        if self._ids is None:  # page ids changed: the step's indices point at old pages
            self._step = self._rows = self._base = None
            self._views = {}


class RingLayer(PagedLayer):
    """One model layer's KV store as a ring of the last ``window`` tokens (plus ``sink_tokens`` pinned).

    Args:
        layer_idx / layer_in_group: as for ``PagedLayer``.
        bind: returns the ``RingRows`` of the layer's layer group for the device and dtype of the first states written.
        window / sink_tokens: as for ``RingRows``.
        is_sliding: the model's own mask applies this window (a sliding layer); ``False`` where the
            ring imposes the window on a full-attention layer.
    """

    def __init__(
        self,
        layer_idx: int,
        layer_in_group: int,
        bind: Callable[[torch.Tensor], RingRows],
        window: int,
        sink_tokens: int = 0,
        is_sliding: bool = True,
    ) -> None:
        super().__init__(layer_idx, layer_in_group, bind)
        self.window = window
        self.sink_tokens = sink_tokens
        self.is_sliding = is_sliding

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layer_idx={self.layer_idx}, window={self.window}, "
            f"sink_tokens={self.sink_tokens}, num_tokens={self.num_tokens})"
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores ``[batch, heads, n, head_dim]`` new states; returns the visible ones in time order."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.rows.update(self.layer_in_group, self.num_tokens, key_states, value_states)
        self.num_tokens += key_states.shape[-2]
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of what ``update`` returns; sinks are placed just before the window."""
        sinks, first = visible_span(self.num_tokens, query_length, self.window, self.sink_tokens)
        return sinks + self.num_tokens + query_length - first, first - sinks

    def get_max_length(self) -> int:
        return self.window + self.sink_tokens
