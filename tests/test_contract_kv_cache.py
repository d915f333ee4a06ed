"""The input contract of dsv4ref.kv_cache (docs/kv_cache.md#the-input-contract).

Every backend writes / reads the reference's bytes or raises the same error class naming the argument,
before any byte is written; slot lists are read as views (int32 or int64); a cache is accepted only
with the page width of the block size it is used with; a written row holding a NaN or ±inf raises while
value checks are on and, with them off, becomes scale byte 255 + e4m3 NaN codes on every backend; the
reader decodes scale bytes 0 and 255 as E8M0 defines them.
"""

import pytest
import torch
from contract import outcome, snapshot, unchanged, views
from hypothesis import given
from hypothesis import strategies as st

from dsv4ref import kv_cache as kc
from dsv4ref import validate
from dsv4ref.device import DEVICE
from dsv4ref.testing import generator, randn

pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning"
)

BACKENDS = ("reference", "triton")
NAN, INF = float("nan"), float("inf")


def random_cache(pages: int, B: int, seed: int) -> torch.Tensor:
    """Random bytes everywhere: every e4m3 code (NaN too), every scale byte (0 and 255 too), any RoPE bits."""
    n = pages * kc.page_bytes(B)
    return (
        torch.randint(0, 256, (n,), generator=generator(seed), dtype=torch.int64)
        .to(torch.uint8)
        .view(pages, kc.page_bytes(B))
        .to(DEVICE)
    )


def i16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().view(torch.int16)


def run_insert(cache, *args, **kwargs):
    """Insert into a copy of ``cache`` on every backend: all write the same bytes or all raise the same error
    class leaving the copy byte-identical. Returns (outcome kind, the reference's cache)."""
    res = {}
    for b in BACKENDS:
        c = cache.clone() if cache.is_contiguous() else cache  # views: the same view object, restored below
        before = snapshot(c)
        kind, val = outcome(kc.insert, c, *args, backend=b, **kwargs)
        res[b] = (kind, val if kind == "raise" else c.clone())
        if kind == "raise":
            assert unchanged(before, c), f"{b}: a failed insert wrote to the cache"
        if not cache.is_contiguous():
            c.copy_(before[0])
    assert len({r[0] for r in res.values()}) == 1, res
    if res["reference"][0] == "raise":
        assert len({r[1] for r in res.values()}) == 1, res
    else:
        assert torch.equal(res["reference"][1].cpu(), res["triton"][1].cpu())
    return res["reference"]


def run_gather(cache, slots, **kwargs):
    got = {b: outcome(kc.gather, cache, slots, backend=b, **kwargs) for b in BACKENDS}
    assert len({g[0] for g in got.values()}) == 1, got
    if got["reference"][0] == "raise":
        assert len({g[1] for g in got.values()}) == 1, got
    else:
        assert torch.equal(i16(got["reference"][1]), i16(got["triton"][1]))
    return got["reference"]


# ----------------------------------------------------------------------------------------------------
# the probes of the input-contract audit
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_probe_gather_strided_slots(dtype):
    """Was: a segfault (int64) / slot 7 for slot 2 and data for −1 (int32) on Triton."""
    B = 2
    cache = kc.allocate(4, B)
    kc.insert(cache, randn((8, 512), seed=1), torch.arange(8, device=DEVICE), block_size=B)
    slots = torch.tensor([5, 10**6, 2, 10**6, -1, 10**6], dtype=dtype, device=DEVICE)[::2]
    kind, out = run_gather(cache, slots, block_size=B)
    assert kind == "ok"
    want = kc.gather(cache, torch.tensor([5, 2, -1], device=DEVICE), block_size=B, backend="reference")
    assert torch.equal(i16(out), i16(want)) and bool((i16(out)[2] == 0).all())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_probe_insert_strided_slots(dtype):
    """Was: slots 5, 7, 2 written instead of 5, 2, 6."""
    B = 2
    kv = randn((3, 512), seed=2)
    slots = torch.tensor([5, 7, 2, 0, 6, 7], dtype=dtype, device=DEVICE)[::2]
    kind, got = run_insert(random_cache(4, B, 3), kv, slots, block_size=B)
    want = random_cache(4, B, 3)
    kc.insert(want, kv, torch.tensor([5, 2, 6], device=DEVICE), block_size=B, backend="reference")
    assert kind == "ok" and torch.equal(got.cpu(), want.cpu())


