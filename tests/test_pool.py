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
from hf_kvcache import KVPool, PagedCache, PagedConfig, PageFormat, PoolExhaustedError
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.memory import device_memory
from hf_kvcache.memory import pools as pool_module
from hf_kvcache.memory.placement import normalize_device

FORMAT = PageFormat(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, page_size=16)


def test_kvpool_public_surface_is_what_users_need(tiny_llama_model):
    """Users see a pool's constructors, statistics, alerts, capacity and prefix index; the allocator, the page tables
    and the storage are behind it in ``pool.pages`` (docs/caches.md lists this surface)."""
    surface = {name for name in dir(KVPool) if not name.startswith("_")}
    assert surface == {
        *("for_model", "named", "default", "drop_defaults", "default_budget"),
        *("stats", "add_alert_callback", "check_integrity", "capacity_pages", "prefix_caching", "reset_prefix_index"),
    }
    assert len(surface) <= 12
    pool = KVPool.for_model(tiny_llama_model, max_tokens=64)
    assert {name for name in vars(pool) if not name.startswith("_")} == {"format", "device", "name", "pages"}
    assert pool.pages.format is pool.format and pool.pages.device == pool.device


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
    by_tokens = KVPool.for_model(tiny_llama_model, PagedConfig(page_size=8), max_tokens=100)
    assert by_tokens.stats()["pages_total"] == 13  # ceil(100 / 8) usable pages
    # [layers, heads, pages incl. null rounded up to whole extents of 128 tokens, slots, head_dim]
    assert by_tokens.pages.storage.keys.shape == (2, 2, 16, 8, 16)
    page_bytes = by_tokens.format.page_bytes
    by_bytes = KVPool.for_model(tiny_llama_model, PagedConfig(page_size=8), max_bytes=10 * page_bytes + 5)
    assert by_bytes.stats()["bytes_total"] == 10 * page_bytes
    with pytest.raises(ValueError, match="exactly one of"):
        KVPool.for_model(tiny_llama_model, max_tokens=10, max_bytes=10)
    with pytest.raises(ValueError, match="CUDA pool"):
        KVPool.for_model(tiny_llama_model, memory_fraction=0.5)
    with pytest.raises(ValueError, match="fewer than 2 pages"):
        KVPool.for_model(tiny_llama_model, max_bytes=page_bytes)


def test_stats_track_use_and_utilization(tiny_llama_model):
    pool = KVPool.for_model(tiny_llama_model, PagedConfig(page_size=16), max_tokens=64)
    cache = PagedCache(tiny_llama_model.config, {"pool": pool})
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
    # A left-padded batch: 3 real tokens of 16 in the short row, whose pages hold its padding's slots (but whole pages
    # of padding). Only tokens count as held.
    model = tiny_llama_model
    config = {"window": 16, "sink_tokens": 0} if cache_name == "sliding_ring" else {}
    pool = KVPool.for_model(model, REGISTRY[cache_name].config({**config, "page_size": 4}), max_tokens=512)
    ids = random_ids(2, 16, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    cache = REGISTRY[cache_name].cache_class(model.config, config | {"pool": pool})
    model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, cache=cache)
    stats = pool.stats()
    real = (16 + 8) + (3 + 8)  # each row: its real prompt tokens and the 8 new tokens written back
    if cache_name == "sliding_ring":  # the full row keeps the pages of its last 16 - 1 + 4 tokens: tokens 4 to 23
        real = (24 - 4) + (3 + 8)
    assert stats["tokens_held"] == real
    assert stats["utilization"] == pytest.approx(real / (stats["pages_used"] * 4))
    del cache
    gc.collect()


def test_alerts_fire_once_per_upward_crossing(caplog):
    pool = KVPool(FORMAT, num_pages=11, alert_thresholds=(0.5, 0.9))
    fired = []
    pool.add_alert_callback(lambda threshold, stats: fired.append((threshold, stats["pages_used"])))
    first = pool.pages.allocate(4)
    assert fired == []
    second = pool.pages.allocate(2)  # 6 of 10: past 50%
    more = pool.pages.allocate(1)  # still past 50%: no second alert
    assert fired == [(0.5, 6)]
    last = pool.pages.allocate(3)  # 10 of 10
    assert fired == [(0.5, 6), (0.9, 10)]
    assert "past the 90% alert threshold" in caplog.text
    pool.pages.free(last + more + second)  # back under both thresholds: they re-arm
    pool.pages.allocate(2)
    assert fired[-1] == (0.5, 6) and len(fired) == 3
    pool.pages.free(first)


def test_exhaustion_is_all_or_nothing():
    pool = KVPool(FORMAT, num_pages=5)
    pool.pages.allocate(3)
    with pytest.raises(PoolExhaustedError, match="needs 2 pages but only 1 of 4 are free") as error:
        pool.pages.allocate(2)
    assert "max_tokens" in str(error.value)
    assert pool.stats()["pages_used"] == 3


