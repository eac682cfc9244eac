"""Cache layers on the shared pool: one small file per policy over ``rows.PagedRows``."""

from hf_kvcache.layers.paged import PagedLayer
from hf_kvcache.layers.ring import RingLayer, RingRows
from hf_kvcache.layers.rows import PagedRows

__all__ = ["PagedLayer", "PagedRows", "RingLayer", "RingRows"]
