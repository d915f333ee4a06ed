"""How the mHC kernels are launched: :class:`MhcLaunch`, the fn split, the custom ops.

Every launch choice (which design, tile sizes, warps, stages, split counts) is a field of the frozen
:class:`MhcLaunch`, passed explicitly as ``launch=`` to the public functions and, encoded as an ``int[]``,
to the ``torch.ops.dsv4ref.mhc_*`` custom ops, so a registered op reads nothing outside its schema.

The defaults are what was measured fastest on one H200 (2026-11-30, T = Hd = 4096, torch 2.11, Triton 3.6;
``benchmarks/RESULTS.md`` and ``benchmarks/mhc.md``), as a fraction of the roofline bound over compulsory
bytes:

======================  =====================================  ==========================
op                      one kernel (``hc_kernel``)             split-K (partial + finish)
======================  =====================================  ==========================
pre                     336.5 µs, 12.3 % (BLOCK_T = 32)        **248.2 µs, 16.6 %**
fused post+pre          **485.1 µs, 17.0 %**                   777.2 µs, 10.6 %
head                    13.9 %                                 **218.0 µs, 18.8 %**
post (``post_kernel``)  **80.2 µs, 91.8 %**                    —
======================  =====================================  ==========================

so ``split_k=None`` (the default) means split-K for pre and head and one kernel for fused post+pre. Split-K
cuts fn's L2 traffic 4× but reads the streams twice; the fused op already reads and writes them once more,
which is why it loses there. Both designs are the main path (each serves an op by default), so both live in
``kernels.py``; ``MhcLaunch(split_k=True)`` / ``MhcLaunch(split_k=False)`` forces one for every op.

``MhcLaunch(one_pass=True)`` selects the third design, ``hc_one_pass_kernel`` (issue 14: one launch, the
streams' second read from L2; kernels.py "Design 3"). Session 3 measured it at 18–25 % (pre), 20–27 % (fused)
and 30 % (head); ``ONE_PASS_VARIANTS`` below lists the candidates that attack what compiling it showed, and
``benchmarks/mhc_sweep.py`` checks and times them in one H200 call. Session 4's run of it measured pre 148 µs,
fused 276 µs, head 116 µs at T = Hd = 4096 (1.7×, 2.2×, 1.9× the other designs), so ``one_pass`` is the default
of every op and of the decode step on a GPU, with the ``one_pass_*`` field defaults (the "default" candidate,
slices of 256). Its launcher zeroes a small int32
sync buffer (ticket, per-tile arrival counters and ready flags) and allocates a workspace of partial mixes
per call.

``MhcLaunch(chunked=True)`` selects the fourth design (kernels.py "Design 4": per chunk of ``chunk_tokens``
tokens a partial and a finish kernel, no waiting between programs, the re-read from L2); ``CHUNKED_VARIANTS``
lists its candidates, which ``benchmarks/mhc_sweep.py chunked`` checks and times beside today's default.
Session 6's H200 sweep measured it faster than one pass for every op, at T = 4096 (chunks of 2048 tokens: pre
94.6 µs, fused 170.5 µs, head 84.0 µs with one chunk of 4096 tokens, the fused op as post + pre and the
partial kernel's copies made contiguous) and at decode sizes (T = 37), so it is the GPU default since; the
interpreter keeps the per-op designs the lessons run.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
import triton

from .. import validate
from ..device import interpreting
from ..formats import HC_MULT
from . import kernels


@dataclass(frozen=True)
class MhcLaunch:
    """Launch configuration of the mHC kernels (the defaults: measured on the H200, module docstring).

    The interpreter pays about a millisecond per program, so a few of the defaults differ there (bigger
    chunks, fewer programs); they never change a result.
    """

    split_k: bool | None = None  # None: split-K for pre and head, one kernel for fused post+pre (measured)
    # one kernel (hc_kernel): BLOCK_T = 16 is the smallest M side of a tensor-core dot; 2 pipeline stages keep
    # 4 streams × (A tile + 6 fn tiles) of shared memory well under the H200's 227 KB
    block_t: int = 16  # tokens per program
    block_k: int = 128 if interpreting() else 64  # hidden dims per chunk
    num_warps: int = 4
    num_stages: int = 2
    # split-K, partial kernel: 64 tokens per program = 4× fewer fn re-reads from L2 than 16
    split_block_t: int = 64
    split_block_k: int = 128 if interpreting() else 64
    split_warps: int = 8  # fused holds x, 4 streams and 4 new streams per chunk: 8 warps halve the registers
    split_stages: int = 2  # per stage: 4 stream tiles (32 KB) + 3 fn tiles of 32 columns × 4 streams (48 KB)
    splits: int | None = None  # force this many K splits (None: enough to reach target_programs)
    target_programs: int = 4 if interpreting() else 528  # about 4 per SM on the H200's 132 SMs
    # split-K, finish kernel
    finish_block_t: int = 16
    finish_block_h: int = 256
    finish_warps: int = 4
    # post_kernel and sinkhorn_kernel
    post_block_t: int = 4
    post_block_h: int = 256
    sinkhorn_block: int = 256 if interpreting() else 16  # 4×4 matrices per program
    # one pass (hc_one_pass_kernel): pre, fused post+pre and head in one launch whose second read of the
    # streams comes from L2 (kernels.py, "Design 3"); an explicit split_k (True / False) overrides it. The
    # default on a GPU since session 4's H200 sweep (T = Hd = 4096: pre 148 µs vs 250 split-K, fused 276 vs
    # 610, head 116 vs 215; benchmarks/mhc.md); in the interpreter the measured per-op designs stay (the
    # lessons' CPU cost), and the tests run every design explicitly
    one_pass: bool = False  # the GPU default from session 4 to session 6 (now chunked, below); asked for, it wins
    # pre and head: tiles, warps, pipeline stages, register cap (2 programs per SM at 8 warps need <= 128)
    one_pass_block_t: int = 32 if interpreting() else 128  # tokens per tile: fn is read from L2 once per tile
    one_pass_block_k: int = 128 if interpreting() else 16  # hidden dims per stream per GEMM chunk
    one_pass_warps: int = 8  # two warpgroups, one per 64-token half of the tile (wgmma's M = 64)
    one_pass_stages: int = 3  # per stage the 4 streams' chunk [128, 64] + its fn tile [64, 128]: 80 KB in all
    one_pass_maxnreg: int | None = 128  # with 80 KB: 2 programs per SM (8 warps × 128 registers = half the file)
    # fused post+pre: x, the 4 streams and the 4 new ones are live per chunk, hence its own tiles
    one_pass_fused_block_t: int = 32 if interpreting() else 128
    one_pass_fused_block_k: int = 128 if interpreting() else 16
    one_pass_fused_warps: int = 8
    one_pass_fused_stages: int = 4  # per stage x + 4 stream tiles [128, 16] + the fn tile [64, 128]: 124 KB
    one_pass_fused_maxnreg: int | None = None
    # all three: work items, phase B, and the issue-14 switches (kernels.py "Design 3" says what each attacks)
    one_pass_block_h: int = 128 if interpreting() else 64  # hidden dims per chunk of the weighted sum
    one_pass_slice_h: int = 256  # hidden dims per work item: 128 tokens × 4 × 256 × 2 B = 256 KB of streams
    one_pass_slices: int | None = None  # force this many slices (None: from one_pass_slice_h / target_programs)
    one_pass_max_slices: int = 32  # small T: no more slices than this for target_programs' sake (the last
    #                                arrival sums every slice's partial; decode-sized T would make 256)
    one_pass_lag: int = 2  # the weighted sum runs this many tiles behind the partials (>= 1)
    one_pass_sum_unroll: int = 4  # the last arrival has this many slices' partials in flight per round
    one_pass_one_dot: int = 2  # dots per chunk: 0 one per stream, 1 one (tiles joined), 2 one (one load; fused: 1)
    one_pass_chain: bool = False  # pre / head: the slice's MMAs chain into one partial instead of one per chunk
    one_pass_pack_ws: bool = True  # workspace rows of the live columns only (pre 24, head 4) instead of 32
    one_pass_prefetch: bool = False  # pre / head: phase B's first stream chunk loaded before the READY wait
    one_pass_hw_round: bool = True  # compiled: bf16 outputs rounded by the hardware conversion (same bits)
    # chunked (hc_chunk_partial_kernel + hc_chunk_finish_kernel, launched once per chunk of chunk_tokens tokens;
    # kernels.py "Design 4"): the finish kernel re-reads the chunk's streams right after the partial kernel read
    # them, so from L2, with no waiting between programs. one_pass=True and an explicit split_k override it. The default on a GPU since session 6's two H200 sweeps: fewer, bigger chunks were faster at
    # every size, so the L2 re-read is not what limits it, and one chunk of 4096 tokens with the fused op as post
    # + pre ("chunked C4096 fused-post") was the fastest candidate over all three ops (T = Hd = 4096: pre 124.2 µs
    # vs 151.0 one pass, fused 201.3 vs 287.2, head 105.2 vs 120.1; T = 37: fused 19.9 vs 37.5 µs;
    # benchmarks/mhc.md); in the interpreter the per-op designs stay, as for one_pass
    chunked: bool = not interpreting()
    chunk_tokens: int = 64 if interpreting() else 4096  # C: tokens per chunk (C × 4 × Hd × 2 B of streams; 1024
    #                                                     fits the H200's 50 MB L2 at Hd = 4096, yet measured slower)
    # partial kernel (pre and head): the one-pass kernel's phase A, tile for tile
    chunk_block_t: int = 16 if interpreting() else 128
    chunk_block_k: int = 64  # (16 on a GPU until session 6's third sweep, with chunk_stream_k off)
    chunk_warps: int = 8
    chunk_stages: int = 3 if interpreting() else 4  # (3 on a GPU until session 8: with fn layout 3, below)
    chunk_maxnreg: int | None = 128  # 2 programs per SM at 8 warps
    # partial kernel, fused post+pre (x, 4 streams and 4 new ones live per chunk)
    chunk_fused_block_t: int = 16 if interpreting() else 128
    chunk_fused_block_k: int = 64 if interpreting() else 16
    chunk_fused_warps: int = 8
    chunk_fused_stages: int = 4
    chunk_fused_maxnreg: int | None = None
    chunk_one_dot: int = 2  # as one_pass_one_dot (fused: at most 1)
    # (slices of 512 dims and 128 target programs on a GPU since session 7: 8 slices × 32 tiles = 256 partial
    # programs, one wave at 2 per SM; 256 / 256 before, 1.9 waves)
    chunk_slice_h: int = 128 if interpreting() else 512  # hidden dims per partial program (fewer: more programs)
    chunk_target_programs: int = 4 if interpreting() else 128  # thinner slices while a chunk has fewer programs
    chunk_max_slices: int = 32  # ... but no more slices than this (the finish sums every slice's partial)
    # finish kernel: tokens per program, hidden dims per program, per weighted-sum chunk, warps, sum rounds
    chunk_finish_block_t: int = 16
    chunk_finish_h: int = 128 if interpreting() else 512  # 8 parts × 64 tiles: 512 programs, ~4 per SM
    chunk_finish_block_h: int = 64 if interpreting() else 128
    chunk_finish_warps: int = 4
    chunk_sum_unroll: int = 8  # slices' partials in flight per round of the finish kernel's sum (32 slices: 4 rounds)
    chunk_pdl: bool = False  # compiled: programmatic dependent launch, the next chunk's partial overlaps this finish
    chunk_fused_post: bool = not interpreting()  # fused post+pre: post_kernel per chunk, then pre's kernels on the new streams
    #                                 (from L2): 3 launches per chunk instead of a post inside the partial kernel
    # the partial kernel's shared-memory traffic (benchmarks/mhc.md, "Partial kernel: shared memory"): each warp's
    # cp.async of today's tiles gathers 16 B pieces from 16 (stream tile) / 8 (fn tile) separate places
    # (on a GPU since session 6's third sweep, with chunk_block_k = 64: "chunked smem sk64 fnkmajor", pre 94.1 µs vs
    # 124.2, fused 170.5 vs 201.4, head 82.9 vs 103.8 at T = Hd = 4096; runs/2026-12-01_s6_h200_mhc_sweep3.log)
    chunk_stream_k: bool = not interpreting()  # pre / head: each dot one stream's chunk_block_k dims (64: 128-byte
    #                                            rows), not 4 × 16
    chunk_fn_layout: int = 0 if interpreting() else 3  # the fn tile from: 0 split_fn's [G, 3, 4·Hd, 16]; 1 a
    #   [4·Hd, 4·NG] copy (split_fn_wide: contiguous rows); 2 its transpose [4·NG, 4·Hd] (the wgmma's B operand K-major);
    #   3 (with chunk_stream_k; else as 2): 2's copy without its zero quarter, two dots of N = 2·NG and NG
    # (3 and 4 stages on a GPU since session 8: "chunked zz slice512 n96 st4", T = Hd = 4096 pre 83.7 µs vs 86.4,
    # fused 155.9 vs 157.5, head 78.8 vs 78.3; runs/2026-12-01_s8_h200_mhc_sweep1.log)
    # session 7: a chunk's kernels walk its tokens in alternating directions (post forward, token-major; the
    # partial kernel backwards after a post, else forward; the finish kernel opposite to the partial), so each
    # kernel starts on the tokens its predecessor touched last: ~L2-sized (50 MB) of the re-read is an L2 hit
    # instead of HBM; the bits are the same (kernels.py "Design 4")
    # (on a GPU since session 7's sweeps, with slices of 512: "chunked zz slice512", T = Hd = 4096 pre 86.3 µs vs
    # 94.3, fused 158.1 vs 170.8, head 79.3 vs 83.6; runs/2026-12-01_s7_h200_mhc_sweep1.log)
    chunk_zigzag: bool = not interpreting()
    # session 10: pre's and the head's partial kernel (chunk_stream_k, fn layout 3) chain this many steps' dots
    # (1, 2 or 4) into one zero-started partial before folding it into the running sum (kernels.py,
    # partial_mix_one_pass): fewer folds and MMA waits, the truncation chain of one K = 4·64 dot at most
    chunk_fold_every: int = 1
    # calls of at most this many tokens (decode-sized) run pre's partial kernel (the fused op's too, as post +
    # pre) on 64-token tiles at 4 warps: a 128-token tile would be half masked rows or more. Session 7, T = 37
    # (runs/2026-12-01_s7_h200_mhc_sweep7.log): pre 12.9 vs 15.7 µs, fused 16.8 vs 19.8, head 9.1 vs 11.1; at
    # T = 4096 the 64-token tiles are slower (pre 99.6 vs 86.8 µs), hence the bound
    chunk_small_t: int = 0 if interpreting() else 64

    def __post_init__(self):
        for name in ("block_t", "block_k", "split_block_t", "split_block_k", "finish_block_t", "finish_block_h",
                     "post_block_t", "post_block_h", "sinkhorn_block", "one_pass_block_t", "one_pass_block_k",
                     "one_pass_fused_block_t", "one_pass_fused_block_k", "one_pass_block_h", "one_pass_slice_h",
                     "one_pass_sum_unroll", "chunk_block_t", "chunk_block_k", "chunk_fused_block_t",
                     "chunk_fused_block_k", "chunk_slice_h", "chunk_finish_block_t", "chunk_finish_h",
                     "chunk_finish_block_h", "chunk_sum_unroll"):
            validate.power_of_two(getattr(self, name), f"launch.{name}")
        for name in ("block_t", "block_k", "split_block_t", "split_block_k", "finish_block_t", "one_pass_block_t",
                     "one_pass_block_k", "one_pass_fused_block_t", "one_pass_fused_block_k", "chunk_block_t", "chunk_block_k",
                     "chunk_fused_block_t", "chunk_fused_block_k", "chunk_finish_block_t"):
            if getattr(self, name) < 16:  # the sides of a tensor-core dot; finish: the [16]-wide gate tiles
                raise ValueError(f"launch.{name}: expected >= 16, got {getattr(self, name)}")
        for name in ("num_warps", "num_stages", "split_warps", "split_stages", "finish_warps", "target_programs",
                     "one_pass_max_slices", "one_pass_lag", "one_pass_warps", "one_pass_stages", "one_pass_fused_warps",
                     "one_pass_fused_stages", "chunk_tokens", "chunk_warps", "chunk_stages", "chunk_fused_warps",
                     "chunk_fused_stages", "chunk_target_programs", "chunk_max_slices", "chunk_finish_warps"):
            validate.integer(getattr(self, name), f"launch.{name}", lo=1)
        if self.chunk_fold_every not in (0, 1, 2, 4):
            raise ValueError(f"launch.chunk_fold_every: expected 0, 1, 2 or 4, got {self.chunk_fold_every}")
        for name in ("splits", "one_pass_slices"):
            if getattr(self, name) is not None:
                validate.integer(getattr(self, name), f"launch.{name}", lo=1)
        for name in ("one_pass_maxnreg", "one_pass_fused_maxnreg", "chunk_maxnreg", "chunk_fused_maxnreg"):  # ptxas takes 24..255 registers per thread
            if getattr(self, name) is not None:
                validate.integer(getattr(self, name), f"launch.{name}", lo=24, hi=255)
        validate.integer(self.one_pass_one_dot, "launch.one_pass_one_dot", lo=0, hi=2)
        validate.integer(self.chunk_one_dot, "launch.chunk_one_dot", lo=0, hi=2)
        validate.integer(self.chunk_small_t, "launch.chunk_small_t", lo=0)
        validate.integer(self.chunk_fn_layout, "launch.chunk_fn_layout", lo=0, hi=3)
        for name in ("split_k",) + _BOOLS:
            v = getattr(self, name)
            if not (isinstance(v, bool) or (v is None and name == "split_k")):
                raise TypeError(f"launch.{name}: expected a bool{' or None' if name == 'split_k' else ''}, got {v!r}")
        if self.one_pass_slice_h < max(self.one_pass_block_k, self.one_pass_fused_block_k):
            raise ValueError(f"launch.one_pass_slice_h: expected >= the one-pass BLOCK_K tiles, got {self.one_pass_slice_h}")
        if self.chunk_slice_h < max(self.chunk_block_k, self.chunk_fused_block_k):
            raise ValueError(f"launch.chunk_slice_h: expected >= the chunked BLOCK_K tiles, got {self.chunk_slice_h}")
        if self.chunk_finish_h < self.chunk_finish_block_h:
            raise ValueError(f"launch.chunk_finish_h: expected >= chunk_finish_block_h, got {self.chunk_finish_h}")
        tile = max(self.chunk_block_t, self.chunk_fused_block_t, self.chunk_finish_block_t)  # powers of two
        if self.chunk_tokens % tile:
            raise ValueError(f"launch.chunk_tokens: expected a multiple of the chunked token tiles ({tile}), "
                             f"got {self.chunk_tokens}")

    def uses_split_k(self, fused: bool) -> bool:
        """Split-K or not, between the first two designs: ``split_k`` if set, else the measured default (one
        kernel for fused only). (Whether ``one_pass`` applies first: :meth:`design`.)"""
        return (not fused) if self.split_k is None else self.split_k

    def design(self, fused: bool) -> str:
        """"chunked", "one_pass", "split_k" or "one_kernel": the kernels an op runs with this launch. An explicit
        ``split_k`` picks one of the first two (so ``MhcLaunch(split_k=...)`` means the same whatever the
        defaults are); otherwise ``one_pass`` (never a default since session 6, so it is always asked for),
        otherwise ``chunked`` (the GPU default), otherwise the measured default per op."""
        if self.split_k is None and self.one_pass:
            return "one_pass"
        if self.split_k is None and self.chunked:
            return "chunked"
        return "split_k" if self.uses_split_k(fused) else "one_kernel"

    def pre_like_fused(self) -> "MhcLaunch":
        """The launch under which :func:`~dsv4ref.mhc.pre` runs the arithmetic :func:`~dsv4ref.mhc.fused_post_pre`
        runs under this one (same design, same chunks), so that fused == post then pre bit for bit."""
        if self.design(fused=True) == "chunked" and self.chunk_fused_post:  # fused IS post then this pre
            return self
        if self.design(fused=True) == "chunked":  # the fused partial tiles (and the slices they give)
            return dataclasses.replace(self, chunk_block_t=self.chunk_fused_block_t,
                                       chunk_block_k=self.chunk_fused_block_k, chunk_warps=self.chunk_fused_warps,
                                       chunk_stages=self.chunk_fused_stages, chunk_maxnreg=self.chunk_fused_maxnreg,
                                       chunk_one_dot=min(self.chunk_one_dot, 1), chunk_stream_k=False)
        if self.design(fused=True) == "one_pass":  # the fused tiles (every tl.sum's order depends on them)
            return dataclasses.replace(self, one_pass_block_t=self.one_pass_fused_block_t,
                                       one_pass_block_k=self.one_pass_fused_block_k,
                                       one_pass_warps=self.one_pass_fused_warps,
                                       one_pass_stages=self.one_pass_fused_stages,
                                       one_pass_maxnreg=self.one_pass_fused_maxnreg,
                                       one_pass_one_dot=min(self.one_pass_one_dot, 1))
        return dataclasses.replace(self, split_k=self.uses_split_k(fused=True))

    def one_pass_tile(self, fused: bool) -> tuple[int, int, int, int, int | None]:
        """(BLOCK_T, BLOCK_K, warps, stages, maxnreg) of the one-pass kernel for pre / head or (``fused``) the
        fused op."""
        if fused:
            return (self.one_pass_fused_block_t, self.one_pass_fused_block_k, self.one_pass_fused_warps,
                    self.one_pass_fused_stages, self.one_pass_fused_maxnreg)
        return self.one_pass_block_t, self.one_pass_block_k, self.one_pass_warps, self.one_pass_stages, self.one_pass_maxnreg

    def one_pass_plan(self, T: int, Hd: int, fused: bool = False) -> tuple[int, int, int, int]:
        """(token tiles, hidden slices per tile, BLOCK_K chunks per slice, BLOCK_K) of the one-pass kernel:
        slices of ``one_pass_slice_h`` hidden dims, more (down to one chunk each, at most
        ``one_pass_max_slices``) while tiles × slices is short of ``target_programs`` (small T), or
        ``one_pass_slices`` if set; each a whole number of chunks, none empty."""
        bt, bk = self.one_pass_tile(fused)[:2]
        tiles = triton.cdiv(T, bt)
        chunks = triton.cdiv(Hd, bk)
        want = self.one_pass_slices or max(triton.cdiv(chunks, self.one_pass_slice_h // bk),
                                           min(self.one_pass_max_slices,
                                               triton.cdiv(self.target_programs, max(tiles, 1))))
        cps = triton.cdiv(chunks, min(chunks, want))
        return tiles, triton.cdiv(chunks, cps), cps, bk

    def chunk_tile(self, fused: bool, T: int | None = None) -> tuple[int, int, int, int, int | None]:
        """(BLOCK_T, BLOCK_K, warps, stages, maxnreg) of the chunked design's partial kernel for pre / head or
        (``fused``) the fused op, for a call of ``T`` tokens (None: a long one): at most ``chunk_small_t``
        tokens, pre's on 64-token tiles at 4 warps (no register cap)."""
        if fused:
            return (self.chunk_fused_block_t, self.chunk_fused_block_k, self.chunk_fused_warps, self.chunk_fused_stages,
                    self.chunk_fused_maxnreg)
        if T is not None and T <= self.chunk_small_t and self.chunk_block_t > 64:
            return 64, self.chunk_block_k, 4, self.chunk_stages, None
        return self.chunk_block_t, self.chunk_block_k, self.chunk_warps, self.chunk_stages, self.chunk_maxnreg

    def chunk_plan(self, T: int, Hd: int, fused: bool = False) -> tuple[int, int, int, int, int]:
        """(tokens per chunk C, chunks, hidden slices, BLOCK_K chunks per slice, BLOCK_K) of the chunked design's
        partial kernel: ``chunk_tokens`` per chunk (a call of fewer tokens: one chunk of T, rounded up to the
        tile); slices of ``chunk_slice_h`` hidden dims, thinner (down to one BLOCK_K chunk, at most
        ``chunk_max_slices``) while a chunk's tiles × slices is short of ``chunk_target_programs``; each slice
        a whole number of BLOCK_K chunks, none empty. Whether a token is in one chunk or another changes none
        of its arithmetic."""
        bt, bk = self.chunk_tile(fused, T)[:2]
        c = min(self.chunk_tokens, max(1, triton.cdiv(T, bt)) * bt)
        chunks = triton.cdiv(Hd, bk)
        want = max(triton.cdiv(chunks, self.chunk_slice_h // bk),
                   min(self.chunk_max_slices, triton.cdiv(self.chunk_target_programs, c // bt)))
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

    def split_plan(self, T: int, Hd: int) -> tuple[int, int]:
        """(splits, BLOCK_K chunks per split) of the partial kernel: enough K splits that token tiles × splits
        reaches ``target_programs`` (or ``splits`` if set), each a whole number of chunks, none empty."""
        chunks = triton.cdiv(Hd, self.split_block_k)
        want = self.splits or max(1, triton.cdiv(self.target_programs, triton.cdiv(T, self.split_block_t)))
        cps = triton.cdiv(chunks, min(chunks, want))
        return triton.cdiv(chunks, cps), cps

    def encode(self) -> list[int]:
        """The fields in declaration order as the custom ops' ``launch: int[]`` argument (None → −1)."""
        return [-1 if v is None else int(v) for v in dataclasses.astuple(self)]

    @classmethod
    def decode(cls, values: list[int]) -> "MhcLaunch":
        """The inverse of :meth:`encode`."""
        kw = {f.name: (None if v == -1 else v) for f, v in zip(dataclasses.fields(cls), values)}
        kw["split_k"] = None if kw["split_k"] is None else bool(kw["split_k"])
        for name in _BOOLS:
            kw[name] = bool(kw[name])
        return cls(**kw)


_BOOLS = ("one_pass", "one_pass_chain", "one_pass_pack_ws", "one_pass_prefetch", "one_pass_hw_round", "chunked",
          "chunk_pdl", "chunk_fused_post", "chunk_stream_k", "chunk_zigzag")

DEFAULT = MhcLaunch()

# The one-pass candidates of issue 14: name -> MhcLaunch fields on top of MhcLaunch(one_pass=True), each run for
# pre, fused and head (a field an op does not use leaves its kernel as another candidate's: benchmarks/
# mhc_sweep.py times each distinct kernel once, ``one_pass_args`` says which are the same). "s3" is the design
# as session 3 measured it (pre 229 µs, fused 410 µs, head 136 µs at T = Hd = 4096; its streams now load
# through a bf16 pointer, so its dots read them from shared memory); every other row names what it changes.
# benchmarks/mhc_compile_check.py compiles them for sm_90a on a CPU, tests/test_mhc.py runs every distinct
# kernel among them in the interpreter; kernels.py "Design 3" says which suspect each switch attacks.
_S3 = dict(one_pass_block_k=32, one_pass_stages=3, one_pass_maxnreg=None, one_pass_lag=1, one_pass_sum_unroll=1,
           one_pass_one_dot=0, one_pass_pack_ws=False, one_pass_prefetch=False, one_pass_hw_round=False)
_FIX = dict(one_pass_lag=2, one_pass_sum_unroll=8, one_pass_pack_ws=True)  # the last arrival off the critical path
_ONE_PER_SM = dict(one_pass_block_k=32, one_pass_stages=3, one_pass_maxnreg=None)  # 160 KB, up to 255 registers
ONE_PASS_VARIANTS: dict[str, dict] = {
    "s3": _S3,
    "s3 slice256": {**_S3, "one_pass_slice_h": 256},
    "s3 +sum8": {**_S3, "one_pass_sum_unroll": 8},
    "s3 +sum8 lag2 pack": {**_S3, **_FIX},
    "1/SM prefetch": {**_ONE_PER_SM, **_FIX, "one_pass_prefetch": True},
    "1/SM one_dot1": {**_ONE_PER_SM, **_FIX, "one_pass_one_dot": 1},
    "default": {},  # MhcLaunch's one-pass field defaults: pre / head 2 programs per SM
    "default lag3": {"one_pass_lag": 3},
    "default slice256": {"one_pass_slice_h": 256},
    "default chain": {"one_pass_chain": True},
    "default 4st": {"one_pass_stages": 4},  # 112 KB: still 2 per SM
    "default sum8": {"one_pass_sum_unroll": 8},
    "default int-round": {"one_pass_hw_round": False},
    "default bt64 4w": {"one_pass_block_t": 64, "one_pass_warps": 4, "one_pass_maxnreg": None,
                        "one_pass_fused_block_t": 64, "one_pass_fused_warps": 4, "one_pass_fused_stages": 3},
    "default fused 3st": {"one_pass_fused_stages": 3},
    "default 4 dots": {"one_pass_one_dot": 0},
}


def one_pass_variant(name: str, **overrides) -> MhcLaunch:
    """``MhcLaunch(one_pass=True)`` with the fields of ``ONE_PASS_VARIANTS[name]``, then ``overrides``."""
    return MhcLaunch(one_pass=True, **{**ONE_PASS_VARIANTS[name], **overrides})


# The chunked candidates (kernels.py "Design 4"): name -> MhcLaunch fields on top of MhcLaunch(chunked=True), each
# run for pre, fused and head by benchmarks/mhc_sweep.py beside today's default, compiled for sm_90a by
# benchmarks/mhc_compile_check.py; every name starts with "chunked", so ``mhc_sweep.py chunked`` times only them.
_BT64 = dict(chunk_block_t=64, chunk_warps=4, chunk_maxnreg=None, chunk_fused_block_t=64, chunk_fused_warps=4,
             chunk_fused_stages=3)
_C4096 = dict(chunk_tokens=4096, chunk_fused_post=True)  # the GPU default after session 6's second sweep
_S6 = dict(_C4096, chunk_stream_k=True, chunk_block_k=64, chunk_fn_layout=2)  # after its third (today's default)
_ZZ512 = dict(_S6, chunk_zigzag=True, chunk_slice_h=512, chunk_target_programs=128)  # session 7's first sweep
CHUNKED_VARIANTS: dict[str, dict] = {
    "chunked": {"chunk_tokens": 1024},  # 32 MB of streams per chunk, 32 slices × 8 tiles, finish 16 × 512 dims
    "chunked C512 bt64": {"chunk_tokens": 512, **_BT64},  # 16 MB per chunk; 8 tiles × 32 slices = 256 programs
    "chunked C768": {"chunk_tokens": 768},  # 24 MB per chunk: L2 margin for the layer input and workspace
    "chunked C2048": {"chunk_tokens": 2048},  # the control: 64 MB per chunk is past the L2
    "chunked slice256": {"chunk_max_slices": 16},  # 16 slices of 256 dims: 128 programs, half the finish's sum
    "chunked finish32": {"chunk_finish_block_t": 32},  # finish programs of 32 tokens × 512 dims: 256 per chunk
    "chunked finish1024": {"chunk_finish_h": 1024},  # 16 × 1024: 256 finish programs per chunk, 2 per SM
    "chunked finish bh256": {"chunk_finish_block_h": 256, "chunk_finish_h": 512},  # twice the finish's loads in flight per round
    "chunked pdl": {"chunk_pdl": True},  # the next chunk's partial streams from HBM while this finish reads L2
    "chunked C512 pdl": {"chunk_tokens": 512, "chunk_pdl": True},  # two chunks live in L2: 32 MB; 128 partial
    #                                                                 programs, so the finish's fit beside them
    "chunked C512 bt64 pdl": {"chunk_tokens": 512, "chunk_pdl": True, **_BT64},
    # fused only (pre and head are "chunked"'s): post_kernel (89 % of copy alone) per chunk, then pre's kernels
    # on the new streams from L2, instead of the instruction-bound fused K loop; 3 launches per chunk
    "chunked fused-post": {"chunk_fused_post": True},
    "chunked fused-post C512 bt64 pdl": {"chunk_fused_post": True, "chunk_tokens": 512, "chunk_pdl": True, **_BT64},
    # session 6, after the first sweep (fewer chunks were faster at every size: C2048 the best, 2 chunks at
    # T = 4096): does the L2 re-read matter at all (C4096: one chunk, split-K with these kernels), and the best
    # of each axis combined
    "chunked C4096": {"chunk_tokens": 4096},
    "chunked C2048 slice256": {"chunk_tokens": 2048, "chunk_max_slices": 16},
    "chunked C2048 pdl": {"chunk_tokens": 2048, "chunk_pdl": True},
    "chunked C2048 fused-post": {"chunk_tokens": 2048, "chunk_fused_post": True},
    "chunked C4096 fused-post": {"chunk_tokens": 4096, "chunk_fused_post": True},
    # after session 6 (today's default is "chunked C4096 fused-post"): the partial kernel's shared-memory
    # traffic (benchmarks/mhc.md, "Partial kernel: shared memory"): sk64 = one stream's 64 dims per dot (128-byte
    # rows), fnwide / fnkmajor = the fn tile from split_fn_wide (rows / its transpose); every name has "smem", so
    # ``mhc_sweep.py smem`` times only these beside today's default
    "chunked smem sk64": {**_C4096, "chunk_stream_k": True, "chunk_block_k": 64},
    "chunked smem fnwide": {**_C4096, "chunk_fn_layout": 1},
    "chunked smem sk64 fnwide": {**_C4096, "chunk_stream_k": True, "chunk_block_k": 64, "chunk_fn_layout": 1},
    "chunked smem sk64 fnkmajor": {**_C4096, "chunk_stream_k": True, "chunk_block_k": 64, "chunk_fn_layout": 2},
    "chunked smem sk64 fnwide 4st": {**_C4096, "chunk_stream_k": True, "chunk_block_k": 64, "chunk_fn_layout": 1,
                                     "chunk_stages": 4},
    # session 7 (against session 6's default, "chunked smem sk64 fnkmajor"): the chunk's kernels walk its tokens in
    # alternating directions (``chunk_zigzag``), so the L2 holds the first ~50 MB each kernel re-reads; with it,
    # chunks smaller than T again (each chunk's re-read from L2); every name has "zz". (The fused op's post
    # inside the partial kernel at 64-dim copies, which would save a 134 MB read, compiled to 255 registers
    # with spills and 1 program per SM in every tile tried: benchmarks/mhc.md; not a candidate.)
    "chunked zz": {**_S6, "chunk_zigzag": True},
    "chunked zz C2048": {**_S6, "chunk_zigzag": True, "chunk_tokens": 2048},
    "chunked zz C2048 pdl": {**_S6, "chunk_zigzag": True, "chunk_tokens": 2048, "chunk_pdl": True},
    "chunked zz C1024 pdl": {**_S6, "chunk_zigzag": True, "chunk_tokens": 1024, "chunk_pdl": True},
    # fewer, longer slices: 8 of 512 dims × 32 tiles = 256 partial programs (one wave at 2 per SM, not 1.9) and
    # half the partials each finish program sums; fewer finish parts: half the redundant sums (L2 reads)
    "chunked zz slice512": {**_S6, "chunk_zigzag": True, "chunk_slice_h": 512, "chunk_target_programs": 128},
    "chunked zz finish1024": {**_S6, "chunk_zigzag": True, "chunk_finish_h": 1024},
    "chunked zz slice512 finish1024": {**_S6, "chunk_zigzag": True, "chunk_slice_h": 512,
                                       "chunk_target_programs": 128, "chunk_finish_h": 1024},
    # after the first session-7 sweep (zz slice512: partial 44.5 µs = 74 % of copy, finish 40.9 µs from L2): the
    # partial kernel reads a [64, 128] fn tile from L2 per [128, 64] stream tile, as many bytes as the streams
    # (L2 → SM ~270 MB in 44 µs); 256-token tiles halve the fn bytes (one 16-warp program per SM)
    "chunked zz slice512 bt256 w16": {**_ZZ512, "chunk_block_t": 256, "chunk_warps": 16, "chunk_stages": 4,
                                      "chunk_maxnreg": None},
    "chunked zz slice512 bt256 w16 st3": {**_ZZ512, "chunk_block_t": 256, "chunk_warps": 16, "chunk_stages": 3,
                                          "chunk_maxnreg": None},
    "chunked zz slice512 st4": {**_ZZ512, "chunk_stages": 4},  # the control: more bytes in flight, same fn bytes
    # after sweep 6: more warpgroups per SM to overlap each one's per-step MMA wait and fold (64-token tiles at
    # 4 warps: 3 programs per SM = 12 warps, against 2 × 8 = 16 warps in 2 programs whose 4 warpgroups share 2 tiles)
    "chunked zz slice512 bt64 w4": {**_ZZ512, "chunk_block_t": 64, "chunk_warps": 4, "chunk_maxnreg": None},
    "chunked zz slice512 bt64 w4 st2": {**_ZZ512, "chunk_block_t": 64, "chunk_warps": 4, "chunk_maxnreg": 128,
                                        "chunk_stages": 2},  # 4 per SM: the 512 programs in one wave
    # session 7, for the next GPU run (pre's partial kernel at 74 % of copy, the head's, at half the MMA columns,
    # at 82 %): fn layout 3 drops the zero quarter of the N = 128 dot (two dots of N = 64 and 32): a quarter
    # less MMA and fold work per step
    "chunked zz slice512 n96": {**_ZZ512, "chunk_fn_layout": 3},
    "chunked zz slice512 n96 st4": {**_ZZ512, "chunk_fn_layout": 3, "chunk_stages": 4},
    "chunked zz slice512 bt256 w8": {**_ZZ512, "chunk_block_t": 256, "chunk_warps": 8, "chunk_stages": 4,
                                     "chunk_maxnreg": None},
    # session 10 (benchmarks/mhc.md): three partial programs per SM (80 registers, thinner slices for the third
    # slot) were slower at every slice count (pre 90.7-97.2 µs against 84.5); removed. What pre's partial
    # kernel does per 64-dim step besides loading: two zero-started dots, their wait, and the fold. Chaining 2
    # or 4 steps' dots before one fold (chunk_fold_every) keeps the dots back to back
    "chunked zz slice512 n96 st4 f2": {**_ZZ512, "chunk_fn_layout": 3, "chunk_stages": 4, "chunk_fold_every": 2},
    "chunked zz slice512 n96 st4 f4": {**_ZZ512, "chunk_fn_layout": 3, "chunk_stages": 4, "chunk_fold_every": 4},
    "chunked zz slice512 n96 st4 f0": {**_ZZ512, "chunk_fn_layout": 3, "chunk_stages": 4, "chunk_fold_every": 0},
}


# what the candidates were written against: the chunked fields before sessions 6 and 7 changed the GPU defaults
# (so every row of CHUNKED_VARIANTS keeps the meaning it was timed with, at T = 37 too)
_CHUNK_BASE = {} if interpreting() else {"chunk_tokens": 1024, "chunk_fused_post": False, "chunk_block_k": 16,
                                          "chunk_stream_k": False, "chunk_fn_layout": 0, "chunk_zigzag": False,
                                          "chunk_slice_h": 256, "chunk_target_programs": 256, "chunk_small_t": 0,
                                          "chunk_stages": 3}


def chunked_variant(name: str, **overrides) -> MhcLaunch:
    """``MhcLaunch(chunked=True)`` with the fields of ``CHUNKED_VARIANTS[name]`` (over the fields the candidates
    were written against: chunks of 1024 tokens, the fused K loop), then ``overrides``."""
    return MhcLaunch(chunked=True, **{**_CHUNK_BASE, **CHUNKED_VARIANTS[name], **overrides})


# ====================================================================================================
# fn split: fp32 = hi + mid + lo, three bf16 parts, exactly
# ====================================================================================================


_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def split3(w: torch.Tensor) -> torch.Tensor:
    """``[3, *w.shape]`` bf16 with hi + mid + lo == w exactly (fp32 has 24 significand bits, bf16 has 8;
    torch's fp32 -> bf16 cast rounds to nearest even, and each remainder is exact in fp32), for every |w| >=
    2^-110 (below, bf16's subnormal spacing 2^-133 rounds the last part: far below any weight's scale) and 0.

    Every fp32 value splits exactly: one that rounds past bf16's largest finite value keeps that value as
    its ``hi`` (not inf) and the rest in ``mid``; a non-finite value (value checks off) splits as
    (value, 0, 0), so the GEMM sees the same ±inf / NaN as an fp32 GEMM (never inf − inf = NaN parts)."""
    hi = w.to(torch.bfloat16)
    hi = torch.where(torch.isinf(hi) & torch.isfinite(w), torch.full_like(w, _BF16_MAX).copysign(w), hi.float())
    hi = hi.to(torch.bfloat16)
    r = torch.where(torch.isfinite(w), w - hi.float(), torch.zeros_like(w))
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo])


_DERIVED: dict[tuple, tuple] = {}  # (id(weight), what) -> (weak reference, version, derived tensor)


def _forget(key: tuple, ref: weakref.ref) -> None:
    """The weight behind ``ref`` was freed: drop its entry (unless a newer weight at that address replaced it)."""
    entry = _DERIVED.get(key)
    if entry is not None and entry[0] is ref:
        del _DERIVED[key]


def _derived(weight: torch.Tensor, what: tuple, build) -> torch.Tensor:
    """``build()``, cached per weight tensor object, version counter and ``what``: an in-place update of the
    weight rebuilds it, and the cache holds only a weak reference to the weight, whose death drops the entry
    (so a model's every mHC site keeps its copy, however many there are: V4-Flash has 2 per layer × 43
    layers, and a freed tensor's address is never mistaken for a live one)."""
    key = (id(weight), *what)
    hit = _DERIVED.get(key)
    if hit is not None and hit[0]() is weight and hit[1] == weight._version:
        return hit[2]
    out = build()
    ref = weakref.ref(weight, lambda r, key=key: _forget(key, r))
    _DERIVED[key] = (ref, weight._version, out)
    return out


def split_fn(fn: torch.Tensor, M: int = HC_MULT, head: bool = False) -> torch.Tensor:
    """The kernels' copy of ``fn``: bf16 ``[G, 3, M·Hd, 16]`` (G = 2 for pre: group 0 = the gate rows
    [pre 0..3 | post 4..7 | zero], group 1 = the 16 comb rows; G = 1 for the head: [gate 0..3 | zero]).
    K-major, so a kernel loads a ``[BLOCK_K, 16]`` tile of fnᵀ with contiguous rows.

    fn is a weight: the split is cached per tensor object and version counter (:func:`_derived`)."""

    def build():
        K = fn.shape[1]
        groups = 1 if head else 2
        w = torch.zeros(groups, 16, K, dtype=torch.float32, device=fn.device)
        if head:
            w[0, :M] = fn
        else:
            w[0, : 2 * M] = fn[: 2 * M]  # pre, post
            w[1, : M * M] = fn[2 * M :]  # comb, row-major (i, j)
        return split3(w).permute(1, 0, 3, 2).contiguous()  # [G, 3, K, 16]

    return _derived(fn, ("split", M, head), build)


def split_fn_wide(fs: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """``split_fn``'s ``[G, 3, K, 16]`` as ``[K, 4·G·16]`` bf16: row k = [hi | mid | lo | 0] × the G·16 columns
    (column p·G·16 + g·16 + j = ``fs[g, p, k, j]``; part 3 zero), the N axis of ``kernels.gemm_tile`` in memory
    order, so a [BLOCK_K, 4·G·16] fn tile is BLOCK_K contiguous rows (``MhcLaunch.chunk_fn_layout`` 1), or
    (``transposed``) its transpose ``[4·G·16, K]`` (layout 2). Cached per split tensor and version, as
    ``split_fn`` (:func:`_derived`)."""

    def build():
        G, P, K, W = fs.shape
        wide = torch.zeros(K, P + 1, G * W, dtype=fs.dtype, device=fs.device)
        wide[:, :P] = fs.permute(2, 1, 0, 3).reshape(K, P, G * W)
        out = wide.reshape(K, (P + 1) * G * W)
        return out.t().contiguous() if transposed else out

    return _derived(fs, ("wide", transposed), build)


# ====================================================================================================
# Launchers
# ====================================================================================================


def one_pass_args(L: MhcLaunch, T: int, Hd: int, head: bool, fused: bool):
    """What ``hc_one_pass_kernel`` is launched with for a [T, 4, Hd] op (shared with
    benchmarks/mhc_compile_check.py, which compiles exactly these): (grid, constexprs but DOT_FP32, compile
    options, (mix workspace, Σ X² workspace, sync buffer) element counts, (tiles, slices, chunks per slice))."""
    tiles, slices, cps, bk = L.one_pass_plan(T, Hd, fused)
    bt, _, warps, stages, maxnreg = L.one_pass_tile(fused)
    ws_gate = (4 if head else 8) if L.one_pass_pack_ws else 16  # gate columns kept per workspace row
    ws_stride = (4 if head else 24) if L.one_pass_pack_ws else 32
    consts = dict(HEAD=head, FUSED=fused, BLOCK_T=bt, BLOCK_K=bk, BLOCK_H=L.one_pass_block_h, LAG=L.one_pass_lag,
                  SPIN_LIMIT=1 << 16, SUM_UNROLL=L.one_pass_sum_unroll, ONE_DOT=L.one_pass_one_dot,
                  CHAIN=L.one_pass_chain and not fused,  # fused feeds its dot from registers: ptxas would
                  #                                        serialise every wgmma of a loop-carried chain (C7515)
                  WS_GATE=ws_gate, WS_STRIDE=ws_stride,
                  PREFETCH=L.one_pass_prefetch and not fused,  # the fused phase B reads what phase A wrote
                  HW_ROUND=L.one_pass_hw_round and not interpreting())  # the interpreter's cast truncates
    opts = dict(num_warps=warps, num_stages=stages, maxnreg=maxnreg)
    sizes = (slices * T * ws_stride, slices * T, 1 + 2 * tiles)
    return ((tiles + L.one_pass_lag) * slices,), consts, opts, sizes, (tiles, slices, cps)


def chunk_args(L: MhcLaunch, T: int, Hd: int, head: bool, fused: bool):
    """What the chunked design launches for a [T, 4, Hd] op (shared with benchmarks/mhc_compile_check.py and
    benchmarks/mhc_sweep.py): (plan, partial, finish, (mix workspace, Σ X² workspace) element counts).
    ``plan`` = (tokens per chunk C, chunks, slices, BLOCK_K chunks per slice, finish parts, hidden dims per
    part); ``partial`` / ``finish`` = (constexprs but DOT_FP32, compile options) of
    ``hc_chunk_partial_kernel`` / ``hc_chunk_finish_kernel``. One workspace serves every chunk: a chunk's
    finish kernel has read it before the next chunk's partial kernel writes it (the same stream). Fused with
    ``chunk_fused_post``: the partial kernel is pre's (it reads the new streams ``post_kernel`` wrote)."""
    post_first = fused and L.chunk_fused_post
    fused = fused and not L.chunk_fused_post
    partial_back = L.chunk_zigzag and post_first  # after post_kernel's forward walk
    finish_back = L.chunk_zigzag and not partial_back
    c, n_chunks, slices, cps, bk = L.chunk_plan(T, Hd, fused)
    bt, _, warps, stages, maxnreg = L.chunk_tile(fused, T)
    parts, h_per_part = L.chunk_finish_plan(c, Hd)
    ws_gate, ws_stride = (4, 4) if head else (8, 24)  # the live columns only (one_pass_pack_ws)
    hw = not interpreting()  # bf16 outputs rounded by the hardware conversion (the interpreter's cast truncates)
    pdl = L.chunk_pdl and not interpreting()
    partial = (dict(HEAD=head, FUSED=fused, BLOCK_T=bt, BLOCK_K=bk, ONE_DOT=min(L.chunk_one_dot, 1) if fused
                    else L.chunk_one_dot, WS_GATE=ws_gate, WS_STRIDE=ws_stride, HW_ROUND=hw, PDL=pdl,
                    STREAM_K=L.chunk_stream_k and not fused, REVERSE=partial_back,
                    FN_LAYOUT=L.chunk_fn_layout if L.chunk_fn_layout < 3 or (L.chunk_stream_k and not fused) else 2,
                    FOLD_EVERY=L.chunk_fold_every if L.chunk_fn_layout == 3 and L.chunk_stream_k and not fused else 1),
               dict(num_warps=warps, num_stages=stages, maxnreg=maxnreg, launch_pdl=pdl))
    finish = (dict(HEAD=head, BLOCK_T=L.chunk_finish_block_t, BLOCK_H=L.chunk_finish_block_h,
                   SUM_UNROLL=L.chunk_sum_unroll, WS_GATE=ws_gate, WS_STRIDE=ws_stride, HW_ROUND=hw, PDL=pdl,
                   REVERSE=finish_back),
              dict(num_warps=L.chunk_finish_warps, launch_pdl=pdl))
    return (c, n_chunks, slices, cps, parts, h_per_part), partial, finish, (slices * c * ws_stride, slices * c)


def launch_chunked(L: MhcLaunch, T: int, Hd: int, ptrs, scale, base, post, comb, out, scalars, *, head: bool,
                   fused: bool) -> None:
    """The chunked design (kernels.py "Design 4"): per chunk of C tokens, the partial kernel (grid: the chunk's
    token tiles × slices) then the finish kernel (grid: hidden parts × the chunk's finish tiles): 2·ceil(T / C)
    launches, into one workspace (one chunk's partials) allocated once per call. ``ptrs`` as ``launch_hc``
    makes them; the finish kernel reads the new streams (fused) or the input ones. Fused with
    ``chunk_fused_post``: per chunk ``post_kernel`` first (3·ceil(T / C) launches), then pre's two kernels on
    the new streams it wrote, so fused == post then pre bit for bit by construction."""
    (c, n_chunks, slices, cps, parts, h_per_part), (pc, po), (fc, fo), (n_mix, n_ssq) = chunk_args(L, T, Hd, head, fused)
    post_first = fused and L.chunk_fused_post
    res_in = ptrs[0]
    if L.chunk_fn_layout:  # the partial kernel reads fn from a [4·Hd, 4·NG] copy (2, 3: transposed)
        ptrs = ptrs[:5] + (split_fn_wide(ptrs[5], transposed=L.chunk_fn_layout >= 2),)
    if post_first:  # the partial kernel reads the new streams: pre's, with the new streams as its input
        ptrs = (ptrs[4],) + ptrs[1:]
    compiled = not interpreting()
    ws = torch.empty(n_mix + n_ssq, dtype=torch.float32, device=ptrs[0].device)
    mix_ws, ssq_ws = ws[:n_mix], ws[n_mix:]
    po = po if compiled else {}
    fo = fo if compiled else {}
    src = ptrs[4] if fused else ptrs[0]
    bt, fbt = pc["BLOCK_T"], fc["BLOCK_T"]
    po_first = {**po, "launch_pdl": False} if po else po  # the call's first launch waits for the kernel before it
    for k in range(n_chunks):
        t0 = k * c
        t_end = min(T, t0 + c)
        if post_first:  # PDL: the post kernel overlaps the previous finish; the partial is an ordinary launch
            grid = (triton.cdiv(t_end - t0, L.post_block_t), triton.cdiv(Hd, L.post_block_h))
            kernels.post_kernel[grid[::-1] if L.chunk_zigzag else grid](
                ptrs[1], res_in, ptrs[2], ptrs[3], ptrs[4], t0, t_end, Hd, BLOCK_T=L.post_block_t,
                BLOCK_H=L.post_block_h, PDL=pc["PDL"], TOKEN_MAJOR=L.chunk_zigzag,
                **({"launch_pdl": pc["PDL"] and k > 0} if compiled else {}))
        kernels.hc_chunk_partial_kernel[(triton.cdiv(t_end - t0, bt) * slices,)](
            *ptrs, mix_ws, ssq_ws, t0, t_end, Hd, c, slices, cps, **pc, DOT_FP32=not compiled,
            **(po if k and not post_first else po_first))
        kernels.hc_chunk_finish_kernel[(parts, triton.cdiv(t_end - t0, fbt))](
            src, mix_ws, ssq_ws, scale, base, post, comb, out, t0, t_end, Hd, c, slices, h_per_part, *scalars,
            **fc, **fo)


def launch_hc(res, x, post_in, comb_in, new, fs, scale, base, post, comb, out, rms_eps, hc_eps, post_mult, iters, *,
              head: bool, fused: bool, launch: MhcLaunch) -> None:
    """Run pre (``fused=False``), fused post+pre (``fused=True``: x, post_in, comb_in, new given) or the head
    (``head=True``: no post / comb outputs) into the given buffers, with the design ``launch`` picks.
    Arguments that an op does not have are None; the kernels never touch them (``scale`` stands in)."""
    T, M, Hd = res.shape
    if T == 0:
        return
    i16 = lambda t: (t if t is not None else res).view(torch.int16)  # noqa: E731
    opt = lambda t: t if t is not None else scale  # noqa: E731
    ptrs = (res.view(torch.int16), i16(x), opt(post_in), opt(comb_in), i16(new), fs)
    scalars = (float(rms_eps), float(hc_eps), float(post_mult), int(iters))
    compiled = not interpreting()
    L = launch
    design = L.design(fused)
    if design == "chunked":
        launch_chunked(L, T, Hd, ptrs, scale, base, opt(post), opt(comb), out.view(torch.int16), scalars, head=head,
                       fused=fused)
        return
    if design == "one_pass":
        grid, consts, opts, (n_mix, n_ssq, n_sync), (tiles, slices, cps) = one_pass_args(L, T, Hd, head, fused)
        ws = torch.empty(n_mix + n_ssq + T * 4, dtype=torch.float32, device=res.device)
        mix_ws, ssq_ws, wpre = ws[:n_mix], ws[n_mix : n_mix + n_ssq], ws[n_mix + n_ssq :]
        sync = torch.zeros(n_sync, dtype=torch.int32, device=res.device)  # ticket | arrivals | READY
        kernels.hc_one_pass_kernel[grid](
            *ptrs, scale, base, opt(post), opt(comb), out.view(torch.int16), mix_ws, ssq_ws, wpre, sync,
            T, Hd, tiles, slices, cps, *scalars, **consts, DOT_FP32=not compiled, **(opts if compiled else {}))
        return
    if design == "one_kernel":
        kw = dict(num_warps=L.num_warps, num_stages=L.num_stages) if compiled else {}
        kernels.hc_kernel[(triton.cdiv(T, L.block_t),)](
            *ptrs, scale, base, opt(post), opt(comb), out.view(torch.int16), T, Hd, *scalars,
            HEAD=head, FUSED=fused, BLOCK_T=L.block_t, BLOCK_K=L.block_k, DOT_FP32=not compiled, **kw)
        return
    n_split, cps = L.split_plan(T, Hd)
    ws = torch.empty(n_split * T * 33, dtype=torch.float32, device=res.device)  # [S, T, 32] mix | [S, T] Σ X²
    mix_ws, ssq_ws = ws[: n_split * T * 32], ws[n_split * T * 32 :]
    kw = dict(num_warps=L.split_warps, num_stages=L.split_stages) if compiled else {}
    kernels.hc_partial_kernel[(n_split, triton.cdiv(T, L.split_block_t))](
        *ptrs, mix_ws, ssq_ws, T, Hd, cps,
        HEAD=head, FUSED=fused, BLOCK_T=L.split_block_t, BLOCK_K=L.split_block_k, DOT_FP32=not compiled, **kw)
    tiles = triton.cdiv(T, L.finish_block_t)
    h_chunks = triton.cdiv(Hd, L.finish_block_h)
    parts = min(h_chunks, max(1, triton.cdiv(L.target_programs, tiles)))
    h_per_part = triton.cdiv(h_chunks, parts) * L.finish_block_h
    parts = triton.cdiv(Hd, h_per_part)
    kw = dict(num_warps=L.finish_warps) if compiled else {}
    kernels.hc_finish_kernel[(parts, tiles)](
        i16(new) if fused else ptrs[0], mix_ws, ssq_ws, scale, base, opt(post), opt(comb), out.view(torch.int16),
        T, Hd, n_split, h_per_part, *scalars, HEAD=head, BLOCK_T=L.finish_block_t, BLOCK_H=L.finish_block_h, **kw)


# ====================================================================================================
# Custom ops: they write into given buffers (the tests poison them first). ``launch`` is
# MhcLaunch.encode(): every launch choice travels in the schema.
# ====================================================================================================


@torch.library.custom_op("dsv4ref::mhc_pre", mutates_args=("post", "comb", "out"))
def mhc_pre(residual: torch.Tensor, fs: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor, out: torch.Tensor, rms_eps: float, hc_eps: float, post_mult: float, iters: int,
            launch: list[int]) -> None:
    launch_hc(residual, None, None, None, None, fs, scale, base, post, comb, out, rms_eps, hc_eps, post_mult, iters,
              head=False, fused=False, launch=MhcLaunch.decode(launch))


@mhc_pre.register_fake
def _(residual, fs, scale, base, post, comb, out, rms_eps, hc_eps, post_mult, iters, launch):
    return None


@torch.library.custom_op("dsv4ref::mhc_fused_post_pre", mutates_args=("new", "post", "comb", "out"))
def mhc_fused_post_pre(x: torch.Tensor, residual: torch.Tensor, post_in: torch.Tensor, comb_in: torch.Tensor,
                       fs: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, new: torch.Tensor, post: torch.Tensor,
                       comb: torch.Tensor, out: torch.Tensor, rms_eps: float, hc_eps: float, post_mult: float,
                       iters: int, launch: list[int]) -> None:
    launch_hc(residual, x, post_in, comb_in, new, fs, scale, base, post, comb, out, rms_eps, hc_eps, post_mult, iters,
              head=False, fused=True, launch=MhcLaunch.decode(launch))


@mhc_fused_post_pre.register_fake
def _(x, residual, post_in, comb_in, fs, scale, base, new, post, comb, out, rms_eps, hc_eps, post_mult, iters, launch):
    return None


@torch.library.custom_op("dsv4ref::mhc_head", mutates_args=("out",))
def mhc_head(hidden: torch.Tensor, fs: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, out: torch.Tensor,
             rms_eps: float, hc_eps: float, launch: list[int]) -> None:
    launch_hc(hidden, None, None, None, None, fs, scale, base, None, None, out, rms_eps, hc_eps, 1.0, 0,
              head=True, fused=False, launch=MhcLaunch.decode(launch))


@mhc_head.register_fake
def _(hidden, fs, scale, base, out, rms_eps, hc_eps, launch):
    return None


@torch.library.custom_op("dsv4ref::mhc_post", mutates_args=("out",))
def mhc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor,
             launch: list[int]) -> None:
    T, M, Hd = residual.shape
    L = MhcLaunch.decode(launch)
    if T:
        grid = (triton.cdiv(T, L.post_block_t), triton.cdiv(Hd, L.post_block_h))
        kernels.post_kernel[grid](x.view(torch.int16), residual.view(torch.int16), post, comb, out.view(torch.int16),
                                  0, T, Hd, BLOCK_T=L.post_block_t, BLOCK_H=L.post_block_h)


@mhc_post.register_fake
def _(x, residual, post, comb, out, launch):
    return None


@torch.library.custom_op("dsv4ref::mhc_sinkhorn", mutates_args=("out",))
def mhc_sinkhorn(logits: torch.Tensor, out: torch.Tensor, iters: int, eps: float, launch: list[int]) -> None:
    n = logits.numel() // 16
    block = MhcLaunch.decode(launch).sinkhorn_block
    if n:
        kernels.sinkhorn_kernel[(triton.cdiv(n, block),)](logits, out, n, iters, eps, BLOCK=block)


@mhc_sinkhorn.register_fake
def _(logits, out, iters, eps, launch):
    return None
