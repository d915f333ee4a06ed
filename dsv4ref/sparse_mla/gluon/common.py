"""What the Hopper Gluon kernels share (imported only where Gluon imported: see :func:`.launch.kernels`).

* the candidate list: :func:`_slots` (virtual candidate ids -> slots), :func:`_candidate_range` and
  :func:`_program` (what one program owns: token, head block, list split, chunk count);
* the row loads and the dequantisation: byte-wise (:func:`_load_raw`, :func:`_dequant_store`: the plain
  kernel) and packed as int64 words (:func:`_load_rows_packed`, :func:`_dequant_store_packed`: the
  producers of the warp-specialised kernels); :func:`_tile` is e4m3 × 2^(scale − 127) -> bf16 for both;
* the query: to shared memory by registers (:func:`_q_to_shared`) or by cp.async (:func:`_q_async`), and
  its NaN / ±inf scan (:func:`_q_scan`);
* the softmax step (:func:`_softmax_step`), the per-head output scale (:func:`_head_scale`), the 64-row
  kernel's epilogue (:func:`_epilogue`) and the split merge (:func:`_merge_kernel`).

**The short names every kernel's arguments use** (the launcher passes the same runtime arguments to each):

=====================  ==============================================================================
name                   what it holds
=====================  ==============================================================================
``t64``                the token t, ``program_id(0)``, as int64 (so ``t · stride`` cannot overflow)
``hb``                 the head block, ``program_id(1)``: heads ``hb·BH … hb·BH + BH − 1``
``sp``                 the list split, ``program_id(2)``, in ``[0, SPLITS)``
``K1``, ``K2``         the width of each pool's slot table (entries per token)
``i1_ptr``, ``i1_st``  pool 1's slot table ``[T, K1]`` and its row stride (``i2_…``: pool 2's)
``l1_ptr``             pool 1's lengths ``[T]`` (``l2_ptr``: pool 2's; read only with ``HAS_LEN1/2``)
``i1``, ``i2``         token t's row of each slot table: ``i1_ptr + t64 · i1_st``
``n1``                 how many of pool 1's entries count for token t (``min(lengths[t], K1)``); token
                       t's list is those ``n1`` entries, then pool 2's: a virtual candidate id
                       ``v < n1`` is ``i1[v]``, else ``i2[v − n1]`` (:func:`_slots`)
``start``, ``stop``    the virtual ids ``[start, stop)`` split ``sp`` owns (``start = sp · chunk``;
                       ``chunk``, a multiple of ``BN``: the candidates per split; the last own fewer)
``n_it``               the chunks of ``BN`` candidates in ``[start, stop)``
``c1_u8``, ``c1_i16``,  pool 1's cache pages viewed as bytes, int16 words and int64 words (one buffer,
``c1_i64``             three element types; ``c2_…``: pool 2's)
``bs1``, ``ps1``       pool 1's block size (tokens per page) and page stride in bytes (``bs2``, ``ps2``)
``q_st``, ``q_sh``     q's strides over tokens and over heads
``po``, ``pml``        the split partials ``[T, S, H, 512]`` and ``[T, S, H, 2]`` (unused when S = 1)
``qk_scale``           ``scale · log2 e``: scores in the log2 domain
``sa``, ``ia``, ``oa``  per row: its slot (int64), whether it comes from pool 1, whether it counts
``BH``, ``BN``, ``NS``  heads per program, candidates per chunk, K stages in the shared ring
=====================  ==============================================================================
"""

