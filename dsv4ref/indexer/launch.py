"""Launching the indexer kernels: the launch choices (:class:`IndexerLaunch`), the grids, and the
fused indexer-Q registered as torch custom ops (``dsv4ref::indexer_q_fp8`` / ``dsv4ref::indexer_q_mxfp4``)
with fake implementations, so ``torch.compile(fullgraph=True)`` traces through them.

These functions do no argument checks: :mod:`dsv4ref.indexer` validates, then calls them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..device import for_interpreter, interpreting
from ..formats import INDEX_HEAD_DIM, index_k_value_bytes
from ..kv_cache.reference import flat_bytes
from ..op_launch import OpLaunch
from . import kernels
from .reference import HADAMARD_SCALE, fold

HEAD_DIM = INDEX_HEAD_DIM


FP4_DECODES = ("nibble", "f16_blocks", "f16_scaled")  # IndexerLaunch.fp4_decode: see kernels.py, "logits"
_FP4_DECODE_DEFAULT = "f16_scaled"  # the fastest decode measured on the H200 (benchmarks/indexer.md)
SCALED_PAGES = 16  # pages per program of "f16_scaled" on a GPU (the H200 sweep's fastest; benchmarks/indexer.md)
# f16_scaled's register cap: its fast loop needs ~114 registers, its rare exact fallback ~155, and ptxas sizes the
# kernel for the larger; 128 keeps 4 programs of 4 warps per SM (65 536 registers) and spills in the fallback only
SCALED_MAXNREG = 128


@dataclass(frozen=True)
class IndexerLaunch(OpLaunch):
    """Launch choices of the indexer kernels. ``None`` = the measured default on this device.

    Attributes:
        quant_rows: rows ((token, head) pairs, or keys) per program of :func:`kernels.quantize_kernel`;
            a power of two. 16 (:func:`default_launch` takes ``INTERPRETER_QUANT_ROWS`` in the interpreter).
        logits_pages: pages of keys per program of :func:`kernels.logits_kernel`; None = 4 on a GPU, 16 for
            MXFP4 keys decoded ``"f16_scaled"`` (the H200 figures in ``benchmarks/``), 1 in the Triton
            interpreter (smaller tiles run faster there).
        logits_warps: warps per logits program, a power of two. 4.
        fp4_decode: how the MXFP4 logits decode packed e2m1 keys (``FP4_DECODES``): ``"nibble"`` (each
            code to fp32 from its bits, × the block scale, one bf16 dot per page) or ``"f16_blocks"`` (fp16
            bits built from the byte by integer shifts, one fp16 dot per 32-block and nibble half, the block
            scales applied to the partial sums). None = ``"f16_scaled"``. Same scores either way,
            within the fp32 summation tolerance. ``"f16_scaled"`` (the default, over twice as fast as the other
            two on the H200 at 16 pages per program; ``benchmarks/indexer.md``): the block scales relative
            to each key's (query head's) largest ride inside the fp16 operands, so ONE fp16 dot over all 128 dims
            per page, no per-block scale products; 4 integer operations and one fp16 multiply per packed byte.
            Programs whose scale bytes fall outside that exact range take an exact slow path (see
            ``kernels.fp4_pages_fast``).
        logits_maxnreg: the register cap of the logits kernel (ptxas ``maxnreg``), None = ``SCALED_MAXNREG``
            for ``"f16_scaled"`` and no cap for the others. Ignored by the interpreter.
        logits_tile_pages: ``"f16_scaled"`` only: pages per dot (the dot's rows are this many pages of keys), a
            power of two; 1. With 8 warps, 2 pages of 64 keys give each warpgroup its own 64 keys (with one page,
            two warpgroups would split the heads and both decode the same keys). Must divide the resolved
            ``logits_pages``; ignored by the other decodes.
    """

    quant_rows: int = 16
    logits_pages: int | None = None
    logits_warps: int = 4
    fp4_decode: str | None = None
    logits_maxnreg: int | None = None
    logits_tile_pages: int = 1

    def __post_init__(self):
        for name in ("quant_rows", "logits_pages", "logits_warps", "logits_tile_pages"):
            v = getattr(self, name)
            if v is None and name == "logits_pages":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"IndexerLaunch.{name}: expected a power of two >= 1, got {v!r}")
        v = self.logits_maxnreg
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 24 <= v <= 255):
            raise ValueError(f"IndexerLaunch.logits_maxnreg: expected an int in [24, 255] or None, got {v!r}")
        if self.fp4_decode is not None and self.fp4_decode not in FP4_DECODES:
            raise ValueError(f"IndexerLaunch.fp4_decode: expected one of {FP4_DECODES} or None, got {self.fp4_decode!r}")
        if self.logits_pages is not None and self.logits_tile_pages > self.logits_pages:
            raise ValueError(
                f"IndexerLaunch.logits_tile_pages: {self.logits_tile_pages} does not divide logits_pages={self.logits_pages}"
            )

    def pages(self, fp4: bool = False) -> int:
        """The resolved ``logits_pages``: 1 interpreted; on a GPU 4, or ``SCALED_PAGES`` for MXFP4 keys
        decoded ``"f16_scaled"``."""
        if self.logits_pages is not None:
            return self.logits_pages
        if interpreting():
            return 1
        return SCALED_PAGES if fp4 and self.decode() == "f16_scaled" else 4

    def decode(self) -> str:
        """The resolved ``fp4_decode``."""
        return self.fp4_decode or _FP4_DECODE_DEFAULT

    def tile_pages(self, fp4: bool) -> int:
        """The resolved ``logits_tile_pages``: 1 unless the MXFP4 logits use ``"f16_scaled"``; never more than
        :meth:`pages` (the interpreter's default of 1 page per program takes 1-page tiles)."""
        if not (fp4 and self.decode() == "f16_scaled"):
            return 1
        return min(self.logits_tile_pages, self.pages(fp4))

    def maxnreg(self, fp4: bool) -> int | None:
        """The resolved ``logits_maxnreg`` for a launch of the FP8 (``fp4=False``) or MXFP4 logits."""
        if self.logits_maxnreg is not None:
            return self.logits_maxnreg
        return SCALED_MAXNREG if fp4 and self.decode() == "f16_scaled" else None

    # the fields each custom op's schema takes (op_args(), from_op_args(): dsv4ref.op_launch); the K quantiser
    # and the logits kernel are launched directly, not through a custom op
    OP_FIELDS = {"indexer_q_fp8": ("quant_rows",), "indexer_q_mxfp4": ("quant_rows",)}


# In Triton's interpreter a program costs about the same whatever its tile: the quantize kernels take the
# widest row tile there (the same bytes; a row's quantisation never reads another row)
INTERPRETER_QUANT_ROWS = 256


def default_launch(*, interpreted: bool | None = None) -> IndexerLaunch:
    """The measured default, ``IndexerLaunch()`` (its ``None`` fields resolved per device and format by
    :meth:`IndexerLaunch.pages`, :meth:`~IndexerLaunch.decode`, ...); in Triton's interpreter
    :data:`INTERPRETER_QUANT_ROWS` rows per quantize program. ``interpreted``: the interpreter's default if
    True, the GPU's if False (None: this process's)."""
    if for_interpreter(interpreted):
        return IndexerLaunch(quant_rows=INTERPRETER_QUANT_ROWS)
    return IndexerLaunch()


def quantize(
    x16: torch.Tensor,
    rows: int,
    *,
    q_out: torch.Tensor,
    s_out: torch.Tensor,
    rows_per_program: int,
    positions=None,
    cos_sin=None,
    weights=None,
    H: int = 1,
    fp4: bool = False,
    hadamard: bool = False,
    wo_out=None,
    slots=None,
    block_size: int = 1,
    q_page_stride=None,
    s_page_stride=None,
) -> None:
    """Launch :func:`kernels.quantize_kernel` over ``rows`` rows of ``x16`` (int16 view of bf16 [rows, 128]).

    ``positions`` switches RoPE on, ``weights`` the weight fold (queries), ``slots`` the paged write (keys)."""
    if rows == 0:
        return
    rope = positions is not None
    dummy = q_out  # never dereferenced when its constexpr switch is off
    kernels.quantize_kernel[(triton.cdiv(rows, rows_per_program),)](
        x16,
        positions if rope else dummy,
        cos_sin if rope else dummy,
        weights if weights is not None else dummy,
        slots if slots is not None else dummy,
        q_out,
        s_out,
        wo_out if wo_out is not None else dummy,
        rows,
        H,
        block_size,
        q_page_stride if q_page_stride is not None else (64 if fp4 else 128),
        s_page_stride if s_page_stride is not None else (4 if fp4 else 1),
        fold(H),
        HADAMARD_SCALE,
        ROWS=rows_per_program,
        ROPE=rope,
        HADAMARD=hadamard,
        FP4=fp4,
        HAS_W=weights is not None,
        PAGED=slots is not None,
        enable_fp_fusion=False,  # RoPE products rounded separately, as in the torch reference
    )


# ----------------------------------------------------------------------------------------------------
# quantize_q: two custom ops (their schema carries the launch choice)
# ----------------------------------------------------------------------------------------------------


def _q_launch(index_q, positions, cos_sin, weights, hadamard, rows_per_program, fp4, q, s, wo):
    T, H, _ = index_q.shape
    quantize(
        index_q.contiguous().view(torch.int16),
        T * H,
        positions=positions.to(torch.int64).contiguous(),
        cos_sin=cos_sin.contiguous(),
        weights=weights.float().contiguous(),
        H=H,
        fp4=fp4,
        hadamard=hadamard,
        q_out=q,
        s_out=s,
        wo_out=wo,
        rows_per_program=rows_per_program,
    )


@torch.library.custom_op("dsv4ref::indexer_q_fp8", mutates_args=())
def indexer_q_fp8_op(
    index_q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: torch.Tensor,
    hadamard: bool,
    quant_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, _ = index_q.shape
    q = torch.empty(T, H, HEAD_DIM, dtype=torch.uint8, device=index_q.device)
    wo = torch.empty(T, H, dtype=torch.float32, device=index_q.device)
    launch = IndexerLaunch.from_op_args(quant_rows, op="indexer_q_fp8")
    _q_launch(index_q, positions, cos_sin, weights, hadamard, launch.quant_rows, False, q, wo, wo)
    return q, wo


@indexer_q_fp8_op.register_fake
def _(index_q, positions, cos_sin, weights, hadamard, quant_rows):
    T, H, _ = index_q.shape
    return index_q.new_empty(T, H, HEAD_DIM, dtype=torch.uint8), index_q.new_empty(T, H, dtype=torch.float32)


@torch.library.custom_op("dsv4ref::indexer_q_mxfp4", mutates_args=())
def indexer_q_mxfp4_op(
    index_q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: torch.Tensor,
    hadamard: bool,
    quant_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, H, _ = index_q.shape
    q = torch.empty(T, H, HEAD_DIM // 2, dtype=torch.uint8, device=index_q.device)
    sc = torch.empty(T, H, 4, dtype=torch.uint8, device=index_q.device)
    wo = torch.empty(T, H, dtype=torch.float32, device=index_q.device)
    launch = IndexerLaunch.from_op_args(quant_rows, op="indexer_q_mxfp4")
    _q_launch(index_q, positions, cos_sin, weights, hadamard, launch.quant_rows, True, q, sc, wo)
    return q, sc.view(torch.int32).reshape(T, H), wo


@indexer_q_mxfp4_op.register_fake
def _(index_q, positions, cos_sin, weights, hadamard, quant_rows):
    T, H, _ = index_q.shape
    return (
        index_q.new_empty(T, H, HEAD_DIM // 2, dtype=torch.uint8),
        index_q.new_empty(T, H, dtype=torch.int32),
        index_q.new_empty(T, H, dtype=torch.float32),
    )


def quantize_q(index_q, positions, cos_sin, weights, *, fmt: str, hadamard: bool, launch: IndexerLaunch):
    """The Triton path of :func:`dsv4ref.indexer.quantize_q`, through the registered custom op."""
    if fmt == "fp8":
        q, wo = indexer_q_fp8_op(index_q, positions, cos_sin, weights, hadamard, *launch.op_args("indexer_q_fp8"))
        return q.view(torch.float8_e4m3fn), None, wo
    return indexer_q_mxfp4_op(index_q, positions, cos_sin, weights, hadamard, *launch.op_args("indexer_q_mxfp4"))


# ----------------------------------------------------------------------------------------------------
# indexer K: quantise, paged write
# ----------------------------------------------------------------------------------------------------


def quantize_k(k: torch.Tensor, *, fmt: str, hadamard: bool, launch: IndexerLaunch):
    """The Triton path of :func:`dsv4ref.indexer.quantize_k`."""
    N = k.shape[0]
    fp4 = fmt == "mxfp4"
    q = torch.empty(N, index_k_value_bytes(fmt), dtype=torch.uint8, device=k.device)
    s = torch.empty((N, 4) if fp4 else (N,), dtype=torch.uint8 if fp4 else torch.float32, device=k.device)
    quantize(
        k.contiguous().view(torch.int16), N, fp4=fp4, hadamard=hadamard, q_out=q, s_out=s, rows_per_program=launch.quant_rows
    )
    return (q, s) if fp4 else (q.view(torch.float8_e4m3fn), s)


def insert_k(
    k_cache: torch.Tensor,
    k: torch.Tensor,
    slots: torch.Tensor,
    *,
    block_size: int,
    fmt: str,
    hadamard: bool,
    launch: IndexerLaunch,
) -> None:
    """The Triton path of :func:`dsv4ref.indexer.insert_k`: quantise and write in one kernel.

    The kernel addresses values through a uint8 view of the whole cache and the scales through a view
    that starts at the first page's scale region (uint8 for mxfp4, fp32 for fp8)."""
    fp4 = fmt == "mxfp4"
    vb = index_k_value_bytes(fmt)
    flat = flat_bytes(k_cache)
    stride = k_cache.stride(0)
    s_region = flat[block_size * vb :] if flat.numel() > block_size * vb else flat
    s_out = s_region if fp4 else s_region[: (s_region.numel() // 4) * 4].view(torch.float32)
    quantize(
        k.contiguous().view(torch.int16),
        slots.shape[0],
        fp4=fp4,
        hadamard=hadamard,
        q_out=flat,
        s_out=s_out,
        slots=slots.to(torch.int64).contiguous(),
        block_size=block_size,
        q_page_stride=stride,
        s_page_stride=stride if fp4 else stride // 4,
        rows_per_program=launch.quant_rows,
    )


# ----------------------------------------------------------------------------------------------------
# logits
# ----------------------------------------------------------------------------------------------------


def logits(
    q, q_scales, weights_out, k_cache, positions, block_table, block_size: int, n_out: int, launch: IndexerLaunch | None = None
) -> torch.Tensor:
    """The logits kernel launch alone (no checks, no host syncs): what the benchmark times.

    Grid (T, ⌈pages / PAGES⌉); the heads are padded to a power of two >= 16 for ``tl.dot``, and so are the
    page's keys (any ``block_size`` works; the padding rows are masked). ``launch`` None = :func:`default_launch`."""
    T, H, _ = q.shape
    launch = launch or default_launch()
    out = torch.empty(T, n_out, dtype=torch.float32, device=q.device)
    if T == 0 or n_out == 0:
        return out
    qs = q_scales.contiguous().view(torch.uint8) if q_scales is not None else q.view(torch.uint8)
    n_pages = -(-n_out // block_size)
    fp4 = q_scales is not None
    pages = launch.pages(fp4)
    hp = max(16, triton.next_power_of_2(H))
    bt = block_table.contiguous()
    cap = launch.maxnreg(fp4)
    opts = {"maxnreg": cap} if cap is not None and not interpreting() else {}
    kernels.logits_kernel[(T, triton.cdiv(n_pages, pages))](
        q.contiguous().view(torch.uint8),
        qs,
        weights_out.contiguous(),
        k_cache,
        k_cache.view(torch.float32),
        k_cache.view(torch.int32),
        bt,
        positions.to(torch.int64).contiguous(),
        out,
        n_out,
        bt.stride(0),
        k_cache.stride(0),
        H,
        HP=hp,
        BC=block_size,
        BCP=max(16, triton.next_power_of_2(block_size)),
        PAGES=pages,
        TP=launch.tile_pages(fp4),
        FP4=fp4,
        FP4_DECODE=launch.decode(),
        DOT_FP32=interpreting(),
        num_warps=launch.logits_warps,
        **opts,
    )
    return out
