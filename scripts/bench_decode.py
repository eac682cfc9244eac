"""Decode benchmark of the bundled model (SmolLM2-135M-Instruct) on real text; see ``hf_kvcache.bench.decode``.

Two suites, each measured against its baselines in the same run:

- ``paged`` (default): ``paged_pool`` next to ``DynamicCache`` and ``StaticCache``, at 1,024 and 4,096 tokens:
  under ``attn_implementation="hf_kvcache"`` (decode reads the pages in place) and ``"sdpa"`` (gathered), each on
  the default pool and a fixed one, and in place on a fragmented default pool (``hf_kvcache.bench.catalogue``);
  each row says which path it took and the compile seconds of its first call; writes ``benchmarks/decode.json``.
- ``sliding``: ``sliding_ring`` next to transformers' sliding-window caches (``dynamic_sliding``,
  ``static_sliding``) at the same ``--window``, with the full ``DynamicCache`` as reference; prompts longer
  than the window; writes ``benchmarks/decode_ring.json``.
- ``quantized``: ``quantized_values`` (int8, int4 values) and ``quantized_kv`` (int8 or int4 keys, int4 values),
  each on a fixed pool and on the default pool (``-default``), next to transformers' ``QuantizedCache`` (quanto
  and hqq, int4 and int2 keys and values) and ``DynamicCache``, at 4,096 tokens; writes
  ``benchmarks/decode_quantized.json``.
- ``compiled``: decode steps as ``generate`` runs them, compiled by ``generate`` itself (``CompileConfig`` with
  ``_compile_all_devices = True``, ``--mode``) or eager: ``StaticCache`` compiled (the baseline), ``DynamicCache``
  and ``StaticCache`` eager, and our caches eager and compiled, on the default pool, at 1,024 x 1, 4,096 x 1 and
  4,096 x 8 (``--lengths`` x ``--batches`` override); ``hf_kvcache.bench.compiled``; writes
  ``benchmarks/decode_compiled.json``.
- ``hybrid``: a hybrid linear-attention model built from its config with random weights (``--hybrid``, default
  ``qwen3_5_text``: Qwen3.5's layout, ``hf_kvcache.bench.hybrid``), each of our caches as
  ``generate(cache_implementation=NAME)`` runs it, under the model's own attention and under ours, against
  ``DynamicCache`` (``--rows`` override, e.g. ``paged_pool@hf_kvcache:compiled``), at 1,024 x 1, 4,096 x 1 and
  4,096 x 8 (``--lengths`` x ``--batches`` override); writes ``benchmarks/decode_hybrid.json``.

Examples (CPU, fp32)::

    PYTHONPATH=. python scripts/bench_decode.py --lengths 256 1024 --batches 1 8
    PYTHONPATH=. python scripts/bench_decode.py --suite sliding --window 256 --lengths 1024 4096 --batches 1 8
    PYTHONPATH=. python scripts/bench_decode.py --suite hybrid --lengths 1024 4096 --batches 1 --threads 1

``--caches``, ``--lengths`` and ``--output`` override a suite's. Writes the record (machine, settings,
results) to ``--output`` as JSON and prints a Markdown table.

``--profile CACHE`` instead prints where the time of one decode step of ``CACHE`` goes (``torch.profiler``), at
the first of ``--lengths`` and ``--batches``, e.g. one 4,096 x 8 step in place::

    PYTHONPATH=. python scripts/bench_decode.py --profile paged_pool --lengths 4096 --batches 8

``--suite compiled --profile-row ROW`` prints where the time of ``ROW``'s decode steps goes (its kernels and device
time per forward pass, then ``torch.profiler``'s table), at the first cell, e.g. on a GPU::

    PYTHONPATH=. python scripts/bench_decode.py --suite compiled --profile-row paged_pool:compiled \\
        --lengths 1024 --batches 1 --device cuda --dtype bfloat16 --mode reduce-overhead

``--random-weights`` builds the bundled model's architecture from its config with random weights (seed 0), for a
machine that has the bundled folder's config and tokenizer but not its weights (the GPU check carries no more than
64 MiB): step times depend on the shapes alone, but greedy tokens of random weights sit close to ties, so the
"tokens equal" columns then say little. The record's ``model`` says so.
"""

import argparse
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hf_kvcache.bench.catalogue import BASELINE, CACHE_NAMES, FULL_CACHES, QUANTIZED_CACHES, SLIDING_CACHES
from hf_kvcache.bench.decode import profile_decode, run_decode_benchmark
from hf_kvcache.bench.decode_report import DecodeBenchConfig, markdown_table, results_record
from hf_kvcache.bench.measure import OtherCpuUse, add_machine_args, machine_settings, write_record
from hf_kvcache.bench.prompts import essay_token_stream
from hf_kvcache.bundled import BUNDLED_MODEL, bundled_model_path, load_bundled_model
from hf_kvcache.eval import environment
from hf_kvcache.testing import HYBRIDS

SUITES = {
    "paged": {"caches": FULL_CACHES, "lengths": (1024, 4096), "output": Path("benchmarks/decode.json")},
    "quantized": {
        "caches": (BASELINE, *QUANTIZED_CACHES),
        "lengths": (4096,),
        "output": Path("benchmarks/decode_quantized.json"),
    },
    "compiled": {"caches": (), "lengths": (), "output": Path("benchmarks/decode_compiled.json")},
    "hybrid": {"caches": (), "lengths": (), "output": Path("benchmarks/decode_hybrid.json")},
    "sliding": {
        "caches": (BASELINE, *SLIDING_CACHES),
        "lengths": (1024, 4096),
        "output": Path("benchmarks/decode_ring.json"),
    },
}


