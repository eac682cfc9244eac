"""Reliability: bad input fails early with an error that names the value and the setting; a short soak.

Every registered name gets the shared keys over its example config, and each cache its own keys (window,
sink_tokens, bits, group_size, residual_length) too.
"""

import gc

import pytest
import torch
from helpers import example_config
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    MambaConfig,
    MambaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from hf_kvcache import IncompatibleModelError
from hf_kvcache.bench.soak import run_soak
from hf_kvcache.integration.registry import REGISTRY

MIB = 2**20


def generate(model, name: str, cache_config: dict, ids=None, **kwargs):
    ids = torch.tensor([[5, 6, 7]]) if ids is None else ids
    return model.generate(
        ids,
        max_new_tokens=kwargs.pop("max_new_tokens", 2),
        do_sample=False,
        cache_implementation=name,
        cache_config=cache_config,
        **kwargs,
    )


# ----- cache_config -----------------------------------------------------------------------------

SHARED_KEY_ERRORS = [
    (
        {"no_such_key": 1},
        ValueError,
        r"Unknown cache_config keys \['no_such_key'\].*valid keys are \[.*'admission_check'",
    ),
    ({"page_size": "16"}, TypeError, r"page_size must be an int, got '16' \(str\)"),
    ({"page_size": 0}, ValueError, r"page_size=0 is out of range: choose 1 <= page_size <= 4096"),
    ({"page_size": 4097}, ValueError, r"page_size=4097 is out of range"),
    ({"max_tokens": "64"}, TypeError, r"max_tokens must be an int, got '64' \(str\)"),
    ({"max_tokens": 0}, ValueError, r"max_tokens=0 is out of range: choose max_tokens >= 1"),
    ({"pool": 3}, TypeError, r"pool must be a KVPool or a pool's name, got 3 \(int\)"),
    ({"pool": "no-such-pool"}, ValueError, r"No pool named 'no-such-pool'"),
    ({"admission_check": "yes"}, TypeError, r"admission_check must be True, False or None, got 'yes' \(str\)"),
]
OWN_KEY_ERRORS = {
    "sliding_ring": [
        ({"window": True}, TypeError, r"window must be an int, got True \(bool\)"),
        ({"window": 16, "sink_tokens": 1.5}, TypeError, r"sink_tokens must be an int, got 1.5 \(float\)"),
    ],
    "quantized_values": [
        ({"group_size": "16"}, TypeError, r"group_size must be an int, got '16' \(str\)"),
        ({"residual_length": 2.0}, TypeError, r"residual_length must be an int, got 2.0 \(float\)"),
        ({"group_size": 32}, ValueError, r"group_size=32 does not divide the model's head_dim=16; choose one of"),
    ],
    "quantized_kv": [
        ({"key_bits": 2}, ValueError, r"key_bits=2 is not supported: choose key_bits=8 or key_bits=4"),
        ({"value_bits": "4"}, TypeError, r"value_bits must be an int, got '4' \(str\)"),
        ({"page_size": 7}, ValueError, r"page_size=7 is odd: key_bits=4 packs two tokens per byte"),
        ({"group_size": 32}, ValueError, r"group_size=32 does not divide the model's head_dim=16; choose one of"),
    ],
}
CASES = [(name, *case) for name in sorted(REGISTRY) for case in SHARED_KEY_ERRORS + OWN_KEY_ERRORS.get(name, [])]


@pytest.mark.parametrize("name,cache_config,error,match", CASES)
def test_bad_cache_config_names_the_key_and_the_value(tiny_llama_model, name, cache_config, error, match):
    with pytest.raises(error, match=match):
        generate(tiny_llama_model, name, example_config(name) | cache_config)


def test_cache_config_that_is_not_a_dict_is_rejected(tiny_llama_model, cache_name):
    with pytest.raises(TypeError, match=r"cache_config='paged' \(str\): give a \w+Config or a dict of its keys \[.*\]"):
        generate(tiny_llama_model, cache_name, "paged")


