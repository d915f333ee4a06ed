"""The grouped FP4-weight expert GEMM: FP8 activations × E2M1 weights, slots grouped by expert.

One kernel serves both GEMMs of a routed expert and both activation formats of ``docs/moe.md#v4s-formats-in-the-experts``::

    out[o_row[r], n] = Σ_k  x̂[a_row[r], k] · Ŵ[e, n, k]                 fp32 accumulation, fp32 out

    x̂[i, k] = e4m3(a[i, k]) · 2^(byte − 127)    A_GROUP = 32: byte j of the packed int32 word a_sf[i, k // 128]
                                                   (moe.stage's layout: byte j scales columns 32j … 32j + 31)
                = e4m3(a[i, k]) · a_sf[i, k // 128]  A_GROUP = 128: one fp32 power of two per 128 (act_quant)
    Ŵ[e, n, k] = e2m1(nibble k % 2 of w[e, n, k // 2]) · 2^(w_sf[e, n, k // 32] − 127)   low nibble = even k

Rows r of one program all belong to expert e = tile_expert[tile] (the tile table of
:func:`dsv4ref.moe.launch.tile_table`; e = E: a program past the real tiles, which returns at once). ``a_row``
and ``o_row`` say which activation row a grouped row reads and which output row it writes: the gate/up GEMM
reads token ``slot // K`` and writes row r (a workspace in grouped order), the down GEMM reads row r and writes
the slot's own row. Both operands are exact in bf16 (e4m3 and e2m1 values times powers of two), so the dots run
on bf16 operands (fp32 when interpreting, where the bf16 dot is wrong), accumulating in fp32: the products are
exact, only the order of the fp32 sums differs from the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import validate
from ..device import interpreting
from ..indexer.kernels import e2m1_value
from ..op_launch import OpLaunch
from ..tl import dot, e4m3_decode, ue8m0_value

__all__ = ["Fp4Launch", "default_fp4_launch", "grouped_fp4_gemm_kernel", "moe_fp4_gemm_op"]


@triton.jit
def grouped_fp4_gemm_kernel(
    a_ptr,  # uint8 e4m3 codes [Ra, K], unit stride along K (row stride stride_a)
    a_sf_ptr,  # A_GROUP 32: int32 packed words [Ra, K/128]; 128: fp32 scales [Ra, K/128] (row stride stride_s)
    a_row_ptr,  # int64 [R]: the activation row each grouped row reads
    o_row_ptr,  # int64 [R]: the output row each grouped row writes
    tile_expert_ptr,
    tile_row0_ptr,
    tile_row1_ptr,  # int32 [n_tiles]: expert, first row, end of the expert's rows
    w_ptr,  # uint8 packed E2M1 [E, N, K/2] (stride_we, stride_wn; unit stride along K/2)
    w_sf_ptr,  # uint8 UE8M0 [E, N, K/32] (stride_se, stride_sn; unit stride along K/32)
    out_ptr,  # fp32 [Ro, N] (row stride stride_o, unit stride along N)
    N,
    K,
    n_experts,
    stride_a,
    stride_s,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_o,
    A_GROUP: tl.constexpr,  # 32 or 128
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 128 dividing K
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e >= n_experts:  # past the real tiles: no work
        return
    rows = tl.load(tile_row0_ptr + tile) + tl.arange(0, BLOCK_M)
    rmask = rows < tl.load(tile_row1_ptr + tile)
    arow = tl.load(a_row_ptr + rows, mask=rmask, other=0)
    orow = tl.load(o_row_ptr + rows, mask=rmask, other=0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + e.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]
    s_rows = w_sf_ptr + e.to(tl.int64) * stride_se + n[None, :].to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk  # [BLOCK_K]
        # x̂ [BLOCK_M, BLOCK_K]: e4m3 codes times their group's scale
        q = tl.load(a_ptr + arow[:, None] * stride_a + k[None, :], mask=rmask[:, None], other=0)
        if A_GROUP == 32:
            word = tl.load(a_sf_ptr + arow[:, None] * stride_s + (k // 128)[None, :], mask=rmask[:, None], other=0)
            sa = ue8m0_value((word >> (8 * ((k % 128) // 32))[None, :]) & 0xFF)
        else:
            sa = tl.load(a_sf_ptr + arow[:, None] * stride_s + (k // 128)[None, :], mask=rmask[:, None], other=0.0)
        xv = (e4m3_decode(q) * sa).to(tl.bfloat16)  # exact
        # Ŵᵀ [BLOCK_K, BLOCK_N]: the nibble of element k (low = even), times its 1x32 scale
        b = tl.load(w_rows + (k // 2)[:, None], mask=nmask[None, :], other=0).to(tl.int32)
        code = (b >> (4 * (k % 2))[:, None]) & 0xF
        sw = ue8m0_value(tl.load(s_rows + (k // 32)[:, None], mask=nmask[None, :], other=127))
        wv = (e2m1_value(code) * sw).to(tl.bfloat16)  # exact
        acc = dot(xv, wv, acc, DOT_FP32)
    tl.store(out_ptr + orow[:, None] * stride_o + n[None, :], acc, mask=rmask[:, None] & nmask[None, :])


@dataclass(frozen=True)
class Fp4Launch(OpLaunch):
    """Launch shape of :func:`grouped_fp4_gemm_kernel`: ``block_m`` grouped rows (one expert) per program
    (≥ 16), ``block_n`` output columns, ``block_k`` reduction values per step (a multiple of 128: whole scale
    words), ``warps``, ``stages``. Powers of two."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    warps: int = 4
    stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "warps"):
            validate.power_of_two(getattr(self, name), name)
        validate.integer(self.stages, "stages", lo=1)
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"block_m, block_n: expected >= 16 (tl.dot's smallest tile), got {self.block_m}, {self.block_n}")
        if self.block_k < 128:
            raise ValueError(f"block_k: expected a multiple of 128, got {self.block_k}")

    # the one custom op takes every field (op_args(), from_op_args(): dsv4ref.op_launch)
    OP_FIELDS = {"moe_fp4_gemm": None}


