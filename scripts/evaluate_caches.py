"""Measures the quality each KV cache costs against DynamicCache; writes JSON, Markdown and plots, prints the table.

Examples:
    python scripts/evaluate_caches.py                       # bundled SmolLM2, essays, every registered cache + quanto
    python scripts/evaluate_caches.py --cache dynamic --cache paged_pool --cache win256=sliding:window=256 \\
        --documents 4 --document-tokens 1024 --retrieval-lengths 1024 2048 4096 --output model_cards/results/x
"""

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from hf_kvcache.eval.caches import TRANSFORMERS_KINDS, parse_spec  # noqa: E402
from hf_kvcache.eval.runner import EvalConfig, run_evaluation  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    defaults = EvalConfig()
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=defaults.model, help="'bundled' or a local model folder")
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument(
        "--attn-implementation",
        default=defaults.attn_implementation,
        help="the model's attention: \"hf_kvcache\" keeps a ring's window within a prompt too (default: %(default)s)",
    )
    parser.add_argument(
        "--cache",
        action="append",
        type=parse_spec,
        dest="specs",
        help=f"LABEL=KIND[:key=value,...]; KIND is a registered name or one of {TRANSFORMERS_KINDS} (repeatable)",
    )
    parser.add_argument("--source", default=defaults.source, help="essays, ruler-essays, wikitext, pg19 or a path")
    parser.add_argument("--documents", type=int, default=defaults.num_documents, dest="num_documents")
    parser.add_argument("--document-tokens", type=int, default=defaults.document_tokens)
    parser.add_argument("--prefill-tokens", type=int, default=defaults.prefill_tokens)
    parser.add_argument("--chunk-size", type=int, default=defaults.chunk_size, help="tokens per forward after prefill")
    parser.add_argument("--generation-tokens", type=int, default=defaults.generation_tokens)
    parser.add_argument("--retrieval-tasks", nargs="*", default=defaults.retrieval_tasks)
    parser.add_argument("--retrieval-lengths", nargs="*", type=int, default=defaults.retrieval_lengths)
    parser.add_argument("--retrieval-depths", nargs="*", type=float, default=defaults.retrieval_depths)
    parser.add_argument("--retrieval-samples", type=int, default=defaults.retrieval_samples)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--output", default="eval_results", help="folder for report.json, report.md and the plots")
    args = vars(parser.parse_args(argv))
    output = args.pop("output")
    args["specs"] = args["specs"] or []
    report = run_evaluation(EvalConfig(**args))
    paths = report.save(output)
    print(f"\n{report.markdown()}\n")
    data = report.data
    print(
        f"{report.config['model']} on {data['source']} ({data['num_windows']} x {data['window_tokens']} tokens), "
        f"{report.seconds:.0f} s. Wrote " + ", ".join(str(path) for path in paths.values()),
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
