"""Argument checks shared by every public op.

Bad input must give an error that names the argument and says what was expected, never a silent
wrong answer or an out-of-bounds read in a kernel. Shape/dtype/device checks are free (metadata only).
Value checks (index ranges) read the tensor, which costs a device sync; they run by default and can be
switched off on a hot path with ``DSV4REF_CHECK_VALUES=0`` once a caller is known to be correct.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import os
from collections.abc import Sequence

import torch

CHECK_VALUES = os.environ.get("DSV4REF_CHECK_VALUES", "1") != "0"  # at import; checks read check_values()


def check_values() -> bool:
    """Whether value checks (index ranges, non-finite data) run now: ``DSV4REF_CHECK_VALUES`` read at call
    time (default on), so a test or a caller can switch it with :func:`checking_values`."""
    return os.environ.get("DSV4REF_CHECK_VALUES", "1") != "0"


@contextlib.contextmanager
def checking_values(on: bool = True):
    """``with checking_values(False): ...`` runs the block with value checks off (the hot path), then
    restores ``DSV4REF_CHECK_VALUES`` as it was."""
    old = os.environ.get("DSV4REF_CHECK_VALUES")
    os.environ["DSV4REF_CHECK_VALUES"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DSV4REF_CHECK_VALUES", None)
        else:
            os.environ["DSV4REF_CHECK_VALUES"] = old


# The one list of backend names. Every public op takes ``backend=`` from it and declares the subset it
# supports; "auto" resolves to the fastest correct backend on this device.
BACKENDS = ("auto", "reference", "triton", "two_pass", "gluon")


def tensor(
    t,
    name: str,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; raise TypeError/ValueError naming ``name`` and the expectation.

    ``shape`` may hold ``None`` for "any size" in that dimension.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        ok = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in ok:
            want = " or ".join(str(d) for d in ok)
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                want_s = tuple("*" if w is None else w for w in shape)
                raise ValueError(f"{name}: expected shape {want_s}, got {tuple(t.shape)} (dim {i})")
    if device is not None and t.device.type != torch.device(device).type:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (strides {t.stride()})")
    return t


def same_device(**tensors: torch.Tensor | None) -> None:
    """All given (non-None) tensors live on one device."""
    devs = {n: t.device for n, t in tensors.items() if t is not None}
    if len({d.type for d in devs.values()}) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devs.items())
        raise ValueError(f"tensors must share one device: {desc}")


def index_range(t: torch.Tensor, name: str, hi: int, *, allow_minus_one: bool = True) -> None:
    """Every entry of integer tensor ``t`` is in [0, hi) (or −1, meaning "skip", if allowed)."""
    if not check_values() or t.numel() == 0:
        return
    lo_ok = -1 if allow_minus_one else 0
    bad = (t < lo_ok) | (t >= hi)
    if bool(bad.any()):
        i = int(bad.nonzero()[0][0]) if t.dim() == 1 else tuple(bad.nonzero()[0].tolist())
        v = int(t[i])
        allowed = f"[0, {hi})" + (" or -1" if allow_minus_one else "")
        raise ValueError(f"{name}: entry {i} = {v} is out of range; expected {allowed}")


def backend(b: str, supported: Sequence[str] = ("reference", "triton"), auto: str = "triton") -> str:
    """Resolve ``backend=``: one of ``supported`` (names from :data:`BACKENDS`) or "auto" (→ ``auto``)."""
    if b == "auto":
        return auto
    if b not in supported:
        raise ValueError(f"backend: expected one of {('auto', *supported)}, got {b!r}")
    return b


def power_of_two(v: int, name: str) -> int:
    v = integer(v, name)
    if v <= 0 or v & (v - 1):
        raise ValueError(f"{name}: expected a power of two, got {v}")
    return v


def integer(v, name: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """An int scalar (Python or numpy int; not bool, not float) in [lo, hi]; returns it as int."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
    v = operator.index(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
        raise ValueError(f"{name}: expected an int {rng}, got {v}")
    return v


def scalar(
    v, name: str, *, lo: float | None = None, hi: float | None = None, finite: bool = True, gt: float | None = None
) -> float:
    """A real scalar (int or float; not bool, not a str, not a tensor), finite unless ``finite=False``, in
    [lo, hi] and > ``gt`` (an open lower bound: ``eps``, a scale factor); returns it as float."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(v).__name__} {v!r}")
    v = float(v)
    if finite and not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {v}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
        raise ValueError(f"{name}: expected a number {rng}, got {v}")
    if gt is not None and not v > gt:
        raise ValueError(f"{name}: expected a number > {gt}, got {v}")
    return v


def not_meta(t: torch.Tensor | None, name: str) -> None:
    """Metadata check: ``t`` is not on the meta device. A meta tensor holds no values, so no op can run on
    it (a value check or a kernel would fail inside torch); every op refuses it with this one message."""
    if t is not None and t.device.type == "meta":
        raise ValueError(f"{name}: tensors on the meta device cannot be run (they hold no values); pass tensors on a real device")


def finite(t: torch.Tensor, name: str) -> None:
    """Value check (skipped when :func:`check_values` is off): no NaN or ±inf in float tensor ``t``."""
    if not check_values() or t.numel() == 0:
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        i = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name}: non-finite values (NaN or inf; the first at index {i} is {t[i].item()})")


def distinct(t: torch.Tensor, name: str) -> None:
    """Value check (skipped when :func:`check_values` is off): the entries >= 0 of 1-d integer ``t`` are
    distinct (a slot list where two rows would write one slot; −1 entries may repeat)."""
    if not check_values() or t.numel() < 2:
        return
    s = t[t >= 0].sort().values
    dup = s[1:] == s[:-1]
    if bool(dup.any()):
        raise ValueError(f"{name}: {int(s[1:][dup][0])} appears more than once (each entry >= 0 must be distinct)")
