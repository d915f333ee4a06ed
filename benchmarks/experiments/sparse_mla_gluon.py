"""GPU-only: the Hopper Gluon sparse-MLA decode (dsv4ref.sparse_mla.gluon) against the roofline bound,
with the portable fused Triton kernel timed on the same inputs (not a test; prints a table).

    PYTHONPATH=. python3 benchmarks/experiments/sparse_mla_gluon.py [--quick]

1. Correctness first: every kernel (``GluonLaunch.kernel``: the default for the shape, the 64-row kernel at
   H 16, the plain kernel) at list splits 1 and 2 against the fp32 torch reference on a small two-pool case
   (tolerance "bf16_weighted_sum").
2. Ceilings measured in this run (device-to-device copy, bf16 matmul: dsv4ref.tools.harness).
3. The issue's three shapes (T 64: H 64 K 640; H 128 K 1152; H 16 K 2048; a window pool of 128 slots plus
   the compressed pool, pages of 64, every (token, candidate) a distinct row, input sets rotated past the
   L2), each timed as a device-graph replay (harness.time_ms): µs and % of max(bytes / copy BW, FLOP /
   bf16 matmul rate). Bytes: 584 B + a 4-byte index per selected row, q and out in bf16, lse fp32, lengths;
   FLOP: 2·H·K·(512 + 512) with the real H.
4. A summary table (default split) of every kernel at the three shapes.

A kernel that does not compile or fails a check is reported and left out of the timing. Its register and
spill figures come from benchmarks/gluon_compile_check.py, which needs no GPU. The variants and timing
diagnostics measured in earlier runs of this script (benchmarks/sparse_mla.md) are in git history.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

os.environ.setdefault("DSV4REF_CHECK_VALUES", "0")  # no host syncs in decode(): graph-capturable

import torch  # noqa: E402

import dsv4ref  # noqa: E402,F401
from dsv4ref import kv_cache  # noqa: E402
from dsv4ref.device import DEVICE, capture_graph, empty_cache, synchronize  # noqa: E402
from dsv4ref.sparse_mla import gluon as G  # noqa: E402
from dsv4ref.testing import compare, randn  # noqa: E402
from dsv4ref.tools.harness import measure_ceilings, time_ms  # noqa: E402

SHAPES = ((64, 64, 640), (64, 128, 1152), (64, 16, 2048))
L2_BYTES = 60e6
# what is timed, by name: GluonLaunch.kernel, None = the default launch's kernel for the shape
KERNELS = {
    "gluon default": None,
    "gluon 64-row kernel": "ws",  # the default for H > 16: timed only at H 16, beside the narrow one
    "gluon plain (rung a)": "plain",  # no warp specialisation: notebook 04's rung "a"
}
SPLIT_SWEEP = {"gluon default"}  # also timed at splits 1, 2 and 4

if os.environ.get("GLUON_BENCH_KERNELS"):  # e.g. "gluon default,gluon plain (rung a)": time only these
    KERNELS = {k: v for k, v in KERNELS.items() if k in os.environ["GLUON_BENCH_KERNELS"].split(",")}
FAILED: set = set()  # kernels that failed a check (or did not compile): not timed


def portable(q, pools, sink):
    from dsv4ref import sparse_mla

    (c1, i1, l1, b1), (c2, i2, l2, b2) = pools
    return sparse_mla.decode(
        q,
        c1,
        i1,
        l1,
        block_size=b1,
        sink=sink,
        extra_cache=c2,
        extra_slots=i2,
        extra_lengths=l2,
        extra_block_size=b2,
        backend="triton",
    )


def reference(q, pools, sink):
    from dsv4ref import sparse_mla

    (c1, i1, l1, b1), (c2, i2, l2, b2) = pools
    return sparse_mla.decode(
        q,
        c1,
        i1,
        l1,
        block_size=b1,
        sink=sink,
        extra_cache=c2,
        extra_slots=i2,
        extra_lengths=l2,
        extra_block_size=b2,
        backend="reference",
    )


def launch_for(q, pools, kernel=None, num_splits=None) -> G.GluonLaunch:
    """The default launch for these inputs, with ``kernel`` / ``num_splits`` replaced where given."""
    T, H, _ = q.shape
    launch = G.default_launch(T, H, sum(p[1].shape[1] for p in pools), DEVICE)
    return dataclasses.replace(launch, kernel=kernel or launch.kernel, num_splits=num_splits or launch.num_splits)


def gluon(q, pools, sink, kernel=None, num_splits=None):
    (c1, i1, l1, b1), (c2, i2, l2, b2) = pools
    return G.decode_gluon(
        q,
        c1,
        i1,
        l1,
        block_size=b1,
        sink=sink,
        extra_cache=c2,
        extra_slots=i2,
        extra_lengths=l2,
        extra_block_size=b2,
        launch=launch_for(q, pools, kernel, num_splits),
    )


def inputs(T, H, K, n_sets, seed=0):
    """n_sets input sets; every (token, candidate) reads a distinct row, window pool 128 + compressed rest."""
    sets = []
    for s in range(n_sets):
        pools = []
        for i, Kp in enumerate((128, K - 128)):
            n = T * Kp
            cache = kv_cache.allocate(n // 64, 64, device=DEVICE)
            kv_cache.insert(
                cache, torch.randn(n, 512, device=DEVICE, dtype=torch.bfloat16), torch.arange(n, device=DEVICE), block_size=64
            )
            g = torch.Generator().manual_seed(1000 * s + i + seed)
            idx = torch.randperm(n, generator=g).to(torch.int32).view(T, Kp).to(DEVICE)
            pools.append((cache, idx, torch.full((T,), Kp, dtype=torch.int32, device=DEVICE), 64))
        sets.append((torch.randn(T, H, 512, device=DEVICE, dtype=torch.bfloat16), pools, torch.randn(H, device=DEVICE)))
    return sets


def counts(T, H, K):
    byts = T * (K * (584 + 4) + H * 512 * 2 * 2 + H * 4 + 2 * 4)
    return byts, T * 2 * H * K * 1024


def correctness():
    """Small two-pool case with holes, partial lengths and a sink, against the fp32 reference."""
    ok = True
    for H in (16, 64, 128):
        T, K1, K2 = 6, 100, 300
        g = torch.Generator().manual_seed(H)
        pools = []
        for i, (K, bs, pages) in enumerate(((K1, 16, 16), (K2, 64, 12))):
            n = bs * pages
            cache = kv_cache.allocate(pages, bs, device=DEVICE)
            kv_cache.insert(cache, randn((n, 512), seed=10 * i + H, octaves=6), torch.arange(n, device=DEVICE), block_size=bs)
            idx = torch.randint(0, n, (T, K), generator=g, dtype=torch.int32)
            idx[torch.rand(T, K, generator=g) < 0.1] = -1
            lens = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
            lens[0], lens[1] = K, 0
            pools.append((cache, idx.to(DEVICE), lens.to(DEVICE), bs))
        q = (randn((T, H, 512), seed=99 + H, octaves=4).float() * 0.25).to(torch.bfloat16)
        sink = (torch.randn(H, generator=g) * 2).to(DEVICE)
        # the fp32 reference and Σ p|v| (the scale of the bf16-P rounding error)
        from dsv4ref.sparse_mla import reference as R

        (c1, i1, l1, b1), (c2, i2, l2, b2) = pools
        ref_out, ref_lse, mass = R.decode(
            q,
            c1,
            i1,
            l1,
            block_size=b1,
            sink=sink,
            extra_cache=c2,
            extra_slots=i2,
            extra_lengths=l2,
            extra_block_size=b2,
            with_mass=True,
        )
        runs = [("portable", lambda: portable(q, pools, sink))]
        for name, kernel in KERNELS.items():
            for sp in (1, 2):
                runs.append((f"{name} split{sp}", lambda kernel=kernel, sp=sp: gluon(q, pools, sink, kernel, sp)))
        for name, fn in runs:
            base = name.rsplit(" split", 1)[0]
            if base in FAILED:
                continue
            try:
                out, lse = fn()
                synchronize()
                r1 = compare(out, ref_out.double(), "bf16_weighted_sum", "out", mass=mass)
                r2 = compare(lse, ref_lse.double(), "lse", "lse")
                good = r1.passed and r2.passed and not bool(torch.isnan(out).any())
                ok &= good or name == "portable"
                if not good and name != "portable":
                    FAILED.add(base)
                print(
                    f"check H={H:<3} {name:<30} {'PASS' if good else 'FAIL'} out max_abs {r1.max_abs:.2e} "
                    f"lse max_abs {r2.max_abs:.2e}",
                    flush=True,
                )
            except Exception as e:
                ok = False
                FAILED.add(base)
                print(f"check H={H:<3} {name:<30} ERROR {type(e).__name__}: {str(e)[:1500]}", flush=True)
    return ok


def main():
    quick = "--quick" in sys.argv
    print(dsv4ref.device.describe() if hasattr(dsv4ref, "device") else "", flush=True)
    if not G.available(DEVICE):
        print(f"gluon backend not available here ({G.import_error()!r})")
        return 1
    ok = correctness()
    rows = []
    ceil = measure_ceilings()
    print(f"ceilings: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 {ceil.bf16_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)
    for T, H, K in SHAPES:
        byts, flops = counts(T, H, K)
        n_sets = max(2, math.ceil(2.5 * L2_BYTES / (T * K * 585)))
        sets = inputs(T, H, K, n_sets)
        bound_us = max(byts / ceil.copy_bytes_per_s, flops / ceil.bf16_flops_per_s) * 1e6
        default = G.default_launch(T, H, K, DEVICE)
        print(
            f"\n== T={T} H={H} K={K}: bound {bound_us:.2f} us ({byts / 1e6:.1f} MB, {flops / 1e9:.2f} GFLOP); "
            f"gluon default {default}",
            flush=True,
        )
        runs = [("portable triton (fused)", lambda i: portable(*sets[i][:2], sets[i][2]))]
        for name, kernel in KERNELS.items():
            if kernel is not None and kernel == default.kernel:
                continue  # the default row times it
            if name in FAILED:
                print(f"{name:<30} skipped (failed its correctness check)", flush=True)
                continue
            runs.append((name, lambda i, kernel=kernel: gluon(*sets[i][:2], sets[i][2], kernel)))
            if name in SPLIT_SWEEP or not quick:
                for sp in (1, 2, 4) if name in SPLIT_SWEEP else (1, 2):
                    if sp != default.num_splits:
                        runs.append(
                            (f"{name} split{sp}", lambda i, kernel=kernel, sp=sp: gluon(*sets[i][:2], sets[i][2], kernel, sp))
                        )
        for name, fn in runs:
            try:
                fn(0)
                synchronize()
                graphed = capture_graph(lambda: [fn(i) for i in range(n_sets)]) is not None
                us = time_ms(fn, n_sets) * 1e3
                extra = ""
                k = G._LAST.get("decode")
                if name.startswith("gluon") and k is not None:
                    extra = f" regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')}"
                rows.append((T, H, K, name, us, bound_us / us))
                print(
                    f"{name:<30} {us:8.1f} us  {byts / us / 1e3:7.0f} GB/s  {flops / us / 1e6:6.1f} TFLOP/s  "
                    f"{bound_us / us:6.1%} of bound{'' if graphed else ' (EAGER: graph capture failed)'}{extra}",
                    flush=True,
                )
            except Exception as e:
                print(f"{name:<30} FAILED {type(e).__name__}: {str(e)[:800]}", flush=True)
        sets = None  # free this shape's inputs
        empty_cache()
    summary(rows)
    print("\ncorrectness:", "all gluon kernels PASS" if ok else f"SOME GLUON CHECK FAILED: {sorted(FAILED)}")
    return 0 if ok else 1


def summary(rows):
    """One line per kernel: µs and % of the bound at each shape (default split), side by side."""
    names = []
    for r in rows:
        if r[3] not in names:
            names.append(r[3])
    print("\n== summary: us (% of bound) per shape " + "  ".join(f"H{H} K{K}" for _, H, K in SHAPES))
    for n in names:
        cells = []
        for T, H, K in SHAPES:
            hit = [r for r in rows if r[:4] == (T, H, K, n)]
            cells.append(f"{hit[0][4]:7.1f} ({hit[0][5]:5.1%})" if hit else f"{'-':>16}")
        print(f"{n:<30} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    sys.exit(main())
