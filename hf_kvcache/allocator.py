"""Page ids with reference counts: pure ints, no torch.

Page 0 is the null page: never handed out, the harmless target of padding writes. A page is
free (refcount 0, on the free list) or used (refcount >= 1, held by that many page-table
entries, plus one if the prefix index publishes it). Sharing a page increments its count; a page returns to
the free list when its count drops to zero. With a prefix index (``hf_kvcache.prefix_index``), a published
page that only the index holds is *cached*: it keeps its contents until ``allocate`` runs out of free pages
and evicts it, least recently used first, so cached pages count as available. Not thread-safe on its own:
``KVPool`` serializes calls.
"""

from hf_kvcache.errors import PoolExhaustedError
from hf_kvcache.prefix_index import PageKey, PrefixIndex

NULL_PAGE = 0


class PageAllocator:
    """Hands out page ids ``1 .. num_pages - 1``.

    Args:
        num_pages: page ids in the pool, the null page included (>= 2).
        prefix_caching: keep a prefix index (``index``) of published pages.
    """

    def __init__(self, num_pages: int, prefix_caching: bool = False) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (one null page plus one usable page), got {num_pages}.")
        self._refcounts = [0] * num_pages
        # A stack popped from the end: ids come out in ascending order on a fresh pool.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self.high_water = 0
        self.index: PrefixIndex | None = PrefixIndex() if prefix_caching else None

    @property
    def num_pages(self) -> int:
        """Usable pages (the null page excluded)."""
        return len(self._refcounts) - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages off the free list: held by page tables, or cached."""
        return self.num_pages - len(self._free)

    @property
    def num_cached(self) -> int:
        """Published pages that only the prefix index holds (evicted when ``allocate`` needs them)."""
        return self.index.num_cached if self.index is not None else 0

    @property
    def num_available(self) -> int:
        """Pages ``allocate`` can hand out: the free ones and the cached ones."""
        return len(self._free) + self.num_cached

    def enable_prefix_caching(self) -> None:
        """Starts a prefix index (a no-op if there is one)."""
        if self.index is None:
            self.index = PrefixIndex()

    def add_pages(self, num_new: int) -> range:
        """Extends the id space by ``num_new`` free pages; returns their ids."""
        start = len(self._refcounts)
        self._refcounts.extend([0] * num_new)
        self._free[:0] = range(start + num_new - 1, start - 1, -1)
        return range(start, start + num_new)

    def allocate(self, num: int) -> list[int]:
        """Takes ``num`` pages (refcount 1 each), all or nothing: free pages first, then cached pages, least
        recently used first (they leave the prefix index).

        Raises:
            PoolExhaustedError: fewer than ``num`` pages are free or cached; nothing changed.
        """
        if num > self.num_available:
            raise PoolExhaustedError(num, self.num_available, self.num_pages)
        for _ in range(num - len(self._free)):
            page = self.index.evict_oldest()
            self._refcounts[page] = 0
            self._free.append(page)
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
            if self.index is not None:
                self.index.mark_held(page)

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
            elif self._refcounts[page] == 1 and self.index is not None and self.index.is_published(page):
                self.index.mark_cached(page)

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def publish(self, key: PageKey, page: int) -> bool:
        """Publishes a used page under ``key``, adding the index's reference; False (nothing changed) if the key
        is already published (the first page published under a key wins) or the page already is."""
        if page == NULL_PAGE or self._refcounts[page] == 0:
            raise ValueError(f"Cannot publish page {page}: it is not allocated.")
        if self.index.page(key) is not None or self.index.is_published(page):
            return False
        self.index.add(key, page)
        self._refcounts[page] += 1
        return True

    def lookup(self, key: PageKey) -> int | None:
        """The page published under ``key``, without taking it (``share`` takes it)."""
        return self.index.page(key) if self.index is not None else None

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
        if self.index is not None:
            self.index.check_integrity(self._refcounts)
