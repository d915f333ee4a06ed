"""Summarise the per-instruction warp-stall samples that ``STAGES=sass bash scripts/gpu-check.sh`` exports
(ncu's source page as CSV, one row per SASS instruction), on any machine, no GPU needed.

    python3 benchmarks/experiments/sass_summary.py gpu-out/sass_gluon_h128.csv [--top 25]

A warp-specialised Gluon kernel's SASS holds its partitions one after another, each starting with the
``USETMAXREG`` that sets its register budget, so the rows are split there into regions. Per region: its
share of the samples, the instructions it executed, its HGMMA / STS / LDG counts (which say whose code it is:
the MMA partitions issue HGMMA, the producers LDG and STS) and its top stall reasons. Then the instructions
holding the most samples, with theirs. Stall names are ncu's (``long_sb``: waiting on a global / local memory
result or an mbarrier try-wait; ``barrier``: a named barrier or warpgroup wait; ``wait``: a fixed-latency
dependency; ``selected``: issuing).
"""

from __future__ import annotations

import argparse
import csv
import sys


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def load(path: str):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[at]
    col = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]
    body = [r for r in rows[at + 1 :] if len(r) == len(hdr)]
    return body, col, stalls


def _top(samples: dict, n: int = 5) -> str:
    tot = sum(samples.values()) or 1.0
    best = sorted(samples.items(), key=lambda kv: -kv[1])[:n]
    return " ".join(f"{k.removeprefix('stall_')}:{100 * v / tot:.0f}" for k, v in best if v > 0)


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    body, col, stalls = load(args.csv)
    if not body:
        print(f"{args.csv}: no instruction rows", file=sys.stderr)
        return 1
    S, X, SRC = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"], col["Source"]
    total = sum(_num(r[S]) for r in body) or 1.0
    starts = [0] + [i for i, r in enumerate(body) if "USETMAXREG" in r[SRC]] + [len(body)]
    print(f"{len(body)} instructions, {total:.0f} samples; regions split at USETMAXREG")
    for a, b in zip(starts, starts[1:]):
        if a == b:
            continue
        reg = body[a:b]
        smp = sum(_num(r[S]) for r in reg)
        src = [r[SRC] for r in reg]
        count = {k: sum(k in s for s in src) for k in ("HGMMA", "STS", "LDG", "SYNCS")}
        why = {h: sum(_num(r[col[h]]) for r in reg) for h in stalls}
        print(
            f"[{a:5d}, {b:5d}) {100 * smp / total:5.1f}% of samples  executed {sum(_num(r[X]) for r in reg):12.0f}  "
            f"HGMMA {count['HGMMA']} STS {count['STS']} LDG {count['LDG']} SYNCS {count['SYNCS']}  {_top(why)}"
        )
    print(f"\ntop {args.top} instructions by samples")
    for i in sorted(range(len(body)), key=lambda i: -_num(body[i][S]))[: args.top]:
        r = body[i]
        why = {h: _num(r[col[h]]) for h in stalls}
        print(f"{i:5d} {100 * _num(r[S]) / total:5.1f}%  ex {_num(r[X]):9.0f}  {r[SRC][:60]:<60} {_top(why, 3)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
