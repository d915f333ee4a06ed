"""Launch sweep of the MoE kernels on a GPU (the figures in benchmarks/moe.md).

    PYTHONPATH=. python3 benchmarks/moe_sweep.py            # staging only (the 80 %-of-copy question), ~90 s
    PYTHONPATH=. python3 benchmarks/moe_sweep.py experts    # the expert kernels (allocates 13 GB of weights)
    PYTHONPATH=. python3 benchmarks/moe_sweep.py all

Staging at T = 4096, Hd = 4096, K = 6, four input sets rotated past the L2, every call timed through the
custom op (no argument checks) by graph replay (dsv4ref.tools.harness.time_ms). Printed first: the 512 MiB
copy ceiling and two copies moving staging's bytes timed the same way (what a copy of this size loses to
launch and tail alone). Then each variant (MoeLaunch stage_* fields), in three phases:

  A. the default, the best shape of the first sweep, and the tile-load variant over tile shapes and warps;
  B. cache hints (evict_first loads, streaming stores) on the three fastest of A;
  C. the persistent grid (1, 2, 4, 8 programs per SM; 1 or 3 pipeline stages) on the two fastest so far.

Before it is timed, every variant's four outputs are compared byte for byte with the reference on input set
0 (real magnitudes, with NaN / ±inf groups planted: the checks-off encoding is checked too); a variant
that differs, or fails to compile, is reported and skipped. Each line gives µs, % of the copy ceiling
and % of the best same-size copy's bandwidth. New variants stop starting after STAGE_BUDGET_S seconds.
"""

import dataclasses
import sys
import time

import torch

import dsv4ref
from dsv4ref.device import sm_count
from dsv4ref import moe, validate
from dsv4ref.moe import reference
from dsv4ref.moe.launch import experts_op_args, stage_op_args
from dsv4ref.tools.cases.moe import STAGE_BENCH, flash_weights, same_size_copies, stage_bytes, stage_sets
from dsv4ref.tools.harness import measure_ceilings, time_ms

STAGE_BUDGET_S = 75.0
dev = dsv4ref.DEVICE
what = sys.argv[1] if len(sys.argv) > 1 else "stage"
if what not in ("stage", "experts", "all"):
    raise SystemExit(f"usage: {sys.argv[0]} [stage|experts|all], got {what!r}")
ceil = measure_ceilings()
print(f"copy ceiling (512 MiB) {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul {ceil.bf16_flops_per_s / 1e12:.0f} TFLOP/s",
      flush=True)


