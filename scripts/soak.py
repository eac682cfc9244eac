"""Soak: random serving requests in threads sharing pools, every output checked; prints the figures, optionally JSON.

Usage: python scripts/soak.py [--requests 400] [--threads 4] [--model tiny_gemma3] [--attention hf_kvcache]
[--json soak.json]

Requests mix the four caches, padding, beams, sampling, prompt reuse, oversized requests and injected failures
(``hf_kvcache.bench.soak``). Exits with status 1 if a request failed in a way not expected of it (an error, other
tokens than the same request alone, an oversized request not refused), if pages or page tables outlived the run, or
if RSS grew by more than --max-rss-growth-mib during it.
"""

import argparse
import json
import logging
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

from hf_kvcache import testing  # noqa: E402
from hf_kvcache.bench.soak import run_soak  # noqa: E402

MODELS = {"tiny_llama": testing.tiny_llama, "tiny_mistral": testing.tiny_mistral, "tiny_gemma3": testing.tiny_gemma3}
MIB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny_gemma3")
    parser.add_argument("--attention", choices=["hf_kvcache"], help="the attention to run under (default: the model's)")
    parser.add_argument("--max-tokens", type=int, default=384, help="tokens each pool holds (per layer group)")
    parser.add_argument("--page-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rss-growth-mib", type=float, default=256.0, help="fail above this RSS growth")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    transformers.logging.set_verbosity_error()  # a full pool warns on every alert crossing
    logging.getLogger("hf_kvcache").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="A step of .* reaches past the ring")  # rings imposed under sdpa
    report = run_soak(
        MODELS[args.model](),
        args.requests,
        num_threads=args.threads,
        max_tokens=args.max_tokens,
        page_size=args.page_size,
        attention=args.attention,
        seed=args.seed,
    )
    print(
        f"{report.num_requests} requests on {args.model} in {report.num_threads} threads under {report.attention} "
        f"attention in {report.seconds:.1f} s ({report.requests_per_second:.1f} requests/s)"
    )
    print(f"  outcomes {report.outcomes}; failures {report.failures}")
    for example in report.failure_examples:
        print(f"    {example}")
    print(f"  prefix hits {report.prefix_hits} ({report.prefix_tokens_reused} tokens reused)")
    print(f"  after the run: pages left {report.pages_left}, live page tables {report.live_tables}")
    print(
        f"  RSS at the start {report.rss_start_bytes / MIB:.1f} MiB, max {report.rss_max_bytes / MIB:.1f} MiB, "
        f"end {report.rss_end_bytes / MIB:.1f} MiB"
    )
    for name, stats in report.pools.items():
        print(f"  pool {name}: high water {stats['high_water_pages']} of {stats['pages_total']} pages")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report.as_dict() | {"model": args.model, "seed": args.seed}, file, indent=2)
    growth = report.rss_end_bytes - report.rss_start_bytes
    failed = report.failures or report.pages_left or report.live_tables or growth > args.max_rss_growth_mib * MIB
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
