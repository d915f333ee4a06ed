"""``python -m dsv4ref check sparse_mla`` / ``bench sparse_mla``: sparse MLA decode's check rows and benchmark cases.

The bench cases are the rungs of notebook 04's ladder, all on the same inputs: the seed's structure
(``sparse_mla.seed``), the clean two-pass path (``sparse_mla.two_pass``), the fused kernel with one program
per (token, head block) (``sparse_mla.fused[split=1]``), the fused kernel with its default list split
(``sparse_mla.fused``: flash-decoding) and, on Hopper, the warp-specialised Gluon kernel
(``sparse_mla.gluon``). :func:`write_ladder` runs them and writes ``benchmarks/sparse_mla_ladder.json``,
the data of the notebook's roofline chart.

The peer: where ``flash_mla`` imports on a Hopper GPU (:func:`dsv4ref.tools.peers.flashmla.available`), FlashMLA's
SM90 kernel (``sparse_mla.flashmla``) is timed on every shape of :data:`GRID_SHAPES`, on the same input sets as
ours, in the same run; ``bench`` then prints our time over FlashMLA's per shape (:func:`peer_ratios`), and the
ladder file keeps both (keys ``peer`` and ``peer_grid``). Otherwise one line says why it was skipped. The
grid's shapes other than the ladder's three time only what ``backend="auto"`` runs (``sparse_mla.gluon`` on
Hopper, ``sparse_mla.fused`` elsewhere) and the peer.

Also used by ``benchmarks/experiments/sparse_mla_sweep.py``: :data:`BENCH_SHAPES`, :func:`bench_inputs`, :func:`bench_counts`.
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
from ..harness import BenchCase, CheckRow, bench, check, run_benches, summary
from ..peers import flashmla

# The shapes (T, H, K): T = 64 decode tokens; the window pool (128 slots, pages of 64) plus the
# compressed pool (the rest, pages of 64), every entry valid.
BENCH_SHAPES = ((64, 64, 640), (64, 128, 1152), (64, 16, 2048))
# The peer comparison's grid (T, H, K), the ladder's three shapes included: T 1 … 256 decode tokens, H 16 / 64 /
# 128 heads, K 640 / 1152 / 2176 candidates (128 window + 512 / 1024 / 2048 compressed) and the ladder's 2048.
GRID_SHAPES = (
    (1, 64, 640),
    (1, 128, 2176),
    (8, 64, 640),
    (8, 128, 1152),
    (8, 128, 2176),
    (64, 64, 640),
    (64, 64, 2176),
    (64, 128, 640),
    (64, 128, 1152),
    (64, 128, 2176),
    (64, 16, 2048),
    (256, 64, 640),
    (256, 64, 2176),
    (256, 128, 1152),
    (256, 128, 2176),
)
PEER_OP = "sparse_mla.flashmla"
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
        inputs = sparse_mla.example_inputs(T, H, K1, K2, block_size=b1, extra_block_size=b2, pages=p1, extra_pages=p2, seed=T + H)
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
            kv_cache.insert(
                cache,
                torch.randn(n, HEAD_DIM, device=device, dtype=torch.bfloat16),
                torch.arange(n, device=device),
                block_size=64,
            )
            g = torch.Generator().manual_seed(1000 * s + i)
            slots = torch.randperm(n, generator=g).to(torch.int32).view(T, Kp).to(device)
            pools.append((cache, slots, torch.full((T,), Kp, dtype=torch.int32, device=device)))
        (c1, s1, l1), (c2, s2, l2) = pools
        sets.append(
            dict(
                q=torch.randn(T, H, HEAD_DIM, device=device, dtype=torch.bfloat16),
                cache=c1,
                slots=s1,
                lengths=l1,
                block_size=64,
                sink=torch.randn(H, device=device),
                extra_cache=c2,
                extra_slots=s2,
                extra_lengths=l2,
                extra_block_size=64,
            )
        )
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


def bench_grid() -> list[tuple[int, int, int]]:
    """The shapes ``bench sparse_mla`` times: the ladder's three first (every rung), then the rest of
    :data:`GRID_SHAPES` (ours and the peer)."""
    return list(BENCH_SHAPES) + [s for s in GRID_SHAPES if s not in BENCH_SHAPES]


def _gluon_case(gluon, T, H, K, sets, byts, flops, dims) -> BenchCase:
    g = lambda i, s=sets: gluon.decode_gluon(**s[i], scale=sparse_mla.DEFAULT_SCALE)  # noqa: E731
    return BenchCase(
        "sparse_mla.gluon",
        f"T={T} H={H} K={K}",
        g,
        len(sets),
        byts,
        flops,
        extra=dims,
        note="warp-specialised Hopper kernel (dsv4ref/sparse_mla/gluon/)",
    )


def _peer_case(T, H, K, sets, byts, flops, dims) -> BenchCase | None:
    """FlashMLA's kernel on the same input sets: each mapped once and run once here (its scheduler metadata is
    made by that first call), so the timed call launches FlashMLA's kernels only. Set 0's lse is checked
    against our fused kernel's first, so a ratio is never the time of a wrong answer. None (and a FAILED
    line) when the mapping or the first call fails."""
    shape = f"T={T} H={H} K={K}"
    try:
        calls = [flashmla.prepare(**s, scale=sparse_mla.DEFAULT_SCALE) for s in sets]
        _, lse = calls[0].result(calls[0].run())
        rep = compare(lse, fused_decode(**sets[0], scale=sparse_mla.DEFAULT_SCALE)[1], "lse", "lse")
    except Exception as e:  # noqa: BLE001 - the peer failing must not hide our rows
        print(f"{PEER_OP} {shape}: FAILED {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}", flush=True)
        return None
    if not rep.passed:
        print(f"{PEER_OP} {shape}: its lse differs from ours on input set 0 ({rep}); timed all the same", flush=True)
    pad = f"; H {H} runs as {64 if H <= 64 else 128} heads" if H not in flashmla.HEADS else ""
    return BenchCase(
        PEER_OP,
        shape,
        lambda i, c=calls: c[i].run(),
        len(sets),
        byts,
        flops,
        extra=dims,
        note=f"FlashMLA's SM90 kernel ({flashmla.WHEEL}, use_legacy=True), inputs mapped outside the timing{pad}",
    )


@bench("sparse_mla")
def _bench() -> list[BenchCase]:
    cases = []
    shapes = [(T, H, K, bench_inputs(T, H, K, n_sets_for(T, K), DEVICE)) for T, H, K in bench_grid()]
    # the two-pass workspace is shared: size it for the largest shape BEFORE any graph captures it, so no
    # captured graph keeps a pointer to a workspace that a later, larger shape replaced (only the ladder's
    # shapes run the two-pass path)
    workspace(max(T * K for T, H, K, _ in shapes if (T, H, K) in BENCH_SHAPES), DEVICE)
    gluon = _gluon()
    peer, why = flashmla.available(DEVICE)
    if not peer:
        print(f"FlashMLA peer skipped: {why}", flush=True)
    for T, H, K, sets in shapes:
        byts, flops = bench_counts(T, H, K)
        dims = dict(T=T, H=H, K=K)
        if (T, H, K) in BENCH_SHAPES:
            cases += _ladder_cases(T, H, K, sets, gluon)
        elif gluon is not None:  # the rest of the grid: what backend="auto" runs here, beside the peer
            cases.append(_gluon_case(gluon, T, H, K, sets, byts, flops, dims))
        else:
            launch = default_launch(T, H, K, DEVICE)
            fused = lambda i, s=sets, L=launch: fused_decode(**s[i], scale=sparse_mla.DEFAULT_SCALE, launch=L)  # noqa: E731
            cases.append(
                BenchCase(
                    "sparse_mla.fused",
                    f"T={T} H={H} K={K} split={launch.num_splits}",
                    fused,
                    len(sets),
                    byts,
                    flops,
                    extra=dims,
                    note="584+4 B/row + q,out bf16 + lse; FLOP 2·H·K·1024",
                )
            )
        if peer and (c := _peer_case(T, H, K, sets, byts, flops, dims)) is not None:
            cases.append(c)
    return cases


def _ladder_cases(T, H, K, sets, gluon) -> list[BenchCase]:
    """Every rung of the ladder at one of its shapes (and the reference under torch.compile beside the fused
    kernel), on the same input sets."""
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
    cases = [
        BenchCase(
            "sparse_mla.seed",
            shape,
            seed,
            len(sets),
            byts,
            flops,
            extra=dims,
            note="the seed's structure: a gather launch per token and pool, then bf16 attention",
        ),
        BenchCase(
            "sparse_mla.two_pass",
            shape,
            two,
            len(sets),
            byts,
            flops,
            extra=dims,
            note="same compulsory bytes; really moves ~2640 B/row (588 + 2·1024 workspace + the slot again)",
        ),
        BenchCase(
            "sparse_mla.fused[split=1]",
            f"T={T} H={H} K={K} split=1",
            fused1,
            len(sets),
            byts,
            flops,
            extra=dims,
            note="the fused kernel, one program per (token, head block)",
        ),
        BenchCase(
            "sparse_mla.fused",
            shape,
            fused,
            len(sets),
            byts,
            flops,
            extra=dims,
            note="584+4 B/row + q,out bf16 + lse; FLOP 2·H·K·1024",
            reference=(lambda kw: reference.decode(**kw), lambda i, s=sets: (s[i],)),
        ),
    ]
    if gluon is not None:
        cases.append(_gluon_case(gluon, T, H, K, sets, byts, flops, dims))
    return cases


def _times(rows) -> dict:
    """{(bench op, T, H, K): µs} of a run's rows."""
    return {(r.case.op, r.case.extra.get("T"), r.case.extra.get("H"), r.case.extra.get("K")): r.ms * 1e3 for r in rows}


