"""``QuantizedKVCache``: keys and values both stored as codes on the shared pool (key pages encoded once, when they
fill: ``hf_kvcache.layers.keys``); bytes per token in docs/caches.md."""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvcache.caches.base import PoolCache
from hf_kvcache.caches.config import PagedConfig, check_count
from hf_kvcache.caches.entry import CacheEntry
from hf_kvcache.caches.policy import RowPolicy
from hf_kvcache.caches.quantized import (
    DEFAULT_RESIDUAL_LENGTH,
    check_quant_options,
    group_size_for,
    residual_row_policy,
    value_group_size,
)
from hf_kvcache.memory.format import PageFormat


def scale_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Scales in 2 bytes: the model's dtype where it has 2 bytes, else float16 (inputs up to 32,752 in magnitude
    keep ``hf_kvcache.memory.quant``'s error bound)."""
    return dtype if dtype.itemsize == 2 else torch.float16


@dataclass(frozen=True)
class QuantizedKVConfig(PagedConfig):
    """The settings of ``QuantizedKVCache``: ``PagedConfig``'s and these.

    Attributes:
        key_bits: 8 (per token, per scale group of ``group_size`` channels) or 4 (per channel over each page's tokens).
        value_bits: 8 or 4, per token and scale group.
        group_size: channels sharing one scale and zero (values, and int8 keys); divides the model's head_dim and
            value width (default: 64, or the whole vector).
        residual_length: newest tokens whose values attention gets in full precision (the keys of a page still
            filling are always exact).
        sink_tokens: first tokens of a row whose keys and values attention gets in full precision (attention
            sinks), held outside the pool beside their codes; full-attention layers only.
    """

    key_bits: int = 4
    value_bits: int = 4
    group_size: int | None = None
    residual_length: int = DEFAULT_RESIDUAL_LENGTH
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_quant_options(self, ("key_bits", "value_bits"))
        check_count("sink_tokens", self.sink_tokens, 0)
        if self.key_bits == 4 and self.page_size % 2:
            raise ValueError(
                f"page_size={self.page_size} is odd: key_bits=4 packs two tokens per byte; choose an even page_size."
            )

    def page_format(self, config: Any, dtype: torch.dtype) -> PageFormat:
        base = super().page_format(config, dtype)
        return dataclasses.replace(
            base,
            value_bits=self.value_bits,
            value_group_size=value_group_size(self.group_size, base),
            key_bits=self.key_bits,
            key_group_size=group_size_for(self.group_size, base.head_dim),
            scale_dtype=scale_dtype_for(dtype),
        )


class QuantizedKVCache(PoolCache):
    """Keys and values as codes on the shared pool: int8 per-token or int4 per-channel keys, int8/int4 values.

    A row's page still filling keeps its keys in full precision outside the pool until it fills, then they are
    encoded once; values are quantized per token when stored, the newest ``residual_length`` served in full
    precision. Attention gets keys and values decoded into reused buffers (never read in place). Takes
    ``PoolCache``'s arguments; a pool given must be built with ``KVPool.for_model(model, cache_config, ...)``.
    """

    config_class = QuantizedKVConfig
    reuses_read_buffers = True

    def _row_policy(self, layer_type: str, layer_kwargs: dict[str, Any]) -> RowPolicy:
        return residual_row_policy(
            layer_type, layer_kwargs, self.cache_config.residual_length, self.cache_config.sink_tokens
        )


ENTRY = CacheEntry(
    name="quantized_kv",
    cache_class=QuantizedKVCache,
    example_config={"key_bits": 4, "value_bits": 4, "group_size": 16},
    eval_presets={"kv-k8v4": {"key_bits": 8, "value_bits": 4}, "kv-k4v4": {"key_bits": 4, "value_bits": 4}},
    bench_presets={"kv-k8v4": {"key_bits": 8, "value_bits": 4}, "kv-k4v4": {"key_bits": 4, "value_bits": 4}},
    # group_size: the default for the model's head_dim; no prompt reuse, as for quantized_values
    soak_config={"key_bits": 4, "value_bits": 4, "prefix_caching": False},
)
