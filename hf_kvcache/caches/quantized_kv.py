"""``QuantizedKVCache``: keys and values both stored as codes on the shared pool.

Keys are encoded a page at a time, once, when the page fills (``hf_kvcache.layers.keys``): int8 per token, or int4
per channel over the page's tokens (keys have outlier channels: KIVI); values as in ``quantized_values``. Scales
are stored in 2 bytes (float16 for a float32 model), the int4 keys' zeros as int8 (bytes per token: docs/caches.md).
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedConfig

from hf_kvcache.caches.base import PoolCache
from hf_kvcache.caches.entry import CacheEntry
from hf_kvcache.caches.options import CacheOptions
from hf_kvcache.caches.policy import RowPolicy
from hf_kvcache.caches.quantized import (
    DEFAULT_RESIDUAL_LENGTH,
    check_quant_options,
    group_size_for,
    refuse_kv_reuse,
    residual_row_policy,
)
from hf_kvcache.memory.format import DEFAULT_PAGE_SIZE, PageFormat
from hf_kvcache.memory.placement import Placement
from hf_kvcache.memory.pool import KVPool

DEFAULT_SINK_TOKENS = 0
"""First tokens of a row kept in full precision by default."""


def scale_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Scales in 2 bytes: the model's dtype where it has 2 bytes, else float16 (inputs up to 32,752 in magnitude keep
    the error bound of ``hf_kvcache.memory.quant``; larger ones stay finite)."""
    return dtype if dtype.itemsize == 2 else torch.float16


@dataclass(frozen=True)
class QuantizedKVOptions(CacheOptions):
    """The ``cache_config`` keys of ``QuantizedKVCache``.

    Attributes:
        key_bits: 8 (per token, per scale group of ``group_size`` channels) or 4 (per channel over each page's tokens).
        value_bits: 8 or 4, per token and scale group.
        group_size: channels sharing one scale and zero (values, and int8 keys); divides the model's head_dim
            (default: 64, or the whole head where head_dim is not a multiple of 64).
        residual_length: newest tokens whose values attention gets in full precision (the keys of a row's page
            still filling are always exact).
        sink_tokens: first tokens of a row whose keys and values attention gets in full precision (attention sinks,
            IntactKV), held outside the pool next to their codes; full-attention layers (a ring's first tokens leave
            it).
    """

    key_bits: int = 4
    value_bits: int = 4
    group_size: int | None = None
    residual_length: int = DEFAULT_RESIDUAL_LENGTH
    sink_tokens: int = DEFAULT_SINK_TOKENS

    def __post_init__(self) -> None:
        super().__post_init__()
        check_quant_options(self, ("key_bits", "value_bits"))
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int):
            raise TypeError(
                f"sink_tokens must be an int, got {self.sink_tokens!r} ({type(self.sink_tokens).__name__})."
            )
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens={self.sink_tokens} is out of range: choose sink_tokens >= 0.")
        if self.key_bits == 4 and self.page_size % 2:
            raise ValueError(
                f"page_size={self.page_size} is odd: key_bits=4 packs two tokens per byte; choose an even page_size."
            )

    def page_format(self, config: Any, dtype: torch.dtype) -> PageFormat:
        base = super().page_format(config, dtype)
        group_size = group_size_for(self.group_size, base.head_dim)
        return dataclasses.replace(
            base,
            value_bits=self.value_bits,
            value_group_size=group_size,
            key_bits=self.key_bits,
            key_group_size=group_size,
            scale_dtype=scale_dtype_for(dtype),
        )


class QuantizedKVCache(PoolCache):
    """Keys and values as codes on the shared pool: int8 per-token or int4 per-channel keys, int8/int4 values.

    A row's page still filling keeps its keys in full precision (outside the pool, counted in ``memory_stats()``)
    until it fills, then its keys are encoded once; values are quantized per token when stored, the newest
    ``residual_length`` served in full precision. Sliding layers of hybrid models stay rings (of encoded pages
    too). Attention gets keys and values decoded into reused buffers (never read in place).

    Args:
        config: the model's config.
        key_bits: 8 (per token) or 4 (per channel over each page).
        value_bits: 8 or 4 bits per stored value.
        group_size: channels sharing one scale and zero (values, and int8 keys); default 64 or the head_dim.
        residual_length: newest tokens whose values attention gets in full precision.
        sink_tokens: first tokens of a row whose keys and values attention gets in full precision.
        pool / page_size / max_tokens / admission_check / prefix_caching / prefix_namespace / dtype / device /
            placement: as for ``PagedCache`` (a given pool must be built with
            ``KVPool.for_model(..., **REGISTRY["quantized_kv"].pool_kwargs(model.config, model.dtype, cache_config))``).
    """

    options_class = QuantizedKVOptions

    def __init__(
        self,
        config: PreTrainedConfig,
        key_bits: int = 4,
        value_bits: int = 4,
        group_size: int | None = None,
        residual_length: int = DEFAULT_RESIDUAL_LENGTH,
        sink_tokens: int = DEFAULT_SINK_TOKENS,
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
        options = QuantizedKVOptions(
            page_size=page_size,
            pool=pool,
            max_tokens=max_tokens,
            admission_check=admission_check,
            prefix_caching=prefix_caching,
            prefix_namespace=prefix_namespace,
            group_size=group_size,
            residual_length=residual_length,
            sink_tokens=sink_tokens,
            key_bits=key_bits,
            value_bits=value_bits,
        )
        refuse_kv_reuse(config, "quantized_kv")
        super().__init__(config, options, dtype, device, placement)

    def _row_policy(self, layer_type: str, layer_kwargs: dict[str, Any]) -> RowPolicy:
        return residual_row_policy(layer_type, layer_kwargs, self.options.residual_length, self.options.sink_tokens)


ENTRY = CacheEntry(
    name="quantized_kv",
    cache_class=QuantizedKVCache,
    example_config={"key_bits": 4, "value_bits": 4, "group_size": 16},
    eval_presets={"kv-k8v4": {"key_bits": 8, "value_bits": 4}, "kv-k4v4": {"key_bits": 4, "value_bits": 4}},
    bench_presets={"kv-k8v4": {"key_bits": 8, "value_bits": 4}, "kv-k4v4": {"key_bits": 4, "value_bits": 4}},
    soak_config={"key_bits": 4, "value_bits": 4},  # group_size: the default for the model's head_dim
)
