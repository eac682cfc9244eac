"""Every causal LM of transformers' auto mapping, tiny, through every cache under either attention (``run_model``).

Each model type is built tiny and random-init (``hf_kvcache.testing.tiny_causal_lm``, fp32, eval, seeded) and runs
greedy ``generate`` of ``NEW_TOKENS`` tokens on a left-padded batch of two prompts (``PROMPT_LENGTHS``): first with
``DynamicCache`` under the model's own attention (``sdpa``, or ``eager`` where the model refuses sdpa), the
reference; then with each registered cache under its own attention, and with ``DynamicCache`` and each registered
cache under ``attn_implementation="hf_kvcache"``, each against the reference:

- ``equal``: the tokens, and the logits to within ``EQUAL_TOLERANCE`` of the largest reference logit (of 1 where
  they are all smaller) (lossless caches: ``paged_pool``, ``sliding_ring`` with a window longer than the sequence,
  ``DynamicCache``);
- ``close``: a quantized cache (``LOSSY``: int8 values, and int4 keys per channel, read as codes from the second
  page on) whose logits stay within ``QUANTIZED_BOUND`` of the largest reference logit (or of 1) over the steps its
  tokens agree with the reference's, and at the first step they differ (fed the same tokens until then);
- ``differs``: neither; ``refused``: ``IncompatibleModelError`` (its message is the reason); ``crash``: any other
  error.

A model type that is not built tiny (its config refuses the tiny sizes, it needs an optional package, ...) or that
transformers cannot generate with ``DynamicCache`` is ``skipped`` with the error (that is not a cache's doing).
``scripts/model_matrix.py`` writes the counts and every model's outcomes to ``benchmarks/model_matrix.json``;
``tests/test_model_matrix.py`` runs the same matrix, one test per model type and attention.
"""

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvcache.attention.interface import ATTENTION_NAME, model_attention
from hf_kvcache.errors import IncompatibleModelError
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.testing import random_padded_batch, tiny_causal_lm
from hf_kvcache.transformers_internals import attn_implementation, causal_lm_model_types

PROMPT_LENGTHS = (6, 11)
NEW_TOKENS = 5
OWN = "own"
"""The attention column of the model's own attention (``sdpa``, or ``eager`` where the model refuses sdpa)."""
ATTENTIONS = (OWN, ATTENTION_NAME)
DYNAMIC = "dynamic"
"""The cache column of transformers' ``DynamicCache`` (``generate``'s default)."""
MATRIX_CONFIGS: dict[str, dict[str, Any]] = {
    "paged_pool": {"page_size": 4},
    "sliding_ring": {"window": 64, "sink_tokens": 0, "page_size": 4},  # longer than the sequence: keeps every token
    "quantized_values": {"bits": 8, "residual_length": 2, "page_size": 4},
    "quantized_kv": {"key_bits": 4, "value_bits": 8, "residual_length": 2, "page_size": 4},  # keys per channel
}
"""The ``cache_config`` of each registered cache in the matrix (a cache not named here runs its ``example_config``)."""
MODEL_SETTINGS: dict[str, dict[str, Any]] = {
    # sparse attention the generic tiny config leaves dense: the indexer keeps 4 of a prompt's keys
    **{name: {"index_topk": 4} for name in ("axk2", "deepseek_v32", "dots3_note_text", "glm_moe_dsa", "hy_v4")},
    # DeepSeek-V4's compressed sparse and heavily compressed layers, compressing every 4 and 8 tokens (128 by default:
    # never within the matrix's 16 tokens), the indexer keeping 2 compressed entries a query
    "deepseek_v4": {
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "index_topk": 2,
    },
    # MiniMax-M3's block-sparse layer (the top block of 2 keys and the local one) beside a full-attention layer
    "minimax_m3_vl_text": {
        "layer_types": ["minimax_m3_sparse", "full_attention"],
        "index_topk_blocks": 1,
        "index_block_size": 2,
        "index_local_blocks": 1,
        "index_head_dim": 16,
    },
}
"""Config fields that make a model type's tiny build use an attention feature the tiny sizes alone leave unused."""
LOSSY = frozenset({"quantized_values", "quantized_kv"})
"""Caches held to ``QUANTIZED_BOUND``; every other cache must give the reference's tokens and logits."""
EQUAL_TOLERANCE = 5e-4
QUANTIZED_BOUND = 0.15
"""Most difference of a quantized cache's logits from the reference's, relative to the largest reference logit."""


