"""Correct on every input a user can give: recycled pages, half precision and autocast, assisted decoding with
drafts that get rejected, on every registered cache (the registry drives the grid)."""

import warnings

import pytest
import torch
from helpers import assert_same_generation, exact_config, example_config, padded_batch, run

import hf_kvcache  # noqa: F401  (registers the names)
from hf_kvcache.attention.interface import ATTENTION_NAME, model_attention
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.testing import tiny_gemma3, tiny_llama, tiny_mistral


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("attn", ["sdpa", "eager", ATTENTION_NAME])
def test_recycled_pages_cannot_change_an_output(tiny_llama_model, cache_name, attn, fill, make_pool):
    """Pages an earlier request filled with what an fp16 overflow leaves (inf, NaN) change nothing once it is done:
    the pool zeroes pages when they come back, so every slot a request has not written reads as zero, also where
    attention reads whole pages in place (a ring window of 32 on a 20-token prompt; whole extents in place)."""
    ids, mask = padded_batch([20, 13])
    cache_config = example_config(cache_name)
    if "window" in cache_config:
        cache_config.update(window=32, sink_tokens=0)
    pool = make_pool(tiny_llama_model, cache_name, max_tokens=1024)
    settings = {"max_new_tokens": 8, "cache_implementation": cache_name, "cache_config": {**cache_config, "pool": pool}}
    with model_attention(tiny_llama_model, attn):
        fresh = run(tiny_llama_model, ids, mask, **settings)
        held = {
            page
            for layer in fresh.cache.layers
            if hasattr(layer, "rows")
            for row in layer.rows.table.rows
            for page in row
        }
        index = torch.tensor(sorted(held))
        for tensor in pool.pages.storage.tensors:  # the request's own pages overflowed
            tensor.index_fill_(2, index, fill if tensor.is_floating_point() else torch.iinfo(tensor.dtype).max)
        fresh.cache.release()  # every page back to the pool, all free, all zeros
        assert pool.stats()["pages_used"] == 0
        assert not any(tensor[:, :, 1:].any() for tensor in pool.pages.storage.tensors)
        recycled = run(tiny_llama_model, ids, mask, **settings)
    assert_same_generation(fresh, recycled)
    assert not any(step.isnan().any() for step in recycled.logits)


HALF_MODELS = {"tiny_llama": tiny_llama, "tiny_gemma3": tiny_gemma3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_name", sorted(HALF_MODELS))
def test_half_precision_models_equal_dynamic_cache(cache_name, model_name, dtype):
    """bf16 and fp16 models through every cache: the same greedy tokens as DynamicCache in the same dtype, and the
    logits within torch's default tolerance for that dtype (bf16: 1.6e-2 relative; fp16: 1e-3; measured: equal)."""
    model = HALF_MODELS[model_name]().to(dtype)
    ids, mask = padded_batch([9, 5])
    reference = run(model, ids, mask, max_new_tokens=12)
    actual = run(
        model, ids, mask, max_new_tokens=12, cache_implementation=cache_name, cache_config=exact_config(cache_name, 64)
    )
    assert actual.cache.pool.format.dtype == dtype
    assert torch.equal(actual.sequences, reference.sequences)
    for expected, got in zip(reference.logits, actual.logits, strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("attn", ["sdpa", ATTENTION_NAME])
def test_generation_under_autocast_equals_dynamic_cache(tiny_llama_model, cache_name, attn):
    """An fp32 model under torch.autocast(bfloat16): the pool keeps the model's dtype and stores the bf16 states
    cast to it (a ring's in-place write too); the tokens are DynamicCache's under the same autocast."""
    ids, mask = padded_batch([9, 5])
    with model_attention(tiny_llama_model, attn), torch.autocast("cpu", dtype=torch.bfloat16):
        reference = run(tiny_llama_model, ids, mask, max_new_tokens=8)
        actual = run(
            tiny_llama_model,
            ids,
            mask,
            max_new_tokens=8,
            cache_implementation=cache_name,
            cache_config=exact_config(cache_name, 64),
        )
    assert actual.cache.pool.format.dtype == torch.float32
    assert torch.equal(actual.sequences, reference.sequences)


ASSISTED_MODELS = {"tiny_mistral": tiny_mistral, "tiny_gemma3": tiny_gemma3}


@pytest.mark.parametrize("model_name", sorted(ASSISTED_MODELS))
def test_assisted_decoding_with_another_assistant_equals_dynamic_cache(cache_name, model_name, monkeypatch):
    """A different (differently seeded) assistant: its drafts get rejected, so the cache is cropped by up to
    20 tokens at a time, on models with sliding layers (rings) and full ones."""
    build = ASSISTED_MODELS[model_name]
    model, assistant = build(), build(seed=1)
    assistant.generation_config.num_assistant_tokens = 20
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    crops = []
    cache_class = REGISTRY[cache_name].cache_class
    crop = cache_class.crop
    monkeypatch.setattr(cache_class, "crop", lambda self, n: crops.append(n) or crop(self, n))
    ids, mask = padded_batch([12], seed=3)
    settings = {"max_new_tokens": 40, "do_sample": False, "assistant_model": assistant}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(ids, attention_mask=mask, **settings)
        actual = model.generate(
            ids,
            attention_mask=mask,
            **settings,
            cache_implementation=cache_name,
            cache_config=exact_config(cache_name, 64),
        )
    assert crops and min(crops) < 0, "no draft was rejected: the test would not crop"
    assert torch.equal(actual, expected)
