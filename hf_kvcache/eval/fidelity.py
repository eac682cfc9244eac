"""Teacher-forced comparison of caches against the baseline, in decode mode, in lockstep.

The documents are fed through every cache the way generation feeds them: a prefill of the first
``prefill_tokens`` tokens, then ``chunk_size`` tokens per forward pass (1 = true decode mode; larger
chunks are a faster approximation, since the tokens of one chunk attend to each other in full
precision). All caches advance together, so the baseline (``DynamicCache``) runs once and each
position's next-token distribution is compared as soon as it is produced; nothing vocabulary-sized
is kept beyond one step. Each cache runs under its spec's attention (the rings under ``"hf_kvcache"`` by
default): the caches of one attention go one after the other, so the model switches attention twice a step
at most.
"""

import itertools
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import Cache, PreTrainedModel

from hf_kvcache.attention.interface import model_attention
from hf_kvcache.caches.base import PoolCache
from hf_kvcache.eval.caches import CacheSpec
from hf_kvcache.transformers_internals import cache_layer_state


@dataclass
class TokenMetrics:
    """Per-position results of one cache; position ``t`` predicts token ``t + 1``.

    Attributes:
        nll: ``[batch, seq_len - 1]`` negative log-likelihood of the true next token (nats).
        kl: ``[batch, seq_len - 1]`` KL(baseline || cache) of the next-token distributions (nats).
        top1_agree: ``[batch, seq_len - 1]`` whether the cache's argmax equals the baseline's.
        kv_bytes_per_token: KV memory the cache held at the end per token it held, per row (a window's tokens
            for a ring, not every token it saw: ``tokens_held``).
        kv_bytes_held: KV memory the cache held at the end, per row.
        seconds: wall time spent in this cache's forward passes.
        pool_stats: ``pool.stats()`` at the end, for caches on a pool.
    """

    nll: torch.Tensor
    kl: torch.Tensor
    top1_agree: torch.Tensor
    kv_bytes_per_token: float
    kv_bytes_held: float
    seconds: float
    pool_stats: dict | None = None


def fidelity_from_logits(
    logits: torch.Tensor, baseline_logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NLL of ``labels``, KL(baseline || candidate) and top-1 agreement, per position.

    Args:
        logits / baseline_logits: ``[..., vocab]`` next-token logits of the candidate and the baseline.
        labels: ``[...]`` the true next tokens.

    Returns:
        ``(nll, kl, top1_agree)``, each shaped like ``labels``.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    base_log_probs = torch.log_softmax(baseline_logits.float(), dim=-1)
    nll = -log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    kl = (base_log_probs.exp() * (base_log_probs - log_probs)).sum(-1).clamp_min(0)
    agree = logits.argmax(-1) == baseline_logits.argmax(-1)
    return nll, kl, agree


def kv_bytes(cache: Cache) -> int:
    """Bytes of KV storage a cache holds (pages for ours; every tensor of every layer for transformers')."""
    if isinstance(cache, PoolCache):
        return cache.memory_stats()["bytes_held"]
    return sum(_tensor_bytes(value) for layer in cache.layers for value in cache_layer_state(layer))


def tokens_held(cache: Cache) -> float:
    """Tokens per row the cache's layers hold at the end, averaged over the layers that hold any: every token seen
    for a layer without a limit, at most its window (and sinks) for a sliding one (``get_max_length``)."""
    counts = []
    for layer in cache.layers:
        seen = layer.get_seq_length()
        if seen:
            limit = layer.get_max_length()
            counts.append(seen if limit < 0 else min(seen, limit))
    return sum(counts) / len(counts) if counts else 0.0


def _tensor_bytes(value: object) -> int:
    if isinstance(value, (tuple, list)):  # e.g. hqq's (codes, meta) pairs
        return sum(_tensor_bytes(item) for item in value)
    if isinstance(value, dict):  # hqq's meta: scales and zeros
        return sum(_tensor_bytes(item) for item in value.values())
    if not isinstance(value, torch.Tensor) or value.dim() == 0:  # 0-dim tensors are counters, not KV
        return 0
    if hasattr(value, "__tensor_flatten__"):  # quantized tensor subclasses: count their packed parts
        names, _ = value.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(value, name)) for name in names)
    return value.numel() * value.element_size()


