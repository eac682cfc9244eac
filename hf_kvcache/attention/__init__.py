"""The attention layer: reading a pool's pages for transformers' attention.

- ``kernels``: the gather path, moving keys and values between attention's tensors and pool slots (pure torch);
- ``block_mask``: the ``BlockMask`` of a decode step built from the page tables (``PagedBlockMask``);
- ``flex``: compiled FlexAttention over the pages where they lie, one kernel per shape (``CompiledKernels``);
- ``reads``: what a layer hands attention beside its keys (``PagedRead``, a window's ``KeyLayout``);
- ``interface``: ``attn_implementation="hf_kvcache"``, sdpa that also reads those, in place where it can.
"""
