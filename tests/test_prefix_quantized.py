"""Quantized caches reuse prompts with the semantics of continuing a cache (``hf_kvcache.caches.prefix``).

The reference is not a fresh prefill but the same cache passed on: one cache is given the reused prefix (a prefill),
then the later prompt is fed on that cache object. A prefix of whole pages reused from the index must give that
call the same tokens and, to float rounding, the same logits: the pages hold every token as codes, and what the
rows held beside them in full precision (the residual window's newest values, the exact sink's first tokens: an
``ExactTail``) comes with them. Each case is checked against a fresh prefill too, which gives other logits: the
comparison could not pass by recomputing."""

import pytest
import torch

from hf_kvcache.integration.seams import build_cache
from hf_kvcache.testing import tiny_gemma3
from tests.helpers import random_ids, run_threads
from tests.test_prefix_caching import PAGE_SIZE, assert_same_tokens_close_logits, greedy, prefix_pool
from tests.test_prefix_store import server  # noqa: F401  (a fixture: a redis-server of the test's own)
from tests.test_prefix_tiers import tiered_pool

# Residual windows of 10 tokens: not a multiple of the 4-token pages, and longer than what each test feeds after the
# reused prefix (a step of as many tokens as the window or more holds its own tokens only there).
CONFIGS = {
    "values": ("quantized_values", {"bits": 4, "group_size": 16, "residual_length": 10}),
    "kv": ("quantized_kv", {"key_bits": 4, "value_bits": 4, "group_size": 16, "residual_length": 10, "sink_tokens": 3}),
    "kv-k8": ("quantized_kv", {"key_bits": 8, "value_bits": 4, "group_size": 16, "residual_length": 10}),
    "values-r0": ("quantized_values", {"bits": 4, "group_size": 16, "residual_length": 0}),
    "kv-r0": ("quantized_kv", {"key_bits": 4, "value_bits": 4, "group_size": 16, "residual_length": 0}),
}
KEYS = sorted(CONFIGS)


def settings(key: str) -> tuple[str, dict]:
    name, config = CONFIGS[key]
    return name, {**config, "page_size": PAGE_SIZE}


def continued(model, prefix, prompt, name: str, config: dict, max_new_tokens: int = 6, decode_steps: int = 0):
    """The reference: a cache (on a pool of its own) given ``prefix`` by a prefill and ``decode_steps`` greedy steps,
    then ``prompt`` (which starts with what it holds) generated on that same cache object."""
    cache = build_cache(name, model, config)
    held = model.generate(prefix, cache=cache, do_sample=False, max_new_tokens=1 + decode_steps)
    assert cache.get_seq_length() == prefix.shape[1] + decode_steps
    assert torch.equal(held[:, : cache.get_seq_length()], prompt[:, : cache.get_seq_length()])
    return model.generate(
        prompt,
        cache=cache,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        return_dict_in_generate=True,
        output_logits=True,
    )


def reused_by(pool, model, ids, name: str, config: dict, **kwargs):
    """Generates on ``pool``; returns the output and the prompt tokens that call reused."""
    before = pool.stats()["prefix_tokens_reused"]
    out = greedy(model, ids, name, {**config, "pool": pool}, **kwargs)
    return out, pool.stats()["prefix_tokens_reused"] - before


def fill(model, pool, seeds, name: str, config: dict) -> None:
    """Generates a 36-token prompt per seed on ``pool`` (a 64-token one): later prompts evict earlier ones."""
    for seed in seeds:
        greedy(model, random_ids(1, 36, seed=seed), name, {**config, "pool": pool}, max_new_tokens=2).cache.release()


def same(reference, candidate) -> bool:
    try:
        assert_same_tokens_close_logits(reference, candidate)
    except AssertionError:
        return False
    return True


