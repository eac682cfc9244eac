"""Serving with compiled steps: ``warmup`` checks its arguments before any work, a compiled call gives its pages back
when its cache is released, requests in other threads survive a compile, and after ``warmup`` requests on a busy
pool compile nothing."""

import gc

import pytest
import torch

from hf_kvcache.memory.pool import KVPool
from hf_kvcache.testing import tiny_llama
from tests.helpers import random_ids

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize(
    ("arguments", "error", "named"),
    [
        ({"batch_sizes": 2}, TypeError, "batch_sizes=2"),
        ({"batch_sizes": (1.5,)}, TypeError, r"batch_sizes=\(1.5,\)"),
        ({"batch_sizes": (True,)}, TypeError, r"batch_sizes=\(True,\)"),
        ({"batch_sizes": ()}, ValueError, r"batch_sizes=\(\)"),
        ({"batch_sizes": (1, 0)}, ValueError, r"batch_sizes=\(1, 0\)"),
        ({"max_tokens": 100.0}, TypeError, "max_tokens=100.0"),
        ({"max_tokens": 9}, ValueError, "max_tokens=9"),
        ({"prompt_tokens": 0}, ValueError, "prompt_tokens=0"),
        ({"prompt_tokens": "8"}, TypeError, "prompt_tokens='8'"),
        ({"cache_config": [("max_tokens", 64)]}, TypeError, "cache_config="),
        ({"compile_config": {"mode": "default"}}, TypeError, "compile_config="),
        ({"cache_implementation": 3}, TypeError, "cache_implementation=3"),
        ({"cache_implementation": "static"}, ValueError, "cache_implementation='static'"),
        ({"model": "HuggingFaceTB/SmolLM2-135M"}, TypeError, "model=str"),
    ],
)
def test_warmup_names_a_bad_argument_before_any_work(compile_config, monkeypatch, arguments, error, named):
    """Every argument is checked before the first ``generate``: the error names the argument, its value and what is
    allowed."""
    from hf_kvcache import warmup

    model = tiny_llama()
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: pytest.fail("warmup ran a generation"))
    call = {"cache_implementation": "paged_pool", "max_tokens": 64, "compile_config": compile_config, **arguments}
    model, name = call.pop("model", model), call.pop("cache_implementation")
    with pytest.raises(error, match=named):
        warmup(model, name, **call)


