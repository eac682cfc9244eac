"""A shared store of prefix pages on a Redis server or a Redis Cluster (or Valkey), fail-open.

Pages go as ``SET key value NX`` (a published page never changes: the first writer wins) and come back with one
pipelined ``GET`` per page. Keys and values are ``page_bytes``' (``store_key``, ``encode_page``): a value that is not
exactly the page asked for is never served, and is deleted. Eviction is the server's (``maxmemory-policy
allkeys-lru``). The client speaks RESP2 over a plain socket, so the core needs no client package.

A cluster (``redis+cluster://host:port,host:port``) is served by hash slot (``key_slot``): the slot map is read from
the first node that answers, every node gets all its commands before any reply is read (a lookup waits for the
slowest node, not their sum), and ``MOVED``/``ASK`` are followed once. A single server is a cluster of one node.

Fail-open: a node that is down, slow (past ``timeout``) or answers an error never fails a request: its keys read as
absent, the failure is counted (``errors``) and logged once per kind, and the node is left alone for
``STORE_RETRY_S`` seconds (a cluster's map is read again first).
"""

import binascii
import dataclasses
import logging
import socket
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger("hf_kvcache")

STORE_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
STORE_TIMEOUT_S = 0.5
"""Seconds a connect or a reply may take before the node counts as down (``?timeout=`` in the URL sets another)."""
STORE_RETRY_S = 5.0
"""Seconds a node is left alone after a failure before it is tried again."""
DEFAULT_PORT = 6379
MAX_IDLE_CONNECTIONS = 8
"""Idle connections kept per node."""
NUM_SLOTS = 16384
"""A Redis Cluster's hash slots: a key lives on the node serving ``key_slot(key)``."""

Node = tuple[str, int]
"""A node's host and port."""
Command = tuple[bytes, ...]


class StoreError(Exception):
    """The server answered with an error, or with something that is not the protocol."""


class ReplyError(StoreError):
    """An error the server answered (``-ERR ...``, ``-MOVED ...``): the connection is still in step."""


@dataclass(frozen=True)
class StoreAddress:
    """Where a store is and how to log in (``parse_store_url``); ``host`` and ``port`` are the first of ``nodes``."""

    host: str
    port: int
    unix_path: str | None
    tls: bool
    db: int
    username: str | None
    password: str | None
    timeout: float
    display: str  # the URL without its password
    cluster: bool = False
    nodes: tuple[Node, ...] = ()


def parse_store_url(url: str) -> StoreAddress:
    """Reads ``redis://[user:password@]host[:port][/db][?timeout=seconds]`` (``rediss://``: TLS;
    ``unix:///path/to.sock[?db=0]``; a cluster: ``redis+cluster://[user:password@]host:port[,host:port...]``,
    ``rediss+cluster://``, db 0 only); ``TypeError`` or ``ValueError`` naming ``prefix_store`` otherwise."""
    if not isinstance(url, str):
        raise TypeError(f"prefix_store must be a URL string such as 'redis://localhost:6379/0', got {url!r}.")
    example = "give 'redis://host:port/db' (or rediss://host:port/db, unix:///path/to.sock, a cluster's nodes as "
    example += "redis+cluster://host:port,host:port)"
    parts = urlsplit(url)
    cluster = parts.scheme.endswith("+cluster")
    if parts.scheme not in STORE_SCHEMES or not (parts.netloc or parts.path):
        raise ValueError(f"prefix_store={url!r} is not a Redis URL: {example}.")
    query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    try:
        hosts = [urlsplit(f"//{host}") for host in parts.netloc.rpartition("@")[2].split(",")]
        nodes = tuple((host.hostname or "localhost", host.port or DEFAULT_PORT) for host in hosts)
        db = int(query.get("db", parts.path.lstrip("/") if parts.scheme != "unix" else 0) or 0)
        timeout = float(query.get("timeout", STORE_TIMEOUT_S))
    except ValueError as error:
        raise ValueError(f"prefix_store={url!r}: {error}; {example}.") from None
    if db < 0 or not timeout > 0:
        raise ValueError(f"prefix_store={url!r}: the db must be >= 0 and the timeout > 0 seconds.")
    if cluster and not all(host.hostname for host in hosts):
        raise ValueError(f"prefix_store={url!r}: a node without a host; {example}.")
    if cluster and db:
        raise ValueError(f"prefix_store={url!r}: a Redis Cluster has db 0 only; leave the db out of the URL.")
    if not cluster and len(nodes) > 1:
        raise ValueError(f"prefix_store={url!r} names several servers: for a cluster's nodes write redis+cluster://.")
    display = url if parts.password is None else url.replace(f":{parts.password}@", ":***@", 1)
    return StoreAddress(
        host=nodes[0][0],
        port=nodes[0][1],
        unix_path=parts.path if parts.scheme == "unix" else None,
        tls=parts.scheme.startswith("rediss"),
        db=db,
        username=parts.username,
        password=parts.password,
        timeout=timeout,
        display=display,
        cluster=cluster,
        nodes=nodes,
    )


