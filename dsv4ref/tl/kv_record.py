"""The one encoder of the 584-byte KV-cache record: used by ``kv_cache.insert`` and by the fused
Q-norm + RoPE + KV insert of :mod:`dsv4ref.rope`.

Spec (``docs/formats.md#the-584-byte-kv-cache-page``): a token's bf16 row k[0:512] becomes

* 448 e4m3 bytes at ``data``: k[0:448] in 7 blocks of 64, each scaled by its own UE8M0 byte
  (``docs/formats.md#ue8m0-scales``: amax floored at 1e-4, exact bit-field ceiling);
* 128 bytes at ``data + 448``: the 64 RoPE dims as bf16, little-endian (dim 448 + j at bytes 448 + 2j,
  449 + 2j), taken from the caller, which loads them as they are or rotates them first;
* 8 bytes at ``scales``: the 7 UE8M0 bytes and a zero pad byte,

where ``data = page·page_stride + 576·offset`` and ``scales = page·page_stride + 576·B + 8·offset`` for
``slot = page·B + offset``: the two regions are NOT adjacent. Slot −1 writes nothing.

A quant block holding a NaN or ±inf is written as scale byte 255 and e4m3 NaN bytes (0x7F; 0xFF for a
value that is not a NaN and has its sign bit set), exactly like ``fp8.quantize_ue8m0``
(``docs/formats.md#non-finite-values``); the RoPE bits are stored as given, NaN and inf included. That policy
costs per-value work, so it runs only for a tile that holds such a block (``e4m3_ue8m0_tile``: one
integer max of the |x| bits per block, one branch per tile); a finite tile runs the plain encoder.

The RoPE words are stored first, so their registers are free before the NoPE tile is loaded. What ptxas makes
of ``kv_cache.insert``'s kernel is printed by ``benchmarks/experiments/kv_cache_compile_check.py`` (Triton 3.6, sm_90a).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import KV_AMAX_FLOOR, N_SCALES, NOPE_DIM, QUANT_BLOCK, ROPE_DIM
from .numerics import e4m3_ue8m0_tile, page_offsets, page_offsets32

_NOPE = tl.constexpr(NOPE_DIM)  # 448 e4m3 bytes, then the RoPE words
_BLOCK = tl.constexpr(QUANT_BLOCK)  # 64 values per scale byte
_N_SCALES = tl.constexpr(N_SCALES)  # 7 quant blocks
_BLOCKS_P2 = tl.constexpr(triton.next_power_of_2(N_SCALES))  # 8: tile rows (tl.arange needs a power of two)
_ROPE = tl.constexpr(ROPE_DIM)  # 64 bf16 values
_FLOOR = tl.constexpr(KV_AMAX_FLOOR)


@triton.jit
def kv_record(
    cache_ptr,  # uint8 pages; page p starts at p · page_stride
    cache16_ptr,  # int16 view of the same bytes (only read when ROPE16)
    row,  # [TOK] pointers to each token's kv row, int16 view of bf16 (dims 0..447 are read from here)
    slot,  # [TOK] int32/int64 slot = page · block_size + offset; −1 = write nothing
    rope_bits,  # [TOK, 64] int16 (or int32 whose low 16 bits are) the bf16 bits to store for dims 448..511
    block_size,  # tokens per page
    page_stride,  # bytes between pages (the cache tensor's stride(0))
    TOK: tl.constexpr,  # tokens in the tile (a power of two; 1 for one token)
    ROPE16: tl.constexpr,  # pages start at even addresses: store the RoPE as 16-bit words, else byte pairs
    NATIVE: tl.constexpr,  # compiled only: the hardware's exact e4m3 cast for finite tiles (e4m3_finite)
    SLOT32: tl.constexpr,  # the cache has < 2^31 slots: divide the slot in int32 (page_offsets32)
    LOAD_POLICY: tl.constexpr,  # eviction policy of the kv row load ("" or "evict_first")
    STORE_CACHE: tl.constexpr,  # cache modifier of the record stores ("" or ".cs", streaming)
):
    # No defaults: compiled Triton cannot bind a jitted callee's str default (LOAD_POLICY = "" failed to compile
    # in the fused RoPE + KV insert on the H200), so every caller passes every constexpr.
    """Quantise and store the 584-byte records of ``TOK`` tokens (axis 0 of every tile is the token). The NoPE
    tile is loaded after the RoPE store, masked by the slot: a row whose slot is −1 is never read."""
    data, scales = _record_offsets(slot, block_size, page_stride, SLOT32)
    _store_rope(cache_ptr, cache16_ptr, data, slot >= 0, rope_bits, TOK, ROPE16, STORE_CACHE)
    bits = kv_nope_bits(row, slot >= 0, TOK, LOAD_POLICY)
    _store_nope_and_scales(cache_ptr, data, scales, slot >= 0, bits, TOK, NATIVE, STORE_CACHE)


@triton.jit
def kv_record_loaded(
    cache_ptr,
    cache16_ptr,
    nope_bits,
    slot,
    rope_bits,
    block_size,
    page_stride,
    TOK: tl.constexpr,
    ROPE16: tl.constexpr,
    NATIVE: tl.constexpr,
    SLOT32: tl.constexpr,
    STORE_CACHE: tl.constexpr,
):
    """:func:`kv_record` on a NoPE tile the caller loaded already (``nope_bits`` = :func:`kv_nope_bits`), so that
    its loads can be issued before the slot is known (``kv_cache.insert`` with ``early_loads``: no DRAM round
    trip waits for another). Same bytes; rows with slot −1 are stored nowhere, whatever was loaded for them."""
    data, scales = _record_offsets(slot, block_size, page_stride, SLOT32)
    _store_rope(cache_ptr, cache16_ptr, data, slot >= 0, rope_bits, TOK, ROPE16, STORE_CACHE)
    _store_nope_and_scales(cache_ptr, data, scales, slot >= 0, nope_bits, TOK, NATIVE, STORE_CACHE)


@triton.jit
def kv_nope_bits(row, row_ok, TOK: tl.constexpr, LOAD_POLICY: tl.constexpr):
    """The NoPE dims 0..447 of ``TOK`` kv rows as a [TOK, 8, 64] int32 tile of bf16 bits (block row 7 and the
    rows where ``row_ok`` is False read as 0)."""
    blk = tl.arange(0, _BLOCKS_P2)[None, :, None]
    dim = blk * _BLOCK + tl.arange(0, _BLOCK)[None, None, :]  # [1, 8, 64]: dim = 64·block + column
    m = tl.broadcast_to(row_ok[:, None, None] & (blk < _N_SCALES), (TOK, _BLOCKS_P2, _BLOCK))  # mask: pointer's shape
    return tl.load(row[:, None, None] + dim, mask=m, other=0, eviction_policy=LOAD_POLICY).to(tl.int32) & 0xFFFF


@triton.jit
def _record_offsets(slot, block_size, page_stride, SLOT32: tl.constexpr):
    """[TOK] int64 byte offsets (data, scales) of each slot's two regions; −1 never addresses (clamped to 0)."""
    if SLOT32:
        data, scales = page_offsets32(tl.maximum(slot, 0), block_size, page_stride)
    else:
        data, scales = page_offsets(tl.maximum(slot, 0), block_size, page_stride)
    return data, scales


