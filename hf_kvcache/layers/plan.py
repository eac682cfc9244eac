"""A step's plan (``StepPlan``): what every layer of a layer group writes and reads, decided once per forward pass
(``PagedRows.plan_step``, ``plan_eager_step``, ``plan_decode``).
"""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepPlan:
    """A compiled step's tensors (``ahead``) are kept and refilled in place, so that its graph (and a CUDA graph replay)
    reads them where they lie. Index tensors broadcast to ``[batch, heads, ...]`` over the storage's ``[layers, heads,
    pages, page_size, head_dim]``.

    Attributes:
        pages: ``[batch, 1, pages]`` the pages per row of a step that reads in place or is planned (padded with the
            null page to ``capacity_bucket``; a window's: from its first visible token's).
        offsets: ``[batch, 1, num_keys]`` with ``pages``, the slot of each key in its page (a window's eager step
            with sinks; ``None``: whole pages).
        write_pages / write_offsets: ``[batch, 1, n]`` the page and slot of each row's new tokens.
        heads: ``[1, heads, 1]`` the KV heads.
        layers: ``[1, 1, 1]`` per layer, its index.
        num_keys: keys attention gets per row (the model's mask is built for this many; a constant of the graph).
        kv_offset: the token of the first key (``get_mask_sizes``).
        partial_index: coded keys: ``[batch, heads, 1]`` each row's and head's page still filling
            (``KeyPages.partial``, ``[batch * heads, page_size, head_dim]``), with ``write_offsets`` the slot a step of
            one token per row writes its keys to.
        window_write: ``[n]`` the residual window's slots the newest tokens' values go to (``ResidualValues``).
        window_sources / window_positions: ``[window length]`` slot ``window_sources[i]`` goes over position
            ``window_positions[i]`` of the values read (``None``: none).
        key_rows / key_slots: coded keys (``KeyPages.plan``): a planned window's ``[batch * heads * pages]`` page
            rows decoded (``kernels.page_rows``; ``None``: ``reads``, whole pages) and ``[batch, 1, num_keys, 1]`` each
            key's slot among them (``None``: the keys from token ``kv_offset`` on, in order).
        filling_rows / filling_coded: coded keys: ``[batch * heads]`` the page still filling among those decoded
            (``None``: none), and a step of one token per row's ``[1, 1, 1]`` whether it fills it (then a planned step
            reads it from the codes it wrote; ``None``: a step of several tokens, which encodes the pages it fills).
        mask: a ``PagedBlockMask`` where attention reads the pages in place; ``None``: the step gathers.
        padding_only: an eager step's: whether the model's mask hides only each row's leading padding (found by
            its first layer's attention; ``None``: not yet). A planned step reads in place only where it does.
        reads: ``[batch * heads * pages]`` page rows to gather (``kernels.page_rows``, cut at token ``kv_offset``),
            or with ``slot_reads`` ``[batch * heads * num_keys]`` slots (``kernels.slot_indices``); ``None``: none.
        start / num_new: an eager step's first token and number of new tokens.
        version: the table version an eager plan was made for (a shared prefill's split rows change it).
        mode: how an eager step's attention reads: ``GATHER``, ``RUN`` or ``IN_PLACE`` (``ReadPath``).
        ahead: planned before the forward pass for a compiled step (``PagedRows.plan_decode``).
        slots: a window's gathered step: ``[batch, num_keys]`` the token of each key, in time order.
        layout: a window's step of several tokens: the ``KeyLayout`` attention gets.
        value_extents: quantized values read in place: ``[n]`` the extents the mask visits, dequantized into
            ``value_buffer`` (a compiled step's padded with the last to a fixed count).
        window_pages / window_offsets: ``[batch, 1, residual length]`` the page and slot of each residual window
            slot's token (the null page's first slot: none), its values going over the dequantized ones.
        value_buffer: ``[heads, view pages * page_size, head_dim]`` quantized values laid out as the storage.
        value_runs: an eager step's ``value_extents`` as ``(first, end)`` runs of consecutive ids.
        sink_write / sink_writes: an exact sink: ``[1]`` where the new token goes in it, ``[1, 1, 1, 1]`` whether
            it is one of the tokens the sink holds.
    """

    pages: torch.Tensor | None
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    heads: torch.Tensor
    layers: tuple[torch.Tensor, ...]
    num_keys: int
    kv_offset: int = 0
    partial_index: torch.Tensor | None = None
    window_write: torch.Tensor | None = None
    window_sources: torch.Tensor | None = None
    window_positions: torch.Tensor | None = None
    key_rows: torch.Tensor | None = None
    key_slots: torch.Tensor | None = None
    filling_rows: torch.Tensor | None = None
    filling_coded: torch.Tensor | None = None
    mask: Any = None
    offsets: torch.Tensor | None = None
    padding_only: bool | None = None
    value_extents: torch.Tensor | None = None
    window_pages: torch.Tensor | None = None
    window_offsets: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None
    value_runs: list[tuple[int, int]] | None = None
    sink_write: torch.Tensor | None = None
    sink_writes: torch.Tensor | None = None
    reads: torch.Tensor | None = None
    slot_reads: bool = False
    start: int = 0
    num_new: int = 1
    version: int = -1
    mode: str = "gather"
    ahead: bool = False
    slots: torch.Tensor | None = None
    layout: Any = None


def capacity_bucket(num_pages: int) -> int:
    """The pages a planned step reads for rows of ``num_pages`` pages: the next of 4, 5, 6, 7, 8, 10, 12, 14, 16,
    20, ... (a power of two times 1, 1.25, 1.5 or 1.75), so that lengths in one bucket share a compiled graph and a
    step reads at most a quarter more than its rows hold."""
    num_pages = max(num_pages, 4)
    quarter = 1 << max(0, num_pages.bit_length() - 3)  # 2^(e - 2) for 2^e <= num_pages < 2^(e + 1)
    return -(-num_pages // quarter) * quarter
