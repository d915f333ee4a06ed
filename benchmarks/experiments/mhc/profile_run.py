"""Run mHC pre (or fused post+pre) a few times at the bench's shape, for a profiler to attach to (GPU only).

    ncu --kernel-name regex:hc_chunk_partial --launch-skip 3 --launch-count 1 --section SourceCounters \\
        --section WarpStateStats python3 benchmarks/experiments/mhc/profile_run.py [pre|fused] [T Hd] [one-pass]

Default: pre at T = Hd = 4096 with the default launch (``one-pass``: the one-pass design). Prints nothing but a line per call; the
profiler's report is what this is for (which instructions the warps wait on).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

from dsv4ref.device import synchronize  # noqa: E402
from dsv4ref.mhc import example_params, example_streams, fused_post_pre, pre  # noqa: E402
from dsv4ref.mhc.launch import OnePassLaunch, default_launch  # noqa: E402
from dsv4ref.testing import randn  # noqa: E402


def main(argv):
    op = argv[0] if argv else "pre"
    T, Hd = (int(argv[1]), int(argv[2])) if len(argv) >= 3 else (4096, 4096)
    launch = OnePassLaunch() if "one-pass" in argv else default_launch("fused_post_pre" if op == "fused" else "pre")
    res = example_streams(T, Hd, seed=1)
    fn, scale, base = example_params(Hd, seed=2)
    if op == "fused":
        x = randn((T, Hd), seed=3, octaves=8)
        p, c, _ = pre(res, fn, scale, base)
    for i in range(6):
        if op == "fused":
            fused_post_pre(x, res, p, c, fn, scale, base, launch=launch)
        else:
            pre(res, fn, scale, base, launch=launch)
        synchronize()
        print(f"{op} call {i} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
