"""FlexAttention over a pool's pages, in place: a decode step reads each row's keys and values where they lie.

A layer's storage goes to ``flex_attention`` in place, its first pages viewed as ``[1, num_kv_heads, num_pages *
page_size, head_dim]`` (one batch row, broadcast over the query's rows; ``view_pages`` below). What each query row
may see is a ``BlockMask`` built from the page tables directly (no ``create_block_mask``):

- a KV block is one *extent* of ``extent_pages`` pages (``KV_BLOCK_TOKENS`` = 128 tokens; the allocator places
  each row's pages in aligned extents), so a block's index is its extent id;
- ``full_kv_indices``: extents all of whose pages are the row's and wholly visible (``mask_mod`` not evaluated:
  the order of the pages inside does not matter, attention does not depend on the keys' order);
- ``kv_indices``: the row's other extents (the first, after left padding; the last, partly filled; extents
  that also hold other rows' pages), then fillers, so that every row has the same counts (inductor's CPU decode
  kernel has a fast path only then: 2.6x faster at 4,096 x 8): fillers are extents the other rows of the step
  visit, which ``mask_mod`` hides entirely for this row.

``mask_mod`` is the whole truth, the block lists only an optimization (uncompiled flex ignores them): it maps a
physical slot to its row's logical position through ``page_position[row, page]`` (-1: not this row's page) and
keeps ``pad[row] <= position < num_tokens``. A masked slot still enters the kernel's sums as ``0 x value``, so
everything in the blocks a row visits must be finite: the row's pages, other live rows' pages (the caller checks
they are its own rows', ``KVPool.foreign_pages``) and free pages (all zeros, ``hf_kvcache.pool``).

GQA is packed: the ``group`` query heads of a KV head become ``group`` query rows of it, so every page is read
once per KV head and the kernel's products get ``group`` rows (1.7x faster than flex's own ``enable_gqa``).

The keys and values go in as a view of the storage's first pages only, as many as the step's pages need
rounded up to a power of two extents (``view_pages``): inductor's CPU kernel allocates two scratch buffers the size
of its whole key sequence at every call (unused in fp32), which over a default pool's reserved cap (17,144 pages
for SmolLM2 here) cost 0.05-0.16 ms per call more than over the 640 pages the rows of a 1,024 x 8 step use.

Compiling: ``torch.compile(dynamic=False, fullgraph=True)`` (``dynamic=True`` does not compile this mask on CPU).
The mask's tensors are allocated once per view size and refilled in place, so rows that grow recompile only when
their pages pass a power of two: one compile per *shape key* (batch, view pages, heads, dtype, page geometry,
softmax scale, threads, grad mode), paid once per process (about 15 s cold on a 2-core CPU, 1 s with inductor's
on-disk cache warm). Each key gets its own compiled function with its own code object: dynamo counts
``recompile_limit`` (8) per code object and past it silently runs flex uncompiled, 100x slower over the whole pool.
Past ``MAX_SHAPE_KEYS`` keys, or where compiling is impossible (``unavailable``), callers take the gather path
(``hf_kvcache.kernels``), the slow twin this is tested against.
"""

import logging
import threading
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from packaging.version import Version

logger = logging.getLogger("hf_kvcache")

MIN_TORCH = Version("2.13")
"""The oldest torch this was measured and tested with; older ones take the gather path."""
MAX_SHAPE_KEYS = 32
"""Compiled shape keys per process; a new shape past them takes the gather path (each costs a compile)."""
Q_BLOCK = 128
"""Query rows per block: one block for a decode step's packed query rows (``group`` of them)."""
MIN_IN_PLACE_TOKENS = 2048
"""Decode steps with fewer tokens than this over all rows (``batch x tokens``) gather instead: a compiled call
costs a fixed 0.1-0.25 ms more than sdpa on this CPU, which the copy it saves repays only past about 1-2k tokens
(SmolLM2, whole model, 1 thread: in place 0.97x ``DynamicCache`` at 1,024 x 1, 1.22x at 1,024 x 8)."""

MIN_VIEW_EXTENTS = 32
"""The smallest view of a storage that in-place attention gets, in extents (4,096 tokens of 16-token pages): fewer
view sizes, fewer compiles."""

