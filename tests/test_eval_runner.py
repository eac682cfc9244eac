"""The whole evaluation, end to end, on a tiny model saved with the real tokenizer."""

import json

import pytest

from hf_kvcache.eval.caches import CacheSpec, parse_spec
from hf_kvcache.eval.runner import EvalConfig, run_evaluation
from hf_kvcache.models import tiny_llama


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
    assert windowed.kl_mean > 0 and windowed.kv_bytes_per_token < dynamic.kv_bytes_per_token
    assert paged.pool_stats["pages_used"] > 0 and dynamic.pool_stats is None
    assert all(r.retrieval["num_samples"] == 1 for r in report.caches)
    assert report.data["num_windows"] == 2 and report.data["window_tokens"] == 64 and "batching" in report.data

    paths = report.save(tmp_path)
    saved = json.loads(paths["json"].read_text())
    assert saved["config"]["specs"][2] == {"label": "win16", "kind": "sliding", "settings": {"window": 16}}
    assert saved["environment"]["torch"] and saved["data"]["tokens_sha256"]
    table = paths["markdown"].read_text()
    assert table.count("\n") == 2 + 3 and "| win16 |" in table
    for key in ("plot_quality_vs_memory", "plot_perplexity_by_position"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
