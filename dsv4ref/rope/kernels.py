"""The rope kernels (@triton.jit only); launched from :mod:`dsv4ref.rope.launch`.

* :func:`rotate_gptj_kernel`: GPT-J RoPE (or its inverse) on the last R dims of a batch of rows.
* :func:`qnorm_rope_kv_insert_mh_kernel` (the default): the fused prologue step with a few query heads of
  one token per program, q read and written as packed bf16 pairs (int32 words).
* :func:`qnorm_rope_kv_insert_kernel`: the same step with one query head per program, grid (T, H + 1), as
  the spec draws it; used when q cannot be viewed as int32 pairs.
* :func:`_kv_record`: the KV program of both fused kernels (rotate one kv row, write its 584-byte record).

The arithmetic is the reference's, rule for rule (``docs/rope.md#rounding-rules``): bf16 is widened to
fp32 in integers (no bf16 arithmetic: the interpreter gets it wrong); the rotation is two separately
rounded products and one add (the launcher passes ``enable_fp_fusion=False``: no FMA); the RMSNorm rounds
each step to bf16 as DeepSeek's bf16 tensor ops do, sums the squares in float64 and uses ``sqrt_rn`` /
``div_rn`` (correctly rounded, never ``rsqrt``); results
are rounded to bf16 nearest-even in integers (``bf16_rne_bits_nan``), every NaN as the one quiet NaN 0x7FC0
(fp32 outputs: 0x7FC00000, ``canonical_nan``), as the reference writes it (``docs/rope.md#non-finite-input``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import HEAD_DIM, NOPE_DIM, ROPE_DIM
from ..tl import bf16_rne_bits_nan, bf16_round_nan, canonical_nan
from ..tl.kv_record import kv_record

# a jit function may only read constexpr globals
_D = tl.constexpr(HEAD_DIM)  # 512 dims per head
_NOPE = tl.constexpr(NOPE_DIM)  # 448: dims [0, 448) are not rotated
_HALF = tl.constexpr(ROPE_DIM // 2)  # 32 pairs; table row = [cos × 32 | sin × 32]
_CHUNKS = tl.constexpr(HEAD_DIM // ROPE_DIM)  # 8 chunks of 64 dims; the last one is the rotary slice
_INV_D = tl.constexpr(1.0 / HEAD_DIM)  # 2^-9: multiplying by it is exact


# ----------------------------------------------------------------------------------------------------
# GPT-J rotation of the last R dims
#   out[d] = x[d]·c − x[d^1]·s  (d even),   x[d]·c + x[d^1]·s  (d odd),   c, s = table[pos, d // 2 (+ R/2)]
# ----------------------------------------------------------------------------------------------------


@triton.jit
def rotate_gptj_kernel(
    x_ptr,  # [N, D] rows: int16 view of bf16 when IS_BF16, else fp32; last dim contiguous, row stride x_stride
    out_ptr,  # [N, D] same dtype (bf16 as int16), contiguous; only its last R dims are written (the rest is a
    #           copy of x)
    pos_ptr,  # int64 [N // POS_DIV], contiguous: position of row n is pos[n // POS_DIV]
    tab_ptr,  # fp32 [max_pos, R] cos/sin table, row stride tab_stride, last dim contiguous
    n_rows,  # N
    x_stride,  # elements between rows of x
    D,  # row length (R <= D)
    tab_stride,
    POS_DIV,  # rows per position (heads per token); 1 when positions has x's leading shape
    R: tl.constexpr,  # rotary dims (64; any even number)
    R_P2: tl.constexpr,  # R rounded up to a power of two (the tile width; lanes >= R are masked off)
    ROWS: tl.constexpr,  # rows per program
    INVERSE: tl.constexpr,  # rotate by −f (sin negated)
    IS_BF16: tl.constexpr,
):
    # A [ROWS, R] tile of the rotary slice. Each element is loaded together with its pair partner
    # (index ^ 1), so output element d is x[d]·c ∓ x[d^1]·s with one vector, no shuffles.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, R_P2)
    ok = (rows < n_rows)[:, None] & (j < R)[None, :]
    col = D - R + j
    src = x_ptr + rows[:, None] * x_stride + col[None, :]
    par = x_ptr + rows[:, None] * x_stride + (D - R + (j ^ 1))[None, :]
    if IS_BF16:  # widen bf16 bits in integers: no bf16 arithmetic
        x = ((tl.load(src, mask=ok, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        y = ((tl.load(par, mask=ok, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(src, mask=ok, other=0.0)
        y = tl.load(par, mask=ok, other=0.0)
    pos = tl.load(pos_ptr + rows // POS_DIV, mask=rows < n_rows, other=0).to(tl.int64)
    trow = tab_ptr + pos[:, None] * tab_stride + (j // 2)[None, :]
    c = tl.load(trow, mask=ok, other=0.0)
    s = tl.load(trow + R // 2, mask=ok, other=0.0)
    if INVERSE:  # −s as torch does it: flip the sign bit (compiled, −s is 0 − s, which keeps sin(0) = +0)
        s = (s.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)
    even = (j % 2 == 0)[None, :]
    # even d: e·c − o·s ; odd d: o·c + e·s (= e·s + o·c). Two rounded products and one add.
    r = tl.where(even, x * c - y * s, x * c + y * s)  # subtract: compiled, −(v) is 0 − v (loses a −0)
    dst = out_ptr + rows[:, None] * D + col[None, :]
    if IS_BF16:
        tl.store(dst, bf16_rne_bits_nan(r).to(tl.int16, bitcast=True), mask=ok)
    else:
        tl.store(dst, canonical_nan(r), mask=ok)


# ----------------------------------------------------------------------------------------------------
# The fused Q-norm + RoPE + KV insert, per token t (docs/rope.md#the-fused-prologue-step)
#   Q:  rr = b(1 / sqrt(b(b(Σ_d b(q[d]²) / 512) + eps)));  y = b(q·rr)   b = bf16 rounding (DeepSeek's bf16 ops)
#       y[448:512] = GPT-J rotation of y[448:512];  q ← bf16(y)
#   KV: only if t < len(slots) and slots[t] >= 0: rotate kv[t, 448:512]; write the 584-B record at slots[t]
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _kv_record(kv_ptr, cache_ptr, t, slot, trow, kv_stride, page_stride, block_size):
    """The KV program of both fused kernels: rotate kv[t, 448:512] and write the 584-B record of slot
    with the shared encoder (:func:`dsv4ref.tl.kv_record.kv_record`, a tile of one token)."""
    row = kv_ptr + t.to(tl.int64) * kv_stride
    # RoPE: element j of the slice with its partner j ^ 1, same formula as the Q side
    j = tl.arange(0, 64)
    e = ((tl.load(row + 448 + j).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    p = ((tl.load(row + 448 + (j ^ 1)).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    ck = tl.load(trow + j // 2)
    sk = tl.load(trow + 32 + j // 2)
    rk = tl.where(j % 2 == 0, e * ck - p * sk, e * ck + p * sk)
    rb = bf16_rne_bits_nan(rk).to(tl.int32)
    one = tl.zeros([1], dtype=tl.int64)  # scalars -> [1] tiles; the RoPE words go out as byte pairs
    # NATIVE, SLOT32 off; no cache hints (kv_record takes every constexpr explicitly)
    kv_record(cache_ptr, cache_ptr, row + one, slot + one, rb[None, :], block_size, page_stride, 1, False, False, False, "", "")


@triton.jit
def _kv_program(kv_ptr, cache_ptr, slot_ptr, t, n_slots, trow, kv_stride, page_stride, block_size):
    """Token t's KV program: nothing for padding rows (t >= n_slots) or slot −1."""
    if t < n_slots:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            _kv_record(kv_ptr, cache_ptr, t, slot, trow, kv_stride, page_stride, block_size)


