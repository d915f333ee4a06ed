"""The decode step's view of the compressor: a thin call of the op :mod:`dsv4ref.compressor`.

The op returns one row per token and a ``done`` flag (no host sync; the decode step writes every row with
slot −1 where not done). This module keeps the older, compacted form for readers of ``docs/decode.md``:
only the rows completed, with the request and the boundary position of each. The math, the state and the
kernels: ``docs/compressor.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compressor import CompressorState, allocate_state, overlap
from ..compressor import compress as compress_op

__all__ = ["CompressorState", "Compressed", "overlap", "allocate_state", "compress"]


@dataclass
class Compressed:
    """The compressed rows completed by one step: ``rows`` (n, D) fp32 (RMS-normed, not rounded),
    ``requests`` (n,) int64 and ``positions`` (n,) int64 of the boundary token of each (row id p // r)."""

    rows: torch.Tensor
    requests: torch.Tensor
    positions: torch.Tensor


def compress(x: torch.Tensor, weights: dict, state: CompressorState, requests: torch.Tensor, positions: torch.Tensor,
             valid: torch.Tensor, *, ratio: int, eps: float, backend: str = "reference") -> Compressed:
    """:func:`dsv4ref.compressor.compress` with the weights as one dict (wkv, wgate, ape, norm) and the
    state as a :class:`CompressorState`, compacted to the rows completed (a host sync). Returns
    :class:`Compressed` with n >= 0 rows, in the order of the step's boundary tokens."""
    rows, done = compress_op(x, weights["wkv"], weights["wgate"], weights["ape"], weights["norm"], state.kv,
                             state.score, requests, positions, ratio=ratio, eps=eps, valid=valid, backend=backend)
    return Compressed(rows[done], requests[done].long(), positions[done].long())
