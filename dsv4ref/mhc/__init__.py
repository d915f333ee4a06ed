"""mHC: manifold-constrained hyper-connections (pre with Sinkhorn, post, fused post+pre, head).

DeepSeek-V4 keeps ``M = 4`` residual streams per token, ``[T, M, Hd]`` bf16, and mixes them around every
attention and FFN sub-layer. The math, shapes, conventions and pitfalls: ``docs/mhc.md``.

* :func:`pre` turns the streams into the sub-layer's input and the weights post and comb will need;
* :func:`post` writes the sub-layer's output back into the streams (``combᵀ @ streams``);
* :func:`fused_post_pre` is post followed by the next sub-layer's pre, in one pass;
* :func:`head` folds the streams into one hidden vector after the last layer;
* :func:`sinkhorn` is the projection pre runs on the comb logits, on its own.

Read in this order: ``reference.py`` (the whole op in PyTorch), ``kernels.py`` (the Triton kernels' shared
pieces, the one-kernel and split-K designs), ``kernels_chunked.py`` (the GPU default), ``kernels_one_pass.py``
(a rung between them), ``launch.py`` (a launch class per design, the measured defaults), ``fn_split.py`` (the
kernels' copies of ``fn``), ``ops.py`` (the launchers, the custom ops). Every function here checks its arguments,
then dispatches on ``backend`` ("reference": ``reference.py`` in fp32; "triton"; "auto" = "triton"). ``launch=``
(a :class:`OneKernelLaunch`, :class:`SplitKLaunch`, :class:`OnePassLaunch` or :class:`ChunkedLaunch`, all
:class:`MhcLaunch`; None = the op's measured default, ``default_launch(op)``) only affects "triton".
"""

from __future__ import annotations

import torch

from .. import validate
from ..device import DEVICE, HOST
from ..seeded import generator, randn
from . import reference
from .fn_split import split_fn
from .ops import mhc_fused_post_pre_op, mhc_head_op, mhc_post_op, mhc_pre_op, mhc_sinkhorn_op
from .launch import ChunkedLaunch, MhcLaunch, OneKernelLaunch, OnePassLaunch, SplitKLaunch, default_launch
from .reference import HC_EPS, HC_MULT, POST_MULT, RMS_EPS, SINKHORN_ITERS

__all__ = [
    "sinkhorn",
    "pre",
    "post",
    "fused_post_pre",
    "head",
    "example_params",
    "example_streams",
    "split_fn",
    "MhcLaunch",
    "OneKernelLaunch",
    "SplitKLaunch",
    "OnePassLaunch",
    "ChunkedLaunch",
    "default_launch",
    "SUPPORTED_BACKENDS",
    "HC_MULT",
    "POST_MULT",
    "SINKHORN_ITERS",
    "HC_EPS",
    "RMS_EPS",
]

SUPPORTED_BACKENDS = ("reference", "triton")  # "auto" = "triton"


# ====================================================================================================
# Argument checks
# ====================================================================================================


def _finite(**tensors: torch.Tensor) -> None:
    """The non-finite policy (docs/mhc.md#the-input-contract): with value checks on (the default), a NaN or
    ±inf in any data tensor raises ``ValueError("<name>: non-finite values ...")`` before any work; with
    ``DSV4REF_CHECK_VALUES=0`` nothing is read here (no sync) and IEEE arithmetic propagates them."""
    for name, t in tensors.items():
        validate.finite(t, name)


def _check_streams(residual: torch.Tensor, name: str = "residual") -> tuple[int, int, int]:
    validate.tensor(residual, name, dtype=torch.bfloat16, ndim=3)
    T, M, Hd = residual.shape
    if M < 1 or Hd < 1:
        raise ValueError(f"{name}: expected [T, M, Hd] with M >= 1 streams and Hd >= 1, got shape {tuple(residual.shape)}")
    return T, M, Hd


def _check_mix_params(fn, scale, base, M: int, Hd: int, rows: int, n_scale: int, what: str) -> None:
    validate.tensor(fn, "fn", dtype=torch.float32, ndim=2)
    if fn.shape[0] != rows:
        raise ValueError(f"fn: expected {rows} rows ({what}) for M={M} streams, got shape {tuple(fn.shape)}")
    if fn.shape[1] != M * Hd:
        raise ValueError(f"fn: expected {M * Hd} columns (M·Hd = {M}·{Hd}), got shape {tuple(fn.shape)}")
    validate.tensor(scale, "scale", dtype=torch.float32, shape=(n_scale,))
    validate.tensor(base, "base", dtype=torch.float32, shape=(rows,))


