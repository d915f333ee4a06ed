"""The MTP draft layer (dsv4ref.mtp) and speculative decoding with it (dsv4ref.decode.Decoder.speculate).

* greedy verification: the hand-made table of docs/mtp.md, ties to the lowest id, the vectorised rule
  against the loop that states it;
* the draft layer's input: shapes, e_proj broadcast to every stream, hnorm per stream, no embedding at
  position 0; its own hc head and norm; no embedding or LM head of its own;
* speculation == plain greedy decoding, token for token (a divergence is only allowed at a near-tie of the
  plain run's top-2 logits, < 1e-4, and is reported with its gap); forced drafts (all right, one wrong,
  all wrong) and the roll-back of the compressor state after rejected rows.

Each pitfall of docs/mtp.md#pitfalls (P12–P14 of the MoE/MTP list, and the roll-back) names its test here.
"""

import copy

import pytest
import torch

from dsv4ref import decode, mtp
from dsv4ref.config import TINY
from dsv4ref.mtp import reference
from dsv4ref.testing import assert_close, generator, randn

EPS = TINY.rms_norm_eps
M, HD = TINY.hc_mult, TINY.hidden_size


# ----------------------------------------------------------------------------------------------------
# greedy verification
# ----------------------------------------------------------------------------------------------------

TABLE = [  # drafts, target (k + 1), emitted
    ([5, 7, 9], [5, 7, 8, 2], [5, 7, 8]),  # third draft wrong: the target's token there, then stop
    ([5, 7, 9], [5, 7, 9, 3], [5, 7, 9, 3]),  # all agree: the drafts and the bonus token
    ([4, 7, 9], [5, 7, 9, 3], [5]),  # first draft wrong: one token, the target's
    ([], [11], [11]),  # k = 0: plain decoding
    ([8], [8, 1], [8, 1]),
    ([8], [2, 1], [2]),
    ([1, 2, 3, 4], [1, 9, 3, 4, 0], [1, 9]),  # later drafts equal the target's again: no skipping
]


@pytest.mark.parametrize("drafts,target,want", TABLE)
def test_greedy_accept_table(drafts, target, want):
    d, t = torch.tensor(drafts, dtype=torch.int64), torch.tensor(target, dtype=torch.int64)
    got = mtp.greedy_accept(d, t)
    assert got.dtype == torch.int64 and got.tolist() == want
    assert reference.greedy_accept(d, t).tolist() == want  # the loop that states the rule


def test_greedy_accept_matches_the_loop_on_random_cases():
    g = generator(3)
    for _ in range(200):
        k = int(torch.randint(0, 6, (1,), generator=g))
        t = torch.randint(0, 4, (k + 1,), generator=g)
        d = torch.where(torch.rand(k, generator=g) < 0.7, t[:k], torch.randint(0, 4, (k,), generator=g))
        assert mtp.greedy_accept(d, t).tolist() == reference.greedy_accept(d, t).tolist()
        assert mtp.greedy_accept(d.int(), t.int()).dtype == torch.int64


def test_target_ties_go_to_the_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    assert mtp.greedy_tokens(logits).tolist() == [1, 0]


