"""KVPool: sizing, statistics, alerts, named and default pools, threads, CUDA."""

import copy
import gc
import math
import os
import threading

import pytest
import torch
from helpers import random_ids

import hf_kvcache  # noqa: F401
from hf_kvcache import KVPool, PagedCache, PageFormat, PoolExhaustedError
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.layers.window import ring_num_slots
from hf_kvcache.memory import device_memory
from hf_kvcache.memory import pool as pool_storage_module
from hf_kvcache.memory import pools as pool_module
from hf_kvcache.memory.device_memory import MemoryBudget
from hf_kvcache.memory.placement import normalize_device

FORMAT = PageFormat(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, page_size=16)


def test_page_format_sizes_and_checks():
    assert FORMAT.token_bytes == 2 * 2 * 2 * 16 * 4
    assert FORMAT.page_bytes == 16 * FORMAT.token_bytes
    assert FORMAT.pages_for_tokens(33) == 3
    with pytest.raises(ValueError, match="page_size=0 is out of range"):
        PageFormat(2, 2, 16, torch.float32, page_size=0)
    with pytest.raises(TypeError, match="page_size must be an int"):
        PageFormat(2, 2, 16, torch.float32, page_size=16.0)
    with pytest.raises(ValueError, match="floating dtype"):
        PageFormat(2, 2, 16, torch.int8)


def test_for_model_sizes_by_tokens_or_bytes(tiny_llama_model):
    by_tokens = KVPool.for_model(tiny_llama_model, max_tokens=100, page_size=8)
    assert by_tokens.stats()["pages_total"] == 13  # ceil(100 / 8) usable pages
    # [layers, heads, pages incl. null rounded up to whole extents of 128 tokens, slots, head_dim]
    assert by_tokens.keys.shape == (2, 2, 16, 8, 16)
    page_bytes = by_tokens.format.page_bytes
    by_bytes = KVPool.for_model(tiny_llama_model, max_bytes=10 * page_bytes + 5, page_size=8)
    assert by_bytes.stats()["bytes_total"] == 10 * page_bytes
    with pytest.raises(ValueError, match="exactly one of"):
        KVPool.for_model(tiny_llama_model, max_tokens=10, max_bytes=10)
    with pytest.raises(ValueError, match="CUDA pool"):
        KVPool.for_model(tiny_llama_model, memory_fraction=0.5)
    with pytest.raises(ValueError, match="fewer than 2 pages"):
        KVPool.for_model(tiny_llama_model, max_bytes=page_bytes)


def test_stats_track_use_and_utilization(tiny_llama_model):
    pool = KVPool.for_model(tiny_llama_model, max_tokens=64, page_size=16)
    cache = PagedCache(tiny_llama_model.config, pool=pool)
    states = torch.randn(2, 2, 20, 16)
    for layer_idx in range(2):
        cache.update(states, states, layer_idx)
    stats = pool.stats()
    expected = {"pages_total": 4, "pages_used": 4, "pages_free": 0, "high_water_pages": 4, "tokens_held": 40}
    assert {key: stats[key] for key in expected} == expected
    assert stats["utilization"] == pytest.approx(40 / 64)
    assert stats["bytes_used"] == 4 * pool.format.page_bytes
    cache.crop(-10)
    assert pool.stats()["pages_used"] == 2 and pool.stats()["high_water_pages"] == 4
    del cache
    gc.collect()
    assert pool.stats()["pages_used"] == 0


