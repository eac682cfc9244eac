"""SlidingRingCache and ring layers: exact where the model defines the window, exact against a banded
mask where the ring imposes it, bounded memory, attention sinks, row operations and crop."""

import contextlib
import copy
import math
import warnings

import pytest
import torch
from helpers import (
    assert_beams_and_sampling_match,
    assert_same_generation,
    padded_batch,
    random_ids,
    run,
    teacher_forced_logits,
)
from transformers import DynamicCache

import hf_kvcache  # noqa: F401  (registers "sliding_ring")
from hf_kvcache import KVPool, PagedCache, SlidingRingCache
from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import ATTENTION_NAME, banded_sdpa_attention, model_attention
from hf_kvcache.attention.reads import KEY_LAYOUT, STEP_PLAN, KeyLayout
from hf_kvcache.bench.catalogue import ring_pool, with_attention
from hf_kvcache.layers import PagedLayer, WindowLayer
from hf_kvcache.layers.window import window_pages_per_row
from hf_kvcache.memory.format import PAGED_LAYER_TYPES, layer_groups, layer_types

SLIDING_MODELS = ["tiny_mistral_model", "tiny_gemma3_model"]  # window 8
IN_PLACE = pytest.mark.skipif(flex.unavailable(torch.device("cpu")) is not None, reason="no compiled FlexAttention")


def read_path(patch: pytest.MonkeyPatch, path: str) -> None:
    """Decode steps of the tiny models read in place (``"in place"``: however few their tokens) or gather."""
    patch.setattr(flex, "MIN_IN_PLACE_TOKENS", 0 if path == "in place" else 1 << 40)


def banded_logits(model, ids: torch.Tensor, window: int, sink_tokens: int = 0) -> torch.Tensor:
    """The model over the whole sequence with a banded causal mask: each query sees its last ``window`` tokens
    (itself included) and the first ``sink_tokens`` ones."""
    positions = torch.arange(ids.shape[1])
    query, key = positions[:, None], positions[None, :]
    allowed = (key <= query) & ((key > query - window) | (key < sink_tokens))  # [seq, seq]
    return model(ids, attention_mask=allowed.expand(ids.shape[0], 1, -1, -1)).logits


@pytest.mark.parametrize("model_name", SLIDING_MODELS)
@pytest.mark.parametrize("lengths,new_tokens", [([5, 3], 2), ([8, 7, 1], 1), ([9, 4], 16), ([23, 16, 17], 40)])
@pytest.mark.parametrize("name", ["sliding_ring", "paged_pool"])
def test_model_window_matches_dynamic_cache(model_name, lengths, new_tokens, name, request):
    """Sequences end before, at, one past and far beyond the window (8), with left padding."""
    model = request.getfixturevalue(model_name)
    ids, mask = padded_batch(lengths)
    reference = run(model, ids, mask, max_new_tokens=new_tokens)
    ring = run(model, ids, mask, max_new_tokens=new_tokens, cache_implementation=name)
    assert_same_generation(reference, ring)
    sliding = [layer for layer, slides in zip(ring.cache.layers, ring.cache.is_sliding) if slides]
    assert sliding and all(isinstance(layer, WindowLayer) for layer in sliding)


@pytest.mark.parametrize("model_name", SLIDING_MODELS)
@pytest.mark.parametrize("chunks", [[60], [5, 3, 1, 20, 31], [7, 9], [1]])
def test_chunked_prefill_matches_dynamic_cache(model_name, chunks, request):
    """Chunks shorter and longer than the window and than the ring (chunk 31 > what fits before a read)."""
    model = request.getfixturevalue(model_name)
    ids = random_ids(2, 60)
    expected = teacher_forced_logits(model, ids, DynamicCache(config=model.config), chunks)
    actual = teacher_forced_logits(model, ids, SlidingRingCache(model.config), chunks)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def banded_attention(model):
    """The model with ``attn_implementation="hf_kvcache"``, which applies the ring's band within a step."""
    return model_attention(model, ATTENTION_NAME)


