"""How much memory a device gives the default pools (``MemoryBudget``), and how it commits it: on the CPU, only where
touched (``commits_lazily``), so a default pool reserves its cap once and commits only the pages it opens.
"""

import os
import threading

import torch

CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
"""Where a container's memory limit is read (cgroup v2, then v1)."""


def commits_lazily(device: torch.device) -> bool:
    """Whether memory reserved on ``device`` is only committed where it is touched (the CPU's, through the OS)."""
    return device.type == "cpu"


def memory_limit_bytes() -> int:
    """Bytes of RAM this process may use: the physical memory, or the container's cgroup limit where it is lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_MEMORY_LIMITS:
        try:
            with open(path) as file:
                value = file.read().strip()
        except OSError:
            continue
        if value.isdigit():  # "max" (v2) means no limit; v1 writes a huge number instead
            limit = min(limit, int(value))
    return limit


def check_fits(setting: str, num_bytes: int, device: torch.device) -> None:
    """Refuses a pool of ``num_bytes`` that ``device`` could never hold, before anything is allocated.

    Args:
        setting: what asked for it, as the user wrote it (e.g. ``"max_tokens=1000000000"``).

    Raises:
        ValueError: naming ``setting``, the bytes it needs and what the device has.
    """
    if device.type == "cuda":
        available, what = torch.cuda.get_device_properties(device).total_memory, f"{device}'s total memory"
    else:
        available, what = memory_limit_bytes(), "the RAM this process may use"
    if num_bytes > available:
        raise ValueError(
            f"{setting} needs {num_bytes:,} bytes of pages, but {device} has {available:,} bytes ({what}); lower it."
        )


class MemoryBudget:
    """Bytes that the default pools of one device may hold together, whatever their page formats."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.used_bytes = 0
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes

    def reserve(self, num_bytes: int) -> bool:
        """Takes ``num_bytes`` of the budget if it has them; False (and nothing taken) otherwise."""
        with self._lock:
            if num_bytes > self.free_bytes:
                return False
            self.used_bytes += num_bytes
            return True

    def limit_to(self, total_bytes: int) -> None:
        """Lowers the cap to ``total_bytes`` (never raises it), but not below the bytes already held."""
        with self._lock:
            self.total_bytes = max(self.used_bytes, min(self.total_bytes, total_bytes))
