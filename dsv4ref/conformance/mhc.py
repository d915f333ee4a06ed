"""Conformance cases of mHC: ``mhc.sinkhorn``, ``mhc.pre``, ``mhc.post`` (with the transposed-comb trap),
``mhc.fused_post_pre`` and ``mhc.head`` (docs/mhc.md; the input contract: docs/mhc.md#the-input-contract).

Every function gets: the model's constants, an empty batch (T = 0), dense non-contiguous layouts (streams
stored stream-major, fn and x transposed, comb stored TRANSPOSED in memory: an implementation that reads the
storage as if contiguous applies combᵀᵀ, the classic bug), an odd hidden size with a partial token tile,
a non-symmetric comb (a 4-cycle: comb @ streams and combᵀ @ streams differ) and non-finite input under the
documented policy (value checks off: IEEE propagation; a token whose streams hold a NaN or ±inf gets NaN
post, comb and layer input). Strided slices with gaps and strided ``scale`` / ``base`` cannot travel
through the suite (it hands each case a clone, which keeps a dense layout but not a slice's gaps); they are
in ``tests/test_contract_mhc.py``.

Fused post + pre: its pre part reads the new streams AS STORED in bf16, so an implementation whose fp32 post
rounds one element the other way gets a slightly different pre. Those cases use weights and streams on a
coarse dyadic grid, so that the post's fp32 sums are exact and every correct implementation stores the same
bf16 streams.
"""

from __future__ import annotations

import math

import torch

from ..config import TINY
from ..testing import generator, randn
from .suite import Case

OUTPUTS = {
    "mhc.sinkhorn": lambda res, a: {"comb": res},
    "mhc.pre": lambda res, a: {"post": res[0], "comb": res[1], "layer_input": res[2]},
    "mhc.post": lambda res, a: {"residual": res},
    "mhc.fused_post_pre": lambda res, a: {"residual": res[0], "post": res[1], "comb": res[2], "layer_input": res[3]},
    "mhc.head": lambda res, a: {"out": res},
}

M = TINY.hc_mult
KW = dict(rms_eps=TINY.rms_norm_eps, hc_eps=TINY.hc_eps)
_PRE_TOL = {"post": "mhc", "comb": "mhc", "layer_input": "bf16_out"}
_FUSED_TOL = {"residual": "bf16_out", **_PRE_TOL}


