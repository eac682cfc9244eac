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
from hf_kvcache.attention.interface import ATTENTION_NAME, banded_sdpa_attention, model_attention
from hf_kvcache.attention.reads import KEY_LAYOUT, KeyLayout
from hf_kvcache.bench.catalogue import with_attention
from hf_kvcache.caches.base import ATTENTION_LAYER_TYPES
from hf_kvcache.layers import PagedLayer, RingLayer, RingRows
from hf_kvcache.memory.format import layer_groups, layer_types

SLIDING_MODELS = ["tiny_mistral_model", "tiny_gemma3_model"]  # window 8


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
    assert sliding and all(isinstance(layer, RingLayer) for layer in sliding)


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
    with pytest.warns(UserWarning, match='A step of 20 tokens reaches past the ring.s window=8.*"hf_kvcache"'):
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


@pytest.mark.parametrize("window,sink_tokens", [(8, 0), (8, 3), (20, 4)])
@pytest.mark.parametrize("chunks", [[1], [9, 1], [5, 3, 1, 20, 2], [16]])
def test_pages_read_in_place_equal_pages_gathered(tiny_llama_model, window, sink_tokens, chunks):
    """The fast path (keys in slot order, views of the pool) against its slow twin (gathered in time order)."""
    ids = random_ids(2, 60, seed=window + sink_tokens)
    pool = KVPool.for_model(tiny_llama_model, max_tokens=1024)  # fresh: a row's pages are consecutive
    with banded_attention(tiny_llama_model):
        cache = SlidingRingCache(tiny_llama_model.config, {"window": window, "sink_tokens": sink_tokens, "pool": pool})
        in_place = teacher_forced_logits(tiny_llama_model, ids, cache, chunks)
        assert cache.read_counts()["in place"] > 0
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(RingRows, "_first_page", lambda self: None)  # never consecutive: always gather
            cache = SlidingRingCache(tiny_llama_model.config, {"window": window, "sink_tokens": sink_tokens})
            gathered = teacher_forced_logits(tiny_llama_model, ids, cache, chunks)
        assert cache.read_counts()["in place"] == 0
    torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        in_place, banded_logits(tiny_llama_model, ids, window, sink_tokens), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("model_name", SLIDING_MODELS)
@pytest.mark.parametrize("lengths,new_tokens", [([5, 3], 2), ([9, 4], 16), ([23, 16, 17], 40)])
@pytest.mark.parametrize("name", ["sliding_ring", "paged_pool"])
def test_pages_read_in_place_match_dynamic_cache_with_padding(model_name, lengths, new_tokens, name, request):
    """The model's own sliding mask and left padding, put in slot order by the layout's mask columns."""
    model = request.getfixturevalue(model_name)
    ids, mask = padded_batch(lengths)
    reference = run(model, ids, mask, max_new_tokens=new_tokens)
    pool = KVPool.for_model(model, max_tokens=1024)  # fresh: a row's pages are consecutive
    with banded_attention(model):
        ring = run(model, ids, mask, max_new_tokens=new_tokens, cache_implementation=name, cache_config={"pool": pool})
    assert ring.past_key_values.read_counts()["in place"] > 0
    assert_same_generation(reference, ring)


def test_generate_takes_planned_ring_pages_at_once_and_reads_them_in_place(tiny_llama_model):
    """Short prompts in a batch: generate plans the rows' length, so each row's pages are taken together."""
    ids, mask = padded_batch([5, 3, 9])
    settings = {"max_new_tokens": 40, "cache_implementation": "sliding_ring"}
    with banded_attention(tiny_llama_model):
        pool = KVPool.for_model(tiny_llama_model, max_tokens=2048)
        fast = run(tiny_llama_model, ids, mask, **settings, cache_config={"window": 20, "pool": pool})
        assert fast.cache.read_counts() == {"gather": 0, "run": 0, "in place": 40 * 2}  # every forward, both layers
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(RingRows, "_first_page", lambda self: None)  # never consecutive: always gather
            slow = run(tiny_llama_model, ids, mask, **settings, cache_config={"window": 20})
        assert slow.cache.read_counts() == {"gather": 40 * 2, "run": 0, "in place": 0}
    assert_same_generation(slow, fast)