@dataclass(frozen=True)
class Outcome:
    """One run of the matrix: a model type, an attention and a cache against the reference.

    Attributes:
        status: ``equal``, ``close``, ``differs``, ``refused`` or ``crash`` (module docstring).
        detail: the reason of a refusal, the error of a crash, else ``""``.
        difference: the largest logit difference from the reference over the steps compared, relative to the
            largest reference logit (``None`` for a refusal or a crash).
    """

    model_type: str
    attention: str
    cache: str
    status: str
    detail: str = ""
    difference: float | None = None


@dataclass(frozen=True)
class ModelResult:
    """The outcomes of one model type, or why it was skipped.

    Attributes:
        own_attention: the model's own attention (``sdpa`` or ``eager``); ``None`` when skipped.
        skipped: transformers' error building the model tiny or generating with ``DynamicCache``; ``None`` if run.
        outcomes: one per attention and cache, in ``ATTENTIONS`` and registry order.
    """

    model_type: str
    own_attention: str | None
    skipped: str | None
    outcomes: tuple[Outcome, ...] = ()


def model_types() -> list[str]:
    """The ``model_type`` of every causal LM of transformers' auto mapping, in its order."""
    return causal_lm_model_types()


def columns(attention: str) -> list[str]:
    """The caches run under ``attention``: ours, and ``DynamicCache`` too under ours."""
    return ([] if attention == OWN else [DYNAMIC]) + list(REGISTRY)


def build(model_type: str) -> tuple[Any, Any] | str:
    """The tiny model of ``model_type`` and its reference run, or why transformers cannot build or run it (a
    ``str``)."""
    try:
        model = tiny_causal_lm(model_type, **MODEL_SETTINGS.get(model_type, {}))
    except Exception as error:  # transformers' own failure: a missing package, pixel inputs, remote code, ...
        return f"not built tiny (the tiny sizes or transformers): {_error(error)}"
    try:
        reference = greedy(model, OWN, DYNAMIC)
    except Exception as error:
        return f"transformers cannot generate with DynamicCache: {_error(error)}"
    return model, reference


def greedy(model: Any, attention: str, cache: str) -> Any:
    """Greedy ``generate`` over the matrix's batch under ``attention`` with ``cache``, with its logits."""
    ids, mask = random_padded_batch(list(PROMPT_LENGTHS), model.config.get_text_config().vocab_size, _seed(), low=3)
    settings = {}
    if cache != DYNAMIC:
        config = MATRIX_CONFIGS.get(cache, REGISTRY[cache].example_config)
        settings = {"cache_implementation": cache, "cache_config": dict(config)}
    with model_attention(model, None if attention == OWN else attention), torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            return_dict_in_generate=True,
            output_logits=True,
            **settings,
        )


def compare(model_type: str, attention: str, cache: str, reference: Any, run: Any) -> Outcome:
    """The outcome of ``run`` against the reference (module docstring)."""
    steps = len(reference.logits)
    new_tokens = reference.sequences.shape[1] - steps
    same = (reference.sequences[:, new_tokens:] == run.sequences[:, new_tokens:]).all(0)  # [steps]
    compared = steps if bool(same.all()) else int((~same).nonzero()[0]) + 1  # up to the first step that differs
    scale = max(max(logits.abs().max().item() for logits in reference.logits), 1.0)  # logits below 1: absolute
    difference = max((run.logits[step] - reference.logits[step]).abs().max().item() / scale for step in range(compared))
    if cache in LOSSY:
        status = "close" if difference <= QUANTIZED_BOUND else "differs"
    else:
        status = "equal" if bool(same.all()) and difference <= EQUAL_TOLERANCE else "differs"
    return Outcome(model_type, attention, cache, status, "", round(difference, 6))


def run_cell(model_type: str, model: Any, reference: Any, attention: str, cache: str) -> Outcome:
    """One run of the matrix: ``cache`` under ``attention`` against the reference."""
    try:
        run = greedy(model, attention, cache)
    except IncompatibleModelError as error:
        return Outcome(model_type, attention, cache, "refused", str(error))
    except Exception as error:
        return Outcome(model_type, attention, cache, "crash", _error(error))
    return compare(model_type, attention, cache, reference, run)


def run_model(model_type: str, attentions: Iterable[str] = ATTENTIONS) -> ModelResult:
    """Every cache under each of ``attentions`` on the tiny ``model_type``, against the reference."""
    built = build(model_type)
    if isinstance(built, str):
        return ModelResult(model_type, None, built)
    model, reference = built
    outcomes = tuple(
        run_cell(model_type, model, reference, attention, cache)
        for attention in attentions
        for cache in columns(attention)
    )
    return ModelResult(model_type, attn_implementation(model.config), None, outcomes)


