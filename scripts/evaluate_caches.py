"""Measures the quality each KV cache costs against DynamicCache; writes JSON, Markdown and plots, prints the table.

Examples:
    python scripts/evaluate_caches.py                       # bundled SmolLM2, essays, every registered cache + quanto
    python scripts/evaluate_caches.py --cache dynamic --cache paged_pool --cache win256=sliding:window=256 \\
        --documents 4 --document-tokens 1024 --retrieval-lengths 1024 2048 4096 --output model_cards/results/x

The flags are defined once, in ``hf_kvcache.eval.command`` (which also writes the command that reruns a report).
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from hf_kvcache.eval.command import parse_eval_args  # noqa: E402
from hf_kvcache.eval.runner import run_evaluation  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    config, output = parse_eval_args(argv, description=__doc__.splitlines()[0])
    report = run_evaluation(config)
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
