"""Models whose attention applies more than sdpa does, or uses the cache's keys and values outside the attention
function, under ``attn_implementation="hf_kvcache"``: each equals the model under its own attention (``eager`` where
the model refuses ``sdpa``) with ``DynamicCache``.

The models are tiny random-init ones built from each model type's config (``AutoConfig.for_model``), fp32, eval.
"""

import pytest
import torch
import torch._dynamo
from helpers import padded_batch
from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig, DynamicCache, PreTrainedModel

from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import (
    ATTENTION_NAME,
    banded_sdpa_attention,
    hands_states_to_attention_only,
    model_attention,
)
from hf_kvcache.errors import IncompatibleModelError

_SIZES = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny(model_type: str, own: str, **overrides) -> PreTrainedModel:
    """A random-init 2-layer model of ``model_type`` under its own attention ``own``, 2 KV heads where it has any."""
    settings = {**_SIZES, "num_key_value_heads": 2, **overrides}
    settings = {name: value for name, value in settings.items() if value is not None}
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=own).to(torch.float32).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # every run makes max_new_tokens tokens
    return model


def greedy(model: PreTrainedModel, attention: str, lengths: list[int], max_new_tokens: int = 8, **kwargs):
    """Greedy ``generate`` over left-padded random prompts of ``lengths`` under ``attention``, with its logits."""
    ids, mask = padded_batch(lengths, seed=3)
    ids = ids.masked_fill(mask.bool() & (ids < 3), 3)  # no bos/eos id inside a prompt
    with model_attention(model, attention):
        return model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )


def assert_equal_runs(reference, candidate, atol: float = 1e-5) -> None:
    for step, (expected, actual) in enumerate(zip(reference.logits, candidate.logits, strict=True)):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=f"logits differ at step {step}")
    assert torch.equal(reference.sequences, candidate.sequences)


def assert_equals_own(
    model: PreTrainedModel,
    own: str,
    lengths: list[int],
    cache_implementation: str | None = None,
    cache_config: dict | None = None,
    max_new_tokens: int = 8,
) -> None:
    """Greedy tokens and logits under our attention (with ``cache_implementation``, else DynamicCache) equal those
    under the model's own attention with DynamicCache."""
    reference = greedy(model, own, lengths, max_new_tokens)
    settings = {}
    if cache_implementation is not None:
        settings = {"cache_implementation": cache_implementation, "cache_config": cache_config or {}}
    assert_equal_runs(reference, greedy(model, ATTENTION_NAME, lengths, max_new_tokens, **settings))


def teacher_forced(model: PreTrainedModel, attention: str, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """``[batch, seq_len, vocab]`` logits over ``ids`` fed through a ``DynamicCache`` in chunks of these sizes."""
    cache, logits, start = DynamicCache(config=model.config), [], 0
    with model_attention(model, attention), torch.no_grad():
        for size in chunks:
            logits.append(model(ids[:, start : start + size], cache=cache).logits)
            start += size
    return torch.cat(logits, dim=1)


GPT_OSS = {
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 4,
}


@pytest.fixture(scope="module")
def gpt_oss() -> PreTrainedModel:
    model = tiny("gpt_oss", "eager", **GPT_OSS)
    with torch.no_grad():  # sinks far from zero, so that dropping them shows
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()))
    return model


