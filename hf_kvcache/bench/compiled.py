"""Compiled-decoding benchmark: decode steps as ``generate`` runs them, compiled by ``generate`` itself or eager.

A *row* is a cache and a way to run it: ``static:compiled`` (transformers' ``StaticCache`` with ``generate``
compiling its decode steps: the baseline), ``dynamic`` and ``static`` (eager), and each of our caches eager and,
where it is compileable, ``:compiled``. Compiled rows pass ``generate`` a ``CompileConfig(mode=...)`` with
``_compile_all_devices = True`` (on CPU ``generate`` compiles only when told; ``mode="default"``: no CUDA graphs;
on CUDA ``"reduce-overhead"``: CUDA graphs), and ``generate`` decides, by its own rule, whether to compile.

For each (length, batch) the prompt rows (consecutive slices of the essays' token stream) are prefilled once with a
``DynamicCache`` and loaded into each run's fresh cache through ``cache.update`` (a copy, not a forward pass); our
caches draw from the default pool, as ``generate(cache_implementation=...)`` would.
``generate`` then gets the prompt plus its next token, so that its own prefill feeds that one token, and runs
``warmup_steps + steps`` decode steps (eager rows with ``disable_compile``: on CUDA ``generate`` would compile a
compileable cache's steps unasked); a logits processor stamps the time of each step and the timed steps' median
gives tokens/s. Each compiled row first runs once untimed (its compile, reported as ``first_call_s``); then every
row runs ``rounds`` times, interleaved. Our caches run under ``attn_implementation="hf_kvcache"`` (their pages read
in place where that applies, eager or compiled), transformers' under the model's own (``sdpa``). Reported per row:
tokens/s, the ratio to ``static:compiled``'s in the same run, graphs compiled during the timed rounds (recompiles: 0
is the target), compiled graphs inductor ran without CUDA graphs in ``"reduce-overhead"`` mode (CUDA graph skips,
first call included: 0 is the target), KV bytes held at the end against ``StaticCache``'s, and whether its greedy
tokens equal the baseline's.
"""

import gc
import logging
import statistics
import time
import unittest.mock
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch._dynamo
from transformers import CompileConfig, DynamicCache, LogitsProcessor, PreTrainedModel, StaticCache

from hf_kvcache.attention.interface import ATTENTION_NAME, model_attention
from hf_kvcache.bench import measure
from hf_kvcache.bench.prompts import prefill_rows
from hf_kvcache.caches.base import PoolCache
from hf_kvcache.eval import kv_bytes
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.integration.seams import build_cache

logger = logging.getLogger("hf_kvcache.bench")

BASELINE = "static:compiled"
ROWS = (
    BASELINE,
    "dynamic",
    "static",
    "paged_pool:compiled",
    "paged_pool",
    "sliding_ring:compiled",
    "sliding_ring",
    "quantized_values:compiled",
    "quantized_values",
    "quantized_kv:compiled",
    "quantized_kv",
)
"""Rows of the suite. A ``:compiled`` row of a cache that is not compileable runs eager (``generate``'s rule)."""
ROW_CONFIGS = {"sliding_ring": {"window": 1024}}
"""The ``cache_config`` of rows that need one (the rest take their defaults): the ring keeps the last 1,024 tokens
of a full-attention model, so its tokens differ from the baseline's past them (not a lossless row)."""


@dataclass(frozen=True)
class CompiledBenchConfig:
    """What to measure.

    Attributes:
        cells: ``(prompt length, batch)`` pairs.
        rows: see ``ROWS``; must include ``BASELINE``.
        steps / warmup_steps: timed / untimed decode steps per run.
        rounds: timed runs of each row per cell, interleaved.
        mode: ``CompileConfig.mode`` of the compiled rows.
    """

    cells: tuple[tuple[int, int], ...] = ((1024, 1), (4096, 1), (4096, 8))
    rows: tuple[str, ...] = ROWS
    steps: int = 24
    warmup_steps: int = 3
    rounds: int = 2
    mode: str = "default"

    def __post_init__(self) -> None:
        measure.check_settings(self, {})
        if BASELINE not in self.rows:
            raise ValueError(f"rows must include {BASELINE!r}: the baseline of ratios and token checks.")
        names = {"static", "dynamic", *REGISTRY}
        unknown = sorted(row for row in self.rows if row.split(":")[0] not in names)
        if unknown:
            raise ValueError(f"Unknown rows {unknown}; a row is one of {sorted(names)}, optionally ':compiled'.")


