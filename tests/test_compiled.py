"""Compiled decoding: ``generate`` compiles the decode steps of a compileable cache (as it does ``StaticCache``'s),
each step planned before the forward pass (``PoolCache.plan_decode``) and run as tensor operations only.

On CPU ``generate`` compiles only when told (``CompileConfig._compile_all_devices``); ``mode="default"`` (no CUDA
graphs). Tiny models compile in a few seconds; ``fullgraph=True`` makes any graph break an error."""

import gc

import pytest
import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import CompileConfig, StaticCache

from hf_kvcache import KVPool, PageFormat
from hf_kvcache.caches.paged import PagedCache
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.integration.seams import build_cache
from hf_kvcache.layers.plan import capacity_bucket
from hf_kvcache.testing import random_padded_batch, tiny_gemma3, tiny_llama, tiny_mistral
from tests.helpers import random_ids

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def generate(model, ids, name=None, compile_config=None, **kwargs):
    if name is not None:
        kwargs["cache_implementation"] = name
    return model.generate(ids, do_sample=False, compile_config=compile_config, **kwargs)


def prompt(batch: str) -> tuple[torch.Tensor, dict]:
    """Two rows of 21 random tokens (``"batch"``), or three left-padded rows of 21, 13 and 17 with their attention
    mask (``"padded"``), and the ``generate`` keywords that go with them."""
    if batch == "padded":
        ids, mask = random_padded_batch([21, 13, 17], 128, torch.Generator().manual_seed(1))
        return ids, {"attention_mask": mask}
    return random_ids(2, 21), {}


def test_only_caches_whose_steps_can_be_planned_are_compileable():
    llama, mistral = tiny_llama(), tiny_mistral()
    cache = PagedCache(llama.config)
    assert cache.is_compileable  # whatever pool it is bound to: a pool's storage never moves
    cache.bind_pools(llama.device, llama.dtype)
    assert cache.is_compileable
    assert build_cache("paged_pool", llama, {}).is_compileable  # built for generate: bound
    assert build_cache("paged_pool", llama, {"max_tokens": 256}).is_compileable
    assert build_cache("paged_pool", mistral, {}).is_compileable  # its sliding layers are rings, planned too
    assert build_cache("sliding_ring", llama, dict(REGISTRY["sliding_ring"].example_config)).is_compileable
    for name in ("quantized_values", "quantized_kv"):
        assert build_cache(name, llama, dict(REGISTRY[name].example_config)).is_compileable
    # Keys coded a page at a time in a ring (a sliding layer) are planned too, and so are exact sinks.
    assert build_cache("quantized_kv", mistral, dict(REGISTRY["quantized_kv"].example_config)).is_compileable
    assert build_cache("quantized_kv", llama, {"key_bits": 4, "value_bits": 4, "sink_tokens": 16}).is_compileable
    growable = KVPool(PageFormat.from_model_config(llama.config, torch.float32), num_pages=4, max_pages=64)
    assert build_cache("paged_pool", llama, {"pool": growable}).is_compileable


@pytest.mark.parametrize(
    "case",
    ["batch", "padded", "beams"],
)
def test_compiled_paged_pool_generates_the_tokens_of_eager_and_dynamic_cache(compile_config, case):
    model = tiny_llama()
    ids, kwargs = prompt("padded" if case == "padded" else "batch")
    kwargs["max_new_tokens"] = 24
    if case == "beams":
        kwargs["num_beams"] = 2
    reference = generate(model, ids, **kwargs)
    assert torch.equal(generate(model, ids, "paged_pool", **kwargs), reference)
    compiled = generate(model, ids, "paged_pool", compile_config, **kwargs)
    assert torch.equal(compiled, reference)
    assert graphs() == (0 if case == "beams" else 1)  # transformers 5.24 compiles greedy and sampling, not beams


