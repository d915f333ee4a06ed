"""How the mHC kernels are launched: :class:`MhcLaunch`, the fn split, the launchers, the custom ops.

Every launch choice (which design, tile sizes, warps, stages, split counts) is a field of the frozen
:class:`MhcLaunch`, passed explicitly as ``launch=`` to the public functions and, as an ``int[]`` (:meth:`MhcLaunch.op_args`),
to the ``torch.ops.dsv4ref.mhc_*`` custom ops, so a registered op reads nothing outside its schema.

Four designs of pre, fused post+pre and head (kernels.py says how each works), picked by :meth:`MhcLaunch.design`:

=================  ==========================================  =====================================
design             kernels                                     default
=================  ==========================================  =====================================
one kernel         ``hc_kernel``                               interpreter: fused post+pre
split-K            ``hc_partial_kernel`` + ``hc_finish_kernel``  interpreter: pre, head
one pass           ``hc_one_pass_kernel``                      none (a rung of notebook 03's ladder)
chunked            ``hc_chunk_partial_kernel`` + ``_finish``     GPU: pre, fused post+pre, head
=================  ==========================================  =====================================

The GPU default is the fastest design measured (``benchmarks/RESULTS.md`` has its figures, ``benchmarks/mhc.md``
every candidate's). The interpreter pays for every program, so there the defaults are the designs with the fewest programs, in bigger tiles; the tests run
every design on both. A design changes the speed, never the result beyond the stated tolerances.

The launchers and the custom ops that run a launch: ``ops.py``; the fn split every design reads: ``fn_split.py``.

Which defaults differ between a GPU and the interpreter: :data:`DEVICE_DEFAULTS`; what a launch written for one
means on the other, and whether it is legal there: :meth:`MhcLaunch.for_device`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import triton

from .. import validate
from ..device import interpreting

# The fields whose defaults differ between compiled kernels (False: a GPU) and Triton's interpreter (True).
DEVICE_DEFAULTS: dict[bool, dict[str, object]] = {
    False: dict(
        block_k=64,
        split_block_k=64,
        target_programs=528,
        sinkhorn_block=16,
        one_pass_block_t=128,
        one_pass_block_k=16,
        one_pass_block_h=64,
        chunked=True,
        chunk_tokens=4096,
        chunk_block_t=128,
        chunk_stages=4,
        chunk_slice_h=512,
        chunk_target_programs=128,
        chunk_finish_h=512,
        chunk_finish_block_h=128,
        chunk_stream_k=True,
        chunk_fn_layout=3,
        chunk_zigzag=True,
        chunk_small_t=64,
    ),
    True: dict(
        block_k=128,
        split_block_k=128,
        target_programs=4,
        sinkhorn_block=256,
        one_pass_block_t=32,
        one_pass_block_k=128,
        one_pass_block_h=128,
        chunked=False,
        chunk_tokens=64,
        chunk_block_t=16,
        chunk_stages=3,
        chunk_slice_h=128,
        chunk_target_programs=4,
        chunk_finish_h=128,
        chunk_finish_block_h=64,
        chunk_stream_k=False,
        chunk_fn_layout=0,
        chunk_zigzag=False,
        chunk_small_t=0,
    ),
}
_D = DEVICE_DEFAULTS[interpreting()]

MAX_SLICES = 32  # one pass and chunked: at most this many hidden slices (each finish sums every slice's partial)
ONE_PASS_LAG = 2  # one pass: phase B finishes the tile this many tiles behind phase A's
ONE_PASS_SUM_UNROLL = 4  # one pass: the last arrival has this many slices' partials in flight per round


@dataclass(frozen=True)
class MhcLaunch:
    """Launch configuration of the mHC kernels; the defaults are this device's (:data:`DEVICE_DEFAULTS`)."""

    # ---- which design: an explicit split_k picks one kernel (False) or split-K (True) for every op; else
    # one_pass if set, else chunked if set (the GPU default), else split-K for pre / head and one kernel for fused
    split_k: bool | None = None
    one_pass: bool = False
    chunked: bool = _D["chunked"]
    # ---- one kernel (hc_kernel): 16 tokens is the smallest M side of a tensor-core dot; 2 pipeline stages keep
    # 4 streams × (A tile + 6 fn tiles) of shared memory well under the H200's 227 KB
    block_t: int = 16  # tokens per program
    block_k: int = _D["block_k"]  # hidden dims per chunk
    num_warps: int = 4
    num_stages: int = 2
    # ---- split-K, partial kernel: 64 tokens per program = 4× fewer fn re-reads from L2 than 16
    split_block_t: int = 64
    split_block_k: int = _D["split_block_k"]
    split_warps: int = 8  # fused holds x, 4 streams and 4 new streams per chunk: 8 warps halve the registers
    split_stages: int = 2  # per stage: 4 stream tiles (32 KB) + 3 fn tiles of 32 columns × 4 streams (48 KB)
    splits: int | None = None  # force this many K splits (None: enough to reach target_programs)
    target_programs: int = _D["target_programs"]  # about 4 per SM on the H200's 132 SMs (one pass: too)
    # ---- split-K, finish kernel
    finish_block_t: int = 16
    finish_block_h: int = 256
    finish_warps: int = 4
    # ---- post_kernel and sinkhorn_kernel
    post_block_t: int = 4
    post_block_h: int = 256
    sinkhorn_block: int = _D["sinkhorn_block"]  # 4×4 matrices per program
    # ---- one pass (hc_one_pass_kernel): tiles of block_t tokens × slices of one_pass_slice_h dims; two programs
    # per SM for pre / head at 8 warps (80 KB of shared memory, <= 128 registers), one for fused
    one_pass_block_t: int = _D["one_pass_block_t"]  # tokens per tile: fn is read from L2 once per tile
    one_pass_block_k: int = _D["one_pass_block_k"]  # hidden dims per stream per GEMM chunk
    one_pass_block_h: int = _D["one_pass_block_h"]  # hidden dims per chunk of the weighted sum (phase B)
    one_pass_slice_h: int = 256  # hidden dims per work item: 128 tokens × 4 × 256 × 2 B = 256 KB of streams
    one_pass_warps: int = 8  # two warpgroups, one per 64-token half of the tile (wgmma's M = 64)
    one_pass_stages: int = 3  # pre / head
    one_pass_fused_stages: int = 4  # fused post+pre: x + 4 stream tiles [128, 16] + the fn tile per stage, 124 KB
    one_pass_maxnreg: int | None = 128  # pre / head (fused: no cap)
    one_pass_one_dot: int = 2  # pre / head: 2 one load of the 4 streams' chunk, 1 the fused op's four joined tiles
    # ---- chunked (hc_chunk_partial_kernel + hc_chunk_finish_kernel per chunk of chunk_tokens tokens; the fused
    # op: post_kernel per chunk first, then pre's two kernels on the new streams)
    chunk_tokens: int = _D["chunk_tokens"]  # C: tokens per chunk (a multiple of the token tiles)
    chunk_block_t: int = _D["chunk_block_t"]  # partial kernel: tokens per program
    chunk_block_k: int = 64  # hidden dims per GEMM step (with chunk_stream_k: one stream's 64 dims, 128-byte rows)
    chunk_warps: int = 8
    chunk_stages: int = _D["chunk_stages"]
    chunk_maxnreg: int | None = 128  # 2 programs per SM at 8 warps
    chunk_slice_h: int = _D["chunk_slice_h"]  # hidden dims per partial program: 8 slices × 32 tiles = one wave
    chunk_target_programs: int = _D["chunk_target_programs"]  # thinner slices while a chunk has fewer programs
    chunk_finish_block_t: int = 16  # finish kernel: tokens per program
    chunk_finish_h: int = _D["chunk_finish_h"]  # hidden dims per finish program
    chunk_finish_block_h: int = _D["chunk_finish_block_h"]  # hidden dims per weighted-sum chunk
    chunk_finish_warps: int = 4
    chunk_sum_unroll: int = 8  # slices' partials in flight per round of the finish kernel's sum
    chunk_stream_k: bool = _D["chunk_stream_k"]  # pre / head: each GEMM step one stream's chunk_block_k dims
    chunk_fn_layout: int = _D["chunk_fn_layout"]  # the fn tile from: 0 split_fn's [G, 3, 4·Hd, 16]; 2 its K-major
    #   copy (split_fn_wide, transposed: one dot of N = 128); 3 (with chunk_stream_k) 2 without its zero quarter
    chunk_zigzag: bool = _D["chunk_zigzag"]  # each kernel of a chunk walks its tokens opposite to the one before
    chunk_small_t: int = _D["chunk_small_t"]  # calls of <= this many tokens: 64-token partial tiles at 4 warps

    @classmethod
    def for_device(cls, *, interpreted: bool, **fields) -> MhcLaunch:
        """``MhcLaunch(**fields)`` with every other field at its default for Triton's interpreter
        (``interpreted=True``) or for compiled kernels on a GPU (False), whichever this process runs: what a
        launch written as ``MhcLaunch(**fields)`` means on that device. Raises as the constructor does where
        the fields are not legal there (a chunk of fewer tokens than that device's token tile, say)."""
        return cls(**{**DEVICE_DEFAULTS[bool(interpreted)], **fields})

    def __post_init__(self):
        for name in (
            "block_t",
            "block_k",
            "split_block_t",
            "split_block_k",
            "finish_block_t",
            "finish_block_h",
            "post_block_t",
            "post_block_h",
            "sinkhorn_block",
            "one_pass_block_t",
            "one_pass_block_k",
            "one_pass_block_h",
            "one_pass_slice_h",
            "chunk_block_t",
            "chunk_block_k",
            "chunk_slice_h",
            "chunk_finish_block_t",
            "chunk_finish_h",
            "chunk_finish_block_h",
            "chunk_sum_unroll",
        ):
            validate.power_of_two(getattr(self, name), f"launch.{name}")
        for name in (
            "block_t",
            "block_k",
            "split_block_t",
            "split_block_k",
            "finish_block_t",
            "one_pass_block_t",
            "one_pass_block_k",
            "chunk_block_t",
            "chunk_block_k",
            "chunk_finish_block_t",
        ):
            if getattr(self, name) < 16:  # the sides of a tensor-core dot; finish: the [16]-wide gate tiles
                raise ValueError(f"launch.{name}: expected >= 16, got {getattr(self, name)}")
        for name in (
            "num_warps",
            "num_stages",
            "split_warps",
            "split_stages",
            "finish_warps",
            "target_programs",
            "one_pass_warps",
            "one_pass_stages",
            "one_pass_fused_stages",
            "chunk_tokens",
            "chunk_warps",
            "chunk_stages",
            "chunk_target_programs",
            "chunk_finish_warps",
        ):
            validate.integer(getattr(self, name), f"launch.{name}", lo=1)
        if self.splits is not None:
            validate.integer(self.splits, "launch.splits", lo=1)
        for name in ("one_pass_maxnreg", "chunk_maxnreg"):  # ptxas takes 24..255 registers per thread
            if getattr(self, name) is not None:
                validate.integer(getattr(self, name), f"launch.{name}", lo=24, hi=255)
        validate.integer(self.one_pass_one_dot, "launch.one_pass_one_dot", lo=1, hi=2)
        validate.integer(self.chunk_small_t, "launch.chunk_small_t", lo=0)
        validate.integer(self.chunk_fn_layout, "launch.chunk_fn_layout", lo=0, hi=3)
        if self.chunk_fn_layout == 1:
            raise ValueError("launch.chunk_fn_layout: expected 0, 2 or 3, got 1")
        if self.chunk_fn_layout == 3 and not self.chunk_stream_k:
            raise ValueError("launch.chunk_fn_layout: 3 needs chunk_stream_k=True")
        for name in ("split_k",) + _BOOLS:
            v = getattr(self, name)
            if not (isinstance(v, bool) or (v is None and name == "split_k")):
                raise TypeError(f"launch.{name}: expected a bool{' or None' if name == 'split_k' else ''}, got {v!r}")
        if self.one_pass_slice_h < self.one_pass_block_k:
            raise ValueError(f"launch.one_pass_slice_h: expected >= one_pass_block_k, got {self.one_pass_slice_h}")
        if self.chunk_slice_h < self.chunk_block_k:
            raise ValueError(f"launch.chunk_slice_h: expected >= chunk_block_k, got {self.chunk_slice_h}")
        if self.chunk_finish_h < self.chunk_finish_block_h:
            raise ValueError(f"launch.chunk_finish_h: expected >= chunk_finish_block_h, got {self.chunk_finish_h}")
        tile = max(self.chunk_block_t, self.chunk_finish_block_t)  # powers of two
        if self.chunk_tokens % tile:
            raise ValueError(
                f"launch.chunk_tokens: expected a multiple of the chunked token tiles ({tile}), got {self.chunk_tokens}"
            )

    def uses_split_k(self, fused: bool) -> bool:
        """Split-K or not, between the first two designs: ``split_k`` if set, else the per-op default (one
        kernel for fused only). (Whether one pass or chunked applies first: :meth:`design`.)"""
        return (not fused) if self.split_k is None else self.split_k

    def design(self, fused: bool) -> str:
        """ "chunked", "one_pass", "split_k" or "one_kernel": the kernels an op runs with this launch. An explicit
        ``split_k`` picks one of the first two (so ``MhcLaunch(split_k=...)`` means the same on every device);
        otherwise ``one_pass`` (never a default: always asked for), otherwise ``chunked`` (the GPU default),
        otherwise split-K for pre / head and one kernel for fused (the interpreter's default)."""
        if self.split_k is None and self.one_pass:
            return "one_pass"
        if self.split_k is None and self.chunked:
            return "chunked"
        return "split_k" if self.uses_split_k(fused) else "one_kernel"

    def pre_like_fused(self) -> MhcLaunch:
        """The launch under which :func:`~dsv4ref.mhc.pre` runs the arithmetic :func:`~dsv4ref.mhc.fused_post_pre`
        runs under this one (same design, same tiles), so that fused == post then pre bit for bit."""
        design = self.design(fused=True)
        if design == "chunked":  # the fused op IS post then this pre
            return self
        if design == "one_pass":  # the fused op's dot of four joined tiles, its stages, no register cap
            return dataclasses.replace(
                self, one_pass_stages=self.one_pass_fused_stages, one_pass_maxnreg=None, one_pass_one_dot=1
            )
        return dataclasses.replace(self, split_k=self.uses_split_k(fused=True))

    def split_plan(self, T: int, Hd: int) -> tuple[int, int]:
        """(splits, BLOCK_K chunks per split) of the partial kernel: enough K splits that token tiles × splits
        reaches ``target_programs`` (or ``splits`` if set), each a whole number of chunks, none empty."""
        chunks = triton.cdiv(Hd, self.split_block_k)
        want = self.splits or max(1, triton.cdiv(self.target_programs, triton.cdiv(T, self.split_block_t)))
        cps = triton.cdiv(chunks, min(chunks, want))
        return triton.cdiv(chunks, cps), cps

    def one_pass_plan(self, T: int, Hd: int) -> tuple[int, int, int, int]:
        """(token tiles, hidden slices per tile, BLOCK_K chunks per slice, BLOCK_K) of the one-pass kernel:
        slices of ``one_pass_slice_h`` hidden dims, more (down to one chunk each, at most ``MAX_SLICES``) while
        tiles × slices is short of ``target_programs`` (small T); each a whole number of chunks, none empty.
        The grid is (tiles + ``ONE_PASS_LAG``) × slices programs."""
        bt, bk = self.one_pass_block_t, self.one_pass_block_k
        tiles = triton.cdiv(T, bt)
        chunks = triton.cdiv(Hd, bk)
        want = max(
            triton.cdiv(chunks, self.one_pass_slice_h // bk), min(MAX_SLICES, triton.cdiv(self.target_programs, max(tiles, 1)))
        )
        cps = triton.cdiv(chunks, min(chunks, want))
        return tiles, triton.cdiv(chunks, cps), cps, bk

    def chunk_tile(self, T: int | None = None) -> tuple[int, int, int, int, int | None]:
        """(BLOCK_T, BLOCK_K, warps, stages, maxnreg) of the chunked design's partial kernel for a call of ``T``
        tokens (None: a long one): at most ``chunk_small_t`` tokens, 64-token tiles at 4 warps (no register
        cap), since a 128-token tile would be half masked rows or more."""
        if T is not None and T <= self.chunk_small_t and self.chunk_block_t > 64:
            return 64, self.chunk_block_k, 4, self.chunk_stages, None
        return self.chunk_block_t, self.chunk_block_k, self.chunk_warps, self.chunk_stages, self.chunk_maxnreg

    def chunk_plan(self, T: int, Hd: int) -> tuple[int, int, int, int, int]:
        """(tokens per chunk C, chunks, hidden slices, BLOCK_K chunks per slice, BLOCK_K) of the chunked design's
        partial kernel: ``chunk_tokens`` per chunk (a call of fewer tokens: one chunk of T, rounded up to the
        tile); slices of ``chunk_slice_h`` hidden dims, thinner (down to one BLOCK_K chunk, at most
        ``MAX_SLICES``) while a chunk's tiles × slices is short of ``chunk_target_programs``; each slice a whole
        number of BLOCK_K chunks, none empty. Whether a token is in one chunk or another changes none of its
        arithmetic."""
        bt, bk = self.chunk_tile(T)[:2]
        c = min(self.chunk_tokens, max(1, triton.cdiv(T, bt)) * bt)
        chunks = triton.cdiv(Hd, bk)
        want = max(
            triton.cdiv(chunks, self.chunk_slice_h // bk), min(MAX_SLICES, triton.cdiv(self.chunk_target_programs, c // bt))
        )
        cps = triton.cdiv(chunks, min(chunks, want))
        return c, triton.cdiv(T, c), triton.cdiv(chunks, cps), cps, bk

    def chunk_finish_plan(self, c: int, Hd: int) -> tuple[int, int]:
        """(hidden parts, hidden dims per part) of the chunked design's finish kernel for chunks of ``c`` tokens:
        parts of ``chunk_finish_h`` dims, more (down to one ``chunk_finish_block_h`` each) while a chunk's
        token tiles × parts is short of ``chunk_target_programs`` (small T)."""
        h_chunks = triton.cdiv(Hd, self.chunk_finish_block_h)
        tiles = triton.cdiv(c, self.chunk_finish_block_t)
        parts = min(h_chunks, max(triton.cdiv(Hd, self.chunk_finish_h), triton.cdiv(self.chunk_target_programs, tiles)))
        h_per_part = triton.cdiv(h_chunks, parts) * self.chunk_finish_block_h
        return triton.cdiv(Hd, h_per_part), h_per_part

    def op_args(self) -> tuple[list[int]]:
        """The launch as the trailing argument of the ``torch.ops.dsv4ref.mhc_*`` custom ops: ``launch: int[]``,
        the fields in declaration order (None → −1)."""
        return ([-1 if v is None else int(v) for v in dataclasses.astuple(self)],)

    @classmethod
    def from_op_args(cls, values: list[int]) -> MhcLaunch:
        """The inverse of :meth:`op_args`: the launch a custom op receives as ``launch``."""
        kw = {f.name: (None if v == -1 else v) for f, v in zip(dataclasses.fields(cls), values)}
        kw["split_k"] = None if kw["split_k"] is None else bool(kw["split_k"])
        for name in _BOOLS:
            kw[name] = bool(kw[name])
        return cls(**kw)


_BOOLS = ("one_pass", "chunked", "chunk_stream_k", "chunk_zigzag")


def default_launch() -> MhcLaunch:
    """The measured default on this device, ``MhcLaunch()`` (:data:`DEVICE_DEFAULTS`)."""
    return MhcLaunch()
