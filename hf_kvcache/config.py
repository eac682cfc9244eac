"""Specs: the page format a pool is cut into, and the options a cache is built from.

Both are frozen dataclasses that check themselves on construction and name the setting to change.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Self

import torch

from hf_kvcache.errors import IncompatibleModelError

DEFAULT_PAGE_SIZE = 16
MAX_PAGE_SIZE = 4096


def check_page_size(page_size: int) -> int:
    """Returns ``page_size`` if it is a valid page size, else raises a ``ValueError`` naming the setting."""
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size must be an int, got {page_size!r} ({type(page_size).__name__}).")
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size={page_size} is out of range: choose 1 <= page_size <= {MAX_PAGE_SIZE}.")
    return page_size


@dataclass(frozen=True)
class PageFormat:
    """Geometry of one page: ``page_size`` token slots in every layer of one model.

    A slot is one token's key and value in one layer; one page id addresses the same
    ``page_size`` slots in all ``num_layers`` layers.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int = DEFAULT_PAGE_SIZE

    def __post_init__(self) -> None:
        check_page_size(self.page_size)
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"PageFormat.{name} must be >= 1, got {getattr(self, name)}.")
        if not self.dtype.is_floating_point:
            raise ValueError(f"PageFormat.dtype must be a floating dtype, got {self.dtype}.")

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers."""
        return self.token_bytes * self.page_size

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens of one sequence."""
        return math.ceil(num_tokens / self.page_size)

    @classmethod
    def from_model_config(cls, config: Any, dtype: torch.dtype, page_size: int = DEFAULT_PAGE_SIZE) -> Self:
        """Reads the attention geometry of a transformers (decoder) config.

        Raises:
            IncompatibleModelError: the config has no attention geometry we can page.
        """
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if getattr(config, "is_encoder_decoder", False):
            raise IncompatibleModelError(
                f"{type(config).__name__} is an encoder-decoder model; hf_kvcache caches serve decoder-only models."
            )
        num_heads = getattr(config, "num_attention_heads", None)
        num_layers = getattr(config, "num_hidden_layers", None)
        if num_heads is None or num_layers is None:
            raise IncompatibleModelError(
                f"{type(config).__name__} has no num_attention_heads/num_hidden_layers: not an attention model."
            )
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(num_layers, num_kv_heads, head_dim, dtype, page_size)


@dataclass(frozen=True)
class CacheOptions:
    """The ``cache_config`` keys of a paged cache.

    Attributes:
        page_size: token slots per page (used when the cache builds its own pool).
        pool: a ``KVPool``, or the name of one, to draw pages from; ``None`` for the default pool.
        max_tokens: give this cache a fixed-budget pool of its own holding this many tokens.
    """

    page_size: int = DEFAULT_PAGE_SIZE
    pool: Any = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        check_page_size(self.page_size)
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
                raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}.")
            if self.pool is not None:
                raise ValueError("Set either pool or max_tokens in cache_config, not both.")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> Self:
        """Builds options from a ``cache_config`` dict, rejecting unknown keys with the list of valid ones."""
        values = dict(values or {})
        valid = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"Unknown cache_config keys {unknown} for {cls.__name__}; valid keys are {valid}.")
        return cls(**values)
