"""A pool's storage tensors (``PoolStorage``): their layout, how they are made, and the per-layer views a step indexes.

One tensor per kind holds every page in every layer of one layer group (a page id serves one layer group)::

    keys:   [num_layers, num_kv_heads, num_storage_pages, page_size, head_dim]
    values: [num_layers, num_kv_heads, num_storage_pages, page_size, value_dim]   (format.value_dim)
    values = keys: the same tensor where the model writes one tensor as both (format.values_are_keys)

    quantized values (format.value_bits), per scale group of value_group_size channels (code_dim: value_dim bytes at
    int8, half at int4):
    values:       [num_layers, num_kv_heads, num_storage_pages, page_size, code_dim]             uint8 codes
    value_scales: [num_layers, num_kv_heads, num_storage_pages, page_size, 2 * num_scale_groups]  scales, zeros

    keys encoded per token (format.key_bits=8), per scale group of key_group_size channels:
    keys:         [num_layers, num_kv_heads, num_storage_pages, page_size, head_dim]             uint8 codes
    key_scales:   [num_layers, num_kv_heads, num_storage_pages, page_size, 2 * num_scale_groups]  scales, zeros
    keys encoded per channel over a page (format.key_bits=4):
    keys:         [num_layers, num_kv_heads, num_storage_pages, page_size // 2, head_dim]  uint8: byte (i, c) holds
                  tokens i (low nibble) and i + page_size // 2 of channel c
    key_scales:   [num_layers, num_kv_heads, num_storage_pages, 1, head_dim]   int16: a channel's compact scale word
    key_zeros:    [num_layers, num_kv_heads, num_storage_pages, 1, head_dim]   int8: the high bits of its zero (quant)
    (laid out as the decoder reads a page: a row of codes a token pair, a scale per channel)

    Scales and float zeros are in format.scale_dtype (default: the dtype). Encoded keys are written a page at a
    time, when its last slot is (a planned step: every step, the page's own codes last; layers.keys).

    slot            =   (layer_in_group, page id, offset < page_size): one token's key/value in one layer
    slot index      =   (head * num_storage_pages + page id) * page_size + offset: a slot's position in one layer's
                        flattened view [heads * pages * page_size, last_dim] (``PoolStorage.slots``, ``kernels``)
    extent e        =   pages [e * extent_pages, (e + 1) * extent_pages): what attention reads in place as one
                        block of extent_pages * page_size tokens (memory.allocator, attention.flex)
"""

from dataclasses import dataclass, field

import torch

from hf_kvcache.memory.format import PageFormat


@dataclass(frozen=True)
class PoolStorage:
    """A pool's storage tensors (the module docstring's), made once for every page id the pool may open;
    ``value_scales`` is ``None`` unless values are quantized, ``key_scales`` unless keys are, ``key_zeros`` unless per
    channel."""

    keys: torch.Tensor
    values: torch.Tensor
    value_scales: torch.Tensor | None
    key_scales: torch.Tensor | None = None
    key_zeros: torch.Tensor | None = None
    _slot_views: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def empty(cls, page_format: PageFormat, num_pages: int, device: torch.device) -> "PoolStorage":
        """Uninitialized storage for ``num_pages`` page ids of ``page_format``, laid out as the module docstring
        says (committed where touched only, on the CPU)."""
        fmt = page_format
        shape = (fmt.num_layers, fmt.num_kv_heads, num_pages, fmt.page_size)
        quant, key_quant = fmt.value_format, fmt.key_format
        scale_dtype = fmt.scale_dtype or fmt.dtype
        key_scales = key_zeros = None
        # Normal tensors even when made under torch.inference_mode(): the pool outlives that scope and is
        # written in place by later calls that may run outside it.
        with torch.inference_mode(False):
            if key_quant is None:
                keys = torch.empty(*shape, fmt.head_dim, dtype=fmt.dtype, device=device)  # [L, H, P, ps, D]
            elif fmt.keys_per_channel:  # a page's codes [ps // 2, D]; per page and channel [L, H, P, 1, D]
                keys = torch.empty(*shape[:3], fmt.page_size // 2, fmt.head_dim, dtype=torch.uint8, device=device)
                key_scales = torch.empty(*shape[:3], 1, fmt.head_dim, dtype=torch.int16, device=device)
                key_zeros = torch.empty(*shape[:3], 1, fmt.head_dim, dtype=torch.int8, device=device)
            else:  # per token, as values: [L, H, P, ps, D] codes and [L, H, P, ps, 2 * num_scale_groups]
                keys = torch.empty(*shape, key_quant.code_dim, dtype=torch.uint8, device=device)
                key_scales = torch.empty(*shape, 2 * key_quant.num_scale_groups, dtype=scale_dtype, device=device)
            scales = None
            if fmt.values_are_keys:  # one tensor, stored once (format.value_bits is then None)
                values = keys
            elif quant is None:
                values = torch.empty(*shape, fmt.value_dim, dtype=fmt.dtype, device=device)  # [L, H, P, ps, Dv]
            else:  # codes [..., code_dim] and (scale, zero) per scale group [..., 2 * num_scale_groups]
                values = torch.empty(*shape, quant.code_dim, dtype=torch.uint8, device=device)
                scales = torch.empty(*shape, 2 * quant.num_scale_groups, dtype=scale_dtype, device=device)
        return cls(keys, values, scales, key_scales, key_zeros)

    @property
    def num_pages(self) -> int:
        """Page ids the tensors hold (the null page and pages never opened included)."""
        return self.keys.shape[2]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The distinct storage tensors (values that are the keys once): what copies, zeroing and ``page_bytes`` go
        over."""
        values = None if self.values is self.keys else self.values
        tensors = (self.keys, values, self.value_scales, self.key_scales, self.key_zeros)
        return tuple(tensor for tensor in tensors if tensor is not None)

    def slots(self, tensor: torch.Tensor, layer_idx: int, slots_per_row: int = 1) -> torch.Tensor:
        """One layer of ``tensor`` as ``[heads * pages * page_size / slots_per_row, slots_per_row * last_dim]``: slots
        (``kernels.read_slots``), or with ``slots_per_row=page_size`` whole pages (``kernels.read_pages``)."""
        return self._view(tensor, layer_idx, (-1, slots_per_row * tensor.shape[-1]))

    def pages(self, tensor: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """One layer of ``tensor`` as ``[heads * pages, *a page's shape]``: coded keys, gathered a page at a time at
        ``kernels.page_rows``."""
        return self._view(tensor, layer_idx, (-1, *tensor.shape[3:]))

    def _view(self, tensor: torch.Tensor, layer_idx: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Kept, so that an eager step dispatches no op to make it (a compiled graph makes it for free)."""
        if torch.compiler.is_compiling():
            return tensor[layer_idx].view(shape)
        key = (id(tensor), layer_idx, torch.is_inference_mode_enabled(), shape)
        view = self._slot_views.get(key)
        if view is None:
            view = self._slot_views[key] = tensor[layer_idx].view(shape)
        return view