def test_no_recompile_within_a_generation_nor_between_lengths_of_one_bucket(compile_config):
    model = tiny_llama()
    ids = random_ids(2, 21)
    generate(model, ids, "paged_pool", compile_config, max_new_tokens=40)
    assert graphs() == 1  # 40 steps, one graph
    torch._dynamo.config.error_on_recompile = True
    for length in (19, 23):  # prompt + 40 tokens: 4 pages of 16 either way (capacity_bucket)
        assert capacity_bucket(-(-(length + 39) // 16)) == 4
        out = generate(model, random_ids(2, length, seed=length), "paged_pool", compile_config, max_new_tokens=40)
        assert torch.equal(out, generate(model, random_ids(2, length, seed=length), max_new_tokens=40))
    assert graphs() == 1


def test_capacity_buckets_waste_at_most_a_quarter():
    for pages in range(1, 2000):
        bucket = capacity_bucket(pages)
        assert pages <= bucket <= max(4, pages * 1.25)
    assert [capacity_bucket(n) for n in (1, 4, 5, 8, 9, 17, 65)] == [4, 4, 5, 8, 10, 20, 80]


def test_prefix_reuse_and_crop_under_compile(compile_config):
    model = tiny_llama()
    pool = KVPool.for_model(model, max_tokens=1024, prefix_caching=True)
    ids = random_ids(1, 40)
    first = generate(model, ids, "paged_pool", compile_config, max_new_tokens=8, cache_config={"pool": pool})
    torch._dynamo.config.error_on_recompile = True
    second = generate(
        model,
        ids,
        "paged_pool",
        compile_config,
        max_new_tokens=8,
        cache_config={"pool": pool},
        return_dict_in_generate=True,
    )
    assert pool.stats()["prefix_tokens_reused"] == 32
    assert torch.equal(second.sequences, first)
    cache = second.cache
    cache.crop(44 - cache.get_seq_length())  # back into the generated tokens, then on with the same cache
    cont = generate(model, second.sequences[:, :45], None, compile_config, max_new_tokens=6, cache=cache)
    assert torch.equal(cont, generate(model, second.sequences[:, :45], max_new_tokens=6))
    pool.check_integrity()


def test_a_default_pool_that_commits_at_once_compiles_from_the_first_request_on_one_storage(
    compile_config, fresh_default_pools, monkeypatch
):
    """CUDA's default pools commit what they allocate, so each takes its storage once when it is made (half the room
    left in the budget), and compiled steps read it from the first request on: the first GPU run found
    ``generate(cache_implementation="paged_pool")`` eager there (42 ms a step against 6.6 compiled) while its pool
    moved its pages as it grew. The CPU's default pools are made to commit as CUDA's do here."""
    from hf_kvcache.memory import device_memory

    monkeypatch.setattr(device_memory, "commits_lazily", lambda device: False)
    model = tiny_llama()
    ids = random_ids(2, 21)
    eager = generate(model, ids, "paged_pool", max_new_tokens=8)
    pool = KVPool.default(PageFormat.from_model_config(model.config, torch.float32), "cpu")
    storage, addresses = pool.pages.storage, [tensor.data_ptr() for tensor in pool.pages.storage.tensors]
    compiled = generate(model, ids, "paged_pool", compile_config, max_new_tokens=8)
    assert torch.equal(compiled, eager)
    assert graphs() > 0
    assert pool.pages.storage is storage and [tensor.data_ptr() for tensor in pool.pages.storage.tensors] == addresses


QUANTIZED_VALUES = {  # residual windows of a page (codes written by page eager), less than one, none
    "by-page": {"bits": 4, "group_size": 16, "residual_length": 16},
    "window-8": {"bits": 4, "group_size": 16, "residual_length": 8},
    "int8-no-window": {"bits": 8, "residual_length": 0},
}


QUANTIZED_KV = {  # int4 keys per channel over a page, int8 keys per token
    "k4v4": ({"key_bits": 4, "value_bits": 4, "group_size": 16, "residual_length": 16}, "inductor"),
    # Inductor's fused forward moves the values it codes by an ulp now and then: a code one step off flips a
    # near-tie of this tiny model's greedy token at step 22 (logits 1e-3 apart). aot_eager traces the same graph
    # (dynamo, fullgraph, functionalized) without inductor's numerics, and gives eager's tokens exactly.
    "k8v4": ({"key_bits": 8, "value_bits": 4, "group_size": 16, "residual_length": 16}, "aot_eager"),
    # the first 16 tokens' keys and values exact over their codes
    "k4v4-sink16": (
        {"key_bits": 4, "value_bits": 4, "group_size": 16, "residual_length": 16, "sink_tokens": 16},
        "inductor",
    ),
}


@pytest.mark.parametrize("config", list(QUANTIZED_KV))
@pytest.mark.parametrize("batch", ["batch", "padded"])
def test_compiled_quantized_kv_generates_the_tokens_of_eager_in_one_graph(compile_config, config, batch):
    """Keys to the page still filling in the graph, which it encodes every step (the step that fills it writes its
    codes last, the codes eager writes then), pages decoded in the graph with the page still filling over theirs."""
    model = tiny_llama()
    cache_config, backend = QUANTIZED_KV[config]
    kwargs = {"max_new_tokens": 40, "cache_config": cache_config}
    compile_config = CompileConfig(mode="default", fullgraph=True, backend=backend)
    compile_config._compile_all_devices = True
    ids, padding = prompt(batch)
    kwargs |= padding
    eager = generate(model, ids, "quantized_kv", **kwargs)
    assert torch.equal(generate(model, ids, "quantized_kv", compile_config, **kwargs), eager)
    assert graphs() == 1


@pytest.mark.parametrize("config", list(QUANTIZED_VALUES))
@pytest.mark.parametrize("batch", ["batch", "padded"])
def test_compiled_quantized_values_generate_the_tokens_of_eager_in_one_graph(compile_config, config, batch):
    """Values coded in the graph, token by token, and read dequantized with the residual window's newest tokens in
    full precision over their codes: the tokens of the eager cache (which codes a page at a time), 40 tokens past a
    window of at most 16, one graph."""
    model = tiny_llama()
    kwargs = {"max_new_tokens": 40, "cache_config": QUANTIZED_VALUES[config]}
    ids, padding = prompt(batch)
    kwargs |= padding
    eager = generate(model, ids, "quantized_values", **kwargs)
    assert torch.equal(generate(model, ids, "quantized_values", compile_config, **kwargs), eager)
    assert graphs() == 1


def test_compiled_quantized_values_on_a_hybrid_model(compile_config):
    model = tiny_gemma3()
    ids = random_ids(2, 21)
    kwargs = {"max_new_tokens": 30, "cache_config": {"bits": 4, "group_size": 16, "residual_length": 16}}
    eager = generate(model, ids, "quantized_values", **kwargs)
    assert torch.equal(generate(model, ids, "quantized_values", compile_config, **kwargs), eager)
    assert graphs() == 1


RING_CASES = {  # (model, cache, cache_config, whether the cache keeps what DynamicCache keeps)
    "mistral-paged_pool": (tiny_mistral, "paged_pool", {}, True),  # sliding layers as rings of the model's window
    "gemma3-paged_pool": (tiny_gemma3, "paged_pool", {}, True),  # hybrid: rings and growing layers, two plans
    "mistral-sliding_ring": (tiny_mistral, "sliding_ring", {}, True),
    "llama-sliding_ring": (tiny_llama, "sliding_ring", {"window": 16, "sink_tokens": 2}, False),  # the ring drops
    "llama-sliding_ring-no-sinks": (tiny_llama, "sliding_ring", {"window": 12}, False),
    # keys coded a page at a time in rings of 2 pages (a window of 8), rows padded apart fill their pages apart
    "mistral-quantized_kv": (tiny_mistral, "quantized_kv", {"key_bits": 4, "value_bits": 4, "group_size": 16}, False),
    "gemma3-quantized_kv": (tiny_gemma3, "quantized_kv", {"key_bits": 4, "value_bits": 4, "group_size": 16}, False),
}


@pytest.mark.parametrize("case", list(RING_CASES))
@pytest.mark.parametrize("batch", ["batch", "padded"])
def test_compiled_rings_generate_the_tokens_of_eager_in_one_graph(compile_config, case, batch):
    """Rings planned before the forward pass: the ring fills, wraps and keeps wrapping (40 tokens, windows of 8 to
    16) in one graph, with the tokens of the eager ring (and of DynamicCache where the ring keeps what it keeps)."""
    build, name, config, keeps_all = RING_CASES[case]
    model = build()
    kwargs = {"max_new_tokens": 40, "cache_config": config}
    ids, padding = prompt(batch)
    kwargs |= padding
    eager = generate(model, ids, name, **kwargs)
    if keeps_all:
        assert torch.equal(eager, generate(model, ids, max_new_tokens=40))
    assert torch.equal(generate(model, ids, name, compile_config, **kwargs), eager)
    assert graphs() == 1


def test_a_compiled_ring_takes_no_new_graph_for_another_prompt_length(compile_config):
    model = tiny_mistral()
    generate(model, random_ids(2, 21), "sliding_ring", compile_config, max_new_tokens=12)
    torch._dynamo.config.error_on_recompile = True
    for length in (5, 30):  # before the window fills, and long past it
        ids = random_ids(2, length, seed=length)
        out = generate(model, ids, "sliding_ring", compile_config, max_new_tokens=12)
        assert torch.equal(out, generate(model, ids, max_new_tokens=12))
    assert graphs() == 1


class HostReads(TorchDispatchMode):
    """Counts the aten ops that read a tensor's value back to the host (``.item()``, ``bool()``, ``nonzero``, and
    indexing with a boolean mask, whose result's size the host must read)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masked = func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1])
        self.reads += masked or func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)
        return func(*args, **(kwargs or {}))


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched (a GPU launches a kernel for nearly each)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "name, config, ops_bound",
    [
        ("paged_pool", {}, 1.1),
        ("sliding_ring", {"window": 16, "sink_tokens": 2}, 1.1),
        # Coding the token, dequantizing and the window: 272 ops against 168 on this 2-layer model (1.62x), which
        # only run compiled (fused); an eager step's plan reads its tokens, not a capacity bucket (docs/compiled.md).
        ("quantized_values", QUANTIZED_VALUES["by-page"], None),
    ],
    ids=["paged", "ring", "quantized_values"],
)
def test_a_planned_step_reads_nothing_back_to_the_host_and_dispatches_what_static_cache_does(name, config, ops_bound):
    model = tiny_llama()
    ids = random_ids(2, 21)
    out = generate(model, ids, name, max_new_tokens=2, cache_config=config, return_dict_in_generate=True)
    cache = out.cache
    cache.compiled_decoding = True
    assert cache.plan_decode(2, 1)
    inputs = {"input_ids": out.sequences[:, -1:], "position_ids": None}
    cache.start_planned(inputs)
    with torch.no_grad(), HostReads() as reads, OpCount() as ops:
        model(**inputs, cache=cache)
    assert reads.reads == 0
    cache.end_planning()
    assert cache.get_seq_length() == 23
    # StaticCache's step, the one generate compiles: like ours, it gets the mask transformers materializes for a
    # compileable cache (DynamicCache's eager step skips it)
    static_cache = StaticCache(config=model.config, max_cache_len=64)
    static = generate(model, ids, max_new_tokens=2, return_dict_in_generate=True, cache=static_cache)
    with torch.no_grad(), OpCount() as static_ops:
        model(input_ids=static.sequences[:, -1:], cache=static.cache)
    assert ops_bound is None or ops.ops <= ops_bound * static_ops.ops, (ops.ops, static_ops.ops)


@pytest.mark.parametrize(
    "name, config, bound",
    [
        ("paged_pool", {}, 2),
        # a residual window of a page, which moves on every step
        ("quantized_values", {"bits": 4, "group_size": 16, "residual_length": 16}, 7),
        ("quantized_kv", QUANTIZED_KV["k4v4"][0], 8),
    ],
    ids=["paged_pool", "quantized_values", "quantized_kv"],
)
def test_planning_a_step_that_opens_no_page_moves_only_the_new_tokens_slot(name, config, bound):
    """Planning runs on the host before every compiled step, where a CUDA graph hides none of it: a step whose rows
    read and write the pages of the step before dispatches only the writes of the new token's slot and offset, and a
    quantized cache's those of its residual window and of whether the step fills its keys' page still filling (it
    rebuilt and copied the whole plan: 13 ops a step for paged_pool, 25 and 34 for the quantized caches, launches and
    host-to-device copies on a GPU). A step that opens a page plans anew; the logits are those of the eager steps."""
    model = tiny_llama()
    ids = random_ids(2, 19)  # page_size 16: generate leaves 20 tokens, position 31 ends the second page
    kwargs = {"max_new_tokens": 2, "return_dict_in_generate": True, "cache_config": config}
    out = generate(model, ids, name, **kwargs)
    cache, token = out.cache, out.sequences[:, -1:]
    eager = generate(model, ids, name, **kwargs).cache
    cache.compiled_decoding = True  # as generate sets them when it compiles
    counts = []
    with torch.no_grad():
        for _ in range(13):  # positions 20 to 32: the step at 32 opens the third page
            with OpCount() as planning:
                assert cache.plan_decode(2, 1)
            counts.append(planning.ops)
            inputs = {"input_ids": token, "position_ids": None}
            cache.start_planned(inputs)
            logits = model(**inputs, cache=cache).logits[:, -1]
            torch.testing.assert_close(logits, model(input_ids=token, cache=eager).logits[:, -1])
            token = logits.argmax(-1, keepdim=True)
    assert counts[0] > bound and counts[-1] > bound, counts  # the first plan, and a step that opens a page
    assert all(count <= bound for count in counts[1:-1]), counts


@pytest.mark.parametrize("name, config", [("paged_pool", {}), ("sliding_ring", {"window": 16, "sink_tokens": 2})])
def test_an_eager_step_dispatches_what_dynamic_cache_does(name, config):
    """An eager decode step (gathered under sdpa: the write and the read of each layer) against ``DynamicCache``'s
    (two ``cat`` per layer), on SmolLM2's depth (30 layers): at most 1.1x the aten ops, and no read back to the
    host. A step that fills a page, and the one after it (the table's indices rebuilt), count too."""
    model = tiny_llama(num_hidden_layers=30)
    ids = random_ids(2, 30)  # the first decode step writes token 30, the second fills the page (31)
    out = generate(model, ids, max_new_tokens=1, return_dict_in_generate=True)
    dynamic, tokens = out.cache, out.sequences[:, -1:]
    # The cache of an eager generate (which skips the mask at decode, as for DynamicCache: is_compileable False)
    ours = generate(model, ids, name, max_new_tokens=1, cache_config=config, return_dict_in_generate=True).cache
    with torch.no_grad():
        for _ in range(3):
            counts = []
            for cache in (ours, dynamic):
                with HostReads() as reads, OpCount() as ops:
                    model(input_ids=tokens, cache=cache)
                assert reads.reads == 0
                counts.append(ops.ops)
            assert counts[0] <= 1.1 * counts[1], counts


def test_a_ring_that_wrapped_reads_nothing_back_to_the_host():
    """Every step of a ring that has wrapped writes slots of pages rows may share (beams: copy-on-write), and asks
    which: each row's come from host arithmetic on the rows' padding (they came from a boolean mask over a tensor of
    slots, a read back to the host that stalls a GPU's queue every step), in an eager step and in the planning of a
    planned one (a left-padded batch: the rows' slots differ)."""
    model = tiny_llama()
    ids, mask = random_padded_batch([60, 47], 128, torch.Generator().manual_seed(2))  # a ring of 48 slots, wrapped
    config = {"window": 16, "sink_tokens": 2}
    kwargs = {"max_new_tokens": 1, "attention_mask": mask, "cache_config": config, "return_dict_in_generate": True}
    for planned in (False, True):
        out = generate(model, ids, "sliding_ring", **kwargs)
        cache, token = out.cache, out.sequences[:, -1:]
        step_mask = torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], dim=1)
        with torch.no_grad(), HostReads() as reads:
            if planned:
                cache.compiled_decoding = True  # as generate sets them when it compiles
                assert cache.plan_decode(2, 1, step_mask)
            else:  # no mask: transformers reads one back to check for padding
                model(input_ids=token, cache=cache)
        assert reads.reads == 0, planned


@pytest.mark.parametrize(
    "name, config",
    [("quantized_values", {"bits": 4}), ("quantized_kv", {"key_bits": 4, "value_bits": 4})],
    ids=["quantized_values", "quantized_kv"],
)
def test_an_eager_quantized_step_dispatches_at_most_its_bound(name, config):
    """Eager decode steps of a quantized cache against ``DynamicCache``'s, on SmolLM2's depth (30 layers), over one
    page (16 steps, one of which fills a page and codes its keys): each step that fills no page, and the whole page,
    at most 1.5x ``DynamicCache``'s aten ops (the issue's target), and no read back to the host."""
    model = tiny_llama(num_hidden_layers=30)
    ids = random_ids(2, 30)
    out = generate(model, ids, max_new_tokens=1, return_dict_in_generate=True)
    dynamic, tokens = out.cache, out.sequences[:, -1:]
    ours = generate(model, ids, name, max_new_tokens=1, cache_config=config, return_dict_in_generate=True).cache
    steps = []
    with torch.no_grad():
        for _ in range(16):
            counts = []
            for cache in (ours, dynamic):
                with HostReads() as reads, OpCount() as ops:
                    model(input_ids=tokens, cache=cache)
                assert reads.reads == 0
                counts.append(ops.ops)
            steps.append(counts)
    fills = steps.pop(1)  # the second step's token (31) fills the second page
    if name == "quantized_kv":  # its keys are coded when their page fills; values are coded every step
        assert fills[0] > max(ours for ours, _ in steps), (fills, steps)
    assert all(ours <= 1.5 * dynamic for ours, dynamic in steps), steps
    steps.append(fills)
    totals = [sum(step[index] for step in steps) for index in (0, 1)]
    assert totals[0] <= 1.5 * totals[1], (totals, totals[0] / totals[1])


PLANNED_CASES = {
    "paged_pool": {},
    "sliding_ring": {"window": 12, "sink_tokens": 2},
    **{f"quantized_values-{name}": config for name, config in QUANTIZED_VALUES.items()},
    **{f"quantized_kv-{name}": config for name, (config, _) in QUANTIZED_KV.items()},
    # Mistral's sliding layers (window 8): keys coded a page at a time in a ring of 2 pages; padded rows fill apart
    **{f"quantized_kv-ring-{name}": QUANTIZED_KV[name][0] for name in ("k4v4", "k8v4")},
    "quantized_kv-ring-padded": QUANTIZED_KV["k4v4"][0],
    # an exact sink of 24 tokens over the codes, which the first planned steps (tokens 22, 23) still write
    "quantized_kv-sink24": QUANTIZED_KV["k8v4"][0] | {"sink_tokens": 24},
}


def planned_and_eager_twins(case: str) -> tuple:
    """A tiny Llama (a tiny Mistral for ``ring`` cases), two caches of ``PLANNED_CASES[case]`` after the same
    21-token prompt (two rows; ``padded``: the second of 14 tokens, left-padded) and one decode step (the first
    set to plan its steps, as ``generate`` sets it when it compiles), the next token to feed and the attention mask
    of the step that feeds it."""
    name, config = case.split("-")[0], PLANNED_CASES[case]
    model = tiny_mistral() if "-ring" in case else tiny_llama()
    if case.endswith("padded"):
        ids, mask = random_padded_batch([21, 14], 128, torch.Generator().manual_seed(1))
    else:
        ids, mask = random_ids(2, 21), torch.ones(2, 21, dtype=torch.long)
    kwargs = {"max_new_tokens": 2, "attention_mask": mask, "cache_config": config}
    planned, eager = (generate(model, ids, name, return_dict_in_generate=True, **kwargs).cache for _ in range(2))
    planned.compiled_decoding = True
    token = generate(model, ids, name, **kwargs)[:, -1:]
    return model, planned, eager, token, torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], dim=1)


