"""``attn_implementation="hf_kvcache"``: transformers' sdpa attention that also reads a ring's ``KeyLayout``.

A full-attention model (Llama, SmolLM2) builds a plainly causal mask, for keys in time order. The
ring layers of our caches (``hf_kvcache.layers.ring``) hand their keys back with a ``KeyLayout``
where that is not enough:

- where ``SlidingRingCache`` imposes a window, a step of several new tokens (a prompt, a prefill
  chunk) must still let each see only its last ``window`` tokens and the sinks: the layout's band;
- with this attention the ring hands over its pages in place, in slot order, without gathering
  them: the layout's ``mask_columns`` put the model's mask (padding, its own sliding window) in
  that order, and its band says which slots hold a token the step may see.

This attention ANDs the layout into the model's mask and is ``"sdpa"`` otherwise, with the same
masks (``sdpa_mask``). Load the model with it, or switch an existing one::

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_kvcache")
    model.set_attn_implementation("hf_kvcache")

``integration.register`` adds the name through transformers' public ``AttentionInterface`` and
``AttentionMaskInterface``; nothing about ``"sdpa"`` or ``"eager"`` changes.
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from hf_kvcache.layers.ring import layout_of
from hf_kvcache.transformers_internals import attn_implementation, sdpa_attention_forward

ATTENTION_NAME = "hf_kvcache"


@contextlib.contextmanager
def model_attention(model: torch.nn.Module, name: str | None) -> Iterator[torch.nn.Module]:
    """Runs ``model`` under ``attn_implementation=name`` for the block (``None``: its own), then under its own again.

    ``model.set_attn_implementation`` walks the model (about 3 ms for a 30-layer model): switch per group of
    forward passes, not per pass.
    """
    own = attn_implementation(model.config)
    if name is None or name == own:
        yield model
        return
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(own)


def banded_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention over ``[batch, heads, n, head_dim]`` states, within the keys' layout if any.

    Args:
        attention_mask: the model's ``[batch, 1, n, num_visible]`` mask (boolean, or additive floats), or
            ``None`` for plain causal attention.
        kwargs: passed on to ``sdpa_attention_forward`` (``scaling``, ``dropout``, ...).
    """
    layout = layout_of(key)
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    allowed = layout.band.unsqueeze(1)  # [batch, 1, n, num_keys]: includes causality
    if attention_mask is None:
        attention_mask = allowed
    else:
        if layout.mask_columns is not None:  # keys in slot order: the model's mask follows them, row by row
            columns = layout.mask_columns[:, None, None, :]  # [batch, 1, 1, num_keys]
            attention_mask = attention_mask.expand(columns.shape[0], -1, allowed.shape[2], -1)
            attention_mask = attention_mask.gather(
                -1, columns.expand(-1, attention_mask.shape[1], allowed.shape[2], -1)
            )
        if attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & allowed
        else:
            attention_mask = attention_mask.masked_fill(~allowed, torch.finfo(attention_mask.dtype).min)
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None or module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    grouped = query.shape[1] != key.shape[1]
    if grouped and query.device.type != "cpu":
        # CUDA's fused kernels do not take a mask together with enable_gqa (torch falls back to the math kernel):
        # repeat the KV heads instead, as transformers' own sdpa does. On CPU torch's grouped path is the fastest.
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        grouped = False
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"), enable_gqa=grouped
    )  # [batch, heads, n, head_dim]
    return output.transpose(1, 2).contiguous(), None
