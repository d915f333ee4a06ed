"""Conformance cases of the FP8 building block: ``fp8.quantize_ue8m0`` and ``fp8.dequantize_ue8m0``.

Every output is compared bit for bit ("exact"): the e4m3 and scale bytes, and the dequantised values (a NaN
is the quiet NaN 0x7FC0 / 0x7FC00000 on every backend; docs/formats.md#non-finite-values). Non-finite
input reaches the quantiser only in a case run with value checks off, where the policy writes scale byte
255 and e4m3 NaN codes. Layouts: the suite hands each case a clone, which keeps a dense non-contiguous
layout (column-major) but not a slice's gaps (those are in ``tests/test_contract_fp8.py``).
"""

from __future__ import annotations

import torch

from .. import fp8
from ..testing import generator, randn
from .suite import Case

OUTPUTS = {
    "fp8.quantize_ue8m0": lambda res, a: {"q": res[0], "scale": res[1]},
    "fp8.dequantize_ue8m0": lambda res, a: {"out": res},
}

_Q = {"q": "exact", "scale": "exact"}


def hard_blocks() -> torch.Tensor:
    """bf16 [9, 512]: 64-blocks whose amax is exactly 448·2^k for k = −30..30 (where a float-log2 scale rule
    is one byte high), all-zero, −0.0, all-equal, tiny (below the 1e-4 floor: e4m3 subnormals) and 28-octave
    blocks."""
    g = generator(81)
    blocks = []
    for k in range(-30, 31, 2):
        b = torch.randn(64, generator=g).clamp(-1, 1) * 300 * 2.0**k
        b[int(torch.randint(64, (1,), generator=g))] = (-1) ** k * 448 * 2.0**k
        blocks.append(b)
    blocks += [
        torch.zeros(64),
        torch.full((64,), -0.0),
        torch.full((64,), 1.75),
        torch.full((64,), -449.0),
        torch.randn(64, generator=g) * 1e-6,
        torch.randn(64, generator=g) * 1e-4,
        torch.randn(64, generator=g) * torch.exp2(torch.randint(-20, 8, (64,), generator=g).float()),
    ]
    x = torch.stack(blocks)
    x = torch.cat([x, torch.zeros(-x.shape[0] % 8, 64)])
    return x.reshape(-1, 512).to(torch.bfloat16)


