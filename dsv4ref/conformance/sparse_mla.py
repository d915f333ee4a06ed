"""Conformance cases of ``sparse_mla.decode``: two pools in one softmax, −1 inside slot prefixes, an
empty row, ±inf sinks, padded heads, strided q / slots views, int32 and int64 indices, lengths None, a
page size of 1, an empty batch, and cache rows holding NaN / inf (the non-finite policy: their token's
rows come out NaN, never as an empty row; ``docs/sparse_mla.md#non-finite-input``).

A NaN query is refused while value checks are on; the case ``nan_query_checks_off`` runs with them off
(``Case.check_values=False``) and holds every implementation to the NaN-row rule."""

from __future__ import annotations

import math

import torch

from .. import sparse_mla
from ..testing import generator, randn
from .inputs import filled_cache
from .suite import Case, to_device

OUTPUTS = {
    "sparse_mla.decode": lambda res, a: {"out": res[0], "lse": res[1]},
}


def cases() -> list[Case]:
    g = generator(31)
    out = []
    B1, P1, B2, P2 = 61, 2, 2, 16
    c1, c2 = filled_cache(P1, B1, 32), filled_cache(P2, B2, 33)
    T, H = 5, 16
    q = randn((T, H, 512), seed=34, device="cpu", block=None, octaves=2)
    slots1 = torch.randperm(P1 * B1, generator=g)[: T * 20].view(T, 20).to(torch.int32)
    len1 = torch.tensor([20, 7, 0, 13, 20], dtype=torch.int32)
    slots1[0, 4] = slots1[3, 2] = -1  # −1 inside the prefix (#12)
    slots1[2] = -1  # row 2: empty in both pools
    slots2 = torch.randperm(P2 * B2, generator=g)[: T * 6].view(T, 6).to(torch.int32)
    len2 = torch.tensor([6, 0, 0, 3, 6], dtype=torch.int32)
    slots2[4, 1] = -1
    sink = torch.randn(H, generator=g)
    sink[0], sink[1], sink[2] = -math.inf, math.inf, 0.0
    out.append(
        Case(
            "sparse_mla.decode",
            "two_pools_minus1_empty_row_inf_sinks",
            dict(
                q=q,
                cache=c1,
                slots=slots1,
                lengths=len1,
                block_size=B1,
                sink=sink,
                scale=512**-0.55,
                extra_cache=c2,
                extra_slots=slots2,
                extra_lengths=len2,
                extra_block_size=B2,
            ),
            ("q", "cache", "slots", "lengths"),
            tol={"out": "bf16_weighted_sum", "lse": "lse"},
            why="B = 61 and B = 2 pools in one softmax; −1 inside prefixes (#12); an empty row (out 0, "
            "lse −inf; #18); sinks −inf, +inf, 0 and finite (#17); scale 512^-0.55",
        )
    )
    Hp = 64
    qp = torch.cat(
        [randn((T, H, 512), seed=35, device="cpu", block=None, octaves=2), torch.zeros(T, Hp - H, 512, dtype=torch.bfloat16)],
        dim=1,
    )
    sinkp = torch.cat([torch.randn(H, generator=g), torch.full((Hp - H,), -math.inf)])
    out.append(
        Case(
            "sparse_mla.decode",
            "padded_heads_64",
            dict(q=qp, cache=c1, slots=slots1, lengths=len1, block_size=B1, sink=sinkp),
            ("q", "cache", "slots", "lengths"),
            tol={"out": "bf16_weighted_sum", "lse": "lse"},
            why="H = 16 padded to 64 with zero q rows and −inf sinks: padded rows finite (#19)",
        )
    )
    out += _more_cases(g)
    return out


