"""Triton kernels of :mod:`dsv4ref.fp8`: block quantisation to e4m3 + UE8M0, and back.

Spec (the same rule as :mod:`dsv4ref.fp8.reference`, ``docs/formats.md#ue8m0-scales``), per block of
``BLOCK`` values of one row::

    byte = clamp(E(s) + (Mant(s) != 0), 1, 254)     s = fp32(max(max|x|, FLOOR) / 448)
    q    = e4m3(clamp(x · 2^(127 − byte), ±448))    round to nearest, ties to even
    x̂    = q · 2^(byte − 127)                        exact in fp32 and in bf16

Both kernels treat the input as ``n_blocks`` rows of ``BLOCK`` contiguous values and handle ``ROWS`` of
them per program. The numerics live in the shared helpers of :mod:`dsv4ref.tl` (``ue8m0_byte``,
``e4m3_encode``, ``pow2``, ``inv_pow2``, ``bf16_rne_bits``), written once for every kernel and correct in
Triton's CPU interpreter too (``docs/triton_interpreter.md``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import E4M3_MAX, UE8M0_BIAS
from ..tl import bf16_rne_bits, e4m3_encode, inv_pow2, pow2, ue8m0_byte

_QMAX = tl.constexpr(E4M3_MAX)  # 448
_ONE = tl.constexpr(UE8M0_BIAS)  # the scale byte of 2^0; masked-off rows read it


@triton.jit
def e4m3_bits(x):
    """fp32 tensor → the e4m3fn byte (uint8), for storing through a uint8 pointer.

    (History: this once set the sign bit itself, because compiled Triton computes ``-r`` as ``0 - r``,
    which loses −0: found by tests/test_fp8.py on the H200. ``dsv4ref.tl.e4m3_encode`` now restores the
    sign bit, so every kernel has the fix.)
    """
    return e4m3_encode(x).to(tl.uint8, bitcast=True)


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
    byte = ue8m0_byte(tl.max(tl.abs(x), axis=1), FLOOR, _QMAX)  # [ROWS]
    q = e4m3_bits(x * inv_pow2(byte)[:, None])  # × 2^-e is exact, so it equals ÷ 2^e
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(s_ptr + rows, byte.to(tl.uint8), mask=rows < n_blocks)


@triton.jit
def dequantize_kernel(
    q_ptr,  # uint8 [n_blocks · BLOCK]: e4m3 bytes
    s_ptr,  # uint8 [n_blocks]: UE8M0 bytes
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
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    byte = tl.load(s_ptr + rows, mask=rows < n_blocks, other=_ONE).to(tl.int32)
    y = q * pow2(byte)[:, None]  # exact: an exponent add
    if OUT_BF16:
        tl.store(out_ptr + offs, bf16_rne_bits(y).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(out_ptr + offs, y, mask=mask)
