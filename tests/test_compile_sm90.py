"""Bugs only a compiled launch can show, caught on a CPU: the KV-cache kernels compiled for sm_90a (Hopper)
with the argument specialisations a real launch makes, in a subprocess (the test session runs the Triton
interpreter, which never compiles).

Why: a compiled launch turns an int argument equal to 1 into the Python int 1 (a constant), so code that calls
``.to()`` on it fails to compile while the interpreter runs it fine. Session 4 met this on the H200 with
``tl.numerics.page_offsets32`` at pages of one token (``block_size = 1``). Needs Triton's NVIDIA backend (the
PyPI wheel has it); skipped where it is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
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
                          "PERSISTENT": False, "LOAD_POLICY": "", "STORE_CACHE": "", "STAGES": 0}}
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
''')


def _has_nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.skipif(not _has_nvidia_backend(), reason="Triton without its NVIDIA backend")
def test_kv_kernels_compile_for_sm90_with_unit_block_size():
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(root=ROOT)], capture_output=True, text=True,
                       timeout=600, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("compiled") == 8, r.stdout
