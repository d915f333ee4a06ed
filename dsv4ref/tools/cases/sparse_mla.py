"""``python -m dsv4ref check sparse_mla`` / ``bench sparse_mla``: sparse MLA decode's check rows and benchmark cases.

The bench cases are the rungs of notebook 04's ladder, all on the same inputs: the seed's structure
(``sparse_mla.seed``), the clean two-pass path (``sparse_mla.two_pass``), the fused kernel with one program
per (token, head block) (``sparse_mla.fused[split=1]``), the fused kernel with its default list split
(``sparse_mla.fused``: flash-decoding) and, on Hopper, the warp-specialised Gluon kernel
(``sparse_mla.gluon``). :func:`write_ladder` runs them and writes ``benchmarks/sparse_mla_ladder.json``,
the data of the notebook's roofline chart.

Also used by ``benchmarks/sparse_mla_sweep.py``: :data:`BENCH_SHAPES`, :func:`bench_inputs`, :func:`bench_counts`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib

import torch

from ... import kv_cache, sparse_mla
from ...device import DEVICE, describe, interpreting
from ...formats import HEAD_DIM, TOKEN_BYTES
from ...sparse_mla import reference
from ...sparse_mla.launch import default_launch, fused_decode, workspace
from ...sparse_mla.two_pass import seed_decode, seed_plan, two_pass_decode
from ...tolerances import compare
from ..harness import BenchCase, CheckRow, bench, check, run_benches

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
        for name, fn in (("seed", seed_decode), ("two_pass", two_pass_decode), ("triton", fused_decode)):
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


def _gluon():
    """The Gluon module where it can run here (compiled Triton with Gluon on a Hopper GPU), else None."""
    try:
        from ...sparse_mla import gluon
    except Exception:  # noqa: BLE001 - an incompatible Triton: the rung is reported missing, not fatal
        return None
    return gluon if gluon.available(DEVICE) else None


@bench("sparse_mla")
def _bench() -> list[BenchCase]:
    cases = []
    shapes = [(T, H, K, bench_inputs(T, H, K, n_sets_for(T, K), DEVICE)) for T, H, K in BENCH_SHAPES]
    # the two-pass workspace is shared: size it for the largest shape BEFORE any graph captures it, so no
    # captured graph keeps a pointer to a workspace that a later, larger shape replaced
    workspace(max(T * K for T, _, K, _ in shapes), DEVICE)
    gluon = _gluon()
    for T, H, K, sets in shapes:
        byts, flops = bench_counts(T, H, K)
        launch = default_launch(T, H, K, DEVICE)
        one = dataclasses.replace(launch, num_splits=1)
        shape = f"T={T} H={H} K={K} split={launch.num_splits}"
        dims = dict(T=T, H=H, K=K)
        scale = sparse_mla.DEFAULT_SCALE
        # the seed's host loop runs once per input set, outside the timing: the figures count
        # device work only (its per-token gathers and the attention)
        plans = [seed_plan(s["slots"], s["lengths"], s["extra_slots"], s["extra_lengths"]) for s in sets]
        # no validation, no host sync on these paths: the harness can capture them in a device graph
        seed = lambda i, s=sets, p=plans, L=launch: seed_decode(**s[i], scale=scale, launch=L, plan=p[i])  # noqa: E731
        two = lambda i, s=sets, L=launch: two_pass_decode(**s[i], scale=scale, launch=L)  # noqa: E731
        fused1 = lambda i, s=sets, L=one: fused_decode(**s[i], scale=scale, launch=L)  # noqa: E731
        fused = lambda i, s=sets, L=launch: fused_decode(**s[i], scale=scale, launch=L)  # noqa: E731
        cases.append(BenchCase("sparse_mla.seed", shape, seed, len(sets), byts, flops, extra=dims,
                               note="the seed's structure: a gather launch per token and pool, then bf16 attention"))
        cases.append(BenchCase("sparse_mla.two_pass", shape, two, len(sets), byts, flops, extra=dims,
                               note="same compulsory bytes; really moves ~2632 B/row (584 + 2·1024 workspace)"))
        cases.append(BenchCase("sparse_mla.fused[split=1]", f"T={T} H={H} K={K} split=1", fused1, len(sets), byts,
                               flops, extra=dims, note="the fused kernel, one program per (token, head block)"))
        cases.append(BenchCase("sparse_mla.fused", shape, fused, len(sets), byts, flops, extra=dims,
                               note="584+4 B/row + q,out bf16 + lse; FLOP 2·H·K·1024",
                               reference=(lambda kw: reference.decode(**kw), lambda i, s=sets: (s[i],))))
        if gluon is not None:
            g = lambda i, s=sets: gluon.decode_gluon(**s[i], scale=scale)  # noqa: E731
            cases.append(BenchCase("sparse_mla.gluon", f"T={T} H={H} K={K}", g, len(sets), byts, flops, extra=dims,
                                   note="warp-specialised Hopper kernel (dsv4ref/sparse_mla/gluon.py)"))
    return cases


# ----------------------------------------------------------------------------------------------------
# the ladder file: notebook 04's roofline chart
# ----------------------------------------------------------------------------------------------------

LADDER_PATH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "sparse_mla_ladder.json"
#: (key, bench op, label) of each rung, in ladder order
RUNGS = (
    ("seed", "sparse_mla.seed", "seed: per-token gathers into bf16, then bf16 attention"),
    ("two_pass", "sparse_mla.two_pass", "clean two-pass: one gather launch, then bf16 attention"),
    ("fused", "sparse_mla.fused[split=1]", "fused: FP8 pages read once, one program per (token, head block)"),
    ("split", "sparse_mla.fused", "fused + split list (flash-decoding): the default"),
    ("gluon", "sparse_mla.gluon", "warp-specialised Hopper kernel (Gluon)"),
)


def ladder(ceil, rows, *, device: str, command: str) -> dict:
    """The ladder file's content from one benchmark run: ceilings, the shapes with their compulsory bytes
    and FLOPs, and per rung the µs per shape (None where the rung did not run)."""
    shapes = [dict(T=T, H=H, K=K, bytes=bench_counts(T, H, K)[0], flops=bench_counts(T, H, K)[1],
                   splits=default_launch(T, H, K, DEVICE).num_splits) for T, H, K in BENCH_SHAPES]
    us = {(r.case.op, r.case.extra.get("T"), r.case.extra.get("H"), r.case.extra.get("K")): r.ms * 1e3 for r in rows}
    rungs = []
    for key, op, label in RUNGS:
        vals = [us.get((op, s["T"], s["H"], s["K"])) for s in shapes]
        rungs.append(dict(key=key, label=label, bench_op=op, us=[None if v is None else round(v, 1) for v in vals],
                          status="measured" if all(v is not None for v in vals) else "pending",
                          source=f"{command} ({datetime.date.today().isoformat()})"))
    return dict(device=device, date=datetime.date.today().isoformat(), command=command,
                ceilings=dict(copy_bytes_per_s=ceil.copy_bytes_per_s, bf16_flops_per_s=ceil.bf16_flops_per_s),
                accounting="bytes: T·(K·(584 + 4) + H·512·2·2 + H·4 + 8); FLOP: T·2·H·K·(512 + 512); bound = "
                           "max(bytes / copy, FLOP / bf16 matmul); times: median device-graph replay",
                shapes=shapes, rungs=rungs, others=_compiled_reference(us, shapes, command))


def _compiled_reference(us: dict, shapes: list[dict], command: str) -> list[dict]:
    """The reference under torch.compile, when the run timed it (bench rows ``sparse_mla.fused[torch.compile]``):
    drawn beside the rungs, not one of them."""
    vals = [us.get(("sparse_mla.fused[torch.compile]", s["T"], s["H"], s["K"])) for s in shapes]
    if any(v is None for v in vals):
        return []
    return [dict(key="torch_compile", label="torch.compile of the reference", us=[round(v, 1) for v in vals],
                 status="measured", source=f"{command} ({datetime.date.today().isoformat()}): the fp32 reference "
                                           "compiled with static shapes, timed with device events")]


def write_ladder(path=LADDER_PATH, *, device: str = "", command: str = "dsv4ref.tools.cases.sparse_mla.write_ladder()",
                 measured=None):
    """Run every rung's bench case on this GPU (or take ``measured`` = ``(ceilings, rows)`` of a bench run
    that included them) and write the ladder file (default ``benchmarks/sparse_mla_ladder.json``); the
    file's ``others`` (figures from other runs, each with its source) are kept. Returns the content written."""
    ceil, rows = measured or run_benches("sparse_mla")
    data = ladder(ceil, rows, device=device or describe(), command=command)
    old = pathlib.Path(path)
    if old.exists() and not data["others"]:  # figures this run did not measure keep their own source
        data["others"] = json.loads(old.read_text()).get("others", [])
    pathlib.Path(path).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return data
