"""Models whose attention layers write keys and values of different geometries: Gemma 4 (here sliding layers of 2 KV
heads of width 16 beside global layers of width 512) and MiMo-V2-Flash (sliding layers with twice the KV heads). Each
geometry's layer groups draw from a pool of their own page format; the model's pool is the set of them
(``KVPoolSet``), built, sized and reported together."""

import functools
import logging

import pytest
import torch

from hf_kvcache import IncompatibleModelError, KVPool, KVPoolSet, PagedCache, PagedConfig, PoolExhaustedError
from hf_kvcache.bench import model_matrix as matrix
from hf_kvcache.caches import prefix as prefix_module
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.memory.format import PageFormat, geometry_groups, layer_types
from hf_kvcache.testing import tiny_causal_lm, tiny_llama
from tests.helpers import assert_same_generation, exact_config, padded_batch, run

PROMPT = [9, 6]
NEW_TOKENS = 6
LENGTH = max(PROMPT) + NEW_TOKENS
GEOMETRIES = {"gemma4_text": [(2, 16, 16), (2, 512, 512)], "mimo_v2_flash": [(2, 24, 16), (4, 24, 16)]}


tiny = functools.cache(tiny_causal_lm)


@pytest.fixture(params=sorted(GEOMETRIES))
def model(request):
    return tiny(request.param)


@pytest.fixture
def gemma4():
    return tiny("gemma4_text")


def test_each_geometry_is_its_own_layer_groups_and_page_format(model):
    config = model.config.get_text_config(decoder=True)
    groups, geometries = geometry_groups(config, layer_types(config))
    assert list(dict.fromkeys(geometries)) == GEOMETRIES[config.model_type]
    formats = PageFormat.from_model_config(config, torch.float32).for_geometries(geometries)
    assert [(part.num_kv_heads, part.head_dim, part.value_dim) for part in formats] == GEOMETRIES[config.model_type]
    assert sum(part.num_layer_groups for part in formats) == len(groups)


@pytest.mark.parametrize(
    "model_type,cache_name",
    [(model_type, cache) for model_type in sorted(GEOMETRIES) for cache in sorted(REGISTRY)],
)
def test_greedy_generation_equals_dynamic_cache(model_type, cache_name):
    """DynamicCache's tokens and logits, a padded batch included; the quantized caches keep every value in full
    precision here (``exact_config``), on both geometries' pages."""
    model = tiny(model_type)
    ids, mask = padded_batch(PROMPT)
    expected = run(model, ids, mask, max_new_tokens=NEW_TOKENS)
    config = exact_config(cache_name, LENGTH)
    if "group_size" in config and model_type == "mimo_v2_flash":
        config["group_size"] = 8  # divides its keys' 24 channels and its values' 16
    actual = run(model, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation=cache_name, cache_config=config)
    assert_same_generation(expected, actual)


@pytest.mark.parametrize("cache_name", ["quantized_values", "quantized_kv"])
def test_quantized_caches_stay_close(gemma4, cache_name):
    """int8 values and int4 keys read as codes from the second page on, in the pages of both geometries: logits
    within the model matrix's bound of DynamicCache's, over the steps whose tokens agree and the first that does
    not (``matrix.compare``)."""
    ids, mask = padded_batch(PROMPT)
    expected = run(gemma4, ids, mask, max_new_tokens=NEW_TOKENS)
    settings = {"quantized_values": {"bits": 8}, "quantized_kv": {"key_bits": 4, "value_bits": 8}}[cache_name]
    config = {**settings, "residual_length": 2, "page_size": 4}
    actual = run(gemma4, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation=cache_name, cache_config=config)
    outcome = matrix.compare("gemma4_text", matrix.OWN, cache_name, expected, actual)
    assert outcome.status == "close" and outcome.difference > 0, outcome


