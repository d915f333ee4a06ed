"""The insert and gather kernels on a persistent grid: at most ``programs_per_sm`` programs per SM, program
``pid`` handling tiles pid, pid + grid, ... with the shipped tile functions
(:func:`dsv4ref.kv_cache.kernels._insert_tile`, ``_gather_tile``); with ``pipeline_stages`` ≥ 2 that loop is
software-pipelined (Triton's ``tl.range`` ``num_stages``: the next tiles' loads go through shared memory with
``cp.async`` while this tile is encoded and stored). Same bytes as :func:`dsv4ref.kv_cache.insert` /
:func:`~dsv4ref.kv_cache.gather` (``tests/test_kv_cache.py`` holds them to the reference); measured slower than
one program per tile on the H200 (``benchmarks/kv_cache.md``), so no default.

:class:`PersistentLaunch` names a variant; :func:`launch_insert` / :func:`launch_gather` run it (or a plain
:class:`~dsv4ref.kv_cache.launch.KVCacheLaunch`, through the shipped launchers): no argument checks, no custom
op; an experiment's launchers.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ... import validate
from ...device import sm_count
from ..kernels import _gather_tile, _insert_tile, gather_kernel, insert_kernel
from ..launch import KVCacheLaunch, _grid_and_flags, int16_view
from ..launch import launch_gather as _shipped_gather
from ..launch import launch_insert as _shipped_insert

__all__ = ["PersistentLaunch", "grid_and_flags", "launch_insert", "launch_gather", "persistent_insert_kernel",
           "persistent_gather_kernel"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PersistentLaunch:
    """A persistent grid over the tiles of ``tile`` (its fields shape each tile as in the shipped kernels).

    Attributes:
        tile: the tile's shape and flags.
        programs_per_sm: k ≥ 1: a grid of at most k programs per SM.
        pipeline_stages: 2 or more software-pipelines the loop over tiles; 0 or 1: no pipelining.
    """

    tile: KVCacheLaunch
    programs_per_sm: int = 1
    pipeline_stages: int = 0

    def __post_init__(self):
        if not isinstance(self.tile, KVCacheLaunch):
            raise TypeError(f"tile: expected a KVCacheLaunch, got {type(self.tile).__name__}")
        validate.integer(self.programs_per_sm, "programs_per_sm", lo=1)
        validate.integer(self.pipeline_stages, "pipeline_stages", lo=0, hi=8)


@triton.jit
def persistent_insert_kernel(
    cache_ptr,  # the arguments of dsv4ref.kv_cache.kernels.insert_kernel, then STAGES
    cache16_ptr,
    kv_ptr,
    slot_ptr,
    n,
    slot_stride,
    kv_stride,
    page_stride,
    block_size,
    TOK: tl.constexpr,
    ROPE16: tl.constexpr,
    NATIVE: tl.constexpr = False,
    SLOT32: tl.constexpr = False,
    LOAD_POLICY: tl.constexpr = "",
    STORE_CACHE: tl.constexpr = "",
    EARLY: tl.constexpr = False,
    STAGES: tl.constexpr = 1,  # >= 2 software-pipelines the loop's loads (tl.range num_stages); 1: none
):
    for tile in tl.range(tl.program_id(0), tl.cdiv(n, TOK), tl.num_programs(0), num_stages=STAGES):
        _insert_tile(cache_ptr, cache16_ptr, kv_ptr, slot_ptr, tile, n, slot_stride, kv_stride, page_stride, block_size,
                     TOK, ROPE16, NATIVE, SLOT32, LOAD_POLICY, STORE_CACHE, EARLY)  # fmt: skip


@triton.jit
def persistent_gather_kernel(
    cache_ptr,  # the arguments of dsv4ref.kv_cache.kernels.gather_kernel, then STAGES
    cache16_ptr,
    slot_ptr,
    out_ptr,
    n,
    slot_stride,
    page_stride,
    block_size,
    TOK: tl.constexpr,
    ROPE16: tl.constexpr,
    NATIVE: tl.constexpr = False,
    SLOT32: tl.constexpr = False,
    LOAD_POLICY: tl.constexpr = "",
    STORE_CACHE: tl.constexpr = "",
    STAGES: tl.constexpr = 1,  # >= 2 software-pipelines the loop's loads (tl.range num_stages); 1: none
):
    for tile in tl.range(tl.program_id(0), tl.cdiv(n, TOK), tl.num_programs(0), num_stages=STAGES):
        _gather_tile(cache_ptr, cache16_ptr, slot_ptr, out_ptr, tile, n, slot_stride, page_stride, block_size,
                     TOK, ROPE16, NATIVE, SLOT32, LOAD_POLICY, STORE_CACHE)  # fmt: skip


def grid_and_flags(cache: torch.Tensor, n: int, block_size: int, launch, insert: bool = False) -> tuple:
    """``(kernel, grid, flags)`` of a launch of ``launch`` (a :class:`PersistentLaunch` or a plain
    ``KVCacheLaunch``) over ``n`` slots: what a sweep warms up and launches."""
    if isinstance(launch, KVCacheLaunch):
        grid, flags = _grid_and_flags(cache, n, block_size, launch, insert)
        return (insert_kernel if insert else gather_kernel), grid, flags
    tiles, flags = _grid_and_flags(cache, n, block_size, launch.tile, insert)
    grid = min(tiles, launch.programs_per_sm * sm_count(cache.device))
    flags["STAGES"] = max(launch.pipeline_stages, 1)
    return (persistent_insert_kernel if insert else persistent_gather_kernel), grid, flags


def launch_insert(cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, block_size: int, launch) -> None:
    """:func:`dsv4ref.kv_cache.launch.launch_insert` with ``launch`` a :class:`PersistentLaunch` (or a plain one)."""
    if isinstance(launch, KVCacheLaunch):
        return _shipped_insert(cache, kv, slots, block_size, launch)
    kv16 = kv.view(torch.int16)
    c16, rope16 = int16_view(cache)
    n = slots.shape[0]
    if n:
        kernel, grid, flags = grid_and_flags(cache, n, block_size, launch, insert=True)
        kernel[(grid,)](
            cache, c16, kv16, slots, n, slots.stride(0), kv16.stride(0), cache.stride(0), block_size, ROPE16=rope16, **flags
        )


def launch_gather(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, block_size: int, launch) -> None:
    """:func:`dsv4ref.kv_cache.launch.launch_gather` with ``launch`` a :class:`PersistentLaunch` (or a plain one)."""
    if isinstance(launch, KVCacheLaunch):
        return _shipped_gather(cache, slots, out, block_size, launch)
    c16, rope16 = int16_view(cache)
    n = slots.shape[0]
    if n:
        kernel, grid, flags = grid_and_flags(cache, n, block_size, launch)
        kernel[(grid,)](
            cache, c16, slots, out.view(torch.int16), n, slots.stride(0), cache.stride(0), block_size, ROPE16=rope16, **flags
        )
