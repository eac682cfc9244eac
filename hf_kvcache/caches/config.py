"""``PagedConfig``: the settings every cache takes (``generate``'s ``cache_config``), checked on construction; each
cache's config extends it with its own."""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import torch

from hf_kvcache.memory.format import DEFAULT_PAGE_SIZE, PageFormat, check_page_size
from hf_kvcache.memory.pool import KVPool
from hf_kvcache.memory.pools import KVPoolSet
from hf_kvcache.memory.tiers import TierSettings


def check_count(name: str, value: Any, low: int, optional: bool = False) -> None:
    """Raises ``TypeError`` unless ``value`` is an int (or ``None`` where ``optional``), ``ValueError`` if it is below
    ``low``, naming the setting and the value."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    if value < low:
        raise ValueError(f"{name}={value} is out of range: choose {name} >= {low}.")


def check_flag(name: str, value: Any) -> None:
    """Raises ``TypeError`` unless ``value`` is ``True``, ``False`` or ``None``, naming the setting and the value."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None, got {value!r} ({type(value).__name__}).")


@dataclass(frozen=True)
class PagedConfig:
    """The settings of ``PagedCache``, which every cache's config extends; build it by keyword.

    Attributes:
        page_size: token slots per page (of a pool the cache makes, and of ``KVPool.for_model(model, config)``).
        pool: a ``KVPool`` (a ``KVPoolSet`` for several geometries) or a pool's name; ``None``: the default pool.
        max_tokens: give this cache a fixed-budget pool of its own holding this many tokens.
        admission_check: refuse, before any compute, a request whose worst-case pages exceed what the pool can give
            (``PoolExhaustedError``). ``None``: wherever the pool is known before the first write; ``True``: always.
        prefix_caching: reuse prompt pages across calls through the pool's prefix index. ``True``: the pool the
            cache makes keeps one (a given ``pool`` must); ``None``: only where a given ``pool`` keeps one.
        prefix_namespace: pages are published and found under it only (tenants, experiments).
        prefix_host_bytes / prefix_disk_dir / prefix_disk_bytes / prefix_store: the pool's prefix tiers (host
            memory, a directory, a Redis URL: ``hf_kvcache.memory.tiers``), set by the first cache that asks; any
            of them turns ``prefix_caching`` on (``False`` with one is refused).
    """

    page_size: int = DEFAULT_PAGE_SIZE
    pool: KVPool | KVPoolSet | str | None = None
    max_tokens: int | None = None
    admission_check: bool | None = None
    prefix_caching: bool | None = None
    prefix_namespace: str = ""
    prefix_host_bytes: int = 0
    prefix_disk_dir: str | None = None
    prefix_disk_bytes: int | None = None
    prefix_store: str | None = None

    def __post_init__(self) -> None:
        check_page_size(self.page_size)
        if self.pool is not None and not isinstance(self.pool, (KVPool, KVPoolSet, str)):
            raise TypeError(f"pool must be a KVPool or a pool's name, got {self.pool!r} ({type(self.pool).__name__}).")
        check_count("max_tokens", self.max_tokens, 1, optional=True)
        if self.max_tokens is not None and self.pool is not None:
            raise ValueError("Set either pool or max_tokens in cache_config, not both.")
        check_flag("admission_check", self.admission_check)
        check_flag("prefix_caching", self.prefix_caching)
        if not isinstance(self.prefix_namespace, str):
            raise TypeError(
                f"prefix_namespace must be a str, got {self.prefix_namespace!r} "
                f"({type(self.prefix_namespace).__name__})."
            )
        tiers = self.prefix_tiers  # checks the four settings, naming the one to change
        if tiers.enabled:
            if self.prefix_caching is False:
                raise ValueError(
                    f"prefix_caching=False but {tiers} asks for prefix tiers: drop those settings or set "
                    "prefix_caching=True (or leave it unset)."
                )
            object.__setattr__(self, "prefix_caching", True)

    @property
    def prefix_tiers(self) -> TierSettings:
        """The prefix tiers this config asks its pool for (``TierSettings.enabled`` False: none)."""
        return TierSettings(self.prefix_host_bytes, self.prefix_disk_dir, self.prefix_disk_bytes, self.prefix_store)

    def page_format(self, config: Any, dtype: torch.dtype) -> PageFormat:
        """The format of the pool a cache with this config draws from, for a model config and dtype."""
        return PageFormat.from_model_config(config, dtype, self.page_size)

    @classmethod
    def parse(cls, value: "PagedConfig | Mapping[str, Any] | None") -> Self:
        """This class's config from a ``cache_config``: an instance as is, a dict (or ``None``: the defaults) by keys.
        ``TypeError`` for another cache's config or neither; ``ValueError`` naming the valid keys for an unknown one."""
        if type(value) is cls:
            return value
        valid = [field.name for field in dataclasses.fields(cls)]
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(
                f"cache_config={value!r} ({type(value).__name__}): give a {cls.__name__} or a dict of its keys {valid}."
            )
        values = dict(value or {})
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"Unknown cache_config keys {unknown} for {cls.__name__}; valid keys are {valid}.")
        return cls(**values)
