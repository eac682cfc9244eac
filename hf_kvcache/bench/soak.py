"""The soak: what a serving user does, for a while, in threads sharing pools; every output is checked against the
same request run alone, and memory stays flat.

Requests are drawn at random (seeded). Each names a registered cache (run with its entry's ``soak_config``), brings one
prompt (half of them) or 2 to ``max_batch`` left-padded ones, most starting with one of a few shared prefixes (system
prompts, which single prompts reuse) followed by a random tail, a ``max_new_tokens``, and a decoding mode: greedy, beam
search (2 beams, 2 returned sequences) or sampling (through transformers' sampler with ``top_k=1``, so that its output
can be checked). Some requests are oversized (64 beams of many tokens, whose worst case exceeds the whole pool:
admission must refuse them before any forward pass), and some get a failure injected at a random step (a logits
processor raises mid-generation).

``num_threads`` threads run the requests on one pool per page format, with prefix caching on, under the model's own
attention or ``attention="hf_kvcache"``. Each request that ran to its end is compared with its reference, the same
request run alone beforehand on a pool of its own without prefix caching: the same tokens, or it counts as wrong.
Outcomes are counted by kind (``SoakReport.outcomes``); an outcome that is not expected of a request (an error, a
wrong output, an oversized request that was not refused) is a failure. After the run every pool must hold no page
but the prefix index's cached ones, and no page table may be alive. ``scripts/soak.py`` runs it from the command line.
"""

import dataclasses
import gc
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_kvcache.attention.interface import model_attention
from hf_kvcache.bench.measure import rss_bytes
from hf_kvcache.errors import PoolExhaustedError
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.pool import KVPool

MODES = ("greedy", "beams", "sampling")
EXPECTED = {"ok", "refused_busy", "exhausted", "refused_oversized", "injected"}
"""Outcomes that are not failures: a request that ran and gave its reference's tokens; refused by admission because
the pool was busy, or run out of pages mid-generation (possible under pressure, each failing alone); an oversized
request refused; an injected failure that surfaced as the request's own error."""


class InjectedFailure(RuntimeError):
    """The failure the soak injects into a request mid-generation."""


class _FailAt(LogitsProcessor):
    """Raises ``InjectedFailure`` before the token of step ``step`` is picked (0: right after the prefill)."""

    def __init__(self, step: int) -> None:
        self.step, self.calls = step, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.calls == self.step:
            raise InjectedFailure(f"injected at step {self.step}")
        self.calls += 1
        return scores


@dataclass(frozen=True)
class SoakRequest:
    """One drawn request.

    Attributes:
        index: its place in the run.
        name: the registered cache name.
        input_ids / attention_mask: ``[rows, width]`` left-padded prompts.
        max_new_tokens: as ``generate``'s.
        mode: one of ``MODES``.
        oversized: its worst case exceeds the whole pool (admission must refuse it).
        fail_at: the step a failure is injected at, or ``None``.
    """

    index: int
    name: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int
    mode: str
    oversized: bool
    fail_at: int | None

    def generate_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": False}
        if self.oversized:  # many rows of many tokens: beyond the pool, a ring's layers too (bounded per row)
            return kwargs | {"min_new_tokens": self.max_new_tokens, "num_beams": 64, "num_return_sequences": 64}
        if self.mode == "beams":
            kwargs |= {"num_beams": 2, "num_return_sequences": 2}
        elif self.mode == "sampling":
            kwargs |= {"do_sample": True, "top_k": 1}
        if self.fail_at is not None:
            kwargs["logits_processor"] = LogitsProcessorList([_FailAt(self.fail_at)])
        return kwargs


