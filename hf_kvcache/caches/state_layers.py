"""The layers of a cache that hold no attention KV we page keep transformers' own cache layers (``StateLayers``),
outside the pool, as ``DynamicCache`` makes them: recurrent, convolution and state-space states, a compressor's state
(``CompressedLayer``); an image's cross-attention keys (``ImageKeysLayer``) and an indexer's keys (``IndexerRing``)
as ``StaticCache`` keeps them, so that decoding compiles. A fused layer (``FUSED_LAYER_TYPES``) is one of our layers
with ``LinearAttentionLayer``'s state half mixed in (``with_state``).

A recurrent state exists only at the end of the tokens it has seen, so ``SNAPSHOT_LAYER_TYPES`` keep copies at page
boundaries for prompt reuse (``tails``), other state layers refuse reuse (``refusal``), and a state is cropped only
where its layer records its past (``activate_past_recording``)."""

import functools
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedConfig, StaticLayer

from hf_kvcache.caches.state_tails import StateTails
from hf_kvcache.errors import IncompatibleModelError
from hf_kvcache.layers import PagedLayer, WindowLayer
from hf_kvcache.layers.plan import capacity_bucket
from hf_kvcache.layers.window import visible_span
from hf_kvcache.memory.format import (
    COMPRESSED_LAYER_TYPES,
    CROSS_ATTENTION,
    FUSED_LAYER_TYPES,
    INDEXED_ATTENTION,
    PAGED_LAYER_TYPES,
)
from hf_kvcache.transformers_internals import LinearAttentionLayer, cache_layer_state

SNAPSHOT_LAYER_TYPES = ("conv", "linear_attention", *FUSED_LAYER_TYPES)
"""Layer types whose states are kept at page boundaries for prompt reuse (``StateTails``)."""


class IndexerRing:
    """An indexed-attention layer's indexer keys at a fixed address, written in place, as transformers'
    ``StaticIndexedLayer`` keeps them: token ``t`` of each row in slot ``t % capacity`` of ``keys [batch, capacity,
    index_head_dim]``. Growing rows' capacity is a capacity bucket of their tokens (it never wraps); a window's is its
    reach (``window - 1 + page_size``). The cache's token count says which slots hold tokens: a crop changes none."""

    is_compileable = True  # a fixed address, written in place

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [batch, capacity, index_head_dim]

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def reserve(self, capacity: int, like: torch.Tensor | None = None) -> None:
        """At least ``capacity`` slots, the tokens held kept (growing rows, which never wrap): a new buffer where it
        has fewer, shaped after ``like`` ``[batch, n, index_head_dim]`` for the first."""
        if capacity <= self.capacity:
            return
        held, like = self.keys, self.keys if self.keys is not None else like
        self.keys = like.new_zeros((like.shape[0], capacity, like.shape[-1]))  # [batch, capacity, index_head_dim]
        if held is not None:
            self.keys[:, : held.shape[1]] = held
        torch._dynamo.mark_static_address(self.keys)  # CUDA graphs read it where it lies

    def reorder_cache(self, order: torch.LongTensor) -> None:
        """Row ``i`` becomes old row ``order[i]`` (beams, repeats, kept rows)."""
        if self.keys is not None:
            self.keys = self.keys.index_select(0, order.to(self.keys.device))

    def crop(self, tokens_to_remove: int) -> None:
        """Nothing to do: the slots past the cache's tokens are not read (``IndexerKeys``)."""


