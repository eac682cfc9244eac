"""The transformers glue on top of the caches: what ``import hf_kvcache`` teaches ``generate``.

- ``registry``: our ``cache_implementation`` names and the cache each builds;
- ``seams``: the three places transformers is patched (``register``/``unregister``) and the request checks;
- ``warmup``: compiling a serving loop's decode shapes ahead of its requests.
"""
