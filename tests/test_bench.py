"""Tests for the benchmarks (hf_kvcache.bench: catalogue, decode, ring_update, prefix) on a tiny random Llama (and
prefix on tiny hybrids): structure and correctness only, never timings."""

import json
import math

import pytest
import torch
from transformers import PreTrainedModel

from hf_kvcache.bench.catalogue import CACHE_NAMES, FULL_CACHES, QUANTIZED_CACHES, RING_ATTENTION, SLIDING_CACHES
from hf_kvcache.bench.decode import run_decode_benchmark
from hf_kvcache.bench.decode_report import DecodeBenchConfig, DecodeResult, markdown_table, results_record
from hf_kvcache.bench.hybrid import hybrid_bench_model
from hf_kvcache.bench.prefix import (
    MODES,
    PrefixBenchConfig,
    random_token_stream,
    run_prefix_benchmark,
    run_prefix_parts,
)
from hf_kvcache.bench.prefix import markdown_table as prefix_markdown_table
from hf_kvcache.bench.prefix import results_record as prefix_results_record
from hf_kvcache.bench.ring_update import RingUpdateBenchConfig, RingUpdateResult, run_ring_update_benchmark
from hf_kvcache.bench.ring_update import markdown_table as update_markdown_table
from hf_kvcache.bench.ring_update import results_record as update_results_record
from hf_kvcache.eval import environment
from hf_kvcache.testing import tiny_llama

LENGTHS = (16, 40)  # the window exactly, and past a ring of two pages (it wraps)
BATCHES = (1, 3)
STEPS, WARMUP_STEPS = 2, 1
WINDOW = 16
PAGE_SIZE = 16
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 64  # the bench model's geometry (head_dim 64: quantized caches' groups)
EXACT_BYTES = 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * 4  # keys + values of one token, fp32
UPDATE_WINDOWS = (8, 17)  # inside one page, and one past a page
UPDATE_BATCHES = (1, 2)


@pytest.fixture(scope="module")
def bench_model() -> PreTrainedModel:
    """The tiny Llama with SmolLM2's head size, so quanto/hqq and our quantized caches take their default groups."""
    return tiny_llama(head_dim=HEAD_DIM)


@pytest.fixture(scope="module")
def results(bench_model: PreTrainedModel) -> list[DecodeResult]:
    generator = torch.Generator().manual_seed(0)
    stream = torch.randint(0, 128, (max(BATCHES) * max(LENGTHS),), generator=generator)
    config = DecodeBenchConfig(
        lengths=LENGTHS,
        batches=BATCHES,
        steps=STEPS,
        rounds=1,
        warmup_steps=WARMUP_STEPS,
        caches=CACHE_NAMES,
        window=WINDOW,
        page_size=PAGE_SIZE,
    )
    return run_decode_benchmark(bench_model, stream, config)


def test_every_cache_is_measured_once_per_setting(results: list[DecodeResult]) -> None:
    seen = [(r.length, r.batch, r.cache) for r in results]
    expected = [(length, batch, cache) for length in LENGTHS for batch in BATCHES for cache in CACHE_NAMES]
    assert seen == expected


def test_tokens_match_their_reference_and_ratios_are_positive(results: list[DecodeResult]) -> None:
    for r in results:
        sliding = r.cache in SLIDING_CACHES
        assert r.window == (WINDOW if sliding else None)
        assert r.reference == ("dynamic_sliding" if sliding else "dynamic")
        if r.cache in QUANTIZED_CACHES:  # lossy: tokens may differ, and the count says by how many
            assert r.tokens_match == (r.mismatched_tokens == 0) and r.mismatched_tokens <= r.batch * (STEPS + 1)
        else:
            assert r.tokens_match and r.mismatched_tokens == 0, r
        for ratio in (r.ratio_vs_dynamic, r.ratio_vs_dynamic_sliding):
            assert math.isfinite(ratio) and ratio > 0
        assert r.tokens_per_s > 0 and r.median_step_ms > 0
        assert r.peak_mib >= 0 and r.other_processes_cores >= 0
        if r.cache == "dynamic":
            assert r.ratio_vs_dynamic == pytest.approx(1.0)
        if r.cache == "dynamic_sliding":
            assert r.ratio_vs_dynamic_sliding == pytest.approx(1.0)