class IndexerKeys:
    """An indexed-attention layer on the pool: its keys and values in pages, its indexer's keys in an ``IndexerRing``
    (``indexer``, held by ``StateLayers``), written and read through ``cache.update_indexer``. The indexer scores the
    keys attention reads, so it gets the same keys in the same order: an eager step the window's ``visible_span`` (or
    every token), a planned step its plan's ``num_keys`` keys from ``kv_offset`` on (``plan_indexer``); slots past
    the step's token hold stale keys, which the model's mask hides from the scores as from attention."""

    indexer: IndexerRing | None = None  # placed by StateLayers.place
    window: int | None = None  # a window's (``WindowLayer``)
    _write_slot: torch.Tensor | None = None  # a planned step's [1] slot of its token (plan_indexer)
    _read_slots: torch.Tensor | None = None  # a planned step's [num_keys] slots of the keys it reads

    def _ring_capacity(self, num_tokens: int) -> int:
        """The slots the indexer keeps for rows of ``num_tokens`` tokens (``IndexerRing``)."""
        if self.window is not None:
            return self.rows.reach
        page_size = self.rows.pool.format.page_size
        return capacity_bucket(-(-num_tokens // page_size)) * page_size

    def plan_indexer(self, start: int, planned: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Before a planned step at ``start``, after its rows' plan: the slot its token goes to and the slots of the
        keys it reads, in tensors kept from step to step, refilled once per layer group by its first indexed layer
        and shared by the others (``planned``: this step's, by rows and ring capacity)."""
        plan = self.rows.step_plan
        if self.window is None:
            self.indexer.reserve(plan.num_keys)
        capacity, device = self.indexer.capacity, self.indexer.keys.device
        made = planned.get((id(self.rows), capacity))
        if made is None:
            reads = (plan.kv_offset + torch.arange(plan.num_keys, device=device)) % capacity  # [num_keys]
            write = torch.tensor([start % capacity], device=device)  # [1]
            if self._read_slots is None or self._read_slots.shape != reads.shape:
                self._write_slot, self._read_slots = write, reads
                torch._dynamo.mark_static_address(self._write_slot)
                torch._dynamo.mark_static_address(self._read_slots)
            else:
                self._write_slot.copy_(write)
                self._read_slots.copy_(reads)
            made = planned[(id(self.rows), capacity)] = (self._write_slot, self._read_slots)
        self._write_slot, self._read_slots = made

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Writes ``[batch, n, index_head_dim]`` indexer keys (after the step's ``update``); returns those of the keys
        attention reads this step, ``[batch, num_keys, index_head_dim]``."""
        ring = self.indexer
        if self.rows.step_plan.ahead:  # planned: the step's one token, the plan's keys (plan_indexer)
            ring.keys.index_copy_(1, self._write_slot, indexer_key_states)
            return ring.keys.index_select(1, self._read_slots)
        num_new = indexer_key_states.shape[1]
        end = self.num_tokens
        start = end - num_new
        ring.reserve(self._ring_capacity(end), indexer_key_states)
        capacity, device = ring.capacity, indexer_key_states.device
        first = 0 if self.window is None else visible_span(start, num_new, self.window, 0)[1]
        seen = ring.keys.index_select(1, torch.arange(first, start, device=device) % capacity)
        kept = min(num_new, capacity)  # a step longer than a window's reach keeps its last tokens only
        written = torch.arange(end - kept, end, device=device) % capacity
        ring.keys.index_copy_(1, written, indexer_key_states[:, num_new - kept :])
        return torch.cat([seen, indexer_key_states], dim=1)


class IndexedLayer(IndexerKeys, PagedLayer):
    """An indexed-attention layer keeping every token (``IndexerKeys``)."""


class IndexedWindowLayer(IndexerKeys, WindowLayer):
    """An indexed-attention layer keeping a window imposed by the cache, without sinks (the indexer's keys do not
    follow them: ``IncompatibleModelError``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.sink_tokens:
            raise IncompatibleModelError(
                f"Layer {self.layer_idx} is an indexed-attention layer, whose indexer's keys a window keeps without "
                f"sinks: sink_tokens={self.sink_tokens} is not served on it. Set cache_config sink_tokens=0."
            )


class ImageKeysLayer(StaticLayer):
    """A cross-attention layer's keys and values (an image's): transformers' ``StaticLayer``, as ``StaticCache``
    makes for Mllama, sized by its first write instead of the vision config, so that a compiled step can read it."""

    def __init__(self) -> None:
        super().__init__(max_cache_len=0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.max_cache_len = key_states.shape[-2]
        super().lazy_initialization(key_states, value_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first write fills the layer; a later one (another image, or a model handed the states at every step:
        ``MllamaForCausalLM``) is appended, as ``DynamicLayer`` appends it."""
        if not self.is_initialized:
            return super().update(key_states, value_states, *args, **kwargs)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.max_cache_len = self.keys.shape[-2]
        self.cumulative_length.add_(key_states.shape[-2])
        return self.keys, self.values


class StateHalf:
    """The state half of a layer carrying both keys and a state (``FUSED_LAYER_TYPES``: Falcon-H1, Zaya, Inkling),
    mixed with ``LinearAttentionLayer`` into one of our layer classes (``with_state``), as transformers mixes it into
    ``DynamicLayer``: keys go to the pool through ``update``, states stay here."""

    def __init__(self, *args: Any, number_of_states: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        """A state's first write comes by keywords (``conv_states=`` / ``recurrent_states=``), keys' by position."""
        if kwargs:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)
        else:
            super().lazy_initialization(*args)

    @property
    def is_compileable(self) -> bool:
        """transformers' rule for the state: static addresses, updated in place, unless it records its past."""
        return not self.record_past

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        super().crop(tokens_to_remove)

    def fresh_state(self) -> None:
        """Drops the states and their memory (``StateLayers.release``): as the layer was made."""
        LinearAttentionLayer.__init__(self, number_of_states=self.number_of_states)


@functools.cache
def with_state(layer_class: type[PagedLayer]) -> type[PagedLayer]:
    """``layer_class`` (``PagedLayer``, ``WindowLayer``) with a state half (``StateHalf``)."""
    return type(f"{layer_class.__name__}WithState", (StateHalf, layer_class, LinearAttentionLayer), {})


class StateLayers:
    """transformers' own layers of one cache by model layer index (every layer neither paged nor ``dummy``), each
    indexed-attention layer's ``IndexerRing``, and the states of the cache's fused layers. ``layer_types``: as
    ``layer_types_and_kwargs`` reads them, cross-attention typed ``CROSS_ATTENTION``; a type ``DynamicCache`` has no
    layer class for raises ``IncompatibleModelError`` (import the model first)."""

    def __init__(self, config: PreTrainedConfig, layer_types: list[str]) -> None:
        self.config = config
        held = lambda kind: kind not in (*PAGED_LAYER_TYPES, "dummy") or kind == INDEXED_ATTENTION  # noqa: E731
        self.types = {idx: kind for idx, kind in enumerate(layer_types) if held(kind)}
        self.fused = [idx for idx, kind in self.types.items() if kind in FUSED_LAYER_TYPES]
        self.layers: dict[int, Any] = self._made()
        snapshots = self.types and all(kind in SNAPSHOT_LAYER_TYPES for kind in self.types.values())
        self.tails = StateTails(self) if snapshots else None  # their states kept for prompt reuse

    def layer_class(self, layer_idx: int, paged_class: type[PagedLayer]) -> Any:
        """What makes layer ``layer_idx`` on the pool: ``paged_class``, with a state half (``with_state``) where the
        layer carries both keys and a state."""
        if layer_idx not in self.fused:
            return paged_class
        states = DynamicCache(config=self.config).layers[layer_idx].number_of_states
        return functools.partial(with_state(paged_class), number_of_states=states)

    def _made(self) -> dict[int, Any]:
        """Fresh layers, as ``DynamicCache`` makes them."""
        if not self.types:
            return {}
        try:
            made = DynamicCache(config=self.config).layers
        except KeyError as error:
            raise IncompatibleModelError(
                f"{type(self.config).__name__} has a layer of type {error} for which transformers' DynamicCache has no "
                "cache layer: import the model (its modeling module registers the layer type) before the cache."
            ) from error
        own = {CROSS_ATTENTION: ImageKeysLayer, INDEXED_ATTENTION: IndexerRing}
        layers = {idx: own[kind]() if kind in own else made[idx] for idx, kind in self.types.items()}
        return {idx: layer for idx, layer in layers.items() if idx not in self.fused}

    def place(self, cache_layers: list[Any]) -> None:
        """Puts these layers in their places of a cache's ``layers``, an indexer's keys and a compressor's state beside
        their layers; keeps the cache's fused layers for their states."""
        for idx, layer in self.layers.items():
            if self.types[idx] == INDEXED_ATTENTION:
                cache_layers[idx].indexer = layer
            elif self.types[idx] in COMPRESSED_LAYER_TYPES:
                cache_layers[idx].compressor = layer
            else:
                cache_layers[idx] = layer
        self.layers.update({idx: cache_layers[idx] for idx in self.fused})

    def release(self, cache_layers: list[Any]) -> None:
        """Drops the states and their memory: fresh layers (a reset one would keep its batch size), fresh states."""
        for idx in self.fused:
            cache_layers[idx].fresh_state()
        self.layers = self._made()
        self.place(cache_layers)
        if self.tails is not None:
            self.tails.release()

    @property
    def is_compileable(self) -> bool:
        """Whether every layer is (a linear-attention layer unless it records its past; a compressor's state not)."""
        return all(layer.is_compileable for layer in self.layers.values())

    def refusal(self) -> str | None:
        """Why a cache with these layers does not reuse prompts (``None``: it has none)."""
        cross = [idx for idx, kind in self.types.items() if kind == CROSS_ATTENTION]
        indexed = [idx for idx, kind in self.types.items() if kind == INDEXED_ATTENTION]
        compressed = self._compressed()
        states = [idx for idx in self.types if idx not in cross + indexed + compressed and self.tails is None]
        kinds = sorted({self.types[idx] for idx in states})
        reasons = []
        if states:
            reasons.append(
                f"layers {states} ({', '.join(kinds)}) keep a recurrent or convolution state (or keys of their own) "
                "outside the pool, which exists only at the end of the tokens it has seen, not at a page of the prompt"
            )
        if indexed:
            reasons.append(
                f"indexed-attention layers {indexed} keep their indexer's keys beside the pool, which a cached "
                "prefix's pages do not hold"
            )
        if compressed:
            reasons.append(
                f"compressed-attention layers {compressed} keep their compressor's state (the tokens of a compression "
                "window not yet closed, the compressed entries) beside the pool, which a cached prefix's pages do not "
                "hold"
            )
        if cross:
            reasons.append(
                f"cross-attention layers {cross} hold the keys of an image or encoder output, which the prompt's "
                "tokens a cached prefix is keyed on do not determine"
            )
        if not reasons:
            return None
        ending = ": a cached prefix could not restore them, so prompts are neither reused nor published."
        return "; ".join(reasons) + ending

    def _compressed(self) -> list[int]:
        """The compressed-attention layers (``COMPRESSED_LAYER_TYPES``)."""
        return [idx for idx, kind in self.types.items() if kind in COMPRESSED_LAYER_TYPES]

    def select_rows(self, indices: list[int]) -> None:
        """Row ``i`` becomes old row ``indices[i]`` in every state (beams, repeats, kept rows)."""
        order = torch.tensor(indices, dtype=torch.long)
        for layer in self.layers.values():
            layer.reorder_cache(order)
        if self.tails is not None:
            self.tails.select_rows(indices)

    def check_crop(self, tokens_to_remove: int) -> None:
        """Refuses a crop a layer cannot make, before anything is cropped (``ValueError``): a compressor's state is
        never croppable (as in transformers), a recurrent state only where it records its past."""
        compressed = self._compressed()
        if tokens_to_remove < 0 and compressed:
            raise ValueError(
                f"Cannot crop {-tokens_to_remove} tokens: layers {compressed} ({self.types[compressed[0]]}) compress "
                "the tokens they have seen, and their compressor's state cannot be cut back (transformers' layer "
                "says is_croppable=False too). Do not crop a cache of this model: assisted decoding and prompt lookup "
                "cannot run with it."
            )
        fixed = [idx for idx, layer in self.layers.items() if getattr(layer, "record_past", True) is False]
        if tokens_to_remove < 0 and fixed:
            raise ValueError(
                f"Cannot crop {-tokens_to_remove} tokens: layers {fixed} ({self.types[fixed[0]]}) keep a recurrent "
                "state that exists only at the end of the tokens seen. Call cache.activate_past_recording() before "
                "the forward passes to be undone (as assisted decoding does), as transformers' own caches require."
            )

    def crop(self, tokens_to_remove: int) -> None:
        """Crops every layer that can (``check_crop`` first); ``crop(0)`` shrinks recorded states to their working
        size. A cross-attention layer's image keys are kept whole."""
        for idx, layer in self.layers.items():
            if getattr(layer, "record_past", True) and self.types[idx] != CROSS_ATTENTION:
                layer.crop(tokens_to_remove)

    def state_bytes(self) -> int:
        """Bytes of the tensors these layers hold, each once, counters aside, and of the state copies not yet
        published (``tails``)."""
        seen: dict[tuple[int, int], int] = {}
        pending = [value for layer in self.layers.values() for value in cache_layer_state(layer)]
        pending += self.tails.held() if self.tails is not None else []
        while pending:
            value = pending.pop()
            if isinstance(value, torch.Tensor) and value.ndim:  # counters (0-d) aside
                seen[(value.untyped_storage().data_ptr(), value.storage_offset())] = value.nbytes
            elif isinstance(value, dict):
                pending += value.values()
            elif isinstance(value, list | tuple):
                pending += value
        return sum(seen.values())
