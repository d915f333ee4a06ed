"""The mHC launchers (``launch_hc``: one call of pre, fused post+pre or head, in the design its
:class:`~dsv4ref.mhc.launch.MhcLaunch` picks) and the ``torch.ops.dsv4ref.mhc_*`` custom ops that run them."""

from __future__ import annotations

import torch
import triton

from ..device import interpreting
from . import kernels, kernels_chunked, kernels_one_pass, kernels_split_k
from .fn_split import split_fn_wide
from .launch import ONE_PASS_LAG, ONE_PASS_SUM_UNROLL, MhcLaunch

# ====================================================================================================
# Launchers
# ====================================================================================================


def one_pass_args(L: MhcLaunch, T: int, Hd: int, head: bool, fused: bool):
    """What ``hc_one_pass_kernel`` is launched with for a [T, 4, Hd] op: (grid, constexprs but DOT_FP32,
    compile options, (mix workspace, Σ X² workspace, sync buffer) element counts, (tiles, slices, chunks per
    slice)). The workspace rows hold the live columns only (pre 8 + 16, head 4)."""
    tiles, slices, cps, bk = L.one_pass_plan(T, Hd)
    ws_gate, ws_stride = (4, 4) if head else (8, 24)
    consts = dict(
        HEAD=head,
        FUSED=fused,
        BLOCK_T=L.one_pass_block_t,
        BLOCK_K=bk,
        BLOCK_H=L.one_pass_block_h,
        LAG=ONE_PASS_LAG,
        SPIN_LIMIT=1 << 16,
        SUM_UNROLL=ONE_PASS_SUM_UNROLL,
        ONE_DOT=1 if fused else L.one_pass_one_dot,
        WS_GATE=ws_gate,
        WS_STRIDE=ws_stride,
        HW_ROUND=not interpreting(),
    )  # the interpreter's cast truncates
    opts = dict(
        num_warps=L.one_pass_warps,
        num_stages=L.one_pass_fused_stages if fused else L.one_pass_stages,
        maxnreg=None if fused else L.one_pass_maxnreg,
    )
    sizes = (slices * T * ws_stride, slices * T, 1 + 2 * tiles)
    return ((tiles + ONE_PASS_LAG) * slices,), consts, opts, sizes, (tiles, slices, cps)


def chunk_args(L: MhcLaunch, T: int, Hd: int, head: bool, fused: bool):
    """What the chunked design launches for a [T, 4, Hd] op (shared with benchmarks/experiments/mhc/):
    (plan, partial, finish, (mix workspace, Σ X² workspace) element counts). ``plan`` = (tokens per chunk C,
    chunks, slices, BLOCK_K chunks per slice, finish parts, hidden dims per part); ``partial`` / ``finish`` =
    (constexprs but DOT_FP32, compile options) of ``hc_chunk_partial_kernel`` / ``hc_chunk_finish_kernel``. One
    workspace serves every chunk: a chunk's finish kernel has read it before the next chunk's partial kernel
    writes it (the same stream). ``fused``: the two kernels run after ``post_kernel`` (only the walk order of
    ``chunk_zigzag`` differs: post forward, partial backward, finish forward)."""
    partial_back = L.chunk_zigzag and fused  # after post_kernel's forward walk
    finish_back = L.chunk_zigzag and not partial_back
    c, n_chunks, slices, cps, bk = L.chunk_plan(T, Hd)
    bt, _, warps, stages, maxnreg = L.chunk_tile(T)
    parts, h_per_part = L.chunk_finish_plan(c, Hd)
    ws_gate, ws_stride = (4, 4) if head else (8, 24)  # the live columns only
    hw = not interpreting()  # bf16 outputs rounded by the hardware conversion (the interpreter's cast truncates)
    partial = (
        dict(
            HEAD=head,
            BLOCK_T=bt,
            BLOCK_K=bk,
            WS_GATE=ws_gate,
            WS_STRIDE=ws_stride,
            STREAM_K=L.chunk_stream_k,
            FN_LAYOUT=L.chunk_fn_layout,
            REVERSE=partial_back,
        ),
        dict(num_warps=warps, num_stages=stages, maxnreg=maxnreg),
    )
    finish = (
        dict(
            HEAD=head,
            BLOCK_T=L.chunk_finish_block_t,
            BLOCK_H=L.chunk_finish_block_h,
            SUM_UNROLL=L.chunk_sum_unroll,
            WS_GATE=ws_gate,
            WS_STRIDE=ws_stride,
            HW_ROUND=hw,
            REVERSE=finish_back,
        ),
        dict(num_warps=L.chunk_finish_warps),
    )
    return (c, n_chunks, slices, cps, parts, h_per_part), partial, finish, (slices * c * ws_stride, slices * c)


