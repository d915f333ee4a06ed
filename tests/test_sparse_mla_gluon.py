"""The Hopper Gluon backend of sparse MLA decode (dsv4ref.sparse_mla.gluon) against a float64 oracle.

GPU-only (compiled Triton with Gluon on a compute-capability-9 device); skipped everywhere else. Same
tolerance ("bf16_weighted_sum": P rounded to bf16 before P·V, as FlashMLA and the portable kernel do) and
the same adversarial data as tests/test_sparse_mla.py: poisoned slots past the lengths, −1 and duplicates
inside the prefixes, empty rows, ±inf sinks, two pools with different page sizes, H 16 / 64 / 128, list
splits (flash-decoding) on and off.
"""

import dataclasses
import math

import pytest
import torch
from test_sparse_mla import POISON_SLOT, make_cache, make_slots
from test_sparse_mla import oracle as portable_oracle

from dsv4ref import kv_cache
from dsv4ref.device import DEVICE, interpreting
from dsv4ref.sparse_mla import gluon as G
from dsv4ref.testing import assert_close, randn

SCALE = 512**-0.5

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        interpreting() or not G.available(DEVICE), reason="the gluon backend needs compiled Triton (Gluon) on a Hopper GPU"
    ),
]


def setup(T, H, K1, K2=0, bs1=16, bs2=2, pages1=8, pages2=64, seed=0, lengths1=None, lengths2=None, nope_zero=False):
    c1 = make_cache(bs1, pages1, seed + 1, nope_zero)
    l1 = torch.tensor(lengths1 if lengths1 is not None else [max(K1 - 3 * t, 0) for t in range(T)], dtype=torch.int32)
    pools = [(c1, make_slots(T, K1, bs1, pages1, seed + 2, l1), l1.to(DEVICE), bs1)]
    if K2:
        c2 = make_cache(bs2, pages2, seed + 3, nope_zero)
        l2 = torch.tensor(lengths2 if lengths2 is not None else [max(K2 - 2 * t, 0) for t in range(T)], dtype=torch.int32)
        pools.append((c2, make_slots(T, K2, bs2, pages2, seed + 4, l2), l2.to(DEVICE), bs2))
    q = (randn((T, H, 512), seed=seed, octaves=4).float() * 0.25).to(torch.bfloat16)
    return q, pools


def oracle(q, pools, sink, scale):
    """The float64 oracle of tests/test_sparse_mla.py (docs/sparse_mla.md), as (out, lse, mass): mass =
    Σ p|v| (times the sink factor), the scale of the kernel's rounding error."""
    out, lse = portable_oracle(q, pools, sink, scale)
    return out, lse, out.mass


def launch_with(q, pools, num_splits=None, kernel=None):
    """The default launch for these inputs with the given fields replaced (None: the default itself)."""
    if num_splits is None and kernel is None:
        return None
    T, H, _ = q.shape
    launch = G.default_launch(T, H, sum(p[1].shape[1] for p in pools), q.device)
    return dataclasses.replace(launch, **{k: v for k, v in dict(num_splits=num_splits, kernel=kernel).items() if v is not None})


def run(q, pools, sink=None, scale=SCALE, num_splits=None, kernel=None):
    (c1, i1, l1, b1), *rest = pools
    kw = {}
    if rest:
        c2, i2, l2, b2 = rest[0]
        kw = dict(extra_cache=c2, extra_slots=i2, extra_lengths=l2, extra_block_size=b2)
    # poison: NaN blocks of the outputs' sizes, freed just before the call, are what the caching allocator
    # hands the launcher's torch.empty, so a program that writes nothing (a merge that never ran) shows
    T, H = q.shape[:2]
    junk = (
        torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=q.device),
        torch.full((T, H), float("nan"), device=q.device),
    )
    del junk
    return G.decode_gluon(
        q, c1, i1, l1, block_size=b1, sink=sink, scale=scale, launch=launch_with(q, pools, num_splits, kernel), **kw
    )


def check(out, lse, ref, name):
    ref_out, ref_lse, mass = ref
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not torch.isnan(out).any(), f"{name}: NaN in out"
    assert_close(out, ref_out, "bf16_weighted_sum", f"{name} out", mass=mass)
    assert_close(lse, ref_lse, "lse", f"{name} lse")


