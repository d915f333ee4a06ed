"""``python -m dsv4ref check fp8``: the fp8 op's check rows (Triton kernel vs torch reference)."""

from __future__ import annotations

import torch

from ... import fp8
from ...device import DEVICE
from ...testing import compare, randn
from ..harness import CheckRow, check

_SHAPES = [((33, 448), 64), ((8, 512), 128)]


def _check_input(shape, seed):
    """Per-block scales over 2^-12..2^12, plus blocks with amax = 448·2^k and an all-zero block."""
    x = randn(shape, seed=seed, octaves=24, device="cpu").float()
    x[0, :64] = 0.0
    x[0, 64 + 3] = 448.0 * 2.0**-5
    return x.to(torch.bfloat16)


@check("fp8.quantize")
def _check_quantize() -> list[CheckRow]:
    rows = []
    for shape, block in _SHAPES:
        x = _check_input(shape, seed=shape[0]).to(DEVICE)
        q_r, s_r = fp8.quantize_ue8m0(x, block, backend="reference")
        q_t, s_t = fp8.quantize_ue8m0(x, block, backend="triton")
        rows.append(CheckRow("fp8.quantize", f"{list(shape)} block={block} (scales)", compare(s_t, s_r, "exact", "scale bytes")))
        rows.append(CheckRow("fp8.quantize", f"{list(shape)} block={block} (e4m3)", compare(q_t, q_r, "exact", "e4m3 bytes")))
    return rows


@check("fp8.dequantize")
def _check_dequantize() -> list[CheckRow]:
    rows = []
    for shape, block in _SHAPES:
        q, s = fp8.quantize_ue8m0(_check_input(shape, seed=shape[0] + 1).to(DEVICE), block, backend="reference")
        for dt in (torch.bfloat16, torch.float32):
            got = fp8.dequantize_ue8m0(q, s, block, dt, backend="triton")
            want = fp8.dequantize_ue8m0(q, s, block, dt, backend="reference")
            rows.append(CheckRow("fp8.dequantize", f"{list(shape)} block={block} -> {str(dt)[6:]}", compare(got, want, "exact")))
    return rows
