"""RoPE in DeepSeek-V4, in plain torch: the whole op, top to bottom. Derivations: ``docs/rope.md``.

1. Frequencies. Plain RoPE turns pair i by ``inv_freq[i] = θ^(−2i/R)`` radians per token (R = 64 rotary
   dims, so 32 pairs). YaRN (compressed layers: θ = 160000, factor F = 16, original length L0 = 65536,
   β_fast = 32, β_slow = 1) slows the low-frequency pairs down by F, with a linear ramp between
   ``low = floor(corr(β_fast))`` and ``high = ceil(corr(β_slow))``, ``corr(n) = R·ln(L0 / (2π n)) / (2 ln θ)``.
2. The table. fp32 ``[max_pos, R]``, row p = ``[cos f_0 … cos f_31 | sin f_0 … sin f_31]`` (two halves, NOT
   interleaved), ``f_i = fp32(p) · inv_freq[i]``. No YaRN mscale: plain cos and sin.
3. GPT-J rotation of the LAST R dims. Pair i is (x[2i], x[2i+1]) = the complex number x[2i] + j·x[2i+1],
   multiplied by e^{j f_i}::

       x'[2i]   = x[2i]·cos f_i − x[2i+1]·sin f_i
       x'[2i+1] = x[2i]·sin f_i + x[2i+1]·cos f_i

   The inverse (on the attention output, at the query's position) is the same with sin negated.
   NeoX pairs (x[i], x[i + R/2]) instead: a different function, kept only as the contrast.
4. The fused prologue step, per token t: q[t, h] ← RoPE(RMSNorm(q[t, h])) for every head (weight-free
   RMSNorm over all 512 dims), and kv[t] → RoPE → the 584-byte FP8 cache record at ``slots[t]``.

Rounding rules (every backend follows them, so kernels equal this file bit for bit): the rotation takes
two separately rounded fp32 products and one add (no FMA), then rounds once to the output dtype (bf16:
nearest-even); the q RMSNorm is DeepSeek's bf16 tensor ops, each result rounded to bf16 (the squares, the
mean, + eps, the rsqrt, q·rsqrt), its sum of squares taken in float64 (order-free) and rounded to fp32, its
rsqrt a correctly rounded sqrt and division (never an approximate rsqrt).

Non-finite input (``docs/rope.md#non-finite-input``) follows IEEE arithmetic through these same formulas,
and every NaN a rotation or the norm produces is written as the one quiet NaN (bf16 0x7FC0, fp32
0x7FC00000) — so a NaN in a q head makes the whole head NaN, bit-identical on every backend; dims that are
only copied keep their bits.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange

from ..device import HOST
from ..formats import ROPE_DIM
from ..fp8.reference import canonical_nan
from ..kv_cache import reference as kv_cache_reference

# ----------------------------------------------------------------------------------------------------
# 1-2. Frequencies, YaRN and the cos/sin table
# ----------------------------------------------------------------------------------------------------


def yarn_correction_range(rope_dim: int, theta: float, yarn: dict) -> tuple[float, float]:
    """(low, high): the pair indices where YaRN's ramp starts and ends. θ = 160000, L0 = 65536: (15, 25)."""
    L0 = float(yarn["original_max_position"])

    def corr(n: float) -> float:  # the pair whose wavelength fits n times into L0
        return rope_dim * math.log(L0 / (2 * math.pi * n)) / (2 * math.log(theta))

    low = max(math.floor(corr(float(yarn["beta_fast"]))), 0)
    high = min(math.ceil(corr(float(yarn["beta_slow"]))), rope_dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-zero width
    return float(low), float(high)


def inv_freq(rope_dim: int = ROPE_DIM, theta: float = 10000.0, yarn: dict | None = None) -> torch.Tensor:
    """fp32 ``[rope_dim // 2]``: radians per position of each pair (CPU)."""
    pf = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=HOST) / rope_dim)  # θ^(2i/R), fp32
    extra = 1.0 / pf  # the original frequency
    if yarn is None:
        return extra
    inter = 1.0 / (float(yarn["factor"]) * pf)  # slowed down by the factor
    low, high = yarn_correction_range(rope_dim, theta, yarn)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device=HOST) - low) / (high - low)).clamp(0, 1)
    return inter * ramp + extra * (1 - ramp)


