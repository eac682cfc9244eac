"""Compiled decoding on a ``PoolCache`` (``PlannedDecoding``, a base of it): whether ``generate`` may compile it
(``is_compileable``), and each decode step planned before the forward pass in the seam that sees every forward
(``hf_kvcache.integration.seams``), then run as tensor operations only."""

import math
from typing import Any

import torch
from transformers import Cache

from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import PLANNED_READS
from hf_kvcache.caches.binder import release_deferred
from hf_kvcache.caches.state_layers import IndexerKeys
from hf_kvcache.layers import PagedLayer
from hf_kvcache.layers.plan import capacity_bucket


class PlannedDecoding(Cache):
    """The base of ``PoolCache`` that decodes compiled: it plans each step over the layers and the binder
    ``PoolCache`` sets up (``_binder``, ``layers``, ``options``, ``compiled_decoding``)."""

    @property
    def is_compileable(self) -> bool:
        """Whether ``generate`` may compile the model's forward with this cache (as it does for ``StaticCache``):
        every layer group keeps its tokens (all of them, or a window's; in full precision or as codes, with or without
        an exact sink) on one device, so a decode step can be planned before the forward pass (``plan_decode``) and
        run as tensor operations only (a pool's storage never moves: what a step reads stays where it was)."""
        binder = self._binder
        # generate's rule said no for this request, or its steps feed several tokens (seams.check_request): masks
        # may then be skipped as Dynamic's
        if self.compiled_decoding is False:
            return False
        return binder.placement.process_group is None and len({at for at in binder.layer_group_devices if at}) <= 1

    def plan_decode(self, num_rows: int, num_new: int | None, attention_mask: torch.Tensor | None = None) -> bool:
        """Before a decode step of ``generate``, and before its inputs are prepared (they may build the attention
        mask, whose size the plan sets): the bookkeeping of the step (pages, copy-on-write, where the new token goes
        and which pages attention reads) done here, on the host, into tensors the step reads
        (``PagedRows.plan_decode``); ``start_planned`` then counts the step. Only steps that run compiled
        (``compiled_decoding``) are planned into these tensors (their graph does no host work); an eager decode step is
        planned here as its layers' first would (``PagedRows.plan_eager_step``), reading exactly its tokens rather
        than a capacity bucket (the model's mask is built for them). Other steps (a prefill, several tokens, a direct
        ``model(...)`` call) are planned by each layer group's first layer (``PagedRows.plan_step``).

        Args:
            attention_mask: ``generate``'s ``[rows, tokens]`` mask (``None``: all ones): where it hides no more than
                each row's leading padding, attention may read the pages in place (``PagedRows.plan_decode``).
        """
        release_deferred()
        binder = self._binder
        rows_of = list(binder.rows.values())
        if not (self.compiled_decoding and num_new == 1 and rows_of):
            self.end_planning()
            if num_new == 1:  # an eager decode step: planned here too, so that its layers only execute the plan
                start = self.get_seq_length()
                for rows in rows_of:
                    rows.plan_eager_step(start, num_rows)
            return False
        start = self.get_seq_length()
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
        padding_only = _hides_padding_only(attention_mask, binder.pad_lengths, start + 1)
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
