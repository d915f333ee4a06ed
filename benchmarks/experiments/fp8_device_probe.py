"""Which step of notebook 01's "arbitrary fp32 scales" cell differs between the CPU and this device?

Draws the cell's inputs on the host, runs every step (divide, clamp + e4m3 cast, product, bf16 cast) on the
CPU and on the picked device from the *same* host inputs, and counts bit differences per step. Run on a GPU:
``python benchmarks/experiments/fp8_device_probe.py``.
"""

import dsv4ref  # noqa: F401  (picks the device first)
import torch

from dsv4ref import DEVICE
from dsv4ref.fp8 import reference as ref
from dsv4ref.testing import randn


def steps(xs: torch.Tensor, dev) -> dict[str, torch.Tensor]:
    x = xs.to(dev).float().reshape(64, 7, 64)
    s = x.abs().amax(-1) / 448
    d = x / s[..., None]
    c = d.clamp(-448, 448)
    q = c.to(torch.float8_e4m3fn)
    p = q.float() * s[..., None]
    b = p.to(torch.bfloat16)
    return {"scale": s, "x/s": d, "clamp": c, "e4m3": q.view(torch.uint8), "q*s": p, "bf16": b.view(torch.int16)}


xs = randn((64, 448), seed=1, octaves=16, device="cpu")
cpu = steps(xs, "cpu")
dev = steps(xs, DEVICE)
print("device:", DEVICE, torch.__version__)
for k in cpu:
    a, b = cpu[k], dev[k].cpu()
    same = (a.view(torch.uint8) == b.view(torch.uint8)).all().item() if a.dtype != torch.uint8 else (a == b).all().item()
    n = int((a != b).sum()) if a.dtype in (torch.uint8, torch.int16) else int((a.view(torch.int32) != b.view(torch.int32)).sum())
    print(f"{k:>6}: {'identical' if same else 'DIFFER'} ({n} of {a.numel()})")
# the e4m3 cast alone, from identical fp32 inputs (the CPU's clamped quotient, sent to the device)
c = cpu["clamp"]
qc = c.to(torch.float8_e4m3fn).view(torch.uint8)
qd = c.to(DEVICE).to(torch.float8_e4m3fn).view(torch.uint8).cpu()
bad = (qc != qd).nonzero()
print("e4m3 cast of identical fp32 inputs: differ in", bad.shape[0], "of", qc.numel())
for i in bad[:12].tolist():
    v = c[tuple(i)].item()
    print(
        f"  x={v!r:>24} bits=0x{c[tuple(i)].view(torch.int32).item() & 0xFFFFFFFF:08X} cpu=0x{qc[tuple(i)].item():02X}"
        f" dev=0x{qd[tuple(i)].item():02X} ref_ok={ref.e4m3_encode(c[tuple(i)].reshape(1)).view(torch.uint8).item():02X}"
    )
# an exhaustive probe: every fp32 in e4m3's range whose low 16 mantissa bits are zero, plus halfway points
g = torch.arange(0, 1 << 16, dtype=torch.int32) << 16
v = g.view(torch.float32)
v = v[v.isfinite() & (v.abs() <= 448)]
qc = v.to(torch.float8_e4m3fn).view(torch.uint8)
qd = v.to(DEVICE).to(torch.float8_e4m3fn).view(torch.uint8).cpu()
bad = (qc != qd).nonzero().flatten()
print("grid probe (fp32 with 16 zero low bits):", bad.numel(), "of", v.numel(), "differ")
for i in bad[:12].tolist():
    print(f"  x={v[i].item()!r:>24} cpu=0x{qc[i].item():02X} dev=0x{qd[i].item():02X}")
