"""Soak: thousands of short random generate calls on small pools; prints memory figures, optionally writes JSON.

Usage: python scripts/soak.py [--calls 5000] [--model tiny_gemma3] [--max-tokens 64] [--json soak.json]

Exits with status 1 if a call left pages in use or a page table alive, or if RSS grew by more than
--max-rss-growth-mib after the warm-up calls. Library: ``hf_kvcache.bench.soak``.
"""

import argparse
import json
import logging
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

from hf_kvcache import testing  # noqa: E402
from hf_kvcache.bench.soak import run_soak  # noqa: E402

MODELS = {"tiny_llama": testing.tiny_llama, "tiny_mistral": testing.tiny_mistral, "tiny_gemma3": testing.tiny_gemma3}
MIB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000, help="generate calls, warm-up included")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny_gemma3")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each pool holds (per layer group)")
    parser.add_argument("--page-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rss-growth-mib", type=float, default=64.0, help="fail above this RSS growth")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    transformers.logging.set_verbosity_error()  # a full pool warns on every alert crossing
    logging.getLogger("hf_kvcache").setLevel(logging.ERROR)
    report = run_soak(
        MODELS[args.model](), args.calls, max_tokens=args.max_tokens, page_size=args.page_size, seed=args.seed
    )
    print(f"{report.num_calls} calls on {args.model} in {report.seconds:.1f} s: {report.calls_per_second:.1f} calls/s")
    print(f"  refused by admission_check {report.num_refused}, exhausted mid-generation {report.num_exhausted}")
    print(
        f"  calls that left pages in use {report.num_calls_with_pages_left}, "
        f"max live page tables after a call {report.max_live_tables}"
    )
    print(
        f"  RSS after {report.num_warmup_calls} warm-up calls {report.rss_start_bytes / MIB:.1f} MiB, "
        f"end {report.rss_end_bytes / MIB:.1f} MiB, max {report.rss_max_bytes / MIB:.1f} MiB, "
        f"growth {report.rss_growth_bytes / MIB:+.2f} MiB"
    )
    for name, stats in report.pools.items():
        print(f"  pool {name}: high water {stats['high_water_pages']} of {stats['pages_total']} pages")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report.as_dict() | {"model": args.model, "seed": args.seed}, file, indent=2)
    failed = (
        report.num_calls_with_pages_left
        or report.max_live_tables
        or report.rss_growth_bytes > args.max_rss_growth_mib * MIB
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
