"""The layers of a cache that hold no attention KV we page keep transformers' own cache layers (``StateLayers``):
linear attention's recurrent and convolution states, state-space and short-convolution states, a
compressed-attention layer's compressor state (``hf_kvcache.caches.compressed``: its window is on the pool), and
cross-attention layers' keys of an image or encoder output (``CROSS_ATTENTION``: Mllama). Each is the object
``DynamicCache`` makes for its layer (same class, same construction), but a cross-attention layer's, which is the
``StaticLayer`` transformers' ``StaticCache`` makes for Mllama, sized by the image's keys when they are written
(``ImageKeysLayer``: written once, read at every step, so decoding compiles); all held outside the pool. Beside
them, the keys of an indexed-attention layer's lightning indexer (``IndexerKeys``: the layer's own keys and values
are on the pool) are kept as transformers' ``StaticCache`` keeps them, at a fixed address written in place
(``IndexerRing``), so that its decode steps compile too. A layer that fuses attention with a state-space block
(``FUSED_LAYER_TYPES``: Falcon-H1, Zaya, Inkling) is one of our layers on the pool with the state half of
transformers' ``LinearAttentionLayer`` mixed in (``with_state``), kept here for its states. The model reads and
writes them through ``Cache``'s own methods (``update``, ``update_conv_state``, ``update_indexer``, ...) or their
``keys``, which find them in ``cache.layers``.

A recurrent state exists only at the end of the tokens it has seen: it moves with its rows (beams, returned
sequences), but it cannot be cut back to a page boundary. Linear-attention and convolution layers
and layers fusing attention with a state-space block (``SNAPSHOT_LAYER_TYPES``) keep copies of their states at the
page boundaries a later call may start from (``tails``: ``hf_kvcache.caches.state_tails``) and so take part in prompt
reuse; state layers of types a model registers do not (``refusal``; nor does one with an indexer's keys, which a
cached prefix's pages do not hold). A state can be cropped only where transformers' layer records its past
(``activate_past_recording``, as assisted decoding does). An image's keys are not a function of the prompt's tokens a
prefix is keyed on: no reuse either; a crop of the prompt's tokens leaves them whole."""

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
"""Layer types whose states (transformers' ``LinearAttentionLayer``'s, or the state half of a fused layer) are kept
at page boundaries for prompt reuse."""


