"""Indexed attention (DeepSeek-V3.2's sparse attention and its family: GLM-MoE-DSA, Dots3, A.X K2, Hunyuan-V4): each
such layer is an attention layer whose keys and values sit on the pool, and whose lightning indexer keeps keys of its
own (``cache.update_indexer``) beside them, which move with the rows, crop with the tokens and count in the cache's
memory.

Tiny random-init models (``hf_kvcache.testing.tiny_causal_lm``) whose indexer keeps 4 keys a query (``index_topk``),
so that prompts of 6 and 9 tokens feel the sparsity, each against ``DynamicCache``."""

import logging

import pytest
import torch
from transformers import DynamicCache

from hf_kvcache import IncompatibleModelError, KVPool, PagedCache, PagedConfig, SlidingRingCache
from hf_kvcache.bench import model_matrix as matrix
from hf_kvcache.caches import prefix as prefix_module
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.layers import PagedLayer
from hf_kvcache.testing import random_padded_batch, tiny_causal_lm
from tests.helpers import assert_same_generation, exact_config, padded_batch, random_ids, run
from tests.test_hybrid_models import ROW_CHANGES, reference_logits
from tests.test_quantized_cache import QuantDequantValues
from tests.test_quantized_kv_cache import EncodedKVSpec

PROMPT = [9, 6]  # a left-padded batch of two rows
NEW_TOKENS = 6
LENGTH = max(PROMPT) + NEW_TOKENS
MODELS = ("deepseek_v32", "glm_moe_dsa", "dots3_note_text")


def lossless_config(cache_name: str) -> dict:
    """``exact_config``, with the quantized caches' scale groups as wide as the latent's rope key (8 channels)."""
    config = exact_config(cache_name, LENGTH)
    return {**config, "group_size": 8} if "group_size" in config else config


def tiny(model_type: str):
    return tiny_causal_lm(model_type, index_topk=4)


@pytest.fixture(scope="module", params=MODELS)
def indexed(request):
    return tiny(request.param)


@pytest.fixture(scope="module")
def deepseek():
    return tiny("deepseek_v32")


def test_indexed_layers_sit_on_the_pool(indexed, cache_name):
    cache = REGISTRY[cache_name].cache_class(indexed.config, lossless_config(cache_name))
    for layer_type, layer in zip(indexed.config.layer_types, cache.layers, strict=True):
        if layer_type == "indexed_attention":
            assert isinstance(layer, PagedLayer) and hasattr(layer, "update_indexer")


@pytest.mark.parametrize("attention", ["sdpa", "hf_kvcache"])
def test_greedy_generation_equals_dynamic_cache(indexed, cache_name, attention):
    """Lossless caches (and the quantized ones keeping every value in full precision) give DynamicCache's tokens and
    logits, a left-padded batch included, under the model's own attention and ours."""
    ids, mask = padded_batch(PROMPT)
    expected = run(indexed, ids, mask, max_new_tokens=NEW_TOKENS)
    indexed.set_attn_implementation(attention)
    try:
        config = lossless_config(cache_name)
        actual = run(
            indexed, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation=cache_name, cache_config=config
        )
    finally:
        indexed.set_attn_implementation("sdpa")
    assert_same_generation(expected, actual)


SPECS = {
    "quantized_values": lambda config: QuantDequantValues(config, bits=8, group_size=8, residual_length=2),
    "quantized_kv": lambda config: EncodedKVSpec(
        config, key_bits=4, value_bits=8, group_size=8, residual_length=2, page_size=4
    ),
}
"""The pure-torch spec of each quantized cache under the model matrix's settings (``matrix.MATRIX_CONFIGS``; a scale
group as wide as the latent's rope key)."""