def _ours(us: dict, T: int, H: int, K: int) -> tuple[str, float | None]:
    """What ``backend="auto"`` ran at this shape and its µs: the Gluon kernel where the run timed it, else the
    portable fused one (None when neither ran)."""
    for op in ("sparse_mla.gluon", "sparse_mla.fused"):
        if (op, T, H, K) in us:
            return op, us[(op, T, H, K)]
    return "", None


@summary("sparse_mla")
def peer_ratios(rows) -> list[str]:
    """The lines ``bench`` prints after its table: per grid shape where both ran, our time (what
    ``backend="auto"`` runs) over FlashMLA's, from the same run and the same inputs. No lines without the peer."""
    us, out = _times(rows), []
    for T, H, K in bench_grid():
        op, ours = _ours(us, T, H, K)
        theirs = us.get((PEER_OP, T, H, K))
        if ours is not None and theirs is not None:
            out.append(f"  T={T} H={H} K={K}: {op} {ours:.1f} us / FlashMLA {theirs:.1f} us = {ours / theirs:.2f}")
    head = "sparse_mla: ours / FlashMLA per shape (time ratio, same run, same inputs; above 1 FlashMLA is faster)"
    return [head, *out] if out else []


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
    shapes = [
        dict(
            T=T,
            H=H,
            K=K,
            bytes=bench_counts(T, H, K)[0],
            flops=bench_counts(T, H, K)[1],
            splits=default_launch(T, H, K, DEVICE).num_splits,
        )
        for T, H, K in BENCH_SHAPES
    ]
    us = _times(rows)
    rungs = []
    for key, op, label in RUNGS:
        vals = [us.get((op, s["T"], s["H"], s["K"])) for s in shapes]
        rungs.append(
            dict(
                key=key,
                label=label,
                bench_op=op,
                us=[None if v is None else round(v, 1) for v in vals],
                status="measured" if all(v is not None for v in vals) else "pending",
                source=f"{command} ({datetime.date.today().isoformat()})",
            )
        )
    return dict(
        device=device,
        date=datetime.date.today().isoformat(),
        command=command,
        ceilings=dict(copy_bytes_per_s=ceil.copy_bytes_per_s, bf16_flops_per_s=ceil.bf16_flops_per_s),
        accounting="bytes: T·(K·(584 + 4) + H·512·2·2 + H·4 + 8); FLOP: T·2·H·K·(512 + 512); bound = "
        "max(bytes / copy, FLOP / bf16 matmul); times: median device-graph replay",
        shapes=shapes,
        rungs=rungs,
        others=_compiled_reference(us, shapes, command),
        **_peer(us, shapes, command),
    )


