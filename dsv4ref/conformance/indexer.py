"""Conformance cases of the lightning indexer: ``indexer.quantize_q``, ``indexer.insert_k``, ``indexer.logits``
(through per-token block tables, with the causal mask), ``indexer.topk`` and ``indexer.to_global``.

The suite runs with value checks on, so non-finite input reaches an op here only where it has a meaning
without raising (``docs/indexer.md#non-finite-input``): finite inputs whose RoPE or Hadamard overflows fp32
(encoded as NaN blocks), NaN-encoded keys and E8M0 bytes 0 / 255 in a cache (read as NaN scores and
2^-127), ±∞ logits (−∞: not visible, +∞: a score). Strided layouts reach an implementation as dense
non-contiguous tensors (head-major q, transposed keys): the suite hands each case a clone, which keeps a dense
layout but not a slice's gaps (those are in ``tests/test_contract_indexer.py``).
"""

from __future__ import annotations

import math

import torch

from .. import indexer, validate
from ..config import TINY
from ..testing import generator, randn
from .inputs import random_bytes, rope_table
from .suite import Case

OUTPUTS = {
    "indexer.quantize_q": lambda res, a: {"q": res[0], "weights_out": res[2]} | ({} if res[1] is None else {"q_scales": res[1]}),
    "indexer.insert_k": lambda res, a: {"k_cache": a["k_cache"]},  # in place: the whole buffer is compared
    "indexer.logits": lambda res, a: {"logits": res},
    "indexer.topk": lambda res, a: {"ids_sorted": torch.sort(res.long(), dim=-1).values},  # order is free
    "indexer.to_global": lambda res, a: {"global_slots": res[0], "topk_len": res[1]},
}

_EXACT_Q = {"q": "exact", "weights_out": "exact", "q_scales": "exact"}
_LOGITS = {"logits": "indexer_logits"}
_LOGITS_BF16 = {"logits": "indexer_logits_bf16"}  # MXFP4: DeepSeek's bf16 scores


