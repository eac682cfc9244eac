"""The page format a pool is cut into (``PageFormat``), read from a model config: a frozen dataclass that checks
itself on construction and names the setting to change.
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
"""Tokens of one extent, which attention reads in place as one KV block (``attention.flex``): rows take their pages
in aligned extents of ``KV_BLOCK_TOKENS // page_size`` pages. Compiled FlexAttention pays a fixed cost per block,
so extents are large; 128 still keeps a row's last one small (docs/attention.md)."""


def check_page_size(page_size: int) -> int:
    """Returns ``page_size`` if it is a valid page size, else raises a ``ValueError`` naming the setting."""
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size must be an int, got {page_size!r} ({type(page_size).__name__}).")
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size={page_size} is out of range: choose 1 <= page_size <= {MAX_PAGE_SIZE}.")
    return page_size


INDEXED_ATTENTION = "indexed_attention"
"""Sparse attention with a lightning indexer (DeepSeek-V3.2, GLM-MoE-DSA, ...): its keys and values are paged as a full
attention layer's, and its indexer's keys, which pick the keys each query reads, are kept beside them
(``caches.state_layers.IndexerKeys``)."""

PAGED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", INDEXED_ATTENTION)
"""Layer types whose keys and values live in pool pages. Layers of other types (linear attention, convolution and
state-space states) hold no pages: the caches keep transformers' own cache layers for them, outside the pool; layers
that carry both keys and a state page their keys (``FUSED_LAYER_TYPES``)."""

FUSED_LAYER_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
"""Layer types that carry both keys and a state (attention fused with a state-space block: Falcon-H1, Zaya, Inkling),
by the attention type their keys and values are paged as; their convolution and recurrent states stay in the state
half of transformers' own layer (``hf_kvcache.caches.state_layers.with_state``)."""

COMPRESSED_LAYER_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")
"""Compressed attention (DeepSeek-V4's CSA and HCA layers): a sliding window of the model's ``sliding_window`` over one
shared key-and-value head, paged as a ``sliding_attention`` layer's, beside a compressor's state (buffered tokens,
compressed entries) kept in transformers' own cache layer (``hf_kvcache.caches.compressed``)."""


def attention_halves(types: list[str]) -> list[str]:
    """``types`` with each fused layer typed as its attention half (``FUSED_LAYER_TYPES``) and each compressed layer as
    the sliding layer its window is (``COMPRESSED_LAYER_TYPES``)."""
    return [
        "sliding_attention" if kind in COMPRESSED_LAYER_TYPES else FUSED_LAYER_TYPES.get(kind, kind) for kind in types
    ]


def layer_types(config: Any) -> list[str]:
    """The attention type of each layer of a (decoder) config: ``full_attention``, ``sliding_attention``, ...

    Mirrors ``transformers.cache_utils.get_layer_types_and_kwargs`` (which this module cannot
    import): ``config.layer_types`` when given, else sliding where the config has a window. Layers
    that keep no cache of their own are ``dummy``.
    """
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
"""The type we give a layer that attends to an image's or encoder's keys (``config.cross_attention_layers``:
Mllama), which transformers' caches count as ``full_attention``: its keys are not the prompt's tokens, so it keeps
transformers' own cache layer, outside the pool."""


def with_cross_attention(config: Any, types: list[str]) -> list[str]:
    """``types`` with the layers of ``config.cross_attention_layers`` typed ``CROSS_ATTENTION``."""
    cross = set(getattr(config, "cross_attention_layers", None) or ())
    return [CROSS_ATTENTION if idx in cross else kind for idx, kind in enumerate(types)]


