"""Sparse MLA decode over the FP8 paged KV cache, with an attention sink.

Facts: ``../shared/spec/sparse_mla.md`` (the math §1, the API §3, the oracle §4, the two-pass seed §5, the
fused design §6, the NaN hazards §7), ``formats.md`` §5 (the 584-byte page layout) and §10 (the gather).

Every query head ``h`` of token ``t`` attends, through ONE shared 512-dim latent KV row per candidate
(MQA; K = V, the 64 RoPE dims included), to a multiset of candidate slots ``J(t)`` drawn from one or two
paged caches (the sliding-window pool and the compressed pool), with a learned sink logit per head::

    s_j = scale · <q[t, h], k_j>                       (fp32 accumulation)
    lse = ln Σ_j exp(s_j)                              (natural log, WITHOUT the sink)
    out = Σ_j exp(s_j − lse) · k_j · σ(lse − sink_h)   (= Σ e^s k / (Σ e^s + e^sink))

A row with no valid candidate gives ``out = 0`` and ``lse = −inf``, whatever the sink.

Three backends:

* ``"reference"``: :func:`dsv4ref.kv_cache.gather` (reference) → fp32 torch math, mask before use.
* ``"two_pass"``: the seed's design done cleanly: dequantise the selected slots into a reused bf16
  workspace with the gather kernel, then a bf16 sparse-attention Triton kernel (with the sink).
* ``"triton"``: one fused kernel that reads the e4m3 bytes, the UE8M0 scale bytes and the bf16 RoPE
  bytes straight from the pages and never writes a bf16 copy of the KV.

Both Triton paths use the same attention loop (:func:`_decode_kernel`); only the row loader differs.
Compiled, P is rounded to bf16 for the P·V product (FlashMLA's numerics, the default). Its error is
bounded by 2^-9·Σ_j p_j|v_j| per output, which is what the tests hold it to (tolerance
``bf16_weighted_sum``); an elementwise relative check (``bf16_out``) fails on wide-range data wherever
outputs cancel. ``pv_split=True`` in the config does P·V as (p_hi + p_lo)·V instead (~16 bits of p, two
MMAs; 6-9x slower with 64-head blocks on the H200). H200 figures and what limits the kernel:
``benchmarks/sparse_mla.md``.

``v_split=2`` or ``4`` in the config (:func:`_config`; default 1) is an alternative layout of the same
math: the 512 output dims are split over that many programs (:func:`_decode_vsplit`), each with a
``[BLOCK_H, 512 / v_split]`` accumulator, each recomputing the full 512-dim scores from the same K rows.
It trades duplicated score work for a smaller accumulator and more programs (bench cases
``sparse_mla.fused_vsplit2`` / ``_vsplit4``); not yet measured on a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import kv_cache, validate
from .device import DEVICE, interpreting
from .harness import BenchCase, CheckRow, bench, check
from .testing import compare, randn
from .tl_helpers import bf16_rne_bits, dot, page_offsets, pow2, splat

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
DEFAULT_SCALE = HEAD_DIM**-0.5
BACKENDS = ("reference", "two_pass", "triton")
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

__all__ = ["decode", "BACKENDS", "DEFAULT_SCALE"]


# ----------------------------------------------------------------------------------------------------
# Reference (plain torch, fp32 math): the oracle's algorithm, readable line by line
# ----------------------------------------------------------------------------------------------------


def _valid_mask(indices: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """[T, K] bool: entry k of row t counts iff k < lengths[t] and indices[t, k] >= 0."""
    keep = indices >= 0
    if lengths is not None:
        keep &= torch.arange(indices.shape[1], device=indices.device)[None, :] < lengths[:, None].to(torch.int64)
    return keep


def _gather_pool_ref(cache, indices, lengths, block_size):
    """Dequantised rows [T, K, 512] fp32 and the validity mask [T, K]. Invalid entries become slot −1
    BEFORE the gather (mask before use: memory is never indexed with −1 or a slot past the length)."""
    T, K = indices.shape
    keep = _valid_mask(indices, lengths)
    slots = torch.where(keep, indices, -1).reshape(-1)
    rows = kv_cache.gather(cache, slots, block_size=block_size, backend="reference")
    return rows.float().view(T, K, HEAD_DIM), keep


def _reference(q, pools, sink, scale, with_mass=False):
    """pools: list of (cache, indices, lengths|None, block_size). ``with_mass`` also returns
    Σ_j p_j·|v_j| (sink factor included), the scale of a kernel's rounding error (tolerance
    "bf16_weighted_sum")."""
    ks, masks = zip(*(_gather_pool_ref(*p) for p in pools))
    k = torch.cat(ks, dim=1)  # [T, K1+K2, 512]: K = V
    keep = torch.cat(masks, dim=1)  # [T, K1+K2]
    s = scale * torch.einsum("thd,tkd->thk", q.float(), k)  # [T, H, K]
    s = s.masked_fill(~keep[:, None, :], -math.inf)
    nonempty = keep.any(dim=1)[:, None].expand(-1, q.shape[1])  # [T, H]
    lse = torch.logsumexp(s, dim=-1)  # −inf for empty rows
    lse_safe = torch.where(nonempty, lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe[..., None])  # masked entries: exp(−inf) = 0
    out = torch.einsum("thk,tkd->thd", p, k)
    if sink is not None:  # the sink is in the denominator only: multiply by σ(lse − sink)
        out = out * torch.sigmoid(lse_safe - sink.float()[None, :])[..., None]
    out = torch.where(nonempty[..., None], out, torch.zeros_like(out))
    lse = torch.where(nonempty, lse, torch.full_like(lse, -math.inf))
    if with_mass:
        mass = torch.einsum("thk,tkd->thd", p, k.abs())
        if sink is not None:
            mass = mass * torch.sigmoid(lse_safe - sink.float()[None, :])[..., None]
        return out.to(torch.bfloat16), lse, torch.where(nonempty[..., None], mass, torch.zeros_like(mass))
    return out.to(torch.bfloat16), lse


# ----------------------------------------------------------------------------------------------------
# Triton: row loaders, the attention loop, the epilogue, the split merge
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _load_rows_fp8(cache_ptr, slot, ok, block_size, page_stride, BLOCK_N: tl.constexpr, ROPE16: tl.constexpr):
    """Dequantised latent rows [BLOCK_N, 512] fp32 straight from the pages (formats.md §5).

    The row is 8 tiles of 64: tiles 0..6 are e4m3 bytes × 2^(scale byte − 127) (exact), tile 7 is the
    64 bf16 RoPE values (two little-endian bytes each). Rows with ``ok`` false load nothing (other=0),
    so a −1 or a NaN-filled page is never read into the math (pitfalls #12)."""
    data, scales = page_offsets(slot, block_size, page_stride)  # [BLOCK_N] int64 each
    b = tl.arange(0, 8)
    c = tl.arange(0, 64)
    b3 = b[None, :, None]
    c3 = c[None, None, :]
    ok3 = (ok[:, None, None] & (b3 < 7)) & (c3 >= 0)  # [BLOCK_N, 8, 64], the pointer's shape
    q8 = tl.load(cache_ptr + data[:, None, None] + b3 * 64 + c3, mask=ok3, other=0)
    x = q8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    ok2 = ok[:, None] & (b[None, :] < 7)
    sb = tl.load(cache_ptr + scales[:, None] + b[None, :], mask=ok2, other=127).to(tl.int32)
    x = x * pow2(sb)[:, :, None]
    okr = ok[:, None] & (c[None, :] >= 0)
    if ROPE16:  # pages start at even byte addresses: read the 64 bf16 as int16 words (little-endian)
        w = tl.load(cache_ptr.to(tl.pointer_type(tl.int16)) + ((data + 448) // 2)[:, None] + c[None, :],
                    mask=okr, other=0).to(tl.int32) & 0xFFFF
    else:  # any alignment: two bytes each
        lo = tl.load(cache_ptr + data[:, None] + 448 + 2 * c[None, :], mask=okr, other=0).to(tl.int32)
        hi = tl.load(cache_ptr + data[:, None] + 449 + 2 * c[None, :], mask=okr, other=0).to(tl.int32)
        w = lo | (hi << 8)
    rope = (w << 16).to(tl.float32, bitcast=True)  # bf16 bits -> fp32, exactly
    x = tl.where(b3 == 7, rope[:, None, :], x)
    return tl.reshape(x, (BLOCK_N, 512))


@triton.jit
def _load_rows_bf16(ws_ptr, row, ok):
    """Rows [BLOCK_N, 512] of the bf16 workspace (two-pass path), widened to fp32 right after the load."""
    d = tl.arange(0, 512)
    ptr = ws_ptr + row.to(tl.int64)[:, None] * 512 + d[None, :]
    return tl.load(ptr, mask=ok[:, None] & (d[None, :] >= 0), other=0.0).to(tl.float32)


@triton.jit
def _load_cols_fp8(cache_ptr, slot, ok, d0, block_size, page_stride, BLOCK_N: tl.constexpr, ROPE16: tl.constexpr,
                   W: tl.constexpr):
    """Dims [d0, d0 + W) of the dequantised rows, [BLOCK_N, W] fp32 (the v-split path; d0 a multiple of 64,
    W in {128, 256}). The same bytes and the same exact dequantisation as :func:`_load_rows_fp8`, for the
    W/64 tiles this slice covers: tiles < 7 are e4m3 × 2^(scale − 127), tile 7 the bf16 RoPE values."""
    data, scales = page_offsets(slot, block_size, page_stride)
    b = d0 // 64 + tl.arange(0, W // 64)  # the tile ids of this slice
    c = tl.arange(0, 64)
    b3 = b[None, :, None]
    c3 = c[None, None, :]
    ok3 = (ok[:, None, None] & (b3 < 7)) & (c3 >= 0)
    q8 = tl.load(cache_ptr + data[:, None, None] + b3 * 64 + c3, mask=ok3, other=0)
    x = q8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    ok2 = ok[:, None] & (b[None, :] < 7)
    sb = tl.load(cache_ptr + scales[:, None] + b[None, :], mask=ok2, other=127).to(tl.int32)
    x = x * pow2(sb)[:, :, None]
    okr = ok[:, None] & ((c[None, :] + (d0 + W)) >= 512)  # only the slice that ends at 512 holds tile 7
    if ROPE16:
        w = tl.load(cache_ptr.to(tl.pointer_type(tl.int16)) + ((data + 448) // 2)[:, None] + c[None, :],
                    mask=okr, other=0).to(tl.int32) & 0xFFFF
    else:
        lo = tl.load(cache_ptr + data[:, None] + 448 + 2 * c[None, :], mask=okr, other=0).to(tl.int32)
        hi = tl.load(cache_ptr + data[:, None] + 449 + 2 * c[None, :], mask=okr, other=0).to(tl.int32)
        w = lo | (hi << 8)
    rope = (w << 16).to(tl.float32, bitcast=True)
    x = tl.where(b3 == 7, rope[:, None, :], x)
    return tl.reshape(x, (BLOCK_N, W))


@triton.jit
def _load_cols(kv_ptr, idx, row, ok, d0, block_size, page_stride, KV_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
               ROPE16: tl.constexpr, W: tl.constexpr, DOT_FP32: tl.constexpr):
    """Dims [d0, d0 + W) of the candidate rows as a dot operand (bf16 compiled, fp32 interpreted)."""
    if KV_BF16:
        d = d0 + tl.arange(0, W)
        k = tl.load(kv_ptr + row.to(tl.int64)[:, None] * 512 + d[None, :], mask=ok[:, None] & (d[None, :] >= 0),
                    other=0.0).to(tl.float32)
    else:
        k = _load_cols_fp8(kv_ptr, tl.maximum(idx, 0), ok, d0, block_size, page_stride, BLOCK_N, ROPE16, W)
    if not DOT_FP32:
        k = k.to(tl.bfloat16)  # exact (e4m3 × 2^e and the RoPE values are bf16 numbers)
    return k


@triton.jit
def _attend_pool_vsplit(q_own, q_sib, q_far, d_own, d_sib, d_far, m, l, acc, kv_ptr, idx_ptr, row_base, start,
                        stop, block_size, page_stride, qk_scale, KV_BF16: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, ROPE16: tl.constexpr,
                        PV_SPLIT: tl.constexpr, VSPLIT: tl.constexpr):
    """:func:`_attend_pool` for a program that owns only the value dims [d_own, d_own + 512/VSPLIT).

    The scores still need all 512 dims: they are summed from the program's own slice (which is then reused
    as V, as in the unsplit loop), for VSPLIT = 4 the other 128 dims of its half (``sib``), and the other
    256-dim half (``far``). Every slice is a power of two wide, so no masked padding enters the dots."""
    jn = tl.arange(0, BLOCK_N)
    for j in range(start, stop, BLOCK_N):
        jj = j + jn
        idx = tl.load(idx_ptr + jj, mask=jj < stop, other=-1)
        ok = idx >= 0
        k_own = _load_cols(kv_ptr, idx, row_base + jj, ok, d_own, block_size, page_stride, KV_BF16, BLOCK_N, ROPE16,
                           512 // VSPLIT, DOT_FP32)
        s = dot(q_own, tl.trans(k_own), tl.zeros((BLOCK_H, BLOCK_N), dtype=tl.float32), DOT_FP32)
        if VSPLIT == 4:
            k_sib = _load_cols(kv_ptr, idx, row_base + jj, ok, d_sib, block_size, page_stride, KV_BF16, BLOCK_N,
                               ROPE16, 128, DOT_FP32)
            s = dot(q_sib, tl.trans(k_sib), s, DOT_FP32)
        k_far = _load_cols(kv_ptr, idx, row_base + jj, ok, d_far, block_size, page_stride, KV_BF16, BLOCK_N, ROPE16,
                           256, DOT_FP32)
        s = dot(q_far, tl.trans(k_far), s, DOT_FP32)
        s = tl.where(ok[None, :], s * qk_scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            acc = dot(p, k_own, acc * alpha[:, None], DOT_FP32)
        elif PV_SPLIT:
            p_hi = p.to(tl.bfloat16)
            p_lo = (p - p_hi.to(tl.float32)).to(tl.bfloat16)
            acc = dot(p_hi, k_own, acc * alpha[:, None], DOT_FP32)
            acc = dot(p_lo, k_own, acc, DOT_FP32)
        else:
            acc = dot(p.to(tl.bfloat16), k_own, acc * alpha[:, None], DOT_FP32)
        m = m_new
    return m, l, acc


@triton.jit
def _load_q_cols(q_ptr, t64, q_stride_h, h, hm, d0, W: tl.constexpr, DOT_FP32: tl.constexpr):
    """q[t, h, d0:d0 + W] for a block of heads (padding heads 0), a dot operand."""
    d = d0 + tl.arange(0, W)
    q = tl.load(q_ptr + t64 + h[:, None].to(tl.int64) * q_stride_h + d[None, :],
                mask=hm[:, None] & (d[None, :] >= 0), other=0.0).to(tl.float32)
    if not DOT_FP32:
        q = q.to(tl.bfloat16)
    return q


@triton.jit
def _attend_pool(q, m, l, acc, kv_ptr, idx_ptr, row_base, start, stop, block_size, page_stride, qk_scale,
                 KV_BF16: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
                 ROPE16: tl.constexpr, PV_SPLIT: tl.constexpr):
    """Online softmax over candidates [start, stop) of one pool; returns the updated (m, l, acc).

    m: running max of the log2-domain logits [BLOCK_H]; l: running Σ 2^(s − m); acc: running Σ 2^(s − m)·k.
    A chunk whose entries are all masked leaves m = −inf; m_safe keeps every exponent finite (I12,
    pitfalls #18): never −inf − (−inf)."""
    jn = tl.arange(0, BLOCK_N)
    for j in range(start, stop, BLOCK_N):
        jj = j + jn
        idx = tl.load(idx_ptr + jj, mask=jj < stop, other=-1)  # beyond the length: −1
        ok = idx >= 0
        if KV_BF16:
            k = _load_rows_bf16(kv_ptr, row_base + jj, ok)
        else:
            k = _load_rows_fp8(kv_ptr, tl.maximum(idx, 0), ok, block_size, page_stride, BLOCK_N, ROPE16)
        if DOT_FP32:
            kd = k
        else:
            kd = k.to(tl.bfloat16)  # exact: e4m3 × 2^e and the RoPE values are bf16 numbers
        s = dot(q, tl.trans(kd), tl.zeros((BLOCK_H, BLOCK_N), dtype=tl.float32), DOT_FP32)
        s = tl.where(ok[None, :], s * qk_scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)  # m = −inf (nothing yet) -> 0
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        # the same tile is V: nothing loaded twice
        if DOT_FP32:
            acc = dot(p, kd, acc * alpha[:, None], DOT_FP32)
        elif PV_SPLIT:  # p = p_hi + p_lo, both bf16: ~16 mantissa bits of p for one more MMA
            p_hi = p.to(tl.bfloat16)
            p_lo = (p - p_hi.to(tl.float32)).to(tl.bfloat16)
            acc = dot(p_hi, kd, acc * alpha[:, None], DOT_FP32)
            acc = dot(p_lo, kd, acc, DOT_FP32)
        else:  # p rounded to bf16 (FlashMLA-style): abs error up to 2^-9 · Σ p|v|
            acc = dot(p.to(tl.bfloat16), kd, acc * alpha[:, None], DOT_FP32)
        m = m_new
    return m, l, acc


@triton.jit
def _finish(m, l, acc, sink):
    """Epilogue: out = acc / l · σ(lse − sink), lse = ln Σ e^s; empty rows -> out 0, lse −inf.

    Emptiness comes from l (l ≥ 1 as soon as one entry is valid: the max entry contributes 2^0), never
    from the running max. The sink enters as the correction factor 1 / (1 + e^(sink − lse)), which is
    right for sink = −inf (factor 1) and +inf (factor 0) without NaN (sparse_mla.md §7.3)."""
    nonempty = l > 0
    l_safe = tl.where(nonempty, l, 1.0)
    m_safe = tl.where(nonempty, m, 0.0)
    lse = (m_safe + tl.log2(l_safe)) * 0.6931471805599453
    corr = 1.0 / (1.0 + tl.exp(sink - lse))
    out = acc * (corr / l_safe)[:, None]
    out = tl.where(nonempty[:, None], out, 0.0)
    lse = tl.where(nonempty, lse, -float("inf"))
    return out, lse


@triton.jit
def _decode_kernel(
    q_ptr, q_stride_t, q_stride_h,  # q [T, H, 512] bf16 (rows contiguous)
    sink_ptr,  # [H] fp32 (HAS_SINK)
    out_ptr,  # int16 view of out [T, H, 512] bf16, contiguous (SPLITS == 1)
    lse_ptr,  # [T, H] fp32 (SPLITS == 1)
    part_o_ptr,  # [T, SPLITS, H, 512] fp32: unnormalised partial acc (SPLITS > 1)
    part_ml_ptr,  # [T, SPLITS, H, 2] fp32: partial (m, l) in the log2 domain (SPLITS > 1)
    kv1_ptr, idx1_ptr, len1_ptr, K1, idx1_stride, bs1, ps1, chunk1,  # pool 1: cache (or workspace), indices [T, K1]
    kv2_ptr, idx2_ptr, len2_ptr, K2, idx2_stride, bs2, ps2, chunk2,  # pool 2 (HAS_POOL2)
    H,
    qk_scale,  # softmax scale · log2(e)
    HAS_LEN1: tl.constexpr, HAS_POOL2: tl.constexpr, HAS_LEN2: tl.constexpr, HAS_SINK: tl.constexpr,
    KV_BF16: tl.constexpr,  # True: kv*_ptr are bf16 workspaces, row = t·K + j (two-pass); False: FP8 pages
    SPLITS: tl.constexpr,  # candidate-list splits (flash-decoding); > 1 writes partials for _merge_kernel
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    ROPE16: tl.constexpr,  # every page starts at an even address: RoPE read as int16 words
    PV_SPLIT: tl.constexpr,  # compiled path: P·V as (p_hi + p_lo)·V in bf16, so p keeps ~16 bits
    VSPLIT: tl.constexpr = 1,  # > 1: program_id(0) = t·VSPLIT + v owns out dims [v·512/VSPLIT, +512/VSPLIT)
):
    tl.static_assert(BLOCK_N >= 16)  # the dots' K (for P·V) and N dims
    tl.static_assert(BLOCK_H >= 16)
    if VSPLIT == 1:
        t = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        sp = tl.program_id(2)
        hm = h < H  # heads past H are padding: q = 0, sink = −inf, never stored
        d = tl.arange(0, 512)
        t64 = t.to(tl.int64)
        q = tl.load(q_ptr + t64 * q_stride_t + h[:, None].to(tl.int64) * q_stride_h + d[None, :],
                    mask=hm[:, None] & (d[None, :] >= 0), other=0.0).to(tl.float32)
        if not DOT_FP32:
            q = q.to(tl.bfloat16)  # exact: q was bf16
        m = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, 512), dtype=tl.float32)

        n1 = K1
        if HAS_LEN1:
            n1 = tl.minimum(tl.load(len1_ptr + t), K1)
        start1 = sp * chunk1
        stop1 = tl.minimum(start1 + chunk1, n1)
        m, l, acc = _attend_pool(q, m, l, acc, kv1_ptr, idx1_ptr + t64 * idx1_stride, t64 * K1, start1, stop1,
                                 bs1, ps1, qk_scale, KV_BF16, BLOCK_H, BLOCK_N, DOT_FP32, ROPE16, PV_SPLIT)
        if HAS_POOL2:
            n2 = K2
            if HAS_LEN2:
                n2 = tl.minimum(tl.load(len2_ptr + t), K2)
            start2 = sp * chunk2
            stop2 = tl.minimum(start2 + chunk2, n2)
            m, l, acc = _attend_pool(q, m, l, acc, kv2_ptr, idx2_ptr + t64 * idx2_stride, t64 * K2, start2, stop2,
                                     bs2, ps2, qk_scale, KV_BF16, BLOCK_H, BLOCK_N, DOT_FP32, ROPE16, PV_SPLIT)

        if SPLITS == 1:
            if HAS_SINK:
                sink = tl.load(sink_ptr + h, mask=hm, other=-float("inf"))
            else:
                sink = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
            out, lse = _finish(m, l, acc, sink)
            row = t64 * H + h.to(tl.int64)
            tl.store(out_ptr + row[:, None] * 512 + d[None, :], bf16_rne_bits(out).to(tl.int16, bitcast=True),
                     mask=hm[:, None] & (d[None, :] >= 0))
            tl.store(lse_ptr + row, lse, mask=hm)
        else:
            row = (t64 * SPLITS + sp) * H + h.to(tl.int64)
            tl.store(part_o_ptr + row[:, None] * 512 + d[None, :], acc, mask=hm[:, None] & (d[None, :] >= 0))
            tl.store(part_ml_ptr + row * 2, m, mask=hm)
            tl.store(part_ml_ptr + row * 2 + 1, l, mask=hm)
    else:
        _decode_vsplit(q_ptr, q_stride_t, q_stride_h, sink_ptr, out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
                       kv1_ptr, idx1_ptr, len1_ptr, K1, idx1_stride, bs1, ps1, chunk1,
                       kv2_ptr, idx2_ptr, len2_ptr, K2, idx2_stride, bs2, ps2, chunk2, H, qk_scale,
                       HAS_LEN1, HAS_POOL2, HAS_LEN2, HAS_SINK, KV_BF16, SPLITS, BLOCK_H, BLOCK_N, DOT_FP32, ROPE16,
                       PV_SPLIT, VSPLIT)


@triton.jit
def _decode_vsplit(
    q_ptr, q_stride_t, q_stride_h, sink_ptr, out_ptr, lse_ptr, part_o_ptr, part_ml_ptr,
    kv1_ptr, idx1_ptr, len1_ptr, K1, idx1_stride, bs1, ps1, chunk1,
    kv2_ptr, idx2_ptr, len2_ptr, K2, idx2_stride, bs2, ps2, chunk2, H, qk_scale,
    HAS_LEN1: tl.constexpr, HAS_POOL2: tl.constexpr, HAS_LEN2: tl.constexpr, HAS_SINK: tl.constexpr,
    KV_BF16: tl.constexpr, SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, ROPE16: tl.constexpr, PV_SPLIT: tl.constexpr, VSPLIT: tl.constexpr,
):
    """The value-split program (VSPLIT = 2 or 4): the body of :func:`_decode_kernel` for one slice of
    512/VSPLIT output dims. Its accumulator is [BLOCK_H, 512/VSPLIT] fp32 (64 heads, VSPLIT = 2: 64 KB
    instead of 128 KB, ~64 registers/thread at 8 warps instead of ~128), at the price of recomputing the
    full 512-dim scores in every slice (the K bytes of the other slices come from L2: the VSPLIT programs
    of one token are adjacent in the grid). Every slice computes the same (m, l) up to fp32 summation
    order; only slice 0 writes lse (or the partial (m, l))."""
    tl.static_assert((VSPLIT == 2) | (VSPLIT == 4))
    pid = tl.program_id(0)
    t = pid // VSPLIT
    v = pid % VSPLIT
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    sp = tl.program_id(2)
    hm = h < H
    t64 = t.to(tl.int64)
    d_own = v * (512 // VSPLIT)
    d_sib = (v ^ 1) * 128  # VSPLIT = 4: the other quarter of this program's half
    d_far = (1 - v // (VSPLIT // 2)) * 256  # the other half
    qt = t64 * q_stride_t
    q_own = _load_q_cols(q_ptr, qt, q_stride_h, h, hm, d_own, 512 // VSPLIT, DOT_FP32)
    q_far = _load_q_cols(q_ptr, qt, q_stride_h, h, hm, d_far, 256, DOT_FP32)
    if VSPLIT == 4:
        q_sib = _load_q_cols(q_ptr, qt, q_stride_h, h, hm, d_sib, 128, DOT_FP32)
    else:
        q_sib = q_own  # unused
    m = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, 512 // VSPLIT), dtype=tl.float32)

    n1 = K1
    if HAS_LEN1:
        n1 = tl.minimum(tl.load(len1_ptr + t), K1)
    start1 = sp * chunk1
    stop1 = tl.minimum(start1 + chunk1, n1)
    m, l, acc = _attend_pool_vsplit(q_own, q_sib, q_far, d_own, d_sib, d_far, m, l, acc, kv1_ptr,
                                    idx1_ptr + t64 * idx1_stride, t64 * K1, start1, stop1, bs1, ps1, qk_scale,
                                    KV_BF16, BLOCK_H, BLOCK_N, DOT_FP32, ROPE16, PV_SPLIT, VSPLIT)
    if HAS_POOL2:
        n2 = K2
        if HAS_LEN2:
            n2 = tl.minimum(tl.load(len2_ptr + t), K2)
        start2 = sp * chunk2
        stop2 = tl.minimum(start2 + chunk2, n2)
        m, l, acc = _attend_pool_vsplit(q_own, q_sib, q_far, d_own, d_sib, d_far, m, l, acc, kv2_ptr,
                                        idx2_ptr + t64 * idx2_stride, t64 * K2, start2, stop2, bs2, ps2, qk_scale,
                                        KV_BF16, BLOCK_H, BLOCK_N, DOT_FP32, ROPE16, PV_SPLIT, VSPLIT)

    dv = d_own + tl.arange(0, 512 // VSPLIT)
    first = hm & splat(v == 0, hm)  # (m, l) and lse: written by slice 0 only
    if SPLITS == 1:
        if HAS_SINK:
            sink = tl.load(sink_ptr + h, mask=hm, other=-float("inf"))
        else:
            sink = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
        out, lse = _finish(m, l, acc, sink)
        row = t64 * H + h.to(tl.int64)
        tl.store(out_ptr + row[:, None] * 512 + dv[None, :], bf16_rne_bits(out).to(tl.int16, bitcast=True),
                 mask=hm[:, None] & (dv[None, :] >= 0))
        tl.store(lse_ptr + row, lse, mask=first)
    else:
        row = (t64 * SPLITS + sp) * H + h.to(tl.int64)
        tl.store(part_o_ptr + row[:, None] * 512 + dv[None, :], acc, mask=hm[:, None] & (dv[None, :] >= 0))
        tl.store(part_ml_ptr + row * 2, m, mask=first)
        tl.store(part_ml_ptr + row * 2 + 1, l, mask=first)


@triton.jit
def _merge_kernel(part_o_ptr, part_ml_ptr, sink_ptr, out_ptr, lse_ptr, H,
                  HAS_SINK: tl.constexpr, SPLITS: tl.constexpr):
    """Merge the SPLITS partial softmax states of one (token, head), then apply the sink ONCE
    (pitfalls #20: the partials carry no sink; lse stays in one unit, log2 inside, ln outside)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, 512)
    row = (t * SPLITS + s) * H + h  # [SPLITS]
    m_s = tl.load(part_ml_ptr + row * 2)
    l_s = tl.load(part_ml_ptr + row * 2 + 1)
    m = tl.max(m_s, axis=0)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    w = tl.exp2(m_s - m_safe)  # empty splits (m_s = −inf) weigh 0
    l = tl.sum(w * l_s, axis=0)
    acc = tl.sum(tl.load(part_o_ptr + row[:, None] * 512 + d[None, :]) * w[:, None], axis=0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + h)
    else:
        sink = -float("inf")
    # the epilogue of _finish, for one head (scalars)
    nonempty = l > 0
    l_safe = tl.where(nonempty, l, 1.0)
    lse = (m_safe + tl.log2(l_safe)) * 0.6931471805599453
    corr = 1.0 / (1.0 + tl.exp(sink - lse))
    out = tl.where(nonempty, acc * (corr / l_safe), 0.0)
    lse = tl.where(nonempty, lse, -float("inf"))
    o = t * H + h
    tl.store(out_ptr + o * 512 + d, bf16_rne_bits(out).to(tl.int16, bitcast=True))
    tl.store(lse_ptr + o, lse)


# ----------------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------------

_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (or equivalent) of ``device``; 1 on CPU. (A private helper: device.py
    exposes no such query.)"""
    if device.type == "cpu":
        return 1
    key = str(device)
    if key not in _SM_COUNT:
        props = getattr(torch, device.type).get_device_properties(device)
        _SM_COUNT[key] = int(getattr(props, "multi_processor_count", 0) or getattr(props, "gpu_subslice_count", 0) or 64)
    return _SM_COUNT[key]


def _config(T: int, H: int, K_total: int, device: torch.device, *, block_h=None, block_n=None, num_splits=None,
            num_warps=None, num_stages=None, v_split=1) -> dict:
    """Fixed meta-parameters (no autotune: tooling.md I10). Heads are processed in blocks of 16 or 64
    (H = 16 -> one block of 16; H = 128 -> two blocks of 64; other H are padded up with masked rows).
    The candidate list is split across programs (flash-decoding) only when T · head blocks would leave
    most SMs idle, and only while each split keeps at least 256 candidates.

    ``v_split`` (1, 2 or 4; 1 is the default) splits the 512 output dims over that many programs
    (:func:`_decode_vsplit`). It counts in the program total, and a program whose accumulator is at most
    32 heads × 512 fp32 (64 heads split in 2, or 16-head blocks) aims at two programs per SM, as the
    16-head blocks do (an untuned guess: not yet measured)."""
    if block_h is None:
        block_h = 16 if H <= 16 else (32 if H <= 32 else 64)
    if block_n is None:
        block_n = 16 if interpreting() else (32 if block_h <= 16 else 64)
    n_hb = triton.cdiv(H, block_h)
    if num_splits is None:
        # tuned on the H200 at T = 64 (benchmarks/sparse_mla.md): blocks of 16 heads want about two
        # programs per SM; blocks of 64 heads at most one (their partial states are 64·512 fp32 each).
        num_splits = 1
        if not interpreting():
            sms = _sm_count(device)
            if v_split == 1:
                target = 2 * sms if block_h <= 16 else sms
            else:
                target = 2 * sms if block_h // v_split <= 32 else sms
            while (T * n_hb * v_split * num_splits * 2 <= target and K_total // (num_splits * 2) >= 256
                   and num_splits < 16):
                num_splits *= 2
    validate.power_of_two(num_splits, "num_splits")
    if v_split not in (1, 2, 4):
        raise ValueError(f"v_split: expected 1, 2 or 4, got {v_split!r}")
    if num_warps is None:
        num_warps = 4 if block_h <= 16 else 8
    if num_stages is None:
        num_stages = 1 if interpreting() else 2
    return dict(block_h=block_h, block_n=block_n, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                v_split=v_split)


def _even_pages(cache: torch.Tensor) -> bool:
    return cache.data_ptr() % 2 == 0 and cache.stride(0) % 2 == 0


def _launch(q, pools, sink, scale, kv_bf16: bool, cfg: dict):
    """Run the attention kernel (and the merge when split). pools: up to two tuples
    (kv, indices [T, K], lengths [T] | None, block_size, page_stride)."""
    T, H, _ = q.shape
    out = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return out, lse
    S, BH, BN = cfg["num_splits"], cfg["block_h"], cfg["block_n"]

    def args(p):
        kv, idx, lens, bs, ps = p
        K = idx.shape[1]
        chunk = max(BN, triton.cdiv(triton.cdiv(K, S), BN) * BN)
        return [kv, idx, lens if lens is not None else idx, K, idx.stride(0), bs, ps, chunk], lens is not None

    a1, has_len1 = args(pools[0])
    has_pool2 = len(pools) > 1
    a2, has_len2 = args(pools[1]) if has_pool2 else (a1, False)
    if S > 1:
        part_o = torch.empty(T, S, H, HEAD_DIM, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(T, S, H, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = lse  # unused
    out16 = out.view(torch.int16)
    rope16 = kv_bf16 or all(_even_pages(p[0]) for p in pools)
    VS = cfg.get("v_split", 1)
    grid = (T * VS, triton.cdiv(H, BH), S)  # the VS slices of one token are neighbours: their K rows share L2
    _decode_kernel[grid](
        q, q.stride(0), q.stride(1), sink if sink is not None else lse, out16, lse, part_o, part_ml,
        *a1, *a2, H, float(scale) * LOG2E,
        HAS_LEN1=has_len1, HAS_POOL2=has_pool2, HAS_LEN2=has_len2, HAS_SINK=sink is not None, KV_BF16=kv_bf16,
        SPLITS=S, BLOCK_H=BH, BLOCK_N=BN, DOT_FP32=interpreting(), ROPE16=cfg.get("rope16", True) and rope16,
        PV_SPLIT=cfg.get("pv_split", False), VSPLIT=VS,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if S > 1:
        _merge_kernel[(T, H)](part_o, part_ml, sink if sink is not None else lse, out16, lse, H,
                              HAS_SINK=sink is not None, SPLITS=S, num_warps=4)
    return out, lse


# ----------------------------------------------------------------------------------------------------
# torch custom ops (fused; and the bf16 attention of the two-pass path)
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("dsv4ref::sparse_mla_decode", mutates_args=())
def _fused_op(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor,
              extra_cache: torch.Tensor | None, extra_indices: torch.Tensor | None,
              extra_lengths: torch.Tensor | None, sink: torch.Tensor | None, block_size: int,
              extra_block_size: int, scale: float, block_h: int, block_n: int, num_splits: int,
              num_warps: int, num_stages: int, pv_split: bool = False,
              v_split: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    pools = [(cache, indices, lengths, block_size, cache.stride(0))]
    if extra_cache is not None:
        pools.append((extra_cache, extra_indices, extra_lengths, extra_block_size, extra_cache.stride(0)))
    cfg = dict(block_h=block_h, block_n=block_n, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
               pv_split=pv_split, v_split=v_split)
    return _launch(q, pools, sink, scale, False, cfg)


@_fused_op.register_fake
def _(q, cache, indices, lengths, extra_cache, extra_indices, extra_lengths, sink, block_size, extra_block_size,
      scale, block_h, block_n, num_splits, num_warps, num_stages, pv_split=False, v_split=1):
    T, H, D = q.shape
    return q.new_empty(T, H, D), q.new_empty(T, H, dtype=torch.float32)


@torch.library.custom_op("dsv4ref::sparse_mla_attend_bf16", mutates_args=())
def _bf16_op(q: torch.Tensor, ws1: torch.Tensor, table1: torch.Tensor, ws2: torch.Tensor | None,
             table2: torch.Tensor | None, sink: torch.Tensor | None, scale: float, block_h: int, block_n: int,
             num_splits: int, num_warps: int, num_stages: int, pv_split: bool = False,
             v_split: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    pools = [(ws1, table1, None, 1, 0)]
    if ws2 is not None:
        pools.append((ws2, table2, None, 1, 0))
    cfg = dict(block_h=block_h, block_n=block_n, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
               pv_split=pv_split, v_split=v_split)
    return _launch(q, pools, sink, scale, True, cfg)


@_bf16_op.register_fake
def _(q, ws1, table1, ws2, table2, sink, scale, block_h, block_n, num_splits, num_warps, num_stages, pv_split=False,
      v_split=1):
    T, H, D = q.shape
    return q.new_empty(T, H, D), q.new_empty(T, H, dtype=torch.float32)


_WORKSPACE: dict[str, torch.Tensor] = {}


def _workspace(rows: int, device: torch.device) -> torch.Tensor:
    """A grow-only bf16 [rows, 512] workspace per device, reused across calls (the two-pass path's
    dequantised copy). Not safe for concurrent use from several streams."""
    key = str(device)
    ws = _WORKSPACE.get(key)
    if ws is None or ws.shape[0] < rows:
        ws = torch.empty(max(rows, 1), HEAD_DIM, dtype=torch.bfloat16, device=device)
        _WORKSPACE[key] = ws
    return ws[:rows]


def _two_pass(q, pools, sink, scale, cfg):
    """Pass 1: gather + dequantise every listed slot (entries past the length or −1 -> slot −1 -> a zero
    row) into the bf16 workspace, pool-major: [T·K1 rows of pool 1 | T·K2 rows of pool 2]. Pass 2: the
    bf16 sparse attention over row t·K + j, valid where the masked table holds a slot ≥ 0. No per-token
    loop, no host sync (the masked table is built with one elementwise op per pool)."""
    T = q.shape[0]
    total = sum(T * p[1].shape[1] for p in pools)
    ws = _workspace(total, q.device)
    wss, tables, r = [], [], 0
    for cache, idx, lens, bs in pools:
        table = torch.where(_valid_mask(idx, lens), idx, -1)  # [T, K] int32, −1 where not counted
        part = ws[r:r + table.numel()]
        torch.ops.dsv4ref.kv_gather(cache, table.reshape(-1), part, bs)  # the kv_cache gather kernel
        wss.append(part)
        tables.append(table)
        r += table.numel()
    ws2 = wss[1] if len(pools) > 1 else None
    t2 = tables[1] if len(pools) > 1 else None
    return torch.ops.dsv4ref.sparse_mla_attend_bf16(q, wss[0], tables[0], ws2, t2, sink, float(scale), cfg["block_h"],
                                                    cfg["block_n"], cfg["num_splits"], cfg["num_warps"], cfg["num_stages"],
                                                    cfg.get("pv_split", False), cfg.get("v_split", 1))


def _fused(q, pools, sink, scale, cfg):
    (c1, i1, l1, b1), *rest = pools
    c2, i2, l2, b2 = rest[0] if rest else (None, None, None, 1)
    return torch.ops.dsv4ref.sparse_mla_decode(q, c1, i1, l1, c2, i2, l2, sink, b1, b2, float(scale), cfg["block_h"],
                                               cfg["block_n"], cfg["num_splits"], cfg["num_warps"], cfg["num_stages"],
                                               cfg.get("pv_split", False), cfg.get("v_split", 1))


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------


def _check_pool(cache, indices, lengths, block_size, T, names):
    cn, iname, lname, bname = names
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{bname}: expected a positive int, got {block_size!r}")
    _check_cache_named(cache, block_size, cn)
    validate.tensor(indices, iname, dtype=torch.int32, ndim=2)
    if indices.shape[0] != T:
        raise ValueError(f"{iname}: expected {T} rows (one per token of q), got shape {tuple(indices.shape)}")
    if indices.stride(1) != 1:
        raise ValueError(f"{iname}: rows must be contiguous (strides {indices.stride()})")
    validate.index_range(indices, iname, cache.shape[0] * block_size)
    if lengths is not None:
        validate.tensor(lengths, lname, dtype=torch.int32, shape=(T,))
        if not lengths.is_contiguous():
            raise ValueError(f"{lname}: expected a contiguous tensor")
        if validate.CHECK_VALUES and T and bool(((lengths < 0) | (lengths > indices.shape[1])).any()):
            bad = int(((lengths < 0) | (lengths > indices.shape[1])).nonzero()[0][0])
            raise ValueError(f"{lname}: entry {bad} = {int(lengths[bad])} is out of range; expected [0, {indices.shape[1]}]")
    validate.same_device(q=None, **{cn: cache, iname: indices, lname: lengths})


def _check_cache_named(cache, block_size, name):
    try:
        kv_cache.check_cache(cache, block_size)
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise type(e)(msg.replace("cache:", f"{name}:", 1) if msg.startswith("cache:") else f"{name}: {msg}") from None


def decode(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor, *, block_size: int,
           sink: torch.Tensor | None = None, scale: float = DEFAULT_SCALE, extra_cache: torch.Tensor | None = None,
           extra_indices: torch.Tensor | None = None, extra_lengths: torch.Tensor | None = None,
           extra_block_size: int | None = None, backend: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode: every head of every token attends to its listed slots of one or two FP8 caches.

    Args:
        q: ``[T, H, 512]`` bf16 (H ≤ 128; heads are padded to a block inside the kernel, never here).
        cache: uint8 pages (``dsv4ref.kv_cache`` layout) of ``block_size`` tokens.
        indices: ``[T, K]`` int32 global slots ``page·block_size + offset``; −1 = no entry.
        lengths: ``[T]`` int32 in ``[0, K]``: only the first ``lengths[t]`` entries of row t count.
        sink: ``[H]`` fp32 sink logits (may be ±inf), in the denominator only; None = no sink.
        scale: softmax scale (DSV4: 512^-0.5).
        extra_cache, extra_indices ``[T, K2]``, extra_lengths ``[T]`` (None = all K2), extra_block_size:
            the second pool (e.g. window + compressed), attended in the same softmax.
        backend: "reference", "two_pass" or "triton" (fused).
    Returns:
        out ``[T, H, 512]`` bf16 and lse ``[T, H]`` fp32 (natural log, without the sink). A row with
        no valid entry gives out = 0 and lse = −inf.

    Every entry of ``indices`` (also past the length) must be −1 or a slot inside the cache: checked here
    (a device sync; ``DSV4REF_CHECK_VALUES=0`` skips the value checks).
    """
    validate.backend(backend, BACKENDS)
    validate.tensor(q, "q", dtype=torch.bfloat16, ndim=3)
    T, H, D = q.shape
    if D != HEAD_DIM:
        raise ValueError(f"q: expected the latent head dim {HEAD_DIM} (448 NoPE + 64 RoPE), got shape {tuple(q.shape)}")
    if not 1 <= H <= 128:
        raise ValueError(f"q: expected 1..128 heads, got {H}")
    if q.stride(2) != 1:
        raise ValueError(f"q: the last dim must be contiguous (strides {q.stride()})")
    _check_pool(cache, indices, lengths, block_size, T, ("cache", "indices", "lengths", "block_size"))
    extras = (extra_cache, extra_indices, extra_block_size)
    if any(e is not None for e in extras) or extra_lengths is not None:
        if any(e is None for e in extras):
            missing = [n for n, e in zip(("extra_cache", "extra_indices", "extra_block_size"), extras) if e is None]
            raise ValueError(f"{', '.join(missing)}: the extra pool needs extra_cache, extra_indices and "
                             f"extra_block_size together")
        _check_pool(extra_cache, extra_indices, extra_lengths, extra_block_size, T,
                    ("extra_cache", "extra_indices", "extra_lengths", "extra_block_size"))
    if sink is not None:
        validate.tensor(sink, "sink", dtype=torch.float32, shape=(H,))
        sink = sink.contiguous()
    validate.same_device(q=q, cache=cache, extra_cache=extra_cache, sink=sink)
    pools = [(cache, indices, lengths, block_size)]
    if extra_cache is not None:
        pools.append((extra_cache, extra_indices, extra_lengths, extra_block_size))
    if backend == "reference":
        return _reference(q, pools, sink, scale)
    cfg = _config(T, H, sum(p[1].shape[1] for p in pools), q.device)
    if backend == "two_pass":
        return _two_pass(q, pools, sink, scale, cfg)
    return _fused(q, pools, sink, scale, cfg)


# ----------------------------------------------------------------------------------------------------
# python -m dsv4ref check / bench
# ----------------------------------------------------------------------------------------------------


def _example(T, H, K1, K2, bs1, bs2, pages1, pages2, seed, device=None):
    """Random caches (per-block magnitudes over 2^-3..2^3), random slots with −1 holes and duplicates,
    partial lengths, a finite sink. Built with seeded CPU generators, then moved to ``device``."""
    device = device or DEVICE
    g = torch.Generator().manual_seed(seed)
    pools = []
    for i, (K, bs, pages) in enumerate(((K1, bs1, pages1), (K2, bs2, pages2))):
        if K == 0:
            continue
        n = bs * pages
        cache = kv_cache.allocate(pages, bs, device=device)
        kv_cache.insert(cache, randn((n, HEAD_DIM), seed=seed + 10 * i, octaves=6, device=device),
                        torch.arange(n, device=device), block_size=bs)
        idx = torch.randint(0, n, (T, K), generator=g, dtype=torch.int32)
        idx[torch.rand(T, K, generator=g) < 0.1] = -1
        lens = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
        lens[0] = K
        pools.append((cache, idx.to(device), lens.to(device), bs))
    q = (randn((T, H, HEAD_DIM), seed=seed + 99, octaves=4, device=device).float() * 0.25).to(torch.bfloat16)
    sink = (torch.randn(H, generator=g) * 2).to(device)
    return q, pools, sink


@check("sparse_mla.decode")
def _check_decode() -> list[CheckRow]:
    rows = []
    shapes = [(3, 16, 40, 10, 16, 2, 4, 24), (2, 64, 24, 0, 16, 2, 3, 0)]
    if not interpreting():
        shapes += [(16, 64, 128, 512, 64, 64, 40, 160), (8, 128, 128, 1024, 64, 2, 40, 4096)]
    for T, H, K1, K2, b1, b2, p1, p2 in shapes:
        q, pools, sink = _example(T, H, K1, K2, b1, b2, p1, p2, seed=T + H)
        ref_out, ref_lse, mass = _reference(q, pools, sink, DEFAULT_SCALE, with_mass=True)
        cfg = _config(T, H, K1 + K2, q.device)
        for name, fn, c in (("two_pass", _two_pass, cfg), ("triton", _fused, cfg),
                            ("triton vsplit2", _fused, _config(T, H, K1 + K2, q.device, v_split=2)),
                            ("triton vsplit4", _fused, _config(T, H, K1 + K2, q.device, v_split=4))):
            out, lse = fn(q, pools, sink, DEFAULT_SCALE, c)
            shape = f"{name} T={T} H={H} K={K1}+{K2}"
            rows.append(CheckRow("sparse_mla.decode", shape + " out",
                                 compare(out, ref_out, "bf16_weighted_sum", mass=mass)))
            rows.append(CheckRow("sparse_mla.decode", shape + " lse", compare(lse, ref_lse, "lse")))
    return rows


# The shapes: T = 64 decode tokens; the window pool (128 slots, pages of 64) plus the compressed
# pool (the rest, pages of 64), all entries valid.
BENCH_SHAPES = ((64, 64, 640), (64, 128, 1152), (64, 16, 2048))
_L2_BYTES = 60e6


def _bench_inputs(T, H, K, n_sets, device):
    """n_sets independent input sets; every (token, candidate) reads a distinct row of a cache that holds
    exactly T·K rows, so nothing is served twice from L2 within a call, and the sets rotate past it."""
    K1 = 128
    K2 = K - K1
    sets = []
    for s in range(n_sets):
        pools = []
        for i, Kp in enumerate((K1, K2)):
            n = T * Kp
            pages = n // 64
            cache = kv_cache.allocate(pages, 64, device=device)
            kv_cache.insert(cache, torch.randn(n, HEAD_DIM, device=device, dtype=torch.bfloat16),
                            torch.arange(n, device=device), block_size=64)
            g = torch.Generator().manual_seed(1000 * s + i)
            idx = torch.randperm(n, generator=g).to(torch.int32).view(T, Kp).to(device)
            pools.append((cache, idx, torch.full((T,), Kp, dtype=torch.int32, device=device), 64))
        q = torch.randn(T, H, HEAD_DIM, device=device, dtype=torch.bfloat16)
        sink = torch.randn(H, device=device)
        sets.append((q, pools, sink))
    return sets


def _bench_counts(T, H, K):
    """Compulsory bytes (584 B per selected row, as the spec counts it, + a 4-byte index; q and out in
    bf16; lse fp32; lengths) and useful FLOPs (QKᵀ and PV, 512 wide each, real H)."""
    byts = T * (K * (kv_cache.TOKEN_BYTES + 4) + H * HEAD_DIM * 2 * 2 + H * 4 + 2 * 4)
    flops = T * 2 * H * K * (HEAD_DIM + HEAD_DIM)
    return byts, flops


@bench("sparse_mla")
def _bench() -> list[BenchCase]:
    cases = []
    shapes = []
    for T, H, K in BENCH_SHAPES:
        per_set = T * K * (kv_cache.page_bytes(64) / 64)
        n_sets = max(2, math.ceil(2.5 * _L2_BYTES / per_set))
        shapes.append((T, H, K, n_sets, _bench_inputs(T, H, K, n_sets, DEVICE)))
    # the two-pass workspace is shared: size it for the largest shape BEFORE any graph captures it, so no
    # captured graph keeps a pointer to a workspace that a later, larger shape replaced
    _workspace(max(T * K for T, _, K, _, _ in shapes), shapes[0][4][0][0].device)
    for T, H, K, n_sets, sets in shapes:
        byts, flops = _bench_counts(T, H, K)
        cfg = _config(T, H, K, DEVICE)
        shape = f"T={T} H={H} K={K} split={cfg['num_splits']}"
        # no validation, no host sync on these paths: the harness can capture them in a device graph
        fused = lambda i, s=sets, c=cfg: _fused(*s[i][0:2], s[i][2], DEFAULT_SCALE, c)  # noqa: E731
        exact = lambda i, s=sets, c=dict(cfg, pv_split=True): _fused(*s[i][0:2], s[i][2], DEFAULT_SCALE, c)  # noqa: E731
        two = lambda i, s=sets, c=cfg: _two_pass(*s[i][0:2], s[i][2], DEFAULT_SCALE, c)  # noqa: E731
        graph = ""
        cases.append(BenchCase("sparse_mla.fused", shape, fused, n_sets, byts, flops,
                               note="584+4 B/row + q,out bf16 + lse; FLOP 2·H·K·1024" + graph))
        cases.append(BenchCase("sparse_mla.fused_pv_split", shape, exact, n_sets, byts, flops,
                               note="P·V as (p_hi + p_lo)·V, ~16 bits of p (benchmarks/sparse_mla.md)" + graph))
        cases.append(BenchCase("sparse_mla.two_pass", shape, two, n_sets, byts, flops,
                               note="same compulsory bytes; really moves ~2632 B/row (584 + 2·1024 workspace)" + graph))
        for vs in (2, 4):  # the value-split variants (_decode_vsplit), bf16 P like the default
            vcfg = _config(T, H, K, DEVICE, v_split=vs)
            vfn = lambda i, s=sets, c=vcfg: _fused(*s[i][0:2], s[i][2], DEFAULT_SCALE, c)  # noqa: E731
            cases.append(BenchCase(f"sparse_mla.fused_vsplit{vs}", f"T={T} H={H} K={K} split={vcfg['num_splits']}",
                                   vfn, n_sets, byts, flops,
                                   note=f"out dims split over {vs} programs, scores recomputed per slice "
                                        f"(QK MMA and dequant x{vs}; K re-read from L2)" + graph))
    return cases
