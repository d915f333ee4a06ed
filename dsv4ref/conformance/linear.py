"""Conformance cases of the projections: ``linear.act_quant``, the weight quantisers, ``fp8_gemm`` /
``fp4_gemm``, ``fp8_linear`` / ``fp4_linear`` (docs/linear.md), and the attention's bf16 output projection
``linear.grouped_o_proj`` (compared under "bf16_gemm"; o heads-outermost and transposed weights reach it as
dense non-contiguous tensors).

Bytes are compared bit for bit ("exact"): e4m3 codes, fp32 power-of-two scales, UE8M0 bytes, packed E2M1. The
GEMM outputs (bf16) under "linear_out", with mass = Σ_i |q_i·w_i|·scales of the same quantised operands
(:func:`dsv4ref.linear.reference.gemm_mass`). Weights and scales are stored as uint8 bytes (the API accepts
them), so every file format holds them; the quantisers' outputs are compared as bytes too.
"""

from __future__ import annotations

import math

import torch

from ..linear import reference
from ..testing import generator, randn
from .inputs import head_major, transposed
from .suite import Case


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


OUTPUTS = {
    "linear.act_quant": lambda res, a: {"q": _bytes(res[0]), "s": res[1]},
    "linear.quantize_fp8_weight": lambda res, a: {"w": _bytes(res[0]), "scale": _bytes(res[1])},
    "linear.quantize_fp4_weight": lambda res, a: {"w_packed": _bytes(res[0]), "scale": _bytes(res[1])},
    "linear.fp8_gemm": lambda res, a: {"y": res},
    "linear.fp4_gemm": lambda res, a: {"y": res},
    "linear.fp8_linear": lambda res, a: {"y": res},
    "linear.fp4_linear": lambda res, a: {"y": res},
    "linear.grouped_o_proj": lambda res, a: {"out": res},
}


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return randn((m, k), seed=seed, dtype=torch.bfloat16, block=128, octaves=24, device="cpu")


def activations() -> list[tuple[str, torch.Tensor, bool, str]]:
    """(name, x [M, K] bf16, check_values, why): the activation cases every op taking x (or its quantisation) runs."""
    zero = _x(4, 256, 91)
    zero[1, 128:] = 0.0
    zero[2, :128] = -0.0
    tiny = _x(3, 256, 92)
    tiny[0, :128] = torch.linspace(-9e-5, 7e-5, 128)
    pow2 = _x(3, 384, 93).float()
    for r, k in ((0, -6), (1, 0), (2, 9)):
        pow2[r, 128:256] = torch.linspace(-1, 1, 128) * 400 * 2.0**k
        pow2[r, 130] = 448 * 2.0**k
    bad = _x(3, 256, 94)
    bad[0, 3], bad[1, 200], bad[1, 201] = float("nan"), float("inf"), -float("inf")
    return [
        ("all_zero_block", zero, True, "an all-zero (and a −0) 128-block: scale 2^-22 from the 1e-4 floor, codes 0x00 / 0x80"),
        ("amax_below_floor", tiny, True, "0 < amax < 1e-4: the floor sets the scale (2^-22); values become e4m3 subnormals"),
        ("amax_448_pow2", pow2.to(torch.bfloat16), True, "amax exactly 448·2^k: scale 2^k (a float-log2 rule gives 2^(k+1))"),
        ("k_not_multiple_of_128", _x(5, 300, 95), True, "K = 300: the last 44 columns are a block of their own"),
        ("decode_rows", _x(8, 512, 96), True, "8 decode rows over 24 octaves of block scales"),
        (
            "nonfinite_checks_off",
            bad,
            False,
            "value checks off: a block holding NaN / ±inf is NaN (scale NaN, codes 0x7F / 0xFF), its row's outputs NaN",
        ),
        ("m_zero", _x(0, 256, 97), True, "no rows: empty outputs, nothing launched"),
    ]


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return randn((n, k), seed=seed, dtype=torch.float32, block=32, octaves=12, device="cpu") * 0.02


