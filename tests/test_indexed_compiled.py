"""Compiled decoding of indexed-attention layers (DeepSeek-V3.2, GLM-MoE-DSA): each layer's keys and values are
planned on the pool as any attention layer's, its lightning indexer's keys sit in an ``IndexerRing`` written in place
at slots planned before the step (``IndexerKeys.plan_indexer``), and ``generate`` compiles the decode step once, with
the tokens of eager decoding, of ``DynamicCache`` and of transformers' ``StaticCache`` compiled (separate from
``test_indexed_attention.py``: each compile takes 10 to 40 seconds on a CPU).

Tiny random-init models whose indexer keeps 4 keys a query (``index_topk``), so that every step feels the sparsity."""

import pytest
import torch

from hf_kvcache.bench.model_matrix import MATRIX_CONFIGS
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.integration.seams import build_cache
from hf_kvcache.layers.plan import capacity_bucket
from hf_kvcache.testing import random_padded_batch, tiny_causal_lm
from tests.test_compiled import HostReads, decode_step

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

NEW_TOKENS = 24
WINDOW = {"window": 10, "sink_tokens": 0, "page_size": 4}  # prompts of 9 and 6: the window fills, then slides
CONFIGS = {
    "paged_pool": {},
    "sliding_ring": WINDOW,
    **{name: MATRIX_CONFIGS[name] for name in ("quantized_values", "quantized_kv")},
}
"""The ``cache_config`` of each cache here; the quantized ones lossy (the matrix's: compiled against eager)."""


