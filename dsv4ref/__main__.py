"""Command line: ``python -m dsv4ref check | bench [OP] | demo | info``."""

from __future__ import annotations

import argparse
import sys


def _cmd_info(args) -> int:
    from .device import describe
    from .harness import load_ops

    print(describe())
    print("ops:", ", ".join(load_ops()))
    return 0


def _cmd_check(args) -> int:
    from .device import DEVICE
    from .harness import run_checks

    rows = run_checks(args.op)
    head = f"{'op':<28} {'shape':<34} {'device':<7} {'max abs err':>11} {'max rel err':>11}  {'tolerance':<16} verdict"
    print(head)
    print("-" * len(head))
    failed = 0
    for r in rows:
        rep = r.report
        failed += not rep.passed
        print(f"{r.op:<28} {r.shape:<34} {DEVICE.type:<7} {rep.max_abs:>11.3g} {rep.max_rel:>11.3g}  {rep.tol:<16} "
              f"{'PASS' if rep.passed else 'FAIL ' + rep.detail}")
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _cmd_bench(args) -> int:
    from .device import DEVICE, describe
    from .harness import run_benches

    if DEVICE.type == "cpu":
        print("bench: running on the CPU, where Triton kernels are interpreted by numpy: timings there mean "
              "nothing. Run on a GPU (CUDA or Intel XPU) to benchmark.")
        return 0
    print(describe())
    from .harness import measure_ceilings

    ceil = measure_ceilings()
    print(f"ceilings measured now: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s (read + write), "
          f"bf16 matmul {ceil.bf16_flops_per_s / 1e12:.0f} TFLOP/s")
    head = f"{'op':<26} {'shape':<40} {'time us':>9} {'GB/s':>8} {'TFLOP/s':>8} {'of bound':>8}  bytes counted"
    print(head)
    print("-" * len(head), flush=True)

    def show(r):
        c = r.case
        print(f"{c.op:<26} {c.shape:<40} {r.ms * 1e3:>9.1f} {r.bytes_per_s / 1e9:>8.0f} {r.flops_per_s / 1e12:>8.1f} "
              f"{r.fraction:>8.1%}  {c.note}", flush=True)

    run_benches(args.op or None, ceil, on_row=show)
    return 0


def _cmd_demo(args) -> int:
    try:
        from .decode import demo
    except ModuleNotFoundError:
        print("demo: the decode step (dsv4ref.decode) is not built yet")
        return 1
    return demo(steps=args.steps)


def _cmd_conformance(args) -> int:
    from .conformance import main as conformance_main

    return conformance_main(args.rest)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4ref", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="device, versions and available ops").set_defaults(fn=_cmd_info)
    c = sub.add_parser("check", help="run every Triton kernel against its reference; exit 1 on any FAIL")
    c.add_argument("op", nargs="?", help="only ops whose name starts with this")
    c.set_defaults(fn=_cmd_check)
    b = sub.add_parser("bench", help="time the kernels against this device's measured ceilings (GPU only)")
    b.add_argument("op", nargs="*", help="only ops whose name starts with one of these, in this order")
    b.set_defaults(fn=_cmd_bench)
    cf = sub.add_parser("conformance", help="run the conformance suite (your kernels vs the references, "
                        "or --golden DIR); see dsv4ref/conformance.py", add_help=False)
    cf.add_argument("rest", nargs=argparse.REMAINDER)
    cf.set_defaults(fn=_cmd_conformance)
    d = sub.add_parser("demo", help="prefill + decode with the teaching config")
    d.add_argument("--steps", type=int, default=16)
    d.set_defaults(fn=_cmd_demo)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
