"""Decode on a hybrid linear-attention model, as ``generate(cache_implementation=NAME)`` runs it, each of our caches
against ``DynamicCache``.

The model (``hybrid_bench_model``) is a hybrid of ``hf_kvcache.testing.HYBRIDS`` built from its config with random
weights at a size where attention matters at a few thousand tokens: Qwen3.5's layout (three Gated DeltaNet
linear-attention layers, then a full-attention one, twice), 8 query heads over 2 KV heads of 64 channels. Our caches
keep transformers' own layers for the linear-attention (or convolution) layers and page the attention layers; their
steps differ from ``DynamicCache``'s in the attention layers only.

A *row* is ``CACHE[@ATTENTION][:compiled]``: ``dynamic`` (``DynamicCache``, the baseline) or a registered cache of
ours, under the model's own attention (``"sdpa"``: our pages gathered) or ``@hf_kvcache`` (read in place where that
applies), eager or with ``generate`` compiling its decode steps (``CompileConfig(mode=...)`` with
``_compile_all_devices = True``; a cache ``generate`` does not compile runs eager, and the row says so). Each run is
one ``generate`` call on fresh prompt rows of random ids (seeded, no padding): its own prefill (untimed), then
``warmup_steps + steps`` decode steps; a logits processor stamps each step and the timed steps' median gives
tokens/s. Compiled rows first run once untimed (their compile, ``first_call_s``); then every row runs ``rounds``
times, interleaved. Reported per row: tokens/s and its ratio to ``dynamic``'s in the same run, graphs compiled during
the timed rounds, how attention read the pages (eager rows), the attention layers' KV bytes and the other layers'
state bytes at the end, and whether the greedy tokens equal ``dynamic``'s.
"""

import gc
import logging
import statistics
import time
import unittest.mock
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import Cache, CompileConfig, PreTrainedModel

from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import ATTENTION_NAME, model_attention
from hf_kvcache.bench import measure
from hf_kvcache.bench.compiled import RECOMPILE_LIMIT, ROW_CONFIGS, StepClock, compiled_graphs
from hf_kvcache.caches.base import PoolCache
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.testing import HYBRIDS, tiny_hybrid

logger = logging.getLogger("hf_kvcache.bench")

