"""Hybrid models: the layers that hold no attention KV we page (linear attention's recurrent and convolution states,
LFM2's short convolutions) keep transformers' own cache layers inside our caches; the attention layers of the same
model live on the pool.

Tiny random-init models built from ``AutoConfig.for_model`` (``hf_kvcache.testing.tiny_hybrid``): Qwen3.5 (Gated
DeltaNet linear attention beside full attention) and LFM2 (short convolutions beside full attention), each against
``DynamicCache``."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from hf_kvcache import IncompatibleModelError, KVPool, PagedCache, PagedConfig, QuantizedKVCache, QuantizedValueCache
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.layers import PagedLayer
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.testing import HYBRIDS, tiny_hybrid
from tests.helpers import (
    assert_same_generation,
    exact_config,
    example_config,
    padded_batch,
    random_ids,
    run,
    teacher_forced_logits,
)

PROMPT = [9, 6]  # a left-padded batch of two rows
NEW_TOKENS = 8
LENGTH = max(PROMPT) + NEW_TOKENS


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request):
    return tiny_hybrid(request.param)


@pytest.fixture(scope="module")
def qwen():
    return tiny_hybrid("qwen3_5_text")


def test_layers_that_are_not_attention_are_the_layers_dynamic_cache_makes(hybrid, cache_name):
    cache = REGISTRY[cache_name].cache_class(hybrid.config, exact_config(cache_name, LENGTH))
    theirs = DynamicCache(config=hybrid.config).layers
    for layer_type, ours, reference in zip(hybrid.config.layer_types, cache.layers, theirs, strict=True):
        if layer_type == "full_attention":
            assert isinstance(ours, PagedLayer)
        else:
            assert type(ours) is type(reference) and ours.number_of_states == reference.number_of_states


def test_greedy_generation_equals_dynamic_cache(hybrid, cache_name):
    """Lossless caches (and the quantized ones keeping every value in full precision) give DynamicCache's tokens and
    logits, a left-padded batch included."""
    ids, mask = padded_batch(PROMPT)
    expected = run(hybrid, ids, mask, max_new_tokens=NEW_TOKENS)
    config = exact_config(cache_name, LENGTH)
    assert_same_generation(
        expected,
        run(hybrid, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation=cache_name, cache_config=config),
    )


@pytest.mark.parametrize(
    "cache_class,settings",
    [(QuantizedValueCache, {"bits": 4}), (QuantizedKVCache, {"key_bits": 4, "value_bits": 4})],
    ids=["quantized_values", "quantized_kv"],
)
def test_quantized_caches_stay_close(hybrid, cache_class, settings):
    """Reading int4 codes from the second page on (teacher-forced: a prefill, then a token at a time), the logits
    stay within 5% of the largest of DynamicCache's (2.6% measured; tiny Llama: 2.3%)."""
    ids = random_ids(2, 28, seed=3)
    cache = cache_class(hybrid.config, {"group_size": 16, "residual_length": 4, "page_size": 4, **settings})
    with torch.no_grad():
        expected = teacher_forced_logits(hybrid, ids, DynamicCache(config=hybrid.config), [12, 1])
        actual = teacher_forced_logits(hybrid, ids, cache, [12, 1])
    worst = (actual - expected).abs().max().item()
    assert 0 < worst < 0.05 * expected.abs().max().item()
    cache.release()


def test_beam_search_and_sampling_equal_dynamic_cache(hybrid, cache_name):
    """Beams reorder the linear-attention and convolution states with the pages."""
    ids, mask = padded_batch(PROMPT, seed=1)
    config = exact_config(cache_name, LENGTH)
    beams = {"num_beams": 3, "max_new_tokens": 6}
    assert torch.equal(
        hybrid.generate(ids, attention_mask=mask, **beams),
        hybrid.generate(ids, attention_mask=mask, cache_implementation=cache_name, cache_config=config, **beams),
    )


def test_returned_sequences_repeat_the_states(hybrid):
    ids, mask = padded_batch(PROMPT, seed=1)
    sampling = {"do_sample": True, "num_return_sequences": 2, "max_new_tokens": 6}
    torch.manual_seed(0)
    expected = hybrid.generate(ids, attention_mask=mask, **sampling)
    torch.manual_seed(0)
    assert torch.equal(
        expected, hybrid.generate(ids, attention_mask=mask, cache_implementation="paged_pool", **sampling)
    )


def reference_logits(model, ids: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """Last logits ``[rows, vocab]`` of feeding ``next_ids [rows, 1]`` after ``ids`` through a ``DynamicCache``."""
    cache = DynamicCache(config=model.config)
    model(ids, cache=cache)
    return model(next_ids, cache=cache).logits[:, -1]


ROW_CHANGES = pytest.mark.parametrize(
    "change,rows",
    [
        (lambda cache: cache.reorder_cache(torch.tensor([2, 2, 0])), [2, 2, 0]),
        (lambda cache: cache.batch_select_indices(torch.tensor([2, 0])), [2, 0]),
        (lambda cache: cache.batch_select_indices(torch.tensor([True, False, True])), [0, 2]),
        (lambda cache: cache.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2]),
    ],
    ids=["reorder", "select", "select-mask", "repeat"],
)
"""A row change of a cache holding rows 0, 1, 2, and the rows it leaves."""


