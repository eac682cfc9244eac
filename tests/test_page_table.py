"""Page-table bookkeeping: property tests with ``check_integrity()`` after every step, identical rows stored once
and copied on write, freed pages handed out again in order."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_kvcache.errors import PoolExhaustedError
from hf_kvcache.memory.allocator import PageAllocator
from hf_kvcache.memory.page_table import PageTable

table_operations = st.lists(
    st.tuples(
        st.sampled_from(["grow", "select", "crop", "private", "release"]),
        st.integers(0, 40),
        st.lists(st.integers(0, 7), min_size=1, max_size=6),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(1, 5), table_operations, st.lists(st.integers(0, 12), min_size=5, max_size=5))
def test_page_table_random_operations_keep_integrity(page_size, num_rows, ops, pads):
    """Rows left-padded by ``pads`` hold no page of padding alone (``PageTable.skips``)."""
    allocator = PageAllocator(64)
    table = PageTable(allocator, page_size)
    for op, amount, picks in ops:
        rows = table.num_rows or num_rows
        used_before = allocator.num_used
        try:
            if op == "grow":
                identical_rows = None
                if not table.num_tokens:
                    table.pads = pads[:rows]
                    identical_rows = []
                    for row, pick in zip(range(rows), picks + [99] * rows):
                        identical_rows.append(identical_rows[min(pick, row)] if pick < row else row)
                copies = table.grow(rows, amount % 9 + 1, identical_rows)
                # Every copy leaves a private page behind: the destination is referenced once.
                assert all(allocator.refcount(dst) == 1 for _, dst in copies)
            elif op == "select" and table.num_rows:
                table.select_rows([pick % table.num_rows for pick in picks])
            elif op == "crop":
                table.crop(amount % (table.num_tokens + 1))
            elif op == "private" and table.num_rows:
                table.make_private([picks[0] % table.num_rows])
                row = table.rows[picks[0] % table.num_rows]
                assert all(allocator.refcount(page) == 1 for page in row)
            elif op == "release":
                table.release()
        except PoolExhaustedError:
            assert allocator.num_used == used_before  # all or nothing
        allocator.check_integrity()
        table.check_integrity()
        expected_pages = math.ceil(table.num_tokens / page_size)
        assert all(len(row) == max(0, expected_pages - skip) for row, skip in zip(table.rows, table.row_skips))
        if table.skips is not None:
            assert table.skips == [pad // page_size for pad in table.pads]
        assert allocator.num_used == len({page for row in table.rows for page in row})
    table.release()
    assert allocator.num_used == 0


def test_grow_shares_identical_rows_and_copies_on_write():
    allocator = PageAllocator(32)
    table = PageTable(allocator, page_size=4)
    # Rows 0 and 2 are identical, row 1 differs: 10 tokens = 3 pages each, stored for 2 rows only.
    assert table.grow(3, 10, identical_rows=[0, 1, 0]) == []
    assert allocator.num_used == 6
    assert table.rows[0] == table.rows[2] and table.rows[0] != table.rows[1]
    # The next token lands in the shared, partly filled page 3: row 0 copies it, row 2 then owns the original.
    copies = table.grow(3, 1)
    assert len(copies) == 1 and copies[0][0] == table.rows[2][2]
    assert table.rows[0][:2] == table.rows[2][:2] and table.rows[0][2] != table.rows[2][2]
    assert allocator.num_used == 7
    table.check_integrity()
    with pytest.raises(ValueError, match="first tokens"):
        table.grow(3, 1, identical_rows=[0, 0, 0])
    with pytest.raises(ValueError, match="the first row identical to it"):
        PageTable(allocator, 4).grow(3, 1, identical_rows=[0, 0, 1])
    with pytest.raises(ValueError, match="holds 3 rows"):
        table.grow(2, 1)


def test_pages_freed_together_come_back_in_their_order():
    """A released table's pages are handed out again in the same order: consecutive rows stay consecutive."""
    allocator = PageAllocator(32)
    table = PageTable(allocator, page_size=4)
    table.grow(3, 10)  # 3 rows of 3 pages
    first = [list(row) for row in table.rows]
    assert sum(first, []) == list(range(23, 32))  # single pages come from the top
    table.release()
    table.grow(3, 10)
    assert table.rows == first
    assert allocator.allocate(2) == [21, 22]
    allocator.check_integrity()
