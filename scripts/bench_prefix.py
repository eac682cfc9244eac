"""Prompt reuse benchmark of the bundled model (SmolLM2-135M-Instruct, fp32) on real text, with and without the
pool's prefix index in the same run; see ``hf_kvcache.bench.prefix``.

Example (the issue's settings: a 2,048-token document, 8 questions of 64 tokens, 32 new tokens, 6 chat turns)::

    PYTHONPATH=. python scripts/bench_prefix.py --threads 1

With ``--tiers``, prompt reuse beyond one pool instead (``hf_kvcache.bench.prefix_tiers``): a worker with a warm
shared store against a cold one, and the host tier after eviction against a recompute (a ``redis-server`` is started
for the run unless ``--store redis://...`` names one)::

    PYTHONPATH=. python scripts/bench_prefix.py --threads 1 --tiers

Writes the record (machine, settings, results) to ``--output`` as JSON and prints Markdown tables.
"""

import argparse
import logging
from pathlib import Path

from hf_kvcache.bench import prefix_tiers
from hf_kvcache.bench.measure import OtherCpuUse, add_machine_args, machine_settings, write_record
from hf_kvcache.bench.prefix import PrefixBenchConfig, markdown_table, results_record, run_prefix_benchmark
from hf_kvcache.bench.prompts import essay_token_stream
from hf_kvcache.bundled import BUNDLED_MODEL, load_bundled_model
from hf_kvcache.eval import environment
from hf_kvcache.integration.registry import REGISTRY


def parse_args() -> argparse.Namespace:
    defaults = PrefixBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=defaults.prefix_tokens, help="tokens of the document")
    parser.add_argument("--question-tokens", type=int, default=defaults.question_tokens, help="tokens per question")
    parser.add_argument("--new-tokens", type=int, default=defaults.new_tokens, help="greedy tokens per answer")
    parser.add_argument("--questions", type=int, default=defaults.num_questions, help="questions, and threads")
    parser.add_argument("--chat-turns", type=int, default=defaults.chat_turns, help="turns of the chat")
    parser.add_argument("--cache", default=defaults.cache, choices=sorted(REGISTRY), help="cache_implementation")
    parser.add_argument("--page-size", type=int, default=defaults.page_size, help="token slots per page")
    parser.add_argument("--tiers", action="store_true", help="the store and host tier benchmark instead")
    parser.add_argument("--store", default=None, help="--tiers: a Redis URL (default: a redis-server for the run)")
    parser.add_argument(
        "--output", type=Path, default=None, help="JSON record path (benchmarks/prefix.json, or prefix_tiers.json)"
    )
    add_machine_args(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.tiers:
        run_tiers(args)
        return
    config = PrefixBenchConfig(
        prefix_tokens=args.prefix_tokens,
        question_tokens=args.question_tokens,
        new_tokens=args.new_tokens,
        num_questions=args.questions,
        chat_turns=args.chat_turns,
        cache=args.cache,
        page_size=args.page_size,
    )
    device, dtype = machine_settings(args)
    model, tokenizer = load_bundled_model(dtype=dtype, device=device)
    info = environment(device, dtype)
    with OtherCpuUse() as others:
        shared, concurrent, chat = run_prefix_benchmark(model, essay_token_stream(tokenizer), config)
    record = results_record(shared, concurrent, chat, config, info)
    record["model"] = BUNDLED_MODEL
    write_record(
        record, args.output or Path("benchmarks/prefix.json"), others, markdown_table(shared, concurrent, chat)
    )


def run_tiers(args: argparse.Namespace) -> None:
    config = prefix_tiers.TierBenchConfig(
        prefix_tokens=args.prefix_tokens,
        question_tokens=args.question_tokens,
        new_tokens=args.new_tokens,
        num_questions=args.questions,
        cache=args.cache,
        page_size=args.page_size,
        store=args.store,
    )
    device, dtype = machine_settings(args)
    model, tokenizer = load_bundled_model(dtype=dtype, device=device)
    info = environment(device, dtype)
    with OtherCpuUse() as others:
        results = prefix_tiers.run_tier_benchmark(model, essay_token_stream(tokenizer), config)
    record = prefix_tiers.results_record(results, config, info)
    record["model"] = BUNDLED_MODEL
    output = args.output or Path("benchmarks/prefix_tiers.json")
    write_record(record, output, others, prefix_tiers.markdown_table(results))


if __name__ == "__main__":
    main()
