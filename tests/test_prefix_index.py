"""The prefix index's bookkeeping: chain keys, publishing, cached pages and their eviction order, with
``check_integrity()`` after every step (reuse through ``generate``: ``test_prefix_caching.py``)."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_kvcache import KVPool
from hf_kvcache.errors import PoolExhaustedError
from hf_kvcache.memory.allocator import PageAllocator
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.prefix_index import KEY_BYTES, chain_keys, root_key


def test_chain_keys_depend_on_every_earlier_token_and_the_position():
    root = root_key("model", 4)
    keys = chain_keys(root, list(range(10)), 4)
    assert len(keys) == 2 and all(len(key) == KEY_BYTES for key in keys)  # the partial page gets no key
    assert chain_keys(root, list(range(8)), 4) == keys  # deterministic, trailing tokens ignored
    assert chain_keys(keys[0], list(range(4, 8)), 4) == keys[1:]  # continuing a chain from its last key
    changed = chain_keys(root, [9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert changed[0] != keys[0] and changed[1] != keys[1]  # a page's key depends on every earlier token
    shifted = chain_keys(root, [4, 5, 6, 7], 4)
    assert shifted[0] != keys[1]  # the same tokens at another position: another key
    assert chain_keys(root_key("other model", 4), list(range(8)), 4)[0] != keys[0]
    assert root_key("a", "bc") != root_key("ab", "c")  # parts are length-prefixed


def test_published_pages_are_cached_when_idle_and_evicted_oldest_first():
    allocator = PageAllocator(6, prefix_caching=True)
    pages = allocator.allocate(3)
    for number, page in enumerate(pages):
        assert allocator.publish((bytes([number]), 0), page)
    assert [allocator.refcount(page) for page in pages] == [2, 2, 2] and allocator.num_cached == 0
    allocator.check_integrity()
    allocator.free([pages[1]])
    allocator.free([pages[0]])
    allocator.free([pages[2]])
    assert allocator.num_cached == 3 and allocator.num_free == 2 and allocator.num_available == 5
    allocator.check_integrity()
    allocator.share([pages[1]])  # a lookup hit revives a cached page
    assert allocator.num_cached == 2 and allocator.refcount(pages[1]) == 2
    allocator.free([pages[1]])  # idle again: now the most recently used
    allocator.check_integrity()
    taken = allocator.allocate(4)  # 2 free pages, then the 2 least recently used cached ones
    assert set(taken) >= {pages[0], pages[2]} and allocator.lookup((b"\x00", 0)) is None
    assert allocator.lookup((b"\x01", 0)) == pages[1] and allocator.num_cached == 1
    allocator.check_integrity()
    with pytest.raises(PoolExhaustedError):
        allocator.allocate(2)  # one cached page left: not enough, nothing evicted
    assert allocator.lookup((b"\x01", 0)) == pages[1]
    assert allocator.allocate(1) == [pages[1]] and allocator.num_cached == 0
    allocator.check_integrity()


def test_the_first_page_published_under_a_key_wins():
    allocator = PageAllocator(4, prefix_caching=True)
    first, second = allocator.allocate(2)
    assert allocator.publish((b"k", 0), first)
    assert not allocator.publish((b"k", 0), second)  # the other copy stays private
    assert not allocator.publish((b"j", 0), first)  # a page is published once
    assert allocator.refcount(first) == 2 and allocator.refcount(second) == 1
    allocator.free([second])
    assert allocator.num_free == 2  # the private copy went back to the free list
    with pytest.raises(ValueError, match="not allocated"):
        allocator.publish((b"x", 0), second)
    allocator.check_integrity()


operations = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "extend", "share", "free", "publish", "revive"]),
        st.integers(0, 5),
        st.integers(0, 1000),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(operations, st.sampled_from([1, 4]))
def test_random_operations_with_an_index_keep_integrity(ops, extent_pages):
    """Single pages and rows' extents (``extend``) alike: cached pages are evicted back into the free pages' extent
    counts and heaps, a request fails only when free plus cached pages are too few, and nothing changes then."""
    allocator = PageAllocator(10, extent_pages, prefix_caching=True)
    held: list[int] = []  # one entry per reference we hold
    for op, count, pick in ops:
        if op in ("allocate", "extend"):
            anchor = held[-1] if held else None
            take = allocator.allocate if op == "allocate" else functools.partial(allocator.extend, anchor)
            if count > allocator.num_available:
                before = (allocator.num_free, allocator.num_cached)
                with pytest.raises(PoolExhaustedError):
                    take(count)
                assert (allocator.num_free, allocator.num_cached) == before
            else:
                pages = take(count)
                assert len(set(pages)) == count and not set(pages) & set(held), "a page was handed out twice"
                held += pages
        elif op == "share" and held:
            page = held[pick % len(held)]
            allocator.share([page])
            held.append(page)
        elif op == "free" and held:
            allocator.free([held.pop(pick % len(held))])
        elif op == "publish" and held:
            allocator.publish((bytes([pick % 7]), count % 2), held[pick % len(held)])
        elif op == "revive":
            page = allocator.lookup((bytes([pick % 7]), count % 2))
            if page is not None:
                allocator.share([page])
                held.append(page)
        allocator.check_integrity()
        assert allocator.num_available == allocator.num_free + allocator.num_cached


def test_ensure_free_evicts_cached_pages_into_whole_extents():
    """Under extents: ``ensure_free`` evicts the least recently used cached pages (returning them) before any page
    is taken, they re-enter the free extents, and a row's ``extend`` after it cannot fail."""
    allocator = PageAllocator(9, 4, prefix_caching=True)  # extents {0: null, 1, 2, 3}, {4, 5, 6, 7}, {8}
    row = allocator.extend(None, 4)
    assert row == [4, 5, 6, 7]
    for number, page in enumerate(row):
        allocator.publish((bytes([number]), 0), page)
    allocator.free(row)  # all four cached, oldest first: 4, 5, 6, 7
    assert (allocator.num_free, allocator.num_cached, allocator.num_available) == (4, 4, 8)
    allocator.check_integrity()
    assert allocator.ensure_free(4) == []  # enough free pages: nothing evicted
    with pytest.raises(PoolExhaustedError):
        allocator.ensure_free(9)
    assert allocator.num_cached == 4  # a failed request evicts nothing
    assert allocator.ensure_free(8) == [4, 5, 6, 7]
    allocator.check_integrity()  # the evicted pages are in the extent counts and heaps
    assert allocator.extend(None, 4) == [4, 5, 6, 7]  # a whole extent again
    assert allocator.lookup((b"\x00", 0)) is None and allocator.num_cached == 0
    assert sorted(allocator.extend(None, 4)) == [1, 2, 3, 8]  # no whole extent left: single pages
    allocator.check_integrity()