def _stream_major(t: torch.Tensor) -> torch.Tensor:
    """[T, M, Hd] with the streams outermost in memory (strides (Hd, T·Hd, 1)): dense, not contiguous."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims swapped in memory (for comb: the storage holds combᵀ)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _cycle(w: float = 1.0) -> torch.Tensor:
    """The 4-cycle P (P[0,1] = P[1,2] = P[2,3] = P[3,0] = 1: source i -> destination i+1), times w."""
    return torch.roll(torch.eye(M), 1, dims=1) * w


def _grid(shape, seed: int, step: float = 2.0**-4, k: int = 64) -> torch.Tensor:
    """bf16 values j·step, j uniform in [-k, k]: few significant bits, so weighted sums of them with dyadic
    weights are exact in fp32."""
    return (torch.randint(-k, k + 1, shape, generator=generator(seed)).float() * step).to(torch.bfloat16)


def _params(Hd: int, seed: int, head: bool = False):
    g = generator(seed)
    rows = M if head else M * (M + 2)
    fn = torch.randn(rows, M * Hd, generator=g) / math.sqrt(M * Hd)
    scale = torch.tensor([0.5]) if head else torch.tensor([0.7, 0.4, 1.3])
    base = 0.3 * torch.randn(rows, generator=g)
    return fn, scale, base


def _nan_tokens(res: torch.Tensor) -> torch.Tensor:
    """res with a NaN in token 1 and +inf / −inf in token 3 (when present)."""
    res = res.clone()
    res[1, 2, 5] = float("nan")
    if res.shape[0] > 3:
        res[3, 0, 0], res[3, 3, 1] = float("inf"), -float("inf")
    return res


def _legacy_cases() -> dict[str, Case]:
    """The four cases the golden files were first written from, built exactly as then (one generator, in
    this order), so their stored inputs stay valid: {op: case}."""
    g = generator(41)
    T, Hd = 3, TINY.hidden_size
    res = randn((T, M, Hd), seed=42, device="cpu", block=None, octaves=4)
    x = randn((T, Hd), seed=43, device="cpu", block=None, octaves=2)
    fn = torch.randn(M * (M + 2), M * Hd, generator=g) / math.sqrt(M * Hd)
    scale = torch.tensor([0.7, 0.4, 1.3])
    base = 0.3 * torch.randn(M * (M + 2), generator=g)
    out = {
        "mhc.pre": Case(
            "mhc.pre",
            "model_constants",
            dict(residual=res, fn=fn, scale=scale, base=base, **KW),
            ("residual", "fn", "scale", "base"),
            tol=_PRE_TOL,
            why="post_mult 2, eps 1e-6, 20 Sinkhorn passes (#23); RMS of the flattened streams",
        )
    }
    # the 4-cycle trap: comb ≈ P with P[0,1] = P[1,2] = P[2,3] = P[3,0] = 1; new_res_j must be res_{j-1}
    comb = (_cycle() * (1 - 3e-6) + 1e-6).expand(T, M, M).contiguous()
    post = 2 * torch.rand(T, M, 1, generator=g)
    out["mhc.post"] = Case(
        "mhc.post",
        "transposed_comb_trap_4cycle",
        dict(x=x, residual=res, post=post, comb=comb),
        ("x", "residual", "post", "comb"),
        tol={"residual": "bf16_out"},
        why="Σ_i comb[i, j]·res_i, i.e. combᵀ @ res: the 4-cycle catches comb @ res (#22)",
    )
    fn2 = torch.randn(M * (M + 2), M * Hd, generator=g) / math.sqrt(M * Hd)
    out["mhc.fused_post_pre"] = Case(
        "mhc.fused_post_pre",
        "cycle_comb_then_pre",
        dict(x=x, residual=res, post=post, comb=comb, fn=fn2, scale=scale, base=base, **KW),
        ("x", "residual", "post", "comb", "fn", "scale", "base"),
        tol=_FUSED_TOL,
        why="post, then the next sub-layer's pre, in one call",
    )
    hfn = torch.randn(M, M * Hd, generator=g) / math.sqrt(M * Hd)
    out["mhc.head"] = Case(
        "mhc.head",
        "hc_head",
        dict(hidden=res, fn=hfn, scale=torch.tensor([0.5]), base=0.2 * torch.randn(M, generator=g), **KW),
        ("hidden", "fn", "scale", "base"),
        tol={"out": "bf16_out"},
        why="the final mix of the M streams into one: σ(mix·scale + base) + eps, no Sinkhorn",
    )
    return out


def _sinkhorn_cases() -> list[Case]:
    out = []
    g = generator(40)

    def case(name, logits, iters, eps, why, check_values=True):
        out.append(
            Case(
                "mhc.sinkhorn",
                name,
                dict(logits=logits, iters=iters, eps=eps),
                ("logits", "iters", "eps"),
                tol={"comb": "mhc"},
                why=why,
                check_values=check_values,
            )
        )

    case(
        "model_constants_std3",
        torch.randn(64, M, M, generator=g) * 3,
        20,
        TINY.hc_eps,
        "20 passes, eps 1e-6: row softmax + eps, then columns; rows are NOT exactly stochastic (#23)",
    )
    case(
        "one_pass",
        torch.randn(16, M, M, generator=g) * 2,
        1,
        TINY.hc_eps,
        "iters = 1: the softmax pass and one column step only (a port that always runs 20 fails)",
    )
    case(
        "peaked_4cycle",
        (30 * _cycle()).expand(3, M, M).contiguous(),
        20,
        TINY.hc_eps,
        "logits 30·P, P the (non-symmetric) 4-cycle: comb ≈ P, ~1e-6 elsewhere; the wrong axis gives Pᵀ",
    )
    case("empty_batch", torch.zeros(0, M, M), 20, TINY.hc_eps, "no matrices: an empty result, no error")
    case(
        "leading_dims_transposed_layout",
        _transposed(torch.randn(3, 5, M, M, generator=g) * 4),
        20,
        1e-3,
        "[3, 5, 4, 4] stored with the last two dims swapped (strides honoured), a non-model eps 1e-3",
    )
    lg = torch.randn(6, M, M, generator=g)
    lg[1, 2, 3], lg[3, 0, 1], lg[4, 1, :] = float("nan"), float("inf"), -float("inf")
    lg[5, 2, 0] = -float("inf")
    case(
        "nonfinite_checks_off",
        lg,
        20,
        TINY.hc_eps,
        "value checks off: a NaN or +inf logit makes its whole matrix NaN, a row of −inf too; a single −inf "
        "logit is a zero weight before the +eps; the other matrices are unaffected",
        check_values=False,
    )
    return out


def _pre_cases() -> list[Case]:
    out = []
    Hd = TINY.hidden_size

    def case(name, res, fn, scale, base, why, check_values=True, **kw):
        out.append(
            Case(
                "mhc.pre",
                name,
                dict(residual=res, fn=fn, scale=scale, base=base, **KW, **kw),
                ("residual", "fn", "scale", "base"),
                tol=_PRE_TOL,
                why=why,
                check_values=check_values,
            )
        )

    out.append(_legacy_cases()["mhc.pre"])
    res = randn((3, M, Hd), seed=42, device="cpu", block=None, octaves=4)
    case("empty_batch", torch.zeros(0, M, Hd, dtype=torch.bfloat16), *_params(Hd, 43), "T = 0: empty outputs")
    fn, scale, base = _params(Hd, 44)
    case(
        "stream_major_streams_transposed_fn",
        _stream_major(randn((5, M, Hd), seed=45, device="cpu", octaves=6)),
        _transposed(fn),
        scale,
        base,
        "residual stored stream-major, fn column-major (strides honoured)",
    )
    case(
        "odd_hidden_T17",
        randn((17, M, 33), seed=46, device="cpu", octaves=6),
        *_params(33, 47),
        "Hd = 33 (K = 132, no tile multiple) and 17 tokens (a partial second token tile)",
    )
    fn0 = torch.zeros(M * (M + 2), M * Hd)
    base_p = torch.cat([torch.zeros(2 * M), 30 * _cycle().reshape(-1)])
    case(
        "cycle_comb_bias",
        randn((4, M, Hd), seed=48, device="cpu", octaves=4),
        fn0,
        torch.ones(3),
        base_p,
        "fn = 0, comb logits 30·P (the 4-cycle): comb ≈ P, so comb stored transposed (Pᵀ) fails; post = 1",
    )
    case(
        "non_model_constants",
        res,
        *_params(Hd, 49),
        "post_mult 1, 3 Sinkhorn passes: the constants are arguments, not baked in",
        post_mult=1.0,
        sinkhorn_iters=3,
    )
    case(
        "nonfinite_checks_off",
        _nan_tokens(randn((5, M, Hd), seed=50, device="cpu", octaves=4)),
        *_params(Hd, 51),
        "value checks off: tokens 1 (NaN) and 3 (±inf) get NaN post, comb and layer input (the RMS factor of inf "
        "is 0, inf·0 = NaN); tokens 0, 2, 4 are unaffected",
        check_values=False,
    )
    return out


def _post_cases() -> list[Case]:
    out = []
    g = generator(41)
    Hd = TINY.hidden_size

    def case(name, x, res, post, comb, why, check_values=True):
        out.append(
            Case(
                "mhc.post",
                name,
                dict(x=x, residual=res, post=post, comb=comb),
                ("x", "residual", "post", "comb"),
                tol={"residual": "bf16_out"},
                why=why,
                check_values=check_values,
            )
        )

    T = 3
    out.append(_legacy_cases()["mhc.post"])
    res = randn((T, M, Hd), seed=42, device="cpu", block=None, octaves=4)
    case(
        "empty_batch",
        torch.zeros(0, Hd, dtype=torch.bfloat16),
        torch.zeros(0, M, Hd, dtype=torch.bfloat16),
        torch.zeros(0, M),
        torch.zeros(0, M, M),
        "T = 0: an empty residual, no error",
    )
    Ts, H = 6, 33
    sk = torch.softmax(torch.randn(Ts, M, M, generator=g) * 2, dim=-1)  # row-stochastic, not symmetric
    case(
        "odd_hidden_random_comb",
        randn((Ts, H), seed=44, device="cpu", octaves=4),
        randn((Ts, M, H), seed=45, device="cpu", octaves=4),
        2 * torch.rand(Ts, M, generator=g),
        sk,
        "Hd = 33, a random non-symmetric comb, post [T, M]",
    )
    case(
        "transposed_layouts",
        _transposed(randn((T, Hd), seed=46, device="cpu", octaves=4)),
        _stream_major(randn((T, M, Hd), seed=47, device="cpu", octaves=4)),
        _transposed(2 * torch.rand(T, M, generator=g)),
        _transposed(_cycle(0.75).expand(T, M, M) + 0.0625),
        "x and post transposed, streams stream-major, and comb stored TRANSPOSED in memory: reading the storage "
        "as if contiguous applies the reverse cycle",
    )
    case(
        "identity_comb",
        randn((T, Hd), seed=48, device="cpu", octaves=4),
        res,
        torch.full((T, M), 0.5),
        torch.eye(M).expand(T, M, M).contiguous(),
        "comb = I: new stream j = post_j·x + stream j",
    )
    xn = randn((4, Hd), seed=49, device="cpu", octaves=4)
    xn[0, 3], xn[2, 7] = float("nan"), float("inf")
    rn = randn((4, M, Hd), seed=50, device="cpu", octaves=4)
    rn[1, 2, 9] = -float("inf")
    case(
        "nonfinite_checks_off",
        xn,
        rn,
        torch.full((4, M), 0.5),
        torch.full((4, M, M), 0.25),
        "value checks off: IEEE propagation; NaN in x at (t, h) is NaN in every new stream at (t, h), inf stays "
        "inf (post, comb > 0); bf16 NaN is NaN, never −0",
        check_values=False,
    )
    return out


def _fused_cases() -> list[Case]:
    out = []
    Hd = TINY.hidden_size

    def case(name, x, res, post, comb, params, why, check_values=True):
        fn, scale, base = params
        out.append(
            Case(
                "mhc.fused_post_pre",
                name,
                dict(x=x, residual=res, post=post, comb=comb, fn=fn, scale=scale, base=base, **KW),
                ("x", "residual", "post", "comb", "fn", "scale", "base"),
                tol=_FUSED_TOL,
                why=why,
                check_values=check_values,
            )
        )

    out.append(_legacy_cases()["mhc.fused_post_pre"])
    case(
        "empty_batch",
        torch.zeros(0, Hd, dtype=torch.bfloat16),
        torch.zeros(0, M, Hd, dtype=torch.bfloat16),
        torch.zeros(0, M),
        torch.zeros(0, M, M),
        _params(Hd, 53),
        "T = 0: four empty outputs",
    )
    # dyadic weights on a coarse grid: the post's fp32 sums are exact, so every correct port stores the same
    # bf16 streams and its pre sees the same input
    mix = torch.eye(M) * 0.5 + _cycle(0.375) + torch.roll(torch.eye(M), 2, dims=1) * 0.125  # non-symmetric
    Tg = 5
    case(
        "dyadic_comb_transposed_layouts",
        _transposed(_grid((Tg, Hd), 54)),
        _stream_major(_grid((Tg, M, Hd), 55)),
        _transposed(torch.tensor([0.5, 1.0, 1.5, 0.25]).expand(Tg, M).contiguous()),
        _transposed(mix.expand(Tg, M, M).contiguous()),
        (lambda f, s, b: (_transposed(f), s, b))(*_params(Hd, 56)),
        "x, post, fn transposed, streams stream-major, comb stored transposed (0.5·I + 0.375·P + 0.125·P²)",
    )
    To, Ho = 17, 33
    case(
        "odd_hidden_T17",
        _grid((To, Ho), 57),
        _grid((To, M, Ho), 58),
        torch.full((To, M), 0.75),
        mix.expand(To, M, M).contiguous(),
        _params(Ho, 59),
        "Hd = 33, 17 tokens (a partial second token tile)",
    )
    case(
        "non_model_constants",
        _grid((4, Hd), 60),
        _grid((4, M, Hd), 61),
        torch.full((4, M), 0.5),
        mix.expand(4, M, M).contiguous(),
        _params(Hd, 62),
        "post_mult 1, 1 Sinkhorn pass: arguments, not baked in",
    )
    out[-1].inputs.update(post_mult=1.0, sinkhorn_iters=1)
    xn = _grid((4, Hd), 63)
    xn[2, 10] = float("nan")
    case(
        "nonfinite_checks_off",
        xn,
        _grid((4, M, Hd), 64),
        torch.full((4, M), 0.5),
        mix.expand(4, M, M).contiguous(),
        _params(Hd, 65),
        "value checks off: NaN in x of token 2 → NaN in its 4 new streams at that dim → token 2's "
        "post, comb and layer input NaN; tokens 0, 1, 3 unaffected",
        check_values=False,
    )
    return out


def _head_cases() -> list[Case]:
    out = []
    Hd = TINY.hidden_size

    def case(name, hidden, fn, scale, base, why, check_values=True):
        out.append(
            Case(
                "mhc.head",
                name,
                dict(hidden=hidden, fn=fn, scale=scale, base=base, **KW),
                ("hidden", "fn", "scale", "base"),
                tol={"out": "bf16_out"},
                why=why,
                check_values=check_values,
            )
        )

    out.append(_legacy_cases()["mhc.head"])
    case("empty_batch", torch.zeros(0, M, Hd, dtype=torch.bfloat16), *_params(Hd, 66, head=True), "T = 0: empty output")
    fn, scale, base = _params(Hd, 67, head=True)
    case(
        "stream_major_transposed_fn",
        _stream_major(randn((5, M, Hd), seed=68, device="cpu", octaves=6)),
        _transposed(fn),
        scale,
        base,
        "hidden stored stream-major, fn column-major (strides honoured)",
    )
    case(
        "odd_hidden_T17",
        randn((17, M, 33), seed=69, device="cpu", octaves=6),
        *_params(33, 70, head=True),
        "Hd = 33 and 17 tokens (a partial second token tile)",
    )
    # hand-computed (docs/mhc.md#checks, 7): fn picks X[0]; every value ±1, so RMS 1 and mix_0 = ±1
    Hh = 32
    hfn1 = torch.zeros(M, M * Hh)
    hfn1[0, 0] = 1.0
    l3 = math.log(3.0)
    signs = torch.tensor([[1.0, 1, 1, 1], [-1, 1, -1, 1]])
    case(
        "hand_computed_ln3",
        (signs[:, :, None] * torch.ones(2, M, Hh)).to(torch.bfloat16),
        hfn1,
        torch.tensor([l3]),
        torch.tensor([0.0, l3, -l3, 0.0]),
        "gates σ(±ln 3 + base) + 1e-6: out = 2.25 (token 0) and 0.75 (token 1)",
    )
    case(
        "nonfinite_checks_off",
        _nan_tokens(randn((5, M, Hd), seed=71, device="cpu", octaves=4)),
        *_params(Hd, 72, head=True),
        "value checks off: tokens 1 and 3 give NaN rows, the others are unaffected",
        check_values=False,
    )
    return out


def cases() -> list[Case]:
    return _sinkhorn_cases() + _pre_cases() + _post_cases() + _fused_cases() + _head_cases()
