"""``python -m dsv4ref check mhc`` rows and ``bench mhc`` cases."""

from __future__ import annotations

import torch

from ...device import DEVICE, interpreting
from ...mhc import example_params, example_streams, fused_post_pre, head, post, pre, reference, sinkhorn
from ...mhc import reference as mhc_reference
from ...mhc.fn_split import split_fn
from ...mhc.launch import ONE_PASS_LAG, ChunkedLaunch, MhcLaunch, OneKernelLaunch, OnePassLaunch, SplitKLaunch, default_launch
from ...mhc.reference import HC_EPS, POST_MULT, RMS_EPS, SINKHORN_ITERS
from ...testing import compare, generator, randn
from ..harness import BenchCase, CheckRow, bench, check


def designs(op: str = "pre") -> list[tuple[str, MhcLaunch]]:
    """(name, launch) of every design the library keeps for ``op`` ("pre", "fused_post_pre" or "head"), as
    ``bench mhc`` times them on a GPU: the two first designs, one pass, the chunked design's rungs (notebook 03's
    ladder) and, last, the op's default ``default_launch(op)``. A rung equal to the default is not listed twice."""
    rungs = [
        ("one-kernel", OneKernelLaunch()),
        ("split-K", SplitKLaunch()),
        ("one-pass", OnePassLaunch()),
        ("chunked, four streams per dot", ChunkedLaunch(stream_k=False, fn_layout=0, zigzag=False, block_k=16)),
        ("chunked, contiguous copies", ChunkedLaunch(stream_k=True, fn_layout=2, zigzag=False)),
        ("chunked, contiguous copies, zigzag", ChunkedLaunch(stream_k=True, fn_layout=2, zigzag=True)),
    ]
    default = default_launch(op)
    return [(n, L) for n, L in rungs if L != default] + [("default", default)]


@check("mhc")
def _check() -> list[CheckRow]:
    rows = []
    # fused == post then pre bit for bit holds for one design: give the separate pre the arithmetic of the fused
    # op's launch (``pre_like_fused``; on a GPU the default itself: there the fused op is post then pre)
    same = default_launch("fused_post_pre").pre_like_fused()
    shapes = [(5, 256)] if interpreting() else [(5, 256), (33, 4096), (17, 7168)]
    for T, Hd in shapes:
        res = example_streams(T, Hd, seed=T)
        x = randn((T, Hd), seed=T + 1, octaves=8)
        fn, scale, base = example_params(Hd, seed=T + 2)
        s = f"T={T} Hd={Hd} default"
        p64, c64, x64 = reference.pre(res, fn, scale, base, dtype=torch.float64)
        p, c, li = pre(res, fn, scale, base)
        rows += [
            CheckRow("mhc.pre post", s, compare(p, p64, "mhc")),
            CheckRow("mhc.pre comb", s, compare(c, c64, "mhc")),
            CheckRow("mhc.pre layer_input", s, compare(li, x64, "bf16_out")),
        ]
        new64 = reference.post(x, res, p64.float(), c64.float(), dtype=torch.float64)
        rows.append(CheckRow("mhc.post", s, compare(post(x, res, p, c), new64, "bf16_out")))
        got = fused_post_pre(x, res, p, c, fn, scale, base)
        new = post(x, res, p, c)
        sep = (new, *pre(new, fn, scale, base, launch=same))
        rows.append(CheckRow("mhc.fused_post_pre residual", s, compare(got[0], sep[0], "exact", "== post")))
        rows.append(CheckRow("mhc.fused_post_pre layer_input", s, compare(got[3], sep[3], "exact", "== post then pre")))
        hfn, hscale, hbase = example_params(Hd, seed=T + 3, head=True)
        h64 = reference.head(res, hfn, hscale, hbase, dtype=torch.float64)
        rows.append(CheckRow("mhc.head", s, compare(head(res, hfn, hscale, hbase), h64, "bf16_out")))
    # the one-pass design and the chunked one in chunks of 128 tokens (interpreter: 16), so that T = 300 crosses
    # two chunk boundaries: the same checks at real sizes
    others = [
        ("one-pass", OnePassLaunch()),
        ("chunked C=16" if interpreting() else "chunked C=128", ChunkedLaunch(tokens=16 if interpreting() else 128)),
    ]
    for (T, Hd), (label, one) in [
        (th, d) for d in others for th in ([(5, 256)] if interpreting() else [(33, 4096), (300, 4096), (17, 7168)])
    ]:
        res = example_streams(T, Hd, seed=T)
        x = randn((T, Hd), seed=T + 1, octaves=8)
        fn, scale, base = example_params(Hd, seed=T + 2)
        s = f"T={T} Hd={Hd} {label}"
        p64, c64, x64 = reference.pre(res, fn, scale, base, dtype=torch.float64)
        p, c, li = pre(res, fn, scale, base, launch=one)
        rows += [
            CheckRow("mhc.pre post", s, compare(p, p64, "mhc")),
            CheckRow("mhc.pre comb", s, compare(c, c64, "mhc")),
            CheckRow("mhc.pre layer_input", s, compare(li, x64, "bf16_out")),
        ]
        got = fused_post_pre(x, res, p, c, fn, scale, base, launch=one)
        new = post(x, res, p, c)
        sep = (new, *pre(new, fn, scale, base, launch=one.pre_like_fused()))
        rows.append(CheckRow("mhc.fused_post_pre residual", s, compare(got[0], sep[0], "exact", "== post")))
        rows.append(CheckRow("mhc.fused_post_pre layer_input", s, compare(got[3], sep[3], "exact", "== post then pre")))
        rows.append(CheckRow("mhc.fused_post_pre post", s, compare(got[1], sep[1], "fp32_reduction", "== post then pre")))
        hfn, hscale, hbase = example_params(Hd, seed=T + 3, head=True)
        h64 = reference.head(res, hfn, hscale, hbase, dtype=torch.float64)
        rows.append(CheckRow("mhc.head", s, compare(head(res, hfn, hscale, hbase, launch=one), h64, "bf16_out")))
    logits = torch.randn(64, 4, 4, generator=generator(7)).to(DEVICE) * 3
    rows.append(
        CheckRow("mhc.sinkhorn", "64 × 4×4, std 3", compare(sinkhorn(logits), reference.sinkhorn(logits.double()), "mhc"))
    )
    return rows