def decode_step(model, cache, token: torch.Tensor, mask: torch.Tensor, planned: bool = False) -> torch.Tensor:
    """One decode step of ``token`` under ``mask`` (positions: each row's real tokens), planned before it runs (as
    generate's seam plans it) or eager; the last logits."""
    inputs = {"input_ids": token, "attention_mask": mask, "position_ids": mask.sum(-1, keepdim=True) - 1}
    if planned:
        assert cache.plan_decode(token.shape[0], 1, mask)
        cache.start_planned(inputs)
    else:
        cache.end_planning()
    return model(**inputs, cache=cache).logits[:, -1]


class GatheredDtypes(TorchDispatchMode):
    """The dtypes of the tensors gathered with index tensors (``aten.index_select``)."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index_select.default:
            self.dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_a_planned_int4_key_step_gathers_its_scale_words_as_bytes():
    """Inductor's CPU code vectorizes no load of a gathered int16 tensor: a compiled ``quantized_kv`` step that
    gathered the int16 words of its compact key scales decoded every key in a scalar loop (a fifth of the step at
    4,096 tokens). A planned step's graph gathers the words as their bytes (the decode computes the scale from them);
    run outside a graph, the same step gathers the words (fewer ops)."""
    model, planned, _, token, mask = planned_and_eager_twins("quantized_kv-k4v4")
    in_graph = set()

    def backend(graph_module, example_inputs):  # the dtypes the graph gathers (index_select)
        for node in graph_module.graph.nodes:
            if node.target in ("index_select", torch.index_select):
                in_graph.add(node.args[0].meta["example_value"].dtype)
        return graph_module.forward

    torch._dynamo.reset()
    with torch.no_grad():
        decode_step(torch.compile(model, backend=backend, fullgraph=True), planned, token, mask, planned=True)
        with GatheredDtypes() as eager:
            decode_step(model, planned, token, torch.cat([mask, mask[:, -1:]], dim=1), planned=True)
    assert torch.uint8 in in_graph and torch.int16 not in in_graph, in_graph
    assert torch.int16 in eager.dtypes, eager.dtypes


@pytest.mark.parametrize("case", list(PLANNED_CASES))
def test_planned_steps_compute_what_eager_steps_do(case):
    """Planned steps run eagerly (no compiler numerics) against eager steps on a twin cache, past a page filling
    and a ring wrapping: the same logits to float precision at every step (a plan that reads a key, a code or a
    window one step off shows here, where greedy tokens of a tiny model may not move)."""
    model, planned, eager, token, mask = planned_and_eager_twins(case)
    with torch.no_grad():
        for _ in range(20):  # tokens 22 to 41: the page [16, 32) fills, the ring of 12 + 2 wraps
            logits = decode_step(model, planned, token, mask, planned=True)
            reference = decode_step(model, eager, token, mask)
            assert (logits - reference).abs().max() < 1e-5
            token = reference.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)


@pytest.mark.parametrize("case", [case for case in PLANNED_CASES if case.startswith("quantized")])
@pytest.mark.parametrize("crop", [False, True], ids=["then-eager", "then-crop"])
def test_eager_steps_and_crops_after_planned_ones_compute_what_eager_steps_do(case, crop):
    """Planned steps encode the key page still filling every step (the step that fills it last), and write values
    into the residual window's ring. When the step after the one that filled a page is not planned (a request that
    stops compiling, a cache reused without compiling), or a crop comes back into that page, the page must hold its
    codes, nothing may write over it, and the window must know which tokens the planned steps overwrote: the same
    logits as a cache that ran every step eagerly."""
    model, planned, eager, token, mask = planned_and_eager_twins(case)
    with torch.no_grad():
        for step in range(16):  # tokens 22 to 37: planned up to token 31, which fills the page [16, 32); then eager
            if crop and step == 10:  # back into the page just filled (4 of its tokens dropped), on both caches
                planned.end_planning()
                planned.crop(-4)
                eager.crop(-4)
                token, mask = token * 0 + 7, mask[:, :-4]
            logits = decode_step(model, planned, token, mask, planned=step < 10)
            reference = decode_step(model, eager, token, mask)
            assert (logits - reference).abs().max() < 1e-5, (step, step < 10)
            token = reference.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)


def test_a_cache_collected_while_dynamo_traces_returns_its_pages_afterwards():
    """The garbage collector may finalize a cache in the middle of a trace, where tensors are fake: zeroing its
    freed pages there failed ("Exception ignored") and the pages never came back. They come back at the next
    planned step or generate instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import hf_kvcache.caches.base as base

    model = tiny_llama()
    pool = KVPool.for_model(model, max_tokens=256)
    out = generate(
        model,
        random_ids(2, 21),
        "paged_pool",
        max_new_tokens=4,
        cache_config={"pool": pool},
        return_dict_in_generate=True,
    )
    assert pool.stats()["pages_used"] > 0
    with FakeTensorMode():
        del out
        gc.collect()
    base.release_deferred()
    assert pool.stats()["pages_used"] == 0
    pool.check_integrity()


