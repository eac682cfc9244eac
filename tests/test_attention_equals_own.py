"""Our attention (``attn_implementation="hf_kvcache"``) equals each model's own, through every cache, eager, on the
models of the matrix whose attention applies what plain sdpa does not.

The features, found by reading the ``attention_interface(...)`` calls and ``eager_attention_forward`` of every
modeling file of transformers 5.25:

- logit softcapping (``softcap``): Gemma 2, VaultGemma;
- attention sinks (``s_aux``): GPT-OSS, Granite-SWA, GraniteMoE-SWA, Flint (the last three refuse sdpa);
- attention scaling other than ``head_dim ** -0.5`` (``scaling``): Granite (``attention_multiplier``), Gemma 3
  (``query_pre_attn_scalar``);
- windows: sliding layers beside full ones (Gemma 2, Gemma 3, GPT-OSS, Cohere 2), chunked attention (Llama 4), a
  window ModernBERT's decoder applies inside its own eager function (``sliding_window``);
- top-k sparse attention (``indices``: DeepSeek's lightning indexer, DSA): DeepSeek-V3.2, GLM-MoE-DSA, A.X K2,
  Hunyuan-V4, Dots3. Under our attention the indexer's choice is folded into the mask as the model does under sdpa
  (``DSA_MODELS``, with ``DynamicCache``; our caches page their indexed layers: tests/test_indexed_attention.py);
- block-sparse attention (``block_indices``: MiniMax-M3's indexer): our caches keep its sparse layer's own cache
  layer and page the full-attention one; under either attention, every cache equals ``DynamicCache``.

Each model is tiny (``hf_kvcache.testing.tiny_causal_lm``) with the feature set where a tiny prompt feels it (a
window of 4, a softcap of 0.5, sinks far from zero); a left-padded batch of two rows, 8 greedy tokens; the reference
is the model under its own attention with ``DynamicCache``. Each cache keeps every token exactly
(``helpers.exact_config``), so any difference is the attention's. ``in place``: decode steps read the pages where
they lie wherever the read path allows it (``flex.MIN_IN_PLACE_TOKENS = 0``).
"""

import functools

import pytest
import torch
from helpers import assert_same_generation, exact_config, padded_batch, run
from transformers import DynamicCache

from hf_kvcache import KVPool
from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import ATTENTION_NAME, model_attention
from hf_kvcache.bench.model_matrix import MODEL_SETTINGS
from hf_kvcache.testing import tiny_causal_lm

PROMPT = [5, 11]
NEW_TOKENS = 8
CACHES = [None, "paged_pool", "sliding_ring", "quantized_values", "quantized_kv"]  # None: DynamicCache

