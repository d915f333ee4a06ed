"""The KV compressor of a ratio-r layer in plain torch: the stateful decode form and the whole-sequence oracle.

Every r tokens a compressed layer gains one compressed KV row that summarises a window of past tokens
(``docs/compressor.md``)::

    per token p:   kv    = x_p · W_kvᵀ                            (coff·D,) fp32
                   score = x_p · W_gateᵀ + ape[p % r]            (coff·D,) fp32, ape: a learned bias per
                                                                  position inside the block of r tokens
    boundary:      (p + 1) % r == 0 completes compressed row p // r. Its window is the n = coff·r positions
                   p − n + 1 … p (positions < 0 are masked: score −inf, kv 0)
                     ratio 4   (coff = 2, "overlap"): the older r tokens give channels [0:D] of their
                                                      (kv, score), the newer r tokens channels [D:2D]
                     ratio 128 (coff = 1):            the r tokens, channels [0:D]
                   c[d] = Σ_j softmax_j(score[j, d]) · kv[j, d]     a PER-CHANNEL softmax over the window
                   c    = fp32(bf16(c))                             rounded to bf16 BEFORE the norm (DeepSeek's
                                                                  order: its pooled row is cast to bf16, then normed)
                   c    = c · rsqrt(mean(c²) + eps) · norm          RMSNorm, fp32

D = 512 for the attention path (the caller rounds the row to bf16, rotates its last 64 dims at (p // r)·r
and writes it to the compressed 584-B cache), D = 128 for the indexer's own ratio-4 compressor.

A decode step only sees the tokens of this step, so each request keeps a ring of its last n tokens'
(kv, score), token p at ring row p % n: the state. :func:`compress` reads a boundary token's window from
this step's rows where they hold it (a prefill holds many tokens of one request) and from the ring
otherwise, THEN stores the step's tokens into the ring (only the last n of each request: the others would
be overwritten in the same step anyway).

:func:`compress_sequence` computes the same rows for a whole sequence at once, written differently
(blocks of r tokens, no ring): the float64 oracle the tests hold the stateful forms to. The oracle does not
round the pooled row (tolerance ``"compressor"``: that one bf16 rounding moves a normed row by <= 2^-7).
"""

from __future__ import annotations

import math

import torch
from einops import rearrange

from .. import validate
from ..device import HOST

__all__ = ["RATIOS", "overlap", "project", "compress", "compress_sequence", "rms_norm", "example_inputs"]

RATIOS = (4, 128)  # the compress ratios of DeepSeek-V4 (C4A with an indexer, C128A without)


def overlap(ratio: int) -> int:
    """coff: 2 for ratio 4 (windows of 2r tokens overlap by r), 1 for ratio 128. ``ratio`` an int (not bool or
    float: TypeError), 4 or 128 (ValueError)."""
    validate.integer(ratio, "ratio")
    if ratio not in RATIOS:
        raise ValueError(f"ratio: expected 4 or 128, got {ratio!r}")
    return 2 if ratio == 4 else 1


