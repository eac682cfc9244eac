"""The whole evaluation, end to end, on a tiny model saved with the real tokenizer."""

import json

import pytest

from hf_kvcache.eval.caches import CacheSpec, parse_spec
from hf_kvcache.eval.command import reproduce_command
from hf_kvcache.eval.runner import EvalConfig, run_evaluation
from hf_kvcache.testing import tiny_llama


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, bundled):
    _, tokenizer = bundled
    folder = tmp_path_factory.mktemp("tiny")
    tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=1024).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_run_evaluation_writes_json_markdown_and_plots(tiny_model_dir, tmp_path):
    specs = [
        CacheSpec("dynamic", "dynamic"),
        CacheSpec("paged_pool", "paged_pool"),
        parse_spec("win16=sliding:window=16"),
    ]
    config = EvalConfig(
        model=tiny_model_dir,
        specs=specs,
        num_documents=2,
        document_tokens=64,
        prefill_tokens=16,
        generation_tokens=6,
        retrieval_lengths=[192],
        retrieval_depths=[0.5],
        progress=False,
    )
    report = run_evaluation(config)
    assert [r.label for r in report.caches] == ["dynamic", "paged_pool", "win16"]
    dynamic, paged, windowed = report.caches
    assert paged.perplexity_change == pytest.approx(0, abs=1e-4) and paged.top1_agreement == 1.0
    assert windowed.kl_mean > 0 and windowed.kv_bytes_held < dynamic.kv_bytes_held
    assert paged.pool_stats["pages_used"] > 0 and dynamic.pool_stats is None
    assert all(r.retrieval["num_samples"] == 1 for r in report.caches)
    assert report.data["num_windows"] == 2 and report.data["window_tokens"] == 64 and "batching" in report.data

    paths = report.save(tmp_path)
    saved = json.loads(paths["json"].read_text())
    assert saved["config"]["specs"][2] == {
        "label": "win16",
        "kind": "sliding",
        "settings": {"window": 16},
        "attn_implementation": None,  # the model's, recorded in config["attn_implementation"]
    }
    assert saved["environment"]["torch"] and saved["data"]["tokens_sha256"]
    table, by_position = paths["markdown"].read_text().split("\n\nQuality by position")
    assert table.count("\n") == 2 + 2 and "| win16 | sdpa |" in table
    assert [line.split(" | ")[0] for line in by_position.splitlines() if line.startswith("| ")] == [
        "| cache",
        "| dynamic",
        "| paged_pool",
        "| win16",
    ]
    for key in ("plot_quality_vs_memory", "plot_perplexity_by_position"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_attention_implementation_is_applied_recorded_and_reproduced(tiny_model_dir):
    """Under "hf_kvcache" a ring keeps its window within the prompt too; a cache without a ring is unchanged."""
    settings = {
        "model": tiny_model_dir,
        "specs": [CacheSpec("dynamic", "dynamic"), parse_spec("ring16=sliding_ring:window=16")],
        "num_documents": 1,
        "document_tokens": 48,
        "prefill_tokens": 32,  # past the window: the prompt sees itself in full under sdpa
        "generation_tokens": 2,
        "retrieval_tasks": [],
        "progress": False,
    }
    plain = run_evaluation(EvalConfig(**settings))
    banded = run_evaluation(EvalConfig(**settings, attn_implementation="hf_kvcache"))
    assert plain.config["attn_implementation"] == "sdpa" and banded.config["attn_implementation"] == "hf_kvcache"
    assert banded.caches[0].perplexity == pytest.approx(plain.caches[0].perplexity, rel=1e-6)
    assert banded.caches[1].perplexity != pytest.approx(plain.caches[1].perplexity, rel=1e-6)
    assert "--attn-implementation hf_kvcache" in reproduce_command(banded, "out")
    assert "--attn-implementation" not in reproduce_command(plain, "out")  # the default, as published reports ran


@pytest.mark.parametrize("window,beyond", [(24, True), (128, False)])
def test_greedy_agreement_starts_past_every_window_or_says_it_did_not(tiny_model_dir, window, beyond):
    """The greedy tokens follow a prompt as long as the largest window (where the documents allow), so they leave
    every ring's window; where a window is longer than a document, the report says the agreement never left it."""
    config = EvalConfig(
        model=tiny_model_dir,
        specs=[CacheSpec("dynamic", "dynamic"), parse_spec(f"ring=sliding_ring:window={window}@hf_kvcache")],
        num_documents=1,
        document_tokens=64,
        prefill_tokens=16,
        generation_tokens=6,
        retrieval_tasks=[],
        progress=False,
    )
    report = run_evaluation(config)
    dynamic, ring = report.caches
    assert ring.generation_prompt_tokens == dynamic.generation_prompt_tokens == min(window, 64)
    assert dynamic.generation_beyond_window is None and ring.generation_beyond_window is beyond
    assert ring.attn_implementation == "hf_kvcache" and dynamic.attn_implementation == "sdpa"
    assert ("never went past the cache's window" in report.markdown()) is not beyond
    assert "@hf_kvcache" in reproduce_command(report, "out")


def test_the_report_carries_quality_by_position():
    """Δ ppl and KL per position bucket, in the JSON and in a table of their own: where a cache loses shows."""
    import torch

    from hf_kvcache.eval.fidelity import TokenMetrics
    from hf_kvcache.eval.report import EvalReport, summarize

    def metrics(nll_late: float, kl_late: float) -> TokenMetrics:
        nll = torch.full((2, 8), 1.0)
        nll[:, 4:] += nll_late
        kl = torch.zeros(2, 8)
        kl[:, 4:] = kl_late
        return TokenMetrics(nll, kl, torch.ones(2, 8, dtype=torch.bool), 10.0, 80.0, 1.0)

    results = summarize(
        [CacheSpec("dynamic", "dynamic"), CacheSpec("late", "paged_pool")],
        {"dynamic": metrics(0.0, 0.0), "late": metrics(0.1, 2e-3)},
        num_buckets=2,
    )
    late = results[1]
    assert late.bucket_edges == [0, 4, 8]
    assert late.perplexity_change_by_bucket == pytest.approx([0.0, torch.tensor(0.1).exp().item() - 1])
    assert late.kl_by_bucket == pytest.approx([0.0, 2e-3])
    report = EvalReport(config={"prefill_tokens": 2}, data={}, environment={}, seconds=1.0, caches=results)
    table = report.markdown().split("Quality by position")[1]
    assert "| cache | 0–4 | 4–8 |" in table
    assert "| late | +0.00% / 0.0e+00 | +10.52% / 2.0e-03 |" in table
    assert EvalReport(**{**report.to_dict(), "caches": results}).caches[1].kl_by_bucket == late.kl_by_bucket
