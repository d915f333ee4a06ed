"""The input contract of dsv4ref.rope (docs/rope.md#input-contract): every backend gives the reference's answer
or the same error, on every view, index dtype and non-finite input; a failed call changes no buffer.

* property tests (hypothesis, profile "ci" in `make test`, "long" in `make test-long`) for apply_gptj,
  qnorm_rope_kv_insert: drawn shapes, strided views (tests/contract.py::views), int32 /
  int64 indices, −1 placements, short slot lists, odd page sizes, NaN / ±inf, value checks on and off;
* the probes of the input-contract audit as named tests (strided positions / slots, scalar arguments, the
  layout check, the non-finite policy of docs/rope.md#non-finite-input);
* the peer disagreement: vLLM's reference form rope(bf16(rmsnorm(q))) passes the conformance suite, a NeoX
  pairing or a missing norm fails it.
"""

import math

import pytest
import torch
from contract import outcome, views
from hypothesis import given
from hypothesis import strategies as st

from dsv4ref import conformance, kv_cache, rope, validate
from dsv4ref.config import FLASH
from dsv4ref.device import DEVICE
from dsv4ref.formats import page_bytes
from dsv4ref.rope import RopeLaunch, apply_gptj, qnorm_rope_kv_insert
from dsv4ref.testing import generator, randn

TAB = rope.cos_sin_cache(64)  # θ = 10000
YTAB = rope.cos_sin_cache(64, theta=FLASH.compress_rope_theta, yarn=FLASH.yarn)
NAN16, NAN32 = 0x7FC0, 0x7FC00000  # the one NaN every backend writes (docs/rope.md#non-finite-input)
NON_FINITE = [float("nan"), float("inf"), float("-inf")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(t.dtype, t.dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of t's storage (the gaps of a strided view included), as a uint8 copy."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()


def random_cache(pages: int, block_size: int, seed: int) -> torch.Tensor:
    """A cache of random bytes: a stray write shows."""
    return torch.randint(0, 256, (pages, page_bytes(block_size)), generator=generator(seed), dtype=torch.uint8).to(DEVICE)


# ------------------------------------------------------------------------------------------------
# property tests
# ------------------------------------------------------------------------------------------------


def _poison(data, t: torch.Tensor, rotary_from: int) -> torch.Tensor:
    """Up to two NaN / ±inf entries at drawn places (often in the rotary slice)."""
    if t.numel() == 0:
        return t
    t = t.clone()
    flat = t.view(-1)
    for _ in range(data.draw(st.integers(0, 2), label="n_poison")):
        row = data.draw(st.integers(0, t.numel() // t.shape[-1] - 1), label="row")
        col = data.draw(st.one_of(st.integers(rotary_from, t.shape[-1] - 1), st.integers(0, t.shape[-1] - 1)), label="col")
        flat[row * t.shape[-1] + col] = data.draw(st.sampled_from(NON_FINITE), label="value")
    return t


def _view(data, t: torch.Tensor, label: str) -> str:
    return data.draw(st.sampled_from(sorted(views(t))), label=label)


@given(data=st.data())
def test_apply_gptj_every_backend_every_view(data):
    D = data.draw(st.sampled_from([64, 67, 128]), label="D")
    lead = data.draw(st.sampled_from([(), (3,), (0, 2), (2, 3), (4, 1), (2, 2, 2)]), label="lead")
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float32]), label="dtype")
    x = randn((*lead, D), seed=data.draw(st.integers(0, 99), label="seed"), dtype=dtype, block=None, octaves=6)
    if data.draw(st.booleans(), label="non_finite"):
        x = _poison(data, x, D - 64)
    per_token = len(lead) >= 2 and data.draw(st.booleans(), label="per_token")
    pshape = lead[:1] if per_token else lead
    pdtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="pdtype")
    positions = torch.randint(0, 64, pshape, generator=generator(len(lead) + D)).to(pdtype).to(DEVICE)
    inverse = data.draw(st.booleans(), label="inverse")
    table = data.draw(st.sampled_from([TAB, YTAB]), label="table")
    xv, pv = _view(data, x, "x_view"), _view(data, positions, "positions_view")
    checks = data.draw(st.booleans(), label="checks")
    with validate.checking_values(checks):
        ref = apply_gptj(views(x)[xv], views(positions)[pv], table, inverse, backend="reference")
        got = apply_gptj(
            views(x)[xv],
            views(positions)[pv],
            table,
            inverse,
            backend="triton",
            launch=RopeLaunch(rotate_rows=data.draw(st.sampled_from([4, 16]), label="rows")),
        )
    assert same_bits(got, ref)
    assert same_bits(ref[..., : D - 64], x[..., : D - 64])  # copied bit for bit, NaN payloads included
    nan = ref[..., D - 64 :].isnan()
    assert bool((_bits(ref[..., D - 64 :])[nan] == (NAN16 if dtype == torch.bfloat16 else NAN32)).all())


