"""Prompt reuse on hybrid models (``hf_kvcache.caches.state_tails``): the attention layers' pages come from the
prefix index, the linear-attention and convolution layers' states from a ``StateTail`` kept beside the index entry
of the prefix's last page, at the page boundaries where a later call is likely to start (the prompt's last whole
page, where it parts from what the index held, the newest boundary the rows wrote before they were let go).

A state exists only where a forward pass ends, so a prompt's prefill runs as passes that end at those boundaries:
the chunked linear attention then sums in another order than one prefill, so logits are compared within
``TOLERANCE`` (fp32; measured below 1e-5) and greedy tokens must equal ``DynamicCache``'s and our cache's without
reuse. Tiny random-init Qwen3.5 (Gated DeltaNet: a convolution and a recurrent state per layer) and LFM2 (short
convolutions), each beside full attention."""

import logging

import pytest
import torch

from hf_kvcache import KVPool
from hf_kvcache.caches import prefix as prefix_module
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.memory.prefix_index import STATE_GROUP, PrefixIndex, tail_key
from hf_kvcache.testing import tiny_causal_lm, tiny_hybrid
from tests.helpers import padded_batch, random_ids, run_threads
from tests.test_fused_hybrid import ONE_GEOMETRY
from tests.test_prefix_caching import TOLERANCE, assert_same_tokens_close_logits
from tests.test_prefix_quantized import CONFIGS as QUANTIZED
from tests.test_prefix_quantized import assert_not_fresh, continued
from tests.test_prefix_store import server  # noqa: F401  (a fixture: a redis-server of the test's own)

PAGE_SIZE = 4
CONFIGS = {"paged_pool": {}, "sliding_ring": {"window": 16, "sink_tokens": 2}}
NAMES = sorted(CONFIGS)


def banded(model_type: str):
    """A tiny hybrid under attn_implementation="hf_kvcache" (a window imposed by ``sliding_ring`` is exact inside a
    step, as prompt reuse requires)."""
    model = tiny_hybrid(model_type)
    model.set_attn_implementation("hf_kvcache")
    return model


@pytest.fixture(scope="module", params=["qwen3_5_text", "lfm2"])
def hybrid(request):
    return banded(request.param)


@pytest.fixture(scope="module")
def qwen():
    return banded("qwen3_5_text")


def prefix_pool(model, name: str, max_tokens: int = 1024, **tiers) -> KVPool:
    settings = REGISTRY[name].config({**CONFIGS[name], "page_size": PAGE_SIZE})
    return KVPool.for_model(model, settings, max_tokens=max_tokens, prefix_caching=True, **tiers)


def generate(model, ids, name: str | None = None, pool: KVPool | None = None, max_new_tokens: int = 6, **kwargs):
    """Greedy generation with ``name`` on ``pool`` (``None``: a pool of the cache's own, no reuse; no name:
    ``DynamicCache``); records the tokens each forward pass feeds in ``out.fed`` (eager calls only: a compiled
    forward would trace the hook)."""
    fed = []
    hook = model.register_forward_pre_hook(
        lambda module, args, inputs: fed.append(inputs["input_ids"].shape[1]), with_kwargs=True
    )
    if "compile_config" in kwargs:
        hook.remove()
    cache = {} if name is None else {"cache_implementation": name, "cache_config": {**CONFIGS[name], "pool": pool}}
    if pool is None:
        cache.get("cache_config", {}).pop("pool", None)
    try:
        out = model.generate(
            ids,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            output_logits=True,
            **cache,
            **kwargs,
        )
    finally:
        hook.remove()
    out.fed = fed
    return out


def max_difference(reference, candidate) -> float:
    return max((a - b).abs().max().item() for a, b in zip(reference.logits, candidate.logits, strict=True))


def assert_fresh(model, ids, name: str, candidate, **kwargs) -> None:
    """The candidate gives our cache's tokens without reuse, and DynamicCache's where the cache keeps every token,
    with logits within ``TOLERANCE``."""
    references = [generate(model, ids, name, **kwargs)] + (
        [generate(model, ids, **kwargs)] if name == "paged_pool" else []
    )
    for reference in references:
        assert torch.equal(reference.sequences, candidate.sequences)
        for step, (expected, actual) in enumerate(zip(reference.logits, candidate.logits, strict=True)):
            torch.testing.assert_close(actual, expected, **TOLERANCE, msg=f"logits differ at step {step}")


