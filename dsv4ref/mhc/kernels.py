"""mHC Triton kernels: Sinkhorn, post, and pre / fused post+pre / head in four designs.

The math these kernels implement is ``reference.py`` (and docs/mhc.md); how they are launched, and which
design serves which op by default, is ``launch.py``.

Conventions for every kernel below
----------------------------------
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
care: ``split_fn`` (launch.py) splits it exactly into three bf16 parts ``fn = hi + mid + lo`` (8 + 8 + 8
significand bits), and ``X @ fnᵀ = X @ hiᵀ + X @ midᵀ + X @ loᵀ`` with fp32 accumulation. Every bf16×bf16
product is exact in fp32, so three tensor-core dots reproduce the fp32 GEMM. Each chunk's dots start from a
ZERO accumulator and the chunk sum is added to the running sum with a plain fp32 add: a tensor-core MMA adds
into its accumulator with truncation aligned to the largest addend, so feeding it the running sum lost up to
an ulp of the whole sum per MMA (measured on the H200 at K = 16 384: 2.6e-5 on post, over the 1e-5
tolerance).

Four designs for pre, fused post+pre and head
---------------------------------------------
* One kernel (``hc_kernel``): a program owns BLOCK_T tokens and the whole K = 4·Hd reduction. Pass 1 streams
  the tokens' 4·Hd values once in BLOCK_K chunks (GEMM + Σ X²); the gates and 20 Sinkhorn passes run in
  registers; pass 2 re-reads the chunks, last first (likeliest still in L2), for ``x = Σ_i pre_i·Hs_i``.
  Every program reads all of fn (3.1 MB as bf16×3 at Hd = 4096) from L2 for only BLOCK_T tokens.
* Split-K (``hc_partial_kernel`` + ``hc_finish_kernel``): program (s, tile) owns 64 tokens and the K-slice
  of split s and writes partial mixes / Σ X² to a workspace; the finish kernel sums the partials in split
  order (deterministic), runs the gates and Sinkhorn, and the weighted sum over a hidden range. 4× less fn
  traffic and enough programs even at small T, but the streams are read twice.
* One pass (``hc_one_pass_kernel``, the default on a GPU since session 4's H200 run): work items (128-token tile, hidden
  slice) taken from an atomic ticket; each program computes one item's partial mix, the tile's last arrival
  runs the gates, and the same program then computes the layer input of the same slice of the PREVIOUS
  tile, whose streams it re-reads from L2. One wide dot per stream chunk. See "Design 3" below.
* Chunked (``hc_chunk_partial_kernel`` + ``hc_chunk_finish_kernel``, ``MhcLaunch(chunked=True)``): split-K's
  two kernels launched per chunk of C tokens whose streams fit in L2, so the finish kernel's re-read hits L2
  and no program ever waits for another; the partial kernel is the one-pass kernel's phase A. "Design 4".
Fused post+pre (every design): pass 1 computes the new streams chunk by chunk, stores them (bf16, RNE) and
feeds the STORED bf16 values to the GEMM, exactly as a separate pre would read them, with the post's FMAs in
one fixed order (``post_stream``): its bf16 outputs equal post-then-pre bit for bit.
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
    return (col(post_ptr, rows, 4, j, rm), col(comb_ptr, rows, 16, 0 * 4 + j, rm), col(comb_ptr, rows, 16, 1 * 4 + j, rm),
            col(comb_ptr, rows, 16, 2 * 4 + j, rm), col(comb_ptr, rows, 16, 3 * 4 + j, rm))


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
    PDL: tl.constexpr = False,  # the chunked fused op's programmatic dependent launch (kernels.py "Design 4")
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
    if PDL:  # launched early beside the previous chunk's finish: end only after it has ended
        tl.extra.cuda.gdc_wait()


# ====================================================================================================
# pre / fused post+pre / head: the pieces both designs share
# ====================================================================================================


@triton.jit
def token_tile(tile, T, post_in_ptr, comb_in_ptr, FUSED: tl.constexpr, BLOCK_T: tl.constexpr):
    """The prologue of a program that owns token tile ``tile``: (rows [BLOCK_T] int64, rm = rows < T, W).
    ``W``, FUSED only: the post's weights for the 4 destination streams (``post_weights``), loaded once."""
    rows = tile.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rm = rows < T
    if FUSED:
        W = (post_weights(post_in_ptr, comb_in_ptr, rows, rm, 0), post_weights(post_in_ptr, comb_in_ptr, rows, rm, 1),
             post_weights(post_in_ptr, comb_in_ptr, rows, rm, 2), post_weights(post_in_ptr, comb_in_ptr, rows, rm, 3))
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
def gates(acc_g, acc_c, ssq, K, rows, rm, scale_ptr, base_ptr, post_ptr, comb_ptr, T, rms_eps, hc_eps, post_mult,
          iters, store, HEAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """From the accumulated logits to the weights: the RMS factor of the flattened streams (applied AFTER the
    GEMM, one scalar per token), pre = σ(·) + eps (head: the gate), and, unless HEAD and only where ``store``,
    post = σ(·)·post_mult and comb = Sinkhorn(·) stored to ``post_ptr`` / ``comb_ptr``.

    acc_g [BLOCK_T, 16]: [pre 0..3 | post 4..7 | 0] (head: [gate | 0]); acc_c [BLOCK_T, 16]: comb logit (i, j)
    at 4i + j; ssq [BLOCK_T]: Σ X² over K = 4·Hd values. Returns pre as four [BLOCK_T] vectors w0..w3."""
    rinv = tl.math.rsqrt(ssq / K + rms_eps)
    i4 = tl.arange(0, 4)
    g3 = tl.reshape(acc_g * rinv[:, None], (BLOCK_T, 4, 4))  # row 0: pre (head: gate), row 1: post
    sel = i4[None, :, None]
    pre = tl.sigmoid(tl.sum(tl.where(sel == 0, g3, 0.0), axis=1) * tl.load(scale_ptr)
                     + tl.load(base_ptr + i4)[None, :]) + hc_eps  # [BLOCK_T, 4]
    if not HEAD:
        if store:
            post = tl.sigmoid(tl.sum(tl.where(sel == 1, g3, 0.0), axis=1) * tl.load(scale_ptr + 1)
                              + tl.load(base_ptr + 4 + i4)[None, :]) * post_mult
            tl.store(post_ptr + rows[:, None] * 4 + i4[None, :], post, mask=rm[:, None] & (i4 < 4)[None, :])
            cl = tl.reshape(acc_c * rinv[:, None], (BLOCK_T, 4, 4)) * tl.load(scale_ptr + 2) \
                + tl.load(base_ptr + 8 + i4[:, None] * 4 + i4[None, :])[None, :, :]
            comb = sinkhorn_tile(cl, iters, hc_eps)
            co = rows[:, None, None] * 16 + i4[None, :, None] * 4 + i4[None, None, :]
            tl.store(comb_ptr + co, comb, mask=co < T * 16)
    w0 = tl.sum(tl.where(i4[None, :] == 0, pre, 0.0), axis=1)
    w1 = tl.sum(tl.where(i4[None, :] == 1, pre, 0.0), axis=1)
    w2 = tl.sum(tl.where(i4[None, :] == 2, pre, 0.0), axis=1)
    w3 = tl.sum(tl.where(i4[None, :] == 3, pre, 0.0), axis=1)
    return w0, w1, w2, w3


@triton.jit
def layer_input_chunk(src_ptr, out_ptr, rows, rm, h, h_end, Hd, w0, w1, w2, w3, CG: tl.constexpr = False,
                      HW: tl.constexpr = False):
    """out[rows, h] = bf16(Σ_i pre_i · stream_i[rows, h]) for one chunk ``h`` of the hidden dim (h < h_end <= Hd).
    ``HW``: rounded by ``bf16_bits``' hardware path (the same bits)."""
    mask = rm[:, None] & (h < h_end)[None, :]
    _, _, _, _, r0, r1, r2, r3 = load_streams(src_ptr, rows[:, None] * (4 * Hd) + h[None, :], Hd, mask, CG)
    y = weighted4(w0, w1, w2, w3, r0, r1, r2, r3)
    tl.store(out_ptr + rows[:, None] * Hd + h[None, :], bf16_bits(y, HW).to(tl.int16, bitcast=True), mask=mask)


@triton.jit
def layer_input_range(src_ptr, out_ptr, rows, rm, h_begin, h_end, Hd, w0, w1, w2, w3, BLOCK: tl.constexpr,
                      CG: tl.constexpr = False, HW: tl.constexpr = False):
    """``layer_input_chunk`` over the hidden range [h_begin, h_end) in BLOCK-wide chunks, LAST chunk first:
    a pass that just read (or wrote) this range in order finds its latest chunks likeliest still in L2."""
    hh = tl.arange(0, BLOCK)
    n_chunks = tl.cdiv(h_end - h_begin, BLOCK)
    for c in range(0, n_chunks):
        layer_input_chunk(src_ptr, out_ptr, rows, rm, h_begin + (n_chunks - 1 - c) * BLOCK + hh, h_end, Hd,
                          w0, w1, w2, w3, CG, HW)


# ====================================================================================================
# Design 1: one kernel (hc_kernel)
# ====================================================================================================


@triton.jit
def gemm_stream(a, k, kmask, fs_ptr, K, acc_g, acc_c, DOT_FP32: tl.constexpr, HEAD: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """acc += a @ fnᵀ[k, :] for one stream chunk: a [BLOCK_T, BLOCK_K] bf16, fs = [G, 3, K, 16] bf16 (hi, mid,
    lo; group 0 = gate columns, group 1 = comb columns). Three bf16 dots per group reproduce the fp32 product
    exactly; the chunk's dots start from zero (module docstring: MMA truncation)."""
    n16 = tl.arange(0, 16)
    b_off = k.to(tl.int64)[:, None] * 16 + n16[None, :]  # [BLOCK_K, 16]
    bm = kmask[:, None] & (n16 < 16)[None, :]  # full-shape mask (the interpreter wants mask.shape == ptr.shape)
    part_g = tl.zeros_like(acc_g)
    part_c = tl.zeros_like(acc_c)
    for s in tl.static_range(3):
        part_g = dot(a, tl.load(fs_ptr + s * K * 16 + b_off, mask=bm, other=0.0), part_g, DOT_FP32)
        if not HEAD:
            part_c = dot(a, tl.load(fs_ptr + (3 + s) * K * 16 + b_off, mask=bm, other=0.0), part_c, DOT_FP32)
    return acc_g + part_g, acc_c + part_c


@triton.jit
def hc_kernel(
    res_ptr,  # int16 view of residual [T, 4, Hd] bf16 (contiguous): the streams read by pre / head,
    #           or, when FUSED, the streams *before* the post
    x_ptr,  # FUSED: int16 view of the sub-layer output x [T, Hd] bf16
    post_in_ptr,  # FUSED: [T, 4] fp32
    comb_in_ptr,  # FUSED: [T, 4, 4] fp32
    new_ptr,  # FUSED: int16 view of the new residual [T, 4, Hd] bf16 (written)
    fs_ptr,  # [G, 3, 4·Hd, 16] bf16: split_fn(fn)
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
        a0, a1, a2, a3, r0, r1, r2, r3 = stream_chunk(res_ptr, x_ptr, new_ptr, W, rows, h, Hd,
                                                      rm[:, None] & hm[None, :], FUSED)
        ssq += tl.sum(weighted4(r0, r1, r2, r3, r0, r1, r2, r3, False), axis=1)  # Σ_i r_i², fixed FMA order
        acc_g, acc_c = gemm_stream(a0, h, hm, fs_ptr, K, acc_g, acc_c, DOT_FP32, HEAD, BLOCK_K)
        acc_g, acc_c = gemm_stream(a1, Hd + h, hm, fs_ptr, K, acc_g, acc_c, DOT_FP32, HEAD, BLOCK_K)
        acc_g, acc_c = gemm_stream(a2, 2 * Hd + h, hm, fs_ptr, K, acc_g, acc_c, DOT_FP32, HEAD, BLOCK_K)
        acc_g, acc_c = gemm_stream(a3, 3 * Hd + h, hm, fs_ptr, K, acc_g, acc_c, DOT_FP32, HEAD, BLOCK_K)

    # ---- RMS factor, gates, Sinkhorn (in registers) --------------------------------------------------------
    w0, w1, w2, w3 = gates(acc_g, acc_c, ssq, K, rows, rm, scale_ptr, base_ptr, post_ptr, comb_ptr, T, rms_eps,
                           hc_eps, post_mult, iters, True, HEAD, BLOCK_T)

    # ---- pass 2: x = Σ_i pre_i · stream_i, last chunk first (it is the likeliest to still be in L2) ----
    if FUSED:
        tl.debug_barrier()  # the new streams written above by other threads of this program
        src_ptr = new_ptr
    else:
        src_ptr = res_ptr
    layer_input_range(src_ptr, out_ptr, rows, rm, 0, Hd, Hd, w0, w1, w2, w3, BLOCK_K)


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
def gemm_stream32(a, k, kmask, fs_ptr, K, acc, DOT_FP32: tl.constexpr, NG: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += a @ fnᵀ[k, :NG] for one stream chunk, NG = 32 (gate group | comb group) or 16 (head: one group).
    fs = [G, 3, K, 16] bf16 (split_fn); column n of the tile is column n % 16 of group n // 16. Per-chunk
    zero-start accumulator, as in ``gemm_stream``."""
    n = tl.arange(0, NG)
    b_off = ((n // 16) * 3 * K * 16 + n % 16).to(tl.int64)[None, :] + k.to(tl.int64)[:, None] * 16  # [BLOCK_K, NG]
    bm = kmask[:, None] & (n < NG)[None, :]
    part = tl.zeros_like(acc)
    for s in tl.static_range(3):
        part = dot(a, tl.load(fs_ptr + s * K * 16 + b_off, mask=bm, other=0.0), part, DOT_FP32)
    return acc + part


@triton.jit
def partial_mix(res_ptr, x_ptr, new_ptr, fs_ptr, W, rows, rm, h_begin, h_end, Hd, DOT_FP32: tl.constexpr,
                FUSED: tl.constexpr, NG: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """The mix GEMM and Σ X² of a token tile over the hidden range [h_begin, h_end) (whole BLOCK_K chunks, the
    last one cut at Hd), all 4 streams: (acc [BLOCK_T, NG] fp32 = [pre | post | 0 | comb (i, j) at 16 + 4i + j]
    (head: [gate | 0]), ssq [BLOCK_T] fp32). FUSED: the post is applied and the new streams stored on the way
    (``stream_chunk``). 3 narrow dots per stream (``gemm_stream32``), each stream's chain zero-started. (The
    one-pass kernel's version, with wide dots: ``partial_mix_one_pass``.)"""
    kk = tl.arange(0, BLOCK_K)
    K = 4 * Hd
    acc = tl.zeros((BLOCK_T, NG), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for h0 in range(h_begin, h_end, BLOCK_K):
        h = h0 + kk
        hm = h < h_end
        a0, a1, a2, a3, r0, r1, r2, r3 = stream_chunk(res_ptr, x_ptr, new_ptr, W, rows, h, Hd,
                                                      rm[:, None] & hm[None, :], FUSED)
        ssq += tl.sum(weighted4(r0, r1, r2, r3, r0, r1, r2, r3, False), axis=1)  # Σ_i r_i², fixed FMA order
        acc = gemm_stream32(a0, h, hm, fs_ptr, K, acc, DOT_FP32, NG, BLOCK_K)
        acc = gemm_stream32(a1, Hd + h, hm, fs_ptr, K, acc, DOT_FP32, NG, BLOCK_K)
        acc = gemm_stream32(a2, 2 * Hd + h, hm, fs_ptr, K, acc, DOT_FP32, NG, BLOCK_K)
        acc = gemm_stream32(a3, 3 * Hd + h, hm, fs_ptr, K, acc, DOT_FP32, NG, BLOCK_K)
    return acc, ssq


@triton.jit
def store_partial(ws_ptr, ssq_ptr, wo, rm, acc, ssq, NG: tl.constexpr):
    """A tile's partial mix and Σ X² into the workspaces [splits, T, 32] / [splits, T] at rows ``wo``."""
    n = tl.arange(0, NG)
    tl.store(ws_ptr + wo[:, None] * 32 + n[None, :], acc, mask=rm[:, None] & (n < NG)[None, :])
    tl.store(ssq_ptr + wo, ssq, mask=rm)


@triton.jit
def sum_partials(ws_ptr, ssq_ptr, rows, rm, T, splits, HEAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """(acc_g, acc_c [BLOCK_T, 16], ssq [BLOCK_T]): the partials of ``rows`` summed in split order (fixed, so
    the same sum on every run, whichever program does it), in the layout ``gates`` takes."""
    n16 = tl.arange(0, 16)
    m16 = rm[:, None] & (n16 < 16)[None, :]
    acc_g = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s in range(0, splits):
        wo = s * T + rows
        acc_g += tl.load(ws_ptr + wo[:, None] * 32 + n16[None, :], mask=m16, other=0.0)
        if not HEAD:
            acc_c += tl.load(ws_ptr + wo[:, None] * 32 + 16 + n16[None, :], mask=m16, other=0.0)
        ssq += tl.load(ssq_ptr + wo, mask=rm, other=0.0)
    return acc_g, acc_c, ssq


@triton.jit
def hc_partial_kernel(
    res_ptr,  # int16 view of residual [T, 4, Hd] bf16 (FUSED: the streams before the post)
    x_ptr,  # FUSED: int16 view of x [T, Hd] bf16
    post_in_ptr,  # FUSED: [T, 4] fp32
    comb_in_ptr,  # FUSED: [T, 4, 4] fp32
    new_ptr,  # FUSED: int16 view of the new residual [T, 4, Hd] bf16 (written)
    fs_ptr,  # [G, 3, 4·Hd, 16] bf16: split_fn(fn)
    ws_ptr,  # [splits, T, 32] fp32 workspace: partial mix columns (head: the first 16)
    ssq_ptr,  # [splits, T] fp32 workspace: partial Σ X²
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
    acc, ssq = partial_mix(res_ptr, x_ptr, new_ptr, fs_ptr, W, rows, rm, h_begin, h_end, Hd, DOT_FP32, FUSED, NG,
                           BLOCK_T, BLOCK_K)
    store_partial(ws_ptr, ssq_ptr, split.to(tl.int64) * T + rows, rm, acc, ssq, NG)


@triton.jit
def hc_finish_kernel(
    src_ptr,  # int16 view of the streams x is summed from [T, 4, Hd] bf16 (FUSED: the new streams)
    ws_ptr,  # [splits, T, 32] fp32 partial mixes from hc_partial_kernel
    ssq_ptr,  # [splits, T] fp32 partial Σ X²
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
    acc_g, acc_c, ssq = sum_partials(ws_ptr, ssq_ptr, rows, rm, T, splits, HEAD, BLOCK_T)
    # every hidden part needs pre; part 0 alone stores post and comb
    w0, w1, w2, w3 = gates(acc_g, acc_c, ssq, 4 * Hd, rows, rm, scale_ptr, base_ptr, post_ptr, comb_ptr, T,
                           rms_eps, hc_eps, post_mult, iters, part == 0, HEAD, BLOCK_T)
    # x = Σ_i pre_i · stream_i over this part's hidden range, last chunk first
    h_begin = part * h_per_part
    layer_input_range(src_ptr, out_ptr, rows, rm, h_begin, tl.minimum(h_begin + h_per_part, Hd), Hd,
                      w0, w1, w2, w3, BLOCK_H)


# ====================================================================================================
# Design 3: one pass (hc_one_pass_kernel), MhcLaunch(one_pass=True) — issue 14, item 3
#
# Why: split-K reads the streams twice from HBM (its finish kernel starts after the whole partial kernel, so
# only the last ~third of the 134 MB of streams is still in the 50 MB L2), and the one-kernel design streams
# all of fn from L2 for every 16 tokens. A token tile's streams (128 tokens × 4 × 4096 × 2 B = 4 MB) cannot
# stay in shared memory or registers (227 KB + 256 KB per SM) across the whole K loop, and the weighted sum
# needs the gates, which need the whole K loop. So: ONE launch in which the second read of every stream byte
# follows the first by about one program's lifetime, and comes from L2.
#
# Work items. A token tile of BLOCK_T tokens × a hidden slice of ``chunks_per_slice`` BLOCK_K chunks (all 4
# streams) is one item, numbered v = tile·slices + slice. A program takes its item number from an atomic
# TICKET counter (not program_id): a program holding ticket v knows that every ticket < v was taken by a
# program that is already running, which makes the one wait below deadlock-free on any GPU, whatever order
# the hardware starts programs in (and in the interpreter, which runs programs one after another, the wait
# is always already satisfied).
#
# Program v (tile g, slice s) runs two phases:
#   A. partial of tile g, slice s: the mix GEMM + Σ X² of that slice (``partial_mix_one_pass``; FUSED: the
#      post first, the new streams stored), stored to the workspace. Then it counts itself in (atomic,
#      acq_rel) on tile g's arrival counter; the LAST of the tile's ``slices`` programs to arrive sums the
#      partials (``sum_partials_rounds``: one fixed order, the same sum whichever program is last, so the
#      result is deterministic), runs ``gates`` (post, comb stored), publishes the four pre weights and raises
#      tile g's READY flag (release).
#   B. layer input of tile g − LAG, slice s: waits for that tile's READY flag (acquire; its programs hold
#      tickets < v, so they are running, and have usually finished), loads its pre weights and re-reads
#      slice s of tile g − LAG's streams (FUSED: the new streams, through L2 only: ``.cg``) — read about one
#      program lifetime ago, so from L2 — for x = Σ_i pre_i·stream_i. The last LAG tiles are finished by
#      LAG·slices extra programs that have no phase A.
# Every program does the same work (one partial slice + one weighted-sum slice): no tail of finishers.
#
# The GEMM: per stream chunk ONE dot of N = 128 = [hi | mid | lo | 0] × 32 columns (``gemm_wide``) instead
# of three dots of N = 32, the four streams' dots chained into one zero-started partial per chunk (each bf16
# part in its own columns, so the truncation the module docstring describes stays relative to a chunk's
# partial sum) and folded (hi + mid + lo) in registers (``fold_parts``).
#
# What the H200 measured (session 3, T = Hd = 4096): pre 229 µs (18.3 % of the copy bound), 170 µs with
# slices of 256 (24.6 %); fused 410 / 308 µs; head 136 µs — 2–3× under the byte model below. Compiled for
# sm_90a with Triton 3.6 on a CPU (benchmarks/mhc_compile_check.py), what serialises it:
#   * the tile's LAST ARRIVAL summed the 32 slices' partials in a loop whose loads are consumed by the next
#     add before the next loads issue: 32 dependent L2 round trips (~20 µs), then Sinkhorn, while phase B
#     of the next tile's programs spun on its READY flag. Fitted to the four measured pre rows, a program
#     lived ~29 µs for ~9 µs of its own work;
#   * one program per SM (160 KB of shared memory): nothing hides a program's own latencies (the ticket,
#     the pipeline fill, the release fence, the READY wait, phase B's two load rounds);
#   * four MMA waits per chunk, and the streams loaded through an int16 pointer and bitcast in registers,
#     which made every dot read its A operand from registers (204 registers);
#   * the fused K loop is instruction-bound: 1306 instructions per 16-dim chunk, a third of them the
#     integer round-to-nearest-even of the new streams.
# The switches (constexprs here, fields of MhcLaunch, each timed by benchmarks/mhc_sweep.py):
#   SUM_UNROLL  the last arrival has SUM_UNROLL slices' loads in flight per round (the same sum, in the same
#               order): 32 / SUM_UNROLL round trips;
#   LAG         phase B finishes the tile LAG tiles back, so its READY flag was raised long ago;
#   PREFETCH    (pre, head) phase B's first chunk of streams is loaded BEFORE the flag wait (the fused op's
#               phase B reads streams other programs wrote: after the wait). +64 registers;
#   ONE_DOT     1: the 4 streams' chunks joined side by side in registers, ONE dot (one MMA wait) per chunk;
#               2 (pre, head): the 4 streams' chunk loaded as ONE [BLOCK_T, 4·BLOCK_K] tile through a bf16
#               pointer, so the one dot reads it from shared memory (pre at BLOCK_K 32: 140 registers);
#   CHAIN       the MMAs of the whole slice chain into one partial (folded once per slice), so the dot's
#               accumulator is carried by the loop and Triton keeps one wgmma group in flight across chunks
#               (wait_group 1). Only with ONE_DOT = 2: with the A operand in registers ptxas serialises
#               every wgmma (its C7515). The MMA truncation is then relative to a slice's partial: 8× longer
#               chains than per chunk, 32× shorter than the chain that failed; the sweep checks it;
#   WS_GATE / WS_STRIDE  the workspace rows packed to the live columns (pre 8 + 16, head 4) instead of 32;
#   HW_ROUND    (compiled only) bf16 outputs rounded by the hardware conversion, NaN made 0x7FC0 after it
#               (``bf16_bits``: the same bits): the fused K loop 1290 -> 1041 instructions, phase B 719 -> 605;
#   plus BLOCK_K / num_stages / maxnreg: at BLOCK_K 16, 3 stages and <= 128 registers, pre and head fit TWO
#   programs per SM (80 KB, 128 registers, no spills); BLOCK_T 64 at 4 warps: pre 3 per SM, fused 2 per SM.
# Compile figures of every candidate: benchmarks/mhc.md, "One-pass variants (issue 14)".
#
# Bytes at T = Hd = 4096 with BLOCK_T 128, BLOCK_K 32, slices of 128 dims (32 tiles × 32 slices), pre:
#   compulsory: streams 134.2 MB + layer input 33.6 MB + fn 1.6 MB + post/comb 0.3 MB = 169.7 MB = 41 µs at
#        the H200's 4.1 TB/s copy rate (the bound the bench divides by);
#   HBM actually: + the fn split 3.1 MB once + the workspace 17.3 MB (slices × T × 33 fp32, written once;
#        13.1 MB packed) + re-read misses                                   ≈ 190 MB ≈ 46 µs;
#   L2 (SM side): streams 134 MB twice, fn split 32 tiles × 3.1 MB = 101 MB, workspace 35 MB, layer input
#        34 MB                                                                ≈ 440 MB ≈ 63–80 µs at 5.5–7 TB/s;
#   re-read distance: between the two reads of a byte the GPU reads about (132 + LAG·slices) programs ×
#        128 KB ≈ 21 MB (LAG 1) of streams: under the 50 MB L2 (the 3.1 MB fn split stays hot throughout);
#   tensor cores: 2 · 4096 · 16 384 · 128 = 17.2 GFLOP (72 of the 128 columns useful), ≈ 38 µs at 60 % of
#        the measured 763 TFLOP/s, overlapped with the loads by the pipeline.
# Fused post+pre: compulsory 337 MB (82 µs); HBM ≈ 355 MB, L2 ≈ 600 MB.
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
def gemm_tile(a, k, kmask, fs_ptr, K, part, DOT_FP32: tl.constexpr, NG: tl.constexpr, FN_LAYOUT: tl.constexpr = 0):
    """part + a @ [hi | mid | lo | 0]ᵀ[k, :] in ONE dot of N = 4·NG (NG = 32; head 16): a [BLOCK_T, n_k] bf16,
    k [n_k] its fn rows (``kmask``: rows past the slice read as zero). Three times fewer MMA waits than three
    narrow dots, full-width tensor-core instructions; the parts are summed later (``fold_parts``).
    ``FN_LAYOUT`` (what ``fs_ptr`` holds): 0 ``split_fn``'s [G, 3, K, 16]; 1 ``split_fn_wide``'s [K, 4·NG] (row k
    = the tile's row, part 3 zero and masked: a warp's cp.async of two rows is 2 × 4·NG × 2 contiguous bytes
    instead of 8 pieces of 64); 2 its transpose [4·NG, K] (k contiguous: the tile is loaded as [4·NG, n_k] and
    fed to the dot transposed, so the wgmma reads a K-major B operand instead of transposing an N-major one).
    (Layout 3, the same copy as 2 without its zero quarter, is ``gemm_tile_three_parts``.)"""
    tl.static_assert(FN_LAYOUT <= 2)
    if FN_LAYOUT == 2:
        n = tl.arange(0, 4 * NG)
        bt = tl.load(fs_ptr + n.to(tl.int64)[:, None] * K + k.to(tl.int64)[None, :],
                     mask=(n < 3 * NG)[:, None] & kmask[None, :], other=0.0)  # [4·NG, n_k]
        return dot(a, tl.trans(bt), part, DOT_FP32)
    if FN_LAYOUT == 1:
        n = tl.arange(0, 4 * NG)
        b_off = n.to(tl.int64)[None, :] + k.to(tl.int64)[:, None] * (4 * NG)  # [n_k, 4·NG]
        live = n < 3 * NG
    else:
        col, live = fn_columns(K, NG)
        b_off = col[None, :] + k.to(tl.int64)[:, None] * 16  # [n_k, 4·NG]
    return dot(a, tl.load(fs_ptr + b_off, mask=kmask[:, None] & live[None, :], other=0.0), part, DOT_FP32)


@triton.jit
def gemm_tile_three_parts(a, k, kmask, fs_ptr, K, DOT_FP32: tl.constexpr, NG: tl.constexpr, BLOCK_T: tl.constexpr):
    """``FN_LAYOUT`` 3: a @ fnᵀ[k, :] as [BLOCK_T, NG] fp32, folded, from the transposed copy of layout 2 without
    its zero quarter: one zero-started dot of N = 2·NG for [hi | mid] (rows 0..2·NG) and one of N = NG for lo
    (rows 2·NG..3·NG), so 3·NG columns of MMA and fold instead of 4·NG. (hi + mid) + lo, in fp32."""
    k64 = k.to(tl.int64)[None, :]
    n2 = tl.arange(0, 2 * NG)
    n1 = 2 * NG + tl.arange(0, NG)
    b2 = tl.load(fs_ptr + n2.to(tl.int64)[:, None] * K + k64, mask=(n2 < 2 * NG)[:, None] & kmask[None, :], other=0.0)
    b1 = tl.load(fs_ptr + n1.to(tl.int64)[:, None] * K + k64, mask=(n1 < 3 * NG)[:, None] & kmask[None, :], other=0.0)
    p2 = dot(a, tl.trans(b2), tl.zeros((BLOCK_T, 2 * NG), dtype=tl.float32), DOT_FP32)  # [hi | mid] products
    p1 = dot(a, tl.trans(b1), tl.zeros((BLOCK_T, NG), dtype=tl.float32), DOT_FP32)  # lo products
    return tl.sum(tl.reshape(p2, (BLOCK_T, 2, NG)), axis=1) + p1


@triton.jit
def gemm_tile_three_parts_chained(a, k, kmask, fs_ptr, K, p2, p1, DOT_FP32: tl.constexpr, NG: tl.constexpr):
    """``gemm_tile_three_parts`` without the fold: (p2 + a @ [hi | mid]ᵀ[k, :], p1 + a @ loᵀ[k, :]), the dots
    accumulating into the caller's unfolded partials (``FOLD_EVERY`` > 1: a few steps chained, then folded)."""
    k64 = k.to(tl.int64)[None, :]
    n2 = tl.arange(0, 2 * NG)
    n1 = 2 * NG + tl.arange(0, NG)
    b2 = tl.load(fs_ptr + n2.to(tl.int64)[:, None] * K + k64, mask=(n2 < 2 * NG)[:, None] & kmask[None, :], other=0.0)
    b1 = tl.load(fs_ptr + n1.to(tl.int64)[:, None] * K + k64, mask=(n1 < 3 * NG)[:, None] & kmask[None, :], other=0.0)
    return dot(a, tl.trans(b2), p2, DOT_FP32), dot(a, tl.trans(b1), p1, DOT_FP32)


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
def partial_mix_one_pass(res_ptr, x_ptr, new_ptr, fs_ptr, W, rows, rm, h_begin, h_end, Hd, DOT_FP32: tl.constexpr,
                         FUSED: tl.constexpr, NG: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                         ONE_DOT: tl.constexpr, CHAIN: tl.constexpr, HW: tl.constexpr, STREAM_K: tl.constexpr = False,
                         FN_LAYOUT: tl.constexpr = 0, FOLD_EVERY: tl.constexpr = 1):
    """``partial_mix`` with wide dots (``gemm_tile``), for the one-pass kernel: (acc [BLOCK_T, NG] fp32, ssq
    [BLOCK_T] fp32) of the hidden range [h_begin, h_end), all 4 streams (FUSED: the post applied, the new
    streams stored). Per BLOCK_K chunk of the 4 streams:

    * ``ONE_DOT = 0``: four dots of K = BLOCK_K, one per stream (four MMA waits);
    * ``ONE_DOT = 1``: the four tiles joined side by side in registers (``join4``), one dot of K = 4·BLOCK_K;
      the tiles and their Σ X² are exactly those of 0, so 0 and 1 give the same bits;
    * ``ONE_DOT = 2`` (FUSED: as 1): ONE [BLOCK_T, 4·BLOCK_K] load of the 4 streams' chunk (column r = stream
      r // BLOCK_K, dim r % BLOCK_K), one dot that reads it from shared memory; Σ X² summed over that tile.

    Not ``CHAIN``: each chunk's MMAs start from zero, the folded chunk product is added to ``acc`` in fp32
    (the MMA-truncation rule of the module docstring, per chunk). ``CHAIN``: the range's MMAs chain into one
    [BLOCK_T, 4·NG] partial, folded once at the end, so the dot's accumulator is carried by the loop.

    ``STREAM_K`` (not FUSED, not CHAIN; the chunked partial kernel): per step ONE stream's BLOCK_K dims, a
    [BLOCK_T, BLOCK_K] tile whose rows are contiguous in memory (BLOCK_K = 64: 128 bytes, the NVMMA swizzle's
    row), the steps walking the streams fastest (4 steps per BLOCK_K dims); one zero-started dot per step, Σ X²
    over the step's tile. ``FN_LAYOUT``: where the fn tiles come from (``gemm_tile``). ``FOLD_EVERY`` (STREAM_K
    with FN_LAYOUT 3): the dots of that many consecutive steps (1, 2 or 4: the 4 streams' tiles of one BLOCK_K
    range at 4) chain into one zero-started partial, folded and added to ``acc`` once; at 4 that is one
    truncation chain of K = 4·BLOCK_K, as ``ONE_DOT = 2``'s one dot per chunk, and a quarter of the folds and
    MMA waits of 1."""
    kk = tl.arange(0, BLOCK_K)
    r4 = tl.arange(0, 4 * BLOCK_K)
    K = 4 * Hd
    acc = tl.zeros((BLOCK_T, NG), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if STREAM_K:
        tl.static_assert(not FUSED and not CHAIN)
        tl.static_assert(FOLD_EVERY == 1 or (FN_LAYOUT == 3 and (FOLD_EVERY == 0 or 4 % FOLD_EVERY == 0)))
        p = res_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
        p2 = tl.zeros((BLOCK_T, 2 * NG), dtype=tl.float32)  # FOLD_EVERY > 1: this group's [hi | mid] products
        p1 = tl.zeros((BLOCK_T, NG), dtype=tl.float32)  # ... and its lo products
        for c in range(0, 4 * tl.cdiv(h_end - h_begin, BLOCK_K)):
            h = h_begin + (c // 4) * BLOCK_K + kk
            hm = h < h_end
            k = (c % 4) * Hd + h  # the fn rows of stream c % 4's dims h: its values start at (4t + c % 4)·Hd
            a = tl.load(p + rows[:, None] * (4 * Hd) + k[None, :], mask=rm[:, None] & hm[None, :], other=0.0)
            x = a.to(tl.float32)
            ssq += tl.sum(x * x, axis=1)
            if FN_LAYOUT == 3 and FOLD_EVERY == 0:  # the whole slice chained: a plain matmul loop
                p2, p1 = gemm_tile_three_parts_chained(a, k, hm, fs_ptr, K, p2, p1, DOT_FP32, NG)
            elif FN_LAYOUT == 3 and FOLD_EVERY > 1:
                # a group's first step starts its dots from zero. Written as a reset right before the dots (not
                # after the fold), so that Triton turns it into the MMA's "ignore the accumulator" flag and the
                # partials' registers are touched by MMAs only: anything else in between makes ptxas serialise
                # every wgmma (its warning C7515)
                if c % FOLD_EVERY == 0:
                    p2 = tl.zeros((BLOCK_T, 2 * NG), dtype=tl.float32)
                    p1 = tl.zeros((BLOCK_T, NG), dtype=tl.float32)
                p2, p1 = gemm_tile_three_parts_chained(a, k, hm, fs_ptr, K, p2, p1, DOT_FP32, NG)
                if c % FOLD_EVERY == FOLD_EVERY - 1:  # the step count is a multiple of 4: no group is left over
                    acc += tl.sum(tl.reshape(p2, (BLOCK_T, 2, NG)), axis=1) + p1
            elif FN_LAYOUT == 3:
                acc += gemm_tile_three_parts(a, k, hm, fs_ptr, K, DOT_FP32, NG, BLOCK_T)
            else:
                part = gemm_tile(a, k, hm, fs_ptr, K, tl.zeros((BLOCK_T, 4 * NG), dtype=tl.float32), DOT_FP32, NG,
                                 FN_LAYOUT)
                acc += fold_parts(part, NG, BLOCK_T)
        if FN_LAYOUT == 3 and FOLD_EVERY == 0:
            acc = tl.sum(tl.reshape(p2, (BLOCK_T, 2, NG)), axis=1) + p1
    else:
        run = tl.zeros((BLOCK_T, 4 * NG), dtype=tl.float32)  # CHAIN: the range's products so far, per bf16 part
        for h0 in range(h_begin, h_end, BLOCK_K):
            if CHAIN:
                part = run
            else:
                part = tl.zeros((BLOCK_T, 4 * NG), dtype=tl.float32)
            if (ONE_DOT == 2) and not FUSED:
                h4 = h0 + r4 % BLOCK_K
                k4 = (r4 // BLOCK_K) * Hd + h4  # = the fn row of column r: token t's stream i starts at (4t + i)·Hd
                p = res_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
                a = tl.load(p + rows[:, None] * (4 * Hd) + k4[None, :], mask=rm[:, None] & (h4 < h_end)[None, :], other=0.0)
                x = a.to(tl.float32)
                ssq += tl.sum(x * x, axis=1)
                part = gemm_tile(a, k4, h4 < h_end, fs_ptr, K, part, DOT_FP32, NG, FN_LAYOUT)
            else:
                h = h0 + kk
                hm = h < h_end
                if FUSED:
                    a0, a1, a2, a3, r0, r1, r2, r3 = stream_chunk(res_ptr, x_ptr, new_ptr, W, rows, h, Hd,
                                                                  rm[:, None] & hm[None, :], FUSED, HW)
                else:  # through a bf16 pointer, so that the dots read the tiles from shared memory
                    a0, a1, a2, a3, r0, r1, r2, r3 = load_streams_bf16(res_ptr, rows[:, None] * (4 * Hd) + h[None, :], Hd,
                                                                       rm[:, None] & hm[None, :])
                ssq += tl.sum(weighted4(r0, r1, r2, r3, r0, r1, r2, r3, False), axis=1)  # Σ_i r_i², fixed FMA order
                if ONE_DOT == 0:
                    part = gemm_tile(a0, h, hm, fs_ptr, K, part, DOT_FP32, NG, FN_LAYOUT)
                    part = gemm_tile(a1, Hd + h, hm, fs_ptr, K, part, DOT_FP32, NG, FN_LAYOUT)
                    part = gemm_tile(a2, 2 * Hd + h, hm, fs_ptr, K, part, DOT_FP32, NG, FN_LAYOUT)
                    part = gemm_tile(a3, 3 * Hd + h, hm, fs_ptr, K, part, DOT_FP32, NG, FN_LAYOUT)
                else:
                    h4 = h0 + r4 % BLOCK_K
                    part = gemm_tile(join4(a0, a1, a2, a3, BLOCK_T, BLOCK_K), (r4 // BLOCK_K) * Hd + h4, h4 < h_end,
                                     fs_ptr, K, part, DOT_FP32, NG, FN_LAYOUT)
            if CHAIN:
                run = part
            else:
                acc += fold_parts(part, NG, BLOCK_T)
        if CHAIN:
            acc = fold_parts(run, NG, BLOCK_T)
    return acc, ssq


@triton.jit
def store_partial_packed(ws_ptr, ssq_ptr, wo, rm, acc, ssq, NG: tl.constexpr, WS_GATE: tl.constexpr,
                         WS_STRIDE: tl.constexpr):
    """acc [BLOCK_T, NG] (``partial_mix`` layout: gate group at columns 0..15, comb group at 16..31) into the
    workspace rows ``wo`` of stride WS_STRIDE: the first WS_GATE gate columns at 0.., the comb group at
    WS_GATE.. (WS_GATE = 16, WS_STRIDE = 32: the columns as they are; 8 / 24 (head 4 / 4): the live ones
    only). ssq into its own [slices, T] workspace."""
    n = tl.arange(0, NG)
    dst = tl.where(n < 16, n, n - 16 + WS_GATE)
    keep = (n < WS_GATE) | (n >= 16)
    tl.store(ws_ptr + wo[:, None] * WS_STRIDE + dst[None, :], acc, mask=rm[:, None] & keep[None, :])
    tl.store(ssq_ptr + wo, ssq, mask=rm)


@triton.jit
def sum_partials_rounds(ws_ptr, ssq_ptr, rows, rm, T, slices, HEAD: tl.constexpr, BLOCK_T: tl.constexpr,
                        UNROLL: tl.constexpr, WS_GATE: tl.constexpr, WS_STRIDE: tl.constexpr, n_gate, n_comb,
                        CACHE: tl.constexpr):
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
            at = ws_ptr + wo[:, None] * WS_STRIDE + n16[None, :]
            acc_g += tl.load(at, mask=mg & ok[:, None], other=0.0, cache_modifier=CACHE)
            if not HEAD:
                acc_c += tl.load(at + WS_GATE, mask=mc & ok[:, None], other=0.0, cache_modifier=CACHE)
            ssq += tl.load(ssq_ptr + wo, mask=rm & ok, other=0.0, cache_modifier=CACHE)
    return acc_g, acc_c, ssq


@triton.jit
def hc_one_pass_kernel(
    res_ptr,  # residual [T, 4, Hd] as int16 (FUSED: the streams before the post); contiguous, as are all below
    x_ptr,  # FUSED: x [T, Hd] as int16
    post_in_ptr,  # FUSED: the post weights [T, 4] fp32 the new streams are made with
    comb_in_ptr,  # FUSED: comb [T, 4, 4] fp32, source i -> destination j
    new_ptr,  # FUSED: the new residual [T, 4, Hd] as int16 (written in phase A, re-read in phase B)
    fs_ptr,  # split_fn(fn): [G, 3, 4·Hd, 16] bf16
    scale_ptr,  # [3] fp32 ([1] head)
    base_ptr,  # [24] fp32 ([4] head)
    post_ptr,  # [T, 4] fp32 out (not HEAD)
    comb_ptr,  # [T, 4, 4] fp32 out (not HEAD)
    out_ptr,  # int16 view of the layer input (head: the output) [T, Hd] bf16
    ws_ptr,  # [slices, T, WS_STRIDE] fp32 workspace: partial mixes
    ssq_ptr,  # [slices, T] fp32 workspace: partial Σ X²
    wpre_ptr,  # [T, 4] fp32 workspace: the pre weights (head: the gates), published per tile
    sync_ptr,  # [1 + 2·n_tiles] int32, ZEROED before the launch: ticket | arrivals per tile | READY per tile
    T,
    Hd,
    n_tiles,  # cdiv(T, BLOCK_T)
    slices,  # hidden slices per tile (the grid is (n_tiles + LAG)·slices programs)
    chunks_per_slice,  # BLOCK_K chunks per slice
    rms_eps,
    hc_eps,
    post_mult,
    iters,
    HEAD: tl.constexpr,
    FUSED: tl.constexpr,
    BLOCK_T: tl.constexpr,  # >= 16 (the M side of tl.dot)
    BLOCK_K: tl.constexpr,  # >= 16 (the K side of tl.dot)
    BLOCK_H: tl.constexpr,  # hidden dims per chunk of phase B (the weighted sum)
    LAG: tl.constexpr,  # >= 1: phase B finishes the tile LAG tiles behind phase A's
    SPIN_LIMIT: tl.constexpr,  # polls of a READY flag before giving up (then that slice is written as NaN)
    SUM_UNROLL: tl.constexpr,  # slices' partials per load round of the last arrival's sum
    ONE_DOT: tl.constexpr,  # one dot per chunk for the 4 streams (gemm_joined) instead of four
    CHAIN: tl.constexpr,  # the slice's MMAs in one chain (partial_mix_one_pass)
    WS_GATE: tl.constexpr,  # gate columns kept per workspace row (16: all; pre 8, head 4: the live ones)
    WS_STRIDE: tl.constexpr,  # workspace row length (32, or pre 24 / head 4 packed)
    PREFETCH: tl.constexpr,  # not FUSED: phase B's first stream chunk loaded before the READY wait
    HW_ROUND: tl.constexpr,  # compiled only: bf16 outputs rounded by the hardware conversion (bf16_bits)
    DOT_FP32: tl.constexpr,
):
    tl.static_assert(BLOCK_K >= 16)
    tl.static_assert(BLOCK_T >= 16)
    tl.static_assert(LAG >= 1)
    tl.static_assert(not (PREFETCH and FUSED))  # the fused phase B reads streams written in this launch
    NG: tl.constexpr = 16 if HEAD else 32
    v = tl.atomic_add(sync_ptr, 1)  # the ticket: this program's work item
    tile = v // slices
    s = v % slices
    h_begin = s * chunks_per_slice * BLOCK_K
    h_end = tl.minimum(h_begin + chunks_per_slice * BLOCK_K, Hd)

    # ---- phase A: the partial mix of (tile, slice s); the tile's last arrival runs the gates ---------
    if tile < n_tiles:
        rows, rm, W = token_tile(tile, T, post_in_ptr, comb_in_ptr, FUSED, BLOCK_T)
        acc, ssq = partial_mix_one_pass(res_ptr, x_ptr, new_ptr, fs_ptr, W, rows, rm, h_begin, h_end, Hd, DOT_FP32,
                                        FUSED, NG, BLOCK_T, BLOCK_K, ONE_DOT, CHAIN, HW_ROUND)
        store_partial_packed(ws_ptr, ssq_ptr, s.to(tl.int64) * T + rows, rm, acc, ssq, NG, WS_GATE, WS_STRIDE)
        tl.debug_barrier()  # every thread's stores (partials; FUSED: new streams) before the release below
        if tl.atomic_add(sync_ptr + 1 + tile, 1, sem="acq_rel", scope="gpu") == slices - 1:  # the last one
            acc_g, acc_c, ssq = sum_partials_rounds(ws_ptr, ssq_ptr, rows, rm, T, slices, HEAD, BLOCK_T, SUM_UNROLL,
                                                    WS_GATE, WS_STRIDE, WS_GATE, 16, ".cg")
            w0, w1, w2, w3 = gates(acc_g, acc_c, ssq, 4 * Hd, rows, rm, scale_ptr, base_ptr, post_ptr, comb_ptr,
                                   T, rms_eps, hc_eps, post_mult, iters, True, HEAD, BLOCK_T)
            tl.store(wpre_ptr + rows * 4, w0, mask=rm)
            tl.store(wpre_ptr + rows * 4 + 1, w1, mask=rm)
            tl.store(wpre_ptr + rows * 4 + 2, w2, mask=rm)
            tl.store(wpre_ptr + rows * 4 + 3, w3, mask=rm)
            tl.debug_barrier()
            tl.atomic_xchg(sync_ptr + 1 + n_tiles + tile, 1, sem="release", scope="gpu")

    # ---- phase B: the layer input of (tile − LAG, slice s), from L2 ---------------------------------------
    prev = tile - LAG
    if (prev >= 0) & (prev < n_tiles):
        rows = prev.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        rm = rows < T
        hh = tl.arange(0, BLOCK_H)
        n_chunks = tl.cdiv(h_end - h_begin, BLOCK_H)
        if PREFETCH:  # the range's LAST chunk (layer_input_range's first), read before the wait hides it
            hl = h_begin + (n_chunks - 1) * BLOCK_H + hh
            ml = rm[:, None] & (hl < h_end)[None, :]
            _, _, _, _, q0, q1, q2, q3 = load_streams(res_ptr, rows[:, None] * (4 * Hd) + hl[None, :], Hd, ml)
        ready = tl.atomic_add(sync_ptr + 1 + n_tiles + prev, 0, sem="acquire", scope="gpu")
        polls = 0
        while (ready == 0) & (polls < SPIN_LIMIT):
            ready = tl.atomic_add(sync_ptr + 1 + n_tiles + prev, 0, sem="acquire", scope="gpu")
            polls += 1
        # a flag never raised (impossible while the ticket order holds) gives NaN, never a hang or a guess
        bad = tl.where(ready != 0, 0.0, float("nan"))
        w0 = tl.load(wpre_ptr + rows * 4, mask=rm, other=0.0, cache_modifier=".cg") + bad
        w1 = tl.load(wpre_ptr + rows * 4 + 1, mask=rm, other=0.0, cache_modifier=".cg") + bad
        w2 = tl.load(wpre_ptr + rows * 4 + 2, mask=rm, other=0.0, cache_modifier=".cg") + bad
        w3 = tl.load(wpre_ptr + rows * 4 + 3, mask=rm, other=0.0, cache_modifier=".cg") + bad
        if FUSED:
            src_ptr = new_ptr
        else:
            src_ptr = res_ptr
        if PREFETCH:
            y = weighted4(w0, w1, w2, w3, q0, q1, q2, q3)
            tl.store(out_ptr + rows[:, None] * Hd + hl[None, :], bf16_bits(y, HW_ROUND).to(tl.int16, bitcast=True),
                     mask=ml)
            layer_input_range(src_ptr, out_ptr, rows, rm, h_begin, h_begin + (n_chunks - 1) * BLOCK_H, Hd,
                              w0, w1, w2, w3, BLOCK_H, FUSED, HW_ROUND)
        else:
            layer_input_range(src_ptr, out_ptr, rows, rm, h_begin, h_end, Hd, w0, w1, w2, w3, BLOCK_H, FUSED, HW_ROUND)


# ====================================================================================================
# Design 4: chunked (hc_chunk_partial_kernel, then hc_chunk_finish_kernel, per chunk of C tokens),
# MhcLaunch(chunked=True)
#
# Why: the one-pass design keeps the streams' second read in L2 by making programs wait for each other (a
# tile's LAST arrival sums every slice's partial and runs Sinkhorn while the next tile's programs spin on its
# READY flag); session 4 measured it at 2–3× its byte model. Split-K needs no waiting but reads the streams
# twice from HBM (its finish kernel starts after the WHOLE partial kernel: 134 MB, past the 50 MB L2). Both
# problems go away if the launcher walks T in chunks of C tokens whose streams fit in L2 (C × 4 × Hd × 2 B:
# 32 MB at C = 1024, Hd = 4096) and runs split-K's two kernels per chunk: the finish kernel then re-reads
# streams the partial kernel read (or, fused, wrote) a few microseconds before, from L2, and the kernel
# boundary is the only synchronisation. 2·ceil(T / C) launches.
#
# * hc_chunk_partial_kernel, grid (the chunk's BLOCK_T tiles × slices), slice fastest: the one-pass kernel's
#   phase A for one work item (``partial_mix_one_pass``: one N = 128 dot per chunk of the 4 streams, each
#   chunk's MMAs zero-started; FUSED: the post applied, the new streams stored), stored to the workspace
#   [slices, C, 24] (head [slices, C, 4]) + [slices, C] at the token's row within the chunk. No ticket, no
#   counter, no flag.
# * hc_chunk_finish_kernel, grid (hidden parts × the chunk's finish tiles): every program of a token tile sums
#   that tile's partials in slice order (``sum_partials_rounds``: the same loads in the same order in every
#   program, so the same bits; the redundant sums replace the one-pass design's serial last arrival), runs
#   ``gates`` — part 0 also post and Sinkhorn, and stores post / comb; the other parts load only the pre
#   columns (4 of 24) and skip Sinkhorn — then the weighted sum over its own hidden range, re-reading the
#   chunk's streams (FUSED: the new ones) from L2.
#
# Bytes at T = Hd = 4096, C = 1024 (4 chunks), 32 slices (of 128 dims) × 8 tiles of 128 tokens = 256 partial
# programs, 64 finish tiles of 16 tokens × 8 parts of 512 dims = 512 finish programs per chunk:
#   HBM: streams 134 MB read once, layer input 34 MB written, the fn split 3.1 MB; the workspace (3.3 MB per
#        chunk, reused by every chunk) stays in L2;
#   L2 (SM side), pre: streams 134 MB twice, fn split 32 tiles × 3.1 MB = 101 MB, workspace written 13 MB and
#        read ≈ 46 MB by the finish programs (part 0 every column; the 7 others one 32-byte sector of pre
#        columns + Σ X² per row and slice);
#   the partial kernel of a chunk is HBM-bound (34 MB: ~9 µs at 3.6 TB/s), its finish kernel L2-bound
#        (34 MB of streams + ~12 MB of workspace reads: ~6 µs), one after the other, plus a launch gap each.
#
# PDL (``MhcLaunch.chunk_pdl``, compiled only): every launch but the call's first partial is a programmatic
# dependent launch (Hopper's griddepcontrol), so the next chunk's partial kernel streams its chunk from HBM
# while this chunk's finish kernel re-reads from L2. The order that keeps it correct: a partial program runs its
# K loop (it reads only the call's inputs; fused: it writes new-stream rows no earlier launch touches), then
# lets the dependents launch and waits for the previous finish to COMPLETE before it overwrites the workspace;
# a finish program first waits for its partial kernel to complete (the partials, the new streams), then lets
# the next partial launch. So at most two chunks' streams are live in L2 (64 MB at C = 1024: C = 512 suits it),
# and no wait can deadlock (a dependent launches only when every program of its primary has started). The
# call's first partial is an ordinary launch: the kernel before it (which wrote the streams) has completed.
# With ``chunk_fused_post`` (the fused op as post_kernel + pre's kernels per chunk) the post kernel is the
# early one instead: it reads only inputs and writes its chunk's new streams, then waits for the previous
# finish before it ends; the partial kernel, which reads those new streams, is an ordinary launch after it.
#
# Walk order (``MhcLaunch.chunk_zigzag``, the GPU default since session 7): the GPU starts a launch's programs
# roughly in grid order, so a kernel's LAST programs leave their bytes in L2 (~50 MB on the H200) and the next
# kernel should start there. ``chunk_rows(..., REVERSE)`` counts a launch's token tiles from the chunk's end:
# pre / head walk the partial kernel forward and the finish kernel backward; fused as post + pre walks
# ``post_kernel`` forward (TOKEN_MAJOR: its grid's fast axis is the hidden dim, so its last programs wrote the
# last tokens), the partial kernel backward, the finish kernel forward. Only the order moves, so the bits are
# those of the forward walk. Measured (one chunk of 4096 tokens, slices of 512): the finish kernel went from
# 88 % to 100 % of copy on its compulsory bytes, pre 94 -> 87 µs; the partial kernel stays at ~74 %.
#
# Shared memory of the partial kernel (benchmarks/mhc.md, "Partial kernel: shared memory"): its copies and reads are
# bank-conflict-free (NVMMA 128-byte swizzle, 16-byte pieces), but a warp's cp.async of the stream tile gathers 16
# lines (4 tokens × 4 streams × 32 B) and of the fn tile 7; STREAM_K (one stream's 64 dims per dot: 128-byte rows)
# and FN_LAYOUT (fn from split_fn_wide's contiguous rows, or their transpose: a K-major B operand) make each 4.
# ====================================================================================================


@triton.jit
def chunk_rows(t0, t_end, tile, BLOCK_T: tl.constexpr, REVERSE: tl.constexpr = False):
    """Token tile ``tile`` of the chunk [t0, t_end): (rows [BLOCK_T] int64, rm = rows < t_end, lrow = rows − t0,
    the rows' index inside the chunk's workspace). ``REVERSE``: counted from the chunk's end (tile 0 is the
    last tile), so a launch walks the chunk backwards (``MhcLaunch.chunk_zigzag``)."""
    if REVERSE:
        tile = tl.cdiv(t_end - t0, BLOCK_T) - 1 - tile
    lrow = tile.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = t0 + lrow
    return rows, rows < t_end, lrow


@triton.jit
def hc_chunk_partial_kernel(
    res_ptr,  # residual [T, 4, Hd] as int16 (FUSED: the streams before the post); contiguous, as are all below
    x_ptr,  # FUSED: x [T, Hd] as int16
    post_in_ptr,  # FUSED: [T, 4] fp32
    comb_in_ptr,  # FUSED: [T, 4, 4] fp32, source i -> destination j
    new_ptr,  # FUSED: the new residual [T, 4, Hd] as int16 (written)
    fs_ptr,  # split_fn(fn): [G, 3, 4·Hd, 16] bf16 (FN_LAYOUT 1 / 2: split_fn_wide(...))
    ws_ptr,  # [slices, C, WS_STRIDE] fp32 workspace: the chunk's partial mixes
    ssq_ptr,  # [slices, C] fp32 workspace: the chunk's partial Σ X²
    t0,  # the chunk's first token
    t_end,  # one past its last token (<= T)
    Hd,
    C,  # workspace rows per slice (tokens per chunk)
    slices,  # hidden slices (the grid is the chunk's token tiles × slices)
    chunks_per_slice,  # BLOCK_K chunks per slice
    HEAD: tl.constexpr,
    FUSED: tl.constexpr,
    BLOCK_T: tl.constexpr,  # >= 16 (the M side of tl.dot)
    BLOCK_K: tl.constexpr,  # >= 16 (the K side of tl.dot)
    ONE_DOT: tl.constexpr,  # partial_mix_one_pass: 0 four dots per chunk, 1 one (tiles joined), 2 one (one load)
    WS_GATE: tl.constexpr,  # gate columns kept per workspace row (pre 8, head 4)
    WS_STRIDE: tl.constexpr,  # workspace row length (pre 24, head 4)
    HW_ROUND: tl.constexpr,  # compiled only: the new streams rounded by the hardware conversion (bf16_bits)
    PDL: tl.constexpr,  # compiled only: programmatic dependent launch (see the section comment)
    DOT_FP32: tl.constexpr,
    STREAM_K: tl.constexpr = False,  # not FUSED: one stream's BLOCK_K dims per dot (partial_mix_one_pass)
    FN_LAYOUT: tl.constexpr = 0,  # 0 fs_ptr is split_fn(fn); 1 split_fn_wide(...) [4·Hd, 4·NG]; 2 its transpose
    #                               (3, STREAM_K only: 2 without its zero quarter, gemm_tile_three_parts)
    REVERSE: tl.constexpr = False,  # the token tiles walked from the chunk's end (chunk_rows; chunk_zigzag)
    FOLD_EVERY: tl.constexpr = 1,  # STREAM_K, FN_LAYOUT 3: steps chained per fold (partial_mix_one_pass)
):
    tl.static_assert(BLOCK_K >= 16)
    tl.static_assert(BLOCK_T >= 16)
    NG: tl.constexpr = 16 if HEAD else 32
    pid = tl.program_id(0)
    s = pid % slices
    rows, rm, lrow = chunk_rows(t0, t_end, pid // slices, BLOCK_T, REVERSE)
    if FUSED:
        W = (post_weights(post_in_ptr, comb_in_ptr, rows, rm, 0), post_weights(post_in_ptr, comb_in_ptr, rows, rm, 1),
             post_weights(post_in_ptr, comb_in_ptr, rows, rm, 2), post_weights(post_in_ptr, comb_in_ptr, rows, rm, 3))
    else:
        W = 0  # unused
    h_begin = s * chunks_per_slice * BLOCK_K
    h_end = tl.minimum(h_begin + chunks_per_slice * BLOCK_K, Hd)
    acc, ssq = partial_mix_one_pass(res_ptr, x_ptr, new_ptr, fs_ptr, W, rows, rm, h_begin, h_end, Hd, DOT_FP32,
                                    FUSED, NG, BLOCK_T, BLOCK_K, ONE_DOT, False, HW_ROUND, STREAM_K, FN_LAYOUT,
                                    FOLD_EVERY)
    if PDL:  # the next launch (this chunk's finish) may start; the workspace is free once the previous finish ended
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    store_partial_packed(ws_ptr, ssq_ptr, s.to(tl.int64) * C + lrow, rm, acc, ssq, NG, WS_GATE, WS_STRIDE)


@triton.jit
def hc_chunk_finish_kernel(
    src_ptr,  # int16 view of the streams x is summed from [T, 4, Hd] bf16 (FUSED: the new streams)
    ws_ptr,  # [slices, C, WS_STRIDE] fp32: the chunk's partial mixes (hc_chunk_partial_kernel)
    ssq_ptr,  # [slices, C] fp32: the chunk's partial Σ X²
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
    PDL: tl.constexpr,
    REVERSE: tl.constexpr = False,  # the token tiles walked from the chunk's end (chunk_rows; chunk_zigzag)
):
    if PDL:  # the partials (and, fused, the new streams) complete and visible; then the next chunk's partial may start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    part = tl.program_id(0)
    rows, rm, lrow = chunk_rows(t0, t_end, tl.program_id(1), BLOCK_T, REVERSE)
    full = part == 0  # part 0 alone stores post and comb, so it alone needs their columns and Sinkhorn
    # the chunk's workspace rows are its tokens' rows inside the chunk; written by the previous launch (no .cg)
    acc_g, acc_c, ssq = sum_partials_rounds(ws_ptr, ssq_ptr, lrow, rm, C, slices, HEAD, BLOCK_T, SUM_UNROLL, WS_GATE,
                                            WS_STRIDE, tl.where(full, WS_GATE, 4), tl.where(full, 16, 0), "")
    T = t_end  # gates masks its comb stores with rows < T: rows past the chunk are masked out by rm already
    w0, w1, w2, w3 = gates(acc_g, acc_c, ssq, 4 * Hd, rows, rm, scale_ptr, base_ptr, post_ptr, comb_ptr, T, rms_eps,
                           hc_eps, post_mult, iters, full, HEAD, BLOCK_T)
    h_begin = part * h_per_part
    layer_input_range(src_ptr, out_ptr, rows, rm, h_begin, tl.minimum(h_begin + h_per_part, Hd), Hd, w0, w1, w2, w3,
                      BLOCK_H, False, HW_ROUND)
