"""``python -m dsv4ref check compressor`` rows and ``bench compressor`` cases.

Checks (any device, tiny shapes): the op, fed a prefill then single tokens, against the float64
whole-sequence oracle under the "compressor" tolerance, both ratios and both widths. Benchmarks (a GPU):
one decode step of 64 requests at V4-Flash size (Hd 4096, D 512), ratio 4 and ratio 128, each at a
boundary step (every request completes a row) and at a step between boundaries.
"""

from __future__ import annotations

import torch

from ... import compressor
from ...device import DEVICE
from ...testing import compare, randn
from ...validate import checking_values
from ..harness import BenchCase, CheckRow, bench, check

EPS = 1e-6


@check("compressor")
def _check() -> list[CheckRow]:
    rows = []
    for ratio, dim, chunks in ((4, 512, (13, 1, 1, 1, 2)), (4, 128, (9, 1, 2)), (128, 512, (129, 1, 126, 1))):
        L = sum(chunks)
        w = compressor.example_inputs(ratio, dim=dim, seed=ratio + dim)
        x = randn((L, 256), seed=ratio, block=None, octaves=2)
        st = compressor.allocate_state(1, ratio, dim)
        got, p0 = [], 0
        for n in chunks:
            pos = torch.arange(p0, p0 + n, device=DEVICE)
            r, done = compressor.compress(
                x[p0 : p0 + n],
                w["wkv"],
                w["wgate"],
                w["ape"],
                w["norm"],
                st.kv,
                st.score,
                torch.zeros(n, dtype=torch.int64, device=DEVICE),
                pos,
                ratio=ratio,
                eps=EPS,
            )
            got.append(r[done])
            p0 += n
        want, _ = compressor.compress_sequence(x, w["wkv"], w["wgate"], w["ape"], w["norm"], ratio=ratio, eps=EPS)
        rows.append(
            CheckRow(
                "compressor.compress", f"r={ratio} D={dim} steps={chunks}", compare(torch.cat(got), want, "compressor", "rows")
            )
        )
    return rows


@bench("compressor")
def _bench() -> list[BenchCase]:
    """R = 64 requests, one token each, Hd = 4096, D = 512. Compulsory bytes: the two bf16 weight matrices
    (coff·D × Hd each), x, the fp32 (kv, score) of each token written to its ring row, and at a boundary the
    window's ring rows read (n·2·D·4 B per request) and the compressed row written (D·4 B)."""
    R, Hd, D = 64, 4096, 512
    cases = []
    for ratio in (4, 128):
        coff = compressor.overlap(ratio)
        n, C = coff * ratio, coff * D
        g = torch.Generator(device=DEVICE).manual_seed(ratio)
        w = dict(
            wkv=torch.randn(C, Hd, device=DEVICE, generator=g).to(torch.bfloat16) * Hd**-0.5,
            wgate=torch.randn(C, Hd, device=DEVICE, generator=g).to(torch.bfloat16) * Hd**-0.5,
            ape=torch.randn(ratio, C, device=DEVICE, generator=g),
            norm=torch.ones(D, device=DEVICE),
        )
        x = torch.randn(R, Hd, device=DEVICE, generator=g).to(torch.bfloat16)
        st = compressor.allocate_state(R, ratio, D)
        st.score.zero_()  # a full ring (any finite values)
        req = torch.arange(R, device=DEVICE)
        for at_boundary in (True, False):
            p = torch.full((R,), 10 * n + (ratio - 1 if at_boundary else 0), device=DEVICE)
            nbytes = 2 * C * Hd * 2 + R * Hd * 2 + R * 2 * C * 4
            if at_boundary:
                nbytes += R * (n * 2 * D * 4 + D * 4)

            def run(i, p=p, w=w, st=st, x=x, ratio=ratio, req=req):
                with checking_values(False):  # no host syncs: the step can be captured in a graph
                    compressor.compress(
                        x, w["wkv"], w["wgate"], w["ape"], w["norm"], st.kv, st.score, req, p, ratio=ratio, eps=EPS
                    )

            def run_ref(i, p=p, w=w, st=st, x=x, ratio=ratio, req=req):
                with checking_values(False):
                    compressor.compress(
                        x,
                        w["wkv"],
                        w["wgate"],
                        w["ape"],
                        w["norm"],
                        st.kv,
                        st.score,
                        req,
                        p,
                        ratio=ratio,
                        eps=EPS,
                        backend="reference",
                    )

            what = "boundary step" if at_boundary else "between boundaries"
            note = "weights + x + ring writes" + (" + window reads + rows" if at_boundary else "")
            flops = 2 * 2 * R * C * Hd
            cases.append(BenchCase("compressor.compress", f"r={ratio} R={R} Hd={Hd}, {what}", run, 1, nbytes, flops, note))
            cases.append(
                BenchCase(
                    "compressor.compress (torch reference)", f"r={ratio} R={R} Hd={Hd}, {what}", run_ref, 1, nbytes, flops, note
                )
            )
            cases[-2].reference = (
                lambda x, p, w=w, st=st, ratio=ratio, req=req: compressor.reference.compress(
                    x, w["wkv"], w["wgate"], w["ape"], w["norm"], st.kv, st.score, req, p, ratio=ratio, eps=EPS
                ),
                lambda i, x=x, p=p: (x, p),
            )
    return cases
