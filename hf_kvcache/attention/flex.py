"""FlexAttention over a pool's pages, in place: a decode step reads each row's keys and values where they lie.

A layer's storage goes in as a view of its first pages, ``[1, num_kv_heads, num_pages * page_size, head_dim]``
(``block_mask.view_pages``: inductor's CPU kernel allocates scratch the size of its keys at every call), broadcast
over the query's rows, with a ``BlockMask`` built from the page tables (``PagedBlockMask``). A KV block is one
*extent* (its index is the extent id); ``full_kv_indices`` lists the extents whose pages are all the row's and wholly
visible, ``kv_indices`` the row's other extents, then fillers (extents other rows visit, hidden) so that every row has
the same counts (inductor's CPU decode kernel has a fast path only then).

``mask_mod`` is the whole truth, the block lists only an optimization: through ``page_position[row, page]`` (-1: not
this row's) it keeps ``pads[row] <= position < num_tokens`` (a window's: its last ``window`` tokens and its sinks). A
masked slot still enters the sums as ``0 x value``, so every page of a visited extent must be finite: the row's, other
live rows' (``PagePool.foreign_pages``) and free pages (zeros).

One compiled function per *shape key* (``dynamic=True`` does not compile this mask on CPU), each with its own code
object: dynamo counts ``recompile_limit`` per code object. Past ``MAX_SHAPE_KEYS``, or where compiling is impossible
(``unavailable``), callers gather (``attention.kernels``); while a shape compiles, other threads wait (``ForwardGate``).
"""

import contextlib
import logging
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from packaging.version import Version

from hf_kvcache.attention.block_mask import PagedBlockMask

logger = logging.getLogger("hf_kvcache")

MIN_TORCH = Version("2.13")
"""The oldest torch the in-place path is tested with; older ones take the gather path."""
MAX_SHAPE_KEYS = 32
"""Compiled shape keys per process; a new shape past them takes the gather path (each costs a compile)."""
Q_BLOCK = 128
"""Query rows per block: one block for a decode step's packed query rows (the queries per KV head)."""
MIN_IN_PLACE_TOKENS = 2048
"""Decode steps with fewer tokens over all rows (``batch x tokens``) gather: a compiled call's fixed cost over sdpa
is more than the copy it saves (docs/attention.md)."""
WINDOW_IN_PLACE_FACTOR = 8
"""A window's decode step reads in place only past this many times ``MIN_IN_PLACE_TOKENS``: its gather copies the
window alone (docs/benchmarks.md)."""


class FlexUnavailable(RuntimeError):
    """In-place attention cannot run for this call; the message says why (the caller gathers instead)."""


class ForwardGate:
    """Holds every other thread's ``nn.Module`` calls while this process compiles.

    While torch compiles, ``torch.compiler.is_compiling()`` is true in every thread, which breaks other threads'
    forwards (docs/attention.md). So a compile inside a request (``CompiledKernels.run``) closes the gate: a global
    forward pre-hook, installed for the compile only, makes every other thread wait at its next module call. Closing
    waits ``PAUSE_SECONDS`` first, so that a thread past the hook finishes setting its per-thread state. Reentrant in
    its thread (another thread that closes it waits); inside a graph dynamo traces the hook does nothing.
    """

    PAUSE_SECONDS = 0.02

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.owner: int | None = None  # the thread that closed the gate
        self.depth = 0
        self.handle: torch.utils.hooks.RemovableHandle | None = None
        self.waits = 0  # module calls held so far (a statistic for tests)

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        """Closes the gate for the block: other threads' module calls wait until it ends."""
        me = threading.get_ident()
        with self.condition:
            while self.owner not in (None, me):
                self.condition.wait()
            self.owner, self.depth = me, self.depth + 1
            first = self.depth == 1
            if first:
                self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._hold)
        if first:
            time.sleep(self.PAUSE_SECONDS)
        try:
            yield
        finally:
            with self.condition:
                self.depth -= 1
                if self.depth == 0:
                    self.handle.remove()
                    self.handle, self.owner = None, None
                    self.condition.notify_all()

    def _hold(self, module: torch.nn.Module, args: tuple) -> None:
        """The pre-hook: waits while another thread holds the gate closed."""
        if torch.compiler.is_dynamo_compiling() or self.owner in (None, threading.get_ident()):
            return
        with self.condition:
            self.waits += 1
            while self.owner not in (None, threading.get_ident()):
                self.condition.wait()


