"""DeepSeek-V4's quantised projections: FP8 (e4m3, 128x128 UE8M0 scales) and FP4 (E2M1, 1x32 UE8M0 scales)
weights times e4m3 activations with 1x128 power-of-two scales, fp32 accumulation per K block, bf16 out.

V4's config says ``"dtype": "fp8"``, ``"scale_fmt": "ue8m0"``, ``"expert_dtype": "fp4"``: every projection of
attention, the indexer's ``wq_b``, the shared expert and MTP's ``e_proj`` / ``h_proj`` is FP8; the routed
experts are FP4 (the table and the byte layouts: ``docs/linear.md``).

* :func:`act_quant` (x -> e4m3 + fp32 scales), :func:`fp8_gemm`, :func:`fp4_gemm` (pre-quantised activations),
  :func:`fp8_linear`, :func:`fp4_linear` (both steps);
* the weight quantisers :func:`quantize_fp8_weight`, :func:`quantize_fp4_weight` and their exact inverses;
* the E2M1 codec :func:`e2m1_encode`, :func:`e2m1_decode`, :func:`pack_e2m1`, :func:`unpack_e2m1`;
* :func:`grouped_o_proj`, the attention's output projection (bf16 ``wo_a`` per group of heads, then ``wo_b``),
  on the attention output after inverse RoPE: with a bf16 ``wo_b`` two bf16 GEMMs (reference only, no byte
  format to get wrong); with V4's FP8 ``wo_b`` the second GEMM is :func:`fp8_linear`'s (either backend).

Where to read what: :mod:`dsv4ref.linear.reference` (the formulas in plain torch), :mod:`.kernels` (Triton),
:mod:`.launch` (:class:`LinearLaunch`, the custom ops).
"""

from __future__ import annotations

import torch

from .. import validate
from ..formats import ACT_BLOCK, FP4_BLOCK, WEIGHT_BLOCK
from ..fp4 import e2m1_decode, e2m1_encode
from ..fp4 import pack_nibbles as pack_e2m1
from ..fp4 import unpack_nibbles as unpack_e2m1
from . import kernels, reference  # noqa: F401  (dsv4ref.linear.kernels / .reference, for readers)
from .launch import LinearLaunch, default_launch, run_act_quant, run_fp4_gemm, run_fp8_gemm

__all__ = [
    "SUPPORTED_BACKENDS",
    "LinearLaunch",
    "default_launch",
    "act_quant",
    "fp8_gemm",
    "fp4_gemm",
    "fp8_linear",
    "fp4_linear",
    "quantize_fp8_weight",
    "quantize_fp4_weight",
    "dequantize_fp8_weight",
    "dequantize_fp4_weight",
    "e2m1_encode",
    "e2m1_decode",
    "pack_e2m1",
    "unpack_e2m1",
    "grouped_o_proj",
]

SUPPORTED_BACKENDS = ("reference", "triton")  # from dsv4ref.validate.BACKENDS; "auto" = "triton"
FLOAT_INPUTS = (torch.float32, torch.bfloat16)
E4M3 = (torch.float8_e4m3fn, torch.uint8)  # e4m3 values, or their bytes
UE8M0 = (torch.float8_e8m0fnu, torch.uint8)  # UE8M0 scale bytes
ACT_SCALES = (torch.float32, torch.float8_e8m0fnu)
FP4_PACKED = (torch.float4_e2m1fn_x2, torch.uint8)
MAX_BLOCK = 4096
_REFERENCE_ONLY = ("reference",)  # grouped_o_proj: two bf16 GEMMs, no byte format


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _common(backend, launch, **tensors):
    for name, t in tensors.items():
        validate.not_meta(t, name)
    validate.same_device(**tensors)
    if launch is not None and not isinstance(launch, LinearLaunch):
        raise TypeError(f"launch: expected a LinearLaunch or None, got {type(launch).__name__}")
    return validate.backend(backend, SUPPORTED_BACKENDS)


def _check_x(x: torch.Tensor) -> None:
    validate.tensor(x, "x", dtype=FLOAT_INPUTS, ndim=2)
    validate.not_meta(x, "x")
    validate.finite(x, "x")


