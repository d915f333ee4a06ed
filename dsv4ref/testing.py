"""Seeded test inputs and output poisoning, shared by tests, checks, benchmarks and the conformance suite.

* :func:`poison` fills an output buffer before a kernel runs, so an element the kernel forgot shows.
* :func:`randn` draws seeded inputs with real magnitudes (per-block scales over many octaves) from a
  CPU generator, then moves them to the device, so the numbers are the same on every machine.
"""

from __future__ import annotations

import math

import torch

from .device import DEVICE, HOST
from .tolerances import Report, Tol, TOLERANCES, assert_close, compare  # noqa: F401  (one import for callers)


def poison(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """An output buffer filled with a value no kernel writes: NaN for floats, 0x7F (an e4m3 NaN
    byte) for uint8, -7777 for ints. Pass it to a kernel; any element left unwritten shows."""
    device = device or DEVICE
    if dtype.is_floating_point and dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    if dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(dtype)
    return torch.full(shape, -7777, dtype=dtype, device=device)


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
