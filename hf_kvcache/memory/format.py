"""The page format a pool is cut into (``PageFormat``), read from a model config, and the model's layer types and
layer groups.
"""

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Self

import torch

from hf_kvcache.errors import IncompatibleModelError
from hf_kvcache.memory.quant import QuantFormat

logger = logging.getLogger("hf_kvcache")

DEFAULT_PAGE_SIZE = 16
MAX_PAGE_SIZE = 4096
KV_BLOCK_TOKENS = 128
"""Tokens of one extent, which attention reads in place as one KV block (``attention.flex``): large, as compiled
FlexAttention pays a fixed cost per block; small enough to keep a row's last one small (docs/attention.md)."""


def check_page_size(page_size: int) -> int:
    """Returns ``page_size`` if it is a valid page size, else raises a ``ValueError`` naming the setting."""
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size must be an int, got {page_size!r} ({type(page_size).__name__}).")
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size={page_size} is out of range: choose 1 <= page_size <= {MAX_PAGE_SIZE}.")
    return page_size


INDEXED_ATTENTION = "indexed_attention"
"""Sparse attention with a lightning indexer (DeepSeek-V3.2, GLM-MoE-DSA, ...): paged as a full attention layer, its
indexer's keys kept beside (``caches.state_layers.IndexerKeys``)."""

PAGED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", INDEXED_ATTENTION)
"""Layer types whose keys and values live in pool pages; layers of other types (linear attention, convolution and
state-space states) keep transformers' own cache layers, outside the pool."""

FUSED_LAYER_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
"""Layer types that carry both keys and a state (Falcon-H1, Zaya, Inkling), by the attention type their keys are paged
as; their states stay in transformers' own layer (``caches.state_layers.with_state``)."""

COMPRESSED_LAYER_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")
"""Compressed attention (DeepSeek-V4's CSA and HCA layers): a window over one shared key-and-value head, paged as a
``sliding_attention`` layer, beside a compressor's state in transformers' own cache layer (``caches.compressed``)."""


def attention_halves(types: list[str]) -> list[str]:
    """``types`` with each fused layer typed as its attention half (``FUSED_LAYER_TYPES``) and each compressed layer as
    the sliding layer its window is (``COMPRESSED_LAYER_TYPES``)."""
    return [
        "sliding_attention" if kind in COMPRESSED_LAYER_TYPES else FUSED_LAYER_TYPES.get(kind, kind) for kind in types
    ]


def layer_types(config: Any) -> list[str]:
    """The attention type of each layer of a (decoder) config, as transformers' ``get_layer_types_and_kwargs`` (which
    this module cannot import) has them; layers that keep no cache of their own are ``dummy``."""
    types = getattr(config, "layer_types", None)
    if types is None:
        if getattr(config, "sliding_window", None) is not None:
            kind = "sliding_attention"
        elif getattr(config, "attention_chunk_size", None) is not None:
            kind = "chunked_attention"
        else:
            kind = "full_attention"
        types = [kind] * config.num_hidden_layers
    modes = getattr(config, "kv_sharing_modes", None) or [None] * len(types)
    types = ["dummy" if kind in ("moe", "mlp") or mode == "reuse" else kind for kind, mode in zip(types, modes)]
    return with_cross_attention(config, attention_halves(types))


CROSS_ATTENTION = "cross_attention"
"""Our type for a layer that attends to an image's or encoder's keys (``config.cross_attention_layers``: Mllama),
which transformers counts as ``full_attention``: its keys are not the prompt's, so it keeps transformers' own layer."""


def with_cross_attention(config: Any, types: list[str]) -> list[str]:
    """``types`` with the layers of ``config.cross_attention_layers`` typed ``CROSS_ATTENTION``."""
    cross = set(getattr(config, "cross_attention_layers", None) or ())
    return [CROSS_ATTENTION if idx in cross else kind for idx, kind in enumerate(types)]


