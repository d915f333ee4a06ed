"""The narrow-head warp-specialised Hopper kernel: the default for H <= 16 (``GluonLaunch(kernel="narrow")``).

The products transposed so the heads are wgmma's N (16) instead of its M (64, three quarters padding at
H = 16): Sᵀ[64, 16] = K·Qᵀ, the softmax down each column, Oᵀ[512, 16] += Vᵀ·Pᵀ with Vᵀ the same K tile read
transposed. Oᵀ is 64 registers per thread, which leaves room for **two** producer warpgroups
(:data:`~.launch.NARROW_REGS` registers each; each dequantises half of every chunk) and a third K stage.

The arguments' short names (``i1``, ``n1``, ``c1_u8``, ``t64``, ``hb``, ``sp``, …): the table at the top of
:mod:`.common`.
"""

from .lang import _bar, _gluon, fence_async_shared, gl, mbarrier, warpgroup_mma, warpgroup_mma_wait
from .common import _dequant_store_packed, _head_scale, _load_rows_packed, _program, _q_async, _slots


@_gluon.jit
def _narrow_producer(
    k_smem,
    ready,
    empty,
    start,
    n_it,
    n1,
    stop,
    i1,
    i2,
    c1_i64,
    bs1,
    ps1,
    c2_i64,
    bs2,
    ps2,
    BN: gl.constexpr,
    NS: gl.constexpr,
    PART: gl.constexpr,
):
    """One of the narrow kernel's two producer warpgroups: rows [PART·BN/2, (PART + 1)·BN/2) of every
    chunk (the other warpgroup dequantises the other half at the same time, so a chunk's dequantisation
    takes half as long as with one producer). Two chunks' rows are held as packed words: chunk it + 1's
    loads are in flight while chunk it is dequantised, and chunk it + 2's are issued right after."""
    LW: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])  # [32, 8] int64 = 16 B per thread
    HALF: gl.constexpr = BN // 2
    rows = PART * HALF + gl.arange(0, HALF, gl.SliceLayout(1, LW))
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
def _narrow_consumer(
    q_smem,
    qbad_smem,
    k_smem,
    p_smem,
    ready,
    empty,
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
    q_ptr,
    q_st,
    q_sh,
    HAS_SINK: gl.constexpr,
    SPLITS: gl.constexpr,
    BH: gl.constexpr,
    BN: gl.constexpr,
    NS: gl.constexpr,
):
    """The narrow kernel's MMA warpgroup (the default partition, 4 warps), on transposed products so that
    the heads are the wgmma's N (16) instead of its M (64, three quarters padding at H = 16):
    Sᵀ[BN, BH] = K · Qᵀ (A = the K tile, B = the query), the online softmax down the columns (one
    per head), Pᵀ (bf16) to shared memory, and Oᵀ[512, BH] += Vᵀ · Pᵀ (A = the same K tile read
    transposed: 8 row blocks of 64 dims). Oᵀ is 64 fp32 registers per thread, not 128."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    V_L: gl.constexpr = gl.SliceLayout(0, S_L)  # one value per head
    _q_async(q_ptr, t64, q_st, q_sh, hb, H, q_smem, qbad_smem, BH)
    m = gl.full([BH], -float("inf"), gl.float32, V_L)
    l = gl.zeros([BH], gl.float32, V_L)
    acc = gl.zeros([512, BH], gl.float32, S_L)  # Oᵀ (S_L's instruction shape serves both products)
    s0 = gl.zeros([BN, BH], gl.float32, S_L)
    cols = start + gl.arange(0, BN, gl.SliceLayout(1, S_L))
    _, _, okc = _slots(cols, n1, stop, i1, i2)
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
    hm = (h[None, :] < H) & (d[:, None] >= 0)
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
):
    """The narrow-head kernel (H <= 16): one program per (token, list split) with the heads as the MMAs' N
    (:func:`_narrow_consumer`), so its tensor-core work is the useful work, and the registers the
    64-row accumulator no longer needs go to a second producer warpgroup (:func:`_narrow_producer`):
    dequantisation, the slower half of this kernel at small H, runs on 8 warps instead of 4. Shared
    memory: the query [BH, 512], an NS-stage ring of K tiles [BN, 512] and Pᵀ [BH, BN], all bf16."""
    gl.static_assert(BN == 64)
    SH_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    t64, hb, sp, n1, start, stop, n_it, i1, i2 = _program(
        chunk, K1, l1_ptr, K2, l2_ptr, i1_ptr, i1_st, i2_ptr, i2_st, BN, HAS_LEN1, HAS_POOL2, HAS_LEN2
    )
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, 512], SH_L)
    qbad_smem = gl.allocate_shared_memory(gl.float32, [BH], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, 512], SH_L)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], SH_L)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=2)  # both producer warpgroups
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    _bar()
    gl.warp_specialize(
        [
            (
                _narrow_consumer,
                (
                    q_smem,
                    qbad_smem,
                    k_smem,
                    p_smem,
                    ready,
                    empty,
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
                    q_ptr,
                    q_st,
                    q_sh,
                    HAS_SINK,
                    SPLITS,
                    BH,
                    BN,
                    NS,
                ),
            ),
            (
                _narrow_producer,
                (k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_i64, bs1, ps1, c2_i64, bs2, ps2, BN, NS, 0),
            ),
            (
                _narrow_producer,
                (k_smem, ready, empty, start, n_it, n1, stop, i1, i2, c1_i64, bs1, ps1, c2_i64, bs2, ps2, BN, NS, 1),
            ),
        ],
        [4, 4],
        [PRODUCER_REGS, PRODUCER_REGS],
    )
