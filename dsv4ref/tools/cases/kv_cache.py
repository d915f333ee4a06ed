"""``python -m dsv4ref check kv_cache`` / ``bench kv_cache``: the KV cache's check rows and benchmark cases."""

from __future__ import annotations

from dataclasses import replace

import torch

from ... import kv_cache
from ...kv_cache import reference
from ...kv_cache.launch import default_launch, kv_gather_op, kv_insert_op
from ...device import DEVICE
from ...formats import HEAD_DIM, TOKEN_BYTES
from ...testing import compare
from ..harness import BenchCase, CheckRow, bench, check, same_size_copy_case

INSERT, GATHER = default_launch("insert"), default_launch("gather")  # what the public functions run


@check("kv_cache.insert")
def _check_insert() -> list[CheckRow]:
    rows = []
    for T, B, nb in [(37, 2, 40), (64, 61, 3), (100, 64, 4)]:
        kv, slots = kv_cache.example_inputs(T, B, nb, seed=T)
        ref, out = kv_cache.allocate(nb, B), kv_cache.allocate(nb, B)
        kv_cache.insert(ref, kv, slots, block_size=B, backend="reference")
        kv_cache.insert(out, kv, slots, block_size=B, backend="triton")
        rows.append(CheckRow("kv_cache.insert", f"T={T} B={B} pages={nb}", compare(out, ref, "exact", "cache bytes")))
    return rows


@check("kv_cache.gather")
def _check_gather() -> list[CheckRow]:
    rows = []
    for T, B, nb in [(37, 2, 40), (100, 64, 4)]:
        kv, slots = kv_cache.example_inputs(T, B, nb, seed=T + 1)
        cache = kv_cache.allocate(nb, B)
        kv_cache.insert(cache, kv, slots, block_size=B)
        got = kv_cache.gather(cache, slots, block_size=B, backend="triton")
        want = kv_cache.gather(cache, slots, block_size=B, backend="reference")
        rows.append(CheckRow("kv_cache.gather", f"S={T} B={B}", compare(got, want, "exact")))
    return rows


@bench("kv_cache")
def _bench() -> list[BenchCase]:
    """64k slots (the issue's size) and 256k slots, pages of 64, a random slot order. Four input sets
    rotate: 4 × (37 MB cache + 64 MB kv + 64 MB out) per size, well past a 60 MB L2. Timed through the
    custom ops with the default launch shapes, each insert beside a uint8 ``copy_`` of its total bytes (what a copy of
    that size loses to launch and tail alone), and (64k only) the insert with other launch shapes, to pick the
    default again (registers per shape: ``benchmarks/experiments/kv_cache_compile_check.py``; every ``KVCacheLaunch`` variant and the
    persistent grids of ``dsv4ref.kv_cache.variants``, checked and timed: ``benchmarks/experiments/kv_cache_sweep2.py``)."""
    cases = []
    for S in (65536, 262144):
        B, n_sets, nb = 64, 4, S // 64
        sets = []
        for _ in range(n_sets):
            kv = torch.randn(S, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
            slots = torch.randperm(S, device=DEVICE)
            sets.append((kv_cache.allocate(nb, B), kv, slots, torch.empty_like(kv)))
        for c, kv, s, _ in sets:
            kv_cache.insert(c, kv, s, block_size=B)
        ins_bytes = S * (HEAD_DIM * 2 + 8 + TOKEN_BYTES)  # read kv + slot, write 584 B
        gat_bytes = S * (TOKEN_BYTES + 8 + HEAD_DIM * 2)  # read 584 B + slot, write bf16 row
        cases += [
            BenchCase(
                "kv_cache.insert",
                f"S={S} B={B}",
                lambda i, st=sets: kv_insert_op(st[i][0], st[i][1], st[i][2], 64, *INSERT.op_args()),
                n_sets,
                ins_bytes,
                note="kv 1024 + slot 8 + cache 584 B/token",
                reference=(lambda c, kv, s: reference.insert(c, kv, s, block_size=64), lambda i, st=sets: st[i][:3]),
            ),
            same_size_copy_case(
                "kv_cache.insert[same-size copy uint8]",
                f"S={S} B={B}",
                ins_bytes,
                n_sets,
                note="torch copy_ of ins_bytes / 2 bytes: the same total traffic as insert",
            ),
            BenchCase(
                "kv_cache.gather",
                f"S={S} B={B}",
                lambda i, st=sets: kv_gather_op(st[i][0], st[i][2], st[i][3], 64, *GATHER.op_args()),
                n_sets,
                gat_bytes,
                note="cache 584 + slot 8 + out 1024 B/row",
                reference=(lambda c, s: reference.gather(c, s, block_size=64), lambda i, st=sets: (st[i][0], st[i][2])),
            ),
        ]
        if S == 65536:
            for tok, warps in INSERT_SHAPES:
                launch = replace(INSERT, tokens_per_program=tok, num_warps=warps)
                cases.append(
                    BenchCase(
                        "kv_cache.insert",
                        f"S={S} B={B} launch={tok}x{warps}",
                        lambda i, st=sets, L=launch: kv_insert_op(st[i][0], st[i][1], st[i][2], 64, *L.op_args()),
                        n_sets,
                        ins_bytes,
                        note=f"{tok} tokens x {warps} warps per program",
                    )
                )
    return cases


INSERT_SHAPES = ((4, 1), (8, 2), (16, 2), (16, 4))  # besides the default 8 x 1
