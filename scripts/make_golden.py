"""Write the conformance suite's cases as golden vectors: golden/<op>__<case>.pt.

Each file is a plain ``torch.save`` dict (load with ``torch.load(path, weights_only=True)`` in Python,
or ``torch::pickle_load`` in libtorch C++)::

    op          "sparse_mla.decode"                       the dsv4ref function
    case        "two_pools_minus1_empty_row_inf_sinks"    the case name
    why         what the case guards against (pitfalls.md numbers)
    positional  ["q", "cache", "indices", "lengths"]      argument names passed positionally, in order
    inputs      {name: tensor or number}                  every argument (keyword ones included)
    expected    {output name: tensor}                     what the reference returns (or writes, for in-place ops)
    tolerance   {output name: {name, mode, atol, rtol, cos}}   how to compare (dsv4ref.testing.TOLERANCES)
    mass        {output name: tensor}                     for mode "mass": |got − expected| <= atol + rtol·(|expected| + mass)

Expected outputs come from the torch references on the CPU. For in-place ops (kv_cache.insert,
rope.qnorm_rope_kv_insert, indexer.insert_k) the expected tensor is the whole buffer after the call:
the input buffer starts as random bytes, so bytes that must stay untouched are checked too.

    python scripts/make_golden.py            # rewrite golden/
    python -m dsv4ref.conformance --golden golden     # check this checkout's kernels against them
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("DSV4REF_DEVICE", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import dsv4ref  # noqa: E402,F401  (picks the device before any kernel module loads)
from dsv4ref import conformance  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> int:
    out = ROOT / "golden"
    for old in out.glob("*.pt"):
        old.unlink()
    paths = conformance.save_golden(out, conformance.all_cases())
    total = sum(p.stat().st_size for p in paths)
    for p in paths:
        print(f"{p.relative_to(ROOT)}  {p.stat().st_size / 1024:.0f} KiB")
    print(f"{len(paths)} files, {total / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
