"""Shared tools for the input-contract tests (tests/test_contract_*.py): the same values in other layouts,
and proof that a failed call left every buffer alone.

* :func:`views` gives a tensor's values as several non-contiguous layouts (a strided slice of a bigger
  buffer, a storage offset, a transposed copy) — every backend must honour them or refuse them.
* :func:`snapshot` / :func:`unchanged` record the bytes of every buffer given to a call and check them after.
* :func:`same_outcome` runs one call per backend and asserts all give the reference's answer (compared by
  the caller) or all raise the same error class.
"""

from __future__ import annotations

import torch


def views(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The values of ``t`` in other layouts (equal to ``t`` elementwise, not contiguous where possible)."""
    out = {"contiguous": t.contiguous()}
    if t.dim() >= 1 and t.numel():
        big = torch.zeros((t.shape[0] * 2, *t.shape[1:]), dtype=t.dtype, device=t.device)
        big[::2] = t
        out["every_other_row"] = big[::2]
        flat = torch.zeros(t.numel() + 3, dtype=t.dtype, device=t.device)
        flat[3:] = t.reshape(-1)
        out["storage_offset"] = flat[3:].view(t.shape)
    if t.dim() >= 2 and t.numel():
        out["transposed_copy"] = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return out


def snapshot(*bufs: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if b is None else b.detach().clone() for b in bufs]


def unchanged(before: list, *bufs: torch.Tensor | None) -> bool:
    """Every buffer byte-identical to its snapshot (NaN payloads included)."""
    for a, b in zip(before, bufs):
        if a is None:
            continue
        # clone(contiguous_format), not .contiguous(): a size-1 dim with stride 2 counts as contiguous, and
        # then the byte view below fails
        ca, cb = (x.clone(memory_format=torch.contiguous_format) for x in (a, b))
        if a.shape != b.shape or not torch.equal(ca.view(torch.uint8), cb.view(torch.uint8)):
            return False
    return True


def outcome(fn, *args, **kwargs):
    """("ok", result) or ("raise", exception class name)."""
    try:
        return "ok", fn(*args, **kwargs)
    except (ValueError, TypeError, IndexError, RuntimeError) as e:
        return "raise", type(e).__name__
