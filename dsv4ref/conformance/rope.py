"""Conformance cases of RoPE and its fused neighbour: ``rope.apply_gptj`` (the rotation, and the inverse
rotation of the attention output) and ``rope.qnorm_rope_kv_insert``.

The q output of the fused step is compared under the tolerance row "qnorm_rope_q" (``docs/rope.md#exactness``):
relative to the larger element of each rotary pair (:func:`mass`), so that every form the spec allows passes —
dsv4ref's fp32 form and vLLM's bf16-after-the-norm form alike — while a wrong pairing, position or norm fails.
The cache bytes are exact. Strided layouts reach an implementation here as dense non-contiguous tensors
(head-major q, transposed kv and weights, transposed per-row positions): the suite hands each case a clone,
which keeps a dense layout but not a slice's gaps (those are tested in ``tests/test_contract_rope.py``).
"""

from __future__ import annotations


import torch

from ..config import TINY
from ..testing import generator, randn
from .inputs import head_major, kv_rows, random_cache, rope_table, transposed
from .suite import Case

OUTPUTS = {
    "rope.apply_gptj": lambda res, a: {"out": res},
    "rope.qnorm_rope_kv_insert": lambda res, a: {"q": a["q"], "cache": a["cache"]},  # both in place
}

_Q_TOL = {"q": "qnorm_rope_q", "cache": "exact"}


def pair_max(t: torch.Tensor) -> torch.Tensor:
    """max(|t[..., d]|, |t[..., d ^ 1]|) for every d of the last dim (NaN ignored): the scale of the rounding
    error a rotation moves between the two members of a pair. fp32 (exact for bf16 input)."""
    a = t.detach().float().abs()
    return torch.fmax(a, a[..., torch.arange(a.shape[-1], device=a.device) ^ 1])


def mass(case: Case) -> dict:
    """The "mass" of each output compared under a "mass" row: the pair maximum of the expected q."""
    return {o: pair_max(case.expected[o]) for o, t in case.tol.items() if t == "qnorm_rope_q"}


def _gptj_cases() -> list[Case]:
    out = []

    def case(name, x, positions, cos_sin, inverse, tol, why):
        out.append(
            Case(
                "rope.apply_gptj",
                name,
                dict(x=x, positions=positions, cos_sin=cos_sin, inverse=inverse),
                ("x", "positions", "cos_sin", "inverse"),
                tol={"out": tol},
                why=why,
            )
        )

    T, H = 5, 16
    x = randn((T, H, 512), seed=22, device="cpu", block=None, octaves=4)
    case(
        "inverse_on_output_yarn",
        x,
        torch.tensor([0, 1, 299, 511, 37]),
        rope_table(TINY.compress_rope_theta, TINY.yarn),
        True,
        "bf16_out",
        "inverse RoPE at the query position on dims 448..511 only (#14, #16)",
    )
    g = generator(27)
    x = head_major(randn((4, 3, 512), seed=28, device="cpu", block=None, octaves=4))
    pos = torch.randint(0, 64, (3, 4), generator=g, dtype=torch.int32).t()  # [T, H], stored transposed
    case(
        "per_row_int32_positions_head_major",
        x,
        pos,
        rope_table(TINY.rope_theta, None, 64),
        False,
        "bf16_out",
        "one position per (token, head) row, int32, in a transposed layout; x heads-outermost (strides honoured)",
    )
    x = randn((6, 128), seed=29, device="cpu", dtype=torch.float32, block=None, octaves=6)
    case(
        "fp32_indexer_head_yarn_last_rows",
        x,
        torch.tensor([127, 0, 126, 64, 1, 127]),
        rope_table(TINY.compress_rope_theta, TINY.yarn, 128),
        False,
        "fp32_elementwise",
        "a 128-dim indexer head in fp32 rotates dims 64..127; int64 positions up to the table's last row (#16)",
    )
    x = randn((5, 67), seed=30, device="cpu", block=None, octaves=2)
    case(
        "odd_row_length_67",
        x,
        torch.tensor([3, 60, 0, 33, 12]),
        rope_table(TINY.rope_theta, None, 64),
        True,
        "bf16_out",
        "an odd row length (3 dims before the rotary slice, odd row stride), inverse rotation",
    )
    x = randn((4, 2, 128), seed=31, device="cpu", block=None, octaves=2)
    x[0, 0, 70] = float("nan")  # a NaN in a pair: both members NaN
    x[1, 1, 65] = float("inf")  # +inf in a pair: ±inf or NaN where the partner's factor is 0
    x[2, 0, 100], x[2, 0, 101] = float("-inf"), float("inf")  # inf − inf: NaN
    x[3, 1, 3] = float("nan")  # outside the rotary slice: copied
    case(
        "non_finite_propagate",
        x,
        torch.tensor([0, 5, 9, 63]),
        rope_table(TINY.rope_theta, None, 64),
        False,
        "bf16_out",
        "NaN/±inf follow IEEE arithmetic through the rotation on every backend, never an error (docs/rope.md#non-finite-input)",
    )
    case(
        "empty_batch",
        torch.zeros(0, 4, 512, dtype=torch.bfloat16),
        torch.zeros(0, dtype=torch.int64),
        rope_table(TINY.rope_theta, None, 16),
        False,
        "bf16_out",
        "T = 0: an empty output, no launch",
    )
    return out