def test_greedy_accept_rejects_bad_arguments():
    with pytest.raises(ValueError, match="target"):
        mtp.greedy_accept(torch.tensor([1, 2]), torch.tensor([1, 2]))  # needs k + 1
    with pytest.raises(TypeError, match="drafts"):
        mtp.greedy_accept(torch.tensor([1.0]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="drafts"):
        mtp.greedy_accept(torch.tensor([[1]]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=">= 0"):
        mtp.greedy_accept(torch.tensor([-1]), torch.tensor([1, 2]))


# ----------------------------------------------------------------------------------------------------
# the draft layer's input and head
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def w():
    return decode.make_weights(TINY, 0, device="cpu")


def _input(wm, T=5, seed=0, **over):
    h = randn((T, M, HD), seed=seed, device="cpu", block=None, octaves=4)
    e = randn((T, HD), seed=seed + 1, device="cpu", block=None, octaves=0)
    args = dict(
        h_prev=h,
        embed_rows=e,
        positions=torch.arange(3, 3 + T),
        enorm=wm["enorm"],
        hnorm=wm["hnorm"],
        e_proj=wm["e_proj"],
        h_proj=wm["h_proj"],
        eps=EPS,
    )
    args.update(over)
    return args


def test_draft_input_shapes_and_the_flat_stash(w):
    """h_prev (T, M·Hd) (vLLM's stash) or (T, M, Hd) → X (T, M, Hd); logits (T, V)."""
    a = _input(w["mtp"])
    X = mtp.draft_input(**a)
    assert X.shape == (5, M, HD) and X.dtype == torch.bfloat16
    flat = mtp.draft_input(**(a | dict(h_prev=a["h_prev"].reshape(5, M * HD))), hc_mult=M)
    assert torch.equal(flat, X)
    hc = w["mtp"]["hc_head"]
    logits = mtp.draft_logits(X, hc["fn"], hc["scale"], hc["base"], w["mtp"]["norm"], w["lm_head"], backend="reference")
    assert logits.shape == (5, TINY.vocab_size) and logits.dtype == torch.float32
    with pytest.raises(ValueError, match="hc_mult"):
        mtp.draft_input(**(a | dict(h_prev=a["h_prev"].reshape(5, M * HD))))


def test_e_proj_is_broadcast_to_every_stream(w):
    """P14: with h_proj = 0 every stream of X is e_proj(enorm(e)), the same for all M."""
    wm = w["mtp"]
    g = generator(4)
    e_proj = (torch.randn(HD, HD, generator=g) / HD**0.5).to(torch.bfloat16)
    X = mtp.draft_input(**_input(wm, h_proj=torch.zeros(HD, HD, dtype=torch.bfloat16), e_proj=e_proj))
    for m in range(1, M):
        assert torch.equal(X[:, m], X[:, 0])
    want = reference.draft_input(
        *[_input(wm, e_proj=e_proj)[k] for k in ("h_prev", "embed_rows", "positions")],
        wm["enorm"],
        wm["hnorm"],
        e_proj,
        torch.zeros(HD, HD),
        eps=EPS,
        dtype=torch.float64,
    )
    assert_close(X[:, 0], want[:, 0], "bf16_gemm")  # the normed e rounded to bf16 before a bf16 GEMM
    assert X[:, 0].abs().sum() > 0


def test_hnorm_is_per_stream(w):
    """P14: with e_proj = 0, scaling the streams of h_prev by different constants changes nothing (an RMSNorm
    per stream); a norm over the flattened M·Hd would shrink the small streams."""
    wm = w["mtp"]
    zero = torch.zeros(HD, HD, dtype=torch.bfloat16)
    a = _input(wm, e_proj=zero)
    scaled = (a["h_prev"].float() * torch.tensor([1.0, 4.0, 0.25, 64.0])[None, :, None]).to(torch.bfloat16)
    assert_close(mtp.draft_input(**(a | dict(h_prev=scaled))), mtp.draft_input(**a), "bf16_out")  # eps, rsqrt ulps
    # the wrong norm (over M·Hd) is not scale-free per stream
    flat = scaled.float().reshape(5, -1)
    wrong = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)).reshape(5, M, HD)
    right = reference.rms_norm(scaled.float(), torch.ones(HD), EPS)
    assert not torch.allclose(wrong, right, rtol=0.1)


def test_position_zero_embeds_the_token_unless_zero_first(w):
    """The draft row at position 0 (the first prompt row) embeds its token as every row does (DeepSeek's
    MTPBlock); with ``zero_first=True`` (vLLM's convention) it gets e = 0 there and other rows keep theirs."""
    wm = w["mtp"]
    a = _input(wm, positions=torch.tensor([0, 1, 2, 0, 5]))
    h_only = mtp.draft_input(**(a | dict(embed_rows=torch.zeros(5, HD, dtype=torch.bfloat16))))
    assert not torch.equal(mtp.draft_input(**a)[[0, 3]], h_only[[0, 3]])
    X = mtp.draft_input(**a, zero_first=True)
    assert torch.equal(X[[0, 3]], h_only[[0, 3]])
    assert not torch.equal(X[[1, 2, 4]], h_only[[1, 2, 4]])
    assert torch.equal(X[[1, 2, 4]], mtp.draft_input(**a)[[1, 2, 4]])


def test_projections_are_summed_in_bf16(w):
    """DeepSeek adds the two bf16 projection outputs: X = bf16(bf16(h_proj(hm)) + bf16(e_proj(e)))."""
    a = _input(w["mtp"])
    hm = reference.rms_norm(a["h_prev"], a["hnorm"], EPS).to(torch.bfloat16).float()
    e = reference.rms_norm(a["embed_rows"], a["enorm"], EPS).to(torch.bfloat16).float()
    hp = (hm @ a["h_proj"].float().T).to(torch.bfloat16)
    ep = (e @ a["e_proj"].float().T).to(torch.bfloat16)
    assert torch.equal(mtp.draft_input(**a), hp + ep[:, None, :])  # a bf16 add