_BAD = [None, "slot_out_of_range", "duplicate_slot", "position_out_of_range", "kv_non_finite", "block_size"]


@given(data=st.data())
def test_qnorm_rope_kv_insert_every_backend_every_view(data):
    T = data.draw(st.integers(0, 4), label="T")
    H = data.draw(st.integers(0, 3), label="H")
    B = data.draw(st.sampled_from([1, 2, 3, 5, 16]), label="B")
    P = data.draw(st.integers(1, 3), label="P")
    seed = data.draw(st.integers(0, 99), label="seed")
    g = generator(seed)
    n_slots = data.draw(st.integers(0, min(T, P * B)), label="n_slots")
    slots = torch.randperm(P * B, generator=g)[:n_slots]
    slots[torch.rand(n_slots, generator=g) < 0.3] = -1
    slots = slots.to(data.draw(st.sampled_from([torch.int32, torch.int64]), label="slots_dtype"))
    positions = torch.randint(0, 64, (T,), generator=g).to(
        data.draw(st.sampled_from([torch.int32, torch.int64]), label="pos_dtype")
    )
    q = randn((T, H, 512), seed=seed, block=None, octaves=6)
    if data.draw(st.booleans(), label="q_non_finite"):
        q = _poison(data, q, 448)
    kv = randn((T, 512), seed=seed + 1)
    checks = data.draw(st.booleans(), label="checks")
    bad = data.draw(st.sampled_from(_BAD), label="bad") if checks else data.draw(st.sampled_from([None, "kv_non_finite"]))
    block_size = B
    if bad == "slot_out_of_range" and n_slots:
        slots[-1] = P * B
    elif bad == "duplicate_slot" and n_slots >= 2:
        slots[0] = slots[1] = 0
    elif bad == "position_out_of_range" and T:
        positions[0] = 64
    elif bad == "kv_non_finite" and T:
        kv[data.draw(st.integers(0, T - 1)), data.draw(st.integers(0, 511))] = data.draw(st.sampled_from(NON_FINITE))
    elif bad == "block_size":
        block_size = B + 1  # the cache was laid out for B
    cache = random_cache(P, B, seed + 2).cpu()
    names = dict(
        q=_view(data, q, "q_view"),
        kv=_view(data, kv, "kv_view"),
        cache=_view(data, cache, "cache_view"),
        slots=_view(data, slots, "slots_view"),
        positions=_view(data, positions, "pos_view"),
    )
    launch = RopeLaunch(heads_per_prog=data.draw(st.sampled_from([0, 1, 2, 8]), label="hpp"))

    expect_raise = (
        (bad == "slot_out_of_range" and n_slots > 0)
        or (bad == "duplicate_slot" and n_slots >= 2)
        or (bad == "position_out_of_range" and T > 0)
        or bad == "block_size"
        or (bad == "kv_non_finite" and checks and bool((~torch.isfinite(kv[:n_slots].cpu()).all(1) & (slots >= 0)).any()))
        or names["cache"] == "storage_offset"
        or (names["cache"] == "transposed_copy" and P > 1)  # refused layouts
    )

    def run(backend):
        a = {
            k: views(v.clone().to(DEVICE))[names[k]]
            for k, v in dict(q=q, kv=kv, cache=cache, slots=slots, positions=positions).items()
        }
        before = {k: storage_bytes(a[k]) for k in ("q", "kv", "cache")}
        with validate.checking_values(checks):
            res = outcome(
                qnorm_rope_kv_insert,
                a["q"],
                a["kv"],
                a["cache"],
                a["slots"],
                a["positions"],
                TAB,
                block_size=block_size,
                backend=backend,
                launch=launch if backend == "triton" else None,
            )
        assert torch.equal(storage_bytes(a["kv"]), before["kv"]), "kv must never change"
        if res[0] == "raise":
            assert all(torch.equal(storage_bytes(a[k]), before[k]) for k in ("q", "cache")), "a failed call wrote"
        return res, a

    (kind_r, val_r), ref = run("reference")
    (kind_t, val_t), got = run("triton")
    assert kind_r == ("raise" if expect_raise else "ok"), val_r
    assert (kind_t, kind_t == "raise" and val_t) == (kind_r, kind_r == "raise" and val_r)
    if kind_r == "ok":  # the same bits everywhere, gaps of the views included
        assert torch.equal(storage_bytes(got["q"]), storage_bytes(ref["q"]))
        assert torch.equal(storage_bytes(got["cache"]), storage_bytes(ref["cache"]))