def subnormal_grid() -> torch.Tensor:
    """fp32 [4, 256]: 64-blocks whose amax is 448·2^e (so the scale is exactly 2^e), holding, after the
    division by 2^e, every e4m3 subnormal code m·2^-9 (m = 1..7), the midpoints (m + ½)·2^-9 (ties to even),
    their ±1-ulp fp32 neighbours, and values that are no power-of-two multiple of anything (k/7, k/3): the
    quotients an arbitrary (non-power-of-two) scale would give. A device whose e4m3 cast mishandled
    subnormals, ties or carries would differ here in the q bytes."""
    sub = torch.arange(1, 8, dtype=torch.float32) * 2.0**-9
    mid = (torch.arange(0, 8, dtype=torch.float32) + 0.5) * 2.0**-9
    up, down = torch.nextafter(mid, torch.tensor(1.0)), torch.nextafter(mid, torch.tensor(-1.0))
    odd = torch.cat([torch.arange(1, 12, dtype=torch.float32) / 7, torch.arange(1, 12, dtype=torch.float32) / 3]) * 2.0**-7
    vals = torch.cat([sub, mid, up, down, odd, -sub, -mid])  # 7 + 8·3 + 22 + 15 = 68 values
    rows = []
    for e in (-20, -3, 0, 9):
        v = torch.cat([vals, vals.flip(0) * 3, vals * 5, vals * 7])[: 4 * 63].reshape(4, 63)
        v = torch.cat([v, torch.full((4, 1), 448.0)], 1)  # one 448 per block pins the scale at 2^e
        rows.append((v * 2.0**e).reshape(-1))
    return torch.stack(rows)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values stored column-major (dense, not contiguous; survives the suite's clone)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def cases() -> list[Case]:
    out = []

    def quant(name, x, block, why, floor=None, check_values=True):
        inputs = dict(x=x, block=block) | ({} if floor is None else dict(amax_floor=floor))
        out.append(Case("fp8.quantize_ue8m0", name, inputs, ("x", "block"), tol=dict(_Q), why=why, check_values=check_values))

    def dequant(name, q, scale, block, out_dtype, why):
        out.append(
            Case(
                "fp8.dequantize_ue8m0",
                name,
                dict(q=q, scale=scale, block=block, out_dtype=out_dtype),
                ("q", "scale", "block", "out_dtype"),
                tol={"out": "exact"},
                why=why,
            )
        )

    # ---- quantize_ue8m0 ---------------------------------------------------------------------------------
    hard = hard_blocks()
    quant(
        "block64_hard_blocks",
        hard,
        64,
        "amax = 448·2^k gets byte 127 + k, not 128 + k (#3); all-zero / −0 blocks byte 105 (−0 codes 0x80); "
        "tiny blocks become e4m3 subnormals; ±449 saturates to ±448",
    )
    quant(
        "block128_fp32_3d",
        randn((2, 3, 256), seed=82, dtype=torch.float32, block=128, octaves=60, device="cpu"),
        128,
        "fp32 input over 60 octaves, a 3-d shape, the indexer's block of 128",
    )
    quant(
        "block32_fp16_floor0",
        randn((5, 96), seed=83, dtype=torch.float16, block=32, octaves=20, device="cpu").index_fill(0, torch.tensor([1]), 0.0),
        32,
        "fp16 input, block 32, amax_floor = 0: an all-zero block gets byte 1 (the clamp), not byte 0",
        floor=0.0,
    )
    quant(
        "column_major_x",
        _column_major(randn((6, 128), seed=84, octaves=24, device="cpu")),
        64,
        "x stored column-major: read by value, not as if contiguous",
    )
    quant("empty_rows", torch.zeros(0, 3, 128, dtype=torch.bfloat16), 64, "no rows: empty q and scale, nothing launched")
    x = randn((3, 256), seed=85, dtype=torch.float32, octaves=24, device="cpu")
    x[0, 5], x[0, 64 + 9], x[0, 192 + 1], x[1, 2], x[2, 255] = float("nan"), float("inf"), -float("inf"), -float("nan"), 448.0
    quant(
        "nonfinite_checks_off",
        x,
        64,
        "value checks off: a block holding NaN / ±inf is scale byte 255 and e4m3 NaN codes 0x7F (0xFF for a set sign "
        "bit); the other blocks of the row are unaffected",
        check_values=False,
    )
    quant(
        "fp32_subnormal_codes_and_ties",
        subnormal_grid(),
        64,
        "fp32 values on, halfway between and one ulp beside every e4m3 subnormal code, and quotients with long "
        "mantissas (k/7, k/3): the e4m3 cast must round to nearest even the same on every device",
    )
    quant(
        "block1",
        randn((2, 16), seed=86, dtype=torch.float32, octaves=30, device="cpu"),
        1,
        "one value per scale: every value lands in (224, 448] after scaling",
    )

    # ---- dequantize_ue8m0 -------------------------------------------------------------------------------
    q, s = fp8.quantize_ue8m0(hard, 64, backend="reference")
    dequant("block64_bf16_of_quantised", q, s, 64, torch.bfloat16, "the round trip: exact in bf16")
    q, s = fp8.quantize_ue8m0(
        randn((2, 3, 256), seed=87, dtype=torch.float32, block=128, octaves=60, device="cpu"), 128, backend="reference"
    )
    dequant("block128_fp32_3d", q, s, 128, torch.float32, "exact in fp32 over 60 octaves")
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8).reshape(4, 64).repeat(4, 1)  # every code, 4 times
    every = torch.tensor([0, 1, 2, 126, 127, 128, 200, 253, 254, 255, 255, 0, 114, 105, 130, 140], dtype=torch.uint8)
    dequant(
        "every_code_every_scale_byte_fp32",
        codes.view(torch.float8_e4m3fn),
        every[:, None],
        64,
        torch.float32,
        "all 256 e4m3 codes (0x7F / 0xFF NaN) under scale bytes 0 (2^-127, subnormal results kept), 255 (NaN, "
        "canonical 0x7FC00000), 1, and 253 / 254 (where large codes overflow fp32 to ±inf)",
    )
    dequant(
        "every_code_every_scale_byte_bf16_uint8",
        codes,
        every[:, None],
        64,
        torch.bfloat16,
        "the same as raw uint8 bytes into bf16: NaN is 0x7FC0 on every device, overflow inf, subnormals kept",
    )
    g = generator(88)
    qr = torch.randint(0, 256, (64, 8), generator=g, dtype=torch.int64).to(torch.uint8)
    sr = torch.randint(100, 140, (2, 8), generator=g, dtype=torch.int64).to(torch.uint8)
    dequant(
        "column_major_q_and_scale",
        qr.t(),
        sr.t(),
        32,
        torch.bfloat16,
        "q [8, 64] and scale [8, 2] stored column-major: read by value",
    )
    dequant(
        "empty_rows",
        torch.zeros(0, 128, dtype=torch.uint8),
        torch.zeros(0, 2, dtype=torch.uint8),
        64,
        torch.float32,
        "no rows: an empty output",
    )
    return out