FORWARDS = ForwardGate()


class CompiledKernels:
    """What this process knows of compiled FlexAttention, behind one lock: each shape key's function (ready once its
    first call, the compile, succeeded; or why it failed), compile seconds, each device type's obstacle, the messages
    said once and the in-place calls made. One instance, ``KERNELS`` (tests swap in a fresh one)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.functions: dict[tuple, Callable[..., torch.Tensor]] = {}
        self.ready: set[tuple] = set()
        self.failed: dict[tuple, str] = {}
        self.seconds: dict[tuple, float] = {}
        self.obstacles: dict[str, str | None] = {}
        self.said: set[str] = set()
        self.calls = 0  # in-place calls (a statistic for benchmarks: the hot path takes no lock, a race may lose one)

    def run(self, shape_key: tuple, arguments: tuple) -> torch.Tensor:
        """Runs ``shape_key``'s function, compiled in its first call (under the lock; other threads held at
        ``FORWARDS``).

        Raises:
            FlexUnavailable: the shape failed to compile, or would be past ``MAX_SHAPE_KEYS``.
        """
        self.calls += 1
        if shape_key in self.ready:
            return self.functions[shape_key](*arguments)
        with self.lock:
            self._check(shape_key)
        with FORWARDS.closed(), self.lock:
            self._check(shape_key)
            started = time.perf_counter()
            try:
                if shape_key not in self.functions:
                    self.functions[shape_key] = _compile(len(self.functions))
                output = self.functions[shape_key](*arguments)
            except Exception as error:  # noqa: BLE001  (dynamo and inductor raise many kinds; any means: gather)
                self.failed[shape_key] = f"compiling FlexAttention failed ({type(error).__name__}: {error})"
                raise FlexUnavailable(self.failed[shape_key]) from error
            if shape_key not in self.ready:
                self.seconds[shape_key] = time.perf_counter() - started
                self.ready.add(shape_key)
                logger.info(
                    "Compiled in-place paged attention for %s in %.1f s.", shape_key[:3], self.seconds[shape_key]
                )
        return output

    def _check(self, shape_key: tuple) -> None:
        """Raises ``FlexUnavailable`` where ``shape_key`` failed to compile, or is new and past ``MAX_SHAPE_KEYS``
        (under the lock)."""
        if shape_key in self.failed:
            raise FlexUnavailable(self.failed[shape_key])
        if shape_key not in self.ready and len(self.ready) + len(self.failed) >= MAX_SHAPE_KEYS:
            raise FlexUnavailable(
                f"{MAX_SHAPE_KEYS} shapes are compiled already: every new shape gathers from here on (raise "
                "hf_kvcache.attention.flex.MAX_SHAPE_KEYS to compile more; each costs 10-20 s)"
            )


KERNELS = CompiledKernels()


def log_once(key: str, level: int, message: str) -> None:
    """Logs ``message`` on the ``hf_kvcache`` logger the first time ``key`` is seen in this process."""
    with KERNELS.lock:
        if key in KERNELS.said:
            return
        KERNELS.said.add(key)
    logger.log(level, message)


def log_path(key: str, why: str) -> None:
    """Says once per process (per ``key``) which path paged decode attention takes and why (``in_place*``: in place);
    a shape past ``MAX_SHAPE_KEYS``, a slowdown the user did not ask for, as a warning."""
    if key.startswith("in_place"):
        message = f"Paged decode attention reads the pool's pages in place ({why})."
    else:
        message = f"Paged decode attention gathers the pages instead of reading them in place: {why}."
    log_once(key, logging.WARNING if "MAX_SHAPE_KEYS" in why else logging.INFO, message)


def unavailable(device: torch.device) -> str | None:
    """Why compiled FlexAttention cannot run on ``device`` here (``None``: it can); checked once per device type."""
    with KERNELS.lock:
        if device.type not in KERNELS.obstacles:
            KERNELS.obstacles[device.type] = _find_obstacle(device.type)
        return KERNELS.obstacles[device.type]


def _find_obstacle(kind: str) -> str | None:
    if Version(torch.__version__.split("+")[0]) < MIN_TORCH:
        return f"torch {torch.__version__} is older than {MIN_TORCH}, the oldest release measured"
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
    return KERNELS.calls


def compile_seconds() -> dict[tuple, float]:
    """Seconds the first call (the compile) of each shape key took in this process."""
    with KERNELS.lock:
        return dict(KERNELS.seconds)


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
    window,
    sink_ends,
    page_size,
    block_tokens,
    scale,
):
    """FlexAttention over pages, its ``BlockMask`` built from plain tensors (what the compiled function guards on)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def mask_mod(b, h, q_idx, kv_idx):
        logical_page = page_position[b, kv_idx // page_size]
        position = logical_page * page_size + kv_idx % page_size
        in_window = (position >= num_tokens[0] - window[0]) | (position < sink_ends[b])
        return (logical_page >= 0) & (position >= pads[b]) & (position < num_tokens[0]) & in_window

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


def _compile(number: int) -> Callable[..., torch.Tensor]:
    """The ``number``-th shape key's compiled function, with its own code object (dynamo's cache is per code object)."""
    code = _paged_flex.__code__.replace(co_name=f"_paged_flex_{number}")
    fresh = types.FunctionType(code, _paged_flex.__globals__, code.co_name)
    return torch.compile(fresh, dynamic=False, fullgraph=True)


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: PagedBlockMask, scale: float | None
) -> torch.Tensor:
    """One decode step's attention in place, ``query [batch, num_heads, 1, head_dim]`` over one layer's storage
    ``keys`` / ``values``, its first ``mask.num_pages`` pages ``[1, num_kv_heads, num_pages * page_size, head_dim]``,
    with softmax ``scale`` (``None``: ``head_dim ** -0.5``): ``[batch, num_heads, 1, head_dim]``.

    Raises:
        FlexUnavailable: this shape cannot be compiled (here, or any more: ``MAX_SHAPE_KEYS``).
    """
    return _decode(query, keys, values, (*mask.tensors, mask.page_size, mask.block_tokens), scale)