@dataclass
class CompiledResult:
    """One row at one cell, over its timed rounds (see the module docstring)."""

    row: str
    length: int
    batch: int
    median_step_ms: float
    round_median_step_ms: list[float]
    tokens_per_s: float
    ratio_vs_static_compiled: float
    first_call_s: float
    recompiles: int
    cudagraph_skips: int
    kv_bytes_held: int
    kv_bytes_vs_static: float
    tokens_match: bool
    compiled: bool  # generate compiled its decode steps (with a graph of its own or one an earlier cell compiled)


class StepClock(LogitsProcessor):
    """Stamps the time each decode step's logits come out (``generate`` calls it once per step)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.is_cuda:
            torch.cuda.synchronize(scores.device)
        self.stamps.append(time.perf_counter())
        return scores


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _cudagraph_skips() -> int:
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


def _build(model: PreTrainedModel, name: str, capacity: int) -> Any:
    if name == "static":
        return StaticCache(config=model.config, max_cache_len=capacity)
    if name == "dynamic":
        return DynamicCache(config=model.config)
    return build_cache(name, model, dict(ROW_CONFIGS.get(name, {})))


def _run(model, prefill, rows: torch.Tensor, row: str, batch: int, config: CompiledBenchConfig):
    """One run: a fresh cache loaded with the prefilled rows, then ``generate``'s decode steps."""
    name, compiled = row.split(":")[0], row.endswith(":compiled")
    length = rows.shape[1]
    cache = _build(model, name, length + config.warmup_steps + config.steps + 2)
    ids = torch.cat([rows[:batch], prefill.next_tokens[:batch, None]], dim=1)  # [batch, length + 1]
    compile_config = None
    if compiled:
        compile_config = CompileConfig(mode=config.mode)
        compile_config._compile_all_devices = True  # a class attribute in transformers 5.24
    clock = StepClock()
    new_tokens = config.warmup_steps + config.steps + 1
    graphs, skips = compiled_graphs(), _cudagraph_skips()
    began = time.perf_counter()
    with model_attention(model, ATTENTION_NAME if name in REGISTRY else None):  # ours read pages in place
        for layer_idx, (keys, values) in enumerate(zip(prefill.keys, prefill.values)):
            cache.update(keys[:batch], values[:batch], layer_idx)  # a ring's band: its own attention's
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # no padding (said, so that generate does not guess from the ids)
            cache=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            compile_config=compile_config,
            disable_compile=not compiled,  # on CUDA generate compiles a compileable cache unless told not to
            logits_processor=[clock],
            return_dict_in_generate=True,
        )
    wall_s = time.perf_counter() - began
    steps = [after - before for before, after in zip(clock.stamps, clock.stamps[1:])][config.warmup_steps :]
    held = kv_bytes(cache)
    # Whether generate compiled the steps (a graph compiled for an earlier cell may serve this one: 0 new graphs).
    ran_compiled = compiled and (cache.compiled_decoding if isinstance(cache, PoolCache) else cache.is_compileable)
    if isinstance(cache, PoolCache):
        cache.release()
    return {
        "compiled": ran_compiled,
        "step_s": steps,
        "tokens": out.sequences[:, length + 1 :].cpu(),
        "wall_s": wall_s,
        "graphs": compiled_graphs() - graphs,
        "cudagraph_skips": _cudagraph_skips() - skips,
        "kv_bytes": held,
    }


def run_compiled_benchmark(
    model: PreTrainedModel, stream: torch.Tensor, config: CompiledBenchConfig
) -> list[CompiledResult]:
    """Measures every row at every cell (see the module docstring). One process compiles the model's forward for
    every cache and cell (a graph each, where a serving process compiles one cache's): dynamo's recompile limit (8
    per function) is raised for the run, so that a late row is not run eager by dynamo while reported compiled."""
    with unittest.mock.patch.object(torch._dynamo.config, "recompile_limit", RECOMPILE_LIMIT):
        return _run_cells(model, stream, config)


RECOMPILE_LIMIT = 64
"""Graphs dynamo may compile per function during a compiled benchmark (``run_compiled_benchmark``)."""