from .lang import _async_load, _bar, _gluon, async_copy, fence_async_shared, gl


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
def _load_raw(
    v0,
    n1,
    stop,
    i1_ptr,
    i2_ptr,
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
    LU: gl.constexpr,
):
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
def _load_rows(slot, in1, ok, c1_u8, c1_i16, c1_i64, bs1, ps1, c2_u8, c2_i16, c2_i64, bs2, ps2, LU: gl.constexpr):
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
def _candidate_range(
    t, sp, chunk, K1, l1_ptr, K2, l2_ptr, HAS_LEN1: gl.constexpr, HAS_POOL2: gl.constexpr, HAS_LEN2: gl.constexpr
):
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
def _program(
    chunk,
    K1,
    l1_ptr,
    K2,
    l2_ptr,
    i1_ptr,
    i1_st,
    i2_ptr,
    i2_st,
    BN: gl.constexpr,
    HAS_LEN1: gl.constexpr,
    HAS_POOL2: gl.constexpr,
    HAS_LEN2: gl.constexpr,
):
    """What a program of the decode kernels owns: token t (as int64), head block hb, list split
    sp, its candidate range (n1, start, stop: :func:`_candidate_range`), its chunk count n_it and the
    token's two slot rows i1, i2."""
    t = gl.program_id(0)
    t64 = t.to(gl.int64)
    sp = gl.program_id(2)
    n1, start, stop = _candidate_range(t, sp, chunk, K1, l1_ptr, K2, l2_ptr, HAS_LEN1, HAS_POOL2, HAS_LEN2)
    n_it = gl.maximum(gl.cdiv(stop - start, BN), 0)
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
    q = gl.load(
        q_ptr + t64 * q_st + hq[:, None].to(gl.int64) * q_sh + dq[None, :], mask=(hq[:, None] < H) & (dq[None, :] >= 0), other=0.0
    )
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, 512], SH_L)
    q_smem.store(q)
    bad = _nonfinite_rows(q) != 0
    qbad_smem = gl.allocate_shared_memory(gl.float32, [BH], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
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
        q_smem, q_ptr + t64 * q_st + hq[:, None].to(gl.int64) * q_sh + dq[None, :], mask=(hq[:, None] < H) & (dq[None, :] >= 0)
    )
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
def _epilogue(
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
    HAS_SINK: gl.constexpr,
    SPLITS: gl.constexpr,
    BH: gl.constexpr,
    O_L: gl.constexpr,
    S_L: gl.constexpr,
    D0: gl.constexpr,
    DW: gl.constexpr,
    ML: gl.constexpr,
    o_st,
):
    """The 4-warp epilogue of the 64-row kernel's two consumer warpgroups: out = acc / l · σ(lse − sink)
    and lse (SPLITS == 1), or the partial (acc, m, l) for the merge. acc holds output columns
    [D0, D0 + DW); ML: this caller also writes lse (or m, l). qbad_smem: the heads' poison words
    (:func:`_q_to_shared`), added to l. With SPLITS == 1 the bf16 output goes through the free shared tile
    ``o_st`` [BH, DW], then out to global memory as whole 16-byte vectors along each row (the
    accumulator's own layout stores 4 bytes per thread, rows apart)."""
    l = l + qbad_smem.load(gl.SliceLayout(1, S_L))
    h_o = hb * BH + gl.arange(0, BH, gl.SliceLayout(1, O_L))
    d_o = D0 + gl.arange(0, DW, gl.SliceLayout(0, O_L))
    h_s = hb * BH + gl.arange(0, BH, gl.SliceLayout(1, S_L))
    if SPLITS == 1:
        nonempty, lse, f = _head_scale(m, l, h_s, H, sink_ptr, HAS_SINK)
        out = acc * gl.convert_layout(f, gl.SliceLayout(1, O_L))[:, None]
        LO: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16 B per thread, rows whole
        o_st.store(out.to(gl.bfloat16))
        _bar()
        h_b = hb * BH + gl.arange(0, BH, gl.SliceLayout(1, LO))
        d_b = D0 + gl.arange(0, DW, gl.SliceLayout(0, LO))
        row_b = t64 * H + h_b.to(gl.int64)
        gl.store(out_ptr + row_b[:, None] * 512 + d_b[None, :], o_st.load(LO), mask=(h_b[:, None] < H) & (d_b[None, :] >= 0))
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
def _bytes_of(w):
    """[R, C] int64 words -> [R, 8·C] uint8, byte i of word j at column 8j + i (little-endian). The
    joins add in-register dimensions; the innermost join is the most significant bit of the byte index."""
    lo = w.to(gl.int32)
    hi = (w >> 32).to(gl.int32)
    x = gl.join(
        gl.join(gl.join(lo & 255, hi & 255), gl.join((lo >> 16) & 255, (hi >> 16) & 255)),
        gl.join(gl.join((lo >> 8) & 255, (hi >> 8) & 255), gl.join((lo >> 24) & 255, (hi >> 24) & 255)),
    )
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
