"""Tests for hf_kvcache.testing (the tiny model builders) and hf_kvcache.bundled (the bundled model, published once)."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from hf_kvcache.bundled import model as bundled_model
from hf_kvcache.testing import tiny_gemma3, tiny_llama, tiny_mistral
from hf_kvcache.transformers_internals import attn_implementation

TINY_CASES = [
    ("tiny_llama_model", [False, False]),
    ("tiny_mistral_model", [True, True]),
    ("tiny_gemma3_model", [True, True, True, False]),
]


@pytest.mark.parametrize(("fixture", "expected_sliding"), TINY_CASES)
def test_tiny_model_cache_layers(request: pytest.FixtureRequest, fixture: str, expected_sliding: list[bool]) -> None:
    model = request.getfixturevalue(fixture)
    cache = DynamicCache(config=model.config)
    assert cache.is_sliding == expected_sliding
    assert all(layer.sliding_window == 8 for layer in cache.layers if layer.is_sliding)


@pytest.mark.parametrize(("fixture", "expected_sliding"), TINY_CASES)
def test_tiny_model_setup_and_generate(
    request: pytest.FixtureRequest, fixture: str, expected_sliding: list[bool]
) -> None:
    model = request.getfixturevalue(fixture)
    assert not model.training
    assert model.dtype == torch.float32
    assert attn_implementation(model.config) == "sdpa"
    assert model.config.head_dim == 16
    assert model.config.num_key_value_heads == 2
    assert model.config.num_hidden_layers == len(expected_sliding)
    assert model.generation_config.pad_token_id == 0
    assert model.generation_config.eos_token_id is not None
    input_ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    output = model.generate(input_ids, max_new_tokens=5, do_sample=False)
    assert output.shape == (1, 11)
    assert torch.equal(output[:, :6], input_ids)


@pytest.mark.parametrize("build", [tiny_llama, tiny_mistral, tiny_gemma3])
def test_tiny_models_are_seeded(build: Callable[..., PreTrainedModel]) -> None:
    first, again, other = build(), build(), build(seed=1)
    weights = [model.model.layers[0].self_attn.q_proj.weight for model in (first, again, other)]
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])


def test_tiny_overrides_reach_the_config() -> None:
    assert tiny_llama(num_hidden_layers=3).config.num_hidden_layers == 3
    assert tiny_mistral(sliding_window=None).config.sliding_window is None


def test_mistral_window_hides_distant_tokens(
    tiny_llama_model: PreTrainedModel, tiny_mistral_model: PreTrainedModel
) -> None:
    # Two layers with window 8 let position 19 see positions >= 19 - 2 * 7 = 5 only, so token 0 cannot matter.
    input_ids = torch.arange(10, 30).unsqueeze(0)  # [1, 20]
    changed = input_ids.clone()
    changed[0, 0] = 99
    with torch.no_grad():
        for model, is_hidden in ((tiny_mistral_model, True), (tiny_llama_model, False)):
            last = model(input_ids).logits[0, -1]
            last_changed = model(changed).logits[0, -1]
            assert torch.allclose(last, last_changed, atol=1e-6) == is_hidden


def test_bundled_model_answers_a_chat_prompt(
    bundled: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = bundled
    assert model.config.num_hidden_layers == 30
    assert model.config.num_key_value_heads == 3
    assert model.config.head_dim == 64
    assert model.dtype == torch.float32
    assert not model.training
    assert tokenizer.pad_token is not None
    assert tokenizer.padding_side == "left"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_publish_dir_keeps_the_copy_that_won_the_race(tmp_path: Path) -> None:
    target, staging = tmp_path / "model", tmp_path / ".model-tmp"
    for folder, text in ((target, "first"), (staging, "second")):
        folder.mkdir()
        (folder / "config.json").write_text(text)
    bundled_model._publish_dir(staging, target)
    assert (target / "config.json").read_text() == "first"
