"""Every causal LM of transformers' auto mapping, tiny, through every cache under either attention, against
``DynamicCache`` under the model's own attention (``hf_kvcache.bench.model_matrix``; ``tests/test_model_matrix.py``
runs the same matrix).

Example::

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/model_matrix.py --output benchmarks/model_matrix.json

Writes the counts and every model type's outcomes to ``--output`` as JSON, and prints the counts and the runs that
are neither equal nor close. ``--write-docs`` also rewrites the list of families in docs/caches.md from the results.
"""

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import hf_kvcache  # noqa: E402
from hf_kvcache import KVPool  # noqa: E402
from hf_kvcache.bench import model_matrix  # noqa: E402
from hf_kvcache.bench.memory import git_state  # noqa: E402

DOCS = Path(__file__).parents[1] / "docs" / "caches.md"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-types", nargs="+", help="these model types only (default: the whole auto mapping)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/model_matrix.json"), help="JSON record path")
    parser.add_argument("--write-docs", action="store_true", help="rewrite docs/caches.md's list of families")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    hf_kvcache.register()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = time.perf_counter()
    results = []
    for model_type in args.model_types or model_matrix.model_types():
        result = model_matrix.run_model(model_type)
        KVPool.drop_defaults()  # each model's pools go with it
        results.append(result)
        failed = [o for o in result.outcomes if o.status not in ("equal", "close")]
        note = result.skipped or ", ".join(f"{o.attention}/{o.cache}: {o.status}" for o in failed) or "ok"
        print(f"{model_type:32s} {note[:160]}", flush=True)
    record = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "git": git_state(Path(hf_kvcache.__file__).parent),
        "settings": model_matrix.settings(),
        "counts": model_matrix.summary(results),
        "wall_s": round(time.perf_counter() - started, 1),
        "models": [model_matrix.as_record(result) for result in results],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["counts"], indent=2))
    if args.write_docs:
        DOCS.write_text(model_matrix.with_families(DOCS.read_text(), record))
        print(f"docs: {DOCS}")
    print(f"record written to {args.output}")


if __name__ == "__main__":
    main()
