"""How much shared memory a compiled mHC launch asks for, estimated on a CPU from its tiles, dtypes and stages.

The interpreter never compiles, so a launch whose tiles cannot fit a Hopper program's shared memory passes every
CPU test and fails on the GPU with ``OutOfResources``. ``tests/test_mhc.py`` holds every launch notebook 03 and
the GPU tests make to :data:`HOPPER_SMEM_PER_PROGRAM` through :func:`mhc_smem`.

**The model.** Triton's software pipeliner copies each tile a K loop loads (``tl.load`` of a [rows, cols] bf16 /
int16 tile, 2 bytes an element) into a shared-memory ring, ``num_stages − 1`` copies of every tile in flight;
a kernel whose dot takes its B operand (the fn tile) straight from shared memory keeps one more copy of it (the
operand the wgmma is reading while the next copies land). So, per program,

    smem = (num_stages − 1) · Σ tiles + B,

Σ tiles the bytes of every tile one K step loads, B the fn tile(s). Checked against the sm_90a compiles of
``benchmarks/experiments/mhc/compile_check.py`` (``triton.compile(...).metadata.shared``, Triton 3.9 on a CPU; the
two figures the GPU's Triton 3.6 reported below are the same bytes), exact for every case compiled:

* chunked partial kernel: layouts 0 (four streams per dot), 2 and 3, 128- and 64-token tiles, 2 / 3 / 4 stages,
  pre and head: 16 compiles, among them the two the GPU refused, four streams per dot at ``ChunkedLaunch.block_k`` 64,
  4 stages: 458 752 bytes (pre, 128-token tiles: 3 · (64 KB stream tile + 64 KB fn tile) + 64 KB) and 360 448
  (pre, 64-token tiles of a short call: 3 · (32 KB + 64 KB) + 64 KB);
* one-pass kernel at its GPU defaults: pre 81 920, fused 126 976 (the x tile too), head 57 344;
* one kernel (``hc_kernel``), whose fn tiles are 24 narrow ones: no extra B copy (pre 57 344, fused 59 392,
  head 32 768 at 2 stages).

The split-K partial kernel does not fit the formula (it compiled to 135 168 / 143 360 / 86 016 bytes, pre /
fused / head, at its GPU defaults); for it :func:`mhc_smem` gives the upper bound ``num_stages · Σ tiles``
(163 840 / 180 224 / 114 688 there). Kernels without a dot (finish, post, Sinkhorn) hold only a layout
conversion's scratch, a few KB, and are not counted.
"""

from __future__ import annotations

from ..mhc.launch import ChunkedLaunch, MhcLaunch, OneKernelLaunch, OnePassLaunch
from ..mhc.ops import one_pass_args

# Hopper (H100, H200): the most shared memory one program may ask for (227 KB: 228 KB a multiprocessor, less the
# 1 KB the driver reserves per program)
HOPPER_SMEM_PER_PROGRAM = 232_448

__all__ = ["HOPPER_SMEM_PER_PROGRAM", "mhc_smem"]

_BF16 = 2  # bytes a value: the streams and x (bf16 or their int16 bits) and the fn split, all two bytes


def _ring(stages: int, tiles: int, b: int) -> int:
    return (stages - 1) * tiles + b


def mhc_smem(launch: MhcLaunch, op: str, T: int | None = None) -> int:
    """Estimated shared-memory bytes of the kernel with a dot that ``op`` ("pre", "fused" or "head") runs under
    ``launch`` for a call of ``T`` tokens (None: a long call; the chunked design takes smaller tiles at most
    ``small_t`` tokens). The model and what it was checked against: the module's docstring. ``launch``
    should carry the GPU's defaults (``ChunkedLaunch.for_device(interpreted=False, ...)``, say)."""
    head, fused = op == "head", op == "fused"
    ng = 16 if head else 32  # fn columns of one bf16 part: gate group (+ comb group)
    if isinstance(launch, ChunkedLaunch):  # the partial kernel (the fused op: pre's, on the new streams)
        bt, bk, _warps, stages, _ = launch.tile(T)
        if launch.stream_k:  # one stream's bk dims per step
            a = bt * bk * _BF16
            b = bk * (3 if launch.fn_layout == 3 else 4) * ng * _BF16
        else:  # the 4 streams' bk dims per step, one dot of N = 4·NG
            a = bt * 4 * bk * _BF16
            b = 4 * bk * 4 * ng * _BF16
        return _ring(stages, a + b, b)
    if isinstance(launch, OnePassLaunch):
        _grid, consts, opts, _sizes, _plan = one_pass_args(launch, 4096, 4096, head, fused)
        bt, bk = consts["BLOCK_T"], consts["BLOCK_K"]
        a = (5 if fused else 4) * bt * bk * _BF16  # the 4 streams' chunk (fused: and x)
        b = 4 * bk * 4 * ng * _BF16
        return _ring(opts["num_stages"], a + b, b)
    if isinstance(launch, OneKernelLaunch):  # per stream 3 (head) or 6 narrow [BLOCK_K, 16] fn tiles
        bt, bk, stages = launch.block_t, launch.block_k, launch.stages
        tiles = (5 if fused else 4) * bt * bk * _BF16 + 4 * (3 if head else 6) * bk * 16 * _BF16
        return _ring(max(stages, 2), tiles, 0)
    # split-K's partial kernel: an upper bound (the module's docstring)
    bt, bk = launch.block_t, launch.block_k
    tiles = (5 if fused else 4) * bt * bk * _BF16 + 4 * 3 * bk * ng * _BF16
    return max(launch.stages, 1) * tiles
