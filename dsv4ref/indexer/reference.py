"""The lightning indexer in plain torch: the whole op, top to bottom (the math: ``docs/indexer.md``).

A decode token t at position p sees n_c(p) = (p + 1) // 4 compressed rows. The indexer scores every one
of them and keeps the best k::

    query side   x      = fp32(bf16(RoPE_last64(index_q[t, h], p)))      (optionally fp32(bf16(H_128·128^-½·x)))
                 q, e   = E4M3(x · 2^-e), e = ⌈log2(max(amax, 1e-4) / 448)⌉          one scale per (t, h)
                 w_out  = w[t, h] · 2^e · 128^-½ · n_ih^-½                         the q scale FOLDED in
    key side     k_s    = E4M3(k · 2^-e_s),  k_scale_s = 2^e_s (fp32)                one scale per key
    scores       I[t, s] = Σ_h w_out[t, h] · ReLU(⟨q[t, h], k_s⟩) · k_scale_s         s < n_c(p_t)
                         = −∞                                                     otherwise
    selection    topk_local[t] = ids of the k largest I[t, :], −∞ → −1, padded with −1
    global slots slot = block_table[t, l // B] · B + l % B                        (l = a local id ≥ 0)

MXFP4 (DeepSeek's format) replaces E4M3 by E2M1 in 4 blocks of 32 with one UE8M0 byte each, folds nothing,
and rounds where DeepSeek's bf16 tensors round: w_out = bf16(w·c), and each head's dot, each product with
its weight and the head sum to bf16 (``docs/indexer.md#rounding-points``).

Non-finite values (value checks off; with them on the public functions raise first): NaNs are made the
quiet NaN 0x7FC00000, then a block holding a NaN or ±inf gets scale byte 255 (E8M0's NaN; the fp8 K scale is
the fp32 NaN, and the fp8 Q weight w_out is NaN) and codes 0x7F (e4m3 NaN) / 0x7 (e2m1's largest magnitude),
with the sign bit where the value's sign bit is set. Readers decode scale byte 0 as 2^-127 and 255 as NaN; a
NaN anywhere in a score's inputs makes that score NaN, and :func:`topk` ranks a NaN score like −∞.

Every function here has the name of the public one in :mod:`dsv4ref.indexer` (which validates the
arguments and dispatches between this file and the Triton kernels); helpers come first, the op after.
All math is fp32, as in the kernels, except :func:`logits`, whose default ``dtype=torch.float64`` is
the oracle the kernel is compared with.
"""

from __future__ import annotations

import struct

import torch

from ..formats import (
    INDEX_AMAX_FLOOR,
    INDEX_HEAD_DIM,
    INDEX_RATIO,
    INDEX_ROPE_DIM,
    index_k_offsets,
    index_k_value_bytes,
)
from ..fp8.reference import canonical_nan, quantize_ue8m0, ue8m0_value
from ..kv_cache.reference import flat_bytes
from .mxfp4 import e2m1_decode, e2m1_encode, mxfp4_values, pack_nibbles, quantize_mxfp4, unpack_nibbles  # noqa: F401

HEAD_DIM = INDEX_HEAD_DIM  # 128
ROPE_START = HEAD_DIM - INDEX_ROPE_DIM  # 64: dims 64..127 are rotated
HADAMARD_SCALE = 128**-0.5  # fp32(2^-3.5), applied after the 7 butterfly stages


# ----------------------------------------------------------------------------------------------------
# small pieces: the causal count, the head weights, the fold constant
# ----------------------------------------------------------------------------------------------------


def n_compressed(positions: torch.Tensor) -> torch.Tensor:
    """n_c(p) = (p + 1) // 4, int64: the complete ratio-4 windows visible at position p. Integer
    division: p = 2 sees nothing, p = 3 sees row 0 (``docs/indexer.md#the-causal-mask``)."""
    return torch.div(positions.to(torch.int64) + 1, INDEX_RATIO, rounding_mode="floor")


