"""The ``scripts/evaluate_caches.py`` command that reruns a report: how a card says where its numbers come from."""

import json
import shlex
from typing import Any

from hf_kvcache.eval.report import EvalReport
from hf_kvcache.eval.runner import EvalConfig
from hf_kvcache.models import BUNDLED_MODEL

EVAL_SCRIPT = "scripts/evaluate_caches.py"


def format_spec(label: str, kind: str, settings: dict[str, Any]) -> str:
    """The eval script's ``--cache LABEL=KIND:key=value,...`` argument, written the way ``parse_spec`` reads it."""
    options = ",".join(f"{key}={_spec_value(value)}" for key, value in settings.items())
    spec = f"{kind}:{options}" if options else kind
    return spec if label == kind and not options else f"{label}={spec}"


def _spec_value(value: Any) -> str:
    # parse_spec reads a value as JSON when it can and keeps any other text as a string.
    if isinstance(value, str):
        try:
            json.loads(value)
        except json.JSONDecodeError:
            return value
    return json.dumps(value, separators=(",", ":"))


# report.config key -> flag of the eval script. Keys that do not change the card's numbers have no flag:
# num_buckets (the per-position plot), progress (a progress bar), model_revision (recorded, not chosen).
_EVAL_FLAGS = {
    "dtype": "--dtype",
    "source": "--source",
    "num_documents": "--documents",
    "document_tokens": "--document-tokens",
    "prefill_tokens": "--prefill-tokens",
    "chunk_size": "--chunk-size",
    "generation_tokens": "--generation-tokens",
    "retrieval_tasks": "--retrieval-tasks",
    "retrieval_lengths": "--retrieval-lengths",
    "retrieval_depths": "--retrieval-depths",
    "retrieval_samples": "--retrieval-samples",
    "seed": "--seed",
    "attn_implementation": "--attn-implementation",
}
_DEFAULT_UNWRITTEN = {"attn_implementation"}
"""Flags added after reports were published: written only where they differ from the script's default."""
_UNFLAGGED = {"model", "specs", "num_buckets", "progress", "model_revision"}


def reproduce_command(report: EvalReport, output: str) -> str:
    """The eval script invocation that reruns ``report`` (the report's own ``command`` when it records one).

    Args:
        report: a loaded eval report.
        output: the ``--output`` folder to write the rerun's report to.

    Raises:
        ValueError: the report's config has a key this function cannot turn into a flag.
    """
    if "command" in report.config:
        return report.config["command"]
    unknown = set(report.config) - set(_EVAL_FLAGS) - _UNFLAGGED
    if unknown:
        raise ValueError(
            f"report config keys {sorted(unknown)} have no flag in eval.command._EVAL_FLAGS; add them there."
        )
    model = "bundled" if report.config["model"] == BUNDLED_MODEL else report.config["model"]
    words = ["python", EVAL_SCRIPT, "--model", model]
    for spec in report.config["specs"]:
        words += ["--cache", format_spec(spec["label"], spec["kind"], spec["settings"])]
    for key, flag in _EVAL_FLAGS.items():
        value = report.config.get(key, getattr(EvalConfig(), key))
        if key in _DEFAULT_UNWRITTEN and value == getattr(EvalConfig(), key):
            continue
        words += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    words += ["--output", output]
    # One flag and its values per line, as a shell reads it.
    lines, line = [], []
    for word in words:
        if word.startswith("--") and line:
            lines.append(shlex.join(line))
            line = []
        line.append(word)
    return " \\\n    ".join([*lines, shlex.join(line)])
