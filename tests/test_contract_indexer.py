"""The input contract of dsv4ref.indexer (docs/indexer.md#the-input-contract).

Every backend gives the reference's answer (bytes for the quantisers and the cache writer, the normalised
"fp32_dot" row for the logits) or raises the same error class naming the argument; views are read as views;
a NaN or ±inf in data raises while value checks are on and, with them off, is encoded as NaN on every
backend; a failed call leaves every buffer byte-identical. The named tests are regression probes.
"""

import pytest
import torch
from contract import outcome, snapshot, unchanged, views
from hypothesis import given, settings
from hypothesis import strategies as st

import dsv4ref.indexer as ix
from dsv4ref import validate
from dsv4ref.device import DEVICE
from dsv4ref.testing import generator, randn
from dsv4ref.tolerances import compare

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter, on inf − inf

BACKENDS = ("reference", "triton")
NAN, INF = float("nan"), float("inf")
VIEWS = ("contiguous", "every_other_row", "storage_offset", "transposed_copy")


def bits(t):
    """Raw bits on the CPU (NaN payloads and −0 count); None stays None."""
    if t is None:
        return None
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def as_view(t: torch.Tensor, kind: str) -> torch.Tensor:
    return views(t).get(kind, t)


def run_all(fn, *args, **kwargs) -> dict:
    """{backend: ("ok", result) or ("raise", error class name)}; asserts every backend had the same kind
    of outcome (and the same error class)."""
    got = {b: outcome(fn, *args, backend=b, **kwargs) for b in BACKENDS}
    assert len({g[0] for g in got.values()}) == 1, got
    if got["reference"][0] == "raise":
        assert len({g[1] for g in got.values()}) == 1, got
    return got


def same_bytes(got: dict) -> None:
    ref = got["reference"][1]
    ref = ref if isinstance(ref, tuple) else (ref,)
    for b in BACKENDS[1:]:
        res = got[b][1] if isinstance(got[b][1], tuple) else (got[b][1],)
        for r, o in zip(ref, res):
            assert (r is None) == (o is None)
            if r is not None:
                assert r.dtype == o.dtype and r.shape == o.shape and torch.equal(bits(r), bits(o)), b


def poke(t: torch.Tensor, where: int, value: float) -> torch.Tensor:
    """A copy of ``t`` with flat element ``where`` (mod numel) set to ``value``."""
    t = t.clone()
    if t.numel():
        t.view(-1)[where % t.numel()] = value
    return t


# ----------------------------------------------------------------------------------------------------
# property tests: every public op, every backend
# ----------------------------------------------------------------------------------------------------

NON_FINITE = st.sampled_from([None, NAN, INF, -INF, -NAN])


def examples(n: int) -> int:
    """``n`` in CI (the "ci" profile: 20 by default), the profile's count in a long run (``make test-long``)."""
    return n if settings.default.max_examples <= 20 else settings.default.max_examples


@given(
    T=st.integers(0, 2),
    H=st.integers(1, 3),
    fmt=st.sampled_from(ix.FMTS),
    hadamard=st.booleans(),
    q_view=st.sampled_from(VIEWS),
    w_view=st.sampled_from(VIEWS),
    pos_dtype=st.sampled_from([torch.int32, torch.int64]),
    pos_view=st.sampled_from(VIEWS),
    bad=NON_FINITE,
    bad_in=st.sampled_from(["index_q", "weights"]),
    where=st.integers(0, 10**6),
    checks=st.booleans(),
    seed=st.integers(0, 99),
)
@settings(max_examples=examples(10))
def test_quantize_q_backends_agree(T, H, fmt, hadamard, q_view, w_view, pos_dtype, pos_view, bad, bad_in, where, checks, seed):
    cs = ix.cos_sin_table(64)
    iq = randn((T, H, 128), seed=seed, block=32, octaves=6)
    w = randn((T, H), seed=seed + 1, dtype=torch.float32, block=None)
    if bad is not None:
        if bad_in == "index_q":
            iq = poke(iq, where, bad)
        else:
            w = poke(w, where, bad)
    pos = torch.randint(0, 64, (T,), generator=generator(seed)).to(pos_dtype).to(DEVICE)
    args = (as_view(iq, q_view), as_view(pos, pos_view), cs, as_view(w, w_view))
    before = snapshot(*args)
    with validate.checking_values(checks):
        got = run_all(ix.quantize_q, *args, fmt=fmt, hadamard=hadamard)
    assert unchanged(before, *args)
    expect_raise = checks and bad is not None and T > 0
    assert got["reference"][0] == ("raise" if expect_raise else "ok"), got
    if not expect_raise:
        same_bytes(got)


