"""quantized_kv against its own scheme as plain fake quantization, and quanto int4, on the evaluation's real text.

Teacher-forced decode (``hf_kvcache.eval.fidelity.compare_in_decode_mode``) of the bundled SmolLM2 on essay windows:
full precision (``DynamicCache``), the cache (``kv-k4v4``, ``kv-k8v4``), the same scheme as float32 fake quantization
(``ref-*``: ``hf_kvcache.eval.reference.FakeQuantKVCache``, same page semantics and residual window), and transformers'
quanto int4 ``QuantizedCache``, in one run. Prints a table and writes JSON.

Example:
    nice -n 10 python scripts/measure_key_fidelity.py --tokens 512 --output benchmarks/key_fidelity_512.json
"""

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import Cache, PreTrainedModel  # noqa: E402

from hf_kvcache.bundled import BUNDLED_MODEL, load_bundled_model  # noqa: E402
from hf_kvcache.caches.quantized import DEFAULT_RESIDUAL_LENGTH  # noqa: E402
from hf_kvcache.eval.caches import CacheSpec, parse_spec  # noqa: E402
from hf_kvcache.eval.data import load_texts, token_windows  # noqa: E402
from hf_kvcache.eval.fidelity import compare_in_decode_mode  # noqa: E402
from hf_kvcache.eval.reference import FakeQuantKVCache  # noqa: E402
from hf_kvcache.eval.report import environment, summarize  # noqa: E402


@dataclass(frozen=True)
class ReferenceSpec(CacheSpec):
    """A ``FakeQuantKVCache`` (settings: its arguments) in an evaluation."""

    def build(self, model: PreTrainedModel, max_cache_len: int) -> Cache:
        return FakeQuantKVCache(model.config.get_text_config(decoder=True), **self.settings)


def reference_spec(text: str) -> ReferenceSpec:
    """``LABEL:key=value,...`` as a ``FakeQuantKVCache`` spec (values parsed as ``--cache`` parses them)."""
    label, _, options = text.partition(":")
    return ReferenceSpec(label, "dynamic", parse_spec(f"{label}=dynamic:{options}").settings)


def default_specs(extra: list[str], references: list[str]) -> list[CacheSpec]:
    residual = {"residual_length": DEFAULT_RESIDUAL_LENGTH}
    return [
        CacheSpec("kv-k4v4", "quantized_kv", {"key_bits": 4, "value_bits": 4}),
        ReferenceSpec("ref-k4v4", "dynamic", {"key_bits": 4, "value_bits": 4, **residual}),
        CacheSpec("kv-k8v4", "quantized_kv", {"key_bits": 8, "value_bits": 4}),
        ReferenceSpec("ref-k8v4", "dynamic", {"key_bits": 8, "value_bits": 4, **residual}),
        CacheSpec("quanto-int4", "quantized", {"backend": "quanto", "nbits": 4}),
        *(parse_spec(text) for text in extra),
        *(reference_spec(text) for text in references),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per document")
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=256, help="tokens of the first forward pass")
    parser.add_argument("--buckets", type=int, default=4, help="position buckets of the per-bucket perplexity")
    parser.add_argument("--cache", action="append", default=[], help="more caches, as LABEL=KIND:key=value,...")
    parser.add_argument(
        "--reference", action="append", default=[], help="more fake-quantization references, as LABEL:key=value,..."
    )
    parser.add_argument("--only", nargs="*", default=None, help="labels of the default caches to keep")
    parser.add_argument("--output", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    torch.manual_seed(0)
    model, tokenizer = load_bundled_model()
    windows = token_windows(tokenizer, load_texts("essays"), args.documents, args.tokens, 0)
    specs = default_specs(args.cache, args.reference)
    if args.only is not None:  # the defaults named, and every extra one
        extra = len(args.cache) + len(args.reference)
        specs = [spec for spec in specs[: len(specs) - extra] if spec.label in args.only] + specs[len(specs) - extra :]
    metrics = compare_in_decode_mode(model, windows.input_ids, specs, args.prefill, progress=False)
    results = summarize(specs, metrics, args.buckets)
    base = next(result for result in results if result.label == "dynamic")
    rows = []
    print(f"{'cache':<14} {'dPPL %':>8} {'KL':>9} {'top-1 %':>8} {'bytes/token':>12}  dPPL % by bucket")
    for result in results:
        buckets = [ppl / base_ppl - 1 for ppl, base_ppl in zip(result.perplexity_by_bucket, base.perplexity_by_bucket)]
        row = {
            "label": result.label,
            "kind": result.kind,
            "settings": result.settings,
            "perplexity": result.perplexity,
            "perplexity_change_relative": result.perplexity_change_relative,
            "kl_mean": result.kl_mean,
            "top1_agreement": result.top1_agreement,
            "kv_bytes_per_token": result.kv_bytes_per_token,
            "perplexity_change_relative_by_bucket": buckets,
            "kl_mean_by_bucket": [
                metrics[result.label].kl[:, a:b].mean().item()
                for a, b in zip(result.bucket_edges, result.bucket_edges[1:])
            ],
            "bucket_edges": result.bucket_edges,
        }
        rows.append(row)
        print(
            f"{result.label:<14} {100 * result.perplexity_change_relative:>8.3f} {result.kl_mean:>9.2e} "
            f"{100 * result.top1_agreement:>8.2f} {result.kv_bytes_per_token:>12,.0f}  "
            + " ".join(f"{100 * b:+.2f}" for b in buckets)
        )
    report = {
        "model": BUNDLED_MODEL,
        "dtype": "float32",
        "data": dict(windows.provenance),
        "documents": args.documents,
        "document_tokens": args.tokens,
        "prefill_tokens": args.prefill,
        "decode": "teacher-forced, one token per forward pass after the prefill, every cache in lockstep",
        "command": "python scripts/measure_key_fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": time.perf_counter() - started,
        "environment": environment(),
        "caches": rows,
    }
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
