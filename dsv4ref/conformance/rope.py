"""Conformance cases of RoPE and its fused neighbours: ``rope.apply_gptj`` (here the inverse rotation of
the attention output), ``rope.qnorm_rope_kv_insert`` and ``rope.grouped_o_proj``."""

from __future__ import annotations

import math

import torch

from ..config import TINY
from ..testing import generator, randn
from .inputs import kv_rows, random_cache, rope_table
from .suite import Case

OUTPUTS = {
    "rope.apply_gptj": lambda res, a: {"out": res},
    "rope.qnorm_rope_kv_insert": lambda res, a: {"q": a["q"], "cache": a["cache"]},  # both in place
    "rope.grouped_o_proj": lambda res, a: {"out": res},
}


def cases() -> list[Case]:
    g = generator(21)
    out = []
    T, H = 5, 16
    x = randn((T, H, 512), seed=22, device="cpu", block=None, octaves=4)
    pos = torch.tensor([0, 1, 299, 511, 37])
    out.append(Case("rope.apply_gptj", "inverse_on_output_yarn",
                    dict(x=x, positions=pos, cos_sin=rope_table(TINY.compress_rope_theta, TINY.yarn), inverse=True),
                    ("x", "positions", "cos_sin", "inverse"), tol={"out": "bf16_out"},
                    why="inverse RoPE at the query position on dims 448..511 only (#14, #16)"))
    B, P = 16, 2
    q = randn((T, H, 512), seed=23, device="cpu", block=None, octaves=6)
    kv = kv_rows(T, 24)
    slots = torch.randperm(P * B, generator=g)[:4]
    slots[1] = -1
    out.append(Case("rope.qnorm_rope_kv_insert", "minus1_and_short_slots",
                    dict(q=q, kv=kv, cache=random_cache(P, B, 25), slots=slots, positions=pos,
                         cos_sin=rope_table(TINY.rope_theta, None), eps=1e-6, block_size=B),
                    ("q", "kv", "cache", "slots", "positions", "cos_sin"), tol={"q": "bf16_out", "cache": "exact"},
                    why="q-norm over all 512 dims then RoPE; slot −1 and rows past len(slots) write nothing (#11)"))
    G, o_lora, Hd, H = 2, 64, 128, 4
    o = randn((3, H, 512), seed=26, device="cpu", block=None, octaves=2)
    wo_a = (torch.randn(G, o_lora, H // G * 512, generator=g) / math.sqrt(H // G * 512)).to(torch.bfloat16)
    wo_b = (torch.randn(Hd, G * o_lora, generator=g) / math.sqrt(G * o_lora)).to(torch.bfloat16)
    out.append(Case("rope.grouped_o_proj", "tiny_G2", dict(o=o, wo_a=wo_a, wo_b=wo_b), ("o", "wo_a", "wo_b"),
                    tol={"out": "bf16_gemm"}, why="contiguous head groups: group g holds heads g·H/G … (g+1)·H/G − 1"))
    return out
