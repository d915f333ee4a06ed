"""``python -m dsv4ref check mhc`` rows and ``bench mhc`` cases."""

from __future__ import annotations

import torch

from ...device import DEVICE, interpreting
from ...mhc import example_params, example_streams, fused_post_pre, head, post, pre, reference, sinkhorn
from ...mhc import reference as mhc_reference
from ...mhc.launch import MhcLaunch, chunked_variant, one_pass_variant, split_fn
from ...mhc.reference import HC_EPS, POST_MULT, RMS_EPS, SINKHORN_ITERS
from ...testing import compare, generator, randn
from ..harness import BenchCase, CheckRow, bench, check


@check("mhc")
def _check() -> list[CheckRow]:
    rows = []
    # fused == post then pre bit for bit holds for one design: give the separate pre the fused op's default
    # (by default pre runs split-K and the fused op one kernel; their sums of squares differ in order)
    same = MhcLaunch().pre_like_fused()
    shapes = [(5, 256)] if interpreting() else [(5, 256), (33, 4096), (17, 7168)]
    for T, Hd in shapes:
        res = example_streams(T, Hd, seed=T)
        x = randn((T, Hd), seed=T + 1, octaves=8)
        fn, scale, base = example_params(Hd, seed=T + 2)
        s = f"T={T} Hd={Hd}"
        p64, c64, x64 = reference.pre(res, fn, scale, base, dtype=torch.float64)
        p, c, li = pre(res, fn, scale, base)
        rows += [CheckRow("mhc.pre post", s, compare(p, p64, "mhc")), CheckRow("mhc.pre comb", s, compare(c, c64, "mhc")),
                 CheckRow("mhc.pre layer_input", s, compare(li, x64, "bf16_out"))]
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
    # the one-pass design (MhcLaunch(one_pass=True)) and the chunked one (the GPU default), in chunks of 128 tokens
    # here so that T = 300 crosses two chunk boundaries: the same checks at real sizes
    designs = [("one-pass", MhcLaunch(one_pass=True)),
               ("chunked", MhcLaunch(chunked=True, chunk_tokens=16 if interpreting() else 128))]
    for (T, Hd), (label, one) in [(th, d) for d in designs
                                  for th in ([(5, 256)] if interpreting() else [(33, 4096), (300, 4096), (17, 7168)])]:
        res = example_streams(T, Hd, seed=T)
        x = randn((T, Hd), seed=T + 1, octaves=8)
        fn, scale, base = example_params(Hd, seed=T + 2)
        s = f"T={T} Hd={Hd} {label}"
        p64, c64, x64 = reference.pre(res, fn, scale, base, dtype=torch.float64)
        p, c, li = pre(res, fn, scale, base, launch=one)
        rows += [CheckRow("mhc.pre post", s, compare(p, p64, "mhc")), CheckRow("mhc.pre comb", s, compare(c, c64, "mhc")),
                 CheckRow("mhc.pre layer_input", s, compare(li, x64, "bf16_out"))]
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
    rows.append(CheckRow("mhc.sinkhorn", "64 × 4×4, std 3", compare(sinkhorn(logits), reference.sinkhorn(logits.double()), "mhc")))
    return rows


def compulsory_bytes(T: int, Hd: int, M: int = 4) -> dict[str, int]:
    """The bytes each op must move at least (what the bench divides by the copy rate), and the logical mix-GEMM
    FLOPs: {"pre", "post", "fused", "head", "flops"}. Shared with benchmarks/mhc_sweep.py."""
    stream = T * M * Hd * 2  # one pass over the bf16 streams
    row = T * Hd * 2  # x or the layer input
    small = T * (M + M * M) * 4  # post + comb (fp32)
    fn_bytes = M * (M + 2) * M * Hd * 4
    return dict(pre=stream + fn_bytes + small + row, post=row + stream + small + stream,
                fused=row + stream + small + stream + small + row + fn_bytes,
                head=stream + M * M * Hd * 4 + row,  # streams read once + fn [4, 4·Hd] fp32 + output written
                flops=2 * T * M * (M + 2) * M * Hd)  # logical; the bf16x3 split does 3× that on tensor cores


