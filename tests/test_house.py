"""Tests that keep the house standing: the layout rules a reader and a porter rely on.

* the library never imports its tooling (ops → tools is forbidden; tools → ops is how it works), and no op
  imports the model level (weights, decode, checkpoint, conformance);
* notebooks and docs use public names only;
* the repository refers to no file outside itself;
* no block of six or more lines is written twice inside ``dsv4ref/`` (except the side-by-sides listed in
  ``docs/layout.md``, kept on purpose for teaching);
* the command line answers ``--help`` without importing torch and never exits 0 when nothing ran.
* no history (run numbers, log paths) in code, tests, docs or notebook sources;
* notebooks build tensors on the library's device and print no digits that differ between devices.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIB = ROOT / "dsv4ref"
OP_DIRS = [p for p in LIB.iterdir() if p.is_dir() and p.name not in ("tools", "__pycache__")]


def _py(paths):
    for p in paths:
        yield from sorted(p.rglob("*.py")) if p.is_dir() else [p]


def _imports(path: pathlib.Path) -> list[str]:
    """Absolute module names a file imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def test_no_op_imports_tools():
    bad = {}
    for p in _py([*OP_DIRS, *[f for f in LIB.glob("*.py") if f.name != "__main__.py"]]):
        hits = [m for m in _imports(p) if m == "dsv4ref.tools" or m.startswith("dsv4ref.tools.")]
        if hits:
            bad[str(p.relative_to(ROOT))] = hits
    assert bad == {}, f"library modules importing dsv4ref.tools: {bad}"


def test_no_op_imports_testing():
    """``dsv4ref.testing`` is for tests, notebooks and tools (and the conformance suite, a test a port runs):
    an op's seeded draws come from ``dsv4ref.seeded``."""
    libs = [d for d in OP_DIRS if d.name != "conformance"]
    files = [*_py(libs), *[f for f in LIB.glob("*.py") if f.name not in ("__main__.py", "testing.py")]]
    bad = {str(p.relative_to(ROOT)): hits for p in files if (hits := [m for m in _imports(p) if m.startswith("dsv4ref.testing")])}
    assert bad == {}, f"library modules importing dsv4ref.testing: {bad}"


OPS = ("fp8", "kv_cache", "rope", "mhc", "sparse_mla", "indexer", "moe", "mtp", "compressor", "linear", "tl")
SHARED = ("formats", "device", "validate", "tolerances", "seeded", "op_launch", "fp4", "config")  # what ops import
MODEL_LEVEL = ("dsv4ref.weights", "dsv4ref.decode", "dsv4ref.checkpoint", "dsv4ref.conformance")


def test_no_op_imports_model_level_modules():
    """An op takes its weights as arguments: it never imports the model level (the stack's weights, the
    decode step, the checkpoint, the conformance suite), nor do the shared modules ops import.
    ``dsv4ref.config`` is allowed: its configs are constants an op may read (mhc's Sinkhorn passes and
    epsilons are V4-Flash's)."""
    assert sorted(OPS) == sorted(d.name for d in OP_DIRS if d.name not in ("decode", "conformance", "__pycache__")), (
        "a new package under dsv4ref/: add it to OPS (an op) or to this test's exclusions (model level)"
    )
    bad = {}
    for p in _py([*(LIB / op for op in OPS), *(LIB / f"{m}.py" for m in SHARED)]):
        hits = [m for m in _imports(p) if any(m == b or m.startswith(b + ".") for b in MODEL_LEVEL)]
        if hits:
            bad[str(p.relative_to(ROOT))] = hits
    assert bad == {}, f"op modules importing model-level modules: {bad}"


def _private_uses(path: pathlib.Path) -> list[str]:
    """``_private`` dsv4ref members a notebook source names (``mod._x`` on an imported dsv4ref module, or
    ``from dsv4ref... import _x``)."""
    tree = ast.parse(path.read_text())
    bound, hits = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "dsv4ref":
                    bound.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dsv4ref":
            for a in node.names:
                if a.name.startswith("_"):
                    hits.append(f"{node.module}.{a.name}")
                bound.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                hits.append(ast.unparse(node))
    return hits


