"""Tests for hf_kvcache.eval.qa: RULER's QA items and distractor paragraphs, read as RULER reads them."""

import pytest

from hf_kvcache.eval.qa import QAItem, load_qa, qa_distractor_pool


def test_squad_items_follow_ruler() -> None:
    items = load_qa("squad")
    assert len(items) == 5928  # answerable questions only
    first = items[0]
    assert isinstance(first, QAItem)
    assert first.question == "In what country is Normandy located?"
    assert first.answers == ("France",)  # four identical references, deduplicated
    assert len(first.documents) == 1 and first.documents[0].startswith("The Normans")
    assert len(first.related_documents) == 38  # the article's other paragraphs
    assert first.documents[0] not in first.related_documents
    assert all(any(answer in item.documents[0] for answer in item.answers) for item in items)
    pool = qa_distractor_pool("squad")
    assert len(pool) == 1204 and pool == sorted(pool)
    pool_set = set(pool)
    assert all(set(item.documents + item.related_documents) <= pool_set for item in items)


def test_hotpotqa_items_follow_ruler() -> None:
    items = load_qa("hotpotqa")
    assert len(items) == 7405
    first = items[0]
    assert first.question == "Were Scott Derrickson and Ed Wood of the same nationality?"
    assert first.answers == ("yes",)
    assert [doc.split("\n")[0] for doc in first.documents] == ["Scott Derrickson", "Ed Wood"]
    assert len(first.related_documents) == 8
    assert all(len(item.documents) == 2 for item in items)
    pool = qa_distractor_pool("hotpotqa")
    assert len(pool) == 66635 and pool == sorted(pool)
    pool_set = set(pool)
    assert all(set(item.documents + item.related_documents) <= pool_set for item in items)


def test_unknown_qa_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"name='nq'.*'squad', 'hotpotqa'"):
        load_qa("nq")
    with pytest.raises(ValueError, match="'squad', 'hotpotqa'"):
        qa_distractor_pool("nq")
