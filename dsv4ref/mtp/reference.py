"""The MTP draft layer and greedy verification in plain torch (``docs/mtp.md``).

The draft layer (one per V4 model: ``num_nextn_predict_layers = 1``) predicts the token TWO positions ahead
of the target's row q, from the target's pre-hc_head residual at q (M streams) and the token at q + 1::

    e    = embed(tok_{q+1})                    [Hd]      the SHARED embedding (the MTP has none of its own),
                                                         at q = 0 too (DeepSeek; vLLM zeroes it there:
                                                         ``zero_first=True``)
    e    = RMSNorm(e)·enorm                    [Hd]
    hm   = RMSNorm(h_prev[m])·hnorm            [Hd]      PER STREAM m = 0..M−1, not over M·Hd
    X[m] = bf16(h_proj(hm)) + bf16(e_proj(e))  [M, Hd]   h_proj on each stream, e_proj(e) broadcast to all M;
                                                         two bf16 outputs, one bf16 add (DeepSeek's)
    X    = Block(X, q)                                   one SWA-only V4 block with its own KV cache
    y    = HCHead(X; the MTP's OWN hc_head)    [Hd]
    logits = lm_head(RMSNorm(y)·norm_mtp)      [V]       its own norm, the SHARED LM head
    draft  = argmax(logits)                              ties to the lowest token id

The block is the decode step's own layer code (:class:`dsv4ref.decode.Decoder` runs it); this module holds
the pieces around it. Greedy verification of k drafts d_1..d_k: the target runs the k + 1 rows
[t, d_1, …, d_k] in ONE decode call; a_j is its argmax at row j (the target's choice for the position d_{j+1}
claims); the emitted tokens are a_0..a_m, where m is the number of leading drafts that equal the target's
choice (all k: the last one, a_k, is the "bonus" token).
"""

from __future__ import annotations

import torch

from ..mhc import reference as mhc_reference

__all__ = ["greedy_accept", "greedy_tokens", "rms_norm", "draft_input", "draft_logits"]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, ties to the lowest token id (``torch.argmax`` returns the first maximal
    index), int64."""
    return logits.argmax(dim=-1)


def greedy_accept(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The emitted tokens: the target's tokens up to and including the first position where the draft
    disagrees, or all k + 1 (the k drafts, which equal the target's, and the bonus token) when none does.

    Written as the loop of the rule; :func:`dsv4ref.mtp.greedy_accept` is the same in one vectorised line."""
    out = []
    for j in range(drafts.shape[0]):
        out.append(int(target[j]))
        if int(drafts[j]) != int(target[j]):
            return torch.tensor(out, dtype=torch.int64, device=target.device)
    out.append(int(target[drafts.shape[0]]))
    return torch.tensor(out, dtype=torch.int64, device=target.device)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, dtype=torch.float32) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) · w over the last dim, computed in ``dtype``."""
    xf = x.to(dtype)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(dtype)


def draft_input(
    h_prev,
    embed_rows,
    positions,
    enorm,
    hnorm,
    e_proj,
    h_proj,
    *,
    eps,
    zero_first=False,
    dtype=torch.float32,
    e_proj_scale=None,
    h_proj_scale=None,
):
    """``X [T, M, Hd]``: ``h_proj(hnorm(h_prev[m])) + e_proj(enorm(e))`` per stream. float32, as DeepSeek's
    bf16 tensors: the norms are rounded to bf16 before the projections, each projection's output is rounded
    to bf16 and their sum is a bf16 add; float64: no rounding (the oracle). ``zero_first``: vLLM's convention,
    e zeroed where the position is 0 (DeepSeek embeds the given token there). FP8 projections (``*_scale``
    given, V4's format): through the 1x128 activation quantiser and the FP8 GEMM
    (:func:`dsv4ref.linear.fp8_linear`, bf16 out), the two bf16 outputs added in bf16; in float64 the
    dequantised weights on the unquantised rows."""
    rnd = (lambda v: v.to(torch.bfloat16).to(dtype)) if dtype != torch.float64 else (lambda v: v)
    e = embed_rows.to(dtype)
    if zero_first:
        e = torch.where((positions == 0)[:, None], 0.0, e)
    e = rnd(rms_norm(e, enorm, eps, dtype))  # [T, Hd]
    hm = rnd(rms_norm(h_prev, hnorm, eps, dtype))  # [T, M, Hd]: the norm runs over Hd, stream by stream
    if e_proj_scale is not None or h_proj_scale is not None:
        return _draft_input_fp8(hm, e, e_proj, h_proj, e_proj_scale, h_proj_scale, dtype)
    x = rnd(hm @ h_proj.to(dtype).T) + rnd(e @ e_proj.to(dtype).T)[:, None, :]  # e_proj(e) broadcast to the M streams
    return x.to(torch.bfloat16) if dtype != torch.float64 else x


def _draft_input_fp8(hm, e, e_proj, h_proj, e_scale, h_scale, dtype):
    """:func:`draft_input`'s two projections with FP8 weights (``hm`` [T, M, Hd], ``e`` [T, Hd], already normed)."""
    from .. import linear as lin

    if dtype == torch.float64:
        We, Wh = (lin.dequantize_fp8_weight(w, s).to(dtype) for w, s in ((e_proj, e_scale), (h_proj, h_scale)))
        return hm @ Wh.T + (e @ We.T)[:, None, :]
    T, M, Hd = hm.shape
    ph = lin.fp8_linear(hm.reshape(T * M, Hd).to(torch.bfloat16), h_proj, h_scale, backend="reference").view(T, M, Hd)
    pe = lin.fp8_linear(e.to(torch.bfloat16), e_proj, e_scale, backend="reference")
    return (ph.float() + pe.float()[:, None, :]).to(torch.bfloat16)


def draft_logits(X, hc_fn, hc_scale, hc_base, norm, lm_head, *, rms_eps, hc_eps, dtype=torch.float32):
    """``[T, V]`` in ``dtype``: ``lm_head(RMSNorm(HCHead(X))·norm)`` with the MTP's own hc_head parameters and
    norm. float32: the head output and the norm are rounded to bf16 as in the target's head; float64: none."""
    rnd = (lambda v: v.to(torch.bfloat16).to(dtype)) if dtype != torch.float64 else (lambda v: v)
    y = rnd(mhc_reference.head(X, hc_fn, hc_scale, hc_base, rms_eps=rms_eps, hc_eps=hc_eps, dtype=dtype))
    return rnd(rms_norm(y, norm, rms_eps, dtype)) @ lm_head.to(dtype).T
