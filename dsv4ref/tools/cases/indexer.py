"""``python -m dsv4ref check indexer`` / ``bench indexer``: the lightning indexer's check rows and benchmark cases."""

from __future__ import annotations

import warnings

import torch

from ... import indexer as ix
from ... import validate
from ...device import DEVICE
from ...formats import INDEX_HEAD_DIM, index_k_page_bytes
from ...indexer import reference as ix_reference
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


@check("indexer.non_finite")
def _check_non_finite() -> list[CheckRow]:
    """Value checks off (``docs/indexer.md#non-finite-input``): NaN / ±inf inputs give the reference's bytes on
    the kernels (NaN blocks), and a NaN-encoded key or query gives NaN scores in the same places."""
    rows = []
    ex = ix.example_inputs(3, 8, 40, block_size=16, seed=9)
    iq, k = ex["index_q"].clone(), ex["k"].clone()
    iq[0, 1, 5], iq[0, 2, 70], iq[0, 3, 100] = float("nan"), float("inf"), float("-inf")  # token 0 only
    k[4, 9], k[7, 66], k[9, 120] = float("nan"), float("-inf"), float("inf")
    with validate.checking_values(False), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's inf − inf warnings, in the interpreter only
        for fmt in ix.FMTS:
            for had in (False, True):
                shape = f"NaN/±inf in, {fmt}{' hadamard' if had else ''}"
                args = (iq, ex["positions"], ex["cos_sin"], ex["weights"])
                r = ix.quantize_q(*args, fmt=fmt, hadamard=had, backend="reference")
                o = ix.quantize_q(*args, fmt=fmt, hadamard=had, backend="triton")
                for a, b, name in zip(o, r, ("q bytes", "q scales", "weights_out")):
                    if a is not None:
                        rows.append(CheckRow("indexer.quantize_q", shape, compare(a, b, "exact", name)))
                caches = [ix.allocate_k_cache(ex["k_cache"].shape[0], 16, fmt) for _ in range(2)]
                for cache, b in zip(caches, ("reference", "triton")):
                    ix.insert_k(cache, k, ex["slots"], block_size=16, fmt=fmt, hadamard=had, backend=b)
                rows.append(CheckRow("indexer.insert_k", shape, compare(caches[1], caches[0], "exact", "cache bytes")))
                q, qs, wo = r
                kw = dict(block_table=ex["block_table"], block_size=16)
                got = ix.logits(q, qs, wo, caches[0], ex["positions"], **kw, backend="triton")
                ref = ix.logits(q, qs, wo, caches[0], ex["positions"], **kw, backend="reference")
                cond = ix.reference.logits_condition(
                    q, qs, wo, caches[0], ex["positions"], ex["block_table"], block_size=16, n_out=ref.shape[1]
                )
                rows.append(
                    CheckRow(
                        "indexer.logits",
                        shape + " (NaN scores)",
                        compare(got.double() / cond, ref.double() / cond, "fp32_dot", "logits"),
                    )
                )
    return rows


