"""The lightning indexer's Triton kernels (the math: ``docs/indexer.md``; the torch twin: ``reference.py``).

* :func:`quantize_kernel` — RoPE + bf16 round trip + Hadamard + FP8 / MXFP4 quantisation of a tile of
  128-wide rows; the same kernel quantises indexer queries (with the weight fold), bare keys, and keys
  written straight into the paged K cache.
* :func:`logits_kernel` — I[t, s] = Σ_h w_out[t, h]·ReLU(⟨q[t, h], k_s⟩)·k_scale_s over a paged cache,
  −∞ for s ≥ (p+1)//4.

Launches (grids, launch choices, custom ops) live in ``launch.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import FP4_AMAX_FLOOR, FP4_MAX, INDEX_AMAX_FLOOR
from ..tl import (
    bf16_round_nan,
    canonical_nan,
    dot,
    e4m3_decode,
    e4m3_ue8m0_blocks,
    inv_pow2,
    nonfinite,
    pow2,
    ue8m0_byte,
    ue8m0_value,
)

FP8_FLOOR: tl.constexpr = tl.constexpr(INDEX_AMAX_FLOOR)
FP4_FLOOR: tl.constexpr = tl.constexpr(FP4_AMAX_FLOOR)  # 6·2^-126
FP4_QMAX: tl.constexpr = tl.constexpr(FP4_MAX)
F16_UNDO: tl.constexpr = tl.constexpr(2.0**28)  # e2m1_f16 values carry 2^-14 on each side of a product
# f16_scaled: block scales relative to the vector's largest, inside the fp16 operands (fp4_q_scaled, fp4_k_scaled)
Q_SHIFT: tl.constexpr = tl.constexpr(13)  # q values e2m1·2^(d + 13): 6·2^13 = 49 152 is the top of fp16's range
Q_SPAN: tl.constexpr = tl.constexpr(36)  # d >= -36: 0.5·2^-23 = 2^-24 is fp16's smallest subnormal
K_SHIFT: tl.constexpr = tl.constexpr(1)  # k values e2m1·2^(d + 1): the factor 2^(15 + d) must itself be an fp16
K_SPAN: tl.constexpr = tl.constexpr(24)  # d >= -24: 0.5·2^-23 again
SCALED_LO: tl.constexpr = tl.constexpr(64)  # largest byte of a vector in [64, 190] (2^-63 .. 2^63): every
SCALED_HI: tl.constexpr = tl.constexpr(190)  # fp32 factor and partial sum of the fast path is a normal number


# ----------------------------------------------------------------------------------------------------
# Hadamard, E2M1
#
#   H_128 = 7 butterfly stages: for h = 1, 2, …, 64 replace each pair (a, b) at distance h inside each
#   2h-block by (a+b, a−b); then × 128^-½.
#   E2M1 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}: saturate at 6, round to nearest, ties to the even code;
#   sign = bit 3.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def butterfly(x, ROWS: tl.constexpr, N: tl.constexpr, HALF: tl.constexpr):
    """One Hadamard stage on each row of x [ROWS, N] fp32: pairs (a, b) at distance HALF -> (a+b, a−b)."""
    y = tl.permute(tl.reshape(x, (ROWS, N // (2 * HALF), 2, HALF)), (0, 1, 3, 2))
    a, b = tl.split(y)
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(y, (ROWS, N))


@triton.jit
def hadamard128(x, ROWS: tl.constexpr, had_scale):
    """H_128 · had_scale applied to each row of x [ROWS, 128] fp32."""
    x = butterfly(x, ROWS, 128, 1)
    x = butterfly(x, ROWS, 128, 2)
    x = butterfly(x, ROWS, 128, 4)
    x = butterfly(x, ROWS, 128, 8)
    x = butterfly(x, ROWS, 128, 16)
    x = butterfly(x, ROWS, 128, 32)
    x = butterfly(x, ROWS, 128, 64)
    return x * had_scale


@triton.jit
def e2m1_codes(y):
    """fp32 -> int32 E2M1 codes: clamp ±6, RNE by grid-snap (spacing 0.5 below 2, 1 below 4, 2 above)."""
    a = tl.minimum(tl.abs(y), 6.0)
    c = tl.where(a < 2.0, 4194304.0, tl.where(a < 4.0, 8388608.0, 16777216.0))  # 2^22, 2^23, 2^24
    v = (a + c) - c  # the fp32 adder rounds half-to-even onto the grid; even multiple = even code
    code = tl.where(v < 2.0, v * 2.0, tl.where(v < 4.0, v + 2.0, v * 0.5 + 4.0)).to(tl.int32)
    neg = (y.to(tl.int32, bitcast=True) < 0).to(tl.int32)  # sign bit: −0.1 → 0b1000
    return code | (neg << 3)


@triton.jit
def e2m1_value(code):
    """int32 E2M1 code -> fp32 value, from bits (exact): the per-nibble decode of ``fp4_decode="nibble"``."""
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)  # (1 + m/2)·2^(e-1)
    v = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def e2m1_f16(b, HI: tl.constexpr):
    """Packed e2m1 bytes (int32) -> fp16 ``value(code) · 2^-14`` of the low (even dim) or high (odd dim) nibble,
    from integer shifts alone: no float arithmetic, no conversion instruction.

    The three magnitude bits ``e1 e0 m`` are moved to the top of fp16's exponent and mantissa fields (exponent
    = e, mantissa = m·2^9) and the sign bit to bit 15. For e >= 1 that is (1 + m/2)·2^(e−15) = value·2^-14; code
    1 lands on the fp16 subnormal 2^-15 = 0.5·2^-14 and code 0 on zero. Exact for all 16 codes."""
    if HI:
        bits = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    else:
        bits = ((b & 0x07) << 9) | ((b & 0x08) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def e4m3_value(byte, NAN_FIX: tl.constexpr):
    """e4m3 bytes (uint8) -> fp32 in the logits' hot loop. ``NAN_FIX`` (set when interpreting) goes through
    :func:`dsv4ref.tl.e4m3_decode`, whose select makes 0x7F / 0xFF NaN (the interpreter reads them as ±480);
    compiled, the plain cast already gives NaN, so the FP8 kernel does not pay for the select."""
    if NAN_FIX:
        v = e4m3_decode(byte)
    else:
        v = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return v


@triton.jit
def relu_nan(x):
    """max(x, 0) that keeps NaN (compiled, tl.maximum would return 0 for a NaN: a NaN score must stay NaN)."""
    return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)


# ----------------------------------------------------------------------------------------------------
# the fused quantiser (indexer Q, indexer K, and the paged K writer share it)
#
#   x      = bf16 row (128 dims)
#   ROPE:  x[64+2i], x[64+2i+1] = e·c_i − o·s_i, e·s_i + o·c_i;  x = fp32(bf16(x))
#   HADAMARD: x = fp32(bf16(H_128 · x · 128^-½))          DeepSeek's rotate_activation returns bf16
#   FP8:   e = ⌈log2(max(amax, 1e-4)/448)⌉, codes = e4m3(x·2^-e);  Q: w_out = (w·2^e)·fold;  K: scale = 2^e
#   FP4:   per 32-block b: e_b = ⌈log2(max(amax_b, 6·2^-126)/6)⌉, codes = e2m1(x·2^-e_b); bytes e_b+127
#   NON-FINITE (checks off; docs/indexer.md#non-finite-input): NaNs are made 0x7FC00000 first; a block
#          holding NaN/±inf gets scale byte 255 (fp8 K: the fp32 scale NaN; fp8 Q: w_out NaN) and codes
#          0x7F / 0x7 (e4m3 NaN, e2m1 max magnitude), with the sign bit where the value's sign bit is set
#   PAGED: row r goes to slot[r] (−1: skip): values at page·q_page_stride + off·V, scales after B·V
# ----------------------------------------------------------------------------------------------------


@triton.jit
def quantize_kernel(
    x_ptr,  # int16 view of bf16 rows [n_rows, 128] (contiguous); row r = t·H + h
    pos_ptr,  # int64 [T] positions (ROPE only)
    cs_ptr,  # fp32 [max_pos, 64] cos/sin table, rows [cos 0..31 | sin 0..31] (ROPE only)
    w_ptr,  # fp32 [n_rows] head weights (HAS_W only)
    slot_ptr,  # int64 [n_rows] destination slots, −1 = skip (PAGED only)
    q_ptr,  # uint8 destination of the codes (128 e4m3 bytes or 64 packed bytes per row)
    s_ptr,  # scale destination: fp32 2^e (FP8) or uint8 bytes (FP4, 4 per row)
    wo_ptr,  # fp32 [n_rows] folded weights (HAS_W only)
    n_rows,
    H,  # heads per token (row r belongs to token r // H)
    block_size,  # rows per page (1 when not PAGED)
    q_page_stride,  # elements of q_ptr per page
    s_page_stride,  # elements of s_ptr per page
    fold,  # fp32: 128^-½ · H^-½
    had_scale,  # fp32: 128^-½
    ROWS: tl.constexpr,  # rows per program
    ROPE: tl.constexpr,
    HADAMARD: tl.constexpr,
    FP4: tl.constexpr,
    HAS_W: tl.constexpr,
    PAGED: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, 128)
    row_ok = rows < n_rows
    ok = row_ok[:, None] & (d[None, :] >= 0)
    src = x_ptr + rows[:, None] * 128 + d[None, :]
    # bf16 -> fp32 exactly, in integers (docs/triton_interpreter.md)
    x = ((tl.load(src, mask=ok, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    if ROPE:
        rot = (d >= 64)[None, :] & ok
        # the pair partner of dim d is d ^ 1; load it again rather than shuffling registers
        xp = ((tl.load(x_ptr + rows[:, None] * 128 + (d[None, :] ^ 1), mask=rot, other=0).to(tl.int32) & 0xFFFF) << 16).to(
            tl.float32, bitcast=True
        )
        pos = tl.load(pos_ptr + rows // H, mask=row_ok, other=0).to(tl.int64)
        i = tl.maximum(d - 64, 0) >> 1
        c = tl.load(cs_ptr + pos[:, None] * 64 + i[None, :], mask=rot, other=1.0)
        s = tl.load(cs_ptr + pos[:, None] * 64 + 32 + i[None, :], mask=rot, other=0.0)
        even = (d & 1) == 0
        r_even = x * c - xp * s  # e·c − o·s   (x = e, xp = o)
        r_odd = xp * s + x * c  # e·s + o·c   (xp = e, x = o): same products, same order of the add
        x = tl.where(rot, tl.where(even[None, :], r_even, r_odd), x)
        # the bf16 round trip (identity on dims 0..63, which are bf16 already); NaN made quiet first, since
        # compiled NaNs are 0x7FFFFFFF, which the rounding add would carry into -0.0
        x = bf16_round_nan(x)
    if HADAMARD:
        x = bf16_round_nan(hadamard128(x, ROWS, had_scale))  # bf16, as DeepSeek's rotate_activation returns it
    x = canonical_nan(x)  # NaN payloads and signs differ per device; the NaN bytes below must not

    if PAGED:
        slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
        row_ok = row_ok & (slot >= 0)
        slot = tl.maximum(slot, 0)
    else:
        slot = rows
    page = slot // block_size
    off = slot % block_size

    if FP4:
        xb = tl.reshape(x, (ROWS, 4, 32))
        bad = tl.max(nonfinite(xb).to(tl.int32), axis=2) != 0  # [ROWS, 4]
        fin = tl.where(nonfinite(xb), 0.0, xb)  # encode finite stand-ins; bad blocks are overwritten below
        byte = ue8m0_byte(tl.max(tl.abs(fin), axis=2), FP4_FLOOR, FP4_QMAX)  # [ROWS, 4]
        codes = e2m1_codes(fin * inv_pow2(byte)[:, :, None])
        nan_codes = 7 | ((xb.to(tl.int32, bitcast=True) >> 28) & 8)  # max magnitude, the value's sign bit
        codes = tl.reshape(tl.where(bad[:, :, None], nan_codes, codes), (ROWS, 64, 2))
        byte = tl.where(bad, 255, byte)
        lo, hi = tl.split(codes)
        j = tl.arange(0, 64)
        qdst = q_ptr + page[:, None] * q_page_stride + off[:, None] * 64 + j[None, :]
        tl.store(qdst, (lo | (hi << 4)).to(tl.uint8), mask=row_ok[:, None] & (j[None, :] >= 0))
        b = tl.arange(0, 4)
        sdst = s_ptr + page[:, None] * s_page_stride + off[:, None] * 4 + b[None, :]
        tl.store(sdst, byte.to(tl.uint8), mask=row_ok[:, None] & (b[None, :] >= 0))
        if HAS_W:
            w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
            tl.store(wo_ptr + rows, bf16_round_nan(w * fold), mask=row_ok)  # no q-scale fold; bf16 as DeepSeek
    else:
        q, byte = e4m3_ue8m0_blocks(x, FP8_FLOOR, 1)  # [ROWS, 128] bytes, [ROWS] scale bytes (255: NaN row)
        qdst = q_ptr + page[:, None] * q_page_stride + off[:, None] * 128 + d[None, :]
        tl.store(qdst, q, mask=row_ok[:, None] & (d[None, :] >= 0))
        if HAS_W:
            w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
            # w·2^e exact, then one rounding; a NaN row (byte 255) gives w_out NaN
            tl.store(wo_ptr + rows, canonical_nan((w * ue8m0_value(byte)) * fold), mask=row_ok)
        else:
            tl.store(s_ptr + page * s_page_stride + off, ue8m0_value(byte), mask=row_ok)  # K: fp32 2^e (or NaN)


# ----------------------------------------------------------------------------------------------------
# logits
#
#   n_c = (p_t + 1) // 4
#   I[t, s] = Σ_h w_out[t, h] · ReLU(⟨q[t, h], k_s⟩) · k_scale_s      s < n_c
#           = −∞                                                     otherwise
#   key s of token t: page block_table[t, s // BC], offset s % BC; one [BC × 128]·[128 × HP] dot per page
#   NaN in, NaN out: a NaN code, scale or weight makes that score NaN (ReLU keeps NaN) on every backend
#
#   MXFP4, three decodes of the packed keys (IndexerLaunch.fp4_decode):
#   nibble      unpack the two nibbles, decode each code to fp32 from its bits, × 2^(byte−127) per 32-block,
#               interleave back to [BC, 128], bf16, one dot.  ~17 ALU ops and two conversions per value.
#   f16_blocks  per 32-block b and nibble half: fp16 bits straight from the byte (e2m1_f16: value·2^-14,
#               3 integer ops, no conversion), a [BC × 16]·[16 × HP] fp16 dot; the block's scales are applied
#               to the [BC, HP] partial sum instead: Σ_b (acc_b · ks_b ⊗ qs_b), and the 2^28 goes into w.
#               8 dots (each waited for) and 4 × [BC × HP] scale products per page.
#   f16_scaled  each vector's block scales RELATIVE to its largest byte ride in the fp16 operands:
#                 k[s, d] = e2m1 · 2^(byte_b − top_s + 1),   q[h, d] = e2m1 · 2^(byte_b − top_h + 13)
#               (keys: e2m1_f16_pairs builds a byte's two fp16 values in 4 integer ops, one fp16 multiply
#               applies the block's power of two), so a page is ONE [BC × 128]·[128 × HP] dot, and
#               I[t, s] = 2^(top_s − 128) · Σ_h (w_h · 2^(top_h − 140)) · ReLU(acc[s, h]).
#               Exact while every key's bytes span <= 24, every head's <= 36 and every largest byte is in
#               [64, 190]; a program whose bytes leave that range runs the f16_blocks arithmetic instead.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def fp4_q_block(q_ptr, qs_ptr, row, hmask, B: tl.constexpr):
    """The token's queries of 32-block ``B`` for ``f16_blocks``: ``(lo [16, HP], hi [16, HP])`` fp16 (even and
    odd dims of the block, value·2^-14, transposed as the dot's B operand) and their scales ``[HP]`` fp32."""
    c = tl.arange(0, 16)
    qb = tl.load(q_ptr + row[:, None] * 64 + B * 16 + c[None, :], mask=hmask[:, None], other=0).to(tl.int32)
    qs = ue8m0_value(tl.load(qs_ptr + row * 4 + B, mask=hmask, other=127))
    return tl.trans(e2m1_f16(qb, False)), tl.trans(e2m1_f16(qb, True)), qs


