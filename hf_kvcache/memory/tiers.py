"""Tiers behind a pool's prefix index (``PageTiers``, the pool's ``pages.tiers``): where its pages go when the index
evicts them, and where a lookup finds them again::

    device pool (prefix index) --evicted--> host memory (HostTier, prefix_host_bytes)
                                              --pushed out--> a local directory (DiskTier, prefix_disk_dir)
    published pages ------------------------------------> a shared store (RedisStore, prefix_store)

A lookup that misses the index asks the tiers, fastest first, for the longest prefix they hold; the pool writes those
pages back and publishes them before the prefill attaches them. Host memory keeps ``PageData``; the directory and the
store keep checked bytes (``encode_page``), and bytes that fail a check are counted (``rejected``) and read as a miss.
A page's tail (``prefix_index``) travels the same way under a key of its own (``tail_key``).

Writes to the directory and the store run on one background thread within ``MAX_PENDING_BYTES`` (past that a write
is dropped and counted); ``flush`` waits for them, and so does an exiting process (``FLUSH_AT_EXIT_S`` at most).
Lookups read synchronously, outside the pool's lock.
"""

import atexit
import contextlib
import logging
import os
import queue
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.page_bytes import (
    CorruptPage,
    PageData,
    TensorSpec,
    decode_page,
    encode_page,
    format_digest,
    store_key,
)
from hf_kvcache.memory.prefix_index import PageKey
from hf_kvcache.memory.store import RedisStore, parse_store_url

logger = logging.getLogger("hf_kvcache")

MAX_PENDING_BYTES = 256 * 2**20
"""Bytes of pages waiting for the background writer at most; a write past that is dropped (and counted)."""
FLUSH_AT_EXIT_S = 10.0
"""Seconds a process that exits waits for the pages its tiers are still writing."""
PAGE_SUFFIX = ".page"
TIERS = ("device", "host", "disk", "store")
NO_TIER_STATS: dict[str, Any] = {
    **dict.fromkeys(("prefix_host_pages", "prefix_host_bytes", "prefix_host_max_bytes"), 0),
    **dict.fromkeys(("prefix_disk_pages", "prefix_disk_bytes", "prefix_pages_spilled", "prefix_pages_dropped"), 0),
    "prefix_store": None,
    **dict.fromkeys(("prefix_store_writes", "prefix_store_errors", "prefix_pages_rejected"), 0),
    **dict.fromkeys(("prefix_store_bytes_read", "prefix_bytes_restored", "prefix_store_redirections"), 0),
}
"""``PageTiers.stats`` of a pool without tiers."""


@dataclass(frozen=True, repr=False)
class TierSettings:
    """Where a pool's prefix pages go besides the device (the ``prefix_*`` settings of ``cache_config`` and
    ``KVPool.for_model``).

    Attributes:
        host_bytes: host memory for pages the index evicts (0: none).
        disk_dir: a directory for pages pushed out of host memory (or evicted, without it), ``disk_bytes`` at most.
        store: a Redis URL that published pages also go to, shared between processes.
    """

    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int | None = None
    store: str | None = None

    def __post_init__(self) -> None:
        for name, value in (("prefix_host_bytes", self.host_bytes), ("prefix_disk_bytes", self.disk_bytes)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int of bytes, got {value!r} ({type(value).__name__}).")
            if value < 0:
                raise ValueError(f"{name}={value} is out of range: choose {name} >= 0.")
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, os.PathLike)):
                raise TypeError(f"prefix_disk_dir must be a directory path, got {self.disk_dir!r}.")
            if self.disk_bytes is None:
                raise ValueError(f"prefix_disk_dir={str(self.disk_dir)!r} needs a budget: set prefix_disk_bytes.")
        elif self.disk_bytes is not None:
            raise ValueError(f"prefix_disk_bytes={self.disk_bytes} without prefix_disk_dir: set the directory too.")
        if self.store is not None:
            parse_store_url(self.store)

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes) or self.disk_dir is not None or self.store is not None

    def __repr__(self) -> str:
        """The settings, the store's password left out (errors and logs show them)."""
        store = None if self.store is None else parse_store_url(self.store).display
        return (
            f"TierSettings(host_bytes={self.host_bytes}, disk_dir={self.disk_dir!r}, disk_bytes={self.disk_bytes}, "
            f"store={store!r})"
        )


