"""``SlidingRingCache``: every layer is a ring of the last ``window`` tokens, with optional attention sinks."""

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from hf_kvcache.caches.base import PoolCache, RowPolicy
from hf_kvcache.config import DEFAULT_PAGE_SIZE, CacheOptions
from hf_kvcache.pool import KVPool


def _check_count(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    if value < low:
        raise ValueError(f"{name}={value} is out of range: choose {name} >= {low}.")


@dataclass(frozen=True)
class RingOptions(CacheOptions):
    """The ``cache_config`` keys of ``SlidingRingCache``.

    Attributes:
        window: tokens each query of a full-attention layer attends to, itself included; the model's
            sliding layers keep the model's own window. Required on a model without sliding layers.
        sink_tokens: first tokens of each row kept for good in the layers where the ring imposes the window.
    """

    window: int | None = None
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window is not None:
            _check_count("window", self.window, 1)
        _check_count("sink_tokens", self.sink_tokens, 0)


class SlidingRingCache(PoolCache):
    """A cache of bounded memory: each layer keeps a fixed ring of pages, reused in a circle.

    Sliding layers of the model (Mistral, Gemma 3) are rings of the model's window: outputs equal
    ``DynamicCache``'s. Full-attention layers become rings of ``window`` tokens: each generated token
    attends to the last ``window`` tokens (and the ``sink_tokens`` first ones, StreamingLLM's
    attention sinks), with memory that stops growing once the window is full. A prompt chunk longer
    than the window attends over itself in full (transformers' causal mask) before the ring keeps its end.

    Args:
        config: the model's config.
        window: ring size of full-attention layers (``None``: keep them whole, on a model with sliding layers).
        sink_tokens: first tokens pinned in those rings.
        pool / page_size / max_tokens / admission_check / dtype / device: as for ``PagedCache``.
    """

    options_class = RingOptions

    def __init__(
        self,
        config: PreTrainedConfig,
        window: int | None = None,
        sink_tokens: int = 0,
        pool: KVPool | str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        max_tokens: int | None = None,
        admission_check: bool = False,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        text_config = config.get_text_config(decoder=True)
        self._has_sliding_layers = "sliding_attention" in get_layer_types_and_kwargs(text_config)[0]
        options = RingOptions(
            page_size=page_size,
            pool=pool,
            max_tokens=max_tokens,
            admission_check=admission_check,
            window=window,
            sink_tokens=sink_tokens,
        )
        super().__init__(config, options, dtype, device)
        if sink_tokens and window is None:
            raise ValueError(
                f"sink_tokens={sink_tokens} needs a window: sinks are kept in the rings that cache_config window "
                "imposes on full-attention layers (the model's sliding layers keep the model's own window)."
            )

    def _row_policy(self, layer_type: str, layer_kwargs: dict[str, Any]) -> RowPolicy:
        if layer_type == "sliding_attention":
            return RowPolicy(window=layer_kwargs["sliding_window"], is_sliding=True)
        options = self.options
        if options.window is None:
            if not self._has_sliding_layers:
                raise ValueError(
                    "cache_config window is required: this model has no sliding layers to take a window from "
                    '(e.g. cache_config={"window": 1024}).'
                )
            return RowPolicy()
        return RowPolicy(window=options.window, sink_tokens=options.sink_tokens)