def test_notebooks_use_public_names_only():
    bad = {p.name: h for p in sorted((ROOT / "notebooks" / "src").glob("*.py")) if (h := _private_uses(p))}
    assert bad == {}, f"notebooks reaching into private members: {bad}"


def test_docs_name_no_private_members():
    pat = re.compile(r"dsv4ref(?:\.[A-Za-z0-9]+)*\._[a-z]\w*")
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    bad = {str(p.relative_to(ROOT)): pat.findall(p.read_text()) for p in files if pat.search(p.read_text())}
    assert bad == {}


def _tracked_text_files():
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in out:
        p = ROOT / name
        if p.suffix in (".py", ".md", ".ipynb", ".txt", ".cfg", ".toml", ".yml", ".sh") and p.is_file():
            yield p


# Paths that exist beside a developer's checkout but never in a clone (the team's fact sheet folder and
# its files), spelled in pieces so this file does not name them itself.
_TEAM_DIR = "sha" + "red"
OUTSIDE = re.compile(r"\.\./" + _TEAM_DIR + r"\b|" + _TEAM_DIR + r"/(?:spec|seeds)|\bspec §|\b\w+\.md §|tooling\.md|/work/")


def test_no_reference_outside_the_repository():
    bad = {}
    for p in _tracked_text_files():
        if p == pathlib.Path(__file__):
            continue
        hits = sorted(set(OUTSIDE.findall(p.read_text(errors="replace"))))
        if hits:
            bad[str(p.relative_to(ROOT))] = hits
    assert bad == {}, f"references to files outside the repository: {bad}"


def test_doc_links_resolve():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    bad = []
    for p in [
        ROOT / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "benchmarks").glob("*.md"),
        *(ROOT / "golden").glob("*.md"),
    ]:
        for target in link.findall(p.read_text()):
            if "://" in target:
                continue
            if not (p.parent / target).exists():
                bad.append(f"{p.relative_to(ROOT)} -> {target}")
    assert bad == []


def _normalised(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, text) of each logical line of code (a statement, however many physical lines the formatter
    spreads it over), its tokens joined by single spaces: comments, blank lines and docstrings dropped (a
    six-line block of prose is not code repeated). Counting statements, not physical lines, keeps the rule the
    same whatever the formatter does with a long argument list."""
    src = path.read_text()
    doc_lines = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER}
    out, toks, first = [], [], None
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.NEWLINE:
            if toks and first not in doc_lines:
                out.append((first, " ".join(toks)))
            toks, first = [], None
        elif tok.type not in skip:
            first = tok.start[0] if first is None else first
            toks.append(tok.string)
    return out


def _allowed_pairs() -> set[frozenset]:
    """The side-by-sides kept on purpose: rows ``| `a.py` | `b.py` | why |`` of docs/layout.md's table."""
    text = (ROOT / "docs" / "layout.md").read_text()
    section = text.split("## Kept side by side", 1)[1] if "## Kept side by side" in text else ""
    pairs = set()
    for row in re.findall(r"^\|\s*`([^`]+)`\s*\|\s*`([^`]+)`\s*\|", section, re.M):
        pairs.add(frozenset(row))
    return pairs


def test_no_repeated_blocks_in_the_library():
    window = 6
    places: dict[str, list[tuple[str, int]]] = {}
    for p in _py([LIB]):
        lines = _normalised(p)
        rel = str(p.relative_to(ROOT))
        for k in range(len(lines) - window + 1):
            block = "\n".join(s for _, s in lines[k : k + window])
            places.setdefault(hashlib.sha1(block.encode()).hexdigest(), []).append((rel, lines[k][0]))
    allowed = _allowed_pairs()
    report = set()
    for where in places.values():
        first = where[0]
        for other in where[1:]:
            if other[0] == first[0] and other[1] - first[1] < window:
                continue  # an overlapping window of one run of identical lines
            if frozenset((first[0], other[0])) in allowed:
                continue
            report.add(f"{first[0]}:{first[1]} == {other[0]}:{other[1]}")
    assert sorted(report) == [], "blocks of 6+ lines written twice:\n" + "\n".join(sorted(report)[:20])


