"""Every use of transformers beyond its public API (``hf_kvcache.transformers_internals``), pinned against the
installed release: if an upgrade moves or changes one of them, a test here is the one that fails first."""

import inspect
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    DynamicCache,
    GenerationConfig,
    GenerationMixin,
)
from transformers.masking_utils import sdpa_mask

import hf_kvcache
from hf_kvcache import transformers_internals as internals
from hf_kvcache.memory.placement import kv_heads_per_rank
from hf_kvcache.testing import tiny_causal_lm, tiny_gemma3, tiny_llama


def test_seams_exist_in_this_transformers():
    """The four seams integration patches: the cache names' tuple, the method that builds the cache, the one that
    prepares each forward pass's inputs, and the prefill."""
    hf_kvcache.unregister()
    try:
        assert isinstance(internals.cache_implementations(), tuple)
        assert "dynamic" in internals.cache_implementations()
        assert internals.prepare_cache_method() is GenerationMixin._prepare_cache_for_generation
        parameters = list(inspect.signature(internals.prepare_cache_method()).parameters)
        # The wrapper takes these by name: batch_size and max_cache_length size the admission check.
        assert parameters == [
            "self",
            "generation_config",
            "model_kwargs",
            "generation_mode",
            "batch_size",
            "max_cache_length",
        ]
        assert internals.prepare_inputs_method() is GenerationMixin.prepare_inputs_for_generation
        parameters = inspect.signature(internals.prepare_inputs_method()).parameters
        # The wrapper takes these by name: the ids so far, the count _prefill slices them to, the cache.
        assert list(parameters)[:4] == ["self", "input_ids", "next_sequence_length", "cache"]
        assert any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
        prefill = inspect.getsource(GenerationMixin._prefill)
        # _prefill passes the whole prompt with is_first_iteration and slices it by next_sequence_length, computed
        # from the cache's length: what a reused prefix shortens.
        assert "is_first_iteration=is_first_iteration" in prefill
        assert "next_sequence_length = input_ids.shape[1] - past_length" in prefill
        # The prefill seam has a chunked prefill's chunks run eager: _prefill picks their forward by generate's rule,
        # which reads the cache's is_compileable, after the decode loop picked its own.
        assert internals.prefill_method() is GenerationMixin._prefill
        assert "self._valid_auto_compile_criteria(model_kwargs, generation_config)" in prefill
        assert list(inspect.signature(internals.prefill_method()).parameters)[:4] == [
            "self",
            "input_ids",
            "generation_config",
            "model_kwargs",
        ]
    finally:
        hf_kvcache.register()


def test_cache_names_set_here_are_the_ones_validate_reads():
    names = internals.cache_implementations()
    try:
        internals.set_cache_implementations((*names, "pinned_name"))
        GenerationConfig(cache_implementation="pinned_name").validate(strict=True)
    finally:
        internals.set_cache_implementations(names)
    assert internals.cache_implementations() == names


def test_attention_names_live_in_the_interfaces_mappings():
    """remove_attention pops the name from the mappings that AttentionInterface.register writes."""
    AttentionInterface.register("pinned_attention", internals.sdpa_attention_forward)
    AttentionMaskInterface.register("pinned_attention", sdpa_mask)
    assert "pinned_attention" in AttentionInterface._global_mapping
    assert "pinned_attention" in AttentionMaskInterface._global_mapping
    internals.remove_attention("pinned_attention")
    assert "pinned_attention" not in AttentionInterface._global_mapping
    assert "pinned_attention" not in AttentionMaskInterface._global_mapping
    internals.remove_attention("pinned_attention")  # absent: a no-op


def test_sdpa_functions_are_sdpas_and_take_what_we_pass():
    assert AttentionInterface._global_mapping["sdpa"] is internals.sdpa_attention_forward
    assert AttentionMaskInterface._global_mapping["sdpa"] is sdpa_mask
    forward = inspect.signature(internals.sdpa_attention_forward).parameters
    assert list(forward)[:5] == ["module", "query", "key", "value", "attention_mask"]
    assert {"scaling", "dropout", "position_bias"} <= set(forward)
    mask = inspect.signature(sdpa_mask).parameters
    assert list(mask)[:3] == ["batch_size", "q_length", "kv_length"]


def test_attn_implementation_is_the_models_attention():
    model = tiny_llama()
    assert internals.attn_implementation(model.config) == "sdpa"
    model.set_attn_implementation("eager")
    assert internals.attn_implementation(model.config) == "eager"
    assert hasattr(model.config, "_attn_implementation")  # read with a default: pin that it is still there
    assert internals.attn_implementation(object()) is None


