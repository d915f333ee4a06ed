"""GPT-J RoPE, YaRN, the fused Q-norm + RoPE + KV insert and inverse RoPE.

Every kernel result is compared with the torch reference (``dsv4ref.rope.reference``) bit for bit (the
rounding rules of docs/rope.md#rounding-rules), and the references themselves with float64 formulas or
hand-checked numbers. The pitfalls these tests catch are listed in docs/rope.md#pitfalls: a missing inverse
RoPE, a wrong pairing / slice / position / table / mscale, and for the KV write the page layout and
slot −1 / a short ``slots``.
"""

import math

import pytest
import torch

from dsv4ref import kv_cache, rope
from dsv4ref.config import FLASH
from dsv4ref.conformance.rope import pair_max
from dsv4ref.device import DEVICE, interpreting
from dsv4ref.rope import (
    apply_gptj,
    apply_neox,
    compressed_position,
    cos_sin_cache,
    cos_sin_rows,
    inv_freq,
    qnorm_rope_kv_insert,
    reference,
    yarn_correction_range,
)
from dsv4ref.rope.launch import MH_SWEEP, RopeLaunch
from dsv4ref.testing import assert_close, generator, randn

YARN = FLASH.yarn  # factor 16, L0 65536, beta_fast 32, beta_slow 1
EPS = FLASH.rms_norm_eps

# q vs the vLLM-style reference (bf16 after the norm, then rotate) is held to the row "qnorm_rope_q" of
# dsv4ref.tolerances (docs/rope.md#exactness): atol = rtol = 1e-2 elementwise is too tight, because the vLLM
# form rounds each pair (e, o) to bf16 BEFORE rotating, an error of up to ½ ulp(max(|e|, |o|)) that the
# rotation moves into BOTH outputs; a small output next to a large partner (seen on the H200: 0.848 vs 0.828
# beside a partner of −6.9, 9 of 2M elements) then misses 1e-2 + 1e-2·|b|. The row's relative part scales
# with the pair's larger magnitude instead. Tolerances not in that table, each from docs/rope.md:
SHIFT_TOL = dict(atol=1e-2, rtol=1e-2)  # docs/rope.md#inverse-rope: Δ-shift invariance of the inverse-rotated output
YARN_RTOL = 1e-6  # docs/rope.md#yarn: the inv_freq table, relative


@pytest.fixture(scope="module")
def table():
    return cos_sin_cache(4096)  # θ = 10000, the window-only layers' table (tiny config length)


@pytest.fixture(params=[0, 1, 2, 8], ids=lambda n: "per_head" if n == 0 else f"hpp{n}")
def fused_variant(request):
    """The ``launch=`` of qnorm_rope_kv_insert: the per-head kernel (grid (T, H + 1)) or the multi-head one
    with n heads per program (packed bf16 pairs; n = 2 is the default; n = 8 leaves a partial group when H = 3 or 4)."""
    return RopeLaunch(heads_per_prog=request.param)


@pytest.fixture(scope="module")
def ctable():
    return cos_sin_cache(4096, theta=FLASH.compress_rope_theta, yarn=YARN)  # compressed layers


# ------------------------------------------------------------------------------------------------
# 1. pairing conventions and the rotary slice (docs/rope.md#pairing)
# ------------------------------------------------------------------------------------------------


def _explicit(x, p, table, pairs):
    """Loop form, element by element, in fp32: the formula as printed in docs/rope.md#pairing."""
    c, s = table[p, :32].cpu(), table[p, 32:].cpu()
    out = x.clone().cpu()
    x = x.cpu()
    for i in range(32):
        a, b = pairs(i)
        out[a] = x[a] * c[i] - x[b] * s[i]
        out[b] = x[a] * s[i] + x[b] * c[i]
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gptj_vs_neox_golden(table, backend):
    x = torch.arange(64, dtype=torch.float32, device=DEVICE)
    pos = torch.tensor([1], device=DEVICE)
    got = apply_gptj(x[None], pos, table, backend=backend)[0].cpu()
    neox = apply_neox(x[None], pos, table)[0].cpu()
    assert_close(got, _explicit(x, 1, table, lambda i: (2 * i, 2 * i + 1)), "exact", "GPT-J formula")
    assert_close(neox, _explicit(x, 1, table, lambda i: (i, i + 32)), "exact", "NeoX formula")
    # by hand: pair 0 is (x0, x1) = (0, 1), rotated by 1 rad: (-sin 1, cos 1); NeoX pairs (x0, x32) = (0, 32)
    assert got[:2].tolist() == pytest.approx([-math.sin(1), math.cos(1)], abs=1e-6)
    assert neox[0].item() == pytest.approx(-32 * math.sin(1), abs=1e-5)
    assert not torch.equal(got, neox)


