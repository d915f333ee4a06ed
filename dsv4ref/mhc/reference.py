"""mHC in plain PyTorch: the whole op, readable in one sitting (the math is in ``docs/mhc.md``).

DeepSeek-V4 keeps ``M = 4`` residual streams per token, ``Hs [T, M, Hd]`` bf16. Around every attention and
FFN sub-layer:

* **pre** reads the streams and makes three sets of weights from one GEMM of the FLATTENED streams
  ``X [T, M·Hd]`` with ``fn [M·(M+2), M·Hd]`` (the RMS factor is applied after the GEMM, one scalar per
  token); logits ``mix = [pre 0:M | post M:2M | comb 2M: (row-major M×M)]``::

      pre  = σ(mix_pre ·α_pre  + b_pre) + eps          input weights,  in (eps, 1 + eps)
      post = σ(mix_post·α_post + b_post)·post_mult     output weights, in (0, 2)
      comb = Sinkhorn(mix_comb·α_res + b_comb)         a nearly doubly-stochastic M×M stream mix
      x    = Σ_i pre_i · Hs_i                          the sub-layer input [T, Hd]

* **post** writes the sub-layer output back: ``Hs'_j = post_j·x + Σ_i comb[i, j]·Hs_i`` = ``combᵀ @ Hs``.
  ``comb[i, j]`` is the weight from SOURCE stream i to DESTINATION stream j (docs/mhc.md#pitfalls).
* **fused_post_pre** is post, then the next sub-layer's pre on the new (bf16) streams.
* **head** (after the last layer): ``Σ_m gate_m·Hs_m`` with ``gate = σ(mix·α + b) + eps``; no Sinkhorn.

Every function computes in ``dtype``: float32 is the library's ``backend="reference"``, float64 the oracle
the tests and ``check`` compare the kernels against. Results are returned unrounded, in ``dtype``.
"""

from __future__ import annotations

import torch
from einops import rearrange

from ..config import FLASH
from ..formats import HC_MULT

SINKHORN_ITERS = FLASH.hc_sinkhorn_iters  # 20 passes
HC_EPS = FLASH.hc_eps  # 1e-6: hc_pre_eps = hc_sinkhorn_eps
RMS_EPS = FLASH.rms_norm_eps  # 1e-6
POST_MULT = 2.0  # post = 2σ(·)

__all__ = [
    "sinkhorn",
    "mix",
    "pre",
    "post",
    "fused_post_pre",
    "head",
    "HC_MULT",
    "SINKHORN_ITERS",
    "HC_EPS",
    "RMS_EPS",
    "POST_MULT",
]


def sinkhorn(logits: torch.Tensor, iters: int = SINKHORN_ITERS, eps: float = HC_EPS) -> torch.Tensor:
    """The DSV4 Sinkhorn schedule on ``[..., M, M]`` logits, in their dtype (docs/mhc.md#sinkhorn).

    Axis -2 is the source stream i (rows), axis -1 the destination stream j (columns)::

        pass 1:         C = softmax(C over j) + eps;   C = C / (Σ_i C + eps)     row softmax, then columns
        pass 2..iters:  C = C / (Σ_j C + eps);         C = C / (Σ_i C + eps)     rows, then columns

    The last step normalises columns: column sums are 1 − O(eps), row sums only converge towards 1.
    """
    c = torch.softmax(logits, dim=-1) + eps  # pass 1: row softmax (over j), then + eps ...
    c = c / (c.sum(dim=-2, keepdim=True) + eps)  # ... then a column normalisation (over i)
    for _ in range(iters - 1):  # passes 2..iters: row, then column
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def mix(residual: torch.Tensor, fn: torch.Tensor, *, rms_eps: float = RMS_EPS, dtype=torch.float32) -> torch.Tensor:
    """The mix logits ``[T, rows of fn]`` = (X @ fnᵀ) · rsqrt(mean(X²) + rms_eps), X the flattened streams.

    The RMS is over all ``M·Hd`` values of a token (not per stream) and multiplies the GEMM's result:
    normalising X first gives the same numbers, because the factor is one scalar per token."""
    X = rearrange(residual, "t m h -> t (m h)").to(dtype)
    return (X @ fn.to(dtype).T) * torch.rsqrt(X.square().mean(dim=-1, keepdim=True) + rms_eps)


