"""The MoE Triton kernels: input staging, the two grouped expert GEMMs, and the combine.

Every kernel follows the interpreter-safe rules of :mod:`dsv4ref.tl`: bf16 is read through an int16 view
and widened to fp32 in integers, all arithmetic is fp32, bf16 is written with integer round-half-even
(``bf16_rne_bits_nan``: every NaN is 0x7FC0), e4m3 and UE8M0 bytes come from ``ue8m0_byte_bits`` + ``e4m3_snap`` (the
non-finite policy: ``e4m3_nan_codes``), staged bytes are read with ``e4m3_decode`` / ``ue8m0_value`` and dots go through
``dot`` (fp32 operands when interpreting). Strides are element strides. The math is drawn in ``docs/moe.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl import bf16_rne_bits_nan, dot, e4m3_decode, e4m3_nan_codes, e4m3_snap, ue8m0_byte_bits, ue8m0_value


@triton.jit
def widen_bf16(bits):
    """The 16 bits of a bf16 (loaded through an int16 view) → that value as fp32, exactly (−0 kept)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


# ----------------------------------------------------------------------------------------------------
# Staging. Spec, per token t and 128-block kb (docs/moe.md#staging):
#   for each of the 4 groups j of 32 values g:   byte_j = clamp(E(s) + (Mant(s) != 0), 1, 254),
#                                                s = fp32(max(max|g|, 1e-4) / 448)
#                                                q = e4m3(clamp(g · 2^(127 − byte_j), ±448))   (RNE)
#                 a group holding a NaN or ±inf: byte_j = 255, every q = 0x7F (0xFF: a non-NaN with its sign set)
#   x_sf[t, kb] = int32 bits of byte_0 | byte_1 << 8 | byte_2 << 16 | byte_3 << 24
#   on the first column block: ids_out[t, :K] = int64(ids[t, :K]) (−1 stays −1), weights_out = bit copy
# The default's encoder (_stage_tile_snap): ue8m0_byte_bits + e4m3_snap on the contiguous [BLOCK_T, BLOCK_H]
# tile (16-byte vectors when the hidden stride is 1), seen as [BLOCK_T, BLOCK_H/32, 32] for the group amax: the
# same bytes as the shared e4m3_ue8m0_blocks in about half the instructions per value; the non-finite policy
# (e4m3_nan_codes, byte 255) only in a tile that holds a NaN / ±inf group (one tile-wide test per program); the
# scale bytes stored as bytes through a uint8 view of x_sf (little-endian: byte j of word kb is group 4·kb + j),
# which spares the cross-thread gather of a word's four bytes. TOPK_FIRST (MoeLaunch.stage_topk_first, the GPU
# default): the ids / weights of the top-k copy are loaded before the tile, not after its stores (one DRAM round
# trip less in the programs of column block 0). The other modes staging was measured in (the shared encoder,
# group loads, a persistent grid, prefetching, other cache hints): dsv4ref/moe/variants/stage.py.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _stage_topk(
    ids_ptr,
    w_ptr,
    ids_out_ptr,
    w_out_ptr,
    rows,
    row_ok,
    r64,
    K,
    stride_it,
    stride_ik,
    stride_wt,
    stride_wk,
    stride_iot,
    stride_wot,
    BLOCK_TOPK: tl.constexpr,
):
    """The top-k copies of one token block: int64 ids (sign-extended), weight bits unchanged."""
    ids, wb = _topk_load(ids_ptr, w_ptr, r64, row_ok, K, stride_it, stride_ik, stride_wt, stride_wk, BLOCK_TOPK)
    _topk_store(ids_out_ptr, w_out_ptr, ids, wb, r64, row_ok, K, stride_iot, stride_wot, BLOCK_TOPK)


