"""Tiny random-init models and random batches: for the tests, the soak and the wheel check, with the core alone.

The models are random-init, deterministic (seeded) and small enough for unit tests:
``vocab_size=128``, ``hidden_size=64``, 4 attention heads over 2 KV heads, ``head_dim=16``. Building one needs
only torch and transformers (nothing is downloaded). Besides Llama, Mistral and Gemma 3, ``tiny_hybrid`` builds
hybrid models whose layers alternate linear attention or convolution with full attention.
"""

from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
)

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


HYBRIDS = {
    # Qwen3.5: Gated DeltaNet linear attention (a convolution and a recurrent state per layer) beside full attention
    "qwen3_5_text": {
        "layer_types": ["linear_attention", "full_attention"] * 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
    # LFM2: short convolutions beside full attention; a larger init spreads its logits (with the default, greedy
    # repeats one token)
    "lfm2": {"layer_types": ["conv", "full_attention"] * 2, "block_ff_dim": 128, "initializer_range": 0.2},
}
"""The hybrid models ``tiny_hybrid`` builds: their ``model_type`` and the settings beside the tiny sizes."""


def tiny_hybrid(model_type: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Builds a random-init 4-layer hybrid model of ``HYBRIDS``: layers of linear attention (``qwen3_5_text``) or
    convolution (``lfm2``), each followed by a full-attention layer.

    Args:
        model_type: a key of ``HYBRIDS``.
        seed: Seed for ``torch.manual_seed`` before the weights are initialized.
        **overrides: config fields that replace the tiny defaults.

    Returns:
        An fp32 model in eval mode using SDPA attention.
    """
    settings = {**_TINY_SIZES, "num_hidden_layers": 4, **HYBRIDS[model_type], **overrides}
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.float32).eval()
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


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