def test_rotates_the_last_dims_only(table):
    x = randn((3, 512), seed=1)
    pos = torch.tensor([5, 900, 4000], device=DEVICE)
    out = apply_gptj(x, pos, table)
    assert torch.equal(out[:, :448].view(torch.int16), x[:, :448].view(torch.int16))  # bit-identical NoPE
    assert (out[:, 448:] != x[:, 448:]).float().mean() > 0.9
    # the indexer's 128-dim heads rotate dims 64..127 with the same function
    xi = randn((3, 128), seed=2)
    oi = apply_gptj(xi, pos, table)
    assert torch.equal(oi[:, :64], xi[:, :64])
    assert_close(oi[:, 64:], apply_gptj(xi[:, 64:].contiguous(), pos, table), "exact")
    # a first-64-dims RoPE (DeepSeek-V3 style) is a different function: a check on dims 448.. would catch it
    first = torch.cat([apply_gptj(x[:, :64].contiguous(), pos, table), x[:, 64:]], dim=1)
    assert not torch.equal(first, out)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference(ctable, dtype, inverse):
    x = randn((6, 4, 512), seed=3, dtype=dtype)
    per_token = torch.tensor([0, 1, 255, 256, 4095, 17], device=DEVICE)
    per_row = torch.randint(0, 4096, (6, 4), generator=generator(4)).to(DEVICE)
    for pos in (per_token, per_row):
        got = apply_gptj(x, pos, ctable, inverse, backend="triton")
        assert_close(got, apply_gptj(x, pos, ctable, inverse, backend="reference"), "exact", "apply_gptj")
    # a non-contiguous input (a slice of the heads) goes through the same path
    xs = x[:, 1:3]
    assert_close(apply_gptj(xs, per_token, ctable, backend="triton"), reference.apply_gptj(xs, per_token, ctable), "exact")


# ------------------------------------------------------------------------------------------------
# 2. frequencies, YaRN, the table (docs/rope.md#yarn)
# ------------------------------------------------------------------------------------------------


def test_yarn_ramp_edges():
    assert yarn_correction_range(64, 160000.0, YARN) == (15.0, 25.0)
    corr = lambda n: 64 * math.log(65536 / (2 * math.pi * n)) / (2 * math.log(160000))  # noqa: E731
    assert corr(32) == pytest.approx(15.453, abs=1e-3) and corr(1) == pytest.approx(24.708, abs=1e-3)
    # low == high gets a 0.001-wide ramp: β_fast = β_slow puts both on one index
    lo, hi = yarn_correction_range(64, 160000.0, dict(YARN, beta_fast=2.0, beta_slow=2.0))
    assert hi != lo


def test_yarn_inv_freq_values():
    f = inv_freq(64, 160000.0, YARN).double()
    spec = {0: 1.0, 1: 0.68765602, 15: 3.6355386e-3, 16: 2.265625e-3, 20: 2.9697778e-4, 25: 5.3723127e-6, 31: 5.6805290e-7}
    for i, v in spec.items():
        assert f[i].item() == pytest.approx(v, rel=YARN_RTOL), i
    plain = inv_freq(64, 160000.0).double()
    assert plain[16].item() == pytest.approx(2.5e-3, rel=YARN_RTOL)
    assert plain[31].item() == pytest.approx(9.0888465e-6, rel=YARN_RTOL)
    # ramp edges: i <= 15 keeps the original frequency exactly, i >= 25 is exactly 1/16 of it
    assert torch.equal(f[:16], plain[:16])
    assert torch.allclose(f[25:], plain[25:] / 16, rtol=YARN_RTOL, atol=0)
    # against a float64 evaluation of the formula everywhere
    i = torch.arange(32, dtype=torch.float64)
    pf = 160000.0 ** (2 * i / 64)
    ramp = ((i - 15) / 10).clamp(0, 1)
    assert torch.allclose(f, ramp / (16 * pf) + (1 - ramp) / pf, rtol=YARN_RTOL, atol=0)
    w = inv_freq(64, 10000.0).double()
    assert w[1].item() == pytest.approx(0.74989421, rel=YARN_RTOL)
    assert w[31].item() == pytest.approx(1.3335214e-4, rel=YARN_RTOL)


