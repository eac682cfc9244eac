"""How much of the KV memory a padded batch spends on live tokens (``scripts/bench_memory.py``).

Requests of random token ids (prompt lengths and budgets of new tokens drawn uniformly, with a fixed seed) are
served in left-padded batches with an attention mask, through the path a user gets:
``model.generate(..., cache_implementation=NAME)``, our pool caches with ``cache_config={"pool": pool}`` on a fresh
pool per batch (its statistics are then that cache's alone), ``"static"`` with ``max_cache_len`` the longest prompt
plus the largest budget of the whole workload (a cache sized for the service). A batch runs to the largest budget of
its requests (greedy, no early stop).

After every forward pass a ``LogitsProcessor`` measures the cache:

- **bytes and slots held**: our caches, the pages the pool has handed out (``KVPool.stats()``: ``pages_used`` x
  ``page_bytes``); transformers' caches, the bytes of their key and value tensors (``numel() * element_size()``,
  every layer). A slot is one token's keys and values in every layer, so ``slots = bytes / slot_bytes``.
- **live tokens**: per row, its real prompt tokens plus the tokens generated so far, for rows still within their
  own budget; a request whose budget is spent is not live, though the batch goes on and its cache still holds it.
- **held tokens**: real tokens of every row, live or done (not padding): the pool's ``tokens_held`` counts these.

Utilization depends on token counts, not on weights: the model is a tiny random-init Llama of a given KV geometry
(``MemoryBenchConfig``: SmolLM2-135M's by default).
"""

import dataclasses
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Cache, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from hf_kvcache.caches import PagedConfig
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.memory.pool import KVPool
from hf_kvcache.testing import random_padded_batch, tiny_llama

CONTIGUOUS_CACHES = ("dynamic", "static")
"""transformers' ``cache_implementation`` names measured from their tensors."""


@dataclass(frozen=True)
class Workload:
    """Requests served in batches: token counts drawn uniformly in the inclusive ranges, with ``seed``.

    Attributes:
        name: the workload's key in the record.
        num_requests: requests, served ``batch_size`` at a time in the order drawn (the last batch may be smaller).
        batch_size: rows per ``generate`` call.
        prompt_tokens: ``(low, high)`` tokens per prompt.
        new_tokens: ``(low, high)`` tokens each request generates (its budget).
        seed: seeds the draw of lengths, budgets and token ids.
    """

    name: str
    num_requests: int
    batch_size: int
    prompt_tokens: tuple[int, int]
    new_tokens: tuple[int, int]
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("prompt_tokens", "new_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {getattr(self, name)}.")

    @property
    def max_row_tokens(self) -> int:
        """Tokens the longest row this workload can draw reaches: the top of both ranges."""
        return self.prompt_tokens[1] + self.new_tokens[1]


PADDED_BATCH = Workload("padded_batch", num_requests=8, batch_size=8, prompt_tokens=(40, 1500), new_tokens=(32, 32))
SERVING = Workload("serving", num_requests=32, batch_size=8, prompt_tokens=(50, 2000), new_tokens=(32, 256))


@dataclass(frozen=True)
class MemoryBenchConfig:
    """What the memory benchmark measures, and the KV geometry of its model.

    Attributes:
        workloads: the workloads, each served by every cache.
        caches: ``cache_implementation`` names: ``"dynamic"``, ``"static"`` and ours (``REGISTRY``).
        num_layers / num_kv_heads / head_dim: the model's KV geometry (SmolLM2-135M's by default).
        page_size: token slots per page of our pools.
        vocab_size: the tiny model's vocabulary; prompt ids are drawn from ``[3, vocab_size)``.
    """

    workloads: tuple[Workload, ...] = (PADDED_BATCH, SERVING)
    caches: tuple[str, ...] = ("dynamic", "static", "paged_pool")
    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64
    page_size: int = 16
    vocab_size: int = 128

    def __post_init__(self) -> None:
        unknown = [cache for cache in self.caches if cache not in CONTIGUOUS_CACHES and cache not in REGISTRY]
        if unknown or not self.caches:
            raise ValueError(f"caches must name some of {[*CONTIGUOUS_CACHES, *REGISTRY]}, got {self.caches}.")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4 (ids 0-2 are pad, bos, eos), got {self.vocab_size}.")


@dataclass(frozen=True)
class StepFigures:
    """One cache's memory after one forward pass.

    Attributes:
        batch / step: the batch (0-based) and its step (0: the prefill; ``k``: ``k`` tokens generated).
        live_tokens: tokens of the rows still within their budget (real prompt tokens plus those generated).
        held_tokens: real tokens of every row, live or done (no padding).
        slots: token slots the cache holds (``bytes / slot_bytes``); ours, ``pages * page_size``.
        pages: pages the pool has handed out (ours; ``None`` for transformers' caches).
        bytes: bytes of keys and values the cache holds.
        live_share: ``live_tokens / slots``, the share of the KV bytes holding live tokens.
        pool_tokens_held / pool_utilization: the pool's own ``tokens_held`` and ``utilization`` (ours only).
    """

    batch: int
    step: int
    live_tokens: int
    held_tokens: int
    slots: int
    pages: int | None
    bytes: int
    live_share: float
    pool_tokens_held: int | None = None
    pool_utilization: float | None = None


