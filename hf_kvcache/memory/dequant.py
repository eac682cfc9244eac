"""Fast decoders of ``quant``'s codes, each bitwise equal to the reference ``dequantize``: values in place into
reused buffers (``dequantize_joined_into``), keys coded per channel into a buffer in a few ops a compiled graph
fuses (``dequantize_channels``).
"""

import sys

import torch

from hf_kvcache.memory.quant import QuantFormat, compact_scale_and_steps, compact_scale_and_steps_from_bytes


def _float32_work(out: torch.Tensor, work: torch.Tensor | None) -> torch.Tensor:
    """``out`` itself when it is float32, else ``work`` (made if ``None``)."""
    if out.dtype == torch.float32:
        return out
    return torch.empty(out.shape, dtype=torch.float32, device=out.device) if work is None else work


def dequantize_channels(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: QuantFormat, out: torch.Tensor
) -> torch.Tensor:
    """Decodes vectors that run down the columns of ``[..., head_dim, columns]`` (a channel's tokens of a key page, one
    scale group per column) from row-major codes ``[..., code_dim, columns]`` uint8 into ``out`` (float32, that shape;
    returned), in place after one op that converts the codes (a compiled graph fuses them): bitwise ``dequantize(
    codes.mT, scale.mT, zero.mT, fmt, torch.float32).mT`` of the columns' own codes. At 4 bits byte ``(i, c)`` holds
    rows ``i`` (low nibble) and ``i + code_dim`` of column ``c`` (``quant.quantize_columns``). ``scale``, ``zero``:
    ``[..., 1, columns]``; compact words may come as their bytes, ``scale [..., 1, 2 * columns]`` uint8."""
    if fmt.bits == 4:  # rows i (low nibble), then rows i + code_dim (high), converted as they are joined
        torch.cat((codes & 0xF, codes >> 4), dim=-2, out=out)
    else:
        out.copy_(codes)
    _codes_to_values(out, scale, zero, fmt)
    return out


def _codes_to_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: QuantFormat) -> None:
    """Float32 ``codes`` to values in place: ``* scale + zero``, or (compact: words, or as uint8 their bytes)
    ``+ z / 16`` then ``* scale``."""
    if fmt.compact_params:
        from_bytes = scale.dtype == torch.uint8
        scale, steps = (compact_scale_and_steps_from_bytes if from_bytes else compact_scale_and_steps)(scale, zero)
        codes.add_(steps)
        codes.mul_(scale)
    else:
        codes.mul_(scale)
        codes.add_(zero)


def dequantize_joined_into(
    out: torch.Tensor,
    codes: torch.Tensor,
    joined: torch.Tensor,
    fmt: QuantFormat,
    work: torch.Tensor | None = None,
    spread: tuple[torch.Tensor, ...] | torch.Tensor | None = None,
) -> None:
    """Dequantizes into a preallocated buffer, bitwise equal to ``dequantize(..., out.dtype)``.

    The codes are copied into a float32 buffer (``out`` itself when it is float32) and turned into values in place
    with a multiply and an add (faster on CPU than ``addcmul`` with a per-group broadcast). int4 first spreads each
    byte's nibbles over the two bytes of an int16 (``byte + 240 * high``), which on a little-endian machine are the
    even and odd channels' codes in order: one contiguous copy converts them (big-endian: two strided copies).

    Args:
        out: ``[..., head_dim]``, written in place (a view is fine). codes: ``[..., code_dim]`` uint8. joined:
            ``[..., 2 * num_scale_groups]``, as ``join_scales`` lays them out. work: float32, ``out``'s shape (made
            if ``None``; unused for float32 ``out``).
        spread: int4 on a little-endian machine: int16 buffers of ``codes``' shape for the spread codes and their
            high nibbles (a pair, or one ``[2, *codes.shape]`` tensor; made if ``None``); a third, ``spread_bytes``
            of the first, saves two ops.
    """
    if out.shape[-1] != fmt.head_dim or codes.shape[-1] != fmt.code_dim:
        raise ValueError(
            f"dequantize_joined_into needs out [..., {fmt.head_dim}] and codes [..., {fmt.code_dim}], "
            f"got {tuple(out.shape)} and {tuple(codes.shape)}."
        )
    groups = fmt.num_scale_groups
    pairs = joined.view(*joined.shape[:-1], 2, *((groups, 1) if groups > 1 else (1,)))
    scale, zero = pairs.unbind(-3 if groups > 1 else -2)  # each [..., groups, 1], or [..., 1] for one group
    work = _float32_work(out, work)
    if fmt.bits == 8:
        work.copy_(codes)
    elif sys.byteorder == "little":
        if spread is None:
            spread = torch.empty((2, *codes.shape), dtype=torch.int16, device=codes.device)  # [2, ..., code_dim]
        spread_codes, high = spread[0], spread[1]
        spread_codes.copy_(codes)
        torch.bitwise_right_shift(spread_codes, 4, out=high)
        spread_codes.add_(high, alpha=240)  # low byte: the low nibble, high byte: the high nibble
        as_bytes = spread[2] if isinstance(spread, tuple) and len(spread) == 3 else spread_bytes(spread_codes, work)
        work.copy_(as_bytes)
    else:
        pairs = work.unflatten(-1, (fmt.code_dim, 2))  # view [..., code_dim, 2]
        pairs[..., 0].copy_(codes & 0xF)
        pairs[..., 1].copy_(codes >> 4)
    values = work.unflatten(-1, (groups, fmt.group_size)) if groups > 1 else work  # view [..., groups, group_size]
    _codes_to_values(values, scale, zero, fmt)
    if work is not out:
        out.copy_(work)


def spread_bytes(spread: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """The spread codes (int16, little-endian) as ``work``'s shape in bytes: ``dequantize_joined_into``'s third
    ``spread`` buffer."""
    return spread.view(torch.uint8).view(work.shape)
