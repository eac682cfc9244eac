"""transformers custom_generate: generate with hf_kvcache's 'quantized_kv' cache.

Rendered by hf_kvcache.cards from the same setting as ../generation_config.json. Importing hf_kvcache
registers its cache names with transformers.
"""

from hf_kvcache.cards import generate_with_cache

CACHE_IMPLEMENTATION = "quantized_kv"
CACHE_CONFIG = {'key_bits': 4, 'value_bits': 4}


def generate(inputs=None, *, model, **kwargs):
    """Runs model.generate with this repo's cache setting unless the call names a cache itself.

    Takes the arguments of GenerationMixin.generate; `model` is keyword-only so that a model whose
    generate this replaces (from_pretrained(..., trust_remote_code=True)) accepts positional inputs.
    """
    return generate_with_cache(model, CACHE_IMPLEMENTATION, CACHE_CONFIG, {"inputs": inputs, **kwargs})
