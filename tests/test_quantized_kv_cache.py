"""QuantizedKVCache: equal to its pure-torch spec, encode-once, every generate mode, bytes per token."""

import pytest
import torch
from helpers import padded_batch, random_ids, run, teacher_forced_logits
from transformers import DynamicCache

import hf_kvcache  # noqa: F401  (registers "quantized_kv")
from hf_kvcache import KVPool, PageFormat, PoolExhaustedError, QuantizedKVCache, QuantizedKVConfig, QuantizedValueCache
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.layers import WindowLayer
from hf_kvcache.memory.quant import QuantFormat, dequantize, quantize

MODELS = ["tiny_llama_model", "tiny_mistral_model", "tiny_gemma3_model"]


class EncodedKVSpec(DynamicCache):
    """The spec: a DynamicCache whose attention sees keys of every full page (``page_size`` tokens from token 0)
    through their encoding and the page still filling exact, and values through quantize -> dequantize but the newest
    ``residual_length``; a step of several tokens (a prefill, a chunk) sees its own keys and values exact. It keeps
    every layer's exact keys to encode pages a sliding layer no longer returns."""

    def __init__(
        self, config, key_bits, value_bits, group_size, residual_length=0, page_size=16, sink_tokens=0
    ) -> None:
        super().__init__(config=config)
        self.key_bits, self.value_bits, self.group_size = key_bits, value_bits, group_size
        self.residual_length, self.page_size, self.sink_tokens = residual_length, page_size, sink_tokens
        self.history: dict[int, torch.Tensor] = {}

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self.history = {idx: keys.index_select(0, beam_idx.to(keys.device)) for idx, keys in self.history.items()}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        scale_dtype = torch.float16 if values.dtype == torch.float32 else values.dtype
        history = self.history.get(layer_idx)
        history = key_states if history is None else torch.cat([history, key_states], dim=2)
        self.history[layer_idx] = history
        full = history.shape[2] // self.page_size * self.page_size
        encoded = history.clone()
        if full:
            pages = history[:, :, :full].unflatten(2, (-1, self.page_size))  # [batch, heads, pages, page_size, dim]
            if self.key_bits == 4:
                fmt = QuantFormat(4, self.page_size, self.page_size, compact_params=True)
                channels = pages.transpose(-1, -2)
                pages = dequantize(*quantize(channels, fmt), fmt, pages.dtype).transpose(-1, -2)
            else:
                fmt = QuantFormat(8, self.group_size, pages.shape[-1], scale_dtype)
                pages = dequantize(*quantize(pages, fmt), fmt, pages.dtype)
            encoded[:, :, :full] = pages.flatten(2, 3)
        keys = encoded[:, :, history.shape[2] - keys.shape[2] :]
        fmt = QuantFormat(self.value_bits, self.group_size, values.shape[-1], scale_dtype)
        attended = dequantize(*quantize(values, fmt), fmt, values.dtype)
        keep = min(self.residual_length, values.shape[2])
        if keep:
            attended[:, :, -keep:] = values[:, :, -keep:]
        if self.sink_tokens and not self.layers[layer_idx].is_sliding:  # full layers: the first tokens exact
            keys[:, :, : self.sink_tokens] = history[:, :, : self.sink_tokens]
            attended[:, :, : self.sink_tokens] = values[:, :, : self.sink_tokens]
        num_new = key_states.shape[2]
        if num_new > 1:  # the step's own tokens, as given
            keys[:, :, -num_new:] = key_states
            attended[:, :, -num_new:] = value_states
        return keys, attended


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize(
    "cache_class, settings",
    [
        (QuantizedKVCache, {"key_bits": 4, "value_bits": 4, "residual_length": 0}),
        (QuantizedKVCache, {"key_bits": 8, "value_bits": 4, "residual_length": 5, "sink_tokens": 4}),
        (QuantizedValueCache, {"bits": 4, "residual_length": 0}),
    ],
    ids=["kv-k4v4", "kv-k8v4-sink", "values-int4"],
)
def test_a_prefill_attends_to_its_own_keys_and_values_exact(model_name, cache_class, settings, request):
    """A prompt's forward pass reads its own keys and values as given, not through their codes (as transformers'
    QuantizedCache does): its logits are DynamicCache's, on full, sliding and hybrid models, padded rows included.
    What the prompt stores is then coded from exact states, and no coding error compounds through its layers (on
    SmolLM2 that cut the KL of 512-token essays to a fifth)."""
    model = request.getfixturevalue(model_name)
    ids, mask = padded_batch([40, 29], seed=3)
    expected = model(ids, attention_mask=mask, cache=DynamicCache(config=model.config)).logits
    actual = model(ids, attention_mask=mask, cache=cache_class(model.config, settings)).logits
    keep = mask.bool()
    torch.testing.assert_close(actual[keep], expected[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("key_bits,value_bits,residual_length", [(8, 4, 0), (4, 4, 5), (4, 8, 40)])
@pytest.mark.parametrize("chunks", [[30, 1], [3, 7, 1], [50, 2], [16, 16, 1]])
def test_cache_equals_its_encode_once_spec(model_name, key_bits, value_bits, residual_length, chunks, request):
    """Prefill and decode, chunks around the page (16), the window (8) and longer than a ring (32 slots), on full,
    sliding and hybrid models: logits equal the reference that encodes each full page once."""
    model = request.getfixturevalue(model_name)
    ids = random_ids(2, 80, seed=key_bits + residual_length)
    settings = {"key_bits": key_bits, "value_bits": value_bits, "group_size": 8, "residual_length": residual_length}
    expected = teacher_forced_logits(model, ids, EncodedKVSpec(model.config, **settings), chunks)
    actual = teacher_forced_logits(model, ids, QuantizedKVCache(model.config, settings), chunks)
    # The cache is compileable, so the model hands sdpa a materialized mask where the reference (not compileable)
    # gets is_causal: another kernel path, logits up to 1.2e-5 apart.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("key_bits,sink_tokens", [(4, 16), (8, 5)])
def test_sink_tokens_are_exact(model_name, key_bits, sink_tokens, request):
    """``sink_tokens``: the first tokens' keys and values reach attention exact (full layers; a ring's leave it),
    written in a prefill shorter or longer than them and decode steps."""
    model = request.getfixturevalue(model_name)
    ids = random_ids(2, 60, seed=sink_tokens)
    settings = {"key_bits": key_bits, "value_bits": 4, "group_size": 8, "residual_length": 5}
    for chunks in ([3, 1], [30, 1]):
        spec = EncodedKVSpec(model.config, **settings, sink_tokens=sink_tokens)
        expected = teacher_forced_logits(model, ids, spec, chunks)
        cache = QuantizedKVCache(model.config, {**settings, "sink_tokens": sink_tokens})
        actual = teacher_forced_logits(model, ids, cache, chunks)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        assert cache.memory_stats()["residual_bytes"] > 0


@pytest.mark.parametrize("key_bits", [8, 4])
def test_full_pages_are_encoded_once_and_never_change(tiny_llama_model, key_bits):
    """A page's codes are written when its last slot is, and stay as they are while tokens are added."""
    cache = QuantizedKVCache(tiny_llama_model.config, {"key_bits": key_bits, "group_size": 16, "residual_length": 0})
    keys, values = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    out_keys, _ = cache.update(keys, values, 0)
    pool = cache.pool
    storage = pool.pages.storage
    page_ids = cache.layers[0].rows.table.rows[0]
    assert len(page_ids) == 3
    torch.testing.assert_close(out_keys[:, :, 32:], keys[:, :, 32:], rtol=0, atol=0)  # the page still filling: exact
    assert not storage.keys[0][:, page_ids[2]].any()  # ... and not in the pool yet
    before = [tensor[0][:, page_ids[:2]].clone() for tensor in storage.tensors if tensor is not storage.values]
    for step in range(30):  # fills page 2 (token 47), then page 3 (token 63) and on
        out_keys, _ = cache.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0)
        after = [tensor[0][:, page_ids[:2]] for tensor in storage.tensors if tensor is not storage.values]
        assert all(torch.equal(old, new) for old, new in zip(before, after)), f"step {step} changed a full page"
    assert storage.keys[0][:, page_ids[2]].any()  # encoded once it filled
    assert cache.memory_stats()["residual_bytes"] == 2 * 16 * 16 * 4  # one page of fp32 keys per row, head (layer 0)


@pytest.mark.parametrize("key_bits", [8, 4])
def test_beams_on_a_hybrid_model_equal_the_spec(tiny_gemma3_model, key_bits):
    """Gemma 3's sliding layers stay rings of encoded pages; beams share pages copy-on-write."""
    ids = random_ids(2, 21, seed=5)
    settings = {"key_bits": key_bits, "value_bits": 4, "group_size": 16, "residual_length": 4, "page_size": 4}
    cache = QuantizedKVCache(tiny_gemma3_model.config, settings)
    greedy = run(tiny_gemma3_model, ids, None, max_new_tokens=20, cache=cache)
    assert [type(layer) for layer in cache.layers][:3] == [WindowLayer] * 3
    reference = run(
        tiny_gemma3_model, ids, None, max_new_tokens=20, cache=EncodedKVSpec(tiny_gemma3_model.config, **settings)
    )
    assert torch.equal(reference.sequences, greedy.sequences)
    beams = {"num_beams": 3, "max_new_tokens": 12}
    assert torch.equal(
        tiny_gemma3_model.generate(ids, cache=EncodedKVSpec(tiny_gemma3_model.config, **settings), **beams),
        tiny_gemma3_model.generate(ids, cache_implementation="quantized_kv", cache_config=settings, **beams),
    )


@pytest.mark.parametrize("key_bits", [8, 4])
def test_a_padded_ring_row_equals_the_row_alone(tiny_mistral_model, key_bits):
    """A ring row counts its pages from its first real token (its padding is kept nowhere): a left-padded row of a
    batch generates what it generates alone."""
    lengths = [21, 6, 13]
    ids, mask = padded_batch(lengths, seed=4)
    settings = {"key_bits": key_bits, "value_bits": 8, "group_size": 16, "residual_length": 0, "page_size": 4}
    batch = run(
        tiny_mistral_model, ids, mask, max_new_tokens=15, cache_implementation="quantized_kv", cache_config=settings
    )
    for row, length in enumerate(lengths):
        alone = ids[row : row + 1, ids.shape[1] - length :]
        single = run(
            tiny_mistral_model,
            alone,
            None,
            max_new_tokens=15,
            cache_implementation="quantized_kv",
            cache_config=settings,
        )
        assert torch.equal(single.sequences[0], batch.sequences[row, ids.shape[1] - length :]), f"row {row}"


def test_crop_into_an_encoded_page_continues_from_its_decoded_keys(tiny_llama_model):
    cache = QuantizedKVCache(tiny_llama_model.config, {"key_bits": 4, "group_size": 16, "residual_length": 0})
    keys = torch.randn(1, 2, 41, 16)
    cache.update(keys[:, :, :40], torch.randn(1, 2, 40, 16), 0)  # a prefill reads its own keys exact
    full, _ = cache.update(keys[:, :, 40:], keys[:, :, 40:], 0)  # the next step reads pages 0 and 1 decoded
    full = full.clone()
    cache.update(keys[:, :, :1], keys[:, :, :1], 1)
    cache.crop(-(41 - 20))  # back into page 1, encoded: its first 4 tokens come back decoded
    assert cache.get_seq_length() == 20
    again, _ = cache.update(keys[:, :, 20:21], keys[:, :, 20:21], 0)
    torch.testing.assert_close(again[:, :, :20], full[:, :, :20], rtol=0, atol=0)


def test_a_ring_crop_into_an_encoded_page_continues_from_its_decoded_keys(tiny_mistral_model):
    """A ring of window 8 in pages of 4 (3 pages): cropping 3 tokens moves the page still filling back into the ring
    page encoded last; the window's tokens read as before."""
    cache = QuantizedKVCache(
        tiny_mistral_model.config, {"key_bits": 4, "group_size": 16, "residual_length": 0, "page_size": 4}
    )
    keys = torch.randn(1, 2, 40, 16)
    cache.update(keys[:, :, :39], keys[:, :, :39], 0)
    before, _ = cache.update(keys[:, :, 39:40], keys[:, :, 39:40], 0)  # tokens 32..39 visible, all encoded
    before = before.clone()
    cache.crop(-3)
    after, _ = cache.update(keys[:, :, 37:38], keys[:, :, 37:38], 0)  # tokens 30..37: 36 decoded, 37 exact
    torch.testing.assert_close(after[:, :, 2:7], before[:, :, :5], rtol=0, atol=0)
    torch.testing.assert_close(after[:, :, 7], keys[:, :, 37], rtol=0, atol=0)


def test_pool_exhaustion_fails_alone_and_returns_the_pages(tiny_llama_model, make_pool):
    pool = make_pool(tiny_llama_model, "quantized_kv", max_tokens=64, page_size=8)
    ids, mask = padded_batch([20, 17], seed=3)
    config = {**REGISTRY["quantized_kv"].example_config, "pool": pool}
    with pytest.raises(PoolExhaustedError):
        tiny_llama_model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=40,
            min_new_tokens=40,
            cache_implementation="quantized_kv",
            cache_config=config,
        )
    assert pool.stats()["pages_used"] == 0
    out = tiny_llama_model.generate(
        ids, attention_mask=mask, max_new_tokens=5, cache_implementation="quantized_kv", cache_config=config
    )
    assert out.shape == (2, ids.shape[1] + 5)
    pool.check_integrity()