def reused(pool: KVPool, before: dict) -> int:
    return pool.stats()["prefix_tokens_reused"] - before["prefix_tokens_reused"]


@pytest.mark.parametrize("name", NAMES)
def test_the_same_prompt_again_reuses_its_pages_and_states(hybrid, name):
    """The first call's prefill ends a pass at the prompt's last whole page and keeps the states there; the second
    call attaches the pages, restores the states and feeds the last token only."""
    pool = prefix_pool(hybrid, name)
    ids = random_ids(1, 22, seed=1)
    first = generate(hybrid, ids, name, pool)
    assert first.fed[:3] == [20, 2, 1]  # a pass ends at the last whole page short of the prompt's last token
    assert_fresh(hybrid, ids, name, first)
    stats = pool.stats()
    assert stats["prefix_tails"] >= 1 and stats["prefix_tail_bytes"] > 0
    second = generate(hybrid, ids, name, pool)
    assert reused(pool, stats) == 20 and pool.stats()["prefix_hits"] == 1
    assert second.fed[0] == 2
    assert_fresh(hybrid, ids, name, second)
    pool.check_integrity()


@pytest.mark.parametrize("name", NAMES)
def test_a_prompt_ending_on_a_page_keeps_its_states_without_a_decode_step(hybrid, name):
    """A prompt of whole pages generated with one new token (a document warmed for later questions) runs no pass
    after its prefill: its states are kept once the prefill's last pass has run, and a prompt extending it reuses
    every page of it."""
    pool = prefix_pool(hybrid, name)
    ids = random_ids(1, 30, seed=7)
    document = generate(hybrid, ids[:, :24], name, pool, max_new_tokens=1)
    assert document.fed == [20, 4]  # the last pass ends on the prompt's last page; no decode pass follows
    before = pool.stats()
    extended = generate(hybrid, ids, name, pool)
    assert reused(pool, before) == 24 and extended.fed[:2] == [4, 2]  # from the document's end, to its last page
    assert_fresh(hybrid, ids, name, extended)
    pool.check_integrity()


@pytest.mark.parametrize("name", NAMES)
def test_a_prompt_parting_mid_page_keeps_the_states_where_it_parts(hybrid, name):
    """A prompt that parts from the index inside a page finds pages but no states before it (the first prompt
    kept them at its own last page): nothing is reused, and a pass ends where it parts; the next prompt parting
    there reuses those pages and states."""
    pool = prefix_pool(hybrid, name)
    head = random_ids(1, 13, seed=2)
    generate(hybrid, torch.cat([head, random_ids(1, 17, seed=3)], dim=1), name, pool)
    second_ids = torch.cat([head, random_ids(1, 10, seed=4)], dim=1)  # [1, 23]: 3 whole pages shared
    before = pool.stats()
    second = generate(hybrid, second_ids, name, pool)
    assert reused(pool, before) == 0
    parted = second.fed[0]  # where the index's pages end (a window's: where it holds the pages the prefix needs)
    assert parted == 12 if name == "paged_pool" else 0 < parted <= 12
    assert second.fed[1:3] == [20 - parted, 3]  # to its own last whole page, then the rest
    assert_fresh(hybrid, second_ids, name, second)
    third_ids = torch.cat([head, random_ids(1, 9, seed=5)], dim=1)  # [1, 22]
    before = pool.stats()
    third = generate(hybrid, third_ids, name, pool)
    assert reused(pool, before) == parted
    assert sum(third.fed) == 22 - parted + 5  # the prompt's rest, then 5 decode steps
    assert third.fed[:2] == [8, 2] if name == "paged_pool" else (parted + third.fed[0]) % PAGE_SIZE == 0
    assert_fresh(hybrid, third_ids, name, third)
    pool.check_integrity()


@pytest.mark.parametrize("name", NAMES)
def test_a_next_turn_reuses_the_prompt_and_the_answer(hybrid, name):
    """The rows keep their states at the newest page boundary a decode step reaches; let go, they are published
    with the pages: turn 2 (turn 1's prompt, its answer, a new message) reuses all of it but the last page."""
    pool = prefix_pool(hybrid, name)
    first_ids = random_ids(1, 21, seed=6)
    answer = generate(hybrid, first_ids, name, pool).sequences  # writes 21 + 5 tokens: the newest boundary is 24
    second_ids = torch.cat([answer, random_ids(1, 5, seed=7)], dim=1)  # [1, 32]
    before = pool.stats()
    second = generate(hybrid, second_ids, name, pool)
    assert reused(pool, before) == 24
    assert second.fed[:2] == [4, 4]  # to the prompt's last whole page, then the rest
    assert_fresh(hybrid, second_ids, name, second)
    pool.check_integrity()