@pytest.mark.parametrize("planned,pages_per_row", [(0, 1), (30, 2), (500, 3)])
def test_planned_tokens_take_pages_up_to_the_ring(tiny_llama_model, planned, pages_per_row):
    cache = SlidingRingCache(
        tiny_llama_model.config, {"window": 20, "pool": KVPool.for_model(tiny_llama_model, max_tokens=512)}
    )
    cache.plan(planned)
    tiny_llama_model(random_ids(3, 9), cache=cache)  # a ring of 20 tokens: 48 slots, 3 pages of 16
    assert cache.memory_stats()["pages_held"] == 3 * pages_per_row
    tiny_llama_model(random_ids(3, 60), cache=cache)
    assert cache.memory_stats()["pages_held"] == 3 * 3
    cache.pool.check_integrity()


def test_quantized_rings_under_banded_attention_match_sdpa(tiny_gemma3_model):
    """Quantized values are gathered (their codes cannot be attended in place): the attention only adds the band."""
    ids, mask = padded_batch([23, 16])
    settings = {"max_new_tokens": 12, "cache_implementation": "quantized_values", "cache_config": {"bits": 8}}
    expected = run(tiny_gemma3_model, ids, mask, **settings)
    with banded_attention(tiny_gemma3_model):
        actual = run(tiny_gemma3_model, ids, mask, **settings)
    assert_same_generation(expected, actual)


