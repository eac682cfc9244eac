"""The caches the decode benchmark compares, and how each is built for a run (``hf_kvcache.bench.decode``).

Three groups, each measured against its baseline in the same run:

- ``FULL_CACHES`` keep every token: transformers' ``DynamicCache`` (``dynamic``, the baseline every run includes)
  and ``StaticCache`` (``static``), and our ``paged_pool`` in the variants of ``PAGED_VARIANTS``: under
  ``attn_implementation="hf_kvcache"`` (decode reads the pages in place, compiled FlexAttention) or ``"sdpa"``
  (gathered), on the default pool (built exactly as ``generate(cache_implementation="paged_pool")`` builds it), on
  a fixed pool sized for the run, or on the default pool *fragmented* (another live table holds every other
  extent, so the rows' pages interleave with it).
- ``SLIDING_CACHES`` keep the last ``window`` tokens of a full-attention model; ``dynamic_sliding`` is their
  baseline:

  - ``dynamic_sliding``: transformers' ``DynamicCache`` on a copy of the model's config whose every layer is a
    sliding-window layer (``hf_kvcache.eval.sliding_window_config``, as the eval's ``sliding`` kind); its
    ``DynamicSlidingWindowLayer`` concatenates the new token to the last ``window - 1`` and keeps the tail:
    O(window) copy and a new tensor per update.
  - ``static_sliding``: ``StaticCache`` on the same config; its ``StaticSlidingWindowLayer`` rolls a fixed
    ``[batch, heads, window, head_dim]`` buffer left by one and writes the new token at the end: O(window).
  - ``sliding_ring``: our ``SlidingRingCache`` with the model on ``attn_implementation="hf_kvcache"``
    (``RING_ATTENTION``); writes the new token once into its ring slot (O(1)) and hands attention a view of the
    rows' pages in slot order, gathering nothing (O(1)), where the rows' pages are consecutive (a fresh or
    emptied pool, as here).
  - ``sliding_ring_sdpa``: the same cache with the model on ``"sdpa"``; writes the new token once, then gathers
    the visible tokens in time order for attention (O(window)).

- ``QUANTIZED_CACHES`` are lossy caches of every token: ours (each registered cache's ``bench_presets``, under
  ``attn_implementation="hf_kvcache"``: keys read in place) and transformers' ``QuantizedCache`` for each
  installed backend; their tokens are compared with ``dynamic``'s.

Our caches draw from fixed pools made for the run (``bench_pools``), sized for the rows and full by design at the
end of a run, unless their name says they run on the default pool.
"""

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache, PreTrainedConfig, PreTrainedModel, StaticCache

from hf_kvcache.attention.interface import ATTENTION_NAME
from hf_kvcache.caches import PagedConfig, SlidingRingCache, SlidingRingConfig
from hf_kvcache.eval import CacheSpec, installed_quantized_backends, sliding_window_config
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.layers.window import window_pages_per_row
from hf_kvcache.memory.format import KV_BLOCK_TOKENS, PageFormat
from hf_kvcache.memory.pool import KVPool

BASELINE = "dynamic"
"""The baseline of every run: ratios of every cache and the token checks of full caches."""


@dataclass(frozen=True)
class PagedVariant:
    """How a ``paged_pool`` row of the benchmark runs.

    Attributes:
        attention: the model's ``attn_implementation`` (``"hf_kvcache"``: in place where it applies).
        pool: ``"default"`` (``KVPool.default``, as ``generate`` builds it), ``"fixed"`` (sized for the run) or
            ``"fragmented"`` (the default pool, every other extent held by another live table).
    """

    attention: str
    pool: str


