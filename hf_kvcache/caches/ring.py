"""``SlidingRingCache``: every layer keeps the last ``window`` tokens, with optional attention sinks."""

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedConfig

from hf_kvcache.attention.interface import ATTENTION_NAME
from hf_kvcache.attention.reads import attention_kwargs
from hf_kvcache.caches.base import PoolCache
from hf_kvcache.caches.config import PagedConfig, check_count
from hf_kvcache.caches.entry import CacheEntry
from hf_kvcache.caches.policy import RowPolicy
from hf_kvcache.layers import WindowLayer
from hf_kvcache.memory.placement import Placement
from hf_kvcache.transformers_internals import attn_implementation, layer_types_and_kwargs


@dataclass(frozen=True)
class SlidingRingConfig(PagedConfig):
    """The settings of ``SlidingRingCache``: ``PagedConfig``'s and these.

    Attributes:
        window: tokens each query of a full-attention layer attends to, itself included (the model's sliding layers
            keep their own); required on a model without sliding layers.
        sink_tokens: first tokens of each row kept for good where the cache imposes the window.
    """

    window: int | None = None
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("window", self.window, 1, optional=True)
        check_count("sink_tokens", self.sink_tokens, 0)
        if self.sink_tokens and self.window is None:
            raise ValueError(
                f"sink_tokens={self.sink_tokens} needs a window: sinks are kept in the windows that cache_config "
                "window imposes on full-attention layers (the model's sliding layers keep the model's own window)."
            )


class SlidingRingCache(PoolCache):
    """A cache of bounded memory: each layer keeps the pages of its last ``window`` tokens and gives back the rest.

    The model's sliding layers keep the model's window (outputs equal ``DynamicCache``'s); full-attention layers keep
    ``window`` tokens and the ``sink_tokens`` first ones (StreamingLLM's attention sinks). Within a step that reaches
    past the window, only ``attn_implementation="hf_kvcache"`` keeps to that band (the model's own mask is plainly
    causal there); with another attention the cache warns, once. Takes ``PoolCache``'s arguments.
    """

    config_class = SlidingRingConfig
    _warned_unbanded = False

    def __init__(
        self,
        config: PreTrainedConfig,
        cache_config: SlidingRingConfig | dict[str, Any] | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        placement: Placement | None = None,
    ) -> None:
        text_config = config.get_text_config(decoder=True)
        self._has_sliding_layers = "sliding_attention" in layer_types_and_kwargs(text_config)[0]
        super().__init__(config, cache_config, dtype=dtype, device=device, placement=placement)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[-2] > 1 and not self._warned_unbanded:
            handed = attention_kwargs(kwargs) is not None
            self._warn_if_unbanded(self.layers[layer_idx], key_states.shape[-2], handed)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _warn_if_unbanded(self, layer: Any, num_new: int, handed: bool) -> None:
        """Warns (once) when a step reaches past an imposed window and the model's attention ignores the band, or
        hands the cache no kwargs to put it in."""
        attention = attn_implementation(self._binder.config)  # None: no model set it
        if (
            not isinstance(layer, WindowLayer)
            or layer.is_sliding
            or layer.num_tokens + num_new <= layer.window
            or attention is None
            or (attention == ATTENTION_NAME and handed)
        ):
            return
        self._warned_unbanded = True
        if attention == ATTENTION_NAME:
            why = (
                "the model's attention hands the cache no kwargs (cache.update(..., kwargs=kwargs), as transformers' "
                "own models do) to put the band in: within this step each token sees all earlier ones, not just its "
                "window. Feed such steps one token at a time for the exact window."
            )
        else:
            why = (
                f"the model's {attention!r} attention applies a plainly causal mask: within this step each token "
                "sees all earlier ones, not just its window. Load the model with "
                f'attn_implementation="{ATTENTION_NAME}" (or call model.set_attn_implementation("{ATTENTION_NAME}")) '
                "for the exact band."
            )
        warnings.warn(
            f"A step of {num_new} tokens reaches past the cache's window={layer.window}, but {why}", stacklevel=3
        )

    def _row_policy(self, layer_type: str, layer_kwargs: dict[str, Any]) -> RowPolicy:
        if layer_type == "sliding_attention":
            return RowPolicy(window=layer_kwargs["sliding_window"], is_sliding=True)
        options = self.cache_config
        if options.window is None:
            if not self._has_sliding_layers:
                raise ValueError(
                    "cache_config window is required: this model has no sliding layers to take a window from "
                    '(e.g. cache_config={"window": 1024}).'
                )
            return RowPolicy()
        return RowPolicy(window=options.window, sink_tokens=options.sink_tokens)


ENTRY = CacheEntry(
    name="sliding_ring",
    cache_class=SlidingRingCache,
    example_config={"window": 16, "sink_tokens": 2},
    eval_presets={"ring-256": {"window": 256}, "ring-256-sink4": {"window": 256, "sink_tokens": 4}},
    attn_implementation=ATTENTION_NAME,  # prompts past the window keep to it; the pages are read in place
)
