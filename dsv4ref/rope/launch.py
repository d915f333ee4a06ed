"""How the rope kernels are launched: :class:`RopeLaunch`, the launchers, and the registered custom ops.

Launch choices are passed explicitly (``launch=RopeLaunch(...)`` on the public functions); the custom ops
carry every one of them in their schema, so a traced or compiled graph never reads a setting from
outside its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from ..device import for_interpreter
from ..op_launch import OpLaunch
from . import kernels

# The best measured warp count for each heads-per-program of the multi-head kernel (H100/H200 sweep,
# benchmarks/rope.md); 4 beyond the table.
MH_WARPS = {1: 1, 2: 1, 4: 2, 8: 4, 16: 4, 32: 4}


def _pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and not v & (v - 1)


@dataclass(frozen=True)
class RopeLaunch(OpLaunch):
    """Launch configuration of the rope kernels; ``RopeLaunch()`` is the measured default.

    Which fused kernel ``qnorm_rope_kv_insert`` launches (each measured on the H200: ``benchmarks/rope.md``,
    ``benchmarks/RESULTS.md``):

    * ``heads_per_prog = n ≥ 1`` (a power of two): the multi-head kernel, n heads of one token per program,
      q read and written as packed bf16 pairs (int32 words), T·(H/n + 1) programs. n = 2 at 1 warp is the
      default; n = 4 at 2 warps and n = 8 at 4 warps measured within a few points of it.
    * ``heads_per_prog = 0``: the per-head kernel, grid (T, H + 1), one 2-KiB head per program, slower still
      (1 warp). Also the fallback when q cannot be viewed as int32 pairs (see :func:`packable`).

    Attributes:
        heads_per_prog: query heads per program of the fused kernel; 0 = the per-head kernel.
        num_warps: warps per program of the fused kernel; None = the best measured for ``heads_per_prog``
            (1 for the per-head kernel, faster than 4; :data:`MH_WARPS` for the others).
        rotate_rows: rows per program of :func:`~dsv4ref.rope.kernels.rotate_gptj_kernel` (a power of two).
    """

    heads_per_prog: int = 2
    num_warps: int | None = None
    rotate_rows: int = 16

    def __post_init__(self):
        if not (self.heads_per_prog == 0 or _pow2(self.heads_per_prog)):
            raise ValueError(f"heads_per_prog: expected 0 or a power of two, got {self.heads_per_prog}")
        if self.num_warps is not None and not (_pow2(self.num_warps) and self.num_warps <= 32):
            raise ValueError(f"num_warps: expected None or a power of two <= 32, got {self.num_warps}")
        if not _pow2(self.rotate_rows):
            raise ValueError(f"rotate_rows: expected a power of two, got {self.rotate_rows}")

    @property
    def warps(self) -> int:
        """``num_warps`` resolved: the number the fused kernel is launched with."""
        if self.num_warps is not None:
            return self.num_warps
        return 1 if self.heads_per_prog == 0 else MH_WARPS.get(self.heads_per_prog, 4)

    def resolve(self, q: torch.Tensor) -> RopeLaunch:
        """What actually runs for this q: the per-head kernel when q is not :func:`packable`, and the warp
        count filled in. The custom op receives these numbers."""
        hpp = self.heads_per_prog if packable(q) else 0
        return replace(self, heads_per_prog=hpp, num_warps=replace(self, heads_per_prog=hpp).warps)

    # What each custom op's schema takes (op_args(op), from_op_args(..., op=op): dsv4ref.op_launch); the fused
    # op's num_warps is the resolved one: call op_args on :meth:`resolve`'s launch.
    OP_FIELDS = {"rope_gptj": ("rotate_rows",), "qnorm_rope_kv_insert": ("heads_per_prog", "num_warps")}


#: heads per program of the fused kernel in Triton's interpreter, which pays for every program whatever its tile:
#: TINY's 16 heads in one program instead of 8 (the arithmetic per head is the same, so are the bits)
INTERPRETER_HEADS_PER_PROG = 16


def default_launch(*, interpreted: bool | None = None) -> RopeLaunch:
    """The measured default, ``RopeLaunch()``: 2 heads per program at 1 warp, 16 rows per rotate program. In
    Triton's interpreter, where the cost is the number of programs, :data:`INTERPRETER_HEADS_PER_PROG` heads
    per program (same bits). ``interpreted``: the interpreter's default if True, the GPU's if False (None:
    this process's)."""
    if for_interpreter(interpreted):
        return RopeLaunch(heads_per_prog=INTERPRETER_HEADS_PER_PROG)
    return RopeLaunch()


# The multi-head launches that `python -m dsv4ref bench rope` times (benchmarks/rope.md) and that the
# GPU-only test holds to the reference bit for bit.
MH_SWEEP = tuple(RopeLaunch(n, w) for n, w in ((1, 1), (2, 1), (4, 1), (4, 2), (8, 1), (8, 2), (8, 4), (16, 4)))


def packable(q: torch.Tensor) -> bool:
    """True when bf16 ``q [T, H, 512]`` can be viewed as int32 pairs (4-byte aligned start, even strides):
    the multi-head kernel needs it; otherwise the per-head kernel runs."""
    return q.storage_offset() % 2 == 0 and q.stride(0) % 2 == 0 and q.stride(1) % 2 == 0


# ----------------------------------------------------------------------------------------------------
# launchers (no argument checks: the public functions in dsv4ref.rope check)
# ----------------------------------------------------------------------------------------------------


def rotate(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, out: torch.Tensor, pos_div: int, inverse: bool, rows: int
) -> None:
    """x, out: ``[N, D]`` with a contiguous last dim (out contiguous, a copy of x); positions int64
    ``[N // pos_div]`` (made contiguous here: the kernel reads ``pos[n // pos_div]``)."""
    n, D = x.shape
    if n == 0:
        return
    bf16 = x.dtype == torch.bfloat16
    xv, ov = (x.view(torch.int16), out.view(torch.int16)) if bf16 else (x, out)
    R = cos_sin.shape[1]
    kernels.rotate_gptj_kernel[(triton.cdiv(n, rows),)](
        xv,
        ov,
        positions.contiguous(),
        cos_sin,
        n,
        x.stride(0),
        D,
        cos_sin.stride(0),
        pos_div,
        R=R,
        R_P2=triton.next_power_of_2(R),
        ROWS=rows,
        INVERSE=inverse,
        IS_BF16=bf16,
        enable_fp_fusion=False,
    )


def fused(
    q,
    kv,
    cache,
    slots,
    positions,
    cos_sin,
    eps: float,
    block_size: int,
    launch: RopeLaunch | None = None,
    *,
    do_q: bool = True,
    do_kv: bool = True,
) -> None:
    """Launch the fused kernel chosen by ``launch`` (the per-head one when q is not :func:`packable`).
    q, kv: last dim contiguous; slots, positions: int64 (made contiguous here: the kernels read them as
    flat arrays). ``do_q`` / ``do_kv`` = False skip that half (benchmarks of the unfused passes). ``launch``
    None = :func:`default_launch`."""
    T, H, _ = q.shape
    if T == 0:
        return
    launch = launch or default_launch()
    slots, positions = slots.contiguous(), positions.contiguous()
    q16, kv16 = q.view(torch.int16), kv.view(torch.int16)
    hpp = launch.heads_per_prog
    if hpp and packable(q):
        q32 = q16.view(torch.int32)
        ng = triton.cdiv(H, hpp)
        kernels.qnorm_rope_kv_insert_mh_kernel[(T * (ng + 1),)](
            q32,
            kv16,
            cache,
            slots,
            positions,
            cos_sin,
            H,
            ng,
            slots.shape[0],
            q32.stride(0),
            q32.stride(1),
            kv16.stride(0),
            cos_sin.stride(0),
            cache.stride(0),
            block_size,
            eps,
            HPP=hpp,
            DO_Q=do_q,
            DO_KV=do_kv,
            num_warps=launch.warps,
            enable_fp_fusion=False,
        )
        return
    kernels.qnorm_rope_kv_insert_kernel[(T, H + 1)](
        q16,
        kv16,
        cache,
        slots,
        positions,
        cos_sin,
        H,
        slots.shape[0],
        q16.stride(0),
        q16.stride(1),
        kv16.stride(0),
        cos_sin.stride(0),
        cache.stride(0),
        block_size,
        eps,
        DO_Q=do_q,
        DO_KV=do_kv,
        num_warps=launch.num_warps or 1,
        enable_fp_fusion=False,
    )


# ----------------------------------------------------------------------------------------------------
# custom ops: every launch choice is an argument
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("dsv4ref::rope_gptj", mutates_args=("out",))
def rope_gptj_op(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    out: torch.Tensor,
    pos_div: int,
    inverse: bool,
    rotate_rows: int,
) -> None:
    rotate(x, positions, cos_sin, out, pos_div, inverse, RopeLaunch.from_op_args(rotate_rows, op="rope_gptj").rotate_rows)


@rope_gptj_op.register_fake
def _(x, positions, cos_sin, out, pos_div, inverse, rotate_rows):
    return None


@torch.library.custom_op("dsv4ref::qnorm_rope_kv_insert", mutates_args=("q", "cache"))
def qnorm_rope_kv_insert_op(
    q: torch.Tensor,
    kv: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    eps: float,
    block_size: int,
    heads_per_prog: int,
    num_warps: int,
) -> None:
    launch = RopeLaunch.from_op_args(heads_per_prog, num_warps, op="qnorm_rope_kv_insert")
    fused(q, kv, cache, slots, positions, cos_sin, eps, block_size, launch)


@qnorm_rope_kv_insert_op.register_fake
def _(q, kv, cache, slots, positions, cos_sin, eps, block_size, heads_per_prog, num_warps):
    return None
