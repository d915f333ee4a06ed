"""Bugs only a compiled launch can show, caught on a CPU: the KV-cache kernels and the fused Q-norm + RoPE + KV
insert kernels compiled for sm_90a (Hopper) with the argument specialisations a real launch makes, in a
subprocess (the test session runs the Triton interpreter, which never compiles).

Why: a compiled launch turns an int argument equal to 1 into the Python int 1 (a constant), so code that calls
``.to()`` on it fails to compile while the interpreter runs it fine: ``tl.numerics.page_offsets32`` at pages of
one token (``block_size = 1``) is the regression this guards. Needs Triton's NVIDIA backend (the PyPI wheel has
it); skipped where it is missing.

The fused kernels (``dsv4ref.rope.launch.fused``: the multi-head one with the default heads per program and
warps, and the per-head fallback) write their record through the same encoder, ``kv_record``, with its
constexprs fixed at the call (one token, byte-pair RoPE stores, NATIVE and SLOT32 off, no cache hints), so they
have no hardware-cast switch to vary; they are compiled at ``block_size`` 64 and at 1, where a one-token decode
step (``n_slots = 1``) is specialised too. Every argument's type is named, so a kernel that gains an argument
fails here until the test learns its type.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    os.environ["DSV4REF_DEVICE"] = "cpu"
    import dsv4ref.device  # on a CPU this sets TRITON_INTERPRET ...
    os.environ.pop("TRITON_INTERPRET", None)  # ... which must be off when the kernels are defined
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4ref.kv_cache import kernels as k

    PTRS = {{"cache_ptr": "*u8", "cache16_ptr": "*i16", "kv_ptr": "*i16", "slot_ptr": "*i64", "out_ptr": "*i16"}}
    for fn in (k.insert_kernel, k.gather_kernel):
        names = fn.arg_names
        for block_size in (1, 64):  # 1: specialised to a constant, as a launch with pages of one token does
            for native in (False, True):
                const = {{"TOK": 4, "ROPE16": block_size != 1, "NATIVE": native, "SLOT32": True,
                          "LOAD_POLICY": "", "STORE_CACHE": ""}}
                sig = {{}}
                for n in names:
                    if n in const:
                        sig[n] = "constexpr"
                    elif n in PTRS:
                        sig[n] = PTRS[n]
                    elif n == "block_size" and block_size == 1:
                        sig[n], const[n] = "constexpr", 1
                    else:
                        sig[n] = "i32"
                triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                               target=GPUTarget("cuda", 90, 32), options={{"num_warps": 1}})
                print(fn.__name__, "block_size", block_size, "native", native, "compiled", flush=True)

    # The fused Q-norm + RoPE + KV insert, as rope.launch.fused launches it for the custom op (DO_Q, DO_KV on).
    from dsv4ref.rope import kernels as rk, launch as rl
    ARGS = {{"kv_ptr": "*i16", "cache_ptr": "*u8", "slot_ptr": "*i64", "pos_ptr": "*i64", "tab_ptr": "*fp32",
             "H": "i32", "NG": "i32", "n_slots": "i32", "q_stride_t": "i32", "q_stride_h": "i32",
             "kv_stride": "i32", "tab_stride": "i32", "page_stride": "i32", "block_size": "i32", "eps": "fp32"}}
    hpp = rl.default_launch().heads_per_prog
    FUSED = ((rk.qnorm_rope_kv_insert_mh_kernel, "*i32", {{"HPP": hpp}}, rl.default_launch().warps),  # q as bf16 pairs
             (rk.qnorm_rope_kv_insert_kernel, "*i16", {{}}, rl.RopeLaunch(0).warps))
    for fn, q_ty, extra, warps in FUSED:
        for block_size in (1, 64):
            const = {{"DO_Q": True, "DO_KV": True, **extra}}
            ones = ("block_size", "n_slots") if block_size == 1 else ()  # one token into pages of one token
            sig = {{}}
            for n in fn.arg_names:
                if n in const:
                    sig[n] = "constexpr"
                elif n in ones:
                    sig[n], const[n] = "constexpr", 1
                else:
                    sig[n] = q_ty if n == "q_ptr" else ARGS[n]
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                           options={{"num_warps": warps, "enable_fp_fusion": False}})
            print(fn.__name__, "block_size", block_size, "warps", warps, "compiled", flush=True)
""")


def _has_nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.skipif(not _has_nvidia_backend(), reason="Triton without its NVIDIA backend")
def test_kv_and_fused_rope_kernels_compile_for_sm90_with_unit_block_size():
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(root=ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("compiled") == 12, r.stdout
    lines = r.stdout.splitlines()
    for fn in ("insert_kernel", "gather_kernel", "qnorm_rope_kv_insert_mh_kernel", "qnorm_rope_kv_insert_kernel"):
        for block_size in (1, 64):
            assert any(ln.startswith(f"{fn} block_size {block_size} ") for ln in lines), r.stdout


LINEAR_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    os.environ["DSV4REF_DEVICE"] = "cpu"
    import dsv4ref.device
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4ref.linear import kernels as k

    PTRS = {{"x_ptr": "*fp32", "q_ptr": "*u8", "s_ptr": "*fp32", "a_ptr": "*u8", "sa_ptr": "*fp32",
             "b_ptr": "*u8", "sb_ptr": "*u8", "c_ptr": "*i16"}}
    jobs = [(k.act_quant_kernel, {{"BLOCK": 128, "ROWS": 16}})]
    for bm in (16, 64):  # 16: an mma.sync tile (decode); 64: a wgmma tile
        c = {{"BM": bm, "BN": 64, "DOT_FP32": False, "SB_BYTES": True}}
        jobs += [(k.fp8_gemm_kernel, {{**c, "SPLIT": bm == 16}}), (k.fp4_gemm_kernel, {{**c, "SPLIT": bm == 16}})]
    for fn, const in jobs:
        sig = {{n: "constexpr" if n in const else PTRS.get(n, "i32") for n in fn.arg_names}}
        if const.get("SPLIT"):
            sig["c_ptr"] = "*fp32"  # the K splits' fp32 partial sums
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 128),
                           options={{"num_warps": 4}})
        fp8_mma = "e4m3" in c.asm["ptx"] and "mma" in c.asm["ptx"]
        print(fn.__name__, const.get("BM", ""), "fp8 mma" if fp8_mma else "no mma", "compiled", flush=True)
""")


@pytest.mark.skipif(not _has_nvidia_backend(), reason="Triton without its NVIDIA backend")
def test_linear_kernels_compile_for_sm90_with_fp8_mma():
    """The GEMMs' compiled path (fp8 operands on the tensor cores), which the interpreter never takes."""
    r = subprocess.run(
        [sys.executable, "-c", LINEAR_SCRIPT.format(root=ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("compiled") == 5, r.stdout
    assert r.stdout.count("fp8 mma compiled") == 4, r.stdout
