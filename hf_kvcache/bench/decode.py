"""Decode benchmark: time one-token decode steps of a model on each cache under test.

For every prompt length and batch size the prompt rows are consecutive, non-overlapping slices of one
token stream (real text for the bundled model: ``hf_kvcache.bench.prompts``), exactly ``length`` tokens each, no
padding. The rows of one length are
prefilled once, row by row, with a ``DynamicCache``; every batch size of that length reuses the first
``batch`` rows. Each cache under test is then brought to the same state by feeding the prefilled
keys/values through ``cache.update(keys, values, layer_idx)``, which costs a copy, not a forward pass.

One run of a cache: ``warmup_steps`` untimed decode steps, then ``steps`` timed ones, one token per
row, greedy. Runs are interleaved across caches (``A B C A B C ...``) so slow drifts of the machine hit
every cache alike. Reported per cache: the median step time over all timed steps of all rounds,
tokens/s (``batch / median step time``), the ratio to ``DynamicCache``'s tokens/s measured in the same
invocation, KV bytes held and per token of context, peak memory growth over the timed loop, and whether its
greedy tokens equal its reference's.

The caches and how each is built are in ``hf_kvcache.bench.catalogue``. The sliding-window caches
(``SLIDING_CACHES``) keep the last ``window``
tokens, so their tokens are checked against ``dynamic_sliding``'s and their tokens/s is also given as a
ratio to its; every prompt is at least ``window`` tokens long, so the window is full from the first step.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` above the allocation at the start of the timed
loop; on CPU the highest resident set size (RSS) a sampling thread saw, above the RSS at the start. RSS
growth is a lower bound of what was allocated: memory that the C allocator kept from earlier runs is
reused without growing RSS. For the same reason timings on CPU depend a little on the process's history:
``DynamicCache`` allocates a new, larger tensor per layer per step, and a round whose buffers land on memory
not touched before pays page faults; ``round_median_step_ms`` shows such a round.
"""

import contextlib
import dataclasses
import gc
import logging
import math
import time
import warnings

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import model_attention
from hf_kvcache.bench import measure
from hf_kvcache.bench.catalogue import (
    BASELINE,
    CACHE_ATTENTION,
    bench_pools,
    build_cache,
    interleaved_extents,
    pool_kind,
)
from hf_kvcache.bench.decode_report import DecodeBenchConfig, DecodeResult, DecodeRun, summarize
from hf_kvcache.bench.measure import OtherCpuUse, PeakMemory
from hf_kvcache.bench.prompts import Prefill, prefill_rows
from hf_kvcache.caches.base import PoolCache
from hf_kvcache.eval import kv_bytes

logger = logging.getLogger("hf_kvcache.bench")


def run_decode_benchmark(
    model: PreTrainedModel, token_stream: torch.Tensor, config: DecodeBenchConfig
) -> list[DecodeResult]:
    """Measures every cache of ``config`` at every (length, batch).

    Args:
        model: a decoder-only causal LM with full attention in every layer, in eval mode.
        token_stream: ``[num_tokens]`` ids; row ``r`` of length ``L`` is ``token_stream[r * L:(r + 1) * L]``,
            so it needs ``max(batches) * max(lengths)`` tokens.
        config: what to measure.

    Returns:
        One ``DecodeResult`` per (length, batch, cache), in that nesting order.

    Raises:
        ValueError: the stream is too short, or the model has sliding-window layers (their caches would
            drop prefilled tokens).
    """
    num_rows = max(config.batches)
    needed = num_rows * max(config.lengths)
    if token_stream.ndim != 1 or token_stream.numel() < needed:
        raise ValueError(
            f"token_stream must be 1-D with at least max(batches) * max(lengths) = {needed} tokens, "
            f"got shape {tuple(token_stream.shape)}; lower the lengths or batches."
        )
    if any(DynamicCache(config=model.config).is_sliding):
        raise ValueError(
            f"{type(model).__name__} has sliding-window layers; the decode benchmark needs full attention."
        )
    results = []
    with torch.inference_mode():
        for length in config.lengths:
            rows = token_stream[: num_rows * length].view(num_rows, length).to(model.device)  # [rows, length]
            started = time.perf_counter()
            prefill = prefill_rows(model, rows)
            logger.info("Prefilled %d rows of %d tokens in %.1f s.", num_rows, length, time.perf_counter() - started)
            for batch in config.batches:
                with OtherCpuUse() as others:
                    runs = _measure(model, prefill, length, batch, config)
                results.extend(summarize(runs, length, batch, config, others.other_cores))
                logger.info(
                    "Measured length %d, batch %d in %.1f s (other processes: %.2f cores).",
                    length,
                    batch,
                    others.wall_s,
                    others.other_cores,
                )
            del prefill
            gc.collect()
    return results