class IndexerRing:
    """An indexed-attention layer's indexer keys (``IndexerKeys``) at a fixed address, written in place, as
    transformers' ``StaticIndexedLayer`` keeps them: token ``t`` of each row in slot ``t % capacity`` of ``keys
    [batch, capacity, index_head_dim]``. Growing rows' capacity is a capacity bucket of their tokens
    (``capacity_bucket`` pages: it never wraps, and grows with the bucket a compiled step reads, one new graph at
    most, as the pages' reads); a window's is its reach (``window - 1 + page_size`` tokens: what the next step sees,
    and a crop of up to a page). The cache's token count says which slots hold the rows' tokens: a crop leaves the
    slots as they are."""

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
    """An indexed-attention layer on the pool (``IndexedLayer``, ``IndexedWindowLayer``): its keys and values in pages,
    its lightning indexer's keys in an ``IndexerRing`` (``indexer``, held by ``StateLayers``, which moves it with the
    rows and counts its bytes), which the model writes and reads through ``cache.update_indexer``. The indexer scores
    the keys attention reads and its picks index them, so it gets the same keys in the same order: an eager step the
    tokens ``[first, end)`` of the window's ``visible_span`` (every token where there is no window), a planned step
    the tokens of its plan's ``num_keys`` keys from ``kv_offset`` on (``plan_indexer``), those past the step's token
    holding whatever their slots hold: the model's mask, which hides them from attention, hides them from the
    indexer's scores too (transformers' ``StaticIndexedLayer`` returns its unwritten slots the same way)."""

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
        """Before a planned step at ``start`` (``PlannedDecoding.plan_decode``, after its rows' plan): the slot its
        token goes to and the slots of the keys it reads, in tensors kept from step to step and refilled in place
        once per layer group: its first indexed layer's, which the others share (``planned``: this step's, by rows
        and ring capacity); growing rows' ring grown to the keys the plan reads (a window's holds its reach)."""
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
    """An indexed-attention layer keeping a window imposed by the cache (``IndexerKeys``).

    Raises:
        IncompatibleModelError: the window keeps sinks, which a padded row keeps at its own first real tokens: the
            indexer's keys do not follow them.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.sink_tokens:
            raise IncompatibleModelError(
                f"Layer {self.layer_idx} is an indexed-attention layer, whose indexer's keys a window keeps without "
                f"sinks: sink_tokens={self.sink_tokens} is not served on it. Set cache_config sink_tokens=0."
            )


class ImageKeysLayer(StaticLayer):
    """A cross-attention layer's keys and values (an image's, an encoder output's): transformers' ``StaticLayer``,
    as its ``StaticCache`` makes for Mllama's cross-attention layers, sized by its first write (the prefill's image)
    instead of from the vision config: a fixed address, read at every decode step, which a compiled step can read."""

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
    """The state half of a layer that carries both keys and a state (``FUSED_LAYER_TYPES``: Falcon-H1, Zaya, Inkling),
    mixed into one of our paged layer classes with transformers' ``LinearAttentionLayer`` (``with_state``), as
    transformers mixes it into ``DynamicLayer`` (``LinearAttentionAndFullAttentionLayer``): the model writes the keys
    through ``update`` (to the pool) and the states through ``update_conv_state`` / ``update_recurrent_state``, all
    on the one layer ``Cache``'s methods find at its index. Row changes move the pages once per layer group (the
    cache's rows) and the states here (``reorder_cache``)."""

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
    """transformers' own layers of one cache, by model layer index: every layer whose type is neither paged
    (``PAGED_LAYER_TYPES``) nor ``dummy``, the indexer keys of each indexed-attention layer (an ``IndexerRing``
    beside the cache's layer on the pool: ``IndexerKeys``), and the cache's own layers that carry keys and a state
    (``FUSED_LAYER_TYPES``), for their states.

    Args:
        config: the model's decoder config.
        layer_types: each layer's type, as transformers' caches read them (``layer_types_and_kwargs``), with
            cross-attention layers typed ``CROSS_ATTENTION`` (``with_cross_attention``).

    Raises:
        IncompatibleModelError: a layer type has no layer class in transformers' ``DynamicCache`` (its modeling module
            registers it; import the model first).
    """

    def __init__(self, config: PreTrainedConfig, layer_types: list[str]) -> None:
        self.config = config
        held = lambda kind: kind not in (*PAGED_LAYER_TYPES, "dummy") or kind == INDEXED_ATTENTION  # noqa: E731
        self.types = {idx: kind for idx, kind in enumerate(layer_types) if held(kind)}
        self.fused = [idx for idx, kind in self.types.items() if kind in FUSED_LAYER_TYPES]
        self.layers: dict[int, Any] = self._made()
        snapshots = self.types and all(kind in SNAPSHOT_LAYER_TYPES for kind in self.types.values())
        self.tails = StateTails(self) if snapshots else None  # their states kept for prompt reuse

    def layer_class(self, layer_idx: int, paged_class: type[PagedLayer]) -> Any:
        """What makes layer ``layer_idx`` on the pool: ``paged_class``, with a state half (``with_state``) and
        ``DynamicCache``'s number of states where the layer carries both keys and a state (the cache's own layer,
        which ``place`` then keeps for its states)."""
        if layer_idx not in self.fused:
            return paged_class
        states = DynamicCache(config=self.config).layers[layer_idx].number_of_states
        return functools.partial(with_state(paged_class), number_of_states=states)

    def __bool__(self) -> bool:
        return bool(self.types)

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
        """Puts these layers in their places of a cache's ``layers``; an indexer's keys beside its layer's keys and
        values (``IndexerKeys.indexer``), a compressor's state beside its window (``CompressedLayer.compressor``);
        keeps the cache's layers that carry keys and a state (``layer_class``)."""
        for idx, layer in self.layers.items():
            if self.types[idx] == INDEXED_ATTENTION:
                cache_layers[idx].indexer = layer
            elif self.types[idx] in COMPRESSED_LAYER_TYPES:
                cache_layers[idx].compressor = layer
            else:
                cache_layers[idx] = layer
        self.layers.update({idx: cache_layers[idx] for idx in self.fused})

    def release(self, cache_layers: list[Any]) -> None:
        """Drops the states and their memory: fresh layers take their places in ``cache_layers`` (a reset layer would
        keep its tensors, whose batch size the next prompt may not share), fresh states those of fused layers."""
        for idx in self.fused:
            cache_layers[idx].fresh_state()
        self.layers = self._made()
        self.place(cache_layers)
        if self.tails is not None:
            self.tails.release()

    @property
    def is_compileable(self) -> bool:
        """Whether every layer is (transformers' rule: a linear-attention layer keeps static addresses, updated in
        place, unless it records its past; a layer that grows its keys, as a compressor's state does, is not)."""
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
        """Row ``i`` becomes old row ``indices[i]`` in every state (beams, repeats, kept rows): each layer's own
        ``reorder_cache``, which moves all it holds (transformers' linear-attention layers have no other row change)."""
        order = torch.tensor(indices, dtype=torch.long)
        for layer in self.layers.values():
            layer.reorder_cache(order)
        if self.tails is not None:
            self.tails.select_rows(indices)

    def check_crop(self, tokens_to_remove: int) -> None:
        """Refuses a crop a layer cannot make, before anything is cropped.

        Raises:
            ValueError: a layer keeps a compressor's state (never croppable, as in transformers), or a recurrent state
                that does not record its past.
        """
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
        """Crops every layer that can (``check_crop`` first); ``crop(0)`` shrinks recorded states back to their
        working size, as in transformers. A cross-attention layer's keys are the image's, not the prompt's tokens:
        kept whole."""
        for idx, layer in self.layers.items():
            if getattr(layer, "record_past", True) and self.types[idx] != CROSS_ATTENTION:
                layer.crop(tokens_to_remove)

    def state_bytes(self) -> int:
        """Bytes of the tensors these layers hold (states, their recorded past, keys of their own), each once, their
        token counters aside, and of the copies of their states kept for prompt reuse and not yet published
        (``tails``)."""
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