def rms_norm(c: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """c · rsqrt(mean(c²) + eps) · norm over the last dim, in c's dtype."""
    return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * norm.to(c.dtype)


def project(x, wkv, wgate, ape, positions, *, ratio, dtype=torch.float32):
    """Every token's ``(kv, score)``, each ``[T, coff·D]`` in ``dtype``: ``x·W_kvᵀ`` and
    ``x·W_gateᵀ + ape[p % r]``."""
    xf = x.to(dtype)
    return xf @ wkv.to(dtype).T, xf @ wgate.to(dtype).T + ape.to(dtype)[positions.long() % ratio]


def compress(x, wkv, wgate, ape, norm, state_kv, state_score, requests, positions, valid=None, *, ratio, eps):
    """One step's tokens through the compressor, fp32; the state is updated in place.

    Args: as :func:`dsv4ref.compressor.compress` (already checked). Returns ``(rows [T, D] fp32,
    done [T] bool)``: row t is the compressed row completed by token t where ``done[t]`` (a valid token
    with (p + 1) % r == 0), zeros elsewhere."""
    coff = overlap(ratio)
    n, D, T, dev = coff * ratio, norm.shape[0], x.shape[0], x.device
    pos, req = positions.long(), requests.long()
    valid = torch.ones(T, dtype=torch.bool, device=dev) if valid is None else valid.bool()
    # a row whose request is outside [0, R) or whose position is negative (possible only with value checks
    # off) is treated as padding, as the kernels do: nothing read or written for it
    valid = valid & (req >= 0) & (req < state_kv.shape[0]) & (pos >= 0)
    req = torch.where(valid, req, 0)
    kv, score = project(x, wkv, wgate, ape, pos, ratio=ratio)
    done = valid & ((pos + 1) % ratio == 0)
    rows = torch.zeros(T, D, dtype=torch.float32, device=dev)
    if bool(done.any()):
        b = done.nonzero()[:, 0]
        rb, pb = req[b], pos[b]
        j = torch.arange(n, device=dev)
        src = pb[:, None] - n + 1 + j[None, :]  # [nb, n]: the window's positions, oldest first
        srcc = src.clamp(min=0)
        # here[i, j]: the row of this step holding position src[i, j] of boundary i's request, or −1
        # (a lookup of the key (request, position) among the step's valid rows)
        span = int(pos[valid].max()) + 1
        rows_v = valid.nonzero()[:, 0]
        keys, order = (req[rows_v] * span + pos[rows_v]).sort()
        want = rb[:, None] * span + srcc
        at = torch.searchsorted(keys, want).clamp(max=keys.numel() - 1)
        here = torch.where((keys[at] == want) & (src >= 0), rows_v[order[at]], -1)
        in_step = (here >= 0)[..., None]
        kv_w = torch.where(in_step, kv[here.clamp(min=0)], state_kv[rb[:, None], srcc % n])
        sc_w = torch.where(in_step, score[here.clamp(min=0)], state_score[rb[:, None], srcc % n])
        if coff == 2:  # overlap: the older r tokens give channels [0:D], the newer r tokens [D:2D]
            newer = (j >= ratio)[None, :, None]
            kv_w = torch.where(newer, kv_w[..., D:], kv_w[..., :D])
            sc_w = torch.where(newer, sc_w[..., D:], sc_w[..., :D])
        before = (src < 0)[..., None]  # positions before the sequence start: masked
        sc_w = sc_w.masked_fill(before, -math.inf)
        kv_w = kv_w.masked_fill(before, 0.0)
        # the non-finite policy, one rule for every backend: a NaN / ±inf kv or score anywhere in the window
        # gives a NaN row (IEEE arithmetic alone would leave some channels 0 where an inf meets the norm)
        bad = ~(kv_w.isfinite() & (sc_w.isfinite() | before)).flatten(1).all(1)
        c = (torch.softmax(sc_w, dim=1) * kv_w).sum(1)  # [nb, D]: per-channel softmax over the window
        c = rms_norm(c.to(torch.bfloat16).float(), norm, eps)  # DeepSeek: the pooled row in bf16, then the norm
        rows[b] = c.masked_fill(bad[:, None], math.nan)
    # the ring keeps each request's last n positions (distinct modulo n: no two writes hit one row)
    last = torch.full((state_kv.shape[0],), -1, dtype=torch.int64, device=dev)
    last = last.scatter_reduce(0, req[valid], pos[valid], "amax")
    keep = valid & (pos > last[req.clamp(min=0)] - n)
    state_kv[req[keep], pos[keep] % n] = kv[keep]
    state_score[req[keep], pos[keep] % n] = score[keep]
    return rows, done


def compress_sequence(x, wkv, wgate, ape, norm, *, ratio, eps, dtype=torch.float64):
    """All compressed rows of one whole sequence, written with blocks instead of a ring: the oracle.

    Block b holds positions b·r … b·r + r − 1, and its row is a per-channel softmax-weighted sum over its
    window. Ratio 128: the window is block b. Ratio 4 (overlap): block b − 1's channels [0:D], then block
    b's channels [D:2D] (block −1 is empty: score −inf, kv 0). Then RMSNorm with weight ``norm``.

    Args: ``x`` [L, Hd]; the weights as in :func:`dsv4ref.compressor.compress`. Returns ``(rows [L // r, D]
    dtype, positions [L // r] int64)``, the boundary position of each row (row id = position // r). ``ratio``
    4 or 128 and ``eps`` a finite number > 0 are checked (TypeError / ValueError naming them)."""
    overlap(ratio)
    validate.scalar(eps, "eps", gt=0.0)
    nb, D = x.shape[0] // ratio, norm.shape[0]
    xb = x[: nb * ratio].to(dtype)
    kv = rearrange(xb @ wkv.to(dtype).T, "(b r) c -> b r c", r=ratio)  # [nb, r, coff·D]
    score = rearrange(xb @ wgate.to(dtype).T, "(b r) c -> b r c", r=ratio) + ape.to(dtype)  # + the bias of p % r
    if ratio == 4:

        def older(t, fill):  # block b − 1's first D channels, at block b
            return torch.cat([torch.full_like(t[:1, :, :D], fill), t[:-1, :, :D]])

        kv = torch.cat([older(kv, 0.0), kv[..., D:]], dim=1)  # [nb, 2r, D]
        score = torch.cat([older(score, -math.inf), score[..., D:]], dim=1)
    c = (torch.softmax(score, dim=1) * kv).sum(1)
    return rms_norm(c, norm, eps), torch.arange(nb, device=x.device) * ratio + ratio - 1


def example_inputs(ratio: int, *, dim: int = 512, hidden: int = 256, seed: int = 0, octaves: int = 2, device=None) -> dict:
    """Seeded weights of one compressor, drawn on the CPU (the same numbers on every device): ``wkv``,
    ``wgate`` bf16 ``[coff·D, Hd]`` (1/sqrt(Hd) scale), ``ape`` fp32 ``[r, coff·D]`` (std 0.5), ``norm``
    fp32 ``[D]`` with a power-of-two factor per 64-block over ``octaves`` octaves (the compressed rows'
    FP8 scale bytes then differ from block to block). Returns a dict of those tensors on ``device``."""
    from ..device import DEVICE
    from ..seeded import generator

    coff = overlap(ratio)
    g = generator(seed)
    C = coff * dim

    def lin(rows):
        return (torch.randn(rows, hidden, generator=g, device=HOST) / math.sqrt(hidden)).to(torch.bfloat16)

    e = torch.randint(-(octaves // 2), octaves // 2 + 1, (max(1, dim // 64),), generator=g, device=HOST).float()
    norm = (1.0 + 0.1 * torch.randn(dim, generator=g, device=HOST)) * torch.exp2(e).repeat_interleave(64)[:dim]
    d = dict(wkv=lin(C), wgate=lin(C), ape=0.5 * torch.randn(ratio, C, generator=g, device=HOST), norm=norm)
    return {k: v.to(device or DEVICE) for k, v in d.items()}
