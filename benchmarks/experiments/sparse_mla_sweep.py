"""GPU-only launch-configuration sweep for dsv4ref.sparse_mla (not a test; prints a table).

    PYTHONPATH=. python3 benchmarks/experiments/sparse_mla_sweep.py

Times each configuration two ways: eager (one Python call per launch, as `python -m dsv4ref bench` does)
and as a device-graph replay (kernel time without the Python/launch overhead; the harness's timing).
Inputs, byte and FLOP counts are the registered bench's (dsv4ref/tools/cases/sparse_mla.py).
"""

import sys

import dsv4ref  # noqa: F401
from dsv4ref.device import DEVICE
from dsv4ref.sparse_mla import DEFAULT_SCALE, SparseMlaLaunch, default_launch
from dsv4ref.sparse_mla.launch import fused_decode
from dsv4ref.sparse_mla.two_pass import two_pass_decode
from dsv4ref.tools.cases.sparse_mla import BENCH_SHAPES, bench_counts, bench_inputs, n_sets_for
from dsv4ref.tools.harness import measure_ceilings, time_ms


def graph_us(fn, n_sets):
    """Kernel time in µs: a device graph of one call per input set, replayed (dsv4ref.tools.harness.time_ms)."""
    return time_ms(fn, n_sets) * 1e3


def main():
    ceil = measure_ceilings()
    print(f"ceilings: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 {ceil.bf16_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)
    sweeps = {  # H -> (block_h, block_n, num_warps, num_stages, num_splits): the first rounds' best layouts
        64: [(64, 64, 8, 2, 2), (64, 64, 8, 2, 1), (64, 32, 8, 2, 2), (64, 64, 4, 2, 2)],
        128: [(64, 64, 8, 2, 1), (64, 64, 8, 2, 2), (64, 32, 8, 2, 1)],
        16: [(16, 32, 4, 2, 4), (16, 32, 4, 3, 4), (16, 16, 4, 2, 4), (16, 32, 4, 2, 8)],
    }
    for T, H, K in BENCH_SHAPES:
        byts, flops = bench_counts(T, H, K)
        n_sets = n_sets_for(T, K)
        sets = bench_inputs(T, H, K, n_sets, DEVICE)
        bound_us = max(byts / ceil.copy_bytes_per_s, flops / ceil.bf16_flops_per_s) * 1e6
        print(f"\n== T={T} H={H} K={K}: bound {bound_us:.2f} us ({byts / 1e6:.1f} MB, {flops / 1e9:.1f} GFLOP)", flush=True)
        default = default_launch(T, H, K, DEVICE)
        print("default launch:", default, flush=True)
        runs = [("two_pass(default)", two_pass_decode, default), ("fused(default)", fused_decode, default)]
        for bh, bn, w, st, sp in sweeps[H]:
            runs.append(
                (
                    f"fused bh{bh} bn{bn} w{w} st{st} sp{sp}",
                    fused_decode,
                    SparseMlaLaunch(block_h=bh, block_n=bn, num_splits=sp, num_warps=w, num_stages=st),
                )
            )
        for name, f, launch in runs:
            try:
                fn = lambda i, f=f, launch=launch: f(**sets[i], scale=DEFAULT_SCALE, launch=launch)
                eager = time_ms(fn, n_sets, graph=False) * 1e3
                g = graph_us(fn, n_sets)
                print(
                    f"{name:<36} eager {eager:8.1f} us  graph {g:8.1f} us  {byts / g / 1e3:7.0f} GB/s "
                    f"{flops / g / 1e6:6.1f} TFLOP/s  {bound_us / g:6.1%} of bound",
                    flush=True,
                )
            except Exception as e:  # a config that does not compile (registers, shared memory)
                print(f"{name:<36} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
