"""The decode-mode comparison, its summary and the `evaluate` metric module, on tiny models."""

import math

import evaluate
import pytest
import torch
from helpers import random_ids
from transformers import DynamicCache, QuantizedCache

from hf_kvcache.eval import FIDELITY_METRIC_PATH
from hf_kvcache.eval.caches import CacheSpec, default_specs, installed_quantized_backends, parse_spec
from hf_kvcache.eval.fidelity import compare_in_decode_mode, fidelity_from_logits, generation_agreement, kv_bytes
from hf_kvcache.eval.report import summarize

LOSSLESS = [
    CacheSpec("dynamic", "dynamic"),
    CacheSpec("paged_pool", "paged_pool"),
    CacheSpec("static", "static"),
    parse_spec("window-before-full=sliding:window=128"),  # longer than the documents: nothing is dropped
]


@pytest.mark.parametrize("model_name", ["tiny_llama_model", "tiny_gemma3_model"])
def test_lossless_caches_report_no_change(model_name, request):
    model = request.getfixturevalue(model_name)
    metrics = compare_in_decode_mode(model, random_ids(2, 48), LOSSLESS, prefill_tokens=5, progress=False)
    results = summarize(LOSSLESS, metrics)
    assert [r.label for r in results] == [spec.label for spec in LOSSLESS]
    for result in results:
        assert result.perplexity_change == pytest.approx(0, abs=1e-4), result.label
        assert result.kl_mean == pytest.approx(0, abs=1e-6), result.label
        assert result.top1_agreement == 1.0, result.label
    agreement = generation_agreement(model, random_ids(2, 48)[:, :6], LOSSLESS, max_new_tokens=12)
    assert all(counts == [12, 12] for counts in agreement.values())


def test_lossy_cache_reports_a_change(tiny_llama_model):
    specs = [CacheSpec("dynamic", "dynamic"), parse_spec("window8=sliding:window=8")]
    metrics = compare_in_decode_mode(tiny_llama_model, random_ids(2, 48), specs, prefill_tokens=4, progress=False)
    baseline, windowed = summarize(specs, metrics)
    assert windowed.kl_mean > 1e-4 and windowed.top1_agreement < 1.0
    assert windowed.perplexity_change != 0
    assert windowed.kv_bytes_per_token < baseline.kv_bytes_per_token / 2  # 8 of 47 tokens kept
    # The window only bites once the sequence is past it: the first bucket is unchanged.
    assert windowed.perplexity_by_bucket[0] == pytest.approx(baseline.perplexity_by_bucket[0], rel=1e-5)
    agreement = generation_agreement(tiny_llama_model, random_ids(2, 30), specs, max_new_tokens=20)
    assert agreement["dynamic"] == [20, 20] and min(agreement["window8"]) < 20


def test_decode_mode_perplexity_equals_a_full_forward(tiny_llama_model):
    ids = random_ids(3, 40)
    metrics = compare_in_decode_mode(tiny_llama_model, ids, [CacheSpec("dynamic", "dynamic")], 7, progress=False)
    logits = tiny_llama_model(ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    result = summarize([], metrics)[0]
    assert result.perplexity == pytest.approx(math.exp(nll.item()), rel=1e-5)
    chunked = compare_in_decode_mode(
        tiny_llama_model, ids, [CacheSpec("dynamic", "dynamic")], 7, chunk_size=5, progress=False
    )
    torch.testing.assert_close(chunked["dynamic"].nll, metrics["dynamic"].nll, rtol=1e-4, atol=1e-4)


def test_fidelity_metric_module_matches_the_library():
    generator = torch.Generator().manual_seed(1)
    logits, baseline = torch.randn(6, 11, generator=generator), torch.randn(6, 11, generator=generator)
    labels = torch.randint(0, 11, (6,), generator=generator)
    nll, kl, agree = fidelity_from_logits(logits, baseline, labels)
    metric = evaluate.load(FIDELITY_METRIC_PATH)
    result = metric.compute(predictions=logits.tolist(), references=baseline.tolist(), labels=labels.tolist())
    assert result["kl_divergence"] == pytest.approx(kl.mean().item(), rel=1e-5)
    assert result["top1_agreement"] == pytest.approx(agree.float().mean().item())
    assert result["perplexity"] == pytest.approx(nll.mean().exp().item(), rel=1e-5)
    same = metric.compute(predictions=baseline.tolist(), references=baseline.tolist())
    assert same == {"kl_divergence": pytest.approx(0, abs=1e-6), "top1_agreement": 1.0}


def test_specs_parse_and_reject_unknown_kinds():
    assert parse_spec("q=quantized:backend=quanto,nbits=4") == CacheSpec(
        "q", "quantized", {"backend": "quanto", "nbits": 4}
    )
    assert parse_spec("paged_pool:page_size=32") == CacheSpec("paged_pool", "paged_pool", {"page_size": 32})
    assert default_specs()[0].is_baseline
    with pytest.raises(ValueError, match="Unknown cache kind 'nope'"):
        parse_spec("x=nope")
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("x=dynamic:oops")
    with pytest.raises(ValueError, match="prefill_tokens=0"):
        compare_in_decode_mode(None, torch.zeros(1, 4, dtype=torch.long), [], prefill_tokens=0)


@pytest.mark.parametrize("backend", installed_quantized_backends())
def test_kv_bytes_count_every_quantized_part(tiny_llama_model, backend):
    """transformers' quantized caches hold codes, scales and zeros (hqq as a (codes, meta) pair): all counted."""
    ids = random_ids(1, 600)
    caches = {"dynamic": DynamicCache(config=tiny_llama_model.config)}
    caches[backend] = QuantizedCache(backend=backend, config=tiny_llama_model.config, nbits=4)
    with torch.inference_mode():
        for cache in caches.values():
            tiny_llama_model(ids, cache=cache)
    ratio = kv_bytes(caches[backend]) / kv_bytes(caches["dynamic"])
    assert 4 / 32 < ratio < 0.5  # 4-bit codes of fp32 states plus their scales and zeros
