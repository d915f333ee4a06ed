"""The DeepSeek-V4 MoE feed-forward in plain torch: routing, input staging, experts and the combine.

This is the definition the Triton kernels are held to. The math, the byte maps and the pitfalls are drawn
in ``docs/moe.md``. Symbols: T tokens, Hd hidden size, E routed experts, K experts per token, I expert
intermediate size, L swiglu_limit.

Routing (the gate)::

    z   = fp32(x) @ fp32(W_gate)ᵀ                      [T, E]  fp32
    s   = sqrt(softplus(z))                            softplus(z) = z if z > 20 else log1p(exp(z))
    ids = the K largest (s + bias), ties → lower id    or tid2eid[input_ids] on a hash-routed layer
    w   = s[ids]                                       the UNBIASED scores: the bias selects, it never weighs
    w   = w / max(Σ_k w, 1e-20) · routed_scale

Staging (the mega-MoE input contract, per token and 32-value group g of the hidden state)::

    byte_g   = ceil(log2(max(amax_g, 1e-4) / 448)) + 127        exact, from the fp32 bits
    x_fp8    = e4m3(clamp(x · 2^(127 − byte_g), ±448))           round to nearest, ties to even
    x_sf[kb] = int32 whose little-endian bytes are the 4 group bytes of 128-block kb (may be negative)
    a group holding a NaN or ±inf: byte_g = 255 (E8M0's NaN), e4m3 bytes 0x7F (0xFF: a non-NaN with its
    sign bit set), fp8.quantize_ue8m0's rule (value checks off; with them on, the public stage raises)

One routed slot (token t, slot k, expert e = ids[t, k] ≥ 0, weight ω = w[t, k])::

    a = x̂ @ W1[e]ᵀ,  u = x̂ @ W3[e]ᵀ                fp32; x̂ = the dequantised staged activations
    h = silu(min(a, L)) · clamp(u, −L, L) · ω       the routing weight goes in HERE, before w2
    o = bf16( bf16(h) @ W2[e]ᵀ )

Combine: ``y = Σ_k o_k (fp32, −1 slots add nothing) + Shared(x)`` (the same clamped SwiGLU on the bf16 x
with ω = 1, never scaled by routed_scale), output ``bf16(y)``. The reference sums experts in ascending id,
then the shared expert, as the V4 reference ``MoE.forward`` does.

Every function takes ``dtype``: float32 is the library's reference backend; float64 is the oracle the tests
compare against (no intermediate bf16 roundings, exact staging dequant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from einops import rearrange

from ..device import HOST
from ..formats import STAGE_AMAX_FLOOR, STAGE_GROUP, STAGE_GROUPS
from ..fp8 import reference as fp8

__all__ = [
    "MoeShape",
    "FLASH_MOE",
    "TINY_MOE",
    "SOFTPLUS_THRESHOLD",
    "WEIGHT_SUM_FLOOR",
    "scores",
    "route",
    "stage",
    "dequantize_staged",
    "swiglu",
    "expert_mlp",
    "experts",
    "forward",
    "example_inputs",
]

SOFTPLUS_THRESHOLD = 20.0  # softplus(z) = z above it (torch's default threshold; vLLM's kernel too)
WEIGHT_SUM_FLOOR = 1e-20  # w / max(Σ w, floor): an all-underflow row gets weights 0, not 0/0 = NaN


@dataclass(frozen=True)
class MoeShape:
    """Sizes of one MoE feed-forward. ``num_hash_layers``: layers 0..n−1 route through tid2eid."""

    hidden: int  # Hd
    experts: int  # E routed experts
    k: int  # experts per token
    intermediate: int  # I, also the shared expert's (one shared expert)
    routed_scale: float
    swiglu_limit: float
    num_hash_layers: int


FLASH_MOE = MoeShape(hidden=4096, experts=256, k=6, intermediate=2048, routed_scale=1.5, swiglu_limit=10.0, num_hash_layers=3)
TINY_MOE = MoeShape(hidden=256, experts=8, k=2, intermediate=128, routed_scale=1.5, swiglu_limit=10.0, num_hash_layers=1)


# ====================================================================================================
# Routing
# ====================================================================================================


def scores(z: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(z)) in z's dtype. log1p, not log(1 + exp(z)): the latter is 0 in fp32 for z ≲ −16.6."""
    return torch.sqrt(torch.where(z > SOFTPLUS_THRESHOLD, z, torch.log1p(torch.exp(z))))