def summary(results: Iterable[ModelResult]) -> dict[str, Any]:
    """Counts of the matrix: model types run and skipped, and per attention the model types of each verdict (the
    worst of their caches': ``crash`` > ``differs`` > ``refused`` > ``close`` > ``equal``) and the runs of each
    status."""
    results = list(results)
    run = [result for result in results if result.skipped is None]
    counts: dict[str, Any] = {"model_types": len(results), "run": len(run), "skipped": len(results) - len(run)}
    order = ["equal", "close", "refused", "differs", "crash"]
    for attention in ATTENTIONS:
        verdicts: Counter[str] = Counter()
        statuses: Counter[str] = Counter()
        for result in run:
            found = [outcome.status for outcome in result.outcomes if outcome.attention == attention]
            if found:
                verdicts[max(found, key=order.index)] += 1
                statuses.update(found)
        counts[attention] = {"models": dict(verdicts), "runs": dict(statuses)}
    return counts


def as_record(result: ModelResult) -> dict[str, Any]:
    """One model type's entry of ``benchmarks/model_matrix.json``."""
    return dataclasses.asdict(result) | {
        "outcomes": [
            {key: value for key, value in dataclasses.asdict(outcome).items() if key != "model_type"}
            for outcome in result.outcomes
        ]
    }


def settings() -> dict[str, Any]:
    """What the matrix runs: the batch, the new tokens, each cache's config and the bounds."""
    return {
        "prompt_lengths": list(PROMPT_LENGTHS),
        "new_tokens": NEW_TOKENS,
        "cache_configs": {name: dict(MATRIX_CONFIGS.get(name, REGISTRY[name].example_config)) for name in REGISTRY},
        "model_settings": MODEL_SETTINGS,
        "equal_tolerance": EQUAL_TOLERANCE,
        "quantized_bound": QUANTIZED_BOUND,
    }


FAMILIES_BEGIN = "<!-- model matrix: begin (scripts/model_matrix.py --write-docs) -->"
FAMILIES_END = "<!-- model matrix: end -->"


def families(record: dict[str, Any]) -> str:
    """The Markdown list of model types served, refused, failing and not run, from a ``benchmarks/model_matrix.json``
    record."""
    served, refused, failing, skipped = [], [], [], []
    for model in record["models"]:
        name = f"`{model['model_type']}`"
        outcomes = model["outcomes"]
        refusals = {outcome["detail"].split(": ")[0].split(", so no")[0] for outcome in outcomes if outcome["detail"]}
        failed = [
            f"{outcome['cache']} {outcome['status']} under {outcome['attention']}"
            for outcome in outcomes
            if outcome["status"] in ("differs", "crash")
        ]
        if model["skipped"] is not None:
            skipped.append(f"{name} ({model['skipped']})")
        elif failed:
            failing.append(f"{name} ({', '.join(failed)})")
        elif any(outcome["status"] == "refused" for outcome in outcomes):
            refused.append(f"{name} ({'; '.join(sorted(refusals))})")
        else:
            served.append(name)
    lines = [
        f"Generated from `benchmarks/model_matrix.json` (transformers {record['transformers']}): of "
        f"{len(record['models'])} causal-LM model types of the auto mapping, {len(served)} give `DynamicCache`'s "
        "tokens (the quantized caches: within their bound) with each of the four caches, under the model's own "
        'attention and under `attn_implementation="hf_kvcache"`:',
        "",
        ", ".join(served) + ".",
        "",
        f"Refused by name ({len(refused)}): " + ("; ".join(refused) or "none") + ".",
        "",
        f"Still failing ({len(failing)}): " + ("; ".join(failing) or "none") + ".",
        "",
        f"Not run ({len(skipped)}: not built tiny, or transformers cannot generate them with `DynamicCache`): "
        + ("; ".join(skipped) or "none")
        + ".",
    ]
    return "\n".join(lines)


def with_families(text: str, record: dict[str, Any]) -> str:
    """``text`` (docs/caches.md) with the block between ``FAMILIES_BEGIN`` and ``FAMILIES_END`` made ``families``.

    Raises:
        ValueError: the markers are missing.
    """
    if FAMILIES_BEGIN not in text or FAMILIES_END not in text:
        raise ValueError(f"docs/caches.md has no {FAMILIES_BEGIN!r} ... {FAMILIES_END!r} block.")
    head, rest = text.split(FAMILIES_BEGIN, 1)
    tail = rest.split(FAMILIES_END, 1)[1]
    return f"{head}{FAMILIES_BEGIN}\n{families(record)}\n{FAMILIES_END}{tail}"


def _seed() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _error(error: BaseException) -> str:
    """An error's type and the first line of its message, at most 300 characters."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"
