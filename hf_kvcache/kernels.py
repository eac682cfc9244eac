"""Moving keys/values between attention's tensors and pool pages (pure torch): the gather path.

A pool's storage holds keys or values as ``[num_layers, num_kv_heads, num_pages, page_size, last_dim]``
(``hf_kvcache.pool``). Inside one layer a (head, page) pair is one row of ``page_size * last_dim`` numbers
and a (head, slot) pair one row of ``last_dim``, so reading pages or slots is a single ``index_select`` over
the layer's flattened view, and the result ``[num_kv_heads, batch, n, last_dim]`` is handed to attention as a
permuted view ``[batch, num_kv_heads, n, last_dim]`` without another copy. Row indices depend on the storage's
page count: build them for the storage they are used with (``hf_kvcache.pool.PoolStorage``).

Where a single row's pages are one run of consecutive ids in order, its tokens are consecutive slots of each head
and ``run_view`` hands them over as a strided view, no copy at all. The in-place path for rows scattered over the
pool is ``hf_kvcache.flex``; ``read_pages`` is the slow twin of both.
"""

from typing import Any

import torch


def page_rows(page_ids: torch.Tensor, num_kv_heads: int, num_pages: int) -> torch.Tensor:
    """``[num_kv_heads * batch * n]``: the row of each (head, page) of ``page_ids [batch, n]`` in a layer's
    ``[num_kv_heads * num_pages, page_size * last_dim]`` view, in ``(head, batch, n)`` order."""
    heads = torch.arange(num_kv_heads, device=page_ids.device).view(-1, 1, 1)  # [heads, 1, 1]
    return (heads * num_pages + page_ids).reshape(-1)


def slot_rows(
    page_ids: torch.Tensor, offsets: torch.Tensor, num_kv_heads: int, num_pages: int, page_size: int
) -> torch.Tensor:
    """``[num_kv_heads * batch * n]``: the row of each (head, slot) in a layer's ``[num_kv_heads * num_pages *
    page_size, last_dim]`` view, for slots ``offsets [batch, n]`` of pages ``page_ids [batch, n]``, in
    ``(head, batch, n)`` order."""
    heads = torch.arange(num_kv_heads, device=page_ids.device).view(-1, 1, 1)  # [heads, 1, 1]
    return ((heads * num_pages + page_ids) * page_size + offsets).reshape(-1)


def read_pages(storage: torch.Tensor, layer_idx: int, rows: torch.Tensor, batch: int, num_tokens: int) -> torch.Tensor:
    """Gathers a layer's pages for attention.

    Args:
        storage: the pool's keys (or values, or value scales), ``[layers, heads, pages, page_size, last_dim]``.
        rows: from ``page_rows`` over a ``[batch, num_pages]`` page table and this storage's page count.
        num_tokens: tokens per row to return (the tail of the last page is dropped).

    Returns:
        ``[batch, heads, num_tokens, last_dim]``, a permuted view of a fresh tensor.
    """
    _, heads, _, page_size, last_dim = storage.shape
    out = storage[layer_idx].view(-1, page_size * last_dim).index_select(0, rows)
    out = out.view(heads, batch, -1, last_dim)[:, :, :num_tokens]  # [heads, batch, tokens, last_dim]
    return out.permute(1, 0, 2, 3)


def run_view(storage: torch.Tensor, layer_idx: int, first_page: int, num_tokens: int) -> torch.Tensor:
    """A layer's tokens ``[0, num_tokens)`` of one row whose pages are ``first_page, first_page + 1, ...``, in place.

    Args:
        storage: as for ``read_pages`` (contiguous: a page's slots follow the page before in each head).

    Returns:
        ``[1, heads, num_tokens, last_dim]``, a view of ``storage`` (the same numbers ``read_pages`` copies out).
    """
    _, heads, _, page_size, last_dim = storage.shape
    head_stride, slot_stride = storage.stride(1), storage.stride(3)
    offset = storage.storage_offset() + layer_idx * storage.stride(0) + first_page * storage.stride(2)
    return storage.as_strided((1, heads, num_tokens, last_dim), (0, head_stride, slot_stride, 1), offset)


def read_slots(storage: torch.Tensor, layer_idx: int, rows: torch.Tensor, batch: int) -> torch.Tensor:
    """Gathers single slots of a layer, in the order given (a ring's tokens in time order).

    Args:
        storage: as for ``read_pages``.
        rows: from ``slot_rows`` over ``[batch, n]`` slots.

    Returns:
        ``[batch, heads, n, last_dim]``, a permuted view of a fresh tensor.
    """
    heads, last_dim = storage.shape[1], storage.shape[-1]
    out = storage[layer_idx].view(-1, last_dim).index_select(0, rows)  # [heads * batch * n, last_dim]
    return out.view(heads, batch, -1, last_dim).permute(1, 0, 2, 3)


def write_slots(storage: torch.Tensor, layer_idx: int, rows: torch.Tensor, states: torch.Tensor) -> None:
    """Scatters new keys (or values) ``[batch, heads, n, last_dim]`` into their slots ``rows`` of one layer
    (``slot_rows``, in ``(head, batch, n)`` order)."""
    last_dim = storage.shape[-1]
    source = states.permute(1, 0, 2, 3).reshape(-1, last_dim)  # [heads * batch * n, last_dim]
    storage[layer_idx].view(-1, last_dim).index_copy_(0, rows, source.to(storage.dtype))


def write_planned(storage: torch.Tensor, plan: "Any", layer_idx: int, states: torch.Tensor) -> None:
    """Writes a planned step's one new token per row, ``states [batch, heads, 1, last_dim]``, to its slot of one layer
    (``StepPlan.write_pages`` / ``write_offsets``): one ``index_put_`` on the whole storage (no view of it is
    mutated, so a compiled step writes the slots in place rather than copying the storage)."""
    index = (plan.layers[layer_idx], plan.heads, plan.write_pages, plan.write_offsets)  # -> [batch, heads, 1]
    states = states.detach() if states.requires_grad else states  # the pool holds inference state
    storage.index_put_(index, states if states.dtype == storage.dtype else states.to(storage.dtype))


def read_planned_view(view: torch.Tensor, plan: "Any") -> torch.Tensor:
    """``read_planned`` from one layer's storage viewed as ``[1, heads, pages * page_size, last_dim]`` (a step that
    reads in place: ``StepPlan.mask``), for attention that must gather after all: ``[batch, heads, num_keys,
    last_dim]``."""
    _, heads, _, last_dim = view.shape
    page_size = plan.mask.page_size
    pages = view.view(heads, -1, page_size, last_dim)[plan.heads, plan.pages]  # [batch, heads, capacity, page, last]
    return pages.view(pages.shape[0], heads, -1, last_dim)


def read_planned(storage: torch.Tensor, plan: "Any", layer_idx: int) -> torch.Tensor:
    """A planned step's keys (or values) of one layer, ``[batch, heads, plan.num_keys, last_dim]``: one gather of
    whole pages (``StepPlan.pages``), or of single slots where the plan has ``offsets``, then a view."""
    if plan.offsets is not None:
        return storage[plan.layers[layer_idx], plan.heads, plan.pages, plan.offsets]  # [batch, heads, keys, last]
    gathered = storage[plan.layers[layer_idx], plan.heads, plan.pages]  # [batch, heads, capacity, page_size, last]
    batch, heads, capacity, page_size, last_dim = gathered.shape
    return gathered.view(batch, heads, capacity * page_size, last_dim)