def head_weights(x: torch.Tensor, weights_proj: torch.Tensor) -> torch.Tensor:
    """The head weights w = x · W_wᵀ (fp32): an unquantised linear on the attention INPUT x (the tensor
    that feeds wq_a / wkv), never on the q-LoRA latent qr."""
    return x.float() @ weights_proj.float().t()


def fold(n_heads: int) -> float:
    """c = 128^-½ · n_ih^-½, computed in float64 and rounded to fp32 once (a Python float)."""
    return struct.unpack("<f", struct.pack("<f", HEAD_DIM**-0.5 * n_heads**-0.5))[0]


# ----------------------------------------------------------------------------------------------------
# the query path: RoPE, bf16 round trip, Hadamard
# ----------------------------------------------------------------------------------------------------


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE on the LAST 64 dims of x ``[T, H, 128]`` fp32, at each token's position.

    ``cos_sin`` rows are ``[cos f_0..f_31 | sin f_0..f_31]``; the pairs are (64+2i, 64+2i+1)::

        x'[64+2i]   = e·c_i − o·s_i          e = x[64+2i], o = x[64+2i+1]
        x'[64+2i+1] = e·s_i + o·c_i

    Each product is rounded to fp32 before the add (no FMA); the Triton kernel is launched with
    ``enable_fp_fusion=False`` so it rounds the same way and the bytes match exactly.
    """
    cs = cos_sin[positions.long()]  # [T, 64]
    c, s = cs[:, None, :32], cs[:, None, 32:]
    e, o = x[..., ROPE_START::2], x[..., ROPE_START + 1 :: 2]
    out = x.clone()
    out[..., ROPE_START::2] = e * c - o * s
    out[..., ROPE_START + 1 :: 2] = e * s + o * c
    return out


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Sylvester Hadamard over the last dim (128) as 7 butterfly stages, then × 128^-½ (fp32).

    Stage h (= 1, 2, …, 64) replaces each pair (a, b) at distance h inside each 2h-block by (a+b, a−b).
    H·128^-½ is symmetric, orthogonal and its own inverse.
    """
    n = x.shape[-1]
    y = x.float()
    h = 1
    while h < n:
        v = y.reshape(*y.shape[:-1], n // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(*y.shape[:-1], n)
        h *= 2
    return y * torch.tensor(HADAMARD_SCALE, dtype=torch.float32, device=y.device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """The Hadamard side of both quantisers: :func:`hadamard_transform` in fp32, then **rounded to bf16**
    (returned as fp32 holding bf16 values): DeepSeek's ``rotate_activation`` returns a bf16 tensor and its
    FP4 quantiser reads bf16, so the codes are made from the rounded values (``docs/indexer.md#the-hadamard-rotation``).
    A NaN comes out the quiet NaN (the cast's NaN bits depend on the device)."""
    return canonical_nan(hadamard_transform(x).to(torch.bfloat16).float())


def prepare_q(index_q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, hadamard: bool = False) -> torch.Tensor:
    """The fp32 values that get quantised: RoPE, the bf16 round trip of the rotated dims, optional Hadamard."""
    x = rope(index_q.float(), positions, cos_sin)
    x[..., ROPE_START:] = x[..., ROPE_START:].to(torch.bfloat16).float()  # "match reference numerics"
    return canonical_nan(rotate(x) if hadamard else x)


# ----------------------------------------------------------------------------------------------------
# the two number formats: FP8 (one 128-block) here; MXFP4 (four 32-blocks of E2M1) in mxfp4.py
# ----------------------------------------------------------------------------------------------------


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One 128-block per row of fp32 ``x [..., 128]``: (e4m3 codes [..., 128], UE8M0 byte [...] uint8).
    The FP8 quantiser of :mod:`dsv4ref.fp8` with block 128 and the indexer's floor; a non-finite row gets
    byte 255 and NaN codes."""
    q, byte = quantize_ue8m0(x, HEAD_DIM, INDEX_AMAX_FLOOR)
    return q, byte[..., 0]


# ----------------------------------------------------------------------------------------------------
# the op: quantise q, quantise and cache k, score, select, map to global slots
# ----------------------------------------------------------------------------------------------------


def bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16, in x's dtype, through fp32 as the kernels round; a NaN comes out the quiet NaN
    0x7FC00000 (torch's CPU cast makes it 0xFFFF...). The rounding points of DeepSeek's MXFP4 indexer (the head
    weights, the scores)."""
    return canonical_nan(x.float().to(torch.bfloat16).float()).to(x.dtype)


def quantize_q(
    index_q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: torch.Tensor,
    *,
    fmt: str = "fp8",
    hadamard: bool = False,
):
    """The fused indexer-Q: ``(q, q_scales or None, weights_out)`` (see :func:`dsv4ref.indexer.quantize_q`).

    FP8: the per-(token, head) scale 2^e is multiplied into the weight (exact), then c = :func:`fold`
    once. MXFP4: the 4 block scales stay with q (packed into one int32, block 0 in the low byte); the
    weight gets c only, rounded to bf16 (DeepSeek's ``weights_proj(x) * c`` is a bf16 tensor op)."""
    x = prepare_q(index_q, positions, cos_sin, hadamard)
    T, H, _ = x.shape
    c = torch.tensor(fold(H), dtype=torch.float32, device=x.device)
    if fmt == "fp8":
        q, byte = quantize_fp8(x)
        return q, None, canonical_nan((weights.float() * ue8m0_value(byte)) * c)  # byte 255: w_out NaN
    packed, byte = quantize_mxfp4(x)
    return packed, byte.contiguous().view(torch.int32).reshape(T, H), bf16(weights.float() * c)  # DeepSeek: bf16


def dequantize_q(q: torch.Tensor, q_scales: torch.Tensor | None) -> torch.Tensor:
    """The values the logits see, fp32 ``[T, H, 128]``: e4m3 codes (FP8: the scale lives in the weights)
    or e2m1 codes × 2^(byte−127) per 32-block (MXFP4). Exact."""
    if q_scales is None:
        return q.float()
    return mxfp4_values(q, q_scales.contiguous().view(torch.uint8).reshape(*q_scales.shape, 4))


def quantize_k(k: torch.Tensor, *, fmt: str = "fp8", hadamard: bool = False):
    """Keys ``[N, 128]`` (already RoPE'd and bf16) → fp8 ``(codes, fp32 scale 2^e [N])`` or
    mxfp4 ``(packed [N, 64], UE8M0 bytes [N, 4])``."""
    x = canonical_nan(rotate(k.float()) if hadamard else k.float())
    if fmt == "fp8":
        q, byte = quantize_fp8(x)
        return q, ue8m0_value(byte)  # 2^e; NaN for a non-finite row
    return quantize_mxfp4(x)


def insert_k(
    k_cache: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, *, block_size: int, fmt: str = "fp8", hadamard: bool = False
) -> None:
    """Quantise ``k[:len(slots)]`` and scatter the bytes into the SoA pages at ``slots`` (−1: skip), in place.

    Page of B keys: ``[B × V value bytes][B × 4 scale bytes]``, V = 128 (fp8) or 64 (mxfp4)."""
    keep = slots >= 0
    q, s = quantize_k(k[: slots.shape[0]][keep], fmt=fmt, hadamard=hadamard)
    vals, scales = index_k_offsets(k_cache.stride(0), block_size, slots[keep].to(torch.int64), fmt)
    flat, dev = flat_bytes(k_cache), k_cache.device
    flat[vals[:, None] + torch.arange(q.shape[1], device=dev)] = q.view(torch.uint8)
    flat[scales[:, None] + torch.arange(4, device=dev)] = s.contiguous().view(torch.uint8).reshape(-1, 4)


def read_k(k_cache: torch.Tensor, slots: torch.Tensor, *, block_size: int, fmt: str = "fp8"):
    """Gather records back: what :func:`quantize_k` returned for those rows; slots −1 give zero records."""
    keep = slots >= 0
    vb, dev = index_k_value_bytes(fmt), k_cache.device
    vals = torch.zeros(slots.shape[0], vb, dtype=torch.uint8, device=dev)
    sc = torch.zeros(slots.shape[0], 4, dtype=torch.uint8, device=dev)
    v_off, s_off = index_k_offsets(k_cache.stride(0), block_size, slots[keep].to(torch.int64), fmt)
    flat = flat_bytes(k_cache)
    vals[keep] = flat[v_off[:, None] + torch.arange(vb, device=dev)]
    sc[keep] = flat[s_off[:, None] + torch.arange(4, device=dev)]
    if fmt == "fp8":
        return vals.view(torch.float8_e4m3fn), sc.view(torch.float32).reshape(-1)
    return vals, sc


def dequantize_k(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 key values as the logits use them: e4m3 codes (fp8; the fp32 scale is applied after the
    head sum) or e2m1 codes × 2^(byte−127) per 32-block (mxfp4)."""
    if values.dtype == torch.float8_e4m3fn:
        return values.float()
    return mxfp4_values(values, scales)


def logits(
    q: torch.Tensor,
    q_scales: torch.Tensor | None,
    weights_out: torch.Tensor,
    k_cache: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    n_out: int,
    dtype: torch.dtype = torch.float64,
    bf16_scores: bool = False,
) -> torch.Tensor:
    """The scores ``[T, n_out]`` in ``dtype`` from the decoded codes (float64: the oracle)::

        I[t, s] = Σ_h w_out[t, h] · ReLU(⟨q[t, h], k_s⟩) (· k_scale_s for fp8)     s < (p_t + 1) // 4, else −∞

    ``bf16_scores`` (what the op does for MXFP4, DeepSeek's bf16 einsum): each head's dot, each product with
    its weight and the head sum are rounded to bf16 (:func:`bf16`), so the result holds bf16 values.
    Key s of token t lives at slot ``block_table[t, s // B] · B + s % B``."""
    fmt = "fp8" if q_scales is None else "mxfp4"
    T, dev = q.shape[0], q.device
    qv = dequantize_q(q, q_scales).to(dtype)  # [T, H, 128]
    s = torch.arange(n_out, device=dev)
    live = s[None, :] < n_compressed(positions)[:, None]  # [T, n_out]: the causal mask
    blk = (s // block_size).clamp(max=max(block_table.shape[1] - 1, 0))
    page = torch.where(live, block_table.long()[:, blk], 0) if block_table.shape[1] else torch.zeros_like(live, dtype=torch.int64)
    slots = torch.where(live, page * block_size + s % block_size, -1)
    vals, sc = read_k(k_cache, slots.reshape(-1), block_size=block_size, fmt=fmt)
    kv = dequantize_k(vals, sc).to(dtype).reshape(T, n_out, HEAD_DIM)
    dots = torch.einsum("thd,tsd->ths", qv, kv).clamp_min(0)  # ReLU per head, BEFORE the head sum
    if bf16_scores:  # DeepSeek: bf16 einsum, bf16 product with the weight, bf16 head sum
        out = bf16(bf16(bf16(dots) * weights_out.to(dtype)[..., None]).sum(1))
        return torch.where(live, out, float("-inf"))
    out = torch.einsum("th,ths->ts", weights_out.to(dtype), dots)
    if fmt == "fp8":
        out = out * sc.to(dtype).reshape(T, n_out)
    return torch.where(live, out, float("-inf"))


def logits_condition(
    q: torch.Tensor,
    q_scales: torch.Tensor | None,
    weights_out: torch.Tensor,
    k_cache: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    n_out: int,
) -> torch.Tensor:
    """Σ_h |w_out|·Σ_d |q_d·k_d|(·k_scale) per (t, s), float64 (1 where masked, ≥ 1e-30 elsewhere).

    The scale of the fp32 accumulation error of :func:`logits`: divide the kernel's scores and the
    oracle's by it, then compare with an absolute tolerance. Built by clearing every sign bit of q and of
    the cached key values and scoring again (ReLU is then the identity)."""
    fmt = "fp8" if q_scales is None else "mxfp4"
    if fmt == "fp8":
        abs_q = (q.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    else:
        abs_q = q & 0x77  # both nibbles' sign bits
    abs_cache = k_cache.clone()
    abs_cache[:, : block_size * index_k_value_bytes(fmt)] &= 0x7F if fmt == "fp8" else 0x77
    ref = logits(abs_q, q_scales, weights_out.abs(), abs_cache, positions, block_table, block_size=block_size, n_out=n_out)
    return torch.where(torch.isfinite(ref), ref.clamp_min(1e-30), 1.0)


def short_context_topk(positions: torch.Tensor, k: int) -> torch.Tensor:
    """The shortcut: row t = [0, 1, …, n_c(t)−1, −1, …] (width k), int32. Valid only when every n_c ≤ k."""
    n_c = n_compressed(positions)
    ids = torch.arange(k, device=positions.device, dtype=torch.int32)
    return torch.where(ids[None, :] < n_c[:, None], ids[None, :], -1).to(torch.int32)


def topk(
    logits: torch.Tensor | None, k: int, *, positions: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Local ids of the k largest scores per row, int32 ``[T, k]``; −∞ entries and missing columns → −1.
    A NaN score ranks like −∞ (never selected; the public function refuses NaN while value checks are on);
    +∞ is a number and ranks first.

    With ``positions`` and every n_c ≤ k the scores are not read at all (the short-context shortcut):
    the result is ``[0 … n_c−1, −1 …]``, the same set as the full path."""
    T = logits.shape[0] if logits is not None else positions.shape[0]
    dev = logits.device if logits is not None else positions.device
    shortcut = positions is not None and (T == 0 or int(n_compressed(positions).max()) <= k)
    if logits is None and not shortcut:
        raise ValueError(f"logits: needed, because some n_c exceeds k={k} (no shortcut)")
    res = out if out is not None else torch.empty(T, k, dtype=torch.int32, device=dev)
    res.fill_(-1)  # reset on every call
    if shortcut:
        return res.copy_(short_context_topk(positions, k))
    kk = min(k, logits.shape[1])
    if kk:
        vals, ids = torch.topk(logits.masked_fill(logits.isnan(), float("-inf")), kk, dim=1)
        res[:, :kk] = torch.where(vals == float("-inf"), -1, ids).to(torch.int32)
    return res


def to_global(
    topk_local: torch.Tensor, block_table: torch.Tensor, slots: torch.Tensor | None = None, *, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local ids → slots of the MAIN compressed cache ``block_table[t, l // B]·B + l % B``, int64, and
    topk_len = the number of slots ≥ 0 per row (int32).

    −1 (none) for: an id < 0, an id past the block table, an id whose page entry is negative (an unmapped
    page), and every id of an invalid token (``slots[t] < 0``)."""
    loc = topk_local.long()
    n_cols = block_table.shape[1]
    ok = (loc >= 0) & (loc < n_cols * block_size)
    if slots is not None:
        ok = ok & (slots >= 0)[:, None]
    if n_cols:
        page = torch.gather(block_table.long(), 1, torch.where(ok, loc // block_size, 0))
    else:
        page = torch.zeros_like(loc)
    ok = ok & (page >= 0)
    glob = torch.where(ok, page * block_size + loc % block_size, -1)
    return glob, ok.sum(1).to(torch.int32)
