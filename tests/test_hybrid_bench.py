"""The op count and the decode benchmark on a hybrid linear-attention model (``hf_kvcache.bench.ops``,
``hf_kvcache.bench.hybrid``), at a tiny size: every cache of ours through ``generate(cache_implementation=...)``
against ``DynamicCache``, and the two scripts end to end. No timing is asserted (timings live in benchmarks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_kvcache import KVPool
from hf_kvcache.bench import hybrid
from hf_kvcache.bench.ops import CACHES, count_decode_ops, markdown_table
from hf_kvcache.integration.registry import REGISTRY

ROOT = Path(__file__).parents[1]
ATTENTIONS = ("sdpa", "hf_kvcache")
ATTENTION_LAYERS = 2  # tiny_hybrid's 4 layers: linear attention, full attention, twice
OP_BOUNDS = {"paged_pool": 1.1, "sliding_ring": 1.1, "quantized_values": 1.5, "quantized_kv": 1.5}
"""The most ops an eager decode step of each cache may dispatch against DynamicCache's (issue 44)."""


@pytest.fixture(autouse=True)
def drop_default_pools():
    yield
    KVPool.drop_defaults()


@pytest.fixture(scope="module")
def model():
    return hybrid.hybrid_bench_model("qwen3_5_text", "tiny")


@pytest.fixture(scope="module")
def op_rows(model):
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    return count_decode_ops(model, ids, ATTENTIONS)


def test_every_cache_is_counted_eager_and_planned_under_each_attention(op_rows):
    keys = [(row.cache, row.attention, row.step) for row in op_rows]
    ours = [name for name, config in CACHES.items() if config is not None]
    steps = [(name, step) for name in ours for step in ("eager", "planned")]
    expected = [("dynamic", "sdpa", "eager")] + [
        (name, attention, step) for attention in ATTENTIONS for name, step in steps
    ]
    assert keys == expected
    assert op_rows[0].ops_vs_dynamic == 1.0 and op_rows[0].page_ops_vs_dynamic == 1.0


def test_no_step_reads_the_device_from_the_host(op_rows):
    assert all(row.host_reads == 0 and row.planning_host_reads == 0 for row in op_rows)


def test_an_eager_step_reads_the_attention_layers_only_within_its_op_bound(op_rows):
    """One read per attention layer (the linear-attention layers are transformers' own), and the bounds on a step's
    ops against DynamicCache hold on a hybrid too: 1.1x for the lossless caches, 1.5x for the quantized ones (a step,
    and a page of steps, where a page's fill encodes keys)."""
    for row in op_rows[1:]:
        if row.step == "eager":
            paths = {path: count for path, count in row.reads.items() if path != "flex"}
            assert sum(paths.values()) == ATTENTION_LAYERS, row
            bound = OP_BOUNDS[row.cache]
            assert row.ops_vs_dynamic <= bound, row
            assert row.page_ops_vs_dynamic <= bound, row
        else:
            assert row.page_ops is None and row.planning_ops > 0, row
    ring = next(
        row for row in op_rows if (row.cache, row.attention, row.step) == ("sliding_ring", ATTENTIONS[1], "eager")
    )
    assert ring.reads["gather"] == ATTENTION_LAYERS  # a window reads in place past flex.MIN_IN_PLACE_TOKENS only
    table = markdown_table(op_rows)
    assert table.count("\n") == len(op_rows) + 1


@pytest.fixture(scope="module")
def bench(model):
    rows = (*hybrid.DEFAULT_ROWS, f"paged_pool@{hybrid.ATTENTION_NAME}:compiled")
    config = hybrid.HybridBenchConfig(cells=((40, 2),), rows=rows, steps=2, warmup_steps=1, rounds=2)
    torch._dynamo.reset()
    try:
        return config, hybrid.run_hybrid_benchmark(model, config)
    finally:
        torch._dynamo.reset()


def test_the_benchmark_runs_every_row_through_generate(bench):
    config, results = bench
    assert [result.row for result in results] == list(config.rows)
    assert all(len(result.round_median_step_ms) == config.rounds and result.tokens_per_s > 0 for result in results)
    by_row = {result.row: result for result in results}
    for name in ("paged_pool", "sliding_ring"):  # lossless here (the ring's window is longer than the rows)
        assert by_row[name].tokens_match and by_row[f"{name}@hf_kvcache"].tokens_match
    # the layers that are not attention are transformers' own in every cache: the same states
    assert len({result.state_bytes for result in results}) == 1 and results[0].state_bytes > 0
    assert all(result.kv_bytes_held > 0 for result in results)


def test_rows_say_their_attention_path_and_whether_they_compiled(bench):
    config, results = bench
    forwards = config.warmup_steps + config.steps + 1  # a prefill, then a step per new token after the first
    for result in results:
        assert result.attention == ("hf_kvcache" if "@hf_kvcache" in result.row else "sdpa")
        if result.row.endswith(":compiled"):
            assert result.compiled and result.recompiles == 0 and result.first_call_s > 0
        elif result.cache in REGISTRY:
            assert not result.compiled
            reads = {path: count for path, count in result.reads.items() if path != "flex"}
            assert sum(reads.values()) == ATTENTION_LAYERS * forwards, result
    paths = {result.row: result.reads for result in results}
    assert paths["paged_pool"]["gather"] == ATTENTION_LAYERS * forwards  # sdpa: gathered
    assert paths["sliding_ring@hf_kvcache"]["gather"] == ATTENTION_LAYERS * forwards  # short: gathered


@pytest.mark.parametrize(
    ("row", "message"),
    [("paged", "Unknown row"), ("paged_pool@eager", "Unknown row"), ("dynamic:compiled", "not compileable")],
)
def test_bad_rows_are_refused_by_name(row, message):
    with pytest.raises(ValueError, match=message):
        hybrid.HybridBenchConfig(rows=(hybrid.BASELINE, row))
    with pytest.raises(ValueError, match="must include"):
        hybrid.HybridBenchConfig(rows=("paged_pool",))


def _script(tmp_path: Path, *args: str) -> dict:
    output = tmp_path / "record.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, *args, "--output", str(output)]
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    return json.loads(output.read_text())


def test_the_scripts_run_a_tiny_hybrid(tmp_path):
    ops = _script(tmp_path, "scripts/count_decode_ops.py", "--model", "lfm2", "--size", "tiny", "--length", "24")
    assert ops["model"]["model_type"] == "lfm2" and ops["results"][0]["cache"] == "dynamic"
    assert len(ops["results"]) == 1 + 2 * (len(CACHES) - 1)  # under the model's own attention only
    timed = _script(
        tmp_path,
        *("scripts/bench_decode.py", "--suite", "hybrid", "--size", "tiny", "--lengths", "24", "--batches", "1"),
        *("--steps", "2", "--rounds", "1", "--rows", "paged_pool@hf_kvcache", "quantized_kv"),
    )
    assert timed["benchmark"] == "decode_hybrid" and timed["model"]["model_type"] == "qwen3_5_text"
    assert [result["row"] for result in timed["results"]] == ["dynamic", "paged_pool@hf_kvcache", "quantized_kv"]
