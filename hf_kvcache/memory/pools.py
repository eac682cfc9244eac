"""How pools are made and found (``PoolFactories``, ``KVPool``'s constructors): for a model under a budget, by name,
the shared default pool of a format and device, and the shared fixed pool of a ``max_tokens`` budget. The registries
of named and shared pools live here, under one lock."""

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, Self

import torch

from hf_kvcache.memory import device_memory
from hf_kvcache.memory.device_memory import MemoryBudget
from hf_kvcache.memory.format import PageFormat, geometry_groups, layer_types
from hf_kvcache.memory.placement import agree, kv_heads_per_rank, normalize_device
from hf_kvcache.memory.tiers import TierSettings

logger = logging.getLogger("hf_kvcache")

DEFAULT_INITIAL_TOKENS = 4096
"""A default pool opens room for this many tokens first, then doubles as needed."""
DEFAULT_MAX_MEMORY_FRACTION = 0.5
"""The default pools of one device hold, together, at most this fraction of the memory (CPU: ``memory_limit_bytes``;
CUDA: the free memory when the first of them was made)."""
DEFAULT_MAX_POOL_PAGES = 1 << 16
"""A default pool holds at most this many pages: attention reads its storage in place with tables of one entry per
page and row (``attention.flex``), which this keeps small."""
_NAMED_POOLS: "weakref.WeakValueDictionary[str, PoolFactories]" = weakref.WeakValueDictionary()
_DEFAULT_POOLS: dict[tuple[PageFormat, torch.device], "PoolFactories"] = {}
_BUDGET_POOLS: dict[tuple[PageFormat, torch.device, int], "PoolFactories"] = {}
_DEFAULT_BUDGETS: dict[torch.device, MemoryBudget] = {}
_REGISTRY_LOCK = threading.Lock()


class CacheConfigLike(Protocol):
    """What ``KVPool.for_model`` needs of a cache's config (``hf_kvcache.PagedConfig`` and its subclasses)."""

    def page_format(self, config: Any, dtype: torch.dtype) -> PageFormat: ...


def register_name(name: str, pool: "Any") -> None:
    """Registers ``pool`` under ``name`` (``KVPool(name=...)``), refusing a name a live pool holds."""
    with _REGISTRY_LOCK:
        if name in _NAMED_POOLS:
            raise ValueError(f"A pool named {name!r} already exists; choose another name.")
        _NAMED_POOLS[name] = pool


def _num_pages(
    page_format: PageFormat, device: torch.device, max_tokens: int | None, max_bytes: int | None, share: float
) -> int:
    """Page ids (the null page included) of a pool of ``page_format`` holding ``max_tokens`` tokens, or ``share`` of
    ``max_bytes`` (a part of a ``KVPoolSet``)."""
    if max_tokens is not None:
        num_pages = page_format.pages_for_tokens(max_tokens) + 1
        device_memory.check_fits(f"max_tokens={max_tokens}", num_pages * page_format.page_bytes, device)
        return num_pages
    num_pages = int(max_bytes * share) // page_format.page_bytes
    device_memory.check_fits(f"max_bytes={max_bytes}", num_pages * page_format.page_bytes, device)
    if num_pages < 2:
        raise ValueError(
            f"max_bytes={max_bytes} holds fewer than 2 pages of {page_format.page_bytes} bytes "
            f"({page_format.num_kv_heads} KV heads of width {page_format.head_dim}); raise it."
        )
    return num_pages


