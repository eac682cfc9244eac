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

A step of several new tokens also hands attention its *band* (``band_of(keys)``, ``[n, num_visible]``):
which visible token each new token may see, itself and the ``window - 1`` before it plus the sinks.
On a model's sliding layer the model's own mask says the same; on a full-attention layer, where
the ring imposes the window and the model's mask is plainly causal, ``attn_implementation="hf_kvcache"``
(``hf_kvcache.attention``) applies it, so that prefill sees exactly what decoding does.
"""

import math
from collections.abc import Callable

import torch

from hf_kvcache.kernels import ChunkIndex, read_slots, split_by_chunk
from hf_kvcache.layers.paged import PagedLayer
from hf_kvcache.layers.rows import PagedRows
from hf_kvcache.pool import KVPool

BAND_ATTRIBUTE = "hf_kvcache_band"


def band_of(keys: torch.Tensor) -> torch.Tensor | None:
    """The band a ring attached to the keys it returned (``None``: attend as the model's mask says)."""
    return getattr(keys, BAND_ATTRIBUTE, None)


def visible_span(start: int, num_new: int, window: int, sink_tokens: int) -> tuple[int, int]:
    """``(num_sinks, first)``: attention sees tokens ``[0, num_sinks)`` and ``[first, start + num_new)``."""
    first = max(0, start - window + 1)
    if first <= sink_tokens:  # the window reaches back to the sinks: one contiguous span
        return 0, 0
    return sink_tokens, first


def ring_num_slots(window: int, sink_tokens: int, page_size: int) -> int:
    """Logical slots of one row of a ring: the sinks plus the window, rounded up to whole pages, plus a spare page."""
    return page_size * (math.ceil((sink_tokens + window - 1) / page_size) + 1)


class RingRows(PagedRows):
    """Page table of one cache's ring layers on one pool (one group of layers).

    Args:
        pool: where the pages live.
        window: tokens each query attends to, itself included (transformers' ``sliding_window``).
        sink_tokens: first tokens of a row kept for good (attention sinks).
        residual_length: as for ``PagedRows``.
    """

    def __init__(self, pool: KVPool, window: int, sink_tokens: int = 0, residual_length: int = 0) -> None:
        super().__init__(pool, residual_length)
        page_size = pool.format.page_size
        self.window = window
        self.sink_tokens = sink_tokens
        self.num_slots = ring_num_slots(window, sink_tokens, page_size)  # logical slots per row
        self.ring_slots = self.num_slots - sink_tokens
        self.total = 0  # tokens written per row, evicted ones included
        self._step: tuple | None = None  # (start, num_new, *what _step_index returns)
        self._rows: torch.Tensor | None = None  # see _slot_rows

    @property
    def num_tokens(self) -> int:
        return self.total

    @property
    def max_step(self) -> int:
        """New tokens a step may bring and still be written before the step's tokens are read."""
        return self.ring_slots - self.window + 1

    def update(
        self, page_layer: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes tokens ``[start, start + n)`` of one layer; returns its visible keys and values.

        Args:
            page_layer: the layer's place in its group of layers.
            key_states / value_states: ``[batch, heads, n, head_dim]``.

        Returns:
            keys, values ``[batch, heads, num_visible, head_dim]`` in time order (see ``visible_span``); the keys
            of a step of several tokens carry its band (``band_of``).
        """
        self.begin_step(start, key_states, value_states)
        num_new = key_states.shape[-2]
        write, read, kept, band = self._step_index(start, num_new)
        sinks, first = visible_span(start, num_new, self.window, self.sink_tokens)
        batch = key_states.shape[0]

        def gather(chunks: list[torch.Tensor]) -> torch.Tensor:
            return read_slots(chunks, page_layer, read, batch)

        if num_new <= self.max_step:  # write first: attention reads the new tokens from their slots
            self._store(page_layer, start, write, kept, key_states, value_states)
            keys, values = self.store.read(page_layer, gather, start + num_new, start + num_new - first)
        else:
            keys, values = self.store.read(page_layer, gather, start, start - first, start + num_new)
            self._store(page_layer, start, write, kept, key_states, value_states)  # a long chunk: only its tail stays
            attended = self.store.as_attended(value_states)
            keys, values = torch.cat([keys, key_states], dim=-2), torch.cat([values, attended], dim=-2)
        setattr(keys, BAND_ATTRIBUTE, band)  # keys are a fresh tensor of this step
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

    def _grow(self, batch: int, start: int, num_new: int, groups: list[int] | None) -> None:
        """Takes pages for slots the ring fills for the first time; copies shared pages it overwrites."""
        end = start + num_new
        fresh = min(end, self.num_slots) - self.table.num_tokens
        if fresh > 0:
            self._apply(lambda: self.table.grow(batch, fresh, groups))
        if end > self.num_slots and start > 0:  # a prefill's pages are all new: rows sharing them are identical
            first = max(start, self.num_slots, end - self.ring_slots)
            slots = {self._slot(token) // self.pool.format.page_size for token in range(first, end)}
            self._apply(lambda: self.table.make_private(list(range(batch)), sorted(slots)))
        self.total = end

    def _slot(self, token: int) -> int:
        return token if token < self.sink_tokens else self.sink_tokens + (token - self.sink_tokens) % self.ring_slots

    def _step_index(
        self, start: int, num_new: int
    ) -> tuple[list[ChunkIndex], list[ChunkIndex], torch.Tensor | None, torch.Tensor | None]:
        """Slot indices of the step's writes and reads, built by the group's first layer and reused by the rest.

        Returns:
            ``(write, read, kept, band)``: ``kept`` selects the new tokens that are written (``None``: all);
            ``band`` is ``[num_new, num_visible]``, true where a new token may see a visible one (``None`` for
            a single new token, which sees them all).
        """
        if self._step is None or self._step[:2] != (start, num_new):
            device = self.pool.device
            end = start + num_new
            sinks, first = visible_span(start, num_new, self.window, self.sink_tokens)
            last = end if num_new <= self.max_step else start
            read = torch.cat([torch.arange(sinks, device=device), torch.arange(first, last, device=device)])
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
            band = None
            if num_new > 1:
                visible = torch.cat([read, torch.arange(last, end, device=device)])  # [num_visible] tokens
                query = torch.arange(start, end, device=device).unsqueeze(1)  # [num_new, 1]
                band = (visible <= query) & ((visible > query - self.window) | (visible < self.sink_tokens))
            self._step = (start, num_new, self._slot_index(written), self._slot_index(read), kept, band)
        return self._step[2:]

    def _slot_index(self, tokens: torch.Tensor) -> list[ChunkIndex]:
        """Where tokens ``[n]`` of every row live, as ``ChunkIndex`` parts over ``(head, batch, n)``."""
        page_size, sinks, pool = self.pool.format.page_size, self.sink_tokens, self.pool
        slots = torch.where(tokens < sinks, tokens, sinks + (tokens - sinks) % self.ring_slots)  # [n]
        if len(pool.chunk_starts) == 1:  # the common case: one lookup in the rows of every slot
            return [ChunkIndex(0, self._slot_rows()[:, :, slots].reshape(-1), None)]
        page_ids = self._page_ids()[:, slots // page_size]  # [batch, n]
        offsets = (slots % page_size).expand_as(page_ids)  # [batch, n]
        return split_by_chunk(
            page_ids, pool.chunk_starts, pool.chunk_sizes, pool.format.num_kv_heads, offsets, page_size
        )

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

    def _store(
        self,
        page_layer: int,
        start: int,
        parts: list[ChunkIndex],
        kept: torch.Tensor | None,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
    ) -> None:
        self.store.remember(page_layer, start, value_states)
        if kept is not None:
            key_states, value_states = key_states[:, :, kept], value_states[:, :, kept]
        self.store.write(page_layer, parts, key_states, value_states)

    def _apply(self, change) -> None:
        super()._apply(change)
        if self._ids is None:  # page ids changed: the step's indices point at old pages
            self._step = self._rows = None


class RingLayer(PagedLayer):
    """One model layer's KV store as a ring of the last ``window`` tokens (plus ``sink_tokens`` pinned).

    Args:
        layer_idx / page_layer: as for ``PagedLayer``.
        bind: returns the ``RingRows`` of the layer's group for the device and dtype of the first states written.
        window / sink_tokens: as for ``RingRows``.
        is_sliding: the model's own mask applies this window (a sliding layer); ``False`` where the
            ring imposes the window on a full-attention layer.
    """

    def __init__(
        self,
        layer_idx: int,
        page_layer: int,
        bind: Callable[[torch.Tensor], RingRows],
        window: int,
        sink_tokens: int = 0,
        is_sliding: bool = True,
    ) -> None:
        super().__init__(layer_idx, page_layer, bind)
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
        keys, values = self.rows.update(self.page_layer, self.num_tokens, key_states, value_states)
        self.num_tokens += key_states.shape[-2]
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of what ``update`` returns; sinks are placed just before the window."""
        sinks, first = visible_span(self.num_tokens, query_length, self.window, self.sink_tokens)
        return sinks + self.num_tokens + query_length - first, first - sinks

    def get_max_length(self) -> int:
        return self.window + self.sink_tokens
