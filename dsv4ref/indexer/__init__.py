"""The lightning indexer of DeepSeek-V4's ratio-4 (C4A) layers: which compressed rows each query reads.

The math and the byte layouts: ``docs/indexer.md``. A decode token at position p can see
n_c = (p+1)//4 compressed rows; the indexer scores every one of them cheaply and keeps the top k::

    I[t, s] = Σ_h w_out[t, h] · ReLU(⟨q_fp8[t, h], k_fp8[s]⟩) · k_scale[s]     s < (p_t + 1) // 4
            = −∞                                                           otherwise

The pieces, each with ``backend="reference"`` (plain torch, :mod:`.reference`) and ``"triton"``
(:mod:`.kernels`, launched by :mod:`.launch`); ``"auto"`` is ``"triton"``:

* :func:`quantize_q` — the fused indexer-Q: GPT-J RoPE on dims 64..127, bf16 round trip, optional
  Hadamard, then FP8 (one UE8M0 scale per (token, head), FOLDED into the head weights) or MXFP4
  (4 blocks of 32, scales packed into one int32, no fold). Registered as torch custom ops.
* :func:`quantize_k`, :func:`insert_k`, :func:`read_k` — the indexer K cache: SoA pages of
  ``[B × 128 e4m3][B × 4 B fp32 scale]`` (132 B/key) or ``[B × 64 packed e2m1][B × 4 UE8M0]`` (68 B/key).
* :func:`logits` — the scores above over a paged cache, −∞ beyond each token's complete windows.
* :func:`topk` — local ids of the k best rows, −1 padded, with the short-context shortcut;
  :func:`select` does logits + top-k, skipping the logits when the shortcut applies.
* :func:`to_global` — local ids → slots of the main compressed cache, and topk_len.
* :func:`example_inputs`, :func:`cos_sin_table` — small consistent problems for tests and notebooks.

Why one module of this length: about 290 statements, most of them the argument checks and docstrings of
the public functions (each one's shapes, dtypes and errors); the math is in ``reference.py`` and ``mxfp4.py``.
"""

from __future__ import annotations

import torch

from .. import validate
from ..device import DEVICE, HOST
from ..formats import FP8_K_RECORD, INDEX_HEAD_DIM, INDEX_K_FORMATS, INDEX_ROPE_DIM, MXFP4_K_RECORD, index_k_page_bytes
from ..seeded import generator, randn
from . import launch as _launch
from . import reference
from .launch import IndexerLaunch, default_launch

__all__ = [
    "HEAD_DIM",
    "ROPE_DIM",
    "FP8_RECORD",
    "MXFP4_RECORD",
    "FMTS",
    "SUPPORTED_BACKENDS",
    "IndexerLaunch",
    "default_launch",
    "head_weights",
    "quantize_q",
    "dequantize_q",
    "quantize_k",
    "k_page_bytes",
    "allocate_k_cache",
    "insert_k",
    "read_k",
    "dequantize_k",
    "n_compressed",
    "logits",
    "topk",
    "short_context_topk",
    "select",
    "to_global",
    "cos_sin_table",
    "example_inputs",
]

HEAD_DIM = INDEX_HEAD_DIM  # d_ih = 128
ROPE_DIM = INDEX_ROPE_DIM  # the LAST 64 dims (64..127) are rotated, GPT-J pairs (2i, 2i+1)
FP8_RECORD = FP8_K_RECORD  # 132 B per key: 128 e4m3 + fp32 scale 2^e
MXFP4_RECORD = MXFP4_K_RECORD  # 68 B per key: 64 packed bytes + 4 UE8M0 bytes
FMTS = INDEX_K_FORMATS  # ("fp8", "mxfp4")
SUPPORTED_BACKENDS = ("reference", "triton")  # the subset of validate.BACKENDS this op supports ("auto" = "triton")


# ----------------------------------------------------------------------------------------------------
# argument checks (docs/indexer.md#the-input-contract)
# ----------------------------------------------------------------------------------------------------

INDEX_DTYPES = (torch.int64, torch.int32)


