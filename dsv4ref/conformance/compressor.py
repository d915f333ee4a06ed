"""Conformance cases of the compressor: ``compressor.compress`` (docs/compressor.md; each case's ``why``
names the pitfall it guards against).

The widths are small so the golden files stay small: D = 128 (the indexer's width) for ratio 4 and D = 32
for ratio 128 over a hidden size of 64; the op is written for any power-of-two D, and the tests run
D = 512 at Hd = 256.

The state (``state_kv``, ``state_score``) starts as random finite values, not the −inf of a fresh state: it
stands for the history of each request, and a ring row the step should leave alone, or a position before
the sequence start that must be masked, shows when an implementation touches or reads it."""

from __future__ import annotations

import torch

from ..compressor import example_inputs, overlap
from ..testing import generator, randn
from .suite import Case

OUTPUTS = {
    "compressor.compress": lambda res, a: {
        "rows": res[0],
        "done": res[1],
        "state_kv": a["state_kv"],
        "state_score": a["state_score"],
    },
}

TOL = {"rows": "compressor", "done": "exact", "state_kv": "fp32_dot", "state_score": "fp32_dot"}
POSITIONAL = ("x", "wkv", "wgate", "ape", "norm", "state_kv", "state_score", "requests", "positions")


def _case(name, why, *, ratio, runs, R, dim=128, hidden=64, seed=0, valid=None, index_dtype=torch.int64):
    """``runs``: (request, first position, number of tokens) per run of rows, in row order."""
    w = example_inputs(ratio, dim=dim, hidden=hidden, seed=seed, device="cpu")
    coff = overlap(ratio)
    g = generator(seed + 7)
    shape = (R, coff * ratio, coff * dim)
    req = torch.cat([torch.full((n,), q) for q, _, n in runs]).to(index_dtype)
    pos = torch.cat([torch.arange(p, p + n) for _, p, n in runs]).to(index_dtype)
    inputs = dict(
        x=randn((req.shape[0], hidden), seed=seed + 1, block=None, octaves=2, device="cpu"),
        **w,
        state_kv=torch.randn(shape, generator=g),
        state_score=torch.randn(shape, generator=g),
        requests=req,
        positions=pos,
        ratio=ratio,
        eps=1e-6,
    )
    if valid is not None:
        inputs["valid"] = torch.tensor(valid)
    return Case("compressor.compress", name, inputs, POSITIONAL, tol=dict(TOL), why=why)


def cases() -> list[Case]:
    return [
        _case(
            "r4_prefill_two_requests_start_mask",
            ratio=4,
            R=3,
            runs=[(0, 0, 13), (2, 0, 6)],
            why="a prefill: every window read from the step's own rows; positions < 0 masked by position, not by "
            "what the state holds (C3); the older 4 tokens give channels [0:D], the newer [D:2D] (C2); "
            "request 1's ring untouched",
        ),
        _case(
            "r4_decode_step_from_ring",
            ratio=4,
            R=4,
            runs=[(0, 7, 1), (1, 3, 1), (2, 100, 1), (3, 10, 1)],
            why="one token per request: boundary rows read 7 of their 8 window positions from the ring, at row "
            "p % 8; a per-channel softmax (C1); ape of p % 4 (C5)",
        ),
        _case(
            "r4_long_step_reads_ring_then_overwrites",
            ratio=4,
            R=1,
            runs=[(0, 6, 12)],
            why="12 tokens after position 5: boundary 7 reads positions 0..5 from the ring that positions 8..13 of "
            "the same step overwrite; the ring must be read first (C4)",
        ),
        _case(
            "r128_decode_boundary_and_not",
            ratio=128,
            R=3,
            dim=32,
            runs=[(0, 127, 1), (1, 1000, 1), (2, 255, 1)],
            why="ratio 128 (no overlap): a boundary reads its 127 older positions from the ring; a non-boundary "
            "token only writes its ring row and returns zeros",
        ),
        _case(
            "r128_prefill_continuing_ring",
            ratio=128,
            R=2,
            dim=32,
            runs=[(1, 0, 4), (0, 120, 140)],
            why="a step continuing a request at position 120: boundary 127 mixes ring rows 0..119 with the step's "
            "rows; boundary 255 reads only the step; only the last 128 tokens reach the ring",
        ),
        _case(
            "r4_padding_row_at_boundary_int32",
            ratio=4,
            R=2,
            runs=[(1, 3, 1), (0, 0, 8)],
            valid=[False] + [True] * 8,
            index_dtype=torch.int32,
            why="a padding row (valid False) at a boundary position "
            "completes nothing and writes no ring row (C6); int32 requests/positions",
        ),
    ]
