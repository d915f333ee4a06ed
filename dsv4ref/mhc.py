"""mHC: manifold-constrained hyper-connections (pre with Sinkhorn, post, fused post+pre, head).

Facts: ``../shared/spec/mhc.md``; pitfalls.md #22 (comb transposed in post) and #23 (Sinkhorn and eps
conventions). DeepSeek-V4 keeps ``M = 4`` residual streams per token, ``Hs`` of shape ``[T, M, Hd]`` bf16.
Around every attention and FFN sub-layer:

* **pre** reads the streams, computes 24 mix logits with one GEMM against ``fn [M·(M+2), M·Hd]`` (the RMS
  factor of the *flattened* streams is applied after the GEMM, a per-row scalar), and turns them into
  ``pre = σ(·) + eps`` (input weights), ``post = 2σ(·)`` (output weights) and ``comb = Sinkhorn(·)``
  (a nearly doubly-stochastic 4×4 stream mix). The sub-layer input is ``x = Σ_i pre_i · Hs_i``.
* **post** writes the new streams ``Hs'_j = post_j · x + Σ_i comb[i, j] · Hs_i``: ``combᵀ @ Hs``.
  ``comb[i, j]`` is the weight from *source* stream i to *destination* stream j.
* **fused_post_pre** is post followed by the next sub-layer's pre, in one kernel.
* **head** (after the last layer) is a pre without Sinkhorn and without post: ``Σ_m gate_m · Hs_m``.

Kernel design (one Triton kernel ``_hc_kernel`` serves pre, fused post+pre and head):

* One program owns ``BLOCK_T`` tokens. Pass 1 streams their ``M·Hd`` residual values once, in chunks of
  ``BLOCK_K`` per stream, accumulating the mix GEMM and the sum of squares. Pass 2 re-reads the same rows
  (in reverse order, so the most recently read chunks are still in L2) for ``x = Σ_i pre_i·Hs_i``.
* The GEMM must be fp32-accurate (tf32 loses ~1e-2, pitfalls.md #23). The residual is bf16, so only
  ``fn`` needs care: it is split exactly into three bf16 parts, ``fn = hi + mid + lo`` (8 + 8 + 8
  significand bits), and ``X @ fnᵀ = X @ hiᵀ + X @ midᵀ + X @ loᵀ`` with fp32 accumulation. Every bf16×bf16
  product is exact in fp32, so the result is as accurate as an fp32 FMA GEMM while running on bf16 tensor
  cores. The split is made once per weight and cached (:func:`split_fn`).
* The gates and the 20 Sinkhorn passes run in registers on a ``[BLOCK_T, 4, 4]`` tile.
* Fused post+pre: pass 1 computes the new streams chunk by chunk, stores them (bf16, RNE) and feeds the
  stored bf16 values to the GEMM, exactly as a separate pre would read them; pass 2 reads them back.

A second, split-K path splits the K = M·Hd reduction across programs and finishes in a second small
kernel; see the comment above ``_hc_partial_kernel`` and benchmarks/mhc.md. ``HC_SPLIT_K = None`` (the
default) picks per op what was faster on the H200 (2026-11-30, T = Hd = 4096): split-K for pre (16.6 % vs
12.3 % of the bound) and head (18.8 % vs 13.9 %), the one-kernel path for fused post+pre (17.0 % vs 10.6 %).
``True`` / ``False`` force one path for every op.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from . import validate
from .config import FLASH
from .device import DEVICE, interpreting
from .harness import BenchCase, CheckRow, bench, check
from .testing import compare, generator, randn
from .tl_helpers import bf16_rne_bits, dot

__all__ = ["sinkhorn", "pre", "post", "fused_post_pre", "head", "split_fn", "HC_MULT", "POST_MULT", "SINKHORN_ITERS", "HC_EPS"]

HC_MULT = FLASH.hc_mult  # M = 4 residual streams
SINKHORN_ITERS = FLASH.hc_sinkhorn_iters  # 20
HC_EPS = FLASH.hc_eps  # 1e-6 (hc_pre_eps = hc_sinkhorn_eps)
RMS_EPS = FLASH.rms_norm_eps  # 1e-6
POST_MULT = 2.0  # mhc.md §3


# ====================================================================================================
# PyTorch references. Each takes a `dtype` for its math: float32 is the library's reference backend,
# float64 is the oracle the tests compare against.
# ====================================================================================================


def sinkhorn_reference(logits: torch.Tensor, iters: int = SINKHORN_ITERS, eps: float = HC_EPS) -> torch.Tensor:
    """The DSV4 schedule (mhc.md §4), in the dtype of ``logits``. Axis -2 is the source stream i (rows),
    axis -1 the destination stream j (columns)."""
    c = torch.softmax(logits, dim=-1) + eps  # pass 1: row softmax (over j), then + eps ...
    c = c / (c.sum(dim=-2, keepdim=True) + eps)  # ... then a column normalisation (over i)
    for _ in range(iters - 1):  # passes 2..iters: row, then column
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def _mix(residual: torch.Tensor, fn: torch.Tensor, rms_eps: float, dtype: torch.dtype) -> torch.Tensor:
    """mix = (X @ fnᵀ) · rsqrt(mean(X²) + eps) with X the FLATTENED streams [T, M·Hd]: the RMS factor is
    one scalar per token, applied after the GEMM (mhc.md §3)."""
    X = residual.reshape(residual.shape[0], -1).to(dtype)
    return (X @ fn.to(dtype).T) * torch.rsqrt(X.square().mean(dim=-1, keepdim=True) + rms_eps)


def pre_reference(residual, fn, scale, base, *, rms_eps=RMS_EPS, hc_eps=HC_EPS, post_mult=POST_MULT,
                  sinkhorn_iters=SINKHORN_ITERS, dtype=torch.float32):
    """(pre [T, M], post [T, M], comb [T, M, M], x [T, Hd]) in ``dtype``; x is not rounded to bf16."""
    T, M, Hd = residual.shape
    scale, base = scale.to(dtype), base.to(dtype)
    mix = _mix(residual, fn, rms_eps, dtype)  # [T, M·(M+2)]: [pre | post | comb (row-major M×M)]
    pre = torch.sigmoid(mix[:, :M] * scale[0] + base[:M]) + hc_eps
    post = torch.sigmoid(mix[:, M : 2 * M] * scale[1] + base[M : 2 * M]) * post_mult
    logits = mix[:, 2 * M :].reshape(T, M, M) * scale[2] + base[2 * M :].reshape(M, M)
    comb = sinkhorn_reference(logits, sinkhorn_iters, hc_eps)
    x = (pre[:, :, None] * residual.to(dtype)).sum(dim=1)  # Σ_i pre_i · Hs_i
    return pre, post, comb, x


def post_reference(x, residual, post, comb, *, dtype=torch.float32):
    """new[t, j] = post[t, j]·x[t] + Σ_i comb[t, i, j]·residual[t, i]: combᵀ @ residual (pitfalls.md #22)."""
    T, M, Hd = residual.shape
    post = post.reshape(T, M).to(dtype)
    mixed = torch.einsum("tij,tih->tjh", comb.to(dtype), residual.to(dtype))  # sum over the SOURCE index i
    return post[:, :, None] * x.to(dtype)[:, None, :] + mixed


def head_reference(hidden, fn, scale, base, *, rms_eps=RMS_EPS, hc_eps=HC_EPS, dtype=torch.float32):
    """(gate [T, M], out [T, Hd]) in ``dtype``: gate = σ(mix·scale + base) + eps; out = Σ_m gate_m·Hs_m."""
    gate = torch.sigmoid(_mix(hidden, fn, rms_eps, dtype) * scale.to(dtype)[0] + base.to(dtype)) + hc_eps
    return gate, (gate[:, :, None] * hidden.to(dtype)).sum(dim=1)


# ====================================================================================================
# Argument checks
# ====================================================================================================


def _finite(name: str, t: torch.Tensor) -> None:
    """Non-finite inputs are rejected (a sync, so behind validate.CHECK_VALUES)."""
    if validate.CHECK_VALUES and t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: contains non-finite values (NaN or inf)")


def _check_streams(residual: torch.Tensor, name: str = "residual") -> tuple[int, int, int]:
    validate.tensor(residual, name, dtype=torch.bfloat16, ndim=3)
    return tuple(residual.shape)


def _check_mix_params(fn, scale, base, M: int, Hd: int, rows: int, n_scale: int, what: str) -> None:
    validate.tensor(fn, "fn", dtype=torch.float32, ndim=2)
    if fn.shape[0] != rows:
        raise ValueError(f"fn: expected {rows} rows ({what}) for M={M} streams, got shape {tuple(fn.shape)}")
    if fn.shape[1] != M * Hd:
        raise ValueError(f"fn: expected {M * Hd} columns (M·Hd = {M}·{Hd}), got shape {tuple(fn.shape)}")
    validate.tensor(scale, "scale", dtype=torch.float32, shape=(n_scale,))
    validate.tensor(base, "base", dtype=torch.float32, shape=(rows,))


def _check_post_args(x, residual, post, comb) -> tuple[int, int, int]:
    T, M, Hd = _check_streams(residual)
    validate.tensor(x, "x", dtype=torch.bfloat16, ndim=2)
    if tuple(x.shape) != (T, Hd):
        raise ValueError(f"x: expected shape {(T, Hd)} to match residual {tuple(residual.shape)}, got {tuple(x.shape)}")
    validate.tensor(post, "post", dtype=torch.float32)
    if tuple(post.shape) not in ((T, M), (T, M, 1)):
        raise ValueError(f"post: expected shape {(T, M)} or {(T, M, 1)}, got {tuple(post.shape)}")
    validate.tensor(comb, "comb", dtype=torch.float32, shape=(T, M, M))
    validate.same_device(x=x, residual=residual, post=post, comb=comb)
    return T, M, Hd


def _need_four(M: int) -> None:
    if M != 4:
        raise ValueError(f"residual: the Triton kernels are written for M = 4 streams (DeepSeek-V4), got M = {M}; "
                         "use backend='reference' for other M")


# ====================================================================================================
# fn split: fp32 = hi + mid + lo, three bf16 parts, exactly
# ====================================================================================================


def _split3(w: torch.Tensor) -> torch.Tensor:
    """[3, *w.shape] bf16 with hi + mid + lo == w exactly (fp32 has 24 significand bits, bf16 has 8;
    torch's fp32 -> bf16 cast rounds to nearest even, and each remainder is exact in fp32)."""
    hi = w.to(torch.bfloat16)
    r = w - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo])


