"""The indexer's scores and choice: :func:`logits` over a paged K cache, :func:`topk` (and
:func:`short_context_topk`), :func:`select` (logits + top-k, skipped when the shortcut applies),
:func:`to_global` (local ids → slots of the main compressed cache), with :func:`n_compressed` and
:func:`head_weights`. Re-exported by :mod:`dsv4ref.indexer`, whose docstring has the overview."""

from __future__ import annotations

import torch

from .. import validate
from . import launch as _launch
from . import reference
from .checks import HEAD_DIM, INDEX_DTYPES, _backend, _check_nan_codes, _checking_values, _launch_config
from .launch import IndexerLaunch
from .quantize import _check_k_cache


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
