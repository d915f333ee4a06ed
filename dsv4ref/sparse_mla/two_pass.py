"""The two-pass backend (``backend="two_pass"``): the seed's design (vLLM's first XPU port), written cleanly;
and the seed's own structure (:func:`seed_decode`), kept to be measured and read beside it.

Pass 1 dequantises every listed slot into a bf16 workspace with the KV-cache reader kernel; pass 2 is a
bf16 sparse attention over the workspace. The seed built a packed index table with a per-token Python
loop and host syncs, gathered token by token, and accepted the sink without applying it. Here:

* the table is one elementwise op per pool (entries past the length or −1 → −1: a zero row in pass 1, a
  masked entry in pass 2); no per-token loop, no host sync;
* the workspace is pool-major, ``[T·K1 rows of pool 1 | T·K2 rows of pool 2]``, entry (t, j) of a pool at
  row t·K + j, and it is reused across calls (:func:`~dsv4ref.sparse_mla.launch.workspace`);
* pass 2 is the fused kernel's own attention loop reading bf16 rows instead of FP8 pages, so the sink,
  the empty-row rule and the split merge are the same code.

It moves 588 (record + slot) + 1024 (write) + 1028 (read the row and its slot again) = 2640 bytes per
selected row, 4.5× the fused kernel's 588:
measured against it in ``benchmarks/sparse_mla.md``.

:func:`seed_decode` is the seed's structure on our kernels (with the sink applied, so its answer is
right): :func:`seed_plan` walks the tokens in Python, reading each token's lengths on the host (a device
sync per token) and packing its counted slots ``[compressed…, window…]``; then one gather launch per token
and pool fills a fresh workspace, and the bf16 attention runs over the packed table. On the H200 it is 3-5×
slower than :func:`two_pass_decode` in device work alone (``benchmarks/sparse_mla.md``): 2·T small launches keep
most SMs idle.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..formats import HEAD_DIM
from ..kv_cache.launch import default_launch as kv_cache_default_launch
from ..kv_cache.launch import kv_gather_op
from .launch import SparseMlaLaunch, resolve, sparse_mla_attend_bf16_op, workspace
from .reference import valid_mask

__all__ = ["two_pass_decode", "seed_plan", "seed_decode", "SeedPlan"]

GATHER = kv_cache_default_launch("gather")  # pass 1 runs the KV cache's gather with its measured default


def two_pass_decode(
    q,
    cache,
    slots,
    lengths,
    *,
    block_size,
    sink=None,
    scale,
    extra_cache=None,
    extra_slots=None,
    extra_lengths=None,
    extra_block_size=None,
    launch: SparseMlaLaunch | None = None,
):
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
        part = ws[r : r + table.numel()]
        kv_gather_op(pool_cache, table.reshape(-1), part, bs, *GATHER.op_args())  # pass 1: the kv_cache reader kernel
        parts.append(part)
        tables.append(table)
        r += table.numel()
    ws2, table2 = (parts[1], tables[1]) if len(pools) > 1 else (None, None)
    return sparse_mla_attend_bf16_op(q, parts[0], tables[0], ws2, table2, sink, float(scale), *launch.op_args())


class SeedPlan(NamedTuple):
    """What the seed's host loop produced: per token, the counted slots of each pool, packed (compressed
    pool first), and the attention's table ``[T, K1 + K2]`` int32 (0 for the first n_t entries of row t,
    whose rows sit at t·(K1 + K2) + j of the workspace; −1 after)."""

    per_token: list  # [(slots of pool 2 [n2_t], slots of pool 1 [n1_t])] per token, on the device
    table: torch.Tensor


def seed_plan(slots, lengths, extra_slots=None, extra_lengths=None) -> SeedPlan:
    """The seed's host step: a Python loop over the tokens, a host sync per token and pool."""
    T, K1 = slots.shape
    K = K1 + (extra_slots.shape[1] if extra_slots is not None else 0)
    per_token, counts = [], []
    for t in range(T):  # the per-token loop: each length read on the host
        row = []
        for s, n in ((extra_slots, extra_lengths), (slots, lengths)):
            if s is None:
                row.append(s)
                continue
            keep = s[t, : s.shape[1] if n is None else int(n[t])]
            row.append(keep[keep >= 0])  # a data-dependent shape: another sync
        per_token.append(tuple(row))
        counts.append(sum(r.numel() for r in row if r is not None))
    j = torch.arange(K, device=slots.device)
    table = torch.where(j[None, :] < torch.tensor(counts, device=slots.device)[:, None], 0, -1).to(torch.int32)
    return SeedPlan(per_token, table)


def seed_decode(
    q,
    cache,
    slots,
    lengths,
    *,
    block_size,
    sink=None,
    scale,
    extra_cache=None,
    extra_slots=None,
    extra_lengths=None,
    extra_block_size=None,
    launch: SparseMlaLaunch | None = None,
    plan: SeedPlan | None = None,
):
    """The seed's two-pass structure (for measurement and reading; not a backend): :func:`seed_plan` on the
    host (skipped when ``plan`` is given, as a benchmark of the device work does), then per token one gather
    launch per pool into a fresh bf16 workspace, then the bf16 attention (pass 2 of :func:`two_pass_decode`)
    over the packed table. Same arguments and results as :func:`dsv4ref.sparse_mla.decode`, unvalidated."""
    plan = plan or seed_plan(slots, lengths, extra_slots, extra_lengths)
    T, K = plan.table.shape
    ws = torch.empty(T * K, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    for t, row in enumerate(plan.per_token):  # 2·T small launches, each only n_t rows wide
        r = t * K
        for pool_slots, pool_cache, bs in zip(row, (extra_cache, cache), (extra_block_size, block_size)):
            if pool_slots is not None and pool_slots.numel():
                kv_gather_op(pool_cache, pool_slots, ws[r : r + pool_slots.numel()], bs, *GATHER.op_args())
                r += pool_slots.numel()
    launch = resolve(launch, q, plan.table)
    return sparse_mla_attend_bf16_op(q, ws, plan.table, None, None, sink, float(scale), *launch.op_args())
