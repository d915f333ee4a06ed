"""E2M1 (FP4) codes in plain torch: the one encoder, decoder and nibble packer of dsv4ref.

Used by the indexer's MXFP4 keys and queries (:mod:`dsv4ref.indexer.mxfp4`) and the FP4 expert weights
(:mod:`dsv4ref.linear`). A code is 4 bits ``S E1 E0 M`` (exponent bias 1)::

    code & 7   0    1    2    3    4    5    6    7
    value      0   0.5   1   1.5   2    3    4    6        negative when bit 3 (S) is set

Encoding saturates to ±6 and rounds to nearest, ties to the even code (0.25 → 0, 0.75 → 1, 2.5 → 2, 5 → 4).
Two codes share a byte, element 2k in the LOW nibble (``docs/formats.md``).
"""

from __future__ import annotations

import torch

from .formats import E2M1_GRID, FP4_MAX

__all__ = ["e2m1_encode", "e2m1_decode", "pack_nibbles", "unpack_nibbles"]

_E2M1_MID = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device="cpu")  # midpoints between grid values


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit E2M1 codes (uint8 0..15): saturate to ±6, round to nearest, ties to the even code.

    The magnitude code is the number of midpoints below |y|; on a midpoint between codes i and i+1 the
    even one wins. The sign is bit 3, taken from the sign bit (so −0.1 → 0b1000)."""
    mid = _E2M1_MID.to(y.device)
    a = y.float().abs().clamp(max=FP4_MAX)[..., None]
    odd = torch.arange(7, device=y.device) % 2 == 1
    code = (mid < a).sum(-1) + ((mid == a) & odd).sum(-1)
    return (code | (torch.signbit(y).to(code.dtype) << 3)).to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15) -> fp32 values: magnitude ``E2M1_GRID[code & 7]``, negative when bit 3 is set."""
    grid = torch.tensor(E2M1_GRID, device=code.device)
    c = code.long()
    v = grid[c & 7]
    return torch.where((c & 8) != 0, -v, v)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes, element 2k in the LOW nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes (the inverse of :func:`pack_nibbles`)."""
    p = packed.to(torch.uint8)
    return torch.stack([p & 15, p >> 4], dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
