"""Where the compressor's backends part on non-finite input: the case of
``tests/test_contract_compressor.py::test_nonfinite_x_with_checks_off_is_the_same_on_every_backend`` (a NaN and an
inf in x, value checks off), run through the reference and the Triton kernel, then for each output (the
compressed rows, the done flags, the ring's kv and score state) the places where the two disagree on NaN or inf,
with the first values, and the largest finite difference.

    python benchmarks/experiments/compressor_nonfinite_probe.py        (on the device to probe; prints only)
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))

from test_contract_compressor import INF, NAN, call, fresh, step  # noqa: E402

from dsv4ref import validate  # noqa: E402


def main() -> int:
    d = step((8,))
    d["x"][2, 5] = NAN
    d["x"][6, 9] = INF
    out = {}
    with validate.checking_values(False):
        for be in ("reference", "triton"):
            dd = fresh(d)
            rows, done = call(dd, be)
            out[be] = (rows.cpu(), done.cpu(), dd["state_kv"].cpu(), dd["state_score"].cpu())
    for i, name in enumerate(("rows", "done", "state_kv", "state_score")):
        a, b = out["reference"][i], out["triton"][i]
        if name == "done":
            print(name, a.tolist(), b.tolist())
            continue
        print(
            f"{name} {tuple(a.shape)}: NaN {int(a.isnan().sum())} / {int(b.isnan().sum())}, inf {int(a.isinf().sum())} / {int(b.isinf().sum())} (reference / triton)"
        )
        where = ((a.isnan() != b.isnan()) | (a.isinf() != b.isinf())).nonzero()
        print(f"  NaN/inf differ at {where.shape[0]} places; first: {where[:6].tolist()}")
        for j in where[:6].tolist():
            print("   ", j, float(a[tuple(j)]), float(b[tuple(j)]))
        fin = a.isfinite() & b.isfinite()
        if fin.any():
            print(f"  largest finite |difference|: {float((a[fin] - b[fin]).abs().max()):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
