"""The lightning indexer (docs/indexer.md): fused Q bytes, 2^k invariance, Hadamard, fold bound, ReLU per head,
causal mask, top-k and its shortcut, local->global, MXFP4 nibbles/scales, weight provenance, errors, compile."""

import functools
import math

import numpy as np
import pytest
import torch

import dsv4ref.indexer as ix
from dsv4ref.device import DEVICE, interpreting
from dsv4ref.testing import assert_close, generator, poison, randn
from dsv4ref.tolerances import compare

# ---------------------------------------------------------------------------------------------------
# independent oracles (written from docs/formats.md, sharing no code with dsv4ref.indexer / dsv4ref.fp8)
# ---------------------------------------------------------------------------------------------------


def assert_logits(actual, oracle, cond, fmt, name):
    """Scores against the float64 oracle ``oracle`` (no roundings), with ``cond`` =
    ``reference.logits_condition``: FP8 (fp32 sums of exact products) under ``fp32_dot`` after dividing by
    the condition; MXFP4 (rounded to bf16 at DeepSeek's points) under ``indexer_logits_bf16``."""
    if fmt == "fp8":
        return assert_close(actual.double() / cond, oracle / cond, "fp32_dot", name)
    return assert_close(actual.double(), oracle, "indexer_logits_bf16", name, mass=cond)


def table(max_pos, theta=10000.0):
    """[cos | sin] fp32 table, no YaRN (the layout of dsv4ref.rope's tables), built here, not by dsv4ref."""
    inv = theta ** (-torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    f = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], 1).to(DEVICE)


def ue8m0_py(amax: float, floor: float, qmax: float) -> int:
    """ceil(log2(fp32(max(amax, floor) / qmax))) + 127 with math.frexp (exact)."""
    s = float(np.float32(np.float32(max(amax, floor)) / np.float32(qmax)))
    m, ex = math.frexp(s)  # s = m·2^ex, m in [0.5, 1)
    return (ex - 1 if m == 0.5 else ex) + 127


def e4m3_int(y: torch.Tensor) -> torch.Tensor:
    """An integer E4M3 encoder (docs/formats.md): clamp, then RNE on the code grid, as uint8 bytes."""
    y = y.float().clamp(-448, 448)
    a = y.abs()
    b = a.view(torch.int32).long()
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - (120 << 3)
    small = torch.round(a.double() * 512).long()  # round half to even
    code = torch.where(a < 2**-6, small, normal)
    return (code | (torch.signbit(y).long() << 7)).to(torch.uint8)


GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_brute(v: float) -> int:
    """Nearest E2M1 magnitude by distance (saturating), ties to the even code; sign from the sign bit."""
    a = min(abs(v), 6.0)
    d = [abs(a - g) for g in GRID]
    best = min(d)
    cands = [i for i, x in enumerate(d) if x == best]
    code = cands[0] if len(cands) == 1 else [c for c in cands if c % 2 == 0][0]
    return code | (8 if math.copysign(1.0, v) < 0 else 0)


def fp8_bytes(x: torch.Tensor):
    """(bytes [R,128], exponent e [R]) for rows of fp32 values: one UE8M0 scale per 128."""
    xs = x.reshape(-1, 128).double().cpu()
    e = torch.tensor([ue8m0_py(float(r.abs().max()), 1e-4, 448.0) - 127 for r in xs])
    q = e4m3_int((xs * torch.exp2(-e.double())[:, None]).float())
    return q.reshape(x.shape), e.reshape(x.shape[:-1])


def fp4_bytes(x: torch.Tensor):
    """(packed [R,64], scale bytes [R,4]) with the brute-force encoder."""
    xs = x.reshape(-1, 4, 32).double().cpu()
    packed, bytes_ = [], []
    for row in xs:
        codes = []
        bs = []
        for blk in row:
            b = ue8m0_py(float(blk.abs().max()), 6.0 * 2.0**-126, 6.0)
            bs.append(b)
            codes += [e2m1_brute(float(v) * 2.0 ** (127 - b)) for v in blk]
        packed.append([codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(64)])
        bytes_.append(bs)
    return (
        torch.tensor(packed, dtype=torch.uint8).reshape(*x.shape[:-1], 64),
        torch.tensor(bytes_, dtype=torch.uint8).reshape(*x.shape[:-1], 4),
    )


def fold(H):
    return float(np.float32(128**-0.5 * H**-0.5))


def problem(T=4, H=8, n_keys=40, *, fmt="fp8", hadamard=False, seed=0, positions=None, block_size=16):
    return ix.example_inputs(T, H, n_keys, fmt=fmt, hadamard=hadamard, seed=seed, positions=positions, block_size=block_size)


def qargs(ex):
    return ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"]


# ---------------------------------------------------------------------------------------------------
# fused Q: kernel == reference == independent encoder, bytes and weight bits
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_q_fp8_exact(hadamard):
    T, H = 4, 8
    cs = table(4096)
    iq = randn((T, H, 128), seed=1, block=32, octaves=12)
    # rows whose amax is exactly 448·2^k (the float-log2 trap, docs/formats.md), on a NoPE dim
    for j, k in enumerate([-20, -3, 0, 1, 5, 9]):
        t, h = divmod(j, H)
        iq[t, h] = (torch.randn(128, generator=generator(j)) * 2.0**k * 60).to(torch.bfloat16).to(DEVICE)
        iq[t, h, 7] = 448 * 2.0**k
    pos = torch.tensor([0, 5, 1000, 4095], dtype=torch.int64, device=DEVICE)
    w = randn((T, H), seed=2, dtype=torch.float32, block=None, octaves=6)
    out = (poison((T, H, 128), torch.float8_e4m3fn), poison((T, H), torch.float32))
    q, none, wo = ix.quantize_q(iq, pos, cs, w, hadamard=hadamard)
    assert none is None and q.dtype == torch.float8_e4m3fn and wo.dtype == torch.float32
    assert not torch.equal(q.view(torch.uint8), out[0].view(torch.uint8))
    qr, _, wr = ix.quantize_q(iq, pos, cs, w, hadamard=hadamard, backend="reference")
    assert_close(q, qr, "exact", "q bytes vs reference")
    assert_close(wo, wr, "exact", "weights_out bits vs reference")
    # independent encoder, given the same rotated fp32 values
    x = ix.reference.prepare_q(iq, pos, cs, hadamard)
    qi, e = fp8_bytes(x)
    assert torch.equal(q.view(torch.uint8).cpu(), qi)
    wi = (w.double().cpu() * torch.exp2(e.double())).float() * fold(H)
    assert torch.equal(wo.cpu(), wi)
    if not hadamard:
        assert e[0, :6].tolist() == [-20, -3, 0, 1, 5, 9]  # byte 127 + k exactly