def assert_not_fresh(model, ids, name: str, config: dict, candidate) -> None:
    """A fresh prefill's logits differ from the candidate's: the candidate continued what it reused."""
    fresh = greedy(model, ids, name, config)
    assert max((a - b).abs().max().item() for a, b in zip(fresh.logits, candidate.logits)) > 1e-3


@pytest.mark.parametrize("key", KEYS)
def test_a_reused_prompt_continues_as_the_cache_that_wrote_it(tiny_llama_model, key):
    model = tiny_llama_model
    name, config = settings(key)
    pool = prefix_pool(model, name, cache_config=config)
    first = random_ids(1, 24, seed=1)  # 6 whole pages
    second = torch.cat([first, random_ids(1, 7, seed=2)], dim=1)  # [1, 31]
    greedy(model, first, name, {**config, "pool": pool}, max_new_tokens=1).cache.release()
    reference = continued(model, first, second, name, config)
    candidate, reused = reused_by(pool, model, second, name, config)
    assert reused == 24
    assert_same_tokens_close_logits(reference, candidate)
    assert_not_fresh(model, second, name, config, candidate)
    pool.check_integrity()


@pytest.mark.parametrize("key", ["values", "kv"])
def test_a_second_turn_continues_where_the_first_turn_ended(tiny_llama_model, key):
    """A cache letting its rows go keeps the tail at the last page boundary it wrote, in the answer: the next turn
    reuses the prompt and the answer's whole pages, as if the first turn's cache (when it held them) were passed on."""
    model = tiny_llama_model
    name, config = settings(key)
    pool = prefix_pool(model, name, cache_config=config)
    first = random_ids(1, 22, seed=17)
    answer = greedy(model, first, name, {**config, "pool": pool}, max_new_tokens=8)  # writes 29 tokens
    answer.cache.release()
    second = torch.cat([answer.sequences, random_ids(1, 5, seed=18)], dim=1)  # [1, 35]
    candidate, reused = reused_by(pool, model, second, name, config)
    assert reused == 28
    assert_same_tokens_close_logits(continued(model, first, second, name, config, decode_steps=6), candidate)
    assert_not_fresh(model, second, name, config, candidate)
    pool.check_integrity()


@pytest.mark.parametrize("key", ["values", "kv"])
def test_a_prompt_reused_while_the_first_request_still_holds_its_pages(tiny_llama_model, key):
    """The first request keeps generating on the shared pages (copy-on-write) while a second one reuses them."""
    model = tiny_llama_model
    name, config = settings(key)
    pool = prefix_pool(model, name, cache_config=config)
    first = random_ids(1, 24, seed=3)
    second = torch.cat([first, random_ids(1, 5, seed=4)], dim=1)
    running = greedy(model, first, name, {**config, "pool": pool}, max_new_tokens=3)  # its cache is held
    candidate, reused = reused_by(pool, model, second, name, config)
    assert reused == 24
    assert_same_tokens_close_logits(continued(model, first, second, name, config), candidate)
    more = torch.cat([running.sequences, random_ids(1, 2, seed=5)], dim=1)
    after = model.generate(more, cache=running.cache, do_sample=False, max_new_tokens=3)
    reference = continued(model, first, more, name, config, max_new_tokens=3)
    assert torch.equal(after, reference.sequences)  # the first request went on undisturbed
    running.cache.release()
    pool.check_integrity()


@pytest.mark.parametrize("key", ["values", "kv"])
def test_no_tail_is_kept_inside_a_pass_that_continues_a_prefix(tiny_llama_model, key):
    """A pass from a reused prefix reads it through the residual window as it stands at the pass's end: a boundary
    inside the pass is no state the cache had, so the same prompt asked again reuses the earlier prefix only."""
    model = tiny_llama_model
    name, config = settings(key)
    pool = prefix_pool(model, name, cache_config=config)
    first = random_ids(1, 24, seed=25)
    second = torch.cat([first, random_ids(1, 9, seed=26)], dim=1)  # [1, 33]: its whole pages end inside its pass
    greedy(model, first, name, {**config, "pool": pool}, max_new_tokens=1).cache.release()
    assert reused_by(pool, model, second, name, config, max_new_tokens=1)[1] == 24
    candidate, reused = reused_by(pool, model, second, name, config)
    assert reused == 24
    assert_same_tokens_close_logits(continued(model, first, second, name, config), candidate)


