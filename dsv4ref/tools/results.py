"""The measured GPU figures, as the notebooks show them: one op's section of ``benchmarks/RESULTS.md``.

``benchmarks/write_results.py`` writes that file from the newest one-run bench log (date, device, the
ceilings measured in the same run). A notebook that talks about performance prints the op's table from it,
so every figure it shows comes from that data and none is typed into its prose.
"""

from __future__ import annotations

import pathlib
import re

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "RESULTS.md"

__all__ = ["RESULTS", "results_header", "results_section"]


def results_header(path: pathlib.Path = RESULTS) -> str:
    """The lines that say where the figures come from: date, device, log, ceilings."""
    lines = path.read_text().splitlines()
    return "\n".join(ln for ln in lines if ln.startswith(("**Date**", "**Ceilings")))


def results_section(op: str, path: pathlib.Path = RESULTS) -> str:
    """The markdown of ``## <op>: ...`` up to the next ``## `` heading (the op's table and its notes).

    Raises ``KeyError`` naming the op when the file has no such section."""
    text = path.read_text()
    m = re.search(rf"^## {re.escape(op)}\b.*?(?=^## |\Z)", text, flags=re.S | re.M)
    if m is None:
        raise KeyError(f"op: no section '## {op}' in {path.name}")
    return m.group(0).rstrip()
