"""Shared fixtures: the models, every registered cache name, and pools that fit a cache name.

Tests run offline: nothing may reach the Hugging Face Hub. Plain helper functions (batches, greedy runs,
teacher-forced logits) are in ``helpers.py``."""

import os

# Set before anything imports transformers or huggingface_hub, which read these once at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from collections.abc import Callable

import pytest
import torch._dynamo
from transformers import CompileConfig, PreTrainedModel, PreTrainedTokenizerBase

from hf_kvcache import KVPool
from hf_kvcache.bundled import load_bundled_model
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.testing import tiny_gemma3, tiny_llama, tiny_mistral

PoolFactory = Callable[..., KVPool]


@pytest.fixture
def fresh_default_pools():
    """The default pools made during the test are fresh (a fresh budget, read from the device then), and are
    forgotten after it."""
    KVPool.drop_defaults()
    yield
    KVPool.drop_defaults()


@pytest.fixture(scope="module")
def compile_config() -> CompileConfig:
    """What generate compiles with on a CPU: the whole forward pass as one graph, on every device (transformers
    compiles only on CUDA unasked)."""
    config = CompileConfig(mode="default", fullgraph=True)
    config._compile_all_devices = True  # a class attribute in transformers 5.24, not a constructor argument
    return config


@pytest.fixture
def fresh_dynamo():
    """Dynamo's compiled code and counters reset before and after the test; recompiles allowed again after it.
    Modules that count graphs use it for every test (``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.config.error_on_recompile = False
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def bundled() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct in fp32 on CPU, with its left-padding tokenizer."""
    return load_bundled_model()


@pytest.fixture(scope="session")
def tiny_llama_model() -> PreTrainedModel:
    """Random-init 2-layer Llama, full attention everywhere."""
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_mistral_model() -> PreTrainedModel:
    """Random-init 2-layer Mistral, sliding window 8 in every layer."""
    return tiny_mistral()


@pytest.fixture(scope="session")
def tiny_gemma3_model() -> PreTrainedModel:
    """Random-init 4-layer Gemma 3: three sliding-window (8) layers, then one full layer."""
    return tiny_gemma3()


@pytest.fixture(params=sorted(REGISTRY))
def cache_name(request: pytest.FixtureRequest) -> str:
    """Each registered ``cache_implementation`` name in turn: a test taking it covers a cache the day it is
    registered (its ``CacheEntry.example_config`` works on the tiny models)."""
    return request.param


def pool_for(model: PreTrainedModel, cache_name: str, /, **budget) -> KVPool:
    """A fixed pool for ``model`` that cache ``cache_name`` can draw from with its example config.

    ``budget``: ``KVPool.for_model`` keywords (``max_tokens``, ``dtype``, ``device``, ``name``, ...) and ``page_size``;
    the value format comes from the registry entry's config (``CacheEntry.config``).
    """
    entry = REGISTRY[cache_name]
    page_size = budget.pop("page_size", None)
    settings = {**entry.example_config, **({} if page_size is None else {"page_size": page_size})}
    return KVPool.for_model(model, entry.config(settings), **budget)


@pytest.fixture
def make_pool() -> PoolFactory:
    """The pool factory: ``make_pool(model, name, max_tokens=..., ...)`` (see ``pool_for``)."""
    return pool_for