def _run_cells(model: PreTrainedModel, stream: torch.Tensor, config: CompiledBenchConfig) -> list[CompiledResult]:
    results = []
    for length, batch in config.cells:
        rows = stream[: batch * length].view(batch, length).to(model.device)  # [batch, length]
        with torch.no_grad():
            prefill = prefill_rows(model, rows)
        first_call: dict[str, dict] = {}  # row -> its untimed first run
        for row in config.rows:  # the compiles, untimed
            if row.endswith(":compiled"):
                run = _run(model, prefill, rows, row, batch, config)
                first_call[row] = run
                logger.info(
                    "%s at %d x %d: first call %.1f s, %d graphs, %d CUDA graph skips",
                    *(row, length, batch, run["wall_s"], run["graphs"], run["cudagraph_skips"]),
                )
        runs: dict[str, list[dict]] = {row: [] for row in config.rows}
        for round_index in range(config.rounds):
            for row in config.rows:
                run = _run(model, prefill, rows, row, batch, config)
                runs[row].append(run)
                logger.info(  # in the log before the record, which a run cut off by its time limit never writes
                    "%s at %d x %d, round %d: median step %.2f ms (%s), %d graphs",
                    *(row, length, batch, round_index, 1e3 * statistics.median(run["step_s"])),
                    *("compiled" if run["compiled"] else "eager", run["graphs"]),
                )
                gc.collect()
        results += _summarize(runs, first_call, length, batch)
    return results


def profile_row(model: PreTrainedModel, stream: torch.Tensor, config: CompiledBenchConfig, row: str) -> str:
    """Where the time of ``row``'s decode steps goes at the first cell: the row runs once untimed (its compile),
    then once under ``torch.profiler``. Returns the kernels launched and their device time per forward pass, and
    the profiler's table of the top 20 operators by their own device time (CPU time on the CPU)."""
    length, batch = config.cells[0]
    rows = stream[: batch * length].view(batch, length).to(model.device)  # [batch, length]
    with torch.no_grad():
        prefill = prefill_rows(model, rows)
    with unittest.mock.patch.object(torch._dynamo.config, "recompile_limit", RECOMPILE_LIMIT):
        _run(model, prefill, rows, row, batch, config)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if model.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profiler:
            _run(model, prefill, rows, row, batch, config)
    averages = profiler.key_averages()
    forwards = config.warmup_steps + config.steps + 1
    on_device = [event for event in averages if event.device_type != torch.autograd.DeviceType.CPU]
    launched = sum(event.count for event in on_device)
    device_ms = sum(event.self_device_time_total for event in on_device) / 1e3
    sort = "self_device_time_total" if on_device else "self_cpu_time_total"
    return (
        f"{row} at {length:,} x {batch}, {forwards} forward passes (one prefill of one token per row, then decode "
        f"steps): {launched / forwards:.0f} kernels and {device_ms / forwards:.3f} ms of device time per pass\n"
        + averages.table(sort_by=sort, row_limit=20)
    )


def _summarize(
    runs: dict[str, list[dict]], first_call: dict[str, dict], length: int, batch: int
) -> list[CompiledResult]:
    median = {row: statistics.median(s for run in rs for s in run["step_s"]) for row, rs in runs.items()}
    baseline = runs[BASELINE]
    results = []
    for row, rs in runs.items():
        matches = all(torch.equal(run["tokens"], base["tokens"]) for run, base in zip(rs, baseline))
        first = first_call.get(row)
        results.append(
            CompiledResult(
                row=row,
                length=length,
                batch=batch,
                median_step_ms=1000 * median[row],
                round_median_step_ms=[1000 * statistics.median(run["step_s"]) for run in rs],
                tokens_per_s=batch / median[row],
                ratio_vs_static_compiled=median[BASELINE] / median[row],
                first_call_s=first["wall_s"] if first else 0.0,
                recompiles=sum(run["graphs"] for run in rs),
                cudagraph_skips=sum(run["cudagraph_skips"] for run in rs) + (first["cudagraph_skips"] if first else 0),
                kv_bytes_held=rs[-1]["kv_bytes"],
                kv_bytes_vs_static=rs[-1]["kv_bytes"] / baseline[-1]["kv_bytes"],
                tokens_match=matches,
                compiled=all(run["compiled"] for run in rs),
            )
        )
    return results


def markdown_table(results: Sequence[CompiledResult]) -> str:
    lines = [
        "| cell | row | compiled | tok/s | vs StaticCache compiled | first call s | recompiles | CUDA graph skips "
        "| KV bytes vs Static | tokens equal |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.length:,} x {r.batch} | {r.row} | {r.compiled} | {r.tokens_per_s:.1f} | "
            f"{r.ratio_vs_static_compiled:.2f}x | {r.first_call_s:.1f} | {r.recompiles} | {r.cudagraph_skips} | "
            f"{r.kv_bytes_vs_static:.2f} | {r.tokens_match} |"
        )
    return "\n".join(lines)


def results_record(results: Sequence[CompiledResult], config: CompiledBenchConfig, info: dict) -> dict:
    return {
        "benchmark": "decode_compiled",
        "config": asdict(config),
        "machine": info,
        "results": [asdict(result) for result in results],
    }
