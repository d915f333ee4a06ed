"""The mHC launchers, one per design (``launch_one_kernel``, ``launch_split_k``, ``launch_one_pass``,
``launch_chunked``; ``launch_hc`` runs one call of pre, fused post+pre or head with the launcher of its launch's
type), and the custom ops that run them: ``mhc_pre_op``, ``mhc_fused_post_pre_op``, ``mhc_head_op``, ``mhc_post_op``,
``mhc_sinkhorn_op`` (the objects the public functions call)."""

from __future__ import annotations

import torch
import triton

from ..device import interpreting
from . import kernels, kernels_chunked, kernels_one_pass, kernels_split_k
from .fn_split import split_fn_wide
from .launch import ONE_PASS_LAG, ONE_PASS_SUM_UNROLL, ChunkedLaunch, MhcLaunch, OneKernelLaunch, OnePassLaunch, SplitKLaunch

# ====================================================================================================
# Launchers, one per design: each takes its launch class, (T, Hd), the pointers launch_hc makes (``ptrs``:
# streams, x, post_in, comb_in, new, fn split), scale, base, post, comb, out, the scalars, head and fused.
# ====================================================================================================


def launch_one_kernel(L: OneKernelLaunch, T, Hd, ptrs, scale, base, post, comb, out, scalars, *, head, fused) -> None:
    """The one-kernel design (kernels.py, ``hc_kernel``): a program per ``block_t`` tokens."""
    kw = dict(num_warps=L.warps, num_stages=L.stages) if not interpreting() else {}
    kernels.hc_kernel[(triton.cdiv(T, L.block_t),)](
        *ptrs,
        scale,
        base,
        post,
        comb,
        out,
        T,
        Hd,
        *scalars,
        HEAD=head,
        FUSED=fused,
        BLOCK_T=L.block_t,
        BLOCK_K=L.block_k,
        DOT_FP32=interpreting(),
        **kw,
    )


def launch_split_k(L: SplitKLaunch, T, Hd, ptrs, scale, base, post, comb, out, scalars, *, head, fused) -> None:
    """The split-K design (kernels_split_k.py): the partial kernel (grid: K splits × token tiles) into a workspace
    of [splits, T, 32] partial mixes and [splits, T] Σ X², then the finish kernel (grid: hidden parts × tiles)."""
    compiled = not interpreting()
    n_split, cps = L.plan(T, Hd)
    ws = torch.empty(n_split * T * 33, dtype=torch.float32, device=out.device)  # [S, T, 32] mix | [S, T] Σ X²
    mix_ws, ssq_ws = ws[: n_split * T * 32], ws[n_split * T * 32 :]
    kw = dict(num_warps=L.warps, num_stages=L.stages) if compiled else {}
    kernels_split_k.hc_partial_kernel[(n_split, triton.cdiv(T, L.block_t))](
        *ptrs,
        mix_ws,
        ssq_ws,
        T,
        Hd,
        cps,
        HEAD=head,
        FUSED=fused,
        BLOCK_T=L.block_t,
        BLOCK_K=L.block_k,
        DOT_FP32=not compiled,
        **kw,
    )
    tiles, parts, h_per_part = L.finish_plan(T, Hd)
    kw = dict(num_warps=L.finish_warps) if compiled else {}
    kernels_split_k.hc_finish_kernel[(parts, tiles)](
        ptrs[4] if fused else ptrs[0],  # the new streams, or the streams
        mix_ws,
        ssq_ws,
        scale,
        base,
        post,
        comb,
        out,
        T,
        Hd,
        n_split,
        h_per_part,
        *scalars,
        HEAD=head,
        BLOCK_T=L.finish_block_t,
        BLOCK_H=L.finish_block_h,
        **kw,
    )


