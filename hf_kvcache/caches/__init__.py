"""Our ``transformers.Cache`` subclasses, one file per cache over ``base.PoolCache``."""

from hf_kvcache.caches.paged import PagedCache

__all__ = ["PagedCache"]
