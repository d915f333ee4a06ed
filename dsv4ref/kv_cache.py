"""The paged FP8 KV cache of DeepSeek-V4 ("fp8_ds_mla", FlashMLA "MODEL1"): 584 bytes per token.

Facts: ``../shared/spec/formats.md`` §5, §7, §9, §10. A token's 512-dim latent row k is stored as

* 448 e4m3 bytes: k[0:448] block-quantised, 7 blocks of 64, one UE8M0 scale per block;
* 128 bytes: k[448:512], the 64 RoPE dims, as bf16 (little-endian), copied bit for bit;
* 7 UE8M0 scale bytes and 1 zero pad byte.

The bytes of one token are NOT contiguous. A page of ``B`` tokens is a structure of arrays::

    [0, 576·B)              token data: token t at 576·t  (448 e4m3 | 128 bytes bf16 RoPE)
    [576·B, 584·B)          scales:     token t at 576·B + 8·t  (7 UE8M0 | 0)
    [584·B, page_bytes)     padding up to a multiple of 576 ("FlashMLA requires 576B alignment")

A slot is ``page · B + offset``; −1 means "no token" (padding): writers skip it, readers return zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validate
from .device import DEVICE
from .fp8 import e4m3_bits, pow2_ref, quantize_ue8m0
from .harness import BenchCase, CheckRow, bench, check
from .testing import compare, randn
from .tl_helpers import bf16_rne_bits, inv_pow2, page_offsets, pow2, ue8m0_byte

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
QUANT_BLOCK = 64
N_SCALES = NOPE_DIM // QUANT_BLOCK  # 7
DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES = N_SCALES + 1  # 8 (7 scales + 1 zero pad)
TOKEN_BYTES = DATA_BYTES + SCALE_BYTES  # 584
PAGE_ALIGN = 576

__all__ = ["page_bytes", "allocate", "insert", "gather", "check_cache", "check_writable", "flat_bytes",
           "token_offsets", "TOKEN_BYTES"]


def page_bytes(block_size: int) -> int:
    """Bytes of one page of ``block_size`` tokens: round_up(584·B, 576). B = 64 gives 37 440."""
    if block_size < 1:
        raise ValueError(f"block_size: expected >= 1, got {block_size}")
    return -(-block_size * TOKEN_BYTES // PAGE_ALIGN) * PAGE_ALIGN


def allocate(num_blocks: int, block_size: int, device=None) -> torch.Tensor:
    """A zeroed cache: uint8 ``[num_blocks, page_bytes(block_size)]``. Kernels take the page stride from
    ``cache.stride(0)``, never from ``584·B``, so a cache may also be a strided view of a bigger buffer."""
    return torch.zeros(num_blocks, page_bytes(block_size), dtype=torch.uint8, device=device or DEVICE)


def check_cache(cache: torch.Tensor, block_size: int) -> None:
    """Raise a clear error unless ``cache`` is a uint8 ``[pages, bytes]`` tensor whose pages are contiguous
    and large enough for ``block_size`` tokens (every op that reads or writes the cache calls this)."""
    validate.tensor(cache, "cache", dtype=torch.uint8, ndim=2)
    if cache.shape[1] < block_size * TOKEN_BYTES:
        raise ValueError(f"cache: pages of {cache.shape[1]} bytes cannot hold block_size={block_size} tokens "
                         f"({block_size * TOKEN_BYTES} bytes needed; page_bytes({block_size}) = {page_bytes(block_size)})")
    if cache.stride(1) != 1 or cache.stride(0) < cache.shape[1]:
        raise ValueError(f"cache: each page must be contiguous bytes (strides {cache.stride()})")


def check_writable(cache: torch.Tensor) -> None:
    """Writers only: allocate() always gives pages at even byte addresses. A view whose pages start at
    odd addresses passed in the interpreter, but the compiled insert kernel wrote wrong NoPE bytes into
    it on the H200 (2026-11-30; cause not found; readers were right), so writers refuse it."""
    if cache.stride(0) % 2 or cache.storage_offset() % 2:
        raise ValueError(f"cache: pages must start at even byte addresses to be written (page stride "
                         f"{cache.stride(0)}, storage offset {cache.storage_offset()})")


def flat_bytes(cache: torch.Tensor) -> torch.Tensor:
    """All bytes from the first page's start to the last page's end, as one 1-d view (works for strided
    caches too), so the reference can address bytes exactly as a kernel does: base + offset."""
    n = (cache.shape[0] - 1) * cache.stride(0) + cache.shape[1] if cache.shape[0] else 0
    return cache.as_strided((n,), (1,), cache.storage_offset())


def token_offsets(cache: torch.Tensor, slots: torch.Tensor, block_size: int):
    """int64 byte offsets (data start, scale start) of each slot in ``flat_bytes(cache)``."""
    slots = slots.to(torch.int64)
    page, off = slots // block_size, slots % block_size
    base = page * cache.stride(0)
    return base + off * DATA_BYTES, base + block_size * DATA_BYTES + off * SCALE_BYTES


# ----------------------------------------------------------------------------------------------------
# insert (writer)
# ----------------------------------------------------------------------------------------------------


def _insert_reference(cache, kv, slot_mapping, block_size):
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0  # −1 rows write nothing
    rows = kv[:n][keep]
    data, scales = token_offsets(cache, slot_mapping[keep], block_size)
    q, s = quantize_ue8m0(rows[:, :NOPE_DIM], QUANT_BLOCK, 1e-4, backend="reference")
    rope_bytes = rows[:, NOPE_DIM:].contiguous().view(torch.uint8)  # 64 bf16 -> 128 bytes, little-endian
    flat = flat_bytes(cache)
    flat[data[:, None] + torch.arange(NOPE_DIM, device=cache.device)] = q.view(torch.uint8)
    flat[data[:, None] + NOPE_DIM + torch.arange(2 * ROPE_DIM, device=cache.device)] = rope_bytes
    scale_row = torch.cat([s, torch.zeros_like(s[:, :1])], dim=1)  # 7 scales + the zero pad byte
    flat[scales[:, None] + torch.arange(SCALE_BYTES, device=cache.device)] = scale_row


@triton.jit
def _insert_kernel(
    cache_ptr,  # uint8, page p starts at p * page_stride
    cache16_ptr,  # int16 view of the same bytes (used for the RoPE copy when ROPE16)
    kv_ptr,  # int16 view of kv [T, 512] bf16 (row stride kv_stride)
    slot_ptr,  # int64 [n]
    n,  # number of slot_mapping entries (rows past it are padding)
    kv_stride,
    page_stride,
    block_size,
    TOK: tl.constexpr,  # tokens per program (a power of two; 1 is the plain "one program per token")
    ROPE16: tl.constexpr,  # page_stride and the cache base are even: copy RoPE as whole bf16 words
):
    # Program p handles tokens p·TOK .. p·TOK+TOK−1. Axis 0 of every tile is the token. The NoPE dims
    # are a [TOK, 8, 64] tile (tl.arange needs powers of two): block axis rows 0..6 are the 7 quant
    # blocks, row 7 is masked off. The 64 RoPE dims are a [TOK, 64] tile, the scale bytes [TOK, 8].
    t = tl.program_id(0) * TOK + tl.arange(0, TOK)  # [TOK]
    slot = tl.load(slot_ptr + t, mask=t < n, other=-1)  # past the end = padding
    ok = slot >= 0  # slot −1 (padding): write nothing at all
    slot = tl.maximum(slot, 0)  # never form an address from −1 (the masks keep it unused)
    data, scales = page_offsets(slot, block_size, page_stride)  # [TOK] int64 byte offsets
    row = kv_ptr + t.to(tl.int64) * kv_stride  # [TOK] row pointers

    blk = tl.arange(0, 8)[None, :, None]
    dim = blk * 64 + tl.arange(0, 64)[None, None, :]  # [1, 8, 64]: dim = 64·block + column
    nope_ok = tl.broadcast_to(ok[:, None, None] & (blk < 7), (TOK, 8, 64))  # a mask has its pointer's shape
    j = tl.arange(0, 64)[None, :]  # RoPE dim 448 + j
    rope_ok = tl.broadcast_to(ok[:, None], (TOK, 64))
    k = tl.arange(0, 8)[None, :]  # scale byte index
    scale_ok = tl.broadcast_to(ok[:, None], (TOK, 8))

    # NoPE: bf16 -> fp32 exactly, in integers (no bf16 arithmetic), then a scale byte per block
    bits = tl.load(row[:, None, None] + dim, mask=nope_ok, other=0).to(tl.int32) & 0xFFFF
    x = (bits << 16).to(tl.float32, bitcast=True)
    byte = ue8m0_byte(tl.max(tl.abs(x), axis=2), 1e-4, 448.0)  # [TOK, 8]; block row 7 is unused
    q = e4m3_bits(x * inv_pow2(byte)[:, :, None])  # × 2^-e is exact; the sign bit set in integers (−0)
    tl.store(cache_ptr + data[:, None, None] + dim, q, mask=nope_ok)

    # RoPE: the 64 bf16 values are copied bit for bit to bytes 448.. of the token's data (little-endian)
    rbits = tl.load(row[:, None] + 448 + j, mask=rope_ok, other=0)
    if ROPE16:
        tl.store(cache16_ptr + (data[:, None] + 448) // 2 + j, rbits, mask=rope_ok)
    else:  # odd page stride (a strided view): two byte stores, low byte first
        r32 = rbits.to(tl.int32) & 0xFFFF
        tl.store(cache_ptr + data[:, None] + 448 + 2 * j, (r32 & 0xFF).to(tl.uint8), mask=rope_ok)
        tl.store(cache_ptr + data[:, None] + 449 + 2 * j, (r32 >> 8).to(tl.uint8), mask=rope_ok)

    # scales: 7 UE8M0 bytes and the zero pad byte
    tl.store(cache_ptr + scales[:, None] + k, tl.where(k < 7, byte, 0).to(tl.uint8), mask=scale_ok)


# Launch shape, measured on the H200 (benchmarks/kv_cache.md): a program per TOK tokens, num_warps warps.
INSERT_TOK, INSERT_WARPS = 8, 1  # 68% (64k) / 75% (256k) of copy, kernel time
GATHER_TOK, GATHER_WARPS = 4, 1  # 80% (64k) / 90% (256k) of copy, kernel time


def _int16_view(cache: torch.Tensor):
    """The cache's bytes as int16 words, when every page starts at an even address (always for
    :func:`allocate`; an odd-strided view falls back to byte copies). Returns (view, ok)."""
    if cache.stride(0) % 2 == 0 and cache.storage_offset() % 2 == 0 and cache.shape[1] % 2 == 0:
        return cache.view(torch.int16), True
    return cache, False


def _launch_insert(cache, kv, slot_mapping, block_size, tok=None, num_warps=None):
    kv16 = kv.view(torch.int16)
    c16, rope16 = _int16_view(cache)
    n, tok = slot_mapping.shape[0], tok or INSERT_TOK
    _insert_kernel[(triton.cdiv(n, tok),)](cache, c16, kv16, slot_mapping, n, kv16.stride(0), cache.stride(0), block_size,
                                           TOK=tok, ROPE16=rope16, num_warps=num_warps or INSERT_WARPS)


@torch.library.custom_op("dsv4ref::kv_insert", mutates_args=("cache",))
def _kv_insert_op(cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> None:
    if slot_mapping.shape[0]:
        _launch_insert(cache, kv, slot_mapping, block_size)


@_kv_insert_op.register_fake
def _(cache, kv, slot_mapping, block_size):
    return None


def insert(cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor, *, block_size: int,
           backend: str = "triton") -> None:
    """Quantise and write rows of ``kv`` into the paged cache, in place.

    Args:
        cache: uint8 ``[num_blocks, ≥ page_bytes(block_size)]`` (page stride from ``cache.stride(0)``).
        kv: ``[T, 512]`` bf16, already RoPE'd on dims 448..511.
        slot_mapping: ``[T']`` int64 (or int32), ``T' ≤ T``; row i goes to slot ``slot_mapping[i]``,
            −1 means skip. Rows ``T'..T-1`` of kv (padding) are ignored.
        block_size: tokens per page.
    """
    validate.backend(backend)
    check_cache(cache, block_size)
    check_writable(cache)
    validate.tensor(kv, "kv", dtype=torch.bfloat16, ndim=2)
    if kv.shape[1] != HEAD_DIM or kv.stride(1) != 1:
        raise ValueError(f"kv: expected [T, {HEAD_DIM}] with contiguous rows, got shape {tuple(kv.shape)} "
                         f"strides {kv.stride()}")
    validate.tensor(slot_mapping, "slot_mapping", dtype=(torch.int64, torch.int32), ndim=1)
    validate.same_device(cache=cache, kv=kv, slot_mapping=slot_mapping)
    if slot_mapping.shape[0] > kv.shape[0]:
        raise ValueError(f"slot_mapping: has {slot_mapping.shape[0]} entries but kv only {kv.shape[0]} rows")
    validate.index_range(slot_mapping, "slot_mapping", cache.shape[0] * block_size)
    if backend == "reference":
        _insert_reference(cache, kv, slot_mapping, block_size)
    else:
        torch.ops.dsv4ref.kv_insert(cache, kv, slot_mapping.to(torch.int64), block_size)


# ----------------------------------------------------------------------------------------------------
# gather (reader)
# ----------------------------------------------------------------------------------------------------


def _gather_reference(cache, slots, block_size):
    out = torch.zeros(slots.shape[0], HEAD_DIM, dtype=torch.bfloat16, device=cache.device)
    keep = slots >= 0  # never index memory with −1: those rows stay zero
    data, scales = token_offsets(cache, slots[keep], block_size)
    flat = flat_bytes(cache)
    q = flat[data[:, None] + torch.arange(NOPE_DIM, device=cache.device)].view(torch.float8_e4m3fn)
    s = flat[scales[:, None] + torch.arange(N_SCALES, device=cache.device)]
    nope = q.float().view(-1, N_SCALES, QUANT_BLOCK) * pow2_ref(s)[..., None]  # exact
    rope = flat[data[:, None] + NOPE_DIM + torch.arange(2 * ROPE_DIM, device=cache.device)].view(torch.bfloat16)
    out[keep] = torch.cat([nope.reshape(-1, NOPE_DIM).to(torch.bfloat16), rope], dim=1)
    return out


@triton.jit
def _gather_kernel(
    cache_ptr,  # uint8 pages
    cache16_ptr,  # int16 view of the same bytes (RoPE read when ROPE16)
    slot_ptr,  # int32/int64 [S]
    out_ptr,  # int16 view of out [S, 512] bf16 (contiguous)
    n,  # S
    page_stride,
    block_size,
    TOK: tl.constexpr,  # slots per program
    ROPE16: tl.constexpr,
):
    p = tl.program_id(0) * TOK + tl.arange(0, TOK)  # [TOK] output rows
    slot = tl.load(slot_ptr + p, mask=p < n, other=-1).to(tl.int64)
    ok = slot >= 0
    slot = tl.maximum(slot, 0)  # masked loads below never touch it for slot −1
    data, scales = page_offsets(slot, block_size, page_stride)  # [TOK] int64 byte offsets
    out_row = out_ptr + p.to(tl.int64) * 512  # [TOK]

    blk = tl.arange(0, 8)[None, :, None]
    dim = blk * 64 + tl.arange(0, 64)[None, None, :]  # [1, 8, 64]; block row 7 masked off
    rows_ok = p < n
    nope_in = tl.broadcast_to(ok[:, None, None] & (blk < 7), (TOK, 8, 64))
    nope_out = tl.broadcast_to(rows_ok[:, None, None] & (blk < 7), (TOK, 8, 64))
    k = tl.arange(0, 8)[None, :]
    j = tl.arange(0, 64)[None, :]
    rope_in = tl.broadcast_to(ok[:, None], (TOK, 64))
    rope_out = tl.broadcast_to(rows_ok[:, None], (TOK, 64))

    # NoPE: e4m3 byte -> fp32, × 2^(scale − 127): exact, and exactly representable in bf16
    q = tl.load(cache_ptr + data[:, None, None] + dim, mask=nope_in, other=0)
    byte = tl.load(cache_ptr + scales[:, None] + k, mask=tl.broadcast_to(ok[:, None] & (k < 7), (TOK, 8)), other=127)
    nope = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * pow2(byte.to(tl.int32))[:, :, None]
    tl.store(out_row[:, None, None] + dim, bf16_rne_bits(nope).to(tl.int16, bitcast=True), mask=nope_out)  # −1: zeros

    # RoPE: the stored bf16 bits, unchanged (other=0 gives the zero row for slot −1)
    if ROPE16:
        rope = tl.load(cache16_ptr + (data[:, None] + 448) // 2 + j, mask=rope_in, other=0)
    else:  # reassemble each bf16 from its two little-endian bytes
        lo = tl.load(cache_ptr + data[:, None] + 448 + 2 * j, mask=rope_in, other=0).to(tl.int32)
        hi = tl.load(cache_ptr + data[:, None] + 449 + 2 * j, mask=rope_in, other=0).to(tl.int32)
        rope = (lo | (hi << 8)).to(tl.int16)
    tl.store(out_row[:, None] + 448 + j, rope, mask=rope_out)


def _launch_gather(cache, slots, out, block_size, tok=None, num_warps=None):
    c16, rope16 = _int16_view(cache)
    n, tok = slots.shape[0], tok or GATHER_TOK
    _gather_kernel[(triton.cdiv(n, tok),)](cache, c16, slots, out.view(torch.int16), n, cache.stride(0), block_size,
                                           TOK=tok, ROPE16=rope16, num_warps=num_warps or GATHER_WARPS)


@torch.library.custom_op("dsv4ref::kv_gather", mutates_args=("out",))
def _kv_gather_op(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, block_size: int) -> None:
    if slots.shape[0]:
        _launch_gather(cache, slots, out, block_size)


@_kv_gather_op.register_fake
def _(cache, slots, out, block_size):
    return None


def gather(cache: torch.Tensor, slots: torch.Tensor, *, block_size: int, out: torch.Tensor | None = None,
           backend: str = "triton") -> torch.Tensor:
    """Dequantise the rows at ``slots`` into bf16.

    Args:
        cache: uint8 pages as written by :func:`insert`.
        slots: ``[S]`` int32 or int64 global slots; −1 gives a zero row.
        out: optional preallocated ``[S, 512]`` bf16 (a workspace reused across calls).
    Returns:
        ``[S, 512]`` bf16; dims 0..447 are e4m3 × 2^(scale−127) (exact), dims 448..511 the stored bf16.
    """
    validate.backend(backend)
    check_cache(cache, block_size)
    validate.tensor(slots, "slots", dtype=(torch.int32, torch.int64), ndim=1)
    validate.same_device(cache=cache, slots=slots)
    validate.index_range(slots, "slots", cache.shape[0] * block_size)
    if out is not None:
        validate.tensor(out, "out", dtype=torch.bfloat16, shape=(slots.shape[0], HEAD_DIM), contiguous=True)
    if backend == "reference":
        ref = _gather_reference(cache, slots, block_size)
        if out is not None:
            out.copy_(ref)
            return out
        return ref
    if out is None:
        out = torch.empty(slots.shape[0], HEAD_DIM, dtype=torch.bfloat16, device=cache.device)
    torch.ops.dsv4ref.kv_gather(cache, slots, out, block_size)
    return out


# ----------------------------------------------------------------------------------------------------
# python -m dsv4ref check / bench
# ----------------------------------------------------------------------------------------------------


def _example(T: int, block_size: int, num_blocks: int, seed: int):
    kv = randn((T, HEAD_DIM), seed=seed)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(seed))[:T].to(DEVICE)
    slots[:: max(1, T // 5)] = -1  # some padding rows
    return kv, slots


@check("kv_cache.insert")
def _check_insert() -> list[CheckRow]:
    rows = []
    for T, B, nb in [(37, 2, 40), (64, 61, 3), (100, 64, 4)]:
        kv, slots = _example(T, B, nb, seed=T)
        ref, out = allocate(nb, B), allocate(nb, B)
        insert(ref, kv, slots, block_size=B, backend="reference")
        insert(out, kv, slots, block_size=B)
        rows.append(CheckRow("kv_cache.insert", f"T={T} B={B} pages={nb}", compare(out, ref, "exact", "cache bytes")))
    return rows


@check("kv_cache.gather")
def _check_gather() -> list[CheckRow]:
    rows = []
    for T, B, nb in [(37, 2, 40), (100, 64, 4)]:
        kv, slots = _example(T, B, nb, seed=T + 1)
        cache = allocate(nb, B)
        insert(cache, kv, slots, block_size=B)
        got = gather(cache, slots, block_size=B)
        rows.append(CheckRow("kv_cache.gather", f"S={T} B={B}", compare(got, gather(cache, slots, block_size=B, backend="reference"), "exact")))
    return rows


@bench("kv_cache")
def _bench() -> list[BenchCase]:
    """64k slots (the issue's size) and 256k slots, pages of 64, a random slot order. Four input sets
    rotate: 4 × (37 MB cache + 64 MB kv + 64 MB out) per size, well past a 60 MB L2."""
    cases = []
    for S in (65536, 262144):
        B, n_sets, nb = 64, 4, S // 64
        sets = []
        for i in range(n_sets):
            kv = torch.randn(S, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
            slots = torch.randperm(S, device=DEVICE)
            sets.append((allocate(nb, B), kv, slots, torch.empty_like(kv)))
        for c, kv, s, _ in sets:
            insert(c, kv, s, block_size=B)
        ins_bytes = S * (HEAD_DIM * 2 + 8 + TOKEN_BYTES)  # read kv + slot, write 584 B
        gat_bytes = S * (TOKEN_BYTES + 8 + HEAD_DIM * 2)  # read 584 B + slot, write bf16 row
        cases += [
            BenchCase("kv_cache.insert", f"S={S} B={B}",
                      lambda i, st=sets: torch.ops.dsv4ref.kv_insert(st[i][0], st[i][1], st[i][2], 64),
                      n_sets, ins_bytes, note="kv 1024 + slot 8 + cache 584 B/token"),
            BenchCase("kv_cache.gather", f"S={S} B={B}",
                      lambda i, st=sets: torch.ops.dsv4ref.kv_gather(st[i][0], st[i][2], st[i][3], 64),
                      n_sets, gat_bytes, note="cache 584 + slot 8 + out 1024 B/row"),
        ]
    return cases