@dataclass
class MemoryResult:
    """One cache on one workload.

    Attributes:
        workload / cache: what was measured.
        num_steps: forward passes measured (every batch's prefill and decode steps).
        mean_live_share: the mean over those steps of ``StepFigures.live_share``.
        mean_held_share: the mean over those steps of ``held_tokens / slots`` (what padding and unfilled slots
            leave; ``1 - mean_live_share`` also counts the tokens of requests already done).
        peak: the step holding the most bytes; of several (a ``StaticCache`` holds the same bytes at every step, a
            page several steps), the one with the fewest live tokens: the worst share at the peak of memory.
        last: the last step of the last batch.
        max_cache_len: the rows' capacity of ``"static"`` (``None`` otherwise).
    """

    workload: str
    cache: str
    num_steps: int
    mean_live_share: float
    mean_held_share: float
    peak: StepFigures
    last: StepFigures
    max_cache_len: int | None = None


@dataclass
class Batch:
    """One ``generate`` call's requests.

    Attributes:
        input_ids / attention_mask: the prompts, left-padded, ``[rows, width]`` int64 (``width = max(lengths)``).
        lengths: real prompt tokens of each row.
        budgets: new tokens each row's request asks for.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: list[int]
    budgets: list[int]

    @classmethod
    def random(cls, lengths: list[int], budgets: list[int], vocab_size: int, generator: torch.Generator) -> "Batch":
        """Rows of random ids in ``[3, vocab_size)`` (no pad, bos or eos) of the given lengths, drawn with
        ``generator``."""
        if len(lengths) != len(budgets) or not lengths or min(lengths) < 1 or min(budgets) < 1:
            raise ValueError(f"Need as many lengths as budgets, all >= 1; got {lengths} and {budgets}.")
        input_ids, attention_mask = random_padded_batch(lengths, vocab_size, generator, low=3)
        return cls(input_ids, attention_mask, lengths, budgets)


@dataclass
class _Probe(LogitsProcessor):
    """Measures the cache after each forward pass of one batch (``__call__`` leaves the scores as they are)."""

    batch: Batch
    batch_idx: int
    slot_bytes: int
    pool: KVPool | None
    cache: Cache | None = None
    steps: list[StepFigures] = field(default_factory=list)

    def capture(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: keeps the cache ``generate`` passes to the model (transformers' ``cache=`` keyword, or
        ``past_key_values=`` in older versions)."""
        self.cache = kwargs.get("cache", kwargs.get("past_key_values", self.cache))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.batch.input_ids.shape[1]  # tokens generated so far, each in the cache
        live = sum(length + step for length, budget in zip(self.batch.lengths, self.batch.budgets) if step < budget)
        held = sum(length + step for length in self.batch.lengths)
        pages = tokens_held = utilization = None
        if self.pool is not None:
            stats = self.pool.stats()
            pages, tokens_held, utilization = stats["pages_used"], stats["tokens_held"], stats["utilization"]
            num_bytes, slots = pages * stats["page_bytes"], pages * stats["page_size"]
        else:
            num_bytes = contiguous_cache_bytes(self.cache)
            slots = num_bytes // self.slot_bytes
        self.steps.append(
            StepFigures(
                self.batch_idx, step, live, held, slots, pages, num_bytes, live / slots, tokens_held, utilization
            )
        )
        return scores


def contiguous_cache_bytes(cache: Cache) -> int:
    """Bytes of the key and value tensors of every layer of a transformers cache (``DynamicCache``,
    ``StaticCache``); a layer not yet written holds none."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def bench_model(config: MemoryBenchConfig, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """The tiny random-init Llama of ``config``'s KV geometry (one query head per KV head, a hidden size of 16 per
    head), with room for every workload's longest row."""
    max_positions = max(workload.max_row_tokens for workload in config.workloads)
    model = tiny_llama(
        num_hidden_layers=config.num_layers,
        hidden_size=16 * config.num_kv_heads,
        intermediate_size=32 * config.num_kv_heads,
        num_attention_heads=config.num_kv_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        max_position_embeddings=max(512, max_positions),
    )
    return model.to(device=device, dtype=dtype)