def test_draft_layer_uses_its_own_head_and_norm(w):
    """P12: the MTP's hc_head and norm are its own parameters; the main model's give other logits."""
    wm = w["mtp"]
    X = mtp.draft_input(**_input(wm))
    own = mtp.draft_logits(X, *wm["hc_head"].values(), wm["norm"], w["lm_head"], backend="reference")
    main = mtp.draft_logits(X, *w["hc_head"].values(), w["final_norm"], w["lm_head"], backend="reference")
    assert list(wm["hc_head"]) == ["fn", "scale", "base"]
    assert not torch.equal(wm["norm"], w["final_norm"]) and not torch.equal(wm["hc_head"]["fn"], w["hc_head"]["fn"])
    assert (own - main).abs().max() > 1e-3


@pytest.mark.parametrize("swap", ["hc_head", "norm"])
def test_the_decoders_draft_head_reads_the_mtp_parameters(monkeypatch, swap):
    """P12 in the Decoder: its draft logits come from the MTP layer's own hc_head and norm. Giving the MTP
    layer the main model's hc_head (or final norm) must change the draft logits; a Decoder that built its
    draft head from the main model's parameters would not notice the swap."""
    seen = []
    greedy = mtp.greedy_tokens
    monkeypatch.setattr(mtp, "greedy_tokens", lambda logits: seen.append(logits.clone()) or greedy(logits))

    def draft_logits(weights):
        seen.clear()
        dec = decode.Decoder(TINY, weights, num_requests=2, capacity=16, seed=0, backend="reference")
        nxt = dec.prefill([[5, 9, 2, 7, 1], [3, 8, 4]]).argmax(-1).cpu()
        dec.draft(nxt, 2)
        return torch.cat(seen)

    w = decode.make_weights(TINY, 0)
    other = copy.copy(w) | {"mtp": dict(w["mtp"])}
    other["mtp"][swap] = w["hc_head"] if swap == "hc_head" else w["final_norm"]
    own, main = draft_logits(w), draft_logits(other)
    assert own.shape == main.shape and own.shape[1] == TINY.vocab_size
    assert (own - main).abs().max() > 1e-3, f"the draft logits do not depend on the MTP layer's {swap}"


def test_draft_layer_shares_the_embedding_and_lm_head(w):
    """P13: the MTP weights hold no embedding and no LM head (the draft layer reads the target's). A loader
    that left an MTP head of its own at zeros drafts token 0 everywhere (all-zero logits, ties to the lowest
    id) and nothing is accepted."""
    assert not {"embed", "lm_head", "head"} & set(w["mtp"])
    X = mtp.draft_input(**_input(w["mtp"]))
    zero = mtp.draft_logits(
        X, *w["mtp"]["hc_head"].values(), w["mtp"]["norm"], torch.zeros_like(w["lm_head"]), backend="reference"
    )
    drafts = mtp.greedy_tokens(zero)
    assert drafts.tolist() == [0] * 5
    target = torch.tensor([17, 3, 9, 40, 2, 6])
    assert mtp.greedy_accept(drafts, target).tolist() == [17]  # acceptance 0


# ----------------------------------------------------------------------------------------------------
# speculative decoding in the decode step
# ----------------------------------------------------------------------------------------------------

PROMPTS = (126, 9)  # request 0's verification rows cross the ratio-128 boundary at position 127
STEPS = 8


@pytest.fixture(scope="module")
def plain():
    dec, w, recs, _ = decode.run(TINY, steps=STEPS, prompt_lens=PROMPTS, decode_backend="reference")
    return dec, recs


def _near_tie_report(plain_recs, r, step):
    top2 = plain_recs[step + 1][2][r].double().topk(2).values
    return float(top2[0] - top2[1])


