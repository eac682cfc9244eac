"""``PoolCache``: the plumbing shared by our caches (layer groups, pools, row changes, returning pages)."""

import functools
import weakref
from typing import Any

import torch
from transformers import CacheLayerMixin, PreTrainedConfig

from hf_kvcache.caches.admission import Admission
from hf_kvcache.caches.binder import PoolBinder, release_deferred, release_when_safe
from hf_kvcache.caches.compressed import CompressedLayer
from hf_kvcache.caches.config import PagedConfig
from hf_kvcache.caches.planned import PlannedDecoding
from hf_kvcache.caches.policy import RowPolicy
from hf_kvcache.caches.prefix import PrefixTracker
from hf_kvcache.caches.state_layers import IndexedLayer, IndexedWindowLayer, StateLayers
from hf_kvcache.errors import IncompatibleModelError
from hf_kvcache.layers import GATHER, IN_PLACE, RUN, PagedLayer, WindowLayer
from hf_kvcache.memory.allocator import NULL_PAGE
from hf_kvcache.memory.format import (
    COMPRESSED_LAYER_TYPES,
    INDEXED_ATTENTION,
    PageFormat,
    attention_halves,
    layer_geometries,
    layer_groups,
    no_paged_layers,
    with_cross_attention,
)
from hf_kvcache.memory.page_pool import PagePool
from hf_kvcache.memory.placement import Placement
from hf_kvcache.memory.pool import KVPool
from hf_kvcache.memory.pools import KVPoolSet
from hf_kvcache.transformers_internals import DummyLayer, layer_types_and_kwargs


