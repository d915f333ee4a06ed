"""``python -m dsv4ref check rope`` / ``bench rope``: the rope op's check rows and benchmark cases."""

from __future__ import annotations

import torch

from ... import kv_cache, rope
from ...device import DEVICE
from ...formats import HEAD_DIM, ROPE_DIM, TOKEN_BYTES
from ...rope import reference as rope_reference
from ...kv_cache.launch import default_launch as kv_cache_default_launch
from ...kv_cache.launch import kv_insert_op
from ...rope.launch import MH_SWEEP, RopeLaunch, default_launch, fused, rope_gptj_op
from ...testing import compare, randn
from ..harness import BenchCase, CheckRow, bench, check

_YARN = dict(factor=16, original_max_position=65536, beta_fast=32, beta_slow=1)


@check("rope.apply_gptj")
def _check_apply() -> list[CheckRow]:
    rows = []
    table = rope.cos_sin_cache(4096, theta=160000.0, yarn=_YARN)
    for shape, dtype in [((5, 16, 512), torch.bfloat16), ((37, 512), torch.float32)]:
        x = randn(shape, seed=len(shape), dtype=dtype)
        pos = torch.randint(0, 4096, shape[:1], generator=torch.Generator().manual_seed(1)).to(DEVICE)
        for inv in (False, True):
            got = rope.apply_gptj(x, pos, table, inv, backend="triton")
            ref = rope.apply_gptj(x, pos, table, inv, backend="reference")
            rows.append(
                CheckRow(
                    "rope.apply_gptj",
                    f"{tuple(shape)} {str(dtype)[6:]}" + (" inverse" if inv else ""),
                    compare(got, ref, "exact"),
                )
            )
    return rows


@check("rope.qnorm_rope_kv_insert")
def _check_fused() -> list[CheckRow]:
    rows = []
    table = rope.cos_sin_cache(4096)
    for T, H, B, nb in [(4, 16, 16, 2), (2, 64, 61, 1)]:  # V4-Flash's 64 heads on 2 tokens: interpreted in CI
        q, kv, slots, pos = rope.example_inputs(T, H, B, nb, seed=T, cos_sin=table)
        q_ref, c_ref = q.clone(), kv_cache.allocate(nb, B)
        rope.qnorm_rope_kv_insert(q_ref, kv, c_ref, slots[: T - 1], pos, table, eps=1e-6, block_size=B, backend="reference")
        for hpp in (0, 4):  # the per-head kernel and the multi-head one (4 heads per program)
            q_out, c_out = q.clone(), kv_cache.allocate(nb, B)
            rope.qnorm_rope_kv_insert(
                q_out,
                kv,
                c_out,
                slots[: T - 1],
                pos,
                table,
                eps=1e-6,
                block_size=B,
                backend="triton",
                launch=RopeLaunch(heads_per_prog=hpp),
            )
            name = f"T={T} H={H} B={B}" + (f" hpp={hpp}" if hpp else "")
            rows.append(CheckRow("rope.qnorm_rope_kv_insert", f"{name} cache", compare(c_out, c_ref, "exact", "cache")))
            rows.append(CheckRow("rope.qnorm_rope_kv_insert", f"{name} q", compare(q_out, q_ref, "exact", "q")))
    # the input contract (docs/rope.md#non-finite-input): strided slots / positions (every other entry of a
    # longer list) and a NaN in one q head, which must come out as that head all NaN on both backends
    T, H, B, nb = 4, 4, 5, 2
    q, kv, slots, pos = rope.example_inputs(2 * T, H, B, nb, seed=11, cos_sin=table)
    q, kv = q[:T].clone(), kv[:T]
    q[1, 2, 9] = float("nan")
    out = {}
    for backend in ("reference", "triton"):
        qq, cache = q.clone(), kv_cache.allocate(nb, B)
        rope.qnorm_rope_kv_insert(qq, kv, cache, slots[::2], pos[::2], table, eps=1e-6, block_size=B, backend=backend)
        out[backend] = qq, cache
    name = f"T={T} H={H} B={B} slots[::2] NaN-head"
    rows.append(
        CheckRow("rope.qnorm_rope_kv_insert", f"{name} cache", compare(out["triton"][1], out["reference"][1], "exact", "cache"))
    )
    rows.append(CheckRow("rope.qnorm_rope_kv_insert", f"{name} q", compare(out["triton"][0], out["reference"][0], "exact", "q")))
    return rows


