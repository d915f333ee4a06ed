"""The sparse MLA decode kernels (Triton): the fused FP8 attention loop and the split merge.

What they compute is :func:`dsv4ref.sparse_mla.reference.decode` (math and conventions:
``docs/sparse_mla.md``). How they are launched: :mod:`dsv4ref.sparse_mla.launch`.

The fused kernel, one program per (token t, block of BLOCK_H heads, split sp of the candidate list)::

    q      = q[t, heads]                     [BLOCK_H, 512], resident for the whole loop (padding heads: 0)
    m, l   = −inf, 0                         running max and Σ 2^(s − m), log2 domain, per head
    acc    = 0                               [BLOCK_H, 512] fp32: running Σ 2^(s − m) · k
    for each pool, for each chunk of BLOCK_N entries of this split (entries past the length: −1):
        k  = the rows at the chunk's slots   [BLOCK_N, 512]: 7 tiles of 64 e4m3 × 2^(scale − 127) and one
                                             tile of 64 bf16 RoPE values, straight from the page bytes;
                                             masked loads (other = 0), so −1 reads nothing
        s  = q · kᵀ · scale · log2(e)        [BLOCK_H, BLOCK_N], −inf where the slot is −1
        online softmax update of (m, l, acc), the SAME tile k used as V: acc += p · k
    epilogue: out = acc / l · σ(lse − sink), lse = ln 2 · (m + log2 l); empty rows (l = 0): out 0, lse −inf

Non-finite input (it reaches the kernels only with value checks off; ``docs/sparse_mla.md#non-finite-input``)
poisons l: a query row holding a NaN or ±inf sets l = NaN after the loop, and a counted score that is not
finite (a cache row holding a NaN or ±inf: E8M0 scale byte 255 reads as NaN) makes l NaN inside it (a −inf
score, which would weigh 0, is turned into NaN first). l = NaN is "not empty" (NaN != 0), so the epilogue
writes out = NaN and lse = NaN; the split merge carries it (0 · NaN = NaN). No extra branch in the loop.

Block sizes (:class:`~dsv4ref.sparse_mla.launch.SparseMlaLaunch`; measured on the H200 in
``benchmarks/sparse_mla.md``): BLOCK_H = 16 heads for H ≤ 16, 32 for H ≤ 32, else 64 (H = 128 runs two
blocks; other H are padded with masked rows: q = 0, sink = −inf, never stored). BLOCK_N = 32 candidates
per chunk with 16-head blocks, 64 with larger ones (16 in the interpreter). Both must be powers of two
≥ 16 (the dots' minimum). 4 warps for 16-head blocks, 8 above.

Split / merge (flash-decoding). With SPLITS > 1, split ``sp`` takes the entries
``[sp·chunk, (sp + 1)·chunk)`` of each pool (``chunk`` = ceil(K / SPLITS) rounded up to BLOCK_N, per pool)
and writes its unnormalised state, without the sink, to two fp32 scratch tensors:

* ``part_o  [T, SPLITS, H, 512]`` fp32, contiguous: acc = Σ 2^(s − m)·k over the split's entries;
* ``part_ml [T, SPLITS, H, 2]`` fp32, contiguous: ``(m, l)``, m the max of the log2-domain logits
  ``s·log2(e)`` (−inf for a split with no valid entry) and l = Σ 2^(s − m) (0 then; NaN for a poisoned row).

:func:`merge_kernel` (one program per token and ``MERGE_BLOCK_H`` = 2 heads, 4 warps) folds the splits
with the same rescaling as the loop, then runs the same epilogue once: the sink is applied after the
merge, never per split, and lse stays in one unit (log2 inside, natural log at the single exit).

Compiled, the dots take bf16 operands (exact for the dequantised rows and for q) with fp32 accumulation,
and P is rounded to bf16 for P·V, as DeepSeek's and FlashMLA's kernels do: an error up to 2^-9·Σ_j p_j|v_j|
per output (tolerance ``bf16_weighted_sum``). Interpreted (``DOT_FP32``), every dot is fp32 and P is rounded
in integers (``bf16_round_nan``), so both paths round it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import HEAD_DIM, N_SCALES, NOPE_DIM, QUANT_BLOCK, ROPE_DIM
from ..tl import bf16_rne_bits_nan, bf16_round_nan, dot, nonfinite, page_offsets, ue8m0_value

# The row as tiles of QUANT_BLOCK values: N_SCALES e4m3 tiles, then one bf16 RoPE tile (needs ROPE_DIM == QUANT_BLOCK).
assert ROPE_DIM == QUANT_BLOCK and NOPE_DIM == N_SCALES * QUANT_BLOCK
_D = tl.constexpr(HEAD_DIM)  # 512: row width (K = V)
_NOPE = tl.constexpr(NOPE_DIM)  # 448: byte offset of the RoPE bf16 values inside a token's data
_TILE = tl.constexpr(QUANT_BLOCK)  # 64 values per UE8M0 scale
_TILES = tl.constexpr(HEAD_DIM // QUANT_BLOCK)  # 8 tiles: 0..6 e4m3, 7 RoPE
_ROPE_TILE = tl.constexpr(N_SCALES)  # 7
_LN2 = tl.constexpr(0.6931471805599453)

__all__ = ["e4m3_value", "load_rows_fp8", "load_rows_bf16", "attend_pool", "finish", "decode_kernel", "merge_kernel"]


@triton.jit
def e4m3_value(q8, INTERPRETED: tl.constexpr):
    """e4m3fn bytes (uint8) -> fp32 values, NaN for the bytes 0x7F / 0xFF. Compiled, the cast does it all;
    Triton's interpreter (seen with 3.9) decodes those two bytes as ±480, so there they are mapped to NaN
    explicitly."""
    x = q8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if INTERPRETED:
        x = tl.where((q8 & 0x7F) == 0x7F, float("nan"), x)
    return x


@triton.jit
def load_rows_fp8(
    cache_ptr, slot, ok, block_size, page_stride, BLOCK_N: tl.constexpr, ROPE16: tl.constexpr, INTERPRETED: tl.constexpr
):
    """Dequantised rows ``[BLOCK_N, 512]`` fp32 straight from the pages (``docs/formats.md``).

    cache_ptr: uint8 pages; slot: [BLOCK_N] int (≥ 0 where ``ok``); ok: [BLOCK_N] bool. Tiles 0..6 are e4m3
    bytes × the UE8M0 scale (2^(byte − 127); byte 0 = 2^-127, byte 255 = NaN, as the format defines), tile 7
    the 64 bf16 RoPE values (two little-endian bytes each). Rows with ``ok`` false load nothing (other = 0):
    a −1 or a NaN-filled page never reaches the math."""
    data, scales = page_offsets(slot, block_size, page_stride)  # [BLOCK_N] int64 each
    b = tl.arange(0, _TILES)
    c = tl.arange(0, _TILE)
    b3 = b[None, :, None]
    c3 = c[None, None, :]
    ok3 = (ok[:, None, None] & (b3 < _ROPE_TILE)) & (c3 >= 0)  # [BLOCK_N, 8, 64], the pointer's shape
    q8 = tl.load(cache_ptr + data[:, None, None] + b3 * _TILE + c3, mask=ok3, other=0)
    x = e4m3_value(q8, INTERPRETED)
    ok2 = ok[:, None] & (b[None, :] < _ROPE_TILE)
    sb = tl.load(cache_ptr + scales[:, None] + b[None, :], mask=ok2, other=127)
    x = x * ue8m0_value(sb)[:, :, None]
    okr = ok[:, None] & (c[None, :] >= 0)
    if ROPE16:  # pages start at even byte addresses: read the 64 bf16 as int16 words (little-endian)
        w = (
            tl.load(cache_ptr.to(tl.pointer_type(tl.int16)) + ((data + _NOPE) // 2)[:, None] + c[None, :], mask=okr, other=0).to(
                tl.int32
            )
            & 0xFFFF
        )
    else:  # any alignment: two bytes each
        lo = tl.load(cache_ptr + data[:, None] + _NOPE + 2 * c[None, :], mask=okr, other=0).to(tl.int32)
        hi = tl.load(cache_ptr + data[:, None] + _NOPE + 1 + 2 * c[None, :], mask=okr, other=0).to(tl.int32)
        w = lo | (hi << 8)
    rope = (w << 16).to(tl.float32, bitcast=True)  # bf16 bits -> fp32, exactly
    x = tl.where(b3 == _ROPE_TILE, rope[:, None, :], x)
    return tl.reshape(x, (BLOCK_N, _D))


@triton.jit
def load_rows_bf16(ws_ptr, row, ok):
    """Rows ``[BLOCK_N, 512]`` of the two-pass path's bf16 workspace (``[rows, 512]``, contiguous), widened
    to fp32 right after the load; rows with ``ok`` false load 0."""
    d = tl.arange(0, _D)
    ptr = ws_ptr + row.to(tl.int64)[:, None] * _D + d[None, :]
    return tl.load(ptr, mask=ok[:, None] & (d[None, :] >= 0), other=0.0).to(tl.float32)


@triton.jit
def attend_pool(
    q,
    m,
    l,
    acc,
    kv_ptr,
    slots_ptr,
    row_base,
    start,
    stop,
    block_size,
    page_stride,
    qk_scale,
    KV_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROPE16: tl.constexpr,
):
    """Online softmax over entries ``[start, stop)`` of one pool's slot row; returns the updated (m, l, acc).

    m: running max of the log2-domain logits [BLOCK_H]; l: running Σ 2^(s − m) [BLOCK_H]; acc: running
    Σ 2^(s − m)·k [BLOCK_H, 512]. A chunk whose entries are all masked leaves m = −inf; ``m_safe`` keeps
    every exponent finite: never −inf − (−inf).

    A counted score that is not finite (only a cache row holding a NaN or ±inf makes one) turns l into NaN
    for good: NaN and +inf do so through the exponentials, and −inf, which would silently weigh 0, is made
    NaN first. The epilogue then writes NaN, never the empty-row answer."""
    jn = tl.arange(0, BLOCK_N)
    for j in range(start, stop, BLOCK_N):
        jj = j + jn
        slot = tl.load(slots_ptr + jj, mask=jj < stop, other=-1)  # beyond the length: −1
        ok = slot >= 0
        if KV_BF16:
            k = load_rows_bf16(kv_ptr, row_base + jj, ok)
        else:
            k = load_rows_fp8(kv_ptr, tl.maximum(slot, 0), ok, block_size, page_stride, BLOCK_N, ROPE16, DOT_FP32)
        if not DOT_FP32:
            k = k.to(tl.bfloat16)  # exact: e4m3 × 2^e and the RoPE values are bf16 numbers
        s = dot(q, tl.trans(k), tl.zeros((BLOCK_H, BLOCK_N), dtype=tl.float32), DOT_FP32)
        s = s * qk_scale
        s = tl.where(ok[None, :], tl.where(s == -float("inf"), float("nan"), s), -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)  # m = −inf (nothing yet) -> 0
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            p = bf16_round_nan(p)  # the interpreter's cast truncates (I4): round in integers, keep fp32
        else:
            p = p.to(tl.bfloat16)  # DeepSeek's and FlashMLA's numerics: abs error up to 2^-9 · Σ p|v|
        acc = dot(p, k, acc * alpha[:, None], DOT_FP32)  # the same tile is V: nothing loaded twice
        m = m_new
    return m, l, acc


@triton.jit
def finish(m, l, acc, sink):
    """Epilogue: out = acc / l · σ(lse − sink), lse = ln Σ e^s; empty rows -> out 0, lse −inf.

    Emptiness comes from l (l ≥ 1 as soon as one entry is valid: the max entry contributes 2^0), never
    from the running max; l = NaN (a poisoned row) is not empty and gives out = NaN, lse = NaN. The sink
    enters as the correction factor 1 / (1 + e^(sink − lse)), right for sink = −inf (factor 1) and +inf
    (factor 0) without NaN."""
    nonempty = l != 0  # NaN != 0: a poisoned row is never taken for an empty one
    l_safe = tl.where(nonempty, l, 1.0)
    m_safe = tl.where(nonempty, m, 0.0)
    lse = (m_safe + tl.log2(l_safe)) * _LN2
    corr = 1.0 / (1.0 + tl.exp(sink - lse))
    out = acc * (corr / l_safe)[:, None]
    out = tl.where(nonempty[:, None], out, 0.0)
    lse = tl.where(nonempty, lse, -float("inf"))
    return out, lse


@triton.jit
def _store_out(out_ptr, lse_ptr, sink_ptr, t64, h, hm, H, m, l, acc, HAS_SINK: tl.constexpr):
    """Run :func:`finish` for heads ``h`` of token t and store out (bf16 bits, RNE) and lse."""
    if HAS_SINK:
        sink = tl.load(sink_ptr + h, mask=hm, other=-float("inf"))
    else:
        sink = tl.full(h.shape, -float("inf"), dtype=tl.float32)
    out, lse = finish(m, l, acc, sink)
    row = t64 * H + h.to(tl.int64)
    d = tl.arange(0, _D)
    tl.store(
        out_ptr + row[:, None] * _D + d[None, :],
        bf16_rne_bits_nan(out).to(tl.int16, bitcast=True),
        mask=hm[:, None] & (d[None, :] >= 0),
    )
    tl.store(lse_ptr + row, lse, mask=hm)


@triton.jit
def decode_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,  # q [T, H, 512] bf16; strides in elements, the last dim contiguous
    sink_ptr,  # [H] fp32 (read only when HAS_SINK)
    out_ptr,  # int16 view of out [T, H, 512] bf16, contiguous (SPLITS == 1)
    lse_ptr,  # [T, H] fp32, contiguous (SPLITS == 1)
    part_o_ptr,  # [T, SPLITS, H, 512] fp32, contiguous: unnormalised partial acc (SPLITS > 1)
    part_ml_ptr,  # [T, SPLITS, H, 2] fp32, contiguous: partial (m, l), log2 domain (SPLITS > 1)
    # pool 1: kv1 = uint8 pages [pages, page_stride] (or the bf16 workspace [T·K1, 512] when KV_BF16);
    # slots1 [T, K1] int32/int64 (row stride slots1_stride, entries contiguous; −1 = none);
    # len1 [T] int32 (HAS_LEN1); bs1 = block_size; ps1 = page stride in bytes; chunk1 = entries per split
    kv1_ptr,
    slots1_ptr,
    len1_ptr,
    K1,
    slots1_stride,
    bs1,
    ps1,
    chunk1,
    kv2_ptr,
    slots2_ptr,
    len2_ptr,
    K2,
    slots2_stride,
    bs2,
    ps2,
    chunk2,  # pool 2, the same (HAS_POOL2)
    H,  # real heads (≤ the grid's head blocks · BLOCK_H)
    qk_scale,  # softmax scale · log2(e)
    HAS_LEN1: tl.constexpr,
    HAS_POOL2: tl.constexpr,
    HAS_LEN2: tl.constexpr,
    HAS_SINK: tl.constexpr,
    KV_BF16: tl.constexpr,  # True: kv*_ptr are bf16 workspaces, row = t·K + j (two-pass); False: FP8 pages
    SPLITS: tl.constexpr,  # candidate-list splits; > 1 writes the partials for merge_kernel
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter: fp32 dots (bf16 tl.dot is wrong there) and its e4m3 NaN fix
    ROPE16: tl.constexpr,  # every page starts at an even address: RoPE read as int16 words
):
    """Grid ``(T, cdiv(H, BLOCK_H), SPLITS)``. Writes out/lse (SPLITS == 1) or the split scratch."""
    tl.static_assert(BLOCK_N >= 16)  # the dots' K (for P·V) and N dims
    tl.static_assert(BLOCK_H >= 16)
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    sp = tl.program_id(2)
    hm = h < H  # heads past H are padding: q = 0, sink = −inf, never stored
    d = tl.arange(0, _D)
    t64 = t.to(tl.int64)
    q = tl.load(
        q_ptr + t64 * q_stride_t + h[:, None].to(tl.int64) * q_stride_h + d[None, :],
        mask=hm[:, None] & (d[None, :] >= 0),
        other=0.0,
    ).to(tl.float32)
    q_bad = tl.max(nonfinite(q).to(tl.int32), axis=1) != 0  # [BLOCK_H]: a NaN/inf query poisons its row
    if not DOT_FP32:
        q = q.to(tl.bfloat16)  # exact: q was bf16
    m = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, _D), dtype=tl.float32)

    n1 = K1
    if HAS_LEN1:
        n1 = tl.minimum(tl.load(len1_ptr + t), K1)
    start1 = sp * chunk1
    m, l, acc = attend_pool(
        q,
        m,
        l,
        acc,
        kv1_ptr,
        slots1_ptr + t64 * slots1_stride,
        t64 * K1,
        start1,
        tl.minimum(start1 + chunk1, n1),
        bs1,
        ps1,
        qk_scale,
        KV_BF16,
        BLOCK_H,
        BLOCK_N,
        DOT_FP32,
        ROPE16,
    )
    if HAS_POOL2:  # the second pool joins the same softmax state
        n2 = K2
        if HAS_LEN2:
            n2 = tl.minimum(tl.load(len2_ptr + t), K2)
        start2 = sp * chunk2
        m, l, acc = attend_pool(
            q,
            m,
            l,
            acc,
            kv2_ptr,
            slots2_ptr + t64 * slots2_stride,
            t64 * K2,
            start2,
            tl.minimum(start2 + chunk2, n2),
            bs2,
            ps2,
            qk_scale,
            KV_BF16,
            BLOCK_H,
            BLOCK_N,
            DOT_FP32,
            ROPE16,
        )

    l = tl.where(q_bad, float("nan"), l)  # also when the row has no valid entry: never the empty-row answer
    if SPLITS == 1:
        _store_out(out_ptr, lse_ptr, sink_ptr, t64, h, hm, H, m, l, acc, HAS_SINK)
    else:  # the split's state, without the sink
        row = (t64 * SPLITS + sp) * H + h.to(tl.int64)
        tl.store(part_o_ptr + row[:, None] * _D + d[None, :], acc, mask=hm[:, None] & (d[None, :] >= 0))
        tl.store(part_ml_ptr + row * 2, m, mask=hm)
        tl.store(part_ml_ptr + row * 2 + 1, l, mask=hm)


@triton.jit
def merge_kernel(
    part_o_ptr,  # [T, SPLITS, H, 512] fp32, contiguous (decode_kernel's scratch)
    part_ml_ptr,  # [T, SPLITS, H, 2] fp32, contiguous
    sink_ptr,  # [H] fp32 (HAS_SINK)
    out_ptr,  # int16 view of out [T, H, 512] bf16, contiguous
    lse_ptr,  # [T, H] fp32, contiguous
    H,
    HAS_SINK: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid ``(T, cdiv(H, BLOCK_H))``. Fold the SPLITS partial states of a (token, block of heads) into one
    with the loop's rescaling (max first, then Σ 2^(m_s − m)·state), then the epilogue, with the sink,
    once."""
    t64 = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    d = tl.arange(0, _D)
    m = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
    for s in range(SPLITS):
        m = tl.maximum(m, tl.load(part_ml_ptr + ((t64 * SPLITS + s) * H + h) * 2, mask=hm, other=-float("inf")))
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, _D), dtype=tl.float32)
    for s in range(SPLITS):
        row = (t64 * SPLITS + s) * H + h
        w = tl.exp2(tl.load(part_ml_ptr + row * 2, mask=hm, other=-float("inf")) - m_safe)  # empty split: 0
        l += w * tl.load(part_ml_ptr + row * 2 + 1, mask=hm, other=0.0)
        acc += w[:, None] * tl.load(part_o_ptr + row[:, None] * _D + d[None, :], mask=hm[:, None] & (d[None, :] >= 0), other=0.0)
    _store_out(out_ptr, lse_ptr, sink_ptr, t64, h, hm, H, m, l, acc, HAS_SINK)
