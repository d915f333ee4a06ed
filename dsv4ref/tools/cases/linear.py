"""``python -m dsv4ref check linear`` rows and ``bench linear`` cases.

Checks (any device, small shapes): act_quant's bytes against the reference; ``fp8_linear`` / ``fp4_linear``
against the float64 oracle of the same quantised operands under ``linear_out``. Benchmarks (a GPU): decode
batches M = 1, 8, 64, 256 times V4-Flash's FP8 projections (and its FP4 expert shapes), beside bf16
``F.linear`` on the same shape and ``torch._scaled_mm`` with the same blockwise scales where this torch and
device support it. Decode GEMMs are bound by the weight bytes; the roofline fraction says how close.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ... import linear
from ...config import FLASH
from ...device import DEVICE, sm_count
from ...linear import reference
from ...testing import compare, randn
from ...validate import checking_values
from ..harness import BenchCase, CheckRow, bench, check

_DECODE_M = (1, 8, 64, 256)


def flash_shapes() -> dict[str, tuple[int, int]]:
    """{projection: (N, K)} of V4-Flash's FP8 weights (the attention's, the shared expert's)."""
    c = FLASH
    return {
        "wq_a": (c.q_lora_rank, c.hidden_size),
        "wq_b": (c.num_heads * c.head_dim, c.q_lora_rank),
        "wkv": (c.head_dim, c.hidden_size),
        "wo_b": (c.hidden_size, c.o_groups * c.o_lora_rank),
        "shared_w1": (c.moe_intermediate_size, c.hidden_size),
        "shared_w2": (c.hidden_size, c.moe_intermediate_size),
    }


def flash_expert_shapes() -> dict[str, tuple[int, int]]:
    """{projection: (N, K)} of one routed expert (FP4)."""
    c = FLASH
    return {"expert_w1": (c.moe_intermediate_size, c.hidden_size), "expert_w2": (c.hidden_size, c.moe_intermediate_size)}


def _weights(n: int, k: int, seed: int, fp4: bool):
    w = randn((n, k), seed=seed, dtype=torch.float32, block=32, octaves=8) * k**-0.5
    return (linear.quantize_fp4_weight if fp4 else linear.quantize_fp8_weight)(w)


@check("linear")
def _check() -> list[CheckRow]:
    rows = []
    for m, n, k in ((1, 192, 512), (24, 136, 300), (64, 64, 1024)):
        x = randn((m, k), seed=m + k, block=128, octaves=20)
        q_r, s_r = linear.act_quant(x, backend="reference")
        q_t, s_t = linear.act_quant(x, backend="triton")
        rows.append(CheckRow("linear.act_quant", f"[{m}, {k}] (e4m3)", compare(q_t, q_r, "exact", "e4m3 bytes")))
        rows.append(CheckRow("linear.act_quant", f"[{m}, {k}] (scales)", compare(s_t, s_r, "exact", "scales")))
        for fp4 in (False, True):
            w, ws = _weights(n, k, seed=n, fp4=fp4)
            y = (linear.fp4_linear if fp4 else linear.fp8_linear)(x, w, ws, backend="triton")
            gemm = reference.fp4_gemm if fp4 else reference.fp8_gemm
            want = gemm(q_r, s_r, w, ws, dtype=torch.float64)
            mass = reference.gemm_mass(q_r, s_r, w, ws, fp4=fp4)
            name = "linear.fp4_linear" if fp4 else "linear.fp8_linear"
            rows.append(CheckRow(name, f"M={m} N={n} K={k}", compare(y, want, "linear_out", "y", mass=mass)))
    return rows


