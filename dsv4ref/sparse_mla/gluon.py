"""Hopper-only fast path for sparse MLA decode, written in Gluon (``triton.experimental.gluon``).

Same math and contract as :func:`dsv4ref.sparse_mla.decode` (docs/sparse_mla.md; page layout:
docs/formats.md): every head of token ``t`` attends to the listed slots of one
or two FP8 paged caches with one softmax, the sink enters the denominator only, ``−1`` entries and
entries past the lengths are ignored, a row with no valid entry gives ``out = 0`` and ``lse = −inf``,
and P is rounded to bf16 before P·V (FlashMLA's numerics, as in the portable kernel).

**What runs by default** (the flags of :data:`VARIANT`; every number below is the H200's, Triton 3.6):

* **H > 16: one program per (token, 64 heads, list split)**, :func:`_ws_kernel` with ``ROLES``. wgmma's M is
  64 rows per warpgroup, so 64 heads are one MMA tile (H = 128 takes two programs). 12 warps in three
  roles, joined by mbarriers:

  - **producer** (4 warps, 104 registers, :func:`_ws_producer_packed`): gathers the 584-byte rows of each
    chunk of 64 candidates as int64 words, half a chunk at a time with the slot indices fetched half a chunk
    ahead, dequantises e4m3 × 2^(scale − 127) to bf16 and stores the tile into a 2-stage ring of shared K
    tiles [64, 512] (NVMMA 128-byte swizzle, read by wgmma directly); arrives on ``ready[stage]``;
  - **scorer** (4 warps, the rest of the registers, :func:`_roles_scorer`): brings the query to shared
    memory by cp.async while the producer already fetches (``QLATE``), then per chunk S = Q·Kᵀ as one
    n = 64 wgmma, the online softmax with every row max and sum inside its own warpgroup, P (bf16) and the
    rescale factor α to a 2-deep shared buffer (``pfull`` / ``pfree``) and its half of the output,
    O[:, 0:256] += P · V[:, 0:256];
  - **P·V warpgroup** (4 warps, 160 registers, :func:`_roles_pv`): rescales and accumulates
    O[:, 256:512] from the shared P. Each half accumulator is 64 × 256 fp32, 128 registers per thread: no
    spill. Both consumers release the stage on ``empty`` (two arrivals). V is the same K tile: one load.

  Shared memory: Q 64 KB, two K stages 128 KB, P 16 KB: about 215 KB, so one program per SM.
* **H <= 16: the narrow kernel** (``NARROW``, :func:`_narrow_kernel`): the products transposed so the heads
  are wgmma's N (16) instead of its M: Sᵀ[64, 16] = K·Qᵀ, the softmax down each column, Oᵀ[512, 16] += Vᵀ·Pᵀ
  with Vᵀ the same K tile read transposed. Oᵀ is 64 registers per thread, which leaves room for **two**
  producer warpgroups (184 registers each; each dequantises half of every chunk) and a third K stage.
* **The list split** (flash-decoding, :func:`config`): where one program per (token, head block) would leave
  SMs idle, each token's list is split into S ranges of whole chunks; a split writes its unnormalised fp32
  accumulator ``po [T, S, H, 512]`` and its (log2 max, sum) ``pml [T, S, H, 2]``, and :func:`_merge_kernel`
  weighs, adds, normalises and applies the sink once.
* **The epilogue**: out = acc / l · σ(lse − sink) in bf16. With S = 1 the output leaves through a released K
  stage as 16-byte row vectors (``OSMEM``), not the accumulator layout's 4-byte pieces. The query's
  NaN / ±inf scan runs after the loop, and only when a head counted no candidate (``LAZY_SCAN``): a
  non-finite query row already makes l NaN through its scores; only an empty row needs the scan.

T = 64, H200, `benchmarks/RESULTS.md`: 35.7 / 69.8 / 54.2 µs at H 64 K 640 / H 128 K 1152 / H 16 K 2048,
22.2 / 35.2 / 35.5 % of max(bytes / copy BW, FLOP / bf16 rate); the portable kernel 78.5 / 185.2 / 98.1 µs.
What limits each shape (the fixed cost at H 64, the scorer's serial chain at H 128) and every variant tried,
with its log: `benchmarks/sparse_mla.md`; the ladder from the seed's path to this kernel: notebook 04.

The other values of the flags (:data:`VARIANT`, each described beside it below) keep every step of the
ladder re-measurable; `benchmarks/sparse_mla.md` has the figures and logs of each.

This module imports Gluon lazily and guarded: on a CPU machine (the Triton interpreter) or a Triton
without Gluon it still imports; :func:`available` says whether the backend can run here.
"""

from __future__ import annotations

import torch

from dsv4ref import formats as F
from dsv4ref.device import capability, interpreting, sm_count

__all__ = ["available", "supports", "decode_gluon", "config"]

LOG2E = 1.4426950408889634
BLOCK_H = 64  # heads per program (wgmma M = 64 per warpgroup); smaller H is padded with masked rows
BLOCK_N = 64  # candidates per chunk
NUM_WARPS = 8  # the column-split consumers (ROLES = KSPLIT = 0) and _decode_kernel: two warpgroups
# kernel variants (constexpr flags), measured in benchmarks/experiments/sparse_mla_gluon.py:
#   WS: the warp-specialised kernel (4 producer warps dequantise into an NS-stage ring, 8 consumer warps run
#       the MMAs); OVERLAP: its next QKᵀ is issued behind the current P·V; PRODUCER_REGS: the producer
#       warps' register budget (setmaxnreg; the consumers get the rest); DEEP: the producer fetches slot
#       indices half a chunk ahead of the row loads (else with the rows).
#       PACKED: the producer keeps rows as int64 words, 1-3 half chunks in registers, or 4: one in registers
#       and the next in flight into shared memory by cp.async (0: the byte-wise producer, one register per
#       byte). KSPLIT: two 4-warp consumer partitions splitting QKᵀ by dims, partial scores swapped through
#       shared memory (2: as two score halves; ~200 registers per consumer thread, spilled in its loop).
#       ROLES: two 4-warp consumer partitions with different roles: a scorer (all of QKᵀ as n = 64 wgmma, the
#       softmax inside one warpgroup, half of P·V) and a P·V warpgroup on PV_REGS registers (the other half,
#       P read from shared memory). ROLES = KSPLIT = 0: two warpgroups splitting every MMA by columns
#       (QKᵀ as n = 32 wgmma in each, the softmax's row reductions crossing them).
#       QLATE (ROLES): the query reaches shared memory by cp.async inside the scorer partition.
#       OSMEM (ROLES, split 1): the bf16 output leaves through a free K stage as 16-byte row vectors.
#       LAZY_SCAN (ROLES with QLATE): the query's NaN / ±inf scan after the loop, only for a head with nothing
#       counted.
#   NARROW (H <= NARROW_H only): the narrow-head kernel (heads as the MMAs' N, two producer warpgroups on
#       NARROW_REGS registers each, an NARROW_NS-stage ring), :func:`_narrow_kernel`.
#   Non-specialised kernel (WS False): PIPE: chunk i+1's raw bytes are loaded one iteration ahead and held
#       in registers (else loaded after the P·V issue, latency exposed); P_SMEM: P reaches the P·V MMA through
#       shared memory (else registers).
#   DIAG (not in VARIANT; timing only, wrong results): 1 no row loads, 2 no MMA, 3 neither, 4 no chunks,
#       5 also no query load, 6 also no epilogue stores.
# why these are the defaults: each was faster on the H200 than the kernel it replaced, measured in the same calls
# with every check passing at H 16 / 64 / 128 (benchmarks/sparse_mla.md): PACKED=1 (the byte-wise producer
# spilled), ROLES=1 (the column-split pair crosses warpgroups for every row reduction), QLATE=1 (about 1 µs at
# H 64); NARROW, OSMEM and LAZY_SCAN: benchmarks/sparse_mla.md, "the narrow kernel; the fixed cost taken apart"
VARIANT = dict(WS=True, NS=2, OVERLAP=False, PRODUCER_REGS=104, DEEP=True, PIPE=False, P_SMEM=True, PACKED=1,
               ROLES=1, PV_REGS=160, QLATE=1, NARROW=1, NARROW_NS=3, NARROW_REGS=184, OSMEM=1, LAZY_SCAN=1)
NARROW_H = 16  # heads per program of the narrow kernel (wgmma N)
_LAST: dict = {}  # the last compiled decode kernel (diagnostics: n_regs, n_spills, shared)

_IMPORT_ERROR: BaseException | None = None
_K = None  # the compiled-kernel namespace, built on first use

try:  # Gluon ships with Triton >= 3.5; the Hopper ops live in its nvidia.hopper namespace
    from triton.experimental import gluon as _gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # the names that moved between Triton releases (one bridge, also for benchmarks/experiments/gather_probe.py):
    # thread_barrier was renamed barrier; cp.async from global to shared memory is async_copy_global_to_shared
    # in Triton 3.6, async_load later
    _bar = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier")
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except Exception as e:  # pragma: no cover - depends on the installed Triton
    _gluon = None
    _IMPORT_ERROR = e