@pytest.mark.parametrize("name", NAMES)
def test_a_batch_restores_each_rows_own_states(hybrid, name):
    pool = prefix_pool(hybrid, name)
    ids = random_ids(2, 18, seed=8)  # two rows of other tokens
    generate(hybrid, ids, name, pool)
    before = pool.stats()
    second = generate(hybrid, ids, name, pool)
    assert reused(pool, before) == 2 * 16
    assert_fresh(hybrid, ids, name, second)
    swapped = ids.flip(0)  # each row finds the other's states under its own tokens
    before = pool.stats()
    assert_fresh(hybrid, swapped, name, generate(hybrid, swapped, name, pool))
    assert reused(pool, before) == 2 * 16
    pool.check_integrity()


def test_beams_and_returned_sequences_after_reuse(qwen):
    pool = prefix_pool(qwen, "paged_pool")
    ids = random_ids(1, 18, seed=9)
    generate(qwen, ids, "paged_pool", pool)
    for settings in ({"num_beams": 3, "num_return_sequences": 2}, {"num_beams": 2}):
        before = pool.stats()
        candidate = generate(qwen, ids, "paged_pool", pool, **settings)
        assert reused(pool, before) > 0
        assert torch.equal(candidate.sequences, generate(qwen, ids, **settings).sequences)
        pool.check_integrity()


def test_the_logits_differ_from_one_prefill_by_float_rounding_only(qwen):
    """A reusing call's logits against one plain prefill's (DynamicCache): the split prefill's rounding only."""
    pool = prefix_pool(qwen, "paged_pool")
    ids = random_ids(1, 70, seed=10)
    generate(qwen, ids, "paged_pool", pool)
    candidate = generate(qwen, ids, "paged_pool", pool)
    reference = generate(qwen, ids)
    assert torch.equal(reference.sequences, candidate.sequences)
    difference = max_difference(reference, candidate)
    print(f"max logit difference after reuse: {difference:.2e}")
    assert difference < 1e-5


def test_snapshots_are_counted_and_dropped_with_their_index_entry(qwen):
    pool = prefix_pool(qwen, "paged_pool", max_tokens=64)
    generate(qwen, random_ids(1, 22, seed=11), "paged_pool", pool)
    stats = pool.stats()
    assert stats["prefix_tails"] == 2  # the prompt's last whole page, the newest boundary decoding reached
    assert stats["prefix_tail_bytes"] > 0
    for seed in range(12, 16):  # evicts the first prompt's pages
        generate(qwen, random_ids(1, 22, seed=seed), "paged_pool", pool)
        pool.check_integrity()
    assert pool.stats()["prefix_tails"] <= 2 * 64 // 22
    pool.reset_prefix_index()
    assert pool.stats()["prefix_tails"] == 0 and pool.stats()["prefix_tail_bytes"] == 0
    pool.check_integrity()


def test_states_come_back_from_host_memory_after_eviction(qwen):
    pool = prefix_pool(qwen, "paged_pool", max_tokens=48, prefix_host_bytes=1 << 22)
    ids = random_ids(1, 22, seed=20)
    generate(qwen, ids, "paged_pool", pool)
    for seed in range(21, 25):
        generate(qwen, random_ids(1, 22, seed=seed), "paged_pool", pool)
    before = pool.stats()
    candidate = generate(qwen, ids, "paged_pool", pool)
    assert reused(pool, before) == 20 and pool.stats()["prefix_hits_host"] > before["prefix_hits_host"]
    assert_fresh(qwen, ids, "paged_pool", candidate)
    pool.check_integrity()


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_decoding_after_reuse(qwen, compile_config):
    pool = prefix_pool(qwen, "paged_pool")
    ids = random_ids(2, 18, seed=30)
    generate(qwen, ids, "paged_pool", pool)
    before = pool.stats()
    candidate = generate(qwen, ids, "paged_pool", pool, max_new_tokens=10, compile_config=compile_config)
    assert reused(pool, before) == 2 * 16
    assert torch.equal(candidate.sequences, generate(qwen, ids, max_new_tokens=10).sequences)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("model_type", ["falcon_h1", "zaya", "inkling_text"])