def test_table_layout_no_mscale(ctable):
    assert ctable.shape == (4096, 64) and ctable.dtype == torch.float32
    p = torch.tensor([0, 1, 37, 299, 4095])
    rows = ctable[p.to(DEVICE)].cpu().double()
    f = p.double()[:, None] * inv_freq(64, 160000.0, YARN).double()[None]
    # [cos 0..31 | sin 0..31], not interleaved; the fp32 angle fp32(p)·inv_freq is off from the exact one by
    # <= 2 half-ulps of f <= p (docs/rope.md#the-cossin-table: "about 1e-7·p rad"), so allow 1.2e-7·p + 1e-6
    bound = 1e-6 + 1.2e-7 * p.double()[:, None]
    assert ((rows[:, :32] - f.cos()).abs() <= bound).all() and ((rows[:, 32:] - f.sin()).abs() <= bound).all()
    # no YaRN mscale: cos² + sin² = 1
    assert torch.allclose(rows[:, :32] ** 2 + rows[:, 32:] ** 2, torch.ones(5, 32, dtype=torch.float64), atol=1e-6)
    assert torch.equal(cos_sin_rows(p, 64, 160000.0, YARN), ctable[p.to(DEVICE)].cpu())
    # the two layer tables are different functions (docs/rope.md#pitfalls: a θ-10000 table in a compressed layer)
    assert not torch.allclose(cos_sin_cache(300)[299], ctable[299], atol=1e-3)


def test_positions_up_to_1m():
    big = torch.tensor([(1 << 20) - 1, 1 << 19, 999_999])
    rows = cos_sin_rows(big, 64, 160000.0, YARN).double()
    # the same fp32 recipe emulated in float64: fp32(p)·fp32(inv_freq) rounded to fp32, then cos/sin
    f = (big.double()[:, None] * inv_freq(64, 160000.0, YARN).double()[None]).float().double()
    assert torch.allclose(rows[:, :32], f.cos(), atol=2e-6) and torch.allclose(rows[:, 32:], f.sin(), atol=2e-6)


def _sparse_big_table(pos):
    """A 2^20-row table (256 MiB, left unwritten: the OS commits only the pages we touch) with the rows
    at ``pos`` filled in: the kernels index a 1M-row table at its far end without building all of it."""
    t = torch.empty((1 << 20, 64), dtype=torch.float32, device=DEVICE)
    t[pos] = cos_sin_rows(pos.cpu(), 64, 160000.0, YARN).to(DEVICE)
    return t


def test_fused_kernel_at_1m_positions(fused_variant):
    pos = torch.tensor([(1 << 20) - 1, 700_001, 1 << 19], device=DEVICE)
    tab = _sparse_big_table(pos)
    _fused_case(T=3, H=2, B=16, n_blocks=1, n_slots=3, pos=pos, table=tab, seed=40, launch=fused_variant)
    x = randn((3, 512), seed=41)
    assert_close(apply_gptj(x, pos, tab, backend="triton"), apply_gptj(x, pos, tab, backend="reference"), "exact")


@pytest.mark.skipif(interpreting(), reason="the full 256 MiB table: GPU only")
def test_full_1m_table(fused_variant):
    tab = cos_sin_cache(FLASH.max_position, theta=160000.0, yarn=YARN)
    p = torch.tensor([0, 65535, 65536, 999_999, (1 << 20) - 1])
    assert torch.equal(tab[p.to(DEVICE)].cpu(), cos_sin_rows(p, 64, 160000.0, YARN))
    pos = torch.randint(0, 1 << 20, (64,), generator=generator(5)).to(DEVICE)
    _fused_case(T=64, H=64, B=64, n_blocks=2, n_slots=60, pos=pos, table=tab, seed=42, launch=fused_variant)


# ------------------------------------------------------------------------------------------------
# 3. rotation properties; inverse (docs/rope.md#inverse-rope); compressed-K position
# ------------------------------------------------------------------------------------------------


def test_inverse_undoes_forward(ctable):
    x = randn((8, 4, 512), seed=6, dtype=torch.float32)
    pos = torch.randint(0, 4096, (8,), generator=generator(6)).to(DEVICE)
    for backend in ("reference", "triton"):
        y = apply_gptj(x, pos, ctable, backend=backend)
        back = apply_gptj(y, pos, ctable, inverse=True, backend=backend)
        assert_close(back, x, "fp32_elementwise", "inv(rope(x))")
        assert not torch.allclose(y, x, atol=1e-3)  # the forward rotation did something


