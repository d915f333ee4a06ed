"""How :mod:`dsv4ref.moe` launches its kernels: :class:`MoeLaunch`, the grouping by expert, the workspaces,
and the two custom ops ``dsv4ref::moe_stage`` and ``dsv4ref::moe_experts`` (every launch choice is an
argument of their schema, so ``torch.compile`` sees them and no module global changes what runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import triton

from .. import validate
from ..device import interpreting
from ..formats import STAGE_AMAX_FLOOR, STAGE_BLOCK
from ..op_launch import OpLaunch
from .kernels import combine_kernel, down_kernel, gate_up_kernel, stage_kernel

__all__ = ["MoeLaunch", "default_launch", "group_by_expert", "tile_table", "stage_constexprs", "moe_stage_op", "moe_experts_op"]


NOT_POWERS_OF_TWO = ("expert_stages", "stage_topk_first")


@dataclass(frozen=True)
class MoeLaunch(OpLaunch):
    """Launch shape of the MoE kernels (powers of two, except ``expert_stages``).

    Attributes:
        stage_block_t, stage_block_h: tokens and hidden values per staging program (``stage_block_h`` a
            multiple of 128: one packed scale word per 128 values).
        stage_warps: warps per staging program.
        stage_topk_first: the programs of column block 0 load their rows' top-k ids and weights before the tile,
            so the copy does not add a DRAM round trip after the tile's stores (a quarter of the programs at
            Hd 4096, tile 1 × 1024). (The modes staging was measured in and does not run by default:
            ``dsv4ref.moe.variants.stage``.)
        block_m: slot rows per expert-GEMM program (≥ 16: the smallest ``tl.dot`` on a GPU). Rows of one
            program belong to one expert, so an expert with c slots takes ceil(c / block_m) programs.
        block_n: output columns per expert-GEMM program (intermediate columns in the gate/up GEMM,
            hidden columns in the down GEMM).
        block_h: hidden values per step of the gate/up GEMM (a multiple of 128: whole scale words).
        block_k: intermediate values per step of the down GEMM.
        expert_warps, expert_stages: warps and software-pipeline stages of the expert GEMMs.
        combine_block_t, combine_block_h, combine_warps: the combine's tile and warps.
    """

    # staging: the fastest byte-exact shape of the H200 staging sweep (benchmarks/moe.md)
    stage_block_t: int = 1
    stage_block_h: int = 1024
    stage_warps: int = 1
    stage_topk_first: bool = False
    block_m: int = 16
    block_n: int = 64
    block_h: int = 128
    block_k: int = 64
    expert_warps: int = 4
    expert_stages: int = 3
    combine_block_t: int = 1
    combine_block_h: int = 1024
    combine_warps: int = 4

    def __post_init__(self):
        for f in fields(self):  # (not vars(self).items(): torch.compile cannot trace that on torch 2.11)
            if f.name not in NOT_POWERS_OF_TWO:
                validate.power_of_two(getattr(self, f.name), f.name)
        validate.integer(self.expert_stages, "expert_stages", lo=1)
        if not isinstance(self.stage_topk_first, bool):
            raise TypeError(f"stage_topk_first: expected a bool, got {type(self.stage_topk_first).__name__}")
        for name in ("stage_block_h", "block_h"):
            if getattr(self, name) < STAGE_BLOCK:
                raise ValueError(f"{name}: expected a multiple of {STAGE_BLOCK}, got {getattr(self, name)}")
        for name in ("block_m", "block_n", "block_k"):
            if getattr(self, name) < 16:
                raise ValueError(f"{name}: expected >= 16 (tl.dot's smallest tile on a GPU), got {getattr(self, name)}")

    # the staging op takes the stage_* fields, the experts op the rest (op_args(op), from_op_args: dsv4ref.op_launch)
    OP_FIELDS = {
        "moe_stage": ("stage_block_t", "stage_block_h", "stage_warps", "stage_topk_first"),
        "moe_experts": (
            "block_m",
            "block_n",
            "block_h",
            "block_k",
            "expert_warps",
            "expert_stages",
            "combine_block_t",
            "combine_block_h",
            "combine_warps",
        ),
    }


def default_launch(tokens: int, k: int, experts: int) -> MoeLaunch:
    """The default shape for ``tokens`` × ``k`` slots over ``experts`` experts: ``block_m`` follows the mean
    number of slots per expert (16 at decode sizes, up to 64 for prefill). In the interpreter, where the cost
    is the number of programs (each as slow whatever its size), the tiles are as large as possible."""
    per_expert = tokens * k / max(experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    if interpreting():
        return MoeLaunch(stage_block_t=16, block_m=block_m, block_n=256, block_h=512, block_k=256, combine_block_t=16)
    # staging: the top-k copy before the tile, the fastest byte-exact staging variant of an H200 probe
    # (benchmarks/experiments/mem_probe.py; benchmarks/moe.md)
    if block_m == 64:  # prefill-sized groups: wider tiles, 8 warps
        return MoeLaunch(block_m=64, block_n=128, block_k=128, expert_warps=8, stage_topk_first=True)
    return MoeLaunch(block_m=block_m, expert_stages=4, stage_topk_first=True)


# ----------------------------------------------------------------------------------------------------
# grouping by expert (device-side, no host sync)
# ----------------------------------------------------------------------------------------------------


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots grouped by expert, for the grouped expert GEMMs.

    Args:
        ids: ``[T, K]`` int32/int64 expert ids, −1 = no expert (so is any id outside [0, E): with value
            checks off an out-of-range id is never used as an index).
        num_experts: E.
    Returns:
        ``(order, counts, offsets)``: ``order`` [T·K] int64, the slot numbers ``t·K + k`` stably sorted by
        expert with the −1 (and out-of-range) slots last; ``counts`` [E] int64; ``offsets`` [E + 1] int64, expert e owning
        ``order[offsets[e]:offsets[e+1]]``. Built with device ops only (no host sync), so it can be captured
        in a graph.
    """
    flat = ids.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # −1 (and ids ≥ E) after every expert
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    offsets[1:] = torch.cumsum(counts[:num_experts], 0)
    return order, counts[:num_experts], offsets