def parse_args() -> argparse.Namespace:
    defaults = DecodeBenchConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="paged", choices=sorted(SUITES), help="caches, lengths and output to use")
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt tokens per row (default: the suite's)")
    parser.add_argument("--batches", type=int, nargs="+", default=list(defaults.batches), help="batch sizes")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed decode steps per run")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="interleaved runs of each cache")
    parser.add_argument("--caches", nargs="+", choices=CACHE_NAMES, help="caches to time (default: the suite's)")
    parser.add_argument("--window", type=int, default=defaults.window, help="tokens kept by the sliding caches")
    parser.add_argument("--output", type=Path, help="JSON record path (default: the suite's)")
    parser.add_argument("--profile", choices=CACHE_NAMES, help="print a profile of one decode step of this cache")
    parser.add_argument("--profile-row", help="the compiled suite: print a profile of this row's steps instead")
    parser.add_argument("--mode", default="default", help="CompileConfig mode of the compiled suite's rows")
    parser.add_argument(
        "--rows", nargs="+", help="the compiled or hybrid suite's rows (default: all; its baseline always)"
    )
    parser.add_argument("--hybrid", default="qwen3_5_text", choices=sorted(HYBRIDS), help="the hybrid suite's model")
    parser.add_argument("--size", default="bench", choices=["bench", "tiny"], help="the hybrid suite's model size")
    parser.add_argument("--random-weights", action="store_true", help="the bundled architecture, random weights")
    add_machine_args(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.suite == "compiled":
        run_compiled_suite(args)
        return
    if args.suite == "hybrid":
        run_hybrid_suite(args)
        return
    suite = SUITES[args.suite]
    output = args.output or suite["output"]
    config = DecodeBenchConfig(
        lengths=tuple(args.lengths or suite["lengths"]),
        batches=tuple(args.batches),
        steps=args.steps,
        rounds=args.rounds,
        caches=tuple(args.caches or suite["caches"]),
        window=args.window,
    )
    device, dtype = machine_settings(args)
    model, tokenizer = load_model(args, device, dtype)
    info = environment(device, dtype)
    if args.profile:
        length, batch = config.lengths[0], config.batches[0]
        print(profile_decode(model, essay_token_stream(tokenizer), args.profile, length, batch, config))
        return
    with OtherCpuUse() as others:
        results = run_decode_benchmark(model, essay_token_stream(tokenizer), config)
    record = results_record(results, config, info)
    record["model"] = model_name(args)
    write_record(record, output, others, markdown_table(results))


def run_compiled_suite(args: argparse.Namespace) -> None:
    from hf_kvcache.bench import compiled

    cells = compiled.CompiledBenchConfig().cells
    if args.lengths:
        cells = tuple((length, batch) for length in args.lengths for batch in args.batches)
    rows = compiled.ROWS
    if args.rows:
        rows = (compiled.BASELINE, *(row for row in args.rows if row != compiled.BASELINE))
    config = compiled.CompiledBenchConfig(cells=cells, rows=rows, steps=args.steps, rounds=args.rounds, mode=args.mode)
    device, dtype = machine_settings(args)
    model, tokenizer = load_model(args, device, dtype)
    info = environment(device, dtype)
    if args.profile_row:
        print(compiled.profile_row(model, essay_token_stream(tokenizer), config, args.profile_row))
        return
    with OtherCpuUse() as others:
        results = compiled.run_compiled_benchmark(model, essay_token_stream(tokenizer), config)
    record = compiled.results_record(results, config, info)
    record["model"] = model_name(args)
    write_record(record, args.output or SUITES["compiled"]["output"], others, compiled.markdown_table(results))


def run_hybrid_suite(args: argparse.Namespace) -> None:
    from hf_kvcache.bench import hybrid

    config = hybrid.HybridBenchConfig()
    cells = config.cells
    if args.lengths:
        cells = tuple((length, batch) for length in args.lengths for batch in args.batches)
    rows = config.rows
    if args.rows:
        rows = (hybrid.BASELINE, *(row for row in args.rows if row != hybrid.BASELINE))
    config = hybrid.HybridBenchConfig(cells=cells, rows=rows, steps=args.steps, rounds=args.rounds, mode=args.mode)
    device, dtype = machine_settings(args)
    model = hybrid.hybrid_bench_model(args.hybrid, args.size, dtype, device)
    with OtherCpuUse() as others:
        results = hybrid.run_hybrid_benchmark(model, config)
    record = hybrid.results_record(results, config, model, environment(device, dtype))
    write_record(record, args.output or SUITES["hybrid"]["output"], others, hybrid.markdown_table(results))


def load_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """The bundled model and tokenizer; with ``--random-weights`` its architecture with random weights (seed 0)."""
    if not args.random_weights:
        return load_bundled_model(dtype=dtype, device=device)
    path = bundled_model_path()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path)


def model_name(args: argparse.Namespace) -> str:
    return f"{BUNDLED_MODEL} (random weights)" if args.random_weights else BUNDLED_MODEL


if __name__ == "__main__":
    main()
