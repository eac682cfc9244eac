"""Compressed attention (DeepSeek-V4's compressed sparse and heavily compressed layers): each such layer's sliding
window of shared keys and values sits on the pool as a window (``CompressedLayer``), its compressor's state (tokens
of a compression window not yet closed, compressed entries, overlap, the indexer's entries) beside it in the cache
layer transformers makes for it, which moves with the rows and counts in the cache's memory.

A tiny random-init DeepSeek-V4 (``hf_kvcache.testing.tiny_causal_lm``) with a sliding, a compressed sparse and a
heavily compressed layer, a window of 8, compression every 4 and 8 tokens and an indexer keeping 2 compressed entries
a query, so that prompts of 3 to 21 tokens feel the window, both compressions and the sparsity; each cache against
``DynamicCache``, under the model's own attention (``eager``: it refuses sdpa) and ours."""

import dataclasses
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from hf_kvcache import KVPool, PagedCache, PagedConfig
from hf_kvcache.attention.interface import model_attention
from hf_kvcache.bench import model_matrix as matrix
from hf_kvcache.caches import prefix as prefix_module
from hf_kvcache.caches.compressed import CompressedLayer
from hf_kvcache.errors import IncompatibleModelError
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.layers import WindowLayer
from hf_kvcache.layers.window import window_pages_per_row
from hf_kvcache.memory import format as format_module
from hf_kvcache.testing import random_padded_batch, tiny_causal_lm
from tests.helpers import assert_same_generation, exact_config, padded_batch, random_ids, run, teacher_forced_logits
from tests.test_hybrid_models import ROW_CHANGES, reference_logits
from tests.test_quantized_cache import QuantDequantValues
from tests.test_quantized_kv_cache import EncodedKVSpec

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
WINDOW = 8  # the tiny config's sliding_window
NEW_TOKENS = 12
PROMPTS = {"shorter": [3, 5], "longer": [6, 19]}
"""Left-padded batches of two rows: shorter than the window and the rates (but a row past the sparse rate), and
longer than all of them."""
COMPRESSOR_STATES = ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate")
"""The tensors (by entry name) of transformers' ``DeepseekV4HCACache`` / ``DeepseekV4CSACache`` beside the window."""


@pytest.fixture(scope="module")
def model():
    built = tiny_causal_lm(
        "deepseek_v4", num_hidden_layers=3, layer_types=LAYER_TYPES, compress_rates=RATES, index_topk=2
    )
    assert built.config.sliding_window == WINDOW and built.config._attn_implementation == "eager"
    return built


def lossless_config(cache_name: str, length: int = 40) -> dict:
    """``exact_config`` with the quantized caches' scale groups as wide as a head (16 channels)."""
    config = exact_config(cache_name, length)
    return {**config, "group_size": 16} if "group_size" in config else config


def compressor_bytes(cache: DynamicCache) -> int:
    """Bytes of the compressor states of ``DynamicCache``'s compressed layers (their windows' keys aside)."""
    states = [getattr(layer, name, {}) for layer in cache.layers for name in COMPRESSOR_STATES]
    return sum(tensor.nbytes for state in states for tensor in state.values() if tensor is not None)


def test_compressed_layers_keep_a_window_on_the_pool_and_their_compressor_beside(model, cache_name):
    cache = REGISTRY[cache_name].cache_class(model.config, lossless_config(cache_name))
    for layer_type, layer in zip(LAYER_TYPES, cache.layers, strict=True):
        assert isinstance(layer, WindowLayer) and layer.window == WINDOW
        if layer_type == "sliding_attention":
            assert not isinstance(layer, CompressedLayer)
        else:
            assert isinstance(layer, CompressedLayer) and type(layer.compressor).__name__ == (
                "DeepseekV4CSACache" if layer_type == "compressed_sparse_attention" else "DeepseekV4HCACache"
            )


