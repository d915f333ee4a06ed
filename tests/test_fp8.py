"""dsv4ref.fp8: UE8M0-scaled e4m3 block quantisation (docs/formats.md, its pitfalls #1–#3 and #5–#7).

Every byte is checked against an *independent* float64 oracle written here from the format's
definition: the e4m3 grid is built from the bit-field formula (not from torch's fp8 dtype), the scale
exponent from ``math.frexp`` (not from fp32 bit tricks), rounding by nearest-neighbour search with ties
to the even code. Both backends must agree with it byte for byte.
"""

import math

import pytest
import torch

from dsv4ref.device import DEVICE
from dsv4ref.fp8 import dequantize_ue8m0, quantize_ue8m0
from dsv4ref.testing import assert_close, generator, randn

BACKENDS = ["reference", "triton"]
FLOOR = 1e-4

# ----------------------------------------------------------------------------------------------------
# The float64 oracle
# ----------------------------------------------------------------------------------------------------


def e4m3_grid() -> torch.Tensor:
    """Values of the 127 non-negative finite e4m3fn codes 0x00..0x7E, in code order (= value order),
    from the definition in docs/formats.md#fp8-e4m3fn."""
    vals = []
    for c in range(127):
        e, m = c >> 3, c & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


GRID = e4m3_grid()


def oracle_e4m3_bytes(y: torch.Tensor) -> torch.Tensor:
    """float64 values (already scaled) -> e4m3fn bytes: clamp to ±448, nearest grid value, ties to the
    even code; the sign bit comes from the sign of y, so -0.0 -> 0x80."""
    a = y.abs().clamp(max=448.0)
    hi = torch.searchsorted(GRID, a).clamp(max=126)  # first grid value >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - GRID[lo], GRID[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    sign = torch.signbit(y).to(torch.int64) << 7
    return (code | sign).to(torch.uint8)


def oracle_scale_exponent(amax: float, floor: float = FLOOR) -> int:
    """e = ceil(log2(fp32(max(amax, floor) / 448))) with exact arithmetic: fp32 division via float64
    (a double rounding that is innocuous for division, since 53 >= 2·24 + 2), then frexp."""
    a = max(amax, float(torch.tensor(floor, dtype=torch.float32)))
    s = float(torch.tensor(a / 448.0, dtype=torch.float64).float())
    m, x = math.frexp(s)  # s = m · 2^x, m in [0.5, 1)
    return x - 1 if m == 0.5 else x


