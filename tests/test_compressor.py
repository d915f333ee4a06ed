"""The compressor op (dsv4ref.compressor) against its float64 whole-sequence oracle.

The stateful op (a ring of each request's last coff·r tokens, fed step by step: a prefill, then single
tokens, in any split, several requests per step) must give the rows of ``compress_sequence`` in float64,
which is written differently (blocks of r tokens, no ring), under the named tolerance "compressor". The
Triton kernels run in the CPU interpreter here (a few short sequences); the torch reference runs the long
ones. Each pitfall of docs/compressor.md#pitfalls has a test below that names it.
"""

import math

import pytest
import torch

from dsv4ref import compressor
from dsv4ref.compressor import reference
from dsv4ref.device import DEVICE
from dsv4ref.testing import assert_close, compare, randn

EPS = 1e-6
HD = 256


def _weights(ratio, dim=512, seed=0):
    return compressor.example_inputs(ratio, dim=dim, hidden=HD, seed=seed, device=DEVICE)


def _run(ratio, plan, *, dim=512, backend="reference", seed=0, state=None, x=None):
    """Feed per-request chunk plans through the op, one step per column of ``plan`` (``plan[q][s]`` tokens of
    request q in step s, 0 = absent). Returns (x per request [L_q, Hd], rows per request [n_q, D] with their
    positions, the state, the weights)."""
    w = _weights(ratio, dim, seed)
    R = len(plan)
    lens = [sum(p) for p in plan]
    xs = x or [randn((n, HD), seed=seed + 10 + q, device=DEVICE, block=None, octaves=2) for q, n in enumerate(lens)]
    st = state or compressor.allocate_state(R, ratio, dim, device=DEVICE)
    got = [[] for _ in range(R)]
    gpos = [[] for _ in range(R)]
    done_at = [0] * R
    for s in range(len(plan[0])):
        req, pos, rows_x = [], [], []
        for q in range(R):
            n = plan[q][s]
            p = torch.arange(done_at[q], done_at[q] + n, device=DEVICE)
            req.append(torch.full((n,), q, device=DEVICE))
            pos.append(p)
            rows_x.append(xs[q][done_at[q] : done_at[q] + n])
            done_at[q] += n
        req, pos, xx = torch.cat(req), torch.cat(pos), torch.cat(rows_x)
        rows, done = compressor.compress(
            xx, w["wkv"], w["wgate"], w["ape"], w["norm"], st.kv, st.score, req, pos, ratio=ratio, eps=EPS, backend=backend
        )
        assert done.tolist() == ((pos + 1) % ratio == 0).tolist()
        assert not rows[~done].any()  # zeros where no row completes
        for q in range(R):
            sel = done & (req == q)
            got[q].append(rows[sel])
            gpos[q].append(pos[sel])
    return xs, [torch.cat(g) for g in got], [torch.cat(g) for g in gpos], st, w


def _oracle(x, w, ratio, bug=None, rounded=False):
    """compress_sequence in float64, or a deliberately wrong variant (the pitfalls) built from the same blocks;
    ``rounded``: the pooled row rounded to bf16 before the norm (DeepSeek's order, in float64 otherwise)."""
    if bug is None and not rounded:
        return compressor.compress_sequence(x, w["wkv"], w["wgate"], w["ape"], w["norm"], ratio=ratio, eps=EPS)[0]
    D = w["norm"].shape[0]
    nb = x.shape[0] // ratio
    xb = x[: nb * ratio].double()
    kv = (xb @ w["wkv"].double().T).view(nb, ratio, -1)
    ape = w["ape"].double()
    if bug == "ape_off_by_one":  # ape[(p + 1) % r]: the bias of the wrong position inside the block
        ape = torch.roll(ape, 1, dims=0)
    score = (xb @ w["wgate"].double().T).view(nb, ratio, -1) + ape
    if ratio == 4:
        lo, hi = (slice(D, None), slice(0, D)) if bug == "halves_swapped" else (slice(0, D), slice(D, None))
        fill = 0.0 if bug == "no_start_mask" else -math.inf

        def older(t, f):
            return torch.cat([torch.full_like(t[:1, :, lo], f), t[:-1, :, lo]])

        kv = torch.cat([older(kv, 0.0), kv[..., hi]], dim=1)
        score = torch.cat([older(score, fill), score[..., hi]], dim=1)
    if bug == "per_token_softmax":  # one weight per token (softmax of the channel-mean score), not per channel
        p = torch.softmax(score.mean(-1, keepdim=True), dim=1)
    else:
        p = torch.softmax(score, dim=1)
    c = (p * kv).sum(1)
    return reference.rms_norm(c.float().to(torch.bfloat16).double() if rounded else c, w["norm"].double(), EPS)


