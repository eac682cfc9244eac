"""``attn_implementation="hf_kvcache"``: transformers' sdpa attention, with the same masks, that also reads what our
layers hand over (``attention.reads``):

- a window's ``KeyLayout``: its band (causality, window, sinks) is ANDed into the model's mask;
- a decode step's plan (``STEP_PLAN``), eager or compiled: the pool's storage itself, which compiled FlexAttention
  reads in place (``flex.paged_attention``) where the model's mask hides exactly each row's leading padding;
  otherwise (a mask with holes, training, a shape that does not compile) the plan's pages gathered.

What sdpa does not apply (``NOT_APPLIED_BY_SDPA``), and every layer of a model that refuses sdpa, runs the model's own
``eager_attention_forward`` over the keys gathered in time order (``own_attention``), never sdpa without it.
``integration.seams`` registers the name (``AttentionInterface``, ``AttentionMaskInterface``).
"""

import ast
import contextlib
import importlib
import inspect
import logging
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionMaskInterface

from hf_kvcache.attention import flex
from hf_kvcache.attention.kernels import read_planned_view
from hf_kvcache.attention.reads import KEY_LAYOUT, STEP_PLAN
from hf_kvcache.errors import IncompatibleModelError
from hf_kvcache.transformers_internals import attn_implementation, sdpa_attention_forward

ATTENTION_NAME = "hf_kvcache"


@contextlib.contextmanager
def model_attention(model: torch.nn.Module, name: str | None) -> Iterator[torch.nn.Module]:
    """Runs ``model`` under ``attn_implementation=name`` for the block (``None``: its own), then under its own again
    (``set_attn_implementation`` walks the whole model: switch once for a run of forward passes, not per pass)."""
    own = attn_implementation(model.config)
    if name is None or name == own:
        yield model
        return
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(own)


def banded_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention over ``[batch, heads, n, head_dim]`` states, within the keys' layout if any, under
    the model's ``attention_mask`` ``[batch, 1, n, num_visible]`` (boolean, or additive floats; ``None``: causal).
    ``kwargs`` go on to sdpa or the model's own attention function (``scaling``, ``dropout``, ``softcap``, ...)."""
    own = own_attention(module, kwargs)  # the model's own attention function where sdpa cannot compute it
    plan, layout = kwargs.pop(STEP_PLAN, None), kwargs.pop(KEY_LAYOUT, None)  # what the layer handed over
    sparse = {name: kwargs.pop(name) for name in SPARSE_KWARGS if kwargs.get(name) is not None}
    if plan is not None:  # the keys and values are the pool's storage, read through the step's plan
        if own is None and not sparse and _reads_in_place(module, query, key, plan, attention_mask):
            output = flex.paged_attention(query, key, value, plan, kwargs.get("scaling"))
            if output is not None:
                return output.transpose(1, 2).contiguous(), None
        key, value = read_planned_view(key, plan), read_planned_view(value, plan)  # the model's mask applies
    if sparse:  # the keys the model's indexer picked, as the model itself folds them into an eager or sdpa mask
        attention_mask = _sparse_mask(module, query, key, attention_mask, layout, plan, kwargs, **sparse)
    if layout is not None:
        allowed = layout.band.unsqueeze(1)  # [batch, 1, n, num_keys]: includes causality
        if attention_mask is None:
            attention_mask = allowed
        elif attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & allowed
        else:
            attention_mask = attention_mask.masked_fill(~allowed, torch.finfo(attention_mask.dtype).min)
    if own is not None:
        return own(module, query, key, value, _additive_mask(module, attention_mask, query, key), **kwargs)
    if layout is None and _packs_decode(module, query, key, attention_mask):
        return flex.packed_decode_attention(query, key, value, kwargs.get("scaling"), attention_mask), None
    if layout is None or module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    grouped = query.shape[1] != key.shape[1]
    if grouped and query.device.type != "cpu":
        # CUDA's fused kernels do not take a mask together with enable_gqa (torch falls back to the math kernel):
        # repeat the KV heads instead, as transformers' own sdpa does. On CPU torch's grouped path is the fastest.
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        grouped = False
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"), enable_gqa=grouped
    )  # [batch, heads, n, head_dim]
    return output.transpose(1, 2).contiguous(), None