BASELINE = "dynamic"
BENCH_SIZES: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "max_position_embeddings": 32768,
    },
    "lfm2": {
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "block_ff_dim": 1408,
        "num_hidden_layers": 8,
        "layer_types": (["conv"] * 3 + ["full_attention"]) * 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 32768,
    },
}
"""The sizes of ``hybrid_bench_model`` per hybrid model type, beside ``HYBRIDS``' settings."""
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def hybrid_bench_model(
    model_type: str = "qwen3_5_text",
    size: str = "bench",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """A random-init hybrid (seed 0) of ``model_type`` (a key of ``HYBRIDS``) under ``"sdpa"``, in eval mode.

    Args:
        size: ``"bench"`` (``BENCH_SIZES``: a Qwen3.5-like layout, about 40 M parameters) or ``"tiny"``
            (``tiny_hybrid``'s 4 layers of 64 channels, for tests).

    Raises:
        ValueError: an unknown model type or size.
    """
    if model_type not in HYBRIDS or size not in ("bench", "tiny"):
        raise ValueError(
            f"model_type must be one of {sorted(HYBRIDS)} and size 'bench' or 'tiny'; got {model_type!r}, {size!r}."
        )
    overrides = BENCH_SIZES[model_type] if size == "bench" else {"max_position_embeddings": 32768}
    model = tiny_hybrid(model_type, **overrides).to(device=device, dtype=dtype)
    model.generation_config.eos_token_id = None  # every run makes its max_new_tokens tokens
    return model


def describe(model: PreTrainedModel) -> dict[str, Any]:
    """The record's ``model``: the type, the layer types and the sizes of the config it was built from."""
    config = model.config
    names = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    return {
        "model_type": config.model_type,
        "weights": "random (seed 0)",
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "layer_types": list(config.layer_types),
        **{name: getattr(config, name, None) for name in names},
    }


@dataclass(frozen=True)
class Row:
    """A row's cache, attention (``None``: the model's own) and whether ``generate`` is asked to compile."""

    cache: str
    attention: str | None
    compiled: bool

    @classmethod
    def parse(cls, text: str) -> "Row":
        """``CACHE[@ATTENTION][:compiled]``.

        Raises:
            ValueError: an unknown cache, attention or suffix, or ``dynamic:compiled``.
        """
        head, _, suffix = text.partition(":")
        cache, _, attention = head.partition("@")
        names = (BASELINE, *REGISTRY)
        if cache not in names or attention not in ("", "sdpa", ATTENTION_NAME) or suffix not in ("", "compiled"):
            raise ValueError(
                f"Unknown row {text!r}: a row is CACHE[@ATTENTION][:compiled], CACHE one of {list(names)}, "
                f"ATTENTION 'sdpa' or {ATTENTION_NAME!r}."
            )
        if cache == BASELINE and suffix:
            raise ValueError("DynamicCache is not compileable: generate runs it eager; drop ':compiled'.")
        return cls(cache, attention or None, bool(suffix))


DEFAULT_ROWS = (BASELINE, *(row for name in REGISTRY for row in (name, f"{name}@{ATTENTION_NAME}")))
"""``dynamic``, then each of our caches under the model's own attention and under ours, eager."""


@dataclass(frozen=True)
class HybridBenchConfig:
    """What to measure.

    Attributes:
        cells: ``(prompt length, batch)`` pairs.
        rows: see the module docstring; must include ``dynamic``.
        steps / warmup_steps: timed / untimed decode steps per run.
        rounds: timed runs of each row per cell, interleaved.
        mode: ``CompileConfig.mode`` of the compiled rows.
    """

    cells: tuple[tuple[int, int], ...] = ((1024, 1), (4096, 1), (4096, 8))
    rows: tuple[str, ...] = DEFAULT_ROWS
    steps: int = 24
    warmup_steps: int = 3
    rounds: int = 2
    mode: str = "default"

    def __post_init__(self) -> None:
        measure.check_settings(self, {})
        if BASELINE not in self.rows:
            raise ValueError(f"rows must include {BASELINE!r}: the baseline of ratios and token checks.")
        for row in self.rows:
            Row.parse(row)
        if not self.cells or any(length < 1 or batch < 1 for length, batch in self.cells):
            raise ValueError(f"cells must be (length >= 1, batch >= 1) pairs, got {self.cells!r}.")


@dataclass
class HybridResult:
    """One row at one cell, over its timed rounds (see the module docstring)."""

    row: str
    cache: str
    attention: str
    compiled: bool  # generate compiled the decode steps
    length: int
    batch: int
    median_step_ms: float
    round_median_step_ms: list[float]
    tokens_per_s: float
    ratio_vs_dynamic: float
    first_call_s: float
    recompiles: int
    kv_bytes_held: int  # the attention layers' (our pages; DynamicCache's tensors)
    kv_bytes_vs_dynamic: float
    state_bytes: int  # the other layers' (transformers' own layers in both)
    tokens_match: bool
    reads: dict[str, int] = field(default_factory=dict)


def _tensor_bytes(value: Any) -> int:
    """Bytes of the tensors of a cache layer's attributes (``LinearAttentionLayer`` keeps its states in dicts); 0-dim
    tensors are counters."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() if value.dim() > 0 else 0
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def held_bytes(cache: Cache, layer_types: Sequence[str]) -> tuple[int, int]:
    """``(attention KV bytes, other layers' state bytes)`` a cache holds: our pages (``memory_stats``) or
    ``DynamicCache``'s attention layers' tensors, and the tensors of the layers of other types."""
    attention = [index for index, kind in enumerate(layer_types) if kind in ATTENTION_LAYER_TYPES]
    others = sum(_tensor_bytes(vars(layer)) for index, layer in enumerate(cache.layers) if index not in attention)
    if isinstance(cache, PoolCache):
        return cache.memory_stats()["bytes_held"], others
    return sum(_tensor_bytes(vars(cache.layers[index])) for index in attention), others


def _run(model: PreTrainedModel, ids: torch.Tensor, row: Row, config: HybridBenchConfig) -> dict[str, Any]:
    """One ``generate`` call of ``row`` over ``ids`` ``[batch, length]``."""
    compile_config = None
    if row.compiled:
        compile_config = CompileConfig(mode=config.mode)
        compile_config._compile_all_devices = True  # on CPU generate compiles only when told
    settings = {}
    if row.cache != BASELINE:
        settings = {"cache_implementation": row.cache, "cache_config": dict(ROW_CONFIGS.get(row.cache, {}))}
    clock = StepClock()
    new_tokens = config.warmup_steps + config.steps + 1  # the first comes from the prefill
    graphs, flex_calls = compiled_graphs(), flex.call_count()
    began = time.perf_counter()
    with model_attention(model, row.attention):
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            compile_config=compile_config,
            disable_compile=not row.compiled,  # on CUDA generate compiles a compileable cache unless told not to
            logits_processor=[clock],
            return_dict_in_generate=True,
            **settings,
        )
    wall_s = time.perf_counter() - began
    cache = out.cache
    kv, states = held_bytes(cache, model.config.layer_types)
    ran_compiled = row.compiled and isinstance(cache, PoolCache) and bool(cache.compiled_decoding)
    reads = {}
    if isinstance(cache, PoolCache):
        reads = {**cache.read_counts(), "flex": flex.call_count() - flex_calls}
        cache.release()
    return {
        "compiled": ran_compiled,
        "step_s": [after - before for before, after in zip(clock.stamps, clock.stamps[1:])][config.warmup_steps :],
        "tokens": out.sequences[:, ids.shape[1] :].cpu(),
        "wall_s": wall_s,
        "graphs": compiled_graphs() - graphs,
        "kv_bytes": kv,
        "state_bytes": states,
        "reads": reads,
    }


def run_hybrid_benchmark(model: PreTrainedModel, config: HybridBenchConfig) -> list[HybridResult]:
    """Measures every row at every cell (see the module docstring); dynamo may compile a graph per cell and row."""
    rows = {text: Row.parse(text) for text in config.rows}
    results = []
    with unittest.mock.patch.object(torch._dynamo.config, "recompile_limit", RECOMPILE_LIMIT), torch.no_grad():
        for length, batch in config.cells:
            generator = torch.Generator().manual_seed(length * 1000 + batch)
            ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=generator).to(model.device)
            first_call = {}
            for text, row in rows.items():  # the compiles, untimed
                if row.compiled:
                    first_call[text] = _run(model, ids, row, config)
                    logger.info("%s at %d x %d: first call %.1f s", text, length, batch, first_call[text]["wall_s"])
            runs: dict[str, list[dict]] = {text: [] for text in rows}
            for round_index in range(config.rounds):
                for text, row in rows.items():
                    run = _run(model, ids, row, config)
                    runs[text].append(run)
                    logger.info(
                        "%s at %d x %d, round %d: median step %.2f ms (%s)",
                        *(text, length, batch, round_index, 1e3 * statistics.median(run["step_s"])),
                        "compiled" if run["compiled"] else "eager",
                    )
                    gc.collect()
            results += _summarize(model, rows, runs, first_call, length, batch)
    return results


def _summarize(
    model: PreTrainedModel,
    rows: dict[str, Row],
    runs: dict[str, list[dict]],
    first_call: dict[str, dict],
    length: int,
    batch: int,
) -> list[HybridResult]:
    median = {text: statistics.median(s for run in rs for s in run["step_s"]) for text, rs in runs.items()}
    baseline = runs[BASELINE]
    own = model.config._attn_implementation
    results = []
    for text, rs in runs.items():
        row = rows[text]
        first = first_call.get(text)
        results.append(
            HybridResult(
                row=text,
                cache=row.cache,
                attention=row.attention or own,
                compiled=all(run["compiled"] for run in rs),
                length=length,
                batch=batch,
                median_step_ms=1000 * median[text],
                round_median_step_ms=[1000 * statistics.median(run["step_s"]) for run in rs],
                tokens_per_s=batch / median[text],
                ratio_vs_dynamic=median[BASELINE] / median[text],
                first_call_s=first["wall_s"] if first else 0.0,
                recompiles=sum(run["graphs"] for run in rs),
                kv_bytes_held=rs[-1]["kv_bytes"],
                kv_bytes_vs_dynamic=rs[-1]["kv_bytes"] / baseline[-1]["kv_bytes"],
                state_bytes=rs[-1]["state_bytes"],
                tokens_match=all(torch.equal(run["tokens"], base["tokens"]) for run, base in zip(rs, baseline)),
                reads=rs[-1]["reads"],
            )
        )
    return results


def markdown_table(results: Sequence[HybridResult]) -> str:
    lines = [
        "| cell | row | attention | compiled | tok/s | vs DynamicCache | recompiles | reads (last run) "
        "| KV bytes vs Dynamic | tokens equal |",
        "|---|---|---|---|---:|---:|---:|---|---:|---|",
    ]
    for r in results:
        reads = ", ".join(f"{path} {count}" for path, count in r.reads.items() if count)
        lines.append(
            f"| {r.length:,} x {r.batch} | {r.row} | {r.attention} | {r.compiled} | {r.tokens_per_s:.1f} | "
            f"{r.ratio_vs_dynamic:.2f}x | {r.recompiles} | {reads} | {r.kv_bytes_vs_dynamic:.2f} | {r.tokens_match} |"
        )
    return "\n".join(lines)


def results_record(
    results: Sequence[HybridResult], config: HybridBenchConfig, model: PreTrainedModel, info: dict
) -> dict:
    return {
        "benchmark": "decode_hybrid",
        "model": describe(model),
        "config": asdict(config),
        "machine": info,
        "results": [asdict(result) for result in results],
    }
