"""Compile the KV-cache insert and gather kernels of a dsv4ref checkout for sm_90a with Triton, on a machine
with no GPU, and print registers, spills, global loads/stores, PTX length and SASS instructions: how the
session-3 regression (insert 67.7 % → 49.4 %, gather 79.1 % → 56.8 % of copy on the H200) was located without
device time, and how its fix was checked.

    PYTHONPATH=<triton-3.6 site-packages> python benchmarks/experiments/kv_cache_compile_check.py <checkout root> [NAME=VALUE ...]

A checkout from before the one-folder-per-op layout (``dsv4ref/kv_cache.py``, e.g. ``git worktree add ../s1
9c1928b``) and one after it (``dsv4ref/kv_cache/kernels.py``) are both understood. Launch shapes: the defaults
(insert 8 tokens, gather 4 slots per program, 1 warp); pointers and the row / page strides 16-byte aligned, as
Triton specialises them at a real launch. The kernel constexprs a checkout has (``NATIVE``, ``SLOT32``, ...) are
set as the launcher sets them for a compiled ``allocate()`` cache and the default launch; ``NAME=VALUE`` arguments
override them (``NATIVE=1``: the hardware casts of ``native_casts=True``; ``TOK=4``; ``WARPS=2``;
``EARLY=1``: ``early_loads``; ``MAXNREG=80``: ``max_registers``). ``--probe``: the insert variants of
``benchmarks/experiments/mem_probe.py`` instead, one line each.

``SASS`` counts the instructions of the cubin; ``hot`` leaves out the block a uniform branch skips (the writer's
non-finite tile path, which a finite tile never runs), so it is what a finite tile executes at most.
"""

import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

ROOT = sys.argv[1].rstrip("/")
PROBE = "--probe" in sys.argv[2:]
OVERRIDE = {k: int(v) for k, v in (a.split("=") for a in sys.argv[2:] if a != "--probe")}
sys.path.insert(0, ROOT)
os.environ["DSV4REF_DEVICE"] = "cpu"
importlib.import_module("dsv4ref.device")  # on a CPU box this sets TRITON_INTERPRET ...
os.environ.pop("TRITON_INTERPRET", None)  # ... which must be off when the kernels are defined, to compile them

OLD = os.path.exists(os.path.join(ROOT, "dsv4ref", "kv_cache.py"))
m = importlib.import_module("dsv4ref.kv_cache" if OLD else "dsv4ref.kv_cache.kernels")
SLOT = {} if OLD else {"slot_stride": "constexpr"}  # 1: Triton specialises a unit stride to a constant
INSERT = (
    "insert",
    m._insert_kernel if OLD else m.insert_kernel,
    8,
    {
        "cache_ptr": "*u8",
        "cache16_ptr": "*i16",
        "kv_ptr": "*i16",
        "slot_ptr": "*i64",
        "n": "i32",
        **SLOT,
        "kv_stride": "i32",
        "page_stride": "i32",
        "block_size": "i32",
        "TOK": "constexpr",
        "ROPE16": "constexpr",
    },
)
GATHER = (
    "gather",
    m._gather_kernel if OLD else m.gather_kernel,
    4,
    {
        "cache_ptr": "*u8",
        "cache16_ptr": "*i16",
        "slot_ptr": "*i64",
        "out_ptr": "*i16",
        "n": "i32",
        **SLOT,
        "page_stride": "i32",
        "block_size": "i32",
        "TOK": "constexpr",
        "ROPE16": "constexpr",
    },
)
# what the launcher passes for a compiled launch of the defaults (kernels without a constexpr keep their own;
# PERSISTENT and STAGES: older checkouts, before the persistent grids moved to dsv4ref/kv_cache/variants/)
LAUNCHED = {"NATIVE": 0, "SLOT32": 1, "PERSISTENT": 0, "LOAD_POLICY": "", "STORE_CACHE": "", "STAGES": 0, "EARLY": 0}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTXAS = get_ptxas(90).path  # the ptxas Triton assembles sm_90 with (3.9: ptxas-blackwell; 3.6: ptxas)


