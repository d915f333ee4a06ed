"""The plain Hopper kernel: rung "a" of notebook 04's ladder (``GluonLaunch(kernel="plain")``).

One program per (token, 64 heads, list split), 8 warps that do everything in series per chunk: load and
dequantise the next chunk into the second of two shared K buffers, S = Q·Kᵀ and the online softmax, then
O += P·V. The warp-specialised kernels (:mod:`.ws_kernel`, :mod:`.narrow_kernel`) keep its row loads,
dequantisation, prologue and epilogue arithmetic (:mod:`.common`) and add producer warps that fill a ring
of stages ahead of the MMAs. Same contract and results as the default kernels; slower on every bench shape.

The arguments' short names (``i1``, ``n1``, ``c1_u8``, ``t64``, ``hb``, ``sp``, …): the table at the top of
:mod:`.common`.
"""

from .lang import _bar, _gluon, fence_async_shared, gl, warpgroup_mma, warpgroup_mma_wait
from .common import _dequant_store, _head_scale, _load_raw, _program, _q_to_shared, _slots, _softmax_step


@_gluon.jit
def _decode_kernel(
    q_ptr,
    q_st,
    q_sh,  # q [T, H, 512] bf16, last dim contiguous
    sink_ptr,  # [H] fp32 (HAS_SINK)
    out_ptr,
    lse_ptr,  # [T, H, 512] bf16, [T, H] fp32 (SPLITS == 1)
    po_ptr,
    pml_ptr,  # [T, SPLITS, H, 512] fp32 partial acc, [T, SPLITS, H, 2] (m, l) log2 domain (SPLITS > 1)
    c1_u8,
    c1_i16,
    c1_i64,
    i1_ptr,
    l1_ptr,
    K1,
    i1_st,
    bs1,
    ps1,  # pool 1: cache views, indices, lengths
    c2_u8,
    c2_i16,
    c2_i64,
    i2_ptr,
    l2_ptr,
    K2,
    i2_st,
    bs2,
    ps2,  # pool 2 (HAS_POOL2)
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
):
    """The plain kernel (rung "a" of notebook 04's ladder): no warp specialisation. The 8 warps (two
    warpgroups) of one program load and dequantise chunk it + 1 into the other of two shared K buffers only
    after chunk it's P·V is issued, so the load latency is exposed; both warpgroups split every MMA by
    columns (QKᵀ as n = 32 wgmma each) and the softmax's row reductions cross them. P reaches the P·V MMA
    through shared memory."""
    gl.static_assert(BH == 64)
    gl.static_assert(BN == 64)
    # layouts: two warpgroups split every MMA's N (columns); raw loads 16 bytes per thread
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16])
    LU: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    SH_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    # this program's token, head block, list split and candidate range (the two pools' valid prefixes,
    # concatenated, then split) in chunks of BN
    t64, hb, sp, n1, start, stop, n_it, i1, i2 = _program(
        chunk, K1, l1_ptr, K2, l2_ptr, i1_ptr, i1_st, i2_ptr, i2_st, BN, HAS_LEN1, HAS_POOL2, HAS_LEN2
    )

    # Q -> shared memory (padded heads: zero rows)
    q_smem, qbad_smem = _q_to_shared(q_ptr, t64, q_st, q_sh, hb, H, BH, LQ, SH_L)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 512], SH_L)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], SH_L)

    # prologue: chunk 0 dequantised into buffer 0
    r0, r1, r2, r3, r4, r5, r6, rr, sc = _load_raw(
        start, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64, bs1, ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, BN, LU
    )
    _dequant_store(k_smem.index(0), r0, r1, r2, r3, r4, r5, r6, rr, sc)
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
        p, alpha, m, l = _softmax_step(s, m, l, okc, qk_scale)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        # P through shared memory: no P registers live while the MMA runs
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        _bar()
        acc = warpgroup_mma(p_smem, kb, acc, is_async=True)
        # load and dequantise chunk it+1 only now (its load latency is exposed)
        a0, a1, a2, a3, a4, a5, a6, ar, asc = _load_raw(
            v0 + BN, n1, stop, i1, i2, c1_u8, c1_i16, c1_i64, bs1, ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, BN, LU
        )
        _dequant_store(k_smem.index(1 - cur), a0, a1, a2, a3, a4, a5, a6, ar, asc)
        fence_async_shared()
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _bar()

    l = l + qbad_smem.load(gl.SliceLayout(1, S_L))  # NaN for a query row holding NaN / ±inf
    h_o = hb * BH + gl.arange(0, BH, gl.SliceLayout(1, O_L))
    d_o = gl.arange(0, 512, gl.SliceLayout(0, O_L))
    h_s = hb * BH + gl.arange(0, BH, gl.SliceLayout(1, S_L))
    if SPLITS == 1:
        nonempty, lse, f = _head_scale(m, l, h_s, H, sink_ptr, HAS_SINK)
        out = acc * gl.convert_layout(f, gl.SliceLayout(1, O_L))[:, None]
        row = t64 * H + h_o.to(gl.int64)
        gl.store(out_ptr + row[:, None] * 512 + d_o[None, :], out.to(gl.bfloat16), mask=(h_o[:, None] < H) & (d_o[None, :] >= 0))
        gl.store(lse_ptr + t64 * H + h_s, gl.where(nonempty, lse, -float("inf")), mask=h_s < H)
    else:
        row = (t64 * SPLITS + sp) * H + h_o.to(gl.int64)
        gl.store(po_ptr + row[:, None] * 512 + d_o[None, :], acc, mask=(h_o[:, None] < H) & (d_o[None, :] >= 0))
        row_s = (t64 * SPLITS + sp) * H + h_s.to(gl.int64)
        gl.store(pml_ptr + row_s * 2, m, mask=h_s < H)
        gl.store(pml_ptr + row_s * 2 + 1, l, mask=h_s < H)