@triton.jit
def fp4_k_block(s, kptr, sptr, live, qlo, qhi, qs, B: tl.constexpr, DOT_FP32: tl.constexpr):
    """``s + ⟨k_b, q_b⟩ · ks_b ⊗ qs_b`` for 32-block ``B`` of a page of keys (``f16_blocks``).

    ``kptr`` [BCP, 16]: each key's first packed byte (+ c); ``sptr`` [BCP]: each key's first scale byte."""
    kb = tl.load(kptr + B * 16, mask=live[:, None], other=0).to(tl.int32)
    ks = ue8m0_value(tl.load(sptr + B, mask=live, other=127))
    acc = dot(e2m1_f16(kb, False), qlo, tl.zeros((kb.shape[0], qs.shape[0]), tl.float32), DOT_FP32)
    acc = dot(e2m1_f16(kb, True), qhi, acc, DOT_FP32)  # exact: ≤ 32 products of small multiples of 2^-30
    return s + acc * (ks[:, None] * qs[None, :])


@triton.jit
def e2m1_f16_pairs(b):
    """Packed e2m1 bytes (0..255, any integer type) -> uint32 holding two fp16 ``value · 2^-14``: the low nibble's in bits
    0..15 (the even dim), the high nibble's in bits 16..31 (the odd dim), as :func:`e2m1_f16` builds them one
    at a time, in 4 integer operations per byte instead of 8:

        u = (b · 0x00200200) & 0x1E001E00    the byte at bits 9.. and 21.. (no overlap, so · is two shifts);
                                             keep the low nibble at 9..12 and the high one at 25..28
        (u | u << 3) & 0x8E008E00            magnitude bits stay at 9..11 / 25..27, each sign bit moves 3 up
                                             to 15 / 31; the copies that land elsewhere are masked off"""
    u = (b.to(tl.uint32) * 0x00200200) & 0x1E001E00
    return (u | (u << 3)) & 0x8E008E00