def test_layers_fusing_attention_with_a_state_space_block_reuse_alike(model_type):
    """Falcon-H1, Zaya and Inkling keep their states in the state half of our layer: the same prompt again and a
    next turn reuse pages and states, and give DynamicCache's generation."""
    model = tiny_causal_lm(model_type, **ONE_GEOMETRY.get(model_type, {}))
    pool = prefix_pool(model, "paged_pool")
    ids = random_ids(1, 22, seed=40, vocab=model.config.vocab_size)
    answer = generate(model, ids, "paged_pool", pool).sequences
    before = pool.stats()
    again = generate(model, ids, "paged_pool", pool)
    assert reused(pool, before) == 20 and again.fed[0] == 2
    assert_fresh(model, ids, "paged_pool", again)
    next_turn = torch.cat([answer, random_ids(1, 5, seed=41, vocab=model.config.vocab_size)], dim=1)
    before = pool.stats()
    assert_fresh(model, next_turn, "paged_pool", generate(model, next_turn, "paged_pool", pool))
    assert reused(pool, before) == 24
    pool.check_integrity()


def test_indexed_attention_still_refuses_with_its_reason(caplog, monkeypatch):
    """Indexed attention's indexer keys are not kept at page boundaries: the refusal and its logged reason stay."""
    monkeypatch.setattr(prefix_module, "_logged", set())
    model = tiny_causal_lm("deepseek_v32", index_topk=4)
    pool = prefix_pool(model, "paged_pool")
    ids = random_ids(1, 14, seed=42)
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        for _ in range(2):
            assert generate(model, ids, "paged_pool", pool, max_new_tokens=3).fed[0] == 14
    refusals = [record.message for record in caplog.records if "Prefix caching is off" in record.message]
    assert refusals == [
        "Prefix caching is off for this call: indexed-attention layers [0, 1] keep their indexer's keys beside the "
        "pool, which a cached prefix's pages do not hold: a cached prefix could not restore them, so prompts are "
        "neither reused nor published."
    ]
    assert pool.stats()["prefix_lookups"] == 0 and pool.stats()["prefix_tails"] == 0


@pytest.mark.parametrize("key", ["values", "kv"])
def test_quantized_caches_reuse_as_a_continuation(qwen, key):
    """The quantized caches reuse a hybrid's prompt as a continuation (tests/test_prefix_quantized.py): pages of
    codes, the residual window's and sink's ``ExactTail`` and the states' ``StateTail`` at one boundary give what
    the first call's cache, passed on at that boundary, gives."""
    name, config = QUANTIZED[key]
    settings = {**config, "page_size": PAGE_SIZE}
    pool = KVPool.for_model(qwen, REGISTRY[name].config(settings), max_tokens=1024, prefix_caching=True)
    ids = random_ids(1, 22, seed=50)
    options = {"cache_implementation": name, "cache_config": {**settings, "pool": pool}, "do_sample": False}
    qwen.generate(ids, max_new_tokens=6, **options)
    before = pool.stats()
    candidate = qwen.generate(ids, max_new_tokens=6, return_dict_in_generate=True, output_logits=True, **options)
    assert reused(pool, before) == 20
    assert_same_tokens_close_logits(continued(qwen, ids[:, :20], ids, name, settings), candidate)
    assert_not_fresh(qwen, ids, name, settings, candidate)
    pool.check_integrity()


def test_the_index_keeps_a_state_tail_beside_layer_group_zeros_page():
    """``STATE_GROUP``'s tails live as long as layer group 0's page of their token page, and travel under keys of
    their own (a layer group the tiers can write)."""
    index = PrefixIndex()
    chain = b"c" * 16
    assert not index.add_tail((chain, STATE_GROUP), "states")  # no page beside it
    index.add((chain, 0), 5)
    index.add((chain, 1), 6)
    assert index.add_tail((chain, STATE_GROUP), "states") and index.add_tail((chain, 0), "exact")
    assert index.tail((chain, STATE_GROUP)) == "states" and index.num_tails == 2
    state_key, exact_key = tail_key((chain, STATE_GROUP)), tail_key((chain, 0))
    assert state_key[1] >= 0 and state_key != exact_key
    index.mark_cached(6)
    index.mark_cached(5)
    assert index.evict_oldest() == 6 and index.num_tails == 2  # layer group 1's page: the tails stay
    assert index.evict_oldest() == 5 and index.num_tails == 0


