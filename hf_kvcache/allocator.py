"""Page ids with reference counts: pure ints, no torch.

Page 0 is the null page: never handed out, the harmless target of padding writes. A page is
free (refcount 0, on the free list) or used (refcount >= 1, held by that many page-table
entries). Sharing a page increments its count; a page returns to the free list when its
count drops to zero. Not thread-safe on its own: ``KVPool`` serializes calls.
"""

from hf_kvcache.errors import PoolExhaustedError

NULL_PAGE = 0


class PageAllocator:
    """Hands out page ids ``1 .. num_pages - 1``.

    Args:
        num_pages: page ids in the pool, the null page included (>= 2).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (one null page plus one usable page), got {num_pages}.")
        self._refcounts = [0] * num_pages
        # A stack popped from the end: ids come out in ascending order on a fresh pool.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self.high_water = 0

    @property
    def num_pages(self) -> int:
        """Usable pages (the null page excluded)."""
        return len(self._refcounts) - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def add_pages(self, num_new: int) -> range:
        """Extends the id space by ``num_new`` free pages; returns their ids."""
        start = len(self._refcounts)
        self._refcounts.extend([0] * num_new)
        self._free[:0] = range(start + num_new - 1, start - 1, -1)
        return range(start, start + num_new)

    def allocate(self, num: int) -> list[int]:
        """Takes ``num`` free pages (refcount 1 each), all or nothing.

        Raises:
            PoolExhaustedError: fewer than ``num`` pages are free; nothing changed.
        """
        if num > len(self._free):
            raise PoolExhaustedError(num, len(self._free), self.num_pages)
        pages = [self._free.pop() for _ in range(num)]
        for page in pages:
            self._refcounts[page] = 1
        self.high_water = max(self.high_water, self.num_used)
        return pages

    def share(self, pages: list[int]) -> None:
        """Adds one reference to each used page."""
        for page in pages:
            if page == NULL_PAGE or self._refcounts[page] == 0:
                raise ValueError(f"Cannot share page {page}: it is not allocated.")
        for page in pages:
            self._refcounts[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drops one reference from each page; pages left with none go back to the free list.

        Pages freed together are pushed last first, so that the next ``allocate`` hands them out in the
        order they are given here: a row's consecutive pages come back consecutive.
        """
        for page in reversed(pages):
            if page == NULL_PAGE or self._refcounts[page] == 0:
                raise ValueError(f"Cannot free page {page}: it is not allocated.")
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                self._free.append(page)

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` if the free list and reference counts disagree."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert NULL_PAGE not in free and self._refcounts[NULL_PAGE] == 0, "the null page was handed out"
        for page in range(1, len(self._refcounts)):
            count = self._refcounts[page]
            assert count >= 0, f"page {page} has refcount {count}"
            assert (count == 0) == (page in free), f"page {page}: refcount {count} but free={page in free}"
        assert self.high_water >= self.num_used, "high-water mark below current use"
