"""Launch-shape sweep of the MoE kernels on a GPU (the figures in benchmarks/moe.md).

    PYTHONPATH=. python3 benchmarks/moe_sweep.py

Staging at T = 4096, Hd = 4096, K = 6 (four input sets rotated), then the expert kernels at V4-Flash size
(E 256, K 6, Hd 4096, I 2048, bf16 weights) at T = 64 and T = 4096, each timed through the custom op (no
argument checks, graph-captured) against the ceilings measured in the same run.
"""

import itertools

import torch

import dsv4ref
from dsv4ref import moe
from dsv4ref.moe.launch import experts_op_args, stage_op_args
from dsv4ref.tools.cases.moe import flash_weights
from dsv4ref.tools.harness import measure_ceilings, time_ms

dev = dsv4ref.DEVICE
ceil = measure_ceilings()
print(f"copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul {ceil.bf16_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)
T, Hd, K = 4096, 4096, 6
sets = []
for _ in range(4):
    x = torch.randn(T, Hd, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (T, K), device=dev, dtype=torch.int32)
    sets.append((x, ids, torch.rand(T, K, device=dev), torch.empty(T, Hd, dtype=torch.uint8, device=dev),
                 torch.empty(T, Hd // 128, dtype=torch.int32, device=dev), torch.empty(T, K, dtype=torch.int64, device=dev),
                 torch.empty(T, K, device=dev)))
nbytes = T * (Hd * 3 + Hd // 32 + K * 20)
for bt, bh, wp in itertools.product((1, 2, 4), (512, 1024, 2048), (2, 4, 8)):
    L = moe.MoeLaunch(stage_block_t=bt, stage_block_h=bh, stage_warps=wp)
    ms = time_ms(lambda i: torch.ops.dsv4ref.moe_stage(*sets[i], *stage_op_args(L)), 4)
    print(f"stage block_t={bt} block_h={bh} warps={wp}: {ms * 1e3:7.1f} us {nbytes / (ms * 1e-3) / ceil.copy_bytes_per_s:.1%} of copy",
          flush=True)

w13, w2, sw13, sw2 = flash_weights()
GRIDS = {  # block_m, block_n, block_h, block_k, warps, stages
    64: [(16, 64, 128, 64, 4, 3), (16, 128, 128, 64, 4, 3), (16, 64, 256, 128, 4, 3), (16, 64, 128, 64, 4, 4),
         (16, 32, 128, 64, 2, 4)],
    4096: [(64, 64, 128, 64, 4, 3), (64, 128, 128, 64, 8, 3), (64, 128, 128, 128, 8, 3), (128, 64, 128, 64, 4, 3),
           (64, 64, 128, 64, 4, 4)],
}
for T, grid in GRIDS.items():
    x = torch.randn(T, Hd, device=dev, dtype=torch.bfloat16)
    gate = torch.randn(256, Hd, device=dev, dtype=torch.bfloat16) * Hd**-0.5
    ids, w = moe.route(x, gate, torch.zeros(256, device=dev), k=6, routed_scale=1.5)
    q, sf, i64, w32 = moe.stage(x, ids, w)
    out = torch.empty(T, Hd, dtype=torch.bfloat16, device=dev)
    used = int(torch.unique(i64).numel())
    ebytes, flops = (used + 1) * 3 * 2048 * Hd * 2, 2 * 3 * Hd * 2048 * T * 7
    launches = [moe.MoeLaunch(block_m=bm, block_n=bn, block_h=bh, block_k=bk, expert_warps=wp, expert_stages=st)
                for bm, bn, bh, bk, wp, st in grid] + [moe.default_launch(T, 6, 256)]
    for L in launches:
        try:
            ms = time_ms(lambda i: torch.ops.dsv4ref.moe_experts(x, q.view(torch.uint8), sf, i64, w32, w13, w2, sw13, sw2, out,
                                                                 10.0, *experts_op_args(L)), 1, reps=10)
        except Exception as e:  # e.g. out of shared memory
            print(f"experts T={T} {L}: FAILED {str(e)[:120]}", flush=True)
            continue
        frac = max(ebytes / ceil.copy_bytes_per_s, flops / ceil.bf16_flops_per_s) / (ms * 1e-3)
        print(f"experts T={T} {L}: {ms * 1e3:8.1f} us {frac:.1%} of bound", flush=True)
