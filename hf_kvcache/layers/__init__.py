"""The layers: one layer group's rows of a cache on the shared pool, one small file per policy.

- ``plan``: a step's plan (``StepPlan``), what the layers execute; ``identical``: a prefill's identical rows, which
  share their pages;
- ``exact``: what a quantized pool's layers keep in full precision (the residual window, the exact sink);
- ``key_codes``: full key pages to and from their codes; ``keys``: keys stored as codes a page at a time;
  ``store``: writing and reading a layer group's slots;
- ``read_path``: how attention reads a step's pages (gathered, a run, in place) and the block mask in place uses;
- ``planned``: the rows' planned steps (``PlannedRows``); ``rows``: ``PagedRows``, the page table and each step's
  plan; ``window``: ``WindowRows``, rows that give back the pages behind their window;
- ``paged``: the layers, ``PagedLayer`` (every token) and ``WindowLayer`` (a window).
"""

from hf_kvcache.layers.paged import PagedLayer, WindowLayer
from hf_kvcache.layers.read_path import GATHER, IN_PLACE, RUN
from hf_kvcache.layers.rows import PagedRows
from hf_kvcache.layers.window import WindowRows

__all__ = ["GATHER", "IN_PLACE", "RUN", "PagedLayer", "PagedRows", "WindowLayer", "WindowRows"]
