"""The shared preamble of the ahead-of-time compile checks (``benchmarks/gluon_compile_check.py``,
``benchmarks/experiments/*_compile_check.py``): import it before any dsv4ref kernel module, and the kernels are
defined for compiling (sm_90a, ``triton.compile``) rather than for Triton's interpreter, on a machine with no GPU.

``dsv4ref.device`` sets ``TRITON_INTERPRET`` on a CPU box; a kernel module imported while it is set defines
interpreted kernels, which never compile. So: the repository root on the path, the device layer on the CPU,
then the variable dropped. ``BIN`` is the directory of the ptxas / cuobjdump that ship with Triton, ``PTXAS`` the ptxas for sm_90.

(``kv_cache_compile_check.py`` keeps its own preamble: it imports the kernels of any checkout given on its
command line, older layouts included.)
"""

import importlib
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
os.environ["DSV4REF_DEVICE"] = "cpu"
importlib.import_module("dsv4ref.device")  # on a CPU box this sets TRITON_INTERPRET ...
os.environ.pop("TRITON_INTERPRET", None)  # ... which must be off when the kernels are defined, to compile them

import triton  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# the ptxas Triton itself assembles sm_90 with, asked of Triton: "ptxas" in 3.6, "ptxas-blackwell" in 3.9 (whose
# plain ptxas rejects the PTX version 3.9 emits)
PTXAS = get_ptxas(90).path
