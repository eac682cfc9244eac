"""Value quantization: the error bound, the code range, int4 packing, and the fast path against the reference."""

import math
import sys
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_kvcache.memory.dequant import dequantize_channels, dequantize_joined_into
from hf_kvcache.memory.quant import (
    COMPACT_SCALE_MAX_BITS,
    QuantFormat,
    compact_scale_and_base,
    compact_scale_and_steps,
    compact_scale_and_steps_from_bytes,
    dequantize,
    join_scales,
    pack_int4,
    quantize,
    quantize_columns,
    unpack_int4,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FAST = settings(max_examples=150, deadline=None)


@st.composite
def formats(draw) -> QuantFormat:
    """Formats of every kind: scales in the input's dtype or a 2-byte one, float zeros or compact parameters."""
    bits = draw(st.sampled_from([8, 4]))
    head_dim = draw(st.integers(1, 64)) * (2 if bits == 4 else 1)
    group_size = draw(st.sampled_from([d for d in range(1, head_dim + 1) if head_dim % d == 0]))
    scale_dtype = draw(st.sampled_from([None, None, torch.float16, torch.bfloat16]))
    return QuantFormat(bits, group_size, head_dim, scale_dtype, bits == 4 and draw(st.booleans()))


@st.composite
def values(draw, fmt: QuantFormat) -> torch.Tensor:
    """``[..., head_dim]`` values of any magnitude the format accepts: normal, subnormal, offset, constant groups."""
    dtype = draw(st.sampled_from(DTYPES))
    info = torch.finfo(dtype)
    scale_dtype = torch.float16 if fmt.compact_params else fmt.scale_dtype  # compact scales: float16's exponent
    if scale_dtype is not None and torch.finfo(scale_dtype).max < info.max:
        info = torch.finfo(scale_dtype)  # the scales' range bounds the inputs' (float32 inputs, float16 scales)
    shape = (*draw(st.lists(st.integers(1, 3), max_size=3)), fmt.head_dim)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    exponent = draw(st.integers(round(math.log2(info.smallest_normal)) - 8, round(math.log2(info.max)) - 5))
    offset = draw(st.sampled_from([0.0, 1.0, -3.0, 100.0]))
    x = (torch.randn(shape, generator=generator, dtype=torch.float64) + offset) * 2.0**exponent
    constant = torch.rand((*shape[:-1], fmt.num_scale_groups), generator=generator) < draw(
        st.sampled_from([0.0, 0.3, 1.0])
    )
    groups = x.unflatten(-1, (fmt.num_scale_groups, fmt.group_size))
    x = torch.where(constant.unsqueeze(-1), groups[..., :1], groups).flatten(-2)
    limit = info.max / 2
    for _ in range(draw(st.integers(0, 3))):  # a few hand-picked values anywhere
        index = draw(st.integers(0, x.numel() - 1))
        x.view(-1)[index] = draw(st.floats(-limit, limit, width=16 if dtype == torch.float16 or info.max < 1e5 else 32))
    return x.clamp(-limit, limit).to(dtype)


@st.composite
def cases(draw) -> tuple[QuantFormat, torch.Tensor]:
    fmt = draw(formats())
    return fmt, draw(values(fmt))


def grouped(tensor: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """``[..., head_dim]`` as float64 ``[..., num_scale_groups, group_size]``."""
    return tensor.double().unflatten(-1, (fmt.num_scale_groups, fmt.group_size))


def unpacked(codes: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return codes if fmt.bits == 8 else unpack_int4(codes)


def stored_scale_and_base(scale: torch.Tensor, zero: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, ...]:
    """float64 ``[..., num_scale_groups, 1]`` scale and base of stored parameters (compact ones unpacked)."""
    if fmt.compact_params:
        scale, zero = compact_scale_and_base(scale, zero)
    return scale.double().unsqueeze(-1), zero.double().unsqueeze(-1)


COMPACT_SLACK = 2**-14
"""Absolute error a compact scale below float16's normal range may add (module docstring of hf_kvcache.memory.quant)."""


@FAST
@given(cases())
def test_stored_values_are_within_half_a_scale(case):
    fmt, x = case
    codes, scale, zero = quantize(x, fmt)
    assert codes.dtype == torch.uint8 and codes.shape == (*x.shape[:-1], fmt.code_dim)
    assert scale.shape == zero.shape == (*x.shape[:-1], fmt.num_scale_groups)
    stored = (torch.int16, torch.int8) if fmt.compact_params else (fmt.scale_dtype or x.dtype,) * 2
    assert (scale.dtype, zero.dtype) == stored
    q = grouped(unpacked(codes, fmt), fmt)
    s, z = stored_scale_and_base(scale, zero, fmt)
    assert (s >= 0).all() and s.isfinite().all()
    # Exact arithmetic on the stored scale and zero (float64 holds code * scale exactly). The code is
    # round((x - zero) / scale) with the subtraction and the division each rounded in float32 (relative
    # error 2**-24 each), so the quotient, at most max_code * (1 + 2**-23), is off by <= max_code * 2**-23
    # before rounding to an integer; 2**-22 leaves a factor of 2 for the float64 evaluation here.
    error = (grouped(x, fmt) - (z + q * s)).abs()
    assert (error <= s * (0.5 + fmt.max_code * 2**-22) + COMPACT_SLACK * fmt.compact_params).all()
    # Codes use the range: the group minimum gets code 0 and the maximum a code near max_code. A normal scale
    # is within one dtype step of range / max_code (rounded to nearest, maybe one step up), i.e. at most
    # (1 + 2 * eps) times it, so the maximum's code is >= round(max_code / (1 + 2 * eps)).
    low, high = grouped(x, fmt).amin(dim=-1), grouped(x, fmt).amax(dim=-1)
    if not fmt.compact_params:
        info = torch.finfo(scale.dtype)
        normal = scale >= info.smallest_normal
        exact_zero = zero.double() == low  # else rounded down to the scale dtype
        assert (q.amin(dim=-1)[exact_zero] == 0).all()
        normal &= exact_zero
        assert (q.amax(dim=-1)[normal] >= math.floor(fmt.max_code * (1 - 2 * info.eps) + 0.5)).all()
        return
    # Compact: the scale is range / max_code, or |minimum| * 16 / 2047 (a 12-bit zero must reach the minimum),
    # rounded to a 7-bit mantissa (after a float16 cast); where it is range / max_code and a normal float16,
    # the minimum gets code 0 and the maximum max_code, as in the float32 math.
    s = s.squeeze(-1)
    wanted = torch.maximum((high - low) / fmt.max_code, low.abs() * 16 * (1 + 2**-7) / 2047)
    # Below float16's normal range the 7-bit rounding is to 2**-21, after the cast has rounded (by up to 2**-25).
    assert (s <= wanted * (1 + 2**-8 + 2**-11) + 2**-22 + 2**-25).all()
    tight = (s >= 2**-14) & (low.abs() * 16 * (1 + 2**-7) / 2047 <= (high - low) / fmt.max_code)
    assert (q.amin(dim=-1)[tight] == 0).all() and (q.amax(dim=-1)[tight] == fmt.max_code).all()


@FAST
@given(cases())
def test_dequantized_values_are_within_half_a_scale(case):
    fmt, x = case
    codes, scale, zero = quantize(x, fmt)
    y = grouped(dequantize(codes, scale, zero, fmt, x.dtype), fmt)
    q, (s, _) = grouped(unpacked(codes, fmt), fmt), stored_scale_and_base(scale, zero, fmt)
    info = torch.finfo(x.dtype)
    # Beyond the bound on the stored values (previous test), dequantize computes w = zero + q * scale in
    # float32 (the product and the sum rounded, relative 2**-24 each; doubled here to 2**-23 so that |y|
    # may stand in for |w|), then rounds w to the dtype: relative eps / 2, or half the subnormal spacing
    # (smallest_normal * eps, which also covers float32's own subnormal spacing).
    subnormal = info.smallest_normal * info.eps
    float32 = s * fmt.max_code * 2**-22 + 2**-23 * ((q * s).abs() + y.abs()) + subnormal
    to_dtype = info.eps / 2 * y.abs() + subnormal
    # x is itself a dtype value and y the dtype value nearest to w, so |y - w| <= |x - w| as well: the
    # final rounding at most doubles the error, which caps the bound at a whole scale where the dtype's
    # step is coarse next to the scale (bfloat16 values far from zero).
    bound = s / 2 + float32 + torch.minimum(to_dtype, s / 2 + float32) + 2 * COMPACT_SLACK * fmt.compact_params
    assert ((grouped(x, fmt) - y).abs() <= bound).all()


@FAST
@given(cases())
def test_constant_groups_reconstruct_exactly(case):
    """Those whose value the zero holds: with compact parameters, 0; else any value the scale dtype holds (others are
    within half a scale: the bound above)."""
    fmt, x = case
    codes, scale, zero = quantize(x, fmt)
    low = grouped(x, fmt).amin(dim=-1)
    constant = low == grouped(x, fmt).amax(dim=-1)
    constant &= (low == 0) if fmt.compact_params else (low.to(scale.dtype).double() == low)
    assert (scale[constant] == 0).all()
    y = dequantize(codes, scale, zero, fmt, x.dtype)
    assert torch.equal(grouped(y, fmt)[constant], grouped(x, fmt)[constant])


def test_float16_scales_for_float32_values_keep_the_bound_near_the_limit():
    """Scales that a float16 cast would round down or to infinity: rounded up, capped at float16's largest."""
    fmt = QuantFormat(4, 4, 8, scale_dtype=torch.float16)
    x = torch.tensor([[-32000.0, 0.0, 1.0, 32000.0, 1e-9, 3e-9, 2e-9, 1.5e-9]])
    codes, scale, zero = quantize(x, fmt)
    y = dequantize(codes, scale, zero, fmt, torch.float32)
    assert scale.dtype == zero.dtype == torch.float16 and scale.isfinite().all()
    assert ((x - y).abs().unflatten(-1, (2, 4)) <= scale.float().unsqueeze(-1) / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize(
    "low,high", [(100.0, 100.5), (-100.5, -100.0), (-1.0, 1.0), (0.25, 3.0), (-3.0, -0.25), (1e-3, 2e-3), (7.0, 7.0)]
)
def test_compact_params_keep_the_grid_of_the_math(low, high):
    """Compact parameters put the grid where the float32 math does (minimum and maximum on codes 0 and 15, within
    a tenth of a step); an offset channel (a range far from 0 next to its width) takes a scale wide enough for the
    12-bit zero to reach it, and keeps the bound."""
    fmt = QuantFormat(4, 16, 16, compact_params=True)
    x = torch.linspace(low, high, 16).view(1, 16)
    codes, word, zero = quantize(x, fmt)
    y = dequantize(codes, word, zero, fmt, torch.float32)
    scale, base = compact_scale_and_base(word, zero)
    assert word.dtype == torch.int16 and zero.dtype == torch.int8
    assert ((x - y).abs() <= scale / 2).all()
    math_scale = (high - low) / 15
    if abs(low) * 16 / 2047 <= math_scale:
        assert abs(scale.item() - math_scale) <= math_scale * (2**-8 + 2**-11)
        assert abs(y[0, 0] - low) <= scale / 10 and abs(y[0, -1] - high) <= scale / 10
    else:
        assert scale.item() <= abs(low) * 16 / 2047 * (1 + 2**-7) * (1 + 2**-8 + 2**-11)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fill", [0.0, -3.5, 1e-30, 6e4])
def test_constant_tensor_is_exact(dtype, fill):
    fmt = QuantFormat(bits=4, group_size=8, head_dim=16)
    x = torch.full((2, 3, 16), fill, dtype=dtype)
    codes, scale, zero = quantize(x, fmt)
    assert torch.equal(dequantize(codes, scale, zero, fmt, dtype), x)
    assert not scale.any() and not codes.any()


@FAST
@given(
    cases(),
    st.integers(0, 3),
    st.sampled_from(DTYPES + [None]),
    st.sampled_from(["little", "big"]),
    st.booleans(),
    st.booleans(),
)
def test_dequantize_joined_into_equals_dequantize_bitwise(case, margin, out_dtype, byteorder, strided_codes, reused):
    """In a view of a larger buffer (a slot range of a page, say), leaving the rest of the buffer alone; int4 codes
    unpacked both ways (the int16 spread of a little-endian machine, the strided nibble copies of a big-endian one),
    from contiguous codes or a strided view of them, the spread in a fresh buffer or a reused one holding garbage."""
    fmt, x = case
    out_dtype = out_dtype or x.dtype
    codes, scale, zero = quantize(x, fmt)
    if strided_codes:  # the same codes, every other byte of a wider tensor
        wide = torch.zeros((*codes.shape[:-1], 2 * codes.shape[-1]), dtype=codes.dtype)
        wide[..., ::2] = codes
        codes = wide[..., ::2]
    buffer = torch.full((*x.shape[:-1], fmt.head_dim + 2 * margin), torch.nan, dtype=out_dtype)
    out = buffer[..., margin : margin + fmt.head_dim]
    spread = torch.randint(-(2**15), 2**15, (2, *codes.shape), dtype=torch.int16) if reused else None
    with mock.patch.object(sys, "byteorder", byteorder):
        dequantize_joined_into(out, codes, join_scales(scale, zero), fmt, spread=spread)
    assert torch.equal(out, dequantize(codes, scale, zero, fmt, out_dtype))
    assert buffer[..., :margin].isnan().all() and buffer[..., margin + fmt.head_dim :].isnan().all()


@FAST
@given(cases(), st.sampled_from(DTYPES + [None]))
def test_dequantize_channels_equals_dequantize_bitwise(case, out_dtype):
    """Columns (a channel's tokens of a key page) quantized in place of the last dim (``quantize_columns``): the
    parameters ``quantize`` stores for each column, decoded as the reference decodes each column."""
    fmt, x = case
    fmt = QuantFormat(fmt.bits, fmt.head_dim, fmt.head_dim, fmt.scale_dtype, fmt.compact_params)  # a group per column
    x = x if x.dim() > 1 else x.unsqueeze(0)  # [..., columns, head_dim]: one vector per column
    out_dtype = out_dtype or x.dtype
    codes, scale, zero = quantize(x, fmt)
    reference = dequantize(codes, scale, zero, fmt, out_dtype).mT
    columns = quantize_columns(x.mT, fmt)
    assert torch.equal(columns[1], scale.mT) and torch.equal(columns[2], zero.mT)
    out = torch.full(reference.shape, torch.nan)  # float32, every element written
    assert torch.equal(dequantize_channels(*columns, fmt, out).to(out_dtype), reference)


def test_compact_parameters_decode_from_their_bytes_as_from_their_words():
    """Every compact scale word a quantization stores (scale bits up to ``COMPACT_SCALE_MAX_BITS``, any low nibble),
    with zeros over their range, read as its little-endian bytes (as a compiled decode gathers it): the scale and
    steps ``compact_scale_and_steps`` reads from the word, bitwise, subnormal scales included."""
    words = torch.arange(COMPACT_SCALE_MAX_BITS + 1, dtype=torch.int32).view(-1, 1) << 4 | torch.arange(16)
    words = words.flatten().to(torch.int16)  # bit 15 wraps into the sign, as stored
    zeros = torch.arange(-128, 128, dtype=torch.int8).repeat(len(words) // 256 + 1)[: len(words)]
    expected = compact_scale_and_steps(words, zeros)
    actual = compact_scale_and_steps_from_bytes(words.view(torch.uint8), zeros)  # [2 * n] bytes, low first
    assert all(torch.equal(a.float(), e.float()) for a, e in zip(actual, expected))


@FAST
@given(st.lists(st.integers(1, 4), max_size=3), st.integers(1, 32), st.integers(0, 2**32 - 1))
def test_int4_pack_round_trip(lead, half_dim, seed):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*lead, 2 * half_dim), generator=generator, dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (*lead, half_dim)
    assert torch.equal(unpack_int4(packed), codes)
    every_byte = torch.randint(0, 256, (*lead, half_dim), generator=generator, dtype=torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(every_byte)), every_byte)


def test_int4_layout_low_nibble_is_the_even_channel():
    assert pack_int4(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    assert unpack_int4(torch.tensor([0xA3], dtype=torch.uint8)).tolist() == [3, 10]


def test_format_sizes():
    int8, int4 = QuantFormat(bits=8, group_size=32, head_dim=128), QuantFormat(bits=4, group_size=32, head_dim=128)
    assert (int8.num_scale_groups, int8.code_dim, int8.max_code) == (4, 128, 255)
    assert (int4.num_scale_groups, int4.code_dim, int4.max_code) == (4, 64, 15)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 2, "group_size": 32, "head_dim": 128}, r"bits must be 8 or 4, got 2"),
        ({"bits": 16, "group_size": 32, "head_dim": 128}, r"bits must be 8 or 4"),
        ({"bits": 8, "group_size": 0, "head_dim": 128}, r"group_size=0 must divide head_dim=128"),
        (
            {"bits": 8, "group_size": 48, "head_dim": 128},
            r"group_size=48 must divide head_dim=128; choose one of \[1, 2, 4",
        ),
        ({"bits": 8, "group_size": 256, "head_dim": 128}, r"group_size=256 must divide"),
        ({"bits": 4, "group_size": 3, "head_dim": 9}, r"bits=4 .* even head_dim, got 9"),
        ({"bits": 8, "group_size": 1, "head_dim": 0}, r"head_dim must be >= 1"),
    ],
)
def test_format_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantFormat(**kwargs)


def test_format_rejects_a_scale_dtype_that_is_not_a_float_dtype():
    with pytest.raises(TypeError, match=r"scale_dtype must be a floating torch.dtype or None, got 'float16'"):
        QuantFormat(8, 32, 128, scale_dtype="float16")


@pytest.mark.parametrize("kwargs", [{"bits": 8.0}, {"bits": True}, {"group_size": "32"}])
def test_format_rejects_non_ints(kwargs):
    with pytest.raises(TypeError, match=rf"QuantFormat.{next(iter(kwargs))} must be an int"):
        QuantFormat(**{"bits": 8, "group_size": 32, "head_dim": 128, **kwargs})


def test_quantize_rejects_wrong_head_dim():
    with pytest.raises(ValueError, match=r"shape \[\.\.\., 128\]"):
        quantize(torch.zeros(2, 64), QuantFormat(8, 32, 128))
