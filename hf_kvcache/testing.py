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


CAUSAL_LM_SIZES: dict[str, Any] = {
    **_TINY_SIZES,
    "vocab_size": 256,  # room for the special token ids some models keep below 256
    "is_decoder": True,  # a causal LM: BERT-like models attend causally only as decoders
    # the same sizes under the names other configs give them (each config takes those it declares)
    **{name: 2 for name in ("decoder_layers", "encoder_layers", "num_layers", "n_layers")},
    **{name: 4 for name in ("decoder_attention_heads", "encoder_attention_heads", "num_decoder_attention_heads")},
    **{name: 4 for name in ("num_encoder_attention_heads", "num_heads", "n_heads")},
    **{name: 128 for name in ("decoder_ffn_dim", "encoder_ffn_dim", "ffn_dim", "d_ff", "dim_ff", "n_inner")},
    **{name: 64 for name in ("d_model", "embed_dim", "n_embed", "word_embed_proj_dim")},
    **{name: 32 for name in ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size")},
    **{name: 4 for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")},
    **{name: 2 for name in ("num_experts_per_tok", "moe_topk")},
    **{name: 16 for name in ("dim_head", "d_kv", "kv_channels", "attention_head_size")},
    **{name: 16 for name in ("kv_lora_rank", "q_lora_rank", "linear_key_head_dim", "linear_value_head_dim")},
    # multi-head latent attention keeps its real layout: its latent (kv_lora_rank) wider than its rope key
    **{"qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
    **{name: 2 for name in ("linear_num_key_heads", "n_group", "topk_group")},
    "linear_num_value_heads": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_positions": 512,
    "sliding_window": 8,  # shorter than the matrix's sequences: sliding layers drop tokens
    "rotary_dim": 8,
    "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 16,
    "global_head_dim": 32,  # Gemma 4's full-attention layers: wider heads than its sliding layers'
    "max_position_embeddings": 512,
}
"""The sizes ``tiny_causal_lm`` gives every model type: each config takes those of its fields (or ``attribute_map``
names) that are here, its sub-configs (a vision tower beside the text model) too."""

_HYBRID = {"layer_types": ["linear_attention", "full_attention"]}
CAUSAL_LM_SETTINGS: dict[str, dict[str, Any]] = {
    "mimo_v2_flash": {"head_dim": 24},  # keys wider than values (v_head_dim), as in the real model
    # hybrids: an attention layer among two (the default patterns put the first one further down)
    **dict.fromkeys(["bailing_hybrid", "granitemoehybrid", "kimi_linear", "qwen3_next", "qwen3_5_text"], _HYBRID),
    **dict.fromkeys(["qwen3_5_moe_text", "qwen4_exp_text"], _HYBRID),
    **{model_type: {"text_config": _HYBRID} for model_type in ("qwen3_5", "qwen3_5_moe", "qwen4_exp")},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    **dict.fromkeys(["lfm2_moe", "lfm3"], {"layer_types": ["conv", "full_attention"]}),
    # sizes these configs check against each other
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    "dots3_note": {"num_key_value_heads": 4},
    "dots3_note_text": {"num_key_value_heads": 4},
    "mamba2": {"num_heads": 8},
    "xlnet": {"d_head": 16},
    "zaya": {"num_experts_per_tok": 1},
    "reformer": {"axial_pos_shape": [16, 32], "axial_pos_embds_dim": [32, 32]},
    # KV sharing: the last layer reads the keys and values of the one before it of its type
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "gemma4_assistant": {"hidden_size_per_layer_input": 0, "text_config": {"hidden_size_per_layer_input": 0}},
    "kolibri1_1": {"index_num_heads": 1},
    "zamba2": {"layer_types": ["mamba", "hybrid"]},
}
"""What ``tiny_causal_lm`` sets besides ``CAUSAL_LM_SIZES`` for a model type whose own fields need it."""


def tiny_causal_lm_config(model_type: str, **overrides: Any) -> PreTrainedConfig:
    """The tiny config of ``model_type`` (a ``model_type`` of transformers' auto mapping of causal LMs):
    ``CAUSAL_LM_SIZES`` where the config (or one of its sub-configs) has such a field, ``CAUSAL_LM_SETTINGS``, then
    ``overrides``.

    Raises:
        whatever transformers raises for a config it cannot build (a missing optional package, ...).
    """
    default = AutoConfig.for_model(model_type)
    settings = {**_declared(type(default), CAUSAL_LM_SIZES), **CAUSAL_LM_SETTINGS.get(model_type, {}), **overrides}
    for key in getattr(type(default), "sub_configs", None) or {}:
        sub_config = getattr(default, key, None)
        if isinstance(sub_config, PreTrainedConfig):  # built by its class, or by its model_type (AutoConfig)
            given, sizes = settings.get(key, {}), _declared(type(sub_config), CAUSAL_LM_SIZES)
            if given or sizes:
                kind = {"model_type": sub_config.model_type} if sub_config.model_type else {}
                settings[key] = {**kind, **sizes, **given}
    return AutoConfig.for_model(model_type, **settings)


def tiny_causal_lm(model_type: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Builds a random-init tiny model of ``model_type`` (``tiny_causal_lm_config``) with ``AutoModelForCausalLM``.

    Args:
        model_type: a ``model_type`` of transformers' auto mapping of causal LMs.
        seed: Seed for ``torch.manual_seed`` before the weights are initialized.
        **overrides: config fields that replace the tiny defaults.

    Returns:
        An fp32 model in eval mode under its own attention: ``"sdpa"``, or ``"eager"`` where the model refuses sdpa;
        its ``generate`` pads with id 0 and stops at no token.
    """
    config = tiny_causal_lm_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()  # transformers' default: sdpa if it can
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # every run makes max_new_tokens tokens
    return model


def _declared(config_class: type[PreTrainedConfig], sizes: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``sizes`` that ``config_class`` declares as fields or ``attribute_map`` names."""
    fields = set(getattr(config_class, "__dataclass_fields__", {})) | set(getattr(config_class, "attribute_map", {}))
    if "qk_rope_head_dim" in fields:  # latent attention: a KV head per query head, head_dim the rope part's (derived)
        fields -= {"head_dim", "num_key_value_heads"}
    return {name: value for name, value in sizes.items() if name in fields}


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
