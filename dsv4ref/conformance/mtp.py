"""Conformance cases of the MTP draft layer: ``mtp.greedy_accept`` (the verification rule, exact) and
``mtp.draft_input`` (the block input: per-stream hnorm, e_proj broadcast, no embedding at position 0).
docs/mtp.md; each case's ``why`` names the pitfall it guards against. The draft_input cases use Hd = 128
so the golden files stay small."""

from __future__ import annotations

import torch

from ..testing import generator, randn
from .suite import Case

OUTPUTS = {
    "mtp.greedy_accept": lambda res, a: {"emitted": res},
    "mtp.draft_input": lambda res, a: {"X": res},
}

ACCEPT = [  # name, drafts, target, why
    ("third_draft_wrong", [5, 7, 9], [5, 7, 8, 2], "the agreeing prefix, then the target's token where the draft "
                                                   "disagrees; nothing after it"),
    ("all_agree_bonus", [5, 7, 9], [5, 7, 9, 3], "all k drafts agree: k + 1 tokens, the last the target's bonus"),
    ("first_draft_wrong", [4, 7, 9], [5, 7, 9, 3], "one token, the target's, even though later drafts match"),
    ("k0_plain_step", [], [11], "no drafts: the target's token (plain decoding)"),
    ("no_skipping_after_a_mismatch", [1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6, 7, 0],
     "drafts 3..7 equal the target's tokens but come after a mismatch: they are not emitted"),
    ("large_ids_int32", [129279, 7], [129279, 7, 129278], "ids near the V4 vocabulary size; int32 inputs give int64"),
]


def cases() -> list[Case]:
    out = []
    for name, d, t, why in ACCEPT:
        dt = torch.int32 if "int32" in name else torch.int64
        out.append(Case("mtp.greedy_accept", name, dict(drafts=torch.tensor(d, dtype=dt), target=torch.tensor(t, dtype=dt)),
                        ("drafts", "target"), tol={"emitted": "exact"}, why=why))
    T, M, Hd = 4, 4, 128
    g = generator(61)
    h = randn((T, M, Hd), seed=62, device="cpu", block=None, octaves=6)  # streams over many octaves: per-stream hnorm
    base = dict(h_prev=h, embed_rows=randn((T, Hd), seed=63, device="cpu", block=None, octaves=0),
                positions=torch.tensor([0, 1, 7, 300]), enorm=1.0 + 0.1 * torch.randn(Hd, generator=g),
                hnorm=1.0 + 0.1 * torch.randn(Hd, generator=g),
                e_proj=(torch.randn(Hd, Hd, generator=g) / Hd**0.5).to(torch.bfloat16),
                h_proj=(torch.randn(Hd, Hd, generator=g) / Hd**0.5).to(torch.bfloat16), eps=1e-6)
    pos_args = ("h_prev", "embed_rows", "positions", "enorm", "hnorm", "e_proj", "h_proj")
    out.append(Case("mtp.draft_input", "streams_over_octaves_position0", base, pos_args, tol={"X": "bf16_gemm"},
                    why="hnorm per stream, not over M·Hd (P14); e_proj(enorm(e)) added to every stream (P14); the row "
                        "at position 0 has no embedding"))
    flat = dict(base, h_prev=h.reshape(T, M * Hd), hc_mult=M)
    out.append(Case("mtp.draft_input", "flat_stash_h_prev", flat, pos_args, tol={"X": "bf16_gemm"},
                    why="vLLM stashes the residual flat, [T, M·Hd]: stream m is columns [m·Hd, (m+1)·Hd)"))
    return out