def test_probe_nan_row_raises_while_checks_are_on_and_writes_nothing():
    B = 2
    kv = randn((3, 512), seed=4)
    kv[1, 70] = NAN
    for b in BACKENDS:
        cache = random_cache(2, B, 5)
        before = snapshot(cache)
        with validate.checking_values(True), pytest.raises(ValueError, match=r"^kv: non-finite values .* row 1"):
            kc.insert(cache, kv, torch.tensor([0, 3, 1], device=DEVICE), block_size=B, backend=b)
        assert unchanged(before, cache)
        # a NaN in a row that is not written (−1 or padding) is not an error
        kc.insert(cache, kv, torch.tensor([0, -1, 1], device=DEVICE), block_size=B, backend=b)
        kc.insert(cache, kv, torch.tensor([0], device=DEVICE), block_size=B, backend=b)


def test_probe_nan_and_inf_encode_as_nan_with_checks_off():
    """Was: reference byte 254 + zeroed block, Triton a finite 3.5 (NaN) and −inf (+inf). Now: the block holding
    the NaN / inf gets scale byte 255 and NaN codes (sign kept), on both; the RoPE bits are copied; the
    other blocks and rows are the finite encoding; gather reads exactly those blocks back as NaN."""
    B = 2
    kv = randn((2, 512), seed=6)
    kv[0, 64 + 3] = NAN
    kv[0, 320 + 1] = -INF
    kv[1, 448 + 2] = INF  # RoPE: stored as given
    kv[1, 10] = -NAN
    with validate.checking_values(False):
        kind, cache = run_insert(kc.allocate(2, B), kv, torch.tensor([3, 0], device=DEVICE), block_size=B)
    assert kind == "ok"
    page0, page1 = cache.cpu()
    scales_row0 = page1[576 * B + 8 : 576 * B + 16]  # slot 3 = page 1, offset 1
    scales_row1 = page0[576 * B : 576 * B + 8]  # slot 0
    assert (scales_row0 == 255).tolist() == [False, True, False, False, False, True, False, False]
    assert scales_row0[7] == 0
    assert scales_row1[0] == 255 and int((scales_row1[:7] == 255).sum()) == 1
    data0 = page1[576:1152]
    sign = torch.signbit(kv[0, 320:384].float().cpu()).to(torch.uint8) << 7  # no NaN in this block: −inf, finite
    assert bool((data0[64:128] & 0x7F == 0x7F).all()) and data0[64 + 3] == 0x7F and torch.equal(data0[320:384], sign | 0x7F)
    assert page0[10] == 0x7F  # a NaN's own sign bit is not kept
    assert torch.equal(page0[448:576], kv[1, 448:].cpu().contiguous().view(torch.uint8))  # RoPE inf copied
    with validate.checking_values(False):
        kind, out = run_gather(cache, torch.tensor([3, 0, -1], device=DEVICE), block_size=B)
    nan = out.cpu().float().isnan()
    assert nan[0, 64:128].all() and nan[0, 320:384].all() and int(nan[0].sum()) == 128
    assert nan[1, :64].all() and int(nan[1].sum()) == 64 and out[1, 450].item() == INF


def test_probe_gather_reads_scale_bytes_0_and_255():
    """E8M0 byte 0 is 2^-127 (was 0), 255 is NaN (was inf), as FlashMLA's and vLLM's readers have it."""
    B = 2
    cache = kc.allocate(1, B)
    cache[0, :448] = 0x38  # token 0: every e4m3 code 1.0
    cache[0, 576 * B : 576 * B + 7] = torch.tensor([0, 255, 127, 1, 254, 0, 255], dtype=torch.uint8)
    kind, out = run_gather(cache, torch.tensor([0], device=DEVICE), block_size=B)
    o = out.cpu()[0].float()
    assert torch.equal(o[:64], torch.full((64,), 2.0**-127)) and torch.equal(o[320:384], torch.full((64,), 2.0**-127))
    assert bool(o[64:128].isnan().all()) and bool(o[384:448].isnan().all())
    assert set(i16(out)[0, 64:128].tolist()) == {0x7FC0}  # the quiet NaN, on every device
    assert o[128].item() == 1.0 and o[192].item() == 2.0**-126 and o[256].item() == 2.0**127