def _scaled_mm(x, w, ws):
    """``torch._scaled_mm`` with 1x128 activation and 128x128 weight scales (fp32), or None with the reason it
    cannot run here (the blockwise recipe needs a recent torch, cuBLAS and an SM90 GPU)."""
    q, s = linear.act_quant(x)
    sw = reference.scale_values(ws)
    try:
        y = torch._scaled_mm(q, w.t(), s.t().contiguous().t(), sw.t().contiguous().t(), out_dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - the peer is optional: say why it is skipped
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    r = compare(y, reference.fp8_gemm(q, s, w, ws, dtype=torch.float64), "linear_out", mass=reference.gemm_mass(q, s, w, ws))
    if not r.passed:
        return None, f"its answer fails linear_out ({r})"
    return (lambda i: torch._scaled_mm(q, w.t(), s.t().contiguous().t(), sw.t().contiguous().t(), out_dtype=torch.bfloat16)), ""


def _split_for(m: int, n: int, k: int, fp4: bool) -> int:
    """K splits giving the default launch's tiles about two programs per SM (at most one split per K block)."""
    lw = linear.default_launch(m)
    tiles = -(-m // lw.block_m) * -(-n // lw.block_n)
    blocks = -(-k // (32 if fp4 else 128))
    return max(1, min(blocks, 2 * sm_count(DEVICE) // tiles))


@bench("linear")
def _bench() -> list[BenchCase]:
    """Compulsory bytes: the weight (N·K bytes FP8, N·K/2 FP4), its scales, x (bf16) and y (bf16); bf16
    ``F.linear`` moves 2·N·K weight bytes. FLOPs 2·M·N·K."""
    cases = []
    shapes = [(name, nk, False) for name, nk in flash_shapes().items()] + [
        (n, nk, True) for n, nk in flash_expert_shapes().items()
    ]
    skipped = set()
    for name, (n, k), fp4 in shapes:
        w, ws = _weights(n, k, seed=n + k, fp4=fp4)
        wb = linear.dequantize_fp4_weight(w, ws) if fp4 else linear.dequantize_fp8_weight(w, ws)
        wb = wb.to(torch.bfloat16)
        for m in _DECODE_M:
            x = randn((m, k), seed=m, block=128, octaves=8)
            io = m * k * 2 + m * n * 2
            wbytes = (n * k // 2 + n * -(-k // 32)) if fp4 else (n * k + -(-n // 128) * -(-k // 128))
            fn = linear.fp4_linear if fp4 else linear.fp8_linear

            def run(i, x=x, w=w, ws=ws, fn=fn):
                with checking_values(False):
                    fn(x, w, ws)

            fmt = "fp4" if fp4 else "fp8"
            shape = f"{name} M={m} N={n} K={k}"
            cases.append(BenchCase(f"linear.{fmt}_linear", shape, run, 1, wbytes + io, 2 * m * n * k, "weight + scales + x + y"))
            split = _split_for(m, n, k, fp4)
            if split > 1:
                lw = replace(linear.default_launch(m), split_k=split)

                def run_split(i, x=x, w=w, ws=ws, fn=fn, lw=lw):
                    with checking_values(False):
                        fn(x, w, ws, launch=lw)

                note = f"as above, K in {split} splits (fp32 partials: 4·M·N·{split} bytes more, not counted)"
                cases.append(
                    BenchCase(f"linear.{fmt}_linear (split_k={split})", shape, run_split, 1, wbytes + io, 2 * m * n * k, note)
                )
            cases.append(
                BenchCase(
                    "linear (bf16 F.linear)",
                    shape,
                    lambda i, x=x, wb=wb: F.linear(x, wb),
                    1,
                    2 * n * k + io,
                    2 * m * n * k,
                    "bf16 weight + x + y",
                )
            )
            if not fp4 and "scaled_mm" not in skipped:
                peer, why = _scaled_mm(x, w, ws)
                if peer is None:
                    print(f"linear: torch._scaled_mm (blockwise) skipped: {why}")
                    skipped.add("scaled_mm")
                    continue
                cases.append(
                    BenchCase(
                        "linear (torch._scaled_mm)",
                        shape,
                        peer,
                        1,
                        wbytes + io,
                        2 * m * n * k,
                        "as fp8_linear, act_quant outside",
                    )
                )
    return cases
