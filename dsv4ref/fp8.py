"""FP8 e4m3fn values with UE8M0 (power-of-two) block scales.

Facts: ``../shared/spec/formats.md`` §1–§3. One block of ``block`` values shares one scale byte ``b``
meaning 2^(b−127); the stored values are ``q = e4m3(clamp(x · 2^-(b−127), ±448))`` and dequantisation
is ``q · 2^(b−127)``, exact in fp32 and in bf16.

The scale rule (normative)::

    amax = max(max|x|, floor)          floor = 1e-4 for the KV cache
    s    = fp32(amax / 448)            IEEE division
    b    = ceil(log2(s)) + 127         from the bits of s: exponent field + (mantissa != 0)

Two faces per op: ``backend="reference"`` (plain torch, readable) and ``backend="triton"`` (one
kernel, the shared helpers of :mod:`dsv4ref.tl_helpers`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validate
from .device import interpreting
from .tl_helpers import E4M3_MAX, bf16_rne_bits, e4m3_encode, inv_pow2, pow2, ue8m0_byte

__all__ = [
    "E4M3_MAX",
    "e4m3_encode_ref",
    "e4m3_bits",
    "ue8m0_byte_ref",
    "pow2_ref",
    "quantize_ue8m0",
    "dequantize_ue8m0",
]

FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)

# ----------------------------------------------------------------------------------------------------
# Reference building blocks (torch). Each is a line or two, so a reader can check it by eye.
# ----------------------------------------------------------------------------------------------------


def e4m3_encode_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn: clamp to ±448 first (torch versions disagree on out-of-range casts:
    2.11 gives NaN, 2.13 saturates), then torch's round-to-nearest-even cast."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def ue8m0_byte_ref(amax: torch.Tensor, floor: float = 1e-4, qmax: float = E4M3_MAX) -> torch.Tensor:
    """UE8M0 byte (uint8) = ceil(log2(max(amax, floor) / qmax)) + 127, exactly, from the fp32 bits."""
    s = torch.clamp(amax.float(), min=floor) / qmax  # torch fp32 division is correctly rounded
    bits = s.view(torch.int32)
    byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    return byte.clamp(1, 254).to(torch.uint8)


def pow2_ref(byte: torch.Tensor) -> torch.Tensor:
    """2^(byte − 127) as fp32, built from bits (exact; no exp2 rounding)."""
    return (byte.to(torch.int32) << 23).view(torch.float32)


def _inv_pow2_ref(byte: torch.Tensor) -> torch.Tensor:
    return ((254 - byte.to(torch.int32)) << 23).view(torch.float32)


@triton.jit
def e4m3_bits(x):
    """fp32 tensor -> the e4m3fn byte (uint8), for storing through a uint8 pointer.

    (History: this first set the sign bit here, because ``e4m3_encode`` negated the rounded magnitude and
    compiled Triton computes ``-r`` as ``0 - r``, which loses −0: found by tests/test_fp8.py on the H200.
    The fix now lives in ``tl_helpers.e4m3_encode`` itself, so every kernel has it.)
    """
    return e4m3_encode(x).to(tl.uint8, bitcast=True)


# ----------------------------------------------------------------------------------------------------
# quantize
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_kernel(
    x_ptr,  # [n_blocks * BLOCK] fp32 (a contiguous view of x)
    q_ptr,  # [n_blocks * BLOCK] uint8 (e4m3 bytes)
    s_ptr,  # [n_blocks] uint8 (UE8M0 bytes)
    n_blocks,
    FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,  # values per scale (64 for the KV cache)
    ROWS: tl.constexpr,  # blocks handled by one program
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = rows[:, None] < n_blocks
    offs = rows[:, None] * BLOCK + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    byte = ue8m0_byte(tl.max(tl.abs(x), axis=1), FLOOR, 448.0)  # [ROWS]
    q = e4m3_bits(x * inv_pow2(byte)[:, None])  # × 2^-e is exact, so it equals ÷ 2^e
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(s_ptr + rows, byte.to(tl.uint8), mask=rows < n_blocks)


def quantize_ue8m0(
    x: torch.Tensor, block: int = 64, amax_floor: float = 1e-4, *, backend: str = "triton"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise ``x`` to e4m3 with one UE8M0 scale per ``block`` values along the last dim.

    Args:
        x: ``[..., D]`` fp32, bf16 or fp16, ``D % block == 0``.
        block: values per scale, a power of two (64 for the KV cache, 128 for the indexer).
        amax_floor: amax is raised to at least this before the scale is chosen (so all-zero blocks
            get a finite scale: 1e-4 gives byte 105).
    Returns:
        ``(q, scale)``: ``q`` float8_e4m3fn of x's shape; ``scale`` uint8 ``[..., D // block]``.
    """
    validate.tensor(x, "x", dtype=FLOAT_INPUTS)
    validate.power_of_two(block, "block")
    validate.backend(backend)
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"x: last dim must be a multiple of block={block}, got shape {tuple(x.shape)}")
    nb = x.shape[-1] // block
    if backend == "reference":
        xb = x.float().reshape(*x.shape[:-1], nb, block)
        byte = ue8m0_byte_ref(xb.abs().amax(dim=-1), amax_floor)
        q = e4m3_encode_ref(xb * _inv_pow2_ref(byte)[..., None])
        return q.reshape(x.shape), byte
    xf = x.float().contiguous()
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    s = torch.empty((*x.shape[:-1], nb), dtype=torch.uint8, device=x.device)
    n_blocks = s.numel()
    rows = 16 if block <= 64 else 8
    if n_blocks:
        _quantize_kernel[(triton.cdiv(n_blocks, rows),)](xf, q, s, n_blocks, FLOOR=amax_floor, BLOCK=block, ROWS=rows)
    return q.view(torch.float8_e4m3fn), s