def _backend(backend: str) -> str:
    return validate.backend(backend, SUPPORTED_BACKENDS, auto="triton")


def _launch_config(launch: IndexerLaunch | None) -> IndexerLaunch:
    if launch is None:
        return default_launch()
    if not isinstance(launch, IndexerLaunch):
        raise TypeError(f"launch: expected an IndexerLaunch or None, got {type(launch).__name__}")
    return launch


def _check_fmt(fmt: str) -> str:
    if not isinstance(fmt, str):
        raise TypeError(f"fmt: expected a str, one of {FMTS}, got {type(fmt).__name__}")
    if fmt not in FMTS:
        raise ValueError(f"fmt: expected one of {FMTS}, got {fmt!r}")
    return fmt


def _check_flag(v, name: str) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__} {v!r}")
    return v


def _checking_values() -> bool:
    """Value checks read tensors (a sync, and a graph break under torch.compile): on unless
    ``DSV4REF_CHECK_VALUES=0`` (read at call time, :func:`dsv4ref.validate.check_values`) or compiling."""
    return validate.check_values() and not torch.compiler.is_compiling()


def _check_k(k: torch.Tensor) -> None:
    validate.tensor(k, "k", dtype=torch.bfloat16, ndim=2)
    if k.shape[1] != HEAD_DIM:
        raise ValueError(f"k: expected shape [N, {HEAD_DIM}], got {tuple(k.shape)}")


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


def _check_nan_codes(q: torch.Tensor, q_scales: torch.Tensor | None, weights_out: torch.Tensor) -> None:
    """Checks on: the quantised query holds no NaN (e4m3 codes 0x7F / 0xFF, UE8M0 byte 255) and finite weights."""
    if q_scales is None:
        bad = (q.view(torch.uint8) & 0x7F) == 0x7F
        if bool(bad.any()):
            raise ValueError(
                f"q: non-finite values (e4m3 NaN codes; the first at index "
                f"{tuple(bad.nonzero()[0].tolist())}): quantize_q wrote a NaN row"
            )
    elif bool((q_scales.contiguous().view(torch.uint8) == 255).any()):
        i = tuple((q_scales.contiguous().view(torch.uint8).view(*q_scales.shape, 4) == 255).nonzero()[0].tolist())
        raise ValueError(f"q_scales: non-finite values (UE8M0 byte 255 = NaN at [t, h, block] {i})")
    validate.finite(weights_out, "weights_out")


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


# ----------------------------------------------------------------------------------------------------
# logits, top-k, local -> global
# ----------------------------------------------------------------------------------------------------


def n_compressed(positions: torch.Tensor) -> torch.Tensor:
    """n_c(p) = (p + 1) // 4: the complete ratio-4 windows visible at position p (``docs/indexer.md#the-causal-mask``).

    Args:
        positions: int64 or int32 tensor, any shape.

    Returns:
        int64, the shape of ``positions``."""
    validate.tensor(positions, "positions", dtype=INDEX_DTYPES)
    return reference.n_compressed(positions)


def head_weights(x: torch.Tensor, weights_proj: torch.Tensor) -> torch.Tensor:
    """The head weights w = x · W_wᵀ (fp32), from the attention INPUT x (never the q-LoRA latent qr).

    Args:
        x: ``[T, hidden]`` float (bf16 / fp32 / fp16).
        weights_proj: ``[n_ih, hidden]`` float.

    Returns:
        fp32 ``[T, n_ih]``."""
    validate.tensor(x, "x", dtype=(torch.bfloat16, torch.float32, torch.float16), ndim=2)
    validate.tensor(weights_proj, "weights_proj", dtype=(torch.bfloat16, torch.float32, torch.float16), ndim=2)
    if x.shape[1] != weights_proj.shape[1]:
        raise ValueError(
            f"x: expected width {weights_proj.shape[1]} (weights_proj's input: the attention input x, "
            f"not qr), got shape {tuple(x.shape)}"
        )
    validate.same_device(x=x, weights_proj=weights_proj)
    return reference.head_weights(x, weights_proj)


