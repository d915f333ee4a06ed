"""Compile the KV-cache insert and gather kernels of a dsv4ref checkout for sm_90a with Triton, on a machine
with no GPU, and print registers, spills, global loads/stores and PTX length: how the session-3 regression
(insert 67.7 % → 49.4 %, gather 79.1 % → 56.8 % of copy on the H200) was located without device time.

    PYTHONPATH=<triton-3.6 site-packages> python benchmarks/kv_cache_compile_check.py <checkout root>

A checkout from before the one-folder-per-op layout (``dsv4ref/kv_cache.py``, e.g. ``git worktree add ../s1
9c1928b``) and one after it (``dsv4ref/kv_cache/kernels.py``) are both understood. Launch shapes: the defaults
(insert 8 tokens, gather 4 slots per program, 1 warp); pointers and the row / page strides 16-byte aligned, as
Triton specialises them at a real launch.
"""

import importlib
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = sys.argv[1].rstrip("/")
sys.path.insert(0, ROOT)
os.environ["DSV4REF_DEVICE"] = "cpu"
importlib.import_module("dsv4ref.device")  # on a CPU box this sets TRITON_INTERPRET ...
os.environ.pop("TRITON_INTERPRET", None)  # ... which must be off when the kernels are defined, to compile them

OLD = os.path.exists(os.path.join(ROOT, "dsv4ref", "kv_cache.py"))
m = importlib.import_module("dsv4ref.kv_cache" if OLD else "dsv4ref.kv_cache.kernels")
SLOT = {} if OLD else {"slot_stride": "constexpr"}  # 1: Triton specialises a unit stride to a constant
INSERT = ("insert", m._insert_kernel if OLD else m.insert_kernel, 8,
          {"cache_ptr": "*u8", "cache16_ptr": "*i16", "kv_ptr": "*i16", "slot_ptr": "*i64", "n": "i32", **SLOT,
           "kv_stride": "i32", "page_stride": "i32", "block_size": "i32", "TOK": "constexpr", "ROPE16": "constexpr"})
GATHER = ("gather", m._gather_kernel if OLD else m.gather_kernel, 4,
          {"cache_ptr": "*u8", "cache16_ptr": "*i16", "slot_ptr": "*i64", "out_ptr": "*i16", "n": "i32", **SLOT,
           "page_stride": "i32", "block_size": "i32", "TOK": "constexpr", "ROPE16": "constexpr"})
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

print(m.__file__, "triton", triton.__version__)
for name, fn, tok, sig in (INSERT, GATHER):
    const = {"TOK": tok, "ROPE16": True, **({"slot_stride": 1} if SLOT else {})}
    aligned = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
               if v.startswith("*") or k in ("kv_stride", "page_stride")}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    log = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    loads, stores = len(re.findall(r"\bld\.global", ptx)), len(re.findall(r"\bst\.global", ptx))
    v4 = len(re.findall(r"(?:ld|st)\.global[.\w]*\.v4\.", ptx))
    print(f"{name}: {regs and regs.group(1)} registers, {spills and spills.group(1)} B spilled, "
          f"{loads} ld.global / {stores} st.global ({v4} of them 16-byte), {ptx.count(chr(10))} PTX lines")
