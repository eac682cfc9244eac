"""Compiled requests whose steps feed several tokens: chunked prefill (``prefill_chunk_size``) and prompt lookup
(``prompt_lookup_num_tokens``, assisted decoding), which ``generate`` runs through the model's compiled forward when
the cache is compileable (on CUDA unasked). A step of several tokens is not planned: a chunked prefill's chunks run
eager and its decode steps compile, as a plain request's do; a prompt-lookup request runs eager (every step after the
prompt feeds candidates), the cache says it is not compileable for it, and says why once.

On CPU ``generate`` compiles only when told (``CompileConfig._compile_all_devices``); ``mode="default"``."""

import logging

import pytest
import torch
import torch._dynamo
from transformers import CompileConfig

from hf_kvcache.attention import flex
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.testing import tiny_llama, tiny_mistral
from tests.helpers import random_ids

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

CACHES = ["paged_pool", "sliding_ring", "quantized_values", "quantized_kv"]
CHUNK_SIZE = 5  # a prompt of 13 tokens feeds chunks of 5, 5 and 3: two chunk sizes


def compile_config(fullgraph: bool = False) -> CompileConfig:
    config = CompileConfig(mode="default", fullgraph=fullgraph)
    config._compile_all_devices = True  # a class attribute in transformers 5.24, not a constructor argument
    return config


@pytest.fixture(scope="module")
def models() -> dict:
    """Tiny Llama (full attention) and tiny Mistral (every layer a sliding window of 8), with no end-of-sequence
    token, so every request generates all its tokens."""
    built = {"llama": tiny_llama(), "mistral": tiny_mistral()}
    for model in built.values():
        model.generation_config.eos_token_id = None
    return built


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def generate(model, ids: torch.Tensor, name: str, config: CompileConfig | None = None, **kwargs) -> torch.Tensor:
    if name in REGISTRY:
        kwargs["cache_config"] = dict(REGISTRY[name].example_config)
    return model.generate(ids, do_sample=False, cache_implementation=name, compile_config=config, **kwargs)


def chunked(model, name: str, config: CompileConfig | None = None) -> torch.Tensor:
    return generate(model, random_ids(2, 13), name, config, prefill_chunk_size=CHUNK_SIZE, max_new_tokens=6)


def looked_up(model, name: str, config: CompileConfig | None = None) -> torch.Tensor:
    """Prompt lookup over a prompt that repeats itself, so that steps feed candidates."""
    ids = random_ids(1, 12, seed=3)
    return generate(
        model, torch.cat([ids, ids[:, :6]], dim=1), name, config, prompt_lookup_num_tokens=3, max_new_tokens=8
    )


@pytest.mark.parametrize("name", CACHES)
@pytest.mark.parametrize("model_name", ["llama", "mistral"])
def test_chunked_prefill_compiled_runs_its_chunks_eager_and_compiles_its_decode_steps(models, model_name, name):
    """The chunks (5, 5 and 3 tokens) run eager; the decode steps run one compiled graph, as a plain request's do
    (they ran eager too, the whole request marked not compileable), and the tokens are eager's."""
    model = models[model_name]
    reference = chunked(model, name)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(chunked(model, name, compile_config()), reference)
    assert graphs() == 1


@pytest.mark.parametrize("name", CACHES)
@pytest.mark.parametrize("model_name", ["llama", "mistral"])
def test_prompt_lookup_compiled_generates_eagers_tokens(models, model_name, name):
    model = models[model_name]
    reference = looked_up(model, name)
    assert torch.equal(looked_up(model, name, compile_config()), reference)
    assert graphs() == 0  # every step after the prompt feeds candidates: the request runs eager


@pytest.mark.parametrize("model_name", ["llama", "mistral"])
def test_multi_token_requests_under_fullgraph_compile_only_one_token_steps_on_paged_pool(models, model_name):
    model = models[model_name]
    assert torch.equal(looked_up(model, "paged_pool", compile_config(fullgraph=True)), looked_up(model, "paged_pool"))
    assert graphs() == 0
    assert torch.equal(chunked(model, "paged_pool", compile_config(fullgraph=True)), chunked(model, "paged_pool"))
    assert graphs() == 1  # the decode steps'


def test_why_a_request_runs_eager_is_said_once_per_reason(models, monkeypatch, caplog):
    monkeypatch.setattr(flex, "KERNELS", flex.CompiledKernels())  # a process that has said nothing yet
    model = models["llama"]
    with caplog.at_level(logging.INFO, logger=flex.logger.name):
        for _ in range(2):
            chunked(model, "paged_pool", compile_config())
            looked_up(model, "paged_pool", compile_config())
    said = [record.getMessage() for record in caplog.records if record.name == flex.logger.name]
    assert sum("prefill_chunk_size" in message for message in said) == 1  # its chunks run eager
    assert sum("prompt lookup and assisted decoding" in message for message in said) == 1


def test_a_plain_request_still_compiles_its_decode_steps(models):
    out = generate(models["llama"], random_ids(2, 13), "paged_pool", compile_config(), max_new_tokens=4)
    assert torch.equal(out, generate(models["llama"], random_ids(2, 13), "paged_pool", max_new_tokens=4))
    assert graphs() == 1