def _cli(*args, env=None):
    e = dict(os.environ) | (env or {})
    return subprocess.run([sys.executable, "-m", "dsv4ref", *args], cwd=ROOT, capture_output=True, text=True, env=e, timeout=600)


def test_cli_help_lists_every_command_without_torch():
    from dsv4ref.tools.cli import COMMANDS

    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dsv4ref", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0
    for c in COMMANDS:
        assert c in r.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines() if "|" in line}
    assert "torch" not in imported


def _exit_code(*args) -> int:
    """``python -m dsv4ref ARGS``'s exit status, in this process: ``__main__`` is ``sys.exit(main())``, so the
    status is what ``main`` returns or what argparse exits with."""
    from dsv4ref.tools.cli import main

    try:
        return main(list(args))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


def test_cli_never_reports_green_on_nothing(tmp_path, capsys):
    main_py = (LIB / "__main__.py").read_text()
    assert "sys.exit(main())" in main_py  # python -m dsv4ref's status is main()'s return (checked in-process)
    assert _exit_code("conformance", "nosuchop") != 0
    assert _exit_code("demo", "--steps", "-1") != 0
    assert _exit_code("demo", "--steps", "0") != 0
    assert _exit_code("conformance", "--golden", str(tmp_path)) != 0  # a directory with no golden file
    assert _exit_code("conformance", "--golden", str(tmp_path / "no" / "such" / "dir")) != 0
    assert _exit_code("check", "nosuchop") != 0


# ----------------------------------------------------------------------------------------------------
# history belongs in benchmarks/ and git; notebooks run the same on every device
# ----------------------------------------------------------------------------------------------------

# written so that this file does not match itself
HISTORY = re.compile(r"\b[Ss]ession" + r"s?[- ][0-9]|\b[Ii]ssue" + r"s? [0-9]|\bruns/" + r"20[0-9][0-9]|\bs[0-9]+_h" + r"200")


def test_no_history_in_code_tests_docs_or_notebooks():
    """Code, tests, docs and notebook sources say what is true now; which run measured what, and when, lives
    in ``benchmarks/`` (the per-op notes) and in git."""
    paths = [
        *_py([LIB, ROOT / "tests"]),
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "notebooks" / "src").glob("*.py")),
    ]
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}"
        for p in paths
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not hits, "history markers:\n" + "\n".join(hits[:20])