@given(
    N=st.integers(0, 6),
    n_pages=st.integers(0, 3),
    block_size=st.integers(1, 20),
    fmt=st.sampled_from(ix.FMTS),
    hadamard=st.booleans(),
    k_view=st.sampled_from(VIEWS),
    cache_view=st.sampled_from(VIEWS),
    slot_dtype=st.sampled_from([torch.int32, torch.int64]),
    slot_view=st.sampled_from(VIEWS),
    n_minus1=st.integers(0, 3),
    bad=NON_FINITE,
    where=st.integers(0, 10**6),
    checks=st.booleans(),
    seed=st.integers(0, 99),
)
@settings(max_examples=examples(20))
def test_k_cache_writers_agree(
    N, n_pages, block_size, fmt, hadamard, k_view, cache_view, slot_dtype, slot_view, n_minus1, bad, where, checks, seed
):
    """quantize_k and insert_k: the same bytes on every backend (the cache compared whole, so a stray write
    shows), or the same error with the cache untouched."""
    g = generator(seed)
    k = randn((N, 128), seed=seed, block=32, octaves=8)
    if bad is not None:
        k = poke(k, where, bad)
    n_slots = n_pages * block_size
    S = min(N, n_slots) if n_slots else 0
    slots = torch.randperm(max(n_slots, 1), generator=g)[:S]
    slots[: min(n_minus1, S)] = -1
    slots = slots[torch.randperm(S, generator=g)].to(slot_dtype).to(DEVICE)
    page = ix.k_page_bytes(block_size, fmt)
    cache0 = torch.randint(0, 256, (n_pages, page), generator=g, dtype=torch.uint8).to(DEVICE)
    kv = as_view(k, k_view)
    row = (where % k.numel()) // 128 if k.numel() else -1
    bad_written = bad is not None and 0 <= row < S and bool(slots[row] >= 0)
    with validate.checking_values(checks):
        got = run_all(ix.quantize_k, kv, fmt=fmt, hadamard=hadamard)
        assert got["reference"][0] == ("raise" if checks and bad is not None and N else "ok"), got
        if got["reference"][0] == "ok":
            same_bytes(got)
        caches = {}
        for b in BACKENDS:
            cache = as_view(cache0, cache_view)
            sv = as_view(slots, slot_view)
            before = snapshot(cache, kv, sv)
            caches[b] = outcome(ix.insert_k, cache, kv, sv, block_size=block_size, fmt=fmt, hadamard=hadamard, backend=b) + (
                cache,
                before,
                (cache, kv, sv),
            )
    kinds = {b: c[0] for b, c in caches.items()}
    assert len(set(kinds.values())) == 1, caches
    refused_view = cache_view in ("storage_offset", "transposed_copy") and n_pages > 0
    if kinds["reference"] == "raise":
        assert len({c[1] for c in caches.values()}) == 1
        for c in caches.values():
            assert unchanged(c[3], *c[4])  # a failed call writes nothing
        assert refused_view or (checks and bad_written), caches
    else:
        assert not refused_view and not (checks and bad_written)
        ref = caches["reference"][2]
        for b in BACKENDS[1:]:
            assert torch.equal(caches[b][2], ref), b
        if S and bad is None:  # the read-back equals quantize_k of the written rows
            vals, sc = ix.read_k(ref, slots, block_size=block_size, fmt=fmt)
            q, s = ix.quantize_k(k[:S], fmt=fmt, hadamard=hadamard, backend="reference")
            keep = slots >= 0
            assert torch.equal(bits(vals[keep]), bits(q[keep])) and torch.equal(bits(sc[keep]), bits(s[keep]))


