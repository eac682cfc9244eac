"""The shared prefix store on a real Redis Cluster (``prefix_store="redis+cluster://host:port,..."``): two processes
share a prompt through it with its pages on every node, a slot migrated between nodes mid-run is followed (``ASK``,
then ``MOVED``), and a node killed or frozen mid-run, or the whole cluster down (``CLUSTERDOWN``), never
fails a request, the other nodes still serving their pages where they can.

Each test starts its own cluster: three ``redis-server --cluster-enabled yes`` masters on loopback ports, the slots
split evenly (``CLUSTER ADDSLOTSRANGE``) and joined by ``CLUSTER MEET``. The tests skip only where the binary cannot
be found, and never on CI (``CI`` set), where a missing server fails them."""

import logging
import os
import re
import signal
import subprocess
import time
from collections import Counter

import pytest
import torch
from transformers import StoppingCriteriaList

from hf_kvcache import KVPool
from hf_kvcache.memory import store as store_module
from hf_kvcache.memory.store import NUM_SLOTS, RedisStore, key_slot, parse_store_url
from hf_kvcache.testing import tiny_llama
from tests.helpers import random_ids
from tests.test_prefix_store import (
    PAGE_SIZE,
    PROMPT,
    KillAt,
    assert_same,
    free_port,
    fresh,
    greedy,
    published,
    redis_server_binary,
    run_second_process,
    store_pool,
)

NUM_NODES = 3


class ClusterNode:
    """One master of the test cluster: a ``redis-server`` on a loopback port, its cluster bus on another."""

    def __init__(self, binary: str, directory: str) -> None:
        self.binary, self.directory = binary, directory
        self.port, self.bus_port = free_port(), free_port()
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Starts the server (again: its nodes file keeps its place in the cluster; its keys are gone)."""
        import redis

        command = [self.binary, "--port", str(self.port), "--cluster-port", str(self.bus_port), "--bind", "127.0.0.1"]
        command += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
        command += ["--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no", "--dir", self.directory]
        command += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        command += ["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port, socket_timeout=2)
        wait_for(self.client.ping, f"redis-server on port {self.port}", alive=lambda: self.process.poll() is None)

    def command(self, *args: object) -> object:
        """A command's raw reply (``CLUSTER`` and its subcommand as two words: no reply parsing)."""
        return self.client.execute_command(*args)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)  # a test may have frozen it
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def keys(self) -> set[bytes]:
        return set(self.command("KEYS", "hf_kvcache:page:*"))


class RedisCluster:
    """``NUM_NODES`` masters, each serving an even share of the slots, that all know each other."""

    def __init__(self, binary: str, directory: str) -> None:
        self.nodes = [ClusterNode(binary, directory) for _ in range(NUM_NODES)]
        for index, node in enumerate(self.nodes):
            first, last = NUM_SLOTS * index // NUM_NODES, NUM_SLOTS * (index + 1) // NUM_NODES - 1
            node.command("CLUSTER", "ADDSLOTSRANGE", first, last)
            node.command("CLUSTER", "SET-CONFIG-EPOCH", index + 1)
        for node in self.nodes[1:]:
            self.nodes[0].command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
        self.ids = {node.port: node.command("CLUSTER", "MYID").decode() for node in self.nodes}
        self.wait_until_joined()
        self.url = f"redis+cluster://127.0.0.1:{self.nodes[0].port},127.0.0.1:{self.nodes[1].port}"

    def wait_until_joined(self) -> None:
        """Until every node says the cluster is ok and maps every slot to a node that is up."""

        def joined() -> bool:
            for node in self.nodes:
                info = node.command("CLUSTER", "INFO").decode()
                ranges = node.command("CLUSTER", "SLOTS")
                if "cluster_state:ok" not in info or f"cluster_known_nodes:{NUM_NODES}" not in info:
                    return False
                if len(ranges) != NUM_NODES or "fail" in node.command("CLUSTER", "NODES").decode():
                    return False
            return True

        wait_for(joined, "the cluster to join")

    def node(self, port: int) -> ClusterNode:
        return next(node for node in self.nodes if node.port == port)

    def keys_by_port(self) -> dict[int, set[bytes]]:
        return {node.port: node.keys() for node in self.nodes}

    def begin_migration(self, slot: int, source: ClusterNode, target: ClusterNode, keys: list[bytes]) -> None:
        """``slot`` migrating from ``source`` to ``target``, ``keys`` moved already: ``source`` answers ``ASK``."""
        target.command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.ids[source.port])
        source.command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.ids[target.port])
        source.command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)

    def end_migration(self, slot: int, target: ClusterNode) -> None:
        """``slot`` served by ``target``, as every node knows: the others answer ``MOVED``."""
        for node in [target, *(node for node in self.nodes if node is not target)]:
            node.command("CLUSTER", "SETSLOT", slot, "NODE", self.ids[target.port])