def _weight_cases() -> list[Case]:
    out = []

    def w8(name, w, why, check_values=True):
        out.append(
            Case(
                "linear.quantize_fp8_weight",
                name,
                dict(w=w),
                ("w",),
                tol={"w": "exact", "scale": "exact"},
                why=why,
                check_values=check_values,
            )
        )

    def w4(name, w, why, check_values=True):
        tol = {"w_packed": "exact", "scale": "exact"}
        out.append(Case("linear.quantize_fp4_weight", name, dict(w=w), ("w",), tol=tol, why=why, check_values=check_values))

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.5, -5.0, -6.0, 0.1, -0.1, 0.0, -0.0] * 2)
    e2m1 = torch.stack([ties * 2.0**k for k in (-9, 0, 4)] + [torch.zeros(32)])
    w4(
        "e2m1_ties",
        e2m1,
        "amax 6·2^k: the scale is 2^k and 0.25, 0.75, 2.5, 5 land on ties (to the even code: 0, 1, 2, 4); −0.1 keeps its sign (0x8)",
    )
    w4("partial_block_k_72", _weight(5, 72, 101), "K = 72: the third 32-block holds 8 values")
    w4("bf16_many_octaves", _weight(64, 256, 102).to(torch.bfloat16), "bf16 weights over 12 octaves of 32-block scales")
    w4("all_zero_rows", torch.zeros(2, 64), "all-zero blocks: byte 1 (the 6·2^-126 floor), codes 0")
    w4("huge_and_tiny", torch.cat([torch.full((1, 32), 3e38), torch.full((1, 32), 1e-38)]), "amax near fp32's ends")
    bad = _weight(2, 64, 103)
    bad[0, 1], bad[1, 40] = float("nan"), -float("inf")
    w4("nonfinite_checks_off", bad, "checks off: a block holding NaN / ±inf is byte 255 with codes 0x7 / 0xF", check_values=False)
    tiles = _weight(256, 256, 104) * torch.tensor([2.0**-10, 1.0, 2.0**6, 0.0]).repeat_interleave(64)[:, None]
    tiles[130, 7] = 448 * 2.0**3
    w8(
        "tiles_over_octaves",
        tiles,
        "four row groups 2^-10..2^6 and an all-zero one: each 128x128 tile its own byte; amax 448·2^3 -> 2^3",
    )
    w8("partial_tiles_130x300", _weight(130, 300, 105), "N = 130, K = 300: partial tiles at both edges are tiles of their own")
    w8("all_zero_tile", torch.zeros(128, 128), "an all-zero tile: byte 1 (the floor 448·2^-126), codes 0")
    w8("bf16_weight", _weight(64, 512, 106).to(torch.bfloat16), "bf16 input: read by value")
    w8("column_major", _weight(160, 128, 107).T.contiguous().T, "a column-major view: read by value")
    bad = _weight(128, 256, 108)
    bad[3, 200] = float("nan")
    w8("nonfinite_checks_off", bad, "checks off: the tile holding NaN is byte 255 with codes 0x7F / 0xFF", check_values=False)
    return out