# ------------------------------------------------------------------------------------------------
# the probes of the input-contract audit
# ------------------------------------------------------------------------------------------------


def test_probe_apply_gptj_strided_positions():
    """Regression: positions[::2] must not be read as if contiguous by the Triton backend."""
    x = randn((3, 512), seed=1)
    pos = torch.tensor([5, 7, 2, 0, 6, 7], device=DEVICE)[::2]  # 5, 2, 6
    for p in (pos, pos.to(torch.int32)):
        got = apply_gptj(x, p, TAB, backend="triton")
        assert same_bits(got, apply_gptj(x, p, TAB, backend="reference"))
        assert same_bits(got, apply_gptj(x, p.contiguous(), TAB, backend="triton"))
    # one position per (token, head), stored transposed
    x3 = randn((2, 3, 128), seed=2)
    p2 = torch.tensor([[1, 60, 33], [7, 0, 12]], device=DEVICE)
    pt = p2.t().contiguous().t()
    assert same_bits(apply_gptj(x3, pt, TAB, backend="triton"), apply_gptj(x3, p2, TAB, backend="reference"))


def test_probe_qnorm_strided_slots_and_positions():
    """Regression: slots[::2] / positions[::2] must not be read as if contiguous (slots 5, 7, 2 written for 5, 2, 6)."""
    B = 2
    q, kv = randn((3, 2, 512), seed=3), randn((3, 512), seed=4)
    for dt in (torch.int64, torch.int32):
        slots = torch.tensor([5, 7, 2, 0, 6, 7], dtype=dt, device=DEVICE)[::2]
        positions = torch.tensor([9, 1, 40, 2, 63, 3], dtype=dt, device=DEVICE)[::2]
        out = {}
        for backend in ("reference", "triton"):
            qq, cache = q.clone(), kv_cache.allocate(4, B)
            qnorm_rope_kv_insert(qq, kv, cache, slots, positions, TAB, block_size=B, backend=backend)
            out[backend] = qq, cache
        assert same_bits(out["triton"][0], out["reference"][0]) and torch.equal(out["triton"][1], out["reference"][1])
        written = kv_cache.gather(out["triton"][1], torch.arange(8, device=DEVICE), block_size=B).abs().sum(1) > 0
        assert written.nonzero()[:, 0].tolist() == [2, 5, 6]
        q_c = q.clone()
        qnorm_rope_kv_insert(q_c, kv, kv_cache.allocate(4, B), slots.contiguous(), positions.contiguous(), TAB, block_size=B)
        assert same_bits(out["triton"][0], q_c)


