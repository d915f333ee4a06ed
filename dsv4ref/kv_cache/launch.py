"""How :mod:`dsv4ref.kv_cache` launches its kernels: the launch shape, the raw launchers, and the
``torch.library`` custom ops (``dsv4ref::kv_insert``, ``dsv4ref::kv_gather``) with their fake kernels.

Every launch choice is an argument of the custom op's schema (no module global is read inside it), so a
traced or compiled graph records the shape it ran with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .. import validate
from .kernels import gather_kernel, insert_kernel

__all__ = ["KVCacheLaunch", "INSERT_DEFAULT", "GATHER_DEFAULT", "launch_insert", "launch_gather", "int16_view"]


@dataclass(frozen=True)
class KVCacheLaunch:
    """Launch shape of the insert / gather kernels.

    Attributes:
        tokens_per_program: slots handled by one program (a power of two; 1 = one program per token).
        num_warps: Triton warps per program (a power of two).
    """

    tokens_per_program: int
    num_warps: int = 1

    def __post_init__(self):
        validate.power_of_two(self.tokens_per_program, "tokens_per_program")
        validate.power_of_two(self.num_warps, "num_warps")


# The defaults, measured on the H200 (benchmarks/kv_cache.md; B = 64, random slot order, CUDA-graph
# kernel time as a fraction of the measured copy bandwidth). One warp per program is best: 4 warps per
# 1.6 KB token starve occupancy (insert 1 × 4: 26.9 %, 1 × 1: 54.7 % at 64k slots).
INSERT_DEFAULT = KVCacheLaunch(tokens_per_program=8, num_warps=1)  # 68.0 % at 64k slots, 74.9 % at 256k
GATHER_DEFAULT = KVCacheLaunch(tokens_per_program=4, num_warps=1)  # 79.9 % at 64k slots, 89.6 % at 256k


def int16_view(cache: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(cache as int16 words, True)`` when every page starts at an even address (always, for
    :func:`dsv4ref.kv_cache.allocate`), else ``(cache, False)``: the kernels then move the RoPE words as
    byte pairs."""
    if cache.stride(0) % 2 == 0 and cache.storage_offset() % 2 == 0 and cache.shape[1] % 2 == 0:
        return cache.view(torch.int16), True
    return cache, False


def launch_insert(cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, block_size: int,
                  launch: KVCacheLaunch = INSERT_DEFAULT) -> None:
    """Launch :func:`~dsv4ref.kv_cache.kernels.insert_kernel` directly (no argument checks, no dispatcher;
    ``slots`` int32/int64, any stride; kv rows with unit column stride). For benchmarks of the bare kernel;
    callers use :func:`dsv4ref.kv_cache.insert`."""
    kv16 = kv.view(torch.int16)
    c16, rope16 = int16_view(cache)
    n, tok = slots.shape[0], launch.tokens_per_program
    if n:
        insert_kernel[(triton.cdiv(n, tok),)](cache, c16, kv16, slots, n, slots.stride(0), kv16.stride(0), cache.stride(0),
                                              block_size, TOK=tok, ROPE16=rope16, num_warps=launch.num_warps)


def launch_gather(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, block_size: int,
                  launch: KVCacheLaunch = GATHER_DEFAULT) -> None:
    """Launch :func:`~dsv4ref.kv_cache.kernels.gather_kernel` directly into ``out`` [S, 512] bf16, contiguous
    (``slots`` int32/int64, any stride)."""
    c16, rope16 = int16_view(cache)
    n, tok = slots.shape[0], launch.tokens_per_program
    if n:
        gather_kernel[(triton.cdiv(n, tok),)](cache, c16, slots, out.view(torch.int16), n, slots.stride(0), cache.stride(0),
                                              block_size, TOK=tok, ROPE16=rope16, num_warps=launch.num_warps)


@torch.library.custom_op("dsv4ref::kv_insert", mutates_args=("cache",))
def kv_insert_op(cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, block_size: int,
                 tokens_per_program: int = INSERT_DEFAULT.tokens_per_program,
                 num_warps: int = INSERT_DEFAULT.num_warps) -> None:
    """``torch.ops.dsv4ref.kv_insert``: the insert kernel on checked arguments (slots int32/int64, any stride)."""
    launch_insert(cache, kv, slots, block_size, KVCacheLaunch(tokens_per_program, num_warps))


@kv_insert_op.register_fake
def _(cache, kv, slots, block_size, tokens_per_program=INSERT_DEFAULT.tokens_per_program,
      num_warps=INSERT_DEFAULT.num_warps):
    return None


@torch.library.custom_op("dsv4ref::kv_gather", mutates_args=("out",))
def kv_gather_op(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, block_size: int,
                 tokens_per_program: int = GATHER_DEFAULT.tokens_per_program,
                 num_warps: int = GATHER_DEFAULT.num_warps) -> None:
    """``torch.ops.dsv4ref.kv_gather``: the gather kernel on checked arguments, into ``out``."""
    launch_gather(cache, slots, out, block_size, KVCacheLaunch(tokens_per_program, num_warps))


@kv_gather_op.register_fake
def _(cache, slots, out, block_size, tokens_per_program=GATHER_DEFAULT.tokens_per_program,
      num_warps=GATHER_DEFAULT.num_warps):
    return None
