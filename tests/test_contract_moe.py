"""The input contract of dsv4ref.moe (docs/contract.md#moe): the non-finite policy and no host sync.

* Value checks on (the default): a NaN / ±inf in ``x`` / ``hidden``, a NaN bias, a non-finite routing weight of a
  slot that is read, staged NaN codes / scale byte 255: ``ValueError`` naming the argument, before any write
  (every buffer byte-identical afterwards).
* Value checks off (``DSV4REF_CHECK_VALUES=0``): staging a 32-group holding NaN / ±inf gives the same bytes on
  every backend and every launch variant (scale byte 255, e4m3 0x7F / 0xFF), the experts give NaN where the
  reference does, and route / stage / experts do no host synchronisation (the decode step captures them in a
  device graph): proven by making every syncing call raise while they run.
"""

from __future__ import annotations


import math

import pytest
import torch
from contract import HostSync, no_host_sync, snapshot, unchanged
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4ref import moe, validate
from dsv4ref.device import DEVICE
from dsv4ref.fp8 import reference as fp8_ref
from dsv4ref.moe import reference as ref
from dsv4ref.moe.variants.stage import StageVariant
from dsv4ref.moe.variants.stage import stage_into as variant_stage_into
from dsv4ref.testing import assert_close, compare, generator, poison, randn

pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning"
)

