"""The compressor's Triton kernels (@triton.jit only); launched from :mod:`dsv4ref.compressor.launch`.

One step of the compressor is three launches, in this order (stream order is the only synchronisation):

* :func:`project_kernel`: every token's ``kv = x·W_kvᵀ`` and ``score = x·W_gateᵀ + ape[p % r]``, one
  tiled GEMM pair with fp32 accumulation, into a [T, coff·D] fp32 workspace each;
* :func:`compress_kernel`: one program per token; a boundary token ((p + 1) % r == 0) gathers its window
  of n = coff·r positions from the workspace (positions this step holds) or the ring (older ones), runs
  the per-channel online softmax over it and the RMSNorm, and writes its compressed row;
* :func:`save_kernel`: one program per token; the last n tokens of each request go into the ring. It must
  run AFTER :func:`compress_kernel`: a step of more than n tokens overwrites ring rows that a boundary
  token of the same step still reads.

The step's rows of one request are one run of consecutive rows holding consecutive positions (the public
function checks it), so "is position q in this step?" is one comparison: the row ``t − (p − q)`` holds
(request, q). Interpreter-safe rules (:mod:`dsv4ref.tl`): bf16 is read through an int16 view and widened
in integers, every sum is fp32, dots go through ``dot``. The math: ``docs/compressor.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl import bf16_round_nan, dot, nonfinite

# ----------------------------------------------------------------------------------------------------
# Projection.  kv[t, c] = Σ_h x[t, h]·W_kv[c, h];   score[t, c] = Σ_h x[t, h]·W_gate[c, h] + ape[p_t % r, c]
# bf16 operands (exact in fp32), fp32 accumulation: the reference's fp32 GEMM up to summation order.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def project_kernel(
    x_ptr,  # int16 view of bf16 x [T, Hd] (stride_xt, stride_xh)
    wkv_ptr,  # bf16 W_kv [C, Hd] (stride_kc, stride_kh), C = coff·D
    wg_ptr,  # bf16 W_gate [C, Hd] (stride_gc, stride_gh)
    ape_ptr,  # fp32 ape [r, C] (stride_ar, stride_ac)
    pos_ptr,  # int32 positions [T], contiguous
    kv_ptr,  # fp32 workspace kv [T, C], contiguous
    sc_ptr,  # fp32 workspace score [T, C], contiguous
    T,
    Hd,
    C,
    stride_xt,
    stride_xh,
    stride_kc,
    stride_kh,
    stride_gc,
    stride_gh,
    stride_ar,
    stride_ac,
    RATIO: tl.constexpr,  # r
    BLOCK_T: tl.constexpr,  # tokens per program (≥ 16: tl.dot's minimum)
    BLOCK_C: tl.constexpr,  # output channels per program
    BLOCK_K: tl.constexpr,  # hidden values per step (≥ 16)
    DOT_FP32: tl.constexpr,  # = interpreting(): fp32 dot operands (the interpreter's bf16 dot is wrong)
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask, cmask = rows < T, cols < C
    r64, c64 = rows.to(tl.int64), cols.to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    acc_kv = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    acc_sc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k0 in range(0, Hd, BLOCK_K):
        kmask = (k0 + kk) < Hd
        bits = tl.load(
            x_ptr + r64[:, None] * stride_xt + (k0 + kk)[None, :] * stride_xh, mask=rmask[:, None] & kmask[None, :], other=0
        )
        xb = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True).to(tl.bfloat16)  # bf16 bits → value, exact
        wmask = kmask[:, None] & cmask[None, :]
        wkv = tl.load(wkv_ptr + c64[None, :] * stride_kc + (k0 + kk)[:, None] * stride_kh, mask=wmask, other=0.0)
        wg = tl.load(wg_ptr + c64[None, :] * stride_gc + (k0 + kk)[:, None] * stride_gh, mask=wmask, other=0.0)
        acc_kv = dot(xb, wkv, acc_kv, DOT_FP32)
        acc_sc = dot(xb, wg, acc_sc, DOT_FP32)
    p = tl.load(pos_ptr + rows, mask=rmask, other=0)
    om = rmask[:, None] & cmask[None, :]
    # a negative position (a padding row, or bad input with value checks off) reads no ape row: p % r < 0 there
    ape = tl.load(ape_ptr + (p % RATIO)[:, None] * stride_ar + cols[None, :] * stride_ac, mask=om & (p >= 0)[:, None], other=0.0)
    out = r64[:, None] * C + cols[None, :]
    tl.store(kv_ptr + out, acc_kv, mask=om)
    tl.store(sc_ptr + out, acc_sc + ape, mask=om)


# ----------------------------------------------------------------------------------------------------
# Compression of one boundary token t (request q_req, position p, (p + 1) % r == 0):
#   window positions s_j = p − n + 1 + j, j = 0..n−1 (n = coff·r); channel offset o_j = D if coff = 2 and j ≥ r
#   (kv_j, score_j) = workspace[t − (p − s_j), o_j : o_j + D]   if that row holds (q_req, s_j)
#                   = ring[q_req, s_j % n, o_j : o_j + D]       elif s_j ≥ 0
#                   = (0, −inf)                                 else (before the sequence start)
#   c[d] = Σ_j e^(score_j[d] − m[d]) kv_j[d] / Σ_j e^(score_j[d] − m[d])   online over BLOCK_J positions at a time
#   c    = fp32(bf16(c))                                                  DeepSeek's order: bf16, then the norm
#   out  = c · 1/sqrt(mean(c²) + eps) · norm                               (zeros for a non-boundary token)
# ----------------------------------------------------------------------------------------------------


@triton.jit
def compress_kernel(
    kv_ptr,  # fp32 workspace kv [T, C], contiguous (written by project_kernel)
    sc_ptr,  # fp32 workspace score [T, C], contiguous
    ring_kv_ptr,  # fp32 state kv [R, n, C], contiguous: position s of request q at row q·n + s % n
    ring_sc_ptr,  # fp32 state score [R, n, C], contiguous
    req_ptr,  # int32 requests [T], contiguous; −1 = padding row (so is any request outside [0, R))
    pos_ptr,  # int32 positions [T], contiguous (a negative one: a padding row)
    norm_ptr,  # fp32 norm [D], contiguous
    out_ptr,  # fp32 rows [T, D], contiguous
    done_ptr,  # uint8 view of the bool done [T]
    T,
    R,
    eps,  # R: the state's requests
    RATIO: tl.constexpr,  # r: 4 or 128
    COFF: tl.constexpr,  # 2 for r = 4 (overlap), 1 for r = 128
    D: tl.constexpr,  # compressed width (512 or 128; a power of two)
    BLOCK_J: tl.constexpr,  # window positions per step (a power of two dividing n)
):
    N: tl.constexpr = COFF * RATIO
    C: tl.constexpr = COFF * D
    t = tl.program_id(0)
    q_req = tl.load(req_ptr + t)
    p = tl.load(pos_ptr + t)
    d = tl.arange(0, D)
    # one compare each keeps every ring address inside the state, whatever the indices (value checks off)
    boundary = (q_req >= 0) & (q_req < R) & (p >= 0) & ((p + 1) % RATIO == 0)
    tl.store(done_ptr + t, boundary.to(tl.uint8))
    out = out_ptr + t.to(tl.int64) * D + d
    if boundary:
        m = tl.full((D,), float("-inf"), dtype=tl.float32)
        den = tl.zeros((D,), dtype=tl.float32)
        acc = tl.zeros((D,), dtype=tl.float32)
        # any NaN / ±inf kv or score in the window: the row is NaN (the written policy), decided on the bits,
        # not left to the online softmax (an inf channel alone would leave the others 0 after the norm)
        bad = tl.zeros((D,), dtype=tl.int32)
        jj = tl.arange(0, BLOCK_J)
        full = d[None, :] < D  # [1, D] all true: widens row conditions to the tile's shape
        for j0 in range(0, N, BLOCK_J):
            j = j0 + jj
            s = p - N + 1 + j  # [BLOCK_J] the window's positions, oldest first
            row = t - N + 1 + j  # the step row that would hold s
            row_ok = (row >= 0) & (row < T)
            in_step = (
                row_ok
                & (tl.load(req_ptr + row, mask=row_ok, other=-2) == q_req)
                & (tl.load(pos_ptr + row, mask=row_ok, other=-1) == s)
            )
            in_ring = (s >= 0) & (in_step == 0)
            ch = (j >= RATIO).to(tl.int32) * (COFF - 1) * D  # overlap: the newer r tokens read channels [D:2D]
            col = ch[:, None] + d[None, :]  # [BLOCK_J, D]
            step_off = row.to(tl.int64)[:, None] * C + col
            ring_off = (q_req.to(tl.int64) * N + tl.where(s >= 0, s, 0) % N)[:, None] * C + col
            ms, mr = in_step[:, None] & full, in_ring[:, None] & full
            kv = tl.load(kv_ptr + step_off, mask=ms, other=0.0) + tl.load(ring_kv_ptr + ring_off, mask=mr, other=0.0)
            sc = tl.load(sc_ptr + step_off, mask=ms, other=0.0) + tl.load(ring_sc_ptr + ring_off, mask=mr, other=0.0)
            bad = bad | tl.max((nonfinite(kv) | nonfinite(sc)).to(tl.int32), axis=0)
            sc = tl.where((s >= 0)[:, None] & full, sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a chunk of only masked positions: no −inf − −inf
            alpha = tl.exp(m - m_safe)
            e = tl.exp(sc - m_safe[None, :])
            den = den * alpha + tl.sum(e, axis=0)
            acc = acc * alpha + tl.sum(e * kv, axis=0)
            m = m_new
        c = bf16_round_nan(acc / den)  # the pooled row in bf16 before the norm, as DeepSeek's Compressor does
        c = tl.where(tl.max(bad, axis=0) > 0, float("nan"), c)
        inv = 1.0 / tl.sqrt_rn(tl.sum(c * c, axis=0) / D + eps)
        tl.store(out, c * inv * tl.load(norm_ptr + d))
    else:
        tl.store(out, tl.zeros((D,), dtype=tl.float32))


# ----------------------------------------------------------------------------------------------------
# Ring update: token t (request q_req, position p) is stored at ring row p % n unless the same step also
# holds position p + n of its request (that later token takes the row): only each request's last n tokens
# are written, so no two programs write one row.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def save_kernel(
    kv_ptr,  # fp32 workspace kv [T, C], contiguous
    sc_ptr,  # fp32 workspace score [T, C], contiguous
    ring_kv_ptr,  # fp32 state kv [R, n, C], contiguous
    ring_sc_ptr,  # fp32 state score [R, n, C], contiguous
    req_ptr,  # int32 requests [T], contiguous; −1 = padding row (so is any request outside [0, R))
    pos_ptr,  # int32 positions [T], contiguous (a negative one: a padding row)
    T,
    R,
    N: tl.constexpr,  # n = coff·r ring rows per request
    C: tl.constexpr,  # coff·D channels
    BLOCK_C: tl.constexpr,  # next_power_of_2(C)
):
    t = tl.program_id(0)
    q_req = tl.load(req_ptr + t)
    p = tl.load(pos_ptr + t)
    nxt = t + N
    later = (
        (nxt < T)
        & (tl.load(req_ptr + nxt, mask=nxt < T, other=-2) == q_req)
        & (tl.load(pos_ptr + nxt, mask=nxt < T, other=-1) == p + N)
    )
    if (q_req >= 0) & (q_req < R) & (p >= 0) & (later == 0):
        c = tl.arange(0, BLOCK_C)
        cm = c < C
        src = t.to(tl.int64) * C + c
        dst = (q_req.to(tl.int64) * N + p % N) * C + c
        tl.store(ring_kv_ptr + dst, tl.load(kv_ptr + src, mask=cm), mask=cm)
        tl.store(ring_sc_ptr + dst, tl.load(sc_ptr + src, mask=cm), mask=cm)