@pytest.mark.parametrize("key_bits,most", [(4, 7_492), (8, 9_400)])
def test_pool_bytes_per_token_on_smollm2_geometry(key_bits, most):
    """SmolLM2-135M in float32 (30 layers, 3 KV heads, head_dim 64): int4 keys and values take no more of the pool
    per token than transformers' quanto int4 QuantizedCache (7,492 bytes; issue 17), int8 keys + int4 values 9,360."""
    smollm2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
    config = type("Config", (), {**smollm2, "hidden_size": 576})()
    options = QuantizedKVConfig(key_bits=key_bits, value_bits=4)
    page_format = options.page_format(config, torch.float32)
    pool = KVPool(page_format, num_pages=4)
    stats = pool.stats()
    per_token = stats["page_bytes"] / stats["page_size"]
    assert per_token == page_format.token_bytes == {4: 7_200, 8: 9_360}[key_bits] <= most
    plain = PageFormat.from_model_config(config, torch.float32)
    assert plain.token_bytes == 46_080  # keys and values in float32, for scale


def test_bad_settings_name_the_key(tiny_llama_model):
    with pytest.raises(ValueError, match="key_bits=2 is not supported: choose key_bits=8 or key_bits=4"):
        QuantizedKVCache(tiny_llama_model.config, {"key_bits": 2})
    with pytest.raises(ValueError, match="page_size=5 is odd: key_bits=4"):
        QuantizedKVCache(tiny_llama_model.config, {"page_size": 5, "group_size": 16})
    with pytest.raises(ValueError, match=r"Unknown cache_config keys \['bits'\]"):
        QuantizedKVConfig.parse({"bits": 4})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key_bits", [8, 4])
