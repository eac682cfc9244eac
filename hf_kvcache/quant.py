"""Value quantization for a value-quantized KV cache (pure torch): the reference and an in-place fast path.

Each token's ``head_dim`` value channels are cut into ``num_scale_groups`` *scale groups* of ``group_size``
consecutive channels. A scale group is stored asymmetrically as unsigned codes plus one ``scale`` and one ``zero``
(the group's minimum) in the values' dtype::

    value ~= zero + code * scale,    code in [0, max_code]  (255 for int8, 15 for int4)

int8 stores one code per byte; int4 packs two channels per byte, the even channel in the low nibble and
the odd channel in the high nibble. For finite inputs with ``|x| <= finfo(dtype).max / 2`` every stored
group satisfies ``|x - (zero + code * scale)| <= scale / 2`` up to float32 rounding: codes are computed
against the stored (cast) scale and zero, and the scale is rounded up where the cast rounded it down, so
``max_code * scale`` covers the group's range and no code is clamped. A constant group stores scale 0 and
reconstructs exactly.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantFormat:
    """How one head's values are quantized.

    Attributes:
        bits: bits per code, 8 or 4.
        group_size: consecutive channels sharing one scale and zero (a scale group); divides ``head_dim``.
        head_dim: channels per head; even for 4 bits (two codes per byte).
    """

    bits: int
    group_size: int
    head_dim: int

    def __post_init__(self) -> None:
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
    """Packs 4-bit codes two per byte: channel ``2i`` in the low nibble, ``2i + 1`` in the high nibble.

    Args:
        codes: ``[..., n]`` uint8 in ``[0, 15]``, ``n`` even.

    Returns:
        ``[..., n // 2]`` uint8.
    """
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs uint8 codes with an even last dim, got {codes.dtype} {tuple(codes.shape)}.")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: ``[..., n // 2]`` uint8 to ``[..., n]`` uint8 codes in ``[0, 15]``."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def quantize(x: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes values group by group (computed in float32).

    Args:
        x: ``[..., head_dim]`` floating values, finite, ``|x| <= finfo(x.dtype).max / 2``.
        fmt: the quantization format.

    Returns:
        ``(codes, scale, zero)``: codes ``[..., code_dim]`` uint8; scale and zero ``[..., num_scale_groups]`` in
        ``x.dtype``. ``scale >= 0``, and ``scale == 0`` exactly for constant groups.
    """
    if not x.is_floating_point() or x.shape[-1] != fmt.head_dim:
        raise ValueError(f"quantize needs floating x of shape [..., {fmt.head_dim}], got {x.dtype} {tuple(x.shape)}.")
    groups = x.float().unflatten(-1, (fmt.num_scale_groups, fmt.group_size))  # [..., num_scale_groups, group_size]
    low, high = groups.aminmax(dim=-1)  # [..., num_scale_groups]
    span = high - low  # [..., num_scale_groups]
    scale = (span / fmt.max_code).to(x.dtype)
    # Where the cast rounded the scale down, max_code * scale would fall short of the span and the group's
    # maximum would be clamped (error up to a whole scale); one step up restores the bound. The product is
    # exact in float32 for bfloat16/float16 scales.
    scale = torch.where(scale.float() * fmt.max_code < span, scale.nextafter(torch.full_like(scale, torch.inf)), scale)
    zero = low.to(x.dtype)  # exact: the minimum is one of x's values
    stored_scale = scale.float().unsqueeze(-1)  # [..., num_scale_groups, 1]
    # A constant group has scale 0 and numerators 0: divide by 1 there to get code 0.
    steps = (groups - low.unsqueeze(-1)) / torch.where(stored_scale > 0, stored_scale, 1)
    codes = steps.round_().clamp_(0, fmt.max_code).to(torch.uint8).flatten(-2)  # [..., head_dim]
    return (codes if fmt.bits == 8 else pack_int4(codes)), scale, zero


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype
) -> torch.Tensor:
    """The reference: ``code * scale + zero`` per group in float32 (a product, then a sum), rounded once to ``dtype``.

    ``dequantize_into`` does the same operations in the same order, so the two agree bitwise.

    Args:
        codes: ``[..., code_dim]`` uint8. scale, zero: ``[..., num_scale_groups]``.

    Returns:
        ``[..., head_dim]`` in ``dtype``.
    """
    unpacked = codes if fmt.bits == 8 else unpack_int4(codes)  # [..., head_dim]
    groups = unpacked.float().unflatten(
        -1, (fmt.num_scale_groups, fmt.group_size)
    )  # [..., num_scale_groups, group_size]
    values = groups * scale.float().unsqueeze(-1)
    values = values + zero.float().unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def dequantize_into(
    out: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    fmt: QuantFormat,
    work: torch.Tensor | None = None,
) -> None:
    """Dequantizes into a preallocated buffer, bitwise equal to ``dequantize(..., out.dtype)``.

    The codes are copied into a float32 buffer (``out`` itself when it is float32) and turned into values in
    place with a multiply and an add (two fast elementwise passes; ``addcmul`` with a per-group broadcast is
    several times slower on CPU); int4 writes its low and high nibbles into the even and odd channels.

    Args:
        out: ``[..., head_dim]`` floating, written in place; may be a view into a larger buffer.
        codes: ``[..., code_dim]`` uint8. scale, zero: ``[..., num_scale_groups]``.
        work: a float32 buffer of ``out``'s shape, reused across calls when ``out`` is not float32 (made if
            ``None``).
    """
    if out.shape[-1] != fmt.head_dim or codes.shape[-1] != fmt.code_dim:
        raise ValueError(
            f"dequantize_into needs out [..., {fmt.head_dim}] and codes [..., {fmt.code_dim}], "
            f"got {tuple(out.shape)} and {tuple(codes.shape)}."
        )
    if out.dtype != torch.float32:
        work = torch.empty(out.shape, dtype=torch.float32, device=out.device) if work is None else work
    else:
        work = out
    if fmt.bits == 8:
        work.copy_(codes)
    else:  # the nibbles straight into the even and odd channels: half the passes of unpack_int4 then copy
        pairs = work.unflatten(-1, (fmt.code_dim, 2))  # view [..., code_dim, 2]
        pairs[..., 0].copy_(codes & 0xF)
        pairs[..., 1].copy_(codes >> 4)
    groups = work.unflatten(-1, (fmt.num_scale_groups, fmt.group_size))  # view [..., num_scale_groups, group_size]
    groups.mul_(scale.unsqueeze(-1))
    groups.add_(zero.unsqueeze(-1))
    if work is not out:
        out.copy_(work)