def test_warmup_compiles_every_shape_before_the_requests(compile_config):
    from hf_kvcache import warmup

    model = tiny_llama()
    shapes = warmup(model, "paged_pool", batch_sizes=(1, 3), max_tokens=120, compile_config=compile_config)
    assert [(shape.batch_size, shape.max_tokens) for shape in shapes] == [
        (batch, pages * 16) for batch in (1, 3) for pages in (4, 5, 6, 7, 8)
    ]
    assert shapes[0].graphs == 1 and sum(shape.graphs for shape in shapes) == graphs()
    torch._dynamo.config.error_on_recompile = True  # the requests compile nothing
    for batch, length, new in ((1, 30, 40), (3, 9, 100), (1, 70, 8), (3, 50, 20)):
        ids = random_ids(batch, length, seed=length)
        out = generate(model, ids, "paged_pool", compile_config, max_new_tokens=new)
        assert torch.equal(out, generate(model, ids, max_new_tokens=new))


def test_warmup_says_when_generate_would_not_compile():
    from hf_kvcache import warmup

    with pytest.raises(ValueError, match="_compile_all_devices"):
        warmup(tiny_llama(), "paged_pool", max_tokens=64)  # on a CPU, generate compiles only when told
    with pytest.raises(ValueError, match="not one of ours"):
        warmup(tiny_llama(), "static")


