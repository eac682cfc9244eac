"""What the decode benchmark measures and reports (``hf_kvcache.bench.decode`` runs it): its settings
(``DecodeBenchConfig``), what one run measured (``DecodeRun``), each cache's summary (``DecodeResult``) and how results
are printed and recorded.
"""

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvcache.bench import measure
from hf_kvcache.bench.catalogue import (
    BASELINE,
    CACHE_ATTENTION,
    CACHE_NAMES,
    FULL_CACHES,
    SLIDING_BASELINE,
    SLIDING_CACHES,
    pool_kind,
)
from hf_kvcache.layers import RUN


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
class DecodeRun:
    """What one run of a cache measured (``summarize`` turns a (length, batch)'s runs into ``DecodeResult``s)."""

    step_s: list[float]
    tokens: torch.Tensor  # [batch, warmup_steps + steps] on CPU
    kv_bytes_held: int
    peak_bytes: int
    in_place_calls: int  # compiled in-place attention calls during the timed steps
    reads: dict[str, int]  # layer reads by path during the timed steps (PoolCache.read_counts; {} for others)
    attention_calls: int  # layer attention calls during the timed steps (layers x steps)
    compile_s: float


def summarize(
    runs: dict[str, list[DecodeRun]], length: int, batch: int, config: DecodeBenchConfig, other_cores: float
) -> list[DecodeResult]:
    """The ``DecodeResult`` of each cache at one (length, batch), from its runs (the baselines' among them)."""
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
        as_runs = sum(run.reads.get(RUN, 0) for run in cache_runs)
        attention_calls = sum(run.attention_calls for run in cache_runs)
        if in_place == as_runs == 0:
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