def test_pool_zeroes_evicted_pages_before_handing_them_out():
    """Free pages are all zeros (in-place attention reads whole extents): an evicted cached page is zeroed."""
    page_format = PageFormat(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=2)
    pool = KVPool(page_format, 3, prefix_caching=True)
    pages = pool.pages.allocate(2)
    pool.pages.storage.keys[:, :, pages] = float("nan")
    pool.pages.storage.values[:, :, pages] = 1.0
    pool.pages.publish([((b"a", 0), pages[0])])
    pool.pages.free(pages)  # pages[1] is free (zeroed), pages[0] cached (kept)
    assert pool.pages.storage.keys[:, :, pages[0]].isnan().all() and pool.pages.storage.keys[:, :, pages[1]].eq(0).all()
    taken = pool.pages.allocate(2)  # evicts pages[0]
    assert sorted(taken) == sorted(pages) and pool.stats()["pages_cached"] == 0
    assert pool.pages.storage.keys[:, :, taken].eq(0).all() and pool.pages.storage.values[:, :, taken].eq(0).all()
    pool.pages.free(taken)
    pool.check_integrity()


def test_pool_counts_cached_pages_as_available_and_in_stats():
    page_format = PageFormat(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=2)
    pool = KVPool(page_format, 5, prefix_caching=True)
    pages = pool.pages.allocate(4)
    assert pool.pages.publish([((b"a", 0), pages[0]), ((b"b", 0), pages[1]), ((b"a", 0), pages[2])]) == 2
    pool.pages.free(pages)
    stats = pool.stats()
    assert (stats["pages_cached"], stats["pages_free"], stats["pages_used"]) == (2, 2, 2)
    assert pool.pages.num_available_pages == 4
    pool.check_integrity()
    taken = pool.pages.allocate(4)  # evicts both cached pages: no PoolExhaustedError
    assert pool.stats()["pages_cached"] == 0 and pool.pages.lookup((b"a", 0)) is None
    pool.pages.free(taken)
    pool.check_integrity()
    pool.pages.record_prefix_lookup(2, 4, 10)
    pool.pages.record_prefix_lookup(1, 0, 10)
    stats = pool.stats()
    assert (stats["prefix_lookups"], stats["prefix_hits"], stats["prefix_tokens_reused"]) == (3, 2, 8)
    assert stats["prefix_hit_rate"] == pytest.approx(8 / 30)


def test_pools_without_an_index_report_none():
    page_format = PageFormat(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=2)
    pool = KVPool(page_format, 3)
    stats = pool.stats()
    assert not pool.prefix_caching and stats["prefix_caching"] is False and stats["pages_cached"] == 0
    pool.pages.enable_prefix_caching()
    assert pool.prefix_caching
