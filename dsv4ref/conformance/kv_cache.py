"""Conformance cases of the paged KV cache: ``kv_cache.insert`` (the 584-B writer) and ``kv_cache.gather``.

Every output is compared bit for bit: the whole cache after an insert (it starts as random bytes, so a stray
write shows), the gathered bf16 rows (a NaN is 0x7FC0 on every backend). Non-finite rows reach the writer
only in a case run with value checks off (scale byte 255 + e4m3 NaN codes; docs/kv_cache.md#non-finite-values);
the reader is also given pages no dsv4ref writer makes: random bytes, E8M0 bytes 0 and 255, NaN codes.
Layouts: the suite hands each case a clone, which keeps a dense non-contiguous layout (a column-major kv) but
not a slice's gaps (strided slot lists and page-strided caches are in ``tests/test_contract_kv_cache.py``).
"""

from __future__ import annotations

import torch

from .. import kv_cache, validate
from ..formats import DATA_BYTES, N_SCALES
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
    out.append(
        Case(
            "kv_cache.insert",
            "B61_minus1_slots_random_bytes",
            dict(cache=random_cache(P, B, 1), kv=kv_rows(T, 2), slots=slots, block_size=B),
            ("cache", "kv", "slots"),
            tol={"cache": "exact"},
            why="odd page size (#9), −1 slots write nothing (#11), 16-octave scales + 448·2^k blocks (#1, #3)",
        )
    )
    # insert: B = 2, slots shorter than kv (padding rows at the end)
    T, B, P = 9, 2, 6
    slots = torch.randperm(P * B, generator=g)[:6]
    out.append(
        Case(
            "kv_cache.insert",
            "B2_short_slots",
            dict(cache=random_cache(P, B, 3), kv=kv_rows(T, 4), slots=slots, block_size=B),
            ("cache", "kv", "slots"),
            tol={"cache": "exact"},
            why="the 1728-B page size of B = 2; rows beyond len(slots) are padding (#11)",
        )
    )
    # gather: B = 61, −1 entries give zero rows
    B, P = 61, 2
    slots = torch.randperm(P * B, generator=g)[:20].to(torch.int32)
    slots[3] = slots[11] = -1
    out.append(
        Case(
            "kv_cache.gather",
            "B61_minus1",
            dict(cache=filled_cache(P, B, 5), slots=slots, block_size=B),
            ("cache", "slots"),
            tol={"out": "exact"},
            why="dequant is exact; −1 gives a zero row (#12)",
        )
    )
    return out + _insert_cases() + _gather_cases()


def _insert(name, cache, kv, slots, B, why, check_values=True) -> Case:
    return Case(
        "kv_cache.insert",
        name,
        dict(cache=cache, kv=kv, slots=slots, block_size=B),
        ("cache", "kv", "slots"),
        tol={"cache": "exact"},
        why=why,
        check_values=check_values,
    )


def _gather(name, cache, slots, B, why) -> Case:
    return Case(
        "kv_cache.gather", name, dict(cache=cache, slots=slots, block_size=B), ("cache", "slots"), tol={"out": "exact"}, why=why
    )


def _nonfinite_rows(T: int, seed: int) -> torch.Tensor:
    """kv_rows with NaN, −NaN, ±inf in some NoPE blocks and +inf / NaN in the RoPE dims of others."""
    kv = kv_rows(T, seed)
    kv[0, 64 + 3] = float("nan")
    kv[1, 320 + 1] = -float("inf")
    kv[1, 5] = -float("nan")
    kv[2, 448 + 2] = float("inf")  # RoPE: copied bit for bit
    kv[3, 511] = float("nan")
    return kv


