"""Prompt reuse never serves pages that another computation wrote, and keeps what it can reuse.

Each test starts from one way a page could be served wrongly or lost: another config over the same weights,
weights written in place, adapters switched, a quantized cache continued, an offloaded model, a
``max_tokens`` pool, eviction of a prompt's head, a 4-D mask, and impossible budgets. Reused generations are
compared with a fresh run of the same model (``assert_same_tokens_close_logits``; a quantized cache's with the cache
continued)."""

import logging

import pytest
import torch

from hf_kvcache import KVPool
from hf_kvcache.caches import prefix as prefix_module
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.testing import tiny_gemma3, tiny_llama, tiny_mistral
from tests.helpers import random_ids
from tests.test_prefix_caching import PAGE_SIZE, assert_same_tokens_close_logits, greedy, prefix_pool


@pytest.fixture(autouse=True)
def fresh_reasons(monkeypatch):
    """Every test sees the refusal reasons logged anew."""
    monkeypatch.setattr(prefix_module, "_logged", set())


def reused_by(pool: KVPool, model, ids, name: str = "paged_pool", config: dict | None = None, **kwargs):
    """Generates on ``pool``; returns the output and the prompt tokens that call reused."""
    before = pool.stats()["prefix_tokens_reused"]
    out = greedy(model, ids, name, {**(config or {}), "pool": pool}, **kwargs)
    return out, pool.stats()["prefix_tokens_reused"] - before


