"""The shared prefix store on a real Redis server (``hf_kvcache.memory.store``, ``prefix_store``): two processes share
a prompt through it, and it fails open: a server killed mid-request, frozen, or unreachable never fails a request, and
a damaged value or a page of another model or page format is never served.

Each test starts its own ``redis-server`` on a loopback port (``.ci/run`` installs it). The tests skip only where the
binary cannot be found, and never on CI (``CI`` set), where a missing server fails them."""

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_kvcache import KVPool, PagedConfig
from hf_kvcache.memory import store as store_module
from hf_kvcache.testing import tiny_llama
from tests.helpers import random_ids

ROOT = Path(__file__).parents[1]
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
PAGE_SIZE = 4
PROMPT = 36  # 9 pages; a lookup reuses 8 (the last token is fed)


def redis_server_binary() -> str:
    """The ``redis-server`` to start: ``$REDIS_SERVER``, or the one on the PATH (or /usr/bin, /usr/sbin)."""
    found = os.environ.get("REDIS_SERVER") or shutil.which("redis-server", path=f"{os.environ['PATH']}:/usr/sbin")
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("redis-server is not installed; .ci/run installs it (apt-get install redis-server).")
    pytest.skip("redis-server not found (apt-get install redis-server, or set REDIS_SERVER to the binary)")


