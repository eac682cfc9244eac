"""Aten ops and device-to-host reads of one decode step, per cache, fp32 on the CPU (``hf_kvcache.bench.ops``).

On the bundled SmolLM2 (``--model bundled``, prompts of essay tokens) or on a hybrid linear-attention model built
from its config with random weights (``--model qwen3_5_text`` or ``lfm2``: ``hf_kvcache.bench.hybrid``, prompts of
random ids; ``--size tiny`` for a quick look). ``--attentions`` names the attentions our caches are counted under
(default: the model's own, ``sdpa``; ``hf_kvcache`` reads pages in place where that applies). Writes JSON and prints
a table.

Examples:
    python scripts/count_decode_ops.py --length 1024 --output benchmarks/decode_ops.json
    python scripts/count_decode_ops.py --model qwen3_5_text --length 4096 --attentions sdpa hf_kvcache \\
        --output benchmarks/decode_ops_hybrid.json
"""

import argparse
import dataclasses
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from hf_kvcache.bench import hybrid  # noqa: E402
from hf_kvcache.bench.ops import count_decode_ops, markdown_table  # noqa: E402
from hf_kvcache.bench.prompts import essay_token_stream  # noqa: E402
from hf_kvcache.bundled import BUNDLED_MODEL, load_bundled_model  # noqa: E402
from hf_kvcache.eval import environment  # noqa: E402
from hf_kvcache.testing import HYBRIDS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled", choices=["bundled", *sorted(HYBRIDS)])
    parser.add_argument("--size", default="bench", choices=["bench", "tiny"], help="a hybrid's size")
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens per row")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--attentions", nargs="+", choices=["sdpa", "hf_kvcache"], help="ours run under each")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if args.model == "bundled":
        model, tokenizer = load_bundled_model(dtype=torch.float32)
        ids = essay_token_stream(tokenizer)[: args.batch * args.length].view(args.batch, args.length)
        described = BUNDLED_MODEL
    else:
        model = hybrid.hybrid_bench_model(args.model, args.size)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (args.batch, args.length), generator=generator)
        described = hybrid.describe(model)
    attentions = tuple(args.attentions) if args.attentions else (None,)
    rows = count_decode_ops(model, ids, attentions)
    print(markdown_table(rows))
    if args.output:
        record = {
            "benchmark": "decode_ops",
            "model": described,
            "length": args.length,
            "batch": args.batch,
            "machine": environment(torch.device("cpu"), torch.float32),
            "results": [dataclasses.asdict(row) for row in rows],
        }
        args.output.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
