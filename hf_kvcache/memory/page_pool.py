"""``PagePool``: the pages behind a ``KVPool`` (``pool.pages``), what caches and layers work on: storage, allocator,
page tables and prefix index under one lock, so that threads running ``generate`` on different caches share a pool.

The storage is made once for every page id the pool may open (its cap, ``max_pages``, halved until the device grants
it) and never replaced: slot indices, views and compiled graphs over it stay valid. A growable pool (the default
pools) opens ``DEFAULT_INITIAL_TOKENS`` worth of ids, then doubles up to its cap, all or nothing; ids are zeroed in
whole extents as they open, and only they are touched (committed, on the CPU).

Every free page is all zeros (zeroed when opened, freed or evicted), so attention reading whole extents in place
reads zeros or live rows' pages, never an earlier request's NaN or inf (0 x NaN is NaN).
"""

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from hf_kvcache.errors import PoolExhaustedError
from hf_kvcache.memory.allocator import PageAllocator
from hf_kvcache.memory.device_memory import MemoryBudget
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.page_bytes import PageData
from hf_kvcache.memory.page_table import Allocator, PageTable
from hf_kvcache.memory.placement import AgreedPages, normalize_device
from hf_kvcache.memory.prefix_index import PageKey
from hf_kvcache.memory.stats import PoolAlerts, check_integrity, pool_stats
from hf_kvcache.memory.storage import PoolStorage
from hf_kvcache.memory.tiers import TIERS, PageTiers, TierSettings

logger = logging.getLogger("hf_kvcache")


