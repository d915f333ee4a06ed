"""The input contract of dsv4ref.sparse_mla.decode (docs/sparse_mla.md#input-contract): every
backend ("reference", "two_pass", "triton") gives the reference's answer or the same error, on every view,
index dtype and non-finite input; no call changes a buffer it was given.

* property tests (hypothesis, profile "ci" in `make test`, "long" in `make test-long`): drawn T (0 too), H,
  K per pool, page sizes 1 / 2 / 3 / 16, int32 / int64 slots and lengths, −1 placements, lengths None,
  ±inf sinks, strided views of q / slots / lengths / sink (tests/contract.py::views), list splits; NaN / ±inf
  in q and in cache rows with value checks off (the NaN-row rule), and the same inputs with checks on
  (ValueError naming q); bad arguments, which every backend refuses with the same error class;
* the probes of the input-contract audit that concern this op, as named tests.
"""

import dataclasses
import functools
import math

import pytest
import torch
from contract import outcome, snapshot, unchanged, views
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4ref import kv_cache, sparse_mla, validate
from dsv4ref.device import DEVICE
from dsv4ref.sparse_mla import SparseMlaLaunch, default_launch, gluon, reference
from dsv4ref.testing import compare, generator, randn

BACKENDS = sparse_mla.SUPPORTED_BACKENDS  # ("reference", "two_pass", "triton")
KERNELS = ("two_pass", "triton")
SCALE = sparse_mla.DEFAULT_SCALE
# numpy's "invalid value" warnings: an interpreted kernel computing inf − inf on non-finite data (expected here)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
# every example runs three backends in the interpreter: a share of the profile's count ("ci" 20 -> 6 and 4;
# "long" 400 -> 120 and 80), so `make test` stays within its budget
N_MAIN = max(2, settings.default.max_examples * 3 // 10)
N_NONFINITE = max(2, settings.default.max_examples // 5)


@functools.cache
def _cache(block_size: int, pages: int, seed: int) -> torch.Tensor:
    """A cache with every slot written (decode never writes it, so one copy serves many examples)."""
    n = block_size * pages
    cache = kv_cache.allocate(pages, block_size)
    kv_cache.insert(
        cache, randn((n, 512), seed=seed, octaves=6), torch.arange(n, device=DEVICE), block_size=block_size, backend="reference"
    )
    return cache


def _pool(data, T: int, K: int, prefix: str, seed: int):
    bs = data.draw(st.sampled_from([1, 2, 3, 16]), label=f"{prefix}block_size")
    pages = max(1, 48 // bs)
    n = bs * pages
    g = generator(seed)
    slots = torch.randint(0, n, (T, K), generator=g, dtype=torch.int64)
    slots[torch.rand(T, K, generator=g) < data.draw(st.sampled_from([0.0, 0.2, 1.0]), label=f"{prefix}p_minus1")] = -1
    slots = slots.to(data.draw(st.sampled_from([torch.int32, torch.int64]), label=f"{prefix}slot_dtype"))
    lengths = None
    if data.draw(st.booleans(), label=f"{prefix}has_lengths"):
        lengths = torch.randint(0, K + 1, (T,), generator=g).to(
            data.draw(st.sampled_from([torch.int32, torch.int64]), label=f"{prefix}len_dtype")
        )
    return _cache(bs, pages, seed % 3), slots.to(DEVICE), None if lengths is None else lengths.to(DEVICE), bs


def _draw_inputs(data) -> dict:
    T = data.draw(st.integers(0, 3), label="T")
    H = data.draw(st.sampled_from([1, 5, 16, 24]), label="H")
    K1 = data.draw(st.integers(1, 20), label="K1")
    K2 = data.draw(st.sampled_from([0, 0, 3, 6]), label="K2")
    seed = data.draw(st.integers(0, 50), label="seed")
    c1, s1, l1, b1 = _pool(data, T, K1, "", seed)
    kw = dict(cache=c1, slots=s1, lengths=l1, block_size=b1)
    if K2:
        c2, s2, l2, b2 = _pool(data, T, K2, "extra_", seed + 1)
        kw.update(extra_cache=c2, extra_slots=s2, extra_lengths=l2, extra_block_size=b2)
    q = (randn((T, H, 512), seed=seed + 7, octaves=4).float() * 0.25).to(torch.bfloat16)
    sink = None
    if data.draw(st.booleans(), label="has_sink"):
        sink = randn((H,), seed=seed + 9, dtype=torch.float32, octaves=0) * 2
        for _ in range(data.draw(st.integers(0, 2), label="n_inf_sinks")):
            sink[data.draw(st.integers(0, H - 1), label="inf_head")] = data.draw(st.sampled_from([math.inf, -math.inf]))
    kw.update(q=q, sink=sink)
    for name in ("q", "slots", "lengths", "sink", "extra_slots", "extra_lengths"):  # the same values, other layouts
        if kw.get(name) is not None:
            kw[name] = views(kw[name])[data.draw(st.sampled_from(sorted(views(kw[name]))), label=f"{name}_view")]
    return kw


def _same_answer(got, ref, mass, name):
    """out within "bf16_weighted_sum", lse within "lse"; non-finite entries at the same places (compare)."""
    out, lse = got
    assert out.shape == ref[0].shape and lse.shape == ref[1].shape and out.dtype == torch.bfloat16
    assert out.is_contiguous() and lse.is_contiguous()
    for r in (compare(out, ref[0], "bf16_weighted_sum", f"{name} out", mass), compare(lse, ref[1], "lse", f"{name} lse")):
        assert r.passed, r


def _tensors(kw):
    return [v for v in kw.values() if isinstance(v, torch.Tensor)]


@settings(max_examples=N_MAIN)
@given(data=st.data())
def test_every_backend_equals_the_reference(data):
    """Drawn shapes, page sizes, index dtypes, views, −1s, lengths (or None), ±inf sinks and list splits:
    the kernels give the reference's answer, and no input buffer changes."""
    kw = _draw_inputs(data)
    before = snapshot(*_tensors(kw))
    ref_out, ref_lse, mass = reference.decode(
        **{k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}, with_mass=True
    )
    for backend in BACKENDS:
        launch = None
        if backend != "reference" and data.draw(st.booleans(), label=f"{backend}_split"):
            T, H, _ = kw["q"].shape
            launch = dataclasses.replace(default_launch(T, H, 26, DEVICE), num_splits=2)
        _same_answer(sparse_mla.decode(**kw, backend=backend, launch=launch), (ref_out, ref_lse), mass, backend)
    assert unchanged(before, *_tensors(kw))


def _poison_q(data, q: torch.Tensor) -> torch.Tensor:
    q = q.clone()
    for _ in range(data.draw(st.integers(1, 3), label="n_bad_q")):
        t, h = data.draw(st.integers(0, q.shape[0] - 1), label="t"), data.draw(st.integers(0, q.shape[1] - 1), label="h")
        q[t, h, data.draw(st.integers(0, 511), label="d")] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    return q


@settings(max_examples=N_NONFINITE)
@given(data=st.data())
def test_nonfinite_input_same_on_every_backend(data):
    """NaN / ±inf in q and NaN / inf in a counted cache row. Checks on: a non-finite q raises
    ValueError("q: non-finite ...") on every backend; cache rows are not checked. Checks off: every backend
    gives the reference's answer, in which each poisoned (token, head) is out NaN, lse NaN — even with no
    valid candidate — and every other row is as without the poison."""
    T, H, K = data.draw(st.integers(1, 3), label="T"), data.draw(st.sampled_from([1, 16, 20]), label="H"), 12
    bs = data.draw(st.sampled_from([2, 16]), label="block_size")
    cache = _cache(bs, 48 // bs, 1).clone()
    g = generator(data.draw(st.integers(0, 9), label="seed"))
    slots = torch.randint(1, 48, (T, K), generator=g, dtype=torch.int32).to(DEVICE)
    lengths = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32).to(DEVICE)
    q = (randn((T, H, 512), seed=3, octaves=4).float() * 0.25).to(torch.bfloat16)
    bad_q = data.draw(st.booleans(), label="bad_q")
    if bad_q:
        q = _poison_q(data, q)
    if data.draw(st.booleans(), label="bad_row") or not bad_q:  # slot 0: NaN scale byte, or +inf / NaN RoPE bits
        how = data.draw(st.sampled_from(["scale255", "rope_inf", "rope_nan"]), label="how")
        if how == "scale255":
            cache[0, bs * 576 + data.draw(st.integers(0, 6), label="block")] = 255
        else:
            cache[0, 448 + 2 * 5 : 448 + 2 * 5 + 2] = torch.tensor([0x80 if how == "rope_inf" else 0xC0, 0x7F], dtype=torch.uint8)
        t = data.draw(st.integers(0, T - 1), label="counted_by")
        slots[t, 0] = 0
        lengths[t] = max(int(lengths[t]), 1)
        if T > 1:
            slots[(t + 1) % T, K - 1] = 0  # past that row's length unless the length is K
    kw = dict(
        q=q,
        cache=cache,
        slots=slots,
        lengths=lengths,
        block_size=bs,
        sink=torch.linspace(-1, 1, H).to(DEVICE) if data.draw(st.booleans(), label="sink") else None,
    )
    if bad_q:  # checks on: refused before any work, on every backend (cache rows are not checked: no raise)
        with validate.checking_values(True):
            assert {outcome(sparse_mla.decode, **kw, backend=b) for b in BACKENDS} == {("raise", "ValueError")}
            with pytest.raises(ValueError, match="^q: non-finite"):
                sparse_mla.decode(**kw)
    with validate.checking_values(False):
        ref_out, ref_lse, mass = reference.decode(**kw, with_mass=True)
        poisoned = torch.isnan(ref_lse)
        assert bool(torch.isnan(ref_out[poisoned]).all()) and not bool(torch.isnan(ref_out[~poisoned]).any())
        if bad_q:
            assert bool(poisoned[~torch.isfinite(q.float()).all(-1)].all()), "a NaN query must give a NaN row"
        for backend in KERNELS:
            splits = data.draw(st.sampled_from([1, 2]), label=f"{backend}_splits")
            launch = dataclasses.replace(default_launch(T, H, K, DEVICE), num_splits=splits)
            _same_answer(
                sparse_mla.decode(**kw, backend=backend, launch=launch), (ref_out, ref_lse), mass, f"{backend} splits={splits}"
            )


def _bad_calls(kw):
    """(argument named in the error, changes to decode's keyword arguments) for each bad input."""
    q, s, n, c, H = kw["q"], kw["slots"], kw["lengths"], kw["cache"], kw["q"].shape[1]
    big = s.clone()
    big[0, 0] = c.shape[0] * kw["block_size"]
    return [
        ("slots", dict(slots=big)),
        ("slots", dict(slots=s.float())),
        ("slots", dict(slots=s[:1])),
        ("lengths", dict(lengths=n + 100)),
        ("lengths", dict(lengths=n.float())),
        ("lengths", dict(lengths=n.to("meta"))),
        ("q", dict(q=q.float())),
        ("q", dict(q=q[..., :256])),
        ("q", dict(q=torch.zeros(2, 129, 512, dtype=torch.bfloat16, device=DEVICE))),
        ("sink", dict(sink=torch.full((H,), math.nan, device=DEVICE))),
        ("sink", dict(sink=torch.zeros(H, dtype=torch.bfloat16, device=DEVICE))),
        ("sink", dict(sink=torch.zeros(H + 1, device=DEVICE))),
        ("scale", dict(scale=math.nan)),
        ("scale", dict(scale=math.inf)),
        ("scale", dict(scale=0.0)),
        ("scale", dict(scale=-0.1)),
        ("scale", dict(scale=True)),
        ("scale", dict(scale="0.04")),
        ("scale", dict(scale=torch.tensor(0.04))),
        ("cache", dict(block_size=kw["block_size"] * 2)),  # the layout check names the cache
        ("block_size", dict(block_size=0)),
        ("block_size", dict(block_size=float(kw["block_size"]))),
        ("block_size", dict(block_size=True)),
        ("cache", dict(cache=c.view(torch.int8))),
        ("cache", dict(cache=c[:, :-1])),
        ("extra_block_size", dict(extra_cache=c, extra_slots=s)),
        ("extra_lengths", dict(extra_cache=c, extra_slots=s, extra_block_size=kw["block_size"], extra_lengths=n[:1])),
        ("launch", dict(launch={"num_splits": 2})),
        # refused where it cannot run (no Hopper GPU); on an H100/H200 it is a valid backend
        *([] if gluon.available() else [("backend", dict(backend="gluon"))]),
    ]


def test_bad_arguments_same_error_on_every_backend():
    """Every bad argument is refused before any work, with the same error class on every backend and a
    message that starts with the argument's name; no buffer changes."""
    kw = dict(
        q=(randn((2, 16, 512), seed=1).float() * 0.25).to(torch.bfloat16),
        cache=_cache(16, 3, 0),
        slots=torch.randint(0, 48, (2, 8), generator=generator(2), dtype=torch.int32).to(DEVICE),
        lengths=torch.tensor([8, 3], dtype=torch.int32, device=DEVICE),
        block_size=16,
    )
    before = snapshot(*_tensors(kw))
    for name, change in _bad_calls(kw):
        errors = set()
        for backend in BACKENDS:
            args = {**kw, "backend": backend, **change}
            with pytest.raises((TypeError, ValueError)) as e:
                sparse_mla.decode(**args)
            assert str(e.value).startswith(f"{name}:"), (name, backend, str(e.value))
            errors.add(type(e.value))
        assert len(errors) == 1, (name, errors)
    assert unchanged(before, *_tensors(kw))


# ------------------------------------------------------------------------------------------------
# the probes of the input-contract audit, by name
# ------------------------------------------------------------------------------------------------


def _small(T=3, H=16, K1=12, K2=4, seed=5):
    return sparse_mla.example_inputs(T, H, K1, K2, block_size=16, extra_block_size=2, pages=2, extra_pages=8, seed=seed)


def test_probe_nan_query_checks_on_raises():
    """Before: the reference gave a NaN row, the kernels a zero row with lse −inf. Now: ValueError naming q."""
    kw = _small()
    kw["q"][1, 3, 7] = math.nan
    for backend in BACKENDS:
        with validate.checking_values(True), pytest.raises(ValueError, match=r"^q: non-finite values"):
            sparse_mla.decode(**kw, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_nan_query_checks_off_gives_a_nan_row(backend):
    """Checks off: out NaN and lse NaN for exactly that (token, head), also when the token has no valid
    candidate (the empty-row answer would be out 0, lse −inf) and through the split merge."""
    kw = _small()
    kw["q"][1, 3, 7] = math.nan
    kw["q"][2, 5, 0] = -math.inf
    kw["lengths"][2] = 0
    kw["extra_lengths"][2] = 0  # token 2: no valid candidate at all
    with validate.checking_values(False):
        for splits in (1, 2) if backend != "reference" else (None,):
            launch = None if splits is None else dataclasses.replace(default_launch(3, 16, 16, DEVICE), num_splits=splits)
            out, lse = sparse_mla.decode(**kw, backend=backend, launch=launch)
            bad = torch.zeros(3, 16, dtype=torch.bool)
            bad[1, 3] = bad[2, 5] = True
            assert torch.equal(torch.isnan(lse).cpu(), bad), lse
            assert bool(torch.isnan(out[bad.to(DEVICE)]).all()) and not bool(torch.isnan(out[~bad.to(DEVICE)]).any())
            assert bool((lse[2][~bad[2].to(DEVICE)] == -math.inf).all())  # the other heads of token 2: empty


def test_probe_scale_validated():
    """Before: decode(scale=nan) was accepted. Now a finite number > 0 (not a bool, a string or a tensor)."""
    kw = _small()
    for bad, err in [
        (math.nan, ValueError),
        (math.inf, ValueError),
        (0.0, ValueError),
        (-1, ValueError),
        (True, TypeError),
        ("0.04", TypeError),
        (torch.tensor(0.04), TypeError),
    ]:
        with pytest.raises(err, match="^scale: "):
            sparse_mla.decode(**kw, scale=bad)
    a = sparse_mla.decode(**kw, scale=1)  # an int is a number
    b = sparse_mla.decode(**kw, scale=1.0)
    assert torch.equal(a[1], b[1])


def test_probe_sink_validated():
    """sink: fp32 [H]; NaN refused while checks are on; ±inf keep their meaning (−inf = no sink, +inf
    silences the head, lse unchanged); a strided sink is read as a view."""
    kw = _small(T=2, K2=0)
    H = kw["q"].shape[1]
    with pytest.raises(TypeError, match="^sink: expected dtype torch.float32"):
        sparse_mla.decode(**{**kw, "sink": kw["sink"].to(torch.bfloat16)})
    with pytest.raises(ValueError, match="^sink: expected shape"):
        sparse_mla.decode(**{**kw, "sink": kw["sink"][:-1]})
    nan_sink = kw["sink"].clone()
    nan_sink[4] = math.nan
    with pytest.raises(ValueError, match="^sink: non-finite values: entry 4 is NaN"):
        sparse_mla.decode(**{**kw, "sink": nan_sink})
    inf = torch.full((H,), math.inf, device=DEVICE)
    strided = torch.zeros(2 * H, device=DEVICE)
    strided[::2] = kw["sink"]
    for backend in BACKENDS:
        ob, lb = sparse_mla.decode(**{**kw, "sink": None}, backend=backend)
        o, l = sparse_mla.decode(**{**kw, "sink": -inf}, backend=backend)
        assert torch.equal(o.view(torch.int16), ob.view(torch.int16)) and torch.equal(l, lb), backend
        o, l = sparse_mla.decode(**{**kw, "sink": inf}, backend=backend)
        assert not bool(o.any()) and torch.equal(l, lb), backend
    a = sparse_mla.decode(**{**kw, "sink": strided[::2]})  # every backend: test_every_backend_equals_the_reference
    b = sparse_mla.decode(**kw)
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))


def test_probe_block_size_against_the_page_stride():
    """A cache laid out for B = 4 read as B = 2 (its pages hold 2 tokens, but the scales sit elsewhere): the
    error names the cache, for both pools; block_size must be an int ≥ 1."""
    kw = _small(K2=0)
    c4 = kv_cache.allocate(6, 4)
    slots = torch.zeros(3, 12, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^cache: pages of 2880 bytes do not match block_size=2.*page_bytes\(4\)"):
        sparse_mla.decode(kw["q"], c4, slots, None, block_size=2)
    with pytest.raises(ValueError, match=r"^extra_cache: pages of 2880 bytes"):
        sparse_mla.decode(**kw, extra_cache=c4, extra_slots=slots, extra_block_size=2)
    with pytest.raises(ValueError, match=r"^extra_cache: pages of .* cannot hold block_size=64"):
        sparse_mla.decode(**kw, extra_cache=c4, extra_slots=slots, extra_block_size=64)
    for bad, err in [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError), ("4", TypeError)]:
        with pytest.raises(err, match="^block_size: "):
            sparse_mla.decode(**{**kw, "block_size": bad})
        with pytest.raises(err, match="^extra_block_size: "):
            sparse_mla.decode(**kw, extra_cache=c4, extra_slots=slots, extra_block_size=bad)


def test_probe_every_tensor_on_one_device():
    """Before: lengths on the meta device failed inside .item(). Now a ValueError naming the argument, for
    every tensor argument, before any value is read."""
    kw = _small()
    for name in ("q", "slots", "lengths", "sink", "extra_slots", "extra_lengths", "cache", "extra_cache"):
        with pytest.raises(ValueError, match=f"^{name}: "):
            sparse_mla.decode(**{**kw, name: kw[name].to("meta")})
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with pytest.raises(ValueError, match="^q: a tensor on the meta device"):
        sparse_mla.decode(**meta)


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_strided_index_views_are_honoured(backend):
    """slots / lengths / extra_slots as every-other-entry views (the storage underneath holds other values),
    q with a padded head stride and a strided last dim, sink strided: the contiguous answer, bit for bit."""
    kw = _small()
    want = sparse_mla.decode(**kw, backend=backend)
    v = dict(kw)
    for name in ("slots", "extra_slots"):
        big = torch.full((kw[name].shape[0], 2 * kw[name].shape[1]), 10**6, dtype=kw[name].dtype, device=DEVICE)
        big[:, ::2] = kw[name]
        v[name] = big[:, ::2]  # entries 2 apart; the gaps hold an out-of-range slot
    for name in ("lengths", "extra_lengths"):
        big = torch.full((2 * kw[name].shape[0],), 10**6, dtype=kw[name].dtype, device=DEVICE)
        big[::2] = kw[name]
        v[name] = big[::2]
    qbig = torch.full((3, 20, 1024), math.nan, dtype=torch.bfloat16, device=DEVICE)
    qbig[:, :16, ::2] = kw["q"]
    v["q"] = qbig[:, :16, ::2]  # head stride 1024, last-dim stride 2, NaN in the gaps
    got = sparse_mla.decode(**v, backend=backend)
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16)) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", [*BACKENDS, *sparse_mla.GPU_ONLY])
def test_row_strided_slots_are_read_at_their_row_stride(backend):
    """slots / extra_slots as row views of wider tables (entries contiguous, rows K + 5 apart, the columns
    beyond holding −1): such a view reaches the kernels as it is (only another entry stride is copied), so a
    launcher that walks the rows at stride K instead of ``slots.stride(0)`` reads the neighbouring columns
    and the next row's entries. The contiguous answer, bit for bit."""
    kw = _small()
    if backend in sparse_mla.GPU_ONLY and not gluon.supports(kw["q"], kw["cache"], kw["extra_cache"]):
        pytest.skip("needs the Hopper backend")
    want = sparse_mla.decode(**kw, backend=backend)
    v = dict(kw)
    for name in ("slots", "extra_slots"):
        T, K = kw[name].shape
        wide = torch.full((T, K + 5), -1, dtype=kw[name].dtype, device=DEVICE)
        wide[:, 1 : K + 1] = kw[name]
        v[name] = wide[:, 1 : K + 1]
        assert v[name].stride() == (K + 5, 1)
    got = sparse_mla.decode(**v, backend=backend)
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16)) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_int64_indices_empty_batch_and_empty_lists(backend):
    """int64 slots and lengths equal int32; T = 0 gives empty outputs; K = 0 (no candidate at all) gives
    out 0 and lse −inf."""
    kw = _small()
    a = sparse_mla.decode(**kw, backend=backend)
    b = sparse_mla.decode(
        **{**kw, **{k: kw[k].long() for k in ("slots", "lengths", "extra_slots", "extra_lengths")}}, backend=backend
    )
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16)) and torch.equal(a[1], b[1])
    e = {
        **kw,
        "q": kw["q"][:0],
        "slots": kw["slots"][:0],
        "lengths": kw["lengths"][:0],
        "extra_slots": kw["extra_slots"][:0],
        "extra_lengths": kw["extra_lengths"][:0],
    }
    out, lse = sparse_mla.decode(**e, backend=backend)
    assert out.shape == (0, 16, 512) and lse.shape == (0, 16)
    z = {**kw, "slots": kw["slots"][:, :0], "lengths": None, "extra_slots": kw["extra_slots"][:, :0], "extra_lengths": None}
    out, lse = sparse_mla.decode(**z, backend=backend)
    assert not bool(out.any()) and bool((lse == -math.inf).all())


