"""Compiled decoding on a ``PoolCache`` (``PlannedDecoding``, a base of it): whether ``generate`` may compile it, and
each decode step planned on the host before the forward pass, which then runs tensor operations only."""

import math
from typing import Any

import torch
from transformers import Cache

from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import mask_hides_padding_only
from hf_kvcache.caches.binder import release_deferred
from hf_kvcache.caches.state_layers import IndexerKeys
from hf_kvcache.layers.plan import capacity_bucket


class PlannedDecoding(Cache):
    """The base of ``PoolCache`` that plans decode steps over the layers and binder ``PoolCache`` sets up."""

    @property
    def is_compileable(self) -> bool:
        """Whether ``generate`` may compile the model's forward with this cache, as with ``StaticCache``: every layer
        group on one device of one process, so that a decode step is planned before the forward pass; not where
        ``generate``'s rule said no for the request (``compiled_decoding`` False: masks may then be skipped)."""
        if self.compiled_decoding is False:
            return False
        binder = self._binder
        return binder.placement.process_group is None and len({at for at in binder.layer_group_devices if at}) <= 1

    def plan_decode(self, num_rows: int, num_new: int | None, attention_mask: torch.Tensor | None = None) -> bool:
        """Before a decode step of ``generate`` and before its inputs are prepared (they may build the mask, whose
        size the plan sets): the step's bookkeeping on the host (``PagedRows.plan_decode``) into tensors a compiled
        step reads, sized by a capacity bucket; ``start_planned`` then counts the step. An eager decode step is
        planned for exactly its tokens (``PagedRows.plan_eager_step``); other steps by each layer group's first layer.

        Args:
            attention_mask: ``generate``'s ``[rows, tokens]`` mask (``None``: all ones): where it hides no more than
                each row's leading padding, attention may read the pages in place.
        """
        release_deferred()
        binder = self._binder
        rows_of = list(binder.rows.values())
        start = self.get_seq_length()
        if not (self.compiled_decoding and num_new == 1 and rows_of):
            self.end_planning()
            if num_new == 1:  # an eager decode step: planned here too, so that its layers only execute the plan
                for rows in rows_of:
                    rows.plan_eager_step(start, num_rows)
            return False
        page_size = rows_of[0].pool.format.page_size
        # A capacity bucket of what generate may reach: one graph for the whole generation.
        capacity = capacity_bucket(math.ceil(max(start + 1, binder.planned_tokens) / page_size))
        if self._planned_capacity != capacity and any(rows.window is None for rows in rows_of):  # windows: fixed
            flex.logger.info(
                "Compiled decoding: this cache reads %d pages per row (a capacity bucket; a graph compiles "
                "where none serves it yet).",
                capacity,
            )
            self._planned_capacity = capacity
        padding_only = not any(binder.pad_lengths or ())  # no mask: every token seen
        if attention_mask is not None:  # generate's [rows, tokens], as the last row of a model's mask
            pads = torch.tensor(binder.pad_lengths or [0] * num_rows)
            padding_only = mask_hides_padding_only(attention_mask.bool()[:, None, None, :], pads, start + 1)
        for rows in rows_of:
            rows.plan_decode(start, num_rows, capacity, padding_only)
        self._planning = True
        indexer_slots = {}  # an indexer's slots, planned once per layer group
        for layer in self._row_layers():
            layer.planned = True  # until its update has run the step
            if isinstance(layer, IndexerKeys):  # its indexer's keys: the step's slots, planned too
                layer.plan_indexer(start, indexer_slots)
        device = rows_of[0].pool.device
        if self._query_offset is None or self._query_offset.device != device:
            self._query_offset = torch.zeros((), dtype=torch.long, device=device)
        self._query_offset.fill_(start)
        return True

    def start_planned(self, inputs: dict[str, Any]) -> None:
        """After a planned step's inputs are prepared: counts its token in every layer, and puts the step's position
        as a tensor where ``generate`` left ``position_ids`` out (a Python int would make each step a new graph)."""
        layers = self._row_layers()
        if self._query_offset is None or not layers or not getattr(layers[0], "planned", False):
            return
        for layer in layers:
            layer.num_tokens += 1
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
            layer.planned = False

    def get_query_offset(self, layer_idx: int = 0) -> Any:
        """A planned step's offset as a tensor (a Python int would make each step a new graph)."""
        layers = self._row_layers()
        if self._query_offset is not None and layers and getattr(layers[0], "planned", False):
            return self._query_offset
        return super().get_query_offset(layer_idx)