class HostTier:
    """Pages in host memory, least recently used first out, within ``max_bytes``. Not thread-safe on its own."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._pages: OrderedDict[PageKey, PageData] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._pages)

    def get(self, key: PageKey) -> PageData | None:
        return self._pages.get(key)

    def put(self, key: PageKey, data: PageData) -> list[tuple[PageKey, PageData]]:
        """Keeps ``data`` as the most recently used page; returns the pages pushed out for room (oldest first; the
        page itself if it alone exceeds ``max_bytes``)."""
        if data.nbytes > self.max_bytes:
            return [(key, data)]
        old = self._pages.pop(key, None)
        if old is not None:
            self.num_bytes -= old.nbytes
        self._pages[key] = data
        self.num_bytes += data.nbytes
        pushed = []
        while self.num_bytes > self.max_bytes:
            oldest, page = self._pages.popitem(last=False)
            self.num_bytes -= page.nbytes
            pushed.append((oldest, page))
        return pushed

    def discard(self, key: PageKey) -> None:
        page = self._pages.pop(key, None)
        if page is not None:
            self.num_bytes -= page.nbytes

    def clear(self) -> None:
        self._pages.clear()
        self.num_bytes = 0


class DiskTier:
    """Pages as files in a local directory (``<store key>.page``), least recently written first out, within
    ``max_bytes`` (files found at start included: another process's or an earlier run's are served too). Its lock
    guards the counts, never a file's reading or writing."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"prefix_disk_dir={str(directory)!r} cannot be made ({error}); choose another.") from error
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        found = []
        for path in self.directory.glob(f"*{PAGE_SUFFIX}"):
            with contextlib.suppress(OSError):  # another process may remove a file meanwhile
                status = path.stat()
                found.append((status.st_mtime, path.name, status.st_size))
        self._sizes: OrderedDict[str, int] = OrderedDict((name, size) for _, name, size in sorted(found))
        self.num_bytes = sum(self._sizes.values())
        with self._lock:
            self._trim()

    def __len__(self) -> int:
        return len(self._sizes)

    def path(self, name: bytes) -> Path:
        return self.directory / (name.decode().rsplit(":", 1)[-1] + PAGE_SUFFIX)

    def read(self, name: bytes) -> bytes | None:
        try:
            return self.path(name).read_bytes()
        except OSError:
            return None

    def write(self, name: bytes, blob: bytes) -> None:
        """Writes a page's bytes (``OSError`` if the directory fails); a page it holds is only marked as used."""
        path = self.path(name)
        with self._lock:
            if path.name in self._sizes and path.exists():
                self._sizes.move_to_end(path.name)
                return
        temporary = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_bytes(blob)
        os.replace(temporary, path)  # readers see a whole file or none
        with self._lock:
            self.num_bytes += len(blob) - self._sizes.pop(path.name, 0)
            self._sizes[path.name] = len(blob)
            self._trim()

    def remove(self, name: bytes) -> None:
        path = self.path(name)
        with self._lock:
            self.num_bytes -= self._sizes.pop(path.name, 0)
            with contextlib.suppress(OSError):
                path.unlink()

    def clear(self) -> None:
        with self._lock:
            for name in list(self._sizes):
                with contextlib.suppress(OSError):
                    (self.directory / name).unlink()
            self._sizes.clear()
            self.num_bytes = 0

    def _trim(self) -> None:
        """Removes the oldest files until the rest fit ``max_bytes`` (under the lock)."""
        while self.num_bytes > self.max_bytes and self._sizes:
            name, size = self._sizes.popitem(last=False)
            self.num_bytes -= size
            with contextlib.suppress(OSError):
                (self.directory / name).unlink()


