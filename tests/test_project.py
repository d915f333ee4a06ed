"""Project hygiene: the set-up contract, the dependency lists, and the stored notebook outputs."""

import json
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_matches_pyproject():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    py = {_name(r) for r in meta["dependencies"]}
    for extra in meta["optional-dependencies"].values():
        py |= {_name(r) for r in extra}
    yml = set()
    in_pip = False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        s = line.strip()
        if s == "- pip:":
            in_pip = True
            continue
        if in_pip and s.startswith("- ") and not s.startswith("- -e"):
            yml.add(_name(s[2:]))
    assert py == yml, f"only in pyproject: {sorted(py - yml)}; only in environment.yml: {sorted(yml - py)}"


def test_ci_runs_the_readme_command():
    assert "make test" in (ROOT / "README.md").read_text().split("\n\n")[0] + (ROOT / "README.md").read_text()[:400]
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.M)


def _notebooks():
    return sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_every_notebook_ran_in_order():
    """nbval silently skips a cell with execution_count null; stored outputs must come from one clean run."""
    assert _notebooks(), "no notebooks"
    for p in _notebooks():
        nb = json.loads(p.read_text())
        assert nb["metadata"]["kernelspec"]["name"] == "python3", p.name
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        counts = [c["execution_count"] for c in code]
        assert counts == list(range(1, len(code) + 1)), f"{p.name}: execution counts {counts}"
        for c in code:
            for o in c.get("outputs", []):
                assert o["output_type"] != "error", f"{p.name}: a stored output is an error"
                assert o.get("name") != "stderr", f"{p.name}: stderr in a stored output: {''.join(o.get('text', ''))[:200]}"


def test_notebooks_match_their_sources():
    """notebooks/src/NN.py is the source; the .ipynb must hold exactly its cells (run `make notebooks`)."""
    import build_notebooks

    srcs = sorted((ROOT / "notebooks" / "src").glob("*.py"))
    assert [p.stem for p in srcs] == [p.stem for p in _notebooks()]
    for src in srcs:
        want = build_notebooks.cells(src)
        nb = json.loads((ROOT / "notebooks" / (src.stem + ".ipynb")).read_text())
        got = [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]
        assert got == want, f"{src.name} and its notebook differ: run `make notebooks NB={src.stem[:2]}`"
