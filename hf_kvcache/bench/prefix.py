"""Benchmark of prompt reuse across ``generate`` calls (the pool's prefix index), with and without the index, in
one run (``scripts/bench_prefix.py``).

The path a user gets: ``model.generate(cache_implementation=CACHE, cache_config={"pool": pool})`` with ``pool =
KVPool.for_model(model, max_tokens=..., prefix_caching=on)``, a fresh pool per mode and part. Three parts:

- **shared prompt**: a ``prefix_tokens`` document followed by ``num_questions`` distinct ``question_tokens``
  questions, ``new_tokens`` greedy tokens each, one call after another. The first question of each mode is a
  warm-up (with the index it publishes the document); the others are timed, modes interleaved question by
  question: time to first token (the prefill and the first pick, read from a streamer) and the call's total time,
  medians. Each question's greedy tokens are compared across modes, and so are its logits (largest difference).
- **concurrent**: the document is generated on once (``max_new_tokens=1``), then ``num_questions`` threads each
  answer one question at once on the pool (each waits after its prefill until all have prefilled, so that the
  requests hold their prompts' pages at the same time however the threads are scheduled): its high-water pages,
  against the issue's bound
  ``prefix + num_questions * (question + answer) + num_questions`` pages (one partial page each).
- **chat**: ``chat_turns`` turns, the first prompt the document, each next prompt the previous prompt, its answer
  and a new ``chat_message_tokens`` message: tokens prefilled per turn (the prompt less the tokens reused).

On a model whose state layers keep their states for prompt reuse (a hybrid: ``StateTails``), a prefill with the index
runs as forward passes ending where the states are kept. Unless the document's end is such a place for the first
question, the second parts from the index where no states are kept, prefills in full and keeps them there: it warms up
too. ``run_prefix_parts`` logs each call of the shared-prompt, first-call and chat parts (threads excepted): the
tokens it reused and the forward passes it ran before its first token (``CallPath``); on request it adds a part:

- **first call**: the shared prompt's questions asked on an empty index each (the index reset before each call,
  untimed), against no index: what the split prefill costs a call that reuses nothing.

Timings come from one process on one device; they are medians over questions, not over repeated runs of one.
"""

import dataclasses
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel

from hf_kvcache.bench import measure
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.memory.pool import KVPool

MODES = ("without_index", "with_index")


