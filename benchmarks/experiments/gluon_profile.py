"""Run the Gluon sparse-MLA kernel a few times at one bench shape, for a profiler to attach to (GPU only).

    ncu --kernel-name regex:_ws_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \\
        --section WarpStateStats --section SchedulerStats python3 benchmarks/experiments/gluon_profile.py [H K SPLITS]

Default shape: T 64, H 64, K 640 (the bench's first), the default launch (or the given list splits). Prints nothing but a
line per call; the profiler's report is what this is for (which unit is busy, what the warps wait on).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from sparse_mla_gluon import gluon, inputs  # noqa: E402

from dsv4ref.device import synchronize  # noqa: E402


def main(argv):
    H, K = (int(argv[0]), int(argv[1])) if len(argv) >= 2 else (64, 640)
    splits = int(argv[2]) if len(argv) >= 3 else None
    q, pools, sink = inputs(64, H, K, 1)[0][:3]
    for i in range(6):
        gluon(q, pools, sink, None, splits)
        synchronize()
        print(f"call {i} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
