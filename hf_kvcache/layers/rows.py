"""The rows of one layer group of a cache on one pool: its page table plus the index tensors attention needs.

All layers of a layer group that live on the same device share one ``PagedRows``. The first layer to
receive a step's new tokens grows the page table (allocating and copying-on-write for every
layer at once, since a page id addresses the same slots in every layer); the layers after it
find the table already grown and reuse the same index tensors.
"""

from collections.abc import Callable

import torch

from hf_kvcache.kernels import ChunkIndex, read_pages, split_by_chunk
from hf_kvcache.layers.store import SlotStore
from hf_kvcache.pool import KVPool


def find_identical_rows(key_states: torch.Tensor, value_states: torch.Tensor) -> list[int] | None:
    """For each row, the first row with identical keys and values (``None`` if all rows differ).

    Args:
        key_states / value_states: ``[batch, heads, seq_len, head_dim]``.
    """
    batch = key_states.shape[0]
    if batch == 1:
        return None
    signature = (key_states.flatten(1).sum(1) + value_states.flatten(1).sum(1)).tolist()  # [batch]
    firsts = list(range(batch))
    for row in range(1, batch):
        for first in range(row):
            if (
                firsts[first] == first
                and signature[first] == signature[row]
                and torch.equal(key_states[first], key_states[row])
                and torch.equal(value_states[first], value_states[row])
            ):
                firsts[row] = first
                break
    return firsts if firsts != list(range(batch)) else None


