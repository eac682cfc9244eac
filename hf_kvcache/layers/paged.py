"""The layers: a model layer's keys and values in pool pages, every token (``PagedLayer``, growing a page at a time)
or the last ``window`` (``WindowLayer``)."""

from collections.abc import Callable

import torch
from transformers import CacheLayerMixin

from hf_kvcache.attention.reads import attention_kwargs
from hf_kvcache.layers.rows import PagedRows
from hf_kvcache.layers.window import visible_span


class PagedLayer(CacheLayerMixin):
    """One model layer's KV store on the pool; keeps every token. Row bookkeeping lives in its layer group's
    ``PagedRows``; the layer only counts its tokens.

    Args:
        layer_idx: the model layer.
        layer_in_group: the layer's index within its layer group.
        bind: returns the layer group's ``PagedRows`` for the device and dtype of the first states written.
    """

    is_sliding = False
    is_croppable = True
    is_compileable = True  # a decode step planned before the forward pass is tensor operations only

    def __init__(self, layer_idx: int, layer_in_group: int, bind: Callable[[torch.Tensor], PagedRows]) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_in_group = layer_in_group
        self.num_tokens = 0
        self.planned = False  # the next update is the step PoolCache.plan_decode planned (its rows' step_plan)
        self.rows: PagedRows | None = None
        self._bind = bind
        # The keys live in the pool: models that ask a layer whether it holds keys (Mllama asks every layer whether
        # it holds an image's) see none, where transformers' mixin leaves None.
        self.keys = self.values = torch.empty(0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer_idx={self.layer_idx}, num_tokens={self.num_tokens})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.rows = self._bind(key_states)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores ``[batch, heads, n, head_dim]`` new states and returns what attention reads (``PagedRows.read``), as
        the step's plan says (planned before the forward pass, else by the layer group's first layer)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        handoff = attention_kwargs(kwargs)
        if self.planned:  # planned (PoolCache.plan_decode), once: the step's count is already in
            self.planned = False
            plan = self.rows.step_plan
        else:
            plan = self.rows.plan_step(
                self.layer_in_group, self.num_tokens, key_states, value_states, handoff is not None
            )
            self.num_tokens += key_states.shape[-2]
        self.rows.write(plan, self.layer_in_group, key_states, value_states)
        return self.rows.read(plan, self.layer_in_group, key_states, value_states, handoff)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        plan = self.rows.step_plan if self.planned else None
        if plan is not None:  # a compiled step reads its plan's keys (their number: a constant of its graph)
            return plan.num_keys, plan.kv_offset
        return self.num_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.num_tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        self.num_tokens = max(0, self.num_tokens + tokens_to_remove)

    # Row changes are done once per layer group and device by the cache, on the shared rows.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        pass


class WindowLayer(PagedLayer):
    """One model layer's KV store over the last ``window`` tokens (plus ``sink_tokens``), in ``WindowRows``.

    Args:
        layer_idx / layer_in_group / bind: as for ``PagedLayer`` (``bind`` returns ``WindowRows``).
        window / sink_tokens / is_sliding: as for ``WindowRows``.
    """

    def __init__(
        self,
        layer_idx: int,
        layer_in_group: int,
        bind: Callable[[torch.Tensor], PagedRows],
        window: int,
        sink_tokens: int = 0,
        is_sliding: bool = True,
    ) -> None:
        super().__init__(layer_idx, layer_in_group, bind)
        self.window, self.sink_tokens, self.is_sliding = window, sink_tokens, is_sliding

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layer_idx={self.layer_idx}, window={self.window}, "
            f"sink_tokens={self.sink_tokens}, num_tokens={self.num_tokens})"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of what ``update`` returns; sinks are placed just before the window."""
        if self.planned:
            return super().get_mask_sizes(query_length)
        sinks, first = visible_span(self.num_tokens, query_length, self.window, self.sink_tokens)
        return sinks + self.num_tokens + query_length - first, first - sinks

    def get_max_length(self) -> int:
        return self.window + self.sink_tokens