AS_GIVEN_ERRORS = {
    "paged_pool": [
        (
            {"page_sise": 8},
            ValueError,
            r"Unknown cache_config keys \['page_sise'\].*valid keys are \['page_size', 'pool', 'max_tokens', "
            r"'admission_check', 'prefix_caching', 'prefix_namespace', 'prefix_host_bytes', 'prefix_disk_dir', "
            r"'prefix_disk_bytes', 'prefix_store'\]",
        ),
        ({"page_size": 0}, ValueError, "page_size=0 is out of range"),
        ({"page_size": "16"}, TypeError, "page_size must be an int"),
        ({"max_tokens": -3}, ValueError, "max_tokens=-3 is out of range"),
        ({"pool": "no-such-pool"}, ValueError, "No pool named 'no-such-pool'"),
        ({"pool": 3}, TypeError, "must be a KVPool or a pool's name"),
        ({"dtype": torch.float16}, ValueError, "Unknown cache_config keys"),
    ],
    "sliding_ring": [
        ({}, ValueError, "cache_config window is required"),
        ({"window": 0}, ValueError, "window=0 is out of range"),
        ({"window": "64"}, TypeError, "window must be an int"),
        ({"window": 8, "sink_tokens": -1}, ValueError, "sink_tokens=-1 is out of range"),
        ({"windows": 8}, ValueError, r"Unknown cache_config keys \['windows'\].*'window', 'sink_tokens'"),
    ],
    "quantized_values": [
        ({"bits": 3}, ValueError, "bits=3 is not supported: choose bits=8 or bits=4"),
        ({"bits": "4"}, TypeError, "bits must be an int"),
        ({"group_size": 12}, ValueError, r"group_size=12 does not divide the model's head_dim=16; choose one of"),
        ({"group_size": 0}, ValueError, "group_size=0 is out of range"),
        ({"residual_length": -1}, ValueError, "residual_length=-1 is out of range"),
        ({"bit": 4}, ValueError, r"Unknown cache_config keys \['bit'\].*'bits', 'group_size', 'residual_length'"),
    ],
    "quantized_kv": [
        ({"bits": 4}, ValueError, r"Unknown cache_config keys \['bits'\].*'key_bits', 'value_bits', 'group_size'"),
    ],
}
"""Each cache's own bad ``cache_config``s, given as they are (not over its example config: a ring without a window)."""


@pytest.mark.parametrize(
    "name,cache_config,error,match", [(name, *case) for name, cases in AS_GIVEN_ERRORS.items() for case in cases]
)
def test_bad_cache_config_as_given_is_rejected(tiny_llama_model, name, cache_config, error, match):
    with pytest.raises(error, match=match):
        tiny_llama_model.generate(
            torch.tensor([[1, 2]]), max_new_tokens=2, cache_implementation=name, cache_config=cache_config
        )


# ----- pools and models that do not fit -------------------------------------------------------------


def test_pool_of_another_geometry_dtype_or_device_is_rejected(
    tiny_llama_model, tiny_gemma3_model, cache_name, make_pool
):
    mismatches = [
        (make_pool(tiny_gemma3_model, cache_name, max_tokens=64), r"num_layers 1 vs 2, num_layer_groups 4 vs 1"),
        (make_pool(tiny_llama_model, cache_name, max_tokens=64, dtype=torch.float16), "dtype torch.float16 vs"),
        # The meta device has no storage, so a pool on it stands for a pool on another device.
        (make_pool(tiny_llama_model, cache_name, max_tokens=64, device="meta"), r"device meta vs cpu"),
    ]
    for pool, match in mismatches:
        with pytest.raises(IncompatibleModelError, match=rf"built for another model or placement \({match}.*for_model"):
            generate(tiny_llama_model, cache_name, example_config(cache_name) | {"pool": pool})
        assert pool.stats()["pages_used"] == 0 and pool.stats()["live_tables"] == 0


def tiny_t5() -> T5ForConditionalGeneration:
    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0)
    return T5ForConditionalGeneration(config).eval()


def tiny_bart() -> BartForConditionalGeneration:
    sizes = {"encoder_layers": 1, "decoder_layers": 1, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}
    heads = {"encoder_attention_heads": 4, "decoder_attention_heads": 4}
    config = BartConfig(vocab_size=128, d_model=32, max_position_embeddings=64, **sizes, **heads)
    return BartForConditionalGeneration(config).eval()


def tiny_mamba() -> MambaForCausalLM:
    return MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=4)).eval()


UNSERVED_MODELS = [
    (tiny_t5, r"T5Config is an encoder-decoder model.*cache_implementation"),
    (tiny_bart, r"BartConfig is an encoder-decoder model.*cache_implementation"),
    (tiny_mamba, r"MambaConfig has layers of type \['linear_attention'\].*attention layers only.*cache_implementation"),
]


