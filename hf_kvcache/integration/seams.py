"""Teaches ``model.generate(cache_implementation=NAME, cache_config={...})`` our cache names.

The only module that changes transformers, through four seams reached through ``hf_kvcache.transformers_internals``
(and ``AttentionInterface``/``AttentionMaskInterface`` for ``attn_implementation="hf_kvcache"``):
``ALL_CACHE_IMPLEMENTATIONS`` (our names appended); ``GenerationMixin._prepare_cache_for_generation`` (our names
build our cache; requests on our caches are checked, ``check_request``); ``prepare_inputs_for_generation`` (our caches
see the token ids and plan each decode step before its inputs are prepared); ``_prefill`` (a chunked prefill's chunks
run eager; a hybrid prefill reusing prompts runs as passes, ``_prefill_in_passes``). Every other cache goes to the
original untouched. ``register()`` is idempotent and ``unregister()`` puts everything back exactly as it was.
"""

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from packaging.version import Version
from transformers import AttentionInterface, AttentionMaskInterface, Cache
from transformers import __version__ as transformers_version

from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import ATTENTION_NAME, banded_sdpa_attention, model_attention_mask
from hf_kvcache.caches.base import PoolCache
from hf_kvcache.errors import IncompatibleModelError
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.placement import Placement, kv_heads_per_rank, layer_devices_from_map
from hf_kvcache.transformers_internals import (
    cache_implementations,
    prefill_method,
    prepare_cache_method,
    prepare_inputs_method,
    remove_attention,
    serves_dynamic_cache,
    set_cache_implementations,
    set_prefill_method,
    set_prepare_cache_method,
    set_prepare_inputs_method,
    tensor_parallel_group,
)

SUPPORTED_TRANSFORMERS = (Version("5.24"), Version("6.0"))
"""The releases hf_kvcache runs on; 5.23 and earlier pass the cache to the model as ``past_key_values``."""

_lock = threading.Lock()
_original_prepare: Callable[..., Any] | None = None
_original_inputs: Callable[..., Any] | None = None
_original_prefill: Callable[..., Any] | None = None
_original_names: tuple[str, ...] | None = None


def check_transformers_version(version: str = transformers_version) -> None:
    """Raises ``ImportError`` if this transformers release is outside the range we were built for."""
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= Version(version) < high:
        raise ImportError(
            f"hf_kvcache supports transformers >= {low}, < {high}; found {version}. "
            f'Install a supported release: pip install "transformers>={low},<{high}".'
        )


def build_cache(name: str, model: Any, cache_config: Any) -> Cache:
    """Builds the cache registered as ``name`` for ``model``, its pool bound to the model's dtype and device(s) and
    cut for the KV heads this process holds; ``IncompatibleModelError`` if the model keeps a cache of its own."""
    if not serves_dynamic_cache(model):
        raise IncompatibleModelError(
            f"{type(model).__name__} keeps a cache of its own, not a DynamicCache (transformers gives it none), so no "
            f"cache_implementation={name!r} either: leave cache_implementation unset."
        )
    cache_class = REGISTRY[name].cache_class
    placement = placement_of(model)
    return cache_class(model.config, cache_config, dtype=model.dtype, device=model.device, placement=placement)


def placement_of(model: Any) -> Placement:
    """Where ``model``'s KV lives, as seen from this process: a tensor-parallel rank's KV heads and process group
    (``model.tp_size``, ``model.tp_plan``, the device mesh's ``"tp"`` axis), each layer's device where
    ``model.hf_device_map`` names several. Raises ``IncompatibleModelError`` where the heads do not split evenly,
    the process group is unknown, or a split model's layers cannot be told apart."""
    config = model.config.get_text_config(decoder=True)
    num_kv_heads = process_group = layer_devices = None
    tp_size = getattr(model, "tp_size", None) or 1
    if tp_size > 1:
        heads = PageFormat.from_model_config(config, model.dtype).num_kv_heads
        num_kv_heads = kv_heads_per_rank(heads, model.tp_plan, tp_size)
        process_group = tensor_parallel_group(model)
        if process_group is None:
            raise IncompatibleModelError(
                f"The model is tensor parallel over {tp_size} ranks, but has no device mesh to tell its ranks' "
                "process group. Load it with from_pretrained(..., tp_plan='auto') under torchrun."
            )
    device_map = getattr(model, "hf_device_map", None) or {}
    if len(set(device_map.values())) > 1:
        layer_devices = layer_devices_from_map(device_map, attention_modules(model, config.num_hidden_layers), model)
    return Placement(num_kv_heads, layer_devices, process_group)


