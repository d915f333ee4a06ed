"""How the mHC kernels are launched: one frozen dataclass per design, passed as ``launch=``.

Four designs of pre, fused post+pre and head (their kernel modules say how each works); each has its own launch
class, holding only its own knobs and the post / Sinkhorn tiles every design shares (:class:`MhcLaunch`, their
base). The launch's type picks the launcher (``ops.py``: ``LAUNCHERS``):

* :class:`OneKernelLaunch`: ``hc_kernel``, ``launch_one_kernel``; the interpreter's default for fused post+pre;
* :class:`SplitKLaunch`: ``hc_partial_kernel`` + ``hc_finish_kernel``, ``launch_split_k``; the interpreter's
  default for pre and head;
* :class:`OnePassLaunch`: ``hc_one_pass_kernel``, ``launch_one_pass``; no default (a rung of notebook 03's ladder);
* :class:`ChunkedLaunch`: ``hc_chunk_partial_kernel`` + ``hc_chunk_finish_kernel``, ``launch_chunked``; the GPU's
  default for every op.

The GPU default is the fastest design measured (``benchmarks/RESULTS.md`` has its figures, ``benchmarks/mhc.md``
every candidate's). The interpreter pays for every program, so there the defaults are the designs with the fewest
programs, in bigger tiles (:func:`default_launch`); the tests run every design on both. A design changes the speed,
never the result beyond the stated tolerances.

A launch reaches the custom ops of ``ops.py`` as :mod:`dsv4ref.op_launch` says (``*launch.op_args(op)``, rebuilt
with ``from_op_args``): ``mhc_post`` and ``mhc_sinkhorn`` take the shared tiles they read, named as the fields;
``mhc_pre``, ``mhc_fused_post_pre`` and ``mhc_head`` (:data:`PACKED_OPS`) take one ``launch: int[]``, the design's
index in :data:`DESIGNS` then its fields, since a schema per design would make twelve of them
(``docs/layout.md``, "One vocabulary"). So a registered op reads nothing outside its schema. Which defaults differ between a GPU and the interpreter: :data:`DEVICE_DEFAULTS`; what a launch written for one means on
the other, and whether it is legal there: :meth:`MhcLaunch.for_device`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import triton

from .. import validate
from ..device import interpreting
from ..op_launch import OpLaunch

# Per design ("shared": the base's fields), the fields whose defaults differ between compiled kernels (False: a
# GPU) and Triton's interpreter (True).
DEVICE_DEFAULTS: dict[bool, dict[str, dict[str, object]]] = {
    False: {
        "shared": dict(sinkhorn_block=16),
        "one_kernel": dict(block_k=64),
        "split_k": dict(block_k=64, target_programs=528),
        "one_pass": dict(block_t=128, block_k=16, block_h=64, target_programs=528),
        "chunked": dict(
            tokens=4096,
            block_t=128,
            stages=4,
            slice_h=512,
            target_programs=128,
            finish_h=512,
            finish_block_h=128,
            stream_k=True,
            fn_layout=3,
            zigzag=True,
            small_t=64,
        ),
    },
    True: {
        "shared": dict(sinkhorn_block=256),
        "one_kernel": dict(block_k=128),
        "split_k": dict(block_k=128, target_programs=4),
        "one_pass": dict(block_t=32, block_k=128, block_h=128, target_programs=4),
        "chunked": dict(
            tokens=64,
            block_t=16,
            stages=3,
            slice_h=128,
            target_programs=4,
            finish_h=128,
            finish_block_h=64,
            stream_k=False,
            fn_layout=0,
            zigzag=False,
            small_t=0,
        ),
    },
}
_D = DEVICE_DEFAULTS[interpreting()]

DESIGNS = ("one_kernel", "split_k", "one_pass", "chunked")  # op_args(op)[0][0] is the index here, op in PACKED_OPS
OPS = ("pre", "fused_post_pre", "head", "post", "sinkhorn")
# the custom ops whose schema takes the launch as one ``launch: int[]`` (the design's index, then its fields)
PACKED_OPS = ("mhc_pre", "mhc_fused_post_pre", "mhc_head")
MAX_SLICES = 32  # one pass and chunked: at most this many hidden slices (each finish sums every slice's partial)
ONE_PASS_LAG = 2  # one pass: phase B finishes the tile this many tiles behind phase A's
ONE_PASS_SUM_UNROLL = 4  # one pass: the last arrival has this many slices' partials in flight per round


@dataclass(frozen=True)
class MhcLaunch(OpLaunch):
    """The base of the four designs' launches: the tiles of ``post_kernel`` (the post op, and the fused op's post
    in the chunked design) and of ``sinkhorn_kernel``, which every design shares. Not built itself: build
    :class:`OneKernelLaunch`, :class:`SplitKLaunch`, :class:`OnePassLaunch` or :class:`ChunkedLaunch`."""

    design: ClassVar[str] = ""  # its name in DESIGNS
    # what __post_init__ checks: powers of two; >= 16 (the sides of a tensor-core dot); ints >= 1; bools
    _POW2: ClassVar[tuple[str, ...]] = ()
    _MIN16: ClassVar[tuple[str, ...]] = ()
    _POSITIVE: ClassVar[tuple[str, ...]] = ()
    _BOOLS: ClassVar[tuple[str, ...]] = ()

    post_block_t: int = 4
    post_block_h: int = 256
    sinkhorn_block: int = _D["shared"]["sinkhorn_block"]  # 4×4 matrices per program

    # post and sinkhorn take the shared tiles they read, by name (dsv4ref.op_launch); PACKED_OPS take all of it
    OP_FIELDS = {"mhc_post": ("post_block_t", "post_block_h"), "mhc_sinkhorn": ("sinkhorn_block",)}

    def __post_init__(self):
        if not self.design:
            raise TypeError(
                "launch: MhcLaunch is the base of OneKernelLaunch, SplitKLaunch, OnePassLaunch and ChunkedLaunch; "
                "build one of them"
            )
        for name in ("post_block_t", "post_block_h", "sinkhorn_block") + self._POW2:
            validate.power_of_two(getattr(self, name), f"launch.{name}")
        for name in self._MIN16:  # the sides of a tensor-core dot; finish kernels: the [16]-wide gate tiles
            if getattr(self, name) < 16:
                raise ValueError(f"launch.{name}: expected >= 16, got {getattr(self, name)}")
        for name in self._POSITIVE:
            validate.integer(getattr(self, name), f"launch.{name}", lo=1)
        for name in self._BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"launch.{name}: expected a bool, got {getattr(self, name)!r}")
        if getattr(self, "maxnreg", None) is not None:  # ptxas takes 24..255 registers per thread
            validate.integer(self.maxnreg, "launch.maxnreg", lo=24, hi=255)

    @classmethod
    def for_device(cls, *, interpreted: bool, **fields) -> MhcLaunch:
        """``cls(**fields)`` with every other field at its default for Triton's interpreter (``interpreted=True``)
        or for compiled kernels on a GPU (False), whichever this process runs: what a launch written as
        ``cls(**fields)`` means on that device. Raises as the constructor does where the fields are not legal
        there (a chunk of fewer tokens than that device's token tile, say)."""
        d = DEVICE_DEFAULTS[bool(interpreted)]
        return cls(**{**d["shared"], **d.get(cls.design, {}), **fields})  # the base: its constructor refuses

    def pre_like_fused(self) -> MhcLaunch:
        """The launch under which :func:`~dsv4ref.mhc.pre` runs the arithmetic :func:`~dsv4ref.mhc.fused_post_pre`
        runs under this one (same design, same tiles), so that fused == post then pre bit for bit: this launch
        itself, but for the one-pass design (:meth:`OnePassLaunch.pre_like_fused`)."""
        return self

    def op_args(self, op: str | None = None) -> tuple:
        """The launch as the trailing arguments of the custom op ``op``: for ``mhc_post`` / ``mhc_sinkhorn`` the
        shared tiles, as :meth:`dsv4ref.op_launch.OpLaunch.op_args`; for :data:`PACKED_OPS` one ``int[]``, the
        design's index in :data:`DESIGNS`, then the fields in declaration order (None → −1)."""
        if op in PACKED_OPS:
            return ([DESIGNS.index(self.design), *(-1 if v is None else int(v) for v in dataclasses.astuple(self))],)
        return super().op_args(op)

    @classmethod
    def from_op_args(cls, *values, op: str | None = None) -> MhcLaunch:
        """The inverse of :meth:`op_args`: the launch a custom op rebuilds from its trailing arguments. For
        ``mhc_post`` / ``mhc_sinkhorn``, on the base class, a :class:`OneKernelLaunch` carries the shared tiles
        (they mean the same in every design; the base is never built)."""
        if op not in PACKED_OPS:
            return super(MhcLaunch, OneKernelLaunch if cls is MhcLaunch else cls).from_op_args(*values, op=op)
        (packed,) = values
        design = _CLASSES[DESIGNS[packed[0]]]
        kw = {f.name: (None if v == -1 else v) for f, v in zip(dataclasses.fields(design), packed[1:])}
        return design(**{k: bool(v) if k in design._BOOLS else v for k, v in kw.items()})


@dataclass(frozen=True)
class OneKernelLaunch(MhcLaunch):
    """One kernel, ``hc_kernel`` (``kernels.py``; launcher ``ops.launch_one_kernel``): a program owns ``block_t``
    tokens and the whole K = 4·Hd reduction. 16 tokens is the smallest M side of a tensor-core dot; 2 pipeline
    stages keep 4 streams × (A tile + 6 fn tiles) of shared memory well under the H200's 227 KB."""

    design: ClassVar[str] = "one_kernel"
    _POW2: ClassVar[tuple[str, ...]] = ("block_t", "block_k")
    _MIN16: ClassVar[tuple[str, ...]] = ("block_t", "block_k")
    _POSITIVE: ClassVar[tuple[str, ...]] = ("warps", "stages")

    block_t: int = 16  # tokens per program
    block_k: int = _D["one_kernel"]["block_k"]  # hidden dims per chunk
    warps: int = 4
    stages: int = 2


@dataclass(frozen=True)
class SplitKLaunch(MhcLaunch):
    """Split-K, ``hc_partial_kernel`` + ``hc_finish_kernel`` (``kernels_split_k.py``; launcher
    ``ops.launch_split_k``): a partial program owns ``block_t`` tokens and one K slice, a finish program sums the
    slices' partials for ``finish_block_t`` tokens and writes a part of the hidden dims."""

    design: ClassVar[str] = "split_k"
    _POW2: ClassVar[tuple[str, ...]] = ("block_t", "block_k", "finish_block_t", "finish_block_h")
    _MIN16: ClassVar[tuple[str, ...]] = ("block_t", "block_k", "finish_block_t")
    _POSITIVE: ClassVar[tuple[str, ...]] = ("warps", "stages", "target_programs", "finish_warps")

    # ---- partial kernel: 64 tokens per program = 4× fewer fn re-reads from L2 than 16
    block_t: int = 64
    block_k: int = _D["split_k"]["block_k"]
    warps: int = 8  # fused holds x, 4 streams and 4 new streams per chunk: 8 warps halve the registers
    stages: int = 2  # per stage: 4 stream tiles (32 KB) + 3 fn tiles of 32 columns × 4 streams (48 KB)
    splits: int | None = None  # force this many K splits (None: enough to reach target_programs)
    target_programs: int = _D["split_k"]["target_programs"]  # about 4 per SM on the H200's 132 SMs
    # ---- finish kernel
    finish_block_t: int = 16
    finish_block_h: int = 256
    finish_warps: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.splits is not None:
            validate.integer(self.splits, "launch.splits", lo=1)

    def plan(self, T: int, Hd: int) -> tuple[int, int]:
        """(splits, BLOCK_K chunks per split) of the partial kernel: enough K splits that token tiles × splits
        reaches ``target_programs`` (or ``splits`` if set), each a whole number of chunks, none empty."""
        chunks = triton.cdiv(Hd, self.block_k)
        want = self.splits or max(1, triton.cdiv(self.target_programs, triton.cdiv(T, self.block_t)))
        cps = triton.cdiv(chunks, min(chunks, want))
        return triton.cdiv(chunks, cps), cps

    def finish_plan(self, T: int, Hd: int) -> tuple[int, int, int]:
        """(token tiles, hidden parts, hidden dims per part) of the finish kernel: parts of ``finish_block_h``
        dims or more, enough that tiles × parts reaches ``target_programs``."""
        tiles = triton.cdiv(T, self.finish_block_t)
        h_chunks = triton.cdiv(Hd, self.finish_block_h)
        parts = min(h_chunks, max(1, triton.cdiv(self.target_programs, tiles)))
        h_per_part = triton.cdiv(h_chunks, parts) * self.finish_block_h
        return tiles, triton.cdiv(Hd, h_per_part), h_per_part


@dataclass(frozen=True)
class OnePassLaunch(MhcLaunch):
    """One pass, ``hc_one_pass_kernel`` (``kernels_one_pass.py``; launcher ``ops.launch_one_pass``): tiles of
    ``block_t`` tokens × slices of ``slice_h`` dims, taken from an atomic ticket. Two programs per SM for pre /
    head at 8 warps (80 KB of shared memory, <= 128 registers), one for fused."""

    design: ClassVar[str] = "one_pass"
    _POW2: ClassVar[tuple[str, ...]] = ("block_t", "block_k", "block_h", "slice_h")
    _MIN16: ClassVar[tuple[str, ...]] = ("block_t", "block_k")
    _POSITIVE: ClassVar[tuple[str, ...]] = ("warps", "stages", "fused_stages", "target_programs")

    block_t: int = _D["one_pass"]["block_t"]  # tokens per tile: fn is read from L2 once per tile
    block_k: int = _D["one_pass"]["block_k"]  # hidden dims per stream per GEMM chunk
    block_h: int = _D["one_pass"]["block_h"]  # hidden dims per chunk of the weighted sum (phase B)
    slice_h: int = 256  # hidden dims per work item: 128 tokens × 4 × 256 × 2 B = 256 KB of streams
    warps: int = 8  # two warpgroups, one per 64-token half of the tile (wgmma's M = 64)
    stages: int = 3  # pre / head
    fused_stages: int = 4  # fused post+pre: x + 4 stream tiles [128, 16] + the fn tile per stage, 124 KB
    maxnreg: int | None = 128  # pre / head (fused: no cap)
    one_dot: int = 2  # pre / head: 2 one load of the 4 streams' chunk, 1 the fused op's four joined tiles
    target_programs: int = _D["one_pass"]["target_programs"]  # about 4 per SM on the H200's 132 SMs

    def __post_init__(self):
        super().__post_init__()
        validate.integer(self.one_dot, "launch.one_dot", lo=1, hi=2)
        if self.slice_h < self.block_k:
            raise ValueError(f"launch.slice_h: expected >= block_k, got {self.slice_h}")

    def pre_like_fused(self) -> OnePassLaunch:
        """The fused op's dot of four joined tiles, its stages, no register cap (see :meth:`MhcLaunch.pre_like_fused`)."""
        return dataclasses.replace(self, stages=self.fused_stages, maxnreg=None, one_dot=1)

    def plan(self, T: int, Hd: int) -> tuple[int, int, int, int]:
        """(token tiles, hidden slices per tile, BLOCK_K chunks per slice, BLOCK_K): slices of ``slice_h`` hidden
        dims, more (down to one chunk each, at most ``MAX_SLICES``) while tiles × slices is short of
        ``target_programs`` (small T); each a whole number of chunks, none empty. The grid is
        (tiles + ``ONE_PASS_LAG``) × slices programs."""
        bt, bk = self.block_t, self.block_k
        tiles = triton.cdiv(T, bt)
        chunks = triton.cdiv(Hd, bk)
        want = max(triton.cdiv(chunks, self.slice_h // bk), min(MAX_SLICES, triton.cdiv(self.target_programs, max(tiles, 1))))
        cps = triton.cdiv(chunks, min(chunks, want))
        return tiles, triton.cdiv(chunks, cps), cps, bk


@dataclass(frozen=True)
class ChunkedLaunch(MhcLaunch):
    """Chunked, ``hc_chunk_partial_kernel`` + ``hc_chunk_finish_kernel`` per chunk of ``tokens`` tokens
    (``kernels_chunked.py``; launcher ``ops.launch_chunked``); the fused op: ``post_kernel`` per chunk first, then
    pre's two kernels on the new streams."""

    design: ClassVar[str] = "chunked"
    _POW2: ClassVar[tuple[str, ...]] = (
        "block_t",
        "block_k",
        "slice_h",
        "finish_block_t",
        "finish_h",
        "finish_block_h",
        "sum_unroll",
    )
    _MIN16: ClassVar[tuple[str, ...]] = ("block_t", "block_k", "finish_block_t")
    _POSITIVE: ClassVar[tuple[str, ...]] = ("tokens", "warps", "stages", "target_programs", "finish_warps")
    _BOOLS: ClassVar[tuple[str, ...]] = ("stream_k", "zigzag")

    tokens: int = _D["chunked"]["tokens"]  # C: tokens per chunk (a multiple of the token tiles)
    block_t: int = _D["chunked"]["block_t"]  # partial kernel: tokens per program
    block_k: int = 64  # hidden dims per GEMM step (with stream_k: one stream's 64 dims, 128-byte rows)
    warps: int = 8
    stages: int = _D["chunked"]["stages"]
    maxnreg: int | None = 128  # 2 programs per SM at 8 warps
    slice_h: int = _D["chunked"]["slice_h"]  # hidden dims per partial program: 8 slices × 32 tiles = one wave
    target_programs: int = _D["chunked"]["target_programs"]  # thinner slices while a chunk has fewer programs
    finish_block_t: int = 16  # finish kernel: tokens per program
    finish_h: int = _D["chunked"]["finish_h"]  # hidden dims per finish program
    finish_block_h: int = _D["chunked"]["finish_block_h"]  # hidden dims per weighted-sum chunk
    finish_warps: int = 4
    sum_unroll: int = 8  # slices' partials in flight per round of the finish kernel's sum
    stream_k: bool = _D["chunked"]["stream_k"]  # pre / head: each GEMM step one stream's block_k dims
    fn_layout: int = _D["chunked"]["fn_layout"]  # the fn tile from: 0 split_fn's [G, 3, 4·Hd, 16]; 2 its K-major
    #   copy (split_fn_wide, transposed: one dot of N = 128); 3 (with stream_k) 2 without its zero quarter
    zigzag: bool = _D["chunked"]["zigzag"]  # each kernel of a chunk walks its tokens opposite to the one before
    small_t: int = _D["chunked"]["small_t"]  # calls of <= this many tokens: 64-token partial tiles at 4 warps

    def __post_init__(self):
        super().__post_init__()
        validate.integer(self.small_t, "launch.small_t", lo=0)
        validate.integer(self.fn_layout, "launch.fn_layout", lo=0, hi=3)
        if self.fn_layout == 1:
            raise ValueError("launch.fn_layout: expected 0, 2 or 3, got 1")
        if self.fn_layout == 3 and not self.stream_k:
            raise ValueError("launch.fn_layout: 3 needs stream_k=True")
        if self.slice_h < self.block_k:
            raise ValueError(f"launch.slice_h: expected >= block_k, got {self.slice_h}")
        if self.finish_h < self.finish_block_h:
            raise ValueError(f"launch.finish_h: expected >= finish_block_h, got {self.finish_h}")
        tile = max(self.block_t, self.finish_block_t)  # powers of two
        if self.tokens % tile:
            raise ValueError(f"launch.tokens: expected a multiple of the chunked token tiles ({tile}), got {self.tokens}")

    def tile(self, T: int | None = None) -> tuple[int, int, int, int, int | None]:
        """(BLOCK_T, BLOCK_K, warps, stages, maxnreg) of the partial kernel for a call of ``T`` tokens (None: a
        long one): at most ``small_t`` tokens, 64-token tiles at 4 warps (no register cap), since a 128-token tile
        would be half masked rows or more."""
        if T is not None and T <= self.small_t and self.block_t > 64:
            return 64, self.block_k, 4, self.stages, None
        return self.block_t, self.block_k, self.warps, self.stages, self.maxnreg

    def plan(self, T: int, Hd: int) -> tuple[int, int, int, int, int]:
        """(tokens per chunk C, chunks, hidden slices, BLOCK_K chunks per slice, BLOCK_K) of the partial kernel:
        ``tokens`` per chunk (a call of fewer tokens: one chunk of T, rounded up to the tile); slices of
        ``slice_h`` hidden dims, thinner (down to one BLOCK_K chunk, at most ``MAX_SLICES``) while a chunk's
        tiles × slices is short of ``target_programs``; each slice a whole number of BLOCK_K chunks, none empty.
        Whether a token is in one chunk or another changes none of its arithmetic."""
        bt, bk = self.tile(T)[:2]
        c = min(self.tokens, max(1, triton.cdiv(T, bt)) * bt)
        chunks = triton.cdiv(Hd, bk)
        want = max(triton.cdiv(chunks, self.slice_h // bk), min(MAX_SLICES, triton.cdiv(self.target_programs, c // bt)))
        cps = triton.cdiv(chunks, min(chunks, want))
        return c, triton.cdiv(T, c), triton.cdiv(chunks, cps), cps, bk

    def finish_plan(self, c: int, Hd: int) -> tuple[int, int]:
        """(hidden parts, hidden dims per part) of the finish kernel for chunks of ``c`` tokens: parts of
        ``finish_h`` dims, more (down to one ``finish_block_h`` each) while a chunk's token tiles × parts is short
        of ``target_programs`` (small T)."""
        h_chunks = triton.cdiv(Hd, self.finish_block_h)
        tiles = triton.cdiv(c, self.finish_block_t)
        parts = min(h_chunks, max(triton.cdiv(Hd, self.finish_h), triton.cdiv(self.target_programs, tiles)))
        h_per_part = triton.cdiv(h_chunks, parts) * self.finish_block_h
        return triton.cdiv(Hd, h_per_part), h_per_part


_CLASSES = {c.design: c for c in (OneKernelLaunch, SplitKLaunch, OnePassLaunch, ChunkedLaunch)}


def default_launch(op: str, *, interpreted: bool | None = None) -> MhcLaunch:
    """The measured default of ``op`` (one of :data:`OPS`) on this device (``interpreted``: on Triton's interpreter
    if True, on a GPU if False, with that device's field defaults): on a GPU ``ChunkedLaunch()`` for every op; in
    the interpreter, which pays for every program, ``OneKernelLaunch()`` for the fused op and ``SplitKLaunch()``
    for the others (post and sinkhorn read only the shared tiles)."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    interpreted = interpreting() if interpreted is None else bool(interpreted)
    if not interpreted:
        return ChunkedLaunch.for_device(interpreted=False)
    return (OneKernelLaunch if op == "fused_post_pre" else SplitKLaunch).for_device(interpreted=True)
