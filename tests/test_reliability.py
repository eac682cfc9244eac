"""Reliability under serving conditions: threads sharing pools, exhaustion and admission, alerts, faults.

Bad input and the soak are in ``test_reliability_input.py``.
"""

import gc
import threading
from typing import NamedTuple

import pytest
import torch
from helpers import WAIT_SECONDS, assert_same_generation, example_config, padded_batch, run, run_threads
from transformers import LogitsProcessor, LogitsProcessorList

from hf_kvcache import KVPool, PagedConfig, PageFormat, PoolExhaustedError
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.layers.window import window_pages_per_row


def pools_for(model, max_tokens: int, page_size: int = 8) -> dict[str, KVPool]:
    """One fixed pool per page format: paged_pool and sliding_ring share one, quantized_values gets its own."""
    made: dict[tuple, KVPool] = {}
    pools = {}
    for name, entry in REGISTRY.items():
        config = entry.config({**entry.example_config, "page_size": page_size})
        key = config.page_format(model.config, model.dtype)
        if key not in made:
            made[key] = KVPool.for_model(model, config, max_tokens=max_tokens)
        pools[name] = made[key]
    return pools


class Generation(NamedTuple):
    """What ``assert_same_generation`` compares, without the cache (which would hold its pages)."""

    sequences: torch.Tensor
    logits: tuple[torch.Tensor, ...]


def generate_on(model, name: str, pool: KVPool, ids, mask, **kwargs) -> Generation:
    """Greedy generate on one of our caches drawing from ``pool``, with scores (``helpers.run``)."""
    cache_config = example_config(name) | {"pool": pool} | kwargs.pop("cache_config", {})
    out = run(model, ids, mask, cache_implementation=name, cache_config=cache_config, **kwargs)
    return Generation(out.sequences, out.logits)


def new_cache(model, name: str, pool: KVPool, **cache_config):
    """The cache ``generate`` would build for ``name`` on ``pool``, to pass as ``cache=``."""
    settings = example_config(name) | {"pool": pool} | cache_config
    return REGISTRY[name].cache_class(model.config, settings)


def assert_pools_empty(*pools: KVPool) -> None:
    for pool in pools:
        pool.check_integrity()
        assert pool.stats()["pages_used"] == 0


class Checkpoint(LogitsProcessor):
    """Calls ``on_step(step)`` before each token is picked (step 0 right after the prefill); changes no score."""

    def __init__(self, on_step) -> None:
        self.on_step = on_step
        self.step = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.on_step(self.step)
        self.step += 1
        return scores


