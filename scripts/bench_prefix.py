"""Prompt reuse benchmark of the bundled model (SmolLM2-135M-Instruct, fp32) on real text, with and without the
pool's prefix index in the same run; see ``hf_kvcache.bench.prefix``.

Example (the issue's settings: a 2,048-token document, 8 questions of 64 tokens, 32 new tokens, 6 chat turns)::

    PYTHONPATH=. python scripts/bench_prefix.py --threads 1

With ``--tiers``, prompt reuse beyond one pool instead (``hf_kvcache.bench.prefix_tiers``): a worker with a warm
shared store against a cold one, and the host tier after eviction against a recompute (a ``redis-server`` is started
for the run unless ``--store redis://...`` names one)::

    PYTHONPATH=. python scripts/bench_prefix.py --threads 1 --tiers

With ``--model hybrid``, the same parts on a hybrid linear-attention model instead (``hybrid_bench_model``: Qwen3.5's
layout with random weights, ``--model-type lfm2`` for convolution layers) over random-id prompts (its text would mean
nothing; reuse keys on the ids), plus a first call's prefill with the index (split into passes) against without, and
each call's path (tokens reused, forward passes to the first token)::

    PYTHONPATH=. python scripts/bench_prefix.py --threads 1 --model hybrid

Writes the record (machine, settings, results) to ``--output`` as JSON and prints Markdown tables.
"""

import argparse
import logging
from pathlib import Path

import torch

from hf_kvcache.bench import prefix_tiers
from hf_kvcache.bench.hybrid import BENCH_SIZES, describe, hybrid_bench_model
from hf_kvcache.bench.measure import OtherCpuUse, add_machine_args, machine_settings, write_record
from hf_kvcache.bench.prefix import (
    PrefixBenchConfig,
    markdown_table,
    random_token_stream,
    results_record,
    run_prefix_benchmark,
    run_prefix_parts,
)
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
    parser.add_argument(
        "--model", default="smollm2", choices=("smollm2", "hybrid"), help="the bundled SmolLM2, or a random hybrid"
    )
    parser.add_argument(
        "--model-type", default="qwen3_5_text", choices=sorted(BENCH_SIZES), help="--model hybrid: its layout"
    )
    parser.add_argument("--tiers", action="store_true", help="the store and host tier benchmark instead")
    parser.add_argument("--store", default=None, help="--tiers: a Redis URL (default: a redis-server for the run)")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON record path (default: benchmarks/prefix.json, prefix_tiers.json or prefix_hybrid.json)",
    )
    add_machine_args(parser)
    args = parser.parse_args()
    if args.tiers and args.model != "smollm2":
        parser.error("--tiers runs on the bundled model only: drop --model hybrid.")
    return args


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
    info = environment(device, dtype)
    if args.model == "hybrid":
        run_hybrid(args, config, device, dtype, info)
        return
    model, tokenizer = load_bundled_model(dtype=dtype, device=device)
    with OtherCpuUse() as others:
        shared, concurrent, chat = run_prefix_benchmark(model, essay_token_stream(tokenizer), config)
    record = results_record(shared, concurrent, chat, config, info)
    record["model"] = BUNDLED_MODEL
    write_record(
        record, args.output or Path("benchmarks/prefix.json"), others, markdown_table(shared, concurrent, chat)
    )


def run_hybrid(
    args: argparse.Namespace, config: PrefixBenchConfig, device: torch.device, dtype: torch.dtype, info: dict
) -> None:
    model = hybrid_bench_model(args.model_type, dtype=dtype, device=device)
    stream = random_token_stream(model.config.vocab_size, config.tokens_needed)
    with OtherCpuUse() as others:
        run = run_prefix_parts(model, stream, config, first_call=True)
    extra = {"first_call": run.first_call, "calls": run.calls}
    record = results_record(run.shared, run.concurrent, run.chat, config, info, **extra)
    record["model"] = describe(model)
    record["attention"] = model.config._attn_implementation  # "sdpa": decoding gathers the pages
    record["prompts"] = "random ids (seed 0): the model's weights are random, its text would mean nothing"
    table = markdown_table(run.shared, run.concurrent, run.chat, **extra)
    write_record(record, args.output or Path("benchmarks/prefix_hybrid.json"), others, table)


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