def _decode(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, arguments: tuple, scale: float | None
) -> torch.Tensor:
    """``decode_attention`` with the mask as ``(*mask.tensors, page_size, block_tokens)``, ``_paged_flex``'s order."""
    batch, num_heads, _, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    # [batch, kv heads, queries per KV head, head_dim]
    packed = query.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
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
    if torch.is_grad_enabled():
        output = KERNELS.run(shape_key, (packed, keys, values, *arguments, scale))
    else:  # below autograd, as inside hf_kvcache::paged_decode: both paths meet one compiled graph's guards
        with torch._C._AutoDispatchBelowADInplaceOrView():
            output = KERNELS.run(shape_key, (packed, keys, values, *arguments, scale))
    return output.reshape(batch, num_heads, 1, head_dim)


def paged_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: Any, scale: float | None
) -> torch.Tensor | None:
    """A decode step's attention over pool pages in place, through its plan's mask (``StepPlan.mask``), shapes as
    ``decode_attention``; ``None`` where an eager step cannot run FlexAttention (attention gathers instead).

    A compiled step's (``plan.ahead``) is one opaque op, ``hf_kvcache::paged_decode``, which gathers the plan's pages
    itself where FlexAttention cannot compile: torch 2.13's CPU FlexAttention template, lowered inside a bigger
    graph, reads a view of a graph input at the input's start (docs/compiled.md)."""
    mask = plan.mask
    if plan.ahead:
        arguments = (*mask.tensors, plan.pages, mask.page_size, mask.block_tokens, scale)
        return torch.ops.hf_kvcache.paged_decode(query, keys, values, *arguments)
    try:
        output = decode_attention(query, keys, values, mask, scale)
    except FlexUnavailable as error:
        log_path(f"compile:{error}", str(error))
        return None
    log_path("in_place", f"compiled FlexAttention, KV blocks of {mask.block_tokens} tokens")
    return output


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
    window: torch.Tensor,
    sink_ends: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    block_tokens: int,
    scale: float | None,
) -> torch.Tensor:
    """``paged_attention``'s op: ``decode_attention`` over the mask's tensors, or the pages gathered."""
    arguments = (
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, page_position, pads, num_tokens, window,
        sink_ends, page_size, block_tokens,
    )  # fmt: skip
    try:
        return _decode(query, keys, values, arguments, scale).clone()
    except FlexUnavailable as error:
        log_path(f"compile:{error}", str(error))
    return gathered_decode(query, keys, values, pages, pads, num_tokens, page_size, scale)


