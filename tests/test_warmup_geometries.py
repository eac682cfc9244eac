"""``warmup`` where a cache draws from a ``KVPoolSet`` (a pool per geometry: ``KVPool.for_model`` makes one for
MiMo-V2-Flash and Gemma 4). A step that reads pages in place (``attn_implementation="hf_kvcache"``) reads a view of
each part's storage, so warmup runs each part's larger views.

Neither MiMo-V2-Flash nor Gemma 4 reaches the in-place kernel: both refuse sdpa, so under ``"hf_kvcache"`` they run
their own attention function over gathered keys, and warmup has no view to warm for them. The views of a set are
warmed here through a tiny Llama that reads in place from a set of its one geometry.
"""

import functools

import pytest
import torch

from hf_kvcache import KVPool, KVPoolSet, warmup
from hf_kvcache.attention import flex
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.integration.warmup import _generate, _warm_views
from hf_kvcache.testing import tiny_causal_lm, tiny_llama
from tests.helpers import random_ids

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def every_step_in_place(monkeypatch):
    """Every decode step long enough to read in place, nothing compiled yet in this process."""
    monkeypatch.setattr(flex, "MIN_IN_PLACE_TOKENS", 0)
    monkeypatch.setattr(flex, "KERNELS", flex.CompiledKernels())


def test_warmup_runs_every_view_of_a_pool_set_then_busy_requests_compile_nothing(every_step_in_place):
    model = tiny_llama()
    model.set_attn_implementation("hf_kvcache")
    pool = KVPoolSet([KVPool.for_model(model, max_tokens=6000)])  # 376 pages: views of 256 pages (32 extents), 376
    shapes = warmup(model, "paged_pool", batch_sizes=(2,), max_tokens=64, cache_config={"pool": pool})
    assert [shape.held_pages > 0 for shape in shapes] == [False, True]  # the first view, then the larger one
    assert all(shape.in_place_calls for shape in shapes)
    assert pool.stats()["pages_used"] == 0
    kernels, calls = len(flex.compile_seconds()), flex.call_count()
    ids = random_ids(2, 21)
    reference = tiny_llama().generate(ids, do_sample=False, max_new_tokens=12)
    (part,) = pool.parts
    for held in (0, 296, 0):  # other requests hold page ids below this: none, most of the pool, none again
        others = part.pages.allocate(part.stats()["pages_free"]) if held else []
        part.pages.free([page for page in others if page >= held])
        out = model.generate(
            ids, do_sample=False, max_new_tokens=12, cache_implementation="paged_pool", cache_config={"pool": pool}
        )
        part.pages.free([page for page in others if page < held])
        assert torch.equal(out, reference)
    assert len(flex.compile_seconds()) == kernels  # warmup compiled every view
    assert flex.call_count() > calls  # read in place
    pool.check_integrity()


def test_warmup_on_mimo_says_no_step_reads_in_place(every_step_in_place):
    """MiMo-V2-Flash's pool is a set, and its attention gathers: warmup names why it has nothing to compile."""
    model = tiny_causal_lm("mimo_v2_flash")
    model.set_attn_implementation("hf_kvcache")
    pool = KVPool.for_model(model, max_tokens=6000)
    assert isinstance(pool, KVPoolSet) and len(pool.parts) == 2
    with pytest.raises(ValueError, match="no eager step of paged_pool reads pages in place"):
        warmup(model, "paged_pool", batch_sizes=(2,), max_tokens=64, cache_config={"pool": pool})
    assert pool.stats()["pages_used"] == 0


def test_each_larger_view_holds_the_pages_below_it_in_every_part():
    """The views of a set's parts grow together: each warm-up generation holds every part's pages below the view,
    so that its rows' pages lie in that view of each part's storage (MiMo-V2-Flash's two geometries, sized alike)."""
    model = tiny_causal_lm("mimo_v2_flash")
    pool = KVPool.for_model(model, max_tokens=6000)  # each part 376 pages: a larger view from page 256
    parts = [part.pages for part in pool.parts]
    run = functools.partial(_generate, model, "paged_pool", REGISTRY["paged_pool"].config({"pool": pool}), None)
    (shape,) = _warm_views(run, parts, batch_size=2, prompt=8, length=10)
    extent = parts[0].format.extent_pages
    assert shape.held_pages == len(parts) * (256 - extent)  # in each part, every extent below but the null page's
    assert pool.stats()["pages_used"] == 0
    pool.check_integrity()