def _more_cases(g) -> list[Case]:
    tol = {"out": "bf16_weighted_sum", "lse": "lse"}
    pos = ("q", "cache", "slots", "lengths")
    out = []
    B1, P1, B2, P2 = 61, 2, 2, 16
    c1, c2 = filled_cache(P1, B1, 40), filled_cache(P2, B2, 41)
    T, H = 4, 16
    # q stored heads-major ([H, T, 512] contiguous), seen as [T, H, 512]: strides (512, T·512, 1)
    q = randn((H, T, 512), seed=42, device="cpu", block=None, octaves=2).transpose(0, 1)
    s1 = torch.randint(0, P1 * B1, (T, 24), generator=g, dtype=torch.int64)
    s1[1, 3] = -1
    s2 = torch.randint(0, P2 * B2, (T, 5), generator=g, dtype=torch.int64)
    out.append(
        Case(
            "sparse_mla.decode",
            "heads_major_q_int64_slots",
            dict(
                q=q,
                cache=c1,
                slots=s1,
                lengths=torch.tensor([24, 9, 1, 17], dtype=torch.int32),
                block_size=B1,
                sink=torch.randn(H, generator=g),
                extra_cache=c2,
                extra_slots=s2,
                extra_lengths=torch.tensor([5, 0, 5, 2], dtype=torch.int32),
                extra_block_size=B2,
            ),
            pos,
            tol=tol,
            why="q a heads-major view (token stride 512, head stride T·512), int64 slots in "
            "both pools: a kernel that assumes contiguous q or int32 slots fails",
        )
    )
    # slots stored [K, T] and seen transposed (entries of a row T apart), int64 lengths, extra lengths None
    s1t = torch.randint(0, P1 * B1, (20, T), generator=g, dtype=torch.int32).t()
    s1t[2, :] = -1  # row 2: nothing in the window pool, the whole compressed pool
    s2t = torch.randint(0, P2 * B2, (3, T), generator=g, dtype=torch.int32).t()
    out.append(
        Case(
            "sparse_mla.decode",
            "transposed_slots_int64_lengths",
            dict(
                q=randn((T, H, 512), seed=43, device="cpu", block=None, octaves=2),
                cache=c1,
                slots=s1t,
                lengths=torch.tensor([20, 11, 20, 0], dtype=torch.int64),
                block_size=B1,
                sink=None,
                extra_cache=c2,
                extra_slots=s2t,
                extra_lengths=None,
                extra_block_size=B2,
            ),
            pos,
            tol=tol,
            why="slots a transposed view (entry stride T), int64 lengths, extra_lengths None "
            "(every entry counts): read as a view, never as the storage underneath",
        )
    )
    # block_size 1 (a page per token), lengths None, H = 20 (a partly padded head block), −1 rows and duplicates
    P = 48
    c = filled_cache(P, 1, 44)
    s = torch.randint(0, P, (3, 12), generator=g, dtype=torch.int32)
    s[0, 5] = s[0, 6]
    s[1] = -1  # an empty row without a length
    s[2, ::3] = -1
    Hb = 20
    out.append(
        Case(
            "sparse_mla.decode",
            "block_size_1_lengths_none_20_heads",
            dict(
                q=randn((3, Hb, 512), seed=45, device="cpu", block=None, octaves=2),
                cache=c,
                slots=s,
                lengths=None,
                block_size=1,
                sink=torch.randn(Hb, generator=g),
            ),
            pos,
            tol=tol,
            why="pages of one token (B = 1), lengths None, a row of −1 only (out 0, lse −inf), "
            "a duplicate, H = 20 padded inside the kernel",
        )
    )
    out.append(
        Case(
            "sparse_mla.decode",
            "empty_batch",
            dict(
                q=torch.zeros(0, H, 512, dtype=torch.bfloat16),
                cache=c1,
                slots=torch.zeros(0, 8, dtype=torch.int32),
                lengths=torch.zeros(0, dtype=torch.int32),
                block_size=B1,
                sink=torch.zeros(H),
                extra_cache=c2,
                extra_slots=torch.zeros(0, 4, dtype=torch.int64),
                extra_lengths=None,
                extra_block_size=B2,
            ),
            pos,
            tol=tol,
            why="T = 0: empty outputs [0, H, 512] and [0, H], no launch, no error",
        )
    )
    # cache rows holding NaN (scale byte 255, E8M0's NaN) and +inf (RoPE bf16 0x7F80), counted by tokens 1 and
    # 3, and listed past the length / as −1 elsewhere (not counted, so harmless there)
    cn = filled_cache(P2, B2, 46)
    nan_slot, inf_slot = 5, 12
    p, o = divmod(nan_slot, B2)
    cn[p, B2 * 576 + o * 8 + 2] = 255
    p, o = divmod(inf_slot, B2)
    cn[p, o * 576 + 448 + 20 : o * 576 + 448 + 22] = torch.tensor([0x80, 0x7F], dtype=torch.uint8)  # dim 458 = +inf
    sn = torch.randint(0, P2 * B2, (4, 8), generator=g, dtype=torch.int32)
    sn[(sn == nan_slot) | (sn == inf_slot)] = 0
    sn[1, 3] = nan_slot  # counted
    sn[3, 0] = inf_slot  # counted
    sn[0, 7] = nan_slot  # past row 0's length
    sn[2, 2] = inf_slot  # past row 2's length
    out.append(
        Case(
            "sparse_mla.decode",
            "nonfinite_cache_rows_poison_their_token",
            dict(
                q=randn((4, H, 512), seed=47, device="cpu", block=None, octaves=2),
                cache=cn,
                slots=sn,
                lengths=torch.tensor([7, 8, 2, 8], dtype=torch.int32),
                block_size=B2,
                sink=torch.randn(H, generator=g),
            ),
            pos,
            tol=tol,
            why="a counted row holding NaN (scale byte 255) or +inf (RoPE bits) makes every "
            "head of its token out NaN, lse NaN — never a finite or empty-row answer; the "
            "same rows past a length are never read",
        )
    )
    # value checks off: NaN / -inf in q -> that (token, head) is out NaN, lse NaN, also on a token with no
    # valid candidate (whose other heads are the empty row: out 0, lse -inf)
    qn = randn((3, H, 512), seed=48, device="cpu", block=None, octaves=2)
    qn[0, 3, 100] = math.nan
    qn[2, 5, 0] = -math.inf
    sq = torch.randint(0, P2 * B2, (3, 8), generator=g, dtype=torch.int32)
    out.append(
        Case(
            "sparse_mla.decode",
            "nan_query_checks_off",
            dict(
                q=qn,
                cache=c2,
                slots=sq,
                lengths=torch.tensor([8, 5, 0], dtype=torch.int32),
                block_size=B2,
                sink=torch.randn(H, generator=g),
            ),
            pos,
            tol=tol,
            check_values=False,
            why="value checks off: a NaN or ±inf in q[t, h] gives out NaN and lse NaN for that (token, head) "
            "only — on token 2, which has no valid candidate, too: never the empty-row answer (0, −inf)",
        )
    )
    return out


def mass(case: Case) -> dict:
    """{"out": Σ_j p_j·|v_j|·σ(lse − sink)} of a sparse_mla.decode case, from the reference: the scale
    the kernel's bf16 rounding error grows with (tolerance "bf16_weighted_sum")."""
    a = {k: to_device(v) for k, v in case.inputs.items()}
    pos = [a.pop(k) for k in case.positional]
    return {"out": sparse_mla.reference.decode(*pos, **a, with_mass=True)[2].cpu()}
