"""Sparse MLA decode with an attention sink, in plain torch: the whole op, top to bottom.

Read ``docs/sparse_mla.md`` for the derivations; this is the definition every backend is held to.

Every query head ``h`` of token ``t`` attends to a multiset ``J(t)`` of cached tokens, drawn from one or
two paged FP8 caches (the sliding-window pool and the compressed pool). It is multi-query attention over
ONE shared latent row per candidate, and that row is both the key and the value (K = V, all 512 dims,
the 64 RoPE dims included)::

    J(t)  = { slots[t, k] : k < lengths[t] and slots[t, k] >= 0 }  ⊎  the same for the extra pool
    k_j   = the dequantised 512-dim row at slot j                    (kv_cache's reader; exact)
    s_j   = scale · <q[t, h], k_j>
    lse   = ln Σ_j exp(s_j)                                          natural log, WITHOUT the sink
    out   = Σ_j exp(s_j − lse) · k_j · σ(lse − sink_h)               = Σ e^s k / (Σ e^s + e^sink)

* The probabilities in bf16 (fp32 ``dtype``): P·V multiplies bf16(e^(s_j − max_j s)) by the rows and divides
  by the unrounded Σ_j e^(s_j − max), as DeepSeek's sparse-attention kernel (and FlashMLA's) does; the kernels
  round their running-max form of the same exponentials. ``dtype=torch.float64`` does not round (the oracle).

* The sink is in the denominator only: multiplying the plain softmax output by σ(lse − sink) is exact for
  sink = −inf (factor 1) and sink = +inf (factor 0) and never forms ∞ − ∞.
* A row with no valid candidate gives ``out = 0`` and ``lse = −inf``, whatever the sink.
* Duplicates are not removed: a slot listed twice counts twice.
* Mask before use: an entry past its length or equal to −1 becomes slot −1 BEFORE the gather, and the
  reader returns a zero row for −1 without touching memory.
* Non-finite input (reached only with value checks off; ``docs/sparse_mla.md#non-finite-input``): a row
  (t, h) is **poisoned** when q[t, h] holds a NaN or ±inf, or when a counted score s_j is not finite (a
  counted cache row holding a NaN or ±inf makes every head's score non-finite). A poisoned row gives
  out = NaN and lse = NaN, also when it has no valid candidate: never the empty-row answer (0, −inf).

The gather is fp32 math on the exactly dequantised rows (they are bf16 numbers); ``dtype=torch.float64``
turns the same code into a float64 oracle (out not rounded to bf16).
"""

from __future__ import annotations

import math

import torch
from einops import einsum

from ..formats import HEAD_DIM
from ..kv_cache import reference as kv_cache

DEFAULT_SCALE = HEAD_DIM**-0.5  # DeepSeek-V4: head_dim^-0.5, no YaRN mscale

__all__ = ["decode", "valid_mask", "DEFAULT_SCALE"]


def valid_mask(slots: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """``[T, K]`` bool: entry k of row t counts iff ``k < lengths[t]`` (None: every k) and ``slots[t, k] >= 0``."""
    keep = slots >= 0
    if lengths is not None:
        keep &= torch.arange(slots.shape[1], device=slots.device)[None, :] < lengths[:, None].to(torch.int64)
    return keep


def _gather(cache, slots, lengths, block_size, dtype):
    """The listed rows ``[T, K, 512]`` in ``dtype`` (zero where not counted) and their mask ``[T, K]``."""
    keep = valid_mask(slots, lengths)
    masked = torch.where(keep, slots, -1).reshape(-1)  # mask before use: never read a slot that does not count
    rows = kv_cache.gather(cache, masked, block_size=block_size)  # the KV cache's reference reader
    return rows.to(dtype).view(*slots.shape, HEAD_DIM), keep  # [T, K, 512] (T = 0 or K = 0 too)


def decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor | None,
    *,
    block_size: int,
    sink: torch.Tensor | None = None,
    scale: float = DEFAULT_SCALE,
    extra_cache: torch.Tensor | None = None,
    extra_slots: torch.Tensor | None = None,
    extra_lengths: torch.Tensor | None = None,
    extra_block_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    with_mass: bool = False,
):
    """The reference of :func:`dsv4ref.sparse_mla.decode` (same arguments, no validation).

    Returns ``(out, lse)``: out ``[T, H, 512]`` bf16 and lse ``[T, H]`` fp32 for ``dtype=torch.float32``;
    both in float64 (out unrounded) for ``dtype=torch.float64``. ``with_mass=True`` appends
    ``mass [T, H, 512]`` = Σ_j p_j·|k_j|·σ(lse − sink): the scale of a kernel's rounding error when it
    rounds P to bf16 before P·V (tolerance ``bf16_weighted_sum``, ``docs/sparse_mla.md#tolerance``).
    """
    k, keep = _gather(cache, slots, lengths, block_size, dtype)
    if extra_cache is not None:  # the second pool joins the SAME softmax
        k2, keep2 = _gather(extra_cache, extra_slots, extra_lengths, extra_block_size, dtype)
        k, keep = torch.cat([k, k2], dim=1), torch.cat([keep, keep2], dim=1)  # [T, K1 + K2, 512], [T, K1 + K2]

    s = scale * einsum(q.to(dtype), k, "t h d, t k d -> t h k")
    poisoned = (keep[:, None, :] & ~torch.isfinite(s)).any(dim=-1) | ~torch.isfinite(q).all(dim=-1)  # [T, H]
    s = s.masked_fill(~keep[:, None, :], -math.inf)
    nonempty = keep.any(dim=1)[:, None].expand(-1, q.shape[1])  # [T, H]
    lse = torch.logsumexp(s, dim=-1)  # −inf for an empty row
    lse_safe = torch.where(nonempty, lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe[..., None])  # entries that do not count: exp(−inf) = 0
    if dtype == torch.float32:  # the kernels' P·V: the unnormalised e^(s − max) in bf16, the sum l unrounded
        mx = s.amax(dim=-1, keepdim=True) if s.shape[-1] else s.new_zeros(*s.shape[:-1], 1)  # K = 0: no entry
        e = torch.exp(s - torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)))
        p = e.to(torch.bfloat16).float() / e.sum(dim=-1, keepdim=True)  # empty rows: 0/0, replaced by 0 below
    factor = 1.0 if sink is None else torch.sigmoid(lse_safe - sink.to(dtype)[None, :])[..., None]  # the sink

    out = einsum(p, k, "t h k, t k d -> t h d") * factor
    out = torch.where(nonempty[..., None], out, torch.zeros_like(out))
    p = torch.exp(s - lse_safe[..., None])  # the mass (below) weighs by the exact p
    lse = torch.where(nonempty, lse, torch.full_like(lse, -math.inf))
    out = out.masked_fill(poisoned[..., None], math.nan)  # a NaN in, a NaN out: never the empty-row answer
    lse = lse.masked_fill(poisoned, math.nan)
    if dtype == torch.float32:
        out = out.to(torch.bfloat16)
    if not with_mass:
        return out, lse
    mass = einsum(p, k.abs(), "t h k, t k d -> t h d") * factor
    mass = torch.where(nonempty[..., None], mass, torch.zeros_like(mass))
    return out, lse, mass.masked_fill(poisoned[..., None], math.nan)
