"""CPU-only compile check of the Hopper Gluon sparse-MLA kernels (dsv4ref.sparse_mla.gluon): no GPU needed.

    PYTHONPATH=<a Triton with Gluon>:. python benchmarks/gluon_compile_check.py [--no-stats] [--defaults | NAME ...]

Compiles the kernels of dsv4ref.sparse_mla.gluon for sm_90a (``GPUTarget("cuda", 90, 32)``) with the
constexpr configurations the benchmark's three shapes launch (two pools with lengths, a sink), then runs the
bundled ``ptxas -v`` on the PTX and prints, per kernel and configuration: ok / FAILED (the error's first
lines), registers per thread, spill stores / loads (bytes) and shared memory. ``--defaults``: the kernel
``default_launch`` picks at each bench shape, with its list splits (on the H200's 132 SMs); otherwise every
kernel of :data:`KERNELS` at SPLITS 2 and 1, or only those whose names contain one of the arguments.
``--no-stats``: compile and check shared memory only (no ptxas / cuobjdump pass; what the test needs). A
warp-specialised kernel's register figure is ptxas's allocation for the whole kernel; the partitions'
budgets are set at run time (setmaxnreg), so the spill figure is the one to watch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from aot import BIN, PTXAS  # noqa: E402  (first: Triton imported with the interpreter off; the repo on the path)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from dsv4ref.sparse_mla import gluon as G  # noqa: E402
from dsv4ref.sparse_mla.gluon.launch import kernel_constexprs  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CONFIGS = {"SPLITS=2": 2, "SPLITS=1": 1}
# every kernel the launcher can run (GluonLaunch.kernel), by the name this script prints
KERNELS = {
    "ws (64-row, the default for H > 16)": "ws",
    "narrow (the default for H <= 16)": "narrow",
    "plain (notebook 04's rung a)": "plain",
}

# runtime argument types of the decode kernels, in order (pointers 16-byte divisible, as at launch)
_PTR = {
    "q_ptr": "*bf16",
    "sink_ptr": "*fp32",
    "out_ptr": "*bf16",
    "lse_ptr": "*fp32",
    "po_ptr": "*fp32",
    "pml_ptr": "*fp32",
    "c1_u8": "*u8",
    "c1_i16": "*i16",
    "c1_i64": "*i64",
    "i1_ptr": "*i32",
    "l1_ptr": "*i32",
    "c2_u8": "*u8",
    "c2_i16": "*i16",
    "c2_i64": "*i64",
    "i2_ptr": "*i32",
    "l2_ptr": "*i32",
}
_I32 = ("q_st", "q_sh", "K1", "i1_st", "bs1", "ps1", "K2", "i2_st", "bs2", "ps2", "H", "chunk")
_DIV16 = set(_PTR) | {"q_st", "q_sh", "ps1", "ps2"}  # what the launcher's specialisation sees for the shapes


def _ptxas_stats(ptx: str, cubin: bytes) -> str:
    """ptxas -v's registers / spill bytes / static smem, and the spill instructions (STL + LDL) of each
    partition and the highest register it touches, read from the SASS: the code between two USETMAXREG instructions is one partition's; the one
    with HGMMA is the consumer's (``mma``), the one with global loads the producer's (``ld``). For a consumer
    it also counts the wgmma waits against the wgmma: about one wait per wgmma means ptxas serialised
    them (it does so when the accumulators do not fit), which costs far more than a few spills."""
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        r = subprocess.run(
            [PTXAS, "-v", "--gpu-name", "sm_90a", p, "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True
        )
        c = os.path.join(tmp, "t.cubin")
        with open(c, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", c], capture_output=True, text=True).stdout
    text = r.stdout + r.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    st = max((int(a) for a, _ in spill), default=0)
    ld = max((int(b) for _, b in spill), default=0)
    parts = []
    for region in re.split(r"USETMAXREG", sass):
        n = len(re.findall(r"\b(?:STL|LDL)\b", region))
        kind = "mma" if "HGMMA" in region else ("ld" if re.search(r"\bLDG", region) else "")
        if kind:
            top = max((int(x) for x in re.findall(r"\bR(\d+)\b", region)), default=-1)
            extra = ""
            if kind == "mma":  # a wait after (nearly) every wgmma: ptxas serialised them (register pressure)
                extra = f"/wait {region.count('WARPGROUP.DEPBAR')}:{region.count('HGMMA')}"
            parts.append(f"{kind} R{top + 1}/{n}{extra}")
    return (
        f"regs {max(map(int, regs), default=-1):>3}  spill st/ld {st:>4}/{ld:<4} B  "
        f"partitions (regs touched/STL+LDL[/wgmma waits:wgmma]): {', '.join(parts) or '-'}"
    )


def compile_launch(launch: G.GluonLaunch):
    """Compile the kernel ``launch`` runs (two pools with lengths, a sink); returns the CompiledKernel."""
    kern = G.kernels()
    if kern is None:
        raise RuntimeError(f"Gluon unavailable: {G.import_error()!r}")
    fn = kern[launch.kernel]
    const = kernel_constexprs(launch.kernel)
    num_warps = const.pop("num_warps")
    const = dict(
        const,
        HAS_LEN1=True,
        HAS_POOL2=True,
        HAS_LEN2=True,
        HAS_SINK=True,
        SPLITS=launch.num_splits,
        BH=launch.block_h,
        BN=G.BLOCK_N,
    )
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in _PTR:
            sig[name] = _PTR[name]
        elif name in _I32:
            sig[name] = "i32"
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:
            raise KeyError(f"no type for argument {name!r}")
        if name in _DIV16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = fn.ASTSource(fn, sig, const, attrs) if hasattr(fn, "ASTSource") else None
    if src is None:
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn, sig, const, attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps})


# --defaults: the kernels decode_gluon launches by default at the bench shapes (T 64, the H200's 132 SMs)
SMEM_LIMIT = 232448  # bytes of shared memory one Hopper CTA may use (227 KB): more and the launch fails
BENCH_SHAPES = ((64, 64, 640), (64, 128, 1152), (64, 16, 2048))


def main(argv):
    print(f"triton {triton.__version__}, target sm_90a, ptxas {PTXAS}", flush=True)
    stats_on = "--no-stats" not in argv
    argv = [a for a in argv if a != "--no-stats"]
    if argv == ["--defaults"]:  # the defaults at each bench shape (tests/test_gluon_compile.py runs this)
        jobs = []
        for T, H, K in BENCH_SHAPES:
            launch = G.launch_for_sms(T, H, K, 132)
            jobs.append((f"default {launch.kernel}", launch, f"H {H} K {K} (SPLITS={launch.num_splits})"))
    else:
        table = {k: v for k, v in KERNELS.items() if not argv or any(a in k for a in argv)}
        jobs = [
            (name, G.GluonLaunch(kernel, splits), cname) for name, kernel in table.items() for cname, splits in CONFIGS.items()
        ]
    bad = 0
    for name, launch, cname in jobs:
        t0 = time.time()
        try:
            ck = compile_launch(launch)
            shared = ck.metadata.shared
            stats = _ptxas_stats(ck.asm["ptx"], ck.asm["cubin"]) if stats_on else "(no stats)"
            over = shared > SMEM_LIMIT
            bad += over
            print(
                f"{name:<34} {cname:<34} {'OVER' if over else 'ok':<7} {stats}  shared {shared} B"
                f"{f' > {SMEM_LIMIT}' if over else ''}  ({time.time() - t0:.0f} s)",
                flush=True,
            )
        except Exception as e:
            bad += 1
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            lines = lines[:6] + ["..."] + lines[-6:] if len(lines) > 12 else lines
            print(f"{name:<34} {cname:<34} FAILED  {type(e).__name__}: " + "\n      ".join(lines), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
