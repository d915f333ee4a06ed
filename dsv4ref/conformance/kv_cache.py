"""Conformance cases of the paged KV cache: ``kv_cache.insert`` (the 584-B writer) and ``kv_cache.gather``."""

from __future__ import annotations

import torch

from ..testing import generator
from .inputs import filled_cache, kv_rows, random_cache
from .suite import Case

OUTPUTS = {
    "kv_cache.insert": lambda res, a: {"cache": a["cache"]},  # in place: the whole buffer is compared
    "kv_cache.gather": lambda res, a: {"out": res},
}


def cases() -> list[Case]:
    g = generator(11)
    out = []
    # insert: B = 61 (odd), 3 pages, −1 slots, random bytes elsewhere (a stray write shows)
    T, B, P = 24, 61, 3
    slots = torch.randperm(P * B, generator=g)[:T]
    slots[::5] = -1
    out.append(Case("kv_cache.insert", "B61_minus1_slots_random_bytes",
                    dict(cache=random_cache(P, B, 1), kv=kv_rows(T, 2), slots=slots, block_size=B),
                    ("cache", "kv", "slots"), tol={"cache": "exact"},
                    why="odd page size (#9), −1 slots write nothing (#11), 16-octave scales + 448·2^k blocks (#1, #3)"))
    # insert: B = 2, slots shorter than kv (padding rows at the end)
    T, B, P = 9, 2, 6
    slots = torch.randperm(P * B, generator=g)[:6]
    out.append(Case("kv_cache.insert", "B2_short_slots",
                    dict(cache=random_cache(P, B, 3), kv=kv_rows(T, 4), slots=slots, block_size=B),
                    ("cache", "kv", "slots"), tol={"cache": "exact"},
                    why="the 1728-B page size of B = 2; rows beyond len(slots) are padding (#11)"))
    # gather: B = 61, −1 entries give zero rows
    B, P = 61, 2
    slots = torch.randperm(P * B, generator=g)[:20].to(torch.int32)
    slots[3] = slots[11] = -1
    out.append(Case("kv_cache.gather", "B61_minus1", dict(cache=filled_cache(P, B, 5), slots=slots, block_size=B),
                    ("cache", "slots"), tol={"out": "exact"}, why="dequant is exact; −1 gives a zero row (#12)"))
    return out