def layer_groups(types: list[str], geometries: list[Any] | None = None) -> list[list[int]]:
    """Splits the paged layers into equal *layer groups* of one attention type (and one of ``geometries``, if given).

    A page spans the layers of one layer group, and each layer group has its own page table, so layers that keep
    different tokens never share a page. The group size is the gcd of the layer counts of each type: Gemma 3 (25
    sliding + 5 full layers) is 6 groups of 5.
    """
    keys = list(zip(types, geometries or [None] * len(types)))
    kinds = [key for key in dict.fromkeys(keys) if key[0] in PAGED_LAYER_TYPES]
    members = {kind: [idx for idx, other in enumerate(keys) if other == kind] for kind in kinds}
    size = math.gcd(*(len(layers) for layers in members.values()))
    return [layers[i : i + size] for layers in members.values() for i in range(0, len(layers), size)]


def no_paged_layers(config: Any, types: list[str]) -> str:
    """Why a model none of whose layers is paged (a pure state-space model such as Mamba) is refused."""
    kinds = sorted(set(types) - {"dummy"})
    return (
        f"{type(config).__name__} has layers of type {kinds} and none of {list(PAGED_LAYER_TYPES)}: hf_kvcache caches "
        "page attention layers only, and this model has none to page. Serve it with transformers' own caches "
        "(DynamicCache, or the model's own cache: leave cache_implementation unset)."
    )


