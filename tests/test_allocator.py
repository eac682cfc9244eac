"""Allocator bookkeeping: property tests with ``check_integrity()`` after every step (page tables:
``test_page_table.py``)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_kvcache.errors import PoolExhaustedError
from hf_kvcache.memory.allocator import NULL_PAGE, PageAllocator

operations = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "extend", "share", "free", "grow"]), st.integers(0, 6), st.integers(0, 1000)
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_allocator_random_operations_keep_integrity(ops):
    allocator = PageAllocator(12, extent_pages=4)
    held: list[int] = []  # one entry per reference we hold
    for op, count, pick in ops:
        if op == "allocate":
            if count > allocator.num_free:
                free_before = allocator.num_free
                with pytest.raises(PoolExhaustedError):
                    allocator.allocate(count)
                assert allocator.num_free == free_before
            else:
                pages = allocator.allocate(count)
                assert NULL_PAGE not in pages and len(set(pages)) == count
                held += pages
        elif op == "extend":
            anchor = held[pick % len(held)] if held and pick % 2 else None
            if count > allocator.num_free:
                with pytest.raises(PoolExhaustedError):
                    allocator.extend(anchor, count)
            else:
                pages = allocator.extend(anchor, count)
                assert NULL_PAGE not in pages and len(set(pages)) == count
                held += pages
        elif op == "share" and held:
            page = held[pick % len(held)]
            allocator.share([page])
            held.append(page)
        elif op == "free" and held:
            page = held.pop(pick % len(held))
            allocator.free([page])
        elif op == "grow":
            allocator.add_pages(count)
        allocator.check_integrity()
        assert allocator.num_used == len(set(held))
        for page in set(held):
            assert allocator.refcount(page) == held.count(page)
    allocator.free(held)
    allocator.check_integrity()
    assert allocator.num_used == 0


def test_allocator_errors_name_the_numbers():
    allocator = PageAllocator(4)
    allocator.allocate(2)
    with pytest.raises(PoolExhaustedError, match="needs 2 pages but only 1 of 3 are free now") as error:
        allocator.allocate(2)
    assert (error.value.requested_pages, error.value.free_pages, error.value.total_pages) == (2, 1, 3)
    assert not error.value.exceeds_pool
    with pytest.raises(PoolExhaustedError, match=r"needs 5 pages, more than the pool's 3 pages in all \(1 free now\)"):
        allocator.allocate(5)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([1])  # single pages come from the top: 2 and 3 are held
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        PageAllocator(1)


def test_rows_take_aligned_extents_and_singles_come_from_the_top():
    """A row grows inside its extent, then starts the lowest wholly free one; single pages take the highest ids;
    once no extent is whole, a row takes single pages (it never fails while pages are free)."""
    allocator = PageAllocator(24, extent_pages=4)  # extents 0 (with the null page), 1..5
    assert allocator.num_whole_extents == 5 and allocator.extents_needed(None, 5) == 2
    first = allocator.extend(None, 3)
    second = allocator.extend(None, 2)
    assert first == [4, 5, 6] and second == [8, 9]
    assert allocator.num_whole_extents == 3 and allocator.extents_needed(first[-1], 3) == 1
    assert allocator.extend(first[-1], 3) == [7, 12, 13]  # the rest of its extent, then the next whole one
    assert allocator.allocate(2) == [22, 23]
    assert allocator.extend(second[-1], 2) == [10, 11]
    allocator.extend(None, 4)  # 16..19
    assert allocator.num_whole_extents == 0 and allocator.extents_needed(None, 3) == 1
    assert allocator.extend(None, 3) == [21, 20, 15]  # no whole extent left: the highest single pages
    allocator.check_integrity()
    freed = allocator.free([8, 9, 10, 11])
    assert freed == [8, 9, 10, 11] and allocator.extend(None, 1) == [8]  # a whole extent again
    allocator.check_integrity()
