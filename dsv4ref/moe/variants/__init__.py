"""The MoE launch variants no device runs by default and no notebook teaches, kept for the experiments that
measured them (``benchmarks/moe.md``; the sweeps: ``benchmarks/experiments/moe_sweep.py``, ``mem_probe.py``,
``moe_stage_compile_check.py``). They import the shipped kernels; the library never imports them.

* :mod:`.stage`: the staging kernel with every mode it was measured in (the shared ``e4m3_ue8m0_blocks``
  encoder, group loads, a persistent grid, prefetching, cache hints, a register cap), and its launcher.
"""
