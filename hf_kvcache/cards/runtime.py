"""What every published card runs: ``generate_with_cache``, imported by its ``custom_generate/generate.py`` as
``from hf_kvcache.cards import generate_with_cache``. Kept apart from rendering so that import stays light."""

from typing import Any

from hf_kvcache import __version__
from hf_kvcache.integration.registry import REGISTRY
from hf_kvcache.integration.seams import is_registered


def require_registered(name: str) -> None:
    """Raises ``ValueError`` naming what to do if ``name`` is not a cache registered by hf_kvcache."""
    if name not in REGISTRY or not is_registered():
        raise ValueError(
            f"cache_implementation={name!r} is not a cache registered by hf_kvcache {__version__} "
            f"(registered: {sorted(REGISTRY) if is_registered() else 'none; call hf_kvcache.register()'}). "
            "Install an hf_kvcache release that provides it, or name a registered cache."
        )


def generate_with_cache(
    model: Any, cache_implementation: str, cache_config: dict[str, Any], arguments: dict[str, Any]
) -> Any:
    """``GenerationMixin.generate`` with a card's cache setting, unless the call chooses a cache itself.

    The body of every card's ``custom_generate/generate.py``. The call chooses a cache when it passes
    ``cache_implementation``, ``cache``/``past_key_values`` or a ``generation_config`` naming one; a
    ``cache_config`` alone replaces the card's.

    Args:
        model: the model ``generate`` was called on.
        cache_implementation: the card's registered cache name.
        cache_config: the card's ``cache_config``.
        arguments: every argument of the ``generate`` call, by name.

    Returns:
        What ``generate`` returns.
    """
    arguments = dict(arguments)
    generation_config = arguments.get("generation_config")
    chosen = any(arguments.get(key) is not None for key in ("cache_implementation", "cache", "past_key_values"))
    if not chosen and (generation_config is None or generation_config.cache_implementation is None):
        require_registered(cache_implementation)
        arguments["cache_implementation"] = cache_implementation
        if arguments.get("cache_config") is None:
            arguments["cache_config"] = dict(cache_config)
    # The class's generate: after from_pretrained(trust_remote_code=True), model.generate is this function.
    return type(model).generate(model, **arguments)
