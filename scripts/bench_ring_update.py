"""Micro-benchmark of one decode step's cache update: ``sliding_ring`` next to transformers' sliding-window
layers, with the bundled model's KV geometry (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64); see
``hf_kvcache.bench.ring_update``. Only the model's config is read: no weights are loaded, no forward pass runs.

Example (CPU, fp32, the default windows 256 ... 8192)::

    PYTHONPATH=. python scripts/bench_ring_update.py --batches 1 8

Writes the record (machine, settings, geometry, results) to ``--output`` as JSON and prints a Markdown table.
"""

import argparse
from pathlib import Path

from transformers import AutoConfig

from hf_kvcache.bench.catalogue import SLIDING_CACHES
from hf_kvcache.bench.measure import OtherCpuUse, add_machine_args, machine_settings, write_record
from hf_kvcache.bench.ring_update import (
    RingUpdateBenchConfig,
    markdown_table,
    results_record,
    run_ring_update_benchmark,
)
from hf_kvcache.bundled import BUNDLED_MODEL, bundled_model_path
from hf_kvcache.eval import environment
from hf_kvcache.memory.format import PageFormat


def parse_args() -> argparse.Namespace:
    defaults = RingUpdateBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, nargs="+", default=list(defaults.windows), help="window sizes")
    parser.add_argument("--batches", type=int, nargs="+", default=list(defaults.batches), help="batch sizes")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed decode steps per run")
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help="untimed steps per run")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="interleaved runs of each cache")
    parser.add_argument("--caches", nargs="+", default=list(SLIDING_CACHES), choices=SLIDING_CACHES)
    parser.add_argument("--page-size", type=int, default=defaults.page_size, help="slots per page of the ring")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/ring_update.json"), help="JSON record path")
    add_machine_args(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    bench = RingUpdateBenchConfig(
        windows=tuple(args.windows),
        batches=tuple(args.batches),
        steps=args.steps,
        rounds=args.rounds,
        warmup_steps=args.warmup_steps,
        caches=tuple(args.caches),
        page_size=args.page_size,
    )
    device, dtype = machine_settings(args)
    config = AutoConfig.from_pretrained(bundled_model_path())
    page_format = PageFormat.from_model_config(config, dtype)
    info = environment(device, dtype)
    with OtherCpuUse() as others:
        results = run_ring_update_benchmark(config, bench, dtype, device)
    record = results_record(results, bench, info)
    record["model"] = BUNDLED_MODEL
    record["geometry"] = {
        "num_layers": page_format.num_layers,
        "num_kv_heads": page_format.num_kv_heads,
        "head_dim": page_format.head_dim,
    }
    write_record(record, args.output, others, markdown_table(results, page_format.num_layers))


if __name__ == "__main__":
    main()