def test_bytes_per_token(results: list[DecodeResult]) -> None:
    for r in results:
        context = r.length + WARMUP_STEPS + STEPS
        attended = context if r.window is None else WINDOW
        assert r.kv_bytes_held == pytest.approx(r.kv_bytes_per_token * r.batch * attended)
        if r.cache in ("dynamic", "static", "static_sliding"):
            # Static is sized to exactly what a run holds, static_sliding to exactly the window.
            assert r.kv_bytes_per_token == pytest.approx(EXACT_BYTES)
        elif r.cache == "dynamic_sliding":  # keeps the last window - 1 tokens
            assert r.kv_bytes_per_token == pytest.approx(EXACT_BYTES * (WINDOW - 1) / WINDOW)
        elif r.cache in RING_ATTENTION:  # the window in whole pages, plus a spare page
            assert EXACT_BYTES <= r.kv_bytes_per_token <= EXACT_BYTES * (WINDOW + 2 * PAGE_SIZE) / WINDOW
        elif r.cache in QUANTIZED_CACHES:  # exact bytes: tests/test_quantized_cache.py (here the 128-token
            assert r.kv_bytes_per_token > 0  # full-precision residual of ours outweighs these short contexts)
        else:
            assert EXACT_BYTES <= r.kv_bytes_per_token < 2 * EXACT_BYTES


def test_rows_say_which_pool_and_path_they_took(results: list[DecodeResult]) -> None:
    """Short contexts (below ``flex.MIN_IN_PLACE_TOKENS``) gather even under ``hf_kvcache``, but for a single row on
    consecutive pages, which attention reads as a view (on the fragmented pool too: these rows fit in one extent)
    unless its keys are codes (``quantized_kv``) or it keeps a window; nothing compiles."""
    kinds = {r.cache: (r.pool, r.attention) for r in results}
    assert kinds["paged_pool"] == ("default", "hf_kvcache") and kinds["paged_pool_sdpa_fixed"] == ("fixed", "sdpa")
    assert kinds["paged_pool_fragmented"] == ("fragmented", "hf_kvcache")
    assert kinds["dynamic"] == (None, "sdpa")
    encoded_keys = {name for name, spec in QUANTIZED_CACHES.items() if spec.kind == "quantized_kv"}
    for r in results:
        if r.pool is None:
            expected = "-"
        elif r.cache in SLIDING_CACHES:  # a window reads in place through FlexAttention only (past the threshold)
            expected = "gathered"
        elif r.batch == 1 and r.attention == "hf_kvcache" and r.cache not in encoded_keys:
            expected = "in place (sdpa over one run of pages)"
        else:
            expected = "gathered"
        assert r.path == expected and r.compile_s == 0, (r.cache, r.batch, r.path)


def test_full_caches_alone_still_run(tiny_llama_model: PreTrainedModel) -> None:
    stream = torch.arange(8)
    config = DecodeBenchConfig(lengths=(8,), batches=(1,), steps=1, rounds=1, warmup_steps=0)
    assert config.caches == FULL_CACHES
    results = run_decode_benchmark(tiny_llama_model, stream, config)
    assert [r.cache for r in results] == list(FULL_CACHES)
    assert all(r.tokens_match and r.window is None and r.ratio_vs_dynamic_sliding is None for r in results)


