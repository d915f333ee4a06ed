"""The paged FP8 KV cache of DeepSeek-V4 ("fp8_ds_mla", FlashMLA "MODEL1"): 584 bytes per token.

A token's 512-dim latent row is stored as 448 e4m3 bytes (dims 0..447 in 7 blocks of 64, one UE8M0 scale
each), 128 bytes of bf16 RoPE (dims 448..511, bit for bit) and 8 scale bytes (7 UE8M0 + a zero pad), in
pages that are a structure of arrays: all tokens' 576 data bytes, then all tokens' 8 scale bytes, then
padding up to a multiple of 576. The page is drawn in ``docs/formats.md#the-584-byte-kv-cache-page``; the
math, conventions and pitfalls (each with the test that catches it) are in ``docs/kv_cache.md``.

A slot is ``page · block_size + offset``; −1 means "no token": writers skip it, readers return zeros.
What each argument may be, the errors, and what NaN / inf input does: ``docs/kv_cache.md#the-input-contract``.

Where to read what:

* :mod:`dsv4ref.kv_cache.reference`: the writer and the reader in plain torch (``insert``, ``gather``);
* :mod:`dsv4ref.kv_cache.kernels`: the two Triton kernels; the record encoder they share with the fused
  RoPE insert is :func:`dsv4ref.tl.kv_record.kv_record`;
* :mod:`dsv4ref.kv_cache.launch`: :class:`KVCacheLaunch`, the measured defaults, the custom ops.
"""

from __future__ import annotations

import torch

from .. import validate
from ..device import DEVICE, HOST
from ..formats import HEAD_DIM, TOKEN_BYTES, page_bytes
from ..seeded import generator, randn
from . import kernels, reference  # noqa: F401  (dsv4ref.kv_cache.kernels / .reference, for readers)
from .launch import KVCacheLaunch, default_launch, kv_gather_op, kv_insert_op
from .reference import flat_bytes, token_offsets

__all__ = [
    "page_bytes",
    "allocate",
    "insert",
    "gather",
    "check_cache",
    "check_writable",
    "flat_bytes",
    "token_offsets",
    "example_inputs",
    "KVCacheLaunch",
    "default_launch",
    "TOKEN_BYTES",
    "SUPPORTED_BACKENDS",
]

SUPPORTED_BACKENDS = ("reference", "triton")  # from dsv4ref.validate.BACKENDS; "auto" = "triton"


def allocate(num_blocks: int, block_size: int, device=None) -> torch.Tensor:
    """A zeroed cache.

    Args:
        num_blocks: number of pages, an int >= 0.
        block_size: tokens per page, an int >= 1.
        device: default :data:`dsv4ref.DEVICE`.
    Returns:
        uint8 ``[num_blocks, page_bytes(block_size)]``, contiguous. Kernels take the page stride from
        ``cache.stride(0)``, never from ``584·B``, so a cache may also be a strided view of a bigger buffer.
    Raises:
        TypeError / ValueError naming ``num_blocks`` or ``block_size``.
    """
    num_blocks = validate.integer(num_blocks, "num_blocks", lo=0)
    block_size = validate.integer(block_size, "block_size", lo=1)
    return torch.zeros(num_blocks, page_bytes(block_size), dtype=torch.uint8, device=device or DEVICE)


