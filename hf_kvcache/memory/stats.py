"""A pool's live statistics (``pool_stats``), alerts (``PoolAlerts``) and integrity check (``check_integrity``), which
``PagePool`` calls under its lock."""

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from hf_kvcache.memory.allocator import PageAllocator
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.page_table import PageTable
from hf_kvcache.memory.storage import PoolStorage
from hf_kvcache.memory.tiers import NO_TIER_STATS, PageTiers

logger = logging.getLogger("hf_kvcache")

AlertCallback = Callable[[float, dict[str, Any]], None]


def pool_stats(
    allocator: PageAllocator,
    tables: list[PageTable],
    page_format: PageFormat,
    storage: PoolStorage,
    max_pages: int,
    device: torch.device,
    tier_hits: dict[str, int],
    tiers: PageTiers | None,
) -> dict[str, Any]:
    """A pool's live statistics as a plain dict (``KVPool.stats``, under the pool's lock).

    ``pages_total``: page ids opened (a growable pool opens more, up to ``max_pages``); ``pages_used``: not free, held
    by page tables or cached (``pages_cached``: published pages only the prefix index holds, evicted when room is
    needed: a request can take ``pages_free + pages_cached``). ``bytes_total``: the opened pages' memory, what the pool
    has committed on the CPU (``bytes_reserved``: the storage made for the cap, all committed at once on CUDA).
    ``pages_unfilled``: pages held that no token was written to yet. ``tokens_held``: slots holding a token, not
    padding; ``utilization``: their bytes over those of the pages caches hold (shared pages once). ``live_tables``:
    page tables of caches not yet garbage collected. Prefix counts are in rows (prompts): ``prefix_lookups`` looked
    up, ``prefix_hits`` reused a page or more, ``prefix_tokens_reused`` tokens not prefilled, ``prefix_hit_rate`` the
    share of looked-up tokens reused; ``prefix_tails`` / ``prefix_tail_bytes``: what caches keep beside published
    pages (``prefix_index``), outside ``bytes_total``.

    The prefix tiers' counts (zeros and ``None`` without tiers): ``prefix_hits_{device,host,disk,store}``: pages
    lookups attached, by where each was found (once per row). ``prefix_host_pages`` / ``prefix_host_bytes`` (within
    ``prefix_host_max_bytes``) and ``prefix_disk_pages`` / ``prefix_disk_bytes``: held there; ``prefix_pages_spilled``:
    evicted into the tiers; ``prefix_pages_dropped``: directory or store writes given up (the writer too far behind,
    the directory failing); ``prefix_store``: its URL, ``prefix_store_writes``, ``prefix_store_errors`` (calls failed),
    ``prefix_store_redirections`` (a cluster's ``MOVED`` and ``ASK`` followed), ``prefix_store_bytes_read``;
    ``prefix_pages_rejected``: pages read back that failed their checks (recomputed); ``prefix_bytes_restored``: bytes
    written back into the pool from any tier.
    """
    filled: dict[int, int] = {}
    for table in tables:
        filled.update(table.filled_slots())
    used, cached = allocator.num_used, allocator.num_cached
    page_bytes = page_format.page_bytes
    tokens = sum(filled.values())
    index = allocator.index
    queried = index.tokens_queried if index is not None else 0
    return {
        "pages_total": allocator.num_pages,
        "extent_pages": page_format.extent_pages,
        "pages_unfilled": sum(1 for count in filled.values() if count == 0),
        "pages_used": used,
        "pages_free": allocator.num_free,
        "pages_cached": cached,
        "max_pages": max_pages,
        "high_water_pages": allocator.high_water,
        "page_size": page_format.page_size,
        "page_bytes": page_bytes,
        "bytes_total": (allocator.num_pages + 1) * page_bytes,
        "bytes_reserved": storage.num_pages * page_bytes,
        "bytes_used": used * page_bytes,
        "tokens_held": tokens,
        "live_tables": len(tables),
        "utilization": tokens / ((used - cached) * page_format.page_size) if used > cached else 0.0,
        "device": str(device),
        "dtype": str(page_format.dtype).removeprefix("torch."),
        "prefix_caching": index is not None,
        "prefix_lookups": index.lookups if index is not None else 0,
        "prefix_hits": index.hits if index is not None else 0,
        "prefix_tokens_reused": index.tokens_reused if index is not None else 0,
        "prefix_hit_rate": index.tokens_reused / queried if queried else 0.0,
        "prefix_tails": index.num_tails if index is not None else 0,
        "prefix_tail_bytes": index.tail_bytes if index is not None else 0,
        **{f"prefix_hits_{tier}": count for tier, count in tier_hits.items()},
        **(tiers.stats() if tiers is not None else NO_TIER_STATS),
    }


class PoolAlerts:
    """Thresholds (fractions in ``(0, 1]``) on the share of a pool's capacity held: each upward crossing logs a
    warning and calls the callbacks once (a threshold re-arms when the share falls back below it)."""

    def __init__(self, thresholds: tuple[float, ...]) -> None:
        if any(not 0 < threshold <= 1 for threshold in thresholds):
            raise ValueError(f"alert_thresholds must lie in (0, 1], got {thresholds}.")
        self.thresholds = sorted(thresholds)
        self.armed = [True] * len(self.thresholds)
        self.callbacks: list[AlertCallback] = []

    def check(self, held: int, capacity: int, stats: Callable[[], dict[str, Any]], device: torch.device) -> None:
        """After a change: ``held`` of ``capacity`` pages are held; ``stats`` gives the pool's statistics."""
        fraction = held / capacity
        for i, threshold in enumerate(self.thresholds):
            if fraction < threshold:
                self.armed[i] = True
            elif self.armed[i]:
                self.armed[i] = False
                snapshot = stats()
                logger.warning(
                    "KV pool on %s is %.0f%% full (%d of %d pages), past the %.0f%% alert threshold.",
                    device,
                    100 * fraction,
                    snapshot["pages_used"],
                    snapshot["max_pages"],
                    100 * threshold,
                )
                for callback in self.callbacks:
                    callback(threshold, snapshot)


def check_integrity(allocator: PageAllocator, tables: list[PageTable], storage: PoolStorage) -> None:
    """Raises ``AssertionError`` if a pool's allocator, its prefix index or any live page table is inconsistent: each
    page's refcount is its page-table references plus one if it is published."""
    allocator.check_integrity()
    references: Counter[int] = Counter()
    for table in tables:
        table.check_integrity()
        references += table.references()
    index = allocator.index
    published = {page for page in references if index is not None and index.is_published(page)}
    for page, count in references.items():
        expected = count + (page in published)
        assert allocator.refcount(page) == expected, f"page {page}: refcount != {expected} references"
    num_published = len(index) if index is not None else 0
    num_held = len(references) + num_published - len(published)
    assert allocator.num_used == num_held, "pages used that no live table or index holds (a leak)"
    assert storage.num_pages >= allocator.num_pages + 1, "page ids past the storage"
