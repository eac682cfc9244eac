"""Measuring a benchmark's machine and writing its record: resident memory, peak memory over a block, the CPU other
processes took, the ``--device``/``--dtype``/``--threads`` options, the checks every benchmark config shares, and
the JSON record a benchmark script writes.

Benchmarks are only as good as the machine was quiet and the record says what it was; these helpers are shared by
the decode benchmark (``decode``), the ring update micro-benchmark (``ring_update``) and the soak (``soak``). The
versions and hardware of a record come from ``hf_kvcache.eval.environment``, the one function that says them for
every report.
"""

import argparse
import dataclasses
import gc
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import psutil
import torch
from transformers import Cache

from hf_kvcache.caches.base import PoolCache

Result = TypeVar("Result")


def rss_bytes() -> int:
    """Resident memory of this process now, in bytes (``/proc/self/statm``, else ``psutil``)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return psutil.Process().memory_info().rss


class PeakMemory:
    """Context manager measuring peak memory growth over a block, in bytes (``peak_bytes`` after exit).

    Args:
        device: CUDA uses the allocator's peak statistics; any other device samples the process RSS (``rss_bytes``).
        interval_s: seconds between RSS samples.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.002) -> None:
        self.device = device
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._base = 0
        self._peak = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = self._peak = rss_bytes()
            self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, rss_bytes())
        self.peak_bytes = max(0, peak - self._base)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, rss_bytes())


class OtherCpuUse:
    """Context manager measuring the CPU time other processes used during a block (``other_cores`` after exit).

    On a shared machine a benchmark's timings are only as good as the machine was quiet; this says how quiet.

    Attributes:
        wall_s: seconds the block took.
        other_cpu_s: CPU-seconds of all processes minus this one's (children included) over the block.
        other_cores: ``other_cpu_s / wall_s``, the mean number of cores others kept busy.
    """

    def __init__(self) -> None:
        self._process = psutil.Process()
        self.wall_s = self.other_cpu_s = self.other_cores = 0.0

    def _busy_s(self) -> tuple[float, float, float]:
        machine = psutil.cpu_times()
        own = self._process.cpu_times()
        busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
        return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system

    def __enter__(self) -> "OtherCpuUse":
        self._start = self._busy_s()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        end = self._busy_s()
        self.wall_s = end[0] - self._start[0]
        self.other_cpu_s = max(0.0, (end[1] - self._start[1]) - (end[2] - self._start[2]))
        self.other_cores = self.other_cpu_s / self.wall_s if self.wall_s > 0 else 0.0


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_machine_args(parser: argparse.ArgumentParser) -> None:
    """The ``--device``, ``--dtype`` and ``--threads`` options every benchmark script takes."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's). On a machine shared with other jobs, 1 avoids timing the OS "
        "scheduler: a parallel op waits for a descheduled worker thread",
    )


def machine_settings(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """Applies ``--threads`` and returns the ``(device, dtype)`` of ``add_machine_args``' options."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return torch.device(args.device), DTYPES[args.dtype]


def run_interleaved(
    names: Sequence[str], rounds: int, build: Callable[[str], Cache], run: Callable[[str, Cache], Result]
) -> dict[str, list[Result]]:
    """Runs every cache ``rounds`` times, interleaved (``A B C A B C ...``), so that slow drifts of the machine hit
    every cache alike.

    Each run gets a fresh cache, ``build(name)``; ``run(name, cache)`` measures it. Our caches give their pages
    back right after their run (the next run of a ring finds them consecutive again) and memory is collected
    before the next cache is built.

    Returns:
        Each cache's ``rounds`` results, in round order.
    """
    results: dict[str, list[Result]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            cache = build(name)
            results[name].append(run(name, cache))
            if isinstance(cache, PoolCache):
                cache.release()
            del cache
            gc.collect()
    return results


def check_settings(config: Any, sequences: dict[str, int]) -> None:
    """The checks every benchmark config shares: each field named in ``sequences`` is a non-empty sequence of ints
    at least the given low, ``steps`` and ``rounds`` are at least 1, and ``warmup_steps`` at least 0.

    Raises:
        ValueError: naming the field and the value.
    """
    for name, low in sequences.items():
        values = getattr(config, name)
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values):
            raise ValueError(f"{name} must be a non-empty sequence of ints >= {low}, got {values!r}.")
    for name in ("steps", "rounds"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}.")
    if config.warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {config.warmup_steps}.")


def results_record(
    results: Sequence[Any], config: Any, machine: dict[str, Any], extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON-ready record of one benchmark invocation: machine, settings, ``extra`` entries, then the results
    (dataclasses, one per measurement)."""
    return {
        "machine": machine,
        "config": dataclasses.asdict(config),
        **(extra or {}),
        "results": [dataclasses.asdict(result) for result in results],
    }


def write_record(record: dict[str, Any], output: Path, others: OtherCpuUse, table: str) -> None:
    """Adds the run's wall time and the CPU other processes took to ``record``, writes it to ``output`` as JSON, and
    prints ``table`` (the results in Markdown) and where the record went."""
    record["wall_s"] = round(others.wall_s, 1)
    # Timings are only as good as the machine was quiet: CPU time other processes took during the run.
    record["other_processes_cores"] = round(others.other_cores, 3)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2) + "\n")
    print(table)
    print(
        f"\nWall time {record['wall_s']} s; other processes kept {others.other_cores:.2f} cores busy on average; "
        f"record written to {output}."
    )