def logits(
    q: torch.Tensor,
    q_scales: torch.Tensor | None,
    weights_out: torch.Tensor,
    k_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    block_size: int,
    block_table: torch.Tensor | None = None,
    n_out: int | None = None,
    backend: str = "auto",
    launch: IndexerLaunch | None = None,
) -> torch.Tensor:
    """Indexer scores: Σ_h w_out·ReLU(⟨q_h, k_s⟩)(·k_scale_s), −∞ for s ≥ (p+1)//4.

    Args:
        q, q_scales, weights_out: what :func:`quantize_q` returned (q_scales None ⇒ fp8, else mxfp4); any
            strides.
        k_cache: the indexer-K pages of the matching format and block size (:func:`insert_k`; pages of exactly
            ``k_page_bytes(block_size, fmt)`` bytes).
        positions: ``[T]`` int64 or int32 positions, >= 0; token t sees n_c = (p+1)//4 local rows.
        block_size: keys per page (keyword, required), an int >= 1 (64 in DSV4).
        block_table: ``[T, max_pages]`` int32 or int64 (any strides), row t = the compressed block table of
            token t's request (local row l lives in page ``block_table[t, l // block_size]``, which must be a
            page of ``k_cache`` for every row read). None: page i holds rows ``i·block_size ..`` for every token.
        n_out: columns of the output, an int >= 0 (default: the largest n_c in the batch).
        backend: ``"auto"`` (= ``"triton"``), ``"reference"`` (float64 from the decoded codes, rounded once to fp32; MXFP4:
            at DeepSeek's bf16 points) or ``"triton"``.
        launch: :class:`IndexerLaunch` (``logits_pages``, ``logits_warps``, ``fp4_decode``), or None.

    Returns:
        ``[T, n_out]`` fp32, contiguous; −∞ in the masked columns. MXFP4 scores hold bf16 values: each
        head's dot, its product with the weight and the head sum are rounded to bf16, as DeepSeek's bf16
        einsum does (``docs/indexer.md#rounding-points``). NaN in, NaN out: a score whose inputs
        hold a NaN (a NaN code or UE8M0 byte 255 in a key of the cache, an infinite weight times a zero) is
        NaN on every backend.

    Raises:
        TypeError / ValueError naming the argument. With value checks on, NaN codes in ``q`` (e4m3 0x7F /
        0xFF), UE8M0 byte 255 in ``q_scales`` and non-finite ``weights_out`` raise ``ValueError``; the cache's
        bytes are not scanned (that would read the whole cache again).
    """
    backend = _backend(backend)
    launch = _launch_config(launch)
    fmt = "fp8" if q_scales is None else "mxfp4"
    validate.tensor(q, "q", dtype=torch.float8_e4m3fn if fmt == "fp8" else torch.uint8, ndim=3)
    T, H, Dq = q.shape
    if Dq != (HEAD_DIM if fmt == "fp8" else HEAD_DIM // 2):
        raise ValueError(f"q: expected [T, n_ih, {HEAD_DIM if fmt == 'fp8' else HEAD_DIM // 2}] for {fmt}, got {tuple(q.shape)}")
    if q_scales is not None:
        validate.tensor(q_scales, "q_scales", dtype=torch.int32, shape=(T, H))
    validate.tensor(weights_out, "weights_out", dtype=torch.float32, shape=(T, H))
    validate.tensor(positions, "positions", dtype=INDEX_DTYPES, shape=(T,))
    block_size = validate.integer(block_size, "block_size", lo=1)
    _check_k_cache(k_cache, block_size, fmt)
    if block_table is not None:
        validate.tensor(block_table, "block_table", dtype=INDEX_DTYPES, ndim=2)
        if block_table.shape[0] != T:
            raise ValueError(f"block_table: expected one row per token ({T}), got shape {tuple(block_table.shape)}")
    if n_out is not None:
        n_out = validate.integer(n_out, "n_out", lo=0)
    validate.same_device(
        q=q, q_scales=q_scales, weights_out=weights_out, k_cache=k_cache, positions=positions, block_table=block_table
    )
    n_c = reference.n_compressed(positions)
    if _checking_values() and T:
        if bool((positions < 0).any()):
            raise ValueError(f"positions: expected non-negative positions, got {int(positions.min())}")
        _check_nan_codes(q, q_scales, weights_out)
    if n_out is None:
        n_out = int(n_c.max()) if T else 0
    if block_table is None:
        n_pages = max(1, -(-n_out // block_size))
        block_table = torch.arange(n_pages, dtype=torch.int32, device=q.device).expand(T, n_pages)
    if _checking_values() and T:
        pages_read = -(-n_c.clamp(max=n_out) // block_size)  # per token: the pages holding rows < min(n_c, n_out)
        if block_table.shape[1] < int(pages_read.max()):
            raise ValueError(
                f"block_table: {block_table.shape[1]} columns cannot address n_c = {int(n_c.max())} "
                f"rows of {block_size} per page ({int(pages_read.max())} needed)"
            )
        used = torch.arange(block_table.shape[1], device=q.device)[None, :] < pages_read[:, None]
        validate.index_range(block_table[used], "block_table", k_cache.shape[0], allow_minus_one=False)
    if backend == "reference":
        return reference.logits(
            q,
            q_scales,
            weights_out,
            k_cache,
            positions,
            block_table,
            block_size=block_size,
            n_out=n_out,
            dtype=torch.float64,
            bf16_scores=fmt == "mxfp4",
        ).float()
    return _launch.logits(q, q_scales, weights_out, k_cache, positions, block_table, block_size, n_out, launch)


def topk(
    logits: torch.Tensor | None, k: int, *, positions: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Local ids of the k largest logits per row; −∞ entries and missing columns → −1 (torch only).

    Order within a row carries no meaning (attention is one softmax); ties are broken by torch.topk.
    Short-context shortcut: if ``positions`` is given and max n_c ≤ k, the logits are not read at all
    (they may be None) and the result is ``[0 … n_c−1, −1 …]``, the same set as the full path.

    Args:
        logits: ``[T, n]`` fp32 (from :func:`logits`; any strides), or None when the shortcut applies. +∞ is a
            score like any other (it ranks first); −∞ means "not visible".
        k: ids per row, an int >= 1.
        positions: ``[T]`` int64 or int32, enables the shortcut.
        out: an optional ``[T, k]`` int32 buffer (any strides), reset to −1 on every call that does not raise.

    Returns:
        int32 ``[T, k]`` (``out`` when given).

    Raises:
        TypeError / ValueError naming the argument. A NaN score has no rank: with value checks on it raises
        ``ValueError("logits: NaN ...")``; with ``DSV4REF_CHECK_VALUES=0`` it ranks like −∞ (never selected,
        reported as −1).
    """
    k = validate.integer(k, "k", lo=1)
    if positions is not None:
        validate.tensor(positions, "positions", dtype=INDEX_DTYPES, ndim=1)
    if logits is None and positions is None:
        raise ValueError("logits: may be None only when positions are given (the short-context shortcut)")
    if logits is not None:
        validate.tensor(logits, "logits", dtype=torch.float32, ndim=2)
    T = logits.shape[0] if logits is not None else positions.shape[0]
    if positions is not None and positions.shape[0] != T:
        raise ValueError(f"positions: expected {T} entries (one per logits row), got {positions.shape[0]}")
    if out is not None:
        validate.tensor(out, "out", dtype=torch.int32, shape=(T, k))
    validate.same_device(logits=logits, positions=positions, out=out)
    shortcut = positions is not None and (T == 0 or int(reference.n_compressed(positions).max()) <= k)
    if not shortcut:
        if logits is None:
            raise ValueError(f"logits: needed, because some n_c exceeds k={k} (no shortcut)")
        if _checking_values() and bool(logits.isnan().any()):
            t, s = logits.isnan().nonzero()[0].tolist()
            raise ValueError(f"logits: NaN score at [{t}, {s}] (a NaN in q, weights_out or the K cache); a NaN has no rank")
    return reference.topk(logits, k, positions=positions, out=out)


def short_context_topk(positions: torch.Tensor, k: int) -> torch.Tensor:
    """The shortcut alone: row t = ``[0, 1, …, n_c(t)−1, −1, …]`` (width k), int32; valid when every n_c ≤ k.

    Args:
        positions: ``[T]`` int64 or int32.
        k: an int >= 1.

    Returns:
        int32 ``[T, k]``."""
    validate.tensor(positions, "positions", dtype=INDEX_DTYPES, ndim=1)
    return reference.short_context_topk(positions, validate.integer(k, "k", lo=1))


def select(
    q: torch.Tensor,
    q_scales: torch.Tensor | None,
    weights_out: torch.Tensor,
    k_cache: torch.Tensor,
    positions: torch.Tensor,
    k: int,
    *,
    block_size: int,
    block_table: torch.Tensor | None = None,
    backend: str = "auto",
    launch: IndexerLaunch | None = None,
) -> torch.Tensor:
    """:func:`logits` + :func:`topk`, skipping the logits when every token sees at most k rows (the shortcut).

    Args: as in :func:`logits` and :func:`topk`.

    Returns:
        int32 ``[T, k]`` local ids, −1 padded.
    """
    validate.tensor(positions, "positions", dtype=INDEX_DTYPES, ndim=1)
    k = validate.integer(k, "k", lo=1)
    if positions.shape[0] and int(reference.n_compressed(positions).max()) <= k:
        return topk(None, k, positions=positions)
    lg = logits(
        q,
        q_scales,
        weights_out,
        k_cache,
        positions,
        block_table=block_table,
        block_size=block_size,
        backend=backend,
        launch=launch,
    )
    return topk(lg, k, positions=positions)


def to_global(
    topk_local: torch.Tensor, block_table: torch.Tensor, slots: torch.Tensor | None = None, *, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local compressed ids → slots of the MAIN compressed KV cache, and the per-token counts (torch only).

    ``global = block_table[t, l // B]·B + l % B`` (int64: no wrap past 2^31) for l ≥ 0, else −1;
    ``topk_len[t]`` = the number of slots ≥ 0 in row t, 0 (and the row all −1) for an invalid token
    (``slots[t] == −1``).

    Args:
        topk_local: ``[T, k]`` int32 or int64 local ids, −1 = none, each < ``max_pages · block_size``.
        block_table: ``[T, max_pages]`` int32 or int64, one row per token (its request's row of the main
            compressed cache); an entry is a page >= 0, or −1 for an unmapped page (ids in it map to −1).
        slots: optional ``[T]`` int64 or int32, each token's own cache slot (>= 0), −1 marks an invalid
            (padding) token.
        block_size: keys per page of the main compressed cache (keyword, required), an int >= 1.

    Returns:
        ``(global_slots [T, k] int64, topk_len [T] int32)``.

    Raises:
        TypeError / ValueError naming the argument. With value checks on: ids outside [−1, max_pages·B),
        page entries < −1 under a selected id, and ``slots`` entries < −1. With checks off those map to −1.
    """
    validate.tensor(topk_local, "topk_local", dtype=INDEX_DTYPES, ndim=2)
    validate.tensor(block_table, "block_table", dtype=INDEX_DTYPES, ndim=2)
    T = topk_local.shape[0]
    if block_table.shape[0] != T:
        raise ValueError(f"block_table: expected one row per token ({T}), got shape {tuple(block_table.shape)}")
    if slots is not None:
        validate.tensor(slots, "slots", dtype=INDEX_DTYPES, shape=(T,))
    block_size = validate.integer(block_size, "block_size", lo=1)
    validate.same_device(topk_local=topk_local, block_table=block_table, slots=slots)
    if _checking_values():
        validate.index_range(topk_local, "topk_local", block_table.shape[1] * block_size)
        if slots is not None and bool((slots < -1).any()):
            raise ValueError(f"slots: expected a slot >= 0 or -1 (invalid token), got {int(slots.min())}")
        sel = topk_local.long()
        if block_table.shape[1] and bool((sel >= 0).any()):
            pages = torch.gather(block_table.long(), 1, (sel.clamp_min(0) // block_size))[sel >= 0]
            if bool((pages < -1).any()):
                raise ValueError(
                    f"block_table: page entry {int(pages.min())} under a selected id; expected a page >= 0 or -1 (unmapped)"
                )
    return reference.to_global(topk_local, block_table, slots, block_size=block_size)


# ----------------------------------------------------------------------------------------------------
# example inputs (tests, notebooks, checks)
# ----------------------------------------------------------------------------------------------------


def cos_sin_table(max_pos: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """A plain (no YaRN) table for demos and checks; the model's tables come from :mod:`dsv4ref.rope`.

    Args:
        max_pos: rows, an int >= 0.
        theta: the RoPE base, a finite number > 0.
        device: default :data:`dsv4ref.DEVICE`.

    Returns:
        fp32 ``[max_pos, 64] = [cos f_0..f_31 | sin f_0..f_31]``.
    """
    max_pos = validate.integer(max_pos, "max_pos", lo=0)
    theta = validate.scalar(theta, "theta", lo=0.0)
    if theta == 0:
        raise ValueError("theta: expected a number > 0, got 0.0")
    inv = theta ** (-torch.arange(0, ROPE_DIM, 2, dtype=torch.float32, device=HOST) / ROPE_DIM)
    f = torch.arange(max_pos, dtype=torch.float32, device=HOST)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=1).to(device or DEVICE)


def example_inputs(
    T: int,
    H: int,
    n_keys: int,
    *,
    block_size: int,
    fmt: str = "fp8",
    hadamard: bool = False,
    seed: int = 0,
    positions: torch.Tensor | None = None,
) -> dict:
    """A small consistent problem: queries, weights, a shuffled paged K cache, per-token block tables.

    Returns:
        dict with ``index_q`` [T, H, 128] bf16, ``positions`` [T] int64 (token 0 sees every key),
        ``cos_sin`` [4·n_keys+8, 64] fp32, ``weights`` [T, H] fp32, ``k`` [n_keys, 128] bf16 (the keys before
        quantisation), ``k_cache`` (the keys inserted in ``fmt``, with ``hadamard``), ``block_table``
        [T, pages] int32 (one request: the same shuffled row for every token), ``block_size`` and
        ``slots`` [n_keys] int64 (where key s went).
    """
    T, H = validate.integer(T, "T", lo=1), validate.integer(H, "H", lo=1)
    n_keys, block_size = validate.integer(n_keys, "n_keys", lo=1), validate.integer(block_size, "block_size", lo=1)
    g = generator(validate.integer(seed, "seed"))
    cs = cos_sin_table(4 * n_keys + 8)
    index_q = randn((T, H, HEAD_DIM), seed=seed, block=32, octaves=8)
    w = randn((T, H), seed=seed + 1, dtype=torch.float32, block=None, octaves=4)
    if positions is None:
        positions = 4 * n_keys - 1 - torch.randint(0, 4 * n_keys // 2, (T,), generator=g, device=HOST)
        positions[0] = 4 * n_keys - 1  # one token sees every key
    positions = positions.to(torch.int64).to(DEVICE)
    n_pages = -(-n_keys // block_size)
    perm = torch.randperm(n_pages + 2, generator=g, device=HOST)[:n_pages]
    bt = perm.to(torch.int32).expand(T, n_pages).contiguous().to(DEVICE)
    k = randn((n_keys, HEAD_DIM), seed=seed + 2, block=32, octaves=8)
    cache = allocate_k_cache(n_pages + 2, block_size, fmt)
    s = torch.arange(n_keys, device=HOST)
    slots = (perm[s // block_size] * block_size + s % block_size).to(DEVICE)
    insert_k(cache, k, slots, block_size=block_size, fmt=fmt, hadamard=hadamard)
    return dict(
        index_q=index_q,
        positions=positions,
        cos_sin=cs,
        weights=w,
        k=k,
        k_cache=cache,
        block_table=bt,
        block_size=block_size,
        slots=slots,
    )