def _logits_problem(T, H, n_keys, block_size, fmt, seed):
    ex = ix.example_inputs(T, H, n_keys, block_size=block_size, fmt=fmt, seed=seed)
    q, qs, wo = ix.quantize_q(ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"], fmt=fmt, backend="reference")
    return ex, q, qs, wo


@given(
    T=st.integers(1, 2),
    H=st.integers(1, 3),
    n_keys=st.integers(1, 24),
    block_size=st.integers(1, 20),
    fmt=st.sampled_from(ix.FMTS),
    q_view=st.sampled_from(VIEWS),
    w_view=st.sampled_from(VIEWS),
    bt_view=st.sampled_from(VIEWS),
    bt_dtype=st.sampled_from([torch.int32, torch.int64]),
    pos_dtype=st.sampled_from([torch.int32, torch.int64]),
    nan_key=st.booleans(),
    n_out=st.integers(-1, 30),
    seed=st.integers(0, 99),
)
@settings(max_examples=examples(10))
def test_logits_backends_agree(T, H, n_keys, block_size, fmt, q_view, w_view, bt_view, bt_dtype, pos_dtype, nan_key, n_out, seed):
    """Any block size, strided q / weights / block tables, int32 / int64 indices, a NaN-encoded key in the
    cache (NaN in, NaN out): the kernel equals the float64 oracle within "fp32_dot" after dividing by the
    condition sum, with NaN and −∞ in the same places."""
    ex, q, qs, wo = _logits_problem(T, H, n_keys, block_size, fmt, seed)
    cache = ex["k_cache"].clone()
    if nan_key:
        bad = torch.zeros(1, 128, dtype=torch.bfloat16, device=DEVICE)
        bad[0, seed % 128] = NAN
        with validate.checking_values(False):
            ix.insert_k(cache, bad, ex["slots"][seed % n_keys :][:1], block_size=block_size, fmt=fmt)
    pos = ex["positions"].to(pos_dtype)
    kw = dict(
        block_size=block_size, block_table=as_view(ex["block_table"].to(bt_dtype), bt_view), n_out=None if n_out < 0 else n_out
    )
    got = run_all(
        ix.logits, as_view(q, q_view), None if qs is None else as_view(qs, q_view), as_view(wo, w_view), cache, pos, **kw
    )
    ref, out = got["reference"][1], got["triton"][1]
    n = ref.shape[1]
    args = (q, qs, wo, cache, ex["positions"], ex["block_table"])
    cond = ix.reference.logits_condition(*args, block_size=block_size, n_out=n)
    assert compare(out.double() / cond, ref.double() / cond, "fp32_dot", "logits").passed
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out == -INF, ref == -INF)
    assert nan_key or not bool(ref.isnan().any())
    if fmt == "mxfp4":  # the one-dot decode, two pages per program and per dot (a NaN key: its exact slow path)
        f16s = ix.IndexerLaunch(fp4_decode="f16_scaled", logits_pages=2, logits_tile_pages=2)
        out = ix.logits(as_view(q, q_view), as_view(qs, q_view), as_view(wo, w_view), cache, pos, **kw, launch=f16s)
        assert compare(out.double() / cond, ref.double() / cond, "fp32_dot", "f16_scaled logits").passed
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out == -INF, ref == -INF)


