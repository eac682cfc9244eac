"""PagedCache against DynamicCache through ``generate``: same tokens, same logits, shared pages."""

import gc

import pytest
import torch
from helpers import assert_beams_and_sampling_match, assert_same_generation, padded_batch, random_ids, run
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import hf_kvcache  # noqa: F401  (registers "paged_pool")
from hf_kvcache import KVPool, PagedCache, PagedConfig, PoolExhaustedError
from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import ATTENTION_NAME, model_attention
from hf_kvcache.bench.catalogue import interleaved_extents, with_attention
from hf_kvcache.layers import PagedRows
from hf_kvcache.layers.paged import PagedLayer
from hf_kvcache.testing import tiny_llama

MODELS = ["tiny_llama_model", "tiny_mistral_model", "tiny_gemma3_model"]


class RecordPages(LogitsProcessor):
    """Records the pool's used pages each time logits are produced (after prefill, then after each step)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool, self.pages_used = pool, []

    def __call__(self, input_ids, scores):
        self.pages_used.append(self.pool.stats()["pages_used"])
        return scores


def pages_used_by_step(model, seed: int, max_tokens: int, **generate_kwargs) -> list[int]:
    """Pages in use after the prefill and after each step of ``paged_pool`` generating from one 40-token prompt on a
    fresh pool; checks that every page is back once the cache is gone."""
    pool = KVPool.for_model(model, max_tokens=max_tokens)
    recorder = RecordPages(pool)
    model.generate(
        random_ids(1, 40, seed=seed),
        cache_implementation="paged_pool",
        cache_config={"pool": pool},
        logits_processor=LogitsProcessorList([recorder]),
        **generate_kwargs,
    )
    gc.collect()
    assert pool.stats()["pages_used"] == 0
    return recorder.pages_used


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("lengths,new_tokens", [([5, 3], 2), ([8, 7, 1], 1), ([9, 4], 16), ([23, 16, 17], 30)])
def test_greedy_matches_dynamic_cache(model_name, lengths, new_tokens, request):
    """Lengths end before, at, one past and far beyond the window (8) and page (16) boundaries."""
    model = request.getfixturevalue(model_name)
    ids, mask = padded_batch(lengths)
    reference = run(model, ids, mask, max_new_tokens=new_tokens)
    paged = run(model, ids, mask, max_new_tokens=new_tokens, cache_implementation="paged_pool")
    assert isinstance(paged.cache, PagedCache) and isinstance(reference.cache, DynamicCache)
    assert_same_generation(reference, paged)
    assert paged.cache.get_seq_length() == reference.cache.get_seq_length()


@pytest.mark.parametrize("model_name", MODELS)
def test_beam_search_and_sampling_match(model_name, request):
    model = request.getfixturevalue(model_name)
    ids, mask = padded_batch([12, 20])
    assert_beams_and_sampling_match(model, ids, mask, "paged_pool", max_new_tokens=12, num_return_sequences=4, seed=7)


def test_identical_rows_share_prompt_pages(tiny_llama_model):
    """num_return_sequences=4 expands one 40-token prompt into 4 identical rows before prefill."""
    pages_used = pages_used_by_step(
        tiny_llama_model, seed=1, max_tokens=1024, do_sample=True, num_return_sequences=4, max_new_tokens=3
    )
    # Prefill: 40 tokens = 2 full pages + 1 partial page, stored once for the 4 rows.
    # Step 1 writes into the shared partial page: 3 rows copy it, the 4th keeps the original.
    # The full pages stay shared.
    assert pages_used[:2] == [3, 3 + 3]


def test_beam_search_shares_pages(tiny_llama_model):
    pages_used = pages_used_by_step(tiny_llama_model, seed=2, max_tokens=2048, num_beams=4, max_new_tokens=20)
    assert pages_used[0] == 3  # the prompt once, not 4 times
    # Beams copy only the page they write into: never more than 2 full prompt pages + 1 partial page per beam,
    # plus the pages the beams grew.
    assert max(pages_used) < 4 * 5


def test_shared_pages_are_copied_before_write():
    """Direct use: a row writing into a shared page must not change the other row's view."""
    model = tiny_llama()
    cache = PagedCache(model.config, {"max_tokens": 256, "page_size": 4})
    keys = torch.randn(1, 2, 6, 16).expand(3, -1, -1, -1).contiguous()  # 3 identical rows
    for layer_idx in range(2):
        cache.update(keys, keys + 1, layer_idx)
    assert cache.pool.stats()["pages_used"] == 2
    new = torch.randn(3, 2, 1, 16)
    for layer_idx in range(2):
        out_keys, out_values = cache.update(new, new + 1, layer_idx)
        torch.testing.assert_close(out_keys, torch.cat([keys, new], dim=2), rtol=0, atol=0)
        torch.testing.assert_close(out_values, torch.cat([keys, new], dim=2) + 1, rtol=0, atol=0)
    assert cache.pool.stats()["pages_used"] == 1 + 3  # the full page shared, one partial page per row
    cache.pool.check_integrity()


