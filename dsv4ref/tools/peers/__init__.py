"""Other projects' kernels behind our public signatures: measured beside ours by ``python -m dsv4ref bench`` and
held to the conformance suite like any port.

Each peer is optional: its module imports on every machine, and ``available() -> (bool, reason)`` says
whether it can run here. Only tools import peers (the library never does).

* :mod:`.flashmla`: FlashMLA's Hopper sparse-decode kernel (the ``sgl-flash-mla`` wheel) as
  ``sparse_mla.decode``.
"""