def _insert_cases() -> list[Case]:
    g = generator(12)
    out = []
    T, B, P = 10, 16, 2
    slots = torch.randperm(P * B, generator=g)[:T].to(torch.int32)
    slots[[0, 7]] = -1
    kv = kv_rows(T, 13).t().contiguous().t()  # column-major: read by value
    out.append(
        _insert(
            "B16_column_major_kv_int32_slots",
            random_cache(P, B, 14),
            kv,
            slots,
            B,
            "kv stored column-major (read by value, not as if its rows were contiguous); int32 slots",
        )
    )
    T, B, P = 5, 3, 3
    slots = torch.tensor([8, 0, 4, 6, -1])
    out.append(
        _insert(
            "B3_nonfinite_checks_off",
            random_cache(P, B, 15),
            _nonfinite_rows(T, 16),
            slots,
            B,
            "value checks off: a NoPE block holding NaN / ±inf is scale byte 255 + e4m3 NaN codes (0xFF for a "
            "set sign bit), RoPE dims are copied as they are (inf, NaN), the other blocks are unaffected; "
            "B = 3 is an odd page of 2304 bytes",
            check_values=False,
        )
    )
    out.append(
        _insert(
            "empty_kv_and_slots",
            random_cache(2, 2, 17),
            torch.zeros(0, 512, dtype=torch.bfloat16),
            torch.zeros(0, dtype=torch.int64),
            2,
            "nothing to write: the cache is unchanged",
        )
    )
    out.append(
        _insert(
            "B61_all_minus1",
            random_cache(2, 61, 18),
            kv_rows(6, 19),
            torch.full((6,), -1),
            61,
            "every slot −1: not one byte is written (page 0 / slot 0 is the usual victim) (#11)",
        )
    )
    T, B, P = 64, 64, 2
    slots = torch.arange(2 * B - 1, B - 1, -1)  # page 1, reversed: offsets 63 .. 0
    out.append(
        _insert(
            "B64_full_page_reversed",
            random_cache(P, B, 20),
            kv_rows(T, 21),
            slots,
            B,
            "a whole page of 64 tokens in reverse order: every data and scale offset of a page, page 0 "
            "untouched; the zero / −0 / 448·2^k rows (#1, #3)",
        )
    )
    return out


def _gather_cases() -> list[Case]:
    g = generator(22)
    out = []
    B, P = 2, 3
    cache = filled_cache(P, B, 23)
    scales = (DATA_BYTES * B) + torch.arange(B)[:, None] * 8 + torch.arange(N_SCALES)  # [token, 7] offsets in a page
    cache[1, scales[0]] = torch.tensor([0, 255, 127, 1, 254, 0, 255], dtype=torch.uint8)
    cache[2, 0:64] = 0x7F  # token 0 of page 2: a NaN-coded first block
    cache[2, 64:66] = torch.tensor([0xFF, 0x80], dtype=torch.uint8)
    slots = torch.tensor([2, 4, 5, -1, 3, 2])
    out.append(
        _gather(
            "B2_e8m0_bytes_0_255_nan_codes",
            cache,
            slots,
            B,
            "scale byte 0 reads 2^-127 (not 0), 255 reads NaN (not inf), codes 0x7F / 0xFF NaN: pages "
            "another writer made; every NaN is bf16 0x7FC0; slot 2 read twice",
        )
    )
    B, P = 3, 4
    slots = torch.randint(-1, P * B, (20,), generator=g)
    out.append(
        _gather(
            "B3_random_bytes",
            random_cache(P, B, 24),
            slots,
            B,
            "a cache of random bytes: every e4m3 code, every scale byte, any RoPE bits (NaN payloads "
            "kept); repeats and −1 in the slot list",
        )
    )
    out.append(
        _gather(
            "empty_slots", filled_cache(2, 16, 25), torch.zeros(0, dtype=torch.int32), 16, "no slots: an empty [0, 512] output"
        )
    )
    B, P = 1, 12
    slots = torch.randint(0, P * B, (16,), generator=g)
    slots[5] = -1
    out.append(
        _gather(
            "B1_int64_repeats",
            filled_cache(P, B, 26),
            slots,
            B,
            "one token per page (page_bytes(1) = 1152): page · stride offsets; int64 slots with repeats",
        )
    )
    B, P = 3, 3
    cache = kv_cache.allocate(P, B, device="cpu")
    with validate.checking_values(False):  # a cache another caller wrote with checks off
        kv_cache.insert(cache, _nonfinite_rows(5, 27), torch.tensor([8, 0, 4, 6, -1]), block_size=B, backend="reference")
    out.append(
        _gather(
            "B3_nonfinite_written",
            cache,
            torch.tensor([0, 4, 6, 8, -1, 1]),
            B,
            "rows written from NaN / ±inf input read back NaN in exactly those blocks (never a plausible "
            "number); the RoPE inf / NaN bits come back as stored",
        )
    )
    return out
