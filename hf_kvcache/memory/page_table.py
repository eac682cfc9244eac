"""Per-row lists of page ids of one layer group on one pool: pure ints, no torch.

All rows hold the same number of tokens (``generate`` pads on the left): row ``r`` keeps token ``t`` in slot
``t % page_size`` of page ``rows[r][t // page_size - skips[r]]``. The ``skips[r] = pads[r] // page_size`` pages of
padding alone are not taken (reads and writes go to the null page there, which the attention mask hides). A window's
rows stay in token order: a page behind the window goes back and its entry becomes the null page (a *hole*).
Rows may share pages (beams, ``num_return_sequences``); a row copies a shared page only when it writes into it
(copy-on-write). Every change allocates all it needs first, so a ``PoolExhaustedError`` leaves the table as it was.
"""

import itertools
import math
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from hf_kvcache.memory.allocator import NULL_PAGE


class Allocator(Protocol):
    def ensure_free(self, num: int) -> None: ...
    def allocate(self, num: int) -> list[int]: ...
    def extend(self, anchor: int | None, num: int) -> list[int]: ...
    def share(self, pages: list[int]) -> None: ...
    def free(self, pages: list[int]) -> list[int]: ...
    def refcount(self, page: int) -> int: ...


class PageTable:
    """Page ids of ``num_rows`` sequences of equal length, from ``allocator`` (a ``PageAllocator`` or a ``PagePool``);
    ``row_extents``: each row's pages in runs after its last page (``Allocator.extend``)."""

    def __init__(self, allocator: Allocator, page_size: int, row_extents: bool = False) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.row_extents = row_extents
        self.rows: list[list[int]] = []
        self.num_tokens = 0
        self.pads: list[int] | None = None  # leading padding of each row (generate's left padding); None: none
        self.skips: list[int] | None = None  # pages of leading padding each row does not hold; None: none
        self.version = 0  # bumped whenever a page id in ``rows`` changes

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def grow(
        self,
        num_rows: int,
        num_new_tokens: int,
        identical_rows: list[int] | None = None,
        keeps: Callable[[int, int], bool] | None = None,
    ) -> list[tuple[int, int]]:
        """Makes room for ``num_new_tokens`` more tokens in every row: shared pages the new tokens land in are copied,
        then pages appended. On an empty table, ``identical_rows[r] <= r`` names the first row identical to row ``r``:
        identical rows share their new pages. ``keeps(row, token_page)``: whether a row takes a page for a new token
        page (else a hole); ``None``: all. Returns the ``(src, dst)`` pages the caller must copy before writing.
        """
        if self.rows and num_rows != len(self.rows):
            raise ValueError(
                f"The cache holds {len(self.rows)} rows but the new tokens come in {num_rows} rows. A cache serves "
                "one batch at a time: reset() it, or use a new cache, before a batch of another size."
            )
        if identical_rows is not None and self.num_tokens:
            raise ValueError("identical_rows can only be given for the first tokens of a table.")
        firsts = list(range(num_rows)) if identical_rows is None else identical_rows
        if len(firsts) != num_rows or any(
            not 0 <= first <= row or firsts[first] != first for row, first in enumerate(firsts)
        ):
            raise ValueError(
                f"identical_rows must name, for each of {num_rows} rows, the first row identical to it: {firsts}."
            )
        if not self.num_tokens and not any(self.rows):  # empty rows take their skips from the pads
            pads = self.pads if self.pads is not None and len(self.pads) == num_rows else None
            self.skips = [pad // self.page_size for pad in pads] if pads is not None and any(pads) else None
        skips = self.skips or [0] * num_rows
        rows = self.rows or [[] for _ in range(num_rows)]  # an empty table takes its rows only once pages are in
        end = self.num_tokens + num_new_tokens
        num_slots = [max(0, math.ceil(end / self.page_size) - skips[row]) - len(rows[row]) for row in range(num_rows)]
        new_pages_at = [  # the positions that take a page
            [
                i
                for i in range(len(rows[row]), len(rows[row]) + num_slots[row])
                if keeps is None or keeps(row, i + skips[row])
            ]
            for row in range(num_rows)
        ]
        num_new = [len(at) for at in new_pages_at]
        firsts = [first if new_pages_at[first] == new_pages_at[row] else row for row, first in enumerate(firsts)]
        first_page = self.num_tokens // self.page_size
        touched = [
            (row, index) for row in range(num_rows) for index in range(max(0, first_page - skips[row]), len(rows[row]))
        ]
        leaders = [row for row in range(num_rows) if firsts[row] == row]  # rows that get pages of their own
        copies, fresh = self._copy_on_write(touched, sum(num_new[row] for row in leaders))
        self.rows = rows
        if fresh or copies or any(num_slots):
            self.version += 1
        if self.row_extents:
            new_pages = {
                row: self.allocator.extend(self._last_page(rows[row]), num_new[row]) if num_new[row] else []
                for row in leaders
            }
        else:
            ends = itertools.accumulate(num_new[row] for row in leaders)
            new_pages = {row: fresh[end - num_new[row] : end] for row, end in zip(leaders, ends)}
        for row in range(num_rows):
            pages = iter(new_pages[firsts[row]])
            if firsts[row] != row:
                self.allocator.share(new_pages[firsts[row]])
            start, taken = len(self.rows[row]), set(new_pages_at[row])
            self.rows[row].extend(
                next(pages) if index in taken else NULL_PAGE for index in range(start, start + num_slots[row])
            )
        self.num_tokens = end
        return copies

    @staticmethod
    def _last_page(row: list[int]) -> int | None:
        """The last page a row holds (where ``Allocator.extend`` continues), ``None`` if it holds none."""
        return next((page for page in reversed(row) if page != NULL_PAGE), None)

    def drop(self, drops: Callable[[int, int], bool]) -> None:
        """Gives back the pages of token pages ``drops(row, token_page)`` says a row no longer needs (behind a window):
        their entries become holes."""
        freed = []
        for row, (pages, skip) in enumerate(zip(self.rows, self.row_skips)):
            for index, page in enumerate(pages):
                if page != NULL_PAGE and drops(row, index + skip):
                    freed.append(page)
                    pages[index] = NULL_PAGE
        if freed:
            self.allocator.free(freed)
            self.version += 1

    def attach(self, rows: list[list[int]], num_tokens: int) -> None:
        """Fills an empty table with rows of ``num_tokens`` tokens whose pages the caller has taken a reference to (a
        reused prefix): ``ceil(num_tokens / page_size)`` page ids each (holes: the null page)."""
        if self.rows or self.num_tokens:
            raise ValueError("Pages can only be attached to an empty table.")
        num_pages = math.ceil(num_tokens / self.page_size)
        if any(len(row) != num_pages for row in rows):
            raise ValueError(f"Each row must bring {num_pages} pages for {num_tokens} tokens.")
        self.rows = [list(row) for row in rows]
        self.num_tokens = num_tokens
        self.skips = None
        self.version += 1

    def make_private(self, rows: list[int], indices: list[int] | None = None) -> list[tuple[int, int]]:
        """Gives ``rows`` their own copy of each page they share (of pages ``indices`` only, if given); returns the
        ``(src, dst)`` copies the caller must make before writing."""
        cells = [(row, index) for row in rows for index in (range(len(self.rows[row])) if indices is None else indices)]
        copies = self._copy_on_write(cells, 0)[0]
        if copies:
            self.version += 1
        return copies

    def _copy_on_write(self, cells: list[tuple[int, int]], num_extra: int) -> tuple[list[tuple[int, int]], list[int]]:
        """Replaces each shared page at ``rows[row][index]`` by a fresh copy, and makes sure of ``num_extra`` more
        pages: taken here (returned) without ``row_extents``, left for ``Allocator.extend`` with."""
        moved: Counter[int] = Counter()
        shared = []
        for row, index in cells:
            page = self.rows[row][index]
            if page != NULL_PAGE and self.allocator.refcount(page) - moved[page] > 1:
                moved[page] += 1
                shared.append((row, index))
        if not shared and not num_extra:  # the common case of a decode step: nothing to copy or take
            return [], []
        self.allocator.ensure_free(len(shared) + num_extra)  # all or nothing: nothing below can fail
        if self.row_extents:
            fresh = []
            for row, index in shared:
                fresh += self.allocator.extend(self._last_page(self.rows[row][:index]), 1)
        else:
            fresh = self.allocator.allocate(len(shared) + num_extra)
        copies = []
        for (row, index), dst in zip(shared, fresh):
            copies.append((self.rows[row][index], dst))
            self.rows[row][index] = dst
        self.allocator.free([src for src, _ in copies])
        return copies, fresh[len(shared) :]

    def select_rows(self, indices: list[int]) -> None:
        """Keeps rows ``indices`` in that order (repeats share pages): beam reorder, repeat, select."""
        if any(not 0 <= index < len(self.rows) for index in indices):
            raise ValueError(f"Row indices {indices} out of range for a cache of {len(self.rows)} rows.")
        new_rows = [list(self.rows[index]) for index in indices]
        if self.pads is not None and len(self.pads) == len(self.rows):
            self.pads = [self.pads[index] for index in indices]
        if self.skips is not None:
            self.skips = [self.skips[index] for index in indices]
        for row in new_rows:
            self.allocator.share([page for page in row if page != NULL_PAGE])
        self.release_rows()
        self.rows = new_rows
        self.version += 1

    def crop(self, num_tokens: int) -> None:
        """Keeps the first ``num_tokens`` tokens of every row; pages past them are released."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"Cannot crop to {num_tokens} tokens: the cache holds {self.num_tokens}.")
        keep = math.ceil(num_tokens / self.page_size)
        self.version += 1
        for row, skip in zip(self.rows, self.row_skips):
            self.allocator.free([page for page in row[max(0, keep - skip) :] if page != NULL_PAGE])
            del row[max(0, keep - skip) :]
        self.num_tokens = num_tokens

    def release_rows(self) -> None:
        # At once, last token page first: a published page left cached enters the prefix index's least recently
        # used order in this order, so eviction takes a prompt's tail before its head (a chain is found from its
        # first page on, so a surviving head is still reused).
        depth = max((len(row) for row in self.rows), default=0)
        pages = [row[d] for d in reversed(range(depth)) for row in self.rows if d < len(row)]
        self.allocator.free([page for page in pages if page != NULL_PAGE])
        self.rows = []
        self.version += 1

    def release(self) -> None:
        self.release_rows()
        self.num_tokens = 0
        self.skips = None

    @property
    def row_skips(self) -> list[int]:
        """``skips``, a 0 for each row where there are none (or no rows: a grow that failed)."""
        return self.skips if self.skips is not None and len(self.skips) == len(self.rows) else [0] * len(self.rows)

    def filled_slots(self) -> dict[int, int]:
        """Slots holding a token (not padding) of each distinct page this table holds."""
        pads = self.pads if self.pads is not None and len(self.pads) == len(self.rows) else [0] * len(self.rows)
        page_size = self.page_size
        filled: dict[int, int] = {}
        for row, pad, skip in zip(self.rows, pads, self.row_skips, strict=True):
            for index, page in enumerate(row, start=skip):
                if page == NULL_PAGE:
                    continue
                tokens = min(self.num_tokens, (index + 1) * page_size) - max(pad, index * page_size)
                filled[page] = max(filled.get(page, 0), tokens, 0)
        return filled

    def references(self) -> Counter[int]:
        return Counter(page for row in self.rows for page in row if page != NULL_PAGE)

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` if a row has the wrong page count or holds a page the pool thinks free."""
        expected = math.ceil(self.num_tokens / self.page_size)
        for row, skip in zip(self.rows, self.row_skips, strict=True):
            assert len(row) == max(0, expected - skip), f"row holds {len(row)} pages for {self.num_tokens} tokens"
        for page, count in self.references().items():
            assert self.allocator.refcount(page) >= count, f"page {page} referenced {count}x, refcount lower"