@pytest.mark.parametrize("key", ["values", "kv"])
def test_a_batch_reuses_each_rows_prefix_with_its_own_tail(tiny_llama_model, key):
    model = tiny_llama_model
    name, config = settings(key)
    pool = prefix_pool(model, name, cache_config=config)
    first = random_ids(2, 20, seed=6)
    second = torch.cat([first, random_ids(2, 7, seed=7)], dim=1)
    greedy(model, first, name, {**config, "pool": pool}, max_new_tokens=1).cache.release()
    candidate, reused = reused_by(pool, model, second, name, config)
    assert reused == 2 * 20
    assert_same_tokens_close_logits(continued(model, first, second, name, config), candidate)
    assert_not_fresh(model, second, name, config, candidate)
    pool.check_integrity()


@pytest.mark.parametrize("key", ["values", "kv"])
def test_prompts_sharing_a_head_reuse_it_from_where_they_part(tiny_llama_model, key):
    """The first prompt keeps its tail where it ends; the second parts from it inside: it finds the pages but no
    tail there, recomputes and keeps one where they part; the third reuses that."""
    model = tiny_llama_model
    name, config = settings(key)
    pool = prefix_pool(model, name, cache_config=config)
    head = random_ids(1, 22, seed=8)  # 5 whole pages
    prompts = [torch.cat([head, random_ids(1, 6, seed=seed)], dim=1) for seed in (9, 10, 11)]
    reused = [reused_by(pool, model, prompt, name, config)[1] for prompt in prompts[:2]]
    assert reused == [0, 0]  # no tail at token 20 yet
    candidate, reused = reused_by(pool, model, prompts[2], name, config)
    assert reused == 20
    assert_same_tokens_close_logits(continued(model, head[:, :20], prompts[2], name, config), candidate)
    pool.check_integrity()


def test_a_hybrid_model_with_sliding_layers_continues_its_windows(banded_gemma3):
    model = banded_gemma3
    name, config = settings("values")
    pool = prefix_pool(model, name, cache_config=config)
    first = random_ids(2, 24, seed=12)
    second = torch.cat([first, random_ids(2, 7, seed=13)], dim=1)
    greedy(model, first, name, {**config, "pool": pool}, max_new_tokens=1).cache.release()
    candidate, reused = reused_by(pool, model, second, name, config)
    assert reused == 2 * 24
    assert_same_tokens_close_logits(continued(model, first, second, name, config), candidate)
    pool.check_integrity()


@pytest.mark.parametrize("key", ["values", "kv"])
def test_threads_racing_on_one_prefix_each_continue_their_own(tiny_llama_model, key):
    """Four threads prefill prompts with one head at once (the first copy of each shared page wins; a thread that
    finds the head's pages without a tail keeps one there, which a later thread may reuse), then ask again. A first
    call from token 0 keeps a tail where its prompt's whole pages end, and the second reuses them all; one that
    reused the head keeps none inside its pass, and the second reuses the head again."""
    model = tiny_llama_model
    name, config = settings(key)
    pool = prefix_pool(model, name, cache_config=config, max_tokens=1024)
    head = random_ids(1, 32, seed=19)
    prompts = [torch.cat([head, random_ids(1, 6, seed=20 + i)], dim=1) for i in range(4)]  # [1, 38]: 9 whole pages
    results = {}

    def work(i: int) -> None:
        results[i] = [greedy(model, prompts[i], name, {**config, "pool": pool}) for _ in range(2)]
        pool.check_integrity()

    assert run_threads(work, 4) == {}
    reused = 0
    for i, prompt in enumerate(prompts):
        if same(greedy(model, prompt, name, config), results[i][0]):
            assert_same_tokens_close_logits(continued(model, prompt[:, :36], prompt, name, config), results[i][1])
            reused += 36
        else:  # it reused the head, from another thread's tail
            for out in results[i]:
                assert_same_tokens_close_logits(continued(model, head, prompt, name, config), out)
            reused += 2 * 32
    assert pool.stats()["prefix_tokens_reused"] == reused
    pool.check_integrity()