def test_positions_near_2_pow_20_int32_and_int64():
    """The model's last positions (2^20 − 1 = the 1M-context end) as int32 and int64, through both backends
    of both rotating ops: a 2^20-row table left unwritten except at the rows used (the OS commits only the
    pages touched; the conformance suite cannot carry a 256 MiB table, so this is where it is checked)."""
    pos = torch.tensor([(1 << 20) - 1, (1 << 20) - 2, 1 << 19], device=DEVICE)
    table = torch.empty((1 << 20, 64), dtype=torch.float32, device=DEVICE)
    table[pos] = rope.cos_sin_rows(pos.cpu(), 64, FLASH.compress_rope_theta, FLASH.yarn).to(DEVICE)
    x, q, kv = randn((3, 2, 512), seed=20), randn((3, 2, 512), seed=21), randn((3, 512), seed=22)
    for p in (pos, pos.to(torch.int32)):
        assert same_bits(apply_gptj(x, p, table, True, backend="triton"), apply_gptj(x, p, table, True, backend="reference"))
        out = {}
        for backend in ("reference", "triton"):
            qq, cache = q.clone(), kv_cache.allocate(1, 3)
            qnorm_rope_kv_insert(
                qq, kv, cache, torch.tensor([2, -1, 0], device=DEVICE, dtype=p.dtype), p, table, block_size=3, backend=backend
            )
            out[backend] = qq, cache
        assert same_bits(out["triton"][0], out["reference"][0]) and torch.equal(out["triton"][1], out["reference"][1])


def _fused_args(**kw):
    a = dict(
        q=randn((2, 2, 512), seed=7),
        kv=randn((2, 512), seed=8),
        cache=kv_cache.allocate(2, 4),
        slots=torch.tensor([0, 5], device=DEVICE),
        positions=torch.tensor([1, 2], device=DEVICE),
        cos_sin=TAB,
        block_size=4,
        eps=1e-6,
    )
    a.update(kw)
    return a


BAD_SCALARS = [
    # (function, kwargs, error class, message prefix)
    ("fused", dict(eps=0.0), ValueError, "eps:"),
    ("fused", dict(eps=-1e-6), ValueError, "eps:"),
    ("fused", dict(eps=float("nan")), ValueError, "eps:"),
    ("fused", dict(eps=float("inf")), ValueError, "eps:"),
    ("fused", dict(eps="1e-6"), TypeError, "eps:"),
    ("fused", dict(eps=True), TypeError, "eps:"),
    ("fused", dict(block_size=0), ValueError, "block_size:"),
    ("fused", dict(block_size=-2), ValueError, "block_size:"),
    ("fused", dict(block_size=4.0), TypeError, "block_size:"),
    ("fused", dict(block_size=True), TypeError, "block_size:"),
    ("fused", dict(block_size=2), ValueError, "cache:"),  # a cache laid out for 4-token pages
    ("fused", dict(block_size=8), ValueError, "cache:"),
    ("fused", dict(launch="fast"), TypeError, "launch:"),
    ("gptj", dict(inverse=1), TypeError, "inverse:"),
    ("gptj", dict(inverse="yes"), TypeError, "inverse:"),
    ("gptj", dict(launch=3), TypeError, "launch:"),
    ("table", dict(max_pos=0), ValueError, "max_pos:"),
    ("table", dict(max_pos=2.5), TypeError, "max_pos:"),
    ("table", dict(max_pos=True), TypeError, "max_pos:"),
    ("table", dict(rope_dim=0), ValueError, "rope_dim:"),
    ("table", dict(rope_dim=63), ValueError, "rope_dim:"),
    ("table", dict(rope_dim=64.0), TypeError, "rope_dim:"),
    ("table", dict(theta=1.0), ValueError, "theta:"),
    ("table", dict(theta=float("nan")), ValueError, "theta:"),
    ("table", dict(theta=float("inf")), ValueError, "theta:"),
    ("table", dict(theta="10000"), TypeError, "theta:"),
    ("table", dict(yarn=[16, 65536, 32, 1]), TypeError, "yarn:"),
    ("table", dict(yarn=dict(factor=16)), ValueError, "yarn:"),
    ("table", dict(yarn=dict(FLASH.yarn, factor=float("nan"))), ValueError, "yarn['factor']:"),
    ("table", dict(yarn=dict(FLASH.yarn, factor=0)), ValueError, "yarn['factor']:"),
    ("table", dict(yarn=dict(FLASH.yarn, original_max_position=-1)), ValueError, "yarn['original_max_position']:"),
    ("table", dict(yarn=dict(FLASH.yarn, beta_fast=float("inf"))), ValueError, "yarn['beta_fast']:"),
    ("table", dict(yarn=dict(FLASH.yarn, beta_slow="1")), TypeError, "yarn['beta_slow']:"),
    ("table", dict(yarn=dict(FLASH.yarn, beta_fast=0.5)), ValueError, "yarn['beta_fast']:"),  # below beta_slow
    ("compressed", dict(ratio=-1), ValueError, "ratio:"),
    ("compressed", dict(ratio=4.0), TypeError, "ratio:"),
    ("compressed", dict(p=-3), ValueError, "p:"),
    ("compressed", dict(p=torch.tensor([3.0])), TypeError, "p:"),
    ("compressed", dict(p=torch.tensor([4, -1])), ValueError, "p:"),
    ("rows", dict(positions=torch.tensor([3, -1])), ValueError, "positions:"),
]