def pre(
    residual,
    fn,
    scale,
    base,
    *,
    rms_eps=RMS_EPS,
    hc_eps=HC_EPS,
    post_mult=POST_MULT,
    sinkhorn_iters=SINKHORN_ITERS,
    dtype=torch.float32,
):
    """mHC pre: ``(post [T, M], comb [T, M, M], x [T, Hd])`` in ``dtype`` (x NOT rounded to bf16).

    residual ``[T, M, Hd]``; fn ``[M·(M+2), M·Hd]``; scale ``[3]`` = (α_pre, α_post, α_res); base ``[M·(M+2)]``."""
    M = residual.shape[1]
    scale, base = scale.to(dtype), base.to(dtype)
    m = mix(residual, fn, rms_eps=rms_eps, dtype=dtype)  # [T, M·(M+2)] = [pre | post | comb]
    w_pre = torch.sigmoid(m[:, :M] * scale[0] + base[:M]) + hc_eps
    w_post = torch.sigmoid(m[:, M : 2 * M] * scale[1] + base[M : 2 * M]) * post_mult
    logits = rearrange(m[:, 2 * M :], "t (i j) -> t i j", i=M) * scale[2] + base[2 * M :].reshape(M, M)
    comb = sinkhorn(logits, sinkhorn_iters, hc_eps)
    x = (w_pre[:, :, None] * residual.to(dtype)).sum(dim=1)  # Σ_i pre_i · Hs_i
    return w_post, comb, x


def post(x, residual, post, comb, *, dtype=torch.float32):
    """mHC post: the new streams ``[T, M, Hd]`` in ``dtype``.

    new[t, j] = post[t, j]·x[t] + Σ_i comb[t, i, j]·residual[t, i]: the SOURCE index i is summed, so the
    stream mix is combᵀ @ residual. post may be ``[T, M]`` or ``[T, M, 1]``."""
    T, M, Hd = residual.shape
    post = post.reshape(T, M).to(dtype)
    mixed = torch.einsum("tij,tih->tjh", comb.to(dtype), residual.to(dtype))  # sum over the source i
    return post[:, :, None] * x.to(dtype)[:, None, :] + mixed


def fused_post_pre(
    x,
    residual,
    post_in,
    comb_in,
    fn,
    scale,
    base,
    *,
    rms_eps=RMS_EPS,
    hc_eps=HC_EPS,
    post_mult=POST_MULT,
    sinkhorn_iters=SINKHORN_ITERS,
    dtype=torch.float32,
):
    """post with the previous sub-layer's ``post_in, comb_in``, then pre with the next one's ``fn, scale,
    base``: ``(new [T, M, Hd] bf16, post [T, M], comb [T, M, M], x [T, Hd])``. The new streams are rounded
    to bf16 (what the op stores) before the pre reads them; the rest is in ``dtype``."""
    new = post(x, residual, post_in, comb_in, dtype=dtype).to(torch.bfloat16)
    return (
        new,
        *pre(
            new, fn, scale, base, rms_eps=rms_eps, hc_eps=hc_eps, post_mult=post_mult, sinkhorn_iters=sinkhorn_iters, dtype=dtype
        ),
    )


def head(hidden, fn, scale, base, *, rms_eps=RMS_EPS, hc_eps=HC_EPS, dtype=torch.float32):
    """HC head: ``out [T, Hd]`` in ``dtype`` = Σ_m gate_m·hidden_m, gate = σ(mix·scale + base) + hc_eps.

    fn ``[M, M·Hd]``, scale ``[1]``, base ``[M]``: a pre with M logits, no post and no Sinkhorn."""
    gate = torch.sigmoid(mix(hidden, fn, rms_eps=rms_eps, dtype=dtype) * scale.to(dtype)[0] + base.to(dtype)) + hc_eps
    return (gate[:, :, None] * hidden.to(dtype)).sum(dim=1)
