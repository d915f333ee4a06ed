"""dsv4ref: DeepSeek-V4 decode building blocks, each as a torch reference and a Triton kernel.

Import this package before anything that defines a Triton kernel: :mod:`dsv4ref.device` picks the
device and, on a CPU-only machine, switches Triton to its interpreter (which must happen before any
``@triton.jit`` runs).

The ops are subpackages, imported by name: ``from dsv4ref import kv_cache, rope, mhc, sparse_mla,
indexer, moe, mtp, decode``; each one's ``__init__`` holds its public functions.
"""

import sys as _sys

__version__ = "0.1.0"


def _help_only() -> bool:
    """``python -m dsv4ref`` / ``python -m dsv4ref --help``: the command line answers without torch. (While
    a package runs under ``-m``, ``sys.argv[0]`` is the literal "-m" until its ``__main__`` starts.)"""
    argv = _sys.argv
    return argv[:1] == ["-m"] and (len(argv) == 1 or argv[1] in ("-h", "--help"))


if not _help_only():
    from .device import DEVICE, Timer, interpreting, pick, synchronize  # noqa: F401  (must come first)
