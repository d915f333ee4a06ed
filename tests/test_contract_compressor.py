"""The input contract of dsv4ref.compressor (docs/contract.md#compressor): arguments checked before the state
is touched, one non-finite policy, and with value checks off a bad request id or position is a padding row
on every backend (the kernels never read or write outside the state).

* Checks on: ratio an int (4 or 128), eps a finite number > 0, x finite on the valid rows, the state two
  separate buffers, no meta tensors: TypeError / ValueError naming the argument, the state byte-identical.
* Checks off: a row whose request is outside [0, R) or whose position is negative gives what the same call
  with that row marked ``valid=False`` gives, bit for bit, on every backend (hypothesis draws the rows).
"""

from __future__ import annotations

import math

import pytest
import torch
from contract import snapshot, unchanged
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4ref import compressor, validate
from dsv4ref.device import DEVICE
from dsv4ref.testing import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

BACKENDS = ("reference", "triton")
NAN, INF = float("nan"), float("inf")


def step(chunks=(5, 3), requests=3, ratio=4):
    return compressor.example_step(ratio, chunks, requests=requests, device=DEVICE)


def call(d, backend, **kw):
    args = dict(ratio=d["ratio"], eps=d["eps"], valid=d.get("valid"), backend=backend)
    args.update(kw)
    return compressor.compress(
        d["x"], d["wkv"], d["wgate"], d["ape"], d["norm"], d["state_kv"], d["state_score"], d["requests"], d["positions"], **args
    )


def fresh(d):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def same_bits(a, b):
    return torch.equal(a.cpu().contiguous().view(torch.int32), b.cpu().contiguous().view(torch.int32))


def state_close(a, b):
    """Two fp32 states equal up to the backends' rounding, NaN / ±inf at the same places."""
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb)
    assert torch.equal(a[~fa].isnan(), b[~fb].isnan()) and torch.equal(a[~fa & ~a.isnan()], b[~fb & ~b.isnan()])
    torch.testing.assert_close(a[fa], b[fb], rtol=1e-4, atol=1e-5)


def rows_close(a, b):
    """Two backends' compressed rows: NaN / ±inf at the same places, the finite rows within the "compressor" row
    (each backend rounds its fp32 pooled row to bf16 before the norm, so an element may land one bf16 ulp apart)."""
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb)
    assert torch.equal(a[~fa].isnan(), b[~fb].isnan()) and torch.equal(a[~fa & ~a.isnan()], b[~fb & ~b.isnan()])
    ok = fa.all(dim=-1)
    assert_close(a[ok], b[ok], "compressor", "rows")