class RedisServer:
    """A ``redis-server`` process on a free loopback port, without persistence, evicting least recently used keys."""

    def __init__(self, binary: str, password: str | None = None) -> None:
        self.binary = binary
        self.port = free_port()
        self.password = password
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        import redis

        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        command += ["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no"]
        command += ["--requirepass", self.password] if self.password else []
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1, password=self.password)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)
        self.client = client

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def keys(self) -> set[bytes]:
        return set(self.client.keys("hf_kvcache:page:*"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def started(password: str | None = None):
    if not os.environ.get("CI"):
        pytest.importorskip("redis")
    running = RedisServer(redis_server_binary(), password)
    yield running
    if running.process is not None and running.process.poll() is None:
        os.kill(running.process.pid, signal.SIGCONT)  # a test may have frozen it
    running.kill()


@pytest.fixture
def server():
    yield from started()


@pytest.fixture
def locked_server():
    """A server that wants a password."""
    yield from started("s3cret")


@pytest.fixture
def quick_retry(monkeypatch):
    """The store is tried again 0.2 s after a failure (5 s otherwise), so that a test can watch it come back."""
    monkeypatch.setattr(store_module, "STORE_RETRY_S", 0.2)


def store_pool(model, url: str, max_tokens: int = 256) -> KVPool:
    return KVPool.for_model(model, PagedConfig(page_size=PAGE_SIZE), max_tokens=max_tokens, prefix_store=url)


def greedy(model, ids, pool: KVPool, max_new_tokens: int = 4, **kwargs):
    out = model.generate(
        ids,
        cache_implementation="paged_pool",
        cache_config={"pool": pool},
        do_sample=False,
        max_new_tokens=max_new_tokens,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
    return out.sequences, out.logits


def fresh(model, ids):
    """The generation on a pool without a prefix index: one plain prefill."""
    return greedy(model, ids, KVPool.for_model(model, max_tokens=512))


def assert_same(reference, candidate):
    assert torch.equal(reference[0], candidate[0])
    for step, (expected, actual) in enumerate(zip(reference[1], candidate[1], strict=True)):
        torch.testing.assert_close(actual, expected, **TOLERANCE, msg=f"logits differ at step {step}")


def published(model, ids, url: str) -> KVPool:
    """A pool on the store that generated ``ids`` and wrote its pages to the server."""
    pool = store_pool(model, url)
    greedy(model, ids, pool)
    assert pool.pages.flush_tiers()
    return pool


SECOND_PROCESS = """
import json, sys, torch
from hf_kvcache.testing import tiny_llama
model = tiny_llama()
ids = torch.randint(1, 128, (1, {length}), generator=torch.Generator().manual_seed({seed}))
config = {{"prefix_store": sys.argv[1], "max_tokens": 512, "page_size": {page_size}}}
out = model.generate(ids, cache_implementation="paged_pool", cache_config=config, do_sample=False, max_new_tokens=4,
                     return_dict_in_generate=True)
stats = out.cache.prefix.pool.stats()
print(json.dumps({{"sequences": out.sequences.tolist(), "hits": stats["prefix_hits_store"],
                  "reused": stats["prefix_tokens_reused"]}}))
"""  # exits without flushing: a process that exits waits for its pages to reach the store


def run_second_process(url: str, seed: int) -> dict:
    script = SECOND_PROCESS.format(length=PROMPT, seed=seed, page_size=PAGE_SIZE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script, url], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_processes_share_a_prompt_through_the_store(server):
    """A worker process generates; this process, with a pool of its own, reuses the worker's prompt pages."""
    first = run_second_process(server.url, seed=5)
    assert first["hits"] == 0 and first["reused"] == 0
    assert len(server.keys()) == PROMPT // PAGE_SIZE  # every full page of the prompt and answer: 40 tokens, 9 pages
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=5)
    pool = store_pool(model, server.url)
    candidate = greedy(model, ids, pool)
    assert_same(fresh(model, ids), candidate)
    assert candidate[0].tolist() == first["sequences"]
    stats = pool.stats()
    assert stats["prefix_hits_store"] == 8 and stats["prefix_tokens_reused"] == 32
    assert stats["prefix_bytes_restored"] == 8 * stats["page_bytes"]
    assert 8 * stats["page_bytes"] < stats["prefix_store_bytes_read"] < 8 * (stats["page_bytes"] + 1024)  # + headers
    assert stats["prefix_store_errors"] == stats["prefix_pages_rejected"] == 0
    second = run_second_process(server.url, seed=5)  # the worker again, in a new process: a warm store
    assert second["hits"] == 8 and second["sequences"] == first["sequences"]


def test_pages_come_from_the_pool_first_and_are_written_once(server):
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=1)
    pool = published(model, ids, server.url)
    writes = pool.stats()["prefix_store_writes"]
    assert writes == len(server.keys()) == 9
    greedy(model, ids, pool)  # found in the pool: nothing read from or written to the store
    assert pool.pages.flush_tiers()
    stats = pool.stats()
    assert stats["prefix_hits_device"] == 8 and stats["prefix_hits_store"] == 0
    assert stats["prefix_store_writes"] == writes


@pytest.mark.parametrize("other", ["model", "page format"])
def test_pages_of_another_model_or_page_format_are_never_served(server, other, caplog):
    """Other weights or another dtype key their pages apart; a value of the first model copied under the other's
    key (a store that mixed them up) is refused by what the value says it is, and recomputed."""
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=2)
    published(model, ids, server.url)
    ours = server.keys()
    other_model = tiny_llama(seed=7) if other == "model" else tiny_llama().to(torch.bfloat16)
    pool = published(other_model, ids, server.url)
    assert pool.stats()["prefix_hits_store"] == 0  # keyed apart: nothing of the first model was found
    theirs = server.keys() - ours
    assert len(theirs) == 9
    for key, source in zip(sorted(theirs), sorted(ours)):  # the first model's values under the other's keys
        server.client.set(key, server.client.get(source))
    candidate_pool = store_pool(other_model, server.url)
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        candidate = greedy(other_model, ids, candidate_pool)
    assert_same(fresh(other_model, ids), candidate)
    stats = candidate_pool.stats()
    assert stats["prefix_hits_store"] == 0 and stats["prefix_tokens_reused"] == 0
    assert stats["prefix_pages_rejected"] == 8  # the pages of the 32 tokens a lookup could reuse
    reason = "a page of other tokens, model or layer group" if other == "model" else "a page of another page format"
    assert sum(f"was not served: {reason}" in record.message for record in caplog.records) == 1
    assert candidate_pool.pages.flush_tiers()
    again = store_pool(other_model, server.url)  # the refused values were replaced by the pages recomputed
    assert_same(candidate, greedy(other_model, ids, again))
    assert again.stats()["prefix_hits_store"] == 8 and again.stats()["prefix_pages_rejected"] == 0


