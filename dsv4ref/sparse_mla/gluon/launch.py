"""How the Hopper Gluon kernels are launched: :class:`GluonLaunch`, the launcher and the custom op.

Plain Python and torch (no Gluon import): the kernels come from :func:`kernels` when a launch runs (the
kernel modules import only :mod:`.lang` and :mod:`.common`, never this module or the package), so this module,
and with it :class:`GluonLaunch` and :func:`default_launch`, import on any machine.

* :class:`GluonLaunch`: every launch choice (which kernel, how many list splits), passed as ``launch=``;
  :func:`default_launch` is the measured default (:func:`launch_for_sms` gives it for any SM count, e.g.
  the H200's 132, on any machine).
* :func:`decode_gluon`: the launcher, on already-validated tensors (no host sync: graph-capturable).
* :data:`sparse_mla_decode_gluon_op` (``dsv4ref::sparse_mla_decode_gluon``): the custom op (with a fake)
  whose schema carries the launch; :func:`decode_op` calls it with the launch resolved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...device import interpreting, sm_count
from ...formats import HEAD_DIM
from ...op_launch import OpLaunch
from ...validate import power_of_two
from ..launch import NO_EXTRA_POOL

LOG2E = 1.4426950408889634
BLOCK_H = 64  # heads per program of the 64-row kernels (wgmma M = 64 per warpgroup); fewer are masked rows
NARROW_H = 16  # heads per program of the narrow kernel (its wgmma N)
BLOCK_N = 64  # candidates per chunk, every kernel
PLAIN_WARPS = 8  # the plain kernel: two warpgroups splitting every MMA by columns
# The warp-specialised kernels' rings and register budgets (setmaxnreg per 4-warp partition, 512 per thread
# slot in all), each the fastest measured on the H200 with every check passing (benchmarks/sparse_mla.md):
WS_STAGES = 2  # K stages of the 64-row kernel: Q 64 KB + 2 × 64 KB + P 16 KB ≈ 215 KB of shared memory
WS_PRODUCER_REGS = 104  # its producer warpgroup (the scorer gets the rest: 248)
WS_PV_REGS = 160  # its P·V warpgroup (a 64 × 256 fp32 accumulator: 128 registers)
NARROW_STAGES = 3  # K stages of the narrow kernel: Q [16, 512] + 3 × 64 KB + Pᵀ ≈ 215 KB
NARROW_REGS = 184  # each of its two producer warpgroups
KERNELS = ("ws", "narrow", "plain")

__all__ = [
    "GluonLaunch",
    "default_launch",
    "launch_for_sms",
    "decode_gluon",
    "decode_op",
    "sparse_mla_decode_gluon_op",
    "kernels",
    "import_error",
    "KERNELS",
    "BLOCK_H",
    "NARROW_H",
    "BLOCK_N",
]


@dataclass(frozen=True)
class GluonLaunch(OpLaunch):
    """Launch choices of the Hopper Gluon kernels (fixed meta-parameters, no autotuning).

    Attributes:
        kernel: ``"ws"``, the 64-row warp-specialised kernel (the default for H > 16;
            :mod:`~dsv4ref.sparse_mla.gluon.ws_kernel`); ``"narrow"``, the narrow-head one (the default for
            H ≤ 16, and only for H ≤ :data:`NARROW_H`; :mod:`~dsv4ref.sparse_mla.gluon.narrow_kernel`); or
            ``"plain"``, the kernel without warp specialisation (rung "a" of notebook 04's ladder;
            :mod:`~dsv4ref.sparse_mla.gluon.plain_kernel`).
        num_splits: programs that share one token's candidate list (flash-decoding), a power of two; > 1
            adds the fp32 partials and the merge kernel.
    """

    kernel: str = "ws"
    num_splits: int = 1

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {KERNELS}, got {self.kernel!r}")
        power_of_two(self.num_splits, "num_splits")

    @property
    def block_h(self) -> int:
        """Heads per program: :data:`NARROW_H` for the narrow kernel, else :data:`BLOCK_H`."""
        return NARROW_H if self.kernel == "narrow" else BLOCK_H

    # the custom op takes every field (op_args(), from_op_args(): dsv4ref.op_launch)
    OP_FIELDS = {"sparse_mla_decode_gluon": None}


def default_launch(T: int, H: int, K_total: int, device) -> GluonLaunch:
    """The measured default for T tokens, H heads and K_total candidates per token (both pools) on
    ``device``: :func:`launch_for_sms` with the device's SM count."""
    return launch_for_sms(T, H, K_total, sm_count(device))


