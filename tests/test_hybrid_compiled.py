"""Compiled decoding on hybrid models: the attention layers' steps are planned on the pool, transformers' own
linear-attention and convolution layers update their states in place (static addresses), and ``generate`` compiles
the decode step once (separate from ``test_hybrid_models.py``: each compile takes tens of seconds on a CPU)."""

import pytest
import torch

from hf_kvcache.testing import tiny_hybrid
from tests.helpers import random_ids

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2"])
def test_compiled_decoding_on_a_hybrid_equals_dynamic_cache_in_one_graph(compile_config, model_type):
    model = tiny_hybrid(model_type)
    ids = random_ids(2, 9)
    settings = {"max_new_tokens": 12, "do_sample": False}
    expected = model.generate(ids, **settings)
    actual = model.generate(ids, cache_implementation="paged_pool", compile_config=compile_config, **settings)
    assert torch.equal(actual, expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
