"""QuantizedValueCache: equal to its pure-torch spec, bytes per token, hybrid models, greedy on SmolLM2."""

import pytest
import torch
from helpers import padded_batch, random_ids, run, teacher_forced_logits
from transformers import DynamicCache

import hf_kvcache  # noqa: F401  (registers "quantized_values")
from hf_kvcache import IncompatibleModelError, KVPool, PagedCache, QuantizedValueCache, QuantizedValueConfig
from hf_kvcache.layers import WindowLayer
from hf_kvcache.layers.rows import PagedRows
from hf_kvcache.memory.quant import QuantFormat, dequantize, quantize
from hf_kvcache.testing import tiny_causal_lm, tiny_llama
from hf_kvcache.transformers_internals import DummyLayer


class QuantDequantValues(DynamicCache):
    """The spec: a DynamicCache whose attention sees values through quantize -> dequantize, except the newest
    ``residual_length`` tokens, and a step of several tokens (a prefill, a chunk) its own, which it sees in full
    precision."""

    def __init__(self, config, bits: int, group_size: int, residual_length: int = 0) -> None:
        super().__init__(config=config)
        self.bits, self.group_size, self.residual_length = bits, group_size, residual_length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        fmt = QuantFormat(self.bits, self.group_size, values.shape[-1])
        attended = dequantize(*quantize(values, fmt), fmt, values.dtype)
        keep = min(self.residual_length, values.shape[2])
        if value_states.shape[2] > 1:  # a step of several tokens sees its own exact
            keep = max(keep, value_states.shape[2])
        if keep:
            attended[:, :, -keep:] = values[:, :, -keep:]
        return keys, attended


MODELS = ["tiny_llama_model", "tiny_mistral_model", "tiny_gemma3_model"]


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("bits,residual_length", [(8, 0), (4, 0), (4, 5), (4, 40)])
@pytest.mark.parametrize("chunks", [[30, 1], [3, 7, 1], [50, 2]])
def test_cache_equals_its_quantize_dequantize_spec(model_name, bits, residual_length, chunks, request):
    """Prefill and decode, chunk sizes around the window (8) and the residual window, on full, sliding and
    hybrid models: logits equal the reference DynamicCache that quantizes and dequantizes values."""
    model = request.getfixturevalue(model_name)
    ids = random_ids(2, 80, seed=bits + residual_length)
    settings = {"bits": bits, "group_size": 8, "residual_length": residual_length}
    expected = teacher_forced_logits(model, ids, QuantDequantValues(model.config, **settings), chunks)
    actual = teacher_forced_logits(model, ids, QuantizedValueCache(model.config, settings), chunks)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_generate_with_padding_and_beams_equals_the_spec(tiny_gemma3_model, bits):
    """transformers' QuantizedCache refuses hybrid models; ours keeps ring semantics on Gemma 3's sliding layers."""
    ids, mask = padded_batch([14, 5, 9])
    settings = {"bits": bits, "group_size": 16, "residual_length": 4}
    cache = QuantizedValueCache(tiny_gemma3_model.config, settings)
    reference = run(
        tiny_gemma3_model, ids, mask, max_new_tokens=20, cache=QuantDequantValues(tiny_gemma3_model.config, **settings)
    )
    ours = run(tiny_gemma3_model, ids, mask, max_new_tokens=20, cache=cache)
    assert torch.equal(reference.sequences, ours.sequences)
    assert [type(layer) for layer in cache.layers][:3] == [WindowLayer] * 3
    beams = {"num_beams": 3, "max_new_tokens": 12, "cache_config": settings}
    assert torch.equal(
        tiny_gemma3_model.generate(
            ids,
            attention_mask=mask,
            cache=QuantDequantValues(tiny_gemma3_model.config, **settings),
            num_beams=3,
            max_new_tokens=12,
        ),
        tiny_gemma3_model.generate(ids, attention_mask=mask, cache_implementation="quantized_values", **beams),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits,target", [(8, 0.77), (4, 0.65)])
def test_pool_bytes_per_token_against_the_paged_cache(dtype, bits, target):
    """Measured from pool.stats() as tokens are added past the residual window, SmolLM2's head geometry."""
    model = tiny_llama(hidden_size=192, num_attention_heads=3, num_key_value_heads=3, head_dim=64)

    def bytes_per_token(cache) -> float:
        pool = cache.pool
        used = []
        for length in (256, 1024):
            states = torch.randn(1, 3, length - cache.get_seq_length(), 64, dtype=dtype)
            for layer_idx in range(2):
                cache.update(states, states, layer_idx)
            used.append(pool.stats()["bytes_used"])
        return (used[1] - used[0]) / (1024 - 256)

    paged = bytes_per_token(PagedCache(model.config, {"max_tokens": 2048}, dtype=dtype, device="cpu"))
    quantized = QuantizedValueCache(
        model.config, {"bits": bits, "residual_length": 64, "max_tokens": 2048}, dtype=dtype, device="cpu"
    )
    ratio = bytes_per_token(quantized) / paged
    assert ratio <= target, f"int{bits} in {dtype}: {ratio:.3f} of the paged cache's bytes per token"


def test_values_are_quantized_once_and_keys_kept_exact(tiny_llama_model):
    cache = QuantizedValueCache(tiny_llama_model.config, {"bits": 4, "group_size": 16, "residual_length": 0})
    keys = torch.randn(1, 2, 40, 16)
    values = torch.randn(1, 2, 40, 16)
    out_keys, out_values = cache.update(keys, values, 0)
    fmt = QuantFormat(4, 16, 16)
    assert torch.equal(out_keys, keys)
    assert torch.equal(out_values, values)  # a prefill reads its own values as given
    pool = cache.pool
    assert (
        pool.pages.storage.values.dtype == torch.uint8 and pool.pages.storage.values.shape[-1] == 8
    )  # two codes per byte
    before = pool.pages.storage.values.clone(), pool.pages.storage.value_scales.clone()
    out_keys, out_values = cache.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0)
    assert torch.equal(out_keys[:, :, :40], keys)
    assert torch.equal(out_values[:, :, :40], dequantize(*quantize(values, fmt), fmt, values.dtype))  # stored codes
    changed = (pool.pages.storage.values != before[0]).any(dim=-1)  # [layers, heads, pages, slots]
    assert changed.sum() == 2  # one slot per head: the new token; the 40 before it are never re-quantized