class PoolFactories:
    """``KVPool``'s constructors beyond ``__init__``: each makes or finds a ``cls`` (the pool class)."""

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        cache_config: "CacheConfigLike | None" = None,
        *,
        max_tokens: int | None = None,
        max_bytes: int | None = None,
        memory_fraction: float | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        name: str | None = None,
        alert_thresholds: tuple[float, ...] = (0.9,),
        prefix_caching: bool = False,
        prefix_host_bytes: int = 0,
        prefix_disk_dir: str | None = None,
        prefix_disk_bytes: int | None = None,
        prefix_store: str | None = None,
    ) -> "Self | KVPoolSet":
        """A fixed-budget pool for ``model``, sized by exactly one of the three budgets.

        A model whose layers write keys and values of different geometries gets a ``KVPoolSet``: a pool per geometry,
        each holding ``max_tokens`` tokens of its layers, or a share of the bytes in proportion to a token's bytes in
        its layers, without a prefix index. On a tensor-parallel model the pool is this rank's, cut for its KV heads
        (``kv_heads_per_rank``).

        Args:
            cache_config: the config of the caches that will draw from the pool (``hf_kvcache.PagedConfig``, ...): its
                page size and how pages store keys and values; ``None``: a default ``PagedConfig``'s.
            max_tokens / max_bytes / memory_fraction: token slots (over all sequences), bytes of pages, or a fraction of
                the device's free memory (CUDA only).
            dtype / device: default to the model's.
            prefix_host_bytes / prefix_disk_dir / prefix_disk_bytes / prefix_store: the index's tiers
                (``tiers.TierSettings``); any of them keeps a prefix index.
        """
        tiers = TierSettings(prefix_host_bytes, prefix_disk_dir, prefix_disk_bytes, prefix_store)
        budgets = {"max_tokens": max_tokens, "max_bytes": max_bytes, "memory_fraction": memory_fraction}
        given = [key for key, value in budgets.items() if value is not None]
        if len(given) != 1:
            raise ValueError(f"Give exactly one of {list(budgets)} to size the pool; got {given or 'none'}.")
        dtype = dtype or model.dtype
        device = normalize_device(device if device is not None else model.device)
        if cache_config is None:
            page_format = PageFormat.from_model_config(model.config, dtype)
        elif callable(getattr(cache_config, "page_format", None)):
            page_format = cache_config.page_format(model.config, dtype)
        else:
            raise TypeError(
                f"cache_config={cache_config!r}: give the config of the caches that will use the pool, such as "
                "hf_kvcache.PagedConfig(page_size=16) or hf_kvcache.QuantizedValueConfig(bits=4), or None."
            )
        text_config = model.config.get_text_config(decoder=True)
        formats = page_format.for_geometries(geometry_groups(text_config, layer_types(text_config))[1])
        tp_size = getattr(model, "tp_size", None) or 1  # transformers' public properties, set on every model
        tp_plan = getattr(model, "tp_plan", None)
        formats = [
            dataclasses.replace(part, num_kv_heads=kv_heads_per_rank(part.num_kv_heads, tp_plan, tp_size))
            for part in formats
        ]
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}.")
        if memory_fraction is not None:
            if device.type != "cuda":
                raise ValueError(f"memory_fraction sizes a CUDA pool; device is {device}. Use max_bytes instead.")
            if not 0 < memory_fraction <= 1:
                raise ValueError(f"memory_fraction must lie in (0, 1], got {memory_fraction}.")
            max_bytes = int(torch.cuda.mem_get_info(device)[0] * memory_fraction)
        if len(formats) > 1 and (prefix_caching or tiers.enabled):
            raise ValueError(
                f"{type(text_config).__name__}'s layers write keys and values of {len(formats)} geometries, whose "
                "pools keep no prefix index (prompts are reused on a pool of one geometry): leave prefix_caching "
                "and the prefix tiers unset."
            )
        token_bytes = sum(part.token_bytes for part in formats)
        parts = [
            cls(
                *(part, _num_pages(part, device, max_tokens, max_bytes, part.token_bytes / token_bytes), device),
                name=name if len(formats) == 1 else None,
                alert_thresholds=alert_thresholds,
                prefix_caching=prefix_caching or tiers.enabled,
                prefix_tiers=tiers,
            )
            for part in formats
        ]
        return parts[0] if len(parts) == 1 else KVPoolSet(parts, name)

    @classmethod
    def named(cls, name: str) -> Self:
        pool = _NAMED_POOLS.get(name)
        if pool is None:
            raise ValueError(f"No pool named {name!r}; live pools: {sorted(_NAMED_POOLS)}.")
        return pool

    @classmethod
    def default(
        cls,
        page_format: PageFormat,
        device: str | torch.device,
        process_group: Any = None,
        max_tokens: int | None = None,
    ) -> Self:
        """The shared pool for this format and device, made on first use and kept for the process: the growable
        default pool, or with ``max_tokens`` a fixed pool of that many tokens with a prefix index.

        The default pools of one device share one ``MemoryBudget`` (``DEFAULT_MAX_MEMORY_FRACTION``). Where memory is
        committed only where touched (``commits_lazily``: the CPU), a pool's cap is the whole budget and its pages draw
        on it as they open; elsewhere (CUDA) the storage commits its cap at once, so the cap is half the room left in
        the budget, drawn at once and logged. With a tensor-parallel ``process_group`` the budget is the smallest of
        the ranks' (a collective: every rank calls it).
        """
        device = normalize_device(device)
        if max_tokens is not None:
            return cls._budget_pool(page_format, device, max_tokens)
        with _REGISTRY_LOCK:
            budget = _DEFAULT_BUDGETS.get(device)
            if budget is None:
                if device.type == "cuda":
                    memory = torch.cuda.mem_get_info(device)[0]
                else:
                    memory = device_memory.memory_limit_bytes()
                budget = _DEFAULT_BUDGETS[device] = MemoryBudget(int(memory * DEFAULT_MAX_MEMORY_FRACTION))
        if process_group is not None:  # outside the lock: the other ranks may take a while to get here
            budget.limit_to(agree([budget.total_bytes], process_group, device)[0])
        with _REGISTRY_LOCK:
            pool = _DEFAULT_POOLS.get((page_format, device))
            if pool is None:
                pool = _DEFAULT_POOLS[(page_format, device)] = cls._new_default(page_format, device, budget)
            return pool

    @classmethod
    def _new_default(cls, page_format: PageFormat, device: torch.device, budget: MemoryBudget) -> Self:
        """A default pool under ``budget`` (``default``), at least the null page and one more."""
        page_bytes, first = page_format.page_bytes, page_format.pages_for_tokens(DEFAULT_INITIAL_TOKENS) + 1
        if device_memory.commits_lazily(device):  # the pages draw on the budget as they open
            max_pages = max(2, min(DEFAULT_MAX_POOL_PAGES, budget.total_bytes // page_bytes))
            num_pages = min(max_pages, max(2, budget.free_bytes // page_bytes), first)
            budget.reserve(num_pages * page_bytes)
            return cls(page_format, num_pages, device, max_pages=max_pages, budget=budget)
        max_pages = max(2, min(DEFAULT_MAX_POOL_PAGES, budget.free_bytes // 2 // page_bytes))
        pool = cls(page_format, min(max_pages, first), device, max_pages=max_pages)  # halved until granted
        budget.reserve(pool.pages.max_pages * page_bytes)
        logger.warning(
            "KV pool on %s took %d pages (%.1f MiB: half the room left in its device's default pools' budget) at "
            "once, in a storage that never moves. Pass cache_config max_tokens, or KVPool.for_model(..., "
            "max_tokens=...), for a pool of another size.",
            *(device, pool.pages.max_pages, pool.pages.max_pages * page_bytes / 2**20),
        )
        return pool

    @classmethod
    def default_budget(cls, device: str | torch.device) -> MemoryBudget | None:
        """The memory budget the default pools of ``device`` share (``None`` before the first is made)."""
        with _REGISTRY_LOCK:
            return _DEFAULT_BUDGETS.get(normalize_device(device))

    @classmethod
    def drop_defaults(cls, device: str | torch.device | None = None) -> int:
        """Forgets the shared default pools of ``device`` (every device: ``None``) and their budget, so that the next
        ``default`` call makes a fresh pool under a fresh budget; caches keep the pools they hold. Returns how many
        pools were forgotten."""
        with _REGISTRY_LOCK:
            keep = None if device is None else normalize_device(device)
            dropped = [key for key in _DEFAULT_POOLS if keep is None or key[1] == keep]
            for key in dropped:
                del _DEFAULT_POOLS[key]
            for budget_device in [d for d in _DEFAULT_BUDGETS if keep is None or d == keep]:
                del _DEFAULT_BUDGETS[budget_device]
            return len(dropped)

    @classmethod
    def _budget_pool(cls, page_format: PageFormat, device: torch.device, max_tokens: int) -> Self:
        """The shared fixed pool of ``max_tokens`` tokens with a prefix index (``default``)."""
        num_pages = _num_pages(page_format, device, max_tokens, None, 1.0)
        with _REGISTRY_LOCK:
            pool = _BUDGET_POOLS.get((page_format, device, num_pages))
            if pool is None:
                pool = cls(page_format, num_pages, device, prefix_caching=True)
                _BUDGET_POOLS[(page_format, device, num_pages)] = pool
            return pool


def pool_parts(pool: Any) -> tuple[Any, ...]:
    """The ``KVPool`` of each geometry ``pool`` serves: a ``KVPoolSet``'s parts, or the pool itself."""
    return pool.parts if isinstance(pool, KVPoolSet) else (pool,)


SUMMED_STATS = ("pages_total", "pages_unfilled", "pages_used", "pages_free", "pages_cached", "max_pages")
SUMMED_STATS += ("high_water_pages", "bytes_total", "bytes_reserved", "bytes_used", "tokens_held", "live_tables")


class KVPoolSet:
    """The pool of a model whose layers write keys and values of different geometries (Gemma 4, MiMo-V2-Flash): a
    ``KVPool`` per geometry (``parts``, in ``PageFormat.for_geometries`` order) on one device, built, sized and reported
    together; ``name`` as ``KVPool``'s.
    """

    def __init__(self, parts: list[Any], name: str | None = None) -> None:
        self.parts = tuple(parts)
        self.device = self.parts[0].device
        self.name = name
        if name is not None:
            register_name(name, self)

    def __repr__(self) -> str:
        return f"KVPoolSet(name={self.name!r}, {', '.join(repr(part) for part in self.parts)})"

    def __copy__(self) -> "KVPoolSet":
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "KVPoolSet":
        return self

    @property
    def formats(self) -> tuple[PageFormat, ...]:
        return tuple(part.format for part in self.parts)

    @property
    def capacity_pages(self) -> int:
        """Usable pages the parts hold or could still grow to, together."""
        return sum(part.capacity_pages for part in self.parts)

    @property
    def prefix_caching(self) -> bool:
        """``False``: prompts are reused on a pool of one geometry only."""
        return False

    def reset_prefix_index(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        """The parts' counts summed (``SUMMED_STATS``), with each part's own statistics under ``"geometries"``."""
        parts = [part.stats() for part in self.parts]
        stats: dict[str, Any] = {key: sum(part[key] for part in parts) for key in SUMMED_STATS}
        stats.update(device=parts[0]["device"], dtype=parts[0]["dtype"], page_size=parts[0]["page_size"])
        stats.update(prefix_caching=False, geometries=parts)
        return stats

    def add_alert_callback(self, callback: Callable[[float, dict[str, Any]], None]) -> None:
        """Calls ``callback(threshold, stats)`` each time a part's use crosses an alert threshold upwards."""
        for part in self.parts:
            part.add_alert_callback(callback)

    def check_integrity(self) -> None:
        for part in self.parts:
            part.check_integrity()