@pytest.mark.parametrize(
    "fn,kw,exc,prefix", BAD_SCALARS, ids=[f"{f}-{next(iter(k))}-{i}" for i, (f, k, *_) in enumerate(BAD_SCALARS)]
)
def test_scalar_arguments_validated(fn, kw, exc, prefix):
    """Every scalar is checked before any work, the error names the argument; a failed call writes nothing."""
    if fn == "fused":
        a = _fused_args(**kw)
        q0, c0 = a["q"].clone(), a["cache"].clone()
        for backend in ("reference", "triton"):
            with pytest.raises(exc) as e:
                qnorm_rope_kv_insert(**a, backend=backend)
            assert str(e.value).startswith(prefix), str(e.value)
            assert same_bits(a["q"], q0) and torch.equal(a["cache"], c0)
        return
    if fn == "gptj":
        call = lambda: apply_gptj(randn((2, 512), seed=9), torch.tensor([0, 1], device=DEVICE), TAB, **kw)  # noqa: E731
    elif fn == "table":
        call = lambda: rope.cos_sin_cache(**{"max_pos": 8, **kw})  # noqa: E731
    elif fn == "compressed":
        call = lambda: rope.compressed_position(**{"p": 7, "ratio": 4, **kw})  # noqa: E731
    else:
        call = lambda: rope.cos_sin_rows(**kw)  # noqa: E731
    with pytest.raises(exc) as e:
        call()
    assert str(e.value).startswith(prefix), str(e.value)


def test_block_size_must_match_the_cache_layout():
    """Regression: a cache laid out for B = 4 used as B = 2 (it holds the bytes, but the scales sit elsewhere)
    must be refused. kv_cache.check_cache refuses it, for the fused writer too."""
    a = _fused_args(cache=kv_cache.allocate(2, 4), block_size=2, slots=torch.tensor([0, 3], device=DEVICE))
    with pytest.raises(ValueError, match=rf"^cache: pages of {page_bytes(4)} bytes do not match block_size=2"):
        qnorm_rope_kv_insert(**a)
    strided = torch.zeros(3, page_bytes(4) + 16, dtype=torch.uint8, device=DEVICE)[:, : page_bytes(4)]
    qnorm_rope_kv_insert(**_fused_args(cache=strided))  # a wider page stride is fine