def test_rows_that_differ_in_a_later_layer_get_private_pages():
    model = tiny_llama()
    cache = PagedCache(model.config, {"max_tokens": 256, "page_size": 4})
    same = torch.randn(2, 2, 6, 16)
    same[1] = same[0]
    cache.update(same, same, 0)  # layer 0: identical rows, stored once
    different = torch.randn(2, 2, 6, 16)
    out_keys, _ = cache.update(different, different, 1)  # layer 1: rows differ
    torch.testing.assert_close(out_keys, different, rtol=0, atol=0)
    rows = cache.layers[0].rows
    keys0, _ = rows.gather(0, rows.step_plan)  # layer 0 read again with the step's plan, made after the split
    torch.testing.assert_close(keys0, same, rtol=0, atol=0)
    cache.pool.check_integrity()


@pytest.mark.parametrize(
    "model_name, name, cache_config, groups",
    [
        ("tiny_llama_model", "paged_pool", {}, 1),
        ("tiny_llama_model", "sliding_ring", {"window": 8}, 1),
        ("tiny_llama_model", "quantized_kv", {"key_bits": 4, "value_bits": 4}, 1),
        ("tiny_gemma3_model", "paged_pool", {}, 4),  # 3 sliding layers and 1 full: 4 layer groups of 1 (layer_groups)
    ],
    ids=["paged_pool", "sliding_ring", "quantized_kv", "gemma3"],
)
def test_each_eager_step_is_planned_once_per_layer_group(model_name, name, cache_config, groups, request, monkeypatch):
    """One plan per forward pass and layer group, which the layers execute: generate's decode steps are planned
    before the forward pass (``PagedRows.plan_eager_step``), the prefill by the group's first layer
    (``PagedRows.plan_step``)."""
    model = request.getfixturevalue(model_name)
    plans, ahead = [], []
    make_ahead = PagedRows.plan_eager_step
    monkeypatch.setattr(PagedRows, "plan_eager_step", lambda self, *args: ahead.append(args) or make_ahead(self, *args))
    make = PagedRows._plan_eager  # windows' too (WindowRows plans its span and gathers through hooks)

    def counted(self, start, num_new, hands_over):
        plans.append((start, num_new))
        return make(self, start, num_new, hands_over)

    monkeypatch.setattr(PagedRows, "_plan_eager", counted)
    ids, mask = padded_batch([19, 6], seed=3)
    settings = {"max_new_tokens": 4, "cache_config": cache_config}
    out = run(model, ids, mask, cache_implementation=name, **settings)
    assert len(plans) == 4 * groups, plans  # the prefill and three decode steps
    assert sorted(set(plans)) == [(0, 19), (19, 1), (20, 1), (21, 1)]
    assert sorted(set(ahead)) == [(19, 2), (20, 2), (21, 2)] and len(ahead) == 3 * groups  # (start, rows)
    if name == "paged_pool":  # lossless (the ring imposes its window on Llama; the codes are lossy)
        assert_same_generation(run(model, ids, mask, max_new_tokens=4), out)


