"""dsv4ref.linear: V4's FP8 / FP4 projections (docs/linear.md).

Bytes (act_quant, the weight quantisers, the E2M1 codec) are checked against independent oracles written
here or in tests/test_fp8.py (the e4m3 grid from its bit formula, scale exponents from math.frexp); the GEMMs
against the float64 oracle of the same quantised operands under the ``linear_out`` tolerance, which
``test_the_tolerance_has_teeth`` shows a real indexing bug fails.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_fp8 import GRID, oracle_quantize

from dsv4ref import linear, validate
from dsv4ref.config import TINY
from dsv4ref.device import DEVICE, interpreting
from dsv4ref.linear import launch as launch_mod
from dsv4ref.linear import reference
from dsv4ref.testing import assert_close, compare, randn

BACKENDS = ["reference", "triton"]
SHAPES = [(1, 64, 256), (5, 130, 300), (17, 72, 128), (40, 24, 96)]  # (M, N, K): K % 128 != 0 twice


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def weight(n, k, seed=2):
    """fp32 [N, K] with real magnitudes: a scale per 32 along K over 16 octaves, times 0.02."""
    return randn((n, k), seed=seed, dtype=torch.float32, block=32) * 0.02


def operands(m, n, k, fp4=False, seed=1):
    x = randn((m, k), seed=seed, dtype=torch.bfloat16, block=128)
    w, ws = (linear.quantize_fp4_weight if fp4 else linear.quantize_fp8_weight)(weight(n, k, seed + 1))
    return x, w, ws


# ---- the E2M1 codec ------------------------------------------------------------------------------------


def numpy_e2m1(y):
    """An independent E2M1 encoder: nearest grid value, ties to the even code, saturating, sign bit kept."""
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    a = np.minimum(np.abs(y), 6.0)[:, None]
    d = np.abs(grid[None, :] - a)
    best = d.min(1, keepdims=True)
    cand = np.where(d == best, np.arange(8), 99)
    even = np.where(cand % 2 == 0, cand, 99).min(1)
    code = np.where(even < 99, even, cand.min(1))
    return (code | (np.signbit(y).astype(np.int64) << 3)).astype(np.uint8)


def test_e2m1_codec_matches_an_independent_encoder():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9, -0.25, -2.5, -5.0, -0.0, 0.1, -0.1]
    y = torch.cat([torch.tensor(ties), torch.linspace(-8, 8, 4001)])
    assert torch.equal(linear.e2m1_encode(y), torch.from_numpy(numpy_e2m1(y.double().numpy())))
    codes = torch.arange(16, dtype=torch.uint8)
    assert linear.e2m1_decode(codes).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    packed = linear.pack_e2m1(codes)
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]  # element 2j in the LOW nibble
    assert torch.equal(linear.unpack_e2m1(packed), codes)


# ---- act_quant: bytes ------------------------------------------------------------------------------------


def oracle_act_quant(x, block=128):
    """(e4m3 bytes, fp32 scales) from test_fp8's float64 oracle, on x zero-padded to whole blocks."""
    xp = F.pad(x.double().cpu(), (0, -x.shape[1] % block))
    if xp.shape[0] == 0:
        return torch.zeros(x.shape, dtype=torch.uint8), torch.zeros(0, xp.shape[1] // block)
    q, byte, _ = oracle_quantize(xp, block, 1e-4)
    return q[:, : x.shape[1]], torch.exp2(byte.double() - 127).float()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 256), (7, 300), (33, 128), (0, 128), (3, 5)])