@dataclass
class SoakReport:
    """Figures of one soak run.

    ``outcomes`` counts requests by outcome: ``ok``, ``wrong`` (other tokens than its reference), ``refused_busy``
    and ``refused_oversized`` (admission, before any forward pass), ``exhausted`` (out of pages mid-generation),
    ``injected``, ``not_refused`` (an oversized request that ran), ``error:<type>`` (anything else). ``failures``
    is the number of outcomes not expected of their request. RSS figures are bytes of resident memory, taken after
    the references (``rss_start_bytes``), at most while the threads run, and at the end.
    """

    num_requests: int
    num_threads: int
    attention: str
    outcomes: dict[str, int]
    failures: int
    failure_examples: list[str]
    prefix_hits: int
    prefix_tokens_reused: int
    tokens_generated: int
    pages_left: int  # pages held by anything but the prefix index after the run (a leak)
    live_tables: int  # page tables alive after the run (0 when every cache is gone)
    seconds: float
    requests_per_second: float
    rss_start_bytes: int
    rss_max_bytes: int
    rss_end_bytes: int
    pools: dict[str, dict[str, Any]]  # per pool: pages_total, high_water_pages, page_size, value_bits

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def soak_pools(model: torch.nn.Module, max_tokens: int, page_size: int) -> dict[str, KVPool]:
    """A fixed pool of ``max_tokens`` tokens per page format with a prefix index, for every registered cache name.

    Names whose caches store pages alike (``paged_pool``, ``sliding_ring``) share one pool.
    """
    made: dict[PageFormat, KVPool] = {}
    pools = {}
    for name, entry in REGISTRY.items():
        page_format = entry.config({**entry.soak_config, "page_size": page_size}).page_format(model.config, model.dtype)
        if page_format not in made:
            made[page_format] = KVPool(
                page_format, page_format.pages_for_tokens(max_tokens) + 1, model.device, prefix_caching=True
            )
        pools[name] = made[page_format]
    return pools


def draw_requests(
    model: torch.nn.Module,
    num_requests: int,
    max_tokens: int,
    page_size: int,
    max_batch: int,
    seed: int,
    oversized_share: float = 0.05,
    failure_share: float = 0.05,
) -> list[SoakRequest]:
    """``num_requests`` random requests (see the module docstring); prompts are ids below the model's vocabulary."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    prefixes = [torch.randint(3, vocab_size, (2 * page_size,), generator=generator) for _ in range(3)]
    names = sorted(REGISTRY)
    requests = []
    for index in range(num_requests):
        rows = []
        # Half the requests are a single prompt, as a chat server sees most: a left-padded batch reuses no prefix
        # (its padded rows' tokens do not start at a page), so only those and batches of one length can hit.
        for _ in range(1 if max_batch == 1 or rng.random() < 0.5 else rng.randint(2, max_batch)):
            tail = torch.randint(3, vocab_size, (rng.randint(1, 2 * page_size),), generator=generator)
            rows.append(torch.cat([rng.choice(prefixes), tail]) if rng.random() < 0.7 else tail)
        width = max(len(row) for row in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)  # [rows, width], left-padded with id 0
        mask = torch.zeros_like(ids)  # [rows, width]
        for row, tokens in enumerate(rows):
            ids[row, width - len(tokens) :], mask[row, width - len(tokens) :] = tokens, 1
        oversized = rng.random() < oversized_share
        max_new = 4 * max_tokens if oversized else rng.randint(1, 2 * page_size)
        fail_at = rng.randint(0, max_new - 1) if not oversized and rng.random() < failure_share else None
        requests.append(
            SoakRequest(index, rng.choice(names), ids, mask, max_new, rng.choice(MODES), oversized, fail_at)
        )
    return requests


def run_soak(
    model: torch.nn.Module,
    num_requests: int,
    *,
    num_threads: int = 4,
    max_tokens: int = 384,
    page_size: int = 8,
    max_batch: int = 3,
    attention: str | None = None,
    seed: int = 0,
) -> SoakReport:
    """Runs ``num_requests`` random requests in ``num_threads`` threads on shared pools and checks every output.

    Args:
        model: a decoder-only model (eval mode).
        num_requests: requests to run.
        num_threads: threads running them at once.
        max_tokens: tokens each pool holds (rounded up to whole pages, for every layer group): small, so that
            requests contend for pages.
        page_size: token slots per page.
        max_batch: most prompts in one request.
        attention: the attention the model runs under (``"hf_kvcache"``: pages read in place); ``None``: its own.
        seed: seeds the requests.
    """
    for label, value, low in (("num_requests", num_requests, 1), ("num_threads", num_threads, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{label}={value!r} is out of range: choose an int >= {low}.")
    requests = draw_requests(model, num_requests, max_tokens, page_size, max_batch, seed)
    pools = soak_pools(model, max_tokens, page_size)
    distinct = list({id(pool): pool for pool in pools.values()}.values())
    with model_attention(model, attention):
        references = {
            request.index: _reference(model, request, page_size)
            for request in requests
            if not request.oversized and request.fail_at is None
        }
        gc.collect()
        rss_start = rss_max = rss_bytes()
        outcomes: dict[int, str] = {}
        examples: list[str] = []
        work: queue.Queue[SoakRequest] = queue.Queue()
        for request in requests:
            work.put(request)
        tokens = Counter()

        def serve() -> None:
            while True:
                try:
                    request = work.get_nowait()
                except queue.Empty:
                    return
                outcome, detail, generated = _run(model, request, pools[request.name], page_size, references)
                outcomes[request.index] = outcome
                tokens[request.index] = generated
                if outcome not in EXPECTED and len(examples) < 5:
                    examples.append(f"request {request.index} ({request.name}, {request.mode}): {detail}")

        start = time.perf_counter()
        threads = [threading.Thread(target=serve, name=f"soak-{i}") for i in range(num_threads)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            rss_max = max(rss_max, rss_bytes())
            time.sleep(0.05)
        seconds = time.perf_counter() - start
    gc.collect()
    stats = [pool.stats() for pool in distinct]
    counts = Counter(outcomes.values())
    expected_kind = {request.index: _expected(request) for request in requests}
    failures = sum(1 for index, outcome in outcomes.items() if outcome not in expected_kind[index])
    return SoakReport(
        num_requests=num_requests,
        num_threads=num_threads,
        attention=attention or "the model's own",
        outcomes=dict(sorted(counts.items())),
        failures=failures,
        failure_examples=examples,
        prefix_hits=sum(s["prefix_hits"] for s in stats),
        prefix_tokens_reused=sum(s["prefix_tokens_reused"] for s in stats),
        tokens_generated=sum(tokens.values()),
        pages_left=sum(s["pages_used"] - s["pages_cached"] for s in stats),
        live_tables=sum(s["live_tables"] for s in stats),
        seconds=seconds,
        requests_per_second=num_requests / seconds,
        rss_start_bytes=rss_start,
        rss_max_bytes=rss_max,
        rss_end_bytes=rss_bytes(),
        pools={
            "+".join(sorted(n for n, p in pools.items() if p is pool)): {
                key: stat[key] for key in ("pages_total", "high_water_pages", "page_size")
            }
            | {"value_bits": pool.format.value_bits}
            for pool, stat in zip(distinct, stats, strict=True)
        },
    )


def _expected(request: SoakRequest) -> set[str]:
    """The outcomes that are no failure for ``request``."""
    if request.oversized:
        return {"refused_oversized"}
    if request.fail_at is not None:
        return {"injected", "refused_busy", "exhausted"}
    return {"ok", "refused_busy", "exhausted"}


def _reference(model: torch.nn.Module, request: SoakRequest, page_size: int) -> torch.Tensor:
    """The request's output run alone, on a pool of its own without prefix caching."""
    config = {**REGISTRY[request.name].soak_config, "page_size": page_size, "prefix_caching": False}
    return model.generate(
        request.input_ids.to(model.device),
        attention_mask=request.attention_mask.to(model.device),
        cache_implementation=request.name,
        cache_config=config,
        **request.generate_kwargs(),
    ).cpu()


