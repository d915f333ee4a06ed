"""Compile the mHC kernels the library launches on a GPU (``dsv4ref.mhc``: the chunked default, the chunked rungs
and the one-pass design, as ``dsv4ref.tools.cases.mhc.designs`` lists them) for sm_90a on a machine with no GPU,
for every op, and print what limits each: registers, spills, shared memory (so programs per SM), and per loop of
the SASS its instruction count, tensor-core instructions (HGMMA), MMA waits (WARPGROUP.DEPBAR), cp.async copies
(LDGSTS), plain global loads (LDG) and barriers; ``--hash`` prints a hash of each kernel's SASS instead (two
checkouts whose hashes agree launch the same machine code).

    python benchmarks/experiments/mhc/compile_check.py [--hash] [NAME ...]

Arguments: only the designs whose names contain one of them. The shapes are the bench's, T = Hd = 4096 (and, for
the chunked design, T = 37: the decode-sized tiles), with the specialisation a real launch gets (pointers and T,
Hd, tiles, slices divisible by 16; a chunk count of 1 is a constant). Programs per SM: min(by registers, by shared
memory), 228 KB and 64 K registers per SM. The one-kernel and split-K designs are not compiled here.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from aot import BIN, PTXAS  # noqa: E402  (first: the kernels below are then defined for compiling)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dsv4ref.mhc import kernels, kernels_chunked, kernels_one_pass  # noqa: E402
from dsv4ref.mhc.launch import ONE_PASS_LAG, ChunkedLaunch, OnePassLaunch  # noqa: E402
from dsv4ref.mhc.ops import chunk_args, one_pass_args  # noqa: E402
from dsv4ref.tools.cases.mhc import designs  # noqa: E402

T = HD = 4096
_F32 = {"post_in_ptr", "comb_in_ptr", "scale_ptr", "base_ptr", "post_ptr", "comb_ptr", "mix_ws_ptr", "ssq_ws_ptr", "pre_ws_ptr"}
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
            sig[name] = (
                "*fp32" if name in _F32 else ("*bf16" if name == "fn_split_ptr" else ("*i32" if name == "sync_ptr" else "*i16"))
            )
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
    return (
        f"{len(body)} ins, {j.count('HGMMA')} hgmma / {j.count('WARPGROUP.DEPBAR')} waits, "
        f"{j.count('LDGSTS')} cp.async, {ldg} ldg, {j.count('BAR.SYNC')} bar"
    )


def compile_sm90(fn, consts: dict, opts: dict, values: dict) -> tuple[int, int, int, int, str, str]:
    """(registers, spill bytes, shared memory bytes, programs per SM, ptxas log, SASS) of ``fn`` compiled for
    sm_90a with these constexprs, options (num_warps, num_stages, maxnreg) and int argument values."""
    sig, const, attrs = _signature(fn, consts, values)
    options = {k: v for k, v in opts.items() if v is not None}
    c = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=options
    )
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(c.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(c.asm["cubin"])
        log = subprocess.run(
            [PTXAS, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull]
            + ([f"--maxrregcount={opts['maxnreg']}"] if opts.get("maxnreg") else []),
            capture_output=True,
            text=True,
        ).stderr
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    smem = c.metadata.shared
    threads = 32 * opts["num_warps"]
    per_sm = min(65536 // (regs * threads), (228 * 1024) // (smem + 1024), 64 // opts["num_warps"], 32)
    return regs, spill, smem, per_sm, log, sass


def sass_hash(sass: str) -> str:
    """A hash of the SASS's instructions (addresses and encodings kept, the header dropped)."""
    body = "\n".join(line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line))
    return f"{hashlib.sha256(body.encode()).hexdigest()[:16]} ({body.count(chr(10)) + 1} instructions)"


def report(what: str, fn, consts: dict, opts: dict, values: dict, hash_only: bool) -> list[str]:
    regs, spill, smem, per_sm, log, sass = compile_sm90(fn, consts, opts, values)
    if hash_only:
        return [f"{'':27s}{what:7s} {sass_hash(sass)}"]
    serial = " SERIALISED wgmma (ptxas C7515)" if "C7515" in log else ""
    return [
        f"{'':27s}{what:7s} {regs:3d} regs, {spill:4d} B spilled, {smem // 1024:3d} KB smem, "
        f"{per_sm} per SM ({opts['num_warps']} warps){serial}"
    ] + [f"{'':35s}loop: {_loop_line(b)}" for b in _loops(sass)]


