"""The KV compressor of a ratio-r layer, as the decode step runs it: stateful, batched, plain torch, fp32.

Every r tokens a compressed layer gains one compressed KV row that summarises a window of past tokens
(``docs/decode.md#the-compressor``)::

    per token p:       [kv | score] = x_p · [W_kv ; W_gate]ᵀ      (fp32, each coff·D wide)
                       score += ape[p % r]                       (a learned bias per position in the window)
    at a boundary      (p + 1) % r == 0: the window is the coff·r positions p − coff·r + 1 … p
                       (positions < 0 are masked: score −∞, kv 0)
                       ratio 4 (coff = 2, "overlap"): the older r tokens give channels [0:D],
                                                      the newer r tokens channels [D:2D]
                       ratio 128 (coff = 1): the r tokens, channels [0:D]
                       c[d] = Σ_j softmax_j(score[j, d]) · kv[j, d]     a per-channel softmax over the window
                       c = RMSNorm_w(c)                                 → compressed row p // r

D = 512 for the attention path (the row is then rounded to bf16, rotated at (p // r)·r and written to
the compressed 584-B cache by the caller), D = 128 for the indexer's own ratio-4 compressor.

A decode step only sees the tokens of this step, so each request keeps a ring of the last coff·r
tokens' (kv, score) (:class:`CompressorState`). A boundary token's window is read from this step's rows
where they hold it (a prefill holds many tokens of one request) and from the ring otherwise.

The float64 dense reference computes the same rows for a whole sequence at once, in a different shape
(blocks of r tokens): :func:`dsv4ref.decode.reference.compress`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..device import DEVICE

__all__ = ["CompressorState", "Compressed", "overlap", "allocate_state", "compress"]


def overlap(ratio: int) -> int:
    """coff: 2 for ratio 4 (windows of 2r tokens overlap by r), 1 for ratio 128."""
    if ratio not in (4, 128):
        raise ValueError(f"ratio: expected 4 or 128, got {ratio}")
    return 2 if ratio == 4 else 1


@dataclass
class CompressorState:
    """Per request, the (kv, score) of its last coff·r tokens, each at row ``position % (coff·r)``.

    ``kv`` (R, coff·r, coff·D) fp32; ``score`` (R, coff·r, coff·D) fp32, −inf where no token was stored."""

    kv: torch.Tensor
    score: torch.Tensor


@dataclass
class Compressed:
    """The compressed rows completed by one step: ``rows`` (n, D) fp32 (RMS-normed, not rounded),
    ``requests`` (n,) int64 and ``positions`` (n,) int64 of the boundary token of each (row id p // r)."""

    rows: torch.Tensor
    requests: torch.Tensor
    positions: torch.Tensor


def allocate_state(num_requests: int, ratio: int, dim: int, *, device=None) -> CompressorState:
    """An empty :class:`CompressorState` for ``num_requests`` requests, compressed width ``dim`` (512 or
    128), on ``device`` (default :data:`dsv4ref.DEVICE`)."""
    coff = overlap(ratio)
    n = coff * ratio
    dev = device or DEVICE
    return CompressorState(kv=torch.zeros(num_requests, n, coff * dim, device=dev),
                           score=torch.full((num_requests, n, coff * dim), -math.inf, device=dev))


def compress(x: torch.Tensor, weights: dict, state: CompressorState, requests: torch.Tensor,
             positions: torch.Tensor, valid: torch.Tensor, *, ratio: int, eps: float) -> Compressed:
    """Run one step's tokens through the compressor; return the rows their boundary tokens complete.

    Args:
        x: (T, Hd) bf16, the layer input after ``attn_norm`` of each of the step's T tokens.
        weights: dict(wkv (coff·D, Hd) bf16, wgate (coff·D, Hd) bf16, ape (ratio, coff·D) fp32,
            norm (D,) fp32).
        state: the requests' :class:`CompressorState`, updated in place (each request keeps its last
            coff·r tokens).
        requests: (T,) int64, the request of each token (an index into the state's first dim).
        positions: (T,) int64, the absolute position of each token; the tokens of one request in one step
            must be consecutive positions following what the state already holds.
        valid: (T,) bool; False rows (padding) are ignored.
        ratio: 4 or 128.  eps: the RMSNorm epsilon.

    Returns:
        :class:`Compressed` with n >= 0 rows, in the order of the step's boundary tokens.
    """
    coff = overlap(ratio)
    n, D = coff * ratio, weights["norm"].shape[0]
    R, dev = state.kv.shape[0], x.device
    kv = x.float() @ weights["wkv"].float().T  # (T, coff·D), fp32
    score = x.float() @ weights["wgate"].float().T + weights["ape"][positions % ratio]
    boundary = valid & ((positions + 1) % ratio == 0)
    if bool(boundary.any()):
        # rowmap[q, p]: the row of this step holding position p of request q, or −1
        rowmap = torch.full((R, int(positions[valid].max()) + 1), -1, dtype=torch.int64, device=dev)
        rowmap[requests[valid], positions[valid]] = torch.arange(x.shape[0], device=dev)[valid]
        req, p = requests[boundary], positions[boundary]
        j = torch.arange(n, device=dev)
        src = p[:, None] - n + 1 + j[None, :]  # (nb, n): the window's positions, oldest first
        srcc = src.clamp(min=0)
        here = rowmap[req[:, None], srcc]  # row of this step holding that position, or −1
        in_step = (here >= 0)[..., None]
        kv_w = torch.where(in_step, kv[here.clamp(min=0)], state.kv[req[:, None], srcc % n])
        sc_w = torch.where(in_step, score[here.clamp(min=0)], state.score[req[:, None], srcc % n])
        if coff == 2:  # overlap: the older r tokens give channels [0:D], the newer r tokens [D:2D]
            newer = (j >= ratio)[None, :, None]
            kv_w = torch.where(newer, kv_w[..., D:], kv_w[..., :D])
            sc_w = torch.where(newer, sc_w[..., D:], sc_w[..., :D])
        before = (src < 0)[..., None]  # positions before the sequence start: masked
        sc_w = sc_w.masked_fill(before, -math.inf)
        kv_w = kv_w.masked_fill(before, 0.0)
        c = (torch.softmax(sc_w, dim=1) * kv_w).sum(1)  # per-channel softmax over the window's tokens
        c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * weights["norm"]
        out = Compressed(c, req, p)
    else:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        out = Compressed(kv.new_zeros(0, D), empty, empty)
    # the ring keeps each request's last n positions (distinct modulo n, so no write conflicts)
    last = torch.full((R,), -1, dtype=torch.int64, device=dev)
    last = last.scatter_reduce(0, requests[valid], positions[valid], "amax")
    keep = valid & (positions > last[requests] - n)
    state.kv[requests[keep], positions[keep] % n] = kv[keep]
    state.score[requests[keep], positions[keep] % n] = score[keep]
    return out