NAN, INF = float("nan"), float("inf")
SHAPE = moe.TINY_MOE  # Hd 256, E 8, K 2, I 128
VARIANTS = {  # staging launches and the variants of dsv4ref.moe.variants.stage: every one writes the reference's bytes
    "tile": moe.MoeLaunch(stage_block_t=2, stage_block_h=512),
    "tile_topk_first": moe.MoeLaunch(stage_block_t=2, stage_block_h=256, stage_topk_first=True),
    "groups": StageVariant(block_t=4, block_h=256, load="groups", encode="blocks"),
    "blocks_tile": StageVariant(block_t=2, block_h=512, encode="blocks"),
    "blocks_tile_persistent_stream": StageVariant(block_t=4, block_h=128, encode="blocks", programs=3, stages=2),
    "groups_persistent_evict": StageVariant(
        block_t=1, block_h=256, load="groups", encode="blocks", programs=5, cache="evict_first"
    ),
    "snap_no_hints": StageVariant(block_t=4, block_h=512, cache=""),
    "snap_persistent": StageVariant(block_t=1, block_h=128, programs=4),
    "snap_prefetch": StageVariant(block_t=2, block_h=128, programs=5, prefetch=True),
    "snap_topk_first_cs": StageVariant(block_t=2, block_h=256, topk_first=True, cache="cs"),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def nonfinite_hidden(T=7, Hd=384) -> torch.Tensor:
    """bf16 [T, Hd] over 24 octaves per 32-group, with NaN / ±inf / −NaN planted in groups of every lane of the
    packed word (and a −1.5 and −0.0 beside them, whose codes must become 0xFF); rows 0 and 6 stay finite."""
    h = randn((T, Hd), seed=31, block=32, octaves=24, device="cpu").float()
    h[1, 3] = NAN  # group 0 (lane 0)
    h[2, 32 + 7] = INF  # lane 1
    h[2, 32 + 8] = -1.5
    h[3, 64 + 1] = -INF  # lane 2
    h[3, 64 + 2] = -0.0
    h[4, 128 + 96 + 31] = -NAN  # lane 3 of word 1: a NaN's own sign is not kept (0x7F)
    h[5, 256:288] = INF  # a whole group of +inf
    h[5, 300] = NAN
    return h.to(torch.bfloat16).to(DEVICE)


def stage_into(backend, hidden, ids, w, launch=None, rows=None):
    """stage_into on poisoned buffers (``rows`` ≥ T of them)."""
    T, Hd = hidden.shape
    N, K = rows or T, ids.shape[1]
    bufs = (
        poison((N, Hd), torch.float8_e4m3fn),
        poison((N, Hd // 128), torch.int32),
        poison((N, K), torch.int64),
        poison((N, K), torch.float32),
    )
    if isinstance(launch, StageVariant):
        variant_stage_into(hidden, ids, w, *bufs, launch)
    else:
        moe.stage_into(hidden, ids, w, *bufs, backend=backend, launch=launch)
    return bufs


def topk(T, K=3, seed=32):
    ids = torch.randint(-1, SHAPE.experts, (T, K), generator=generator(seed)).to(torch.int32).to(DEVICE)
    return ids, torch.rand(T, K, generator=generator(seed + 1)).to(DEVICE)


# ----------------------------------------------------------------------------------------------------
# staging, checks off: the NaN encoding, byte for byte on every backend and launch variant
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stage_nonfinite_groups_same_bytes_everywhere(variant):
    h = nonfinite_hidden()
    ids, w = topk(h.shape[0])
    with validate.checking_values(False):
        want = stage_into("reference", h, ids, w)
        got = stage_into("triton", h, ids, w, VARIANTS[variant])
    for name, g, r in zip(("x_fp8", "x_sf", "ids", "weights"), got, want):
        assert torch.equal(bits(g), bits(r)), f"{variant}: {name}"


def test_stage_nonfinite_group_encoding():
    """The written rule, checked from its definition: a group with a NaN / ±inf gets byte 255 and codes 0x7F
    (0xFF for a non-NaN with its sign bit set); every other group is what staging its finite values gives."""
    h = nonfinite_hidden()
    ids, w = topk(h.shape[0])
    with validate.checking_values(False):
        q, sf, _, _ = stage_into("triton", h, ids, w, VARIANTS["tile"])
    g = h.cpu().float().reshape(h.shape[0], -1, 32)
    bad = ~torch.isfinite(g).all(-1)  # [T, Hd/32]
    assert bad.sum().item() == 6 and not bad[0].any() and not bad[6].any()
    byte = sf.cpu().contiguous().view(torch.uint8).reshape(bad.shape)
    assert torch.equal(byte == 255, bad)
    codes = bits(q).reshape(g.shape)
    assert torch.equal(codes[bad], fp8_ref.e4m3_nan(g[bad]))
    assert codes[2, 1, 8].item() == 0xFF and codes[3, 2, 2].item() == 0xFF and codes[4, 7, 31].item() == 0x7F
    clean = torch.where(bad[..., None], 0.0, g).reshape(h.shape).to(torch.bfloat16)
    q0, sf0, _, _ = moe.stage(clean.to(DEVICE), ids, w, backend="reference")
    keep = ~bad[..., None].expand_as(codes)
    assert torch.equal(codes[keep], bits(q0).reshape(g.shape)[keep])
    assert torch.equal(byte[~bad], bits(sf0).view(torch.uint8).reshape(bad.shape)[~bad])
    deq = ref.dequantize_staged(q, sf).cpu().reshape(g.shape)  # reads back as NaN, never a number
    assert bool(deq[bad].isnan().all()) and not bool(deq[~bad].isnan().any())


# ----------------------------------------------------------------------------------------------------
# checks on: ValueError naming the argument, before any write
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_stage_refuses_nonfinite_hidden_and_leaves_buffers(backend):
    h = nonfinite_hidden()
    ids, w = topk(h.shape[0])
    bufs = (
        poison((9, 384), torch.float8_e4m3fn),
        poison((9, 3), torch.int32),
        poison((9, 3), torch.int64),
        poison((9, 3), torch.float32),
    )
    before = snapshot(h, ids, w, *bufs)
    with validate.checking_values(True):
        with pytest.raises(ValueError, match=r"^hidden: non-finite values"):
            moe.stage_into(h, ids, w, *bufs, backend=backend)
        with pytest.raises(ValueError, match=r"^hidden: non-finite values"):
            moe.stage(h, ids, w, backend=backend)
        with pytest.raises(ValueError, match=r"^hidden: non-finite values"):
            moe.stage(h[2:3], ids[:1], w[:1], backend=backend)  # a lone +inf
    assert unchanged(before, h, ids, w, *bufs)
    with validate.checking_values(True):  # a finite input still stages (the check is not a blanket refusal)
        moe.stage_into(h[6:], ids[6:], w[6:], *bufs, backend=backend)
    assert not unchanged(before[3:], *bufs)


def test_route_refuses_nonfinite_x_and_nan_bias():
    d = moe.example_inputs(5, SHAPE, seed=33)
    x = d["x"].clone()
    x[3, 17] = -INF
    with validate.checking_values(True):
        with pytest.raises(ValueError, match=r"^x: non-finite values"):
            moe.route(x, d["gate_weight"], d["bias"], k=2, routed_scale=1.5)
        bias = d["bias"].clone()
        bias[4] = NAN
        with pytest.raises(ValueError, match=r"^bias: NaN at index \(4,\)"):
            moe.route(d["x"], d["gate_weight"], bias, k=2, routed_scale=1.5)
        bias[4] = -INF  # −inf: "never select" is a meaning, so it is allowed
        ids, w = moe.route(d["x"], d["gate_weight"], bias, k=2, routed_scale=1.5)
    assert not (ids == 4).any() and bool(torch.isfinite(w).all())


def test_experts_refuse_nonfinite_inputs_and_leave_out():
    d = moe.example_inputs(6, SHAPE, seed=34, octaves=12)
    ids, w = moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=1.5)
    staged = moe.stage(d["x"], ids, w, backend="reference")
    sw = (d["w13"], d["w2"], d["shared_w13"], d["shared_w2"])

    def call(x=d["x"], q=staged[0], sf=staged[1], i=staged[2], ww=staged[3], out=None):
        return moe.experts(x, q, sf, i, ww, *sw, swiglu_limit=10.0, out=out, backend="triton")

    bad_w = staged[3].clone()
    bad_w[2, 1] = NAN
    bad_q = staged[0].view(torch.uint8).clone()
    bad_q[4, 200] = 0xFF
    bad_sf = staged[1].clone()
    bad_sf.view(torch.uint8)[1, 5] = 255
    bad_x = d["x"].clone()
    bad_x[0, 0] = INF
    out = poison((6, SHAPE.hidden), torch.bfloat16)
    before = snapshot(out, *staged, d["x"])
    with validate.checking_values(True):
        for kw, msg in (
            (dict(ww=bad_w), r"^weights: non-finite value nan at \(2, 1\)"),
            (dict(q=bad_q.view(torch.float8_e4m3fn)), r"^x_fp8: e4m3 NaN codes"),
            (dict(sf=bad_sf), r"^x_sf: scale byte 255 \(E8M0 NaN\) in row 1, group 5"),
            (dict(x=bad_x), r"^x: non-finite values"),
        ):
            with pytest.raises(ValueError, match=msg):
                call(out=out, **kw)
            assert unchanged(before, out, *staged, d["x"]), msg
        ids_pad = staged[2].clone()
        ids_pad[2, 1] = -1  # the NaN weight of a −1 slot is never read: allowed
        call(i=ids_pad, ww=bad_w, out=out)
    assert bool(torch.isfinite(out.float()).all())


# ----------------------------------------------------------------------------------------------------
# checks off: the experts and the router propagate NaN as the reference does
# ----------------------------------------------------------------------------------------------------


def test_experts_nonfinite_checks_off_match_the_reference():
    """Row 1: a NaN group (staged as byte 255 / 0x7F) → NaN row; row 2: +inf in x with no routed slot → the
    shared expert's IEEE answer on inf; row 3: a NaN routing weight → NaN row; row 4: NaN weight on a −1 slot
    → nothing. Kernel and reference agree on every non-finite position, finite rows to the tolerance."""
    d = moe.example_inputs(6, SHAPE, seed=35, octaves=12, weight_gain=2.0)
    x = d["x"].clone()
    x[1, 70] = NAN
    x[2, 3] = INF
    ids, w = moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=1.5)
    ids[2] = -1
    w[3, 0] = NAN
    ids[4, 1], w[4, 1] = -1, NAN
    sw = (d["w13"], d["w2"], d["shared_w13"], d["shared_w2"])
    with validate.checking_values(False):
        staged = moe.stage(x, ids, w, backend="triton")
        out = poison((6, SHAPE.hidden), torch.bfloat16)
        moe.experts(x, *staged, *sw, swiglu_limit=10.0, out=out, backend="triton")
        want32 = moe.experts(x, *staged, *sw, swiglu_limit=10.0, backend="reference")
    want = ref.experts(x, *staged, *sw, swiglu_limit=10.0, dtype=torch.float64)
    mass = ref.experts(x, *staged, *sw, swiglu_limit=10.0, dtype=torch.float64, mass=True)
    nan_rows = out.float().isnan().all(-1).cpu()
    assert nan_rows.tolist() == [False, True, True, True, False, False]  # row 2: some a = −inf → silu NaN → whole row
    assert_close(out, want, "moe_out", "checks off", mass=mass.nan_to_num(0.0))
    assert torch.equal(bits(out), bits(want32)), "kernel and float32 reference: the same bits where NaN"
    assert set(bits(out)[nan_rows].flatten().tolist()) == {0x7FC0}


def test_route_nonfinite_rows_get_nan_weights_checks_off():
    d = moe.example_inputs(5, SHAPE, seed=36)
    x = d["x"].clone()
    x[1, 9] = NAN
    x[3, 0] = INF
    with validate.checking_values(False):
        ids, w = moe.route(x, d["gate_weight"], d["bias"], k=2, routed_scale=1.5)
        good_ids, good_w = moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=1.5)
        nan_bias = d["bias"].clone()
        nan_bias[0] = NAN
        _, wb = moe.route(d["x"], d["gate_weight"], nan_bias, k=2, routed_scale=1.5)
        pad = torch.tensor([0, 1, 2, -1, 4], device=DEVICE)
        ids_p, w_p = moe.route(x, d["gate_weight"], d["bias"], k=2, routed_scale=1.5, input_ids=pad)
    assert w.isnan().all(-1).tolist() == [False, True, False, True, False]
    keep = [0, 2, 4]
    assert torch.equal(ids[keep], good_ids[keep]) and torch.equal(bits(w[keep]), bits(good_w[keep]))
    assert bool(wb.isnan().all())
    assert (ids_p[3] == -1).all() and (w_p[3] == 0).all() and bool(w_p[1].isnan().all())  # padding wins


