"""GPU-only, one device call (~1.5 min): the two memory-bound kernels that miss >= 80 % of the copy ceiling by a
little, ``kv_cache.insert`` at 65 536 slots and ``moe.stage`` at T 4096 x Hd 4096, K 6: today's default, a
same-size uint8 copy, and each new launch variant, every one checked byte for byte against the torch reference
before it is timed.

    python3 benchmarks/experiments/mem_probe.py [--budget-s 135] [--only insert|stage] [--variants SUBSTR,SUBSTR]
    STAGES=probe LIMIT_PROBE=180 PROBE=benchmarks/experiments/mem_probe.py bash scripts/gpu-check.sh

Why each variant, from the SASS of the defaults (``benchmarks/experiments/kv_cache_compile_check.py``,
``benchmarks/experiments/moe_stage_compile_check.py``; Triton 3.6, sm_90a; benchmarks/kv_cache.md, benchmarks/moe.md):

* insert (4 tokens x 1 warp, 95 registers, 21 resident programs per SM): its kv loads are predicated on
  ``slot >= 0`` and the NoPE tile is loaded after the RoPE store, so a program runs three DRAM round trips in
  series (slot, RoPE row, NoPE tile). ``early_loads`` issues every load of the tile at once (96 registers);
  ``max_registers`` trades a few spills for more resident programs; ``streaming_stores`` was best at 262 144
  slots and never timed at 4 tokens; 2 / 8 tokens and 2 warps move the registers-per-byte balance.
* stage (1 x 1024 values x 1 warp, 63 registers, 32 programs per SM = the CTA cap, 2 KB of loads in flight
  each; session 4: 16 values per thread 24 us, 32 values per thread 16.9 us, reads alone 14.8 us): more bytes in
  flight per SM, by 64 / 128 values per thread (1 x 2048: 71 registers, 28 programs x 4 KB; 1 x 4096: 144
  registers, 14 x 8 KB) or by a persistent grid that prefetches its next tile (96 registers, 2 tiles per
  program, no program launches between tiles); ``stage_topk_first``: the top-k loads issued with the tile's, not
  after its stores (a quarter of the programs ran one more round trip); ``stage_cache="cs"``: streaming stores
  without the evict-first loads that session 4 measured slower than no hint.

Timing: ``time_ms`` of dsv4ref.tools.harness as the registered benchmark does it (a CUDA graph holding one call
per input set, 4 sets rotated past the L2, replayed; the median per call), and the same with a graph of 32
calls ("long"), which spreads the graph's launch (the device waits between the start event and the first
kernel while the host submits the graph) over 32 calls instead of 4. Percentages: of the 512 MiB copy ceiling
measured in this call (``measure_ceilings``: one eager copy between two events) and of the same-size uint8 copy
timed the same way. Bytes counted as the benchmark counts them (insert 1616 B per token; stage
``tools.cases.moe.stage_bytes``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [
    _HERE,
    os.path.dirname(os.path.dirname(_HERE)),
]  # the sibling sweeps, and this checkout's dsv4ref (not an installed one)

from dsv4ref import kv_cache as kc  # noqa: E402
from dsv4ref import moe, validate  # noqa: E402
from dsv4ref.kv_cache.launch import KVCacheLaunch, default_launch  # noqa: E402
from dsv4ref.moe.variants.stage import StageVariant, stage_into  # noqa: E402

L = KVCacheLaunch
S_INSERT = 65536
GOAL = 0.80
LONG = 8  # the "long" graph: LONG x the 4 input sets


def insert_variants() -> dict[str, KVCacheLaunch]:
    """The default first, then in order of interest (a spent budget cuts the tail)."""
    return {
        "default 4x1 native": default_launch("insert"),
        "4x1 early": L(4, 1, native_casts=True, early_loads=True),
        "4x1 early cs": L(4, 1, native_casts=True, early_loads=True, streaming_stores=True),
        "4x1 cs": L(4, 1, native_casts=True, streaming_stores=True),
        "4x1 early maxreg80": L(4, 1, native_casts=True, early_loads=True, max_registers=80),
        "4x1 early cs maxreg80": L(4, 1, native_casts=True, early_loads=True, streaming_stores=True, max_registers=80),
        "4x1 early cs maxreg64": L(4, 1, native_casts=True, early_loads=True, streaming_stores=True, max_registers=64),
        "2x1 early": L(2, 1, native_casts=True, early_loads=True),
        "2x1 early cs": L(2, 1, native_casts=True, early_loads=True, streaming_stores=True),
        "4x2 early cs": L(4, 2, native_casts=True, early_loads=True, streaming_stores=True),
        "8x1 early cs": L(8, 1, native_casts=True, early_loads=True, streaming_stores=True),
        "8x2 early cs": L(8, 2, native_casts=True, early_loads=True, streaming_stores=True),
    }


def stage_variants(sms: int) -> dict[str, StageVariant]:
    """The default first (``default_launch`` at T 4096, K 6, E 256), then the candidates; ``sms``: the device's
    SM count, for the persistent grids (2048 programs: 8 tiles each, no remainder)."""
    L = moe.default_launch(4096, 6, 256)
    d = StageVariant(block_t=L.stage_block_t, block_h=L.stage_block_h, warps=L.stage_warps)  # top-k after the tile
    r = dataclasses.replace
    pre = dict(prefetch=True, stages=1, topk_first=False)  # persistent grids: no top-k first
    return {
        "default 1x1024 w1 stream": r(d, topk_first=L.stage_topk_first),
        "topk_first": r(d, topk_first=True),
        "cs": r(d, cache="cs"),
        "cs topk_first": r(d, cache="cs", topk_first=True),
        "1x2048 w1 stream": r(d, block_h=2048),
        "1x2048 w1 stream topk_first": r(d, block_h=2048, topk_first=True),
        "1x2048 w1 cs topk_first": r(d, block_h=2048, cache="cs", topk_first=True),
        "2x1024 w1 stream topk_first": r(d, block_t=2, topk_first=True),
        "1x4096 w1 stream": r(d, block_h=4096),
        f"prefetch P={16 * sms} stream": r(d, programs=16 * sms, **pre),
        "prefetch P=2048 stream": r(d, programs=2048, **pre),
        f"prefetch P={20 * sms} cs": r(d, programs=20 * sms, cache="cs", **pre),
    }


# ------------------------------------------------------------------------------------------------
# GPU part
# ------------------------------------------------------------------------------------------------


class Probe:
    def __init__(self, budget_s: float, pick: list[str], dry: bool = False):
        from dsv4ref.tools.harness import time_ms

        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.pick = pick
        self.dry = dry  # --dry-run: tiny sizes, one timed call, on any device (the interpreter on a CPU)
        self.time_ms = (lambda fn, n: time_ms(fn, n, warmup=1, reps=1)) if dry else time_ms
        self.summary = []

    def chosen(self, variants: dict) -> dict:
        first = next(iter(variants))  # the default is always timed
        return {k: v for k, v in variants.items() if k == first or not self.pick or any(p in k for p in self.pick)}

    def spent(self) -> bool:
        return time.perf_counter() - self.t0 > self.budget_s

    def times(self, fn, n_sets: int) -> tuple[float, float]:
        """(bench-method ms per call, long-graph ms per call)."""
        short = self.time_ms(fn, n_sets)
        long = self.time_ms(lambda i: fn(i % n_sets), n_sets * LONG)
        return short, long

    def row(self, op, name, nbytes, ms, long_ms, ceil, copy_ms, note=""):
        bw = nbytes / (ms * 1e-3)
        print(
            f"{op:<7} {name:<30} {ms * 1e3:7.1f} us {bw / ceil:6.1%} of ceiling {copy_ms / ms:6.1%} of same-size copy"
            f" | long {long_ms * 1e3:6.1f} us {nbytes / (long_ms * 1e-3) / ceil:6.1%}{note}",
            flush=True,
        )

    def copy_baseline(self, op, what, nbytes, n, ceil) -> tuple[float, float]:
        """Time the same-size uint8 copy of ``nbytes`` (the op's own yardstick; its buffers are freed on return),
        print the op's header (``what``: its shape) and the copy's row: (ms, long-graph ms) per call."""
        from dsv4ref.tools.harness import same_size_copy_case

        copy = same_size_copy_case("copy", "", nbytes, n)
        copy_ms, copy_long = self.times(copy.run, n)
        print(f"\n{what}: {nbytes / 1e6:.1f} MB per call, {n} sets, {time.perf_counter() - self.t0:.0f} s in", flush=True)
        self.row(op, "same-size uint8 copy", nbytes, copy_ms, copy_long, ceil, copy_ms)
        return copy_ms, copy_long

    def finish(self, op, rows, nbytes, ceil, copy_ms, copy_long, failed):
        """rows: [(name, ms, long_ms)], the default first."""
        if not rows:
            self.summary.append(f"{op}: nothing timed")
            return
        d = rows[0]
        best = min(rows, key=lambda r: r[1])
        frac = nbytes / (best[1] * 1e-3) / ceil
        line = (
            f"{op}: fastest byte-exact {best[0]!r} {best[1] * 1e3:.1f} us = {frac:.1%} of ceiling "
            f"({'MEETS' if frac >= GOAL else 'misses'} {GOAL:.0%}; long graph {best[2] * 1e3:.1f} us = "
            f"{nbytes / (best[2] * 1e-3) / ceil:.1%}); default {d[1] * 1e3:.1f} us = "
            f"{nbytes / (d[1] * 1e-3) / ceil:.1%}; same-size copy {copy_ms * 1e3:.1f} us = "
            f"{nbytes / (copy_ms * 1e-3) / ceil:.1%} (long {copy_long * 1e3:.1f} us)"
        )
        if failed:
            line += f"; not timed: {', '.join(failed)}"
        self.summary.append(line)

    def sweep(self, op, variants, wrong_bytes, timed_call, n, nbytes, ceil, copy_ms):
        """Check, then time, each variant: ``wrong_bytes(v)`` runs it once and says what came out wrong (an
        empty string: nothing); ``timed_call(v)`` is the per-set call to time. A variant that raises or writes
        wrong bytes is reported and not timed. Returns (rows [(name, ms, long_ms)], failed [names])."""
        rows, failed = [], []
        for name, v in variants.items():
            if self.spent():
                failed.append(f"{name} (budget)")
                continue
            try:
                bad = wrong_bytes(v)
            except Exception as e:  # noqa: BLE001
                print(f"{op:<7} {name:<30} FAILED {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
                failed.append(f"{name} (failed)")
                continue
            if bad:
                print(f"{op:<7} {name:<30} WRONG BYTES {bad}: not timed", flush=True)
                failed.append(f"{name} (wrong bytes)")
                continue
            ms, long_ms = self.times(timed_call(v), n)
            rows.append((name, ms, long_ms))
            self.row(op, name, nbytes, ms, long_ms, ceil, copy_ms)
        return rows, failed

    # -------------------------------------------------------------------------------- insert
    def insert(self, ceil: float):
        from kv_cache_sweep import make_sets
        from kv_cache_sweep2 import PER_TOKEN, hard_inputs

        from dsv4ref.device import empty_cache
        from dsv4ref.kv_cache import reference
        from dsv4ref.kv_cache.kernels import insert_kernel
        from dsv4ref.kv_cache.launch import _grid_and_flags, int16_view, launch_insert

        variants = self.chosen(insert_variants())
        B, S = 64, (256 if self.dry else S_INSERT)
        nbytes = S * PER_TOKEN
        hkv, hslots, hcache, _ = hard_inputs(64, 2) if self.dry else hard_inputs()
        with validate.checking_values(False):
            want_hard = hcache.clone()
            reference.insert(want_hard, hkv, hslots, block_size=B)

        def compile_all():  # several ptxas at once; a variant that fails to compile shows at its check
            import concurrent.futures

            def one(v):
                grid, flags = _grid_and_flags(hcache, hslots.shape[0], B, v, insert=True)
                kv16 = hkv.view(torch.int16)
                insert_kernel.warmup(
                    hcache,
                    int16_view(hcache)[0],
                    kv16,
                    hslots,
                    hslots.shape[0],
                    1,
                    kv16.stride(0),
                    hcache.stride(0),
                    B,
                    grid=(grid,),
                    ROPE16=True,
                    **flags,
                )

            with concurrent.futures.ThreadPoolExecutor(8) as ex:
                list(ex.map(lambda v: _quiet(one, v), variants.values()))

        compile_all()
        sets = make_sets(S)
        n = len(sets)
        want = kc.allocate(S // B, B)
        reference.insert(want, sets[0][1], sets[0][2], block_size=B)
        copy_ms, copy_long = self.copy_baseline("insert", f"insert S={S} B={B} ({PER_TOKEN} B/token)", nbytes, n, ceil)

        def wrong_bytes(v):
            c = hcache.clone()
            launch_insert(c, hkv, hslots, B, v)
            if not torch.equal(c, want_hard):
                return "(hard set)"
            sets[0][0].zero_()
            launch_insert(sets[0][0], sets[0][1], sets[0][2], B, v)
            return "" if torch.equal(sets[0][0], want) else "(timed set)"

        def timed_call(v):
            def fn(i):
                c, kv, sl, _ = sets[i]
                launch_insert(c, kv, sl, B, v)

            return fn

        rows, failed = self.sweep("insert", variants, wrong_bytes, timed_call, n, nbytes, ceil, copy_ms)
        self.finish(f"kv_cache.insert S={S}", rows, nbytes, ceil, copy_ms, copy_long, failed)
        sets.clear()
        want = None  # (freed before empty_cache)
        empty_cache()

    # -------------------------------------------------------------------------------- stage
    def stage(self, ceil: float):
        from dsv4ref.device import empty_cache, sm_count
        from dsv4ref.moe import reference
        from dsv4ref.tools.cases.moe import STAGE_BENCH, stage_bytes, stage_sets

        variants = self.chosen(stage_variants(sm_count()))
        T, Hd, K, n = (16, 2048, 6, 2) if self.dry else STAGE_BENCH
        nbytes = stage_bytes(T, Hd, K)
        sets = stage_sets(T, Hd, K, n)
        x0 = sets[0][0]
        for t, h in ((5, 7), (9, 32 + 3), (2047, 4000), (4095, 130)):  # NaN, +inf, -inf, NaN groups in set 0
            x0[t % T, h % Hd] = (float("nan"), float("inf"), -float("inf"), float("nan"))[t % 4]
        x0[9, 32 + 4] = -1.5  # its code becomes 0xFF
        with validate.checking_values(False):
            want = [t.contiguous() for t in reference.stage(x0, sets[0][1], sets[0][2])]
        want[0] = want[0].view(torch.uint8)
        copy_ms, copy_long = self.copy_baseline("stage", f"stage T={T} Hd={Hd} K={K}", nbytes, n, ceil)

        def wrong_bytes(v):
            x, ids, w, q, sf, i64, w32 = sets[0]
            for b in (q, sf, i64, w32):
                b.fill_(-1 if b.dtype != torch.uint8 else 0x7F)  # poison: an unwritten byte shows
            stage_into(*sets[0], v)
            bad = [
                nm
                for nm, g, r in zip(("x_fp8", "x_sf", "ids", "weights"), (q, sf, i64, w32), want)
                if not torch.equal(g.view(torch.uint8), r.view(torch.uint8))
            ]
            return f"in {', '.join(bad)}" if bad else ""

        def timed_call(v):
            return lambda i: stage_into(*sets[i], v)

        rows, failed = self.sweep("stage", variants, wrong_bytes, timed_call, n, nbytes, ceil, copy_ms)
        self.finish(f"moe.stage T={T} Hd={Hd} K={K}", rows, nbytes, ceil, copy_ms, copy_long, failed)
        sets.clear()
        empty_cache()


def _quiet(fn, *a):
    try:
        fn(*a)
    except Exception:  # noqa: BLE001  (reported when the variant is checked)
        pass


def main():
    import dsv4ref
    from dsv4ref.device import describe
    from dsv4ref.tools.harness import measure_ceilings

    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=135.0, help="start no new variant after this many seconds")
    ap.add_argument("--only", choices=("insert", "stage"), default=None)
    ap.add_argument(
        "--variants",
        default=os.environ.get("MEM_PROBE_VARIANTS", ""),
        help="comma-separated substrings of variant names to run (the default is always run)",
    )
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, no ceiling, any device: checks the script")
    a = ap.parse_args()
    assert a.dry_run or dsv4ref.DEVICE.type != "cpu", "GPU only (--dry-run runs the logic at tiny sizes anywhere)"
    p = Probe(a.budget_s, [s for s in a.variants.split(",") if s], a.dry_run)
    print(describe(), flush=True)
    ceil = 1e9 if a.dry_run else measure_ceilings().copy_bytes_per_s
    print(f"copy ceiling (512 MiB, read + write, one eager call between events): {ceil / 1e12:.3f} TB/s", flush=True)
    if not a.dry_run:  # for comparison only: the same 512 MiB copy timed as the kernels are (graph of 2 calls)
        from dsv4ref.device import DEVICE, empty_cache

        src = [torch.empty(1 << 29, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
        dst = [torch.empty_like(x) for x in src]
        ms = p.time_ms(lambda i: dst[i].copy_(src[i]), 2)
        print(
            f"  the same copy timed like the kernels (graph of 2 calls): {2 * (1 << 29) / (ms * 1e-3) / 1e12:.3f} TB/s"
            " (not used below)",
            flush=True,
        )
        del src, dst
        empty_cache()
    print(
        "columns: bench method (graph of 4 calls) us, % of ceiling, % of same-size copy | graph of "
        f"{4 * LONG} calls us, % of ceiling. Every timed variant byte-exact (timed set with NaN/inf; insert: hard set)"
    )
    if a.only in (None, "insert"):
        p.insert(ceil)
    if a.only in (None, "stage"):
        p.stage(ceil)
    print(f"\nSUMMARY (copy ceiling {ceil / 1e12:.3f} TB/s; goal >= {GOAL:.0%}; {time.perf_counter() - p.t0:.0f} s)")
    for line in p.summary:
        print("  " + line)


if __name__ == "__main__":
    main()