def _allocated_for(nbytes: int) -> int | None:
    """The block size whose page_bytes is ``nbytes``, if any (page_bytes is strictly increasing)."""
    b = max(1, nbytes * 72 // (73 * 576) - 1)
    while page_bytes(b) < nbytes:
        b += 1
    return b if page_bytes(b) == nbytes else None


def check_cache(cache: torch.Tensor, block_size: int) -> int:
    """Raise a clear error unless ``block_size`` is an int >= 1 and ``cache`` is a uint8 ``[pages,
    page_bytes(block_size)]`` tensor whose pages are contiguous and do not overlap (every op that reads or
    writes the cache calls this). Returns ``block_size`` as an int.

    The page width must EQUAL ``page_bytes(block_size)``, not merely hold ``584·block_size`` bytes: the cache
    does not record its block size, and ``page_bytes`` is strictly increasing, so the width names the one
    block size the pages were laid out for (a cache allocated for B = 4 is refused as B = 2, where a reader
    would otherwise find the scales of one layout at the offsets of another). The page stride
    ``cache.stride(0)`` may be larger than the width (a view of a bigger buffer)."""
    block_size = validate.integer(block_size, "block_size", lo=1)
    validate.tensor(cache, "cache", dtype=torch.uint8, ndim=2)
    need = page_bytes(block_size)
    if cache.shape[1] != need:
        if cache.shape[1] < block_size * TOKEN_BYTES:
            why = f"cannot hold block_size={block_size} tokens ({block_size * TOKEN_BYTES} bytes needed; "
        else:
            why = f"do not match block_size={block_size} ("
        other = _allocated_for(cache.shape[1])
        hint = f"; this width is page_bytes({other})" if other else ""
        raise ValueError(f"cache: pages of {cache.shape[1]} bytes {why}expected page_bytes({block_size}) = {need}{hint})")
    if cache.stride(1) != 1 or (cache.shape[0] > 1 and cache.stride(0) < cache.shape[1]):
        raise ValueError(f"cache: each page must be contiguous bytes and pages must not overlap (strides {cache.stride()})")
    return block_size


def check_writable(cache: torch.Tensor) -> None:
    """Writers only: raise unless every page starts at an even byte address (:func:`allocate` always gives
    that). A view whose pages start at odd addresses passed in the interpreter, but the compiled insert
    kernel wrote wrong NoPE bytes into it on the H200 (2026-11-30; cause not found; readers were right), so
    writers refuse it."""
    if cache.stride(0) % 2 or cache.storage_offset() % 2:
        raise ValueError(
            f"cache: pages must start at even byte addresses to be written (page stride "
            f"{cache.stride(0)}, storage offset {cache.storage_offset()})"
        )


def _check_launch(launch) -> None:
    if launch is not None and not isinstance(launch, KVCacheLaunch):
        raise TypeError(f"launch: expected a KVCacheLaunch or None, got {type(launch).__name__}")


def insert(
    cache: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    *,
    block_size: int,
    backend: str = "auto",
    launch: KVCacheLaunch | None = None,
) -> None:
    """Quantise rows of ``kv`` and write them into the paged cache, in place.

    Args:
        cache: uint8 ``[num_blocks, page_bytes(block_size)]`` (exactly that width), pages contiguous and at
            even addresses; the page stride is ``cache.stride(0)`` (a view of a bigger buffer is fine).
        kv: ``[T, 512]`` bf16, any strides, already RoPE'd on dims 448..511. Every row that is written must
            be finite: a NaN or ±inf raises ``ValueError("kv: non-finite ...")`` while value checks are on;
            with ``DSV4REF_CHECK_VALUES=0`` its quant block is written as scale byte 255 + e4m3 NaN bytes and
            its RoPE dims bit for bit (so it reads back as NaN). Rows that are not written are not read
            (with ``launch.early_loads``, rows with slot −1 are read, never written; rows past ``len(slots)`` never).
        slots: ``[T']`` int64 or int32, any stride, ``T' ≤ T``; row i goes to slot ``slots[i]`` in
            ``[0, num_blocks · block_size)``, −1 means skip; entries >= 0 distinct. Rows ``T'..T-1`` of kv
            (padding) are ignored.
        block_size: tokens per page, an int >= 1; must be the block size the cache was laid out for.
        backend: ``"auto"`` (= ``"triton"``), ``"triton"`` or ``"reference"``; identical bytes.
        launch: the kernel's launch shape, a :class:`KVCacheLaunch` (anything else: TypeError naming
            ``launch``); None = ``default_launch("insert")``. The reference backend has no launch to shape.
    Returns:
        None. Only the 584 bytes of each written slot change (576 data + 8 scale bytes).
    Raises:
        TypeError / ValueError naming the argument, before any byte of the cache is written.
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    block_size = check_cache(cache, block_size)
    check_writable(cache)
    validate.tensor(kv, "kv", dtype=torch.bfloat16, ndim=2)
    if kv.shape[1] != HEAD_DIM:
        raise ValueError(f"kv: expected [T, {HEAD_DIM}], got shape {tuple(kv.shape)}")
    validate.tensor(slots, "slots", dtype=(torch.int64, torch.int32), ndim=1)
    validate.same_device(cache=cache, kv=kv, slots=slots)
    if slots.shape[0] > kv.shape[0]:
        raise ValueError(f"slots: has {slots.shape[0]} entries but kv only {kv.shape[0]} rows")
    _check_launch(launch)
    validate.index_range(slots, "slots", cache.shape[0] * block_size)
    validate.distinct(slots, "slots")
    _check_finite_rows(kv, slots)
    if backend == "reference":
        reference.insert(cache, kv, slots, block_size=block_size)
        return
    launch = launch or default_launch("insert")
    kv = kv if kv.stride(1) == 1 else kv.contiguous()  # the kernel reads rows of unit column stride
    kv_insert_op(cache, kv, slots, block_size, *launch.op_args())


def _check_finite_rows(kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Value check: every row of kv that :func:`insert` writes is finite (padding and −1 rows are not read)."""
    if not validate.check_values() or slots.numel() == 0:
        return
    bad = ~torch.isfinite(kv[: slots.shape[0]]).all(dim=1) & (slots >= 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0][0])
        raise ValueError(f"kv: non-finite values (NaN or inf) in row {i}, which goes to slot {int(slots[i])}")


