"""The split-K design of pre / fused post+pre / head (``hc_partial_kernel``, then ``hc_finish_kernel``), rung 2
of notebook 03's ladder and the interpreter's default for pre and head. Conventions, the fp32-exact GEMM and
the pieces every design shares: ``kernels.py``; the launcher: ``ops.py`` (``launch_hc``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl import dot
from .kernels import gates, layer_input_range, stream_chunk, token_tile, weighted4

# ====================================================================================================
# Design 2: split-K (hc_partial_kernel, then hc_finish_kernel)
#
# Why: hc_kernel gives each program 16 tokens and the WHOLE K = 4·Hd reduction, so every program streams
# all of fn through L2 for only 16 tokens (256 programs × 3.1 MB ≈ 0.8 GB of L2 traffic against 0.13 GB of
# streams at T = Hd = 4096). Raising BLOCK_T alone starves the 132 SMs of programs (BLOCK_T = 64: 64
# programs). Splitting K gives both big token tiles (fn traffic / 4) and enough programs; small T (decode)
# gets Hd/BLOCK_K programs instead of one.
#
# * hc_partial_kernel, grid (splits, token tiles): program (s, t) owns BLOCK_T tokens and the hidden range
#   of split s (whole BLOCK_K chunks) of all 4 streams; it writes its partial mix [BLOCK_T, 32] and partial
#   Σ X² [BLOCK_T] to fp32 workspaces [splits, T, 32] and [splits, T]. The gate and comb columns of fn are
#   ONE [BLOCK_K, 32] tile per bf16 part (3 dots of N = 32 instead of 6 of N = 16).
# * hc_finish_kernel, grid (hidden parts, token tiles): sums the partials in split order (fixed, so
#   deterministic), runs ``gates`` (every hidden part of a tile needs pre; part 0 stores post and comb),
#   then the weighted stream sum over its hidden range. The split index varies fastest in the first grid,
#   so it finishes the LAST token tiles last; the second grid walks the token tiles in REVERSE, so it starts
#   on the streams the first one read (or, fused, wrote) most recently, the likeliest still in the L2.
# ====================================================================================================


@triton.jit
def gemm_stream32(a, k, kmask, fn_split_ptr, K, acc, DOT_FP32: tl.constexpr, NG: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += a @ fnᵀ[k, :NG] for one stream chunk, NG = 32 (gate group | comb group) or 16 (head: one group).
    fs = [G, 3, K, 16] bf16 (split_fn); column n of the tile is column n % 16 of group n // 16. Per-chunk
    zero-start accumulator, as in ``gemm_stream``."""
    n = tl.arange(0, NG)
    b_off = ((n // 16) * 3 * K * 16 + n % 16).to(tl.int64)[None, :] + k.to(tl.int64)[:, None] * 16  # [BLOCK_K, NG]
    bm = kmask[:, None] & (n < NG)[None, :]
    part = tl.zeros_like(acc)
    for s in tl.static_range(3):
        part = dot(a, tl.load(fn_split_ptr + s * K * 16 + b_off, mask=bm, other=0.0), part, DOT_FP32)
    return acc + part


@triton.jit
def partial_mix(
    res_ptr,
    x_ptr,
    new_ptr,
    fn_split_ptr,
    W,
    rows,
    rm,
    h_begin,
    h_end,
    Hd,
    DOT_FP32: tl.constexpr,
    FUSED: tl.constexpr,
    NG: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The mix GEMM and Σ X² of a token tile over the hidden range [h_begin, h_end) (whole BLOCK_K chunks, the
    last one cut at Hd), all 4 streams: (acc [BLOCK_T, NG] fp32 = [pre | post | 0 | comb (i, j) at 16 + 4i + j]
    (head: [gate | 0]), ssq [BLOCK_T] fp32). FUSED: the post is applied and the new streams stored on the way
    (``stream_chunk``). 3 narrow dots per stream (``gemm_stream32``), each stream's chain zero-started. (The
    version with wide dots: ``kernels_chunked.partial_mix_wide``.)"""
    kk = tl.arange(0, BLOCK_K)
    K = 4 * Hd
    acc = tl.zeros((BLOCK_T, NG), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for h0 in range(h_begin, h_end, BLOCK_K):
        h = h0 + kk
        hm = h < h_end
        a0, a1, a2, a3, r0, r1, r2, r3 = stream_chunk(res_ptr, x_ptr, new_ptr, W, rows, h, Hd, rm[:, None] & hm[None, :], FUSED)
        ssq += tl.sum(weighted4(r0, r1, r2, r3, r0, r1, r2, r3, False), axis=1)  # Σ_i r_i², fixed FMA order
        acc = gemm_stream32(a0, h, hm, fn_split_ptr, K, acc, DOT_FP32, NG, BLOCK_K)
        acc = gemm_stream32(a1, Hd + h, hm, fn_split_ptr, K, acc, DOT_FP32, NG, BLOCK_K)
        acc = gemm_stream32(a2, 2 * Hd + h, hm, fn_split_ptr, K, acc, DOT_FP32, NG, BLOCK_K)
        acc = gemm_stream32(a3, 3 * Hd + h, hm, fn_split_ptr, K, acc, DOT_FP32, NG, BLOCK_K)
    return acc, ssq


@triton.jit
def store_partial(mix_ws_ptr, ssq_ws_ptr, wo, rm, acc, ssq, NG: tl.constexpr):
    """A tile's partial mix and Σ X² into the workspaces [splits, T, 32] / [splits, T] at rows ``wo``."""
    n = tl.arange(0, NG)
    tl.store(mix_ws_ptr + wo[:, None] * 32 + n[None, :], acc, mask=rm[:, None] & (n < NG)[None, :])
    tl.store(ssq_ws_ptr + wo, ssq, mask=rm)


@triton.jit
def sum_partials(mix_ws_ptr, ssq_ws_ptr, rows, rm, T, splits, HEAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """(acc_g, acc_c [BLOCK_T, 16], ssq [BLOCK_T]): the partials of ``rows`` summed in split order (fixed, so
    the same sum on every run, whichever program does it), in the layout ``gates`` takes."""
    n16 = tl.arange(0, 16)
    m16 = rm[:, None] & (n16 < 16)[None, :]
    acc_g = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s in range(0, splits):
        wo = s * T + rows
        acc_g += tl.load(mix_ws_ptr + wo[:, None] * 32 + n16[None, :], mask=m16, other=0.0)
        if not HEAD:
            acc_c += tl.load(mix_ws_ptr + wo[:, None] * 32 + 16 + n16[None, :], mask=m16, other=0.0)
        ssq += tl.load(ssq_ws_ptr + wo, mask=rm, other=0.0)
    return acc_g, acc_c, ssq


@triton.jit
def hc_partial_kernel(
    res_ptr,  # int16 view of residual [T, 4, Hd] bf16 (FUSED: the streams before the post)
    x_ptr,  # FUSED: int16 view of x [T, Hd] bf16
    post_in_ptr,  # FUSED: [T, 4] fp32
    comb_in_ptr,  # FUSED: [T, 4, 4] fp32
    new_ptr,  # FUSED: int16 view of the new residual [T, 4, Hd] bf16 (written)
    fn_split_ptr,  # [G, 3, 4·Hd, 16] bf16: split_fn(fn)
    mix_ws_ptr,  # [splits, T, 32] fp32 workspace: partial mix columns (head: the first 16)
    ssq_ws_ptr,  # [splits, T] fp32 workspace: partial Σ X²
    T,
    Hd,
    chunks_per_split,  # BLOCK_K chunks per split
    HEAD: tl.constexpr,
    FUSED: tl.constexpr,
    BLOCK_T: tl.constexpr,  # >= 16 (the M side of tl.dot)
    BLOCK_K: tl.constexpr,  # >= 16 (the K side of tl.dot)
    DOT_FP32: tl.constexpr,
):
    tl.static_assert(BLOCK_K >= 16)
    tl.static_assert(BLOCK_T >= 16)
    NG: tl.constexpr = 16 if HEAD else 32
    split = tl.program_id(0)
    rows, rm, W = token_tile(tl.program_id(1), T, post_in_ptr, comb_in_ptr, FUSED, BLOCK_T)
    h_begin = split * chunks_per_split * BLOCK_K
    h_end = tl.minimum(h_begin + chunks_per_split * BLOCK_K, Hd)
    acc, ssq = partial_mix(
        res_ptr, x_ptr, new_ptr, fn_split_ptr, W, rows, rm, h_begin, h_end, Hd, DOT_FP32, FUSED, NG, BLOCK_T, BLOCK_K
    )
    store_partial(mix_ws_ptr, ssq_ws_ptr, split.to(tl.int64) * T + rows, rm, acc, ssq, NG)


@triton.jit
def hc_finish_kernel(
    src_ptr,  # int16 view of the streams x is summed from [T, 4, Hd] bf16 (FUSED: the new streams)
    mix_ws_ptr,  # [splits, T, 32] fp32 partial mixes from hc_partial_kernel
    ssq_ws_ptr,  # [splits, T] fp32 partial Σ X²
    scale_ptr,  # [3] fp32 ([1] head)
    base_ptr,  # [24] fp32 ([4] head)
    post_ptr,  # [T, 4] fp32 out (not HEAD)
    comb_ptr,  # [T, 4, 4] fp32 out (not HEAD)
    out_ptr,  # int16 view of the layer input (head: the output) [T, Hd] bf16
    T,
    Hd,
    splits,
    h_per_part,  # hidden values per program along grid axis 0 (a multiple of BLOCK_H)
    rms_eps,
    hc_eps,
    post_mult,
    iters,
    HEAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    part = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # reverse token order (see the section comment)
    rows = tile.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rm = rows < T
    acc_g, acc_c, ssq = sum_partials(mix_ws_ptr, ssq_ws_ptr, rows, rm, T, splits, HEAD, BLOCK_T)
    # every hidden part needs pre; part 0 alone stores post and comb
    w0, w1, w2, w3 = gates(
        acc_g,
        acc_c,
        ssq,
        4 * Hd,
        rows,
        rm,
        scale_ptr,
        base_ptr,
        post_ptr,
        comb_ptr,
        T,
        rms_eps,
        hc_eps,
        post_mult,
        iters,
        part == 0,
        HEAD,
        BLOCK_T,
    )
    # x = Σ_i pre_i · stream_i over this part's hidden range, last chunk first
    h_begin = part * h_per_part
    layer_input_range(src_ptr, out_ptr, rows, rm, h_begin, tl.minimum(h_begin + h_per_part, Hd), Hd, w0, w1, w2, w3, BLOCK_H)
