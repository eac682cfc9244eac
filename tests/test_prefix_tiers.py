"""The prefix index's tiers (``hf_kvcache.memory.tiers``): pages the pool evicts spill to host memory and a directory,
within their budgets, and a later lookup brings them back before the prefill, which then gives the tokens and
logits a fresh prefill gives; ``stats()`` counts hits per tier; a page's bytes are checked before they are served.

Reused prompts are compared with a fresh prefill within ``TOLERANCE`` (a prefill split in two sums attention in
another order: tests/test_prefix_caching.py)."""

import dataclasses
import os

import pytest
import torch

from hf_kvcache import KVPool, PagedConfig
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.page_bytes import CorruptPage, PageData, decode_page, encode_page, format_digest, store_key
from hf_kvcache.memory.tiers import TierSettings
from tests.helpers import random_ids

TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
PAGE_SIZE = 4
PROMPT = 36  # 9 pages; a lookup reuses 8 (the last token is fed)


def tiered_pool(model, max_tokens: int = 64, name: str = "paged_pool", config: dict | None = None, **tiers) -> KVPool:
    settings = {**(config or {}), "page_size": PAGE_SIZE}
    return KVPool.for_model(model, REGISTRY[name].config(settings), max_tokens=max_tokens, **tiers)


def greedy(model, ids, cache_config: dict, name: str = "paged_pool", max_new_tokens: int = 4):
    """``(sequences, logits)`` of a greedy generation; the cache is let go (its pages go back to the pool)."""
    out = model.generate(
        ids,
        cache_implementation=name,
        cache_config=cache_config,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences, out.logits


def fresh(model, ids, name: str = "paged_pool", config: dict | None = None):
    """The same generation on a pool without a prefix index: one plain prefill."""
    return greedy(model, ids, {**(config or {}), "pool": tiered_pool(model, 512, name, config)}, name)


def assert_same(reference, candidate):
    assert torch.equal(reference[0], candidate[0])
    for step, (expected, actual) in enumerate(zip(reference[1], candidate[1], strict=True)):
        torch.testing.assert_close(actual, expected, **TOLERANCE, msg=f"logits differ at step {step}")


def fill(model, pool, seeds, length: int = PROMPT) -> None:
    """Generates one prompt per seed on ``pool``: 10 pages each, so that later prompts evict earlier ones."""
    for seed in seeds:
        greedy(model, random_ids(1, length, seed=seed), {"pool": pool}, max_new_tokens=2)
        pool.check_integrity()


def test_pages_evicted_under_pressure_come_back_from_host_memory(tiny_llama_model):
    pool = tiered_pool(tiny_llama_model, prefix_host_bytes=1 << 20)
    fill(tiny_llama_model, pool, range(4))
    stats = pool.stats()
    assert stats["prefix_pages_spilled"] > 0 and stats["prefix_host_pages"] == stats["prefix_pages_spilled"]
    assert stats["prefix_host_bytes"] == stats["prefix_host_pages"] * stats["page_bytes"]
    ids = random_ids(1, PROMPT, seed=0)  # the oldest prompt: none of its pages is left in the pool
    before = pool.stats()
    candidate = greedy(tiny_llama_model, ids, {"pool": pool})
    after = pool.stats()
    assert_same(fresh(tiny_llama_model, ids), candidate)
    assert after["prefix_tokens_reused"] - before["prefix_tokens_reused"] == 32
    assert after["prefix_hits_host"] - before["prefix_hits_host"] == 8
    assert after["prefix_bytes_restored"] - before["prefix_bytes_restored"] == 8 * after["page_bytes"]
    assert after["prefix_hits_device"] == before["prefix_hits_device"]
    assert (
        after["prefix_host_pages"]
        < before["prefix_host_pages"] + after["prefix_pages_spilled"] - before["prefix_pages_spilled"]
    )  # the pages brought back left host memory
    pool.check_integrity()
    again = greedy(tiny_llama_model, ids, {"pool": pool})  # now from the pool itself
    assert_same(candidate, again)
    assert pool.stats()["prefix_hits_device"] - after["prefix_hits_device"] == 8


def test_without_a_host_tier_evicted_pages_are_recomputed(tiny_llama_model):
    """The control of the test above: the same pressure without tiers reuses nothing of the oldest prompt."""
    pool = tiered_pool(tiny_llama_model, prefix_caching=True)
    fill(tiny_llama_model, pool, range(4))
    before = pool.stats()["prefix_tokens_reused"]
    greedy(tiny_llama_model, random_ids(1, PROMPT, seed=0), {"pool": pool})
    assert pool.stats()["prefix_tokens_reused"] == before
    assert pool.stats()["prefix_pages_spilled"] == 0 and pool.stats()["prefix_hits_host"] == 0


def test_host_memory_stays_within_its_budget(tiny_llama_model):
    page_bytes = tiered_pool(tiny_llama_model).stats()["page_bytes"]
    pool = tiered_pool(tiny_llama_model, prefix_host_bytes=5 * page_bytes + page_bytes // 2)
    for seed in range(6):
        fill(tiny_llama_model, pool, [seed])
        stats = pool.stats()
        assert stats["prefix_host_bytes"] <= stats["prefix_host_max_bytes"]
        assert stats["prefix_host_pages"] <= 5
    assert pool.stats()["prefix_host_pages"] == 5 and pool.stats()["prefix_pages_spilled"] > 5
    too_small = tiered_pool(tiny_llama_model, prefix_host_bytes=page_bytes - 1)  # no page fits
    fill(tiny_llama_model, too_small, range(3))
    assert too_small.stats()["prefix_host_pages"] == 0 and too_small.stats()["prefix_pages_spilled"] > 0


def test_a_batch_and_a_hybrid_model_with_rings_reuse_pages_from_host_memory(tiny_gemma3_model):
    """Gemma 3's sliding layers are rings of their window (a layer group of their own): the lookup brings back the
    pages their layout wants as well as every page of the full layers."""
    model = tiny_gemma3_model
    model.set_attn_implementation("hf_kvcache")
    try:
        pool = tiered_pool(model, max_tokens=48, prefix_host_bytes=1 << 20)  # 48 pages: 12 tokens in each group
        shared = random_ids(1, 28, seed=11)
        batch = torch.cat([shared.repeat(2, 1), random_ids(2, 9, seed=12)], dim=1)  # [2, 37], two prompts
        greedy(model, batch, {"pool": pool})
        fill(model, pool, range(20, 24))
        before = pool.stats()
        candidate = greedy(model, batch, {"pool": pool})
        after = pool.stats()
        assert_same(fresh(model, batch), candidate)
        assert after["prefix_tokens_reused"] - before["prefix_tokens_reused"] == 2 * 36  # every row its own
        assert after["prefix_hits_host"] > before["prefix_hits_host"]
        pool.check_integrity()
    finally:
        model.set_attn_implementation("sdpa")


def test_pages_pushed_out_of_host_memory_go_to_a_directory_that_outlives_the_pool(tiny_llama_model, tmp_path):
    page_bytes = tiered_pool(tiny_llama_model).stats()["page_bytes"]
    disk_bytes = 40 * (page_bytes + 200)  # a page's file: its bytes and a header
    tiers = {"prefix_host_bytes": 2 * page_bytes, "prefix_disk_dir": str(tmp_path), "prefix_disk_bytes": disk_bytes}
    pool = tiered_pool(tiny_llama_model, **tiers)
    fill(tiny_llama_model, pool, range(4))
    assert pool.pages.flush_tiers()
    files = list(tmp_path.glob("*.page"))
    assert len(files) == pool.stats()["prefix_disk_pages"] > 0
    assert sum(f.stat().st_size for f in files) == pool.stats()["prefix_disk_bytes"] <= disk_bytes
    ids = random_ids(1, PROMPT, seed=0)
    reference = fresh(tiny_llama_model, ids)
    assert_same(reference, greedy(tiny_llama_model, ids, {"pool": pool}))
    assert pool.stats()["prefix_hits_disk"] == 8
    del pool
    restarted = tiered_pool(tiny_llama_model, **tiers)  # a new process would find the same files
    before = restarted.stats()
    assert before["prefix_disk_pages"] == len(list(tmp_path.glob("*.page")))
    assert_same(reference, greedy(tiny_llama_model, ids, {"pool": restarted}))
    assert restarted.stats()["prefix_hits_disk"] == 8


def test_the_directory_stays_within_its_budget(tiny_llama_model, tmp_path):
    page_bytes = tiered_pool(tiny_llama_model).stats()["page_bytes"]
    pool = tiered_pool(tiny_llama_model, prefix_disk_dir=str(tmp_path), prefix_disk_bytes=6 * page_bytes)
    fill(tiny_llama_model, pool, range(5))
    assert pool.pages.flush_tiers()
    stats = pool.stats()
    assert 0 < sum(f.stat().st_size for f in tmp_path.glob("*.page")) == stats["prefix_disk_bytes"] <= 6 * page_bytes
    assert stats["prefix_host_pages"] == 0  # no host memory asked: evicted pages go straight to the directory


def test_a_damaged_file_is_never_served(tiny_llama_model, tmp_path, caplog):
    pool = tiered_pool(tiny_llama_model, prefix_disk_dir=str(tmp_path), prefix_disk_bytes=1 << 22)
    fill(tiny_llama_model, pool, range(4))
    assert pool.pages.flush_tiers()
    for path in tmp_path.glob("*.page"):  # one flipped byte in the middle of every page's values
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    ids = random_ids(1, PROMPT, seed=0)
    with caplog.at_level("WARNING", logger="hf_kvcache"):
        candidate = greedy(tiny_llama_model, ids, {"pool": pool})
    assert_same(fresh(tiny_llama_model, ids), candidate)
    stats = pool.stats()
    assert stats["prefix_hits_disk"] == 0 and stats["prefix_pages_rejected"] > 0
    assert sum("was not served: the checksum does not match" in record.message for record in caplog.records) == 1


def test_resetting_the_index_forgets_the_tiers(tiny_llama_model, tmp_path):
    page_bytes = tiered_pool(tiny_llama_model).stats()["page_bytes"]
    pool = tiered_pool(
        tiny_llama_model, prefix_host_bytes=2 * page_bytes, prefix_disk_dir=str(tmp_path), prefix_disk_bytes=1 << 22
    )
    fill(tiny_llama_model, pool, range(4))
    pool.reset_prefix_index()
    stats = pool.stats()
    assert stats["prefix_host_pages"] == stats["prefix_disk_pages"] == 0 and not list(tmp_path.glob("*.page"))
    before = stats["prefix_tokens_reused"]
    greedy(tiny_llama_model, random_ids(1, PROMPT, seed=0), {"pool": pool})
    assert pool.stats()["prefix_tokens_reused"] == before


def test_cache_config_gives_the_pool_its_tiers_and_refuses_conflicts(tiny_llama_model):
    ids = random_ids(1, 20)
    config = {"max_tokens": 96, "page_size": PAGE_SIZE, "prefix_host_bytes": 1 << 20}
    seq, _ = greedy(tiny_llama_model, ids, config)
    pool = KVPool.default(PagedConfig(page_size=PAGE_SIZE).page_format(tiny_llama_model.config, torch.float32), "cpu")
    assert pool is not None
    shared = KVPool.default(
        PagedConfig(page_size=PAGE_SIZE).page_format(tiny_llama_model.config, torch.float32), "cpu", max_tokens=96
    )
    assert shared.prefix_caching and shared.stats()["prefix_host_max_bytes"] == 1 << 20
    assert PagedConfig(prefix_host_bytes=1).prefix_caching is True  # a tier turns the index on
    with pytest.raises(ValueError, match="The pool keeps its prefix pages in"):
        greedy(tiny_llama_model, ids, {**config, "prefix_host_bytes": 2 << 20})
    greedy(tiny_llama_model, ids, {"pool": shared})  # a cache that names no tiers uses its pool's
    plain = tiered_pool(tiny_llama_model)
    with pytest.raises(ValueError, match="need a prefix index"):
        plain.pages.configure_tiers(TierSettings(host_bytes=1024))


@pytest.mark.parametrize(
    "settings,error,message",
    [
        ({"prefix_host_bytes": -1}, ValueError, "prefix_host_bytes=-1 is out of range"),
        ({"prefix_host_bytes": "1GB"}, TypeError, "prefix_host_bytes must be an int of bytes"),
        ({"prefix_disk_dir": "/tmp/x"}, ValueError, "needs a budget: set prefix_disk_bytes"),
        ({"prefix_disk_bytes": 10}, ValueError, "without prefix_disk_dir"),
        ({"prefix_store": "http://localhost:6379"}, ValueError, "prefix_store='http://localhost:6379' is not a Redis"),
        ({"prefix_store": 6379}, TypeError, "prefix_store must be a URL string"),
        ({"prefix_store": "redis://h:notaport/0"}, ValueError, "prefix_store=.redis://h:notaport/0.: Port"),
        ({"prefix_store": "redis://h/0?timeout=0"}, ValueError, "the timeout > 0"),
        ({"prefix_store": "redis://h:1/0", "prefix_caching": False}, ValueError, "prefix_caching=False but"),
    ],
)
def test_bad_tier_settings_name_the_setting(settings, error, message):
    with pytest.raises(error, match=message):
        PagedConfig(**settings)


def test_a_directory_that_cannot_be_made_names_the_setting(tiny_llama_model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="prefix_disk_dir=.* cannot be made"):
        tiered_pool(tiny_llama_model, prefix_disk_dir=str(blocker / "pages"), prefix_disk_bytes=1024)


# ----- a page's bytes --------------------------------------------------------------------------------


@pytest.fixture
def page():
    fmt = PageFormat(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, page_size=PAGE_SIZE)
    data = PageData((torch.randn(2, 2, PAGE_SIZE, 8).to(torch.bfloat16), torch.randn(2, 2, PAGE_SIZE, 8)))
    specs = [(tuple(t.shape), t.dtype) for t in data.tensors]
    return fmt, (os.urandom(16), 3), data, specs


def test_a_page_travels_as_checked_bytes(page):
    fmt, key, data, specs = page
    digest = format_digest(fmt)
    back = decode_page(encode_page(digest, key, data), digest, key, specs)
    for expected, actual in zip(data.tensors, back.tensors, strict=True):
        assert torch.equal(expected, actual) and expected.dtype == actual.dtype


@pytest.mark.parametrize(
    "damage,reason",
    [
        ("flip", "the checksum does not match"),
        ("truncate", "the checksum does not match"),
        ("empty", "too few"),
        ("format", "another page format"),
        ("key", "other tokens, model or layer group"),
        ("layer_group", "other tokens, model or layer group"),
        ("shape", "where the pool has"),
    ],
)
def test_bytes_of_another_page_or_damaged_bytes_are_refused(page, damage, reason):
    fmt, key, data, specs = page
    digest = format_digest(fmt)
    blob = encode_page(digest, key, data)
    if damage == "flip":
        blob = blob[:100] + bytes([blob[100] ^ 1]) + blob[101:]
    elif damage == "truncate":
        blob = blob[:-40]
    elif damage == "empty":
        blob = b""
    elif damage == "format":  # the same tokens from a pool of another page size
        blob = encode_page(format_digest(dataclasses.replace(fmt, page_size=8)), key, data)
    elif damage == "key":
        blob = encode_page(digest, (os.urandom(16), key[1]), data)
    elif damage == "layer_group":
        blob = encode_page(digest, (key[0], key[1] + 1), data)
    elif damage == "shape":
        specs = [((2, 2, PAGE_SIZE, 16), specs[0][1]), specs[1]]
    with pytest.raises(CorruptPage, match=reason):
        decode_page(blob, digest, key, specs)


def test_store_keys_differ_by_format_chain_and_layer_group(page):
    fmt, key, _, _ = page
    digest = format_digest(fmt)
    other_format = format_digest(dataclasses.replace(fmt, dtype=torch.float16))
    names = {store_key(digest, key), store_key(other_format, key), store_key(digest, (key[0], key[1] + 1))}
    assert len(names) == 3 and all(name.startswith(b"hf_kvcache:page:") for name in names)


def test_threads_evicting_and_restoring_on_one_pool_keep_it_whole(tiny_llama_model):
    """Four threads generate six prompts over and over on a pool too small to keep them: pages spill and come back while
    other threads take, share and evict pages; every answer equals a fresh prefill's."""
    import threading

    model = tiny_llama_model
    prompts = [random_ids(1, PROMPT, seed=30 + i) for i in range(6)]
    references = [fresh(model, ids) for ids in prompts]
    pool = tiered_pool(model, max_tokens=192, prefix_host_bytes=1 << 20)  # 48 pages: 4 requests of 10, 8 cached
    failures: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for step in range(6):
                i = (offset + step) % len(prompts)
                assert_same(references[i], greedy(model, prompts[i], {"pool": pool}))
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    threads = [threading.Thread(target=work, args=(offset,)) for offset in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]
    pool.check_integrity()
    stats = pool.stats()
    assert stats["prefix_hits_host"] > 0 and stats["pages_used"] == stats["pages_cached"]


def test_a_ring_cache_reuses_as_much_from_host_memory_as_from_the_pool(tiny_llama_model):
    """sliding_ring publishes the pages its ring still holds (the sink page, the window's last pages): after
    eviction, the host tier gives back what the pool itself gave before, and the generation equals a fresh one."""
    model, config = tiny_llama_model, {"window": 16, "sink_tokens": 4}
    model.set_attn_implementation("hf_kvcache")
    try:
        pool = tiered_pool(model, 64, "sliding_ring", config, prefix_host_bytes=1 << 20)
        ids = random_ids(1, PROMPT, seed=50)
        greedy(model, ids, {**config, "pool": pool}, "sliding_ring")
        before = pool.stats()
        greedy(model, ids, {**config, "pool": pool}, "sliding_ring")
        from_pool = pool.stats()["prefix_tokens_reused"] - before["prefix_tokens_reused"]
        assert from_pool > 0 and pool.stats()["prefix_hits_host"] == 0
        for seed in range(51, 55):  # other prompts evict its pages
            greedy(model, random_ids(1, PROMPT, seed=seed), {**config, "pool": pool}, "sliding_ring")
        before = pool.stats()
        candidate = greedy(model, ids, {**config, "pool": pool}, "sliding_ring")
        after = pool.stats()
        assert_same(fresh(model, ids, "sliding_ring", config), candidate)
        assert after["prefix_tokens_reused"] - before["prefix_tokens_reused"] == from_pool
        hits = after["prefix_hits_host"] - before["prefix_hits_host"]
        assert hits > 0 and after["prefix_hits_device"] == before["prefix_hits_device"]
        assert after["prefix_bytes_restored"] - before["prefix_bytes_restored"] == hits * after["page_bytes"]
        pool.check_integrity()
    finally:
        model.set_attn_implementation("sdpa")


def test_errors_never_show_the_stores_password(tiny_llama_model):
    url = "redis://:pa55word@127.0.0.1:1/0"
    with pytest.raises(ValueError, match="prefix_caching=False") as refused:
        PagedConfig(prefix_store=url, prefix_caching=False)
    assert "pa55word" not in str(refused.value) and "redis://:***@127.0.0.1:1/0" in str(refused.value)
    pool = tiered_pool(tiny_llama_model, prefix_store=url)
    with pytest.raises(ValueError, match="The pool keeps its prefix pages in") as refused:
        pool.pages.configure_tiers(TierSettings(host_bytes=1024))
    assert "pa55word" not in str(refused.value) and "pa55word" not in repr(pool.pages.tiers.settings)
    assert pool.stats()["prefix_store"] == "redis://:***@127.0.0.1:1/0"
