"""``KVPool``: the pool of KV pages a user builds, names, shares between caches and watches.

Users hold a ``KVPool``: its constructors (``pools.PoolFactories``), ``stats``, alerts, ``reset_prefix_index`` and
``check_integrity``. Everything else is behind it in ``pool.pages`` (a ``PagePool``), which caches and layers use.
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
        num_pages: page ids to open now, the null page included (>= 2).
        max_pages: let the pool open page ids, in doublings, up to this many (``PagePool``); ``None``: a fixed pool.
        budget: a memory budget the ids the pool opens also draw from (the default pools').
        name: register the pool under this name so a ``cache_config`` can say ``{"pool": name}``.
        alert_thresholds: fractions of the capacity whose crossing alerts (``stats.PoolAlerts``).
        prefix_caching: keep a prefix index, so that caches on the pool reuse each other's prompt pages.
        prefix_tiers: where the prefix index's pages go besides the pool (``tiers``); needs ``prefix_caching``.
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
        return self.pages.prefix_caching

    def reset_prefix_index(self) -> int:
        """Drops every page of the prefix index (vLLM's ``reset_prefix_cache``), e.g. after the model's weights were
        updated in place: cached pages are freed; live caches keep theirs but publish nothing they wrote before.
        Returns the pages dropped from the index (0 without one)."""
        return self.pages.reset_prefix_index()

    def stats(self) -> dict[str, Any]:
        """Live statistics as a plain dict (``stats.pool_stats`` says what each count is)."""
        return self.pages.stats()

    def add_alert_callback(self, callback: AlertCallback) -> None:
        """Calls ``callback(threshold, stats)`` each time use crosses an alert threshold upwards."""
        self.pages.alerts.callbacks.append(callback)

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` if the allocator, its prefix index or any live page table is inconsistent."""
        self.pages.check_integrity()
