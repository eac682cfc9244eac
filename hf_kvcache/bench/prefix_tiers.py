"""Benchmark of prompt reuse beyond one pool (``scripts/bench_prefix.py --tiers``): the shared store across workers
and the host tier after eviction, each against its baseline in one run.

The path a user gets: ``model.generate(cache_implementation=CACHE, cache_config={"pool": pool})`` with ``pool =
KVPool.for_model(model, max_tokens=..., prefix_store=URL)`` or ``prefix_host_bytes=...``. Two parts, each over
``num_questions`` prompts of one ``prefix_tokens`` document followed by a distinct ``question_tokens`` question,
``new_tokens`` greedy tokens each; the first question of each mode warms up, the others are timed, modes interleaved
question by question; time to first token (the prefill and the first pick, read from a streamer) and the call's
total time, medians:

- **store**: every question runs on a fresh pool, as a worker process that just started has (an empty index; the
  store is its only source of pages). ``cold``: the store holds nothing of the document (each question in a
  namespace of its own); ``warm``: another worker published the document's pages under the one namespace. Bytes
  read from the store per reused token.
- **host**: one pool that holds one request; before each question a request of other tokens that takes every page
  evicts the document's pages. ``recompute``: without tiers, the prefill recomputes them; ``host``: with
  ``prefix_host_bytes``, they come back from host memory. Bytes written back into the pool per reused token.

Each part compares every question's greedy tokens across its modes. Timings come from one process on one device:
medians over questions, not over repeated runs of one.
"""

import dataclasses
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_kvcache.bench import measure
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.memory.pool import KVPool

PARTS = {"store": ("cold", "warm"), "host": ("recompute", "host")}


