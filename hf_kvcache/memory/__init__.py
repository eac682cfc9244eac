"""The memory layer: pages and who holds them, no attention, no transformers.

``quant`` (codes and their reference decoder), ``dequant`` (fast decoders), ``format`` (``PageFormat``, layer
groups); pure ints: ``allocator`` (page ids, reference counts), ``page_table`` (each row's pages), ``prefix_index``
(chain keys of full pages); ``device_memory`` (a device's budget), ``placement`` (ranks and devices), ``storage``
(``PoolStorage``), ``pools`` (how pools are made and found), ``stats``; for prefix pages beyond the pool:
``page_bytes``, ``store`` (Redis) and ``tiers``; ``page_pool`` (``PagePool``: what caches and layers work on) and
``pool`` (``KVPool``: what users hold).
"""
