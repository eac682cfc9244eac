"""Plumbing shared by our caches: finding the pool, row changes, returning pages.

A cache is a thin ``transformers.Cache`` whose layers draw pages from one pool per device.
Subclasses state only which layer kind each model layer gets (``_make_layer``).
"""

import dataclasses
import functools
import logging
import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import torch
from transformers import Cache, CacheLayerMixin, PreTrainedConfig

from hf_kvcache import flex
from hf_kvcache.attention import ATTENTION_NAME, PLANNED_READS
from hf_kvcache.caches.prefix import PrefixTracker, log_once
from hf_kvcache.config import CacheOptions, PageFormat, layer_groups
from hf_kvcache.device_memory import check_fits
from hf_kvcache.errors import IncompatibleModelError, PoolExhaustedError
from hf_kvcache.layers import PagedLayer, PagedRows, RingLayer, RingRows
from hf_kvcache.layers.plan import capacity_bucket
from hf_kvcache.layers.ring import ring_num_slots
from hf_kvcache.placement import Placement, agree, normalize_device
from hf_kvcache.pool import KVPool
from hf_kvcache.transformers_internals import DummyLayer, attn_implementation, layer_types_and_kwargs

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class RowPolicy:
    """Which tokens a layer group keeps: all of them (``window=None``), or a ring of the last ``window``.

    Attributes:
        window: tokens each query attends to, itself included; ``None`` keeps every token.
        sink_tokens: first tokens of a row a ring keeps for good.
        is_sliding: the model's own mask applies the window (a sliding layer of the model).
        residual_length: newest tokens whose values stay in full precision (quantized pools only).
        exact_tokens: first tokens of a row whose keys and values attention gets in full precision over their codes
            (quantized pools, rows that keep every page).
    """

    window: int | None = None
    sink_tokens: int = 0
    is_sliding: bool = False
    residual_length: int = 0
    exact_tokens: int = 0

    def max_pages_per_row(self, num_tokens: int, page_size: int) -> int:
        """Most pages one row holds with ``num_tokens`` tokens: all of them, or at most a ring's worth."""
        if self.window is not None:
            num_tokens = min(num_tokens, ring_num_slots(self.window, self.sink_tokens, page_size))
        return math.ceil(num_tokens / page_size)

    def make_rows(
        self, pool: KVPool, reads_slots: Callable[[], bool], query_group: int = 1, group: Any = None
    ) -> PagedRows:
        """The rows of a layer group on ``pool``.

        Args:
            reads_slots: does the model's attention read a ``KeyLayout`` (and a ``PagedRead``).
            query_group: query heads per KV head.
            group: the process group of a tensor-parallel model's ranks (``Placement.group``).
        """
        if self.window is None:
            return PagedRows(
                pool,
                self.residual_length,
                reads_in_place=reads_slots,
                query_group=query_group,
                group=group,
                exact_tokens=self.exact_tokens,
            )
        return RingRows(pool, self.window, self.sink_tokens, self.residual_length, reads_slots, group)


def reads_key_layouts(config: PreTrainedConfig) -> bool:
    """Whether the model attends with ``attn_implementation="hf_kvcache"``, which reads a ring's ``KeyLayout``."""
    return attn_implementation(config) == ATTENTION_NAME


