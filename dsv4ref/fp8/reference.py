"""FP8 e4m3fn with UE8M0 block scales, in plain torch: the definition the Triton kernels are held to.

The format (drawn in ``docs/formats.md#fp8-e4m3fn``, ``docs/formats.md#ue8m0-scales``): a block of ``block``
values along the last dim shares one scale byte ``b`` meaning 2^(b − 127). The scale rule::

    amax = max(max|x|, floor)          floor = 1e-4 for the KV cache
    s    = fp32(amax / qmax)           IEEE division; qmax = 448 for e4m3
    b    = ceil(log2(s)) + 127         from the bits of s: exponent field + (mantissa != 0), in [1, 254]

Stored values are ``q = e4m3(clamp(x · 2^-(b−127), ±448))`` (round to nearest, ties to even); the value
read back is ``q · 2^(b−127)``, exact in fp32 and in bf16. Every function here is a line or two, so a
reader can check it by eye; the float64 oracle that checks *these* lives in ``tests/test_fp8.py``.

Non-finite values (``docs/formats.md#non-finite-values``; the public functions raise on them while value
checks are on): a block holding a NaN or ±inf is written as scale byte 255 (E8M0's NaN) and e4m3 NaN bytes
(0x7F; 0xFF where the value is not a NaN and its sign bit is set), so it reads back as NaN. Readers decode
every scale byte the format defines: 0 is 2^-127, 255 is NaN; a NaN comes out as the quiet NaN 0x7FC0
(bf16) / 0x7FC00000 (fp32) on every device.
"""

from __future__ import annotations

import torch
from einops import rearrange

from ..formats import E4M3_MAX, KV_AMAX_FLOOR, UE8M0_NAN

__all__ = [
    "e4m3_encode",
    "div_rn",
    "e4m3_nan",
    "ue8m0_byte",
    "pow2",
    "inv_pow2",
    "ue8m0_value",
    "canonical_nan",
    "quantize_ue8m0",
    "dequantize_ue8m0",
]


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 → float8_e4m3fn: clamp to ±448 first (torch versions disagree on out-of-range casts:
    2.11 gives NaN, 2.13 saturates), then torch's round-to-nearest-even cast."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def div_rn(x: torch.Tensor, d: float) -> torch.Tensor:
    """``x / d`` correctly rounded on every device. torch on CUDA computes ``tensor / python_number`` as
    ``tensor · fp32(1 / d)``: two roundings, so for a ``d`` that is not a power of two (448, 6, 7, ...) about
    one quotient in ten differs from the CPU's in its last bit. Dividing by a tensor of ``d`` makes every
    backend do the one IEEE division."""
    return x / torch.full_like(x, d)


def e4m3_nan(x: torch.Tensor) -> torch.Tensor:
    """The e4m3fn NaN byte (uint8) for each element of ``x`` in a non-finite block: 0x7F, or 0xFF where the
    element is not a NaN and its sign bit is set (±inf, negative values, −0.0). A NaN's own sign is not
    kept: devices disagree on it (a GPU product of a NaN is the positive 0x7FFFFFFF)."""
    return ((torch.signbit(x) & ~x.isnan()).to(torch.uint8) << 7) | 0x7F


def ue8m0_byte(amax: torch.Tensor, floor: float = KV_AMAX_FLOOR, qmax: float = E4M3_MAX) -> torch.Tensor:
    """UE8M0 byte (uint8) = ceil(log2(max(amax, floor) / qmax)) + 127, exactly, from the fp32 bits."""
    s = div_rn(torch.clamp(amax.float(), min=floor), qmax)  # one IEEE division on every device
    bits = s.view(torch.int32)
    byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    return byte.clamp(1, 254).to(torch.uint8)


def pow2(byte: torch.Tensor) -> torch.Tensor:
    """2^(byte − 127) as fp32, built from bits (exact; no exp2 rounding): the float whose exponent is byte."""
    return (byte.to(torch.int32) << 23).view(torch.float32)


def inv_pow2(byte: torch.Tensor) -> torch.Tensor:
    """2^(127 − byte) as fp32 for a byte in [1, 253], exactly: multiplying by it equals dividing by 2^e."""
    return ((254 - byte.to(torch.int32)) << 23).view(torch.float32)


def ue8m0_value(byte: torch.Tensor) -> torch.Tensor:
    """Any UE8M0 byte -> fp32, as the E8M0 format defines it: 2^(byte − 127) for 1..254, 2^-127 for 0 (an
    fp32 subnormal), NaN for 255. (:func:`pow2` is the writer-side shortcut, right for 1..254 only.)"""
    b = byte.to(torch.int32)
    return torch.where(b == 0, 0x00400000, torch.where(b == UE8M0_NAN, 0x7FC00000, b << 23)).view(torch.float32)


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """Every NaN of a bf16 / fp32 tensor as the quiet NaN 0x7FC0 / 0x7FC00000 (torch's own conversions
    differ per device: fp32 NaN -> bf16 gives 0xFFFF on the CPU, 0x7FFF on CUDA)."""
    bits = torch.int16 if t.dtype == torch.bfloat16 else torch.int32
    return t.view(bits).masked_fill(t.isnan(), 0x7FC0 if bits == torch.int16 else 0x7FC00000).view(t.dtype)


def quantize_ue8m0(x: torch.Tensor, block: int = 64, amax_floor: float = KV_AMAX_FLOOR) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` float8_e4m3fn of x's shape, ``scale`` uint8 ``[..., D // block]``."""
    xb = rearrange(x.float(), "... (n b) -> ... n b", b=block)
    byte = ue8m0_byte(xb.abs().amax(dim=-1), amax_floor)
    q = e4m3_encode(xb * inv_pow2(byte)[..., None]).view(torch.uint8)  # × 2^-e is exact, so it equals ÷ 2^e
    bad = ~xb.isfinite().all(dim=-1)  # non-finite blocks: NaN scale byte, NaN values
    q = torch.where(bad[..., None], e4m3_nan(xb), q).view(torch.float8_e4m3fn)
    return rearrange(q, "... n b -> ... (n b)"), byte.masked_fill(bad, UE8M0_NAN)


def dequantize_ue8m0(
    q: torch.Tensor, scale: torch.Tensor, block: int = 64, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``q · 2^(scale − 127)`` blockwise, as ``out_dtype``; exact for every byte the quantiser writes. Scale
    bytes 0 and 255 read as 2^-127 and NaN (:func:`ue8m0_value`); NaNs come out canonical."""
    qb = rearrange(q.view(torch.float8_e4m3fn).float(), "... (n b) -> ... n b", b=block)
    return canonical_nan(rearrange(qb * ue8m0_value(scale)[..., None], "... n b -> ... (n b)").to(out_dtype))