@pytest.mark.parametrize("cache_name", ["paged_pool", "sliding_ring"])
def test_utilization_counts_real_tokens_not_left_padding(tiny_llama_model, cache_name):
    # A left-padded batch: 3 real tokens of 16 in the short row, whose pages hold its padding's slots (growing rows)
    # or start at its first real token (a ring). Only tokens count as held.
    model = tiny_llama_model
    config = {"window": 16, "sink_tokens": 0} if cache_name == "sliding_ring" else {}
    pool = KVPool.for_model(
        model, max_tokens=512, page_size=4, **REGISTRY[cache_name].pool_kwargs(model.config, model.dtype, config)
    )
    ids = random_ids(2, 16, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    cache = REGISTRY[cache_name].cache_class.from_cache_config(model.config, config | {"pool": pool})
    model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, cache=cache)
    stats = pool.stats()
    real = (16 + 8) + (3 + 8)  # each row: its real prompt tokens and the 8 new tokens written back
    if cache_name == "sliding_ring":  # the full row keeps the ring's slots: its window and the page it fills
        real = min(16 + 8, ring_num_slots(16, 0, 4)) + (3 + 8)  # the full row has wrapped
    assert stats["tokens_held"] == real
    assert stats["utilization"] == pytest.approx(real / (stats["pages_used"] * 4))
    del cache
    gc.collect()


def test_alerts_fire_once_per_upward_crossing(caplog):
    pool = KVPool(FORMAT, num_pages=11, alert_thresholds=(0.5, 0.9))
    fired = []
    pool.add_alert_callback(lambda threshold, stats: fired.append((threshold, stats["pages_used"])))
    first = pool.allocate(4)
    assert fired == []
    second = pool.allocate(2)  # 6 of 10: past 50%
    more = pool.allocate(1)  # still past 50%: no second alert
    assert fired == [(0.5, 6)]
    last = pool.allocate(3)  # 10 of 10
    assert fired == [(0.5, 6), (0.9, 10)]
    assert "past the 90% alert threshold" in caplog.text
    pool.free(last + more + second)  # back under both thresholds: they re-arm
    pool.allocate(2)
    assert fired[-1] == (0.5, 6) and len(fired) == 3
    pool.free(first)


def test_exhaustion_is_all_or_nothing():
    pool = KVPool(FORMAT, num_pages=5)
    pool.allocate(3)
    with pytest.raises(PoolExhaustedError, match="needs 2 pages but only 1 of 4 are free") as error:
        pool.allocate(2)
    assert "max_tokens" in str(error.value)
    assert pool.stats()["pages_used"] == 3


@pytest.mark.parametrize("reserve", [True, False], ids=["reserved", "moved"])
def test_growable_pool_doubles_up_to_its_cap(reserve):
    """A growable pool opens page ids in doublings up to its cap. Reserved (the CPU's default): one storage for
    the pool's life, so views of it and compiled attention stay valid. Not reserved (CUDA's default): a growth
    moves the pages into a larger storage, their contents with them."""
    pool = KVPool(FORMAT, num_pages=4, max_pages=20, reserve=reserve)
    storage = pool.storage
    assert pool.storage_is_fixed == reserve and storage.num_pages == (24 if reserve else 8)
    pages = pool.allocate(3)
    pool.keys[1, 0, pages[0]] = 7.0
    pages += pool.allocate(5)  # 4 ids -> 8 is not enough -> 16
    assert pool.stats()["pages_total"] == 15 and (pool.storage is storage) == reserve
    assert pool.stats()["bytes_total"] == 16 * FORMAT.page_bytes  # committed: the opened pages (null included)
    pages += pool.allocate(9)  # 7 free -> capped at 20 ids
    assert pool.stats()["pages_total"] == 19 and pool.storage.num_pages == 24
    with pytest.raises(PoolExhaustedError, match="needs 5 pages but only 2 of 19 are free"):
        pool.allocate(5)
    assert (pool.keys[1, 0, pages[0]] == 7.0).all() and pool.keys[:, :, 20:].eq(0).all()  # unopened ids: zeros
    pool.free(pages)
    assert pool.keys.eq(0).all() and pool.values.eq(0).all()  # free pages are zeros
    pool.check_integrity()


