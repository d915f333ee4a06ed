"""The MoE experts with V4's weights: FP4 routed experts, an FP8 shared expert, and the two paths that feed them.

DeepSeek-V4 stores each routed expert's w1, w3 (gate, up) and w2 (down) in FP4 (E2M1, two to a byte along K,
element 2k in the low nibble, one UE8M0 scale per 32 values of a row) and the shared expert in FP8 (e4m3, one
UE8M0 scale per 128×128 block). Two published pipelines feed them (``docs/moe.md#v4s-formats-in-the-experts``):

``path="deepseek"`` — DeepSeek's ``inference/model.py`` (``Expert.forward`` through ``linear``)::

    x̂    = act_quant(x)                           e4m3, one power-of-two scale per 1x128
    a, u = bf16(x̂ @ Ŵ1ᵀ), bf16(x̂ @ Ŵ3ᵀ)            fp4_gemm returns bf16: rounded BEFORE the clamp
    h    = bf16(silu(min(a, L)) · clamp(u, ±L) · ω)
    o    = bf16(act_quant(h) @ Ŵ2ᵀ)

``path="megamoe"`` — vLLM's mega-MoE contract (DeepGEMM's fused FP8 × FP4 kernel)::

    x̂    = dequantize_staged(moe.stage(x))         e4m3, one UE8M0 byte per 1x32, four packed in an int32
    a, u = x̂ @ Ŵ1ᵀ, x̂ @ Ŵ3ᵀ                        fp32, never rounded
    h    = silu(min(a, L)) · clamp(u, ±L) · ω       fp32
    o    = bf16(ĥ @ Ŵ2ᵀ),  ĥ = e4m3 of h with one UE8M0 byte per 1x32

The shared expert is the same on both paths (vLLM runs it outside the mega kernel, as an FP8 block linear):
the ``deepseek`` recipe with ω = 1 and the FP8 GEMM. Combine: ``y = bf16(Σ_slots o (fp32, ascending expert) +
shared)``. With ``dtype=torch.float64`` :func:`reference` is the oracle: the dequantised weights (exact), no
activation quantisation, no rounding — what the formats of the activations cost is measured against it.
"""

from __future__ import annotations

import torch
from .. import linear as lin
from .. import validate
from ..formats import STAGE_AMAX_FLOOR, STAGE_BLOCK, STAGE_GROUP
from ..fp8 import reference as fp8
from .kernels_fp4 import Fp4Launch, default_fp4_launch, moe_fp4_gemm_op
from .launch import group_by_expert, tile_table
from .reference import dequantize_staged, swiglu

__all__ = ["PATHS", "experts_fp4", "reference", "dequantize_experts", "error_bound", "Fp4Launch", "default_fp4_launch"]

PATHS = ("deepseek", "megamoe")
SUPPORTED_BACKENDS = ("reference", "triton")
_FP4 = torch.float4_e2m1fn_x2


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Packed E2M1 ``[E, N, K/2]`` with UE8M0 ``[E, N, K/32]`` → the values ``[E, N, K]`` in ``dtype`` (exact)."""
    flat = lin.dequantize_fp4_weight(w.reshape(-1, w.shape[-1]), scale.reshape(-1, scale.shape[-1]))
    return flat.view(*w.shape[:-1], -1).to(dtype)


def _e4m3_1x32(h: torch.Tensor) -> torch.Tensor:
    """The mega path's FP8 of an fp32 activation: e4m3 with one UE8M0 byte per 32 (moe.stage's rule), dequantised."""
    q, byte = fp8.quantize_ue8m0(h, STAGE_GROUP, STAGE_AMAX_FLOOR)
    return fp8.dequantize_ue8m0(q, byte, STAGE_GROUP, torch.float32)


def _act_1x128(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's act_quant of a bf16 activation (the linear op's reference), dequantised to fp32."""
    q, s = lin.act_quant(x.to(torch.bfloat16), backend="reference")
    return q.float() * s.repeat_interleave(128, dim=1)[:, : q.shape[1]]


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).float()


def _shared(x, shared_w13, shared_w13_scale, shared_w2, shared_w2_scale, limit, backend):
    """The FP8 shared expert, DeepSeek's recipe: act_quant → FP8 GEMM (bf16 out) → SwiGLU → bf16 → act_quant →
    FP8 GEMM → bf16 ``[T, Hd]``."""
    a, u = lin.fp8_linear(x, shared_w13, shared_w13_scale, backend=backend).float().chunk(2, dim=-1)
    h = swiglu(a, u, limit).to(torch.bfloat16)
    return lin.fp8_linear(h, shared_w2, shared_w2_scale, backend=backend)


