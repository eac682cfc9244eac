"""What ``import hf_kvcache`` teaches ``generate``: ``registry`` (our ``cache_implementation`` names), ``seams``
(``register``/``unregister`` and the request checks), ``warmup`` (a serving loop's decode shapes compiled ahead)."""