@pytest.mark.parametrize("cache", sorted(SPECS))
@pytest.mark.parametrize("model_type", MODELS)
def test_quantized_caches_give_their_specs_logits_within_the_matrix_bound(model_type, cache):
    """On the model matrix's batch a quantized cache gives the logits of its spec (a DynamicCache coding what it
    returns), and stays within ``matrix.QUANTIZED_BOUND`` of DynamicCache's: the indexer's picks, which follow the
    coded keys' error, move them (0.13 of the largest logit through int4 keys; 0.005 on dense latent attention)."""
    model, reference = matrix.build(model_type)
    ids, mask = random_padded_batch(list(matrix.PROMPT_LENGTHS), model.config.vocab_size, matrix._seed(), low=3)
    settings = {"max_new_tokens": matrix.NEW_TOKENS, "do_sample": False, "return_dict_in_generate": True}
    config = dict(matrix.MATRIX_CONFIGS[cache])
    ours = model.generate(
        ids, attention_mask=mask, output_logits=True, **settings, cache_implementation=cache, cache_config=config
    )
    spec = model.generate(ids, attention_mask=mask, output_logits=True, **settings, cache=SPECS[cache](model.config))
    assert torch.equal(ours.sequences, spec.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(spec.logits), rtol=1e-5, atol=1e-5)
    assert matrix.compare(model_type, matrix.OWN, cache, reference, ours).status == "close"


def test_beam_search_and_sampling_equal_dynamic_cache(deepseek, cache_name):
    """Beams and returned sequences move the indexer keys with the pages."""
    ids, mask = padded_batch(PROMPT, seed=1)
    config = lossless_config(cache_name)
    beams = {"num_beams": 3, "max_new_tokens": 6}
    assert torch.equal(
        deepseek.generate(ids, attention_mask=mask, **beams),
        deepseek.generate(ids, attention_mask=mask, cache_implementation=cache_name, cache_config=config, **beams),
    )
    sampling = {"do_sample": True, "num_return_sequences": 2, "max_new_tokens": 6}
    torch.manual_seed(0)
    expected = deepseek.generate(ids, attention_mask=mask, **sampling)
    torch.manual_seed(0)
    actual = deepseek.generate(
        ids, attention_mask=mask, cache_implementation=cache_name, cache_config=config, **sampling
    )
    assert torch.equal(expected, actual)


@ROW_CHANGES
def test_row_changes_move_the_indexer_keys_with_the_pages(deepseek, change, rows):
    """After a row change the next step's logits are those of the changed rows fed from the start."""
    ids = random_ids(3, 7, seed=2)
    cache = PagedCache(deepseek.config)
    with torch.no_grad():
        deepseek(ids, cache=cache)
        change(cache)
        next_ids = random_ids(len(rows), 1, seed=3)
        actual = deepseek(next_ids, cache=cache).logits[:, -1]
        expected = reference_logits(deepseek, ids[rows], next_ids)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    cache.release()


def test_a_crop_crops_the_indexer_keys(deepseek, cache_name):
    """After a crop the next step reads only the tokens kept, the indexer's keys too."""
    ids, next_ids = random_ids(2, 9, seed=7), random_ids(2, 1, seed=8)
    cache = REGISTRY[cache_name].cache_class(deepseek.config, lossless_config(cache_name))
    with torch.no_grad():
        deepseek(ids, cache=cache)
        cache.crop(-3)
        assert cache.get_seq_length() == 6
        actual = deepseek(next_ids, cache=cache).logits[:, -1]
    torch.testing.assert_close(actual, reference_logits(deepseek, ids[:, :6], next_ids), rtol=1e-5, atol=1e-5)
    cache.release()


def test_prompt_lookup_crops_the_rejected_candidates(deepseek):
    """Assisted decoding crops the rejected candidates: the tokens of greedy search."""
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])  # repeats, so that prompt lookup proposes candidates
    settings = {"max_new_tokens": 10, "do_sample": False}
    expected = deepseek.generate(ids, **settings)
    actual = deepseek.generate(ids, prompt_lookup_num_tokens=3, cache_implementation="paged_pool", **settings)
    assert torch.equal(actual, expected)


