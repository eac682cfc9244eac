"""Moving keys/values between attention's tensors and pool pages (pure torch).

A pool's storage is a list of chunks (see ``hf_kvcache.pool``); each chunk holds keys or values
of pages ``[start, start + num_pages)`` as ``[num_layers, num_kv_heads, num_pages, page_size,
head_dim]``. Inside one layer and one chunk a (head, page) pair is one row of ``page_size *
head_dim`` numbers, so reading pages is a single ``index_select`` per chunk, and the result
``[num_kv_heads, batch, pages * page_size, head_dim]`` is handed to attention as a permuted view
``[batch, num_kv_heads, seq_len, head_dim]`` without another copy.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkIndex:
    """Where one chunk's part of a read or write goes.

    Attributes:
        chunk_idx: which chunk of the pool.
        index: rows of the chunk's flattened layer view (pages for reads, slots for writes).
        positions: rows of the flattened attention-side tensor they pair with; ``None`` for all, in order.
    """

    chunk_idx: int
    index: torch.Tensor
    positions: torch.Tensor | None


def split_by_chunk(
    page_ids: torch.Tensor,
    chunk_starts: list[int],
    chunk_sizes: list[int],
    num_kv_heads: int,
    slot_offsets: torch.Tensor | None = None,
    page_size: int = 0,
) -> list[ChunkIndex]:
    """Index of each (head, page) or (head, slot) of ``page_ids`` inside its chunk.

    Args:
        page_ids: ``[batch, n]`` page ids (one per page to read, or one per slot to write).
        chunk_starts / chunk_sizes: first page id and page count of each chunk.
        num_kv_heads: heads per layer.
        slot_offsets: ``[batch, n]`` slot within each page for writes; ``None`` for reads.
        page_size: slots per page (writes only).

    Returns:
        One ``ChunkIndex`` per chunk touched; its ``index`` enumerates ``(head, batch, n)`` in order.
    """
    heads = torch.arange(num_kv_heads, device=page_ids.device).view(-1, 1, 1)  # [heads, 1, 1]
    parts = []
    for chunk_idx, (start, size) in enumerate(zip(chunk_starts, chunk_sizes)):
        local = page_ids - start  # [batch, n]
        rows = heads * size + local  # [heads, batch, n]
        if slot_offsets is not None:
            rows = rows * page_size + slot_offsets
        if len(chunk_starts) == 1:
            return [ChunkIndex(chunk_idx, rows.reshape(-1), None)]
        inside = ((local >= 0) & (local < size)).expand_as(rows).reshape(-1)
        if inside.any():
            parts.append(ChunkIndex(chunk_idx, rows.reshape(-1)[inside], inside.nonzero().squeeze(1)))
    return parts


def read_pages(
    chunks: list[torch.Tensor], layer_idx: int, parts: list[ChunkIndex], batch: int, num_tokens: int
) -> torch.Tensor:
    """Gathers a layer's pages for attention.

    Args:
        chunks: the pool's key (or value) chunks, each ``[layers, heads, pages, page_size, head_dim]``.
        parts: from ``split_by_chunk`` over a ``[batch, num_pages]`` page table.
        num_tokens: tokens per row to return (the tail of the last page is dropped).

    Returns:
        ``[batch, heads, num_tokens, head_dim]``, a permuted view of a fresh tensor.
    """
    _, heads, _, page_size, head_dim = chunks[0].shape
    out = _gather([chunk[layer_idx].view(-1, page_size * head_dim) for chunk in chunks], parts)
    out = out.view(heads, batch, -1, head_dim)[:, :, :num_tokens]  # [heads, batch, tokens, head_dim]
    return out.permute(1, 0, 2, 3)


def read_slots(chunks: list[torch.Tensor], layer_idx: int, parts: list[ChunkIndex], batch: int) -> torch.Tensor:
    """Gathers single slots of a layer, in the order given (a ring's tokens in time order).

    Args:
        chunks: as for ``read_pages``.
        parts: from ``split_by_chunk`` over ``[batch, n]`` slot page ids and offsets.

    Returns:
        ``[batch, heads, n, head_dim]``, a permuted view of a fresh tensor.
    """
    heads, head_dim = chunks[0].shape[1], chunks[0].shape[-1]
    out = _gather([chunk[layer_idx].view(-1, head_dim) for chunk in chunks], parts)  # [heads * batch * n, head_dim]
    return out.view(heads, batch, -1, head_dim).permute(1, 0, 2, 3)


def _gather(flat: list[torch.Tensor], parts: list[ChunkIndex]) -> torch.Tensor:
    """Rows ``parts`` of the flattened chunks ``flat``, in the order of the parts' positions."""
    if len(parts) == 1 and parts[0].positions is None:
        return flat[parts[0].chunk_idx].index_select(0, parts[0].index)
    out = flat[0].new_empty(sum(part.index.numel() for part in parts), flat[0].shape[1])
    for part in parts:
        out.index_copy_(0, part.positions, flat[part.chunk_idx].index_select(0, part.index))
    return out


def write_slots(chunks: list[torch.Tensor], layer_idx: int, parts: list[ChunkIndex], states: torch.Tensor) -> None:
    """Scatters new keys (or values) ``[batch, heads, n, head_dim]`` into their slots of one layer."""
    _, heads, _, _, head_dim = chunks[0].shape
    source = states.permute(1, 0, 2, 3).reshape(-1, head_dim)  # [heads * batch * n, head_dim]
    for part in parts:
        target = chunks[part.chunk_idx][layer_idx].view(-1, head_dim)  # [heads * pages * page_size, head_dim]
        values = source if part.positions is None else source.index_select(0, part.positions)
        target.index_copy_(0, part.index, values.to(target.dtype))
