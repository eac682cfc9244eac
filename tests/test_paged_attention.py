"""In-place paged decode attention (``attention.flex``) against its slow twin (gathered pages) and DynamicCache.

Compiling costs 15-100 s per shape key (batch, the pool's storage, dtype) on a 2-core CPU, so these tests share
few: batches of 3 rows (3 prompts, or 3 beams, or 3 returned sequences of one prompt) on the default pools,
``torch.no_grad`` like ``generate``. ``MIN_IN_PLACE_TOKENS`` is lowered to 0 so the tiny prompts read in place.
"""

import copy
import gc
import logging
import threading

import pytest
import torch
from helpers import assert_same_generation, padded_batch, random_ids, run, teacher_forced_logits
from transformers import DynamicCache

from hf_kvcache import KVPool, PagedCache
from hf_kvcache.attention import block_mask, flex
from hf_kvcache.attention.interface import ATTENTION_NAME, mask_hides_padding_only, model_attention
from hf_kvcache.attention.kernels import read_planned_view
from hf_kvcache.attention.reads import STEP_PLAN
from hf_kvcache.bench.catalogue import with_attention
from hf_kvcache.layers import store as store_module

pytestmark = pytest.mark.skipif(flex.unavailable(torch.device("cpu")) is not None, reason="no compiled FlexAttention")


@pytest.fixture
def in_place(monkeypatch):
    """Every decode step reads in place (no minimum size); counts the compiled in-place attention calls."""
    monkeypatch.setattr(flex, "MIN_IN_PLACE_TOKENS", 0)
    counted = {"calls": 0}
    decode_attention = flex.decode_attention

    def counting(*args, **kwargs):
        counted["calls"] += 1
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(flex, "decode_attention", counting)
    return counted


def paged(model, ids, mask, attention: str, **kwargs):
    """``generate`` through ``paged_pool`` (the default pool unless ``cache_config`` names one) under ``attention``."""
    with model_attention(model, attention):
        return run(model, ids, mask, cache_implementation="paged_pool", **kwargs)


@pytest.mark.parametrize("pool_kind", ["default", "fixed"])
def test_in_place_equals_gathered_and_dynamic_with_padding(tiny_llama_model, in_place, pool_kind):
    """Left-padded rows, on the default pool (reserved once, lazily committed) and on a fixed one."""
    ids, mask = padded_batch([23, 16, 17], seed=1)
    settings = {"max_new_tokens": 20}
    if pool_kind == "fixed":
        settings["cache_config"] = {"pool": KVPool.for_model(tiny_llama_model, max_tokens=2048)}
    reference = run(tiny_llama_model, ids, mask, max_new_tokens=20)
    fast = paged(tiny_llama_model, ids, mask, ATTENTION_NAME, **settings)
    assert in_place["calls"] == 19 * 2  # every decode step of both layers
    gathered = paged(tiny_llama_model, ids, mask, "sdpa", **settings)
    assert in_place["calls"] == 19 * 2
    assert_same_generation(reference, fast)
    assert_same_generation(gathered, fast)


def test_beams_and_returned_sequences_share_pages_in_place(tiny_llama_model, in_place):
    """Three beams, or three sampled sequences of one prompt: rows share pages copy-on-write."""
    ids = random_ids(1, 37, seed=2)
    beams = {"num_beams": 3, "num_return_sequences": 3, "max_new_tokens": 12}
    expected = tiny_llama_model.generate(ids, **beams)
    with model_attention(tiny_llama_model, ATTENTION_NAME):
        actual = tiny_llama_model.generate(ids, cache_implementation="paged_pool", **beams)
    assert torch.equal(expected, actual) and in_place["calls"] > 0
    calls = in_place["calls"]
    sampling = {"do_sample": True, "num_return_sequences": 3, "max_new_tokens": 12}
    torch.manual_seed(5)
    expected = tiny_llama_model.generate(ids, **sampling)
    torch.manual_seed(5)
    with model_attention(tiny_llama_model, ATTENTION_NAME):
        actual = tiny_llama_model.generate(ids, cache_implementation="paged_pool", **sampling)
    assert torch.equal(expected, actual) and in_place["calls"] > calls


