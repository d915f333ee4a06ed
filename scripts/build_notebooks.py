"""Build notebooks/*.ipynb from their sources notebooks/src/*.py and execute them in place.

The sources are plain Python in the "percent" format: ``# %%`` starts a code cell, ``# %% [markdown]``
a markdown cell whose lines are comments (``# `` is stripped). Reviewers read the .py; nbval runs the
.ipynb, whose stored outputs come only from this script (run by ``make notebooks``, on the CPU), so they
always match what CI sees.

    python scripts/build_notebooks.py            # all notebooks
    python scripts/build_notebooks.py 01 03      # those whose name starts with 01 or 03
    python scripts/build_notebooks.py --no-exec  # convert only (tests use this to check the sync)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "notebooks" / "src"
OUT = ROOT / "notebooks"


def parse(path: pathlib.Path) -> list[tuple[str, str]]:
    """[(cell_type, source)] from a percent-format file."""
    cells: list[tuple[str, list[str]]] = []
    for line in path.read_text().splitlines():
        if line.startswith("# %%"):
            kind = "markdown" if "[markdown]" in line else "code"
            cells.append((kind, []))
            continue
        if not cells:
            continue  # a module docstring or blank lines before the first cell
        kind, lines = cells[-1]
        if kind == "markdown":
            line = line[2:] if line.startswith("# ") else line.lstrip("#")
        lines.append(line)
    out = []
    for kind, lines in cells:
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        out.append((kind, "\n".join(lines)))
    return out


def to_notebook(path: pathlib.Path) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, src) in enumerate(parse(path)):
        cell = nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
        cell["id"] = f"c{i:03d}"  # stable ids keep git diffs small
        nb.cells.append(cell)
    return nb


def execute(nb: nbformat.NotebookNode) -> None:
    from nbconvert.preprocessors import ExecutePreprocessor

    os.environ["DSV4REF_DEVICE"] = "cpu"
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    ExecutePreprocessor(timeout=600, kernel_name="python3").preprocess(nb, {"metadata": {"path": str(OUT)}})
    for cell in nb.cells:  # execution timestamps would churn every rebuild's diff
        cell.metadata.pop("execution", None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prefixes", nargs="*")
    ap.add_argument("--no-exec", action="store_true")
    args = ap.parse_args()
    srcs = sorted(p for p in SRC.glob("*.py") if not args.prefixes or any(p.name.startswith(x) for x in args.prefixes))
    for src in srcs:
        nb = to_notebook(src)
        t0 = time.time()
        if not args.no_exec:
            execute(nb)
        dst = OUT / (src.stem + ".ipynb")
        nbformat.write(nb, dst)
        print(f"{dst.relative_to(ROOT)}: {len(nb.cells)} cells" + ("" if args.no_exec else f", executed in {time.time() - t0:.1f} s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