@dataclass(frozen=True)
class PageFormat:
    """Geometry of one page: ``page_size`` slots in each of the ``num_layers`` layers of one layer group (a model has
    ``num_layer_groups``).

    Keys are stored in ``dtype``; values too, or with ``value_bits`` as int8/int4 codes plus a scale and zero per
    scale group of ``value_group_size`` channels (``quant``; scales in ``scale_dtype``, default ``dtype``). With
    ``key_bits``, keys are codes too, encoded a page at a time when its last slot is written:

    - ``key_bits=8``: per token, a scale and zero per scale group of ``key_group_size`` channels;
    - ``key_bits=4``: per channel over the page's tokens (keys have outlier channels, which int4 per token loses), a
      compact scale and zero per channel and page (``QuantFormat.compact_params``).

    Values are ``value_head_dim`` wide where it is set (latent attention caches its latent as keys and its narrower
    rope key as values). With ``values_are_keys`` (one tensor written as keys and values: ``update(kv, kv)``) a page
    stores no values: the keys are read as the values on every path, and ``value_bits`` is dropped (logged once).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int = DEFAULT_PAGE_SIZE
    num_layer_groups: int = 1
    value_bits: int | None = None
    value_group_size: int = 64
    key_bits: int | None = None
    key_group_size: int = 64
    scale_dtype: torch.dtype | None = None
    value_head_dim: int | None = None
    values_are_keys: bool = False

    def __post_init__(self) -> None:
        check_page_size(self.page_size)
        if self.values_are_keys and self.value_dim != self.head_dim:
            raise ValueError(
                f"PageFormat.values_are_keys stores values as the keys, but value_head_dim={self.value_head_dim} is "
                f"not head_dim={self.head_dim}: leave value_head_dim unset or values_are_keys False."
            )
        if self.values_are_keys and self.value_bits is not None:
            _log_once(
                f"The model writes one tensor as its keys and its values; the pool stores it once, as keys, so "
                f"value_bits={self.value_bits} has no values to code: values are served as the keys are (in full "
                "precision, or decoded from key_bits codes)."
            )
            object.__setattr__(self, "value_bits", None)
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_layer_groups", "value_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"PageFormat.{name} must be >= 1, got {getattr(self, name)}.")
        if not self.dtype.is_floating_point:
            raise ValueError(f"PageFormat.dtype must be a floating dtype, got {self.dtype}.")
        if self.key_bits is not None and self.key_bits not in (8, 4):
            raise ValueError(
                f"PageFormat.key_bits must be 8 (per token), 4 (per channel) or None, got {self.key_bits}."
            )
        if self.key_bits == 4 and self.page_size % 2:
            raise ValueError(
                f"key_bits=4 packs two tokens of a channel per byte and needs an even page_size, got {self.page_size}."
            )
        self.value_format  # noqa: B018  (checks bits, group size and scale dtype)
        self.key_format  # noqa: B018

    @property
    def value_dim(self) -> int:
        return self.value_head_dim or self.head_dim

    @property
    def value_format(self) -> QuantFormat | None:
        """How values are quantized (``value_dim`` channels a token); ``None`` when they are stored in ``dtype``."""
        if self.value_bits is None:
            return None
        return QuantFormat(self.value_bits, self.value_group_size, self.value_dim, self.scale_dtype)

    @property
    def key_format(self) -> QuantFormat | None:
        """How keys are quantized: a token's channels, or a channel's ``page_size`` tokens (``keys_per_channel``);
        ``None`` when they are stored in ``dtype``."""
        if self.key_bits is None:
            return None
        if self.keys_per_channel:
            return QuantFormat(4, self.page_size, self.page_size, compact_params=True)
        return QuantFormat(self.key_bits, self.key_group_size, self.head_dim, self.scale_dtype)

    @property
    def keys_per_channel(self) -> bool:
        return self.key_bits == 4

    @property
    def encodes(self) -> bool:
        """Keys or values are stored as codes (attention then reads them gathered and decoded, never in place)."""
        return self.key_bits is not None or self.value_bits is not None

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: keys and values (keys only where ``values_are_keys``) of its slots in every layer."""
        full_bytes = self.head_dim * self.dtype.itemsize * self.page_size  # one head's keys or values of a page
        scale_bytes = (self.scale_dtype or self.dtype).itemsize
        values = self.value_format
        value_bytes = 0 if self.values_are_keys else self.value_dim * self.dtype.itemsize * self.page_size
        if values is not None:
            value_bytes = (values.code_dim + 2 * values.num_scale_groups * scale_bytes) * self.page_size
        keys = self.key_format
        key_bytes = full_bytes
        if keys is not None and self.keys_per_channel:  # codes, then a compact scale and zero (3 bytes) per channel
            key_bytes = self.head_dim * (keys.code_dim + 3)
        elif keys is not None:
            key_bytes = (keys.code_dim + 2 * keys.num_scale_groups * scale_bytes) * self.page_size
        return self.num_layers * self.num_kv_heads * (key_bytes + value_bytes)

    @property
    def extent_pages(self) -> int:
        """Pages per aligned extent of ``KV_BLOCK_TOKENS`` tokens (one page where pages are that large)."""
        return max(1, KV_BLOCK_TOKENS // self.page_size)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values in every layer of the model (all layer groups)."""
        return self.page_bytes // self.page_size * self.num_layer_groups

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages holding ``num_tokens`` tokens of one sequence in every layer (a page per layer group and page_size)."""
        return math.ceil(num_tokens / self.page_size) * self.num_layer_groups

    @classmethod
    def from_model_config(cls, config: Any, dtype: torch.dtype, page_size: int = DEFAULT_PAGE_SIZE) -> Self:
        """Reads the attention geometry of a transformers (decoder) config (``IncompatibleModelError`` if there is
        none we can page)."""
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if getattr(config, "is_encoder_decoder", False):
            raise IncompatibleModelError(
                f"{type(config).__name__} is an encoder-decoder model; hf_kvcache caches serve decoder-only models. "
                "Serve it with transformers' own caches (leave cache_implementation unset, or 'dynamic')."
            )
        num_heads = getattr(config, "num_attention_heads", None)
        num_layers = getattr(config, "num_hidden_layers", None)
        types = layer_types(config) if num_layers is not None else []
        groups = layer_groups(types)
        if types and not groups:
            raise IncompatibleModelError(no_paged_layers(config, types))
        if num_heads is None or num_layers is None:
            raise IncompatibleModelError(
                f"{type(config).__name__} has no num_attention_heads/num_hidden_layers: not an attention model. "
                "Serve it with transformers' own caches (leave cache_implementation unset)."
            )
        groups, geometries = geometry_groups(config, types)
        num_kv_heads, head_dim, value_dim = geometries[0]
        value_head_dim = None if value_dim == head_dim else value_dim
        num_groups = geometries.count(geometries[0])
        return cls(
            *(len(groups[0]), num_kv_heads, head_dim, dtype, page_size, num_groups),
            value_head_dim=value_head_dim,
            values_are_keys=getattr(config, "compress_rates", None) is not None,  # one tensor as keys and values
        )

    def for_geometries(self, geometries: list[tuple[int, int, int]]) -> list[Self]:
        """The formats of a model whose layer groups write ``geometries`` (``geometry_groups``; this format is the
        first's): one per distinct geometry, in order, with its count of layer groups and this format's page size,
        dtypes and codes (its scale groups must divide the others' widths, else ``ValueError``)."""
        distinct = list(dict.fromkeys(geometries))
        return [
            dataclasses.replace(
                self,
                num_kv_heads=heads,
                head_dim=head_dim,
                value_head_dim=None if value_dim == head_dim else value_dim,
                num_layer_groups=geometries.count((heads, head_dim, value_dim)),
            )
            for heads, head_dim, value_dim in distinct
        ]


def layer_geometries(config: Any, types: list[str]) -> list[tuple[int, int, int] | None]:
    """The ``(num_kv_heads, head_dim, value_head_dim)`` each paged layer of a (decoder) config writes (``None``: not
    paged): the config's (``layer_geometry``), or each layer's own where the config is heterogeneous
    (``per_layer_config``) or its sliding layers hold other heads. Layers of different geometries never share a page."""
    paged = [kind in PAGED_LAYER_TYPES for kind in types]
    if getattr(config, "is_heterogeneous", False):
        return [layer_geometry(config.per_layer_config[idx]) if paged[idx] else None for idx in range(len(types))]
    heads, head_dim, value_head_dim = layer_geometry(config)
    more = 2 if getattr(config, "model_type", None) == "mimo_v2_flash" else 1  # its sliding layers' KV heads
    sliding = (heads * more, head_dim, value_head_dim)
    if getattr(config, "swa_head_dim", None) is not None:  # Inkling's sliding layers: heads of their own
        sliding = (config.swa_num_key_value_heads, config.swa_head_dim, config.swa_head_dim)
    return [
        (sliding if kind == "sliding_attention" else (heads, head_dim, value_head_dim)) if is_paged else None
        for kind, is_paged in zip(types, paged)
    ]


def geometry_groups(config: Any, types: list[str]) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """The layer groups of a (decoder) config's paged layers, of one type and geometry each, and each one's geometry."""
    found = layer_geometries(config, types)
    groups = layer_groups(types, found)
    return groups, [found[members[0]] for members in groups]


_logged: set[str] = set()  # the warnings said once in this process


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


def layer_geometry(config: Any) -> tuple[int, int, int]:
    """``(num_kv_heads, head_dim, value_head_dim)`` each attention layer of a (decoder) config writes, read where the
    config says it exactly (docs/caches.md names the models behind each rule)."""
    latent, rope = getattr(config, "kv_lora_rank", None), getattr(config, "qk_rope_head_dim", None)
    if latent is not None and rope is not None:  # latent attention caches its latent and rope key as one head
        return 1, latent, rope
    if getattr(config, "compress_rates", None) is not None:  # compressed attention: one head, keys and values alike
        return 1, config.head_dim, config.head_dim
    decoder_heads = getattr(config, "decoder_attention_heads", None)
    decoder_heads = decoder_heads or getattr(config, "num_decoder_attention_heads", None)
    if decoder_heads is not None:  # a decoder beside an encoder: its num_key_value_heads may be the encoder's
        head_dim = config.hidden_size // decoder_heads
        return decoder_heads, head_dim, head_dim
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or getattr(config, "dim_head", None) or config.hidden_size // num_heads
    return num_kv_heads, head_dim, getattr(config, "v_head_dim", None) or head_dim
