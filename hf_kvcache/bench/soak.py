"""Soak test: many short ``generate`` calls on small pools, checking that memory stays flat.

Each call picks a registered cache name (run with its entry's ``soak_config``), a batch of random prompt lengths,
``max_new_tokens`` and ``admission_check`` at random, and runs greedy ``generate`` on the pool of that cache's
page format (one pool per format, shared by every name of that format). Pools are small on purpose: the largest
requests do not fit, so both refusals (``admission_check``) and mid-generation ``PoolExhaustedError`` happen
along the way. After every call the soak records whether every pool is back to 0 pages used and to 0 live page
tables, and samples the process's resident memory (RSS, ``measure.rss_bytes``). ``scripts/soak.py`` runs it from
the command line.
"""

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvcache.bench.measure import rss_bytes
from hf_kvcache.errors import PoolExhaustedError
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.pool import KVPool
from hf_kvcache.testing import random_padded_batch


@dataclass
class SoakReport:
    """Figures of one soak run.

    RSS figures are bytes of resident memory; ``rss_start_bytes`` is taken after the warm-up calls, so
    ``rss_growth_bytes`` (end minus start) leaves out the one-off allocations of the first calls.
    """

    num_calls: int
    num_warmup_calls: int
    num_refused: int  # refused up front by admission_check
    num_exhausted: int  # PoolExhaustedError mid-generation
    num_calls_with_pages_left: int  # calls after which a pool still had pages in use (a leak)
    max_live_tables: int  # most page tables alive across pools after a call (0 when every cache is gone)
    seconds: float
    calls_per_second: float
    tokens_generated: int
    rss_start_bytes: int
    rss_end_bytes: int
    rss_max_bytes: int
    rss_growth_bytes: int
    pools: dict[str, dict[str, Any]]  # per pool: pages_total, high_water_pages, page_size, value_bits

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def soak_pools(model: torch.nn.Module, max_tokens: int, page_size: int) -> dict[str, KVPool]:
    """A fixed pool of ``max_tokens`` tokens per page format, for every registered cache name.

    Names whose caches store pages alike (``paged_pool``, ``sliding_ring``) share one pool.
    """
    made: dict[PageFormat, KVPool] = {}
    pools = {}
    for name, entry in REGISTRY.items():
        page_format = entry.page_format(model.config, model.dtype, {**entry.soak_config, "page_size": page_size})
        if page_format not in made:
            made[page_format] = KVPool(page_format, page_format.pages_for_tokens(max_tokens) + 1, model.device)
        pools[name] = made[page_format]
    return pools


def run_soak(
    model: torch.nn.Module,
    num_calls: int,
    *,
    max_tokens: int = 64,
    page_size: int = 8,
    max_batch: int = 3,
    max_prompt_tokens: int = 40,
    max_new_tokens: int = 24,
    num_warmup_calls: int | None = None,
    seed: int = 0,
) -> SoakReport:
    """Runs ``num_calls`` random greedy ``generate`` calls on small pools and reports memory figures.

    Args:
        model: a decoder-only model (eval mode); prompts are random ids below its vocabulary size.
        num_calls: calls to make, warm-up included.
        max_tokens: tokens each pool holds (rounded up to whole pages, for every layer group).
        page_size: token slots per page.
        max_batch / max_prompt_tokens / max_new_tokens: upper bounds of the random request sizes (lower: 1).
        num_warmup_calls: calls before the starting RSS is taken (default: a tenth, at least 20, at most all).
        seed: seeds the request sizes and prompts.
    """
    if num_calls < 1:
        raise ValueError(f"num_calls={num_calls} is out of range: choose num_calls >= 1.")
    num_warmup = min(num_calls, max(20, num_calls // 10)) if num_warmup_calls is None else num_warmup_calls
    if not 0 <= num_warmup <= num_calls:
        raise ValueError(f"num_warmup_calls={num_warmup} is out of range: choose 0 <= num_warmup_calls <= num_calls.")
    pools = soak_pools(model, max_tokens, page_size)
    distinct = list({id(pool): pool for pool in pools.values()}.values())
    names = sorted(pools)
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    counts = {"refused": 0, "exhausted": 0, "leaks": 0, "tokens": 0}
    max_live_tables = 0
    rss_start = rss_max = rss_bytes()
    start = time.perf_counter()
    for call in range(num_calls):
        if call == num_warmup:
            rss_start = rss_bytes()
        name = rng.choice(names)
        lengths = [rng.randint(1, max_prompt_tokens) for _ in range(rng.randint(1, max_batch))]
        ids, mask = random_padded_batch(lengths, vocab_size, generator, low=3)  # special ids 0-2 left out
        cache_config = {**REGISTRY[name].soak_config} | {
            "pool": pools[name],
            "page_size": page_size,
            "admission_check": rng.random() < 0.5,
        }
        try:
            out = model.generate(
                ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=rng.randint(1, max_new_tokens),
                do_sample=False,
                cache_implementation=name,
                cache_config=cache_config,
            )
            counts["tokens"] += (out.shape[1] - ids.shape[1]) * out.shape[0]
        except PoolExhaustedError as error:
            counts["refused" if "admission_check refused" in str(error) else "exhausted"] += 1
        stats = [pool.stats() for pool in distinct]
        counts["leaks"] += any(s["pages_used"] for s in stats)
        max_live_tables = max(max_live_tables, sum(s["live_tables"] for s in stats))
        rss_max = max(rss_max, rss_bytes())
    seconds = time.perf_counter() - start
    rss_end = rss_bytes()
    return SoakReport(
        num_calls=num_calls,
        num_warmup_calls=num_warmup,
        num_refused=counts["refused"],
        num_exhausted=counts["exhausted"],
        num_calls_with_pages_left=counts["leaks"],
        max_live_tables=max_live_tables,
        seconds=seconds,
        calls_per_second=num_calls / seconds,
        tokens_generated=counts["tokens"],
        rss_start_bytes=rss_start,
        rss_end_bytes=rss_end,
        rss_max_bytes=rss_max,
        rss_growth_bytes=rss_end - rss_start,
        pools={
            "+".join(sorted(n for n, p in pools.items() if p is pool)): {
                key: pool.stats()[key] for key in ("pages_total", "high_water_pages", "page_size")
            }
            | {"value_bits": pool.format.value_bits}
            for pool in distinct
        },
    )