@torch.no_grad()
def test_crop_then_decode_in_place_matches_dynamic(tiny_llama_model, in_place):
    """Decode, crop back across a page boundary, decode again (what assisted decoding does)."""
    ids = random_ids(3, 60, seed=3)
    caches = {"dynamic": DynamicCache(config=tiny_llama_model.config), "paged": PagedCache(tiny_llama_model.config)}
    logits = {}
    with model_attention(tiny_llama_model, ATTENTION_NAME):
        for name, cache in caches.items():
            steps = [tiny_llama_model(ids[:, :30], cache=cache).logits]
            steps += [tiny_llama_model(ids[:, t : t + 1], cache=cache).logits for t in range(30, 40)]
            cache.crop(-12)  # back to 28 tokens: the third page goes
            steps += [tiny_llama_model(ids[:, t : t + 1], cache=cache).logits for t in range(28, 45)]
            logits[name] = torch.cat(steps, dim=1)
    assert in_place["calls"] == 27 * 2
    torch.testing.assert_close(logits["paged"], logits["dynamic"], rtol=1e-5, atol=1e-5)


def test_threads_sharing_the_default_pool_read_in_place(tiny_llama_model, in_place):
    """Requests running at once on one pool: their rows' extents interleave in the pool."""
    batches = [padded_batch([9 + 5 * i, 30, 4 + i], seed=10 + i) for i in range(3)]
    expected = [run(tiny_llama_model, ids, mask, max_new_tokens=24) for ids, mask in batches]
    results = {}

    def work(i: int) -> None:
        ids, mask = batches[i]
        results[i] = run(tiny_llama_model, ids, mask, max_new_tokens=24, cache_implementation="paged_pool")

    with model_attention(tiny_llama_model, ATTENTION_NAME):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert in_place["calls"] > 0
    for i in range(len(batches)):
        assert_same_generation(expected[i], results[i])


