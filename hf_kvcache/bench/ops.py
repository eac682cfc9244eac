"""Aten ops and device-to-host reads of one decode step, per cache and attention: what a GPU launches (a kernel for
nearly each eager op) and where it waits for the host.

For each cache: ``generate(cache_implementation=NAME)`` (``DynamicCache``: no name) over the prompt and two greedy
tokens, as a user's call builds the cache (the default pool); then one decode step counted with a
``TorchDispatchMode``, as a step of an uncompiled ``generate`` runs (*eager*); for our caches also *planned*
(``PoolCache.plan_decode``: the step ``generate`` compiles, run here without the compiler, so its ops are those the
graph holds before fusion; the second planned step, and apart, the ops its planning dispatched on the host before
the forward pass, which a CUDA graph does not hide). Eager, also the ops of the ``page_size`` (16) steps after it,
one of which fills a page (a quantized cache codes its keys' or values' page there). Our caches run under each
attention asked for (the model's own, ``"sdpa"``: keys gathered; ``"hf_kvcache"``: read in place where that
applies); ``DynamicCache`` under the model's own is the baseline of every ratio. Op counts depend on the model's
shapes and the prompt's length, not on the machine: one run says them.
"""

import dataclasses
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PreTrainedModel

from hf_kvcache.attention import flex
from hf_kvcache.attention.interface import model_attention
from hf_kvcache.caches.base import PoolCache
from hf_kvcache.transformers_internals import attn_implementation

CACHES: dict[str, dict | None] = {  # name -> cache_config (None: DynamicCache)
    "dynamic": None,
    "paged_pool": {},
    "sliding_ring": {"window": 1024},
    "quantized_values": {"bits": 4},
    "quantized_kv": {"key_bits": 4, "value_bits": 4},
}
"""The caches counted: ``DynamicCache`` (the baseline) and each of ours with the settings of its benchmark rows."""
HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)
PAGE_STEPS = 16
"""Eager steps counted after the step (a page of the default format): one of them fills a page."""


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched in its block (``ops``) and those that read the device from the host
    (``host_reads``: ``.item()``, ``nonzero``, indexing with a boolean mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        # indexing with a boolean mask reads the mask back to size its result
        masked = func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1])
        self.host_reads += masked or func in HOST_READS
        return func(*args, **(kwargs or {}))


@dataclass
class OpRow:
    """One cache under one attention, one way of stepping (see the module docstring).

    Attributes:
        cache: a name of ``CACHES``.
        attention: the model's ``attn_implementation`` during the step.
        step: ``"eager"`` or ``"planned"``.
        ops / host_reads: of the step's forward pass.
        planning_ops / planning_host_reads: of the planning before it (planned steps; 0 for eager ones).
        page_ops: the ops of ``PAGE_STEPS`` eager steps after it (eager rows; ``None`` for planned ones).
        reads: how attention read our cache's layers in the eager step, by path (``PoolCache.read_counts``: one per
            attention layer) and ``"flex"`` (FlexAttention calls over the pages in place); ``{}`` for
            ``DynamicCache`` and planned steps (a planned step under ``"hf_kvcache"`` reads in place, under
            ``"sdpa"`` gathers).
        ops_vs_dynamic / page_ops_vs_dynamic: ratios to ``DynamicCache``'s under the model's own attention.
    """

    cache: str
    attention: str
    step: str
    ops: int
    host_reads: int
    planning_ops: int
    planning_host_reads: int
    page_ops: int | None
    reads: dict[str, int]
    ops_vs_dynamic: float = 0.0
    page_ops_vs_dynamic: float | None = None


def _reads(cache) -> dict[str, int]:
    counts = cache.read_counts() if isinstance(cache, PoolCache) else {}
    return {**counts, "flex": flex.call_count()} if counts else {}


def _count_page(model: PreTrainedModel, cache, token: torch.Tensor) -> int:
    """The aten ops of ``PAGE_STEPS`` eager decode steps from ``cache`` fed ``token`` then the greedy tokens."""
    total = 0
    for _ in range(PAGE_STEPS):
        with OpCount() as count:
            logits = model(input_ids=token, cache=cache).logits
        total += count.ops
        token = logits[:, -1:].argmax(-1)
    return total


def count_step(model: PreTrainedModel, ids: torch.Tensor, name: str, planned: bool) -> OpRow:
    """Counts one decode step of cache ``name`` (of ``CACHES``) after ``ids`` ``[batch, length]`` and two greedy
    tokens, under the model's current attention (see the module docstring)."""
    config = CACHES[name]
    kwargs = {} if config is None else {"cache_implementation": name, "cache_config": dict(config)}
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=2, return_dict_in_generate=True, **kwargs)
        cache, token = out.cache, out.sequences[:, -1:]
        row = OpRow(name, attn_implementation(model.config), "planned" if planned else "eager", 0, 0, 0, 0, None, {})
        if not planned:
            before = _reads(cache)
            with OpCount() as count:
                model(input_ids=token, cache=cache)
            row.reads = {path: reads - before[path] for path, reads in _reads(cache).items()}
            row.page_ops = _count_page(model, cache, token)
        else:
            cache.compiled_decoding = True  # as generate sets it when it compiles
            for _ in range(2):  # the second step: the first makes the plan's tensors
                with OpCount() as planning:
                    if not cache.plan_decode(ids.shape[0], 1):
                        raise RuntimeError(f"{name}: the step could not be planned")
                inputs = {"input_ids": token, "position_ids": None}
                cache.start_planned(inputs)
                with OpCount() as count:
                    logits = model(**inputs, cache=cache).logits
                token = logits[:, -1:].argmax(-1)
            row.planning_ops, row.planning_host_reads = planning.ops, planning.host_reads
        if isinstance(cache, PoolCache):
            cache.release()
    row.ops, row.host_reads = count.ops, count.host_reads
    return row


def count_decode_ops(
    model: PreTrainedModel,
    ids: torch.Tensor,
    attentions: tuple[str | None, ...] = (None,),
    caches: tuple[str, ...] = tuple(CACHES),
) -> list[OpRow]:
    """``DynamicCache`` under the model's own attention, then each of our ``caches`` under each of ``attentions``
    (``None``: the model's own), eager and planned.

    Args:
        ids: ``[batch, length]`` prompt ids, no padding.

    Returns:
        The rows, ``DynamicCache``'s first, with their ratios to it.
    """
    rows = [count_step(model, ids, "dynamic", planned=False)]
    for attention in attentions:
        with model_attention(model, attention):
            for name in caches:
                if CACHES[name] is not None:
                    rows += [count_step(model, ids, name, planned) for planned in (False, True)]
    base = rows[0]
    return [
        dataclasses.replace(
            row,
            ops_vs_dynamic=row.ops / base.ops,
            page_ops_vs_dynamic=None if row.page_ops is None else row.page_ops / base.page_ops,
        )
        for row in rows
    ]


def markdown_table(rows: list[OpRow]) -> str:
    lines = [
        "| cache | attention | step | aten ops | vs DynamicCache | host reads | planning ops | reads (eager step) "
        "| a page of steps vs DynamicCache |",
        "|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        reads = ", ".join(f"{path} {count}" for path, count in row.reads.items() if count)
        page = "" if row.page_ops_vs_dynamic is None else f"{row.page_ops_vs_dynamic:.2f}x"
        cells = (row.cache, row.attention, row.step, f"{row.ops:,}", f"{row.ops_vs_dynamic:.2f}x")
        lines.append("| " + " | ".join((*cells, str(row.host_reads), str(row.planning_ops), reads, page)) + " |")
    return "\n".join(lines)
