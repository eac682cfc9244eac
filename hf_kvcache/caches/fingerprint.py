"""What computes a model's keys and values, as the prefix index keys its pages on (``model_fingerprint``)."""

import json

import torch

from hf_kvcache.memory.prefix_index import root_key

FINGERPRINT_VALUES = 16
"""Values sampled from each weight tensor for a model's fingerprint."""
VOLATILE_CONFIG_KEYS = frozenset(
    {"use_cache", "output_attentions", "output_hidden_states", "return_dict", "transformers_version", "_commit_hash"}
)
"""Config keys that do not change what the model computes for a token (left out of its fingerprint)."""


class UnreadableWeights(Exception):
    """A model's weights cannot be read where they are (offloaded: on the meta device)."""


def model_fingerprint(model: torch.nn.Module) -> bytes:
    """Identifies what computes a model's keys and values: its class, config (less ``VOLATILE_CONFIG_KEYS``), dtype,
    adapter state (PEFT) and ``FINGERPRINT_VALUES`` evenly spaced values of every parameter and buffer. Recomputed
    at every call, since weights written in place keep their pointers; a write missing every sampled value goes
    unseen (``KVPool.reset_prefix_index``). ``UnreadableWeights`` where weights are offloaded (on meta).
    """
    tensors = [*model.parameters(), *model.buffers()]
    if any(tensor.is_meta for tensor in tensors):
        raise UnreadableWeights(
            "the model has weights offloaded (on the meta device, e.g. accelerate's disk or CPU offload), which the "
            "prefix index cannot fingerprint without loading them; load the model without offloading to reuse prompts."
        )
    with torch.no_grad():
        sample = torch.cat(
            [
                tensor.detach()
                .reshape(-1)[:: max(1, tensor.numel() // FINGERPRINT_VALUES)][:FINGERPRINT_VALUES]
                .to(device=tensors[0].device, dtype=torch.float32)
                for tensor in tensors
            ]
        )  # [num_tensors * FINGERPRINT_VALUES] at most
    config = getattr(model, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {}
    settings = {key: value for key, value in settings.items() if key not in VOLATILE_CONFIG_KEYS}
    adapters = [
        (name, module.disable_adapters, tuple(module.active_adapters), tuple(getattr(module, "merged_adapters", ())))
        for name, module in model.named_modules()
        if isinstance(getattr(module, "disable_adapters", None), bool)  # PEFT's tuner layers (a model's is a method)
    ]
    return root_key(
        type(model).__name__,
        json.dumps(settings, sort_keys=True, default=str),
        str(getattr(model, "dtype", "")),
        repr(adapters),
        sample.cpu().numpy().tobytes(),
    )