@pytest.fixture
def no_cyclic_collector():
    """Python's cyclic collector off for the test, as between its automatic runs."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_a_compiled_call_releases_its_pages_when_its_cache_is_released(compile_config, no_cyclic_collector):
    """Dynamo leaves the objects it traced (the compiled step's cache among them) in a reference cycle of its own
    trackers: the call that compiled held its pages until the cyclic collector ran, where other calls release them
    as the output is dropped."""
    model = tiny_llama()
    pool = KVPool.for_model(model, max_tokens=256)
    for _ in range(2):  # the first call compiles, the second does not
        out = model.generate(
            random_ids(2, 21),
            do_sample=False,
            max_new_tokens=6,
            cache_implementation="paged_pool",
            cache_config={"pool": pool},
            compile_config=compile_config,
            return_dict_in_generate=True,
        )
        assert out.cache.compiled_decoding and pool.stats()["pages_used"] > 0
        del out
        assert pool.stats()["pages_used"] == 0
        pool.check_integrity()


def test_warmup_leaves_no_page_held(compile_config, no_cyclic_collector):
    """Each warm-up generation compiles in its last step: its cache's pages come back before ``warmup`` returns."""
    from hf_kvcache import warmup

    model = tiny_llama()
    pool = KVPool.for_model(model, max_tokens=256)
    warmup(model, "paged_pool", max_tokens=40, cache_config={"pool": pool}, compile_config=compile_config)
    assert pool.stats()["pages_used"] == 0
    pool.check_integrity()


@pytest.fixture
def in_place_model(monkeypatch):
    """Tiny Llama under ``attn_implementation="hf_kvcache"``, every decode step long enough to read in place."""
    from hf_kvcache.attention import flex

    monkeypatch.setattr(flex, "MIN_IN_PLACE_TOKENS", 0)
    monkeypatch.setattr(flex, "KERNELS", flex.CompiledKernels())  # nothing compiled yet in this process
    model = tiny_llama()
    model.set_attn_implementation("hf_kvcache")
    return model


def on_pool(model, ids, pool: KVPool, compile_config=None):
    """Twelve greedy tokens through ``paged_pool`` on ``pool`` (compiled with ``compile_config``, if given)."""
    return model.generate(
        ids,
        do_sample=False,
        max_new_tokens=12,
        cache_implementation="paged_pool",
        cache_config={"pool": pool},
        compile_config=compile_config,
    )


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_after_warmup_requests_on_a_busy_pool_compile_nothing(compile_config, in_place_model, compiled):
    """Other live requests' pages push a request's pages to higher page ids, and attention's view of the storage
    grows with them: warmup compiles every view the pool can give, so that the requests compile no graph and no
    kernel, in place all the same."""
    from hf_kvcache import warmup
    from hf_kvcache.attention import flex

    model, config = in_place_model, compile_config if compiled else None
    pool = KVPool.for_model(model, max_tokens=6000)  # 376 pages: views of 256 pages (32 extents) and 376
    warmup(model, "paged_pool", batch_sizes=(2,), max_tokens=64, cache_config={"pool": pool}, compile_config=config)
    torch._dynamo.config.error_on_recompile = True
    kernels, compiled_graphs, calls = len(flex.compile_seconds()), graphs(), flex.call_count()
    ids = random_ids(2, 21)
    reference = tiny_llama().generate(ids, do_sample=False, max_new_tokens=12)
    for held in (0, 296, 0):  # other requests hold page ids below this: none, most of the pool, none again
        others = pool.pages.allocate(pool.stats()["pages_free"]) if held else []
        pool.pages.free([page for page in others if page >= held])
        others = [page for page in others if page < held]
        out = on_pool(model, ids, pool, compile_config=config)
        pool.pages.free(others)
        assert torch.equal(out, reference)
    assert (len(flex.compile_seconds()), graphs()) == (kernels, compiled_graphs)
    assert flex.call_count() - calls >= 3 * 10 * model.config.num_hidden_layers  # read in place


def test_requests_in_other_threads_survive_a_compile(in_place_model):
    """While torch compiles, ``torch.compiler.is_compiling()`` is true in every thread, and the context variables of
    transformers' kernelized attention (the ``kernels`` package's, Llama's) switch to one process-wide value: other
    threads' forwards failed (``TypeError`` on a ``Token``). The in-place kernel that compiles inside a request
    holds the other threads' module calls until it is compiled: every ``DynamicCache`` request in them succeeds."""
    import threading

    from hf_kvcache.attention import flex

    model = in_place_model
    short = random_ids(1, 9, seed=3)
    expected = model.generate(short, do_sample=False, max_new_tokens=3)
    failures: list[str] = []
    done = [0]
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            try:
                out = model.generate(short, do_sample=False, max_new_tokens=3)  # DynamicCache
                assert torch.equal(out, expected)
                done[0] += 1
            except Exception as error:  # noqa: BLE001  (any failure of a request counts)
                failures.append(f"{type(error).__name__}: {error}"[:200])

    waits = flex.FORWARDS.waits
    threads = [threading.Thread(target=traffic) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        while done[0] < 3:
            stop.wait(0.01)
        ids = random_ids(2, 21)
        out = model.generate(ids, do_sample=False, max_new_tokens=4, cache_implementation="paged_pool")
        before = done[0]
        while done[0] < before + 3 and not failures:
            stop.wait(0.01)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert flex.compile_seconds(), "the request compiled no kernel"
    assert flex.FORWARDS.waits > waits, "no other thread's module call waited for the compile"
    assert torch.equal(out, tiny_llama().generate(ids, do_sample=False, max_new_tokens=4))
    assert not failures, f"{len(failures)} of {len(failures) + done[0]} requests failed: {sorted(set(failures))[:3]}"


def test_serving_from_threads_after_warmup_compiles_nothing(in_place_model):
    """The rule of docs/attention.md: ``warmup`` before the threads start, then requests of the warmed batch size on
    a shared pool, while other threads hold its pages and run ``DynamicCache`` requests, compile nothing and all
    succeed."""
    import threading

    from hf_kvcache import warmup
    from hf_kvcache.attention import flex

    model = in_place_model
    pool = KVPool.for_model(model, max_tokens=6000)
    warmup(model, "paged_pool", batch_sizes=(2,), max_tokens=64, cache_config={"pool": pool})
    kernels, waits = len(flex.compile_seconds()), flex.FORWARDS.waits
    ids, short = random_ids(2, 21), random_ids(1, 9, seed=3)
    expected = {2: tiny_llama().generate(ids, do_sample=False, max_new_tokens=12)}
    expected[1] = model.generate(short, do_sample=False, max_new_tokens=3)
    failures: list[str] = []

    def requests(batch: int, rounds: int) -> None:
        for round_idx in range(rounds):
            try:
                if batch == 1:  # DynamicCache
                    out = model.generate(short, do_sample=False, max_new_tokens=3)
                else:
                    held = (
                        pool.pages.extend(None, 136) if round_idx % 2 else []
                    )  # other requests' pages, the lowest free
                    out = on_pool(model, ids, pool)
                    pool.pages.free(held)
                assert torch.equal(out, expected[batch])
            except Exception as error:  # noqa: BLE001  (any failure of a request counts)
                failures.append(f"{type(error).__name__}: {error}"[:200])

    threads = [threading.Thread(target=requests, args=(batch, 6)) for batch in (2, 2, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:3]
    assert (len(flex.compile_seconds()), flex.FORWARDS.waits) == (kernels, waits)
    assert pool.stats()["pages_used"] == 0
