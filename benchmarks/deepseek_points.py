"""The decode step's rounding points against DeepSeek's own inference code, measured point by point.

For each row of docs/decode.md's "Against DeepSeek's own inference code" table, this script recomputes the
step the way DeepSeek's ``inference/model.py`` (and its ``kernel.py``) does, in its own few lines of torch written
from the facts in docs/ (never from dsv4ref functions), runs dsv4ref's op on the same inputs, and prints how the
values compare: the fraction of output values that differ (bit for bit, in the dtype DeepSeek stores) and the
largest difference. Where dsv4ref changed a rounding point to DeepSeek's, the row also measures the previous form
("before"), so the size of each change is on record.

    PYTHONPATH=. DSV4REF_DEVICE=cpu python benchmarks/deepseek_points.py      # about a minute on 2 CPU cores

Output: one markdown line per point (pasted as data into docs/decode.md). CPU, seeded inputs, reference backends
(the Triton kernels equal them bit for bit or within the tolerances of docs/tolerances.md; the tests say which).
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("DSV4REF_DEVICE", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dsv4ref import compressor, indexer, kv_cache, linear, mhc, moe, mtp, rope, sparse_mla  # noqa: E402
from dsv4ref.config import FLASH  # noqa: E402
from dsv4ref.testing import randn  # noqa: E402

EPS = 1e-6
ROWS: list[tuple[str, str]] = []


def bf(x):
    """DeepSeek's bf16 tensors: fp32 math, rounded to bf16 (returned as float64 for comparisons)."""
    return x.float().to(torch.bfloat16).double()


def differ(a, b) -> str:
    """'values equal' or 'x % of values differ, by at most y of the largest magnitude'."""
    a, b = a.double(), b.double()
    n = int((a != b).sum())
    if n == 0:
        return f"values equal ({a.numel()} of {a.numel()})"
    rel = float((a - b).abs().max() / b.abs().max())
    return f"{100 * n / a.numel():.2f} % of {a.numel()} values differ, by <= {rel:.2g} of the largest magnitude"


def row(point, verdict):
    ROWS.append((point, verdict))
    print(f"| {point} | {verdict} |", flush=True)


# ---- the indexer (V4-Flash: 64 heads × 128, top 512 of 2 048 keys) ----------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def ds_fp4(x):
    """DeepSeek's ``fp4_act_quant`` (blocks of 32): amax floored at 6·2^-126, scale 2^ceil(log2(amax/6)),
    clamp ±6, nearest E2M1 (ties to even), dequantised."""
    b = x.double().unflatten(-1, (-1, 32))
    scale = torch.exp2(torch.ceil(torch.log2(b.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-126) / 6)))
    y = (b / scale).clamp(-6, 6)
    code = (2 * (y.abs()[..., None] - E2M1).abs() + 1e-9 * (torch.arange(8) % 2)).argmin(-1)
    return (torch.where(y < 0, -1.0, 1.0) * E2M1[code] * scale).flatten(-2)


def ds_hadamard(x, to_bf16=True):
    Hm = torch.ones(1, 1, dtype=torch.float64)
    while Hm.shape[0] < 128:
        Hm = torch.cat([torch.cat([Hm, Hm], 1), torch.cat([Hm, -Hm], 1)], 0)
    y = (x.double() @ Hm).float() * torch.tensor(128**-0.5, dtype=torch.float32)
    return bf(y) if to_bf16 else y.double()


def ds_rope(x, pos, cs):
    """apply_rotary_emb: the last 64 dims as complex pairs times e^(i f), fp32, back into bf16."""
    xc = torch.view_as_complex(x.float()[..., -64:].unflatten(-1, (-1, 2)).contiguous())
    f = torch.complex(cs[pos][:, :32], cs[pos][:, 32:])
    while f.dim() < xc.dim():
        f = f.unsqueeze(-2)
    y = x.float().clone()
    y[..., -64:] = torch.view_as_real(xc * f).flatten(-2)
    return bf(y)


