"""The indexer's quantisers and its K cache: :func:`quantize_q` (the fused indexer-Q), :func:`dequantize_q`,
:func:`quantize_k`, :func:`insert_k` (the cache writer), :func:`read_k`, :func:`dequantize_k` and the page
arithmetic (:func:`k_page_bytes`, :func:`allocate_k_cache`). Re-exported by :mod:`dsv4ref.indexer`, whose
docstring has the overview."""

from __future__ import annotations

import torch

from .. import validate
from ..device import DEVICE
from ..formats import index_k_page_bytes
from . import launch as _launch
from . import reference
from .checks import (
    HEAD_DIM,
    INDEX_DTYPES,
    ROPE_DIM,
    _backend,
    _check_flag,
    _check_fmt,
    _check_k,
    _checking_values,
    _launch_config,
)
from .launch import IndexerLaunch


# ----------------------------------------------------------------------------------------------------
# the query path
# ----------------------------------------------------------------------------------------------------


def quantize_q(
    index_q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: torch.Tensor,
    *,
    fmt: str = "fp8",
    hadamard: bool = False,
    backend: str = "auto",
    launch: IndexerLaunch | None = None,
):
    """The fused indexer-Q: RoPE + bf16 round trip (+ Hadamard) + FP8 or MXFP4 quantisation + weight fold.

    Args:
        index_q: ``[T, n_ih, 128]`` bf16, n_ih >= 1, the indexer queries ``wq_b(qr)`` before RoPE (any strides).
        positions: ``[T]`` int64 or int32 absolute positions, each in [0, ``cos_sin.shape[0]``) (any strides).
        cos_sin: ``[max_pos, 64]`` fp32, rows ``[cos 0..31 | sin 0..31]`` (the layer's table; any strides).
        weights: ``[T, n_ih]`` fp32 or bf16 head weights, from ``weights_proj(x)`` (see :func:`head_weights`).
        fmt: ``"fp8"`` or ``"mxfp4"``.
        hadamard: bool; rotate by H_128·128^-½ (fp32, then rounded to bf16 as DeepSeek's
            ``rotate_activation`` returns it) before quantising (the K side must match).
        backend: ``"auto"`` (= ``"triton"``), ``"reference"`` or ``"triton"``.
        launch: :class:`IndexerLaunch` (``quant_rows``), or None for the default.

    Returns:
        fp8: ``(q [T, n_ih, 128] float8_e4m3fn, None, weights_out [T, n_ih] fp32)`` where
        ``weights_out = w · 2^e · 128^-½ · n_ih^-½`` carries the per-(token, head) q scale 2^e.
        mxfp4: ``(q [T, n_ih, 64] uint8 packed (low nibble = even dim), scales [T, n_ih] int32 (4 UE8M0
        bytes, block 0 in the low byte), weights_out [T, n_ih] fp32 = w · 128^-½ · n_ih^-½)``, no fold.
        All outputs are contiguous and new; every NaN in ``weights_out`` is 0x7FC00000.

    Raises:
        TypeError / ValueError naming the argument. While value checks are on, a NaN or ±inf in ``index_q``,
        ``weights`` or the rows of ``cos_sin`` at ``positions`` raises ``ValueError("<arg>: non-finite ...")``.
        With ``DSV4REF_CHECK_VALUES=0`` a non-finite block (also one made by overflow in RoPE or the Hadamard)
        reads back as NaN on every backend: fp8 codes 0x7F (0xFF where the sign bit is set) and ``weights_out``
        NaN; mxfp4 scale byte 255 and codes 0x7 / 0xF (``docs/indexer.md#non-finite-input``).
    """
    backend = _backend(backend)
    launch = _launch_config(launch)
    _check_fmt(fmt)
    _check_flag(hadamard, "hadamard")
    validate.tensor(index_q, "index_q", dtype=torch.bfloat16, ndim=3)
    T, H, D = index_q.shape
    if D != HEAD_DIM or H < 1:
        raise ValueError(f"index_q: expected shape [T, n_ih >= 1, {HEAD_DIM}], got {tuple(index_q.shape)}")
    validate.tensor(positions, "positions", dtype=INDEX_DTYPES, shape=(T,))
    validate.tensor(cos_sin, "cos_sin", dtype=torch.float32, shape=(None, ROPE_DIM))
    validate.tensor(weights, "weights", dtype=(torch.float32, torch.bfloat16), shape=(T, H))
    validate.same_device(index_q=index_q, positions=positions, cos_sin=cos_sin, weights=weights)
    if _checking_values():
        validate.index_range(positions, "positions", cos_sin.shape[0], allow_minus_one=False)
        validate.finite(index_q, "index_q")
        validate.finite(weights, "weights")
        rows = cos_sin[positions.long()]
        if rows.numel() and not bool(rows.isfinite().all()):
            t = int((~rows.isfinite()).any(1).nonzero()[0])
            raise ValueError(f"cos_sin: non-finite values in row {int(positions[t])} (the position of token {t})")
    if backend == "reference":
        return reference.quantize_q(index_q, positions, cos_sin, weights, fmt=fmt, hadamard=hadamard)
    return _launch.quantize_q(index_q, positions, cos_sin, weights, fmt=fmt, hadamard=hadamard, launch=launch)


