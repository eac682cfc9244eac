"""``QuantizedValueCache``: keys in the model's dtype, values stored as int8/int4 codes on the shared pool."""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvcache.caches.base import PoolCache
from hf_kvcache.caches.config import PagedConfig, check_count
from hf_kvcache.caches.entry import CacheEntry
from hf_kvcache.caches.policy import RowPolicy
from hf_kvcache.memory.format import PageFormat

DEFAULT_GROUP_SIZE = 64
DEFAULT_RESIDUAL_LENGTH = 128
"""The most recent tokens whose values each row and layer keeps in full precision, outside the pool; what the
window buys in accuracy is in docs/caches.md."""


@dataclass(frozen=True)
class QuantizedValueConfig(PagedConfig):
    """The settings of ``QuantizedValueCache``: ``PagedConfig``'s and these.

    Attributes:
        bits: bits per stored value, 8 or 4.
        group_size: value channels sharing one scale and zero; divides the model's value width (default: 64, or the
            whole value where its width is not a multiple of 64).
        residual_length: newest tokens whose values attention gets in full precision.
    """

    bits: int = 4
    group_size: int | None = None
    residual_length: int = DEFAULT_RESIDUAL_LENGTH

    def __post_init__(self) -> None:
        super().__post_init__()
        check_quant_options(self, ("bits",))

    def page_format(self, config: Any, dtype: torch.dtype) -> PageFormat:
        base = super().page_format(config, dtype)
        return dataclasses.replace(base, value_bits=self.bits, value_group_size=value_group_size(self.group_size, base))


def check_quant_options(options: PagedConfig, bit_names: tuple[str, ...]) -> None:
    """Checks a quantized cache's config: its bits (8 or 4), ``group_size`` and ``residual_length``, raising
    ``TypeError`` / ``ValueError`` that name the setting and the value."""
    for name in bit_names:
        bits = getattr(options, name)
        check_count(name, bits, 1)
        if bits not in (8, 4):
            raise ValueError(f"{name}={bits} is not supported: choose {name}=8 or {name}=4.")
    check_count("group_size", options.group_size, 1, optional=True)
    check_count("residual_length", options.residual_length, 0)


def group_size_for(group_size: int | None, width: int, name: str = "head_dim") -> int:
    """The scale group size of a ``cache_config``'s ``group_size`` on vectors of ``width`` channels (the model's
    ``name``; default 64, or the whole vector); ``ValueError`` naming the divisors where it does not divide."""
    group_size = group_size or (DEFAULT_GROUP_SIZE if width % DEFAULT_GROUP_SIZE == 0 else width)
    if width % group_size:
        divisors = [size for size in range(1, width + 1) if width % size == 0]
        raise ValueError(
            f"group_size={group_size} does not divide the model's {name}={width}; choose one of {divisors}."
        )
    return group_size


def value_group_size(group_size: int | None, page_format: PageFormat) -> int:
    """``group_size_for`` the values of ``page_format`` (as wide as its keys, or of their own width)."""
    name = "head_dim" if page_format.value_head_dim is None else "value width"
    return group_size_for(group_size, page_format.value_dim, name)


def residual_row_policy(
    layer_type: str, layer_kwargs: dict[str, Any], residual_length: int, exact_tokens: int = 0
) -> RowPolicy:
    """A quantized cache's rows: sliding layers keep their window, the others growing (with their first
    ``exact_tokens`` tokens in full precision); both with the residual window of ``residual_length`` tokens."""
    if layer_type == "sliding_attention":
        return RowPolicy(window=layer_kwargs["sliding_window"], is_sliding=True, residual_length=residual_length)
    return RowPolicy(residual_length=residual_length, exact_tokens=exact_tokens)


class QuantizedValueCache(PoolCache):
    """Keys in full precision, values as int8 or int4 codes with per-token scales, on the shared pool.

    Values are quantized once, when stored; attention gets them dequantized into a reused buffer, the newest
    ``residual_length`` in full precision. Sliding layers keep their window. Takes ``PoolCache``'s arguments; a pool
    given must be built with ``KVPool.for_model(model, cache_config, ...)``.
    """

    config_class = QuantizedValueConfig
    reuses_read_buffers = True

    def _row_policy(self, layer_type: str, layer_kwargs: dict[str, Any]) -> RowPolicy:
        return residual_row_policy(layer_type, layer_kwargs, self.cache_config.residual_length)


ENTRY = CacheEntry(
    name="quantized_values",
    cache_class=QuantizedValueCache,
    example_config={"bits": 4, "group_size": 16},
    eval_presets={"values-int8": {"bits": 8}, "values-int4": {"bits": 4}},
    bench_presets={"values-int8": {"bits": 8}, "values-int4": {"bits": 4}},
    # group_size: the default for the model's head_dim. The soak compares each request with itself run alone, which a
    # reused prompt does not equal (it continues the cache that wrote it: tests/test_prefix_quantized.py)
    soak_config={"bits": 4, "prefix_caching": False},
)
