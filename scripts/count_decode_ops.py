"""Aten ops and device-to-host reads of one decode step, per cache, on the bundled SmolLM2 (fp32, CPU).

For each cache: a prompt of ``--length`` essay tokens per row and two greedy tokens through ``generate``, then one
decode step counted with a ``TorchDispatchMode``: eager (the path an uncompiled ``generate`` takes) and, for our
caches, planned (``PoolCache.plan_decode``: the step ``generate`` compiles, run here without the compiler, so its
ops are those the graph holds before fusion; the second planned step, and apart, the ops its planning dispatched on
the host before the forward pass, which a CUDA graph does not hide); eager, also the ops of the 16 steps after it,
one of which fills a page (a quantized cache codes its keys' or values' page there). A GPU launches a kernel for
nearly each eager op. Writes JSON and prints a table.

Example:
    python scripts/count_decode_ops.py --length 1024 --output benchmarks/decode_ops.json
"""

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hf_kvcache.bench.prompts import essay_token_stream  # noqa: E402
from hf_kvcache.bundled import BUNDLED_MODEL, load_bundled_model  # noqa: E402
from hf_kvcache.eval import environment  # noqa: E402

CACHES = {  # name -> cache_config
    "dynamic": None,
    "paged_pool": {},
    "sliding_ring": {"window": 1024},
    "quantized_values": {"bits": 4},
    "quantized_kv": {"key_bits": 4, "value_bits": 4},
}
HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        # indexing with a boolean mask reads the mask back to size its result
        masked = func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1])
        self.host_reads += masked or func in HOST_READS
        return func(*args, **(kwargs or {}))


def count_page(model, cache, token: torch.Tensor) -> int:
    """The aten ops of ``page_size`` (16) eager decode steps from ``cache`` fed ``token`` then the greedy tokens: one
    of them fills a page (the steps of a quantized cache that code their keys' or values' page)."""
    total = 0
    with torch.no_grad():
        for _ in range(16):
            with Count() as count:
                logits = model(input_ids=token, cache=cache).logits
            total += count.ops
            token = logits[:, -1:].argmax(-1)
    return total


def count_step(
    model, ids: torch.Tensor, name: str, config: dict | None, planned: bool
) -> tuple[Count, Count, int | None]:
    """The counts of one decode step's forward pass and, planned, of its planning (of the second planned step: the
    first makes the plan's tensors); eager, the ops of a page of steps after it (``count_page``)."""
    kwargs = {} if config is None else {"cache_implementation": name, "cache_config": config}
    out = model.generate(ids, do_sample=False, max_new_tokens=2, return_dict_in_generate=True, **kwargs)
    cache, token = out.cache, out.sequences[:, -1:]
    if not planned:
        with torch.no_grad(), Count() as count:
            model(input_ids=token, cache=cache)
        return count, Count(), count_page(model, cache, token)
    cache.compiled_decoding = True  # as generate sets it when it compiles
    for _ in range(2):
        with Count() as planning:
            if not cache.plan_decode(ids.shape[0], 1):
                raise RuntimeError(f"{name}: the step could not be planned")
        inputs = {"input_ids": token, "position_ids": None}
        cache.start_planned(inputs)
        with torch.no_grad(), Count() as count:
            logits = model(**inputs, cache=cache).logits
        token = logits[:, -1:].argmax(-1)
    return count, planning, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens per row")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    model, tokenizer = load_bundled_model(dtype=torch.float32)
    stream = essay_token_stream(tokenizer)
    ids = stream[: args.batch * args.length].view(args.batch, args.length)
    rows = []
    for name, config in CACHES.items():
        for planned in (False, True) if config is not None else (False,):
            count, planning, page_ops = count_step(model, ids, name, config, planned)
            rows.append(
                {
                    "cache": name,
                    "step": "planned" if planned else "eager",
                    "ops": count.ops,
                    "host_reads": count.host_reads,
                    "planning_ops": planning.ops,
                    "planning_host_reads": planning.host_reads,
                    "page_ops": page_ops,
                }
            )
    base, base_page = rows[0]["ops"], rows[0]["page_ops"]
    print(
        "| cache | step | aten ops | vs DynamicCache | host reads | planning ops | a page of steps vs DynamicCache |\n"
        "|---|---|---:|---:|---:|---:|---:|"
    )
    for row in rows:
        row["ops_vs_dynamic"] = row["ops"] / base
        row["page_ops_vs_dynamic"] = None if row["page_ops"] is None else row["page_ops"] / base_page
        cells = (row["cache"], row["step"], f"{row['ops']:,}", f"{row['ops_vs_dynamic']:.2f}x", str(row["host_reads"]))
        page = "" if row["page_ops"] is None else f"{row['page_ops_vs_dynamic']:.2f}x"
        print("| " + " | ".join((*cells, str(row["planning_ops"]), page)) + " |")
    if args.output:
        record = {
            "benchmark": "decode_ops",
            "model": BUNDLED_MODEL,
            "length": args.length,
            "batch": args.batch,
            "machine": environment(torch.device("cpu"), torch.float32),
            "results": rows,
        }
        args.output.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
