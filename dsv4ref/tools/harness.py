"""Registries behind ``python -m dsv4ref check`` and ``python -m dsv4ref bench``.

An op module registers

* checks: ``@check("kv_cache.insert")`` on a function ``() -> list[CheckRow]`` that runs the Triton
  kernel against its reference at a few shapes on :data:`dsv4ref.DEVICE`;
* benchmarks: ``@bench("kv_cache.insert")`` on a function ``() -> list[BenchCase]`` giving what to time
  and how many bytes / FLOPs it must move (the compulsory traffic, stated in the case's note).

The benchmark runner measures the device's ceilings (device-to-device copy bandwidth, bf16 matmul rate)
in the same run, then reports each case as achieved bytes/s and FLOP/s and the fraction of the roofline
bound ``max(bytes / copy_bw, flops / matmul_rate)``.
"""

from __future__ import annotations

import importlib
import math
import os
import statistics
from dataclasses import dataclass, field
from collections.abc import Callable

import torch

from .cases import OPS
from ..device import DEVICE, Timer, capture_graph, interpreting, synchronize
from ..tolerances import Report

CHECKS: dict[str, Callable[[], list[CheckRow]]] = {}
BENCHES: dict[str, Callable[[], list[BenchCase]]] = {}
# ``@summary("sparse_mla")`` on ``(rows) -> list[str]``: lines ``bench`` prints after its table when a case of
# that op ran (e.g. a peer's time ratios, computed from the rows of the same run)
SUMMARIES: dict[str, Callable[[list[BenchRow]], list[str]]] = {}


@dataclass
class CheckRow:
    op: str
    shape: str
    report: Report


@dataclass
class BenchCase:
    op: str
    shape: str
    run: Callable[[int], object]  # run(i) launches the op on input set i % n_sets
    n_sets: int
    bytes: float  # compulsory bytes moved per call
    flops: float = 0.0
    note: str = ""  # how the bytes were counted
    extra: dict = field(default_factory=dict)
    # the torch reference of the same call, timed beside the kernel under torch.compile: (fn, args) where
    # fn(*args(i)) computes what run(i) computes. fn is compiled once (static shapes); every input set
    # has the same shapes, so the sets share one compiled graph.
    reference: tuple[Callable, Callable[[int], tuple]] | None = None


def same_size_copy_case(
    op: str,
    shape: str,
    total_bytes: int,
    n_sets: int,
    note: str = "torch copy_ of total / 2 bytes: the same total traffic, read = written",
) -> BenchCase:
    """A baseline row: a uint8 ``copy_`` of ``total_bytes // 2`` bytes (so ``2 · (total_bytes // 2)`` bytes read
    plus written), over ``n_sets`` preallocated source/destination pairs rotated like the op's input sets and
    timed the same way. Beside an op moving ``total_bytes`` it shows how much a copy of that size alone loses
    to launch and tail against the (512 MiB) copy ceiling."""
    n = total_bytes // 2
    src = [torch.empty(n, device=DEVICE, dtype=torch.uint8) for _ in range(n_sets)]
    dst = [torch.empty_like(s) for s in src]
    return BenchCase(op, shape, lambda i: dst[i].copy_(src[i]), n_sets, 2 * n, note=note)


def check(name: str):
    def deco(fn):
        CHECKS[name] = fn
        return fn

    return deco


def bench(name: str):
    def deco(fn):
        BENCHES[name] = fn
        return fn

    return deco


def summary(name: str):
    def deco(fn):
        SUMMARIES[name] = fn
        return fn

    return deco


def load_ops() -> list[str]:
    """Import every op's cases module (``dsv4ref.tools.cases.<op>``), so its checks and benchmarks
    register. Returns the op names found."""
    found = []
    for m in OPS:
        try:
            importlib.import_module(f"dsv4ref.tools.cases.{m}")
        except ModuleNotFoundError as e:
            if e.name != f"dsv4ref.tools.cases.{m}":
                raise
            # not moved yet: the op module registers its own cases (to be removed once every op has moved)
            try:
                importlib.import_module(f"dsv4ref.{m}")
            except ModuleNotFoundError as e2:
                if e2.name != f"dsv4ref.{m}":
                    raise
                continue
        found.append(m)
    return found


def run_checks(only=None):
    """Yield the check rows of every registered op (``only``: an op-name prefix or a list of them), as each
    check finishes, so a long run reports as it goes."""
    load_ops()
    prefixes = [only] if isinstance(only, str) else list(only or [""])
    for name, fn in CHECKS.items():
        if any(name.startswith(p) for p in prefixes):
            yield from fn()


# ------------------------------------------------------------------------------------------------
# timing and ceilings
# ------------------------------------------------------------------------------------------------


