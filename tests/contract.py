"""Shared tools for the input-contract tests (tests/test_contract_*.py): the same values in other layouts,
and proof that a failed call left every buffer alone.

* :func:`views` gives a tensor's values as several non-contiguous layouts (a strided slice of a bigger
  buffer, a storage offset, a transposed copy) — every backend must honour them or refuse them.
* :func:`snapshot` / :func:`unchanged` record the bytes of every buffer given to a call and check them after.
* :func:`same_outcome` runs one call per backend and asserts all give the reference's answer (compared by
  the caller) or all raise the same error class.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode


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


# ----------------------------------------------------------------------------------------------------
# no host sync: the CPU proxy for "this can be captured in a device graph"
# ----------------------------------------------------------------------------------------------------


class HostSync(AssertionError):
    """A host sync from dsv4ref code where none may happen (a graph-captured region)."""


#: The entry points of a host sync: reading a value (item, tolist, bool/int/float/index of a tensor, cpu,
#: numpy), the ops whose output shape depends on the data (nonzero, unique, bincount, masked_select, indexing
#: with a bool mask), and a tensor made from host data (torch.tensor / as_tensor: on a GPU an H2D copy from
#: pageable memory, which waits for the stream and cannot be captured).
TENSOR_SYNCS = (
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "cpu",
    "numpy",
    "nonzero",
    "unique",
    "bincount",
    "masked_select",
)
TORCH_SYNCS = ("nonzero", "unique", "bincount", "masked_select", "argwhere", "tensor", "as_tensor")


def _where(depth: int) -> str:
    """module:line of the frame ``depth`` levels up, skipping torch's own frames and this module's."""
    f = sys._getframe(depth + 1)
    while f is not None and (f.f_globals.get("__name__", "").startswith("torch") or f.f_globals is globals()):
        f = f.f_back
    return "" if f is None else f"{f.f_globals.get('__name__', '')}:{f.f_lineno}"


class _Guard(TorchFunctionMode):
    """Indexing with a bool mask (``t[mask]``, ``t[mask] = v``): seen as a torch function, because patching
    ``torch.Tensor.__getitem__`` would leave the type's sequence slot changed (every 0-d tensor a sequence)."""

    def __init__(self, hit):
        super().__init__()
        self.hit = hit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__getitem__", "__setitem__") and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
                self.hit(func.__name__ + " (bool mask)", _where(1))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync(record: list, tolerate: tuple = ()):
    """While active, a host sync called from a dsv4ref module is appended to ``record`` as (module:line, what)
    and raises :class:`HostSync`, except from modules starting with a name in ``tolerate`` (recorded only).
    Calls from torch or Triton themselves (the interpreter reads its tensors on the host) are let through.
    The entry points are patched on torch.Tensor / torch (so calls inside the dsv4ref custom ops' Python
    implementations are seen too); bool-mask indexing is seen by a torch function mode, which does not see
    inside a custom op."""

    def hit(name, where):
        if where.startswith("dsv4ref"):
            if (where, name) not in record:  # a patched dunder may be seen twice: as itself and through the mode
                record.append((where, name))
            if not where.startswith(tolerate or ("\0",)):
                raise HostSync(f"host sync {name} from {where}")

    saved = []

    def guard(owner, name):
        orig = getattr(owner, name)

        def wrapper(*a, **k):
            hit(name, _where(1))
            return orig(*a, **k)

        saved.append((owner, name, vars(owner).get(name)))  # None: inherited, deleted again on exit
        setattr(owner, name, wrapper)

    try:
        for n in TENSOR_SYNCS:
            guard(torch.Tensor, n)
        for n in TORCH_SYNCS:
            guard(torch, n)
        where = torch.where  # torch.where(cond) alone is nonzero; with two values it is a plain select

        def where_guarded(*a, **k):
            if len(a) + len(k) == 1:
                hit("where(cond)", _where(1))
            return where(*a, **k)

        saved.append((torch, "where", vars(torch).get("where")))
        torch.where = where_guarded
        with _Guard(hit):
            yield record
    finally:
        for owner, name, orig in reversed(saved):
            if orig is None:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