def test_growable_pool_keeps_rows_in_extents_of_their_own():
    """Rows that outgrow a growable pool's whole extents make it grow rather than take single pages in extents
    other rows began (or the null page's): attention reads a row's extents in place only when they hold nothing
    else. 8 rows of 64 pages (1,024 tokens) on a pool opened at 257 ids, then one token more (each row's 65th
    page starts a new extent)."""
    pool = KVPool(FORMAT, num_pages=257, max_pages=4096)
    table = pool.new_table(row_extents=True)
    for num_new in [64 * 16, 1]:
        table.grow(8, num_new)
        held = {page for row in table.rows for page in row}
        extents = {page // pool.format.extent_pages for page in held}
        assert pool.foreign_pages(held, sorted(extents)) == []
        assert len(extents) == 8 * math.ceil(len(table.rows[0]) / pool.format.extent_pages)
    pool.check_integrity()
    table.release()


def test_named_default_and_copied_pools(tiny_llama_model):
    pool = KVPool(FORMAT, num_pages=4, name="test-named")
    assert KVPool.named("test-named") is pool
    with pytest.raises(ValueError, match="already exists"):
        KVPool(FORMAT, num_pages=4, name="test-named")
    with pytest.raises(ValueError, match="No pool named 'nope'"):
        KVPool.named("nope")
    assert copy.deepcopy({"pool": pool})["pool"] is pool
    assert KVPool.default(FORMAT, "cpu") is KVPool.default(FORMAT, torch.device("cpu"))
    first, second = (
        tiny_llama_model.generate(
            torch.tensor([[1, 2, 3]]), max_new_tokens=2, cache_implementation="paged_pool", return_dict_in_generate=True
        ).cache.pool
        for _ in range(2)
    )
    assert first is second and first.max_pages > first.stats()["pages_total"]


def test_pool_made_under_inference_mode_serves_calls_outside_it(tiny_llama_model):
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        pool = KVPool.for_model(tiny_llama_model, max_tokens=256)
        config = {"cache_implementation": "paged_pool", "cache_config": {"pool": pool}, "max_new_tokens": 4}
        inside = tiny_llama_model.generate(ids, **config)
    assert not pool.keys[0].is_inference()
    assert torch.equal(tiny_llama_model.generate(ids, **config), inside)


def test_pool_of_another_model_is_rejected(tiny_llama_model, tiny_gemma3_model):
    pool = KVPool.for_model(tiny_gemma3_model, max_tokens=64)
    with pytest.raises(
        hf_kvcache.IncompatibleModelError, match="num_layers 1 vs 2, num_layer_groups 4 vs 1.*KVPool.for_model"
    ):
        tiny_llama_model.generate(
            torch.tensor([[1, 2, 3]]), max_new_tokens=2, cache_implementation="paged_pool", cache_config={"pool": pool}
        )
    wrong_dtype = KVPool.for_model(tiny_llama_model, max_tokens=64, dtype=torch.float16)
    with pytest.raises(hf_kvcache.IncompatibleModelError, match="dtype torch.float16 vs torch.float32"):
        PagedCache(tiny_llama_model.config, pool=wrong_dtype).update(
            torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0
        )


def test_threads_share_one_pool(tiny_llama_model):
    pool = KVPool.for_model(tiny_llama_model, max_tokens=4096)
    prompts = [random_ids(1 + i % 3, 5 + 3 * i, seed=i) for i in range(6)]
    expected = [tiny_llama_model.generate(p, max_new_tokens=12, do_sample=False) for p in prompts]
    results: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        results[i] = tiny_llama_model.generate(
            prompts[i],
            max_new_tokens=12,
            do_sample=False,
            cache_implementation="paged_pool",
            cache_config={"pool": pool},
        )

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(results[i], expected[i]) for i in range(len(prompts)))
    gc.collect()
    pool.check_integrity()
    assert pool.stats()["pages_used"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pool_matches_dynamic_cache(tiny_gemma3_model):
    model = copy.deepcopy(tiny_gemma3_model).to("cuda")
    pool = KVPool.for_model(model, memory_fraction=0.01)
    assert pool.device.type == "cuda" and pool.keys[0].is_cuda
    ids = torch.randint(1, 128, (3, 30), device="cuda")
    expected = model.generate(ids, max_new_tokens=20, do_sample=False)
    actual = model.generate(
        ids, max_new_tokens=20, do_sample=False, cache_implementation="paged_pool", cache_config={"pool": pool}
    )
    assert torch.equal(expected, actual)
    default = model.generate(ids, max_new_tokens=5, cache_implementation="paged_pool", return_dict_in_generate=True)
    assert default.cache.pool.device.type == "cuda"


@pytest.mark.parametrize("offload", ["device_map", "cpu_offload"])
def test_an_offloaded_model_generates_on_pools_where_its_layers_run(tiny_llama_model, offload, tmp_path):
    """accelerate leaves an offloaded module's parameters on "meta" and streams them to where it runs, so
    ``model.device`` says meta (the GPU check met it: IncompatibleModelError "No layer of this cache is placed on
    meta"). Pools are bound where the layers run (the device map's, or where the first write comes), never on meta."""
    from accelerate import cpu_offload, dispatch_model

    model = copy.deepcopy(tiny_llama_model)
    if offload == "device_map":
        device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers.0": "disk"}
        device_map |= {"model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
        model = dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))
    else:
        model = cpu_offload(model, execution_device="cpu")
    assert model.device.type == "meta"
    ids = torch.randint(1, 128, (2, 20))
    expected = tiny_llama_model.generate(ids, max_new_tokens=10, do_sample=False)
    out = model.generate(
        ids, max_new_tokens=10, do_sample=False, cache_implementation="paged_pool", return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, expected)
    assert list(out.cache.pools) == [torch.device("cpu")]
    if offload == "cpu_offload":  # no device map: the check cannot know which pool the layers will use
        with pytest.raises(hf_kvcache.IncompatibleModelError, match="admission_check=True cannot check this request"):
            model.generate(
                ids, max_new_tokens=2, cache_implementation="paged_pool", cache_config={"admission_check": True}
            )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_model_split_across_devices_gets_one_pool_per_device(tiny_llama_model):
    """Layer 0 on the CPU, layer 1 on the GPU (accelerate's hooks move activations between them). ``main_device``
    is the CPU: by default accelerate offloads modules mapped to "cpu" and runs them on the GPU (one pool, there)."""
    from accelerate import dispatch_model

    model = dispatch_model(
        copy.deepcopy(tiny_llama_model),
        main_device="cpu",
        device_map={
            "model.embed_tokens": "cpu",
            "model.rotary_emb": "cpu",
            "model.layers.0": "cpu",
            "model.layers.1": 0,
            "model.norm": 0,
            "lm_head": 0,
        },
    )
    ids = torch.randint(1, 128, (2, 20))
    expected = tiny_llama_model.generate(ids, max_new_tokens=10, do_sample=False)
    out = model.generate(
        ids, max_new_tokens=10, do_sample=False, cache_implementation="paged_pool", return_dict_in_generate=True
    )
    assert torch.equal(out.sequences.cpu(), expected)
    assert sorted(device.type for device in out.cache.pools) == ["cpu", "cuda"]
    with pytest.raises(ValueError, match="spans 2 devices"):
        _ = out.cache.pool


