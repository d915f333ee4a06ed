"""What V4's number formats change, measured on the teaching config: the data of docs/decode.md#v4s-number-formats
and docs/moe.md#v4s-formats-in-the-experts.

    PYTHONPATH=$PWD python benchmarks/format_error.py [--steps 8] [--out benchmarks/runs/format_error.md]

1. The MoE layer alone (TINY_MOE: Hd 256, E 8, K 2, I 128; T tokens routed by the gate), its weights quantised
   to V4's formats: each path (deepseek, megamoe) against the float64 oracle (dequantised weights, x itself, no
   rounding) and against each other; the bf16-weight experts (moe.experts, on the dequantised weights) for scale.
2. A whole decode step (dsv4ref.decode.format_error): the same model in bf16 and in V4's formats, per step,
   for each MoE path: the relative L2 of the logits between the two runs and against each run's float64
   reference, top-1 agreement, and where the greedy tokens part.

Runs on whatever device dsv4ref picks (the reference backend, so a CPU takes minutes, not hours).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import dsv4ref  # noqa: E402,F401
from dsv4ref import decode, moe  # noqa: E402
from dsv4ref import linear as lin  # noqa: E402
from dsv4ref.config import TINY  # noqa: E402
from dsv4ref.device import describe  # noqa: E402
from dsv4ref.moe import experts_v4  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def moe_layer(T: int = 64, seed: int = 0) -> str:
    """The table of part 1."""
    d = moe.example_inputs(T, moe.TINY_MOE, seed=seed, octaves=4)

    def fp4(w):
        q, s = lin.quantize_fp4_weight(w.reshape(-1, w.shape[-1]))
        return q.view(*w.shape[:-1], -1), s.view(*w.shape[:-1], -1)

    ids, w = moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=1.5)
    args = (d["x"], ids, w, *fp4(d["w13"]), *fp4(d["w2"]))
    args += lin.quantize_fp8_weight(d["shared_w13"]) + lin.quantize_fp8_weight(d["shared_w2"])
    x_fp8, x_sf, ids64, w32 = moe.stage(d["x"], ids, w, backend="reference")
    oracle = experts_v4.reference(*args, swiglu_limit=10.0, dtype=torch.float64)
    out = {p: moe.experts_fp4(*args, swiglu_limit=10.0, path=p, x_fp8=x_fp8, x_sf=x_sf, backend="reference") for p in moe.PATHS}
    deq = [
        experts_v4.dequantize_experts(args[3], args[4], torch.bfloat16),
        experts_v4.dequantize_experts(args[5], args[6], torch.bfloat16),
    ]
    deq += [lin.dequantize_fp8_weight(args[7], args[8]).bfloat16(), lin.dequantize_fp8_weight(args[9], args[10]).bfloat16()]
    bf16 = moe.experts(d["x"], x_fp8, x_sf, ids64, w32, *deq, swiglu_limit=10.0, backend="reference")
    rows = [
        f"MoE layer, TINY_MOE (Hd 256, E 8, K 2, I 128), T = {T} tokens, seed {seed}; relative L2 of the [T, Hd] output:",
        "",
        "| | vs float64 oracle | vs the other path |",
        "|---|---|---|",
        f"| deepseek (1x128 act_quant, gate/up rounded to bf16) | {_rel(out['deepseek'], oracle):.4f} | "
        f"{_rel(out['deepseek'], out['megamoe']):.4f} |",
        f"| megamoe (moe.stage's 1x32 input, gate/up fp32, h 1x32 e4m3) | {_rel(out['megamoe'], oracle):.4f} | "
        f"{_rel(out['megamoe'], out['deepseek']):.4f} |",
        f"| bf16 GEMMs on the same (dequantised) weights, staged x (moe.experts) | {_rel(bf16, oracle):.4f} | |",
    ]
    return "\n".join(rows)


def decode_step(steps: int, prompt_lens) -> str:
    """The tables of part 2, one per MoE path."""
    parts = []
    for path in ("deepseek", "megamoe"):
        t0 = time.perf_counter()
        r = decode.format_error(TINY.replace(moe_path=path), steps=steps, prompt_lens=prompt_lens)
        parts += [
            f"Decode step, TINY, moe_path {path!r}, prompts {tuple(prompt_lens)}, {steps} greedy steps "
            f"({time.perf_counter() - t0:.0f} s); logits relative L2, max over requests:",
            "",
            r.table(),
            "",
            f"greedy tokens part at generated token (per request; None = never within {steps + 1}): {r.parted}",
            "",
        ]
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, nargs="+", default=[133, 37, 5, 70])
    ap.add_argument("--out", help="also write the report to this file")
    a = ap.parse_args(argv)
    head = f"benchmarks/format_error.py, {datetime.date.today()}, {describe()}"
    text = "\n\n".join([head, moe_layer(), decode_step(a.steps, a.prompts)])
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
