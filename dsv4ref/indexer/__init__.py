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
"""

from __future__ import annotations

import torch

from .. import validate
from ..device import DEVICE
from ..formats import FP8_K_RECORD, INDEX_HEAD_DIM, INDEX_K_FORMATS, INDEX_ROPE_DIM, MXFP4_K_RECORD, index_k_page_bytes
from ..testing import generator, randn
from . import launch as _launch
from . import reference
from .launch import IndexerLaunch
from .reference import dequantize_k, dequantize_q, head_weights, n_compressed, short_context_topk

__all__ = [
    "HEAD_DIM", "ROPE_DIM", "FP8_RECORD", "MXFP4_RECORD", "FMTS", "BACKENDS", "IndexerLaunch",
    "head_weights", "quantize_q", "dequantize_q", "quantize_k", "k_page_bytes", "allocate_k_cache", "insert_k",
    "read_k", "dequantize_k", "n_compressed", "logits", "topk", "short_context_topk", "select", "to_global",
    "cos_sin_table", "example_inputs",
]

HEAD_DIM = INDEX_HEAD_DIM  # d_ih = 128
ROPE_DIM = INDEX_ROPE_DIM  # the LAST 64 dims (64..127) are rotated, GPT-J pairs (2i, 2i+1)
FP8_RECORD = FP8_K_RECORD  # 132 B per key: 128 e4m3 + fp32 scale 2^e
MXFP4_RECORD = MXFP4_K_RECORD  # 68 B per key: 64 packed bytes + 4 UE8M0 bytes
FMTS = INDEX_K_FORMATS  # ("fp8", "mxfp4")
BACKENDS = ("reference", "triton")  # the subset of validate.BACKENDS this op supports ("auto" = "triton")


# ----------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------


def _backend(backend: str) -> str:
    return validate.backend(backend, BACKENDS, auto="triton")


def _launch_config(launch: IndexerLaunch | None) -> IndexerLaunch:
    if launch is None:
        return _launch.DEFAULT
    if not isinstance(launch, IndexerLaunch):
        raise TypeError(f"launch: expected an IndexerLaunch or None, got {type(launch).__name__}")
    return launch


def _check_fmt(fmt: str) -> str:
    if fmt not in FMTS:
        raise ValueError(f"fmt: expected one of {FMTS}, got {fmt!r}")
    return fmt


def _checking_values() -> bool:
    """Value checks read tensors (a sync, and a graph break under torch.compile): skip them when compiling."""
    return not torch.compiler.is_compiling()


def _check_k(k: torch.Tensor) -> None:
    validate.tensor(k, "k", dtype=torch.bfloat16, ndim=2)
    if k.shape[1] != HEAD_DIM:
        raise ValueError(f"k: expected shape [N, {HEAD_DIM}], got {tuple(k.shape)}")


def _check_k_cache(cache: torch.Tensor, block_size: int, fmt: str) -> None:
    validate.tensor(cache, "k_cache", dtype=torch.uint8, ndim=2)
    need = k_page_bytes(block_size, fmt)
    if cache.shape[1] < need:
        raise ValueError(f"k_cache: pages of {cache.shape[1]} bytes cannot hold block_size={block_size} {fmt} keys "
                         f"({need} bytes needed)")
    if cache.stride(1) != 1 or cache.stride(0) < cache.shape[1] or cache.stride(0) % 4:
        raise ValueError(f"k_cache: pages must be contiguous bytes with a stride that is a multiple of 4 "
                         f"(strides {cache.stride()})")


# ----------------------------------------------------------------------------------------------------
# the query path
# ----------------------------------------------------------------------------------------------------


def quantize_q(index_q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, weights: torch.Tensor, *,
               fmt: str = "fp8", hadamard: bool = False, backend: str = "auto", launch: IndexerLaunch | None = None):
    """The fused indexer-Q: RoPE + bf16 round trip (+ Hadamard) + FP8 or MXFP4 quantisation + weight fold.

    Args:
        index_q: ``[T, n_ih, 128]`` bf16, the indexer queries ``wq_b(qr)`` before RoPE (any strides).
        positions: ``[T]`` int64 or int32 absolute positions, each < ``cos_sin.shape[0]``.
        cos_sin: ``[max_pos, 64]`` fp32, rows ``[cos 0..31 | sin 0..31]`` (the layer's table).
        weights: ``[T, n_ih]`` fp32 or bf16 head weights, from ``weights_proj(x)`` (see :func:`head_weights`).
        fmt: ``"fp8"`` or ``"mxfp4"``.
        hadamard: rotate by H_128·128^-½ before quantising (the K side must match).
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.
        launch: :class:`IndexerLaunch` (``quant_rows``), or None for the default.

    Returns:
        fp8: ``(q [T, n_ih, 128] float8_e4m3fn, None, weights_out [T, n_ih] fp32)`` where
        ``weights_out = w · 2^e · 128^-½ · n_ih^-½`` carries the per-(token, head) q scale 2^e.
        mxfp4: ``(q [T, n_ih, 64] uint8 packed (low nibble = even dim), scales [T, n_ih] int32 (4 UE8M0
        bytes, block 0 in the low byte), weights_out [T, n_ih] fp32 = w · 128^-½ · n_ih^-½)``, no fold.
        All outputs are contiguous and new.
    """
    backend = _backend(backend)
    launch = _launch_config(launch)
    _check_fmt(fmt)
    validate.tensor(index_q, "index_q", dtype=torch.bfloat16, ndim=3)
    T, H, D = index_q.shape
    if D != HEAD_DIM:
        raise ValueError(f"index_q: expected head dim {HEAD_DIM} (shape [T, n_ih, 128]), got shape {tuple(index_q.shape)}")
    validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32), shape=(T,))
    validate.tensor(cos_sin, "cos_sin", dtype=torch.float32, shape=(None, ROPE_DIM))
    validate.tensor(weights, "weights", dtype=(torch.float32, torch.bfloat16), shape=(T, H))
    validate.same_device(index_q=index_q, positions=positions, cos_sin=cos_sin, weights=weights)
    if _checking_values():
        validate.index_range(positions, "positions", cos_sin.shape[0], allow_minus_one=False)
    if backend == "reference":
        return reference.quantize_q(index_q, positions, cos_sin, weights, fmt=fmt, hadamard=hadamard)
    return _launch.quantize_q(index_q, positions, cos_sin, weights, fmt=fmt, hadamard=hadamard, launch=launch)


# ----------------------------------------------------------------------------------------------------
# the K cache
# ----------------------------------------------------------------------------------------------------


def quantize_k(k: torch.Tensor, *, fmt: str = "fp8", hadamard: bool = False, backend: str = "auto",
               launch: IndexerLaunch | None = None):
    """Quantise indexer keys (already RoPE'd at (p//4)·4 and bf16-rounded).

    Args:
        k: ``[N, 128]`` bf16 (any strides).
        fmt: ``"fp8"`` or ``"mxfp4"``.
        hadamard: rotate (in fp32) before quantising; it must match the Q side.
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.
        launch: :class:`IndexerLaunch` (``quant_rows``), or None for the default.

    Returns:
        fp8: ``(k [N, 128] float8_e4m3fn, scale [N] fp32 = 2^e)``;
        mxfp4: ``(packed [N, 64] uint8 (low nibble = even dim), scale bytes [N, 4] uint8)``.
    """
    backend = _backend(backend)
    launch = _launch_config(launch)
    _check_fmt(fmt)
    _check_k(k)
    if backend == "reference":
        return reference.quantize_k(k, fmt=fmt, hadamard=hadamard)
    return _launch.quantize_k(k, fmt=fmt, hadamard=hadamard, launch=launch)


def k_page_bytes(block_size: int, fmt: str = "fp8") -> int:
    """Bytes of one indexer-K page: ``block_size · 132`` (fp8) or ``· 68`` (mxfp4). No extra padding.

    Returns:
        int."""
    _check_fmt(fmt)
    return index_k_page_bytes(block_size, fmt)


def allocate_k_cache(num_blocks: int, block_size: int, fmt: str = "fp8", device=None) -> torch.Tensor:
    """A zeroed indexer-K cache.

    Args:
        num_blocks: pages.
        block_size: keys per page (64 in DeepSeek-V4; a power of two >= 16 for :func:`logits`' kernel).
        fmt: ``"fp8"`` or ``"mxfp4"``.
        device: default :data:`dsv4ref.DEVICE`.

    Returns:
        uint8 ``[num_blocks, k_page_bytes(block_size, fmt)]``, contiguous.
    """
    return torch.zeros(num_blocks, k_page_bytes(block_size, fmt), dtype=torch.uint8, device=device or DEVICE)


def insert_k(k_cache: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, *, block_size: int, fmt: str = "fp8",
             hadamard: bool = False, backend: str = "auto", launch: IndexerLaunch | None = None) -> None:
    """Quantise rows of ``k`` and write them at ``slots`` into the SoA pages, in place.

    Page layout, B = block_size::

        fp8:   [B × 128 e4m3 bytes][B × 4 bytes fp32 scale 2^e]     key j: values at 128·j, scale at 128·B + 4·j
        mxfp4: [B × 64 packed bytes][B × 4 UE8M0 bytes]             key j: values at 64·j,  scales at 64·B + 4·j

    Args:
        k_cache: uint8 ``[num_blocks, >= k_page_bytes(block_size, fmt)]``, rows contiguous, row stride a
            multiple of 4 (as from :func:`allocate_k_cache`).
        k: ``[N, 128]`` bf16 keys.
        slots: ``[S]`` int64 or int32, S <= N, flat slots ``page · block_size + offset``; −1 = skip (row i
            of k goes to slots[i]; rows beyond S are padding).
        block_size: keys per page (keyword, required).
        fmt, hadamard, backend, launch: as in :func:`quantize_k`.

    Returns:
        None (``k_cache`` is written in place; bytes of other slots are untouched).
    """
    backend = _backend(backend)
    launch = _launch_config(launch)
    _check_fmt(fmt)
    _check_k_cache(k_cache, block_size, fmt)
    _check_k(k)
    validate.tensor(slots, "slots", dtype=(torch.int64, torch.int32), ndim=1)
    validate.same_device(k_cache=k_cache, k=k, slots=slots)
    if slots.shape[0] > k.shape[0]:
        raise ValueError(f"slots: has {slots.shape[0]} entries but k only {k.shape[0]} rows")
    validate.index_range(slots, "slots", k_cache.shape[0] * block_size)
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
    _check_k_cache(k_cache, block_size, fmt)
    validate.tensor(slots, "slots", dtype=(torch.int64, torch.int32), ndim=1)
    validate.index_range(slots, "slots", k_cache.shape[0] * block_size)
    return reference.read_k(k_cache, slots, block_size=block_size, fmt=fmt)


# ----------------------------------------------------------------------------------------------------
# logits, top-k, local -> global
# ----------------------------------------------------------------------------------------------------


def logits(q: torch.Tensor, q_scales: torch.Tensor | None, weights_out: torch.Tensor, k_cache: torch.Tensor,
           positions: torch.Tensor, *, block_size: int, block_table: torch.Tensor | None = None,
           n_out: int | None = None, backend: str = "auto", launch: IndexerLaunch | None = None) -> torch.Tensor:
    """Indexer scores: Σ_h w_out·ReLU(⟨q_h, k_s⟩)(·k_scale_s), −∞ for s ≥ (p+1)//4.

    Args:
        q, q_scales, weights_out: what :func:`quantize_q` returned (q_scales None ⇒ fp8, else mxfp4).
        k_cache: the indexer-K pages of the matching format (:func:`insert_k`).
        positions: ``[T]`` int64 or int32 positions, >= 0; token t sees n_c = (p+1)//4 local rows.
        block_size: keys per page (keyword, required), a power of two >= 16 for the Triton kernel (64 in DSV4).
        block_table: ``[T, max_pages]`` int32, row t = the compressed block table of token t's request
            (local row l lives in page ``block_table[t, l // block_size]``). None: page i holds rows
            ``i·block_size ..`` for every token (one request).
        n_out: columns of the output (default: the largest n_c in the batch).
        backend: ``"auto"``, ``"reference"`` (float64 from the decoded codes, rounded once to fp32) or
            ``"triton"``.
        launch: :class:`IndexerLaunch` (``logits_pages``), or None for the default.

    Returns:
        ``[T, n_out]`` fp32, contiguous; −∞ in the masked columns.
    """
    backend = _backend(backend)
    launch = _launch_config(launch)
    fmt = "fp8" if q_scales is None else "mxfp4"
    validate.tensor(q, "q", dtype=torch.float8_e4m3fn if fmt == "fp8" else torch.uint8, ndim=3)
    T, H, Dq = q.shape
    if Dq != (HEAD_DIM if fmt == "fp8" else HEAD_DIM // 2):
        raise ValueError(f"q: expected [T, n_ih, {HEAD_DIM if fmt == 'fp8' else HEAD_DIM // 2}] for {fmt}, "
                         f"got {tuple(q.shape)}")
    if q_scales is not None:
        validate.tensor(q_scales, "q_scales", dtype=torch.int32, shape=(T, H))
    validate.tensor(weights_out, "weights_out", dtype=torch.float32, shape=(T, H))
    validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32), shape=(T,))
    _check_k_cache(k_cache, block_size, fmt)
    validate.same_device(q=q, weights_out=weights_out, k_cache=k_cache, positions=positions)
    if backend == "triton" and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(f"block_size: the Triton kernel needs a power of two >= 16, got {block_size}")
    n_c = n_compressed(positions)
    if _checking_values() and T and bool((positions < 0).any()):
        raise ValueError("positions: expected non-negative positions")
    if n_out is None:
        n_out = int(n_c.max()) if T else 0
    if block_table is None:
        n_pages = max(1, -(-n_out // block_size))
        block_table = torch.arange(n_pages, dtype=torch.int32, device=q.device).expand(T, n_pages)
    validate.tensor(block_table, "block_table", dtype=torch.int32, ndim=2)
    if block_table.shape[0] != T:
        raise ValueError(f"block_table: expected one row per token ({T}), got shape {tuple(block_table.shape)}")
    if _checking_values() and T:
        need = -(-int(n_c.max()) // block_size)
        if block_table.shape[1] < need:
            raise ValueError(f"block_table: {block_table.shape[1]} columns cannot address n_c = {int(n_c.max())} "
                             f"rows of {block_size} per page ({need} needed)")
        used = torch.arange(block_table.shape[1], device=q.device)[None, :] < (-(-n_c // block_size))[:, None]
        validate.index_range(block_table[used], "block_table", k_cache.shape[0], allow_minus_one=False)
    if backend == "reference":
        return reference.logits(q, q_scales, weights_out, k_cache, positions, block_table, block_size=block_size,
                                n_out=n_out, dtype=torch.float64).float()
    return _launch.logits(q, q_scales, weights_out, k_cache, positions, block_table, block_size, n_out, launch)


def topk(logits: torch.Tensor | None, k: int, *, positions: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Local ids of the k largest logits per row; −∞ entries and missing columns → −1 (torch only).

    Order within a row carries no meaning (attention is one softmax); ties are broken by torch.topk.
    Short-context shortcut: if ``positions`` is given and max n_c ≤ k, the logits are not read at all
    (they may be None) and the result is ``[0 … n_c−1, −1 …]``, the same set as the full path.

    Args:
        logits: ``[T, n]`` fp32 (from :func:`logits`), or None when the shortcut applies.
        k: ids per row, >= 1.
        positions: ``[T]`` int64 or int32, enables the shortcut.
        out: an optional ``[T, k]`` int32 buffer, reset to −1 on every call.

    Returns:
        int32 ``[T, k]`` (``out`` when given).
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected a positive int, got {k!r}")
    if positions is not None:
        validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32), ndim=1)
    if logits is None and positions is None:
        raise ValueError("logits: may be None only when positions are given (the short-context shortcut)")
    if logits is not None:
        validate.tensor(logits, "logits", dtype=torch.float32, ndim=2)
    T = logits.shape[0] if logits is not None else positions.shape[0]
    if positions is not None and positions.shape[0] != T:
        raise ValueError(f"positions: expected {T} entries (one per logits row), got {positions.shape[0]}")
    if out is not None:
        validate.tensor(out, "out", dtype=torch.int32, shape=(T, k))
    return reference.topk(logits, k, positions=positions, out=out)


def select(q: torch.Tensor, q_scales: torch.Tensor | None, weights_out: torch.Tensor, k_cache: torch.Tensor,
           positions: torch.Tensor, k: int, *, block_size: int, block_table: torch.Tensor | None = None,
           backend: str = "auto", launch: IndexerLaunch | None = None) -> torch.Tensor:
    """:func:`logits` + :func:`topk`, skipping the logits when every token sees at most k rows (the shortcut).

    Args: as in :func:`logits` and :func:`topk`.

    Returns:
        int32 ``[T, k]`` local ids, −1 padded.
    """
    validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32), ndim=1)
    if positions.shape[0] and int(n_compressed(positions).max()) <= k:
        return topk(None, k, positions=positions)
    lg = logits(q, q_scales, weights_out, k_cache, positions, block_table=block_table, block_size=block_size,
                backend=backend, launch=launch)
    return topk(lg, k, positions=positions)


def to_global(topk_local: torch.Tensor, block_table: torch.Tensor, slots: torch.Tensor | None = None, *,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local compressed ids → slots of the MAIN compressed KV cache, and the per-token counts (torch only).

    ``global = block_table[t, l // B]·B + l % B`` for l ≥ 0, else −1; ``topk_len[t]`` = number of l ≥ 0,
    forced to 0 (and the row to −1) for invalid tokens (``slots[t] < 0``).

    Args:
        topk_local: ``[T, k]`` int32 local ids, −1 = none.
        block_table: ``[T, max_pages]`` int32, one row per token (its request's row of the main
            compressed cache).
        slots: optional ``[T]`` int64 or int32, each token's own cache slot; −1 marks an invalid (padding)
            token.
        block_size: keys per page of the main compressed cache (keyword, required).

    Returns:
        ``(global_slots [T, k] int32, topk_len [T] int32)``.
    """
    validate.tensor(topk_local, "topk_local", dtype=torch.int32, ndim=2)
    validate.tensor(block_table, "block_table", dtype=torch.int32, ndim=2)
    T = topk_local.shape[0]
    if block_table.shape[0] != T:
        raise ValueError(f"block_table: expected one row per token ({T}), got shape {tuple(block_table.shape)}")
    if slots is not None:
        validate.tensor(slots, "slots", dtype=(torch.int64, torch.int32), shape=(T,))
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected an int >= 1, got {block_size!r}")
    validate.index_range(topk_local, "topk_local", block_table.shape[1] * block_size)
    return reference.to_global(topk_local, block_table, slots, block_size=block_size)


# ----------------------------------------------------------------------------------------------------
# example inputs (tests, notebooks, checks)
# ----------------------------------------------------------------------------------------------------


def cos_sin_table(max_pos: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """A plain (no YaRN) table for demos and checks; the model's tables come from :mod:`dsv4ref.rope`.

    Returns:
        fp32 ``[max_pos, 64] = [cos f_0..f_31 | sin f_0..f_31]``.
    """
    inv = theta ** (-torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM)
    f = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=1).to(device or DEVICE)


def example_inputs(T: int, H: int, n_keys: int, *, block_size: int, fmt: str = "fp8", hadamard: bool = False,
                   seed: int = 0, positions: torch.Tensor | None = None) -> dict:
    """A small consistent problem: queries, weights, a shuffled paged K cache, per-token block tables.

    Returns:
        dict with ``index_q`` [T, H, 128] bf16, ``positions`` [T] int64 (token 0 sees every key),
        ``cos_sin`` [4·n_keys+8, 64] fp32, ``weights`` [T, H] fp32, ``k`` [n_keys, 128] bf16 (the keys before
        quantisation), ``k_cache`` (the keys inserted in ``fmt``, with ``hadamard``), ``block_table``
        [T, pages] int32 (one request: the same shuffled row for every token), ``block_size`` and
        ``slots`` [n_keys] int64 (where key s went).
    """
    g = generator(seed)
    cs = cos_sin_table(4 * n_keys + 8)
    index_q = randn((T, H, HEAD_DIM), seed=seed, block=32, octaves=8)
    w = randn((T, H), seed=seed + 1, dtype=torch.float32, block=None, octaves=4)
    if positions is None:
        positions = 4 * n_keys - 1 - torch.randint(0, 4 * n_keys // 2, (T,), generator=g)
        positions[0] = 4 * n_keys - 1  # one token sees every key
    positions = positions.to(torch.int64).to(DEVICE)
    n_pages = -(-n_keys // block_size)
    perm = torch.randperm(n_pages + 2, generator=g)[:n_pages]
    bt = perm.to(torch.int32).expand(T, n_pages).contiguous().to(DEVICE)
    k = randn((n_keys, HEAD_DIM), seed=seed + 2, block=32, octaves=8)
    cache = allocate_k_cache(n_pages + 2, block_size, fmt)
    s = torch.arange(n_keys)
    slots = (perm[s // block_size] * block_size + s % block_size).to(DEVICE)
    insert_k(cache, k, slots, block_size=block_size, fmt=fmt, hadamard=hadamard)
    return dict(index_q=index_q, positions=positions, cos_sin=cs, weights=w, k=k, k_cache=cache, block_table=bt,
                block_size=block_size, slots=slots)