SOFTCAP = {"attn_logit_softcapping": 1.0, "initializer_range": 0.5}
"""A softcap a tiny model feels: with the default init its scores stay far below any cap (tanh's linear part)."""
FEATURES = {  # model type -> (the feature's settings, the same model without it)
    "gemma2": ({**SOFTCAP, "sliding_window": 4}, {"attn_logit_softcapping": None}),
    "vaultgemma": ({**SOFTCAP, "sliding_window": 4}, {"attn_logit_softcapping": None}),
    "gpt_oss": ({"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}, {"sinks": 0.0}),
    "granite_swa": ({}, {"sinks": 0.0}),
    "granitemoe_swa": ({}, {"sinks": 0.0}),
    "flint": ({}, {"sinks": 0.0}),
    "granite": ({"attention_multiplier": 0.9}, {"attention_multiplier": 0.25}),
    "gemma3_text": (
        {"sliding_window": 4, "query_pre_attn_scalar": 3},
        {"sliding_window": 64, "query_pre_attn_scalar": 16},
    ),
    "cohere2": ({"sliding_window": 4}, {"sliding_window": 64}),
    "llama4_text": ({"attention_chunk_size": 4}, {"attention_chunk_size": 64}),
    "modernbert-decoder": ({"sliding_window": 4}, {"sliding_window": 64}),
}
"""The models, with the settings that make each feature show in a tiny run and settings that switch it off."""


def build(model_type: str, settings: dict, sinks: float | None = None):
    """The tiny model; its attention sinks (where it has any) set to values far from zero, or all to ``sinks``."""
    model = tiny_causal_lm(model_type, **settings)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                values = torch.linspace(-1.0, 2.0, module.sinks.numel()) if sinks is None else sinks
                module.sinks.copy_(torch.as_tensor(values).expand_as(module.sinks))
    return model


def generation(model, attention: str | None = None, cache: str | None = None):
    ids, mask = padded_batch(PROMPT, vocab=model.config.vocab_size, seed=3)
    ids = ids.masked_fill(mask.bool() & (ids < 3), 3)  # no bos/eos id inside a prompt
    settings = {}
    if cache is not None:
        settings = {"cache_implementation": cache, "cache_config": exact_config(cache, max(PROMPT) + NEW_TOKENS)}
    with model_attention(model, attention):
        return run(model, ids, mask, max_new_tokens=NEW_TOKENS, **settings)


@functools.cache
def model_and_reference(model_type: str):
    """The model with its feature and its run under its own attention with DynamicCache, once per model type."""
    model = build(model_type, FEATURES[model_type][0])
    return model, generation(model)


@pytest.fixture(autouse=True)
def drop_default_pools():
    yield
    KVPool.drop_defaults()


@pytest.mark.parametrize("model_type", sorted(FEATURES))
def test_the_feature_changes_the_models_own_output(model_type):
    """Each setting is one a tiny run feels: without it, the model's own logits move."""
    settings, without = FEATURES[model_type]
    model, reference = model_and_reference(model_type)
    sinks = without.get("sinks")
    plain = build(model_type, {**settings, **{k: v for k, v in without.items() if k != "sinks"}}, sinks)
    other = generation(plain)
    assert max((a - b).abs().max().item() for a, b in zip(reference.logits, other.logits)) > 1e-3


@pytest.mark.parametrize("cache", CACHES, ids=lambda cache: cache or "dynamic")
@pytest.mark.parametrize("model_type", sorted(FEATURES))
def test_our_attention_equals_the_models_own(model_type, cache):
    model, reference = model_and_reference(model_type)
    assert_same_generation(reference, generation(model, ATTENTION_NAME, cache))


@pytest.mark.parametrize("model_type", sorted(FEATURES))
def test_our_attention_equals_the_models_own_reading_in_place(model_type, monkeypatch):
    """Decode steps hand attention the pool's pages; FlexAttention reads them where its plain causal read is the
    model's (Granite's scaling, ModernBERT's full layers), the rest gather them for the model's own function or mask."""
    monkeypatch.setattr(flex, "MIN_IN_PLACE_TOKENS", 0)
    model, reference = model_and_reference(model_type)
    calls = flex.call_count()
    actual = generation(model, ATTENTION_NAME, "paged_pool")
    assert actual.cache.read_counts()["in place"] > 0
    assert_same_generation(reference, actual)
    if model_type in ("granite", "modernbert-decoder"):
        assert flex.call_count() > calls


DSA_MODELS = ["axk2", "deepseek_v32", "dots3_note_text", "glm_moe_dsa", "hy_v4"]
"""Models whose attention layers keep only the keys their indexer picks (``index_topk`` of them): under ``"eager"``
and ``"sdpa"`` the model folds the pick into the mask; under any other attention it passes ``indices=`` for the
attention function to apply, which ``attention.interface.banded_sdpa_attention`` folds into the mask as the model
does (``_sparse_mask``)."""


def _prefill_logits(model, attention: str | None) -> torch.Tensor:
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with model_attention(model, attention), torch.no_grad():
        return model(ids, cache=DynamicCache(config=model.config)).logits


@pytest.mark.parametrize("model_type", DSA_MODELS)
def test_sparse_attention_keeps_every_key_while_the_indexer_picks_all(model_type):
    """With ``index_topk`` above the prompt's length the indexer picks every key: ours equals the model's own."""
    model = tiny_causal_lm(model_type, index_topk=64)
    torch.testing.assert_close(_prefill_logits(model, ATTENTION_NAME), _prefill_logits(model, None))


@pytest.mark.parametrize("model_type", DSA_MODELS)
def test_sparse_attention_keeps_the_keys_its_indexer_picks(model_type):
    """The model folds its indexer's pick into the mask only under "eager" and "sdpa"; ours folds the ``indices=`` it
    passes any other attention (before, every key was attended: logits 0.008-0.31 of the largest off)."""
    model = tiny_causal_lm(model_type, **MODEL_SETTINGS[model_type])  # the indexer keeps 4 keys
    torch.testing.assert_close(_prefill_logits(model, ATTENTION_NAME), _prefill_logits(model, None))


MINIMAX_M3_SPARSE = MODEL_SETTINGS["minimax_m3_vl_text"]
"""MiniMax-M3's text model with a block-sparse layer (its lightning indexer keeps the top block of 2 keys and the
local one) beside a full-attention layer, as the matrix builds it."""
SPARSE_CACHES = [None, "paged_pool", "quantized_values", "quantized_kv"]  # no window to give a ring


@functools.cache
def minimax_m3_sparse():
    model = tiny_causal_lm("minimax_m3_vl_text", **MINIMAX_M3_SPARSE)
    return model, generation(model)


@pytest.mark.parametrize("cache", SPARSE_CACHES[1:3])
def test_block_sparse_layers_keep_their_own_cache_layer_under_the_models_attention(cache):
    """Under ``"sdpa"`` (the model folds its indexer's blocks into the mask) our lossless caches equal DynamicCache;
    the block-sparse layer keeps transformers' own cache layer."""
    model, reference = minimax_m3_sparse()
    actual = generation(model, None, cache)
    assert type(actual.cache.layers[0]).__name__ == "MiniMaxM3VLSparseCacheLayer"
    assert_same_generation(reference, actual)


@pytest.mark.parametrize("cache", SPARSE_CACHES, ids=lambda cache: cache or "dynamic")
def test_block_sparse_layers_under_our_attention(cache):
    """Ours folds the ``block_indices=`` MiniMax-M3's block-sparse layers pass (before: ignored, other tokens, logits
    0.81 off)."""
    model, reference = minimax_m3_sparse()
    assert_same_generation(reference, generation(model, ATTENTION_NAME, cache))
