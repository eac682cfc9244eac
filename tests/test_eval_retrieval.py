"""Retrieval evaluation: prompt building, scoring, aggregation, and one end-to-end run on a tiny model."""

import json

import pytest
from transformers import PreTrainedTokenizerBase

from hf_kvcache.eval.caches import CacheSpec, default_specs
from hf_kvcache.eval.prompts import RULER_DEPTHS, PromptBuilder
from hf_kvcache.eval.qa import load_qa
from hf_kvcache.eval.retrieval import RetrievalResult, accuracy_table, is_correct, run_retrieval
from hf_kvcache.testing import tiny_llama


@pytest.fixture(scope="module")
def tokenizer(bundled) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer (with a chat template): the tiny models' 128-token vocabulary cannot spell prompts."""
    return bundled[1]


@pytest.fixture(scope="module")
def builder(tokenizer) -> PromptBuilder:
    return PromptBuilder(tokenizer, seed=0)


def _share_before(tokenizer: PreTrainedTokenizerBase, context: str, needle: str) -> float:
    """Share of the haystack's tokens (needle excluded) that come before the needle."""
    before, _, after = context.partition(needle)
    count = len(tokenizer(before, add_special_tokens=False)["input_ids"])
    return count / (count + len(tokenizer(after, add_special_tokens=False)["input_ids"]))


@pytest.mark.parametrize("length", [512, 1024])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_needle_prompt_fits_the_length_and_puts_the_needle_at_the_depth(builder, tokenizer, length, depth):
    prompt = builder.build("needle", length, sample=0, depth=depth)
    assert 0.97 * length <= len(prompt.input_ids) <= length
    assert list(prompt.input_ids) == tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    (needle,) = prompt.needles
    (number,) = prompt.expected
    assert len(number) == 7 and number.isdigit() and number in needle
    assert prompt.context.count(needle) == 1 and number not in prompt.context.replace(needle, "")
    assert _share_before(tokenizer, prompt.context, needle) == pytest.approx(depth, abs=0.04)
    # At a sentence boundary: the needle starts the context or follows a sentence's end.
    before = prompt.context.partition(needle)[0]
    assert before == "" or before.rstrip()[-1] in ".!?"


def test_prompt_is_chat_formatted_with_the_question_after_the_context(builder):
    prompt = builder.build("needle", 512, sample=0, depth=0.5)
    assert prompt.text.startswith("<|im_start|>system\n")
    user_turn, _, reply = prompt.text.partition("<|im_start|>assistant\n")
    assert user_turn.index(prompt.context) < user_turn.index("What is the secret vault code")
    assert reply == "The secret vault code is"


def test_prompts_are_deterministic_per_seed(tokenizer, builder):
    again = PromptBuilder(tokenizer, seed=0)
    for task, depth in [("needle", 0.5), ("niah_single", None), ("qa_squad", None)]:
        assert again.build(task, 512, 1, depth) == builder.build(task, 512, 1, depth)
    other_seed = PromptBuilder(tokenizer, seed=1).build("needle", 512, 0, 0.5)
    assert other_seed.expected != builder.build("needle", 512, 0, 0.5).expected
    assert builder.build("needle", 512, 1, 0.5).expected != builder.build("needle", 512, 0, 0.5).expected


def test_niah_single_follows_rulers_recipe(builder):
    prompt = builder.build("niah_single", 1024, sample=0)
    (needle,) = prompt.needles
    key = needle.split(" for ")[1].split(" is: ")[0]
    assert needle == f"The special magic number for {key} is: {prompt.expected[0]}."
    assert prompt.depth in RULER_DEPTHS
    assert prompt.text.endswith(f"The special magic number for {key} in the text above is")
    assert f"What is the special magic number for {key}" in prompt.text.partition(prompt.context)[2]
    assert 0.97 * 1024 <= len(prompt.input_ids) <= 1024


@pytest.mark.parametrize("task, dataset", [("qa_squad", "squad"), ("qa_hotpotqa", "hotpotqa")])
def test_qa_context_holds_the_gold_documents_and_the_question(builder, task, dataset):
    prompt = builder.build(task, 1024, sample=0)
    question = prompt.text.partition(prompt.context)[2]
    (item,) = [item for item in load_qa(dataset) if item.documents == prompt.needles and item.question in question]
    assert prompt.expected == item.answers
    for document in item.documents:
        assert f":\n{document}" in prompt.context
    assert prompt.context.count("Document ") > len(item.documents)  # distractors too
    assert f"Question: {item.question}" in question
    assert 0.75 * 1024 <= len(prompt.input_ids) <= 1024
    # The same question at every length.
    assert builder.build(task, 512, sample=0).needles == prompt.needles


def test_bad_requests_name_the_setting(builder):
    with pytest.raises(ValueError, match="Unknown retrieval task"):
        builder.build("niah_multikey", 512, 0)
    with pytest.raises(ValueError, match="depth"):
        builder.build("niah_single", 512, 0, depth=0.5)
    with pytest.raises(ValueError, match="depth"):
        builder.build("needle", 512, 0, depth=1.5)
    with pytest.raises(ValueError, match="length=60"):
        builder.build("needle", 60, 0, depth=0.5)