def reference(
    x,
    ids,
    weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    shared_w13,
    shared_w13_scale,
    shared_w2,
    shared_w2_scale,
    *,
    swiglu_limit,
    path="deepseek",
    x_fp8=None,
    x_sf=None,
    dtype=torch.float32,
):
    """The experts and the combine in plain torch, ``[T, Hd]``: bf16 on ``path`` (float32 math), or the float64
    oracle (``dtype=torch.float64``: dequantised weights, x unquantised, no rounding; ``path`` then changes
    nothing). ``x_fp8``, ``x_sf``: ``moe.stage``'s outputs, read on the ``megamoe`` path."""
    f64 = dtype == torch.float64
    W13, W2 = dequantize_experts(w13, w13_scale, dtype), dequantize_experts(w2, w2_scale, dtype)
    if f64:
        xin = x.to(dtype)
    elif path == "megamoe":
        xin = dequantize_staged(x_fp8, x_sf)
    else:
        xin = _act_1x128(x)
    T = x.shape[0]
    y = torch.zeros(T, x.shape[1], dtype=dtype, device=x.device)
    for e in range(W13.shape[0]):  # ascending expert id, as DeepSeek's MoE.forward sums
        tok, slot = torch.where(ids == e)
        if not tok.numel():
            continue
        a, u = (xin[tok] @ W13[e].T).chunk(2, dim=-1)
        if path == "deepseek" and not f64:
            a, u = _bf16(a), _bf16(u)
        h = swiglu(a, u, swiglu_limit) * weights[tok, slot].to(dtype)[:, None]
        if not f64:
            h = _e4m3_1x32(h) if path == "megamoe" else _act_1x128(h.to(torch.bfloat16))
        o = h @ W2[e].T
        y.index_add_(0, tok, o if f64 else _bf16(o))
    if f64:
        Ws13 = lin.dequantize_fp8_weight(shared_w13, shared_w13_scale).to(dtype)
        a, u = (xin @ Ws13.T).chunk(2, dim=-1)
        y += swiglu(a, u, swiglu_limit) @ lin.dequantize_fp8_weight(shared_w2, shared_w2_scale).to(dtype).T
        return y
    y += _shared(x, shared_w13, shared_w13_scale, shared_w2, shared_w2_scale, swiglu_limit, "reference").float()
    return fp8.canonical_nan(y.to(torch.bfloat16))


