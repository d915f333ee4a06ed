"""Throwaway GPU probe: qnorm_rope_kv_insert with one +inf at q[0, 0, 448], checks off; print where the
reference's and the kernel's q bytes differ."""

import torch
from dsv4ref import rope, validate
from dsv4ref.device import DEVICE
from dsv4ref.rope import RopeLaunch, qnorm_rope_kv_insert
from dsv4ref.testing import randn
from dsv4ref.formats import page_bytes

TAB = rope.cos_sin_cache(64)
for col, val in ((448, float("inf")), (3, float("inf")), (449, float("nan")), (100, -float("inf"))):
    for hpp in (0, 1, 2):
        q = randn((1, 1, 512), seed=0, block=None, octaves=6)
        q[0, 0, col] = val
        kv = randn((1, 512), seed=1)
        cache = torch.zeros(1, page_bytes(1), dtype=torch.uint8, device=DEVICE)
        slots = torch.zeros(0, dtype=torch.int32, device=DEVICE)
        pos = torch.tensor([5], dtype=torch.int32, device=DEVICE)
        outs = {}
        for b in ("reference", "triton"):
            qq, c = q.clone(), cache.clone()
            with validate.checking_values(False):
                qnorm_rope_kv_insert(
                    qq,
                    kv,
                    c,
                    slots,
                    pos,
                    TAB,
                    block_size=1,
                    backend=b,
                    launch=RopeLaunch(heads_per_prog=hpp) if b == "triton" else None,
                )
            outs[b] = qq.view(torch.int16).flatten().cpu()
        d = (outs["reference"] != outs["triton"]).nonzero().flatten()
        print(
            f"col {col} {val} hpp {hpp}: {d.numel()} differing words",
            [(int(i), hex(int(outs["reference"][i]) & 0xFFFF), hex(int(outs["triton"][i]) & 0xFFFF)) for i in d[:6]],
        )