@dataclass(frozen=True)
class TierBenchConfig:
    """What the tiers benchmark measures.

    Attributes:
        prefix_tokens: tokens of the shared document.
        question_tokens: tokens of each question.
        new_tokens: greedy tokens generated per question.
        num_questions: questions per mode (the first warms up).
        cache: the ``cache_implementation`` (its registry entry's example config).
        page_size: token slots per page.
        store: the Redis URL of the store part; ``None``: a ``redis-server`` started for the run on a loopback port.
    """

    prefix_tokens: int = 2048
    question_tokens: int = 64
    new_tokens: int = 8
    num_questions: int = 6
    cache: str = "paged_pool"
    page_size: int = 16
    store: str | None = None

    def __post_init__(self) -> None:
        for name in ("prefix_tokens", "question_tokens", "new_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.num_questions < 2:
            raise ValueError(f"num_questions must be >= 2 (one warm-up, then one timed), got {self.num_questions}.")
        if self.cache not in REGISTRY:
            raise ValueError(f"Unknown cache {self.cache!r}; choose from {sorted(REGISTRY)}.")

    @property
    def tokens_needed(self) -> int:
        """Tokens of the stream the benchmark reads: the document, the evicting prompt, the questions."""
        return self.prefix_tokens + self.evicting_tokens + self.num_questions * self.question_tokens

    @property
    def evicting_tokens(self) -> int:
        """Tokens of the prompt that evicts the document: with its answer, every page of a pool of one request."""
        return self.request_tokens - self.new_tokens

    @property
    def request_tokens(self) -> int:
        """Tokens one request holds at most: a page more than its prompt and answer."""
        return self.prefix_tokens + self.question_tokens + self.new_tokens + self.page_size


@dataclass
class TierResult:
    """One mode of one part (medians over the timed questions)."""

    part: str
    mode: str
    questions_timed: int
    median_ttft_ms: float
    median_total_ms: float
    tokens_reused_per_question: float
    bytes_moved_per_reused_token: float | None  # store: read from the server; host: written back into the pool
    ttft_speedup: float | None = None  # baseline / this, on the second mode's row
    total_speedup: float | None = None
    tokens_match: bool | None = None  # second mode's row: every question's tokens equal the baseline's


class _FirstToken:
    """A ``generate`` streamer that notes when the first new token is handed over (its second ``put``)."""

    def __init__(self) -> None:
        self.puts, self.first_token_at = 0, 0.0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def run_tier_benchmark(model: PreTrainedModel, token_stream: torch.Tensor, config: TierBenchConfig) -> list[TierResult]:
    """Runs both parts (module docstring) on ``model``; starts a ``redis-server`` for the store part unless
    ``config.store`` names one.

    Args:
        token_stream: ``[num_tokens]`` ids, at least ``config.tokens_needed``: the document, the prompt that evicts
            it, then the questions.
    """
    if token_stream.ndim != 1 or token_stream.numel() < config.tokens_needed:
        raise ValueError(
            f"token_stream must be 1-D with at least {config.tokens_needed} tokens, got shape "
            f"{tuple(token_stream.shape)}; lower prefix_tokens, question_tokens or num_questions."
        )
    stream = token_stream.to(model.device)
    size, evicting = config.prefix_tokens, config.evicting_tokens
    document, other = stream[:size], stream[size : size + evicting]
    questions = stream[size + evicting :].split(config.question_tokens)[: config.num_questions]
    prompts = [torch.cat([document, question])[None] for question in questions]  # each [1, prefix + question]
    with _store_url(config.store) as url:
        results = _store_part(model, prompts, config, url)
    return results + _host_part(model, prompts, other[None], config)


def _store_part(
    model: PreTrainedModel, prompts: list[torch.Tensor], config: TierBenchConfig, url: str
) -> list[TierResult]:
    stamp = f"bench-{time.time_ns()}"  # namespaces of this run only: a store used before holds none of them
    publisher = _pool(model, config, config.request_tokens, prefix_store=url)
    _generate(model, prompts[0], publisher, config, namespace=f"{stamp}-warm", max_new_tokens=1)
    publisher.pages.flush_tiers()  # the warm store: another worker published the document
    runs: dict[str, list[tuple[float, float, Any, dict[str, Any]]]] = {mode: [] for mode in PARTS["store"]}
    for index, ids in enumerate(prompts):
        for mode in PARTS["store"]:
            namespace = f"{stamp}-warm" if mode == "warm" else f"{stamp}-cold-{index}"
            pool = _pool(model, config, config.request_tokens, prefix_store=url)  # a worker that just started
            runs[mode].append((*_timed(model, ids, pool, config, namespace), pool.stats()))
            pool.pages.flush_tiers()  # its writes land before the next worker is timed
    return _summarize("store", runs, config, "prefix_store_bytes_read")


def _host_part(
    model: PreTrainedModel, prompts: list[torch.Tensor], other: torch.Tensor, config: TierBenchConfig
) -> list[TierResult]:
    document_bytes = (config.prefix_tokens // config.page_size + 1) * _pool(model, config, 1).stats()["page_bytes"]
    pools = {
        "recompute": _pool(model, config, config.request_tokens, prefix_caching=True),
        "host": _pool(model, config, config.request_tokens, prefix_host_bytes=2 * document_bytes),
    }
    runs: dict[str, list[tuple[float, float, Any, dict[str, Any]]]] = {mode: [] for mode in PARTS["host"]}
    for ids in prompts:
        for mode, pool in pools.items():
            _generate(model, other, pool, config)  # takes every page: evicts the document's
            before = pool.stats()
            first, total, sequences = _timed(model, ids, pool, config)
            after = pool.stats()
            delta = {key: after[key] - before[key] for key in ("prefix_tokens_reused", "prefix_bytes_restored")}
            runs[mode].append((first, total, sequences, delta))
    return _summarize("host", runs, config, "prefix_bytes_restored")


def _summarize(
    part: str, runs: dict[str, list[tuple[float, float, Any, dict[str, Any]]]], config: TierBenchConfig, moved: str
) -> list[TierResult]:
    """The timed questions (all but the first) of each mode of ``part`` as results; ``moved``: the stats key of the
    bytes each question moved."""
    results = []
    for mode, done in runs.items():
        timed = done[1:]
        reused = sum(stats["prefix_tokens_reused"] for *_, stats in timed)
        results.append(
            TierResult(
                part=part,
                mode=mode,
                questions_timed=len(timed),
                median_ttft_ms=statistics.median(first for first, *_ in timed) * 1e3,
                median_total_ms=statistics.median(total for _, total, *_ in timed) * 1e3,
                tokens_reused_per_question=reused / len(timed),
                bytes_moved_per_reused_token=sum(stats[moved] for *_, stats in timed) / reused if reused else None,
            )
        )
    baseline, tiered = results
    tiered.ttft_speedup = baseline.median_ttft_ms / tiered.median_ttft_ms
    tiered.total_speedup = baseline.median_total_ms / tiered.median_total_ms
    modes = list(runs)
    tiered.tokens_match = all(torch.equal(a[2], b[2]) for a, b in zip(runs[modes[0]], runs[modes[1]], strict=True))
    return results


def _pool(model: PreTrainedModel, config: TierBenchConfig, max_tokens: int, **tiers: Any) -> KVPool:
    entry = REGISTRY[config.cache]
    cache_config = entry.config({**entry.example_config, "page_size": config.page_size})
    return KVPool.for_model(model, cache_config, max_tokens=max_tokens, **tiers)


def _generate(
    model: PreTrainedModel, ids: torch.Tensor, pool: KVPool, config: TierBenchConfig, namespace: str = "", **kwargs
):
    cache_config = {**REGISTRY[config.cache].example_config, "pool": pool, "prefix_namespace": namespace}
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache_implementation=config.cache,
        cache_config=cache_config,
        do_sample=False,
        **{"max_new_tokens": config.new_tokens, **kwargs},
    )


def _timed(
    model: PreTrainedModel, ids: torch.Tensor, pool: KVPool, config: TierBenchConfig, namespace: str = ""
) -> tuple[float, float, torch.Tensor]:
    """``(time to first token s, total s, sequences)`` of one question on ``pool``."""
    streamer = _FirstToken()
    start = time.perf_counter()
    sequences = _generate(model, ids, pool, config, namespace, streamer=streamer)
    if sequences.device.type == "cuda":
        torch.cuda.synchronize(sequences.device)
    end = time.perf_counter()
    return streamer.first_token_at - start, end - start, sequences.cpu()


@contextmanager
def _store_url(url: str | None) -> Iterator[str]:
    """``url``, or a ``redis-server`` started on a free loopback port for the block (no persistence, LRU eviction)."""
    if url is not None:
        yield url
        return
    binary = shutil.which("redis-server", path="/usr/bin:/usr/sbin:/usr/local/bin") or shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("The store part needs a Redis server: install redis-server, or pass --store redis://...")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    command += ["--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(10)


def markdown_table(results: Sequence[TierResult]) -> str:
    """Both parts as one Markdown table."""
    lines = [
        "| part | mode | TTFT ms | total ms | reused tokens | bytes moved / reused token | TTFT speedup "
        "| total speedup | tokens match |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        speedups = ("-", "-") if r.ttft_speedup is None else (f"{r.ttft_speedup:.1f}x", f"{r.total_speedup:.1f}x")
        moved = "-" if r.bytes_moved_per_reused_token is None else f"{r.bytes_moved_per_reused_token:,.0f}"
        match = "-" if r.tokens_match is None else ("yes" if r.tokens_match else "no")
        lines.append(
            f"| {r.part} | {r.mode} | {r.median_ttft_ms:.1f} | {r.median_total_ms:.1f} "
            f"| {r.tokens_reused_per_question:.0f} | {moved} | {speedups[0]} | {speedups[1]} | {match} |"
        )
    return "\n".join(lines)


def results_record(results: Sequence[TierResult], config: TierBenchConfig, info: dict[str, Any]) -> dict[str, Any]:
    """The JSON-ready record of one invocation: machine, settings (the store's URL left out), results."""
    return measure.results_record(results, dataclasses.replace(config, store=None), info)
