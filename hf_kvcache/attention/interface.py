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
masks (``sdpa_mask``); a decode step of grouped KV heads, under a mask or (on CPU) without one, packs each KV
head's query heads as its query rows (``flex.packed_decode_attention``: its keys and values read once, not once per
query head, and never copied per query head as transformers' sdpa does inside a compiled graph).

The growing layers (``PagedRows.attend``) hand a decode step's keys over as the pool's storage itself, with a
``PagedRead``: this attention then runs compiled FlexAttention over the pages where they lie
(``attention.flex``), after checking that the model's mask hides exactly each row's leading padding; anything it
cannot do in place (a mask with holes, softcapping, attention sinks, training, a shape that does not compile) it
does on the same keys gathered, the slow twin. A single row on consecutive pages comes as a plain view of them
(``kernels.run_view``, no ``PagedRead``) and takes the sdpa path like any keys. Load the model with it, or switch an
existing one::

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_kvcache")
    model.set_attn_implementation("hf_kvcache")

``integration.register`` adds the name through transformers' public ``AttentionInterface`` and
``AttentionMaskInterface``; nothing about ``"sdpa"`` or ``"eager"`` changes.
"""

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from hf_kvcache.attention import flex
from hf_kvcache.attention.kernels import read_planned_view
from hf_kvcache.attention.reads import KEY_LAYOUT, PAGED_READ, PagedRead
from hf_kvcache.transformers_internals import attn_implementation, sdpa_attention_forward

ATTENTION_NAME = "hf_kvcache"
PLANNED_READS = "hf_kvcache_planned_reads"
"""The forward argument a planned decode step (``PoolCache.start_planned``) hands the step's ``StepPlan`` of each layer
that returns the pool's storage for attention to read in place (``None`` for the others) on, through the model's
``**kwargs`` (as continuous batching hands its paged cache to its attention)."""


@contextlib.contextmanager
def model_attention(model: torch.nn.Module, name: str | None) -> Iterator[torch.nn.Module]:
    """Runs ``model`` under ``attn_implementation=name`` for the block (``None``: its own), then under its own again.

    ``model.set_attn_implementation`` walks the model (about 3 ms for a 30-layer model): switch once for a
    run of forward passes, not per pass.
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
    plans = kwargs.pop(PLANNED_READS, None)
    plan = plans[module.layer_idx] if plans is not None else None
    if plan is not None:  # the keys and values are the pool's storage, read through the step's plan
        if _extras(kwargs) is None and not module.training:
            output = flex.planned_attention(query, key, value, plan.mask, plan.pages, kwargs.get("scaling"))
            return output.transpose(1, 2).contiguous(), None
        key, value = read_planned_view(key, plan), read_planned_view(value, plan)  # the model's mask applies
    read, layout = kwargs.pop(PAGED_READ, None), kwargs.pop(KEY_LAYOUT, None)  # what the layer handed over
    if read is not None:
        output = paged_attention(module, query, key, value, read, attention_mask, kwargs)
        if output is not None:
            return output, None
        key, value = read.gather()
    if layout is None:
        if _packs_decode(module, query, key, attention_mask, kwargs):
            return flex.packed_decode_attention(query, key, value, kwargs.get("scaling"), attention_mask), None
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


def _packs_decode(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict
) -> bool:
    """Whether ``flex.packed_decode_attention`` computes what transformers' sdpa would: one decode token per row,
    grouped KV heads, nothing else applied; under a mask, one for every head of the token (a compiled step's:
    transformers builds the mask of a compileable cache, and inside dynamo its sdpa repeats every key and value once
    per query head); without one on CPU only (elsewhere transformers' grouped kernel serves)."""
    extras = any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux", "sinks"))
    if query.shape[2] != 1 or query.shape[1] == key.shape[1] or extras or module.training:
        return False
    if attention_mask is None:
        return query.device.type == "cpu"
    return attention_mask.dim() == 4 and attention_mask.shape[1] == attention_mask.shape[2] == 1


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    read: PagedRead,
    attention_mask: torch.Tensor | None,
    kwargs: dict,
) -> torch.Tensor | None:
    """One decode step's attention over the pool's pages in place; ``None`` where it must gather instead.

    Args:
        query: ``[batch, heads, 1, head_dim]``.
        keys / values: one layer's storage ``[1, kv_heads, storage pages * page_size, head_dim]``.
        attention_mask: the model's ``[batch, 1, 1, num_tokens]`` mask (boolean or additive), or ``None``.

    Returns:
        ``[batch, 1, heads, head_dim]`` (transformers' attention output layout).
    """
    extra = _extras(kwargs)
    if extra is not None:
        flex.log_path(extra, f"the model's attention uses {extra}, which the in-place kernel does not apply")
        return None
    if module.training or query.shape[2] != 1:
        return None
    if not _hides_padding_only(read, attention_mask):
        flex.log_path("mask", "the model's mask hides more than each row's leading padding")
        return None
    if query.dtype != keys.dtype:
        flex.log_path("dtype", f"the query is {query.dtype} and the pool {keys.dtype} (autocast?)")
        return None
    try:
        output = flex.decode_attention(query, keys, values, read.mask, kwargs.get("scaling"))
    except flex.FlexUnavailable as error:
        limit = "MAX_SHAPE_KEYS" in error.reason  # a slowdown the user did not ask for: said louder
        flex.log_path(f"compile:{error.reason}", error.reason, logging.WARNING if limit else logging.INFO)
        return None
    flex.log_path("in_place", f"compiled FlexAttention, KV blocks of {read.mask.block_tokens} tokens")
    return output.transpose(1, 2).contiguous()


def _extras(kwargs: dict) -> str | None:
    """What the model's attention applies that in-place FlexAttention does not (``None``: nothing)."""
    return next((name for name in ("softcap", "s_aux", "position_bias", "sinks") if kwargs.get(name) is not None), None)


def _hides_padding_only(read: PagedRead, attention_mask: torch.Tensor | None) -> bool:
    """``mask_hides_padding_only`` for the read, checked once per step: the layers after the first find the verdict."""
    last = read.mask.padding_check
    if last is not None and last[0] is attention_mask and last[1] is read.pads and last[2] == read.num_tokens:
        return last[3]
    verdict = mask_hides_padding_only(attention_mask, read.pads, read.num_tokens)
    read.mask.padding_check = (attention_mask, read.pads, read.num_tokens, verdict)
    return verdict


def mask_hides_padding_only(attention_mask: torch.Tensor | None, pads: torch.Tensor, num_tokens: int) -> bool:
    """Whether the model's mask for the step's (last) query hides exactly each row's first ``pads`` tokens.

    Args:
        attention_mask: ``[batch, 1, q, kv]`` boolean (true: seen) or additive (0: seen), or ``None`` (all seen).
        pads: ``[batch]`` leading padding tokens of each row.
    """
    if attention_mask is None:
        return not bool(pads.any())
    if attention_mask.shape[-1] != num_tokens:
        return False
    last = attention_mask[:, 0, -1, :]  # [batch or 1, num_tokens]
    seen = last if last.dtype == torch.bool else last == 0
    expected = torch.arange(num_tokens, device=seen.device) >= pads.to(seen.device).view(-1, 1)  # [batch, tokens]
    return bool(torch.equal(seen.expand_as(expected), expected))
