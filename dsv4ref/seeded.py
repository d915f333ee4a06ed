"""Seeded draws with real magnitudes, the same numbers on every machine: what the ops' ``example_inputs``
and the random weights of the stack are built from (:mod:`dsv4ref.testing` re-exports them for tests).

Every draw uses a seeded CPU generator, then moves the result to the device (the CUDA RNG stream differs).
"""

from __future__ import annotations

import math

import torch

from .device import DEVICE, HOST

__all__ = ["generator", "randn", "randint", "randperm"]


def generator(seed: int) -> torch.Generator:
    """A seeded CPU generator: CPU and GPU draw the same numbers (the CUDA RNG stream differs)."""
    return torch.Generator(device=HOST).manual_seed(seed)


def randn(
    shape, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device=None, block: int | None = 64, octaves: int = 16
) -> torch.Tensor:
    """N(0,1) values times a random power-of-two scale per ``block`` of the last dim (2^-octaves/2 ..
    2^+octaves/2), so quantised blocks get many different scale bytes. ``block=None``: one scale per row.

    Drawn on the CPU with a seeded generator, then moved to ``device`` (default :data:`DEVICE`)."""
    g = generator(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32, device=HOST)
    if octaves:
        last = shape[-1]
        b = last if block is None else block
        nb = math.ceil(last / b)
        e = torch.randint(-octaves // 2, octaves // 2 + 1, (*shape[:-1], nb), generator=g, device=HOST).float()
        x = x * torch.exp2(e).repeat_interleave(b, dim=-1)[..., :last]
    return x.to(dtype).to(device or DEVICE)


def randint(low: int, high: int, shape, *, seed: int = 0, dtype=torch.int64, device=None) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=generator(seed), device=HOST).to(dtype).to(device or DEVICE)


def randperm(n: int, *, seed: int = 0, dtype=torch.int64, device=None) -> torch.Tensor:
    return torch.randperm(n, generator=generator(seed), device=HOST).to(dtype).to(device or DEVICE)