WINDOW_8 = {"bits": 4, "group_size": 16, "residual_length": 8}
"""Quantized values whose residual window a 24-token generation passes."""


@pytest.fixture
def in_place_model(monkeypatch):
    """Tiny Llama under ``attn_implementation="hf_kvcache"``, with every planned step long enough to read in place."""
    from hf_kvcache.attention import flex

    monkeypatch.setattr(flex, "MIN_IN_PLACE_TOKENS", 0)
    model = tiny_llama()
    model.set_attn_implementation("hf_kvcache")
    return model


@pytest.mark.parametrize("batch", ["batch", "padded"])
@pytest.mark.parametrize("name", ["paged_pool", "quantized_values"])
def test_compiled_steps_read_their_pages_in_place(compile_config, in_place_model, batch, name):
    """Under ``attn_implementation="hf_kvcache"`` a compiled step hands attention the pool's storage and the step's
    mask (``StepPlan.mask``): FlexAttention reads the rows' pages where they lie, nothing is gathered (quantized
    values: dequantized into a buffer laid out as the pool, as eager steps read them)."""
    from hf_kvcache.attention import flex

    ids, kwargs = prompt(batch)
    kwargs["max_new_tokens"] = 24
    if name == "paged_pool":
        reference = generate(tiny_llama(), ids, **kwargs)  # DynamicCache under sdpa
    else:
        kwargs["cache_config"] = WINDOW_8
        reference = generate(in_place_model, ids, name, **kwargs)  # its eager steps
    calls = flex.call_count()
    out = generate(in_place_model, ids, name, compile_config, **kwargs)
    assert torch.equal(out, reference)
    planned_steps = 24 - 2  # the prefill and the first decode step run eager
    assert flex.call_count() - calls >= planned_steps * in_place_model.config.num_hidden_layers


