"""Plain report objects of an evaluation, and their JSON, Markdown and PNG forms."""

import datetime
import json
import logging
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from hf_kvcache.eval.caches import CacheSpec
from hf_kvcache.eval.fidelity import TokenMetrics

logger = logging.getLogger("hf_kvcache.eval")


@dataclass
class CacheResult:
    """Quality and memory of one cache against the baseline on the same model, data and tokens.

    ``perplexity_change`` is absolute, ``perplexity_change_relative`` a fraction of the baseline's;
    ``perplexity_by_bucket[i]`` covers predicted positions ``[bucket_edges[i], bucket_edges[i + 1])``, as do
    ``perplexity_change_by_bucket[i]`` (a fraction of the baseline's perplexity there) and ``kl_by_bucket[i]``
    (empty in reports from before they were recorded).
    ``kv_bytes_per_token`` is per token *held* (a ring holds its window, not every token it saw) and
    ``kv_bytes_held`` per row, both at the end. ``attn_implementation`` is the attention the cache ran under.
    ``generation_agreement`` counts greedy tokens after a prompt of ``generation_prompt_tokens``;
    ``generation_beyond_window`` says, for a cache with a window, whether those tokens went past it (``None``:
    no window).
    """

    label: str
    kind: str
    settings: dict[str, Any]
    perplexity: float
    perplexity_change: float
    perplexity_change_relative: float
    kl_mean: float
    top1_agreement: float
    perplexity_by_bucket: list[float]
    bucket_edges: list[int]
    kv_bytes_per_token: float
    eval_tokens_per_s: float
    generation_agreement: list[int] = field(default_factory=list)
    retrieval: dict[str, Any] = field(default_factory=dict)
    pool_stats: dict[str, Any] | None = None
    attn_implementation: str | None = None
    kv_bytes_held: float | None = None
    generation_prompt_tokens: int | None = None
    generation_beyond_window: bool | None = None
    perplexity_change_by_bucket: list[float] = field(default_factory=list)
    kl_by_bucket: list[float] = field(default_factory=list)


def summarize(
    specs: list[CacheSpec], metrics: dict[str, TokenMetrics], num_buckets: int = 8, attn_implementation: str = "sdpa"
) -> list[CacheResult]:
    """Aggregates per-position metrics into one ``CacheResult`` per spec (the baseline first).

    Args:
        attn_implementation: the model's attention, for the specs that name none.
    """
    baseline = next(iter(metrics))  # compare_in_decode_mode puts the baseline first
    base_ppl = math.exp(metrics[baseline].nll.mean().item())
    num_positions = metrics[baseline].nll.shape[1]
    edges = [round(i * num_positions / num_buckets) for i in range(num_buckets + 1)]
    spans = list(zip(edges, edges[1:]))
    base_by_bucket = [math.exp(metrics[baseline].nll[:, a:b].mean().item()) for a, b in spans]
    kinds = {spec.label: spec for spec in specs}
    results = []
    for label, metric in metrics.items():
        ppl = math.exp(metric.nll.mean().item())
        by_bucket = [math.exp(metric.nll[:, a:b].mean().item()) for a, b in spans]
        spec = kinds.get(label, CacheSpec(label, "dynamic"))
        results.append(
            CacheResult(
                label=label,
                kind=spec.kind,
                settings=spec.settings,
                perplexity=ppl,
                perplexity_change=ppl - base_ppl,
                perplexity_change_relative=ppl / base_ppl - 1,
                kl_mean=metric.kl.mean().item(),
                top1_agreement=metric.top1_agree.float().mean().item(),
                perplexity_by_bucket=by_bucket,
                bucket_edges=edges,
                perplexity_change_by_bucket=[ppl / base - 1 for ppl, base in zip(by_bucket, base_by_bucket)],
                kl_by_bucket=[metric.kl[:, a:b].mean().item() for a, b in spans],
                kv_bytes_per_token=metric.kv_bytes_per_token,
                eval_tokens_per_s=metric.nll.numel() / metric.seconds if metric.seconds else float("nan"),
                pool_stats=metric.pool_stats,
                attn_implementation=spec.attn_implementation or attn_implementation,
                kv_bytes_held=metric.kv_bytes_held,
            )
        )
    return results


def change_by_bucket(result: CacheResult, baseline: CacheResult) -> list[float]:
    """``result.perplexity_change_by_bucket``, or for a report from before it was recorded, the same from the
    perplexities by bucket."""
    if result.perplexity_change_by_bucket:
        return result.perplexity_change_by_bucket
    return [ppl / base - 1 for ppl, base in zip(result.perplexity_by_bucket, baseline.perplexity_by_bucket)]