def _peer(us: dict, shapes: list[dict], command: str) -> dict:
    """The ladder file's anchor: FlashMLA's kernel timed in the same run. ``peer`` is drawn like a rung (µs
    on the ladder's shapes); ``peer_grid`` holds, per shape of :data:`GRID_SHAPES`, our time (what
    ``backend="auto"`` ran), FlashMLA's and their ratio (None where one did not run)."""
    vals = [us.get((PEER_OP, s["T"], s["H"], s["K"])) for s in shapes]
    measured = all(v is not None for v in vals)
    peer = dict(
        key="flashmla",
        label="FlashMLA's SM90 kernel (sgl-flash-mla, use_legacy=True)",
        bench_op=PEER_OP,
        us=[None if v is None else round(v, 1) for v in vals],
        status="measured" if measured else "pending",
        source=f"{command} ({datetime.date.today().isoformat()})",
        version=flashmla.version() if any(v is not None for v in vals) else "",
    )
    grid = []
    for T, H, K in GRID_SHAPES:
        op, ours = _ours(us, T, H, K)
        theirs = us.get((PEER_OP, T, H, K))
        grid.append(
            dict(
                T=T,
                H=H,
                K=K,
                bytes=bench_counts(T, H, K)[0],
                flops=bench_counts(T, H, K)[1],
                ours_op=op or None,
                ours_us=None if ours is None else round(ours, 1),
                flashmla_us=None if theirs is None else round(theirs, 1),
                ours_over_flashmla=None if ours is None or theirs is None else round(ours / theirs, 3),
            )
        )
    return dict(peer=peer, peer_grid=grid)