def test_same_weights_under_another_rope_config_never_reuse_each_others_pages():
    base = tiny_llama()
    scaled = tiny_llama(rope_parameters={"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0})
    scaled.load_state_dict(base.state_dict())
    pool = prefix_pool(base, "paged_pool")
    ids = random_ids(1, 40)
    greedy(base, ids, "paged_pool", {"pool": pool})
    reference = greedy(scaled, ids, "paged_pool", {})
    candidate, reused = reused_by(pool, scaled, ids)
    assert reused == 0
    assert_same_tokens_close_logits(reference, candidate)
    _, reused = reused_by(pool, scaled, ids)  # its own pages are found again
    assert reused == 36
    pool.check_integrity()


def test_weights_written_in_place_are_never_served_the_old_weights_pages():
    model, other = tiny_llama(seed=0), tiny_llama(seed=1)
    pool = prefix_pool(model, "paged_pool")
    ids = random_ids(1, 40)
    greedy(model, ids, "paged_pool", {"pool": pool})
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
            mine.data.copy_(theirs.data)  # keeps each parameter's pointer and version counter
    candidate, reused = reused_by(pool, model, ids)
    assert reused == 0
    assert_same_tokens_close_logits(greedy(other, ids, "paged_pool", {}), candidate)


def test_a_namespace_keeps_pages_apart_and_reset_drops_every_cached_page():
    model = tiny_llama()
    pool = prefix_pool(model, "paged_pool")
    ids = random_ids(1, 40)
    greedy(model, ids, "paged_pool", {"pool": pool, "prefix_namespace": "tenant-a"})
    assert reused_by(pool, model, ids, config={"prefix_namespace": "tenant-b"})[1] == 0
    assert reused_by(pool, model, ids, config={"prefix_namespace": "tenant-a"})[1] == 36
    assert pool.stats()["pages_cached"] > 0
    assert pool.reset_prefix_index() > 0
    stats = pool.stats()
    assert stats["pages_cached"] == 0 and stats["pages_used"] == 0
    assert reused_by(pool, model, ids, config={"prefix_namespace": "tenant-a"})[1] == 0
    pool.check_integrity()
    with pytest.raises(TypeError, match="prefix_namespace"):
        greedy(model, ids, "paged_pool", {"prefix_namespace": 3})


def test_reset_keeps_the_pages_live_caches_hold_and_they_are_never_published_again():
    """After a reset (e.g. weights updated in place), what a live cache wrote before it may be stale."""
    model = tiny_llama()
    pool = prefix_pool(model, "paged_pool")
    out = greedy(model, random_ids(1, 40), "paged_pool", {"pool": pool})  # out.cache still holds its pages
    held = pool.stats()["pages_used"]
    assert pool.reset_prefix_index() > 0
    assert pool.stats()["pages_used"] == held and pool.stats()["pages_cached"] == 0
    pool.check_integrity()
    out.cache.release()
    assert pool.stats()["pages_used"] == 0
    pool.check_integrity()


def test_switching_or_disabling_an_adapter_never_reuses_the_other_adapters_pages():
    peft = pytest.importorskip("peft")  # the dev extra installs it
    base = tiny_llama()
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, lora, adapter_name="one").eval()
    model.add_adapter("two", peft.LoraConfig(r=4, target_modules=["k_proj"], init_lora_weights=False))
    pool = prefix_pool(base, "paged_pool")
    ids = random_ids(1, 40)
    greedy(model, ids, "paged_pool", {"pool": pool})  # adapter "one"
    with model.disable_adapter():
        reference = greedy(model, ids, "paged_pool", {})
        candidate, reused = reused_by(pool, model, ids)
    assert reused == 0
    assert_same_tokens_close_logits(reference, candidate)
    model.set_adapter("two")
    reference = greedy(model, ids, "paged_pool", {})
    candidate, reused = reused_by(pool, model, ids)
    assert reused == 0
    assert_same_tokens_close_logits(reference, candidate)
    model.set_adapter("one")
    assert reused_by(pool, model, ids)[1] == 36


@pytest.mark.parametrize("build", [tiny_llama, tiny_mistral, tiny_gemma3], ids=["llama", "mistral", "gemma3"])
@pytest.mark.parametrize(
    "name,config",
    [
        ("quantized_kv", {"key_bits": 4, "value_bits": 4, "group_size": 16, "residual_length": 0}),
        ("quantized_kv", {"key_bits": 8, "value_bits": 4, "group_size": 16, "residual_length": 0}),
        ("quantized_values", {"bits": 4, "group_size": 16, "residual_length": 0}),
    ],
    ids=["kv-k4v4", "kv-k8v4", "values-int4"],
)
def test_a_second_turn_of_a_quantized_cache_continues_the_first(build, name, config):
    """A cache that stores codes (here with nothing beside them in full precision) reuses its pages as the first turn's
    cache continued, on every model kind (tests/test_prefix_quantized.py: with a residual window and a sink)."""
    from tests.test_prefix_quantized import continued

    model = build()
    model.set_attn_implementation("hf_kvcache")
    config = {**config, "page_size": PAGE_SIZE}
    pool = prefix_pool(model, name, cache_config=config)
    first = random_ids(2, 45, seed=1)
    answer = greedy(model, first, name, {**config, "pool": pool}).sequences
    second = torch.cat([answer, random_ids(2, 7, seed=2)], dim=1)  # [2, 58]
    reference = continued(model, first, second, name, config, decode_steps=3)  # 48 tokens: 12 whole pages
    candidate, reused = reused_by(pool, model, second, name, config)
    assert_same_tokens_close_logits(reference, candidate)
    assert reused == 2 * 48
    pool.check_integrity()


def test_a_model_with_a_layer_offloaded_to_disk_generates_and_reuses_nothing(tmp_path, caplog):
    pytest.importorskip("accelerate")
    from transformers import LlamaForCausalLM

    tiny_llama().save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
    device_map |= {"model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = LlamaForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    pool = prefix_pool(model, "paged_pool")
    ids = random_ids(1, 40)
    reference = greedy(tiny_llama(), ids, "paged_pool", {})
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        for _ in range(2):
            candidate, reused = reused_by(pool, model, ids)
            assert reused == 0
            assert_same_tokens_close_logits(reference, candidate)
    assert any("offloaded" in record.message for record in caplog.records)
    pool.check_integrity()


def test_a_max_tokens_pool_with_prefix_caching_reuses_across_calls():
    model = tiny_llama()
    ids = random_ids(1, 40)
    config = {"max_tokens": 256, "prefix_caching": True}
    first = greedy(model, ids, "paged_pool", config)
    before = first.cache.pool.stats()["prefix_tokens_reused"]  # the pool is the process's: earlier calls count too
    second = greedy(model, ids, "paged_pool", config)
    assert second.cache.pool is first.cache.pool
    assert second.cache.pool.stats()["prefix_tokens_reused"] - before == 32  # 16-token pages: 2 of 39 prompt tokens
    assert_same_tokens_close_logits(first, second)
    other = greedy(model, ids, "paged_pool", {"max_tokens": 512, "prefix_caching": True})
    assert other.cache.pool is not first.cache.pool  # another budget, another pool
    plain = greedy(model, ids, "paged_pool", {"max_tokens": 256})
    assert plain.cache.pool is not first.cache.pool  # without prefix caching a call's pool is its own


def test_eviction_takes_a_prompts_tail_first_so_its_head_is_still_reused():
    """A released row's pages enter the least recently used order tail first: a partly evicted prompt still finds
    its head (a chain is reachable only from its first page)."""
    model = tiny_llama()
    pool = prefix_pool(model, "paged_pool", max_tokens=300)  # 75 pages of 4 tokens
    prompt = random_ids(1, 257, seed=3)
    greedy(model, prompt, "paged_pool", {"pool": pool}, max_new_tokens=1)
    assert pool.stats()["pages_cached"] == 64  # 256 tokens in whole pages
    free = pool.stats()["pages_free"]
    other = random_ids(1, (free + 16) * PAGE_SIZE - 1, seed=4)  # takes every free page, then evicts 16
    greedy(model, other, "paged_pool", {"pool": pool}, max_new_tokens=1)
    reference = greedy(model, prompt, "paged_pool", {})
    candidate, reused = reused_by(pool, model, prompt)
    assert reused == (64 - 16) * PAGE_SIZE
    assert_same_tokens_close_logits(reference, candidate)
    pool.check_integrity()


def test_a_four_dimensional_attention_mask_neither_looks_up_nor_publishes():
    model = tiny_llama()
    pool = prefix_pool(model, "paged_pool")
    ids = random_ids(1, 40)
    greedy(model, ids, "paged_pool", {"pool": pool})
    before = pool.stats()
    cache = pool_cache(model, pool)
    causal = torch.ones(40, 40).tril().bool()[None, None]  # [1, 1, 40, 40], a custom mask of the same causal shape
    assert cache.begin_generation(model, ids, 40, {"attention_mask": causal}) == 40  # fed in full
    model(ids, past_key_values=cache)
    cache.release()
    after = pool.stats()
    assert after["prefix_lookups"] == before["prefix_lookups"]  # nothing looked up
    assert after["pages_cached"] == before["pages_cached"]  # nothing published
    pool.check_integrity()


def pool_cache(model, pool):
    from hf_kvcache.integration.seams import build_cache

    return build_cache("paged_pool", model, {"pool": pool})


@pytest.mark.parametrize("max_tokens", [10**9, 10**12])
def test_an_impossible_budget_fails_at_once_naming_max_tokens(max_tokens):
    model = tiny_llama()
    with pytest.raises(ValueError, match=rf"max_tokens={max_tokens}.* bytes.*has"):
        KVPool.for_model(model, max_tokens=max_tokens)
    with pytest.raises(ValueError, match=rf"max_tokens={max_tokens}.* bytes.*has"):
        greedy(model, random_ids(1, 8), "paged_pool", {"max_tokens": max_tokens})


@pytest.mark.parametrize(
    "name,config",
    [
        ("quantized_kv", {"key_bits": 4, "value_bits": 4, "residual_length": 16}),
        ("quantized_kv", {"key_bits": 8, "value_bits": 4, "residual_length": 0}),
        ("quantized_values", {"bits": 4, "residual_length": 16}),
    ],
    ids=["kv-k4v4-r16", "kv-k8v4-r0", "values-int4-r16"],
)
def test_a_second_turn_on_smollm2_continues_the_first(bundled, name, config):
    """On a real model, a quantized cache's second turn gives the logits of the cache that wrote the prefix,
    continued (not a fresh run's: a fresh prefill reads the prompt's own keys and values exact, and reused codes of
    quantized keys were up to 0.7 off a fresh run at 80 tokens)."""
    from tests.test_prefix_quantized import continued

    model, _ = bundled
    torch.manual_seed(0)
    first = torch.randint(100, 40000, (1, 60))
    second = torch.cat([first, torch.randint(100, 40000, (1, 20))], dim=1)  # [1, 80]
    pool = KVPool.for_model(model, REGISTRY[name].config(config), max_tokens=512, prefix_caching=True)
    greedy(model, first, name, {**config, "pool": pool}, max_new_tokens=2).cache.release()
    boundary = 60 // pool.pages.format.page_size * pool.pages.format.page_size
    reference = continued(model, first[:, :boundary], second, name, config, max_new_tokens=2)
    candidate, reused = reused_by(pool, model, second, name, config, max_new_tokens=2)
    assert reused == boundary  # see docs/prefix-caching.md
    for expected, actual in zip(reference.logits, candidate.logits, strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=2e-4)
    assert torch.equal(reference.sequences, candidate.sequences)
