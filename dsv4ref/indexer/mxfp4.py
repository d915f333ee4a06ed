"""MXFP4 for the indexer, in plain torch: E2M1 values in four 32-blocks per 128-dim row, one UE8M0 byte each.

The E2M1 codec itself (encode, decode, nibble packing) is :mod:`dsv4ref.fp4`, shared with the FP4 expert weights.

The codec the indexer's MXFP4 query and key paths use (``docs/indexer.md#mxfp4``; the byte map of a cached
key: ``docs/formats.md``)::

    byte  = ceil(log2(max(amax_32, 6 · 2^-126) / 6)) + 127        per 32-block, exact from the fp32 bits
    code  = E2M1(clamp(x · 2^(127 − byte), ±6))                      round to nearest, ties to the even code
    pack  = two codes per byte, element 2k in the LOW nibble

E2M1's eight magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign. A block holding NaN or ±inf gets
byte 255 (E8M0's NaN) and codes 0x7 (0xF where the value's sign bit is set).
"""

from __future__ import annotations

import torch

from ..formats import FP4_AMAX_FLOOR, FP4_BLOCK, FP4_MAX, INDEX_HEAD_DIM
from ..fp4 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles
from ..fp8.reference import inv_pow2, ue8m0_byte, ue8m0_value

__all__ = ["e2m1_encode", "e2m1_decode", "pack_nibbles", "unpack_nibbles", "quantize_mxfp4", "mxfp4_values"]

HEAD_DIM = INDEX_HEAD_DIM  # 128


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Four 32-blocks per row of fp32 ``x [..., 128]``: (packed e2m1 [..., 64] uint8, UE8M0 bytes [..., 4] uint8).
    A block holding NaN or ±inf gets byte 255 (E8M0's NaN) and codes 0x7 (0xF where the sign bit is set)."""
    xb = x.reshape(*x.shape[:-1], HEAD_DIM // FP4_BLOCK, FP4_BLOCK)
    bad = ~xb.isfinite().all(-1)
    fin = torch.where(xb.isfinite(), xb, 0.0)  # finite stand-ins; bad blocks are overwritten below
    byte = ue8m0_byte(fin.abs().amax(-1), FP4_AMAX_FLOOR, FP4_MAX)
    nan_codes = 7 | (torch.signbit(xb).to(torch.uint8) << 3)
    codes = torch.where(bad[..., None], nan_codes, e2m1_encode(fin * inv_pow2(byte)[..., None]))
    return pack_nibbles(codes.reshape(x.shape)), byte.masked_fill(bad, 255)


def mxfp4_values(packed: torch.Tensor, byte: torch.Tensor) -> torch.Tensor:
    """Decode MXFP4: e2m1 codes × 2^(byte − 127) per 32-block, fp32 ``[..., 128]`` (exact). Every scale byte
    reads as E8M0 defines it: 0 is 2^-127, 255 is NaN (the whole block)."""
    codes = e2m1_decode(unpack_nibbles(packed))
    blocks = codes.reshape(*codes.shape[:-1], HEAD_DIM // FP4_BLOCK, FP4_BLOCK)
    return (blocks * ue8m0_value(byte)[..., None]).reshape(codes.shape)
