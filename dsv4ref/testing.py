"""Seeded test inputs and output poisoning, shared by tests, checks, benchmarks and the conformance suite
(the library's ops never import this module: their seeded draws come from :mod:`dsv4ref.seeded`).

* :func:`poison` fills an output buffer before a kernel runs, so an element the kernel forgot shows.
* :func:`randn` draws seeded inputs with real magnitudes (per-block scales over many octaves) from a
  CPU generator, then moves them to the device, so the numbers are the same on every machine.
"""

from __future__ import annotations

import torch

from .device import DEVICE
from .seeded import generator, randint, randn, randperm  # noqa: F401  (one import for callers)
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