@pytest.mark.parametrize("name", ["paged_pool", "quantized_values"])
def test_compiled_in_place_steps_compute_what_eager_steps_do(in_place_model, name):
    """The model's forward compiled by inductor, every layer reading its own pages in place, against eager steps:
    the same logits at every step (torch 2.13's CPU FlexAttention lowered in a bigger graph read every layer's
    storage as the first layer's: 0.17 off on this model). Quantized values: past the residual window (8 tokens),
    so that the step reads codes and full-precision values both."""
    model = in_place_model
    forward = torch.compile(model.forward, fullgraph=True)
    ids = random_ids(2, 21)
    config = {"cache_config": WINDOW_8} if name == "quantized_values" else {}
    planned, eager = (
        generate(model, ids, name, max_new_tokens=2, return_dict_in_generate=True, **config).cache for _ in range(2)
    )
    planned.compiled_decoding = True  # as generate sets them when it compiles
    token = generate(model, ids, name, max_new_tokens=2, **config)[:, -1:]
    with torch.no_grad():
        for _ in range(12):  # tokens 22 to 33: a page fills
            assert planned.plan_decode(2, 1)
            inputs = {"input_ids": token, "position_ids": None}
            planned.start_planned(inputs)
            assert planned.layers[0].rows.step_plan.mask is not None
            logits = forward(**inputs, cache=planned).logits[:, -1]
            reference = model(input_ids=token, cache=eager).logits[:, -1]
            assert (logits - reference).abs().max() < 1e-5
            token = reference.argmax(-1, keepdim=True)