class PageTiers:
    """A pool's tiers (``TierSettings``) for pages of ``page_format`` whose tensors are ``specs`` (shape, dtype).
    Thread-safe: the pool calls ``spill`` and ``publish`` under its lock, lookups call ``fetch`` outside it."""

    def __init__(self, settings: TierSettings, page_format: PageFormat, specs: list[TensorSpec]) -> None:
        self.settings = settings
        self.digest = format_digest(page_format)
        self.specs = specs
        self.host = HostTier(settings.host_bytes) if settings.host_bytes else None
        self.disk = DiskTier(settings.disk_dir, settings.disk_bytes) if settings.disk_dir is not None else None
        self.store = RedisStore(settings.store) if settings.store is not None else None
        self._lock = threading.Lock()
        self._jobs: queue.Queue[tuple[Callable[[], None], int]] = queue.Queue()
        self._pending = 0  # bytes queued for the writer
        self._idle = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self.counts: Counter[str] = Counter()

    @property
    def keeps_evicted(self) -> bool:
        """Whether pages the index evicts go anywhere (host memory or the directory)."""
        return self.host is not None or self.disk is not None

    # ----- pages in --------------------------------------------------------------------------

    def spill(self, pages: list[tuple[PageKey, PageData]]) -> None:
        """Pages the index evicted, kept (``_keep``)."""
        with self._lock:
            self.counts["spilled"] += len(pages)
        self._keep(pages)

    def publish_tails(self, tails: list[tuple[PageKey, PageData]]) -> None:
        """Tails the index keeps beside published pages (under ``tail_key``): kept and published at once, as they
        outlive their page in the pool."""
        self._keep(tails)
        self.publish(tails)

    def _keep(self, pages: list[tuple[PageKey, PageData]]) -> None:
        """Into host memory, and what that pushes out (or everything, without host memory) to the directory."""
        with self._lock:
            host = self.host
            pushed = pages if host is None else [out for key, data in pages for out in host.put(key, data)]
        if self.disk is not None:
            for key, data in pushed:
                self._submit(lambda key=key, data=data: self._write_disk(key, data), data.nbytes)

    def publish(self, pages: list[tuple[PageKey, PageData]]) -> None:
        """Pages the index published: to the store (in the background)."""
        if self.store is not None:
            for key, data in pages:
                self._submit(lambda key=key, data=data: self._write_store(key, data), data.nbytes)

    # ----- pages out -------------------------------------------------------------------------

    def fetch(self, keys: list[PageKey], tails: bool = False) -> dict[PageKey, tuple[str, PageData]]:
        """The pages of ``keys`` the tiers hold (``tails``: the tails, their tensors unchecked), with the tier each
        came from (fastest first: host, disk, store). Damaged or foreign bytes are counted (``rejected``) and left
        out."""
        found: dict[PageKey, tuple[str, PageData]] = {}
        if self.host is not None:
            with self._lock:
                for key in keys:
                    data = self.host.get(key)
                    if data is not None:
                        found[key] = ("host", data)
        rest = [key for key in keys if key not in found]
        if self.disk is not None and rest:
            for key in rest:
                blob = self.disk.read(store_key(self.digest, key))
                data = self._decode("disk", key, blob, tails) if blob is not None else None
                if data is not None:
                    found[key] = ("disk", data)
            rest = [key for key in rest if key not in found]
        if self.store is not None and rest:
            names = [store_key(self.digest, key) for key in rest]
            rejected = []
            blobs = self.store.get_many(names)
            with self._lock:
                self.counts["store_bytes_read"] += sum(len(blob) for blob in blobs if blob is not None)
            for key, name, blob in zip(rest, names, blobs):
                data = self._decode("store", key, blob, tails) if blob is not None else None
                if data is not None:
                    found[key] = ("store", data)
                elif blob is not None:
                    rejected.append(name)
            self.store.delete(rejected)  # the page recomputed here then takes their place
        return found

    def restored(self, keys: list[PageKey], num_bytes: int) -> None:
        """Counts pages the pool brought back; they leave host memory (the index holds them again)."""
        with self._lock:
            self.counts["bytes_restored"] += num_bytes
            if self.host is not None:
                for key in keys:
                    self.host.discard(key)

    def clear(self) -> None:
        """Forgets the pages of host memory and of the directory (the store is shared: left as it is)."""
        self.flush()
        with self._lock:
            if self.host is not None:
                self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Waits until the background writes are done; False if ``timeout`` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stats(self) -> dict[str, Any]:
        """The tiers' counts for ``KVPool.stats`` (``stats.pool_stats`` says what each is)."""
        with self._lock:
            counts = self.counts
            return {
                "prefix_host_pages": len(self.host) if self.host is not None else 0,
                "prefix_host_bytes": self.host.num_bytes if self.host is not None else 0,
                "prefix_host_max_bytes": self.settings.host_bytes,
                "prefix_disk_pages": len(self.disk) if self.disk is not None else 0,
                "prefix_disk_bytes": self.disk.num_bytes if self.disk is not None else 0,
                "prefix_pages_spilled": counts["spilled"],
                "prefix_pages_dropped": counts["dropped"],
                "prefix_store": self.store.url if self.store is not None else None,
                "prefix_store_writes": counts["store_writes"],
                "prefix_store_errors": self.store.errors if self.store is not None else 0,
                "prefix_store_redirections": sum(self.store.redirections.values()) if self.store is not None else 0,
                "prefix_pages_rejected": counts["rejected"],
                "prefix_store_bytes_read": counts["store_bytes_read"],
                "prefix_bytes_restored": counts["bytes_restored"],
            }

    # ----- internals ---------------------------------------------------------------------------

    def _decode(self, tier: str, key: PageKey, blob: bytes, tails: bool = False) -> PageData | None:
        try:
            return decode_page(blob, self.digest, key, None if tails else self.specs)
        except CorruptPage as error:
            with self._lock:
                self.counts["rejected"] += 1
                first = self.counts[f"rejected_{tier}"] == 0
                self.counts[f"rejected_{tier}"] += 1
            if first:
                logger.warning(
                    "A prefix page from the %s tier was not served: %s. It is recomputed; counted in "
                    "pool.stats()['prefix_pages_rejected']; logged once.",
                    *(tier, error),
                )
            if tier == "disk" and self.disk is not None:
                self.disk.remove(store_key(self.digest, key))
            return None

    def _write_disk(self, key: PageKey, data: PageData) -> None:
        blob = encode_page(self.digest, key, data)
        try:
            self.disk.write(store_key(self.digest, key), blob)
        except OSError as error:
            with self._lock:
                first = self.counts["disk_errors"] == 0
                self.counts["disk_errors"] += 1
                self.counts["dropped"] += 1
            if first:
                logger.warning("Writing prefix pages to %s failed (%s); logged once.", self.disk.directory, error)

    def _write_store(self, key: PageKey, data: PageData) -> None:
        if self.store.put(store_key(self.digest, key), encode_page(self.digest, key, data)):
            with self._lock:
                self.counts["store_writes"] += 1

    def _submit(self, job: Callable[[], None], num_bytes: int) -> None:
        with self._lock:
            if self._pending + num_bytes > MAX_PENDING_BYTES:
                self.counts["dropped"] += 1
                return
            self._pending += num_bytes
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="hf_kvcache-tiers", daemon=True)
                self._writer.start()
                _WRITING.add(self)
        self._jobs.put((job, num_bytes))

    def _write_loop(self) -> None:
        while True:
            job, num_bytes = self._jobs.get()
            try:
                job()
            except Exception:  # a writer that dies would stop every later write: log and go on
                logger.exception("A background write of prefix pages failed.")
            finally:
                with self._idle:
                    self._pending -= num_bytes
                    self._idle.notify_all()


_WRITING: "weakref.WeakSet[PageTiers]" = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """Lets every live pool's tier writes land before the process exits (the writers are daemon threads)."""
    for tiers in list(_WRITING):
        tiers.flush(FLUSH_AT_EXIT_S)