@given(
    T=st.integers(0, 4),
    n=st.integers(0, 12),
    k=st.integers(1, 8),
    view=st.sampled_from(VIEWS),
    specials=st.lists(st.tuples(st.integers(0, 60), st.sampled_from([NAN, INF, -INF])), max_size=4),
    checks=st.booleans(),
    out_view=st.sampled_from(["none", "contiguous", "every_other_row"]),
    seed=st.integers(0, 99),
)
def test_topk_contract(T, n, k, view, specials, checks, out_view, seed):
    """torch only: views give the same ids; NaN raises (checks on) or ranks like −∞ (checks off), +∞ ranks
    first; a call that raises leaves ``out`` alone."""
    lg = torch.randperm(max(T * n, 1), generator=generator(seed))[: T * n].float().view(T, n).to(DEVICE)
    for i, v in specials:
        lg = poke(lg, i, v)
    out = None if out_view == "none" else as_view(torch.full((T, k), 77, dtype=torch.int32, device=DEVICE), out_view)
    before = snapshot(out)
    with validate.checking_values(checks):
        res = outcome(ix.topk, as_view(lg, view), k, out=out)
    has_nan = bool(lg.isnan().any())
    if checks and has_nan:
        assert res == ("raise", "ValueError") and unchanged(before, out)
        return
    ids = res[1]
    assert ids.dtype == torch.int32 and ids.shape == (T, k) and (out is None or ids is out)
    clean = lg.masked_fill(lg.isnan(), -INF)
    for t in range(T):
        want = [i for i in torch.argsort(clean[t], descending=True, stable=True).tolist() if clean[t, i] > -INF][:k]
        got = [i for i in ids[t].tolist() if i >= 0]
        assert sorted(clean[t, got].tolist(), reverse=True) == [clean[t, i].item() for i in want]
        assert len(got) == len(set(got)) and ids[t].tolist()[len(got) :] == [-1] * (k - len(got))