_SPLIT_CACHE: dict[int, tuple] = {}


def split_fn(fn: torch.Tensor, M: int = HC_MULT, head: bool = False) -> torch.Tensor:
    """The kernel's copy of ``fn``: bf16 ``[G, 3, M·Hd, 16]`` (G = 2 for pre: group 0 = the gate rows
    [pre 0..3 | post 4..7 | zero], group 1 = the 16 comb rows; G = 1 for the head: [gate 0..3 | zero]).
    K-major, so a kernel loads a ``[BLOCK_K, 16]`` tile of fnᵀ with contiguous rows.

    fn is a weight: the split is cached per tensor object and version counter (an in-place update
    invalidates it; the cache holds a weak reference, so a freed tensor's address is never reused)."""
    key = id(fn)
    hit = _SPLIT_CACHE.get(key)
    if hit is not None and hit[0]() is fn and hit[1] == fn._version and hit[2] == head:
        return hit[3]
    K = fn.shape[1]
    groups = 1 if head else 2
    w = torch.zeros(groups, 16, K, dtype=torch.float32, device=fn.device)
    if head:
        w[0, :M] = fn
    else:
        w[0, : 2 * M] = fn[: 2 * M]  # pre, post
        w[1, : M * M] = fn[2 * M :]  # comb, row-major (i, j)
    out = _split3(w).permute(1, 0, 3, 2).contiguous()  # [G, 3, K, 16]
    if len(_SPLIT_CACHE) >= 16:
        _SPLIT_CACHE.pop(next(iter(_SPLIT_CACHE)))
    _SPLIT_CACHE[key] = (weakref.ref(fn), fn._version, head, out)
    return out


# ====================================================================================================
# Triton building blocks
# ====================================================================================================


@triton.jit
def _load_bf16(ptr, offs, mask):
    """bf16 through its int16 view -> (bf16 tensor for tl.dot, its exact fp32 value). The widening is
    done in integers (bits << 16), so no bf16 arithmetic ever happens (interpreter bug I3)."""
    bits = tl.load(ptr + offs, mask=mask, other=0)
    f = ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return bits.to(tl.bfloat16, bitcast=True), f


@triton.jit
def _col(ptr, rows, stride, col, mask):
    """A [BLOCK_T] fp32 vector: column ``col`` of a row-major [T, stride] fp32 matrix."""
    return tl.load(ptr + rows * stride + col, mask=mask, other=0.0)


@triton.jit
def _post_stream(x, p_j, c0j, c1j, c2j, c3j, r0, r1, r2, r3):
    """New stream j: post_j·x + Σ_i comb[i, j]·r_i (the SOURCE index i is summed: combᵀ, pitfalls.md #22).
    One fixed order of operations with explicit FMAs, shared by the post and fused kernels, so their bf16
    outputs are equal bit for bit (with plain ``a*b + c*d`` the compiler chose different FMA contractions
    in the two kernels on the H200: 3 of 540 672 values differed by an ulp)."""
    y = p_j[:, None] * x
    y = tl.fma(c0j[:, None], r0, y)
    y = tl.fma(c1j[:, None], r1, y)
    y = tl.fma(c2j[:, None], r2, y)
    return tl.fma(c3j[:, None], r3, y)


@triton.jit
def _weighted4(w0, w1, w2, w3, r0, r1, r2, r3, ROWS: tl.constexpr = True):
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
def _sinkhorn_tl(c, iters, eps):
    """DSV4 Sinkhorn on a [BLOCK, 4, 4] fp32 tile in registers (axis 1 = source i, axis 2 = destination j).
    Pass 1: row softmax + eps, column normalise. Passes 2..iters: row, then column normalise."""
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])  # finite logits only (the launchers reject NaN/inf)
    c = c / tl.sum(c, axis=2)[:, :, None] + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(1, iters):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    return c


@triton.jit
def _sinkhorn_kernel(
    in_ptr,  # [n, 4, 4] fp32 logits, contiguous
    out_ptr,  # [n, 4, 4] fp32
    n,
    iters,
    eps,
    BLOCK: tl.constexpr,  # matrices per program
):
    m = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    i4 = tl.arange(0, 4)
    offs = m[:, None, None] * 16 + i4[None, :, None] * 4 + i4[None, None, :]  # [BLOCK, 4, 4]
    mask = offs < n * 16  # rows beyond n: masked (their zero logits never reach memory)
    c = tl.load(in_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _sinkhorn_tl(c, iters, eps), mask=mask)