class PoolCache(Admission, PlannedDecoding):
    """A ``transformers.Cache`` whose attention layers live in pool pages.

    The attention layers are split into layer groups (one page table each; per device on a split model, each device
    with a pool of its own), and a subclass says which tokens each keeps (``_row_policy``). Other layers keep
    transformers' own objects (``StateLayers``); a model with no attention layer to page is refused.

    Args:
        config: the model's config (its decoder config is used).
        cache_config: the cache's config (``config_class``), or a dict of its settings; ``None``: the defaults.
        dtype / device: bind the pool now rather than at the first write (both or neither).
        placement: where the model's KV lives (``seams.placement_of(model)``); ``None``: this process, its heads.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        cache_config: PagedConfig | dict[str, Any] | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        placement: Placement | None = None,
    ) -> None:
        config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = layer_types_and_kwargs(config)
        layer_kwargs = [  # a compressed layer's window is the model's sliding window
            {"sliding_window": config.sliding_window} if kind in COMPRESSED_LAYER_TYPES else kwargs
            for kind, kwargs in zip(layer_types, layer_kwargs)
        ]
        layer_types = with_cross_attention(config, layer_types)
        self.cache_config = cache_config = self.config_class.parse(cache_config)
        self._state_layers = StateLayers(config, layer_types)
        layer_types = attention_halves(layer_types)  # a layer of keys and a state: its keys paged, its state above
        if not layer_groups(layer_types):
            raise IncompatibleModelError(no_paged_layers(config, layer_types))
        geometries = layer_geometries(config, layer_types)
        groups = layer_groups(layer_types, geometries)
        page_format = PageFormat.from_model_config(config, torch.float32)
        num_groups = sum(
            part.num_layer_groups for part in page_format.for_geometries([geometries[g[0]] for g in groups])
        )
        if (page_format.num_layers, num_groups) != (len(groups[0]), len(groups)):
            raise IncompatibleModelError(
                f"{type(config).__name__}: transformers and hf_kvcache infer different layer types; "
                "set config.layer_types explicitly."
            )
        placement = placement or Placement()
        groups, group_devices = self._place_layer_groups(layer_types, geometries, groups, placement)
        if self.reuses_read_buffers:
            self._check_kv_sharing(config, groups)
        policies = []
        for members in groups:
            found = {self._row_policy(layer_types[idx], layer_kwargs[idx]) for idx in members}
            if len(found) > 1:
                raise IncompatibleModelError(f"Layers {members} share pages but keep different tokens: {found}.")
            policies.append(found.pop())
        group_geometries = [geometries[members[0]] for members in groups]
        self._binder = PoolBinder(config, cache_config, policies, placement, groups, group_devices, group_geometries)
        layers: list[CacheLayerMixin] = [DummyLayer() for _ in layer_types]
        for layer_group_idx, members in enumerate(groups):
            bind = functools.partial(self._binder.rows_for, layer_group_idx)
            for layer_in_group, layer_idx in enumerate(members):
                layers[layer_idx] = self._make_layer(layer_idx, layer_in_group, bind, policies[layer_group_idx])
        self._state_layers.place(layers)
        super().__init__(layers=layers)
        # Whether generate compiles this request's decode steps (hf_kvcache.integration.seams): True, plan them; False,
        # it runs eager (is_compileable then says False); None, not told (a cache used outside generate).
        self.compiled_decoding: bool | None = None
        self._planned_capacity: int | None = None
        self._planning = False  # a step was planned since the last end_planning
        self._query_offset: torch.Tensor | None = None  # [] a planned step's start, on the pool's device
        weakref.finalize(self, release_when_safe, self._binder)
        if (dtype is None) != (device is None):
            raise ValueError("Give both dtype and device to bind the pool early, or neither.")
        if dtype is not None:
            self.bind_pools(device, dtype)

    config_class = PagedConfig
    reuses_read_buffers = False
    """Whether a layer returns its keys and values in buffers the next layer of its layer group overwrites (decoded
    codes): a layer whose states later layers reuse must then be its layer group's last (``_check_kv_sharing``)."""

    @staticmethod
    def _check_kv_sharing(config: PreTrainedConfig, groups: list[list[int]]) -> None:
        """Refuses a model whose layers reuse another layer's keys and values (``kv_sharing_modes``) where the layer
        storing them is not the last of its layer group (they would be overwritten first), or none is named."""
        modes = list(getattr(config, "kv_sharing_modes", None) or ())
        stores = [idx for idx, mode in enumerate(modes) if mode == "store"]
        overwritten = [(idx, group[group.index(idx) + 1]) for group in groups for idx in stores if idx in group[:-1]]
        if overwritten or ("reuse" in modes and not stores):
            found = ", ".join(f"layer {idx}'s by layer {by}" for idx, by in overwritten) or "no layer is marked 'store'"
            raise IncompatibleModelError(
                f"{type(config).__name__} shares KV between layers (kv_sharing_modes), and the quantized caches return "
                f"a layer's keys and values in buffers the next layer of its layer group overwrites before the layers "
                f"that reuse them read them ({found}). Use paged_pool or sliding_ring for this model."
            )

    @staticmethod
    def _place_layer_groups(
        layer_types: list[str], geometries: list[Any], groups: list[list[int]], placement: Placement
    ) -> tuple[list[list[int]], list[torch.device | None]]:
        """The layer groups and each one's device: the model's (no device), or each device's of a split model."""
        devices = placement.layer_devices
        if devices is None:
            return groups, [None] * len(groups)
        if len(devices) != len(layer_types):
            raise ValueError(f"Placement.layer_devices names {len(devices)} devices for {len(layer_types)} layers.")
        placed_groups: list[list[int]] = []
        group_devices: list[torch.device | None] = []
        for device in placement.devices:
            on_device = [kind if at == device else "dummy" for kind, at in zip(layer_types, devices)]
            on_device = layer_groups(on_device, geometries)
            placed_groups += on_device
            group_devices += [device] * len(on_device)
        return placed_groups, group_devices

    @property
    def placement(self) -> Placement:
        """Where this cache's model keeps its KV (a tensor-parallel rank's heads, a split model's layer devices)."""
        return self._binder.placement

    def _row_policy(self, layer_type: str, layer_kwargs: dict[str, Any]) -> RowPolicy:
        """Which tokens a layer of ``layer_type`` keeps: a sliding layer the model's window, the others every token."""
        if layer_type == "sliding_attention":
            return RowPolicy(window=layer_kwargs["sliding_window"], is_sliding=True)
        return RowPolicy()

    def _make_layer(self, layer_idx: int, layer_in_group: int, bind, policy: RowPolicy) -> CacheLayerMixin:
        """A layer on the pool: paged or a window (a compressed layer's), with an indexer's keys or a state half."""
        kind = self._state_layers.types.get(layer_idx)
        indexed = kind == INDEXED_ATTENTION  # its indexer's keys beside
        if policy.window is None:
            paged = self._state_layers.layer_class(layer_idx, IndexedLayer if indexed else PagedLayer)
            return paged(layer_idx, layer_in_group, bind)
        window_class = CompressedLayer if kind in COMPRESSED_LAYER_TYPES else WindowLayer
        window = self._state_layers.layer_class(layer_idx, IndexedWindowLayer if indexed else window_class)
        return window(layer_idx, layer_in_group, bind, policy.window, policy.sink_tokens, policy.is_sliding)

    @property
    def pools(self) -> dict[torch.device, KVPool | KVPoolSet]:
        """The pool of each device the cache wrote to or was bound to (a ``KVPoolSet`` for several geometries)."""
        return dict(self._binder.pools)

    @property
    def pool(self) -> KVPool | KVPoolSet | None:
        """The pool this cache draws from; ``None`` before its first write unless one was given."""
        pools = list(self.pools.values())
        if len(pools) > 1:
            raise ValueError(f"This cache spans {len(pools)} devices; use cache.pools.")
        return pools[0] if pools else self._binder.pool

    def bind_pools(self, device: torch.device, dtype: torch.dtype) -> None:
        """Resolves the pool of each device the cache's layers live on (``device`` where they are not placed)."""
        for placed in self._binder.placement.devices_for(device):
            self._binder.bind(placed, dtype)

    def plan(self, num_tokens: int, attention_mask: torch.Tensor | None = None) -> None:
        """Says how long rows will grow (``num_tokens``: a compiled step's capacity bucket is sized for them) and where
        each starts, before the first write: a row's leading padding (``attention_mask [rows, prompt_length]``, 0:
        padding; ``None``: none) takes no whole page, so that a window's sinks are its first real tokens."""
        release_deferred()
        pad_lengths = None
        if attention_mask is not None:
            leading = (torch.as_tensor(attention_mask).long().cumsum(-1) == 0).sum(-1)  # [rows]
            pad_lengths = leading.tolist() if bool(leading.any()) else None
        self._binder.planned_tokens, self._binder.pad_lengths, self._binder.fed_tokens = num_tokens, pad_lengths, None
        for rows in self._binder.rows.values():
            rows.set_plan(pad_lengths, None)

    def feeds(self, num_tokens: int | None) -> None:
        """The tokens ``generate``'s first forward pass feeds (``None``: not known). A model that writes others than
        its mask shows (CPM-Ant prepends tokens of its own) holds tokens where the mask shows padding: its rows then
        skip no page and hide no token."""
        self._binder.fed_tokens = num_tokens
        for rows in self._binder.rows.values():
            rows.set_plan(self._binder.pad_lengths, num_tokens)

    def memory_stats(self) -> dict[str, int]:
        """Pages this cache holds (shared pages once), the bytes it holds, and the tokens per row: ``bytes_held``
        counts the pages, ``residual_bytes`` (a quantized cache's exact newest values) and ``state_bytes``
        (``StateLayers``); ``pages_unfilled``: pages held that hold no token."""
        pages = self._held_pages()
        unfilled = sum(
            1 for rows in self._binder.rows.values() for count in rows.table.filled_slots().values() if count == 0
        )
        num_rows = max((rows.table.num_rows for rows in self._binder.rows.values()), default=0)
        residual_bytes = sum(rows.store.residual_bytes for rows in self._binder.rows.values())
        state_bytes = self._state_layers.state_bytes()
        return {
            "pages_held": len(pages),
            "pages_unfilled": unfilled,
            "bytes_held": sum(pool.format.page_bytes for pool, _ in pages) + residual_bytes + state_bytes,
            "residual_bytes": residual_bytes,
            "state_bytes": state_bytes,
            "num_rows": num_rows,
            "tokens_per_row": self.get_seq_length(),
        }

    def read_counts(self) -> dict[str, int]:
        """How attention has read this cache's layers so far, one count per layer and forward pass, by path:
        ``"gather"``, ``"run"`` (a view of a row's consecutive pages), ``"in place"``. Planned steps are not counted."""
        counts = dict.fromkeys((GATHER, RUN, IN_PLACE), 0)
        for rows in self._binder.rows.values():
            for path, count in rows.path.reads.items():
                counts[path] += count
        return counts

    def _held_pages(self) -> set[tuple[PagePool, int]]:
        """``(PagePool, page id)`` of every page this cache's rows hold, shared ones once."""
        bound = self._binder.rows.values()
        pages = {(rows.pool, page) for rows in bound for row in rows.table.rows for page in row}
        return {(pool, page) for pool, page in pages if page != NULL_PAGE}  # holes: none

    def _row_layers(self) -> list[PagedLayer]:
        """The layers on the pool (not transformers' own, not ``DummyLayer``)."""
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens each row holds: layer ``layer_idx``'s count, or the first pool layer's where that one is not on the
        pool."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if not isinstance(layer, PagedLayer):
            layer = next(iter(self._row_layers()), None)
        return 0 if layer is None else layer.get_seq_length()

    @property
    def is_compileable(self) -> bool:
        """``PlannedDecoding.is_compileable``, and transformers' own layers say so too."""
        return super().is_compileable and self._state_layers.is_compileable

    # ----- prompt reuse (hf_kvcache.caches.prefix; driven by hf_kvcache.integration.seams) ---------

    @property
    def prefix(self) -> PrefixTracker | None:
        """The cache's side of its pool's prefix index; ``None`` unless the cache reuses prompts (known once bound)."""
        return self._binder.prefix

    def begin_generation(
        self,
        model: Any,
        input_ids: torch.Tensor,
        next_sequence_length: int | None,
        inputs: dict[str, Any],
    ) -> int | None:
        """Before a ``generate`` call's first forward pass: attaches the longest cached prefix of the prompt
        (``input_ids [rows, length]``) to an empty cache, where ``generate`` slices the prompt itself
        (``next_sequence_length`` given); returns the tokens left to feed. ``inputs``: the other
        ``prepare_inputs_for_generation`` arguments."""
        for device in self._binder.placement.devices_for(model.device)[:1]:  # the first layer's
            self._binder.bind(device, model.dtype)
        tracker = self._binder.prefix
        if tracker is None or not tracker.begin_call(model, input_ids, inputs, self._state_layers.refusal()):
            return next_sequence_length
        tracker.states = self._state_layers.tails
        if next_sequence_length is None or self.get_seq_length():
            return next_sequence_length
        rows_of = self._binder.layer_group_rows(tracker.pool.device, create=True)
        reused = tracker.reuse(rows_of, input_ids)
        for layer in self._row_layers():
            layer.num_tokens = reused
        return next_sequence_length - reused

    @property
    def splits_prefill(self) -> bool:
        """Whether a prefill runs as passes ending where the state layers keep their states (``pass_ends``)."""
        return self._binder.prefix is not None and self._state_layers.tails is not None

    def record_inputs(self, fed_ids: torch.Tensor | None) -> None:
        """The ids ``[rows, n]`` a forward pass is about to feed (``None``: embeddings), written after the tokens the
        cache holds; publishes the pages written so far."""
        tracker = self._binder.prefix
        if tracker is not None:
            tracker.record(self.get_seq_length(), fed_ids, self._binder.layer_group_rows(tracker.pool.device))

    def prefill_ran(self) -> None:
        """A prefill run as passes (``splits_prefill``) has run its last one (``PrefixTracker.passed``)."""
        tracker = self._binder.prefix
        if tracker is not None:
            tracker.passed(self.get_seq_length(), self._binder.layer_group_rows(tracker.pool.device))

    def _select_rows(self, indices: list[int]) -> None:
        for rows in self._binder.rows.values():
            if rows.table.num_rows:
                rows.select_rows(indices)
        if self._binder.prefix is not None:
            self._binder.prefix.select_rows(indices)
        self._state_layers.select_rows(indices)

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
        """Removes the last ``-tokens_to_remove`` tokens (``<= 0``), returning emptied pages; transformers' own layers
        are cropped as transformers crops them. Raises ``ValueError`` for ``tokens_to_remove > 0``, or where a window
        or a state cannot give back what the crop needs (nothing is cropped then)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}.")
        self._state_layers.check_crop(tokens_to_remove)
        if tokens_to_remove == 0:
            self._state_layers.crop(0)
            return
        self.end_planning()
        keep = max(0, self.get_seq_length() + tokens_to_remove)
        for rows in self._binder.rows.values():
            rows.check_crop(keep)  # all or nothing: a window may not hold what the crop needs
        self._state_layers.crop(tokens_to_remove)
        for rows in self._binder.rows.values():
            rows.crop(keep)
        if self._binder.prefix is not None:
            self._binder.prefix.crop(keep)
        for layer in self._row_layers():
            layer.num_tokens = keep

    def release(self) -> None:
        """Returns every page to the pool and drops the states of transformers' own layers: the cache is empty and
        stays usable."""
        self.end_planning()
        self._binder.release()
        self._state_layers.release(self.layers)
        for layer in self._row_layers():
            layer.num_tokens = 0

    reset = release
