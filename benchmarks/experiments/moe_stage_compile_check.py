"""Compile the MoE staging kernel's variants for sm_90a on a machine with no GPU, and count what they execute.

    PYTHONPATH=<triton-3.6 site-packages>:. python benchmarks/experiments/moe_stage_compile_check.py [NAME ...]
    PYTHONPATH=<triton-3.6 site-packages>:. python benchmarks/experiments/moe_stage_compile_check.py probe:   # mem_probe's rows

The variants are benchmarks/experiments/moe_sweep.py's (its module constants: the references, the two encoders, the
snap grid), compiled as the launcher specialises them at T = 4096, Hd = 4096, K = 6 (constexprs from
``dsv4ref.moe.variants.stage.constexprs``; the pointers and the row strides 16-byte aligned, unit strides
constant). Per variant: registers and stack (bytes spilled) from ``cuobjdump -res-usage``, the SASS length,
and the instructions one thread executes on the common path divided by the values it stages (``/value``):
the walk starts at the entry and takes every forward conditional branch and the first conditional EXIT,
which on these kernels is the path of a tile with no NaN / ±inf group in a program that does not copy the
top-k (the rare arms are laid out in front of the common ones; the timing-only DIAG "finite" variant, which had no
such branch, was the check while the library had it: benchmarks/moe.md). Then the mix of that path: integer / logic ops (LOP3, SHF, PRMT, SEL, IMNMX, ISETP,
...), which share the half-rate ALU pipe, fp32 (FFMA, FADD, FMUL, also IMAD, which runs on the FMA pipe),
F2FP (the e4m3 cvt, two values each), shuffles, barriers, spill loads / stores.

Why instructions: at ~16 µs for 51 MB, an H200 SM sub-partition has ~30 issue cycles per warp and 32 values;
the integer / logic ops issue at half rate, so ~15 of them per value already fill the time of a copy.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # benchmarks/aot.py
from aot import BIN  # noqa: E402  (first: the kernels below are then defined for compiling)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dsv4ref.moe.variants.stage import constexprs, stage_variant_kernel  # noqa: E402
from mem_probe import stage_variants  # noqa: E402
from moe_sweep import ENCODER_ROWS, MAXNREGS, SESSION3_BEST, SNAP_1024, SNAP_GRID, default_variant, stage_name  # noqa: E402


T, HD, K = 4096, 4096, 6
ALU = (
    "LOP3",
    "SHF",
    "PRMT",
    "SEL",
    "FSEL",
    "ISETP",
    "FSETP",
    "VIMNMX",
    "VIMNMX3",
    "IMNMX",
    "FMNMX",
    "LEA",
    "IADD3",
    "VIADD",
    "PLOP3",
    "SGXT",
    "BMSK",
    "IABS",
    "POPC",
    "FLO",
)
FMA = ("FFMA", "FADD", "FMUL", "IMAD")
SIG = {
    "x_ptr": "*i16",
    "q_ptr": "*u8",
    "sf_ptr": "*i32",
    "ids_ptr": "*i32",
    "w_ptr": "*i32",
    "ids_out_ptr": "*i64",
    "w_out_ptr": "*i32",
    "T": "i32",
    "Hd": "i32",
    "K": "i32",
    "stride_xt": "i32",
    "stride_xh": "constexpr",
    "stride_qt": "i32",
    "stride_st": "i32",
    "stride_it": "i32",
    "stride_ik": "constexpr",
    "stride_wt": "i32",
    "stride_wk": "constexpr",
    "stride_iot": "i32",
    "stride_wot": "i32",
}
ALIGNED = (
    "x_ptr",
    "q_ptr",
    "sf_ptr",
    "ids_ptr",
    "w_ptr",
    "ids_out_ptr",
    "w_out_ptr",
    "Hd",
    "stride_xt",
    "stride_qt",
    "stride_st",
)


def compile_variant(L):
    const = constexprs(HD, K, L)
    const.update(stride_xh=1, stride_ik=1, stride_wk=1)
    sig = dict(SIG, **{k: "constexpr" for k in const})
    if const["ENCODE"] != "blocks":
        sig["sf_ptr"] = "*u8"  # the launcher passes x_sf's bytes
    names = list(sig)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ALIGNED}
    return triton.compile(
        ASTSource(fn=stage_variant_kernel, signature=sig, constexprs=const, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={
            "num_warps": L.warps,
            "num_stages": L.stages,
            **({"maxnreg": L.maxnreg} if L.maxnreg else {}),
        },
    )


def sass_of(cubin: bytes) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    return sass, res


def common_path(sass: str) -> list[str]:
    """Opcodes on the walk described in the module docstring."""
    code = {}
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", sass):
        code[int(m.group(1), 16)] = (m.group(2), m.group(3), m.group(4))
    addrs = sorted(code)
    nxt = {a: b for a, b in zip(addrs, addrs[1:])}
    path, pc, steps = [], addrs[0], 0
    while pc in code and steps < 100000:
        steps += 1
        pred, op, args = code[pc]
        path.append(op.split(".")[0])
        if op.startswith("EXIT"):
            break  # unconditional, or the first conditional one (programs past the top-k column)
        if op.startswith("BRA"):
            target = int(re.search(r"0x([0-9a-f]+)", args).group(1), 16)
            if pred is None or target > pc:
                if target == pc:
                    break  # the trailing self-loop
                pc = target
                continue
        pc = nxt.get(pc)
    return path


def report(label, L):
    try:
        ck = compile_variant(L)
    except Exception as e:  # noqa: BLE001
        print(f"{label:58s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:90]}", flush=True)
        return
    sass, res = sass_of(ck.asm["cubin"])
    regs = re.search(r"REG:(\d+)", res).group(1)
    stack = re.search(r"STACK:(\d+)", res).group(1)
    shared = re.search(r"SHARED:(\d+)", res).group(1)
    static = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s", sass))
    path = common_path(sass)
    per_thread = L.block_t * min(L.block_h, HD) / (32 * L.warps)
    c = collections.Counter(path)
    alu = sum(v for k, v in c.items() if k in ALU)
    fma = sum(v for k, v in c.items() if k in FMA)
    print(
        f"{label:58s} regs {regs:>3} stack {stack:>3}  SASS {static:4d}  path {len(path) / per_thread:5.1f}/value: "
        f"ALU {alu / per_thread:4.1f} FMA {fma / per_thread:4.1f} F2FP {c['F2FP'] / per_thread:3.1f} "
        f"SHFL {c['SHFL']:2d} BAR {c['BAR']} LDL+STL {c['LDL'] + c['STL']} per thread; shared "
        f"{shared} B; {widths(sass)}",
        flush=True,
    )


def widths(sass: str) -> str:
    """The global loads / stores of the SASS by width and cache hint (every instruction once, rare paths too);
    EF = evict-first (``evict_first`` loads, ``.cs`` stores)."""
    count = collections.Counter(
        f"{op}{hint}.{w or '32'}"
        for op, hint, w in re.findall(r"\b(LDG|STG)\.E((?:\.EF|\.EL|\.LU)*)(?:\.(128|64|U8|S8|U16|S16))?\b", sass)
    )
    return " ".join(f"{k} x{v}" for k, v in sorted(count.items()))


def main(argv):
    print(f"triton {triton.__version__}, sm_90a, T={T} Hd={HD} K={K}; /value: per value staged by one thread", flush=True)
    rows = [
        ("default: " + stage_name(default_variant()), default_variant()),
        ("session-3 fastest: " + stage_name(SESSION3_BEST), SESSION3_BEST),
    ]
    rows += [(stage_name(L), L) for L in ENCODER_ROWS + SNAP_GRID]
    rows += [(stage_name(L), L) for L in (dataclasses.replace(SNAP_1024, maxnreg=n) for n in MAXNREGS)]
    rows += [(f"probe: {name}", L) for name, L in stage_variants(132).items()]  # benchmarks/experiments/mem_probe.py, H200
    for label, L in rows:
        if not argv or any(a in label for a in argv):
            report(label, L)


if __name__ == "__main__":
    main(sys.argv[1:])