def error_bound(
    x, ids, weights, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2, shared_w2_scale, *, swiglu_limit
):
    """A first-order bound ``[T, Hd]`` float64 on |:func:`reference` on a path − the float64 oracle|, per element
    (``docs/moe.md#tolerance-of-the-v4-experts``). Each e4m3 activation is within 2^-4 of its value (relative),
    each bf16 rounding within 2^-8: with m(v, W) = |v| @ |W|ᵀ (the "mass" of a GEMM),

        |δa| ≤ 2^-4·m(x, W1) + 2^-8·|a|        (and δu likewise with W3)
        |δh| ≤ (1.1·|u|·|δa| + |silu(a)|·|δu|)·ω + 2^-8·|h|     |silu'| ≤ 1.1; the clamp only shrinks errors
        |δo| ≤ m(δh, W2) + 2^-4·m(h, W2) + 2^-8·|o|

    summed over the slots and the shared expert, plus 2^-8·|y| for the final rounding. The same bound holds for
    both paths (1x32 scales are never coarser than 1x128; the mega path skips roundings the bound allows)."""
    d = torch.float64
    q, r = 2.0**-4, 2.0**-8
    x64 = x.to(d)
    W13, W2 = dequantize_experts(w13, w13_scale, d), dequantize_experts(w2, w2_scale, d)
    Ws13 = lin.dequantize_fp8_weight(shared_w13, shared_w13_scale).to(d)
    Ws2 = lin.dequantize_fp8_weight(shared_w2, shared_w2_scale).to(d)

    def one(xr, w13e, w2e, omega):
        a, u = (xr @ w13e.T).chunk(2, dim=-1)
        ma, mu = (xr.abs() @ w13e.abs().T).chunk(2, dim=-1)
        da, du = q * ma + r * a.abs(), q * mu + r * u.abs()
        sa = torch.nn.functional.silu(a.clamp(max=swiglu_limit))
        h = swiglu(a, u, swiglu_limit) * omega[:, None]
        dh = (1.1 * u.abs() * da + sa.abs() * du) * omega[:, None] + r * h.abs()
        o = h @ w2e.T
        return dh.abs() @ w2e.abs().T + q * (h.abs() @ w2e.abs().T) + r * o.abs(), o

    bound = torch.zeros_like(x64)
    y = torch.zeros_like(x64)
    for e in range(W13.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel():
            b, o = one(x64[tok], W13[e], W2[e], weights[tok, slot].to(d))
            bound.index_add_(0, tok, b)
            y.index_add_(0, tok, o)
    b, o = one(x64, Ws13, Ws2, torch.ones(x.shape[0], dtype=d, device=x.device))
    return bound + b + r * (y + o).abs()


def _check(x, ids, weights, w13, w13_scale, w2, w2_scale, shared, swiglu_limit, path, x_fp8, x_sf):
    validate.tensor(x, "x", dtype=torch.bfloat16, ndim=2)
    T, Hd = x.shape
    if Hd % STAGE_BLOCK:
        raise ValueError(f"x: the hidden size must be a multiple of {STAGE_BLOCK}, got shape {tuple(x.shape)}")
    validate.tensor(ids, "ids", dtype=(torch.int32, torch.int64), ndim=2)
    K = ids.shape[1]
    validate.tensor(ids, "ids", shape=(T, K))
    validate.tensor(weights, "weights", dtype=torch.float32, shape=(T, K))
    validate.tensor(w13, "w13", dtype=_FP4, ndim=3)
    E, I2 = w13.shape[:2]
    I = I2 // 2
    if I2 % 2 or w13.shape[2] * 2 != Hd or I % STAGE_BLOCK:
        raise ValueError(f"w13: expected [E, 2I, {Hd // 2}] packed E2M1 with I a multiple of 128, got {tuple(w13.shape)}")
    validate.tensor(w13_scale, "w13_scale", dtype=torch.float8_e8m0fnu, shape=(E, I2, Hd // 32))
    validate.tensor(w2, "w2", dtype=_FP4, shape=(E, Hd, I // 2))
    validate.tensor(w2_scale, "w2_scale", dtype=torch.float8_e8m0fnu, shape=(E, Hd, I // 32))
    s13, s13s, s2, s2s = shared
    validate.tensor(s13, "shared_w13", dtype=torch.float8_e4m3fn, ndim=2)
    if s13.shape[1] != Hd:
        raise ValueError(f"shared_w13: expected [2Is, {Hd}], got {tuple(s13.shape)}")
    Is = s13.shape[0] // 2
    validate.tensor(s13s, "shared_w13_scale", dtype=torch.float8_e8m0fnu, shape=(-(-2 * Is // 128), Hd // 128))
    validate.tensor(s2, "shared_w2", dtype=torch.float8_e4m3fn, shape=(Hd, Is))
    validate.tensor(s2s, "shared_w2_scale", dtype=torch.float8_e8m0fnu, shape=(Hd // 128, -(-Is // 128)))
    validate.scalar(swiglu_limit, "swiglu_limit")
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    if path == "megamoe":
        if x_fp8 is None or x_sf is None:
            raise ValueError('x_fp8, x_sf: path="megamoe" reads moe.stage\'s outputs; pass them')
        validate.tensor(x_fp8, "x_fp8", dtype=torch.float8_e4m3fn, shape=(T, Hd))
        validate.tensor(x_sf, "x_sf", dtype=torch.int32, shape=(T, Hd // STAGE_BLOCK))
    validate.same_device(x=x, ids=ids, weights=weights, w13=w13, w2=w2, shared_w13=s13, shared_w2=s2, x_fp8=x_fp8, x_sf=x_sf)
    validate.not_meta(x, "x")
    if validate.check_values():
        validate.finite(x, "x")
    return T, Hd, K, E, I


def experts_fp4(
    x,
    ids,
    weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    shared_w13,
    shared_w13_scale,
    shared_w2,
    shared_w2_scale,
    *,
    swiglu_limit,
    path="deepseek",
    x_fp8=None,
    x_sf=None,
    backend="auto",
    launch=None,
):
    """Routed FP4 experts + the FP8 shared expert, combined: ``[T, Hd]`` bf16 (the module docstring's math).

    Args:
        x: ``[T, Hd]`` bf16, the ``ffn_norm`` output (Hd a multiple of 128).
        ids, weights: ``[T, K]`` int32/int64 expert ids (−1 = none) and fp32 routing weights (:func:`moe.route`).
        w13, w13_scale: ``[E, 2I, Hd/2]`` float4_e2m1fn_x2 (rows [0, I) = W1, [I, 2I) = W3) and
            ``[E, 2I, Hd/32]`` float8_e8m0fnu; w2, w2_scale: ``[E, Hd, I/2]`` and ``[E, Hd, I/32]`` (I % 128 == 0).
        shared_w13, shared_w13_scale, shared_w2, shared_w2_scale: the shared expert, float8_e4m3fn
            ``[2Is, Hd]`` / ``[Hd, Is]`` with float8_e8m0fnu 128×128 block scales.
        swiglu_limit: L (≤ 0: no clamp). path: ``"deepseek"`` or ``"megamoe"``.
        x_fp8, x_sf: :func:`moe.stage`'s e4m3 x and packed int32 scales: required on ``"megamoe"``.
        backend: ``"auto"`` (= ``"triton"``: the grouped GEMM kernel), ``"triton"`` or ``"reference"``.
        launch: :class:`Fp4Launch` or None (:func:`default_fp4_launch`).
    Raises:
        TypeError / ValueError naming the argument, before any work (a non-finite x with value checks on)."""
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    T, Hd, K, E, I = _check(
        x,
        ids,
        weights,
        w13,
        w13_scale,
        w2,
        w2_scale,
        (shared_w13, shared_w13_scale, shared_w2, shared_w2_scale),
        swiglu_limit,
        path,
        x_fp8,
        x_sf,
    )
    if launch is not None and not isinstance(launch, Fp4Launch):
        raise TypeError(f"launch: expected an Fp4Launch or None, got {type(launch).__name__}")
    args = (x, ids, weights, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2, shared_w2_scale)
    if backend == "reference":
        return reference(*args, swiglu_limit=float(swiglu_limit), path=path, x_fp8=x_fp8, x_sf=x_sf)
    launch = launch or default_fp4_launch(T, K, E)
    limit = float(swiglu_limit)
    order, counts, offsets = group_by_expert(ids, E)
    n = order.shape[0]
    te, r0, r1 = tile_table(counts, offsets, launch.block_m, n)
    rows = torch.arange(n, device=x.device)

    def gemm(a, a_sf, group, a_row, o_row, w, w_sf, n_out, N):
        out = torch.zeros(n_out, N, dtype=torch.float32, device=x.device)  # rows no tile covers stay 0
        moe_fp4_gemm_op(
            a.view(torch.uint8), a_sf, a_row, o_row, te, r0, r1, w.view(torch.uint8), w_sf.view(torch.uint8), out, group,
            *launch.op_args(),
        )  # fmt: skip
        return out

    if path == "megamoe":
        a, a_sf, group = x_fp8, x_sf, 32
    else:
        (a, a_sf), group = lin.act_quant(x, backend=backend), 128
    gu = gemm(a, a_sf, group, order // K, rows, w13, w13_scale, n, 2 * I)  # [n, 2I], grouped order
    g, u = gu.chunk(2, dim=-1)
    if path == "deepseek":
        g, u = _bf16(g), _bf16(u)
    h = swiglu(g, u, limit) * weights.reshape(-1)[order][:, None]
    if path == "megamoe":
        q, byte = fp8.quantize_ue8m0(h, STAGE_GROUP, STAGE_AMAX_FLOOR)
        hq, h_sf = q, byte.contiguous().view(torch.int32)  # four bytes to a little-endian word, as moe.stage
    else:
        hq, h_sf = lin.act_quant(h.to(torch.bfloat16), backend=backend)
    o = gemm(hq, h_sf, group, rows, order, w2, w2_scale, T * K, Hd)  # [T·K, Hd]: each slot's own row
    valid = ((ids >= 0) & (ids < E)).reshape(T, K, 1)
    y = torch.where(valid, _bf16(o).view(T, K, Hd), 0.0).sum(1)
    y = y + _shared(x, shared_w13, shared_w13_scale, shared_w2, shared_w2_scale, limit, backend).float()
    return fp8.canonical_nan(y.to(torch.bfloat16))
