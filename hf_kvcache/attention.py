"""``attn_implementation="hf_kvcache"``: transformers' sdpa attention that also honours a ring's band.

A full-attention model (Llama, SmolLM2) builds a plainly causal mask. Where ``SlidingRingCache``
imposes a window on its layers, a step of several new tokens (a prompt, a prefill chunk) must
still let each of them see only its last ``window`` tokens and the sinks, as decoding does. The
ring hands its keys back with that band (``hf_kvcache.layers.ring.band_of``); this attention ANDs
it into the model's mask and is ``"sdpa"`` otherwise, with the same masks (``sdpa_mask``).

Load the model with it, or switch an existing one::

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_kvcache")
    model.set_attn_implementation("hf_kvcache")

``integration.register`` adds the name through transformers' public ``AttentionInterface`` and
``AttentionMaskInterface``; nothing about ``"sdpa"`` or ``"eager"`` changes.
"""

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_kvcache.layers.ring import band_of

ATTENTION_NAME = "hf_kvcache"


def banded_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention over ``[batch, heads, n, head_dim]`` states, within the keys' band if any.

    Args:
        attention_mask: the model's ``[batch, 1, n, num_keys]`` mask (boolean, or additive floats), or ``None``
            for plain causal attention.
        kwargs: passed on to ``sdpa_attention_forward`` (``scaling``, ``dropout``, ...).
    """
    band = band_of(key)  # [n, num_keys]: the band includes causality
    if band is not None:
        if attention_mask is None:
            attention_mask = band
        elif attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & band
        else:
            attention_mask = attention_mask.masked_fill(~band, torch.finfo(attention_mask.dtype).min)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
