"""Benchmarks and the soak: library code under ``scripts/bench_decode.py``, ``scripts/bench_ring_update.py`` and
``scripts/soak.py``.

Modules: ``catalogue`` (the caches compared and how each is built), ``decode`` (decode tokens/s, KV bytes and
peak memory of each cache, against its baselines in the same run; ``decode_report``: its settings, results and
table), ``ring_update`` (one cache update alone,
sliding caches), ``measure`` (RSS and peak memory, other processes' CPU, the scripts' machine options, the
checks and JSON record every benchmark shares), ``soak`` (thousands of short ``generate`` calls on small
pools, checking that memory stays flat) and ``model_matrix`` (every causal LM of transformers' auto mapping, tiny,
through every cache under either attention: ``scripts/model_matrix.py``).
"""

from hf_kvcache.errors import MissingExtraError

try:  # the bench extra (psutil, and the evaluation's packages: the benchmarks read its essays and measures)
    import datasets  # noqa: F401
    import evaluate  # noqa: F401
    import psutil  # noqa: F401
    import tqdm  # noqa: F401
except ModuleNotFoundError as error:
    raise MissingExtraError("bench", "hf_kvcache.bench", error.name) from error
