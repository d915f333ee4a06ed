"""Which device dsv4ref runs on, and the few device services it needs.

Import order matters (Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` runs, i.e. when a kernel
module is imported, not when a kernel is launched). ``dsv4ref/__init__.py`` imports this module first, so
that on a CPU-only machine every kernel module that follows is decorated in interpreter mode.

This is the only module in the package that touches a backend-specific torch namespace
(``torch.xpu`` / ``torch.cuda``); everything else goes through :func:`pick`, :func:`synchronize` and
:class:`Timer`, which work the same on Intel XPU, CUDA and CPU.
"""

from __future__ import annotations

import os
import time

import torch

__all__ = ["pick", "DEVICE", "HOST", "interpreting", "synchronize", "Timer", "describe"]


def _accelerator() -> str | None:
    """The accelerator torch can use here: 'xpu' first, then 'cuda', else None."""
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    if torch.cuda.is_available():
        return "cuda"
    return None


def pick() -> torch.device:
    """The torch device dsv4ref uses.

    Order: the environment variable ``DSV4REF_DEVICE`` (``cpu``, ``cuda``, ``xpu``, ``cuda:1`` …) if set;
    CPU if the user already asked Triton for its interpreter (``TRITON_INTERPRET=1``), so outputs match CI;
    otherwise Intel XPU, then CUDA, then CPU.
    """
    env = os.environ.get("DSV4REF_DEVICE")
    if env:
        dev = torch.device(env)
        if dev.type != "cpu" and _accelerator() != dev.type:
            raise RuntimeError(f"DSV4REF_DEVICE={env!r}, but torch sees no {dev.type} device here")
        return dev
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    acc = _accelerator()
    return torch.device(acc) if acc else torch.device("cpu")


DEVICE: torch.device = pick()

#: Where tables (cos/sin) and seeded draws are built, whatever torch's default device is: on the CPU, so
#: every machine gets the same bits. Library code names it explicitly (``device=HOST``); it never relies on
#: ``torch.set_default_device``.
HOST: torch.device = torch.device("cpu")

# On CPU the Triton kernels can only run in Triton's interpreter. This must happen before any
# module defines a @triton.jit kernel (docs/triton_interpreter.md).
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (numpy), False when they are compiled."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def for_interpreter(interpreted: bool | None) -> bool:
    """The ``interpreted=`` argument of the ops' ``default_launch``: True asks for the interpreter's default, False
    for the GPU's, None for this process's (:func:`interpreting`)."""
    return interpreting() if interpreted is None else interpreted


def synchronize(device: torch.device | None = None) -> None:
    """Wait for all queued work on ``device`` (default: :data:`DEVICE`). A no-op on CPU."""
    dev = device or DEVICE
    if dev.type != "cpu":
        torch.accelerator.synchronize(dev)


class Timer:
    """Elapsed time of a region in milliseconds, with device events where there is a device.

    >>> with Timer() as t:
    ...     y = x @ x
    >>> t.ms

    On XPU and CUDA this records ``torch.Event(enable_timing=True)`` on the current stream (the same code
    for both: no ``torch.cuda.Event``); on CPU it uses ``time.perf_counter``.
    """

    def __init__(self, device: torch.device | None = None):
        self.device = device or DEVICE
        self.ms = float("nan")

    def __enter__(self) -> Timer:
        if self.device.type == "cpu":
            self._t0 = time.perf_counter()
        else:
            self._start = torch.Event(enable_timing=True)
            self._end = torch.Event(enable_timing=True)
            self._start.record()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cpu":
            self.ms = (time.perf_counter() - self._t0) * 1e3
        else:
            self._end.record()
            self._end.synchronize()
            self.ms = self._start.elapsed_time(self._end)


def capability(device: torch.device | None = None) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device; None on any other device."""
    dev = torch.device(device) if device is not None else DEVICE
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(dev)


_SM_COUNT: dict[str, int] = {}


def sm_count(device: torch.device | None = None) -> int:
    """Streaming multiprocessors (CUDA) / compute units (XPU) of a device; 1 on a CPU. Read once per device
    (launch defaults ask for it on every call)."""
    dev = torch.device(device) if device is not None else DEVICE
    key = str(dev)
    if key not in _SM_COUNT:
        if dev.type == "cuda":
            _SM_COUNT[key] = torch.cuda.get_device_properties(dev).multi_processor_count
        elif dev.type == "xpu":
            _SM_COUNT[key] = torch.xpu.get_device_properties(dev).gpu_subslice_count
        else:
            _SM_COUNT[key] = 1
    return _SM_COUNT[key]


def empty_cache() -> None:
    """Give cached device memory back (benchmarks between cases); a no-op on CPU."""
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    elif DEVICE.type == "xpu":
        torch.xpu.empty_cache()


def describe() -> str:
    """One line naming the device, for logs and notebook cells marked NBVAL_IGNORE_OUTPUT."""
    import triton

    if DEVICE.type == "cpu":
        name = "CPU (Triton interpreter)" if interpreting() else "CPU"
    else:
        name = torch.accelerator.current_accelerator().type
        mod = getattr(torch, DEVICE.type)
        name = f"{DEVICE} ({mod.get_device_name(DEVICE)})"
    return f"{name}; torch {torch.__version__}; triton {triton.__version__}"


def capturing(device: torch.device | None = None) -> bool:
    """True while the current stream of ``device`` is recording a graph (for code that must run eagerly, e.g. a
    benchmark case that times host work too, to refuse :func:`capture_graph`). False on a CPU."""
    dev = device or DEVICE
    mod = getattr(torch, dev.type, None) if dev.type in ("cuda", "xpu") else None
    check = getattr(mod, "is_current_stream_capturing", None)
    return bool(check()) if check is not None else False


def capture_graph(fn, device: torch.device | None = None):
    """Record ``fn()`` (a sequence of kernel launches, no host syncs) as a device graph and return a
    function that replays it, or None where graphs are not available (CPU; an XPU torch without graphs).

    Benchmarks replay graphs so that host launch cost (tens of µs per Triton launch, plus the
    torch.library dispatcher) does not hide the kernel time of small ops.
    """
    dev = device or DEVICE
    if dev.type == "cuda":
        mod = torch.cuda
        graph_cls = getattr(mod, "CUDAGraph", None)
    elif dev.type == "xpu":
        mod = torch.xpu
        graph_cls = getattr(mod, "XPUGraph", None)
    else:
        return None
    if graph_cls is None or not hasattr(mod, "graph"):
        return None
    side = mod.Stream()
    side.wait_stream(mod.current_stream())
    with mod.stream(side):
        fn()  # warm up (compiles kernels) outside the capture
    mod.current_stream().wait_stream(side)
    g = graph_cls()
    with mod.graph(g):
        fn()
    return g.replay
