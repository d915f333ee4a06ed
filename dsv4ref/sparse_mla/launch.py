"""How :mod:`dsv4ref.sparse_mla` launches its kernels: the launch shape, the launcher, the custom ops.

* :class:`SparseMlaLaunch`: every launch choice (head block, candidate chunk, list splits, warps, stages),
  passed explicitly as ``launch=``; :func:`default_launch` is the measured default (:func:`launch_for_sms`
  gives it for any SM count, e.g. the H200's 132, on any machine).
* :func:`attend`: runs :func:`~dsv4ref.sparse_mla.kernels.decode_kernel` (and the merge when split) on
  already-validated tensors, over FP8 pages (the fused path) or bf16 workspaces (the two-pass path).
* Two ``torch.library`` custom ops with fakes, whose schemas carry every launch choice:
  :data:`sparse_mla_decode_op` (``dsv4ref::sparse_mla_decode``, fused) and :data:`sparse_mla_attend_bf16_op`
  (``dsv4ref::sparse_mla_attend_bf16``, two-pass, pass 2); callers call these objects.
* :func:`fused_decode`: the fused backend without validation or host syncs (graph-capturable).
* :func:`workspace`: the two-pass path's reusable bf16 workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..device import interpreting, sm_count
from ..formats import HEAD_DIM
from ..op_launch import OpLaunch
from ..validate import integer, power_of_two
from .kernels import decode_kernel, merge_kernel

LOG2E = 1.4426950408889634
# Heads per merge program: the fastest measured on the H200 (benchmarks/sparse_mla.md, "Heads per merge
# program"); more heads per program leave too few programs for the SMs at H = 16.
MERGE_BLOCK_H = 2

__all__ = [
    "SparseMlaLaunch",
    "default_launch",
    "launch_for_sms",
    "resolve",
    "attend",
    "fused_decode",
    "workspace",
    "sparse_mla_decode_op",
    "sparse_mla_attend_bf16_op",
    "NO_EXTRA_POOL",
    "MERGE_BLOCK_H",
]

# What the custom ops' ``extra_block_size`` holds when there is no second pool (no block size is 0).
NO_EXTRA_POOL = 0


@dataclass(frozen=True)
class SparseMlaLaunch(OpLaunch):
    """Launch shape of the sparse MLA kernels (fixed meta-parameters, no autotuning).

    Attributes:
        block_h: heads per program, a power of two ≥ 16; H is padded up to a multiple with masked rows.
        block_n: candidates per chunk of the loop, a power of two ≥ 16.
        num_splits: programs that share one token's candidate list (flash-decoding), a power of two;
            > 1 adds the split scratch and :func:`~dsv4ref.sparse_mla.kernels.merge_kernel`.
        num_warps: Triton warps per program (a power of two).
        num_stages: software-pipelining depth of the candidate loop (≥ 1).
    """

    block_h: int
    block_n: int
    num_splits: int = 1
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_h", "block_n"):
            if power_of_two(getattr(self, name), name) < 16:
                raise ValueError(f"{name}: expected a power of two >= 16, got {getattr(self, name)}")
        power_of_two(self.num_splits, "num_splits")
        power_of_two(self.num_warps, "num_warps")
        integer(self.num_stages, "num_stages", lo=1)

    # both custom ops take every field (op_args(), from_op_args(): dsv4ref.op_launch)
    OP_FIELDS = {"sparse_mla_decode": None, "sparse_mla_attend_bf16": None}


def default_launch(T: int, H: int, K_total: int, device: torch.device) -> SparseMlaLaunch:
    """The measured default for T tokens, H heads and K_total candidates per token (both pools) on
    ``device``: :func:`launch_for_sms` with the device's SM count (compiled) or the interpreter's shapes."""
    return launch_for_sms(T, H, K_total, sm_count(device), interpreted=interpreting())


def launch_for_sms(T: int, H: int, K_total: int, sm_count: int, *, interpreted: bool = False) -> SparseMlaLaunch:
    """The default launch on a device with ``sm_count`` streaming multiprocessors (the H200 has 132), so a
    reader on any machine can see what a GPU runs.

    Tuned on the H200 at T = 64 (``benchmarks/sparse_mla.md``): heads in blocks of 16, 32 or 64 (H = 128:
    two blocks of 64); 32-candidate chunks with 16-head blocks, 64 otherwise (16 in the interpreter). The
    list is split only while T · head blocks would leave most SMs idle (target: two programs per SM for
    16-head blocks, one for 64-head blocks, whose partial states are 64·512 fp32) and each split keeps
    ≥ 256 candidates. ``interpreted``: Triton's CPU interpreter (16-candidate chunks, no split, 1 stage)."""
    block_h = 16 if H <= 16 else (32 if H <= 32 else 64)
    block_n = 16 if interpreted else (32 if block_h <= 16 else 64)
    num_splits = 1
    if not interpreted:
        target = 2 * sm_count if block_h <= 16 else sm_count
        n_hb = triton.cdiv(H, block_h)
        while T * n_hb * num_splits * 2 <= target and K_total // (num_splits * 2) >= 256 and num_splits < 16:
            num_splits *= 2
    return SparseMlaLaunch(block_h, block_n, num_splits, num_warps=4 if block_h <= 16 else 8, num_stages=1 if interpreted else 2)