def layer_groups(types: list[str], geometries: list[Any] | None = None) -> list[list[int]]:
    """Splits the paged layers into equal *layer groups* of one attention type (and one geometry, where
    ``geometries`` gives each layer's: ``geometry_groups``) each (layers of a type not in ``PAGED_LAYER_TYPES``,
    ``dummy`` ones included, left out).

    A page spans the layers of one layer group, and each layer group has its own page table, so layers
    that keep different tokens (a full layer keeps all, a sliding layer only its window) never share a
    page. The layer group size is the greatest common divisor of the layer counts of each type: a model of
    one type is one layer group of all its layers; Gemma 3 (25 sliding + 5 full layers) is 6 groups of 5.
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
    """Geometry of one page: ``page_size`` slots in each of the ``num_layers`` layers of one layer group.

    A model whose layers are all of one type is one layer group (``num_layer_groups == 1``); a hybrid model
    (sliding and full layers) has ``num_layer_groups`` groups of ``num_layers`` layers (``layer_groups``). Keys are
    stored in ``dtype``; values too, or, with ``value_bits`` set, as int8/int4 codes plus a scale and zero per
    scale group of ``value_group_size`` channels (``memory.quant``). With ``key_bits`` set, keys are stored as
    codes too, a page at a time (encoded once, when the page's last slot is written):

    - ``key_bits=8``: per token, a scale and zero per scale group of ``key_group_size`` channels;
    - ``key_bits=4``: per channel over the page's ``page_size`` tokens (keys have outlier channels, which int4 per
      token loses; docs/caches.md), a scale and a zero per channel and page in 3 bytes
      (``QuantFormat.compact_params``: the float32 math's grid to within 1/10 of a step).

    Scales (and float zeros) are stored in ``scale_dtype``, by default ``dtype``. Values are ``value_head_dim``
    wide where it is set (``value_dim``; ``None``: ``head_dim``, as keys): multi-head latent attention caches its
    latent as keys and its narrower rope key as values. Values are coded at their own width (``value_group_size``
    divides ``value_dim``), keys at theirs.

    With ``values_are_keys`` (a model that writes one tensor as its keys and its values: ``update(kv, kv)``,
    DeepSeek-V4's shared key-and-value head, ``compress_rates``) a page stores no values: the pool's values
    are its keys, read as such on every path, and a page's bytes count the keys once. There are then no values to
    code: ``value_bits`` is dropped (to ``None``, logged once), and attention gets the keys as the values, full
    precision or decoded from ``key_bits`` codes.
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
        """Channels of a stored value: ``value_head_dim``, or ``head_dim`` where that is ``None``."""
        return self.value_head_dim or self.head_dim

    @property
    def value_format(self) -> QuantFormat | None:
        """How values are quantized (``value_dim`` channels a token); ``None`` when they are stored in ``dtype``."""
        if self.value_bits is None:
            return None
        return QuantFormat(self.value_bits, self.value_group_size, self.value_dim, self.scale_dtype)

    @property
    def key_format(self) -> QuantFormat | None:
        """How keys are quantized: a token's channels (``key_bits=8``), or a channel's ``page_size`` tokens
        (``key_bits=4``, ``keys_per_channel``); ``None`` when they are stored in ``dtype``."""
        if self.key_bits is None:
            return None
        if self.keys_per_channel:
            return QuantFormat(4, self.page_size, self.page_size, compact_params=True)
        return QuantFormat(self.key_bits, self.key_group_size, self.head_dim, self.scale_dtype)

    @property
    def keys_per_channel(self) -> bool:
        """Keys are encoded per channel over each page's tokens (``key_bits=4``)."""
        return self.key_bits == 4

    @property
    def encodes(self) -> bool:
        """Keys or values are stored as codes (attention then reads them gathered and decoded, never in place)."""
        return self.key_bits is not None or self.value_bits is not None

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (keys and values of ``page_size`` slots in ``num_layers`` layers; keys only where
        ``values_are_keys``)."""
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
        """Reads the attention geometry of a transformers (decoder) config.

        Raises:
            IncompatibleModelError: the config has no attention geometry we can page.
        """
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
        """The formats of a model whose layer groups write the ``geometries`` (``geometry_groups``; this format is
        the first's, ``from_model_config``): one per geometry, in their order, each with its layer groups, and this
        format's page size, dtypes and codes (scale groups included: a cache config chooses them for the first
        geometry; they must divide the others' widths).

        Raises:
            ValueError: a scale group does not divide another geometry's width.
        """
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
    """The ``(num_kv_heads, head_dim, value_head_dim)`` each paged layer of a (decoder) config writes (``None``: a
    layer not paged): the config's (``layer_geometry``), or each layer's own where the config is heterogeneous
    (``per_layer_config``: Gemma 4's wider global layers) or the model's sliding layers hold other heads
    (MiMo-V2-Flash: twice ``num_key_value_heads``; Inkling: ``swa_num_key_value_heads`` of ``swa_head_dim``). Layers
    of different geometries never share a page: each geometry has pools of its own page format
    (``PageFormat.for_geometries``)."""
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
    """The layer groups of a (decoder) config's paged layers (``layer_groups``: one attention type and one geometry
    each) and the geometry each writes (``layer_geometries``)."""
    found = layer_geometries(config, types)
    groups = layer_groups(types, found)
    return groups, [found[members[0]] for members in groups]


_logged: set[str] = set()  # the warnings said once in this process


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


def layer_geometry(config: Any) -> tuple[int, int, int]:
    """``(num_kv_heads, head_dim, value_head_dim)`` of the keys and values each attention layer of a (decoder) config
    writes.

    Read where the config says it exactly: a decoder beside an encoder writes its own heads
    (``decoder_attention_heads`` or ``num_decoder_attention_heads``, where ``num_attention_heads`` and
    ``num_key_value_heads`` may be the encoder's: BART-like decoders, Whisper, ProphetNet), each ``hidden_size`` over
    them wide; otherwise ``num_key_value_heads`` (one for a multi-query model: GPTBigCode's ``multi_query`` sets it),
    else ``num_attention_heads``, each ``head_dim`` (or ``dim_head``: CPM-Ant) wide, else ``hidden_size`` over the
    heads; values ``v_head_dim`` wide where the config says so (MiMo-V2-Flash), else as wide as the keys. Multi-head
    latent attention (``kv_lora_rank`` and ``qk_rope_head_dim``: DeepSeek-V2/V3, Kimi, ...) writes one head: its
    compressed latent as the keys, its rope key as the values. Compressed attention (``compress_rates``: DeepSeek-V4)
    writes one head of ``head_dim``, the same tensor as keys and as values (``PageFormat.values_are_keys``).
    """
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
