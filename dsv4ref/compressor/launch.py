"""How :mod:`dsv4ref.compressor` launches its kernels: :class:`CompressorLaunch`, the workspaces, and the
custom op ``dsv4ref::compressor_compress`` (every launch choice is an argument of its schema, so
``torch.compile`` sees them and no module global changes what runs).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton

from .. import validate
from ..device import interpreting
from ..op_launch import OpLaunch
from .kernels import compress_kernel, project_kernel, save_kernel

__all__ = ["CompressorLaunch", "default_launch", "compressor_compress_op"]


@dataclass(frozen=True)
class CompressorLaunch(OpLaunch):
    """Launch shape of the compressor's kernels (all powers of two).

    Not measured on a GPU yet (the figures would go to ``benchmarks/``): the defaults are chosen so the
    projection reads every weight once per 16 tokens and a decode-sized step (T ≤ 16) still spreads the
    weights over C / 32 programs.

    Attributes:
        block_t: tokens per projection program (≥ 16: the smallest ``tl.dot`` on a GPU).
        block_c: output channels per projection program (≥ 16).
        block_k: hidden values per step of the projection (≥ 16).
        project_warps: warps per projection program.
        block_j: window positions per step of the compression (divides n = coff·r: 8 or 128).
        compress_warps: warps per compression program (one program per token, all D channels).
    """

    block_t: int = 16
    block_c: int = 32
    block_k: int = 128
    project_warps: int = 4
    block_j: int = 8
    compress_warps: int = 4

    def __post_init__(self):
        for f in fields(self):
            validate.power_of_two(getattr(self, f.name), f.name)
        for name in ("block_t", "block_c", "block_k"):
            if getattr(self, name) < 16:
                raise ValueError(f"{name}: expected >= 16 (tl.dot's smallest tile on a GPU), got {getattr(self, name)}")
        if self.block_j > 8:
            raise ValueError(f"block_j: expected <= 8 (it must divide the ratio-4 window of 8), got {self.block_j}")

    # the custom op takes every field, in declaration order (op_args(), from_op_args(): dsv4ref.op_launch)
    OP_FIELDS = {"compressor_compress": None}


def default_launch() -> CompressorLaunch:
    """The default shape; in the interpreter, where the cost is the number of programs, wide projection tiles."""
    if interpreting():
        return CompressorLaunch(block_c=512, block_k=256)
    return CompressorLaunch()


def _compress(
    x,
    wkv,
    wgate,
    ape,
    norm,
    state_kv,
    state_score,
    requests,
    positions,
    rows,
    done,
    ratio,
    eps,
    block_t,
    block_c,
    block_k,
    project_warps,
    block_j,
    compress_warps,
) -> None:
    """Launch the three kernels. ``requests`` / ``positions``: int32 [T], contiguous, −1 requests for padding
    rows (the public function prepares them); ``rows`` [T, D] fp32 and ``done`` [T] bool, contiguous."""
    T, Hd = x.shape
    C, D = wkv.shape[0], norm.shape[0]
    coff = C // D
    # workspaces: this step's (kv, score), fp32
    kv = torch.empty(T, C, dtype=torch.float32, device=x.device)
    sc = torch.empty(T, C, dtype=torch.float32, device=x.device)
    x16 = x.view(torch.int16)
    project_kernel[(triton.cdiv(T, block_t), triton.cdiv(C, block_c))](
        x16,
        wkv,
        wgate,
        ape,
        positions,
        kv,
        sc,
        T,
        Hd,
        C,
        x16.stride(0),
        x16.stride(1),
        wkv.stride(0),
        wkv.stride(1),
        wgate.stride(0),
        wgate.stride(1),
        ape.stride(0),
        ape.stride(1),
        RATIO=ratio,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        BLOCK_K=block_k,
        DOT_FP32=interpreting(),
        num_warps=project_warps,
    )
    compress_kernel[(T,)](
        kv,
        sc,
        state_kv,
        state_score,
        requests,
        positions,
        norm,
        rows,
        done.view(torch.uint8),
        T,
        state_kv.shape[0],
        eps,
        RATIO=ratio,
        COFF=coff,
        D=D,
        BLOCK_J=min(block_j, coff * ratio),
        num_warps=compress_warps,
    )
    save_kernel[(T,)](
        kv,
        sc,
        state_kv,
        state_score,
        requests,
        positions,
        T,
        state_kv.shape[0],
        N=coff * ratio,
        C=C,
        BLOCK_C=triton.next_power_of_2(C),
        num_warps=compress_warps,
    )


@torch.library.custom_op("dsv4ref::compressor_compress", mutates_args=("state_kv", "state_score", "rows", "done"))
def compressor_compress_op(
    x: torch.Tensor,
    wkv: torch.Tensor,
    wgate: torch.Tensor,
    ape: torch.Tensor,
    norm: torch.Tensor,
    state_kv: torch.Tensor,
    state_score: torch.Tensor,
    requests: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    done: torch.Tensor,
    ratio: int,
    eps: float,
    block_t: int,
    block_c: int,
    block_k: int,
    project_warps: int,
    block_j: int,
    compress_warps: int,
) -> None:
    """One compressor step: project, compress the boundary tokens into ``rows`` / ``done``, update the ring."""
    if x.shape[0]:
        _compress(
            x,
            wkv,
            wgate,
            ape,
            norm,
            state_kv,
            state_score,
            requests,
            positions,
            rows,
            done,
            ratio,
            eps,
            block_t,
            block_c,
            block_k,
            project_warps,
            block_j,
            compress_warps,
        )


@compressor_compress_op.register_fake
def _(
    x,
    wkv,
    wgate,
    ape,
    norm,
    state_kv,
    state_score,
    requests,
    positions,
    rows,
    done,
    ratio,
    eps,
    block_t,
    block_c,
    block_k,
    project_warps,
    block_j,
    compress_warps,
):
    return None
