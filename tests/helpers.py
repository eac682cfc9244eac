"""Helpers shared by the cache tests: padded batches, greedy runs, and one working cache_config per cache name."""

import torch

EXAMPLE_CACHE_CONFIGS = {
    "paged_pool": {},
    "sliding_ring": {"window": 16, "sink_tokens": 2},
    "quantized_values": {"bits": 4, "group_size": 16},
}
"""A cache_config that works on a full-attention model, for each registered name (tests iterate the registry)."""


EXAMPLE_POOL_FORMATS = {"quantized_values": {"value_bits": 4, "value_group_size": 16}}
"""``KVPool.for_model`` keywords of a pool the example cache_config can draw from."""


def example_cache_config(name: str) -> dict:
    if name not in EXAMPLE_CACHE_CONFIGS:
        raise KeyError(f"Add a working cache_config for the newly registered {name!r} to tests/helpers.py.")
    return dict(EXAMPLE_CACHE_CONFIGS[name])


def padded_batch(lengths: list[int], vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token rows of the given lengths, left-padded with token 0."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(1, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def run(model, ids, mask, **kwargs):
    return model.generate(
        ids, attention_mask=mask, do_sample=False, return_dict_in_generate=True, output_logits=True, **kwargs
    )


def assert_same_generation(reference, candidate):
    assert torch.equal(reference.sequences, candidate.sequences)
    for step, (expected, actual) in enumerate(zip(reference.logits, candidate.logits, strict=True)):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=f"logits differ at step {step}")