class PagePool:
    """The storage, allocator and page tables of one ``KVPool``, under one lock (``KVPool``'s arguments).

    Attributes:
        storage: the page storage (``storage.PoolStorage``); write it inside ``held``.
        max_pages: page ids the pool may open at most, the null page included.
        tiers: where prefix pages go besides the pool (``configure_tiers``), or ``None``.
    """

    def __init__(
        self,
        page_format: PageFormat,
        num_pages: int,
        device: str | torch.device,
        max_pages: int | None,
        budget: MemoryBudget | None,
        alert_thresholds: tuple[float, ...],
        prefix_caching: bool,
    ) -> None:
        self._allocator = PageAllocator(num_pages, page_format.extent_pages, prefix_caching)  # checks num_pages
        if max_pages is not None and max_pages < num_pages:
            raise ValueError(f"max_pages={max_pages} is below num_pages={num_pages}.")
        self.alerts = PoolAlerts(alert_thresholds)
        self.format = page_format
        self.device = normalize_device(device)
        self.lock = threading.RLock()
        self._prefix_epoch = 0
        self.max_pages = max_pages or num_pages
        self.budget = budget
        self.storage = self._new_storage(num_pages)  # made once: the pool's for its life
        self._zero_range(0, self._storage_pages(num_pages))
        self._tables: weakref.WeakSet[PageTable] = weakref.WeakSet()
        self.tiers: PageTiers | None = None
        self._tier_hits = dict.fromkeys(TIERS, 0)  # pages attached by a lookup, by the tier they came from

    # ----- storage ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def held(self) -> Iterator[PoolStorage]:
        """Holds the lock for a change of several steps (a write at planned slots, a lookup and its attach): no other
        thread takes, frees or evicts pages until the block exits. Yields the storage."""
        with self.lock:
            yield self.storage

    def _new_storage(self, num_ids: int) -> PoolStorage:
        """Uninitialized storage for ``max_pages`` ids, whose cap is halved until the device grants it (never below
        the ``num_ids`` opened first)."""
        while True:
            try:
                return PoolStorage.empty(self.format, self._storage_pages(self.max_pages), self.device)
            except (RuntimeError, MemoryError) as error:  # torch's out-of-memory errors are RuntimeErrors
                if self.max_pages // 2 < num_ids:
                    raise
                logger.warning(
                    "KV pool on %s could not take %d pages (%s); trying half.", self.device, self.max_pages, error
                )
                self.max_pages //= 2

    def _storage_pages(self, num_ids: int) -> int:
        """Storage page ids for ``num_ids`` opened ones: whole extents (attention reads whole blocks)."""
        extent = self.format.extent_pages
        return -(-num_ids // extent) * extent

    def _zero_range(self, start: int, end: int) -> None:
        for tensor in self.storage.tensors:
            tensor[:, :, start:end].zero_()

    def _growth_room(self) -> int:
        """Page ids that can still open: up to ``max_pages``, within the memory budget if any."""
        room = self.max_pages - self._allocator.num_pages - 1
        if self.budget is not None:
            room = min(room, self.budget.free_bytes // self.format.page_bytes)
        return max(0, room)

    @property
    def capacity_pages(self) -> int:
        """Usable pages the pool holds or could still grow to (the null page excluded)."""
        with self.lock:
            return self._allocator.num_pages + self._growth_room()

    def _grow(self, num_needed: int) -> bool:
        """Opens page ids in doublings until ``num_needed`` are free, zeroed in whole extents; all or nothing. False
        if they cannot fit."""
        num_ids, num_wanted = self._allocator.num_pages + 1, num_needed - self._allocator.num_free
        room = self._growth_room()
        if room < num_wanted:
            return False
        target = num_ids
        while target - num_ids < num_wanted:
            target = min(num_ids + room, 2 * target)
        if self.budget is not None and not self.budget.reserve((target - num_ids) * self.format.page_bytes):
            return False  # another default pool of this device took the room meanwhile
        self._zero_range(num_ids, self._storage_pages(target))  # whole extents: attention reads them whole
        self._allocator.add_pages(target - num_ids)
        logger.info(
            "KV pool on %s grew to %d pages (%.1f MiB).",
            *(self.device, self._allocator.num_pages + 1, self.stats()["bytes_total"] / 2**20),
        )
        return True

    # ----- pages ----------------------------------------------------------------------------

    def ensure_free(self, num: int) -> None:
        """Makes sure ``num`` pages are free: the free ones, then cached pages evicted (least recently used first,
        zeroed), then room a growable pool grows into. Raises ``PoolExhaustedError``, nothing evicted, if
        the pool at its cap cannot hold ``num`` more."""
        with self.lock:
            num_cached = self._allocator.num_cached
            if num > self._allocator.num_available and not self._grow(num - num_cached):
                raise PoolExhaustedError(
                    num,
                    self._allocator.num_available,
                    self.capacity_pages,
                    f"Pages hold {self.format.page_size} tokens. Give the pool more room (KVPool.for_model(..., "
                    "max_tokens=...) or cache_config max_tokens), or lower the batch size or max_new_tokens.",
                )
            evicted = self._allocator.ensure_free(num)
            if self._allocator.index is not None:
                spilled = self._allocator.index.take_evicted()
                if spilled and self.tiers is not None and self.tiers.keeps_evicted:  # copied before they are zeroed
                    keys, pages = zip(*spilled)
                    self.tiers.spill(list(zip(keys, self._read_pages(list(pages)))))
            self._zero_pages(evicted)

    def allocate(self, num: int) -> list[int]:
        """``PageAllocator.allocate`` after ``ensure_free``: ``num`` zeroed pages, all or nothing."""
        with self.lock:
            self.ensure_free(num)
            pages = self._allocator.allocate(num)
            self._check_alerts()
            return pages

    def extend(self, anchor: int | None, num: int) -> list[int]:
        """``PageAllocator.extend`` after ``ensure_free``: a row's next ``num`` zeroed pages, all or nothing. A growable
        pool also grows where the free pages lie in too few whole extents, so that the row keeps extents of its own
        (which attention reads in place: ``foreign_pages``)."""
        with self.lock:
            self.ensure_free(num)
            allocator = self._allocator
            short = allocator.extents_needed(anchor, num) - allocator.num_whole_extents
            if short > 0:  # one extent more than short: the pages opened need not start on an extent boundary
                self._grow(allocator.num_free + (short + 1) * self.format.extent_pages)
            pages = allocator.extend(anchor, num)
            self._check_alerts()
            return pages

    def share(self, pages: list[int]) -> None:
        with self.lock:
            self._allocator.share(pages)

    def free(self, pages: list[int]) -> list[int]:
        """Drops one reference from each page; the pages left with none are zeroed."""
        with self.lock:
            freed = self._allocator.free(pages)
            self._zero_pages(freed)
            self._check_alerts()
            return freed

    def _zero_pages(self, pages: list[int]) -> None:
        if pages:
            index = torch.tensor(pages, dtype=torch.long, device=self.device)
            for tensor in self.storage.tensors:
                tensor.index_fill_(2, index, 0)

    def _read_pages(self, pages: list[int]) -> list[PageData]:
        """Each page's slots of every storage tensor, copied to the host (from CUDA: pinned, not waited for; ordered
        before any later write on the stream; ``PageData.ready`` marks their end)."""
        cuda = self.device.type == "cuda"
        tensors = self.storage.tensors
        datas = [
            PageData(tuple(t[:, :, page].to("cpu", non_blocking=cuda, copy=True) for t in tensors)) for page in pages
        ]
        if cuda and datas:
            event = torch.cuda.Event()
            event.record()
            for data in datas:
                data.ready = event
        return datas

    def _write_pages(self, pages: list[int], datas: list[PageData]) -> None:
        for page, data in zip(pages, datas):
            for tensor, slots in zip(self.storage.tensors, data.wait().tensors):
                tensor[:, :, page].copy_(slots, non_blocking=True)

    def refcount(self, page: int) -> int:
        return self._allocator.refcount(page)

    def foreign_pages(self, pages: set[int], extents: list[int]) -> list[int]:
        """Pages of ``extents`` neither in ``pages`` nor free (the null page among them): what attention reading those
        extents whole reads of other rows than the ones holding ``pages``."""
        size = self.format.extent_pages
        with self.lock:
            num_ids = self._allocator.num_pages + 1
            return [
                page
                for extent in extents
                for page in range(extent * size, min((extent + 1) * size, num_ids))
                if page not in pages and not self._allocator.is_free(page)
            ]

    @property
    def num_available_pages(self) -> int:
        """Pages a request could take now: the free and cached ones plus the room a growable pool can grow into."""
        with self.lock:
            return self._allocator.num_available + self._growth_room()

    # ----- prefix index -----------------------------------------------------------------------

    @property
    def prefix_caching(self) -> bool:
        return self._allocator.index is not None

    def enable_prefix_caching(self) -> None:
        """Starts the pool's prefix index (a no-op if it has one)."""
        with self.lock:
            self._allocator.enable_prefix_caching()

    @property
    def prefix_epoch(self) -> int:
        """How many times the prefix index was reset (``reset_prefix_index``)."""
        return self._prefix_epoch

    def reset_prefix_index(self) -> int:
        """``KVPool.reset_prefix_index``: frees the cached pages, counts a reset (``prefix_epoch``)."""
        with self.lock:
            if self._allocator.index is None:
                return 0
            dropped, freed = self._allocator.clear_index()
            self._zero_pages(freed)
            if self.tiers is not None:
                self.tiers.clear()
            self._prefix_epoch += 1
            self._check_alerts()
            return dropped

    def publish(self, pages: list[tuple[PageKey, int]]) -> int:
        """Publishes each ``(key, page)`` (a full page a cache holds); returns how many were new. A key already
        published keeps its page (the first wins)."""
        with self.lock:
            new = [(key, page) for key, page in pages if self._allocator.publish(key, page)]
            if new and self.tiers is not None and self.tiers.store is not None:
                keys, ids = zip(*new)
                self.tiers.publish(list(zip(keys, self._read_pages(list(ids)))))
            return len(new)

    def publish_tails(self, tails: list[tuple[PageKey, Any]]) -> list[tuple[PageKey, Any]]:
        """Keeps each ``(key, tail)`` beside the page published under ``key`` (``PrefixIndex.add_tail``); returns
        those kept."""
        with self.lock:
            return [(key, tail) for key, tail in tails if self._allocator.index.add_tail(key, tail)]

    def tail(self, key: PageKey) -> Any:
        """The tail kept beside the page published under ``key``, if any; hold ``lock`` as for ``lookup``."""
        return self._allocator.index.tail(key)

    def configure_tiers(self, settings: TierSettings | None) -> None:
        """Gives the pool's prefix index the tiers of ``settings`` (a no-op for ``None``, none enabled, or the pool's);
        ``ValueError`` without a prefix index, or with tiers of other settings."""
        if settings is None or not settings.enabled:
            return
        with self.lock:
            if self.tiers is not None:
                if self.tiers.settings != settings:
                    raise ValueError(
                        f"The pool keeps its prefix pages in {self.tiers.settings}; a cache asks for {settings}. "
                        "Give every cache on a pool the same prefix_host_bytes, prefix_disk_dir, prefix_disk_bytes and "
                        "prefix_store (or none: a cache uses its pool's), or give the cache a pool of its own."
                    )
                return
            if self._allocator.index is None:
                raise ValueError(
                    "Prefix tiers (prefix_host_bytes, prefix_disk_dir, prefix_store) need a prefix index: build the "
                    "pool with KVPool.for_model(model, ..., prefix_caching=True)."
                )
            specs = [(tuple(tensor[:, :, 0].shape), tensor.dtype) for tensor in self.storage.tensors]
            self.tiers = PageTiers(settings, self.format, specs)

    def restore(self, keys: list[PageKey], fetched: dict[PageKey, tuple[str, PageData]]) -> list[int]:
        """Takes a reference to each page of ``keys`` the index holds (so that nothing evicts it) and brings back each
        page of ``fetched`` (``PageTiers.fetch``) it lacks, published and taken (what does not fit stays out). Returns
        the pages taken: free them once the lookup attached what it wanted."""
        with self.lock:
            held, missing = [], []
            for key in dict.fromkeys(keys):
                page = self._allocator.lookup(key)
                if page is not None:
                    held.append(page)
                elif key in fetched:
                    missing.append(key)
            self._allocator.share(held)
            if not missing:
                return held
            try:
                pages = self.allocate(len(missing))
            except PoolExhaustedError:
                logger.info("%d prefix pages from the tiers do not fit in the pool; they are recomputed.", len(missing))
                return held
            datas = [fetched[key][1] for key in missing]
            self._write_pages(pages, datas)
            for key, page in zip(missing, pages):
                self._allocator.publish(key, page)
            self.tiers.restored(missing, sum(data.nbytes for data in datas))
            return held + pages

    def flush_tiers(self, timeout: float | None = 30.0) -> bool:
        """Waits until pages on their way to the prefix directory or store are written; False if ``timeout`` seconds
        passed first."""
        return self.tiers.flush(timeout) if self.tiers is not None else True

    def record_tier_hits(self, tiers: list[str]) -> None:
        """Counts pages a lookup attached, each by the tier it came from (``stats()``)."""
        with self.lock:
            for tier in tiers:
                self._tier_hits[tier] += 1

    def lookup(self, key: PageKey) -> int | None:
        """The page published under ``key``, without taking it. Hold ``lock`` until it is taken (``share``), or it
        may be evicted in between."""
        return self._allocator.lookup(key)

    def record_prefix_lookup(self, num_rows: int, tokens_reused_per_row: int, tokens_per_row: int) -> None:
        """Counts a lookup of ``num_rows`` prompts of ``tokens_per_row`` tokens, ``tokens_reused_per_row`` reused."""
        with self.lock:
            self._allocator.index.record_lookup(num_rows, tokens_reused_per_row, tokens_per_row)

    def new_table(self, row_extents: bool = False, process_group: Any = None) -> PageTable:
        """An empty page table drawing from this pool, counted in its statistics; with a tensor-parallel
        ``process_group``, its allocations are agreed over it (``AgreedPages``)."""
        allocator: Allocator = self if process_group is None else AgreedPages(self, process_group)
        table = PageTable(allocator, self.format.page_size, row_extents)
        with self.lock:
            self._tables.add(table)
        return table

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copies every layer's slots of page ``src`` into page ``dst`` for each ``(src, dst)``."""
        if not pairs:
            return
        src = torch.tensor([pair[0] for pair in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([pair[1] for pair in pairs], dtype=torch.long, device=self.device)
        with self.lock:
            for tensor in self.storage.tensors:
                tensor.index_copy_(2, dst, tensor.index_select(2, src))

    # ----- statistics -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self.lock:
            max_pages, tables = self.capacity_pages, list(self._tables)
            return pool_stats(
                self._allocator, tables, self.format, self.storage, max_pages, self.device, self._tier_hits, self.tiers
            )

    def _check_alerts(self) -> None:
        held = self._allocator.num_used - self._allocator.num_cached  # cached pages are as good as free
        self.alerts.check(held, self.capacity_pages, self.stats, self.device)

    def check_integrity(self) -> None:
        with self.lock:
            check_integrity(self._allocator, list(self._tables), self.storage)
