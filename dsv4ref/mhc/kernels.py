"""mHC Triton kernels: Sinkhorn, post, the pieces every design of pre shares, and the first of its four designs.

The math these kernels implement is ``reference.py`` (and docs/mhc.md); how they are launched, and which
design serves which op by default, is ``launch.py``. The designs of pre / fused post+pre / head:

* one kernel (``hc_kernel``, below): a program owns BLOCK_T tokens and the whole K = 4·Hd reduction. Pass 1
  streams the tokens' 4·Hd values once in BLOCK_K chunks (GEMM + Σ X²); the gates and 20 Sinkhorn passes run
  in registers; pass 2 re-reads the chunks, last first (likeliest still in L2), for ``x = Σ_i pre_i·Hs_i``.
  Every program reads all of fn (3.1 MB as bf16×3 at Hd = 4096) from L2 for only BLOCK_T tokens. The
  interpreter's default for fused post+pre;
* split-K (``kernels_split_k.py``: ``hc_partial_kernel`` + ``hc_finish_kernel``): program (s, tile) owns 64 tokens and the
  K-slice of split s and writes partial mixes / Σ X² to a workspace; the finish kernel sums the partials in
  split order (deterministic), runs the gates and Sinkhorn, and the weighted sum over a hidden range. 4× less
  fn traffic and enough programs even at small T, but the streams are read twice. The interpreter's default
  for pre and head;
* one pass (``kernels_one_pass.py``): one launch whose programs hand work to each other through an atomic
  ticket, so that the streams' second read comes from L2; a rung of the ladder, no default;
* chunked (``kernels_chunked.py``): split-K's two kernels per chunk of tokens, with wide dots and contiguous
  copies; the GPU default of every op.

Conventions for every kernel
----------------------------
* bf16 tensors are passed as their ``torch.int16`` view and widened in integers (``load_bf16``): no bf16
  arithmetic ever runs (the interpreter computes bf16 on raw bits, docs/triton_interpreter.md I3). bf16
  outputs are rounded with ``bf16_rne_bits_nan`` (integer round-to-nearest-even; a NaN stays NaN) and
  stored through int16.
* The streams ``[T, 4, Hd]`` are contiguous: token t's stream i starts at ``(4·t + i)·Hd``.
* ``M = 4`` is written into the kernels (DeepSeek-V4's ``hc_mult``): a 4×4 comb is a ``[BLOCK, 4, 4]`` tile
  and the four streams are four named registers ``r0..r3``.

The mix GEMM, fp32-exact on bf16 tensor cores
---------------------------------------------
``mix = X @ fnᵀ`` must be fp32-accurate (tf32 errs by ~1e-2 on comb). X is bf16 already, so only fn needs
care: ``split_fn`` (fn_split.py) splits it exactly into three bf16 parts ``fn = hi + mid + lo`` (8 + 8 + 8
significand bits), and ``X @ fnᵀ = X @ hiᵀ + X @ midᵀ + X @ loᵀ`` with fp32 accumulation. Every bf16×bf16
product is exact in fp32, so three tensor-core dots reproduce the fp32 GEMM. Each chunk's dots start from a
ZERO accumulator and the chunk sum is added to the running sum with a plain fp32 add: a tensor-core MMA adds
into its accumulator with truncation aligned to the largest addend, so feeding it the running sum lost up to
an ulp of the whole sum per MMA (measured on the H200 at K = 16 384: 2.6e-5 on post, over the 1e-5
tolerance).

Fused post+pre (every design that fuses): pass 1 computes the new streams chunk by chunk, stores them (bf16,
RNE) and feeds the STORED bf16 values to the GEMM, exactly as a separate pre would read them, with the post's
FMAs in one fixed order (``post_stream``): its bf16 outputs equal post-then-pre bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl import bf16_rne_bits_nan, dot

# ====================================================================================================
# Building blocks
# ====================================================================================================


@triton.jit
def load_bf16(ptr, offs, mask, CG: tl.constexpr = False):
    """bf16 through its int16 view -> (bf16 tensor for tl.dot, its exact fp32 value). The widening is done
    in integers (bits << 16), so no bf16 arithmetic ever happens. ``CG``: load through the L2 only (PTX
    ``ld.global.cg``), for data another program wrote during this launch (a stale L1 line must not answer)."""
    if CG:
        bits = tl.load(ptr + offs, mask=mask, other=0, cache_modifier=".cg")
    else:
        bits = tl.load(ptr + offs, mask=mask, other=0)
    f = ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return bits.to(tl.bfloat16, bitcast=True), f


@triton.jit
def load_streams(ptr, ro, Hd, mask, CG: tl.constexpr = False):
    """The 4 streams of a [BLOCK_T, BLOCK] chunk (stream i at ``ro + i·Hd``): (a0..a3 bf16, r0..r3 fp32)."""
    a0, r0 = load_bf16(ptr, ro, mask, CG)
    a1, r1 = load_bf16(ptr, ro + Hd, mask, CG)
    a2, r2 = load_bf16(ptr, ro + 2 * Hd, mask, CG)
    a3, r3 = load_bf16(ptr, ro + 3 * Hd, mask, CG)
    return a0, a1, a2, a3, r0, r1, r2, r3


@triton.jit
def bf16_bits(x, HW: tl.constexpr = False):
    """fp32 -> the uint16 bits of bf16(x), round to nearest even, every NaN 0x7FC0: ``bf16_rne_bits_nan``
    (integer arithmetic, ~9 instructions a value, right in the interpreter) or, ``HW`` (compiled kernels only:
    the interpreter's cast truncates, docs/triton_interpreter.md I4), the hardware conversion (cvt.rn.bf16x2:
    one instruction per two values) with NaN made 0x7FC0 after it. The same bits for every input."""
    if HW:
        b = x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.uint16, bitcast=True)
        return tl.where(x != x, 0x7FC0, b.to(tl.int32)).to(tl.uint16)
    else:
        return bf16_rne_bits_nan(x)


@triton.jit
def load_streams_bf16(ptr, ro, Hd, mask):
    """``load_streams`` through a bf16 pointer (the int16 view reinterpreted): the loaded tiles go straight
    to a tensor-core dot, which then reads its A operand from shared memory (an int16 load bitcast to bf16
    in registers makes the compiler feed the dot from registers); the fp32 values are ``.to(tl.float32)``
    right after the load, which the interpreter gets right (docs/triton_interpreter.md I3)."""
    p = ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    a0 = tl.load(p + ro, mask=mask, other=0.0)
    a1 = tl.load(p + ro + Hd, mask=mask, other=0.0)
    a2 = tl.load(p + ro + 2 * Hd, mask=mask, other=0.0)
    a3 = tl.load(p + ro + 3 * Hd, mask=mask, other=0.0)
    return a0, a1, a2, a3, a0.to(tl.float32), a1.to(tl.float32), a2.to(tl.float32), a3.to(tl.float32)


@triton.jit
def col(ptr, rows, stride, c, mask):
    """A [BLOCK_T] fp32 vector: column ``c`` of a row-major [T, stride] fp32 matrix."""
    return tl.load(ptr + rows * stride + c, mask=mask, other=0.0)


@triton.jit
def post_weights(post_ptr, comb_ptr, rows, rm, j: tl.constexpr):
    """Destination stream j's post weights, [BLOCK_T] vectors: (post_j, comb[0, j], comb[1, j], comb[2, j],
    comb[3, j]) from post [T, 4] and comb [T, 4, 4] (fp32, contiguous)."""
    return (
        col(post_ptr, rows, 4, j, rm),
        col(comb_ptr, rows, 16, 0 * 4 + j, rm),
        col(comb_ptr, rows, 16, 1 * 4 + j, rm),
        col(comb_ptr, rows, 16, 2 * 4 + j, rm),
        col(comb_ptr, rows, 16, 3 * 4 + j, rm),
    )


@triton.jit
def post_stream(x, w, r0, r1, r2, r3):
    """New stream j: post_j·x + Σ_i comb[i, j]·r_i (the SOURCE index i is summed: combᵀ), ``w`` from
    ``post_weights``. One fixed order of operations with explicit FMAs, shared by the post and fused kernels,
    so their bf16 outputs are equal bit for bit (with plain ``a*b + c*d`` the compiler chose different FMA
    contractions in the two kernels on the H200: 3 of 540 672 values differed by an ulp)."""
    p_j, c0j, c1j, c2j, c3j = w
    y = p_j[:, None] * x
    y = tl.fma(c0j[:, None], r0, y)
    y = tl.fma(c1j[:, None], r1, y)
    y = tl.fma(c2j[:, None], r2, y)
    return tl.fma(c3j[:, None], r3, y)


@triton.jit
def weighted4(w0, w1, w2, w3, r0, r1, r2, r3, ROWS: tl.constexpr = True):
    """Σ_i w_i·r_i in one fixed FMA order (so pre and the fused kernel agree bit for bit). ``ROWS``: the
    weights are [BLOCK_T] vectors (one per token), else tiles of r's shape."""
    if ROWS:
        y = w0[:, None] * r0
        y = tl.fma(w1[:, None], r1, y)
        y = tl.fma(w2[:, None], r2, y)
        y = tl.fma(w3[:, None], r3, y)
    else:
        y = w0 * r0
        y = tl.fma(w1, r1, y)
        y = tl.fma(w2, r2, y)
        y = tl.fma(w3, r3, y)
    return y