@pytest.mark.parametrize("attention", ["eager", "hf_kvcache"])
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_greedy_generation_equals_dynamic_cache(model, cache_name, prompt, attention):
    """Every cache keeping every value exactly gives DynamicCache's tokens and logits on a left-padded batch, under
    the model's own attention and ours."""
    ids, mask = padded_batch(PROMPTS[prompt], vocab=model.config.vocab_size)
    expected = run(model, ids, mask, max_new_tokens=NEW_TOKENS)
    config = lossless_config(cache_name)
    with model_attention(model, attention):
        actual = run(model, ids, mask, max_new_tokens=NEW_TOKENS, cache_implementation=cache_name, cache_config=config)
    assert_same_generation(expected, actual)


def test_prefill_in_chunks_then_decoding_equals_dynamic_cache(model):
    """Steps of several tokens after the first (a chunked prefill) and decode steps continue the compressor's
    buffer and entries as DynamicCache's do."""
    ids = random_ids(2, 23, seed=4, vocab=model.config.vocab_size)
    with torch.no_grad():
        expected = teacher_forced_logits(model, ids, DynamicCache(config=model.config), [5, 6, 3, 1])
        cache = PagedCache(model.config, {"page_size": 4})
        actual = teacher_forced_logits(model, ids, cache, [5, 6, 3, 1])
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    cache.release()


SPECS = {
    "quantized_values": lambda config: QuantDequantValues(config, bits=8, group_size=16, residual_length=2),
    "quantized_kv": lambda config: EncodedKVSpec(
        config, key_bits=4, value_bits=8, group_size=16, residual_length=2, page_size=4
    ),
}
"""The pure-torch spec of each quantized cache under the model matrix's settings (``matrix.MATRIX_CONFIGS``)."""


@pytest.mark.parametrize("cache", sorted(SPECS))
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_quantized_caches_give_their_specs_logits_within_the_matrix_bound(model, cache, prompt):
    """With codes read (the model matrix's settings) a quantized cache gives its spec's logits, within
    ``matrix.QUANTIZED_BOUND`` of DynamicCache's. The model reads the keys a layer returns as its values too (the
    pool stores no values), so ``quantized_values``, whose keys are exact, gives DynamicCache's; ``quantized_kv``'s
    int4 keys move them."""
    ids, mask = random_padded_batch(PROMPTS[prompt], model.config.vocab_size, torch.Generator().manual_seed(0), low=3)
    reference = run(model, ids, mask, max_new_tokens=NEW_TOKENS)
    settings = {"max_new_tokens": NEW_TOKENS, "cache_implementation": cache}
    ours = run(model, ids, mask, **settings, cache_config=dict(matrix.MATRIX_CONFIGS[cache]))
    spec = run(model, ids, mask, max_new_tokens=NEW_TOKENS, cache=SPECS[cache](model.config))
    assert_same_generation(spec, ours)
    outcome = matrix.compare("deepseek_v4", matrix.OWN, cache, reference, ours)
    assert outcome.status == "close"
    assert (outcome.difference == 0) == (cache == "quantized_values"), outcome


def test_beam_search_and_sampling_equal_dynamic_cache(model, cache_name):
    """Beams and returned sequences move the compressor's state with the pages."""
    ids, mask = padded_batch(PROMPTS["longer"], vocab=model.config.vocab_size, seed=1)
    config = lossless_config(cache_name)
    beams = {"num_beams": 3, "max_new_tokens": 8}
    assert torch.equal(
        model.generate(ids, attention_mask=mask, **beams),
        model.generate(ids, attention_mask=mask, cache_implementation=cache_name, cache_config=config, **beams),
    )
    sampling = {"do_sample": True, "num_return_sequences": 2, "max_new_tokens": 8}
    torch.manual_seed(0)
    expected = model.generate(ids, attention_mask=mask, **sampling)
    torch.manual_seed(0)
    actual = model.generate(ids, attention_mask=mask, cache_implementation=cache_name, cache_config=config, **sampling)
    assert torch.equal(expected, actual)