PAGED_VARIANTS = {
    "paged_pool": PagedVariant(ATTENTION_NAME, "default"),
    "paged_pool_fixed": PagedVariant(ATTENTION_NAME, "fixed"),
    "paged_pool_fragmented": PagedVariant(ATTENTION_NAME, "fragmented"),
    "paged_pool_sdpa": PagedVariant("sdpa", "default"),
    "paged_pool_sdpa_fixed": PagedVariant("sdpa", "fixed"),
}
"""The ``paged_pool`` rows of the ``paged`` suite (all the same cache class, ``PagedCache``)."""
FULL_CACHES = ("dynamic", "static", *PAGED_VARIANTS)
"""Caches that keep every token; their greedy tokens are checked against ``dynamic``'s."""
SLIDING_CACHES = ("dynamic_sliding", "static_sliding", "sliding_ring", "sliding_ring_sdpa")
"""Caches that keep the last ``window`` tokens; ``dynamic_sliding`` is their baseline."""
SLIDING_BASELINE = "dynamic_sliding"
RING_ATTENTION = {"sliding_ring": ATTENTION_NAME, "sliding_ring_sdpa": "sdpa"}
"""The model's ``attn_implementation`` under each ring (transformers' caches run under the model's own)."""
DEFAULT_POOL_SUFFIX = "-default"
"""A quantized cache of ours named with this suffix runs on its default pool (the others on a fixed one)."""
QUANTIZED_CACHES = {
    spec.label: spec
    for spec in (
        *(
            CacheSpec(label, entry.name, dict(settings))
            for entry in REGISTRY.values()
            for label, settings in entry.bench_presets.items()
        ),
        *(
            CacheSpec(label + DEFAULT_POOL_SUFFIX, entry.name, dict(settings))
            for entry in REGISTRY.values()
            for label, settings in entry.bench_presets.items()
        ),
        *(
            CacheSpec(f"{backend}-int{bits}", "quantized", {"backend": backend, "nbits": bits})
            for backend in installed_quantized_backends()
            for bits in (4, 2)
        ),
    )
}
"""Lossy caches of every token: ours (each registered cache's ``bench_presets``) and transformers'
``QuantizedCache`` (keys and values) for each installed backend (the optional extras ``.[quanto]``, ``.[hqq]``).
Their tokens are compared with ``dynamic``'s; a difference is a loss."""
CACHE_NAMES = FULL_CACHES + SLIDING_CACHES + tuple(QUANTIZED_CACHES)
"""Caches the decode benchmark knows; ``dynamic`` is the baseline every run includes."""
CACHE_ATTENTION = {
    **RING_ATTENTION,
    **{name: variant.attention for name, variant in PAGED_VARIANTS.items()},
    **{name: ATTENTION_NAME for name, spec in QUANTIZED_CACHES.items() if spec.kind in REGISTRY},
}
"""The model's ``attn_implementation`` under each cache that names one (the others run under the model's own):
ours under ``"hf_kvcache"`` (in place where it applies), except the ``paged_pool`` variants that time ``"sdpa"``."""


def pool_kind(name: str) -> str | None:
    """Which pool cache ``name`` of ours draws from (``"default"``, ``"fixed"``, ``"fragmented"``); ``None`` for
    transformers' caches."""
    if name in PAGED_VARIANTS:
        return PAGED_VARIANTS[name].pool
    if name in RING_ATTENTION:
        return "fixed"
    spec = QUANTIZED_CACHES.get(name)
    if spec is not None and spec.kind in REGISTRY:
        return "default" if name.endswith(DEFAULT_POOL_SUFFIX) else "fixed"
    return None


@contextlib.contextmanager
def interleaved_extents(pool: KVPool, num_extents: int) -> Iterator[None]:
    """Holds every other one of the next ``2 * num_extents`` whole extents of ``pool`` for the block, as another
    live request would: rows taking pages meanwhile get the ones between, their pages interleaved with its."""
    table = pool.pages.new_table(row_extents=True)
    with pool.pages.held():
        table.grow(2 * num_extents, pool.format.extent_pages * pool.format.page_size)  # one whole extent per row
        table.select_rows(list(range(0, 2 * num_extents, 2)))  # gives the odd rows' extents back
    try:
        yield
    finally:
        table.release()


def with_attention(config: PreTrainedConfig, attn_implementation: str) -> PreTrainedConfig:
    """A copy of ``config`` naming ``attn_implementation``, for caches updated without a model."""
    return type(config).from_dict({**config.to_dict(), "attn_implementation": attn_implementation})