def _even_pages(cache: torch.Tensor) -> bool:
    """Every page starts at an even byte address (the RoPE bf16 values can be read as int16 words)."""
    return cache.data_ptr() % 2 == 0 and cache.stride(0) % 2 == 0


def attend(q, pools, sink, scale, launch: SparseMlaLaunch, *, kv_bf16: bool, out=None, lse=None):
    """Run the attention kernel (and the merge when split) on validated tensors.

    Args:
        q: ``[T, H, 512]`` bf16, last dim contiguous.
        pools: one or two ``(kv, slots [T, K], lengths [T] | None, block_size, page_stride)``: kv is the
            uint8 pages (``kv_bf16=False``) or a bf16 workspace ``[T·K, 512]`` whose row t·K + j holds entry
            (t, j) (``kv_bf16=True``; block_size and page_stride unused).
        sink: ``[H]`` fp32 or None. scale: the softmax scale.
        out, lse: optional ``[T, H, 512]`` bf16 / ``[T, H]`` fp32 contiguous buffers to write.
    Returns:
        ``(out, lse)``.
    """
    T, H, _ = q.shape
    out = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16, device=q.device) if out is None else out
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device) if lse is None else lse
    if T == 0 or H == 0:
        return out, lse
    S, BH, BN = launch.num_splits, launch.block_h, launch.block_n

    def args(p):
        kv, slots, lens, bs, ps = p
        K = slots.shape[1]
        chunk = max(BN, triton.cdiv(triton.cdiv(K, S), BN) * BN)  # entries per split, a multiple of BN
        return [kv, slots, lens if lens is not None else slots, K, slots.stride(0), bs, ps, chunk], lens is not None

    a1, has_len1 = args(pools[0])
    has_pool2 = len(pools) > 1
    a2, has_len2 = args(pools[1]) if has_pool2 else (a1, False)
    if S > 1:  # the split scratch (format: kernels module docstring)
        part_o = torch.empty(T, S, H, HEAD_DIM, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(T, S, H, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = lse  # unused
    out16 = out.view(torch.int16)
    sink_arg = sink if sink is not None else lse  # unused without a sink
    decode_kernel[(T, triton.cdiv(H, BH), S)](
        q,
        q.stride(0),
        q.stride(1),
        sink_arg,
        out16,
        lse,
        part_o,
        part_ml,
        *a1,
        *a2,
        H,
        float(scale) * LOG2E,
        HAS_LEN1=has_len1,
        HAS_POOL2=has_pool2,
        HAS_LEN2=has_len2,
        HAS_SINK=sink is not None,
        KV_BF16=kv_bf16,
        SPLITS=S,
        BLOCK_H=BH,
        BLOCK_N=BN,
        DOT_FP32=interpreting(),
        ROPE16=kv_bf16 or all(_even_pages(p[0]) for p in pools),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if S > 1:
        merge_kernel[(T, triton.cdiv(H, MERGE_BLOCK_H))](
            part_o, part_ml, sink_arg, out16, lse, H, HAS_SINK=sink is not None, SPLITS=S, BLOCK_H=MERGE_BLOCK_H, num_warps=4
        )
    return out, lse


# ----------------------------------------------------------------------------------------------------
# torch custom ops: the schema carries every launch choice
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("dsv4ref::sparse_mla_decode", mutates_args=())
def sparse_mla_decode_op(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor | None,
    extra_cache: torch.Tensor | None,
    extra_slots: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
    sink: torch.Tensor | None,
    block_size: int,
    extra_block_size: int,
    scale: float,
    block_h: int,
    block_n: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    pools = [(cache, slots, lengths, block_size, cache.stride(0))]
    if extra_cache is not None:
        pools.append((extra_cache, extra_slots, extra_lengths, extra_block_size, extra_cache.stride(0)))
    launch = SparseMlaLaunch.from_op_args(block_h, block_n, num_splits, num_warps, num_stages)
    return attend(q, pools, sink, scale, launch, kv_bf16=False)


@sparse_mla_decode_op.register_fake
def _(
    q,
    cache,
    slots,
    lengths,
    extra_cache,
    extra_slots,
    extra_lengths,
    sink,
    block_size,
    extra_block_size,
    scale,
    block_h,
    block_n,
    num_splits,
    num_warps,
    num_stages,
):
    T, H, D = q.shape
    return q.new_empty(T, H, D), q.new_empty(T, H, dtype=torch.float32)


@torch.library.custom_op("dsv4ref::sparse_mla_attend_bf16", mutates_args=())
def sparse_mla_attend_bf16_op(
    q: torch.Tensor,
    ws1: torch.Tensor,
    table1: torch.Tensor,
    ws2: torch.Tensor | None,
    table2: torch.Tensor | None,
    sink: torch.Tensor | None,
    scale: float,
    block_h: int,
    block_n: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    pools = [(ws1, table1, None, 1, 0)]
    if ws2 is not None:
        pools.append((ws2, table2, None, 1, 0))
    launch = SparseMlaLaunch.from_op_args(block_h, block_n, num_splits, num_warps, num_stages)
    return attend(q, pools, sink, scale, launch, kv_bf16=True)


@sparse_mla_attend_bf16_op.register_fake
def _(q, ws1, table1, ws2, table2, sink, scale, block_h, block_n, num_splits, num_warps, num_stages):
    T, H, D = q.shape
    return q.new_empty(T, H, D), q.new_empty(T, H, dtype=torch.float32)


def resolve(launch: SparseMlaLaunch | None, q: torch.Tensor, *slot_tables: torch.Tensor | None) -> SparseMlaLaunch:
    """``launch``, or the measured default for q's shape and the total candidates of ``slot_tables``."""
    if launch is not None:
        return launch
    T, H, _ = q.shape
    return default_launch(T, H, sum(s.shape[1] for s in slot_tables if s is not None), q.device)


def fused_decode(
    q,
    cache,
    slots,
    lengths,
    *,
    block_size,
    sink=None,
    scale,
    extra_cache=None,
    extra_slots=None,
    extra_lengths=None,
    extra_block_size=None,
    launch: SparseMlaLaunch | None = None,
):
    """The fused backend (``backend="triton"``) of :func:`dsv4ref.sparse_mla.decode`, without validation and
    without host syncs (a device graph can capture it). Same arguments; ``launch`` None = :func:`default_launch`."""
    launch = resolve(launch, q, slots, extra_slots)
    return sparse_mla_decode_op(
        q,
        cache,
        slots,
        lengths,
        extra_cache,
        extra_slots,
        extra_lengths,
        sink,
        block_size,
        extra_block_size or NO_EXTRA_POOL,
        float(scale),
        *launch.op_args(),
    )


_WORKSPACE: dict[str, torch.Tensor] = {}


def workspace(rows: int, device: torch.device) -> torch.Tensor:
    """The two-pass path's bf16 ``[rows, 512]`` workspace on ``device``: one grow-only buffer per device,
    reused across calls (a view of its first ``rows`` rows). Not safe for concurrent use from several
    streams. Sizing it once for the largest shape before capturing device graphs keeps every graph's
    pointer valid."""
    key = str(device)
    ws = _WORKSPACE.get(key)
    if ws is None or ws.shape[0] < rows:
        ws = torch.empty(max(rows, 1), HEAD_DIM, dtype=torch.bfloat16, device=device)
        _WORKSPACE[key] = ws
    return ws[:rows]