@dataclass(frozen=True)
class PrefixBenchConfig:
    """What the prefix benchmark measures.

    Attributes:
        prefix_tokens: tokens of the shared document.
        question_tokens: tokens of each question (and of each chat message).
        new_tokens: greedy tokens generated per question (and per chat turn).
        num_questions: questions asked one after another, and threads answering at once.
        chat_turns: turns of the chat.
        cache: the ``cache_implementation`` (its registry entry's example config).
        page_size: token slots per page.
    """

    prefix_tokens: int = 2048
    question_tokens: int = 64
    new_tokens: int = 32
    num_questions: int = 8
    chat_turns: int = 6
    cache: str = "paged_pool"
    page_size: int = 16

    def __post_init__(self) -> None:
        for name in ("prefix_tokens", "question_tokens", "new_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("num_questions", "chat_turns"):
            if getattr(self, name) < 2:
                raise ValueError(
                    f"{name} must be >= 2 (one warm-up or first turn, then one measured), got {getattr(self, name)}."
                )
        if self.cache not in REGISTRY:
            raise ValueError(f"Unknown cache {self.cache!r}; choose from {sorted(REGISTRY)}.")

    @property
    def tokens_needed(self) -> int:
        """Tokens of the stream the benchmark reads: the document, the questions, the chat messages."""
        return self.prefix_tokens + (self.num_questions + self.chat_turns) * self.question_tokens

    @property
    def max_pool_tokens(self) -> int:
        """Tokens each pool holds: every concurrent request in full, twice over (room for cached pages)."""
        per_request = self.prefix_tokens + self.question_tokens + self.new_tokens + self.page_size
        longest_chat = self.prefix_tokens + self.chat_turns * (self.question_tokens + self.new_tokens)
        return 2 * max(self.num_questions * per_request, longest_chat + self.page_size)


@dataclass
class SharedPromptResult:
    """One mode of the shared-prompt part (medians over the timed questions)."""

    mode: str
    questions_timed: int
    median_ttft_ms: float
    median_total_ms: float
    prefill_tokens_per_question: float
    ttft_speedup: float | None = None  # without / with, on the with-index row
    total_speedup: float | None = None
    tokens_match: bool | None = None  # with-index row: every question's tokens equal the other mode's
    max_logit_diff: float | None = None  # with-index row: largest |difference| of any generated step's logits


@dataclass
class ConcurrentResult:
    """One mode of the concurrent part."""

    mode: str
    threads: int
    high_water_pages: int
    bound_pages: int  # the bound: prefix + threads * (question + answer) + threads, in pages
    wall_s: float


@dataclass
class ChatTurnResult:
    """One chat turn in both modes."""

    turn: int
    prompt_tokens: int
    prefilled_without_index: int
    prefilled_with_index: int
    reused_share: float  # of the prompt, with the index
    tokens_match: bool


@dataclass
class CallPath:
    """The path one ``generate`` call took: what it reused and how it prefilled."""

    part: str  # shared_prompt, first_call or chat
    mode: str
    call: int  # the question, or the chat turn
    warmup: bool
    prompt_tokens: int
    tokens_reused: int
    prefill_passes: int  # forward passes of the model before the first new token


@dataclass
class PrefixRun:
    """The parts of one run (``run_prefix_parts``); ``first_call`` empty unless asked for."""

    shared: list[SharedPromptResult]
    concurrent: list[ConcurrentResult]
    chat: list[ChatTurnResult]
    first_call: list[SharedPromptResult]
    calls: list[CallPath]


class _FirstToken:
    """A ``generate`` streamer (``put``/``end``, as transformers' ``TextStreamer``) that notes when the first new token
    is handed over (its second ``put``: the first is the prompt) and, as a forward pre-hook of the model
    (``count_pass``), the forward passes run before it."""

    def __init__(self) -> None:
        self.puts = self.passes = 0
        self.first_token_at: float | None = None
        self.passes_before_first_token = 0

    def count_pass(self, module: torch.nn.Module, args: tuple) -> None:
        self.passes += 1

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()
            self.passes_before_first_token = self.passes

    def end(self) -> None:
        pass


def random_token_stream(vocab_size: int, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """``[num_tokens]`` random ids in ``[3, vocab_size)`` (the first ids are often special): prompts for a model with
    random weights, whose text means nothing; prompt reuse keys on the ids alone."""
    return torch.randint(3, vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed))


def run_prefix_benchmark(
    model: PreTrainedModel, token_stream: torch.Tensor, config: PrefixBenchConfig
) -> tuple[list[SharedPromptResult], list[ConcurrentResult], list[ChatTurnResult]]:
    """Runs the three parts (module docstring) on ``model``; see ``run_prefix_parts``."""
    run = run_prefix_parts(model, token_stream, config)
    return run.shared, run.concurrent, run.chat


def run_prefix_parts(
    model: PreTrainedModel, token_stream: torch.Tensor, config: PrefixBenchConfig, first_call: bool = False
) -> PrefixRun:
    """Runs the three parts (module docstring) on ``model``, and with ``first_call`` the first-call part; logs the
    calls.

    Args:
        token_stream: ``[num_tokens]`` ids, at least ``config.tokens_needed``: the document first, then the
            questions, then the chat messages.
    """
    if token_stream.ndim != 1 or token_stream.numel() < config.tokens_needed:
        raise ValueError(
            f"token_stream must be 1-D with at least {config.tokens_needed} tokens, got shape "
            f"{tuple(token_stream.shape)}; lower prefix_tokens, question_tokens or num_questions."
        )
    stream = token_stream.to(model.device)
    document = stream[: config.prefix_tokens]
    offset, size = config.prefix_tokens, config.question_tokens
    questions = [stream[offset + i * size : offset + (i + 1) * size] for i in range(config.num_questions)]
    offset += config.num_questions * size
    messages = [stream[offset + i * size : offset + (i + 1) * size] for i in range(config.chat_turns)]
    prompts = [torch.cat([document, question])[None] for question in questions]  # each [1, prefix + question]
    calls: list[CallPath] = []
    return PrefixRun(
        shared=_shared_prompt(model, prompts, config, calls),
        concurrent=_concurrent(model, document[None], prompts, config),
        chat=_chat(model, document[None], messages, config, calls),
        first_call=_shared_prompt(model, prompts, config, calls, fresh_index=True) if first_call else [],
        calls=calls,
    )


def _pool(model: PreTrainedModel, config: PrefixBenchConfig, mode: str) -> KVPool:
    entry = REGISTRY[config.cache]
    cache_config = entry.config({**entry.example_config, "page_size": config.page_size})
    return KVPool.for_model(model, cache_config, max_tokens=config.max_pool_tokens, prefix_caching=mode == "with_index")


def _generate(model: PreTrainedModel, ids: torch.Tensor, pool: KVPool, config: PrefixBenchConfig, **kwargs: Any):
    cache_config = {**REGISTRY[config.cache].example_config, "pool": pool}
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache_implementation=config.cache,
        cache_config=cache_config,
        do_sample=False,
        **{"max_new_tokens": config.new_tokens, **kwargs},
    )


