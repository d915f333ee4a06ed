"""DeepSeek-V4's quantised projections in plain torch: the definition the Triton kernels are held to.

The whole recipe (``docs/linear.md``), for ``y = x · Wᵀ`` with x ``[M, K]`` and W ``[N, K]``::

    act_quant   per 1x128 block of x along K:  s = 2^ceil(log2(max(amax, 1e-4) / 448))   (an fp32 power of two)
                                               q = e4m3(clamp(x / s, ±448))               (round to nearest even)
    fp8_gemm    W: e4m3 with one UE8M0 byte per 128x128 tile.  For each 128-wide K block k, in K order:
                    P_k  = Σ_{i in block k} q[m, i] · W[n, i]          fp32, on its own (from zero)
                    acc += P_k · (s[m, k] · s_W[n // 128, k])          a second fp32 accumulator
                y = bf16(acc)
    fp4_gemm    W: E2M1 (two codes a byte, the even element in the LOW nibble) with one UE8M0 byte per 1x32
                block.  The same, per 32-wide K block k:  acc += P_k · (s[m, k // 4] · s_W[n, k])

Every scale is a power of two, so the scaling multiplies are exact; the products of e4m3 (or E2M1) values
are exact in fp32; what rounds is the fp32 sums and the final bf16. ``dtype=torch.float64`` gives the
oracle of the same quantised operands (exact products and sums in float64, no bf16 rounding), the answer a
kernel is held to under the ``linear_out`` tolerance.

K that is not a multiple of the block: the last, partial block is a block of its own (its amax over the
values it has), which is the answer for K padded with zeros to a whole block. DeepSeek's own ``act_quant``
asserts ``K % 128 == 0`` (every V4 projection has such a K); dsv4ref extends it this way.

The attention's output projection ``grouped_o_proj`` (bf16 weights on every V4 config's ``wo_a``): heads in G
contiguous groups, ``out = wo_b(concat_g wo_a[g] · o_g)``, both GEMMs in fp32, z rounded to bf16 between them.

Non-finite values (``docs/formats.md#non-finite-values``): a block of x holding a NaN or ±inf is quantised as
NaN (scale NaN, e4m3 codes 0x7F / 0xFF, ``dsv4ref.fp8``'s rule), so every output of that row is NaN; NaN codes
and scale byte 255 read as NaN; the GEMMs are IEEE arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from ..formats import ACT_AMAX_FLOOR, ACT_BLOCK, FP4_BLOCK, FP8_WEIGHT_AMAX_FLOOR, WEIGHT_BLOCK
from ..fp4 import e2m1_decode, unpack_nibbles
from ..fp8.reference import canonical_nan, quantize_ue8m0, ue8m0_value
from ..indexer.mxfp4 import quantize_mxfp4

__all__ = [
    "act_quant",
    "fp8_gemm",
    "fp4_gemm",
    "fp8_linear",
    "fp4_linear",
    "quantize_fp8_weight",
    "quantize_fp4_weight",
    "dequantize_fp8_weight",
    "dequantize_fp4_weight",
    "scale_values",
    "gemm_mass",
    "blockwise_gemm",
    "grouped_o_proj",
]


def _pad_last(x: torch.Tensor, block: int) -> torch.Tensor:
    """x with its last dim zero-padded to a multiple of ``block``."""
    return F.pad(x, (0, -x.shape[-1] % block))


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Any scale tensor -> its fp32 values: fp32 as it is; UE8M0 bytes (``float8_e8m0fnu`` or uint8) as E8M0
    defines them (byte 0 is 2^-127, 255 is NaN)."""
    if scale.dtype == torch.float32:
        return scale
    return ue8m0_value(scale.view(torch.uint8))