# ----------------------------------------------------------------------------------------------------
# checks off: no host synchronisation in route / stage / experts
# ----------------------------------------------------------------------------------------------------


# The guard is the one the decode-graph tests use (tests/contract.py): the Python entry points of a host sync
# raise when called from dsv4ref code. (An earlier, global guard here also raised on calls from torch's own
# code and failed on the H200 while the same route/stage/experts ran inside a captured decode graph.)


def test_the_no_sync_guard_can_fail():
    """The guard catches the syncs it is meant to: the checked path (checks on) syncs, so it must raise."""
    d = moe.example_inputs(3, SHAPE, seed=37)
    probes = (
        "x.sum().item()",
        "bool(x.isnan().any())",
        "torch.where(x > 0)",
        "x[x > 0]",
        "int(bias.argmax())",
        "torch.tensor([0, 3], device=x.device)",
    )
    for probe in probes:
        with no_host_sync([]), pytest.raises(HostSync):  # run as if from a dsv4ref module
            exec(probe, {"__name__": "dsv4ref.probe", "torch": torch, "x": d["x"], "bias": d["bias"]})
    with no_host_sync([]), validate.checking_values(True), pytest.raises(HostSync):
        moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=1.5)


@pytest.mark.parametrize("hash_layer", [False, True])
def test_route_stage_experts_do_not_sync_with_checks_off(hash_layer):
    """route → stage → experts (triton) under the guard, against the reference computed outside it. T·K = 18
    slots on 8 experts with block_m 16: the tile table has programs past the real tiles (expert E: no work)."""
    T = 9
    d = moe.example_inputs(T, moe.MoeShape(256, 8, 2, 128, 1.5, 10.0, 1), seed=38, octaves=12, hash_layer=hash_layer)
    input_ids = d["input_ids"].clone() if hash_layer else torch.arange(T, device=DEVICE)
    input_ids[5] = -1  # a padding row
    x = d["x"].clone()
    x[7, 11] = NAN  # a non-finite row, staged with the NaN encoding
    sw = (d["w13"], d["w2"], d["shared_w13"], d["shared_w2"])
    rk = dict(k=2, routed_scale=1.5, hash_table=d["hash_table"], input_ids=input_ids)
    launch = moe.MoeLaunch(
        stage_block_t=4, stage_block_h=128, block_m=16, block_n=64, block_h=128, block_k=128, expert_stages=2, combine_block_t=16
    )  # tiles that fit a GPU's shared memory
    with validate.checking_values(False):
        ids_r, w_r = moe.route(x, d["gate_weight"], d["bias"], **rk)
        staged_r = moe.stage(x, ids_r, w_r, backend="reference")
        want = moe.experts(x, *staged_r, *sw, swiglu_limit=10.0, backend="reference")
        staged = tuple(poison(tuple(t.shape), t.dtype) for t in staged_r)
        out = poison((T, 256), torch.bfloat16)
        with no_host_sync([]):
            ids, w = moe.route(x, d["gate_weight"], d["bias"], **rk)
            moe.stage_into(x, ids, w, *staged, backend="triton", launch=launch)
            moe.experts(x, *staged, *sw, swiglu_limit=10.0, out=out, backend="triton", launch=launch)
    assert torch.equal(ids, ids_r) and torch.equal(bits(w), bits(w_r))
    for name, g, r in zip(("x_fp8", "x_sf", "ids", "weights"), staged, staged_r):
        assert torch.equal(bits(g), bits(r)), name
    want64 = ref.experts(x, *staged_r, *sw, swiglu_limit=10.0, dtype=torch.float64)
    mass = ref.experts(x, *staged_r, *sw, swiglu_limit=10.0, dtype=torch.float64, mass=True)
    assert_close(out, want64, "moe_out", "no-sync path", mass=mass.nan_to_num(0.0))
    assert compare(want, want64, "moe_out", mass=mass.nan_to_num(0.0)).passed
    assert bool(out[7].float().isnan().all()) and not bool(out[:7].float().isnan().any())