def _packs_decode(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None
) -> bool:
    """Whether ``flex.packed_decode_attention`` computes what transformers' sdpa would, faster: one decode token per
    row, grouped KV heads, not training; under a mask, one for every head of the token; without one, on CPU only
    (elsewhere transformers' grouped kernel serves)."""
    if query.shape[2] != 1 or query.shape[1] == key.shape[1] or module.training:
        return False
    if attention_mask is None:
        return query.device.type == "cpu"
    return attention_mask.dim() == 4 and attention_mask.shape[1] == attention_mask.shape[2] == 1


def _reads_in_place(
    module: torch.nn.Module, query: torch.Tensor, keys: torch.Tensor, plan: Any, attention_mask: torch.Tensor | None
) -> bool:
    """Whether attention reads ``plan``'s pages in place: not training, in the pool's dtype, and under a mask that
    hides only each row's leading padding, as a compiled step's plan was made for; an eager step's verdict is
    found by its first layer and kept in its plan (``StepPlan.padding_only``) for the others."""
    if module.training:
        return False
    if not plan.ahead and plan.padding_only is None:
        plan.padding_only = mask_hides_padding_only(attention_mask, plan.mask.pads, plan.num_keys, plan.kv_offset)
        if not plan.padding_only:
            flex.log_path("mask", "the model's mask hides more than each row's leading padding")
    if not (plan.ahead or plan.padding_only):
        return False
    if query.dtype != keys.dtype:
        flex.log_path("dtype", f"the query is {query.dtype} and the pool {keys.dtype} (autocast?)")
        return False
    return True


SPARSE_KWARGS = ("indices", "block_indices")
"""The attention kwargs of sparse attention: the keys (DeepSeek-V3.2's lightning indexer, ``[batch, q, top-k]``) or
blocks of keys (MiniMax-M3's, ``[batch, index heads, q, blocks]``) each query keeps, which a model folds into its
mask itself only under ``"eager"`` and ``"sdpa"``; ``_sparse_mask`` folds them here the same way."""


