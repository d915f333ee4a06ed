"""Hopper-only fast path for sparse MLA decode, written in Gluon (``triton.experimental.gluon``).

Same math and contract as :func:`dsv4ref.sparse_mla.decode` (docs/sparse_mla.md; page layout:
docs/formats.md): every head of token ``t`` attends to the listed slots of one or two FP8 paged caches with
one softmax, the sink enters the denominator only, ``−1`` entries and entries past the lengths are ignored,
a row with no valid entry gives ``out = 0`` and ``lse = −inf``, and P is rounded to bf16 before P·V
(FlashMLA's numerics, as in the portable kernel).

Read in this order:

* :mod:`.lang`: the Gluon names the kernels are written in, imported once (or the reason they are missing);
* :mod:`.launch`: :class:`GluonLaunch` (which kernel, how many list splits), :func:`default_launch`, the
  launcher :func:`decode_gluon` and the custom op; plain Python, importable without Gluon;
* :mod:`.common`: what the kernels share (the candidate list, row loads and dequantisation, the query, the
  softmax step, the epilogue arithmetic, the split merge :func:`~.common._merge_kernel`);
* :mod:`.plain_kernel`: rung "a" of notebook 04's ladder, no warp specialisation;
* :mod:`.ws_kernel`: the 64-row warp-specialised kernel (producer, scorer and P·V warpgroups), the default
  for H > 16;
* :mod:`.narrow_kernel`: heads as the MMAs' N, two producer warpgroups, the default for H ≤ 16.

**The list split** (flash-decoding, :func:`launch_for_sms`): where one program per (token, head block) would
leave SMs idle, each token's list is split into S ranges of whole chunks; a split writes its unnormalised fp32
accumulator ``po [T, S, H, 512]`` and its (log2 max, sum) ``pml [T, S, H, 2]``, and the merge kernel weighs,
adds, normalises and applies the sink once.

Its figures beside the portable kernel's, as fractions of max(bytes / copy BW, FLOP / bf16 rate):
`benchmarks/RESULTS.md`.
What limits each shape and every variant tried (the variants and timing diagnostics that are no longer in
the code live in git history, each with its row there): `benchmarks/sparse_mla.md`; the ladder: notebook 04.

The kernel modules are imported only where Gluon imported (:func:`kernels`, on first use): on a CPU machine
(the Triton interpreter) or a Triton without Gluon this package still imports, and :func:`available` says
whether the backend can run here.
"""

from __future__ import annotations

import torch

from ...device import capability, interpreting
from .launch import (
    BLOCK_H,
    BLOCK_N,
    KERNELS,
    NARROW_H,
    GluonLaunch,
    _LAST,  # noqa: F401 - the last compiled decode kernel (benchmarks/experiments/sparse_mla_gluon.py reads it)
    _aligned,
    decode_gluon,
    decode_op,
    default_launch,
    import_error,
    kernels,
    launch_for_sms,
    sparse_mla_decode_gluon_op,
)

__all__ = [
    "available",
    "supports",
    "decode_gluon",
    "decode_op",
    "sparse_mla_decode_gluon_op",
    "kernels",
    "import_error",
    "GluonLaunch",
    "default_launch",
    "launch_for_sms",
    "KERNELS",
    "BLOCK_H",
    "BLOCK_N",
    "NARROW_H",
]


def available(device: torch.device | None = None) -> bool:
    """True where this backend can run: compiled Triton with Gluon (never the interpreter) and a CUDA
    device of compute capability 9.x (Hopper: H100 / H200)."""
    if interpreting():
        return False
    cap = capability(device)
    if cap is None or cap[0] != 9:
        return False
    return kernels() is not None


def supports(q: torch.Tensor, cache: torch.Tensor, extra_cache: torch.Tensor | None = None) -> bool:
    """Whether :func:`decode_gluon` takes these inputs: Hopper, H <= 128, and caches whose pages start at
    16-byte aligned addresses (every cache :func:`dsv4ref.kv_cache.allocate` makes; the kernel loads 16-byte
    vectors and the 8 scale bytes of a row as one word). Otherwise use the portable kernel."""
    return available(q.device) and q.shape[1] <= 128 and _aligned(cache) and (extra_cache is None or _aligned(extra_cache))
