"""One module per op: its ``python -m dsv4ref check`` rows and ``bench`` cases, registered on import.

:func:`dsv4ref.tools.harness.load_ops` imports every module named in :data:`OPS`."""

OPS = ("fp8", "kv_cache", "rope", "mhc", "sparse_mla", "indexer", "decode", "moe", "compressor", "mtp", "linear")