@dataclass
class EvalReport:
    """Everything one evaluation run measured, with the exact configuration that reproduces it."""

    config: dict[str, Any]
    data: dict[str, Any]
    environment: dict[str, Any]
    seconds: float
    caches: list[CacheResult]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "EvalReport":
        """Reads a ``report.json`` written by ``save``."""
        fields = json.loads(Path(path).read_text())
        fields["caches"] = [CacheResult(**result) for result in fields["caches"]]
        return cls(**fields)

    def save(self, directory: str | Path) -> dict[str, Path]:
        """Writes ``report.json``, ``report.md`` and the plots into ``directory``; returns their paths."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = {"json": directory / "report.json", "markdown": directory / "report.md"}
        paths["json"].write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        paths["markdown"].write_text(self.markdown() + "\n")
        try:
            paths.update(self.plot(directory))
        except ModuleNotFoundError as error:  # matplotlib alone missing: the table and the JSON are the report
            if error.name is None or error.name.split(".")[0] != "matplotlib":
                raise
            logger.warning(
                "Plots skipped: matplotlib is not installed. Install the eval extra (pip install 'hf_kvcache[eval]', "
                "or pip install matplotlib) to get quality_vs_memory.png and perplexity_by_position.png."
            )
        return paths

    def markdown(self) -> str:
        """The results table (one row per cache) in Markdown, with a footnote where a cache's greedy agreement
        never left its window."""
        has_retrieval = any(result.retrieval for result in self.caches)
        header = ["cache", "attention", "perplexity", "Δ ppl", "Δ ppl %", "KL (nats)", "top-1 agree"]
        header += ["greedy agree (tokens)"] + (["retrieval acc"] if has_retrieval else [])
        header += ["KV MiB held/row", "KV bytes/token held", "eval tokens/s"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        within = [r.label for r in self.caches if r.generation_beyond_window is False]
        for r in self.caches:
            greedy = (
                f"{sum(r.generation_agreement) / len(r.generation_agreement):.1f}" if r.generation_agreement else "–"
            )
            row = [
                r.label,
                r.attn_implementation or "–",
                f"{r.perplexity:.3f}",
                f"{r.perplexity_change:+.4f}",
                f"{100 * r.perplexity_change_relative:+.4f}",
                f"{r.kl_mean:.2e}",
                f"{100 * r.top1_agreement:.2f}%",
                greedy + ("*" if r.label in within else ""),
            ]
            row += [f"{100 * r.retrieval['accuracy']:.0f}%" if r.retrieval else "–"] if has_retrieval else []
            held = "–" if r.kv_bytes_held is None else f"{r.kv_bytes_held / 2**20:.2f}"
            row += [held, f"{r.kv_bytes_per_token:,.0f}", f"{r.eval_tokens_per_s:.1f}"]
            lines.append("| " + " | ".join(row) + " |")
        if within:
            lines.append(
                f"\n\\* {', '.join(within)}: the greedy tokens never went past the cache's window (prompt and new "
                "tokens fit in it), so this agreement does not measure what the window drops."
            )
        return "\n".join(lines) + "\n\n" + self.by_position_markdown()

    def by_position_markdown(self) -> str:
        """Quality by position: Δ ppl % and mean KL of each cache over each bucket of predicted positions."""
        baseline, edges = self.caches[0], self.caches[0].bucket_edges
        prefill = self.config.get("prefill_tokens")
        lines = [
            "Quality by position: Δ ppl % / mean KL (nats) over predicted positions [a, b) of each document"
            + (f" (the first {prefill} are the prompt, read in one forward pass)." if prefill else "."),
            "",
            "| cache | " + " | ".join(f"{a}–{b}" for a, b in zip(edges, edges[1:])) + " |",
            "|" + "---|" * len(edges),
        ]
        for r in self.caches:
            changes = change_by_bucket(r, baseline)
            kl = r.kl_by_bucket or [math.nan] * len(changes)  # a report from before it was recorded: "nan"
            cells = [f"{100 * change:+.2f}% / {value:.1e}" for change, value in zip(changes, kl)]
            lines.append("| " + " | ".join([r.label, *cells]) + " |")
        return "\n".join(lines)

    def plot(self, directory: Path) -> dict[str, Path]:
        """PNG plots: quality change against KV bytes per token; perplexity by position."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        paths = {"plot_quality_vs_memory": directory / "quality_vs_memory.png"}
        figure, axis = plt.subplots(figsize=(6, 4))
        placed: list[tuple[float, float]] = []
        for r in self.caches:
            held = r.kv_bytes_held if r.kv_bytes_held is not None else r.kv_bytes_per_token
            point = (held / 2**20, 100 * r.perplexity_change_relative)
            axis.scatter(*point)
            # Lossless caches sit on one spot: stack the labels of points that coincide.
            stacked = sum(
                math.isclose(point[0], x, rel_tol=0.01) and math.isclose(point[1], y, abs_tol=0.5) for x, y in placed
            )
            placed.append(point)
            axis.annotate(r.label, point, xytext=(4, 4 + 9 * stacked), textcoords="offset points", fontsize=8)
        axis.set_xlabel("KV memory held per row at the end (MiB)")
        axis.set_ylabel("perplexity change vs DynamicCache (%)")
        axis.set_title(f"{self.config.get('model', '')}: quality vs memory")
        axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(paths["plot_quality_vs_memory"], dpi=120)
        plt.close(figure)

        paths["plot_perplexity_by_position"] = directory / "perplexity_by_position.png"
        figure, axis = plt.subplots(figsize=(6, 4))
        for r in self.caches:
            centers = [(a + b) / 2 for a, b in zip(r.bucket_edges, r.bucket_edges[1:])]
            axis.plot(centers, r.perplexity_by_bucket, marker="o", label=r.label)
        axis.set_xlabel("token position")
        axis.set_ylabel("perplexity")
        axis.set_title("perplexity by position (teacher-forced through the cache)")
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(paths["plot_perplexity_by_position"], dpi=120)
        plt.close(figure)
        return paths


def environment(device: torch.device | None = None, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Versions and hardware a run measured on, for its record: the one function every report and benchmark uses.

    Args:
        device / dtype: what a benchmark ran on; the record then also holds the date, the processor, the device,
            the dtype and the GPU's name on CUDA. Without them (an evaluation report) it holds the GPU's name, or
            ``None`` without CUDA, under ``cuda``.
    """
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device is None:
        return info | {"cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **info,
        "processor": platform.processor() or platform.machine(),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