def test_relative_position_property(ctable):
    """<rope(q, m), rope(k, n)> depends only on m − n (docs/rope.md#inverse-rope: scores are already relative)."""
    q = randn((1, 64), seed=7, dtype=torch.float32, octaves=4)
    k = randn((1, 64), seed=8, dtype=torch.float32, octaves=4)

    def score(m, n):
        qm = apply_gptj(q, torch.tensor([m], device=DEVICE), ctable)
        kn = apply_gptj(k, torch.tensor([n], device=DEVICE), ctable)
        return (qm.double() * kn.double()).sum().item()

    scale = (q.double().norm() * k.double().norm()).item()
    for m, n, d in [(10, 3, 1000), (100, 100, 3000), (7, 40, 512)]:
        assert score(m, n) == pytest.approx(score(m + d, n + d), abs=1e-5 * scale)
    assert abs(score(10, 3) - score(10, 4)) > 1e-3 * scale  # while the offset itself matters


def test_compressed_key_position(ctable):
    assert [compressed_position(p, 4) for p in (0, 3, 4, 37, 299)] == [0, 0, 4, 36, 296]
    assert [compressed_position(p, 128) for p in (127, 128, 299)] == [0, 128, 256]
    assert compressed_position(299, 0) == 299
    p = torch.tensor([299, 37])
    start = compressed_position(p, 4)
    # golden: the compressed key of the window holding p is rotated at its first position (p//4)·4
    k = randn((2, 512), seed=9, dtype=torch.float32, octaves=4)
    f = start.double()[:, None] * inv_freq(64, 160000.0, YARN).double()[None]
    e, o = k[:, 448::2].cpu().double(), k[:, 449::2].cpu().double()
    golden = torch.stack([e * f.cos() - o * f.sin(), e * f.sin() + o * f.cos()], -1).flatten(-2)
    scale = k[:, 448:].abs().max().item()
    good = apply_gptj(k, start.to(DEVICE), ctable)[:, 448:].cpu().double()
    wrong = apply_gptj(k, p.to(DEVICE), ctable)[:, 448:].cpu().double()
    assert torch.allclose(good, golden, atol=1e-5 * scale, rtol=0)
    assert not torch.allclose(wrong, golden, atol=1e-2 * scale, rtol=0)  # rotated at p: fails the golden


# ------------------------------------------------------------------------------------------------
# 4. the fused kernel (docs/rope.md#the-fused-prologue-step)
# ------------------------------------------------------------------------------------------------


def _vllm_style_q(q, pos, table):
    """vLLM's torch test reference: bf16 after the norm, then rotate (docs/rope.md#exactness)."""
    x = q.float()
    rr = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return reference.apply_gptj((x * rr).to(torch.bfloat16), pos, table)


def _assert_q_close_vllm(got, want):
    """|got − want| <= atol + rtol·(|got| + m), m = max(|got[d]|, |got[d ^ 1]|): the row "qnorm_rope_q",
    the conformance suite's tolerance for q (the pair's scale; see the comment at the top)."""
    assert_close(want, got, "qnorm_rope_q", "q vs the vLLM-style reference", mass=pair_max(got))