# ----- concurrency -----------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", ["tiny_llama_model", "tiny_gemma3_model"])
def test_threads_with_every_cache_match_their_solo_runs(model_name, request):
    """Nine threads, three per cache, of different lengths and batch sizes, on two shared pools."""
    model = request.getfixturevalue(model_name)
    pools = pools_for(model, max_tokens=2048)
    names = sorted(REGISTRY)
    requests = [
        (names[i % len(names)], [4 + 5 * i, 2 + 3 * i, 7][: 1 + i // len(names)], 3 + 2 * i, i)
        for i in range(3 * len(names))
    ]
    inputs = [padded_batch(lengths, seed=seed) for _, lengths, _, seed in requests]
    solo = [
        generate_on(model, name, pools[name], *inputs[i], max_new_tokens=new)
        for i, (name, _, new, _) in enumerate(requests)
    ]
    assert_pools_empty(*pools.values())
    results = {}

    def work(i: int) -> None:
        name, _, new, _ = requests[i]
        results[i] = generate_on(model, name, pools[name], *inputs[i], max_new_tokens=new)

    assert run_threads(work, len(requests)) == {}
    for i in range(len(requests)):
        assert_same_generation(solo[i], results[i])
    assert_pools_empty(*pools.values())


# ----- exhaustion and admission -------------------------------------------------------------------


def test_request_overflowing_mid_generation_fails_alone(tiny_llama_model):
    """Two requests hold pages; a third, without admission check, overflows the pool mid-generation; the two finish
    as when run alone.

    Logits processors order the threads: the small requests prefill, then wait at their first token
    while the big one runs until the pool is exhausted.
    """
    model = tiny_llama_model
    pool = KVPool.for_model(model, PagedConfig(page_size=4), max_tokens=160)  # 40 pages
    small = [("paged_pool", padded_batch([10, 7], seed=1), 12), ("sliding_ring", padded_batch([6], seed=2), 20)]
    big_ids, big_mask = padded_batch([20, 18], seed=3)  # 10 pages after its prefill, 40 at 80 tokens per row
    solo = [generate_on(model, name, pool, *batch, max_new_tokens=new) for name, batch, new in small]
    prefilled = [threading.Event() for _ in small]
    big_done = threading.Event()
    outcome: dict = {}

    def wait_for_big(i: int, step: int) -> None:
        if step == 0:
            prefilled[i].set()
            assert big_done.wait(WAIT_SECONDS)

    def note_step(step: int) -> None:
        outcome["big_steps"] = step + 1

    def work(i: int) -> None:
        if i < len(small):
            name, batch, new = small[i]
            processors = LogitsProcessorList([Checkpoint(lambda step: wait_for_big(i, step))])
            outcome[i] = generate_on(model, name, pool, *batch, max_new_tokens=new, logits_processor=processors)
            return
        assert all(event.wait(WAIT_SECONDS) for event in prefilled)
        try:
            generate_on(
                model,
                "paged_pool",
                pool,
                big_ids,
                big_mask,
                max_new_tokens=60,
                min_new_tokens=60,
                logits_processor=LogitsProcessorList([Checkpoint(note_step)]),
                cache_config={"admission_check": False},  # on, it would be refused before its prefill
            )
        except PoolExhaustedError as error:
            # Only figures are kept: the error's traceback holds the frames that hold the failed cache.
            outcome["error"] = (error.requested_pages, error.free_pages, error.total_pages, str(error))
        finally:
            gc.collect()  # the failed cache's pages go back before the small requests go on
            big_done.set()

    assert run_threads(work, len(small) + 1) == {}
    requested, free, total, message = outcome["error"]
    assert requested > free and total == 40 and "max_tokens" in message
    assert outcome["big_steps"] > 1, "the big request should fail mid-generation, not at its prefill"
    for i in range(len(small)):
        assert_same_generation(solo[i], outcome[i])
    assert_pools_empty(pool)


def count_forwards(model) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    calls = [0]
    handle = model.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    return calls, handle


def test_admission_check_refuses_before_any_forward(tiny_llama_model, cache_name):
    model = tiny_llama_model
    pool = pools_for(model, max_tokens=80)[cache_name]  # 10 pages of 8 tokens
    held = new_cache(model, cache_name, pool)
    run(model, *padded_batch([6]), max_new_tokens=3, cache=held)  # 8 tokens: holds 1 page
    before = pool.stats()
    checked = {"admission_check": True}
    big, prompt = padded_batch([10, 8, 9]), padded_batch([10])
    calls, handle = count_forwards(model)
    try:
        # 3 rows of 10 + 40 - 1 tokens: 3 x 7 pages kept in full, 3 x 6 in a window of 16 + 2 sinks; 9 are free.
        with pytest.raises(
            PoolExhaustedError, match=r"pool's 10 pages in all \(9 free now\).*admission_check refused.*3 rows"
        ):
            generate_on(model, cache_name, pool, *big, max_new_tokens=40, cache_config=checked)
        with pytest.raises(PoolExhaustedError, match="admission_check refused") as error:  # passed as `cache=`
            run(model, *big, max_new_tokens=40, cache=new_cache(model, cache_name, pool, **checked))
        assert error.value.requested_pages == (18 if cache_name == "sliding_ring" else 21)
        # Beams multiply the rows: 1 prompt x 3 beams x 4 pages > 9 free pages.
        with pytest.raises(PoolExhaustedError, match="3 rows of up to 29 tokens"):
            generate_on(model, cache_name, pool, *prompt, max_new_tokens=20, num_beams=3, cache_config=checked)
        assert calls[0] == 0 and pool.stats() == before
        fits = generate_on(model, cache_name, pool, *prompt, max_new_tokens=20, num_beams=2, cache_config=checked)
        assert calls[0] > 0
    finally:
        handle.remove()
    assert torch.equal(
        fits.sequences, generate_on(model, cache_name, pool, *prompt, max_new_tokens=20, num_beams=2).sequences
    )
    del held, error
    gc.collect()
    assert_pools_empty(pool)


def test_a_request_that_cannot_fit_fails_alone_before_taking_a_page_by_default(tiny_llama_model, cache_name):
    # No admission_check key: a request whose worst case exceeds the free room is refused before any forward, so it
    # never takes the pages other requests need; the error says whether the pool is busy or simply too small.
    model = tiny_llama_model
    pool = pools_for(model, max_tokens=80)[cache_name]  # 10 pages of 8 tokens
    held = new_cache(model, cache_name, pool)
    run(model, *padded_batch([10, 10, 10]), max_new_tokens=15, cache=held)  # 3 rows of 24 tokens: 9 pages
    before = pool.stats()
    calls, handle = count_forwards(model)
    try:
        with pytest.raises(PoolExhaustedError, match=r"needs 3 pages but only 1 of 10 are free now.*Retry") as busy:
            generate_on(model, cache_name, pool, *padded_batch([10]), max_new_tokens=10)
        with pytest.raises(PoolExhaustedError, match=r"more than the pool's 10 pages in all.*can never fit") as small:
            generate_on(model, cache_name, pool, *padded_batch([10, 8, 9]), max_new_tokens=400)
    finally:
        handle.remove()
    assert calls[0] == 0 and pool.stats() == before
    assert not busy.value.exceeds_pool and small.value.exceeds_pool
    # Opting out keeps the old behaviour: the request starts, and fails when a page it needs is not free.
    with pytest.raises(PoolExhaustedError):
        generate_on(
            model,
            cache_name,
            pool,
            *padded_batch([10, 8, 9]),
            max_new_tokens=400,
            min_new_tokens=400,
            cache_config={"admission_check": False},
        )
    del held
    gc.collect()
    assert_pools_empty(pool)


def test_admission_counts_a_ring_up_to_its_size_and_a_growable_pool_up_to_its_cap(tiny_llama_model):
    model = tiny_llama_model
    pool = pools_for(model, max_tokens=96)["sliding_ring"]  # 12 pages of 8 tokens
    checked = {"admission_check": True}
    ids, mask = padded_batch([12, 9], seed=4)
    # 2 rows of 211 tokens: 2 x 27 pages kept in full, 2 x 6 in a window of 16 + 2 sinks (window_pages_per_row).
    with pytest.raises(PoolExhaustedError, match="needs 54 pages, more than the pool's 12 pages in all"):
        generate_on(model, "paged_pool", pool, ids, mask, max_new_tokens=200, cache_config=checked)
    generate_on(model, "sliding_ring", pool, ids, mask, max_new_tokens=200, min_new_tokens=200, cache_config=checked)
    assert pool.stats()["high_water_pages"] == 10  # 12 is the bound: the sinks are 1 page of 2 where unpadded
    growable = KVPool(PageFormat.from_model_config(model.config, torch.float32, page_size=8), num_pages=3, max_pages=40)
    with pytest.raises(PoolExhaustedError, match="needs 54 pages, more than the pool's 39 pages in all"):
        generate_on(model, "paged_pool", growable, ids, mask, max_new_tokens=200, cache_config=checked)
    assert growable.stats()["pages_total"] == 2  # refused without growing
    generate_on(model, "paged_pool", growable, ids, mask, max_new_tokens=100, min_new_tokens=100, cache_config=checked)
    assert growable.stats()["high_water_pages"] == 28
    assert_pools_empty(pool, growable)


# Pages per row of 17 + 15 - 1 = 31 tokens in pages of 4: 8 kept in full; in a window of 16 + 2 sinks, the pages its
# sinks (2) and its last 16 - 1 + 4 tokens (6) may touch (window_pages_per_row): 8 as well; 4 in a window of the
# models' 8. Gemma 3 is 3 sliding groups + 1 full.
WORST_CASE_PAGES_PER_ROW = {
    "tiny_llama_model": {"paged_pool": 8, "sliding_ring": 8, "quantized_values": 8, "quantized_kv": 8},
    "tiny_mistral_model": {"paged_pool": 4, "sliding_ring": 4, "quantized_values": 4, "quantized_kv": 4},
    "tiny_gemma3_model": {
        "paged_pool": 3 * 4 + 8,
        "sliding_ring": 3 * 4 + 8,
        "quantized_values": 3 * 4 + 8,
        "quantized_kv": 3 * 4 + 8,
    },
}


@pytest.mark.parametrize("model_name", sorted(WORST_CASE_PAGES_PER_ROW))
def test_worst_case_pages_is_what_a_request_of_distinct_rows_takes(model_name, cache_name, request):
    """The admission bound is tight: two rows that share no page take the worst case (a row padded by less than a
    page: one padded by more takes fewer, its pages of padding alone are not taken)."""
    model = request.getfixturevalue(model_name)
    pool = pools_for(model, max_tokens=1024, page_size=4)[cache_name]
    worst = new_cache(model, cache_name, pool).worst_case_pages(2, 17 + 15 - 1, 4)
    assert window_pages_per_row(16, 2, 4) == 8 and window_pages_per_row(8, 0, 4) == 4
    assert worst == 2 * WORST_CASE_PAGES_PER_ROW[model_name][cache_name]
    generate_on(model, cache_name, pool, *padded_batch([17, 14], seed=7), max_new_tokens=15, min_new_tokens=15)
    # A window's 2 sinks touch 2 pages only where a row's padding puts them across a page boundary: here 1 row of 2.
    sinks = cache_name == "sliding_ring" and model_name != "tiny_mistral_model"
    assert pool.stats()["high_water_pages"] == worst - sinks


def test_alerts_fire_once_per_upward_crossing_across_generate_cycles(tiny_llama_model):
    pool = KVPool.for_model(
        tiny_llama_model, PagedConfig(page_size=8), max_tokens=80, alert_thresholds=(0.5, 0.9)
    )  # 10 pages
    fired = []
    # A callback runs under the pool's lock; reading the pool from it is safe (the lock is reentrant).
    pool.add_alert_callback(lambda threshold, stats: fired.append((threshold, pool.stats()["pages_used"])))
    ids, mask = padded_batch([20, 17], seed=9)  # 3 pages a row after the prefill: 60%
    for _ in range(3):  # up to 4 pages a row (80%), then empty again: both thresholds re-arm
        generate_on(tiny_llama_model, "paged_pool", pool, ids, mask, max_new_tokens=10, min_new_tokens=10)
        assert pool.stats()["pages_used"] == 0 and pool.stats()["high_water_pages"] == 8
    assert fired == [(0.5, 6)] * 3
    generate_on(tiny_llama_model, "paged_pool", pool, ids, mask, max_new_tokens=20, min_new_tokens=20)  # 100%
    # Rows take their pages one row after another (extents), so the 90% alert fires at 9 or 10 pages used.
    assert fired[:4] == [(0.5, 6)] * 4 and len(fired) == 5
    assert fired[4][0] == 0.9 and fired[4][1] in (9, 10)
    assert_pools_empty(pool)


# ----- faults -----------------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


def raise_on_call(module: torch.nn.Module, call: int, error: type[BaseException]):
    """A forward pre-hook on ``module`` that raises ``error`` on its ``call``-th call (1-based)."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] == call:
            raise error(f"injected on call {call}")

    return module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_pages_come_back_after_a_failure_inside_the_model(tiny_gemma3_model, cache_name, error):
    model = tiny_gemma3_model
    pool = pools_for(model, max_tokens=512, page_size=4)[cache_name]
    ids, mask = padded_batch([9, 14], seed=11)
    expected = generate_on(model, cache_name, pool, ids, mask, max_new_tokens=8)
    handle = raise_on_call(model.model.layers[-1], 4, error)  # the last layer, in the third decode step
    try:
        with pytest.raises(error, match="injected on call 4") as info:
            generate_on(model, cache_name, pool, ids, mask, max_new_tokens=8)
    finally:
        handle.remove()
    assert pool.stats()["pages_used"] > 0  # the traceback holds generate's frame, which holds the cache
    del info
    # Dropping the traceback frees the cache by reference counting; gc.collect() makes sure of it even if a
    # frame sits in a reference cycle (a frame that refers to its own exception), which only the collector frees.
    gc.collect()
    assert_pools_empty(pool)
    assert_same_generation(expected, generate_on(model, cache_name, pool, ids, mask, max_new_tokens=8))


def test_a_cache_kept_across_a_failure_resets_and_a_dropped_cache_returns_its_pages(tiny_gemma3_model, cache_name):
    model = tiny_gemma3_model
    pool = pools_for(model, max_tokens=512, page_size=4)[cache_name]
    ids, mask = padded_batch([9, 14], seed=12)
    expected = generate_on(model, cache_name, pool, ids, mask, max_new_tokens=8)
    cache = new_cache(model, cache_name, pool)
    handle = raise_on_call(model.model.layers[1], 3, Boom)  # mid-step: earlier layers of the step have written
    try:
        with pytest.raises(Boom):
            run(model, ids, mask, max_new_tokens=8, cache=cache)
    finally:
        handle.remove()
    cache.reset()  # the caller's cache: reset returns its pages at once, whatever step it failed in
    assert_pools_empty(pool)
    assert_same_generation(expected, run(model, ids, mask, max_new_tokens=8, cache=cache))
    assert pool.stats()["pages_used"] > 0
    del cache  # dropped without reset: its finalizer returns the pages
    gc.collect()
    assert_pools_empty(pool)
