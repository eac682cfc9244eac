"""Compressed attention on the pool (``CompressedLayer``: DeepSeek-V4's compressed sparse and heavily compressed
attention layers, ``COMPRESSED_LAYER_TYPES``).

Such a layer attends to a sliding window of the model's ``sliding_window`` tokens of one shared key-and-value head, and
to the entries its compressor makes of every ``compress_rate`` tokens, which the model concatenates after the window's
keys itself. transformers keeps both in one ``DynamicSlidingWindowLayer`` (``DeepseekV4HCACache``,
``DeepseekV4CSACache``); here the window is one of our windows over pages, and the compressor's state (the tokens
buffered until a window of ``compress_rate`` closes, the compressed entries, their count, a compressed sparse layer's
overlap and its indexer's entries) stays in transformers' own layer object (``compressor``, held by ``StateLayers``:
moved with the rows, counted in ``state_bytes``), reached by the model through the methods it calls on its cache
layer.

The model writes the same tensor as keys and as values (``update(kv, kv)``, on its sliding layers too); the pool
stores it once, as keys (``PageFormat.values_are_keys``: the values are the keys on every read path), and the model
reads the keys ``update`` returns as both. A quantized cache therefore has no values to code: ``quantized_values``
keeps the tensor in full precision, ``quantized_kv`` as its key codes, whose decoded keys are the values.
transformers can neither crop the compressor's state (``is_croppable = False``) nor compile these layers
(``_can_compile_fullgraph = False``): a crop is refused by name, and the cache says it does not compile
(``StateLayers.is_compileable``)."""

from typing import Any

import torch

from hf_kvcache.layers import WindowLayer


class CompressedLayer(WindowLayer):
    """A compressed-attention layer: its window's keys and values on the pool, its compressor's state in
    transformers' own layer (``compressor``: a ``DeepseekV4HCACache`` or ``DeepseekV4CSACache``, placed by
    ``StateLayers.place``), which the model drives through ``store_compression_weights``,
    ``update_compressor_states`` and (compressed sparse layers) ``update_overlap_state``."""

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
