"""One typed config per cache: ``generate(cache_config=...)``, the cache classes and ``KVPool.for_model`` take it, as a
dict or the dataclass, and it checks itself (naming the setting and the value)."""

import dataclasses

import pytest
import torch
from helpers import padded_batch, run

import hf_kvcache
from hf_kvcache import (
    KVPool,
    PagedCache,
    PagedConfig,
    QuantizedKVCache,
    QuantizedKVConfig,
    QuantizedValueCache,
    QuantizedValueConfig,
    SlidingRingCache,
    SlidingRingConfig,
)

CONFIGS = {
    "paged_pool": (PagedCache, PagedConfig, {"page_size": 8}),
    "sliding_ring": (SlidingRingCache, SlidingRingConfig, {"window": 16, "sink_tokens": 2}),
    "quantized_values": (QuantizedValueCache, QuantizedValueConfig, {"bits": 4, "group_size": 16}),
    "quantized_kv": (QuantizedKVCache, QuantizedKVConfig, {"key_bits": 8, "value_bits": 4, "group_size": 16}),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_generate_with_the_dataclass_equals_generate_with_the_dict(tiny_llama_model, name):
    _, config_class, settings = CONFIGS[name]
    ids, mask = padded_batch([5, 9])
    by_dict = run(tiny_llama_model, ids, mask, max_new_tokens=6, cache_implementation=name, cache_config=settings)
    typed = config_class(**settings)
    by_class = run(tiny_llama_model, ids, mask, max_new_tokens=6, cache_implementation=name, cache_config=typed)
    assert torch.equal(by_dict.sequences, by_class.sequences)
    assert type(by_class.cache).__name__ == CONFIGS[name][0].__name__
    assert by_class.cache.cache_config == typed


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_cache_takes_its_config_or_a_dict(tiny_llama_model, name):
    cache_class, config_class, settings = CONFIGS[name]
    assert cache_class(tiny_llama_model.config, settings).cache_config == config_class(**settings)
    assert cache_class(tiny_llama_model.config, config_class(**settings)).cache_config == config_class(**settings)


@pytest.mark.parametrize("name", ["quantized_values", "quantized_kv"])
def test_for_model_builds_the_pool_a_quantized_cache_accepts(tiny_llama_model, name):
    cache_class, config_class, settings = CONFIGS[name]
    config = config_class(**settings, page_size=8)
    pool = KVPool.for_model(tiny_llama_model, config, max_tokens=256)
    assert pool.format.page_size == 8 and pool.format.value_bits == 4
    cache = cache_class(tiny_llama_model.config, dataclasses.replace(config, pool=pool))
    ids, mask = padded_batch([4, 7])
    out = run(tiny_llama_model, ids, mask, max_new_tokens=3, cache=cache)
    assert out.cache.pool is pool and pool.stats()["pages_used"] > 0
    plain = KVPool.for_model(tiny_llama_model, max_tokens=256)
    with pytest.raises(ValueError, match="value_bits None vs 4.*KVPool.for_model\(model, cache_config"):
        cache_class(tiny_llama_model.config, {**settings, "pool": plain}, dtype=torch.float32, device="cpu")


def test_for_model_refuses_what_is_not_a_cache_config(tiny_llama_model):
    with pytest.raises(TypeError, match=r"config=\{'bits': 4\}.*QuantizedValueConfig"):
        KVPool.for_model(tiny_llama_model, {"bits": 4}, max_tokens=64)


@pytest.mark.parametrize(
    "make,error,words",
    [
        (lambda: PagedConfig(page_size=0), ValueError, "page_size=0"),
        (lambda: PagedConfig(max_tokens="8"), TypeError, "max_tokens must be an int, got '8'"),
        (lambda: PagedConfig.parse({"windw": 8}), ValueError, r"\['windw'\].*page_size"),
        (lambda: PagedConfig.parse([("page_size", 8)]), TypeError, "cache_config"),
        (lambda: SlidingRingConfig(window=0), ValueError, "window=0"),
        (lambda: SlidingRingConfig(sink_tokens=2), ValueError, "sink_tokens=2 needs a window"),
        (lambda: QuantizedValueConfig(bits=3), ValueError, "bits=3"),
        (lambda: QuantizedKVConfig(key_bits=2), ValueError, "key_bits=2"),
        (lambda: QuantizedKVConfig(page_size=6, residual_length=-1), ValueError, "residual_length=-1"),
        (lambda: PagedConfig.parse(QuantizedKVConfig()), TypeError, "QuantizedKVConfig.*PagedConfig"),
    ],
)
def test_bad_settings_name_the_setting_and_the_value(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_a_cache_refuses_another_cache_s_config(tiny_llama_model):
    with pytest.raises(TypeError, match="SlidingRingConfig.*give a PagedConfig"):
        PagedCache(tiny_llama_model.config, SlidingRingConfig(window=8))
    with pytest.raises(TypeError, match="QuantizedKVConfig"):
        tiny_llama_model.generate(
            torch.tensor([[1, 2, 3]]),
            max_new_tokens=2,
            cache_implementation="quantized_values",
            cache_config=QuantizedKVConfig(),
        )


def test_the_configs_are_exported_one_per_cache():
    exported = {name for name in hf_kvcache.__all__ if name.endswith("Config")}
    assert exported == {"PagedConfig", "SlidingRingConfig", "QuantizedValueConfig", "QuantizedKVConfig"}
    for cache_class, config_class, _ in CONFIGS.values():
        assert cache_class.config_class is config_class
