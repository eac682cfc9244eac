"""A step's plan: what every layer of a layer group writes and reads, decided once per forward pass.

``generate``'s decode steps are planned before the forward pass, in the seam that sees every step
(``PoolCache.plan_decode``): a compiled one into tensors kept from step to step (``PagedRows.plan_decode``), an eager
one as its layers' first would (``PagedRows.plan_eager_step``). Other steps (a prefill, several tokens, a direct
``model(...)`` call) are planned by each layer group's first layer (``PagedRows.plan_step``). The layers write with
one kernel (``kernels.write_planned``) and gather with another (``kernels.read_pages``, a window's slots
``kernels.read_slots``), eager and compiled alike.
"""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepPlan:
    """A step's writes and reads. A compiled step (``ahead``: one new token per row, planned before the forward pass
    by ``PagedRows.plan_decode``) keeps its tensors from step to step, refilled in place, so that a compiled step
    (and a CUDA graph replay) reads them without a recompile while the batch and the number of keys stay; an eager
    step's (``PagedRows.plan_step``, ``plan_eager_step``) are made for it. Index tensors broadcast to ``[batch,
    heads, ...]`` over the storage's ``[layers, heads, pages, page_size, head_dim]`` (``kernels.write_planned``).

    Attributes:
        pages: a planned step's ``[batch, 1, pages]``: the pages each row reads (a row's pages, then the null page up
            to a capacity bucket: ``capacity_bucket``; a window's, from its first visible token's), which coded keys
            decode and attention gathers where it cannot read in place.
        write_pages / write_offsets: ``[batch, 1, n]`` the page and the slot in it of each row's new tokens.
        heads: ``[1, heads, 1]`` the KV heads.
        layers: ``[1, 1, 1]`` each layer's index (kept, so that a step makes none).
        num_keys: keys attention gets per row: the model's mask is built for this many (a constant of the graph);
            it hides the keys past the rows' tokens.
        kv_offset: the token of the first key (the model's mask: ``get_mask_sizes``; it is built outside the graph).
        rows: ``[batch, 1, 1]`` the rows (keys coded a page at a time: each row's page still filling).
        window_write: quantized values with a residual window (``ResidualValues``): ``[n]`` the window's slots the
            step's newest tokens' full-precision values go to.
        window_sources / window_positions: ``[window length]`` where attention gets the window's tokens: slot
            ``window_sources[i]``'s values go over position ``window_positions[i]`` of the values it reads (gathered
            reads; a fixed count); ``None``: none to read.
        key_pages / key_slots: keys coded a page at a time in a window: ``[batch, 1, window pages]`` the pages decoded
            (from the first visible token's; the null page past the rows'), and ``[batch, 1, num_keys, 1]`` each key's
            slot among them (``None`` both for rows that read every page: they decode ``pages``).
        filling_page / filling_coded: keys coded a page at a time: ``[1, 1]`` where the rows' page still filling lies
            among the pages the step decodes (its keys go over that page's), and ``[1, 1, 1, 1]`` whether the step
            fills it (then it is read through its encoding). Every row counts tokens from 0 (``KeyPages``).
        mask: a ``PagedBlockMask`` where attention reads the pages in place (FlexAttention over the storage, in
            the graph), refilled before each step; ``None``: the step gathers ``pages``.
        reads: what a step gathers: ``[batch * heads * pages]`` the rows' pages, as rows of a layer's storage viewed
            as ``[heads * pages, page_size * last_dim]`` (``kernels.page_rows``), cut at token ``kv_offset`` of the
            first page, or with ``slot_reads`` ``[batch * heads * num_keys]`` slot indices (``kernels.slot_indices``: a
            window's visible tokens in time order, the null page's first slot where a key holds none); ``None`` where
            the step does not gather.
        slot_reads: ``reads`` names slots, not pages.
        start / num_new: an eager step's first token and its number of new tokens.
        version: the page table's version an eager plan was made for (a shared prefill's rows that turn out to
            differ change it mid-step).
        mode: how an eager step's attention reads: ``"gather"``, ``"run"`` or ``"in place"`` (``ReadPath``).
        ahead: planned before the forward pass for a compiled step (``PagedRows.plan_decode``).
        slots: a window's gathered step: ``[batch, num_keys]`` the token of each key, in time order (``WindowRows``),
            which ``reads`` reads (and keys coded a page at a time decode).
        layout: a window's step of several tokens: the ``KeyLayout`` attention gets (``None``: a single new token
            sees every key).
        value_extents: quantized values read in place: ``[n]`` the extents the mask visits (a compiled step's padded
            with the last one to a fixed count), whose codes are dequantized into ``value_buffer``.
        window_pages / window_offsets: ``[batch, 1, residual length]`` the page and slot of the token each slot
            of the residual window holds (the null page's first slot where it holds none), where its
            full-precision values go over the dequantized ones.
        value_buffer: ``[heads, view pages * page_size, head_dim]`` quantized values laid out as the storage's
            first pages (the view attention reads), rewritten by each layer.
        value_runs: an eager step's ``value_extents`` as ``(first, end)`` runs of consecutive ids
            (``SlotStore.values_in_place``).
        key_ids / key_filling / key_step: an eager step's keys coded a page at a time (``KeyPages.plan_eager``): the
            rows' pages flattened ``[batch * pages]``, to decode; each row's page still filling among them ``[batch]``
            (rows counted from 0, ``None``: none); a one-token step's slot in the pages still filling ``[batch, heads,
            1, head_dim]`` and, where it fills them, the pool pages they are encoded to and the rows that fill.
        sink_write / sink_writes: an exact sink (``ExactSink``): ``[1]`` where the new token goes in it, and ``[1, 1,
            1, 1]`` whether it is one of the first tokens the sink holds (else the sink keeps what it held).
    """

    pages: torch.Tensor | None
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    heads: torch.Tensor
    layers: tuple[torch.Tensor, ...]
    num_keys: int
    kv_offset: int = 0
    rows: torch.Tensor | None = None
    window_write: torch.Tensor | None = None
    window_sources: torch.Tensor | None = None
    window_positions: torch.Tensor | None = None
    key_pages: torch.Tensor | None = None
    key_slots: torch.Tensor | None = None
    filling_page: torch.Tensor | None = None
    filling_coded: torch.Tensor | None = None
    mask: Any = None
    value_extents: torch.Tensor | None = None
    window_pages: torch.Tensor | None = None
    window_offsets: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None
    value_runs: list[tuple[int, int]] | None = None
    key_ids: torch.Tensor | None = None
    key_filling: torch.Tensor | None = None
    key_step: Any = None
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

    @property
    def window(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(window_write, window_sources, window_positions)``."""
        return self.window_write, self.window_sources, self.window_positions

    @property
    def window_reads(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(window_sources, window_positions)``, ``None`` where there are none."""
        return None if self.window_sources is None else (self.window_sources, self.window_positions)

    @property
    def in_place_values(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(value_extents, window_pages, window_offsets)``."""
        return self.value_extents, self.window_pages, self.window_offsets

    @property
    def sink(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(sink_write, sink_writes)``."""
        return self.sink_write, self.sink_writes

    @property
    def keys_read(self) -> tuple[torch.Tensor | None, ...]:
        """``(key_pages, key_slots, filling_page, filling_coded)``."""
        return self.key_pages, self.key_slots, self.filling_page, self.filling_coded


def capacity_bucket(num_pages: int) -> int:
    """The pages a planned step reads for rows of ``num_pages`` pages: the next of 4, 5, 6, 7, 8, 10, 12, 14, 16,
    20, ... (a power of two times 1, 1.25, 1.5 or 1.75), so that lengths in one bucket share a compiled graph and a
    step reads at most a quarter more than its rows hold."""
    num_pages = max(num_pages, 4)
    quarter = 1 << max(0, num_pages.bit_length() - 3)  # 2^(e - 2) for 2^e <= num_pages < 2^(e + 1)
    return -(-num_pages // quarter) * quarter
