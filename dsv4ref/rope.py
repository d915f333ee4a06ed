"""GPT-J RoPE on the last 64 dims, with YaRN; the fused Q-norm + RoPE + FP8 KV insert; inverse RoPE on the
attention output; the grouped low-rank output projection.

Facts: ``../shared/spec/rope.md`` (all sections), ``config.md``, ``pitfalls.md`` #14–#16.

DeepSeek-V4 rotates only the **last** R = 64 dims of every 512-dim head (dims 448..511), and pairs them
**GPT-J style** (interleaved): pair i is (x[2i], x[2i+1]), read as the complex number x[2i] + j·x[2i+1]
and multiplied by e^{j·p·inv_freq[i]}. NeoX (half-split) pairing, (x[i], x[i+32]), is here only as the
contrast that breaks things.

The cos/sin table is fp32 ``[max_pos, 64]``, row p = ``[cos f_0 … cos f_31 | sin f_0 … sin f_31]`` (not
interleaved), f_i = fp32(p)·inv_freq[i]. Every kernel takes the table as an input; bit-exactness is judged
given the same table.

Arithmetic rule (the "canonical form" every backend follows, so results are bit-identical):

* rotation: ``e·c − o·s`` and ``e·s + o·c`` from separately rounded fp32 products (no FMA; the Triton
  launches pass ``enable_fp_fusion=False``), rounded once to the output dtype (bf16: nearest-even);
* weight-free RMSNorm of q: ``ss = Σ q²`` summed in float64 (so the summation order does not matter),
  rounded to fp32, ``rr = 1 / sqrt(ss/512 + eps)`` with a correctly rounded sqrt and division (never an
  approximate rsqrt), ``q·rr`` in fp32. The rotation takes the fp32 normalised values (rope.md §5: the fp32
  form; vLLM's torch test reference rounds to bf16 after the norm, which differs by ≤ 1 bf16 ulp).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import kv_cache, validate
from .device import DEVICE
from .harness import BenchCase, CheckRow, bench, check
from .kv_cache import HEAD_DIM, NOPE_DIM, ROPE_DIM
from .testing import compare, randn
from .tl_helpers import bf16_rne_bits, e4m3_encode, inv_pow2, page_offsets, ue8m0_byte

__all__ = [
    "inv_freq",
    "yarn_correction_range",
    "cos_sin_rows",
    "cos_sin_cache",
    "compressed_position",
    "apply_gptj",
    "apply_neox",
    "qnorm_rope_kv_insert",
    "grouped_o_proj",
    "MAX_HEADS",
]

MAX_HEADS = 128  # FlashMLA-style kernels pad H to 64 or 128; more is rejected (README §3, Hp)

# ----------------------------------------------------------------------------------------------------
# 1. Frequencies and the cos/sin table (rope.md §2, §3)
# ----------------------------------------------------------------------------------------------------


def _yarn_args(yarn: dict) -> tuple[float, float, float, float]:
    missing = {"factor", "original_max_position", "beta_fast", "beta_slow"} - set(yarn)
    if missing:
        raise ValueError(f"yarn: missing keys {sorted(missing)}; expected factor, original_max_position, "
                         f"beta_fast, beta_slow (as in dsv4ref.config.Config.yarn)")
    return float(yarn["factor"]), float(yarn["original_max_position"]), float(yarn["beta_fast"]), float(yarn["beta_slow"])


def yarn_correction_range(rope_dim: int, theta: float, yarn: dict) -> tuple[float, float]:
    """(low, high) pair indices of YaRN's linear ramp (rope.md §3).

    corr(n) = R·ln(L0 / (2π n)) / (2 ln θ) is the pair index whose wavelength fits n times into the
    original context L0. low = max(floor(corr(β_fast)), 0), high = min(ceil(corr(β_slow)), R − 1); if they
    are equal, high += 0.001 (the ramp needs a non-zero width). θ = 160000, L0 = 65536: (15, 25).
    """
    _, L0, beta_fast, beta_slow = _yarn_args(yarn)

    def corr(n: float) -> float:
        return rope_dim * math.log(L0 / (2 * math.pi * n)) / (2 * math.log(theta))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    return float(low), float(high)


def inv_freq(rope_dim: int = ROPE_DIM, theta: float = 10000.0, yarn: dict | None = None) -> torch.Tensor:
    """fp32 ``[rope_dim // 2]``: the angle per position of each pair, on the CPU.

    Plain RoPE: inv_freq[i] = θ^(−2i/R). With YaRN: pairs below ``low`` keep that (original) frequency,
    pairs above ``high`` are slowed down by ``factor``, and the ramp blends linearly in between.
    """
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim: expected a positive even number, got {rope_dim}")
    if not theta > 1:
        raise ValueError(f"theta: expected > 1, got {theta}")
    pf = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)  # θ^(2i/R), fp32
    extra = 1.0 / pf
    if yarn is None:
        return extra
    factor = _yarn_args(yarn)[0]
    inter = 1.0 / (factor * pf)
    low, high = yarn_correction_range(rope_dim, theta, yarn)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inter * ramp + extra * (1 - ramp)


def cos_sin_rows(positions: torch.Tensor, rope_dim: int = ROPE_DIM, theta: float = 10000.0,
                 yarn: dict | None = None) -> torch.Tensor:
    """The table rows for the given positions only: fp32 ``[len(positions), rope_dim]``, bit-identical to
    ``cos_sin_cache(max_pos, …)[positions]`` (the same fp32 recipe). Lets tests look at position 2^20 − 1
    without building the 256 MiB table. Computed on the CPU, returned on ``positions.device``."""
    validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32), ndim=1)
    f = positions.cpu().to(torch.float32)[:, None] * inv_freq(rope_dim, theta, yarn)[None, :]  # fp32(p)·inv_freq
    return torch.cat([torch.cos(f), torch.sin(f)], dim=1).to(positions.device)


def cos_sin_cache(max_pos: int, rope_dim: int = ROPE_DIM, theta: float = 10000.0, yarn: dict | None = None,
                  *, device=None) -> torch.Tensor:
    """fp32 ``[max_pos, rope_dim]``: row p = ``[cos f_0 … cos f_{R/2−1} | sin f_0 … sin f_{R/2−1}]``.

    Built on the CPU (so every machine gets the same bits), then moved to ``device`` (default DEVICE).
    ``yarn``: dict(factor, original_max_position, beta_fast, beta_slow), e.g. ``config.FLASH.yarn``;
    DSV4 uses θ = 10000 without YaRN on window-only layers and θ = 160000 with YaRN on compressed layers.
    No mscale: the values are plain cos/sin (rope.md §2).
    """
    if max_pos < 1:
        raise ValueError(f"max_pos: expected >= 1, got {max_pos}")
    return cos_sin_rows(torch.arange(max_pos), rope_dim, theta, yarn).to(device or DEVICE)


def compressed_position(p: torch.Tensor | int, ratio: int):
    """The position a compressed key (and the indexer key) is rotated at: (p // r)·r, the first position
    of its window of r tokens (rope.md §4). Ratio 0/1 (window-only) returns p."""
    r = max(1, int(ratio))
    return (p // r) * r


# ----------------------------------------------------------------------------------------------------
# 2. Rotation: reference (torch) and a Triton kernel
# ----------------------------------------------------------------------------------------------------


def _check_table(cos_sin: torch.Tensor) -> int:
    validate.tensor(cos_sin, "cos_sin", dtype=torch.float32, ndim=2)
    R = cos_sin.shape[1]
    if R <= 0 or R % 2:
        raise ValueError(f"cos_sin: expected [max_pos, R] with R even, got shape {tuple(cos_sin.shape)}")
    if cos_sin.stride(1) != 1:
        raise ValueError(f"cos_sin: rows must be contiguous (strides {cos_sin.stride()})")
    return R


def _rows_for(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Table rows broadcast to x.shape[:-1] + (R,)."""
    rows = cos_sin[positions.long()]
    while rows.dim() < x.dim():
        rows = rows.unsqueeze(-2)  # one position per token, shared by all heads
    return rows


def _check_rotate_args(x, positions, cos_sin) -> int:
    validate.tensor(x, "x", dtype=(torch.bfloat16, torch.float32))
    R = _check_table(cos_sin)
    if x.dim() < 1 or x.shape[-1] < R:
        raise ValueError(f"x: the last dim must hold the {R} rotary dims, got shape {tuple(x.shape)}")
    validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32))
    if tuple(positions.shape) not in (tuple(x.shape[:-1]), tuple(x.shape[:1])):
        raise ValueError(f"positions: expected shape {tuple(x.shape[:-1])} (one per row) or {tuple(x.shape[:1])} "
                         f"(one per token), got {tuple(positions.shape)}")
    validate.same_device(x=x, positions=positions, cos_sin=cos_sin)
    validate.index_range(positions, "positions", cos_sin.shape[0], allow_minus_one=False)
    return R