def one_pass_args(L: OnePassLaunch, T: int, Hd: int, head: bool, fused: bool):
    """What ``hc_one_pass_kernel`` is launched with for a [T, 4, Hd] op: (grid, constexprs but DOT_FP32,
    compile options, (mix workspace, Σ X² workspace, sync buffer) element counts, (tiles, slices, chunks per
    slice)). The workspace rows hold the live columns only (pre 8 + 16, head 4)."""
    tiles, slices, cps, bk = L.plan(T, Hd)
    ws_gate, ws_stride = (4, 4) if head else (8, 24)
    consts = dict(
        HEAD=head,
        FUSED=fused,
        BLOCK_T=L.block_t,
        BLOCK_K=bk,
        BLOCK_H=L.block_h,
        LAG=ONE_PASS_LAG,
        SPIN_LIMIT=1 << 16,
        SUM_UNROLL=ONE_PASS_SUM_UNROLL,
        ONE_DOT=1 if fused else L.one_dot,
        WS_GATE=ws_gate,
        WS_STRIDE=ws_stride,
        HW_ROUND=not interpreting(),
    )  # the interpreter's cast truncates
    opts = dict(
        num_warps=L.warps,
        num_stages=L.fused_stages if fused else L.stages,
        maxnreg=None if fused else L.maxnreg,
    )
    sizes = (slices * T * ws_stride, slices * T, 1 + 2 * tiles)
    return ((tiles + ONE_PASS_LAG) * slices,), consts, opts, sizes, (tiles, slices, cps)


def launch_one_pass(L: OnePassLaunch, T, Hd, ptrs, scale, base, post, comb, out, scalars, *, head, fused) -> None:
    """The one-pass design (kernels_one_pass.py): one launch of ``hc_one_pass_kernel``, its workspaces and the
    ticket / arrival / ready counters zeroed per call."""
    grid, consts, opts, (n_mix, n_ssq, n_sync), (tiles, slices, cps) = one_pass_args(L, T, Hd, head, fused)
    ws = torch.empty(n_mix + n_ssq + T * 4, dtype=torch.float32, device=out.device)
    mix_ws, ssq_ws, wpre = ws[:n_mix], ws[n_mix : n_mix + n_ssq], ws[n_mix + n_ssq :]
    sync = torch.zeros(n_sync, dtype=torch.int32, device=out.device)  # ticket | arrivals | READY
    compiled = not interpreting()
    kernels_one_pass.hc_one_pass_kernel[grid](
        *ptrs,
        scale,
        base,
        post,
        comb,
        out,
        mix_ws,
        ssq_ws,
        wpre,
        sync,
        T,
        Hd,
        tiles,
        slices,
        cps,
        *scalars,
        **consts,
        DOT_FP32=not compiled,
        **(opts if compiled else {}),
    )


def chunk_args(L: ChunkedLaunch, T: int, Hd: int, head: bool, fused: bool):
    """What the chunked design launches for a [T, 4, Hd] op (shared with benchmarks/experiments/mhc/):
    (plan, partial, finish, (mix workspace, Σ X² workspace) element counts). ``plan`` = (tokens per chunk C,
    chunks, slices, BLOCK_K chunks per slice, finish parts, hidden dims per part); ``partial`` / ``finish`` =
    (constexprs but DOT_FP32, compile options) of ``hc_chunk_partial_kernel`` / ``hc_chunk_finish_kernel``. One
    workspace serves every chunk: a chunk's finish kernel has read it before the next chunk's partial kernel
    writes it (the same stream). ``fused``: the two kernels run after ``post_kernel`` (only the walk order of
    ``zigzag`` differs: post forward, partial backward, finish forward)."""
    partial_back = L.zigzag and fused  # after post_kernel's forward walk
    finish_back = L.zigzag and not partial_back
    c, n_chunks, slices, cps, bk = L.plan(T, Hd)
    bt, _, warps, stages, maxnreg = L.tile(T)
    parts, h_per_part = L.finish_plan(c, Hd)
    ws_gate, ws_stride = (4, 4) if head else (8, 24)  # the live columns only
    hw = not interpreting()  # bf16 outputs rounded by the hardware conversion (the interpreter's cast truncates)
    partial = (
        dict(
            HEAD=head,
            BLOCK_T=bt,
            BLOCK_K=bk,
            WS_GATE=ws_gate,
            WS_STRIDE=ws_stride,
            STREAM_K=L.stream_k,
            FN_LAYOUT=L.fn_layout,
            REVERSE=partial_back,
        ),
        dict(num_warps=warps, num_stages=stages, maxnreg=maxnreg),
    )
    finish = (
        dict(
            HEAD=head,
            BLOCK_T=L.finish_block_t,
            BLOCK_H=L.finish_block_h,
            SUM_UNROLL=L.sum_unroll,
            WS_GATE=ws_gate,
            WS_STRIDE=ws_stride,
            HW_ROUND=hw,
            REVERSE=finish_back,
        ),
        dict(num_warps=L.finish_warps),
    )
    return (c, n_chunks, slices, cps, parts, h_per_part), partial, finish, (slices * c * ws_stride, slices * c)