@ROW_CHANGES
def test_row_changes_move_the_compressor_state_with_the_pages(model, change, rows):
    """After a row change the next step's logits are those of the changed rows fed from the start (13 tokens: past
    the window, entries and buffered tokens in both compressors)."""
    ids = random_ids(3, 13, seed=2, vocab=model.config.vocab_size)
    cache = PagedCache(model.config)
    with torch.no_grad():
        model(ids, cache=cache)
        change(cache)
        next_ids = random_ids(len(rows), 1, seed=3, vocab=model.config.vocab_size)
        actual = model(next_ids, cache=cache).logits[:, -1]
        expected = reference_logits(model, ids[rows], next_ids)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    cache.release()


def test_a_crop_is_refused_by_name_and_crops_nothing(model, cache_name):
    """transformers cannot cut a compressor's state back (``is_croppable`` is false on its layers): neither do we,
    before anything is cropped; prompt lookup refuses the cache as it refuses DynamicCache."""
    ids = random_ids(2, 11, seed=7, vocab=model.config.vocab_size)
    cache = REGISTRY[cache_name].cache_class(model.config, lossless_config(cache_name))
    assert not cache.is_croppable and not DynamicCache(config=model.config).is_croppable
    with torch.no_grad():
        model(ids, cache=cache)
        with pytest.raises(ValueError, match=r"layers \[1, 2\] \(compressed_sparse_attention\).*cannot be cut back"):
            cache.crop(-3)
        assert cache.get_seq_length() == 11
        next_ids = random_ids(2, 1, seed=8, vocab=model.config.vocab_size)
        actual = model(next_ids, cache=cache).logits[:, -1]
    torch.testing.assert_close(actual, reference_logits(model, ids, next_ids), rtol=1e-5, atol=1e-5)
    cache.release()
    lookup = {"max_new_tokens": 6, "prompt_lookup_num_tokens": 3}
    repeating = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    for settings in ({}, {"cache_implementation": cache_name, "cache_config": lossless_config(cache_name)}):
        with pytest.raises(ValueError, match="cache that can be cropped"):
            model.generate(repeating, **lookup, **settings)