def draw_batches(workload: Workload, vocab_size: int) -> list[Batch]:
    """The workload's requests, drawn with its seed, as left-padded batches in the order drawn."""
    generator = torch.Generator().manual_seed(workload.seed)
    lengths = torch.randint(
        workload.prompt_tokens[0], workload.prompt_tokens[1] + 1, (workload.num_requests,), generator=generator
    )
    budgets = torch.randint(
        workload.new_tokens[0], workload.new_tokens[1] + 1, (workload.num_requests,), generator=generator
    )
    batches = []
    for start in range(0, workload.num_requests, workload.batch_size):
        rows = slice(start, start + workload.batch_size)
        batches.append(Batch.random(lengths[rows].tolist(), budgets[rows].tolist(), vocab_size, generator))
    return batches


def measure_cache(
    model: PreTrainedModel, batches: Sequence[Batch], cache: str, config: MemoryBenchConfig, workload: str = ""
) -> MemoryResult:
    """Serves ``batches``, one ``generate`` call each, with ``cache`` on ``model`` (of ``config``'s geometry) and
    measures the cache after every forward pass. ``"static"`` is sized for the service: ``max_cache_len`` is the
    longest prompt plus the largest budget of all the batches."""
    slot_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * model.dtype.itemsize
    max_cache_len = max(max(batch.lengths) for batch in batches) + max(max(batch.budgets) for batch in batches)
    steps: list[StepFigures] = []
    for batch_idx, batch in enumerate(batches):
        num_new = max(batch.budgets)
        kwargs: dict[str, Any] = {"cache_implementation": cache}
        pool = None
        if cache == "static":
            kwargs["max_cache_len"] = max_cache_len
        elif cache not in CONTIGUOUS_CACHES:
            # every row at full width, plus room for the pages admission counts ahead (only pages taken are counted)
            max_tokens = len(batch.lengths) * (batch.input_ids.shape[1] + num_new + 4 * config.page_size)
            pool = KVPool.for_model(model, PagedConfig(page_size=config.page_size), max_tokens=max_tokens)
            kwargs["cache_config"] = {"pool": pool}
        probe = _Probe(batch, batch_idx, slot_bytes, pool)
        hook = model.register_forward_pre_hook(probe.capture, with_kwargs=True)
        try:
            model.generate(
                batch.input_ids.to(model.device),
                attention_mask=batch.attention_mask.to(model.device),
                max_new_tokens=num_new,
                min_new_tokens=num_new,  # no early stop: the batch runs to its largest budget
                do_sample=False,
                logits_processor=LogitsProcessorList([probe]),
                **kwargs,
            )
        finally:
            hook.remove()
        if len(probe.steps) != num_new:
            raise RuntimeError(f"{cache}: measured {len(probe.steps)} steps of batch {batch_idx}, expected {num_new}.")
        steps.extend(probe.steps)
    peak = max(steps, key=lambda figures: (figures.bytes, -figures.live_tokens))
    return MemoryResult(
        workload=workload,
        cache=cache,
        num_steps=len(steps),
        mean_live_share=sum(figures.live_share for figures in steps) / len(steps),
        mean_held_share=sum(figures.held_tokens / figures.slots for figures in steps) / len(steps),
        peak=peak,
        last=steps[-1],
        max_cache_len=max_cache_len if cache == "static" else None,
    )


def run_memory_benchmark(
    config: MemoryBenchConfig, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> list[MemoryResult]:
    """Every cache of ``config`` on every workload, each workload on a model of its own (``bench_model``, so that
    transformers' memory of an earlier static cache's size does not carry over).

    Returns:
        One ``MemoryResult`` per workload and cache, workload by workload.
    """
    device = device or torch.device("cpu")
    results = []
    for workload in config.workloads:
        model = bench_model(dataclasses.replace(config, workloads=(workload,)), device, dtype)
        batches = draw_batches(workload, config.vocab_size)
        results.extend(measure_cache(model, batches, cache, config, workload.name) for cache in config.caches)
    return results


def git_state(path: Path) -> dict[str, Any]:
    """The commit of the git checkout holding ``path`` and whether its tracked files differ from it (``None``s
    outside a checkout)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "modified": None}
    return {"commit": commit, "modified": sorted(line[3:] for line in changed if line)}


def markdown_table(results: Sequence[MemoryResult]) -> str:
    """The results as a Markdown table: shares in percent, bytes in MiB."""
    lines = [
        "| workload | cache | live share at peak | mean live share | mean held share | peak MiB | slots at peak "
        "| pages at peak | held tokens at peak | last: live tokens / slots (pages) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for result in results:
        peak, last = result.peak, result.last
        peak_pages, last_pages = (figures.pages if figures.pages is not None else "-" for figures in (peak, last))
        lines.append(
            f"| {result.workload} | {result.cache} | {100 * peak.live_share:.1f}% "
            f"| {100 * result.mean_live_share:.1f}% | {100 * result.mean_held_share:.1f}% | {peak.bytes / 2**20:.1f} "
            f"| {peak.slots:,} | {peak_pages} "
            f"| {peak.held_tokens:,} | {last.live_tokens:,} / {last.slots:,} ({last_pages}) "
            f"= {100 * last.live_share:.1f}% |"
        )
    return "\n".join(lines)