def route(x, gate_weight, bias, *, k, routed_scale, hash_table=None, input_ids=None, dtype=torch.float32):
    """``(ids [T, K] int32, weights [T, K] dtype)``; rows whose ``input_ids`` is −1 are padding (ids −1,
    weights 0). ``bias`` is not read on a hash-routed layer (``hash_table`` given).

    Non-finite input (reached only with value checks off): a row whose scores s are not all finite, or every
    row when a bias entry is NaN, gets NaN weights (its ids: the stable sort's order, NaN keys first)."""
    z = x.to(dtype) @ gate_weight.to(dtype).T  # [T, E]: the gate GEMM, in fp32 for the backend
    s = scores(z)
    if hash_table is not None:
        ids = hash_table[input_ids.clamp_min(0)].long()  # [T, K], the table's order
    else:
        # descending (s + b), ties to the lower expert id: a stable sort keeps equal keys in id order
        ids = torch.sort(s + bias.to(dtype), dim=-1, descending=True, stable=True).indices[:, :k]
    w = s.gather(1, ids)  # unbiased scores
    w = w / w.sum(dim=-1, keepdim=True).clamp_min(WEIGHT_SUM_FLOOR) * routed_scale
    bad = ~torch.isfinite(s).all(dim=-1)  # NaN / inf scores: the row's weights are NaN, never plausible numbers
    if hash_table is None:
        bad = bad | torch.isnan(bias).any()  # (device ops only: no host sync)
    w = w.masked_fill(bad[:, None], math.nan)
    ids = ids.to(torch.int32)
    if input_ids is not None:
        pad = (input_ids < 0)[:, None]
        ids, w = ids.masked_fill(pad, -1), w.masked_fill(pad, 0.0)
    return ids, w


# ====================================================================================================
# Staging
# ====================================================================================================


def stage(hidden, ids, weights):
    """``(x_fp8 [T, Hd] e4m3, x_sf [T, Hd/128] int32, ids int64, weights fp32)``, bit for bit."""
    q, byte = fp8.quantize_ue8m0(hidden, STAGE_GROUP, STAGE_AMAX_FLOOR)  # byte: [T, Hd/32] uint8
    # four consecutive bytes, viewed as one little-endian int32: byte 0 is the least significant, and a
    # byte_3 >= 128 sets the sign bit (a view wraps; adding in int64 and casting would saturate)
    x_sf = byte.contiguous().view(torch.int32)
    return q, x_sf, ids.to(torch.int64), weights.clone()


def dequantize_staged(x_fp8, x_sf, dtype=torch.float32):
    """x̂ = e4m3 value · 2^(byte − 127) per 32-group: exact in fp32 (and in bf16). Every byte as the formats
    define it: e4m3 0x7F / 0xFF and scale byte 255 are NaN, scale byte 0 is 2^-127."""
    byte = (x_sf[..., None].to(torch.int64) >> (8 * torch.arange(STAGE_GROUPS, device=x_sf.device))) & 0xFF
    scale = fp8.ue8m0_value(rearrange(byte, "t b j -> t (b j)")).to(dtype)  # [T, Hd/32]
    q = rearrange(x_fp8.view(torch.float8_e4m3fn).to(dtype), "t (g i) -> t g i", i=STAGE_GROUP)
    return rearrange(q * scale[..., None], "t g i -> t (g i)")


# ====================================================================================================
# Experts and combine
# ====================================================================================================


def swiglu(a, u, limit):
    """silu(min(a, L)) · clamp(u, −L, L); no clamp when ``limit <= 0`` (the V4 reference's switch)."""
    if limit > 0:
        a, u = a.clamp(max=limit), u.clamp(-limit, limit)
    return torch.nn.functional.silu(a) * u


def expert_mlp(x, w13, w2, omega, limit, dtype=torch.float32, *, mass=False):
    """One expert on rows ``x`` [n, Hd]: ``bf16(bf16(swiglu(x W1ᵀ, x W3ᵀ) · ω) @ W2ᵀ)`` in ``dtype``
    (float64: no bf16 roundings). ``w13`` = [W1; W3] stacked, [2I, Hd]; ``w2`` [Hd, I]; ``omega`` [n].
    ``mass=True`` returns ``|h| @ |W2|ᵀ`` instead: the scale the output's rounding errors grow with."""
    rnd = (lambda v: v.to(torch.bfloat16).to(dtype)) if dtype != torch.float64 else (lambda v: v)
    a, u = (x.to(dtype) @ w13.to(dtype).T).chunk(2, dim=-1)
    h = swiglu(a, u, limit) * omega.to(dtype)[:, None]
    if mass:
        return h.abs() @ w2.to(dtype).abs().T
    return rnd(rnd(h) @ w2.to(dtype).T)