# ----------------------------------------------------------------------------------------------------
# indices and scalars: out-of-range ids never read outside the weights; every backend the same answer or
# the same error; scalars checked by name before any work
# ----------------------------------------------------------------------------------------------------


def _experts(d, staged, ids, backend, E=None, out=None, shared=True):
    w13, w2 = (d["w13"], d["w2"]) if E is None else (d["w13"][:E], d["w2"][:E])
    return moe.experts(
        d["x"],
        staged[0],
        staged[1],
        ids,
        staged[3],
        w13,
        w2,
        d["shared_w13"] if shared else None,
        d["shared_w2"] if shared else None,
        swiglu_limit=10.0,
        out=out,
        backend=backend,
    )


def _poisoned_empty(monkeypatch):
    """Every float buffer the op allocates with ``torch.empty`` starts as NaN (its workspaces too), so a row the
    kernels never wrote cannot pass for a zero row because the allocator happened to hand out zeroed memory."""
    empty = torch.empty

    def poisoned(*shape, **kw):
        t = empty(*shape, **kw)
        return t.fill_(math.nan) if t.dtype.is_floating_point and t.dtype.itemsize > 1 else t

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_expert_ids_outside_the_range_count_as_minus_one_with_checks_off(backend, monkeypatch):
    """An id == E once gave 3.0e38 in row 0 (a slot row never written, read by the combine), ids > E a scatter
    error: now any id outside [0, E) contributes exactly 0, as −1 does, on every backend. The workspaces are
    NaN-poisoned: the slot row of an out-of-range id is never written, and reading it must show."""
    d = moe.example_inputs(4, SHAPE, seed=40)
    E = SHAPE.experts
    ids = torch.tensor([[E, 1], [0, E + 5], [-1, 2], [-7, 3]], dtype=torch.int64, device=DEVICE)
    w = torch.full((4, 2), 0.75, device=DEVICE)
    staged = moe.stage(d["x"], ids, w, backend="reference")
    clean = torch.where((ids >= 0) & (ids < E), ids, -1)
    out = poison((4, SHAPE.hidden), torch.bfloat16)
    _poisoned_empty(monkeypatch)
    with validate.checking_values(False):
        got = _experts(d, staged, ids, backend, out=out)
        want = _experts(d, staged, clean, backend)
    assert torch.equal(bits(got), bits(want))
    with pytest.raises(ValueError, match=r"^ids: entry \(0, 0\) = 8 is out of range"):
        _experts(d, staged, ids, backend)