@triton.jit
def f16_halves(pairs, INTERPRET: tl.constexpr):
    """uint32 [..., N] of :func:`e2m1_f16_pairs` -> fp16 [..., N, 2] (the low half first), bits unchanged.

    Compiled, one PTX ``mov.b32 {lo, hi}, pair``: the two halves are named where they are, so ptxas multiplies
    the pair with one HMUL2 and hands the register to the tensor core as it is. Written as integer truncations
    instead, ptxas re-packs every pair twice (2 PRMT per byte). The
    interpreter cannot run PTX and takes the integer form, which gives the same bits."""
    if INTERPRET:
        lo = pairs.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        lo, hi = tl.inline_asm_elementwise(
            "mov.b32 {$0, $1}, $2;", "=h,=h,r", [pairs], dtype=(tl.float16, tl.float16), is_pure=True, pack=1
        )
    return tl.join(lo, hi)


@triton.jit
def dot_order(x, ROWS: tl.constexpr):
    """[ROWS, 4, 16, 2] values (32-block, byte of the block, nibble) -> [ROWS, 128] in the dot's K order.

    Any order of the 128 dims gives the same dot product as long as q and k use the same one. This one puts
    the 16 bytes of a 32-block where one thread of the tensor-core operand layout holds them (a thread holds
    bytes c and c + 4 of every 8 along K), so a thread's bytes are 16 contiguous bytes of memory, all of one
    block (one scale per key), instead of 2-byte pieces of every block."""
    x = tl.reshape(x, (ROWS, 4, 8, 2, 2))
    return tl.reshape(tl.permute(x, (0, 2, 3, 1, 4)), (ROWS, 128))


