"""Compile the MXFP4 indexer logits kernel of every variant of ``benchmarks/experiments/indexer_sweep.py`` for sm_90a on a
machine with no GPU, and print what decides its speed before any device time is spent: registers, spills,
shared memory, PTX lines, and for the page loop (of the SASS loops that hold no other loop, the one with the
most HGMMA): SASS instructions per page per thread (and of them integer ones) and per page for the whole
program (× warps: what the SM must issue), tensor-core dots (``tl.dot``) and HGMMA instructions per page, the
waits for them, and spill instructions inside the loop; and the SASS outside any loop (run once per program:
the query decode, the checks, the first loads).

    PYTHONPATH=<triton-3.6 site-packages>:. python benchmarks/experiments/indexer_compile_check.py [NAME_PART ...]

The launch is the benchmark's: T = 64, H = 64 (HP 64), pages of 64 keys; pointers, n_out, the block-table stride
and the page stride 16-byte divisible, as Triton specialises them at a real launch.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # benchmarks/aot.py
from aot import BIN, PTXAS  # noqa: E402  (first: the kernels below are then defined for compiling)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dsv4ref.indexer import IndexerLaunch, kernels  # noqa: E402
from indexer_sweep import VARIANTS  # noqa: E402

SIG = {
    "q_ptr": "*u8",
    "qs_ptr": "*u8",
    "w_ptr": "*fp32",
    "cache_ptr": "*u8",
    "cache_f32_ptr": "*fp32",
    "cache_i32_ptr": "*i32",
    "bt_ptr": "*i32",
    "pos_ptr": "*i64",
    "out_ptr": "*fp32",
    "n_out": "i32",
    "bt_stride": "i32",
    "page_stride": "i32",
    "H": "i32",
}
OP = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([.\w]*)(.*?);")


def compile_variant(launch: IndexerLaunch):
    const = dict(
        HP=64,
        BC=64,
        BCP=64,
        PAGES=launch.pages(),
        TP=launch.tile_pages(True),
        FP4=True,
        FP4_DECODE=launch.decode(),
        DOT_FP32=False,
    )
    sig = {k: SIG.get(k, "constexpr") for k in kernels.logits_kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(kernels.logits_kernel.arg_names) if k in SIG}
    opts = {"num_warps": launch.logits_warps}
    if launch.maxnreg(True) is not None:
        opts["maxnreg"] = launch.maxnreg(True)
    src = ASTSource(fn=kernels.logits_kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts), const


def stats(ck, const, warps: int) -> str:
    ptx, ttgir = ck.asm["ptx"], ck.asm["ttgir"]
    with tempfile.TemporaryDirectory() as tmp:
        p, c = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(p, "w") as f:
            f.write(ptx)
        log = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", p, "-o", os.devnull], capture_output=True, text=True).stderr
        with open(c, "wb") as f:
            f.write(ck.asm["cubin"])
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", c], capture_output=True, text=True).stdout
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    ops = [(int(m.group(1), 16), m.group(2), m.group(3) + m.group(4)) for m in map(OP.match, sass.splitlines()) if m]
    loops = []  # (first, last) address of every backward branch
    for addr, op, rest in ops:
        t = re.search(r"(0x[0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) < addr:
            loops.append((int(t.group(1), 16), addr))

    def body(lo, hi):  # op counts; a wait for the tensor cores (WARPGROUP.DEPBAR) counts as "WAIT"
        return collections.Counter(
            "WAIT" if op == "WARPGROUP" and rest.startswith(".DEPBAR") else op for a, op, rest in ops if lo <= a <= hi
        )

    # the page loop: of the loops that hold no other loop (f16_scaled's slow path is a loop in a loop), the one
    # with the most HGMMA
    inner = [r for r in loops if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in loops)]
    lo, hi = max(inner, key=lambda r: body(*r)["HGMMA"])
    b = body(lo, hi)
    per = const["TP"] if const["FP4_DECODE"] == "f16_scaled" else 1  # pages per loop iteration
    if const["PAGES"] == per:  # one iteration: the compiler drops the page loop, there is none to show
        lo, hi, b = 0, -1, collections.Counter()
    n = sum(b.values())
    dots = len(re.findall(r"warp_group_dot ", ttgir)) + len(re.findall(r"tt\.dot ", ttgir))
    loop_dots = _loop_dots(ttgir)
    int_ops = sum(b[k] for k in ("IMAD", "LOP3", "PRMT", "SHF", "IADD3", "LEA", "SEL", "ISETP"))
    outer = [r for r in loops if not any(o != r and o[0] <= r[0] and r[1] <= o[1] for o in loops)]
    straight = len(ops) - sum(sum(body(*r).values()) for r in outer)  # prologue, epilogue: once per program
    return (
        f"regs {regs.group(1) if regs else '?':>3}  spill {spill.group(1) if spill else '?'}/"
        f"{spill.group(2) if spill else '?'} B  smem {ck.metadata.shared:>6} B  PTX {ptx.count(chr(10)):>5} lines  "
        f"SASS outside loops {straight:>5}  "
        f"| page loop: {n / per:5.1f} SASS/page/thread ({int_ops / per:5.1f} integer), "
        f"{n * warps / per:5.0f} warp-instr/page, dots/page {loop_dots / per:4.2f} "
        f"(kernel {dots}), HGMMA/page {b['HGMMA'] / per:4.1f}, waits/page {b['WAIT'] / per:4.1f}, "
        f"STL+LDL {b['STL'] + b['LDL']}"
    )


def _loop_dots(ttgir: str) -> int:
    """tl.dot ops in the first scf.for of the TTGIR that holds one (the fast / only page loop)."""
    depth, inside, count = 0, False, 0
    for line in ttgir.splitlines():
        if not inside and "scf.for" in line:
            inside, depth, count = True, 0, 0
        if inside:
            if "warp_group_dot " in line or "tt.dot " in line:
                count += 1
            depth += line.count("{") - line.count("}")
            if depth <= 0 and "}" in line:
                if count:
                    return count
                inside = False
    return count


def main(argv):
    print(f"triton {triton.__version__}, target sm_90a, {kernels.__file__}", flush=True)
    bad = 0
    for name, fields in VARIANTS:
        if argv and not any(a in name for a in argv):
            continue
        launch = IndexerLaunch(**fields)
        try:
            ck, const = compile_variant(launch)
            print(f"{name:<28} {stats(ck, const, launch.logits_warps)}", flush=True)
        except Exception as e:  # report and go on
            bad += 1
            print(f"{name:<28} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
