"""The V4 indexer path recomputed the way DeepSeek's ``inference/model.py`` computes it, in this file's own few
lines of torch (no dsv4ref function), and the library held to it.

DeepSeek's indexer, as facts (``docs/indexer.md#rounding-points``): q = ``wq_b(qr)`` bf16, RoPE on the last
64 dims (fp32 math, bf16 out), ``rotate_activation`` (Hadamard in fp32, **bf16 out**), then its FP4 simulation
per 32-block: amax floored at 6·2^-126, scale 2^⌈log2(amax/6)⌉, x/scale clamped to ±6 and rounded to nearest
E2M1 (ties to even), times the scale, back in bf16. The keys the same from the Hadamard on. Weights =
``weights_proj(x) * 128^-½·n^-½`` (bf16 tensor ops); scores = a bf16 einsum (fp32 accumulation, bf16 out),
ReLU, × the weights (bf16), the head sum (bf16). Top-k of those bf16 scores.
"""

from __future__ import annotations

import pytest
import torch

import dsv4ref.indexer as ix
from dsv4ref.device import DEVICE
from dsv4ref.testing import randn

H, D, BC = 64, 128, 64  # V4-Flash: 64 index heads × 128, top 512 of ~2 048 keys (CASES), pages of 64 keys
# the reference at V4-Flash's key count; the kernels on 256 keys, top 64: 4 pages of 64 per token (programs of
# their own interpreted, logits_pages 1), the last one cut by the causal mask, so every boundary the 32 pages
# cross (test_indexer.py holds the kernels to the reference over more launch shapes)
CASES = {"reference": (2048, 512), "triton": (256, 64)}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def bf16(x):
    return x.float().to(torch.bfloat16).double()


def ds_rope(x, pos, cos_sin):
    """GPT-J pairs on the last 64 dims, fp32 (each product rounded, no FMA), bf16 out."""
    x = x.float()
    c, s = cos_sin[pos][:, None, :32], cos_sin[pos][:, None, 32:]
    e, o = x[..., 64::2], x[..., 65::2]
    y = x.clone()
    y[..., 64::2], y[..., 65::2] = e * c - o * s, e * s + o * c
    return bf16(y)


def ds_hadamard(x, to_bf16=True):
    """Sylvester H_128 in exact arithmetic (float64: exact for these sums), to fp32, × fp32(128^-½) in fp32;
    ``rotate_activation`` returns it in bf16."""
    Hm = torch.ones(1, 1, dtype=torch.float64)
    while Hm.shape[0] < D:
        Hm = torch.cat([torch.cat([Hm, Hm], 1), torch.cat([Hm, -Hm], 1)], 0)
    y = (x.double() @ Hm).float() * torch.tensor(D**-0.5, dtype=torch.float32)
    return bf16(y) if to_bf16 else y.double()


def ds_fp4(x):
    """DeepSeek's FP4 simulation of ``x [..., 128]``, blocks of 32: the dequantised values (float64)."""
    b = x.double().unflatten(-1, (-1, 32))
    amax = b.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6)))
    y = (b / scale).clamp(-6, 6)
    d = (y.abs()[..., None] - E2M1).abs()  # distance to each magnitude; on a tie the even code wins
    code = (2 * d + 1e-9 * (torch.arange(8) % 2)).argmin(-1)
    return (torch.where(y < 0, -1.0, 1.0) * E2M1[code] * scale).flatten(-2)


def ds_scores(qv, kv, w):
    """bf16(Σ_h bf16(ReLU(bf16(q_h·k)) · w_h)) for every (token, key): ``[T, N]``."""
    dots = bf16(torch.einsum("thd,nd->thn", qv, kv)).clamp_min(0)
    return bf16((bf16(dots * w[..., None])).sum(1))


def problem(n_keys, seed=0):
    T = 4
    cs = ix.cos_sin_table(4 * n_keys)
    q = randn((T, H, D), seed=seed, block=None, octaves=2)
    k = randn((n_keys, D), seed=seed + 1, block=None, octaves=2)
    w = randn((T, H), seed=seed + 2, block=None, octaves=0)  # weights_proj(x): bf16
    pos = torch.tensor([4 * n_keys - 1, 4 * n_keys - 2, 4 * n_keys - 5, 4 * n_keys - 9], device=DEVICE)
    return q, k, w, pos, cs


@pytest.mark.parametrize("backend", sorted(CASES))
def test_fp4_values_and_top_k_equal_deepseeks(backend):
    """V4-Flash shapes (64 heads × 128, top 512 of 2 048 keys): the library's FP4 q and k values equal
    DeepSeek's rule applied to the bf16 Hadamard outputs, 0 mismatches; its scores equal DeepSeek's bf16 ones
    but for a one-ulp rounding of the head sum, and its top-k set equals DeepSeek's up to ties at the k-th score.
    Without the bf16 rounding after the Hadamard the same rule gives other values (the point is not vacuous)."""
    n_keys, k_top = CASES[backend]
    q, k, w, pos, cs = problem(n_keys)
    qd = ds_fp4(ds_hadamard(ds_rope(q.cpu(), pos.cpu(), cs.cpu())))  # [T, H, 128]
    kd = ds_fp4(ds_hadamard(k.cpu()))  # [N, 128]
    c = torch.tensor(D**-0.5 * H**-0.5, dtype=torch.float32)
    wd = bf16(w.cpu().float() * c)
    sd = ds_scores(qd, kd, wd)  # [T, N]
    n_c = (pos.cpu() + 1) // 4  # DeepSeek scores the cache up to end_pos // 4: complete windows only
    sd = sd.masked_fill(torch.arange(n_keys)[None, :] >= n_c[:, None], float("-inf"))

    qq, qs, wo = ix.quantize_q(q, pos, cs, w, fmt="mxfp4", hadamard=True, backend=backend)
    cache = ix.allocate_k_cache(n_keys // BC, BC, "mxfp4")
    ix.insert_k(cache, k, torch.arange(n_keys, device=DEVICE), block_size=BC, fmt="mxfp4", hadamard=True, backend=backend)
    vals, scales = ix.read_k(cache, torch.arange(n_keys, device=DEVICE), block_size=BC, fmt="mxfp4")
    assert int((ix.dequantize_q(qq, qs).cpu().double() != qd).sum()) == 0
    assert int((ix.dequantize_k(vals, scales).cpu().double() != kd).sum()) == 0
    assert torch.equal(wo.cpu().double(), wd)
    fp32_had = ds_fp4(ds_hadamard(k.cpu(), to_bf16=False))
    assert int((fp32_had != kd).sum()) > 0  # the rounding point matters on this data

    lg = ix.logits(qq, qs, wo, cache, pos, block_size=BC, backend=backend).cpu().double()
    ulp = torch.exp2(torch.floor(torch.log2(sd.abs().clamp_min(2.0**-126))) - 7)
    assert torch.equal(lg.isinf(), sd.isinf())
    f = sd.isfinite()
    assert bool(((lg - sd)[f].abs() <= ulp[f]).all())
    top = ix.topk(lg.float(), k_top).cpu().long()
    kth = sd.topk(k_top, dim=1).values[:, -1:]  # DeepSeek's k-th score per token
    mine = torch.zeros_like(sd, dtype=torch.bool).scatter_(1, top, True)
    assert bool((mine | (sd <= kth)).all())  # every key DeepSeek ranks above its k-th score is chosen
    assert bool((~mine | (sd >= kth)).all())  # every chosen key is at least DeepSeek's k-th score