@triton.jit
def _post_kernel(
    x_ptr,  # int16 view of x [T, Hd] bf16, contiguous
    res_ptr,  # int16 view of residual [T, 4, Hd] bf16, contiguous
    post_ptr,  # [T, 4] fp32
    comb_ptr,  # [T, 4, 4] fp32; comb[t, i, j] = weight from source i to destination j
    out_ptr,  # int16 view of the new residual [T, 4, Hd] bf16
    T,
    Hd,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rm = rows < T
    mask = rm[:, None] & (h < Hd)[None, :]
    xo = rows[:, None] * Hd + h[None, :]
    ro = rows[:, None] * (4 * Hd) + h[None, :]  # stream i at ro + i·Hd
    _, x = _load_bf16(x_ptr, xo, mask)
    _, r0 = _load_bf16(res_ptr, ro, mask)
    _, r1 = _load_bf16(res_ptr, ro + Hd, mask)
    _, r2 = _load_bf16(res_ptr, ro + 2 * Hd, mask)
    _, r3 = _load_bf16(res_ptr, ro + 3 * Hd, mask)
    for j in tl.static_range(4):
        y = _post_stream(x, _col(post_ptr, rows, 4, j, rm),
                         _col(comb_ptr, rows, 16, 0 * 4 + j, rm), _col(comb_ptr, rows, 16, 1 * 4 + j, rm),
                         _col(comb_ptr, rows, 16, 2 * 4 + j, rm), _col(comb_ptr, rows, 16, 3 * 4 + j, rm),
                         r0, r1, r2, r3)
        tl.store(out_ptr + ro + j * Hd, bf16_rne_bits(y).to(tl.int16, bitcast=True), mask=mask)


@triton.jit
def _gemm_stream(a, k, kmask, fs_ptr, K, acc_g, acc_c, DOT_FP32: tl.constexpr, HEAD: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """acc += a @ fnᵀ[k, :] for one stream chunk: a [BLOCK_T, BLOCK_K] bf16, fs = [G, 3, K, 16] bf16
    (hi, mid, lo). Three bf16 dots per group reproduce the fp32 product exactly (module docstring).

    The chunk's dots start from a ZERO accumulator and the chunk sum is added to ``acc`` with an ordinary
    fp32 add. Tensor-core MMAs add into their accumulator with truncation, aligned to the largest addend:
    fed the running sum, every MMA loses up to an ulp of the whole sum, a bias that grows with K (measured
    on the H200 at K = 16 384: 2.6e-5 on post, over the 1e-5 tolerance). Per chunk, the loss is relative to
    the chunk's own (much smaller) partial sum."""
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
def _hc_kernel(
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
    DOT_FP32: tl.constexpr,  # interpreting(): see tl_helpers.dot
):
    tl.static_assert(BLOCK_K >= 16)
    tl.static_assert(BLOCK_T >= 16)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rm = rows < T
    kk = tl.arange(0, BLOCK_K)
    K = 4 * Hd
    acc_g = tl.zeros((BLOCK_T, 16), dtype=tl.float32)  # [pre 0..3 | post 4..7 | 0] (head: [gate | 0])
    acc_c = tl.zeros((BLOCK_T, 16), dtype=tl.float32)  # comb logits, (i, j) at 4i + j
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)  # Σ X² over the flattened 4·Hd values
    if FUSED:  # the post's weights, as [BLOCK_T] vectors
        p0 = _col(post_in_ptr, rows, 4, 0, rm)
        p1 = _col(post_in_ptr, rows, 4, 1, rm)
        p2 = _col(post_in_ptr, rows, 4, 2, rm)
        p3 = _col(post_in_ptr, rows, 4, 3, rm)
        c00 = _col(comb_in_ptr, rows, 16, 0, rm)
        c01 = _col(comb_in_ptr, rows, 16, 1, rm)
        c02 = _col(comb_in_ptr, rows, 16, 2, rm)
        c03 = _col(comb_in_ptr, rows, 16, 3, rm)
        c10 = _col(comb_in_ptr, rows, 16, 4, rm)
        c11 = _col(comb_in_ptr, rows, 16, 5, rm)
        c12 = _col(comb_in_ptr, rows, 16, 6, rm)
        c13 = _col(comb_in_ptr, rows, 16, 7, rm)
        c20 = _col(comb_in_ptr, rows, 16, 8, rm)
        c21 = _col(comb_in_ptr, rows, 16, 9, rm)
        c22 = _col(comb_in_ptr, rows, 16, 10, rm)
        c23 = _col(comb_in_ptr, rows, 16, 11, rm)
        c30 = _col(comb_in_ptr, rows, 16, 12, rm)
        c31 = _col(comb_in_ptr, rows, 16, 13, rm)
        c32 = _col(comb_in_ptr, rows, 16, 14, rm)
        c33 = _col(comb_in_ptr, rows, 16, 15, rm)

    # ---- pass 1: the mix GEMM and Σ X², one chunk of all 4 streams at a time ---------------------------
    for h0 in range(0, Hd, BLOCK_K):
        h = h0 + kk
        hm = h < Hd
        mask = rm[:, None] & hm[None, :]
        ro = rows[:, None] * K + h[None, :]  # stream i at ro + i·Hd
        a0, r0 = _load_bf16(res_ptr, ro, mask)
        a1, r1 = _load_bf16(res_ptr, ro + Hd, mask)
        a2, r2 = _load_bf16(res_ptr, ro + 2 * Hd, mask)
        a3, r3 = _load_bf16(res_ptr, ro + 3 * Hd, mask)
        if FUSED:  # new streams = post_j·x + Σ_i comb[i, j]·r_i, rounded to bf16 and stored
            _, x = _load_bf16(x_ptr, rows[:, None] * Hd + h[None, :], mask)
            n0 = bf16_rne_bits(_post_stream(x, p0, c00, c10, c20, c30, r0, r1, r2, r3))
            n1 = bf16_rne_bits(_post_stream(x, p1, c01, c11, c21, c31, r0, r1, r2, r3))
            n2 = bf16_rne_bits(_post_stream(x, p2, c02, c12, c22, c32, r0, r1, r2, r3))
            n3 = bf16_rne_bits(_post_stream(x, p3, c03, c13, c23, c33, r0, r1, r2, r3))
            tl.store(new_ptr + ro, n0.to(tl.int16, bitcast=True), mask=mask)
            tl.store(new_ptr + ro + Hd, n1.to(tl.int16, bitcast=True), mask=mask)
            tl.store(new_ptr + ro + 2 * Hd, n2.to(tl.int16, bitcast=True), mask=mask)
            tl.store(new_ptr + ro + 3 * Hd, n3.to(tl.int16, bitcast=True), mask=mask)
            # the pre sees exactly the stored bf16 values (not the fp32 ones)
            a0, r0 = n0.to(tl.bfloat16, bitcast=True), (n0.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            a1, r1 = n1.to(tl.bfloat16, bitcast=True), (n1.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            a2, r2 = n2.to(tl.bfloat16, bitcast=True), (n2.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            a3, r3 = n3.to(tl.bfloat16, bitcast=True), (n3.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        ssq += tl.sum(_weighted4(r0, r1, r2, r3, r0, r1, r2, r3, False), axis=1)  # Σ_i r_i², fixed FMA order
        acc_g, acc_c = _gemm_stream(a0, h, hm, fs_ptr, K, acc_g, acc_c, DOT_FP32, HEAD, BLOCK_K)
        acc_g, acc_c = _gemm_stream(a1, Hd + h, hm, fs_ptr, K, acc_g, acc_c, DOT_FP32, HEAD, BLOCK_K)
        acc_g, acc_c = _gemm_stream(a2, 2 * Hd + h, hm, fs_ptr, K, acc_g, acc_c, DOT_FP32, HEAD, BLOCK_K)
        acc_g, acc_c = _gemm_stream(a3, 3 * Hd + h, hm, fs_ptr, K, acc_g, acc_c, DOT_FP32, HEAD, BLOCK_K)

    # ---- the RMS factor of the flattened streams, applied AFTER the GEMM (one scalar per token) -------
    rinv = tl.math.rsqrt(ssq / K + rms_eps)
    i4 = tl.arange(0, 4)
    g3 = tl.reshape(acc_g * rinv[:, None], (BLOCK_T, 4, 4))  # row 0: pre (head: gate), row 1: post
    sel = i4[None, :, None]
    pre = tl.sigmoid(tl.sum(tl.where(sel == 0, g3, 0.0), axis=1) * tl.load(scale_ptr)
                     + tl.load(base_ptr + i4)[None, :]) + hc_eps  # [BLOCK_T, 4]
    if not HEAD:
        post = tl.sigmoid(tl.sum(tl.where(sel == 1, g3, 0.0), axis=1) * tl.load(scale_ptr + 1)
                          + tl.load(base_ptr + 4 + i4)[None, :]) * post_mult
        tl.store(post_ptr + rows[:, None] * 4 + i4[None, :], post, mask=rm[:, None] & (i4 < 4)[None, :])
        cl = tl.reshape(acc_c * rinv[:, None], (BLOCK_T, 4, 4)) * tl.load(scale_ptr + 2) \
            + tl.load(base_ptr + 8 + i4[:, None] * 4 + i4[None, :])[None, :, :]
        comb = _sinkhorn_tl(cl, iters, hc_eps)
        co = rows[:, None, None] * 16 + i4[None, :, None] * 4 + i4[None, None, :]
        tl.store(comb_ptr + co, comb, mask=co < T * 16)
    w0 = tl.sum(tl.where(i4[None, :] == 0, pre, 0.0), axis=1)
    w1 = tl.sum(tl.where(i4[None, :] == 1, pre, 0.0), axis=1)
    w2 = tl.sum(tl.where(i4[None, :] == 2, pre, 0.0), axis=1)
    w3 = tl.sum(tl.where(i4[None, :] == 3, pre, 0.0), axis=1)

    # ---- pass 2: x = Σ_i pre_i · stream_i, last chunk first (it is the likeliest to still be in L2) ----
    if FUSED:
        tl.debug_barrier()  # the new streams written above by other threads of this program
        src_ptr = new_ptr
    else:
        src_ptr = res_ptr
    n_chunks = tl.cdiv(Hd, BLOCK_K)
    for c in range(0, n_chunks):
        h = (n_chunks - 1 - c) * BLOCK_K + kk
        mask = rm[:, None] & (h < Hd)[None, :]
        ro = rows[:, None] * K + h[None, :]
        _, r0 = _load_bf16(src_ptr, ro, mask)
        _, r1 = _load_bf16(src_ptr, ro + Hd, mask)
        _, r2 = _load_bf16(src_ptr, ro + 2 * Hd, mask)
        _, r3 = _load_bf16(src_ptr, ro + 3 * Hd, mask)
        y = _weighted4(w0, w1, w2, w3, r0, r1, r2, r3)
        tl.store(out_ptr + rows[:, None] * Hd + h[None, :], bf16_rne_bits(y).to(tl.int16, bitcast=True), mask=mask)


# ----------------------------------------------------------------------------------------------------
# Split-K variant (selectable: HC_SPLIT_K / _launch_hc(split_k=True)). Two kernels instead of one.
#
# Why: ``_hc_kernel`` gives each program BLOCK_T = 16 tokens and the WHOLE K = 4·Hd reduction, so every
# program streams all of fn (bf16×3, 32 padded columns: 3.1 MB at Hd = 4096) through L2 for only 16 tokens:
# 256 programs × 3.1 MB ≈ 0.8 GB of L2 traffic against 0.13 GB of streams (benchmarks/mhc.md: ~10 % of copy
# bandwidth). Raising BLOCK_T alone starves the 132 SMs of programs (BLOCK_T = 64: 64 programs).
# Splitting K gives both: big token tiles (fn traffic / 4) AND enough programs, and small T (decode) gets
# Hd/BLOCK_K programs instead of one.
#
# * ``_hc_partial_kernel``, grid (splits, token tiles): program (s, t) owns BLOCK_T tokens and the hidden
#   range of split s (whole BLOCK_K chunks) of all 4 streams; it writes its partial mix [BLOCK_T, 32] and
#   partial Σ X² [BLOCK_T] to fp32 workspaces ``[splits, T, 32]`` and ``[splits, T]``. The per-chunk
#   accumulators of ``_gemm_stream`` are kept (every chunk's MMAs start from zero), and the gate and comb
#   columns of fn are ONE [BLOCK_K, 32] tile per bf16 part (3 dots of N = 32 instead of 6 of N = 16).
#   FUSED: the post is applied chunk by chunk exactly as in ``_hc_kernel`` and the new streams stored.
# * ``_hc_finish_kernel``, grid (hidden parts, token tiles): reduces the partials in split order (fixed,
#   so deterministic), applies the RMS factor and the input gates (every hidden part of a token tile
#   needs them: a few FLOPs per token), the post gates and Sinkhorn (part 0 only, which stores them), then
#   the weighted stream sum over its hidden range. The split index varies fastest in the first grid,
#   so it finishes the LAST token tiles last; the second grid walks the token tiles in REVERSE, so it
#   starts on the streams the first one read (or, fused, wrote) most recently, the ones likeliest to
#   still be in the 60 MB L2.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _gemm_stream32(a, k, kmask, fs_ptr, K, acc, DOT_FP32: tl.constexpr, NG: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += a @ fnᵀ[k, :NG] for one stream chunk, NG = 32 (gate group | comb group) or 16 (head: one
    group). fs = [G, 3, K, 16] bf16 (split_fn); column n of the tile is column n % 16 of group n // 16.
    Per-chunk accumulator, as in ``_gemm_stream`` (its docstring says why)."""
    n = tl.arange(0, NG)
    b_off = ((n // 16) * 3 * K * 16 + n % 16).to(tl.int64)[None, :] + k.to(tl.int64)[:, None] * 16  # [BLOCK_K, NG]
    bm = kmask[:, None] & (n < NG)[None, :]
    part = tl.zeros_like(acc)
    for s in tl.static_range(3):
        part = dot(a, tl.load(fs_ptr + s * K * 16 + b_off, mask=bm, other=0.0), part, DOT_FP32)
    return acc + part


@triton.jit
def _hc_partial_kernel(
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
    rows = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rm = rows < T
    kk = tl.arange(0, BLOCK_K)
    K = 4 * Hd
    acc = tl.zeros((BLOCK_T, NG), dtype=tl.float32)  # [pre | post | 0 | comb (i, j) at 16 + 4i + j]
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if FUSED:
        p0 = _col(post_in_ptr, rows, 4, 0, rm)
        p1 = _col(post_in_ptr, rows, 4, 1, rm)
        p2 = _col(post_in_ptr, rows, 4, 2, rm)
        p3 = _col(post_in_ptr, rows, 4, 3, rm)
        c00 = _col(comb_in_ptr, rows, 16, 0, rm)
        c01 = _col(comb_in_ptr, rows, 16, 1, rm)
        c02 = _col(comb_in_ptr, rows, 16, 2, rm)
        c03 = _col(comb_in_ptr, rows, 16, 3, rm)
        c10 = _col(comb_in_ptr, rows, 16, 4, rm)
        c11 = _col(comb_in_ptr, rows, 16, 5, rm)
        c12 = _col(comb_in_ptr, rows, 16, 6, rm)
        c13 = _col(comb_in_ptr, rows, 16, 7, rm)
        c20 = _col(comb_in_ptr, rows, 16, 8, rm)
        c21 = _col(comb_in_ptr, rows, 16, 9, rm)
        c22 = _col(comb_in_ptr, rows, 16, 10, rm)
        c23 = _col(comb_in_ptr, rows, 16, 11, rm)
        c30 = _col(comb_in_ptr, rows, 16, 12, rm)
        c31 = _col(comb_in_ptr, rows, 16, 13, rm)
        c32 = _col(comb_in_ptr, rows, 16, 14, rm)
        c33 = _col(comb_in_ptr, rows, 16, 15, rm)
    h_begin = split * chunks_per_split * BLOCK_K
    h_end = tl.minimum(h_begin + chunks_per_split * BLOCK_K, Hd)
    for h0 in range(h_begin, h_end, BLOCK_K):
        h = h0 + kk
        hm = h < h_end
        mask = rm[:, None] & hm[None, :]
        ro = rows[:, None] * K + h[None, :]
        a0, r0 = _load_bf16(res_ptr, ro, mask)
        a1, r1 = _load_bf16(res_ptr, ro + Hd, mask)
        a2, r2 = _load_bf16(res_ptr, ro + 2 * Hd, mask)
        a3, r3 = _load_bf16(res_ptr, ro + 3 * Hd, mask)
        if FUSED:  # the post, exactly as in _hc_kernel and _post_kernel (same helper, same FMA order)
            _, x = _load_bf16(x_ptr, rows[:, None] * Hd + h[None, :], mask)
            n0 = bf16_rne_bits(_post_stream(x, p0, c00, c10, c20, c30, r0, r1, r2, r3))
            n1 = bf16_rne_bits(_post_stream(x, p1, c01, c11, c21, c31, r0, r1, r2, r3))
            n2 = bf16_rne_bits(_post_stream(x, p2, c02, c12, c22, c32, r0, r1, r2, r3))
            n3 = bf16_rne_bits(_post_stream(x, p3, c03, c13, c23, c33, r0, r1, r2, r3))
            tl.store(new_ptr + ro, n0.to(tl.int16, bitcast=True), mask=mask)
            tl.store(new_ptr + ro + Hd, n1.to(tl.int16, bitcast=True), mask=mask)
            tl.store(new_ptr + ro + 2 * Hd, n2.to(tl.int16, bitcast=True), mask=mask)
            tl.store(new_ptr + ro + 3 * Hd, n3.to(tl.int16, bitcast=True), mask=mask)
            a0, r0 = n0.to(tl.bfloat16, bitcast=True), (n0.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            a1, r1 = n1.to(tl.bfloat16, bitcast=True), (n1.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            a2, r2 = n2.to(tl.bfloat16, bitcast=True), (n2.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            a3, r3 = n3.to(tl.bfloat16, bitcast=True), (n3.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        ssq += tl.sum(_weighted4(r0, r1, r2, r3, r0, r1, r2, r3, False), axis=1)
        acc = _gemm_stream32(a0, h, hm, fs_ptr, K, acc, DOT_FP32, NG, BLOCK_K)
        acc = _gemm_stream32(a1, Hd + h, hm, fs_ptr, K, acc, DOT_FP32, NG, BLOCK_K)
        acc = _gemm_stream32(a2, 2 * Hd + h, hm, fs_ptr, K, acc, DOT_FP32, NG, BLOCK_K)
        acc = _gemm_stream32(a3, 3 * Hd + h, hm, fs_ptr, K, acc, DOT_FP32, NG, BLOCK_K)
    wo = split.to(tl.int64) * T + rows  # this split's rows of the workspace
    n = tl.arange(0, NG)
    tl.store(ws_ptr + wo[:, None] * 32 + n[None, :], acc, mask=rm[:, None] & (n < NG)[None, :])
    tl.store(ssq_ptr + wo, ssq, mask=rm)


@triton.jit
def _hc_finish_kernel(
    src_ptr,  # int16 view of the streams x is summed from [T, 4, Hd] bf16 (FUSED: the new streams)
    ws_ptr,  # [splits, T, 32] fp32 partial mixes from _hc_partial_kernel
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
    K = 4 * Hd
    n16 = tl.arange(0, 16)
    m16 = rm[:, None] & (n16 < 16)[None, :]
    acc_g = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s in range(0, splits):  # split order: the same sum on every run
        wo = s * T + rows
        acc_g += tl.load(ws_ptr + wo[:, None] * 32 + n16[None, :], mask=m16, other=0.0)
        if not HEAD:
            acc_c += tl.load(ws_ptr + wo[:, None] * 32 + 16 + n16[None, :], mask=m16, other=0.0)
        ssq += tl.load(ssq_ptr + wo, mask=rm, other=0.0)

    # ---- as in _hc_kernel: RMS factor after the GEMM, gates, Sinkhorn ----------------------------------
    rinv = tl.math.rsqrt(ssq / K + rms_eps)
    i4 = tl.arange(0, 4)
    g3 = tl.reshape(acc_g * rinv[:, None], (BLOCK_T, 4, 4))
    sel = i4[None, :, None]
    pre = tl.sigmoid(tl.sum(tl.where(sel == 0, g3, 0.0), axis=1) * tl.load(scale_ptr)
                     + tl.load(base_ptr + i4)[None, :]) + hc_eps
    if not HEAD:
        if part == 0:  # every hidden part computes the gates; one stores them
            post = tl.sigmoid(tl.sum(tl.where(sel == 1, g3, 0.0), axis=1) * tl.load(scale_ptr + 1)
                              + tl.load(base_ptr + 4 + i4)[None, :]) * post_mult
            tl.store(post_ptr + rows[:, None] * 4 + i4[None, :], post, mask=rm[:, None] & (i4 < 4)[None, :])
            cl = tl.reshape(acc_c * rinv[:, None], (BLOCK_T, 4, 4)) * tl.load(scale_ptr + 2) \
                + tl.load(base_ptr + 8 + i4[:, None] * 4 + i4[None, :])[None, :, :]
            comb = _sinkhorn_tl(cl, iters, hc_eps)
            co = rows[:, None, None] * 16 + i4[None, :, None] * 4 + i4[None, None, :]
            tl.store(comb_ptr + co, comb, mask=co < T * 16)
    w0 = tl.sum(tl.where(i4[None, :] == 0, pre, 0.0), axis=1)
    w1 = tl.sum(tl.where(i4[None, :] == 1, pre, 0.0), axis=1)
    w2 = tl.sum(tl.where(i4[None, :] == 2, pre, 0.0), axis=1)
    w3 = tl.sum(tl.where(i4[None, :] == 3, pre, 0.0), axis=1)

    # ---- x = Σ_i pre_i · stream_i over this part's hidden range, last chunk first ---------------------
    hh = tl.arange(0, BLOCK_H)
    h_begin = part * h_per_part
    n_chunks = tl.cdiv(tl.minimum(h_per_part, Hd - h_begin), BLOCK_H)
    for c in range(0, n_chunks):
        h = h_begin + (n_chunks - 1 - c) * BLOCK_H + hh
        mask = rm[:, None] & (h < Hd)[None, :]
        ro = rows[:, None] * K + h[None, :]
        _, r0 = _load_bf16(src_ptr, ro, mask)
        _, r1 = _load_bf16(src_ptr, ro + Hd, mask)
        _, r2 = _load_bf16(src_ptr, ro + 2 * Hd, mask)
        _, r3 = _load_bf16(src_ptr, ro + 3 * Hd, mask)
        y = _weighted4(w0, w1, w2, w3, r0, r1, r2, r3)
        tl.store(out_ptr + rows[:, None] * Hd + h[None, :], bf16_rne_bits(y).to(tl.int16, bitcast=True), mask=mask)


# ====================================================================================================
# Launchers: custom ops that write into given buffers (tests poison them first)
# ====================================================================================================

# Tile sizes: BLOCK_T = 16 is the smallest M side of a tensor-core dot. On a GPU, 2 pipeline stages keep
# the shared memory for 4 streams × (A tile + 6 fn tiles) well under the 227 KB limit.
HC_BLOCK_T = 16
HC_BLOCK_K = 128 if interpreting() else 64
HC_WARPS = 4
HC_STAGES = 2


def _launch_hc(res, x, post_in, comb_in, new, fs, scale, base, post, comb, out, rms_eps, hc_eps, post_mult, iters,
               head, fused, block_t=None, block_k=None, split_k=None, splits=None):
    """``split_k``: None = the module flag :data:`HC_SPLIT_K` (itself None: split-K for pre and head, one
    kernel for fused post+pre, the faster of each on the H200); True = the two-kernel split-K path
    (``splits`` forces its number of K splits, for tests), False = the one-kernel path."""
    T, M, Hd = res.shape
    if T == 0:
        return
    if split_k is None:
        split_k = (not fused) if HC_SPLIT_K is None else HC_SPLIT_K
    if split_k:
        _launch_hc_split(res, x, post_in, comb_in, new, fs, scale, base, post, comb, out, rms_eps, hc_eps,
                         post_mult, iters, head, fused, block_t, block_k, splits)
        return
    bt = block_t or HC_BLOCK_T
    bk = block_k or HC_BLOCK_K
    kw = {} if interpreting() else dict(num_warps=HC_WARPS, num_stages=HC_STAGES)
    i16 = lambda t: t.view(torch.int16) if t is not None else res.view(torch.int16)  # noqa: E731
    _hc_kernel[(triton.cdiv(T, bt),)](
        res.view(torch.int16), i16(x), post_in if post_in is not None else scale, comb_in if comb_in is not None else scale,
        i16(new), fs, scale, base, post if post is not None else scale, comb if comb is not None else scale,
        out.view(torch.int16), T, Hd, float(rms_eps), float(hc_eps), float(post_mult), int(iters),
        HEAD=head, FUSED=fused, BLOCK_T=bt, BLOCK_K=bk, DOT_FP32=interpreting(), **kw,
    )


# Split-K path (HC_SPLIT_K = True): token tile and K split of the partial kernel, token tile and hidden
# chunk of the finish kernel, and how many programs to aim for (132 SMs on an H200: ~4 per SM). The
# interpreter pays ~1 ms per program, so there it aims for few.
HC_SPLIT_K = None  # None: per op, the faster path measured on the H200 (see _launch_hc)
SPLIT_BLOCK_T = 64  # 4× fewer fn re-reads from L2 than HC_BLOCK_T = 16
SPLIT_BLOCK_K = 128 if interpreting() else 64
SPLIT_WARPS = 8  # the fused variant holds x, 4 streams and 4 new streams per chunk: 8 warps halve the registers
SPLIT_STAGES = 2  # smem per stage: 4 stream tiles (32 KB) + 3 fn tiles of 32 columns × 4 streams (48 KB)
FINISH_BLOCK_T = 16
FINISH_BLOCK_H = 256
FINISH_WARPS = 4
SPLIT_TARGET_PROGRAMS = 4 if interpreting() else 528


def split_plan(T: int, Hd: int, block_t: int, block_k: int, splits: int | None = None) -> tuple[int, int]:
    """(splits, chunks per split) for the partial kernel: enough K splits that tiles × splits reaches
    SPLIT_TARGET_PROGRAMS, each split a whole number of BLOCK_K chunks, no empty split."""
    chunks = triton.cdiv(Hd, block_k)
    want = splits or max(1, triton.cdiv(SPLIT_TARGET_PROGRAMS, triton.cdiv(T, block_t)))
    cps = triton.cdiv(chunks, min(chunks, want))
    return triton.cdiv(chunks, cps), cps


def _launch_hc_split(res, x, post_in, comb_in, new, fs, scale, base, post, comb, out, rms_eps, hc_eps, post_mult,
                     iters, head, fused, block_t=None, block_k=None, splits=None):
    T, M, Hd = res.shape
    bt = block_t or SPLIT_BLOCK_T
    bk = block_k or SPLIT_BLOCK_K
    n_split, cps = split_plan(T, Hd, bt, bk, splits)
    ws = torch.empty(n_split * T * 33, dtype=torch.float32, device=res.device)  # [S, T, 32] mix | [S, T] Σ X²
    mix_ws, ssq_ws = ws[: n_split * T * 32], ws[n_split * T * 32 :]
    i16 = lambda t: t.view(torch.int16) if t is not None else res.view(torch.int16)  # noqa: E731
    kw = {} if interpreting() else dict(num_warps=SPLIT_WARPS, num_stages=SPLIT_STAGES)
    _hc_partial_kernel[(n_split, triton.cdiv(T, bt))](
        res.view(torch.int16), i16(x), post_in if post_in is not None else scale,
        comb_in if comb_in is not None else scale, i16(new), fs, mix_ws, ssq_ws, T, Hd, cps,
        HEAD=head, FUSED=fused, BLOCK_T=bt, BLOCK_K=bk, DOT_FP32=interpreting(), **kw,
    )
    fbt, fbh = FINISH_BLOCK_T, FINISH_BLOCK_H
    tiles = triton.cdiv(T, fbt)
    h_chunks = triton.cdiv(Hd, fbh)
    parts = min(h_chunks, max(1, triton.cdiv(SPLIT_TARGET_PROGRAMS, tiles)))
    h_per_part = triton.cdiv(h_chunks, parts) * fbh
    parts = triton.cdiv(Hd, h_per_part)
    kw = {} if interpreting() else dict(num_warps=FINISH_WARPS)
    _hc_finish_kernel[(parts, tiles)](
        i16(new) if fused else res.view(torch.int16), mix_ws, ssq_ws, scale, base,
        post if post is not None else scale, comb if comb is not None else scale, out.view(torch.int16),
        T, Hd, n_split, h_per_part, float(rms_eps), float(hc_eps), float(post_mult), int(iters),
        HEAD=head, BLOCK_T=fbt, BLOCK_H=fbh, **kw,
    )


@torch.library.custom_op("dsv4ref::mhc_pre", mutates_args=("post", "comb", "out"))
def _pre_op(residual: torch.Tensor, fs: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor, out: torch.Tensor, rms_eps: float, hc_eps: float, post_mult: float, iters: int) -> None:
    _launch_hc(residual, None, None, None, None, fs, scale, base, post, comb, out, rms_eps, hc_eps, post_mult, iters,
               head=False, fused=False)


@_pre_op.register_fake
def _(residual, fs, scale, base, post, comb, out, rms_eps, hc_eps, post_mult, iters):
    return None


@torch.library.custom_op("dsv4ref::mhc_fused_post_pre", mutates_args=("new", "post", "comb", "out"))
def _fused_op(x: torch.Tensor, residual: torch.Tensor, post_in: torch.Tensor, comb_in: torch.Tensor, fs: torch.Tensor,
              scale: torch.Tensor, base: torch.Tensor, new: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
              out: torch.Tensor, rms_eps: float, hc_eps: float, post_mult: float, iters: int) -> None:
    _launch_hc(residual, x, post_in, comb_in, new, fs, scale, base, post, comb, out, rms_eps, hc_eps, post_mult, iters,
               head=False, fused=True)


@_fused_op.register_fake
def _(x, residual, post_in, comb_in, fs, scale, base, new, post, comb, out, rms_eps, hc_eps, post_mult, iters):
    return None


@torch.library.custom_op("dsv4ref::mhc_head", mutates_args=("out",))
def _head_op(hidden: torch.Tensor, fs: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, out: torch.Tensor,
             rms_eps: float, hc_eps: float) -> None:
    _launch_hc(hidden, None, None, None, None, fs, scale, base, None, None, out, rms_eps, hc_eps, 1.0, 0,
               head=True, fused=False)


@_head_op.register_fake
def _(hidden, fs, scale, base, out, rms_eps, hc_eps):
    return None


POST_BLOCK_T = 4
POST_BLOCK_H = 256


@torch.library.custom_op("dsv4ref::mhc_post", mutates_args=("out",))
def _post_op(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> None:
    T, M, Hd = residual.shape
    if T:
        grid = (triton.cdiv(T, POST_BLOCK_T), triton.cdiv(Hd, POST_BLOCK_H))
        _post_kernel[grid](x.view(torch.int16), residual.view(torch.int16), post, comb, out.view(torch.int16), T, Hd,
                           BLOCK_T=POST_BLOCK_T, BLOCK_H=POST_BLOCK_H)


@_post_op.register_fake
def _(x, residual, post, comb, out):
    return None


@torch.library.custom_op("dsv4ref::mhc_sinkhorn", mutates_args=("out",))
def _sinkhorn_op(logits: torch.Tensor, out: torch.Tensor, iters: int, eps: float) -> None:
    n = logits.numel() // 16
    block = 256 if interpreting() else 16  # the interpreter pays per program, a GPU wants many programs
    if n:
        _sinkhorn_kernel[(triton.cdiv(n, block),)](logits, out, n, iters, eps, BLOCK=block)


@_sinkhorn_op.register_fake
def _(logits, out, iters, eps):
    return None


# ====================================================================================================
# Public API
# ====================================================================================================


def sinkhorn(logits: torch.Tensor, iters: int = SINKHORN_ITERS, eps: float = HC_EPS, *,
             backend: str = "triton") -> torch.Tensor:
    """Project ``[..., M, M]`` logits to a nearly doubly-stochastic matrix with the DSV4 schedule
    (mhc.md §4): pass 1 = row softmax + eps then column normalise; passes 2..iters = row, column.
    The last step normalises columns, so column sums are 1 − O(eps); row sums are NOT exactly 1."""
    validate.backend(backend)
    validate.tensor(logits, "logits", dtype=(torch.float32, torch.float64) if backend == "reference" else torch.float32)
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"logits: expected [..., M, M], got shape {tuple(logits.shape)}")
    if iters < 1:
        raise ValueError(f"iters: expected >= 1, got {iters}")
    _finite("logits", logits)
    if backend == "reference":
        return sinkhorn_reference(logits, iters, eps)
    _need_four(logits.shape[-1])
    src = logits.contiguous()
    out = torch.empty_like(src)
    torch.ops.dsv4ref.mhc_sinkhorn(src, out, int(iters), float(eps))
    return out


def _pre_check(residual, fn, scale, base):
    T, M, Hd = _check_streams(residual)
    _check_mix_params(fn, scale, base, M, Hd, M * (M + 2), 3, "M·(M+2)")
    validate.same_device(residual=residual, fn=fn, scale=scale, base=base)
    for n, t in (("fn", fn), ("scale", scale), ("base", base)):
        _finite(n, t)
    return T, M, Hd


def pre(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *,
        rms_eps: float = RMS_EPS, hc_eps: float = HC_EPS, post_mult: float = POST_MULT,
        sinkhorn_iters: int = SINKHORN_ITERS, backend: str = "triton"):
    """mHC pre (mhc.md §3).

    Args:
        residual: ``[T, M, Hd]`` bf16, the M residual streams.
        fn: ``[M·(M+2), M·Hd]`` fp32 (rows: 4 pre, 4 post, 16 comb row-major); scale ``[3]``
            (α_pre, α_post, α_res); base ``[M·(M+2)]``, all fp32.
    Returns:
        ``(post [T, M] fp32 in (0, post_mult), comb [T, M, M] fp32, layer_input [T, Hd] bf16)``.
    """
    validate.backend(backend)
    T, M, Hd = _pre_check(residual, fn, scale, base)
    _finite("residual", residual)
    if backend == "reference":
        _, p, c, x = pre_reference(residual, fn, scale, base, rms_eps=rms_eps, hc_eps=hc_eps, post_mult=post_mult,
                                   sinkhorn_iters=sinkhorn_iters)
        return p, c, x.to(torch.bfloat16)
    _need_four(M)
    res = residual.contiguous()
    p = torch.empty(T, M, dtype=torch.float32, device=res.device)
    c = torch.empty(T, M, M, dtype=torch.float32, device=res.device)
    out = torch.empty(T, Hd, dtype=torch.bfloat16, device=res.device)
    torch.ops.dsv4ref.mhc_pre(res, split_fn(fn, M), scale, base, p, c, out, rms_eps, hc_eps, post_mult, sinkhorn_iters)
    return p, c, out


def post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
         backend: str = "triton") -> torch.Tensor:
    """mHC post (mhc.md §5): new stream j = post_j·x + Σ_i comb[i, j]·residual_i (combᵀ @ residual).

    x ``[T, Hd]`` bf16; residual ``[T, M, Hd]`` bf16; post ``[T, M]`` or ``[T, M, 1]`` fp32; comb
    ``[T, M, M]`` fp32. Returns the new residual ``[T, M, Hd]`` bf16."""
    validate.backend(backend)
    T, M, Hd = _check_post_args(x, residual, post, comb)
    for n, t in (("x", x), ("residual", residual), ("post", post), ("comb", comb)):
        _finite(n, t)
    if backend == "reference":
        return post_reference(x, residual, post, comb).to(torch.bfloat16)
    _need_four(M)
    out = torch.empty(T, M, Hd, dtype=torch.bfloat16, device=residual.device)
    torch.ops.dsv4ref.mhc_post(x.contiguous(), residual.contiguous(), post.reshape(T, M).contiguous(),
                               comb.contiguous(), out)
    return out


def fused_post_pre(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                   fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, rms_eps: float = RMS_EPS,
                   hc_eps: float = HC_EPS, post_mult: float = POST_MULT, sinkhorn_iters: int = SINKHORN_ITERS,
                   backend: str = "triton"):
    """post(x, residual, post, comb) then pre(…, fn, scale, base) of the NEXT sub-layer (mhc.md §6).

    Returns ``(residual' [T, M, Hd] bf16, post' [T, M], comb' [T, M, M], layer_input [T, Hd] bf16)``,
    equal to the two-step composition (bit for bit on the bf16 outputs with the Triton backend)."""
    validate.backend(backend)
    T, M, Hd = _check_post_args(x, residual, post, comb)
    _pre_check(residual, fn, scale, base)
    for n, t in (("x", x), ("residual", residual), ("post", post), ("comb", comb)):
        _finite(n, t)
    kw = dict(rms_eps=rms_eps, hc_eps=hc_eps, post_mult=post_mult, sinkhorn_iters=sinkhorn_iters)
    if backend == "reference":
        new = post_reference(x, residual, post, comb).to(torch.bfloat16)
        return (new, *pre(new, fn, scale, base, backend="reference", **kw))
    _need_four(M)
    new = torch.empty(T, M, Hd, dtype=torch.bfloat16, device=residual.device)
    p = torch.empty(T, M, dtype=torch.float32, device=residual.device)
    c = torch.empty(T, M, M, dtype=torch.float32, device=residual.device)
    out = torch.empty(T, Hd, dtype=torch.bfloat16, device=residual.device)
    torch.ops.dsv4ref.mhc_fused_post_pre(x.contiguous(), residual.contiguous(), post.reshape(T, M).contiguous(),
                                         comb.contiguous(), split_fn(fn, M), scale, base, new, p, c, out,
                                         rms_eps, hc_eps, post_mult, sinkhorn_iters)
    return new, p, c, out


def head(hidden: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *,
         rms_eps: float = RMS_EPS, hc_eps: float = HC_EPS, backend: str = "triton") -> torch.Tensor:
    """HC head (mhc.md §7): out = Σ_m gate_m·hidden_m with gate = σ(mix·scale + base) + eps, mix the
    RMS-scaled GEMM of the flattened streams with fn ``[M, M·Hd]``; scale ``[1]``, base ``[M]``.
    Returns ``[T, Hd]`` bf16."""
    validate.backend(backend)
    T, M, Hd = _check_streams(hidden, "hidden")
    _check_mix_params(fn, scale, base, M, Hd, M, 1, "M")
    validate.same_device(hidden=hidden, fn=fn, scale=scale, base=base)
    for n, t in (("hidden", hidden), ("fn", fn), ("scale", scale), ("base", base)):
        _finite(n, t)
    if backend == "reference":
        return head_reference(hidden, fn, scale, base, rms_eps=rms_eps, hc_eps=hc_eps)[1].to(torch.bfloat16)
    _need_four(M)
    out = torch.empty(T, Hd, dtype=torch.bfloat16, device=hidden.device)
    torch.ops.dsv4ref.mhc_head(hidden.contiguous(), split_fn(fn, M, head=True), scale, base, out, rms_eps, hc_eps)
    return out


# ====================================================================================================
# Example parameters, python -m dsv4ref check / bench
# ====================================================================================================


def example_params(Hd: int, *, seed: int = 0, M: int = HC_MULT, head: bool = False, device=None):
    """Seeded (fn, scale, base) with real magnitudes: fn ~ N(0, 1/(M·Hd)) so every mix logit has std ≈ 1
    for RMS-normalised streams; α = (0.8, 0.6, 1.5) (head: 0.9); base ~ N(0, 0.5). Drawn on the CPU."""
    g = generator(seed)
    rows = M if head else M * (M + 2)
    fn = torch.randn(rows, M * Hd, generator=g) / (M * Hd) ** 0.5
    scale = torch.tensor([0.9] if head else [0.8, 0.6, 1.5])
    base = torch.randn(rows, generator=g) * 0.5
    dev = device or DEVICE
    return fn.to(dev), scale.to(dev), base.to(dev)


def example_streams(T: int, Hd: int, *, seed: int = 0, M: int = HC_MULT, device=None) -> torch.Tensor:
    """[T, M, Hd] bf16 streams whose 64-wide blocks span 2^-4 .. 2^4 (testing.randn octaves)."""
    return randn((T, M, Hd), seed=seed, octaves=8, device=device)


def _check_case(T, Hd, seed):
    res = example_streams(T, Hd, seed=seed)
    x = randn((T, Hd), seed=seed + 1, octaves=8)
    fn, scale, base = example_params(Hd, seed=seed + 2)
    return res, x, fn, scale, base


@check("mhc")
def _check() -> list[CheckRow]:
    rows = []
    shapes = [(5, 256)] if interpreting() else [(5, 256), (33, 4096), (17, 7168)]
    for T, Hd in shapes:
        res, x, fn, scale, base = _check_case(T, Hd, seed=T)
        s = f"T={T} Hd={Hd}"
        _, p64, c64, x64 = pre_reference(res, fn, scale, base, dtype=torch.float64)
        p, c, li = pre(res, fn, scale, base)
        rows += [CheckRow("mhc.pre post", s, compare(p, p64, "mhc")), CheckRow("mhc.pre comb", s, compare(c, c64, "mhc")),
                 CheckRow("mhc.pre layer_input", s, compare(li, x64, "bf16_out"))]
        new64 = post_reference(x, res, p64.float(), c64.float(), dtype=torch.float64)
        rows.append(CheckRow("mhc.post", s, compare(post(x, res, p, c), new64, "bf16_out")))
        got = fused_post_pre(x, res, p, c, fn, scale, base)
        new = post(x, res, p, c)
        sep = (new, *pre(new, fn, scale, base))
        rows.append(CheckRow("mhc.fused_post_pre residual", s, compare(got[0], sep[0], "exact", "== post")))
        rows.append(CheckRow("mhc.fused_post_pre layer_input", s, compare(got[3], sep[3], "exact", "== post then pre")))
        hfn, hscale, hbase = example_params(Hd, seed=T + 3, head=True)
        _, h64 = head_reference(res, hfn, hscale, hbase, dtype=torch.float64)
        rows.append(CheckRow("mhc.head", s, compare(head(res, hfn, hscale, hbase), h64, "bf16_out")))
    logits = torch.randn(64, 4, 4, generator=generator(7)).to(DEVICE) * 3
    rows.append(CheckRow("mhc.sinkhorn", "64 × 4×4, std 3", compare(sinkhorn(logits), sinkhorn_reference(logits.double()), "mhc")))
    return rows


@bench("mhc")
def _bench() -> list[BenchCase]:
    T, Hd, M = 4096, 4096, 4
    n_sets = 2  # one set is ~300 MB already, far past the L2
    sets = []
    fn, scale, base = example_params(Hd)
    fs = split_fn(fn, M)
    for i in range(n_sets):
        res = torch.randn(T, M, Hd, device=DEVICE, dtype=torch.bfloat16)
        x = torch.randn(T, Hd, device=DEVICE, dtype=torch.bfloat16)
        p, c = torch.rand(T, M, device=DEVICE) * 2, torch.rand(T, M, M, device=DEVICE) * 0.5
        bufs = (torch.empty_like(res), torch.empty(T, M, device=DEVICE), torch.empty(T, M, M, device=DEVICE),
                torch.empty_like(x), torch.empty_like(res))
        sets.append((res, x, p, c, bufs))
    stream = T * M * Hd * 2  # one pass over the bf16 streams
    row = T * Hd * 2  # x or the layer input
    small = T * (M + M * M) * 4  # post + comb (fp32)
    fn_bytes = M * (M + 2) * M * Hd * 4
    flops = 2 * T * M * (M + 2) * M * Hd  # the mix GEMM (logical; the bf16x3 split does 3× on tensor cores)
    pre_b = stream + fn_bytes + small + row
    post_b = row + stream + small + stream
    fused_b = row + stream + small + stream + small + row + fn_bytes

    hfn, hscale, hbase = example_params(Hd, head=True)
    hfs = split_fn(hfn, M, head=True)
    head_b = stream + M * M * Hd * 4 + row  # streams read once + fn [4, 4·Hd] fp32 + output written

    # every case names its path explicitly (split_k=False/True), so flipping HC_SPLIT_K changes no row
    def run_pre(i, bt=None, split_k=False):
        res, x, p, c, (new, p2, c2, out, _) = sets[i]
        _launch_hc(res, None, None, None, None, fs, scale, base, p2, c2, out, RMS_EPS, HC_EPS, POST_MULT,
                   SINKHORN_ITERS, head=False, fused=False, block_t=bt, split_k=split_k)

    def run_post(i):
        res, x, p, c, (new, *_rest) = sets[i]
        torch.ops.dsv4ref.mhc_post(x, res, p, c, new)

    def run_fused(i, split_k=False):
        res, x, p, c, (new, p2, c2, out, _) = sets[i]
        _launch_hc(res, x, p, c, new, fs, scale, base, p2, c2, out, RMS_EPS, HC_EPS, POST_MULT, SINKHORN_ITERS,
                   head=False, fused=True, split_k=split_k)

    def run_separate(i):
        res, x, p, c, (new, p2, c2, out, _) = sets[i]
        torch.ops.dsv4ref.mhc_post(x, res, p, c, new)
        run_pre_on(new, p2, c2, out)

    def run_pre_on(res, p2, c2, out):
        _launch_hc(res, None, None, None, None, fs, scale, base, p2, c2, out, RMS_EPS, HC_EPS, POST_MULT,
                   SINKHORN_ITERS, head=False, fused=False, split_k=False)

    def run_head(i, split_k=False):
        res, x, p, c, (new, p2, c2, out, _) = sets[i]
        _launch_hc(res, None, None, None, None, hfs, hscale, hbase, None, None, out, RMS_EPS, HC_EPS, 1.0, 0,
                   head=True, fused=False, split_k=split_k)

    cases = [
        BenchCase("mhc.pre", f"T={T} Hd={Hd} BLOCK_T=16", run_pre, n_sets, pre_b, flops,
                  "streams read once + fn + post/comb + layer input"),
        BenchCase("mhc.post", f"T={T} Hd={Hd}", run_post, n_sets, post_b, 0, "x + streams read, streams written"),
        BenchCase("mhc.fused_post_pre", f"T={T} Hd={Hd}", run_fused, n_sets, fused_b, flops,
                  "x + streams read, streams + layer input written"),
        BenchCase("mhc.post+pre (separate)", f"T={T} Hd={Hd}", run_separate, n_sets, fused_b, flops,
                  "fused op's compulsory bytes (so it compares)"),
        BenchCase("mhc.head", f"T={T} Hd={Hd}", run_head, n_sets, head_b, flops // 6,
                  "streams read once + fn + output written"),
    ]
    for bt in (32, 64):  # tile-size variants of pre: fewer fn re-reads from L2, fewer programs
        try:
            run_pre(0, bt)
            cases.append(BenchCase("mhc.pre", f"T={T} Hd={Hd} BLOCK_T={bt}", lambda i, bt=bt: run_pre(i, bt), n_sets,
                                   pre_b, flops, "as above"))
        except Exception as e:  # a tile that does not compile on this device is reported, not fatal
            print(f"mhc.pre BLOCK_T={bt}: skipped ({type(e).__name__}: {str(e)[:80]})")
    # the split-K path (HC_SPLIT_K): same compulsory bytes; it really reads the streams twice (the second
    # read partly from L2) plus a [splits, T, 33] fp32 workspace written once and read per hidden part
    n_split, _ = split_plan(T, Hd, SPLIT_BLOCK_T, SPLIT_BLOCK_K)
    sk = f"T={T} Hd={Hd} BLOCK_T={SPLIT_BLOCK_T} splits={n_split}"
    for name, run, b, f, note in [
        ("mhc.pre split-K", lambda i: run_pre(i, split_k=True), pre_b, flops, "as mhc.pre; moves ~2x the streams"),
        ("mhc.fused_post_pre split-K", lambda i: run_fused(i, split_k=True), fused_b, flops,
         "as mhc.fused_post_pre; re-reads the new streams"),
        ("mhc.head split-K", lambda i: run_head(i, split_k=True), head_b, flops // 6,
         "as mhc.head; moves ~2x the streams"),
    ]:
        try:
            run(0)
            cases.append(BenchCase(name, sk, run, n_sets, b, f, note))
        except Exception as e:  # reported, not fatal: the other rows still run
            print(f"{name}: skipped ({type(e).__name__}: {str(e)[:120]})")
    return cases