@pytest.mark.parametrize(
    "output, expected, correct",
    [
        (" 4829173.", ("4829173",), True),
        ("The code is 4829 173", ("4829173",), False),
        ("4829174", ("4829173",), False),
        ("", ("4829173",), False),
        (" PARIS, France", ("Paris",), True),
        ("The Stanford university campus", ("Harvard", "Stanford University"), True),
        ("Denmark and Norway", ("Denmark, Iceland and Norway",), False),
    ],
)
def test_scoring_is_a_case_insensitive_match_of_any_answer(output, expected, correct):
    assert is_correct(output, expected) is correct


def _result(cache: str, task: str, length: int, depth: float, correct: bool) -> RetrievalResult:
    return RetrievalResult(task, cache, length - 3, length, depth, 0, ("1",), "1" if correct else "0", correct)


def test_accuracy_table_aggregates_per_cache_task_length_and_depth():
    results = [
        _result("paged", "needle", 512, 0.0, True),
        _result("dynamic", "needle", 512, 0.0, True),
        _result("dynamic", "needle", 512, 1.0, False),
        _result("dynamic", "needle", 1024, 0.0, False),
        _result("dynamic", "qa_squad", 512, 0.5, True),
    ]
    table = accuracy_table(results)
    assert list(table) == ["paged", "dynamic"]
    dynamic = table["dynamic"]
    assert dynamic["accuracy"] == 0.5 and dynamic["num_samples"] == 4
    assert [(row["task"], row["target_length"], row["accuracy"]) for row in dynamic["by_length"]] == [
        ("needle", 512, 0.5),
        ("needle", 1024, 0.0),
        ("qa_squad", 512, 1.0),
    ]
    assert [(row["target_length"], row["depth"], row["accuracy"]) for row in dynamic["by_depth"]][:3] == [
        (512, 0.0, 1.0),
        (512, 1.0, 0.0),
        (1024, 0.0, 0.0),
    ]
    assert dynamic["by_length"][0]["mean_context_length"] == 509
    assert table["paged"]["by_depth"] == [
        {
            "task": "needle",
            "target_length": 512,
            "depth": 0.0,
            "accuracy": 1.0,
            "num_samples": 1,
            "mean_context_length": 509,
        }
    ]
    assert json.loads(json.dumps(table)) == table


def test_run_retrieval_on_a_tiny_model_runs_every_cache_on_the_same_prompts(tokenizer, monkeypatch):
    model = tiny_llama(vocab_size=len(tokenizer))
    # Every registered cache, a static one (sized by max_cache_len), and quanto in groups that fit head_dim=16.
    specs = [
        CacheSpec(spec.label, spec.kind, {**spec.settings, "q_group_size": 16}) if spec.kind == "quantized" else spec
        for spec in default_specs()
    ] + [CacheSpec("static", "static")]
    seen = []  # (prompt ids, cache type) of every generate call
    generate = model.generate

    def spy(input_ids, **kwargs):
        seen.append((input_ids[0].tolist(), type(kwargs["cache"]).__name__))
        return generate(input_ids, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    tasks = ["needle", "niah_single", "qa_squad"]
    results = run_retrieval(
        model, tokenizer, specs, lengths=[384], depths=[0.0, 1.0], tasks=tasks, max_new_tokens=4, progress=False
    )

    num_prompts = 2 + 1 + 1
    assert len(results) == len(seen) == num_prompts * len(specs)
    for prompt_idx in range(num_prompts):
        calls = seen[prompt_idx * len(specs) : (prompt_idx + 1) * len(specs)]
        assert all(ids == calls[0][0] for ids, _ in calls)
    assert seen[0][0] != seen[len(specs)][0]
    assert [result.cache for result in results] == [spec.label for spec in specs] * num_prompts
    assert {result.task for result in results} == set(tasks)
    assert all(0 < result.context_length <= 384 and isinstance(result.correct, bool) for result in results)
    assert [result.depth for result in results[: 2 * len(specs) : len(specs)]] == [0.0, 1.0]
    table = accuracy_table(results)
    assert list(table) == [spec.label for spec in specs]
    assert all(0.0 <= row["accuracy"] <= 1.0 for entry in table.values() for row in entry["by_length"])


def test_run_retrieval_rejects_bad_grids(tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer))
    specs = [CacheSpec("dynamic", "dynamic")]
    grid = {"lengths": [256], "depths": [0.5], "tasks": ["needle"]}
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        run_retrieval(model, tokenizer, specs, **{**grid, "lengths": [512]}, progress=False)
    with pytest.raises(ValueError, match="unique labels"):
        run_retrieval(model, tokenizer, specs * 2, **grid, progress=False)
    with pytest.raises(ValueError, match="tasks="):
        run_retrieval(model, tokenizer, specs, **{**grid, "tasks": ["vt"]}, progress=False)
    with pytest.raises(ValueError, match="embeds only 128"):
        run_retrieval(tiny_llama(), tokenizer, specs, **grid, progress=False)
