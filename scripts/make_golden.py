"""Write the conformance suite's cases as golden vectors: golden/<op>__<case>.pt.

Each case is written twice: ``<op>__<case>.safetensors`` (language-neutral; golden/README.md) and
``<op>__<case>.pt``, a plain ``torch.save`` dict (load with ``torch.load(path, weights_only=True)`` in Python,
or ``torch::pickle_load`` in libtorch C++)::

    op          "sparse_mla.decode"                       the dsv4ref function
    case        "two_pools_minus1_empty_row_inf_sinks"    the case name
    why         what the case guards against (#N: the pitfall numbers of docs/conformance.md)
    positional  ["q", "cache", "slots", "lengths"]        argument names passed positionally, in order
    inputs      {name: tensor or number}                  every argument (keyword ones included)
    expected    {output name: tensor}                     what the reference returns (or writes, for in-place ops)
    tolerance   {output name: {name, mode, atol, rtol, cos}}   how to compare (dsv4ref.tolerances.TOLERANCES)
    mass        {output name: tensor}                     for mode "mass": |got − expected| <= atol + rtol·(|expected| + mass)

Expected outputs come from the torch references on the CPU. For in-place ops (kv_cache.insert,
rope.qnorm_rope_kv_insert, indexer.insert_k) the expected tensor is the whole buffer after the call:
the input buffer starts as random bytes, so bytes that must stay untouched are checked too.

    python scripts/make_golden.py            # write golden/ for the cases of this checkout
    python scripts/make_golden.py --recompute moe.route    # recompute these ops' expected outputs (a fixed reference)
    python scripts/make_golden.py --all      # recompute every expected output, even of unchanged cases
    python -m dsv4ref.conformance --golden golden     # check this checkout's kernels against them

A case whose stored inputs, argument order and tolerance rows are those the suite builds now keeps its
stored expected outputs (only ``why`` and the tolerance figures are refreshed): a float output recomputed on
another machine can differ in its last fp32 bits (the order of a reduction), and frozen vectors should not
move for that. New or changed cases get fresh expected outputs; files of cases that no longer exist go.

The format and how a port uses the files: docs/conformance.md#golden-files.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile

os.environ.setdefault("DSV4REF_DEVICE", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import dsv4ref  # noqa: E402,F401  (picks the device before any kernel module loads)
from dsv4ref import conformance  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _same(a, b) -> bool:
    """Equal values, bit for bit (tensors: dtype, shape and bytes; NaN payloads included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.flatten().contiguous().view(torch.uint8), b.flatten().contiguous().view(torch.uint8))
        )
    return a == b


def _same_safetensors(a: pathlib.Path, b: pathlib.Path) -> bool:
    """The same header (tensor entries and metadata, whatever their order in the JSON) and the same bytes."""

    def parts(p):
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        return json.loads(raw[8 : 8 + n]), raw[8 + n :]

    return parts(a) == parts(b)


def _unchanged(stored: conformance.Case, now: conformance.Case) -> bool:
    return (
        list(stored.inputs) == list(now.inputs)
        and stored.positional == now.positional
        and stored.tol == now.tol
        and stored.check_values == now.check_values
        and all(_same(stored.inputs[k], v) for k, v in now.inputs.items())
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="recompute the expected outputs of every case")
    ap.add_argument(
        "--recompute",
        action="append",
        default=[],
        metavar="OP_PREFIX",
        help="recompute the expected outputs of the ops whose name starts with this (repeatable)",
    )
    a = ap.parse_args(argv)
    out = ROOT / "golden"
    missing = sorted(set(conformance.suite.outputs()) - set(conformance.suite._available_ops()))
    if missing:  # an op that does not import would lose its golden files below (its cases "no longer exist")
        print(f"make_golden: {', '.join(missing)} not importable in this checkout; golden/ left as it is", file=sys.stderr)
        return 1
    stored = {} if a.all else {(c.op, c.name): c for c in conformance.load_golden(out)}
    cases, kept, write = conformance.all_cases(), 0, []
    for c in cases:
        s = stored.get((c.op, c.name))
        if s is not None and _unchanged(s, c) and not any(c.op.startswith(x) for x in a.recompute):
            c.expected, c.mass = s.expected, s.mass
            kept += 1
            raw = torch.load(out / f"{c.op}__{c.name}.pt", weights_only=True)
            if raw["why"] == c.why and raw["tolerance"] == conformance.suite.tolerance_record(c):
                continue  # nothing to change: leave the file (and its bytes) alone
        write.append(c)
    names = {f"{c.op}__{c.name}.pt" for c in cases}
    for old in out.glob("*.pt"):
        if old.name not in names or any(old.name == f"{c.op}__{c.name}.pt" for c in write):
            old.unlink()
    paths = conformance.save_golden(out, write)
    for p in paths:
        print(f"wrote {p.relative_to(ROOT)}  {p.stat().st_size / 1024:.0f} KiB")
    # the same cases, language-neutral (golden/README.md), from the .pt files just settled. safetensors writes
    # its metadata map in no fixed order, so a file is replaced only where its contents change: the bytes of an
    # unchanged case stay as they are
    from dsv4ref.conformance import safetensors_io

    for old in out.glob("*.safetensors"):
        if old.with_suffix(".pt").name not in names:
            old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        for new in safetensors_io.save(tmp, conformance.load_golden(out)):
            dst = out / new.name
            if not (dst.exists() and _same_safetensors(dst, new)):
                shutil.copyfile(new, dst)
    total = sum(p.stat().st_size for p in out.glob("*.pt"))
    print(
        f"{len(cases)} cases, {total / 2**20:.2f} MiB in golden/; {len(paths)} files written; {kept} kept their "
        f"stored expected outputs, {len(cases) - kept} computed now"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
