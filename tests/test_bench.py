"""Tests for hf_kvcache.bench on a tiny random Llama: structure and correctness only, never timings."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from hf_kvcache.bench import CACHE_NAMES, DecodeBenchConfig, DecodeResult, markdown_table, run_decode_benchmark

LENGTHS = (16, 40)
BATCHES = (1, 3)
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 16


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float32).eval()


@pytest.fixture(scope="module")
def results(model: PreTrainedModel) -> list[DecodeResult]:
    generator = torch.Generator().manual_seed(0)
    stream = torch.randint(0, 128, (max(BATCHES) * max(LENGTHS),), generator=generator)
    config = DecodeBenchConfig(lengths=LENGTHS, batches=BATCHES, steps=4, rounds=1)
    return run_decode_benchmark(model, stream, config)


def test_every_cache_is_measured_once_per_setting(results: list[DecodeResult]) -> None:
    seen = [(r.length, r.batch, r.cache) for r in results]
    expected = [(length, batch, cache) for length in LENGTHS for batch in BATCHES for cache in CACHE_NAMES]
    assert seen == expected


def test_tokens_match_and_ratios_are_positive(results: list[DecodeResult]) -> None:
    for r in results:
        assert r.tokens_match, r
        assert r.mismatched_tokens == 0
        assert math.isfinite(r.ratio_vs_dynamic) and r.ratio_vs_dynamic > 0
        assert r.tokens_per_s > 0 and r.median_step_ms > 0
        assert r.peak_mib >= 0 and r.other_processes_cores >= 0
        if r.cache == "dynamic":
            assert r.ratio_vs_dynamic == pytest.approx(1.0)


def test_bytes_per_token(results: list[DecodeResult]) -> None:
    exact = 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * 4  # keys + values, fp32
    for r in results:
        if r.cache in ("dynamic", "static"):
            # Static is sized to exactly what a run holds, so it matches Dynamic here.
            assert r.kv_bytes_per_token == pytest.approx(exact)
        else:
            assert exact <= r.kv_bytes_per_token < 2 * exact


def test_markdown_table_has_a_line_per_result(results: list[DecodeResult]) -> None:
    lines = markdown_table(results, busy_cores=float("inf")).splitlines()
    assert len(lines) == 2 + len(results)
    assert lines[2].startswith("| dynamic | 16 | 1 |")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"caches": ("static",)}, "must include 'dynamic'"),
        ({"caches": ("dynamic", "nope")}, "Unknown caches"),
        ({"lengths": ()}, "lengths"),
        ({"steps": 0}, "steps"),
    ],
)
def test_config_rejects_bad_settings(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecodeBenchConfig(**settings)


def test_short_stream_is_rejected(model: PreTrainedModel) -> None:
    with pytest.raises(ValueError, match="at least"):
        run_decode_benchmark(model, torch.zeros(10, dtype=torch.long), DecodeBenchConfig(lengths=(8,), batches=(2,)))