def test_growable_pool_doubles_up_to_its_cap():
    """A growable pool opens page ids in doublings up to its cap, in one storage made for the cap when the pool is
    (the CPU commits only the pages opened): views of it and compiled attention stay valid for the pool's life."""
    pool = KVPool(FORMAT, num_pages=4, max_pages=20)
    storage = pool.pages.storage
    assert storage.num_pages == 24  # 20 ids in whole extents of 8 pages
    pages = pool.pages.allocate(3)
    pool.pages.storage.keys[1, 0, pages[0]] = 7.0
    pages += pool.pages.allocate(5)  # 4 ids -> 8 is not enough -> 16
    assert pool.stats()["pages_total"] == 15 and pool.pages.storage is storage
    assert pool.stats()["bytes_total"] == 16 * FORMAT.page_bytes  # committed: the opened pages (null included)
    pages += pool.pages.allocate(9)  # 7 free -> capped at 20 ids
    assert pool.stats()["pages_total"] == 19 and pool.pages.storage is storage
    with pytest.raises(PoolExhaustedError, match="needs 5 pages but only 2 of 19 are free"):
        pool.pages.allocate(5)
    assert (pool.pages.storage.keys[1, 0, pages[0]] == 7.0).all() and pool.pages.storage.keys[:, :, 20:].eq(
        0
    ).all()  # unopened ids: zeros
    pool.pages.free(pages)
    assert pool.pages.storage.keys.eq(0).all() and pool.pages.storage.values.eq(0).all()  # free pages are zeros
    pool.check_integrity()


def default_pool_budget(monkeypatch, num_pages: int, lazily: bool) -> None:
    """The default pools made next share a budget of ``num_pages`` pages of ``FORMAT``, on a CPU that commits memory
    where it is touched (``lazily``) or, as CUDA does, at once."""
    cap = num_pages * FORMAT.page_bytes
    monkeypatch.setattr(device_memory, "memory_limit_bytes", lambda: int(cap / pool_module.DEFAULT_MAX_MEMORY_FRACTION))
    monkeypatch.setattr(device_memory, "commits_lazily", lambda device: lazily)


@pytest.mark.parametrize("lazily", [True, False], ids=["commits-lazily", "commits-at-once"])
def test_a_default_pools_storage_never_moves_as_it_opens_pages(monkeypatch, fresh_default_pools, lazily):
    """A default pool's storage tensors are made once, for every page id it may open, and never replaced: opening
    more pages keeps the same tensors at the same addresses, so slot indices and compiled graphs never depend on a
    growth. Where memory is committed where touched (the CPU) and where it is committed at once (CUDA's)."""
    default_pool_budget(monkeypatch, 1000, lazily)
    pool = KVPool.default(FORMAT, "cpu")
    tensors = pool.pages.storage.tensors
    addresses = [tensor.data_ptr() for tensor in tensors]
    opened = pool.stats()["pages_total"]
    pages = pool.pages.allocate(opened + 1)  # more than it opened first: it opens more
    assert pool.stats()["pages_total"] > opened
    assert all(now is before for now, before in zip(pool.pages.storage.tensors, tensors, strict=True))
    assert [tensor.data_ptr() for tensor in pool.pages.storage.tensors] == addresses
    pool.pages.free(pages)
    pool.check_integrity()


