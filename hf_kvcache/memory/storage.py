"""A pool's storage tensors at one time (``PoolStorage``), and the per-layer views of them that a step's layers index
(``hf_kvcache.memory.pool`` lays them out)."""

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PoolStorage:
    """The pool's storage tensors at one time (a growth that moves pages makes a new one).

    Indices into the storage depend on its page count, so code that writes or reads takes one snapshot
    (``KVPool.storage``; writers under ``KVPool.lock``) and uses indices built for it with it: pages written
    before a growth are in the new storage too, and the old one stays valid for reading them.

    Attributes:
        keys / values / value_scales / key_scales / key_zeros: see the module docstring; ``value_scales`` is ``None``
            unless values are quantized, ``key_scales`` unless keys are, ``key_zeros`` unless per channel.
    """

    keys: torch.Tensor
    values: torch.Tensor
    value_scales: torch.Tensor | None
    key_scales: torch.Tensor | None = None
    key_zeros: torch.Tensor | None = None
    _slot_views: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_pages(self) -> int:
        """Page ids the tensors hold (the null page and pages never opened included)."""
        return self.keys.shape[2]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        tensors = (self.keys, self.values, self.value_scales, self.key_scales, self.key_zeros)
        return tuple(tensor for tensor in tensors if tensor is not None)

    def slots(self, tensor: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """One layer of ``tensor`` (one of ``tensors``) as ``[heads * pages * page_size, last_dim]`` slots, the view
        ``kernels.read_slots`` and ``kernels.write_slots`` index with ``kernels.slot_rows``; kept, so that a step's
        layers dispatch no op to make it."""
        key = (id(tensor), layer_idx, torch.is_inference_mode_enabled())
        view = self._slot_views.get(key)
        if view is None:
            view = self._slot_views[key] = tensor[layer_idx].view(-1, tensor.shape[-1])
        return view

    def page_view(self, tensor: torch.Tensor, layer_idx: int, page_shape: tuple[int, ...]) -> torch.Tensor:
        """One layer of ``tensor`` as ``[heads, pages, *page_shape]`` (a page's numbers in ``page_shape``: encoded
        keys are gathered a page at a time, ``index_select`` on dim 1 giving their shape); kept, as ``slots`` is."""
        key = (id(tensor), layer_idx, torch.is_inference_mode_enabled(), page_shape)
        view = self._slot_views.get(key)
        if view is None:
            view = self._slot_views[key] = tensor[layer_idx].view(*tensor.shape[1:3], *page_shape)
        return view