def dequantize_q(q: torch.Tensor, q_scales: torch.Tensor | None) -> torch.Tensor:
    """The values the logits see, fp32 ``[T, H, 128]`` (torch only; exact).

    Args:
        q, q_scales: what :func:`quantize_q` returned (q_scales None: fp8 codes, whose scale lives in the
            weights; else packed e2m1 with UE8M0 bytes, byte 0 read as 2^-127 and 255 as NaN).

    Returns:
        fp32 ``[T, H, 128]``."""
    if q_scales is None:
        validate.tensor(q, "q", dtype=torch.float8_e4m3fn, ndim=3)
    else:
        validate.tensor(q, "q", dtype=torch.uint8, shape=(None, None, HEAD_DIM // 2))
        validate.tensor(q_scales, "q_scales", dtype=torch.int32, shape=tuple(q.shape[:2]))
    return reference.dequantize_q(q, q_scales)


# ----------------------------------------------------------------------------------------------------
# the K cache
# ----------------------------------------------------------------------------------------------------


def _check_k_cache(cache: torch.Tensor, block_size: int, fmt: str) -> None:
    """The page holds exactly ``block_size`` keys of ``fmt`` (the SoA layout has no padding, so a cache of
    another block size or format is refused), rows of contiguous bytes, 4-byte aligned (fp32 scales)."""
    validate.tensor(cache, "k_cache", dtype=torch.uint8, ndim=2)
    need, per_key = k_page_bytes(block_size, fmt), k_page_bytes(1, fmt)
    if cache.shape[1] != need:
        held = f"{cache.shape[1] // per_key}" if cache.shape[1] % per_key == 0 else "no whole number of"
        raise ValueError(
            f"k_cache: pages of {cache.shape[1]} bytes hold {held} {fmt} keys ({per_key} B each), "
            f"but block_size={block_size} needs pages of exactly {need} bytes (a cache allocated for "
            f"another block size or format)"
        )
    if cache.stride(1) != 1 or cache.stride(0) % 4 or (cache.shape[0] > 1 and cache.stride(0) < cache.shape[1]):
        raise ValueError(
            f"k_cache: pages must be rows of contiguous bytes with a row stride that is a multiple of "
            f"4 and holds the page (strides {cache.stride()}, page {cache.shape[1]} bytes)"
        )
    if cache.data_ptr() % 4:
        raise ValueError(
            "k_cache: the first page must start at a 4-byte aligned address (fp32 scales); got a "
            f"view at storage offset {cache.storage_offset()}"
        )


def quantize_k(
    k: torch.Tensor, *, fmt: str = "fp8", hadamard: bool = False, backend: str = "auto", launch: IndexerLaunch | None = None
):
    """Quantise indexer keys (already RoPE'd at (p//4)·4 and bf16-rounded).

    Args:
        k: ``[N, 128]`` bf16 (any strides).
        fmt: ``"fp8"`` or ``"mxfp4"``.
        hadamard: bool; rotate (in fp32, then rounded to bf16, as DeepSeek does) before quantising; it
            must match the Q side.
        backend: ``"auto"`` (= ``"triton"``), ``"reference"`` or ``"triton"``.
        launch: :class:`IndexerLaunch` (``quant_rows``), or None for the default.

    Returns:
        fp8: ``(k [N, 128] float8_e4m3fn, scale [N] fp32 = 2^e)``;
        mxfp4: ``(packed [N, 64] uint8 (low nibble = even dim), scale bytes [N, 4] uint8)``.

    Raises:
        TypeError / ValueError naming the argument. While value checks are on, a NaN or ±inf in ``k`` raises
        ``ValueError("k: non-finite ...")``. With ``DSV4REF_CHECK_VALUES=0`` a non-finite row (fp8) or 32-block
        (mxfp4) reads back as NaN on every backend: fp8 codes 0x7F / 0xFF and the fp32 scale NaN; mxfp4 scale
        byte 255 and codes 0x7 / 0xF (``docs/indexer.md#non-finite-input``).
    """
    backend = _backend(backend)
    launch = _launch_config(launch)
    _check_fmt(fmt)
    _check_flag(hadamard, "hadamard")
    _check_k(k)
    if _checking_values():
        validate.finite(k, "k")
    if backend == "reference":
        return reference.quantize_k(k, fmt=fmt, hadamard=hadamard)
    return _launch.quantize_k(k, fmt=fmt, hadamard=hadamard, launch=launch)


def k_page_bytes(block_size: int, fmt: str = "fp8") -> int:
    """Bytes of one indexer-K page: ``block_size · 132`` (fp8) or ``· 68`` (mxfp4). No extra padding.

    Args:
        block_size: keys per page, an int >= 1.
        fmt: ``"fp8"`` or ``"mxfp4"``.

    Returns:
        int."""
    _check_fmt(fmt)
    return index_k_page_bytes(validate.integer(block_size, "block_size", lo=1), fmt)


def allocate_k_cache(num_blocks: int, block_size: int, fmt: str = "fp8", device=None) -> torch.Tensor:
    """A zeroed indexer-K cache.

    Args:
        num_blocks: pages, an int >= 0.
        block_size: keys per page, an int >= 1 (64 in DeepSeek-V4; any size works on every backend).
        fmt: ``"fp8"`` or ``"mxfp4"``.
        device: default :data:`dsv4ref.DEVICE`.

    Returns:
        uint8 ``[num_blocks, k_page_bytes(block_size, fmt)]``, contiguous.
    """
    num_blocks = validate.integer(num_blocks, "num_blocks", lo=0)
    return torch.zeros(num_blocks, k_page_bytes(block_size, fmt), dtype=torch.uint8, device=device or DEVICE)


def insert_k(
    k_cache: torch.Tensor,
    k: torch.Tensor,
    slots: torch.Tensor,
    *,
    block_size: int,
    fmt: str = "fp8",
    hadamard: bool = False,
    backend: str = "auto",
    launch: IndexerLaunch | None = None,
) -> None:
    """Quantise rows of ``k`` and write them at ``slots`` into the SoA pages, in place.

    Page layout, B = block_size::

        fp8:   [B × 128 e4m3 bytes][B × 4 bytes fp32 scale 2^e]     key j: values at 128·j, scale at 128·B + 4·j
        mxfp4: [B × 64 packed bytes][B × 4 UE8M0 bytes]             key j: values at 64·j,  scales at 64·B + 4·j

    Args:
        k_cache: uint8 ``[num_blocks, k_page_bytes(block_size, fmt)]`` exactly (a cache made for another block
            size or format is refused), rows of contiguous bytes, row stride a multiple of 4, 4-byte aligned
            (as from :func:`allocate_k_cache`, or a slice of pages of one).
        k: ``[N, 128]`` bf16 keys (any strides).
        slots: ``[S]`` int64 or int32 (any strides), S <= N, flat slots ``page · block_size + offset`` in
            [0, num_blocks · block_size), distinct; −1 = skip (row i of k goes to slots[i]; rows beyond S are
            padding and are not read for the non-finite check).
        block_size: keys per page (keyword, required), an int >= 1.
        fmt, hadamard, backend, launch: as in :func:`quantize_k`.

    Returns:
        None (``k_cache`` is written in place; bytes of other slots are untouched; a call that raises writes
        nothing).

    Raises:
        TypeError / ValueError naming the argument. While value checks are on: slots out of range or repeated,
        and a NaN or ±inf in a row of ``k`` that is written (``ValueError("k: non-finite ...")``). With
        ``DSV4REF_CHECK_VALUES=0`` such a key is written as :func:`quantize_k` encodes it (NaN on read back).
    """
    backend = _backend(backend)
    launch = _launch_config(launch)
    _check_fmt(fmt)
    _check_flag(hadamard, "hadamard")
    block_size = validate.integer(block_size, "block_size", lo=1)
    _check_k_cache(k_cache, block_size, fmt)
    _check_k(k)
    validate.tensor(slots, "slots", dtype=INDEX_DTYPES, ndim=1)
    validate.same_device(k_cache=k_cache, k=k, slots=slots)
    if slots.shape[0] > k.shape[0]:
        raise ValueError(f"slots: has {slots.shape[0]} entries but k only {k.shape[0]} rows")
    if _checking_values():
        validate.index_range(slots, "slots", k_cache.shape[0] * block_size)
        validate.distinct(slots, "slots")
        validate.finite(torch.where((slots >= 0)[:, None], k[: slots.shape[0]], 0), "k")  # the rows written
    if backend == "reference":
        return reference.insert_k(k_cache, k, slots, block_size=block_size, fmt=fmt, hadamard=hadamard)
    return _launch.insert_k(k_cache, k, slots, block_size=block_size, fmt=fmt, hadamard=hadamard, launch=launch)


def read_k(k_cache: torch.Tensor, slots: torch.Tensor, *, block_size: int, fmt: str = "fp8"):
    """Read records back (a byte gather; torch only).

    Args:
        k_cache: as in :func:`insert_k`.
        slots: ``[S]`` int64 or int32 flat slots, −1 = none.
        block_size: keys per page (keyword, required).
        fmt: ``"fp8"`` or ``"mxfp4"``.

    Returns:
        What :func:`quantize_k` returns for those rows: fp8 ``(k [S, 128] float8_e4m3fn, scale [S] fp32)``,
        mxfp4 ``(packed [S, 64] uint8, bytes [S, 4] uint8)``. Slots −1 give zero records.
    """
    _check_fmt(fmt)
    block_size = validate.integer(block_size, "block_size", lo=1)
    _check_k_cache(k_cache, block_size, fmt)
    validate.tensor(slots, "slots", dtype=INDEX_DTYPES, ndim=1)
    validate.same_device(k_cache=k_cache, slots=slots)
    if _checking_values():
        validate.index_range(slots, "slots", k_cache.shape[0] * block_size)
    return reference.read_k(k_cache, slots, block_size=block_size, fmt=fmt)


def dequantize_k(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 key values as the logits use them (torch only; exact).

    Args:
        values, scales: what :func:`read_k` or :func:`quantize_k` returned: fp8 ``(codes [S, 128]
            float8_e4m3fn, scale [S] fp32)`` (the codes' values; the scale is applied after the head sum), or
            mxfp4 ``(packed [S, 64] uint8, UE8M0 bytes [S, 4] uint8)`` (byte 0 reads 2^-127, 255 NaN).

    Returns:
        fp32 ``[S, 128]``."""
    validate.tensor(values, "values", dtype=(torch.float8_e4m3fn, torch.uint8), ndim=2)
    if values.dtype == torch.uint8:
        validate.tensor(values, "values", shape=(None, HEAD_DIM // 2))
        validate.tensor(scales, "scales", dtype=torch.uint8, shape=(values.shape[0], 4))
    return reference.dequantize_k(values, scales)
