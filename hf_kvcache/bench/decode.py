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
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import model_attention
from hf_kvcache.bench import measure
from hf_kvcache.bench.catalogue import (
    BASELINE,
    CACHE_ATTENTION,
    CACHE_NAMES,
    FULL_CACHES,
    SLIDING_BASELINE,
    SLIDING_CACHES,
    bench_pools,
    build_cache,
    interleaved_extents,
    pool_kind,
)
from hf_kvcache.bench.measure import OtherCpuUse, PeakMemory
from hf_kvcache.bench.prompts import Prefill, prefill_rows
from hf_kvcache.caches.base import PoolCache
from hf_kvcache.eval import kv_bytes
from hf_kvcache.layers import IN_PLACE, RUN

logger = logging.getLogger("hf_kvcache.bench")


@dataclass(frozen=True)
class DecodeBenchConfig:
    """What to measure.

    Attributes:
        lengths: prompt lengths in tokens (every row holds exactly this many).
        batches: batch sizes (rows decoded together).
        steps: timed decode steps per run.
        rounds: runs of each cache per (length, batch), interleaved across caches.
        warmup_steps: untimed decode steps at the start of every run.
        caches: names from ``CACHE_NAMES``; must include ``"dynamic"``, and ``"dynamic_sliding"`` if any
            sliding cache runs.
        window: tokens each query attends to in the sliding caches, itself included (<= every length).
        page_size: token slots per page of our caches' pools.
        sample_interval_s: seconds between RSS samples on CPU.
    """

    lengths: tuple[int, ...] = (256, 1024, 4096)
    batches: tuple[int, ...] = (1, 8)
    steps: int = 32
    rounds: int = 3
    warmup_steps: int = 2
    caches: tuple[str, ...] = FULL_CACHES
    window: int = 256
    page_size: int = 16
    sample_interval_s: float = 0.002

    def __post_init__(self) -> None:
        measure.check_settings(self, {"lengths": 1, "batches": 1})
        unknown = sorted(set(self.caches) - set(CACHE_NAMES))
        if unknown:
            raise ValueError(f"Unknown caches {unknown}; choose from {list(CACHE_NAMES)}.")
        if BASELINE not in self.caches:
            raise ValueError(f"caches must include {BASELINE!r}: it is the baseline of ratios and token checks.")
        if self.sample_interval_s <= 0:
            raise ValueError(f"sample_interval_s must be > 0, got {self.sample_interval_s}.")
        # DynamicSlidingWindowLayer keeps its last window - 1 tokens, which for window 1 slices [-0:], i.e. all.
        if self.window < 2:
            raise ValueError(f"window must be >= 2, got {self.window}.")
        if set(self.caches) & set(SLIDING_CACHES):
            if SLIDING_BASELINE not in self.caches:
                raise ValueError(f"caches must include {SLIDING_BASELINE!r} when a sliding cache runs: their baseline.")
            if min(self.lengths) < self.window:
                raise ValueError(
                    f"Every length must be >= window={self.window} so the window is full while decoding, "
                    f"got lengths {self.lengths}; raise the lengths or lower the window."
                )

    @property
    def tokens_per_row(self) -> int:
        """Decode steps per run, warmup included: what a row holds beyond its prompt at the end."""
        return self.warmup_steps + self.steps


