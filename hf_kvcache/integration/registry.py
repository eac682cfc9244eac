"""The registry: every ``cache_implementation`` name hf_kvcache adds to ``generate``, one ``CacheEntry`` each. Adding
a cache is one module under ``hf_kvcache/caches/`` (the class and its ``ENTRY``) and its entry here."""

from hf_kvcache.caches import paged, quantized, quantized_kv, ring
from hf_kvcache.caches.entry import CacheEntry

REGISTRY: dict[str, CacheEntry] = {
    entry.name: entry for entry in (paged.ENTRY, ring.ENTRY, quantized.ENTRY, quantized_kv.ENTRY)
}
"""Our ``cache_implementation`` names and their entries, in registration order."""