def mass(case: Case) -> dict:
    """The condition sum Σ_h |w_out|·Σ_d |q_d·k_d|(·k_scale) of each score compared under "indexer_logits" or
    "indexer_logits_bf16" (the scale of its rounding error; ``reference.logits_condition``)."""
    if case.tol.get("logits") not in ("indexer_logits", "indexer_logits_bf16"):
        return {}
    a = case.inputs
    n_out = a.get("n_out") or case.expected["logits"].shape[1]
    bt = a.get("block_table")
    if bt is None:
        bt = torch.arange(max(1, -(-n_out // a["block_size"])), dtype=torch.int32).expand(a["q"].shape[0], -1)
    cond = indexer.reference.logits_condition(
        a["q"], a["q_scales"], a["weights_out"], a["k_cache"], a["positions"], bt, block_size=a["block_size"], n_out=n_out
    )
    return {"logits": cond.float()}


def _head_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with dims 0 and 1 swapped in memory (dense, not contiguous)."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def _originals() -> dict:
    """The inputs of the suite's first five indexer cases, drawn in their original order (golden files)."""
    g = generator(51)
    T, nih = 4, TINY.index_heads
    o = dict(table=rope_table(TINY.compress_rope_theta, TINY.yarn))
    iq = randn((T, nih, 128), seed=52, device="cpu", block=None, octaves=8)
    iq[0, 0] = iq[0, 0] / iq[0, 0].abs().max().float() * 448.0  # amax = 448·2^k: the exact ceil matters (#3)
    o.update(iq=iq, pos=torch.tensor([2, 3, 37, 299]), wts=torch.randn(T, nih, generator=g))
    # indexer K: 80 keys (two requests' compressed rows) into shuffled 16-key pages, random bytes elsewhere
    Bc, P = 16, 8
    o.update(
        Bc=Bc,
        P=P,
        k=randn((80, 128), seed=53, device="cpu", block=None, octaves=8),
        bt=torch.randperm(P, generator=g).to(torch.int32).view(2, 4),
    )
    loc = torch.arange(40)
    slots = torch.cat([o["bt"][0, loc // Bc].long() * Bc + loc % Bc, o["bt"][1, loc // Bc].long() * Bc + loc % Bc])
    slots[5] = -1
    o.update(slots=slots, kc=random_bytes(P * indexer.k_page_bytes(Bc), 54).view(P, -1))
    o["topk_vals"] = torch.randperm(T * 40, generator=g).float().view(T, 40)  # no ties: the top-k set is unique
    return o


def _quantize_q_cases(o) -> list[Case]:
    out = []

    def case(name, iq, pos, table, w, fmt, had, why):
        out.append(
            Case(
                "indexer.quantize_q",
                name,
                dict(index_q=iq, positions=pos, cos_sin=table, weights=w, fmt=fmt, hadamard=had),
                ("index_q", "positions", "cos_sin", "weights"),
                tol=dict(_EXACT_Q),
                why=why,
            )
        )

    for had in (False, True):
        case(
            f"fp8_hadamard_{had}",
            o["iq"],
            o["pos"],
            o["table"],
            o["wts"],
            "fp8",
            had,
            "RoPE on dims 64..127, bf16 round trip (#4), optional Hadamard (#24), q scale folded into the weights (#25)",
        )
    g = generator(55)
    small = indexer.cos_sin_table(16, device="cpu")
    iq4 = randn((3, 5, 128), seed=55, device="cpu", block=32, octaves=12)
    case(
        "mxfp4_hadamard_block_scales",
        iq4,
        torch.tensor([15, 0, 9]),
        small,
        torch.randn(3, 5, generator=g),
        "mxfp4",
        True,
        "4 UE8M0 bytes per (token, head) packed in one int32, block 0 low; no fold (#25); 5 heads",
    )
    case(
        "mxfp4_head_major_int32_positions_bf16_weights",
        _head_major(iq4),
        torch.tensor([1, 14, 7], dtype=torch.int32),
        small,
        _head_major(torch.randn(3, 5, generator=g).to(torch.bfloat16)),
        "mxfp4",
        False,
        "q and weights in head-major layouts (strides honoured), int32 positions, bf16 weights",
    )
    big = randn((2, 3, 128), seed=56, device="cpu", block=None, octaves=2)
    big[0, 1, 64], big[0, 1, 65] = 3.0e38, -3.0e38  # at p = 7 (cos 0.75, sin 0.66): e·c − o·s overflows to +inf
    case(
        "rope_overflow_nan_row",
        big,
        torch.tensor([7, 3]),
        small,
        torch.randn(2, 3, generator=g),
        "fp8",
        False,
        "finite input, infinite after RoPE: that row is e4m3 NaN codes and weights_out NaN (0x7FC00000); the other "
        "rows unchanged (docs/indexer.md#non-finite-input)",
    )
    big = randn((2, 3, 128), seed=57, device="cpu", block=None, octaves=2)
    big[1, 2, :] = 2.0e38  # the Hadamard's sums overflow: +inf and inf − inf = NaN in its blocks
    case(
        "hadamard_overflow_nan_blocks",
        big,
        torch.tensor([4, 11]),
        small,
        torch.randn(2, 3, generator=g),
        "mxfp4",
        True,
        "finite input, non-finite after the Hadamard: its 32-blocks get scale byte 255 and codes 0x7 / 0xF",
    )
    case(
        "empty_batch",
        iq4[:0],
        torch.tensor([], dtype=torch.int64),
        small,
        torch.zeros(0, 5),
        "fp8",
        True,
        "T = 0: empty outputs, no launch",
    )
    return out


def _insert_k_cases(o) -> list[Case]:
    out = []

    def case(name, cache, k, slots, bs, fmt, had, why):
        out.append(
            Case(
                "indexer.insert_k",
                name,
                dict(k_cache=cache, k=k, slots=slots, block_size=bs, fmt=fmt, hadamard=had),
                ("k_cache", "k", "slots"),
                tol={"k_cache": "exact"},
                why=why,
            )
        )

    out.append(
        Case(
            "indexer.insert_k",
            "soa_pages_minus1",
            dict(k_cache=o["kc"], k=o["k"], slots=o["slots"], block_size=o["Bc"], hadamard=True),
            ("k_cache", "k", "slots"),
            tol={"k_cache": "exact"},
            why="[Bc×128 e4m3][Bc×4 fp32 scale] pages (#9), −1 writes nothing (#11)",
        )
    )
    k2 = randn((12, 128), seed=58, device="cpu", block=32, octaves=10)
    s2 = torch.tensor([7, -1, 0, 14, 3, -1, 9, 10, 1], dtype=torch.int32)  # 9 slots for 12 rows: 3 padding rows
    case(
        "mxfp4_block_size_5_int32_slots",
        random_bytes(3 * indexer.k_page_bytes(5, "mxfp4"), 59).view(3, -1),
        k2,
        s2,
        5,
        "mxfp4",
        True,
        "an odd page of 5 keys ([5×64][5×4] bytes), int32 slots with −1, rows past the slots unread",
    )
    case(
        "fp8_block_size_1",
        random_bytes(6 * indexer.k_page_bytes(1), 60).view(6, -1),
        k2[:6],
        torch.tensor([5, 0, -1, 2, 4, 1]),
        1,
        "fp8",
        False,
        "one key per page: page = slot, scale right after its values",
    )
    case(
        "transposed_keys",
        random_bytes(2 * indexer.k_page_bytes(16), 61).view(2, -1),
        k2.t().contiguous().t(),
        torch.tensor([31, 0, 17, 16, 2, -1, 30, 5, 6, 7, 8, 9]),
        16,
        "fp8",
        True,
        "k stored column-major (strides honoured), Hadamard on",
    )
    k3 = randn((3, 128), seed=62, device="cpu", block=None, octaves=2)
    k3[1, :] = 2.0e38  # finite, but the Hadamard overflows: a NaN key (scale 0x7FC00000, codes 0x7F / 0xFF)
    for fmt in ("fp8", "mxfp4"):
        case(
            f"hadamard_overflow_nan_key_{fmt}",
            random_bytes(indexer.k_page_bytes(4, fmt), 63).view(1, -1),
            k3,
            torch.tensor([2, 0, 3]),
            4,
            fmt,
            True,
            "a key that overflows in the Hadamard is written as NaN (docs/indexer.md#non-finite-input), its neighbours untouched",
        )
    case(
        "no_slots",
        random_bytes(indexer.k_page_bytes(8), 64).view(1, -1),
        k2[:2],
        torch.tensor([], dtype=torch.int64),
        8,
        "fp8",
        False,
        "an empty slot list writes nothing",
    )
    return out


def _logits_cases(o) -> list[Case]:
    out = []

    def case(name, q, qs, w, cache, pos, bt, bs, n_out, why, tol=None):
        out.append(
            Case(
                "indexer.logits",
                name,
                dict(q=q, q_scales=qs, weights_out=w, k_cache=cache, positions=pos, block_table=bt, block_size=bs, n_out=n_out),
                ("q", "q_scales", "weights_out", "k_cache", "positions"),
                tol=dict(tol or (_LOGITS if qs is None else _LOGITS_BF16)),
                why=why,
            )
        )

    def problem(T, H, n_keys, bs, fmt, seed, had=False, positions=None):
        ex = indexer.example_inputs(T, H, n_keys, block_size=bs, fmt=fmt, seed=seed, hadamard=had, positions=positions)
        ex = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in ex.items()}
        q, qs, w = indexer.quantize_q(
            ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"], fmt=fmt, hadamard=had, backend="reference"
        )
        return ex, q, qs, w

    kc2 = indexer.allocate_k_cache(o["P"], o["Bc"], device="cpu")
    indexer.insert_k(kc2, o["k"], o["slots"], block_size=o["Bc"], hadamard=True, backend="reference")
    q8, _, w_out = indexer.quantize_q(o["iq"], o["pos"].clamp(max=159), o["table"], o["wts"], hadamard=True, backend="reference")
    case(
        "block_table_causal",
        q8,
        None,
        w_out,
        kc2,
        torch.tensor([2, 3, 37, 159]),
        o["bt"][torch.tensor([0, 1, 0, 1])],
        o["Bc"],
        40,
        "per-token block tables; ReLU per head before the weighted sum; −inf for s >= (p+1)//4 (#26)",
        tol={"logits": "fp32_reduction"},
    )

    ex, q, qs, w = problem(3, 5, 37, 16, "mxfp4", 70, had=True)
    case(
        "mxfp4_block_table",
        q,
        qs,
        w,
        ex["k_cache"],
        ex["positions"],
        ex["block_table"],
        16,
        None,
        "packed e2m1 keys × 2^(byte−127) per 32-block on both sides, Hadamard on both sides, 5 heads",
    )
    ex, q, qs, w = problem(3, 4, 23, 5, "fp8", 71)
    case(
        "block_size_5_int64_table_int32_positions",
        q,
        qs,
        w,
        ex["k_cache"],
        ex["positions"].to(torch.int32),
        ex["block_table"].long(),
        5,
        None,
        "an odd page of 5 keys on every backend; int64 block table, int32 positions",
    )
    ex, q, qs, w = problem(2, 3, 12, 1, "mxfp4", 72)
    case(
        "block_size_1_head_major",
        _head_major(q),
        _head_major(qs),
        _head_major(w),
        ex["k_cache"],
        ex["positions"],
        ex["block_table"],
        1,
        None,
        "one key per page; q, q_scales and weights in head-major layouts",
    )
    ex, q, qs, w = problem(3, 4, 40, 16, "fp8", 73)
    cache = ex["k_cache"].clone()
    bad = torch.zeros(1, 128, dtype=torch.bfloat16)
    bad[0, 9] = math.nan
    with validate.checking_values(False):  # a page another writer made: a NaN key (codes 0x7F, scale NaN)
        indexer.insert_k(cache, bad, ex["slots"][6:7], block_size=16, backend="reference")
    case(
        "nan_key_in_cache",
        q,
        qs,
        w,
        cache,
        ex["positions"],
        ex["block_table"],
        16,
        None,
        "the cache is not scanned: a NaN-encoded key gives that column NaN for every token that sees it, never a "
        "finite or −inf score",
    )
    ex, q, qs, w = problem(2, 4, 32, 16, "mxfp4", 74)
    cache = ex["k_cache"].clone()
    for key, sc in ((3, (0, 127, 255, 130)), (20, (0, 0, 0, 0))):  # E8M0 bytes 0 (2^-127) and 255 (NaN)
        page, off = divmod(int(ex["slots"][key]), 16)
        cache[page, 16 * 64 + 4 * off : 16 * 64 + 4 * off + 4] = torch.tensor(sc, dtype=torch.uint8)
    case(
        "e8m0_bytes_0_and_255",
        q,
        qs,
        w,
        cache,
        ex["positions"],
        ex["block_table"],
        16,
        None,
        "scale byte 0 reads 2^-127 (a tiny score, not 0·x), 255 reads NaN (a NaN score), as E8M0 defines them",
    )
    ex, q, qs, w = problem(3, 4, 40, 8, "fp8", 75, positions=torch.tensor([159, 0, 90]))
    case(
        "n_out_below_n_c",
        q,
        qs,
        w,
        ex["k_cache"],
        ex["positions"],
        ex["block_table"],
        8,
        10,
        "n_out = 10 columns while token 0 sees 40 rows: only the first 10 are scored; p = 0 sees none (all −inf)",
    )
    return out


def _topk_cases(o) -> list[Case]:
    out = []

    def case(name, logits, k, why, positions=None):
        inputs = dict(logits=logits, k=k) if positions is None else dict(logits=logits, k=k, positions=positions)
        out.append(Case("indexer.topk", name, inputs, ("logits", "k"), tol={"ids_sorted": "exact"}, why=why))

    vals, lpos = o["topk_vals"], torch.tensor([2, 3, 37, 159])
    vis = torch.arange(vals.shape[1])[None, :] < ((lpos + 1) // 4)[:, None]
    case(
        "causal_mask_minus1_padding",
        vals.masked_fill(~vis, -math.inf),
        16,
        "−inf (not yet visible) ids become −1, rows padded with −1; p = 2 → none, p = 3 → id 0 (#26)",
    )
    g2 = generator(80)
    lg = torch.randperm(3 * 12, generator=g2).float().view(3, 12)
    lg[0, 4], lg[1, 0], lg[1, 11] = math.inf, math.inf, -math.inf
    case("plus_inf_ranks_first", lg, 2, "+∞ is a score (it ranks first), −∞ is never selected")
    case("k_exceeds_columns", lg[:, :5], 8, "k = 8 over 5 columns: the 5 ids, then −1")
    case("all_masked_rows", torch.full((2, 6), -math.inf), 3, "rows with nothing visible: all −1")
    case(
        "shortcut_ignores_logits",
        torch.full((3, 8), math.nan),
        4,
        "every n_c <= k: the logits are not read (NaN here) and ids 0..n_c−1 come back",
        positions=torch.tensor([0, 9, 15]),
    )
    big = torch.randperm(2 * 300, generator=g2).float().view(2, 300).t().contiguous().t()
    case("k_64_of_300_column_major", big, 64, "k = 64 of 300 columns, logits stored column-major")
    case("empty_batch", torch.zeros(0, 7), 5, "T = 0: an empty [0, k] result")
    return out


def _to_global_cases(g) -> list[Case]:
    out = []

    def case(name, local, bt, slots, bs, why):
        inputs = dict(topk_local=local, block_table=bt, block_size=bs) | ({} if slots is None else dict(slots=slots))
        out.append(
            Case(
                "indexer.to_global",
                name,
                inputs,
                ("topk_local", "block_table") + (() if slots is None else ("slots",)),
                tol={"global_slots": "exact", "topk_len": "exact"},
                why=why,
            )
        )

    bt = torch.stack([torch.randperm(20, generator=g)[:5] for _ in range(4)]).to(torch.int32)
    local = torch.tensor([[0, 5, 19, -1, -1, -1], [3, 4, 7, 8, 12, 1], [-1] * 6, [2, -1, -1, -1, -1, -1]], dtype=torch.int32)
    case(
        "shuffled_tables_invalid_token",
        local,
        bt,
        torch.tensor([10, -1, 11, 12]),
        4,
        "global = page·B + l % B through each token's own table row; a padding token (slot −1) gets length 0",
    )
    case(
        "slots_past_int32",
        torch.tensor([[0, 63, 64, -1]], dtype=torch.int32),
        torch.tensor([[2**25, 2**26 - 1]], dtype=torch.int64),
        None,
        64,
        "page 2^25 of 64-slot pages is slot 2^31: int64 out, no wrap to −2^31",
    )
    case(
        "unmapped_pages_minus1",
        torch.tensor([[0, 5, 9, 12], [1, 2, 3, -1]]),
        torch.tensor([[-1, 3, 7, -1], [6, -1, -1, -1]]),
        None,
        4,
        "an id in an unmapped page (entry −1) maps to −1 and is not counted",
    )
    case(
        "int64_ids_int32_slots",
        torch.tensor([[7, 0, 3]], dtype=torch.int64),
        torch.tensor([[9, 4]], dtype=torch.int64),
        torch.tensor([2], dtype=torch.int32),
        4,
        "int64 ids and block table, int32 token slots",
    )
    case(
        "block_size_1",
        torch.tensor([[2, 0, -1], [1, 1, 0]], dtype=torch.int32),
        torch.tensor([[11, 12, 13], [5, 6, 7]], dtype=torch.int32),
        None,
        1,
        "pages of one slot: global = page",
    )
    case(
        "nothing_selected",
        torch.full((2, 3), -1, dtype=torch.int32),
        torch.zeros(2, 0, dtype=torch.int32),
        None,
        64,
        "all −1 ids and an empty block table: all −1, lengths 0",
    )
    case(
        "empty_batch",
        torch.zeros(0, 4, dtype=torch.int32),
        torch.zeros(0, 2, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int64),
        16,
        "T = 0",
    )
    return out


def cases() -> list[Case]:
    o = _originals()
    return [*_quantize_q_cases(o), *_insert_k_cases(o), *_logits_cases(o), *_topk_cases(o), *_to_global_cases(generator(81))]