def test_row_operations_match_dynamic_cache(tiny_llama_model):
    config = tiny_llama_model.config
    paged, dynamic = PagedCache(config, {"max_tokens": 512, "page_size": 4}), DynamicCache(config=config)
    generator = torch.Generator().manual_seed(3)

    def step(num_tokens: int, batch: int) -> None:
        for layer_idx in range(2):
            keys = torch.randn(batch, 2, num_tokens, 16, generator=generator)
            values = torch.randn(batch, 2, num_tokens, 16, generator=generator)
            expected = dynamic.update(keys, values, layer_idx)
            actual = paged.update(keys, values, layer_idx)
            for a, e in zip(actual, expected, strict=True):
                torch.testing.assert_close(a, e, rtol=0, atol=0)
        paged.pool.check_integrity()

    step(7, 2)
    for cache in (paged, dynamic):
        cache.batch_repeat_interleave(3)
    step(1, 6)
    beam_idx = torch.tensor([5, 5, 0, 1, 2, 2])
    for cache in (paged, dynamic):
        cache.reorder_cache(beam_idx)
    step(2, 6)
    for cache in (paged, dynamic):
        cache.crop(-5)
    assert paged.get_seq_length() == dynamic.get_seq_length() == 5
    step(3, 6)
    for cache in (paged, dynamic):
        cache.batch_select_indices(torch.tensor([4, 0, 2]))
    step(9, 3)
    keep = torch.tensor([True, False, True])
    paged.batch_select_indices(keep)
    dynamic.batch_select_indices(keep.nonzero().flatten())
    step(1, 2)
    pool = paged.pool
    paged.reset()
    assert pool.stats()["pages_used"] == 0 and paged.get_seq_length() == 0
    with pytest.raises(ValueError, match="negative number"):
        paged.crop(3)


def test_assisted_decoding_crops_like_dynamic(tiny_llama_model):
    assistant = tiny_llama(seed=1)
    ids, mask = padded_batch([10])
    expected = tiny_llama_model.generate(ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=20)
    actual = tiny_llama_model.generate(
        ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=20, cache_implementation="paged_pool"
    )
    assert torch.equal(expected, actual)


def test_request_larger_than_pool_fails_alone(tiny_llama_model):
    pool = KVPool.for_model(tiny_llama_model, PagedConfig(page_size=16), max_tokens=160)  # 10 pages
    ids, mask = padded_batch([20, 30], seed=5)
    alone = run(tiny_llama_model, ids, mask, max_new_tokens=10)

    # Sequence A holds 2 rows x 3 pages, then request B (4 rows x 4 pages) does not fit.
    cache_a = PagedCache(tiny_llama_model.config, {"pool": pool})
    first = run(tiny_llama_model, ids, mask, max_new_tokens=5, cache=cache_a)
    held = pool.stats()["pages_used"]
    big, big_mask = padded_batch([60, 50, 40, 55], seed=6)
    with pytest.raises(
        PoolExhaustedError, match=r"needs 16 pages, more than the pool's 10 pages in all.*max_tokens"
    ) as error:
        tiny_llama_model.generate(
            big,
            attention_mask=big_mask,
            max_new_tokens=5,
            cache_implementation="paged_pool",
            cache_config={"pool": pool},
        )
    assert error.value.total_pages == 10 and error.value.exceeds_pool
    del error
    gc.collect()
    assert pool.stats()["pages_used"] == held
    pool.check_integrity()

    # A continues where it stopped and ends exactly as when it ran alone.
    rest = tiny_llama_model.generate(
        first.sequences,
        attention_mask=torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1),
        max_new_tokens=5,
        do_sample=False,
        cache=cache_a,
    )
    assert torch.equal(rest, alone.sequences)


def test_pool_returns_to_zero_after_many_generate_calls(tiny_gemma3_model):
    pool = KVPool.for_model(tiny_gemma3_model, max_tokens=4096, name="many-calls")
    for seed in range(12):
        lengths = [3 + seed, 1 + 2 * seed][: 1 + seed % 2]
        ids, mask = padded_batch(lengths, seed=seed)
        tiny_gemma3_model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4 + seed,
            num_beams=1 + seed % 3,
            do_sample=False,
            cache_implementation="paged_pool",
            cache_config={"pool": "many-calls"},
        )
    gc.collect()
    stats = pool.stats()
    assert stats["pages_used"] == 0 and stats["high_water_pages"] > 0
    pool.check_integrity()