def test_devices_are_normalized_and_mismatches_named(tiny_llama_model, monkeypatch):
    """A pool or cache made for "cpu:0" or torch.device("cpu") is the model's "cpu" pool; "cuda" means the current
    CUDA device with its index, as the model's tensors report it; a pool on another device is refused by name."""
    assert normalize_device("cpu:0") == torch.device("cpu")
    assert normalize_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert normalize_device("cuda") == torch.device("cuda", 1)
    assert normalize_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    monkeypatch.undo()
    ids = torch.tensor([[1, 2, 3]])
    for device in ("cpu:0", torch.device("cpu:0"), "cpu"):
        pool = KVPool.for_model(tiny_llama_model, max_tokens=64, device=device)
        assert pool.device == torch.device("cpu")
        out = tiny_llama_model.generate(
            ids, max_new_tokens=2, cache_implementation="paged_pool", cache_config={"pool": pool}
        )
        assert out.shape == (1, 5)
        cache = PagedCache(tiny_llama_model.config, dtype=torch.float32, device=device)
        tiny_llama_model(ids, cache=cache)
        assert list(cache.pools) == [torch.device("cpu")]
    elsewhere = KVPool.for_model(tiny_llama_model, max_tokens=64, device="meta")
    with pytest.raises(hf_kvcache.IncompatibleModelError, match="device meta vs cpu"):
        tiny_llama_model.generate(
            ids, max_new_tokens=2, cache_implementation="paged_pool", cache_config={"pool": elsewhere}
        )


