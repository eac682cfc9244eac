"""Pages cut for the keys and values the model writes: multi-query models (one KV head: GPTBigCode's config says so
with ``multi_query``), multi-head latent attention (its compressed latent as keys and its rope key as values, one head:
DeepSeek-V3: values of another width than keys, in full precision; the quantized caches refuse it by name), decoders
whose config names an encoder's heads besides theirs (ProphetNet) or heads of ``dim_head`` (CPM-Ant); and the models
whose layers write heads of different geometries, refused by name before any page is taken (MiMo-V2-Flash).

Tiny random-init models from ``hf_kvcache.testing.tiny_causal_lm``, against ``DynamicCache``."""

import dataclasses

import pytest
import torch

from hf_kvcache import IncompatibleModelError, KVPool, PagedCache, PagedConfig
from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import model_attention
from hf_kvcache.layers import PagedRows
from hf_kvcache.layers.read_path import IN_PLACE
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.testing import tiny_causal_lm, tiny_llama
from tests.helpers import assert_same_generation, exact_config, padded_batch, run

PROMPT = [5, 11]
NEW_TOKENS = 5


def assert_generates_as_dynamic_cache(model, cache_name: str) -> None:
    ids, mask = padded_batch(PROMPT, vocab=256, seed=2)
    expected = run(model, ids, mask, max_new_tokens=NEW_TOKENS)
    config = exact_config(cache_name, max(PROMPT) + NEW_TOKENS)
    config.pop("group_size", None)  # the default: the model's head, however wide
    actual = run(model, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation=cache_name, cache_config=config)
    assert_same_generation(expected, actual)


@pytest.fixture(scope="module")
def starcoder():
    """GPTBigCode with multi-query attention (StarCoder, SantaCoder): one KV head for 4 query heads."""
    return tiny_causal_lm("gpt_bigcode", multi_query=True)


@pytest.fixture(scope="module")
def latent():
    """DeepSeek-V3's latent attention as released: its cached latent (kv_lora_rank 16) wider than its rope key (8)."""
    return tiny_causal_lm("deepseek_v3")


def test_a_multi_query_model_is_cut_one_kv_head(starcoder):
    page_format = PageFormat.from_model_config(starcoder.config, torch.float32)
    assert (page_format.num_kv_heads, page_format.head_dim) == (1, 16)


def test_a_multi_query_model_generates_on_the_default_pool(starcoder, cache_name, fresh_default_pools):
    assert_generates_as_dynamic_cache(starcoder, cache_name)


def test_latent_attention_is_cut_one_head_of_its_latent_and_rope_key(latent):
    page_format = PageFormat.from_model_config(latent.config, torch.float32)
    assert (page_format.num_kv_heads, page_format.head_dim, page_format.value_dim) == (1, 16, 8)
    assert page_format.page_bytes == 2 * 1 * (16 + 8) * 4 * page_format.page_size  # 2 layers, fp32


@pytest.mark.parametrize("attention", [None, "hf_kvcache"])
@pytest.mark.parametrize("cache_name", ["paged_pool", "sliding_ring"])
def test_latent_attention_generates_on_the_default_pool(latent, cache_name, attention, fresh_default_pools):
    with model_attention(latent, attention):
        assert_generates_as_dynamic_cache(latent, cache_name)


@pytest.mark.parametrize("cache_name", ["quantized_values", "quantized_kv"])
def test_values_of_another_width_are_refused_by_the_quantized_caches_before_any_page(
    latent, cache_name, fresh_default_pools
):
    ids, mask = padded_batch(PROMPT, vocab=256)
    with pytest.raises(IncompatibleModelError, match="Keys of width 16 and values of width 8 are stored in full"):
        latent.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation=cache_name)
    assert KVPool.drop_defaults() == 0  # no pool was made, so no page was taken


@pytest.mark.parametrize(
    "model_type,overrides,geometry",
    [
        ("prophetnet", {"num_decoder_attention_heads": 8}, (8, 8)),  # the encoder's heads are num_attention_heads
        ("cpmant", {"dim_head": 32}, (4, 32)),  # heads of dim_head channels, not hidden_size / heads
    ],
    ids=["prophetnet", "cpmant"],
)
def test_a_decoder_is_cut_for_the_heads_it_writes(model_type, overrides, geometry, fresh_default_pools):
    model = tiny_causal_lm(model_type, **overrides)
    page_format = PageFormat.from_model_config(model.config, torch.float32)
    assert (page_format.num_kv_heads, page_format.head_dim) == geometry
    assert_generates_as_dynamic_cache(model, "paged_pool")


