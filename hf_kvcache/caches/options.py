"""The options a cache is built from (``cache_config``): a frozen dataclass that checks itself on construction and
names the setting to change; each cache's options extend ``CacheOptions`` with its own keys.
"""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import torch

from hf_kvcache.memory.format import DEFAULT_PAGE_SIZE, PageFormat, check_page_size


@dataclass(frozen=True)
class CacheOptions:
    """The ``cache_config`` keys of a paged cache.

    Subclasses add their own keys after these; build options by keyword.

    Attributes:
        page_size: token slots per page (used when the cache builds its own pool).
        pool: a ``KVPool``, or the name of one, to draw pages from; ``None`` for the default pool.
        max_tokens: give this cache a fixed-budget pool of its own holding this many tokens.
        admission_check: before any compute, ``generate`` refuses a request whose worst-case page need
            (rows x pages for prompt + ``max_new_tokens``) exceeds what the pool has free or can still grow
            into, with a ``PoolExhaustedError`` (``exceeds_pool``: more than the whole pool), so that a request
            that cannot fit fails alone instead of taking the pages other requests need. A check, not a
            reservation: requests running at the same time may still take the pages, and a request that passes
            can then fail mid-generation. ``None`` (the default): on wherever the pool is known before the first
            write (not for a model offloaded without a device map); ``True``: on, and such a model is refused;
            ``False``: off.
        prefix_caching: reuse prompt pages across ``generate`` calls through the pool's prefix index
            (``hf_kvcache.caches.prefix``). ``True``: the default pool or ``max_tokens`` pool the cache draws from
            keeps one (a given ``pool`` must have been built with ``prefix_caching=True``); ``None``: only where a
            given ``pool`` keeps one; ``False``: never.
        prefix_namespace: a name the cache's pages are published and found under, besides the model and the
            cache's attention: caches of other namespaces (tenants, experiments) never share pages on one pool.
    """

    page_size: int = DEFAULT_PAGE_SIZE
    pool: Any = None
    max_tokens: int | None = None
    admission_check: bool | None = None
    prefix_caching: bool | None = None
    prefix_namespace: str = ""

    def __post_init__(self) -> None:
        check_page_size(self.page_size)
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise TypeError(
                    f"max_tokens must be an int, got {self.max_tokens!r} ({type(self.max_tokens).__name__})."
                )
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}.")
            if self.pool is not None:
                raise ValueError("Set either pool or max_tokens in cache_config, not both.")
        if self.admission_check is not None and not isinstance(self.admission_check, bool):
            raise TypeError(
                f"admission_check must be True, False or None, got {self.admission_check!r} "
                f"({type(self.admission_check).__name__})."
            )
        if self.prefix_caching is not None and not isinstance(self.prefix_caching, bool):
            raise TypeError(
                f"prefix_caching must be True, False or None, got {self.prefix_caching!r} "
                f"({type(self.prefix_caching).__name__})."
            )
        if not isinstance(self.prefix_namespace, str):
            raise TypeError(
                f"prefix_namespace must be a str, got {self.prefix_namespace!r} "
                f"({type(self.prefix_namespace).__name__})."
            )

    def page_format(self, config: Any, dtype: torch.dtype) -> PageFormat:
        """The format of the pool a cache with these options draws from, for a model config and dtype."""
        return PageFormat.from_model_config(config, dtype, self.page_size)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> Self:
        """Builds options from a ``cache_config`` dict, rejecting unknown keys with the list of valid ones."""
        valid = [field.name for field in dataclasses.fields(cls)]
        if values is not None and not isinstance(values, Mapping):
            raise TypeError(
                f"cache_config must be a dict of {cls.__name__} keys {valid}, got {values!r} ({type(values).__name__})."
            )
        values = dict(values or {})
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"Unknown cache_config keys {unknown} for {cls.__name__}; valid keys are {valid}.")
        return cls(**values)