@pytest.mark.parametrize("name", ["paged_pool", "quantized_values"])
def test_a_compiled_step_that_cannot_compile_flex_attention_gathers(compile_config, in_place_model, monkeypatch, name):
    from hf_kvcache.attention import flex

    ids = random_ids(2, 21)
    if name == "paged_pool":
        reference = generate(tiny_llama(), ids, max_new_tokens=12)
    else:
        reference = generate(in_place_model, ids, name, max_new_tokens=12, cache_config=WINDOW_8)
    monkeypatch.setattr(flex, "MAX_SHAPE_KEYS", 0)  # every in-place shape is past the limit: the op gathers
    monkeypatch.setattr(flex, "KERNELS", flex.CompiledKernels())  # as if no shape were compiled yet in this process
    config = {"cache_config": WINDOW_8} if name == "quantized_values" else {}
    out = generate(in_place_model, ids, name, compile_config, max_new_tokens=12, **config)
    assert torch.equal(out, reference)


def test_a_mask_that_hides_more_than_padding_is_not_read_in_place(in_place_model):
    """A planned step reads in place only under a ``generate`` mask that hides each row's leading padding and nothing
    else (none: all seen), the rule attention applies to an eager step's mask (``mask_hides_padding_only``)."""
    ids = random_ids(2, 21)
    holed = torch.ones(2, 24, dtype=torch.long)
    holed[0, 5] = 0
    cases = ((None, True), (torch.ones(2, 24, dtype=torch.long), True), (holed, False), (torch.ones(2, 25), False))
    for attention_mask, in_place in cases:
        cache = generate(in_place_model, ids, "paged_pool", max_new_tokens=3, return_dict_in_generate=True).cache
        cache.compiled_decoding = True  # as generate sets it when it compiles
        assert cache.get_seq_length() == 23 and cache.plan_decode(2, 1, attention_mask)
        assert (cache.layers[0].rows.step_plan.mask is not None) == in_place


