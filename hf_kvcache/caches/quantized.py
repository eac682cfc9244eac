"""``QuantizedValueCache``: keys in the model's dtype, values stored as int8/int4 codes on the shared pool."""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedConfig

from hf_kvcache.caches.base import PoolCache
from hf_kvcache.caches.entry import CacheEntry
from hf_kvcache.caches.options import CacheOptions
from hf_kvcache.caches.policy import RowPolicy
from hf_kvcache.errors import IncompatibleModelError
from hf_kvcache.memory.format import DEFAULT_PAGE_SIZE, PageFormat
from hf_kvcache.memory.placement import Placement
from hf_kvcache.memory.pool import KVPool

DEFAULT_GROUP_SIZE = 64
DEFAULT_RESIDUAL_LENGTH = 128
"""The most recent tokens whose values each row and layer keeps in full precision, outside the pool; what the
window buys in accuracy is in docs/caches.md."""


@dataclass(frozen=True)
class QuantizedValueOptions(CacheOptions):
    """The ``cache_config`` keys of ``QuantizedValueCache``.

    Attributes:
        bits: bits per stored value, 8 or 4.
        group_size: value channels sharing one scale and zero; divides the model's head_dim (default: 64,
            or the whole head where head_dim is not a multiple of 64).
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
        group_size = group_size_for(self.group_size, base.head_dim)
        return dataclasses.replace(base, value_bits=self.bits, value_group_size=group_size)


def check_quant_options(options: CacheOptions, bit_names: tuple[str, ...]) -> None:
    """Checks a quantized cache's ``cache_config``: its bits (8 or 4), ``group_size`` and ``residual_length``.

    Raises:
        TypeError / ValueError: naming the key and the value.
    """
    for name in (*bit_names, "group_size", "residual_length"):
        value = getattr(options, name)
        if name == "group_size" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    for name in bit_names:
        bits = getattr(options, name)
        if bits not in (8, 4):
            raise ValueError(f"{name}={bits} is not supported: choose {name}=8 or {name}=4.")
    if options.group_size is not None and options.group_size < 1:
        raise ValueError(f"group_size={options.group_size} is out of range: choose a divisor of the head_dim.")
    if options.residual_length < 0:
        raise ValueError(f"residual_length={options.residual_length} is out of range: choose residual_length >= 0.")


def group_size_for(group_size: int | None, head_dim: int) -> int:
    """The scale group size of a ``cache_config``'s ``group_size`` on a model's head_dim (default: 64, or the head).

    Raises:
        ValueError: ``group_size`` does not divide the head_dim (naming the ones that do).
    """
    group_size = group_size or (DEFAULT_GROUP_SIZE if head_dim % DEFAULT_GROUP_SIZE == 0 else head_dim)
    if head_dim % group_size:
        divisors = [size for size in range(1, head_dim + 1) if head_dim % size == 0]
        raise ValueError(
            f"group_size={group_size} does not divide the model's head_dim={head_dim}; choose one of {divisors}."
        )
    return group_size


def refuse_kv_reuse(config: PreTrainedConfig, cache_name: str) -> None:
    """Raises ``IncompatibleModelError`` for a model whose layers reuse an earlier layer's keys and values: a reusing
    layer reads what that layer's update returned, which a quantized cache keeps in buffers the next layer
    overwrites."""
    text_config = config.get_text_config(decoder=True)
    if "reuse" in (getattr(text_config, "kv_sharing_modes", None) or ()):
        raise IncompatibleModelError(
            f"{type(text_config).__name__} shares KV between layers (kv_sharing_modes has 'reuse'); "
            f"{cache_name} does not support it yet. Use paged_pool or sliding_ring for this model."
        )


def residual_row_policy(
    layer_type: str, layer_kwargs: dict[str, Any], residual_length: int, exact_tokens: int = 0
) -> RowPolicy:
    """A quantized cache's rows: sliding layers as rings of their window, the others growing (with their first
    ``exact_tokens`` tokens in full precision); both with the residual window of ``residual_length`` tokens."""
    if layer_type == "sliding_attention":
        return RowPolicy(window=layer_kwargs["sliding_window"], is_sliding=True, residual_length=residual_length)
    return RowPolicy(residual_length=residual_length, exact_tokens=exact_tokens)


class QuantizedValueCache(PoolCache):
    """Keys in full precision, values as int8 or int4 codes with per-token scales, on the shared pool.

    Each token's values are quantized once, when stored; attention gets them dequantized into a reused
    buffer, the newest ``residual_length`` in full precision. Sliding layers of hybrid models keep ring
    semantics (their memory stays bounded by the window) with quantized values too.

    Args:
        config: the model's config.
        bits: 8 or 4 bits per stored value.
        group_size: value channels sharing one scale and zero (asymmetric, per token); default 64.
        residual_length: newest tokens whose values attention gets in full precision.
        pool / page_size / max_tokens / admission_check / prefix_caching / prefix_namespace / dtype / device /
            placement: as for
            ``PagedCache`` (a given pool must be built with ``KVPool.for_model(..., value_bits=bits,
            value_group_size=group_size)``).
    """

    options_class = QuantizedValueOptions

    def __init__(
        self,
        config: PreTrainedConfig,
        bits: int = 4,
        group_size: int | None = None,
        residual_length: int = DEFAULT_RESIDUAL_LENGTH,
        pool: KVPool | str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        max_tokens: int | None = None,
        admission_check: bool | None = None,
        prefix_caching: bool | None = None,
        prefix_namespace: str = "",
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        placement: Placement | None = None,
    ) -> None:
        options = QuantizedValueOptions(
            page_size=page_size,
            pool=pool,
            max_tokens=max_tokens,
            admission_check=admission_check,
            prefix_caching=prefix_caching,
            prefix_namespace=prefix_namespace,
            bits=bits,
            group_size=group_size,
            residual_length=residual_length,
        )
        refuse_kv_reuse(config, "quantized_values")
        super().__init__(config, options, dtype, device, placement)

    def _row_policy(self, layer_type: str, layer_kwargs: dict[str, Any]) -> RowPolicy:
        return residual_row_policy(layer_type, layer_kwargs, self.options.residual_length)


ENTRY = CacheEntry(
    name="quantized_values",
    cache_class=QuantizedValueCache,
    example_config={"bits": 4, "group_size": 16},
    eval_presets={"values-int8": {"bits": 8}, "values-int4": {"bits": 4}},
    bench_presets={"values-int8": {"bits": 8}, "values-int4": {"bits": 4}},
    soak_config={"bits": 4},  # group_size: the default for the model's head_dim
)
