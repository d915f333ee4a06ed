"""The KV-cache launch variants no device runs by default and no notebook teaches, kept for the experiments that
measured them (``benchmarks/kv_cache.md``; the sweep: ``benchmarks/experiments/kv_cache_sweep2.py``). They import
the shipped kernels; the library never imports them.

* :mod:`.persistent`: the insert and gather on a persistent grid (a few programs per SM, each looping over
  tiles), that loop optionally software-pipelined, and their launchers.
"""
