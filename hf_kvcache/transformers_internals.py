"""Every use of transformers beyond its top-level names (the rest of hf_kvcache imports only those: test_layering).

Each is re-exported here or reached by one small function, and pinned against the installed release by
``tests/test_transformers_internals.py``, so an upgrade that moves one fails there first. Only ``integration.seams``
and ``bundled.model`` call the writers (``set_*``, ``remove_attention``, ``drop_quantizer``).
"""

from collections.abc import Callable
from typing import Any

from transformers import AttentionInterface, AttentionMaskInterface, GenerationMixin, PreTrainedConfig
from transformers.cache_utils import DummyLayer, LinearAttentionLayer
from transformers.cache_utils import get_layer_types_and_kwargs as layer_types_and_kwargs
from transformers.dynamic_module_utils import check_python_requirements
from transformers.generation import configuration_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = [
    "DummyLayer",
    "LinearAttentionLayer",
    "attn_implementation",
    "cache_implementations",
    "cache_layer_state",
    "causal_lm_model_types",
    "check_python_requirements",
    "drop_quantizer",
    "layer_types_and_kwargs",
    "prefill_method",
    "prepare_cache_method",
    "prepare_inputs_method",
    "remove_attention",
    "sdpa_attention_forward",
    "serves_dynamic_cache",
    "set_cache_implementations",
    "set_prefill_method",
    "set_prepare_cache_method",
    "set_prepare_inputs_method",
    "tensor_parallel_group",
]


def attn_implementation(config: PreTrainedConfig) -> str | None:
    """The attention a model of ``config`` runs (``"sdpa"``, ``"eager"``, ...); ``None`` when no model set it."""
    return getattr(config, "_attn_implementation", None)


def tensor_parallel_group(model: Any) -> Any:
    """The process group of a tensor-parallel model's ranks (the ``"tp"`` axis of ``model._device_mesh``); ``None``
    for a model loaded without one."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return None
    return mesh["tp"].get_group()


def cache_layer_state(layer: Any) -> list[Any]:
    """Every attribute value of a transformers cache layer (quantized layers keep their tensors in private ones)."""
    return list(vars(layer).values())


def cache_implementations() -> tuple[str, ...]:
    """The ``cache_implementation`` names ``GenerationConfig.validate`` accepts."""
    return configuration_utils.ALL_CACHE_IMPLEMENTATIONS


def set_cache_implementations(names: tuple[str, ...]) -> None:
    configuration_utils.ALL_CACHE_IMPLEMENTATIONS = names


def prepare_cache_method() -> Callable[..., Any]:
    """``GenerationMixin._prepare_cache_for_generation``, which builds the cache ``generate`` runs with."""
    return GenerationMixin._prepare_cache_for_generation


def set_prepare_cache_method(method: Callable[..., Any]) -> None:
    GenerationMixin._prepare_cache_for_generation = method


def prepare_inputs_method() -> Callable[..., Any]:
    """``GenerationMixin.prepare_inputs_for_generation``, the one place a cache sees each forward pass's token ids."""
    return GenerationMixin.prepare_inputs_for_generation


def set_prepare_inputs_method(method: Callable[..., Any]) -> None:
    """Replaces ``GenerationMixin.prepare_inputs_for_generation`` (models that override it call it via ``super()``)."""
    GenerationMixin.prepare_inputs_for_generation = method


def prefill_method() -> Callable[..., Any]:
    """``GenerationMixin._prefill``: a request's first forward pass, or its chunks with ``prefill_chunk_size``."""
    return GenerationMixin._prefill


def set_prefill_method(method: Callable[..., Any]) -> None:
    GenerationMixin._prefill = method


def remove_attention(name: str) -> None:
    """Drops ``name`` from ``AttentionInterface`` and ``AttentionMaskInterface`` (``register`` has no public undo);
    a no-op where it is absent."""
    for interface in (AttentionInterface, AttentionMaskInterface):
        interface._global_mapping.pop(name, None)


def drop_quantizer(model: Any) -> None:
    """Forgets the quantizer of a model whose weights are already dequantized (a GGUF file's), so that
    ``save_pretrained`` writes a plain checkpoint."""
    model.hf_quantizer = None
    del model.config.quantization_config


def causal_lm_model_types() -> list[str]:
    """The ``model_type`` of every causal LM ``AutoModelForCausalLM`` builds, in its auto mapping's order."""
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def serves_dynamic_cache(model: Any) -> bool:
    """Whether ``generate`` gives ``model`` a ``DynamicCache`` (not to models with a cache of their own: MiniMax's,
    RWKV's, ...)."""
    return type(model)._supports_default_dynamic_cache()