def test_a_failed_growth_leaves_the_pool_as_it_was(monkeypatch):
    """A growth that moves pages allocates keys, values and scales before it switches: an allocation failure in
    between changes nothing, the request fails alone with PoolExhaustedError, and the pool grows later."""
    page_format = PageFormat(2, 2, 16, torch.float32, value_bits=4, value_group_size=16)
    pool = KVPool(page_format, num_pages=4, max_pages=64, reserve=False)
    table = pool.new_table()
    table.grow(1, 3 * 16)  # 3 pages
    empty, calls, before = torch.empty, {"n": 0}, pool.storage

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the values, after the keys were made
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", failing)
    with pytest.raises(PoolExhaustedError, match="needs 5 pages"):
        table.grow(1, 5 * 16)
    monkeypatch.undo()
    assert pool.storage is before and pool.stats()["pages_total"] == 3
    assert pool.stats()["pages_used"] == 3 and table.num_tokens == 3 * 16
    pool.check_integrity()
    table.grow(1, 5 * 16)
    assert pool.storage is not before and pool.stats()["pages_total"] == 15  # 4 ids -> 8 is not enough -> 16
    pool.check_integrity()
    table.release()
    pool.check_integrity()


def test_a_default_pool_that_moves_takes_fixed_storage_once_within_its_budget(monkeypatch):
    """Before compiled steps (``PoolCache.fix_pool_storage``): a default pool whose storage moves when it grows
    (CUDA's) takes storage for its page ids and half the room left in its budget, once, halved until the device
    grants it, and draws it from the budget at once; later growths open pages without moving them. One that cannot
    have even the pages it holds keeps its storage; a pool of the user's that moves is left as it is."""
    budget = MemoryBudget(40 * FORMAT.page_bytes)
    budget.reserve(4 * FORMAT.page_bytes)  # as KVPool.default does for the ids it opens first
    pool = KVPool(FORMAT, num_pages=4, max_pages=64, budget=budget, reserve=False)
    pages = pool.allocate(2)
    pool.keys[1, 0, pages[0]] = 7.0
    new_storage = pool.memory.new_storage
    monkeypatch.setattr(pool.memory, "new_storage", lambda n: new_storage(n) if n <= 20 else torch.empty(2**62))
    assert pool.can_fix_storage and not pool.storage_is_fixed
    assert pool.fix_storage()  # 4 ids + 18 (half the budget's 36 left) -> 4 + 9
    storage = pool.storage
    assert pool.storage_is_fixed and pool.max_pages == 13 and not pool.can_fix_storage
    assert budget.used_bytes == 13 * FORMAT.page_bytes and pool.stats()["pages_total"] == 3  # taken, not opened
    assert (pool.keys[1, 0, pages[0]] == 7.0).all()
    pages += pool.allocate(10)
    assert pool.storage is storage and pool.stats()["pages_total"] == 12
    with pytest.raises(PoolExhaustedError, match="needs 1 pages but only 0 of 12 are free"):
        pool.allocate(1)
    pool.free(pages)
    pool.check_integrity()

    stuck = KVPool(FORMAT, num_pages=4, max_pages=64, budget=MemoryBudget(40 * FORMAT.page_bytes), reserve=False)
    monkeypatch.setattr(stuck.memory, "new_storage", lambda n: torch.empty(2**62))
    before = stuck.storage
    assert not stuck.fix_storage() and stuck.storage is before and stuck.max_pages == 64
    users = KVPool(FORMAT, num_pages=4, max_pages=64, reserve=False)
    assert not users.can_fix_storage and not users.fix_storage() and not users.storage_is_fixed