def test_decoded_keys_equal_the_reference_bitwise(tiny_llama_model, key_bits, dtype):
    """The keys' decoder (the stored codes gathered by page) against the reference ``dequantize`` of the same stored
    codes (int4: a channel's byte ``i`` of a page holds its tokens ``i`` and ``i + page_size / 2``)."""
    cache = QuantizedKVCache(
        tiny_llama_model.config,
        {"key_bits": key_bits, "group_size": 8, "page_size": 4, "max_tokens": 64},
        dtype=dtype,
        device="cpu",
    )
    states = (torch.randn(2, 2, 13, 16) * torch.linspace(0.1, 20, 16)).to(dtype)  # channels of many magnitudes
    cache.update(states, states, 0)
    rows = cache.layers[0].rows
    storage, fmt, ids = cache.pool.pages.storage, cache.pool.format, rows._page_ids()[:, :3]  # the 3 full pages
    page_rows = (torch.arange(2).view(1, -1, 1) * storage.num_pages + ids.unsqueeze(1)).view(-1)
    decoded = rows.store.keys.codes.decode(storage, 0, page_rows, dtype)  # [batch * heads * 3, page_size, head_dim]
    fast = decoded.view(2, 2, 12, -1)  # [batch, heads, 12, head_dim]
    layer = (storage.keys[0], storage.key_scales[0])
    codes, scales = (tensor[:, ids].transpose(0, 1) for tensor in layer)  # [batch, heads, 3, ...]
    quant = fmt.key_format
    if key_bits == 4:
        channels = codes.transpose(-1, -2)  # a page's bytes [page_size // 2, head_dim], a channel's: [head_dim, 2]
        zeros = storage.key_zeros[0][:, ids].transpose(0, 1).mT  # [batch, heads, 3, head_dim, 1]
        paired = dequantize(channels, scales.mT, zeros, quant, dtype)  # a channel's tokens 0, 2, 1, 3
        reference = paired.unflatten(-1, (2, 2)).transpose(-1, -2).flatten(-2).transpose(-1, -2)
    else:
        groups = quant.num_scale_groups
        reference = dequantize(codes, scales[..., :groups], scales[..., groups:], quant, dtype)
    assert torch.equal(fast, reference.flatten(2, 3))
    two_bytes = torch.int16 if key_bits == 4 else torch.float16 if dtype == torch.float32 else dtype
    assert storage.key_scales.dtype == two_bytes  # 2-byte scales (int4: the compact word, with an int8 zero)


