"""The conformance runner: cases in, one PASS/FAIL row per (case, output) out; and the golden files.

The cases live in one module per op (``dsv4ref/conformance/<op>.py``), named in :data:`OPS`. Each such
module exposes

* ``OUTPUTS``: ``{"<op>.<function>": extract(result, args) -> {output name: tensor}}``: what to compare,
  taken from the function's return value and, for in-place ops, from its (mutated) arguments;
* ``cases() -> list[Case]``: the op's adversarial input sets, without expected outputs;
* optionally ``mass(case) -> {output name: tensor}``: for outputs compared under the tolerance
  "bf16_weighted_sum", Σ_j p_j·|v_j|, the scale their rounding error grows with.

A new op (moe, mtp, compressor …) adds one module and one entry in :data:`OPS`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pathlib
from dataclasses import dataclass, field
from types import ModuleType
from collections.abc import Callable

import torch

from ..device import DEVICE
from ..tolerances import TOLERANCES, Report, compare
from ..validate import checking_values

__all__ = [
    "OPS",
    "Case",
    "Row",
    "op_modules",
    "outputs",
    "all_cases",
    "default_impls",
    "reference_impls",
    "run",
    "format_report",
    "save_golden",
    "load_golden",
    "tolerance_record",
]

#: The ops whose cases the suite runs, in report order: one module ``dsv4ref.conformance.<op>`` each.
OPS = ("fp8", "kv_cache", "rope", "sparse_mla", "mhc", "indexer", "moe", "compressor", "mtp", "linear")


@dataclass
class Case:
    """One input set for one op function.

    ``op``: "<op>.<function>" (e.g. "sparse_mla.decode"); ``inputs`` maps argument names to values, in
    signature order; ``positional`` names those passed positionally (the rest go by keyword).
    ``expected`` maps output names to the reference's tensors, ``tol`` output names to a row of
    :data:`dsv4ref.tolerances.TOLERANCES`; ``mass`` maps an output compared under "bf16_weighted_sum" to
    its Σ_j p_j·|v_j|. ``why``: what the case guards against."""

    op: str
    name: str
    inputs: dict
    positional: tuple
    expected: dict = field(default_factory=dict)
    tol: dict = field(default_factory=dict)
    why: str = ""
    mass: dict = field(default_factory=dict)
    check_values: bool = True  # False: run with value checks off (non-finite input under the documented policy)


@dataclass
class Row:
    """One compared output: ``report`` is None when the implementation raised (``error`` says what)."""

    op: str
    case: str
    output: str
    report: Report | None
    error: str = ""

    @property
    def passed(self) -> bool:
        return self.report is not None and self.report.passed


# ----------------------------------------------------------------------------------------------------
# the op modules and the library's own implementations
# ----------------------------------------------------------------------------------------------------


def op_modules() -> dict[str, ModuleType]:
    """{op: its cases module} for every op of :data:`OPS`."""
    return {op: importlib.import_module(f"{__package__}.{op}") for op in OPS}


def outputs() -> dict[str, Callable[[object, dict], dict]]:
    """{"<op>.<function>": output extractor} over every op module."""
    return {name: f for m in op_modules().values() for name, f in m.OUTPUTS.items()}


def _fn(op: str, backend: str | None):
    """The library function of ``op`` with ``backend`` bound (if given and the function takes one)."""
    mod, name = op.split(".")
    f = getattr(importlib.import_module(f"dsv4ref.{mod}"), name)
    if backend and "backend" in inspect.signature(f).parameters:
        return functools.partial(f, backend=backend)
    return f


def _available_ops() -> list[str]:
    ops = []
    for op in outputs():
        try:
            _fn(op, None)
        except (ImportError, AttributeError):
            continue
        ops.append(op)
    return ops


def default_impls() -> dict[str, Callable]:
    """Every op function that exists in this checkout, through its default backend (``backend="auto"``:
    the Triton kernel wherever the op has one)."""
    return {op: _fn(op, "auto") for op in _available_ops()}


def reference_impls() -> dict[str, Callable]:
    """Every op function through its torch reference (``backend="reference"``): the suite's own oracle
    (a sanity run; must all PASS)."""
    return {op: _fn(op, "reference") for op in _available_ops()}


# ----------------------------------------------------------------------------------------------------
# cases and running
# ----------------------------------------------------------------------------------------------------


def all_cases(only: str | None = None, *, with_expected: bool = True) -> list[Case]:
    """Every case of every op present in this checkout (``only``: an op-name prefix such as "mhc" or
    "sparse_mla.decode"), with the expected outputs computed by the references on :data:`DEVICE`."""
    avail = set(_available_ops())
    mods = op_modules()
    cases = []
    for op, mod in mods.items():
        if only and not (op.startswith(only) or only.startswith(op)):
            continue
        if not any(name.startswith(op + ".") for name in avail):
            continue
        cases += [c for c in mod.cases() if c.op in avail and (not only or c.op.startswith(only))]
    if with_expected:
        ref = reference_impls()
        for c in cases:
            c.expected = {k: v.detach().cpu() for k, v in _call(ref[c.op], c).items()}
            mass = getattr(mods[c.op.split(".")[0]], "mass", None)
            if mass is not None:
                c.mass = {k: v.detach().cpu() for k, v in mass(c).items()}
    return cases


def to_device(v, device=None):
    """A fresh copy of a tensor on ``device`` (default :data:`DEVICE`); other values unchanged."""
    return v.clone().to(device or DEVICE) if isinstance(v, torch.Tensor) else v


def _call(impl: Callable, case: Case, device=None) -> dict:
    args = {k: to_device(v, device) for k, v in case.inputs.items()}  # fresh copies: ops mutate
    pos = [args[k] for k in case.positional]
    kw = {k: v for k, v in args.items() if k not in case.positional}
    with checking_values(case.check_values):
        return outputs()[case.op](impl(*pos, **kw), args)


def run(impls: dict[str, Callable] | None = None, cases: list[Case] | str | None = None) -> list[Row]:
    """Run each case whose op is in ``impls`` and compare its outputs with the case's expected ones.

    Args:
        impls: {"<op>.<function>": callable with the library's signature}; default :func:`default_impls`.
        cases: a list of :class:`Case` (e.g. :func:`load_golden`), an op-name prefix, or None for all.

    Returns: one :class:`Row` per (case, output); an implementation that raises gives FAIL rows
    carrying the error."""
    impls = default_impls() if impls is None else impls
    if cases is None or isinstance(cases, str):
        cases = all_cases(cases)
    rows = []
    for c in cases:
        if c.op not in impls:
            continue
        try:
            got = _call(impls[c.op], c)
        except Exception as e:  # noqa: BLE001 - a crash is a FAIL, reported with its message
            rows += [Row(c.op, c.name, o, None, f"{type(e).__name__}: {e}") for o in c.expected]
            continue
        for o, exp in c.expected.items():
            if o not in got:
                rows.append(Row(c.op, c.name, o, None, "output missing"))
                continue
            m = c.mass.get(o)
            rows.append(
                Row(
                    c.op,
                    c.name,
                    o,
                    compare(got[o], exp.to(got[o].device), c.tol[o], o, None if m is None else m.to(got[o].device)),
                )
            )
    return rows


def format_report(rows: list[Row], details: bool = True) -> str:
    """A table, one line per (case, output), and a last line "N passed, M failed". ``details=False``
    leaves out error magnitudes and messages (notebooks print only verdicts, so CPU and GPU outputs match)."""
    head = f"{'op':<26} {'case':<40} {'output':<12} {'tolerance':<10} verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        tol = r.report.tol if r.report else "-"
        v = "PASS" if r.passed else "FAIL" + (" " + (r.error or (r.report.detail if r.report else "")) if details else "")
        lines.append(f"{r.op:<26} {r.case:<40} {r.output:<12} {tol:<10} {v}")
    n_fail = sum(not r.passed for r in rows)
    lines.append(f"{len(rows) - n_fail} passed, {n_fail} failed")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# golden vectors (docs/conformance.md#golden-files)
# ----------------------------------------------------------------------------------------------------


def save_golden(directory, cases: list[Case] | None = None) -> list[pathlib.Path]:
    """Write each case to ``directory/<op>__<case>.pt``: a dict with keys op, case, why, positional
    (argument names passed positionally, in order), inputs (name → tensor or number), expected (output
    name → tensor), tolerance (output name → {name, mode, atol, rtol, cos}), mass (output name →
    tensor), and ``check_values=False`` only for a case that runs with value checks off (non-finite input
    under the documented policy). Returns the paths written."""
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for c in cases if cases is not None else all_cases():
        p = d / f"{c.op}__{c.name}.pt"
        torch.save(
            dict(
                op=c.op,
                case=c.name,
                why=c.why,
                positional=list(c.positional),
                inputs={k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in c.inputs.items()},
                expected={k: v.cpu().clone() for k, v in c.expected.items()},
                tolerance=tolerance_record(c),
                mass={k: v.cpu().clone() for k, v in c.mass.items()},
                **({} if c.check_values else {"check_values": False}),
            ),
            p,
        )
        paths.append(p)
    return paths


def tolerance_record(case: Case) -> dict:
    """The ``tolerance`` entry of a golden file: output name → {name, mode, atol, rtol, cos}."""
    return {
        o: dict(name=t, mode=TOLERANCES[t].mode, atol=TOLERANCES[t].atol, rtol=TOLERANCES[t].rtol, cos=TOLERANCES[t].cos)
        for o, t in case.tol.items()
    }


def load_golden(directory) -> list[Case]:
    """The cases stored by :func:`save_golden` in ``directory`` (expected outputs as stored, not recomputed)."""
    cases = []
    for p in sorted(pathlib.Path(directory).glob("*.pt")):
        d = torch.load(p, weights_only=True)
        cases.append(
            Case(
                d["op"],
                d["case"],
                d["inputs"],
                tuple(d["positional"]),
                d["expected"],
                {o: t["name"] for o, t in d["tolerance"].items()},
                d["why"],
                d.get("mass", {}),
                d.get("check_values", True),
            )
        )
    return cases
