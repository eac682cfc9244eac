"""Compiled decoding on models of several geometries (Gemma 4, MiMo-V2-Flash) and with cross-attention layers
(Mllama): the steps of each geometry's layer groups are planned on their own part of the pool, and ``generate``
compiles the decode step once where the cache is compileable (apart from ``test_geometry_groups.py``: each compile
takes tens of seconds on a CPU)."""

import pytest
import torch

from hf_kvcache.testing import tiny_causal_lm
from tests.helpers import exact_config, random_ids
from tests.test_cross_attention import image_inputs, tiny_mllama

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("model_type", ["gemma4_text", "mimo_v2_flash"])
@pytest.mark.parametrize("cache_name", ["paged_pool", "quantized_kv"])
def test_compiled_decoding_equals_dynamic_cache_in_one_graph(compile_config, model_type, cache_name):
    model = tiny_causal_lm(model_type)
    ids = random_ids(2, 9, vocab=256)
    settings = {"max_new_tokens": 10, "do_sample": False}
    expected = model.generate(ids, **settings)
    config = {**exact_config(cache_name, 20), **({"group_size": 8} if cache_name == "quantized_kv" else {})}
    actual = model.generate(
        ids, cache_implementation=cache_name, cache_config=config, compile_config=compile_config, **settings
    )
    assert torch.equal(actual, expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_compiled_decoding_with_an_image_equals_dynamic_cache_in_one_graph(compile_config):
    """The image's keys sit in a StaticLayer written at the prefill; the compiled steps read them where they lie."""
    model = tiny_mllama()
    ids = random_ids(2, 9)
    settings = {"max_new_tokens": 8, "do_sample": False, **image_inputs(2, 9)}
    expected = model.generate(ids, **settings)
    actual = model.generate(ids, cache_implementation="paged_pool", compile_config=compile_config, **settings)
    assert torch.equal(actual, expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