def tile_table(counts: torch.Tensor, offsets: torch.Tensor, block_m: int, n_rows: int) -> tuple[torch.Tensor, ...]:
    """Per program of a grouped GEMM: ``(expert, row0, row1)`` int32 [n_tiles], program p covering rows
    ``row0[p] .. min(row0[p] + block_m, row1[p])`` of ``order``, all of expert ``expert[p]``.

    ``n_tiles`` = ceil(n_rows / block_m) + min(E, n_rows), an upper bound on Σ_e ceil(c_e / block_m) known
    without reading the counts; the programs past the real tiles get expert = E and return at once."""
    E = counts.shape[0]
    tiles = (counts + block_m - 1) // block_m
    cum = torch.cumsum(tiles, 0)
    n_tiles = triton.cdiv(n_rows, block_m) + min(E, n_rows)
    p = torch.arange(n_tiles, device=counts.device)
    e = torch.searchsorted(cum, p, right=True)  # in [0, E]
    ec = e.clamp(max=E - 1)
    row0 = offsets[ec] + (p - (cum[ec] - tiles[ec])) * block_m
    return e.int(), row0.int(), offsets[ec + 1].int()


# ----------------------------------------------------------------------------------------------------
# staging
# ----------------------------------------------------------------------------------------------------


def stage_constexprs(Hd: int, K: int, block_t: int, block_h: int, topk_first: bool = False) -> dict:
    """The constexpr arguments of ``stage_kernel`` for these launch fields."""
    return dict(
        FLOOR=STAGE_AMAX_FLOOR,
        BLOCK_T=block_t,
        BLOCK_H=min(block_h, triton.next_power_of_2(Hd)),
        BLOCK_TOPK=max(1, triton.next_power_of_2(K)),
        TOPK_FIRST=topk_first,
    )


def scale_bytes(x_sf: torch.Tensor) -> torch.Tensor:
    """The int32 scale words ``x_sf [T, Hd/128]`` as their uint8 bytes ``[T, Hd/32]``: the stage stores one byte
    per 32-group through them."""
    if x_sf.stride(1) != 1:  # one column (Hd = 128): its stride is never used, but view() requires 1
        x_sf = x_sf.as_strided(x_sf.shape, (x_sf.stride(0), 1))
    return x_sf.view(torch.uint8)