@pytest.mark.parametrize("splits", [1, 2])
def test_two_pools_with_sink(splits):
    """Pages of 16 and 2, short prefixes with a non-empty second pool, −1 and duplicates, poisoned slots
    past the lengths, lengths that are not multiples of the 64-candidate chunk, a first chunk with no
    valid entry, a finite sink."""
    q, pools = setup(T=4, H=16, K1=140, K2=70, lengths1=[140, 5, 100, 0], lengths2=[70, 69, 0, 33])
    pools[0][1][2, :64] = -1
    sink = torch.linspace(-2.0, 6.0, 16).to(DEVICE)
    ref = oracle(q, pools, sink, SCALE)
    check(*run(q, pools, sink, num_splits=splits), ref, f"splits={splits}")
    assert float(ref[0].abs().max()) > 0.1


# the kernels other than the default at some H (GluonLaunch.kernel): the 64-row kernel at H <= 16 too (where
# the narrow one is the default), and the plain kernel (notebook 04's rung "a"; byte-wise dequantisation)
KERNELS = {"64-row kernel at every H": "ws", "plain kernel": "plain"}


@pytest.mark.parametrize("name", ["default", *KERNELS])
def test_every_e4m3_code_and_scale_byte(name):
    """Each token attends to one row, with q = 0, so its output is that row's dequantised values (p = 1, l = 1)
    bit for bit: rows cover all 254 finite e4m3 codes (both zeros and the subnormals included) under scale
    bytes from 0 to 254 (2^-127 .. 2^127, products overflowing to ±inf and underflowing to bf16 subnormals or
    0 included), and rows holding a NaN code or the NaN scale byte 255 must come out NaN. The gluon
    dequantisation must match the reference's bytes -> values exactly."""
    bs, pages = 64, 8
    n = bs * pages
    cache = kv_cache.allocate(pages, bs)
    g = torch.Generator().manual_seed(7)
    codes = torch.arange(256, dtype=torch.int64)
    finite = codes[(codes & 0x7F) != 0x7F]
    e4 = finite[torch.randint(0, finite.numel(), (n, 448), generator=g)]
    e4[:, : finite.numel()] = finite  # every finite code in every row
    scales = torch.tensor([0, 1, 2, 7, 60, 100, 120, 126, 127, 128, 134, 135, 140, 200, 240, 245, 254])
    sc = scales[torch.randint(0, scales.numel(), (n, 7), generator=g)]
    nan_code_rows = torch.arange(5, n, 37)
    e4[nan_code_rows, (nan_code_rows * 13) % 448] = 0x7F + 0x80 * (nan_code_rows % 2)
    nan_scale_rows = torch.arange(11, n, 53)
    sc[nan_scale_rows, nan_scale_rows % 7] = 255
    rope = randn((n, 64), seed=3, octaves=6).to(torch.bfloat16).view(torch.uint8).view(n, 128).cpu()
    flat = torch.zeros(pages, cache.shape[1], dtype=torch.uint8)
    for r in range(n):
        pg, off = divmod(r, bs)
        flat[pg, off * 576 : off * 576 + 448] = e4[r].to(torch.uint8)
        flat[pg, off * 576 + 448 : off * 576 + 576] = rope[r]
        flat[pg, bs * 576 + off * 8 : bs * 576 + off * 8 + 7] = sc[r].to(torch.uint8)
    cache.copy_(flat.to(cache.device))
    slots = torch.arange(n, dtype=torch.int32, device=DEVICE).view(n, 1)
    lengths = torch.ones(n, dtype=torch.int32, device=DEVICE)
    q = torch.zeros(n, 16, 512, dtype=torch.bfloat16, device=DEVICE)
    rows = kv_cache.gather(cache, slots.view(-1), block_size=bs, backend="reference")  # [n, 512] bf16
    launch = None if name == "default" else G.GluonLaunch(KERNELS[name])  # one list split, as the default here
    out, lse = G.decode_gluon(q, cache, slots, lengths, block_size=bs, scale=SCALE, launch=launch)
    bad = torch.zeros(n, dtype=torch.bool)
    bad[nan_code_rows] = True
    bad[nan_scale_rows] = True
    bad = bad.to(DEVICE)
    want = rows[:, None, :].expand(n, 16, 512)
    good = ~bad & ~torch.isinf(rows).any(1) & ~torch.isnan(rows).any(1)
    assert int(good.sum()) > n // 2
    # values compared (−0 == +0: P·V adds the row to a +0 accumulator); bf16 subnormal outputs are left out,
    # as the tensor cores' P·V may flush them whatever the dequantisation did
    normal = (want.abs() >= 2.0**-126) | (want == 0)
    diff = (out != want) & normal & good[:, None, None]
    if bool(diff.any()):
        r, h, c = (int(x) for x in diff.nonzero()[0])
        tiles = torch.bincount(diff.any(1).nonzero()[:, 1] // 64, minlength=8).tolist()
        raise AssertionError(
            f"{name}: {int(diff.sum())} values differ; first row {r} col {c}: got "
            f"{float(out[r, h, c])} want {float(want[r, h, c])} (scale bytes {sc[r].tolist()}); "
            f"mismatching (row, col) pairs per 64-column tile: {tiles}"
        )
    assert bool(torch.isnan(out[bad]).all()) and bool(torch.isnan(lse[bad]).all()), f"{name}: NaN rows"
    assert bool((lse[good] == 0).all())


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernels(name):
    """Every kernel other than the default on the adversarial two-pool case (holes, poisoned slots, an
    all-masked first chunk, empty rows), H 16 / 64 / 128, with and without the list split."""
    for H in (16, 64, 128):
        q, pools = setup(T=4, H=H, K1=140, K2=70, lengths1=[140, 5, 100, 0], lengths2=[70, 69, 0, 0], seed=H)
        pools[0][1][2, :64] = -1
        sink = torch.linspace(-2.0, 6.0, H).to(DEVICE)
        ref = oracle(q, pools, sink, SCALE)
        for splits in (1, 2):
            out, lse = run(q, pools, sink, num_splits=splits, kernel=KERNELS[name])
            check(out, lse, ref, f"{name} H={H} splits={splits}")
            assert bool((lse[3] == -math.inf).all()) and not bool(out[3].any()), "an empty row: out 0, lse -inf"


@pytest.mark.parametrize("H", [16, 64, 128, 40, 1, 8, 12])
def test_heads(H):
    """H = 16 (padded to a 64-row block), 64, 128 (two blocks), 40 (padded), and 1, 8, 12 (padded rows of
    the 64-row kernel, padded columns of the narrow one, the default at H <= 16); a non-default scale; the
    64-row kernel too where the narrow one is the default, at list splits 1, 2 and 4."""
    q, pools = setup(T=3, H=H, K1=96, K2=40, lengths1=[96, 77, 10], lengths2=[40, 0, 13], seed=H)
    sink = randn((H,), seed=5, dtype=torch.float32, octaves=0) * 2
    scale = 512**-0.55
    ref = oracle(q, pools, sink, scale)
    for kernel in (None, "ws") if H <= G.NARROW_H else (None,):
        for splits in (1, 2, 4):
            check(*run(q, pools, sink, scale, num_splits=splits, kernel=kernel), ref, f"H={H} splits={splits} kernel={kernel}")


@pytest.mark.parametrize("splits", [1, 2])
def test_empty_rows_and_infinite_sinks(splits):
    """Row 0: length 0; row 1: only −1 entries; row 2: normal. Empty rows: out 0, lse −inf, with any sink.
    sink −inf == no sink; sink +inf gives out 0 and the same lse."""
    q, pools = setup(T=3, H=16, K1=80, lengths1=[0, 6, 80])
    pools[0][1][1, :6] = -1
    base_out, base_lse = run(q, pools, num_splits=splits)
    check(base_out, base_lse, oracle(q, pools, None, SCALE), "no sink")
    assert torch.equal(base_out[:2].cpu(), torch.zeros(2, 16, 512, dtype=torch.bfloat16))
    assert bool((base_lse[:2] == -math.inf).all()) and bool(torch.isfinite(base_lse[2]).all())
    minf = torch.full((16,), -math.inf, device=DEVICE)
    o, l = run(q, pools, minf, num_splits=splits)
    assert torch.equal(o.cpu().view(torch.int16), base_out.cpu().view(torch.int16)) and torch.equal(l.cpu(), base_lse.cpu())
    o, l = run(q, pools, -minf, num_splits=splits)
    assert torch.equal(o.cpu(), torch.zeros_like(o.cpu())), "sink = +inf must zero the output"
    assert torch.equal(l.cpu(), base_lse.cpu()), "lse excludes the sink"


def test_sink_equal_to_lse_halves_the_output():
    q, pools = setup(T=1, H=16, K1=24, lengths1=[21])
    out, lse = run(q, pools)
    half, lse2 = run(q, pools, lse[0].clone())
    assert torch.equal(lse2.cpu(), lse.cpu())
    assert_close(half, out.double() * 0.5, "bf16_out", "sink = lse")


def test_value_width_is_512():
    """NoPE zeroed: dims 448..511 (the RoPE part of V) must still reach the output (#15)."""
    q, pools = setup(T=2, H=16, K1=16, lengths1=[16, 9], nope_zero=True)
    out, lse = run(q, pools)
    check(out, lse, oracle(q, pools, None, SCALE), "nope zero")
    assert bool((out[..., :448] == 0).all())
    assert int((out[..., 448:] != 0).sum()) > 0.9 * out[..., 448:].numel()


def test_no_lengths_means_all_entries():
    q, pools = setup(T=2, H=64, K1=72, K2=20, lengths1=[72, 72], lengths2=[20, 20])
    pools = [(c, i, None, b) for c, i, _, b in pools]
    for p in pools:
        p[1][p[1] == POISON_SLOT] = 1
    check(*run(q, pools), oracle(q, pools, None, SCALE), "lengths None")


@pytest.mark.parametrize("H,K1,K2", [(64, 128, 512), (128, 128, 1024), (16, 128, 1920)])
def test_real_shapes(H, K1, K2):
    """The V4 shapes, pages of 64, both pools, a fully masked 64-entry chunk, default split heuristic."""
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
    pools[1][1][1, :64] = -1
    sink = torch.linspace(-1.0, 3.0, H).to(DEVICE)
    ref = oracle(q, pools, sink, SCALE)
    for splits in (None, 1, 4):
        check(*run(q, pools, sink, num_splits=splits), ref, f"H={H} splits={splits}")


def test_matches_the_portable_kernel():
    """Same inputs through the public portable backend: both within tolerance of each other's oracle."""
    from dsv4ref import sparse_mla

    q, pools = setup(T=4, H=64, K1=64, K2=200, bs1=64, bs2=64, pages1=8, pages2=20, seed=3)
    (c1, i1, l1, b1), (c2, i2, l2, b2) = pools
    sink = torch.linspace(-1.0, 1.0, 64).to(DEVICE)
    a = sparse_mla.decode(
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
        backend="triton",
    )
    b = run(q, pools, sink)
    ref = oracle(q, pools, sink, SCALE)
    check(*a, ref, "portable")
    check(*b, ref, "gluon")


@pytest.mark.parametrize("kernel", ["narrow", "ws", "plain"])  # H 16: every kernel
@pytest.mark.parametrize("splits", [1, 2])
def test_non_finite_rows_follow_the_contract(splits, kernel):
    """Value checks off (docs/contract.md): a listed row whose scale byte is 255 (E8M0's NaN) or a query with
    a NaN or ±inf makes that token's attention rows NaN, out and lse, as the reference does; never the empty-row
    answer (out 0, lse −inf), even for a row with no entry (only a scan of the query can see it there); the
    other tokens are untouched. The Gluon backend's E8M0 decode must read byte 255
    as NaN, not +inf."""
    from dsv4ref import sparse_mla
    from dsv4ref.validate import checking_values

    bs = 16
    q, pools = setup(T=4, H=16, K1=40, bs1=bs, lengths1=[40, 40, 40, 0])
    ((c1, i1, l1, b1),) = pools
    others = set(i1[0].tolist()) | set(i1[2].tolist())
    slot = next(s for s in i1[1].tolist() if s > POISON_SLOT and s not in others)  # listed by token 1 only
    page, off = divmod(slot, bs)
    c1[page, bs * 576 + off * 8 + 2] = 255  # token 1 attends to a row whose third scale byte is E8M0's NaN
    q[2, 5, 100] = float("nan")  # token 2, head 5: a NaN query
    q[2, 9, 10] = float("inf")  # token 2, head 9: +inf (every score of the row non-finite)
    q[3, 7, 9] = -float("inf")  # token 3 (no entry), head 7: no score at all; only the query scan sees it
    with checking_values(False):
        want_out, want_lse = sparse_mla.decode(q, c1, i1, l1, block_size=bs, backend="reference")
        out, lse = run(q, pools, num_splits=splits, kernel=kernel)
    nan_rows = torch.isnan(want_lse)
    assert nan_rows[1].all() and nan_rows[2, 5] and nan_rows[2, 9] and not nan_rows[0].any()
    assert nan_rows[3].nonzero().flatten().tolist() == [7]
    assert torch.equal(torch.isnan(lse), nan_rows) and torch.equal(torch.isnan(out).all(-1), nan_rows)
    keep = torch.arange(16, device=lse.device) != 7
    assert torch.equal(lse[3][keep], want_lse[3][keep]) and not out[3][keep].any()  # empty rows stay empty
    ref_out, ref_lse, mass = oracle(q[:1], [(c1, i1[:1], l1[:1], bs)], None, SCALE)  # token 0: all finite
    assert_close(out[:1], ref_out, "bf16_weighted_sum", "finite token", mass=mass)
    assert_close(lse[:1], ref_lse, "lse", "finite token lse")
