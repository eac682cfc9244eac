"""KV quantization (pure torch): the encoding and its reference decoder (``dequant`` has the fast ones).

A vector's ``head_dim`` channels (a token's; for keys per channel, one channel's ``page_size`` tokens) are cut into
*scale groups* of ``group_size``, each stored asymmetrically as unsigned codes plus a ``scale`` and a ``zero``::

    float zero (default):  x ~= zero + code * scale,   zero: the group's minimum, rounded down, in scale_dtype
    compact (3 bytes):     x ~= base + code * scale,   base = z * scale / 16, z: a 12-bit integer (1/16 steps)
    code in [0, max_code]  (255 for int8, 15 for int4: channel 2i in a byte's low nibble, 2i + 1 in its high one;
                            keys per channel: tokens i and i + page_size / 2, quantize_columns)

Float zeros: for finite inputs with ``|x| <= finfo(d).max / 2`` (``d``: the input's and the scale's dtype),
``|x - stored| <= scale / 2`` up to float32 rounding: codes are computed against the stored scale and zero, the zero
rounded down and the scale up where a cast rounded them the other way, so no code is clamped. A constant group whose
value the zero holds stores scale 0 and reconstructs exactly.

Compact parameters (``compact_params``: int4 keys per channel, where 16 tokens' parameters cost a third of their
codes): the scale is ``range / max_code`` rounded to 7 mantissa bits (a float16's top bits), the zero the minimum
rounded to 1/16 of that scale (``|z| <= 2047``; a larger minimum widens the scale), so the minimum and maximum get
codes 0 and ``max_code`` within 1/10 of a step, as the float32 math has them. Stored: an int16 word (bits 15..4: the
scale's float16 bits 14..3; bits 3..0: ``z``'s low 4 bits) and an int8 zero (``z >> 4``). For finite inputs with
``|x| <= 32752``, ``|x - stored| <= scale / 2 + 2**-14``; a constant group of 0 stores scale 0 and is exact.
"""

from dataclasses import dataclass

import torch

ZERO_STEPS = 16
"""A compact zero counts 1/16 scale steps."""

COMPACT_ZERO_RANGE = (-2048, 2047)
"""The compact zeros 12 bits hold."""

COMPACT_SCALE_MAX_BITS = 0xF7F
"""The largest compact scale (float16 bits 14..3): 65,280."""


