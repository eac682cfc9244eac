"""Micro-benchmark of one decode step's cache update alone, for the sliding-window caches of
``hf_kvcache.bench.catalogue`` (``SLIDING_CACHES``).

It times one decode step's ``cache.update(keys, values, layer_idx)`` of each cache, with the model's KV geometry
(heads, head_dim, layers, dtype) and random keys/values, no model forward. Per (window, batch) and cache: layers 0
and 1 get a prefill of ``2 * window`` tokens (the window is full and has wrapped), then ``warmup_steps`` untimed
and ``steps`` timed decode steps, each updating layer 0 then layer 1 with one new token per row, each update timed
alone (device synchronized on CUDA). Runs are interleaved across caches (``A B C A B C ...``) over ``rounds``. Two
figures, because a cache's layers can share per-step work: layer 0's update is the step's first (the ring grows or
checks its page table and builds the step's slot indices there, once for all layers); layer 1's is every later
layer's (the ring reuses those indices). ``per_layer_us`` weighs them as a decode step of the model does:
``(first + (num_layers - 1) * next) / num_layers``. transformers' layers share nothing, so their two figures
differ only by noise.
"""

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache, PreTrainedConfig

from hf_kvcache.bench import measure
from hf_kvcache.bench.catalogue import (
    RING_ATTENTION,
    SLIDING_BASELINE,
    SLIDING_CACHES,
    build_sliding_cache,
    ring_pool,
    with_attention,
)
from hf_kvcache.memory.format import PageFormat

UPDATE_WINDOWS = (256, 512, 1024, 2048, 4096, 8192)
TIMED_LAYERS = (0, 1)
"""Layers the micro-benchmark updates each step: the step's first layer, and one after it."""


@dataclass(frozen=True)
class RingUpdateBenchConfig:
    """What the update micro-benchmark measures.

    Attributes:
        windows: window sizes in tokens (each >= 2).
        batches: batch sizes (rows updated together).
        steps: timed decode steps per run.
        rounds: runs of each cache per (window, batch), interleaved across caches.
        warmup_steps: untimed decode steps at the start of every run, after the prefill.
        caches: names from ``SLIDING_CACHES``.
        page_size: token slots per page of the ring's pool.
        seed: seed of the random keys/values.
    """

    windows: tuple[int, ...] = UPDATE_WINDOWS
    batches: tuple[int, ...] = (1,)
    steps: int = 200
    rounds: int = 3
    warmup_steps: int = 20
    caches: tuple[str, ...] = SLIDING_CACHES
    page_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        measure.check_settings(self, {"windows": 2, "batches": 1})
        unknown = sorted(set(self.caches) - set(SLIDING_CACHES))
        if unknown or not self.caches:
            raise ValueError(f"caches must name some of {list(SLIDING_CACHES)}, got {list(self.caches)}.")


@dataclass
class RingUpdateResult:
    """One cache at one (window, batch), over all rounds; times are medians over every timed step, in µs.

    Attributes:
        cache / window / batch: what was measured.
        steps / rounds: timed steps per run / runs.
        first_update_us: layer 0's update, the first of each step.
        next_update_us: layer 1's update, after layer 0's in the same step.
        per_layer_us: ``(first + (num_layers - 1) * next) / num_layers``: one layer's share of a decode step.
        round_next_update_us: ``next_update_us`` of each round alone (spread shows the machine's noise).
        ratio_vs_dynamic_sliding / ratio_vs_static_sliding: ``per_layer_us`` over that cache's, measured in
            the same invocation (below 1: faster); ``None`` when it did not run.
    """

    cache: str
    window: int
    batch: int
    steps: int
    rounds: int
    first_update_us: float
    next_update_us: float
    per_layer_us: float
    round_next_update_us: list[float]
    ratio_vs_dynamic_sliding: float | None
    ratio_vs_static_sliding: float | None


