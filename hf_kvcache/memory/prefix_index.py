"""The prefix index: full pages of earlier prompts found again by their tokens (pure ints, no torch).

A page is published under a *page key*, ``(chain key, layer group)``. Token page ``d`` of a sequence is tokens
``[d * page_size, (d + 1) * page_size)``; its chain key hashes the one before it with the page's token ids::

    chain[-1] = root                              (the model, the cache's attention semantics, the page size)
    chain[d]  = blake2b(chain[d - 1] || token ids of token page d)          16 bytes

so a page is only found for the same tokens at the same positions after the same tokens (a pool has one page
format, so keys need none).

The index holds one reference to each page it publishes (counted by the allocator: a page a cache holds too has
refcount 2, and its page table copies it before writing). A published page only the index holds is *cached*: kept in
least recently used order and evicted, oldest first, only when the allocator needs pages. ``PageAllocator`` drives
these transitions; ``take_evicted`` hands the pool what went, for its tiers.

Beside a published page the index may keep a *tail*, an object it never reads: what a cache holds besides its pages
at that page's end (``layers.exact.ExactTail``; a hybrid model's states, under layer group ``STATE_GROUP`` beside
layer group 0's page: ``caches.state_tails.StateTail``). A tail lives as long as its page is published.
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

KEY_BYTES = 16
PageKey = tuple[bytes, int]
"""``(chain key of a token page, layer group index)``."""
STATE_GROUP = -1
"""The layer group a tail of a hybrid model's state layers is kept under (beside layer group 0's page)."""


def root_key(*parts: bytes | str | int) -> bytes:
    """The chain key before a sequence's first page, from whatever makes pages of equal tokens differ."""
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.digest()


def chain_keys(parent: bytes, token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Chain keys of the full token pages of ``token_ids`` (from a page boundary on; a partial page gets none), the
    first page's parent being ``parent`` (``root_key(...)`` at a sequence's start)."""
    keys = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = array("q", token_ids[start : start + page_size]).tobytes()
        parent = hashlib.blake2b(parent + page, digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys


def tail_key(key: PageKey) -> PageKey:
    """The key the tail kept under ``key`` travels under to the pool's tiers (apart from the page's own)."""
    if key[1] == STATE_GROUP:
        return root_key(key[0], "states"), 0
    return root_key(key[0], "tail"), key[1]


def page_beside(key: PageKey) -> PageKey:
    """The page key a tail kept under ``key`` lives beside (its own, or layer group 0's for ``STATE_GROUP``)."""
    return key[0], max(key[1], 0)


class PrefixIndex:
    """Page key -> page id for published pages, and the cached ones in least recently used order; lookups counted
    in rows (``stats.pool_stats``)."""

    def __init__(self) -> None:
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._evicted: list[tuple[PageKey, int]] = []  # evicted since the last take_evicted, oldest first
        self._tails: dict[PageKey, Any] = {}  # beside published pages (their keys)
        self.lookups = self.hits = self.tokens_reused = self.tokens_queried = 0

    def __len__(self) -> int:
        return len(self._page_of)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def page(self, key: PageKey) -> int | None:
        return self._page_of.get(key)

    def is_published(self, page: int) -> bool:
        return page in self._key_of

    def add(self, key: PageKey, page: int) -> None:
        """Publishes ``page`` under ``key`` (both new to the index); the caller adds the index's reference."""
        if key in self._page_of or page in self._key_of:
            raise ValueError(f"Page {page} or its key is already published.")
        self._page_of[key] = page
        self._key_of[page] = key

    def add_tail(self, key: PageKey, tail: Any) -> bool:
        """Keeps ``tail`` under ``key``, beside the page published under ``page_beside(key)``; False (nothing kept)
        if none is, or a tail is kept under ``key``."""
        if page_beside(key) not in self._page_of or key in self._tails:
            return False
        self._tails[key] = tail
        return True

    def tail(self, key: PageKey) -> Any:
        return self._tails.get(key)

    @property
    def num_tails(self) -> int:
        return len(self._tails)

    @property
    def tail_bytes(self) -> int:
        """The bytes of the tails kept (each tail's ``nbytes``)."""
        return sum(tail.nbytes for tail in self._tails.values())

    def mark_cached(self, page: int) -> None:
        """``page`` is now held by the index alone: the most recently used cached page."""
        self._cached[page] = None

    def mark_held(self, page: int) -> None:
        """A cache holds ``page`` again: it leaves the cached pages."""
        self._cached.pop(page, None)

    def evict_oldest(self) -> int:
        """Unpublishes the least recently used cached page and returns it (the caller drops the index's reference)."""
        page, _ = self._cached.popitem(last=False)
        key = self._key_of.pop(page)
        del self._page_of[key]
        self._tails.pop(key, None)
        if key[1] == 0:
            self._tails.pop((key[0], STATE_GROUP), None)
        self._evicted.append((key, page))
        return page

    def take_evicted(self) -> list[tuple[PageKey, int]]:
        """The ``(key, page)`` of each page evicted since the last call, oldest first (the pages still hold their
        contents until the pool zeroes them), and forgets them."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def clear(self) -> list[int]:
        """Unpublishes every page; returns them (the caller drops the index's references). Counts are kept."""
        pages = list(self._key_of)
        self._page_of.clear()
        self._key_of.clear()
        self._cached.clear()
        self._tails.clear()
        return pages

    def record_lookup(self, num_rows: int, tokens_reused_per_row: int, tokens_per_row: int) -> None:
        self.lookups += num_rows
        self.hits += num_rows if tokens_reused_per_row else 0
        self.tokens_reused += num_rows * tokens_reused_per_row
        self.tokens_queried += num_rows * tokens_per_row

    def check_integrity(self, refcounts: Sequence[int]) -> None:
        """Raises ``AssertionError`` if the maps disagree, or with ``refcounts`` (the index's references included): a
        published page is cached exactly when the index alone holds it."""
        assert len(self._page_of) == len(self._key_of), "page keys and published pages differ in number"
        for key, page in self._page_of.items():
            assert self._key_of.get(page) == key, f"page {page} is published under two keys"
            assert refcounts[page] >= 1, f"published page {page} has refcount {refcounts[page]}"
            assert (refcounts[page] == 1) == (page in self._cached), (
                f"page {page}: refcount {refcounts[page]} but cached={page in self._cached}"
            )
        assert all(page in self._key_of for page in self._cached), "a cached page is not published"
        assert all(page_beside(key) in self._page_of for key in self._tails), "a tail is kept beside no published page"
