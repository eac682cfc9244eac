"""Tests for the memory benchmark (hf_kvcache.bench.memory) on a tiny random Llama: the figures agree with each other
and with the pool's statistics, and a padded row holds no page of padding alone."""

import json
import math

import pytest
import torch
from transformers import PreTrainedModel

from hf_kvcache.bench.measure import results_record
from hf_kvcache.bench.memory import (
    Batch,
    MemoryBenchConfig,
    MemoryResult,
    Workload,
    bench_model,
    draw_batches,
    markdown_table,
    measure_cache,
    run_memory_benchmark,
)

LENGTHS, BUDGETS = [5, 100], [2, 4]  # one row mostly padding: 95 of its 100 positions
CONFIG = MemoryBenchConfig(
    workloads=(Workload("tiny", num_requests=3, batch_size=2, prompt_tokens=(5, 40), new_tokens=(2, 5)),),
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    page_size=16,
)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return bench_model(CONFIG, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def padded(model: PreTrainedModel) -> dict[str, MemoryResult]:
    batch = Batch.random(LENGTHS, BUDGETS, CONFIG.vocab_size, torch.Generator().manual_seed(0))
    return {cache: measure_cache(model, [batch], cache, CONFIG, "padded") for cache in CONFIG.caches}


def test_a_padded_row_holds_no_page_of_padding_alone(padded: dict[str, MemoryResult]) -> None:
    width, page_size = max(LENGTHS), CONFIG.page_size
    for figures in (padded["paged_pool"].peak, padded["paged_pool"].last):
        tokens = width + figures.step  # every row's positions, padding included
        expected = sum(math.ceil(tokens / page_size) - (width - length) // page_size for length in LENGTHS)
        assert figures.pages == expected
        assert figures.slots == expected * page_size
    # the last step, 3 tokens generated: the short row's budget of 2 is spent, so only the long row is live
    last = padded["paged_pool"].last
    assert last.step == max(BUDGETS) - 1 and last.live_tokens == LENGTHS[1] + last.step
    assert last.held_tokens == sum(LENGTHS) + len(LENGTHS) * last.step


def test_paged_figures_are_the_pools(padded: dict[str, MemoryResult]) -> None:
    for figures in (padded["paged_pool"].peak, padded["paged_pool"].last):
        assert figures.pool_tokens_held == figures.held_tokens
        assert figures.pool_utilization == pytest.approx(figures.held_tokens / figures.slots)


def test_paged_pool_spends_more_of_a_padded_batch_on_live_tokens(padded: dict[str, MemoryResult]) -> None:
    paged, dynamic, static = padded["paged_pool"], padded["dynamic"], padded["static"]
    assert paged.peak.live_share > dynamic.peak.live_share
    assert paged.mean_live_share > dynamic.mean_live_share >= static.mean_live_share
    # transformers' caches hold every row at the padded width: DynamicCache what was written, StaticCache its capacity
    assert dynamic.last.slots == len(LENGTHS) * (max(LENGTHS) + dynamic.last.step)
    assert static.max_cache_len == max(LENGTHS) + max(BUDGETS)
    assert static.peak.slots == len(LENGTHS) * static.max_cache_len


def test_the_benchmark_records_every_cache_on_every_workload() -> None:
    results = run_memory_benchmark(CONFIG)
    assert [(r.workload, r.cache) for r in results] == [("tiny", cache) for cache in CONFIG.caches]
    batches = draw_batches(CONFIG.workloads[0], CONFIG.vocab_size)
    assert [len(batch.lengths) for batch in batches] == [2, 1]
    for result in results:
        assert result.num_steps == sum(max(batch.budgets) for batch in batches)
        for figures in (result.peak, result.last):
            assert 0 < figures.live_share <= 1
            assert figures.live_tokens <= figures.held_tokens <= figures.slots
            assert figures.bytes == figures.slots * 2 * CONFIG.num_layers * CONFIG.num_kv_heads * CONFIG.head_dim * 4
        assert 0 < result.mean_live_share <= result.mean_held_share <= 1
    record = json.loads(json.dumps(results_record(results, CONFIG, {})))
    assert record["results"][0]["peak"]["live_share"] == results[0].peak.live_share
    assert "paged_pool" in markdown_table(results)


def test_bad_settings_name_the_knob() -> None:
    with pytest.raises(ValueError, match="prompt_tokens"):
        Workload("bad", num_requests=1, batch_size=1, prompt_tokens=(10, 5), new_tokens=(1, 1))
    with pytest.raises(ValueError, match="caches"):
        MemoryBenchConfig(caches=("nope",))
