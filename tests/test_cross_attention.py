"""Cross-attention layers (Mllama's, which attend to an image's keys): they keep transformers' own cache layer inside
our caches (the ``StaticLayer`` its ``StaticCache`` makes for them, sized by the image); the self-attention layers of
the same model live on the pool.

A tiny random-init Mllama (a vision encoder of 2 layers, a text decoder of 4 with layer 1 cross-attending, its gates
opened) generates from a prompt and an image, against ``DynamicCache``."""

import logging

import pytest
import torch
from transformers import MllamaConfig, MllamaForCausalLM, MllamaForConditionalGeneration, StaticLayer

from hf_kvcache import KVPool, PagedCache, PagedConfig
from hf_kvcache.caches import prefix as prefix_module
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.layers import PagedLayer
from hf_kvcache.memory.format import PageFormat
from tests.helpers import assert_same_generation, exact_config, padded_batch, run

PROMPT = [9, 6]  # a left-padded batch of two rows
NEW_TOKENS = 6
LENGTH = max(PROMPT) + NEW_TOKENS
CROSS = [1]
TEXT = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "cross_attention_layers": CROSS,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}
VISION = {
    "image_size": 16,
    "patch_size": 4,
    "num_hidden_layers": 2,
    "num_global_layers": 1,
    "hidden_size": 16,
    "attention_heads": 4,
    "intermediate_size": 32,
    "intermediate_layers_indices": [0],
    "vision_output_dim": 32,  # hidden_size x (intermediate layers + 1)
    "max_num_tiles": 2,
    "supported_aspect_ratios": [[1, 1], [1, 2]],
}


@pytest.fixture(scope="module")
def mllama():
    return tiny_mllama()


def tiny_mllama() -> MllamaForConditionalGeneration:
    torch.manual_seed(0)
    config = MllamaConfig(text_config=TEXT, vision_config=VISION, image_token_index=127)
    model = MllamaForConditionalGeneration(config).eval()
    for idx in CROSS:  # the gates start at 0 (the image ignored): open them
        layer = model.model.language_model.layers[idx]
        torch.nn.init.constant_(layer.cross_attn_attn_gate, 1.0)
        torch.nn.init.constant_(layer.cross_attn_mlp_gate, 1.0)
    return model


def image_inputs(rows: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One image of one tile per row, seen by every token."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(rows, 1, 2, 3, 16, 16, generator=generator),
        "aspect_ratio_ids": torch.ones(rows, 1, dtype=torch.long),
        "aspect_ratio_mask": torch.tensor([[[1, 0]]] * rows),
        "cross_attention_mask": torch.tensor([[[[1, 0]]] * length] * rows),
    }


def test_cross_attention_layers_are_static_layers_the_self_attention_ones_on_the_pool(mllama, cache_name):
    cache = REGISTRY[cache_name].cache_class(mllama.config, exact_config(cache_name, LENGTH))
    for idx, ours in enumerate(cache.layers):
        assert isinstance(ours, StaticLayer if idx in CROSS else PagedLayer)
    assert cache.is_compileable
    page_format = PageFormat.from_model_config(mllama.config, torch.float32)
    assert (page_format.num_layers, page_format.num_kv_heads, page_format.head_dim) == (3, 2, 16)


def test_greedy_generation_with_an_image_equals_dynamic_cache(mllama, cache_name):
    """The prompt's tokens on the pool, the image's keys in transformers' layer: DynamicCache's tokens and logits."""
    ids, mask = padded_batch(PROMPT)
    images = image_inputs(len(PROMPT), max(PROMPT))
    expected = run(mllama, ids, mask, max_new_tokens=NEW_TOKENS, **images)
    config = exact_config(cache_name, LENGTH)
    actual = run(
        mllama, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation=cache_name, cache_config=config, **images
    )
    assert_same_generation(expected, actual)


def test_a_text_model_handed_the_image_states_at_every_step_equals_dynamic_cache(mllama):
    """``MllamaForCausalLM`` takes ``cross_attention_states`` at every step, each written again (appended)."""
    model = MllamaForCausalLM(mllama.config.text_config).eval()
    model.model.load_state_dict(mllama.model.language_model.state_dict())
    ids, mask = padded_batch(PROMPT)
    states = {"cross_attention_states": torch.randn(len(PROMPT), 10, TEXT["hidden_size"])}
    expected = run(model, ids, mask, max_new_tokens=4, **states)
    actual = run(model, ids, mask, max_new_tokens=4, cache_implementation="paged_pool", **states)
    assert_same_generation(expected, actual)