def attention_modules(model: Any, num_layers: int) -> list[str]:
    """The name of each layer's attention module, the deepest carrying that ``layer_idx``
    (``IncompatibleModelError`` where none does)."""
    names: dict[int, str] = {}
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and len(name) > len(names.get(idx, "")):
            names[idx] = name
    missing = sorted(set(range(num_layers)) - set(names))
    if missing:
        raise IncompatibleModelError(
            f"Cannot tell where layers {missing} of the split model run: no module carries their layer_idx. Serve "
            "it with transformers' own caches (leave cache_implementation unset)."
        )
    return [names[idx] for idx in range(num_layers)]


def check_request(
    model: Any,
    cache: PoolCache,
    generation_config: Any,
    model_kwargs: dict[str, Any],
    batch_size: int,
    max_cache_length: int,
    generation_mode: str | None = None,
) -> None:
    """Checks a request on one of our caches before ``generate`` runs any forward pass: rejects an empty prompt (the
    model would fail with an obscure reshape error) and, unless ``admission_check`` is off, a request whose worst case
    does not fit the pool (``PoolExhaustedError``); tells the cache how long its rows will grow; decides whether the
    steps compile: where ``generate``'s own rule says so and every step feeds one token (``several_tokens_a_step``).

    Args:
        batch_size: prompts in the request; each runs ``max(num_beams, num_return_sequences)`` rows.
        max_cache_length: tokens a row may hold at most (``max_length - 1``, as transformers sizes static caches).
        generation_mode: ``generate``'s decoding method (a ``GenerationMode``, which is a ``str``).
    """
    for key in ("attention_mask", "position_ids"):  # [rows, prompt_length] where generate has made them
        value = model_kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.ndim == 2 and value.shape[-1] == 0 and cache.get_seq_length() == 0:
            raise ValueError(
                f"The prompt is empty ({key} has shape {list(value.shape)}): generate needs at least one input token "
                "per row to start from, e.g. the tokenizer's bos_token_id."
            )
    cache.bind_pools(model.device, model.dtype)  # whether the cache is compileable depends on its pools' devices
    compiles = getattr(model, "_valid_auto_compile_criteria", None)  # generate's own rule (StaticCache's)
    cache.compiled_decoding = None
    compiled = compiles is not None and compiles(model_kwargs | {"cache": cache}, generation_config)
    why_eager = several_tokens_a_step(generation_config, generation_mode) if compiled else None
    if why_eager is not None:  # a step of several tokens is not planned: the request runs eager
        flex.log_once(f"compiled:{why_eager[0]}", logging.WARNING, why_eager[1])
        compiled = False
    # A cache that says it is compileable gets a materialized mask at every step, even eager (transformers skips
    # it only for caches that are not): once generate's rule said no, it says no.
    cache.compiled_decoding = bool(compiled)
    mask = model_kwargs.get("attention_mask")  # [rows, prompt_length]; generate drops it when all ones
    cache.plan(max_cache_length, mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None)
    if cache.cache_config.admission_check is not False:
        num_rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        cache.check_admission(num_rows, max_cache_length, model.device, model.dtype)


def several_tokens_a_step(generation_config: Any, generation_mode: str | None) -> tuple[str, str] | None:
    """Why ``generate`` would feed several tokens a step through a request's compiled forward (assisted decoding
    and prompt lookup do, after the prompt): a key to log it once by and the message; ``None``: one token a step.
    Only one-token steps are planned, so such requests run eager."""
    if generation_mode == "assisted_generation":
        return "assisted", (
            "Compiled decoding is off for prompt lookup and assisted decoding: every step after the prompt feeds the "
            "candidate tokens, several a step, and only one-token steps are planned, so such a request runs eager."
        )
    return None


