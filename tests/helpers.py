"""Helper functions shared by the cache tests: padded batches, greedy runs, comparing generations.

A working ``cache_config`` per cache name is its registry entry's ``example_config``
(``hf_kvcache.registry.REGISTRY``); ``conftest.py`` has the ``cache_name`` and ``make_pool`` fixtures."""

import torch

from hf_kvcache.models import random_padded_batch
from hf_kvcache.registry import REGISTRY


def example_config(name: str) -> dict:
    """A copy of the registered cache ``name``'s ``example_config``, to add keys to."""
    return dict(REGISTRY[name].example_config)


def padded_batch(lengths: list[int], vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token rows of the given lengths, left-padded with token 0, and their attention mask."""
    return random_padded_batch(lengths, vocab, torch.Generator().manual_seed(seed))


def run(model, ids, mask, **kwargs):
    return model.generate(
        ids, attention_mask=mask, do_sample=False, return_dict_in_generate=True, output_logits=True, **kwargs
    )


def assert_same_generation(reference, candidate):
    assert torch.equal(reference.sequences, candidate.sequences)
    for step, (expected, actual) in enumerate(zip(reference.logits, candidate.logits, strict=True)):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=f"logits differ at step {step}")
