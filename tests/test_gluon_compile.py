"""The Hopper Gluon kernels compile for sm_90a with the Triton installed here, on any machine: no GPU is
needed to compile (``triton.compile`` with a CUDA target and the ptxas Triton ships). This is what catches
Gluon API drift between Triton releases on a CPU-only CI: Triton 3.9 renamed a cp.async builtin every
kernel used, which no GPU test could see (the GPU machine runs 3.6). Whether the kernels are *right* is
``tests/test_sparse_mla_gluon.py``'s job, on a GPU.

It runs ``benchmarks/gluon_compile_check.py --defaults`` in a fresh interpreter: in this process Triton was
imported with ``TRITON_INTERPRET`` set (``dsv4ref.device`` sets it on a CPU machine), which makes Triton's
own reduction helpers interpreted functions that a compiled Gluon kernel cannot call."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from dsv4ref.sparse_mla import gluon as G

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gluon_compile_check.py"


def test_default_kernels_compile_for_sm90():
    """The kernel ``decode_gluon`` launches by default at each bench shape's (H, list splits) compiles, within
    Hopper's shared memory: the 64-row warp-specialised kernel at split 2 (partials) and split 1 (output
    staged through shared memory), and the narrow kernel at H 16."""
    if G.kernels() is None:
        pytest.skip(f"this Triton has no usable Gluon: {G.import_error()!r}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--no-stats", "--defaults"], env=env, capture_output=True, text=True, timeout=600
    )
    report = "\n".join(ln for ln in (r.stdout + r.stderr).splitlines() if "leaked" not in ln and "nanobind" not in ln)
    if "ptxas" in report and "No such file" in report:
        pytest.skip("this Triton install ships no ptxas")
    assert r.returncode == 0, report[-4000:]
    assert report.count(" ok ") == 3, report[-4000:]