def cold_instructions(sass_lines: list[str]) -> int:
    """Instructions in blocks entered only by a forward uniform branch that jumps over a block ending in an
    unconditional forward jump (an if / else whose else part a finite tile never runs)."""
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", line).group(1), 16) for line in sass_lines]
    where = {a: i for i, a in enumerate(addr)}
    cold = 0
    for a, line in zip(addr, sass_lines):
        hit = re.search(r"@!?P\d BRA (0x[0-9a-f]+)", line)
        if hit and int(hit.group(1), 16) - a > 4096 and int(hit.group(1), 16) - 16 in where:
            x = int(hit.group(1), 16)
            prev = sass_lines[where[x - 16]]
            jump = re.search(r"\*/\s+BRA (0x[0-9a-f]+)", prev)
            if jump and int(jump.group(1), 16) > x:
                cold += (int(jump.group(1), 16) - x) // 16
    return cold


print(m.__file__, "triton", triton.__version__, OVERRIDE or "")


def report(name, fn, tok, sig, ov, label=""):
    sig = dict(sig)
    params = inspect.signature(fn.fn).parameters
    const = {"TOK": ov.get("TOK", tok), "ROPE16": True, **({"slot_stride": 1} if SLOT else {})}
    for k, v in LAUNCHED.items():
        if k in params:
            sig[k] = "constexpr"
            const[k] = ov.get(k, v)
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, (k, v) in enumerate(sig.items())
        if v.startswith("*") or k in ("kv_stride", "page_stride")
    }
    compiled = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=const, attrs=aligned),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": ov.get("WARPS", 1), **({"maxnreg": ov["MAXNREG"]} if ov.get("MAXNREG") else {})},
    )
    ptx = compiled.asm["ptx"]
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "k.ptx"), "w") as f:
        f.write(ptx)
    log = subprocess.run(
        [PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True
    ).stderr
    sass = subprocess.run(
        [os.path.join(BIN, "cuobjdump"), "-sass", os.path.join(d, "k.cubin")], capture_output=True, text=True
    ).stdout
    ins = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    loads, stores = len(re.findall(r"\bld\.global", ptx)), len(re.findall(r"\bst\.global", ptx))
    v4 = len(re.findall(r"(?:ld|st)\.global[.\w]*\.v4\.", ptx))
    print(
        f"{label}{name} ({const['TOK']} x {ov.get('WARPS', 1)}): {regs and regs.group(1)} registers, "
        f"{spills and spills.group(1)} B spilled, {loads} ld.global / {stores} st.global ({v4} of them 16-byte), "
        f"{ptx.count(chr(10))} PTX lines, {len(ins)} SASS ({len(ins) - cold_instructions(ins)} hot), "
        f"{compiled.metadata.shared} B shared memory; SASS {widths(sass)}"
    )


def widths(sass: str) -> str:
    """The global loads / stores of the SASS by width and cache hint (every instruction once, hot or cold), e.g.
    ``LDG.128 x9``, ``STG.EF.128 x5`` (EF: evict-first, what ``.cs`` stores and ``evict_first`` loads become)."""
    found = re.findall(r"\b(LDG|STG)\.E((?:\.EF|\.EL|\.LU|\.STRONG\.\w+)*)(?:\.(128|64|U8|S8|U16|S16))?\b", sass)
    count = {}
    for op, hint, w in found:
        key = f"{op}{hint}.{w or '32'}"
        count[key] = count.get(key, 0) + 1
    return " ".join(f"{k} x{v}" for k, v in sorted(count.items()))


if PROBE:  # the insert variants of benchmarks/experiments/mem_probe.py, as its launcher would specialise them
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mem_probe import insert_variants

    for label, v in insert_variants().items():
        ov = {
            "TOK": v.tokens_per_program,
            "WARPS": v.num_warps,
            "NATIVE": int(v.native_casts),
            "EARLY": int(v.early_loads),
            "MAXNREG": v.max_registers,
            "STORE_CACHE": ".cs" if v.streaming_stores else "",
            "LOAD_POLICY": "evict_first" if v.evict_first else "",
        }
        report(*INSERT, ov, label=f"{label:<24} ")
else:
    for name, fn, tok, sig in (INSERT, GATHER):
        report(name, fn, tok, sig, OVERRIDE)