def _fused_case(T, H, B, n_blocks, n_slots, pos, table, seed, launch):
    q = randn((T, H, 512), seed=seed)
    kv = randn((T, 512), seed=seed + 1)
    g = generator(seed)
    slots = torch.randperm(n_blocks * B, generator=g)[:n_slots].to(DEVICE)
    if n_slots > 2:
        slots[1] = -1
    # a cache full of random bytes: whatever the kernel must not touch keeps its bytes (snapshot)
    start = torch.randint(0, 256, (n_blocks, kv_cache.page_bytes(B)), generator=g, dtype=torch.uint8).to(DEVICE)
    q_out, c_out, kv_in = q.clone(), start.clone(), kv.clone()
    qnorm_rope_kv_insert(q_out, kv, c_out, slots, pos, table, eps=EPS, block_size=B, launch=launch)
    assert torch.equal(kv.view(torch.int16), kv_in.view(torch.int16)), "kv must not be modified"

    # cache bytes == kv_cache.insert(apply_gptj(kv)) [EXACT], untouched slots keep their bytes
    c_ref = start.clone()
    kv_cache.insert(c_ref, reference.apply_gptj(kv, pos, table), slots, block_size=B, backend="reference")
    assert_close(c_out, c_ref, "exact", "cache bytes")
    written = slots[slots >= 0]
    untouched = torch.ones(n_blocks * B, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    ids = untouched.nonzero()[:, 0]
    flat_o, flat_s = kv_cache.flat_bytes(c_out), kv_cache.flat_bytes(start)
    d, s = kv_cache.token_offsets(c_out, ids, B)
    for base, n in ((d, 576), (s, 8)):
        idx = base[:, None] + torch.arange(n, device=DEVICE)
        assert torch.equal(flat_o[idx], flat_s[idx]), "a slot that was not written changed"
    # the RoPE region round-trips exactly through the reader
    if written.numel():
        keep = slots >= 0
        got = kv_cache.gather(c_out, written, block_size=B)[:, 448:]
        assert_close(got, reference.apply_gptj(kv, pos, table)[: slots.shape[0]][keep][:, 448:], "exact", "gathered RoPE")

    # q: EXACT vs the canonical form (the reference backend), within "qnorm_rope_q" of the vLLM-style reference
    q_ref, c_ref2 = q.clone(), start.clone()
    qnorm_rope_kv_insert(q_ref, kv, c_ref2, slots, pos, table, eps=EPS, block_size=B, backend="reference")
    assert_close(q_out, q_ref, "exact", "q")
    assert_close(c_ref2, c_out, "exact", "reference backend cache")
    _assert_q_close_vllm(q_out, _vllm_style_q(q, pos, table))
    # q is normalised: RMS over the 512 dims is 1 per head (rotation keeps the norm)
    rms = q_out.double().pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-2)
    return q_out, c_out


@pytest.mark.parametrize("T,H,B,n_blocks,n_slots", [(4, 16, 16, 2, 4), (5, 3, 61, 1, 3)])
def test_fused_kernel(table, T, H, B, n_blocks, n_slots, fused_variant):
    """Tiny config (H = 16, B = 16), an odd page (B = 61) with H = 3 (a partial head group for 2 and 8 heads
    per program); slot −1 in row 1 and T'' < T where n_slots < T (rows beyond T'' write nothing)."""
    pos = torch.randint(0, 4096, (T,), generator=generator(T + H)).to(DEVICE)
    _fused_case(T, H, B, n_blocks, n_slots, pos, table, seed=T * H, launch=fused_variant)


@pytest.mark.parametrize("hpp", [2, 8])
def test_fused_kernel_128_heads(table, hpp):
    """H = 128 (the most the op takes) on the kernels that group heads: 64 groups of 2 (the default launch) and
    16 of 8, with 2-token pages. One token is enough: the grid's head-group index runs over all 128 heads per
    token (several tokens, T'' < T and slot −1 are test_fused_kernel's), and the per-head kernel and 1 head per
    program group nothing, so H = 128 is no boundary for them."""
    pos = torch.tensor([3000], device=DEVICE)
    _fused_case(1, 128, 2, 3, 1, pos, table, seed=128 + hpp, launch=RopeLaunch(heads_per_prog=hpp))


def test_fused_kernel_empty_slots_and_padding_rows(table, fused_variant):
    """All slots −1, or an empty ``slots``: q is still normalised and rotated, the cache untouched."""
    pos = torch.tensor([0, 4095], device=DEVICE)
    for slots in (torch.tensor([-1, -1], device=DEVICE), torch.empty(0, dtype=torch.int64, device=DEVICE)):
        q = randn((2, 2, 512), seed=11)
        kv = randn((2, 512), seed=12)
        cache = torch.full((1, kv_cache.page_bytes(16)), 0x7F, dtype=torch.uint8, device=DEVICE)  # poison
        q_ref = q.clone()
        qnorm_rope_kv_insert(q, kv, cache, slots, pos, table, eps=EPS, block_size=16, launch=fused_variant)
        qnorm_rope_kv_insert(q_ref, kv, cache.clone(), slots, pos, table, eps=EPS, block_size=16, backend="reference")
        assert bool((cache == 0x7F).all())
        assert_close(q, q_ref, "exact", "q")