# ----------------------------------------------------------------------------------------------------
# dequantize
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _dequantize_kernel(
    q_ptr,  # [n_blocks * BLOCK] uint8 (e4m3 bytes)
    s_ptr,  # [n_blocks] uint8
    out_ptr,  # [n_blocks * BLOCK]: int16 bits of bf16 when OUT_BF16, else fp32
    n_blocks,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = rows[:, None] < n_blocks
    offs = rows[:, None] * BLOCK + cols[None, :]
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    byte = tl.load(s_ptr + rows, mask=rows < n_blocks, other=127).to(tl.int32)
    y = q * pow2(byte)[:, None]  # exact: an exponent add
    if OUT_BF16:
        tl.store(out_ptr + offs, bf16_rne_bits(y).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(out_ptr + offs, y, mask=mask)


def dequantize_ue8m0(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: int = 64,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "triton",
) -> torch.Tensor:
    """``q · 2^(scale − 127)`` blockwise. q ``[..., D]`` float8_e4m3fn (or its uint8 bytes), scale uint8
    ``[..., D // block]``. Returns ``out_dtype`` (bf16 or fp32) of q's shape; exact for any byte the
    quantiser produces."""
    validate.tensor(q, "q", dtype=(torch.float8_e4m3fn, torch.uint8))
    validate.tensor(scale, "scale", dtype=torch.uint8)
    validate.power_of_two(block, "block")
    validate.backend(backend)
    validate.same_device(q=q, scale=scale)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    if q.dim() == 0 or q.shape[-1] % block or tuple(scale.shape) != (*q.shape[:-1], q.shape[-1] // block):
        raise ValueError(
            f"scale: expected shape {(*q.shape[:-1], q.shape[-1] // block) if q.dim() else '?'} for q of shape "
            f"{tuple(q.shape)} and block={block}, got {tuple(scale.shape)}"
        )
    q8 = q.view(torch.float8_e4m3fn)
    if backend == "reference":
        nb = q.shape[-1] // block
        y = q8.float().reshape(*q.shape[:-1], nb, block) * pow2_ref(scale)[..., None]
        return y.reshape(q.shape).to(out_dtype)
    qb = q.view(torch.uint8).contiguous()
    s = scale.contiguous()
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    n_blocks = s.numel()
    rows = 16
    if n_blocks:
        _dequantize_kernel[(triton.cdiv(n_blocks, rows),)](
            qb, s, out.view(torch.int16) if out_dtype == torch.bfloat16 else out, n_blocks,
            BLOCK=block, ROWS=rows, OUT_BF16=out_dtype == torch.bfloat16,
        )
    return out


# ----------------------------------------------------------------------------------------------------
# python -m dsv4ref check
# ----------------------------------------------------------------------------------------------------

from .harness import CheckRow, check  # noqa: E402  (after the ops: harness is only needed for these)
from .testing import compare, randn  # noqa: E402


def _check_input(shape, seed):
    """Per-block scales over 2^-12..2^12, plus blocks with amax = 448·2^k and an all-zero block."""
    x = randn(shape, seed=seed, octaves=24, device="cpu").float()
    x[0, :64] = 0.0
    x[0, 64 + 3] = 448.0 * 2.0**-5
    return x.to(torch.bfloat16)


@check("fp8.quantize")
def _check_quantize() -> list[CheckRow]:
    from .device import DEVICE

    rows = []
    for shape, block in [((33, 448), 64), ((8, 512), 128)]:
        x = _check_input(shape, seed=shape[0]).to(DEVICE)
        q_r, s_r = quantize_ue8m0(x, block, backend="reference")
        q_t, s_t = quantize_ue8m0(x, block)
        rows.append(CheckRow("fp8.quantize", f"{list(shape)} block={block} (scales)", compare(s_t, s_r, "exact", "scale bytes")))
        rows.append(CheckRow("fp8.quantize", f"{list(shape)} block={block} (e4m3)", compare(q_t, q_r, "exact", "e4m3 bytes")))
    return rows


@check("fp8.dequantize")
def _check_dequantize() -> list[CheckRow]:
    from .device import DEVICE

    rows = []
    for shape, block in [((33, 448), 64), ((8, 512), 128)]:
        q, s = quantize_ue8m0(_check_input(shape, seed=shape[0] + 1).to(DEVICE), block, backend="reference")
        for dt in (torch.bfloat16, torch.float32):
            got = dequantize_ue8m0(q, s, block, dt)
            rows.append(CheckRow("fp8.dequantize", f"{list(shape)} block={block} -> {str(dt)[6:]}",
                                 compare(got, dequantize_ue8m0(q, s, block, dt, backend="reference"), "exact")))
    return rows
