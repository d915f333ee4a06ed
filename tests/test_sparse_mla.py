"""Sparse MLA decode (docs/sparse_mla.md): every backend against a float64 attention over the dequantised KV.

Catches the pitfalls listed in docs/sparse_mla.md#pitfalls: #12 (read before mask: poisoned slots), #13
(prefix cut-off with a non-empty second pool), #15 (V of 448 dims), #17 (dropped sink), #18 (−inf sentinel
NaN), #19 (head padding / padded sink), #20 (split-merge applies the sink once, lse units).
"""

import dataclasses
import json
import math

import pytest
import torch

from dsv4ref import kv_cache, sparse_mla
from dsv4ref.device import DEVICE, interpreting
from dsv4ref.sparse_mla import SparseMlaLaunch, default_launch, reference
from dsv4ref.sparse_mla.launch import attend, launch_for_sms, workspace
from dsv4ref.sparse_mla.two_pass import seed_decode
from dsv4ref.testing import assert_close, generator, poison, randn

BACKENDS = sparse_mla.SUPPORTED_BACKENDS  # ("reference", "two_pass", "triton")
KERNELS = ("two_pass", "triton")


def launch_with(q, pools, **changes):
    """The default launch for this shape with some fields replaced (passed explicitly as ``launch=``)."""
    T, H, _ = q.shape
    return dataclasses.replace(default_launch(T, H, sum(p[1].shape[1] for p in pools), q.device), **changes)


# ---------------------------------------------------------------------------------------------------
# data and the float64 oracle
# ---------------------------------------------------------------------------------------------------

POISON_SLOT = 0  # page 0, offset 0: e4m3 bytes 0x7F (NaN), RoPE bf16 0x7FC0 (NaN), scale bytes 0xFF (2^128 = inf)

# numpy's "invalid value" warnings are what a −inf − (−inf) in an interpreted kernel prints
# (docs/triton_interpreter.md)
pytestmark = pytest.mark.filterwarnings("error")


def make_cache(block_size, num_pages, seed, nope_zero=False):
    """A cache whose every slot holds a random row with per-64-block magnitudes over 2^-3..2^3 (so the
    7 scale bytes of a row differ), except POISON_SLOT, which holds NaN/inf bytes."""
    n = block_size * num_pages
    kv = randn((n, 512), seed=seed, octaves=6)
    if nope_zero:
        kv[:, :448] = 0
    cache = kv_cache.allocate(num_pages, block_size)
    kv_cache.insert(cache, kv, torch.arange(n, device=DEVICE), block_size=block_size, backend="reference")
    cache[0, :448] = 0x7F  # e4m3 NaN (the interpreter may decode it as 480: the next two poisons still bite)
    cache[0, 448:576:2] = 0xC0  # bf16 0x7FC0, little-endian: NaN
    cache[0, 449:576:2] = 0x7F
    cache[0, block_size * 576 : block_size * 576 + 8] = 0xFF
    return cache


def make_slots(T, K, block_size, num_pages, seed, lengths, *, minus_one=True, dup=True):
    """[T, K] int32: random slots (never the poisoned one) inside the prefix, some −1 and a duplicate
    inside the prefix; every entry past lengths[t] points at the poisoned slot."""
    g = generator(seed)
    n = block_size * num_pages
    idx = torch.randint(1, n, (T, K), generator=g, dtype=torch.int32)
    for t in range(T):
        L = int(lengths[t])
        if minus_one and L >= 3:
            idx[t, 1] = -1
        if dup and L >= 4:
            idx[t, 3] = idx[t, 2]
        idx[t, L:] = POISON_SLOT
    return idx.to(DEVICE)