def test_generate_grows_a_small_pool(tiny_llama_model):
    """A growable pool starting at 3 pages opens more several times, in the storage it made for its cap; reads and
    writes stay exact."""
    page_format = hf_kvcache.PageFormat.from_model_config(tiny_llama_model.config, torch.float32, page_size=4)
    pool = KVPool(page_format, num_pages=3, max_pages=200)
    storage = pool.pages.storage
    ids, mask = padded_batch([13, 6, 9], seed=8)
    reference = run(tiny_llama_model, ids, mask, max_new_tokens=25)
    paged = run(
        tiny_llama_model, ids, mask, max_new_tokens=25, cache_implementation="paged_pool", cache_config={"pool": pool}
    )
    assert pool.stats()["high_water_pages"] > 8 and pool.pages.storage is storage  # grew at least twice, unmoved
    assert_same_generation(reference, paged)


def test_smollm2_batch_beam_and_sampling_match(bundled):
    model, tokenizer = bundled
    prompts = [
        "The capital of France is",
        "Write a haiku about the sea. The waves",
        "In 1905, Albert Einstein published four papers that",
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    reference = run(model, batch.input_ids, batch.attention_mask, max_new_tokens=16)
    paged = run(model, batch.input_ids, batch.attention_mask, max_new_tokens=16, cache_implementation="paged_pool")
    assert_same_generation(reference, paged)
    assert_beams_and_sampling_match(
        model, batch.input_ids, batch.attention_mask, "paged_pool", max_new_tokens=8, num_return_sequences=4, seed=11
    )


@pytest.mark.parametrize(
    "cache_implementation, cache_config",
    [
        ("paged_pool", {}),
        ("quantized_values", {"bits": 4, "group_size": 8, "residual_length": 5}),
        ("quantized_values", {"bits": 8, "residual_length": 0}),
    ],
    ids=["paged", "int4-residual-5", "int8-no-residual"],
)
def test_a_single_row_is_read_as_a_view_of_its_run_of_pages(tiny_llama_model, cache_implementation, cache_config):
    """One row on a fresh pool lies on consecutive pages: under ``hf_kvcache`` attention reads a view of them (the
    prompt and every decode step, nothing compiled), with the same tokens and logits as gathering them (sdpa), and
    as DynamicCache where nothing is quantized."""
    ids = random_ids(1, 40, seed=7)
    mask = torch.ones_like(ids)
    settings = {"max_new_tokens": 20, "cache_implementation": cache_implementation, "cache_config": cache_config}
    gathered = run(tiny_llama_model, ids, mask, **settings)
    calls = flex.call_count()
    with model_attention(tiny_llama_model, ATTENTION_NAME):
        viewed = run(tiny_llama_model, ids, mask, **settings)
    # each cache counts its own reads: the prompt and 19 decode steps, in both layers
    assert gathered.cache.read_counts() == {"gather": 20 * 2, "run": 0, "in place": 0}
    assert viewed.cache.read_counts() == {"gather": 0, "run": 20 * 2, "in place": 0}
    assert flex.call_count() == calls
    assert_same_generation(gathered, viewed)
    if cache_implementation == "paged_pool":
        assert_same_generation(run(tiny_llama_model, ids, mask, max_new_tokens=20), viewed)


@torch.no_grad()
def test_the_view_is_the_pools_storage(tiny_llama_model):
    """What attention gets for a run is the pool's memory itself (written there, not copied out), token by token."""
    config = with_attention(tiny_llama_model.config, ATTENTION_NAME)
    pool = KVPool.for_model(tiny_llama_model, max_tokens=256)
    cache = PagedCache(config, {"pool": pool})
    states = torch.randn(2, 1, config.num_key_value_heads, 37, config.head_dim)  # keys, values: [1, heads, 37, dim]
    keys, values = cache.update(states[0], states[1], 0)
    assert torch.equal(keys, states[0]) and torch.equal(values, states[1])
    memory = pool.pages.storage.keys.untyped_storage()
    start, end = memory.data_ptr(), memory.data_ptr() + memory.nbytes()
    assert start <= keys.data_ptr() < end  # a view: the next write shows through it
    pool.pages.storage.keys.zero_()
    assert not keys.any()


def test_a_row_off_consecutive_pages_is_gathered(tiny_llama_model):
    """Another request holds every other extent of the pool, so a 200-token row's pages skip ids: not one run, so
    attention gathers them (short of ``flex.MIN_IN_PLACE_TOKENS``); the tokens are DynamicCache's."""
    ids = random_ids(1, 180, seed=8)
    mask = torch.ones_like(ids)
    pool = KVPool.for_model(tiny_llama_model, max_tokens=2048)
    with interleaved_extents(pool, 4), model_attention(tiny_llama_model, ATTENTION_NAME):
        paged = run(
            tiny_llama_model,
            ids,
            mask,
            max_new_tokens=20,
            cache_implementation="paged_pool",
            cache_config={"pool": pool},
        )
    assert paged.cache.read_counts() == {"gather": 20 * 2, "run": 0, "in place": 0}
    assert_same_generation(run(tiny_llama_model, ids, mask, max_new_tokens=20), paged)


# Padded rows hold no page of padding alone (``PageTable.skips``): rows of 3, 70 and 37 tokens left-padded to 70 hold
# 67 and 33 tokens of padding, 4 and 2 whole pages of 16 the rows do not take.
PADDED_LENGTHS, NEW_TOKENS = [3, 70, 37], 20


def expected_pages(lengths: list[int], num_new: int, page_size: int = 16) -> int:
    """Pages the rows of a left-padded batch hold after ``num_new`` tokens each: from the page of a row's first token
    to the page of its last written one (``generate`` never writes the last token it samples)."""
    end = max(lengths) + num_new - 1
    return sum(-(-end // page_size) - (max(lengths) - length) // page_size for length in lengths)


@pytest.mark.parametrize("attention", ["sdpa", ATTENTION_NAME])
@pytest.mark.parametrize("model_name", MODELS)
def test_a_padded_batch_holds_no_page_of_padding(model_name, attention, request):
    """The tokens are DynamicCache's, eager and through every read (gathered, in place), while the pool holds only the
    pages from each row's first token on: nearly every slot held is a token's."""
    model = request.getfixturevalue(model_name)
    ids, mask = padded_batch(PADDED_LENGTHS, seed=3)
    reference = run(model, ids, mask, max_new_tokens=NEW_TOKENS)
    pool = KVPool.for_model(model, max_tokens=4096)
    with model_attention(model, attention):
        paged = run(
            model, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation="paged_pool", cache_config={"pool": pool}
        )
    assert_same_generation(reference, paged)
    if all(type(layer) is PagedLayer for layer in paged.cache.layers):  # Mistral, Gemma 3: rings (their own pages)
        stats = pool.stats()
        assert stats["pages_used"] == expected_pages(PADDED_LENGTHS, NEW_TOKENS)
        assert stats["tokens_held"] == sum(length + NEW_TOKENS - 1 for length in PADDED_LENGTHS)
        assert stats["utilization"] > 0.75  # 224 of 288 slots: a row's last page and the padding in its first


def test_a_padded_batch_holds_no_page_of_padding_in_place_and_compiled(tiny_llama_model, compile_config, monkeypatch):
    """In place (every row's pages read through the block mask, rows holding no page of padding) and compiled (the
    planned step reads the null page for them): DynamicCache's tokens."""
    ids, mask = padded_batch([5, 150, 90, 40], seed=4)
    reference = run(tiny_llama_model, ids, mask, max_new_tokens=12)
    pool = KVPool.for_model(tiny_llama_model, max_tokens=4096)
    settings = {"max_new_tokens": 12, "cache_implementation": "paged_pool", "cache_config": {"pool": pool}}
    calls = flex.call_count()
    monkeypatch.setattr(flex, "MIN_IN_PLACE_TOKENS", 0)
    with model_attention(tiny_llama_model, ATTENTION_NAME):
        in_place = run(tiny_llama_model, ids, mask, **settings)
        assert flex.call_count() > calls
        assert in_place.cache.read_counts()["in place"] > 0
    assert_same_generation(reference, in_place)
    assert pool.stats()["pages_used"] == expected_pages([5, 150, 90, 40], 12)
    compiled = run(tiny_llama_model, ids, mask, compile_config=compile_config, **settings)
    assert_same_generation(reference, compiled)