@settings(max_examples=4)
@given(T=st.integers(1, 5), K=st.integers(1, 3), data=st.data())
def test_property_out_of_range_ids_are_minus_one_on_every_backend(T, K, data):
    E = SHAPE.experts
    d = moe.example_inputs(T, SHAPE, seed=41)
    flat = data.draw(st.lists(st.integers(-3, E + 3), min_size=T * K, max_size=T * K))
    ids = torch.tensor(flat, dtype=torch.int64, device=DEVICE).view(T, K)
    w = torch.rand(T, K, generator=generator(42)).to(DEVICE)
    staged = moe.stage(d["x"], ids, w, backend="reference")  # the experts' input; staging has its own tests
    clean = torch.where((ids >= 0) & (ids < E), ids, -1)
    with validate.checking_values(False):  # routed experts only: an out-of-range id is the routed slots' business
        for be in ("reference", "triton"):
            got, want = (_experts(d, staged, i, be, shared=False) for i in (ids, clean))
            assert torch.equal(bits(got), bits(want)), be


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_no_experts_and_no_slots_work_on_every_backend(backend):
    """E = 0 with every id −1, and K = 0 slots: the shared expert alone, the same on both backends (the
    Triton path once raised an InterpreterError on both)."""
    d = moe.example_inputs(3, SHAPE, seed=43)
    ids = torch.full((3, 2), -1, dtype=torch.int64, device=DEVICE)
    w = torch.ones(3, 2, device=DEVICE)
    staged = moe.stage(d["x"], ids, w, backend=backend)
    got = _experts(d, staged, ids, backend, E=0)
    want = _experts(d, staged, ids, "reference")  # every slot −1: the shared expert alone
    assert_close(got, want, "bf16_out", backend)
    q, sf, i64, w32 = moe.stage(d["x"], ids[:, :0], w[:, :0], backend=backend)
    rq, rsf, _, _ = moe.stage(d["x"], ids[:, :0], w[:, :0], backend="reference")
    assert i64.shape == (3, 0) and w32.shape == (3, 0)
    assert torch.equal(bits(q), bits(rq)) and torch.equal(sf, rsf)
    got0 = moe.experts(
        d["x"], q, sf, i64, w32, d["w13"], d["w2"], d["shared_w13"], d["shared_w2"], swiglu_limit=10.0, backend=backend
    )
    assert_close(got0, want, "bf16_out", backend)