def test_speculation_equals_plain_decoding(plain):
    """Greedy speculation emits exactly the plain greedy tokens: each emitted token is the target's argmax
    at its position, computed from the same tokens. A divergence would only be acceptable at a near-tie
    (top-2 gap < 1e-4 in the plain run), and is reported with its gap."""
    dec0, recs = plain
    spec, _, srecs, _ = decode.run_speculative(TINY, steps=STEPS, k=3, prompt_lens=PROMPTS, decode_backend="reference")
    for r in range(len(PROMPTS)):
        n0 = PROMPTS[r]
        want = dec0.tokens[r, n0 : n0 + STEPS].tolist()
        got = spec.generated[r][:STEPS]
        if got != want:
            s = next(i for i in range(STEPS) if got[i] != want[i])
            gap = _near_tie_report(recs, r, s - 1) if s else float("nan")
            assert gap < 1e-4, f"request {r}: speculation changed token {s} ({want[s]} -> {got[s]}), plain top-2 gap {gap:.3g}"
            pytest.xfail(f"request {r}: near-tie at generated token {s}, plain top-2 logit gap {gap:.3g}")
    assert spec.spec.accepted > 0, "no draft was accepted: the test would not exercise accepted rows"
    assert spec.spec.emitted == spec.spec.accepted + spec.spec.rounds * len(PROMPTS)
    # the speculative records (accepted rows only) hold the float64 reference like a plain run's
    rows = decode.agreement(TINY, spec.w, srecs, spec.history())
    assert all(a.passed for a in rows if a.n)


@pytest.fixture(scope="module")
def prefilled(plain):
    """A fresh Decoder with the plain run's prompts prefilled (copied by each test that uses it)."""
    dec0, _ = plain
    dec = decode.Decoder(
        TINY, decode.make_weights(TINY, 0), num_requests=len(PROMPTS), capacity=dec0.capacity, seed=0, backend="reference"
    )
    toks0, _ = dec0.history()
    logits = dec.prefill([toks0[r][:n] for r, n in enumerate(PROMPTS)])
    return dec, logits.argmax(-1).cpu()


@pytest.mark.parametrize("corrupt", [None, 1, 0])
def test_forced_drafts_and_the_rollback(plain, prefilled, corrupt):
    """Drafts taken from the plain run (all accepted, plus the bonus), with draft ``corrupt`` wrong (the ones
    after it rejected), or the first one wrong. After each round the compressor rings hold, for every
    position still in the request's history, what the plain run holds there: the rejected rows' writes were
    undone (without that the next boundary would read a rejected token's kv). The run stays short of the
    ratio-128 ring's wrap, so the ratio-4 rings carry the check."""
    dec0, _ = plain
    k = 3
    dec, nxt = copy.deepcopy(prefilled)
    toks0, _ = dec0.history()
    for _ in range(2):
        L = dec.lengths.clone()
        drafts = torch.stack([toks0[r][int(L[r]) + 1 : int(L[r]) + 1 + k] for r in range(len(PROMPTS))])
        if corrupt is not None:
            drafts[:, corrupt] = (drafts[:, corrupt] + 1) % TINY.vocab_size
        sp = dec.verify(nxt, drafts)
        want_m = k if corrupt is None else corrupt
        assert sp.accepted.tolist() == [want_m] * len(PROMPTS)
        for r in range(len(PROMPTS)):  # (the plain run stops before the last round's bonus token)
            want = toks0[r][int(L[r]) + 1 : int(L[r]) + 2 + want_m].tolist()
            assert sp.emitted[r].tolist()[: len(want)] == want and len(want) >= want_m
        nxt = sp.next
    assert (dec.lengths == L + want_m + 1).all()
    ref, _ = copy.deepcopy(prefilled)  # plain steps to the same lengths, with the same tokens
    while int(ref.lengths[0]) < int(dec.lengths[0]):
        ref.step(torch.stack([toks0[r][int(ref.lengths[r])] for r in range(len(PROMPTS))]))
    for li, st in enumerate(dec.layers):
        for key in ("ring", "idx_ring"):
            if getattr(st, key) is None:
                continue
            n = getattr(st, key).kv.shape[1]
            for r in range(len(PROMPTS)):
                p = torch.arange(max(0, int(dec.lengths[r]) - n), int(dec.lengths[r]))
                got, want = getattr(st, key).kv[r, p % n], getattr(ref.layers[li], key).kv[r, p % n]
                # the same tokens, batched differently (k + 1 rows per call): bf16 activations may differ by an
                # ulp, and an ulp can flip an e4m3 rounding of a cached row, so deeper layers drift by ~1 %;
                # a rejected token's kv left in a ring row is another token's (relative error ~1.4)
                assert_close(got, want, "decode_step", f"layer {li} {key} request {r}")


def test_speculate_checks_its_arguments(plain):
    dec0, _ = plain
    dec = decode.Decoder(TINY, decode.make_weights(TINY, 0), num_requests=2, capacity=32, backend="reference")
    logits = dec.prefill([[1, 2, 3], [4]])
    nxt = logits.argmax(-1)
    with pytest.raises(ValueError, match="k"):
        dec.draft(nxt, 8)
    with pytest.raises(ValueError, match="drafts"):
        dec.verify(nxt, torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="next_ids"):
        dec.speculate(nxt[:1], 2)
    d = dec.draft(nxt, 2)
    with pytest.raises(ValueError, match="target step"):
        dec.draft(nxt, 2)  # the draft layer has read everything the target verified
    dec.verify(nxt, d)
    no_mtp = decode.Decoder(TINY.replace(num_nextn_predict_layers=0), num_requests=1, capacity=16, backend="reference")
    with pytest.raises(ValueError, match="no MTP layer"):
        no_mtp.draft(torch.tensor([1]), 1)