@check("indexer.logits")
def _check_logits() -> list[CheckRow]:
    """Every format and MXFP4 decode (``IndexerLaunch.fp4_decode``), at a page of 64 and an odd page of 24."""
    rows = []
    for fmt in ix.FMTS:
        for bs in (64, 24):
            ex = ix.example_inputs(4, 64, 150, block_size=bs, fmt=fmt, seed=7)
            q, qs, wo = ix.quantize_q(ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"], fmt=fmt)
            args = (q, qs, wo, ex["k_cache"], ex["positions"], ex["block_table"])
            kw = dict(block_size=bs, n_out=150)
            ref = ix.reference.logits(*args, **kw, dtype=torch.float64)
            # normalise by the condition scale Σ_h |w|·Σ_d |q k| so "fp32_dot" (atol 1e-5) bounds the fp32 sum error
            cond = ix.reference.logits_condition(*args, **kw)
            for dec in ix.launch.FP4_DECODES if fmt == "mxfp4" else ("nibble",):
                got = ix.logits(
                    q,
                    qs,
                    wo,
                    ex["k_cache"],
                    ex["positions"],
                    block_table=ex["block_table"],
                    block_size=bs,
                    backend="triton",
                    launch=ix.IndexerLaunch(fp4_decode=dec),
                )
                rows.append(
                    CheckRow(
                        "indexer.logits",
                        f"T=4 H=64 n_c<=150 Bc={bs} {fmt}" + (f" {dec}" if fmt == "mxfp4" else ""),
                        compare(got.double() / cond, ref / cond, "fp32_dot", "logits / condition"),
                    )
                )
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


BENCH_SHAPE = dict(T=64, H=64, n_c=32768, Bc=64)  # 64 decode tokens × 32 768 compressed keys (a 128K context)


def logits_bench_inputs(fmt: str, n_sets: int = 2, seed: int = 0, T: int = 64, H: int = 64, n_c: int = 32768, Bc: int = 64):
    """The logits benchmark's inputs: ``(positions, sets, bytes, flops)`` with ``sets`` a list of ``n_sets``
    tuples ``(q, q_scales, weights_out, cache, block_table)`` (2 sets: 2 × 277 MB (fp8) / 143 MB (mxfp4) of
    keys, far beyond the 60 MB L2). Cache bytes are random (fp8: no NaN codes, scales 2^-10..2^9; mxfp4: scale
    bytes 117..136), block tables shuffled per token, queries quantised from N(0, 1). ``bytes``: the
    compulsory traffic of one call; ``flops``: 2·T·n_c·H·128. Shared by ``bench indexer`` and
    ``benchmarks/experiments/indexer_sweep.py``."""
    pages_per_tok = n_c // Bc
    pos = torch.full((T,), 4 * n_c + 2, dtype=torch.int64, device=DEVICE)  # n_c visible keys for every token
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    cs = ix.cos_sin_table(4 * n_c + 8)
    rec = index_k_page_bytes(1, fmt)
    sets = []
    for _ in range(n_sets):
        cache = torch.randint(0, 256, (T * pages_per_tok, Bc * rec), dtype=torch.uint8, device=DEVICE, generator=g)
        if fmt == "fp8":
            cache.view(T * pages_per_tok, Bc, rec)[:, :, :INDEX_HEAD_DIM] &= 0x77  # no NaN codes (0x7F / 0xFF)
            sc = cache[:, Bc * INDEX_HEAD_DIM :].view(torch.float32)
            sc.copy_(torch.exp2(torch.randint(-10, 10, sc.shape, device=DEVICE, generator=g).float()))
        else:
            cache[:, Bc * 64 :] = torch.randint(
                117, 137, (T * pages_per_tok, Bc * 4), dtype=torch.uint8, device=DEVICE, generator=g
            )
        bt = torch.randperm(T * pages_per_tok, device=DEVICE, generator=g).to(torch.int32).view(T, pages_per_tok)
        iq = torch.randn(T, H, INDEX_HEAD_DIM, device=DEVICE, generator=g).to(torch.bfloat16)
        w = torch.randn(T, H, device=DEVICE, generator=g)
        q, qs, wo = ix.quantize_q(iq, pos, cs, w, fmt=fmt)
        sets.append((q, qs, wo, cache, bt))
    nbytes = T * n_c * rec + T * H * (INDEX_HEAD_DIM if fmt == "fp8" else 68) + T * H * 4 + T * pages_per_tok * 4 + T * n_c * 4
    return pos, sets, nbytes, 2.0 * T * n_c * H * INDEX_HEAD_DIM


@bench("indexer")
def _bench() -> list[BenchCase]:
    """The logits kernel alone (``dsv4ref.indexer.launch.logits``) at T = 64 tokens × n_c = 32 768 keys: FP8, and
    MXFP4 with each decode (``IndexerLaunch.fp4_decode``) and a few tile choices for the new one, side by side.
    The full grid of launch choices: ``benchmarks/experiments/indexer_sweep.py``."""
    T, H, n_c, Bc = (BENCH_SHAPE[k] for k in ("T", "H", "n_c", "Bc"))
    cases = []
    variants = {
        "fp8": [("", ix.default_launch())],
        "mxfp4": [
            ("", ix.IndexerLaunch(fp4_decode="nibble")),
            (".f16_blocks", ix.IndexerLaunch(fp4_decode="f16_blocks")),
            (".f16_blocks.p8", ix.IndexerLaunch(fp4_decode="f16_blocks", logits_pages=8)),
            (".f16_scaled", ix.IndexerLaunch(fp4_decode="f16_scaled")),
            (".f16_scaled.p8", ix.IndexerLaunch(fp4_decode="f16_scaled", logits_pages=8)),
        ],
    }
    for fmt in ix.FMTS:
        rec = index_k_page_bytes(1, fmt)
        n_sets = 2
        pos, sets, nbytes, flops = logits_bench_inputs(fmt, n_sets, T=T, H=H, n_c=n_c, Bc=Bc)
        for suffix, launch in variants[fmt]:

            def run(i, sets=sets, launch=launch, pos=pos):
                q, qs, wo, cache, bt = sets[i]
                return ix.launch.logits(q, qs, wo, cache, pos, bt, Bc, n_c, launch)

            cases.append(
                BenchCase(
                    f"indexer.logits.{fmt}{suffix}",
                    f"T={T} H={H} n_c={n_c} Bc={Bc}",
                    run,
                    n_sets,
                    nbytes,
                    flops,
                    note=f"keys {rec} B/key/token + q + w + block table + fp32 logits out; launch {launch}",
                )
            )
        # the torch reference in fp32 (the float64 oracle would not be a fair speed comparison)
        cases[-len(variants[fmt])].reference = (
            lambda q, qs, wo, cache, bt, pos=pos: ix_reference.logits(
                q, qs, wo, cache, pos, bt, block_size=Bc, n_out=n_c, dtype=torch.float32
            ),
            lambda i, sets=sets: sets[i],
        )
    return cases