# ----------------------------------------------------------------------------------------------------
# scalars and layout: checked before the state is touched, the same error on every backend
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "ratio, err", [(4.0, TypeError), (True, TypeError), ("4", TypeError), (8, ValueError), (None, TypeError)]
)
def test_ratio_must_be_an_int_four_or_128_on_every_backend(backend, ratio, err):
    d = step()
    before = snapshot(d["state_kv"], d["state_score"])
    with pytest.raises(err, match="^ratio:"):
        call(d, backend, ratio=ratio)
    assert unchanged(before, d["state_kv"], d["state_score"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "eps, err",
    [(0, ValueError), (-1.0, ValueError), (NAN, ValueError), (INF, ValueError), ("1e-6", TypeError), (True, TypeError)],
)
def test_eps_must_be_a_finite_number_above_zero(backend, eps, err):
    d = step()
    before = snapshot(d["state_kv"], d["state_score"])
    with pytest.raises(err, match="^eps:"):
        call(d, backend, eps=eps)
    assert unchanged(before, d["state_kv"], d["state_score"])


@pytest.mark.parametrize("eps", [-1.0, NAN, 0.0])
def test_compress_sequence_refuses_an_eps_that_would_give_nan_rows(eps):
    d = step((8,))
    with pytest.raises(ValueError, match="^eps:"):
        compressor.compress_sequence(d["x"], d["wkv"], d["wgate"], d["ape"], d["norm"], ratio=4, eps=eps)
    with pytest.raises(TypeError, match="^ratio:"):
        compressor.compress_sequence(d["x"], d["wkv"], d["wgate"], d["ape"], d["norm"], ratio=4.0, eps=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_kv_and_state_score_must_be_separate_buffers(backend):
    d = step()
    d["state_score"] = d["state_kv"]
    before = snapshot(d["state_kv"])
    with pytest.raises(ValueError, match="^state_score: shares memory with state_kv"):
        call(d, backend)
    assert unchanged(before, d["state_kv"])
    both = torch.zeros(2, *d["state_kv"].shape, device=DEVICE)  # two halves of one buffer: fine
    d["state_kv"], d["state_score"] = both[0], both[1].fill_(-math.inf)
    call(d, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_tensors_are_refused_by_name(backend):
    d = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in step().items()}
    with pytest.raises(ValueError, match="^x: tensors on the meta device cannot be run"):
        call(d, backend)


# ----------------------------------------------------------------------------------------------------
# non-finite x
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_x_is_refused_before_the_ring_is_written(backend, bad):
    d = step()
    d["x"][7, 17] = bad
    before = snapshot(d["state_kv"], d["state_score"])
    with pytest.raises(ValueError, match=r"^x: non-finite values"):
        call(d, backend)
    assert unchanged(before, d["state_kv"], d["state_score"])
    d["valid"] = torch.ones(8, dtype=torch.bool, device=DEVICE)
    d["valid"][7] = False  # a padding row is ignored entirely, its x included
    call(d, backend)


def test_nonfinite_x_with_checks_off_is_the_same_on_every_backend():
    d = step((8,))
    d["x"][2, 5] = NAN
    d["x"][6, 9] = INF
    out = {}
    with validate.checking_values(False):
        for be in BACKENDS:
            dd = fresh(d)
            rows, done = call(dd, be)
            out[be] = rows, done, dd["state_kv"], dd["state_score"]
    (r0, d0, k0, s0), (r1, d1, k1, s1) = out.values()
    assert torch.equal(d0, d1) and bool(d0.any())
    assert bool(r0.isnan().any())  # a window holding the NaN token gives a NaN row, never a plausible one
    rows_close(r0, r1)
    for a, b in ((k0, k1), (s0, s1)):
        state_close(a, b)


def test_one_nonfinite_channel_gives_an_all_nan_row_on_every_backend():
    """The policy is decided explicitly, not left to IEEE: one inf weight makes one kv channel +inf; IEEE
    arithmetic would give that channel NaN and the rest 0 after the norm (1/sqrt(inf) = 0). Every backend gives
    the whole row NaN."""
    d = step((8,))
    d["wkv"] = d["wkv"].clone()
    d["wkv"][-1, 0] = INF  # the last channel: the newer tokens' half, which every boundary window reads
    d["x"][:, 0] = d["x"][:, 0].abs() + 0.5  # one sign: that channel is +inf for every token (never inf − inf)
    out = {}
    with validate.checking_values(False):
        for be in BACKENDS:
            rows, done = call(fresh(d), be)
            out[be] = rows[done]
    for be, r in out.items():
        assert bool(r.isnan().all()), be  # both boundary windows hold tokens whose last kv channel is ±inf


# ----------------------------------------------------------------------------------------------------
# bad indices with checks off: padding rows on every backend, never a write outside the state
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_padding_row_with_any_request_is_ignored(backend):
    """valid=False rows are ignored entirely: request 99 (past the state) and position −7 raise nothing."""
    d = step()
    want = call(fresh(d), backend)
    d["valid"] = torch.ones(9, dtype=torch.bool, device=DEVICE)
    d["valid"][8] = False
    for k, v in (("x", d["x"][:1]), ("requests", torch.tensor([99])), ("positions", torch.tensor([-7]))):
        d[k] = torch.cat([d[k], v.to(DEVICE)])
    got = call(d, backend)
    assert same_bits(got[0][:8], want[0]) and torch.equal(got[1][:8], want[1]) and not bool(got[1][8])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["request_past_state", "request_negative", "position_negative"])
def test_bad_index_with_checks_off_is_a_padding_row(backend, where):
    """The write past the state's rows that killed the process: now the row is padding, on every backend."""
    d = step((5, 3), requests=2)
    row = {"request_past_state": 6, "request_negative": 1, "position_negative": 7}[where]
    if where == "position_negative":
        d["positions"][row] = -4
    else:
        d["requests"][row] = 2 if where == "request_past_state" else -3
    masked = fresh(d)
    masked["valid"] = torch.ones(8, dtype=torch.bool, device=DEVICE)
    masked["valid"][row] = False
    with validate.checking_values(False):
        want = call(masked, backend)
        got = call(d, backend)
    assert same_bits(got[0], want[0]) and torch.equal(got[1], want[1])
    assert same_bits(d["state_kv"], masked["state_kv"]) and same_bits(d["state_score"], masked["state_score"])
    with pytest.raises(ValueError, match="^(requests|positions):"):
        call(fresh(d), backend)  # checks on: refused


@settings(max_examples=6)
@given(chunks=st.lists(st.integers(1, 9), min_size=1, max_size=2), data=st.data())
def test_property_bad_rows_are_padding_on_every_backend(chunks, data):
    d = step(tuple(chunks), requests=2)
    T = sum(chunks)
    bad = data.draw(st.lists(st.integers(0, T - 1), max_size=3, unique=True))
    kinds = data.draw(st.lists(st.sampled_from(["req_hi", "req_lo", "pos"]), min_size=len(bad), max_size=len(bad)))
    valid = torch.ones(T, dtype=torch.bool)
    for t, kind in zip(bad, kinds):
        if kind == "pos":
            d["positions"][t] = -1 - t
        else:
            d["requests"][t] = 2 + t if kind == "req_hi" else -2
        valid[t] = False
    masked = fresh(d)
    masked["valid"] = valid.to(DEVICE)
    results = []
    with validate.checking_values(False):
        for be in BACKENDS:
            for dd in (fresh(d), fresh(masked)):
                rows, done = call(dd, be)
                results.append((rows, done, dd["state_kv"], dd["state_score"]))
    (ref, ref_m, tri, tri_m) = results
    for a, b in ((ref, ref_m), (tri, tri_m)):  # each backend: a bad row is a padding row, bit for bit
        assert all(same_bits(x, y) if x.dtype != torch.bool else torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(ref[1], tri[1])  # and the backends agree
    rows_close(ref[0], tri[0])
    for x, y in zip((ref[2], ref[3]), (tri[2], tri[3])):
        state_close(x, y)
