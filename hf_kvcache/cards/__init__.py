"""Hub model-card folders for our cache settings, with every number taken from an evaluation report.

One folder per (base model, cache setting), named ``<model>-<cache name>``::

    <model>-<cache>/
        README.md                          card: Hub metadata, what the setting does, the eval's table,
                                           the command that reproduces it, hardware and versions, usage
        generation_config.json             GenerationConfig(cache_implementation=..., cache_config=...)
        custom_generate/generate.py        transformers' custom generation entry point: applies the setting
        custom_generate/requirements.txt   checked by transformers before generate.py runs

Modules: ``settings`` (the cards we publish: ``CARD_SETTINGS``; a new cache setting is one ``CardSetting``, rendered
once its cache name is registered and an eval report holds a result under its label), ``render`` (a card folder
from a report; the README from ``card_template.md``), ``validate`` (a folder checked offline), ``publish`` (to the
Hub) and ``runtime`` (``generate_with_cache``, what every published card's ``custom_generate/generate.py`` runs).

This package itself exports only the runtime, so a published card's ``from hf_kvcache.cards import
generate_with_cache`` imports no evaluation or Hub code.
"""

from hf_kvcache.cards.runtime import generate_with_cache, require_registered

__all__ = ["generate_with_cache", "require_registered"]
