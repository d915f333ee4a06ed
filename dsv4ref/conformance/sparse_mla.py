"""Conformance cases of ``sparse_mla.decode``: two pools in one softmax, −1 inside slot prefixes, an
empty row, ±inf sinks and padded heads."""

from __future__ import annotations

import math

import torch

from .. import sparse_mla
from ..testing import generator, randn
from .inputs import filled_cache
from .suite import Case, to_device

OUTPUTS = {
    "sparse_mla.decode": lambda res, a: {"out": res[0], "lse": res[1]},
}


def cases() -> list[Case]:
    g = generator(31)
    out = []
    B1, P1, B2, P2 = 61, 2, 2, 16
    c1, c2 = filled_cache(P1, B1, 32), filled_cache(P2, B2, 33)
    T, H = 5, 16
    q = randn((T, H, 512), seed=34, device="cpu", block=None, octaves=2)
    slots1 = torch.randperm(P1 * B1, generator=g)[: T * 20].view(T, 20).to(torch.int32)
    len1 = torch.tensor([20, 7, 0, 13, 20], dtype=torch.int32)
    slots1[0, 4] = slots1[3, 2] = -1  # −1 inside the prefix (#12)
    slots1[2] = -1  # row 2: empty in both pools
    slots2 = torch.randperm(P2 * B2, generator=g)[: T * 6].view(T, 6).to(torch.int32)
    len2 = torch.tensor([6, 0, 0, 3, 6], dtype=torch.int32)
    slots2[4, 1] = -1
    sink = torch.randn(H, generator=g)
    sink[0], sink[1], sink[2] = -math.inf, math.inf, 0.0
    out.append(Case("sparse_mla.decode", "two_pools_minus1_empty_row_inf_sinks",
                    dict(q=q, cache=c1, slots=slots1, lengths=len1, block_size=B1, sink=sink, scale=512**-0.55,
                         extra_cache=c2, extra_slots=slots2, extra_lengths=len2, extra_block_size=B2),
                    ("q", "cache", "slots", "lengths"), tol={"out": "bf16_weighted_sum", "lse": "lse"},
                    why="B = 61 and B = 2 pools in one softmax; −1 inside prefixes (#12); an empty row (out 0, "
                        "lse −inf; #18); sinks −inf, +inf, 0 and finite (#17); scale 512^-0.55"))
    Hp = 64
    qp = torch.cat([randn((T, H, 512), seed=35, device="cpu", block=None, octaves=2),
                    torch.zeros(T, Hp - H, 512, dtype=torch.bfloat16)], dim=1)
    sinkp = torch.cat([torch.randn(H, generator=g), torch.full((Hp - H,), -math.inf)])
    out.append(Case("sparse_mla.decode", "padded_heads_64",
                    dict(q=qp, cache=c1, slots=slots1, lengths=len1, block_size=B1, sink=sinkp),
                    ("q", "cache", "slots", "lengths"), tol={"out": "bf16_weighted_sum", "lse": "lse"},
                    why="H = 16 padded to 64 with zero q rows and −inf sinks: padded rows finite (#19)"))
    return out


def mass(case: Case) -> dict:
    """{"out": Σ_j p_j·|v_j|·σ(lse − sink)} of a sparse_mla.decode case, from the reference: the scale
    the kernel's bf16 rounding error grows with (tolerance "bf16_weighted_sum")."""
    a = {k: to_device(v) for k, v in case.inputs.items()}
    pos = [a.pop(k) for k in case.positional]
    return {"out": sparse_mla.reference.decode(*pos, **a, with_mass=True)[2].cpu()}
