"""Conformance cases of the MTP draft layer: ``mtp.greedy_accept`` (the verification rule, exact),
``mtp.accepted_counts`` (the same rule over a batch of rows), ``mtp.greedy_tokens`` (argmax, ties to the
lowest id) and ``mtp.draft_input`` (the block input: per-stream hnorm, e_proj broadcast, no embedding at
position 0). docs/mtp.md; each case's ``why`` names the pitfall it guards against. The draft_input cases use
Hd = 128 so the golden files stay small."""

from __future__ import annotations

import torch

from ..testing import generator, randn
from .suite import Case

OUTPUTS = {
    "mtp.greedy_accept": lambda res, a: {"emitted": res},
    "mtp.draft_input": lambda res, a: {"X": res},
    "mtp.accepted_counts": lambda res, a: {"counts": res},
    "mtp.greedy_tokens": lambda res, a: {"tokens": res},
}

ACCEPT = [  # name, drafts, target, why
    (
        "third_draft_wrong",
        [5, 7, 9],
        [5, 7, 8, 2],
        "the agreeing prefix, then the target's token where the draft disagrees; nothing after it",
    ),
    ("all_agree_bonus", [5, 7, 9], [5, 7, 9, 3], "all k drafts agree: k + 1 tokens, the last the target's bonus"),
    ("first_draft_wrong", [4, 7, 9], [5, 7, 9, 3], "one token, the target's, even though later drafts match"),
    ("k0_plain_step", [], [11], "no drafts: the target's token (plain decoding)"),
    (
        "no_skipping_after_a_mismatch",
        [1, 2, 3, 4, 5, 6, 7],
        [1, 9, 3, 4, 5, 6, 7, 0],
        "drafts 3..7 equal the target's tokens but come after a mismatch: they are not emitted",
    ),
    ("large_ids_int32", [129279, 7], [129279, 7, 129278], "ids near the V4 vocabulary size; int32 inputs give int64"),
]


def cases() -> list[Case]:
    out = []
    for name, d, t, why in ACCEPT:
        dt = torch.int32 if "int32" in name else torch.int64
        out.append(
            Case(
                "mtp.greedy_accept",
                name,
                dict(drafts=torch.tensor(d, dtype=dt), target=torch.tensor(t, dtype=dt)),
                ("drafts", "target"),
                tol={"emitted": "exact"},
                why=why,
            )
        )
    T, M, Hd = 4, 4, 128
    g = generator(61)
    h = randn((T, M, Hd), seed=62, device="cpu", block=None, octaves=6)  # streams over many octaves: per-stream hnorm
    base = dict(
        h_prev=h,
        embed_rows=randn((T, Hd), seed=63, device="cpu", block=None, octaves=0),
        positions=torch.tensor([0, 1, 7, 300]),
        enorm=1.0 + 0.1 * torch.randn(Hd, generator=g),
        hnorm=1.0 + 0.1 * torch.randn(Hd, generator=g),
        e_proj=(torch.randn(Hd, Hd, generator=g) / Hd**0.5).to(torch.bfloat16),
        h_proj=(torch.randn(Hd, Hd, generator=g) / Hd**0.5).to(torch.bfloat16),
        eps=1e-6,
    )
    pos_args = ("h_prev", "embed_rows", "positions", "enorm", "hnorm", "e_proj", "h_proj")
    out.append(
        Case(
            "mtp.draft_input",
            "streams_over_octaves_position0",
            base,
            pos_args,
            tol={"X": "bf16_gemm"},
            why="hnorm per stream, not over M·Hd (P14); e_proj(enorm(e)) added to every stream (P14); the row "
            "at position 0 has no embedding",
        )
    )
    flat = dict(base, h_prev=h.reshape(T, M * Hd), hc_mult=M)
    out.append(
        Case(
            "mtp.draft_input",
            "flat_stash_h_prev",
            flat,
            pos_args,
            tol={"X": "bf16_gemm"},
            why="vLLM stashes the residual flat, [T, M·Hd]: stream m is columns [m·Hd, (m+1)·Hd)",
        )
    )
    return out + _draft_input_more(base, pos_args) + _accepted_counts() + _greedy_tokens()