def test_act_quant_bytes_equal_the_float64_oracle(backend, dtype, m, k):
    x = randn((m, k), seed=3, dtype=dtype, block=16, octaves=30)
    q, s = linear.act_quant(x, backend=backend)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (m, -(-k // 128))
    oq, os_ = oracle_act_quant(x)
    assert torch.equal(bits(q), oq) and torch.equal(s.cpu(), os_)


@pytest.mark.parametrize("backend", BACKENDS)
def test_act_quant_hard_blocks(backend):
    """All-zero -> 2^-22 (floor 1e-4), 0 < amax < 1e-4 -> 2^-22, amax = 448·2^k -> exactly 2^k."""
    x = torch.zeros(4, 256)
    x[1, :128] = torch.linspace(-5e-5, 9e-5, 128)
    for r, k in ((2, -3), (3, 5)):
        x[r] = torch.linspace(-1, 1, 256) * 300 * 2.0**k
        x[r, 7], x[r, 200] = 448 * 2.0**k, -448 * 2.0**k
    q, s = linear.act_quant(x.to(DEVICE), backend=backend)
    assert s.cpu().tolist() == [[2.0**-22] * 2, [2.0**-22] * 2, [2.0**-3] * 2, [2.0**5] * 2]
    assert bits(q)[2, 7] == 0x7E and bits(q)[2, 200] == 0xFE  # ±448: the largest code, never clamped lower


# ---- the weight quantisers: bytes --------------------------------------------------------------------------


def test_quantize_fp8_weight_bytes_per_128x128_tile():
    w = weight(200, 300)
    w8, ws = linear.quantize_fp8_weight(w)
    assert w8.dtype == torch.float8_e4m3fn and ws.dtype == torch.float8_e8m0fnu and ws.shape == (2, 3)
    for a in range(2):
        for b in range(3):
            tile = w[128 * a : 128 * a + 128, 128 * b : 128 * b + 128]
            q, byte, _ = oracle_quantize(tile.reshape(1, -1), tile.numel(), 448 * 2.0**-126)
            assert int(bits(ws)[a, b]) == int(byte)
            assert torch.equal(bits(w8)[128 * a : 128 * a + 128, 128 * b : 128 * b + 128], q.reshape(tile.shape))
    assert torch.equal(linear.dequantize_fp8_weight(w8, ws), reference.dequantize_fp8_weight(w8, ws))


def test_quantize_fp4_weight_bytes_per_1x32_block():
    w = weight(3, 96)
    w[0, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # amax 6 -> scale 1: E2M1 ties
    w[1, 32:64] = 0.0
    packed, ws = linear.quantize_fp4_weight(w)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (3, 48) and ws.shape == (3, 3)
    blocks = w.cpu().reshape(3, 3, 32).double()  # host: the oracle is numpy's
    amax = blocks.abs().amax(-1).clamp_min(6 * 2.0**-126)
    e = torch.tensor([exponent(float(torch.tensor(a.item() / 6).float())) for a in amax.flatten()]).reshape(3, 3).double()
    codes = torch.from_numpy(numpy_e2m1((blocks / torch.exp2(e)[..., None]).reshape(-1).numpy()).reshape(3, 96))
    assert torch.equal(bits(ws), (e + 127).to(torch.uint8))
    assert torch.equal(linear.unpack_e2m1(bits(packed)), codes)
    assert codes[0, :8].tolist() == [0, 2, 2, 4, 4, 6, 6, 7]  # 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4: ties to even
    deq = linear.dequantize_fp4_weight(packed, ws).cpu()
    assert torch.equal(deq, linear.e2m1_decode(codes) * torch.exp2(e).float().repeat_interleave(32, 1))


def exponent(s: float) -> int:
    """ceil(log2(s)) exactly, for s > 0 (math.frexp: s = m·2^x with m in [0.5, 1))."""
    m, x = math.frexp(s)
    return x - 1 if m == 0.5 else x


def test_quantisers_round_trip_within_the_format_bound():
    w = weight(130, 256)
    d8 = linear.dequantize_fp8_weight(*linear.quantize_fp8_weight(w))
    s8 = reference.scale_values(linear.quantize_fp8_weight(w)[1]).repeat_interleave(128, 0).repeat_interleave(128, 1)[:130]
    assert bool(((d8 - w).abs() <= s8 * 2.0**-9 + (w.abs() * 2.0**-4)).all())  # half a step of the e4m3 grid


# ---- the GEMMs: tolerance vs the float64 oracle --------------------------------------------------------------


def check_gemm(y, x, w, ws, fp4):
    q, s = reference.act_quant(x)
    gemm = reference.fp4_gemm if fp4 else reference.fp8_gemm
    oracle = gemm(q, s, w, ws, dtype=torch.float64)
    return compare(y, oracle, "linear_out", mass=reference.gemm_mass(q, s, w, ws, fp4=fp4))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_linear_vs_the_float64_oracle(backend, fp4, m, n, k):
    x, w, ws = operands(m, n, k, fp4)
    y = (linear.fp4_linear if fp4 else linear.fp8_linear)(x, w, ws, backend=backend)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    r = check_gemm(y, x, w, ws, fp4)
    assert r.passed, r


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4"])
def test_kernel_writes_every_output(fp4, monkeypatch):
    """Poison: every buffer the launcher allocates starts as NaN / 0x7F; the kernel must overwrite all of it."""
    real = torch.empty

    def poisoned(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t.fill_(0x7F)

    x, w, ws = operands(20, 70, 300, fp4)
    monkeypatch.setattr(launch_mod.torch, "empty", poisoned)
    y = (linear.fp4_linear if fp4 else linear.fp8_linear)(x, w, ws, backend="triton", launch=linear.LinearLaunch(16, 16))
    monkeypatch.undo()
    assert bool(y.isfinite().all()) and check_gemm(y, x, w, ws, fp4).passed


def test_fp4_kernel_nibble_order_and_scales_exact():
    """q = identity: y[m, n] is w's element (n, m) times its scales, exactly (one product per output)."""
    codes = torch.randint(0, 16, (40, 64), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    ws = torch.randint(120, 134, (40, 2), generator=torch.Generator().manual_seed(6), dtype=torch.uint8)
    packed = linear.pack_e2m1(codes).to(DEVICE)
    q = torch.eye(64).to(torch.float8_e4m3fn).to(DEVICE)
    s = torch.full((64, 1), 2.0**-3, device=DEVICE)
    y = linear.fp4_gemm(q, s, packed, ws.to(DEVICE), backend="triton")
    want = linear.dequantize_fp4_weight(packed.cpu(), ws).T * 2.0**-3
    assert torch.equal(y.cpu().float(), want)


def test_the_tolerance_has_teeth():
    """Real bugs fail ``linear_out``: the activation scale of the wrong K block, 128x128 weight scales indexed
    one tile off along N, swapped nibbles."""
    m, n, k = 8, 256, 512
    x = randn((m, k), seed=1, dtype=torch.bfloat16, block=128)
    w, ws = linear.quantize_fp8_weight(weight(n, k) * torch.exp2(torch.arange(n) // 128 * 3.0)[:, None].to(DEVICE))
    q, s = reference.act_quant(x)
    good = reference.fp8_gemm(q, s, w, ws)
    assert check_gemm(good, x, w, ws, False).passed
    wrong_block = reference.fp8_gemm(q, s.roll(1, dims=1), w, ws)
    wrong_tile = reference.fp8_gemm(q, s, w, ws.view(torch.uint8).roll(1, dims=0).view(ws.dtype))
    for bad in (wrong_block, wrong_tile):
        assert not check_gemm(bad, x, w, ws, False).passed
    x4, w4, ws4 = operands(m, n, k, fp4=True)
    q4, s4 = reference.act_quant(x4)
    swapped = ((w4.view(torch.uint8) >> 4) | (w4.view(torch.uint8) << 4)).view(w4.dtype)
    assert check_gemm(reference.fp4_gemm(q4, s4, w4, ws4), x4, w4, ws4, True).passed
    assert not check_gemm(reference.fp4_gemm(q4, s4, swapped, ws4), x4, w4, ws4, True).passed


def test_m_zero_and_strided_views():
    x, w, ws = operands(6, 64, 256)
    want = linear.fp8_linear(x, w, ws, backend="reference")
    for b in BACKENDS:
        assert linear.fp8_linear(x[:0], w, ws, backend=b).shape == (0, 64)
        big = torch.zeros(12, 256, dtype=x.dtype, device=DEVICE)
        big[::2] = x
        assert torch.equal(bits(linear.fp8_linear(big[::2], w, ws, backend=b)), bits(want))
        xt = x.T.contiguous().T  # column-major
        assert torch.equal(bits(linear.fp8_linear(xt, w, ws, backend=b)), bits(want))
        wt = w.view(torch.uint8).T.contiguous().T.view(w.dtype)
        assert torch.equal(bits(linear.fp8_linear(x, wt, ws, backend=b)), bits(want))


# ---- non-finite input, errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_policy(backend):
    x, w, ws = operands(3, 64, 256)
    x[1, 130] = float("inf")
    with pytest.raises(ValueError, match="^x: non-finite"):
        linear.fp8_linear(x, w, ws, backend=backend)
    with validate.checking_values(False):
        q, s = linear.act_quant(x, backend=backend)
        y = linear.fp8_linear(x, w, ws, backend=backend)
    assert bits(q)[1, 130] == 0x7F and bool(s[1, 1].isnan()) and not bool(s[1, 0].isnan())
    assert bool(y[1].isnan().all()) and bool(y[[0, 2]].isfinite().all())
    assert bits(y)[1, 0] == 0x7FC0
    with pytest.raises(ValueError, match="^q: e4m3 NaN codes"):
        linear.fp8_gemm(q, s, w, ws, backend=backend)


def test_errors_name_the_argument():
    x, w, ws = operands(2, 64, 256)
    w4, ws4 = linear.quantize_fp4_weight(weight(64, 256))
    cases = [
        (TypeError, "^x:", lambda: linear.fp8_linear(x.half(), w, ws)),
        (ValueError, "^x:", lambda: linear.fp8_linear(x[:, :128], w, ws)),
        (TypeError, "^w:", lambda: linear.fp8_linear(x, w.float(), ws)),
        (ValueError, "^w_scale:", lambda: linear.fp8_linear(x, w, ws[:, :1])),
        (TypeError, "^w_packed:", lambda: linear.fp4_linear(x, w4.view(torch.int8), ws4)),
        (ValueError, "^w_scale:", lambda: linear.fp4_linear(x, w4, ws)),
        (ValueError, "^w:", lambda: linear.quantize_fp4_weight(weight(4, 33))),
        (ValueError, "^block:", lambda: linear.act_quant(x, block=100)),
        (TypeError, "^launch:", lambda: linear.act_quant(x, launch=(16, 64))),
        (ValueError, "^backend:", lambda: linear.act_quant(x, backend="cuda")),
        (ValueError, "^block_m:", lambda: linear.LinearLaunch(block_m=8)),
        (ValueError, "^split_k:", lambda: linear.LinearLaunch(split_k=0)),
    ]
    for err, msg, call in cases:
        with pytest.raises(err, match=msg):
            call()


def test_custom_ops_opcheck():
    x, w, ws = operands(3, 32, 128)
    q, s = linear.act_quant(x)
    launch = linear.default_launch(3)
    torch.library.opcheck(launch_mod.act_quant_op, (x, 128, *launch.op_args("linear_act_quant")))
    gemm_args = (q.view(torch.uint8), s, w.view(torch.uint8), reference.scale_values(ws))
    torch.library.opcheck(launch_mod.fp8_gemm_op, (*gemm_args, *launch.op_args("linear_fp8_gemm")))


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4"])
def test_default_launch_is_what_its_docstring_says_and_changes_no_bit(fp4):
    """default_launch(m): block_m 16 / 32 / 64 by M, 64 columns per program on a GPU and INTERPRETER_BLOCK_N in the
    interpreter (with no argument, this process's); both give the same bits, at an N that is no multiple of
    either block (a partial last tile of each)."""
    for m, bm in ((3, 16), (20, 32), (100, 64)):
        gpu, cpu = linear.default_launch(m, interpreted=False), linear.default_launch(m, interpreted=True)
        assert (gpu.block_m, gpu.block_n, cpu.block_m, cpu.block_n) == (bm, 64, bm, launch_mod.INTERPRETER_BLOCK_N)
        assert linear.default_launch(m) == (cpu if interpreting() else gpu)
    x, w, ws = operands(5, 320, 256, fp4, seed=9)
    f = linear.fp4_linear if fp4 else linear.fp8_linear
    a = f(x, w, ws, backend="triton", launch=linear.default_launch(5, interpreted=False))
    b = f(x, w, ws, backend="triton", launch=linear.default_launch(5, interpreted=True))
    assert torch.equal(bits(a), bits(b))


def test_grid_values_are_the_e4m3_codes():
    """E2M1 -> e4m3 is exact: every E2M1 magnitude is on the e4m3 grid (the fp4 kernel's conversion)."""
    assert all(v in GRID.tolist() for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6))
    assert_close(linear.e2m1_decode(torch.arange(8)), torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6]), "exact")


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4"])
def test_every_scale_dtype_gives_the_same_bits(fp4):
    """Weight scales as float8_e8m0fnu, as their uint8 bytes (both decoded in the kernel) or as fp32 values;
    activation scales as fp32 or UE8M0 bytes: one answer."""
    x, w, ws = operands(9, 48, 256, fp4)
    q, s = linear.act_quant(x)
    gemm = linear.fp4_gemm if fp4 else linear.fp8_gemm
    for b in BACKENDS:
        want = gemm(q, s, w, ws, backend=b)
        s8 = (s.view(torch.int32) >> 23).to(torch.uint8).view(torch.float8_e8m0fnu)
        for sw in (ws.view(torch.uint8), reference.scale_values(ws)):
            assert torch.equal(bits(gemm(q, s, w, sw, backend=b)), bits(want))
        assert torch.equal(bits(gemm(q, s8, w, ws, backend=b)), bits(want))


def test_bench_shapes_are_v4_flash_projections():
    from dsv4ref.tools.cases import linear as cases

    s = cases.flash_shapes()
    assert s["wq_a"] == (1024, 4096) and s["wq_b"] == (64 * 512, 1024) and s["wkv"] == (512, 4096)
    assert s["wo_b"] == (4096, 8 * 1024) and s["shared_w1"] == (2048, 4096) and s["shared_w2"] == (4096, 2048)
    assert cases.flash_expert_shapes() == {"expert_w1": (2048, 4096), "expert_w2": (4096, 2048)}


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "fp4"])
@pytest.mark.parametrize("split_k", [2, 3, 64])
def test_split_k_within_the_tolerance(fp4, split_k, monkeypatch):
    """K split over programs: fp32 partials summed after the kernel; every output written (poisoned buffers),
    the answer within linear_out; more splits than K blocks is one split per block."""
    real = torch.empty

    def poisoned(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t.fill_(0x7F)

    x, w, ws = operands(19, 70, 700, fp4)
    monkeypatch.setattr(launch_mod.torch, "empty", poisoned)
    y = (linear.fp4_linear if fp4 else linear.fp8_linear)(x, w, ws, backend="triton", launch=linear.LinearLaunch(split_k=split_k))
    monkeypatch.undo()
    assert check_gemm(y, x, w, ws, fp4).passed


# ------------------------------------------------------------------------------------------------
# the attention's output projection (docs/linear.md#the-attentions-output-projection)
# ------------------------------------------------------------------------------------------------


def test_grouped_o_proj():
    T, H, G, o_lora, Hd = 3, TINY.num_heads, TINY.o_groups, 32, 48
    hpg = H // G
    o = randn((T, H, 512), seed=30, octaves=4)
    wo_a = randn((G, o_lora, hpg * 512), seed=31, octaves=0) * 0.02
    wo_b = randn((Hd, G * o_lora), seed=32, octaves=0) * 0.05
    out = linear.grouped_o_proj(o, wo_a, wo_b)
    assert out.shape == (T, Hd) and out.dtype == torch.bfloat16
    # float64 oracle, group by group: group g owns heads [g·hpg, (g+1)·hpg)
    z = torch.stack([o[:, g * hpg : (g + 1) * hpg].reshape(T, -1).double() @ wo_a[g].double().T for g in range(G)], 1)
    ref = z.reshape(T, -1) @ wo_b.double().T
    assert_close(out, ref, "bf16_gemm", "grouped o-proj")
    # strided grouping (heads g, g+G, …) is a different function: the check above would catch it
    zs = torch.stack([o[:, g::G].reshape(T, -1).double() @ wo_a[g].double().T for g in range(G)], 1)
    assert not torch.allclose((zs.reshape(T, -1) @ wo_b.double().T), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_o_proj_with_v4s_fp8_wo_b(backend):
    """V4's FP8 ``wo_b``: z (the bf16 ``wo_a`` half, heads in contiguous groups) through the 1x128 quantiser and
    the FP8 GEMM, held to the float64 oracle of those quantised operands (the ``linear_out`` tolerance); a NaN
    in o[t] gives a NaN row t, checks on or off; a bf16 ``wo_b`` given a scale, or an FP8 one without, is refused."""
    T, H, G, o_lora, Hd = 3, TINY.num_heads, TINY.o_groups, 80, 200  # G·o_lora = 160: a partial 128 block
    hpg = H // G
    o = randn((T, H, 512), seed=33, octaves=4)
    wo_a = randn((G, o_lora, hpg * 512), seed=34, octaves=0) * 0.02
    wo_b, wo_b_scale = linear.quantize_fp8_weight(weight(Hd, G * o_lora, seed=35))
    out = linear.grouped_o_proj(o, wo_a, wo_b, wo_b_scale, backend=backend)
    assert out.shape == (T, Hd) and out.dtype == torch.bfloat16
    z = torch.stack([o[:, g * hpg : (g + 1) * hpg].reshape(T, -1).double() @ wo_a[g].double().T for g in range(G)], 1)
    z = z.reshape(T, -1).to(torch.bfloat16)  # rounded to bf16 between the two GEMMs, as DeepSeek's Attention does
    r = check_gemm(out, z, wo_b, wo_b_scale, fp4=False)
    assert r.passed, r
    o[1, 5, 7] = float("nan")
    got = linear.grouped_o_proj(o, wo_a, wo_b, wo_b_scale, backend=backend)
    assert bool(got[1].isnan().all()) and bool(got[[0, 2]].isfinite().all())
    with pytest.raises(TypeError, match="^wo_b: expected dtype"):
        linear.grouped_o_proj(o, wo_a, wo_b.float().to(torch.bfloat16), wo_b_scale, backend=backend)
    with pytest.raises(TypeError, match="^wo_b: expected dtype"):
        linear.grouped_o_proj(o, wo_a, wo_b, backend="reference")


def test_grouped_o_proj_bad_input_raises():
    q = randn((2, 2, 512), seed=50)
    wo_a = torch.zeros(2, 8, 512, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="wo_a: G = 3 groups must divide H = 2"):
        linear.grouped_o_proj(
            q,
            torch.zeros(3, 8, 512, dtype=torch.bfloat16, device=DEVICE),
            torch.zeros(4, 24, dtype=torch.bfloat16, device=DEVICE),
        )
    with pytest.raises(ValueError, match="wo_b: expected shape"):
        linear.grouped_o_proj(q, wo_a, torch.zeros(4, 15, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="wo_a: expected shape"):
        linear.grouped_o_proj(
            q,
            torch.zeros(2, 8, 500, dtype=torch.bfloat16, device=DEVICE),
            torch.zeros(4, 16, dtype=torch.bfloat16, device=DEVICE),
        )