def _o_proj_cases() -> list[Case]:
    out = []
    g = generator(56)

    def weights(G, o_lora, width, Hd):
        wo_a = (torch.randn(G, o_lora, width, generator=g) / math.sqrt(width)).to(torch.bfloat16)
        wo_b = (torch.randn(Hd, G * o_lora, generator=g) / math.sqrt(G * o_lora)).to(torch.bfloat16)
        return wo_a, wo_b

    def case(name, o, wo_a, wo_b, why):
        out.append(
            Case(
                "linear.grouped_o_proj",
                name,
                dict(o=o, wo_a=wo_a, wo_b=wo_b),
                ("o", "wo_a", "wo_b"),
                tol={"out": "bf16_gemm"},
                why=why,
            )
        )

    gg = generator(21)  # the draws of the first version of this case (its golden file)
    torch.randperm(32, generator=gg)
    G, o_lora, Hd, H = 2, 64, 128, 4
    o = randn((3, H, 512), seed=26, device="cpu", block=None, octaves=2)
    wo_a = (torch.randn(G, o_lora, H // G * 512, generator=gg) / math.sqrt(H // G * 512)).to(torch.bfloat16)
    wo_b = (torch.randn(Hd, G * o_lora, generator=gg) / math.sqrt(G * o_lora)).to(torch.bfloat16)
    case("tiny_G2", o, wo_a, wo_b, "contiguous head groups: group g holds heads g·H/G … (g+1)·H/G − 1")
    case(
        "one_group",
        randn((3, 2, 512), seed=57, device="cpu", block=None, octaves=2),
        *weights(1, 16, 1024, 32),
        "G = 1: one projection over all heads' 1024 dims (#15: the input is 512 dims per head, not 448)",
    )
    case(
        "one_head_per_group",
        randn((2, 4, 512), seed=58, device="cpu", block=None, octaves=2),
        *weights(4, 8, 512, 16),
        "G = H: each head its own projection",
    )
    wo_a, wo_b = weights(3, 6, 1024, 40)
    case(
        "odd_sizes_strided_layouts",
        head_major(randn((7, 6, 512), seed=59, device="cpu", block=None, octaves=2)),
        transposed(wo_a),
        transposed(wo_b),
        "T = 7, H = 6, G = 3, o_lora = 6, Hd = 40; o heads-outermost, both weights stored transposed",
    )
    o = randn((3, 2, 512), seed=60, device="cpu", block=None, octaves=2)
    o[1, 1, 5] = float("nan")
    case(
        "nan_in_one_token",
        o,
        *weights(2, 8, 512, 16),
        "a NaN in token 1's group-1 input makes output row 1 NaN, the other rows finite (GEMM propagation)",
    )
    case("empty_batch", torch.zeros(0, 4, 512, dtype=torch.bfloat16), *weights(2, 8, 1024, 16), "T = 0: an empty [0, Hd] output")
    return out


def cases() -> list[Case]:
    out = []
    for name, x, cv, why in activations():
        out.append(Case("linear.act_quant", name, dict(x=x), ("x",), tol={"q": "exact", "s": "exact"}, why=why, check_values=cv))
    out.append(
        Case(
            "linear.act_quant",
            "block_64",
            dict(x=_x(3, 256, 98), block=64),
            ("x",),
            tol={"q": "exact", "s": "exact"},
            why="another block size: 64",
        )
    )
    out += _weight_cases()
    g = generator(109)
    for name, x, cv, why in activations():
        k = x.shape[1]
        w8, s8 = reference.quantize_fp8_weight(_weight(136, k, 110))
        w4, s4 = reference.quantize_fp4_weight(_weight(72, k, 111))
        y8 = dict(w=_bytes(w8), w_scale=_bytes(s8))
        y4 = dict(w_packed=_bytes(w4), w_scale=_bytes(s4))
        out.append(
            Case(
                "linear.fp8_linear",
                name,
                dict(x=x, **y8),
                ("x", "w", "w_scale"),
                tol={"y": "linear_out"},
                why=why,
                check_values=cv,
            )
        )
        out.append(
            Case(
                "linear.fp4_linear",
                name,
                dict(x=x, **y4),
                ("x", "w_packed", "w_scale"),
                tol={"y": "linear_out"},
                why=why,
                check_values=cv,
            )
        )
        if cv:  # the GEMMs on act_quant's outputs (a non-finite block's NaN codes are refused while checks are on)
            q, s = reference.act_quant(x)
            qs = dict(q=_bytes(q), s=s)
            out.append(
                Case("linear.fp8_gemm", name, dict(**qs, **y8), ("q", "s", "w", "w_scale"), tol={"y": "linear_out"}, why=why)
            )
            out.append(
                Case(
                    "linear.fp4_gemm", name, dict(**qs, **y4), ("q", "s", "w_packed", "w_scale"), tol={"y": "linear_out"}, why=why
                )
            )
    q, s = reference.act_quant(_x(4, 256, 112))
    codes = torch.randint(0, 256, (40, 128), generator=g, dtype=torch.int64).to(torch.uint8)
    sb = torch.randint(118, 136, (40, 8), generator=g, dtype=torch.int64).to(torch.uint8)
    out.append(
        Case(
            "linear.fp4_gemm",
            "every_nibble_ue8m0_bytes",
            dict(q=_bytes(q), s=s, w_packed=codes, w_scale=sb),
            ("q", "s", "w_packed", "w_scale"),
            tol={"y": "linear_out"},
            why="random bytes: all 16 codes in both nibbles, a scale byte per 32 values (E2M1 -> e4m3 exact)",
        )
    )
    return out + _o_proj_cases()


def mass(case: Case) -> dict:
    """Σ_i |q_i·w_i|·scales in float64 for the GEMM outputs (tolerance "linear_out")."""
    a = case.inputs
    if case.op in ("linear.fp8_linear", "linear.fp4_linear"):
        q, s = reference.act_quant(a["x"])
    elif case.op in ("linear.fp8_gemm", "linear.fp4_gemm"):
        q, s = a["q"], a["s"]
    else:
        return {}
    fp4 = "w_packed" in a
    return {"y": reference.gemm_mass(q, s, a["w_packed"] if fp4 else a["w"], a["w_scale"], fp4=fp4)}