@triton.jit
def fp4_q_scaled(q_ptr, qs_ptr, row, hmask, HP: tl.constexpr, INTERPRET: tl.constexpr):
    """The token's queries for ``f16_scaled``: ``(qT [128, HP] fp16 in :func:`dot_order`, top [HP] int32,
    ok [HP] bool)``.

    Head h's values are ``e2m1 · 2^(byte_b − top_h + Q_SHIFT)`` per 32-block b, with ``top_h`` its largest
    scale byte: the block scales RELATIVE to the head's largest ride inside the fp16 operand, so one dot over
    all 128 dims needs no per-block scale product; ``2^(top_h − 127 − Q_SHIFT)`` goes into the head's weight
    instead. Exact in fp16 while the head's bytes span at most ``Q_SPAN``; ``ok`` says so, and that ``top_h``
    is in [SCALED_LO, SCALED_HI]."""
    pb = tl.arange(0, 64)
    qb = tl.load(q_ptr + row[:, None] * 64 + pb[None, :], mask=hmask[:, None], other=0)
    qsb = tl.load(qs_ptr + row[:, None] * 4 + tl.arange(0, 4)[None, :], mask=hmask[:, None], other=127).to(tl.int32)
    top = tl.max(qsb, axis=1)
    ok = (top - tl.min(qsb, axis=1) <= Q_SPAN) & (top >= SCALED_LO) & (top <= SCALED_HI)
    # 2^(byte − top + Q_SHIFT): an fp32 power of two, exact in fp16 down to its subnormal 2^-24 (d >= -37)
    rel = pow2(tl.maximum(qsb - top[:, None] + (127 + Q_SHIFT), 1)).to(tl.float16)
    # the keys' integer decode (e2m1 · 2^-14), × 2^14 and × rel: two exact fp16 multiplies per pair of values
    qv = tl.reshape(f16_halves(e2m1_f16_pairs(qb), INTERPRET), (HP, 4, 16, 2)) * 16384.0
    return tl.trans(dot_order(qv * rel[:, :, None, None], HP)), top, ok


