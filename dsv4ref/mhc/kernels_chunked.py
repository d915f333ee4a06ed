"""The chunked design of pre / fused post+pre / head, the GPU default of every op, and the wide-dot pieces it
shares with the one-pass design (``kernels_one_pass.py``). Conventions, the fp32-exact GEMM and the pieces every
design shares: ``kernels.py``; the launcher: ``ops.py`` (``launch_chunked``).

Per chunk of C tokens (``ChunkedLaunch.tokens``) the launcher runs two kernels, and the kernel boundary is the
only synchronisation:

* ``hc_chunk_partial_kernel``, grid (the chunk's BLOCK_T tiles × hidden slices), slice fastest: one program's
  partial mix (GEMM + Σ X²) of its tile and slice, all 4 streams, stored to the workspace [slices, C, 24]
  (head [slices, C, 4]) + [slices, C] at the token's row within the chunk;
* ``hc_chunk_finish_kernel``, grid (hidden parts × the chunk's finish tiles): every program of a token tile sums
  that tile's partials in slice order (``sum_partials_rounds``: the same loads in the same order in every
  program, so the same bits), runs ``gates`` (part 0 also post and Sinkhorn, and stores post / comb; the other
  parts load only the 4 pre columns and skip Sinkhorn), then the weighted sum over its own hidden range,
  re-reading the chunk's streams.

The fused op runs as ``post_kernel`` per chunk, then these two kernels on the new streams it wrote: so fused ==
post then pre bit for bit by construction (``launch.py``). The GPU default is one chunk of 4096 tokens: at
T = Hd = 4096, fewer and bigger chunks measured faster at every size (``benchmarks/mhc.md``).

The partial kernel's GEMM, three ways (``ChunkedLaunch.stream_k``, ``fn_layout``; the lesson's rungs):

* per BLOCK_K chunk of the 4 streams ONE [BLOCK_T, 4·BLOCK_K] load and ONE dot of N = 4·NG = [hi | mid | lo | 0]
  × NG columns (``partial_mix_wide``, ``gemm_tile``), the parts folded in registers (``fold_parts``); a warp's
  copy of that tile gathers 16-byte pieces from 16 separate 128-byte lines;
* ``stream_k`` with ``fn_layout = 2``: per step ONE stream's BLOCK_K = 64 dims (128-byte rows,
  ``partial_mix_stream_k``), and fn from ``split_fn_wide``'s transposed copy, so the wgmma reads a K-major B
  operand and each copy is whole lines;
* ``fn_layout = 3`` (the default): layout 2's copy without its zero quarter, as one dot of N = 2·NG for
  [hi | mid] and one of N = NG for lo (``gemm_tile_three_parts``): a quarter less MMA and fold work per step.

Each step's dots start from zero and are folded into the running sum in fp32 (the MMA-truncation rule of
``kernels.py``), whichever way.

Walk order (``ChunkedLaunch.zigzag``, the GPU default): the GPU starts a launch's programs roughly in grid
order, so a kernel's LAST programs leave their bytes in L2 (~50 MB on the H200) and the next kernel should start
there. ``chunk_rows(..., REVERSE)`` counts a launch's token tiles from the chunk's end: pre / head walk the
partial kernel forward and the finish kernel backward; fused walks ``post_kernel`` forward (TOKEN_MAJOR: its
grid's fast axis is the hidden dim, so its last programs wrote the last tokens), the partial kernel backward,
the finish kernel forward. Only the order moves, so the bits are those of the forward walk.

Bytes at T = Hd = 4096 (pre): streams 134 MB read by the partial kernel from HBM and re-read by the finish
kernel (the part the previous kernel's last programs left in L2 from there), layer input 34 MB written, the fn
split 3.1 MB; the workspace (3.3 MB per 1024 tokens) stays in L2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl import dot
from .kernels import gates, layer_input_range, load_streams_bf16, stream_chunk, weighted4

# ====================================================================================================
# Wide dots: fn's three bf16 parts side by side on the N axis of one tensor-core dot
# ====================================================================================================


@triton.jit
def fn_columns(K, NG: tl.constexpr):
    """The N axis of a wide fn tile, [hi | mid | lo | 0] × NG columns (NG = 32; head 16): (col [4·NG] int64,
    the offset of column n inside one K row of fs = [G, 3, K, 16] bf16 (split_fn); live [4·NG], False on the
    zero part 3, which is masked, so never loaded). Column p·NG + c is column c (``gemm_stream32``'s
    numbering: gate group, then comb group) of bf16 part p."""
    n = tl.arange(0, 4 * NG)
    b = n // 16  # 16-column block: part p, group g (written so that Triton sees 16-wide contiguous runs,
    p = b // (NG // 16)  # which lets it pipeline this load with cp.async; (n % NG) // 16 hides them)
    g = b % (NG // 16)
    return ((g * 3 + p) * K * 16 + n % 16).to(tl.int64), p < 3


@triton.jit
def gemm_tile(a, k, kmask, fn_split_ptr, K, part, DOT_FP32: tl.constexpr, NG: tl.constexpr, FN_LAYOUT: tl.constexpr = 0):
    """part + a @ [hi | mid | lo | 0]ᵀ[k, :] in ONE dot of N = 4·NG (NG = 32; head 16): a [BLOCK_T, n_k] bf16,
    k [n_k] its fn rows (``kmask``: rows past the slice read as zero). Three times fewer MMA waits than three
    narrow dots, full-width tensor-core instructions; the parts are summed later (``fold_parts``).
    ``FN_LAYOUT`` (what ``fn_split_ptr`` holds): 0 ``split_fn``'s [G, 3, K, 16] (part 3 masked, never loaded); 2
    ``split_fn_wide``'s [4·NG, K] (k contiguous: the tile is loaded as [4·NG, n_k] and fed to the dot transposed,
    so the wgmma reads a K-major B operand instead of transposing an N-major one). (Layout 3, the same copy
    without its zero quarter, is ``gemm_tile_three_parts``.)"""
    tl.static_assert(FN_LAYOUT <= 2)  # 0 or 2 (launch.py refuses 1)
    if FN_LAYOUT == 2:
        n = tl.arange(0, 4 * NG)
        bt = tl.load(
            fn_split_ptr + n.to(tl.int64)[:, None] * K + k.to(tl.int64)[None, :],
            mask=(n < 3 * NG)[:, None] & kmask[None, :],
            other=0.0,
        )  # [4·NG, n_k]
        return dot(a, tl.trans(bt), part, DOT_FP32)
    col, live = fn_columns(K, NG)
    b_off = col[None, :] + k.to(tl.int64)[:, None] * 16  # [n_k, 4·NG]
    return dot(a, tl.load(fn_split_ptr + b_off, mask=kmask[:, None] & live[None, :], other=0.0), part, DOT_FP32)


@triton.jit
def gemm_tile_three_parts(a, k, kmask, fn_split_ptr, K, DOT_FP32: tl.constexpr, NG: tl.constexpr, BLOCK_T: tl.constexpr):
    """``FN_LAYOUT`` 3: a @ fnᵀ[k, :] as [BLOCK_T, NG] fp32, folded, from the transposed copy of layout 2 without
    its zero quarter: one zero-started dot of N = 2·NG for [hi | mid] (rows 0..2·NG) and one of N = NG for lo
    (rows 2·NG..3·NG), so 3·NG columns of MMA and fold instead of 4·NG. (hi + mid) + lo, in fp32."""
    k64 = k.to(tl.int64)[None, :]
    n2 = tl.arange(0, 2 * NG)
    n1 = 2 * NG + tl.arange(0, NG)
    b2 = tl.load(fn_split_ptr + n2.to(tl.int64)[:, None] * K + k64, mask=(n2 < 2 * NG)[:, None] & kmask[None, :], other=0.0)
    b1 = tl.load(fn_split_ptr + n1.to(tl.int64)[:, None] * K + k64, mask=(n1 < 3 * NG)[:, None] & kmask[None, :], other=0.0)
    p2 = dot(a, tl.trans(b2), tl.zeros((BLOCK_T, 2 * NG), dtype=tl.float32), DOT_FP32)  # [hi | mid] products
    p1 = dot(a, tl.trans(b1), tl.zeros((BLOCK_T, NG), dtype=tl.float32), DOT_FP32)  # lo products
    return tl.sum(tl.reshape(p2, (BLOCK_T, 2, NG)), axis=1) + p1


@triton.jit
def join4(a0, a1, a2, a3, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """[a0 | a1 | a2 | a3]: four [BLOCK_T, BLOCK_K] tiles side by side, [BLOCK_T, 4·BLOCK_K] (tl.join stacks on a
    new last axis: j[t, k, u, v] = a_{2v+u}[t, k]; the permute puts stream 2v + u at columns (2v + u)·BLOCK_K)."""
    j = tl.join(tl.join(a0, a1), tl.join(a2, a3))
    return tl.reshape(tl.permute(j, (0, 3, 2, 1)), (BLOCK_T, 4 * BLOCK_K))


@triton.jit
def fold_parts(acc, NG: tl.constexpr, BLOCK_T: tl.constexpr):
    """[BLOCK_T, 4·NG] (hi | mid | lo | 0 products) -> [BLOCK_T, NG]: their sum, the fp32 product X @ fnᵀ."""
    return tl.sum(tl.reshape(acc, (BLOCK_T, 4, NG)), axis=1)


@triton.jit
def partial_mix_wide(
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
    ONE_DOT: tl.constexpr,
    HW: tl.constexpr,
    FN_LAYOUT: tl.constexpr = 0,
):
    """``kernels.partial_mix`` with wide dots (``gemm_tile``): (acc [BLOCK_T, NG] fp32, ssq [BLOCK_T] fp32) of the
    hidden range [h_begin, h_end), all 4 streams (FUSED: the post applied, the new streams stored, rounded by
    ``bf16_bits``' hardware path where ``HW``). Per BLOCK_K chunk of the 4 streams, ONE zero-started dot of
    K = 4·BLOCK_K, folded and added to ``acc`` in fp32:

    * ``ONE_DOT = 2`` (not FUSED): ONE [BLOCK_T, 4·BLOCK_K] load of the 4 streams' chunk (column r = stream
      r // BLOCK_K, dim r % BLOCK_K) through a bf16 pointer, so the dot reads it from shared memory; Σ X²
      summed over that tile;
    * ``ONE_DOT = 1`` (FUSED always): the four [BLOCK_T, BLOCK_K] tiles side by side in registers (``join4``),
      Σ X² in ``weighted4``'s fixed order, as the fused op's pass 1 sees them: a pre run with 1 gives the
      fused op's bits."""
    kk = tl.arange(0, BLOCK_K)
    r4 = tl.arange(0, 4 * BLOCK_K)
    K = 4 * Hd
    acc = tl.zeros((BLOCK_T, NG), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for h0 in range(h_begin, h_end, BLOCK_K):
        part = tl.zeros((BLOCK_T, 4 * NG), dtype=tl.float32)
        if (ONE_DOT == 2) and not FUSED:
            h4 = h0 + r4 % BLOCK_K
            k4 = (r4 // BLOCK_K) * Hd + h4  # = the fn row of column r: token t's stream i starts at (4t + i)·Hd
            p = res_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
            a = tl.load(p + rows[:, None] * (4 * Hd) + k4[None, :], mask=rm[:, None] & (h4 < h_end)[None, :], other=0.0)
            x = a.to(tl.float32)
            ssq += tl.sum(x * x, axis=1)
            part = gemm_tile(a, k4, h4 < h_end, fn_split_ptr, K, part, DOT_FP32, NG, FN_LAYOUT)
        else:
            h = h0 + kk
            hm = h < h_end
            if FUSED:
                a0, a1, a2, a3, r0, r1, r2, r3 = stream_chunk(
                    res_ptr, x_ptr, new_ptr, W, rows, h, Hd, rm[:, None] & hm[None, :], FUSED, HW
                )
            else:  # through a bf16 pointer, so that the dot reads the tiles from shared memory
                a0, a1, a2, a3, r0, r1, r2, r3 = load_streams_bf16(
                    res_ptr, rows[:, None] * (4 * Hd) + h[None, :], Hd, rm[:, None] & hm[None, :]
                )
            ssq += tl.sum(weighted4(r0, r1, r2, r3, r0, r1, r2, r3, False), axis=1)  # Σ_i r_i², fixed FMA order
            h4 = h0 + r4 % BLOCK_K
            part = gemm_tile(
                join4(a0, a1, a2, a3, BLOCK_T, BLOCK_K),
                (r4 // BLOCK_K) * Hd + h4,
                h4 < h_end,
                fn_split_ptr,
                K,
                part,
                DOT_FP32,
                NG,
                FN_LAYOUT,
            )
        acc += fold_parts(part, NG, BLOCK_T)
    return acc, ssq


@triton.jit
def partial_mix_stream_k(
    res_ptr,
    fn_split_ptr,
    rows,
    rm,
    h_begin,
    h_end,
    Hd,
    DOT_FP32: tl.constexpr,
    NG: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FN_LAYOUT: tl.constexpr,
):
    """``partial_mix_wide`` of pre / head with one stream per step (``ChunkedLaunch.stream_k``): per step ONE
    stream's BLOCK_K dims, a [BLOCK_T, BLOCK_K] tile whose rows are contiguous in memory (BLOCK_K = 64: 128
    bytes, the NVMMA swizzle's row), the steps walking the streams fastest (4 steps per BLOCK_K dims); per step
    zero-started dots, folded and added to ``acc``; Σ X² over the step's tile. ``FN_LAYOUT``: 0 / 2 one dot
    (``gemm_tile``), 3 two (``gemm_tile_three_parts``: fs is layout 2's copy)."""
    kk = tl.arange(0, BLOCK_K)
    K = 4 * Hd
    acc = tl.zeros((BLOCK_T, NG), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    p = res_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    for c in range(0, 4 * tl.cdiv(h_end - h_begin, BLOCK_K)):
        h = h_begin + (c // 4) * BLOCK_K + kk
        hm = h < h_end
        k = (c % 4) * Hd + h  # the fn rows of stream c % 4's dims h: its values start at (4t + c % 4)·Hd
        a = tl.load(p + rows[:, None] * (4 * Hd) + k[None, :], mask=rm[:, None] & hm[None, :], other=0.0)
        x = a.to(tl.float32)
        ssq += tl.sum(x * x, axis=1)
        if FN_LAYOUT == 3:
            acc += gemm_tile_three_parts(a, k, hm, fn_split_ptr, K, DOT_FP32, NG, BLOCK_T)
        else:
            part = gemm_tile(a, k, hm, fn_split_ptr, K, tl.zeros((BLOCK_T, 4 * NG), dtype=tl.float32), DOT_FP32, NG, FN_LAYOUT)
            acc += fold_parts(part, NG, BLOCK_T)
    return acc, ssq


@triton.jit
def store_partial_packed(
    mix_ws_ptr, ssq_ws_ptr, wo, rm, acc, ssq, NG: tl.constexpr, WS_GATE: tl.constexpr, WS_STRIDE: tl.constexpr
):
    """acc [BLOCK_T, NG] (``partial_mix`` layout: gate group at columns 0..15, comb group at 16..31) into the
    workspace rows ``wo`` of stride WS_STRIDE: the first WS_GATE gate columns at 0.., the comb group at
    WS_GATE.. (WS_GATE = 16, WS_STRIDE = 32: the columns as they are; 8 / 24 (head 4 / 4): the live ones
    only). ssq into its own [slices, T] workspace."""
    n = tl.arange(0, NG)
    dst = tl.where(n < 16, n, n - 16 + WS_GATE)
    keep = (n < WS_GATE) | (n >= 16)
    tl.store(mix_ws_ptr + wo[:, None] * WS_STRIDE + dst[None, :], acc, mask=rm[:, None] & keep[None, :])
    tl.store(ssq_ws_ptr + wo, ssq, mask=rm)


@triton.jit
def sum_partials_rounds(
    mix_ws_ptr,
    ssq_ws_ptr,
    rows,
    rm,
    T,
    slices,
    HEAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    UNROLL: tl.constexpr,
    WS_GATE: tl.constexpr,
    WS_STRIDE: tl.constexpr,
    n_gate,
    n_comb,
    CACHE: tl.constexpr,
):
    """(acc_g, acc_c [BLOCK_T, 16], ssq [BLOCK_T]) for ``gates``: the ``slices`` partials of ``rows`` (workspace
    row ``slice·T + rows``) added in slice order (fixed: the same sum whichever program runs it), in rounds of
    UNROLL slices. A round is unrolled and its loads do not depend on its adds, so all UNROLL slices' loads are
    in flight together: slices / UNROLL L2 round trips instead of one per slice; the sum (and its bits) do not
    depend on UNROLL. Only the first ``n_gate`` gate and ``n_comb`` comb columns are loaded (the others stay
    zero): the chunked finish programs that store neither post nor comb load only the 4 pre columns, with the
    same loads in the same order, so the same pre. CACHE: the loads' cache modifier (".cg", through L2 only,
    where other programs of the same launch wrote the workspace)."""
    n16 = tl.arange(0, 16)
    mg = rm[:, None] & (n16 < n_gate)[None, :]
    mc = rm[:, None] & (n16 < n_comb)[None, :]
    acc_g = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s0 in range(0, slices, UNROLL):
        for u in tl.static_range(UNROLL):
            sl = tl.zeros_like(rows) + (s0 + u)  # the slice, per row (int64, as rows)
            ok = sl < slices
            wo = sl * T + rows  # its workspace rows
            at = mix_ws_ptr + wo[:, None] * WS_STRIDE + n16[None, :]
            acc_g += tl.load(at, mask=mg & ok[:, None], other=0.0, cache_modifier=CACHE)
            if not HEAD:
                acc_c += tl.load(at + WS_GATE, mask=mc & ok[:, None], other=0.0, cache_modifier=CACHE)
            ssq += tl.load(ssq_ws_ptr + wo, mask=rm & ok, other=0.0, cache_modifier=CACHE)
    return acc_g, acc_c, ssq


# ====================================================================================================
# The chunked kernels
# ====================================================================================================


@triton.jit
def chunk_rows(t0, t_end, tile, BLOCK_T: tl.constexpr, REVERSE: tl.constexpr = False):
    """Token tile ``tile`` of the chunk [t0, t_end): (rows [BLOCK_T] int64, rm = rows < t_end, lrow = rows − t0,
    the rows' index inside the chunk's workspace). ``REVERSE``: counted from the chunk's end (tile 0 is the
    last tile), so a launch walks the chunk backwards (``ChunkedLaunch.zigzag``)."""
    if REVERSE:
        tile = tl.cdiv(t_end - t0, BLOCK_T) - 1 - tile
    lrow = tile.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = t0 + lrow
    return rows, rows < t_end, lrow


@triton.jit
def hc_chunk_partial_kernel(
    res_ptr,  # residual [T, 4, Hd] as int16 (the fused op: the new streams post_kernel wrote); contiguous
    fn_split_ptr,  # split_fn(fn): [G, 3, 4·Hd, 16] bf16 (FN_LAYOUT 2 / 3: split_fn_wide(..., transposed=True))
    mix_ws_ptr,  # [slices, C, WS_STRIDE] fp32 workspace: the chunk's partial mixes
    ssq_ws_ptr,  # [slices, C] fp32 workspace: the chunk's partial Σ X²
    t0,  # the chunk's first token
    t_end,  # one past its last token (<= T)
    Hd,
    C,  # workspace rows per slice (tokens per chunk)
    slices,  # hidden slices (the grid is the chunk's token tiles × slices)
    chunks_per_slice,  # BLOCK_K chunks per slice
    HEAD: tl.constexpr,
    BLOCK_T: tl.constexpr,  # >= 16 (the M side of tl.dot)
    BLOCK_K: tl.constexpr,  # >= 16 (the K side of tl.dot)
    WS_GATE: tl.constexpr,  # gate columns kept per workspace row (pre 8, head 4)
    WS_STRIDE: tl.constexpr,  # workspace row length (pre 24, head 4)
    DOT_FP32: tl.constexpr,
    STREAM_K: tl.constexpr = False,  # one stream's BLOCK_K dims per step (partial_mix_stream_k)
    FN_LAYOUT: tl.constexpr = 0,  # 0 fn_split_ptr is split_fn(fn); 2 split_fn_wide(..., transposed=True); 3 (STREAM_K
    #                               only) the same copy in two dots, without its zero quarter (gemm_tile_three_parts)
    REVERSE: tl.constexpr = False,  # the token tiles walked from the chunk's end (chunk_rows; zigzag)
):
    tl.static_assert(BLOCK_K >= 16)
    tl.static_assert(BLOCK_T >= 16)
    NG: tl.constexpr = 16 if HEAD else 32
    pid = tl.program_id(0)
    s = pid % slices
    rows, rm, lrow = chunk_rows(t0, t_end, pid // slices, BLOCK_T, REVERSE)
    h_begin = s * chunks_per_slice * BLOCK_K
    h_end = tl.minimum(h_begin + chunks_per_slice * BLOCK_K, Hd)
    if STREAM_K:
        acc, ssq = partial_mix_stream_k(
            res_ptr, fn_split_ptr, rows, rm, h_begin, h_end, Hd, DOT_FP32, NG, BLOCK_T, BLOCK_K, FN_LAYOUT
        )
    else:
        tl.static_assert(FN_LAYOUT < 3)
        acc, ssq = partial_mix_wide(
            res_ptr,
            res_ptr,
            res_ptr,
            fn_split_ptr,
            0,
            rows,
            rm,
            h_begin,
            h_end,
            Hd,
            DOT_FP32,
            False,
            NG,
            BLOCK_T,
            BLOCK_K,
            2,
            False,
            FN_LAYOUT,
        )
    store_partial_packed(mix_ws_ptr, ssq_ws_ptr, s.to(tl.int64) * C + lrow, rm, acc, ssq, NG, WS_GATE, WS_STRIDE)


@triton.jit
def hc_chunk_finish_kernel(
    src_ptr,  # int16 view of the streams x is summed from [T, 4, Hd] bf16 (the fused op: the new streams)
    mix_ws_ptr,  # [slices, C, WS_STRIDE] fp32: the chunk's partial mixes (hc_chunk_partial_kernel)
    ssq_ws_ptr,  # [slices, C] fp32: the chunk's partial Σ X²
    scale_ptr,  # [3] fp32 ([1] head)
    base_ptr,  # [24] fp32 ([4] head)
    post_ptr,  # [T, 4] fp32 out (not HEAD)
    comb_ptr,  # [T, 4, 4] fp32 out (not HEAD)
    out_ptr,  # int16 view of the layer input (head: the output) [T, Hd] bf16
    t0,
    t_end,
    Hd,
    C,
    slices,
    h_per_part,  # hidden dims per program along grid axis 0 (a multiple of BLOCK_H)
    rms_eps,
    hc_eps,
    post_mult,
    iters,
    BLOCK_T: tl.constexpr,  # tokens per program
    HEAD: tl.constexpr,
    BLOCK_H: tl.constexpr,  # hidden dims per chunk of the weighted sum
    SUM_UNROLL: tl.constexpr,
    WS_GATE: tl.constexpr,
    WS_STRIDE: tl.constexpr,
    HW_ROUND: tl.constexpr,
    REVERSE: tl.constexpr = False,  # the token tiles walked from the chunk's end (chunk_rows; zigzag)
):
    part = tl.program_id(0)
    rows, rm, lrow = chunk_rows(t0, t_end, tl.program_id(1), BLOCK_T, REVERSE)
    full = part == 0  # part 0 alone stores post and comb, so it alone needs their columns and Sinkhorn
    # the chunk's workspace rows are its tokens' rows inside the chunk; written by the previous launch (no .cg)
    acc_g, acc_c, ssq = sum_partials_rounds(
        mix_ws_ptr,
        ssq_ws_ptr,
        lrow,
        rm,
        C,
        slices,
        HEAD,
        BLOCK_T,
        SUM_UNROLL,
        WS_GATE,
        WS_STRIDE,
        tl.where(full, WS_GATE, 4),
        tl.where(full, 16, 0),
        "",
    )
    T = t_end  # gates masks its comb stores with rows < T: rows past the chunk are masked out by rm already
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
        full,
        HEAD,
        BLOCK_T,
    )
    h_begin = part * h_per_part
    layer_input_range(
        src_ptr, out_ptr, rows, rm, h_begin, tl.minimum(h_begin + h_per_part, Hd), Hd, w0, w1, w2, w3, BLOCK_H, False, HW_ROUND
    )