def test_probe_checks_off_lengths_are_clamped_and_negative_slots_are_none():
    """Checks off, every backend reads a length below 0 as 0 and above K as K, and any negative slot as −1."""
    kw = _small(K2=0)
    clean = dict(kw)
    clean["lengths"] = torch.tensor([0, 12, 5], dtype=torch.int32, device=DEVICE)
    dirty = dict(clean)
    dirty["lengths"] = torch.tensor([-3, 40, 5], dtype=torch.int32, device=DEVICE)
    dirty["slots"] = kw["slots"].clone()
    dirty["slots"][1, 2] = -7
    clean["slots"] = dirty["slots"].clamp_min(-1)
    with validate.checking_values(True), pytest.raises(ValueError, match=r"^slots: entry \(1, 2\) = -7"):
        sparse_mla.decode(**dirty)
    with validate.checking_values(True), pytest.raises(ValueError, match=r"^lengths: entry 0 = -3"):
        sparse_mla.decode(**{**dirty, "slots": clean["slots"]})
    with validate.checking_values(False):
        for backend in BACKENDS:
            a = sparse_mla.decode(**dirty, backend=backend)
            b = sparse_mla.decode(**clean, backend=backend)
            assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16)) and torch.equal(a[1], b[1]), backend


def test_probe_launch_validated():
    with pytest.raises(ValueError, match="^block_n: expected a power of two"):
        SparseMlaLaunch(block_h=16, block_n=24)
    with pytest.raises(ValueError, match="^block_h: expected a power of two >= 16"):
        SparseMlaLaunch(block_h=8, block_n=16)
    with pytest.raises(ValueError, match="^num_stages: expected an int >= 1"):
        SparseMlaLaunch(block_h=16, block_n=16, num_stages=0)
    with pytest.raises(TypeError, match="^num_warps: expected an int"):
        SparseMlaLaunch(block_h=16, block_n=16, num_warps=4.0)