def wait_for(check, what: str, alive=lambda: True, seconds: float = 20) -> None:
    """Calls ``check`` until it returns true without raising a connection error (or ``alive()`` turns false)."""
    import redis

    deadline = time.monotonic() + seconds
    while True:
        try:
            if check():
                return
        except redis.ConnectionError:
            pass
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def cluster(tmp_path):
    if not os.environ.get("CI"):
        pytest.importorskip("redis")
    binary = redis_server_binary()
    running = RedisCluster(binary, str(tmp_path))
    yield running
    for node in running.nodes:
        node.kill()


@pytest.fixture
def quick_retry(monkeypatch):
    """A node is tried again 0.2 s after a failure (5 s otherwise), so that a test can watch it come back."""
    monkeypatch.setattr(store_module, "STORE_RETRY_S", 0.2)


def the_store(pool: KVPool) -> RedisStore:
    return pool.pages.tiers.store


def logged_kinds(records) -> Counter:
    """How often each kind of store failure (what failed, the error's type) was logged."""
    found = (re.search(r"failed a (.+?) \((\w+):", record.message) for record in records)
    return Counter(match.groups() for match in found if match)


@pytest.mark.parametrize(
    "key,slot",
    [
        (b"123456789", 0x31C3),  # the CRC16 (XMODEM) check value of the Redis Cluster spec, below 16384
        (b"foo", 12182),
        (b"bar", 5061),
        (b"{user1000}.following", 3443),  # the hash tag alone: the slot of b"user1000"
        (b"foo{}{bar}", 8363),  # an empty tag: the whole key
        (b"foo{{bar}}zap", 4015),  # the first { to the first } after it: b"{bar"
        (b"foo{bar}{zap}", 5061),  # the first tag only: b"bar", as b"bar" itself
    ],
)
def test_key_slots_follow_the_cluster_spec(key, slot):
    assert key_slot(key) == slot


def test_key_slots_agree_with_a_real_cluster_and_pages_land_on_every_node(cluster):
    generator = torch.Generator().manual_seed(0)
    keys = [bytes(torch.randint(32, 127, (12,), generator=generator).tolist()) for _ in range(200)]
    keys += [b"{tag}" + key for key in keys[:20]] + [key + b"{}" for key in keys[:20]] + [b"123456789"]
    assert [key_slot(key) for key in keys] == [cluster.nodes[0].command("CLUSTER", "KEYSLOT", key) for key in keys]


def test_two_processes_share_a_prompt_through_a_cluster(cluster):
    """A worker process generates; its pages spread over the nodes by slot; this process reuses them all."""
    first = run_second_process(cluster.url, seed=5)
    assert first["hits"] == 0
    by_port = cluster.keys_by_port()
    assert sum(map(len, by_port.values())) == PROMPT // PAGE_SIZE and all(by_port.values())  # 9 pages, on every node
    for node in cluster.nodes:  # each where the cluster itself puts it
        assert {node.command("CLUSTER", "COUNTKEYSINSLOT", key_slot(key)) for key in by_port[node.port]} == {1}
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=5)
    pool = store_pool(model, cluster.url)
    candidate = greedy(model, ids, pool)
    assert_same(fresh(model, ids), candidate)
    assert candidate[0].tolist() == first["sequences"]
    stats = pool.stats()
    assert stats["prefix_hits_store"] == 8 and stats["prefix_tokens_reused"] == 32
    assert stats["prefix_store_errors"] == stats["prefix_pages_rejected"] == 0
    assert not the_store(pool).redirections
    second = run_second_process(cluster.url, seed=5)
    assert second["hits"] == 8 and second["sequences"] == first["sequences"]