def _compiled_reference(us: dict, shapes: list[dict], command: str) -> list[dict]:
    """The reference under torch.compile, when the run timed it (bench rows ``sparse_mla.fused[torch.compile]``):
    drawn beside the rungs, not one of them."""
    vals = [us.get(("sparse_mla.fused[torch.compile]", s["T"], s["H"], s["K"])) for s in shapes]
    if any(v is None for v in vals):
        return []
    return [
        dict(
            key="torch_compile",
            label="torch.compile of the reference",
            us=[round(v, 1) for v in vals],
            status="measured",
            source=f"{command} ({datetime.date.today().isoformat()}): the fp32 reference "
            "compiled with static shapes, timed with device events",
        )
    ]


def write_ladder(
    path=LADDER_PATH, *, device: str = "", command: str = "dsv4ref.tools.cases.sparse_mla.write_ladder()", measured=None
):
    """Run every rung's bench case on this GPU (or take ``measured`` = ``(ceilings, rows)`` of a bench run
    that included them) and write the ladder file (default ``benchmarks/sparse_mla_ladder.json``); the
    file's ``others`` (figures from other runs, each with its source) are kept, and so are ``peer`` /
    ``peer_grid`` when this run did not time the peer, and every key this function does not write. Returns
    the content written."""
    ceil, rows = measured or run_benches("sparse_mla")
    data = ladder(ceil, rows, device=device or describe(), command=command)
    old = pathlib.Path(path)
    prev = json.loads(old.read_text()) if old.exists() else {}
    if not data["others"]:  # figures this run did not measure keep their own source
        data["others"] = prev.get("others", [])
    if data["peer"]["status"] != "measured" and prev.get("peer", {}).get("status") == "measured":
        data["peer"], data["peer_grid"] = prev["peer"], prev.get("peer_grid", data["peer_grid"])  # both from one run
    for k, v in prev.items():  # keys this function does not write (e.g. "diagnostics") are kept as they are
        data.setdefault(k, v)
    pathlib.Path(path).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return data