_LOCK = threading.Lock()
_COMPILED: dict[tuple, Callable[..., torch.Tensor]] = {}
_READY: set[tuple] = set()  # keys whose first call (the compile) succeeded
_FAILED: dict[tuple, str] = {}
_COMPILE_SECONDS: dict[tuple, float] = {}
_UNAVAILABLE: dict[str, str | None] = {}
_LOGGED: set[str] = set()
_CALLS = [0]  # in-place attention calls in this process (benchmarks report the path each row took)


class FlexUnavailable(RuntimeError):
    """In-place attention cannot run for this call; ``reason`` says why (the caller gathers instead)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def log_once(key: str, level: int, message: str) -> None:
    """Logs ``message`` on the ``hf_kvcache`` logger the first time ``key`` is seen in this process."""
    with _LOCK:
        if key in _LOGGED:
            return
        _LOGGED.add(key)
    logger.log(level, message)


def log_path(key: str, why: str, level: int = logging.INFO) -> None:
    """Says once per process (per ``key``) which path paged decode attention takes and why (``in_place*``: in place)."""
    if key.startswith("in_place"):
        message = f"Paged decode attention reads the pool's pages in place ({why})."
    else:
        message = f"Paged decode attention gathers the pages instead of reading them in place: {why}."
    log_once(key, level, message)


def unavailable(device: torch.device) -> str | None:
    """Why compiled FlexAttention cannot run on ``device`` here (``None``: it can); checked once per device type."""
    kind = device.type
    if kind not in _UNAVAILABLE:
        _UNAVAILABLE[kind] = _find_obstacle(kind)
    return _UNAVAILABLE[kind]


def _find_obstacle(kind: str) -> str | None:
    if Version(torch.__version__.split("+")[0]) < MIN_TORCH:
        return f"torch {torch.__version__} is older than {MIN_TORCH}, the oldest release measured"
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError as error:
        return f"this torch has no FlexAttention ({error})"
    if kind == "cpu":
        try:  # torch internals: inductor's own checks for its CPU flex kernel and C++ toolchain
            from torch._inductor.cpp_builder import get_cpp_compiler
            from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

            if not check_cpu_supported():
                return "inductor's CPU FlexAttention kernel does not support this CPU (it needs AVX2; not on macOS)"
            get_cpp_compiler()
        except (ImportError, AttributeError):
            return None  # the checks moved: try compiling, and fall back if that fails
        except (RuntimeError, OSError) as error:
            return f"torch.compile needs a C++ compiler on the CPU ({error})"
    elif kind == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "torch.compile needs Triton on CUDA"
    else:
        return f"compiled FlexAttention is not supported on {kind}"
    return None


def call_count() -> int:
    """In-place attention calls made in this process so far."""
    return _CALLS[0]


def compile_seconds() -> dict[tuple, float]:
    """Seconds the first call (the compile) of each shape key took in this process."""
    return dict(_COMPILE_SECONDS)


def view_pages(num_used: int, extent_pages: int, storage_pages: int) -> int:
    """Page ids ``[0, n)`` of a storage that in-place attention reads: the first ``num_used`` ones, rounded up to a
    power of two extents (at least ``MIN_VIEW_EXTENTS``), at most the storage's ``storage_pages``."""
    num_extents = max(MIN_VIEW_EXTENTS, -(-num_used // extent_pages))
    return min(storage_pages, extent_pages << (num_extents - 1).bit_length())


def _paged_flex(
    query,
    key,
    value,
    kv_num_blocks,
    kv_indices,
    full_kv_num_blocks,
    full_kv_indices,
    page_position,
    pads,
    num_tokens,
    page_size,
    block_tokens,
    scale,
):
    """FlexAttention over pages, its ``BlockMask`` built from plain tensors (what the compiled function guards on)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def mask_mod(b, h, q_idx, kv_idx):
        logical_page = page_position[b, kv_idx // page_size]
        position = logical_page * page_size + kv_idx % page_size
        return (logical_page >= 0) & (position >= pads[b]) & (position < num_tokens[0])

    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        BLOCK_SIZE=(Q_BLOCK, block_tokens),
        mask_mod=mask_mod,
        seq_lengths=(query.shape[2], key.shape[2]),
        compute_q_blocks=False,  # the backward pass's lists: inference only
    )
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale)


def _compile() -> Callable[..., torch.Tensor]:
    """A new shape key's compiled function: a fresh function object with its own code object (dynamo's cache of
    compiled graphs is per code object)."""
    code = _paged_flex.__code__.replace(co_name=f"_paged_flex_{len(_COMPILED)}")
    fresh = types.FunctionType(code, _paged_flex.__globals__, code.co_name)
    return torch.compile(fresh, dynamic=False, fullgraph=True)


class PagedBlockMask:
    """A ``BlockMask`` over a pool's storage for ``batch`` rows of one layer group, one decode token each.

    Args:
        batch: rows (the query's batch).
        num_pages: page ids of the storage's view that attention gets (``view_pages``, a multiple of
            ``extent_pages``): every page of the rows is below it.
        page_size / extent_pages: the pool's page geometry; a KV block is one extent.
        group: query heads per KV head (the packed query rows of a decode step).
        device: the pool's device.

    ``update(...)`` refills it in place from a page table, ``advance(...)`` moves it one token on; ``arguments``
    (the same tensors every time) then serve every layer of the layer group for the step. The compiled function
    builds the ``BlockMask`` from them: dynamo then guards on a few tensors, not on a ``BlockMask`` and the closure of
    its ``mask_mod`` (about 0.05 ms less per call at 4,096 x 1 on this CPU, 1 thread: 572 vs 630 us, medians of
    1,500 interleaved calls).
    """

    def __init__(
        self, batch: int, num_pages: int, page_size: int, extent_pages: int, group: int, device: torch.device
    ) -> None:
        self.batch, self.num_pages, self.page_size, self.extent_pages, self.group = (
            batch,
            num_pages,
            page_size,
            extent_pages,
            group,
        )
        num_extents = num_pages // extent_pages
        # Every list holds up to all extents: inductor asserts num_pages * page_size <= capacity * block size.
        as_int = {"dtype": torch.int32, "device": device}
        self.kv_num_blocks = torch.zeros(batch, 1, 1, **as_int)  # [batch, heads=1, q blocks=1]
        self.kv_indices = torch.zeros(batch, 1, 1, num_extents, **as_int)  # [batch, 1, 1, extents]
        self.full_kv_num_blocks = torch.zeros(batch, 1, 1, **as_int)
        self.full_kv_indices = torch.zeros(batch, 1, 1, num_extents, **as_int)
        self.page_position = torch.full((batch, num_pages), -1, **as_int)  # [batch, pages]: logical page, or -1
        self.pads = torch.zeros(batch, dtype=torch.int64, device=device)  # [batch] leading padding tokens
        self.num_tokens = torch.zeros(1, dtype=torch.int64, device=device)  # [1] tokens per row, the new one included
        for tensor in self.tensors:  # refilled in place: a compiled step (planned_attention) reads them where they lie
            torch._dynamo.mark_static_address(tensor)  # CUDA graphs replay over them
            torch._dynamo.mark_static(tensor)  # a shape of the graph: another mask is another graph, never dynamic

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The mask's tensors."""
        return (
            self.kv_num_blocks,
            self.kv_indices,
            self.full_kv_num_blocks,
            self.full_kv_indices,
            self.page_position,
            self.pads,
            self.num_tokens,
        )

    @property
    def block_tokens(self) -> int:
        """Tokens per KV block: one extent."""
        return self.extent_pages * self.page_size

    @property
    def arguments(self) -> tuple[torch.Tensor | int, ...]:
        """What ``_paged_flex`` takes after the query, keys and values (and before the scale)."""
        return (*self.tensors, self.page_size, self.block_tokens)

    @torch.no_grad()
    def update(self, page_ids: torch.Tensor, num_tokens: int, pads: torch.Tensor) -> list[int]:
        """Refills the mask from the rows' page table.

        Args:
            page_ids: ``[batch, n]`` each row's pages in logical order, ``n = ceil(num_tokens / page_size)``.
            num_tokens: tokens every row holds, the step's new one included.
            pads: ``[batch]`` leading padding tokens of each row (hidden).

        Returns:
            The extents the step visits (some row's pages, or fillers), for ``KVPool.foreign_pages``.
        """
        batch, n = page_ids.shape
        size, device = self.extent_pages, page_ids.device
        first = torch.arange(n, device=device) * self.page_size  # [n] first position of each logical page
        pads = pads.to(device=device, dtype=torch.long).view(-1, 1)  # [batch, 1]
        seen_any = first + self.page_size > pads  # [batch, n]: some slot visible (all pages hold tokens)
        seen_all = (first >= pads) & (first + self.page_size <= num_tokens)  # [batch, n]: every slot visible
        extents, inverse = torch.unique(page_ids // size, return_inverse=True)  # [u], [batch, n]
        any_count = torch.zeros(batch, extents.numel(), dtype=torch.int32, device=device)  # [batch, u]
        any_count.scatter_add_(1, inverse, seen_any.int())
        all_count = torch.zeros_like(any_count).scatter_add_(1, inverse, seen_all.int())
        full = all_count == size  # [batch, u]: all the extent's pages are the row's, wholly visible
        partial = (any_count > 0) & ~full
        # Equal counts for every row: keep the fewest rows' number of full extents, the rest become partial.
        num_full = int(full.sum(1).min())
        kept = full & (full.cumsum(1) <= num_full)
        partial |= full & ~kept
        # Partial extents first, then fillers (extents of other rows, hidden), the row's full extents last.
        rank = torch.where(partial, 0, torch.where(kept, 2, 1)).to(torch.int8)
        order = torch.sort(rank, dim=1, stable=True).indices  # [batch, u]
        full_order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices
        u = extents.numel()
        self.kv_num_blocks.fill_(int(partial.sum(1).max()))
        self.kv_indices[:, 0, 0, :u] = extents[order].to(torch.int32)
        self.full_kv_num_blocks.fill_(num_full)
        self.full_kv_indices[:, 0, 0, :u] = extents[full_order].to(torch.int32)
        self.page_position.fill_(-1)
        logical = torch.arange(n, dtype=torch.int32, device=device).expand(batch, n)
        self.page_position.scatter_(1, page_ids, logical)
        self.pads.copy_(pads.view(-1))
        self.num_tokens.fill_(num_tokens)
        return extents.tolist()

    def advance(self, num_tokens: int) -> None:
        """One more token per row in the rows' last pages, nothing else changed: only the end moves (the last page
        is in a partial block, where ``mask_mod`` bounds what is seen)."""
        self.num_tokens.fill_(num_tokens)


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: PagedBlockMask, scale: float | None
) -> torch.Tensor:
    """One decode step's attention over pool pages in place.

    Args:
        query: ``[batch, num_heads, 1, head_dim]``.
        keys / values: one layer's storage, its first ``mask.num_pages`` pages ``[1, num_kv_heads, num_pages *
            page_size, head_dim]``.
        mask: the step's mask, built for ``num_heads // num_kv_heads`` packed rows.
        scale: the softmax scale (``None``: ``head_dim ** -0.5``).

    Returns:
        ``[batch, num_heads, 1, head_dim]``.

    Raises:
        FlexUnavailable: this shape cannot be compiled (here, or any more: ``MAX_SHAPE_KEYS``).
    """
    return _decode(query, keys, values, mask.arguments, scale)


def _decode(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, arguments: tuple, scale: float | None
) -> torch.Tensor:
    """``decode_attention`` with the mask as ``PagedBlockMask.arguments``."""
    batch, num_heads, _, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    packed = query.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [batch, kv heads, group, hd]
    kv_indices, page_size, block_tokens = arguments[1], arguments[-2], arguments[-1]
    shape_key = (
        tuple(packed.shape),
        tuple(keys.shape),
        tuple(values.shape),
        packed.dtype,
        keys.dtype,
        values.dtype,
        str(keys.device),
        tuple(keys.stride()),
        tuple(values.stride()),
        tuple(kv_indices.shape),
        page_size,
        block_tokens,
        scale,
        torch.get_num_threads(),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
    )
    _CALLS[0] += 1
    arguments = (packed, keys, values, *arguments, scale)
    output = _COMPILED[shape_key](*arguments) if shape_key in _READY else _first_call(shape_key, arguments)
    return output.reshape(batch, num_heads, 1, head_dim)


def planned_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: PagedBlockMask,
    pages: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """A planned decode step's attention over pool pages in place (``StepPlan.mask``), shapes as
    ``decode_attention``; ``pages`` (``StepPlan.pages``, ``[batch, 1, capacity]``) serve a step that cannot run
    FlexAttention (``FlexUnavailable``), gathered.

    Inside a graph being compiled (``generate``'s) this is one opaque op (``hf_kvcache::paged_decode``) that calls
    the compiled ``decode_attention`` when the graph runs: torch 2.13's CPU FlexAttention template, lowered inside a
    bigger graph, reads a view of a graph input at the input's start (a layer's pages of the pool's storage came out
    as the first layer's) and a query that is a view of another shape with that buffer's strides (pytorch#157612,
    fixed after 2.13 by copying such inputs, which here would copy the pool every step)."""
    arguments = (*mask.tensors, pages, mask.page_size, mask.block_tokens, scale)
    return torch.ops.hf_kvcache.paged_decode(query, keys, values, *arguments)


@torch.library.custom_op("hf_kvcache::paged_decode", mutates_args=())
def _paged_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    full_kv_num_blocks: torch.Tensor,
    full_kv_indices: torch.Tensor,
    page_position: torch.Tensor,
    pads: torch.Tensor,
    num_tokens: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    block_tokens: int,
    scale: float | None,
) -> torch.Tensor:
    """``planned_attention``'s op: ``decode_attention`` over the mask's tensors, or the pages gathered."""
    arguments = (
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, page_position, pads, num_tokens,
        page_size, block_tokens,
    )  # fmt: skip
    try:
        return _decode(query, keys, values, arguments, scale).clone()
    except FlexUnavailable as error:
        limit = "MAX_SHAPE_KEYS" in error.reason
        log_path(f"compile:{error.reason}", error.reason, logging.WARNING if limit else logging.INFO)
    batch, num_heads, _, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    heads = torch.arange(num_kv_heads, device=keys.device).view(1, -1, 1)
    gathered = [
        tensor.view(num_kv_heads, -1, page_size, head_dim)[heads, pages].view(batch, num_kv_heads, -1, head_dim)
        for tensor in (keys, values)
    ]  # [batch, kv heads, capacity * page_size, head_dim] each
    positions = torch.arange(gathered[0].shape[2], device=keys.device)
    seen = (positions >= pads.view(-1, 1)) & (positions < num_tokens)  # [batch, keys]
    return F.scaled_dot_product_attention(
        query, *gathered, attn_mask=seen[:, None, None, :], scale=scale, enable_gqa=num_heads != num_kv_heads
    )