def _logged_generate(
    model: PreTrainedModel,
    ids: torch.Tensor,
    pool: KVPool,
    config: PrefixBenchConfig,
    call: CallPath,
    calls: list[CallPath],
) -> tuple[Any, float, float]:
    """One ``generate`` call over ``ids`` (its output with logits), logged to ``calls`` as ``call`` with the tokens it
    reused and its forward passes before the first token; returns the output, the seconds to the first token and in
    all."""
    streamer = _FirstToken()
    hook = model.register_forward_pre_hook(streamer.count_pass)
    before = pool.stats()["prefix_tokens_reused"]
    start = time.perf_counter()
    try:
        out = _generate(model, ids, pool, config, streamer=streamer, return_dict_in_generate=True, output_logits=True)
    finally:
        hook.remove()
    end = time.perf_counter()
    reused = pool.stats()["prefix_tokens_reused"] - before
    calls.append(dataclasses.replace(call, tokens_reused=reused, prefill_passes=streamer.passes_before_first_token))
    return out, streamer.first_token_at - start, end - start


def _shared_prompt(
    model: PreTrainedModel,
    prompts: list[torch.Tensor],
    config: PrefixBenchConfig,
    calls: list[CallPath],
    fresh_index: bool = False,
) -> list[SharedPromptResult]:
    """The shared-prompt part, or with ``fresh_index`` the first-call part (module docstring); logs to ``calls``."""
    part = "first_call" if fresh_index else "shared_prompt"
    pools = {mode: _pool(model, config, mode) for mode in MODES}
    ttft: dict[str, list[float]] = {mode: [] for mode in MODES}
    total: dict[str, list[float]] = {mode: [] for mode in MODES}
    outputs: dict[str, list[Any]] = {mode: [] for mode in MODES}
    for index, ids in enumerate(prompts):
        for mode in MODES:
            if fresh_index and mode == "with_index":
                pools[mode].reset_prefix_index()
            out, first_token_s, total_s = _logged_generate(
                model, ids, pools[mode], config, CallPath(part, mode, index, False, ids.shape[1], 0, 0), calls
            )
            ttft[mode].append(first_token_s)
            total[mode].append(total_s)
            outputs[mode].append((out.sequences.cpu(), [step.cpu() for step in out.logits]))
            del out
        if index == 0 and len(prompts) < 3 and not fresh_index and calls[-1].prefill_passes > 1:
            raise ValueError(
                "num_questions must be >= 3 on a model whose state layers keep their states for prompt reuse (two "
                f"questions may warm up), got {len(prompts)}."
            )
    part_calls = [c for c in calls if c.part == part]
    with_index_calls = [c for c in part_calls if c.mode == "with_index"]
    warmups = 1  # question 0 (it publishes the document with the index)
    if not fresh_index and with_index_calls[0].prefill_passes > 1 and not with_index_calls[1].tokens_reused:
        warmups = 2  # question 1 parted from the index where question 0 kept no states (module docstring)
    for call in part_calls:
        call.warmup = call.call < warmups
    timed = len(prompts) - warmups
    prompt_tokens = prompts[0].shape[1]
    reused = sum(c.tokens_reused for c in with_index_calls[warmups:]) / timed
    results = []
    for mode in MODES:
        results.append(
            SharedPromptResult(
                mode=mode,
                questions_timed=timed,
                median_ttft_ms=statistics.median(ttft[mode][warmups:]) * 1e3,
                median_total_ms=statistics.median(total[mode][warmups:]) * 1e3,
                prefill_tokens_per_question=prompt_tokens - (reused if mode == "with_index" else 0),
            )
        )
    with_index = results[1]
    with_index.ttft_speedup = results[0].median_ttft_ms / with_index.median_ttft_ms
    with_index.total_speedup = results[0].median_total_ms / with_index.median_total_ms
    pairs = list(zip(outputs["without_index"][warmups:], outputs["with_index"][warmups:], strict=True))
    with_index.tokens_match = all(torch.equal(a[0], b[0]) for a, b in pairs)
    with_index.max_logit_diff = max(
        (x - y).abs().max().item() for a, b in pairs for x, y in zip(a[1], b[1], strict=False)
    )
    return results