def _sparse_mask(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layout: Any,
    plan: Any,
    kwargs: dict,
    indices: torch.Tensor | None = None,
    block_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's mask with only the keys its indexer picked seen, as its modeling file builds it for ``"sdpa"``.

    Raises:
        IncompatibleModelError: the keys are a window's (not every token from the first): the indexer's picks count
            from token 0.
    """
    if layout is not None or (plan is not None and plan.kv_offset):
        raise IncompatibleModelError(
            f"{type(module).__name__} keeps the keys its indexer picks, counted from the first token, but the cache "
            "hands it a window's keys: serve it with paged_pool or a quantized cache, or without a window."
        )
    batch, num_new, num_keys = query.shape[0], query.shape[2], key.shape[2]
    if indices is not None:  # [batch, q, top-k]: True where a key is not picked
        hidden = torch.ones(batch, num_new, num_keys, dtype=torch.bool, device=query.device)
        hidden = hidden.scatter(-1, indices.long(), False).unsqueeze(1)  # [batch, 1, q, keys]
        if attention_mask is None:
            attention_mask = ~hidden
        elif attention_mask.dtype == torch.bool:
            attention_mask = attention_mask[..., :num_keys] & ~hidden
        else:
            attention_mask = attention_mask[..., :num_keys].masked_fill(hidden, torch.finfo(query.dtype).min)
    if block_indices is not None:
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(num_keys - num_new, num_keys, device=query.device)
        positions = (positions if positions.ndim > 1 else positions.unsqueeze(0)).expand(batch, -1)
        attention_mask = module.indexer.build_block_mask(
            block_indices, attention_mask, num_keys, query.dtype, query.device, positions
        )
    return attention_mask


NOT_APPLIED_BY_SDPA = ("softcap", "s_aux", "sinks", "position_bias")
"""The attention kwargs of what sdpa does not compute (logit softcapping, attention sinks, a relative position bias):
a layer whose attention passes one runs the model's own attention function instead."""


OwnAttention = Callable[..., tuple[torch.Tensor, Any]]
"""A modeling file's ``eager_attention_forward(module, query, key, value, attention_mask, **kwargs)``."""

# What this module finds out about a model's code, once per attention module class or modeling module: plain dicts,
# which a compiled forward pass reads without a graph break.
_OWN: dict[tuple[type, str | None], OwnAttention | None] = {}  # own_attention's answers
_REFUSES_SDPA: dict[str, bool] = {}  # refuses_sdpa's answers
_HANDS_STATES_ONLY: dict[str, bool] = {}  # hands_states_to_attention_only's answers


def own_attention(module: torch.nn.Module, kwargs: dict) -> OwnAttention | None:
    """The modeling file's ``eager_attention_forward`` where sdpa would compute something else for ``module`` (a kwarg
    of ``NOT_APPLIED_BY_SDPA``, or ``refuses_sdpa``); ``None``: sdpa computes what the model does.

    Raises:
        IncompatibleModelError: the model needs its own attention and its modeling file defines none.
    """
    feature = next((name for name in NOT_APPLIED_BY_SDPA if kwargs.get(name) is not None), None)
    key = (type(module), feature)
    if key not in _OWN:
        _OWN[key] = _find_own_attention(*key)
    return _OWN[key]


def _find_own_attention(module_class: type, feature: str | None) -> OwnAttention | None:
    modeling = sys.modules.get(module_class.__module__)
    if feature is None and not refuses_sdpa(module_class.__module__):
        return None
    reason = f"passes {feature!r}" if feature is not None else "belongs to a model that refuses sdpa"
    function = getattr(modeling, "eager_attention_forward", None)
    if not callable(function):
        raise IncompatibleModelError(
            f"{module_class.__name__} {reason}, which sdpa does not apply, and its modeling file "
            f"({module_class.__module__}) defines no eager_attention_forward that attn_implementation="
            f"{ATTENTION_NAME!r} could run instead: load the model with attn_implementation='eager'."
        )
    flex.log_once(
        f"own:{module_class.__module__}.{module_class.__qualname__}:{feature}",
        logging.INFO,
        f"{module_class.__name__} {reason}, which sdpa does not apply: attn_implementation={ATTENTION_NAME!r} runs "
        "the model's own eager_attention_forward over its keys and values, gathered in time order.",
    )
    return function


def refuses_sdpa(modeling_name: str) -> bool:
    """Whether a model class of the modeling module ``modeling_name`` refuses ``attn_implementation="sdpa"``
    (its ``_supports_sdpa`` is false), as transformers checks when the attention is set."""
    if modeling_name not in _REFUSES_SDPA:
        modeling = sys.modules.get(modeling_name)
        if modeling is None:  # no model of it was built: nothing to refuse yet
            return False
        _REFUSES_SDPA[modeling_name] = any(
            getattr(value, "_supports_sdpa", None) is False
            for value in vars(modeling).values()
            if isinstance(value, type) and value.__module__ == modeling_name
        )
    return _REFUSES_SDPA[modeling_name]


def _additive_mask(
    module: torch.nn.Module, attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor
) -> torch.Tensor | None:
    """The mask as an eager attention function adds it to the scores: ``[batch, 1, n, num_keys]`` floats (0: seen),
    from a boolean mask (true: seen) or from ``None`` (causal for a causal module, the queries the last keys)."""
    if attention_mask is None:
        num_new, num_keys = query.shape[2], key.shape[2]
        if num_new == 1 or not getattr(module, "is_causal", True):
            return None
        new = torch.arange(num_keys - num_new, num_keys, device=query.device).unsqueeze(1)  # [n, 1]
        attention_mask = (torch.arange(num_keys, device=query.device) <= new)[None, None]  # [1, 1, n, num_keys]
    if attention_mask.dtype != torch.bool:
        return attention_mask
    scores = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)  # [batch, 1, n, num_keys]
    return scores.masked_fill(~attention_mask, torch.finfo(query.dtype).min)


def model_attention_mask(**kwargs) -> torch.Tensor | None:
    """Our ``AttentionMaskInterface`` entry: sdpa's boolean mask, or for a model that refuses sdpa the additive float
    mask its own code adds to its scores (GIT's). ``kwargs``: what transformers' mask functions take."""
    config = kwargs.get("config")
    modeling = _modeling_name(type(config).__module__) if config is not None else None
    kind = "eager" if modeling is not None and refuses_sdpa(modeling) else "sdpa"
    return _MASKS[kind](**kwargs)


_MASKS = AttentionMaskInterface()  # transformers' mask builders by name