def test_markdown_table_and_record(results: list[DecodeResult]) -> None:
    lines = markdown_table(results, busy_cores=float("inf")).splitlines()
    assert len(lines) == 2 + len(results)
    assert lines[2].startswith("| dynamic | - | - (sdpa) | - | 16 | 1 |")
    assert lines[2 + len(FULL_CACHES)].startswith(f"| dynamic_sliding | - | - (sdpa) | {WINDOW} | 16 | 1 |")
    config = DecodeBenchConfig(lengths=LENGTHS, batches=BATCHES, caches=CACHE_NAMES, window=WINDOW)
    record = json.loads(json.dumps(results_record(results, config, environment(torch.device("cpu"), torch.float32))))
    assert set(record) == {"machine", "config", "results"}
    assert record["config"]["window"] == WINDOW
    assert {result["cache"] for result in record["results"]} == set(CACHE_NAMES)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"caches": ("static",)}, "must include 'dynamic'"),
        ({"caches": ("dynamic", "nope")}, "Unknown caches"),
        ({"caches": ("dynamic", "sliding_ring")}, "must include 'dynamic_sliding'"),
        ({"caches": ("dynamic", "dynamic_sliding"), "lengths": (255, 1024)}, "length must be >= window=256"),
        ({"window": 1}, "window must be >= 2"),
        ({"lengths": ()}, "lengths"),
        ({"steps": 0}, "steps"),
    ],
)
def test_config_rejects_bad_settings(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecodeBenchConfig(**settings)


def test_short_stream_is_rejected(tiny_llama_model: PreTrainedModel) -> None:
    with pytest.raises(ValueError, match="at least"):
        run_decode_benchmark(
            tiny_llama_model, torch.zeros(10, dtype=torch.long), DecodeBenchConfig(lengths=(8,), batches=(2,))
        )


# ----- the update micro-benchmark -----------------------------------------------------------------


@pytest.fixture(scope="module")
def update_results(tiny_llama_model: PreTrainedModel) -> list[RingUpdateResult]:
    bench = RingUpdateBenchConfig(windows=UPDATE_WINDOWS, batches=UPDATE_BATCHES, steps=3, rounds=1, warmup_steps=1)
    return run_ring_update_benchmark(tiny_llama_model.config, bench)


def test_update_benchmark_measures_every_cache(update_results: list[RingUpdateResult]) -> None:
    seen = [(r.window, r.batch, r.cache) for r in update_results]
    expected = [(w, b, cache) for w in UPDATE_WINDOWS for b in UPDATE_BATCHES for cache in SLIDING_CACHES]
    assert seen == expected
    for r in update_results:
        assert r.steps == 3 and r.rounds == 1 and len(r.round_next_update_us) == 1
        assert r.first_update_us > 0 and r.next_update_us > 0
        assert r.per_layer_us == pytest.approx((r.first_update_us + (NUM_LAYERS - 1) * r.next_update_us) / NUM_LAYERS)
        for ratio in (r.ratio_vs_dynamic_sliding, r.ratio_vs_static_sliding):
            assert math.isfinite(ratio) and ratio > 0
        if r.cache == "dynamic_sliding":
            assert r.ratio_vs_dynamic_sliding == pytest.approx(1.0)
        if r.cache == "static_sliding":
            assert r.ratio_vs_static_sliding == pytest.approx(1.0)


def test_update_table_and_record(update_results: list[RingUpdateResult]) -> None:
    lines = update_markdown_table(update_results, NUM_LAYERS).splitlines()
    assert len(lines) == 2 + len(update_results)
    assert lines[2].startswith("| dynamic_sliding | 8 | 1 |")
    bench = RingUpdateBenchConfig(windows=UPDATE_WINDOWS, batches=UPDATE_BATCHES)
    info = environment(torch.device("cpu"), torch.float32)
    record = json.loads(json.dumps(update_results_record(update_results, bench, info)))
    assert set(record) == {"machine", "config", "timed_layers", "results"}
    assert len(record["results"]) == len(update_results)


def test_update_benchmark_without_a_baseline_gives_no_ratio() -> None:
    bench = RingUpdateBenchConfig(windows=(4,), steps=1, rounds=2, warmup_steps=0, caches=("sliding_ring",))
    (result,) = run_ring_update_benchmark(tiny_llama().config, bench)
    assert len(result.round_next_update_us) == 2
    assert result.ratio_vs_dynamic_sliding is None and result.ratio_vs_static_sliding is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"caches": ("dynamic",)}, "caches must name some of"),
        ({"caches": ()}, "caches must name some of"),
        ({"windows": (1,)}, "windows"),
        ({"batches": (0,)}, "batches"),
        ({"steps": 0}, "steps"),
        ({"warmup_steps": -1}, "warmup_steps"),
    ],
)
def test_update_config_rejects_bad_settings(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RingUpdateBenchConfig(**settings)


def test_update_benchmark_needs_two_layers() -> None:
    with pytest.raises(ValueError, match="layers"):
        run_ring_update_benchmark(tiny_llama(num_hidden_layers=1).config, RingUpdateBenchConfig(windows=(4,)))


# ----- the prefix benchmark -----------------------------------------------------------------------


def test_prefix_benchmark_reuses_and_matches(tiny_llama_model: PreTrainedModel) -> None:
    config = PrefixBenchConfig(
        prefix_tokens=32, question_tokens=8, new_tokens=3, num_questions=3, chat_turns=3, page_size=4
    )
    stream = torch.randint(1, 128, (config.tokens_needed,), generator=torch.Generator().manual_seed(0))
    shared, concurrent, chat = run_prefix_benchmark(tiny_llama_model, stream, config)
    without, with_index = shared
    assert (without.mode, with_index.mode) == MODES and without.questions_timed == 2
    assert without.prefill_tokens_per_question == 40 and with_index.prefill_tokens_per_question == 8
    assert with_index.tokens_match and with_index.max_logit_diff < 1e-4 and with_index.ttft_speedup > 0
    bound = 32 // 4 + 3 * ((8 + 3) // 4) + 3
    assert [r.bound_pages for r in concurrent] == [bound, bound]
    assert concurrent[1].high_water_pages <= bound < concurrent[0].high_water_pages
    assert [r.turn for r in chat] == [1, 2, 3] and all(r.tokens_match for r in chat)
    assert chat[0].prefilled_with_index == chat[0].prefilled_without_index == 32
    assert all(r.prefilled_with_index < r.prefilled_without_index == r.prompt_tokens for r in chat[1:])
    lines = prefix_markdown_table(shared, concurrent, chat).splitlines()
    assert len(lines) == 4 + 5 + 6
    info = environment(torch.device("cpu"), torch.float32)
    record = json.loads(json.dumps(prefix_results_record(shared, concurrent, chat, config, info)))
    assert set(record["results"]) == {"shared_prompt", "concurrent", "chat"}
    assert record["config"]["prefix_tokens"] == 32


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2"])
def test_prefix_benchmark_on_a_hybrid_reuses_states_and_logs_each_calls_path(model_type: str) -> None:
    """scripts/bench_prefix.py --model hybrid at tiny sizes: the record's parts, reuse (states restored), equal greedy
    answers with and without reuse, and the split prefill of a first call against one pass."""
    model = hybrid_bench_model(model_type, size="tiny")
    config = PrefixBenchConfig(
        prefix_tokens=32, question_tokens=8, new_tokens=3, num_questions=4, chat_turns=3, page_size=4
    )
    stream = random_token_stream(model.config.vocab_size, config.tokens_needed)
    run = run_prefix_parts(model, stream, config, first_call=True)
    without, with_index = run.shared
    assert without.questions_timed == with_index.questions_timed == 2  # a hybrid's first two questions warm up
    assert without.prefill_tokens_per_question == 40 and with_index.prefill_tokens_per_question == 8
    assert with_index.tokens_match and with_index.max_logit_diff < 1e-4
    assert all(r.tokens_match for r in run.chat)
    assert all(r.prefilled_with_index < r.prefilled_without_index == r.prompt_tokens for r in run.chat[1:])
    one_pass, split = run.first_call
    assert one_pass.prefill_tokens_per_question == split.prefill_tokens_per_question == 40  # nothing reused
    assert split.tokens_match and split.max_logit_diff < 1e-4 and split.ttft_speedup > 0
    paths: dict[tuple[str, str], list[tuple[bool, int, int]]] = {}  # (part, mode) -> (warm-up, reused, passes)
    for call in run.calls:
        paths.setdefault((call.part, call.mode), []).append((call.warmup, call.tokens_reused, call.prefill_passes))
    # the states at the document's end (token 32) are kept by the second question, which prefills in full
    assert paths["shared_prompt", "with_index"] == [(True, 0, 2), (True, 0, 3), (False, 32, 2), (False, 32, 2)]
    assert paths["first_call", "with_index"] == [(True, 0, 2)] + [(False, 0, 2)] * 3
    for part in ("shared_prompt", "first_call", "chat"):
        assert {(reused, passes) for _, reused, passes in paths[part, "without_index"]} == {(0, 1)}
    assert [reused > 0 for _, reused, _ in paths["chat", "with_index"]] == [False, True, True]
    lines = prefix_markdown_table(run.shared, run.concurrent, run.chat, run.first_call, run.calls).splitlines()
    assert len(lines) == 4 + 5 + 6 + 5 + 3 + 6  # the three parts, the first call, the calls of 6 parts and modes
    info = environment(torch.device("cpu"), torch.float32)
    record = prefix_results_record(
        run.shared, run.concurrent, run.chat, config, info, first_call=run.first_call, calls=run.calls
    )
    record = json.loads(json.dumps(record))
    assert set(record["results"]) == {"shared_prompt", "concurrent", "chat", "first_call", "calls"}
    assert len(record["results"]["calls"]) == 2 * (4 + 4 + 3)


def test_a_hybrid_whose_first_question_keeps_states_at_the_documents_end_warms_up_once() -> None:
    model = hybrid_bench_model("qwen3_5_text", size="tiny")
    config = PrefixBenchConfig(prefix_tokens=32, question_tokens=4, new_tokens=2, num_questions=3, page_size=4)
    run = run_prefix_parts(model, random_token_stream(model.config.vocab_size, config.tokens_needed), config)
    assert run.shared[1].questions_timed == 2 and run.shared[1].prefill_tokens_per_question == 4
    with_index = [c for c in run.calls if (c.part, c.mode) == ("shared_prompt", "with_index")]
    # question 0 (36 tokens) keeps its states at its last whole page short of its last token: the document's end
    assert [(c.warmup, c.tokens_reused, c.prefill_passes) for c in with_index] == [(True, 0, 2)] + [(False, 32, 1)] * 2


def test_prefix_benchmark_on_a_hybrid_needs_a_third_question() -> None:
    model = hybrid_bench_model("qwen3_5_text", size="tiny")
    config = PrefixBenchConfig(prefix_tokens=8, question_tokens=4, new_tokens=2, num_questions=2, page_size=4)
    with pytest.raises(ValueError, match="num_questions must be >= 3"):
        run_prefix_parts(model, random_token_stream(model.config.vocab_size, config.tokens_needed), config)


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"num_questions": 1}, "num_questions"), ({"prefix_tokens": 0}, "prefix_tokens"), ({"cache": "x"}, "Unknown")],
)
def test_prefix_config_rejects_bad_settings(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrefixBenchConfig(**settings)


def test_compiled_suite_compiles_our_caches_as_generate_does():
    """The compiled suite on a tiny model: the rows compiled by generate say so, recompile nothing while timed, and
    the lossless ones give StaticCache's tokens."""
    import torch._dynamo

    from hf_kvcache.bench.compiled import CompiledBenchConfig, markdown_table, run_compiled_benchmark

    torch._dynamo.reset()
    rows = ("static:compiled", "dynamic", "paged_pool:compiled", "sliding_ring:compiled", "quantized_values:compiled")
    config = CompiledBenchConfig(cells=((40, 2),), rows=rows, steps=3, warmup_steps=1, rounds=1)
    stream = torch.randint(128, (80,), generator=torch.Generator().manual_seed(0))
    results = {r.row: r for r in run_compiled_benchmark(tiny_llama(), stream, config)}
    torch._dynamo.reset()
    assert all(results[row].compiled for row in rows if row.endswith(":compiled"))
    assert not results["dynamic"].compiled
    assert all(r.recompiles == 0 for r in results.values())
    assert results["paged_pool:compiled"].tokens_match and results["sliding_ring:compiled"].tokens_match  # window 1,024
    assert "| 40 x 2 | paged_pool:compiled | True |" in markdown_table(list(results.values()))


def test_eager_rows_of_the_compiled_suite_stay_eager_where_generate_would_compile_them(monkeypatch):
    """On CUDA ``generate`` compiles the steps of every compileable cache unasked (``_valid_auto_compile_criteria``:
    a CUDA device, a compileable cache, no ``disable_compile``); the suite's eager rows must stay eager there. The
    rule is put in place here with the device check answered as on CUDA."""
    from transformers import DynamicCache

    from hf_kvcache.bench.compiled import CompiledBenchConfig, run_compiled_benchmark

    def as_on_cuda(self, model_kwargs, generation_config) -> bool:
        cache = model_kwargs.get("cache")
        return not generation_config.disable_compile and cache.is_compileable and type(cache) is not DynamicCache

    model = tiny_llama()
    monkeypatch.setattr(type(model), "_valid_auto_compile_criteria", as_on_cuda)
    compiled_calls = []
    get_compiled_call = model.get_compiled_call
    model.get_compiled_call = lambda config: compiled_calls.append(config) or get_compiled_call(config)
    config = CompiledBenchConfig(cells=((24, 1),), rows=("static:compiled", "static", "paged_pool"), steps=2, rounds=1)
    stream = torch.randint(128, (24,), generator=torch.Generator().manual_seed(0))
    results = run_compiled_benchmark(model, stream, config)
    assert len(compiled_calls) == 2  # static:compiled's first call and its one round
    assert [r.compiled for r in results] == [True, False, False]
