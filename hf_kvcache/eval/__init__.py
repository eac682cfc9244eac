"""Evaluation: the quality each cache costs against the full-precision ``DynamicCache``.

Modules: ``caches`` (what to compare: ``CacheSpec``), ``data`` (essays, text sources, token windows), ``qa``
(RULER's QA data), ``fidelity`` (decode-mode comparison), ``prompts`` (the retrieval tasks' prompts), ``retrieval``
(needle and RULER tasks run and scored), ``report`` (results, JSON/Markdown/plots, the environment record),
``runner`` (one run), ``command`` (the eval script's flags and the command that reruns a report).

The names below are the evaluation's public surface: the benchmarks (``hf_kvcache.bench``) and the model cards
(``hf_kvcache.cards``) use these and nothing else of it (``tests/test_layering.py`` checks that).
"""

from pathlib import Path

from hf_kvcache.errors import MissingExtraError

try:  # the eval extra, checked before any module of the package so that a missing one names the extra
    import datasets  # noqa: F401
    import evaluate  # noqa: F401
    import huggingface_hub  # noqa: F401
    import tqdm  # noqa: F401
except ModuleNotFoundError as error:
    raise MissingExtraError("eval", "hf_kvcache.eval", error.name) from error

from hf_kvcache.eval.caches import CacheSpec, installed_quantized_backends, parse_spec, sliding_window_config
from hf_kvcache.eval.command import format_spec, reproduce_command
from hf_kvcache.eval.data import load_essays
from hf_kvcache.eval.fidelity import kv_bytes
from hf_kvcache.eval.report import CacheResult, EvalReport, change_by_bucket, environment
from hf_kvcache.eval.runner import EvalConfig, run_evaluation

FIDELITY_METRIC_PATH = str(Path(__file__).parent / "metrics" / "kv_cache_fidelity")
"""Folder of the ``evaluate`` metric module: ``evaluate.load(FIDELITY_METRIC_PATH)``."""

__all__ = [
    "FIDELITY_METRIC_PATH",
    "CacheResult",
    "CacheSpec",
    "EvalConfig",
    "EvalReport",
    "change_by_bucket",
    "environment",
    "format_spec",
    "installed_quantized_backends",
    "kv_bytes",
    "load_essays",
    "parse_spec",
    "reproduce_command",
    "run_evaluation",
    "sliding_window_config",
]
