"""Padding the cache skips must be padding where the cache holds it.

The cache takes each row's leading padding from the 2-D attention mask and holds no page for its whole pages (the
null page stands in for them). CPM-Ant puts 32 prompt tokens of its own in front of the input inside its forward pass,
so the cache's first tokens are those prompt tokens, not the padding the mask shows: pages skipped there would keep
real tokens on the null page, which every padded row writes and reads. Batches of several rows padded by different
amounts, through every cache, against ``DynamicCache``; the null page stays untouched.
"""

import functools

import pytest
import torch

from hf_kvcache import KVPool
from hf_kvcache.bench import model_matrix as matrix
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.memory.allocator import NULL_PAGE
from hf_kvcache.testing import random_padded_batch, tiny_causal_lm

NEW_TOKENS = 4
CONFIGS = {
    "paged_pool": {"page_size": 4},
    "sliding_ring": {"window": 64, "sink_tokens": 2, "page_size": 4},  # longer than the sequence: keeps every token
    "quantized_values": {"bits": 8, "residual_length": 2, "page_size": 4},
    "quantized_kv": {"key_bits": 8, "value_bits": 8, "residual_length": 2, "page_size": 4},
}
LENGTHS = [(3, 11, 6), (2, 9, 5), (1, 4, 13, 7)]  # two or three rows padded, by whole pages and parts of them


tiny = functools.cache(tiny_causal_lm)


def greedy(model, lengths, **settings):
    ids, mask = random_padded_batch(list(lengths), model.config.vocab_size, torch.Generator().manual_seed(0), low=3)
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            return_dict_in_generate=True,
            output_logits=True,
            **settings,
        )


def null_page(pool: KVPool) -> list[torch.Tensor]:
    """Every storage tensor's slots of the null page, as views."""
    storage = pool.pages.storage
    tensors = (storage.keys, storage.values, storage.value_scales, storage.key_scales, storage.key_zeros)
    return [tensor[:, :, NULL_PAGE] for tensor in tensors if tensor is not None]


@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda lengths: "-".join(map(str, lengths)))
@pytest.mark.parametrize("cache", sorted(CONFIGS))
def test_cpmant_padded_rows_equal_dynamic_cache_and_leave_the_null_page_alone(cache, lengths):
    model = tiny("cpmant")
    reference = greedy(model, lengths)
    config = dict(CONFIGS[cache])
    pool = KVPool.for_model(model, REGISTRY[cache].config(config), max_tokens=1024)
    for slots in null_page(pool):
        slots.zero_()
    run = greedy(model, lengths, cache_implementation=cache, cache_config={**config, "pool": pool})
    outcome = matrix.compare("cpmant", matrix.OWN, cache, reference, run)
    assert outcome.status == ("close" if cache in matrix.LOSSY else "equal"), outcome
    assert all(not slots.any() for slots in null_page(pool)), "a padded row wrote to the null page"