def test_gpt_oss_sinks_apply_in_prefill_and_decode(gpt_oss):
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    chunks = [9, 1, 1, 1]  # a prefill, then decode steps
    expected = teacher_forced(gpt_oss, "eager", ids, chunks)
    torch.testing.assert_close(teacher_forced(gpt_oss, ATTENTION_NAME, ids, chunks), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_implementation", [None, "paged_pool", "sliding_ring"])
def test_gpt_oss_sinks_apply_through_our_caches(gpt_oss, cache_implementation):
    config = {"window": 32} if cache_implementation == "sliding_ring" else None
    assert_equals_own(gpt_oss, "eager", [5, 11], cache_implementation, config)


@pytest.mark.parametrize("model_type", ["gemma2", "vaultgemma"])
def test_softcapped_attention_applies_its_softcap(model_type):
    """A softcap of 1.0 over weights large enough for scores past it (at the default init a cap of 0.5 moved the
    logits by 1e-6: the test could not fail); first, that the cap moves the model's own logits."""
    model = tiny(model_type, "eager", sliding_window=4, attn_logit_softcapping=1.0, initializer_range=0.5)
    uncapped = tiny(model_type, "eager", sliding_window=4, attn_logit_softcapping=1e9, initializer_range=0.5)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    moved = teacher_forced(model, "eager", ids, [12]) - teacher_forced(uncapped, "eager", ids, [12])
    assert moved.abs().max() > 0.1
    assert_equals_own(model, "eager", [5, 11])
    assert_equals_own(model, "eager", [5, 11], "paged_pool")


@pytest.mark.parametrize("model_type", ["granite_swa", "flint"])
def test_models_that_refuse_sdpa_get_their_own_attention(model_type):
    model = tiny(model_type, "eager")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.copy_(torch.linspace(-1.0, 2.0, module.sinks.numel()))
    assert_equals_own(model, "eager", [5, 11])


def test_moshi_sliding_layers_through_paged_pool():
    """Moshi's layers are sliding for its cache (``sliding_window``) but its mask is plainly causal: a prompt sees
    all of itself, as with DynamicCache, and decode steps their window."""
    model = tiny("moshi", "sdpa", sliding_window=8)
    assert_equals_own(model, "sdpa", [5, 12], "paged_pool")
    assert_equals_own(model, "sdpa", [30], "paged_pool")


def test_xlm_roberta_xl_decoder_through_sliding_ring():
    model = tiny("xlm-roberta-xl", "sdpa", is_decoder=True, num_key_value_heads=None)
    assert_equals_own(model, "sdpa", [5, 12], "sliding_ring", {"window": 64})


def test_doge_reads_its_values_in_time_order(monkeypatch):
    """Doge computes its attention mask from the values the cache returns: in place, they would be the pool's."""
    monkeypatch.setattr(flex, "MIN_IN_PLACE_TOKENS", 0)
    model = tiny("doge", "sdpa")
    assert_equals_own(model, "sdpa", [5, 12], "paged_pool")


def test_git_attends_to_its_keys_in_time_order():
    """GIT's attention module computes attention itself, with the keys the cache returns."""
    model = tiny("git", "eager", num_key_value_heads=None)
    assert_equals_own(model, "eager", [5, 12], "sliding_ring", {"window": 64})


def test_gpt_oss_sinks_apply_in_compiled_steps(gpt_oss):
    """A compiled decode step (``generate``'s ``compile_config``, one graph) runs the model's own attention too."""
    torch._dynamo.reset()
    config = CompileConfig(mode="default", fullgraph=True)
    config._compile_all_devices = True  # compile on CPU too
    try:
        reference = greedy(gpt_oss, "eager", [5, 11], max_new_tokens=4)
        settings = {"cache_implementation": "paged_pool", "compile_config": config}
        assert_equal_runs(reference, greedy(gpt_oss, ATTENTION_NAME, [5, 11], max_new_tokens=4, **settings), atol=1e-4)
    finally:
        torch._dynamo.reset()


class _AttentionWithoutEagerFunction(torch.nn.Module):
    """An attention module whose modeling file (this one) defines no ``eager_attention_forward``."""

    is_causal, layer_idx, training = True, 0, False


def test_a_feature_without_the_models_own_attention_is_refused_by_name():
    query = key = value = torch.zeros(1, 2, 3, 4)
    with pytest.raises(IncompatibleModelError, match="_AttentionWithoutEagerFunction passes 'softcap'"):
        banded_sdpa_attention(_AttentionWithoutEagerFunction(), query, key, value, None, softcap=30.0)


STATES_ONLY = [("llama", True), ("gpt_oss", True), ("doge", False), ("git", False)]


@pytest.mark.parametrize(("model_type", "expected"), STATES_ONLY)
def test_models_whose_attention_reads_the_states_besides_are_found_in_their_source(model_type, expected):
    assert hands_states_to_attention_only(AutoConfig.for_model(model_type)) is expected