def gather(
    cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    block_size: int,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    launch: KVCacheLaunch | None = None,
) -> torch.Tensor:
    """Dequantise the rows at ``slots`` into bf16.

    Args:
        cache: uint8 ``[num_blocks, page_bytes(block_size)]`` pages as written by :func:`insert` or any
            other fp8_ds_mla writer (pages contiguous; any page stride, odd too).
        slots: ``[S]`` int32 or int64, any stride; entries in ``[0, num_blocks · block_size)`` or −1 (a zero
            row); repeats allowed.
        block_size: tokens per page, an int >= 1; must be the block size the cache was laid out for.
        out: optional preallocated ``[S, 512]`` bf16, contiguous (a workspace reused across calls).
        backend: ``"auto"`` (= ``"triton"``), ``"triton"`` or ``"reference"``; identical bits.
        launch: the kernel's launch shape, a :class:`KVCacheLaunch` (anything else: TypeError naming
            ``launch``); None = ``default_launch("gather")``. The reference backend has no launch to shape.
    Returns:
        ``[S, 512]`` bf16 (``out`` itself when given): dims 0..447 are e4m3 × E8M0(scale) (exact; scale byte
        0 reads 2^-127, 255 reads NaN, every NaN as 0x7FC0), dims 448..511 the stored bf16 bits; +0.0
        everywhere for slot −1.
    Raises:
        TypeError / ValueError naming the argument, before ``out`` is written.
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    block_size = check_cache(cache, block_size)
    validate.tensor(slots, "slots", dtype=(torch.int32, torch.int64), ndim=1)
    validate.same_device(cache=cache, slots=slots, out=out)
    if out is not None:
        validate.tensor(out, "out", dtype=torch.bfloat16, shape=(slots.shape[0], HEAD_DIM), contiguous=True)
    _check_launch(launch)
    validate.index_range(slots, "slots", cache.shape[0] * block_size)
    if backend == "reference":
        ref = reference.gather(cache, slots, block_size=block_size)
        if out is None:
            return ref
        out.copy_(ref)
        return out
    if out is None:
        out = torch.empty(slots.shape[0], HEAD_DIM, dtype=torch.bfloat16, device=cache.device)
    launch = launch or default_launch("gather")
    kv_gather_op(cache, slots, out, block_size, *launch.op_args())
    return out


def example_inputs(T: int, block_size: int, num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A small insert problem on :data:`dsv4ref.DEVICE`: ``(kv [T, 512] bf16, slots [T] int64)``, the slots
    distinct and random over ``num_blocks · block_size``, every ``T // 5``-th one −1 (padding)."""
    kv = randn((T, HEAD_DIM), seed=seed)
    slots = torch.randperm(num_blocks * block_size, generator=generator(seed), device=HOST)[:T].to(DEVICE)
    slots[:: max(1, T // 5)] = -1
    return kv, slots