@triton.jit
def _topk_load(ids_ptr, w_ptr, r64, row_ok, K, stride_it, stride_ik, stride_wt, stride_wk, BLOCK_TOPK: tl.constexpr):
    """(ids, weight bits) [BLOCK_T, BLOCK_TOPK] of the rows where ``row_ok``."""
    k = tl.arange(0, BLOCK_TOPK)
    mk = row_ok[:, None] & (k < K)[None, :]
    ids = tl.load(ids_ptr + r64[:, None] * stride_it + k[None, :] * stride_ik, mask=mk)
    wb = tl.load(w_ptr + r64[:, None] * stride_wt + k[None, :] * stride_wk, mask=mk)
    return ids, wb


@triton.jit
def _topk_store(ids_out_ptr, w_out_ptr, ids, wb, r64, row_ok, K, stride_iot, stride_wot, BLOCK_TOPK: tl.constexpr):
    k = tl.arange(0, BLOCK_TOPK)
    mk = row_ok[:, None] & (k < K)[None, :]
    tl.store(ids_out_ptr + r64[:, None] * stride_iot + k[None, :], ids.to(tl.int64), mask=mk)  # sign-extends
    tl.store(w_out_ptr + r64[:, None] * stride_wot + k[None, :], wb, mask=mk)


@triton.jit
def _stage_tile_snap(
    x_ptr,
    q_ptr,
    sf_ptr,
    T,
    Hd,
    tt,
    th,
    stride_xt,
    stride_xh,
    stride_qt,
    stride_st,
    FLOOR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVICT: tl.constexpr,
    STORE_CACHE: tl.constexpr,
):
    """Stage tokens [tt·BLOCK_T, +BLOCK_T) × hidden values [th·BLOCK_H, +BLOCK_H) into e4m3 bytes and one scale
    byte per 32-group (sf_ptr: the uint8 view of x_sf, stride_st in bytes). Returns (rows, row_ok, r64) for the
    top-k copies."""
    bits = _snap_load(x_ptr, T, Hd, tt, th, stride_xt, stride_xh, BLOCK_T, BLOCK_H, EVICT)
    return _stage_bits_snap(
        bits,
        x_ptr,
        q_ptr,
        sf_ptr,
        T,
        Hd,
        tt,
        th,
        stride_xt,
        stride_xh,
        stride_qt,
        stride_st,
        FLOOR,
        BLOCK_T,
        BLOCK_H,
        STORE_CACHE,
    )


@triton.jit
def _snap_load(x_ptr, T, Hd, tt, th, stride_xt, stride_xh, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, EVICT: tl.constexpr):
    """The [BLOCK_T, BLOCK_H] int16 tile (token block tt, column block th) of x; rows past T read as 0."""
    rows = tt * BLOCK_T + tl.arange(0, BLOCK_T)
    col = th * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m = (rows < T)[:, None] & (col < Hd)[None, :]
    return tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * stride_xt + col[None, :].to(tl.int64) * stride_xh,
        mask=m,
        other=0,
        eviction_policy=EVICT,
    )


