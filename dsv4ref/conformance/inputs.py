"""Adversarial input builders shared by the op modules of the suite. Everything is drawn on the CPU
from seeded generators, so every machine (and the golden files) gets the same bytes."""

from __future__ import annotations

import torch

from .. import kv_cache, rope
from ..formats import ROPE_DIM
from ..testing import generator, randn

__all__ = ["random_bytes", "kv_rows", "random_cache", "filled_cache", "rope_table"]


def random_bytes(n: int, seed: int) -> torch.Tensor:
    """(n,) uint8, uniform: a buffer an op must leave alone starts like this, so a stray write shows."""
    return torch.randint(0, 256, (n,), generator=generator(seed), dtype=torch.int64).to(torch.uint8)


def kv_rows(T: int, seed: int) -> torch.Tensor:
    """bf16 [T, 512] with per-64-block scales over 16 octaves, one all-zero block and blocks whose amax
    is exactly 448·2^k (where a float-log2 scale rule goes one byte too high)."""
    kv = randn((T, 512), seed=seed, device="cpu")
    kv[0, 64:128] = 0.0
    kv[1, 0:64] = kv[1, 0:64] / kv[1, 0:64].abs().max().float() * 448.0
    kv[min(2, T - 1), 128:192] = kv[min(2, T - 1), 128:192] / kv[min(2, T - 1), 128:192].abs().max().float() * 1.75
    return kv


def random_cache(n_pages: int, block_size: int, seed: int) -> torch.Tensor:
    """A KV cache of ``n_pages`` pages of ``block_size`` tokens, full of random bytes."""
    pb = kv_cache.page_bytes(block_size)
    return random_bytes(n_pages * pb, seed).view(n_pages, pb)


def filled_cache(n_pages: int, block_size: int, seed: int) -> torch.Tensor:
    """A cache with every slot written by the reference writer (so every row decodes to finite values)."""
    cache = kv_cache.allocate(n_pages, block_size, device="cpu")
    kv = kv_rows(n_pages * block_size, seed)
    kv_cache.insert(cache, kv, torch.arange(n_pages * block_size), block_size=block_size, backend="reference")
    return cache


def rope_table(theta: float, yarn: dict | None, max_pos: int = 512) -> torch.Tensor:
    """fp32 cos/sin table [max_pos, 64] on the CPU."""
    return rope.cos_sin_cache(max_pos, ROPE_DIM, theta, yarn, device="cpu")


def head_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with dims 0 and 1 swapped in memory (dense, not contiguous): heads outermost."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims swapped in memory (the last dim is no longer contiguous)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)