def test_notebooks_build_tensors_on_the_library_device():
    """A tensor a notebook pins to the CPU reaches a kernel on a GPU box and fails there (the interpreter on a
    CPU cannot tell). ``device="cpu"`` is allowed only on a line that says why: ``# host: ...``."""
    pin = re.compile(r"""device\s*=\s*["']cpu["']|\.cpu\(\)\s*\.\s*to\(|torch\.device\(["']cpu["']\)""")
    hits = [
        f"{p.name}:{i}: {line.strip()}"
        for p in sorted((ROOT / "notebooks" / "src").glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pin.search(line) and "# host:" not in line
    ]
    assert not hits, "tensors pinned to the CPU:\n" + "\n".join(hits)


_DECIMAL = re.compile(r"(?<![\w.])-?\d+\.\d+(?:[eE][-+]?\d+)?")


def _device_independent(text: str) -> bool:
    """A printed decimal is safe if it cannot carry a device's rounding: at most 6 significant digits, the fp32
    value of a short decimal (an input constant printed in full), or a small-mantissa power of two (exact)."""
    import math

    import numpy as np

    digits = text.lstrip("-").lower().split("e")[0].replace(".", "").lstrip("0")
    if len(digits) <= 6:
        return True
    v = float(text)
    if v == 0 or not math.isfinite(v):
        return True
    if len(repr(np.float32(v)).strip("np.float32()").lstrip("-").split("e")[0].replace(".", "").lstrip("0")) <= 6:
        return True
    m, _ = math.frexp(abs(v))
    return (m * 256).is_integer()  # 8 significant bits or fewer: an exact, computed-anywhere-the-same value


def test_stored_outputs_print_no_device_dependent_digits():
    """nbval compares stored CPU outputs with a fresh run on a GPU: a raw fp32 result printed to 7 or 8 digits
    (an exp, a sqrt, a sum in another order) differs in its last digit there. Such cells round to what both
    devices agree on, start with ``# NBVAL_IGNORE_OUTPUT``, or say why their digits are the same everywhere
    with an ``# exact digits: ...`` comment (values computed on the host, for instance)."""
    hits = []
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, c in enumerate(json.loads(p.read_text())["cells"]):
            src = "".join(c["source"])
            if c["cell_type"] != "code" or "NBVAL_IGNORE_OUTPUT" in src or "# exact digits:" in src:
                continue
            for o in c.get("outputs", []):
                text = "".join(o.get("text", "")) or "".join(o.get("data", {}).get("text/plain", ""))
                hits += [f"{p.name} cell {i}: {d}" for d in _DECIMAL.findall(text) if not _device_independent(d)]
    assert not hits, "device-dependent digits in stored outputs:\n" + "\n".join(hits[:20])


def test_named_benchmark_scripts_exist():
    """Code, tests, docs and notebooks that name a script under ``benchmarks/`` name one that is there."""
    paths = [
        *_py([LIB, ROOT / "tests", ROOT / "scripts"]),
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "notebooks" / "src").glob("*.py")),
        ROOT / "README.md",
    ]
    named = re.compile(r"benchmarks/[\w/.-]+\.(?:py|json|md)")
    missing = sorted(
        {f"{p.relative_to(ROOT)}: {m}" for p in paths for m in named.findall(p.read_text()) if not (ROOT / m).exists()}
    )
    assert not missing, "named but not there:\n" + "\n".join(missing)


def test_one_name_per_plumbing_concept():
    """The plumbing has one name in every op (docs/layout.md, "One vocabulary"): the backends an op supports are
    ``SUPPORTED_BACKENDS`` in its ``__init__.py``; its measured default launch is the function ``default_launch``
    of its ``launch.py`` (no public ``…DEFAULT`` constant); a launch becomes a custom op's arguments through the
    ``op_args`` method of its ``…Launch`` dataclass (no module-level ``…op_args`` / ``launch_args`` helper)."""
    bad = []
    for d in sorted(OP_DIRS):
        init = d / "__init__.py"
        if init.exists() and "validate.backend(" in init.read_text():
            names = {
                t.id
                for n in ast.parse(init.read_text()).body
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            if "SUPPORTED_BACKENDS" not in names or names & {"SUPPORTED", "BACKENDS"}:
                bad.append(f"{init.relative_to(ROOT)}: the supported backends are not SUPPORTED_BACKENDS")
        launch = d / "launch.py"
        if not launch.exists():
            continue
        text = launch.read_text()
        body = ast.parse(text).body
        funcs = {n.name for n in body if isinstance(n, ast.FunctionDef)}
        consts = {
            t.id
            for n in body
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Name)
        }
        rel = launch.relative_to(ROOT)
        bad += [f"{rel}: no default_launch()"] * ("default_launch" not in funcs)
        bad += [
            f"{rel}: public default constant {c}"
            for c in sorted(consts)
            if re.fullmatch(r"[A-Z0-9_]*DEFAULT", c) and not c.startswith("_")
        ]
        bad += [f"{rel}: module-level {f}()" for f in sorted(funcs) if f.endswith("op_args") or f == "launch_args"]
        if "torch.library.custom_op" in text:
            bad += [
                f"{rel}: {c.name} has no op_args()"
                for c in body
                if isinstance(c, ast.ClassDef)
                and c.name.endswith("Launch")
                and "op_args" not in {m.name for m in c.body if isinstance(m, ast.FunctionDef)}
                and "OpLaunch" not in {ast.unparse(b) for b in c.bases}
            ]
    assert not bad, "\n".join(bad)


