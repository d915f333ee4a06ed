"""Launch sweep of the MoE kernels on a GPU (the figures in benchmarks/moe.md).

    PYTHONPATH=. python3 benchmarks/experiments/moe_sweep.py            # staging only (the 80 %-of-copy question), ~100 s
    PYTHONPATH=. python3 benchmarks/experiments/moe_sweep.py experts    # the expert kernels (allocates 13 GB of weights)
    PYTHONPATH=. python3 benchmarks/experiments/moe_sweep.py all

Staging at T = 4096, Hd = 4096, K = 6, four input sets rotated past the L2, every call timed through the
custom op (no argument checks) by graph replay (dsv4ref.tools.harness.time_ms). Printed first: the 512 MiB
copy ceiling and two copies moving staging's bytes timed the same way (what a copy of this size loses to
launch and tail alone). Then, in order of priority (new variants stop starting after STAGE_BUDGET_S):

  A. the references: the default, the session-3 fastest (tile 1 × 1024, 2 warps, streaming stores);
  B. the two encoders on tile 1 × 1024, 2 warps: the shared one ("blocks") and "snap";
  C. stage_encode="snap" over tile shapes and warps (8–32 values per thread);
  D. cache hints (evict_first loads, streaming stores) on the three fastest of C, then a register cap
     (stage_maxnreg 40 / 48: more programs resident per SM, against spills) on the three fastest snap rows.

Before it is timed, every variant's four outputs are compared byte for byte with the reference on input set
0 (real magnitudes, with NaN / ±inf groups planted: the checks-off encoding is checked too); a variant that
differs, or fails to compile, is reported and skipped. Each line gives µs, % of the copy ceiling and % of the
best same-size copy's bandwidth. The variant lists are module constants, so
benchmarks/experiments/moe_stage_compile_check.py compiles the same kernels for sm_90a on a machine with no GPU.

The DIAG rows that took the gap to a copy apart (timing-only encodings with wrong bytes by design: "cast",
"trunc", "loads", "finite", "notopk") needed variants of the library's staging kernel: removed from the
library; commit c98f529 still has them, and this sweep with them. Their figures: benchmarks/moe.md.
"""

import dataclasses
import sys
import time

import torch

import dsv4ref
from dsv4ref import moe
from dsv4ref.moe.variants.stage import StageVariant, stage_into

STAGE_BUDGET_S = 85.0  # new staging variants stop starting after this (the whole run must stay under 120 s)


def tile(bt, bh, warps, **kw):
    """A staging variant (dsv4ref.moe.variants.stage) on [bt, bh] tiles."""
    return StageVariant(block_t=bt, block_h=bh, warps=warps, load="tile", **kw)


def default_variant() -> StageVariant:
    """The shipped default (``moe.default_launch`` at T 4096, K 6, E 256) as a variant."""
    d = moe.default_launch(4096, 6, 256)
    return StageVariant(block_t=d.stage_block_t, block_h=d.stage_block_h, warps=d.stage_warps, topk_first=d.stage_topk_first)


SESSION3_BEST = tile(1, 1024, 2, cache="stream")
BLOCKS_1024 = tile(1, 1024, 2, encode="blocks")  # the shared encoder on the session-3 fastest shape
SNAP_1024 = tile(1, 1024, 2, encode="snap")
ENCODER_ROWS = [BLOCKS_1024, SNAP_1024]
# C: tokens × values per program and warps, 8 to 32 values per thread
SNAP_SHAPES = [
    (1, 512, 1),
    (1, 512, 2),
    (1, 1024, 1),
    (1, 1024, 4),
    (1, 2048, 2),
    (1, 2048, 4),
    (1, 2048, 8),
    (1, 4096, 4),
    (1, 4096, 8),
    (2, 1024, 2),
    (2, 1024, 4),
    (4, 512, 2),
    (4, 512, 4),
    (2, 2048, 4),
    (2, 2048, 8),
    (4, 1024, 4),
    (4, 1024, 8),
]
SNAP_GRID = [tile(bt, bh, w, encode="snap") for bt, bh, w in SNAP_SHAPES]
CACHE_HINTS = ("evict_first", "stream")
MAXNREGS = (40, 48)


def stage_name(v):
    s = f"{v.encode:6s} {v.load:6s} {v.block_t}x{v.block_h} w{v.warps}"
    if v.cache:
        s += f" cache={v.cache}"
    if v.programs:
        s += f" persistent={v.programs} stages={v.stages}"
    if v.maxnreg:
        s += f" maxnreg={v.maxnreg}"
    if v.topk_first:
        s += " topk_first"
    return s