def time_ms(
    run: Callable[[int], object], n_sets: int = 1, warmup: int = 5, reps: int = 30, graph: bool = True, min_calls: int = 32
) -> float:
    """Median device time of one call in ms.

    Cycles through the ``n_sets`` input sets so no set stays in cache (each case should make the sum of
    its sets larger than the L2). Where the device supports graphs, one graph holding one call per input
    set is captured and replayed, so host launch overhead is not counted (it can exceed the kernel time
    of a small op); otherwise the calls are timed eagerly with device events.

    Each timed window holds back-to-back replays of at least ``min_calls`` calls in all: the start event
    fires on an idle device, so the host's submission of the window's first replay is inside the window,
    and only the first (the host submits the next replays while the device runs). A window of one replay
    (``n_sets`` calls) would charge every call a share of that submission, which is comparable to the time of
    a small decode kernel (``min_calls=1`` times that way). A replay that takes over a millisecond is timed
    alone.
    """
    replay = None
    if graph:
        try:
            replay = capture_graph(lambda: [run(i) for i in range(n_sets)])
        except Exception:  # an op that syncs with the host cannot be captured: time it eagerly
            replay = None
    if replay is not None:
        for _ in range(max(1, warmup // n_sets)):
            replay()
        synchronize()
        with Timer() as t:
            replay()
        # replays per window; one where a replay takes over a millisecond (the submission is then a small part of it)
        per = 1 if t.ms > 1.0 else max(1, -(-min_calls // n_sets))
        times = []
        for _ in range(max(3, reps // (n_sets * per))):
            with Timer() as t:
                for _ in range(per):
                    replay()
            times.append(t.ms / (n_sets * per))
        return statistics.median(times)
    for i in range(warmup):
        run(i % n_sets)
    synchronize()
    times = []
    for i in range(reps):
        with Timer() as t:
            run(i % n_sets)
        times.append(t.ms)
    return statistics.median(times)


@dataclass
class Ceilings:
    copy_bytes_per_s: float
    bf16_flops_per_s: float


def measure_ceilings() -> Ceilings:
    """Device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate, measured now."""
    n = 1 << 29  # 512 MiB, far above any L2
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = time_ms(lambda i: dst.copy_(src), warmup=3, reps=20, graph=False)
    copy = 2 * n / (ms * 1e-3)
    src = dst = None  # free the 1 GiB before the matmul
    m = 8192
    a = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    ms = time_ms(lambda i: a @ b, warmup=3, reps=10, graph=False)
    return Ceilings(copy, 2 * m**3 / (ms * 1e-3))


@dataclass
class BenchRow:
    case: BenchCase
    ms: float
    bytes_per_s: float
    flops_per_s: float
    fraction: float  # of the roofline bound


def run_benches(
    only=None, ceilings: Ceilings | None = None, on_row=None, compile_reference: bool = True
) -> tuple[Ceilings, list[BenchRow]]:
    """Time the registered benchmarks. ``only``: an op-name prefix or a list of them (run in that order);
    ``on_row(row)`` is called as each case finishes, so a long run reports as it goes. A case that names
    its ``reference`` is followed by that reference under ``torch.compile`` (``compile_reference=False``
    skips them)."""
    if interpreting() or DEVICE.type == "cpu":
        raise RuntimeError("benchmarks need a GPU: on the CPU the kernels run in Triton's interpreter")
    if os.environ.get("DSV4REF_BENCH") == "0":  # e.g. nbval on a GPU: run the notebooks, skip their timings
        return ceilings or Ceilings(math.nan, math.nan), []
    load_ops()
    ceil = ceilings or measure_ceilings()
    prefixes = [only] if isinstance(only, str) else list(only or [""])
    names = [n for p in prefixes for n in BENCHES if n.startswith(p)]
    rows = []
    for name in dict.fromkeys(names):
        for case in BENCHES[name]():
            try:
                ms = time_ms(case.run, case.n_sets)
            except Exception as e:  # one case that fails to compile or run must not hide the others
                print(f"{case.op} {case.shape}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            rows.append(_row(case, ms, ceil))
            if on_row:
                on_row(rows[-1])
            if case.reference is not None and compile_reference:
                try:
                    ref = compiled_case(case)
                    # timed with events, not captured: a compiled graph whose capture fails leaves the
                    # device RNG in capture state and breaks every later case (seen on the H200)
                    rows.append(_row(ref, time_ms(ref.run, ref.n_sets, graph=False), ceil))
                except Exception as e:  # the reference not compiling must not hide the kernels' rows
                    print(
                        f"{case.op}[torch.compile] {case.shape}: FAILED {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''}"
                    )
                    continue
                if on_row:
                    on_row(rows[-1])
    return ceil, rows


def _row(case: BenchCase, ms: float, ceil: Ceilings) -> BenchRow:
    s = ms * 1e-3
    bound = max(case.bytes / ceil.copy_bytes_per_s, case.flops / ceil.bf16_flops_per_s)
    return BenchRow(case, ms, case.bytes / s, case.flops / s, bound / s)


def compiled_case(case: BenchCase) -> BenchCase:
    """The case's torch reference under ``torch.compile`` (same input sets, same byte and FLOP counts), as
    a case of its own named ``<op>[torch.compile]``. Compiled and run once per set here, outside any timing
    or graph capture."""
    fn, args = case.reference
    cfn = torch.compile(fn, dynamic=False)
    for i in range(case.n_sets):
        cfn(*args(i))
    synchronize()
    return BenchCase(
        f"{case.op}[torch.compile]",
        case.shape,
        lambda i: cfn(*args(i)),
        case.n_sets,
        case.bytes,
        case.flops,
        "the torch reference under torch.compile, same inputs",
        extra=case.extra,
    )
