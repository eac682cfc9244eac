"""The layers: one layer group's rows of a cache on the shared pool, one small file per concept, lowest first:
``plan`` (``StepPlan``), ``identical`` (a prefill's identical rows), ``exact`` (what quantized layers keep in full
precision), ``key_codes`` and ``keys`` (coded keys), ``store`` (``SlotStore``), ``read_path`` (``ReadPath``),
``planned`` (``PlannedRows``), ``rows`` (``PagedRows``), ``window`` (``WindowRows``), ``paged`` (the layers).
"""

from hf_kvcache.layers.paged import PagedLayer, WindowLayer
from hf_kvcache.layers.read_path import GATHER, IN_PLACE, RUN
from hf_kvcache.layers.rows import PagedRows
from hf_kvcache.layers.window import WindowRows

__all__ = ["GATHER", "IN_PLACE", "RUN", "PagedLayer", "PagedRows", "WindowLayer", "WindowRows"]
