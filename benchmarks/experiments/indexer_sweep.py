"""GPU sweep of the MXFP4 indexer logits launch choices (issue 14): decode × pages per program × warps (× pages per
dot, register cap), each checked against the float64 reference BEFORE it is timed. Not a test; prints a table.

    PYTHONPATH=. python3 benchmarks/experiments/indexer_sweep.py [--budget 95] [--jobs 8] [NAME_PART ...]

The case is ``bench indexer``'s (``dsv4ref.tools.cases.indexer.logits_bench_inputs``): T = 64 tokens, 64 heads,
n_c = 32 768 keys of 64 per page, 2 input sets of 143 MB (beyond the L2). Per variant, in the order of
``VARIANTS`` (most promising first):

1. check: its logits on input set 0 against ``reference.logits`` in float64, both divided by the condition sum
   (``reference.logits_condition``), under the ``fp32_dot`` tolerance the tests use; and the same on a small
   problem whose key scale bytes span up to 64 binades, so that ``f16_scaled`` takes its exact slow path;
2. time: ``dsv4ref.tools.harness.time_ms`` (a device graph of one call per input set, replayed), only if the
   check passed; a variant that fails to compile or to check is reported and skipped.

Kernels compile in ``--jobs`` worker processes started first (each launches its variants once on a tiny
problem with the same specialisation, which fills Triton's on-disk cache), so the variants do not compile one
after the other. No new variant starts after ``--budget`` seconds (from the script's start); the summary
lists the ones left out. Expected run time on an H200: ~60-90 s for the 14 variants.

The % of bound is the harness's: bound = max(bytes / measured copy bandwidth, FLOPs / measured bf16 matmul
rate), both ceilings measured at the start of this run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# (name, IndexerLaunch fields): the launch choices timed, most promising first. Kept free of imports beyond the
# standard library so that benchmarks/experiments/indexer_compile_check.py can read it on a machine with no GPU.
VARIANTS = [
    ("f16_scaled p4 w4", dict(fp4_decode="f16_scaled", logits_pages=4)),
    ("f16_blocks p4 w4 (default)", dict(fp4_decode="f16_blocks", logits_pages=4)),
    ("f16_scaled p4 w8 tile2", dict(fp4_decode="f16_scaled", logits_pages=4, logits_warps=8, logits_tile_pages=2)),
    ("f16_scaled p8 w4", dict(fp4_decode="f16_scaled", logits_pages=8)),
    ("f16_scaled p8 w8 tile2", dict(fp4_decode="f16_scaled", logits_pages=8, logits_warps=8, logits_tile_pages=2)),
    ("f16_scaled p2 w4", dict(fp4_decode="f16_scaled", logits_pages=2)),
    ("f16_scaled p16 w4", dict(fp4_decode="f16_scaled", logits_pages=16)),
    ("f16_scaled p4 w4 reg168", dict(fp4_decode="f16_scaled", logits_pages=4, logits_maxnreg=168)),
    ("f16_scaled p4 w4 reg255", dict(fp4_decode="f16_scaled", logits_pages=4, logits_maxnreg=255)),
    ("f16_scaled p8 w4 reg168", dict(fp4_decode="f16_scaled", logits_pages=8, logits_maxnreg=168)),
    ("f16_scaled p16 w8 tile2", dict(fp4_decode="f16_scaled", logits_pages=16, logits_warps=8, logits_tile_pages=2)),
    ("f16_scaled p4 w8", dict(fp4_decode="f16_scaled", logits_pages=4, logits_warps=8)),
    ("f16_blocks p8 w4", dict(fp4_decode="f16_blocks", logits_pages=8)),
    ("nibble p4 w4", dict(fp4_decode="nibble", logits_pages=4)),
]
SHAPE = dict(T=64, H=64, n_c=32768, Bc=64)
SMALL_N_C = 1024  # keys per token of the wide-span problem and of the compile workers' problem
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def _warm(fields: dict) -> float:
    """Worker: launch one variant on a tiny problem with the bench's specialisation (pointers 16-byte aligned;
    n_out, block-table stride and page stride divisible by 16; H = 64), so that its kernel lands in Triton's
    cache. Returns the seconds it took."""
    t0 = time.time()
    sys.path.insert(0, ROOT)
    import dsv4ref.indexer as ix
    from dsv4ref.device import synchronize
    from dsv4ref.tools.cases.indexer import logits_bench_inputs

    n_c = SMALL_N_C
    pos, sets, _, _ = logits_bench_inputs("mxfp4", 1, T=1, H=SHAPE["H"], n_c=n_c, Bc=SHAPE["Bc"])
    q, qs, wo, cache, bt = sets[0]
    ix.launch.logits(q, qs, wo, cache, pos, bt, SHAPE["Bc"], n_c, ix.IndexerLaunch(**fields))
    synchronize()
    return time.time() - t0


def _check(ix, launch, problem, tol="fp32_dot"):
    """(passed, max |err| / condition) of one launch on one problem: (pos, set, n_c, Bc, ref, cond)."""
    from dsv4ref.tolerances import compare

    pos, (q, qs, wo, cache, bt), n_c, Bc, ref, cond = problem
    got = ix.launch.logits(q, qs, wo, cache, pos, bt, Bc, n_c, launch).double()
    r = compare(got / cond, ref / cond, tol, "logits / condition")
    return r.passed, r.max_abs


def _problem(ix, pos, s, n_c, Bc):
    """A checked problem: the inputs, the float64 oracle and the condition sums."""
    import torch

    args = (s[0], s[1], s[2], s[3], pos, s[4])
    ref = ix.reference.logits(*args, block_size=Bc, n_out=n_c, dtype=torch.float64)
    cond = ix.reference.logits_condition(*args, block_size=Bc, n_out=n_c)
    return pos, s, n_c, Bc, ref, cond


def main(argv=None) -> int:
    t_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=95.0, help="seconds after which no new variant starts")
    ap.add_argument("--jobs", type=int, default=8, help="compile workers (0: compile in this process)")
    ap.add_argument("only", nargs="*", help="run only the variants whose names contain one of these")
    a = ap.parse_args(argv)
    variants = [v for v in VARIANTS if not a.only or any(o in v[0] for o in a.only)]

    pool, futures = None, {}
    if a.jobs > 0:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(max_workers=min(a.jobs, len(variants)), mp_context=mp.get_context("spawn"))
        futures = {name: pool.submit(_warm, fields) for name, fields in variants}

    import torch

    import dsv4ref.indexer as ix
    from dsv4ref.device import describe
    from dsv4ref.tools.cases.indexer import logits_bench_inputs
    from dsv4ref.tools.harness import measure_ceilings, time_ms

    T, H, n_c, Bc = (SHAPE[k] for k in ("T", "H", "n_c", "Bc"))
    print(describe(), "| triton", __import__("triton").__version__, flush=True)
    ceil = measure_ceilings()
    pos, sets, nbytes, flops = logits_bench_inputs("mxfp4", 2, T=T, H=H, n_c=n_c, Bc=Bc)
    bound_us = max(nbytes / ceil.copy_bytes_per_s, flops / ceil.bf16_flops_per_s) * 1e6
    print(
        f"ceilings: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 {ceil.bf16_flops_per_s / 1e12:.0f} TFLOP/s; "
        f"T={T} H={H} n_c={n_c} Bc={Bc}: {nbytes / 1e6:.1f} MB, {flops / 1e9:.1f} GFLOP, bound {bound_us:.1f} us "
        f"(30 % = {bound_us / 0.3:.0f} us)",
        flush=True,
    )
    big = _problem(ix, pos, sets[0], n_c, Bc)
    # the slow-path problem: 4 tokens × 1024 keys whose scale bytes span up to 64 binades (f16_scaled refuses
    # its fast path for every program; every product of scales stays a normal fp32 number)
    spos, ssets, _, _ = logits_bench_inputs("mxfp4", 1, seed=1, T=4, H=H, n_c=SMALL_N_C, Bc=Bc)
    scales = ssets[0][3][:, Bc * 64 :]
    g = torch.Generator(device=scales.device).manual_seed(1)
    scales.copy_(torch.randint(96, 161, scales.shape, dtype=torch.uint8, device=scales.device, generator=g))
    small = _problem(ix, spos, ssets[0], SMALL_N_C, Bc)
    print(f"inputs and float64 references ready ({time.time() - t_start:.0f} s)", flush=True)
    print(
        f"{'variant':<28} {'us':>8} {'GB/s':>6} {'TFLOP/s':>8} {'of bound':>8}  check (max |err|/cond: bench, wide spans)",
        flush=True,
    )

    rows, skipped = [], []
    for name, fields in variants:
        if time.time() - t_start > a.budget:
            skipped.append((name, "not started: time budget"))
            continue
        launch = ix.IndexerLaunch(**fields)
        try:
            if name in futures:
                try:
                    futures[name].result()
                except Exception:  # the worker failed: try here, where the error (if any) is reported
                    pass
            ok1, e1 = _check(ix, launch, big)
            ok2, e2 = _check(ix, launch, small)
        except Exception as e:  # a launch that does not compile (registers, shared memory, ...)
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
            print(f"{name:<28} FAILED to run: {msg}", flush=True)
            skipped.append((name, "failed to run"))
            continue
        if not (ok1 and ok2):
            print(f"{name:<28} FAILED the check: {e1:.2e}, {e2:.2e} (not timed)", flush=True)
            skipped.append((name, "failed the check"))
            continue

        def run(i, launch=launch):
            q, qs, wo, cache, bt = sets[i]
            return ix.launch.logits(q, qs, wo, cache, pos, bt, Bc, n_c, launch)

        us = time_ms(run, len(sets)) * 1e3
        rows.append((name, us))
        print(
            f"{name:<28} {us:8.1f} {nbytes / us / 1e3:6.0f} {flops / us / 1e6:8.1f} {bound_us / us:8.1%}  "
            f"pass {e1:.1e}, {e2:.1e}  ({time.time() - t_start:.0f} s)",
            flush=True,
        )

    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    print(f"\nsummary ({time.time() - t_start:.0f} s; bound {bound_us:.1f} us, 30 % = {bound_us / 0.3:.0f} us):", flush=True)
    base = dict(rows).get("f16_blocks p4 w4 (default)")
    for name, us in sorted(rows, key=lambda r: r[1]):
        rel = f"  {base / us:4.2f}x the default" if base else ""
        print(f"  {name:<28} {us:8.1f} us  {bound_us / us:6.1%} of bound{rel}", flush=True)
    for name, why in skipped:
        print(f"  {name:<28} {why}", flush=True)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
