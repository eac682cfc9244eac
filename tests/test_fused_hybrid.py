"""Models whose layers fuse attention with a state-space block (Falcon-H1, Zaya: ``hybrid``; Inkling: ``hybrid`` and
``hybrid_sliding``): each such layer's keys and values live on the pool (a window's for ``hybrid_sliding``), its
convolution and recurrent states in the state half of transformers' own layer (``LinearAttentionLayer``), which the
model reaches through ``Cache``'s own methods (``update_conv_state``, ``get_recurrent_state``, ...).

Tiny random-init models (``hf_kvcache.testing.tiny_causal_lm``), each against ``DynamicCache``."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from hf_kvcache import KVPool, PagedCache, PagedConfig, QuantizedKVCache, QuantizedValueCache
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.layers import PagedLayer, WindowLayer
from hf_kvcache.testing import tiny_causal_lm
from hf_kvcache.transformers_internals import LinearAttentionLayer
from tests.helpers import assert_same_generation, exact_config, padded_batch, random_ids, run, teacher_forced_logits

PROMPT = [11, 6]  # a left-padded batch of two rows, the first longer than Inkling's window of 8
NEW_TOKENS = 8
LENGTH = max(PROMPT) + NEW_TOKENS
# Inkling: a full (``hybrid``) layer beside a sliding one, whose heads differ (two geometries, two pools)
INKLING = {
    "layer_types": ["hybrid_sliding", "hybrid"],
    "swa_head_dim": 32,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 4,
}
MODELS = {"falcon_h1": {}, "zaya": {}, "inkling_text": INKLING}


@pytest.fixture(scope="module", params=sorted(MODELS))
def fused(request):
    return tiny_causal_lm(request.param, **MODELS[request.param])


def test_fused_layers_keep_their_keys_on_the_pool_and_their_state_in_transformers_layer(fused, cache_name):
    cache = REGISTRY[cache_name].cache_class(fused.config, exact_config(cache_name, LENGTH))
    theirs = DynamicCache(config=fused.config).layers
    for layer_type, ours, reference in zip(fused.config.layer_types, cache.layers, theirs, strict=True):
        assert isinstance(ours, PagedLayer) and isinstance(ours, LinearAttentionCacheLayerMixin)
        assert isinstance(ours, WindowLayer) == (layer_type == "hybrid_sliding" or cache_name == "sliding_ring")
        assert ours.number_of_states == reference.number_of_states
        assert isinstance(reference, LinearAttentionLayer)  # the state half transformers mixes in, as ours does


def test_greedy_generation_equals_dynamic_cache(fused, cache_name):
    """Lossless caches (and the quantized ones keeping every value in full precision) give DynamicCache's tokens and
    logits, a left-padded batch and a prompt longer than Inkling's window included."""
    ids, mask = padded_batch(PROMPT, vocab=fused.config.vocab_size)
    expected = run(fused, ids, mask, max_new_tokens=NEW_TOKENS)
    config = exact_config(cache_name, LENGTH)
    assert_same_generation(
        expected, run(fused, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation=cache_name, cache_config=config)
    )


@pytest.mark.parametrize(
    "cache_class,settings",
    [(QuantizedValueCache, {"bits": 4}), (QuantizedKVCache, {"key_bits": 4, "value_bits": 4})],
    ids=["quantized_values", "quantized_kv"],
)
def test_quantized_caches_stay_close(fused, cache_class, settings):
    """Reading int4 codes from the second page on (a prefill, then a token at a time), the logits stay within 5% of
    the largest of DynamicCache's (the bound of tests/test_hybrid_models.py)."""
    ids = random_ids(2, 28, seed=3, vocab=fused.config.vocab_size)
    cache = cache_class(fused.config, {"group_size": 16, "residual_length": 4, "page_size": 4, **settings})
    with torch.no_grad():
        expected = teacher_forced_logits(fused, ids, DynamicCache(config=fused.config), [12, 1])
        actual = teacher_forced_logits(fused, ids, cache, [12, 1])
    worst = (actual - expected).abs().max().item()
    assert 0 < worst < 0.05 * expected.abs().max().item()
    cache.release()