@pytest.mark.parametrize("key", ["values", "kv"])
def test_compiled_decoding_continues_a_reused_prefix_as_eager_does(tiny_llama_model, compile_config, key):
    """Planned decode steps read the restored residual window and sink as eager steps do."""
    model = tiny_llama_model
    name, config = settings(key)
    pool = prefix_pool(model, name, cache_config=config)
    first = random_ids(1, 24, seed=21)
    second = torch.cat([first, random_ids(1, 7, seed=22)], dim=1)
    greedy(model, first, name, {**config, "pool": pool}, max_new_tokens=1).cache.release()
    before = pool.stats()["prefix_tokens_reused"]
    compiled = greedy(model, second, name, {**config, "pool": pool}, max_new_tokens=8, compile_config=compile_config)
    assert pool.stats()["prefix_tokens_reused"] - before == 24
    reference = continued(model, first, second, name, config, max_new_tokens=8)
    assert torch.equal(compiled.sequences, reference.sequences)


@pytest.fixture
def banded_gemma3():
    model = tiny_gemma3()
    model.set_attn_implementation("hf_kvcache")
    return model


def test_a_tail_lives_as_long_as_its_page(tiny_llama_model):
    """Evicting the page at a prefix's end drops its tail: the prompt is then reused up to the next tail kept."""
    model = tiny_llama_model
    name, config = settings("values")
    pool = prefix_pool(model, name, cache_config=config, max_tokens=120)
    first = random_ids(1, 24, seed=14)
    greedy(model, first, name, {**config, "pool": pool}, max_new_tokens=1).cache.release()  # tails at 20 and 24
    other = random_ids(1, (pool.stats()["pages_free"] + 1) * PAGE_SIZE - 1, seed=15)  # evicts first's last page
    greedy(model, other, name, {**config, "pool": pool}, max_new_tokens=1).cache.release()
    pool.check_integrity()  # every tail kept lies beside a published page
    second = torch.cat([first, random_ids(1, 5, seed=16)], dim=1)
    candidate, reused = reused_by(pool, model, second, name, config)
    assert reused == 20
    assert_same_tokens_close_logits(continued(model, first[:, :20], second, name, config), candidate)


def test_stats_count_the_tails_kept_beside_published_pages(tiny_llama_model):
    """``prefix_tails`` / ``prefix_tail_bytes``: a residual window's values per tail, gone with their pages."""
    model = tiny_llama_model
    name, config = settings("values")
    pool = prefix_pool(model, name, cache_config=config, max_tokens=120)
    assert (pool.stats()["prefix_tails"], pool.stats()["prefix_tail_bytes"]) == (0, 0)
    first = random_ids(1, 24, seed=14)
    greedy(model, first, name, {**config, "pool": pool}, max_new_tokens=1).cache.release()  # tails at 20 and 24
    text = model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_tail = text.num_hidden_layers * text.num_key_value_heads * 10 * head_dim * model.dtype.itemsize  # 10 values
    assert (pool.stats()["prefix_tails"], pool.stats()["prefix_tail_bytes"]) == (2, 2 * per_tail)
    other = random_ids(1, (pool.stats()["pages_free"] + 1) * PAGE_SIZE - 1, seed=15)  # evicts first's last page
    greedy(model, other, name, {**config, "pool": pool}, max_new_tokens=1).cache.release()
    kept = pool.stats()["prefix_tails"]
    assert kept >= 1 and pool.stats()["prefix_tail_bytes"] == kept * per_tail  # 24's went with its page; 20's stays
    pool.reset_prefix_index()
    assert (pool.stats()["prefix_tails"], pool.stats()["prefix_tail_bytes"]) == (0, 0)


