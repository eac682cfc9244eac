"""The registry: every ``cache_implementation`` name hf_kvcache adds to ``generate``, one ``CacheEntry`` each.

Adding a cache is one module under ``hf_kvcache/caches/`` (the class and its ``ENTRY``) and its entry here.
``hf_kvcache.integration.seams`` registers these names with transformers; the tests (``tests/conftest.py``'s
``cache_name``), the soak, the evaluation and the benchmarks read the settings they run each cache with from
its entry.
"""

from hf_kvcache.caches import paged, quantized, quantized_kv, ring
from hf_kvcache.caches.entry import CacheEntry

REGISTRY: dict[str, CacheEntry] = {
    entry.name: entry for entry in (paged.ENTRY, ring.ENTRY, quantized.ENTRY, quantized_kv.ENTRY)
}
"""Our ``cache_implementation`` names and their entries, in registration order."""