def _stage(hidden, ids, weights, x_fp8, x_sf, ids_out, weights_out, block_t, block_h, num_warps, topk_first):
    T, Hd = hidden.shape
    K = ids.shape[1]
    const = stage_constexprs(Hd, K, block_t, block_h, topk_first)
    wv, wov = weights.view(torch.int32), weights_out.view(torch.int32)
    xv = hidden.view(torch.int16)
    sf = scale_bytes(x_sf)
    grid = (triton.cdiv(T, block_t), triton.cdiv(Hd, const["BLOCK_H"]))
    stage_kernel[grid](
        xv,
        x_fp8.view(torch.uint8),
        sf,
        ids,
        wv,
        ids_out,
        wov,
        T,
        Hd,
        K,
        xv.stride(0),
        xv.stride(1),
        x_fp8.stride(0),
        sf.stride(0),
        ids.stride(0),
        ids.stride(1),
        wv.stride(0),
        wv.stride(1),
        ids_out.stride(0),
        wov.stride(0),
        **const,
        num_warps=num_warps,
    )


@torch.library.custom_op("dsv4ref::moe_stage", mutates_args=("x_fp8", "x_sf", "ids_out", "weights_out"))
def moe_stage_op(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    x_fp8: torch.Tensor,
    x_sf: torch.Tensor,
    ids_out: torch.Tensor,
    weights_out: torch.Tensor,
    stage_block_t: int,
    stage_block_h: int,
    stage_warps: int,
    stage_topk_first: bool,
) -> None:
    """Rows [0, T) of the four output buffers (which may have more rows: those stay as they are). ``x_fp8``
    is passed as its uint8 bytes (torch has no arithmetic on fp8 tensors, which op checks need); the launch's
    ``stage_*`` fields follow the buffers (``*launch.op_args("moe_stage")``)."""
    launch = MoeLaunch.from_op_args(stage_block_t, stage_block_h, stage_warps, stage_topk_first, op="moe_stage")
    if hidden.shape[0]:
        _stage(
            hidden,
            ids,
            weights,
            x_fp8,
            x_sf,
            ids_out,
            weights_out,
            launch.stage_block_t,
            launch.stage_block_h,
            launch.stage_warps,
            launch.stage_topk_first,
        )


@moe_stage_op.register_fake
def _(hidden, ids, weights, x_fp8, x_sf, ids_out, weights_out, *launch):
    return None


# ----------------------------------------------------------------------------------------------------
# experts + combine
# ----------------------------------------------------------------------------------------------------


def _mlp(x, xq, xsf, order, counts, offsets, omega, w13, w2, o, K, fp8_in, limit, launch):
    """gate_up_kernel then down_kernel over the slots in ``order`` (grouped by expert); writes o[slot].
    Block sizes larger than the problem are cut down to it (a power of two; ``block_h`` to a divisor of Hd)."""
    E, I2, Hd = w13.shape
    I, n_rows = I2 // 2, order.shape[0]
    if E == 0 or n_rows == 0:  # no expert or no slot: nothing to compute (and no empty grid to launch)
        return
    te, r0, r1 = tile_table(counts, offsets, launch.block_m, n_rows)
    h = torch.empty(n_rows, I, dtype=torch.bfloat16, device=w13.device)  # workspace, rows in `order`'s order
    dot_fp32 = interpreting()
    xb = x.view(torch.int16)
    bh = math.gcd(launch.block_h, Hd)  # powers of two times 128 that divide Hd
    bn_i = max(16, min(launch.block_n, triton.next_power_of_2(I)))
    gate_up_kernel[(te.shape[0], triton.cdiv(I, bn_i))](
        xb,
        xq,
        xsf,
        order,
        omega,
        te,
        r0,
        r1,
        w13,
        h.view(torch.int16),
        Hd,
        I,
        K,
        E,
        limit,
        xb.stride(0),
        xb.stride(1),
        xq.stride(0),
        xsf.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        BLOCK_M=launch.block_m,
        BLOCK_N=bn_i,
        BLOCK_H=bh,
        FP8_IN=fp8_in,
        APPLY_W=fp8_in,
        DOT_FP32=dot_fp32,  # routed slots carry ω, the shared expert does not
        num_warps=launch.expert_warps,
        num_stages=launch.expert_stages,
    )
    bn_h = min(launch.block_n, triton.next_power_of_2(Hd))
    bk = max(16, min(launch.block_k, triton.next_power_of_2(I)))
    down_kernel[(te.shape[0], triton.cdiv(Hd, bn_h))](
        h,
        order,
        te,
        r0,
        r1,
        w2,
        o.view(torch.int16),
        Hd,
        I,
        E,
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        o.stride(0),
        BLOCK_M=launch.block_m,
        BLOCK_N=bn_h,
        BLOCK_K=bk,
        DOT_FP32=dot_fp32,
        num_warps=launch.expert_warps,
        num_stages=launch.expert_stages,
    )


