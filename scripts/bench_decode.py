"""Decode benchmark of the bundled model (SmolLM2-135M-Instruct) on real text; see ``hf_kvcache.bench``.

Example (CPU, fp32, the short grid)::

    PYTHONPATH=. python scripts/bench_decode.py --lengths 256 1024 --batches 1 8

Writes the record (machine, settings, results) to ``--output`` as JSON and prints a Markdown table.
"""

import argparse
import json
import logging
from pathlib import Path

import torch

from hf_kvcache.bench import (
    CACHE_NAMES,
    DecodeBenchConfig,
    OtherCpuUse,
    essay_token_stream,
    machine_info,
    markdown_table,
    results_record,
    run_decode_benchmark,
)
from hf_kvcache.models import BUNDLED_MODEL, load_bundled_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args() -> argparse.Namespace:
    defaults = DecodeBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(defaults.lengths), help="prompt tokens per row")
    parser.add_argument("--batches", type=int, nargs="+", default=list(defaults.batches), help="batch sizes")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed decode steps per run")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="interleaved runs of each cache")
    parser.add_argument("--caches", nargs="+", default=list(CACHE_NAMES), choices=CACHE_NAMES, help="caches to time")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/decode.json"), help="JSON record path")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = DecodeBenchConfig(
        lengths=tuple(args.lengths),
        batches=tuple(args.batches),
        steps=args.steps,
        rounds=args.rounds,
        caches=tuple(args.caches),
    )
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    model, tokenizer = load_bundled_model(dtype=dtype, device=device)
    info = machine_info(device, dtype)
    with OtherCpuUse() as others:
        results = run_decode_benchmark(model, essay_token_stream(tokenizer), config)
    record = results_record(results, config, info)
    record["model"] = BUNDLED_MODEL
    record["wall_s"] = round(others.wall_s, 1)
    # Timings are only as good as the machine was quiet: CPU time other processes took during the run.
    record["other_processes_cores"] = round(others.other_cores, 3)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    print(markdown_table(results))
    print(
        f"\nWall time {record['wall_s']} s; other processes kept {others.other_cores:.2f} cores busy on average; "
        f"record written to {args.output}."
    )


if __name__ == "__main__":
    main()