def test_the_cache_counts_the_window_pages_and_the_compressor_state(model):
    """Pages hold the window's one tensor, once (the model reads its keys as its values), and go back behind the
    window; ``state_bytes`` is what DynamicCache's compressors hold, fed the same tokens; ``memory_stats()`` and the
    pool's ``stats()`` count the same bytes; all of it is given back on release."""
    pool = KVPool.for_model(model, PagedConfig(page_size=4), max_tokens=256)
    fmt = pool.format
    assert (fmt.num_layers, fmt.num_layer_groups, fmt.num_kv_heads, fmt.head_dim, fmt.value_dim) == (3, 1, 1, 16, 16)
    assert fmt.values_are_keys and fmt.page_bytes == 3 * 16 * 4 * 4  # layers x head_dim x fp32 x page_size
    cache = PagedCache(model.config, {"pool": pool})
    reference = DynamicCache(config=model.config)
    ids = random_ids(2, 21, seed=5, vocab=model.config.vocab_size)
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids, cache=reference)
        for step in range(9):  # decoding past another heavy compression window: pages behind the window go back
            next_ids = random_ids(2, 1, seed=6 + step, vocab=model.config.vocab_size)
            model(next_ids, cache=cache)
            model(next_ids, cache=reference)
    expected = compressor_bytes(reference)
    entries = 2 * 16 * 4 * (30 // 4 + 30 // 8) + 2 * 128 * 4 * (30 // 4)  # rows x width x fp32 x entries
    assert expected > entries  # the compressed entries and the tokens buffered, the overlap
    stats = cache.memory_stats()
    assert stats["pages_held"] == 2 * window_pages_per_row(WINDOW, 0, 4) == 2 * 4 and stats["tokens_per_row"] == 30
    assert stats["state_bytes"] == expected
    assert stats["bytes_held"] == stats["pages_held"] * fmt.page_bytes + expected
    pool_stats = pool.stats()  # the pool holds this cache's pages only
    assert pool_stats["pages_used"] == stats["pages_held"] and pool_stats["page_bytes"] == fmt.page_bytes
    assert pool_stats["bytes_used"] == stats["bytes_held"] - expected == 2 * 4 * 3 * 16 * 4 * 4
    cache.release()
    assert pool.stats()["pages_used"] == 0 and cache.memory_stats()["state_bytes"] == 0
    second = random_ids(3, 13, seed=20, vocab=model.config.vocab_size)
    next_ids = random_ids(3, 1, seed=21, vocab=model.config.vocab_size)
    with torch.no_grad():  # a released cache serves the next prompt (another batch size) as a fresh one
        model(second, cache=cache)
        actual = model(next_ids, cache=cache).logits[:, -1]
    torch.testing.assert_close(actual, reference_logits(model, second, next_ids), rtol=1e-5, atol=1e-5)
    cache.release()


def test_prefix_caching_is_refused_once_with_its_reason(model, caplog, monkeypatch):
    """The compressor's state lives outside the pool's pages a cached prefix restores: prompts are not reused."""
    monkeypatch.setattr(prefix_module, "_logged", set())
    pool = KVPool.for_model(model, PagedConfig(page_size=4), max_tokens=512, prefix_caching=True)
    ids = random_ids(1, 18, seed=9, vocab=model.config.vocab_size)
    expected = run(model, ids, None, max_new_tokens=4)
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        for _ in range(2):
            actual = run(
                model, ids, None, max_new_tokens=4, cache_implementation="paged_pool", cache_config={"pool": pool}
            )
            assert_same_generation(expected, actual)
    refusals = [record.message for record in caplog.records if "Prefix caching is off" in record.message]
    assert len(refusals) == 1 and "compressed-attention layers [1, 2]" in refusals[0], refusals
    stats = pool.stats()
    assert stats["prefix_lookups"] == 0 and stats["pages_cached"] == 0


def test_decoding_is_not_compiled(model, cache_name):
    """transformers compiles neither the model (``_can_compile_fullgraph`` is false) nor its compressed layers'
    cache: generate runs eager."""
    assert not type(model)._can_compile_fullgraph
    assert not REGISTRY[cache_name].cache_class(model.config, lossless_config(cache_name)).is_compileable


STORED_ONCE = {
    # bytes of a token in the tiny model's 3 layers (one head of 16 channels each), its one tensor stored as keys only
    "paged_pool": 3 * 16 * 4,  # fp32
    "sliding_ring": 3 * 16 * 4,
    "quantized_values": 3 * 16 * 4,  # no values to code: the keys in fp32, as paged_pool's
    "quantized_kv": 3 * 16 * (4 // 2 + 3) // 4,  # int4 keys per channel over a page of 4: 2 bytes of codes, 3 of scale
}
"""Bytes per token of each cache under the model matrix's settings (``matrix.MATRIX_CONFIGS``). Stored as keys and as
values, the lossless caches' were twice these, ``quantized_values``' 264 (int8 values, an fp32 scale and zero each)
and ``quantized_kv``'s 132."""


@pytest.mark.parametrize("cache", sorted(matrix.MATRIX_CONFIGS))
def test_a_page_stores_the_shared_tensor_once(model, cache):
    """The model writes one tensor as its keys and its values: a page stores it once (half the bytes of a page that
    stores it twice), the pool's values are its keys (nothing allocated for them), and its storage is the bytes its
    format counts."""
    cache_config = REGISTRY[cache].config(matrix.MATRIX_CONFIGS[cache])
    fmt = cache_config.page_format(model.config, torch.float32)
    assert fmt.values_are_keys and fmt.value_bits is None
    assert fmt.token_bytes == STORED_ONCE[cache] and fmt.page_bytes == fmt.token_bytes * fmt.page_size
    if not fmt.encodes:
        assert 2 * fmt.page_bytes == dataclasses.replace(fmt, values_are_keys=False).page_bytes
    pool = KVPool.for_model(model, cache_config, max_tokens=64)
    storage = pool.pages.storage
    assert storage.values is storage.keys and len(storage.tensors) == (3 if fmt.keys_per_channel else 1)
    assert sum(tensor.nbytes for tensor in storage.tensors) == pool.stats()["bytes_reserved"]
    assert pool.stats()["bytes_reserved"] == storage.num_pages * fmt.page_bytes


class PoolTraffic(TorchDispatchMode):
    """Counts the writes (``index_put_``) into and gathers (``index_select``) out of a pool's storage tensors."""

    def __init__(self, storage) -> None:
        super().__init__()
        self.storages = {tensor.untyped_storage().data_ptr() for tensor in (storage.keys, storage.values)}
        self.writes = self.gathers = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is not None and target.untyped_storage().data_ptr() in self.storages:
            self.writes += func is torch.ops.aten.index_put_.default
            self.gathers += func is torch.ops.aten.index_select.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("steps", [[11], [11, 1]], ids=["prefill", "decode"])
def test_a_step_writes_and_gathers_the_shared_tensor_once_a_layer(model, steps):
    """Each layer writes the model's one tensor into its slots once and gathers it once, for keys and values alike."""
    pool = KVPool.for_model(model, PagedConfig(page_size=4), max_tokens=256)
    cache = PagedCache(model.config, {"pool": pool})
    with torch.no_grad():
        for step, length in enumerate(steps):
            ids = random_ids(2, length, seed=30 + step, vocab=model.config.vocab_size)
            with PoolTraffic(pool.pages.storage) as traffic:
                model(ids, cache=cache)
    assert (traffic.writes, traffic.gathers) == (3, 3)
    cache.release()


def test_the_quantized_caches_have_no_values_to_code(model, caplog, monkeypatch):
    """``quantized_values`` stores the keys as ``paged_pool`` does and holds its bytes, no residual window; asking for
    value codes is said once, in a warning; ``quantized_kv`` returns its decoded keys as the values, the tensor the
    model reads as both."""
    monkeypatch.setattr(format_module, "_logged", set())
    ids = random_ids(2, 13, seed=40, vocab=model.config.vocab_size)
    held = {}
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"), torch.no_grad():
        for name in ("paged_pool", "quantized_values", "quantized_kv"):
            cache = REGISTRY[name].cache_class(model.config, dict(matrix.MATRIX_CONFIGS[name]))
            model(ids, cache=cache)
            held[name] = cache.memory_stats()
            next_keys = torch.randn(2, 1, 1, 16)
            keys, values = cache.update(next_keys, next_keys, 1)
            assert values is keys and keys.shape == (2, 1, WINDOW, 16)
            cache.release()
    warnings = [record.message for record in caplog.records if "no values to code" in record.message]
    assert len(warnings) == 1 and "value_bits=8" in warnings[0], warnings  # both quantized caches ask for 8
    assert held["quantized_values"]["bytes_held"] == held["paged_pool"]["bytes_held"]
    assert held["quantized_values"]["residual_bytes"] == 0


def test_a_pool_that_stores_the_keys_as_values_refuses_other_values(model):
    """A model writing values other than its keys into such a pool is refused by name, before a slot is written."""
    cache = PagedCache(model.config)
    keys = torch.randn(1, 1, 3, 16)
    with pytest.raises(IncompatibleModelError, match="values_are_keys"):
        cache.update(keys, keys.clone(), 0)
    cache.release()