def _define_kernels():
    """Define the Gluon kernels (only called where Gluon imported). Returns a dict of them."""

    @_gluon.jit
    def _slots(v, n1, stop, i1_ptr, i2_ptr):
        """Virtual candidate ids v (pool 1 entries [0, n1), then pool 2's) -> (slot int64 >= 0, from pool 1,
        valid). Entries at or past ``stop`` (the split's end, itself <= the token's length) and −1 entries are
        invalid and read nothing."""
        live = v < stop
        in1 = v < n1
        s1 = gl.load(i1_ptr + v, mask=live & in1, other=-1)
        s2 = gl.load(i2_ptr + (v - n1), mask=live & (v >= n1), other=-1)
        slot = gl.where(in1, s1, s2)
        ok = slot >= 0
        return gl.maximum(slot, 0).to(gl.int64), in1, ok

    @_gluon.jit
    def _load_raw(v0, n1, stop, i1_ptr, i2_ptr, c1_u8, c1_i16, c1_i64, bs1, ps1, c2_u8, c2_i16, c2_i64, bs2, ps2,
                  BN: gl.constexpr, LU: gl.constexpr):
        """Issue the global loads of one chunk: 7 e4m3 tiles [BN, 64] uint8, the RoPE tile [BN, 64] bf16 bits
        (int16) and the 8 scale bytes of each row as one int64. Masked rows load zeros."""
        rows = v0 + gl.arange(0, BN, gl.SliceLayout(1, LU))
        slot, in1, ok = _slots(rows, n1, stop, i1_ptr, i2_ptr)
        return _load_rows(slot, in1, ok, c1_u8, c1_i16, c1_i64, bs1, ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, LU)

    @_gluon.jit
    def _row_words(slot, in1, bs1, ps1, bs2, ps2):
        """int64-word indices of a row's 576 data bytes (16-byte aligned) and of its 8 scale bytes, in the
        paged layout (page = slot // block, the data of the page's rows first, then their scale words)."""
        bs = gl.where(in1, bs1, bs2)
        ps = gl.where(in1, ps1, ps2)
        page = slot // bs
        off = slot - page * bs
        return (page * ps + off * 576) // 8, (page * ps + bs * 576 + off * 8) // 8

    @_gluon.jit
    def _load_rows(slot, in1, ok, c1_u8, c1_i16, c1_i64, bs1, ps1, c2_u8, c2_i16, c2_i64, bs2, ps2,
                   LU: gl.constexpr):
        """The global loads of rows whose slots are known (see :func:`_load_raw`)."""
        dw, sidx = _row_words(slot, in1, bs1, ps1, bs2, ps2)
        data = dw * 8  # byte offset of the row's 576 data bytes; sidx: int64-word index of its 8 scale bytes
        ridx = (data + 448) // 2  # int16 index of the 64 RoPE values
        col = gl.arange(0, 64, gl.SliceLayout(0, LU))
        m2 = ok[:, None] & (col[None, :] >= 0)
        p8 = gl.where(in1[:, None], c1_u8 + data[:, None], c2_u8 + data[:, None]) + col[None, :]
        r0 = gl.load(p8, mask=m2, other=0)
        r1 = gl.load(p8 + 64, mask=m2, other=0)
        r2 = gl.load(p8 + 128, mask=m2, other=0)
        r3 = gl.load(p8 + 192, mask=m2, other=0)
        r4 = gl.load(p8 + 256, mask=m2, other=0)
        r5 = gl.load(p8 + 320, mask=m2, other=0)
        r6 = gl.load(p8 + 384, mask=m2, other=0)
        p16 = gl.where(in1[:, None], c1_i16 + ridx[:, None], c2_i16 + ridx[:, None]) + col[None, :]
        rr = gl.load(p16, mask=m2, other=0)
        p64 = gl.where(in1, c1_i64 + sidx, c2_i64 + sidx)
        sc = gl.load(p64, mask=ok, other=0)
        return r0, r1, r2, r3, r4, r5, r6, rr, sc

    @_gluon.jit
    def _tile(raw, sc, b: gl.constexpr):
        """e4m3 bytes × 2^(scale byte b − 127) -> bf16 (exact: every such product is a bf16 number)."""
        e = ((sc >> (8 * b)) & 0xFF).to(gl.int32)
        # E8M0 as the format defines it (docs/formats.md): 2^(e − 127); byte 0 is 2^-127, byte 255 is NaN
        bits = gl.where(e == 0, 0x00400000, gl.where(e == 255, 0x7FC00000, e << 23))
        scale = bits.to(gl.float32, bitcast=True)
        x = raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]
        return x.to(gl.bfloat16)

    @_gluon.jit
    def _dequant_store(kb, r0, r1, r2, r3, r4, r5, r6, rr, sc):
        """Write one chunk's dequantised rows [BN, 512] bf16 into the shared buffer ``kb``."""
        kb.slice(0, 64, dim=1).store(_tile(r0, sc, 0))
        kb.slice(64, 64, dim=1).store(_tile(r1, sc, 1))
        kb.slice(128, 64, dim=1).store(_tile(r2, sc, 2))
        kb.slice(192, 64, dim=1).store(_tile(r3, sc, 3))
        kb.slice(256, 64, dim=1).store(_tile(r4, sc, 4))
        kb.slice(320, 64, dim=1).store(_tile(r5, sc, 5))
        kb.slice(384, 64, dim=1).store(_tile(r6, sc, 6))
        kb.slice(448, 64, dim=1).store(rr.to(gl.bfloat16, bitcast=True))

    @_gluon.jit
    def _candidate_range(t, sp, chunk, K1, l1_ptr, K2, l2_ptr, HAS_LEN1: gl.constexpr, HAS_POOL2: gl.constexpr,
                         HAS_LEN2: gl.constexpr):
        """Token t's candidates are pool 1's valid prefix then pool 2's, concatenated; list split ``sp`` owns
        ``[start, stop)`` of them. Returns (n1 = pool 1's valid count, start, stop)."""
        n1 = K1
        if HAS_LEN1:
            n1 = gl.minimum(gl.load(l1_ptr + t), K1).to(gl.int32)  # int64 lengths too: counts index smem stages
        n2 = 0
        if HAS_POOL2:
            n2 = K2
            if HAS_LEN2:
                n2 = gl.minimum(gl.load(l2_ptr + t), K2).to(gl.int32)
        start = sp * chunk
        return n1, start, gl.minimum(start + chunk, n1 + n2)

    @_gluon.jit
    def _head_scale(m, l, h, H, sink_ptr, HAS_SINK: gl.constexpr):
        """Per head h (any layout), from the final running max m (log2 units) and sum l: (nonempty, lse in
        natural log, the factor f = σ(lse − sink) / l that turns the accumulator into the output). An empty
        head (l = 0) gets f = 0; NaN != 0, so a poisoned head is never taken for an empty one; the sink
        enters the denominator only: −inf gives σ = 1, +inf gives 0."""
        if HAS_SINK:
            sink = gl.load(sink_ptr + h, mask=h < H, other=-float("inf"))
        else:
            sink = gl.full(h.shape, -float("inf"), gl.float32, h.type.layout)
        nonempty = l != 0
        l_safe = gl.where(nonempty, l, 1.0)
        m_s = gl.where(nonempty, m, 0.0)
        lse = (m_s + gl.log2(l_safe)) * 0.6931471805599453
        corr = 1.0 / (1.0 + gl.exp(sink - lse))
        return nonempty, lse, gl.where(nonempty, corr / l_safe, 0.0)

    @_gluon.jit
    def _program(chunk, K1, l1_ptr, K2, l2_ptr, i1_ptr, i1_st, i2_ptr, i2_st, BN: gl.constexpr,
                 HAS_LEN1: gl.constexpr, HAS_POOL2: gl.constexpr, HAS_LEN2: gl.constexpr, DIAG: gl.constexpr):
        """What a program of the decode kernels owns: token t (as int64), head block hb, list split
        sp, its candidate range (n1, start, stop: :func:`_candidate_range`), its chunk count n_it (DIAG >= 4,
        timing only: none) and the token's two slot rows i1, i2."""
        t = gl.program_id(0)
        t64 = t.to(gl.int64)
        sp = gl.program_id(2)
        n1, start, stop = _candidate_range(t, sp, chunk, K1, l1_ptr, K2, l2_ptr, HAS_LEN1, HAS_POOL2, HAS_LEN2)
        n_it = gl.maximum(gl.cdiv(stop - start, BN), 0)
        if DIAG >= 4:  # timing diagnostics only (wrong results): no chunk at all, the fixed cost alone (5: and
            n_it = 0  # no query load, 6: and no epilogue stores; ROLES and the narrow kernel)
        return t64, gl.program_id(1), sp, n1, start, stop, n_it, i1_ptr + t64 * i1_st, i2_ptr + t64 * i2_st

    @_gluon.jit
    def _nonfinite_rows(x):
        """[R, C] bf16 -> [R] int32: 1 where the row holds a NaN or ±inf (exponent bits all ones), else 0."""
        expo = x.to(gl.int16, bitcast=True) & 0x7F80
        return gl.max((expo == 0x7F80).to(gl.int32), axis=1)

    @_gluon.jit
    def _q_to_shared(q_ptr, t64, q_st, q_sh, hb, H, BH: gl.constexpr, LQ: gl.constexpr, SH_L: gl.constexpr):
        """Token t's query rows of head block hb, [BH, 512] bf16, in shared memory (padded heads: zero rows),
        and each head's poison word [BH] fp32: NaN where the query row holds a NaN or ±inf, else 0. The
        epilogue adds it to l, so such a row comes out NaN even with no valid candidate (the contract), where
        its scores alone would leave the empty-row answer."""
        hq = hb * BH + gl.arange(0, BH, gl.SliceLayout(1, LQ))
        dq = gl.arange(0, 512, gl.SliceLayout(0, LQ))
        q = gl.load(q_ptr + t64 * q_st + hq[:, None].to(gl.int64) * q_sh + dq[None, :],
                    mask=(hq[:, None] < H) & (dq[None, :] >= 0), other=0.0)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, 512], SH_L)
        q_smem.store(q)
        bad = _nonfinite_rows(q) != 0
        qbad_smem = gl.allocate_shared_memory(gl.float32, [BH], gl.SwizzledSharedLayout(
            vec=1, per_phase=1, max_phase=1, order=[0]))
        qbad_smem.store(gl.where(bad, float("nan"), 0.0))
        return q_smem, qbad_smem

    @_gluon.jit
    def _q_async(q_ptr, t64, q_st, q_sh, hb, H, q_smem, qbad_smem, BH: gl.constexpr, SCAN: gl.constexpr = True):
        """What :func:`_q_to_shared` does, by the 4 warps of a partition and without holding the query in
        registers: cp.async copies (padded heads zero-filled), then (SCAN) the NaN / ±inf scan
        (:func:`_q_scan`). On return q_smem is ready for wgmma (fenced for the async proxy)."""
        LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16 bytes per copy
        hq = hb * BH + gl.arange(0, BH, gl.SliceLayout(1, LQ))
        dq = gl.arange(0, 512, gl.SliceLayout(0, LQ))
        _async_load(
            q_smem, q_ptr + t64 * q_st + hq[:, None].to(gl.int64) * q_sh + dq[None, :],
            mask=(hq[:, None] < H) & (dq[None, :] >= 0))
        async_copy.commit_group()
        async_copy.wait_group(0)
        _bar()  # every thread's copies have landed
        if SCAN:
            _q_scan(q_smem, qbad_smem, BH)
        fence_async_shared()  # the copies were generic-proxy writes; wgmma reads through the async proxy
        _bar()

    @_gluon.jit
    def _q_scan(q_smem, qbad_smem, BH: gl.constexpr):
        """qbad_smem [BH] = NaN where the query row in q_smem holds a NaN or ±inf, else 0: the rows read back
        a quarter of the columns at a time by the 4 warps of a partition."""
        LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        bad = gl.zeros([BH], gl.int32, gl.SliceLayout(1, LQ))
        for j in gl.static_range(4):
            bad = gl.maximum(bad, _nonfinite_rows(q_smem.slice(128 * j, 128, dim=1).load(LQ)))
        qbad_smem.store(gl.where(bad != 0, float("nan"), 0.0))

    @_gluon.jit
    def _decode_kernel(
        q_ptr, q_st, q_sh,  # q [T, H, 512] bf16, last dim contiguous
        sink_ptr,  # [H] fp32 (HAS_SINK)
        out_ptr, lse_ptr,  # [T, H, 512] bf16, [T, H] fp32 (SPLITS == 1)
        po_ptr, pml_ptr,  # [T, SPLITS, H, 512] fp32 partial acc, [T, SPLITS, H, 2] (m, l) log2 domain (SPLITS > 1)
        c1_u8, c1_i16, c1_i64, i1_ptr, l1_ptr, K1, i1_st, bs1, ps1,  # pool 1: cache views, indices, lengths
        c2_u8, c2_i16, c2_i64, i2_ptr, l2_ptr, K2, i2_st, bs2, ps2,  # pool 2 (HAS_POOL2)
        H, qk_scale, chunk,
        HAS_LEN1: gl.constexpr, HAS_POOL2: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_SINK: gl.constexpr,
        SPLITS: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, P_SMEM: gl.constexpr,
        PIPE: gl.constexpr,
    ):
        gl.static_assert(BH == 64)
        gl.static_assert(BN == 64)
        # layouts: two warpgroups split every MMA's N (columns); raw loads 16 bytes per thread
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BN // 2, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        LU: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])
        LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        SH_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        # this program's token, head block, list split and candidate range (the two pools' valid prefixes,
        # concatenated, then split) in chunks of BN
        t64, hb, sp, n1, start, stop, n_it, i1, i2 = _program(chunk, K1, l1_ptr, K2, l2_ptr, i1_ptr, i1_st, i2_ptr,
                                                              i2_st, BN, HAS_LEN1, HAS_POOL2, HAS_LEN2, 0)

        # Q -> shared memory (padded heads: zero rows)
        q_smem, qbad_smem = _q_to_shared(q_ptr, t64, q_st, q_sh, hb, H, BH, LQ, SH_L)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 512], SH_L)
        if P_SMEM:
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], SH_L)

        # prologue: chunk 0 dequantised into buffer 0, chunk 1's raw bytes in registers
        r0, r1, r2, r3, r4, r5, r6, rr, sc = _load_raw(start, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64, bs1, ps1,
                                                       c2_u8, c2_i16, c2_i64, bs2, ps2, BN, LU)
        _dequant_store(k_smem.index(0), r0, r1, r2, r3, r4, r5, r6, rr, sc)
        if PIPE:
            r0, r1, r2, r3, r4, r5, r6, rr, sc = _load_raw(start + BN, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64,
                                                           bs1, ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, BN, LU)
        fence_async_shared()
        _bar()

        m = gl.full([BH], -float("inf"), gl.float32, gl.SliceLayout(1, S_L))
        l = gl.zeros([BH], gl.float32, gl.SliceLayout(1, S_L))
        acc = gl.zeros([BH, 512], gl.float32, O_L)
        s0 = gl.zeros([BH, BN], gl.float32, S_L)
        for it in range(n_it):
            cur = it % 2
            kb = k_smem.index(cur)
            v0 = start + it * BN
            s = warpgroup_mma(q_smem, kb.permute((1, 0)), s0, use_acc=False)
            cols = v0 + gl.arange(0, BN, gl.SliceLayout(0, S_L))
            _, _, okc = _slots(cols, n1, stop, i1, i2)
            s = s * qk_scale
            s = gl.where(okc[None, :], gl.where(s == -float("inf"), float("nan"), s), -float("inf"))
            m_new = gl.maximum(m, gl.max(s, axis=1))
            m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = gl.exp2(m - m_safe)
            p = gl.exp2(s - m_safe[:, None])
            l = l * alpha + gl.sum(p, axis=1)
            m = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            if P_SMEM:  # P through shared memory: no P registers live while the MMA runs
                p_smem.store(p.to(gl.bfloat16))
                fence_async_shared()
                _bar()
                acc = warpgroup_mma(p_smem, kb, acc, is_async=True)
            else:  # P as the register A operand (each warpgroup holds all 64 columns)
                p_op = gl.convert_layout(p.to(gl.bfloat16), P_L)
                acc = warpgroup_mma(p_op, kb, acc, is_async=True)
            if PIPE:  # while the tensor cores run P·V: chunk it+1 -> the other buffer, chunk it+2's loads issued
                _dequant_store(k_smem.index(1 - cur), r0, r1, r2, r3, r4, r5, r6, rr, sc)
                r0, r1, r2, r3, r4, r5, r6, rr, sc = _load_raw(v0 + 2 * BN, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64,
                                                               bs1, ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, BN, LU)
            else:  # load and dequantise chunk it+1 only now (its load latency is exposed)
                a0, a1, a2, a3, a4, a5, a6, ar, asc = _load_raw(v0 + BN, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64,
                                                                bs1, ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, BN, LU)
                _dequant_store(k_smem.index(1 - cur), a0, a1, a2, a3, a4, a5, a6, ar, asc)
            fence_async_shared()
            if P_SMEM:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            else:
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            _bar()

        l = l + qbad_smem.load(gl.SliceLayout(1, S_L))  # NaN for a query row holding NaN / ±inf
        h_o = hb * BH + gl.arange(0, BH, gl.SliceLayout(1, O_L))
        d_o = gl.arange(0, 512, gl.SliceLayout(0, O_L))
        h_s = hb * BH + gl.arange(0, BH, gl.SliceLayout(1, S_L))
        if SPLITS == 1:
            nonempty, lse, f = _head_scale(m, l, h_s, H, sink_ptr, HAS_SINK)
            out = acc * gl.convert_layout(f, gl.SliceLayout(1, O_L))[:, None]
            row = t64 * H + h_o.to(gl.int64)
            gl.store(out_ptr + row[:, None] * 512 + d_o[None, :], out.to(gl.bfloat16),
                     mask=(h_o[:, None] < H) & (d_o[None, :] >= 0))
            gl.store(lse_ptr + t64 * H + h_s, gl.where(nonempty, lse, -float("inf")), mask=h_s < H)
        else:
            row = (t64 * SPLITS + sp) * H + h_o.to(gl.int64)
            gl.store(po_ptr + row[:, None] * 512 + d_o[None, :], acc, mask=(h_o[:, None] < H) & (d_o[None, :] >= 0))
            row_s = (t64 * SPLITS + sp) * H + h_s.to(gl.int64)
            gl.store(pml_ptr + row_s * 2, m, mask=h_s < H)
            gl.store(pml_ptr + row_s * 2 + 1, l, mask=h_s < H)

    @_gluon.jit
    def _merge_kernel(po_ptr, pml_ptr, sink_ptr, out_ptr, lse_ptr, H, HAS_SINK: gl.constexpr, SPLITS: gl.constexpr):
        """Merge the SPLITS partial softmax states of one (token, head); apply the sink once (pitfalls #20)."""
        ML: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, 4], [1, 0])
        t = gl.program_id(0).to(gl.int64)
        h = gl.program_id(1)
        s = gl.arange(0, SPLITS, gl.SliceLayout(1, ML))
        d = gl.arange(0, 512, gl.SliceLayout(0, ML))
        row = (t * SPLITS + s) * H + h
        m_s = gl.load(pml_ptr + row * 2)
        l_s = gl.load(pml_ptr + row * 2 + 1)
        m = gl.max(m_s, axis=0)
        m_safe = gl.where(m == -float("inf"), 0.0, m)
        w = gl.exp2(m_s - m_safe)  # empty splits (m_s = −inf) weigh 0
        l = gl.sum(w * l_s, axis=0)
        acc = gl.sum(gl.load(po_ptr + row[:, None] * 512 + d[None, :]) * w[:, None], axis=0)
        if HAS_SINK:
            sink = gl.load(sink_ptr + h)
        else:
            sink = -float("inf")
        nonempty = l != 0  # NaN != 0: a poisoned row is never taken for an empty one
        l_safe = gl.where(nonempty, l, 1.0)
        lse = (m_safe + gl.log2(l_safe)) * 0.6931471805599453
        corr = 1.0 / (1.0 + gl.exp(sink - lse))
        out = gl.where(nonempty, acc * (corr / l_safe), 0.0)
        o = t * H + h
        gl.store(out_ptr + o * 512 + d, out.to(gl.bfloat16))
        gl.store(lse_ptr + o, gl.where(nonempty, lse, -float("inf")))


    @_gluon.jit
    def _softmax_step(s, m, l, okc, qk_scale):
        """One online-softmax step on the raw scores s [BH, BN] (log2 domain after qk_scale); returns
        (p, alpha, m, l). Masked columns (okc false) get p = 0; m_safe keeps every exponent finite (§7.1).
        Non-finite input (docs/contract.md): a counted score that is NaN, +inf or −inf turns l into NaN for
        good (−inf, which would weigh 0, is made NaN first; the max ignores NaN, the sum does not)."""
        s = s * qk_scale
        s = gl.where(okc[None, :], gl.where(s == -float("inf"), float("nan"), s), -float("inf"))
        m_new = gl.maximum(m, gl.max(s, axis=1))
        m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l = l * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l

    @_gluon.jit
    def _epilogue(acc, m, l, qbad_smem, t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr,
                  HAS_SINK: gl.constexpr, SPLITS: gl.constexpr, BH: gl.constexpr, O_L: gl.constexpr,
                  S_L: gl.constexpr, D0: gl.constexpr = 0, DW: gl.constexpr = 512, ML: gl.constexpr = True,
                  o_st=None, OSMEM: gl.constexpr = False):
        """out = acc / l · σ(lse − sink) and lse (SPLITS == 1), or the partial (acc, m, l) for the merge.
        acc holds output columns [D0, D0 + DW); ML: this caller also writes lse (or m, l). qbad_smem: the
        heads' poison words (:func:`_q_to_shared`), added to l. OSMEM (SPLITS == 1, 4-warp callers): the bf16
        output goes through the free shared tile ``o_st`` [BH, DW], then out to global memory as whole
        16-byte vectors along each row (the accumulator's own layout stores 4 bytes per thread, rows apart)."""
        l = l + qbad_smem.load(gl.SliceLayout(1, S_L))
        h_o = hb * BH + gl.arange(0, BH, gl.SliceLayout(1, O_L))
        d_o = D0 + gl.arange(0, DW, gl.SliceLayout(0, O_L))
        h_s = hb * BH + gl.arange(0, BH, gl.SliceLayout(1, S_L))
        if SPLITS == 1:
            nonempty, lse, f = _head_scale(m, l, h_s, H, sink_ptr, HAS_SINK)
            out = acc * gl.convert_layout(f, gl.SliceLayout(1, O_L))[:, None]
            if OSMEM:
                LO: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16 B per thread, rows whole
                o_st.store(out.to(gl.bfloat16))
                _bar()
                h_b = hb * BH + gl.arange(0, BH, gl.SliceLayout(1, LO))
                d_b = D0 + gl.arange(0, DW, gl.SliceLayout(0, LO))
                row_b = t64 * H + h_b.to(gl.int64)
                gl.store(out_ptr + row_b[:, None] * 512 + d_b[None, :], o_st.load(LO),
                         mask=(h_b[:, None] < H) & (d_b[None, :] >= 0))
            else:
                row = t64 * H + h_o.to(gl.int64)
                gl.store(out_ptr + row[:, None] * 512 + d_o[None, :], out.to(gl.bfloat16),
                         mask=(h_o[:, None] < H) & (d_o[None, :] >= 0))
            if ML:
                gl.store(lse_ptr + t64 * H + h_s, gl.where(nonempty, lse, -float("inf")), mask=h_s < H)
        else:
            row = (t64 * SPLITS + sp) * H + h_o.to(gl.int64)
            gl.store(po_ptr + row[:, None] * 512 + d_o[None, :], acc, mask=(h_o[:, None] < H) & (d_o[None, :] >= 0))
            if ML:
                row_s = (t64 * SPLITS + sp) * H + h_s.to(gl.int64)
                gl.store(pml_ptr + row_s * 2, m, mask=h_s < H)
                gl.store(pml_ptr + row_s * 2 + 1, l, mask=h_s < H)

    @_gluon.jit
    def _ws_producer(k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64, bs1, ps1,
                     c2_u8, c2_i16, c2_i64, bs2, ps2, BN: gl.constexpr, NS: gl.constexpr, DEEP: gl.constexpr,
                     DIAG: gl.constexpr):
        """Producer warps (4): gather + dequantise each chunk into the shared ring, half a chunk (32 rows)
        at a time; the next half's row loads are in flight while the current half is dequantised. DEEP: the
        slot indices are also fetched one half ahead, so the two dependent memory round trips of a gathered
        row (index, then row) no longer sit in series."""
        LP: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # [32, 64] per pass
        HALF: gl.constexpr = BN // 2
        rows = gl.arange(0, HALF, gl.SliceLayout(1, LP))
        if DIAG == 1 or DIAG == 3:  # timing diagnostic only (wrong results): every row load masked off
            stop = start
        if DEEP:
            sa, ia, oa = _slots(start + rows, n1, stop, i1, i2)
            r0, r1, r2, r3, r4, r5, r6, rr, sc = _load_rows(sa, ia, oa, c1_u8, c1_i16, c1_i64, bs1, ps1, c2_u8,
                                                            c2_i16, c2_i64, bs2, ps2, LP)
            sb, ib, ob = _slots(start + HALF + rows, n1, stop, i1, i2)
            for it in range(n_it):
                st = it % NS
                v0 = start + it * BN
                mbarrier.wait(empty.index(st), ((it // NS) & 1) ^ 1)
                kb = k_smem.index(st)
                _dequant_store(kb.slice(0, HALF, dim=0), r0, r1, r2, r3, r4, r5, r6, rr, sc)
                r0, r1, r2, r3, r4, r5, r6, rr, sc = _load_rows(sb, ib, ob, c1_u8, c1_i16, c1_i64, bs1, ps1, c2_u8,
                                                                c2_i16, c2_i64, bs2, ps2, LP)
                sa, ia, oa = _slots(v0 + BN + rows, n1, stop, i1, i2)
                _dequant_store(kb.slice(HALF, HALF, dim=0), r0, r1, r2, r3, r4, r5, r6, rr, sc)
                r0, r1, r2, r3, r4, r5, r6, rr, sc = _load_rows(sa, ia, oa, c1_u8, c1_i16, c1_i64, bs1, ps1, c2_u8,
                                                                c2_i16, c2_i64, bs2, ps2, LP)
                sb, ib, ob = _slots(v0 + BN + HALF + rows, n1, stop, i1, i2)
                fence_async_shared()
                _bar()
                mbarrier.arrive(ready.index(st))
        else:
            r0, r1, r2, r3, r4, r5, r6, rr, sc = _load_raw(start, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64, bs1,
                                                           ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, HALF, LP)
            for it in range(n_it):
                st = it % NS
                mbarrier.wait(empty.index(st), ((it // NS) & 1) ^ 1)
                kb = k_smem.index(st)
                v0 = start + it * BN
                _dequant_store(kb.slice(0, HALF, dim=0), r0, r1, r2, r3, r4, r5, r6, rr, sc)
                r0, r1, r2, r3, r4, r5, r6, rr, sc = _load_raw(v0 + HALF, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64,
                                                               bs1, ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, HALF, LP)
                _dequant_store(kb.slice(HALF, HALF, dim=0), r0, r1, r2, r3, r4, r5, r6, rr, sc)
                r0, r1, r2, r3, r4, r5, r6, rr, sc = _load_raw(v0 + BN, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64,
                                                               bs1, ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, HALF, LP)
                fence_async_shared()
                _bar()
                mbarrier.arrive(ready.index(st))

    @_gluon.jit
    def _drain(ready, empty, n_it, NS: gl.constexpr):
        """A consumer of the timing diagnostics (DIAG >= 2, wrong results): take each ready stage and release
        it at once, so the producer runs at its own pace with no MMA behind it."""
        for it in range(n_it):
            mbarrier.wait(ready.index(it % NS), (it // NS) & 1)
            _bar()
            mbarrier.arrive(empty.index(it % NS))

    @_gluon.jit
    def _consumer_start(ready, empty, n_it, start, n1, stop, i1, i2, BH: gl.constexpr, SN: gl.constexpr,
                        DW: gl.constexpr, NS: gl.constexpr, DIAG: gl.constexpr, S_L: gl.constexpr,
                        O_L: gl.constexpr):
        """A consumer's starting state: the running row max m and sum l [BH] (layout of the score tile S_L),
        its accumulator [BH, DW] fp32 (O_L), a zero score tile [BH, SN], the first chunk's candidate ids [SN]
        (the columns of the score tile) and their mask; and
        the chunk count it will run (DIAG >= 2, timing only: every stage taken and released with no MMA, then
        none left)."""
        m = gl.full([BH], -float("inf"), gl.float32, gl.SliceLayout(1, S_L))
        l = gl.zeros([BH], gl.float32, gl.SliceLayout(1, S_L))
        acc = gl.zeros([BH, DW], gl.float32, O_L)
        s0 = gl.zeros([BH, SN], gl.float32, S_L)
        cols = start + gl.arange(0, SN, gl.SliceLayout(0, S_L))
        _, _, okc = _slots(cols, n1, stop, i1, i2)
        if DIAG >= 2:  # timing diagnostic only (wrong results): take each stage and release it, no MMA
            _drain(ready, empty, n_it, NS)
            n_it = 0
        return m, l, acc, s0, cols, okc, n_it

    @_gluon.jit
    def _ws_consumer(q_smem, qbad_smem, k_smem, p_smem, ready, empty, start, n_it, n1, stop, i1, i2, qk_scale,
                     t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr,
                     HAS_SINK: gl.constexpr, SPLITS: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
                     NS: gl.constexpr, OVERLAP: gl.constexpr, DIAG: gl.constexpr):
        """Consumer warpgroups (the default 8 warps): S = Q·Kᵀ, online softmax, O += P·V on each ready
        stage, then release the stage. OVERLAP: the next chunk's QKᵀ is issued right behind this chunk's
        P·V, so the tensor cores run the two back to back."""
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BN // 2, 16])
        m, l, acc, s0, cols, okc, n_it = _consumer_start(ready, empty, n_it, start, n1, stop, i1, i2, BH, BN, 512, NS, DIAG,
                                                         S_L, O_L)
        if OVERLAP:
            mbarrier.wait(ready.index(0), 0, pred=n_it > 0)
            s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s0, use_acc=False)
        for it in range(n_it):
            st = it % NS
            kb = k_smem.index(st)
            if not OVERLAP:
                mbarrier.wait(ready.index(st), (it // NS) & 1)
                s = warpgroup_mma(q_smem, kb.permute((1, 0)), s0, use_acc=False)
            p, alpha, m, l = _softmax_step(s, m, l, okc, qk_scale)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            _bar()
            acc = warpgroup_mma(p_smem, kb, acc, is_async=True)
            _, _, okc = _slots(cols + (it + 1) * BN, n1, stop, i1, i2)  # next chunk's mask, fetched early
            if OVERLAP:
                nx = it + 1
                sn = nx % NS
                mbarrier.wait(ready.index(sn), (nx // NS) & 1, pred=nx < n_it)
                s_next = warpgroup_mma(q_smem, k_smem.index(sn).permute((1, 0)), s0, use_acc=False, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                _bar()
                mbarrier.arrive(empty.index(st))
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                _bar()
                mbarrier.arrive(empty.index(st))
        _epilogue(acc, m, l, qbad_smem, t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr, HAS_SINK, SPLITS, BH, O_L, S_L)

    # ---- packed producer and K-split consumers (flags PACKED, KSPLIT of _ws_kernel) ----------------------

    @_gluon.jit
    def _row_ptrs_packed(slot, in1, ok, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW: gl.constexpr):
        """Addresses (as int64-word pointers) and masks of the rows whose slots are known: the first e4m3 tile
        [R, 8] words (tile b at + 8·b), the RoPE words [R, 16] (4 per thread, so that as 16 bf16 they sit in
        the layout of a dequantised e4m3 tile) and the scale word [R]."""
        data, sidx = _row_words(slot, in1, bs1, ps1, bs2, ps2)
        col = gl.arange(0, 8, gl.SliceLayout(0, LW))
        m2 = ok[:, None] & (col[None, :] >= 0)
        p = gl.where(in1[:, None], c1_i64 + data[:, None], c2_i64 + data[:, None]) + col[None, :]
        LR: gl.constexpr = gl.BlockedLayout([1, 4], LW.threads_per_warp, LW.warps_per_cta, [1, 0])
        col16 = gl.arange(0, 16, gl.SliceLayout(0, LR))
        data_r = gl.convert_layout(data, gl.SliceLayout(1, LR))
        in1_r = gl.convert_layout(in1, gl.SliceLayout(1, LR))
        ok_r = gl.convert_layout(ok, gl.SliceLayout(1, LR))
        pr = gl.where(in1_r[:, None], c1_i64 + data_r[:, None], c2_i64 + data_r[:, None]) + (56 + col16[None, :])
        mr = ok_r[:, None] & (col16[None, :] >= 0)
        psc = gl.where(in1, c1_i64 + sidx, c2_i64 + sidx)
        return p, m2, pr, mr, psc

    @_gluon.jit
    def _load_rows_packed(slot, in1, ok, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW: gl.constexpr):
        """The global loads of rows whose slots are known, kept packed: each e4m3 tile [R, 64] as [R, 8]
        int64 words (8 bytes per two registers, where a uint8 tensor costs a register per byte), the RoPE
        values as [R, 16] int64 words (4 bf16 each), the 8 scale bytes as one int64. Masked rows load zeros."""
        p, m2, pr, mr, psc = _row_ptrs_packed(slot, in1, ok, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
        w0 = gl.load(p, mask=m2, other=0)
        w1 = gl.load(p + 8, mask=m2, other=0)
        w2 = gl.load(p + 16, mask=m2, other=0)
        w3 = gl.load(p + 24, mask=m2, other=0)
        w4 = gl.load(p + 32, mask=m2, other=0)
        w5 = gl.load(p + 40, mask=m2, other=0)
        w6 = gl.load(p + 48, mask=m2, other=0)
        rr = gl.load(pr, mask=mr, other=0)
        sc = gl.load(psc, mask=ok, other=0)
        return w0, w1, w2, w3, w4, w5, w6, rr, sc

    @_gluon.jit
    def _copy_rows_async(raw_w, raw_r, raw_s, slot, in1, ok, c1_i64, bs1, ps1, c2_i64, bs2, ps2,
                         LW: gl.constexpr):
        """Issue cp.async copies of the rows whose slots are known into the raw staging buffers (raw_w
        [8·R, 8] (tile b in rows [b·R, b·R + R)), raw_r [R, 16], raw_s [R] int64; masked rows are
        zero-filled) and commit them as one group:
        the bytes travel without occupying a register."""
        p, m2, pr, mr, psc = _row_ptrs_packed(slot, in1, ok, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
        R: gl.constexpr = raw_r.shape[0]
        for b in gl.static_range(7):
            _async_load(raw_w.slice(b * R, R, dim=0), p + 8 * b, mask=m2)
        _async_load(raw_r, pr, mask=mr)
        _async_load(raw_s, psc, mask=ok)
        async_copy.commit_group()

    @_gluon.jit
    def _read_rows_async(raw_w, raw_r, raw_s, LW: gl.constexpr):
        """Wait for the copies of :func:`_copy_rows_async`, and read them (what :func:`_load_rows_packed`
        returns). The barriers: every thread's copies have landed before any thread reads, and every thread
        has read before the buffers are refilled."""
        LR: gl.constexpr = gl.BlockedLayout([1, 4], LW.threads_per_warp, LW.warps_per_cta, [1, 0])
        async_copy.wait_group(0)
        _bar()
        R: gl.constexpr = raw_r.shape[0]
        w0 = raw_w.slice(0, R, dim=0).load(LW)
        w1 = raw_w.slice(R, R, dim=0).load(LW)
        w2 = raw_w.slice(2 * R, R, dim=0).load(LW)
        w3 = raw_w.slice(3 * R, R, dim=0).load(LW)
        w4 = raw_w.slice(4 * R, R, dim=0).load(LW)
        w5 = raw_w.slice(5 * R, R, dim=0).load(LW)
        w6 = raw_w.slice(6 * R, R, dim=0).load(LW)
        rr = raw_r.load(LR)
        sc = raw_s.load(gl.SliceLayout(1, LW))
        _bar()
        return w0, w1, w2, w3, w4, w5, w6, rr, sc

    @_gluon.jit
    def _bytes_of(w):
        """[R, C] int64 words -> [R, 8·C] uint8, byte i of word j at column 8j + i (little-endian). The
        joins add in-register dimensions; the innermost join is the most significant bit of the byte index."""
        lo = w.to(gl.int32)
        hi = (w >> 32).to(gl.int32)
        x = gl.join(gl.join(gl.join(lo & 255, hi & 255), gl.join((lo >> 16) & 255, (hi >> 16) & 255)),
                    gl.join(gl.join((lo >> 8) & 255, (hi >> 8) & 255), gl.join((lo >> 24) & 255, (hi >> 24) & 255)))
        return gl.reshape(x, [w.shape[0], 8 * w.shape[1]]).to(gl.uint8)

    @_gluon.jit
    def _halves_of(w):
        """[R, C] int64 words -> [R, 4·C] int16: 16-bit value q of word j at column 4j + q."""
        lo = w.to(gl.int32)
        hi = (w >> 32).to(gl.int32)
        x = gl.join(gl.join(lo & 0xFFFF, hi & 0xFFFF), gl.join((lo >> 16) & 0xFFFF, (hi >> 16) & 0xFFFF))
        return gl.reshape(x, [w.shape[0], 4 * w.shape[1]]).to(gl.int16)

    @_gluon.jit
    def _side_by_side(a, b):
        """Two [R, C] tiles -> one [R, 2C] tile (a in columns [0, C), b in [C, 2C)), in registers."""
        x = gl.permute(gl.join(a, b), (0, 2, 1))
        return gl.reshape(x, [a.shape[0], 2 * a.shape[1]])

    @_gluon.jit
    def _dequant_store_packed(kb, raw, ONE_STORE: gl.constexpr):
        """Write one half chunk of packed rows (:func:`_load_rows_packed`) dequantised into ``kb`` [R, 512]:
        the eight 64-column tiles are put side by side in registers and stored at once (ONE_STORE), or as two
        stores of four tiles (half the temporaries, for the fuller register budgets). Triton puts a barrier
        between two stores into one shared buffer (it does not tell disjoint slices apart): eight stores
        cost seven barriers per half chunk, one store none."""
        w0, w1, w2, w3, w4, w5, w6, rr, sc = raw
        x = _bytes_of(w0)
        sc = gl.convert_layout(sc, gl.SliceLayout(1, x.type.layout))
        t01 = _side_by_side(_tile(x, sc, 0), _tile(_bytes_of(w1), sc, 1))
        t23 = _side_by_side(_tile(_bytes_of(w2), sc, 2), _tile(_bytes_of(w3), sc, 3))
        if not ONE_STORE:
            kb.slice(0, 256, dim=1).store(_side_by_side(t01, t23))
        t45 = _side_by_side(_tile(_bytes_of(w4), sc, 4), _tile(_bytes_of(w5), sc, 5))
        t67 = _side_by_side(_tile(_bytes_of(w6), sc, 6), _halves_of(rr).to(gl.bfloat16, bitcast=True))
        if ONE_STORE:
            kb.store(_side_by_side(_side_by_side(t01, t23), _side_by_side(t45, t67)))
        else:
            kb.slice(256, 256, dim=1).store(_side_by_side(t45, t67))

    @_gluon.jit
    def _ws_producer_packed(k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_i64, bs1, ps1,
                            c2_i64, bs2, ps2, BN: gl.constexpr, NS: gl.constexpr, SETS: gl.constexpr,
                            DIAG: gl.constexpr):
        """Producer warps (4) holding the gathered rows packed (int64 words: no byte or 16-bit value lives in a
        register of its own), SETS half chunks at once. SETS = 1: the DEEP producer's schedule (one half in
        flight, issued right after the previous half is dequantised); SETS = 2: double-buffered (one half in
        flight while the other is dequantised, two while waiting for a free stage); SETS = 3: two in flight
        (37 KB per SM) while the third is dequantised; SETS = 4: one half in registers being dequantised
        while the next travels by cp.async into a shared-memory staging buffer (SETS = 1's registers,
        SETS = 2's overlap). Slot indices are fetched one half ahead of the rows."""
        LW: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])  # [32, 8] int64 = 16 B per thread
        HALF: gl.constexpr = BN // 2
        rows = gl.arange(0, HALF, gl.SliceLayout(1, LW))
        if DIAG == 1 or DIAG == 3:  # timing diagnostic only (wrong results): every row load masked off
            stop = start
        if SETS == 4:  # one half in registers, the next one in flight through shared memory (cp.async)
            R_L: gl.constexpr = gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=1, order=[1, 0])
            raw_w = gl.allocate_shared_memory(gl.int64, [8 * HALF, 8], R_L)  # 7 tiles (shapes are powers of 2)
            raw_r = gl.allocate_shared_memory(gl.int64, [HALF, 16], R_L)
            raw_s = gl.allocate_shared_memory(gl.int64, [HALF], gl.SwizzledSharedLayout(
                vec=1, per_phase=1, max_phase=1, order=[0]))
            sa, ia, oa = _slots(start + rows, n1, stop, i1, i2)
            _copy_rows_async(raw_w, raw_r, raw_s, sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
            sa, ia, oa = _slots(start + HALF + rows, n1, stop, i1, i2)
            a = _read_rows_async(raw_w, raw_r, raw_s, LW)
            _copy_rows_async(raw_w, raw_r, raw_s, sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
            sa, ia, oa = _slots(start + 2 * HALF + rows, n1, stop, i1, i2)
            for it in range(n_it):
                st = it % NS
                v0 = start + it * BN
                mbarrier.wait(empty.index(st), ((it // NS) & 1) ^ 1)
                kb = k_smem.index(st)
                _dequant_store_packed(kb.slice(0, HALF, dim=0), a, True)  # half 2·it; 2·it + 1 in flight
                a = _read_rows_async(raw_w, raw_r, raw_s, LW)
                _copy_rows_async(raw_w, raw_r, raw_s, sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
                sa, ia, oa = _slots(v0 + BN + HALF + rows, n1, stop, i1, i2)
                _dequant_store_packed(kb.slice(HALF, HALF, dim=0), a, True)  # half 2·it + 1; 2·it + 2 in flight
                a = _read_rows_async(raw_w, raw_r, raw_s, LW)
                _copy_rows_async(raw_w, raw_r, raw_s, sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
                sa, ia, oa = _slots(v0 + 2 * BN + rows, n1, stop, i1, i2)
                fence_async_shared()
                _bar()
                mbarrier.arrive(ready.index(st))
            async_copy.wait_group(0)  # the last (empty) copies, before the partition ends
            n_it = 0
        sa, ia, oa = _slots(start + rows, n1, stop, i1, i2)
        a = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
        if SETS == 1:  # one half in registers (as the DEEP producer, packed): the leanest, for small budgets
            sa, ia, oa = _slots(start + HALF + rows, n1, stop, i1, i2)
            for it in range(n_it):
                st = it % NS
                v0 = start + it * BN
                mbarrier.wait(empty.index(st), ((it // NS) & 1) ^ 1)
                kb = k_smem.index(st)
                _dequant_store_packed(kb.slice(0, HALF, dim=0), a, SETS == 1)
                a = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
                sa, ia, oa = _slots(v0 + BN + rows, n1, stop, i1, i2)
                _dequant_store_packed(kb.slice(HALF, HALF, dim=0), a, SETS == 1)
                a = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
                sa, ia, oa = _slots(v0 + BN + HALF + rows, n1, stop, i1, i2)
                fence_async_shared()
                _bar()
                mbarrier.arrive(ready.index(st))
            n_it = 0
        sa, ia, oa = _slots(start + HALF + rows, n1, stop, i1, i2)
        b = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
        if SETS == 3:
            sa, ia, oa = _slots(start + 2 * HALF + rows, n1, stop, i1, i2)
            c = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
        sa, ia, oa = _slots(start + SETS * HALF + rows, n1, stop, i1, i2)
        for it in range(n_it):
            st = it % NS
            v0 = start + it * BN
            mbarrier.wait(empty.index(st), ((it // NS) & 1) ^ 1)
            kb = k_smem.index(st)
            # half 2·it from a; its registers then take half 2·it + SETS
            _dequant_store_packed(kb.slice(0, HALF, dim=0), a, SETS == 1)
            a = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
            sa, ia, oa = _slots(v0 + (SETS + 1) * HALF + rows, n1, stop, i1, i2)
            # half 2·it + 1 from b; then half 2·it + SETS + 1
            _dequant_store_packed(kb.slice(HALF, HALF, dim=0), b, SETS == 1)
            b = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
            sa, ia, oa = _slots(v0 + (SETS + 2) * HALF + rows, n1, stop, i1, i2)
            fence_async_shared()
            _bar()
            mbarrier.arrive(ready.index(st))
            if SETS == 3:  # rotate: the sets now hold halves 2·it + 2 (c), 2·it + 3 (a), 2·it + 4 (b)
                a, b, c = c, a, b

    @_gluon.jit
    def _ws_producer_of(k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64, bs1, ps1,
                        c2_u8, c2_i16, c2_i64, bs2, ps2, BN: gl.constexpr, NS: gl.constexpr, DEEP: gl.constexpr,
                        PACKED: gl.constexpr, DIAG: gl.constexpr):
        """The producer partition the flags pick: packed (PACKED 1-3 half chunks in registers, 4: cp.async
        staging) or byte-wise."""
        if PACKED:
            _ws_producer_packed(k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_i64, bs1, ps1,
                                c2_i64, bs2, ps2, BN, NS, PACKED, DIAG)
        else:
            _ws_producer(k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64, bs1, ps1,
                         c2_u8, c2_i16, c2_i64, bs2, ps2, BN, NS, DEEP, DIAG)

    @_gluon.jit
    def _softmax_step2(sa, sb, m, l, oka, okb, qk_scale):
        """:func:`_softmax_step` on a score tile held as two column halves (sa, sb)."""
        sa = sa * qk_scale
        sb = sb * qk_scale
        sa = gl.where(oka[None, :], gl.where(sa == -float("inf"), float("nan"), sa), -float("inf"))
        sb = gl.where(okb[None, :], gl.where(sb == -float("inf"), float("nan"), sb), -float("inf"))
        m_new = gl.maximum(m, gl.maximum(gl.max(sa, axis=1), gl.max(sb, axis=1)))
        m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_safe)
        pa = gl.exp2(sa - m_safe[:, None])
        pb = gl.exp2(sb - m_safe[:, None])
        l = l * alpha + (gl.sum(pa, axis=1) + gl.sum(pb, axis=1))
        return pa, pb, alpha, m_new, l

    @_gluon.jit
    def _ks_consumer(q_smem, qbad_smem, k_smem, x_smem, ready, empty, xfull, xfree, start, n_it, n1, stop, i1, i2, qk_scale,
                     t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr,
                     W: gl.constexpr, HAS_SINK: gl.constexpr, SPLITS: gl.constexpr, BH: gl.constexpr,
                     BN: gl.constexpr, NS: gl.constexpr, HALVES: gl.constexpr, DIAG: gl.constexpr):
        """One consumer warpgroup (its own partition; W = 0 or 1) of the K-split scheme. It owns dims
        [256·W, 256·W + 256): S_W = Q[:, dims] · K[:, dims]ᵀ is a partial score over all 64 candidates; the two
        warpgroups swap partials through shared memory (mbarriers xfull / xfree, no CTA-wide barrier), each
        forms S = S_0 + S_1 (the same bits in both: fp32 addition commutes) and runs the same online softmax,
        so no row max or sum crosses warpgroups. P stays in registers as the A operand of O[:, dims] += P · V[:,
        dims]. Each warpgroup releases the stage (empty counts two arrivals).
        HALVES: S is computed, swapped and exponentiated as two [64, 32] column halves (n = 32 MMAs), so the
        partner's partial is in registers one half at a time (16 registers, not 32): with the 128-register
        accumulator that is what lets the consumer fit beside a producer of 144 registers."""
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        SN: gl.constexpr = BN // 2 if HALVES else BN
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SN, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        D0: gl.constexpr = 256 * W
        q_h = q_smem.slice(D0, 256, dim=1)
        m, l, acc, s0, cols, okc, n_it = _consumer_start(ready, empty, n_it, start, n1, stop, i1, i2, BH, SN, 256, NS, DIAG,
                                                         S_L, O_L)
        if HALVES:
            _, _, okb = _slots(cols + SN, n1, stop, i1, i2)
        for it in range(n_it):
            st = it % NS
            k_h = k_smem.index(st).slice(D0, 256, dim=1)
            xw = x_smem.index(W)
            xo = x_smem.index(1 - W)
            mbarrier.wait(ready.index(st), (it // NS) & 1)
            if HALVES:
                s = warpgroup_mma(q_h, k_h.slice(0, SN, dim=0).permute((1, 0)), s0, use_acc=False)
                sb = warpgroup_mma(q_h, k_h.slice(SN, SN, dim=0).permute((1, 0)), s0, use_acc=False)
                mbarrier.wait(xfree.index(W), (it & 1) ^ 1)  # the other warpgroup has read my previous partial
                xw.slice(0, SN, dim=1).store(s)
                xw.slice(SN, SN, dim=1).store(sb)
            else:
                s = warpgroup_mma(q_h, k_h.permute((1, 0)), s0, use_acc=False)
                mbarrier.wait(xfree.index(W), (it & 1) ^ 1)
                xw.store(s)
            _bar()
            mbarrier.arrive(xfull.index(W))
            mbarrier.wait(xfull.index(1 - W), it & 1)
            if HALVES:
                s = s + xo.slice(0, SN, dim=1).load(S_L)
                sb = sb + xo.slice(SN, SN, dim=1).load(S_L)
            else:
                s = s + xo.load(S_L)
            _bar()
            mbarrier.arrive(xfree.index(1 - W))
            if HALVES:
                p, pb, alpha, m, l = _softmax_step2(s, sb, m, l, okc, okb, qk_scale)
            else:
                p, alpha, m, l = _softmax_step(s, m, l, okc, qk_scale)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            if HALVES:
                p_op = gl.convert_layout(p.to(gl.bfloat16), P_L)
                acc = warpgroup_mma(p_op, k_h.slice(0, SN, dim=0), acc, is_async=True)
                pb_op = gl.convert_layout(pb.to(gl.bfloat16), P_L)
                acc = warpgroup_mma(pb_op, k_h.slice(SN, SN, dim=0), acc, is_async=True)
                _, _, okc = _slots(cols + (it + 1) * BN, n1, stop, i1, i2)  # next chunk's mask, fetched early
                _, _, okb = _slots(cols + (it + 1) * BN + SN, n1, stop, i1, i2)
                acc, p_op, pb_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op, pb_op))
            else:
                p_op = gl.convert_layout(p.to(gl.bfloat16), P_L)
                acc = warpgroup_mma(p_op, k_h, acc, is_async=True)
                _, _, okc = _slots(cols + (it + 1) * BN, n1, stop, i1, i2)
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            _bar()
            mbarrier.arrive(empty.index(st))
        _epilogue(acc, m, l, qbad_smem, t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr, HAS_SINK, SPLITS, BH,
                  O_L, S_L, D0, 256, W == 0)

    @_gluon.jit
    def _ks_consumer1(q_smem, qbad_smem, k_smem, x_smem, ready, empty, xfull, xfree, start, n_it, n1, stop, i1, i2, qk_scale,
                      t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr,
                      HAS_SINK: gl.constexpr, SPLITS: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
                      NS: gl.constexpr, HALVES: gl.constexpr, DIAG: gl.constexpr):
        """The second consumer warpgroup (a worker partition: the columns W = 1)."""
        _ks_consumer(q_smem, qbad_smem, k_smem, x_smem, ready, empty, xfull, xfree, start, n_it, n1, stop, i1, i2, qk_scale,
                     t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr, 1, HAS_SINK, SPLITS, BH, BN,
                     NS, HALVES, DIAG)

    @_gluon.jit
    def _ks_consumer0(q_smem, qbad_smem, k_smem, x_smem, ready, empty, xfull, xfree, start, n_it, n1, stop, i1, i2, qk_scale,
                      t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr,
                      HAS_SINK: gl.constexpr, SPLITS: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
                      NS: gl.constexpr, HALVES: gl.constexpr, DIAG: gl.constexpr):
        """The first consumer warpgroup (the default partition: the columns W = 0)."""
        _ks_consumer(q_smem, qbad_smem, k_smem, x_smem, ready, empty, xfull, xfree, start, n_it, n1, stop, i1, i2, qk_scale,
                     t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr, 0, HAS_SINK, SPLITS, BH, BN,
                     NS, HALVES, DIAG)

    # ---- role-split consumers (flag ROLES of _ws_kernel) -------------------------------------------------

    @_gluon.jit
    def _roles_scorer(q_smem, qbad_smem, k_smem, p_smem, a_smem, ml_smem, ready, empty, pfull, pfree, fin,
                      start, n_it, n1, stop, i1, i2, qk_scale, t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr,
                      pml_ptr, HAS_SINK: gl.constexpr, SPLITS: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
                      NS: gl.constexpr, OVERLAP: gl.constexpr, DIAG: gl.constexpr, q_ptr, q_st, q_sh,
                      QLATE: gl.constexpr, OSMEM: gl.constexpr = False, LAZY_SCAN: gl.constexpr = False):
        """The scoring warpgroup (the default partition, 4 warps) of the role split: S = Q·Kᵀ for all 64
        candidates as n = 64 wgmma (Q read once per chunk, not once per warpgroup), the online softmax with
        every row max and sum inside one warpgroup (no CTA barrier), then P (bf16) and the rescale factor
        alpha are published to the P·V warpgroup through a 2-deep shared buffer (mbarriers pfull / pfree),
        and its own half of the output, O[:, 0:256] += P · V[:, 0:256], runs with P in registers.
        OVERLAP: the next chunk's QKᵀ is issued right behind this chunk's P·V. QLATE: this warpgroup first
        brings the query to shared memory itself (:func:`_q_async`). OSMEM: the output leaves through K stage
        0, once the last chunk's stage is released by both warpgroups (:func:`_epilogue`). LAZY_SCAN (with
        QLATE): the query's NaN / ±inf scan is not run before the first chunk but after the last, and only
        if a head counted no candidate: a non-finite query row makes every one of its scores non-finite,
        and the softmax turns l into NaN by itself; only a row with nothing counted needs the poison word."""
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        if QLATE and DIAG < 5:  # DIAG 5, 6 (timing only): no query load
            _q_async(q_ptr, t64, q_st, q_sh, hb, H, q_smem, qbad_smem, BH, not LAZY_SCAN)
        m, l, acc, s0, cols, okc, n_it = _consumer_start(ready, empty, n_it, start, n1, stop, i1, i2, BH, BN, 256, NS, DIAG,
                                                         S_L, O_L)
        if OVERLAP:
            mbarrier.wait(ready.index(0), 0, pred=n_it > 0)
            s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s0, use_acc=False)
        for it in range(n_it):
            st = it % NS
            b = it % 2
            kb = k_smem.index(st)
            if not OVERLAP:
                mbarrier.wait(ready.index(st), (it // NS) & 1)
                s = warpgroup_mma(q_smem, kb.permute((1, 0)), s0, use_acc=False)
            p, alpha, m, l = _softmax_step(s, m, l, okc, qk_scale)
            pb = p.to(gl.bfloat16)
            mbarrier.wait(pfree.index(b), ((it // 2) & 1) ^ 1)  # the P·V warpgroup is done with buffer b
            p_smem.index(b).store(pb)
            a_smem.index(b).store(alpha)
            fence_async_shared()  # P is read by the other warpgroup's wgmma (the async proxy)
            _bar()
            mbarrier.arrive(pfull.index(b))
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            p_op = gl.convert_layout(pb, P_L)
            acc = warpgroup_mma(p_op, kb.slice(0, 256, dim=1), acc, is_async=True)
            _, _, okc = _slots(cols + (it + 1) * BN, n1, stop, i1, i2)  # next chunk's mask, fetched early
            if OVERLAP:
                nx = it + 1
                sn = nx % NS
                mbarrier.wait(ready.index(sn), (nx // NS) & 1, pred=nx < n_it)
                s_next = warpgroup_mma(q_smem, k_smem.index(sn).permute((1, 0)), s0, use_acc=False, is_async=True)
                acc, p_op = warpgroup_mma_wait(num_outstanding=1, deps=(acc, p_op))
                _bar()
                mbarrier.arrive(empty.index(st))
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
            else:
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
                _bar()
                mbarrier.arrive(empty.index(st))
        if LAZY_SCAN:
            if gl.max((l == 0).to(gl.int32), axis=0) > 0:  # a head with no counted candidate (rare)
                _q_scan(q_smem, qbad_smem, BH)
            else:
                qbad_smem.store(gl.zeros([BH], gl.float32, gl.SliceLayout(1, S_L)))
        ml_smem.index(0).store(m)  # the final row max and sum, for the P·V warpgroup's epilogue
        ml_smem.index(1).store(l)
        _bar()
        mbarrier.arrive(fin)
        if OSMEM and SPLITS == 1:  # the P·V warpgroup's last read of a K stage is over (it released it)
            last = gl.maximum(n_it - 1, 0)
            mbarrier.wait(empty.index(last % NS), (last // NS) & 1, pred=n_it > 0)
        if DIAG < 6:  # DIAG 6 (timing only): no epilogue stores either
            _epilogue(acc, m, l, qbad_smem, t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr, HAS_SINK,
                      SPLITS, BH, O_L, S_L, 0, 256, True, k_smem.index(0).slice(0, 256, dim=1), OSMEM and SPLITS == 1)

    @_gluon.jit
    def _roles_pv(q_smem, qbad_smem, k_smem, p_smem, a_smem, ml_smem, ready, empty, pfull, pfree, fin,
                  start, n_it, n1, stop, i1, i2, qk_scale, t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr,
                  pml_ptr, HAS_SINK: gl.constexpr, SPLITS: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
                  NS: gl.constexpr, OVERLAP: gl.constexpr, DIAG: gl.constexpr, OSMEM: gl.constexpr = False):
        """The P·V warpgroup (a worker partition, 4 warps) of the role split: for each chunk it waits for
        the scorer's P and alpha, rescales its half of the output and runs O[:, 256:512] += P · V[:, 256:512]
        with P read from shared memory; it computes no score and no softmax, so it needs only the
        accumulator's registers. Both warpgroups release the K stage (empty counts two arrivals)."""
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        acc = gl.zeros([BH, 256], gl.float32, O_L)
        if DIAG >= 2:  # timing diagnostic only (wrong results): take each stage and release it, no MMA
            _drain(ready, empty, n_it, NS)
            n_it = 0
        for it in range(n_it):
            st = it % NS
            b = it % 2
            mbarrier.wait(ready.index(st), (it // NS) & 1)
            mbarrier.wait(pfull.index(b), (it // 2) & 1)
            alpha = a_smem.index(b).load(gl.SliceLayout(1, O_L))
            acc = acc * alpha[:, None]
            acc = warpgroup_mma(p_smem.index(b), k_smem.index(st).slice(256, 256, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _bar()
            mbarrier.arrive(pfree.index(b))
            mbarrier.arrive(empty.index(st))
        mbarrier.wait(fin, 0)
        m = ml_smem.index(0).load(gl.SliceLayout(1, S_L))
        l = ml_smem.index(1).load(gl.SliceLayout(1, S_L))
        if DIAG < 6:  # (the scorer's MMAs are over once fin completes: stage 1 is free for OSMEM)
            _epilogue(acc, m, l, qbad_smem, t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr, HAS_SINK,
                      SPLITS, BH, O_L, S_L, 256, 256, False, k_smem.index(1).slice(0, 256, dim=1), OSMEM and SPLITS == 1)

    @_gluon.jit
    def _ws_kernel(
        q_ptr, q_st, q_sh, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr,
        c1_u8, c1_i16, c1_i64, i1_ptr, l1_ptr, K1, i1_st, bs1, ps1,
        c2_u8, c2_i16, c2_i64, i2_ptr, l2_ptr, K2, i2_st, bs2, ps2,
        H, qk_scale, chunk,
        HAS_LEN1: gl.constexpr, HAS_POOL2: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_SINK: gl.constexpr,
        SPLITS: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, OVERLAP: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, DEEP: gl.constexpr, DIAG: gl.constexpr = 0, PACKED: gl.constexpr = 0,
        KSPLIT: gl.constexpr = 0, ROLES: gl.constexpr = 0, PV_REGS: gl.constexpr = 160, QLATE: gl.constexpr = 0,
        OSMEM: gl.constexpr = 0, LAZY_SCAN: gl.constexpr = 0,
    ):
        """Warp-specialised variant: 4 producer warps fill an NS-stage ring of dequantised K tiles (mbarriers
        ready / empty per stage); the 8 default warps (two warpgroups) only run the MMAs and the softmax.
        PACKED (1-3): the packed producer with that many half chunks in registers (4: one, and the next one
        staged through shared memory by cp.async); KSPLIT (1, or 2 for the
        score halves): the two consumer warpgroups are two partitions splitting QKᵀ by dims (the launch then
        has 4 default warps, not 8); ROLES: the two consumer warpgroups take different roles, a scorer (QKᵀ,
        softmax, half of P·V; the default partition) and a P·V warpgroup on PV_REGS registers (the other half).
        QLATE (ROLES): the query reaches
        shared memory inside the scorer partition by cp.async, while the producer already fetches the
        first chunk, instead of before the partitions start."""
        gl.static_assert(BH == 64)
        gl.static_assert(BN == 64)
        LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        SH_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        t64, hb, sp, n1, start, stop, n_it, i1, i2 = _program(chunk, K1, l1_ptr, K2, l2_ptr, i1_ptr, i1_st, i2_ptr,
                                                              i2_st, BN, HAS_LEN1, HAS_POOL2, HAS_LEN2, DIAG)

        if QLATE:  # the scorer partition fills these (_q_async)
            q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, 512], SH_L)
            qbad_smem = gl.allocate_shared_memory(gl.float32, [BH], gl.SwizzledSharedLayout(
                vec=1, per_phase=1, max_phase=1, order=[0]))
        else:
            q_smem, qbad_smem = _q_to_shared(q_ptr, t64, q_st, q_sh, hb, H, BH, LQ, SH_L)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, 512], SH_L)
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NS):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2 if (KSPLIT or ROLES) else 1)
        if ROLES:  # P (bf16) and alpha, 2 deep, from the scorer to the P·V warpgroup; the final (m, l)
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BH, BN], SH_L)
            V_L: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])  # per [BH] row
            a_smem = gl.allocate_shared_memory(gl.float32, [2, BH], V_L)
            ml_smem = gl.allocate_shared_memory(gl.float32, [2, BH], V_L)
            pfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            pfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(pfull.index(i), count=1)
                mbarrier.init(pfree.index(i), count=1)
            mbarrier.init(fin, count=1)
        elif KSPLIT:  # the two partial-score buffers (fp32, 16 KB each) and their handshakes; no P buffer
            x_smem = gl.allocate_shared_memory(gl.float32, [2, BH, BN], gl.NVMMASharedLayout(
                swizzle_byte_width=128, element_bitwidth=32, rank=2))
            xfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            xfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(xfull.index(i), count=1)
                mbarrier.init(xfree.index(i), count=1)
        else:
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], SH_L)
        fence_async_shared()
        _bar()
        # (the partitions' argument tuples are written out in each call: a tuple bound to a name first
        # would turn its constexpr members into tensors)
        if ROLES:  # registers: 512 per thread slot over three 4-warp partitions; the scorer gets the rest
            gl.warp_specialize([
                (_roles_scorer, (q_smem, qbad_smem, k_smem, p_smem, a_smem, ml_smem, ready, empty, pfull, pfree, fin,
                                 start, n_it, n1, stop, i1, i2, qk_scale, t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr,
                                 po_ptr, pml_ptr, HAS_SINK, SPLITS, BH, BN, NS, OVERLAP, DIAG,
                                 q_ptr, q_st, q_sh, QLATE, OSMEM, LAZY_SCAN)),
                (_roles_pv, (q_smem, qbad_smem, k_smem, p_smem, a_smem, ml_smem, ready, empty, pfull, pfree, fin,
                             start, n_it, n1, stop, i1, i2, qk_scale, t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr,
                             po_ptr, pml_ptr, HAS_SINK, SPLITS, BH, BN, NS, OVERLAP, DIAG, OSMEM)),
                (_ws_producer_of, (k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64, bs1,
                                   ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, BN, NS, DEEP, PACKED, DIAG)),
            ], [4, 4], [PV_REGS, PRODUCER_REGS])
        elif KSPLIT:  # registers: 512 per thread slot over three 4-warp partitions; the consumers split the rest
            gl.warp_specialize([
                (_ks_consumer0, (q_smem, qbad_smem, k_smem, x_smem, ready, empty, xfull, xfree, start, n_it, n1, stop, i1, i2,
                                 qk_scale, t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr, HAS_SINK,
                                 SPLITS, BH, BN, NS, KSPLIT == 2, DIAG)),
                (_ks_consumer1, (q_smem, qbad_smem, k_smem, x_smem, ready, empty, xfull, xfree, start, n_it, n1, stop, i1, i2,
                                 qk_scale, t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr, HAS_SINK,
                                 SPLITS, BH, BN, NS, KSPLIT == 2, DIAG)),
                (_ws_producer_of, (k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64, bs1,
                                   ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, BN, NS, DEEP, PACKED, DIAG)),
            ], [4, 4], [(512 - PRODUCER_REGS) // 16 * 8, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_ws_consumer, (q_smem, qbad_smem, k_smem, p_smem, ready, empty, start, n_it, n1, stop, i1, i2, qk_scale,
                                t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr,
                                HAS_SINK, SPLITS, BH, BN, NS, OVERLAP, DIAG)),
                (_ws_producer_of, (k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64, bs1,
                                   ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, BN, NS, DEEP, PACKED, DIAG)),
            ], [4], [PRODUCER_REGS])


    # ---- narrow heads (flag NARROW): H <= 16, the MMAs transposed ---------------------------------------

    @_gluon.jit
    def _narrow_producer(k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_i64, bs1, ps1, c2_i64, bs2, ps2,
                         BN: gl.constexpr, NS: gl.constexpr, PART: gl.constexpr, DIAG: gl.constexpr):
        """One of the narrow kernel's two producer warpgroups: rows [PART·BN/2, (PART + 1)·BN/2) of every
        chunk (the other warpgroup dequantises the other half at the same time, so a chunk's dequantisation
        takes half as long as with one producer). Two chunks' rows are held as packed words: chunk it + 1's
        loads are in flight while chunk it is dequantised, and chunk it + 2's are issued right after."""
        LW: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])  # [32, 8] int64 = 16 B per thread
        HALF: gl.constexpr = BN // 2
        rows = PART * HALF + gl.arange(0, HALF, gl.SliceLayout(1, LW))
        if DIAG == 1 or DIAG == 3:  # timing diagnostic only (wrong results): every row load masked off
            stop = start
        sa, ia, oa = _slots(start + rows, n1, stop, i1, i2)
        a = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
        sa, ia, oa = _slots(start + BN + rows, n1, stop, i1, i2)
        b = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
        sa, ia, oa = _slots(start + 2 * BN + rows, n1, stop, i1, i2)
        for it in range(n_it):
            st = it % NS
            mbarrier.wait(empty.index(st), ((it // NS) & 1) ^ 1)
            _dequant_store_packed(k_smem.index(st).slice(PART * HALF, HALF, dim=0), a, False)
            a = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)  # chunk it + 2
            sa, ia, oa = _slots(start + (it + 3) * BN + rows, n1, stop, i1, i2)
            fence_async_shared()
            _bar()
            mbarrier.arrive(ready.index(st))
            a, b = b, a

    @_gluon.jit
    def _narrow_consumer(q_smem, qbad_smem, k_smem, p_smem, ready, empty, start, n_it, n1, stop, i1, i2, qk_scale,
                         t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr, q_ptr, q_st, q_sh,
                         HAS_SINK: gl.constexpr, SPLITS: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
                         NS: gl.constexpr, DIAG: gl.constexpr):
        """The narrow kernel's MMA warpgroup (the default partition, 4 warps), on transposed products so that
        the heads are the wgmma's N (16) instead of its M (64, three quarters padding at H = 16):
        Sᵀ[BN, BH] = K · Qᵀ (A = the K tile, B = the query), the online softmax down the columns (one
        per head), Pᵀ (bf16) to shared memory, and Oᵀ[512, BH] += Vᵀ · Pᵀ (A = the same K tile read
        transposed: 8 row blocks of 64 dims). Oᵀ is 64 fp32 registers per thread, not 128."""
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
        V_L: gl.constexpr = gl.SliceLayout(0, S_L)  # one value per head
        if DIAG < 5:  # DIAG 5, 6 (timing only): no query load
            _q_async(q_ptr, t64, q_st, q_sh, hb, H, q_smem, qbad_smem, BH)
        m = gl.full([BH], -float("inf"), gl.float32, V_L)
        l = gl.zeros([BH], gl.float32, V_L)
        acc = gl.zeros([512, BH], gl.float32, S_L)  # Oᵀ (S_L's instruction shape serves both products)
        s0 = gl.zeros([BN, BH], gl.float32, S_L)
        cols = start + gl.arange(0, BN, gl.SliceLayout(1, S_L))
        _, _, okc = _slots(cols, n1, stop, i1, i2)
        if DIAG >= 2:  # timing diagnostic only (wrong results): take each stage and release it, no MMA
            _drain(ready, empty, n_it, NS)
            n_it = 0
        for it in range(n_it):
            st = it % NS
            kb = k_smem.index(st)
            mbarrier.wait(ready.index(st), (it // NS) & 1)
            s = warpgroup_mma(kb, q_smem.permute((1, 0)), s0, use_acc=False)
            # _softmax_step, transposed: candidates down the rows, one column per head
            s = s * qk_scale
            s = gl.where(okc[:, None], gl.where(s == -float("inf"), float("nan"), s), -float("inf"))
            m_new = gl.maximum(m, gl.max(s, axis=0))
            m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = gl.exp2(m - m_safe)
            p = gl.exp2(s - m_safe[None, :])
            l = l * alpha + gl.sum(p, axis=0)
            m = m_new
            p_smem.store(gl.permute(p.to(gl.bfloat16), (1, 0)))  # [BH, BN]: read back as the K-major B operand
            fence_async_shared()
            _bar()
            acc = acc * alpha[None, :]
            acc = warpgroup_mma(kb.permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)
            _, _, okc = _slots(cols + (it + 1) * BN, n1, stop, i1, i2)  # next chunk's mask, fetched early
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _bar()
            mbarrier.arrive(empty.index(st))
        # the epilogue of _epilogue, on Oᵀ: heads along the columns
        l = l + qbad_smem.load(V_L)
        h = hb * BH + gl.arange(0, BH, V_L)
        d = gl.arange(0, 512, gl.SliceLayout(1, S_L))
        hm = (h[None, :] < H) & (d[:, None] >= 0) & (DIAG < 6)  # DIAG 6 (timing only): no epilogue stores
        if SPLITS == 1:
            nonempty, lse, f = _head_scale(m, l, h, H, sink_ptr, HAS_SINK)
            row = t64 * H + h.to(gl.int64)
            gl.store(out_ptr + row[None, :] * 512 + d[:, None], (acc * f[None, :]).to(gl.bfloat16), mask=hm)
            gl.store(lse_ptr + row, gl.where(nonempty, lse, -float("inf")), mask=h < H)
        else:
            row = (t64 * SPLITS + sp) * H + h.to(gl.int64)
            gl.store(po_ptr + row[None, :] * 512 + d[:, None], acc, mask=hm)
            gl.store(pml_ptr + row * 2, m, mask=h < H)
            gl.store(pml_ptr + row * 2 + 1, l, mask=h < H)

    @_gluon.jit
    def _narrow_kernel(
        q_ptr, q_st, q_sh, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr,
        c1_u8, c1_i16, c1_i64, i1_ptr, l1_ptr, K1, i1_st, bs1, ps1,
        c2_u8, c2_i16, c2_i64, i2_ptr, l2_ptr, K2, i2_st, bs2, ps2,
        H, qk_scale, chunk,
        HAS_LEN1: gl.constexpr, HAS_POOL2: gl.constexpr, HAS_LEN2: gl.constexpr, HAS_SINK: gl.constexpr,
        SPLITS: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, DIAG: gl.constexpr = 0,
    ):
        """Narrow-head variant (H <= 16): one program per (token, list split) with the heads as the MMAs' N
        (:func:`_narrow_consumer`), so its tensor-core work is the useful work, and the registers the
        64-row accumulator no longer needs go to a second producer warpgroup (:func:`_narrow_producer`):
        dequantisation, the slower half of this kernel at small H, runs on 8 warps instead of 4. Shared
        memory: the query [BH, 512], an NS-stage ring of K tiles [BN, 512] and Pᵀ [BH, BN], all bf16."""
        gl.static_assert(BN == 64)
        SH_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        t64, hb, sp, n1, start, stop, n_it, i1, i2 = _program(chunk, K1, l1_ptr, K2, l2_ptr, i1_ptr, i1_st, i2_ptr,
                                                              i2_st, BN, HAS_LEN1, HAS_POOL2, HAS_LEN2, DIAG)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, 512], SH_L)
        qbad_smem = gl.allocate_shared_memory(gl.float32, [BH], gl.SwizzledSharedLayout(
            vec=1, per_phase=1, max_phase=1, order=[0]))
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, 512], SH_L)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], SH_L)
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NS):
            mbarrier.init(ready.index(i), count=2)  # both producer warpgroups
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        _bar()
        gl.warp_specialize([
            (_narrow_consumer, (q_smem, qbad_smem, k_smem, p_smem, ready, empty, start, n_it, n1, stop, i1, i2,
                                qk_scale, t64, hb, sp, H, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr, q_ptr, q_st,
                                q_sh, HAS_SINK, SPLITS, BH, BN, NS, DIAG)),
            (_narrow_producer, (k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_i64, bs1, ps1, c2_i64, bs2,
                                ps2, BN, NS, 0, DIAG)),
            (_narrow_producer, (k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_i64, bs1, ps1, c2_i64, bs2,
                                ps2, BN, NS, 1, DIAG)),
        ], [4, 4], [PRODUCER_REGS, PRODUCER_REGS])

    return {"decode": _decode_kernel, "merge": _merge_kernel, "ws": _ws_kernel, "narrow": _narrow_kernel}


def block_h(flags: dict, H: int) -> int:
    """Heads per program: :data:`NARROW_H` for the narrow kernel (flag NARROW, H <= NARROW_H), else
    :data:`BLOCK_H`."""
    return NARROW_H if flags.get("NARROW") and H <= NARROW_H else BLOCK_H


def _kernel_and_flags(kern: dict, flags: dict, H: int = BLOCK_H):
    """The decode kernel a full set of :data:`VARIANT` flags selects for ``H`` heads, and its variant
    constexprs (the launcher and benchmarks/gluon_compile_check.py share this)."""
    if block_h(flags, H) == NARROW_H:
        return kern["narrow"], dict(NS=flags.get("NARROW_NS", 2), PRODUCER_REGS=flags.get("NARROW_REGS", 184),
                                    DIAG=flags.get("DIAG", 0), num_warps=4)
    if flags["WS"]:
        ksplit = int(flags.get("KSPLIT", 0))
        roles = int(flags.get("ROLES", 0))
        return kern["ws"], dict(NS=flags["NS"], OVERLAP=flags["OVERLAP"], PRODUCER_REGS=flags["PRODUCER_REGS"],
                                DEEP=flags["DEEP"], DIAG=flags.get("DIAG", 0), PACKED=flags.get("PACKED", 0),
                                KSPLIT=ksplit, ROLES=roles, PV_REGS=flags.get("PV_REGS", 160),
                                QLATE=int(flags.get("QLATE", 0)) if roles else 0,  # the scorer loads it
                                OSMEM=int(flags.get("OSMEM", 0)) if roles else 0,
                                LAZY_SCAN=int(flags.get("LAZY_SCAN", 0)) if roles and flags.get("QLATE") else 0,
                                num_warps=4 if (ksplit or roles) else NUM_WARPS)
    return kern["decode"], dict(P_SMEM=flags["P_SMEM"], PIPE=flags["PIPE"], num_warps=NUM_WARPS)


def _kernels():
    global _K, _IMPORT_ERROR
    if _K is None:
        if _gluon is None:
            _K = False
        else:
            try:
                _K = _define_kernels()
            except Exception as e:  # an incompatible Gluon API
                _IMPORT_ERROR = e
                _K = False
    return _K or None


def available(device: torch.device | None = None) -> bool:
    """True where this backend can run: compiled Triton with Gluon (never the interpreter) and a CUDA
    device of compute capability 9.x (Hopper: H100 / H200)."""
    if interpreting():
        return False
    cap = capability(device)
    if cap is None or cap[0] != 9:
        return False
    return _kernels() is not None


def _aligned(cache: torch.Tensor) -> bool:
    return cache.data_ptr() % 16 == 0 and cache.stride(0) % 16 == 0 and cache.stride(1) == 1


def supports(q: torch.Tensor, cache: torch.Tensor, extra_cache: torch.Tensor | None = None) -> bool:
    """Whether :func:`decode_gluon` takes these inputs: Hopper, H <= 128, and caches whose pages start at
    16-byte aligned addresses (every cache :func:`dsv4ref.kv_cache.allocate` makes; the kernel loads 16-byte
    vectors and the 8 scale bytes of a row as one word). Otherwise use the portable kernel."""
    return (available(q.device) and q.shape[1] <= 128 and _aligned(cache)
            and (extra_cache is None or _aligned(extra_cache)))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def config(T: int, H: int, K_total: int, device, *, num_splits: int | None = None) -> dict:
    """Launch configuration: chunks of 64 candidates and the number of list splits (the head block is
    :func:`block_h`'s: 64, or 16 for the narrow kernel).

    One program per (token, 64-head block) holds ~215 KB of shared memory, so one runs per SM (the narrow
    kernel's too); the list is split (flash-decoding) while that leaves SMs idle and every split keeps >= 4
    chunks. The split count is the same for both kernels: at H <= 16 a 64-head block is one block."""
    n_hb = -(-H // BLOCK_H)
    if num_splits is None:
        num_splits = 1
        sms = sm_count(device)
        while T * n_hb * num_splits * 2 <= sms + sms // 8 and K_total // (num_splits * 2) >= 4 * BLOCK_N:
            num_splits *= 2
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits: expected a power of two, got {num_splits!r}")
    return dict(num_splits=num_splits)


def decode_gluon(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor | None, *,
                 block_size: int, sink: torch.Tensor | None = None, scale: float = F.HEAD_DIM ** -0.5,
                 extra_cache: torch.Tensor | None = None, extra_slots: torch.Tensor | None = None,
                 extra_lengths: torch.Tensor | None = None, extra_block_size: int | None = None,
                 num_splits: int | None = None, variant: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode on Hopper: same arguments and results as :func:`dsv4ref.sparse_mla.decode`
    (already-validated inputs; no value checks and no host sync here, so it can be graph-captured).

    q ``[T, H, 512]`` bf16 (H <= 128); cache uint8 pages of ``block_size`` tokens; slots ``[T, K]`` int32
    (−1 = no entry, rows contiguous); lengths ``[T]`` int32 or None (all K); sink ``[H]`` fp32 or None;
    the optional extra pool likewise. Returns out ``[T, H, 512]`` bf16, lse ``[T, H]`` fp32 (natural log,
    without the sink; −inf for empty rows).

    ``num_splits`` overrides the list-split heuristic (:func:`config`); ``variant`` overrides flags of
    :data:`VARIANT` (benchmarks and tests only)."""
    kern = _kernels()
    if kern is None or interpreting():
        raise RuntimeError(f"the gluon backend needs compiled Triton with Gluon on a Hopper GPU ({_IMPORT_ERROR!r})")
    T, H, D = q.shape
    if D != F.HEAD_DIM or H > 128 or q.stride(2) != 1:
        raise ValueError(f"q: expected [T, H <= 128, {F.HEAD_DIM}] with a contiguous last dim, got {tuple(q.shape)}")
    for x, name in ((slots, "slots"), (extra_slots, "extra_slots")):
        if x is not None and x.shape[1] and x.stride(1) != 1:
            raise ValueError(f"{name}: rows must be contiguous (strides {x.stride()})")
    for c, name in ((cache, "cache"), (extra_cache, "extra_cache")):
        if c is not None and not _aligned(c):
            raise ValueError(f"{name}: the gluon backend needs 16-byte aligned pages (data_ptr and stride(0) % 16 == 0)")
    out = torch.empty(T, H, F.HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return out, lse
    has_pool2 = extra_cache is not None
    K1 = slots.shape[1]
    K2 = extra_slots.shape[1] if has_pool2 else 0
    cfg = config(T, H, K1 + K2, q.device, num_splits=num_splits)
    S = cfg["num_splits"]
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
        po = torch.empty(T, S, H, F.HEAD_DIM, dtype=torch.float32, device=q.device)
        pml = torch.empty(T, S, H, 2, dtype=torch.float32, device=q.device)
    else:
        po = pml = lse  # unused
    sink_arg = sink if sink is not None else lse
    flags = dict(VARIANT, **(variant or {}))
    bh = block_h(flags, H)
    grid = (T, -(-H // bh), S)
    args = (q, q.stride(0), q.stride(1), sink_arg, out, lse, po, pml,
            *c1, slots, l1, K1, slots.stride(0), block_size, cache.stride(0),
            *c2, i2, l2, K2, i2.stride(0), bs2, (extra_cache if has_pool2 else cache).stride(0),
            H, float(scale) * LOG2E, chunk)
    common = dict(HAS_LEN1=lengths is not None, HAS_POOL2=has_pool2,
                  HAS_LEN2=has_pool2 and extra_lengths is not None, HAS_SINK=sink is not None, SPLITS=S,
                  BH=bh, BN=BLOCK_N)
    fn, const = _kernel_and_flags(kern, flags, H)
    _LAST["decode"] = fn[grid](*args, **common, **const)
    if S > 1:
        kern["merge"][(T, H)](po, pml, sink_arg, out, lse, H, HAS_SINK=sink is not None, SPLITS=S, num_warps=4)
    return out, lse


# ---- registered as a torch custom op (with a fake), like every other dsv4ref kernel ----------------------


@torch.library.custom_op("dsv4ref::sparse_mla_decode_gluon", mutates_args=())
def decode_op(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor | None,
              extra_cache: torch.Tensor | None, extra_slots: torch.Tensor | None, extra_lengths: torch.Tensor | None,
              sink: torch.Tensor | None, block_size: int, extra_block_size: int, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return decode_gluon(q, cache, slots, lengths, block_size=block_size, sink=sink, scale=scale,
                        extra_cache=extra_cache, extra_slots=extra_slots, extra_lengths=extra_lengths,
                        extra_block_size=extra_block_size if extra_cache is not None else None)


@decode_op.register_fake
def _(q, cache, slots, lengths, extra_cache, extra_slots, extra_lengths, sink, block_size, extra_block_size, scale):
    T, H, D = q.shape
    return q.new_empty(T, H, D), q.new_empty(T, H, dtype=torch.float32)