def test_a_damaged_value_is_never_served_and_is_replaced(server, caplog):
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=3)
    published(model, ids, server.url)
    damaged = sorted(server.keys())[4]  # one page of the nine, whichever token page it holds
    value = bytearray(server.client.get(damaged))
    server.client.setrange(damaged, len(value) // 2, bytes([value[len(value) // 2] ^ 0x10]))
    broken = server.client.get(damaged)
    assert broken != bytes(value)
    pool = store_pool(model, server.url)
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        candidate = greedy(model, ids, pool)
    assert_same(fresh(model, ids), candidate)
    stats = pool.stats()
    assert stats["prefix_pages_rejected"] == 1
    assert 0 <= stats["prefix_hits_store"] < 8  # the pages before the damaged one at most
    assert sum("the checksum does not match" in record.message for record in caplog.records) == 1
    assert pool.pages.flush_tiers()
    repaired = server.client.get(damaged)
    assert repaired is not None and repaired != broken  # deleted, then written again by the prefill
    again = store_pool(model, server.url)
    assert_same(candidate, greedy(model, ids, again))
    assert again.stats()["prefix_hits_store"] == 8 and again.stats()["prefix_pages_rejected"] == 0


class KillAt(StoppingCriteria):
    """Kills the server at the ``step``-th decode step of a generation (and never stops it)."""

    def __init__(self, server: "RedisServer", step: int) -> None:
        self.server, self.step, self.calls = server, step, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.step:
            self.server.kill()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_server_killed_mid_request_never_fails_a_request(server, quick_retry, caplog):
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=4)
    pool = store_pool(model, server.url)
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        candidate = greedy(
            model, ids, pool, max_new_tokens=8, stopping_criteria=StoppingCriteriaList([KillAt(server, 2)])
        )
        assert pool.pages.flush_tiers()
        reference = greedy(model, ids, KVPool.for_model(model, max_tokens=512), max_new_tokens=8)
        assert_same(reference, candidate)
        other = random_ids(1, PROMPT, seed=40)  # a lookup and its writes while the server is down
        assert_same(fresh(model, other), greedy(model, other, store_pool(model, server.url)))
    errors = pool.stats()["prefix_store_errors"]
    assert errors >= 1
    assert sum("The prefix store" in record.message for record in caplog.records) <= 2  # once per kind (read, write)
    server.start()  # back, empty, on the same port: the store is used again once STORE_RETRY_S has passed
    time.sleep(0.3)
    again = store_pool(model, server.url)
    greedy(model, ids, again)
    assert again.pages.flush_tiers()
    assert again.stats()["prefix_store_writes"] == 9 and len(server.keys()) == 9


def test_a_frozen_server_times_out_and_the_request_goes_on(server, caplog):
    """A server that stops answering (SIGSTOP) costs a lookup one timeout; the request is served without it."""
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=6)
    published(model, ids, server.url)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        pool = store_pool(model, server.url)
        with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
            candidate = greedy(model, ids, pool)
        assert_same(fresh(model, ids), candidate)
        stats = pool.stats()
        assert stats["prefix_hits_store"] == 0 and stats["prefix_store_errors"] >= 1
        assert any("Timeout" in record.message for record in caplog.records)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def test_an_unreachable_store_fails_open_and_is_logged_once(caplog):
    model = tiny_llama()
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    pool = store_pool(model, url)
    ids = random_ids(1, PROMPT, seed=8)
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        for _ in range(2):
            assert_same(fresh(model, ids), greedy(model, ids, pool))
    assert pool.stats()["prefix_store_errors"] >= 1
    assert sum(url in record.message for record in caplog.records) == 1