@pytest.mark.parametrize("window,sink_tokens,prompt", [(8, 0, 5), (8, 0, 8), (16, 0, 1), (8, 2, 6), (20, 4, 20)])
def test_imposed_window_equals_banded_attention(tiny_llama_model, window, sink_tokens, prompt):
    """A full-attention model through the ring sees exactly the last ``window`` tokens (plus the sinks)."""
    ids = random_ids(2, 70, seed=window + sink_tokens)
    cache = SlidingRingCache(tiny_llama_model.config, {"window": window, "sink_tokens": sink_tokens})
    actual = teacher_forced_logits(tiny_llama_model, ids, cache, [prompt, 1])
    torch.testing.assert_close(actual, banded_logits(tiny_llama_model, ids, window, sink_tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,sink_tokens", [(8, 0), (8, 2), (20, 4)])
@pytest.mark.parametrize("chunks", [[70], [9, 1], [5, 3, 1, 20, 31], [24, 7]])
def test_imposed_window_prefill_past_the_window_equals_banded_attention(tiny_llama_model, window, sink_tokens, chunks):
    """Prompts and prefill chunks reaching far past the window (and past the ring) keep to the band too."""
    ids = random_ids(2, 70, seed=window + sink_tokens)
    cache = SlidingRingCache(tiny_llama_model.config, {"window": window, "sink_tokens": sink_tokens})
    with banded_attention(tiny_llama_model):
        actual = teacher_forced_logits(tiny_llama_model, ids, cache, chunks)
    torch.testing.assert_close(actual, banded_logits(tiny_llama_model, ids, window, sink_tokens), rtol=1e-5, atol=1e-5)


def test_prefill_past_an_imposed_window_without_banded_attention_warns(tiny_llama_model):
    ids = random_ids(1, 20)
    cache = SlidingRingCache(tiny_llama_model.config, {"window": 8})
    with pytest.warns(UserWarning, match='A step of 20 tokens reaches past the cache.s window=8.*"hf_kvcache"'):
        tiny_llama_model(ids, cache=cache)
    with warnings.catch_warnings():  # once per cache; and never where the band is applied
        warnings.simplefilter("error")
        tiny_llama_model(ids[:, :4], cache=cache)
        with banded_attention(tiny_llama_model):
            tiny_llama_model(ids, cache=SlidingRingCache(tiny_llama_model.config, {"window": 8}))


def test_banded_attention_without_a_band_is_sdpa(tiny_llama_model):
    """Keys that carry no band (every cache but a ring's multi-token steps) are attended exactly as by sdpa."""
    ids, mask = padded_batch([12, 5])
    expected = run(tiny_llama_model, ids, mask, max_new_tokens=6)
    with banded_attention(tiny_llama_model):
        actual = run(tiny_llama_model, ids, mask, max_new_tokens=6)
        paged = run(tiny_llama_model, ids, mask, max_new_tokens=6, cache_implementation="paged_pool")
    assert_same_generation(expected, actual)
    assert_same_generation(expected, paged)


@IN_PLACE
@pytest.mark.parametrize("window,sink_tokens", [(8, 0), (8, 3), (20, 4)])
@pytest.mark.parametrize("chunks", [[1], [9, 1], [5, 3, 1, 20, 1]])
def test_pages_read_in_place_equal_pages_gathered(tiny_llama_model, window, sink_tokens, chunks):
    """The fast path (FlexAttention over the pages where they lie, the window in its mask) against its slow twin
    (gathered in time order)."""
    ids = random_ids(2, 60, seed=window + sink_tokens)
    settings = {"window": window, "sink_tokens": sink_tokens}
    with banded_attention(tiny_llama_model), pytest.MonkeyPatch.context() as patch:
        read_path(patch, "in place")
        cache = SlidingRingCache(tiny_llama_model.config, settings)
        in_place = teacher_forced_logits(tiny_llama_model, ids, cache, chunks)
        assert cache.read_counts()["in place"] > 0
        read_path(patch, "gathered")
        cache = SlidingRingCache(tiny_llama_model.config, settings)
        gathered = teacher_forced_logits(tiny_llama_model, ids, cache, chunks)
        assert cache.read_counts()["in place"] == 0
    torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        in_place, banded_logits(tiny_llama_model, ids, window, sink_tokens), rtol=1e-5, atol=1e-5
    )


@IN_PLACE
@pytest.mark.parametrize("model_name", SLIDING_MODELS)
@pytest.mark.parametrize("lengths,new_tokens", [([5, 3], 2), ([9, 4], 16), ([23, 16, 17], 40)])
@pytest.mark.parametrize("name", ["sliding_ring", "paged_pool"])
def test_pages_read_in_place_match_dynamic_cache_with_padding(model_name, lengths, new_tokens, name, request):
    """The model's own sliding mask and left padding, applied in place by the block mask's window."""
    model = request.getfixturevalue(model_name)
    ids, mask = padded_batch(lengths)
    reference = run(model, ids, mask, max_new_tokens=new_tokens)
    with banded_attention(model), pytest.MonkeyPatch.context() as patch:
        read_path(patch, "in place")
        ring = run(model, ids, mask, max_new_tokens=new_tokens, cache_implementation=name)
    assert ring.past_key_values.read_counts()["in place"] > 0
    assert_same_generation(reference, ring)


@IN_PLACE
def test_generate_reads_window_pages_in_place(tiny_llama_model):
    """Short prompts in a batch, past the window: every decode step reads in place, the prefill gathers."""
    ids, mask = padded_batch([5, 3, 9])
    settings = {"max_new_tokens": 40, "cache_implementation": "sliding_ring", "cache_config": {"window": 20}}
    with banded_attention(tiny_llama_model), pytest.MonkeyPatch.context() as patch:
        read_path(patch, "in place")
        fast = run(tiny_llama_model, ids, mask, **settings)
        assert fast.cache.read_counts() == {"gather": 2, "run": 0, "in place": 39 * 2}  # both layers
        read_path(patch, "gathered")
        slow = run(tiny_llama_model, ids, mask, **settings)
        assert slow.cache.read_counts() == {"gather": 40 * 2, "run": 0, "in place": 0}
    assert_same_generation(slow, fast)


@IN_PLACE
def test_windows_read_in_place_on_a_pool_they_fill(tiny_llama_model, monkeypatch):
    """A pool sized for the rows' windows alone: they take pages in the first extent too, beside the null page (which
    holds what padding and holes write: finite, hidden by the block mask), and still read in place."""
    read_path(monkeypatch, "in place")
    pool = ring_pool(tiny_llama_model.config, 64, 8, 16, torch.float32, torch.device("cpu"))
    cache = SlidingRingCache(tiny_llama_model.config, {"window": 64, "pool": pool})
    ids = random_ids(8, 300)
    with banded_attention(tiny_llama_model), torch.no_grad():
        tiny_llama_model(ids, cache=cache)
        calls = flex.call_count()
        for token in range(20):
            tiny_llama_model(ids[:, token : token + 1], cache=cache)
    assert flex.call_count() - calls == 20 * 2  # every decode step, both layers
    pool.check_integrity()


def test_window_rows_hold_the_pages_of_what_they_see(tiny_llama_model):
    """A window of 20 tokens keeps its last 20 - 1 + 16 (a page more, for crops): after a step to token 69 (a step of
    60 tokens takes no page for its tokens behind them) and one more, the pages of tokens 35 to 69; those behind went
    back to the pool."""
    pool = KVPool.for_model(tiny_llama_model, max_tokens=512)
    cache = SlidingRingCache(tiny_llama_model.config, {"window": 20, "pool": pool})
    tiny_llama_model(random_ids(3, 9), cache=cache)
    assert cache.memory_stats()["pages_held"] == 3 * 1
    tiny_llama_model(random_ids(3, 60), cache=cache)  # page 0 (what the step sees), 2 to 4 (its last 35); 1: a hole
    rows = cache.layers[0].rows.table.rows
    assert [row[1] for row in rows] == [0, 0, 0] and all(row[0] and row[2] for row in rows)
    tiny_llama_model(random_ids(3, 1), cache=cache)  # its last 35 tokens: 35 to 69, pages 2 to 4
    assert cache.memory_stats()["pages_held"] == 3 * 3
    assert all(row[:2] == [0, 0] for row in rows)  # holes: the null page
    cache.pool.check_integrity()


def test_quantized_rings_under_banded_attention_match_sdpa(tiny_gemma3_model):
    """Quantized values are gathered (their codes cannot be attended in place): the attention only adds the band."""
    ids, mask = padded_batch([23, 16])
    settings = {"max_new_tokens": 12, "cache_implementation": "quantized_values", "cache_config": {"bits": 8}}
    expected = run(tiny_gemma3_model, ids, mask, **settings)
    with banded_attention(tiny_gemma3_model):
        actual = run(tiny_gemma3_model, ids, mask, **settings)
    assert_same_generation(expected, actual)


def test_banded_attention_reads_additive_float_masks_like_boolean_ones():
    """A custom additive 4D mask gets the same band as transformers' boolean one; both equal plain attention."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 2, 3, 8, generator=generator) for _ in range(3))
    allowed = torch.rand(2, 1, 3, 3, generator=generator) > 0.3  # the model's mask
    band = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 1]], dtype=torch.bool).expand(2, -1, -1)  # [batch, n, keys]
    layout = KeyLayout(band)
    allowed[..., 0] = True  # every query sees key 0
    module = torch.nn.Module().eval()
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    handed = {KEY_LAYOUT: layout}  # as a ring's update puts it in the attention's kwargs
    from_bool, _ = banded_sdpa_attention(module, query, key, value, allowed, scaling=0.5, **handed)
    from_float, _ = banded_sdpa_attention(module, query, key, value, additive, scaling=0.5, **handed)
    torch.testing.assert_close(from_float, from_bool)
    seen = allowed & layout.band.unsqueeze(1)  # [2, 1, 3, 3]
    scores = (query @ key.transpose(-1, -2) * 0.5).masked_fill(~seen, -torch.inf)
    torch.testing.assert_close(from_bool, (scores.softmax(-1) @ value).transpose(1, 2))


@IN_PLACE
def test_pages_read_in_place_are_views_of_the_pool(tiny_llama_model, monkeypatch):
    """A decode step reads the window's pages without a copy, rows that share pages (beams) too; the block mask
    hides what lies behind the window."""
    read_path(monkeypatch, "in place")
    pool = KVPool.for_model(tiny_llama_model, max_tokens=1024)
    cache = SlidingRingCache(tiny_llama_model.config, {"window": 8, "pool": pool})
    storage = pool.pages.storage.keys.untyped_storage().data_ptr()
    with banded_attention(tiny_llama_model):
        tiny_llama_model(random_ids(2, 20), cache=cache)
        for layer_idx, rows in ((0, [0, 1]), (1, [0, 0])):
            handed = {}  # the attention's kwargs, as transformers hands them to update
            keys, values = cache.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), layer_idx, kwargs=handed)
            assert keys.untyped_storage().data_ptr() == storage
            assert values.untyped_storage().data_ptr() == pool.pages.storage.values.untyped_storage().data_ptr()
            assert handed[STEP_PLAN].kv_offset == 21 - 8 and handed[STEP_PLAN].mask.windowed
            cache.reorder_cache(torch.tensor(rows))  # then both rows share row 0's pages


@pytest.mark.parametrize("prompt", [16, 64])
def test_imposed_window_on_smollm2_equals_banded_attention(bundled, prompt):
    """The real model: a prompt inside the window under sdpa, one twice the window under the banded attention."""
    model, tokenizer = bundled
    text = "The quick brown fox jumps over the lazy dog while the cat watches from the garden wall. " * 6
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :96]
    cache = SlidingRingCache(model.config, {"window": 32, "sink_tokens": 4})
    with torch.inference_mode(), banded_attention(model) if prompt > 32 else contextlib.nullcontext():
        actual = teacher_forced_logits(model, ids, cache, [prompt, 1])
        expected = banded_logits(model, ids, 32, 4)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("banded", [False, True])
def test_imposed_window_with_left_padding_matches_unpadded_rows(tiny_llama_model, banded):
    """Each row of a left-padded batch, prompts longer than the window included, decodes exactly as it does alone."""
    ids, mask = padded_batch([30, 6, 19])
    cache_config = {"window": 8}
    with banded_attention(tiny_llama_model) if banded else warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without the band, prompts past the window warn
        batch = run(
            tiny_llama_model,
            ids,
            mask,
            max_new_tokens=20,
            cache_implementation="sliding_ring",
            cache_config=cache_config,
        )
        for row in range(ids.shape[0]):
            alone = ids[row : row + 1, mask[row].bool()]
            single = run(
                tiny_llama_model,
                alone,
                torch.ones_like(alone),
                max_new_tokens=20,
                cache_implementation="sliding_ring",
                cache_config=cache_config,
            )
            assert torch.equal(batch.sequences[row, -20:], single.sequences[0, -20:])


@pytest.mark.parametrize(
    "attention,path",
    [("sdpa", "gathered"), ("eager", "gathered"), (ATTENTION_NAME, "gathered"), (ATTENTION_NAME, "in place")],
)
@pytest.mark.parametrize("window,sink_tokens", [(8, 4), (8, 1), (20, 3)])
def test_sinks_are_each_rows_first_real_tokens(tiny_llama_model, attention, path, window, sink_tokens):
    """A left-padded batch with sinks decodes every row exactly as the row does alone (30 greedy tokens, the
    prompts reaching past the window and not), under every attention and on both read paths."""
    ids, mask = padded_batch([30, 6, 19])
    cache_config = {"window": window, "sink_tokens": sink_tokens}
    settings = {"max_new_tokens": 30, "cache_implementation": "sliding_ring"}
    with model_attention(tiny_llama_model, attention), pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without the band, prompts past the window warn
        read_path(patch, path)
        batch = run(tiny_llama_model, ids, mask, **settings, cache_config=cache_config)
        assert (batch.past_key_values.read_counts()["in place"] > 0) == (path == "in place")
        for row in range(ids.shape[0]):
            alone = ids[row : row + 1, mask[row].bool()]
            single = run(tiny_llama_model, alone, torch.ones_like(alone), **settings, cache_config=cache_config)
            generated = single.sequences[0, alone.shape[1] :]  # up to its end of sequence, if any
            assert torch.equal(batch.sequences[row, ids.shape[1] : ids.shape[1] + generated.numel()], generated)
            for step, (expected, actual) in enumerate(zip(single.logits, batch.logits)):
                torch.testing.assert_close(actual[row], expected[0], rtol=1e-5, atol=1e-5, msg=f"row {row} step {step}")


@pytest.mark.parametrize("chunks", [[30, 1], [9, 1], [4, 7, 1]])
def test_padded_rows_with_sinks_equal_the_banded_reference_row_by_row(tiny_llama_model, chunks):
    """Teacher-forced through the cache, told each row's padding with ``plan``: every real position of every row
    equals the banded-mask reference of the row alone (its window and its own first real tokens)."""
    window, sink_tokens = 8, 3
    ids, mask = padded_batch([40, 12, 27])
    cache = SlidingRingCache(tiny_llama_model.config, {"window": window, "sink_tokens": sink_tokens})
    cache.plan(ids.shape[1], attention_mask=mask)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers a padded row's tokens
    logits, start = [], 0
    with banded_attention(tiny_llama_model):
        while start < ids.shape[1]:
            size = chunks[min(len(logits), len(chunks) - 1)]
            end = min(start + size, ids.shape[1])
            out = tiny_llama_model(
                ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end], cache=cache
            )
            logits.append(out.logits)
            start = end
    logits = torch.cat(logits, dim=1)
    for row in range(ids.shape[0]):
        real = mask[row].bool()
        expected = banded_logits(tiny_llama_model, ids[row : row + 1, real], window, sink_tokens)[0]
        torch.testing.assert_close(logits[row, real], expected, rtol=1e-5, atol=1e-5, msg=f"row {row}")


@pytest.mark.parametrize("sink_tokens", [0, 4])
def test_pages_held_stop_growing_once_the_window_is_full(tiny_llama_model, sink_tokens):
    pool = KVPool.for_model(tiny_llama_model, max_tokens=4096)
    cache = SlidingRingCache(tiny_llama_model.config, {"window": 40, "sink_tokens": sink_tokens, "pool": pool})
    ids = random_ids(3, 400)
    held = []
    for token in range(ids.shape[1]):
        tiny_llama_model(ids[:, token : token + 1], cache=cache)
        held.append(pool.stats()["pages_used"])
    per_row = window_pages_per_row(40, sink_tokens, pool.format.page_size)
    assert max(held) <= 3 * per_row  # three rows, each its sinks' and its window's pages
    assert held.index(max(held)) < 40 + sink_tokens + 3 * pool.format.page_size
    pool.check_integrity()
    cache.reset()
    assert pool.stats()["pages_used"] == 0


def test_hybrid_model_layers_draw_from_one_pool_in_groups(tiny_gemma3_model):
    """Gemma 3 (3 sliding + 1 full): one layer group per layer; the sliding ones stay bounded, the full one grows."""
    config = tiny_gemma3_model.config
    assert layer_groups(layer_types(config)) == [[0], [1], [2], [3]]
    pool = KVPool.for_model(tiny_gemma3_model, max_tokens=2048)
    assert (pool.format.num_layers, pool.format.num_layer_groups) == (1, 4)
    cache = PagedCache(config, {"pool": pool})
    assert [type(layer) for layer in cache.layers] == [WindowLayer, WindowLayer, WindowLayer, PagedLayer]
    ids = random_ids(1, 301)
    tiny_gemma3_model(ids[:, :100], cache=cache)
    first = cache.memory_stats()["pages_held"]
    tiny_gemma3_model(ids[:, 100:300], cache=cache)
    grown = cache.memory_stats()["pages_held"]
    page_size = pool.format.page_size
    assert len(cache.layers[3].rows.table.rows[0]) == math.ceil(300 / page_size)  # the full layer grew
    tiny_gemma3_model(ids[:, 300:301], cache=cache)  # a decode step: the sliding layers give back what the chunk read
    for layer in cache.layers[:3]:  # the sliding ones hold their window's pages
        assert sum(page != 0 for page in layer.rows.table.rows[0]) <= window_pages_per_row(8, 0, page_size)
    assert first < grown


def test_layer_groups_split_by_type_in_equal_sizes():
    full, sliding = "full_attention", "sliding_attention"
    assert layer_groups([full] * 4) == [[0, 1, 2, 3]]
    assert layer_groups(([sliding] * 5 + [full]) * 2) == [[0, 1], [2, 3], [4, 6], [7, 8], [9, 10], [5, 11]]
    groups = layer_groups(([sliding] * 5 + [full]) * 5)  # Gemma 3: 25 sliding + 5 full -> 6 groups of 5
    assert [len(layer_group) for layer_group in groups] == [5] * 6 and sorted(sum(groups, [])) == list(range(30))
    assert layer_groups([sliding, "dummy", full, sliding]) == [[0], [3], [2]]
    assert set(PAGED_LAYER_TYPES) >= {full, sliding}


def test_beam_search_and_return_sequences_match_dynamic(tiny_mistral_model):
    ids, mask = padded_batch([12, 30])
    assert_beams_and_sampling_match(
        tiny_mistral_model, ids, mask, "sliding_ring", max_new_tokens=20, num_return_sequences=3, seed=3
    )


def test_row_operations_and_reset_match_dynamic(tiny_mistral_model, fresh_default_pools):
    """Beams' row operations, then a reset that gives back every page (on a default pool of its own: a cache an
    earlier test left to the garbage collector may still hold pages of the shared one)."""
    ids = random_ids(2, 40)
    ring, dynamic = SlidingRingCache(tiny_mistral_model.config), DynamicCache(config=tiny_mistral_model.config)
    for cache in (ring, dynamic):
        tiny_mistral_model(ids, cache=cache)
        cache.batch_repeat_interleave(2)
        cache.reorder_cache(torch.tensor([3, 0, 0, 2]))
    step = random_ids(4, 1, seed=5)
    for _ in range(12):  # the ring wraps while rows 1 and 2 share pages: each copies before writing
        torch.testing.assert_close(
            tiny_mistral_model(step, cache=ring).logits, tiny_mistral_model(step, cache=dynamic).logits
        )
    ring.reset()
    assert ring.get_seq_length() == 0 and ring.pool.stats()["pages_used"] == 0
    torch.testing.assert_close(
        tiny_mistral_model(ids, cache=ring).logits,
        tiny_mistral_model(ids, cache=DynamicCache(config=tiny_mistral_model.config)).logits,
    )


def test_crop_is_exact_where_tokens_remain_and_refused_where_evicted(tiny_llama_model):
    ids = random_ids(1, 80)
    cache = SlidingRingCache(tiny_llama_model.config, {"window": 8})
    with banded_attention(tiny_llama_model):
        tiny_llama_model(ids[:, :70], cache=cache)
        cache.crop(-5)  # tokens 57..64 are still in the ring
        assert cache.get_seq_length() == 65
        actual = teacher_forced_logits(tiny_llama_model, ids[:, 65:], cache, [1])
    torch.testing.assert_close(actual, banded_logits(tiny_llama_model, ids, 8)[:, 65:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gave back the page of token.*Crop at most"):
        cache.crop(-40)
    assert cache.get_seq_length() == 80  # a refused crop changes nothing
    cache.pool.check_integrity()


def test_assisted_decoding_matches_dynamic(tiny_mistral_model):
    ids = random_ids(1, 30)
    assistant = tiny_mistral_model
    expected = tiny_mistral_model.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=assistant)
    actual = tiny_mistral_model.generate(
        ids, max_new_tokens=20, do_sample=False, assistant_model=assistant, cache_implementation="sliding_ring"
    )
    assert torch.equal(expected, actual)


def test_sinks_without_a_window_to_keep_them_are_rejected(tiny_mistral_model):
    with pytest.raises(ValueError, match="sink_tokens=4 needs a window"):
        SlidingRingCache(tiny_mistral_model.config, {"sink_tokens": 4})


def test_ring_on_a_grown_pool_matches_dynamic(tiny_mistral_model):
    """A default-style growable pool that starts with 3 pages and opens more: rings stay exact."""
    pool = KVPool(KVPool.for_model(tiny_mistral_model, max_tokens=16).format, 3, max_pages=256)
    ids = random_ids(3, 50)
    expected = teacher_forced_logits(tiny_mistral_model, ids, DynamicCache(config=tiny_mistral_model.config), [9, 1])
    actual = teacher_forced_logits(
        tiny_mistral_model, ids, SlidingRingCache(tiny_mistral_model.config, {"pool": pool}), [9, 1]
    )
    assert pool.stats()["pages_total"] > 8  # grew at least twice
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rings_read_in_place_match_dynamic_cache(tiny_mistral_model):
    model = copy.deepcopy(tiny_mistral_model).to("cuda")
    ids, mask = (tensor.to("cuda") for tensor in padded_batch([23, 16, 17]))
    reference = run(model, ids, mask, max_new_tokens=40)
    pool = KVPool.for_model(model, max_tokens=1024)
    with banded_attention(model):
        ring = run(
            model, ids, mask, max_new_tokens=40, cache_implementation="sliding_ring", cache_config={"pool": pool}
        )
    assert ring.past_key_values.read_counts()["in place"] > 0
    assert_same_generation(reference, ring)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_banded_attention_takes_a_fused_kernel(tiny_llama_model):
    """With a mask and grouped KV heads, hf_kvcache attention runs on a fused sdpa kernel on CUDA: with the math
    kernel disabled it still runs (torch raises "No available kernel" otherwise), and equals the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = copy.deepcopy(tiny_llama_model).to("cuda", torch.float16)
    ids, mask = (tensor.to("cuda") for tensor in padded_batch([23, 16, 17]))
    settings = {"max_new_tokens": 20, "cache_implementation": "sliding_ring"}
    with banded_attention(model):
        with sdpa_kernel([SDPBackend.MATH]):
            reference = run(model, ids, mask, **settings, cache_config={"window": 8, "sink_tokens": 2})
        pool = KVPool.for_model(model, max_tokens=1024)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            fused = run(model, ids, mask, **settings, cache_config={"window": 8, "sink_tokens": 2, "pool": pool})
    assert fused.past_key_values.read_counts()["in place"] > 0
    assert torch.equal(fused.sequences, reference.sequences)


