"""Helper functions shared by the tests: padded batches and random ids, greedy runs, teacher-forced logits, threads
started together, comparing generations.

A working ``cache_config`` per cache name is its registry entry's ``example_config``
(``hf_kvcache.integration.registry.REGISTRY``); ``conftest.py`` has the ``cache_name`` and ``make_pool`` fixtures."""

import threading

import torch

from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.testing import random_padded_batch

WAIT_SECONDS = 120  # a generous bound on how long a thread waits for another; only reached if one hangs


def example_config(name: str) -> dict:
    """A copy of the registered cache ``name``'s ``example_config``, to add keys to."""
    return dict(REGISTRY[name].example_config)


def exact_config(name: str, length: int) -> dict:
    """A cache_config under which ``name`` keeps every one of ``length`` tokens exactly (so it equals DynamicCache)."""
    config = example_config(name)
    if "window" in config:
        config.update(window=length, sink_tokens=0)
    if name in ("quantized_values", "quantized_kv"):
        config["residual_length"] = length  # attention gets every value in full precision
    if name == "quantized_kv":  # keys are encoded when their page fills: one page larger than the rows never does
        config["page_size"] = length + 2 - length % 2
    return config


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


def random_ids(batch: int, length: int, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    """``[batch, length]`` random token ids in ``[1, vocab)`` (no padding), the same for the same seed."""
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def teacher_forced_logits(model, ids: torch.Tensor, cache, chunks: list[int]) -> torch.Tensor:
    """The model's logits ``[batch, seq_len, vocab]`` over ``ids`` fed through ``cache`` in chunks of the given
    sizes (the last size repeated to the end): a prefill, then decode steps or prefill chunks."""
    logits, start = [], 0
    while start < ids.shape[1]:
        size = chunks[min(len(logits), len(chunks) - 1)]
        logits.append(model(ids[:, start : start + size], cache=cache).logits)
        start += size
    return torch.cat(logits, dim=1)


def assert_beams_and_sampling_match(
    model, ids: torch.Tensor, mask: torch.Tensor, name: str, max_new_tokens: int, num_return_sequences: int, seed: int
) -> None:
    """Beam search (4 beams) and seeded sampling (``num_return_sequences`` each) through our cache ``name`` give
    exactly the tokens they give with transformers' default cache."""
    beams = {"num_beams": 4, "max_new_tokens": max_new_tokens}
    assert torch.equal(
        model.generate(ids, attention_mask=mask, **beams),
        model.generate(ids, attention_mask=mask, cache_implementation=name, **beams),
    )
    sampling = {"do_sample": True, "num_return_sequences": num_return_sequences, "max_new_tokens": max_new_tokens}
    torch.manual_seed(seed)
    expected = model.generate(ids, attention_mask=mask, **sampling)
    torch.manual_seed(seed)
    assert torch.equal(expected, model.generate(ids, attention_mask=mask, cache_implementation=name, **sampling))


def run_threads(work, count: int) -> dict[int, BaseException]:
    """Runs ``work(i)`` for ``i < count`` in threads started together; returns what each raised."""
    errors: dict[int, BaseException] = {}
    barrier = threading.Barrier(count)

    def target(i: int) -> None:
        try:
            barrier.wait(WAIT_SECONDS)
            work(i)
        except BaseException as error:  # reported by the test, which fails on any
            errors[i] = error

    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_SECONDS)
    assert not any(thread.is_alive() for thread in threads), "a generate thread hangs"
    return errors
