"""One rank of ``test_multi_device.py``'s tensor-parallel run: ``torchrun --nproc-per-node 2 torchrun_worker.py DIR``.

Loads each tiny model saved under ``DIR`` (``TP_MODELS``) with ``tp_plan="auto"``, generates every case of
``cases()``, runs requests that do not fit their pool, and writes what it saw to ``DIR/rank<N>.json``.
``test_multi_device.py`` runs the same cases on the unsharded models (``run_case``).
"""

import functools
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from helpers import exact_config, example_config
from transformers import AutoModelForCausalLM, PreTrainedModel, StoppingCriteria

import hf_kvcache
from hf_kvcache import KVPool, PagedConfig, PoolExhaustedError
from hf_kvcache.attention.interface import model_attention
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.memory import device_memory
from hf_kvcache.memory import pools as pool_module
from hf_kvcache.testing import tiny_gemma3, tiny_llama
from hf_kvcache.transformers_internals import tensor_parallel_group

TP_HEADS = {"num_attention_heads": 8, "num_key_value_heads": 4}
"""4 KV heads: 2 on each of 2 ranks."""

TP_MODELS = {
    "llama": functools.partial(tiny_llama, **TP_HEADS),
    "gemma3": functools.partial(tiny_gemma3, **TP_HEADS),  # 3 sliding (window 8) layers + 1 full: hybrid
}

PROMPTS = [[5, 9, 17, 33, 4, 8, 21, 70, 11, 3, 99, 42], [5, 9, 17, 33, 4, 8, 21, 70, 11, 3, 99, 42], [60, 7, 13, 88]]
"""Two identical rows (they share their prompt's pages) and a shorter one; 12 + 10 tokens cross pages of 4."""
MAX_NEW_TOKENS = 10
PAGE_SIZE = 4
SMALL_POOL_TOKENS = 3 * PAGE_SIZE
"""A pool for 3 pages per layer group: one row of 12 + 10 tokens outgrows it while decoding (or, for a ring that
takes its pages at the first write, at the prefill)."""
RANK1_MEMORY_FRACTION = pool_module.DEFAULT_MAX_MEMORY_FRACTION / 10
"""Rank 1's default pools may hold a tenth of rank 0's: the ranks must agree on the smaller budget."""


def cases() -> dict[str, tuple[str | None, dict[str, Any] | None]]:
    """``{case: (cache_implementation, cache_config)}``: DynamicCache, then each registered cache with a config
    that keeps every token exactly (``name/exact``: its tokens equal DynamicCache's) and, where that differs, its
    example config (``name/example``, which drops or rounds tokens: its tokens equal the unsharded model's)."""
    found: dict[str, tuple[str | None, dict[str, Any] | None]] = {"dynamic": (None, None)}
    for name in REGISTRY:
        exact = {"page_size": PAGE_SIZE, **exact_config(name, len(PROMPTS[0]) + MAX_NEW_TOKENS)}  # its own, if any
        example = {**example_config(name), "page_size": PAGE_SIZE}
        found[f"{name}/exact"] = (name, exact)
        if example != exact:
            found[f"{name}/example"] = (name, example)
    return found


def batch(num_rows: int = len(PROMPTS)) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_rows`` of ``PROMPTS``, left-padded with 0, and their attention mask."""
    prompts = PROMPTS[:num_rows]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # [rows, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [rows, width]
    return ids, mask


class CountSteps(StoppingCriteria):
    """Counts the tokens ``generate`` has produced (it asks after each one); never stops it."""

    def __init__(self) -> None:
        self.num_tokens = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.num_tokens += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_case(
    model: PreTrainedModel,
    name: str | None,
    cache_config: dict[str, Any] | None,
    num_rows: int = len(PROMPTS),
    steps: CountSteps | None = None,
) -> dict[str, Any]:
    """Greedy tokens of the batch under the cache's recommended attention, and the statistics of each of its pools."""
    ids, mask = batch(num_rows)
    with model_attention(model, REGISTRY[name].attn_implementation if name else None):
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            cache_implementation=name,
            cache_config=cache_config,
            return_dict_in_generate=True,
            stopping_criteria=[steps] if steps else None,
        )
    result: dict[str, Any] = {"tokens": out.sequences[:, ids.shape[1] :].tolist()}
    if name is not None:
        result["num_kv_heads"] = out.cache.placement.num_kv_heads
        result["pools"] = {str(device): pool.stats() for device, pool in out.cache.pools.items()}
    return result


def exhaust(model: PreTrainedModel, name: str, cache_config: dict[str, Any]) -> dict[str, Any]:
    """Runs one row that does not fit the pool; says how and when it failed (every rank must, and none may hang)."""
    steps = CountSteps()
    try:
        run_case(model, name, cache_config, num_rows=1, steps=steps)
    except PoolExhaustedError as error:
        return {
            "error": type(error).__name__,
            "new_tokens_before": steps.num_tokens,
            "requested_pages": error.requested_pages,
            "free_pages": error.free_pages,
            "total_pages": error.total_pages,
            "message": str(error),
        }
    return {"error": None, "new_tokens_before": steps.num_tokens}


def main() -> None:
    root, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    if rank == 1:  # before any default pool is made
        pool_module.DEFAULT_MAX_MEMORY_FRACTION = RANK1_MEMORY_FRACTION
    results: dict[str, Any] = {"hf_kvcache": hf_kvcache.__file__}
    for model_name in TP_MODELS:
        model = AutoModelForCausalLM.from_pretrained(root / model_name, tp_plan="auto")
        results[f"{model_name}/tp"] = {
            "tp_size": model.tp_size,
            "process_group_size": tensor_parallel_group(model).size(),
        }
        for case, (name, cache_config) in cases().items():
            results[f"{model_name}/{case}"] = run_case(model, name, cache_config)
        # Without admission, the request starts and runs out mid-generation (on every rank at the same step).
        small = {"page_size": PAGE_SIZE, "max_tokens": SMALL_POOL_TOKENS, "admission_check": False}
        for name in REGISTRY:
            results[f"{model_name}/exhausted/{name}"] = exhaust(model, name, {**example_config(name), **small})
        results[f"{model_name}/refused"] = exhaust(model, "paged_pool", {**small, "admission_check": True})
        # Pools of different sizes on the two ranks: rank 1's runs out, and rank 0 stops with it.
        pool = KVPool.for_model(model, PagedConfig(page_size=PAGE_SIZE), max_tokens=SMALL_POOL_TOKENS if rank else 64)
        results[f"{model_name}/uneven"] = exhaust(model, "paged_pool", {"pool": pool, "admission_check": False})
        gc.collect()  # the failed request's cache: its pages go back
        results[f"{model_name}/uneven"]["pages_used_after"] = pool.stats()["pages_used"]
    results["budget"] = {
        "own": int(device_memory.memory_limit_bytes() * pool_module.DEFAULT_MAX_MEMORY_FRACTION),
        "agreed": KVPool.default_budget("cpu").total_bytes,
    }
    (root / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