def run_ring_update_benchmark(
    config: PreTrainedConfig,
    bench: RingUpdateBenchConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> list[RingUpdateResult]:
    """Times one decode step's cache update of every cache of ``bench`` at every (window, batch).

    Args:
        config: a model config with full attention in every layer and at least 2 layers (no model is built).
        bench: what to measure.
        dtype / device: of the keys/values and caches.

    Returns:
        One ``RingUpdateResult`` per (window, batch, cache), in that nesting order.
    """
    config = config.get_text_config(decoder=True)
    page_format = PageFormat.from_model_config(config, dtype)
    num_layers = config.num_hidden_layers
    if num_layers < len(TIMED_LAYERS):
        raise ValueError(f"The config has {num_layers} layers; the update benchmark times layers {TIMED_LAYERS}.")
    device = torch.device(device)
    generator = torch.Generator().manual_seed(bench.seed)
    results = []
    with torch.inference_mode():
        for window in bench.windows:
            for batch in bench.batches:
                shape = (batch, page_format.num_kv_heads, 2 * window, page_format.head_dim)  # fill: [.., 2W, hd]
                fill = [torch.randn(shape, generator=generator, dtype=dtype).to(device) for _ in range(2)]
                timings = _measure(config, bench, window, fill, device)
                results.extend(_summarize(timings, window, batch, num_layers, bench))
                del fill
                gc.collect()
    return results


def _measure(
    config: PreTrainedConfig, bench: RingUpdateBenchConfig, window: int, fill: list[torch.Tensor], device: torch.device
) -> dict[str, list[tuple[list[float], list[float]]]]:
    """Times every cache of ``bench`` ``bench.rounds`` times, interleaved, at one (window, batch); ``fill`` holds the
    prefill's keys and values ``[batch, heads, 2 * window, head_dim]``."""
    step = [state[:, :, -1:].clone() for state in fill]  # [batch, heads, 1, head_dim]
    max_cache_len = 2 * window + bench.warmup_steps + bench.steps
    pool = None
    if set(RING_ATTENTION) & set(bench.caches):
        pool = ring_pool(config, window, fill[0].shape[0], bench.page_size, fill[0].dtype, device)

    def build(name: str) -> Cache:
        attended = with_attention(config, RING_ATTENTION[name]) if name in RING_ATTENTION else config
        return build_sliding_cache(name, attended, window, max_cache_len, pool)

    def run(name: str, cache: Cache) -> tuple[list[float], list[float]]:
        return _time_updates(cache, fill, step, bench, device)

    return measure.run_interleaved(bench.caches, bench.rounds, build, run)


def _time_updates(
    cache: Cache, fill: list[torch.Tensor], step: list[torch.Tensor], bench: RingUpdateBenchConfig, device: torch.device
) -> tuple[list[float], list[float]]:
    """Prefills ``TIMED_LAYERS`` with ``fill`` (keys, values), then times their one-token updates with ``step``.

    Returns:
        Seconds of each timed update of the first and of the second timed layer.
    """
    for layer_idx in TIMED_LAYERS:
        cache.update(fill[0], fill[1], layer_idx)
    is_cuda = device.type == "cuda"
    seconds: tuple[list[float], list[float]] = ([], [])
    for step_idx in range(bench.warmup_steps + bench.steps):
        for slot, layer_idx in enumerate(TIMED_LAYERS):
            if is_cuda:
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            cache.update(step[0], step[1], layer_idx)
            if is_cuda:
                torch.cuda.synchronize(device)
            if step_idx >= bench.warmup_steps:
                seconds[slot].append(time.perf_counter() - began)
    return seconds


def _summarize(
    timings: dict[str, list[tuple[list[float], list[float]]]],
    window: int,
    batch: int,
    num_layers: int,
    bench: RingUpdateBenchConfig,
) -> list[RingUpdateResult]:
    medians = {}
    for name, runs in timings.items():
        first = 1e6 * statistics.median(s for run in runs for s in run[0])
        later = 1e6 * statistics.median(s for run in runs for s in run[1])
        medians[name] = (first, later, (first + (num_layers - 1) * later) / num_layers)
    results = []
    for name, runs in timings.items():
        first, later, per_layer = medians[name]
        results.append(
            RingUpdateResult(
                cache=name,
                window=window,
                batch=batch,
                steps=bench.steps,
                rounds=bench.rounds,
                first_update_us=first,
                next_update_us=later,
                per_layer_us=per_layer,
                round_next_update_us=[1e6 * statistics.median(run[1]) for run in runs],
                ratio_vs_dynamic_sliding=per_layer / medians[SLIDING_BASELINE][2]
                if SLIDING_BASELINE in medians
                else None,
                ratio_vs_static_sliding=per_layer / medians["static_sliding"][2]
                if "static_sliding" in medians
                else None,
            )
        )
    return results


def markdown_table(results: Sequence[RingUpdateResult], num_layers: int) -> str:
    """The results as a Markdown table, one line per (window, batch, cache); ratios are of time (below 1: faster).

    Args:
        results: from ``run_ring_update_benchmark``.
        num_layers: the model's layers (the weight of ``next`` in ``per_layer_us``), for the header.
    """
    lines = [
        f"| cache | window | batch | first layer µs | next layer µs | per layer µs ({num_layers} layers) "
        "| vs dynamic_sliding | vs static_sliding |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    for r in results:
        lines.append(
            f"| {r.cache} | {r.window} | {r.batch} | {r.first_update_us:.1f} | {r.next_update_us:.1f} | "
            f"{r.per_layer_us:.1f} | {ratio(r.ratio_vs_dynamic_sliding)} | {ratio(r.ratio_vs_static_sliding)} |"
        )
    return "\n".join(lines)


def results_record(
    results: Sequence[RingUpdateResult], bench: RingUpdateBenchConfig, info: dict[str, Any]
) -> dict[str, Any]:
    """The JSON-ready record of one invocation: machine, settings, the timed layers and results."""
    return measure.results_record(results, bench, info, {"timed_layers": list(TIMED_LAYERS)})