def test_a_slot_migrated_mid_run_is_followed(cluster):
    """A worker keeps its store while the slots of one node's pages migrate to another: while they migrate the
    source answers ASK (followed with ASKING), once moved MOVED (followed, and the slot map read again)."""
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=21)
    published(model, ids, cluster.url)
    by_port = cluster.keys_by_port()
    source = max(cluster.nodes, key=lambda node: len(by_port[node.port]))
    target = next(node for node in cluster.nodes if node is not source)
    pool = store_pool(model, cluster.url)
    store = the_store(pool)
    reference = greedy(model, ids, pool)
    assert pool.pages.flush_tiers()
    assert pool.stats()["prefix_hits_store"] == 8 and not store.redirections

    def reused_again() -> int:
        """The store pages a lookup of the prompt found (the pool's own index emptied first)."""
        before = pool.stats()["prefix_hits_store"]
        pool.reset_prefix_index()
        assert_same(reference, greedy(model, ids, pool))
        assert pool.pages.flush_tiers()
        return pool.stats()["prefix_hits_store"] - before

    slots = sorted({key_slot(key) for key in by_port[source.port]})
    for slot in slots:
        cluster.begin_migration(slot, source, target, [key for key in by_port[source.port] if key_slot(key) == slot])
    assert not source.keys() and by_port[source.port] <= target.keys()
    assert reused_again() == 8
    assert store.redirections["ASK"] >= 1 and store.redirections["MOVED"] == 0
    for slot in slots:
        cluster.end_migration(slot, target)
    assert len(slots) >= 2
    first = min(by_port[source.port])
    assert store.get_many([first]) == [target.command("GET", first)]  # MOVED, followed
    assert store.redirections["MOVED"] == 1
    assert reused_again() == 8
    assert store.redirections["MOVED"] == 1  # the map was read again at once: the other slots moved are known
    assert pool.stats()["prefix_store_errors"] == 0
    assert pool.stats()["prefix_store_redirections"] == sum(store.redirections.values()) >= 2


def test_a_node_killed_mid_generate_never_fails_a_request(cluster, quick_retry, caplog):
    """One node killed at a decode step: every request's tokens are those of a run without a store, the other nodes
    still serve their pages, every failure is counted and each kind logged once; the node restarted is used again."""
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=22)
    published(model, ids, cluster.url)
    by_port = cluster.keys_by_port()
    victim = max(cluster.nodes, key=lambda node: len(by_port[node.port]))  # 3 of the 9 pages or more
    pool = store_pool(model, cluster.url)
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        candidate = greedy(
            model, ids, pool, max_new_tokens=8, stopping_criteria=StoppingCriteriaList([KillAt(victim, 2)])
        )
        assert pool.pages.flush_tiers()
        reference = greedy(model, ids, KVPool.for_model(model, max_tokens=512), max_new_tokens=8)
        assert_same(reference, candidate)
        assert pool.stats()["prefix_hits_store"] == 8  # looked up before the kill
        pool.reset_prefix_index()  # the prompt again, from the store with the victim's pages missing
        assert_same(fresh(model, ids), greedy(model, ids, pool))
        assert pool.stats()["prefix_hits_store"] < 16 and pool.stats()["prefix_store_errors"] >= 1
        other = random_ids(1, PROMPT, seed=41)  # a new prompt: a lookup and its writes with a node down
        assert_same(fresh(model, other), greedy(model, other, pool))
        assert pool.pages.flush_tiers()
        everything = sorted(key for keys in by_port.values() for key in keys)
        values = the_store(pool).get_many(everything)
        assert [value is not None for value in values] == [key not in by_port[victim.port] for key in everything]
    kinds = logged_kinds(caplog.records)
    assert kinds and set(kinds.values()) == {1}, kinds
    victim.start()  # back, empty, in its place in the cluster: used again once STORE_RETRY_S has passed
    cluster.wait_until_joined()
    time.sleep(0.3)
    pool.reset_prefix_index()
    greedy(model, ids, pool)
    assert pool.pages.flush_tiers()
    assert victim.keys() == by_port[victim.port]  # its pages written again