def test_rope_pairs_and_bf16_round_trip():
    """RoPE = GPT-J rotation of the last 64 dims (checked against complex fp64); the bf16 round trip
    of the rotated dims is what the bytes are made from (docs/indexer.md#pitfalls): dropping it changes bytes."""
    T, H = 4, 8
    cs = table(4096)
    iq = randn((T, H, 128), seed=3, block=32, octaves=4)
    pos = torch.tensor([1, 77, 2048, 4000], dtype=torch.int64, device=DEVICE)
    rot = ix.reference.rope(iq.float(), pos, cs).double().cpu()
    z = iq.double().cpu()[..., 64:].reshape(T, H, 32, 2)
    tab = cs.double().cpu()[pos.cpu()]  # [T, 64]
    zc = torch.complex(z[..., 0], z[..., 1]) * torch.complex(tab[:, None, :32], tab[:, None, 32:])
    expect = torch.cat([iq.double().cpu()[..., :64], torch.stack([zc.real, zc.imag], -1).reshape(T, H, 64)], -1)
    assert float((rot - expect).abs().max()) <= 1e-5 * float(expect.abs().max())
    assert torch.equal(rot[..., :64], iq.double().cpu()[..., :64])  # dims 0..63 untouched
    q, _, _ = ix.quantize_q(iq, pos, cs, torch.ones(T, H, device=DEVICE))
    no_rt, _ = fp8_bytes(ix.reference.rope(iq.float(), pos, cs))  # without the round trip
    assert not torch.equal(q.view(torch.uint8).cpu(), no_rt), "data never crosses a bf16 rounding boundary"


@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_q_mxfp4_exact(hadamard):
    T, H = 4, 8
    cs = table(4096)
    iq = randn((T, H, 128), seed=4, block=32, octaves=12)
    pos = torch.tensor([3, 9, 100, 4095], dtype=torch.int64, device=DEVICE)
    w = randn((T, H), seed=5, dtype=torch.bfloat16, block=None, octaves=6)
    q, sc, wo = ix.quantize_q(iq, pos, cs, w, fmt="mxfp4", hadamard=hadamard)
    assert q.shape == (T, H, 64) and q.dtype == torch.uint8 and sc.shape == (T, H) and sc.dtype == torch.int32
    r = ix.quantize_q(iq, pos, cs, w, fmt="mxfp4", hadamard=hadamard, backend="reference")
    for a, b, n in zip((q, sc, wo), r, ("packed", "scales", "weights_out")):
        assert_close(a, b, "exact", n)
    packed, bytes_ = fp4_bytes(ix.reference.prepare_q(iq, pos, cs, hadamard))
    assert torch.equal(q.cpu(), packed)
    assert torch.equal(sc.cpu().view(torch.uint8).reshape(T, H, 4), bytes_)
    # no weight fold in MXFP4: weights_out = w · 128^-0.5 · H^-0.5 exactly, whatever the q scales
    assert torch.equal(wo.cpu(), (w.float().cpu() * fold(H)))


def test_mxfp4_codes_nibbles_and_scale_packing():
    """Hand-built vectors: E2M1 ties/saturation/signed zero, low nibble = even element, block 0 in the
    low byte of the int32 scale word (docs/indexer.md#mxfp4-half-the-bytes-no-fold)."""
    vals = [0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -2.5, -0.0, -0.1, -6, -5, -0.75, 1.75]
    codes = [0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 12, 8, 8, 15, 14, 10, 4]
    assert [e2m1_brute(v) for v in vals] == codes  # the oracle agrees with the hand table
    assert [e2m1_brute(v) for v in (7.0, 100.0, -9.0)] == [7, 7, 15]  # saturation
    assert ix.reference.e2m1_encode(torch.tensor([7.0, 100.0, -9.0, -0.2, 0.2])).tolist() == [7, 7, 15, 8, 0]
    # one key: block b = the table times 2^kb (block amax 6·2^kb -> byte 127 + kb)
    kb = [0, 3, -2, 1]
    row = torch.zeros(128)
    for b in range(4):
        row[32 * b : 32 * b + len(vals)] = torch.tensor(vals) * 2.0 ** kb[b]
    k = row[None].to(torch.bfloat16).to(DEVICE)
    for backend in ("triton", "reference"):
        packed, sb = ix.quantize_k(k, fmt="mxfp4", backend=backend)
        assert sb[0].tolist() == [127 + x for x in kb]
        c = codes + [0] * (32 - len(codes))
        expect = [c[2 * i] | (c[2 * i + 1] << 4) for i in range(16)] * 4
        assert packed[0].tolist() == expect
    # the Q side packs the 4 scale bytes into one int32, little-endian (block 0 = low byte)
    iq = torch.zeros(1, 1, 128)
    for b in range(4):
        iq[0, 0, 32 * b] = 6.0 * 2.0 ** kb[b]
    cs = table(1)  # position 0: cos 1, sin 0
    _, sc, _ = ix.quantize_q(
        iq.to(torch.bfloat16).to(DEVICE),
        torch.zeros(1, dtype=torch.int64, device=DEVICE),
        cs,
        torch.ones(1, 1, device=DEVICE),
        fmt="mxfp4",
    )
    word = sum((127 + x) << (8 * b) for b, x in enumerate(kb))
    assert int(sc[0, 0]) == word - (1 << 32 if word >= 1 << 31 else 0)


# ---------------------------------------------------------------------------------------------------
# power-of-two invariance (EXACT)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hadamard", [False, True])
def test_power_of_two_invariance(hadamard):
    T, H = 4, 8
    cs = table(4096)
    iq = randn((T, H, 128), seed=6, block=32, octaves=6)
    pos = torch.tensor([2, 50, 600, 4001], dtype=torch.int64, device=DEVICE)
    w = randn((T, H), seed=7, dtype=torch.float32, block=None)
    q0, _, w0 = ix.quantize_q(iq, pos, cs, w, hadamard=hadamard)
    p0, s0, v0 = ix.quantize_q(iq, pos, cs, w, fmt="mxfp4", hadamard=hadamard)
    for k in (-3, 5):
        iqk = iq * 2.0**k  # exact in bf16
        q1, _, w1 = ix.quantize_q(iqk, pos, cs, w, hadamard=hadamard)
        assert torch.equal(q1.view(torch.uint8), q0.view(torch.uint8))
        assert torch.equal(w1, w0 * 2.0**k)
        p1, s1, v1 = ix.quantize_q(iqk, pos, cs, w, fmt="mxfp4", hadamard=hadamard)
        assert torch.equal(p1, p0) and torch.equal(v1, v0)  # MXFP4: no fold, the weights do not move
        b0 = s0.view(torch.uint8).reshape(T, H, 4).int()
        assert torch.equal(s1.view(torch.uint8).reshape(T, H, 4).int(), b0 + k)


# ---------------------------------------------------------------------------------------------------
# Hadamard
# ---------------------------------------------------------------------------------------------------


def test_hadamard_matrix():
    Hm = ix.reference.hadamard_transform(torch.eye(128, device=DEVICE)).double().cpu()
    assert torch.equal(Hm, Hm.t())
    assert float((Hm @ Hm.t() - torch.eye(128, dtype=torch.float64)).abs().max()) < 1e-6
    syl = torch.ones(1, 1, dtype=torch.float64)
    while syl.shape[0] < 128:
        syl = torch.cat([torch.cat([syl, syl], 1), torch.cat([syl, -syl], 1)], 0)
    assert float((Hm - syl * 128**-0.5).abs().max()) < 1e-7
    q, k = randn((64, 128), seed=8, dtype=torch.float32), randn((64, 128), seed=9, dtype=torch.float32)
    dq = (ix.reference.hadamard_transform(q).double() * ix.reference.hadamard_transform(k).double()).sum(-1)
    d = (q.double() * k.double()).sum(-1)
    cond = (q.double().abs() * k.double().abs()).sum(-1)
    assert bool(((dq - d).abs() <= 1e-5 * cond).all())