@dataclass(frozen=True)
class QuantFormat:
    """How one head's vectors (values, or keys) are quantized: ``bits`` per code (8 or 4), ``group_size`` channels
    of the ``head_dim`` a scale group, scales and float zeros in ``scale_dtype`` (``None``: the input's dtype), or with
    ``compact_params`` (4 bits only) a scale and zero in 3 bytes."""

    bits: int
    group_size: int
    head_dim: int
    scale_dtype: torch.dtype | None = None
    compact_params: bool = False

    def __post_init__(self) -> None:
        if self.scale_dtype is not None and not (
            isinstance(self.scale_dtype, torch.dtype) and self.scale_dtype.is_floating_point
        ):
            raise TypeError(
                f"QuantFormat.scale_dtype must be a floating torch.dtype or None, got {self.scale_dtype!r}."
            )
        for name in ("bits", "group_size", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"QuantFormat.{name} must be an int, got {value!r} ({type(value).__name__}).")
        if self.bits not in (8, 4):
            raise ValueError(f"QuantFormat.bits must be 8 or 4, got {self.bits}.")
        if self.head_dim < 1:
            raise ValueError(f"QuantFormat.head_dim must be >= 1, got {self.head_dim}.")
        if self.group_size < 1 or self.head_dim % self.group_size:
            divisors = [d for d in range(1, self.head_dim + 1) if self.head_dim % d == 0]
            raise ValueError(
                f"QuantFormat.group_size={self.group_size} must divide head_dim={self.head_dim}; "
                f"choose one of {divisors}."
            )
        if self.compact_params and self.bits != 4:
            raise ValueError(
                f"QuantFormat.compact_params holds a scale to 7 mantissa bits, enough for 15 steps: it needs bits=4, "
                f"got bits={self.bits}."
            )
        if self.bits == 4 and self.head_dim % 2:
            raise ValueError(
                f"QuantFormat.bits=4 packs two codes per byte and needs an even head_dim, got {self.head_dim}."
            )

    @property
    def num_scale_groups(self) -> int:
        """Scales (and zeros) per token per head."""
        return self.head_dim // self.group_size

    @property
    def code_dim(self) -> int:
        """Bytes of codes per token per head."""
        return self.head_dim if self.bits == 8 else self.head_dim // 2

    @property
    def max_code(self) -> int:
        """Largest code: ``2 ** bits - 1``."""
        return (1 << self.bits) - 1


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Packs 4-bit codes ``[..., n]`` (uint8, ``n`` even) two per byte, ``[..., n // 2]``: channel ``2i`` in the low
    nibble, ``2i + 1`` in the high one."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs uint8 codes with an even last dim, got {codes.dtype} {tuple(codes.shape)}.")
    return codes[..., 0::2].add(codes[..., 1::2], alpha=16)  # the high nibble's code times 16: no carry


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: ``[..., n // 2]`` uint8 to ``[..., n]`` uint8 codes in ``[0, 15]``."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def quantize(x: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes ``x [..., head_dim]`` (finite, within the module docstring's bounds) group by group in float32.

    Returns:
        ``(codes, scale, zero)``: codes ``[..., code_dim]`` uint8; scale and zero ``[..., num_scale_groups]`` in
        ``fmt.scale_dtype or x.dtype`` (compact: int16 words, int8 zeros); ``scale == 0`` for exact constant groups.
    """
    if not x.is_floating_point() or x.shape[-1] != fmt.head_dim:
        raise ValueError(f"quantize needs floating x of shape [..., {fmt.head_dim}], got {x.dtype} {tuple(x.shape)}.")
    groups = x.float().unflatten(-1, (fmt.num_scale_groups, fmt.group_size))  # [..., num_scale_groups, group_size]
    low, high = groups.aminmax(dim=-1)  # [..., num_scale_groups]
    scale, zero, stored, base = _parameters(low, high, fmt, fmt.scale_dtype or x.dtype)
    codes = _codes(groups, base.unsqueeze(-1), stored.unsqueeze(-1), fmt).flatten(-2)  # [..., head_dim]
    return (codes if fmt.bits == 8 else pack_int4(codes)), scale, zero


def quantize_columns(x: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize`` of each column of ``x [..., head_dim, columns]`` as one scale group (a key page's channels over
    its tokens), in place of the last dim: ``(codes [..., code_dim, columns], scale, zero [..., 1, columns])``, the
    parameters and codes of ``quantize(x.mT)``; at 4 bits byte ``(i, c)`` holds rows ``i`` (low nibble) and ``i +
    code_dim`` of column ``c`` (``dequant.dequantize_channels`` reads them so)."""
    if fmt.num_scale_groups != 1 or not x.is_floating_point() or x.shape[-2] != fmt.head_dim:
        raise ValueError(
            f"quantize_columns needs one scale group and x [..., {fmt.head_dim}, columns], got "
            f"group_size={fmt.group_size}, {x.dtype} {tuple(x.shape)}."
        )
    columns = x.float()
    low, high = columns.aminmax(dim=-2, keepdim=True)  # [..., 1, columns]
    scale, zero, stored, base = _parameters(low, high, fmt, fmt.scale_dtype or x.dtype)
    codes = _codes(columns, base, stored, fmt)  # [..., head_dim, columns]
    if fmt.bits == 4:
        half = fmt.head_dim // 2
        codes = codes[..., :half, :].add(codes[..., half:, :], alpha=16)  # as pack_int4
    return codes, scale, zero


def _parameters(
    low: torch.Tensor, high: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """``(scale, zero, stored scale, base)`` of groups spanning ``[low, high]`` (float32): what ``quantize`` stores,
    and the float32 scale and base its codes are computed against."""
    if fmt.compact_params:
        scale, zero, stored, steps = _compact_params(low, high, fmt.max_code)
        return scale, zero, stored, steps * stored  # exact, as compact_scale_and_base has it
    # A float32 minimum is stored as it is (the common case: rounding it down would take six more small ops).
    zero = low if dtype == torch.float32 else _round_down(low, dtype)
    base = zero.float()
    scale = _covering_scale(high - base, fmt.max_code, dtype)
    return scale, zero, scale.float(), base


def _codes(x: torch.Tensor, base: torch.Tensor, stored: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """uint8 codes of float32 ``x`` against ``base`` and ``stored`` scales broadcast to it."""
    # A constant group has scale 0 and numerators 0: divide by 1 there to get code 0.
    steps = (x - base) / torch.where(stored > 0, stored, 1)
    return steps.round_().clamp_(0, fmt.max_code).to(torch.uint8)


def _compact_params(low: torch.Tensor, high: torch.Tensor, max_code: int) -> tuple[torch.Tensor, ...]:
    """The compact ``(scale word, zero)`` (int16, int8) of groups spanning ``[low, high]`` (float32), with the scale
    (float16) and the zero in scale steps (float32) that ``compact_scale_and_steps`` reads back from them."""
    lowest, highest = COMPACT_ZERO_RANGE
    # range / max_code, or wide enough for the zero to reach the minimum (the factor covers the scale's rounding).
    wanted = torch.maximum((high - low) / max_code, low.abs() * (ZERO_STEPS * (1 + 2**-7) / highest))
    half = wanted.clamp_(max=torch.finfo(torch.float16).max).to(torch.float16).view(torch.int16)  # <= 0x7BFF
    scale_bits = ((half + 4) >> 3).clamp_(max=COMPACT_SCALE_MAX_BITS)  # nearest 7-bit mantissa (ties up)
    scale = (scale_bits << 3).view(torch.float16)
    # A scale of 0 (a group within 3.2e-6 of constant, |low| below 2.7e-5) divides by 1, and its zero rounds to 0.
    zero = (low * ZERO_STEPS / torch.where(scale > 0, scale, 1)).round_().int().clamp_(lowest, highest)
    word = (zero & (ZERO_STEPS - 1)).add_(scale_bits, alpha=ZERO_STEPS).to(torch.int16)  # wraps bit 15 to the sign
    return word, (zero >> 4).to(torch.int8), scale, zero.div(ZERO_STEPS)


def compact_scale_and_base(word: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 ``(scale, base)`` of compact parameters (int16 words and int8 zeros of any equal shape): a value
    is ``base + code * scale``."""
    scale, steps = compact_scale_and_steps(word, zero)
    return scale.float(), steps * scale


def compact_scale_and_steps(word: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale (as its float16: it promotes in a product with float32, one op fewer than a cast) and the zero in
    scale steps (``z / 16``, float32) of compact parameters. ``code + z / 16`` is exact in float32, so
    ``(code + z / 16) * scale`` rounds once, as the reference's exact product plus exact base does: bitwise equal."""
    scale = ((word >> 1) & 0x7FF8).view(torch.float16)
    # z = 16 * (its high bits) + its low 4 bits: one add (the low bits are below the sum's, so it equals the OR);
    # an integer's true division is float32, and z / 16 is exact in it
    steps = torch.add(word & (ZERO_STEPS - 1), zero, alpha=ZERO_STEPS).div(ZERO_STEPS)
    return scale, steps


def compact_scale_and_steps_from_bytes(
    word_bytes: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``compact_scale_and_steps`` of words given as their bytes, ``[..., 2 * n]`` uint8 (little-endian: a word's low
    byte first) with zeros ``[..., n]``: bitwise the same, computed in int32 (inductor's CPU code vectorizes no
    gathered int16 load)."""
    bits = word_bytes[..., 0::2].int() | (word_bytes[..., 1::2].int() << 8)  # the words' 16 bits, [..., n]
    half = (bits >> 1) & 0x7FF8  # the scale's float16 bits: sign 0, exponent at most 30 (COMPACT_SCALE_MAX_BITS)
    # A normal float16's float32 bits: the exponent rebased (+112) above the mantissa, both moved up 13 bits; a
    # subnormal one is its mantissa times 2**-24 (exact).
    scale = torch.where(half >= 1 << 10, ((half + (112 << 10)) << 13).view(torch.float32), half.float() * 2.0**-24)
    steps = torch.add(bits & (ZERO_STEPS - 1), zero, alpha=ZERO_STEPS).div(ZERO_STEPS)
    return scale, steps


def _round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) cast to ``dtype``, one step down where the cast rounded it up."""
    cast = x.to(dtype)
    return torch.where(cast.float() > x, cast.nextafter(torch.full_like(cast, -torch.inf)), cast)


def _covering_scale(span: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``dtype`` scale nearest ``span / steps`` from above, so that ``steps * scale >= span`` (float32 ``span >=
    0``; the product is exact in float32 for bfloat16/float16 scales). Finite: at most ``finfo(dtype).max``."""
    scale = (span / steps).to(dtype)
    # Where the cast rounded the scale down, steps * scale would fall short of the span and the group's maximum
    # would be clamped (error up to a whole scale); one step up restores the bound.
    scale = torch.where(scale.float() * steps < span, scale.nextafter(torch.full_like(scale, torch.inf)), scale)
    return scale.clamp(max=torch.finfo(dtype).max)


def join_scales(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * num_scale_groups]``: the scales, then the zeros, as a pool stores them (not ``torch.cat``, which
    CPU autocast refuses for float16)."""
    joined = scale.new_empty(*scale.shape[:-1], 2 * scale.shape[-1])
    joined[..., : scale.shape[-1]] = scale
    joined[..., scale.shape[-1] :] = zero
    return joined


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype
) -> torch.Tensor:
    """The reference decoder: ``codes [..., code_dim]`` with ``scale``, ``zero [..., num_scale_groups]`` to
    ``[..., head_dim]`` in ``dtype``: ``code * scale + base`` in float32 (a product, then a sum; ``base``: the zero,
    or ``z * scale / 16``), rounded once. The fast decoders (``dequant``) do the same ops in the same order."""
    unpacked = codes if fmt.bits == 8 else unpack_int4(codes)  # [..., head_dim]
    groups = unpacked.float().unflatten(
        -1, (fmt.num_scale_groups, fmt.group_size)
    )  # [..., num_scale_groups, group_size]
    if fmt.compact_params:
        scale, zero = compact_scale_and_base(scale, zero)
    values = groups * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return values.flatten(-2).to(dtype)