@given(
    T=st.integers(0, 3),
    k=st.integers(1, 6),
    cols=st.integers(0, 4),
    block_size=st.integers(1, 9),
    dtypes=st.tuples(*[st.sampled_from([torch.int32, torch.int64])] * 3),
    view=st.sampled_from(VIEWS),
    big=st.booleans(),
    neg_page=st.sampled_from([None, -1, -3]),
    checks=st.booleans(),
    seed=st.integers(0, 99),
)
def test_to_global_contract(T, k, cols, block_size, dtypes, view, big, neg_page, checks, seed):
    """int64 slots without wrapping (page numbers near 2^31 / block_size), views, −1 ids, unmapped (−1) pages;
    a page entry < −1 under a selected id raises while checks are on and maps to −1 when off."""
    g = generator(seed)
    base = (2**31 - 64) // block_size if big else 0  # slots near 2^31: past int32 once block_size > 1
    bt = (torch.randint(0, 50, (T, cols), generator=g) + base).to(dtypes[0])
    if neg_page is not None and T and cols:
        bt[0, 0] = neg_page
    hi = cols * block_size
    loc = torch.randint(-1, max(hi, 1), (T, k), generator=g) if hi else torch.full((T, k), -1)
    slots = torch.randint(-1, 5, (T,), generator=g).to(dtypes[2])
    args = (as_view(loc.to(dtypes[1]).to(DEVICE), view), as_view(bt.to(DEVICE), view), as_view(slots.to(DEVICE), view))
    with validate.checking_values(checks):
        res = outcome(ix.to_global, *args, block_size=block_size)
    under_id = neg_page == -3 and T and cols and bool(((loc[0] >= 0) & (loc[0] < block_size)).any())
    if checks and under_id:
        assert res == ("raise", "ValueError")
        return
    assert res[0] == "ok", res
    glob, n = res[1]
    assert glob.dtype == torch.int64 and n.dtype == torch.int32
    for t in range(T):
        for j in range(k):
            lid = int(loc[t, j])
            page = int(bt[t, lid // block_size]) if lid >= 0 else -1
            want = page * block_size + lid % block_size if (lid >= 0 and slots[t] >= 0 and page >= 0) else -1
            assert int(glob[t, j]) == want
        assert int(n[t]) == sum(int(x) >= 0 for x in glob[t])


# ----------------------------------------------------------------------------------------------------
# the probes of the input-contract audit
# ----------------------------------------------------------------------------------------------------


def test_probe_topk_nan_is_never_top1():
    """Before: torch.topk ranked a NaN logit first. Now: refused while checks are on; ranked like −∞ when off."""
    lg = torch.tensor([[1.0, NAN, 3.0, -INF, 2.0]], device=DEVICE)
    with pytest.raises(ValueError, match=r"^logits: NaN score at \[0, 1\]"):
        ix.topk(lg, 2)
    with validate.checking_values(False):
        assert sorted(ix.topk(lg, 2)[0].tolist()) == [2, 4]
        assert sorted(ix.topk(lg, 5)[0].tolist()) == [-1, -1, 0, 2, 4]  # NaN and −∞: not selected
    assert ix.topk(torch.tensor([[INF, 1.0]], device=DEVICE), 1)[0].tolist() == [0]  # +∞ is a score


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_logits_block_size_against_page_bytes(backend):
    """Before: block_size=8 on a cache of 16-key pages was accepted by the reference (logits off by 4.6e32).
    Now: the page must be exactly k_page_bytes(block_size, fmt) on every backend; so must the format."""
    ex, q, qs, wo = _logits_problem(2, 2, 32, 16, "fp8", 1)
    with pytest.raises(ValueError, match=r"^k_cache: pages of 2112 bytes hold 16 fp8 keys"):
        ix.logits(q, qs, wo, ex["k_cache"], ex["positions"], block_size=8, block_table=ex["block_table"], backend=backend)
    with pytest.raises(ValueError, match=r"^k_cache: .* no whole number of mxfp4 keys"):
        ix.insert_k(ex["k_cache"], ex["k"], ex["slots"], block_size=16, fmt="mxfp4", backend=backend)
    with pytest.raises(ValueError, match=r"^k_cache: pages of 1088 bytes hold 16 mxfp4 keys"):
        ix.insert_k(ix.allocate_k_cache(2, 16, "mxfp4"), ex["k"], ex["slots"], block_size=8, fmt="mxfp4", backend=backend)


def test_probe_to_global_int64_and_negative_pages():
    """Before: slot 2^25·64 came back as −2^31 (int32), and a −3 page entry became slot 0, counted valid."""
    local = torch.tensor([[0, 1, -1]], dtype=torch.int32, device=DEVICE)
    bt = torch.tensor([[2**25]], dtype=torch.int64, device=DEVICE)
    glob, n = ix.to_global(local, bt, block_size=64)
    assert glob.dtype == torch.int64 and glob[0].tolist() == [2**31, 2**31 + 1, -1] and n.tolist() == [2]
    bad = torch.tensor([[-3]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^block_table: page entry -3"):
        ix.to_global(local, bad, block_size=64)
    for page in (-1, -3):  # −1 is an unmapped page: its ids map to −1 (and −3 too, with checks off)
        with validate.checking_values(page == -1):
            glob, n = ix.to_global(local, torch.tensor([[page]], dtype=torch.int32, device=DEVICE), block_size=64)
        assert glob[0].tolist() == [-1, -1, -1] and n.tolist() == [0]


@pytest.mark.parametrize("fmt", ix.FMTS)
def test_probe_non_finite_quantisers_write_nan_blocks(fmt):
    """Before: NaN → finite 3.5 and +inf → −inf on Triton, zeroed blocks on the reference. Now: checks on
    raise (nothing written); off, both backends write the same NaN blocks: scale byte 255 / fp32 NaN and
    codes 0x7F / 0xFF (fp8) or 0x7 / 0xF (mxfp4), a finite block next to them unchanged."""
    k = randn((3, 128), seed=5, block=32)
    k[0, 40], k[1, 100], k[2, 3] = NAN, INF, -INF
    k[2, 4] = -1.0
    cache = ix.allocate_k_cache(1, 4, fmt)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"^k: non-finite values"):
        ix.insert_k(cache, k, torch.tensor([0, 1, 2], device=DEVICE), block_size=4, fmt=fmt)
    assert unchanged(before, cache)
    with validate.checking_values(False):
        got = run_all(ix.quantize_k, k, fmt=fmt)
        same_bytes(got)
        vals, sc = got["reference"][1]
        finite, fsc = ix.quantize_k(torch.where(k.isfinite(), k, 0).to(torch.bfloat16), fmt=fmt)
    sign = torch.signbit(k.cpu().float()).to(torch.int32)  # the NaN set above is positive, −inf negative
    if fmt == "fp8":
        assert bits(sc).tolist() == [0x7FC00000] * 3  # the fp32 scale is the quiet NaN
        assert torch.equal(bits(vals).to(torch.int32) & 0xFF, 0x7F | (sign << 7))  # every row had a non-finite
    else:
        assert sc.cpu().tolist() == [
            [fsc[0, 0].item(), 255, fsc[0, 2].item(), fsc[0, 3].item()],
            [*fsc[1, :3].tolist(), 255],
            [255, *fsc[2, 1:].tolist()],
        ]
        codes = ix.reference.unpack_nibbles(vals.cpu()).to(torch.int32)
        for key, blk in ((0, 1), (1, 3), (2, 0)):
            assert torch.equal(codes[key, 32 * blk : 32 * blk + 32], 7 | (sign[key, 32 * blk : 32 * blk + 32] << 3))
        assert torch.equal(vals[0, :16], finite[0, :16])  # block 0 of key 0 is finite: its codes unchanged
        deq = ix.dequantize_k(vals, sc)
        assert bool(deq[0, 32:64].isnan().all()) and bool(deq[0, :32].isfinite().all())


@pytest.mark.parametrize("fmt", ix.FMTS)
def test_probe_nan_query_is_a_nan_score(fmt):
    """A NaN query (checks off) gives NaN scores on every backend, never the finite or −∞ answer."""
    ex = ix.example_inputs(2, 2, 20, block_size=8, fmt=fmt, seed=4)
    iq = ex["index_q"].clone()
    iq[1, 0, 77] = NAN
    with validate.checking_values(False):
        q, qs, wo = ix.quantize_q(iq, ex["positions"], ex["cos_sin"], ex["weights"], fmt=fmt)
        got = run_all(ix.logits, q, qs, wo, ex["k_cache"], ex["positions"], block_size=8, block_table=ex["block_table"])
    n_c = int(ix.n_compressed(ex["positions"][1:2]))
    for b in BACKENDS:
        lg = got[b][1]
        assert bool(lg[1, :n_c].isnan().all()) and bool(lg[0].isfinite().all())
    with pytest.raises(ValueError, match=r"^q(_scales)?: non-finite"):
        ix.logits(q, qs, wo, ex["k_cache"], ex["positions"], block_size=8, block_table=ex["block_table"])


def test_probe_e8m0_reader_bytes_0_and_255():
    """MXFP4 readers decode scale byte 0 as 2^-127 (not 0) and 255 as NaN (not inf), on every backend."""
    ex, q, qs, wo = _logits_problem(1, 2, 16, 16, "mxfp4", 2)
    cache = ex["k_cache"].clone()
    page, off = divmod(int(ex["slots"][3]), 16)
    cache[page, 16 * 64 + 4 * off : 16 * 64 + 4 * off + 4] = torch.tensor([0, 255, 127, 127], dtype=torch.uint8)
    vals, sc = ix.read_k(cache, ex["slots"][3:4], block_size=16, fmt="mxfp4")
    deq = ix.dequantize_k(vals, sc)[0]
    codes = ix.reference.e2m1_decode(ix.reference.unpack_nibbles(vals[0]))
    assert torch.equal(deq[:32], codes[:32] * 2.0**-127) and bool(deq[32:64].isnan().all())
    got = run_all(ix.logits, q, qs, wo, cache, ex["positions"], block_size=16, block_table=ex["block_table"])
    assert all(bool(got[b][1][0, 3].isnan()) for b in BACKENDS)


def test_probe_views_are_honoured():
    """Strided positions / weights / slots / block tables / queries give the contiguous answer on every
    backend (the Triton launchers make small index tensors contiguous; the cache may be a slice of pages)."""
    ex, q, qs, wo = _logits_problem(2, 3, 40, 16, "mxfp4", 6)
    for b in BACKENDS:
        want = ix.logits(q, qs, wo, ex["k_cache"], ex["positions"], block_size=16, block_table=ex["block_table"], backend=b)
        for kind in ("every_other_row", "storage_offset", "transposed_copy"):
            got = ix.logits(
                as_view(q, kind),
                as_view(qs, kind),
                as_view(wo, kind),
                ex["k_cache"],
                as_view(ex["positions"], kind),
                block_size=16,
                block_table=as_view(ex["block_table"], kind),
                backend=b,
            )
            assert torch.equal(got, want) if b == "triton" else compare(got, want, "fp32_reduction", kind).passed
    big = torch.zeros(2 * ex["k_cache"].shape[0], ex["k_cache"].shape[1], dtype=torch.uint8, device=DEVICE)
    sliced = big[::2]  # every other page of a bigger pool: a row stride of two pages
    for b in BACKENDS:
        sliced.zero_()
        ix.insert_k(
            sliced,
            as_view(ex["k"], "transposed_copy"),
            as_view(ex["slots"].to(torch.int32), "every_other_row"),
            block_size=16,
            fmt="mxfp4",
            backend=b,
        )
        assert torch.equal(sliced, ex["k_cache"]) and not bool(big[1::2].any()), b


def test_probe_scalars_are_validated():
    ex, q, qs, wo = _logits_problem(1, 2, 16, 16, "fp8", 3)
    cache, pos, bt = ex["k_cache"], ex["positions"], ex["block_table"]
    cases = [
        (TypeError, "block_size", lambda: ix.logits(q, qs, wo, cache, pos, block_size=16.0)),
        (TypeError, "block_size", lambda: ix.insert_k(cache, ex["k"], ex["slots"], block_size=True)),
        (ValueError, "block_size", lambda: ix.read_k(cache, ex["slots"], block_size=0)),
        (ValueError, "n_out", lambda: ix.logits(q, qs, wo, cache, pos, block_size=16, n_out=-1)),
        (TypeError, "k", lambda: ix.topk(torch.zeros(1, 4, device=DEVICE), 2.0)),
        (TypeError, "hadamard", lambda: ix.quantize_k(ex["k"], hadamard=1)),
        (TypeError, "fmt", lambda: ix.quantize_k(ex["k"], fmt=None)),
        (TypeError, "launch", lambda: ix.quantize_k(ex["k"], launch={"quant_rows": 16})),
        (ValueError, "IndexerLaunch.fp4_decode", lambda: ix.IndexerLaunch(fp4_decode="lut")),
        (TypeError, "num_blocks", lambda: ix.allocate_k_cache(2.5, 16)),
        (ValueError, "num_blocks", lambda: ix.allocate_k_cache(-1, 16)),
        (ValueError, "theta", lambda: ix.cos_sin_table(8, theta=float("nan"))),
        (TypeError, "block_table", lambda: ix.logits(q, qs, wo, cache, pos, block_size=16, block_table=bt.float())),
        (ValueError, "positions", lambda: ix.logits(q, qs, wo, cache, -pos - 1, block_size=16, block_table=bt)),
        (ValueError, "index_q", lambda: ix.quantize_q(ex["index_q"][:, :0], pos, ex["cos_sin"], ex["weights"][:, :0])),
        (ValueError, "cos_sin", lambda: ix.quantize_q(ex["index_q"], pos, ex["cos_sin"] * NAN, ex["weights"])),
        (ValueError, "slots", lambda: ix.insert_k(cache, ex["k"][:2], torch.tensor([3, 3], device=DEVICE), block_size=16)),
    ]
    for err, name, call in cases:
        snap = snapshot(cache)
        with pytest.raises(err, match=rf"^{name}"):
            call()
        assert unchanged(snap, cache), name