def key_slot(key: bytes) -> int:
    """A Redis Cluster's hash slot of ``key``: CRC16 (XMODEM) of the key, or of its first non-empty ``{hash tag}``,
    modulo ``NUM_SLOTS``. ``binascii.crc_hqx`` is that CRC (``crc_hqx(b"123456789", 0) == 0x31C3``)."""
    start = key.find(b"{")
    end = key.find(b"}", start + 1) if start >= 0 else -1
    if end > start + 1:
        key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % NUM_SLOTS


class Connection:
    """One connection to a server, logged in and on its db; ``send`` commands, then ``receive`` their replies."""

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
        """Sends one command; returns its reply (bytes, int, ``None`` or a list of them) or raises it (``ReplyError``).
        Raises ``StoreError`` (not the protocol) and ``OSError`` (the connection failed) too."""
        self.send([args])
        reply = self.receive(1)[0]
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    def send(self, commands: list[tuple[bytes | str | int, ...]]) -> None:
        """Sends ``commands`` at once (their replies come back in order)."""
        out = []
        for args in commands:
            parts = [arg if isinstance(arg, bytes) else str(arg).encode() for arg in args]
            out.append(b"*%d\r\n" % len(parts))
            for part in parts:
                out += [b"$%d\r\n" % len(part), part, b"\r\n"]
        self._sock.sendall(b"".join(out))

    def receive(self, count: int) -> list[object]:
        """The next ``count`` replies; an error reply comes back as a ``ReplyError`` in its place."""
        return [self._read() for _ in range(count)]

    def _read(self) -> object:
        line = self._reader.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionResetError("the server closed the connection")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest
        if kind == b"-":
            return ReplyError(rest.decode(errors="replace"))
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
    """A server's or a cluster's connections (a few kept idle per node), used from any thread, every call fail-open.
    ``url``: without its password; ``errors``: calls failed, per node; ``redirections``: ``MOVED``/``ASK`` followed."""

    def __init__(self, url: str) -> None:
        self._address = parse_store_url(url)
        self.url = self._address.display
        self._lock = threading.Lock()
        self._idle: dict[Node, list[Connection]] = {}
        self._down_until: dict[Node, float] = {}
        self._slots: list[Node | None] | None = None  # a cluster's node for each hash slot, once read
        self._stale = self._address.cluster  # the slot map is to be read before the next call
        self._logged: set[str] = set()
        self.errors = 0
        self.redirections: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, errors={self.errors})"

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """The value of each key (``None``: absent, or its node is down)."""
        replies = self._run("read", [(key, (b"GET", key)) for key in keys])
        return [value if isinstance(value, bytes) else None for value in replies]

    def put(self, key: bytes, value: bytes) -> bool:
        """Sets ``key`` unless the server has it; False if its node is down or failed."""
        return self._run("write", [(key, (b"SET", key, value, b"NX"))])[0] is not FAILED

    def delete(self, keys: list[bytes]) -> None:
        """Removes ``keys`` (values that failed their checks, so that a good page can take their place)."""
        self._run("write", [(key, (b"DEL", key)) for key in keys])

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for connection in (connection for connections in idle.values() for connection in connections):
            connection.close()

    def _run(self, what: str, commands: list[tuple[bytes, Command]]) -> list[object]:
        """Each ``(key, command)`` on the node serving its key, then once more where that node redirected it;
        the replies in order, ``FAILED`` where a node was down, failed, or redirected a command twice."""
        if self._stale and commands:
            self._read_slot_map()
        replies: list[object] = [FAILED] * len(commands)
        pending = {index: (self._node_of(key), False) for index, (key, _) in enumerate(commands)}  # node, asking
        for attempt in range(2):
            batches: dict[Node, list[int]] = {}
            for index, (node, _) in pending.items():
                if node is not None and self._is_up(node):
                    batches.setdefault(node, []).append(index)
            sent: dict[Node, list[Command]] = {}
            for node, indices in batches.items():
                sent[node] = []
                for index in indices:
                    sent[node] += [(b"ASKING",), commands[index][1]] if pending[index][1] else [commands[index][1]]
            answers = self._exchange(what, sent)
            redirected = {}
            for node, indices in batches.items():
                if answers[node] is FAILED:
                    continue
                node_answers, error = iter(answers[node]), None
                for index in indices:
                    if pending[index][1]:
                        next(node_answers)  # ASKING's OK
                    answer = next(node_answers)
                    target = self._redirection(answer, node) if attempt == 0 else None
                    if target is not None:
                        redirected[index] = target
                    elif isinstance(answer, ReplyError):
                        error = error or answer
                    else:
                        replies[index] = answer
                if error is not None:
                    self._fail(what, error, node)
            pending = redirected
        return replies

    def _node_of(self, key: bytes) -> Node | None:
        if not self._address.cluster:
            return self._address.host, self._address.port
        slots = self._slots
        return slots[key_slot(key)] if slots is not None else None

    def _redirection(self, answer: object, node: Node) -> tuple[Node, bool] | None:
        """Where a cluster's ``MOVED`` or ``ASK`` answer sends its command, and whether ``ASKING`` goes first."""
        if not (self._address.cluster and isinstance(answer, ReplyError)):
            return None
        kind, slot, target = (str(answer).split(" ") + ["", ""])[:3]
        host, _, port = target.rpartition(":")
        if kind not in ("MOVED", "ASK") or not (slot.isdigit() and port.isdigit()):
            return None
        target_node = (host or node[0], int(port))  # an empty host: the one the answer came from
        with self._lock:
            self.redirections[kind] += 1
            if kind == "MOVED" and self._slots is not None:
                self._slots[int(slot) % NUM_SLOTS] = target_node
                self._stale = True  # a slot moved: others likely did too
        return target_node, kind == "ASK"

    def _read_slot_map(self) -> None:
        """Reads a cluster's slot map from the first node that answers: the URL's, then those the map named."""
        with self._lock:
            known = {node for node in self._slots or () if node is not None}
        for node in [*self._address.nodes, *sorted(known - set(self._address.nodes))]:
            if not self._is_up(node):
                continue
            answer = self._exchange("read of the slot map", {node: [(b"CLUSTER", b"SLOTS")]})[node]
            if answer is FAILED:
                continue
            slots: list[Node | None] = [None] * NUM_SLOTS
            try:
                if isinstance(answer[0], ReplyError):
                    raise answer[0]
                for start, end, (host, port, *_), *_replicas in answer[0]:  # the master first, then its replicas
                    host = host.decode() if host not in (b"", b"?") else node[0]
                    slots[start : end + 1] = [(host, port)] * (end + 1 - start)
            except (StoreError, TypeError, ValueError, UnicodeDecodeError) as error:
                self._fail("read of the slot map", error, node)
                continue
            with self._lock:
                self._slots, self._stale = slots, False
            return

    def _exchange(self, what: str, batches: dict[Node, list[Command]]) -> dict[Node, list[object] | object]:
        """Sends each node its commands, all before reading any reply, then reads them: a node's replies, or
        ``FAILED`` where it failed (counted, and the node left alone for a while)."""
        sent: dict[Node, Connection] = {}
        for node, commands in batches.items():
            with self._lock:
                idle = self._idle.get(node)
                connection = idle.pop() if idle else None
            try:
                if connection is None:
                    connection = Connection(dataclasses.replace(self._address, host=node[0], port=node[1]))
                connection.send(commands)
                sent[node] = connection
            except (OSError, StoreError, ValueError) as error:
                if connection is not None:
                    connection.close()
                self._fail(what, error, node)
        answers: dict[Node, list[object] | object] = dict.fromkeys(batches, FAILED)
        for node, connection in sent.items():
            try:
                answers[node] = connection.receive(len(batches[node]))
            except (OSError, StoreError, ValueError) as error:  # ValueError: a reply's length that is not a number
                connection.close()  # a connection that failed mid-reply cannot be trusted again
                self._fail(what, error, node)
                continue
            with self._lock:
                idle = self._idle.setdefault(node, [])
                kept = len(idle) < MAX_IDLE_CONNECTIONS
                if kept:
                    idle.append(connection)
            if not kept:
                connection.close()
        return answers

    def _is_up(self, node: Node) -> bool:
        """False for ``STORE_RETRY_S`` seconds after the node failed (its keys then read as absent)."""
        return time.monotonic() >= self._down_until.get(node, 0.0)

    def _fail(self, what: str, error: Exception, node: Node) -> None:
        cluster = self._address.cluster
        with self._lock:
            self.errors += 1
            self._down_until[node] = time.monotonic() + STORE_RETRY_S
            self._stale = cluster  # the node may have been replaced: read the map again before the next call
            kind = f"{what}:{type(error).__name__}"
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            where = f" (node {node[0]}:{node[1]})" if cluster else ""
            hint = ""
            if not cluster and str(error).startswith(("MOVED", "ASK", "CLUSTERDOWN")):
                hint = " The server is a cluster's node: name the cluster as redis+cluster://host:port,..."
            logger.warning(
                "The prefix store %s%s failed a %s (%s: %s); prompts are served without that server for %.0f s "
                "at a time. Counted in pool.stats()['prefix_store_errors']; logged once.%s",
                *(self.url, where, what, type(error).__name__, error, STORE_RETRY_S, hint),
            )


FAILED = object()
"""``RedisStore._run``'s answer where a node is down or its call failed."""