@triton.jit
def _stage_bits_snap(
    bits,
    x_ptr,
    q_ptr,
    sf_ptr,
    T,
    Hd,
    tt,
    th,
    stride_xt,
    stride_xh,
    stride_qt,
    stride_st,
    FLOOR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STORE_CACHE: tl.constexpr,
):
    """_stage_tile_snap on the tile ``bits`` (= _snap_load(.., tt, th, ..)) loaded already (the prefetching
    persistent loop of dsv4ref/moe/variants/stage.py loads the next tile before this one is encoded)."""
    NG: tl.constexpr = BLOCK_H // 32  # 32-value groups per tile row
    rows = tt * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    r64 = rows.to(tl.int64)
    col = th * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m = row_ok[:, None] & (col < Hd)[None, :]
    xb = tl.reshape(bits.to(tl.int32) << 16, (BLOCK_T, NG, 32))  # fp32 bits of the bf16 values, exactly
    x = xb.to(tl.float32, bitcast=True)
    q_out = q_ptr + r64[:, None] * stride_qt + col[None, :]
    amax = tl.max(xb & 0x7FFFFFFF, axis=2)  # [BLOCK_T, NG] |x| bits: >= 0x7F800000 is NaN / inf
    byte = ue8m0_byte_bits(amax, FLOOR)
    bad = amax >= 0x7F800000
    # Every tile is stored as if finite, straight from the cvt (no branch between the cvt and the store,
    # which would unpack the packed bytes one per register). A tile that holds a non-finite group (rare)
    # then reloads its values and stores them again with the policy applied: the same thread rewrites
    # the same bytes, so its second store wins, and x need not stay live across the tile-wide test.
    tl.store(q_out, tl.reshape(e4m3_snap(x, byte[:, :, None]), (BLOCK_T, BLOCK_H)), mask=m, cache_modifier=STORE_CACHE)
    if tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) > 0:
        bits = tl.load(x_ptr + r64[:, None] * stride_xt + col[None, :].to(tl.int64) * stride_xh, mask=m, other=0)
        xb = tl.reshape(bits.to(tl.int32) << 16, (BLOCK_T, NG, 32))
        q = tl.where(bad[:, :, None], e4m3_nan_codes(xb), e4m3_snap(xb.to(tl.float32, bitcast=True), byte[:, :, None]))
        tl.store(q_out, tl.reshape(q, (BLOCK_T, BLOCK_H)), mask=m, cache_modifier=STORE_CACHE)
    byte = tl.where(bad, 255, byte)
    g = th * NG + tl.arange(0, NG)  # [NG] group index = byte index in the row of x_sf's bytes
    tl.store(
        sf_ptr + r64[:, None] * stride_st + g[None, :],
        byte.to(tl.uint8),
        mask=row_ok[:, None] & (g * 32 < Hd)[None, :],
        cache_modifier=STORE_CACHE,
    )
    return rows, row_ok, r64


@triton.jit
def stage_kernel(
    x_ptr,  # int16 view of hidden bf16 [T, Hd], any strides (stride_x_t, stride_x_h)
    x_fp8_ptr,  # uint8 view of x_fp8 [≥T, Hd], unit stride along Hd, row stride stride_fp8_t
    x_sf_ptr,  # uint8 view of x_sf [≥T, Hd/128] int32 (little-endian: [≥T, Hd/32] scale bytes), row stride stride_sf_t bytes
    ids_ptr,  # int32 or int64 ids [T, K] (stride_ids_t, stride_ids_k)
    weights_ptr,  # int32 view of fp32 weights [T, K] (stride_weights_t, stride_weights_k): their bits are copied
    ids_out_ptr,  # int64 [≥T, K], unit stride along K, row stride stride_ids_out_t
    weights_out_ptr,  # int32 view of fp32 [≥T, K], unit stride along K, row stride stride_weights_out_t
    T,
    Hd,
    K,
    stride_x_t,
    stride_x_h,
    stride_fp8_t,
    stride_sf_t,
    stride_ids_t,
    stride_ids_k,
    stride_weights_t,
    stride_weights_k,
    stride_ids_out_t,
    stride_weights_out_t,
    FLOOR: tl.constexpr,  # 1e-4, the amax floor
    BLOCK_T: tl.constexpr,  # tokens per tile
    BLOCK_H: tl.constexpr,  # hidden values per tile, a multiple of 128
    BLOCK_TOPK: tl.constexpr,  # next_power_of_2(K)
    TOPK_FIRST: tl.constexpr = False,  # the top-k loads issued before the tile's loads
):
    """One program per (token block, column block): its tile staged by ``_stage_tile_snap`` (the bf16 input
    loaded evict-first, the outputs stored streaming, ``.cs``: read once, written once); the programs of column
    block 0 also copy their rows' top-k."""
    if TOPK_FIRST:
        # the program of column block 0 loads its rows' ids and weights before its tile, so these small loads
        # share the tile's round trip instead of adding one after its stores; the others load nothing (masked)
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        copy = rows < T - T * tl.minimum(tl.program_id(1), 1)  # rows < T in column block 0, none elsewhere
        ids, wb = _topk_load(
            ids_ptr,
            weights_ptr,
            rows.to(tl.int64),
            copy,
            K,
            stride_ids_t,
            stride_ids_k,
            stride_weights_t,
            stride_weights_k,
            BLOCK_TOPK,
        )
        tl.debug_barrier()  # keeps the compiler from sinking these loads below the tile's (found in the SASS)
        _stage_tile_snap(
            x_ptr,
            x_fp8_ptr,
            x_sf_ptr,
            T,
            Hd,
            tl.program_id(0),
            tl.program_id(1),
            stride_x_t,
            stride_x_h,
            stride_fp8_t,
            stride_sf_t,
            FLOOR,
            BLOCK_T,
            BLOCK_H,
            "evict_first",
            ".cs",
        )
        _topk_store(
            ids_out_ptr, weights_out_ptr, ids, wb, rows.to(tl.int64), copy, K, stride_ids_out_t, stride_weights_out_t, BLOCK_TOPK
        )
    else:
        rows, row_ok, r64 = _stage_tile_snap(
            x_ptr,
            x_fp8_ptr,
            x_sf_ptr,
            T,
            Hd,
            tl.program_id(0),
            tl.program_id(1),
            stride_x_t,
            stride_x_h,
            stride_fp8_t,
            stride_sf_t,
            FLOOR,
            BLOCK_T,
            BLOCK_H,
            "evict_first",
            ".cs",
        )
        if tl.program_id(1) == 0:  # the top-k copies, once per token
            _stage_topk(
                ids_ptr,
                weights_ptr,
                ids_out_ptr,
                weights_out_ptr,
                rows,
                row_ok,
                r64,
                K,
                stride_ids_t,
                stride_ids_k,
                stride_weights_t,
                stride_weights_k,
                stride_ids_out_t,
                stride_weights_out_t,
                BLOCK_TOPK,
            )


