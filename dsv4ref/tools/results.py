"""The measured GPU figures, as the notebooks show them: one op's section of ``benchmarks/RESULTS.md``.

``benchmarks/write_results.py`` writes that file from the newest one-run bench log (date, device, the
ceilings measured in the same run). A notebook that talks about performance prints the op's table from it,
so every figure it shows comes from that data and none is typed into its prose. Links in that file are
relative to ``benchmarks/``; both functions rewrite them relative to ``notebooks/``, where they are shown.
"""

from __future__ import annotations

import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
NOTEBOOKS = ROOT / "notebooks"


def _relink(text: str, path: pathlib.Path) -> str:
    """Markdown links relative to ``path``'s folder, rewritten relative to :data:`NOTEBOOKS` (a link the
    notebook resolves, ``../benchmarks/runs/...``); absolute URLs and anchors stay as they are."""

    def fix(m: re.Match) -> str:
        target = m.group(1)
        if "://" in target or target.startswith(("#", "/")):
            return m.group(0)
        return f"]({pathlib.Path(os.path.relpath(path.parent / target, NOTEBOOKS)).as_posix()})"

    return re.sub(r"\]\(([^)\s]+)\)", fix, text)


__all__ = ["RESULTS", "results_header", "results_section"]


def results_header(path: pathlib.Path = RESULTS) -> str:
    """The lines that say where the figures come from: date, device, log, ceilings."""
    lines = path.read_text().splitlines()
    return _relink("\n".join(ln for ln in lines if ln.startswith(("**Date**", "**Ceilings"))), path)


def results_section(op: str, path: pathlib.Path = RESULTS) -> str:
    """The markdown of ``## <op>: ...`` up to the next ``## `` heading (the op's table and its notes).

    Raises ``KeyError`` naming the op when the file has no such section."""
    text = path.read_text()
    m = re.search(rf"^## {re.escape(op)}\b.*?(?=^## |\Z)", text, flags=re.S | re.M)
    if m is None:
        raise KeyError(f"op: no section '## {op}' in {path.name}")
    return _relink(m.group(0).rstrip(), path)
