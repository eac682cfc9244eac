"""``PoolBinder``: the pool a cache's layers write to, found once per device, and its pages returned; apart from the
cache so that layers and the cache's finalizer hold it without a reference cycle back to the cache."""

import dataclasses
import functools
import gc
import threading

import torch
import torch._dynamo.utils
from transformers import PreTrainedConfig

from hf_kvcache.attention.interface import hands_states_to_attention_only
from hf_kvcache.caches.config import PagedConfig
from hf_kvcache.caches.policy import RowPolicy, uses_our_attention
from hf_kvcache.caches.prefix import PrefixTracker, log_once
from hf_kvcache.errors import IncompatibleModelError
from hf_kvcache.layers import PagedRows
from hf_kvcache.memory.device_memory import check_fits
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.placement import Placement
from hf_kvcache.memory.pool import KVPool
from hf_kvcache.memory.pools import KVPoolSet, pool_parts

FORMAT_FIELDS = ("num_layers", "num_layer_groups", "num_kv_heads", "head_dim", "value_head_dim", "dtype")
FORMAT_FIELDS += ("value_bits", "value_group_size", "key_bits", "key_group_size", "scale_dtype")
"""The ``PageFormat`` fields a pool given to a cache must share with the model's format."""


class PoolBinder:
    """Finds (once per device) the pool a cache's layers write to, and each layer group's rows on it.

    Args:
        layer_groups: the layers of each layer group (per device for a split model).
        layer_group_devices: each layer group's device; ``None``: learnt at the first write, and each device's pool
            is cut for all layer groups.
        layer_group_geometries: the ``(num_kv_heads, head_dim, value_head_dim)`` each layer group writes: each
            geometry draws from a pool of its own page format (the parts of a ``KVPoolSet``).
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        cache_config: PagedConfig,
        policies: list[RowPolicy],
        placement: Placement,
        layer_groups: list[list[int]],
        layer_group_devices: list[torch.device | None],
        layer_group_geometries: list[tuple[int, int, int]],
    ) -> None:
        self.config = config
        self.cache_config = cache_config
        self.policies = policies
        self.placement = placement
        self.layer_groups = layer_groups
        self.layer_group_devices = layer_group_devices
        self.layer_group_geometries = layer_group_geometries
        self.pools: dict[torch.device, KVPool | KVPoolSet] = {}
        self.rows: dict[tuple[torch.device, int], PagedRows] = {}
        self.planned_tokens = 0  # see PoolCache.plan
        self.pad_lengths: list[int] | None = None  # see PoolCache.plan
        self.fed_tokens: int | None = None  # see PoolCache.feeds
        self.prefix: PrefixTracker | None = None  # made when the pool is bound, if the cache reuses prompts
        pool = cache_config.pool
        self.pool = KVPool.named(pool) if isinstance(pool, str) else pool

    def layer_groups_on(self, device: torch.device) -> list[int]:
        """The layer groups whose pages live on ``device``: those placed there, or all when none is placed."""
        placed = [idx for idx, at in enumerate(self.layer_group_devices) if at == device]
        return placed or [idx for idx, at in enumerate(self.layer_group_devices) if at is None]

    def part_of(self, layer_group_idx: int, device: torch.device) -> KVPool:
        """The pool (the part of a ``KVPoolSet``) on ``device`` that layer group ``layer_group_idx`` draws from."""
        on_device = dict.fromkeys(self.layer_group_geometries[idx] for idx in self.layer_groups_on(device))
        geometry = list(on_device).index(self.layer_group_geometries[layer_group_idx])  # one part per geometry
        return pool_parts(self.pools[device])[geometry]

    def rows_for(self, layer_group_idx: int, key_states: torch.Tensor) -> PagedRows:
        """The rows of layer group ``layer_group_idx`` on the device of ``key_states`` (made on first use);
        ``IncompatibleModelError`` where they come on another device than placed, or not of the pool's geometry."""
        device = key_states.device
        rows = self.rows.get((device, layer_group_idx))
        if rows is not None:
            return rows
        placed = self.layer_group_devices[layer_group_idx]
        if placed is not None and device != placed:
            raise IncompatibleModelError(
                f"Layers {self.layer_groups[layer_group_idx]} were placed on {placed} (the model's "
                f"hf_device_map) but write their states on {device}. Build the cache for the model as it runs: "
                "generate(cache_implementation=...) reads the placement when generate starts."
            )
        self.bind(device, key_states.dtype)
        pool = self.part_of(layer_group_idx, device)
        seen = (key_states.shape[1], key_states.shape[-1])  # [batch, heads, n, head_dim]
        if seen != (pool.format.num_kv_heads, pool.format.head_dim):
            source = "the tensor-parallel plan" if self.placement.num_kv_heads is not None else "the config"
            raise IncompatibleModelError(
                f"The model writes {seen[0]} KV heads of size {seen[1]}, but the pool on {device} holds "
                f"{pool.format.num_kv_heads} of size {pool.format.head_dim} (from {source}, for layers "
                f"{self.layer_groups[layer_group_idx]}). A tensor-parallel "
                "rank holds its share of the heads: let generate build the cache (cache_implementation=...), or "
                "build it with placement=hf_kvcache.integration.seams.placement_of(model) and its pool with "
                "KVPool.for_model(model, ...)."
            )
        return self.rows_on(layer_group_idx, device, key_states.dtype)

    def rows_on(self, layer_group_idx: int, device: torch.device, dtype: torch.dtype) -> PagedRows:
        """The rows of layer group ``layer_group_idx`` on ``device`` (made on first use, binding the pool)."""
        rows = self.rows.get((device, layer_group_idx))
        if rows is None:
            self.bind(device, dtype)
            pool = self.part_of(layer_group_idx, device)
            our_attention = functools.partial(uses_our_attention, self.config)  # not a method: rows must not hold self
            policy = self.policies[layer_group_idx]
            rows = policy.make_rows(pool.pages, our_attention, self.placement.process_group)
            rows.contiguous_keys = not hands_states_to_attention_only(self.config)  # its own code may .view()
            self.rows[(device, layer_group_idx)] = rows
            rows.set_plan(self.pad_lengths, self.fed_tokens)
        return rows

    def page_formats(self, device: torch.device, dtype: torch.dtype) -> list[PageFormat]:
        """The formats of the pool on ``device``, one per geometry of its layers: the config's, cut for the heads
        this rank holds and the layers placed there. ``IncompatibleModelError`` where no layer is placed there, or a
        tensor-parallel model's layers write several geometries."""
        layer_groups = [self.layer_groups[idx] for idx in self.layer_groups_on(device)]
        if not layer_groups:
            raise IncompatibleModelError(
                f"No layer of this cache is placed on {device}; its layers are on {self.placement.devices}."
            )
        geometries = [self.layer_group_geometries[idx] for idx in self.layer_groups_on(device)]
        if self.placement.num_kv_heads is not None and len(set(geometries)) > 1:
            raise IncompatibleModelError(
                f"{type(self.config).__name__}'s layers write keys and values of several geometries "
                f"({sorted(set(geometries))}), which hf_kvcache caches do not split over tensor-parallel ranks. "
                "Load the model without tp_plan, or serve it with transformers' own caches."
            )
        page_format = dataclasses.replace(
            self.cache_config.page_format(self.config, dtype), num_layers=len(layer_groups[0])
        )
        return [
            dataclasses.replace(part, num_kv_heads=self.placement.num_kv_heads or part.num_kv_heads)
            for part in page_format.for_geometries(geometries)
        ]

    def bind(self, device: torch.device, dtype: torch.dtype) -> KVPool:
        """The pool on ``device``, resolved on first use (``IncompatibleModelError`` if a given one does not fit)."""
        pool = self.pools.get(device)
        if pool is not None:
            return pool
        pool = self._pool_for(self.page_formats(device, dtype), device)
        prefix_caching = self.cache_config.prefix_caching  # None: a given pool's index (not another cache's asking)
        if self.pools and self.prefix is not None:
            log_once("the cache spans several devices; prompts are reused on a cache with one pool.")
            self.prefix.active = False
        elif pool.prefix_caching and (prefix_caching or (prefix_caching is None and self.pool is not None)):
            self._check_prefix_placement()
            pool.pages.configure_tiers(self.cache_config.prefix_tiers)
            self.prefix = PrefixTracker(pool.pages, self.policies, self.cache_config.prefix_namespace)
        self.pools[device] = pool
        return pool

    def _check_prefix_placement(self) -> None:
        """Refuses prompt reuse (``ValueError``) on a tensor-parallel model (each rank's index could find prefixes of
        other lengths, feeding the ranks' collectives different tokens) or a split one (no pool holds a prefix)."""
        if self.placement.process_group is not None:
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
            dtype = pool_parts(pool)[0].format.dtype
            return {idx: self.rows_on(idx, device, dtype) for idx in range(len(self.policies))}
        return {idx: rows for (rows_device, idx), rows in self.rows.items() if rows_device == device}

    def _pool_for(self, formats: list[PageFormat], device: torch.device) -> KVPool | KVPoolSet:
        """The pool of ``formats`` on ``device``: the one given to the cache (checked), else a new part per format
        (a ``KVPoolSet`` where there are several)."""
        prefix_caching = bool(self.cache_config.prefix_caching)
        if prefix_caching and len(formats) > 1:
            log_once(
                f"the model's layers write keys and values of {len(formats)} geometries, each on a pool of its own; "
                "prompts are reused on a pool of one geometry."
            )
            prefix_caching = False
        if prefix_caching:
            self._check_prefix_placement()
        if self.pool is not None and self.cache_config.max_tokens is None:
            return self._checked(self.pool, formats, device, prefix_caching)
        parts = [self._new_part(page_format, device, prefix_caching) for page_format in formats]
        return parts[0] if len(parts) == 1 else KVPoolSet(parts)

    def _new_part(self, page_format: PageFormat, device: torch.device, prefix_caching: bool) -> KVPool:
        """A pool of ``page_format``: of ``max_tokens`` tokens where the cache config says so, else the default."""
        max_tokens = self.cache_config.max_tokens
        if max_tokens is not None:
            if prefix_caching:  # kept for the process, so that its index outlives the call
                return KVPool.default(page_format, device, max_tokens=max_tokens)
            num_pages = page_format.pages_for_tokens(max_tokens) + 1
            check_fits(f"max_tokens={max_tokens}", num_pages * page_format.page_bytes, device)
            return KVPool(page_format, num_pages, device)
        pool = KVPool.default(page_format, device, self.placement.process_group)
        if prefix_caching:
            pool.pages.enable_prefix_caching()
        return pool

    def _checked(
        self, pool: KVPool | KVPoolSet, formats: list[PageFormat], device: torch.device, prefix_caching: bool
    ) -> KVPool | KVPoolSet:
        """The pool given to the cache, if it holds a part of each of ``formats`` on ``device``:
        ``IncompatibleModelError`` naming each difference; ``ValueError`` if it has no index ``prefix_caching`` asks."""
        if prefix_caching and not pool.prefix_caching:
            raise ValueError(
                "cache_config prefix_caching=True, but the given pool keeps no prefix index: build it with "
                "KVPool.for_model(model, ..., prefix_caching=True), or leave prefix_caching unset."
            )
        mismatches = []
        parts = pool_parts(pool)
        if len(parts) != len(formats):
            mismatches.append(
                f"pages of {len(parts)} geometries vs {len(formats)} "
                f"({[(ours.num_kv_heads, ours.head_dim, ours.value_dim) for ours in formats]} as (KV heads, key "
                "width, value width))"
            )
        for geometry, (theirs, ours) in enumerate(zip((part.format for part in parts), formats)):
            where = f" of geometry {geometry}" if len(formats) > 1 else ""
            mismatches += [
                f"{name}{where} {getattr(theirs, name)} vs {getattr(ours, name)}"
                for name in FORMAT_FIELDS
                if getattr(theirs, name) != getattr(ours, name)
            ]
        if pool.device != device:
            mismatches.append(f"device {pool.device} vs {device}")
        if mismatches:
            raise IncompatibleModelError(
                f"The pool was built for another model or placement ({', '.join(mismatches)}, pool vs model). "
                "Build it with KVPool.for_model(model, cache_config, ...) for this model, dtype and device; a model "
                "split over several devices takes one pool per device (cache_config max_tokens, or the default pools)."
            )
        return pool

    def release(self) -> None:
        """Publishes what the prefix index still lacks (if the cache reuses prompts), then returns every page."""
        for rows in self.rows.values():
            rows.end_planning()
        if self.prefix is not None:
            self.prefix.publish(self.layer_group_rows(self.prefix.pool.device), final=True)
            self.prefix.reset()
        for rows in self.rows.values():
            rows.release()