@bench("rope")
def _bench() -> list[BenchCase]:
    T, H, B = 4096, 64, 64
    n_sets = 2  # each set: q 256 MiB + kv 4 MiB + cache 2.3 MiB, far above the 60 MB L2
    nb = T // B
    table = rope.cos_sin_cache(1 << 16, theta=160000.0, yarn=_YARN)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(T, H, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        kv = torch.randn(T, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        pos = torch.randint(0, 1 << 16, (T,), device=DEVICE)
        slots = torch.randperm(T, device=DEVICE)
        sets.append((q, kv, kv_cache.allocate(nb, B), slots, pos, torch.empty_like(kv)))
    q_bytes = T * H * HEAD_DIM * 2 * 2  # read + write q
    kv_bytes = T * (HEAD_DIM * 2 + 8 + TOKEN_BYTES)  # read kv + slot, write the 584-B record
    misc = T * (8 + ROPE_DIM * 4)  # positions + one table row per token
    fused_bytes = q_bytes + kv_bytes + misc
    # three passes: the same Q programs alone; rotate kv into a temp (read kv, write kv'); insert (read kv')
    three_bytes = fused_bytes + T * HEAD_DIM * 2 * 2 + T * 8

    def run_fused(i, launch: RopeLaunch):
        q, kv, c, s, p, _ = sets[i]
        fused(q, kv, c, s, p, table, 1e-6, B, launch)

    def three(i):
        q, kv, c, s, p, tmp = sets[i]
        fused(q, kv, c, s, p, table, 1e-6, B, RopeLaunch(heads_per_prog=0, num_warps=4), do_kv=False)  # pass 1
        rope_gptj_op(kv, p, table, tmp, 1, False, *default_launch().op_args("rope_gptj"))  # pass 2: RoPE of kv (tmp: kv's NoPE)
        kv_insert_op(c, tmp, s, B, *kv_cache_default_launch("insert").op_args())  # pass 3: quantise + insert

    for _, kv, _, _, _, tmp in sets:
        tmp.copy_(kv)
    shape = f"T={T} H={H} B={B}"
    note = "q r+w 1024 B/head + kv 1024 + slot 8 + cache 584 + pos 8 + table row 256 B/token"
    # the per-head kernel (heads_per_prog = 0), then the multi-head kernel at each launch of MH_SWEEP: same
    # compulsory bytes, so the rows compare directly
    cases = [
        BenchCase(
            "rope.fused", shape + f" warps={w}", (lambda i, w=w: run_fused(i, RopeLaunch(0, w))), n_sets, fused_bytes, note=note
        )
        for w in (1, 2, 4, 8)
    ]
    cases += [
        BenchCase(
            "rope.fused_mh",
            shape + f" hpp={lc.heads_per_prog} warps={lc.warps}",
            (lambda i, lc=lc: run_fused(i, lc)),
            n_sets,
            fused_bytes,
            note=note,
            extra={"heads_per_prog": lc.heads_per_prog, "num_warps": lc.warps},
        )
        for lc in MH_SWEEP
    ]
    cases[0].reference = (
        lambda q, kv, c, s, p: rope_reference.qnorm_rope_kv_insert(q, kv, c, s, p, table, block_size=B, eps=1e-6),
        lambda i: sets[i][:5],
    )
    cases.append(
        BenchCase(
            "rope.three_passes",
            shape,
            three,
            n_sets,
            fused_bytes,
            note="same compulsory bytes as fused (actual traffic +2 KiB/token for the kv temp)",
            extra={"actual_bytes": three_bytes},
        )
    )
    return cases
