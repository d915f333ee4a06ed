"""The input contract of dsv4ref.linear (docs/contract.md, "linear").

Hypothesis draws shapes (M = 0 included, K not a multiple of 128), layouts (views of bigger buffers, storage
offsets, column-major copies), dtypes and NaN / ±inf positions. Every backend gives the same act_quant bytes
and a GEMM output within ``linear_out`` of the float64 oracle with NaN rows in the same places, or the same
error class naming the argument; a failed call leaves its inputs byte-identical.
"""

import pytest
import torch
from contract import outcome, snapshot, unchanged, views
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4ref import linear, validate
from dsv4ref.device import DEVICE
from dsv4ref.linear import reference
from dsv4ref.testing import compare, randn

BACKENDS = ("reference", "triton")
NAN, INF = float("nan"), float("inf")


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@settings(max_examples=12, deadline=None)
@given(
    m=st.integers(0, 20),
    k=st.integers(1, 300),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    layout=st.sampled_from(["contiguous", "every_other_row", "storage_offset", "transposed_copy"]),
    poison=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([NAN, INF, -INF])), max_size=3),
    seed=st.integers(0, 1000),
)
def test_act_quant_same_bytes_on_every_backend(m, k, dtype, layout, poison, seed):
    x = randn((m, k), seed=seed, dtype=dtype, block=16, octaves=40)
    for i, v in poison:
        if x.numel():
            x.view(-1)[i % x.numel()] = v
    xv = views(x).get(layout, x)
    before = snapshot(xv)
    for checks in (True, False):
        with validate.checking_values(checks):
            got = {b: outcome(linear.act_quant, xv, backend=b) for b in BACKENDS}
        assert got["reference"][0] == got["triton"][0], got
        if got["reference"][0] == "raise":
            assert checks and poison and got["reference"][1] == got["triton"][1] == "ValueError"
            continue
        (q0, s0), (q1, s1) = got["reference"][1], got["triton"][1]
        assert torch.equal(bits(q0), bits(q1)) and torch.equal(bits(s0), bits(s1))
    assert unchanged(before, xv)


@settings(max_examples=8, deadline=None)
@given(
    m=st.integers(0, 18),
    n=st.integers(1, 140),
    k2=st.integers(1, 160),
    fp4=st.booleans(),
    layout=st.sampled_from(["contiguous", "every_other_row", "transposed_copy"]),
    nan_row=st.integers(-1, 17),
    seed=st.integers(0, 1000),
)
def test_linear_within_the_tolerance_on_every_backend(m, n, k2, fp4, layout, nan_row, seed):
    k = 2 * k2
    x = randn((m, k), seed=seed, dtype=torch.bfloat16, block=128, octaves=20)
    w = randn((n, k), seed=seed + 1, dtype=torch.float32, block=32, octaves=12) * 0.02
    wq, ws = (linear.quantize_fp4_weight if fp4 else linear.quantize_fp8_weight)(w)
    if 0 <= nan_row < m:
        x[nan_row, k // 2] = NAN
    xv = views(x).get(layout, x)
    fn = linear.fp4_linear if fp4 else linear.fp8_linear
    q, s = reference.act_quant(x)
    gemm = reference.fp4_gemm if fp4 else reference.fp8_gemm
    oracle = gemm(q, s, wq, ws, dtype=torch.float64)
    mass = reference.gemm_mass(q, s, wq, ws, fp4=fp4)
    for b in BACKENDS:
        if 0 <= nan_row < m:
            with pytest.raises(ValueError, match="^x: non-finite"):
                fn(xv, wq, ws, backend=b)
        with validate.checking_values(False):
            y = fn(xv, wq, ws, backend=b)
        r = compare(y, oracle, "linear_out", mass=mass)  # NaN rows must match in place and value
        assert r.passed, (b, r)


def test_failed_calls_leave_buffers_alone():
    x = randn((4, 256), seed=1, block=128).to(DEVICE)
    w, ws = linear.quantize_fp8_weight(randn((64, 256), seed=2, dtype=torch.float32) * 0.02)
    x[2, 3] = NAN
    before = snapshot(x, w, ws)
    for b in BACKENDS:
        for call in (
            lambda b=b: linear.fp8_linear(x, w, ws, backend=b),
            lambda b=b: linear.fp8_linear(x[:, :128], w, ws, backend=b),
            lambda b=b: linear.fp8_gemm(x.to(torch.float8_e4m3fn), torch.ones(4, 1), w, ws, backend=b),
        ):
            with pytest.raises((ValueError, TypeError)):
                call()
    assert unchanged(before, x, w, ws)


def test_meta_tensors_refused():
    w, ws = linear.quantize_fp8_weight(torch.ones(64, 128))
    with pytest.raises(ValueError, match="^x: tensors on the meta device"):
        linear.fp8_linear(torch.empty(2, 128, dtype=torch.bfloat16, device="meta"), w, ws)


def _view(data, t: torch.Tensor, label: str) -> str:
    return data.draw(st.sampled_from(sorted(views(t))), label=label)


@given(data=st.data())
def test_grouped_o_proj_every_view(data):
    """Reference only: every view gives the contiguous call's bits; a NaN row stays in its row."""
    T = data.draw(st.integers(0, 3), label="T")
    G = data.draw(st.sampled_from([1, 2]), label="G")
    H = G * data.draw(st.integers(1, 2), label="hpg")
    o_lora, Hd = 8, 16
    o = randn((T, H, 512), seed=T + H, block=None, octaves=2)
    nan_row = T and data.draw(st.booleans(), label="nan")
    if nan_row:
        o[0, 0, 7] = float("nan")
    wo_a = randn((G, o_lora, H // G * 512), seed=5, block=None, octaves=0) * 0.03
    wo_b = randn((Hd, G * o_lora), seed=6, block=None, octaves=0) * 0.2
    want = linear.grouped_o_proj(o, wo_a, wo_b)
    got = linear.grouped_o_proj(
        views(o)[_view(data, o, "o_view")],
        views(wo_a)[_view(data, wo_a, "a_view")],
        views(wo_b)[_view(data, wo_b, "b_view")],
        backend="reference",
    )
    assert torch.equal(bits(got), bits(want)) and got.shape == (T, Hd)
    if nan_row:
        assert bool(got[0].isnan().all()) and not bool(got[1:].isnan().any())