class PagedRows:
    """Page table of one layer group of a cache on one pool, with cached read/write indices.

    Args:
        pool: where the pages live.
        residual_length: newest tokens whose values attention gets in full precision (quantized pools only).
    """

    def __init__(self, pool: KVPool, residual_length: int = 0) -> None:
        self.pool = pool
        self.store = SlotStore(pool, residual_length)
        self.table = pool.new_table()
        self.written = 0  # tokens every layer of the layer group has written (see write)
        self._last_layer = pool.format.num_layers - 1
        self._version = -1  # table version the cached indices below were built for
        self._ids: torch.Tensor | None = None
        self._read: list[ChunkIndex] | None = None
        self._write: tuple[int, int, list[ChunkIndex]] | None = None
        self._shared_prefill: tuple[int, list[int]] | None = None  # (num_tokens, identical_rows) of a prefill

    @property
    def num_tokens(self) -> int:
        return self.table.num_tokens

    def write(self, layer_in_group: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Stores tokens ``[start, start + n)`` of every row for one layer, growing the table if this layer is first.

        Args:
            layer_in_group: the layer's index within its layer group (which slots of each page are its own).
            key_states / value_states: ``[batch, heads, n, head_dim]``.
        """
        self.begin_step(start, key_states, value_states)
        self.store.write(layer_in_group, self._write_index(start, key_states.shape[-2]), key_states, value_states)
        self.store.remember(layer_in_group, start, value_states)
        self.end_step(layer_in_group, start + key_states.shape[-2])

    def end_step(self, layer_in_group: int, end: int) -> None:
        """A layer has written the step's tokens up to ``end``: once the layer group's last layer has, every
        layer holds them (``written``, what may be published to a prefix index)."""
        if layer_in_group == self._last_layer:
            self.written = end

    def read(self, layer_in_group: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, heads, num_tokens, head_dim]`` of one layer, for attention."""
        if self._read is None:
            self._read = split_by_chunk(
                self._page_ids(), self.pool.chunk_starts, self.pool.chunk_sizes, self.pool.format.num_kv_heads
            )
        batch, parts = self.table.num_rows, self._read
        return self.store.read(
            layer_in_group,
            lambda chunks: read_pages(chunks, layer_in_group, parts, batch, num_tokens),
            num_tokens,
            num_tokens,
        )

    def begin_step(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Makes room for tokens ``[start, start + n)``: the first layer of a step grows the table.

        The layers after it check the batch, and in a shared prefill give rows whose states turn
        out to differ their own pages.

        Args:
            key_states / value_states: ``[batch, heads, n, head_dim]``.
        """
        batch, _, num_new, _ = key_states.shape
        # Checked first, here: a full ring takes no new page, so the page table's own check would not run.
        if self.table.num_rows and batch != self.table.num_rows:
            raise ValueError(
                f"The cache holds {self.table.num_rows} rows but a layer got {batch}. A cache serves one batch at a "
                "time: reset() it, or use a new cache, before a batch of another size."
            )
        end = start + num_new
        if end > self.num_tokens:
            if start != self.num_tokens:
                raise RuntimeError(f"A layer writes from token {start}; the cache holds {self.num_tokens}.")
            identical_rows = find_identical_rows(key_states, value_states) if start == 0 else None
            self._grow(batch, start, num_new, identical_rows)
            self._shared_prefill = (end, identical_rows) if identical_rows else None
        elif self._shared_prefill is not None and self._shared_prefill[0] == end:
            self._split_differing_rows(key_states, value_states)

    def _grow(self, batch: int, start: int, num_new: int, identical_rows: list[int] | None) -> None:
        self._apply(lambda: self.table.grow(batch, num_new, identical_rows))

    def select_rows(self, indices: list[int]) -> None:
        """Keeps rows ``indices`` in that order, sharing the pages of repeated rows."""
        self._apply(lambda: self.table.select_rows(indices))
        self.store.select_rows(indices)

    def check_crop(self, num_tokens: int) -> None:
        """Paged rows keep every token, so any crop is exact."""

    def crop(self, num_tokens: int) -> None:
        self._apply(lambda: self.table.crop(num_tokens))
        self.store.crop(num_tokens)
        self.written = min(self.written, num_tokens)

    def release(self) -> None:
        """Returns all pages to the pool."""
        self._apply(self.table.release)
        self.store.release()
        self.written = 0

    # ----- reused prefixes (hf_kvcache.caches.prefix) -------------------------------------------

    def prefix_layout(self, num_pages: int) -> list[int | None]:
        """Which token page each page of a row holds right after its first ``num_pages`` full token pages were
        written (``None``: a page that holds none the row still needs). Paged rows: all of them, in order."""
        return list(range(num_pages))

    def token_page_position(self, token_page: int) -> int | None:
        """Where in a row's pages a full token page written earlier lies (``None``: no longer held)."""
        return token_page

    def attach(self, pages: list[list[int]], num_tokens: int) -> None:
        """Starts the empty rows from a reused prefix: ``pages`` (laid out as ``prefix_layout`` says, already taken
        from the pool) hold each row's first ``num_tokens`` tokens, in every layer of the layer group."""
        self._apply(lambda: self.table.attach(pages, num_tokens))
        self.written = num_tokens
        if self.store.residual is not None:  # the prefix's values are codes only
            self.store.residual.first = num_tokens

    def _apply(self, change: Callable[[], list[tuple[int, int]] | None]) -> None:
        """Runs a table change under the pool lock, copies the pages it asks for, drops cached indices."""
        self._shared_prefill = None
        with self.pool.lock:
            copies = change()
        if copies:
            self.pool.copy_pages(copies)
        if self.table.version != self._version:
            self._version = self.table.version
            self._ids = self._read = self._write = None

    def _split_differing_rows(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """In a shared prefill, gives private pages to rows whose states differ from the first row they were
        identical to in the layers before."""
        end, firsts = self._shared_prefill
        differing = [
            row
            for row, first in enumerate(firsts)
            if first != row
            and not (
                torch.equal(key_states[row], key_states[first]) and torch.equal(value_states[row], value_states[first])
            )
        ]
        if differing:
            self._apply(lambda: self.table.make_private(differing))
            self._shared_prefill = (end, [row if row in differing else first for row, first in enumerate(firsts)])

    def _page_ids(self) -> torch.Tensor:
        """The page table as a ``[batch, num_pages]`` tensor on the pool's device."""
        if self._ids is None:
            rows = self.table.rows
            self._ids = torch.tensor(rows, dtype=torch.long, device=self.pool.device).view(len(rows), -1)
        return self._ids

    def _write_index(self, start: int, num_new: int) -> list[ChunkIndex]:
        if self._write is None or self._write[:2] != (start, num_new):
            page_size = self.pool.format.page_size
            positions = torch.arange(start, start + num_new, device=self.pool.device)  # [n]
            page_ids = self._page_ids()[:, positions // page_size]  # [batch, n]
            offsets = (positions % page_size).expand_as(page_ids)  # [batch, n]
            parts = split_by_chunk(
                page_ids,
                self.pool.chunk_starts,
                self.pool.chunk_sizes,
                self.pool.format.num_kv_heads,
                offsets,
                page_size,
            )
            self._write = (start, num_new, parts)
        return self._write[2]