def ring_pool(
    config: PreTrainedConfig, window: int, batch: int, page_size: int, dtype: torch.dtype, device: torch.device
) -> KVPool:
    """A fixed pool for ``batch`` rows of a ``sliding_ring`` cache of ``window`` tokens (no sinks).

    A row takes at most ``window_pages_per_row`` pages (``hf_kvcache.layers.window``). The pool is full by design:
    no use alerts.
    """
    page_format = PageFormat.from_model_config(config, dtype, page_size)
    pages_per_row = page_format.pages_for_tokens(window_pages_per_row(window, 0, page_size) * page_size)
    return KVPool(page_format, batch * pages_per_row + 1, device, alert_thresholds=())


def build_sliding_cache(
    name: str, config: PreTrainedConfig, window: int, max_cache_len: int, pool: KVPool | None = None
) -> Cache:
    """A fresh, empty sliding-window cache (a name from ``SLIDING_CACHES``) for a model of ``config``.

    Args:
        config: the model's config (full attention in every layer).
        window: tokens each query attends to, itself included.
        max_cache_len: tokens a row receives in all (sizes ``static_sliding``, which keeps ``min(window, this)``).
        pool: the pool of a ring (``None``: the default pool of the model's geometry).

    A ring reads its pages in place where ``config`` names ``attn_implementation="hf_kvcache"``: pass the
    config of the model that runs it (``with_attention`` for a cache updated without a model).
    """
    if name == "dynamic_sliding":
        return DynamicCache(config=sliding_window_config(config, window))
    if name == "static_sliding":
        return StaticCache(config=sliding_window_config(config, window), max_cache_len=max_cache_len)
    if name in RING_ATTENTION:
        return SlidingRingCache(config, SlidingRingConfig(window=window, pool=pool))
    raise ValueError(f"Unknown sliding cache {name!r}; choose from {list(SLIDING_CACHES)}.")


def bench_pools(
    model: PreTrainedModel, names: tuple[str, ...], window: int, batch: int, capacity: int, page_size: int
) -> dict[str, KVPool]:
    """Fixed pools for ``batch`` rows of ``capacity`` tokens, one per cache of ours among ``names``.

    Rows round up to whole extents (``KV_BLOCK_TOKENS``), so the budget is per row, not the batch's token total. No
    use-alert thresholds. The rings share one pool: each run gives all its pages back, consecutive for the next.
    """
    # Whole extents per row (128 tokens, PageFormat.extent_pages), and one more for the null page's extent (page 0 is
    # never handed out, so that extent is never whole): rows of growing layers take pages in aligned extents, and a pool
    # too tight for that hands out single pages, which attention cannot read in place.
    block = max(page_size, KV_BLOCK_TOKENS)
    max_tokens = (batch * math.ceil(capacity / block) + 1) * block
    configs = {
        name: PagedConfig(page_size=page_size)
        for name in names
        if pool_kind(name) == "fixed" and name in PAGED_VARIANTS
    }
    for name in names:
        spec = QUANTIZED_CACHES.get(name)
        if spec is not None and pool_kind(name) == "fixed":
            configs[name] = REGISTRY[spec.kind].config({**spec.settings, "page_size": page_size})
    pools = {
        name: KVPool.for_model(model, config, max_tokens=max_tokens, alert_thresholds=())
        for name, config in configs.items()
    }
    rings = [name for name in names if name in RING_ATTENTION]
    if rings:
        pool = ring_pool(model.config, window, batch, page_size, model.dtype, model.device)
        pools.update(dict.fromkeys(rings, pool))
    return pools


def build_cache(name: str, model: PreTrainedModel, window: int, capacity: int, pool: KVPool | None = None) -> Cache:
    """A fresh, empty cache ``name`` (from ``CACHE_NAMES``) for ``model``; ours draw from ``pool`` when given.

    Args:
        window: the sliding caches' window.
        capacity: tokens a row receives in all (sizes the static caches).
    """
    if name in SLIDING_CACHES:
        return build_sliding_cache(name, model.config, window, capacity, pool)
    spec = QUANTIZED_CACHES.get(name) or CacheSpec(name, "paged_pool" if name in PAGED_VARIANTS else name)
    if pool is not None:
        spec = dataclasses.replace(spec, settings={**spec.settings, "pool": pool})
    return spec.build(model, capacity)