def _check_against_oracle(xs, got, gpos, w, ratio):
    for x, g, p in zip(xs, got, gpos):
        want, wpos = compressor.compress_sequence(x, w["wkv"], w["wgate"], w["ape"], w["norm"], ratio=ratio, eps=EPS)
        assert p.tolist() == wpos.tolist()
        assert_close(g, want, "compressor", "compressed rows")


# ----------------------------------------------------------------------------------------------------
# the op against the float64 oracle
# ----------------------------------------------------------------------------------------------------

PLANS = {
    4: [[37, 1, 1, 1, 9, 1], [1, 1, 6, 0, 1, 19]],  # request 1 absent from one step
    128: [[130, 1, 126, 1, 0, 3], [3, 0, 125, 2, 1, 130]],
}


@pytest.mark.parametrize("ratio", [4, 128])
def test_reference_matches_the_float64_oracle(ratio):
    xs, got, gpos, _, w = _run(ratio, PLANS[ratio])
    _check_against_oracle(xs, got, gpos, w, ratio)


@pytest.mark.parametrize("ratio,plan", [(4, [[13, 1, 2], [6, 1, 1]]), (128, [[129, 1, 0], [1, 126, 2]])])
def test_kernel_matches_the_float64_oracle(ratio, plan):
    xs, got, gpos, st, w = _run(ratio, plan, backend="triton")
    _check_against_oracle(xs, got, gpos, w, ratio)
    _, _, _, st_ref, _ = _run(ratio, plan, backend="reference")
    assert torch.equal(torch.isinf(st.score), torch.isinf(st_ref.score))  # the same ring rows were written
    assert_close(st.kv, st_ref.kv, "fp32_dot", "ring kv")
    assert_close(st.score, st_ref.score, "fp32_dot", "ring score")


def test_indexer_width_128():
    """The indexer's own ratio-4 compressor: D = 128, same op."""
    xs, got, gpos, _, w = _run(4, [[11, 1, 1]], dim=128, backend="triton")
    _check_against_oracle(xs, got, gpos, w, 4)