def check_one_pass(name: str, L: OnePassLaunch, op: str, hash_only: bool = False) -> str:
    """The one-pass kernel for ``op`` at T = Hd = 4096."""
    head, fused = op == "head", op == "fused"
    _grid, consts, opts, _sizes, (tiles, slices, cps) = one_pass_args(L, T, HD, head, fused)
    values = dict(T=T, Hd=HD, n_tiles=tiles, slices=slices, chunks_per_slice=cps, iters=20)
    lines = [f"{name:36s} {op:5s} T = {T}: {(tiles + ONE_PASS_LAG) * slices} programs"]
    lines += report("kernel", kernels_one_pass.hc_one_pass_kernel, {**consts, "DOT_FP32": False}, opts, values, hash_only)
    return "\n".join(lines)


def check_chunked(name: str, L: ChunkedLaunch, op: str, t: int, hash_only: bool = False) -> str:
    """The chunked design's kernels for ``op`` (fused: post_kernel, then pre's two) as a launch of a middle chunk
    (t0 = C) of a call of ``t`` tokens specialises them."""
    fused = op == "fused"
    (c, n_chunks, slices, cps, parts, h_per_part), (pc, po), (fc, fo), _ = chunk_args(L, t, HD, op == "head", fused)
    values = dict(t0=c, t_end=2 * c, Hd=HD, C=c, slices=slices, chunks_per_slice=cps, h_per_part=h_per_part, iters=20)
    lines = [
        f"{name:36s} {op:5s} T = {t}: C = {c} ({n_chunks} chunks, {(3 if fused else 2) * n_chunks} launches): "
        f"partial {c // pc['BLOCK_T']} tiles × {slices} slices of {cps * pc['BLOCK_K']} dims, finish {parts} "
        f"parts × {c // fc['BLOCK_T']} tiles of {fc['BLOCK_T']} tokens"
    ]
    todo = [
        ("partial", kernels_chunked.hc_chunk_partial_kernel, {**pc, "DOT_FP32": False}, po),
        ("finish", kernels_chunked.hc_chunk_finish_kernel, fc, fo),
    ]
    if fused:
        todo.insert(
            0,
            (
                "post",
                kernels.post_kernel,
                dict(BLOCK_T=L.post_block_t, BLOCK_H=L.post_block_h, TOKEN_MAJOR=L.zigzag),
                dict(num_warps=4),
            ),
        )
    for what, fn, consts, opts in todo:
        lines += report(what, fn, consts, opts, values, hash_only)
    return "\n".join(lines)


if __name__ == "__main__":
    hash_only = "--hash" in sys.argv[1:]
    want = [a for a in sys.argv[1:] if a != "--hash"]
    print(f"{kernels.__file__}, triton {triton.__version__}, sm_90a, Hd = {HD}", flush=True)
    for name, _ in designs():
        if want and not any(w in name for w in want):
            continue
        for op in ("pre", "fused", "head"):
            L = dict(designs({"fused": "fused_post_pre"}.get(op, op))).get(name)  # "default": the op's own
            if L is None:  # the interpreter: this rung is the op's default (its "default" row)
                continue
            try:  # a design that does not compile is reported, not fatal
                if isinstance(L, ChunkedLaunch):
                    for t in (T, 37):
                        print(check_chunked(name, L, op, t, hash_only), flush=True)
                elif isinstance(L, OnePassLaunch):
                    print(check_one_pass(name, L, op, hash_only), flush=True)
                else:
                    print(f"{name:36s} {op:5s} {L.design}: not compiled here", flush=True)
            except Exception as e:
                msg = str(e) if len(str(e)) <= 900 else f"{str(e)[:300]} ... {str(e)[-600:]}"  # the cause is at the end
                print(f"{name:36s} {op:5s} FAILED: {type(e).__name__}: {msg}", flush=True)