def test_layer_types_and_kwargs_name_each_layers_attention():
    types, kwargs = internals.layer_types_and_kwargs(tiny_gemma3().config)
    assert types == ["sliding_attention"] * 3 + ["full_attention"]
    assert [entry.get("sliding_window") for entry in kwargs][:3] == [8, 8, 8]
    config = tiny_llama().config
    config.kv_sharing_modes = ["store", "reuse"]
    assert internals.layer_types_and_kwargs(config)[0] == ["full_attention", "dummy"]


def test_dummy_layer_is_what_a_cache_keeps_for_a_layer_without_a_cache():
    config = tiny_llama().config
    config.kv_sharing_modes = ["store", "reuse"]
    assert isinstance(DynamicCache(config=config).layers[1], internals.DummyLayer)


def test_a_loaded_config_keeps_no_hub_revision(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    # This release resolves a hub revision per load and no longer keeps it on the config (it pops
    # "_commit_hash"), so the eval records no model_revision for a model other than the bundled one.
    # Whichever way that changes, this fails and says so.
    assert not hasattr(model.config, "_commit_hash")


def test_a_dropped_quantizer_no_longer_refuses_save_pretrained(tmp_path):
    """save_pretrained refuses a model whose ``hf_quantizer`` cannot serialize (GGUF's); drop_quantizer clears it."""
    model = tiny_llama()
    model.hf_quantizer = SimpleNamespace(quantization_config=SimpleNamespace(quant_method="gguf"))  # not serializable
    model.config.quantization_config = {"quant_method": "gguf"}
    with pytest.raises(ValueError, match="quantized with gguf and is not serializable"):
        model.save_pretrained(tmp_path / "refused")
    internals.drop_quantizer(model)
    assert model.hf_quantizer is None and not hasattr(model.config, "quantization_config")
    model.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in (tmp_path / "saved" / "config.json").read_text()


def test_cache_layer_state_holds_the_layers_tensors():
    cache = DynamicCache(config=tiny_llama().config)
    keys = torch.randn(1, 2, 3, 16)
    cache.update(keys, keys, 0)
    state = internals.cache_layer_state(cache.layers[0])
    assert any(value is cache.layers[0].keys for value in state)
    assert any(value is cache.layers[0].values for value in state)


def test_python_requirements_check_reads_a_named_file(tmp_path):
    assert "requirements_file" in inspect.signature(internals.check_python_requirements).parameters
    (tmp_path / "needs.txt").write_text("torch\n")
    internals.check_python_requirements(tmp_path, requirements_file="needs.txt")


def test_a_model_loaded_without_tensor_parallelism_has_no_device_mesh():
    """``from_pretrained(..., tp_plan=...)`` sets ``model._device_mesh`` (``transformers.distributed.mixin``), whose
    ``"tp"`` axis is the ranks' process group; every model has the attribute, ``None`` until then.
    ``test_multi_device.py`` reads the process group of a real tensor-parallel model under torchrun."""
    model = tiny_llama()
    assert any("_device_mesh" in vars(cls) for cls in type(model).__mro__)  # a class attribute, not a getattr default
    assert model._device_mesh is None and model.tp_size is None
    assert internals.tensor_parallel_group(model) is None


def test_kv_heads_per_rank_is_transformers_rule():
    """``memory.placement.kv_heads_per_rank`` mirrors ``get_kv_heads_per_rank`` (which sizes transformers' own
    StaticCache under tensor parallelism) on the plans of the tiny models, where an even split is possible."""
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    for model in (tiny_llama(), tiny_gemma3()):
        plan = model.tp_plan
        assert any(style == "colwise" for style in plan.values())
        for num_kv_heads, tp_size in [(4, 1), (4, 2), (4, 4), (8, 2)]:
            assert kv_heads_per_rank(num_kv_heads, plan, tp_size) == get_kv_heads_per_rank(plan, num_kv_heads, tp_size)
        assert get_kv_heads_per_rank(plan, 3, 2) is None  # ours raises, naming tp_size
    for style in ("colwise_gather_output", "rowwise"):
        plan = {"model.layers.*.self_attn.k_proj": style}
        assert kv_heads_per_rank(4, plan, 2) == get_kv_heads_per_rank(plan, 4, 2) == 4


def test_causal_lm_model_types_are_the_auto_mappings():
    """Each names a config ``AutoModelForCausalLM`` builds a model for."""
    model_types = internals.causal_lm_model_types()
    assert {"llama", "gpt2", "qwen3_5_text", "mamba"} <= set(model_types)
    assert len(model_types) == len(set(model_types))


def test_serves_dynamic_cache_is_generates_rule():
    """transformers gives ``DynamicCache`` to a Llama, not to MiniMax (a cache of its own)."""
    assert internals.serves_dynamic_cache(tiny_llama())
    assert not internals.serves_dynamic_cache(tiny_causal_lm("minimax"))