def _run(
    model: torch.nn.Module,
    request: SoakRequest,
    pool: KVPool,
    page_size: int,
    references: dict[int, torch.Tensor],
) -> tuple[str, str, int]:
    """Runs one request on the shared pool; returns its outcome, a detail for failures and the tokens generated."""
    config = {**REGISTRY[request.name].soak_config, "page_size": page_size, "pool": pool}
    try:
        out = model.generate(
            request.input_ids.to(model.device),
            attention_mask=request.attention_mask.to(model.device),
            cache_implementation=request.name,
            cache_config=config,
            **request.generate_kwargs(),
        ).cpu()
    except PoolExhaustedError as error:
        if "admission_check refused" not in str(error):
            return "exhausted", str(error), 0
        return ("refused_oversized" if error.exceeds_pool else "refused_busy"), str(error), 0
    except InjectedFailure as error:
        return "injected", str(error), 0
    except Exception as error:  # the soak counts whatever a request raises; nothing is swallowed silently
        return f"error:{type(error).__name__}", f"{type(error).__name__}: {error}", 0
    generated = (out.shape[1] - request.input_ids.shape[1]) * out.shape[0]
    if request.oversized:
        return "not_refused", "an oversized request ran", generated
    reference = references[request.index]
    if out.shape != reference.shape or not torch.equal(out, reference):
        return "wrong", f"tokens {out.tolist()} where alone {reference.tolist()}", generated
    return "ok", "", generated
