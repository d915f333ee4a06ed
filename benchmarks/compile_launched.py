"""Compile for sm_90a (Hopper) every Triton kernel launch the CPU suite makes, on a machine with no GPU.

    python benchmarks/compile_launched.py [OP ...]        # default: every op of the conformance suite

The interpreter runs a kernel's Python source and never compiles it, so a construct the compiler rejects (or
a specialisation it makes, such as an int argument equal to 1 turned into a constant) passes every CPU test
and fails on the first GPU launch. This script closes that gap for whatever the conformance suite launches:

1. **record** (this process, Triton's interpreter): run the suite's cases through the library's kernels
   (``dsv4ref.conformance.run``) with the interpreter's launch wrapped, keeping each launch's kernel, its
   argument types and values (tensors as dtype and 16-byte alignment) and its launch options;
2. **compile** (a fresh process, interpreter off, ``benchmarks/aot.py``): bind each distinct launch with
   Triton's own binder, as a GPU launch would, and ``triton.compile`` it for sm_90a.

One line per distinct compile; exit 1 if any fails, 2 if nothing was launched. Triton-internal APIs (the
binder, ``_pack_args``) are used, so this follows the Triton installed here (3.9); the GPU runs 3.6.

Its limit: the launches are the interpreter's, so their launch choices (tile sizes, fp32 dot operands) are the
interpreter defaults, not the GPU's; a branch only the GPU's defaults take is compiled by the op's own compile
check (``benchmarks/gluon_compile_check.py``, ``benchmarks/experiments/*_compile_check.py``), not here. Large
interpreter tiles compile slowly (the compressor's projection: about 100 s each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _describe(x):
    import torch

    if isinstance(x, torch.Tensor):
        return {"tensor": str(x.dtype).removeprefix("torch."), "aligned": x.data_ptr() % 16 == 0}
    if isinstance(x, bool) or x is None or isinstance(x, (int, float, str)):
        return {"value": x}
    if hasattr(x, "value"):  # tl.constexpr
        return {"value": x.value}
    return {"value": repr(x)}


def record(ops: list[str], path: str) -> int:
    sys.path.insert(0, os.path.join(HERE, ".."))
    os.environ.setdefault("DSV4REF_DEVICE", "cpu")
    import dsv4ref  # noqa: F401  (sets TRITON_INTERPRET on a CPU)
    from triton.runtime import interpreter

    from dsv4ref.conformance import suite

    seen: dict[str, dict] = {}
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        rec = {
            "module": fn.__module__,
            "name": fn.__name__,
            "args": [_describe(a) for a in args],
            "kwargs": {k: _describe(v) for k, v in sorted(kwargs.items())},
        }
        seen.setdefault(json.dumps(rec, sort_keys=True), rec)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    try:
        for op in ops or [None]:
            suite.run(suite.default_impls(), op)
    finally:
        interpreter.InterpretedFunction.run = original
    with open(path, "w") as f:
        json.dump(list(seen.values()), f)
    return len(seen)


def compile_all(path: str) -> int:
    import importlib

    sys.path.insert(0, HERE)
    import aot  # noqa: F401  (interpreter off, before any kernel module is imported)
    import torch
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    records = json.load(open(path))

    def value(d):
        if "tensor" in d:
            t = torch.empty(32, dtype=getattr(torch, d["tensor"]))
            return t if d["aligned"] else t[1:]
        return d["value"]

    failed, compiled, done = 0, 0, set()
    for rec in records:
        fn = getattr(importlib.import_module(rec["module"]), rec["name"])
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        kw = {k: value(v) for k, v in rec["kwargs"].items()}
        kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
        for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, knob):
                kw[knob] = getattr(knobs.compilation, knob)
        try:
            bound, spec, opts = binder(*[value(a) for a in rec["args"]], **kw)
            options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, opts)
        except Exception as e:  # noqa: BLE001 - a launch this Triton cannot bind is a failure to report
            failed += 1
            print(f"FAIL bind {rec['module']}.{rec['name']}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        key = repr(
            (
                rec["module"],
                rec["name"],
                signature,
                sorted(map(repr, constexprs.items())),
                sorted(map(repr, attrs.items())),
                sorted((k, repr(v)) for k, v in options.__dict__.items()),
            )
        )
        if key in done:
            continue
        done.add(key)
        t0 = time.time()
        try:
            triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
            compiled += 1
            print(f"ok   {rec['module']}.{rec['name']} ({time.time() - t0:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"FAIL {rec['module']}.{rec['name']}: {type(e).__name__}: {str(e)[:600]}", flush=True)
    print(f"{compiled} compiled, {failed} failed, {len(records)} distinct launches recorded", flush=True)
    return 1 if failed else (2 if not compiled else 0)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--compile":
        return compile_all(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.json")
        n = record(sys.argv[1:], path)
        print(f"recorded {n} distinct launches", flush=True)
        if not n:
            return 2
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run([sys.executable, os.path.abspath(__file__), "--compile", path], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