def test_layers_of_different_geometries_are_refused_by_name_before_any_page(cache_name, fresh_default_pools):
    """MiMo-V2-Flash's sliding layers hold twice the KV heads of its full-attention layers: no one pool holds both."""
    model = tiny_causal_lm("mimo_v2_flash", num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(IncompatibleModelError, match=r"different geometries \(\[\(2, 24, 16\), \(4, 24, 16\)\]"):
        PagedCache(model.config)
    ids, mask = padded_batch(PROMPT, vocab=256)
    with pytest.raises(IncompatibleModelError, match="DynamicCache"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation=cache_name)
    assert KVPool.drop_defaults() == 0  # no pool was made, so no page was taken


def test_a_given_pool_of_another_geometry_keeps_its_error(starcoder):
    pool = KVPool.for_model(tiny_llama(), PagedConfig(), max_tokens=64)  # 2 KV heads
    cache = PagedCache(starcoder.config, {"pool": pool})
    ids, mask = padded_batch(PROMPT, vocab=256)
    with pytest.raises(IncompatibleModelError, match=r"pool was built for another model .*num_kv_heads 2 vs 1"):
        starcoder.generate(ids, attention_mask=mask, max_new_tokens=2, cache=cache)
    assert pool.stats()["pages_used"] == 0


def test_values_are_as_wide_as_keys_unless_the_format_says_otherwise():
    page_format = PageFormat(2, 2, 16, torch.float32)
    assert page_format.value_head_dim is None and page_format.value_dim == 16
    assert dataclasses.replace(page_format, head_dim=32).value_dim == 32  # follows the keys
    assert PageFormat(2, 2, 16, torch.float32, value_head_dim=8).page_bytes == 2 * 2 * (16 + 8) * 4 * 16


def test_values_of_another_width_are_read_in_place_at_their_width(monkeypatch):
    """An in-place read hands attention views of the pool's first pages, the values' cut at their own width (no
    model with such values reads in place today: latent attention uses its cache's states outside the attention
    call, so it reads gathered)."""
    monkeypatch.setattr(flex, "MIN_IN_PLACE_TOKENS", 0)
    pool = KVPool(PageFormat(1, 2, 16, torch.float32, page_size=4, value_head_dim=8), num_pages=256)
    rows = PagedRows(pool.pages, our_attention=lambda: True)
    states = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 8)  # [batch, heads, tokens, width]
    for start, end in ((0, 6), (6, 7)):  # a prefill, then a decode step
        step = tuple(part[:, :, start:end] for part in states)
        plan = rows.plan_step(0, start, *step, hands_over=True)
        rows.write(plan, 0, *step)
        keys, values = rows.read(plan, 0, *step, handoff={})
    assert plan.mode == IN_PLACE
    page_ids, page_size = rows._page_ids(), 4
    for row in range(2):
        slots = torch.tensor([page_ids[row, t // page_size] * page_size + t % page_size for t in range(7)])
        for held, written in zip((keys, values), states):
            assert torch.equal(held[0][:, slots], written[row])


def test_a_multi_query_model_decodes_compiled_in_one_graph(starcoder, compile_config, fresh_dynamo):
    """generate compiles the decode step of a one-KV-head model once (issue 46, item 5), with eager's tokens."""
    ids, mask = padded_batch(PROMPT, vocab=256, seed=2)
    expected = run(starcoder, ids, mask, max_new_tokens=NEW_TOKENS)
    actual = run(
        starcoder,
        ids,
        mask,
        max_new_tokens=NEW_TOKENS,
        cache_implementation="paged_pool",
        compile_config=compile_config,
    )
    assert torch.equal(actual.sequences, expected.sequences)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_a_multi_query_model_reuses_its_prompt_pages(starcoder):
    """A second call with the same prompt takes the first call's pages from the pool's prefix index (one KV head a
    page) and generates the same tokens."""
    pool = KVPool.for_model(starcoder, PagedConfig(page_size=4), max_tokens=512, prefix_caching=True)
    ids = torch.randint(1, 256, (1, 18), generator=torch.Generator().manual_seed(5))
    calls = [
        run(
            starcoder,
            ids,
            torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            cache_implementation="paged_pool",
            cache_config={"pool": pool},
        )
        for _ in range(2)
    ]
    assert_same_generation(*calls)
    assert pool.stats()["prefix_tokens_reused"] == 16  # 17 tokens at most (the last is fed), whole pages of 4
