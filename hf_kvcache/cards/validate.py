"""Checks a rendered card folder offline, as the Hub and transformers will read it."""

import importlib.util
import json
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard
from transformers import GenerationConfig

from hf_kvcache.cards.render import CARD_FILES, CUSTOM_GENERATE_DIR
from hf_kvcache.cards.runtime import require_registered
from hf_kvcache.transformers_internals import check_python_requirements


def validate_card(folder: str | Path) -> ModelCard:
    """Checks a card folder offline: files, generation config, custom_generate code, Hub metadata.

    The metadata check is huggingface_hub's own parsing (``ModelCard.load``, which builds ``ModelCardData`` and
    rejects a malformed YAML block or model-index) plus the fields the Hub needs for this kind of repo;
    ``ModelCard.validate`` would ask the Hub over the network.

    Returns:
        The parsed card.

    Raises:
        ValueError: a file is missing, the generation config names an unregistered cache or does not load, the
            custom_generate code disagrees with it, or the metadata lacks a field.
        ImportError: the installed packages do not satisfy ``custom_generate/requirements.txt``.
    """
    folder = Path(folder)
    missing = [name for name in CARD_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"Card folder {folder} lacks {missing}; render it with hf_kvcache.cards.render.render_card.")
    saved = json.loads((folder / "generation_config.json").read_text())
    require_registered(saved.get("cache_implementation"))
    config = GenerationConfig.from_pretrained(folder)
    check_python_requirements(folder, requirements_file=f"{CUSTOM_GENERATE_DIR}/requirements.txt")
    module = _load_module(folder / CUSTOM_GENERATE_DIR / "generate.py")
    applied = (getattr(module, "CACHE_IMPLEMENTATION", None), getattr(module, "CACHE_CONFIG", None))
    if not callable(getattr(module, "generate", None)) or applied != (config.cache_implementation, config.cache_config):
        raise ValueError(
            f"{folder}/{CUSTOM_GENERATE_DIR}/generate.py applies {applied}, but generation_config.json says "
            f"{(config.cache_implementation, config.cache_config)}; render the card again."
        )
    card = ModelCard.load(folder / "README.md")
    needed = {"library_name": "transformers", "pipeline_tag": "text-generation"}
    problems = [f"{key} must be {value!r}" for key, value in needed.items() if getattr(card.data, key) != value]
    problems += [f"{key} is missing" for key in ("base_model", "license") if not getattr(card.data, key)]
    problems += [] if "custom_generate" in (card.data.tags or []) else ["tags must include 'custom_generate'"]
    if problems:
        raise ValueError(f"{folder}/README.md metadata: " + "; ".join(problems) + ".")
    return card


def _load_module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"_card_{path.parent.parent.name.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