def test_default_pools_of_a_device_share_one_memory_cap(monkeypatch, fresh_default_pools):
    """Pools of different formats on one device draw from one budget: together they never pass it."""
    small, large = FORMAT, PageFormat(2, 2, 16, torch.float32, page_size=32)
    cap = 1000 * small.page_bytes
    monkeypatch.setattr(device_memory, "memory_limit_bytes", lambda: int(cap / pool_module.DEFAULT_MAX_MEMORY_FRACTION))
    first = KVPool.default(small, "cpu")
    second = KVPool.default(large, "cpu")
    budget = KVPool.default_budget("cpu")
    assert budget.total_bytes == cap

    def held_bytes() -> int:
        return sum(pool.stats()["bytes_total"] for pool in (first, second))

    assert held_bytes() == budget.used_bytes <= cap
    table = first.new_table()
    table.grow(1, first.capacity_pages * small.page_size)  # grows into the rest of the budget
    assert held_bytes() == budget.used_bytes <= cap
    assert second.capacity_pages == second.stats()["pages_total"]  # no room left to grow into
    with pytest.raises(PoolExhaustedError):
        second.new_table().grow(1, (second.stats()["pages_free"] + 1) * large.page_size)
    first.check_integrity()
    table.release()
    second.check_integrity()


def test_default_pools_of_two_formats_both_take_fixed_storage_for_compiled_steps(monkeypatch, fresh_default_pools):
    """Where default pools move when they grow (CUDA's), each format's pool takes fixed storage when generate first
    compiles on it: the first takes half the room left in the budget, so the next format's pool still gets room (it
    got none, and then the first step past its few pages failed with PoolExhaustedError)."""
    small, large = FORMAT, PageFormat(2, 2, 16, torch.float32, page_size=32)
    cap = 1000 * small.page_bytes
    monkeypatch.setattr(device_memory, "memory_limit_bytes", lambda: int(cap / pool_module.DEFAULT_MAX_MEMORY_FRACTION))
    monkeypatch.setattr(pool_storage_module, "commits_lazily", lambda device: False)
    first, second = KVPool.default(small, "cpu"), KVPool.default(large, "cpu")
    budget = KVPool.default_budget("cpu")
    room = budget.free_bytes
    assert first.fix_storage() and second.fix_storage()
    first_bytes = first.max_pages * small.page_bytes
    assert first_bytes - first.stats()["bytes_total"] == pytest.approx(room / 2, abs=small.page_bytes)
    assert second.capacity_pages >= budget.total_bytes // 4 // large.page_bytes - 8
    second.new_table().grow(1, second.capacity_pages * large.page_size)  # every page it took opens, unmoved
    assert budget.used_bytes <= cap


@pytest.mark.parametrize(
    "contents,expected", [(None, "physical"), ("max\n", "physical"), ("1073741824\n", 2**30), ("9" * 30, "physical")]
)
def test_cpu_memory_limit_reads_the_containers_cgroup(tmp_path, monkeypatch, contents, expected):
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = tmp_path / "memory.max"
    if contents is not None:
        limit.write_text(contents)
    monkeypatch.setattr(device_memory, "CGROUP_MEMORY_LIMITS", (str(limit), str(tmp_path / "absent")))
    assert device_memory.memory_limit_bytes() == (physical if expected == "physical" else expected)


def test_forgotten_default_pools_stay_with_their_caches_and_the_next_ones_start_fresh(fresh_default_pools):
    """``KVPool.drop_defaults``: the next default pool of the format is a new one, under a new budget, while a table
    of the forgotten pool keeps its pages there."""
    first = KVPool.default(FORMAT, "cpu")
    budget = KVPool.default_budget("cpu")
    assert KVPool.default(FORMAT, "cpu") is first
    table = first.new_table()
    table.grow(1, 3 * FORMAT.page_size)
    assert KVPool.drop_defaults("cuda:0") == 0  # another device's: nothing of the CPU's goes
    assert KVPool.default(FORMAT, "cpu") is first
    assert KVPool.drop_defaults("cpu") == 1
    second = KVPool.default(FORMAT, "cpu")
    assert second is not first and KVPool.default_budget("cpu") is not budget
    assert first.stats()["pages_used"] == 3 and second.stats()["pages_used"] == 0
    table.release()
    first.check_integrity()
    assert first.stats()["pages_used"] == 0