def oracle(q, pools, sink, scale):
    """float64, one token at a time: the definition in docs/sparse_mla.md#the-math, written out.

    The returned ``out`` carries ``out.mass`` = Σ_j p_j·|v_j| (times the sink factor): the scale a kernel's
    rounding error grows with (P rounded to bf16 before P·V, as FlashMLA does), used by :func:`check`."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, 512, dtype=torch.float64)
    mass = torch.zeros(T, H, 512, dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    q64 = q.cpu().double()
    for t in range(T):
        rows = []
        for cache, idx, lens, bs in pools:
            L = idx.shape[1] if lens is None else int(lens[t])
            slots = [int(s) for s in idx[t, :L].tolist() if s >= 0]  # duplicates stay: no de-duplication
            if slots:
                rows.append(
                    kv_cache.gather(
                        cache, torch.tensor(slots, dtype=torch.int32, device=cache.device), block_size=bs, backend="reference"
                    )
                    .cpu()
                    .double()
                )
        if not rows:
            continue  # empty row: out 0, lse −inf
        k = torch.cat(rows)  # [n, 512]; K = V
        s = scale * q64[t] @ k.T  # [H, n]
        lse[t] = torch.logsumexp(s, dim=1)
        p = torch.softmax(s, dim=1)
        o, m = p @ k, p @ k.abs()
        if sink is not None:
            f = torch.sigmoid(lse[t] - sink.cpu().double())[:, None]
            o, m = o * f, m * f
        out[t], mass[t] = o, m
    out.mass = mass
    return out, lse


def check(out, lse, ref_out, ref_lse, name=""):
    """out within tolerance "bf16_weighted_sum" (|err| <= 2^-8·(|ref| + Σ p|v|) + 1e-6: P and out rounded
    to bf16), lse within "lse"."""
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not torch.isnan(out).any(), f"{name}: NaN in out"
    assert_close(out, ref_out, "bf16_weighted_sum", f"{name} out", mass=ref_out.mass)
    assert_close(lse, ref_lse, "lse", f"{name} lse")


def make_q(T, H, seed):
    return (randn((T, H, 512), seed=seed, octaves=4).float() * 0.25).to(torch.bfloat16)


def setup(T=3, H=16, K1=40, K2=0, bs1=16, bs2=2, pages1=4, pages2=24, seed=0, lengths1=None, lengths2=None, nope_zero=False):
    c1 = make_cache(bs1, pages1, seed + 1, nope_zero)
    l1 = torch.tensor(lengths1 if lengths1 is not None else [K1 - 3 * t for t in range(T)], dtype=torch.int32).to(DEVICE)
    i1 = make_slots(T, K1, bs1, pages1, seed + 2, l1)
    pools = [(c1, i1, l1, bs1)]
    if K2:
        c2 = make_cache(bs2, pages2, seed + 3, nope_zero)
        l2 = torch.tensor(lengths2 if lengths2 is not None else [K2 - 2 * t for t in range(T)], dtype=torch.int32).to(DEVICE)
        pools.append((c2, make_slots(T, K2, bs2, pages2, seed + 4, l2), l2, bs2))
    return make_q(T, H, seed), pools


def run(q, pools, backend, sink=None, scale=sparse_mla.DEFAULT_SCALE, launch=None):
    (c1, i1, l1, b1), *rest = pools
    kw = {}
    if rest:
        c2, i2, l2, b2 = rest[0]
        kw = dict(extra_cache=c2, extra_slots=i2, extra_lengths=l2, extra_block_size=b2)
    return sparse_mla.decode(q, c1, i1, l1, block_size=b1, sink=sink, scale=scale, backend=backend, launch=launch, **kw)


# ---------------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_pools_with_sink_vs_float64(backend):
    """Both pools (page sizes 16 and 2), a short main-pool prefix with a non-empty second pool (#13),
    −1 and duplicates inside the prefix, poisoned slots past the lengths (#12), K = 40 and 10: not
    multiples of the kernel's block, a finite sink (#17)."""
    q, pools = setup(T=3, H=16, K1=40, K2=10, lengths1=[40, 5, 17], lengths2=[10, 9, 0])
    pools[0][1][2, :16] = -1  # row 2: a first chunk (BLOCK_N = 16 here) with no valid entry (#18)
    sink = torch.linspace(-2.0, 6.0, 16).to(DEVICE)
    out, lse = run(q, pools, backend, sink)
    ref_out, ref_lse = oracle(q, pools, sink, sparse_mla.DEFAULT_SCALE)
    check(out, lse, ref_out, ref_lse, backend)
    # the data are not degenerate: the softmax spreads over several candidates in most rows
    assert float(ref_out.abs().max()) > 0.1


def test_reference_float64_is_the_oracle():
    """reference.decode(dtype=torch.float64) (vectorised) equals the per-token float64 oracle above, and its
    mass is the oracle's Σ p|v|·σ(lse − sink)."""
    q, pools = setup(T=3, H=16, K1=40, K2=10, lengths1=[40, 5, 0], lengths2=[10, 9, 0])
    sink = torch.linspace(-2.0, 6.0, 16).to(DEVICE)
    (c1, i1, l1, b1), (c2, i2, l2, b2) = pools
    out, lse, mass = reference.decode(
        q,
        c1,
        i1,
        l1,
        block_size=b1,
        sink=sink,
        extra_cache=c2,
        extra_slots=i2,
        extra_lengths=l2,
        extra_block_size=b2,
        dtype=torch.float64,
        with_mass=True,
    )
    ref_out, ref_lse = oracle(q, pools, sink, sparse_mla.DEFAULT_SCALE)
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mass.cpu(), ref_out.mass, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("backend", BACKENDS)
def test_heads_64_128(backend, H):
    """H = 64 (one block of 64 heads) and 128 (two blocks); a non-default softmax scale."""
    q, pools = setup(T=2, H=H, K1=24, K2=0, lengths1=[24, 19], seed=H)
    sink = randn((H,), seed=5, dtype=torch.float32, octaves=0) * 2
    scale = 512**-0.55
    out, lse = run(q, pools, backend, sink, scale)
    check(out, lse, *oracle(q, pools, sink, scale), f"{backend} H={H}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows_and_infinite_sinks(backend):
    """Row 0: length 0; row 1: every entry in the prefix is −1; row 2: normal. Empty rows give out 0
    and lse −inf with any sink, never NaN (#18). sink −inf == no sink; sink +inf gives out = 0 with the
    same lse."""
    q, pools = setup(T=3, H=16, K1=20, lengths1=[0, 6, 20])
    pools[0][1][1, :6] = -1
    base_out, base_lse = run(q, pools, backend)
    check(base_out, base_lse, *oracle(q, pools, None, sparse_mla.DEFAULT_SCALE), f"{backend} no sink")
    assert torch.equal(base_out[:2].cpu(), torch.zeros(2, 16, 512, dtype=torch.bfloat16))
    assert bool((base_lse[:2] == -math.inf).all()) and bool(torch.isfinite(base_lse[2]).all())
    minf = torch.full((16,), -math.inf, device=DEVICE)
    o, l = run(q, pools, backend, minf)
    assert torch.equal(o.cpu().view(torch.int16), base_out.cpu().view(torch.int16)) and torch.equal(l.cpu(), base_lse.cpu())
    o, l = run(q, pools, backend, -minf)
    assert torch.equal(o.cpu(), torch.zeros_like(o.cpu())), "sink = +inf must zero the output"
    assert torch.equal(l.cpu(), base_lse.cpu()), "lse excludes the sink"


@pytest.mark.parametrize("backend", BACKENDS)
def test_sink_equal_to_lse_halves_the_output(backend):
    """sink_h = lse: e^lse / (e^lse + e^sink) = 1/2 exactly (#17: a dropped sink leaves the output whole)."""
    q, pools = setup(T=1, H=16, K1=24, lengths1=[21])
    out, lse = run(q, pools, backend)
    half, lse2 = run(q, pools, backend, lse[0].clone())
    assert torch.equal(lse2.cpu(), lse.cpu())
    assert_close(half, (out.double() * 0.5), "bf16_out", "sink = lse")


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_width_is_512(backend):
    """NoPE zeroed in every cached row: the output must still carry dims 448..511 (#15, d_v = 448 bug)."""
    q, pools = setup(T=2, H=16, K1=16, lengths1=[16, 9], nope_zero=True)
    out, lse = run(q, pools, backend)
    check(out, lse, *oracle(q, pools, None, sparse_mla.DEFAULT_SCALE), backend)
    assert bool((out[..., :448] == 0).all())
    assert int((out[..., 448:] != 0).sum()) > 0.9 * out[..., 448:].numel()


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_slots_equal_int32(backend):
    """``slots`` may be int32 or int64 (one vocabulary across ops): the same result either way."""
    q, pools = setup(T=2, H=16, K1=16, K2=6, lengths1=[16, 9], lengths2=[6, 2])
    a = run(q, pools, backend)
    b = run(q, [(c, s.long(), l, bs) for c, s, l, bs in pools], backend)
    assert torch.equal(a[0].cpu().view(torch.int16), b[0].cpu().view(torch.int16)) and torch.equal(a[1].cpu(), b[1].cpu())


def test_odd_aligned_cache():
    """A cache that is a view starting at an odd byte (page stride odd too): the kernel reads the RoPE
    bytes one by one instead of as int16 words, and the result is the same."""
    bs, pages = 16, 3
    big = torch.zeros(pages, kv_cache.page_bytes(bs) + 1, dtype=torch.uint8, device=DEVICE)
    odd = big[:, 1:]
    even = make_cache(bs, pages, seed=7)
    odd.copy_(even)
    q = make_q(2, 16, seed=8)
    lens = torch.tensor([16, 12], dtype=torch.int32, device=DEVICE)
    slots = make_slots(2, 16, bs, pages, 9, lens)
    a = sparse_mla.decode(q, even, slots, lens, block_size=bs, backend="triton")  # the portable kernel's byte reads
    b = sparse_mla.decode(q, odd, slots, lens, block_size=bs, backend="triton")
    assert odd.data_ptr() % 2 == 1 and odd.stride(0) % 2 == 1
    assert torch.equal(a[0].cpu().view(torch.int16), b[0].cpu().view(torch.int16)) and torch.equal(a[1].cpu(), b[1].cpu())
    check(*b, *oracle(q, [(odd, slots, lens, bs)], None, sparse_mla.DEFAULT_SCALE), "odd")


@pytest.mark.parametrize("backend", KERNELS)
def test_split_merge_equals_single_pass(backend):
    """Flash-decoding: the candidate list split over 1, 2 and 4 programs (launch=) and merged; the sink is
    applied once, after the merge (#20)."""
    q, pools = setup(T=2, H=16, K1=40, K2=8, lengths1=[40, 3], lengths2=[8, 8])
    sink = torch.linspace(-1.0, 3.0, 16).to(DEVICE)
    ref = oracle(q, pools, sink, sparse_mla.DEFAULT_SCALE)
    outs = []
    for splits in (1, 2, 4):
        out, lse = run(q, pools, backend, sink, launch=launch_with(q, pools, num_splits=splits))
        check(out, lse, *ref, f"{backend} splits={splits}")
        outs.append((out, lse))
    assert_close(outs[2][0], outs[0][0].double(), "bf16_weighted_sum", "split 4 vs 1", mass=ref[0].mass)
    assert_close(outs[2][1], outs[0][1].double(), "lse", "split 4 vs 1 lse")


@pytest.mark.parametrize("backend", KERNELS)
def test_padded_head_block_matches_unpadded(backend):
    """H = 16 run with a block of 64 heads (48 padded, masked rows, padded sink −inf) gives the same
    real-head results as the exact block of 16 (#19); nothing is written past H."""
    q, pools = setup(T=2, H=16, K1=16, lengths1=[16, 11])
    sink = torch.linspace(-1.0, 3.0, 16).to(DEVICE)
    a = run(q, pools, backend, sink, launch=launch_with(q, pools, block_h=16))
    b = run(q, pools, backend, sink, launch=launch_with(q, pools, block_h=64))
    assert_close(b[0], a[0].double(), "bf16_out", "padded")
    assert_close(b[1], a[1].double(), "lse", "padded lse")
    assert b[0].shape == (2, 16, 512) and not torch.isnan(b[0]).any()


@pytest.mark.parametrize("splits", [1, 2])
def test_outputs_fully_written(splits):
    """The kernels write every element: run the launcher on NaN-poisoned out / lse buffers, in one pass
    and through the split merge (H = 24: a partly padded head block in both kernels)."""
    q, pools = setup(T=2, H=24, K1=16, lengths1=[16, 0])
    out, lse = poison((2, 24, 512), torch.bfloat16), poison((2, 24), torch.float32)
    attend(
        q,
        [(c, s, l, b, c.stride(0)) for c, s, l, b in pools],
        None,
        sparse_mla.DEFAULT_SCALE,
        launch_with(q, pools, num_splits=splits),
        kv_bf16=False,
        out=out,
        lse=lse,
    )
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


def test_two_pass_reuses_its_workspace():
    q, pools = setup(T=2, H=16, K1=16, lengths1=[16, 5])
    run(q, pools, "two_pass")
    ptr = workspace(1, q.device).data_ptr()
    run(q, pools, "two_pass")
    assert workspace(1, q.device).data_ptr() == ptr


def test_seed_path_vs_float64():
    """The seed's structure (per-token host loop, a gather launch per token and pool, bf16 attention over the
    packed table) gives the same answer: the ladder's first rung is measured on a correct path."""
    q, pools = setup(T=3, H=16, K1=20, K2=6, lengths1=[20, 4, 0], lengths2=[6, 3, 0])
    (c1, i1, l1, b1), (c2, i2, l2, b2) = pools
    sink = torch.linspace(-2.0, 2.0, 16).to(DEVICE)
    out, lse = seed_decode(
        q,
        c1,
        i1,
        l1,
        block_size=b1,
        sink=sink,
        scale=sparse_mla.DEFAULT_SCALE,
        extra_cache=c2,
        extra_slots=i2,
        extra_lengths=l2,
        extra_block_size=b2,
    )
    check(out, lse, *oracle(q, pools, sink, sparse_mla.DEFAULT_SCALE), "seed")


def test_h200_launch_and_the_ladder_file():
    """launch_for_sms(…, 132) is what the H200 ran (splits 2 / 1 / 4 on the bench shapes), and
    benchmarks/sparse_mla_ladder.json (notebook 04's chart data) matches the bench accounting and rungs."""
    from dsv4ref.tools.cases import sparse_mla as cases

    assert [launch_for_sms(T, H, K, 132).num_splits for T, H, K in cases.BENCH_SHAPES] == [2, 1, 4]
    d = json.loads(cases.LADDER_PATH.read_text())
    assert [(s["T"], s["H"], s["K"]) for s in d["shapes"]] == list(cases.BENCH_SHAPES)
    assert [(s["bytes"], s["flops"]) for s in d["shapes"]] == [cases.bench_counts(*s) for s in cases.BENCH_SHAPES]
    assert [r["key"] for r in d["rungs"]] == [k for k, _, _ in cases.RUNGS]
    assert d["ceilings"]["copy_bytes_per_s"] > 0 and d["ceilings"]["bf16_flops_per_s"] > 0
    for r in d["rungs"] + d["others"]:
        assert len(r["us"]) == 3 and all(u is None or u > 0 for u in r["us"]) and r["source"]
        assert (r["status"] == "measured") == all(u is not None for u in r["us"])


def test_ladder_from_bench_rows():
    """write_ladder's content from one run: every rung found by its bench op, missing ones pending."""
    from dsv4ref.tools.cases import sparse_mla as cases
    from dsv4ref.tools.harness import BenchCase, BenchRow, Ceilings

    rows = [
        BenchRow(BenchCase(op, "", None, 1, 1.0, extra=dict(T=T, H=H, K=K)), 0.1, 0, 0, 0)
        for _, op, _ in cases.RUNGS[:-1]
        for T, H, K in cases.BENCH_SHAPES
    ]
    d = cases.ladder(Ceilings(4e12, 7e14), rows, device="test", command="test")
    assert [r["status"] for r in d["rungs"]] == ["measured"] * 4 + ["pending"]
    assert d["rungs"][0]["us"] == [100.0] * 3 and d["rungs"][-1]["us"] == [None] * 3


def test_custom_op_fake_impl():
    q, pools = setup(T=2, H=16, K1=16, lengths1=[16, 5])
    ((c, i, l, b),) = pools
    torch.library.opcheck(
        torch.ops.dsv4ref.sparse_mla_decode,
        (q, c, i, l, None, None, None, None, b, 1, 0.04, 16, 16, 1, 4, 1),
        test_utils=("test_schema", "test_faketensor"),
    )


# ---------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------


def test_bad_input_raises_naming_the_argument():
    q, pools = setup(T=2, H=16, K1=8, K2=4, lengths1=[8, 8], lengths2=[4, 4])
    (c1, i1, l1, b1), (c2, i2, l2, b2) = pools
    n1 = c1.shape[0] * b1
    bad = i1.clone()
    bad[1, 7] = n1  # one past the last slot
    with pytest.raises(ValueError, match=r"slots: entry \(1, 7\) = 64 is out of range"):
        sparse_mla.decode(q, c1, bad, l1, block_size=b1)
    bad = i1.clone()
    bad[0, 0] = -2
    with pytest.raises(ValueError, match="slots: entry"):
        sparse_mla.decode(q, c1, bad, l1, block_size=b1)
    bad2 = i2.clone()
    bad2[0, 0] = c2.shape[0] * b2
    with pytest.raises(ValueError, match="extra_slots: entry"):
        sparse_mla.decode(q, c1, i1, l1, block_size=b1, extra_cache=c2, extra_slots=bad2, extra_lengths=l2, extra_block_size=b2)
    with pytest.raises(ValueError, match="slots: expected 2 rows"):
        sparse_mla.decode(q, c1, i1[:1], l1, block_size=b1)
    with pytest.raises(ValueError, match="lengths: expected shape"):
        sparse_mla.decode(q, c1, i1, l1[:1], block_size=b1)
    with pytest.raises(ValueError, match="lengths: entry 1 = 9 is out of range"):
        sparse_mla.decode(q, c1, i1, torch.tensor([8, 9], dtype=torch.int32, device=DEVICE), block_size=b1)
    with pytest.raises(TypeError, match="slots: expected dtype torch.int32 or torch.int64"):
        sparse_mla.decode(q, c1, i1.float(), l1, block_size=b1)
    with pytest.raises(ValueError, match="q: expected the latent head dim 512"):
        sparse_mla.decode(q[..., :448], c1, i1, l1, block_size=b1)
    with pytest.raises(TypeError, match="q: expected dtype torch.bfloat16"):
        sparse_mla.decode(q.float(), c1, i1, l1, block_size=b1)
    with pytest.raises(ValueError, match="sink: expected shape"):
        sparse_mla.decode(q, c1, i1, l1, block_size=b1, sink=torch.zeros(64, device=DEVICE))
    with pytest.raises(ValueError, match="extra_block_size: the extra pool needs"):
        sparse_mla.decode(q, c1, i1, l1, block_size=b1, extra_cache=c2, extra_slots=i2)
    with pytest.raises(ValueError, match="extra_cache: pages of"):
        sparse_mla.decode(q, c1, i1, l1, block_size=b1, extra_cache=c2, extra_slots=i2, extra_block_size=64)
    with pytest.raises(TypeError, match="block_size"):
        sparse_mla.decode(q, c1, i1, l1)  # block_size is keyword-only and required
    with pytest.raises(ValueError, match="backend: expected one of"):
        sparse_mla.decode(q, c1, i1, l1, block_size=b1, backend="flashmla")
    with pytest.raises(TypeError, match="launch: expected a SparseMlaLaunch"):
        sparse_mla.decode(q, c1, i1, l1, block_size=b1, launch={"num_splits": 2})
    with pytest.raises(ValueError, match="block_h: expected a power of two >= 16"):
        SparseMlaLaunch(block_h=8, block_n=16)
    with pytest.raises(ValueError, match="num_splits: expected a power of two"):
        SparseMlaLaunch(block_h=16, block_n=16, num_splits=3)


# ---------------------------------------------------------------------------------------------------
# GPU-only: real shapes
# ---------------------------------------------------------------------------------------------------


@pytest.mark.skipif(interpreting(), reason="real V4 shapes: GPU only (the interpreter runs ~1 ms per program)")
@pytest.mark.parametrize("H,K1,K2", [(64, 128, 512), (128, 128, 1024), (16, 128, 1920)])
def test_real_shapes_gpu(H, K1, K2):
    T = 8
    q, pools = setup(
        T=T,
        H=H,
        K1=K1,
        K2=K2,
        bs1=64,
        bs2=64,
        pages1=40,
        pages2=200,
        seed=H,
        lengths1=[K1 - 7 * t for t in range(T)],
        lengths2=[K2 - 13 * t for t in range(T)],
    )
    pools[1][1][1, :64] = -1  # a fully masked first chunk of BLOCK_N = 64 (#18)
    sink = torch.linspace(-1.0, 3.0, H).to(DEVICE)
    ref = oracle(q, pools, sink, sparse_mla.DEFAULT_SCALE)
    for backend in KERNELS:
        check(*run(q, pools, backend, sink), *ref, f"{backend} H={H}")
    for splits in (2, 8):
        check(*run(q, pools, "triton", sink, launch=launch_with(q, pools, num_splits=splits)), *ref, f"splits={splits}")