def test_probe_layout_mismatch_is_refused():
    """Was: insert(allocate(2, 4), kv, arange(4), block_size=2) accepted, a later gather garbage."""
    kv = randn((4, 512), seed=7)
    cache = kc.allocate(2, 4)
    for b in BACKENDS:
        before = snapshot(cache)
        with pytest.raises(ValueError, match=r"^cache: pages of 2880 bytes do not match block_size=2 .*page_bytes\(4\)"):
            kc.insert(cache, kv, torch.arange(4, device=DEVICE), block_size=2, backend=b)
        assert unchanged(before, cache)
        with pytest.raises(ValueError, match=r"^cache: pages of 2880 bytes"):
            kc.gather(cache, torch.arange(4, device=DEVICE), block_size=2, backend=b)
        with pytest.raises(ValueError, match=r"^cache: pages of 1728 bytes cannot hold block_size=4"):
            kc.gather(kc.allocate(2, 2), torch.arange(4, device=DEVICE), block_size=4, backend=b)
    # a wider page stride is fine (a view of a bigger buffer); a wider page is not
    big = torch.zeros(2, 4000, dtype=torch.uint8, device=DEVICE)
    kc.insert(big[:, : kc.page_bytes(2)], kv, torch.arange(4, device=DEVICE), block_size=2)
    with pytest.raises(ValueError, match=r"^cache: pages of 4000 bytes do not match block_size=2"):
        kc.gather(big, torch.arange(4, device=DEVICE), block_size=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_errors_name_the_argument(backend):
    B = 2
    cache = kc.allocate(2, B)
    kv = randn((4, 512), seed=8)
    s = torch.arange(4, device=DEVICE)
    before = snapshot(cache)
    for bad, err in [(-2, ValueError), (0, ValueError), (2.0, TypeError), (True, TypeError), ("2", TypeError)]:
        with pytest.raises(err, match=r"^block_size: expected an int"):
            kc.insert(cache, kv, s, block_size=bad, backend=backend)  # was: a message about slot_mapping
        with pytest.raises(err, match=r"^block_size: expected an int"):
            kc.gather(cache, s, block_size=bad, backend=backend)
    with pytest.raises(ValueError, match=r"^slots: 1 appears more than once"):
        kc.insert(cache, kv, torch.tensor([1, -1, -1, 1], device=DEVICE), block_size=B, backend=backend)
    with pytest.raises(TypeError, match=r"^launch: expected a KVCacheLaunch"):
        kc.insert(cache, kv, s, block_size=B, backend=backend, launch=8)
    assert unchanged(before, cache)
    kc.gather(cache, torch.tensor([1, 1, -1, -1], device=DEVICE), block_size=B, backend=backend)  # readers: repeats are fine


def test_probe_allocate_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^num_blocks: expected an int >= 0, got -1"):
        kc.allocate(-1, 2)  # was a raw torch error
    with pytest.raises(TypeError, match=r"^num_blocks: expected an int, got float 2.5"):
        kc.allocate(2.5, 2)
    with pytest.raises(ValueError, match=r"^block_size: expected an int >= 1"):
        kc.allocate(2, 0)
    with pytest.raises(TypeError, match=r"^block_size: expected an int"):
        kc.allocate(2, 2.0)
    assert tuple(kc.allocate(0, 3).shape) == (0, kc.page_bytes(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_strided_slots_past_2_pow_31(backend):
    """int32 slots read through a strided view, a page stride of 1 MiB: page 2100 starts past 2^31 bytes,
    so slot · stride must be int64 on both paths (torch.empty maps only the pages touched)."""
    B, n, stride = 2, 2100, 1 << 20
    buf = torch.empty((n - 1) * stride + kc.page_bytes(B), dtype=torch.uint8, device=DEVICE)
    cache = buf.as_strided((n, kc.page_bytes(B)), (stride, 1))
    last = (n - 1) * B + 1
    slots = torch.tensor([last, 0, 3, 0, -1, 0, last - 1], dtype=torch.int32, device=DEVICE)[::2]
    for p in (1, n - 1):
        cache[p].fill_(0xAB)
    kv = randn((4, 512), seed=9)
    kc.insert(cache, kv, slots, block_size=B, backend=backend)
    small = torch.full((2, kc.page_bytes(B)), 0xAB, dtype=torch.uint8, device=DEVICE)
    local = torch.tensor([1, 3, -1, 0], device=DEVICE)
    kc.insert(small, kv, local, block_size=B, backend="reference")
    assert torch.equal(cache[n - 1].cpu(), small[0].cpu()) and torch.equal(cache[1].cpu(), small[1].cpu())
    got = kc.gather(cache, slots, block_size=B, backend=backend)
    assert torch.equal(i16(got), i16(kc.gather(small, local, block_size=B, backend="reference")))


# ----------------------------------------------------------------------------------------------------
# property-based: every backend = the reference on views, int32/int64, −1s, NaN/inf, checks on and off
# ----------------------------------------------------------------------------------------------------

LAYOUTS = ("contiguous", "every_other_row", "storage_offset", "transposed_copy")


@st.composite
def slot_lists(draw, n_slots, max_len, distinct):
    n = draw(st.integers(0, max_len))
    if distinct:
        pick = draw(st.permutations(range(n_slots)))[:n] if n_slots else []
        vals = list(pick) + [-1] * (n - len(pick))
        order = draw(st.permutations(range(n)))
        vals = [vals[i] for i in order]
    else:
        vals = draw(st.lists(st.integers(-1, max(n_slots - 1, -1)), min_size=n, max_size=n))
    return vals


@given(
    data=st.data(),
    B=st.sampled_from([1, 2, 3, 16, 61]),
    pages=st.integers(0, 3),
    dtype=st.sampled_from([torch.int64, torch.int32]),
    s_layout=st.sampled_from(LAYOUTS[:3]),
    kv_layout=st.sampled_from(LAYOUTS),
    cache_layout=st.sampled_from(LAYOUTS),
    extra_rows=st.integers(0, 2),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([NAN, -NAN, INF, -INF])), max_size=2),
    checks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_insert_every_backend_equals_reference(
    data, B, pages, dtype, s_layout, kv_layout, cache_layout, extra_rows, specials, checks, seed
):
    vals = data.draw(slot_lists(pages * B, 5, distinct=True))
    slots = views(torch.tensor(vals, dtype=dtype, device=DEVICE)).get(s_layout)
    slots = slots if slots is not None else torch.tensor(vals, dtype=dtype, device=DEVICE)
    kv = randn((len(vals) + extra_rows, 512), seed=seed, octaves=24)
    for pos, v in specials:
        if kv.numel():
            kv.view(-1)[pos % kv.numel()] = v
    kv = views(kv).get(kv_layout, kv)
    cache = random_cache(pages, B, seed)
    cache = views(cache).get(cache_layout, cache)
    kv_before = snapshot(kv, slots)
    with validate.checking_values(checks):
        run_insert(cache, kv, slots, block_size=B)
    assert unchanged(kv_before, kv, slots)


@given(
    data=st.data(),
    B=st.sampled_from([1, 2, 3, 16, 61]),
    pages=st.integers(0, 3),
    dtype=st.sampled_from([torch.int64, torch.int32]),
    s_layout=st.sampled_from(LAYOUTS[:3]),
    cache_layout=st.sampled_from(LAYOUTS),
    with_out=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gather_every_backend_equals_reference_on_any_bytes(data, B, pages, dtype, s_layout, cache_layout, with_out, seed):
    """A cache of random bytes: every e4m3 code, every scale byte (0 and 255), any RoPE bits; slots repeat."""
    vals = data.draw(slot_lists(pages * B, 6, distinct=False))
    slots = torch.tensor(vals, dtype=dtype, device=DEVICE)
    slots = views(slots).get(s_layout, slots)
    cache = random_cache(pages, B, seed)
    cache = views(cache).get(cache_layout, cache)
    before = snapshot(cache, slots)
    out = torch.full((len(vals), 512), 7.0, dtype=torch.bfloat16, device=DEVICE) if with_out else None
    run_gather(cache, slots, block_size=B, out=out)
    assert unchanged(before, cache, slots)


@pytest.mark.parametrize("layout", ["every other column", "transposed"])
def test_gather_refuses_a_strided_out(layout):
    """``out`` must be a contiguous [S, 512] bf16 buffer: the kernel writes rows 1024 bytes apart. A strided
    view of the right shape is refused on every backend, with the argument named and not one byte of the
    buffer under it written (read as if contiguous, it would land rows in the wrong places)."""
    B, S = 4, 6
    cache = random_cache(2, B, seed=5)
    slots = torch.tensor([0, 7, -1, 3, 3, 5], device=DEVICE)
    base = torch.full((S, 1024) if layout == "every other column" else (512, S), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out = base[:, ::2] if layout == "every other column" else base.t()
    assert out.shape == (S, 512) and not out.is_contiguous()
    before = snapshot(base)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="out: expected a contiguous tensor"):
            kc.gather(cache, slots, block_size=B, out=out, backend=backend)
        assert unchanged(before, base), backend
