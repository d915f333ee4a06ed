"""The float64 dense reference of the decode step: one request's whole sequence, every position a query.

Same weights and equations as the decode path (:mod:`.model`), but **no FP8, no paging and no sparsity**
beyond the causal window and the top-k ids it is given (the ones the indexer chose, so both sides attend
to the same rows). It computes the whole sequence at once, where the decode path goes token by token
through caches, and shares no code with it: its RoPE is its own float64 rotation (not the fp32 tables),
its compressor works on blocks of r tokens (not a ring). The mHC pieces are the mHC op's own readable
references run at float64 (they are held to an independent oracle in ``tests/test_mhc.py``), and so is the
MoE's, fed the expert ids the decode path chose (as the top-k ids: both sides then run the same experts).
The MoE's FP8 input staging is part of its definition (the experts read e4m3 activations with UE8M0
scales), so the reference stages too; what it leaves out are the bf16 roundings.

Per layer l with ratio r, for all L positions p at once (``docs/decode.md#one-step-op-by-op``)::

    x            = mHC pre(Hs)                              (L, Hd)       [mhc reference, float64]
    x            = RMSNorm(x);  [qr | kv] = x·[W_qa ; W_kv]ᵀ;  qr, kv = RMSNorm(qr), RMSNorm(kv)
    q            = rope(RMSNorm(qr·W_qbᵀ) per head, p)      (L, H, 512)   RoPE on dims 448..511
    k            = rope(kv, p)                              (L, 512)      the window rows
    c            = rope(compress(x), (p // r)·r)            (L // r, 512) the compressed rows
    candidates   = window (p − W, p] ∪ compressed rows {top-k ids (r = 4) | all n_c = (p+1)//r (r = 128)}
    o            = softmax(q·kᵀ·scale) @ k · σ(lse − sink)   (L, H, 512)   K = V; the sink in the denominator
    a            = o_proj(rope⁻¹(o, p))                     (L, Hd)       grouped: wo_a per group, then wo_b
    Hs           = mHC post(a);  x = mHC pre(Hs);  Hs = mHC post(MoE(RMSNorm(x)))   [moe reference, float64]
    logits       = lm_head(RMSNorm(hc_head(Hs)))            (L, V)

``bugs`` injects known mistakes on purpose (to show that the agreement check has teeth), ``fp8_kv``
stores the KV rows as the cache does (e4m3 NoPE with UE8M0 scales, bf16 RoPE), which removes the FP8
part of the error budget. The indexer's scores come twice: unquantised, and with q and k through the
config's indexer format (``cfg.index_format``: FP8, or DeepSeek's FP4, simulated in float64 by
:func:`index_quant_sim`), for recall checks of the decode path's top-k.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange

from .. import mhc, moe
from ..compressor import compress_sequence
from ..config import Config
from ..device import HOST
from ..formats import E4M3_MAX, KV_AMAX_FLOOR, NOPE_DIM, QUANT_BLOCK
from ..fp8.reference import div_rn
from ..rope import yarn_correction_range
from ..weights import check_config, dequantize_weights, layer_ratio

__all__ = [
    "reference_forward",
    "REFERENCE_BUGS",
    "block",
    "moe_f64",
    "compress",
    "inv_freq",
    "rope",
    "fp8_kv_sim",
    "index_scores",
    "index_quant_sim",
]

#: deliberate bugs :func:`reference_forward` can inject, to show the agreement check has teeth
REFERENCE_BUGS = ("no_sink", "no_inv_rope", "comb_not_transposed", "no_compressed", "rope_neox")


def reference_forward(
    cfg: Config,
    weights: dict,
    tokens: torch.Tensor,
    topk: dict | None = None,
    bugs=(),
    fp8_kv: bool = False,
    experts: dict | None = None,
) -> dict:
    """Float64 full-sequence forward of one request.

    Args:
        cfg, weights: the config and :func:`dsv4ref.decode.make_weights` dict (any device).
        tokens: (L,) int token ids.
        topk: {layer: (L, K_top) local compressed ids, −1 padded} for every ratio-4 layer (the indexer's
            choice, e.g. from :meth:`dsv4ref.decode.Decoder.history`); ratio-128 layers use all rows.
        bugs: names from :data:`REFERENCE_BUGS`.
        fp8_kv: simulate the cache's FP8 storage of the KV rows (window and compressed).
        experts: {layer: (L, K) expert ids} the decode path's MoE chose (``Decoder.history().experts``), so
            both sides run the same experts (the weights are still the reference's own float64 scores at
            those ids); None: the reference routes by itself (a near-tie between the K-th and (K+1)-th
            expert then flips on rounding noise, and that token's FFN output is a different one).

    Returns:
        dict(logits (L, V), attn [per layer (L, Hd)], index_scores {layer: (L, n_c) unquantised indexer
        logits, −inf where not visible}, index_scores_fmt {layer: the same with q and k quantised in
        ``cfg.index_format`` (simulated, after the Hadamard rotation)}, hidden (L, M, Hd) the pre-hc_head residual (what the MTP layer
        reads), experts {layer: (L, K) the ids used}), all float64 on the CPU (ids int32).
    """
    check_config(cfg)
    for b in bugs:
        if b not in REFERENCE_BUGS:
            raise ValueError(f"bugs: {b!r} is not one of {REFERENCE_BUGS}")
    w = dequantize_weights(weights, torch.float64)  # V4's formats: the values the codes stand for, exactly
    tokens = torch.as_tensor(tokens, dtype=torch.int64).cpu()
    L, M, eps = tokens.shape[0], cfg.hc_mult, cfg.rms_norm_eps
    Hs = w["embed"][tokens][:, None, :].expand(L, M, -1).clone()  # (L, M, Hd): the embedding, M times
    out = dict(attn=[], index_scores={}, index_scores_fmt={}, experts={})
    for li, Lw in enumerate(w["layers"]):
        r = layer_ratio(cfg, li)
        if r == 4 and (topk is None or li not in topk):
            raise ValueError(f"topk: layer {li} has ratio 4; pass the indexer's top-k ids for it")
        Hs, a, sc, ids = block(
            cfg,
            Lw,
            r,
            Hs,
            tokens,
            topk=None if topk is None else topk.get(li),
            bugs=bugs,
            fp8_kv=fp8_kv,
            experts=None if experts is None else experts.get(li),
            hash_layer=li < cfg.num_hash_layers,
            layer=li,
        )
        out["attn"].append(a)
        out["experts"][li] = ids
        if sc is not None:
            out["index_scores"][li], out["index_scores_fmt"][li] = sc
    hp = w["hc_head"]
    out["hidden"] = Hs
    y = mhc.reference.head(Hs, hp["fn"], hp["scale"], hp["base"], dtype=torch.float64, rms_eps=eps, hc_eps=cfg.hc_eps)
    out["logits"] = rms_norm(y, w["final_norm"], eps) @ w["lm_head"].T
    return out


def block(
    cfg: Config,
    Lw: dict,
    r: int,
    Hs: torch.Tensor,
    tokens: torch.Tensor,
    *,
    topk=None,
    bugs=(),
    fp8_kv: bool = False,
    experts=None,
    hash_layer: bool = False,
    layer: int = 0,
    positions=None,
):
    """One V4 block in float64 over a whole sequence: mHC pre → attention → mHC post, mHC pre → MoE → mHC post.

    Args: ``Lw`` one layer's weights (float64, CPU), ``r`` its ratio, ``Hs`` (L, M, Hd) the streams in,
    ``tokens`` (L,) (a hash layer routes by them), ``topk`` (L, K_top) for ratio 4, ``experts`` (L, K) ids to
    use (None: route here), ``positions`` (L,) (default 0..L−1). Returns ``(Hs, attn (L, Hd), index_scores
    or None, expert ids (L, K) int32)``; index_scores (ratio 4) is the pair (unquantised, in
    ``cfg.index_format``) of :func:`index_scores`."""
    L, H, W, eps = Hs.shape[0], cfg.num_heads, cfg.window, cfg.rms_norm_eps
    neox = "rope_neox" in bugs
    pos = torch.arange(L, device=HOST) if positions is None else positions
    inv = inv_freq(cfg, r)
    mk = dict(rms_eps=eps, hc_eps=cfg.hc_eps)

    def mhc_post(x, Hs, post, comb):
        if "comb_not_transposed" in bugs:
            comb = comb.transpose(-1, -2)
        return mhc.reference.post(x, Hs, post, comb, dtype=torch.float64)

    def mhc_pre(Hs, p):  # -> (post, comb, x)
        return mhc.reference.pre(
            Hs, p["fn"], p["scale"], p["base"], sinkhorn_iters=cfg.hc_sinkhorn_iters, dtype=torch.float64, **mk
        )

    post, comb, x = mhc_pre(Hs, Lw["hc_attn"])
    # attention: projections, norms, RoPE
    x = rms_norm(x, Lw["attn_norm"], eps)
    qkv = x @ Lw["wqkv_a"].T
    qr = rms_norm(qkv[:, : cfg.q_lora_rank], Lw["q_norm"], eps)
    kv = rms_norm(qkv[:, cfg.q_lora_rank :], Lw["kv_norm"], eps)
    q = rearrange(qr @ Lw["wq_b"].T, "l (h d) -> l h d", h=H)
    q = rope(rms_norm(q, None, eps), pos, inv, neox=neox)
    k = rope(kv, pos, inv, neox=neox)
    if fp8_kv:
        k = fp8_kv_sim(k)
    # candidates of each position: its window (L, W) and its compressed rows (L, n_sel)
    j = torch.arange(L, device=HOST)
    win = j[:, None] - W + 1 + torch.arange(W, device=HOST)[None, :]
    cand, ok = [k[win.clamp(min=0)]], [win >= 0]
    scores = None
    if r > 1 and "no_compressed" not in bugs:
        c, cp = compress(Lw["comp"], r, x, eps)
        ck = rope(c, cp - (r - 1), inv, neox=neox)  # rotated at (p // r)·r, the window's first position
        if fp8_kv:
            ck = fp8_kv_sim(ck)
        n_c = (j + 1) // r
        if r == 4:
            sel = torch.as_tensor(topk).long().cpu()
            if tuple(sel.shape[:1]) != (L,):
                raise ValueError(f"topk[{layer}]: expected {L} rows, got shape {tuple(sel.shape)}")
            if bool(((sel >= n_c[:, None]) & (sel >= 0)).any()):
                raise ValueError(f"topk[{layer}]: an id is not yet visible (id >= (p+1)//4): causal mask broken")
            scores = tuple(index_scores(cfg, Lw, x, qr, inv, pos, fmt=f) for f in (None, cfg.index_format))
        else:
            sel = torch.arange(max(1, L // r), device=HOST)[None, :].expand(L, -1)
            sel = torch.where(sel < n_c[:, None], sel, -1)
        if c.shape[0]:
            cand.append(ck[sel.clamp(min=0)])
            ok.append(sel >= 0)
    kk, okk = torch.cat(cand, 1), torch.cat(ok, 1)  # (L, N, 512), (L, N)
    # one softmax over all candidates; K = V; the sink only in the denominator
    s = torch.einsum("lhd,lnd->lhn", q, kk) * cfg.softmax_scale
    s = s.masked_fill(~okk[:, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("lhn,lnd->lhd", torch.exp(s - lse[..., None]), kk)
    if "no_sink" not in bugs:
        o = o * torch.sigmoid(lse - Lw["sink"])[..., None]
    if "no_inv_rope" not in bugs:
        o = rope(o, pos, inv, inverse=True, neox=neox)
    # grouped o-projection: contiguous head groups, wo_a per group, then wo_b
    z = torch.einsum("lgk,gok->lgo", rearrange(o, "l (g h) d -> l g (h d)", g=cfg.o_groups), Lw["wo_a"])
    a = rearrange(z, "l g o -> l (g o)") @ Lw["wo_b"].T
    # the MoE feed-forward
    Hs = mhc_post(a, Hs, post, comb)
    post, comb, x = mhc_pre(Hs, Lw["hc_ffn"])
    y, ids = moe_f64(
        cfg, Lw["moe"], rms_norm(x, Lw["ffn_norm"], eps), tokens, experts, hash_layer, staged=cfg.weight_format != "v4"
    )
    return mhc_post(y, Hs, post, comb), a, scores, ids


def moe_f64(
    cfg: Config, m: dict, x: torch.Tensor, tokens: torch.Tensor, experts=None, hash_layer: bool = False, staged: bool = True
):
    """The MoE feed-forward in float64 (``docs/moe.md``): routing on float64 scores, the FP8 input staging
    (the experts' defined input with bf16 weights, so both sides read the same e4m3 activations; ``staged=False``,
    V4's formats: the experts read x itself, and every activation quantiser is part of the error measured),
    experts and shared expert without roundings. ``experts``: (L, K) ids to use instead of routing (their
    weights are still this function's scores at those ids). Returns ``(y (L, Hd) float64, ids (L, K) int32)``."""
    if experts is not None:
        table, ids_in = torch.as_tensor(experts).long().cpu(), torch.arange(x.shape[0], device=HOST)
    else:
        table, ids_in = (m["tid2eid"], tokens) if hash_layer else (None, None)
    ids, wts = moe.reference.route(
        x,
        m["gate_weight"],
        m["bias"],
        k=cfg.num_experts_per_tok,
        routed_scale=cfg.routed_scaling_factor,
        hash_table=table,
        input_ids=ids_in,
        dtype=torch.float64,
    )
    x_fp8, x_sf, ids64, _ = moe.reference.stage(x, ids, wts.float())
    if not staged:
        x_fp8 = x_sf = None
    y = moe.reference.experts(
        x,
        x_fp8,
        x_sf,
        ids64,
        wts,
        m["w13"],
        m["w2"],
        m["shared_w13"],
        m["shared_w2"],
        swiglu_limit=cfg.swiglu_limit,
        dtype=torch.float64,
    )
    return y, ids


# ====================================================================================================
# the pieces, float64
# ====================================================================================================


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def inv_freq(cfg: Config, ratio: int) -> torch.Tensor:
    """(32,) float64: θ^(−2i/64) for window-only layers (θ = rope_theta); compressed layers use
    θ = compress_rope_theta with YaRN, a linear ramp between the original frequency (pairs below ``low``)
    and the one slowed down by ``factor`` (pairs above ``high``)."""
    R = cfg.rope_dim
    i = torch.arange(R // 2, dtype=torch.float64, device=HOST)
    if ratio == 0:
        return cfg.rope_theta ** (-2 * i / R)
    th = cfg.compress_rope_theta
    pf = th ** (2 * i / R)
    low, high = yarn_correction_range(R, th, cfg.yarn)
    extra, inter = 1 / pf, 1 / (cfg.yarn["factor"] * pf)
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    return inter * ramp + extra * (1 - ramp)


def rope(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, inverse=False, neox=False) -> torch.Tensor:
    """GPT-J rotation (pairs 2i, 2i+1) of the LAST 64 dims of x (L, ..., D) at positions pos (L,), by −angle
    if ``inverse``. ``neox``: the wrong pairing (i, i + 32), a bug to inject."""
    f = pos.double()[:, None] * inv[None, :]  # (L, 32)
    f = f.view(f.shape[0], *([1] * (x.dim() - 2)), f.shape[1])
    c, s = torch.cos(f), torch.sin(f) * (-1 if inverse else 1)
    r = x[..., -64:]
    e, o = (r[..., :32], r[..., 32:]) if neox else (r[..., 0::2], r[..., 1::2])
    e2, o2 = e * c - o * s, e * s + o * c
    rot = torch.cat([e2, o2], -1) if neox else torch.stack([e2, o2], -1).flatten(-2)
    return torch.cat([x[..., :-64], rot], -1)


def fp8_kv_sim(x: torch.Tensor) -> torch.Tensor:
    """What the 584-B cache stores, simulated in float64: dims 0..447 through e4m3 with a power-of-two
    scale per 64-block (amax floored at 1e-4, scale = 2^ceil(log2(amax / 448))), dims 448..511 rounded to
    bf16 (``docs/formats.md``)."""
    nope = rearrange(x[..., :NOPE_DIM], "... (b k) -> ... b k", k=QUANT_BLOCK)
    amax = nope.abs().amax(-1, keepdim=True).clamp(min=KV_AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(div_rn(amax, E4M3_MAX).float().double())))  # from the fp32 ratio, as the writer
    q = (nope / scale).float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double() * scale
    return torch.cat([rearrange(q, "... b k -> ... (b k)"), x[..., NOPE_DIM:].to(torch.bfloat16).double()], -1)


def compress(cw: dict, r: int, x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """All compressed rows of a sequence, float64: (L // r, D) and the boundary position of each. The
    compressor op's whole-sequence form, written with blocks of r tokens (not the decode path's ring):
    :func:`dsv4ref.compressor.compress_sequence`."""
    return compress_sequence(x, cw["wkv"], cw["wgate"], cw["ape"], cw["norm"], ratio=r, eps=eps, dtype=torch.float64)


def index_quant_sim(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The values an indexer row (last dim 128) holds after quantisation, simulated in float64
    (``docs/decode.md#the-indexer-format``): ``"fp8"``: e4m3 with one power-of-two scale per row,
    2^ceil(log2(max(amax, 1e-4) / 448)); ``"mxfp4"``: E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6; round half to even)
    in blocks of 32 with one power-of-two scale each, 2^ceil(log2(max(amax, 6·2^-126) / 6)) (DeepSeek's
    FP4 of the indexer's q and k)."""
    if fmt == "fp8":
        amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-4)
        scale = torch.exp2(torch.ceil(torch.log2(div_rn(amax, E4M3_MAX))))
        return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double() * scale
    if fmt != "mxfp4":
        raise ValueError(f"fmt: expected 'fp8' or 'mxfp4', got {fmt!r}")
    b = rearrange(x, "... (n k) -> ... n k", k=32)
    amax = b.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(div_rn(amax, 6.0))))
    v = (b / scale).clamp(-6, 6)
    step = torch.where(v.abs() < 2, 0.5, torch.where(v.abs() < 4, 1.0, 2.0))  # the E2M1 grid's spacing
    q = torch.round(v / step) * step  # round half to even: an even multiple of the step is an even code
    return rearrange(q * scale, "... n k -> ... (n k)")


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """x · H_128 · 128^-½ over the last dim (Sylvester's H), float64."""
    h = torch.ones(1, 1, dtype=x.dtype, device=HOST)
    while h.shape[0] < x.shape[-1]:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return x @ h * x.shape[-1] ** -0.5


def index_scores(
    cfg: Config,
    Lw: dict,
    x: torch.Tensor,
    qr: torch.Tensor,
    inv: torch.Tensor,
    pos: torch.Tensor,
    fmt: str | None = None,
    hadamard: bool = True,
) -> torch.Tensor:
    """Indexer logits I[p, s] = Σ_h w[p, h]·ReLU(q[p, h]·k[s]) · 128^-0.5 · n_ih^-0.5, float64; −inf for
    s >= (p+1)//4 (not yet complete). ``fmt`` None: unquantised; ``"fp8"`` / ``"mxfp4"``: q and k rotated
    by the Hadamard (if ``hadamard``, as the decode path does by default) and quantised as
    :func:`index_quant_sim` simulates. For top-k recall checks, not for the forward."""
    c, cp = compress(Lw["idx_comp"], 4, x, cfg.rms_norm_eps)
    k = rope(c, cp - 3, inv)
    q = rope(rearrange(qr @ Lw["idx_wq_b"].T, "l (h d) -> l h d", h=cfg.index_heads), pos, inv)
    if fmt is not None:
        if hadamard:  # the rotation's output in bf16, as the quantisers (and DeepSeek's rotate_activation) have it
            q, k = (_hadamard(v).float().to(torch.bfloat16).double() for v in (q, k))
        q, k = index_quant_sim(q, fmt), index_quant_sim(k, fmt)
    wts = x @ Lw["idx_weights"].T
    s = torch.einsum("lhd,sd->lhs", q, k).clamp(min=0)
    s = (s * wts[..., None]).sum(1) * (cfg.index_head_dim**-0.5 * cfg.index_heads**-0.5)
    vis = torch.arange(k.shape[0], device=HOST)[None, :] < ((pos + 1) // 4)[:, None]
    return s.masked_fill(~vis, -math.inf)
