"""Compile the one-pass mHC kernel (dsv4ref.mhc, kernels.py "Design 3") for sm_90a on a machine with no GPU, for
every candidate of ``dsv4ref.mhc.launch.ONE_PASS_VARIANTS`` and every op it is timed for, and the chunked
design's two kernels ("Design 4") for every candidate of ``CHUNKED_VARIANTS``, and print what
serialises it: registers, spills, shared memory (so programs per SM), and per loop of the SASS its
instruction count, tensor-core instructions (HGMMA), MMA waits (WARPGROUP.DEPBAR), cp.async copies (LDGSTS),
plain global loads (LDG) and barriers. The loops, in order: the K loop (HGMMA), the last arrival's sum of
partials (LDG), Sinkhorn, the READY spin, phase B (LDG).

    PYTHONPATH=<triton-3.6 site-packages>:. python benchmarks/mhc_compile_check.py [NAME ...]

Arguments: only the variants whose names contain one of them. The shapes are the bench's, T = Hd = 4096,
with the specialisation a real launch gets (pointers and T, Hd, tiles, slices divisible by 16; a chunk
count of 1 is a constant). Programs per SM: min(by registers, by shared memory), 228 KB and 64 K registers
per SM; one program per SM means nothing hides the program's own latencies (ticket, pipeline fill, the
release fence, the READY wait).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from aot import BIN, PTXAS  # noqa: E402  (first: the kernels below are then defined for compiling)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dsv4ref.mhc import kernels  # noqa: E402
from dsv4ref.mhc.launch import (CHUNKED_VARIANTS, ONE_PASS_VARIANTS, chunk_args, chunked_variant,  # noqa: E402
                                one_pass_args, one_pass_variant)

T = HD = 4096
_F32 = {"post_in_ptr", "comb_in_ptr", "scale_ptr", "base_ptr", "post_ptr", "comb_ptr", "ws_ptr", "ssq_ptr", "wpre_ptr"}
_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*;)")


def _signature(fn, consts: dict, values: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as a launch at the bench's shape would specialise them."""
    sig, attrs = {}, {}
    consts = dict(consts)
    for prm in fn.params:  # a constexpr the launch leaves out takes its default, as at a real launch
        if prm.is_constexpr and prm.name not in consts and prm.default is not inspect.Parameter.empty:
            consts[prm.name] = prm.default
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name in _F32 else ("*bf16" if name == "fs_ptr" else
                                                      ("*i32" if name == "sync_ptr" else "*i16"))
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("rms_eps", "hc_eps", "post_mult"):
            sig[name] = "fp32"
        elif values.get(name) == 1:  # Triton specialises an int argument equal to 1 to a constant
            sig[name] = "constexpr"
            consts[name] = 1
        else:
            sig[name] = "i32"
            if values.get(name, 1) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def _loops(sass: str) -> list[list[str]]:
    """The instructions of every loop (a backward branch's target .. the branch), in address order."""
    ins = [(int(a, 16), t) for a, t in _INS.findall(sass)]
    out = []
    for a, t in ins:
        m = re.search(r"BRA (?:[!P0-9U]+, )?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            out.append([x for b, x in ins if int(m.group(1), 16) <= b <= a])
    return out


def _loop_line(body: list[str]) -> str:
    j = "\n".join(body)
    ldg = len(re.findall(r"\bLDG\.", j))
    return (f"{len(body)} ins, {j.count('HGMMA')} hgmma / {j.count('WARPGROUP.DEPBAR')} waits, "
            f"{j.count('LDGSTS')} cp.async, {ldg} ldg, {j.count('BAR.SYNC')} bar")


def compile_sm90(fn, consts: dict, opts: dict, values: dict) -> tuple[int, int, int, int, str, str]:
    """(registers, spill bytes, shared memory bytes, programs per SM, ptxas log, SASS) of ``fn`` compiled for
    sm_90a with these constexprs, options (num_warps, num_stages, maxnreg) and int argument values."""
    sig, const, attrs = _signature(fn, consts, values)
    options = {k: v for k, v in opts.items() if v is not None}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(c.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(c.asm["cubin"])
        log = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull]
                             + ([f"--maxrregcount={opts['maxnreg']}"] if opts.get("maxnreg") else []),
                             capture_output=True, text=True).stderr
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    smem = c.metadata.shared
    threads = 32 * opts["num_warps"]
    per_sm = min(65536 // (regs * threads), (228 * 1024) // (smem + 1024), 64 // opts["num_warps"], 32)
    return regs, spill, smem, per_sm, log, sass


def check(name: str, op: str) -> str:
    L = one_pass_variant(name)
    head, fused = op == "head", op == "fused"
    _grid, consts, opts, _sizes, (tiles, slices, cps) = one_pass_args(L, T, HD, head, fused)
    values = dict(T=T, Hd=HD, n_tiles=tiles, slices=slices, chunks_per_slice=cps, iters=20)
    regs, spill, smem, per_sm, log, sass = compile_sm90(kernels.hc_one_pass_kernel, {**consts, "DOT_FP32": False},
                                                        opts, values)
    serial = " SERIALISED wgmma (ptxas C7515)" if "C7515" in log else ""
    head_line = (f"{name:20s} {op:5s} {regs:3d} regs, {spill:4d} B spilled, {smem // 1024:3d} KB smem, "
                 f"{per_sm} per SM, {(tiles + L.one_pass_lag) * slices} programs{serial}")
    return "\n".join([head_line] + [f"{'':27s}loop: {_loop_line(b)}" for b in _loops(sass)])


def check_chunked(name: str, op: str) -> str:
    """The chunked design's partial and finish kernels for ``op`` under candidate ``name``, as a launch of a
    middle chunk (t0 = C) at T = Hd = 4096 specialises them."""
    L = chunked_variant(name)
    (c, n_chunks, slices, cps, parts, h_per_part), (pc, po), (fc, fo), _ = chunk_args(L, T, HD, op == "head", op == "fused")
    values = dict(t0=c, t_end=2 * c, Hd=HD, C=c, slices=slices, chunks_per_slice=cps, h_per_part=h_per_part, iters=20)
    post = L.chunk_fused_post and op == "fused"  # post_kernel per chunk, then pre's partial on the new streams
    lines = [f"{name:20s} {op:5s} C = {c} ({n_chunks} chunks, {(3 if post else 2) * n_chunks} launches)"
             f"{': post_kernel, then' if post else ':'} partial {c // pc['BLOCK_T']} "
             f"tiles × {slices} slices of {cps * pc['BLOCK_K']} dims, finish {parts} parts × "
             f"{c // fc['BLOCK_T']} tiles of {fc['BLOCK_T']} tokens"]
    for what, fn, consts, opts in (("partial", kernels.hc_chunk_partial_kernel, {**pc, "DOT_FP32": False}, po),
                                   ("finish", kernels.hc_chunk_finish_kernel, fc, fo)):
        regs, spill, smem, per_sm, log, sass = compile_sm90(fn, consts, opts, values)
        serial = " SERIALISED wgmma (ptxas C7515)" if "C7515" in log else ""
        lines.append(f"{'':27s}{what:7s} {regs:3d} regs, {spill:4d} B spilled, {smem // 1024:3d} KB smem, "
                     f"{per_sm} per SM ({opts['num_warps']} warps){serial}")
        lines += [f"{'':35s}loop: {_loop_line(b)}" for b in _loops(sass)]
    return "\n".join(lines)


def kernel_key(name: str, op: str) -> tuple:
    """What a launch of ``op`` under candidate ``name`` compiles and runs: equal keys, the same kernel."""
    _grid, consts, opts, _sizes, plan = one_pass_args(one_pass_variant(name), T, HD, op == "head", op == "fused")
    return op, tuple(sorted(consts.items())), tuple(sorted(opts.items())), plan


def chunked_key(name: str, op: str) -> tuple:
    """``kernel_key`` for the chunked design: equal keys, the same two kernels and plan."""
    L = chunked_variant(name)
    plan, (pc, po), (fc, fo), _ = chunk_args(L, T, HD, op == "head", op == "fused")
    return "chunked", op, L.chunk_fused_post and op == "fused", plan, tuple(sorted(pc.items())), tuple(sorted(po.items())), tuple(sorted(fc.items())), \
        tuple(sorted(fo.items()))


if __name__ == "__main__":
    want = sys.argv[1:]
    print(f"{kernels.__file__}, triton {triton.__version__}, sm_90a, T = Hd = {T}", flush=True)
    seen: dict[tuple, str] = {}
    # (table, its kernels' identity, its compile-and-report): a candidate whose kernels equal an earlier one's
    # is named, not compiled again
    for table, key_of, report in ((ONE_PASS_VARIANTS, kernel_key, check), (CHUNKED_VARIANTS, chunked_key, check_chunked)):
        for name in table:
            if want and not any(w in name for w in want):
                continue
            for op in ("pre", "fused", "head"):
                key = key_of(name, op)
                if key in seen:
                    print(f"{name:20s} {op:5s} = {seen[key]!r} (the same kernels)", flush=True)
                    continue
                seen[key] = name
                try:
                    print(report(name, op), flush=True)
                except Exception as e:  # a variant that does not compile is reported, not fatal
                    msg = str(e) if len(str(e)) <= 900 else f"{str(e)[:300]} ... {str(e)[-600:]}"  # the cause is at the end
                    print(f"{name:20s} {op:5s} FAILED: {type(e).__name__}: {msg}", flush=True)