def test_overlapping_q_refused():
    q = randn((2, 1, 512), seed=10).expand(2, 3, 512)
    with pytest.raises(ValueError, match="^q: an overlapping view"):
        qnorm_rope_kv_insert(**_fused_args(q=q))


def test_q_with_a_strided_last_dim_is_honoured():
    base = randn((2, 512, 2), seed=11)
    out = {}
    for backend in ("reference", "triton"):
        b = base.clone()
        a = _fused_args(q=b.transpose(1, 2))  # q [2, 2, 512] with last stride 2
        qnorm_rope_kv_insert(**a, backend=backend)
        out[backend] = b
    assert same_bits(out["triton"], out["reference"])


# ------------------------------------------------------------------------------------------------
# the non-finite policy (docs/rope.md#non-finite-input)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checks", [True, False])
def test_non_finite_apply_gptj_propagates(checks):
    """Rotation of a NaN is NaN (never an error): both members of its pair; inf·0 (position 0: sin = 0) and
    inf − inf are NaN, inf alone stays ±inf; the dims before the slice are copied."""
    x = torch.zeros(3, 66, dtype=torch.bfloat16, device=DEVICE)
    x[:, 2:] = 1.0
    x[0, 2] = float("nan")
    x[1, 4] = float("inf")
    x[2, 6], x[2, 7] = float("inf"), float("-inf")
    x[0, 0] = float("nan")
    pos = torch.tensor([5, 0, 7], device=DEVICE)
    with validate.checking_values(checks):
        outs = [apply_gptj(x, pos, TAB, backend=b) for b in ("reference", "triton")]
    assert same_bits(outs[0], outs[1])
    o = outs[0]
    assert bool(o[0, 2:4].isnan().all()) and not bool(o[0, 4:].isnan().any()) and bool(o[0, 0].isnan())
    assert o[1, 4].item() == math.inf and bool(o[1, 5].isnan())  # inf·cos 0 − 1·sin 0 = inf; inf·sin 0 = NaN
    assert not bool(torch.isfinite(o[2, 6:8]).any()) and bool(o[2, 6:8].isnan().any())  # ±inf·c ∓ ∞·s: one of them inf − inf
    assert bool((_bits(o[:, 2:])[o[:, 2:].isnan()] == NAN16).all())


def test_non_finite_q_makes_its_head_nan():
    """A NaN in one q head: that head is NaN (canonical bits) on both backends, never an empty-looking row;
    the other heads are what they are without it. No error, checks on or off."""
    q, kv = randn((2, 3, 512), seed=12), randn((2, 512), seed=13)
    q[1, 2, 100] = float("nan")
    out = {}
    for backend, launch in (("reference", None), ("triton", RopeLaunch(0)), ("triton", RopeLaunch(2))):
        for checks in (True, False):
            qq = q.clone()
            with validate.checking_values(checks):
                qnorm_rope_kv_insert(
                    qq,
                    kv,
                    kv_cache.allocate(1, 2),
                    torch.tensor([0, 1], device=DEVICE),
                    torch.tensor([3, 4], device=DEVICE),
                    TAB,
                    block_size=2,
                    backend=backend,
                    launch=launch,
                )
            out[backend, launch, checks] = qq
    ref = out["reference", None, True]
    assert all(same_bits(v, ref) for v in out.values())
    assert bool((_bits(ref[1, 2]) == NAN16).all())
    clean = q.clone()
    clean[1, 2] = 1.0
    qnorm_rope_kv_insert(
        clean,
        kv,
        kv_cache.allocate(1, 2),
        torch.tensor([0, 1], device=DEVICE),
        torch.tensor([3, 4], device=DEVICE),
        TAB,
        block_size=2,
    )
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, 2] = False
    assert same_bits(ref[keep], clean[keep]) and not bool(ref[keep].isnan().any())


