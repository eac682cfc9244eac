"""The layers: one layer group's rows of a cache on the shared pool, one small file per policy.

- ``plan``: a decode step planned before the forward pass (``StepPlan``), what a compiled graph reads;
- ``window``: the ring's arithmetic; ``identical``: a prefill's identical rows, which share their pages;
- ``exact``: what a quantized pool's layers keep in full precision (the residual window, the exact sink);
- ``key_codes``: full key pages to and from their codes; ``keys``: keys stored as codes a page at a time;
  ``store``: writing and reading a layer group's slots;
- ``read_path``: how attention reads a step's pages (gathered, a run, in place) and the block mask in place uses;
- ``planned``: the rows' planned steps (``PlannedRows``); ``rows``: ``PagedRows``, the page table and the index
  tensors attention needs, in place or gathered;
- ``paged``: the growing layer, which keeps every token; ``ring``: the sliding ring, a fixed set of pages per row
  (``RingRows``); ``ring_layer``: its layer.
"""

from hf_kvcache.layers.paged import PagedLayer
from hf_kvcache.layers.read_path import GATHER, IN_PLACE, RUN
from hf_kvcache.layers.ring import RingRows
from hf_kvcache.layers.ring_layer import RingLayer
from hf_kvcache.layers.rows import PagedRows

__all__ = ["GATHER", "IN_PLACE", "RUN", "PagedLayer", "PagedRows", "RingLayer", "RingRows"]