@pytest.mark.parametrize("key", ["values", "kv", "values-r0"])
def test_a_prefix_evicted_to_host_memory_continues_the_cache(tiny_llama_model, key):
    """Pages the index evicts go to host memory; the tails went there when they were published: both come back."""
    model = tiny_llama_model
    name, config = settings(key)
    pool = tiered_pool(model, name=name, config=config, prefix_host_bytes=1 << 22)
    first = random_ids(1, 36, seed=0)
    fill(model, pool, range(4), name, config)
    second = torch.cat([first, random_ids(1, 5, seed=16)], dim=1)
    before = pool.stats()
    candidate, reused = reused_by(pool, model, second, name, config)
    assert reused == 36 and pool.stats()["prefix_hits_host"] - before["prefix_hits_host"] == 9
    assert_same_tokens_close_logits(continued(model, first, second, name, config), candidate)
    pool.check_integrity()


@pytest.mark.parametrize("tier", ["directory", "store"])
def test_a_second_worker_continues_a_prefix_from_the_directory_or_the_store(tiny_llama_model, tmp_path, tier, request):
    """A pool that never saw the prompt (another worker, or after a restart) finds its pages and tails in the
    directory or on a Redis server, and continues the cache that wrote them."""
    model = tiny_llama_model
    name, config = settings("kv")
    if tier == "store":
        tiers = {"prefix_store": request.getfixturevalue("server").url}
    else:
        tiers = {"prefix_disk_dir": str(tmp_path), "prefix_disk_bytes": 1 << 24}
    first = random_ids(1, 24, seed=23)
    second = torch.cat([first, random_ids(1, 7, seed=24)], dim=1)
    writer = tiered_pool(model, 256 if tier == "store" else 64, name, config, **tiers)
    greedy(model, first, name, {**config, "pool": writer}, max_new_tokens=1).cache.release()
    if tier == "directory":  # pages reach the directory when the pool evicts them
        fill(model, writer, range(2), name, config)
    assert writer.pages.flush_tiers()
    reader = tiered_pool(model, 256, name, config, **tiers)
    candidate, reused = reused_by(reader, model, second, name, config)
    assert reused == 24
    assert_same_tokens_close_logits(continued(model, first, second, name, config), candidate)
    reader.check_integrity()


def test_quantized_and_full_precision_pools_never_serve_each_others_pages(tiny_llama_model, tmp_path):
    """Pools of other page formats on one directory key their pages apart: none is served across."""
    model = tiny_llama_model
    name, config = settings("values-r0")
    tiers = {"prefix_disk_dir": str(tmp_path), "prefix_disk_bytes": 1 << 24}
    ids = random_ids(1, 36, seed=0)
    for first, second in (((name, config), ("paged_pool", {})), (("paged_pool", {}), (name, config))):
        for path in tmp_path.glob("*.page"):
            path.unlink()
        writer = tiered_pool(model, name=first[0], config=first[1], **tiers)
        fill(model, writer, range(4), *first)
        assert writer.pages.flush_tiers() and writer.stats()["prefix_disk_pages"] > 0
        reader = tiered_pool(model, name=second[0], config=second[1], **tiers)
        out, reused = reused_by(reader, model, ids, second[0], second[1])
        assert reused == 0 and reader.stats()["prefix_hits_disk"] == 0
        assert_same_tokens_close_logits(greedy(model, ids, second[0], second[1]), out)
        same = tiered_pool(model, name=first[0], config=first[1], **tiers)  # the writer's format finds them
        assert reused_by(same, model, ids, first[0], first[1])[1] == 32