@pytest.mark.parametrize("lazily", [True, False], ids=["commits-lazily", "commits-at-once"])
def test_a_default_pools_opened_pages_are_zeros(monkeypatch, fresh_default_pools, lazily):
    """The storage is uninitialized past the pages opened (``torch.empty``: on CUDA, whatever the memory held):
    each page id the pool opens, and the rest of its extent, is zeroed as it opens, so pages handed out are zeros."""
    default_pool_budget(monkeypatch, 1000, lazily)
    pool = KVPool.default(FORMAT, "cpu")
    extent = FORMAT.extent_pages
    first = -(-(pool.stats()["pages_total"] + 1) // extent) * extent  # the opened ids, in whole extents
    assert pool.pages.storage.num_pages > first
    for tensor in pool.pages.storage.tensors:
        tensor[:, :, first:].fill_(float("nan"))  # what an uninitialized storage may hold
    pages = pool.pages.allocate(pool.stats()["pages_total"] + 1)
    opened = -(-(pool.stats()["pages_total"] + 1) // extent) * extent
    assert opened > first
    assert all(tensor[:, :, :opened].eq(0).all() for tensor in pool.pages.storage.tensors)
    assert pool.pages.storage.keys[:, :, pages].eq(0).all() and pool.pages.storage.values[:, :, pages].eq(0).all()
    pool.pages.free(pages)
    pool.check_integrity()


def test_growable_pool_keeps_rows_in_extents_of_their_own():
    """Rows that outgrow a growable pool's whole extents make it grow rather than take single pages in extents
    other rows began (or the null page's): attention reads a row's extents in place only when they hold nothing
    else. 8 rows of 64 pages (1,024 tokens) on a pool opened at 257 ids, then one token more (each row's 65th
    page starts a new extent)."""
    pool = KVPool(FORMAT, num_pages=257, max_pages=4096)
    table = pool.pages.new_table(row_extents=True)
    for num_new in [64 * 16, 1]:
        table.grow(8, num_new)
        held = {page for row in table.rows for page in row}
        extents = {page // pool.format.extent_pages for page in held}
        assert pool.pages.foreign_pages(held, sorted(extents)) == []
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
    assert first is second and first.pages.max_pages > first.stats()["pages_total"]


def test_pool_made_under_inference_mode_serves_calls_outside_it(tiny_llama_model):
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        pool = KVPool.for_model(tiny_llama_model, max_tokens=256)
        config = {"cache_implementation": "paged_pool", "cache_config": {"pool": pool}, "max_new_tokens": 4}
        inside = tiny_llama_model.generate(ids, **config)
    assert not pool.pages.storage.keys[0].is_inference()
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
        PagedCache(tiny_llama_model.config, {"pool": wrong_dtype}).update(
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
    assert pool.device.type == "cuda" and pool.pages.storage.keys[0].is_cuda
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


def test_a_storage_the_device_refuses_is_halved_until_granted(monkeypatch, caplog):
    """A pool's storage, made once for its cap, is halved until the device grants it (keys, values and scales are
    allocated one after the other: a refusal in between starts over), logged; never below the pages it opens first."""
    page_format = PageFormat(2, 2, 16, torch.float32, value_bits=4, value_group_size=16)
    empty = torch.empty

    def refusing(*shape, **kwargs):  # [layers, heads, pages, ...]: more than 16 pages of values are refused
        if len(shape) > 2 and shape[2] > 16 and kwargs.get("dtype") == torch.uint8:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")
        return empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", refusing)
    with caplog.at_level("WARNING", logger="hf_kvcache"):
        pool = KVPool(page_format, num_pages=4, max_pages=64)
    assert pool.pages.max_pages == 16 and pool.pages.storage.num_pages == 16
    assert "could not take 64 pages" in caplog.text and "could not take 32 pages" in caplog.text
    with pytest.raises(RuntimeError, match="injected"):
        KVPool(page_format, num_pages=20, max_pages=64)  # 16 pages would not hold the 20 it opens
    monkeypatch.undo()
    pages = pool.pages.allocate(15)
    assert pool.stats()["pages_total"] == 15
    pool.pages.free(pages)
    pool.check_integrity()


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
    table = first.pages.new_table()
    table.grow(1, first.capacity_pages * small.page_size)  # grows into the rest of the budget
    assert held_bytes() == budget.used_bytes <= cap
    assert second.capacity_pages == second.stats()["pages_total"]  # no room left to grow into
    with pytest.raises(PoolExhaustedError):
        second.pages.new_table().grow(1, (second.stats()["pages_free"] + 1) * large.page_size)
    first.check_integrity()
    table.release()
    second.check_integrity()


def test_default_pools_that_commit_at_once_take_half_the_room_left_each(monkeypatch, fresh_default_pools, caplog):
    """Where memory is committed at once (CUDA's), a default pool takes its storage when it is made: half the room
    left in its device's budget, drawn from the budget at once and logged with the knob that sizes a pool otherwise,
    so that the next format's pool still gets room (half of the rest). Every page it took then opens, unmoved."""
    small, large = FORMAT, PageFormat(2, 2, 16, torch.float32, page_size=32)
    default_pool_budget(monkeypatch, 1000, lazily=False)
    with caplog.at_level("WARNING", logger="hf_kvcache"):
        first = KVPool.default(small, "cpu")
    assert "took 500 pages" in caplog.text and "never moves" in caplog.text and "max_tokens" in caplog.text
    budget = KVPool.default_budget("cpu")
    assert first.pages.max_pages == 500 and budget.used_bytes == 500 * small.page_bytes
    second = KVPool.default(large, "cpu")
    assert second.pages.max_pages == 125  # half of the 250 pages of twice the size left
    assert budget.used_bytes == 500 * small.page_bytes + 125 * large.page_bytes <= budget.total_bytes
    used = budget.used_bytes
    for pool, page_format in ((first, small), (second, large)):
        storage = pool.pages.storage
        table = pool.pages.new_table()
        table.grow(1, pool.capacity_pages * page_format.page_size)  # every page it took opens
        assert pool.stats()["pages_total"] == pool.pages.max_pages - 1 and pool.pages.storage is storage
        table.release()
        pool.check_integrity()
    assert budget.used_bytes == used  # drawn once, when the pools were made


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
    table = first.pages.new_table()
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
