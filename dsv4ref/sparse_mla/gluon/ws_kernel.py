"""The 64-row warp-specialised Hopper kernel: the default for H > 16 (``GluonLaunch(kernel="ws")``).

One program per (token, 64 heads, list split): wgmma's M is 64 rows per warpgroup, so 64 heads are one MMA
tile (H = 128 takes two programs). 12 warps in three roles, joined by mbarriers:

* **producer** (4 warps, :data:`~.launch.WS_PRODUCER_REGS` registers, :func:`_ws_producer`): gathers the
  584-byte rows of each chunk of 64 candidates as int64 words, half a chunk at a time with the slot indices
  fetched half a chunk ahead, dequantises e4m3 × 2^(scale − 127) to bf16 and stores the tile into a
  2-stage ring of shared K tiles [64, 512] (NVMMA 128-byte swizzle, read by wgmma directly); arrives on
  ``ready[stage]``;
* **scorer** (4 warps, the rest of the registers, :func:`_roles_scorer`): brings the query to shared memory
  by cp.async while the producer already fetches, then per chunk S = Q·Kᵀ as one n = 64 wgmma, the online
  softmax with every row max and sum inside its own warpgroup, P (bf16) and the rescale factor α to a
  2-deep shared buffer (``pfull`` / ``pfree``) and its half of the output, O[:, 0:256] += P · V[:, 0:256];
* **P·V warpgroup** (4 warps, :data:`~.launch.WS_PV_REGS` registers, :func:`_roles_pv`): rescales and
  accumulates O[:, 256:512] from the shared P. Each half accumulator is 64 × 256 fp32, 128 registers per
  thread: no spill. Both consumers release the stage on ``empty`` (two arrivals). V is the same K tile.

Shared memory: Q 64 KB, two K stages 128 KB, P 16 KB: about 215 KB, so one program per SM. With one list
split the output leaves through a released K stage as 16-byte row vectors; the query's NaN / ±inf scan
runs after the loop, and only when a head counted no candidate.

The arguments' short names (``i1``, ``n1``, ``c1_u8``, ``t64``, ``hb``, ``sp``, …) are the ones every kernel
uses: the table at the top of :mod:`.common` says what each holds.
"""

from .lang import _bar, _gluon, fence_async_shared, gl, mbarrier, warpgroup_mma, warpgroup_mma_wait
from .common import _dequant_store_packed, _epilogue, _load_rows_packed, _program, _q_async, _q_scan, _slots, _softmax_step