def experts(x, x_fp8, x_sf, ids, weights, w13, w2, shared_w13, shared_w2, *, swiglu_limit, dtype=torch.float32, mass=False):
    """``[T, Hd]``: routed experts on the staged activations, then the shared expert on ``x``, summed in
    ``dtype`` in ascending expert id; bf16 unless ``dtype`` is float64. −1 slots are never indexed.
    ``mass=True`` (with float64): Σ over slots and the shared expert of ``|h| @ |W2|ᵀ`` instead, the
    ``mass`` argument of the "moe_out" tolerance. ``x_fp8 = x_sf = None``: the routed experts read ``x`` itself
    (the float64 oracle of V4's formats, ``dsv4ref.decode.reference``)."""
    T, K = ids.shape
    xq = dequantize_staged(x_fp8, x_sf, dtype) if x_fp8 is not None else x.to(dtype)
    y = torch.zeros(T, x.shape[1], dtype=dtype, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)  # a repeated id in a row gives two (tok, slot) pairs
        if tok.numel():
            o = expert_mlp(xq[tok], w13[e], w2[e], weights[tok, slot], swiglu_limit, dtype, mass=mass)
            y.index_add_(0, tok, o)  # accumulates repeated indices; `y[tok] += o` would drop one
    if shared_w13 is not None:
        y += expert_mlp(x, shared_w13, shared_w2, torch.ones(T, device=x.device), swiglu_limit, dtype, mass=mass)
    return y if dtype == torch.float64 else fp8.canonical_nan(y.to(torch.bfloat16))  # NaN: 0x7FC0 everywhere


def forward(
    x,
    gate_weight,
    bias,
    w13,
    w2,
    shared_w13,
    shared_w2,
    *,
    k,
    routed_scale,
    swiglu_limit,
    hash_table=None,
    input_ids=None,
    dtype=torch.float32,
):
    """route → stage → experts: the MoE feed-forward of one layer, ``[T, Hd]``."""
    ids, w = route(x, gate_weight, bias, k=k, routed_scale=routed_scale, hash_table=hash_table, input_ids=input_ids)
    x_fp8, x_sf, ids64, w32 = stage(x, ids, w)
    return experts(x, x_fp8, x_sf, ids64, w32, w13, w2, shared_w13, shared_w2, swiglu_limit=swiglu_limit, dtype=dtype)


# ====================================================================================================
# Example inputs (tests, notebooks, checks, conformance)
# ====================================================================================================


def example_inputs(
    T: int,
    shape: MoeShape = TINY_MOE,
    *,
    seed: int = 0,
    hash_layer: bool = False,
    vocab: int = 512,
    octaves: int = 8,
    weight_gain: float = 1.0,
    device=None,
) -> dict:
    """Seeded inputs of one MoE layer, drawn on the CPU (the same numbers on every device).

    ``x`` bf16 [T, Hd] with a power-of-two scale per 32-group over ``octaves`` octaves (so the staging writes
    many different bytes); ``gate_weight`` bf16 [E, Hd]; ``bias`` fp32 [E] ≈ 8.08 + small noise (the
    near-uniform bias of V4-Flash); ``w13`` bf16 [E, 2I, Hd]; ``w2`` bf16 [E, Hd, I]; ``shared_w13``,
    ``shared_w2`` likewise for the one shared expert; ``hash_table`` int64 [vocab, K] with distinct ids
    per row and ``input_ids`` [T] int64 when ``hash_layer``. ``weight_gain`` scales the gate/up weights:
    at 1, x's largest groups push some pre-activations past ±L, so the clamp matters.

    Returns a dict with those tensors plus ``k``, ``routed_scale`` and ``swiglu_limit``.
    """
    from ..device import DEVICE
    from ..seeded import generator, randn

    device = device or DEVICE
    g = generator(seed + 1)
    Hd, E, I, K = shape.hidden, shape.experts, shape.intermediate, shape.k

    def w(*s, fan_in, gain=1.0):
        return (torch.randn(*s, generator=g, device=HOST) * (gain / math.sqrt(fan_in))).to(torch.bfloat16)

    x = randn((T, Hd), seed=seed, block=STAGE_GROUP, octaves=octaves, device="cpu")
    d = dict(
        x=x,
        gate_weight=w(E, Hd, fan_in=Hd, gain=0.5),
        bias=8.08 + 0.02 * torch.randn(E, generator=g, device=HOST),
        w13=w(E, 2 * I, Hd, fan_in=Hd, gain=weight_gain),
        w2=w(E, Hd, I, fan_in=I),
        shared_w13=w(2 * I, Hd, fan_in=Hd, gain=weight_gain),
        shared_w2=w(Hd, I, fan_in=I),
        hash_table=None,
        input_ids=None,
    )
    if hash_layer:
        d["hash_table"] = torch.stack([torch.randperm(E, generator=g, device=HOST)[:K] for _ in range(vocab)])
        d["input_ids"] = torch.randint(0, vocab, (T,), generator=g, device=HOST)
    out = {n: (v.to(device) if isinstance(v, torch.Tensor) else v) for n, v in d.items()}
    out.update(k=K, routed_scale=shape.routed_scale, swiglu_limit=shape.swiglu_limit)
    return out