@ROW_CHANGES
def test_row_changes_move_the_states_with_the_pages(hybrid, change, rows):
    """After a row change the next step's logits are those of the changed rows fed from the start."""
    ids = random_ids(3, 7, seed=2)
    cache = PagedCache(hybrid.config)
    with torch.no_grad():
        hybrid(ids, cache=cache)
        change(cache)
        next_ids = random_ids(len(rows), 1, seed=3)
        actual = hybrid(next_ids, cache=cache).logits[:, -1]
        expected = reference_logits(hybrid, ids[rows], next_ids)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    cache.release()


def test_the_cache_counts_tokens_pages_and_the_states_outside_the_pool(qwen):
    pool = KVPool.for_model(qwen, PagedConfig(page_size=4), max_tokens=256)
    assert (pool.format.num_layers, pool.format.num_layer_groups) == (2, 1)  # the two full-attention layers
    cache = PagedCache(qwen.config, {"pool": pool})
    assert cache.worst_case_pages(2, 40, 4) == 2 * 10  # pool pages only
    with torch.no_grad():
        qwen(random_ids(2, 7), cache=cache)
    assert cache.get_seq_length() == 7 and isinstance(cache.get_seq_length(), int)
    assert cache.get_seq_length(0) == 7  # layer 0 is a linear-attention layer: the attention layers' count
    reference = DynamicCache(config=qwen.config)
    with torch.no_grad():
        qwen(random_ids(2, 7), cache=reference)
    state_bytes = sum(
        state.nbytes
        for layer in reference.layers[::2]
        for states in (layer.conv_states, layer.recurrent_states)
        for state in states.values()
    )
    stats = cache.memory_stats()
    assert stats["pages_held"] == 2 * 2 and stats["state_bytes"] == state_bytes > 0
    assert stats["bytes_held"] == stats["pages_held"] * pool.format.page_bytes + state_bytes
    cache.release()
    assert pool.stats()["pages_used"] == 0 and cache.memory_stats()["state_bytes"] == 0
    assert cache.get_seq_length() == 0


def test_a_released_cache_serves_the_next_prompt_as_a_fresh_one(qwen):
    cache = PagedCache(qwen.config)
    first, second = random_ids(2, 9, seed=4), random_ids(3, 5, seed=5)
    next_ids = random_ids(3, 1, seed=6)
    with torch.no_grad():
        qwen(first, cache=cache)
        cache.reset()
        qwen(second, cache=cache)
        actual = qwen(next_ids, cache=cache).logits[:, -1]
    torch.testing.assert_close(actual, reference_logits(qwen, second, next_ids), rtol=1e-5, atol=1e-5)
    cache.release()


def test_crop_refuses_a_recurrent_state_that_does_not_record_its_past(qwen):
    """As transformers' own layers: a recurrent state cannot be cropped unless it records its past; the cache is left
    as it was."""
    cache = PagedCache(qwen.config)
    ids, next_ids = random_ids(1, 9, seed=7), random_ids(1, 1, seed=8)
    with torch.no_grad():
        qwen(ids, cache=cache)
        pages = cache.memory_stats()["pages_held"]
        with pytest.raises(ValueError, match=r"layers \[0, 2\].*activate_past_recording"):
            cache.crop(-2)
        assert cache.get_seq_length() == 9 and cache.memory_stats()["pages_held"] == pages
        actual = qwen(next_ids, cache=cache).logits[:, -1]
    torch.testing.assert_close(actual, reference_logits(qwen, ids, next_ids), rtol=1e-5, atol=1e-5)
    cache.release()


def test_prompt_lookup_crops_recorded_states_as_dynamic_cache_does(hybrid):
    """Assisted decoding records the states' past and crops the rejected candidates: the tokens of greedy search."""
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])  # repeats, so that prompt lookup proposes candidates
    settings = {"max_new_tokens": 10, "do_sample": False}
    expected = hybrid.generate(ids, **settings)
    assert torch.equal(hybrid.generate(ids, prompt_lookup_num_tokens=3, **settings), expected)
    actual = hybrid.generate(ids, prompt_lookup_num_tokens=3, cache_implementation="paged_pool", **settings)
    assert torch.equal(actual, expected)


def test_is_compileable_follows_transformers_layers(qwen):
    cache = PagedCache(qwen.config, {"max_tokens": 256})  # a pool of its own: compileable before it is bound
    assert cache.is_compileable  # linear-attention states keep static addresses, updated in place
    cache.activate_past_recording()  # a recording layer reassigns its states: not compileable (transformers' rule)
    assert not cache.is_compileable


MAMBA = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 4}


@pytest.mark.parametrize(
    "model_type,sizes,types",
    [("mamba", MAMBA, r"\['linear_attention'\]"), ("falcon_mamba", MAMBA, r"\['linear_attention'\]")],
)
def test_models_without_an_attention_layer_to_page_are_refused_by_name(model_type, sizes, types):
    config = AutoConfig.for_model(model_type, **sizes)
    name = type(config).__name__
    with pytest.raises(IncompatibleModelError, match=rf"{name} has layers of type {types}.*DynamicCache"):
        PagedCache(config)
    with pytest.raises(IncompatibleModelError, match=rf"{name} has layers of type {types}.*DynamicCache"):
        PageFormat.from_model_config(config, torch.float32)  # what KVPool.for_model reads


def test_a_pure_mamba_is_refused_by_generate(cache_name):
    config = AutoConfig.for_model("mamba", **MAMBA)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(IncompatibleModelError, match=r"MambaConfig has layers of type.*DynamicCache"):
        model.generate(
            random_ids(1, 4), max_new_tokens=2, cache_implementation=cache_name, cache_config=example_config(cache_name)
        )