def indexer_points():
    T, H, N, K, BC = 16, 64, 2048, 512, 64
    cs = indexer.cos_sin_table(4 * N)
    q = randn((T, H, 128), seed=1, block=None, octaves=2)
    k = randn((N, 128), seed=2, block=None, octaves=2)
    w = randn((T, H), seed=3, block=None, octaves=0)
    pos = torch.full((T,), 4 * N - 1)
    qd = ds_fp4(ds_hadamard(ds_rope(q, pos, cs)))
    kd = ds_fp4(ds_hadamard(k.double()))
    wd = bf(w.float() * torch.tensor(128**-0.5 * H**-0.5, dtype=torch.float32))
    sd = bf(bf(bf(torch.einsum("thd,nd->thn", qd, kd)).clamp_min(0) * wd[..., None]).sum(1))

    qq, qs, wo = indexer.quantize_q(q, pos, cs, w, fmt="mxfp4", hadamard=True, backend="reference")
    cache = indexer.allocate_k_cache(N // BC, BC, "mxfp4")
    indexer.insert_k(cache, k, torch.arange(N), block_size=BC, fmt="mxfp4", hadamard=True, backend="reference")
    kv, ks = indexer.read_k(cache, torch.arange(N), block_size=BC, fmt="mxfp4")
    lg = indexer.logits(qq, qs, wo, cache, pos, block_size=BC, backend="reference").double()
    row("indexer: FP4 q values", differ(indexer.dequantize_q(qq, qs), qd))
    row("indexer: FP4 k values", differ(indexer.dequantize_k(kv, ks), kd))
    row("indexer: weights ·128^-½·64^-½", differ(wo, wd))
    row("indexer: scores", differ(lg, sd))

    def overlap(a, b):
        ta, tb = a.topk(K, dim=1).indices, b.topk(K, dim=1).indices
        hit = torch.zeros_like(a, dtype=torch.bool).scatter_(1, ta, True).gather(1, tb)
        return float(hit.double().mean())

    row("indexer: top-512 sets", f"overlap {overlap(lg, sd):.4f} (ties at the 512th score aside)")
    # before: the fp32 Hadamard output quantised, fp32 weights and scores
    r = indexer.reference
    q_old = ds_fp4(r.hadamard_transform(r.prepare_q(q, pos, cs, hadamard=False)))
    k_old = ds_fp4(r.hadamard_transform(k.float()))
    s_old = torch.einsum("thd,nd->thn", q_old, k_old).clamp_min(0).mul(w.double()[..., None] * 128**-0.5 * H**-0.5).sum(1)
    row("indexer before: FP4 q values (fp32 Hadamard)", differ(q_old, qd))
    row("indexer before: FP4 k values (fp32 Hadamard)", differ(k_old, kd))
    dev = float(((s_old - sd).abs().amax(1) / sd.abs().amax(1)).max())
    row(
        "indexer before: scores",
        f"differ by up to {dev:.3f} of the row's largest score; top-512 overlap {overlap(s_old, sd):.4f}",
    )


# ---- the compressor (ratio 4, D = 512, V4-Flash width 4096) -------------------------------------------------


def compressor_points():
    r, D, Hd, L = 4, 512, 4096, 64
    w = compressor.example_inputs(r, dim=D, hidden=Hd, seed=4)
    x = randn((L, Hd), seed=5, block=None, octaves=2)
    # DeepSeek's prefill path: fp32 kv / score, blocks of r, overlap transform, per-channel softmax, then
    # the pooled row in bf16 (``kv.to(dtype)``), its RMSNorm (fp32 math, bf16 out)
    kvp = (x.float() @ w["wkv"].float().T).view(L // r, r, 2 * D)
    sc = (x.float() @ w["wgate"].float().T).view(L // r, r, 2 * D) + w["ape"]
    kvw = torch.cat([torch.cat([torch.zeros_like(kvp[:1, :, :D]), kvp[:-1, :, :D]]), kvp[:, :, D:]], 1)
    scw = torch.cat([torch.cat([torch.full_like(sc[:1, :, :D], -math.inf), sc[:-1, :, :D]]), sc[:, :, D:]], 1)
    pooled = (kvw * scw.softmax(dim=1)).sum(1)

    def norm(c):
        return (w["norm"] * (c * torch.rsqrt(c.square().mean(-1, keepdim=True) + EPS))).to(torch.bfloat16)

    want = norm(pooled.to(torch.bfloat16).float())
    st = compressor.allocate_state(1, r, D)
    rows, done = compressor.compress(
        x,
        *(w[n] for n in ("wkv", "wgate", "ape", "norm")),
        st.kv,
        st.score,
        torch.zeros(L, dtype=torch.long),
        torch.arange(L),
        ratio=r,
        eps=EPS,
        backend="reference",
    )
    row("compressor: the row (bf16, after the norm)", differ(rows[done].to(torch.bfloat16), want))
    row("compressor before: norm of the fp32 pooled row", differ(norm(pooled), want))


# ---- attention: q-norm, RoPE, the kv row, sparse attention, the output projection ------------------------------


def attention_points():
    T, H = 8, 64
    q = randn((T, H, 512), seed=6, block=None, octaves=4)
    pos = torch.arange(T) * 97 + 5
    cs = rope.cos_sin_cache(2048, theta=FLASH.compress_rope_theta, yarn=FLASH.yarn)
    ds = q.clone()
    ds *= torch.rsqrt(ds.square().mean(-1, keepdim=True) + EPS)  # DeepSeek's line, bf16 tensor ops
    ds = ds_rope(ds, pos, cs)
    kv = randn((T, 512), seed=7, block=64, octaves=4)
    cache = kv_cache.allocate(1, 16)
    got = q.clone()
    rope.qnorm_rope_kv_insert(got, kv, cache, torch.arange(T), pos, cs, eps=EPS, block_size=16, backend="reference")
    row("attention: q after the per-head norm and RoPE", differ(got, ds))
    x = q.float()
    old = rope.apply_gptj((x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)), pos, cs).to(torch.bfloat16)
    row("attention before: q-norm in fp32, rounded once", differ(old, ds))

    # the kv row: RoPE (bf16), then the NoPE dims through FP8 (blocks of 64, power-of-two scales), dequantised
    kr = ds_rope(kv, pos, cs)
    b = kr[:, :448].unflatten(-1, (-1, 64))
    scale = torch.exp2(torch.ceil(torch.log2(b.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448)))
    nope = ((b / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * scale).flatten(-2)
    want = bf(torch.cat([nope, kr[:, 448:]], 1))
    got_rows = kv_cache.gather(cache, torch.arange(T), block_size=16, backend="reference").view(T, 512)
    row("attention: kv row as cached (dequantised)", differ(got_rows, want))
    row(
        "attention: RoPE of kv (GPT-J pairs, YaRN table)",
        differ(rope.apply_gptj(kv, pos, cs, backend="reference"), ds_rope(kv, pos, cs)),
    )

    # sparse attention: DeepSeek's kernel multiplies bf16(e^(s − max)) by the rows, divides by the fp32 sum + sink
    ex = sparse_mla.example_inputs(4, 64, 96, block_size=16, seed=8)
    keep = sparse_mla.reference.valid_mask(ex["slots"], ex["lengths"])
    rows_ = kv_cache.gather(ex["cache"], torch.where(keep, ex["slots"], -1).reshape(-1), block_size=16, backend="reference")
    kk = rows_.float().view(*keep.shape, 512)
    s = torch.einsum("thd,tkd->thk", ex["q"].float(), kk) * sparse_mla.reference.DEFAULT_SCALE
    s = s.masked_fill(~keep[:, None, :], -math.inf)
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    den = e.sum(-1) + torch.exp(ex["sink"][None, :] - m[..., 0])
    ds_o = (torch.einsum("thk,tkd->thd", e.to(torch.bfloat16).float(), kk) / den[..., None]).to(torch.bfloat16)
    o, _ = sparse_mla.decode(**ex, backend="reference")
    row("attention: sparse attention output (bf16)", differ(o, ds_o))
    p = e / e.sum(-1, keepdim=True)
    old_o = (torch.einsum("thk,tkd->thd", p, kk) * torch.sigmoid(torch.logsumexp(s, -1) - ex["sink"])[..., None]).to(
        torch.bfloat16
    )
    row("attention before: fp32 probabilities", differ(old_o, ds_o))

    # the output: inverse RoPE, wo_a per group (bf16 einsum), wo_b
    G, R, Hd = 8, 1024, 4096
    o = randn((T, H, 512), seed=9, block=None, octaves=0)
    wo_a = randn((G, R, H * 512 // G), seed=10, block=None, octaves=0) * (H * 512 // G) ** -0.5
    wo_b = randn((Hd, G * R), seed=11, block=None, octaves=0) * (G * R) ** -0.5
    z = torch.einsum("tgd,grd->tgr", o.view(T, G, -1).float(), wo_a.float()).to(torch.bfloat16)
    ds_out = F.linear(z.flatten(1).float(), wo_b.float()).to(torch.bfloat16)
    row("attention: wo_a per group, then wo_b", differ(linear.grouped_o_proj(o, wo_a, wo_b, backend="reference"), ds_out))


# ---- mHC, MoE, MTP ------------------------------------------------------------------------------------------


def mhc_moe_mtp_points():
    T, M, Hd, E = 8, 4, 4096, 256
    res = randn((T, M, Hd), seed=12, block=None, octaves=2)
    fn = randn((M * (M + 2), M * Hd), seed=13, dtype=torch.float32, block=None, octaves=0) * (M * Hd) ** -0.5
    scale = torch.tensor([0.5, 0.7, 0.9])
    base = randn((M * (M + 2),), seed=14, dtype=torch.float32, block=None, octaves=0)
    # DeepSeek's hc_pre: RMS-scaled mixes, pre = σ + eps, post = 2σ, comb = 20 Sinkhorn passes, y = Σ pre·x
    xf = res.flatten(1).float()
    mixes = F.linear(xf, fn) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS)
    pre = torch.sigmoid(mixes[:, :M] * scale[0] + base[:M]) + EPS
    post = 2 * torch.sigmoid(mixes[:, M : 2 * M] * scale[1] + base[M : 2 * M])
    comb = (mixes[:, 2 * M :] * scale[2] + base[2 * M :]).view(T, M, M).softmax(-1) + EPS
    comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    for _ in range(19):
        comb = comb / (comb.sum(-1, keepdim=True) + EPS)
        comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    y = (pre[..., None] * res.float()).sum(1).to(torch.bfloat16)
    p_, c_, x_ = mhc.reference.pre(res, fn, scale, base)
    row("mHC pre: x (bf16)", differ(x_.to(torch.bfloat16), y))
    row(
        "mHC pre: post, comb (fp32)", differ(torch.cat([p_.flatten(), c_.flatten()]), torch.cat([post.flatten(), comb.flatten()]))
    )

    # MoE routing: sqrt(softplus) in fp32, the bias for the choice only, renormalised × route_scale
    x = randn((T, Hd), seed=15, block=None, octaves=0)
    gw = randn((E, Hd), seed=16, block=None, octaves=0) * Hd**-0.5
    bias = 0.01 * randn((E,), seed=17, dtype=torch.float32, block=None, octaves=0)
    sc = F.softplus(x.float() @ gw.float().T).sqrt()
    ids = (sc + bias).topk(8, dim=-1).indices
    wts = sc.gather(1, ids)
    wts = wts / wts.sum(-1, keepdim=True) * FLASH.routed_scaling_factor
    gi, gwts = moe.reference.route(x, gw, bias, k=8, routed_scale=FLASH.routed_scaling_factor)
    same_ids = bool((gi.long().sort(-1).values == ids.sort(-1).values).all())
    order = gi.long().argsort(-1)
    row(
        "MoE routing: ids, weights",
        f"ids {'equal' if same_ids else 'differ'}; weights: {differ(gwts.gather(1, order), wts.gather(1, ids.argsort(-1)))}",
    )

    # MoE clamp on fp32 gate/up values: gate = min(g, 10), up = clamp(u, ±10), silu(gate)·up
    from dsv4ref.decode.glue import swiglu_clamped

    gu = 8 * torch.randn(T, 2 * 512, generator=torch.Generator().manual_seed(18))
    ds_act = F.silu(gu[:, :512].clamp(max=10.0)) * gu[:, 512:].clamp(-10.0, 10.0)
    row("MoE clamp: silu(min(g, 10))·clamp(u, ±10)", differ(swiglu_clamped(gu, 10.0), ds_act))

    # MTP: e = embed (position 0 too), enorm, hnorm per stream, e_proj(e) + h_proj(hm) as two bf16 outputs, a bf16 add
    h = randn((T, M, Hd), seed=19, block=None, octaves=2)
    emb = randn((T, Hd), seed=20, block=None, octaves=0)
    en, hn = 1 + 0.1 * torch.randn(Hd, generator=torch.Generator().manual_seed(21)), torch.ones(Hd)
    ep = randn((Hd, Hd), seed=22, block=None, octaves=0) * Hd**-0.5
    hp = randn((Hd, Hd), seed=23, block=None, octaves=0) * Hd**-0.5

    def rms(v, wt):
        v = v.float()
        return (wt * (v * torch.rsqrt(v.square().mean(-1, keepdim=True) + EPS))).to(torch.bfloat16)

    X = F.linear(rms(emb, en), ep).unsqueeze(1) + F.linear(rms(h, hn), hp)
    pos = torch.arange(T)
    args = (h, emb, pos, en, hn, ep, hp)
    row("MTP: block input X (bf16)", differ(mtp.draft_input(*args, eps=EPS), X))
    x0 = mtp.draft_input(*args, eps=EPS, zero_first=True)
    row("MTP: vLLM's zero_first at position 0 (row 0 of X)", differ(x0[:1], X[:1]))
    hs = torch.einsum("tmh,oh->tmo", rms(h, hn).float(), hp.float())
    old = (hs + (rms(emb, en).float() @ ep.float().T)[:, None]).to(torch.bfloat16)
    old[0] = (hs[0]).to(torch.bfloat16)  # before: e zeroed at position 0, one rounding of the fp32 sum
    row("MTP before: fp32 sum, rounded once; e = 0 at position 0", differ(old, X))


def yarn_point():
    # DeepSeek's precompute_freqs_cis (YaRN): the frequencies of the slow pairs divided by the factor, a linear
    # ramp between floor(corr(β_fast)) and ceil(corr(β_slow)); cos / sin of fp32 position · frequency
    y, base, dim = FLASH.yarn, FLASH.compress_rope_theta, 64
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def corr(n):
        return dim * math.log(y["original_max_position"] / (n * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(corr(y["beta_fast"])), 0), min(math.ceil(corr(y["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / max(hi - lo, 0.001)).clamp(0, 1)
    smooth = 1 - ramp
    freqs = freqs / y["factor"] * (1 - smooth) + freqs * smooth
    ang = torch.outer(torch.arange(4096, dtype=torch.float32), freqs)
    ds = torch.cat([ang.cos(), ang.sin()], 1)
    row("RoPE: the YaRN cos/sin table (fp32)", differ(rope.cos_sin_cache(4096, theta=base, yarn=y), ds))


if __name__ == "__main__":
    torch.manual_seed(0)
    print("| point | measured: dsv4ref vs DeepSeek's recomputation |")
    print("|---|---|")
    yarn_point()
    attention_points()
    compressor_points()
    indexer_points()
    mhc_moe_mtp_points()
