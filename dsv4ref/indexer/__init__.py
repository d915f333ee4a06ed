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

Modules: :mod:`.quantize` (the quantisers and the K cache), :mod:`.scores` (logits, top-k, local → global),
:mod:`.checks` (the constants and the argument checks they share); the math is in :mod:`.reference` and
:mod:`.mxfp4`. This module re-exports their public functions and holds the example inputs.
"""

from __future__ import annotations

import torch

from .. import validate
from ..device import DEVICE, HOST
from ..seeded import generator, randn
from .checks import FMTS, FP8_RECORD, HEAD_DIM, MXFP4_RECORD, ROPE_DIM, SUPPORTED_BACKENDS
from .launch import IndexerLaunch, default_launch
from .quantize import allocate_k_cache, dequantize_k, dequantize_q, insert_k, k_page_bytes, quantize_k, quantize_q, read_k
from .scores import head_weights, logits, n_compressed, select, short_context_topk, to_global, topk

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
    # the reference writer: the kernel's bytes (tests/test_indexer.py), without an interpreted launch
    insert_k(cache, k, slots, block_size=block_size, fmt=fmt, hadamard=hadamard, backend="reference")
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
