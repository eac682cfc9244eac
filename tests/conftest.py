"""Shared fixtures. Tests run offline: nothing may reach the Hugging Face Hub."""

import os

# Set before anything imports transformers or huggingface_hub, which read these once at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_kvcache.models import load_bundled_model, tiny_gemma3, tiny_llama, tiny_mistral


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