def _check_scalars(rms_eps, hc_eps, *pre_only) -> None:
    """The scalar arguments: eps values finite and >= 0; for pre (``pre_only`` = post_mult, sinkhorn_iters)
    post_mult finite and the pass count an int >= 1 (the same rule as :func:`sinkhorn`'s ``iters``)."""
    validate.scalar(rms_eps, "rms_eps", lo=0.0)
    validate.scalar(hc_eps, "hc_eps", lo=0.0)
    if pre_only:
        post_mult, sinkhorn_iters = pre_only
        validate.scalar(post_mult, "post_mult")
        validate.integer(sinkhorn_iters, "sinkhorn_iters", lo=1)


def _check_pre(residual, fn, scale, base, name: str = "residual") -> tuple[int, int, int]:
    T, M, Hd = _check_streams(residual, name)
    _check_mix_params(fn, scale, base, M, Hd, M * (M + 2), 3, "M·(M+2)")
    validate.same_device(**{name: residual}, fn=fn, scale=scale, base=base)
    return T, M, Hd


def _check_post(x, residual, post, comb) -> tuple[int, int, int]:
    T, M, Hd = _check_streams(residual)
    validate.tensor(x, "x", dtype=torch.bfloat16, ndim=2)
    if tuple(x.shape) != (T, Hd):
        raise ValueError(f"x: expected shape {(T, Hd)} to match residual {tuple(residual.shape)}, got {tuple(x.shape)}")
    validate.tensor(post, "post", dtype=torch.float32)
    if tuple(post.shape) not in ((T, M), (T, M, 1)):
        raise ValueError(f"post: expected shape {(T, M)} or {(T, M, 1)}, got {tuple(post.shape)}")
    validate.tensor(comb, "comb", dtype=torch.float32, shape=(T, M, M))
    validate.same_device(x=x, residual=residual, post=post, comb=comb)
    return T, M, Hd


def _need_four(M: int, name: str) -> None:
    if M != 4:
        raise ValueError(
            f"{name}: the Triton kernels are written for M = 4 streams (DeepSeek-V4), got M = {M}; "
            "use backend='reference' for other M"
        )


def _launch(launch: MhcLaunch | None, op: str) -> MhcLaunch:
    if launch is None:
        return default_launch(op)
    if not isinstance(launch, MhcLaunch):
        raise TypeError(
            f"launch: expected a OneKernelLaunch, SplitKLaunch, OnePassLaunch, ChunkedLaunch or None, got {type(launch).__name__}"
        )
    return launch


def _c(t: torch.Tensor) -> torch.Tensor:
    """What a kernel reads: the kernels take contiguous tensors, so any other layout (a strided view, a
    storage offset, a transpose, an expand) is copied first. Strides are honoured, never ignored."""
    return t.contiguous()


def _gate_buffers(T: int, M: int, Hd: int, device):
    """Outputs of a pre: post [T, M] fp32, comb [T, M, M] fp32, layer input [T, Hd] bf16."""
    return (
        torch.empty(T, M, dtype=torch.float32, device=device),
        torch.empty(T, M, M, dtype=torch.float32, device=device),
        torch.empty(T, Hd, dtype=torch.bfloat16, device=device),
    )


# ====================================================================================================
# Public API
# ====================================================================================================


