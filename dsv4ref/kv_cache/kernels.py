"""Triton kernels of :mod:`dsv4ref.kv_cache`: the writer (insert) and the reader (gather).

Spec (the same as :mod:`dsv4ref.kv_cache.reference`; ``docs/kv_cache.md``)::

    insert:  for i < n with slots[i] >= 0: record(kv[i]) -> slot slots[i]     (584 bytes in two regions)
    gather:  out[p] = slots[p] < 0 ? 0 : [e4m3 × E8M0(scale) (448) | stored bf16 RoPE (64)]

E8M0(b) = 2^(b − 127) for 1..254, 2^-127 for 0, NaN for 255; a NaN comes out as bf16 0x7FC0. The writer
turns a quant block holding a NaN or ±inf into byte 255 + e4m3 NaN bytes (the shared record encoder).
``slots`` is read with its stride (any 1-d view, int32 or int64).

Both kernels handle ``TOK`` slots per tile; axis 0 of every tile is the token; a program handles one tile
(the persistent, pipelined grids measured against this: ``dsv4ref.kv_cache.variants``). The record encoder is the
shared :func:`dsv4ref.tl.kv_record.kv_record` (the fused RoPE + insert of :mod:`dsv4ref.rope` uses it too).
Byte offsets are int64 (a cache passes 2^31 bytes at about 57 000 pages of 64 tokens); with ``SLOT32`` (the
launcher's check that the cache has fewer than 2^31 slots) the slot is divided by the block size in int32.

Per-value work is kept off the common path (a non-finite test per value cost the insert about a quarter of its
bandwidth, ``benchmarks/kv_cache.md``): the writer runs the non-finite policy only for a tile that holds a NaN /
±inf block (one integer max of the |x| bits per block, one branch per tile:
:func:`dsv4ref.tl.numerics.e4m3_ue8m0_tile`); the reader finds NaN codes and byte-255 blocks with one
compare per value against a per-block bound. ``NATIVE`` (compiled only) uses the hardware's e4m3 / bf16
conversions, which are exact; the interpreter always runs the integer encoders.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import HEAD_DIM, N_SCALES, NOPE_DIM, QUANT_BLOCK, ROPE_DIM, SCALE_BYTES, UE8M0_BIAS
from ..tl.kv_record import kv_nope_bits, kv_record, kv_record_loaded
from ..tl.numerics import bf16_bits, page_offsets, page_offsets32

_D = tl.constexpr(HEAD_DIM)  # 512: row width of kv and out
_NOPE = tl.constexpr(NOPE_DIM)  # 448
_ROPE = tl.constexpr(ROPE_DIM)  # 64
_BLOCK = tl.constexpr(QUANT_BLOCK)  # 64
_N_SCALES = tl.constexpr(N_SCALES)  # 7
_SCALE_BYTES = tl.constexpr(SCALE_BYTES)  # 8: the 7 scales + 1 pad byte; also the padded block count
_ONE = tl.constexpr(UE8M0_BIAS)  # scale byte of 2^0, for masked-off lanes


@triton.jit
def _insert_tile(
    cache_ptr,
    cache16_ptr,
    kv_ptr,
    slot_ptr,
    tile,
    n,
    slot_stride,
    kv_stride,
    page_stride,
    block_size,
    TOK: tl.constexpr,
    ROPE16: tl.constexpr,
    NATIVE: tl.constexpr,
    SLOT32: tl.constexpr,
    LOAD_POLICY: tl.constexpr,
    STORE_CACHE: tl.constexpr,
    EARLY: tl.constexpr,
):
    t = tile * TOK + tl.arange(0, TOK)  # [TOK]
    slot = tl.load(slot_ptr + t.to(tl.int64) * slot_stride, mask=t < n, other=-1)  # past the end = padding
    row = kv_ptr + t.to(tl.int64) * kv_stride  # [TOK] row pointers
    j = tl.arange(0, _ROPE)[None, :]
    if EARLY:
        # every load of the tile at once, masked by the row count only (kv has at least n rows): none waits for
        # the slot load, and the NoPE tile is not held behind the RoPE store. A row with slot −1 is read, never
        # written (its values can only send the tile down the non-finite path: same bytes, slower)
        live = t < n
        rope = tl.load(
            row[:, None] + _NOPE + j, mask=tl.broadcast_to(live[:, None], (TOK, _ROPE)), other=0, eviction_policy=LOAD_POLICY
        )
        nope = kv_nope_bits(row, live, TOK, LOAD_POLICY)
        kv_record_loaded(
            cache_ptr, cache16_ptr, nope, slot, rope, block_size, page_stride, TOK, ROPE16, NATIVE, SLOT32, STORE_CACHE
        )
    else:
        rope = tl.load(
            row[:, None] + _NOPE + j,
            mask=tl.broadcast_to((slot >= 0)[:, None], (TOK, _ROPE)),
            other=0,
            eviction_policy=LOAD_POLICY,
        )
        kv_record(
            cache_ptr,
            cache16_ptr,
            row,
            slot,
            rope,
            block_size,
            page_stride,
            TOK,
            ROPE16,
            NATIVE,
            SLOT32,
            LOAD_POLICY,
            STORE_CACHE,
        )


@triton.jit
def insert_kernel(
    cache_ptr,  # uint8 pages, page p at p · page_stride
    cache16_ptr,  # int16 view of the same bytes (the RoPE words go through it when ROPE16)
    kv_ptr,  # int16 view of kv [T, 512] bf16, row stride kv_stride, last dim contiguous
    slot_ptr,  # int32/int64 [n], stride slot_stride: the slot of row i; −1 = write nothing
    n,  # int: number of slots (rows of kv past it are padding)
    slot_stride,  # int: elements between slots (a strided view is read as a view)
    kv_stride,  # int: elements between kv rows
    page_stride,  # int: bytes between pages (cache.stride(0))
    block_size,  # int: tokens per page
    TOK: tl.constexpr,  # tokens per tile (a power of two; 1 = one token per program)
    ROPE16: tl.constexpr,  # page_stride and the cache base are even: store RoPE as whole bf16 words
    NATIVE: tl.constexpr = False,  # compiled: the hardware's exact e4m3 cast (numerics.e4m3_finite); never interpreted
    SLOT32: tl.constexpr = False,  # the cache has < 2^31 slots: int32 slot division (numerics.page_offsets32)
    LOAD_POLICY: tl.constexpr = "",  # eviction policy of the kv loads ("" or "evict_first")
    STORE_CACHE: tl.constexpr = "",  # cache modifier of the cache stores ("" or ".cs")
    EARLY: tl.constexpr = False,  # load the kv rows masked by the row count only, before the slot is known
):
    _insert_tile(
        cache_ptr,
        cache16_ptr,
        kv_ptr,
        slot_ptr,
        tl.program_id(0),
        n,
        slot_stride,
        kv_stride,
        page_stride,
        block_size,
        TOK,
        ROPE16,
        NATIVE,
        SLOT32,
        LOAD_POLICY,
        STORE_CACHE,
        EARLY,
    )


@triton.jit
def _gather_tile(
    cache_ptr,
    cache16_ptr,
    slot_ptr,
    out_ptr,
    tile,
    n,
    slot_stride,
    page_stride,
    block_size,
    TOK: tl.constexpr,
    ROPE16: tl.constexpr,
    NATIVE: tl.constexpr,
    SLOT32: tl.constexpr,
    LOAD_POLICY: tl.constexpr,
    STORE_CACHE: tl.constexpr,
):
    p = tile * TOK + tl.arange(0, TOK)  # [TOK] output rows
    slot = tl.load(slot_ptr + p.to(tl.int64) * slot_stride, mask=p < n, other=-1).to(tl.int64)
    ok = slot >= 0
    if SLOT32:
        data, scales = page_offsets32(tl.maximum(slot, 0), block_size, page_stride)  # [TOK] int64; −1 never addresses
    else:
        data, scales = page_offsets(tl.maximum(slot, 0), block_size, page_stride)
    out_row = out_ptr + p.to(tl.int64) * _D  # [TOK]

    blk = tl.arange(0, _SCALE_BYTES)[None, :, None]
    dim = blk * _BLOCK + tl.arange(0, _BLOCK)[None, None, :]  # [1, 8, 64]; block row 7 masked off
    rows_ok = p < n
    nope_in = tl.broadcast_to(ok[:, None, None] & (blk < _N_SCALES), (TOK, _SCALE_BYTES, _BLOCK))
    nope_out = tl.broadcast_to(rows_ok[:, None, None] & (blk < _N_SCALES), (TOK, _SCALE_BYTES, _BLOCK))
    k = tl.arange(0, _SCALE_BYTES)[None, :]
    j = tl.arange(0, _ROPE)[None, :]
    rope_in = tl.broadcast_to(ok[:, None], (TOK, _ROPE))
    rope_out = tl.broadcast_to(rows_ok[:, None], (TOK, _ROPE))

    # NoPE: e4m3 byte -> fp32, × E8M0(scale): exact, and exactly representable in bf16 (NaN: 0x7FC0).
    # One compare per value finds the NaNs: |e4m3| <= 448 for every code but 0x7F / 0xFF (NaN compiled, ±480
    # interpreted), and a block with scale byte 255 gets the bound −1, which no code passes. Its scale is then
    # irrelevant (254 keeps the product finite, so the interpreter warns of nothing new).
    q = tl.load(cache_ptr + data[:, None, None] + dim, mask=nope_in, other=0, eviction_policy=LOAD_POLICY)
    byte = tl.load(
        cache_ptr + scales[:, None] + k,
        mask=tl.broadcast_to(ok[:, None] & (k < _N_SCALES), (TOK, _SCALE_BYTES)),
        other=_ONE,
        eviction_policy=LOAD_POLICY,
    ).to(tl.int32)
    scale = tl.where(byte == 0, 0x00400000, tl.minimum(byte, 254) << 23).to(tl.float32, bitcast=True)  # 0: 2^-127
    bound = tl.where(byte == 255, -1.0, 448.0)[:, :, None]
    x = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    nan = ~(tl.abs(x) <= bound)  # a NaN code, or any code of a byte-255 block
    nope = tl.where(nan, 0x7FC0, bf16_bits(x * scale[:, :, None], NATIVE))
    tl.store(out_row[:, None, None] + dim, nope.to(tl.int16), mask=nope_out, cache_modifier=STORE_CACHE)  # −1: zeros

    # RoPE: the stored bf16 bits, unchanged (other=0 gives the zero row for slot −1)
    if ROPE16:
        rope = tl.load(cache16_ptr + (data[:, None] + _NOPE) // 2 + j, mask=rope_in, other=0, eviction_policy=LOAD_POLICY)
    else:  # reassemble each bf16 from its two little-endian bytes
        lo = tl.load(cache_ptr + data[:, None] + _NOPE + 2 * j, mask=rope_in, other=0, eviction_policy=LOAD_POLICY)
        hi = tl.load(cache_ptr + data[:, None] + _NOPE + 1 + 2 * j, mask=rope_in, other=0, eviction_policy=LOAD_POLICY)
        rope = (lo.to(tl.int32) | (hi.to(tl.int32) << 8)).to(tl.int16)
    tl.store(out_row[:, None] + _NOPE + j, rope, mask=rope_out, cache_modifier=STORE_CACHE)


@triton.jit
def gather_kernel(
    cache_ptr,  # uint8 pages, page p at p · page_stride
    cache16_ptr,  # int16 view of the same bytes (the RoPE words are read through it when ROPE16)
    slot_ptr,  # int32/int64 [n], stride slot_stride: −1 = a zero row
    out_ptr,  # int16 view of out [n, 512] bf16, contiguous
    n,  # int: number of slots
    slot_stride,  # int: elements between slots
    page_stride,  # int: bytes between pages
    block_size,  # int: tokens per page
    TOK: tl.constexpr,  # slots per tile (a power of two)
    ROPE16: tl.constexpr,  # pages start at even addresses: read RoPE as whole words, else byte pairs
    NATIVE: tl.constexpr = False,  # compiled: the hardware's exact bf16 cast (numerics.bf16_bits); never interpreted
    SLOT32: tl.constexpr = False,  # the cache has < 2^31 slots: int32 slot division (numerics.page_offsets32)
    LOAD_POLICY: tl.constexpr = "",  # eviction policy of the cache loads ("" or "evict_first")
    STORE_CACHE: tl.constexpr = "",  # cache modifier of the out stores ("" or ".cs")
):
    _gather_tile(
        cache_ptr,
        cache16_ptr,
        slot_ptr,
        out_ptr,
        tl.program_id(0),
        n,
        slot_stride,
        page_stride,
        block_size,
        TOK,
        ROPE16,
        NATIVE,
        SLOT32,
        LOAD_POLICY,
        STORE_CACHE,
    )