class PoolBinder:
    """Finds (once per device) the pool a cache's layers write to, and each layer group's rows on it.

    Kept apart from the cache so that layers and the cache's finalizer can hold it without a
    reference cycle back to the cache.

    Args:
        config: the model's decoder config.
        options: the cache's options.
        policies: the row policy of each layer group.
        placement: where the model's KV lives (a tensor-parallel rank's share of the heads, a split model's layers).
        layer_groups: the layers of each layer group (``config.layer_groups``, per device for a split model).
        layer_group_devices: the device each layer group's layers are placed on; ``None``: learnt at the first
            write, and the pool of every device the cache writes on is cut for all layer groups.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        options: CacheOptions,
        policies: list[RowPolicy],
        placement: Placement,
        layer_groups: list[list[int]],
        layer_group_devices: list[torch.device | None],
    ) -> None:
        self.config = config
        self.options = options
        self.policies = policies
        self.placement = placement
        self.layer_groups = layer_groups
        self.layer_group_devices = layer_group_devices
        self.pools: dict[torch.device, KVPool] = {}
        self.rows: dict[tuple[torch.device, int], PagedRows] = {}
        self.planned_tokens = 0  # see PoolCache.plan
        self.pad_lengths: list[int] | None = None  # see PoolCache.plan
        self.prefix: PrefixTracker | None = None  # made when the pool is bound, if the cache reuses prompts
        self.pool = KVPool.named(options.pool) if isinstance(options.pool, str) else options.pool
        if self.pool is not None and not isinstance(self.pool, KVPool):
            raise TypeError(f"cache_config pool must be a KVPool or a pool's name, got {type(self.pool).__name__}.")

    def layer_groups_on(self, device: torch.device) -> list[int]:
        """The layer groups whose pages live on ``device``: those placed there, or all when none is placed."""
        placed = [idx for idx, at in enumerate(self.layer_group_devices) if at == device]
        return placed or [idx for idx, at in enumerate(self.layer_group_devices) if at is None]

    def rows_for(self, layer_group_idx: int, key_states: torch.Tensor) -> PagedRows:
        """The rows of layer group ``layer_group_idx`` on the device of ``key_states`` (made on first use).

        Raises:
            IncompatibleModelError: the states come on another device than the layer group was placed on, or do
                not have the geometry of the pool (its heads come from the tensor-parallel plan, or the config).
        """
        device = key_states.device
        rows = self.rows.get((device, layer_group_idx))
        if rows is None:
            placed = self.layer_group_devices[layer_group_idx]
            if placed is not None and device != placed:
                raise IncompatibleModelError(
                    f"Layers {self.layer_groups[layer_group_idx]} were placed on {placed} (the model's "
                    f"hf_device_map) but write their states on {device}. Build the cache for the model as it runs: "
                    "generate(cache_implementation=...) reads the placement when generate starts."
                )
            pool = self.bind(device, key_states.dtype)
            seen = (key_states.shape[1], key_states.shape[-1])  # [batch, heads, n, head_dim]
            if seen != (pool.format.num_kv_heads, pool.format.head_dim):
                source = "the tensor-parallel plan" if self.placement.num_kv_heads is not None else "the config"
                raise IncompatibleModelError(
                    f"The model writes {seen[0]} KV heads of size {seen[1]}, but the pool on {device} holds "
                    f"{pool.format.num_kv_heads} of size {pool.format.head_dim} (from {source}). A tensor-parallel "
                    "rank holds its share of the heads: let generate build the cache (cache_implementation=...), or "
                    "build it with placement=hf_kvcache.integration.placement_of(model) and its pool with "
                    "KVPool.for_model(model, ...). Mixed layer geometries are not supported."
                )
            rows = self.rows_on(layer_group_idx, device, key_states.dtype)
        return rows

    def rows_on(self, layer_group_idx: int, device: torch.device, dtype: torch.dtype) -> PagedRows:
        """The rows of layer group ``layer_group_idx`` on ``device`` (made on first use, binding the pool)."""
        rows = self.rows.get((device, layer_group_idx))
        if rows is None:
            pool = self.bind(device, dtype)
            reads_slots = functools.partial(reads_key_layouts, self.config)  # not a method: rows must not hold self
            policy = self.policies[layer_group_idx]
            config = self.config
            heads = getattr(config, "num_attention_heads", 1)
            query_group = max(1, heads // (getattr(config, "num_key_value_heads", None) or heads))  # rank-invariant
            rows = policy.make_rows(pool, reads_slots, query_group, self.placement.group)
            self.rows[(device, layer_group_idx)] = rows
            rows.set_plan(self.planned_tokens, self.pad_lengths)
        return rows

    def page_format(self, device: torch.device, dtype: torch.dtype) -> PageFormat:
        """The format of the pool on ``device``: the config's, cut for the heads this rank holds and the layers
        placed on ``device``.

        Raises:
            IncompatibleModelError: no layer is placed on ``device``.
        """
        layer_groups = [self.layer_groups[idx] for idx in self.layer_groups_on(device)]
        if not layer_groups:
            raise IncompatibleModelError(
                f"No layer of this cache is placed on {device}; its layers are on {self.placement.devices}."
            )
        page_format = self.options.page_format(self.config, dtype)
        return dataclasses.replace(
            page_format,
            num_kv_heads=self.placement.num_kv_heads or page_format.num_kv_heads,
            num_layers=len(layer_groups[0]),
            num_layer_groups=len(layer_groups),
        )

    def bind(self, device: torch.device, dtype: torch.dtype) -> KVPool:
        """The pool on ``device``, resolved on first use.

        Raises:
            IncompatibleModelError: the given pool does not match the model's geometry.
        """
        pool = self.pools.get(device)
        if pool is not None:
            return pool
        pool = self._pool_for(self.page_format(device, dtype), device)
        if self.pools and self.prefix is not None:
            log_once("the cache spans several devices; prompts are reused on a cache with one pool.")
            self.prefix.active = False
        elif pool.prefix_caching and self._uses_prefix_index():
            self._check_prefix_placement()
            self.prefix = PrefixTracker(pool, self.policies, self.options.prefix_namespace)
        self.pools[device] = pool
        return pool

    def _uses_prefix_index(self) -> bool:
        """``prefix_caching`` True, or None on a pool given to the cache (another cache may have started the default
        pool's index: that is not this cache's asking)."""
        return bool(self.options.prefix_caching) or (self.options.prefix_caching is None and self.pool is not None)

    def _check_prefix_placement(self) -> None:
        """Refuses prompt reuse where the ranks or devices would have to agree on it.

        Raises:
            ValueError: the model is tensor parallel (each rank's pool keeps its own index, whose lookups could find
                prefixes of different lengths on different ranks, which would then feed different tokens into the
                model's collectives), or split over several devices (one pool per device, each with a part of the
                layer groups, none of which holds a whole prefix).
        """
        if self.placement.group is not None:
            raise ValueError(
                "Prefix caching is not supported under tensor parallelism: the ranks' prefix indexes are not agreed, "
                "so they could reuse prefixes of different lengths. Leave cache_config prefix_caching unset, and "
                "give the cache a pool without one (KVPool.for_model(..., prefix_caching=False))."
            )
        if len({device for device in self.layer_group_devices if device is not None}) > 1:
            raise ValueError(
                "Prefix caching is not supported on a model split over several devices (one pool per device, none "
                "holding a whole prefix). Leave cache_config prefix_caching unset, or load the model on one device."
            )

    def layer_group_rows(self, device: torch.device, create: bool = False) -> dict[int, PagedRows]:
        """The rows of each layer group on ``device`` (those made so far, or all of them with ``create``)."""
        if create:
            pool = self.pools[device]
            return {idx: self.rows_on(idx, device, pool.format.dtype) for idx in range(len(self.policies))}
        return {idx: rows for (rows_device, idx), rows in self.rows.items() if rows_device == device}

    def _pool_for(self, page_format: PageFormat, device: torch.device) -> KVPool:
        options = self.options
        prefix_caching = bool(options.prefix_caching)
        if prefix_caching:
            self._check_prefix_placement()
        if options.max_tokens is not None:
            if prefix_caching:  # kept for the process, so that its index outlives the call
                return KVPool.for_budget(page_format, device, options.max_tokens)
            num_pages = page_format.pages_for_tokens(options.max_tokens) + 1
            check_fits(f"max_tokens={options.max_tokens}", num_pages * page_format.page_bytes, device)
            return KVPool(page_format, num_pages, device)
        pool = self.pool
        if pool is None:
            pool = KVPool.default(page_format, device, self.placement.group)
            if prefix_caching:
                pool.enable_prefix_caching()
            return pool
        if prefix_caching and not pool.prefix_caching:
            raise ValueError(
                "cache_config prefix_caching=True, but the given pool keeps no prefix index: build it with "
                "KVPool.for_model(model, ..., prefix_caching=True), or leave prefix_caching unset."
            )
        theirs, ours = pool.format, page_format
        mismatches = [
            f"{name} {getattr(theirs, name)} vs {getattr(ours, name)}"
            for name in (
                "num_layers",
                "num_layer_groups",
                "num_kv_heads",
                "head_dim",
                "dtype",
                "value_bits",
                "value_group_size",
                "key_bits",
                "key_group_size",
                "scale_dtype",
            )
            if getattr(theirs, name) != getattr(ours, name)
        ]
        if pool.device != device:
            mismatches.append(f"device {pool.device} vs {device}")
        if mismatches:
            raise IncompatibleModelError(
                f"The pool was built for another model or placement ({', '.join(mismatches)}, pool vs model). "
                "Build it with KVPool.for_model(model, ...) for this model, dtype and device; a model split over "
                "several devices takes one pool per device (cache_config max_tokens, or the default pools)."
            )
        return pool

    def release(self) -> None:
        """Publishes what the prefix index still lacks (if the cache reuses prompts), then returns every page."""
        for rows in self.rows.values():
            rows.end_planning()
        if self.prefix is not None:
            self.prefix.publish(self.layer_group_rows(self.prefix.pool.device))
            self.prefix.reset()
        for rows in self.rows.values():
            rows.release()


_DEFERRED: list[PoolBinder] = []  # binders of caches collected while torch.compile traced (release_when_safe)
_DEFERRED_LOCK = threading.Lock()


def _tracing() -> bool:
    """Whether torch.compile (or export) is tracing now: tensors are fake, a write to the pool would be lost."""
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(key) is not None for key in (keys.FAKE, keys.PROXY, keys.FUNCTIONAL))


def release_when_safe(binder: PoolBinder) -> None:
    """Releases a collected cache's pages, or, when the garbage collector ran it while torch.compile traced (where
    zeroing freed pages would act on fake tensors and fail), at the next ``release_deferred``."""
    if _tracing():
        with _DEFERRED_LOCK:
            _DEFERRED.append(binder)
        return
    binder.release()


def release_deferred() -> None:
    """Releases the caches collected while torch.compile traced (``release_when_safe``)."""
    if not _DEFERRED or _tracing():
        return
    with _DEFERRED_LOCK:
        binders = _DEFERRED[:]
        _DEFERRED.clear()
    for binder in binders:
        binder.release()


class PoolCache(Cache):
    """A ``transformers.Cache`` whose layers live in pool pages.

    The model's layers are split into layer groups of one attention type (``config.layer_groups``); each
    layer group has its own page table, and a subclass says which tokens each one keeps
    (``_row_policy``): every token, or a ring of the last ``window``.

    On a model split over devices (``placement.layer_devices``), the layers of each device make their own layer
    groups, which draw from a pool on that device cut for them only.

    Args:
        config: the model's config (its decoder config is used).
        options: the cache's ``cache_config``, checked.
        dtype / device: bind the pool now rather than at the first write (both or neither); a split model binds
            the pool of each of its devices.
        placement: where the model's KV lives (``hf_kvcache.integration.placement_of(model)``, which
            ``generate(cache_implementation=...)`` reads); ``None``: in this process, on the device of the first
            write, with the config's heads.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        options: CacheOptions,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        placement: Placement | None = None,
    ) -> None:
        config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = layer_types_and_kwargs(config)
        unsupported = sorted({kind for kind in layer_types if kind not in (*ATTENTION_LAYER_TYPES, "dummy")})
        if unsupported:
            raise IncompatibleModelError(
                f"{type(config).__name__} has layers of type {unsupported}; hf_kvcache caches serve attention layers "
                "only. Serve it with transformers' own caches (leave cache_implementation unset)."
            )
        self.options = options
        groups = layer_groups(layer_types)
        page_format = PageFormat.from_model_config(config, torch.float32)
        if (page_format.num_layers, page_format.num_layer_groups) != (len(groups[0]), len(groups)):
            raise IncompatibleModelError(
                f"{type(config).__name__}: transformers and hf_kvcache infer different layer types; "
                "set config.layer_types explicitly."
            )
        placement = placement or Placement()
        groups, group_devices = self._place_layer_groups(layer_types, groups, placement)
        policies = []
        for members in groups:
            found = {self._row_policy(layer_types[idx], layer_kwargs[idx]) for idx in members}
            if len(found) > 1:
                raise IncompatibleModelError(f"Layers {members} share pages but keep different tokens: {found}.")
            policies.append(found.pop())
        self._binder = PoolBinder(config, options, policies, placement, groups, group_devices)
        layers: list[CacheLayerMixin] = [DummyLayer() for _ in layer_types]
        for layer_group_idx, members in enumerate(groups):
            bind = functools.partial(self._binder.rows_for, layer_group_idx)
            for layer_in_group, layer_idx in enumerate(members):
                layers[layer_idx] = self._make_layer(layer_idx, layer_in_group, bind, policies[layer_group_idx])
        super().__init__(layers=layers)
        self.compiled_decoding = False  # generate compiles the decode steps: plan them (hf_kvcache.integration)
        self.runs_eager = False  # generate will not compile this request (then is_compileable says False)
        self._planned_capacity: int | None = None
        self._planning = False  # a step was planned since the last end_planning
        self._query_offset: torch.Tensor | None = None  # [] a planned step's start, on the pool's device
        weakref.finalize(self, release_when_safe, self._binder)
        if (dtype is None) != (device is None):
            raise ValueError("Give both dtype and device to bind the pool early, or neither.")
        if dtype is not None:
            for placed in placement.devices or [normalize_device(device)]:
                self._binder.bind(placed, dtype)

    options_class = CacheOptions

    @staticmethod
    def _place_layer_groups(
        layer_types: list[str], groups: list[list[int]], placement: Placement
    ) -> tuple[list[list[int]], list[torch.device | None]]:
        """The layer groups and the device each is placed on: the model's (on no device in particular), or those
        of the layers of each device of a split model, in the order of the devices."""
        devices = placement.layer_devices
        if devices is None:
            return groups, [None] * len(groups)
        if len(devices) != len(layer_types):
            raise ValueError(f"Placement.layer_devices names {len(devices)} devices for {len(layer_types)} layers.")
        placed_groups: list[list[int]] = []
        group_devices: list[torch.device | None] = []
        for device in placement.devices:
            on_device = layer_groups([kind if at == device else "dummy" for kind, at in zip(layer_types, devices)])
            placed_groups += on_device
            group_devices += [device] * len(on_device)
        return placed_groups, group_devices

    @classmethod
    def from_cache_config(
        cls,
        config: PreTrainedConfig,
        cache_config: dict[str, Any] | None,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        placement: Placement | None = None,
    ) -> Self:
        """Builds the cache from a ``generate`` ``cache_config`` dict, rejecting unknown keys."""
        options = cls.options_class.from_dict(cache_config)
        settings = {field.name: getattr(options, field.name) for field in dataclasses.fields(options)}
        return cls(config, **settings, dtype=dtype, device=device, placement=placement)

    @property
    def placement(self) -> Placement:
        """Where this cache's model keeps its KV (a tensor-parallel rank's heads, a split model's layer devices)."""
        return self._binder.placement

    def _row_policy(self, layer_type: str, layer_kwargs: dict[str, Any]) -> RowPolicy:
        """Which tokens a layer of ``layer_type`` keeps (``layer_kwargs`` carry its ``sliding_window``)."""
        raise NotImplementedError

    def _make_layer(self, layer_idx: int, layer_in_group: int, bind, policy: RowPolicy) -> CacheLayerMixin:
        if policy.window is None:
            return PagedLayer(layer_idx, layer_in_group, bind)
        return RingLayer(layer_idx, layer_in_group, bind, policy.window, policy.sink_tokens, policy.is_sliding)

    @property
    def pools(self) -> dict[torch.device, KVPool]:
        """The pool of each device this cache has written to (or was bound to)."""
        return dict(self._binder.pools)

    @property
    def pool(self) -> KVPool | None:
        """The pool this cache draws from; ``None`` before its first write unless one was given."""
        pools = list(self.pools.values())
        if len(pools) > 1:
            raise ValueError(f"This cache spans {len(pools)} devices; use cache.pools.")
        return pools[0] if pools else self._binder.pool

    def worst_case_pages(
        self, num_rows: int, num_tokens: int, page_size: int, device: torch.device | None = None
    ) -> int:
        """Most pages ``num_rows`` rows of ``num_tokens`` tokens each can hold on one pool, no page shared.

        Each layer group takes its own pages: every token's for a layer group that keeps them all, at most
        a ring's worth (``ring_num_slots``) for a ring. Rows that share pages (beams, identical prompts)
        only need fewer.

        Args:
            device: count the layer groups whose pages live on this device only (a split model); ``None``: all.
        """
        binder = self._binder
        groups = range(len(binder.policies)) if device is None else binder.layer_groups_on(normalize_device(device))
        return num_rows * sum(binder.policies[idx].max_pages_per_row(num_tokens, page_size) for idx in groups)

    def check_admission(self, num_rows: int, num_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        """Refuses, before any compute, a request that could not fit in the pool in the worst case.

        A check, not a reservation: pages stay free for anyone until the cache writes, so requests
        running at the same time can still exhaust the pool mid-generation. Pages the cache already holds
        (a cache passed back to ``generate`` to continue) count towards the request. A split model checks the
        pool of each of its devices; the ranks of a tensor-parallel model refuse together: the fewest pages any
        rank's pool has available count.

        Args:
            num_rows: rows the request runs (batch size x beams or returned sequences).
            num_tokens: tokens each row may hold at most (prompt + ``max_new_tokens`` - 1 in ``generate``).
            device / dtype: where the cache's pool lives (it is bound now if it was not).

        Raises:
            PoolExhaustedError: the worst case needs more pages than a pool has free or can still grow into.
        """
        binder = self._binder
        for placed in binder.placement.devices or [normalize_device(device)]:
            pool = binder.bind(placed, dtype)
            page_size = pool.format.page_size
            worst = self.worst_case_pages(num_rows, num_tokens, page_size, placed)
            held = sum(1 for held_device, _ in self._held_pages() if held_device == placed)
            requested = worst - held
            available = agree([pool.num_available_pages], binder.placement.group, placed)[0]
            if requested > available:
                raise PoolExhaustedError(
                    requested,
                    available,
                    pool.capacity_pages,
                    f"admission_check refused the request before any compute: {num_rows} rows of up to "
                    f"{num_tokens} tokens need up to {worst} pages of {page_size} tokens in "
                    f"{len(binder.layer_groups_on(placed))} layer group(s) on {placed}. Lower the batch size, "
                    "num_beams/num_return_sequences or max_new_tokens, or give the pool more room "
                    "(KVPool.for_model(..., max_tokens=...) or cache_config max_tokens).",
                )

    def bind_pools(self, device: torch.device, dtype: torch.dtype) -> None:
        """Resolves the pool of each device the cache's layers live on (``device`` where they are not placed)."""
        for placed in self._binder.placement.devices or [normalize_device(device)]:
            self._binder.bind(placed, dtype)

    def plan(self, num_tokens: int, attention_mask: torch.Tensor | None = None) -> None:
        """Says how long rows will grow and where each starts, before the first write (``generate`` does both).

        Ring layers then take the pages for ``num_tokens`` tokens (up to the ring's) at their first write rather
        than a page at a time, so that each row's pages follow one another on a fresh pool and attention can read
        them in place (``hf_kvcache.attention``); those pages are held, and counted as held, from the first write.
        The attention mask tells each row's leading padding, so that a ring's sinks are the row's first *real*
        tokens, and so that paged layers reading in place hide it (``PagedRows.attend``).

        Args:
            num_tokens: tokens a row may hold at most (``generate``: prompt + ``max_new_tokens`` - 1).
            attention_mask: ``[rows, prompt_length]`` the mask the prompt is fed with (1: token, 0: padding);
                ``None`` for rows without padding.
        """
        release_deferred()
        pad_lengths = None
        if attention_mask is not None:
            leading = (torch.as_tensor(attention_mask).long().cumsum(-1) == 0).sum(-1)  # [rows]
            pad_lengths = leading.tolist() if bool(leading.any()) else None
        self._binder.planned_tokens, self._binder.pad_lengths = num_tokens, pad_lengths
        for rows in self._binder.rows.values():
            rows.set_plan(num_tokens, pad_lengths)

    def memory_stats(self) -> dict[str, int]:
        """Pages this cache holds (shared pages once), the KV bytes it holds, and the tokens per row.

        ``bytes_held`` counts the pages plus ``residual_bytes``, the full-precision values of the newest
        ``residual_length`` tokens a quantized cache keeps outside the pool. ``pages_unfilled``: pages held that no
        token has been written to yet (a ring's planned pages before its tokens reach them).
        """
        pages = self._held_pages()
        unfilled = sum(
            1 for rows in self._binder.rows.values() for count in rows.table.filled_slots().values() if count == 0
        )
        page_bytes = {device: pool.format.page_bytes for device, pool in self._binder.pools.items()}
        num_rows = max((rows.table.num_rows for rows in self._binder.rows.values()), default=0)
        residual_bytes = sum(rows.store.residual_bytes for rows in self._binder.rows.values())
        return {
            "pages_held": len(pages),
            "pages_unfilled": unfilled,
            "bytes_held": sum(page_bytes[device] for device, _ in pages) + residual_bytes,
            "residual_bytes": residual_bytes,
            "num_rows": num_rows,
            "tokens_per_row": self.get_seq_length(),
        }

    def _held_pages(self) -> set[tuple[torch.device, int]]:
        """``(device, page id)`` of every page this cache's rows hold, shared ones once."""
        bound = self._binder.rows.items()
        return {(device, page) for (device, _), rows in bound for row in rows.table.rows for page in row}

    def _row_layers(self):
        return [layer for layer in self.layers if not isinstance(layer, DummyLayer)]

    # ----- planned decode steps (compiled decoding; driven by hf_kvcache.integration) ------------

    @property
    def is_compileable(self) -> bool:
        """Whether ``generate`` may compile the model's forward with this cache (as it does for ``StaticCache``):
        every layer group keeps its tokens (all of them, or a ring's) on one device, keys in full precision (values
        may be codes) and no exact sink, so a decode step can be planned before the forward pass (``plan_decode``)
        and run as tensor operations only."""
        binder = self._binder
        if self.runs_eager:  # generate's rule said no for this request: masks may then be skipped as Dynamic's
            return False
        if binder.placement.group is not None or len({at for at in binder.layer_group_devices if at}) > 1:
            return False
        if any(policy.exact_tokens for policy in binder.policies):
            return False
        page_format = self.options.page_format(binder.config, torch.float32)
        if page_format.key_bits is not None and any(policy.window is not None for policy in binder.policies):
            return False  # keys coded a page at a time in a ring
        # A compiled step (a CUDA graph above all) needs storage that never moves: CPU default pools, fixed pools.
        pools = list(binder.pools.values()) or ([binder.pool] if binder.pool is not None else [])
        if not pools:
            return self.options.max_tokens is not None  # unbound: only a fixed pool of its own is known to stay
        return all(pool.storage_is_fixed for pool in pools)

    def plan_decode(self, num_rows: int, num_new: int | None, attention_mask: torch.Tensor | None = None) -> bool:
        """Before a decode step of ``generate``, and before its inputs are prepared (they may build the attention
        mask, whose size the plan sets): the bookkeeping of the step (pages, copy-on-write, where the new token goes
        and which pages attention reads) done here, on the host, into tensors the step reads
        (``PagedRows.plan_decode``); ``start_planned`` then counts the step. Only steps that run compiled
        (``compiled_decoding``) are planned: eager, the planned gather (one ``aten.index`` per layer) measured
        slower than the paths ``PagedRows.attend`` picks (0.88x against 0.97x DynamicCache at 4,096 x 1 under
        sdpa), though it dispatches fewer ops (1.08x DynamicCache's against 1.37x at 1,024 x 1).

        Args:
            attention_mask: ``generate``'s ``[rows, tokens]`` mask (``None``: all ones): where it hides no more than
                each row's leading padding, attention may read the pages in place (``PagedRows.plan_decode``).
        """
        release_deferred()
        binder = self._binder
        rows_of = list(binder.rows.values())
        wanted = self.compiled_decoding and num_new == 1 and bool(rows_of)
        if not wanted or not all(rows.plannable for rows in rows_of):
            if wanted:
                flex.log_once(
                    "compiled:moves",
                    logging.WARNING,
                    "Compiled decoding runs the eager step: the pool's storage moves when it grows (CUDA's default "
                    "pools); give the cache a fixed pool (cache_config max_tokens, or KVPool.for_model).",
                )
            self.end_planning()
            return False
        start = self.get_seq_length()
        page_size = rows_of[0].pool.format.page_size
        # A capacity bucket of what generate may reach: one graph for the whole generation.
        capacity = capacity_bucket(math.ceil(max(start + 1, binder.planned_tokens) / page_size))
        if self._planned_capacity != capacity and any(rows.ring_pages is None for rows in rows_of):  # rings: fixed
            flex.logger.info(
                "Compiled decoding: this cache reads %d pages per row (a capacity bucket; a graph compiles "
                "where none serves it yet).",
                capacity,
            )
            self._planned_capacity = capacity
        padding_only = _hides_padding_only(attention_mask, binder.pad_lengths, start + 1)
        for rows in rows_of:
            rows.plan_decode(start, num_rows, capacity, padding_only)
        self._planning = True
        for layer in self._row_layers():
            layer.planned = True  # until its update has run the step
        device = rows_of[0].pool.device
        if self._query_offset is None or self._query_offset.device != device:
            self._query_offset = torch.zeros((), dtype=torch.long, device=device)
        self._query_offset.fill_(start)
        return True

    def start_planned(self, inputs: dict[str, Any]) -> None:
        """After a planned step's inputs are prepared (``plan_decode``): counts its token in every layer, and hands
        the step's position over as a tensor where the model takes ``position_ids`` and ``generate`` left them out
        (a Python int would make each step a new graph)."""
        layers = self._row_layers()
        if self._query_offset is None or not layers or not getattr(layers[0], "planned", False):
            return
        for layer in self._row_layers():
            layer.num_tokens += 1
        plans = [getattr(layer, "rows", None) and layer.rows.step_plan for layer in self.layers]
        plans = tuple(plan if plan is not None and plan.mask is not None else None for plan in plans)
        if any(plans):  # these layers hand attention the pool's storage, to read in place through the plan
            inputs[PLANNED_READS] = plans
        fed = inputs.get("input_ids")
        if "position_ids" in inputs and inputs["position_ids"] is None and isinstance(fed, torch.Tensor):
            inputs["position_ids"] = self._query_offset.expand(fed.shape[0], 1)  # [batch, 1]: no padding

    def end_planning(self) -> None:
        """The next forward pass is not a planned decode step: the eager path runs."""
        if not self._planning:  # every eager step comes here: nothing to undo
            return
        self._planning = False
        for rows in self._binder.rows.values():
            rows.end_planning()
        for layer in self._row_layers():
            if isinstance(layer, PagedLayer):
                layer.planned = False

    def get_query_offset(self, layer_idx: int = 0) -> Any:
        """A planned step's offset as a tensor (a Python int would make each step a new graph)."""
        layers = self._row_layers()
        if self._query_offset is not None and layers and getattr(layers[0], "planned", False):
            return self._query_offset
        return super().get_query_offset(layer_idx)

    # ----- prompt reuse (hf_kvcache.caches.prefix; driven by hf_kvcache.integration) ---------

    @property
    def prefix(self) -> PrefixTracker | None:
        """The cache's side of its pool's prefix index; ``None`` unless the cache reuses prompts (its pool keeps a
        prefix index, and ``CacheOptions.prefix_caching`` says to use it; known once the pool is bound)."""
        return self._binder.prefix

    def begin_generation(
        self,
        model: Any,
        input_ids: torch.Tensor,
        next_sequence_length: int | None,
        inputs: dict[str, Any],
    ) -> int | None:
        """Before a ``generate`` call's first forward pass: attaches the longest cached prefix of the prompt.

        Only where ``generate`` slices the prompt itself (``next_sequence_length`` given: a plain prefill, not
        chunked prefill or assisted decoding) and the cache is empty.

        Args:
            model: the model generating.
            input_ids: ``[rows, length]`` the prompt.
            next_sequence_length: the tokens ``generate`` is about to feed (``None``: it feeds all of ``input_ids``).
            inputs: the other ``prepare_inputs_for_generation`` arguments (mask, position ids, ...).

        Returns:
            the tokens to feed: ``next_sequence_length`` less the tokens reused.
        """
        self._binder.bind(normalize_device(model.device), model.dtype)
        tracker = self._binder.prefix
        if tracker is None or not tracker.begin_call(model, input_ids, inputs):
            return next_sequence_length
        if next_sequence_length is None or self.get_seq_length():
            return next_sequence_length
        rows_of = self._binder.layer_group_rows(tracker.pool.device, create=True)
        reused = tracker.reuse(rows_of, input_ids)
        for layer in self._row_layers():
            layer.num_tokens = reused
        return next_sequence_length - reused

    def record_inputs(self, fed_ids: torch.Tensor | None) -> None:
        """The ids ``[rows, n]`` a forward pass is about to feed (``None``: embeddings), written after the tokens the
        cache holds; publishes the pages written so far."""
        tracker = self._binder.prefix
        if tracker is not None:
            tracker.record(self.get_seq_length(), fed_ids, self._binder.layer_group_rows(tracker.pool.device))

    def _select_rows(self, indices: list[int]) -> None:
        for rows in self._binder.rows.values():
            if rows.table.num_rows:
                rows.select_rows(indices)
        if self._binder.prefix is not None:
            self._binder.prefix.select_rows(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]``; pages are shared, not copied."""
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        num_rows = max((rows.table.num_rows for rows in self._binder.rows.values()), default=0)
        self._select_rows([row for row in range(num_rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps the rows named by ``indices`` (row numbers, or a boolean mask over the rows)."""
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:
            indices = indices.nonzero()
        self._select_rows(indices.flatten().tolist())

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last ``-tokens_to_remove`` tokens (``tokens_to_remove <= 0``), returning emptied pages."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}.")
        if tokens_to_remove == 0:
            return
        self.end_planning()
        keep = max(0, self.get_seq_length() + tokens_to_remove)
        for rows in self._binder.rows.values():
            rows.check_crop(keep)  # all or nothing: a ring may not hold what the crop needs
        for rows in self._binder.rows.values():
            rows.crop(keep)
        if self._binder.prefix is not None:
            self._binder.prefix.crop(keep)
        for layer in self._row_layers():
            layer.num_tokens = keep

    def reset(self) -> None:
        """Empties the cache and returns its pages to the pool (the cache stays usable)."""
        self.release()

    def release(self) -> None:
        """Returns every page to the pool; the cache is empty afterwards."""
        self.end_planning()
        self._binder.release()
        for layer in self._row_layers():
            layer.num_tokens = 0


def _hides_padding_only(attention_mask: torch.Tensor | None, pad_lengths: list[int] | None, num_tokens: int) -> bool:
    """Whether ``generate``'s ``[rows, num_tokens]`` mask (``None``: all ones) hides exactly each row's first
    ``pad_lengths`` tokens (``None``: none)."""
    if attention_mask is None:
        return not any(pad_lengths or ())
    if attention_mask.ndim != 2 or attention_mask.shape[-1] != num_tokens:
        return False
    pads = torch.tensor(pad_lengths or [0] * attention_mask.shape[0], device=attention_mask.device).view(-1, 1)
    expected = torch.arange(num_tokens, device=attention_mask.device) >= pads  # [rows, num_tokens]
    return expected.shape == attention_mask.shape and bool(torch.equal(attention_mask.bool(), expected))