def oracle_quantize(x: torch.Tensor, block: int = 64, floor: float = FLOOR):
    """(e4m3 bytes, scale bytes, dequantised float64 values) for x [..., D]."""
    xd = x.detach().cpu().double()
    xb = xd.reshape(-1, xd.shape[-1] // block, block)
    amax = xb.abs().amax(dim=-1)
    e = torch.tensor([oracle_scale_exponent(float(a), floor) for a in amax.flatten()], dtype=torch.float64)
    e = e.reshape(amax.shape)
    q = oracle_e4m3_bytes(xb / torch.exp2(e)[..., None])
    mag = GRID[(q & 0x7F).long()]
    deq = torch.where((q & 0x80) != 0, -mag, mag) * torch.exp2(e)[..., None]
    return (q.reshape(x.shape), (e + 127).to(torch.uint8).reshape(*x.shape[:-1], -1), deq.reshape(x.shape))


# ----------------------------------------------------------------------------------------------------
# Inputs with real magnitudes
# ----------------------------------------------------------------------------------------------------


def hard_blocks(dtype=torch.bfloat16) -> torch.Tensor:
    """[R, 64·8] rows whose 64-blocks are each a named hard case (docs/formats.md#ue8m0-scales; pitfalls #1, #3)."""
    g = generator(7)
    blocks = []
    for k in range(-20, 21):  # amax = 448·2^k exactly: s is a power of two, float log2+ceil may say k+1
        b = torch.randn(64, generator=g).clamp(-1, 1) * 300 * 2.0**k
        b[int(torch.randint(64, (1,), generator=g))] = (-1) ** k * 448 * 2.0**k
        blocks.append(b)
    for v in [1.75, 224.0, 448.0, 449.0, 3.0, 0.01, 1.0, 1e-6, 5e-5, 2.0**-30]:  # all-equal blocks
        blocks.append(torch.full((64,), v))
        blocks.append(torch.full((64,), -v))
    blocks.append(torch.zeros(64))  # all zero -> byte 105
    blocks.append(torch.full((64,), -0.0))  # negative zero -> 0x80 bytes, byte 105
    tiny = torch.randn(64, generator=g) * 1e-6  # below the floor: e4m3 subnormals at scale 2^-22
    tiny[::7] = -0.0
    blocks.append(tiny)
    blocks.append(torch.randn(64, generator=g) * 1e-4)  # amax straddles the floor
    wide = torch.randn(64, generator=g) * torch.exp2(torch.randint(-20, 8, (64,), generator=g).float())
    blocks.append(wide)  # one block, 28 octaves: its small values become e4m3 subnormals or zeros
    x = torch.stack(blocks)
    x = torch.cat([x, torch.zeros((-x.shape[0]) % 8, 64)])  # 8 blocks per row
    return x.reshape(-1, 8 * 64).to(dtype)


def mixed_input(dtype=torch.bfloat16) -> torch.Tensor:
    rnd = randn((12, 512), seed=3, octaves=40, dtype=dtype, device="cpu")  # 2^-20 .. 2^20 per block
    return torch.cat([hard_blocks(dtype), rnd]).to(DEVICE)


# ----------------------------------------------------------------------------------------------------
# The oracle itself (so that a wrong oracle cannot hide a wrong kernel)
# ----------------------------------------------------------------------------------------------------


def test_oracle_grid_matches_the_format_facts():
    assert GRID[0x7E] == 448 and GRID[0x08] == 2.0**-6 and GRID[0x01] == 2.0**-9 and GRID[0x38] == 1.0
    assert bool((GRID[1:] > GRID[:-1]).all())
    # the worked values of docs/formats.md#fp8-e4m3fn
    y = torch.tensor(
        [1.0, -1.0, 448, 449, 464, 470, -500, 2**-6, 2**-9, 2**-10, 3 * 2**-10, 17, 19, 232, 248, -0.0], dtype=torch.float64
    )
    want = [0x38, 0xB8, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x08, 0x01, 0x00, 0x02, 0x58, 0x5A, 0x76, 0x78, 0x80]
    assert oracle_e4m3_bytes(y).tolist() == want


def test_oracle_scale_table():
    # the worked KV examples of docs/formats.md#ue8m0-scales
    got = [oracle_scale_exponent(a) + 127 for a in [0.0, 0.01, 1.0, 1.75, 3.0, 448.0, 449.0]]
    assert got == [105, 112, 119, 119, 120, 127, 128]


# ----------------------------------------------------------------------------------------------------
# quantize
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_bytes_worked_table(backend):
    amax = [0.0, 0.01, 1.0, 1.75, 3.0, 448.0, 449.0]
    x = torch.zeros(len(amax), 64)
    for i, a in enumerate(amax):
        x[i, 5] = -a  # the amax element is negative: |x| is what counts
        x[i, 9] = a / 3
    _, s = quantize_ue8m0(x.to(DEVICE), backend=backend)
    assert s.cpu().flatten().tolist() == [105, 112, 119, 119, 120, 127, 128]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_bytes_equal_the_float64_oracle(backend, dtype):
    x = mixed_input(dtype)
    q, s = quantize_ue8m0(x, backend=backend)
    q_o, s_o, _ = oracle_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
    assert tuple(q.shape) == tuple(x.shape) and tuple(s.shape) == (x.shape[0], x.shape[1] // 64)
    assert_close(s.cpu(), s_o, "exact", "scale bytes")
    assert_close(q.cpu().view(torch.uint8), q_o, "exact", "e4m3 bytes")


def test_inputs_exercise_many_scales():
    """Pitfall #1 guard: the data above must not be unit-scale. Many distinct bytes overall and within
    single rows, byte 105 (zero/tiny blocks), and several blocks whose s is an exact power of two."""
    x = mixed_input()
    _, s, _ = oracle_quantize(x)
    assert len(set(s.flatten().tolist())) >= 40
    assert min(len(set(r)) for r in s[-12:].tolist()) >= 5
    assert 105 in s.flatten().tolist()
    amax = x.cpu().double().reshape(-1, 64).abs().amax(-1)
    exact_pow2 = [(a / 448) == 2.0 ** round(math.log2(a / 448)) for a in amax.tolist() if a > 0]
    assert sum(exact_pow2) >= 41


@pytest.mark.parametrize("backend", BACKENDS)
def test_amax_448_times_pow2_gets_the_ceil_byte(backend):
    """amax = 448·2^k must give byte 127 + k (not 128 + k): the largest element lands exactly on 448
    (0x7E / 0xFE) and nothing is clamped."""
    k = torch.arange(-20, 21)
    x = torch.zeros(len(k), 64)
    x[:, 0] = 448 * torch.exp2(k.float())
    x[:, 1] = -448 * torch.exp2(k.float())
    x[:, 2] = 300 * torch.exp2(k.float())
    q, s = quantize_ue8m0(x.to(torch.bfloat16).to(DEVICE), backend=backend)
    assert s.cpu().flatten().tolist() == (127 + k).tolist()
    qb = q.cpu().view(torch.uint8)
    assert set(qb[:, 0].tolist()) == {0x7E} and set(qb[:, 1].tolist()) == {0xFE}


def test_the_tests_catch_a_fuzzy_log2():
    """A mutant scale rule (float log2 that returns k + ε at powers of two, then ceil) must disagree
    with the bytes we test against on this data; round() and floor() rules must too."""
    x = mixed_input().cpu().double().reshape(-1, 64)
    s = x.abs().amax(-1).clamp(min=FLOOR) / 448
    _, good, _ = oracle_quantize(x.reshape(-1, 64))
    good = good.flatten().long()
    fuzzy = (torch.log2(s) + 1e-6).ceil().long() + 127
    rounded = torch.log2(s).round().long() + 127
    floored = torch.log2(s).floor().long() + 127
    for mutant in (fuzzy, rounded, floored):
        assert not torch.equal(mutant, good)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_scale_is_a_power_of_two(backend):
    """Pitfall #2: decode the scale bytes two ways, as fp32 bits and as torch.float8_e8m0fnu, and
    check both give the same value with a zero mantissa."""
    x = mixed_input()
    _, s = quantize_ue8m0(x, backend=backend)
    s = s.cpu()
    as_bits = (s.to(torch.int32) << 23).view(torch.float32)
    assert bool(((as_bits.view(torch.int32) & 0x7FFFFF) == 0).all())
    as_e8m0 = s.view(torch.float8_e8m0fnu).float()
    assert torch.equal(as_e8m0, as_bits)
    assert all(math.frexp(v)[0] == 0.5 for v in as_e8m0.flatten().tolist())


@pytest.mark.parametrize("backend", BACKENDS)
def test_largest_element_lands_in_upper_binade(backend):
    """docs/formats.md#block-quantisation: when amax >= floor, max|x| / 2^e is in (224, 448] before rounding."""
    x = mixed_input()
    _, s = quantize_ue8m0(x, backend=backend)
    amax = x.cpu().double().reshape(-1, 64).abs().amax(-1)
    ratio = amax / torch.exp2(s.cpu().double().flatten() - 127)
    big = amax >= FLOOR
    assert bool(big.any()) and bool((ratio[big] > 224).all()) and bool((ratio[big] <= 448).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block,shape", [(128, (3, 2, 256)), (32, (5, 96)), (64, (1, 64))])
def test_other_blocks_and_shapes(backend, block, shape):
    x = randn(shape, seed=11, block=block, octaves=24)
    q, s = quantize_ue8m0(x, block=block, backend=backend)
    q_o, s_o, _ = oracle_quantize(x, block=block)
    assert tuple(s.shape) == (*shape[:-1], shape[-1] // block)
    assert_close(s.cpu(), s_o, "exact")
    assert_close(q.cpu().view(torch.uint8), q_o, "exact")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_input(backend):
    q, s = quantize_ue8m0(torch.zeros(0, 128, device=DEVICE), backend=backend)
    assert tuple(q.shape) == (0, 128) and tuple(s.shape) == (0, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_never_emits_nan_codes(backend):
    x = mixed_input()
    q, _ = quantize_ue8m0(x, backend=backend)
    b = q.cpu().view(torch.uint8)
    assert not bool(((b == 0x7F) | (b == 0xFF)).any())


# ----------------------------------------------------------------------------------------------------
# dequantize
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_dequantize_is_exact(backend, out_dtype):
    x = mixed_input()
    q_o, s_o, deq = oracle_quantize(x)
    got = dequantize_ue8m0(q_o.to(DEVICE).view(torch.float8_e4m3fn), s_o.to(DEVICE), out_dtype=out_dtype, backend=backend)
    assert got.dtype == out_dtype
    assert torch.equal(got.cpu().double(), deq)  # every value is representable: exact, not "close"
    got_u8 = dequantize_ue8m0(q_o.to(DEVICE), s_o.to(DEVICE), out_dtype=out_dtype, backend=backend)  # raw bytes
    assert_close(got_u8, got, "exact")


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_within_the_format_bound(backend):
    """|x̂ − x| <= max(2^-4·|x|, 2^-10·2^e) (docs/formats.md#block-quantisation)."""
    x = mixed_input()
    q, s = quantize_ue8m0(x, backend=backend)
    xh = dequantize_ue8m0(q, s, out_dtype=torch.float32, backend=backend).cpu().double()
    xd = x.cpu().double()
    e = (s.cpu().double() - 127).repeat_interleave(64, dim=-1)
    bound = torch.maximum(xd.abs() * 2.0**-4, torch.exp2(e - 10))
    assert bool(((xh - xd).abs() <= bound).all())
    assert bool(((xh - xd).abs() > 0).any())  # it is a lossy format: the test is not vacuous


def test_fn_not_fnuz():
    """Pitfall #5: decode a fixed byte table under the declared flavour (OCP fn, bias 7, max 448, 0x80 = -0)."""
    q = torch.tensor([[0x38, 0x7E, 0xFE, 0x80, 0x08, 0x01] + [0] * 58], dtype=torch.uint8, device=DEVICE)
    out = dequantize_ue8m0(q, torch.full((1, 1), 127, dtype=torch.uint8, device=DEVICE), out_dtype=torch.float32)
    v = out.cpu()[0, :6].tolist()
    assert v == [1.0, 448.0, -448.0, -0.0, 2.0**-6, 2.0**-9]
    assert math.copysign(1.0, v[3]) == -1.0  # fnuz would make 0x80 a NaN; fn keeps -0


# ----------------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------------


def test_quantize_rejects_bad_input():
    x = torch.zeros(2, 128, device=DEVICE)
    with pytest.raises(TypeError, match="x: expected dtype"):
        quantize_ue8m0(torch.zeros(2, 128, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="x: last dim must be a multiple of block=64"):
        quantize_ue8m0(torch.zeros(2, 100, device=DEVICE))
    with pytest.raises(ValueError, match="block: expected a power of two"):
        quantize_ue8m0(x, block=48)
    with pytest.raises(ValueError, match="backend"):
        quantize_ue8m0(x, backend="cuda")
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        quantize_ue8m0([1.0] * 64)


def test_dequantize_rejects_bad_input():
    q = torch.zeros(2, 128, dtype=torch.uint8, device=DEVICE)
    s = torch.zeros(2, 2, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(TypeError, match="q: expected dtype"):
        dequantize_ue8m0(q.float(), s)
    with pytest.raises(TypeError, match="scale: expected dtype"):
        dequantize_ue8m0(q, s.float())
    with pytest.raises(ValueError, match="scale: expected shape"):
        dequantize_ue8m0(q, s[:, :1])
    with pytest.raises(ValueError, match="scale: expected shape"):
        dequantize_ue8m0(q[:, :100], s)
    with pytest.raises(TypeError, match="out_dtype"):
        dequantize_ue8m0(q, s, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="block"):
        dequantize_ue8m0(q, s, block=3)
