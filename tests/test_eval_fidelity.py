"""The decode-mode comparison, its summary and the `evaluate` metric module, on tiny models."""

import math
import warnings

import evaluate
import pytest
import torch
from helpers import random_ids
from transformers import DynamicCache, QuantizedCache

from hf_kvcache.eval import FIDELITY_METRIC_PATH
from hf_kvcache.eval.caches import CacheSpec, default_specs, installed_quantized_backends, parse_spec
from hf_kvcache.eval.fidelity import compare_in_decode_mode, fidelity_from_logits, generation_agreement, kv_bytes
from hf_kvcache.eval.report import summarize
from hf_kvcache.transformers_internals import attn_implementation

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
    assert windowed.kv_bytes_held < baseline.kv_bytes_held / 2  # 8 of 47 tokens kept
    assert windowed.kv_bytes_per_token <= baseline.kv_bytes_per_token  # per token held: no worse
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


def test_kv_bytes_per_token_are_per_token_held(tiny_llama_model):
    """A ring's memory per token is over the tokens it holds (its window), not every token it saw; the memory it
    holds is what shows its saving."""
    specs = [CacheSpec("paged_pool", "paged_pool"), parse_spec("ring16=sliding_ring:window=16@hf_kvcache")]
    metrics = compare_in_decode_mode(tiny_llama_model, random_ids(2, 48), specs, prefill_tokens=4, progress=False)
    assert tokens_held_in(metrics) == {"dynamic": 47, "paged_pool": 47, "ring16": 16}
    paged, ring = metrics["paged_pool"], metrics["ring16"]
    assert ring.kv_bytes_held < paged.kv_bytes_held
    assert ring.kv_bytes_per_token == pytest.approx(ring.kv_bytes_held / 16)
    assert paged.kv_bytes_per_token == pytest.approx(paged.kv_bytes_held / 47)


def tokens_held_in(metrics) -> dict[str, int]:
    return {label: round(metric.kv_bytes_held / metric.kv_bytes_per_token) for label, metric in metrics.items()}


def test_each_cache_runs_under_its_attention_without_a_warning(tiny_llama_model):
    """The default evaluation runs the rings the way docs/caches.md recommends (under "hf_kvcache": a prompt past the
    window keeps to it, and nothing warns), the other caches under the model's attention."""
    rings = [spec for spec in default_specs() if spec.kind == "sliding_ring"]
    assert rings and all(spec.attn_implementation == "hf_kvcache" for spec in rings)
    assert all(spec.attn_implementation is None for spec in default_specs() if spec.kind != "sliding_ring")
    specs = [CacheSpec("dynamic", "dynamic"), parse_spec("ring8=sliding_ring:window=8@hf_kvcache")]
    assert specs[1] == CacheSpec("ring8", "sliding_ring", {"window": 8}, "hf_kvcache")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the ring's "plainly causal mask" warning would fail here
        metrics = compare_in_decode_mode(tiny_llama_model, random_ids(2, 40), specs, prefill_tokens=20, progress=False)
    assert attn_implementation(tiny_llama_model.config) == "sdpa"  # switched back
    results = summarize(specs, metrics, attn_implementation="sdpa")
    assert [r.attn_implementation for r in results] == ["sdpa", "hf_kvcache"]
