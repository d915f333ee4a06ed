"""The two-pass backend (``backend="two_pass"``): the seed's design (vLLM's first XPU port), written cleanly.

Pass 1 dequantises every listed slot into a bf16 workspace with the KV-cache reader kernel; pass 2 is a
bf16 sparse attention over the workspace. The seed built a packed index table with a per-token Python
loop and host syncs, and accepted the sink without applying it. Here:

* the table is one elementwise op per pool (entries past the length or −1 → −1: a zero row in pass 1, a
  masked entry in pass 2); no per-token loop, no host sync;
* the workspace is pool-major, ``[T·K1 rows of pool 1 | T·K2 rows of pool 2]``, entry (t, j) of a pool at
  row t·K + j, and it is reused across calls (:func:`~dsv4ref.sparse_mla.launch.workspace`);
* pass 2 is the fused kernel's own attention loop reading bf16 rows instead of FP8 pages, so the sink,
  the empty-row rule and the split merge are the same code.

It moves 584 + 1024 (write) + 1024 (read) = 2632 bytes per selected row, 4.5× the fused kernel's 584:
measured against it in ``benchmarks/sparse_mla.md``.
"""

from __future__ import annotations

import torch

from .launch import SparseMlaLaunch, launch_args, resolve, workspace
from .reference import valid_mask

__all__ = ["two_pass_decode"]


def two_pass_decode(q, cache, slots, lengths, *, block_size, sink=None, scale, extra_cache=None, extra_slots=None,
                    extra_lengths=None, extra_block_size=None, launch: SparseMlaLaunch | None = None):
    """The two-pass backend of :func:`dsv4ref.sparse_mla.decode`, without validation and without host syncs.
    Same arguments; ``launch`` (None = the default) shapes pass 2."""
    launch = resolve(launch, q, slots, extra_slots)
    pools = [(cache, slots, lengths, block_size)]
    if extra_cache is not None:
        pools.append((extra_cache, extra_slots, extra_lengths, extra_block_size))
    T = q.shape[0]
    ws = workspace(sum(T * p[1].shape[1] for p in pools), q.device)
    parts, tables, r = [], [], 0
    for pool_cache, pool_slots, pool_lengths, bs in pools:
        table = torch.where(valid_mask(pool_slots, pool_lengths), pool_slots, -1)  # [T, K], −1 where not counted
        part = ws[r:r + table.numel()]
        torch.ops.dsv4ref.kv_gather(pool_cache, table.reshape(-1), part, bs)  # pass 1: the kv_cache reader kernel
        parts.append(part)
        tables.append(table)
        r += table.numel()
    ws2, table2 = (parts[1], tables[1]) if len(pools) > 1 else (None, None)
    return torch.ops.dsv4ref.sparse_mla_attend_bf16(q, parts[0], tables[0], ws2, table2, sink, float(scale),
                                                    *launch_args(launch))