def launch_chunked(L: ChunkedLaunch, T, Hd, ptrs, scale, base, post, comb, out, scalars, *, head, fused) -> None:
    """The chunked design (kernels_chunked.py): per chunk of C tokens, the partial kernel (grid: the chunk's token
    tiles × slices) then the finish kernel (grid: hidden parts × the chunk's finish tiles), into one workspace
    (one chunk's partials) allocated once per call. Fused: per chunk ``post_kernel`` first (3 launches per
    chunk), then pre's two kernels on the new streams it wrote, so fused == post then pre bit for bit by
    construction."""
    (c, n_chunks, slices, cps, parts, h_per_part), (pc, po), (fc, fo), (n_mix, n_ssq) = chunk_args(L, T, Hd, head, fused)
    res_in, x, post_in, comb_in, new, fs = ptrs
    if L.fn_layout:  # 2, 3: the partial kernel reads fn from the K-major [4·NG, 4·Hd] copy
        fs = split_fn_wide(fs)
    src = new if fused else res_in  # what the partial and finish kernels read
    compiled = not interpreting()
    ws = torch.empty(n_mix + n_ssq, dtype=torch.float32, device=res_in.device)
    mix_ws, ssq_ws = ws[:n_mix], ws[n_mix:]
    po = po if compiled else {}
    fo = fo if compiled else {}
    bt, fbt = pc["BLOCK_T"], fc["BLOCK_T"]
    for k in range(n_chunks):
        t0 = k * c
        t_end = min(T, t0 + c)
        if fused:
            grid = (triton.cdiv(t_end - t0, L.post_block_t), triton.cdiv(Hd, L.post_block_h))
            kernels.post_kernel[grid[::-1] if L.zigzag else grid](
                x,
                res_in,
                post_in,
                comb_in,
                new,
                t0,
                t_end,
                Hd,
                BLOCK_T=L.post_block_t,
                BLOCK_H=L.post_block_h,
                TOKEN_MAJOR=L.zigzag,
            )
        kernels_chunked.hc_chunk_partial_kernel[(triton.cdiv(t_end - t0, bt) * slices,)](
            src, fs, mix_ws, ssq_ws, t0, t_end, Hd, c, slices, cps, **pc, DOT_FP32=not compiled, **po
        )
        kernels_chunked.hc_chunk_finish_kernel[(parts, triton.cdiv(t_end - t0, fbt))](
            src, mix_ws, ssq_ws, scale, base, post, comb, out, t0, t_end, Hd, c, slices, h_per_part, *scalars, **fc, **fo
        )


LAUNCHERS = {
    OneKernelLaunch: launch_one_kernel,
    SplitKLaunch: launch_split_k,
    OnePassLaunch: launch_one_pass,
    ChunkedLaunch: launch_chunked,
}


def launch_hc(
    res,
    x,
    post_in,
    comb_in,
    new,
    fs,
    scale,
    base,
    post,
    comb,
    out,
    rms_eps,
    hc_eps,
    post_mult,
    iters,
    *,
    head: bool,
    fused: bool,
    launch: MhcLaunch,
) -> None:
    """Run pre (``fused=False``), fused post+pre (``fused=True``: x, post_in, comb_in, new given) or the head
    (``head=True``: no post / comb outputs) into the given buffers, with the launcher of ``launch``'s type
    (``LAUNCHERS``). Arguments that an op does not have are None; the kernels never touch them (``scale``
    stands in)."""
    T, M, Hd = res.shape
    if T == 0:
        return
    i16 = lambda t: (t if t is not None else res).view(torch.int16)  # noqa: E731
    opt = lambda t: t if t is not None else scale  # noqa: E731
    ptrs = (res.view(torch.int16), i16(x), opt(post_in), opt(comb_in), i16(new), fs)
    scalars = (float(rms_eps), float(hc_eps), float(post_mult), int(iters))
    LAUNCHERS[type(launch)](
        launch, T, Hd, ptrs, scale, base, opt(post), opt(comb), out.view(torch.int16), scalars, head=head, fused=fused
    )


