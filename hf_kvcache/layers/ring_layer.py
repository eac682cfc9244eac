"""The sliding ring's layer: a model layer's keys and values in its layer group's ``RingRows`` (``ring.py``), which
keep the last ``window`` tokens per row (plus ``sink_tokens``) in a fixed set of pages."""

from collections.abc import Callable

import torch

from hf_kvcache.attention.reads import attention_kwargs
from hf_kvcache.layers.paged import PagedLayer
from hf_kvcache.layers.ring import RingRows
from hf_kvcache.layers.window import visible_span


class RingLayer(PagedLayer):
    """One model layer's KV store as a ring of the last ``window`` tokens (plus ``sink_tokens`` pinned).

    Args:
        layer_idx / layer_in_group: as for ``PagedLayer``.
        bind: returns the ``RingRows`` of the layer's layer group for the device and dtype of the first states written.
        window / sink_tokens: as for ``RingRows``.
        is_sliding: the model's own mask applies this window (a sliding layer); ``False`` where the
            ring imposes the window on a full-attention layer.
    """

    def __init__(
        self,
        layer_idx: int,
        layer_in_group: int,
        bind: Callable[[torch.Tensor], RingRows],
        window: int,
        sink_tokens: int = 0,
        is_sliding: bool = True,
    ) -> None:
        super().__init__(layer_idx, layer_in_group, bind)
        self.window = window
        self.sink_tokens = sink_tokens
        self.is_sliding = is_sliding

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layer_idx={self.layer_idx}, window={self.window}, "
            f"sink_tokens={self.sink_tokens}, num_tokens={self.num_tokens})"
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores ``[batch, heads, n, head_dim]`` new states; returns the visible ones in time order."""
        if self.planned:  # a planned step reads its visible tokens as PagedLayer reads a plan
            return super().update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        handoff = attention_kwargs(kwargs)
        keys, values = self.rows.update(self.layer_in_group, self.num_tokens, key_states, value_states, handoff)
        self.num_tokens += key_states.shape[-2]
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of what ``update`` returns; sinks are placed just before the window."""
        if self.planned:
            return super().get_mask_sizes(query_length)
        sinks, first = visible_span(self.num_tokens, query_length, self.window, self.sink_tokens)
        return sinks + self.num_tokens + query_length - first, first - sinks

    def get_max_length(self) -> int:
        return self.window + self.sink_tokens