def test_the_pool_for_the_model_is_a_pool_per_geometry_reported_together(gemma4):
    pool = KVPool.for_model(gemma4, PagedConfig(page_size=4), max_tokens=64)
    assert isinstance(pool, KVPoolSet) and len(pool.parts) == 2
    assert [(part.num_kv_heads, part.head_dim) for part in pool.formats] == [(2, 16), (2, 512)]
    assert [part.stats()["pages_total"] for part in pool.parts] == [
        part.pages_for_tokens(64) for part in pool.formats
    ]  # each geometry holds max_tokens tokens of its layers
    ids, mask = padded_batch(PROMPT)
    expected = run(gemma4, ids, mask, max_new_tokens=NEW_TOKENS)
    config = {"pool": pool, "page_size": 4}
    actual = run(gemma4, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation="paged_pool", cache_config=config)
    assert_same_generation(expected, actual)
    del actual
    cache = PagedCache(gemma4.config, config)
    with torch.no_grad():
        gemma4(ids, attention_mask=mask, cache=cache)
    stats, parts = pool.stats(), [part.stats() for part in pool.parts]
    assert stats["pages_used"] == sum(part["pages_used"] for part in parts) > parts[0]["pages_used"] > 0
    assert stats["bytes_used"] == sum(part["pages_used"] * part["page_bytes"] for part in parts)
    assert cache.memory_stats()["bytes_held"] == stats["bytes_used"]
    cache.release()
    assert pool.stats()["pages_used"] == 0
    pool.check_integrity()


def test_max_bytes_is_shared_so_that_each_geometry_holds_as_many_tokens(gemma4):
    pool = KVPool.for_model(gemma4, PagedConfig(page_size=4), max_bytes=4 << 20)
    tokens = [part.stats()["pages_total"] // part.format.num_layer_groups * 4 for part in pool.parts]
    assert abs(tokens[0] - tokens[1]) <= 4 and pool.stats()["bytes_total"] <= 4 << 20


def test_a_pool_of_another_geometry_is_refused_by_name(gemma4):
    ids, mask = padded_batch(PROMPT)
    others = [
        KVPool.for_model(tiny_llama(), PagedConfig(page_size=4), max_tokens=64),
        KVPool.for_model(gemma4, PagedConfig(page_size=4), max_tokens=64).parts[0],  # one part of the set
    ]
    for other in others:
        with pytest.raises(IncompatibleModelError, match=r"pages of 1 geometries vs 2.*\(2, 512, 512\)"):
            run(gemma4, ids, mask, max_new_tokens=1, cache_implementation="paged_pool", cache_config={"pool": other})


def test_admission_is_checked_on_each_geometrys_pool(gemma4):
    """The global layers' pool is the one too small: refused before any compute, naming its layer groups."""
    pool = KVPool.for_model(gemma4, PagedConfig(page_size=4), max_tokens=64)
    small = KVPoolSet([pool.parts[0], KVPool(pool.formats[1], 3)])
    ids, mask = padded_batch(PROMPT)
    config = {"pool": small, "page_size": 4, "admission_check": True}
    with pytest.raises(PoolExhaustedError, match="admission_check refused"):
        run(gemma4, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation="paged_pool", cache_config=config)
    assert small.stats()["pages_used"] == 0


def test_prefix_caching_is_refused_by_name(gemma4):
    with pytest.raises(ValueError, match="2 geometries.*prefix_caching"):
        KVPool.for_model(gemma4, PagedConfig(page_size=4), max_tokens=64, prefix_caching=True)


def test_a_cache_asked_to_reuse_prompts_says_once_why_it_does_not(gemma4, caplog, monkeypatch):
    monkeypatch.setattr(prefix_module, "_logged", set())
    ids, mask = padded_batch(PROMPT)
    expected = run(gemma4, ids, mask, max_new_tokens=NEW_TOKENS)
    config = {"prefix_caching": True, "max_tokens": 64, "page_size": 4}
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        for _ in range(2):
            actual = run(
                gemma4, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation="paged_pool", cache_config=config
            )
            assert_same_generation(expected, actual)
    refusals = [record.message for record in caplog.records if "2 geometries" in record.message]
    assert len(refusals) == 1, refusals