BAD_SCALARS = [(NAN, ValueError), (INF, ValueError), (-1.5, ValueError), ("1.5", TypeError), (True, TypeError), (None, TypeError)]


@pytest.mark.parametrize("value, err", BAD_SCALARS)
def test_routed_scale_must_be_a_finite_number_at_least_zero(value, err):
    d = moe.example_inputs(3, SHAPE, seed=44)
    with pytest.raises(err, match="^routed_scale:"):
        moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=value)
    out = poison((3, SHAPE.hidden), torch.bfloat16)
    before = snapshot(out)
    for be in ("reference", "triton"):  # forward once blamed `weights`, an argument it does not take
        with pytest.raises(err, match="^routed_scale:"):
            moe.forward(
                d["x"],
                d["gate_weight"],
                d["bias"],
                d["w13"],
                d["w2"],
                d["shared_w13"],
                d["shared_w2"],
                k=2,
                routed_scale=value,
                swiglu_limit=10.0,
                out=out,
                backend=be,
            )
    assert unchanged(before, out)


@pytest.mark.parametrize("value, err", [v for v in BAD_SCALARS if v[0] != -1.5] + [("10", TypeError)])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_swiglu_limit_must_be_a_finite_number(value, err, backend):
    """NaN once switched the clamp off silently; ≤ 0 switching it off is the documented rule."""
    d = moe.example_inputs(3, SHAPE, seed=45)
    ids, w = moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=1.5)
    staged = moe.stage(d["x"], ids, w, backend="reference")
    out = poison((3, SHAPE.hidden), torch.bfloat16)
    before = snapshot(out)
    with pytest.raises(err, match="^swiglu_limit:"):
        moe.experts(
            d["x"], *staged, d["w13"], d["w2"], d["shared_w13"], d["shared_w2"], swiglu_limit=value, out=out, backend=backend
        )
    with pytest.raises(err, match="^swiglu_limit:"):
        moe.forward(
            d["x"],
            d["gate_weight"],
            d["bias"],
            d["w13"],
            d["w2"],
            d["shared_w13"],
            d["shared_w2"],
            k=2,
            routed_scale=1.5,
            swiglu_limit=value,
            out=out,
            backend=backend,
        )
    assert unchanged(before, out)