# ----------------------------------------------------------------------------------------------------
# Experts: a grouped GEMM pair over slots sorted by expert (docs/moe.md#experts).
#   rows r of one program all belong to expert e = tile_expert[tile] (E: no work, the program returns);
#   slot = order[r] = t·K + k, token t = slot // K.
#   gate_up_kernel:  a, u = x̂[t] @ W1[e]ᵀ, x̂[t] @ W3[e]ᵀ   (fp32 accumulation over Hd, BLOCK_H at a time)
#                    h[r] = bf16( silu(min(a, L)) · clamp(u, −L, L) · ω[slot] )       ω: only if APPLY_W
#   down_kernel:     o[slot] = bf16( h[r] @ W2[e]ᵀ )                                  one row per slot
# x̂ is the staged activation (FP8_IN: e4m3 byte · 2^(byte_j − 127) from the packed word) or the bf16 x.
# Both are exact in bf16, so the dots run on bf16 operands (fp32 when interpreting).
# ----------------------------------------------------------------------------------------------------


@triton.jit
def tile_slots(tile_expert_ptr, tile_row0_ptr, tile_row1_ptr, order_ptr, BLOCK_M: tl.constexpr):
    """This program's tile of a grouped GEMM: (expert e, its rows of ``order``, their mask, their slot numbers).
    e = E marks a program past the real tiles."""
    tile = tl.program_id(0)
    rows = tl.load(tile_row0_ptr + tile) + tl.arange(0, BLOCK_M)
    rmask = rows < tl.load(tile_row1_ptr + tile)
    return tl.load(tile_expert_ptr + tile), rows, rmask, tl.load(order_ptr + rows, mask=rmask, other=0)