def _qnorm_cases() -> list[Case]:
    out = []
    g = generator(21)

    def case(name, q, kv, cache, slots, positions, cos_sin, block_size, why, eps=1e-6, check_values=True):
        out.append(
            Case(
                "rope.qnorm_rope_kv_insert",
                name,
                dict(q=q, kv=kv, cache=cache, slots=slots, positions=positions, cos_sin=cos_sin, eps=eps, block_size=block_size),
                ("q", "kv", "cache", "slots", "positions", "cos_sin"),
                tol=dict(_Q_TOL),
                why=why,
                check_values=check_values,
            )
        )

    T, H = 5, 16
    pos = torch.tensor([0, 1, 299, 511, 37])
    B, P = 16, 2
    q = randn((T, H, 512), seed=23, device="cpu", block=None, octaves=6)
    slots = torch.randperm(P * B, generator=g)[:4]
    slots[1] = -1
    case(
        "minus1_and_short_slots",
        q,
        kv_rows(T, 24),
        random_cache(P, B, 25),
        slots,
        pos,
        rope_table(TINY.rope_theta, None),
        B,
        "q-norm over all 512 dims then RoPE; slot −1 and rows past len(slots) write nothing (#11)",
    )

    T, H, B, P = 6, 2, 5, 3
    slots = torch.randperm(P * B, generator=g)[:T].to(torch.int32)
    slots[4] = -1
    case(
        "odd_block_B5_int32",
        randn((T, H, 512), seed=40, device="cpu", block=None, octaves=6),
        kv_rows(T, 41),
        random_cache(P, B, 42),
        slots,
        torch.tensor([5, 0, 63, 17, 2, 40], dtype=torch.int32),
        rope_table(TINY.rope_theta, None, 64),
        B,
        "an odd page size (B = 5, #9), int32 slots and positions, a −1 (#11)",
    )

    T, B, P = 7, 2, 6
    slots = torch.randperm(P * B, generator=g)[:5]
    case(
        "B2_short_slots_one_head",
        randn((T, 1, 512), seed=43, device="cpu", block=None, octaves=6),
        kv_rows(T, 44),
        random_cache(P, B, 45),
        slots,
        torch.randint(0, 64, (T,), generator=g),
        rope_table(TINY.rope_theta, None, 64),
        B,
        "2-token pages (1728-B page stride), one head, rows 5..6 padding: nothing written for them (#11)",
    )

    T, H, B, P = 3, 4, 3, 2
    q = head_major(randn((T, H, 512), seed=46, device="cpu", block=None, octaves=6))
    kv = transposed(kv_rows(T, 47))
    case(
        "head_major_q_transposed_kv_yarn",
        q,
        kv,
        random_cache(P, B, 48),
        torch.tensor([4, 0, 3]),
        torch.tensor([127, 64, 0]),
        rope_table(TINY.compress_rope_theta, TINY.yarn, 128),
        B,
        "q stored heads-outermost, kv with a non-contiguous last dim (honoured: written in place / read by value); "
        "YaRN table, positions at its last row; odd B = 3",
    )

    T, H, B, P = 3, 3, 4, 1
    q = randn((T, H, 512), seed=49, device="cpu", block=None, octaves=4)
    q[0, 1, 5] = float("nan")  # the whole head becomes NaN
    q[1, 2, 460] = float("inf")  # rr = 0: zeros, NaN at the inf and its pair partner
    q[2, 0, 3] = float("-inf")  # rr = 0: zeros, NaN at dim 3
    case(
        "non_finite_q_head",
        q,
        kv_rows(T, 50),
        random_cache(P, B, 51),
        torch.tensor([2, -1, 0]),
        torch.tensor([9, 0, 33]),
        rope_table(TINY.rope_theta, None, 64),
        B,
        "a NaN in q makes its head NaN (never an empty-looking row); ±inf gives rr = 0 and NaN where it was "
        "(docs/rope.md#non-finite-input); kv finite",
    )

    T, H, B, P = 3, 1, 3, 2
    kv = kv_rows(T, 56)
    kv[0, 70] = float("nan")  # NoPE block 1 of the row written to slot 4
    kv[1, 5] = float("-inf")  # NoPE block 0 of the row written to slot 0
    kv[2, 449] = float("inf")  # a rotary dim: stored as the rotation gives it (±inf here, no NaN payload to match)
    case(
        "non_finite_kv_checks_off",
        randn((T, H, 512), seed=57, device="cpu", block=None, octaves=4),
        kv,
        random_cache(P, B, 58),
        torch.tensor([4, 0, 2]),
        torch.tensor([1, 2, 3]),
        rope_table(TINY.rope_theta, None, 64),
        B,
        "value checks off (the hot path): a NoPE block holding NaN/±inf is written as scale byte 255 and e4m3 "
        "NaN bytes (0x7F/0xFF), the rotary dims as rotated — kv_cache.insert's encoding (docs/rope.md#non-finite-input)",
        check_values=False,
    )

    T, H, B, P = 3, 2, 4, 1
    case(
        "no_slots_all_padding",
        randn((T, H, 512), seed=52, device="cpu", block=None, octaves=4),
        kv_rows(T, 53),
        random_cache(P, B, 54),
        torch.zeros(0, dtype=torch.int64),
        torch.tensor([1, 2, 3]),
        rope_table(TINY.rope_theta, None, 64),
        B,
        "len(slots) = 0: q still normalised and rotated, the cache untouched (#11)",
    )
    case(
        "empty_batch",
        torch.zeros(0, 4, 512, dtype=torch.bfloat16),
        torch.zeros(0, 512, dtype=torch.bfloat16),
        random_cache(1, 2, 55),
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        rope_table(TINY.rope_theta, None, 16),
        2,
        "T = 0: nothing to do, nothing written",
    )
    return out


def cases() -> list[Case]:
    return _gptj_cases() + _qnorm_cases()