@dataclass
class DecodeResult:
    """One cache at one (length, batch), over all rounds.

    Attributes:
        cache: the cache's name.
        length / batch: prompt tokens per row / rows.
        steps / rounds: timed steps per run / runs.
        median_step_ms: median wall time of one decode step (forward plus greedy pick), ms.
        round_median_step_ms: the median of each round alone, ms (spread shows the machine's noise).
        tokens_per_s: ``batch / median step time``.
        window: tokens a query attends to (sliding caches), ``None`` for caches that keep every token.
        reference: the cache whose greedy tokens this one's are checked against (``dynamic`` or ``dynamic_sliding``).
        ratio_vs_dynamic: ``tokens_per_s`` over DynamicCache's in the same invocation.
        ratio_vs_dynamic_sliding: ``tokens_per_s`` over ``dynamic_sliding``'s in the same invocation (``None``
            when it did not run).
        kv_bytes_held: bytes of KV storage the cache holds at the end of a run (our caches: whole pages).
        kv_bytes_per_token: ``kv_bytes_held`` per token of context a query attends to, per row: all tokens
            held for full caches, ``window`` for sliding ones.
        peak_mib: highest memory growth over the timed loop of any round, MiB (see module docstring).
        tokens_match: every round's greedy tokens equal the reference's of the same round.
        mismatched_tokens: decoded tokens that differ from the reference's, summed over rounds.
        other_processes_cores: mean cores other processes kept busy while this (length, batch) was measured;
            well above 0 on a machine with few cores means the timings are suspect.
        attention: the model's ``attn_implementation`` during the run.
        pool: which pool a cache of ours drew from (``default``, ``fixed``, ``fragmented``); ``None`` for
            transformers' caches.
        path: how decode attention read a paged cache of ours: ``in place (compiled FlexAttention)`` or ``in place
            (sdpa over one run of pages)`` where every timed step of every round did that, ``gathered`` where none
            read in place, ``mixed`` otherwise; ``-`` for transformers'
            caches and rings (``sliding_ring`` reads its slots in place without compiling, ``sliding_ring_sdpa``
            gathers them).
        compile_s: seconds the first call of each compiled shape took in these runs (the compile, paid once per
            process and shape; 0 where nothing was compiled or it was compiled before).
    """

    cache: str
    length: int
    batch: int
    steps: int
    rounds: int
    median_step_ms: float
    round_median_step_ms: list[float]
    tokens_per_s: float
    window: int | None
    reference: str
    ratio_vs_dynamic: float
    ratio_vs_dynamic_sliding: float | None
    kv_bytes_held: int
    kv_bytes_per_token: float
    peak_mib: float
    tokens_match: bool
    mismatched_tokens: int
    other_processes_cores: float
    attention: str
    pool: str | None
    path: str
    compile_s: float


@dataclass
class _Run:
    step_s: list[float]
    tokens: torch.Tensor  # [batch, warmup_steps + steps] on CPU
    kv_bytes_held: int
    peak_bytes: int
    in_place_calls: int  # compiled in-place attention calls during the timed steps
    reads: dict[str, int]  # layer reads by path during the timed steps (PoolCache.read_counts; {} for others)
    attention_calls: int  # layer attention calls during the timed steps (layers x steps)
    compile_s: float


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
                results.extend(_summarize(runs, length, batch, config, others.other_cores))
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
) -> dict[str, list[_Run]]:
    """Runs every cache ``config.rounds`` times, interleaved; returns each cache's runs."""
    capacity = length + config.tokens_per_row
    pools = bench_pools(model, config.caches, config.window, batch, capacity, config.page_size)

    def build(name: str) -> Cache:
        return build_cache(name, model, config.window, capacity, pools.get(name))

    def run(name: str, cache: Cache) -> _Run:
        fragment = contextlib.nullcontext()
        if pool_kind(name) == "fragmented" and isinstance(cache, PoolCache):
            block = cache.pool.format.extent_pages * cache.pool.format.page_size
            fragment = interleaved_extents(cache.pool, batch * math.ceil(capacity / block))
        with model_attention(model, CACHE_ATTENTION.get(name)), fragment:
            return _decode(model, cache, prefill, length, batch, config)

    return measure.run_interleaved(config.caches, config.rounds, build, run)