@pytest.mark.parametrize("in_slot_order", [False, True])
def test_banded_attention_reads_additive_float_masks_like_boolean_ones(in_slot_order):
    """A custom additive 4D mask gets the same layout as transformers' boolean one; both equal plain attention."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 2, 3, 8, generator=generator) for _ in range(3))
    allowed = torch.rand(2, 1, 3, 3, generator=generator) > 0.3  # the model's mask
    band = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 1]], dtype=torch.bool).expand(2, -1, -1)  # [batch, n, keys]
    layout = KeyLayout(band)
    if in_slot_order:  # each row's keys in their own order
        layout = KeyLayout(layout.band, torch.tensor([[2, 0, 1], [1, 2, 0]]))
    columns = torch.arange(3).expand(2, -1) if layout.mask_columns is None else layout.mask_columns  # [batch, keys]
    allowed[torch.arange(2), ..., columns[:, 0]] = True  # every query sees key 0
    module = torch.nn.Module().eval()
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    handed = {KEY_LAYOUT: layout}  # as a ring's update puts it in the attention's kwargs
    from_bool, _ = banded_sdpa_attention(module, query, key, value, allowed, scaling=0.5, **handed)
    from_float, _ = banded_sdpa_attention(module, query, key, value, additive, scaling=0.5, **handed)
    torch.testing.assert_close(from_float, from_bool)
    seen = allowed.gather(-1, columns[:, None, None, :].expand(-1, 1, 3, -1)) & layout.band.unsqueeze(1)  # [2, 1, 3, 3]
    scores = (query @ key.transpose(-1, -2) * 0.5).masked_fill(~seen, -torch.inf)
    torch.testing.assert_close(from_bool, (scores.softmax(-1) @ value).transpose(1, 2))


def test_pages_read_in_place_are_views_of_the_pool(tiny_llama_model):
    """Consecutive pages are read without a copy; rows that share pages (beams) are gathered."""
    pool = KVPool.for_model(tiny_llama_model, max_tokens=1024)
    cache = SlidingRingCache(tiny_llama_model.config, {"window": 8, "pool": pool})
    with banded_attention(tiny_llama_model):
        tiny_llama_model(random_ids(2, 20), cache=cache)
        handed = {}  # the attention's kwargs, as transformers hands them to update
        keys, values = cache.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), 0, kwargs=handed)
        assert handed[KEY_LAYOUT].mask_columns is not None  # slot order: attention gets where each key's column is
        storage = pool.pages.storage.keys.untyped_storage().data_ptr()
        assert keys.untyped_storage().data_ptr() == storage
        assert values.untyped_storage().data_ptr() == pool.pages.storage.values.untyped_storage().data_ptr()
        assert keys.shape[2] == cache.layers[0].rows.num_slots  # every slot, in slot order
        cache.reorder_cache(torch.tensor([0, 0]))  # both rows now share row 0's pages
        keys, _ = cache.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), 1, kwargs={})
        assert keys.untyped_storage().data_ptr() != storage


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
        if path == "gathered":
            patch.setattr(RingRows, "_first_page", lambda self: None)  # never consecutive: always gather
        pool = KVPool.for_model(tiny_llama_model, max_tokens=2048)  # fresh: a row's pages are consecutive
        batch = run(tiny_llama_model, ids, mask, **settings, cache_config={**cache_config, "pool": pool})
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
    per_row = RingRows(pool.pages, 40, sink_tokens).num_slots // pool.format.page_size
    assert max(held) == held[-1] == 3 * per_row  # three rows, each a fixed ring
    assert held.index(max(held)) < 40 + sink_tokens + pool.format.page_size
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
    assert [type(layer) for layer in cache.layers] == [RingLayer, RingLayer, RingLayer, PagedLayer]
    ids = random_ids(1, 300)
    tiny_gemma3_model(ids[:, :100], cache=cache)
    first = cache.memory_stats()["pages_held"]
    tiny_gemma3_model(ids[:, 100:300], cache=cache)
    grown = cache.memory_stats()["pages_held"]
    page_size = pool.format.page_size
    assert grown - first == math.ceil(300 / page_size) - math.ceil(100 / page_size)  # only the full layer grew
    assert pool.stats()["pages_used"] == grown


def test_layer_groups_split_by_type_in_equal_sizes():
    full, sliding = "full_attention", "sliding_attention"
    assert layer_groups([full] * 4) == [[0, 1, 2, 3]]
    assert layer_groups(([sliding] * 5 + [full]) * 2) == [[0, 1], [2, 3], [4, 6], [7, 8], [9, 10], [5, 11]]
    groups = layer_groups(([sliding] * 5 + [full]) * 5)  # Gemma 3: 25 sliding + 5 full -> 6 groups of 5
    assert [len(layer_group) for layer_group in groups] == [5] * 6 and sorted(sum(groups, [])) == list(range(30))
    assert layer_groups([sliding, "dummy", full, sliding]) == [[0], [3], [2]]
    assert set(ATTENTION_LAYER_TYPES) >= {full, sliding}


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
    with pytest.raises(ValueError, match="has overwritten tokens.*Crop at most"):
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
    with pytest.warns(UserWarning, match="reaches past the ring.s window=8, but the model's attention hands the cache"):
        SlidingRingCache(config, {"window": 8}).update(states[0], states[1], 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SlidingRingCache(config, {"window": 8}).update(states[0], states[1], 0, kwargs={})


@pytest.mark.parametrize("window, sink_tokens", [(40, 0), (40, 4), (16, 2), (100, 16)])
def test_the_pages_a_step_takes_are_those_of_its_tokens_slots(tiny_llama_model, window, sink_tokens):
    """``RingRows._pages_taking`` (host arithmetic, what copy-on-write asks every step of a wrapped ring) against its
    slow twin: the pages of ``_slots``' slots of every token of every row, for steps of one token and chunks longer
    than the ring, around the sinks and the wrap, rows padded differently."""
    rows = RingRows(KVPool.for_model(tiny_llama_model, max_tokens=4096).pages, window, sink_tokens)
    page_size, generator = rows.pool.format.page_size, torch.Generator().manual_seed(0)
    for _ in range(300):
        pads = torch.randint(0, 30, (3,), generator=generator).tolist()
        rows.set_plan(0, pads)
        end = int(torch.randint(1, 4 * rows.num_slots, (1,), generator=generator))
        first = max(
            end - int(torch.randint(1, 2 * rows.num_slots, (1,), generator=generator)), 0, end - rows.ring_slots
        )
        slots = rows._slots(torch.arange(first, end).expand(3, -1))
        expected = sorted(set((slots[slots >= 0] // page_size).tolist()))
        assert rows._pages_taking(3, first, end) == expected, (pads, first, end)
