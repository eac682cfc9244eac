"""A shared store of prefix pages on a Redis server (or Valkey: the same protocol), fail-open.

Pages go to the server as ``SET key value NX`` (a page's contents never change once published, so the first writer
wins and later ones cost nothing) and come back with one ``MGET`` per lookup. Keys and values are made by
``hf_kvcache.memory.tiers`` (``store_key``, ``encode_page``): the key hashes everything that computes a page, the
value carries its key, its page format and a checksum, so a value that is not exactly the page asked for is never
served (and is deleted, so that the page recomputed takes its place). Eviction is the server's: run it with
``maxmemory`` and ``maxmemory-policy allkeys-lru``.

The client speaks the server's protocol (RESP2) over a plain socket, so that the core needs no client package: four
commands (``AUTH``, ``SELECT``, ``MGET``, ``SET``, ``DEL``), each waiting ``timeout`` seconds at most.

Fail-open: a server that is down, slow (past the timeout) or answers with an error never fails a request. The first
failure of each kind is logged once; every one is counted (``errors``), and the store is then left alone for
``STORE_RETRY_S`` seconds, so that a dead server costs a request at most one timeout and then nothing until it is
tried again.
"""

import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger("hf_kvcache")

STORE_SCHEMES = ("redis", "rediss", "unix")
STORE_TIMEOUT_S = 0.5
"""Seconds a connect or a reply may take before the store counts as down (``?timeout=`` in the URL sets another)."""
STORE_RETRY_S = 5.0
"""Seconds the store is left alone after a failure before it is tried again."""
DEFAULT_PORT = 6379
MAX_IDLE_CONNECTIONS = 8


class StoreError(Exception):
    """The server answered with an error, or with something that is not the protocol."""


@dataclass(frozen=True)
class StoreAddress:
    """Where a store is and how to log in (``parse_store_url``)."""

    host: str
    port: int
    unix_path: str | None
    tls: bool
    db: int
    username: str | None
    password: str | None
    timeout: float
    display: str  # the URL without its password


def parse_store_url(url: str, setting: str = "prefix_store") -> StoreAddress:
    """Reads ``redis://[user:password@]host[:port][/db][?timeout=seconds]`` (``rediss://``: TLS;
    ``unix:///path/to.sock[?db=0]``).

    Raises:
        TypeError: ``url`` is not a string; ValueError: not such a URL (both name ``setting`` and the value).
    """
    if not isinstance(url, str):
        raise TypeError(f"{setting} must be a URL string such as 'redis://localhost:6379/0', got {url!r}.")
    example = "give 'redis://host:port/db' (or rediss://host:port/db, unix:///path/to.sock)"
    parts = urlsplit(url)
    if parts.scheme not in STORE_SCHEMES or not (parts.hostname or parts.path):
        raise ValueError(f"{setting}={url!r} is not a Redis URL: {example}.")
    query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    try:
        port = parts.port or DEFAULT_PORT
        db = int(query.get("db", parts.path.lstrip("/") if parts.scheme != "unix" else 0) or 0)
        timeout = float(query.get("timeout", STORE_TIMEOUT_S))
    except ValueError as error:
        raise ValueError(f"{setting}={url!r}: {error}; {example}.") from None
    if db < 0 or not timeout > 0:
        raise ValueError(f"{setting}={url!r}: the db must be >= 0 and the timeout > 0 seconds.")
    display = url if parts.password is None else url.replace(f":{parts.password}@", ":***@", 1)
    return StoreAddress(
        host=parts.hostname or "localhost",
        port=port,
        unix_path=parts.path if parts.scheme == "unix" else None,
        tls=parts.scheme == "rediss",
        db=db,
        username=parts.username,
        password=parts.password,
        timeout=timeout,
        display=display,
    )


class Connection:
    """One connection to the server, logged in and on its db; ``call`` sends one command and reads its reply."""

    def __init__(self, address: StoreAddress) -> None:
        if address.unix_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(address.timeout)
            sock.connect(address.unix_path)
        else:
            sock = socket.create_connection((address.host, address.port), timeout=address.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if address.tls:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=address.host)
        sock.settimeout(address.timeout)
        self._sock = sock
        self._reader = sock.makefile("rb")
        try:
            if address.password is not None:
                login = [address.username] if address.username else []
                self.call(b"AUTH", *login, address.password)
            if address.db:
                self.call(b"SELECT", address.db)
        except BaseException:
            self.close()
            raise

    def call(self, *args: bytes | str | int) -> object:
        """Sends one command; returns its reply (bytes, int, ``None`` or a list of them).

        Raises:
            StoreError: an error reply. OSError (``TimeoutError`` among them): the connection failed.
        """
        parts = [arg if isinstance(arg, bytes) else str(arg).encode() for arg in args]
        command = [b"*%d\r\n" % len(parts)]
        for part in parts:
            command += [b"$%d\r\n" % len(part), part, b"\r\n"]
        self._sock.sendall(b"".join(command))
        return self._read()

    def _read(self) -> object:
        line = self._reader.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionResetError("the server closed the connection")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise StoreError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            data = self._reader.read(size + 2)
            if len(data) != size + 2:
                raise ConnectionResetError("the server closed the connection")
            return data[:-2]
        if kind == b"*":
            size = int(rest)
            return None if size < 0 else [self._read() for _ in range(size)]
        raise StoreError(f"not a reply of the Redis protocol: {line[:32]!r}")

    def close(self) -> None:
        self._reader.close()
        self._sock.close()


class RedisStore:
    """One server's connections (a few kept idle), used from any thread; every call is fail-open.

    Args:
        url: ``parse_store_url``'s URL.

    Attributes:
        url: the URL without its password (what logs and ``stats()`` show).
        errors: calls that failed (down, slow, an error answer).
    """

    def __init__(self, url: str) -> None:
        self._address = parse_store_url(url)
        self.url = self._address.display
        self._lock = threading.Lock()
        self._idle: list[Connection] = []
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
        reply = self._call("read", b"MGET", *keys) if keys else None
        if not isinstance(reply, list) or len(reply) != len(keys):
            return [None] * len(keys)
        return [value if isinstance(value, bytes) else None for value in reply]

    def put(self, key: bytes, value: bytes) -> bool:
        """Sets ``key`` unless the server has it; False if the store is down or failed."""
        return self._call("write", b"SET", key, value, b"NX") is not FAILED

    def delete(self, keys: list[bytes]) -> None:
        """Removes ``keys`` (values that failed their checks, so that a good page can take their place)."""
        if keys:
            self._call("write", b"DEL", *keys)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def _call(self, what: str, *args: bytes) -> object:
        """One command on an idle connection (or a new one); ``FAILED`` if the store is down or the call fails."""
        if not self.is_up:
            return FAILED
        with self._lock:
            connection = self._idle.pop() if self._idle else None
        try:
            if connection is None:
                connection = Connection(self._address)
            reply = connection.call(*args)
        except (OSError, StoreError, ValueError) as error:  # ValueError: a reply's length that is not a number
            if connection is not None:
                connection.close()  # a connection that failed mid-reply cannot be trusted again
            self._fail(what, error)
            return FAILED
        with self._lock:
            if len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(connection)
                connection = None
        if connection is not None:
            connection.close()
        return reply

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


FAILED = object()
"""``RedisStore._call``'s answer when the store is down or the call failed."""