@torch.no_grad()
def test_a_planned_in_place_step_of_a_model_that_hands_no_kwargs_returns_its_pages_gathered(in_place_model):
    """A planned step that reads in place hands attention its plan through the attention's kwargs; a model whose
    attention passes the cache none (GPT-NeoX, Falcon) gets the plan's pages gathered instead: the eager step's
    keys and values, then slots past the rows' tokens up to the capacity (the model's mask hides them)."""
    ids, config = random_ids(2, 21), in_place_model.config
    planned, eager = (
        generate(in_place_model, ids, "paged_pool", max_new_tokens=3, return_dict_in_generate=True).cache
        for _ in range(2)
    )
    planned.compiled_decoding = True
    assert planned.plan_decode(2, 1)
    plan = planned.layers[0].rows.step_plan
    assert plan.mask is not None and plan.num_keys > 24
    states = torch.randn(2, 2, config.num_key_value_heads, 1, config.head_dim)
    keys, values = planned.update(states[0], states[1], 0)  # no kwargs=
    expected = eager.update(states[0], states[1], 0)  # eager, without kwargs: gathered
    for got, want in zip((keys, values), expected, strict=True):
        assert got.shape == (2, config.num_key_value_heads, plan.num_keys, config.head_dim)
        torch.testing.assert_close(got[:, :, :24], want)  # past them: slots the causal mask hides


def gathered_decode_case(device: str, dtype: torch.dtype) -> tuple[tuple, torch.Tensor]:
    """``flex.gathered_decode``'s arguments for two rows of 10 tokens in 3 pages (row 0's first 2 padding), 4 KV heads
    of 3 query heads each, and the attention it must compute: each row over its own tokens, the KV heads repeated."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, queries_per_kv_head, head_dim, page_size, num_pages = 4, 3, 16, 4, 12
    keys, values = torch.randn(2, 1, kv_heads, num_pages * page_size, head_dim, generator=generator).to(device, dtype)
    query = torch.randn(2, kv_heads * queries_per_kv_head, 1, head_dim, generator=generator).to(device, dtype)
    pages = torch.tensor([[[3, 7, 1, 0]], [[5, 2, 9, 0]]], device=device)  # page 0: the null page
    pads, num_tokens = torch.tensor([2, 0], device=device), torch.tensor([10], device=device)
    expected = []
    for row, pad in enumerate([2, 0]):
        slots = torch.cat([torch.arange(page * page_size, (page + 1) * page_size) for page in pages[row, 0, :3]])
        row_keys, row_values = (
            tensor[:, :, slots[pad:10]].repeat_interleave(queries_per_kv_head, 1) for tensor in (keys, values)
        )
        expected.append(torch.nn.functional.scaled_dot_product_attention(query[row : row + 1], row_keys, row_values))
    arguments = (query, keys, values, pages, pads, num_tokens, page_size, None)
    return arguments, torch.cat(expected)


def test_a_gathered_decode_step_reads_each_rows_tokens_with_no_grouped_masked_sdpa_call(monkeypatch):
    """The planned step's fallback (no FlexAttention) packs a KV head's query heads as query rows: sdpa never gets
    ``enable_gqa`` beside a mask, the pair CUDA's fused kernels refuse (torch then runs the math kernel)."""
    from hf_kvcache.attention import flex

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    arguments, expected = gathered_decode_case("cpu", torch.float32)
    torch.testing.assert_close(flex.gathered_decode(*arguments), expected)
    assert calls and not any(call.get("enable_gqa") and call.get("attn_mask") is not None for call in calls)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gathered_decode_step_takes_a_fused_kernel_on_cuda():
    """With the math kernel disabled the fallback still runs (torch raises "No available kernel" otherwise)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_kvcache.attention import flex

    arguments, expected = gathered_decode_case("cuda", torch.bfloat16)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        output = flex.gathered_decode(*arguments)
    torch.testing.assert_close(output, expected, rtol=2e-2, atol=2e-2)