def compulsory_bytes(T: int, Hd: int, M: int = 4) -> dict[str, int]:
    """The bytes each op must move at least (what the bench divides by the copy rate), and the logical mix-GEMM
    FLOPs: {"pre", "post", "fused", "head", "flops"}. Shared with benchmarks/experiments/mhc/sweep.py."""
    stream = T * M * Hd * 2  # one pass over the bf16 streams
    row = T * Hd * 2  # x or the layer input
    small = T * (M + M * M) * 4  # post + comb (fp32)
    fn_bytes = M * (M + 2) * M * Hd * 4
    return dict(
        pre=stream + fn_bytes + small + row,
        post=row + stream + small + stream,
        fused=row + stream + small + stream + small + row + fn_bytes,
        head=stream + M * M * Hd * 4 + row,  # streams read once + fn [4, 4·Hd] fp32 + output written
        flops=2 * T * M * (M + 2) * M * Hd,
    )  # logical; the bf16x3 split does 3× that on tensor cores


@bench("mhc")
def _bench() -> list[BenchCase]:
    T, Hd, M = 4096, 4096, 4
    n_sets = 2  # one set is ~300 MB already, far past the L2
    sets = []
    fn, scale, base = example_params(Hd)
    fs = split_fn(fn, M)
    for _ in range(n_sets):
        res = torch.randn(T, M, Hd, device=DEVICE, dtype=torch.bfloat16)
        x = torch.randn(T, Hd, device=DEVICE, dtype=torch.bfloat16)
        p, c = torch.rand(T, M, device=DEVICE) * 2, torch.rand(T, M, M, device=DEVICE) * 0.5
        bufs = (torch.empty_like(res), torch.empty(T, M, device=DEVICE), torch.empty(T, M, M, device=DEVICE), torch.empty_like(x))
        sets.append((res, x, p, c, bufs))
    nb = compulsory_bytes(T, Hd, M)
    pre_b, post_b, fused_b, head_b, flops = nb["pre"], nb["post"], nb["fused"], nb["head"], nb["flops"]

    hfn, hscale, hbase = example_params(Hd, head=True)
    hfs = split_fn(hfn, M, head=True)

    def run_pre(i, launch, src=None):  # launch: a launch's op_args("mhc_pre") (pre, fused and head: the same)
        res, x, p, c, (new, p2, c2, out) = sets[i]
        torch.ops.dsv4ref.mhc_pre(
            res if src is None else src, fs, scale, base, p2, c2, out, RMS_EPS, HC_EPS, POST_MULT, SINKHORN_ITERS, *launch
        )

    def run_post(i):
        res, x, p, c, (new, *_rest) = sets[i]
        torch.ops.dsv4ref.mhc_post(x, res, p, c, new, *base_post)

    def run_fused(i, launch):
        res, x, p, c, (new, p2, c2, out) = sets[i]
        torch.ops.dsv4ref.mhc_fused_post_pre(
            x, res, p, c, fs, scale, base, new, p2, c2, out, RMS_EPS, HC_EPS, POST_MULT, SINKHORN_ITERS, *launch
        )

    def run_head(i, launch):
        res, x, p, c, (new, p2, c2, out) = sets[i]
        torch.ops.dsv4ref.mhc_head(res, hfs, hscale, hbase, out, RMS_EPS, HC_EPS, *launch)

    base_post = default_launch("post").op_args("mhc_post")

    def run_separate(i):
        run_post(i)
        run_pre(i, default_launch("pre").op_args("mhc_pre"), src=sets[i][4][0])

    shape = f"T={T} Hd={Hd}"
    cases = [
        BenchCase("mhc.post", shape, run_post, n_sets, post_b, 0, "x + streams read, streams written"),
        BenchCase(
            "mhc.post+pre (separate, default pre)",
            shape,
            run_separate,
            n_sets,
            fused_b,
            flops,
            "fused op's compulsory bytes (so it compares)",
        ),
    ]
    cases[0].reference = (mhc_reference.post, lambda i: sets[i][1::-1] + sets[i][2:4])
    runners = {
        "pre": ("mhc.pre", run_pre, pre_b, flops, "streams read once + fn + post/comb + layer input"),
        "fused": ("mhc.fused_post_pre", run_fused, fused_b, flops, "x + streams read, streams + layer input written"),
        "head": ("mhc.head", run_head, head_b, flops // 6, "streams read once + fn + output written"),
    }
    refs = {
        "pre": (lambda r: mhc_reference.pre(r, fn, scale, base), lambda i: (sets[i][0],)),
        "fused": (
            lambda x, r, p, c: mhc_reference.fused_post_pre(x, r, p, c, fn, scale, base),
            lambda i: sets[i][1::-1] + sets[i][2:4],
        ),
        "head": (lambda r: mhc_reference.head(r, hfn, hscale, hbase), lambda i: (sets[i][0],)),
    }
    # one row per (op, design): the op name carries the design ("(default)" marks default_launch(op)'s), the
    # shape its plan; every row has the op's compulsory bytes, so the rows of one op compare directly
    op_names = {"pre": "pre", "fused": "fused_post_pre", "head": "head"}
    per_op = {op: dict(designs(op_names[op])) for op in runners}  # in the interpreter, pre's default is not fused's
    for design in dict.fromkeys(n for d in per_op.values() for n in d):
        for op, (name, runner, b, f, note) in runners.items():
            fused = op == "fused"
            if (L := per_op[op].get(design)) is None:  # this rung is the op's default: its "default" row
                continue
            kind = L.design
            if isinstance(L, ChunkedLaunch):
                c, n_chunks, slices, cps, bk = L.plan(T, Hd)
                plan = (
                    f"C={c} ({(3 if fused else 2) * n_chunks} launches) BLOCK_T={L.tile(T)[0]} BLOCK_K={bk} "
                    f"slice={cps * bk} stream_k={int(L.stream_k)} fn_layout={L.fn_layout} zigzag={int(L.zigzag)}"
                )
            elif isinstance(L, OnePassLaunch):
                tiles, slices, cps, bk = L.plan(T, Hd)
                plan = f"BLOCK_T={L.block_t} BLOCK_K={bk} slice={cps * bk} ({(tiles + ONE_PASS_LAG) * slices} programs)"
            elif isinstance(L, SplitKLaunch):
                plan = f"BLOCK_T={L.block_t} splits={L.plan(T, Hd)[0]}"
            else:
                plan = f"BLOCK_T={L.block_t}"
            label = f"{kind.replace('_', '-')} (default)" if design == "default" else design
            enc = L.op_args("mhc_pre")  # pre, fused and head take the same packed launch
            try:  # a design that does not run here is reported, not fatal: the other rows still run
                runner(0, enc)
            except Exception as e:
                print(f"{name} {label}: skipped ({type(e).__name__}: {str(e)[:120]})")
                continue
            case = BenchCase(f"{name} {label}", f"{shape} {plan}", lambda i, r=runner, e=enc: r(i, e), n_sets, b, f, note)
            if L == default_launch(op_names[op]):  # the torch reference under torch.compile, beside the default
                case.reference = refs[op]
            cases.append(case)
    return cases
