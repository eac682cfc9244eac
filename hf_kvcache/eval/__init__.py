"""Evaluation: the quality each cache costs against the full-precision ``DynamicCache``."""

from pathlib import Path

FIDELITY_METRIC_PATH = str(Path(__file__).parent / "metrics" / "kv_cache_fidelity")
"""Folder of the ``evaluate`` metric module: ``evaluate.load(FIDELITY_METRIC_PATH)``."""
