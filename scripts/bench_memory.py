"""How much of the KV memory a padded batch spends on live tokens, for each cache; see ``hf_kvcache.bench.memory``.

Two workloads (random token ids, fixed seeds, left padding): ``padded_batch``, one batch of 8 prompts of 40-1,500
tokens, 32 new tokens each; ``serving``, 32 requests of 50-2,000 prompt tokens and 32-256 new tokens, 8 per batch.
A tiny random-init Llama with SmolLM2-135M's KV geometry (30 layers, 3 KV heads, head_dim 64), fp32.

Example::

    PYTHONPATH=. python scripts/bench_memory.py --output benchmarks/memory.json

Writes the record (machine, git commit, settings, results) to ``--output`` as JSON and prints a Markdown table.
"""

import argparse
import dataclasses
from pathlib import Path

import hf_kvcache
from hf_kvcache.bench.measure import OtherCpuUse, add_machine_args, machine_settings, results_record, write_record
from hf_kvcache.bench.memory import MemoryBenchConfig, git_state, markdown_table, run_memory_benchmark
from hf_kvcache.eval import environment


def parse_args() -> argparse.Namespace:
    defaults = MemoryBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caches", nargs="+", default=list(defaults.caches), help="cache_implementation names")
    parser.add_argument("--workloads", nargs="+", default=[w.name for w in defaults.workloads], help="which to run")
    parser.add_argument("--page-size", type=int, default=defaults.page_size, help="token slots per page")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/memory.json"), help="JSON record path")
    add_machine_args(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    defaults = MemoryBenchConfig()
    known = {workload.name: workload for workload in defaults.workloads}
    if unknown := sorted(set(args.workloads) - set(known)):
        raise SystemExit(f"Unknown workloads {unknown}; choose from {sorted(known)}.")
    config = dataclasses.replace(
        defaults,
        workloads=tuple(known[name] for name in args.workloads),
        caches=tuple(args.caches),
        page_size=args.page_size,
    )
    device, dtype = machine_settings(args)
    git = git_state(Path(hf_kvcache.__file__).parent)  # the checkout whose code runs, as it was imported
    with OtherCpuUse() as others:
        results = run_memory_benchmark(config, device, dtype)
    record = results_record(results, config, environment(device, dtype), {"git": git})
    write_record(record, args.output, others, markdown_table(results))


if __name__ == "__main__":
    main()