def test_the_cache_counts_the_indexer_keys_and_drops_them_on_release(deepseek):
    pool = KVPool.for_model(deepseek, PagedConfig(page_size=4), max_tokens=256)
    assert (pool.format.num_layers, pool.format.num_layer_groups) == (2, 1)  # both indexed layers
    cache = PagedCache(deepseek.config, {"pool": pool})
    with torch.no_grad():
        deepseek(random_ids(2, 7), cache=cache)
    # the indexers' rings: layers x rows x slots (7 tokens: a capacity bucket of 4 pages of 4) x width x fp32
    expected = 2 * 2 * 16 * deepseek.config.index_head_dim * 4
    stats = cache.memory_stats()
    assert stats["pages_held"] == 2 * 2 and stats["state_bytes"] == expected
    assert stats["bytes_held"] == stats["pages_held"] * pool.format.page_bytes + expected
    cache.release()
    assert pool.stats()["pages_used"] == 0 and cache.memory_stats()["state_bytes"] == 0
    first, second, next_ids = random_ids(2, 9, seed=4), random_ids(3, 5, seed=5), random_ids(3, 1, seed=6)
    with torch.no_grad():  # a released cache serves the next prompt as a fresh one
        deepseek(first, cache=cache)
        cache.reset()
        deepseek(second, cache=cache)
        actual = deepseek(next_ids, cache=cache).logits[:, -1]
    torch.testing.assert_close(actual, reference_logits(deepseek, second, next_ids), rtol=1e-5, atol=1e-5)
    cache.release()


def windowed_reference(model, ids: torch.Tensor, next_ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """The logits of a token at a time ``next_ids [rows, steps]`` after the prompt ``ids`` (no longer than
    ``window``), each step reading only the last ``window`` tokens: a ``DynamicCache`` whose layers (keys, values and
    the indexer's keys) are cut to their last ``window - 1`` tokens before each step, positions given."""
    cache = DynamicCache(config=model.config)
    model(ids, cache=cache)
    logits = []
    for step in range(next_ids.shape[1]):
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[..., 1 - window :, :], layer.values[..., 1 - window :, :]
            layer.indexer_keys = layer.indexer_keys[:, 1 - window :]
        position = torch.full((ids.shape[0], 1), ids.shape[1] + step)
        logits.append(model(next_ids[:, step : step + 1], cache=cache, position_ids=position).logits[:, -1])
    return logits


def test_a_window_hands_the_indexer_the_keys_it_hands_attention(deepseek):
    """Where a window cuts the rows, the indexer scores the keys attention reads (its picks index them): a token at a
    time, each step's logits are those of reading the last ``window`` tokens; the indexer keeps no more of its own
    keys than the window's reach."""
    window, ids, next_ids = 6, random_ids(2, 6, seed=10), random_ids(2, 10, seed=11)
    cache = SlidingRingCache(deepseek.config, {"window": window, "page_size": 2})
    expected = windowed_reference(deepseek, ids, next_ids, window)
    with torch.no_grad():
        deepseek(ids, cache=cache)
        for step in range(next_ids.shape[1]):
            actual = deepseek(next_ids[:, step : step + 1], cache=cache).logits[:, -1]
            torch.testing.assert_close(actual, expected[step], rtol=1e-5, atol=1e-5, msg=f"step {step}")
    reach = window - 1 + 2  # the window's pages: window - 1 tokens and a page
    assert cache.memory_stats()["state_bytes"] == 2 * 2 * reach * deepseek.config.index_head_dim * 4
    cache.release()


def test_prefix_caching_is_refused_once_with_its_reason(deepseek, caplog, monkeypatch):
    """The indexer's keys live outside the pool's pages a cached prefix restores: prompts are not reused."""
    monkeypatch.setattr(prefix_module, "_logged", set())
    pool = KVPool.for_model(deepseek, PagedConfig(page_size=4), max_tokens=512, prefix_caching=True)
    ids = random_ids(1, 18, seed=9)
    expected = run(deepseek, ids, None, max_new_tokens=4)
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        for _ in range(2):
            actual = run(
                deepseek, ids, None, max_new_tokens=4, cache_implementation="paged_pool", cache_config={"pool": pool}
            )
            assert_same_generation(expected, actual)
    refusals = [record.message for record in caplog.records if "Prefix caching is off" in record.message]
    assert len(refusals) == 1 and "indexer" in refusals[0], refusals
    stats = pool.stats()
    assert stats["prefix_lookups"] == 0 and stats["pages_cached"] == 0


def test_a_window_with_sinks_is_refused_by_name_on_an_indexed_layer(deepseek):
    """A padded row keeps its sinks at its own first real tokens, which the indexer's keys do not follow."""
    with pytest.raises(IncompatibleModelError, match=r"indexed-attention.*sink_tokens=2.*sink_tokens=0"):
        SlidingRingCache(deepseek.config, {"window": 6, "sink_tokens": 2})