@pytest.mark.parametrize("build,match", UNSERVED_MODELS, ids=["t5", "bart", "mamba"])
def test_models_we_cannot_serve_are_rejected_with_what_to_use_instead(cache_name, build, match):
    torch.manual_seed(0)
    with pytest.raises(IncompatibleModelError, match=match):
        generate(build(), cache_name, example_config(cache_name))


# ----- requests -----------------------------------------------------------------------------------


def test_empty_prompt_is_rejected_before_the_model_runs(tiny_llama_model, cache_name):
    """Without this check the model itself fails on an empty prompt with an obscure reshape error (any cache)."""
    with pytest.raises(ValueError, match=r"The prompt is empty \(position_ids has shape \[1, 0\]\).*at least one"):
        generate(tiny_llama_model, cache_name, example_config(cache_name), ids=torch.zeros(1, 0, dtype=torch.long))


def test_max_new_tokens_zero_is_rejected_by_transformers_before_our_code(tiny_llama_model, cache_name, make_pool):
    """transformers' own generation-config check already names the value and the setting; no pool is touched."""
    pool = make_pool(tiny_llama_model, cache_name, max_tokens=64)
    with pytest.raises(ValueError, match=r"`max_new_tokens` must be greater than 0, but is 0"):
        generate(tiny_llama_model, cache_name, example_config(cache_name) | {"pool": pool}, max_new_tokens=0)
    assert pool.stats()["high_water_pages"] == 0 and pool.stats()["live_tables"] == 0


@pytest.mark.parametrize("prompt_length", [3, 30], ids=["growing", "past-the-ring"])
@pytest.mark.parametrize("model_name", ["tiny_llama_model", "tiny_mistral_model"])
def test_batch_of_another_size_is_rejected_without_a_change(model_name, cache_name, prompt_length, request, make_pool):
    """A cache holding 2 rows fed 3 (or 1), while it still grows and once its rings are full (window 8 or 16)."""
    model = request.getfixturevalue(model_name)
    pool = make_pool(model, cache_name, max_tokens=512, page_size=4)
    cache_class = REGISTRY[cache_name].cache_class
    cache = cache_class(model.config, example_config(cache_name) | {"pool": pool})
    ids = torch.randint(3, 128, (2, prompt_length), generator=torch.Generator().manual_seed(0))
    model.generate(ids, max_new_tokens=2, do_sample=False, cache=cache)
    held, tokens = pool.stats()["pages_used"], cache.get_seq_length()
    for rows in (3, 1):
        states = torch.randn(rows, 2, 1, 16)
        with pytest.raises(ValueError, match=rf"The cache holds 2 rows but a layer got {rows}.*reset\(\)"):
            cache.update(states, states, 0)
        assert pool.stats()["pages_used"] == held and cache.get_seq_length() == tokens
        pool.check_integrity()
    more = torch.randint(3, 128, (3, prompt_length + 3), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="The cache holds 2 rows but a layer got 3"):
        model.generate(more, max_new_tokens=2, do_sample=False, cache=cache)
    cache.reset()
    assert model.generate(more, max_new_tokens=2, do_sample=False, cache=cache).shape[0] == 3
    del cache
    gc.collect()
    assert pool.stats()["pages_used"] == 0


# ----- soak -----------------------------------------------------------------------------------------


def test_a_short_serving_soak_loses_nothing_and_leaks_nothing(tiny_gemma3_model):
    """A CI-sized soak (scripts/soak.py runs longer ones): threads on shared prefix-caching pools, the four caches,
    padding, beams, sampling, oversized requests and injected failures; every output equals the request alone."""
    report = run_soak(tiny_gemma3_model, 120, num_threads=4, seed=1)
    assert report.failures == 0, report.failure_examples
    assert report.pages_left == 0 and report.live_tables == 0
    assert report.outcomes.get("ok", 0) > 80 and report.tokens_generated > 0
    assert report.outcomes.get("refused_oversized", 0) > 0 and report.outcomes.get("injected", 0) > 0
    assert report.prefix_hits > 0  # the shared prefixes were reused
    assert report.rss_max_bytes - report.rss_start_bytes < 256 * MIB
    for stats in report.pools.values():
        assert 0 < stats["high_water_pages"] <= stats["pages_total"]
