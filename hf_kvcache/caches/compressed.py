"""Compressed attention on the pool (``CompressedLayer``: DeepSeek-V4's layers of ``COMPRESSED_LAYER_TYPES``): a
window of the model's ``sliding_window`` tokens of one shared key-and-value head on our pages, and the entries a
compressor makes of every ``compress_rate`` tokens, whose state stays in transformers' own layer (``compressor``).

The model writes one tensor as keys and values (``update(kv, kv)``): the pool stores it once, as keys
(``PageFormat.values_are_keys``). transformers can neither crop the compressor's state nor compile these layers: a
crop is refused by name, and the cache does not compile."""

from typing import Any

import torch

from hf_kvcache.layers import WindowLayer


class CompressedLayer(WindowLayer):
    """A compressed-attention layer: its window on the pool, its compressor's state in transformers' own layer
    (``compressor``), which the model drives through the methods below."""

    is_croppable = False  # the compressor's state cannot be cut back, as in transformers
    compressor: Any = None  # placed by StateLayers.place

    def store_compression_weights(
        self, name: str, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The buffered tokens' and the new ``[batch, n, width]`` projections' longest run of whole compression
        windows, with the position of its first token (transformers' layer keeps the rest buffered)."""
        return self.compressor.store_compression_weights(name, kv, gate)

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """Appends ``[batch, n, head_dim]`` new compressed entries; returns all of them."""
        return self.compressor.update_compressor_states(name, compressed)

    def update_overlap_state(
        self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A compressed sparse layer's last window's first series, kept for the next call; returns the previous call's
        (``None`` on the first)."""
        return self.compressor.update_overlap_state(name, chunk_kv, chunk_gate, head_dim)