def test_the_image_changes_the_tokens(mllama):
    """The test above could not pass with the image ignored: another image gives other logits."""
    ids, mask = padded_batch(PROMPT)
    first = run(mllama, ids, mask, max_new_tokens=2, cache_implementation="paged_pool", **image_inputs(2, 9, seed=0))
    second = run(mllama, ids, mask, max_new_tokens=2, cache_implementation="paged_pool", **image_inputs(2, 9, seed=1))
    assert (first.logits[-1] - second.logits[-1]).abs().max() > 1e-3


@pytest.mark.parametrize("cache_name", ["quantized_values", "quantized_kv"])
def test_quantized_caches_stay_close(mllama, cache_name):
    """int8 values and int4 keys read as codes from the second page on: logits within 15% of the largest of
    DynamicCache's, as the model matrix bounds them."""
    ids, mask = padded_batch(PROMPT)
    images = image_inputs(len(PROMPT), max(PROMPT))
    expected = run(mllama, ids, mask, max_new_tokens=NEW_TOKENS, **images)
    settings = {"quantized_values": {"bits": 8}, "quantized_kv": {"key_bits": 4, "value_bits": 8}}[cache_name]
    config = {**settings, "residual_length": 2, "page_size": 4}
    actual = run(
        mllama, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation=cache_name, cache_config=config, **images
    )
    assert torch.equal(actual.sequences, expected.sequences)
    worst = max((ours - theirs).abs().max().item() for ours, theirs in zip(actual.logits, expected.logits))
    assert 0 < worst < 0.15 * max(logits.abs().max().item() for logits in expected.logits)


def test_beam_search_moves_the_image_keys_with_the_pages(mllama, cache_name):
    ids, mask = padded_batch(PROMPT, seed=1)
    images = image_inputs(len(PROMPT), max(PROMPT), seed=2)
    beams = {"num_beams": 3, "max_new_tokens": 5, **images}
    config = exact_config(cache_name, LENGTH)
    assert torch.equal(
        mllama.generate(ids, attention_mask=mask, **beams),
        mllama.generate(ids, attention_mask=mask, cache_implementation=cache_name, cache_config=config, **beams),
    )


def test_the_cache_counts_the_image_keys_and_releases_them(mllama):
    pool = KVPool.for_model(mllama, PagedConfig(page_size=4), max_tokens=256)
    assert (pool.format.num_layers, pool.format.num_layer_groups) == (3, 1)  # the self-attention layers
    cache = PagedCache(mllama.config, {"pool": pool})
    ids, _ = padded_batch([7, 7])
    with torch.no_grad():
        mllama(ids, cache=cache, **image_inputs(2, 7))
    image_keys = cache.layers[CROSS[0]].keys
    assert cache.get_seq_length() == 7 and image_keys.shape[-2] > 7  # the image's tokens, not the prompt's
    stats = cache.memory_stats()
    assert stats["pages_held"] == 2 * 2 and stats["state_bytes"] == 2 * image_keys.nbytes
    cache.crop(-2)  # the prompt's tokens only: the image keeps its keys
    assert cache.get_seq_length() == 5 and torch.equal(cache.layers[CROSS[0]].keys, image_keys)
    cache.release()
    assert pool.stats()["pages_used"] == 0 and cache.memory_stats()["state_bytes"] == 0


def test_prefix_caching_is_refused_once_with_its_reason(mllama, caplog, monkeypatch):
    """The image's keys are not a function of the prompt's tokens: no cached prefix may stand for them."""
    monkeypatch.setattr(prefix_module, "_logged", set())
    pool = KVPool.for_model(mllama, PagedConfig(page_size=4), max_tokens=512, prefix_caching=True)
    ids, mask = padded_batch([18])
    images = image_inputs(1, 18)
    expected = run(mllama, ids, mask, max_new_tokens=4, **images)
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        for _ in range(2):
            actual = run(
                mllama,
                ids,
                mask,
                max_new_tokens=4,
                cache_implementation="paged_pool",
                cache_config={"pool": pool},
                **images,
            )
            assert_same_generation(expected, actual)
    refusals = [record.message for record in caplog.records if "Prefix caching is off" in record.message]
    assert len(refusals) == 1 and "cross-attention" in refusals[0], refusals
    stats = pool.stats()
    assert stats["prefix_lookups"] == 0 and stats["pages_cached"] == 0
    pool.check_integrity()