@triton.jit
def sinkhorn_tile(c, iters, eps):
    """DSV4 Sinkhorn on a [BLOCK, 4, 4] fp32 tile in registers (axis 1 = source i, axis 2 = destination j).
    Pass 1: row softmax + eps, column normalise. Passes 2..iters: row, then column normalise."""
    # with value checks off a NaN / +inf logit makes its matrix NaN (docs/mhc.md#non-finite-values): compiled,
    # tl.max may drop a NaN, but exp(NaN − m) is NaN all the same
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(1, iters):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    return c


# ====================================================================================================
# Sinkhorn and post
# ====================================================================================================


@triton.jit
def sinkhorn_kernel(
    in_ptr,  # [n, 4, 4] fp32 logits, contiguous
    out_ptr,  # [n, 4, 4] fp32
    n,  # number of 4×4 matrices
    iters,  # Sinkhorn passes (>= 1)
    eps,  # hc_eps
    BLOCK: tl.constexpr,  # matrices per program
):
    m = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    i4 = tl.arange(0, 4)
    offs = m[:, None, None] * 16 + i4[None, :, None] * 4 + i4[None, None, :]  # [BLOCK, 4, 4]
    mask = offs < n * 16  # rows beyond n: masked (their zero logits never reach memory)
    c = tl.load(in_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, sinkhorn_tile(c, iters, eps), mask=mask)