def test_beam_search_moves_the_states_with_the_pages(fused):
    ids, mask = padded_batch(PROMPT, vocab=fused.config.vocab_size, seed=1)
    beams = {"num_beams": 3, "max_new_tokens": 6}
    assert torch.equal(
        fused.generate(ids, attention_mask=mask, **beams),
        fused.generate(ids, attention_mask=mask, cache_implementation="paged_pool", **beams),
    )


@pytest.mark.parametrize(
    "change,rows",
    [
        (lambda cache: cache.reorder_cache(torch.tensor([2, 2, 0])), [2, 2, 0]),
        (lambda cache: cache.batch_select_indices(torch.tensor([True, False, True])), [0, 2]),
        (lambda cache: cache.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2]),
    ],
    ids=["reorder", "select-mask", "repeat"],
)
def test_row_changes_move_the_states_with_the_pages(fused, change, rows):
    """After a row change the next step's logits are those of the changed rows fed from the start."""
    ids = random_ids(3, 10, seed=2, vocab=fused.config.vocab_size)
    next_ids = random_ids(len(rows), 1, seed=3, vocab=fused.config.vocab_size)
    cache, reference = PagedCache(fused.config), DynamicCache(config=fused.config)
    with torch.no_grad():
        fused(ids, cache=cache)
        change(cache)
        actual = fused(next_ids, cache=cache).logits[:, -1]
        fused(ids[rows], cache=reference)
        expected = fused(next_ids, cache=reference).logits[:, -1]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    cache.release()


def test_a_released_cache_starts_the_next_prompt_with_fresh_states(fused):
    ids, second = random_ids(2, 9, seed=4), random_ids(3, 5, seed=5)
    next_ids = random_ids(3, 1, seed=6)
    cache, reference = PagedCache(fused.config), DynamicCache(config=fused.config)
    with torch.no_grad():
        fused(ids, cache=cache)
        assert cache.memory_stats()["state_bytes"] > 0
        cache.reset()
        assert cache.memory_stats()["state_bytes"] == 0 and not cache.has_previous_state()
        fused(second, cache=cache)
        actual = fused(next_ids, cache=cache).logits[:, -1]
        fused(second, cache=reference)
        expected = fused(next_ids, cache=reference).logits[:, -1]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    cache.release()


def test_crop_refuses_a_state_that_does_not_record_its_past(fused):
    cache = PagedCache(fused.config)
    with torch.no_grad():
        fused(random_ids(1, 9, seed=7), cache=cache)
    with pytest.raises(ValueError, match=r"layers \[0, 1\] \(hybrid.*activate_past_recording"):
        cache.crop(-2)
    assert cache.get_seq_length() == 9
    cache.release()


# Inkling's default layers (both sliding) with the full layers' heads: one geometry, a pool with a prefix index
ONE_GEOMETRY = {"inkling_text": {"swa_head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2}}


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_prompt_reuse_restores_the_state_half(model_type):
    """The state half's states are kept at page boundaries, as other hybrids' (``hf_kvcache.caches.state_tails``):
    the second call reuses the prompt's whole pages with their states and gives the same generation."""
    fused = tiny_causal_lm(model_type, **ONE_GEOMETRY.get(model_type, {}))
    pool = KVPool.for_model(fused, PagedConfig(page_size=4), max_tokens=512, prefix_caching=True)
    ids = random_ids(1, 18, seed=9, vocab=fused.config.vocab_size)
    expected = run(fused, ids, None, max_new_tokens=4)
    for _ in range(2):
        actual = run(fused, ids, None, max_new_tokens=4, cache_implementation="paged_pool", cache_config={"pool": pool})
        assert_same_generation(expected, actual)
    stats = pool.stats()
    assert stats["prefix_tokens_reused"] == 16 and stats["prefix_tails"] > 0
    pool.check_integrity()


def test_is_compileable_follows_the_state_half(fused):
    cache = PagedCache(fused.config, {"max_tokens": 256})
    assert cache.is_compileable  # the states keep static addresses, updated in place
    cache.activate_past_recording()  # a recording state reassigns its tensors: not compileable (transformers' rule)
    assert not cache.is_compileable
