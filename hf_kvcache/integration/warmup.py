"""Compiles ahead of traffic: ``warmup`` runs, once, the decode shapes a serving loop will meet, so that no request
pays a compile or a CUDA graph recording, and no compile runs while other threads serve (``flex.ForwardGate``).

A compiled decode step's shape is its batch and the keys it reads per row: a capacity bucket of pages for growing
layers, a window's ``sink_tokens + window``. A step that reads pages in place also has the view of the pool's
storage attention gets (``block_mask.view_pages``), which other requests' pages push to larger views: ``warmup`` runs
those too. Use the requests' ``compile_config``: ``generate`` compiles again when it changes.
"""

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo
from transformers import CompileConfig, StoppingCriteria, StoppingCriteriaList

from hf_kvcache.attention import block_mask, flex
from hf_kvcache.caches.binder import release_deferred
from hf_kvcache.caches.config import PagedConfig
from hf_kvcache.errors import PoolExhaustedError
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.layers.plan import capacity_bucket
from hf_kvcache.memory.page_pool import PagePool
from hf_kvcache.memory.pools import pool_parts

logger = logging.getLogger("hf_kvcache")


@dataclass(frozen=True)
class WarmedShape:
    """One decode shape ``warmup`` ran: its ``batch_size``, the tokens a row was planned to reach (``max_tokens``,
    the bucket's last), the ``seconds`` its generation took, the ``graphs`` dynamo compiled during it (0: an earlier
    one served), the ``held_pages`` held below its rows, and its ``in_place_calls`` of in-place attention."""

    batch_size: int
    max_tokens: int
    seconds: float
    graphs: int
    held_pages: int = 0
    in_place_calls: int = 0


class _StopAfter(StoppingCriteria):
    """Stops every row once it holds ``length`` tokens."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)


def warmup_lengths(max_tokens: int, page_size: int, prompt_tokens: int) -> list[int]:
    """The last token count of each capacity bucket a request of ``prompt_tokens`` to ``max_tokens`` tokens meets."""
    first = capacity_bucket(-(-(prompt_tokens + 2) // page_size))
    last = capacity_bucket(-(-max_tokens // page_size))
    buckets = sorted({capacity_bucket(pages) for pages in range(first, last + 1)})
    return [pages * page_size for pages in buckets]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_arguments(
    model: Any, cache_implementation: Any, batch_sizes: Any, max_tokens: Any, compile_config: Any, prompt_tokens: Any
) -> None:
    """Checks ``warmup``'s arguments before any work, raising ``TypeError`` / ``ValueError`` that name the argument,
    its value and what is allowed."""
    if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "generate", None)):
        raise TypeError(f"model={type(model).__name__}: give the transformers model requests will run (with generate).")
    if not isinstance(cache_implementation, str):
        raise TypeError(
            f"cache_implementation={cache_implementation!r}: give one of our cache names, {sorted(REGISTRY)}."
        )
    if cache_implementation not in REGISTRY:
        raise ValueError(f"cache_implementation={cache_implementation!r} is not one of ours: {sorted(REGISTRY)}.")
    if not isinstance(batch_sizes, (tuple, list)) or not all(_is_int(size) for size in batch_sizes):
        raise TypeError(f"batch_sizes={batch_sizes!r}: give a tuple or list of ints, such as (1, 2, 4).")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes={batch_sizes!r}: give one or more batch sizes of 1 or more.")
    if not _is_int(prompt_tokens):
        raise TypeError(f"prompt_tokens={prompt_tokens!r}: give an int of 1 or more.")
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens!r}: give an int of 1 or more.")
    if not _is_int(max_tokens):
        raise TypeError(f"max_tokens={max_tokens!r}: give an int of at least prompt_tokens + 2 ({prompt_tokens + 2}).")
    if max_tokens < prompt_tokens + 2:
        raise ValueError(
            f"max_tokens={max_tokens!r} leaves no room for two new tokens after prompt_tokens={prompt_tokens}: give "
            f"at least {prompt_tokens + 2}."
        )
    if compile_config is not None and not isinstance(compile_config, CompileConfig):
        raise TypeError(f"compile_config={compile_config!r}: give a transformers.CompileConfig, or None.")


def warmup(
    model: Any,
    cache_implementation: str,
    batch_sizes: tuple[int, ...] = (1,),
    max_tokens: int = 2048,
    cache_config: PagedConfig | dict[str, Any] | None = None,
    compile_config: CompileConfig | None = None,
    prompt_tokens: int = 8,
) -> list[WarmedShape]:
    """Compiles, before any request, the decode steps of ``cache_implementation`` for every batch size and capacity
    bucket up to ``max_tokens``, and the in-place attention kernels of every view of a shared pool: a short
    ``generate`` per shape (two new tokens), one ``WarmedShape`` each, in the order run. With a ``compile_config``,
    the steps ``generate`` compiles; without one, the eager steps that read pages in place.

    Args:
        batch_sizes: the batch sizes requests will run (rows: batch x beams or returned sequences).
        max_tokens: the most tokens a row of a request may hold (prompt + ``max_new_tokens``).
        cache_config / compile_config: those the requests will pass to ``generate``.
        prompt_tokens: the prompt of each warm-up generation (random token ids).

    Raises:
        TypeError / ValueError: a bad argument, named, before any work; or nothing to compile (``generate`` would
            not compile this cache here, or no step reads pages in place), saying what to change.
    """
    _check_arguments(model, cache_implementation, batch_sizes, max_tokens, compile_config, prompt_tokens)
    cache_config = REGISTRY[cache_implementation].config(cache_config or {})  # checked before any work
    page_size = cache_config.page_size
    run = functools.partial(_generate, model, cache_implementation, cache_config, compile_config)
    shapes: list[WarmedShape] = []
    for batch_size in batch_sizes:
        if compile_config is not None:
            lengths = warmup_lengths(max_tokens, page_size, prompt_tokens)
            prompt = prompt_tokens
        else:  # an eager step reads in place from MIN_IN_PLACE_TOKENS over its rows (its tokens decide)
            prompt = max(prompt_tokens, -(-flex.MIN_IN_PLACE_TOKENS // batch_size))
            lengths = [prompt + 2] if prompt + 1 <= max_tokens else []  # its first decode step holds prompt + 1
        views_done = False
        for length in lengths:
            shape, out = run(batch_size, prompt, length)
            if compile_config is not None and not out.cache.compiled_decoding:
                raise ValueError(
                    f"generate does not compile {cache_implementation} here (is_compileable="
                    f"{out.cache.is_compileable}, device {model.device}): on a CPU pass a compile_config with "
                    "_compile_all_devices = True."
                )
            pool = out.cache.pool
            del out
            release_deferred()  # the pages of the cache the compile traced, before the next shape or request
            shapes.append(shape)
            if shape.in_place_calls and not views_done and _shares_pool(cache_config) and pool is not None:
                # The first shape read in place: the same in each larger view of each part's storage.
                shapes += _warm_views(run, [part.pages for part in pool_parts(pool)], batch_size, prompt, length)
                views_done = True
    if compile_config is None and not any(shape.in_place_calls for shape in shapes):
        raise ValueError(
            f"no eager step of {cache_implementation} reads pages in place here, so there is nothing to compile "
            "without a compile_config (in-place reads need attn_implementation='hf_kvcache', "
            f"{flex.MIN_IN_PLACE_TOKENS} tokens over a step's rows within max_tokens={max_tokens}, full-precision "
            "keys and a device that compiles FlexAttention). To warm generate's compiled steps, pass the "
            "compile_config the requests will pass (on a CPU, one with _compile_all_devices = True)."
        )
    return shapes


def _shares_pool(cache_config: PagedConfig) -> bool:
    """Whether requests write to one pool, where other requests' pages may lie below theirs (not with ``max_tokens``
    and no prefix caching: each cache then makes a pool of its own)."""
    return cache_config.max_tokens is None or bool(cache_config.prefix_caching)


def _warm_views(run: Callable, pools: list[PagePool], batch_size: int, prompt: int, length: int) -> list[WarmedShape]:
    """Runs a generation of ``batch_size`` rows of ``length`` tokens whose pages lie in each larger view of the
    storage in-place attention may read (``block_mask.view_pages``), the pages below held as other requests would.
    ``pools``: the pool of each geometry (``KVPoolSet.parts``), whose views grow together; a part whose views are all
    run stays in its largest."""
    starts = [_view_starts(pool) for pool in pools]
    shapes = []
    for step in range(max(map(len, starts))):
        firsts = [views[min(step, len(views) - 1)] if views else None for views in starts]
        held = [[] if first is None else _hold_extents_below(pool, first) for pool, first in zip(pools, firsts)]
        try:
            shape, out = run(batch_size, prompt, length, held_pages=sum(map(len, held)))
            del out
        finally:
            for pool, pages in zip(pools, held):
                pool.free(pages)
        release_deferred()
        shapes.append(shape)
    return shapes


def _view_starts(pool: PagePool) -> list[int]:
    """The first page of each view of ``pool``'s storage larger than the smallest (``block_mask.view_pages``)."""
    starts, view = [], pool.format.extent_pages * block_mask.MIN_VIEW_EXTENTS
    while view < pool.storage.num_pages:
        starts.append(view)
        view *= 2
    return starts