def test_non_finite_kv_raises_while_checking():
    """A written kv row with a NaN / inf: ValueError naming kv, before q or the cache changes. The same
    values in a padding row (past len(slots)) or a −1 row are never read: no error."""
    for bad in NON_FINITE:
        kv = randn((3, 512), seed=14)
        kv[1, 200] = bad
        for backend in ("reference", "triton"):
            q, cache = randn((3, 2, 512), seed=15), random_cache(2, 2, 16)
            q0, c0 = q.clone(), cache.clone()
            with pytest.raises(ValueError, match=r"^kv: non-finite values"):
                qnorm_rope_kv_insert(
                    q,
                    kv,
                    cache,
                    torch.tensor([0, 3, 1], device=DEVICE),
                    torch.tensor([1, 2, 3], device=DEVICE),
                    TAB,
                    block_size=2,
                    backend=backend,
                )
            assert same_bits(q, q0) and torch.equal(cache, c0)
            for slots in (torch.tensor([0, -1, 1], device=DEVICE), torch.tensor([0], device=DEVICE)):
                qnorm_rope_kv_insert(
                    q, kv, cache, slots, torch.tensor([1, 2, 3], device=DEVICE), TAB, block_size=2, backend=backend
                )


def test_non_finite_kv_encoded_when_not_checking():
    """Checks off: the cache-writer policy of kv_cache.insert, bit for bit on both backends: the NoPE block
    holding the NaN / inf gets scale byte 255 and e4m3 NaN bytes (0x7F, 0xFF where negative), so the row
    reads back NaN there; the other blocks and rows are the normal encoding."""
    B = 2
    kv = randn((3, 512), seed=17)
    kv[0, 70] = float("nan")  # block 1 of row 0
    kv[1, 5] = float("-inf")  # block 0 of row 1
    kv[2, 449] = float("inf")  # a rotary dim: stored as the rotation gives it
    slots, pos = torch.tensor([3, 0, 1], device=DEVICE), torch.tensor([1, 2, 3], device=DEVICE)
    caches = {}
    with validate.checking_values(False):
        for backend in ("reference", "triton"):
            cache = random_cache(2, B, 18)
            qnorm_rope_kv_insert(randn((3, 1, 512), seed=19), kv, cache, slots, pos, TAB, block_size=B, backend=backend)
            caches[backend] = cache
        want = random_cache(2, B, 18)
        kv_cache.insert(want, apply_gptj(kv, pos, TAB), slots, block_size=B, backend="reference")
        back = kv_cache.gather(caches["triton"], slots, block_size=B)
    assert torch.equal(caches["triton"], caches["reference"]) and torch.equal(caches["reference"], want)
    flat = kv_cache.flat_bytes(caches["triton"])
    data, scales = kv_cache.token_offsets(caches["triton"], slots, B)
    assert flat[scales[0] + 1].item() == 255 and flat[scales[1]].item() == 255
    assert flat[scales[0]].item() != 255 and flat[scales[2] : scales[2] + 7].ne(255).all()
    nope0 = flat[data[0] + 64 : data[0] + 128]
    assert bool(((nope0 == 0x7F) | (nope0 == 0xFF)).all())
    assert bool(back[0, 64:128].isnan().all()) and bool(back[1, :64].isnan().all())
    assert not bool(back[0, :64].isnan().any()) and not bool(back[2, :448].isnan().any())


# ------------------------------------------------------------------------------------------------
# peer disagreement (c): the conformance tolerance accepts every form the spec allows
# ------------------------------------------------------------------------------------------------


def _rotate(y: torch.Tensor, positions, cos_sin, pairs: str) -> torch.Tensor:
    """fp32 rotation of y's last 64 dims, GPT-J (adjacent) or NeoX (half-split) pairs."""
    c, s = cos_sin[positions.long()].chunk(2, dim=-1)
    while c.dim() < y.dim():
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    r = y[..., -64:]
    e, o = (r[..., 0::2].clone(), r[..., 1::2].clone()) if pairs == "gptj" else (r[..., :32].clone(), r[..., 32:].clone())
    out = y.clone()
    a, b = e * c - o * s, e * s + o * c
    if pairs == "gptj":
        out[..., -64::2], out[..., -63::2] = a, b
    else:
        out[..., -64:-32], out[..., -32:] = a, b
    return out