def sweep_stage(ceil):
    from dsv4ref import validate
    from dsv4ref.moe import reference
    from dsv4ref.tools.cases.moe import STAGE_BENCH, same_size_copies, stage_bytes, stage_sets
    from dsv4ref.tools.harness import time_ms

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
        print(
            f"  {case.op:40s} {ms * 1e3:7.1f} us  {bw / 1e12:.2f} TB/s = {bw / ceil.copy_bytes_per_s:6.1%} of the ceiling",
            flush=True,
        )
    copy_us = nbytes / best_copy * 1e6  # staging's bytes at the same-size copy's bandwidth

    results = {}  # label -> (ms, launch)

    def run(L):
        label = stage_name(L)
        if label in results:
            return
        if time.perf_counter() - t0 > STAGE_BUDGET_S:
            print(f"  {label:62s} skipped (time budget)", flush=True)
            return
        x, ids, w, q, sf, i64, w32 = sets[0]
        for b in (q, sf, i64, w32):
            b.fill_(-1 if b.dtype != torch.uint8 else 0x7F)  # poison: an unwritten byte shows
        try:
            stage_into(*sets[0], L)
            bad = [
                n
                for n, g, r in zip(("x_fp8", "x_sf", "ids", "weights"), (q, sf, i64, w32), want)
                if not torch.equal(g.view(torch.uint8), r.view(torch.uint8))
            ]
            if bad:
                print(f"  {label:62s} WRONG BYTES in {', '.join(bad)}: skipped", flush=True)
                return
            ms = time_ms(lambda i: stage_into(*sets[i], L), n_sets)
        except Exception as e:  # e.g. out of registers / shared memory
            print(f"  {label:62s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
            return
        bw = nbytes / (ms * 1e-3)
        results[label] = (ms, L)
        print(
            f"  {label:62s} {ms * 1e3:7.1f} us  {bw / ceil.copy_bytes_per_s:6.1%} of ceiling  "
            f"{bw / best_copy:6.1%} of same-size copy",
            flush=True,
        )

    def fastest(n, encode=None):
        rows = [r for r in results.values() if encode is None or r[1].encode == encode]
        return [L for _, L in sorted(rows, key=lambda r: r[0])[:n]]

    print("A. references", flush=True)
    default = default_variant()
    run(default)
    run(SESSION3_BEST)
    print("B. the two encoders on tile 1 x 1024, 2 warps", flush=True)
    for L in ENCODER_ROWS:
        run(L)
    print("C. snap: tile shapes and warps", flush=True)
    for L in SNAP_GRID:
        run(L)
    print("D. cache hints, then a register cap, on the three fastest snap variants", flush=True)
    for L in fastest(3, "snap"):
        for cache in CACHE_HINTS:
            run(dataclasses.replace(L, cache=cache))
    for L in fastest(3, "snap"):
        for n in MAXNREGS:
            run(dataclasses.replace(L, maxnreg=n))

    print(f"\nsummary (µs; a copy of staging's {nbytes / 1e6:.1f} MB at the same-size copy's bandwidth: {copy_us:.1f} µs)")
    for row in [r for r in (default, SESSION3_BEST) if stage_name(r) in results] + fastest(3):
        ms = results[stage_name(row)][0]
        bw = nbytes / (ms * 1e-3)
        print(
            f"  {stage_name(row):62s} {ms * 1e3:7.1f} us  {bw / ceil.copy_bytes_per_s:6.1%} of ceiling  "
            f"{bw / best_copy:6.1%} of same-size copy; {ms * 1e3 - copy_us:+.1f} µs over the copy"
        )
    print(f"staging sweep: {time.perf_counter() - t0:.0f} s", flush=True)


def sweep_experts(ceil):
    from dsv4ref.tools.cases.moe import flash_weights
    from dsv4ref.tools.harness import time_ms

    dev = dsv4ref.DEVICE
    Hd = 4096
    w13, w2, sw13, sw2 = flash_weights()
    GRIDS = {  # block_m, block_n, block_h, block_k, warps, stages
        64: [
            (16, 64, 128, 64, 4, 3),
            (16, 128, 128, 64, 4, 3),
            (16, 64, 256, 128, 4, 3),
            (16, 64, 128, 64, 4, 4),
            (16, 32, 128, 64, 2, 4),
        ],
        4096: [
            (64, 64, 128, 64, 4, 3),
            (64, 128, 128, 64, 8, 3),
            (64, 128, 128, 128, 8, 3),
            (128, 64, 128, 64, 4, 3),
            (64, 64, 128, 64, 4, 4),
        ],
    }
    for T, grid in GRIDS.items():
        x = torch.randn(T, Hd, device=dev, dtype=torch.bfloat16)
        gate = torch.randn(256, Hd, device=dev, dtype=torch.bfloat16) * Hd**-0.5
        ids, w = moe.route(x, gate, torch.zeros(256, device=dev), k=6, routed_scale=1.5)
        q, sf, i64, w32 = moe.stage(x, ids, w)
        out = torch.empty(T, Hd, dtype=torch.bfloat16, device=dev)
        used = int(torch.unique(i64).numel())
        ebytes, flops = (used + 1) * 3 * 2048 * Hd * 2, 2 * 3 * Hd * 2048 * T * 7
        launches = [
            moe.MoeLaunch(block_m=bm, block_n=bn, block_h=bh, block_k=bk, expert_warps=wp, expert_stages=st)
            for bm, bn, bh, bk, wp, st in grid
        ] + [moe.default_launch(T, 6, 256)]
        for L in launches:
            try:
                ms = time_ms(
                    lambda i: torch.ops.dsv4ref.moe_experts(
                        x, q.view(torch.uint8), sf, i64, w32, w13, w2, sw13, sw2, out, 10.0, *L.op_args("moe_experts")
                    ),
                    1,
                    reps=10,
                )
            except Exception as e:  # e.g. out of shared memory
                print(f"experts T={T} {L}: FAILED {str(e)[:120]}", flush=True)
                continue
            frac = max(ebytes / ceil.copy_bytes_per_s, flops / ceil.bf16_flops_per_s) / (ms * 1e-3)
            print(f"experts T={T} {L}: {ms * 1e3:8.1f} us {frac:.1%} of bound", flush=True)


def main(what):
    from dsv4ref.tools.harness import measure_ceilings

    if what not in ("stage", "experts", "all"):
        raise SystemExit(f"usage: {sys.argv[0]} [stage|experts|all], got {what!r}")
    ceil = measure_ceilings()
    print(
        f"copy ceiling (512 MiB) {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul {ceil.bf16_flops_per_s / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    if what in ("stage", "all"):
        sweep_stage(ceil)
    if what in ("experts", "all"):
        sweep_experts(ceil)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "stage")
