"""The shared Triton helpers are exact, interpreted and compiled alike (docs/triton_interpreter.md).

Each helper is tested on an exhaustive or adversarial sweep against torch. Next to each, a test of the
raw Triton operation the helper replaces is marked ``interp_bug``: it must FAIL in the interpreter
(that is the bug being worked around) and pass on a GPU.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from conftest import interp_bug
from dsv4ref.device import DEVICE, interpreting
from dsv4ref.testing import assert_close, generator
from dsv4ref.tl import bf16_rne_bits, dot, e4m3_encode, e4m3_ue8m0_blocks, ue8m0_byte
from dsv4ref.tl.numerics import bf16_bits, e4m3_ue8m0_tile, ue8m0_byte_bits


@triton.jit
def _e4m3_kernel(x_ptr, out_ptr, n, RAW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if RAW:  # what the helper replaces: clamp, then Triton's own cast
        y = tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.float8e4nv)
    else:
        y = e4m3_encode(x)
    tl.store(out_ptr + offs, y.to(tl.uint8, bitcast=True), mask=m)


def _e4m3(x, raw=False):
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _e4m3_kernel[(triton.cdiv(x.numel(), 4096),)](x, out, x.numel(), RAW=raw, BLOCK=4096)
    return out


def _e4m3_sweep() -> torch.Tensor:
    """fp32 inputs over the whole e4m3 range: every finite bf16 value (65 280), every e4m3 grid point
    and the midpoints between neighbours (the ties) and their fp32 neighbours, ±448 and beyond, signed
    zeros, subnormals, and random fp32 values spread over 2^-12 .. 2^10."""
    bf = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf = bf[torch.isfinite(bf)]
    grid = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique().sort().values.double()
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    nudge = torch.cat(
        [torch.nextafter(mids, torch.full_like(mids, math.inf)), torch.nextafter(mids, torch.full_like(mids, -math.inf))]
    )
    special = torch.tensor(
        [
            0.0,
            -0.0,
            448.0,
            -448.0,
            449.0,
            464.0,
            470.0,
            480.0,
            500.0,
            -500.0,
            1e30,
            -1e30,
            7.78,
            126.24,
            17.0,
            19.0,
            0.001,
            2**-9,
            2**-10,
            3 * 2**-10,
            2**-6,
            232.0,
            248.0,
        ]
    )
    g = generator(0)
    rnd = torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-12, 11, (100_000,), generator=g).float())
    x = torch.cat([bf, grid.float(), -grid.float(), mids, -mids, nudge, -nudge, special, rnd])
    return x.contiguous()


def test_e4m3_encode_is_exact_on_the_whole_range():
    x = _e4m3_sweep()
    expected = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    got = _e4m3(x.to(DEVICE)).cpu()
    assert_close(got, expected, "exact", "e4m3 bytes")
    assert x.numel() > 160_000


def test_e4m3_worked_values():
    x = torch.tensor([1.0, -1.0, 448, 449, 464, 470, -500, 2**-6, 2**-9, 2**-10, 3 * 2**-10, 17, 19, 232, 248, -0.0])
    want = [0x38, 0xB8, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x08, 0x01, 0x00, 0x02, 0x58, 0x5A, 0x76, 0x78, 0x80]
    assert _e4m3(x.to(DEVICE)).cpu().tolist() == want


@interp_bug("triton#8322: the interpreter's fp32->fp8e4nv cast misrounds (carry, ties, subnormals)")
def test_raw_triton_fp8_cast_is_exact():
    x = _e4m3_sweep()
    expected = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(_e4m3(x.to(DEVICE), raw=True).cpu(), expected)


@triton.jit
def _ue8m0_kernel(a_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, ue8m0_byte(tl.load(a_ptr + offs, mask=m, other=1.0), 1e-4, 448.0), mask=m)


def _ue8m0_oracle(amax: torch.Tensor, floor=1e-4, qmax=448.0) -> list[int]:
    """Independent construction: frexp of the fp32 quotient. s = m·2^e with m in [0.5, 1), so
    ceil(log2 s) = e − 1 when m is exactly 0.5 (a power of two), else e."""
    s = (torch.clamp(amax, min=floor) / qmax).tolist()  # fp32 quotient, as a Python float
    out = []
    for v in s:
        m, e = math.frexp(v)
        out.append(min(max((e - 1 if m == 0.5 else e) + 127, 1), 254))
    return out


def test_ue8m0_bytes_exact():
    g = generator(1)
    table = torch.tensor([0.0, 0.01, 1.0, 1.75, 3.0, 448.0, 449.0])
    pow_edges = torch.tensor([448.0 * 2.0**k for k in range(-20, 21)])
    rnd = torch.exp(torch.empty(20_000).uniform_(math.log(1e-8), math.log(1e6), generator=g))
    bf = rnd.bfloat16().float()  # bf16-valued amax, as the KV writer sees
    amax = torch.cat([table, pow_edges, rnd, bf])
    out = torch.empty(amax.shape, dtype=torch.int32, device=DEVICE)
    _ue8m0_kernel[(triton.cdiv(amax.numel(), 1024),)](amax.to(DEVICE), out, amax.numel(), BLOCK=1024)
    got = out.cpu().tolist()
    assert got == _ue8m0_oracle(amax)
    assert got[:7] == [105, 112, 119, 119, 120, 127, 128]  # the worked examples of docs/formats.md
    assert got[7:48] == [127 + k for k in range(-20, 21)]  # 448·2^k -> exactly 127 + k, never one more


@triton.jit
def _bf16_kernel(x_ptr, out_ptr, n, RAW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if RAW:
        tl.store(out_ptr + offs, x.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=m)
    else:
        tl.store(out_ptr + offs, bf16_rne_bits(x).to(tl.int16, bitcast=True), mask=m)


def _bf16_sweep():
    g = generator(2)
    x = torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-30, 30, (100_000,), generator=g).float())
    ties = torch.arange(-32768, 32768, dtype=torch.int32)[::7].to(torch.int16).view(torch.bfloat16).float()
    ties = ties[torch.isfinite(ties)]
    ties = (ties.view(torch.int32) | 0x8000).view(torch.float32)  # exactly halfway to the next bf16
    return torch.cat([x, ties, torch.tensor([1.01171875, -0.0, 0.0])])


def _bf16(x, raw):
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    _bf16_kernel[(triton.cdiv(x.numel(), 4096),)](x, out.view(torch.int16), x.numel(), RAW=raw, BLOCK=4096)
    return out


def test_bf16_rne_matches_torch():
    x = _bf16_sweep()
    assert_close(_bf16(x.to(DEVICE), raw=False).cpu(), x.to(torch.bfloat16), "exact", "bf16 bits")


@interp_bug("I4: the interpreter's fp32->bf16 cast truncates instead of rounding")
def test_raw_triton_bf16_cast_rounds():
    x = _bf16_sweep()
    assert torch.equal(_bf16(x.to(DEVICE), raw=True).cpu().view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


@triton.jit
def _dot_kernel(
    a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, DOT_FP32: tl.constexpr, RAW: tl.constexpr
):
    tl.static_assert(K >= 16)  # compiled tl.dot needs K >= 16 for 16-bit operands (I9)
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    acc = tl.zeros((M, N), dtype=tl.float32)
    if RAW:
        acc = tl.dot(a, b, acc)
    else:
        acc = dot(a, b, acc, DOT_FP32)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


def _dot(a, b, raw):
    c = torch.full((a.shape[0], b.shape[1]), float("nan"), device=a.device)
    _dot_kernel[(1,)](a, b, c, M=a.shape[0], N=b.shape[1], K=a.shape[1], DOT_FP32=interpreting(), RAW=raw)
    return c


@pytest.mark.parametrize("k", [16, 64, 128])
def test_dot_bf16(k):
    a = (torch.randn(64, k, generator=generator(k)) * 3).bfloat16()
    b = (torch.randn(k, 32, generator=generator(k + 1)) * 0.5).bfloat16()
    ref = a.double() @ b.double()
    assert_close(_dot(a.to(DEVICE), b.to(DEVICE), raw=False), ref, "fp32_dot", "bf16 dot")


@interp_bug("triton#11584: bf16 tl.dot in the interpreter multiplies bit patterns")
def test_raw_triton_bf16_dot():
    a = torch.randn(32, 32, generator=generator(7)).bfloat16()
    b = torch.randn(32, 32, generator=generator(8)).bfloat16()
    assert_close(_dot(a.to(DEVICE), b.to(DEVICE), raw=True), a.double() @ b.double(), "fp32_dot")


# ----------------------------------------------------------------------------------------------------
# the fast paths of the KV writer and reader (dsv4ref.tl.numerics; benchmarks/kv_cache.md)
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _ue8m0_448_kernel(a_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=1.0)
    tl.store(out_ptr + offs, ue8m0_byte_bits(a.to(tl.int32, bitcast=True), 1e-4) - ue8m0_byte(a, 1e-4, 448.0), mask=m)


def test_ue8m0_byte_bits_is_ue8m0_byte():
    """The division-free byte equals the correctly rounded quotient's: every non-negative finite bf16 (what the
    KV writer's amax is), 448·2^k and its fp32 neighbours, random fp32 values."""
    g = generator(3)
    bf = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    edges = torch.tensor([448.0 * 2.0**k for k in range(-30, 31)])
    near = torch.cat([edges, torch.nextafter(edges, edges * 2), torch.nextafter(edges, edges * 0)])
    rnd = torch.exp(torch.empty(50_000).uniform_(math.log(1e-30), math.log(1e30), generator=g))
    a = torch.cat([bf, near, rnd, torch.tensor([0.0, -0.0, 1e-4, 3.4e38])])
    out = torch.empty(a.shape, dtype=torch.int32, device=DEVICE)
    _ue8m0_448_kernel[(triton.cdiv(a.numel(), 4096),)](a.to(DEVICE), out, a.numel(), BLOCK=4096)
    assert int(out.abs().max()) == 0


