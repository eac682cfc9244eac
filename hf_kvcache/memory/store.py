"""A shared store of prefix pages on a Redis server (or Valkey: the same protocol), fail-open.

Pages go to the server as ``SET key value NX`` (a page's contents never change once published, so the first writer
wins and later ones cost nothing) and come back with one ``MGET`` per lookup. Keys and values are made by
``hf_kvcache.memory.tiers`` (``store_key``, ``encode_page``): the key hashes everything that computes a page, the
value carries its key, its page format and a checksum, so a value that is not exactly the page asked for is never
served. Eviction is the server's: run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru``.

Fail-open: a server that is down, slow (``socket_timeout``) or answers with an error never fails a request. The
first failure of each kind is logged once; every one is counted (``errors``), and the store is then left alone for
``STORE_RETRY_S`` seconds, so a dead server costs a request at most one timeout and then nothing until it is tried
again.
"""

import logging
import threading
import time
from urllib.parse import urlsplit

from hf_kvcache.errors import MissingExtraError

logger = logging.getLogger("hf_kvcache")

STORE_SCHEMES = ("redis", "rediss", "unix")
STORE_TIMEOUT_S = 0.5
"""Seconds a connect or a read may take before the store counts as down (``?socket_timeout=`` in the URL wins)."""
STORE_RETRY_S = 5.0
"""Seconds the store is left alone after a failure before it is tried again."""


def check_store_url(url: str, setting: str = "prefix_store") -> str:
    """Returns ``url`` if it names a Redis server (``redis://host:port/db``, ``rediss://``, ``unix://``), else raises
    a ``ValueError`` (``TypeError`` for a non-string) naming ``setting`` and the value."""
    if not isinstance(url, str):
        raise TypeError(f"{setting} must be a URL string such as 'redis://localhost:6379/0', got {url!r}.")
    parts = urlsplit(url)
    if parts.scheme not in STORE_SCHEMES or not (parts.netloc or parts.path):
        raise ValueError(
            f"{setting}={url!r} is not a Redis URL: give 'redis://host:port/db' (or rediss://, unix://path)."
        )
    return url


class RedisStore:
    """One Redis server's connections, used from any thread; every call is fail-open.

    Args:
        url: ``redis://host:port/db`` (``check_store_url``); query arguments (``?socket_timeout=2``) reach the client.

    Attributes:
        url: the URL.
        errors: calls that failed (down, slow, an error answer).
    """

    def __init__(self, url: str) -> None:
        self.url = check_store_url(url)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ModuleNotFoundError as error:
            raise MissingExtraError("store", "prefix_store (a shared store of prompt pages)", error.name) from error
        self._errors_of = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=STORE_TIMEOUT_S,
            socket_connect_timeout=STORE_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),  # a failure is a miss: no retry adds to a request's time
        )
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._logged: set[str] = set()
        self.errors = 0

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, errors={self.errors})"

    @property
    def is_up(self) -> bool:
        """False for ``STORE_RETRY_S`` seconds after a failure (calls then do nothing)."""
        return time.monotonic() >= self._down_until

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """The value of each key (``None``: absent, or the store is down)."""
        if not keys or not self.is_up:
            return [None] * len(keys)
        try:
            return list(self._client.mget(keys))
        except self._errors_of as error:
            self._fail("read", error)
            return [None] * len(keys)

    def put(self, key: bytes, value: bytes) -> bool:
        """Sets ``key`` unless the server has it; False if the store is down or failed."""
        if not self.is_up:
            return False
        try:
            self._client.set(key, value, nx=True)
            return True
        except self._errors_of as error:
            self._fail("write", error)
            return False

    def delete(self, keys: list[bytes]) -> None:
        """Removes ``keys`` (values that failed their checks, so that a good page can take their place)."""
        if not keys or not self.is_up:
            return
        try:
            self._client.delete(*keys)
        except self._errors_of as error:
            self._fail("write", error)

    def _fail(self, what: str, error: Exception) -> None:
        with self._lock:
            self.errors += 1
            self._down_until = time.monotonic() + STORE_RETRY_S
            kind = f"{what}:{type(error).__name__}"
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            logger.warning(
                "The prefix store %s failed a %s (%s: %s); prompts are served without it for %.0f s at a time. "
                "Counted in pool.stats()['prefix_store_errors']; logged once.",
                *(self.url, what, type(error).__name__, error, STORE_RETRY_S),
            )
