"""The command line: ``python -m dsv4ref {info,check,bench,conformance,demo} ...``.

Every command exits non-zero when it ran nothing (an unknown op name, an empty golden directory) or when
anything failed, so a script can never mistake "nothing happened" for "all passed". ``--help`` is answered
before torch is imported (:func:`build_parser` needs only argparse).
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = ("info", "check", "bench", "conformance", "demo")


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dsv4ref",
        description="DeepSeek-V4 decode building blocks: check the kernels against their references, benchmark "
        "them, run the conformance suite, or run the decode demo.",
        epilog="commands: " + ", ".join(COMMANDS) + ". `python -m dsv4ref COMMAND --help` for each.",
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    sub.add_parser("info", help="device, versions and the ops present")
    c = sub.add_parser(
        "check", help="every Triton kernel against its reference on this device; exit 1 on any FAIL or when no check matches"
    )
    c.add_argument("op", nargs="*", help="only ops whose name starts with one of these (e.g. kv_cache, rope.apply)")
    b = sub.add_parser("bench", help="time the kernels against this device's measured ceilings (GPU only)")
    b.add_argument("op", nargs="*", help="only ops whose name starts with one of these, in this order")
    b.add_argument(
        "--ladder",
        metavar="JSON",
        help="also write the sparse-MLA ladder (notebook 04) from this run's rows "
        "to JSON (e.g. benchmarks/sparse_mla_ladder.json)",
    )
    cf = sub.add_parser(
        "conformance",
        help="the conformance suite: this checkout's kernels (or --reference) on the "
        "adversarial cases, or on the stored golden vectors (--golden DIR)",
    )
    cf.add_argument("op", nargs="*", help="only ops whose name starts with one of these")
    cf.add_argument("--golden", metavar="DIR", help="run the golden cases stored in DIR (*.pt) instead")
    cf.add_argument("--reference", action="store_true", help="hold the torch references to the suite instead")
    d = sub.add_parser("demo", help="prefill + greedy decode with the teaching config on the picked device")
    d.add_argument("--steps", type=_positive, default=None, help="decode steps (>= 1; default 16, 8 in Triton's CPU interpreter)")
    d.add_argument(
        "--speculate",
        type=int,
        default=0,
        choices=range(0, 8),
        metavar="K",
        help="then decode again with MTP speculation, K drafts per step (1..7): prints the acceptance "
        "rate and checks the tokens equal plain greedy decoding's (0 = off)",
    )
    d.add_argument(
        "--graph",
        action="store_true",
        help="then decode again eagerly and as one replayed device graph per step (value checks off): "
        "prints tokens/s of both and checks the tokens are the same",
    )
    d.add_argument(
        "--weight-format",
        default="bf16",
        choices=("bf16", "v4"),
        help="the projections' weights: bf16 (the teaching config's default) or V4's FP8 / FP4 experts",
    )
    d.add_argument(
        "--moe-path",
        default="deepseek",
        choices=("deepseek", "megamoe"),
        help="with --weight-format v4: which pipeline feeds the FP4 experts (docs/moe.md)",
    )
    return p


def _known(prefixes: list[str], names) -> list[str]:
    """The prefixes that match no name (an unknown op)."""
    names = list(names)
    return [x for x in prefixes if not any(n.startswith(x) for n in names)]


def _cmd_info(args) -> int:
    from ..device import describe
    from .harness import load_ops

    print(describe())
    print("ops:", ", ".join(load_ops()))
    return 0


def _cmd_check(args) -> int:
    from ..device import DEVICE
    from .harness import CHECKS, load_ops, run_checks

    load_ops()
    unknown = _known(args.op, CHECKS)
    if unknown:
        print(f"check: no op named {', '.join(unknown)}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    head = f"{'op':<28} {'shape':<34} {'device':<7} {'max abs err':>11} {'max rel err':>11}  {'tolerance':<17} verdict"
    print(head)
    print("-" * len(head), flush=True)
    n = failed = 0
    for r in run_checks(args.op or None):
        rep = r.report
        n += 1
        failed += not rep.passed
        print(
            f"{r.op:<28} {r.shape:<34} {DEVICE.type:<7} {rep.max_abs:>11.3g} {rep.max_rel:>11.3g}  {rep.tol:<17} "
            f"{'PASS' if rep.passed else 'FAIL ' + rep.detail}",
            flush=True,
        )
    print(f"{n - failed} passed, {failed} failed")
    if n == 0:
        print("check: no check ran", file=sys.stderr)
        return 2
    return 1 if failed else 0


def _cmd_bench(args) -> int:
    from ..device import DEVICE, describe
    from .harness import BENCHES, SUMMARIES, load_ops, measure_ceilings, run_benches

    if DEVICE.type == "cpu":
        print(
            "bench: running on the CPU, where Triton kernels are interpreted by numpy: timings there mean "
            "nothing. Run on a GPU (CUDA or Intel XPU) to benchmark.",
            file=sys.stderr,
        )
        return 2
    load_ops()
    unknown = _known(args.op, BENCHES)
    if unknown:
        print(f"bench: no op named {', '.join(unknown)}; known: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    print(describe())
    ceil = measure_ceilings()
    print(
        f"ceilings measured now: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s (read + write), "
        f"bf16 matmul {ceil.bf16_flops_per_s / 1e12:.0f} TFLOP/s"
    )
    head = f"{'op':<26} {'shape':<40} {'time us':>9} {'GB/s':>8} {'TFLOP/s':>8} {'of bound':>8}  bytes counted"
    print(head)
    print("-" * len(head), flush=True)

    def show(r):
        c = r.case
        print(
            f"{c.op:<26} {c.shape:<40} {r.ms * 1e3:>9.1f} {r.bytes_per_s / 1e9:>8.0f} {r.flops_per_s / 1e12:>8.1f} "
            f"{r.fraction:>8.1%}  {c.note}",
            flush=True,
        )

    _, rows = run_benches(args.op or None, ceil, on_row=show)
    if not rows:
        print("bench: no case ran", file=sys.stderr)
        return 2
    for name, fn in SUMMARIES.items():  # e.g. sparse_mla: our time over a peer's, per shape
        for line in fn(rows) if any(r.case.op.startswith(name) for r in rows) else []:
            print(line, flush=True)
    if args.ladder:  # the sparse-MLA ladder of notebook 04, from this run's rows
        from .cases.sparse_mla import write_ladder

        data = write_ladder(args.ladder, command="python -m dsv4ref bench --ladder " + args.ladder, measured=(ceil, rows))
        pending = [r["key"] for r in data["rungs"] if r["status"] != "measured"]
        print(f"ladder written to {args.ladder}" + (f"; not measured: {', '.join(pending)}" if pending else ""))
    return 0


def _cmd_conformance(args) -> int:
    from .. import conformance

    argv = list(args.op) + (["--golden", args.golden] if args.golden else []) + (["--reference"] if args.reference else [])
    return conformance.main(argv)


def _cmd_demo(args) -> int:
    from ..decode import demo
    from ..decode.demo import check_demo, default_steps

    steps = default_steps() if args.steps is None else args.steps
    try:  # every flag against the teaching config's capacity before any work (a warm-up included)
        check_demo(steps, args.speculate, args.graph, names=("--steps", "--speculate", "--graph"))
    except (TypeError, ValueError) as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    return demo(steps=steps, speculate=args.speculate, graph=args.graph, weight_format=args.weight_format, moe_path=args.moe_path)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return {"info": _cmd_info, "check": _cmd_check, "bench": _cmd_bench, "conformance": _cmd_conformance, "demo": _cmd_demo}[
        args.cmd
    ](args)