@triton.jit
def gate_up_kernel(
    x_ptr,  # int16 view of bf16 x [T, Hd] (stride_xt, stride_xh); read when not FP8_IN
    xq_ptr,  # uint8 view of the staged e4m3 x_fp8 [T, Hd], unit stride along Hd (stride_qt); read when FP8_IN
    xsf_ptr,  # int32 packed scales x_sf [T, Hd/128], unit stride along Hd/128 (stride_st); read when FP8_IN
    order_ptr,  # int64 [R]: slot numbers t·K + k, grouped by expert
    omega_ptr,  # fp32 [T·K]: the routing weight of each slot; read when APPLY_W
    tile_expert_ptr,
    tile_row0_ptr,
    tile_row1_ptr,  # int32 [n_tiles]: expert, first row, end of the expert's rows
    w13_ptr,  # bf16 [E, 2I, Hd] (stride_we, stride_wn, stride_wk): rows [0, I) = W1 (gate), [I, 2I) = W3 (up)
    h_ptr,  # int16 view of the bf16 workspace h [R, I], contiguous
    Hd,
    I,
    K,
    n_experts,
    limit,  # limit: L (inf = no clamp)
    stride_xt,
    stride_xh,
    stride_qt,
    stride_st,
    stride_we,
    stride_wn,
    stride_wk,
    BLOCK_M: tl.constexpr,  # rows per program (≥ 16)
    BLOCK_N: tl.constexpr,  # intermediate columns per program
    BLOCK_H: tl.constexpr,  # hidden values per step, a multiple of 128 (whole scale words) dividing Hd
    FP8_IN: tl.constexpr,
    APPLY_W: tl.constexpr,
    DOT_FP32: tl.constexpr,  # = interpreting(): fp32 dot operands (the interpreter's bf16 dot is wrong)
):
    NB: tl.constexpr = BLOCK_H // 128
    e, rows, rmask, slot = tile_slots(tile_expert_ptr, tile_row0_ptr, tile_row1_ptr, order_ptr, BLOCK_M)
    if e >= n_experts:  # past the real tiles: no work
        return
    tok = slot // K
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    kh = tl.arange(0, BLOCK_H)
    w1 = w13_ptr + e.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn + kh[:, None] * stride_wk
    w3 = w1 + I * stride_wn
    wmask = tl.broadcast_to(nmask[None, :], (BLOCK_H, BLOCK_N))
    kb = tl.arange(0, NB)
    kk = tl.arange(0, 128)
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, Hd, BLOCK_H):
        if FP8_IN:  # [BLOCK_M, NB, 128] e4m3 codes, times 2^(byte − 127) of their 32-group (byte j of the word)
            col = k0 + kb[None, :, None] * 128 + kk[None, None, :]
            q = tl.load(xq_ptr + tok[:, None, None] * stride_qt + col, mask=rmask[:, None, None], other=0)
            word = tl.load(xsf_ptr + tok[:, None] * stride_st + k0 // 128 + kb[None, :], mask=rmask[:, None], other=0)
            byte = (word[:, :, None] >> (8 * (kk // 32))[None, None, :]) & 0xFF
            # every byte as the formats define it: e4m3 0x7F / 0xFF and scale byte 255 are NaN, byte 0 is 2^-127
            xv = tl.reshape(e4m3_decode(q) * ue8m0_value(byte), (BLOCK_M, BLOCK_H))
        else:
            bits = tl.load(x_ptr + tok[:, None] * stride_xt + (k0 + kh[None, :]) * stride_xh, mask=rmask[:, None], other=0)
            xv = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)  # bf16 bits -> fp32, exactly
        xb = xv.to(tl.bfloat16)  # exact: e4m3 · 2^k and bf16 values are bf16 values (NaN stays NaN)
        acc_a = dot(xb, tl.load(w1 + k0 * stride_wk, mask=wmask, other=0.0), acc_a, DOT_FP32)
        acc_u = dot(xb, tl.load(w3 + k0 * stride_wk, mask=wmask, other=0.0), acc_u, DOT_FP32)
    # the gate is clamped from above only. Written with compares, not tl.minimum / tl.maximum: compiled, those
    # return the number when one operand is NaN, and a NaN must go through as torch's clamp lets it
    a = tl.where(acc_a > limit, limit, acc_a)
    u = tl.where(acc_u > limit, limit, tl.where(acc_u < -limit, -limit, acc_u))
    ea = tl.exp(-tl.abs(a))  # sigmoid without overflow: exp of a non-positive number
    h = a * tl.where(a >= 0, 1.0 / (1.0 + ea), ea / (1.0 + ea)) * u
    if APPLY_W:
        h = h * tl.load(omega_ptr + slot, mask=rmask, other=0.0)[:, None]  # before w2, as V4 does
    out = h_ptr + rows[:, None].to(tl.int64) * I + n[None, :]
    tl.store(out, bf16_rne_bits_nan(h).to(tl.int16, bitcast=True), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def down_kernel(
    h_ptr,  # bf16 workspace h [R, I], contiguous (written by gate_up_kernel)
    order_ptr,  # int64 [R]: slot numbers, grouped by expert
    tile_expert_ptr,
    tile_row0_ptr,
    tile_row1_ptr,  # int32 [n_tiles], as in gate_up_kernel
    w2_ptr,  # bf16 [E, Hd, I] (stride_we, stride_wn, stride_wk)
    o_ptr,  # int16 view of the bf16 slot outputs [T·K, Hd] (row stride stride_ot, unit stride along Hd)
    Hd,
    I,
    n_experts,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    BLOCK_M: tl.constexpr,  # rows per program (≥ 16)
    BLOCK_N: tl.constexpr,  # hidden columns per program
    BLOCK_K: tl.constexpr,  # intermediate values per step (≥ 16)
    DOT_FP32: tl.constexpr,
):
    e, rows, rmask, slot = tile_slots(tile_expert_ptr, tile_row0_ptr, tile_row1_ptr, order_ptr, BLOCK_M)
    if e >= n_experts:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < Hd
    kk = tl.arange(0, BLOCK_K)
    hrow = h_ptr + rows[:, None].to(tl.int64) * I + kk[None, :]
    w = w2_ptr + e.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn + kk[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kmask = (k0 + kk) < I
        hv = tl.load(hrow + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
        wv = tl.load(w + k0 * stride_wk, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = dot(hv, wv, acc, DOT_FP32)
    out = o_ptr + slot[:, None] * stride_ot + n[None, :]
    tl.store(out, bf16_rne_bits_nan(acc).to(tl.int16, bitcast=True), mask=rmask[:, None] & nmask[None, :])


# ----------------------------------------------------------------------------------------------------
# Combine (docs/moe.md#combine):  out[t] = bf16( Σ_{k: 0 ≤ ids[t,k] < E} o[t·K + k]  +  shared[t] )   in fp32.
# One output row per token, read by slot: a repeated expert id in a row is two slots, two rows, two adds.
# A −1 slot's row is never read (masked load), so its weight and its (unwritten) row cannot leak in; an id
# outside [0, E) (possible only with value checks off) is masked the same way: one compare, no garbage row.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def combine_kernel(
    o_ptr,  # int16 view of the bf16 slot outputs [T·K, Hd] (row stride stride_ot)
    ids_ptr,  # int64 ids [T, K], contiguous
    shared_ptr,  # int16 view of the bf16 shared-expert output [T, Hd], contiguous; read when HAS_SHARED
    out_ptr,  # int16 view of the bf16 output [T, Hd] (row stride stride_out, unit stride along Hd)
    T,
    Hd,
    K,
    n_experts,
    stride_ot,
    stride_out,
    HAS_SHARED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r64 = rows.to(tl.int64)
    ok = (rows < T)[:, None] & (cols < Hd)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in range(K):
        e = tl.load(ids_ptr + r64 * K + k, mask=rows < T, other=-1)
        m = ok & ((e >= 0) & (e < n_experts))[:, None]
        acc += widen_bf16(tl.load(o_ptr + (r64 * K + k)[:, None] * stride_ot + cols[None, :], mask=m, other=0))
    if HAS_SHARED:
        acc += widen_bf16(tl.load(shared_ptr + r64[:, None] * Hd + cols[None, :], mask=ok, other=0))
    tl.store(out_ptr + r64[:, None] * stride_out + cols[None, :], bf16_rne_bits_nan(acc).to(tl.int16, bitcast=True), mask=ok)
