"""Page ids with reference counts, placed in aligned extents: pure ints, no torch.

Page 0 is the null page: never handed out, the harmless target of padding writes. A page is free (refcount 0) or
used (refcount >= 1: one per page-table entry holding it, plus the prefix index's). Not thread-safe on its own:
``PagePool`` serializes calls.

Placement. Extent ``e`` holds pages ``[e * extent_pages, (e + 1) * extent_pages)``, which attention reads as one block
(``attention.flex``). ``extend`` places a row's next page right after its last one while that stays in its extent and
is free, else at the start of the lowest wholly free extent, else anywhere: rows of different requests interleave by
whole extents only. ``allocate`` (copies) takes the highest free ids. Extents are claimed softly: a request fails only
when fewer pages are free than it needs.

Cached pages (``prefix_index``): a published page only the index holds is *cached*: not free (it keeps its contents,
which attention reading extents in place treats as another row's) but available: ``ensure_free`` evicts cached pages,
least recently used first, before any page is taken, and returns them for the caller to zero.
"""

import heapq
from collections import Counter

from hf_kvcache.errors import PoolExhaustedError
from hf_kvcache.memory.prefix_index import PageKey, PrefixIndex

NULL_PAGE = 0


class PageAllocator:
    """Hands out page ids ``1 .. num_pages - 1`` in extents of ``extent_pages``; with ``prefix_caching``, keeps a
    prefix index (``index``)."""

    def __init__(self, num_pages: int, extent_pages: int = 1, prefix_caching: bool = False) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (one null page plus one usable page), got {num_pages}.")
        if extent_pages < 1:
            raise ValueError(f"extent_pages must be >= 1, got {extent_pages}.")
        self.extent_pages = extent_pages
        self._refcounts: list[int] = []
        self._free_in_extent: list[int] = []  # free pages of each extent
        self._singles: list[int] = []  # max-heap (negated ids) of free pages; stale entries skipped
        self._extents: list[int] = []  # min-heap of wholly free extents; stale entries skipped
        self.num_whole_extents = 0  # wholly free extents: where ``extend`` starts a run
        self.num_free = 0  # the null page is neither free nor used
        self.high_water = 0
        self.index: PrefixIndex | None = PrefixIndex() if prefix_caching else None
        self.add_pages(num_pages)

    @property
    def num_pages(self) -> int:
        """Usable pages (the null page excluded)."""
        return len(self._refcounts) - 1

    @property
    def num_used(self) -> int:
        """Pages not free: held by page tables, or cached."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Published pages that only the prefix index holds (evicted when ``ensure_free`` needs them)."""
        return self.index.num_cached if self.index is not None else 0

    @property
    def num_available(self) -> int:
        """Pages a request can take: the free ones and the cached ones."""
        return self.num_free + self.num_cached

    def enable_prefix_caching(self) -> None:
        if self.index is None:
            self.index = PrefixIndex()

    def add_pages(self, num_new: int) -> range:
        """Extends the id space by ``num_new`` free pages; returns their ids."""
        start = len(self._refcounts)
        self._refcounts.extend([0] * num_new)
        num_extents = -(-len(self._refcounts) // self.extent_pages)
        self._free_in_extent.extend([0] * (num_extents - len(self._free_in_extent)))
        for page in range(max(start, NULL_PAGE + 1), start + num_new):
            self._free_in_extent[page // self.extent_pages] += 1
            heapq.heappush(self._singles, -page)
            self.num_free += 1
        for extent in range(start // self.extent_pages, num_extents):
            if self._is_whole(extent):
                heapq.heappush(self._extents, extent)
        self.num_whole_extents = sum(1 for extent in range(num_extents) if self._is_whole(extent))
        return range(start, start + num_new)

    def allocate(self, num: int) -> list[int]:
        """Takes ``num`` single pages (refcount 1 each), the highest free ids, in ascending order; all or nothing
        (``ensure_free`` first)."""
        self.ensure_free(num)
        pages = [self._pop_single() for _ in range(num)]
        self.high_water = max(self.high_water, self.num_used)
        return sorted(pages)

    def extend(self, anchor: int | None, num: int) -> list[int]:
        """Takes the next ``num`` pages of a row whose last page is ``anchor`` (``None``: a row without pages), placed
        as the module docstring says; all or nothing (``ensure_free`` first)."""
        self.ensure_free(num)
        pages = []
        for _ in range(num):
            anchor = self._next_after(anchor)
            pages.append(anchor)
        self.high_water = max(self.high_water, self.num_used)
        return pages

    def extents_needed(self, anchor: int | None, num: int) -> int:
        """Wholly free extents ``extend(anchor, num)`` would start: with fewer, it takes single pages in extents other
        rows have begun."""
        size, run = self.extent_pages, 0
        if anchor is not None:
            page = anchor + 1
            while run < num and page % size and page < len(self._refcounts) and self._refcounts[page] == 0:
                run, page = run + 1, page + 1
        return -(-(num - run) // size)

    def ensure_free(self, num: int) -> list[int]:
        """Makes ``num`` pages free, evicting cached pages (least recently used first) if the free ones are fewer;
        returns those (free, still holding their contents). ``PoolExhaustedError``, nothing changed, if free and
        cached pages are fewer than ``num``."""
        if num > self.num_available:
            raise PoolExhaustedError(num, self.num_available, self.num_pages)
        evicted = [self.index.evict_oldest() for _ in range(num - self.num_free)]
        for page in evicted:
            self._release(page)
        return evicted

    def share(self, pages: list[int]) -> None:
        for page in pages:
            if page == NULL_PAGE or self._refcounts[page] == 0:
                raise ValueError(f"Cannot share page {page}: it is not allocated.")
        for page in pages:
            self._refcounts[page] += 1
            if self.index is not None:
                self.index.mark_held(page)

    def free(self, pages: list[int]) -> list[int]:
        """Drops one reference from each page; returns the pages left with none (free again). A published page left
        with the index's reference only becomes cached (the most recently used)."""
        for page, count in Counter(pages).items():
            if page == NULL_PAGE or not 0 < page < len(self._refcounts) or self._refcounts[page] < count:
                raise ValueError(f"Cannot free page {page}: it is not allocated.")
        freed = []
        for page in pages:
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                freed.append(page)
                self._release(page)
            elif self._refcounts[page] == 1 and self.index is not None and self.index.is_published(page):
                self.index.mark_cached(page)
        return freed

    def clear_index(self) -> tuple[int, list[int]]:
        """Unpublishes every page; returns how many were published and the pages freed (the cached ones)."""
        published = self.index.clear()
        return len(published), self.free(published)  # no longer published: none becomes cached

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def is_free(self, page: int) -> bool:
        return page != NULL_PAGE and self._refcounts[page] == 0

    def publish(self, key: PageKey, page: int) -> bool:
        """Publishes a used page under ``key``, adding the index's reference; False (nothing changed) if the key or
        the page already is published (the first page published under a key wins)."""
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

    # ----- internals ---------------------------------------------------------------------------

    def _is_whole(self, extent: int) -> bool:
        """All pages of a full-size extent without the null page are free."""
        size = self.extent_pages
        if extent == NULL_PAGE // size or (extent + 1) * size > len(self._refcounts):
            return False
        return self._free_in_extent[extent] == size

    def _release(self, page: int) -> None:
        """Puts a page whose last reference went (freed or evicted) back into the free counts and heaps."""
        self._refcounts[page] = 0
        self.num_free += 1
        heapq.heappush(self._singles, -page)
        extent = page // self.extent_pages
        self._free_in_extent[extent] += 1
        if self._is_whole(extent):
            heapq.heappush(self._extents, extent)
            self.num_whole_extents += 1
        if len(self._singles) > 2 * len(self._refcounts) + 64:  # drop stale entries now and then
            self._rebuild_heaps()

    def _take(self, page: int) -> int:
        if self._is_whole(page // self.extent_pages):
            self.num_whole_extents -= 1
        self._refcounts[page] = 1
        self._free_in_extent[page // self.extent_pages] -= 1
        self.num_free -= 1
        return page

    def _pop_single(self) -> int:
        while True:
            page = -heapq.heappop(self._singles)
            if page != NULL_PAGE and self._refcounts[page] == 0:
                return self._take(page)

    def _next_after(self, anchor: int | None) -> int:
        size = self.extent_pages
        if anchor is not None:
            candidate = anchor + 1
            if candidate % size and candidate < len(self._refcounts) and self._refcounts[candidate] == 0:
                return self._take(candidate)
        while self._extents:
            extent = heapq.heappop(self._extents)
            if self._is_whole(extent):
                return self._take(extent * size)
        return self._pop_single()

    def _rebuild_heaps(self) -> None:
        self._singles = [-page for page in range(1, len(self._refcounts)) if self._refcounts[page] == 0]
        heapq.heapify(self._singles)
        self._extents = [extent for extent in range(len(self._free_in_extent)) if self._is_whole(extent)]
        heapq.heapify(self._extents)

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` if the free counts, the extents' bookkeeping, the reference counts and the prefix
        index disagree."""
        assert self._refcounts[NULL_PAGE] == 0, "the null page was handed out"
        free = [page for page in range(1, len(self._refcounts)) if self._refcounts[page] == 0]
        assert len(free) == self.num_free, f"{len(free)} pages have refcount 0 but {self.num_free} are counted free"
        assert all(count >= 0 for count in self._refcounts), "a negative refcount"
        size = self.extent_pages
        for extent, count in enumerate(self._free_in_extent):
            pages = range(max(1, extent * size), min((extent + 1) * size, len(self._refcounts)))
            expected = sum(1 for page in pages if self._refcounts[page] == 0)
            assert count == expected, f"extent {extent}: {count} free pages counted, {expected} free"
        assert set(free) <= {-page for page in self._singles}, "a free page is missing from the single-page heap"
        whole = {extent for extent in range(len(self._free_in_extent)) if self._is_whole(extent)}
        assert whole <= set(self._extents), "a wholly free extent is missing from the extent heap"
        assert len(whole) == self.num_whole_extents, (
            f"{len(whole)} wholly free extents, {self.num_whole_extents} counted"
        )
        assert self.high_water >= self.num_used, "high-water mark below current use"
        if self.index is not None:
            self.index.check_integrity(self._refcounts)