def _concurrent(
    model: PreTrainedModel, document: torch.Tensor, prompts: list[torch.Tensor], config: PrefixBenchConfig
) -> list[ConcurrentResult]:
    page_size = config.page_size
    bound = (
        config.prefix_tokens // page_size
        + len(prompts) * ((config.question_tokens + config.new_tokens) // page_size)
        + len(prompts)
    )
    results = []
    for mode in MODES:
        pool = _pool(model, config, mode)
        _generate(model, document, pool, config, max_new_tokens=1)  # with the index: publishes the document
        start = time.perf_counter()
        _answer_at_once(model, prompts, pool, config)
        pool.check_integrity()
        results.append(
            ConcurrentResult(
                mode=mode,
                threads=len(prompts),
                high_water_pages=pool.stats()["high_water_pages"],
                bound_pages=bound,
                wall_s=time.perf_counter() - start,
            )
        )
    return results


def _answer_at_once(
    model: PreTrainedModel, prompts: list[torch.Tensor], pool: KVPool, config: PrefixBenchConfig
) -> None:
    """One thread per prompt, all starting together on ``pool``; re-raises the first thread's error."""
    barrier, prefilled, errors = threading.Barrier(len(prompts)), threading.Barrier(len(prompts)), []

    def answer(ids: torch.Tensor) -> None:
        try:
            barrier.wait()
            _generate(model, ids, pool, config, logits_processor=LogitsProcessorList([_AllPrefilled(prefilled)]))
        except Exception as error:  # noqa: BLE001  (re-raised below, in the calling thread)
            errors.append(error)

    threads = [threading.Thread(target=answer, args=(ids,)) for ids in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


class _AllPrefilled(LogitsProcessor):
    """Holds a request at its first pick (its prompt's pages taken) until every request of ``barrier`` is there."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier, self.waited = barrier, False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.waited:
            self.waited = True
            self.barrier.wait(timeout=300)
        return scores


def _chat(
    model: PreTrainedModel,
    document: torch.Tensor,
    messages: list[torch.Tensor],
    config: PrefixBenchConfig,
    calls: list[CallPath],
) -> list[ChatTurnResult]:
    pools = {mode: _pool(model, config, mode) for mode in MODES}
    prompt, history = document, None  # history: the last turn's prompt and answer
    results = []
    for turn, message in enumerate(messages, start=1):
        if history is not None:
            prompt = torch.cat([history, message[None]], dim=1)
        answers, prefilled = {}, {}
        for mode in MODES:
            call = CallPath("chat", mode, turn, False, prompt.shape[1], 0, 0)
            answers[mode] = _logged_generate(model, prompt, pools[mode], config, call, calls)[0].sequences
            prefilled[mode] = prompt.shape[1] - calls[-1].tokens_reused
        history = answers["without_index"]
        results.append(
            ChatTurnResult(
                turn=turn,
                prompt_tokens=prompt.shape[1],
                prefilled_without_index=prefilled["without_index"],
                prefilled_with_index=prefilled["with_index"],
                reused_share=1 - prefilled["with_index"] / prompt.shape[1],
                tokens_match=torch.equal(answers["without_index"], answers["with_index"]),
            )
        )
    return results


def markdown_table(
    shared: Sequence[SharedPromptResult],
    concurrent: Sequence[ConcurrentResult],
    chat: Sequence[ChatTurnResult],
    first_call: Sequence[SharedPromptResult] = (),
    calls: Sequence[CallPath] = (),
) -> str:
    """The parts as Markdown tables: the three, then the first-call part and the calls' paths where given."""
    lines = _shared_table("shared prompt", shared)
    lines += ["", "| concurrent | threads | high-water pages | bound | wall s |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in concurrent:
        lines.append(f"| {r.mode} | {r.threads} | {r.high_water_pages} | {r.bound_pages} | {r.wall_s:.1f} |")
    lines += [
        "",
        "| chat turn | prompt tokens | prefilled without | prefilled with | reused | tokens match |",
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in chat:
        lines.append(
            f"| {r.turn} | {r.prompt_tokens} | {r.prefilled_without_index} | {r.prefilled_with_index} "
            f"| {r.reused_share:.0%} | {'yes' if r.tokens_match else 'no'} |"
        )
    if first_call:
        lines += ["", *_shared_table("first call", first_call)]
    if calls:
        lines += [
            "",
            "| calls (* warm-up) | mode | tokens reused, per call | forward passes to the first token, per call |",
            "| --- | --- | --- | --- |",
        ]
        for part, mode in dict.fromkeys((c.part, c.mode) for c in calls):
            group = [c for c in calls if (c.part, c.mode) == (part, mode)]
            reused = ", ".join(f"{c.tokens_reused}{'*' * c.warmup}" for c in group)
            passes = ", ".join(f"{c.prefill_passes}{'*' * c.warmup}" for c in group)
            lines.append(f"| {part} | {mode} | {reused} | {passes} |")
    return "\n".join(lines)


def _shared_table(title: str, results: Sequence[SharedPromptResult]) -> list[str]:
    lines = [
        f"| {title} | TTFT ms | total ms | prefilled/question | TTFT speedup | total speedup | tokens match "
        "| max logit diff |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in results:
        speedups = ("-", "-") if r.ttft_speedup is None else (f"{r.ttft_speedup:.1f}x", f"{r.total_speedup:.1f}x")
        match = "-" if r.tokens_match is None else ("yes" if r.tokens_match else "no")
        diff = "-" if r.max_logit_diff is None else f"{r.max_logit_diff:.1e}"
        lines.append(
            f"| {r.mode} | {r.median_ttft_ms:.1f} | {r.median_total_ms:.1f} | {r.prefill_tokens_per_question:.0f} "
            f"| {speedups[0]} | {speedups[1]} | {match} | {diff} |"
        )
    return lines


def results_record(
    shared: Sequence[SharedPromptResult],
    concurrent: Sequence[ConcurrentResult],
    chat: Sequence[ChatTurnResult],
    config: PrefixBenchConfig,
    info: dict[str, Any],
    first_call: Sequence[SharedPromptResult] = (),
    calls: Sequence[CallPath] = (),
) -> dict[str, Any]:
    """The JSON-ready record of one invocation: machine, settings, then each part's results (the first-call part and
    the calls' paths where given)."""
    record = measure.results_record([], config, info)
    parts = {"shared_prompt": shared, "concurrent": concurrent, "chat": chat, "first_call": first_call, "calls": calls}
    record["results"] = {
        part: [dataclasses.asdict(result) for result in results] for part, results in parts.items() if results
    }
    return record