def _gptj_reference(x, positions, cos_sin, inverse):
    R = cos_sin.shape[1]
    rows = _rows_for(x, positions, cos_sin)
    c, s = rows[..., : R // 2], rows[..., R // 2:]
    if inverse:
        s = -s  # rotate by −f: the complex conjugate
    xr = x[..., -R:].float()
    e, o = xr[..., 0::2], xr[..., 1::2]  # pairs (x[2i], x[2i+1])
    rot = torch.stack([e * c - o * s, e * s + o * c], dim=-1).flatten(-2)  # re-interleave
    out = x.clone()
    out[..., -R:] = rot.to(x.dtype)  # one rounding (nearest-even) to x's dtype
    return out


def _neox_reference(x, positions, cos_sin, inverse):
    R = cos_sin.shape[1]
    rows = _rows_for(x, positions, cos_sin)
    c, s = rows[..., : R // 2], rows[..., R // 2:]
    if inverse:
        s = -s
    xr = x[..., -R:].float()
    a, b = xr[..., : R // 2], xr[..., R // 2:]  # pairs (x[i], x[i + R/2])
    out = x.clone()
    out[..., -R:] = torch.cat([a * c - b * s, a * s + b * c], dim=-1).to(x.dtype)
    return out


@triton.jit
def _gptj_kernel(
    x_ptr,  # [N, D] rows: int16 view of bf16 when IS_BF16, else fp32; row stride x_stride
    out_ptr,  # [N, D] same dtype (contiguous); only its last R dims are written (the rest is a copy of x)
    pos_ptr,  # int64 [N // POS_DIV]: position of row n is pos[n // POS_DIV]
    tab_ptr,  # fp32 [max_pos, R] table, row stride tab_stride
    n_rows,
    x_stride,
    D,
    tab_stride,
    POS_DIV,  # rows per position (heads per token), 1 when positions has x's leading shape
    R: tl.constexpr,  # rotary dims (64)
    ROWS: tl.constexpr,  # rows per program
    INVERSE: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    # A [ROWS, R] tile of the rotary slice. Each element is loaded together with its pair partner
    # (index ^ 1), so output element d is x[d]·c ∓ x[d^1]·s with one vector, no shuffles.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, R)
    ok = (rows < n_rows)[:, None] & (j < R)[None, :]
    col = D - R + j
    src = x_ptr + rows[:, None] * x_stride + col[None, :]
    par = x_ptr + rows[:, None] * x_stride + (D - R + (j ^ 1))[None, :]
    if IS_BF16:  # widen bf16 bits in integers: no bf16 arithmetic (interpreter bug I3)
        x = ((tl.load(src, mask=ok, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        y = ((tl.load(par, mask=ok, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(src, mask=ok, other=0.0)
        y = tl.load(par, mask=ok, other=0.0)
    pos = tl.load(pos_ptr + rows // POS_DIV, mask=rows < n_rows, other=0).to(tl.int64)
    trow = tab_ptr + pos[:, None] * tab_stride + (j // 2)[None, :]
    c = tl.load(trow, mask=ok, other=0.0)
    s = tl.load(trow + R // 2, mask=ok, other=0.0)
    if INVERSE:
        s = -s
    even = (j % 2 == 0)[None, :]
    # even d: e·c − o·s ; odd d: o·c + e·s (= e·s + o·c). Two rounded products and one add.
    r = x * c + tl.where(even, -(y * s), y * s)
    dst = out_ptr + rows[:, None] * D + col[None, :]
    if IS_BF16:
        tl.store(dst, bf16_rne_bits(r).to(tl.int16, bitcast=True), mask=ok)
    else:
        tl.store(dst, r, mask=ok)


@torch.library.custom_op("dsv4ref::rope_gptj", mutates_args=("out",))
def _rope_gptj_op(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, out: torch.Tensor,
                  pos_div: int, inverse: bool) -> None:
    """x, out: [N, D] (out contiguous, a copy of x); positions int64 [N // pos_div]."""
    n, D = x.shape
    if n == 0:
        return
    bf16 = x.dtype == torch.bfloat16
    xv, ov = (x.view(torch.int16), out.view(torch.int16)) if bf16 else (x, out)
    rows = 16
    _gptj_kernel[(triton.cdiv(n, rows),)](
        xv, ov, positions, cos_sin, n, x.stride(0), D, cos_sin.stride(0), pos_div,
        R=cos_sin.shape[1], ROWS=rows, INVERSE=inverse, IS_BF16=bf16, enable_fp_fusion=False,
    )


@_rope_gptj_op.register_fake
def _(x, positions, cos_sin, out, pos_div, inverse):
    return None


def apply_gptj(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False, *,
               backend: str = "reference") -> torch.Tensor:
    """GPT-J (interleaved) RoPE on the LAST ``R = cos_sin.shape[1]`` dims of ``x``; returns a new tensor.

    x'[2i] = x[2i]·cos f_i − x[2i+1]·sin f_i,  x'[2i+1] = x[2i]·sin f_i + x[2i+1]·cos f_i  (f_i at the
    row's position), on the slice x[..., D−R:]; dims 0..D−R−1 are copied bit for bit.

    Args:
        x: ``[..., D]`` bf16 or fp32 (``D ≥ R``), e.g. q ``[T, H, 512]`` or kv ``[T, 512]``.
        positions: int64 (or int32) of shape ``x.shape[:-1]`` (one per row) or ``x.shape[:1]`` (one per
            token, shared by all heads). Each in ``[0, max_pos)``.
        cos_sin: the fp32 table from :func:`cos_sin_cache` (the layer's own: θ and YaRN differ per layer).
        inverse: rotate by −f instead (rope.md §6: the attention output, at the query's position).
        backend: ``"reference"`` (torch) or ``"triton"``; bit-identical results.
    """
    validate.backend(backend)
    _check_rotate_args(x, positions, cos_sin)
    if backend == "reference":
        return _gptj_reference(x, positions, cos_sin, inverse)
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.numel() and x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = x2.clone(memory_format=torch.contiguous_format)
    per_row = tuple(positions.shape) == tuple(x.shape[:-1])
    pos_div = 1 if per_row or x.dim() == 1 else math.prod(x.shape[1:-1])
    torch.ops.dsv4ref.rope_gptj(x2, positions.reshape(-1).to(torch.int64), cos_sin, out, pos_div, inverse)
    return out.view(x.shape)


def apply_neox(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """NeoX (half-split) RoPE on the last R dims: pairs (x[i], x[i + R/2]). NOT what DSV4 uses; here to show
    what goes wrong when the pairing is mixed up (pitfalls.md #16). Reference only."""
    _check_rotate_args(x, positions, cos_sin)
    return _neox_reference(x, positions, cos_sin, inverse)


# ----------------------------------------------------------------------------------------------------
# 3. The fused Q-norm + RoPE + KV insert (rope.md §5)
# ----------------------------------------------------------------------------------------------------


def _qnorm_rope_reference(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, eps: float) -> torch.Tensor:
    """dsv4ref's canonical form of the Q side: weight-free RMSNorm over all 512 dims per head, then GPT-J
    RoPE of the fp32 normalised values, one rounding to bf16 at the end."""
    ss = (q.double() ** 2).sum(dim=-1, keepdim=True).float()  # order-free: fp64 sum, then one rounding
    rr = 1.0 / torch.sqrt(ss / q.shape[-1] + eps)  # correctly rounded sqrt and division, fp32
    y = q.float() * rr
    return apply_gptj(y, positions, cos_sin).to(torch.bfloat16)


@triton.jit
def _kv_record(kv_ptr, cache_ptr, t, slot, trow, kv_stride, page_stride, block_size):
    """The KV program of both fused kernels: rotate kv[t, 448:512] and write the 584-B record of slot."""
    row = kv_ptr + t.to(tl.int64) * kv_stride
    data, scales = page_offsets(slot, block_size, page_stride)
    # NoPE: an [8, 64] tile, rows 0..6 = the 7 quant blocks (row 7 masked off)
    tile = tl.arange(0, 8)[:, None]
    dim = tile * 64 + tl.arange(0, 64)[None, :]
    nope_ok = (tile < 7) & (dim >= 0)
    xb = ((tl.load(row + dim, mask=nope_ok, other=0).to(tl.int32) & 0xFFFF) << 16)
    xk = xb.to(tl.float32, bitcast=True)
    byte = ue8m0_byte(tl.max(tl.abs(xk), axis=1), 1e-4, 448.0)  # [8]; row 7 unused
    qk = e4m3_encode(xk * inv_pow2(byte)[:, None])  # × 2^-e is exact
    tl.store(cache_ptr + data + dim, qk.to(tl.uint8, bitcast=True), mask=nope_ok)
    k8 = tl.arange(0, 8)
    tl.store(cache_ptr + scales + k8, tl.where(k8 < 7, byte, 0).to(tl.uint8))
    # RoPE: element j of the slice with its partner j ^ 1, same formula as the Q side
    j = tl.arange(0, 64)
    e = ((tl.load(row + 448 + j).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    p = ((tl.load(row + 448 + (j ^ 1)).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    ck = tl.load(trow + j // 2)
    sk = tl.load(trow + 32 + j // 2)
    rk = e * ck + tl.where(j % 2 == 0, -(p * sk), p * sk)
    rb = bf16_rne_bits(rk).to(tl.int32)
    # bf16 little-endian: low byte at 448 + 2j, high byte at 449 + 2j
    tl.store(cache_ptr + data + 448 + 2 * j, (rb & 0xFF).to(tl.uint8))
    tl.store(cache_ptr + data + 449 + 2 * j, (rb >> 8).to(tl.uint8))


@triton.jit
def _qnorm_rope_kv_insert_kernel(
    q_ptr,  # int16 view of q [T, H, 512] bf16 (last dim contiguous), updated in place
    kv_ptr,  # int16 view of kv [T, 512] bf16 (last dim contiguous)
    cache_ptr,  # uint8 pages, page p at p * page_stride (fp8_ds_mla layout, formats.md §5)
    slot_ptr,  # int64 [n_slots] (n_slots <= T); −1 = write nothing
    pos_ptr,  # int64 [T]
    tab_ptr,  # fp32 [max_pos, 64] cos/sin table, row stride tab_stride
    H,  # query heads; program (t, H) is token t's KV program
    n_slots,
    q_stride_t,
    q_stride_h,
    kv_stride,
    tab_stride,
    page_stride,
    block_size,
    eps,
    DO_Q: tl.constexpr,  # False: skip the Q programs (benchmark of the unfused passes only)
    DO_KV: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    trow = tab_ptr + pos * tab_stride

    if h < H:
        if DO_Q:
            # ---- Q program: one head, all 512 dims as one vector --------------------------------------
            d = tl.arange(0, 512)
            head = q_ptr + t.to(tl.int64) * q_stride_t + h.to(tl.int64) * q_stride_h
            x = ((tl.load(head + d).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
            # weight-free RMSNorm: fp64 sum of exact squares (order-free), correctly rounded sqrt and div
            x64 = x.to(tl.float64)
            ss = tl.sum(x64 * x64, axis=0).to(tl.float32)
            rr = tl.math.div_rn(1.0, tl.math.sqrt_rn(ss * (1.0 / 512.0) + eps))  # ×2^-9 is exact
            xn = x * rr
            # RoPE on dims 448..511: the pair partner of d is d ^ 1 (re-loaded; it is in L1 already)
            is_rope = d >= 448
            i = tl.where(is_rope, (d - 448) // 2, 0)
            c = tl.load(trow + i, mask=is_rope, other=1.0)
            s = tl.load(trow + 32 + i, mask=is_rope, other=0.0)
            partner = ((tl.load(head + (d ^ 1)).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True) * rr
            rot = xn * c + tl.where(d % 2 == 0, -(partner * s), partner * s)
            y = tl.where(is_rope, rot, xn)
            tl.store(head + d, bf16_rne_bits(y).to(tl.int16, bitcast=True))
    else:
        if DO_KV:
            if t < n_slots:
                slot = tl.load(slot_ptr + t).to(tl.int64)
                if slot >= 0:
                    _kv_record(kv_ptr, cache_ptr, t, slot, trow, kv_stride, page_stride, block_size)


@triton.jit
def _qnorm_rope_kv_insert_mh_kernel(
    q_ptr,  # int32 view of q [T, H, 256]: word w holds the bf16 pair (dim 2w: low 16 bits, dim 2w+1: high)
    kv_ptr,  # int16 view of kv [T, 512] bf16 (last dim contiguous)
    cache_ptr,  # uint8 pages, page p at p * page_stride (fp8_ds_mla layout, formats.md §5)
    slot_ptr,  # int64 [n_slots] (n_slots <= T); −1 = write nothing
    pos_ptr,  # int64 [T]
    tab_ptr,  # fp32 [max_pos, 64] cos/sin table, row stride tab_stride
    H,  # query heads
    NG,  # head groups: cdiv(H, HPP)
    n_slots,
    q_stride_t,  # in int32 words
    q_stride_h,
    kv_stride,
    tab_stride,
    page_stride,
    block_size,
    eps,
    HPP: tl.constexpr,  # query heads per program (a power of two)
    DO_Q: tl.constexpr,
    DO_KV: tl.constexpr,
):
    # 1-D grid of T·(NG + 1) programs, NG = cdiv(H, HPP): program t·(NG + 1) + g handles heads
    # [g·HPP, g·HPP + HPP) of token t for g < NG and token t's KV row for g = NG. The head group varies
    # fastest, so consecutive programs walk q in address order.
    pid = tl.program_id(0)
    t = pid // (NG + 1)
    g = pid % (NG + 1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    trow = tab_ptr + pos * tab_stride

    if g < NG:
        if DO_Q:
            # ---- Q program: an [HPP, 8, 32] tile of int32 words = HPP heads × 512 bf16 dims --------
            # Word (k, i) of a head is dims (64k + 2i, 64k + 2i + 1); chunk k = 7 is the RoPE slice and
            # there word i IS rotary pair i: its two halves are e and o, so no partner is re-loaded.
            hh = g * HPP + tl.arange(0, HPP)
            k = tl.arange(0, 8)
            i = tl.arange(0, 32)
            hmask = (hh < H)[:, None, None] & (k >= 0)[None, :, None] & (i >= 0)[None, None, :]
            word = (t.to(tl.int64) * q_stride_t + hh.to(tl.int64)[:, None, None] * q_stride_h
                    + (k * 32)[None, :, None] + i[None, None, :])
            # the table row, loaded in the tile's own shape (the same register layout as w, so no shuffle
            # through shared memory); only the chunk-7 lanes read, each (c_i, s_i) once per head from L1
            rope = (k == 7)[None, :, None]
            tab_ok = hmask & rope
            c = tl.load(trow + 0 * word + i[None, None, :], mask=tab_ok, other=0.0)
            s = tl.load(trow + 0 * word + 32 + i[None, None, :], mask=tab_ok, other=0.0)
            w = tl.load(q_ptr + word, mask=hmask, other=0)
            lo = (w << 16).to(tl.float32, bitcast=True)  # even dim: the low half, widened
            hi = (w & -65536).to(tl.float32, bitcast=True)  # odd dim: the high half (0xFFFF0000)
            # weight-free RMSNorm per head: fp64 sum of exact squares (order-free), as the per-head kernel
            lo64, hi64 = lo.to(tl.float64), hi.to(tl.float64)
            sq = lo64 * lo64 + hi64 * hi64
            ss = tl.sum(tl.sum(sq, axis=2, keep_dims=True), axis=1, keep_dims=True).to(tl.float32)  # [HPP, 1, 1]
            rr = tl.math.div_rn(1.0, tl.math.sqrt_rn(ss * (1.0 / 512.0) + eps))  # kept dims: no layout change
            e = lo * rr
            o = hi * rr
            # RoPE on chunk 7: e·c − o·s and e·s + o·c, separately rounded products (no FMA)
            y_lo = tl.where(rope, e * c - o * s, e)
            y_hi = tl.where(rope, e * s + o * c, o)
            packed = bf16_rne_bits(y_lo).to(tl.uint32) | (bf16_rne_bits(y_hi).to(tl.uint32) << 16)
            tl.store(q_ptr + word, packed.to(tl.int32, bitcast=True), mask=hmask)
    else:
        if DO_KV:
            if t < n_slots:
                slot = tl.load(slot_ptr + t).to(tl.int64)
                if slot >= 0:
                    _kv_record(kv_ptr, cache_ptr, t, slot, trow, kv_stride, page_stride, block_size)


# Which fused kernel the op launches (benchmarks/rope.md compares them). Measured on the H200 (2026-11-30,
# T = 4096, H = 64, graph-replay timing, fraction of copy bandwidth over compulsory bytes):
#   FUSED_HEADS_PER_PROG = 0: the per-head kernel, grid (T, H + 1), one 2-KiB head per program: 78.7 %
#                             (1 warp);
#   FUSED_HEADS_PER_PROG = n ≥ 1 (power of two): the multi-head kernel, n heads of one token per program
#                             read and written as packed bf16 pairs (int32 words): n = 2, 1 warp: 94.1 %
#                             (the best); n = 4, 2 warps: 91.8 %; n = 8, 4 warps: 90.0 %.
FUSED_HEADS_PER_PROG = 2
# warps per program; None = 1 for the per-head kernel, _MH_WARPS[n] for the multi-head kernel (the best
# measured warp count for each n on the H200)
FUSED_WARPS = None
_MH_WARPS = {1: 1, 2: 1, 4: 2, 8: 4, 16: 4, 32: 4}
# (heads per program, warps) of the multi-head kernel that `python -m dsv4ref bench rope` times (rope.fused_mh)
# and that the GPU-only test holds to the reference
MH_BENCH_CONFIGS = ((1, 1), (2, 1), (4, 1), (4, 2), (8, 1), (8, 2), (8, 4), (16, 4))


def _packable(q16: torch.Tensor) -> bool:
    """True when q's int16 view can be viewed as int32 pairs (4-byte aligned base, even strides)."""
    return q16.storage_offset() % 2 == 0 and q16.stride(0) % 2 == 0 and q16.stride(1) % 2 == 0


def _launch_fused(q, kv, cache, slot_mapping, positions, cos_sin, eps, block_size, *, do_q=True, do_kv=True,
                  heads_per_prog=None, num_warps=None):
    """heads_per_prog: None = FUSED_HEADS_PER_PROG; 0 = the per-head kernel; n >= 1 = the multi-head kernel
    (falls back to the per-head one when q cannot be viewed as int32 pairs). num_warps: None = FUSED_WARPS,
    else the kernel's default."""
    T, H, _ = q.shape
    if T == 0:
        return
    hpp = FUSED_HEADS_PER_PROG if heads_per_prog is None else heads_per_prog
    warps = FUSED_WARPS if num_warps is None else num_warps
    q16, kv16 = q.view(torch.int16), kv.view(torch.int16)
    if hpp and _packable(q16):
        if hpp & (hpp - 1):
            raise ValueError(f"heads_per_prog: expected 0 or a power of two, got {hpp}")
        q32 = q16.view(torch.int32)
        ng = triton.cdiv(H, hpp)
        _qnorm_rope_kv_insert_mh_kernel[(T * (ng + 1),)](
            q32, kv16, cache, slot_mapping, positions, cos_sin,
            H, ng, slot_mapping.shape[0], q32.stride(0), q32.stride(1), kv16.stride(0), cos_sin.stride(0),
            cache.stride(0), block_size, eps,
            HPP=hpp, DO_Q=do_q, DO_KV=do_kv, num_warps=warps or _MH_WARPS.get(hpp, 4), enable_fp_fusion=False,
        )
        return
    # per-head kernel; num_warps=1: fastest of 1/2/4/8 on the H200 (benchmarks/rope.md: 224 us vs 270 us
    # with 4 warps); a program moves only 2 KiB, so fewer, fuller warps win.
    _qnorm_rope_kv_insert_kernel[(T, H + 1)](
        q16, kv16, cache, slot_mapping, positions, cos_sin,
        H, slot_mapping.shape[0], q16.stride(0), q16.stride(1), kv16.stride(0), cos_sin.stride(0),
        cache.stride(0), block_size, eps,
        DO_Q=do_q, DO_KV=do_kv, num_warps=warps or 1, enable_fp_fusion=False,
    )


@torch.library.custom_op("dsv4ref::qnorm_rope_kv_insert", mutates_args=("q", "cache"))
def _qnorm_rope_kv_insert_op(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                             positions: torch.Tensor, cos_sin: torch.Tensor, eps: float, block_size: int) -> None:
    _launch_fused(q, kv, cache, slot_mapping, positions, cos_sin, eps, block_size)


@_qnorm_rope_kv_insert_op.register_fake
def _(q, kv, cache, slot_mapping, positions, cos_sin, eps, block_size):
    return None


def qnorm_rope_kv_insert(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                         positions: torch.Tensor, cos_sin: torch.Tensor, *, eps: float, block_size: int,
                         backend: str = "triton") -> None:
    """The attention prologue's fused step (rope.md §5), in place.

    * q ``[T, H, 512]`` bf16 is overwritten by RoPE(RMSNorm(q)): weight-free RMSNorm over all 512 dims of
      each head, then GPT-J RoPE on dims 448..511 at the token's position. Every row, padding included.
    * kv ``[T, 512]`` bf16 (already kv_norm'ed) is rotated on dims 448..511 and written to ``cache`` at
      ``slot_mapping[t]`` exactly as ``kv_cache.insert(cache, apply_gptj(kv, positions, cos_sin), …)``
      would: 448 e4m3 + 7 UE8M0 of the unrotated NoPE dims, the rotated RoPE dims as bf16. kv is not
      modified. ``slot_mapping`` may be shorter than T (rows beyond it are padding); slot −1 writes nothing.

    Args:
        cache: uint8 ``[num_blocks, ≥ page_bytes(block_size)]`` (:func:`dsv4ref.kv_cache.allocate`).
        slot_mapping: int64 (or int32) ``[T'']``, T'' ≤ T.
        positions: int64 (or int32) ``[T]``, each in ``[0, cos_sin.shape[0])``.
        cos_sin: fp32 ``[max_pos, 64]`` (:func:`cos_sin_cache`) of this layer.
        eps: rms_norm_eps (1e-6 for DSV4).
        block_size: tokens per cache page.
        backend: ``"triton"`` (one kernel: grid (T, H + 1), one head per program, or with
            ``FUSED_HEADS_PER_PROG = n`` n heads per program, T·(H/n + 1) programs; bit-identical) or
            ``"reference"`` (torch + kv_cache.insert).
    """
    validate.backend(backend)
    validate.tensor(q, "q", dtype=torch.bfloat16, ndim=3)
    T, H, D = q.shape
    if D != HEAD_DIM or q.stride(2) != 1:
        raise ValueError(f"q: expected [T, H, {HEAD_DIM}] with a contiguous last dim, got shape {tuple(q.shape)} "
                         f"strides {q.stride()}")
    if H > MAX_HEADS:
        raise ValueError(f"q: H = {H} query heads; at most {MAX_HEADS} are supported")
    validate.tensor(kv, "kv", dtype=torch.bfloat16, shape=(T, HEAD_DIM))
    if kv.stride(1) != 1:
        raise ValueError(f"kv: expected a contiguous last dim (strides {kv.stride()})")
    kv_cache.check_cache(cache, block_size)
    kv_cache.check_writable(cache)
    validate.tensor(slot_mapping, "slot_mapping", dtype=(torch.int64, torch.int32), ndim=1)
    if slot_mapping.shape[0] > T:
        raise ValueError(f"slot_mapping: has {slot_mapping.shape[0]} entries but q/kv only {T} rows")
    validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32), shape=(T,))
    if _check_table(cos_sin) != ROPE_DIM:
        raise ValueError(f"cos_sin: expected {ROPE_DIM} columns (cos 0..31 | sin 0..31), got shape {tuple(cos_sin.shape)}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps: expected a positive float, got {eps!r}")
    validate.same_device(q=q, kv=kv, cache=cache, slot_mapping=slot_mapping, positions=positions, cos_sin=cos_sin)
    validate.index_range(slot_mapping, "slot_mapping", cache.shape[0] * block_size)
    validate.index_range(positions, "positions", cos_sin.shape[0], allow_minus_one=False)
    if backend == "reference":
        q.copy_(_qnorm_rope_reference(q, positions, cos_sin, eps))
        kv_cache.insert(cache, apply_gptj(kv, positions, cos_sin), slot_mapping, block_size=block_size,
                        backend="reference")
        return
    torch.ops.dsv4ref.qnorm_rope_kv_insert(q, kv, cache, slot_mapping.to(torch.int64), positions.to(torch.int64),
                                           cos_sin, float(eps), block_size)


# ----------------------------------------------------------------------------------------------------
# 4. Grouped low-rank output projection (rope.md §7)
# ----------------------------------------------------------------------------------------------------


def grouped_o_proj(o: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor) -> torch.Tensor:
    """out = wo_b( concat_g( wo_a[g] @ o[t, heads of group g].flatten() ) ), reference only.

    Args:
        o: ``[T, H, 512]`` bf16: the attention output AFTER inverse RoPE, padded heads already removed.
        wo_a: ``[G, o_lora, (H/G)·512]`` bf16: group g owns the contiguous heads [g·hpg, (g+1)·hpg).
        wo_b: ``[Hd, G·o_lora]`` bf16.
    Returns:
        ``[T, Hd]`` bf16. Both GEMMs accumulate in fp32; the intermediate z is rounded to bf16 like an
        activation between two bf16 GEMMs.
    """
    validate.tensor(o, "o", dtype=torch.bfloat16, ndim=3)
    validate.tensor(wo_a, "wo_a", dtype=torch.bfloat16, ndim=3)
    validate.tensor(wo_b, "wo_b", dtype=torch.bfloat16, ndim=2)
    validate.same_device(o=o, wo_a=wo_a, wo_b=wo_b)
    T, H, D = o.shape
    G, o_lora, width = wo_a.shape
    if G < 1 or H % G:
        raise ValueError(f"wo_a: G = {G} groups must divide H = {H} heads (o has shape {tuple(o.shape)})")
    if width != (H // G) * D:
        raise ValueError(f"wo_a: expected shape ({G}, o_lora, {(H // G) * D}) = (G, o_lora, H/G·{D}), "
                         f"got {tuple(wo_a.shape)}")
    if wo_b.shape[1] != G * o_lora:
        raise ValueError(f"wo_b: expected shape (Hd, {G * o_lora}) = (Hd, G·o_lora), got {tuple(wo_b.shape)}")
    og = o.reshape(T, G, width)  # contiguous head groups
    z = torch.einsum("tgk,gok->tgo", og.float(), wo_a.float()).to(torch.bfloat16)  # (T, G, o_lora)
    return (z.reshape(T, G * o_lora).float() @ wo_b.float().T).to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------------
# python -m dsv4ref check / bench
# ----------------------------------------------------------------------------------------------------


def _fused_example(T: int, H: int, B: int, n_blocks: int, seed: int, table: torch.Tensor):
    q = randn((T, H, HEAD_DIM), seed=seed)
    kv = randn((T, HEAD_DIM), seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, table.shape[0], (T,), generator=g).to(DEVICE)
    slots = torch.randperm(n_blocks * B, generator=g)[:T].to(DEVICE)
    slots[:: max(1, T // 3)] = -1
    return q, kv, slots, pos


@check("rope.apply_gptj")
def _check_apply() -> list[CheckRow]:
    rows = []
    table = cos_sin_cache(4096, theta=160000.0, yarn=dict(factor=16, original_max_position=65536, beta_fast=32, beta_slow=1))
    for shape, dtype in [((5, 16, 512), torch.bfloat16), ((37, 512), torch.float32)]:
        x = randn(shape, seed=len(shape), dtype=dtype)
        pos = torch.randint(0, 4096, shape[:1], generator=torch.Generator().manual_seed(1)).to(DEVICE)
        for inv in (False, True):
            got = apply_gptj(x, pos, table, inv, backend="triton")
            ref = apply_gptj(x, pos, table, inv)
            rows.append(CheckRow("rope.apply_gptj", f"{tuple(shape)} {str(dtype)[6:]}" + (" inverse" if inv else ""),
                                 compare(got, ref, "exact")))
    return rows


@check("rope.qnorm_rope_kv_insert")
def _check_fused() -> list[CheckRow]:
    rows = []
    table = cos_sin_cache(4096)
    for T, H, B, nb in [(4, 16, 16, 2), (7, 64, 61, 1)]:
        q, kv, slots, pos = _fused_example(T, H, B, nb, seed=T, table=table)
        q_ref, c_ref = q.clone(), kv_cache.allocate(nb, B)
        qnorm_rope_kv_insert(q_ref, kv, c_ref, slots[: T - 1], pos, table, eps=1e-6, block_size=B, backend="reference")
        for hpp in (0, 4):  # the per-head kernel and the multi-head one (4 heads per program)
            q_out, c_out = q.clone(), kv_cache.allocate(nb, B)
            _launch_fused(q_out, kv, c_out, slots[: T - 1], pos, table, 1e-6, B, heads_per_prog=hpp)
            name = f"T={T} H={H} B={B}" + (f" hpp={hpp}" if hpp else "")
            rows.append(CheckRow("rope.qnorm_rope_kv_insert", f"{name} cache", compare(c_out, c_ref, "exact", "cache")))
            rows.append(CheckRow("rope.qnorm_rope_kv_insert", f"{name} q", compare(q_out, q_ref, "exact", "q")))
    return rows


@bench("rope")
def _bench() -> list[BenchCase]:
    T, H, B = 4096, 64, 64
    n_sets = 2  # each set: q 256 MiB + kv 4 MiB + cache 2.3 MiB, far above the 60 MB L2
    nb = T // B
    table = cos_sin_cache(1 << 16, theta=160000.0, yarn=dict(factor=16, original_max_position=65536, beta_fast=32, beta_slow=1))
    sets = []
    for i in range(n_sets):
        q = torch.randn(T, H, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        kv = torch.randn(T, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        pos = torch.randint(0, 1 << 16, (T,), device=DEVICE)
        slots = torch.randperm(T, device=DEVICE)
        sets.append((q, kv, kv_cache.allocate(nb, B), slots, pos, torch.empty_like(kv)))
    q_bytes = T * H * HEAD_DIM * 2 * 2  # read + write q
    kv_bytes = T * (HEAD_DIM * 2 + 8 + kv_cache.TOKEN_BYTES)  # read kv + slot, write the 584-B record
    misc = T * (8 + ROPE_DIM * 4)  # positions + one table row per token
    fused_bytes = q_bytes + kv_bytes + misc
    # three passes: the same Q programs alone; rotate kv into a temp (read kv, write kv'); insert (read kv')
    three_bytes = fused_bytes + T * HEAD_DIM * 2 * 2 + T * 8

    def fused(i, warps=1, hpp=0):
        q, kv, c, s, p, _ = sets[i]
        _launch_fused(q, kv, c, s, p, table, 1e-6, B, heads_per_prog=hpp, num_warps=warps)

    def three(i):
        q, kv, c, s, p, tmp = sets[i]
        _launch_fused(q, kv, c, s, p, table, 1e-6, B, do_kv=False, heads_per_prog=0, num_warps=4)  # pass 1
        torch.ops.dsv4ref.rope_gptj(kv, p, table, tmp, 1, False)  # pass 2: RoPE of kv (tmp holds kv's NoPE copy)
        torch.ops.dsv4ref.kv_insert(c, tmp, s, B)  # pass 3: quantise + insert

    for _, kv, _, _, _, tmp in sets:
        tmp.copy_(kv)
    shape = f"T={T} H={H} B={B}"
    note = "q r+w 1024 B/head + kv 1024 + slot 8 + cache 584 + pos 8 + table row 256 B/token"
    # the per-head kernel (FUSED_HEADS_PER_PROG = 0), then the multi-head kernel at each (HPP, warps) of
    # MH_BENCH_CONFIGS: same compulsory bytes, so the rows compare directly
    cases = [BenchCase("rope.fused", shape + f" warps={w}", (lambda i, w=w: fused(i, w, 0)), n_sets, fused_bytes,
                       note=note) for w in (1, 2, 4, 8)]
    cases += [BenchCase("rope.fused_mh", shape + f" hpp={n} warps={w}", (lambda i, w=w, n=n: fused(i, w, n)),
                        n_sets, fused_bytes, note=note, extra={"heads_per_prog": n, "num_warps": w})
              for n, w in MH_BENCH_CONFIGS]
    cases.append(BenchCase("rope.three_passes", shape, three, n_sets, fused_bytes,
                           note="same compulsory bytes as fused (actual traffic +2 KiB/token for the kv temp)",
                           extra={"actual_bytes": three_bytes}))
    return cases