@triton.jit
def _store_rope(cache_ptr, cache16_ptr, data, ok, rope_bits, TOK: tl.constexpr, ROPE16: tl.constexpr, STORE_CACHE: tl.constexpr):
    """RoPE: the caller's bf16 bits to bytes 448.. of the token's data, little-endian."""
    j = tl.arange(0, _ROPE)[None, :]
    rope_ok = tl.broadcast_to(ok[:, None], (TOK, _ROPE))
    if ROPE16:
        tl.store(cache16_ptr + (data[:, None] + _NOPE) // 2 + j, rope_bits.to(tl.int16), mask=rope_ok, cache_modifier=STORE_CACHE)
    else:  # two byte stores, low byte first
        r = rope_bits.to(tl.int32) & 0xFFFF
        tl.store(cache_ptr + data[:, None] + _NOPE + 2 * j, (r & 0xFF).to(tl.uint8), mask=rope_ok, cache_modifier=STORE_CACHE)
        tl.store(cache_ptr + data[:, None] + _NOPE + 1 + 2 * j, (r >> 8).to(tl.uint8), mask=rope_ok, cache_modifier=STORE_CACHE)


@triton.jit
def _store_nope_and_scales(cache_ptr, data, scales, ok, bits, TOK: tl.constexpr, NATIVE: tl.constexpr, STORE_CACHE: tl.constexpr):
    """NoPE: the [TOK, 8, 64] tile of bf16 bits (block rows 0..6 are the 7 quant blocks, row 7 unused) -> fp32
    exactly, in integers (no bf16 arithmetic), one scale byte per block; then the 7 UE8M0 bytes and the zero pad
    byte."""
    blk = tl.arange(0, _BLOCKS_P2)[None, :, None]
    dim = blk * _BLOCK + tl.arange(0, _BLOCK)[None, None, :]  # [1, 8, 64]: dim = 64·block + column
    nope_ok = tl.broadcast_to(ok[:, None, None] & (blk < _N_SCALES), (TOK, _BLOCKS_P2, _BLOCK))  # mask: pointer's shape
    x = (bits << 16).to(tl.float32, bitcast=True)
    q, byte = e4m3_ue8m0_tile(x, _FLOOR, 2, NATIVE)  # [TOK, 8, 64] uint8, [TOK, 8] int32; block row 7 unused
    tl.store(cache_ptr + data[:, None, None] + dim, q, mask=nope_ok, cache_modifier=STORE_CACHE)

    # scales: the 7 UE8M0 bytes and the zero pad byte
    k = tl.arange(0, _BLOCKS_P2)[None, :]  # the 8 scale-row bytes line up with the 8 tile rows of byte
    scale_ok = tl.broadcast_to(ok[:, None], (TOK, _BLOCKS_P2))
    tl.store(
        cache_ptr + scales[:, None] + k, tl.where(k < _N_SCALES, byte, 0).to(tl.uint8), mask=scale_ok, cache_modifier=STORE_CACHE
    )
