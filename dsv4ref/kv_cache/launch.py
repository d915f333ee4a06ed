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
from ..op_launch import OpLaunch
from ..device import for_interpreter, interpreting  # compiled kernels only take the hardware casts
from .kernels import gather_kernel, insert_kernel

__all__ = ["KVCacheLaunch", "default_launch", "launch_insert", "launch_gather", "int16_view", "kv_insert_op", "kv_gather_op"]


@dataclass(frozen=True)
class KVCacheLaunch(OpLaunch):
    """Launch shape of the insert / gather kernels: one program per tile. No field changes a byte of the result.
    (The persistent and pipelined grids measured against it, no default: ``dsv4ref.kv_cache.variants``.)

    Attributes:
        tokens_per_program: slots handled by one tile (a power of two; 1 = one token per program).
        num_warps: Triton warps per program (a power of two).
        native_casts: compiled kernels convert with the hardware's e4m3 (insert, finite tiles) / bf16 (gather)
            casts instead of the integer encoders of :mod:`dsv4ref.tl.numerics` (about 8 instructions a value for
            e4m3, 4 for bf16; the compiled casts are exact on the H200 by
            ``tests/test_tl_helpers.py::test_raw_triton_fp8_cast_is_exact`` / ``..._bf16_cast_rounds``). On in
            the defaults: faster on the H200, and byte-checked there (``benchmarks/kv_cache.md``). The
            interpreter's casts are wrong (I4, I5): interpreted launches always take the integer encoders.
        evict_first: load the streamed input (insert: the kv rows; gather: the cache bytes) with the
            ``evict_first`` L2 policy.
        streaming_stores: store the output (insert: the cache records; gather: the rows) with ``.cs``.
        early_loads: insert only (the gather ignores it): load a tile's kv rows masked by the row count alone, all
            at once, before the slots arrive. The default masks them by ``slot >= 0``, so they wait for the slot
            load, and loads the NoPE tile after the RoPE store, which waits for the RoPE load: three DRAM round trips
            in series per program (the SASS in ``benchmarks/kv_cache.md``), against one. Rows with slot
            −1 are then read (never written); kv has at least ``len(slots)`` rows (``insert`` checks it).
        max_registers: 0 = the registers ptxas picks; n in [16, 255] caps them (Triton's ``maxnreg``): more
            resident one-warp programs per SM (64 registers: the 32-program cap), so more loads in flight, against
            spills.
    """

    tokens_per_program: int
    num_warps: int = 1
    native_casts: bool = False
    evict_first: bool = False
    streaming_stores: bool = False
    early_loads: bool = False
    max_registers: int = 0

    def __post_init__(self):
        validate.power_of_two(self.tokens_per_program, "tokens_per_program")
        validate.power_of_two(self.num_warps, "num_warps")
        for name in ("native_casts", "evict_first", "streaming_stores", "early_loads"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {type(getattr(self, name)).__name__}")
        validate.integer(self.max_registers, "max_registers", lo=0, hi=255)
        if 0 < self.max_registers < 16:
            raise ValueError(f"max_registers: expected 0 or 16..255, got {self.max_registers}")

    # both custom ops take every field (op_args(), from_op_args(): dsv4ref.op_launch)
    OP_FIELDS = {"kv_insert": None, "kv_gather": None}


# The defaults, measured on the H200 (benchmarks/kv_cache.md; B = 64, random slot order, CUDA-graph
# kernel time as a fraction of the measured copy bandwidth). One warp per program is best: 4 warps per
# 1.6 KB token starve occupancy (insert 1 × 4: 26.9 %, 1 × 1: 54.7 % at 64k slots).
# Both use the hardware casts (byte-exact on the H200, NaN / inf / subnormal rows and pages of 1, 2, 61 and 64
# tokens included: scripts/probe_kv_native.py). The insert loads its kv rows early (one DRAM round trip per
# program instead of three), 4 tokens over 2 warps, with streaming stores: the fastest insert measured.
_INSERT = KVCacheLaunch(tokens_per_program=4, num_warps=2, native_casts=True, streaming_stores=True, early_loads=True)
_GATHER = KVCacheLaunch(tokens_per_program=4, num_warps=1, native_casts=True)


# In Triton's interpreter a program costs about the same whatever its tile, so the default there is the
# widest tile (the same bytes: a program's tokens are independent; the interpreter ignores the cast and cache flags)
INTERPRETER_TOKENS = 64
_INTERPRETED = KVCacheLaunch(tokens_per_program=INTERPRETER_TOKENS)


def default_launch(op: str, *, interpreted: bool | None = None) -> KVCacheLaunch:
    """The measured default of ``op``, ``"insert"`` or ``"gather"`` (the note above; ``benchmarks/kv_cache.md``);
    in Triton's interpreter :data:`INTERPRETER_TOKENS` tokens per program. ``interpreted``: the interpreter's
    default if True, the GPU's if False (None: this process's)."""
    if op not in ("insert", "gather"):
        raise ValueError(f'op: expected "insert" or "gather", got {op!r}')
    if for_interpreter(interpreted):
        return _INTERPRETED
    return _INSERT if op == "insert" else _GATHER


def int16_view(cache: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(cache as int16 words, True)`` when every page starts at an even address (always, for
    :func:`dsv4ref.kv_cache.allocate`), else ``(cache, False)``: the kernels then move the RoPE words as
    byte pairs."""
    if cache.stride(0) % 2 == 0 and cache.storage_offset() % 2 == 0 and cache.shape[1] % 2 == 0:
        return cache.view(torch.int16), True
    return cache, False


def _grid_and_flags(
    cache: torch.Tensor, n: int, block_size: int, launch: KVCacheLaunch, insert: bool = False
) -> tuple[int, dict]:
    """The grid and the kernel's launch constexprs and options (metadata only: no device sync); ``insert``: for
    the insert kernel (the only one with ``EARLY``)."""
    grid = triton.cdiv(n, launch.tokens_per_program)  # one program per tile
    flags = dict(
        TOK=launch.tokens_per_program,
        NATIVE=launch.native_casts and not interpreting(),
        SLOT32=cache.shape[0] * block_size < 2**31,  # pages · B slots: the slot fits int32 (numerics.page_offsets32)
        LOAD_POLICY="evict_first" if launch.evict_first else "",
        STORE_CACHE=".cs" if launch.streaming_stores else "",
        num_warps=launch.num_warps,
    )
    if insert:
        flags["EARLY"] = launch.early_loads
    if launch.max_registers:
        flags["maxnreg"] = launch.max_registers
    return grid, flags


def launch_insert(
    cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, block_size: int, launch: KVCacheLaunch = _INSERT
) -> None:
    """Launch :func:`~dsv4ref.kv_cache.kernels.insert_kernel` directly (no argument checks, no dispatcher;
    ``slots`` int32/int64, any stride; kv rows with unit column stride). For benchmarks of the bare kernel;
    callers use :func:`dsv4ref.kv_cache.insert`."""
    kv16 = kv.view(torch.int16)
    c16, rope16 = int16_view(cache)
    n = slots.shape[0]
    if n:
        grid, flags = _grid_and_flags(cache, n, block_size, launch, insert=True)
        insert_kernel[(grid,)](
            cache, c16, kv16, slots, n, slots.stride(0), kv16.stride(0), cache.stride(0), block_size, ROPE16=rope16, **flags
        )


def launch_gather(
    cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, block_size: int, launch: KVCacheLaunch = _GATHER
) -> None:
    """Launch :func:`~dsv4ref.kv_cache.kernels.gather_kernel` directly into ``out`` [S, 512] bf16, contiguous
    (``slots`` int32/int64, any stride)."""
    c16, rope16 = int16_view(cache)
    n = slots.shape[0]
    if n:
        grid, flags = _grid_and_flags(cache, n, block_size, launch)
        gather_kernel[(grid,)](
            cache, c16, slots, out.view(torch.int16), n, slots.stride(0), cache.stride(0), block_size, ROPE16=rope16, **flags
        )


@torch.library.custom_op("dsv4ref::kv_insert", mutates_args=("cache",))
def kv_insert_op(
    cache: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    tokens_per_program: int,
    num_warps: int,
    native_casts: bool,
    evict_first: bool,
    streaming_stores: bool,
    early_loads: bool,
    max_registers: int,
) -> None:
    """``torch.ops.dsv4ref.kv_insert``: the insert kernel on checked arguments (slots int32/int64, any stride);
    the launch's fields follow ``block_size`` (``*launch.op_args()``)."""
    launch = KVCacheLaunch.from_op_args(
        tokens_per_program,
        num_warps,
        native_casts,
        evict_first,
        streaming_stores,
        early_loads,
        max_registers,
    )
    launch_insert(cache, kv, slots, block_size, launch)


@kv_insert_op.register_fake
def _(cache, kv, slots, block_size, *launch):
    return None


@torch.library.custom_op("dsv4ref::kv_gather", mutates_args=("out",))
def kv_gather_op(
    cache: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    block_size: int,
    tokens_per_program: int,
    num_warps: int,
    native_casts: bool,
    evict_first: bool,
    streaming_stores: bool,
    early_loads: bool,
    max_registers: int,
) -> None:
    """``torch.ops.dsv4ref.kv_gather``: the gather kernel on checked arguments, into ``out``; the launch's
    fields follow ``block_size`` (``*launch.op_args()``)."""
    launch = KVCacheLaunch.from_op_args(
        tokens_per_program,
        num_warps,
        native_casts,
        evict_first,
        streaming_stores,
        early_loads,
        max_registers,
    )
    launch_gather(cache, slots, out, block_size, launch)


@kv_gather_op.register_fake
def _(cache, slots, out, block_size, *launch):
    return None