def _decode(
    model: PreTrainedModel, cache: Cache, prefill: Prefill, length: int, batch: int, config: DecodeBenchConfig
) -> _Run:
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
    return _Run(
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


def _summarize(
    runs: dict[str, list[_Run]], length: int, batch: int, config: DecodeBenchConfig, other_cores: float
) -> list[DecodeResult]:
    tokens_per_s = {name: batch / statistics.median(s for run in rs for s in run.step_s) for name, rs in runs.items()}
    context = length + config.tokens_per_row  # tokens a row received by the end of a run
    results = []
    for name, cache_runs in runs.items():
        median_s = batch / tokens_per_s[name]
        window = config.window if name in SLIDING_CACHES else None
        reference = BASELINE if window is None else SLIDING_BASELINE
        mismatched = sum(
            int((run.tokens != reference_run.tokens).sum()) for run, reference_run in zip(cache_runs, runs[reference])
        )
        held = cache_runs[-1].kv_bytes_held
        in_place = sum(run.in_place_calls for run in cache_runs)
        as_runs, in_slots = (sum(run.reads.get(kind, 0) for run in cache_runs) for kind in (RUN, IN_PLACE))
        attention_calls = sum(run.attention_calls for run in cache_runs)
        if name in SLIDING_CACHES and pool_kind(name) is not None:  # a ring: its slots in place, or gathered
            path = {0: "gathered", attention_calls: "in place (its slots, in ring order)"}.get(in_slots, "mixed")
        elif in_place == as_runs == 0:
            path = "gathered" if pool_kind(name) is not None else "-"
        elif in_place == attention_calls:
            path = "in place (compiled FlexAttention)"
        elif as_runs == attention_calls:
            path = "in place (sdpa over one run of pages)"
        else:
            path = "mixed"
        results.append(
            DecodeResult(
                cache=name,
                length=length,
                batch=batch,
                steps=config.steps,
                rounds=config.rounds,
                median_step_ms=1e3 * median_s,
                round_median_step_ms=[1e3 * statistics.median(run.step_s) for run in cache_runs],
                tokens_per_s=tokens_per_s[name],
                window=window,
                reference=reference,
                ratio_vs_dynamic=tokens_per_s[name] / tokens_per_s[BASELINE],
                ratio_vs_dynamic_sliding=(
                    tokens_per_s[name] / tokens_per_s[SLIDING_BASELINE] if SLIDING_BASELINE in runs else None
                ),
                kv_bytes_held=held,
                kv_bytes_per_token=held / (batch * (context if window is None else min(context, window))),
                peak_mib=max(run.peak_bytes for run in cache_runs) / 2**20,
                tokens_match=mismatched == 0,
                mismatched_tokens=mismatched,
                other_processes_cores=round(other_cores, 3),
                attention=CACHE_ATTENTION.get(name, "sdpa"),
                pool=pool_kind(name),
                path=path,
                compile_s=round(sum(run.compile_s for run in cache_runs), 2),
            )
        )
    return results


def markdown_table(results: Sequence[DecodeResult], busy_cores: float = 0.25) -> str:
    """The results as a Markdown table, one line per (cache, length, batch).

    ``KV bytes/token``: bytes held per token of context a query attends to (see ``DecodeResult``).

    Args:
        results: from ``run_decode_benchmark``.
        busy_cores: tokens/s measured while other processes kept more cores than this busy get a ``*``
            and a footnote: their timings are suspect.
    """
    lines = [
        "| cache | pool | attention read | window | length | batch | tokens/s | vs dynamic | vs static "
        "| vs dynamic_sliding | KV MiB held | KV bytes/token | peak MiB | compile s | tokens match (vs) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    static = {(r.length, r.batch): r.tokens_per_s for r in results if r.cache == "static"}
    for r in results:
        match = "yes" if r.tokens_match else f"no ({r.mismatched_tokens} differ)"
        mark = "*" if r.other_processes_cores > busy_cores else ""
        window = "-" if r.window is None else r.window
        vs_sliding = "-" if r.ratio_vs_dynamic_sliding is None else f"{r.ratio_vs_dynamic_sliding:.2f}x"
        vs_static = static.get((r.length, r.batch))
        vs_static = "-" if vs_static is None else f"{r.tokens_per_s / vs_static:.2f}x"
        lines.append(
            f"| {r.cache} | {r.pool or '-'} | {r.path} ({r.attention}) | {window} | {r.length} | {r.batch} | "
            f"{r.tokens_per_s:.1f}{mark} | {r.ratio_vs_dynamic:.2f}x | {vs_static} | {vs_sliding} | "
            f"{r.kv_bytes_held / 2**20:.1f} | {r.kv_bytes_per_token:,.0f} | {r.peak_mib:.1f} | {r.compile_s:.1f} | "
            f"{match} ({r.reference}) |"
        )
    if any(r.other_processes_cores > busy_cores for r in results):
        lines.append(f"\n\\* measured while other processes kept more than {busy_cores} cores busy.")
    return "\n".join(lines)


def results_record(results: Sequence[DecodeResult], config: DecodeBenchConfig, info: dict[str, Any]) -> dict[str, Any]:
    """The JSON-ready record of one benchmark invocation: machine, settings and results."""
    return measure.results_record(results, config, info)


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