# ----------------------------------------------------------------------------------------------------
# pitfalls (docs/compressor.md#pitfalls)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bug", ["per_token_softmax", "halves_swapped", "no_start_mask", "ape_off_by_one"])
def test_pitfall_variants_are_caught(bug):
    """C1 per-token softmax, C2 overlap halves swapped, C3 positions before the start not masked, C5 ape not
    indexed by p % r: each wrong variant is far outside the tolerance, and the op matches the right one."""
    ratio = 4
    xs, got, _, _, w = _run(ratio, [[24]])
    right, wrong = _oracle(xs[0], w, ratio), _oracle(xs[0], w, ratio, bug)
    assert_close(got[0], right, "compressor")
    assert not compare(got[0], wrong, "compressor").passed
    if bug == "no_start_mask":  # only the first row (p = 3) has positions before the start
        assert not compare(got[0][:1], wrong[:1], "compressor").passed
        assert compare(got[0][1:], wrong[1:], "compressor").passed


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_pooled_row_is_rounded_to_bf16_before_the_norm(backend):
    """DeepSeek's order (the pooled row cast to bf16, then RMSNorm): the op's rows sit within fp32 noise (2^-14)
    of a float64 oracle that rounds there, but for the rare row where the fp32 pooled value and the float64 one
    fall on either side of a bf16 rounding boundary; the oracle that does not round is a bf16 rounding away
    from most rows (and within the derived "compressor" bound of all of them)."""
    ratio = 4
    xs, got, _, _, w = _run(ratio, [[64], [40]], backend=backend)
    near, far = [], []
    for x, g in zip(xs, got):
        rounded, exact = _oracle(x, w, ratio, rounded=True), _oracle(x, w, ratio)
        assert_close(g, exact, "compressor")
        near.append((g.double() - rounded).norm(dim=-1) <= 2.0**-14 * rounded.norm(dim=-1))
        far.append((g.double() - exact).norm(dim=-1) > 2.0**-14 * exact.norm(dim=-1))
    near, far = torch.cat(near), torch.cat(far)
    assert float(near.double().mean()) >= 0.9 and float(far.double().mean()) >= 0.9, (near, far)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_ring_is_read_before_it_is_overwritten(backend):
    """C4: a step of more than n tokens after a first step: boundary p = 7 reads positions 0..5 from the ring,
    and the same step's positions 8..13 go to those ring rows. Writing the ring first breaks row 1."""
    xs, got, gpos, _, w = _run(4, [[6, 12]], backend=backend)
    assert gpos[0].tolist() == [3, 7, 11, 15]
    _check_against_oracle(xs, got, gpos, w, 4)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_start_is_masked_whatever_the_state_holds(backend):
    """C3: positions before the sequence start are masked by position, not by the state's −inf: a ring full of
    finite garbage gives the same first rows."""
    st = compressor.allocate_state(1, 4, 512, device=DEVICE)
    st.kv.copy_(torch.randn(st.kv.shape, generator=torch.Generator().manual_seed(3)))
    st.score.copy_(torch.randn(st.score.shape, generator=torch.Generator().manual_seed(4)))
    xs, got, gpos, _, w = _run(4, [[9]], backend=backend, state=st)
    _check_against_oracle(xs, got, gpos, w, 4)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_padding_rows_are_ignored(backend):
    """C6: a padding row (valid False) completes no row and writes no ring row, even at a boundary position."""
    w = _weights(4)
    x = randn((9, HD), seed=8, device=DEVICE, block=None, octaves=2)
    st = compressor.allocate_state(2, 4, 512, device=DEVICE)
    req = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 0], device=DEVICE)
    pos = torch.tensor([3, 0, 1, 2, 3, 4, 5, 6, 7], device=DEVICE)
    valid = torch.tensor([False] + [True] * 8, device=DEVICE)
    rows, done = compressor.compress(
        x, w["wkv"], w["wgate"], w["ape"], w["norm"], st.kv, st.score, req, pos, ratio=4, eps=EPS, valid=valid, backend=backend
    )
    assert done.tolist() == [False] * 4 + [True] + [False] * 3 + [True]
    assert torch.isinf(st.score[1]).all()  # request 1's ring untouched
    keep = valid.clone()
    want = compressor.compress_sequence(x[keep], w["wkv"], w["wgate"], w["ape"], w["norm"], ratio=4, eps=EPS)[0]
    assert_close(rows[done], want, "compressor")


def test_strided_x_and_int32_indices():
    """x may be a strided view; requests / positions may be int32."""
    d = compressor.example_step(4, (9, 4), device=DEVICE)
    wide = torch.zeros(d["x"].shape[0], 2 * HD, dtype=torch.bfloat16, device=DEVICE)
    wide[:, ::2] = d["x"]
    d2 = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
    d2["x"], d2["requests"], d2["positions"] = wide[:, ::2], d["requests"].int(), d["positions"].int()
    r1, done1 = compressor.compress(**d, backend="reference")
    r2, done2 = compressor.compress(**d2, backend="triton")
    assert torch.equal(done1, done2)
    assert_close(r2, r1, "compressor")


