"""Full key pages to and from their codes in the pool (a format that sets ``key_bits``): ``KeyCodes``.

At 8 bits a page's keys are coded per token, at 4 per channel over the page's tokens (compact parameters), stored
row-major so that they decode a token row at a time. ``hf_kvcache.layers.keys`` holds the page still filling.
"""

import sys

import torch

from hf_kvcache.memory.dequant import dequantize_channels
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.quant import dequantize, join_scales, quantize, quantize_columns
from hf_kvcache.memory.storage import PoolStorage


class KeyCodes:
    """One layer group's full key pages as codes in the pool: encoded once, decoded for each read.

    Args:
        page_format: the pool's format (``key_bits`` set).
    """

    def __init__(self, page_format: PageFormat) -> None:
        self.format = page_format
        self.quant = page_format.key_format
        self.page_size = page_format.page_size

    def store(
        self, storage: PoolStorage, pages: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> None:
        """Encodes full pages ``[batch, heads, m, page_size, head_dim]`` into the pool pages ``index`` names (``(layer
        [1, 1, 1], heads [1, heads, 1], pages [batch, 1, m])``, as ``StepPlan`` indexes the storage)."""
        fmt, quant = self.format, self.quant
        if fmt.keys_per_channel:  # each channel over its page_size tokens, stored as the decoder reads them
            codes, scale, zero = quantize_columns(pages, quant)  # codes [..., page_size // 2, head_dim]
            parts = ((storage.keys, codes), (storage.key_scales, scale), (storage.key_zeros, zero))
        else:
            codes, scale, zero = quantize(pages, quant)
            parts = ((storage.keys, codes), (storage.key_scales, join_scales(scale, zero)))
        for tensor, part in parts:  # part [batch, heads, m, *a page's shape]
            tensor.index_put_(index, part.to(tensor.dtype))

    def decode(
        self,
        storage: PoolStorage,
        layer_idx: int,
        rows: torch.Tensor,
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The keys of layer ``layer_idx``'s pages at ``rows`` (``kernels.page_rows``) as ``[rows, page_size,
        head_dim]`` in ``dtype``, in tensor operations only. Keys coded per channel decode into ``out`` (float32, that
        shape; ``None``: a new tensor)."""
        fmt, quant = self.format, self.quant

        def gather(tensor: torch.Tensor) -> torch.Tensor:  # [rows, *a page's shape]: one index_select each
            return storage.pages(tensor, layer_idx).index_select(0, rows)

        codes = gather(storage.keys)
        if fmt.keys_per_channel:  # a page's codes row-major [page_size // 2, head_dim], a scale per channel
            words = storage.key_scales
            if quant.compact_params and sys.byteorder == "little" and torch.compiler.is_compiling():
                words = words.view(torch.uint8)  # gathered as bytes in a graph: see dequantize_channels
            if out is None:
                out = codes.new_empty((len(rows), fmt.page_size, fmt.head_dim), dtype=torch.float32)
            return dequantize_channels(codes, gather(words), gather(storage.key_zeros), quant, out).to(dtype)
        scales, groups = gather(storage.key_scales), quant.num_scale_groups
        return dequantize(codes, scales[..., :groups], scales[..., groups:], quant, dtype)