def cos_sin_rows(
    positions: torch.Tensor, rope_dim: int = ROPE_DIM, theta: float = 10000.0, yarn: dict | None = None
) -> torch.Tensor:
    """Rows ``positions`` of the table, fp32 ``[N, rope_dim]`` = ``[cos f | sin f]``; computed on the CPU
    (every machine gets the same bits), returned on ``positions.device``."""
    f = positions.cpu().to(torch.float32)[:, None] * inv_freq(rope_dim, theta, yarn)[None, :]  # fp32(p)·inv_freq
    return torch.cat([torch.cos(f), torch.sin(f)], dim=1).to(positions.device)


def compressed_position(p, ratio: int):
    """(p // r)·r: a compressed key (and an indexer key) is rotated at the first position of its window."""
    r = max(1, int(ratio))
    return (p // r) * r


# ----------------------------------------------------------------------------------------------------
# 3. Rotation: GPT-J (DSV4) and NeoX (the contrast)
# ----------------------------------------------------------------------------------------------------


def cos_sin_for(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool):
    """c, s of each row of x, shaped x.shape[:-1] + (R/2,); s negated for the inverse rotation."""
    rows = cos_sin[positions.long()]
    while rows.dim() < x.dim():
        rows = rows.unsqueeze(-2)  # one position per token, shared by all heads
    c, s = rows.chunk(2, dim=-1)  # [cos | sin]: two halves
    return c, (-s if inverse else s)


def rotate_pairs(x: torch.Tensor, positions, cos_sin, inverse: bool, pairing: str) -> torch.Tensor:
    """Rotate the pairs of x's last R dims by their angles at ``positions``; ``pairing`` is the einops pattern
    of the last R dims that names each pair's two members: ``(i two)`` = adjacent (GPT-J), ``(two i)`` =
    half-split (NeoX)."""
    R = cos_sin.shape[1]
    c, s = cos_sin_for(x, positions, cos_sin, inverse)
    e, o = rearrange(x[..., -R:].float(), f"... {pairing} -> two ... i", two=2)
    rot = torch.stack([e * c - o * s, e * s + o * c])  # two rounded products and one add each (no FMA)
    out = x.clone(memory_format=torch.contiguous_format)  # every backend returns a contiguous tensor
    out[..., -R:] = canonical_nan(rearrange(rot, f"two ... i -> ... {pairing}").to(x.dtype))  # one rounding, one NaN
    return out


def apply_gptj(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """GPT-J (interleaved) RoPE on x's last R dims: pair i = (x[2i], x[2i+1]). The rest is copied."""
    return rotate_pairs(x, positions, cos_sin, inverse, "(i two)")


def apply_neox(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """NeoX (half-split) RoPE on x's last R dims: pair i = (x[i], x[i + R/2]). Not DSV4's convention."""
    return rotate_pairs(x, positions, cos_sin, inverse, "(two i)")


# ----------------------------------------------------------------------------------------------------
# 4. The fused Q-norm + RoPE + KV insert
# ----------------------------------------------------------------------------------------------------


def bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 → fp32(bf16(x)), nearest-even: the rounding of one bf16 tensor op."""
    return x.to(torch.bfloat16).float()


def qnorm_rope(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The Q side as DeepSeek computes it: the weight-free RMSNorm of each head over all 512 dims as bf16
    tensor ops (``q *= rsqrt(q.square().mean(-1) + eps)`` on bf16 q: every op rounds to bf16; the mean's sum
    is fp32), then GPT-J RoPE of the normalised bf16 values in fp32, rounded once to bf16."""
    x = q.float()
    sq = bf16(x * x)  # q.square() in bf16
    ss = sq.double().sum(dim=-1, keepdim=True).float()  # the mean's fp32 sum, order-free: fp64, then one rounding
    m = bf16(bf16(ss / q.shape[-1]) + eps)  # mean (÷512 exact) in bf16, + eps in bf16
    rr = bf16(1.0 / torch.sqrt(m))  # rsqrt in bf16: correctly rounded sqrt and division, then bf16
    return canonical_nan(apply_gptj(bf16(x * rr), positions, cos_sin).to(torch.bfloat16))


def qnorm_rope_kv_insert(
    q: torch.Tensor,
    kv: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    block_size: int,
    eps: float = 1e-6,
) -> None:
    """In place: q ← qnorm_rope(q); the rotated kv rows go into the cache exactly as ``kv_cache.insert``
    writes them (448 e4m3 + 7 UE8M0 of the NoPE dims as given, the 64 rotated dims as bf16; a NoPE block
    holding a NaN or ±inf as kv_cache's non-finite encoding). Slot −1 and rows beyond ``len(slots)`` write
    nothing; kv itself is not modified."""
    kv_cache_reference.insert(cache, apply_gptj(kv, positions, cos_sin), slots, block_size=block_size)
    q.copy_(qnorm_rope(q, positions, cos_sin, eps))
