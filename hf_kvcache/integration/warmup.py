"""Compiles ahead of traffic: ``warmup`` runs, once, the decode shapes a serving loop will meet, so that no user
request pays a compile (14-75 s on a CPU) or a CUDA graph recording.

A compiled decode step's shape is its batch and the keys it reads per row: a capacity bucket of pages for layers
that keep every token (``hf_kvcache.layers.plan.capacity_bucket``: a request's bucket follows from its prompt +
``max_new_tokens``), a ring's ``sink_tokens + window`` whatever the length. ``warmup`` runs a short ``generate`` per
batch size and bucket up to ``max_tokens``, stopped two tokens in, with the ``compile_config`` the requests will
pass (``generate`` keeps one compiled forward per model and compiles again when the config changes). Dynamo makes
a dimension it has seen change dynamic, so most buckets cost no graph of their own; a CUDA graph
(``mode="reduce-overhead"``) is recorded per shape, here rather than in a request.
"""

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo
from transformers import CompileConfig, StoppingCriteria, StoppingCriteriaList

from hf_kvcache.caches.binder import release_deferred
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.layers.plan import capacity_bucket

logger = logging.getLogger("hf_kvcache")


@dataclass(frozen=True)
class WarmedShape:
    """One decode shape ``warmup`` ran.

    Attributes:
        batch_size: rows of the step.
        max_tokens: tokens a row was planned to reach (prompt + ``max_new_tokens`` - 1): the bucket's last.
        seconds: wall time of the short generation (its first decode step's compile included).
        graphs: graphs dynamo compiled during it (0: an earlier one served the shape).
    """

    batch_size: int
    max_tokens: int
    seconds: float
    graphs: int


class _StopAfter(StoppingCriteria):
    """Stops every row once it holds ``length`` tokens."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)


def warmup_lengths(max_tokens: int, page_size: int, prompt_tokens: int) -> list[int]:
    """The last token count of each capacity bucket a request of ``prompt_tokens`` to ``max_tokens`` tokens meets."""
    first = capacity_bucket(-(-(prompt_tokens + 2) // page_size))
    last = capacity_bucket(-(-max_tokens // page_size))
    buckets = sorted({capacity_bucket(pages) for pages in range(first, last + 1)})
    return [pages * page_size for pages in buckets]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_arguments(
    model: Any,
    cache_implementation: Any,
    batch_sizes: Any,
    max_tokens: Any,
    cache_config: Any,
    compile_config: Any,
    prompt_tokens: Any,
) -> None:
    """Checks ``warmup``'s arguments before any work.

    Raises:
        TypeError: an argument of the wrong type (named, with its value and the type allowed).
        ValueError: an argument out of its range (named, with its value and the range allowed).
    """
    if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "generate", None)):
        raise TypeError(f"model={type(model).__name__}: give the transformers model requests will run (with generate).")
    if not isinstance(cache_implementation, str):
        raise TypeError(
            f"cache_implementation={cache_implementation!r}: give one of our cache names, {sorted(REGISTRY)}."
        )
    if cache_implementation not in REGISTRY:
        raise ValueError(f"cache_implementation={cache_implementation!r} is not one of ours: {sorted(REGISTRY)}.")
    if not isinstance(batch_sizes, (tuple, list)) or not all(_is_int(size) for size in batch_sizes):
        raise TypeError(f"batch_sizes={batch_sizes!r}: give a tuple or list of ints, such as (1, 2, 4).")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes={batch_sizes!r}: give one or more batch sizes of 1 or more.")
    if not _is_int(prompt_tokens):
        raise TypeError(f"prompt_tokens={prompt_tokens!r}: give an int of 1 or more.")
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens!r}: give an int of 1 or more.")
    if not _is_int(max_tokens):
        raise TypeError(f"max_tokens={max_tokens!r}: give an int of at least prompt_tokens + 2 ({prompt_tokens + 2}).")
    if max_tokens < prompt_tokens + 2:
        raise ValueError(
            f"max_tokens={max_tokens!r} leaves no room for two new tokens after prompt_tokens={prompt_tokens}: give "
            f"at least {prompt_tokens + 2}."
        )
    if cache_config is not None and not isinstance(cache_config, dict):
        raise TypeError(f"cache_config={cache_config!r}: give a dict of the cache's options, or None.")
    if compile_config is not None and not isinstance(compile_config, CompileConfig):
        raise TypeError(f"compile_config={compile_config!r}: give a transformers.CompileConfig, or None.")


def warmup(
    model: Any,
    cache_implementation: str,
    batch_sizes: tuple[int, ...] = (1,),
    max_tokens: int = 2048,
    cache_config: dict[str, Any] | None = None,
    compile_config: CompileConfig | None = None,
    prompt_tokens: int = 8,
) -> list[WarmedShape]:
    """Compiles the decode steps of ``cache_implementation`` for every batch size and capacity bucket up to
    ``max_tokens``, before any request: a short ``generate`` per shape (two new tokens), logged and returned.

    Args:
        model: the model requests will run (its compiled forward is kept on it by ``generate``).
        cache_implementation: one of our cache names.
        batch_sizes: the batch sizes requests will run (rows: batch x beams or returned sequences).
        max_tokens: the most tokens a row of a request may hold (prompt + ``max_new_tokens``).
        cache_config / compile_config: those the requests will pass to ``generate``.
        prompt_tokens: the prompt of each warm-up generation (random token ids).

    Returns:
        One ``WarmedShape`` per batch size and bucket, in the order run.

    Raises:
        TypeError / ValueError: an argument of the wrong type or value (checked before any work: the message
            names the argument, its value and what is allowed).
        ValueError: ``generate`` would not compile this cache here (then there is nothing to warm: the message
            says why and what to change).
    """
    _check_arguments(model, cache_implementation, batch_sizes, max_tokens, cache_config, compile_config, prompt_tokens)
    page_size = REGISTRY[cache_implementation].page_format(model.config, model.dtype, cache_config or {}).page_size
    vocab = model.config.vocab_size
    shapes: list[WarmedShape] = []
    for batch_size in batch_sizes:
        ids = torch.randint(vocab, (batch_size, prompt_tokens), generator=torch.Generator().manual_seed(batch_size))
        for length in warmup_lengths(max_tokens, page_size, prompt_tokens):
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            started = time.perf_counter()
            out = model.generate(
                ids.to(model.device),
                attention_mask=torch.ones_like(ids, device=model.device),
                do_sample=False,
                max_new_tokens=length - prompt_tokens + 1,  # plans rows of `length` tokens: the bucket
                stopping_criteria=StoppingCriteriaList([_StopAfter(prompt_tokens + 2)]),
                cache_implementation=cache_implementation,
                cache_config=cache_config,
                compile_config=compile_config,
                return_dict_in_generate=True,
            )
            if not out.cache.compiled_decoding:
                raise ValueError(
                    f"generate does not compile {cache_implementation} here (is_compileable="
                    f"{out.cache.is_compileable}, device {model.device}): on a CPU pass a compile_config with "
                    "_compile_all_devices = True; a cache whose pool moves when it grows needs cache_config max_tokens."
                )
            seconds = time.perf_counter() - started
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
            del out
            release_deferred()  # the pages of the cache the compile traced, before the next shape or request
            shape = WarmedShape(batch_size, length, seconds, graphs)
            shapes.append(shape)
            logger.info(
                "warmup %s: batch %d, rows up to %d tokens: %.1f s, %d graph(s)",
                cache_implementation,
                batch_size,
                length,
                seconds,
                shape.graphs,
            )
    return shapes