def launch_for_sms(T: int, H: int, K_total: int, sms: int) -> GluonLaunch:
    """The default launch on a device with ``sms`` streaming multiprocessors (the H200 has 132), so a reader
    on any machine can see what a GPU runs: the narrow kernel for H ≤ :data:`NARROW_H`, else the 64-row one.

    One program per (token, 64-head block) holds ~215 KB of shared memory, so one runs per SM (the narrow
    kernel's too); the list is split (flash-decoding) while T × head blocks × 2S ≤ 1.125 × the SM count and
    every split keeps ≥ 4 chunks. The split count is the same for both kernels: at H ≤ 16 a 64-head block
    is one block."""
    n_hb = -(-H // BLOCK_H)
    num_splits = 1
    while T * n_hb * num_splits * 2 <= sms + sms // 8 and K_total // (num_splits * 2) >= 4 * BLOCK_N:
        num_splits *= 2
    return GluonLaunch("narrow" if H <= NARROW_H else "ws", num_splits)


_K: dict = {}  # the kernels by name once imported; {"error": e} where they cannot be


def kernels() -> dict | None:
    """The kernels by name ("plain", "ws", "narrow", "merge"), imported on first use; None where Gluon is
    missing or its API does not fit these kernels (the reason: :func:`import_error`)."""
    from . import lang

    if not _K:
        if lang._gluon is None:
            _K["error"] = lang.IMPORT_ERROR
        else:
            try:
                from .common import _merge_kernel
                from .narrow_kernel import _narrow_kernel
                from .plain_kernel import _decode_kernel
                from .ws_kernel import _ws_kernel

                _K.update(plain=_decode_kernel, ws=_ws_kernel, narrow=_narrow_kernel, merge=_merge_kernel)
            except Exception as e:  # an incompatible Gluon API
                _K["error"] = e
    return None if "error" in _K else _K


def import_error() -> BaseException | None:
    """Why :func:`kernels` is None here (None where they import)."""
    kernels()
    return _K.get("error")


def _aligned(cache: torch.Tensor) -> bool:
    return cache.data_ptr() % 16 == 0 and cache.stride(0) % 16 == 0 and cache.stride(1) == 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kernel_constexprs(kernel: str) -> dict:
    """What each kernel is launched with besides the shape's constexprs: its ring and register budgets, and
    num_warps (the default partition's warps for the warp-specialised ones). The launcher and
    ``benchmarks/gluon_compile_check.py`` share this."""
    if kernel == "narrow":
        return dict(NS=NARROW_STAGES, PRODUCER_REGS=NARROW_REGS, num_warps=4)
    if kernel == "ws":
        return dict(NS=WS_STAGES, PRODUCER_REGS=WS_PRODUCER_REGS, PV_REGS=WS_PV_REGS, num_warps=4)
    return dict(num_warps=PLAIN_WARPS)


_LAST: dict = {}  # the last compiled decode kernel (diagnostics: n_regs, n_spills, shared)


def decode_gluon(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor | None,
    *,
    block_size: int,
    sink: torch.Tensor | None = None,
    scale: float = HEAD_DIM**-0.5,
    extra_cache: torch.Tensor | None = None,
    extra_slots: torch.Tensor | None = None,
    extra_lengths: torch.Tensor | None = None,
    extra_block_size: int | None = None,
    launch: GluonLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode on Hopper: same arguments and results as :func:`dsv4ref.sparse_mla.decode`
    (already-validated inputs; no value checks and no host sync here, so it can be graph-captured).

    q ``[T, H, 512]`` bf16 (H <= 128); cache uint8 pages of ``block_size`` tokens; slots ``[T, K]`` int32
    (−1 = no entry, rows contiguous); lengths ``[T]`` int32 or None (all K); sink ``[H]`` fp32 or None;
    the optional extra pool likewise. Returns out ``[T, H, 512]`` bf16, lse ``[T, H]`` fp32 (natural log,
    without the sink; −inf for empty rows). ``launch``: the :class:`GluonLaunch`; None =
    :func:`default_launch` for this shape."""
    kern = kernels()
    if kern is None or interpreting():
        raise RuntimeError(f"the gluon backend needs compiled Triton with Gluon on a Hopper GPU ({import_error()!r})")
    if launch is not None and not isinstance(launch, GluonLaunch):
        raise TypeError(f"launch: expected a GluonLaunch or None, got {type(launch).__name__}")
    T, H, D = q.shape
    if D != HEAD_DIM or H > 128 or q.stride(2) != 1:
        raise ValueError(f"q: expected [T, H <= 128, {HEAD_DIM}] with a contiguous last dim, got {tuple(q.shape)}")
    for x, name in ((slots, "slots"), (extra_slots, "extra_slots")):
        if x is not None and x.shape[1] and x.stride(1) != 1:
            raise ValueError(f"{name}: rows must be contiguous (strides {x.stride()})")
    for c, name in ((cache, "cache"), (extra_cache, "extra_cache")):
        if c is not None and not _aligned(c):
            raise ValueError(f"{name}: the gluon backend needs 16-byte aligned pages (data_ptr and stride(0) % 16 == 0)")
    out = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return out, lse
    has_pool2 = extra_cache is not None
    K1 = slots.shape[1]
    K2 = extra_slots.shape[1] if has_pool2 else 0
    if launch is None:
        launch = default_launch(T, H, K1 + K2, q.device)
    if launch.kernel == "narrow" and H > NARROW_H:
        raise ValueError(f"launch: the narrow kernel takes H <= {NARROW_H} heads, got {H}")
    S = launch.num_splits
    chunk = _cdiv(_cdiv(K1 + K2, S), BLOCK_N) * BLOCK_N or BLOCK_N

    def views(c):
        return c, c.view(torch.int16), c.view(torch.int64)

    c1 = views(cache)
    c2 = views(extra_cache) if has_pool2 else c1
    l1 = lengths if lengths is not None else slots
    i2 = extra_slots if has_pool2 else slots
    l2 = extra_lengths if (has_pool2 and extra_lengths is not None) else i2
    bs2 = extra_block_size if has_pool2 else block_size
    if S > 1:
        po = torch.empty(T, S, H, HEAD_DIM, dtype=torch.float32, device=q.device)
        pml = torch.empty(T, S, H, 2, dtype=torch.float32, device=q.device)
    else:
        po = pml = lse  # unused
    sink_arg = sink if sink is not None else lse
    bh = launch.block_h
    grid = (T, -(-H // bh), S)
    # the same runtime arguments for every kernel (the byte views c1_u8 / c1_i16 are the plain kernel's)
    args = (
        q,
        q.stride(0),
        q.stride(1),
        sink_arg,
        out,
        lse,
        po,
        pml,
        *c1,
        slots,
        l1,
        K1,
        slots.stride(0),
        block_size,
        cache.stride(0),
        *c2,
        i2,
        l2,
        K2,
        i2.stride(0),
        bs2,
        (extra_cache if has_pool2 else cache).stride(0),
        H,
        float(scale) * LOG2E,
        chunk,
    )
    common = dict(
        HAS_LEN1=lengths is not None,
        HAS_POOL2=has_pool2,
        HAS_LEN2=has_pool2 and extra_lengths is not None,
        HAS_SINK=sink is not None,
        SPLITS=S,
        BH=bh,
        BN=BLOCK_N,
    )
    _LAST["decode"] = kern[launch.kernel][grid](*args, **common, **kernel_constexprs(launch.kernel))
    if S > 1:
        kern["merge"][(T, H)](po, pml, sink_arg, out, lse, H, HAS_SINK=sink is not None, SPLITS=S, num_warps=4)
    return out, lse


# ---- registered as a torch custom op (with a fake), like every other dsv4ref kernel ----------------------


@torch.library.custom_op("dsv4ref::sparse_mla_decode_gluon", mutates_args=())
def sparse_mla_decode_gluon_op(
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
    kernel: str,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return decode_gluon(
        q,
        cache,
        slots,
        lengths,
        block_size=block_size,
        sink=sink,
        scale=scale,
        extra_cache=extra_cache,
        extra_slots=extra_slots,
        extra_lengths=extra_lengths,
        extra_block_size=extra_block_size if extra_cache is not None else None,
        launch=GluonLaunch.from_op_args(kernel, num_splits),
    )


@sparse_mla_decode_gluon_op.register_fake
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
    kernel,
    num_splits,
):
    T, H, D = q.shape
    return q.new_empty(T, H, D), q.new_empty(T, H, dtype=torch.float32)


def decode_op(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor | None,
    extra_cache: torch.Tensor | None,
    extra_slots: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
    sink: torch.Tensor | None,
    block_size: int,
    extra_block_size: int | None,
    scale: float,
    launch: GluonLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`sparse_mla_decode_gluon_op` (what ``sparse_mla.decode`` runs for the gluon backend) with ``launch``
    resolved: None = :func:`default_launch` for q's shape and both pools' candidates. ``extra_block_size``
    None (no second pool) travels as :data:`~dsv4ref.sparse_mla.launch.NO_EXTRA_POOL`, as in the fused path."""
    if launch is not None and not isinstance(launch, GluonLaunch):
        raise TypeError(f"launch: expected a GluonLaunch or None, got {type(launch).__name__}")
    if launch is None:
        T, H, _ = q.shape
        launch = default_launch(T, H, slots.shape[1] + (extra_slots.shape[1] if extra_cache is not None else 0), q.device)
    return sparse_mla_decode_gluon_op(
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