@_gluon.jit
def _ws_producer(
    k_smem,
    ready,
    empty,
    start,
    n_it,
    n1,
    stop,
    i1,
    i2,
    c1_u8,
    c1_i16,
    c1_i64,
    bs1,
    ps1,
    c2_u8,
    c2_i16,
    c2_i64,
    bs2,
    ps2,
    BN: gl.constexpr,
    NS: gl.constexpr,
):
    """The producer warps (4): gather + dequantise each chunk into the shared ring, half a chunk (32 rows)
    at a time, the rows held packed (int64 words: no byte or 16-bit value lives in a register of its own).
    One half is in registers: the next half's row loads are issued right after the current half is
    dequantised, and the slot indices are fetched one half ahead of the rows, so the two dependent memory
    round trips of a gathered row (index, then row) do not sit in series. (c1_u8, c1_i16 and their pool-2
    twins: the byte views, passed along with the rest of the kernel's arguments and not read here.)"""
    LW: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])  # [32, 8] int64 = 16 B per thread
    HALF: gl.constexpr = BN // 2
    rows = gl.arange(0, HALF, gl.SliceLayout(1, LW))
    sa, ia, oa = _slots(start + rows, n1, stop, i1, i2)
    a = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
    sa, ia, oa = _slots(start + HALF + rows, n1, stop, i1, i2)
    for it in range(n_it):
        st = it % NS
        v0 = start + it * BN
        mbarrier.wait(empty.index(st), ((it // NS) & 1) ^ 1)
        kb = k_smem.index(st)
        _dequant_store_packed(kb.slice(0, HALF, dim=0), a, True)
        a = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
        sa, ia, oa = _slots(v0 + BN + rows, n1, stop, i1, i2)
        _dequant_store_packed(kb.slice(HALF, HALF, dim=0), a, True)
        a = _load_rows_packed(sa, ia, oa, c1_i64, bs1, ps1, c2_i64, bs2, ps2, LW)
        sa, ia, oa = _slots(v0 + BN + HALF + rows, n1, stop, i1, i2)
        fence_async_shared()
        _bar()
        mbarrier.arrive(ready.index(st))


@_gluon.jit
def _roles_scorer(
    q_smem,
    qbad_smem,
    k_smem,
    p_smem,
    a_smem,
    ml_smem,
    ready,
    empty,
    pfull,
    pfree,
    fin,
    start,
    n_it,
    n1,
    stop,
    i1,
    i2,
    qk_scale,
    t64,
    hb,
    sp,
    H,
    sink_ptr,
    out_ptr,
    lse_ptr,
    po_ptr,
    pml_ptr,
    HAS_SINK: gl.constexpr,
    SPLITS: gl.constexpr,
    BH: gl.constexpr,
    BN: gl.constexpr,
    NS: gl.constexpr,
    q_ptr,
    q_st,
    q_sh,
):
    """The scoring warpgroup (the default partition, 4 warps): it first brings the query to shared memory
    itself by cp.async (:func:`_q_async`, while the producer already fetches rows), then per chunk S = Q·Kᵀ
    for all 64 candidates as n = 64 wgmma (Q read once per chunk, not once per warpgroup), the online
    softmax with every row max and sum inside one warpgroup (no CTA barrier), then P (bf16) and the
    rescale factor alpha are published to the P·V warpgroup through a 2-deep shared buffer (mbarriers
    pfull / pfree), and its own half of the output, O[:, 0:256] += P · V[:, 0:256], runs with P in
    registers. The query's NaN / ±inf scan is not run before the first chunk but after the last, and only
    if a head counted no candidate: a non-finite query row makes every one of its scores non-finite, and
    the softmax turns l into NaN by itself; only a row with nothing counted needs the poison word. With
    SPLITS == 1 the output leaves through K stage 0, once the last chunk's stage is released by both
    warpgroups (:func:`_epilogue`)."""
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    _q_async(q_ptr, t64, q_st, q_sh, hb, H, q_smem, qbad_smem, BH, False)  # the scan comes after the loop
    m = gl.full([BH], -float("inf"), gl.float32, gl.SliceLayout(1, S_L))
    l = gl.zeros([BH], gl.float32, gl.SliceLayout(1, S_L))
    acc = gl.zeros([BH, 256], gl.float32, O_L)
    s0 = gl.zeros([BH, BN], gl.float32, S_L)
    cols = start + gl.arange(0, BN, gl.SliceLayout(0, S_L))
    _, _, okc = _slots(cols, n1, stop, i1, i2)
    for it in range(n_it):
        st = it % NS
        b = it % 2
        kb = k_smem.index(st)
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
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
        _bar()
        mbarrier.arrive(empty.index(st))
    if gl.max((l == 0).to(gl.int32), axis=0) > 0:  # a head with no counted candidate (rare)
        _q_scan(q_smem, qbad_smem, BH)
    else:
        qbad_smem.store(gl.zeros([BH], gl.float32, gl.SliceLayout(1, S_L)))
    ml_smem.index(0).store(m)  # the final row max and sum, for the P·V warpgroup's epilogue
    ml_smem.index(1).store(l)
    _bar()
    mbarrier.arrive(fin)
    if SPLITS == 1:  # the P·V warpgroup's last read of a K stage is over (it released it)
        last = gl.maximum(n_it - 1, 0)
        mbarrier.wait(empty.index(last % NS), (last // NS) & 1, pred=n_it > 0)
    _epilogue(
        acc,
        m,
        l,
        qbad_smem,
        t64,
        hb,
        sp,
        H,
        sink_ptr,
        out_ptr,
        lse_ptr,
        po_ptr,
        pml_ptr,
        HAS_SINK,
        SPLITS,
        BH,
        O_L,
        S_L,
        0,
        256,
        True,
        k_smem.index(0).slice(0, 256, dim=1),
    )


@_gluon.jit
def _roles_pv(
    q_smem,
    qbad_smem,
    k_smem,
    p_smem,
    a_smem,
    ml_smem,
    ready,
    empty,
    pfull,
    pfree,
    fin,
    start,
    n_it,
    n1,
    stop,
    i1,
    i2,
    qk_scale,
    t64,
    hb,
    sp,
    H,
    sink_ptr,
    out_ptr,
    lse_ptr,
    po_ptr,
    pml_ptr,
    HAS_SINK: gl.constexpr,
    SPLITS: gl.constexpr,
    BH: gl.constexpr,
    BN: gl.constexpr,
    NS: gl.constexpr,
):
    """The P·V warpgroup (a worker partition, 4 warps) of the role split: for each chunk it waits for
    the scorer's P and alpha, rescales its half of the output and runs O[:, 256:512] += P · V[:, 256:512]
    with P read from shared memory; it computes no score and no softmax, so it needs only the
    accumulator's registers. Both warpgroups release the K stage (empty counts two arrivals)."""
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    acc = gl.zeros([BH, 256], gl.float32, O_L)
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
    # (the scorer's MMAs are over once fin completes: stage 1 is free for the output)
    _epilogue(
        acc,
        m,
        l,
        qbad_smem,
        t64,
        hb,
        sp,
        H,
        sink_ptr,
        out_ptr,
        lse_ptr,
        po_ptr,
        pml_ptr,
        HAS_SINK,
        SPLITS,
        BH,
        O_L,
        S_L,
        256,
        256,
        False,
        k_smem.index(1).slice(0, 256, dim=1),
    )


@_gluon.jit
def _ws_kernel(
    q_ptr,
    q_st,
    q_sh,
    sink_ptr,
    out_ptr,
    lse_ptr,
    po_ptr,
    pml_ptr,
    c1_u8,
    c1_i16,
    c1_i64,
    i1_ptr,
    l1_ptr,
    K1,
    i1_st,
    bs1,
    ps1,
    c2_u8,
    c2_i16,
    c2_i64,
    i2_ptr,
    l2_ptr,
    K2,
    i2_st,
    bs2,
    ps2,
    H,
    qk_scale,
    chunk,
    HAS_LEN1: gl.constexpr,
    HAS_POOL2: gl.constexpr,
    HAS_LEN2: gl.constexpr,
    HAS_SINK: gl.constexpr,
    SPLITS: gl.constexpr,
    BH: gl.constexpr,
    BN: gl.constexpr,
    NS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    PV_REGS: gl.constexpr,
):
    """The 64-row warp-specialised kernel: 4 producer warps (:func:`_ws_producer`, PRODUCER_REGS registers)
    fill an NS-stage ring of dequantised K tiles (mbarriers ready / empty per stage); the default partition
    is the scorer (:func:`_roles_scorer`: the query, QKᵀ, the softmax, half of P·V) and a 4-warp P·V
    warpgroup on PV_REGS registers (:func:`_roles_pv`) accumulates the other half. The runtime arguments
    are the launcher's for every kernel (the byte views c1_u8 / c1_i16 and their pool-2 twins are only
    read by the plain kernel)."""
    gl.static_assert(BH == 64)
    gl.static_assert(BN == 64)
    SH_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    t64, hb, sp, n1, start, stop, n_it, i1, i2 = _program(
        chunk, K1, l1_ptr, K2, l2_ptr, i1_ptr, i1_st, i2_ptr, i2_st, BN, HAS_LEN1, HAS_POOL2, HAS_LEN2
    )

    # the scorer partition fills these (_q_async)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, 512], SH_L)
    qbad_smem = gl.allocate_shared_memory(gl.float32, [BH], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, 512], SH_L)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a stage
    # P (bf16) and alpha, 2 deep, from the scorer to the P·V warpgroup; the final (m, l)
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
    fence_async_shared()
    _bar()
    # registers: 512 per thread slot over three 4-warp partitions; the scorer gets the rest. (The partitions'
    # argument tuples are written out in the call: a tuple bound to a name first would turn its constexpr
    # members into tensors.)
    gl.warp_specialize(
        [
            (
                _roles_scorer,
                (
                    q_smem,
                    qbad_smem,
                    k_smem,
                    p_smem,
                    a_smem,
                    ml_smem,
                    ready,
                    empty,
                    pfull,
                    pfree,
                    fin,
                    start,
                    n_it,
                    n1,
                    stop,
                    i1,
                    i2,
                    qk_scale,
                    t64,
                    hb,
                    sp,
                    H,
                    sink_ptr,
                    out_ptr,
                    lse_ptr,
                    po_ptr,
                    pml_ptr,
                    HAS_SINK,
                    SPLITS,
                    BH,
                    BN,
                    NS,
                    q_ptr,
                    q_st,
                    q_sh,
                ),
            ),
            (
                _roles_pv,
                (
                    q_smem,
                    qbad_smem,
                    k_smem,
                    p_smem,
                    a_smem,
                    ml_smem,
                    ready,
                    empty,
                    pfull,
                    pfree,
                    fin,
                    start,
                    n_it,
                    n1,
                    stop,
                    i1,
                    i2,
                    qk_scale,
                    t64,
                    hb,
                    sp,
                    H,
                    sink_ptr,
                    out_ptr,
                    lse_ptr,
                    po_ptr,
                    pml_ptr,
                    HAS_SINK,
                    SPLITS,
                    BH,
                    BN,
                    NS,
                ),
            ),
            (
                _ws_producer,
                (
                    k_smem,
                    ready,
                    empty,
                    start,
                    n_it,
                    n1,
                    stop,
                    i1,
                    i2,
                    c1_u8,
                    c1_i16,
                    c1_i64,
                    bs1,
                    ps1,
                    c2_u8,
                    c2_i16,
                    c2_i64,
                    bs2,
                    ps2,
                    BN,
                    NS,
                ),
            ),
        ],
        [4, 4],
        [PV_REGS, PRODUCER_REGS],
    )