_DEFERRED: list[PoolBinder] = []  # binders of caches collected while torch.compile traced (release_when_safe)
_DEFERRED_LOCK = threading.Lock()
_GRAPHS_SEEN = [0]  # dynamo's count of graphs compiled at the last release_deferred (under _DEFERRED_LOCK)


def _tracing() -> bool:
    """Whether torch.compile (or export) is tracing now: tensors are fake, a write to the pool would be lost."""
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(key) is not None for key in (keys.FAKE, keys.PROXY, keys.FUNCTIONAL))


def release_when_safe(binder: PoolBinder) -> None:
    """Releases a collected cache's pages, or at the next ``release_deferred`` if torch.compile is tracing (zeroing
    freed pages would act on fake tensors)."""
    if _tracing():
        with _DEFERRED_LOCK:
            _DEFERRED.append(binder)
        return
    binder.release()


def release_deferred() -> None:
    """Releases the caches collected while torch.compile traced (``release_when_safe``), and those a compile left
    held: dynamo keeps what it traced in a reference cycle only the cyclic collector frees, so where a graph was
    compiled since the last call, this collects once. Called before each planned step and generation, and by
    ``warmup``."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if (graphs == _GRAPHS_SEEN[0] and not _DEFERRED) or _tracing():
        return
    with _DEFERRED_LOCK:
        compiled, _GRAPHS_SEEN[0] = graphs != _GRAPHS_SEEN[0], graphs
    if compiled:
        gc.collect()  # finalizes the caches only the compile's leftovers held (release_when_safe)
    with _DEFERRED_LOCK:
        binders = _DEFERRED[:]
        _DEFERRED.clear()
    for binder in binders:
        binder.release()