def test_no_shipped_module_imports_variants():
    """``dsv4ref/<op>/variants/`` (designs and modes no device runs by default and no notebook teaches, kept for
    the experiments) import the shipped code; nothing outside ``variants/`` and ``tools/`` imports them."""
    bad = {}
    for p in _py([LIB]):
        rel = p.relative_to(LIB).parts
        if "variants" in rel or rel[0] == "tools":
            continue
        hits = [m for m in _imports(p) if ".variants" in m]
        if hits:
            bad[str(p.relative_to(ROOT))] = hits
    assert bad == {}, f"shipped modules importing variants: {bad}"


# Over 600 lines and being split by their owners on other branches: each leaves this list when it is split (the test
# fails while a module listed here is no longer over, so the list never outlives its reason).
LONG_MODULES_BEING_SPLIT: set[str] = set()


def test_no_module_over_600_lines():
    """No module of the library over 600 lines: a long file is where a reader gets lost. Split it; no paragraph
    excuses one."""
    long = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _py([LIB])}
    long = {p: n for p, n in long.items() if n > 600}
    assert set(long) <= LONG_MODULES_BEING_SPLIT, f"modules over 600 lines: {long}"
    assert LONG_MODULES_BEING_SPLIT <= set(long), f"split now, drop from the list: {LONG_MODULES_BEING_SPLIT - set(long)}"


# a number with a unit of time or rate, or a fraction "of" something (the bound, copy, a same-size copy ...)
MEASURED = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s*(?:µs|us|ms|TB/s|GB/s|TFLOP/s)(?![\w/])|(?<![\w.])\d+(?:\.\d+)?\s*% of\b")


def test_no_measured_figure_in_library_code():
    """No measured figure (µs, ms, TB/s, GB/s, TFLOP/s, "% of" the bound or a copy) in the library's code or
    docstrings: figures go stale with the next run, so they live in ``benchmarks/`` (``RESULTS.md``, the per-op
    notes, the ladder JSON) and reach notebooks and docs through ``dsv4ref.tools.results``. ``dsv4ref/tools/``
    is held too: the bench prints figures it measures, never figures written in its source."""
    bad = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in _py([LIB])
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if MEASURED.search(line)
    ]
    assert not bad, "measured figures in library code:\n" + "\n".join(bad)


_FORMAT_MAXIMA = {"448", "448.0", "6", "6.0", "E4M3_MAX", "FP4_MAX", "qmax"}


def test_scale_divisions_are_correctly_rounded_on_every_device():
    """torch on CUDA computes ``tensor / 448`` as ``tensor · fp32(1/448)``: two roundings, so a scale computed
    that way differs from the CPU's in its last bit for about one block in ten (notebook 01 once printed
    another count on a GPU for this reason). A division by a format maximum (448, 6) in the library or a
    notebook goes through ``fp8.reference.div_rn``; a line that divides plain Python numbers says so with
    ``# host-scalar: why``."""
    paths = [*sorted((ROOT / "dsv4ref").rglob("*.py")), *sorted((ROOT / "notebooks" / "src").glob("*.py"))]
    hits = []
    for p in paths:
        lines = p.read_text().splitlines()
        for n in ast.walk(ast.parse(p.read_text())):  # the tree, not tokens: f-string expressions count too
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) and ast.unparse(n.right) in _FORMAT_MAXIMA:
                line = lines[n.lineno - 1]
                if "# host-scalar:" not in line:
                    hits.append(f"{p.relative_to(ROOT)}:{n.lineno}: {line.strip()[:100]}")
    assert not hits, "divisions by a format maximum that CUDA rounds twice:\n" + "\n".join(hits)


def test_ops_call_their_custom_ops_by_object():
    """A public function reaches its kernel through names a reader can follow: it calls the object
    ``torch.library.custom_op`` returned (``<schema name>_op`` in the op's ``launch.py``), never a string looked
    up at call time (``torch.ops.dsv4ref.<name>``). The tools, tests and benchmarks may use either."""
    files = _py(OP_DIRS)
    hits = [
        f"{p.relative_to(ROOT)}:{n.lineno}"
        for p in files
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Attribute) and ast.unparse(n).startswith("torch.ops.dsv4ref.")
    ]
    assert not hits, "custom ops looked up by name:\n" + "\n".join(hits)
