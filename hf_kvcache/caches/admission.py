"""Admission of a request to a cache's pools (``Admission``, a base of ``PoolCache``): a request whose rows could not
fit in the worst case fails before any compute, naming what to change, rather than midway through a generation."""

import functools
import logging
from typing import Any

import torch

from hf_kvcache.errors import IncompatibleModelError, PoolExhaustedError
from hf_kvcache.memory.placement import agree, normalize_device
from hf_kvcache.memory.pool import KVPool

logger = logging.getLogger("hf_kvcache")


@functools.cache
def _log_unchecked_admission() -> None:
    logger.warning(
        "Requests are not checked for admission: the model's parameters are offloaded without a device map, so the "
        "pool its layers use is known at their first write only. Load it with a device_map to check them."
    )


class Admission:
    """The admission checks of ``PoolCache``, over its ``_binder``, ``cache_config`` and ``_held_pages``."""

    def worst_case_pages(
        self, num_rows: int, num_tokens: int, page_size: int, device: torch.device | None = None
    ) -> int:
        """Most pages ``num_rows`` rows of ``num_tokens`` tokens each can hold on one pool, no page shared (each
        layer group's own), on ``device`` only where given (a split model)."""
        binder = self._binder
        groups = range(len(binder.policies)) if device is None else binder.layer_groups_on(normalize_device(device))
        return self._worst_pages(groups, num_rows, num_tokens, page_size)

    def _worst_pages(self, groups: Any, num_rows: int, num_tokens: int, page_size: int) -> int:
        """``worst_case_pages`` of the layer groups ``groups``."""
        return num_rows * sum(self._binder.policies[idx].max_pages_per_row(num_tokens, page_size) for idx in groups)

    def check_admission(self, num_rows: int, num_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        """Refuses, before any compute, a request that could not fit in the pool in the worst case
        (``PoolExhaustedError``). A check, not a reservation: requests running at the same time can still exhaust
        the pool. Pages the cache holds count towards the request; a split model checks each device's pool; the
        ranks of a tensor-parallel model refuse together, on the fewest pages any rank has available. A model
        offloaded without a device map is not checked (logged once), or refused where ``admission_check`` is ``True``.

        Args:
            num_rows: rows the request runs (batch size x beams or returned sequences).
            num_tokens: tokens each row may hold at most.
            device / dtype: where the cache's pool lives (bound now if it was not).
        """
        binder = self._binder
        placed_devices = binder.placement.devices_for(device)
        if not placed_devices and self.cache_config.admission_check is None:  # the default: checked where it can be
            _log_unchecked_admission()
            return
        if not placed_devices:
            raise IncompatibleModelError(
                "admission_check=True cannot check this request: the model's parameters are offloaded (on meta) "
                "without a device map, so which device's pool its layers use is known at their first write only. "
                "Load the model with a device_map (from_pretrained(..., device_map=...)) or pass admission_check=False."
            )
        for placed in placed_devices:
            binder.bind(placed, dtype)
            parts: dict[KVPool, list[int]] = {}  # the layer groups drawing from each part of the pool
            for idx in binder.layer_groups_on(placed):
                parts.setdefault(binder.part_of(idx, placed), []).append(idx)
            for pool, groups in parts.items():
                self._admit(pool, groups, num_rows, num_tokens, placed)

    def _admit(self, pool: KVPool, groups: list[int], num_rows: int, num_tokens: int, placed: torch.device) -> None:
        """``check_admission`` on one pool (a part of a ``KVPoolSet``) for the layer groups drawing from it."""
        binder = self._binder
        page_size = pool.format.page_size
        worst = self._worst_pages(groups, num_rows, num_tokens, page_size)
        held = sum(1 for held_pool, _ in self._held_pages() if held_pool is pool.pages)
        requested = worst - held
        available = agree([pool.pages.num_available_pages], binder.placement.process_group, placed)[0]
        if requested > available:
            capacity = pool.capacity_pages
            retry = "" if requested > capacity else "Retry once requests in flight have given pages back, or: "
            raise PoolExhaustedError(
                requested,
                available,
                capacity,
                f"admission_check refused the request before any compute: {num_rows} rows of up to "
                f"{num_tokens} tokens need up to {worst} pages of {page_size} tokens in "
                f"{len(groups)} layer group(s) on {placed}. {retry}lower the batch "
                "size, num_beams/num_return_sequences or max_new_tokens, or give the pool more room "
                "(KVPool.for_model(..., max_tokens=...) or cache_config max_tokens); admission_check=False lets "
                "the request start and fail when a page it needs is not free.",
            )