def test_greedy_int8_matches_dynamic_on_smollm2(bundled):
    model, tokenizer = bundled
    prompts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "def fibonacci(n):",
        "Three facts about the moon:",
        "Once upon a time, in a small village,",
    ]
    same = 0
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = model.generate(ids, max_new_tokens=64, do_sample=False)
        actual = model.generate(
            ids, max_new_tokens=64, do_sample=False, cache_implementation="quantized_values", cache_config={"bits": 8}
        )
        same += torch.equal(expected, actual)
    assert same >= 4, f"{same} of 5 prompts identical for 64 tokens"


def test_pool_must_match_the_value_format(tiny_llama_model):
    full = KVPool.for_model(tiny_llama_model, max_tokens=256)
    with pytest.raises(IncompatibleModelError, match="value_bits None vs 4.*KVPool.for_model"):
        QuantizedValueCache(tiny_llama_model.config, {"bits": 4, "group_size": 16, "pool": full}).update(
            torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0
        )
    int4 = KVPool.for_model(tiny_llama_model, QuantizedValueConfig(bits=4, group_size=16), max_tokens=256)
    out = tiny_llama_model.generate(
        torch.tensor([[1, 2, 3]]),
        max_new_tokens=3,
        cache_implementation="quantized_values",
        cache_config={"bits": 4, "group_size": 16, "pool": int4},
        return_dict_in_generate=True,
    )
    assert out.cache.pool is int4


@pytest.mark.parametrize("bits,residual_length", [(8, 0), (4, 3)])
def test_layers_that_reuse_another_layers_kv_read_its_values_as_the_spec(bits, residual_length):
    """Gemma 3n's last layers read the keys and values of the last layer of each type before them (kv_sharing_modes
    "store" and "reuse"): those come back decoded in the buffers of their layer group, which the group's next layer
    would overwrite; each stores its group's last layer, so the reusing layers read them intact, as the spec's.
    Layers [sliding, full] x 3, the last two reusing: groups [0, 2] and [1, 3], each storing layer 2 and 3."""
    model = tiny_causal_lm(
        "gemma3n_text",
        num_hidden_layers=6,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 3,
    )
    assert model.config.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse"]
    ids = random_ids(2, 30, seed=bits, vocab=256)
    settings = {"bits": bits, "group_size": 8, "residual_length": residual_length}
    expected = teacher_forced_logits(model, ids, QuantDequantValues(model.config, **settings), [12, 1])
    cache = QuantizedValueCache(model.config, settings)
    actual = teacher_forced_logits(model, ids, cache, [12, 1])
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert [type(layer) for layer in cache.layers[4:]] == [DummyLayer, DummyLayer]


@pytest.mark.parametrize(
    "modes,found", [(["store", None, "reuse"], "layer 0's by layer 1"), ([None, None, "reuse"], "no layer is marked")]
)
def test_layers_that_reuse_kv_a_later_layer_of_its_group_overwrites_are_refused(modes, found):
    """A layer whose keys and values later layers read, followed by another layer of its layer group, would hand
    them the next layer's (or none is marked as storing them): refused by name; the paged cache serves both."""
    config = tiny_llama(num_hidden_layers=3).config
    config.kv_sharing_modes = modes
    with pytest.raises(IncompatibleModelError, match=f"shares KV between layers.*{found}.*paged_pool or sliding"):
        QuantizedValueCache(config, {"group_size": 16})
    assert isinstance(PagedCache(config).layers[2], DummyLayer)


@pytest.mark.parametrize("crop_to", [37, 48, 20])
@torch.no_grad()
def test_codes_of_a_step_written_at_its_end_equal_codes_written_by_each_layer(tiny_llama_model, crop_to, monkeypatch):
    """With a residual window, a one-token step's value codes are written for every layer at once after its last
    layer; the logits equal writing each layer's codes with it, through decode steps, a ``crop`` (inside a page, at a
    page's edge, back past the window) and the steps after it."""
    settings = {"bits": 4, "group_size": 8, "residual_length": 16}
    ids, other = random_ids(1, 70, seed=21), random_ids(1, 60, seed=22)

    def logits() -> torch.Tensor:
        cache = QuantizedValueCache(tiny_llama_model.config, settings)
        before = teacher_forced_logits(tiny_llama_model, ids, cache, [40, 1])
        cache.crop(crop_to - ids.shape[1])  # removes the tokens past crop_to
        return torch.cat([before, teacher_forced_logits(tiny_llama_model, other, cache, [1])], dim=1)

    at_the_end = logits()
    monkeypatch.setattr(PagedRows, "defers_codes", False)
    torch.testing.assert_close(at_the_end, logits(), rtol=0, atol=0)
