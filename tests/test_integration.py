"""Registration: three seams in transformers plus an attention name; additive, idempotent, undoable, version-checked.

The seams themselves are pinned in ``test_transformers_internals.py``."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache, GenerationConfig, StaticCache

import hf_kvcache
from hf_kvcache import KVPool, PagedCache
from hf_kvcache.attention.interface import ATTENTION_NAME, banded_sdpa_attention, model_attention_mask
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.integration.seams import check_transformers_version
from hf_kvcache.transformers_internals import (
    cache_implementations,
    prepare_cache_method,
    prepare_inputs_method,
    sdpa_attention_forward,
)


def test_register_is_idempotent_and_undoable():
    assert hf_kvcache.is_registered()
    names = cache_implementations()
    hf_kvcache.register()
    assert names == cache_implementations()
    assert all(names.count(name) == 1 for name in REGISTRY)
    hf_kvcache.unregister()
    try:
        assert not any(name in cache_implementations() for name in REGISTRY)
        assert prepare_cache_method().__module__ == "transformers.generation.utils"
        original_inputs = prepare_inputs_method()
        assert original_inputs.__module__ == "transformers.generation.utils"
        assert ATTENTION_NAME not in AttentionInterface._global_mapping
        assert ATTENTION_NAME not in AttentionMaskInterface._global_mapping
        with pytest.raises(ValueError, match="Invalid `cache_implementation`"):
            GenerationConfig(cache_implementation="paged_pool").validate(strict=True)
        hf_kvcache.unregister()  # a no-op
    finally:
        hf_kvcache.register()
    assert names == cache_implementations()
    assert prepare_inputs_method() is not original_inputs and prepare_inputs_method().__wrapped__ is original_inputs
    assert AttentionInterface._global_mapping[ATTENTION_NAME] is banded_sdpa_attention
    assert AttentionMaskInterface._global_mapping[ATTENTION_NAME] is model_attention_mask


@pytest.mark.parametrize("name,expected", [(None, DynamicCache), ("dynamic", DynamicCache), ("static", StaticCache)])
def test_existing_names_behave_as_before(tiny_llama_model, name, expected):
    ids = torch.tensor([[1, 5, 9, 3]])
    out = tiny_llama_model.generate(
        ids, max_new_tokens=3, do_sample=False, cache_implementation=name, return_dict_in_generate=True
    )
    assert type(out.cache) is expected
    hf_kvcache.unregister()
    try:
        before = tiny_llama_model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation=name)
    finally:
        hf_kvcache.register()
    assert torch.equal(out.sequences, before)


def test_generation_config_naming_our_cache_saves_and_loads(tmp_path, tiny_llama_model, cache_name, make_pool):
    name = cache_name
    pool = make_pool(tiny_llama_model, name, max_tokens=512, page_size=8, name=f"saved-{name}")
    cache_config = {**REGISTRY[name].example_config, "pool": f"saved-{name}"}
    config = GenerationConfig(cache_implementation=name, cache_config=cache_config, max_new_tokens=4, do_sample=False)
    config.validate(strict=True)
    config.save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.cache_implementation == name and loaded.cache_config == cache_config
    out = tiny_llama_model.generate(torch.tensor([[1, 2, 3]]), generation_config=loaded, return_dict_in_generate=True)
    assert isinstance(out.cache, REGISTRY[name].cache_class) and out.cache.pool is pool


def test_cache_config_pool_is_used_as_is_and_max_tokens_makes_a_pool(tiny_llama_model):
    pool = KVPool.for_model(tiny_llama_model, max_tokens=256)
    ids = torch.tensor([[4, 5, 6]])
    out = tiny_llama_model.generate(
        ids,
        max_new_tokens=2,
        cache_implementation="paged_pool",
        cache_config={"pool": pool},
        return_dict_in_generate=True,
    )
    assert out.cache.pool is pool
    own = tiny_llama_model.generate(
        ids,
        max_new_tokens=2,
        cache_implementation="paged_pool",
        cache_config={"max_tokens": 64, "page_size": 8},
        return_dict_in_generate=True,
    ).cache.pool
    assert own is not pool and own.stats()["pages_total"] == 8 and own.format.page_size == 8


def test_cache_object_and_name_together_are_rejected(tiny_llama_model):
    with pytest.raises(ValueError, match="both"):
        tiny_llama_model.generate(
            torch.tensor([[1, 2]]),
            max_new_tokens=2,
            cache_implementation="paged_pool",
            cache=PagedCache(tiny_llama_model.config),
        )


def test_transformers_version_is_checked():
    check_transformers_version("5.24.0")
    with pytest.raises(ImportError, match=r"supports transformers >= 5.24, < 6.0; found 4.46.0"):
        check_transformers_version("4.46.0")
    with pytest.raises(ImportError, match=r"found 5.23.0"):  # passes the cache as past_key_values
        check_transformers_version("5.23.0")


@pytest.mark.parametrize("batch,heads,kv_heads", [(1, 9, 3), (2, 4, 2)])
def test_unmasked_decode_packs_the_query_heads_of_each_kv_head(monkeypatch, batch, heads, kv_heads):
    """Under this attention an unmasked decode step of grouped KV heads calls sdpa once, each KV head's query heads
    as its query rows, and equals transformers' sdpa (torch's grouped path) to float rounding."""
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    query = torch.randn(batch, heads, 1, 16)  # [batch, heads, 1, head_dim]
    key, value = torch.randn(2, batch, kv_heads, 40, 16)  # [batch, kv_heads, 40, head_dim] each
    sdpa, queries = F.scaled_dot_product_attention, []
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda q, *a, **kw: queries.append(q.shape) or sdpa(q, *a, **kw)
    )
    packed, _ = banded_sdpa_attention(module, query, key, value, None, scaling=0.25)
    assert queries == [(batch, kv_heads, heads // kv_heads, 16)]
    reference, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.25)
    assert packed.shape == reference.shape == (batch, 1, heads, 16)
    torch.testing.assert_close(packed, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_a_masked_decode_step_packs_the_query_heads_where_transformers_would_repeat_the_kv_heads(
    monkeypatch, mask_dtype
):
    """A decode step of grouped KV heads under a mask, as a compiled step gets one (transformers builds the mask of
    a compileable cache; under dynamo its sdpa repeats every key and value once per query head): this attention
    packs each KV head's query heads as query rows under the same mask instead, so sdpa reads the KV heads as they
    are, and equals transformers' sdpa to float rounding."""
    import transformers.integrations.sdpa_attention as transformers_sdpa

    batch, heads, kv_heads = 2, 9, 3
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    query = torch.randn(batch, heads, 1, 16)  # [batch, heads, 1, head_dim]
    key, value = torch.randn(2, batch, kv_heads, 40, 16)  # [batch, kv_heads, 40, head_dim] each
    seen = torch.arange(40) >= torch.tensor([[0], [7]])  # [batch, 40]: the second row's 7 tokens of left padding
    mask = (
        seen if mask_dtype == torch.bool else torch.zeros(batch, 40).masked_fill(~seen, torch.finfo(torch.float32).min)
    )
    mask = mask.view(batch, 1, 1, 40)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    monkeypatch.setattr(transformers_sdpa, "is_torchdynamo_compiling", lambda: True)  # as inside generate's graph
    sdpa, shapes = F.scaled_dot_product_attention, []
    monkeypatch.setattr(
        F,
        "scaled_dot_product_attention",
        lambda q, k, *a, **kw: shapes.append((q.shape, k.shape)) or sdpa(q, k, *a, **kw),
    )
    packed, _ = banded_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    assert shapes == [((batch, kv_heads, heads // kv_heads, 16), (batch, kv_heads, 40, 16))]
    assert packed.shape == reference.shape == (batch, 1, heads, 16)
    torch.testing.assert_close(packed, reference, rtol=0, atol=1e-6)