def tiny(model_type: str):
    return tiny_causal_lm(model_type, index_topk=4)


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def padded() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 9 and 6 tokens, left-padded, and their attention mask."""
    return random_padded_batch([9, 6], 128, torch.Generator().manual_seed(1), low=3)


def generate(model, ids, mask, name=None, compile_config=None, **kwargs):
    if name is not None:
        kwargs = {"cache_implementation": name, "cache_config": CONFIGS.get(name, {})} | kwargs
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "compile_config": compile_config} | kwargs
    return model.generate(ids, attention_mask=mask, **settings)


def test_every_cache_compiles_an_indexed_model():
    model = tiny("deepseek_v32")
    for name in REGISTRY:
        assert build_cache(name, model, dict(CONFIGS.get(name, REGISTRY[name].example_config))).is_compileable


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_compiled_paged_pool_generates_the_tokens_of_eager_dynamic_and_static_cache_in_one_graph(
    compile_config, model_type
):
    model = tiny(model_type)
    ids, mask = padded()
    reference = generate(model, ids, mask)
    assert torch.equal(generate(model, ids, mask, "paged_pool"), reference)
    assert torch.equal(generate(model, ids, mask, "paged_pool", compile_config), reference)
    assert graphs() == 1  # 24 steps, one graph
    assert torch.equal(
        generate(model, ids, mask, compile_config=compile_config, cache_implementation="static"), reference
    )


def test_compiled_decoding_under_our_attention_generates_the_tokens_of_dynamic_cache(compile_config):
    """Under ``attn_implementation="hf_kvcache"`` our attention folds the indexer's picks into the mask of the keys
    the planned step gathers."""
    model = tiny("deepseek_v32")
    ids, mask = padded()
    reference = generate(model, ids, mask)
    model.set_attn_implementation("hf_kvcache")
    try:
        compiled = generate(model, ids, mask, "paged_pool", compile_config)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(compiled, reference)
    assert graphs() == 1


@pytest.mark.parametrize("name", ["sliding_ring", "quantized_values", "quantized_kv"])
def test_compiled_caches_generate_the_tokens_of_eager_in_one_graph(compile_config, name):
    """A window that fills and slides (the indexer reads its ring from the window's first token), and the quantized
    caches' codes: the tokens of the same cache decoding eager."""
    model = tiny("deepseek_v32")
    ids, mask = padded()
    eager = generate(model, ids, mask, name)
    assert torch.equal(generate(model, ids, mask, name, compile_config), eager)
    assert graphs() == 1


def test_compiled_beams_generate_the_tokens_of_dynamic_cache(compile_config):
    """transformers compiles no beam search (no graph): the rings move with the beams in eager steps."""
    model = tiny("deepseek_v32")
    ids, mask = padded()
    reference = generate(model, ids, mask, num_beams=2, max_new_tokens=8)
    compiled = generate(model, ids, mask, "paged_pool", compile_config, num_beams=2, max_new_tokens=8)
    assert torch.equal(compiled, reference)
    assert graphs() == 0


def test_one_graph_per_capacity_bucket_and_a_crop_under_compile(compile_config):
    """Lengths of one capacity bucket share a graph; a longer generation reads a bucket more (the pages' reads and
    the indexer's ring grow together): one graph more. A cache cropped back into its tokens continues compiled."""
    model = tiny("deepseek_v32")
    config = {"page_size": 4}
    out = generate(model, *padded(), "paged_pool", compile_config, cache_config=config, return_dict_in_generate=True)
    assert graphs() == 1
    ring = out.cache.layers[0].indexer.keys
    assert ring.shape[1] == capacity_bucket(-(-(9 + NEW_TOKENS - 1) // 4)) * 4  # [batch, 32 slots, index_head_dim]
    assert out.cache.memory_stats()["state_bytes"] == 2 * ring.nbytes  # both layers' rings
    torch._dynamo.config.error_on_recompile = True
    for length in (6, 8):  # 6 + 23 and 8 + 23 tokens held: 8 pages of 4 either way, as 9 + 23
        ids, mask = random_padded_batch([length, 5], 128, torch.Generator().manual_seed(length), low=3)
        compiled = generate(model, ids, mask, "paged_pool", compile_config, cache_config=config)
        assert torch.equal(compiled, generate(model, ids, mask))
    assert graphs() == 1
    cache = out.cache
    cache.crop(-8)  # back into the generated tokens, then on with the same cache (and its graph)
    cont = out.sequences[:, : cache.get_seq_length() + 1]
    mask = torch.cat([padded()[1], torch.ones(2, cont.shape[1] - 9, dtype=torch.long)], dim=1)
    expected = generate(model, cont, mask, max_new_tokens=6)
    assert torch.equal(generate(model, cont, mask, None, compile_config, max_new_tokens=6, cache=cache), expected)
    torch._dynamo.config.error_on_recompile = False
    ids, mask = padded()
    longer = generate(model, ids, mask, "paged_pool", compile_config, cache_config=config, max_new_tokens=40)
    assert torch.equal(longer, generate(model, ids, mask, max_new_tokens=40))
    assert graphs() == 2  # 48 tokens held: 12 pages of 4, a bucket more


def planned_and_eager_twins(name: str):
    """The tiny DeepSeek-V3.2, two caches of ``CONFIGS[name]`` after the same padded prompt and one decode step (the
    first set to plan its steps, as ``generate`` sets it when it compiles), the next token and the step's mask."""
    model = tiny("deepseek_v32")
    ids, mask = padded()
    settings = {"max_new_tokens": 2, "cache_config": CONFIGS[name], "cache_implementation": name}
    planned, eager = (generate(model, ids, mask, return_dict_in_generate=True, **settings).cache for _ in range(2))
    planned.compiled_decoding = True
    token = generate(model, ids, mask, **settings)[:, -1:]
    return model, planned, eager, token, torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], dim=1)


def poison(cache) -> None:
    """Large keys in every ring slot that holds none of the rows' tokens: a step that read one under a column the
    model's mask leaves open, or let the indexer pick one over a row's token, would differ."""
    for layer in cache.layers:
        ring = layer.indexer.keys  # [batch, capacity, index_head_dim]
        held = min(cache.get_seq_length(), layer.rows.reach if layer.window else ring.shape[1])
        slots = torch.arange(cache.get_seq_length() - held, cache.get_seq_length()) % ring.shape[1]
        unheld = torch.ones(ring.shape[1], dtype=torch.bool)
        unheld[slots] = False
        ring[:, unheld] = 1e3


@pytest.mark.parametrize("name", ["paged_pool", "sliding_ring"])
def test_planned_steps_compute_what_eager_steps_do(name):
    """Planned steps run eagerly (no compiler numerics) against eager steps on a twin cache, the ring's free slots
    poisoned, past a window's slide and a crop back into the planned tokens: the same logits at every step."""
    model, planned, eager, token, mask = planned_and_eager_twins(name)
    poison(planned)
    with torch.no_grad():
        for step in range(16):  # tokens 11 to 26: the window of 10 slides, the ring of 13 wraps
            if step == 8:  # back into the tokens the planned steps wrote, on both caches
                planned.end_planning()
                planned.crop(-3)
                eager.crop(-3)
                token, mask = token * 0 + 7, mask[:, :-3]
                poison(planned)
            logits = decode_step(model, planned, token, mask, planned=True)
            assert planned.layers[0]._read_slots is planned.layers[1]._read_slots  # planned once for the group
            reference = decode_step(model, eager, token, mask)
            assert (logits - reference).abs().max() < 1e-5, step
            token = reference.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)


@pytest.mark.parametrize("name", ["paged_pool", "sliding_ring"])
def test_a_planned_step_reads_nothing_back_to_the_host(name):
    """The indexer's slots are planned before the forward pass: the step itself (the model's indexer and top-k
    included) reads no value back to the host."""
    model, planned, _, token, mask = planned_and_eager_twins(name)
    inputs = {"input_ids": token, "attention_mask": mask, "position_ids": mask.sum(-1, keepdim=True) - 1}
    assert planned.plan_decode(token.shape[0], 1, mask)
    planned.start_planned(inputs)
    with torch.no_grad(), HostReads() as reads:
        model(**inputs, cache=planned)
    assert reads.reads == 0
