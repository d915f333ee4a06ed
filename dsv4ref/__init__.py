"""dsv4ref: DeepSeek-V4 attention-decode building blocks, each as a torch reference and a Triton kernel.

Import this package before anything that defines a Triton kernel: :mod:`dsv4ref.device` picks the
device and, on a CPU-only machine, switches Triton to its interpreter (which must happen before any
``@triton.jit`` runs).
"""

from .device import DEVICE, Timer, interpreting, pick, synchronize  # noqa: F401  (must come first)

__version__ = "0.1.0"

# The op modules, in the order of the notebooks. `python -m dsv4ref check` / `bench` import these to
# find their registered checks and benchmarks; a module that does not exist yet is skipped.
OP_MODULES = ("fp8", "kv_cache", "rope", "mhc", "sparse_mla", "indexer", "decode")
