"""How :mod:`dsv4ref.linear` launches its kernels: :class:`LinearLaunch`, the launchers, and the
``torch.library`` custom ops (``dsv4ref::linear_act_quant``, ``dsv4ref::linear_fp8_gemm``,
``dsv4ref::linear_fp4_gemm``) with their fake implementations.

Every launch choice is an argument of the custom op's schema (``*launch.op_args()``), so a traced or compiled
graph records the shape it ran with. The custom ops take plain dtypes: e4m3 / E2M1 data as uint8 bytes, the
activation scales as fp32 values, the weight scales as UE8M0 bytes (uint8, decoded in the kernel) or fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .. import validate
from ..device import for_interpreter, interpreting
from ..op_launch import OpLaunch
from ..formats import ACT_BLOCK, FP4_BLOCK
from .kernels import act_quant_kernel, fp4_gemm_kernel, fp8_gemm_kernel
from ..fp8.reference import canonical_nan
from .reference import scale_values

__all__ = ["LinearLaunch", "default_launch", "run_act_quant", "run_fp8_gemm", "run_fp4_gemm"]

MAX_TILE = 1 << 20  # Triton's largest tensor
INTERPRETER_BLOCK_N = 256  # the widest block_n: a quarter of the GEMM programs of the GPU's 64


@dataclass(frozen=True)
class LinearLaunch(OpLaunch):
    """Launch shape of the linear kernels. No field changes a bit of the result.

    Attributes:
        block_m: rows of y per GEMM program, and rows per act_quant program (a power of two >= 16: tl.dot's
            smallest M; decode batches of 1..16 rows fill one tile).
        block_n: columns of y per GEMM program (a power of two >= 16).
        num_warps: Triton warps per program (a power of two).
        split_k: K splits of the GEMMs (an int >= 1): each split sums its K
            blocks into an fp32 partial ``[M, N]``, and the partials are added (then rounded to bf16) after the
            kernel. More programs for a decode GEMM with few tiles of y; the order of the fp32 sums changes,
            within ``linear_out``.
    """

    block_m: int = 16
    block_n: int = 64
    num_warps: int = 4
    split_k: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = validate.power_of_two(getattr(self, name), name)
            if v < 16 or v > 256:
                raise ValueError(f"{name}: expected a power of two in [16, 256], got {v}")
        validate.power_of_two(self.num_warps, "num_warps")
        validate.integer(self.split_k, "split_k", lo=1)

    # act_quant tiles rows only; the GEMMs take every field (op_args(), from_op_args(): dsv4ref.op_launch)
    OP_FIELDS = {"linear_act_quant": ("block_m", "num_warps"), "linear_fp8_gemm": None, "linear_fp4_gemm": None}


def default_launch(m: int, *, interpreted: bool | None = None) -> LinearLaunch:
    """The default for M rows of activations: the smallest block_m of 16, 32, 64 that holds them (decode M is
    1..256), 4 warps, no split of K; 64 columns per program on a GPU (not yet tuned there: ``bench linear``
    times a split-K launch beside it), :data:`INTERPRETER_BLOCK_N` in Triton's interpreter, where the cost is
    the number of programs (same bits: no field changes one). ``interpreted``: the interpreter's default if
    True, the GPU's if False (None: this process's)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    if for_interpreter(interpreted):
        return LinearLaunch(block_m=block_m, block_n=INTERPRETER_BLOCK_N)
    return LinearLaunch(block_m=block_m)


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    """A view whose columns are contiguous is read with its row stride; any other layout is copied."""
    return t if t.stride(1) == 1 else t.contiguous()