def test_empty_step_leaves_the_state_alone():
    d = compressor.example_step(128, (0,), device=DEVICE)
    before = d["state_kv"].clone()
    for backend in ("reference", "triton"):
        rows, done = compressor.compress(**d, backend=backend)
        assert rows.shape == (0, 512) and done.shape == (0,)
    assert torch.equal(d["state_kv"], before)


def test_bad_arguments_raise():
    d = compressor.example_step(4, (5,), device=DEVICE)

    def call(**kw):
        return compressor.compress(**(d | kw), backend="reference")

    with pytest.raises(ValueError, match="ratio"):
        call(ratio=8)
    with pytest.raises(TypeError, match="x"):
        call(x=d["x"].float())
    with pytest.raises(ValueError, match="wkv"):
        call(wkv=d["wkv"][:512])
    with pytest.raises(ValueError, match="ape"):
        call(ape=d["ape"][:2])
    with pytest.raises(ValueError, match="state_kv"):
        call(state_kv=d["state_kv"][:, :4])
    with pytest.raises(ValueError, match="requests"):
        call(requests=torch.full((5,), 7, device=DEVICE))
    with pytest.raises(ValueError, match="positions"):
        call(positions=torch.tensor([0, 1, 2, -1, 4], device=DEVICE))
    with pytest.raises(ValueError, match="one run"):  # out of order
        call(positions=torch.tensor([0, 2, 1, 3, 4], device=DEVICE))
    with pytest.raises(ValueError, match="one run"):  # one request split into two runs
        call(requests=torch.tensor([0, 0, 1, 0, 0], device=DEVICE), positions=torch.tensor([0, 1, 0, 2, 3], device=DEVICE))
    with pytest.raises(ValueError, match="backend"):
        compressor.compress(**d, backend="gluon")
    with pytest.raises(TypeError, match="launch"):
        compressor.compress(**d, launch=dict(block_j=4))
    with pytest.raises(ValueError, match="block_j"):
        compressor.CompressorLaunch(block_j=16)


@pytest.mark.parametrize("name", ["state_kv", "state_score"])
def test_strided_state_is_refused(name):
    """The ring state is read and written by flat row offsets, so a strided view of the right shape is
    refused, with the argument named, before anything is written (x, by contrast, may be strided)."""
    d = compressor.example_step(4, (5,), device=DEVICE)
    state = d[name]
    base = torch.full((*state.shape[:-1], 2 * state.shape[-1]), 3.0, dtype=state.dtype, device=DEVICE)
    view = base[..., ::2]
    assert view.shape == state.shape and not view.is_contiguous()
    before = base.clone()
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match=f"{name}: expected a contiguous tensor"):
            compressor.compress(**(d | {name: view}), backend=backend)
        assert torch.equal(base, before), backend


def test_conformance_suite_has_teeth():
    """The compressor's conformance cases pass through the kernel and fail an implementation with the
    overlap halves swapped (C2: the older tokens read channels [D:2D])."""
    from dsv4ref import conformance

    rows = conformance.run(cases="compressor")
    assert len({r.case for r in rows}) >= 6 and all(r.passed for r in rows), conformance.format_report(rows)

    def swapped(x, wkv, wgate, ape, norm, *args, ratio, **kw):
        if ratio == 4:
            D = norm.shape[0]
            wkv, wgate, ape = (
                torch.cat([t[..., D:, :], t[..., :D, :]], -2)
                if t.dim() == 2 and t.shape[0] == 2 * D
                else torch.cat([t[:, D:], t[:, :D]], -1)
                for t in (wkv, wgate, ape)
            )
        return compressor.compress(x, wkv, wgate, ape, norm, *args, ratio=ratio, backend="reference", **kw)

    bad = [r for r in conformance.run({"compressor.compress": swapped}, "compressor") if not r.passed]
    assert {r.case for r in bad} >= {"r4_prefill_two_requests_start_mask", "r4_decode_step_from_ring"}
    assert all(r.case.startswith("r4") for r in bad)