def _hold_extents_below(pool: PagePool, first_page: int) -> list[int]:
    """Takes the pool's wholly free extents below ``first_page``, lowest first, so that the next rows start at
    ``first_page`` or above (where the pool has room). Returns the pages."""
    held: list[int] = []
    try:
        while True:
            pages = pool.extend(None, pool.format.extent_pages)
            if pages[0] >= first_page:
                pool.free(pages)
                return held
            held += pages
    except PoolExhaustedError:
        return held


def _generate(
    model: Any,
    cache_implementation: str,
    cache_config: PagedConfig,
    compile_config: CompileConfig | None,
    batch_size: int,
    prompt_tokens: int,
    length: int,
    held_pages: int = 0,
) -> tuple[WarmedShape, Any]:
    """One warm-up generation: ``batch_size`` rows of ``prompt_tokens`` random tokens planned to reach ``length``
    tokens (the bucket), stopped two tokens in; its shape, logged, and ``generate``'s output."""
    generator = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(model.config.vocab_size, (batch_size, prompt_tokens), generator=generator).to(model.device)
    graphs, calls = torch._dynamo.utils.counters["stats"]["unique_graphs"], flex.call_count()
    started = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=length - prompt_tokens + 1,  # plans rows of `length` tokens: the bucket
        stopping_criteria=StoppingCriteriaList([_StopAfter(prompt_tokens + 2)]),
        cache_implementation=cache_implementation,
        cache_config=cache_config,
        compile_config=compile_config,
        return_dict_in_generate=True,
    )
    seconds = time.perf_counter() - started
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    shape = WarmedShape(batch_size, length, seconds, graphs, held_pages, flex.call_count() - calls)
    logger.info(
        "warmup %s: batch %d, rows up to %d tokens, %d pages held below them: %.1f s, %d graph(s), %d in-place calls",
        *(cache_implementation, batch_size, length, held_pages, seconds, graphs, shape.in_place_calls),
    )
    return shape, out
