"""Reading a pool's pages for transformers' attention: ``kernels`` gathers them (the slow twin), ``block_mask`` and
``flex`` read them in place, ``reads`` is what a layer hands attention, ``interface`` is the attention itself."""