def act_quant(x: torch.Tensor, block: int = ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` -> ``(q float8_e4m3fn [M, K], s float32 [M, ceil(K / block)])``, s a power of two (NaN for a
    non-finite block): ``dsv4ref.fp8``'s UE8M0 quantiser with DeepSeek's floor 1e-4, its scale stored as fp32."""
    q, byte = quantize_ue8m0(_pad_last(x.float(), block), block, ACT_AMAX_FLOOR)
    return q[:, : x.shape[1]], ue8m0_value(byte)


def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W ``[N, K]`` -> ``(e4m3 [N, K], UE8M0 float8_e8m0fnu [ceil(N/128), ceil(K/128)])``: one scale per 128x128
    tile, the same rule as ``act_quant`` with the amax floor 448·2^-126 (so only an all-zero tile meets it)."""
    n, k = w.shape
    wp = F.pad(w.float(), (0, -k % WEIGHT_BLOCK, 0, -n % WEIGHT_BLOCK))
    tiles = rearrange(wp, "(a r) (b c) -> a b (r c)", r=WEIGHT_BLOCK, c=WEIGHT_BLOCK)  # one tile per row
    q, byte = quantize_ue8m0(tiles, WEIGHT_BLOCK * WEIGHT_BLOCK, FP8_WEIGHT_AMAX_FLOOR)
    q = rearrange(q, "a b (r c) -> (a r) (b c)", r=WEIGHT_BLOCK)
    return q[:n, :k].contiguous(), byte[..., 0].contiguous().view(torch.float8_e8m0fnu)


def quantize_fp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W ``[N, K]`` (K even) -> ``(packed float4_e2m1fn_x2 [N, K/2], UE8M0 float8_e8m0fnu [N, ceil(K/32)])``:
    DeepSeek's MXFP4 rule, the indexer's codec (:func:`dsv4ref.indexer.mxfp4.quantize_mxfp4`) run on rows of
    128 (so each 1x32 block: byte from max(amax, 6·2^-126) / 6, E2M1 round to nearest even, clamp ±6)."""
    n, k = w.shape
    rows = _pad_last(w.float(), 128).reshape(-1, 128)
    packed, byte = quantize_mxfp4(rows)
    packed = packed.reshape(n, -1)[:, : k // 2].contiguous()
    return packed.view(torch.float4_e2m1fn_x2), byte.reshape(n, -1)[:, : -(-k // FP4_BLOCK)].contiguous().view(
        torch.float8_e8m0fnu
    )


def dequantize_fp8_weight(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[N, K]`` × its 128x128 scales -> fp32 ``[N, K]``, exact."""
    n, k = w8.shape
    s = scale_values(scale).repeat_interleave(WEIGHT_BLOCK, 0).repeat_interleave(WEIGHT_BLOCK, 1)
    return w8.view(torch.float8_e4m3fn).float() * s[:n, :k]


def dequantize_fp4_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 ``[N, K/2]`` packed × its 1x32 scales -> fp32 ``[N, K]``, exact."""
    codes = unpack_nibbles(packed.view(torch.uint8))
    return e2m1_decode(codes) * scale_values(scale).repeat_interleave(FP4_BLOCK, 1)[:, : codes.shape[1]]


def blockwise_gemm(a, b, block, scale, dtype):
    """Σ_k P_k · scale[k] in K order, P_k = a_k · b_kᵀ the product of K block k alone; ``scale`` [nb, M, N]."""
    ab = rearrange(_pad_last(a, block), "m (k c) -> k m c", c=block)
    bb = rearrange(_pad_last(b, block), "n (k c) -> k n c", c=block)
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=dtype, device=a.device)
    for k in range(ab.shape[0]):
        acc = acc + (ab[k] @ bb[k].T) * scale[k]
    return acc


def _out(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return acc if dtype == torch.float64 else canonical_nan(acc.to(torch.bfloat16))


def fp8_gemm(q, s, w, w_scale, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``y [M, N] = Σ_k (q_k · w_kᵀ) · s[:, k] · w_scale[n // 128, k]`` (bf16; float64 without rounding with
    ``dtype=torch.float64``). q e4m3 ``[M, K]``, s ``[M, ceil(K/128)]``, w e4m3 ``[N, K]``, w_scale
    ``[ceil(N/128), ceil(K/128)]`` (UE8M0 bytes or fp32)."""
    n = w.shape[0]
    a = q.view(torch.float8_e4m3fn).to(dtype)
    b = w.view(torch.float8_e4m3fn).to(dtype)
    sa = scale_values(s).to(dtype).T[:, :, None]  # [nb, M, 1]
    sb = scale_values(w_scale).to(dtype).repeat_interleave(WEIGHT_BLOCK, 0)[:n].T[:, None, :]  # [nb, 1, N]
    return _out(blockwise_gemm(a, b, ACT_BLOCK, sa * sb, dtype), dtype)


def fp4_gemm(q, s, w_packed, w_scale, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``y [M, N] = Σ_k (q_k · w_kᵀ) · s[:, k // 4] · w_scale[n, k]`` over 32-wide K blocks k. q e4m3 ``[M, K]``,
    s ``[M, ceil(K/128)]``, w_packed E2M1 ``[N, K/2]``, w_scale UE8M0 ``[N, ceil(K/32)]``. (DeepSeek converts
    E2M1 to e4m3 for the MMA: exact, so decoding to ``dtype`` here is the same value.)"""
    a = q.view(torch.float8_e4m3fn).to(dtype)
    b = e2m1_decode(unpack_nibbles(w_packed.view(torch.uint8))).to(dtype)
    sa = scale_values(s).to(dtype).repeat_interleave(ACT_BLOCK // FP4_BLOCK, 1)[:, : w_scale.shape[1]]
    sab = sa.T[:, :, None] * scale_values(w_scale).to(dtype).T[:, None, :]  # [nb32, M, N]
    return _out(blockwise_gemm(a, b, FP4_BLOCK, sab, dtype), dtype)


def fp8_linear(x, w, w_scale, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``act_quant`` then ``fp8_gemm``: DeepSeek's ``linear`` for an FP8 weight."""
    return fp8_gemm(*act_quant(x), w, w_scale, dtype=dtype)


def fp4_linear(x, w_packed, w_scale, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``act_quant`` (1x128, e4m3) then ``fp4_gemm``: DeepSeek's ``linear`` for an FP4 (expert) weight."""
    return fp4_gemm(*act_quant(x), w_packed, w_scale, dtype=dtype)


def gemm_mass(q, s, w, w_scale, *, fp4: bool = False) -> torch.Tensor:
    """float64 ``Σ_i |q[m, i]·w[n, i]|·scales``: the oracle run on the magnitudes (sign bits cleared), the scale
    a GEMM's rounding error grows with (the ``mass`` of the ``linear_out`` tolerance)."""
    sign = 0x77 if fp4 else 0x7F  # E2M1: bit 3 of each nibble; e4m3: bit 7
    gemm = fp4_gemm if fp4 else fp8_gemm
    return gemm(q.view(torch.uint8) & 0x7F, s, w.view(torch.uint8) & sign, w_scale, dtype=torch.float64)


def o_groups(o: torch.Tensor, wo_a: torch.Tensor) -> torch.Tensor:
    """The ``wo_a`` half of the output projection: z[t, g] = wo_a[g] @ o[t, heads of group g], group g = heads
    [g·hpg, (g+1)·hpg); fp32 accumulation, z rounded to bf16 like any activation between two GEMMs.
    o ``[T, H, 512]``, wo_a ``[G, o_lora, hpg·512]``; returns bf16 ``[T, G·o_lora]``."""
    # fp32 copies in one layout, so that every input layout gives the same summation order (the same bits)
    o, wo_a = (t.float().contiguous() for t in (o, wo_a))
    og = rearrange(o, "t (g h) d -> t g (h d)", g=wo_a.shape[0])  # contiguous head groups
    z = torch.einsum("tgk,gok->tgo", og, wo_a).to(torch.bfloat16)  # (T, G, o_lora)
    return rearrange(z, "t g o -> t (g o)")


def grouped_o_proj(
    o: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor, wo_b_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """out = wo_b(z), z = :func:`o_groups` (o, wo_a). A bf16 ``wo_b``: a bf16 GEMM, fp32 accumulation. V4's FP8
    ``wo_b`` (with its 128x128 scales): z through :func:`fp8_linear`, as DeepSeek's ``Attention`` does."""
    z = o_groups(o, wo_a)
    if wo_b_scale is not None:
        return fp8_linear(z, wo_b, wo_b_scale)
    return (z.float() @ wo_b.float().contiguous().T).to(torch.bfloat16)