def launch_chunked(
    L: MhcLaunch, T: int, Hd: int, ptrs, scale, base, post, comb, out, scalars, *, head: bool, fused: bool
) -> None:
    """The chunked design (kernels_chunked.py): per chunk of C tokens, the partial kernel (grid: the chunk's token
    tiles × slices) then the finish kernel (grid: hidden parts × the chunk's finish tiles), into one workspace
    (one chunk's partials) allocated once per call. ``ptrs`` as ``launch_hc`` makes them. Fused: per chunk
    ``post_kernel`` first (3 launches per chunk), then pre's two kernels on the new streams it wrote, so fused ==
    post then pre bit for bit by construction."""
    (c, n_chunks, slices, cps, parts, h_per_part), (pc, po), (fc, fo), (n_mix, n_ssq) = chunk_args(L, T, Hd, head, fused)
    res_in, x, post_in, comb_in, new, fs = ptrs
    if L.chunk_fn_layout:  # 2, 3: the partial kernel reads fn from the K-major [4·NG, 4·Hd] copy
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
            kernels.post_kernel[grid[::-1] if L.chunk_zigzag else grid](
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
                TOKEN_MAJOR=L.chunk_zigzag,
            )
        kernels_chunked.hc_chunk_partial_kernel[(triton.cdiv(t_end - t0, bt) * slices,)](
            src, fs, mix_ws, ssq_ws, t0, t_end, Hd, c, slices, cps, **pc, DOT_FP32=not compiled, **po
        )
        kernels_chunked.hc_chunk_finish_kernel[(parts, triton.cdiv(t_end - t0, fbt))](
            src, mix_ws, ssq_ws, scale, base, post, comb, out, t0, t_end, Hd, c, slices, h_per_part, *scalars, **fc, **fo
        )


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
        launch_chunked(L, T, Hd, ptrs, scale, base, opt(post), opt(comb), out.view(torch.int16), scalars, head=head, fused=fused)
        return
    if design == "one_pass":
        grid, consts, opts, (n_mix, n_ssq, n_sync), (tiles, slices, cps) = one_pass_args(L, T, Hd, head, fused)
        ws = torch.empty(n_mix + n_ssq + T * 4, dtype=torch.float32, device=res.device)
        mix_ws, ssq_ws, wpre = ws[:n_mix], ws[n_mix : n_mix + n_ssq], ws[n_mix + n_ssq :]
        sync = torch.zeros(n_sync, dtype=torch.int32, device=res.device)  # ticket | arrivals | READY
        kernels_one_pass.hc_one_pass_kernel[grid](
            *ptrs,
            scale,
            base,
            opt(post),
            opt(comb),
            out.view(torch.int16),
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
        return
    if design == "one_kernel":
        kw = dict(num_warps=L.num_warps, num_stages=L.num_stages) if compiled else {}
        kernels.hc_kernel[(triton.cdiv(T, L.block_t),)](
            *ptrs,
            scale,
            base,
            opt(post),
            opt(comb),
            out.view(torch.int16),
            T,
            Hd,
            *scalars,
            HEAD=head,
            FUSED=fused,
            BLOCK_T=L.block_t,
            BLOCK_K=L.block_k,
            DOT_FP32=not compiled,
            **kw,
        )
        return
    n_split, cps = L.split_plan(T, Hd)
    ws = torch.empty(n_split * T * 33, dtype=torch.float32, device=res.device)  # [S, T, 32] mix | [S, T] Σ X²
    mix_ws, ssq_ws = ws[: n_split * T * 32], ws[n_split * T * 32 :]
    kw = dict(num_warps=L.split_warps, num_stages=L.split_stages) if compiled else {}
    kernels_split_k.hc_partial_kernel[(n_split, triton.cdiv(T, L.split_block_t))](
        *ptrs,
        mix_ws,
        ssq_ws,
        T,
        Hd,
        cps,
        HEAD=head,
        FUSED=fused,
        BLOCK_T=L.split_block_t,
        BLOCK_K=L.split_block_k,
        DOT_FP32=not compiled,
        **kw,
    )
    tiles = triton.cdiv(T, L.finish_block_t)
    h_chunks = triton.cdiv(Hd, L.finish_block_h)
    parts = min(h_chunks, max(1, triton.cdiv(L.target_programs, tiles)))
    h_per_part = triton.cdiv(h_chunks, parts) * L.finish_block_h
    parts = triton.cdiv(Hd, h_per_part)
    kw = dict(num_warps=L.finish_warps) if compiled else {}
    kernels_split_k.hc_finish_kernel[(parts, tiles)](
        i16(new) if fused else ptrs[0],
        mix_ws,
        ssq_ws,
        scale,
        base,
        opt(post),
        opt(comb),
        out.view(torch.int16),
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


# ====================================================================================================
# Custom ops: they write into given buffers (the tests poison them first). ``launch`` is
# MhcLaunch.op_args(): every launch choice travels in the schema.
# ====================================================================================================


@torch.library.custom_op("dsv4ref::mhc_pre", mutates_args=("post", "comb", "out"))
def mhc_pre(
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
        launch=MhcLaunch.from_op_args(launch),
    )


@mhc_pre.register_fake
def _(residual, fs, scale, base, post, comb, out, rms_eps, hc_eps, post_mult, iters, launch):
    return None


@torch.library.custom_op("dsv4ref::mhc_fused_post_pre", mutates_args=("new", "post", "comb", "out"))
def mhc_fused_post_pre(
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
        launch=MhcLaunch.from_op_args(launch),
    )


@mhc_fused_post_pre.register_fake
def _(x, residual, post_in, comb_in, fs, scale, base, new, post, comb, out, rms_eps, hc_eps, post_mult, iters, launch):
    return None


@torch.library.custom_op("dsv4ref::mhc_head", mutates_args=("out",))
def mhc_head(
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
        launch=MhcLaunch.from_op_args(launch),
    )


@mhc_head.register_fake
def _(hidden, fs, scale, base, out, rms_eps, hc_eps, launch):
    return None


@torch.library.custom_op("dsv4ref::mhc_post", mutates_args=("out",))
def mhc_post(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, launch: list[int]
) -> None:
    T, M, Hd = residual.shape
    L = MhcLaunch.from_op_args(launch)
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


@mhc_post.register_fake
def _(x, residual, post, comb, out, launch):
    return None


@torch.library.custom_op("dsv4ref::mhc_sinkhorn", mutates_args=("out",))
def mhc_sinkhorn(logits: torch.Tensor, out: torch.Tensor, iters: int, eps: float, launch: list[int]) -> None:
    n = logits.numel() // 16
    block = MhcLaunch.from_op_args(launch).sinkhorn_block
    if n:
        kernels.sinkhorn_kernel[(triton.cdiv(n, block),)](logits, out, n, iters, eps, BLOCK=block)


@mhc_sinkhorn.register_fake
def _(logits, out, iters, eps, launch):
    return None