@torch.library.custom_op("dsv4ref::linear_act_quant", mutates_args=())
def act_quant_op(x: torch.Tensor, block: int, block_m: int, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.dsv4ref.linear_act_quant``: x ``[M, K]`` (any float view) -> (uint8 e4m3 bytes, fp32 scales)."""
    launch = LinearLaunch.from_op_args(block_m, num_warps, op="linear_act_quant")
    block_m, num_warps = launch.block_m, launch.num_warps
    m, k = x.shape
    nb = triton.cdiv(k, block)
    if block_m * block > MAX_TILE:
        raise ValueError(f"launch: block_m={block_m} × block={block} values per program exceed Triton's {MAX_TILE}")
    xf = x.float().contiguous()
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    s = torch.empty((m, nb), dtype=torch.float32, device=x.device)
    if m and k:
        act_quant_kernel[(triton.cdiv(m, block_m), nb)](xf, q, s, m, k, nb, BLOCK=block, ROWS=block_m, num_warps=num_warps)
    return q, s


@act_quant_op.register_fake
def _(x, block, block_m, num_warps):
    m, k = x.shape
    return x.new_empty((m, k), dtype=torch.uint8), x.new_empty((m, -(-k // block)), dtype=torch.float32)


def _gemm(kernel, q, s, w, w_scale, n, nb, extra, launch: LinearLaunch):
    """Launch a GEMM kernel over ``nb`` K blocks in ``launch.split_k`` splits (at most one per block)."""
    block_m, block_n, num_warps, split_k = launch.block_m, launch.block_n, launch.num_warps, launch.split_k
    m, k = q.shape
    per = triton.cdiv(nb, min(split_k, max(nb, 1)))  # K blocks per split
    splits = triton.cdiv(nb, per) if nb else 1
    out = torch.empty((m, n), dtype=torch.bfloat16, device=q.device)
    if m and n:
        a, b = _unit_columns(q), _unit_columns(w)
        part = torch.empty((splits, m, n), dtype=torch.float32, device=q.device) if splits > 1 else None
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
        kernel[grid](
            a,
            s.contiguous(),
            b,
            w_scale.contiguous(),
            out.view(torch.int16) if part is None else part,
            m,
            n,
            k,
            a.stride(0),
            b.stride(0),
            *extra,
            per,
            BM=block_m,
            BN=block_n,
            DOT_FP32=interpreting(),
            SB_BYTES=w_scale.dtype == torch.uint8,
            SPLIT=part is not None,
            num_warps=num_warps,
        )
        if part is not None:
            out = canonical_nan(part.sum(0).to(torch.bfloat16))  # torch's fp32 -> bf16 rounds to nearest even
    return out


@torch.library.custom_op("dsv4ref::linear_fp8_gemm", mutates_args=())
def fp8_gemm_op(
    q: torch.Tensor,
    s: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block_m: int,
    block_n: int,
    num_warps: int,
    split_k: int,
) -> torch.Tensor:
    """``torch.ops.dsv4ref.linear_fp8_gemm``: uint8 e4m3 q ``[M, K]``, fp32 s, uint8 e4m3 w ``[N, K]``, w_scale
    ``[ceil(N/128), ceil(K/128)]`` (UE8M0 bytes or fp32) -> bf16 ``[M, N]``."""
    nbk = triton.cdiv(q.shape[1], ACT_BLOCK)
    launch = LinearLaunch.from_op_args(block_m, block_n, num_warps, split_k, op="linear_fp8_gemm")
    return _gemm(fp8_gemm_kernel, q, s, w, w_scale, w.shape[0], nbk, (nbk,), launch)


@fp8_gemm_op.register_fake
def _(q, s, w, w_scale, block_m, block_n, num_warps, split_k):
    return q.new_empty((q.shape[0], w.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("dsv4ref::linear_fp4_gemm", mutates_args=())
def fp4_gemm_op(
    q: torch.Tensor,
    s: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block_m: int,
    block_n: int,
    num_warps: int,
    split_k: int,
) -> torch.Tensor:
    """``torch.ops.dsv4ref.linear_fp4_gemm``: uint8 e4m3 q ``[M, K]``, fp32 s, uint8 packed E2M1 w ``[N, K/2]``,
    w_scale ``[N, ceil(K/32)]`` (UE8M0 bytes or fp32) -> bf16 ``[M, N]``."""
    k = q.shape[1]
    nb4 = triton.cdiv(k, FP4_BLOCK)
    extra = (triton.cdiv(k, ACT_BLOCK), nb4)
    launch = LinearLaunch.from_op_args(block_m, block_n, num_warps, split_k, op="linear_fp4_gemm")
    return _gemm(fp4_gemm_kernel, q, s, w, w_scale, w.shape[0], nb4, extra, launch)


@fp4_gemm_op.register_fake
def _(q, s, w, w_scale, block_m, block_n, num_warps, split_k):
    return q.new_empty((q.shape[0], w.shape[0]), dtype=torch.bfloat16)


def _weight_scales(w_scale: torch.Tensor) -> torch.Tensor:
    """Weight scales as the kernels read them: UE8M0 bytes as uint8 (decoded in the kernel), fp32 as it is."""
    return w_scale if w_scale.dtype == torch.float32 else w_scale.view(torch.uint8)


def run_act_quant(x: torch.Tensor, block: int, launch: LinearLaunch) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant on checked arguments: ``(q float8_e4m3fn, s fp32)``."""
    q, s = act_quant_op(x, block, *launch.op_args("linear_act_quant"))
    return q.view(torch.float8_e4m3fn), s


def run_fp8_gemm(q, s, w, w_scale, launch: LinearLaunch) -> torch.Tensor:
    """fp8_gemm on checked arguments (any of the accepted dtypes, converted here)."""
    args = (q.view(torch.uint8), scale_values(s), w.view(torch.uint8), _weight_scales(w_scale))
    return fp8_gemm_op(*args, *launch.op_args("linear_fp8_gemm"))


def run_fp4_gemm(q, s, w_packed, w_scale, launch: LinearLaunch) -> torch.Tensor:
    """fp4_gemm on checked arguments (``w_packed`` float4_e2m1fn_x2 or uint8)."""
    args = (q.view(torch.uint8), scale_values(s), w_packed.view(torch.uint8), _weight_scales(w_scale))
    return fp4_gemm_op(*args, *launch.op_args("linear_fp4_gemm"))