def sinkhorn(
    logits: torch.Tensor,
    iters: int = SINKHORN_ITERS,
    eps: float = HC_EPS,
    *,
    backend: str = "auto",
    launch: MhcLaunch | None = None,
) -> torch.Tensor:
    """Project logits to a nearly doubly-stochastic matrix with the DSV4 schedule (docs/mhc.md#sinkhorn).

    Pass 1 = row softmax + eps, then a column normalisation; passes 2..iters = row, then column (each divisor
    + eps). The last step normalises columns, so column sums are 1 − O(eps); row sums are NOT exactly 1.

    Args:
        logits: ``[..., M, M]`` fp32, any leading dims, any strides (a non-contiguous view is copied before
            the kernel); axis -2 is the source stream i, axis -1 the destination stream j. "triton" needs
            M = 4. Finite (docs/mhc.md#the-input-contract). The float64 oracle is ``reference.sinkhorn``.
        iters: number of passes, an int >= 1; the model's is 20.
        eps: the +eps of every step, finite and >= 0; the model's is 1e-6.
        backend: "auto" (= "triton") | "reference" | "triton".
        launch: any design's launch (it reads ``sinkhorn_block``), None = the default.
    Returns:
        ``[..., M, M]`` fp32, contiguous.
    Raises:
        TypeError / ValueError naming the argument (docs/mhc.md#the-input-contract).
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    validate.tensor(logits, "logits", dtype=torch.float32)
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2] or logits.shape[-1] < 1:
        raise ValueError(f"logits: expected [..., M, M], got shape {tuple(logits.shape)}")
    validate.integer(iters, "iters", lo=1)
    validate.scalar(eps, "eps", lo=0.0)
    launch = _launch(launch, "sinkhorn")
    if backend == "triton":
        _need_four(logits.shape[-1], "logits")
    _finite(logits=logits)
    if backend == "reference":
        return reference.sinkhorn(logits, iters, eps).contiguous()
    src = _c(logits)
    out = torch.empty_like(src)
    mhc_sinkhorn_op(src, out, int(iters), float(eps), *launch.op_args("mhc_sinkhorn"))
    return out


def pre(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    rms_eps: float = RMS_EPS,
    hc_eps: float = HC_EPS,
    post_mult: float = POST_MULT,
    sinkhorn_iters: int = SINKHORN_ITERS,
    backend: str = "auto",
    launch: MhcLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre (docs/mhc.md#pre): the sub-layer input and the weights of the following post.

    mix = (X @ fnᵀ)·rsqrt(mean(X²) + rms_eps) with X the flattened streams ``[T, M·Hd]``; pre = σ(mix[0:M]·
    scale[0] + base[0:M]) + hc_eps; post = σ(mix[M:2M]·scale[1] + base[M:2M])·post_mult; comb = Sinkhorn(
    mix[2M:]·scale[2] + base[2M:], as M×M row-major); layer input = Σ_i pre_i·residual_i.

    Every tensor may be any strided view (it is copied to contiguous before a kernel reads it); every data
    tensor must be finite (docs/mhc.md#the-input-contract).

    Args:
        residual: ``[T, M, Hd]`` bf16, the M residual streams, T >= 0, M, Hd >= 1 ("triton" needs M = 4).
        fn: ``[M·(M+2), M·Hd]`` fp32; rows: M pre, M post, M² comb (row-major: logit (i, j) is row 2M + M·i + j).
        scale: ``[3]`` fp32: (α_pre, α_post, α_res).
        base: ``[M·(M+2)]`` fp32, in fn's row order.
        rms_eps, hc_eps: finite, >= 0; post_mult: finite; sinkhorn_iters: an int >= 1. The model's
            constants by default (1e-6, 1e-6, 2, 20).
        backend: "auto" (= "triton") | "reference" | "triton".
        launch: a design's launch class, None = the measured default (on a GPU :class:`ChunkedLaunch`).
    Returns:
        ``(post, comb, layer_input)``: post ``[T, M]`` fp32 in (0, post_mult); comb ``[T, M, M]`` fp32,
        ``comb[t, i, j]`` the weight from source stream i to destination j; layer_input ``[T, Hd]`` bf16.
    Raises:
        TypeError / ValueError naming the argument, before any work.
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    T, M, Hd = _check_pre(residual, fn, scale, base)
    _check_scalars(rms_eps, hc_eps, post_mult, sinkhorn_iters)
    launch = _launch(launch, "pre")
    if backend == "triton":
        _need_four(M, "residual")
    _finite(residual=residual, fn=fn, scale=scale, base=base)
    if backend == "reference":
        p, c, x = reference.pre(
            residual, fn, scale, base, rms_eps=rms_eps, hc_eps=hc_eps, post_mult=post_mult, sinkhorn_iters=sinkhorn_iters
        )
        return p, c, x.to(torch.bfloat16)
    p, c, out = _gate_buffers(T, M, Hd, residual.device)
    mhc_pre_op(
        _c(residual),
        split_fn(fn, M),
        _c(scale),
        _c(base),
        p,
        c,
        out,
        float(rms_eps),
        float(hc_eps),
        float(post_mult),
        int(sinkhorn_iters),
        *launch.op_args("mhc_pre"),
    )
    return p, c, out


def post(
    x: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    backend: str = "auto",
    launch: MhcLaunch | None = None,
) -> torch.Tensor:
    """mHC post (docs/mhc.md#post): new stream j = post_j·x + Σ_i comb[i, j]·residual_i, i.e. combᵀ @ residual.

    Args:
        x: ``[T, Hd]`` bf16, the sub-layer's output.
        residual: ``[T, M, Hd]`` bf16, the streams the sub-layer's pre read ("triton" needs M = 4).
        post: ``[T, M]`` or ``[T, M, 1]`` fp32, from :func:`pre`.
        comb: ``[T, M, M]`` fp32, from :func:`pre`; ``comb[t, i, j]``: source i → destination j (not
            symmetric in general: a transposed comb is a different, wrong model).
        All four: any strides (copied to contiguous first), finite (docs/mhc.md#the-input-contract).
        backend: "auto" (= "triton") | "reference" | "triton".
        launch: any design's launch (it reads ``post_block_t``, ``post_block_h``), None = the default.
    Returns:
        The new residual ``[T, M, Hd]`` bf16 (fp32 math, rounded to nearest even once).
    Raises:
        TypeError / ValueError naming the argument, before any work.
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    T, M, Hd = _check_post(x, residual, post, comb)
    launch = _launch(launch, "post")
    if backend == "triton":
        _need_four(M, "residual")
    _finite(x=x, residual=residual, post=post, comb=comb)
    if backend == "reference":
        return reference.post(x, residual, post, comb).to(torch.bfloat16)
    out = torch.empty(T, M, Hd, dtype=torch.bfloat16, device=residual.device)
    mhc_post_op(_c(x), _c(residual), _c(post.reshape(T, M)), _c(comb), out, *launch.op_args("mhc_post"))
    return out


def fused_post_pre(
    x: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    rms_eps: float = RMS_EPS,
    hc_eps: float = HC_EPS,
    post_mult: float = POST_MULT,
    sinkhorn_iters: int = SINKHORN_ITERS,
    backend: str = "auto",
    launch: MhcLaunch | None = None,
):
    """:func:`post` with this sub-layer's ``post, comb``, then :func:`pre` of the NEXT sub-layer on the new
    streams with its ``fn, scale, base`` (docs/mhc.md#fused-post-pre). Arguments (shapes, dtypes, any
    strides, finite values, the scalar ranges) as in those two.

    Returns:
        ``(residual', post', comb', layer_input)``: the new residual ``[T, M, Hd]`` bf16, the next post
        ``[T, M]`` fp32, comb ``[T, M, M]`` fp32 and layer input ``[T, Hd]`` bf16: equal to post then pre, bit
        for bit on the bf16 outputs and within 1e-6 on the fp32 ones, when that pre runs the same design
        (``launch.pre_like_fused()`` is that pre's launch: the launch itself but for the one-pass design; with
        ``launch=None`` in the interpreter, where the fused op runs one kernel and pre split-K, pre needs
        ``launch=OneKernelLaunch()``).
    Raises:
        TypeError / ValueError naming the argument, before any work.
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    T, M, Hd = _check_post(x, residual, post, comb)
    _check_pre(residual, fn, scale, base)
    _check_scalars(rms_eps, hc_eps, post_mult, sinkhorn_iters)
    launch = _launch(launch, "fused_post_pre")
    if backend == "triton":
        _need_four(M, "residual")
    _finite(x=x, residual=residual, post=post, comb=comb, fn=fn, scale=scale, base=base)
    kw = dict(rms_eps=rms_eps, hc_eps=hc_eps, post_mult=post_mult, sinkhorn_iters=sinkhorn_iters)
    if backend == "reference":
        new, p, c, li = reference.fused_post_pre(x, residual, post, comb, fn, scale, base, **kw)
        return new, p, c, li.to(torch.bfloat16)
    new = torch.empty(T, M, Hd, dtype=torch.bfloat16, device=residual.device)
    p, c, out = _gate_buffers(T, M, Hd, residual.device)
    mhc_fused_post_pre_op(
        _c(x),
        _c(residual),
        _c(post.reshape(T, M)),
        _c(comb),
        split_fn(fn, M),
        _c(scale),
        _c(base),
        new,
        p,
        c,
        out,
        float(rms_eps),
        float(hc_eps),
        float(post_mult),
        int(sinkhorn_iters),
        *launch.op_args("mhc_fused_post_pre"),
    )
    return new, p, c, out


def head(
    hidden: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    rms_eps: float = RMS_EPS,
    hc_eps: float = HC_EPS,
    backend: str = "auto",
    launch: MhcLaunch | None = None,
) -> torch.Tensor:
    """HC head (docs/mhc.md#head): out = Σ_m gate_m·hidden_m, gate = σ(mix·scale[0] + base) + hc_eps, mix the
    RMS-scaled GEMM of the flattened streams as in :func:`pre`. No post, no Sinkhorn.

    Args:
        hidden: ``[T, M, Hd]`` bf16, the streams after the last layer's post ("triton" needs M = 4).
        fn: ``[M, M·Hd]`` fp32 (``hc_head_fn``); scale: ``[1]`` fp32; base: ``[M]`` fp32.
        All four: any strides (copied to contiguous first), finite (docs/mhc.md#the-input-contract).
        rms_eps, hc_eps: finite, >= 0; the model's 1e-6 by default.
        backend: "auto" (= "triton") | "reference" | "triton".
        launch: a design's launch class, None = the measured default (on a GPU :class:`ChunkedLaunch`).
    Returns:
        ``[T, Hd]`` bf16.
    Raises:
        TypeError / ValueError naming the argument, before any work.
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    T, M, Hd = _check_streams(hidden, "hidden")
    _check_mix_params(fn, scale, base, M, Hd, M, 1, "M")
    validate.same_device(hidden=hidden, fn=fn, scale=scale, base=base)
    _check_scalars(rms_eps, hc_eps)
    launch = _launch(launch, "head")
    if backend == "triton":
        _need_four(M, "hidden")
    _finite(hidden=hidden, fn=fn, scale=scale, base=base)
    if backend == "reference":
        return reference.head(hidden, fn, scale, base, rms_eps=rms_eps, hc_eps=hc_eps).to(torch.bfloat16)
    out = torch.empty(T, Hd, dtype=torch.bfloat16, device=hidden.device)
    mhc_head_op(
        _c(hidden),
        split_fn(fn, M, head=True),
        _c(scale),
        _c(base),
        out,
        float(rms_eps),
        float(hc_eps),
        *launch.op_args("mhc_head"),
    )
    return out


# ====================================================================================================
# Example inputs (notebooks, tests, check, bench)
# ====================================================================================================


def example_params(Hd: int, *, seed: int = 0, M: int = HC_MULT, head: bool = False, device=None):
    """Seeded ``(fn, scale, base)`` fp32 with real magnitudes: fn ~ N(0, 1/(M·Hd)) so every mix logit has
    std ≈ 1 for RMS-normalised streams; α = (0.8, 0.6, 1.5) (head: 0.9); base ~ N(0, 0.5).

    Returns:
        pre: fn ``[M·(M+2), M·Hd]``, scale ``[3]``, base ``[M·(M+2)]``; ``head=True``: fn ``[M, M·Hd]``,
        scale ``[1]``, base ``[M]``. Drawn on the CPU, moved to ``device`` (default: dsv4ref.DEVICE).
    """
    g = generator(seed)
    rows = M if head else M * (M + 2)
    fn = torch.randn(rows, M * Hd, generator=g, device=HOST) / (M * Hd) ** 0.5
    scale = torch.tensor([0.9] if head else [0.8, 0.6, 1.5], device=HOST)
    base = torch.randn(rows, generator=g, device=HOST) * 0.5
    dev = device or DEVICE
    return fn.to(dev), scale.to(dev), base.to(dev)


def example_streams(T: int, Hd: int, *, seed: int = 0, M: int = HC_MULT, device=None) -> torch.Tensor:
    """Seeded streams ``[T, M, Hd]`` bf16 whose 64-wide blocks span 2^-4 .. 2^4 (``seeded.randn`` octaves)."""
    return randn((T, M, Hd), seed=seed, octaves=8, device=device)