# ====================================================================================================
# Custom ops: they write into given buffers (the tests poison them first). Every launch choice travels in the
# schema (MhcLaunch.op_args(op)): pre, fused and head take ``launch`` (the design, then its fields), post and
# sinkhorn the shared tiles they read, named as the fields.
# ====================================================================================================


@torch.library.custom_op("dsv4ref::mhc_pre", mutates_args=("post", "comb", "out"))
def mhc_pre_op(
    residual: torch.Tensor,
    fs: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    out: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    post_mult: float,
    iters: int,
    launch: list[int],
) -> None:
    launch_hc(
        residual,
        None,
        None,
        None,
        None,
        fs,
        scale,
        base,
        post,
        comb,
        out,
        rms_eps,
        hc_eps,
        post_mult,
        iters,
        head=False,
        fused=False,
        launch=MhcLaunch.from_op_args(launch, op="mhc_pre"),
    )


@mhc_pre_op.register_fake
def _(residual, fs, scale, base, post, comb, out, rms_eps, hc_eps, post_mult, iters, launch):
    return None


@torch.library.custom_op("dsv4ref::mhc_fused_post_pre", mutates_args=("new", "post", "comb", "out"))
def mhc_fused_post_pre_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_in: torch.Tensor,
    comb_in: torch.Tensor,
    fs: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    new: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    out: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    post_mult: float,
    iters: int,
    launch: list[int],
) -> None:
    launch_hc(
        residual,
        x,
        post_in,
        comb_in,
        new,
        fs,
        scale,
        base,
        post,
        comb,
        out,
        rms_eps,
        hc_eps,
        post_mult,
        iters,
        head=False,
        fused=True,
        launch=MhcLaunch.from_op_args(launch, op="mhc_fused_post_pre"),
    )


@mhc_fused_post_pre_op.register_fake
def _(x, residual, post_in, comb_in, fs, scale, base, new, post, comb, out, rms_eps, hc_eps, post_mult, iters, launch):
    return None


@torch.library.custom_op("dsv4ref::mhc_head", mutates_args=("out",))
def mhc_head_op(
    hidden: torch.Tensor,
    fs: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    out: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    launch: list[int],
) -> None:
    launch_hc(
        hidden,
        None,
        None,
        None,
        None,
        fs,
        scale,
        base,
        None,
        None,
        out,
        rms_eps,
        hc_eps,
        1.0,
        0,
        head=True,
        fused=False,
        launch=MhcLaunch.from_op_args(launch, op="mhc_head"),
    )


@mhc_head_op.register_fake
def _(hidden, fs, scale, base, out, rms_eps, hc_eps, launch):
    return None


@torch.library.custom_op("dsv4ref::mhc_post", mutates_args=("out",))
def mhc_post_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    out: torch.Tensor,
    post_block_t: int,
    post_block_h: int,
) -> None:
    T, M, Hd = residual.shape
    L = MhcLaunch.from_op_args(post_block_t, post_block_h, op="mhc_post")
    if T:
        grid = (triton.cdiv(T, L.post_block_t), triton.cdiv(Hd, L.post_block_h))
        kernels.post_kernel[grid](
            x.view(torch.int16),
            residual.view(torch.int16),
            post,
            comb,
            out.view(torch.int16),
            0,
            T,
            Hd,
            BLOCK_T=L.post_block_t,
            BLOCK_H=L.post_block_h,
        )


@mhc_post_op.register_fake
def _(x, residual, post, comb, out, post_block_t, post_block_h):
    return None


@torch.library.custom_op("dsv4ref::mhc_sinkhorn", mutates_args=("out",))
def mhc_sinkhorn_op(logits: torch.Tensor, out: torch.Tensor, iters: int, eps: float, sinkhorn_block: int) -> None:
    n = logits.numel() // 16
    block = MhcLaunch.from_op_args(sinkhorn_block, op="mhc_sinkhorn").sinkhorn_block
    if n:
        kernels.sinkhorn_kernel[(triton.cdiv(n, block),)](logits, out, n, iters, eps, BLOCK=block)


@mhc_sinkhorn_op.register_fake
def _(logits, out, iters, eps, sinkhorn_block):
    return None