def test_heads_whose_mean_square_is_near_eps(table, fused_variant):
    """Heads with Σ q² / 512 at 0, eps / 4, eps and 4·eps (values ~1e-3): there eps is not negligible, so a
    norm that drops it, adds it after the square root or squares it shows (random heads of magnitude ~1,
    as in the other tests, pass all of those). The kernels equal the reference bit for bit, and the reference
    is q · (Σ q² / 512 + eps)^-½ in float64, within the "qnorm_rope_q" tolerance."""
    T, H = 2, 4
    q = randn((T, H, 512), seed=21, block=None, octaves=0).double()
    q = q / q.pow(2).mean(-1, keepdim=True).sqrt()  # every head: mean square 1
    target = torch.tensor([0.0, 0.25, 1.0, 4.0], dtype=torch.float64, device=DEVICE) * EPS
    q = (q * target.sqrt()[None, :, None]).to(torch.bfloat16)
    ms = q.double().pow(2).mean(-1)
    assert (ms[:, 1:] / target[1:]).sub(1).abs().max() < 0.02, "the heads' mean squares are near the targets"
    kv = randn((T, 512), seed=22)
    pos = torch.tensor([3, 4000], device=DEVICE)
    slots = torch.tensor([-1, -1], device=DEVICE)
    cache = kv_cache.allocate(1, 16)
    got, ref_q = q.clone(), q.clone()
    qnorm_rope_kv_insert(got, kv, cache, slots, pos, table, eps=EPS, block_size=16, launch=fused_variant)
    qnorm_rope_kv_insert(ref_q, kv, cache, slots, pos, table, eps=EPS, block_size=16, backend="reference")
    assert_close(got, ref_q, "exact", "q")
    normed = (q.double() * torch.rsqrt(ms[..., None] + EPS)).float()  # the norm in float64, then fp32
    want = reference.apply_gptj(normed, pos, table)
    assert_close(want, got, "qnorm_rope_q", "q vs the float64 formula", mass=pair_max(got))
    assert got[:, 0].abs().max() == 0  # a zero head stays zero: no NaN from 0 / sqrt(0)


def test_fused_op_is_registered(table, fused_variant):
    op = torch.ops.dsv4ref.qnorm_rope_kv_insert.default
    assert op._schema.arguments[0].alias_info.is_write and op._schema.arguments[2].alias_info.is_write
    q = randn((2, 2, 512), seed=13)
    run = fused_variant.resolve(q)  # every launch choice is an argument of the op
    args = (
        q,
        randn((2, 512), seed=14),
        kv_cache.allocate(1, 2),
        torch.tensor([1, 0], device=DEVICE),
        torch.tensor([3, 9], device=DEVICE),
        table,
        EPS,
        2,
        run.heads_per_prog,
        run.warps,
    )
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("hpp", [0, 4])
def test_fused_kernel_strided_q(table, hpp):
    """q as a view of a wider buffer: an even row pitch (514 dims: the multi-head kernel reads int32 pairs
    with a head stride of 257 words) and an odd start (q[..., 1:513]: not 4-byte aligned, so the launcher
    falls back to the per-head kernel). Only q's 512 dims change; the pad columns keep their bits."""
    T, H, B = 3, 5, 16
    pos = torch.tensor([7, 4095, 300], device=DEVICE)
    kv = randn((T, 512), seed=61)
    slots = torch.tensor([3, -1, 17], device=DEVICE)
    for start in (0, 1):
        buf = randn((T, H, 514), seed=60 + start)
        before = buf.clone()
        q = buf[..., start : start + 512]
        assert rope.launch.packable(q) == (start == 0)
        q_ref, c_ref, c_out = q.clone(), kv_cache.allocate(2, B), kv_cache.allocate(2, B)
        qnorm_rope_kv_insert(q_ref, kv, c_ref, slots, pos, table, eps=EPS, block_size=B, backend="reference")
        qnorm_rope_kv_insert(q, kv, c_out, slots, pos, table, eps=EPS, block_size=B, launch=RopeLaunch(hpp))
        assert_close(q, q_ref, "exact", "q")
        assert_close(c_out, c_ref, "exact", "cache bytes")
        pad = torch.ones(514, dtype=torch.bool)
        pad[start : start + 512] = False
        assert torch.equal(buf[..., pad].view(torch.int16), before[..., pad].view(torch.int16))


def test_fused_heads_per_prog_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="heads_per_prog: expected 0 or a power of two, got 3"):
        RopeLaunch(heads_per_prog=3)
    with pytest.raises(ValueError, match="num_warps: expected None or a power of two"):
        RopeLaunch(num_warps=3)
    assert RopeLaunch().warps == 1 and RopeLaunch(8).warps == 4 and RopeLaunch(0).warps == 1


