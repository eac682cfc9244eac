"""Serving with compiled steps: ``warmup`` checks its arguments before any work, a compiled call gives its pages back
when its cache is released, requests in other threads survive a compile, and after ``warmup`` requests on a busy
pool compile nothing."""

import pytest
import torch
from transformers import CompileConfig

from hf_kvcache.testing import tiny_llama


@pytest.fixture
def compile_config() -> CompileConfig:
    config = CompileConfig(mode="default", fullgraph=True)
    config._compile_all_devices = True  # a class attribute in transformers 5.24, not a constructor argument
    return config


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.config.error_on_recompile = False
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("arguments", "error", "named"),
    [
        ({"batch_sizes": 2}, TypeError, "batch_sizes=2"),
        ({"batch_sizes": (1.5,)}, TypeError, r"batch_sizes=\(1.5,\)"),
        ({"batch_sizes": (True,)}, TypeError, r"batch_sizes=\(True,\)"),
        ({"batch_sizes": ()}, ValueError, r"batch_sizes=\(\)"),
        ({"batch_sizes": (1, 0)}, ValueError, r"batch_sizes=\(1, 0\)"),
        ({"max_tokens": 100.0}, TypeError, "max_tokens=100.0"),
        ({"max_tokens": 9}, ValueError, "max_tokens=9"),
        ({"prompt_tokens": 0}, ValueError, "prompt_tokens=0"),
        ({"prompt_tokens": "8"}, TypeError, "prompt_tokens='8'"),
        ({"cache_config": [("max_tokens", 64)]}, TypeError, "cache_config="),
        ({"compile_config": {"mode": "default"}}, TypeError, "compile_config="),
        ({"cache_implementation": 3}, TypeError, "cache_implementation=3"),
        ({"cache_implementation": "static"}, ValueError, "cache_implementation='static'"),
        ({"model": "HuggingFaceTB/SmolLM2-135M"}, TypeError, "model=str"),
    ],
)
def test_warmup_names_a_bad_argument_before_any_work(compile_config, monkeypatch, arguments, error, named):
    """Every argument is checked before the first ``generate``: the error names the argument, its value and what is
    allowed."""
    from hf_kvcache import warmup

    model = tiny_llama()
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: pytest.fail("warmup ran a generation"))
    call = {"cache_implementation": "paged_pool", "max_tokens": 64, "compile_config": compile_config, **arguments}
    model, name = call.pop("model", model), call.pop("cache_implementation")
    with pytest.raises(error, match=named):
        warmup(model, name, **call)