@torch.inference_mode()
def compare_in_decode_mode(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    specs: list[CacheSpec],
    prefill_tokens: int,
    chunk_size: int = 1,
    progress: bool = True,
) -> dict[str, TokenMetrics]:
    """Runs ``input_ids`` through the baseline and every cache in lockstep.

    Args:
        model: a causal LM.
        input_ids: ``[batch, seq_len]`` documents of equal length (no padding).
        specs: caches to compare; a ``DynamicCache`` baseline is always run (and reported as ``"dynamic"``
            unless a spec already is the baseline).
        prefill_tokens: tokens fed in the first forward pass (>= 1).
        chunk_size: tokens per forward pass after the prefill (1 = decode mode).

    Returns:
        ``TokenMetrics`` per spec label (the baseline's KL is 0 and its agreement 1).
    """
    batch, seq_len = input_ids.shape
    if not 1 <= prefill_tokens < seq_len:
        raise ValueError(f"prefill_tokens={prefill_tokens} must lie in [1, {seq_len - 1}] for documents of {seq_len}.")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1.")
    baseline = next((spec for spec in specs if spec.is_baseline), CacheSpec("dynamic", "dynamic"))
    candidates = [spec for spec in specs if spec is not baseline]
    input_ids = input_ids.to(model.device)
    caches = {spec.label: spec.build(model, max_cache_len=seq_len) for spec in [baseline, *candidates]}
    results: dict[str, list[tuple[torch.Tensor, ...]]] = {label: [] for label in caches}
    seconds = dict.fromkeys(caches, 0.0)
    bounds = [0, prefill_tokens, *range(prefill_tokens + chunk_size, seq_len - 1, chunk_size), seq_len - 1]
    ordered = sorted(candidates, key=lambda spec: spec.attn_implementation is not None)  # the model's own first
    by_attention = [
        (name, list(same)) for name, same in itertools.groupby(ordered, key=lambda spec: spec.attn_implementation)
    ]
    for start, end in tqdm(list(zip(bounds, bounds[1:])), desc="decode-mode eval", disable=not progress):
        chunk, labels = input_ids[:, start:end], input_ids[:, start + 1 : end + 1]
        with model_attention(model, baseline.attn_implementation):
            base_logits = _forward(model, chunk, caches[baseline.label], seconds, baseline.label)
        results[baseline.label].append(fidelity_from_logits(base_logits, base_logits, labels))
        for attention, attention_specs in by_attention:
            with model_attention(model, attention):
                for spec in attention_specs:
                    logits = _forward(model, chunk, caches[spec.label], seconds, spec.label)
                    results[spec.label].append(fidelity_from_logits(logits, base_logits, labels))
    return {
        label: TokenMetrics(
            *(torch.cat(parts, dim=1).cpu() for parts in zip(*results[label])),
            kv_bytes_per_token=kv_bytes(caches[label]) / (batch * tokens_held(caches[label])),
            kv_bytes_held=kv_bytes(caches[label]) / batch,
            seconds=seconds[label],
            pool_stats=caches[label].pool.stats() if isinstance(caches[label], PoolCache) else None,
        )
        for label in caches
    }


def _forward(model: PreTrainedModel, chunk: torch.Tensor, cache: Cache, seconds: dict[str, float], label: str):
    started = time.perf_counter()
    logits = model(input_ids=chunk, cache=cache, use_cache=True).logits
    if logits.is_cuda:
        torch.cuda.synchronize()
    seconds[label] += time.perf_counter() - started
    return logits


@torch.inference_mode()
def generation_agreement(
    model: PreTrainedModel, input_ids: torch.Tensor, specs: list[CacheSpec], max_new_tokens: int
) -> dict[str, list[int]]:
    """Greedy tokens each cache generates before its first divergence from the baseline, per prompt row.

    Args:
        input_ids: ``[batch, prompt_len]`` prompts of equal length (no padding).

    Returns:
        Per label, a list of ``batch`` counts in ``[0, max_new_tokens]``.
    """
    input_ids = input_ids.to(model.device)
    prompt_len = input_ids.shape[1]
    max_len = prompt_len + max_new_tokens

    def greedy(spec: CacheSpec) -> torch.Tensor:
        settings = {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "do_sample": False}
        cache = spec.build(model, max_cache_len=max_len)
        with model_attention(model, spec.attn_implementation):
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), cache=cache, **settings)
        return out[:, prompt_len:]

    baseline = next((spec for spec in specs if spec.is_baseline), CacheSpec("dynamic", "dynamic"))
    expected = greedy(baseline)
    agreement = {}
    for spec in specs:
        tokens = expected if spec is baseline else greedy(spec)
        same = (tokens == expected).int()
        agreement[spec.label] = same.cumprod(dim=1).sum(dim=1).tolist()
    agreement.setdefault(baseline.label, [max_new_tokens] * input_ids.shape[0])
    return agreement