@triton.jit
def fp4_k_scaled(kb, ksb, BCP: tl.constexpr, INTERPRET: tl.constexpr):
    """A page of keys for ``f16_scaled``: ``(kv [BCP, 128] fp16 in :func:`dot_order`, top [BCP] int32,
    ok [BCP] bool)`` from the packed bytes ``kb`` [BCP, 64] and the scale bytes ``ksb`` [BCP, 4] (int32).

    ``kv = e2m1 · 2^(byte_b − top_s + K_SHIFT)``: :func:`e2m1_f16_pairs` (e2m1·2^-14, integer operations)
    times the fp16 power of two ``2^(14 + byte_b − top_s + K_SHIFT)``: one fp16 multiply per two values, exact
    while the key's bytes span at most ``K_SPAN``. ``2^(top_s − 127 − K_SHIFT)`` is applied to the key's
    score after the head sum."""
    top = tl.max(ksb, axis=1)
    ok = (top - tl.min(ksb, axis=1) <= K_SPAN) & (top >= SCALED_LO) & (top <= SCALED_HI)
    f = ((tl.maximum(ksb - top[:, None] + (29 + K_SHIFT), 1) << 10).to(tl.int16)).to(tl.float16, bitcast=True)
    kv = dot_order(tl.reshape(f16_halves(e2m1_f16_pairs(kb), INTERPRET), (BCP, 4, 16, 2)), BCP)
    fk = tl.reshape(tl.broadcast_to(f[:, None, :, None], (BCP, 16, 4, 2)), (BCP, 128))  # block (k // 2) % 4
    return kv * fk, top, ok


@triton.jit
def fp4_pages_fast(cache_ptr, page, blk, page_stride, n_c, BC: tl.constexpr, BCP: tl.constexpr):
    """True when every live key of this program's pages (``page``, ``blk``: [PAGES] page ids and their block
    numbers) has scale bytes that :func:`fp4_k_scaled` folds exactly (span <= K_SPAN, largest in [SCALED_LO,
    SCALED_HI]): one look at the program's 4·BC·PAGES scale bytes before its first page, so that the page loop
    that follows carries no branch."""
    j = tl.arange(0, BCP)
    live = (j < BC)[None, :] & (blk[:, None] * BC + j[None, :] < n_c)  # [PAGES, BCP]
    sb = tl.load(
        cache_ptr + page[:, None, None] * page_stride + BC * 64 + j[None, :, None] * 4 + tl.arange(0, 4)[None, None, :],
        mask=live[:, :, None],
        other=127,
    ).to(tl.int32)
    top = tl.max(sb, axis=2)
    bad = (top - tl.min(sb, axis=2) > K_SPAN) | (top < SCALED_LO) | (top > SCALED_HI)
    return tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) == 0


