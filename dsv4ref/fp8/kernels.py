"""Triton kernels of :mod:`dsv4ref.fp8`: block quantisation to e4m3 + UE8M0, and back.

Spec (the same rule as :mod:`dsv4ref.fp8.reference`, ``docs/formats.md#ue8m0-scales``), per block of
``BLOCK`` values of one row::

    byte = clamp(E(s) + (Mant(s) != 0), 1, 254)     s = fp32(max(max|x|, FLOOR) / 448)
    q    = e4m3(clamp(x · 2^(127 − byte), ±448))    round to nearest, ties to even
    x̂    = q · 2^(byte − 127)                        exact in fp32 and in bf16

A block holding a NaN or ±inf is written as byte 255 and e4m3 NaN bytes (0x7F; 0xFF for a non-NaN negative);
the reader decodes every byte (0: 2^-127, 255: NaN) and writes NaN as the quiet NaN 0x7FC0 / 0x7FC00000
(``docs/formats.md#non-finite-values``).

Both kernels treat the input as ``n_blocks`` rows of ``BLOCK`` contiguous values and handle ``ROWS`` of
them per program. The numerics live in the shared helpers of :mod:`dsv4ref.tl` (``e4m3_ue8m0_blocks``:
``ue8m0_byte`` + ``e4m3_encode`` + the policy; ``ue8m0_value``, ``bf16_rne_bits_nan``), written once for
every kernel and correct in Triton's CPU interpreter too (``docs/triton_interpreter.md``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import UE8M0_BIAS
from ..tl import bf16_rne_bits_nan, canonical_nan, e4m3_decode, e4m3_ue8m0_blocks, ue8m0_value

_ONE = tl.constexpr(UE8M0_BIAS)  # the scale byte of 2^0; masked-off rows read it


@triton.jit
def quantize_kernel(
    x_ptr,  # fp32 [n_blocks · BLOCK]: a contiguous view of x
    q_ptr,  # uint8 [n_blocks · BLOCK]: the e4m3 bytes (out)
    s_ptr,  # uint8 [n_blocks]: the UE8M0 bytes (out)
    n_blocks,  # int: number of BLOCK-value blocks
    FLOOR: tl.constexpr,  # amax floor (1e-4 for the KV cache)
    BLOCK: tl.constexpr,  # values per scale, a power of two (64 for the KV cache)
    ROWS: tl.constexpr,  # blocks handled by one program, a power of two
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = rows[:, None] < n_blocks
    offs = rows[:, None] * BLOCK + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    q, byte = e4m3_ue8m0_blocks(x, FLOOR, 1)  # [ROWS, BLOCK] uint8, [ROWS] int32; NaN/inf block: 0x7F.., 255
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(s_ptr + rows, byte.to(tl.uint8), mask=rows < n_blocks)


@triton.jit
def dequantize_kernel(
    q_ptr,  # uint8 [n_blocks · BLOCK]: e4m3 bytes
    s_ptr,  # uint8 [n_blocks]: UE8M0 bytes (any byte: 0 reads 2^-127, 255 reads NaN)
    out_ptr,  # [n_blocks · BLOCK]: int16 bits of bf16 when OUT_BF16, else fp32 (out)
    n_blocks,  # int
    BLOCK: tl.constexpr,  # values per scale
    ROWS: tl.constexpr,  # blocks per program
    OUT_BF16: tl.constexpr,  # store bf16 (as bits) instead of fp32
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = rows[:, None] < n_blocks
    offs = rows[:, None] * BLOCK + cols[None, :]
    q = e4m3_decode(tl.load(q_ptr + offs, mask=mask, other=0))
    byte = tl.load(s_ptr + rows, mask=rows < n_blocks, other=_ONE)
    y = q * ue8m0_value(byte)[:, None]  # exact: an exponent add (NaN for byte 255 or a NaN code)
    if OUT_BF16:
        tl.store(out_ptr + offs, bf16_rne_bits_nan(y).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(out_ptr + offs, canonical_nan(y), mask=mask)