def _draft_input_more(base, pos_args) -> list[Case]:
    out = []
    T, M, Hd = 5, 1, 128
    g = generator(64)
    one = dict(
        base,
        h_prev=randn((T, M, Hd), seed=65, device="cpu", block=None, octaves=8),
        embed_rows=randn((T, Hd), seed=66, device="cpu", block=None, octaves=4),
        positions=torch.tensor([0, 0, 5, 0, 129000], dtype=torch.int32),
        enorm=1.0 + 0.1 * torch.randn(Hd, generator=g),
        hnorm=1.0 + 0.1 * torch.randn(Hd, generator=g),
    )
    out.append(
        Case(
            "mtp.draft_input",
            "single_stream_int32_positions",
            one,
            pos_args,
            tol={"X": "bf16_gemm"},
            why="M = 1; int32 positions with three rows at position 0 (a batch of prefills: no embedding "
            "on each), the others with one",
        )
    )
    T, M = 6, 4
    stream_major = randn((M, T, Hd), seed=67, device="cpu", block=None, octaves=6)
    wide = randn((T, 3 * Hd), seed=68, device="cpu", block=None, octaves=0)
    views = dict(
        base,
        h_prev=stream_major.transpose(0, 1),
        embed_rows=wide[:, Hd : 2 * Hd],
        positions=torch.tensor([3, 0, 8, 1, 2, 40]),
        e_proj=base["e_proj"].T.contiguous().T,
        h_proj=base["h_proj"].T.contiguous().T,
    )
    out.append(
        Case(
            "mtp.draft_input",
            "strided_views",
            views,
            pos_args,
            tol={"X": "bf16_gemm"},
            why="h_prev a stream-major [M, T, Hd] buffer seen as [T, M, Hd], embed_rows a column slice of "
            "a wider buffer, e_proj / h_proj column-major: values, not strides, define the op",
        )
    )
    small = dict(
        base,
        h_prev=(randn((4, 4, Hd), seed=69, device="cpu", block=None, octaves=0) * 2.0**-7),
        embed_rows=randn((4, Hd), seed=70, device="cpu", block=None, octaves=0) * 2.0**-6,
        eps=1e-2,
    )
    out.append(
        Case(
            "mtp.draft_input",
            "eps_dominates_small_rows",
            small,
            pos_args,
            tol={"X": "bf16_gemm"},
            why="eps = 1e-2 on rows whose mean square is ~1e-4: the given eps, inside the square root, sets "
            "the output's scale (a hard-coded 1e-6 is ~10x off)",
        )
    )
    empty = dict(
        base,
        h_prev=torch.zeros(0, 4, Hd, dtype=torch.bfloat16),
        embed_rows=torch.zeros(0, Hd, dtype=torch.bfloat16),
        positions=torch.zeros(0, dtype=torch.int64),
    )
    out.append(
        Case(
            "mtp.draft_input",
            "empty_batch",
            empty,
            pos_args,
            tol={"X": "bf16_gemm"},
            why="T = 0: an empty [0, M, Hd] bf16 result, no error",
        )
    )
    return out


COUNTS = [  # name, drafts, target, dtype, why
    (
        "mixed_rows_k3",
        [[5, 7, 9], [5, 7, 9], [4, 7, 9], [5, 8, 9], [1, 1, 1], [0, 0, 0]],
        [[5, 7, 8, 2], [5, 7, 9, 3], [5, 7, 9, 3], [5, 7, 9, 3], [1, 1, 1, 1], [0, 0, 0, 0]],
        torch.int64,
        "per row the number of LEADING agreements (2, 3, 0, 1, 3, 3): matches after a mismatch do not count; "
        "the bonus column is never compared; token 0 is a token",
    ),
    (
        "k0_plain_step",
        [[], [], []],
        [[11], [0], [7]],
        torch.int64,
        "k = 0 (drafts [R, 0]): every count is 0 and each row emits its target token",
    ),
    (
        "large_ids_int32",
        [[129279, 7, 3], [129279, 7, 4], [129278, 7, 3]],
        [[129279, 7, 3, 129278], [129279, 7, 3, 0], [129279, 7, 3, 1]],
        torch.int32,
        "ids near the V4 vocabulary size, int32 inputs: int64 counts 3, 2, 0",
    ),
    ("empty_batch", [[0, 0]] * 0, [[0, 0, 0]] * 0, torch.int64, "R = 0 rows: an empty int64 result"),
    (
        "one_row_k7_all_agree",
        [[3, 1, 4, 1, 5, 9, 2]],
        [[3, 1, 4, 1, 5, 9, 2, 6]],
        torch.int64,
        "all 7 drafts agree: count 7 (the row emits the 7 drafts and the bonus)",
    ),
]


