"""Moving keys and values between attention's tensors and pool slots (pure torch): the gather path, the slow twin of
``attention.flex``'s in-place reads.

A pool's storage holds keys or values as ``[num_layers, num_kv_heads, num_pages, page_size, last_dim]``
(``memory.storage``). A step writes its tokens with one ``index_put_`` per layer (``write_planned``) and gathers
with one ``index_select`` per layer: whole pages (``page_rows``, ``read_pages``) or single slots, a window's
(``slot_indices``, ``read_slots``). Indices depend on the storage's page count: build them for the storage they index.
"""

from typing import Any

import torch


def slot_indices(
    page_ids: torch.Tensor, offsets: torch.Tensor, num_kv_heads: int, num_pages: int, page_size: int
) -> torch.Tensor:
    """``[batch, num_kv_heads, n]``: the slot index of each (head, slot), its position in a layer's ``[num_kv_heads *
    num_pages * page_size, last_dim]`` view (``PoolStorage.slots``), for slots ``offsets [batch, n]`` of pages
    ``page_ids [batch, n]``."""
    heads = torch.arange(num_kv_heads, device=page_ids.device).view(1, -1, 1)  # [1, heads, 1]
    return (heads * num_pages + page_ids.unsqueeze(1)) * page_size + offsets.unsqueeze(1)


def page_rows(page_ids: torch.Tensor, num_kv_heads: int, num_pages: int) -> torch.Tensor:
    """``[batch * num_kv_heads * pages]``: the row of each (row, head, page) of ``page_ids [batch, pages]`` in a
    layer's storage viewed as ``[num_kv_heads * num_pages, page_size * last_dim]`` (``read_pages``), flattened."""
    heads = torch.arange(num_kv_heads, device=page_ids.device).view(1, -1, 1)  # [1, heads, 1]
    return (heads * num_pages + page_ids.unsqueeze(1)).view(-1)


def read_pages(pages: torch.Tensor, rows: torch.Tensor, shape: tuple[int, int, int, int], first: int) -> torch.Tensor:
    """Gathers whole pages of one layer, ``pages [heads * num_pages, page_size * last_dim]`` (``PoolStorage.slots``
    with ``slots_per_row=page_size``), at ``rows`` (``page_rows``): ``shape`` ``(batch, heads, num_tokens, last_dim)``,
    each row's tokens from token ``first`` of its first page, a view of one ``index_select`` (a page_size times smaller
    index than of slots)."""
    batch, heads, _, last_dim = shape
    row_numbers = rows.numel() // (batch * heads) * pages.shape[1]  # a row's pages, per head
    strides = (heads * row_numbers, row_numbers, last_dim, 1)
    return pages.index_select(0, rows).as_strided(shape, strides, first * last_dim)


def run_view(storage: torch.Tensor, layer_idx: int, first_page: int, num_tokens: int) -> torch.Tensor:
    """A layer's tokens ``[0, num_tokens)`` of one row whose pages are ``first_page, first_page + 1, ...``, in place:
    ``[1, heads, num_tokens, last_dim]``, a view of ``storage`` (``[layers, heads, pages, page_size, last_dim]``,
    contiguous: a page's slots follow the page before in each head)."""
    _, heads, _, page_size, last_dim = storage.shape
    head_stride, slot_stride = storage.stride(1), storage.stride(3)
    offset = storage.storage_offset() + layer_idx * storage.stride(0) + first_page * storage.stride(2)
    return storage.as_strided((1, heads, num_tokens, last_dim), (0, head_stride, slot_stride, 1), offset)


def read_slots(slots: torch.Tensor, index: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Gathers slots of one layer, ``slots [heads * pages * page_size, last_dim]`` (``PoolStorage.slots``), in the
    order of ``index [batch * heads * n]`` (``slot_indices`` flattened: one ``index_select`` over a flat index is faster
    than ``slots[index]``): ``[*shape, last_dim]`` for ``shape = (batch, heads, n)``, a fresh tensor."""
    return slots.index_select(0, index).view(*shape, slots.shape[-1])


def write_planned(storage: torch.Tensor, plan: Any, layer_idx: int, states: torch.Tensor) -> None:
    """Writes a step's new tokens, ``states [batch, heads, n, last_dim]``, to their slots of one layer
    (``StepPlan.write_pages`` / ``write_offsets``): one ``index_put_`` on the whole storage (no view of it is
    mutated, so a compiled step writes the slots in place rather than copying the storage)."""
    index = (plan.layers[layer_idx], plan.heads, plan.write_pages, plan.write_offsets)  # -> [batch, heads, 1]
    states = states.detach() if states.requires_grad else states  # the pool holds inference state
    storage.index_put_(index, states if states.dtype == storage.dtype else states.to(storage.dtype))


def read_planned_view(view: torch.Tensor, plan: Any) -> torch.Tensor:
    """The keys of a step that reads in place (``StepPlan.mask``), ``[batch, heads, num_keys, last_dim]``, gathered
    from one layer's storage viewed as ``[1, heads, pages * page_size, last_dim]`` for attention that cannot read
    in place after all: ``StepPlan.pages`` whole from token ``kv_offset``, or with ``offsets`` one slot each."""
    _, heads, _, last_dim = view.shape
    slots = view.view(heads, -1, plan.mask.page_size, last_dim)
    if plan.offsets is not None:  # [batch, heads, num_keys, last_dim]
        return slots[plan.heads, plan.pages, plan.offsets]
    pages = slots[plan.heads, plan.pages]  # [batch, heads, pages, page_size, last_dim]
    skip = plan.kv_offset % plan.mask.page_size
    return pages.view(pages.shape[0], heads, -1, last_dim)[:, :, skip : skip + plan.num_keys]