def _port(pairs="gptj", norm=True):
    """A plain-torch qnorm_rope_kv_insert with our signature, in vLLM's reference form: RMSNorm with rsqrt in
    fp32, q rounded to bf16, then the fp32 rotation; kv's last 64 dims rotated in fp32 (dims 0..447 as given:
    a round trip through fp32 could flip a NaN's sign bit, which the cache encoding keeps), written by
    kv_cache.insert."""

    def qnorm_rope_kv_insert_port(q, kv, cache, slots, positions, cos_sin, *, block_size, eps=1e-6):
        x = q.float()
        if norm:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        q.copy_(_rotate(x.to(torch.bfloat16).float(), positions, cos_sin, pairs).to(torch.bfloat16))
        k = kv.clone()
        k[:, -64:] = _rotate(kv.float(), positions, cos_sin, pairs)[:, -64:].to(torch.bfloat16)
        kv_cache.insert(cache, k, slots, block_size=block_size, backend="reference")

    return qnorm_rope_kv_insert_port


def test_conformance_accepts_the_bf16_intermediate_form():
    """vLLM's own reference form, rope(bf16(rmsnorm(q))), passes every case of the suite (q under the row
    "qnorm_rope_q", the cache exact), although it is up to 2^-9·max|pair| off dsv4ref's fp32 form."""
    cases = conformance.all_cases("rope.qnorm_rope_kv_insert")
    rows = conformance.run({"rope.qnorm_rope_kv_insert": _port()}, cases)
    assert len(rows) == 2 * len(cases) >= 12 and all(r.passed for r in rows), conformance.format_report(rows)
    assert {r.report.tol for r in rows if r.output == "q"} == {"qnorm_rope_q"}


def test_the_pair_scaled_row_is_needed():
    """Where the rotation nearly cancels (pair 0 = K·(tan 1, 1) at position 1: output 0 ≈ 0 beside a partner
    of ≈ 19), the bf16-intermediate form is off by up to 0.05: an elementwise bound (the spec's
    1e-2 + 1e-2·|b|) rejects a correct implementation, the pair-scaled row accepts it."""
    from dsv4ref.conformance.rope import pair_max
    from dsv4ref.tolerances import compare

    H = 64
    q = torch.full((1, H, 512), 0.05, device=DEVICE)
    q[0, :, 449] = 6.0
    q[0, :, 448] = 6.0 * math.tan(1.0) + torch.arange(H, device=DEVICE) * 0.02  # 64 near-cancelling variants
    q = q.to(torch.bfloat16)
    exact, port = q.clone(), q.clone()
    args = (
        torch.zeros(1, 512, dtype=torch.bfloat16, device=DEVICE),
        kv_cache.allocate(1, 1),
        torch.tensor([-1], device=DEVICE),
        torch.tensor([1], device=DEVICE),
        TAB,
    )
    qnorm_rope_kv_insert(exact, *args, block_size=1, backend="reference")
    _port()(port, *args, block_size=1)
    assert not compare(port, exact, "bf16_gemm").passed
    assert compare(port, exact, "qnorm_rope_q", mass=pair_max(exact)).passed


@pytest.mark.parametrize("wrong", ["neox_pairs", "no_norm"])
def test_conformance_rejects_wrong_forms(wrong):
    port = _port(pairs="neox") if wrong == "neox_pairs" else _port(norm=False)
    rows = conformance.run({"rope.qnorm_rope_kv_insert": port}, conformance.all_cases("rope.qnorm_rope_kv_insert"))
    bad = [r for r in rows if not r.passed]
    assert bad and all(r.output == "q" or wrong == "neox_pairs" for r in bad)
    assert "minus1_and_short_slots" in {r.case for r in bad if r.output == "q"}
