"""The input contract of dsv4ref.fp8 (docs/formats.md#non-finite-values, docs/contract.md).

Every backend gives the reference's bytes or raises the same error class naming the argument; views are
read as views; a block holding a NaN or ±inf raises while value checks are on and, with them off, is
written as scale byte 255 + e4m3 NaN codes on every backend; every scale byte reads as E8M0 defines it.
"""

import pytest
import torch
from contract import outcome, snapshot, unchanged, views
from hypothesis import given
from hypothesis import strategies as st

from dsv4ref import fp8, validate
from dsv4ref.device import DEVICE
from dsv4ref.testing import generator

pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning"
)

BACKENDS = ("reference", "triton")
NAN, INF = float("nan"), float("inf")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits on the CPU, so NaN payloads and −0 count."""
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_everywhere(fn, *args, **kwargs):
    """Run ``fn`` on every backend: all return bit-identical tensors (then return the reference's) or all
    raise the same error class (then return it)."""
    got = {b: outcome(fn, *args, backend=b, **kwargs) for b in BACKENDS}
    kinds = {b: g[0] for b, g in got.items()}
    assert len(set(kinds.values())) == 1, got
    ref = got["reference"][1]
    if kinds["reference"] == "raise":
        assert len({g[1] for g in got.values()}) == 1, got
        return ref
    for b in BACKENDS[1:]:
        res = got[b][1]
        for r, o in zip(ref if isinstance(ref, tuple) else (ref,), res if isinstance(res, tuple) else (res,)):
            assert r.dtype == o.dtype and r.shape == o.shape and torch.equal(bits(r), bits(o)), b
    return ref


def nan_block_input() -> torch.Tensor:
    """[2, 256] fp32: block 0 holds a NaN, block 1 a +inf, block 2 is finite, block 3 a −inf and a −NaN;
    row 1 is finite."""
    x = torch.randn(2, 256, generator=generator(1))
    x[0, 5] = NAN
    x[0, 64 + 9] = INF
    x[0, 192 + 1] = -INF
    x[0, 192 + 2] = -NAN  # a NaN's own sign is not kept (a GPU product of a NaN is +NaN): 0x7F
    x[0, 192 + 3] = -1.5
    return x.to(DEVICE)


# ----------------------------------------------------------------------------------------------------
# the probes of the input-contract audit
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_nan_block_raises_while_checks_are_on(backend):
    x = nan_block_input()
    before = snapshot(x)
    with validate.checking_values(True), pytest.raises(ValueError, match=r"^x: non-finite values"):
        fp8.quantize_ue8m0(x, backend=backend)
    assert unchanged(before, x)


def test_probe_nan_block_encodes_as_nan_with_checks_off():
    """Before: the reference zeroed a NaN block and wrote byte 254, Triton encoded the NaN as 3.5 and +inf
    as −inf. Now: scale byte 255, e4m3 0x7F (0xFF for a set sign bit) in the whole block, on both."""
    x = nan_block_input()
    with validate.checking_values(False):
        q, s = same_everywhere(fp8.quantize_ue8m0, x)
    qb, s = q.cpu().view(torch.uint8), s.cpu()
    finite_q, finite_s = fp8.quantize_ue8m0(x[:, 128:192], backend="reference")
    assert s[0].tolist() == [255, 255, int(finite_s[0, 0]), 255]
    assert torch.equal(qb[0, 128:192], finite_q[0].cpu().view(torch.uint8))  # finite blocks are unaffected
    xr = x.cpu()[0]
    sign = (torch.signbit(xr) & ~xr.isnan()).to(torch.uint8) << 7  # 0xFF: a non-NaN with its sign bit set
    for blk in (0, 1, 3):
        assert torch.equal(qb[0, 64 * blk : 64 * blk + 64], sign[64 * blk : 64 * blk + 64] | 0x7F)
    assert qb[0, 192 + 1] == 0xFF and qb[0, 192 + 2] == 0x7F and qb[0, 192 + 3] == 0xFF and qb[0, 5] == 0x7F
    assert torch.equal(s[1], fp8.quantize_ue8m0(x[1:], backend="reference")[1].cpu()[0])
    # ... and reads back as NaN, never as a plausible number
    for backend in BACKENDS:
        y = fp8.dequantize_ue8m0(q, s.to(DEVICE), out_dtype=torch.float32, backend=backend).cpu()
        assert bool(y[0, :128].isnan().all()) and bool(y[0, 192:].isnan().all()) and not bool(y[0, 128:192].isnan().any())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_probe_scale_bytes_0_and_255(out_dtype):
    """E8M0: byte 255 is NaN (was inf), byte 0 is 2^-127 (was 0); every NaN comes out as the quiet NaN
    0x7FC0 / 0x7FC00000, so backends agree bit for bit."""
    codes = torch.tensor([0x38, 0xB8, 0x01, 0x7E, 0x00, 0x80, 0x7F, 0xFF], dtype=torch.uint8)  # 1, −1, 2^-9, 448, ±0, NaN
    q = codes.repeat(8)[None].repeat(3, 1).to(DEVICE)  # [3, 64]
    s = torch.tensor([[0], [255], [127]], dtype=torch.uint8, device=DEVICE)
    y = same_everywhere(fp8.dequantize_ue8m0, q, s, out_dtype=out_dtype).cpu()
    v = torch.tensor([1.0, -1.0, 2.0**-9, 448.0, 0.0, -0.0])
    assert torch.equal(bits(y[0, :6]), bits((v * 2.0**-127).to(out_dtype)))  # subnormals kept
    assert bool(y[1].isnan().all())
    nan_bits = 0x7FC0 if out_dtype == torch.bfloat16 else 0x7FC00000
    assert set(bits(y[1]).tolist()) == {nan_bits} and set(bits(y[:, 6:8]).flatten().tolist()) == {nan_bits}


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_scalar_arguments_are_named(backend):
    x = torch.zeros(2, 128, device=DEVICE)
    with pytest.raises(TypeError, match=r"^block: expected an int, got float 64.0"):
        fp8.quantize_ue8m0(x, block=64.0, backend=backend)  # was "unsupported operand &"
    with pytest.raises(TypeError, match=r"^block: expected an int"):
        fp8.quantize_ue8m0(x, block=True, backend=backend)
    with pytest.raises(ValueError, match=r"^block: expected a power of two <= 65536"):
        fp8.quantize_ue8m0(torch.zeros(1, 1 << 17, device=DEVICE), block=1 << 17, backend=backend)
    with pytest.raises(ValueError, match=r"^amax_floor: expected a finite number"):
        fp8.quantize_ue8m0(x, amax_floor=NAN, backend=backend)
    with pytest.raises(ValueError, match=r"^amax_floor: expected a number >= 0"):
        fp8.quantize_ue8m0(x, amax_floor=-1e-4, backend=backend)
    with pytest.raises(TypeError, match=r"^amax_floor: expected a number"):
        fp8.quantize_ue8m0(x, amax_floor="1e-4", backend=backend)
    with pytest.raises(TypeError, match=r"^block: expected an int"):
        fp8.dequantize_ue8m0(x.to(torch.uint8), torch.zeros(2, 2, dtype=torch.uint8, device=DEVICE), block=64.0, backend=backend)
    with pytest.raises(TypeError, match=r"^launch: expected an Fp8Launch"):
        fp8.quantize_ue8m0(x, launch=(16, 4), backend=backend)


def test_launch_tile_limit_is_named():
    with pytest.raises(ValueError, match=r"^launch: rows_per_program=32"):
        fp8.quantize_ue8m0(torch.zeros(1, 65536, device=DEVICE), block=65536, launch=fp8.Fp8Launch(32))


# ----------------------------------------------------------------------------------------------------
# property-based: every backend = the reference, on views, NaN/inf positions, checks on and off
# ----------------------------------------------------------------------------------------------------

LAYOUTS = ("contiguous", "every_other_row", "storage_offset", "transposed_copy")


@given(
    rows=st.integers(0, 3),
    blocks=st.integers(1, 3),
    block=st.sampled_from([16, 32, 64, 128]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    layout=st.sampled_from(LAYOUTS),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([NAN, INF, -INF, -NAN, 0.0, -0.0, 448.0])), max_size=3),
    checks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quantize_every_backend_equals_reference(rows, blocks, block, dtype, layout, specials, checks, seed):
    octave = torch.randint(-20, 20, (rows, blocks, 1), generator=generator(seed + 1)).float()
    x = (torch.randn(rows, blocks, block, generator=generator(seed)) * torch.exp2(octave)).reshape(rows, blocks * block)
    for pos, v in specials:
        if x.numel():
            x.view(-1)[pos % x.numel()] = v
    x = views(x.to(dtype).to(DEVICE)).get(layout, x.to(dtype).to(DEVICE))
    before = snapshot(x)
    with validate.checking_values(checks):
        same_everywhere(fp8.quantize_ue8m0, x, block)
    assert unchanged(before, x)


@given(
    rows=st.integers(0, 3),
    blocks=st.integers(1, 3),
    block=st.sampled_from([16, 64, 128]),
    out_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    q_layout=st.sampled_from(LAYOUTS),
    s_layout=st.sampled_from(LAYOUTS),
    as_fp8=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_dequantize_every_backend_equals_reference_on_any_bytes(rows, blocks, block, out_dtype, q_layout, s_layout, as_fp8, seed):
    """Every e4m3 code (NaN codes too) and every scale byte (0 and 255 too)."""
    g = generator(seed)
    q = torch.randint(0, 256, (rows, blocks * block), generator=g, dtype=torch.int64).to(torch.uint8).to(DEVICE)
    s = torch.randint(0, 256, (rows, blocks), generator=g, dtype=torch.int64).to(torch.uint8)
    if s.numel():
        s.view(-1)[0] = 0
        s.view(-1)[-1] = 255
    s = s.to(DEVICE)
    q = views(q).get(q_layout, q)
    q = q.view(torch.float8_e4m3fn) if as_fp8 else q
    s = views(s).get(s_layout, s)
    before = snapshot(q, s)
    same_everywhere(fp8.dequantize_ue8m0, q, s, block, out_dtype)
    assert unchanged(before, q, s)