def test_greedy_on_smollm2_follows_dynamic(bundled):
    """The real model: greedy tokens with int8 keys and values equal DynamicCache's on most prompts; with int4 keys
    they follow it for a while past the first encoded page (measured: first divergence after 10-32 new tokens, mean
    20, with the compact scale and zero of issue 29, 13-32 before it; quanto's int4 QuantizedCache diverged after
    3-13. One prompt's divergence is chaotic: the fix lowered the mean KL on real text by a third, see
    benchmarks/key_fidelity_512.json)."""
    model, tokenizer = bundled
    prompts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "def fibonacci(n):",
        "Three facts about the moon:",
        "Once upon a time, in a small village,",
    ]
    same, agreed = 0, []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1] :]
        for key_bits in (8, 4):
            actual = model.generate(
                ids,
                max_new_tokens=48,
                do_sample=False,
                cache_implementation="quantized_kv",
                cache_config={"key_bits": key_bits, "value_bits": 8},
            )[0, ids.shape[1] :]
            if key_bits == 8:
                same += torch.equal(expected, actual)
            else:
                length = min(len(expected), len(actual))
                differ = (expected[:length] != actual[:length]).nonzero()
                agreed.append(int(differ[0]) if len(differ) else length)
    assert same >= 4, f"int8 keys: {same} of 5 prompts identical for 48 tokens"
    assert min(agreed) >= 10 and sum(agreed) / len(agreed) >= 16, (
        f"int4 keys: tokens before the first divergence {agreed}"
    )
