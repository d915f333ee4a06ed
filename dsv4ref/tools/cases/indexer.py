"""``python -m dsv4ref check indexer`` / ``bench indexer``: the lightning indexer's check rows and benchmark cases."""

from __future__ import annotations

import torch

from ... import indexer as ix
from ...device import DEVICE
from ...formats import INDEX_HEAD_DIM, index_k_page_bytes
from ...testing import compare, generator, randn
from ..harness import BenchCase, CheckRow, bench, check


@check("indexer.quantize_q")
def _check_quantize_q() -> list[CheckRow]:
    rows = []
    for fmt in ix.FMTS:
        for had in (False, True):
            ex = ix.example_inputs(5, 16, 16, block_size=16, seed=3, hadamard=had)
            args = (ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"])
            r = ix.quantize_q(*args, fmt=fmt, hadamard=had, backend="reference")
            o = ix.quantize_q(*args, fmt=fmt, hadamard=had, backend="triton")
            shape = f"T=5 H=16 {fmt}{' hadamard' if had else ''}"
            rows.append(CheckRow("indexer.quantize_q", shape, compare(o[0], r[0], "exact", "q bytes")))
            if fmt == "mxfp4":
                rows.append(CheckRow("indexer.quantize_q", shape, compare(o[1], r[1], "exact", "q scales")))
            rows.append(CheckRow("indexer.quantize_q", shape, compare(o[2], r[2], "exact", "weights_out")))
    return rows


@check("indexer.insert_k")
def _check_insert_k() -> list[CheckRow]:
    rows = []
    for fmt in ix.FMTS:
        k = randn((40, INDEX_HEAD_DIM), seed=5, block=32)
        slots = torch.randperm(64, generator=generator(5))[:40].to(DEVICE)
        slots[::7] = -1
        a, b = ix.allocate_k_cache(4, 16, fmt), ix.allocate_k_cache(4, 16, fmt)
        ix.insert_k(a, k, slots, block_size=16, fmt=fmt, hadamard=True, backend="reference")
        ix.insert_k(b, k, slots, block_size=16, fmt=fmt, hadamard=True, backend="triton")
        rows.append(CheckRow("indexer.insert_k", f"N=40 Bc=16 {fmt}", compare(b, a, "exact", "cache bytes")))
    return rows


@check("indexer.logits")
def _check_logits() -> list[CheckRow]:
    rows = []
    for fmt in ix.FMTS:
        ex = ix.example_inputs(4, 16, 40, block_size=16, fmt=fmt, seed=7)
        q, qs, wo = ix.quantize_q(ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"], fmt=fmt)
        got = ix.logits(q, qs, wo, ex["k_cache"], ex["positions"], block_table=ex["block_table"],
                        block_size=ex["block_size"], backend="triton")
        args = (q, qs, wo, ex["k_cache"], ex["positions"], ex["block_table"])
        kw = dict(block_size=ex["block_size"], n_out=got.shape[1])
        ref = ix.reference.logits(*args, **kw, dtype=torch.float64)
        # normalise by the condition scale Σ_h |w|·Σ_d |q k| so "fp32_dot" (atol 1e-5) bounds the fp32 sum error
        cond = ix.reference.logits_condition(*args, **kw)
        rows.append(CheckRow("indexer.logits", f"T=4 H=16 n_c<=40 Bc=16 {fmt}",
                             compare(got.double() / cond, ref / cond, "fp32_dot", "logits / condition")))
    return rows


@check("indexer.topk")
def _check_topk() -> list[CheckRow]:
    lg = torch.randn(6, 300, generator=generator(11)).to(DEVICE)
    pos = torch.tensor([3, 40, 400, 1199, 800, 2], dtype=torch.int64, device=DEVICE)
    n_c = ix.n_compressed(pos)
    lg = torch.where(torch.arange(300, device=DEVICE)[None, :] < n_c[:, None], lg, float("-inf"))
    got = ix.topk(lg, 64).sort(dim=1).values
    exp = torch.full((6, 64), -1, dtype=torch.int32)
    for t in range(6):
        ids = torch.topk(lg[t, : int(n_c[t])].cpu(), min(64, int(n_c[t]))).indices.to(torch.int32)
        exp[t, : ids.numel()] = ids
    return [CheckRow("indexer.topk", "T=6 n<=300 k=64", compare(got.cpu(), exp.sort(dim=1).values, "exact", "id sets"))]


@bench("indexer")
def _bench() -> list[BenchCase]:
    """The logits kernel alone (``dsv4ref.indexer.launch.logits``) at T = 64 tokens × n_c = 32 768 keys."""
    T, H, n_c, Bc = 64, 64, 32768, 64
    pages_per_tok = n_c // Bc
    pos = torch.full((T,), 4 * n_c + 2, dtype=torch.int64, device=DEVICE)  # n_c = 32768 for every token
    cases = []
    g = torch.Generator(device=DEVICE).manual_seed(0)
    cs = ix.cos_sin_table(4 * n_c + 8)
    for fmt in ix.FMTS:
        rec = index_k_page_bytes(1, fmt)
        n_sets = 2  # 2 × 277 MB (fp8) / 143 MB (mxfp4) of keys: far beyond the 60 MB L2
        sets = []
        for i in range(n_sets):
            cache = torch.randint(0, 256, (T * pages_per_tok, Bc * rec), dtype=torch.uint8, device=DEVICE,
                                  generator=g)
            if fmt == "fp8":
                cache.view(T * pages_per_tok, Bc, rec)[:, :, :INDEX_HEAD_DIM] &= 0x77  # no NaN codes (0x7F / 0xFF)
                sc = cache[:, Bc * INDEX_HEAD_DIM:].view(torch.float32)
                sc.copy_(torch.exp2(torch.randint(-10, 10, sc.shape, device=DEVICE, generator=g).float()))
            else:
                cache[:, Bc * 64:] = torch.randint(117, 137, (T * pages_per_tok, Bc * 4), dtype=torch.uint8,
                                                   device=DEVICE, generator=g)
            bt = torch.randperm(T * pages_per_tok, device=DEVICE, generator=g).to(torch.int32).view(T, pages_per_tok)
            iq = torch.randn(T, H, INDEX_HEAD_DIM, device=DEVICE, generator=g).to(torch.bfloat16)
            w = torch.randn(T, H, device=DEVICE, generator=g)
            q, qs, wo = ix.quantize_q(iq, pos, cs, w, fmt=fmt)
            sets.append((q, qs, wo, cache, bt))
        nbytes = T * n_c * rec + T * H * (INDEX_HEAD_DIM if fmt == "fp8" else 68) + T * H * 4 \
            + T * pages_per_tok * 4 + T * n_c * 4
        flops = 2.0 * T * n_c * H * INDEX_HEAD_DIM

        def run(i, sets=sets):
            q, qs, wo, cache, bt = sets[i]
            return ix.launch.logits(q, qs, wo, cache, pos, bt, Bc, n_c)

        cases.append(BenchCase(f"indexer.logits.{fmt}", f"T={T} H={H} n_c={n_c} Bc={Bc}", run, n_sets, nbytes,
                               flops, note=f"keys {rec} B/key/token + q + w + block table + fp32 logits out"))
    return cases