def test_conformance_suite_has_teeth():
    """The MTP's conformance cases pass, and fail a verification that emits every row's target token (no stop at
    the first mismatch) or a draft input with the norm over M·Hd."""
    from dsv4ref import conformance

    rows = conformance.run(cases="mtp")
    assert len({(r.op, r.case) for r in rows}) >= 8 and all(r.passed for r in rows), conformance.format_report(rows)

    def no_stop(drafts, target):
        return target.to(torch.int64).clone()

    bad = {r.case for r in conformance.run({"mtp.greedy_accept": no_stop}, "mtp") if not r.passed}
    assert bad == {"third_draft_wrong", "first_draft_wrong", "no_skipping_after_a_mismatch"}

    def flat_norm(h_prev, embed_rows, positions, enorm, hnorm, e_proj, h_proj, *, eps, hc_mult=None):
        T, Hd = h_prev.shape[0], hnorm.shape[0]
        hf = h_prev.reshape(T, -1).float()  # P14: one RMS over all M·Hd values
        hm = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).reshape(T, -1, Hd) * hnorm
        e = reference.rms_norm(torch.where((positions == 0)[:, None], 0.0, embed_rows.float()), enorm, eps)
        x = hm.bfloat16().float() @ h_proj.float().T + (e.bfloat16().float() @ e_proj.float().T)[:, None, :]
        return x.bfloat16()

    bad = {r.case for r in conformance.run({"mtp.draft_input": flat_norm}, "mtp") if not r.passed}
    assert "streams_over_octaves_position0" in bad


def test_draft_input_with_v4s_fp8_projections(w):
    """V4's format: e_proj / h_proj in FP8 (128x128 scales) behind the 1x128 activation quantiser. Against the
    float64 draft input on the dequantised weights and unquantised rows: the "fp8_activations" row per row
    (two e4m3 roundings of the inputs; the bf16 output rounding is small next to them), and not the bf16
    path's bits (the quantiser ran)."""
    from dsv4ref import linear as lin

    wm = w["mtp"]
    (qe, se), (qh, sh) = lin.quantize_fp8_weight(wm["e_proj"].cpu()), lin.quantize_fp8_weight(wm["h_proj"].cpu())
    a = _input(wm, T=4, seed=7, e_proj=qe, h_proj=qh)
    a = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items()} | dict(
        enorm=wm["enorm"].cpu(), hnorm=wm["hnorm"].cpu()
    )
    X = mtp.draft_input(**a, e_proj_scale=se, h_proj_scale=sh)
    want = reference.draft_input(
        *[a[k] for k in ("h_prev", "embed_rows", "positions", "enorm", "hnorm")],
        lin.dequantize_fp8_weight(qe, se).double(),
        lin.dequantize_fp8_weight(qh, sh).double(),
        eps=EPS,
        dtype=torch.float64,
    )
    assert_close(X, want, "fp8_activations")  # per row
    bf16 = dict(a, e_proj=lin.dequantize_fp8_weight(qe, se).bfloat16(), h_proj=lin.dequantize_fp8_weight(qh, sh).bfloat16())
    assert not torch.equal(X, mtp.draft_input(**bf16))
    with pytest.raises(TypeError, match="e_proj"):
        mtp.draft_input(**a, h_proj_scale=sh)  # an FP8 e_proj without its scale is not a bf16 weight


def test_speculation_in_v4s_formats_emits_the_greedy_tokens():
    """With V4's formats (the draft layer's e_proj / h_proj and its block's projections FP8, its experts FP4)
    greedy speculation still emits exactly the plain greedy tokens."""
    cfg = TINY.replace(weight_format="v4")
    plain, _, _, _ = decode.run(cfg, steps=3, prompt_lens=(6,), decode_backend="reference")
    spec, _, _, _ = decode.run_speculative(cfg, steps=3, k=2, prompt_lens=(6,), decode_backend="reference")
    assert spec.w["mtp"]["e_proj"].dtype == torch.float8_e4m3fn
    assert spec.generated[0][:3] == plain.tokens[0, 6:9].tolist()