def sweep_stage():
    t0 = time.perf_counter()
    T, Hd, K, n_sets = STAGE_BENCH
    nbytes = stage_bytes(T, Hd, K)
    sets = stage_sets(T, Hd, K, n_sets)
    x0 = sets[0][0]
    for t, h in ((5, 7), (9, 32 + 3), (2047, 4000), (4095, 130)):  # NaN, +inf, -inf, NaN groups in set 0
        x0[t % T, h % Hd] = (float("nan"), float("inf"), -float("inf"), float("nan"))[t % 4]
    x0[9 % T, 32 + 4] = -1.5  # its code becomes 0xFF
    with validate.checking_values(False):
        want = [t.contiguous() for t in reference.stage(x0, sets[0][1], sets[0][2])]
    want[0] = want[0].view(torch.uint8)

    print(f"\nstaging T={T} Hd={Hd} K={K}: {nbytes / 1e6:.1f} MB per call, {n_sets} sets", flush=True)
    best_copy = 0.0
    for case in same_size_copies(T, Hd, K, n_sets):
        ms = time_ms(case.run, case.n_sets)
        bw = case.bytes / (ms * 1e-3)
        best_copy = max(best_copy, bw)
        print(f"  {case.op:40s} {ms * 1e3:7.1f} us  {bw / 1e12:.2f} TB/s = {bw / ceil.copy_bytes_per_s:6.1%} of the ceiling",
              flush=True)

    results = {}

    def run(label, L):
        if time.perf_counter() - t0 > STAGE_BUDGET_S:
            print(f"  {label:60s} skipped (time budget)", flush=True)
            return
        x, ids, w, q, sf, i64, w32 = sets[0]
        for b in (q, sf, i64, w32):
            b.fill_(-1 if b.dtype != torch.uint8 else 0x7F)  # poison: an unwritten byte shows
        try:
            torch.ops.dsv4ref.moe_stage(*sets[0], *stage_op_args(L))
            bad = [n for n, g, r in zip(("x_fp8", "x_sf", "ids", "weights"), (q, sf, i64, w32), want)
                   if not torch.equal(g.view(torch.uint8), r.view(torch.uint8))]
            if bad:
                print(f"  {label:60s} WRONG BYTES in {', '.join(bad)}: skipped", flush=True)
                return
            ms = time_ms(lambda i: torch.ops.dsv4ref.moe_stage(*sets[i], *stage_op_args(L)), n_sets)
        except Exception as e:  # e.g. out of registers / shared memory
            print(f"  {label:60s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
            return
        bw = nbytes / (ms * 1e-3)
        results[label] = (ms, L)
        print(f"  {label:60s} {ms * 1e3:7.1f} us  {bw / ceil.copy_bytes_per_s:6.1%} of ceiling  "
              f"{bw / best_copy:6.1%} of same-size copy", flush=True)

    def name(L):
        s = f"{L.stage_load:6s} {L.stage_block_t}x{L.stage_block_h} w{L.stage_warps}"
        if L.stage_cache:
            s += f" cache={L.stage_cache}"
        if L.stage_programs:
            s += f" persistent={L.stage_programs} stages={L.stage_stages}"
        return s

    def fastest(n):
        return [L for _, L in sorted(results.values(), key=lambda r: r[0])[:n]]

    print("A. load and tile shape", flush=True)
    default = moe.default_launch(T, K, 256)
    run("default: " + name(default), default)
    run(name(moe.MoeLaunch(stage_block_t=1, stage_block_h=2048, stage_warps=2)),
        moe.MoeLaunch(stage_block_t=1, stage_block_h=2048, stage_warps=2))
    for bt, bh in ((1, 1024), (1, 2048), (1, 4096), (2, 1024), (2, 2048), (4, 512), (4, 1024), (8, 512), (8, 1024)):
        for wp in (2, 4, 8):
            L = moe.MoeLaunch(stage_block_t=bt, stage_block_h=bh, stage_warps=wp, stage_load="tile")
            run(name(L), L)
    print("B. cache hints on the three fastest", flush=True)
    for L in fastest(3):
        for cache in ("evict_first", "stream"):
            L2 = dataclasses.replace(L, stage_cache=cache)
            run(name(L2), L2)
    print("C. persistent grid on the two fastest", flush=True)
    sms = sm_count(dev)
    for L in fastest(2):
        for per_sm in (1, 2, 4, 8):
            for stages in (1, 3):
                L2 = dataclasses.replace(L, stage_programs=per_sm * sms, stage_stages=stages)
                run(name(L2) + f" ({per_sm}/SM)", L2)
    ms, L = sorted(results.values(), key=lambda r: r[0])[0]
    bw = nbytes / (ms * 1e-3)
    print(f"\nfastest: {name(L)}: {ms * 1e3:.1f} us, {bw / ceil.copy_bytes_per_s:.1%} of the copy ceiling, "
          f"{bw / best_copy:.1%} of the same-size copy; default {results.get('default: ' + name(default), (float('nan'),))[0] * 1e3:.1f} us"
          f"\n{L}\nstaging sweep: {time.perf_counter() - t0:.0f} s", flush=True)


def sweep_experts():
    Hd = 4096
    w13, w2, sw13, sw2 = flash_weights()
    GRIDS = {  # block_m, block_n, block_h, block_k, warps, stages
        64: [(16, 64, 128, 64, 4, 3), (16, 128, 128, 64, 4, 3), (16, 64, 256, 128, 4, 3), (16, 64, 128, 64, 4, 4),
             (16, 32, 128, 64, 2, 4)],
        4096: [(64, 64, 128, 64, 4, 3), (64, 128, 128, 64, 8, 3), (64, 128, 128, 128, 8, 3), (128, 64, 128, 64, 4, 3),
               (64, 64, 128, 64, 4, 4)],
    }
    for T, grid in GRIDS.items():
        x = torch.randn(T, Hd, device=dev, dtype=torch.bfloat16)
        gate = torch.randn(256, Hd, device=dev, dtype=torch.bfloat16) * Hd**-0.5
        ids, w = moe.route(x, gate, torch.zeros(256, device=dev), k=6, routed_scale=1.5)
        q, sf, i64, w32 = moe.stage(x, ids, w)
        out = torch.empty(T, Hd, dtype=torch.bfloat16, device=dev)
        used = int(torch.unique(i64).numel())
        ebytes, flops = (used + 1) * 3 * 2048 * Hd * 2, 2 * 3 * Hd * 2048 * T * 7
        launches = [moe.MoeLaunch(block_m=bm, block_n=bn, block_h=bh, block_k=bk, expert_warps=wp, expert_stages=st)
                    for bm, bn, bh, bk, wp, st in grid] + [moe.default_launch(T, 6, 256)]
        for L in launches:
            try:
                ms = time_ms(lambda i: torch.ops.dsv4ref.moe_experts(x, q.view(torch.uint8), sf, i64, w32, w13, w2, sw13, sw2,
                                                                     out, 10.0, *experts_op_args(L)), 1, reps=10)
            except Exception as e:  # e.g. out of shared memory
                print(f"experts T={T} {L}: FAILED {str(e)[:120]}", flush=True)
                continue
            frac = max(ebytes / ceil.copy_bytes_per_s, flops / ceil.bf16_flops_per_s) / (ms * 1e-3)
            print(f"experts T={T} {L}: {ms * 1e3:8.1f} us {frac:.1%} of bound", flush=True)


if what in ("stage", "all"):
    sweep_stage()
if what in ("experts", "all"):
    sweep_experts()