def _accepted_counts() -> list[Case]:
    out = []
    for name, d, t, dt, why in COUNTS:
        R, k = len(t), len(t[0]) - 1 if t else 2
        out.append(
            Case(
                "mtp.accepted_counts",
                name,
                dict(drafts=torch.tensor(d, dtype=dt).reshape(R, k), target=torch.tensor(t, dtype=dt).reshape(R, k + 1)),
                ("drafts", "target"),
                tol={"counts": "exact"},
                why=why,
            )
        )
    g = torch.randint(0, 50, (4, 9), generator=generator(71))  # drafts = columns 1..5 of the target's columns 0..5
    tgt = g[:, :6]
    d = tgt[:, :5].clone()
    d[0, 2], d[2, 0], d[3, 4] = 99, 98, 97
    buf = torch.zeros(5, 4, dtype=torch.int64)
    buf.copy_(d.T)
    out.append(
        Case(
            "mtp.accepted_counts",
            "strided_views",
            dict(drafts=buf.T, target=g[:, :6]),
            ("drafts", "target"),
            tol={"counts": "exact"},
            why="drafts a column-major view, target a column slice of a wider buffer (the verification rows "
            "of a padded batch); counts 2, 5, 0, 4",
        )
    )
    return out


def _greedy_tokens() -> list[Case]:
    out = []
    g = generator(72)
    lg = torch.randn(4, 1000, generator=g) * 8
    lg[0, [17, 400, 999]] = 50.0  # a three-way tie: the lowest id
    lg[1] = 0.25  # all equal: id 0
    lg[2, 999] = 1e30  # the maximum in the last column
    lg[3, [3, 4]] = torch.tensor([30.0, 30.000002])  # one ulp apart: no rounding through bf16
    out.append(
        Case(
            "mtp.greedy_tokens",
            "ties_to_the_lowest_id",
            dict(logits=lg),
            ("logits",),
            tol={"tokens": "exact"},
            why="argmax ties go to the lowest token id (a three-way tie, an all-equal row); values one fp32 "
            "ulp apart are not tied (compared in fp32, not bf16)",
        )
    )
    lg = torch.full((3, 64), -float("inf"))
    lg[1, 40] = -1e38
    lg[2, [5, 9]] = float("inf")
    out.append(
        Case(
            "mtp.greedy_tokens",
            "infinite_logits",
            dict(logits=lg),
            ("logits",),
            tol={"tokens": "exact"},
            why="a row all −inf (a fully masked vocabulary) gives id 0; one finite entry among −inf wins; "
            "two +inf tie to the lower id",
        )
    )
    V = 129280
    lg = randn((2, V), seed=73, device="cpu", dtype=torch.float32, block=4096, octaves=4)
    lg[0, V - 1] = 1e4
    lg[1, 65537] = 1e4
    out.append(
        Case(
            "mtp.greedy_tokens",
            "v4_vocabulary_129280",
            dict(logits=lg),
            ("logits",),
            tol={"tokens": "exact"},
            why="V4's vocabulary size: the maximum in the last column, and past 65536 (an int16 or a "
            "one-block reduction loses it); int64 ids",
        )
    )
    big = torch.randn(20, 7, generator=g) * 3
    out.append(
        Case(
            "mtp.greedy_tokens",
            "column_major_many_rows",
            dict(logits=big.T.contiguous().T),
            ("logits",),
            tol={"tokens": "exact"},
            why="20 rows of a column-major [T, V] buffer, V = 7",
        )
    )
    out.append(
        Case(
            "mtp.greedy_tokens",
            "empty_batch",
            dict(logits=torch.zeros(0, 32)),
            ("logits",),
            tol={"tokens": "exact"},
            why="T = 0: an empty int64 result",
        )
    )
    lg = torch.randn(3, 300, generator=g) * 2.0**-20  # tiny logits: no scaling assumption
    lg[1, :150] -= 1.0
    lg[2] = -1.0
    lg[2, 10], lg[2, 200] = 0.0, 1e-45  # the smallest positive subnormal beats 0.0: flushed to zero, they would tie
    out.append(
        Case(
            "mtp.greedy_tokens",
            "tiny_and_subnormal_logits",
            dict(logits=lg),
            ("logits",),
            tol={"tokens": "exact"},
            why="logits of magnitude 2^-20, and a row whose maximum is the subnormal 1e-45 next to 0.0 at a "
            "lower id: no flush to zero, the exact fp32 order",
        )
    )
    return out