def _exact_logits(ex, hadamard_q=False):
    """float64 Σ_h w·c·ReLU(x_h·k_s) from the UNquantised rotated q and the bf16 keys, −∞ beyond n_c."""
    x = ix.reference.prepare_q(ex["index_q"], ex["positions"], ex["cos_sin"], hadamard_q).double()
    k = ex["k"].double()
    H = x.shape[1]
    dots = torch.einsum("thd,sd->ths", x, k).clamp_min(0)
    out = torch.einsum("th,ths->ts", ex["weights"].double() * fold(H), dots)
    live = torch.arange(k.shape[0], device=k.device)[None, :] < ix.n_compressed(ex["positions"])[:, None]
    return torch.where(live, out, float("-inf")), x, k


def _recall(lg, ref, kk):
    hits = total = 0
    for t in range(lg.shape[0]):
        n = int(torch.isfinite(ref[t]).sum())
        m = min(kk, n)
        a = set(torch.topk(lg[t, :n].cpu(), m).indices.tolist())
        b = set(torch.topk(ref[t, :n].cpu(), m).indices.tolist())
        hits, total = hits + len(a & b), total + m
    return hits / total


def _rel_l2(a, b):
    f = torch.isfinite(b)
    return float((a.double()[f] - b[f]).norm() / b[f].norm())


def test_hadamard_both_sides_vs_one_side():
    """Rotating q and k together leaves the scores (up to quantisation); rotating one side only
    scrambles them: the "Hadamard on K but not Q" detector (docs/indexer.md#pitfalls)."""
    res = {}
    for hq, hk in [(False, False), (True, True), (True, False), (False, True)]:
        ex = problem(4, 16, 48, hadamard=hk, seed=10)
        q, _, wo = ix.quantize_q(*qargs(ex), hadamard=hq)
        lg = ix.logits(q, None, wo, ex["k_cache"], ex["positions"], block_table=ex["block_table"], block_size=16)
        ref, _, _ = _exact_logits(ex)
        assert torch.equal(torch.isinf(lg).cpu(), torch.isinf(ref).cpu())
        res[hq, hk] = (_rel_l2(lg, ref), _recall(lg, ref, 8))
    for key in [(False, False), (True, True)]:
        assert res[key][0] < 0.1 and res[key][1] >= 0.75, res
    for key in [(True, False), (False, True)]:
        assert res[key][0] > 0.5 and res[key][1] < 0.7, res


# ---------------------------------------------------------------------------------------------------
# fold: fp8 logits vs the unquantised logits within a derived bound; kernel vs reference
# ---------------------------------------------------------------------------------------------------


def _quant_err_bound(x, e):
    """Per-element E4M3 error bound of values x quantised with scale 2^e: max(2^-4|x|, 2^-10·2^e)
    (docs/formats.md: half an ulp for normals, half the subnormal spacing below 2^-6)."""
    return torch.maximum(x.abs() * 2.0**-4, torch.exp2(e.double() - 10)[..., None])