# post:  new[t, j, h] = post[t, j]·x[t, h] + Σ_i comb[t, i, j]·residual[t, i, h]   (combᵀ @ residual)
# A program owns a [BLOCK_T tokens × BLOCK_H dims] tile of all four streams: 5 rows read, 4 written.
@triton.jit
def post_kernel(
    x_ptr,  # int16 view of x [T, Hd] bf16, contiguous
    res_ptr,  # int16 view of residual [T, 4, Hd] bf16, contiguous
    post_ptr,  # [T, 4] fp32
    comb_ptr,  # [T, 4, 4] fp32; comb[t, i, j] = weight from source i to destination j
    out_ptr,  # int16 view of the new residual [T, 4, Hd] bf16
    t0,  # the first token (0; the chunked design's fused op runs it per chunk of tokens)
    T,  # one past the last token
    Hd,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TOKEN_MAJOR: tl.constexpr = False,  # grid (hidden parts, token tiles): the programs walk T once, in order
):
    if TOKEN_MAJOR:  # consecutive programs cover one token tile's dims: the last ones launched wrote the last tokens
        tile, hp = tl.program_id(1), tl.program_id(0)
    else:
        tile, hp = tl.program_id(0), tl.program_id(1)
    rows = t0 + tile.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = hp * BLOCK_H + tl.arange(0, BLOCK_H)
    rm = rows < T
    mask = rm[:, None] & (h < Hd)[None, :]
    ro = rows[:, None] * (4 * Hd) + h[None, :]  # stream i at ro + i·Hd
    _, x = load_bf16(x_ptr, rows[:, None] * Hd + h[None, :], mask)
    _, _, _, _, r0, r1, r2, r3 = load_streams(res_ptr, ro, Hd, mask)
    for j in tl.static_range(4):
        y = post_stream(x, post_weights(post_ptr, comb_ptr, rows, rm, j), r0, r1, r2, r3)
        tl.store(out_ptr + ro + j * Hd, bf16_rne_bits_nan(y).to(tl.int16, bitcast=True), mask=mask)


# ====================================================================================================
# pre / fused post+pre / head: the pieces every design shares
# ====================================================================================================


