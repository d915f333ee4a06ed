"""GPU-only: the launch variants of ``kv_cache.insert`` / ``gather`` (issue 14), each checked byte-exact, then timed.

One device call of under two minutes: every variant of :class:`dsv4ref.kv_cache.KVCacheLaunch` listed below (and the persistent grids of
``dsv4ref.kv_cache.variants.persistent``) is
compiled first (in threads, so the compiles overlap), then for each slot count (65 536, then 262 144 while the
time budget lasts)

* checked: its bytes against the torch reference, on the timed input set 0 (random bf16 rows, a random
  permutation of every slot) and on a small hard set (rows of random bit patterns: NaN / ±inf blocks, signed
  zeros, subnormals; −1 slots; for the gather a cache of random bytes: NaN codes, scale bytes 0
  and 255), so the non-finite branch of the encoder and the native casts run on the device;
* timed: kernel time by graph replay (``dsv4ref.tools.harness.time_ms``), 4 rotating input sets
  (4 × (37 MB cache + 64 MB kv + 64 MB out), past the 60 MB L2), as a fraction of the copy bandwidth
  measured in the same run. Bytes counted per token: 1024 (bf16 row) + 8 (slot) + 584 (record) = 1616.

    PYTHONPATH=. python3 benchmarks/experiments/kv_cache_sweep2.py [--budget-s 100] [--sizes 65536,262144]

A row reads ``op S variant time GB/s of-copy exact``; ``exact`` is False if either check failed (the timing
of a wrong variant is still printed, marked).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time

import torch

import dsv4ref
from dsv4ref import kv_cache as kc
from dsv4ref import validate
from dsv4ref.device import DEVICE, describe, empty_cache, synchronize
from dsv4ref.kv_cache import reference
from dsv4ref.kv_cache.kernels import gather_kernel, insert_kernel
from dsv4ref.kv_cache.launch import KVCacheLaunch, int16_view
from dsv4ref.kv_cache.variants.persistent import PersistentLaunch, grid_and_flags, launch_gather, launch_insert
from dsv4ref.tools.harness import measure_ceilings, time_ms
from kv_cache_sweep import make_sets  # the same four rotated input sets (pages of 64) as the first sweep

L = KVCacheLaunch
P = PersistentLaunch  # a persistent grid (dsv4ref.kv_cache.variants.persistent): no default
# The first of each list is the default launch; the rest in order of interest (a tight budget cuts the tail).
INSERT_VARIANTS = {
    "8x1": L(8, 1),  # the default: integer encoders, one tile per program
    "8x1 native": L(8, 1, native_casts=True),  # hardware e4m3 cast for finite tiles
    "4x1 native": L(4, 1, native_casts=True),
    "8x2 native": L(8, 2, native_casts=True),
    "4x1 native pers14 st2": P(L(4, 1, native_casts=True), 14, 2),
    "8x1 native pers10 st2": P(L(8, 1, native_casts=True), 10, 2),
    "4x1 native pers20": P(L(4, 1, native_casts=True), 20),
    "8x1 native evict": L(8, 1, native_casts=True, evict_first=True),
    "8x1 native cs": L(8, 1, native_casts=True, streaming_stores=True),
    "16x2 native": L(16, 2, native_casts=True),
    "4x1": L(4, 1),
    "8x2": L(8, 2),
}
GATHER_VARIANTS = {
    "4x1": L(4, 1),  # the default
    "4x1 native": L(4, 1, native_casts=True),  # hardware bf16 cast
    "8x2 native": L(8, 2, native_casts=True),
    "2x1 native": L(2, 1, native_casts=True),
    "8x1 native": L(8, 1, native_casts=True),
    "4x1 native pers24 st2": P(L(4, 1, native_casts=True), 24, 2),
    "8x1 native pers16 st2": P(L(8, 1, native_casts=True), 16, 2),
    "4x1 native evict": L(4, 1, native_casts=True, evict_first=True),
    "4x1 native cs": L(4, 1, native_casts=True, streaming_stores=True),
    "8x2": L(8, 2),
}
B = 64
PER_TOKEN = 1024 + 8 + kc.TOKEN_BYTES


def hard_inputs(T: int = 32768, pages: int = 640):
    """Rows a writer can get wrong (checks off): random bit patterns (NaN / inf in most blocks), finite rows
    with single NaN / ±inf / −0 / subnormal values, zero rows; slots with −1; a cache of random bytes. Large enough
    that every persistent variant loops (more tiles than programs). int64 slots, like the timed sets (int32 slots
    are covered by the interpreter tests)"""
    g = torch.Generator().manual_seed(7)
    kv = (
        torch.randn(T, 512, generator=g)
        * torch.exp2(torch.randint(-40, 40, (T, 8), generator=g).float()).repeat_interleave(64, 1)
    ).to(torch.bfloat16)
    bits = kv.view(torch.int16)
    bits[: T // 8] = torch.randint(-32768, 32768, (T // 8, 512), generator=g, dtype=torch.int32).to(torch.int16)
    special = torch.tensor([0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x7F81, 0xFFFF, 0x8000, 0x0001, 0x8001], dtype=torch.int32)
    rows = torch.randint(T // 8, T, (T // 8,), generator=g)
    cols = torch.randint(0, 512, (T // 8,), generator=g)
    bits[rows, cols] = special[torch.randint(0, len(special), (T // 8,), generator=g)].to(torch.int16)
    kv[T // 8 : T // 8 + 4] = 0.0
    kv[T // 8 + 4 : T // 8 + 8] = -0.0
    slots = torch.randperm(pages * B, generator=g)[:T]
    slots[torch.randperm(T, generator=g)[: T // 16]] = -1
    cache = torch.randint(0, 256, (pages, kc.page_bytes(B)), generator=g, dtype=torch.int32).to(torch.uint8)
    read = torch.randint(-1, pages * B, (T,), generator=g)
    return kv.to(DEVICE), slots.to(DEVICE), cache.to(DEVICE), read.to(DEVICE)


def warm_up(variants: dict, kernel, args_for) -> dict:
    """Compile every variant's kernel, several at once (ptxas runs as a subprocess). Returns {name: error} for
    the variants that do not compile (they are skipped)."""

    def one(launch):
        cache, args, n = args_for()
        fn, grid, flags = grid_and_flags(cache, n, B, launch, insert=kernel is insert_kernel)
        fn.warmup(*args, grid=(grid,), ROPE16=int16_view(cache)[1], **flags)

    failed = {}
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        futures = {name: ex.submit(one, v) for name, v in variants.items()}
        for name, f in futures.items():
            try:
                f.result()
            except Exception as e:
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    return failed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=95.0, help="start no new variant after this many seconds")
    ap.add_argument("--sizes", default="65536,262144")
    a = ap.parse_args()
    t0 = time.time()
    print(describe())
    bw = measure_ceilings().copy_bytes_per_s
    print(f"copy bandwidth (read + write) measured now: {bw / 1e12:.3f} TB/s")

    hkv, hslots, hcache, hread = hard_inputs()
    with validate.checking_values(False):
        want_hard = hcache.clone()
        reference.insert(want_hard, hkv, hslots, block_size=B)
        want_hard_g = reference.gather(hcache, hread, block_size=B).view(torch.int16)

    def ins_args():
        c16, _ = int16_view(hcache)
        kv16 = hkv.view(torch.int16)
        return hcache, (hcache, c16, kv16, hslots, hslots.shape[0], 1, kv16.stride(0), hcache.stride(0), B), hslots.shape[0]

    def gat_args():
        c16, _ = int16_view(hcache)
        out = torch.empty(hread.shape[0], 512, dtype=torch.int16, device=DEVICE)
        return hcache, (hcache, c16, hread, out, hread.shape[0], 1, hcache.stride(0), B), hread.shape[0]

    skip = {("insert", k): v for k, v in warm_up(INSERT_VARIANTS, insert_kernel, ins_args).items()}
    skip |= {("gather", k): v for k, v in warm_up(GATHER_VARIANTS, gather_kernel, gat_args).items()}
    synchronize()
    print(
        f"compiled {len(INSERT_VARIANTS) + len(GATHER_VARIANTS) - len(skip)} variants in {time.time() - t0:.0f} s"
        + "".join(f"\n  {op} {name}: does not compile ({why}), skipped" for (op, name), why in skip.items())
    )

    # the hard set first: a variant with wrong bytes there is never timed
    for op, variants in (("insert", INSERT_VARIANTS), ("gather", GATHER_VARIANTS)):
        for name, v in variants.items():
            if (op, name) in skip:
                continue
            try:
                if op == "insert":
                    c = hcache.clone()
                    launch_insert(c, hkv, hslots, B, v)
                    ok = torch.equal(c, want_hard)
                else:
                    out = torch.empty(hread.shape[0], 512, dtype=torch.bfloat16, device=DEVICE)
                    launch_gather(hcache, hread, out, B, v)
                    ok = torch.equal(out.view(torch.int16), want_hard_g)
            except Exception as e:
                ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
            else:
                why = "wrong bytes on the hard set (NaN / inf / -0 rows, random-byte cache)"
            if not ok:
                skip[op, name] = why
                print(f"  {op} {name}: {why}, skipped")

    results = {}  # (op, S) -> [(name, fraction)]
    print(f"{'op':<7} {'S':>7} {'variant':<22} {'time us':>8} {'GB/s':>6} {'of copy':>8}")
    for S in [int(x) for x in a.sizes.split(",")]:
        if time.time() - t0 > a.budget_s:
            print(f"(S={S} not started: {time.time() - t0:.0f} s used of a {a.budget_s:.0f} s budget)")
            break
        sets = make_sets(S)
        n = len(sets)
        want_cache = kc.allocate(S // B, B)
        reference.insert(want_cache, sets[0][1], sets[0][2], block_size=B)
        want_out = reference.gather(want_cache, sets[0][2], block_size=B).view(torch.int16)
        for op, variants in (("insert", INSERT_VARIANTS), ("gather", GATHER_VARIANTS)):
            if op == "gather":
                sets[0][0].copy_(want_cache)  # the records every gather variant reads, whatever the inserts did
            for name, v in variants.items():
                if (op, name) in skip:
                    continue
                if time.time() - t0 > a.budget_s:
                    print(f"{op:<7} {S:>7} {name:<22} not started: time budget spent")
                    continue
                if op == "insert":

                    def fn(i, v=v):
                        c, kv, sl, _ = sets[i]
                        launch_insert(c, kv, sl, B, v)

                    sets[0][0].zero_()
                    fn(0)
                    exact = torch.equal(sets[0][0], want_cache)
                else:

                    def fn(i, v=v):
                        c, _, sl, out = sets[i]
                        launch_gather(c, sl, out, B, v)

                    sets[0][3].zero_()
                    fn(0)
                    exact = torch.equal(sets[0][3].view(torch.int16), want_out)
                if not exact:
                    skip[op, name] = f"wrong bytes at S={S}"
                    print(f"{op:<7} {S:>7} {name:<22} WRONG BYTES against the reference: not timed")
                    continue
                ms = time_ms(fn, n)
                byts = S * PER_TOKEN
                frac = byts / (ms * 1e-3) / bw
                results.setdefault((op, S), []).append((name, frac, ms))
                print(f"{op:<7} {S:>7} {name:<22} {ms * 1e3:>8.1f} {byts / (ms * 1e-3) / 1e9:>6.0f} {frac:>8.1%}", flush=True)
        sets.clear()
        del want_cache, want_out
        empty_cache()

    print(f"\nsummary (kernel time by graph replay, % of {bw / 1e12:.2f} TB/s copy; every timed variant byte-exact):")
    for (op, S), rows in results.items():
        default = rows[0] if rows[0][0] == next(iter(INSERT_VARIANTS if op == "insert" else GATHER_VARIANTS)) else None
        best = max(rows, key=lambda r: r[1])
        d = f"default {default[0]} {default[1]:.1%} ({default[2] * 1e3:.1f} us)" if default else "default not timed"
        print(
            f"  {op:<6} S={S:>6}: {d}; best {best[0]} {best[1]:.1%} ({best[2] * 1e3:.1f} us)"
            + ("  [>= 80 %]" if best[1] >= 0.8 else "")
        )
    for (op, name), why in skip.items():
        print(f"  skipped {op} {name}: {why}")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    assert dsv4ref.DEVICE.type != "cpu", "GPU only"
    main()