def hands_states_to_attention_only(config: Any) -> bool:
    """Whether every attention module of ``config``'s modeling file hands the keys and values its cache returns to the
    attention function alone, read from their ``forward``'s source: only then may a layer return the pool's storage
    or slots out of time order (with a ``StepPlan`` or ``KeyLayout``), which only this attention reads."""
    modeling = _modeling_name(type(config).__module__)
    if modeling is None:
        return False
    if modeling not in _HANDS_STATES_ONLY:
        _HANDS_STATES_ONLY[modeling] = _modeling_hands_states_only(modeling)
    return _HANDS_STATES_ONLY[modeling]


def _modeling_name(config_module: str) -> str | None:
    """``transformers.models.x.modeling_x`` for ``transformers.models.x.configuration_x`` (``None``: not named so)."""
    package, _, name = config_module.rpartition(".")
    return f"{package}.modeling_{name.removeprefix('configuration_')}" if name.startswith("configuration_") else None


def _modeling_hands_states_only(modeling_name: str) -> bool:
    try:
        modeling = sys.modules.get(modeling_name) or importlib.import_module(modeling_name)
    except ImportError:
        return False
    classes = [
        value for value in vars(modeling).values() if isinstance(value, type) and value.__module__ == modeling_name
    ]
    verdicts = [_hands_states_only(cls) for cls in classes if "forward" in vars(cls)]
    verdicts = [verdict for verdict in verdicts if verdict is not None]
    if not all(verdicts):
        flex.log_once(
            f"states:{modeling_name}",
            logging.INFO,
            f"{modeling_name} uses the keys or values its cache returns besides handing them to the attention "
            "function: its layers return them gathered in time order.",
        )
    return bool(verdicts) and all(verdicts)


def _hands_states_only(module_class: type) -> bool | None:
    """Whether ``module_class.forward`` uses the pair ``keys, values = <cache>.update(...)`` returns only as
    arguments of its ``attention_interface(...)`` call; ``None`` where it updates no cache (or has no source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(module_class.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    update = next((node for node in ast.walk(tree) if _is_cache_update(node)), None)
    if update is None:
        return None
    names = {target.id for target in update.targets[0].elts}
    handed = {
        id(argument)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _called_name(node) == "attention_interface"
        for argument in [*node.args, *(keyword.value for keyword in node.keywords)]
    }
    after = (update.end_lineno, update.end_col_offset)
    return not any(
        isinstance(node, ast.Name)
        and node.id in names
        and isinstance(node.ctx, ast.Load)
        and (node.lineno, node.col_offset) >= after
        and id(node) not in handed
        for node in ast.walk(tree)
    )


def _is_cache_update(node: ast.AST) -> bool:
    """``a, b = <something>.update(...)``."""
    if not isinstance(node, ast.Assign) or len(node.targets) != 1 or not isinstance(node.value, ast.Call):
        return False
    target = node.targets[0]
    pair = isinstance(target, ast.Tuple) and len(target.elts) == 2
    return pair and all(isinstance(name, ast.Name) for name in target.elts) and _called_name(node.value) == "update"


def _called_name(call: ast.Call) -> str:
    function = call.func
    if isinstance(function, ast.Name):
        return function.id
    return function.attr if isinstance(function, ast.Attribute) else ""


def mask_hides_padding_only(
    attention_mask: torch.Tensor | None, pads: torch.Tensor, num_tokens: int, kv_offset: int = 0
) -> bool:
    """Whether the model's ``attention_mask`` (``[batch, 1, q, kv]``, boolean (true: seen) or additive (0: seen), or
    ``None``: all seen) hides, for the step's last query, exactly each row's first ``pads [batch]`` tokens; its
    ``num_tokens`` columns start at token ``kv_offset`` (a window's first visible: ``get_mask_sizes``)."""
    if attention_mask is None:
        return not bool(pads.any())
    if attention_mask.shape[-1] != num_tokens:
        return False
    last = attention_mask[:, 0, -1, :]  # [batch or 1, num_tokens]
    seen = last if last.dtype == torch.bool else last == 0
    columns = torch.arange(kv_offset, kv_offset + num_tokens, device=seen.device)
    expected = columns >= pads.to(seen.device).view(-1, 1)  # [batch, tokens]
    return bool(torch.equal(seen.expand_as(expected), expected))