def _experts(x, x_fp8, x_sf, ids, weights, w13, w2, shared_w13, shared_w2, out, swiglu_limit, launch):
    T, K = ids.shape
    Hd = x.shape[1]
    limit = swiglu_limit if swiglu_limit > 0 else float("inf")
    ids64 = ids.to(torch.int64).contiguous()
    omega = weights.contiguous().view(-1)
    xq = x_fp8.view(torch.uint8)
    o = torch.empty(T * K, Hd, dtype=torch.bfloat16, device=x.device)  # one row per slot; −1 rows never read
    order, counts, offsets = group_by_expert(ids64, w13.shape[0])
    _mlp(x, xq, x_sf, order, counts, offsets, omega, w13, w2, o, K, True, limit, launch)
    shared = None
    if shared_w13 is not None:  # the shared expert: one "expert" that every token uses with ω = 1, on bf16 x
        shared = torch.empty(T, Hd, dtype=torch.bfloat16, device=x.device)
        tokens = torch.arange(T, device=x.device)
        both = torch.arange(0, 2 * T, T, device=x.device)  # [0, T] made on the device (torch.tensor would copy from the host)
        _mlp(x, xq, x_sf, tokens, both[1:], both, omega, shared_w13[None], shared_w2[None], shared, 1, False, limit, launch)
    ov = out.view(torch.int16)
    bh = min(launch.combine_block_h, triton.next_power_of_2(Hd))
    combine_kernel[(triton.cdiv(T, launch.combine_block_t), triton.cdiv(Hd, bh))](
        o.view(torch.int16),
        ids64,
        (shared if shared is not None else o).view(torch.int16),
        ov,
        T,
        Hd,
        K,
        w13.shape[0],
        o.stride(0),
        ov.stride(0),
        HAS_SHARED=shared is not None,
        BLOCK_T=launch.combine_block_t,
        BLOCK_H=bh,
        num_warps=launch.combine_warps,
    )


@torch.library.custom_op("dsv4ref::moe_experts", mutates_args=("out",))
def moe_experts_op(
    x: torch.Tensor,
    x_fp8: torch.Tensor,
    x_sf: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_w13: torch.Tensor | None,
    shared_w2: torch.Tensor | None,
    out: torch.Tensor,
    swiglu_limit: float,
    block_m: int,
    block_n: int,
    block_h: int,
    block_k: int,
    expert_warps: int,
    expert_stages: int,
    combine_block_t: int,
    combine_block_h: int,
    combine_warps: int,
) -> None:
    """Routed experts on the staged activations + the shared expert on x, combined in fp32, into ``out``.
    ``x_fp8`` is passed as its uint8 bytes; the launch's expert and combine fields follow ``swiglu_limit``
    (``*launch.op_args("moe_experts")``)."""
    launch = MoeLaunch.from_op_args(
        block_m,
        block_n,
        block_h,
        block_k,
        expert_warps,
        expert_stages,
        combine_block_t,
        combine_block_h,
        combine_warps,
        op="moe_experts",
    )
    if ids.shape[0]:
        _experts(x, x_fp8, x_sf, ids, weights, w13, w2, shared_w13, shared_w2, out, swiglu_limit, launch)


@moe_experts_op.register_fake
def _(x, x_fp8, x_sf, ids, weights, w13, w2, shared_w13, shared_w2, out, swiglu_limit, *launch):
    return None