@triton.jit
def fp4_scale_bytes(cache_ptr, srow, live):
    """The scale bytes of a tile of keys, [TILE, 4] int32 (127 for the keys that are not read); ``srow`` [TILE]:
    each key's first scale byte."""
    return tl.load(cache_ptr + srow[:, None] + tl.arange(0, 4)[None, :], mask=live[:, None], other=127).to(tl.int32)


@triton.jit
def fp4_scaled_tile(cache_ptr, krow, live, ksb, qT, w_fast, DOT_FP32: tl.constexpr):
    """A tile of keys' logits [TILE] by ``f16_scaled``'s fast path: one [TILE × 128]·[128 × HP] fp16 dot.
    ``krow`` [TILE]: each key's first packed byte; ``ksb``: the tile's scale bytes (:func:`fp4_scale_bytes`),
    loaded one tile ahead by the caller."""
    kb = tl.load(cache_ptr + krow[:, None] + tl.arange(0, 64)[None, :], mask=live[:, None], other=0)
    kv, ktop, _ = fp4_k_scaled(kb, ksb, krow.shape[0], DOT_FP32)
    s = dot(kv, qT, tl.zeros((krow.shape[0], qT.shape[1]), tl.float32), DOT_FP32)  # [TILE, HP], all 128 dims
    return head_sum(s, w_fast, True) * pow2(tl.maximum(ktop - K_SHIFT, 1))  # × 2^(top − 127 − K_SHIFT) per key