def default_fp4_launch(tokens: int, k: int, experts: int) -> Fp4Launch:
    """``block_m`` from the mean slots per expert (16 at decode sizes); in the interpreter, where each program
    costs about the same whatever its size, the widest tiles."""
    per_expert = tokens * k / max(experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    if interpreting():
        return Fp4Launch(block_m=block_m, block_n=256, block_k=256)
    return Fp4Launch(block_m=block_m)


@torch.library.custom_op("dsv4ref::moe_fp4_gemm", mutates_args=("out",))
def moe_fp4_gemm_op(
    a: torch.Tensor,
    a_sf: torch.Tensor,
    a_row: torch.Tensor,
    o_row: torch.Tensor,
    tile_expert: torch.Tensor,
    tile_row0: torch.Tensor,
    tile_row1: torch.Tensor,
    w: torch.Tensor,
    w_sf: torch.Tensor,
    out: torch.Tensor,
    a_group: int,
    block_m: int,
    block_n: int,
    block_k: int,
    warps: int,
    stages: int,
) -> None:
    """Rows ``o_row[r]`` of ``out`` (fp32 [Ro, N]) for every grouped row r a tile covers; other rows are left
    as they are. ``a`` is the uint8 view of the e4m3 codes, ``w`` / ``w_sf`` the uint8 views of the packed E2M1
    weights and their scales; the launch's fields follow ``a_group`` (``*launch.op_args()``)."""
    launch = Fp4Launch.from_op_args(block_m, block_n, block_k, warps, stages)
    if tile_expert.shape[0] == 0:
        return
    E, N, Kh = w.shape
    K = 2 * Kh
    bk = launch.block_k
    while K % bk:  # whole 128-blocks that divide K
        bk //= 2
    bn = max(16, min(launch.block_n, triton.next_power_of_2(N)))
    grouped_fp4_gemm_kernel[(tile_expert.shape[0], triton.cdiv(N, bn))](
        a,
        a_sf,
        a_row,
        o_row,
        tile_expert,
        tile_row0,
        tile_row1,
        w,
        w_sf,
        out,
        N,
        K,
        E,
        a.stride(0),
        a_sf.stride(0),
        w.stride(0),
        w.stride(1),
        w_sf.stride(0),
        w_sf.stride(1),
        out.stride(0),
        A_GROUP=a_group,
        BLOCK_M=launch.block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_FP32=interpreting(),
        num_warps=launch.warps,
        num_stages=launch.stages,
    )


@moe_fp4_gemm_op.register_fake
def _(a, a_sf, a_row, o_row, tile_expert, tile_row0, tile_row1, w, w_sf, out, a_group, block_m, block_n, block_k, warps, stages):
    return None
