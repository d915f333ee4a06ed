"""The whole decode step (dsv4ref.decode) against its float64 dense reference.

The decode path (paged FP8 caches, compressor, indexer, sparse MLA, mHC, FFN) must track the float64
reference, which has no FP8, no paging and no sparsity beyond the window and the top-k ids the indexer
chose, within ATTN_TOL = 2^-3 (every layer's attention output) and LOGITS_TOL = 2^-4 (the logits); the
figures are derived from e4m3's relative half-ulp 2^-4 in docs/decode.md#tolerances. Many steps run through the
library's torch ops (fast in the CPU interpreter; the caches' bytes are the same as the kernels'); one
step runs through the Triton kernels.
"""

import copy

import pytest
import torch

from dsv4ref import compressor, decode
from dsv4ref.config import FLASH, TINY
from dsv4ref.decode import (
    ATTN_TOL,
    LOGITS_TOL,
    CacheCapacityError,
    Decoder,
    agreement,
    make_weights,
    reference_forward,
    rel_err,
    run,
    traffic_per_op,
)
from dsv4ref.decode import reference as dense
from dsv4ref.device import interpreting
from dsv4ref.mhc import OnePassLaunch
from dsv4ref.testing import assert_close, randn
from dsv4ref.tolerances import TOLERANCES

PROMPTS = (133, 37, 5, 70)  # ratio-128 row written at p = 127; n_c = 33 > K_top = 16; a 5-token request


@pytest.fixture(scope="module")
def long_run():
    """Prefill 4 requests, then 10 greedy steps through the torch ops; request 2 sits out steps 3 and 4
    as a padding row (slot −1, all lengths 0)."""
    return run(TINY, steps=10, prompt_lens=PROMPTS, decode_backend="reference", inactive={3: [2], 4: [2]})