def test_a_fresh_default_pool_grows_to_keep_rows_in_place(tiny_llama_model, in_place, fresh_default_pools):
    """The default pool opens 4,096 tokens (256 pages) and doubles. Three rows of 2,700 tokens (169 pages, 22
    extents of 8 each) make it double once, to 63 whole extents beside the null page's: too few, so it grows again
    rather than give the last row single pages in the null page's extent, which attention cannot read in place."""
    ids = random_ids(3, 2700, seed=12)
    mask = torch.ones_like(ids)
    reference = run(tiny_llama_model, ids, mask, max_new_tokens=4)
    assert_same_generation(reference, paged(tiny_llama_model, ids, mask, ATTENTION_NAME, max_new_tokens=4))
    assert in_place["calls"] == 3 * 2


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {
            "cache_implementation": "quantized_values",
            "cache_config": {"bits": 4, "group_size": 8, "residual_length": 5},
        },
    ],
    ids=["paged", "quantized-values"],
)
def test_attention_reads_a_view_that_grows_with_the_rows_pages(
    tiny_llama_model, in_place, settings, monkeypatch, fresh_default_pools
):
    """Attention gets the storage's first pages only, a power of two extents holding all the rows' pages
    (``block_mask.view_pages``, here from one extent up): on a fresh default pool three rows of 120 tokens hold extents
    1-3 (a view of 4 extents, 32 pages), cross into extents 4-6 at their 129th token (a view of 8) and read the
    same tokens as gathered, the residual window of quantized values included."""
    monkeypatch.setattr(block_mask, "MIN_VIEW_EXTENTS", 1)
    views = []
    decode_attention = flex.decode_attention

    def recording(query, keys, values, mask, scale):
        views.append((keys.shape[2] // mask.page_size, values.shape[2] // mask.page_size, mask.num_pages))
        return decode_attention(query, keys, values, mask, scale)

    monkeypatch.setattr(flex, "decode_attention", recording)
    ids, mask = padded_batch([120, 111, 104], seed=4)
    settings = {"cache_implementation": "paged_pool", "max_new_tokens": 16, **settings}
    with model_attention(tiny_llama_model, ATTENTION_NAME):
        fast = run(tiny_llama_model, ids, mask, **settings)
    gathered = run(tiny_llama_model, ids, mask, **settings)
    assert_same_generation(gathered, fast)
    assert views == [(32, 32, 32)] * 2 * 8 + [(64, 64, 64)] * 2 * 7  # steps to token 128, then past it
    storage_pages = fast.cache.pool.pages.storage.num_pages
    assert storage_pages > 64


@pytest.mark.parametrize(
    "cache_config",
    [{"bits": 4, "group_size": 8, "residual_length": 5}, {"bits": 8, "residual_length": 0}, {"bits": 4}],
    ids=["int4-residual-5", "int8-no-residual", "int4-default-residual"],
)
@pytest.mark.parametrize("max_runs", [store_module.MAX_RUNS, 0], ids=["by-run", "gathered-extents"])
def test_quantized_values_read_keys_in_place(tiny_llama_model, in_place, cache_config, max_runs, monkeypatch):
    """quantized_values: keys read in place, the visited pages' values dequantized into the storage's layout (run by
    run of consecutive extents, or gathered and scattered), the residual window's tokens written over them in full
    precision; the same numbers as gathering them."""
    monkeypatch.setattr(store_module, "MAX_RUNS", max_runs)
    ids, mask = padded_batch([23, 16, 17], seed=1)
    settings = {"max_new_tokens": 20, "cache_implementation": "quantized_values", "cache_config": cache_config}
    with model_attention(tiny_llama_model, ATTENTION_NAME):
        fast = run(tiny_llama_model, ids, mask, **settings)
    assert in_place["calls"] == 19 * 2
    gathered = run(tiny_llama_model, ids, mask, **settings)
    assert_same_generation(gathered, fast)


def test_hybrid_model_reads_full_layers_in_place(tiny_gemma3_model, in_place):
    """Gemma 3: every layer reads in place, the sliding ones with their window in the block mask."""
    ids, mask = padded_batch([23, 16, 17], seed=4)
    reference = run(tiny_gemma3_model, ids, mask, max_new_tokens=20)
    fast = paged(tiny_gemma3_model, ids, mask, ATTENTION_NAME, max_new_tokens=20)
    assert in_place["calls"] == 19 * 4  # three sliding layers and one full-attention layer
    assert_same_generation(reference, fast)


def test_sliding_model_reads_its_windows_in_place(tiny_mistral_model, in_place):
    """Mistral (a window in every layer): the compiled kernel reads each layer's window where its pages lie, and the
    tokens are DynamicCache's and the gathered path's."""
    ids, mask = padded_batch([23, 16, 17], seed=5)
    reference = run(tiny_mistral_model, ids, mask, max_new_tokens=20)
    fast = paged(tiny_mistral_model, ids, mask, ATTENTION_NAME, max_new_tokens=20)
    assert in_place["calls"] == 19 * 2
    gathered = paged(tiny_mistral_model, ids, mask, "sdpa", max_new_tokens=20)
    assert_same_generation(reference, fast)
    assert_same_generation(gathered, fast)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_reduced_precision_pools_read_in_place_as_exactly_as_gathered(tiny_llama_model, in_place, dtype):
    """bf16/fp16 pools, teacher-forced (greedy tokens may part on rounding): in place is as close to fp32 as the
    gathered path in the same dtype."""
    model = copy.deepcopy(tiny_llama_model).to(dtype)
    ids = random_ids(3, 40, seed=6)
    exact = teacher_forced_logits(tiny_llama_model, ids, DynamicCache(config=tiny_llama_model.config), [28, 1])
    errors = {}
    for attention in (ATTENTION_NAME, "sdpa"):
        with model_attention(model, attention):
            logits = teacher_forced_logits(model, ids, PagedCache(model.config), [28, 1])
        errors[attention] = (logits.float() - exact).abs().max().item()
    assert in_place["calls"] == 12 * 2
    assert errors[ATTENTION_NAME] <= 2 * errors["sdpa"] + 1e-3, errors


def test_smollm2_padded_batch_and_beams_in_place(bundled, in_place):
    """The real model: greedy tokens equal; logits within 1e-4 absolute. The kernel sums in another order than
    sdpa over 30 layers: on this model StaticCache's own logits differ from DynamicCache's by up to 2.8e-5 (in place
    3.1e-5), above the 1e-5 the tiny models hold to."""
    model, tokenizer = bundled
    prompts = ["The capital of France is", "Write a haiku about the sea. The waves", "def fibonacci(n):"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    reference = run(model, batch.input_ids, batch.attention_mask, max_new_tokens=12)
    fast = paged(model, batch.input_ids, batch.attention_mask, ATTENTION_NAME, max_new_tokens=12)
    assert in_place["calls"] == 11 * model.config.num_hidden_layers
    assert torch.equal(reference.sequences, fast.sequences)
    for expected, actual in zip(reference.logits, fast.logits, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)
    one = tokenizer(prompts[:1], return_tensors="pt")
    beams = {"num_beams": 3, "num_return_sequences": 3, "max_new_tokens": 10}
    expected = model.generate(**one, **beams)
    with model_attention(model, ATTENTION_NAME):
        assert torch.equal(expected, model.generate(**one, cache_implementation="paged_pool", **beams))


def test_gathers_with_one_log_line_where_it_cannot_compile(tiny_llama_model, in_place, monkeypatch, caplog):
    """No compiler (or an old torch, no FlexAttention): the gather path, said once on the ``hf_kvcache`` logger."""
    monkeypatch.setattr(flex, "unavailable", lambda device: "torch.compile needs a C++ compiler on the CPU (test)")
    monkeypatch.setattr(flex, "KERNELS", flex.CompiledKernels())  # nothing said yet in this process
    ids, mask = padded_batch([23, 16, 17], seed=1)
    reference = run(tiny_llama_model, ids, mask, max_new_tokens=6)
    with caplog.at_level(logging.INFO, logger="hf_kvcache"):
        for _ in range(2):
            assert_same_generation(reference, paged(tiny_llama_model, ids, mask, ATTENTION_NAME, max_new_tokens=6))
    assert in_place["calls"] == 0
    lines = [record.message for record in caplog.records if "C++ compiler" in record.message]
    assert len(lines) == 1 and "gathers the pages" in lines[0]


def test_mask_check_accepts_only_leading_padding():
    pads = torch.tensor([0, 2])
    seen = torch.arange(5) >= pads.view(-1, 1)  # [2, 5]
    assert mask_hides_padding_only(seen[:, None, None, :], pads, 5)
    additive = torch.zeros(2, 1, 1, 5).masked_fill(~seen[:, None, None, :], -1e9)
    assert mask_hides_padding_only(additive, pads, 5)
    holed = seen.clone()
    holed[0, 3] = False
    assert not mask_hides_padding_only(holed[:, None, None, :], pads, 5)
    assert not mask_hides_padding_only(seen[:, None, None, :4], pads, 5)
    assert mask_hides_padding_only(None, torch.zeros(2, dtype=torch.long), 5)
    assert not mask_hides_padding_only(None, pads, 5)


def test_gathers_past_the_shape_key_limit(tiny_llama_model, in_place, monkeypatch, caplog):
    """A shape past ``MAX_SHAPE_KEYS`` is not compiled: that step's attention gathers the same keys instead."""
    monkeypatch.setattr(flex, "MAX_SHAPE_KEYS", 0)
    monkeypatch.setattr(flex, "KERNELS", flex.CompiledKernels())  # as if nothing were compiled or said yet
    ids, mask = padded_batch([11, 7], seed=9)
    reference = run(tiny_llama_model, ids, mask, max_new_tokens=6)
    with caplog.at_level(logging.INFO, logger="hf_kvcache"):
        assert_same_generation(reference, paged(tiny_llama_model, ids, mask, ATTENTION_NAME, max_new_tokens=6))
    assert in_place["calls"] == 5 * 2  # tried, and gathered
    said = [record for record in caplog.records if "hf_kvcache.attention.flex.MAX_SHAPE_KEYS" in record.message]
    assert [record.levelno for record in said] == [logging.WARNING]  # once, not silently, with the knob


def test_reused_prefix_reads_in_place_as_without_reuse(tiny_llama_model, in_place):
    """A second turn on a prefix-caching pool: the rows start from pages an earlier call published (shared, in
    another request's extents); decode gathers while those extents hold another live cache's pages and reads in
    place once they hold nothing foreign, with the tokens and logits of a call without reuse (within 1e-4)."""
    indexed = KVPool.for_model(tiny_llama_model, max_tokens=2048, prefix_caching=True)
    plain = KVPool.for_model(tiny_llama_model, max_tokens=2048)

    def paged_on(pool: KVPool, ids: torch.Tensor, max_new_tokens: int = 8):
        return run(
            tiny_llama_model,
            ids,
            None,
            max_new_tokens=max_new_tokens,
            cache_implementation="paged_pool",
            cache_config={"pool": pool},
        )

    with model_attention(tiny_llama_model, ATTENTION_NAME):
        turn = paged_on(indexed, random_ids(3, 40, seed=21), max_new_tokens=6)  # its cache stays alive in `turn`
        second = torch.cat([turn.sequences, random_ids(3, 7, seed=22)], dim=1)  # [3, 53]
        reference = paged_on(plain, second)
        calls = in_place["calls"]
        live = paged_on(indexed, second)
        assert indexed.stats()["prefix_tokens_reused"] == 3 * 32  # turn 1's two full pages (45 tokens fed)
        assert in_place["calls"] == calls  # turn 1's cache holds the page after the prefix's: gathered
        indexed.check_integrity()
        del turn  # the caches' pages go to the index (full ones) or back to the free pages, zeroed
        live = (live.sequences, live.logits)  # without the output's cache
        gc.collect()
        calls = in_place["calls"]
        reused = paged_on(indexed, second)
    assert indexed.stats()["prefix_tokens_reused"] == 3 * 32 + 3 * 48  # now all but the prompt's last page
    assert in_place["calls"] > calls
    for sequences, logits in (live, (reused.sequences, reused.logits)):
        assert torch.equal(sequences, reference.sequences)
        for step, (expected, actual) in enumerate(zip(reference.logits, logits, strict=True)):
            torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, msg=f"logits differ at step {step}")
    del reused
    gc.collect()
    indexed.check_integrity()
    assert indexed.stats()["pages_used"] == indexed.stats()["pages_cached"]


@torch.no_grad()
def test_an_in_place_read_is_handed_to_attention_in_its_kwargs_and_only_there(tiny_llama_model, in_place):
    """transformers hands the attention's kwargs to ``cache.update`` (``kwargs=``): an in-place step puts its
    plan there and returns the pool's storage, with nothing set on the tensors; called without them (a model
    that passes none), the same step returns its keys and values gathered."""
    config = with_attention(tiny_llama_model.config, ATTENTION_NAME)
    heads, head_dim = config.num_key_value_heads, config.head_dim
    states = torch.randn(2, 2, heads, 41, head_dim)  # keys, values: [batch, heads, 41, head_dim]
    for handed in (True, False):
        cache = PagedCache(config, {"pool": KVPool.for_model(tiny_llama_model, max_tokens=1024)})
        cache.update(states[0, :, :, :40], states[1, :, :, :40], 0)  # a prefill of two rows
        kwargs = {"scaling": 0.125}
        handoff = {"kwargs": kwargs} if handed else {}  # what transformers' attention passes (Llama: kwargs=kwargs)
        keys, values = cache.update(states[0, :, :, 40:], states[1, :, :, 40:], 0, **handoff)
        assert not vars(keys) and not vars(values)  # no attribute on the tensors
        if handed:
            plan = kwargs.pop(STEP_PLAN)
            assert keys.shape[0] == 1 and plan.num_keys == 41 and kwargs == {"scaling": 0.125}
            assert plan.mask.batch == 2
            # What attention reads where it cannot read in place after all: the plan's pages, gathered
            torch.testing.assert_close(read_planned_view(keys, plan), states[0])
            torch.testing.assert_close(read_planned_view(values, plan), states[1])
        else:
            assert cache.read_counts() == {"gather": 2, "run": 0, "in place": 0}
            torch.testing.assert_close(keys, states[0])
            torch.testing.assert_close(values, states[1])