@triton.jit
def qnorm_rope_kv_insert_mh_kernel(
    q_ptr,  # int32 view of q [T, H, 256]: word w holds the bf16 pair (dim 2w: low 16 bits, dim 2w+1: high)
    kv_ptr,  # int16 view of kv [T, 512] bf16 (last dim contiguous)
    cache_ptr,  # uint8 pages, page p at p * page_stride (the 584-B record layout, docs/formats.md)
    slot_ptr,  # int64 [n_slots] (n_slots <= T), contiguous; −1 = write nothing
    pos_ptr,  # int64 [T], contiguous
    tab_ptr,  # fp32 [max_pos, 64] cos/sin table, row stride tab_stride
    H,  # query heads
    NG,  # head groups: cdiv(H, HPP)
    n_slots,
    q_stride_t,  # in int32 words
    q_stride_h,  # in int32 words
    kv_stride,  # in elements
    tab_stride,
    page_stride,  # bytes between pages
    block_size,  # tokens per page
    eps,
    HPP: tl.constexpr,  # query heads per program (a power of two)
    DO_Q: tl.constexpr,  # False: skip the Q programs (the benchmark of the unfused passes)
    DO_KV: tl.constexpr,
):
    # 1-D grid of T·(NG + 1) programs, NG = cdiv(H, HPP): program t·(NG + 1) + g handles heads
    # [g·HPP, g·HPP + HPP) of token t for g < NG and token t's KV row for g = NG. The head group varies
    # fastest, so consecutive programs walk q in address order.
    pid = tl.program_id(0)
    t = pid // (NG + 1)
    g = pid % (NG + 1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    trow = tab_ptr + pos * tab_stride

    if g < NG:
        if DO_Q:
            # ---- Q program: an [HPP, 8, 32] tile of int32 words = HPP heads × 512 bf16 dims --------
            # Word (k, i) of a head is dims (64k + 2i, 64k + 2i + 1); chunk k = 7 is the RoPE slice and
            # there word i IS rotary pair i: its two halves are e and o, so no partner is re-loaded.
            hh = g * HPP + tl.arange(0, HPP)
            k = tl.arange(0, _CHUNKS)
            i = tl.arange(0, _HALF)
            hmask = (hh < H)[:, None, None] & (k >= 0)[None, :, None] & (i >= 0)[None, None, :]
            word = (
                t.to(tl.int64) * q_stride_t
                + hh.to(tl.int64)[:, None, None] * q_stride_h
                + (k * _HALF)[None, :, None]
                + i[None, None, :]
            )
            # the table row, loaded in the tile's own shape (the same register layout as w, so no shuffle
            # through shared memory); only the chunk-7 lanes read, each (c_i, s_i) once per head from L1
            rope = (k == _CHUNKS - 1)[None, :, None]
            tab_ok = hmask & rope
            c = tl.load(trow + 0 * word + i[None, None, :], mask=tab_ok, other=0.0)
            s = tl.load(trow + 0 * word + _HALF + i[None, None, :], mask=tab_ok, other=0.0)
            w = tl.load(q_ptr + word, mask=hmask, other=0)
            lo = (w << 16).to(tl.float32, bitcast=True)  # even dim: the low half, widened
            hi = (w & -65536).to(tl.float32, bitcast=True)  # odd dim: the high half (0xFFFF0000)
            # weight-free RMSNorm per head: fp64 sum of exact squares (order-free), as the per-head kernel
            # of the bf16 squares, each op rounded to bf16 as DeepSeek's bf16 tensor ops
            sq = bf16_round_nan(lo * lo).to(tl.float64) + bf16_round_nan(hi * hi).to(tl.float64)
            ss = tl.sum(tl.sum(sq, axis=2, keep_dims=True), axis=1, keep_dims=True).to(tl.float32)  # [HPP, 1, 1]
            m = bf16_round_nan(bf16_round_nan(ss * _INV_D) + eps)  # kept dims: no layout change
            rr = bf16_round_nan(tl.math.div_rn(1.0, tl.math.sqrt_rn(m)))
            e = bf16_round_nan(lo * rr)
            o = bf16_round_nan(hi * rr)
            # RoPE on chunk 7: e·c − o·s and e·s + o·c, separately rounded products (no FMA)
            y_lo = tl.where(rope, e * c - o * s, e)
            y_hi = tl.where(rope, e * s + o * c, o)
            packed = bf16_rne_bits_nan(y_lo).to(tl.uint32) | (bf16_rne_bits_nan(y_hi).to(tl.uint32) << 16)
            tl.store(q_ptr + word, packed.to(tl.int32, bitcast=True), mask=hmask)
    else:
        if DO_KV:
            _kv_program(kv_ptr, cache_ptr, slot_ptr, t, n_slots, trow, kv_stride, page_stride, block_size)


@triton.jit
def qnorm_rope_kv_insert_kernel(
    q_ptr,  # int16 view of q [T, H, 512] bf16 (last dim contiguous), updated in place
    kv_ptr,  # int16 view of kv [T, 512] bf16 (last dim contiguous)
    cache_ptr,  # uint8 pages, page p at p * page_stride (the 584-B record layout, docs/formats.md)
    slot_ptr,  # int64 [n_slots] (n_slots <= T), contiguous; −1 = write nothing
    pos_ptr,  # int64 [T], contiguous
    tab_ptr,  # fp32 [max_pos, 64] cos/sin table, row stride tab_stride
    H,  # query heads; program (t, H) is token t's KV program
    n_slots,
    q_stride_t,  # in elements
    q_stride_h,
    kv_stride,
    tab_stride,
    page_stride,  # bytes between pages
    block_size,  # tokens per page
    eps,
    DO_Q: tl.constexpr,  # False: skip the Q programs (the benchmark of the unfused passes)
    DO_KV: tl.constexpr,
):
    # grid (T, H + 1): program (t, h < H) is query head h of token t, program (t, H) token t's KV row
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    trow = tab_ptr + pos * tab_stride

    if h < H:
        if DO_Q:
            # ---- Q program: one head, all 512 dims as one vector --------------------------------------
            d = tl.arange(0, _D)
            head = q_ptr + t.to(tl.int64) * q_stride_t + h.to(tl.int64) * q_stride_h
            x = ((tl.load(head + d).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
            # weight-free RMSNorm as DeepSeek's bf16 tensor ops, each rounded to bf16: the squares, their
            # mean (an fp64 sum, order-free), + eps, the rsqrt (correctly rounded sqrt and div), q·rsqrt
            ss = tl.sum(bf16_round_nan(x * x).to(tl.float64), axis=0).to(tl.float32)
            rr = bf16_round_nan(tl.math.div_rn(1.0, tl.math.sqrt_rn(bf16_round_nan(bf16_round_nan(ss * _INV_D) + eps))))
            xn = bf16_round_nan(x * rr)
            # RoPE on dims 448..511: the pair partner of d is d ^ 1 (re-loaded; it is in L1 already)
            is_rope = d >= _NOPE
            i = tl.where(is_rope, (d - _NOPE) // 2, 0)
            c = tl.load(trow + i, mask=is_rope, other=1.0)
            s = tl.load(trow + _HALF + i, mask=is_rope, other=0.0)
            partner = bf16_round_nan(((tl.load(head + (d ^ 1)).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True) * rr)
            # even dims subtract: compiled Triton negates −(v) as 0 − v, so x·c + (−(+0)) would give +0 where
            # the reference's x·c − y·s gives −0 (seen on the H200 with a zeroed row)
            rot = tl.where(d % 2 == 0, xn * c - partner * s, xn * c + partner * s)
            y = tl.where(is_rope, rot, xn)
            tl.store(head + d, bf16_rne_bits_nan(y).to(tl.int16, bitcast=True))
    else:
        if DO_KV:
            _kv_program(kv_ptr, cache_ptr, slot_ptr, t, n_slots, trow, kv_stride, page_stride, block_size)
