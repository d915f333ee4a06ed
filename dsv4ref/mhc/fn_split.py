"""The kernels' copies of the mHC weight ``fn``: fp32 split exactly into three bf16 parts (``split3``), laid out
for the GEMM tiles (``split_fn``, and ``split_fn_wide`` for the chunked design's K-major fn tile), cached per
weight tensor and version."""

from __future__ import annotations

import weakref

import torch

from ..formats import HC_MULT

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


def split_fn_wide(fs: torch.Tensor) -> torch.Tensor:
    """``split_fn``'s ``[G, 3, K, 16]`` as ``[4·G·16, K]`` bf16, K-major: row p·G·16 + g·16 + j = ``fs[g, p, :, j]``
    (parts hi, mid, lo, then a zero part 3), so a chunked partial kernel's fn tile ``[4·G·16, BLOCK_K]`` is
    whole rows and the wgmma reads it as a K-major B operand (``ChunkedLaunch.fn_layout`` 2; layout 3 reads
    its first three parts only). Cached per split tensor and version, as ``split_fn`` (:func:`_derived`)."""

    def build():
        G, P, K, W = fs.shape
        wide = torch.zeros(K, P + 1, G * W, dtype=fs.dtype, device=fs.device)
        wide[:, :P] = fs.permute(2, 1, 0, 3).reshape(K, P, G * W)
        return wide.reshape(K, (P + 1) * G * W).t().contiguous()

    return _derived(fs, ("wide", True), build)
