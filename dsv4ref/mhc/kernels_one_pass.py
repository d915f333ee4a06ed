"""The one-pass design of pre / fused post+pre / head (``hc_one_pass_kernel``, ``OnePassLaunch()``): a rung
of the lesson's ladder between split-K and the chunked GPU default, no default itself. Conventions and shared
pieces: ``kernels.py``; its wide-dot partial mix: ``kernels_chunked.py``; the launcher: ``ops.launch_one_pass``.

Why: split-K reads the streams twice from HBM (its finish kernel starts after the whole partial kernel, so only
the last ~third of the 134 MB of streams at T = Hd = 4096 is still in the 50 MB L2), and the one-kernel design
streams all of fn from L2 for every 16 tokens. A token tile's streams (128 tokens × 4 × 4096 × 2 B = 4 MB)
cannot stay in shared memory or registers across the whole K loop, and the weighted sum needs the gates, which
need the whole K loop. So: ONE launch in which the second read of every stream byte follows the first by about
one program's lifetime, and comes from L2.

Work items. A token tile of BLOCK_T tokens × a hidden slice of ``chunks_per_slice`` BLOCK_K chunks (all 4
streams) is one item, numbered v = tile·slices + slice. A program takes its item number from an atomic TICKET
counter (not program_id): a program holding ticket v knows that every ticket < v was taken by a program that is
already running, which makes the one wait below deadlock-free on any GPU, whatever order the hardware starts
programs in (and in the interpreter, which runs programs one after another, the wait is always already
satisfied).

Program v (tile g, slice s) runs two phases:

A. partial of tile g, slice s: the mix GEMM + Σ X² of that slice (``partial_mix_wide``; FUSED: the post first,
   the new streams stored), stored to the workspace. Then it counts itself in (atomic, acq_rel) on tile g's
   arrival counter; the LAST of the tile's ``slices`` programs to arrive sums the partials
   (``sum_partials_rounds``: one fixed order, the same sum whichever program is last, so the result is
   deterministic), runs ``gates`` (post, comb stored), publishes the four pre weights and raises tile g's READY
   flag (release).
B. layer input of tile g − LAG, slice s: waits for that tile's READY flag (acquire; its programs hold tickets
   < v, so they are running, and have usually finished), loads its pre weights and re-reads slice s of tile
   g − LAG's streams (FUSED: the new streams, through L2 only: ``.cg``), read about one program lifetime ago,
   so from L2, for x = Σ_i pre_i·stream_i. The last LAG tiles are finished by LAG·slices extra programs that
   have no phase A.

Every program does the same work (one partial slice + one weighted-sum slice): no tail of finishers. A flag
that is never raised makes the waiting program give up after SPIN_LIMIT polls and write NaN, so a broken
protocol shows up as failed checks, not as a hung run.

What limits it, measured on the H200 (``benchmarks/mhc.md``): the tile's last arrival sums every slice's
partial and runs Sinkhorn while the next tile's programs wait on its flag; the chunked design, whose programs
never wait for each other, replaced it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import gates, layer_input_range, token_tile
from .kernels_chunked import partial_mix_wide, store_partial_packed, sum_partials_rounds


@triton.jit
def hc_one_pass_kernel(
    res_ptr,  # residual [T, 4, Hd] as int16 (FUSED: the streams before the post); contiguous, as are all below
    x_ptr,  # FUSED: x [T, Hd] as int16
    post_in_ptr,  # FUSED: the post weights [T, 4] fp32 the new streams are made with
    comb_in_ptr,  # FUSED: comb [T, 4, 4] fp32, source i -> destination j
    new_ptr,  # FUSED: the new residual [T, 4, Hd] as int16 (written in phase A, re-read in phase B)
    fn_split_ptr,  # split_fn(fn): [G, 3, 4·Hd, 16] bf16
    scale_ptr,  # [3] fp32 ([1] head)
    base_ptr,  # [24] fp32 ([4] head)
    post_ptr,  # [T, 4] fp32 out (not HEAD)
    comb_ptr,  # [T, 4, 4] fp32 out (not HEAD)
    out_ptr,  # int16 view of the layer input (head: the output) [T, Hd] bf16
    mix_ws_ptr,  # [slices, T, WS_STRIDE] fp32 workspace: partial mixes
    ssq_ws_ptr,  # [slices, T] fp32 workspace: partial Σ X²
    pre_ws_ptr,  # [T, 4] fp32 workspace: the pre weights (head: the gates), published per tile
    sync_ptr,  # [1 + 2·n_tiles] int32, ZEROED before the launch: ticket | arrivals per tile | READY per tile
    T,
    Hd,
    n_tiles,  # cdiv(T, BLOCK_T)
    slices,  # hidden slices per tile (the grid is (n_tiles + LAG)·slices programs)
    chunks_per_slice,  # BLOCK_K chunks per slice
    rms_eps,
    hc_eps,
    post_mult,
    iters,
    HEAD: tl.constexpr,
    FUSED: tl.constexpr,
    BLOCK_T: tl.constexpr,  # >= 16 (the M side of tl.dot)
    BLOCK_K: tl.constexpr,  # >= 16 (the K side of tl.dot)
    BLOCK_H: tl.constexpr,  # hidden dims per chunk of phase B (the weighted sum)
    LAG: tl.constexpr,  # >= 1: phase B finishes the tile LAG tiles behind phase A's
    SPIN_LIMIT: tl.constexpr,  # polls of a READY flag before giving up (then that slice is written as NaN)
    SUM_UNROLL: tl.constexpr,  # slices' partials per load round of the last arrival's sum
    ONE_DOT: tl.constexpr,  # partial_mix_wide: 2 one load of the 4 streams' chunk, 1 four joined (FUSED: 1)
    WS_GATE: tl.constexpr,  # gate columns kept per workspace row (pre 8, head 4: the live ones)
    WS_STRIDE: tl.constexpr,  # workspace row length (pre 24, head 4)
    HW_ROUND: tl.constexpr,  # compiled only: bf16 outputs rounded by the hardware conversion (bf16_bits)
    DOT_FP32: tl.constexpr,
):
    tl.static_assert(BLOCK_K >= 16)
    tl.static_assert(BLOCK_T >= 16)
    tl.static_assert(LAG >= 1)
    NG: tl.constexpr = 16 if HEAD else 32
    v = tl.atomic_add(sync_ptr, 1)  # the ticket: this program's work item
    tile = v // slices
    s = v % slices
    h_begin = s * chunks_per_slice * BLOCK_K
    h_end = tl.minimum(h_begin + chunks_per_slice * BLOCK_K, Hd)

    # ---- phase A: the partial mix of (tile, slice s); the tile's last arrival runs the gates ---------
    if tile < n_tiles:
        rows, rm, W = token_tile(tile, T, post_in_ptr, comb_in_ptr, FUSED, BLOCK_T)
        acc, ssq = partial_mix_wide(
            res_ptr,
            x_ptr,
            new_ptr,
            fn_split_ptr,
            W,
            rows,
            rm,
            h_begin,
            h_end,
            Hd,
            DOT_FP32,
            FUSED,
            NG,
            BLOCK_T,
            BLOCK_K,
            ONE_DOT,
            HW_ROUND,
        )
        store_partial_packed(mix_ws_ptr, ssq_ws_ptr, s.to(tl.int64) * T + rows, rm, acc, ssq, NG, WS_GATE, WS_STRIDE)
        tl.debug_barrier()  # every thread's stores (partials; FUSED: new streams) before the release below
        if tl.atomic_add(sync_ptr + 1 + tile, 1, sem="acq_rel", scope="gpu") == slices - 1:  # the last one
            acc_g, acc_c, ssq = sum_partials_rounds(
                mix_ws_ptr, ssq_ws_ptr, rows, rm, T, slices, HEAD, BLOCK_T, SUM_UNROLL, WS_GATE, WS_STRIDE, WS_GATE, 16, ".cg"
            )
            w0, w1, w2, w3 = gates(
                acc_g,
                acc_c,
                ssq,
                4 * Hd,
                rows,
                rm,
                scale_ptr,
                base_ptr,
                post_ptr,
                comb_ptr,
                T,
                rms_eps,
                hc_eps,
                post_mult,
                iters,
                True,
                HEAD,
                BLOCK_T,
            )
            tl.store(pre_ws_ptr + rows * 4, w0, mask=rm)
            tl.store(pre_ws_ptr + rows * 4 + 1, w1, mask=rm)
            tl.store(pre_ws_ptr + rows * 4 + 2, w2, mask=rm)
            tl.store(pre_ws_ptr + rows * 4 + 3, w3, mask=rm)
            tl.debug_barrier()
            tl.atomic_xchg(sync_ptr + 1 + n_tiles + tile, 1, sem="release", scope="gpu")

    # ---- phase B: the layer input of (tile − LAG, slice s), from L2 ---------------------------------------
    prev = tile - LAG
    if (prev >= 0) & (prev < n_tiles):
        rows = prev.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        rm = rows < T
        ready = tl.atomic_add(sync_ptr + 1 + n_tiles + prev, 0, sem="acquire", scope="gpu")
        polls = 0
        while (ready == 0) & (polls < SPIN_LIMIT):
            ready = tl.atomic_add(sync_ptr + 1 + n_tiles + prev, 0, sem="acquire", scope="gpu")
            polls += 1
        # a flag never raised (impossible while the ticket order holds) gives NaN, never a hang or a guess
        bad = tl.where(ready != 0, 0.0, float("nan"))
        w0 = tl.load(pre_ws_ptr + rows * 4, mask=rm, other=0.0, cache_modifier=".cg") + bad
        w1 = tl.load(pre_ws_ptr + rows * 4 + 1, mask=rm, other=0.0, cache_modifier=".cg") + bad
        w2 = tl.load(pre_ws_ptr + rows * 4 + 2, mask=rm, other=0.0, cache_modifier=".cg") + bad
        w3 = tl.load(pre_ws_ptr + rows * 4 + 3, mask=rm, other=0.0, cache_modifier=".cg") + bad
        if FUSED:
            src_ptr = new_ptr
        else:
            src_ptr = res_ptr
        layer_input_range(src_ptr, out_ptr, rows, rm, h_begin, h_end, Hd, w0, w1, w2, w3, BLOCK_H, FUSED, HW_ROUND)
