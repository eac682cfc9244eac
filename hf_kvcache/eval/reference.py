"""The key and value encodings of ``quantized_kv`` as plain fake quantization: the math, without storage.

``FakeQuantKVCache`` is a ``DynamicCache`` whose attention sees what ``quantized_kv`` promises, computed in float32
with exact minima and scales (``range / max_code``, nothing rounded to a stored precision): keys of every full page
(``page_size`` tokens from token 0) through per-channel int4 codes over the page (or int8 per token and group of
``group_size`` channels), the page still filling exact; values through per-token codes per group of ``group_size``
channels but the newest ``residual_length`` tokens; a step of several tokens (a prefill, a chunk) sees its own keys
and values exact. Comparing the cache with it (``scripts/measure_key_fidelity.py``)
separates what the scheme costs from what its implementation costs.
"""

import torch
from transformers import DynamicCache, PreTrainedConfig


def fake_quantize(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``x [..., n]`` through asymmetric ``bits``-bit codes per group of ``group_size`` consecutive entries of the last
    dim, in float32: ``code = round((x - min) / scale)``, ``scale = (max - min) / (2 ** bits - 1)``; back in
    ``x.dtype``."""
    groups = x.float().unflatten(-1, (-1, group_size))  # [..., n // group_size, group_size]
    low, high = groups.aminmax(dim=-1, keepdim=True)
    scale = (high - low) / ((1 << bits) - 1)
    codes = ((groups - low) / torch.where(scale > 0, scale, 1)).round()
    return (codes * scale + low).flatten(-2).to(x.dtype)


class FakeQuantKVCache(DynamicCache):
    """A ``DynamicCache`` whose attention sees keys and values through ``fake_quantize`` the way ``quantized_kv``
    stores them (see the module docstring); the exact states are kept, the encoded ones computed once.

    Args:
        config: the model's config.
        key_bits: 4 (per channel over each page's tokens) or 8 (per token and group of ``group_size`` channels).
        value_bits: 4 or 8 (per token and group).
        group_size: channels sharing a scale (values, and int8 keys).
        page_size: tokens of a key page.
        residual_length: newest tokens whose values attention gets exact.
        sink_tokens: first tokens whose keys and values attention gets exact (attention sinks).
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        key_bits: int = 4,
        value_bits: int = 4,
        group_size: int = 64,
        page_size: int = 16,
        residual_length: int = 0,
        sink_tokens: int = 0,
    ) -> None:
        super().__init__(config=config)
        self.key_bits, self.value_bits, self.group_size = key_bits, value_bits, group_size
        self.page_size, self.residual_length, self.sink_tokens = page_size, residual_length, sink_tokens
        self.coded_keys: dict[int, torch.Tensor] = {}  # layer_idx -> [batch, heads, full pages' tokens, head_dim]
        self.coded_values: dict[int, torch.Tensor] = {}  # layer_idx -> [batch, heads, tokens, head_dim]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        coded_values = fake_quantize(value_states, self.value_bits, self.group_size)
        if layer_idx in self.coded_values:
            coded_values = torch.cat([self.coded_values[layer_idx], coded_values], dim=2)
        self.coded_values[layer_idx] = coded_values
        done = self.coded_keys.get(layer_idx, keys[:, :, :0])
        full = keys.shape[2] // self.page_size * self.page_size
        if full > done.shape[2]:
            pages = keys[:, :, done.shape[2] : full].unflatten(2, (-1, self.page_size))  # [b, h, m, page_size, d]
            if self.key_bits == 4:
                pages = fake_quantize(pages.transpose(-1, -2), 4, self.page_size).transpose(-1, -2)
            else:
                pages = fake_quantize(pages, self.key_bits, self.group_size)
            done = self.coded_keys[layer_idx] = torch.cat([done, pages.flatten(2, 3)], dim=2)
        attended_keys = torch.cat([done, keys[:, :, done.shape[2] :]], dim=2)
        attended_values = coded_values.clone()
        keep = min(self.residual_length, values.shape[2])
        if keep:
            attended_values[:, :, -keep:] = values[:, :, -keep:]
        sink = self.sink_tokens
        if sink:  # both are fresh tensors
            attended_keys[:, :, :sink] = keys[:, :, :sink]
            attended_values[:, :, :sink] = values[:, :, :sink]
        num_new = key_states.shape[2]
        if num_new > 1:  # a step of several tokens (a prefill, a chunk) sees its own exact
            attended_keys[:, :, -num_new:] = key_states
            attended_values[:, :, -num_new:] = value_states
        return attended_keys, attended_values
