"""Prompt reuse across ``generate`` calls through a pool's prefix index (``hf_kvcache.caches.prefix``): each cache
and model kind, batches, the cache_config key, eviction under pressure, refusals, and threads sharing a pool.

A prefill split in two (the reused prefix, then the rest) sums attention in another order than one prefill, so
logits are compared within ``TOLERANCE`` (fp32; the differences measured here are below 1e-6) and greedy tokens must
be equal."""

import logging

import pytest
import torch

from hf_kvcache import KVPool
from hf_kvcache.caches import prefix as prefix_module
from hf_kvcache.integration.registry import REGISTRY
from tests.helpers import random_ids, run_threads

TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
PAGE_SIZE = 4
CONFIGS = {
    "paged_pool": {},
    "quantized_values": {"bits": 4, "group_size": 16, "residual_length": 8},
    # keys are encoded a page at a time: the reference's own pool takes the pages of the prefix pool (PAGE_SIZE)
    "quantized_kv": {"key_bits": 4, "value_bits": 4, "group_size": 16, "residual_length": 8, "page_size": PAGE_SIZE},
    "sliding_ring": {"window": 16, "sink_tokens": 2},  # sinks in part of a page: the page is kept whole
}


def prefix_pool(model, name: str, max_tokens: int = 2048, cache_config: dict | None = None) -> KVPool:
    settings = {**(REGISTRY[name].example_config if cache_config is None else cache_config), "page_size": PAGE_SIZE}
    return KVPool.for_model(model, REGISTRY[name].config(settings), max_tokens=max_tokens, prefix_caching=True)


def greedy(model, ids, name: str, cache_config: dict, max_new_tokens: int = 6, **kwargs):
    return model.generate(
        ids,
        cache_implementation=name,
        cache_config=cache_config,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )


def assert_same_tokens_close_logits(reference, candidate):
    assert torch.equal(reference.sequences, candidate.sequences)
    for step, (expected, actual) in enumerate(zip(reference.logits, candidate.logits, strict=True)):
        torch.testing.assert_close(actual, expected, **TOLERANCE, msg=f"logits differ at step {step}")


@pytest.fixture
def models(tiny_llama_model, tiny_mistral_model, tiny_gemma3_model):
    return {"llama": tiny_llama_model, "mistral": tiny_mistral_model, "gemma3": tiny_gemma3_model}


@pytest.fixture
def banded(models):
    """The tiny models under attn_implementation="hf_kvcache" (exact windows inside a step), put back after."""
    before = {key: model.config._attn_implementation for key, model in models.items()}
    for model in models.values():
        model.set_attn_implementation("hf_kvcache")
    yield models
    for key, model in models.items():
        model.set_attn_implementation(before[key])