@bench("mhc")
def _bench() -> list[BenchCase]:
    T, Hd, M = 4096, 4096, 4
    n_sets = 2  # one set is ~300 MB already, far past the L2
    sets = []
    fn, scale, base = example_params(Hd)
    fs = split_fn(fn, M)
    for i in range(n_sets):
        res = torch.randn(T, M, Hd, device=DEVICE, dtype=torch.bfloat16)
        x = torch.randn(T, Hd, device=DEVICE, dtype=torch.bfloat16)
        p, c = torch.rand(T, M, device=DEVICE) * 2, torch.rand(T, M, M, device=DEVICE) * 0.5
        bufs = (torch.empty_like(res), torch.empty(T, M, device=DEVICE), torch.empty(T, M, M, device=DEVICE),
                torch.empty_like(x))
        sets.append((res, x, p, c, bufs))
    nb = compulsory_bytes(T, Hd, M)
    pre_b, post_b, fused_b, head_b, flops = nb["pre"], nb["post"], nb["fused"], nb["head"], nb["flops"]

    hfn, hscale, hbase = example_params(Hd, head=True)
    hfs = split_fn(hfn, M, head=True)

    # every case names its design explicitly (MhcLaunch(split_k=False / True)), so the defaults move no row
    one = MhcLaunch(split_k=False).encode()
    split = MhcLaunch(split_k=True).encode()
    base_post = MhcLaunch().encode()

    def run_pre(i, launch=one, src=None):
        res, x, p, c, (new, p2, c2, out) = sets[i]
        torch.ops.dsv4ref.mhc_pre(res if src is None else src, fs, scale, base, p2, c2, out, RMS_EPS, HC_EPS,
                                  POST_MULT, SINKHORN_ITERS, launch)

    def run_post(i):
        res, x, p, c, (new, *_rest) = sets[i]
        torch.ops.dsv4ref.mhc_post(x, res, p, c, new, base_post)

    def run_fused(i, launch=one):
        res, x, p, c, (new, p2, c2, out) = sets[i]
        torch.ops.dsv4ref.mhc_fused_post_pre(x, res, p, c, fs, scale, base, new, p2, c2, out, RMS_EPS, HC_EPS,
                                             POST_MULT, SINKHORN_ITERS, launch)

    def run_separate(i):
        run_post(i)
        run_pre(i, src=sets[i][4][0])

    def run_head(i, launch=one):
        res, x, p, c, (new, p2, c2, out) = sets[i]
        torch.ops.dsv4ref.mhc_head(res, hfs, hscale, hbase, out, RMS_EPS, HC_EPS, launch)

    cases = [
        BenchCase("mhc.pre", f"T={T} Hd={Hd} BLOCK_T=16", run_pre, n_sets, pre_b, flops,
                  "streams read once + fn + post/comb + layer input"),
        BenchCase("mhc.post", f"T={T} Hd={Hd}", run_post, n_sets, post_b, 0, "x + streams read, streams written"),
        BenchCase("mhc.fused_post_pre", f"T={T} Hd={Hd}", run_fused, n_sets, fused_b, flops,
                  "x + streams read, streams + layer input written"),
        BenchCase("mhc.post+pre (separate)", f"T={T} Hd={Hd}", run_separate, n_sets, fused_b, flops,
                  "fused op's compulsory bytes (so it compares)"),
        BenchCase("mhc.head", f"T={T} Hd={Hd}", run_head, n_sets, head_b, flops // 6,
                  "streams read once + fn + output written"),
    ]
    # the torch references of pre, post, fused post-pre and head, beside them under torch.compile
    cases[0].reference = (lambda r: mhc_reference.pre(r, fn, scale, base), lambda i: (sets[i][0],))
    cases[1].reference = (mhc_reference.post, lambda i: sets[i][1::-1] + sets[i][2:4])
    cases[2].reference = (lambda x, r, p, c: mhc_reference.fused_post_pre(x, r, p, c, fn, scale, base),
                          lambda i: sets[i][1::-1] + sets[i][2:4])
    cases[4].reference = (lambda r: mhc_reference.head(r, hfn, hscale, hbase), lambda i: (sets[i][0],))
    for bt in (32, 64):  # tile-size variants of pre: fewer fn re-reads from L2, fewer programs
        launch = MhcLaunch(split_k=False, block_t=bt).encode()
        try:
            run_pre(0, launch)
            cases.append(BenchCase("mhc.pre", f"T={T} Hd={Hd} BLOCK_T={bt}", lambda i, la=launch: run_pre(i, la), n_sets,
                                   pre_b, flops, "as above"))
        except Exception as e:  # a tile that does not compile on this device is reported, not fatal
            print(f"mhc.pre BLOCK_T={bt}: skipped ({type(e).__name__}: {str(e)[:80]})")
    # split-K: same compulsory bytes; it really reads the streams twice (the second read partly from L2) plus a
    # [splits, T, 33] fp32 workspace written once and read per hidden part
    sk_launch = MhcLaunch(split_k=True)
    n_split, _ = sk_launch.split_plan(T, Hd)
    sk = f"T={T} Hd={Hd} BLOCK_T={sk_launch.split_block_t} splits={n_split}"
    for name, run, b, f, note in [
        ("mhc.pre split-K", lambda i: run_pre(i, split), pre_b, flops, "as mhc.pre; moves ~2x the streams"),
        ("mhc.fused_post_pre split-K", lambda i: run_fused(i, split), fused_b, flops,
         "as mhc.fused_post_pre; re-reads the new streams"),
        ("mhc.head split-K", lambda i: run_head(i, split), head_b, flops // 6, "as mhc.head; moves ~2x the streams"),
    ]:
        try:
            run(0)
            cases.append(BenchCase(name, sk, run, n_sets, b, f, note))
        except Exception as e:  # reported, not fatal: the other rows still run
            print(f"{name}: skipped ({type(e).__name__}: {str(e)[:120]})")
    runners = {"pre": ("mhc.pre", run_pre, pre_b, flops), "fused": ("mhc.fused_post_pre", run_fused, fused_b, flops),
               "head": ("mhc.head", run_head, head_b, flops // 6)}

    def add_design_case(op, design, shape, L, note):
        """One row of ``op`` under launch ``L`` (same compulsory bytes as the op's first row); reported, not
        fatal, if it does not run here."""
        name, runner, b, f = runners[op]
        enc = L.encode()
        try:
            runner(0, enc)
            cases.append(BenchCase(f"{name} {design}", shape, lambda i, r=runner, e=enc: r(i, e), n_sets, b, f, note))
        except Exception as e:
            print(f"{name} {design} {shape}: skipped ({type(e).__name__}: {str(e)[:120]})")

    # one pass (issue 14; kernels.py "Design 3"): the design as session 3 measured it and the field defaults
    # (benchmarks/mhc_sweep.py times every candidate of ONE_PASS_VARIANTS)
    for variant in ("s3", "default"):
        for op in ("pre", "fused", "head"):
            L = one_pass_variant(variant)
            tiles, slices, _, bk = L.one_pass_plan(T, Hd, op == "fused")
            shape = (f"T={T} Hd={Hd} {variant}: BLOCK_T={L.one_pass_tile(op == 'fused')[0]} BLOCK_K={bk} "
                     f"slice={L.one_pass_slice_h} lag={L.one_pass_lag} ({(tiles + L.one_pass_lag) * slices} programs)")
            add_design_case(op, "one-pass", shape, L, "as the op above; one launch, the second read of the streams from L2")
    # chunked (kernels.py "Design 4"; benchmarks/mhc_sweep.py times every candidate of CHUNKED_VARIANTS): the
    # second sweep's winner, session 6's third sweep's (contiguous partial-kernel copies), session 7's (zigzag
    # walks, slices of 512 dims) and the GPU default since session 8 (fn without its zero quarter, 4 stages)
    for variant in ("chunked C4096 fused-post", "chunked smem sk64 fnkmajor", "chunked zz slice512",
                    "chunked zz slice512 n96 st4"):
        for op in ("pre", "fused", "head"):
            L = chunked_variant(variant)
            own = op == "fused" and not L.chunk_fused_post  # as post + pre, the fused op runs pre's partial kernel
            c, n_chunks, slices, cps, bk = L.chunk_plan(T, Hd, own)
            launches = (3 if op == "fused" and L.chunk_fused_post else 2) * n_chunks
            shape = (f"T={T} Hd={Hd} {variant}: C={c} ({launches} launches) BLOCK_T={L.chunk_tile(own)[0]} "
                     f"BLOCK_K={bk} slice={cps * bk} finish={L.chunk_finish_block_t}x{L.chunk_finish_plan(c, Hd)[1]}")
            add_design_case(op, "chunked", shape, L,
                            "as the op above; per chunk a partial and a finish kernel, re-read from L2")
    return cases