@triton.jit
def fp4_blocks_page(
    cache_ptr,
    base,
    j,
    live,
    q_ptr,
    qs_ptr,
    row,
    hmask,
    w,
    BC: tl.constexpr,
    BCP: tl.constexpr,
    HP: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One page's logits [BCP] by the ``f16_blocks`` arithmetic (the same products, the same order), with the
    token's query blocks loaded here, one 32-block at a time: ``f16_scaled``'s exact fallback for a program
    whose scale bytes leave the fast path's range. Rare, so written for few live registers, not for speed."""
    c = tl.arange(0, 16)
    s = tl.zeros((BCP, HP), tl.float32)
    for b in tl.range(4, num_stages=1):  # no software pipelining: fewer live registers
        qb = tl.load(q_ptr + row[:, None] * 64 + b * 16 + c[None, :], mask=hmask[:, None], other=0).to(tl.int32)
        qs = ue8m0_value(tl.load(qs_ptr + row * 4 + b, mask=hmask, other=127))
        kb = tl.load(cache_ptr + base + j[:, None] * 64 + b * 16 + c[None, :], mask=live[:, None], other=0).to(tl.int32)
        ks = ue8m0_value(tl.load(cache_ptr + base + BC * 64 + j * 4 + b, mask=live, other=127))
        acc = dot(e2m1_f16(kb, False), tl.trans(e2m1_f16(qb, False)), tl.zeros((BCP, HP), tl.float32), DOT_FP32)
        acc = dot(e2m1_f16(kb, True), tl.trans(e2m1_f16(qb, True)), acc, DOT_FP32)
        s = s + acc * (ks[:, None] * qs[None, :])
    return head_sum(s, w * F16_UNDO, True)


@triton.jit
def head_sum(s, w, BF16: tl.constexpr):
    """Σ_h w[h] · ReLU(s[:, h]) for scores s [BCP, HP]: the ReLU per head, BEFORE the weighted head sum. ``BF16``
    (MXFP4, DeepSeek's bf16 einsum): each head's dot, each product and the sum rounded to bf16 (a power-of-two
    factor riding in s or w, as the fp16 decodes carry, commutes with these roundings)."""
    if BF16:
        r = bf16_round_nan(relu_nan(s))
        return bf16_round_nan(tl.sum(bf16_round_nan(r * w[None, :]), axis=1))
    return tl.sum(relu_nan(s) * w[None, :], axis=1)


@triton.jit
def page_rows(bt_ptr, t, bt_stride, page_stride, n_c, p, BC: tl.constexpr, BCP: tl.constexpr, PAGES: tl.constexpr):
    """Page ``p`` of this program: ``(cols [BCP] local key ids, live [BCP], base)`` (base: the page's first byte)."""
    j = tl.arange(0, BCP)
    blk = tl.program_id(1).to(tl.int64) * PAGES + p
    cols = blk * BC + j
    page = tl.load(bt_ptr + t * bt_stride + blk, mask=blk * BC < n_c, other=0).to(tl.int64)
    return cols, (j < BC) & (cols < n_c), page * page_stride


@triton.jit
def tile_rows(page, page_stride, n_c, it, BC: tl.constexpr, BCP: tl.constexpr, PAGES: tl.constexpr, TP: tl.constexpr):
    """Tile ``it`` of this program: its ``TP`` pages' rows stacked, ``TP·BCP`` keys (one dot's rows), from the
    program's page ids ``page`` [PAGES] loaded before the loop, so that no load in the loop waits for another
    to learn its address. Returns ``(cols, valid, live, krow, srow)`` [TILE]: local key ids, rows that are keys
    of a page (offset < BC), rows the token sees, each key's first packed byte and first scale byte."""
    jt = tl.arange(0, TP * BCP)
    off = jt % BCP
    slot = jt // BCP  # which of the tile's pages (0 when TP = 1)
    base = tl.zeros((TP * BCP,), tl.int64)
    for k in tl.static_range(TP):
        this = tl.sum(tl.where(tl.arange(0, PAGES) == it * TP + k, page, 0), axis=0)
        base = tl.where(slot == k, this * page_stride, base)
    cols = (tl.program_id(1).to(tl.int64) * PAGES + it * TP + slot) * BC + off
    valid = off < BC
    return cols, valid, valid & (cols < n_c), base + off * 64, base + BC * 64 + off * 4


@triton.jit
def store_logits(out_ptr, t, n_out, cols, valid, live, logit):
    """Write a page's (a tile's) logits, −∞ for the keys the token cannot see (s >= n_c); ``valid``: the rows
    that are keys (offset in the page < BC)."""
    tl.store(out_ptr + t * n_out + cols, tl.where(live, logit, float("-inf")), mask=valid & (cols < n_out))


@triton.jit
def logits_kernel(
    q_ptr,  # uint8 [T, H, 128] e4m3 bytes (FP8) or [T, H, 64] packed e2m1 (FP4), contiguous
    qs_ptr,  # uint8 [T, H, 4] UE8M0 bytes (FP4 only)
    w_ptr,  # fp32 [T, H] weights_out, contiguous
    cache_ptr,  # uint8 indexer-K pages (page p at p·page_stride bytes)
    cache_f32_ptr,  # the same bytes viewed as fp32 (FP8 scales)
    cache_i32_ptr,  # the same bytes viewed as int32 (MXFP4 scale words, f16_scaled)
    bt_ptr,  # int32 or int64 [T, bt_stride] per-token block table (the token's request row)
    pos_ptr,  # int64 [T]
    out_ptr,  # fp32 [T, n_out], contiguous
    n_out,
    bt_stride,  # elements between block-table rows
    page_stride,  # bytes per page (a multiple of 4)
    H,
    HP: tl.constexpr,  # H padded to a power of two >= 16 (tl.dot needs M, N >= 16)
    BC: tl.constexpr,  # keys per page (block_size: any int >= 1)
    BCP: tl.constexpr,  # BC padded to a power of two >= 16 (the tile's rows)
    PAGES: tl.constexpr,  # pages per program
    TP: tl.constexpr,  # f16_scaled: pages per dot tile (TP·BCP rows), a power of two dividing PAGES
    FP4: tl.constexpr,
    FP4_DECODE: tl.constexpr,  # FP4 only: "nibble", "f16_blocks" or "f16_scaled" (IndexerLaunch.fp4_decode)
    DOT_FP32: tl.constexpr,  # the interpreter: fp32 operands (exact for these values), NaN codes decoded as NaN
):
    tl.static_assert(BCP >= 16)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)
    d = tl.arange(0, 128)
    j = tl.arange(0, BCP)
    hmask = h < H
    row = t * H + h
    n_c = (tl.load(pos_ptr + t).to(tl.int64) + 1) // 4
    w = tl.load(w_ptr + row, mask=hmask, other=0.0)  # padded heads weigh 0

    if FP4 and FP4_DECODE == "f16_scaled":
        # one dot per page when every scale byte of the token's queries and of the program's pages folds exactly;
        # otherwise (rare: a block 2^24 below its key's largest, a scale outside 2^±63) all its pages go the
        # f16_blocks way. Two loops, not a branch per page: a branch in the loop costs registers and pipelining.
        qT, qtop, qok = fp4_q_scaled(q_ptr, qs_ptr, row, hmask, HP, DOT_FP32)
        blk = tl.program_id(1).to(tl.int64) * PAGES + tl.arange(0, PAGES)
        page = tl.load(bt_ptr + t * bt_stride + blk, mask=blk * BC < n_c, other=0).to(tl.int64)  # [PAGES]
        fast = (tl.min(qok.to(tl.int32), axis=0) != 0) & fp4_pages_fast(cache_ptr, page, blk, page_stride, n_c, BC, BCP)
        if fast:
            w_fast = w * pow2(tl.maximum(qtop - Q_SHIFT, 1))  # w · 2^(top − 127 − Q_SHIFT) per head
            # tiles of TP pages (TP·BCP keys: the rows of one dot); the scale bytes are loaded a tile ahead by
            # hand: 2-byte loads are not among the ones the compiler prefetches (cp.async moves >= 4 bytes), and
            # a tile's decode cannot start without them
            cols, valid, live, krow, srow = tile_rows(page, page_stride, n_c, 0, BC, BCP, PAGES, TP)
            ksb = fp4_scale_bytes(cache_ptr, srow, live)
            for it in range(PAGES // TP):
                cols_n, valid_n, live_n, krow_n, srow_n = tile_rows(page, page_stride, n_c, it + 1, BC, BCP, PAGES, TP)
                ksb_n = fp4_scale_bytes(cache_ptr, srow_n, live_n & (it + 1 < PAGES // TP))
                logit = fp4_scaled_tile(cache_ptr, krow, live, ksb, qT, w_fast, DOT_FP32)
                store_logits(out_ptr, t, n_out, cols, valid, live, logit)
                cols, valid, live, krow, ksb = cols_n, valid_n, live_n, krow_n, ksb_n
        else:
            for p in tl.range(PAGES, num_stages=1):
                cols, live, base = page_rows(bt_ptr, t, bt_stride, page_stride, n_c, p, BC, BCP, PAGES)
                logit = fp4_blocks_page(cache_ptr, base, j, live, q_ptr, qs_ptr, row, hmask, w, BC, BCP, HP, DOT_FP32)
                store_logits(out_ptr, t, n_out, cols, j < BC, live, logit)
    else:
        # the token's queries, loaded once: [128, HP] (the B operand), or 4 blocks × 2 halves of [16, HP]
        if FP4:
            if FP4_DECODE == "f16_blocks":
                ql0, qh0, qs0 = fp4_q_block(q_ptr, qs_ptr, row, hmask, 0)
                ql1, qh1, qs1 = fp4_q_block(q_ptr, qs_ptr, row, hmask, 1)
                ql2, qh2, qs2 = fp4_q_block(q_ptr, qs_ptr, row, hmask, 2)
                ql3, qh3, qs3 = fp4_q_block(q_ptr, qs_ptr, row, hmask, 3)
                w = w * F16_UNDO  # both operands carry 2^-14: put the 2^28 back once, here
            else:
                pb = tl.arange(0, 64)
                qb = tl.load(q_ptr + row[:, None] * 64 + pb[None, :], mask=hmask[:, None], other=0).to(tl.int32)
                qc = tl.reshape(tl.join(qb & 15, qb >> 4), (HP, 128))  # low nibble = even dim
                qsb = tl.load(qs_ptr + row[:, None] * 4 + tl.arange(0, 4)[None, :], mask=hmask[:, None], other=127)
                qv = tl.reshape(tl.reshape(e2m1_value(qc), (HP, 4, 32)) * ue8m0_value(qsb)[:, :, None], (HP, 128))
                if not DOT_FP32:
                    qv = qv.to(tl.bfloat16)  # scaled e2m1 values are exact in bf16
                qT = tl.trans(qv)
        else:
            qv = e4m3_value(tl.load(q_ptr + row[:, None] * 128 + d[None, :], mask=hmask[:, None], other=0), DOT_FP32)
            if not DOT_FP32:
                qv = qv.to(tl.bfloat16)  # e4m3 values are exact in bf16
            qT = tl.trans(qv)

        for p in range(PAGES):
            cols, live, base = page_rows(bt_ptr, t, bt_stride, page_stride, n_c, p, BC, BCP, PAGES)
            kscale = tl.full((BCP,), 1.0, tl.float32)
            if FP4:
                if FP4_DECODE == "f16_blocks":
                    kptr = cache_ptr + base + j[:, None] * 64 + tl.arange(0, 16)[None, :]
                    sptr = cache_ptr + base + BC * 64 + j * 4
                    s = tl.zeros((BCP, HP), tl.float32)
                    s = fp4_k_block(s, kptr, sptr, live, ql0, qh0, qs0, 0, DOT_FP32)
                    s = fp4_k_block(s, kptr, sptr, live, ql1, qh1, qs1, 1, DOT_FP32)
                    s = fp4_k_block(s, kptr, sptr, live, ql2, qh2, qs2, 2, DOT_FP32)
                    s = fp4_k_block(s, kptr, sptr, live, ql3, qh3, qs3, 3, DOT_FP32)
                else:
                    kb = tl.load(cache_ptr + base + j[:, None] * 64 + tl.arange(0, 64)[None, :], mask=live[:, None], other=0).to(
                        tl.int32
                    )
                    kc = tl.reshape(tl.join(kb & 15, kb >> 4), (BCP, 128))
                    ksb = tl.load(
                        cache_ptr + base + BC * 64 + j[:, None] * 4 + tl.arange(0, 4)[None, :], mask=live[:, None], other=127
                    )
                    kv = tl.reshape(tl.reshape(e2m1_value(kc), (BCP, 4, 32)) * ue8m0_value(ksb)[:, :, None], (BCP, 128))
                    if not DOT_FP32:
                        kv = kv.to(tl.bfloat16)
                    s = dot(kv, qT, tl.zeros((BCP, HP), tl.float32), DOT_FP32)  # [BCP, HP] = ⟨k_s, q_h⟩
            else:
                kb = tl.load(cache_ptr + base + j[:, None] * 128 + d[None, :], mask=live[:, None], other=0)
                kv = e4m3_value(kb, DOT_FP32)
                kscale = tl.load(cache_f32_ptr + base // 4 + BC * 32 + j, mask=live, other=1.0)
                if not DOT_FP32:
                    kv = kv.to(tl.bfloat16)
                s = dot(kv, qT, tl.zeros((BCP, HP), tl.float32), DOT_FP32)  # [BCP, HP] = ⟨k_s, q_h⟩
            store_logits(out_ptr, t, n_out, cols, j < BC, live, head_sum(s, w, FP4) * kscale)
