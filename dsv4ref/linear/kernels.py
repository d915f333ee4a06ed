"""Triton kernels of :mod:`dsv4ref.linear`: act_quant, the FP8 GEMM and the FP4 GEMM.

Spec (:mod:`dsv4ref.linear.reference`)::

    act_quant  per [1, BLOCK] block of x:  byte = ceil(log2(max(amax, 1e-4) / 448)) + 127,  q = e4m3(x · 2^(127 − byte))
    fp8_gemm   acc[m, n] = Σ_k dot(q[m, k-block], w[n, k-block]) · (s[m, k] · s_w[n // 128, k])      128-wide k blocks
    fp4_gemm   acc[m, n] = Σ_k dot(q[m, k-block], e4m3(w[n, k-block])) · (s[m, k // 4] · s_w[n, k])  32-wide k blocks
    y = bf16(acc)    (round to nearest even; NaN as 0x7FC0)

Each K block's product starts from zero and is added to the fp32 accumulator in K order after its scaling
(DeepSeek's "two accumulators": an MMA's own accumulation is short, its sum over K is not). A program owns a
``[BM, BN]`` tile of y and walks all of K; rows past M, columns past N and the K tail are masked as zeros (an
e4m3 / E2M1 zero code adds nothing). The numerics are the shared helpers of :mod:`dsv4ref.tl`:
``e4m3_ue8m0_blocks`` (the quantiser and its non-finite policy), ``dot_e4m3`` (fp8 MMA compiled; fp32 decoded
operands in the interpreter), ``e2m1_e4m3``, ``bf16_rne_bits_nan``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import ACT_AMAX_FLOOR, ACT_BLOCK, FP4_BLOCK, WEIGHT_BLOCK
from ..tl import bf16_rne_bits_nan, dot_e4m3, e2m1_e4m3, e4m3_ue8m0_blocks, ue8m0_value

_FLOOR = tl.constexpr(ACT_AMAX_FLOOR)
_KB8 = tl.constexpr(ACT_BLOCK)  # K block of the FP8 GEMM (= the activation scale block)
_KB4 = tl.constexpr(FP4_BLOCK)  # K block of the FP4 GEMM
_A_PER_4 = tl.constexpr(ACT_BLOCK // FP4_BLOCK)  # FP4 K blocks per activation scale
_WB = tl.constexpr(WEIGHT_BLOCK)  # rows of w per FP8 weight scale


@triton.jit
def act_quant_kernel(
    x_ptr,  # fp32 [M, K], contiguous
    q_ptr,  # uint8 [M, K]: e4m3 bytes (out)
    s_ptr,  # fp32 [M, NB]: the scales 2^(byte − 127), NaN for a non-finite block (out)
    M,
    K,
    NB,  # ceil(K / BLOCK)
    BLOCK: tl.constexpr,  # values per scale (128)
    ROWS: tl.constexpr,  # rows per program
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    kb = tl.program_id(1)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = rows[:, None] * K + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)  # a partial last block reads zeros: amax unchanged
    q, byte = e4m3_ue8m0_blocks(x, _FLOOR, 1)
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(s_ptr + rows * NB + kb, ue8m0_value(byte), mask=rows < M)


@triton.jit
def _tile(pid_m, pid_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    return rm, rn, rm < M, rn < N


@triton.jit
def _weight_scale(ptr, mask, BYTES: tl.constexpr):
    """A weight scale: its UE8M0 byte decoded here (``BYTES``: 1/4 of the fp32 traffic), or an fp32 value."""
    if BYTES:
        return ue8m0_value(tl.load(ptr, mask=mask, other=127))
    else:
        return tl.load(ptr, mask=mask, other=1.0)


@triton.jit
def _store_bf16(c_ptr, acc, rm, rn, m_ok, n_ok, N):
    tl.store(
        c_ptr + rm[:, None] * N + rn[None, :],
        bf16_rne_bits_nan(acc).to(tl.int16, bitcast=True),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _store_out(c_ptr, acc, rm, rn, m_ok, n_ok, M, N, SPLIT: tl.constexpr):
    """y's tile as bf16 bits, or with ``SPLIT`` this K split's fp32 partial sum at ``c_ptr[split, m, n]``."""
    if SPLIT:
        off = tl.program_id(2).to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
        tl.store(c_ptr + off, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        _store_bf16(c_ptr, acc, rm, rn, m_ok, n_ok, N)


@triton.jit
def fp8_gemm_kernel(
    a_ptr,  # uint8 [M, K]: e4m3 activations, row stride lda, unit column stride
    sa_ptr,  # fp32 [M, NBK]: activation scales, contiguous
    b_ptr,  # uint8 [N, K]: e4m3 weight, row stride ldb, unit column stride
    sb_ptr,  # [ceil(N/128), NBK]: weight scales (fp32, or UE8M0 bytes with SB_BYTES), contiguous
    c_ptr,  # int16 [M, N]: the bits of bf16 y; with SPLIT fp32 [splits, M, N] partial sums (out), contiguous
    M,
    N,
    K,
    lda,
    ldb,
    NBK,  # ceil(K / 128)
    KB_SPLIT,  # K blocks per split: program_id(2) takes blocks [pid·KB_SPLIT, (pid + 1)·KB_SPLIT)
    BM: tl.constexpr,  # rows of y per program (>= 16: tl.dot's minimum)
    BN: tl.constexpr,  # columns of y per program
    DOT_FP32: tl.constexpr,  # = interpreting()
    SB_BYTES: tl.constexpr,  # sb_ptr holds UE8M0 bytes (uint8), not fp32 values
    SPLIT: tl.constexpr,  # more than one K split: write fp32 partials, summed by the launcher
):
    rm, rn, m_ok, n_ok = _tile(tl.program_id(1), tl.program_id(0), M, N, BM, BN)
    rk = tl.arange(0, _KB8)
    acc = tl.zeros((BM, BN), tl.float32)
    kb0 = tl.program_id(2) * KB_SPLIT
    for kb in range(kb0, tl.minimum(kb0 + KB_SPLIT, NBK)):
        k = kb * _KB8 + rk
        k_ok = k < K
        a = tl.load(a_ptr + rm[:, None] * lda + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(b_ptr + rn[:, None] * ldb + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        part = dot_e4m3(a, tl.trans(b), DOT_FP32)  # this K block alone, from zero
        sa = tl.load(sa_ptr + rm * NBK + kb, mask=m_ok, other=1.0)
        sb = _weight_scale(sb_ptr + (rn // _WB) * NBK + kb, n_ok, SB_BYTES)
        acc += part * (sa[:, None] * sb[None, :])  # the product of two powers of two: exact
    _store_out(c_ptr, acc, rm, rn, m_ok, n_ok, M, N, SPLIT)


@triton.jit
def _fp4_tile(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    rm,
    m_ok,
    rn,
    n_ok,
    K,
    lda,
    ldb,
    NBK,
    NB4,
    kb0,
    kb1,
    BM: tl.constexpr,
    BN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SB_BYTES: tl.constexpr,  # sb_ptr holds UE8M0 bytes (uint8), not fp32 values
):
    """The fp32 ``[BM, BN]`` accumulator of y's tile over the 32-wide K blocks [kb0, kb1), for the rows ``m_ok``
    (the others read zero codes)."""
    rk = tl.arange(0, _KB4)
    acc = tl.zeros((BM, BN), tl.float32)
    for kb in range(kb0, kb1):
        k = kb * _KB4 + rk
        k_ok = k < K
        a = tl.load(a_ptr + rm[:, None] * lda + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        # each byte is read for both of its elements; the nibble is picked by the parity of k
        packed = tl.load(b_ptr + rn[:, None] * ldb + (k // 2)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        code = (packed.to(tl.int32) >> ((k & 1) * 4)[None, :]) & 15
        part = dot_e4m3(a, tl.trans(e2m1_e4m3(code)), DOT_FP32)  # E2M1 -> e4m3 is exact
        sa = tl.load(sa_ptr + rm * NBK + kb // _A_PER_4, mask=m_ok, other=1.0)
        sb = _weight_scale(sb_ptr + rn * NB4 + kb, n_ok, SB_BYTES)
        acc += part * (sa[:, None] * sb[None, :])
    return acc


@triton.jit
def fp4_gemm_kernel(
    a_ptr,  # uint8 [M, K]: e4m3 activations, row stride lda, unit column stride
    sa_ptr,  # fp32 [M, NBK]: activation scales (one per 128 of K), contiguous
    b_ptr,  # uint8 [N, K / 2]: packed E2M1, element 2j in the low nibble of byte j; row stride ldb
    sb_ptr,  # [N, NB4]: weight scales (one per 32 of K; fp32 or UE8M0 bytes), contiguous
    c_ptr,  # int16 [M, N]: the bits of bf16 y; with SPLIT fp32 [splits, M, N] partial sums (out), contiguous
    M,
    N,
    K,
    lda,
    ldb,
    NBK,  # ceil(K / 128)
    NB4,  # ceil(K / 32)
    KB_SPLIT,  # 32-wide K blocks per split (program_id(2))
    BM: tl.constexpr,
    BN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SB_BYTES: tl.constexpr,  # sb_ptr holds UE8M0 bytes (uint8), not fp32 values
    SPLIT: tl.constexpr,  # more than one K split: write fp32 partials, summed by the launcher
):
    rm, rn, m_ok, n_ok = _tile(tl.program_id(1), tl.program_id(0), M, N, BM, BN)
    kb0 = tl.program_id(2) * KB_SPLIT
    kb1 = tl.minimum(kb0 + KB_SPLIT, NB4)
    acc = _fp4_tile(a_ptr, sa_ptr, b_ptr, sb_ptr, rm, m_ok, rn, n_ok, K, lda, ldb, NBK, NB4, kb0, kb1, BM, BN, DOT_FP32, SB_BYTES)
    _store_out(c_ptr, acc, rm, rn, m_ok, n_ok, M, N, SPLIT)
