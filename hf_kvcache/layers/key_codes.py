"""Full key pages to and from their codes in the pool (a format that sets ``key_bits``): ``KeyCodes``.

At 8 bits a page's keys are coded per token, at 4 per channel over the page's tokens (compact parameters), stored
row-major so that they decode a token row at a time. ``hf_kvcache.layers.keys`` holds the page still filling.
"""

import sys
from collections.abc import Callable

import torch

from hf_kvcache.memory.dequant import (
    channel_halves,
    dequantize_channels,
    dequantize_channels_into,
    dequantize_joined_into,
)
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.quant import dequantize, join_scales, quantize
from hf_kvcache.memory.storage import PoolStorage

Buffer = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]
"""A reused buffer by name, shape and dtype (``SlotStore._buffer``)."""


class KeyCodes:
    """One layer group's full key pages as codes in the pool: encoded once, decoded for each read.

    Args:
        page_format: the pool's format (``key_bits`` set).
        buffer: where decoded keys go (reused; a view of it is valid until the next layer's read).
    """

    def __init__(self, page_format: PageFormat, buffer: Buffer) -> None:
        self.format = page_format
        self.quant = page_format.key_format
        self.page_size = page_format.page_size
        self._buffer = buffer
        self._halves: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None  # (decode buffer, its rows)

    def store_index(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``store``'s index of pool pages ``targets [batch, m]``: ``[heads, batch, m]`` as index tensors."""
        heads = torch.arange(self.format.num_kv_heads, device=targets.device).view(-1, 1, 1)
        return heads, targets.unsqueeze(0)

    def store(
        self, layer_in_group: int, storage: PoolStorage, pages: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """Encodes full pages ``[batch, heads, m, page_size, head_dim]`` into the pool pages ``index`` names."""
        fmt, quant = self.format, self.quant
        if fmt.keys_per_channel:  # each channel's page_size tokens: [batch, heads, m, head_dim, page_size]
            codes, scale, zero = quantize(pages.transpose(-1, -2), quant)  # codes [..., head_dim, page_size // 2]
            # Stored row-major, [page_size // 2, head_dim], so that they decode a token row at a time.
            parts = ((storage.keys, codes.transpose(-1, -2)), (storage.key_scales, scale), (storage.key_zeros, zero))
        else:
            codes, scale, zero = quantize(pages, quant)
            parts = ((storage.keys, codes), (storage.key_scales, join_scales(scale, zero)))
        for tensor, part in parts:  # part [batch, heads, m, *a page's shape] to each head's pages
            pool_pages = storage.page_view(tensor, layer_in_group, tuple(part.shape[3:]))  # [heads, pages, *shape]
            pool_pages.index_put_(index, part.transpose(0, 1).to(tensor.dtype))

    def decode(
        self,
        layer_in_group: int,
        storage: PoolStorage,
        page_ids: torch.Tensor,
        dtype: torch.dtype,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The keys of pages ``page_ids [batch, m]`` (``ids``: the same flattened, ``StepPlan.key_ids``) as
        ``[heads, batch * m, page_size, head_dim]`` in ``dtype``, decoded into a reused buffer (a page still filling
        reads as whatever its codes were)."""
        fmt, quant = self.format, self.quant
        heads, page_size, head_dim = fmt.num_kv_heads, self.page_size, fmt.head_dim
        batch, m = page_ids.shape
        ids = page_ids.reshape(-1) if ids is None else ids

        def gather(tensor: torch.Tensor, *page_shape: int) -> torch.Tensor:  # [heads, batch * m, *page_shape]
            return storage.page_view(tensor, layer_in_group, page_shape).index_select(1, ids)

        shape = (heads, batch * m, page_size, head_dim)
        out = self._buffer("keys", shape, dtype)
        work = None if dtype == torch.float32 else self._buffer("key_work", shape, torch.float32)
        if fmt.keys_per_channel:  # codes row-major [code_dim, head_dim]; a scale and zero per channel
            codes = gather(storage.keys, quant.code_dim, head_dim)
            scale, zero = gather(storage.key_scales, 1, head_dim), gather(storage.key_zeros, 1, head_dim)
            halves = self._channel_halves(out if work is None else work) if quant.bits == 4 else None
            dequantize_channels_into(out, codes, scale, zero, quant, work, halves)
        else:
            codes = gather(storage.keys, page_size, quant.code_dim)
            scales = gather(storage.key_scales, page_size, 2 * quant.num_scale_groups)
            spread = None
            if quant.bits == 4:
                spread = tuple(self._buffer(name, codes.shape, torch.int16) for name in ("key_spread", "key_high"))
            dequantize_joined_into(out, codes, scales, quant, work, spread)
        return out

    def _channel_halves(self, work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``channel_halves`` of a reused buffer, kept while it is the same."""
        if self._halves is None or self._halves[0] is not work:
            self._halves = (work, channel_halves(work, self.quant))
        return self._halves[1]

    def decode_indexed(self, storage: PoolStorage, index: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """The keys of the pages ``storage.keys[index]`` selects (a planned step's ``(layer, heads, pages)``) as
        ``[batch, heads, pages, page_size, head_dim]``, bitwise as ``decode``, in tensor operations only."""
        fmt, quant = self.format, self.quant
        codes = storage.keys[index]  # [batch, heads, pages, page_size, last]
        batch, heads, num_pages = codes.shape[:3]
        if fmt.keys_per_channel:  # a page's codes row-major [page_size // 2, head_dim], a scale per channel
            codes = codes.view(batch, heads, num_pages, quant.code_dim, fmt.head_dim)
            words = storage.key_scales
            if quant.compact_params and sys.byteorder == "little":  # gathered as bytes: see dequantize_channels
                words = words.view(torch.uint8)
            scale, zero = words[index].unsqueeze(-2), storage.key_zeros[index].unsqueeze(-2)
            return dequantize_channels(codes, scale, zero, quant, dtype)
        scales, groups = storage.key_scales[index], quant.num_scale_groups
        return dequantize(codes, scales[..., :groups], scales[..., groups:], quant, dtype)

    def release(self) -> None:
        self._halves = None