def test_a_step_past_an_imposed_window_warns_where_the_model_hands_no_kwargs(tiny_llama_model):
    """Under the banded attention a ring hands its band in the attention's kwargs; called without them (a model
    whose attention does not pass them to ``cache.update``), a step past the window cannot get its band: it warns,
    once per cache, and not where the kwargs come."""
    config = with_attention(tiny_llama_model.config, ATTENTION_NAME)
    states = torch.randn(2, 1, config.num_key_value_heads, 20, config.head_dim)  # keys, values
    with pytest.warns(UserWarning, match="past the cache.s window=8, but the model's attention hands the cache"):
        SlidingRingCache(config, {"window": 8}).update(states[0], states[1], 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SlidingRingCache(config, {"window": 8}).update(states[0], states[1], 0, kwargs={})


@pytest.mark.parametrize("window, sink_tokens", [(40, 0), (40, 4), (16, 2), (20, 16)])
def test_window_rows_keep_what_they_see_and_give_back_the_rest(tiny_llama_model, window, sink_tokens):
    """Rows padded differently, steps of one token and chunks longer than the window: after every step each row
    holds the pages of its sinks and of its last ``window - 1 + page_size`` tokens (what the next step sees, and a
    crop of a page), and after a one-token step no more than ``window_pages_per_row``."""
    pool = KVPool.for_model(tiny_llama_model, max_tokens=4096)
    page_size, generator = pool.format.page_size, torch.Generator().manual_seed(window + sink_tokens)
    bound = window_pages_per_row(window, sink_tokens, page_size)
    for _ in range(3):
        pads = torch.randint(0, 30, (3,), generator=generator)
        mask = (torch.arange(40) >= pads.unsqueeze(1)).long()  # [3, 40]
        cache = SlidingRingCache(tiny_llama_model.config, {"window": window, "sink_tokens": sink_tokens, "pool": pool})
        cache.plan(200, attention_mask=mask)
        end = 0
        while end < 200:
            size = int(torch.randint(1, 60, (1,), generator=generator)) if end < 100 else 1
            tiny_llama_model(random_ids(3, size), cache=cache)
            end += size
            rows = cache.layers[0].rows
            for row, (pages, skip, pad) in enumerate(zip(rows.table.rows, rows.table.row_skips, pads.tolist())):
                held = {skip + index for index, page in enumerate(pages) if page != 0}
                needed = set(range(max(end - window + 1 - page_size, 0) // page_size, -(-end // page_size)))
                if sink_tokens:
                    needed |= set(range(pad // page_size, (pad + sink_tokens - 1) // page_size + 1))
                needed &= set(range(skip, -(-end // page_size)))  # pages of padding alone are not taken
                assert needed <= held, (row, end)
                assert size > 1 or len(held) <= bound, (row, end)
        pool.check_integrity()
        cache.reset()
    assert pool.stats()["pages_used"] == 0
