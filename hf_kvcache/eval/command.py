"""The eval script's command line, defined once: ``scripts/evaluate_caches.py`` parses it, and
``reproduce_command`` writes the invocation that reruns a report (how a card says where its numbers come from)."""

import argparse
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_kvcache.bundled import BUNDLED_MODEL
from hf_kvcache.eval.caches import TRANSFORMERS_KINDS, parse_spec
from hf_kvcache.eval.report import EvalReport
from hf_kvcache.eval.runner import EvalConfig

EVAL_SCRIPT = "scripts/evaluate_caches.py"
DEFAULT_OUTPUT = "eval_results"


@dataclass(frozen=True)
class EvalFlag:
    """A flag of the eval script that sets one ``EvalConfig`` field.

    Attributes:
        field: the ``EvalConfig`` field (and ``report.config`` key) it sets.
        flag: the option, e.g. ``--documents``.
        type: parses one value.
        nargs: argparse's ``nargs`` for a list field (``"*"``), ``None`` for one value.
        help: the option's help.
    """

    field: str
    flag: str
    type: Callable[[str], Any] = str
    nargs: str | None = None
    help: str | None = None


EVAL_FLAGS = (
    EvalFlag("dtype", "--dtype"),
    EvalFlag("source", "--source", help="essays, ruler-essays, wikitext, pg19 or a path"),
    EvalFlag("num_documents", "--documents", int),
    EvalFlag("document_tokens", "--document-tokens", int),
    EvalFlag("prefill_tokens", "--prefill-tokens", int),
    EvalFlag("chunk_size", "--chunk-size", int, help="tokens per forward after prefill"),
    EvalFlag("generation_tokens", "--generation-tokens", int),
    EvalFlag("retrieval_tasks", "--retrieval-tasks", nargs="*"),
    EvalFlag("retrieval_lengths", "--retrieval-lengths", int, nargs="*"),
    EvalFlag("retrieval_depths", "--retrieval-depths", float, nargs="*"),
    EvalFlag("retrieval_samples", "--retrieval-samples", int),
    EvalFlag("seed", "--seed", int),
    EvalFlag(
        "attn_implementation",
        "--attn-implementation",
        help="the model's attention: \"hf_kvcache\" keeps a ring's window within a prompt too (default: %(default)s)",
    ),
)
"""Every flag that sets one ``EvalConfig`` field, in the order ``reproduce_command`` writes them; besides these
the script takes ``--model``, ``--cache`` (repeatable) and ``--output``. Config keys that do not change a report's
numbers have no flag: num_buckets (the per-position plot), progress (a progress bar), model_revision (recorded,
not chosen)."""
_DEFAULT_UNWRITTEN = {"attn_implementation"}
"""Flags added after reports were published: written only where they differ from the script's default."""
_UNFLAGGED = {"model", "specs", "num_buckets", "progress", "model_revision"}


def eval_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The eval script's argument parser: ``--model``, ``--cache``, ``EVAL_FLAGS`` and ``--output``."""
    defaults = EvalConfig()
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=defaults.model, help="'bundled' or a local model folder")
    parser.add_argument(
        "--cache",
        action="append",
        type=parse_spec,
        dest="specs",
        help=f"LABEL=KIND[:key=value,...]; KIND is a registered name or one of {TRANSFORMERS_KINDS} (repeatable)",
    )
    for flag in EVAL_FLAGS:
        parser.add_argument(
            flag.flag,
            dest=flag.field,
            type=flag.type,
            nargs=flag.nargs,
            default=getattr(defaults, flag.field),
            help=flag.help,
        )
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="folder for report.json, report.md and the plots")
    return parser


def parse_eval_args(argv: list[str] | None = None, description: str | None = None) -> tuple[EvalConfig, str]:
    """``(config, output folder)`` of an eval script command line (``argv``: ``sys.argv[1:]`` when ``None``)."""
    args = vars(eval_parser(description).parse_args(argv))
    output = args.pop("output")
    args["specs"] = args["specs"] or []
    return EvalConfig(**args), output


def format_spec(label: str, kind: str, settings: dict[str, Any], attn_implementation: str | None = None) -> str:
    """The eval script's ``--cache LABEL=KIND:key=value,...[@ATTENTION]`` argument, written the way ``parse_spec``
    reads it."""
    options = ",".join(f"{key}={_spec_value(value)}" for key, value in settings.items())
    spec = f"{kind}:{options}" if options else kind
    spec = spec if label == kind and not options else f"{label}={spec}"
    return f"{spec}@{attn_implementation}" if attn_implementation else spec


def _spec_value(value: Any) -> str:
    # parse_spec reads a value as JSON when it can and keeps any other text as a string.
    if isinstance(value, str):
        try:
            json.loads(value)
        except json.JSONDecodeError:
            return value
    return json.dumps(value, separators=(",", ":"))


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
    flagged = {flag.field for flag in EVAL_FLAGS}
    unknown = set(report.config) - flagged - _UNFLAGGED
    if unknown:
        raise ValueError(
            f"report config keys {sorted(unknown)} have no flag in eval.command.EVAL_FLAGS; add them there."
        )
    model = "bundled" if report.config["model"] == BUNDLED_MODEL else report.config["model"]
    words = ["python", EVAL_SCRIPT, "--model", model]
    for spec in report.config["specs"]:
        words += [
            "--cache",
            format_spec(spec["label"], spec["kind"], spec["settings"], spec.get("attn_implementation")),
        ]
    for flag in EVAL_FLAGS:
        default = getattr(EvalConfig(), flag.field)
        value = report.config.get(flag.field, default)
        if flag.field in _DEFAULT_UNWRITTEN and value == default:
            continue
        words += [flag.flag, *map(str, value)] if isinstance(value, list) else [flag.flag, str(value)]
    words += ["--output", output]
    # One flag and its values per line, as a shell reads it.
    lines, line = [], []
    for word in words:
        if word.startswith("--") and line:
            lines.append(shlex.join(line))
            line = []
        line.append(word)
    return " \\\n    ".join([*lines, shlex.join(line)])
