"""The memory layer: pages and who holds them. No attention, no transformers.

- ``format``: a page's geometry from a model config (``PageFormat``), ``quant``: the codes quantized pages hold
  and their reference decoder, ``dequant``: the fast decoders;
- ``allocator`` (page ids, reference counts, copy-on-write) and ``page_table`` (each row's pages), pure Python;
- ``prefix_index``: chain-hashed keys of full pages, for prompt reuse;
- ``device_memory``: what a device has free; ``placement``: which device and rank hold which layers and heads, and
  the page allocations a tensor-parallel model's ranks agree on (``AgreedPages``);
- ``storage``: the tensors page ids address and their layout (``PoolStorage``); ``pools``: how pools are made and
  found (for a model, by name, the default pool of a format and device); ``stats``: statistics, alerts, the
  integrity check;
- ``page_bytes``: a page's contents on the host and as checked bytes; ``store``: a shared store of pages on a Redis
  server, fail-open; ``tiers``: where a prefix index's pages go besides the pool (host memory, a directory, the
  store);
- ``page_pool``: ``PagePool``, one storage made for its cap, the page ids it opens, the allocator and the page
  tables under one lock: what caches and layers work on;
- ``pool``: ``KVPool``, what users hold: its constructors, statistics and alerts, with its ``PagePool`` in
  ``pool.pages``.
"""