def _check_activations(q: torch.Tensor, s: torch.Tensor, k: int | None = None) -> tuple[int, int]:
    """q ``[M, K]`` e4m3, s ``[M, ceil(K/128)]``; with checks on, no NaN code and no non-finite scale."""
    validate.tensor(q, "q", dtype=E4M3, ndim=2)
    validate.tensor(s, "s", dtype=ACT_SCALES, ndim=2)
    m, kq = q.shape
    if k is not None and kq != k:
        raise ValueError(f"q: expected K = {k} columns (the weight's), got shape {tuple(q.shape)}")
    validate.tensor(s, "s", shape=(m, _cdiv(kq, ACT_BLOCK)))
    validate.not_meta(q, "q")
    validate.not_meta(s, "s")
    if validate.check_values() and q.numel():
        bad = (q.view(torch.uint8) & 0x7F) == 0x7F
        if bool(bad.any()):
            raise ValueError(f"q: e4m3 NaN codes (0x7F / 0xFF; the first at {tuple(bad.nonzero()[0].tolist())})")
        sv = reference.scale_values(s)
        if not bool(sv.isfinite().all()):
            raise ValueError(f"s: non-finite scales (NaN; the first at {tuple((~sv.isfinite()).nonzero()[0].tolist())})")
    return m, kq


def _check_fp8_weight(w: torch.Tensor, w_scale: torch.Tensor, name: str = "w") -> tuple[int, int]:
    validate.tensor(w, name, dtype=E4M3, ndim=2)
    n, k = w.shape
    validate.tensor(w_scale, f"{name}_scale", dtype=(*UE8M0, torch.float32))
    validate.tensor(w_scale, f"{name}_scale", shape=(_cdiv(n, WEIGHT_BLOCK), _cdiv(k, WEIGHT_BLOCK)))
    return n, k


def _check_fp4_weight(w_packed: torch.Tensor, w_scale: torch.Tensor) -> tuple[int, int]:
    """``[N, K/2]`` and ``[N, ceil(K/32)]``."""
    validate.tensor(w_packed, "w_packed", dtype=FP4_PACKED, ndim=2)
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    validate.tensor(w_scale, "w_scale", dtype=(*UE8M0, torch.float32))
    validate.tensor(w_scale, "w_scale", shape=(n, _cdiv(k, FP4_BLOCK)))
    return n, k