def test_a_frozen_node_times_out_and_the_others_still_serve(cluster, caplog):
    """A node that stops answering (SIGSTOP) costs a lookup one timeout; its keys read as absent, the others' are
    served, and the request is served as without a store."""
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=23)
    published(model, ids, cluster.url)
    by_port = cluster.keys_by_port()
    frozen = cluster.nodes[2]  # not one the URL names: the slot map still comes at once
    os.kill(frozen.process.pid, signal.SIGSTOP)
    try:
        pool = store_pool(model, cluster.url)
        with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
            candidate = greedy(model, ids, pool)
        assert_same(fresh(model, ids), candidate)
        assert pool.stats()["prefix_store_errors"] >= 1
        assert ("read", "TimeoutError") in logged_kinds(caplog.records)
        everything = sorted(key for keys in by_port.values() for key in keys)
        values = the_store(pool).get_many(everything)
        assert [value is not None for value in values] == [key not in by_port[frozen.port] for key in everything]
    finally:
        os.kill(frozen.process.pid, signal.SIGCONT)


def test_a_cluster_that_goes_down_fails_open(cluster, caplog):
    """Under the default ``cluster-require-full-coverage yes`` a master lost without a replica takes the cluster
    down: every node answers CLUSTERDOWN, which is counted and logged once, and requests go on without the store."""
    for node in cluster.nodes:
        node.command("CONFIG", "SET", "cluster-require-full-coverage", "yes")
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=26)
    published(model, ids, cluster.url)
    pool = store_pool(model, cluster.url)
    greedy(model, random_ids(1, PROMPT, seed=27), pool)  # the slot map read while the cluster is up
    lost, survivors = cluster.nodes[2], cluster.nodes[:2]
    lost.kill()
    wait_for(lambda: all(b"cluster_state:fail" in node.command("CLUSTER", "INFO") for node in survivors), "it to fail")
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        assert_same(fresh(model, ids), greedy(model, ids, pool))
    stats = pool.stats()
    assert stats["prefix_hits_store"] == 0 and stats["prefix_store_errors"] >= len(survivors)
    assert set(logged_kinds(caplog.records).values()) == {1}
    assert any("CLUSTERDOWN" in record.message for record in caplog.records)


def test_a_cluster_node_named_as_a_single_server_says_how_to_name_the_cluster(cluster, caplog):
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=24)
    published(model, ids, cluster.url)
    pool = store_pool(model, f"redis://127.0.0.1:{cluster.nodes[0].port}/0")
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        assert_same(fresh(model, ids), greedy(model, ids, pool))
    assert pool.stats()["prefix_store_errors"] >= 1
    assert any("MOVED" in record.message and "redis+cluster://" in record.message for record in caplog.records)


def test_an_unreachable_cluster_fails_open_and_is_logged_once(caplog):
    model = tiny_llama()
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"  # nothing listens there
    pool = store_pool(model, url)
    ids = random_ids(1, PROMPT, seed=25)
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        for _ in range(2):
            assert_same(fresh(model, ids), greedy(model, ids, pool))
    assert pool.stats()["prefix_store_errors"] >= 2  # both nodes tried
    assert logged_kinds(caplog.records) == {("read of the slot map", "ConnectionRefusedError"): 1}


@pytest.mark.parametrize(
    "url,nodes,tls,timeout",
    [
        ("redis+cluster://10.0.0.1:7000,10.0.0.2:7001", (("10.0.0.1", 7000), ("10.0.0.2", 7001)), False, 0.5),
        ("rediss+cluster://u:pw@a:7000,[::1]:7001/?timeout=0.2", (("a", 7000), ("::1", 7001)), True, 0.2),
        ("redis+cluster://a/0", (("a", 6379),), False, 0.5),
    ],
)
def test_cluster_urls(url, nodes, tls, timeout):
    address = parse_store_url(url)
    assert (address.cluster, address.nodes, address.tls, address.timeout, address.db) == (True, nodes, tls, timeout, 0)
    assert (address.host, address.port) == nodes[0]
    store = RedisStore(url)
    assert "pw" not in store.url and "pw" not in repr(store)


@pytest.mark.parametrize(
    "url,message",
    [
        ("redis+cluster://a:7000/2", "db 0 only"),
        ("redis://a:7000,b:7001", "redis+cluster://"),
        ("redis+cluster://a:7000,,b:7001", "a node without a host"),
        ("redis+cluster://a:70000", "out of range"),
        ("redis+cluster://", "is not a Redis URL"),
    ],
)
def test_bad_cluster_urls_name_the_setting(url, message):
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        parse_store_url(url)
    assert "prefix_store=" in str(raised.value)