def test_a_server_with_a_password_and_another_db(locked_server, caplog):
    model = tiny_llama()
    ids = random_ids(1, PROMPT, seed=10)
    url = f"redis://:s3cret@127.0.0.1:{locked_server.port}/3"
    first = published(model, ids, url)
    assert first.stats()["prefix_store"] == f"redis://:***@127.0.0.1:{locked_server.port}/3"  # never the password
    assert first.stats()["prefix_store_writes"] == 9 and first.stats()["prefix_store_errors"] == 0
    assert not locked_server.keys()  # db 0 holds nothing: the pages are in db 3
    locked_server.client.execute_command("SELECT", 3)
    assert len(locked_server.keys()) == 9
    again = store_pool(model, url)
    greedy(model, ids, again)
    assert again.stats()["prefix_hits_store"] == 8
    wrong = store_pool(model, f"redis://:wrong@127.0.0.1:{locked_server.port}/3")
    with caplog.at_level(logging.WARNING, logger="hf_kvcache"):
        assert_same(fresh(model, ids), greedy(model, ids, wrong))
    assert wrong.stats()["prefix_hits_store"] == 0 and wrong.stats()["prefix_store_errors"] >= 1
    assert any("WRONGPASS" in record.message and "wrong" not in record.message for record in caplog.records)


@pytest.mark.parametrize(
    "url,expected",
    [
        ("redis://localhost", ("localhost", 6379, None, False, 0, None, None, 0.5)),
        ("redis://u:p@h:7000/2?timeout=1.5", ("h", 7000, None, False, 2, "u", "p", 1.5)),
        ("rediss://h:7000/0", ("h", 7000, None, True, 0, None, None, 0.5)),
        ("unix:///run/redis.sock?db=4", ("localhost", 6379, "/run/redis.sock", False, 4, None, None, 0.5)),
    ],
)
def test_store_urls(url, expected):
    address = store_module.parse_store_url(url)
    fields = ("host", "port", "unix_path", "tls", "db", "username", "password", "timeout")
    assert tuple(getattr(address, name) for name in fields) == expected
    assert "p@" not in address.display


def test_the_tiers_benchmark_reuses_from_the_store_and_host_memory_and_matches(server):
    """scripts/bench_prefix.py --tiers on a tiny model: structure, reuse and equal tokens (timings are not checked)."""
    from hf_kvcache.bench.prefix_tiers import TierBenchConfig, markdown_table, results_record, run_tier_benchmark

    config = TierBenchConfig(prefix_tokens=32, question_tokens=8, new_tokens=3, num_questions=3, page_size=4)
    model = tiny_llama()
    stream = random_ids(1, config.tokens_needed, seed=12)[0]
    results = run_tier_benchmark(model, stream, dataclasses.replace(config, store=server.url))
    by_mode = {(r.part, r.mode): r for r in results}
    assert list(by_mode) == [("store", "cold"), ("store", "warm"), ("host", "recompute"), ("host", "host")]
    assert by_mode["store", "cold"].tokens_reused_per_question == 0
    assert by_mode["store", "warm"].tokens_reused_per_question == 32  # the document's 8 pages
    assert by_mode["host", "recompute"].tokens_reused_per_question == 0
    assert by_mode["host", "host"].tokens_reused_per_question == 32
    page_bytes = store_pool(model, server.url).stats()["page_bytes"]
    assert by_mode["host", "host"].bytes_moved_per_reused_token == page_bytes / PAGE_SIZE
    assert page_bytes / PAGE_SIZE < by_mode["store", "warm"].bytes_moved_per_reused_token < 2 * page_bytes / PAGE_SIZE
    assert by_mode["store", "warm"].tokens_match and by_mode["host", "host"].tokens_match
    assert all(r.questions_timed == 2 and r.median_ttft_ms > 0 for r in results)
    assert len(markdown_table(results).splitlines()) == 2 + 4
    record = json.loads(json.dumps(results_record(results, config, {"device": "cpu"})))
    assert record["config"]["store"] is None and len(record["results"]) == 4
