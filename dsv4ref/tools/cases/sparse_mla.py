"""``python -m dsv4ref check sparse_mla`` / ``bench sparse_mla``: sparse MLA decode's check rows and benchmark cases.

Also used by ``benchmarks/sparse_mla_sweep.py``: :data:`BENCH_SHAPES`, :func:`bench_inputs`, :func:`bench_counts`.
"""

from __future__ import annotations

import math

import torch

from ... import kv_cache, sparse_mla
from ...device import DEVICE, interpreting
from ...formats import HEAD_DIM, TOKEN_BYTES
from ...sparse_mla import reference
from ...sparse_mla.launch import default_launch, fused_decode, workspace
from ...sparse_mla.two_pass import two_pass_decode
from ...tolerances import compare
from ..harness import BenchCase, CheckRow, bench, check

# The shapes (T, H, K): T = 64 decode tokens; the window pool (128 slots, pages of 64) plus the
# compressed pool (the rest, pages of 64), every entry valid.
BENCH_SHAPES = ((64, 64, 640), (64, 128, 1152), (64, 16, 2048))
L2_BYTES = 60e6  # the H200's L2, rounded up: input sets rotate past it
WINDOW = 128


@check("sparse_mla.decode")
def _check_decode() -> list[CheckRow]:
    rows = []
    # (T, H, K1, K2, block_size, extra_block_size, pages, extra_pages)
    shapes = [(3, 16, 40, 10, 16, 2, 4, 24), (2, 64, 24, 0, 16, 2, 3, 0)]
    if not interpreting():
        shapes += [(16, 64, 128, 512, 64, 64, 40, 160), (8, 128, 128, 1024, 64, 2, 40, 4096)]
    for T, H, K1, K2, b1, b2, p1, p2 in shapes:
        inputs = sparse_mla.example_inputs(T, H, K1, K2, block_size=b1, extra_block_size=b2, pages=p1, extra_pages=p2,
                                           seed=T + H)
        ref_out, ref_lse, mass = reference.decode(**inputs, with_mass=True)
        for name, fn in (("two_pass", two_pass_decode), ("triton", fused_decode)):
            out, lse = fn(**inputs, scale=sparse_mla.DEFAULT_SCALE)
            shape = f"{name} T={T} H={H} K={K1}+{K2}"
            rows.append(CheckRow("sparse_mla.decode", shape + " out", compare(out, ref_out, "bf16_weighted_sum", mass=mass)))
            rows.append(CheckRow("sparse_mla.decode", shape + " lse", compare(lse, ref_lse, "lse")))
    return rows


def bench_inputs(T: int, H: int, K: int, n_sets: int, device) -> list[dict]:
    """``n_sets`` independent sets of :func:`dsv4ref.sparse_mla.decode` keyword arguments: the window pool
    (128 entries) and the compressed pool (K − 128), pages of 64, every entry valid. Every (token,
    candidate) reads a distinct row of a cache that holds exactly T·K rows, so nothing is served twice
    from L2 within a call, and the sets rotate past it."""
    sets = []
    for s in range(n_sets):
        pools = []
        for i, Kp in enumerate((WINDOW, K - WINDOW)):
            n = T * Kp
            cache = kv_cache.allocate(n // 64, 64, device=device)
            kv_cache.insert(cache, torch.randn(n, HEAD_DIM, device=device, dtype=torch.bfloat16),
                            torch.arange(n, device=device), block_size=64)
            g = torch.Generator().manual_seed(1000 * s + i)
            slots = torch.randperm(n, generator=g).to(torch.int32).view(T, Kp).to(device)
            pools.append((cache, slots, torch.full((T,), Kp, dtype=torch.int32, device=device)))
        (c1, s1, l1), (c2, s2, l2) = pools
        sets.append(dict(q=torch.randn(T, H, HEAD_DIM, device=device, dtype=torch.bfloat16), cache=c1, slots=s1,
                         lengths=l1, block_size=64, sink=torch.randn(H, device=device), extra_cache=c2, extra_slots=s2,
                         extra_lengths=l2, extra_block_size=64))
    return sets


def bench_counts(T: int, H: int, K: int) -> tuple[int, int]:
    """Compulsory bytes (584 B per selected row + a 4-byte slot; q and out in bf16; lse fp32; lengths) and
    useful FLOPs (QKᵀ and P·V, 512 wide each, the real H)."""
    byts = T * (K * (TOKEN_BYTES + 4) + H * HEAD_DIM * 2 * 2 + H * 4 + 2 * 4)
    flops = T * 2 * H * K * (HEAD_DIM + HEAD_DIM)
    return byts, flops


def n_sets_for(T: int, K: int) -> int:
    """Input sets to rotate so that their caches together exceed the L2 2.5 times."""
    return max(2, math.ceil(2.5 * L2_BYTES / (T * K * (kv_cache.page_bytes(64) / 64))))


@bench("sparse_mla")
def _bench() -> list[BenchCase]:
    cases = []
    shapes = [(T, H, K, bench_inputs(T, H, K, n_sets_for(T, K), DEVICE)) for T, H, K in BENCH_SHAPES]
    # the two-pass workspace is shared: size it for the largest shape BEFORE any graph captures it, so no
    # captured graph keeps a pointer to a workspace that a later, larger shape replaced
    workspace(max(T * K for T, _, K, _ in shapes), DEVICE)
    for T, H, K, sets in shapes:
        byts, flops = bench_counts(T, H, K)
        launch = default_launch(T, H, K, DEVICE)
        shape = f"T={T} H={H} K={K} split={launch.num_splits}"
        # no validation, no host sync on these paths: the harness can capture them in a device graph
        fused = lambda i, s=sets, L=launch: fused_decode(**s[i], scale=sparse_mla.DEFAULT_SCALE, launch=L)  # noqa: E731
        two = lambda i, s=sets, L=launch: two_pass_decode(**s[i], scale=sparse_mla.DEFAULT_SCALE, launch=L)  # noqa: E731
        cases.append(BenchCase("sparse_mla.fused", shape, fused, len(sets), byts, flops,
                               note="584+4 B/row + q,out bf16 + lse; FLOP 2·H·K·1024"))
        cases.append(BenchCase("sparse_mla.two_pass", shape, two, len(sets), byts, flops,
                               note="same compulsory bytes; really moves ~2632 B/row (584 + 2·1024 workspace)"))
    return cases
