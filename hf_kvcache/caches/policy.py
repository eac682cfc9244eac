"""Which tokens a layer group keeps (``RowPolicy``), and the rows that keep them."""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedConfig

from hf_kvcache.attention.interface import ATTENTION_NAME, hands_states_to_attention_only
from hf_kvcache.layers import PagedRows, WindowRows
from hf_kvcache.layers.window import window_pages_per_row
from hf_kvcache.memory.page_pool import PagePool
from hf_kvcache.transformers_internals import attn_implementation


@dataclass(frozen=True)
class RowPolicy:
    """Which tokens a layer group keeps: all of them (``window=None``), or a window of the last ``window``.

    Attributes:
        window: tokens each query attends to, itself included; ``None`` keeps every token.
        sink_tokens: first real tokens of a row a window keeps for good.
        is_sliding: the model's own mask applies the window (a sliding layer of the model).
        residual_length / exact_tokens: newest tokens whose values, first tokens whose keys and values stay in full
            precision beside their codes (quantized pools; exact tokens in growing rows only).
    """

    window: int | None = None
    sink_tokens: int = 0
    is_sliding: bool = False
    residual_length: int = 0
    exact_tokens: int = 0

    def max_pages_per_row(self, num_tokens: int, page_size: int) -> int:
        """Most pages one row holds with ``num_tokens`` tokens: all of them, or at most a window's worth."""
        pages = math.ceil(num_tokens / page_size)
        if self.window is not None:
            pages = min(pages, window_pages_per_row(self.window, self.sink_tokens, page_size))
        return pages

    def make_rows(self, pool: PagePool, our_attention: Callable[[], bool], process_group: Any) -> PagedRows:
        """The rows of a layer group on ``pool`` (a ``KVPool``'s ``pages``); ``our_attention``: whether the model's
        attention reads a ``KeyLayout`` and a ``StepPlan``; ``process_group``: a tensor-parallel model's ranks'."""
        if self.window is None:
            return PagedRows(
                pool,
                self.residual_length,
                our_attention=our_attention,
                process_group=process_group,
                exact_tokens=self.exact_tokens,
            )
        return WindowRows(
            pool, self.window, self.sink_tokens, self.residual_length, our_attention, process_group, self.is_sliding
        )


def uses_our_attention(config: PreTrainedConfig) -> bool:
    """Whether the model attends with ``attn_implementation="hf_kvcache"``, which reads a window's ``KeyLayout`` (and a
    ``StepPlan``), and its attention modules hand the keys and values they get to that attention alone."""
    return attn_implementation(config) == ATTENTION_NAME and hands_states_to_attention_only(config)
