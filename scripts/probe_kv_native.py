"""GPU probe: which kv_cache launch choices write the reference's bytes for each page size (B = 1 included).

    PYTHONPATH=. python3 scripts/probe_kv_native.py

For B in (1, 2, 61, 64), insert 24 rows (real magnitudes) into a random-byte cache through the custom op
with each launch choice, compare every byte with the torch reference; then gather them back the same way.
Prints one line per (B, launch): insert / gather exact or the count of differing bytes / values.
"""

import torch

from dsv4ref import kv_cache as kc
from dsv4ref.device import DEVICE, synchronize
from dsv4ref.kv_cache.launch import KVCacheLaunch, launch_gather, launch_insert

for B, pages in ((1, 40), (2, 16), (61, 2), (64, 2)):
    g = torch.Generator().manual_seed(B)
    T = 24
    kv = torch.randn(T, 512, generator=g) * torch.exp2(torch.randint(-8, 8, (T, 1), generator=g).float())
    kv = kv.to(torch.bfloat16).to(DEVICE)
    slots = torch.randperm(pages * B, generator=g)[:T].to(DEVICE)
    base = torch.randint(0, 256, (pages, kc.allocate(1, B).shape[1]), generator=g, dtype=torch.uint8).to(DEVICE)
    want = base.clone()
    kc.insert(want, kv, slots, block_size=B, backend="reference")
    want_rows = kc.gather(want, slots, block_size=B, backend="reference")
    for tok in (4, 8):
        for native in (False, True):
            launch = KVCacheLaunch(tokens_per_program=tok, num_warps=1, native_casts=native)
            got = base.clone()
            launch_insert(got, kv, slots, B, launch)
            rows = torch.empty(T, 512, dtype=torch.bfloat16, device=DEVICE)
            launch_gather(want, slots, rows, B, launch)
            synchronize()
            bad_i = int((got != want).sum())
            bad_g = int((rows.view(torch.int16) != want_rows.view(torch.int16)).sum())
            print(
                f"B={B:3d} tokens={tok} native={native!s:5}: insert {'exact' if not bad_i else f'{bad_i} bytes differ'}, "
                f"gather {'exact' if not bad_g else f'{bad_g} values differ'}",
                flush=True,
            )