@pytest.mark.skipif(interpreting(), reason="num_warps only matters compiled: GPU only")
@pytest.mark.parametrize("launch", MH_SWEEP, ids=lambda lc: f"hpp{lc.heads_per_prog}_w{lc.warps}")
def test_fused_mh_bench_configs(table, launch):
    """Every launch that `python -m dsv4ref bench rope` times is bit-exact compiled: q vs the canonical
    reference, cache bytes vs kv_cache.insert(apply_gptj(kv)); H = 64 and H = 13 (a partial head group)."""
    hpp, warps = launch.heads_per_prog, launch.warps
    for T, H in ((64, 64), (9, 13)):
        q, kv, slots, pos = rope.example_inputs(T, H, 64, 2, seed=H + hpp, cos_sin=table)
        q_ref, c_ref = q.clone(), kv_cache.allocate(2, 64)
        qnorm_rope_kv_insert(q_ref, kv, c_ref, slots, pos, table, eps=EPS, block_size=64, backend="reference")
        q_out, c_out = q.clone(), kv_cache.allocate(2, 64)
        qnorm_rope_kv_insert(q_out, kv, c_out, slots, pos, table, eps=EPS, block_size=64, launch=launch)
        assert_close(q_out, q_ref, "exact", f"q hpp={hpp} warps={warps}")
        assert_close(c_out, c_ref, "exact", f"cache hpp={hpp} warps={warps}")


# ------------------------------------------------------------------------------------------------
# 5. inverse RoPE on the output: the Δ-shift invariance (docs/rope.md#inverse-rope)
# ------------------------------------------------------------------------------------------------


def _decode_output(delta, table):
    """One query token at position 1000 + Δ attends to 8 keys at 1000 + Δ − j (itself included),
    inserted with the fused kernel; attention in float64 over the gathered (dequantised) rows.
    Returns the output with its RoPE dims rotated back at the query position, and without that step."""
    T, H, B = 8, 2, 16
    pos = (1000 + delta - torch.arange(T)).to(DEVICE)
    q = randn((T, H, 512), seed=20, octaves=4)
    kv = randn((T, 512), seed=21, octaves=4)
    cache = kv_cache.allocate(1, B)
    slots = torch.arange(T, device=DEVICE)
    qnorm_rope_kv_insert(q, kv, cache, slots, pos, table, eps=EPS, block_size=B)
    k = kv_cache.gather(cache, slots, block_size=B).double()  # K = V = the full 512-dim row
    p = torch.softmax((q[0].double() @ k.T) * 512**-0.5, dim=-1)  # (H, T)
    o = (p @ k).float()  # (H, 512)
    return apply_gptj(o, pos[:1].expand(H), table, inverse=True), o  # the query position, every head


def test_output_inverse_rope_shift_invariance(table):
    delta = 128 * 7  # a multiple of 128 keeps compressed-window starts aligned
    (a, a0), (b, b0) = _decode_output(0, table), _decode_output(delta, table)
    torch.testing.assert_close(a, b, **SHIFT_TOL)
    # without the inverse step (a0, b0) the RoPE dims of the output rotate with Δ (the missing-inverse pitfall)
    torch.testing.assert_close(a0[:, :448], b0[:, :448], **SHIFT_TOL)
    assert (a0[:, 448:] - b0[:, 448:]).abs().max() > 10 * SHIFT_TOL["atol"] * (1 + a0[:, 448:].abs().max())


# ------------------------------------------------------------------------------------------------
# 6. bad input
# ------------------------------------------------------------------------------------------------


