"""GPU-only companion of ``python -m dsv4ref bench kv_cache``: separates kernel time from host launch time.

The harness times ONE call between two device events after a synchronize, so the host's launch cost
(Python, the torch.library dispatcher, Triton's launcher) is inside the measurement whenever it is longer
than the GPU's idle gap. For a ~30 µs kernel that matters. This script times the same kernels three ways:

* ``event``: one call per timed region, like the harness (what a caller sees for an isolated call);
* ``b2b``:   50 calls back to back between two events (host launches overlap GPU work);
* ``graph``: the calls captured once in a device graph and replayed (kernel time only, no host cost;
  ``dsv4ref.tools.harness.time_ms``, what ``python -m dsv4ref bench`` reports);

over tokens per program ∈ {1, 2, 4, 8} × num_warps ∈ {1, 2, 4}, for S = 64k and 256k slots, rotating 4 input sets (> 60 MB L2).

    PYTHONPATH=. python3 benchmarks/experiments/kv_cache_sweep.py
"""

from __future__ import annotations

import statistics

import torch

import dsv4ref
from dsv4ref import kv_cache as kc
from dsv4ref.device import DEVICE, Timer, describe, synchronize
from dsv4ref.kv_cache.launch import KVCacheLaunch, default_launch, kv_gather_op, kv_insert_op, launch_gather, launch_insert
from dsv4ref.tools.harness import measure_ceilings, time_ms


def make_sets(S: int, B: int = 64, n_sets: int = 4):
    sets = []
    for i in range(n_sets):
        g = torch.Generator(device=DEVICE).manual_seed(i)
        kv = torch.randn(S, 512, device=DEVICE, dtype=torch.bfloat16, generator=g)
        slots = torch.randperm(S, device=DEVICE, generator=g)
        cache = kc.allocate(S // B, B)
        kc.insert(cache, kv, slots, block_size=B)
        sets.append((cache, kv, slots, torch.empty_like(kv)))
    return sets


def t_event(fn, n_sets):
    return time_ms(fn, n_sets, graph=False)  # one call per timed region


def t_graph(fn, n_sets):
    return time_ms(fn, n_sets)  # replay of a device graph holding one call per input set


def t_b2b(fn, n_sets, calls=50, reps=5):
    for i in range(5):
        fn(i % n_sets)
    synchronize()
    ts = []
    for _ in range(reps):
        with Timer() as t:
            for i in range(calls):
                fn(i % n_sets)
        ts.append(t.ms / calls)
    return statistics.median(ts)


def main():
    print(describe())
    ceil = measure_ceilings()
    bw = ceil.copy_bytes_per_s
    print(f"copy bandwidth (read + write) measured now: {bw / 1e12:.3f} TB/s")
    B = 64
    per_tok = 1024 + 8 + kc.TOKEN_BYTES  # insert and gather move the same bytes per token
    print(f"{'op':<8} {'S':>7} {'tok':>3} {'warps':>5} {'via':<7} {'time us':>9} {'GB/s':>7} {'of copy':>8}  exact")
    for S in (65536, 262144):
        sets = make_sets(S, B)
        n = len(sets)
        c0, kv0, sl0, _ = sets[0]
        ref_cache = kc.allocate(S // B, B)
        kc.insert(ref_cache, kv0, sl0, block_size=B, backend="reference")
        ref_out = kc.gather(ref_cache, sl0, block_size=B, backend="reference")
        for op in ("insert", "gather"):
            for tok in (1, 2, 4, 8):
                for w in (1, 2, 4):
                    if op == "insert":

                        def fn(i, w=w, tok=tok):
                            c, kv, sl, _ = sets[i]
                            launch_insert(c, kv, sl, B, KVCacheLaunch(tok, w))
                    else:

                        def fn(i, w=w, tok=tok):
                            c, _, sl, out = sets[i]
                            launch_gather(c, sl, out, B, KVCacheLaunch(tok, w))

                    row = []
                    for via, timer in (("event", t_event), ("graph", t_graph)):
                        ms = timer(fn, n)
                        row.append((via, ms))
                    # what was timed is exact: set 0 against the torch reference
                    if op == "insert":
                        exact = torch.equal(sets[0][0], ref_cache)
                    else:
                        exact = torch.equal(sets[0][3].view(torch.int16), ref_out.view(torch.int16))
                    for via, ms in row:
                        byts = S * per_tok
                        print(
                            f"{op:<8} {S:>7} {tok:>3} {w:>5} {via:<7} {ms * 1e3:>9.1f} {byts / (ms * 1e-3) / 1e9:>7.0f} "
                            f"{byts / (ms * 1e-3) / bw:>8.1%}  {exact}"
                        )
        # the custom-op path the harness times (dispatcher + launcher, the measured defaults)
        for op, fn in (
            ("insert*", lambda i: kv_insert_op(sets[i][0], sets[i][1], sets[i][2], B, *default_launch("insert").op_args())),
            ("gather*", lambda i: kv_gather_op(sets[i][0], sets[i][2], sets[i][3], B, *default_launch("gather").op_args())),
        ):
            for via, timer in (("event", t_event), ("b2b", t_b2b)):
                ms = timer(fn, n)
                byts = S * per_tok
                print(
                    f"{op:<8} {S:>7} {'def':>3} {'def':>5} {via:<7} {ms * 1e3:>9.1f} {byts / (ms * 1e-3) / 1e9:>7.0f} "
                    f"{byts / (ms * 1e-3) / bw:>8.1%}"
                )
        sets.clear()  # free the input sets before the next size
        del ref_cache, ref_out


if __name__ == "__main__":
    assert dsv4ref.DEVICE.type != "cpu", "GPU only"
    main()