def _measure(
    model: PreTrainedModel, prefill: Prefill, length: int, batch: int, config: DecodeBenchConfig
) -> dict[str, list[DecodeRun]]:
    """Runs every cache ``config.rounds`` times, interleaved; returns each cache's runs."""
    capacity = length + config.tokens_per_row
    pools = bench_pools(model, config.caches, config.window, batch, capacity, config.page_size)

    def build(name: str) -> Cache:
        return build_cache(name, model, config.window, capacity, pools.get(name))

    def run(name: str, cache: Cache) -> DecodeRun:
        fragment = contextlib.nullcontext()
        if pool_kind(name) == "fragmented" and isinstance(cache, PoolCache):
            block = cache.pool.format.extent_pages * cache.pool.format.page_size
            fragment = interleaved_extents(cache.pool, batch * math.ceil(capacity / block))
        with model_attention(model, CACHE_ATTENTION.get(name)), fragment:
            return _decode(model, cache, prefill, length, batch, config)

    return measure.run_interleaved(config.caches, config.rounds, build, run)


def _decode(
    model: PreTrainedModel, cache: Cache, prefill: Prefill, length: int, batch: int, config: DecodeBenchConfig
) -> DecodeRun:
    """Loads the prefilled state of the first ``batch`` rows into ``cache``, then decodes greedily."""
    with warnings.catch_warnings():  # no attention reads these updates: a ring's warning about its band is moot
        warnings.simplefilter("ignore")
        for layer_idx, (keys, values) in enumerate(zip(prefill.keys, prefill.values)):
            cache.update(keys[:batch], values[:batch], layer_idx)
    device = prefill.next_tokens.device
    is_cuda = device.type == "cuda"
    next_tokens = prefill.next_tokens[:batch].unsqueeze(1)  # [batch, 1]
    picked = []
    step_s = []

    def step(tokens: torch.Tensor, position: int) -> torch.Tensor:
        """Feeds ``tokens`` ``[batch, 1]`` at ``position``; returns the greedy picks ``[batch, 1]``."""
        position_ids = torch.full((batch, 1), position, dtype=torch.long, device=device)  # [batch, 1]
        logits = model(input_ids=tokens, position_ids=position_ids, cache=cache, use_cache=True).logits
        return logits[:, -1].argmax(-1, keepdim=True)  # [batch, 1]

    compiled_before = sum(flex.compile_seconds().values())
    for position in range(length, length + config.warmup_steps):
        next_tokens = step(next_tokens, position)
        picked.append(next_tokens)
    start = length + config.warmup_steps
    calls_before, reads_before = flex.call_count(), _read_counts(cache)
    with PeakMemory(device, config.sample_interval_s) as memory:
        for position in range(start, start + config.steps):
            if is_cuda:
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            next_tokens = step(next_tokens, position)
            if is_cuda:
                torch.cuda.synchronize(device)
            step_s.append(time.perf_counter() - began)
            picked.append(next_tokens)
    in_place_calls = flex.call_count() - calls_before
    reads = {path: count - reads_before[path] for path, count in _read_counts(cache).items()}
    attention_calls = config.steps * model.config.num_hidden_layers
    compile_s = sum(flex.compile_seconds().values()) - compiled_before
    return DecodeRun(
        step_s,
        torch.cat(picked, dim=1).cpu(),
        kv_bytes(cache),
        memory.peak_bytes,
        in_place_calls,
        reads,
        attention_calls,
        compile_s,
    )


def _read_counts(cache: Cache) -> dict[str, int]:
    """How attention read the cache's layers so far, by path (``PoolCache.read_counts``; ``{}`` for transformers')."""
    return cache.read_counts() if isinstance(cache, PoolCache) else {}


def profile_decode(
    model: PreTrainedModel, token_stream: torch.Tensor, name: str, length: int, batch: int, config: DecodeBenchConfig
) -> str:
    """Where the time of one decode step of cache ``name`` goes: ``torch.profiler``'s table of one step.

    The cache is brought to ``length`` tokens per row of ``batch`` rows as in ``run_decode_benchmark``, decodes
    ``config.warmup_steps`` steps (compiling where it compiles), then one step is profiled.

    Returns:
        The profiler's table, sorted by total CPU time (the top 25 operators).
    """
    config = dataclasses.replace(config, lengths=(length,), batches=(batch,), caches=(BASELINE, name), steps=1)
    rows = token_stream[: batch * length].view(batch, length).to(model.device)  # [batch, length]
    with torch.inference_mode():
        prefill = prefill_rows(model, rows)
        capacity = length + config.tokens_per_row + 1  # and the profiled step
        pools = bench_pools(model, config.caches, config.window, batch, capacity, config.page_size)
        cache = build_cache(name, model, config.window, capacity, pools.get(name))
        with model_attention(model, CACHE_ATTENTION.get(name)):
            _decode(model, cache, prefill, length, batch, config)  # loads the rows, warms up (compiles), one step
            tokens = prefill.next_tokens[:batch].unsqueeze(1)  # [batch, 1]: which tokens does not matter here
            position_ids = torch.full_like(tokens, length + config.tokens_per_row)  # [batch, 1]
            with torch.profiler.profile() as profiler:
                model(input_ids=tokens, position_ids=position_ids, cache=cache, use_cache=True)
    return profiler.key_averages().table(sort_by="cpu_time_total", row_limit=25)