def gathered_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pages: torch.Tensor,
    pads: torch.Tensor,
    num_tokens: torch.Tensor,
    page_size: int,
    scale: float | None,
) -> torch.Tensor:
    """A decode step's attention over each row's ``pages`` (``[batch, 1, capacity]``) gathered from one layer's
    storage, keys ``pads[row] <= position < num_tokens`` seen; shapes as ``decode_attention``. Its query
    heads are packed (``packed_decode_attention``): sdpa gets a mask and no ``enable_gqa``, which CUDA's fused kernels
    do not take together."""
    batch, num_heads, _, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    heads = torch.arange(num_kv_heads, device=keys.device).view(1, -1, 1)
    gathered = [
        tensor.view(num_kv_heads, -1, page_size, head_dim)[heads, pages].view(batch, num_kv_heads, -1, head_dim)
        for tensor in (keys, values)
    ]  # [batch, kv heads, capacity * page_size, head_dim] each
    positions = torch.arange(gathered[0].shape[2], device=keys.device)
    seen = (positions >= pads.view(-1, 1)) & (positions < num_tokens)  # [batch, keys]
    output = packed_decode_attention(query, *gathered, scale, seen[:, None, None, :])  # [batch, 1, heads, head_dim]
    return output.view(batch, num_heads, 1, head_dim)


def packed_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """A decode step's attention with the query heads of each KV head packed as query rows of it: ``[batch, 1, heads,
    head_dim]`` (transformers' attention output layout).

    Torch's grouped path (``enable_gqa``, unmasked) reads a KV head's keys and values once per query head on CPU, and
    transformers' sdpa under a mask in a compiled graph repeats them per query head; packed, they are read once per KV
    head and the token's mask serves every row. The same sums in another order: equal to float rounding.

    Args:
        query: ``[batch, heads, 1, head_dim]``. key, value: ``[batch, kv_heads, n, head_dim]``.
        attention_mask: ``None``, or the token's ``[batch or 1, 1, 1, >= n]`` mask (boolean, or additive floats).
    """
    batch, heads, _, head_dim = query.shape
    # [batch, kv_heads, queries per KV head, head_dim], in and out
    packed = query.reshape(batch, key.shape[1], heads // key.shape[1], head_dim)
    if attention_mask is not None:
        attention_mask = attention_mask[..., : key.shape[2]]  # [batch or 1, 1, 1, n]: broadcast over the rows
    output = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return output.reshape(batch, 1, heads, head_dim)


@_paged_decode.register_fake
def _(query, *args) -> torch.Tensor:
    return torch.empty_like(query)