@triton.jit
def _tile_kernel(x_ptr, q_ptr, b_ptr, R: tl.constexpr, NATIVE: tl.constexpr, FAST: tl.constexpr):
    """[R, 64] fp32 -> the e4m3 bytes and UE8M0 bytes of its R blocks, by the tile helper or the blocks helper."""
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, 64)[None, :]
    x = tl.load(x_ptr + r * 64 + c)
    if FAST:
        q, byte = e4m3_ue8m0_tile(x, 1e-4, 1, NATIVE)
    else:
        q, byte = e4m3_ue8m0_blocks(x, 1e-4, 1)
    tl.store(q_ptr + r * 64 + c, q)
    tl.store(b_ptr + tl.arange(0, R), byte)


@pytest.mark.parametrize("nonfinite", [False, True])
def test_e4m3_ue8m0_tile_is_e4m3_ue8m0_blocks(nonfinite):
    """Same bytes as the policy helper, on a finite tile (the fast path; compiled, with the hardware e4m3 cast)
    and on a tile with NaN / ±inf blocks (the policy path): bf16-valued rows over 2^-40..2^40, signed zeros,
    amax = 448·2^k, all-zero blocks."""
    g = generator(4)
    R = 64
    x = torch.randn(R, 64, generator=g) * torch.exp2(torch.randint(-40, 40, (R, 1), generator=g).float())
    x[0], x[1] = 0.0, -0.0
    x[2, 5], x[3, 7] = 448.0 * 2.0**-3, -448.0 * 2.0**5
    x = x.bfloat16().float()
    if nonfinite:
        x[4, 3], x[5, 0], x[6, 63] = float("nan"), float("inf"), -float("inf")
        x[7, 9] = (torch.tensor(0xFFC00001, dtype=torch.int64).to(torch.int32)).view(torch.float32)  # NaN, sign set
    got, want = [], []
    for fast, dst in ((True, got), (False, want)):
        q = torch.empty(R, 64, dtype=torch.uint8, device=DEVICE)
        b = torch.empty(R, dtype=torch.int32, device=DEVICE)
        _tile_kernel[(1,)](x.to(DEVICE), q, b, R=R, NATIVE=not interpreting(), FAST=fast)
        dst += [q.cpu(), b.cpu()]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert bool((want[1] == 255).any()) == nonfinite


