"""GPU-only probe (one device call, ~1 min): how fast can one program per SM gather FP8 cache rows into
shared memory when the rows travel by cp.async, with D chunks of 64 rows in flight and no register held
for them?

Why (benchmarks/sparse_mla.md, "Diagnostics and probes"): the Gluon sparse MLA producers take ~2.3 µs (4 warps) and
~2.0 µs (8 warps) per 64-candidate chunk when timed without any MMA, against ~1.2 µs of row bytes per SM at
the copy ceiling; their rows travel through registers, one or two half chunks in flight. The redesign
named there (a raw FP8 ring in shared memory, several chunks ahead) costs a K stage of shared memory. This
probe measures what it would buy before anyone builds it: the gather alone, at the rows the decode kernel
reads (the real cache layout of ``dsv4ref.kv_cache``: 576 bytes of a row's NoPE + RoPE, 8 scale bytes
elsewhere in its page), for D = 1..4 chunks in flight and 4 or 8 warps, with every chunk read back from
shared memory once (as a dequantising producer would).

    PYTHONPATH=. python3 benchmarks/experiments/gather_probe.py              # on the GPU
    PYTHONPATH=. python3 benchmarks/experiments/gather_probe.py --compile    # CPU: compile every variant for sm_90a

Prints, per (rows per program, D, warps): µs per call, µs per chunk per program, the achieved bytes/s
(584 B per row) and its fraction of the copy ceiling measured in the same call, and the checksum test (the
XOR of every word the kernel read equals torch's).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if "--compile" in sys.argv[1:]:  # on a CPU box: the kernel defined for compiling, not for the interpreter
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # benchmarks/aot.py
    import aot  # noqa: F401

# Gluon and the names that moved between Triton releases, as the decode kernels import them
from dsv4ref.sparse_mla.gluon.lang import IMPORT_ERROR, _async_load, _bar, _gluon as gluon, async_copy, gl  # noqa: E402

if gluon is None:
    sys.exit(f"needs Triton with Gluon: {IMPORT_ERROR!r}")

ROW_WORDS = 72  # 576 bytes of NoPE (448) + RoPE (128) per row, as int64 words: 64 + 8
BS = 64  # rows per page
PROGRAMS = 128  # one per SM at T 64 with the list split in two (H 64) or two head blocks (H 128)


@gluon.jit
def gather_kernel(
    cache_ptr, slots_ptr, xor_ptr, n_rows, page_words, D: gl.constexpr, BS: gl.constexpr, SCALES: gl.constexpr = True
):
    """Program p gathers rows ``slots[p, :n_rows]`` of the int64-word cache (pages of ``page_words`` words:
    BS rows of 72 words, then BS scale words) chunk by chunk into a D-deep shared ring by cp.async, keeping
    D chunks in flight, reads each landed chunk back once and XORs it into ``xor[p]``. SCALES False: the
    rows' scale words are not fetched (their XOR is left out).

    cache_ptr int64 [pages · page_words]; slots_ptr int32 [programs, n_rows] (n_rows % 64 == 0);
    xor_ptr int64 [programs]."""
    NW: gl.constexpr = gl.num_warps()
    LA: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [NW, 1], [1, 0])  # [64, 64] words, 16 B per copy
    LS: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])  # [64] scale words
    SL: gl.constexpr = gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[1, 0])
    S1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    ring_a = gl.allocate_shared_memory(gl.int64, [D, 64, 64], SL)
    ring_b = gl.allocate_shared_memory(
        gl.int64, [D, 64, 8], gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=4, order=[1, 0])
    )
    ring_s = gl.allocate_shared_memory(gl.int64, [D, 64], S1)
    LB8: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [NW, 1], [1, 0])  # [64, 8] words
    pid = gl.program_id(0)
    base = slots_ptr + pid.to(gl.int64) * n_rows
    ra = gl.arange(0, 64, gl.SliceLayout(1, LA))
    ca = gl.arange(0, 64, gl.SliceLayout(0, LA))
    rb = gl.arange(0, 64, gl.SliceLayout(1, LB8))
    cb = gl.arange(0, 8, gl.SliceLayout(0, LB8))
    rs = gl.arange(0, 64, LS)
    acc_a = gl.zeros([64, 64], gl.int64, LA)
    acc_b = gl.zeros([64, 8], gl.int64, LB8)
    acc_s = gl.zeros([64], gl.int64, LS)
    n_it = n_rows // 64
    nxt_a = gl.load(base + ra)  # the first chunk's slots; each iteration fetches the next one's
    nxt_b = gl.load(base + rb)
    nxt_s = gl.load(base + rs)
    for it in range(n_it + D - 1):
        if it < n_it:
            sa = nxt_a.to(gl.int64)
            sb = nxt_b.to(gl.int64)
            ss = nxt_s.to(gl.int64)
            more = it + 1 < n_it
            nxt_a = gl.load(base + (it + 1) * 64 + ra, mask=more & (ra >= 0), other=0)
            nxt_b = gl.load(base + (it + 1) * 64 + rb, mask=more & (rb >= 0), other=0)
            nxt_s = gl.load(base + (it + 1) * 64 + rs, mask=more & (rs >= 0), other=0)
            st = it % D
            row_a = (sa // BS) * page_words + (sa % BS) * 72
            row_b = (sb // BS) * page_words + (sb % BS) * 72
            _async_load(ring_a.index(st), cache_ptr + row_a[:, None] + ca[None, :])
            _async_load(ring_b.index(st), cache_ptr + row_b[:, None] + 64 + cb[None, :])
            if SCALES:
                _async_load(ring_s.index(st), cache_ptr + (ss // BS) * page_words + BS * 72 + ss % BS)
        async_copy.commit_group()  # (an empty group past the last chunk keeps the count simple)
        if it >= D - 1:
            async_copy.wait_group(D - 1)  # the chunk issued D - 1 iterations ago has landed
            _bar()
            c = (it - (D - 1)) % D
            acc_a = acc_a ^ ring_a.index(c).load(LA)
            acc_b = acc_b ^ ring_b.index(c).load(LB8)
            if SCALES:
                acc_s = acc_s ^ ring_s.index(c).load(LS)
            _bar()  # every thread has read the stage before it is refilled
    x = gl.xor_sum(gl.xor_sum(acc_a, axis=1), axis=0) ^ gl.xor_sum(gl.xor_sum(acc_b, axis=1), axis=0)
    x = x ^ gl.xor_sum(acc_s, axis=0)
    gl.store(xor_ptr + pid, x)


VARIANTS = [(d, w) for w in (4, 8) for d in (1, 2, 3, 4)]
# second pass, at D 2 and 4 warps: what the row pattern costs. "random": distinct rows anywhere (the decode
# bench's pattern); "sorted": the same rows, each program's list ascending; "contiguous": each program reads
# consecutive rows (whole pages); "no scales": random rows without their scale words
PATTERNS = ("random", "sorted", "contiguous", "random, no scales")
# third pass: the same bytes over twice the programs (half the rows each; two per SM fit at D 2): is the cap
# per program (its copies in flight) or per device?
SPREAD = (
    ("random", 2, 4, 2),
    ("contiguous", 2, 4, 2),
    ("random", 1, 8, 2),  # where the rows split in whole chunks
    # fourth pass (call 6): warps per SM or programs per SM? (at 16 warps the [64, 8] tail and the scale
    # words are copied by more threads than they have elements: the layouts replicate them)
    ("random", 2, 8, 2),
    ("random", 2, 16, 1),
    ("random", 1, 16, 1),
    ("contiguous", 2, 16, 1),
    # fifth pass (call 10): what makes 256 programs x 8 warps x one chunk fast (80-84 %)?
    ("random", 1, 4, 2),
    ("random", 1, 8, 3),
    ("random, no scales", 1, 8, 2),
    ("contiguous", 1, 8, 2),
)
ROWS = (320, 1152)  # rows per program: H 64 K 640 split 2, H 128 K 1152


def _compile_only():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {
        "cache_ptr": "*i64",
        "slots_ptr": "*i32",
        "xor_ptr": "*i64",
        "n_rows": "i32",
        "page_words": "i32",
        "D": "constexpr",
        "BS": "constexpr",
        "SCALES": "constexpr",
    }
    for d, w, scales in [(d, w, True) for d, w in VARIANTS] + [(2, 4, False)]:
        src = GluonASTSource(
            gather_kernel,
            sig,
            {"D": d, "BS": BS, "SCALES": scales},
            {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
        )
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": w})
        print(f"D {d} warps {w} scales {scales}: shared {ck.metadata.shared} B", flush=True)


def _slot_sets(pattern: str, perm: torch.Tensor, n_rows: int, dev, programs: int = PROGRAMS) -> list[torch.Tensor]:
    """2-4 slot tables [programs, n_rows] int32 of distinct rows (together past the L2) in ``pattern``."""
    n = programs * n_rows
    n_sets = max(2, min(4, perm.numel() // n))
    if pattern.startswith("contiguous"):
        return [torch.arange(i * n, (i + 1) * n, dtype=torch.int32).view(programs, n_rows).to(dev) for i in range(n_sets)]
    sets = [perm[i * n : (i + 1) * n].view(programs, n_rows) for i in range(n_sets)]
    if pattern.startswith("sorted"):
        sets = [x.sort(dim=1).values for x in sets]
    return [x.contiguous().to(dev) for x in sets]


def _expected_xor(words: torch.Tensor, pages: int, slots: torch.Tensor, scales: bool) -> torch.Tensor:
    """What the kernel must XOR together per program: the 72 row words (and the scale word) of each row."""
    flat = words.view(pages, -1)
    sl = slots.long()
    pg, off = sl // BS, sl % BS
    cols = torch.arange(ROW_WORDS, device=slots.device)
    row = flat[pg.unsqueeze(-1), off.unsqueeze(-1) * ROW_WORDS + cols]  # [P, n, 72]
    x = _xor_reduce(_xor_reduce(row))
    return x ^ _xor_reduce(flat[pg, BS * ROW_WORDS + off]) if scales else x


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="compile every variant for sm_90a, no GPU")
    args = ap.parse_args(argv)
    if args.compile:
        _compile_only()
        return 0
    from dsv4ref import kv_cache
    from dsv4ref.device import DEVICE, describe, synchronize
    from dsv4ref.tools.harness import measure_ceilings, time_ms

    if DEVICE.type != "cuda":  # a Gluon kernel for NVIDIA GPUs
        sys.exit(f"no CUDA device ({DEVICE}): nothing timed (use --compile on a CPU)")
    dev = DEVICE
    ceil = measure_ceilings()
    print(f"{describe()}; copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s", flush=True)
    pages = 8192  # 8192 × 64 rows × 584 B ≈ 306 MB: every set below misses the 60 MB L2
    cache = kv_cache.allocate(pages, BS, device=dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    cache.copy_(torch.randint(0, 256, cache.shape, generator=g, dtype=torch.uint8).to(dev))
    words = cache.view(torch.int64)
    page_words = cache.stride(0) // 8
    assert cache.stride(0) % 8 == 0 and cache.is_contiguous()
    perm = torch.randperm(pages * BS, generator=g).to(torch.int32)
    runs = [("random", d, w, 1) for d, w in VARIANTS] + [(p, 2, 4, 1) for p in PATTERNS[1:]] + list(SPREAD)
    bad = 0
    t0 = time.time()
    for rows_total in ROWS:
        for pattern, d, w, spread in runs:
            if rows_total % (64 * spread):
                continue
            scales = "no scales" not in pattern
            programs, n_rows = PROGRAMS * spread, rows_total // spread
            sets = _slot_sets(pattern, perm, n_rows, dev, programs)
            want = _expected_xor(words, pages, sets[0], scales)
            xo = torch.zeros(programs, dtype=torch.int64, device=dev)

            def call(i, d=d, w=w, xo=xo, sets=sets, scales=scales, programs=programs, n_rows=n_rows):
                gather_kernel[(programs,)](
                    words, sets[i % len(sets)], xo, n_rows, page_words, D=d, BS=BS, SCALES=scales, num_warps=w
                )

            call(0)
            synchronize()
            ok = bool(torch.equal(xo, want))
            bad += not ok
            ms = time_ms(call, n_sets=len(sets))
            us = ms * 1e3
            bw = programs * n_rows * (584 if scales else 576) / (ms * 1e-3)
            print(
                f"programs {programs:3d} x rows {n_rows:5d}  {pattern:<18} D {d}  warps {w}: {us:7.1f} us  "
                f"{us / (n_rows // 64):5.2f} us/chunk  {bw / 1e9:6.0f} GB/s  {bw / ceil.copy_bytes_per_s:6.1%} of copy  "
                f"xor {'ok' if ok else 'WRONG'}",
                flush=True,
            )
    print(f"{len(ROWS) * len(runs)} runs timed in {time.time() - t0:.0f} s; {bad} wrong", flush=True)
    return 1 if bad else 0


def _xor_reduce(x: torch.Tensor) -> torch.Tensor:
    """XOR over the last dim (int64), by halving (zero-padded to an even length)."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = torch.cat([x, torch.zeros_like(x[..., :1])], -1)
        h = x.shape[-1] // 2
        x = x[..., :h] ^ x[..., h:]
    return x[..., 0]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