def test_tracks_the_float64_reference_over_many_steps(long_run):
    dec, w, recs, _ = long_run
    rows = agreement(TINY, w, recs, dec.history())
    assert len(rows) == 11
    for a in rows:
        assert a.attn_err <= ATTN_TOL and a.logits_err <= LOGITS_TOL, a
    assert [a.n for a in rows[4:6]] == [3, 3]  # the padding row was left out of those steps
    assert dec.lengths.tolist() == [p + 10 - (i == 2) * 2 for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("bug", ["no_sink", "no_inv_rope", "no_compressed", "rope_neox"])
def test_the_tolerance_has_teeth(long_run, bug):
    """Each bug, put into the reference, moves the attention outputs far past ATTN_TOL (pitfalls #14, #16, #17)."""
    dec, w, recs, _ = long_run
    rows = agreement(TINY, w, recs[-2:], dec.history(), bugs=(bug,))
    assert all(a.attn_err > ATTN_TOL and not a.passed for a in rows)


def test_fp8_budget_is_what_separates_the_paths(long_run):
    """Simulating the cache's FP8 inside the float64 reference brings it closer to the decode path: the
    error being budgeted really is the KV quantisation."""
    dec, w, recs, _ = long_run
    toks, topks = dec.history()
    step, pos, logits, attn, act = recs[-1]
    r = 0
    pure = reference_forward(TINY, w, toks[r], topks[r])
    sim = reference_forward(TINY, w, toks[r], topks[r], fp8_kv=True)
    p = int(pos[r])
    e_pure = float(rel_err(attn[0][r], pure["attn"][0][p]))
    e_sim = float(rel_err(attn[0][r], sim["attn"][0][p]))
    budget = float(rel_err(sim["attn"][0][p], pure["attn"][0][p]))  # the FP8 effect alone, in float64
    assert e_sim < e_pure and 0.25 * budget < e_pure < 3 * budget


def _topk_recall(history, ref, key, request=0):
    """Fraction of the decode path's top-k ids (request ``request``, every ratio-4 layer, every position with
    n_c > K_top) that are among the top-k of the float64 scores ``ref[key]``."""
    toks, topks = history
    K = TINY.index_topk
    hits = tot = 0
    for li, ids in topks[request].items():
        sc = ref[key][li]
        for p in range(4 * K + 3, len(toks[request])):  # n_c > K_top: a real selection
            want = set(torch.topk(sc[p], K).indices.tolist())
            got = set(i for i in ids[p].tolist() if i >= 0)
            assert len(got) == K and max(got) < (p + 1) // 4  # causal (pitfall #26)
            hits += len(got & want)
            tot += K
    assert tot
    return hits / tot


def test_indexer_picks_the_float64_top_k(long_run):
    """The FP8 indexer's choice overlaps the top-k of the unquantised float64 scores (near-ties may flip), and
    more of the top-k of the float64 scores with q and k simulated in FP8 (the reference follows the format)."""
    dec, w, recs, _ = long_run
    toks, topks = dec.history()
    ref = reference_forward(TINY, w, toks[0], topks[0])
    exact, same_format = _topk_recall(dec.history(), ref, "index_scores"), _topk_recall(dec.history(), ref, "index_scores_fmt")
    assert exact >= 0.8 and same_format >= 0.9 and same_format >= exact


def test_short_prompts_use_every_visible_row(long_run):
    dec, w, recs, _ = long_run
    toks, topks = dec.history()
    ids = topks[1][1]  # request 1 (37-token prompt), layer 1 (ratio 4)
    for p in (2, 3, 20, 36):
        n_c = (p + 1) // 4
        assert sorted(i for i in ids[p].tolist() if i >= 0) == list(range(n_c))


# the two non-default choices share one step: they touch disjoint ops (mHC's kernels, the indexer's), so a fault in
# either still fails that step's checks, and the interpreter runs two whole Triton steps instead of three
@pytest.mark.parametrize("mhc_design, index_format", [("default", "fp8"), ("one-pass", "mxfp4")])
def test_triton_step_matches(mhc_design, index_format):
    """One decode step through the Triton kernels (interpreted on the CPU) agrees with the reference
    and with the same step through the torch ops. Heads unpadded here to keep the interpreter quick;
    the demo and the GPU run use Hp = 64. ``one-pass``: every mHC call of the step (pre, fused post+pre, post,
    head) runs the one-pass design, ``Decoder(mhc_launch=OnePassLaunch())``: what the step does once
    that design is the default (benchmarks/mhc.md). ``mxfp4``: the indexer in DeepSeek's FP4 (V4-Flash's and
    V4-Pro's ``index_format``), its MXFP4 quantiser and logits kernels (request 0's n_c = 33 > K_top: the
    logits and top-k run)."""
    launch = OnePassLaunch() if mhc_design == "one-pass" else None
    cfg = TINY.replace(index_format=index_format)
    dec, w, recs, _ = run(cfg, steps=0, prompt_lens=(133, 6), pad_heads=False, mhc_launch=launch)
    twin = copy.deepcopy(dec)
    ids = recs[0][2].argmax(-1)
    pos = dec.lengths.clone()
    got = dec.step(ids, backend="triton")
    attn = [a.cpu() for a in dec.attn_out]
    want = twin.step(ids, backend="reference")
    assert float(rel_err(got, want).max()) <= LOGITS_TOL
    rows = agreement(cfg, w, recs + [(0, pos, got.cpu(), attn, torch.ones(2, dtype=torch.bool))], dec.history())
    assert all(a.passed for a in rows), rows


@pytest.mark.skipif(interpreting(), reason="many Triton steps: GPU only")
def test_triton_many_steps_padded_heads():
    dec, w, recs, tps = run(TINY, steps=24, prompt_lens=PROMPTS, inactive={5: [1]})
    assert all(a.passed for a in agreement(TINY, w, recs, dec.history()))


# ------------------------------------------------------------------------------------------------
# bookkeeping and bad input
# ------------------------------------------------------------------------------------------------


def test_decode_past_capacity_raises_and_writes_nothing():
    w = make_weights(TINY, 0)
    dec = Decoder(TINY, w, num_requests=2, capacity=16, backend="reference")
    dec.prefill([list(range(14)), [7, 8, 9]])
    dec.step(torch.tensor([1, 2]))
    dec.step(torch.tensor([3, 4]))  # request 0 now holds 16 tokens = capacity
    before = [st.swa.clone() for st in dec.layers]
    with pytest.raises(CacheCapacityError, match="past the cache capacity of 16"):
        dec.step(torch.tensor([5, 6]))
    assert all(torch.equal(b, st.swa) for b, st in zip(before, dec.layers))
    assert dec.lengths.tolist() == [16, 5]
    dec.step(torch.tensor([5, 6]), active=torch.tensor([False, True]))  # the other request may go on
    assert dec.lengths.tolist() == [16, 6]


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="compress_ratios"):
        Decoder(TINY.replace(compress_ratios=(0, 4, 64, 4)))
    with pytest.raises(ValueError, match="compress_ratios"):
        Decoder(TINY.replace(compress_ratios=(0, 4)))
    with pytest.raises(ValueError, match="o_groups"):
        Decoder(TINY.replace(o_groups=3))
    with pytest.raises(ValueError, match="head_dim"):
        decode.check_config(TINY.replace(head_dim=256))
    with pytest.raises(TypeError, match="cfg"):
        decode.check_config({"hidden_size": 256})
    with pytest.raises(ValueError, match="capacity"):
        Decoder(TINY, num_requests=1, capacity=TINY.max_position + 1)
    dec = Decoder(TINY, make_weights(TINY, 0), num_requests=2, capacity=32, backend="reference")
    with pytest.raises(ValueError, match="prompts"):
        dec.prefill([[1, 2]])
    with pytest.raises(ValueError, match=r"prompts: token ids must be in \[0, 512\)"):
        dec.prefill([[1, 2], [3, 512]])
    with pytest.raises(CacheCapacityError, match="position 32 is past"):
        dec.prefill([[1] * 33, [2]])
    dec.prefill([[1, 2], [3]])
    with pytest.raises(ValueError, match="prefill"):
        dec.prefill([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"ids: expected shape \(2,\)"):
        dec.step(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="bugs"):
        reference_forward(TINY, dec.w, torch.tensor([1, 2]), bugs=("typo",))


def test_reference_refuses_a_non_causal_top_k():
    w = make_weights(TINY, 0)
    L = 12
    topk = {li: torch.full((L, TINY.index_topk), -1) for li in (1, 3)}
    topk[1][5, 0] = 1  # p = 5 sees (5+1)//4 = 1 row: id 1 is not complete yet
    with pytest.raises(ValueError, match="causal"):
        reference_forward(TINY, w, torch.arange(L), topk)


def test_block_tables_are_shuffled_and_disjoint():
    dec = Decoder(TINY, make_weights(TINY, 0), num_requests=3, capacity=64, backend="reference")
    for bt in [dec.bt_swa] + [bt for st in dec.layers for bt in (st.bt_c, st.bt_i) if bt is not None]:
        flat = bt.flatten().tolist()
        assert sorted(flat) == list(range(len(flat)))  # every page once
    assert dec.bt_swa.flatten().tolist() != sorted(dec.bt_swa.flatten().tolist())


def test_traffic_formulas():
    t4k, t1m = traffic_per_op(FLASH, 4096), traffic_per_op(FLASH, 1 << 20)
    assert t4k["sparse_mla"] > t4k["indexer"]
    assert t1m["indexer"] > sum(v for k, v in t1m.items() if k != "indexer")  # the indexer dominates at 1M
    # 21 ratio-4 layers scan (2^20 / 4) indexer keys of 68 B in V4-Flash's MXFP4 (132 B in FP8), + 4 B logit
    # written, 4 B read by top-k
    assert FLASH.index_format == "mxfp4"
    for cfg, record in ((FLASH, 68), (FLASH.replace(index_format="fp8"), 132)):
        keys = 21 * (1 << 18) * (record + 4 + 4)
        assert keys < traffic_per_op(cfg, 1 << 20)["indexer"] < keys * 1.01
    # window-only layer at any context: 128 rows of 584 B + 4-B indices + q/out bf16 + lse
    one = traffic_per_op(FLASH.replace(num_layers=1, compress_ratios=(0,), num_hash_layers=0), 10**6)["sparse_mla"]
    assert one == 128 * 588 + 2 * 64 * 512 * 2 + 4 * 64


def test_swiglu_clamp():
    gu = torch.tensor([[20.0, -3.0, 50.0, -50.0]])  # gate = [20, -3], up = [50, -50]
    out = decode.swiglu_clamped(gu, 10.0)
    want = torch.tensor([[10 * torch.sigmoid(torch.tensor(10.0)) * 10, -3 * torch.sigmoid(torch.tensor(-3.0)) * -10]])
    assert torch.allclose(out, want)


def test_attn_tol_is_the_decode_step_tolerance_row():
    assert TOLERANCES["decode_step"].rtol == ATTN_TOL


def _completed(x, cw, st, req, pos, valid, ratio):
    """The compressor op's rows completed by one call (its torch reference), with the request and the boundary
    position of each: the op returns one row per token and a ``done`` flag."""
    rows, done = compressor.compress(
        x,
        cw["wkv"],
        cw["wgate"],
        cw["ape"],
        cw["norm"],
        st.kv,
        st.score,
        req,
        pos,
        ratio=ratio,
        eps=TINY.rms_norm_eps,
        valid=valid,
        backend="reference",
    )
    return rows[done], req[done], pos[done]


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("chunks", [(300,), (1,) * 10 + (290,), (3, 125, 1, 1, 170)])
def test_stateful_compressor_matches_the_block_reference(ratio, chunks):
    """The decode path's compressor (a ring per request, fed chunk by chunk: a prefill, then single tokens,
    in any split) gives the rows of the float64 whole-sequence compressor, which is written differently
    (blocks of r tokens), within the "compressor" bound of its bf16 rounding before the norm."""
    L, Hd, eps = sum(chunks), TINY.hidden_size, TINY.rms_norm_eps
    cw = make_weights(TINY, 0, device="cpu")["layers"][1 if ratio == 4 else 2]["comp"]
    x = randn((L, Hd), seed=7, device="cpu", block=None, octaves=2)
    want, wpos = dense.compress({k: v.double() for k, v in cw.items()}, ratio, x.double(), eps)
    st = compressor.allocate_state(2, ratio, TINY.head_dim, device="cpu")  # request 0 stays empty
    rows, pos, p0 = [], [], 0
    for n in chunks:
        p = torch.arange(p0, p0 + n)
        done_rows, done_req, done_pos = _completed(
            x[p0 : p0 + n], cw, st, torch.ones(n, dtype=torch.int64), p, torch.ones(n, dtype=torch.bool), ratio
        )
        assert done_req.tolist() == [1] * done_rows.shape[0]
        rows.append(done_rows)
        pos.append(done_pos)
        p0 += n
    assert torch.cat(pos).tolist() == wpos.tolist()
    # the op rounds the pooled row to bf16 before its norm (DeepSeek's order); the float64 rows do not
    assert_close(torch.cat(rows), want, "compressor", "compressed rows")
    assert torch.isinf(st.score[0]).all()  # the other request's ring was not touched


def test_compressor_ignores_padding_rows():
    """A padding row (a request sitting out the step) completes nothing and leaves its request's ring alone."""
    cw = make_weights(TINY, 0, device="cpu")["layers"][1]["comp"]
    x = randn((8, TINY.hidden_size), seed=8, device="cpu", block=None, octaves=2)
    st = compressor.allocate_state(2, 4, TINY.head_dim, device="cpu")
    req, pos = torch.tensor([0] * 4 + [1] * 4), torch.tensor([0, 1, 2, 3] * 2)
    valid = torch.tensor([True] * 4 + [False] * 4)
    _, done_req, done_pos = _completed(x, cw, st, req, pos, valid, 4)
    assert done_req.tolist() == [0] and done_pos.tolist() == [3]  # request 1's p = 3 was padding
    assert torch.isinf(st.score[1]).all() and not torch.isinf(st.score[0, :4]).any()


# ------------------------------------------------------------------------------------------------
# the indexer K cache, byte for byte
# ------------------------------------------------------------------------------------------------


def _window_start(p):
    return p // 4 * 4  # the ratio-4 compressor's window start: where the model rotates the indexer key


@pytest.fixture(scope="module")
def indexer_run():
    """Prefill 3 requests, then 9 greedy steps through the torch ops, recording every layer's input rows.
    Request 2 sits out step 4. The prompts put boundary tokens ((p + 1) % 4 == 0) inside the decode steps."""
    w = make_weights(TINY, 0)
    dec = Decoder(TINY, w, num_requests=3, capacity=64, backend="reference")
    seen = []  # (layer, layer input x, rows) of every call, prefill included
    attention = dec.attention

    def spy(li, x, rows, backend):
        seen.append((li, x.clone(), rows))
        return attention(li, x, rows, backend)

    dec.attention = spy
    g = torch.Generator().manual_seed(5)
    logits = dec.prefill([torch.randint(0, TINY.vocab_size, (n,), generator=g) for n in (37, 6, 10)])
    for s in range(9):
        logits = dec.step(logits.argmax(-1), active=torch.tensor([True, True, s != 4]))
    return dec, seen


def _expected_index_k_cache(dec, seen, li, rotate_at):
    """The indexer-K pool of ratio-4 layer ``li`` rebuilt outside the decoder: the layer inputs after
    attn_norm through the indexer compressor (its torch reference, fed the same chunks), each completed key
    rounded to bf16, RoPE'd (the layer's table) at ``rotate_at(p)`` for its boundary token p, and written by the
    indexer's reference writer with the Hadamard rotation into a zeroed pool at slot bt_i[request, p // 4]."""
    from dsv4ref import indexer, rope
    from dsv4ref.indexer import reference as iref

    cfg, L, st = TINY, dec.w["layers"][li], dec.layers[li]
    cw, eps, page = L["idx_comp"], cfg.rms_norm_eps, cfg.index_page
    state = compressor.allocate_state(dec.R, 4, cfg.index_head_dim, device=dec.dev)
    cache = torch.zeros_like(st.idx_cache)
    assert torch.equal(cache, indexer.allocate_k_cache(cache.shape[0], page, device=dec.dev))  # a fresh pool is zeros
    n = 0
    for lj, x, rows in seen:
        if lj != li:
            continue
        xf = x.float()  # attn_norm, as the decoder computes it (fp32 math, bf16 out)
        xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * L["attn_norm"].float()).to(torch.bfloat16)
        out, done = compressor.compress(
            xn,
            cw["wkv"],
            cw["wgate"],
            cw["ape"],
            cw["norm"],
            state.kv,
            state.score,
            rows.req,
            rows.pos,
            ratio=4,
            eps=eps,
            valid=rows.valid,
            backend="reference",
        )
        p, req = rows.pos[done], rows.req[done]
        k = rope.apply_gptj(out[done].to(torch.bfloat16), rotate_at(p), dec.cos_sin["comp"], backend="reference")
        local = p // 4
        slots = st.bt_i[req, local // page].long() * page + local % page
        iref.insert_k(cache, k.contiguous(), slots, block_size=page, hadamard=True)
        n += int(done.sum())
    return cache, n


@pytest.mark.parametrize(
    "rotate_at, same",
    [(_window_start, True), (lambda p: p, False), (lambda p: p // 4, False)],
    ids=["(p//4)*4", "p (planted)", "p//4 (planted)"],
)
def test_indexer_k_cache_holds_keys_rotated_at_the_window_start(indexer_run, rotate_at, same):
    """The decode step's indexer-K pools hold, byte for byte, the reference writer's records of the indexer
    compressor's keys rotated at (p // 4)·4. A wrong position costs the indexer only some
    recall (0.985 → 0.88), which test_indexer_picks_the_float64_top_k would accept; the bytes do not.

    Byte-exact because the decoder ran the torch ops here (its compressor is the same fp32 reference); through
    the Triton compressor the fp32 rows may differ in the last bit, and a bf16 rounding then flips a byte.
    The planted positions (the boundary token p, the row id p // 4) must give other bytes."""
    dec, seen = indexer_run
    steps_boundaries = sum(int(((rows.pos + 1) % 4 == 0)[rows.valid].sum()) for li, _, rows in seen[-9 * 4 :] if li == 1)
    assert steps_boundaries >= 4  # keys written by decode steps, not only by the prefill
    for li in (1, 3):  # the ratio-4 layers
        want, n = _expected_index_k_cache(dec, seen, li, rotate_at)
        assert n == sum(int(dec.lengths[r]) // 4 for r in range(dec.R))  # one key per complete window of 4
        assert torch.equal(dec.layers[li].idx_cache, want) is same, f"layer {li}"


# ------------------------------------------------------------------------------------------------
# the indexer format (FP8 or DeepSeek's FP4) and a config without window-only layers
# ------------------------------------------------------------------------------------------------


def test_index_format_of_the_configs():
    """V4-Flash and V4-Pro take DeepSeek's FP4 indexer (its inference code simulates E2M1 in blocks of 32 on q
    and k); the teaching config keeps FP8 (docs/config.md). V4-Pro's routed scale is 2.5 (its config.json)."""
    from dsv4ref.config import PRO

    assert (FLASH.index_format, PRO.index_format, TINY.index_format) == ("mxfp4", "mxfp4", "fp8")
    assert (FLASH.routed_scaling_factor, PRO.routed_scaling_factor) == (1.5, 2.5)
    assert 0 not in PRO.compress_ratios  # no window-only main layer: only the MTP layer needs theta = 10000
    with pytest.raises(ValueError, match="index_format"):
        TINY.replace(index_format="fp4")


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_index_quant_sim_is_the_cache_format(fmt):
    """The float64 reference's simulation of the indexer format gives, value for value, what the indexer's own
    K writer stores (read back and dequantised): per-block power-of-two scales, RNE to e4m3 / E2M1."""
    from dsv4ref import indexer

    k = randn((40, 128), seed=11, device="cpu", block=32, octaves=12)  # per-block scales over 12 octaves
    k[3, :32] = 0.0  # an all-zero block: the amax floor
    cache = indexer.allocate_k_cache(5, 8, fmt, device="cpu")
    slots = torch.arange(40)
    indexer.insert_k(cache, k, slots, block_size=8, fmt=fmt, backend="reference")
    values, scales = indexer.read_k(cache, slots, block_size=8, fmt=fmt)
    got = indexer.dequantize_k(values, scales).double()
    if fmt == "fp8":
        got = got * scales.double()[:, None]  # the FP8 key scale is applied after the head sum
    want = dense.index_quant_sim(k.double(), fmt)
    assert torch.equal(got, want)
    assert not torch.equal(dense.index_quant_sim(k.double(), "fp8"), dense.index_quant_sim(k.double(), "mxfp4"))


def test_mxfp4_indexer_decode_tracks_the_reference():
    """The decode step with DeepSeek's FP4 indexer: 68-B keys in the indexer pools, agreement with the float64
    reference, and top-k recall against the reference's float64 FP4 simulation at least as high as against the
    unquantised scores. The FP8 and FP4 choices differ on the same inputs (the format is really used)."""
    cfg = TINY.replace(index_format="mxfp4")
    dec, w, recs, _ = run(cfg, steps=2, prompt_lens=(133, 6), decode_backend="reference")
    assert dec.layers[1].idx_cache.shape[1] == 68 * cfg.index_page
    assert all(a.passed for a in agreement(cfg, w, recs, dec.history()))
    toks, topks = dec.history()
    ref = reference_forward(cfg, w, toks[0], topks[0])
    exact, same_format = _topk_recall(dec.history(), ref, "index_scores"), _topk_recall(dec.history(), ref, "index_scores_fmt")
    assert exact >= 0.8 and same_format >= 0.9 and same_format >= exact
    fp8 = Decoder(TINY, w, num_requests=2, capacity=dec.capacity, backend="reference")
    fp8.prefill([toks[0][:133], toks[1][:6]])
    a, b = fp8.history()[1][0][1][:133], topks[0][1][:133]  # layer 1: the same inputs in both decoders
    overlap = sum(len(set(a[p].tolist()) & set(b[p].tolist())) for p in range(67, 133)) / (66 * cfg.index_topk)
    assert 0.8 <= overlap < 1.0


def test_draft_without_a_window_only_main_layer():
    """A config whose main layers are all compressed (V4-Pro: ratios 128, 128, 4, 128, …) still drafts: the MTP
    layer is window-only and reads the theta = 10000 RoPE table, which must exist (a KeyError before)."""
    from dsv4ref import rope
    from dsv4ref.config import PRO

    cfg = TINY.replace(name="pro-like", compress_ratios=PRO.compress_ratios[:4])
    assert 0 not in cfg.compress_ratios and cfg.num_nextn_predict_layers == 1
    w = make_weights(cfg, 0)
    dec = Decoder(cfg, w, num_requests=2, capacity=32, backend="reference")
    assert torch.equal(dec.cos_sin["swa"], rope.cos_sin_cache(cfg.max_position, cfg.rope_dim, cfg.rope_theta, device=dec.dev))
    logits = dec.prefill([list(range(9)), [5, 6, 7]])
    drafts = dec.draft(logits.argmax(-1).cpu(), 2)
    assert drafts.shape == (2, 2) and bool(((drafts >= 0) & (drafts < cfg.vocab_size)).all())
    spec = dec.verify(logits.argmax(-1).cpu(), drafts)  # and the target verifies them
    assert dec.lengths.tolist() == [9 + int(spec.accepted[0]) + 1, 3 + int(spec.accepted[1]) + 1]


# ----------------------------------------------------------------------------------------------------
# V4's weight formats (docs/decode.md#v4s-number-formats)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("moe_path", ["deepseek", "megamoe"])
def test_v4_formats_track_the_float64_reference(moe_path):
    """weight_format="v4" (FP8 projections, FP4 experts on either path) through the torch ops, held to the float64
    reference of the dequantised weights under the v4 tolerances; request 1 crosses a ratio-4 boundary with a
    compressed row. The same run's errors exceed the bf16 tolerance somewhere (the activation quantisers are on
    the budget), or they stay under it: either way they stay under the v4 one."""
    cfg = TINY.replace(weight_format="v4", moe_path=moe_path)
    dec, w, recs, _ = run(cfg, steps=2, prompt_lens=(9, 6), decode_backend="reference")
    assert w["layers"][1]["wq_b"].dtype == torch.float8_e4m3fn and w["layers"][1]["moe"]["w13"].dtype == torch.float4_e2m1fn_x2
    assert w["layers"][1]["wo_a"].dtype == torch.bfloat16 and w["layers"][1]["idx_weights"].dtype == torch.bfloat16
    rows = agreement(cfg, w, recs, dec.history())
    assert all(a.passed and a.tol == decode.tolerances(cfg) for a in rows), rows
    assert all(a.logits_err > 2.0**-7 for a in rows)  # the formats are on the path


def test_v4_weights_are_the_bf16_draw_quantised():
    """make_weights(v4) quantises the bf16 draw with the linear op's quantisers; its exact dequantisation is a bf16
    dict of the same shapes; a bf16 config refuses the v4 dict, naming the entry."""
    from dsv4ref import linear as lin
    from dsv4ref.weights import dequantize_weights

    cfg = TINY.replace(weight_format="v4")
    wb, wv = make_weights(TINY, 0, device="cpu"), make_weights(cfg, 0, device="cpu")
    q, s = lin.quantize_fp8_weight(wb["layers"][2]["wo_b"])
    assert torch.equal(wv["layers"][2]["wo_b"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(wv["layers"][2]["wo_b_scale"].view(torch.uint8), s.view(torch.uint8))
    deq = dequantize_weights(wv, None)
    assert deq["layers"][2]["moe"]["w13"].dtype == torch.bfloat16 and "w13_scale" not in deq["layers"][2]["moe"]
    decode.Decoder(TINY, deq, num_requests=1, capacity=16, device="cpu")  # a valid bf16 dict
    with pytest.raises(TypeError, match=r"\['wqkv_a'\]"):
        decode.Decoder(TINY, wv, num_requests=1, capacity=16, device="cpu")


def test_format_error_measures_the_formats():
    """decode.format_error: the same model in two formats moves the logits by the activation quantisers' order
    (well above bf16 noise, under the v4 tolerance) and each run stays on its float64 reference."""
    r = decode.format_error(steps=1, prompt_lens=(6,))
    assert len(r.steps) == 2 and len(r.parted) == 1
    for s in r.steps:
        assert 2.0**-8 < s.v4_vs_bf16 < decode.LOGITS_TOL_V4
        assert s.bf16_vs_oracle <= LOGITS_TOL and s.v4_vs_oracle <= decode.LOGITS_TOL_V4
    assert "| prefill |" in r.table()
