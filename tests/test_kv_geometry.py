"""Pages cut for the keys and values the model writes: multi-query models (one KV head: GPTBigCode's config says so
with ``multi_query``), multi-head latent attention (its compressed latent as keys and its rope key as values, one head:
DeepSeek-V3: values of another width than keys, stored at their width, in full precision or coded at their width by
the quantized caches), decoders whose config names an encoder's heads besides theirs (ProphetNet) or heads of
``dim_head`` (CPM-Ant); and the models whose layers write heads of different geometries, refused by name before any
page is taken (MiMo-V2-Flash).

Tiny random-init models from ``hf_kvcache.testing.tiny_causal_lm``, against ``DynamicCache``."""

import dataclasses

import pytest
import torch
from transformers import CompileConfig

from hf_kvcache import (
    IncompatibleModelError,
    KVPool,
    PagedCache,
    PagedConfig,
    QuantizedKVCache,
    QuantizedValueCache,
)
from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import model_attention
from hf_kvcache.layers import PagedRows
from hf_kvcache.layers.read_path import IN_PLACE
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.quant import QuantFormat, dequantize, quantize
from hf_kvcache.testing import tiny_causal_lm, tiny_llama
from tests.helpers import assert_same_generation, exact_config, padded_batch, random_ids, run, teacher_forced_logits
from tests.test_quantized_cache import QuantDequantValues
from tests.test_quantized_kv_cache import EncodedKVSpec

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
def test_latent_attention_generates_on_the_default_pool(latent, cache_name, attention, fresh_default_pools):
    """Every cache, the quantized ones with every value in their residual window (and keys on one page still
    filling): DynamicCache's tokens and logits on a padded batch."""
    with model_attention(latent, attention):
        assert_generates_as_dynamic_cache(latent, cache_name)


@pytest.mark.parametrize(
    "settings",
    [
        {"bits": 8, "residual_length": 0},
        {"bits": 4, "residual_length": 5},
        {"bits": 4, "group_size": 4, "residual_length": 0},
    ],
    ids=["int8", "int4-residual5", "int4-groups4"],
)
@pytest.mark.parametrize("chunks", [[30, 1], [3, 7, 1]])
def test_values_of_another_width_are_coded_at_their_width(latent, settings, chunks):
    """quantized_values on latent attention: its rope key (8 wide, the values) coded per token at its own width, in
    scale groups of its own (default: the whole value), its latent (16, the keys) kept exact; equal to the spec that
    quantizes and dequantizes the values DynamicCache returns, through a prefill, chunks and decode steps."""
    ids = random_ids(2, 40, seed=3, vocab=256)
    spec = {**settings, "group_size": settings.get("group_size", 8)}
    expected = teacher_forced_logits(latent, ids, QuantDequantValues(latent.config, **spec), chunks)
    cache = QuantizedValueCache(latent.config, {**settings, "page_size": 4})
    actual = teacher_forced_logits(latent, ids, cache, chunks)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert (cache.pool.format.head_dim, cache.pool.format.value_format.head_dim) == (16, 8)


@pytest.mark.parametrize("key_bits,value_bits,residual_length", [(4, 8, 0), (8, 4, 5), (4, 4, 40)])
@pytest.mark.parametrize("chunks", [[30, 1], [3, 7, 1]])
def test_keys_and_values_of_different_widths_are_each_coded_at_theirs(
    latent, key_bits, value_bits, residual_length, chunks
):
    """quantized_kv on latent attention: the latent (keys, 16 wide) coded a page at a time at its width (per channel
    at 4 bits, per token at 8), the rope key (values, 8) per token at its own; equal to the encode-once spec through
    pages that fill in a prefill, in chunks and in decode steps."""
    ids = random_ids(2, 40, seed=key_bits + residual_length, vocab=256)
    settings = {"key_bits": key_bits, "value_bits": value_bits, "group_size": 8, "residual_length": residual_length}
    spec = EncodedKVSpec(latent.config, **settings, page_size=4)
    expected = teacher_forced_logits(latent, ids, spec, chunks)
    cache = QuantizedKVCache(latent.config, {**settings, "page_size": 4, "sink_tokens": 0})
    actual = teacher_forced_logits(latent, ids, cache, chunks)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("cache_class", [QuantizedValueCache, QuantizedKVCache])
def test_a_group_size_that_does_not_divide_the_values_width_names_it(latent, cache_class):
    with pytest.raises(ValueError, match=r"group_size=16 does not divide the model's value width=8; choose one of"):
        cache_class(latent.config, {"group_size": 16}).update(torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 8), 0)


@pytest.mark.parametrize("cache_name", ["quantized_values", "quantized_kv"])
def test_latent_attention_decodes_compiled_in_one_graph_as_eager(latent, cache_name, fresh_dynamo):
    """Compiled decode steps code and read values at their own width in the graph (and keys at theirs): the tokens
    of the eager cache, past its residual window and several pages, one graph."""
    ids, mask = padded_batch([9, 5], vocab=256, seed=4)
    cache_config = {"page_size": 4, "residual_length": 2}
    kwargs = {"attention_mask": mask, "max_new_tokens": 12, "do_sample": False, "cache_implementation": cache_name}
    eager = latent.generate(ids, cache_config=cache_config, **kwargs)
    compile_config = CompileConfig(mode="default", fullgraph=True)
    compile_config._compile_all_devices = True
    compiled = latent.generate(ids, cache_config=cache_config, compile_config=compile_config, **kwargs)
    assert torch.equal(compiled, eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


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


def test_quantized_values_of_another_width_are_read_in_place_at_their_width(monkeypatch):
    """An in-place read of coded values hands attention the visited pages' values decoded at their own width into a
    buffer laid out as the storage's slots, the residual window's newest tokens exact over theirs."""
    monkeypatch.setattr(flex, "MIN_IN_PLACE_TOKENS", 0)
    page_format = PageFormat(1, 2, 16, torch.float32, page_size=4, value_bits=8, value_group_size=4, value_head_dim=8)
    pool = KVPool(page_format, num_pages=256)
    rows = PagedRows(pool.pages, residual_length=2, our_attention=lambda: True)
    states = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 8)  # [batch, heads, tokens, width]
    for start, end in ((0, 6), (6, 7)):  # a prefill, then a decode step
        step = tuple(part[:, :, start:end] for part in states)
        plan = rows.plan_step(0, start, *step, hands_over=True)
        rows.write(plan, 0, *step)
        keys, values = rows.read(plan, 0, *step, handoff={})
    assert plan.mode == IN_PLACE and values.shape[-1] == 8
    fmt = QuantFormat(8, 4, 8)
    coded = dequantize(*quantize(states[1], fmt), fmt, torch.float32)
    expected = torch.cat([coded[:, :, :5], states[1][:, :, 5:]], dim=2)  # tokens 5 and 6: the residual window
    page_ids, page_size = rows._page_ids(), 4
    for row in range(2):
        slots = torch.tensor([page_ids[row, t // page_size] * page_size + t % page_size for t in range(7)])
        assert torch.equal(keys[0][:, slots], states[0][row])
        torch.testing.assert_close(values[0][:, slots], expected[row], rtol=0, atol=1e-6)
    assert not torch.equal(coded[:, :, :5], states[1][:, :, :5])  # the codes lose something: the test can tell


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