@pytest.mark.parametrize("model_key", ["llama", "mistral", "gemma3"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_second_turn_reuses_the_first_and_generates_the_same(banded, model_key, name):
    """Turn 2's prompt is turn 1's prompt, its answer and a new message: every full page of turn 1 that the prefix
    may reuse comes from the index, and the generation equals a plain one."""
    model, config = banded[model_key], CONFIGS[name]
    pool = prefix_pool(model, name)
    first = random_ids(2, 45, seed=1)
    answer = greedy(model, first, name, {**config, "pool": pool}).sequences
    pool.check_integrity()
    assert pool.stats()["pages_cached"] > 0  # the released cache left its pages to the index
    second = torch.cat([answer, random_ids(2, 7, seed=2)], dim=1)  # [2, 58]
    if name in ("quantized_values", "quantized_kv"):  # codes reuse as the first turn's cache continued, at 48 tokens
        from tests.test_prefix_quantized import continued

        reference = continued(model, first, second, name, config, decode_steps=3)
    else:
        reference = greedy(model, second, name, config)
    candidate = greedy(model, second, name, {**config, "pool": pool})
    assert_same_tokens_close_logits(reference, candidate)
    pool.check_integrity()
    stats = pool.stats()
    # turn 1's prompt and the generated tokens fed back: 45 + 5, whole pages
    assert stats["prefix_tokens_reused"] == 2 * ((45 + 5) // PAGE_SIZE * PAGE_SIZE)
    assert (stats["prefix_lookups"], stats["prefix_hits"]) == (4, 2)  # both rows of both turns
    del candidate
    pool.check_integrity()


def test_same_prompt_reuses_all_but_the_last_page(tiny_llama_model):
    pool = prefix_pool(tiny_llama_model, "paged_pool")
    ids = random_ids(1, 40)
    reference = greedy(tiny_llama_model, ids, "paged_pool", {"pool": pool})
    candidate = greedy(tiny_llama_model, ids, "paged_pool", {"pool": pool})
    assert_same_tokens_close_logits(reference, candidate)
    assert pool.stats()["prefix_tokens_reused"] == 36  # at most 39 (the last prompt token is fed), page-aligned
    assert candidate.cache.get_seq_length() == 40 + 5


def test_a_batch_reuses_the_longest_prefix_every_row_has_and_padded_rows_miss(tiny_llama_model):
    pool = prefix_pool(tiny_llama_model, "paged_pool")
    shared = random_ids(1, 24, seed=3)
    greedy(tiny_llama_model, torch.cat([shared, random_ids(1, 16, seed=4)], dim=1), "paged_pool", {"pool": pool})
    greedy(tiny_llama_model, shared[:, :12], "paged_pool", {"pool": pool}, max_new_tokens=1)
    batch = torch.cat([shared.repeat(2, 1), random_ids(2, 9, seed=5)], dim=1)  # [2, 33]: the rows agree up to 24
    stats = pool.stats()
    candidate = greedy(tiny_llama_model, batch, "paged_pool", {"pool": pool})
    assert_same_tokens_close_logits(greedy(tiny_llama_model, batch, "paged_pool", {}), candidate)
    reused = pool.stats()["prefix_tokens_reused"] - stats["prefix_tokens_reused"]
    assert reused == 2 * 24
    mask = torch.ones_like(batch)
    mask[1, :3] = 0  # a left-padded row: its positions are not its token indices
    before = pool.stats()["prefix_tokens_reused"]
    padded = greedy(tiny_llama_model, batch, "paged_pool", {"pool": pool}, attention_mask=mask)
    reference = greedy(tiny_llama_model, batch, "paged_pool", {}, attention_mask=mask)
    assert_same_tokens_close_logits(reference, padded)
    assert pool.stats()["prefix_tokens_reused"] == before  # one row misses: the batch starts from 0
    pool.check_integrity()


def test_cache_config_turns_it_on_for_the_pools_a_cache_makes(tiny_llama_model):
    ids = random_ids(1, 20)
    out = greedy(tiny_llama_model, ids, "paged_pool", {"max_tokens": 256, "prefix_caching": True})
    assert out.cache.prefix is not None and out.cache.prefix.pool.prefix_caching
    out = greedy(tiny_llama_model, ids, "paged_pool", {"max_tokens": 256})
    assert out.cache.prefix is None
    plain = KVPool.for_model(tiny_llama_model, max_tokens=256)
    with pytest.raises(ValueError, match="prefix_caching=True"):
        greedy(tiny_llama_model, ids, "paged_pool", {"pool": plain, "prefix_caching": True})
    indexed = prefix_pool(tiny_llama_model, "paged_pool")
    greedy(tiny_llama_model, ids, "paged_pool", {"pool": indexed, "prefix_caching": False})
    assert indexed.stats()["prefix_lookups"] == 0 and indexed.stats()["pages_cached"] == 0
    with pytest.raises(TypeError, match="prefix_caching"):
        greedy(tiny_llama_model, ids, "paged_pool", {"prefix_caching": "yes"})


def test_cached_pages_make_room_for_new_prompts(tiny_llama_model):
    """A small pool full of cached pages still serves every new prompt: the least recently used pages go first."""
    pool = prefix_pool(tiny_llama_model, "paged_pool", max_tokens=64)  # 16 pages
    prompts = [random_ids(1, 36, seed=seed) for seed in range(4)]
    for ids in prompts:  # 10 pages each: later prompts evict earlier ones' cached pages
        greedy(tiny_llama_model, ids, "paged_pool", {"pool": pool}, max_new_tokens=2)
        pool.check_integrity()
        assert pool.pages.num_available_pages == pool.stats()["pages_free"] + pool.stats()["pages_cached"]
    assert pool.stats()["pages_cached"] > 0
    before = pool.stats()["prefix_tokens_reused"]
    greedy(tiny_llama_model, prompts[-1], "paged_pool", {"pool": pool}, max_new_tokens=2)
    assert pool.stats()["prefix_tokens_reused"] - before == 32  # the newest prompt is still cached
    before = pool.stats()["prefix_tokens_reused"]
    greedy(tiny_llama_model, prompts[0], "paged_pool", {"pool": pool}, max_new_tokens=2)
    assert pool.stats()["prefix_tokens_reused"] == before  # the oldest was evicted
    pool.check_integrity()


def test_live_pages_are_never_evicted(tiny_llama_model):
    pool = prefix_pool(tiny_llama_model, "paged_pool", max_tokens=64)
    ids = random_ids(1, 30)
    held = greedy(tiny_llama_model, ids, "paged_pool", {"pool": pool}, max_new_tokens=2)  # its cache stays alive
    greedy(tiny_llama_model, random_ids(1, 20, seed=9), "paged_pool", {"pool": pool}, max_new_tokens=2)
    pool.check_integrity()
    again = greedy(tiny_llama_model, ids, "paged_pool", {"pool": pool}, max_new_tokens=2)
    assert torch.equal(again.sequences, held.sequences)


def test_other_models_and_windows_never_share_pages(tiny_llama_model):
    pool = prefix_pool(tiny_llama_model, "sliding_ring")
    ids = random_ids(1, 40)
    greedy(tiny_llama_model, ids, "paged_pool", {"pool": pool})
    other = type(tiny_llama_model)(tiny_llama_model.config).eval()  # same name and shapes, other weights
    reference = greedy(other, ids, "paged_pool", {})
    assert_same_tokens_close_logits(reference, greedy(other, ids, "paged_pool", {"pool": pool}))
    assert pool.stats()["prefix_hits"] == 0
    tiny_llama_model.set_attn_implementation("hf_kvcache")
    try:
        greedy(tiny_llama_model, ids, "sliding_ring", {"pool": pool, "window": 16, "sink_tokens": 0})
    finally:
        tiny_llama_model.set_attn_implementation("sdpa")
    assert pool.stats()["prefix_hits"] == 0  # a ring's pages are keyed apart from full pages
    greedy(tiny_llama_model, ids, "paged_pool", {"pool": pool})
    assert pool.stats()["prefix_hits"] == 1


@pytest.mark.parametrize(
    "config,attention,reason",
    [
        ({"window": 16, "sink_tokens": 4}, "sdpa", "load the model with attn_implementation"),
    ],
)
def test_rings_that_cannot_be_exact_are_refused_once_with_a_reason(
    tiny_llama_model, caplog, monkeypatch, config, attention, reason
):
    monkeypatch.setattr(prefix_module, "_logged", set())
    tiny_llama_model.set_attn_implementation(attention)
    pool = prefix_pool(tiny_llama_model, "sliding_ring")
    ids = random_ids(1, 40)
    try:
        with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
            for _ in range(2):
                out = greedy(tiny_llama_model, ids, "sliding_ring", {**config, "pool": pool})
    finally:
        tiny_llama_model.set_attn_implementation("sdpa")
    refusals = [record for record in caplog.records if "Prefix caching is off" in record.message]
    assert len(refusals) == 1 and reason in refusals[0].message
    assert pool.stats()["prefix_hits"] == 0 and out.sequences.shape == (1, 46)
    pool.check_integrity()


def test_inputs_embeds_are_refused(tiny_llama_model, monkeypatch):
    monkeypatch.setattr(prefix_module, "_logged", set())
    pool = prefix_pool(tiny_llama_model, "paged_pool")
    ids = random_ids(1, 20)
    embeds = tiny_llama_model.get_input_embeddings()(ids)
    for _ in range(2):
        tiny_llama_model.generate(
            inputs_embeds=embeds,
            cache_implementation="paged_pool",
            cache_config={"pool": pool},
            max_new_tokens=3,
            do_sample=False,
        )
    assert pool.stats()["prefix_hits"] == 0 and any("inputs_embeds" in reason for reason in prefix_module._logged)
    pool.check_integrity()


def test_threads_find_each_others_pages_and_race_on_one_prefix(tiny_llama_model):
    pool = prefix_pool(tiny_llama_model, "paged_pool", max_tokens=1024)
    shared = random_ids(1, 32, seed=7)
    prompts = [torch.cat([shared, random_ids(1, 6, seed=10 + i)], dim=1) for i in range(4)]
    expected = [greedy(tiny_llama_model, ids, "paged_pool", {}).sequences for ids in prompts]
    results = {}

    def work(i: int) -> None:  # all four compute the same prefix at once: each publishes, the first copy wins
        for _ in range(2):
            results[i] = greedy(tiny_llama_model, prompts[i], "paged_pool", {"pool": pool}).sequences
            pool.check_integrity()

    assert run_threads(work, 4) == {}
    assert all(torch.equal(results[i], expected[i]) for i in range(4))
    stats = pool.stats()
    assert stats["prefix_lookups"] == 8 and stats["prefix_hits"] >= 4  # every second round reuses at least
    assert stats["prefix_tokens_reused"] >= 4 * 32
    # every cache is gone: what stays is what was published, one copy of the shared prefix's 8 pages and each
    # thread's own 2 (38 prompt tokens and 5 fed back: 10 full pages)
    assert stats["pages_cached"] == stats["pages_used"] == 8 + 4 * 2
    pool.check_integrity()


@pytest.mark.parametrize("case", ["one_page_prompt", "left_padded_batch"])
def test_beams_on_a_prefix_caching_pool_equal_dynamic_cache(tiny_llama_model, case):
    # Beam search reorders the rows right after the prefill, also when the prompt held no full page to look up
    # (a prompt of at most one page) or a row was padded: the lookup never built those rows' chain keys.
    model = tiny_llama_model
    if case == "one_page_prompt":
        ids, mask = random_ids(2, PAGE_SIZE, seed=3), None
    else:
        ids = random_ids(2, 3 * PAGE_SIZE + 1, seed=4)
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
    kwargs = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 6, "do_sample": False}
    if mask is not None:
        kwargs["attention_mask"] = mask
    expected = model.generate(ids, **kwargs)
    pool = prefix_pool(model, "paged_pool")
    for _ in range(2):  # the second call finds what the first published
        out = model.generate(ids, cache_implementation="paged_pool", cache_config={"pool": pool}, **kwargs)
        assert torch.equal(out, expected)
    pool.check_integrity()
    stats = pool.stats()
    assert stats["live_tables"] == 0 and stats["pages_used"] == stats["pages_cached"]  # only published pages stay