@triton.jit
def token_tile(tile, T, post_in_ptr, comb_in_ptr, FUSED: tl.constexpr, BLOCK_T: tl.constexpr):
    """The prologue of a program that owns token tile ``tile``: (rows [BLOCK_T] int64, rm = rows < T, W).
    ``W``, FUSED only: the post's weights for the 4 destination streams (``post_weights``), loaded once."""
    rows = tile.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rm = rows < T
    if FUSED:
        W = (
            post_weights(post_in_ptr, comb_in_ptr, rows, rm, 0),
            post_weights(post_in_ptr, comb_in_ptr, rows, rm, 1),
            post_weights(post_in_ptr, comb_in_ptr, rows, rm, 2),
            post_weights(post_in_ptr, comb_in_ptr, rows, rm, 3),
        )
    else:
        W = 0  # unused
    return rows, rm, W


@triton.jit
def stream_chunk(res_ptr, x_ptr, new_ptr, W, rows, h, Hd, mask, FUSED: tl.constexpr, HW: tl.constexpr = False):
    """Pass 1's input for one chunk ``h`` [BLOCK_K] of the tile's 4 streams: (a0..a3 bf16, r0..r3 fp32).

    FUSED: the streams read are the ones BEFORE the post; the post is applied here (new stream j =
    post_j·x + Σ_i comb[i, j]·r_i), rounded to bf16, stored to ``new_ptr``, and returned as the values the
    GEMM sees, exactly the bf16 values a separate pre would read. ``HW``: rounded by ``bf16_bits``' hardware
    path (the same bits)."""
    ro = rows[:, None] * (4 * Hd) + h[None, :]  # stream i at ro + i·Hd
    a0, a1, a2, a3, r0, r1, r2, r3 = load_streams(res_ptr, ro, Hd, mask)
    if FUSED:
        _, x = load_bf16(x_ptr, rows[:, None] * Hd + h[None, :], mask)
        n0 = bf16_bits(post_stream(x, W[0], r0, r1, r2, r3), HW)
        n1 = bf16_bits(post_stream(x, W[1], r0, r1, r2, r3), HW)
        n2 = bf16_bits(post_stream(x, W[2], r0, r1, r2, r3), HW)
        n3 = bf16_bits(post_stream(x, W[3], r0, r1, r2, r3), HW)
        tl.store(new_ptr + ro, n0.to(tl.int16, bitcast=True), mask=mask)
        tl.store(new_ptr + ro + Hd, n1.to(tl.int16, bitcast=True), mask=mask)
        tl.store(new_ptr + ro + 2 * Hd, n2.to(tl.int16, bitcast=True), mask=mask)
        tl.store(new_ptr + ro + 3 * Hd, n3.to(tl.int16, bitcast=True), mask=mask)
        a0, r0 = n0.to(tl.bfloat16, bitcast=True), (n0.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        a1, r1 = n1.to(tl.bfloat16, bitcast=True), (n1.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        a2, r2 = n2.to(tl.bfloat16, bitcast=True), (n2.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        a3, r3 = n3.to(tl.bfloat16, bitcast=True), (n3.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return a0, a1, a2, a3, r0, r1, r2, r3


@triton.jit
def gates(
    acc_g,
    acc_c,
    ssq,
    K,
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
    store,
    HEAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """From the accumulated logits to the weights: the RMS factor of the flattened streams (applied AFTER the
    GEMM, one scalar per token), pre = σ(·) + eps (head: the gate), and, unless HEAD and only where ``store``,
    post = σ(·)·post_mult and comb = Sinkhorn(·) stored to ``post_ptr`` / ``comb_ptr``.

    acc_g [BLOCK_T, 16]: [pre 0..3 | post 4..7 | 0] (head: [gate | 0]); acc_c [BLOCK_T, 16]: comb logit (i, j)
    at 4i + j; ssq [BLOCK_T]: Σ X² over K = 4·Hd values. Returns pre as four [BLOCK_T] vectors w0..w3."""
    rinv = tl.math.rsqrt(ssq / K + rms_eps)
    i4 = tl.arange(0, 4)
    g3 = tl.reshape(acc_g * rinv[:, None], (BLOCK_T, 4, 4))  # row 0: pre (head: gate), row 1: post
    sel = i4[None, :, None]
    pre = (
        tl.sigmoid(tl.sum(tl.where(sel == 0, g3, 0.0), axis=1) * tl.load(scale_ptr) + tl.load(base_ptr + i4)[None, :]) + hc_eps
    )  # [BLOCK_T, 4]
    if not HEAD:
        if store:
            post = (
                tl.sigmoid(
                    tl.sum(tl.where(sel == 1, g3, 0.0), axis=1) * tl.load(scale_ptr + 1) + tl.load(base_ptr + 4 + i4)[None, :]
                )
                * post_mult
            )
            tl.store(post_ptr + rows[:, None] * 4 + i4[None, :], post, mask=rm[:, None] & (i4 < 4)[None, :])
            cl = (
                tl.reshape(acc_c * rinv[:, None], (BLOCK_T, 4, 4)) * tl.load(scale_ptr + 2)
                + tl.load(base_ptr + 8 + i4[:, None] * 4 + i4[None, :])[None, :, :]
            )
            comb = sinkhorn_tile(cl, iters, hc_eps)
            co = rows[:, None, None] * 16 + i4[None, :, None] * 4 + i4[None, None, :]
            tl.store(comb_ptr + co, comb, mask=co < T * 16)
    w0 = tl.sum(tl.where(i4[None, :] == 0, pre, 0.0), axis=1)
    w1 = tl.sum(tl.where(i4[None, :] == 1, pre, 0.0), axis=1)
    w2 = tl.sum(tl.where(i4[None, :] == 2, pre, 0.0), axis=1)
    w3 = tl.sum(tl.where(i4[None, :] == 3, pre, 0.0), axis=1)
    return w0, w1, w2, w3


@triton.jit
def layer_input_chunk(
    src_ptr, out_ptr, rows, rm, h, h_end, Hd, w0, w1, w2, w3, CG: tl.constexpr = False, HW: tl.constexpr = False
):
    """out[rows, h] = bf16(Σ_i pre_i · stream_i[rows, h]) for one chunk ``h`` of the hidden dim (h < h_end <= Hd).
    ``HW``: rounded by ``bf16_bits``' hardware path (the same bits)."""
    mask = rm[:, None] & (h < h_end)[None, :]
    _, _, _, _, r0, r1, r2, r3 = load_streams(src_ptr, rows[:, None] * (4 * Hd) + h[None, :], Hd, mask, CG)
    y = weighted4(w0, w1, w2, w3, r0, r1, r2, r3)
    tl.store(out_ptr + rows[:, None] * Hd + h[None, :], bf16_bits(y, HW).to(tl.int16, bitcast=True), mask=mask)


@triton.jit
def layer_input_range(
    src_ptr,
    out_ptr,
    rows,
    rm,
    h_begin,
    h_end,
    Hd,
    w0,
    w1,
    w2,
    w3,
    BLOCK: tl.constexpr,
    CG: tl.constexpr = False,
    HW: tl.constexpr = False,
):
    """``layer_input_chunk`` over the hidden range [h_begin, h_end) in BLOCK-wide chunks, LAST chunk first:
    a pass that just read (or wrote) this range in order finds its latest chunks likeliest still in L2."""
    hh = tl.arange(0, BLOCK)
    n_chunks = tl.cdiv(h_end - h_begin, BLOCK)
    for c in range(0, n_chunks):
        layer_input_chunk(
            src_ptr, out_ptr, rows, rm, h_begin + (n_chunks - 1 - c) * BLOCK + hh, h_end, Hd, w0, w1, w2, w3, CG, HW
        )


# ====================================================================================================
# Design 1: one kernel (hc_kernel)
# ====================================================================================================


@triton.jit
def gemm_stream(a, k, kmask, fn_split_ptr, K, acc_g, acc_c, DOT_FP32: tl.constexpr, HEAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += a @ fnᵀ[k, :] for one stream chunk: a [BLOCK_T, BLOCK_K] bf16, fs = [G, 3, K, 16] bf16 (hi, mid,
    lo; group 0 = gate columns, group 1 = comb columns). Three bf16 dots per group reproduce the fp32 product
    exactly; the chunk's dots start from zero (module docstring: MMA truncation)."""
    n16 = tl.arange(0, 16)
    b_off = k.to(tl.int64)[:, None] * 16 + n16[None, :]  # [BLOCK_K, 16]
    bm = kmask[:, None] & (n16 < 16)[None, :]  # full-shape mask (the interpreter wants mask.shape == ptr.shape)
    part_g = tl.zeros_like(acc_g)
    part_c = tl.zeros_like(acc_c)
    for s in tl.static_range(3):
        part_g = dot(a, tl.load(fn_split_ptr + s * K * 16 + b_off, mask=bm, other=0.0), part_g, DOT_FP32)
        if not HEAD:
            part_c = dot(a, tl.load(fn_split_ptr + (3 + s) * K * 16 + b_off, mask=bm, other=0.0), part_c, DOT_FP32)
    return acc_g + part_g, acc_c + part_c


@triton.jit
def hc_kernel(
    res_ptr,  # int16 view of residual [T, 4, Hd] bf16 (contiguous): the streams read by pre / head,
    #           or, when FUSED, the streams *before* the post
    x_ptr,  # FUSED: int16 view of the sub-layer output x [T, Hd] bf16
    post_in_ptr,  # FUSED: [T, 4] fp32
    comb_in_ptr,  # FUSED: [T, 4, 4] fp32
    new_ptr,  # FUSED: int16 view of the new residual [T, 4, Hd] bf16 (written)
    fn_split_ptr,  # [G, 3, 4·Hd, 16] bf16: split_fn(fn)
    scale_ptr,  # [3] fp32 (pre, post, comb) or [1] for the head
    base_ptr,  # [24] fp32 ([4] for the head)
    post_ptr,  # [T, 4] fp32 out (not HEAD)
    comb_ptr,  # [T, 4, 4] fp32 out (not HEAD)
    out_ptr,  # int16 view of the layer input (head: the output) [T, Hd] bf16
    T,
    Hd,
    rms_eps,
    hc_eps,
    post_mult,
    iters,
    HEAD: tl.constexpr,  # head: gates only (no post, no Sinkhorn)
    FUSED: tl.constexpr,  # apply post(x, residual, post_in, comb_in) first, store it, run pre on it
    BLOCK_T: tl.constexpr,  # tokens per program (>= 16: the M side of tl.dot)
    BLOCK_K: tl.constexpr,  # hidden dims per chunk (>= 16: the K side of tl.dot)
    DOT_FP32: tl.constexpr,  # interpreting(): see dsv4ref.tl.dot
):
    tl.static_assert(BLOCK_K >= 16)
    tl.static_assert(BLOCK_T >= 16)
    rows, rm, W = token_tile(tl.program_id(0), T, post_in_ptr, comb_in_ptr, FUSED, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    K = 4 * Hd
    acc_g = tl.zeros((BLOCK_T, 16), dtype=tl.float32)  # [pre 0..3 | post 4..7 | 0] (head: [gate | 0])
    acc_c = tl.zeros((BLOCK_T, 16), dtype=tl.float32)  # comb logits, (i, j) at 4i + j
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)  # Σ X² over the flattened 4·Hd values

    # ---- pass 1: the mix GEMM and Σ X², one chunk of all 4 streams at a time ---------------------------
    for h0 in range(0, Hd, BLOCK_K):
        h = h0 + kk
        hm = h < Hd
        a0, a1, a2, a3, r0, r1, r2, r3 = stream_chunk(res_ptr, x_ptr, new_ptr, W, rows, h, Hd, rm[:, None] & hm[None, :], FUSED)
        ssq += tl.sum(weighted4(r0, r1, r2, r3, r0, r1, r2, r3, False), axis=1)  # Σ_i r_i², fixed FMA order
        acc_g, acc_c = gemm_stream(a0, h, hm, fn_split_ptr, K, acc_g, acc_c, DOT_FP32, HEAD, BLOCK_K)
        acc_g, acc_c = gemm_stream(a1, Hd + h, hm, fn_split_ptr, K, acc_g, acc_c, DOT_FP32, HEAD, BLOCK_K)
        acc_g, acc_c = gemm_stream(a2, 2 * Hd + h, hm, fn_split_ptr, K, acc_g, acc_c, DOT_FP32, HEAD, BLOCK_K)
        acc_g, acc_c = gemm_stream(a3, 3 * Hd + h, hm, fn_split_ptr, K, acc_g, acc_c, DOT_FP32, HEAD, BLOCK_K)

    # ---- RMS factor, gates, Sinkhorn (in registers) --------------------------------------------------------
    w0, w1, w2, w3 = gates(
        acc_g,
        acc_c,
        ssq,
        K,
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
        True,
        HEAD,
        BLOCK_T,
    )

    # ---- pass 2: x = Σ_i pre_i · stream_i, last chunk first (it is the likeliest to still be in L2) ----
    if FUSED:
        tl.debug_barrier()  # the new streams written above by other threads of this program
        src_ptr = new_ptr
    else:
        src_ptr = res_ptr
    layer_input_range(src_ptr, out_ptr, rows, rm, 0, Hd, Hd, w0, w1, w2, w3, BLOCK_K)