def test_bad_input_raises(table):
    T, H, B = 2, 2, 16
    q = randn((T, H, 512), seed=50)
    kv = randn((T, 512), seed=51)
    cache = kv_cache.allocate(1, B)
    slots = torch.tensor([0, 1], device=DEVICE)
    pos = torch.tensor([0, 1], device=DEVICE)

    def call(**kw):
        a = dict(q=q, kv=kv, cache=cache, slots=slots, positions=pos, cos_sin=table, eps=EPS, block_size=B)
        a.update(kw)
        qnorm_rope_kv_insert(**a)

    with pytest.raises(TypeError, match="q: expected dtype"):
        call(q=q.float())
    with pytest.raises(ValueError, match=r"q: expected \[T, H, 512\]"):
        call(q=q[..., :256])
    with pytest.raises(ValueError, match="q: H = 129 query heads; at most 128"):
        call(q=torch.zeros(T, 129, 512, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="kv: expected shape"):
        call(kv=kv[:1])
    with pytest.raises(TypeError, match="kv: expected dtype"):
        call(kv=kv.half())
    with pytest.raises(ValueError, match="positions: entry 1 = 4096 is out of range"):
        call(positions=torch.tensor([0, 4096], device=DEVICE))
    with pytest.raises(ValueError, match="positions: entry 0 = -1 is out of range"):
        call(positions=torch.tensor([-1, 0], device=DEVICE))
    with pytest.raises(ValueError, match="positions: expected shape"):
        call(positions=pos[:1])
    with pytest.raises(TypeError, match="positions: expected dtype"):
        call(positions=pos.float())
    with pytest.raises(ValueError, match="slots: has 3 entries"):
        call(slots=torch.tensor([0, 1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="slots: entry 1 = 16 is out of range"):
        call(slots=torch.tensor([0, 16], device=DEVICE))
    with pytest.raises(ValueError, match="cos_sin: expected 64 columns"):
        call(cos_sin=table[:, :32].contiguous())
    with pytest.raises(TypeError, match="cos_sin: expected dtype"):
        call(cos_sin=table.double())
    with pytest.raises(ValueError, match="cache: pages of"):
        call(block_size=64)
    with pytest.raises(ValueError, match="eps: expected a positive"):
        call(eps=0.0)
    with pytest.raises(ValueError, match="backend"):
        call(backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        apply_neox(kv, pos, table, backend="triton")
    # apply_gptj / apply_neox
    with pytest.raises(ValueError, match="positions: expected shape"):
        apply_gptj(q, pos[:1], table)
    with pytest.raises(ValueError, match="positions: entry 0 = 5000"):
        apply_gptj(kv, torch.tensor([5000, 0], device=DEVICE), table, backend="triton")
    with pytest.raises(TypeError, match="x: expected dtype"):
        apply_neox(kv.half(), pos, table)
    with pytest.raises(ValueError, match="x: the last dim must hold the 64 rotary dims"):
        apply_gptj(kv[:, :32], pos, table)
    with pytest.raises(ValueError, match="max_pos"):
        cos_sin_cache(0)
    with pytest.raises(ValueError, match="yarn: missing keys"):
        cos_sin_cache(8, yarn=dict(factor=16))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_qnorm_is_deepseeks_bf16_line(backend):
    """The per-head q RMSNorm is DeepSeek's line run on bf16 q, ``q *= torch.rsqrt(q.square().mean(-1,
    keepdim=True) + eps)`` (each op rounds to bf16), recomputed here with torch's own bf16 ops: the NoPE dims
    (not rotated) are equal on V4-Flash's width; the fp32 form (one rounding after an fp32 norm) is not."""
    T, H = 2, 16
    q = randn((T, H, 512), seed=41, block=None, octaves=6)
    pos = torch.arange(T, device=DEVICE) * 37
    table = cos_sin_cache(512, theta=10000.0)
    ds = q.cpu().clone()
    ds *= torch.rsqrt(ds.square().mean(-1, keepdim=True) + EPS)  # DeepSeek's bf16 tensor ops
    kv = randn((T, 512), seed=42, block=64, octaves=4)
    cache = kv_cache.allocate(1, 16, device=DEVICE)
    got = q.clone()
    qnorm_rope_kv_insert(got, kv, cache, torch.arange(T, device=DEVICE), pos, table, eps=EPS, block_size=16, backend=backend)
    nope = slice(0, 448)
    assert torch.equal(got[..., nope].cpu(), ds[..., nope])
    x = q.cpu().float()
    fp32_form = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    assert not torch.equal(fp32_form[..., nope], ds[..., nope])


def test_default_launch_is_what_its_docstring_says_on_each_device():
    """default_launch(): the measured GPU default (2 heads per program, 1 warp) compiled; in the interpreter
    INTERPRETER_HEADS_PER_PROG heads per program; with no argument, this process's."""
    from dsv4ref.rope.launch import INTERPRETER_HEADS_PER_PROG, default_launch

    gpu, cpu = default_launch(interpreted=False), default_launch(interpreted=True)
    assert (gpu.heads_per_prog, gpu.warps) == (2, 1) and gpu == RopeLaunch()
    assert cpu.heads_per_prog == INTERPRETER_HEADS_PER_PROG
    assert default_launch() == (cpu if interpreting() else gpu)
