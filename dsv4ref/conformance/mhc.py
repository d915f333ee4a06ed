"""Conformance cases of mHC: ``mhc.pre``, ``mhc.post`` (with the transposed-comb trap),
``mhc.fused_post_pre`` and ``mhc.head``."""

from __future__ import annotations

import math

import torch

from ..config import TINY
from ..testing import generator, randn
from .suite import Case

OUTPUTS = {
    "mhc.pre": lambda res, a: {"post": res[0], "comb": res[1], "layer_input": res[2]},
    "mhc.post": lambda res, a: {"residual": res},
    "mhc.fused_post_pre": lambda res, a: {"residual": res[0], "post": res[1], "comb": res[2], "layer_input": res[3]},
    "mhc.head": lambda res, a: {"out": res},
}


def cases() -> list[Case]:
    g = generator(41)
    out = []
    T, M, Hd = 3, TINY.hc_mult, TINY.hidden_size
    res = randn((T, M, Hd), seed=42, device="cpu", block=None, octaves=4)
    x = randn((T, Hd), seed=43, device="cpu", block=None, octaves=2)
    fn = torch.randn(M * (M + 2), M * Hd, generator=g) / math.sqrt(M * Hd)
    scale = torch.tensor([0.7, 0.4, 1.3])
    base = 0.3 * torch.randn(M * (M + 2), generator=g)
    kw = dict(rms_eps=TINY.rms_norm_eps, hc_eps=TINY.hc_eps)
    out.append(Case("mhc.pre", "model_constants", dict(residual=res, fn=fn, scale=scale, base=base, **kw),
                    ("residual", "fn", "scale", "base"), tol={"post": "mhc", "comb": "mhc", "layer_input": "bf16_out"},
                    why="post_mult 2, eps 1e-6, 20 Sinkhorn passes (#23); RMS of the flattened streams"))
    # the 4-cycle trap: comb ≈ P with P[0,1] = P[1,2] = P[2,3] = P[3,0] = 1; new_res_j must be res_{j-1}
    P = torch.zeros(M, M)
    for i in range(M):
        P[i, (i + 1) % M] = 1.0
    comb = (P * (1 - 3e-6) + 1e-6).expand(T, M, M).contiguous()
    post = (2 * torch.rand(T, M, 1, generator=g))
    out.append(Case("mhc.post", "transposed_comb_trap_4cycle", dict(x=x, residual=res, post=post, comb=comb),
                    ("x", "residual", "post", "comb"), tol={"residual": "bf16_out"},
                    why="Σ_i comb[i, j]·res_i, i.e. combᵀ @ res: the 4-cycle catches comb @ res (#22)"))
    fn2 = torch.randn(M * (M + 2), M * Hd, generator=g) / math.sqrt(M * Hd)
    out.append(Case("mhc.fused_post_pre", "cycle_comb_then_pre",
                    dict(x=x, residual=res, post=post, comb=comb, fn=fn2, scale=scale, base=base, **kw),
                    ("x", "residual", "post", "comb", "fn", "scale", "base"),
                    tol={"residual": "bf16_out", "post": "mhc", "comb": "mhc", "layer_input": "bf16_out"},
                    why="post, then the next sub-layer's pre, in one call"))
    hfn = torch.randn(M, M * Hd, generator=g) / math.sqrt(M * Hd)
    out.append(Case("mhc.head", "hc_head", dict(hidden=res, fn=hfn, scale=torch.tensor([0.5]),
                                                base=0.2 * torch.randn(M, generator=g), **kw),
                    ("hidden", "fn", "scale", "base"), tol={"out": "bf16_out"},
                    why="the final mix of the M streams into one: σ(mix·scale + base) + eps, no Sinkhorn"))
    return out
