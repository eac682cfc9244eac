"""``KVPool``: the pool of KV pages a user builds, names, shares between caches and watches.

Where things live: ``KVPool`` is what users hold, a handful of methods (its constructors, ``stats``, alerts,
``reset_prefix_index``, ``check_integrity``); its constructors beyond ``__init__`` and the registries of named and
shared default pools are in ``hf_kvcache.memory.pools``. Everything else is behind it, in ``pool.pages`` (a
``PagePool``, ``hf_kvcache.memory.page_pool``): the storage that never moves, the allocator, the page tables drawing
from it and the prefix index, under one lock. Caches, layers and the prefix tracker work on ``pool.pages``; so do
tests that poke the allocator. ``pool.format`` and ``pool.device`` say what the pool holds and where.
"""

from typing import Any

import torch

from hf_kvcache.memory.device_memory import MemoryBudget
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.page_pool import PagePool
from hf_kvcache.memory.pools import PoolFactories, register_name
from hf_kvcache.memory.stats import AlertCallback
from hf_kvcache.memory.tiers import TierSettings


class KVPool(PoolFactories):
    """Pages of KV memory for one model geometry (``PageFormat``) on one device.

    Build one with ``KVPool.for_model(model, cache_config, max_tokens=...)``; caches draw from the default pool of
    their model otherwise (``KVPool.default``).

    Args:
        page_format: geometry and dtype of a page.
        num_pages: page ids to open now, the null page included (>= 2).
        device: where the storage lives.
        max_pages: let the pool open page ids, in doublings, up to this many (its storage holds them all from the
            start; halved until the device grants it); ``None`` for a fixed pool.
        budget: a memory budget the ids the pool opens also draw from (the CPU's default pools share one).
        name: register the pool under this name so a ``cache_config`` can say ``{"pool": name}``.
        alert_thresholds: fractions of the pool's capacity whose upward crossing logs a warning and
            calls the alert callbacks (once per crossing).
        prefix_caching: keep a prefix index, so that caches on the pool reuse each other's prompt pages across
            ``generate`` calls (``PoolCache.prefix``); idle published pages stay cached until evicted.
        prefix_tiers: where the prefix index's pages go besides the pool (host memory, a directory, a shared store:
            ``hf_kvcache.memory.tiers``); needs ``prefix_caching``.

    Attributes:
        format / device: the page format and the device.
        name: the name the pool is registered under, or ``None``.
        pages: the storage, allocator and page tables behind the pool (``PagePool``), for caches and layers.
    """

    def __init__(
        self,
        page_format: PageFormat,
        num_pages: int,
        device: str | torch.device = "cpu",
        *,
        max_pages: int | None = None,
        budget: MemoryBudget | None = None,
        name: str | None = None,
        alert_thresholds: tuple[float, ...] = (0.9,),
        prefix_caching: bool = False,
        prefix_tiers: TierSettings | None = None,
    ) -> None:
        self.pages = PagePool(page_format, num_pages, device, max_pages, budget, alert_thresholds, prefix_caching)
        self.pages.configure_tiers(prefix_tiers)
        self.format = page_format
        self.device = self.pages.device
        self.name = name
        if name is not None:
            register_name(name, self)

    def __repr__(self) -> str:
        stats = self.stats()
        return (
            f"KVPool(name={self.name!r}, device={self.device}, pages {stats['pages_used']}/{stats['pages_total']} "
            f"used, page_size={self.format.page_size}, {stats['bytes_total'] / 2**20:.1f} MiB)"
        )

    def __copy__(self) -> "KVPool":
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "KVPool":
        """A pool is a shared resource: ``generate`` deep-copies its config, never the pool in it."""
        return self

    @property
    def capacity_pages(self) -> int:
        """Usable pages the pool holds or could still grow to (the null page excluded)."""
        return self.pages.capacity_pages

    @property
    def prefix_caching(self) -> bool:
        """Whether the pool keeps a prefix index (``KVPool.for_model(..., prefix_caching=True)``, or a cache's
        ``prefix_caching=True`` on the default pool)."""
        return self.pages.prefix_caching

    def reset_prefix_index(self) -> int:
        """Drops every page of the prefix index at once (vLLM's ``reset_prefix_cache``), e.g. after the model's
        weights were updated in place: cached pages are freed; pages live caches hold stay theirs, and those caches
        publish nothing more they wrote before the reset. Returns the pages dropped from the index (0 without one).
        """
        return self.pages.reset_prefix_index()

    def stats(self) -> dict[str, Any]:
        """Live statistics as a plain dict (``hf_kvcache.memory.stats.pool_stats`` says what each count is)."""
        return self.pages.stats()

    def add_alert_callback(self, callback: AlertCallback) -> None:
        """Calls ``callback(threshold, stats)`` each time use crosses an alert threshold upwards."""
        self.pages.alerts.callbacks.append(callback)

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` if the allocator, its prefix index or any live page table is inconsistent: each
        page's refcount is its page-table references plus one if it is published."""
        self.pages.check_integrity()