@triton.jit
def _bf16_bits_kernel(x_ptr, out_ptr, n, NATIVE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, bf16_bits(x, NATIVE).to(tl.int16), mask=m)


def test_bf16_bits_native_is_bf16_rne_bits():
    """The cast the KV reader uses: the integer rounding, or compiled the hardware cast, give torch's bits (the
    tie sweep of test_bf16_rne_matches_torch, plus ±inf and fp32 subnormals)."""
    x = torch.cat([_bf16_sweep(), torch.tensor([float("inf"), -float("inf"), 2.0**-130, -(2.0**-136), 3 * 2.0**-140])])
    out = torch.empty(x.shape, dtype=torch.int16, device=DEVICE)
    _bf16_bits_kernel[(triton.cdiv(x.numel(), 4096),)](x.to(DEVICE), out, x.numel(), NATIVE=not interpreting(), BLOCK=4096)
    assert torch.equal(out.cpu(), x.to(torch.bfloat16).view(torch.int16))


@pytest.mark.skipif(not interpreting(), reason="the interpreter's dtype table (dsv4ref._interpreter) is installed only there")
def test_the_interpreter_dtype_table_gives_the_builders_answers():
    """dsv4ref._interpreter.cache_dtype_table: every dtype a kernel uses, alone, in a block, and as a pointer (or a
    block of pointers), maps to what Triton's own builder returns, twice (the second from the table)."""
    from triton.runtime import interpreter as interp

    table = interp._get_np_dtype
    build = table.dsv4ref_builder  # AttributeError: the table is not installed
    kinds = (tl.int1, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.float32, tl.bfloat16, tl.float8e4nv)
    for ty in kinds:
        for t in (ty, tl.block_type(ty, [4, 8]), tl.pointer_type(ty), tl.block_type(tl.pointer_type(ty), [16])):
            assert table(t) == build(t) == table(t), t
