"""How :mod:`dsv4ref.fp8` launches its kernels: the launch shape, passed explicitly, and the launchers.

fp8 registers no ``torch.library`` custom op: the quantiser is a building block (the KV cache, the
indexer and the MoE staging each fuse it into their own kernel), called here directly through Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .. import validate
from .kernels import dequantize_kernel, quantize_kernel

__all__ = ["Fp8Launch", "default_launch", "quantize", "dequantize"]


@dataclass(frozen=True)
class Fp8Launch:
    """Launch shape of the fp8 kernels.

    Attributes:
        rows_per_program: quant blocks handled by one program (a power of two).
        num_warps: Triton warps per program (a power of two).
    """

    rows_per_program: int
    num_warps: int = 4

    def __post_init__(self):
        validate.power_of_two(self.rows_per_program, "rows_per_program")
        validate.power_of_two(self.num_warps, "num_warps")


def default_launch(block: int, *, dequantize: bool = False) -> Fp8Launch:
    """The default shape: 16 blocks per program (the quantiser: 8 for blocks over 64 values), 4 warps. Not
    tuned: fp8 is not benchmarked on its own; the kernels that matter fuse the quantiser into their own
    (``benchmarks/kv_cache.md``)."""
    return Fp8Launch(16 if dequantize or block <= 64 else 8)


MAX_TILE = 1 << 20  # Triton's largest tensor: rows_per_program · block values


def _check_tile(launch: Fp8Launch, block: int) -> None:
    if launch.rows_per_program * block > MAX_TILE:
        raise ValueError(
            f"launch: rows_per_program={launch.rows_per_program} × block={block} values per program "
            f"exceed Triton's {MAX_TILE}-element tile"
        )


def quantize(x: torch.Tensor, block: int, amax_floor: float, launch: Fp8Launch) -> tuple[torch.Tensor, torch.Tensor]:
    """Run :func:`~dsv4ref.fp8.kernels.quantize_kernel` on validated arguments: ``(q uint8, scale uint8)``.
    ``x`` may be any view: it is read through a contiguous fp32 copy."""
    _check_tile(launch, block)
    xf = x.float().contiguous()
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    s = torch.empty((*x.shape[:-1], x.shape[-1] // block), dtype=torch.uint8, device=x.device)
    n_blocks, rows = s.numel(), launch.rows_per_program
    if n_blocks:
        quantize_kernel[(triton.cdiv(n_blocks, rows),)](
            xf, q, s, n_blocks, FLOOR=amax_floor, BLOCK=block, ROWS=rows, num_warps=launch.num_warps
        )
    return q, s


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int, out_dtype: torch.dtype, launch: Fp8Launch) -> torch.Tensor:
    """Run :func:`~dsv4ref.fp8.kernels.dequantize_kernel` on validated arguments (``q`` as uint8 bytes; views
    are read through contiguous copies)."""
    _check_tile(launch, block)
    qb = q.contiguous()
    s = scale.contiguous()
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    n_blocks, rows = s.numel(), launch.rows_per_program
    bf16 = out_dtype == torch.bfloat16
    if n_blocks:
        dequantize_kernel[(triton.cdiv(n_blocks, rows),)](
            qb,
            s,
            out.view(torch.int16) if bf16 else out,
            n_blocks,
            BLOCK=block,
            ROWS=rows,
            OUT_BF16=bf16,
            num_warps=launch.num_warps,
        )
    return out
