"""Long-context retrieval accuracy through a given cache: every cache generates from the same prompts
(``hf_kvcache.eval.prompts``: needle in a haystack and RULER's retrieval tasks), and the answers are scored.

Scoring is RULER's ``string_match_part``: an output is correct when any expected answer occurs in it,
case-insensitively.

"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_kvcache.attention.interface import model_attention
from hf_kvcache.eval.caches import CacheSpec
from hf_kvcache.eval.prompts import TASKS, PromptBuilder


@dataclass(frozen=True)
class RetrievalResult:
    """One cache's answer to one prompt.

    Attributes:
        task: one of ``TASKS``.
        cache: the cache spec's label.
        context_length: the prompt's actual length in tokens.
        target_length: the requested prompt length in tokens.
        depth: where the needle (or the first gold document) sat, as a fraction of the context.
        sample: the sample index within ``(task, target_length, depth)``.
        expected: the answers; any one of them in ``output`` scores.
        output: the generated text (new tokens only, special tokens removed).
        correct: whether ``output`` contains an expected answer (``is_correct``).
    """

    task: str
    cache: str
    context_length: int
    target_length: int
    depth: float
    sample: int
    expected: tuple[str, ...]
    output: str
    correct: bool


def is_correct(output: str, expected: Sequence[str]) -> bool:
    """RULER's ``string_match_part`` for one sample: any expected answer occurs in ``output``, ignoring case."""
    return any(answer.lower() in output.lower() for answer in expected)


@torch.inference_mode()
def run_retrieval(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    specs: list[CacheSpec],
    lengths: list[int],
    depths: list[float],
    tasks: list[str],
    samples: int = 1,
    seed: int = 0,
    max_new_tokens: int = 12,
    progress: bool = True,
) -> list[RetrievalResult]:
    """Generates greedily through every cache from the same prompts and scores the answers.

    Prompts: for ``needle``, one per ``(length, depth, sample)``; for the RULER tasks, one per
    ``(length, sample)`` at the position the recipe draws. All prompts are built before any generation,
    so a length too short for a template fails at once.

    Args:
        model: a causal LM; its vocabulary must cover ``tokenizer``'s ids.
        tokenizer: the model's tokenizer.
        specs: the caches to compare; labels must be unique.
        lengths: prompt lengths in tokens.
        depths: needle depths (0..1) of the ``needle`` task.
        tasks: names from ``TASKS``.
        samples: prompts per ``(task, length, depth)``.
        seed: base seed of the needles, keys, questions and distractors.
        max_new_tokens: tokens generated per answer.
        progress: show a progress bar over ``prompts x caches``.

    Returns:
        One result per prompt and cache, prompt-major, caches in ``specs`` order.

    Raises:
        ValueError: for empty or duplicate specs, unknown tasks, non-positive sizes, or prompts that
            would outgrow the model's ``max_position_embeddings`` or vocabulary.
    """
    _check_run(model, tokenizer, specs, lengths, depths, tasks, samples, max_new_tokens)
    builder = PromptBuilder(tokenizer, seed)
    prompts = [
        builder.build(task, length, sample, depth)
        for task in tasks
        for length in lengths
        for depth in (depths if task == "needle" else [None])
        for sample in range(samples)
    ]
    results = []
    with tqdm(total=len(prompts) * len(specs), desc="retrieval", disable=not progress) as bar:
        for prompt in prompts:
            input_ids = torch.tensor([prompt.input_ids], device=model.device)  # [1, prompt_len]
            for spec in specs:
                output = _generate(model, tokenizer, input_ids, spec, max_new_tokens)
                results.append(
                    RetrievalResult(
                        task=prompt.task,
                        cache=spec.label,
                        context_length=len(prompt.input_ids),
                        target_length=prompt.target_length,
                        depth=prompt.depth,
                        sample=prompt.sample,
                        expected=prompt.expected,
                        output=output,
                        correct=is_correct(output, prompt.expected),
                    )
                )
                bar.update()
    return results


def _check_run(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    specs: list[CacheSpec],
    lengths: list[int],
    depths: list[float],
    tasks: list[str],
    samples: int,
    max_new_tokens: int,
) -> None:
    labels = [spec.label for spec in specs]
    if not labels or len(set(labels)) != len(labels):
        raise ValueError(f"specs must be non-empty with unique labels; got {labels}.")
    if not tasks or not set(tasks) <= set(TASKS):
        raise ValueError(f"tasks={tasks} must be a non-empty list from {list(TASKS)}.")
    if "needle" in tasks and not depths:
        raise ValueError("The needle task needs at least one depth in depths.")
    for name, value in (("samples", samples), ("max_new_tokens", max_new_tokens), *(("lengths", n) for n in lengths)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}.")
    if not lengths:
        raise ValueError("lengths must hold at least one prompt length.")
    max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if max_positions is not None and max(lengths) + max_new_tokens > max_positions:
        raise ValueError(
            f"lengths up to {max(lengths)} plus max_new_tokens={max_new_tokens} exceed the model's "
            f"max_position_embeddings={max_positions}."
        )
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ValueError(f"The tokenizer has {len(tokenizer)} tokens but the model embeds only {vocab}.")


def _generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    input_ids: torch.Tensor,
    spec: CacheSpec,
    max_new_tokens: int,
) -> str:
    """Greedy answer to ``input_ids`` (``[1, prompt_len]``) through a fresh cache of ``spec``, under its attention."""
    prompt_len = input_ids.shape[1]
    cache = spec.build(model, max_cache_len=prompt_len + max_new_tokens)
    with model_attention(model, spec.attn_implementation):
        tokens = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            cache=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )  # [1, prompt_len + generated]
    return tokenizer.decode(tokens[0, prompt_len:], skip_special_tokens=True)


def accuracy_table(results: Sequence[RetrievalResult]) -> dict[str, dict[str, Any]]:
    """Accuracy per cache, and per ``(task, target_length)`` and ``(task, target_length, depth)`` of each cache.

    Returns:
        ``{label: {"accuracy", "num_samples", "by_length": rows, "by_depth": rows}}`` with caches in order
        of first appearance; each row holds its key fields, ``accuracy`` (0..1), ``num_samples`` and
        ``mean_context_length`` (actual tokens), sorted by task, length and depth. Plain Python values,
        ready for ``json.dump``.
    """
    by_cache: dict[str, list[RetrievalResult]] = {}
    for result in results:
        by_cache.setdefault(result.cache, []).append(result)
    return {
        label: {
            "accuracy": _accuracy(records),
            "num_samples": len(records),
            "by_length": _rows(records, ("task", "target_length")),
            "by_depth": _rows(records, ("task", "target_length", "depth")),
        }
        for label, records in by_cache.items()
    }


def _rows(results: list[RetrievalResult], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    groups: dict[tuple[Any, ...], list[RetrievalResult]] = {}
    for result in results:
        groups.setdefault(tuple(getattr(result, key) for key in keys), []).append(result)
    return [
        {
            **dict(zip(keys, group_key)),
            "accuracy": _accuracy(groups[group_key]),
            "num_samples": len(groups[group_key]),
            "mean_context_length": sum(result.context_length for result in groups[group_key]) / len(groups[group_key]),
        }
        for group_key in sorted(groups)
    ]


def _accuracy(results: list[RetrievalResult]) -> float:
    return sum(result.correct for result in results) / len(results)