def _prepare_cache_for_generation(
    self, generation_config, model_kwargs, generation_mode, batch_size: int, max_cache_length: int
):
    name = generation_config.cache_implementation
    if name not in REGISTRY:
        result = _original_prepare(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        if isinstance(model_kwargs.get("cache"), PoolCache):  # one of our caches, passed as `cache=`
            cache = model_kwargs["cache"]
            check_request(self, cache, generation_config, model_kwargs, batch_size, max_cache_length, generation_mode)
        return result
    if model_kwargs.get("cache") is not None:
        raise ValueError(
            f"Passing both cache_implementation={name!r} and a `cache` object is unsupported; use one of the two."
        )
    if generation_config.use_cache is False:
        return None
    cache = build_cache(name, self, generation_config.cache_config)
    check_request(self, cache, generation_config, model_kwargs, batch_size, max_cache_length, generation_mode)
    model_kwargs["cache"] = cache
    return None


def _prefill(self, input_ids: torch.LongTensor, generation_config: Any, model_kwargs: dict, *args, **kwargs):
    cache = model_kwargs.get("cache")
    first = (args or (kwargs.get("is_first_iteration", True),))[0]
    if (
        isinstance(cache, PoolCache)
        and cache.splits_prefill
        and first
        and generation_config.prefill_chunk_size is None
        and model_kwargs.get("inputs_embeds") is None
        and not cache.get_seq_length()
    ):
        return _prefill_in_passes(self, input_ids, model_kwargs)
    if not isinstance(cache, PoolCache) or generation_config.prefill_chunk_size is None or not cache.compiled_decoding:
        return _original_prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
    flex.log_once(
        "compiled:prefill_chunk_size",
        logging.INFO,
        "A chunked prefill's chunks (prefill_chunk_size, several tokens a step) run eager, its decode steps compiled: "
        "only one-token steps are planned.",
    )
    cache.compiled_decoding = False  # generate's rule then picks the eager forward for the chunks
    try:
        return _original_prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
    finally:
        cache.compiled_decoding = True


def _prefill_in_passes(model: Any, input_ids: torch.LongTensor, model_kwargs: dict) -> Any:
    """A prompt's prefill on a cache that keeps its state layers' states for prompt reuse (``splits_prefill``): the
    cached prefix attached, the rest fed in passes ending where the states are kept (``PrefixTracker.pass_ends``),
    each prepared as a chunk of transformers' chunked prefill. Returns the last pass's outputs."""
    cache = model_kwargs["cache"]
    length = input_ids.shape[1]
    start = length - cache.begin_generation(model, input_ids, length, model_kwargs)
    mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
    for end in cache.prefix.pass_ends(start, length):
        kwargs = dict(model_kwargs)
        if mask is not None:
            kwargs["attention_mask"] = mask[:, :end]
        if positions is not None:
            kwargs["position_ids"] = positions[..., start:end]
        inputs = model.prepare_inputs_for_generation(input_ids[:, start:end], is_first_iteration=True, **kwargs)
        outputs = model(**inputs, return_dict=True)
        start = end
    cache.prefill_ran()
    return outputs


def _prepare_inputs_for_generation(
    self,
    input_ids: torch.LongTensor,
    next_sequence_length: int | None = None,
    cache: Cache | None = None,
    **kwargs,
):
    if not isinstance(cache, PoolCache):
        return _original_inputs(self, input_ids, next_sequence_length=next_sequence_length, cache=cache, **kwargs)
    if kwargs.get("is_first_iteration"):
        cache.end_planning()
        next_sequence_length = cache.begin_generation(self, input_ids, next_sequence_length, kwargs)
    else:  # before the inputs: preparing them may build the mask, whose size the plan sets
        cache.plan_decode(input_ids.shape[0], next_sequence_length, kwargs.get("attention_mask"))
    inputs = _original_inputs(self, input_ids, next_sequence_length=next_sequence_length, cache=cache, **kwargs)
    if kwargs.get("is_first_iteration"):
        cache.feeds(_num_fed(inputs))
    cache.record_inputs(inputs.get("input_ids"))
    cache.start_planned(inputs)
    return inputs


def _num_fed(inputs: dict[str, Any]) -> int | None:
    """The tokens prepared ``inputs`` feed (``input_ids [rows, n]`` or ``inputs_embeds [rows, n, hidden]``)."""
    ids, embeds = inputs.get("input_ids"), inputs.get("inputs_embeds")
    if isinstance(ids, torch.Tensor) and ids.ndim == 2:
        return ids.shape[-1]
    if isinstance(embeds, torch.Tensor) and embeds.ndim == 3:
        return embeds.shape[-2]
    return None


def register() -> None:
    """Makes our names valid ``cache_implementation`` values (idempotent); ``ImportError`` outside
    ``SUPPORTED_TRANSFORMERS``."""
    global _original_prepare, _original_inputs, _original_prefill, _original_names
    check_transformers_version()
    with _lock:
        if _original_prepare is not None:
            return
        _original_names = cache_implementations()
        _original_prepare = prepare_cache_method()
        _original_inputs = prepare_inputs_method()
        _original_prefill = prefill_method()
        new_names = tuple(name for name in REGISTRY if name not in _original_names)
        set_cache_implementations(_original_names + new_names)
        set_prepare_cache_method(functools.wraps(_original_prepare)(_prepare_cache_for_generation))
        set_prepare_inputs_method(functools.wraps(_original_inputs)(_prepare_inputs_for_generation))
        set_prefill_method(functools.wraps(_original_prefill)(_prefill))
        AttentionInterface.register(ATTENTION_NAME, banded_sdpa_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, model_attention_mask)


def unregister() -> None:
    """Puts transformers back exactly as before ``register()`` (a no-op if not registered)."""
    global _original_prepare, _original_inputs, _original_prefill, _original_names
    with _lock:
        if _original_prepare is None:
            return
        set_cache_implementations(_original_names)
        set_prepare_cache_method(_original_prepare)
        set_prepare_inputs_method(_original_inputs)
        set_prefill_method(_original_prefill)
        remove_attention(ATTENTION_NAME)  # register() has no public undo
        _original_prepare = _original_inputs = _original_prefill = _original_names = None


def is_registered() -> bool:
    return _original_prepare is not None