def act_quant(
    x: torch.Tensor, *, block: int = ACT_BLOCK, backend: str = "auto", launch: LinearLaunch | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations per 1 x ``block`` block along K: DeepSeek's ``act_quant`` with ``scale_fmt="ue8m0"``.

    Args:
        x: ``[M, K]`` bf16 or fp32, M >= 0, any strides. Finite: a NaN / ±inf raises ``ValueError("x: non-finite
            ...")`` while value checks are on; with them off its block is written as NaN (scale NaN, e4m3 codes
            0x7F, 0xFF where a non-NaN value has its sign bit set). K need not be a multiple of ``block``: the
            last partial block is a block of its own.
        block: values per scale, an int power of two in [1, 4096] (128 in V4).
        backend / launch: ``"auto"`` (= ``"triton"``), ``"triton"`` or ``"reference"`` (identical bytes); the
            kernel's :class:`LinearLaunch` or None.
    Returns:
        ``(q, s)``: q float8_e4m3fn ``[M, K]``, s float32 ``[M, ceil(K / block)]``, each a power of two
        2^(b − 127) with b = ceil(log2(max(amax, 1e-4) / 448)) + 127 (``s.view(torch.int32) >> 23`` is b).
    """
    _check_x(x)
    block = validate.power_of_two(block, "block")
    if block > MAX_BLOCK:
        raise ValueError(f"block: expected a power of two <= {MAX_BLOCK}, got {block}")
    backend = _common(backend, launch, x=x)
    if backend == "reference":
        return reference.act_quant(x, block)
    return run_act_quant(x, block, launch or default_launch(x.shape[0]))


def fp8_gemm(
    q: torch.Tensor,
    s: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    backend: str = "auto",
    launch: LinearLaunch | None = None,
) -> torch.Tensor:
    """``y = q · wᵀ`` with blockwise scales: per 128-wide K block, the block's product in fp32 from zero, times
    ``s[m, k] · w_scale[n // 128, k]``, added to the fp32 accumulator in K order; bf16 out.

    Args:
        q: ``[M, K]`` float8_e4m3fn (or its bytes, uint8), any strides; ``s``: ``[M, ceil(K/128)]`` float32 (or
            UE8M0 bytes as float8_e8m0fnu): :func:`act_quant`'s outputs. With value checks on, a NaN code or a
            NaN scale raises ``ValueError``; off, they give NaN rows.
        w: ``[N, K]`` float8_e4m3fn (or uint8 bytes); ``w_scale``: ``[ceil(N/128), ceil(K/128)]``
            float8_e8m0fnu (or uint8 bytes, or float32 values). Parameters: not value-checked (byte 255 reads NaN).
    Returns:
        bf16 ``[M, N]``, contiguous; every NaN is 0x7FC0.
    """
    n, k = _check_fp8_weight(w, w_scale)
    m, _ = _check_activations(q, s, k)
    backend = _common(backend, launch, q=q, s=s, w=w, w_scale=w_scale)
    if backend == "reference":
        return reference.fp8_gemm(q, s, w, w_scale)
    return run_fp8_gemm(q, s, w, w_scale, launch or default_launch(m))


def fp4_gemm(
    q: torch.Tensor,
    s: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    backend: str = "auto",
    launch: LinearLaunch | None = None,
) -> torch.Tensor:
    """``y = q · wᵀ`` for an FP4 weight: per 32-wide K block, the block's product in fp32 from zero, times
    ``s[m, k // 4] · w_scale[n, k]``, added to the fp32 accumulator in K order; bf16 out. (The routed
    experts, one weight per row, go through the MoE's grouped FP4 GEMM: :func:`dsv4ref.moe.experts_fp4`.)

    Args:
        q, s: as :func:`fp8_gemm` (K = 2 · w_packed's columns).
        w_packed: ``[N, K/2]`` float4_e2m1fn_x2 (DeepSeek's checkpoint dtype) or its bytes as uint8; element 2j
            of a row in the LOW nibble of byte j.
        w_scale: ``[N, ceil(K/32)]`` float8_e8m0fnu (or uint8 bytes, or float32 values). Not value-checked.
    Returns:
        bf16 ``[M, N]``, contiguous.
    """
    n, k = _check_fp4_weight(w_packed, w_scale)
    m, _ = _check_activations(q, s, k)
    backend = _common(backend, launch, q=q, s=s, w_packed=w_packed, w_scale=w_scale)
    if backend == "reference":
        return reference.fp4_gemm(q, s, w_packed, w_scale)
    return run_fp4_gemm(q, s, w_packed, w_scale, launch or default_launch(m))


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, backend: str = "auto", launch: LinearLaunch | None = None
) -> torch.Tensor:
    """:func:`act_quant` then :func:`fp8_gemm`: DeepSeek's ``linear(x, weight)`` for an FP8 weight. x ``[M, K]``
    bf16 / fp32 (:func:`act_quant`'s rules), w / w_scale as :func:`fp8_gemm`. Returns bf16 ``[M, N]``."""
    _check_x(x)
    _, k = _check_fp8_weight(w, w_scale)
    if x.shape[1] != k:
        raise ValueError(f"x: expected K = {k} columns (the weight's), got shape {tuple(x.shape)}")
    _common(backend, launch, x=x, w=w, w_scale=w_scale)
    with validate.checking_values(False):  # x was checked above; act_quant's output is finite or NaN by policy
        q, s = act_quant(x, backend=backend, launch=launch)
        return fp8_gemm(q, s, w, w_scale, backend=backend, launch=launch)


def fp4_linear(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    backend: str = "auto",
    launch: LinearLaunch | None = None,
) -> torch.Tensor:
    """:func:`act_quant` then :func:`fp4_gemm`: DeepSeek's ``linear(x, weight)`` for an FP4 (routed expert)
    weight. x ``[M, K]`` bf16 / fp32; w_packed / w_scale as :func:`fp4_gemm`. Returns bf16 ``[M, N]``."""
    _check_x(x)
    _, k = _check_fp4_weight(w_packed, w_scale)
    if x.shape[1] != k:
        raise ValueError(f"x: expected K = {k} columns (the weight's), got shape {tuple(x.shape)}")
    _common(backend, launch, x=x, w_packed=w_packed, w_scale=w_scale)
    with validate.checking_values(False):
        q, s = act_quant(x, backend=backend, launch=launch)
        return fp4_gemm(q, s, w_packed, w_scale, backend=backend, launch=launch)


def _check_weight(w: torch.Tensor, name: str = "w") -> None:
    validate.tensor(w, name, dtype=FLOAT_INPUTS, ndim=2)
    validate.not_meta(w, name)
    validate.finite(w, name)


def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 / fp32 W ``[N, K]`` -> ``(e4m3 [N, K], float8_e8m0fnu [ceil(N/128), ceil(K/128)])``: per 128x128
    tile, scale 2^ceil(log2(max(amax, 448·2^-126) / 448)), values e4m3(clamp(w / scale, ±448)). Partial tiles
    at the edges are tiles of their own. Non-finite W: ``ValueError`` (checks on); off, its tile is NaN (byte
    255, codes 0x7F / 0xFF). Plain torch (an offline step)."""
    _check_weight(w)
    return reference.quantize_fp8_weight(w)


def quantize_fp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 / fp32 W ``[N, K]``, K even -> ``(float4_e2m1fn_x2 [N, K/2], float8_e8m0fnu [N, ceil(K/32)])``: per
    1x32 block, scale 2^ceil(log2(max(amax, 6·2^-126) / 6)), codes E2M1(clamp(w / scale, ±6)) rounded to nearest
    even, element 2j in the LOW nibble of byte j. Non-finite W: ``ValueError`` (checks on); off, byte 255 and
    codes 0x7 / 0xF. Plain torch (an offline step)."""
    _check_weight(w)
    if w.shape[1] % 2:
        raise ValueError(f"w: K must be even to pack two E2M1 codes a byte, got shape {tuple(w.shape)}")
    return reference.quantize_fp4_weight(w)


def dequantize_fp8_weight(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[N, K]`` and its 128x128 scales -> fp32 ``[N, K]``, exact (byte 255 / NaN codes: NaN)."""
    _check_fp8_weight(w, w_scale)
    return reference.dequantize_fp8_weight(w, w_scale)


def dequantize_fp4_weight(w_packed: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 ``[N, K/2]`` and its 1x32 scales -> fp32 ``[N, K]``, exact (byte 255: NaN)."""
    _check_fp4_weight(w_packed, w_scale)
    return reference.dequantize_fp4_weight(w_packed, w_scale)


def grouped_o_proj(
    o: torch.Tensor,
    wo_a: torch.Tensor,
    wo_b: torch.Tensor,
    wo_b_scale: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    launch: LinearLaunch | None = None,
) -> torch.Tensor:
    """out = wo_b( concat_g( wo_a[g] @ o[t, heads of group g].flatten() ) ) (``docs/linear.md#the-attentions-output-projection``).

    The ``wo_a`` half is a bf16 einsum per group (fp32 accumulation, z rounded to bf16). ``wo_b`` is bf16 (a
    second bf16 GEMM) or, as in V4's checkpoint, FP8 with its 128x128 scales: then z goes through
    :func:`fp8_linear` (the 1x128 activation quantiser and the FP8 GEMM), as DeepSeek's ``Attention`` does.
    Non-finite values propagate as in any GEMM (a NaN in o[t] makes the groups it feeds NaN, so row t of
    the output NaN; never an error).

    Args:
        o: ``[T, H, 512]`` bf16 (any strides): the attention output AFTER inverse RoPE, padded heads already removed.
        wo_a: ``[G, o_lora, (H/G)·512]`` bf16 (any strides): group g owns the contiguous heads [g·hpg, (g+1)·hpg).
        wo_b: ``[Hd, G·o_lora]`` bf16, or float8_e4m3fn (or its uint8 bytes) with ``wo_b_scale``.
        wo_b_scale: None (bf16 ``wo_b``), or ``[ceil(Hd/128), ceil(G·o_lora/128)]`` float8_e8m0fnu (or uint8
            bytes, or float32 values) for an FP8 ``wo_b``.
        backend: bf16 ``wo_b``: ``"auto"`` (= ``"reference"``) or ``"reference"`` (no kernel: two bf16 GEMMs, no
            byte format to get wrong). FP8 ``wo_b``: as :func:`fp8_linear` (``"auto"`` = ``"triton"``).
        launch: a :class:`LinearLaunch` for the FP8 GEMM's kernels, or None (taken and unused where no kernel runs).
    Returns:
        ``[T, Hd]`` bf16.
    """
    validate.tensor(o, "o", dtype=torch.bfloat16, ndim=3)
    validate.tensor(wo_a, "wo_a", dtype=torch.bfloat16, ndim=3)
    fp8 = wo_b_scale is not None
    if fp8:
        _check_fp8_weight(wo_b, wo_b_scale, name="wo_b")
        backend = _common(backend, launch, o=o, wo_a=wo_a, wo_b=wo_b, wo_b_scale=wo_b_scale)
    else:  # no kernel to run: a LinearLaunch is taken and unused, as every reference backend does
        validate.tensor(wo_b, "wo_b", dtype=torch.bfloat16, ndim=2)
        validate.backend(backend, _REFERENCE_ONLY, auto="reference")
        _common("reference", launch, o=o, wo_a=wo_a, wo_b=wo_b)
    T, H, D = o.shape
    G, o_lora, width = wo_a.shape
    if G < 1 or H % G:
        raise ValueError(f"wo_a: G = {G} groups must divide H = {H} heads (o has shape {tuple(o.shape)})")
    if width != (H // G) * D:
        raise ValueError(f"wo_a: expected shape ({G}, o_lora, {(H // G) * D}) = (G, o_lora, H/G·{D}), got {tuple(wo_a.shape)}")
    if wo_b.shape[1] != G * o_lora:
        raise ValueError(f"wo_b: expected shape (Hd, {G * o_lora}) = (Hd, G·o_lora), got {tuple(wo_b.shape)}")
    if not fp8:
        return reference.grouped_o_proj(o, wo_a, wo_b)
    z = reference.o_groups(o, wo_a)  # the bf16 half has no kernel: a torch einsum on every backend
    with validate.checking_values(False):  # non-finite o propagates (a NaN row), as in the bf16 path
        return fp8_linear(z, wo_b, wo_b_scale, backend=backend, launch=launch)
