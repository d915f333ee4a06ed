"""FP8 e4m3fn values with UE8M0 (power-of-two) block scales: quantise and dequantise.

One block of ``block`` values along the last dim shares one scale byte ``b`` meaning 2^(b − 127); the
stored values are ``q = e4m3(clamp(x · 2^-(b−127), ±448))`` and dequantisation is ``q · 2^(b−127)``, exact
in fp32 and in bf16. The scale rule (the ceiling computed from the bits of ``amax / 448``) and the byte
maps are in ``docs/formats.md``; the pitfalls and the tests that catch them in
``docs/formats.md#pitfalls``.

Where to read what:

* :mod:`dsv4ref.fp8.reference`: the whole op in plain torch (``e4m3_encode``, ``ue8m0_byte``, ``pow2``,
  ``inv_pow2``, ``quantize_ue8m0``, ``dequantize_ue8m0``);
* :mod:`dsv4ref.fp8.kernels`: the two Triton kernels;
* :mod:`dsv4ref.fp8.launch`: :class:`Fp8Launch` and the launchers.
"""

from __future__ import annotations

import torch

from .. import validate
from ..formats import E4M3_MAX, KV_AMAX_FLOOR
from . import kernels, reference  # noqa: F401  (dsv4ref.fp8.kernels / .reference, for readers)
from .launch import Fp8Launch, default_launch
from .launch import dequantize as _run_dequantize
from .launch import quantize as _run_quantize

__all__ = ["E4M3_MAX", "Fp8Launch", "default_launch", "quantize_ue8m0", "dequantize_ue8m0", "SUPPORTED_BACKENDS"]

FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK = 1 << 16  # the largest block: a kernel tile of rows_per_program · block values must fit Triton's limit


def _check_block(block) -> int:
    block = validate.power_of_two(block, "block")
    if block > MAX_BLOCK:
        raise ValueError(f"block: expected a power of two <= {MAX_BLOCK}, got {block}")
    return block


SUPPORTED_BACKENDS = ("reference", "triton")  # from dsv4ref.validate.BACKENDS; "auto" = "triton"


def quantize_ue8m0(
    x: torch.Tensor,
    block: int = 64,
    amax_floor: float = KV_AMAX_FLOOR,
    *,
    backend: str = "auto",
    launch: Fp8Launch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise ``x`` to e4m3 with one UE8M0 scale per ``block`` values along the last dim.

    Args:
        x: ``[..., D]`` fp32, bf16 or fp16, any strides (views are read as views), ``D % block == 0``.
            Finite: a NaN or ±inf raises ``ValueError("x: non-finite values ...")`` while value checks are on
            (the default); with ``DSV4REF_CHECK_VALUES=0`` its block is written as scale byte 255 and e4m3 NaN
            codes (0x7F; 0xFF for a value that is not a NaN and has its sign bit set), so it reads back as NaN.
        block: values per scale, an int power of two in [1, 65536] (64 for the KV cache, 128 for the indexer).
        amax_floor: a finite number >= 0; amax is raised to at least this before the scale is chosen, so
            all-zero blocks get a finite scale (1e-4 gives byte 105).
        backend: ``"auto"`` (= ``"triton"``), ``"triton"`` or ``"reference"``; identical bytes.
        launch: the kernel's launch shape; None = :func:`dsv4ref.fp8.launch.default_launch`.
    Returns:
        ``(q, scale)``: ``q`` float8_e4m3fn ``[..., D]`` (x's shape, contiguous); ``scale`` uint8
        ``[..., D // block]``, byte ``b`` meaning 2^(b − 127), in [1, 254] for finite blocks (255: a
        non-finite block, checks off).
    Raises:
        TypeError / ValueError naming the argument (``x``, ``block``, ``amax_floor``, ``backend``, ``launch``).
    """
    validate.tensor(x, "x", dtype=FLOAT_INPUTS)
    block = _check_block(block)
    amax_floor = validate.scalar(amax_floor, "amax_floor", lo=0.0)
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"x: last dim must be a multiple of block={block}, got shape {tuple(x.shape)}")
    if launch is not None and not isinstance(launch, Fp8Launch):
        raise TypeError(f"launch: expected an Fp8Launch or None, got {type(launch).__name__}")
    validate.finite(x, "x")
    if backend == "reference":
        return reference.quantize_ue8m0(x, block, amax_floor)
    q, s = _run_quantize(x, block, amax_floor, launch or default_launch(block))
    return q.view(torch.float8_e4m3fn), s


def dequantize_ue8m0(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: int = 64,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "auto",
    launch: Fp8Launch | None = None,
) -> torch.Tensor:
    """``q · 2^(scale − 127)`` blockwise along the last dim.

    Args:
        q: ``[..., D]`` float8_e4m3fn, or its raw bytes as uint8; any strides. Every byte is read as the
            format defines it (0x7F / 0xFF are NaN).
        scale: ``[..., D // block]`` uint8 UE8M0 bytes, any strides. Every byte is read as E8M0 defines it:
            ``b`` in 1..254 is 2^(b − 127), 0 is 2^-127, 255 is NaN (a whole NaN block).
        block: values per scale, an int power of two in [1, 65536].
        out_dtype: ``torch.bfloat16`` or ``torch.float32``.
        backend: ``"auto"`` (= ``"triton"``), ``"triton"`` or ``"reference"``; identical bits.
        launch: the kernel's launch shape; None = 16 blocks per program, 4 warps.
    Returns:
        ``out_dtype`` tensor of q's shape (contiguous); exact for every finite result; every NaN is the
        quiet NaN 0x7FC0 (bf16) / 0x7FC00000 (fp32), so backends agree bit for bit.
    Raises:
        TypeError / ValueError naming the argument (``q``, ``scale``, ``block``, ``out_dtype``, ``backend``).
    """
    validate.tensor(q, "q", dtype=(torch.float8_e4m3fn, torch.uint8))
    validate.tensor(scale, "scale", dtype=torch.uint8)
    block = _check_block(block)
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    validate.same_device(q=q, scale=scale)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    if q.dim() == 0 or q.shape[-1] % block or tuple(scale.shape) != (*q.shape[:-1], q.shape[-1] // block):
        raise ValueError(
            f"scale: expected shape {(*q.shape[:-1], q.shape[-1] // block) if q.dim() else '?'} for q of shape "
            f"{tuple(q.shape)} and block={block}, got {tuple(scale.shape)}"
        )
    if launch is not None and not isinstance(launch, Fp8Launch):
        raise TypeError(f"launch: expected an Fp8Launch or None, got {type(launch).__name__}")
    if backend == "reference":
        return reference.dequantize_ue8m0(q, scale, block, out_dtype)
    return _run_dequantize(q.view(torch.uint8), scale, block, out_dtype, launch or default_launch(block, dequantize=True))
