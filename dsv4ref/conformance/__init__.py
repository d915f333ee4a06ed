"""Conformance suite: hold ANY implementation of dsv4ref's public ops to the references.

An implementation is a callable with our public signature (an XPU port, a vLLM kernel behind a thin
adapter, a reader's own attempt). :func:`run` feeds it the adversarial cases our tests use and compares
what it returns (or writes, for in-place ops) with the reference's output under a named row of
:data:`dsv4ref.tolerances.TOLERANCES`::

    from dsv4ref import conformance
    report = conformance.run({"sparse_mla.decode": my_decode})        # only the ops you map are run
    print(conformance.format_report(report))

The cases cover what has broken real DSV4 kernels: per-block scales over many octaves, amax = 448·2^k
blocks, odd page sizes B = 61 and B = 2, −1 slots and slot lists shorter than the batch, −1 inside a
slot prefix, empty rows and ±inf sinks, padded heads with −inf sinks, the inverse RoPE on the output,
the causal top-k mask and mHC's transposed-comb trap. Caches that an op should leave alone start as
random bytes, so a stray write shows. They live in one module per op (:mod:`.kv_cache`, :mod:`.rope`,
:mod:`.sparse_mla`, :mod:`.mhc`, :mod:`.indexer`), listed in :data:`OPS`; the runner is :mod:`.suite`.

The same cases, frozen, are the golden vectors (``scripts/make_golden.py`` → ``golden/*.pt``): plain
``torch.save`` dicts of named tensors (inputs, expected outputs, tolerances) that a C++/SYCL port can
read with libtorch (``torch::pickle_load``) or any .pt reader, without running our Python.

``python -m dsv4ref.conformance [OP_PREFIX] [--golden DIR] [--reference]`` prints the report
(:func:`main`). How to run it against your own callables: ``docs/conformance.md``.
"""

from __future__ import annotations

from .suite import (
    OPS,
    Case,
    Row,
    all_cases,
    default_impls,
    format_report,
    load_golden,
    outputs,
    reference_impls,
    run,
    save_golden,
)

__all__ = [
    "Case",
    "Row",
    "OPS",
    "run",
    "all_cases",
    "default_impls",
    "reference_impls",
    "format_report",
    "save_golden",
    "load_golden",
    "main",
]


def main(argv=None) -> int:
    """``python -m dsv4ref.conformance [OP_PREFIX ...] [--golden DIR] [--reference]``: run the suite on this
    checkout's kernels (or its references) and print the report.

    Returns the exit code: 0 when every row passed, 1 on any FAIL, 2 when nothing ran (an op prefix that
    names no case, a golden directory without ``*.pt`` files)."""
    import argparse
    import pathlib
    import sys

    ap = argparse.ArgumentParser(prog="python -m dsv4ref.conformance", description=main.__doc__)
    ap.add_argument("op", nargs="*", help="only ops whose name starts with one of these (e.g. mhc, sparse_mla.decode)")
    ap.add_argument("--golden", metavar="DIR", help="run the golden cases stored in DIR (*.pt) instead")
    ap.add_argument("--reference", action="store_true", help="check the torch references instead of the kernels")
    a = ap.parse_args(argv)
    if a.golden:
        if not pathlib.Path(a.golden).is_dir():
            print(f"conformance: --golden {a.golden}: no such directory", file=sys.stderr)
            return 2
        cases = load_golden(a.golden)
    else:  # an unknown op is refused before any case is built (building them all runs every reference)
        cases = None
    if a.op:
        known = sorted({c.op for c in cases}) if a.golden else list(outputs())
        unknown = [x for x in a.op if not any(name.startswith(x) for name in known)]
        if unknown:
            print(f"conformance: no case for {', '.join(unknown)}; ops: {', '.join(known)}", file=sys.stderr)
            return 2
    if cases is None:
        cases = all_cases(a.op[0] if len(a.op) == 1 else None)
    if a.op:
        cases = [c for c in cases if any(c.op.startswith(x) for x in a.op)]
    rows = run(reference_impls() if a.reference else default_impls(), cases)
    print(format_report(rows))
    if not rows:
        print("conformance: no case ran" + (f" (no *.pt files in {a.golden})" if a.golden else ""), file=sys.stderr)
        return 2
    return 0 if all(r.passed for r in rows) else 1