@pytest.mark.parametrize("tier", ["directory", "store"])
def test_a_second_worker_finds_the_states_in_the_directory_or_the_store(qwen, tmp_path, tier, request):
    """A pool that never saw the prompt finds its pages and states in the directory or on a Redis server (their
    checked bytes)."""
    if tier == "store":
        tiers = {"prefix_store": request.getfixturevalue("server").url}
    else:
        tiers = {"prefix_disk_dir": str(tmp_path), "prefix_disk_bytes": 1 << 24}
    ids = random_ids(1, 22, seed=60)
    writer = prefix_pool(qwen, "paged_pool", max_tokens=48, **tiers)
    generate(qwen, ids, "paged_pool", writer)
    for seed in range(61, 64 if tier == "directory" else 61):  # pages reach the directory when the pool evicts them
        generate(qwen, random_ids(1, 22, seed=seed), "paged_pool", writer)
    assert writer.pages.flush_tiers()
    reader = prefix_pool(qwen, "paged_pool", **tiers)
    candidate = generate(qwen, ids, "paged_pool", reader)
    assert reader.stats()["prefix_tokens_reused"] == 20 and candidate.fed[0] == 2
    assert_fresh(qwen, ids, "paged_pool", candidate)
    reader.check_integrity()


def test_prompt_lookup_on_a_pool_with_states_gives_greedy_tokens(qwen):
    """Assisted decoding (prompt lookup) feeds the prompt itself (no lookup, as on any model) and records the states'
    past, where no state of one boundary is kept: it runs beside the states kept for other calls."""
    pool = prefix_pool(qwen, "paged_pool")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])  # repeats: candidates
    generate(qwen, ids, "paged_pool", pool)
    before = pool.stats()
    candidate = generate(qwen, ids, "paged_pool", pool, max_new_tokens=10, prompt_lookup_num_tokens=3)
    assert reused(pool, before) == 0 and pool.stats()["prefix_tails"] == before["prefix_tails"]
    assert torch.equal(candidate.sequences, generate(qwen, ids, max_new_tokens=10).sequences)
    pool.check_integrity()


def test_the_copies_a_cache_holds_count_in_its_state_bytes(qwen):
    """Until the rows are let go, the cache holds a copy of its states at the newest page boundary (a next turn's):
    ``memory_stats()``'s ``state_bytes`` counts it beside the states themselves."""
    ids = random_ids(1, 22, seed=70)
    alone = generate(qwen, ids, "paged_pool").cache.memory_stats()["state_bytes"]
    kept = generate(qwen, ids, "paged_pool", prefix_pool(qwen, "paged_pool")).cache.memory_stats()["state_bytes"]
    assert alone > 0 and kept == 2 * alone


def test_a_padded_batch_keeps_no_states_and_feeds_one_pass(qwen):
    """A padded row's states hold its padding: a padded batch keeps no states and its prefill is one pass."""
    pool = prefix_pool(qwen, "paged_pool")
    ids, mask = padded_batch([22, 15], seed=71)
    for _ in range(2):
        candidate = generate(qwen, ids, "paged_pool", pool, attention_mask=mask)
        assert candidate.fed[0] == 22
        assert torch.equal(candidate.sequences, generate(qwen, ids, attention_mask=mask).sequences)
    assert pool.stats()["prefix_tails"] == 0 and pool.stats()["prefix_tokens_reused"] == 0
    pool.check_integrity()


def test_threads_on_one_pool_each_restore_their_own_states(qwen):
    """Four threads generate prompts with one head at once, twice each: each second call restores the states its
    first kept (the first copy of a shared page wins; states are kept once per boundary), and every call gives the
    generation of a cache without reuse."""
    pool = prefix_pool(qwen, "paged_pool")
    head = random_ids(1, 16, seed=80)
    prompts = [torch.cat([head, random_ids(1, 6, seed=81 + i)], dim=1) for i in range(4)]  # [1, 22]
    results = {}
    options = {"cache_implementation": "paged_pool", "cache_config": {"pool": pool}, "do_sample": False}

    def work(i: int) -> None:
        results[i] = [qwen.generate(prompts[i], max_new_tokens=6, **options) for _ in range(2)]
        pool.check_integrity()

    assert run_threads(work, 4) == {}
    assert pool.stats()["prefix_tokens_reused"] >= 4 * 20
    for i, prompt in enumerate(prompts):
        expected = generate(qwen, prompt, "paged_pool").sequences
        assert all(torch.equal(expected, sequences) for sequences in results[i])
    pool.check_integrity()
