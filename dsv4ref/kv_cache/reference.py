"""The paged 584-byte KV cache in plain torch: the writer and the reader every kernel is held to.

Spec (``docs/kv_cache.md``, the page drawn in ``docs/formats.md#the-584-byte-kv-cache-page``). A token's
512-dim bf16 latent row k is stored as 448 e4m3 bytes (k[0:448], 7 blocks of 64, one UE8M0 scale each),
128 bytes of bf16 RoPE (k[448:512], bit for bit) and 8 scale bytes (7 UE8M0 + a zero pad byte). A page of
``B`` tokens is a structure of arrays::

    [0, 576·B)              token data: token t at 576·t  (448 e4m3 | 128 bytes bf16 RoPE)
    [576·B, 584·B)          scales:     token t at 576·B + 8·t  (7 UE8M0 | 0)
    [584·B, page_stride)    padding; never read

    slot = page · B + offset         data at page·page_stride + 576·offset
                                     scales at page·page_stride + 576·B + 8·offset

``page_stride`` is the cache tensor's ``stride(0)`` (at least ``page_bytes(B)``). Writers skip slot −1
and rows of kv past ``len(slots)``; readers give a zero row for slot −1.

Non-finite values (``docs/formats.md#non-finite-values``): the writer encodes a quant block holding a NaN
or ±inf as scale byte 255 + e4m3 NaN bytes (``fp8.quantize_ue8m0``'s rule) and copies the RoPE bits as
they are; the reader decodes every scale byte as E8M0 defines it (0: 2^-127, 255: NaN) and gives every
NaN of the NoPE part as bf16 0x7FC0.

Both functions address the cache exactly as a kernel does: one flat byte view plus int64 offsets.
"""

from __future__ import annotations

import torch
from einops import rearrange

from ..formats import (
    DATA_BYTES,
    HEAD_DIM,
    KV_AMAX_FLOOR,
    N_SCALES,
    NOPE_DIM,
    QUANT_BLOCK,
    SCALE_BYTES,
    token_data_offset,
    token_scale_offset,
)
from ..fp8 import reference as fp8

__all__ = ["insert", "gather", "flat_bytes", "token_offsets"]


def flat_bytes(cache: torch.Tensor) -> torch.Tensor:
    """All bytes from the first page's start to the last page's end, as one 1-d view (strided caches too),
    so bytes are addressed as a kernel addresses them: base + offset."""
    n = (cache.shape[0] - 1) * cache.stride(0) + cache.shape[1] if cache.shape[0] else 0
    return cache.as_strided((n,), (1,), cache.storage_offset())


def token_offsets(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 byte offsets ``(data start, scale start)`` of each slot in ``flat_bytes(cache)``."""
    slots = slots.to(torch.int64)
    return (token_data_offset(cache.stride(0), block_size, slots), token_scale_offset(cache.stride(0), block_size, slots))


def _span(start: torch.Tensor, n: int) -> torch.Tensor:
    """[S, n] byte offsets start[s] + 0 .. n−1."""
    return start[:, None] + torch.arange(n, device=start.device)


def insert(cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, *, block_size: int) -> None:
    """Write row i of ``kv`` [T, 512] bf16 into slot ``slots[i]`` (i < len(slots)), in place."""
    keep = slots >= 0  # −1 rows write nothing
    rows = kv[: slots.shape[0]][keep]
    data, scales = token_offsets(cache, slots[keep], block_size)
    q, s = fp8.quantize_ue8m0(rows[:, :NOPE_DIM], QUANT_BLOCK, KV_AMAX_FLOOR)
    rope_bytes = rows[:, NOPE_DIM:].contiguous().view(torch.uint8)  # 64 bf16 -> 128 bytes, little-endian
    flat = flat_bytes(cache)
    flat[_span(data, DATA_BYTES)] = torch.cat([q.view(torch.uint8), rope_bytes], dim=1)
    flat[_span(scales, SCALE_BYTES)] = torch.cat([s, torch.zeros_like(s[:, :1])], dim=1)  # 7 scales + pad


def gather(cache: torch.Tensor, slots: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """Rows ``[S, 512]`` bf16 at ``slots`` (−1: a zero row): e4m3 × E8M0(scale), then the RoPE bits."""
    out = torch.zeros(slots.shape[0], HEAD_DIM, dtype=torch.bfloat16, device=cache.device)
    keep = slots >= 0  # never index memory with −1: those rows stay zero
    data, scales = token_offsets(cache, slots[keep], block_size)
    flat = flat_bytes(cache)
    record = flat[_span(data, DATA_BYTES)]  # [S', 576]
    q = rearrange(record[:, :NOPE_DIM].view(torch.float8_e4m3fn).float(), "s (n b) -> s n b", b=QUANT_BLOCK)
    nope = q * fp8.ue8m0_value(flat[_span(scales, N_SCALES)])[..., None]  # exact; byte 0: 2^-127, 255: NaN
    rope = record[:, NOPE_DIM:].contiguous().view(torch.bfloat16)
    out[keep] = torch.cat([fp8.canonical_nan(rearrange(nope, "s n b -> s (n b)").to(torch.bfloat16)), rope], dim=1)
    return out
