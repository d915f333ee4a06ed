"""Conformance cases of the lightning indexer: ``indexer.quantize_q``, ``indexer.insert_k``,
``indexer.logits`` (through per-token block tables, with the causal mask) and ``indexer.topk``."""

from __future__ import annotations

import math

import torch

from .. import indexer
from ..config import TINY
from ..testing import generator, randn
from .inputs import random_bytes, rope_table
from .suite import Case

OUTPUTS = {
    "indexer.quantize_q": lambda res, a: {"q": res[0], "weights_out": res[2]},
    "indexer.insert_k": lambda res, a: {"k_cache": a["k_cache"]},  # in place: the whole buffer is compared
    "indexer.logits": lambda res, a: {"logits": res},
    "indexer.topk": lambda res, a: {"ids_sorted": torch.sort(res.long(), dim=-1).values},  # order is free
}


def cases() -> list[Case]:
    g = generator(51)
    out = []
    T, nih = 4, TINY.index_heads
    table = rope_table(TINY.compress_rope_theta, TINY.yarn)
    iq = randn((T, nih, 128), seed=52, device="cpu", block=None, octaves=8)
    iq[0, 0] = iq[0, 0] / iq[0, 0].abs().max().float() * 448.0  # amax = 448·2^k: the exact ceil matters (#3)
    pos = torch.tensor([2, 3, 37, 299])
    wts = torch.randn(T, nih, generator=g)
    for had in (False, True):
        out.append(Case("indexer.quantize_q", f"fp8_hadamard_{had}",
                        dict(index_q=iq, positions=pos, cos_sin=table, weights=wts, fmt="fp8", hadamard=had),
                        ("index_q", "positions", "cos_sin", "weights"), tol={"q": "exact", "weights_out": "exact"},
                        why="RoPE on dims 64..127, bf16 round trip (#4), optional Hadamard (#24), q scale folded "
                            "into the weights (#25)"))
    # indexer K: write 80 keys (two requests' compressed rows) into shuffled 16-key pages, random bytes elsewhere
    Bc, P = 16, 8
    k = randn((80, 128), seed=53, device="cpu", block=None, octaves=8)
    bt = torch.randperm(P, generator=g).to(torch.int32).view(2, 4)
    loc = torch.arange(40)
    slots = torch.cat([bt[0, loc // Bc].long() * Bc + loc % Bc, bt[1, loc // Bc].long() * Bc + loc % Bc])
    slots[5] = -1
    kc = random_bytes(P * indexer.k_page_bytes(Bc), 54).view(P, -1)
    out.append(Case("indexer.insert_k", "soa_pages_minus1", dict(k_cache=kc, k=k, slots=slots, block_size=Bc,
                                                                  hadamard=True),
                    ("k_cache", "k", "slots"), tol={"k_cache": "exact"},
                    why="[Bc×128 e4m3][Bc×4 fp32 scale] pages (#9), −1 writes nothing (#11)"))
    kc2 = indexer.allocate_k_cache(P, Bc, device="cpu")
    indexer.insert_k(kc2, k, slots, block_size=Bc, hadamard=True, backend="reference")
    q8, _, w_out = indexer.quantize_q(iq, pos.clamp(max=159), table, wts, hadamard=True, backend="reference")
    lpos = torch.tensor([2, 3, 37, 159])  # visible rows n_c = 0, 1, 9, 40
    out.append(Case("indexer.logits", "block_table_causal",
                    dict(q=q8, q_scales=None, weights_out=w_out, k_cache=kc2, positions=lpos,
                         block_table=bt[torch.tensor([0, 1, 0, 1])], block_size=Bc, n_out=40),
                    ("q", "q_scales", "weights_out", "k_cache", "positions"), tol={"logits": "fp32_reduction"},
                    why="per-token block tables; ReLU per head before the weighted sum; −inf for s >= (p+1)//4 (#26)"))
    n, kk = 40, 16
    vals = torch.randperm(T * n, generator=g).float().view(T, n)  # no ties: the top-k set is unique
    vis = torch.arange(n)[None, :] < ((lpos + 1) // 4)[:, None]
    out.append(Case("indexer.topk", "causal_mask_minus1_padding", dict(logits=vals.masked_fill(~vis, -math.inf), k=kk),
                    ("logits", "k"), tol={"ids_sorted": "exact"},
                    why="−inf (not yet visible) ids become −1, rows padded with −1; p = 2 → none, p = 3 → id 0 (#26)"))
    return out
