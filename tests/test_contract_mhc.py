"""The input contract of ``dsv4ref.mhc`` (docs/mhc.md#the-input-contract).

Property tests (hypothesis, profiles in conftest.py) draw shapes (T = 0, one token, a partial token tile,
odd Hd), a layout per tensor argument (``contract.views``: strided rows, a storage offset, a transposed
copy), non-finite values at drawn positions and value checks on or off, and assert for every public function
of the op: every backend equals the float64 oracle under the named tolerance (non-finite entries at the same
positions), or every backend raises the same error class naming the argument; no call changes an input.
Then one named test per adversarial probe (a strided scale, an empty batch, NaN with checks off, ...).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import outcome, snapshot, unchanged, views
from dsv4ref import mhc, validate
from dsv4ref.device import DEVICE
from dsv4ref.mhc import OnePassLaunch, reference
from dsv4ref.testing import assert_close, compare, generator, randn

BACKENDS = ("reference", "triton")
# the interpreter pays ~10 ms per kernel helper call: fewer examples than the profile's default for the
# functions that run the pre kernels (the "long" profile still multiplies them)
FEW = settings(max_examples=max(6, settings.default.max_examples // 3))

NONFINITE = st.one_of(st.none(), st.tuples(st.sampled_from(["nan", "inf", "-inf"]), st.integers(0, 2**31 - 1)))


def _inject(t: torch.Tensor, spec) -> torch.Tensor:
    """``t`` with one entry (drawn) set to NaN / ±inf; bf16 stays bf16."""
    if spec is None or t.numel() == 0:
        return t
    kind, pos = spec
    out = t.clone()
    out.view(-1)[pos % out.numel()] = float(kind)
    return out


def _layout(draw, t: torch.Tensor) -> torch.Tensor:
    v = views(t)
    return v[draw(st.sampled_from(sorted(v)))]


def _run(fn, *args, **kw):
    """{backend: ("ok", result) | ("raise", class name)} with the inputs checked unchanged afterwards."""
    tensors = [a for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)]
    before = snapshot(*tensors)
    got = {b: outcome(fn, *args, backend=b, **kw) for b in BACKENDS}
    assert unchanged(before, *tensors), "a call changed an input"
    return got


def _expect_same_error(got, name_hint=None):
    kinds = {k for k, _ in got.values()}
    assert kinds == {"raise"}, got
    assert len({v for _, v in got.values()}) == 1, got


def _poisoned_run(draw, op, args: dict):
    """``args`` with one drawn argument given a drawn NaN / ±inf (or none), each in a drawn layout, and ``op``
    run on every backend with value checks drawn on or off. Returns ``(args, got, refused)``: ``refused`` is
    the poisoned argument's name when the checked call had to refuse it (every backend raised the same
    error), else None."""
    bad_arg = draw(st.sampled_from(list(args)))
    bad = draw(NONFINITE)
    checks = draw(st.booleans())
    args = dict(args)
    args[bad_arg] = _inject(args[bad_arg], bad)
    args = {k: _layout(draw, v) for k, v in args.items()}
    with validate.checking_values(checks):
        got = _run(op, *args.values())
    if bad is not None and checks and args[bad_arg].numel():
        _expect_same_error(got)
        return args, got, bad_arg
    return args, got, None


def _draw_case(draw, Hd_choices=(16, 33)):
    T = draw(st.sampled_from([0, 1, 5, 17]))
    Hd = draw(st.sampled_from(list(Hd_choices)))
    seed = draw(st.integers(0, 1000))
    return T, Hd, seed


def _stream_inputs(draw, T, Hd, seed, head=False):
    res = mhc.example_streams(T, Hd, seed=seed)
    fn, scale, base = mhc.example_params(Hd, seed=seed + 1, head=head)
    return res, fn, scale, base


# ====================================================================================================
# Property tests: every public function, every backend, against the float64 oracle
# ====================================================================================================


@given(st.data())
def test_sinkhorn_contract(data):
    draw = data.draw
    n = draw(st.sampled_from([0, 1, 7]))
    lead = draw(st.sampled_from([(n,), (n, 2)]))
    L = (torch.randn(*lead, 4, 4, generator=generator(draw(st.integers(0, 999)))) * 3).to(DEVICE)
    iters = draw(st.sampled_from([1, 2, 20]))
    bad = draw(NONFINITE)
    checks = draw(st.booleans())
    L = _layout(draw, _inject(L, bad))
    with validate.checking_values(checks):
        got = _run(mhc.sinkhorn, L, iters)
    if bad is not None and checks and L.numel():
        _expect_same_error(got)
        assert got["triton"][1] == "ValueError"
        return
    want = reference.sinkhorn(L.double(), iters)
    for b, (kind, out) in got.items():
        assert kind == "ok", (b, out)
        assert out.dtype == torch.float32 and out.shape == L.shape
        assert_close(out, want, "mhc", f"sinkhorn[{b}]")


@FEW
@given(st.data())
def test_pre_contract(data):
    draw = data.draw
    T, Hd, seed = _draw_case(draw)
    res, fn, scale, base = _stream_inputs(draw, T, Hd, seed)
    args, got, refused = _poisoned_run(draw, mhc.pre, dict(residual=res, fn=fn, scale=scale, base=base))
    if refused:
        with validate.checking_values(True), pytest.raises(ValueError, match=f"^{refused}: non-finite values"):
            mhc.pre(*args.values(), backend="triton")
        return
    p64, c64, x64 = reference.pre(*args.values(), dtype=torch.float64)
    for b, (kind, out) in got.items():
        assert kind == "ok", (b, out)
        p, c, x = out
        assert_close(p, p64, "mhc", f"pre[{b}] post")
        assert_close(c, c64, "mhc", f"pre[{b}] comb")
        assert_close(x, x64, "bf16_out", f"pre[{b}] layer_input")


@FEW
@given(st.data())
def test_post_contract(data):
    draw = data.draw
    T, Hd, seed = _draw_case(draw, (16, 33, 64))
    res = mhc.example_streams(T, Hd, seed=seed)
    x = randn((T, Hd), seed=seed + 1, octaves=4)
    g = generator(seed + 2)
    post = (2 * torch.rand(T, 4, generator=g)).to(DEVICE)
    if draw(st.booleans()):
        post = post[:, :, None]
    comb = mhc.sinkhorn(torch.randn(T, 4, 4, generator=g).to(DEVICE) * 2, backend="reference")  # not symmetric
    args, got, refused = _poisoned_run(draw, mhc.post, dict(x=x, residual=res, post=post, comb=comb))
    if refused:
        with validate.checking_values(True), pytest.raises(ValueError, match=f"^{refused}: non-finite values"):
            mhc.post(*args.values(), backend="triton")
        return
    want = reference.post(*args.values(), dtype=torch.float64)
    for b, (kind, out) in got.items():
        assert kind == "ok", (b, out)
        assert_close(out, want, "bf16_out", f"post[{b}]")


@FEW
@given(st.data())
def test_fused_post_pre_contract(data):
    draw = data.draw
    T, Hd, seed = _draw_case(draw)
    res, fn, scale, base = _stream_inputs(draw, T, Hd, seed)
    x = randn((T, Hd), seed=seed + 3, octaves=4)
    g = generator(seed + 4)
    post = (2 * torch.rand(T, 4, generator=g)).to(DEVICE)
    comb = mhc.sinkhorn(torch.randn(T, 4, 4, generator=g).to(DEVICE) * 2, backend="reference")
    args, got, refused = _poisoned_run(
        draw, mhc.fused_post_pre, dict(x=x, residual=res, post=post, comb=comb, fn=fn, scale=scale, base=base)
    )
    if refused:
        return
    a = list(args.values())
    want_new = reference.post(*a[:4], dtype=torch.float64)
    for b, (kind, out) in got.items():
        assert kind == "ok", (b, out)
        new, p, c, li = out
        assert_close(new, want_new, "bf16_out", f"fused[{b}] residual")
        p64, c64, x64 = reference.pre(new, *a[4:], dtype=torch.float64)  # the pre of the streams it stored
        assert_close(p, p64, "mhc", f"fused[{b}] post")
        assert_close(c, c64, "mhc", f"fused[{b}] comb")
        assert_close(li, x64, "bf16_out", f"fused[{b}] layer_input")


@FEW
@given(st.data())
def test_head_contract(data):
    draw = data.draw
    T, Hd, seed = _draw_case(draw)
    hidden, fn, scale, base = _stream_inputs(draw, T, Hd, seed, head=True)
    args, got, refused = _poisoned_run(draw, mhc.head, dict(hidden=hidden, fn=fn, scale=scale, base=base))
    if refused:
        return
    want = reference.head(*args.values(), dtype=torch.float64)
    for b, (kind, out) in got.items():
        assert kind == "ok", (b, out)
        assert_close(out, want, "bf16_out", f"head[{b}]")


# ====================================================================================================
# Adversarial probes, one named test each
# ====================================================================================================


def test_probe_strided_scale_and_base_are_honoured():
    """Before: the Triton launcher passed strided scale / base straight to the kernel, which read the
    storage underneath (post off by up to 1.15). Now every backend gives the contiguous answer; the Triton
    one bit for bit."""
    res = mhc.example_streams(3, 64, seed=1)
    fn, scale, base = mhc.example_params(64, seed=2)
    ref = mhc.pre(res, fn, scale, base)
    for kind in ("every_other_row", "storage_offset"):
        s_view, b_view = views(scale)[kind], views(base)[kind]
        assert not s_view.is_contiguous() or s_view.storage_offset()
        got = mhc.pre(res, fn, s_view, b_view)
        for a, b in zip(got, ref):
            assert_close(a, b, "exact")
        assert_close(mhc.pre(res, fn, s_view, b_view, backend="reference")[0], ref[0], "mhc")


def test_probe_every_tensor_argument_may_be_a_view():
    """fused_post_pre and head with every tensor argument a non-contiguous view: bit-equal to contiguous."""
    T, Hd = 3, 32
    res = mhc.example_streams(T, Hd, seed=3)
    x = randn((T, Hd), seed=4, octaves=4)
    fn, scale, base = mhc.example_params(Hd, seed=5)
    p, c, _ = mhc.pre(res, fn, scale, base)
    want = mhc.fused_post_pre(x, res, p, c, fn, scale, base)
    got = mhc.fused_post_pre(
        *(views(t)["every_other_row"] for t in (x, res, p, c, fn)), views(scale)["storage_offset"], views(base)["every_other_row"]
    )
    for a, b in zip(got, want):
        assert_close(a, b, "exact")
    hfn, hscale, hbase = mhc.example_params(Hd, seed=6, head=True)
    assert_close(
        mhc.head(views(res)["transposed_copy"], views(hfn)["storage_offset"], hscale, hbase),
        mhc.head(res, hfn, hscale, hbase),
        "exact",
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_sinkhorn_iters_one_rule(backend):
    """Before: ``pre(sinkhorn_iters=0)`` silently ran one pass while ``sinkhorn(iters=0)`` raised. Now both
    take an int >= 1, on every backend: 0 or −1 is a ValueError, 1.5 or True a TypeError, naming the argument."""
    res = mhc.example_streams(2, 16)
    fn, scale, base = mhc.example_params(16)
    L = torch.zeros(2, 4, 4, device=DEVICE)
    for bad, err in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), (None, TypeError)):
        with pytest.raises(err, match="^iters: "):
            mhc.sinkhorn(L, bad, backend=backend)
        with pytest.raises(err, match="^sinkhorn_iters: "):
            mhc.pre(res, fn, scale, base, sinkhorn_iters=bad, backend=backend)
        with pytest.raises(err, match="^sinkhorn_iters: "):
            mhc.fused_post_pre(
                torch.zeros(2, 16, dtype=torch.bfloat16, device=DEVICE),
                res,
                torch.ones(2, 4, device=DEVICE),
                torch.full((2, 4, 4), 0.25, device=DEVICE),
                fn,
                scale,
                base,
                sinkhorn_iters=bad,
                backend=backend,
            )


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_scalars_are_validated(backend):
    """eps, rms_eps, hc_eps: finite and >= 0; post_mult: finite; each error names its argument."""
    res = mhc.example_streams(2, 16)
    fn, scale, base = mhc.example_params(16)
    hfn, hscale, hbase = mhc.example_params(16, head=True)
    L = torch.zeros(2, 4, 4, device=DEVICE)
    for v, err in ((float("nan"), ValueError), (float("inf"), ValueError), (-1e-6, ValueError), ("1e-6", TypeError)):
        with pytest.raises(err, match="^eps: "):
            mhc.sinkhorn(L, 20, v, backend=backend)
        for name in ("rms_eps", "hc_eps"):
            with pytest.raises(err, match=f"^{name}: "):
                mhc.pre(res, fn, scale, base, backend=backend, **{name: v})
            with pytest.raises(err, match=f"^{name}: "):
                mhc.head(res, hfn, hscale, hbase, backend=backend, **{name: v})
    for v in (float("nan"), float("-inf")):
        with pytest.raises(ValueError, match="^post_mult: "):
            mhc.pre(res, fn, scale, base, post_mult=v, backend=backend)
    with pytest.raises(TypeError, match="^launch: "):
        mhc.post(
            torch.zeros(2, 16, dtype=torch.bfloat16, device=DEVICE),
            res,
            torch.ones(2, 4, device=DEVICE),
            L,
            backend=backend,
            launch="split_k",
        )


def test_probe_sinkhorn_names_its_own_argument():
    """Before: ``sinkhorn`` on 5×5 logits blamed "residual"."""
    with pytest.raises(ValueError, match="^logits: the Triton kernels are written for M = 4"):
        mhc.sinkhorn(torch.zeros(3, 5, 5, device=DEVICE), backend="triton")
    assert mhc.sinkhorn(torch.zeros(3, 5, 5, device=DEVICE), backend="reference").shape == (3, 5, 5)
    with pytest.raises(TypeError, match="^logits: expected dtype torch.float32"):
        mhc.sinkhorn(torch.zeros(3, 4, 4, dtype=torch.float64, device=DEVICE), backend="reference")


def test_probe_empty_inputs_every_backend():
    """Peer disagreement (a): pre / fused_post_pre / head with backend="reference" crashed on T = 0 (in
    ``reshape(T, -1)``) where Triton returned empty outputs. Every backend returns the same empty outputs."""
    res, fn, scale, base = mhc.example_streams(0, 33), *mhc.example_params(33)
    hfn, hscale, hbase = mhc.example_params(33, head=True)
    x, p, c = torch.zeros(0, 33, dtype=torch.bfloat16), torch.zeros(0, 4), torch.zeros(0, 4, 4)
    x, p, c = x.to(DEVICE), p.to(DEVICE), c.to(DEVICE)
    calls = {
        "pre": lambda b: mhc.pre(res, fn, scale, base, backend=b),
        "post": lambda b: (mhc.post(x, res, p, c, backend=b),),
        "fused": lambda b: mhc.fused_post_pre(x, res, p, c, fn, scale, base, backend=b),
        "head": lambda b: (mhc.head(res, hfn, hscale, hbase, backend=b),),
        "sinkhorn": lambda b: (mhc.sinkhorn(c, backend=b),),
    }
    for name, call in calls.items():
        outs = {b: call(b) for b in BACKENDS}
        for a, b in zip(outs["reference"], outs["triton"]):
            assert a.shape == b.shape and a.dtype == b.dtype and a.numel() == 0, name


@pytest.mark.parametrize("design", ["default", "one_pass"])
def test_probe_nonfinite_with_checks_off_is_defined(design):
    """Value checks off: IEEE propagation, the same on every backend and design. A NaN (or ±inf) in token
    t's streams makes exactly that token's post, comb and layer input NaN (the RMS factor of an inf is 0,
    and inf·0 is NaN); other tokens are untouched. A NaN stored as bf16 stays NaN (compiled, a NaN is
    0x7FFFFFFF, which a plain rounding add would carry into −0.0)."""
    launch = OnePassLaunch() if design == "one_pass" else None
    T, Hd = 4, 32
    res = mhc.example_streams(T, Hd, seed=7)
    fn, scale, base = mhc.example_params(Hd, seed=8)
    res[1, 2, 5] = float("nan")
    res[3, 0, 0] = float("inf")
    with validate.checking_values(False):
        outs = {b: mhc.pre(res, fn, scale, base, backend=b, launch=launch) for b in BACKENDS}
    for b, (p, c, x) in outs.items():
        for t in range(T):
            bad = t in (1, 3)
            assert bool(p[t].isnan().all()) == bad and bool(c[t].isnan().all()) == bad, (b, t)
            assert bool(x[t].float().isnan().all()) == bad and bool(x[t].float().isfinite().all()) != bad, (b, t)
    p64, c64, x64 = reference.pre(res, fn, scale, base, dtype=torch.float64)
    assert_close(outs["triton"][0], p64, "mhc")
    assert_close(outs["triton"][2], x64, "bf16_out")
    # post: NaN in x at (t, h) gives NaN in every new stream at (t, h); inf stays inf (post > 0, comb > 0)
    x = randn((T, Hd), seed=9, octaves=4)
    x[0, 3], x[2, 7] = float("nan"), float("inf")
    p, c, _ = mhc.pre(mhc.example_streams(T, Hd, seed=10), fn, scale, base, backend="reference")
    with validate.checking_values(False):
        news = {b: mhc.post(x, mhc.example_streams(T, Hd, seed=10), p, c, backend=b) for b in BACKENDS}
    for b, new in news.items():
        assert bool(new[0, :, 3].float().isnan().all()) and bool((new[2, :, 7].float() == float("inf")).all()), b
        assert int(new.float().isnan().sum()) == 4 and int(new.float().isinf().sum()) == 4, b
        assert int((new.view(torch.int16) == -32768).sum()) == 0, b  # no NaN turned into -0.0


def test_probe_failed_call_touches_nothing():
    """Validation runs before any work: a failed call leaves every argument byte-identical, on every
    backend (the property tests above check the same for every drawn case)."""
    res = mhc.example_streams(3, 16, seed=11)
    fn, scale, base = mhc.example_params(16, seed=12)
    bad = res.clone()
    bad[0, 0, 0] = float("nan")
    for b in BACKENDS:
        before = snapshot(bad, fn, scale, base)
        with pytest.raises(ValueError, match="^residual: non-finite"):
            mhc.pre(bad, fn, scale, base, backend=b)
        with pytest.raises(ValueError, match="^hc_eps: "):
            mhc.pre(res, fn, scale, base, hc_eps=-1.0, backend=b)
        assert unchanged(before, bad, fn, scale, base)
    assert compare(mhc.pre(res, fn, scale, base)[0], mhc.pre(res, fn, scale, base, backend="reference")[0], "mhc").passed
