"""benchmarks/RESULTS.md and README.md's results excerpt are written by benchmarks/write_results.py from the
bench logs in benchmarks/runs/: a hand edit of either (or a changed default with no new bench) fails here."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("write_results", ROOT / "benchmarks" / "write_results.py")
W = sys.modules["write_results"] = importlib.util.module_from_spec(_spec)  # (dataclasses look their module up)
_spec.loader.exec_module(W)


def test_results_and_readme_match_the_logs():
    assert W.main(["--check"]) == 0, "run: python benchmarks/write_results.py"


def test_check_fails_on_a_hand_edit(monkeypatch, tmp_path):
    edited = tmp_path / "RESULTS.md"
    edited.write_text(W.RESULTS.read_text().replace("89.9 %", "91.0 %", 1))
    monkeypatch.setattr(W, "RESULTS", edited)
    assert W.main(["--check"]) == 1


_LOG = """cuda (NVIDIA H200); torch 2.11.0+cu130; triton 3.6.0
ceilings measured now: copy 4.11 TB/s (read + write), bf16 matmul 786 TFLOP/s
op                         shape                                      time us     GB/s  TFLOP/s of bound  bytes counted
-----------------------------------------------------------------------------------------------------------------------
kv_cache.insert            S=65536 B=64                                  28.7     3695      0.0    89.9%  kv 1024 B/token
kv_cache.insert[same-size copy uint8] S=65536 B=64                                  27.3     3880      0.0    94.4%  copy
/some/warning.py:1: UserWarning: 12.5 34 5.0 6.0%  not a row: before it, no op
mhc.fused_post_pre one-pass T=4096 Hd=4096 s3: BLOCK_T=128 (528 programs)     309.4     1092     10.4    26.6%  as above
compressor.compress (torch reference) r=4 R=64 Hd=4096, boundary step           1755.4       11      0.6     0.3%  rows
decode.step                tiny T=4 replay alone                       1846.9       21      0.0     0.5%  device part
mhc.pre BLOCK_T=64: skipped (OutOfResources: ...)
sparse_mla.gluon T=64 H=64 K=640: FAILED RuntimeError: boom
"""


def test_parser_splits_op_and_shape():
    log = W.parse_bench(_LOG, "x.log")
    assert (log.device, log.versions, log.copy_tbs, log.bf16_tflops) == (
        "NVIDIA H200 (cuda)",
        "torch 2.11.0+cu130, triton 3.6.0",
        "4.11",
        "786",
    )
    got = [(r.op, r.shape, r.us, r.frac) for r in log.rows]
    assert got == [
        ("kv_cache.insert", "S=65536 B=64", "28.7", "89.9"),
        ("kv_cache.insert[same-size copy uint8]", "S=65536 B=64", "27.3", "94.4"),
        ("mhc.fused_post_pre one-pass", "T=4096 Hd=4096 s3: BLOCK_T=128 (528 programs)", "309.4", "26.6"),
        ("compressor.compress (torch reference)", "r=4 R=64 Hd=4096, boundary step", "1755.4", "0.3"),
        ("decode.step", "tiny T=4 replay alone", "1846.9", "0.5"),
    ]
    assert log.failed == ["sparse_mla.gluon T=64 H=64 K=640: FAILED RuntimeError: boom"]
    assert W.peers(log, log.rows[0]) == ["same-size uint8 copy 27.3 µs (94.4 %)"]
    with pytest.raises(LookupError):
        log.find("sparse_mla.gluon", "T=64 H=64 K=640")  # failed in the run: no row, a clear error


def test_parser_refuses_other_logs():
    with pytest.raises(ValueError):
        W.parse_bench("== 5 passed in 3.2 s ==\n", "unit.log")
    with pytest.raises(ValueError):
        W.parse_mhc_sweep("[  4.4 s] copy ceiling (512 MiB) 3.98 TB/s; cuda\n", "sweep.log")


def test_notebook_links_resolve_from_the_notebooks_folder():
    """results_header / results_section print RESULTS.md's links relative to notebooks/, where the notebooks
    show them (a log link copied as ``runs/...`` pointed at notebooks/runs/, which does not exist)."""
    import re

    from dsv4ref.tools.results import NOTEBOOKS, results_header, results_section

    text = results_header() + "\n" + "\n".join(results_section(op) for op in ("moe", "sparse_mla", "kv_cache"))
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]
    assert links, "RESULTS.md's header names its log"
    missing = [t for t in links if not (NOTEBOOKS / t).exists()]
    assert not missing, missing
