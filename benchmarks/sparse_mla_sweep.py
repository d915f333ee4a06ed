"""GPU-only launch-configuration sweep for dsv4ref.sparse_mla (not a test; prints a table).

    PYTHONPATH=. python3 benchmarks/sparse_mla_sweep.py

Times each configuration two ways: eager (one Python call per launch, as `python -m dsv4ref bench` does)
and as a device-graph replay (kernel time without the Python/launch overhead; the harness's timing).
"""

import math
import sys

import torch

import dsv4ref  # noqa: F401
from dsv4ref import sparse_mla as sm
from dsv4ref.device import DEVICE
from dsv4ref.harness import measure_ceilings, time_ms


def graph_us(fn, n_sets):
    """Kernel time in µs: a device graph of one call per input set, replayed (dsv4ref.harness.time_ms)."""
    return time_ms(fn, n_sets) * 1e3


def main():
    ceil = measure_ceilings()
    print(f"ceilings: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 {ceil.bf16_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)
    sweeps = {  # second round: the first round's best layouts, with and without the exact P·V split
        64: [(64, 64, 8, 2, 2, False), (64, 64, 8, 1, 2, True), (64, 64, 4, 2, 2, True)],
        128: [(64, 64, 8, 2, 1, False), (64, 64, 8, 1, 1, True), (64, 128, 8, 1, 1, True)],
        16: [(16, 32, 4, 2, 4, False), (16, 32, 4, 3, 4, True), (16, 16, 4, 2, 4, True), (16, 32, 4, 2, 8, True)],
    }
    for T, H, K in sm.BENCH_SHAPES:
        byts, flops = sm._bench_counts(T, H, K)
        per_set = T * K * 585
        n_sets = max(2, math.ceil(2.5 * 60e6 / per_set))
        sets = sm._bench_inputs(T, H, K, n_sets, DEVICE)
        bound_us = max(byts / ceil.copy_bytes_per_s, flops / ceil.bf16_flops_per_s) * 1e6
        print(f"\n== T={T} H={H} K={K}: bound {bound_us:.2f} us ({byts / 1e6:.1f} MB, {flops / 1e9:.1f} GFLOP)", flush=True)
        default = sm._config(T, H, K, DEVICE)
        print("default config:", default, flush=True)
        runs = [("two_pass(default)", sm._two_pass, default)]
        runs.append(("fused(default)", sm._fused, default))
        for bh, bn, w, st, sp, pv in sweeps[H]:
            runs.append((f"fused bh{bh} bn{bn} w{w} st{st} sp{sp} pv{int(pv)}", sm._fused,
                         dict(block_h=bh, block_n=bn, num_warps=w, num_stages=st, num_splits=sp, pv_split=pv)))
        for name, f, cfg in runs:
            try:
                fn = lambda i, f=f, cfg=cfg: f(*sets[i][0:2], sets[i][2], sm.DEFAULT_SCALE, cfg)
                eager = time_ms(fn, n_sets) * 1e3
                g = graph_us(fn, n_sets)
                print(f"{name:<36} eager {eager:8.1f} us  graph {g:8.1f} us  {byts / g / 1e3:7.0f} GB/s "
                      f"{flops / g / 1e6:6.1f} TFLOP/s  {bound_us / g:6.1%} of bound", flush=True)
            except Exception as e:  # a config that does not compile (registers, shared memory)
                print(f"{name:<36} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
