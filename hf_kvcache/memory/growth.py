"""A pool's storage and how it grows (``GrowingStorage``): how many page ids it may open (its cap, and the memory
budget it shares with other default pools), where it reserves its cap once (memory committed lazily: the CPU) and
where a growth moves the opened pages into a larger storage (CUDA), and ``fix``, which gives a moving storage one
that never moves for compiled decoding. Page ids and who holds them are the allocator's (``KVPool`` keeps both under
its lock and calls in here with the count of ids it has opened, the null page included).
"""

import logging

import torch

from hf_kvcache.memory.device_memory import MemoryBudget
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.storage import PoolStorage

logger = logging.getLogger("hf_kvcache")


class GrowingStorage:
    """The storage of one pool's page ids and its growth, up to ``max_pages`` ids and within ``budget`` if any.

    Args:
        num_ids: page ids opened first (the null page included); zeroed.
        reserves: reserve storage for ``max_pages`` now (halved until the device grants it), so that it never moves.
    """

    def __init__(
        self,
        page_format: PageFormat,
        device: torch.device,
        num_ids: int,
        max_pages: int,
        budget: MemoryBudget | None,
        reserves: bool,
    ) -> None:
        self.format = page_format
        self.device = device
        self.max_pages = max_pages
        self.budget = budget
        self.storage = self._reserve(num_ids) if reserves else self.new_storage(num_ids)
        self.zero_range(0, self._storage_pages(num_ids))

    @property
    def is_fixed(self) -> bool:
        """Whether the storage never moves: it holds every page id the pool may ever open (views of it stay valid)."""
        return self.storage.num_pages >= self.max_pages

    @property
    def can_fix(self) -> bool:
        """Whether ``fix`` may give it a storage that never moves: a default pool's (it has a memory budget) whose
        storage moves when it grows (CUDA's). A pool of the user's keeps the storage it was made with."""
        return not self.is_fixed and self.budget is not None

    def room(self, num_ids: int) -> int:
        """Page ids that can still open beyond ``num_ids``: up to ``max_pages``, within the memory budget if any."""
        room = self.max_pages - num_ids
        if self.budget is not None:
            room = min(room, self.budget.free_bytes // self.format.page_bytes)
        return max(0, room)

    def grow(self, num_ids: int, num_wanted: int) -> int:
        """Opens ids beyond ``num_ids`` in doublings, as often as needed for at least ``num_wanted`` more (within
        the room), moving the pages to a larger storage where it is not reserved. All or nothing.

        Returns:
            the ids opened (zeroed, in whole extents), 0 where it could not (no room, or the device refused).
        """
        room = self.room(num_ids)
        if room < num_wanted:
            return 0
        target = num_ids
        while target - num_ids < num_wanted:
            target = min(num_ids + room, 2 * target)
        num_bytes = (target - num_ids) * self.format.page_bytes
        if self.budget is not None and not self.budget.reserve(num_bytes):
            return 0  # another default pool of this device took the room meanwhile
        if target > self.storage.num_pages:  # not reserved: move the pages to a larger storage
            try:
                larger = self.new_storage(target)
            except (RuntimeError, MemoryError) as error:  # torch's out-of-memory errors are RuntimeErrors
                if self.budget is not None:
                    self.budget.release(num_bytes)
                logger.warning("KV pool on %s could not grow by %d bytes: %s", self.device, num_bytes, error)
                return 0
            self._move_to(larger, num_ids)
        self.zero_range(num_ids, self._storage_pages(target))  # whole extents: attention reads them whole
        return target - num_ids

    def fix(self, num_ids: int) -> bool:
        """Gives a moving default pool's storage one that never moves, for compiled decoding (a CUDA graph replays
        over fixed addresses): storage for the ``num_ids`` it holds and half the room left in its memory budget
        (the other half stays for the default pools of other formats, which fix theirs in turn), taken now (halved
        until the device grants it) and drawn from the budget at once. Later growths open ids (zeroed) without
        moving them; its cap is what it took. Logged.

        Returns:
            whether the storage is fixed now.
        """
        if self.is_fixed or not self.can_fix:
            return self.is_fixed
        half = self.budget.free_bytes // 2 // self.format.page_bytes
        target = num_ids + max(0, min(self.max_pages - num_ids, half))
        while True:
            try:
                larger = self.new_storage(target)
                break
            except (RuntimeError, MemoryError) as error:  # torch's out-of-memory errors are RuntimeErrors
                logger.warning("KV pool on %s could not take %d pages (%s).", self.device, target, error)
                if target == num_ids:
                    return False  # not even the pages it holds: it keeps its storage (the steps run eager)
                target = num_ids + (target - num_ids) // 2
        if not self.budget.reserve((target - num_ids) * self.format.page_bytes):
            return False  # another default pool of this device took the room meanwhile
        self._move_to(larger, num_ids)
        self.max_pages, self.budget = target, None  # its bytes are all drawn from the budget already
        logger.warning(
            "KV pool on %s took its cap, %d pages (%.1f MiB: half the default pools' budget left), in a storage "
            "that never moves, so that generate can compile its decode steps (a CUDA graph replays over fixed "
            "addresses). Pass cache_config max_tokens for a fixed pool of another size, or "
            "generate(disable_compile=True) to keep the default pool growing.",
            *(self.device, target, target * self.format.page_bytes / 2**20),
        )
        return True

    def new_storage(self, num_ids: int) -> PoolStorage:
        """Uninitialized storage for ``num_ids`` page ids (committed where touched only, on the CPU)."""
        return PoolStorage.empty(self.format, self._storage_pages(num_ids), self.device)

    def zero_range(self, start: int, end: int) -> None:
        for tensor in self.storage.tensors:
            tensor[:, :, start:end].zero_()

    def _storage_pages(self, num_ids: int) -> int:
        """Storage page ids for ``num_ids`` opened ones: whole extents (attention reads whole blocks)."""
        extent = self.format.extent_pages
        return -(-num_ids // extent) * extent

    def _reserve(self, num_ids: int) -> PoolStorage:
        """Storage for the cap (halved until the device grants it, never below ``num_ids``)."""
        while True:
            try:
                return self.new_storage(self.max_pages)
            except (RuntimeError, MemoryError) as error:  # torch's out-of-memory errors are RuntimeErrors
                if self.max_pages // 2 < num_ids:
                    raise
                logger.warning(
                    "KV pool on %s could not reserve %d pages (%s); trying half.", self.device, self.max_pages, error
                )
                self.max_pages //= 2

    def _move_to(self, larger: PoolStorage, num_ids: int) -> None:
        """Copies the first ``num_ids`` page ids into ``larger`` and makes it the storage (under the pool's lock)."""
        for old, new in zip(self.storage.tensors, larger.tensors):
            new[:, :, :num_ids].copy_(old[:, :, :num_ids])
        self.storage = larger
