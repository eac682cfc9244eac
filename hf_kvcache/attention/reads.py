"""What a layer hands attention beyond the keys and values: how to read them where they lie.

transformers passes an attention layer's kwargs to the cache (``update(..., kwargs=kwargs)``), then to the attention
function, the same dict: a layer that returns the pool's storage puts the step's plan there (``STEP_PLAN``, its
block mask and pages), a window its ``KeyLayout`` (``KEY_LAYOUT``). Where a model passes none, layers return keys
and values gathered in time order.
"""

from dataclasses import dataclass
from typing import Any

import torch

STEP_PLAN = "hf_kvcache_step_plan"
KEY_LAYOUT = "hf_kvcache_key_layout"


def attention_kwargs(update_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The attention's kwargs a cache layer's ``update`` got from transformers (``kwargs=``); ``None`` where the model
    passed none."""
    handed = update_kwargs.get("kwargs")
    return handed if isinstance(handed, dict) else None


@dataclass(frozen=True)
class KeyLayout:
    """What attention must know of the keys a window returned, beyond the model's mask (``KEY_LAYOUT``): its ``band``
    ``[batch, num_new, num_keys]``, true where a new token of a row may see a key (causality, window, the row's sinks).
    """

    band: torch.Tensor
