"""Measuring the machine a benchmark runs on: peak memory over a block, CPU other processes took.

Versions and hardware for a record: ``hf_kvcache.eval.environment``.

Benchmarks are only as good as the machine was quiet and the record says what it was; these helpers are
shared by the decode benchmark (``hf_kvcache.bench``) and the ring update micro-benchmark (``hf_kvcache.bench_ring``).
"""

import argparse
import threading
import time
from types import TracebackType

import psutil
import torch


class PeakMemory:
    """Context manager measuring peak memory growth over a block, in bytes (``peak_bytes`` after exit).

    Args:
        device: CUDA uses the allocator's peak statistics; any other device samples the process RSS.
        interval_s: seconds between RSS samples.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.002) -> None:
        self.device = device
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._process = psutil.Process()
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
            self._base = self._peak = self._process.memory_info().rss
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
            peak = max(self._peak, self._process.memory_info().rss)
        self.peak_bytes = max(0, peak - self._base)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, self._process.memory_info().rss)


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