def test_fold_fp8_logits_within_bound_and_topk():
    ex = problem(4, 16, 48, seed=12)
    q, _, wo = ix.quantize_q(*qargs(ex))
    lg = ix.logits(q, None, wo, ex["k_cache"], ex["positions"], block_table=ex["block_table"], block_size=16)
    ref, x, k = _exact_logits(ex)
    _, eq = fp8_bytes(x.float())
    _, ek = fp8_bytes(k.float())
    dq, dk = _quant_err_bound(x.cpu(), eq), _quant_err_bound(k.cpu(), ek)
    xa, ka = x.abs().cpu(), k.abs().cpu()
    # |x·k − x̂·k̂| ≤ Σ_d |x|δk + δq|k| + δqδk; ReLU is 1-Lipschitz; |w·c| weights each head
    per_head = torch.einsum("thd,sd->ths", xa, dk) + torch.einsum("thd,sd->ths", dq, ka) + torch.einsum("thd,sd->ths", dq, dk)
    bound = torch.einsum("th,ths->ts", ex["weights"].double().abs().cpu() * fold(16), per_head)
    f = torch.isfinite(ref.cpu())
    err = (lg.double().cpu() - ref.cpu()).abs()
    assert bool((err[f] <= bound[f] * (1 + 1e-6) + 1e-30).all())
    rel = err[f] / ref.cpu().abs()[f].clamp_min(1e-30)
    assert float(rel.median()) < 0.05  # "a few %" (docs/indexer.md#numerics)
    # without the fold (weights · c only, the q scale forgotten) the logits leave the bound
    nofold = (
        ix.logits(
            q,
            None,
            (ex["weights"] * fold(16)).float(),
            ex["k_cache"],
            ex["positions"],
            block_table=ex["block_table"],
            block_size=16,
            backend="reference",
        )
        .double()
        .cpu()
    )
    assert not bool(((nofold - ref.cpu()).abs()[f] <= bound[f]).all())
    # top-k: recall >= 0.9, and the exact set wherever the k-th gap exceeds twice the bound
    assert _recall(lg, ref, 8) >= 0.9
    for t in range(4):
        n = int(f[t].sum())
        vals, ids = torch.topk(ref.cpu()[t, :n], 9)
        if float(vals[7] - vals[8]) > 2 * float(bound[t, :n].max()):
            assert set(torch.topk(lg.cpu()[t, :n], 8).indices.tolist()) == set(ids[:8].tolist())


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_logits_kernel_vs_reference(fmt):
    """Paged keys through per-token (different-request) shuffled block tables, ragged positions."""
    T, H, Bc = 4, 8, 16
    ex = problem(T, H, 64, fmt=fmt, seed=13)
    # give each token its own request: a different page permutation over a bigger cache
    g = generator(14)
    pages = ex["k_cache"].shape[0]
    bts = torch.stack([torch.randperm(pages, generator=g)[:4] for _ in range(T)]).to(torch.int32).to(DEVICE)
    cache = ix.allocate_k_cache(pages, Bc, fmt)
    ks = [randn((64, 128), seed=20 + t, block=32, octaves=8) for t in range(T)]
    # token t's rows go to its own pages; tokens share pages here only when the permutations collide,
    # so write token by token and build the oracle from what is finally in the cache
    for t in range(T):
        s = torch.arange(64, device=DEVICE)
        ix.insert_k(cache, ks[t], bts[t].long()[s // Bc] * Bc + s % Bc, block_size=Bc, fmt=fmt)
    pos = torch.tensor([255, 130, 3, 2], dtype=torch.int64, device=DEVICE)
    q, qs, wo = ix.quantize_q(ex["index_q"], pos, ex["cos_sin"], ex["weights"], fmt=fmt)
    lg = ix.logits(q, qs, wo, cache, pos, block_table=bts, block_size=Bc)
    ref = ix.reference.logits(q, qs, wo, cache, pos, bts, block_size=Bc, n_out=64, dtype=torch.float64)
    assert lg.shape == (T, 64)
    cond = ix.reference.logits_condition(q, qs, wo, cache, pos, bts, block_size=Bc, n_out=64)
    # fp32 accumulation of exact products: error <= ~K·2^-24 of the condition sum (fp8), plus the bf16
    # roundings of the MXFP4 scores
    assert_logits(lg, ref, cond, fmt, "logits / condition")
    assert torch.isinf(lg[3]).all() and torch.isfinite(lg[2, :1]).all() and torch.isinf(lg[2, 1:]).all()


def test_relu_per_head_before_sum():
    ex = problem(2, 16, 32, seed=15)
    q, _, wo = ix.quantize_q(*qargs(ex))
    lg = ix.logits(q, None, wo, ex["k_cache"], ex["positions"], block_table=ex["block_table"], block_size=16)
    qv = q.double()
    vals, sc = ix.read_k(ex["k_cache"], ex["slots"], block_size=16)
    dots = torch.einsum("thd,sd->ths", qv, vals.double()) * sc.double()  # [T, H, S]
    assert bool((dots < 0).any()) and bool((dots > 0).any())
    w = wo.double()[:, :, None]
    per_head = (w * dots.clamp_min(0)).sum(1)
    after_sum = (w * dots).sum(1).clamp_min(0)
    no_relu = (w * dots).sum(1)
    f = torch.isfinite(lg)
    scale = float(per_head.abs().max())
    assert float((lg.double() - per_head)[f].abs().max()) < 1e-5 * scale
    assert float((lg.double() - after_sum)[f].abs().max()) > 1e-2 * scale
    assert float((lg.double() - no_relu)[f].abs().max()) > 1e-2 * scale


def test_mxfp4_bf16_score_tolerance_has_teeth():
    """The MXFP4 scores (bf16 at DeepSeek's three points) pass ``indexer_logits_bf16`` against the float64 oracle,
    and real bugs still fail it: ReLU after the head sum, no ReLU, the weights without c = 128^-½·n^-½."""
    ex = problem(2, 64, 64, fmt="mxfp4", hadamard=True, seed=16)
    q, qs, wo = ix.quantize_q(*qargs(ex), fmt="mxfp4", hadamard=True)
    args = (q, qs, wo, ex["k_cache"], ex["positions"], ex["block_table"])
    lg = ix.logits(*args[:5], block_table=ex["block_table"], block_size=16).double()
    cond = ix.reference.logits_condition(*args, block_size=16, n_out=lg.shape[1])
    ref = ix.reference.logits(*args, block_size=16, n_out=lg.shape[1])
    assert_close(lg, ref, "indexer_logits_bf16", "MXFP4 scores", mass=cond)
    vals, sc = ix.read_k(ex["k_cache"], ex["slots"], block_size=16, fmt="mxfp4")
    dots = torch.einsum("thd,sd->ths", ix.dequantize_q(q, qs).double(), ix.dequantize_k(vals, sc).double())
    w = wo.double()[:, :, None]
    f = torch.isfinite(lg)
    for bug in ((w * dots).sum(1).clamp_min(0), (w * dots).sum(1), (w * dots.clamp_min(0)).sum(1) / ix.reference.fold(64)):
        assert not compare(lg[f], bug[f], "indexer_logits_bf16", mass=cond[f]).passed


# ---------------------------------------------------------------------------------------------------
# causal mask, shortcut, top-k
# ---------------------------------------------------------------------------------------------------


def test_causal_mask_p2_none_p3_id0():
    pos = torch.arange(0, 12, dtype=torch.int64, device=DEVICE)
    ex = problem(12, 8, 16, seed=16, positions=pos)
    q, _, wo = ix.quantize_q(*qargs(ex))
    lg = ix.logits(q, None, wo, ex["k_cache"], pos, block_table=ex["block_table"], block_size=16, n_out=4)
    n_c = ((pos + 1) // 4).tolist()
    assert n_c == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    for t in range(12):
        assert torch.isfinite(lg[t, : n_c[t]]).all() and torch.isinf(lg[t, n_c[t] :]).all()
    for full in (ix.topk(lg, 4), ix.topk(lg, 4, positions=pos)):
        assert full[2].tolist() == [-1, -1, -1, -1]  # p = 2: nothing visible
        assert full[3].tolist() == [0, -1, -1, -1]  # p = 3: exactly id 0
        for t in range(12):
            ids = [i for i in full[t].tolist() if i >= 0]
            assert sorted(ids) == list(range(n_c[t]))


def test_topk_distinct_matches_torch_topk():
    lg = torch.randn(5, 200, generator=generator(17), dtype=torch.float64).float().to(DEVICE)
    got = ix.topk(lg, 16)
    assert got.dtype == torch.int32 and got.shape == (5, 16)
    ref = torch.topk(lg, 16, dim=1).indices
    assert torch.equal(got.sort(1).values.long().cpu(), ref.sort(1).values.cpu())


def test_topk_ties_short_rows_and_out_buffer():
    lg = torch.randint(0, 4, (3, 50), generator=generator(18)).float().to(DEVICE)  # many ties
    got = ix.topk(lg, 10)
    for t in range(3):
        ids = got[t].long()
        assert len(set(ids.tolist())) == 10
        assert torch.equal(lg[t, ids].sort(descending=True).values, torch.topk(lg[t], 10).values)
    short = torch.full((2, 6), float("-inf"), device=DEVICE)
    short[0, :3] = torch.tensor([1.0, 3.0, 2.0])
    out = torch.full((2, 8), 1234, dtype=torch.int32, device=DEVICE)
    r = ix.topk(short, 8, out=out)
    assert r is out and r[0].tolist() == [1, 2, 0, -1, -1, -1, -1, -1] and r[1].tolist() == [-1] * 8


def test_shortcut_equals_full_path():
    pos = torch.tensor([3, 17, 40, 63, 0], dtype=torch.int64, device=DEVICE)  # n_c = 1, 4, 10, 16, 0 <= k
    ex = problem(5, 8, 16, seed=19, positions=pos)
    q, _, wo = ix.quantize_q(*qargs(ex))
    lg = ix.logits(q, None, wo, ex["k_cache"], pos, block_table=ex["block_table"], block_size=16)
    full = ix.topk(lg, 16)
    fast = ix.topk(None, 16, positions=pos)
    assert torch.equal(full.sort(1).values, fast.sort(1).values)
    assert torch.equal(ix.select(q, None, wo, ex["k_cache"], pos, 16, block_table=ex["block_table"], block_size=16), fast)
    assert fast[1].tolist()[:5] == [0, 1, 2, 3, -1]
    with pytest.raises(ValueError, match="logits"):
        ix.topk(None, 8, positions=pos)  # n_c = 16 > 8: the shortcut does not apply


# ---------------------------------------------------------------------------------------------------
# local -> global
# ---------------------------------------------------------------------------------------------------


def test_to_global_shuffled_tables_invalid_tokens():
    Bc, T, k = 4, 4, 6
    g = generator(20)
    bt = torch.stack([torch.randperm(20, generator=g)[:5] for _ in range(T)]).to(torch.int32)
    local = torch.tensor([[0, 5, 19, -1, -1, -1], [3, 4, 7, 8, 12, 1], [-1] * 6, [2, -1, -1, -1, -1, -1]], dtype=torch.int32)
    slots = torch.tensor([10, -1, 11, 12], dtype=torch.int64)  # token 1 is padding
    glob, n = ix.to_global(local.to(DEVICE), bt.to(DEVICE), slots.to(DEVICE), block_size=Bc)
    for t in range(T):
        for j in range(k):
            l = int(local[t, j])
            want = -1 if l < 0 or slots[t] < 0 else int(bt[t, l // Bc]) * Bc + l % Bc
            assert int(glob[t, j]) == want
    assert n.tolist() == [3, 0, 0, 1] and n.dtype == torch.int32 and glob.dtype == torch.int64
    with pytest.raises(ValueError, match="topk_local"):
        ix.to_global(torch.tensor([[20]], dtype=torch.int32, device=DEVICE), bt[:1].to(DEVICE), block_size=Bc)


# ---------------------------------------------------------------------------------------------------
# K cache: writer/reader bytes, layout, untouched bytes
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_k_cache_writer_reader(fmt):
    Bc, pages = 16, 3
    k = randn((20, 128), seed=21, block=32, octaves=10)
    slots = torch.randperm(pages * Bc, generator=generator(21))[:18].to(DEVICE)  # 2 rows of padding
    slots[4] = -1
    snap = torch.randint(0, 256, (pages, ix.k_page_bytes(Bc, fmt)), generator=generator(22), dtype=torch.uint8).to(DEVICE)
    a, b = snap.clone(), snap.clone()
    ix.insert_k(a, k, slots, block_size=Bc, fmt=fmt)
    ix.insert_k(b, k, slots, block_size=Bc, fmt=fmt, backend="reference")
    assert torch.equal(a, b)
    assert ix.k_page_bytes(64, fmt) == 64 * (132 if fmt == "fp8" else 68)
    # layout golden: the row written to slot s sits at page s//Bc, offset (s%Bc)·V; its scale after Bc·V
    V = 128 if fmt == "fp8" else 64
    vals, sc = ix.quantize_k(k, fmt=fmt)
    written = torch.zeros(pages * Bc, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        written[s] = True
        p, o = divmod(s, Bc)
        assert torch.equal(a[p, o * V : (o + 1) * V], vals[i].view(torch.uint8))
        assert torch.equal(a[p, Bc * V + 4 * o : Bc * V + 4 * o + 4], sc[i : i + 1].contiguous().view(torch.uint8).reshape(4))
    # untouched records keep their bytes
    for s in range(pages * Bc):
        if not written[s]:
            p, o = divmod(s, Bc)
            assert torch.equal(a[p, o * V : (o + 1) * V], snap[p, o * V : (o + 1) * V])
    rv, rs = ix.read_k(a, slots, block_size=Bc, fmt=fmt)
    keep = slots >= 0
    assert torch.equal(rv[keep].view(torch.uint8), vals[:18][keep].view(torch.uint8))
    assert torch.equal(rs[keep], sc[:18][keep])
    if fmt == "fp8":  # scales are fp32 powers of two (docs/indexer.md#pitfalls) and differ between rows
        bits = sc.view(torch.int32)
        assert bool(((bits & 0x7FFFFF) == 0).all()) and len(set(bits.tolist())) > 3
        qi, e = fp8_bytes(k.float())
        assert torch.equal(vals.view(torch.uint8).cpu(), qi) and torch.equal(sc.cpu(), torch.exp2(e.float()))
    else:
        packed, by = fp4_bytes(k.float())
        assert torch.equal(vals.cpu(), packed) and torch.equal(sc.cpu(), by)


def fwht_f32(x: np.ndarray) -> np.ndarray:
    """The fast Walsh-Hadamard transform in numpy fp32, written out as the textbook in-place loop (stage
    h = 1, 2, …, 64: a[j], a[j+h] = a[j] + a[j+h], a[j] − a[j+h]), then × fp32(128^-½); rows in parallel."""
    a = x.astype(np.float32).copy()
    h = 1
    while h < 128:
        for i in range(0, 128, 2 * h):
            for j in range(i, i + h):
                u, v = a[:, j].copy(), a[:, j + h].copy()
                a[:, j], a[:, j + h] = u + v, u - v
        h *= 2
    return a * np.float32(128**-0.5)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_insert_k_hadamard_reference_vs_oracle_and_triton(fmt):
    """The REFERENCE indexer-K writer with the Hadamard rotation on, held to an independent
    oracle (numpy fp32 FWHT, rounded to bf16 as DeepSeek's ``rotate_activation`` returns it, + this file's
    encoders + the page layout written out here) and to the Triton writer, byte for byte, on a cache of
    random bytes."""
    Bc, pages = 8, 3
    k = randn((20, 128), seed=36, block=32, octaves=10)
    k[3, :] = 0.0  # an all-zero key: the amax floor
    slots = torch.randperm(pages * Bc, generator=generator(36))[:18].to(DEVICE)
    slots[[2, 11]] = -1
    snap = torch.randint(0, 256, (pages, ix.k_page_bytes(Bc, fmt)), generator=generator(37), dtype=torch.uint8)
    ref, tri = snap.clone().to(DEVICE), snap.clone().to(DEVICE)
    ix.insert_k(ref, k, slots, block_size=Bc, fmt=fmt, hadamard=True, backend="reference")
    ix.insert_k(tri, k, slots, block_size=Bc, fmt=fmt, hadamard=True, backend="triton")
    rot = torch.from_numpy(fwht_f32(k.float().cpu().numpy())).to(torch.bfloat16).float()
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < 128:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    exact = k.double().cpu() @ H * 128**-0.5  # the oracle is a Hadamard rotation (to fp32 rounding)
    assert float((rot.double() - exact).abs().max()) <= 2**-8 * float(exact.abs().max())
    expect = snap.clone()
    V = 128 if fmt == "fp8" else 64
    if fmt == "fp8":
        vals, e = fp8_bytes(rot)
        scale = torch.exp2(e.float()).contiguous().view(torch.uint8).reshape(-1, 4)
    else:
        vals, scale = fp4_bytes(rot)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            p, o = divmod(s, Bc)
            expect[p, o * V : (o + 1) * V] = vals[i]
            expect[p, Bc * V + 4 * o : Bc * V + 4 * o + 4] = scale[i]
    assert torch.equal(ref.cpu(), expect), "reference writer vs the independent oracle"
    assert torch.equal(tri, ref), "Triton writer vs the reference writer"
    plain = snap.clone().to(DEVICE)
    ix.insert_k(plain, k, slots, block_size=Bc, fmt=fmt, hadamard=False, backend="reference")
    assert not torch.equal(plain, ref)  # the rotation changes the bytes: the flag is honoured


# ---------------------------------------------------------------------------------------------------
# weight provenance, errors, launch choices, torch.compile
# ---------------------------------------------------------------------------------------------------


def test_weights_follow_x_not_qr():
    T, H, Hd, q_lora = 4, 8, 32, 16
    x = randn((T, Hd), seed=23, block=None)
    qr = randn((T, q_lora), seed=24, block=None)
    W = randn((H, Hd), seed=25, dtype=torch.float32, block=None, octaves=0)
    w = ix.head_weights(x, W)
    assert torch.equal(w, x.float() @ W.t())
    with pytest.raises(ValueError, match="x: expected width"):
        ix.head_weights(qr, W)  # qr has the wrong width: it cannot be the input of weights_proj
    cs = table(64)
    iq = randn((T, H, 128), seed=26, block=32)
    pos = torch.tensor([3, 7, 11, 63], dtype=torch.int64, device=DEVICE)
    _, _, wo = ix.quantize_q(iq, pos, cs, w)
    _, e = fp8_bytes(ix.reference.prepare_q(iq, pos, cs))
    assert torch.equal(wo.cpu(), (w.cpu().double() * torch.exp2(e.double())).float() * fold(H))  # taken as given
    w2 = ix.head_weights(randn((T, Hd), seed=27, block=None), W)
    _, _, wo2 = ix.quantize_q(iq, pos, cs, w2)
    assert torch.equal(wo2.cpu(), (w2.cpu().double() * torch.exp2(e.double())).float() * fold(H))


def test_bad_input_errors():
    cs = table(16)
    iq = randn((2, 4, 128), seed=28)
    pos = torch.tensor([1, 2], dtype=torch.int64, device=DEVICE)
    w = torch.ones(2, 4, device=DEVICE)
    with pytest.raises(TypeError, match="index_q"):
        ix.quantize_q(iq.float(), pos, cs, w)
    with pytest.raises(ValueError, match="index_q"):
        ix.quantize_q(randn((2, 4, 64), seed=0), pos, cs, w)
    with pytest.raises(ValueError, match="fmt"):
        ix.quantize_q(iq, pos, cs, w, fmt="nvfp4")
    with pytest.raises(ValueError, match="positions"):
        ix.quantize_q(iq, torch.tensor([1, 16], device=DEVICE), cs, w)
    with pytest.raises(ValueError, match="cos_sin"):
        ix.quantize_q(iq, pos, cs[:, :32], w)
    with pytest.raises(ValueError, match="weights"):
        ix.quantize_q(iq, pos, cs, torch.ones(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="backend"):
        ix.quantize_q(iq, pos, cs, w, backend="cuda")
    q, _, wo = ix.quantize_q(iq, pos, cs, w)
    small = ix.allocate_k_cache(2, 8)
    with pytest.raises(ValueError, match="k_cache"):
        ix.logits(q, None, wo, small, pos, block_size=16)
    with pytest.raises(TypeError, match="block_size"):
        ix.logits(q, None, wo, ix.allocate_k_cache(2, 16), pos, block_size=16.0)
    with pytest.raises(ValueError, match="k_cache: pages of 2112 bytes hold 16 fp8 keys"):
        ix.logits(q, None, wo, ix.allocate_k_cache(2, 16), pos, block_size=8)  # regression: a 16-key page read as 8
    with pytest.raises(TypeError, match="q"):
        ix.logits(
            q, torch.zeros(2, 4, dtype=torch.int32, device=DEVICE), wo, ix.allocate_k_cache(2, 16, "mxfp4"), pos, block_size=16
        )
    with pytest.raises(ValueError, match="block_table"):
        ix.logits(
            q,
            None,
            wo,
            ix.allocate_k_cache(2, 16),
            torch.tensor([200, 3], device=DEVICE),
            block_size=16,
            block_table=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE),
        )
    with pytest.raises(ValueError, match="block_table"):
        ix.logits(
            q,
            None,
            wo,
            ix.allocate_k_cache(2, 16),
            torch.tensor([40, 3], device=DEVICE),
            block_size=16,
            block_table=torch.full((2, 1), 5, dtype=torch.int32, device=DEVICE),
        )
    with pytest.raises(ValueError, match="k"):
        ix.topk(torch.zeros(2, 3, device=DEVICE), 0)
    with pytest.raises(ValueError, match="slots"):
        ix.insert_k(ix.allocate_k_cache(1, 16), randn((2, 128), seed=0), torch.tensor([0, 16], device=DEVICE), block_size=16)
    with pytest.raises(ValueError, match="k"):
        ix.quantize_k(randn((2, 64), seed=0))


def test_block_size_required_and_backend_names():
    """block_size has no default wherever a cache is passed; backend takes names from validate.BACKENDS."""
    ex = problem(2, 4, 16, seed=33)
    q, _, wo = ix.quantize_q(*qargs(ex), backend="auto")
    with pytest.raises(TypeError, match="block_size"):
        ix.logits(q, None, wo, ex["k_cache"], ex["positions"], block_table=ex["block_table"])
    with pytest.raises(TypeError, match="block_size"):
        ix.insert_k(ex["k_cache"], ex["k"], ex["slots"])
    with pytest.raises(TypeError, match="block_size"):
        ix.read_k(ex["k_cache"], ex["slots"])
    with pytest.raises(ValueError, match="backend"):
        ix.quantize_q(*qargs(ex), backend="two_pass")  # in validate.BACKENDS, but not an indexer backend


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_launch_choices_do_not_change_results(fmt):
    """IndexerLaunch is passed explicitly; other tile sizes give the same bytes and the same logits."""
    ex = problem(3, 8, 64, fmt=fmt, seed=34)
    other = ix.IndexerLaunch(quant_rows=32, logits_pages=2)
    a = ix.quantize_q(*qargs(ex), fmt=fmt, hadamard=True)
    b = ix.quantize_q(*qargs(ex), fmt=fmt, hadamard=True, launch=other)
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    kw = dict(block_table=ex["block_table"], block_size=16)
    la = ix.logits(a[0], a[1], a[2], ex["k_cache"], ex["positions"], **kw)
    lb = ix.logits(a[0], a[1], a[2], ex["k_cache"], ex["positions"], **kw, launch=other)
    assert torch.equal(la, lb)
    # the integer fp16 decodes (fp4_decode=): each within the fp32 summation tolerance of the float64 oracle,
    # -inf and NaN in its places, on real magnitudes and hard scale bytes: test_mxfp4_decodes_real_and_hard_scale_bytes
    cache = ix.allocate_k_cache(ex["k_cache"].shape[0], 16, fmt)
    ix.insert_k(cache, ex["k"], ex["slots"], block_size=16, fmt=fmt, launch=ix.IndexerLaunch(quant_rows=4))
    assert torch.equal(cache, ex["k_cache"])
    with pytest.raises(ValueError, match="quant_rows"):
        ix.IndexerLaunch(quant_rows=12)


def test_e2m1_f16_decode_is_exact_for_every_byte():
    """fp4_decode="f16_blocks" builds fp16 bits from each packed byte with integer shifts: for all 256 bytes
    and both nibbles the value is exactly e2m1(code)·2^-14 (code 1 on the fp16 subnormal 2^-15, code 0 on
    ±0, the sign in bit 15)."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode(b_ptr, lo_ptr, hi_ptr):
        i = tl.arange(0, 256)
        b = tl.load(b_ptr + i).to(tl.int32)
        tl.store(lo_ptr + i, ix.kernels.e2m1_f16(b, False))
        tl.store(hi_ptr + i, ix.kernels.e2m1_f16(b, True))

    b = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    lo, hi = (torch.empty(256, dtype=torch.float16, device=DEVICE) for _ in range(2))
    decode[(1,)](b, lo, hi)
    codes = torch.stack([b & 15, b >> 4]).cpu()
    want = ix.reference.e2m1_decode(codes).double() * 2.0**-14
    assert torch.equal(torch.stack([lo, hi]).cpu().double(), want)
    assert torch.equal(torch.signbit(torch.stack([lo, hi]).cpu()), (codes & 8) != 0)  # −0 for code 8 too
    assert lo[1].item() == 2.0**-15 and hi[0x10].item() == 2.0**-15  # the subnormal: 0.5·2^-14


def _dot_order(v: torch.Tensor) -> torch.Tensor:
    """[..., 128] values in dim order -> the K order of the f16_scaled operands (kernels.dot_order): dim
    32·b + 2·c + n (block b, byte c of the block, nibble n) goes to position 2·(4·c + b) + n."""
    return v.reshape(*v.shape[:-1], 4, 16, 2).transpose(-3, -2).reshape(v.shape)


def _scaled_operand_case():
    """Scale-byte patterns for f16_scaled's operand builders, with the expected "fast path" flag: spans at and
    past the exact limits (K_SPAN 24 for keys, Q_SPAN 36 for queries), largest bytes at and past SCALED_LO /
    SCALED_HI, and the hard bytes 0, 1, 254, 255. Every packed byte 0..255 appears in the codes (64 per row)."""
    k = ix.kernels
    lo, hi = k.SCALED_LO.value, k.SCALED_HI.value
    pats = []
    for top in (lo, 127, hi):
        for span in range(k.Q_SPAN.value + 2):
            pats.append(([top, top - span, top - span // 2, top], span))
    pats += [
        ([lo - 1] * 4, 99),
        ([hi + 1] * 4, 99),
        ([0, 127, 127, 127], 127),
        ([1, 1, 1, 1], 99),
        ([254, 200, 254, 254], 99),
        ([127, 255, 127, 127], 99),
        ([0, 0, 0, 0], 99),
    ]
    byts = torch.tensor([p for p, _ in pats], dtype=torch.uint8)
    spans = torch.tensor([sp for _, sp in pats])
    codes = torch.arange(64 * len(pats), dtype=torch.int64).reshape(len(pats), 64) * 37 % 256
    return codes.to(torch.uint8), byts, spans


def test_f16_scaled_operands_exact_and_fast_range():
    """fp4_decode="f16_scaled" folds each vector's block scales, relative to its largest, into fp16 operands:
    keys e2m1·2^(byte − top + 1) (integer decode × one fp16 multiply), queries e2m1·2^(byte − top + 13). Within
    the fast range (span <= 24 for keys, <= 36 for queries, top in [64, 190]) every value is exact, down to the
    fp16 subnormals at the span limits; outside it the builders say so, and the kernel takes its exact slow
    path (test_mxfp4_decodes_real_and_hard_scale_bytes)."""
    import triton
    import triton.language as tl

    kern = ix.kernels  # host-side constants; the jit function reaches the helpers through ix

    @triton.jit
    def build(kb_ptr, ks_ptr, kv_ptr, ktop_ptr, kok_ptr, qT_ptr, qtop_ptr, qok_ptr, INTERPRET: tl.constexpr):
        r = tl.program_id(0) * 16 + tl.arange(0, 16)
        c = tl.arange(0, 64)
        kb = tl.load(kb_ptr + r[:, None] * 64 + c[None, :])
        ksb = tl.load(ks_ptr + r[:, None] * 4 + tl.arange(0, 4)[None, :]).to(tl.int32)
        kv, ktop, kok = ix.kernels.fp4_k_scaled(kb, ksb, 16, INTERPRET)
        tl.store(kv_ptr + r[:, None] * 128 + tl.arange(0, 128)[None, :], kv)
        tl.store(ktop_ptr + r, ktop)
        tl.store(kok_ptr + r, kok.to(tl.int32))
        qT, qtop, qok = ix.kernels.fp4_q_scaled(kb_ptr, ks_ptr, r, r >= 0, 16, INTERPRET)
        tl.store(qT_ptr + tl.arange(0, 128)[:, None] * 16 + (r - tl.program_id(0) * 16)[None, :] + tl.program_id(0) * 2048, qT)
        tl.store(qtop_ptr + r, qtop)
        tl.store(qok_ptr + r, qok.to(tl.int32))

    codes, byts, spans = _scaled_operand_case()
    n = -(-codes.shape[0] // 16) * 16
    codes = torch.cat([codes, codes[: n - codes.shape[0]]])
    byts, spans = torch.cat([byts, byts[: n - byts.shape[0]]]), torch.cat([spans, spans[: n - spans.shape[0]]])
    kv = torch.empty(n, 128, dtype=torch.float16, device=DEVICE)
    qT = torch.empty(n // 16, 128, 16, dtype=torch.float16, device=DEVICE)
    ktop, kok, qtop, qok = (torch.empty(n, dtype=torch.int32, device=DEVICE) for _ in range(4))
    build[(n // 16,)](codes.to(DEVICE), byts.to(DEVICE), kv, ktop, kok, qT, qtop, qok, interpreting())
    top = byts.int().amax(1)
    in_range = (top >= kern.SCALED_LO.value) & (top <= kern.SCALED_HI.value)
    assert torch.equal(ktop.cpu(), top) and torch.equal(qtop.cpu(), top)
    assert torch.equal(kok.cpu().bool(), in_range & (spans <= kern.K_SPAN.value))
    assert torch.equal(qok.cpu().bool(), in_range & (spans <= kern.Q_SPAN.value))
    e2m1 = ix.reference.e2m1_decode(ix.reference.unpack_nibbles(codes)).double()  # [n, 128] in dim order
    rel = (byts.double() - top[:, None].double()).repeat_interleave(32, 1)
    neg = _dot_order((ix.reference.unpack_nibbles(codes) & 8) != 0)
    got_k, got_q = kv.cpu().double(), qT.cpu().permute(0, 2, 1).reshape(n, 128).double()
    for got, shift, ok in ((got_k, 1, kok), (got_q, 13, qok)):
        want = _dot_order(e2m1 * torch.exp2(rel + shift))
        fast = ok.cpu().bool()
        assert torch.equal(got[fast], want[fast]) and torch.equal(torch.signbit(got[fast]), neg[fast])
    assert bool((spans[kok.cpu().bool()] == kern.K_SPAN.value).any())  # the limits themselves are exact
    assert bool((spans[qok.cpu().bool()] == kern.Q_SPAN.value).any())


@functools.cache  # every decode reads the same problem (nothing writes it)
def _hard_scale_problem(seed=40):
    """Real magnitudes (example_inputs: RoPE, bf16, Hadamard, blocks spread over 8 octaves) through the
    quantisers, then scale bytes set by hand: queries and keys at the exact limits of f16_scaled's fast path
    (span 24 / 36, top 64 / 190), just past them (span 25 / 37, top 191), and the hard bytes 0, 1, 254 and 255.
    Every product of a key scale and a query scale stays a normal fp32 number (the f16_blocks method's exact
    range), so the float64 oracle rounded once is the right answer."""
    T, H, Bc, n = 4, 8, 16, 128
    pos = torch.tensor([4 * 96 - 1] + [4 * n - 1] * (T - 1))  # token 0 sees keys 0..95, the others all 128
    ex = ix.example_inputs(T, H, n, block_size=Bc, fmt="mxfp4", seed=seed, hadamard=True, positions=pos)
    q, qs, wo = ix.quantize_q(ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"], fmt="mxfp4", hadamard=True)
    qb = qs.view(torch.uint8).reshape(T, H, 4).clone()
    cache = ex["k_cache"].clone()

    def set_key(s, byts):  # the 4 scale bytes of local key s
        page, off = divmod(int(ex["slots"][s]), Bc)
        cache[page, Bc * 64 + 4 * off : Bc * 64 + 4 * off + 4] = torch.tensor(byts, dtype=torch.uint8)

    def key_top(s):
        page, off = divmod(int(ex["slots"][s]), Bc)
        return int(cache[page, Bc * 64 + 4 * off : Bc * 64 + 4 * off + 4].max())

    # keys 0..63: the first program of 4 pages, fast with its limit cases; keys 64..127: slow (hard bytes)
    t0 = key_top(5)
    set_key(5, [t0, t0 - 24, t0 - 7, t0])  # span 24: the fast path's limit
    set_key(20, [90, 66, 70, 80])  # small values, span 24
    set_key(70, [t0, t0 - 25, t0, t0])  # span 25: its program goes the slow way
    set_key(75, [0, 127, 120, 127])  # 2^-127 (the E8M0 subnormal) next to ordinary blocks
    set_key(90, [1, 1, 1, 1])  # the encoder's floor
    set_key(99, [127, 254, 110, 127])  # 2^127 (its products stay in range: the queries' block 1 is small) …
    page, off = divmod(int(ex["slots"][99]), Bc)
    cache[page, 64 * off + 16 : 64 * off + 32] &= 0xBB  # … and its codes <= 1.5: 6·2^127 is past fp32's range
    set_key(120, [127, 255, 127, 127])  # E8M0 NaN: NaN scores for this key
    qb[:, :, 1] = torch.minimum(qb[:, :, 1], torch.tensor(115, dtype=torch.uint8))
    qb[0, 2] = torch.tensor([190, 170, 166, 180], dtype=torch.uint8)  # top 190 (token 0 does not see key 99)
    qb[1, 4] = torch.tensor([100, 64, 100, 90], dtype=torch.uint8)  # span 36: the queries' limit
    qb[2, 1] = torch.tensor([100, 63, 100, 90], dtype=torch.uint8)  # span 37: token 2 goes the slow way
    qb[3, 6] = torch.tensor([191, 110, 170, 171], dtype=torch.uint8)  # top 191: token 3 too
    return ex, q, qb.view(torch.int32).reshape(T, H), wo, cache


@pytest.mark.parametrize("dec", ix.launch.FP4_DECODES)
def test_mxfp4_decodes_real_and_hard_scale_bytes(dec):
    """Every MXFP4 decode equals the float64 oracle within the normalised "fp32_dot" row, NaN and −∞ in the
    same places, on real magnitudes with scale bytes at and past f16_scaled's exact limits and the hard bytes
    0, 1, 254, 255 (one program per token takes f16_scaled's fast path, one its slow path)."""
    ex, q, qs, wo, cache = _hard_scale_problem()
    args = (q, qs, wo, cache, ex["positions"], ex["block_table"])
    ref = ix.reference.logits(*args, block_size=16, n_out=128, dtype=torch.float64)
    cond = ix.reference.logits_condition(*args, block_size=16, n_out=128)
    assert bool(ref[1:, 120].isnan().all()) and int(ref.isnan().sum()) == 3 and bool(ref[0, 96:].isneginf().all())
    # (pages, pages per dot, tokens). The other tilings run tokens 0 and 1: they read every key byte (the hard
    # ones too), take f16_scaled's fast path (keys 0..63) and its slow one (keys 64..127), and token 0 has a
    # program with no visible key at 2 pages. The query bytes of tokens 2 and 3 only send f16_scaled the slow
    # way, which decodes a page at a time whatever the tiling: (4, 1) runs them. Pages per dot shape the fast
    # path only (f16_scaled).
    tiles = [(4, 1, 4), (2, 1, 2)] + ([(4, 2, 2), (4, 4, 2)] if dec == "f16_scaled" else [])
    for pages, tile, n in tiles:
        lg = ix.launch.logits(
            q[:n],
            qs[:n],
            wo[:n],
            cache,
            ex["positions"][:n],
            ex["block_table"][:n],
            16,
            128,
            ix.IndexerLaunch(fp4_decode=dec, logits_pages=pages, logits_tile_pages=tile),
        )
        r, c = ref[:n], cond[:n]
        assert torch.equal(lg.isnan(), r.isnan()) and torch.equal(lg == float("-inf"), r == float("-inf"))
        f = r.isfinite()
        assert_logits(lg[f], r[f], c[f], "mxfp4", f"{dec} pages {pages} tile {tile}")


def test_quantize_q_torch_compile_fullgraph():
    """The custom ops trace through their fake implementations: no graph break under fullgraph=True.
    backend="aot_eager" runs dynamo + AOTAutograd (which needs register_fake) without a C++ build,
    keeping this test fast on the 2-core CI; inductor is shown in notebook 05."""
    torch._dynamo.reset()
    cs = table(64)
    iq = randn((2, 4, 128), seed=29)
    pos = torch.tensor([5, 60], dtype=torch.int64, device=DEVICE)
    w = randn((2, 4), seed=30, dtype=torch.float32, block=None)

    def f(iq, pos, cs, w):
        q, _, wo = ix.quantize_q(iq, pos, cs, w)
        p, s, wo4 = ix.quantize_q(iq, pos, cs, w, fmt="mxfp4", hadamard=True)
        return q.view(torch.uint8), wo * 2, p, s, wo4

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(iq, pos, cs, w)
    want = f(iq, pos, cs, w)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.skipif(interpreting(), reason="GPU-only size: the real V4-Flash shapes (64 heads, 2048 keys)")
def test_real_shapes_gpu():
    ex = problem(8, 64, 2048, block_size=64, seed=31)
    q, _, wo = ix.quantize_q(*qargs(ex), hadamard=True)
    r = ix.quantize_q(*qargs(ex), hadamard=True, backend="reference")
    assert torch.equal(q.view(torch.uint8), r[0].view(torch.uint8)) and torch.equal(wo, r[2])
    for fmt in ("fp8", "mxfp4"):
        ex = problem(8, 64, 2048, block_size=64, seed=32, fmt=fmt)
        q, qs, wo = ix.quantize_q(*qargs(ex), fmt=fmt)
        args = (q, qs, wo, ex["k_cache"], ex["positions"], ex["block_table"])
        for dec in ix.launch.FP4_DECODES if fmt == "mxfp4" else ("nibble",):
            lg = ix.logits(
                q,
                qs,
                wo,
                ex["k_cache"],
                ex["positions"],
                block_table=ex["block_table"],
                block_size=64,
                launch=ix.IndexerLaunch(fp4_decode=dec),
            )
            ref = ix.reference.logits(*args, block_size=64, n_out=lg.shape[1], dtype=torch.float64)
            cond = ix.reference.logits_condition(*args, block_size=64, n_out=lg.shape[1])
            assert_logits(lg, ref, cond, fmt, f"{fmt} {dec} logits / condition")


def test_default_launch_is_what_its_docstring_says_and_changes_no_byte():
    """default_launch(): IndexerLaunch() on a GPU, INTERPRETER_QUANT_ROWS quantize rows per program in the
    interpreter (with no argument, this process's); both give the same Q bytes and weights, on a row count that
    is a multiple of neither tile."""
    from dsv4ref.indexer.launch import INTERPRETER_QUANT_ROWS, IndexerLaunch

    gpu, cpu = ix.default_launch(interpreted=False), ix.default_launch(interpreted=True)
    assert gpu == IndexerLaunch() and cpu == IndexerLaunch(quant_rows=INTERPRETER_QUANT_ROWS)
    assert ix.default_launch() == (cpu if interpreting() else gpu)
    for fmt in ("fp8", "mxfp4"):
        ex = ix.example_inputs(5, 59, 64, block_size=64, fmt=fmt, seed=3)  # 295 (token, head) rows
        args = (ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"])
        a = ix.quantize_q(*args, fmt=fmt, backend="triton", launch=gpu)
        b = ix.quantize_q(*args, fmt=fmt, backend="triton", launch=cpu)
        for x, y in zip(a, b):  # (q, its scales or None, weights)
            assert (x is None and y is None) or torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), (
                fmt
            )