@pytest.mark.parametrize("k, err", [(2.0, TypeError), (True, TypeError), (0, ValueError), (9, ValueError)])
def test_k_must_be_an_int_in_range(k, err):
    d = moe.example_inputs(3, SHAPE, seed=46)
    with pytest.raises(err, match="^k:"):
        moe.route(d["x"], d["gate_weight"], d["bias"], k=k, routed_scale=1.5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_forward_names_the_argument_at_fault(backend):
    d = moe.example_inputs(3, SHAPE, seed=47)
    args = [d["x"], d["gate_weight"], d["bias"], d["w13"], d["w2"], d["shared_w13"], d["shared_w2"]]
    kw = dict(k=2, routed_scale=1.5, swiglu_limit=10.0, backend=backend)
    out = poison((3, SHAPE.hidden), torch.bfloat16)
    before = snapshot(out)
    half = [a[:4] if i in (3, 4) else a for i, a in enumerate(args)]  # gate over 8 experts, w13 / w2 of 4
    with pytest.raises(ValueError, match="^w13: holds 4 experts, but gate_weight routes over 8"):
        moe.forward(*half, out=out, **kw)
    with pytest.raises(TypeError, match="^w13: expected a torch.Tensor"):
        moe.forward(*args[:3], None, *args[4:], out=out, **kw)
    narrow = [args[0][:, :200], args[1][:, :200]] + args[2:]
    with pytest.raises(ValueError, match="^x: the hidden size must be a multiple of 128"):
        moe.forward(*narrow, **kw)
    assert unchanged(before, out)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_meta_tensors_are_refused_by_name(backend):
    d = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in moe.example_inputs(3, SHAPE).items()}
    ids = torch.zeros(3, 2, dtype=torch.int64, device="meta")
    w = torch.zeros(3, 2, device="meta")
    with pytest.raises(ValueError, match="^x: tensors on the meta device cannot be run"):
        moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=1.5)
    with pytest.raises(ValueError, match="^hidden: tensors on the meta device cannot be run"):
        moe.stage(d["x"], ids, w, backend=backend)
    q = torch.zeros(3, SHAPE.hidden, dtype=torch.float8_e4m3fn, device="meta")
    sf = torch.zeros(3, SHAPE.hidden // 128, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="^x: tensors on the meta device cannot be run"):
        moe.experts(d["x"], q, sf, ids, w, d["w13"], d["w2"], d["shared_w13"], d["shared_w2"], swiglu_limit=10.0, backend=backend)
    with pytest.raises(ValueError, match="^x: tensors on the meta device cannot be run"):
        moe.forward(
            d["x"],
            d["gate_weight"],
            d["bias"],
            d["w13"],
            d["w2"],
            d["shared_w13"],
            d["shared_w2"],
            k=2,
            routed_scale=1.5,
            swiglu_limit=10.0,
            backend=backend,
        )