@_paged_decode.register_fake
def _(query, *args) -> torch.Tensor:
    return torch.empty_like(query)


def _first_call(shape_key: tuple, arguments: tuple) -> torch.Tensor:
    """Compiles and runs a new shape key, once per process (under a lock: threads wait for one compile)."""
    with _LOCK:
        if shape_key in _FAILED:
            raise FlexUnavailable(_FAILED[shape_key])
        if shape_key not in _READY and len(_READY) + len(_FAILED) >= MAX_SHAPE_KEYS:
            raise FlexUnavailable(
                f"{MAX_SHAPE_KEYS} shapes are compiled already: every new shape gathers from here on (raise "
                "hf_kvcache.flex.MAX_SHAPE_KEYS to compile more; each costs 10-20 s)"
            )
        started = time.perf_counter()
        try:
            if shape_key not in _COMPILED:
                _COMPILED[shape_key] = _compile()
            output = _COMPILED[shape_key](*arguments)
        except Exception as error:  # noqa: BLE001  (dynamo and inductor raise many kinds; any means: gather)
            _FAILED[shape_key] = f"compiling FlexAttention failed ({type(error).__name__}: {error})"
            raise FlexUnavailable(_FAILED[shape_key]) from error
        if shape_key not in _READY:
            _COMPILE_SECONDS[shape_key] = time.perf_counter() - started
            _READY.add(shape_key)
            logger.info(
                "Compiled in-place paged attention for %s in %.1f s.", shape_key[:3], _COMPILE_SECONDS[shape_key]
            )
    return output
