"""The FlashMLA peer (dsv4ref.tools.peers.flashmla): FlashMLA's SM90 sparse-decode kernel behind our
``sparse_mla.decode`` signature.

On a CPU: every mapping helper (the cache view reads exactly our record of every slot, the slot padding keeps
which entries count, head padding, the lse mapping), the argument checks, the whole adapter run through the
conformance suite against a plain-torch model of FlashMLA's documented behaviour, the bench's and the ladder
file's peer plumbing, and the bench output parsing. On a Hopper GPU with ``flash_mla`` installed: FlashMLA itself
through the conformance suite, held to the per-case table of docs/glossary.md.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import re
import sys

import pytest
import torch

from dsv4ref import conformance, kv_cache
from dsv4ref.conformance.inputs import filled_cache
from dsv4ref.formats import (
    DATA_BYTES,
    N_SCALES,
    NOPE_DIM,
    QUANT_BLOCK,
    SCALE_BYTES,
    TOKEN_BYTES,
    token_data_offset,
    token_scale_offset,
)
from dsv4ref.tools.peers import flashmla
from dsv4ref.validate import checking_values

ROOT = pathlib.Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "glossary.md"
FAILS_BY_CONVENTION = {"nonfinite_cache_rows_poison_their_token", "nan_query_checks_off"}


# ---------------------------------------------------------------------------------------------------
# FlashMLA's V4 page layout, read from its k_cache argument (our own decoder of its documented format)
# ---------------------------------------------------------------------------------------------------


def v4_record(k_cache: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 576 data bytes and 8 scale bytes of ``slot`` where FlashMLA's V4 format puts them, given its
    ``k_cache [pages, B, 1, 584]``: page ``slot // B`` (by ``stride(0)``), data row ``576·o``, scale row
    ``576·B + 8·o`` of that page's bytes."""
    B = k_cache.shape[1]
    page = k_cache[slot // B].reshape(-1)  # B·584 bytes, contiguous within the page
    o = slot % B
    return page[DATA_BYTES * o : DATA_BYTES * (o + 1)], page[
        DATA_BYTES * B + SCALE_BYTES * o : DATA_BYTES * B + SCALE_BYTES * (o + 1)
    ]


def v4_rows(k_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, 512]``: the rows at ``slots`` (every entry ≥ 0) decoded from ``k_cache`` by FlashMLA's V4 format:
    7 blocks of 64 e4m3 values × 2^(scale byte − 127), then 64 bf16 RoPE values."""
    P, B = k_cache.shape[:2]
    pages = k_cache.reshape(P, B * TOKEN_BYTES)
    p, o = (slots // B)[:, None], (slots % B)[:, None]
    data = pages[p, DATA_BYTES * o + torch.arange(DATA_BYTES, device=slots.device)]
    scales = pages[p, DATA_BYTES * B + SCALE_BYTES * o + torch.arange(N_SCALES, device=slots.device)]
    nope = data[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float().view(-1, N_SCALES, QUANT_BLOCK)
    nope = nope * torch.exp2(scales.float() - 127)[..., None]
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.reshape(-1, NOPE_DIM), rope], dim=1)


def strided(cache: torch.Tensor, pad: int = 32) -> torch.Tensor:
    """The same pages as a view of a wider buffer (page stride = width + ``pad``), the gaps full of 0xAB."""
    buf = torch.full((cache.shape[0], cache.shape[1] + pad), 0xAB, dtype=torch.uint8)
    view = buf[:, : cache.shape[1]]
    view.copy_(cache)
    return view


# ---------------------------------------------------------------------------------------------------
# the mapping helpers
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B,P", [(64, 3), (61, 2), (2, 16), (1, 48)])
def test_cache_view_reads_exactly_the_bytes_of_every_slot(B, P):
    cache = strided(filled_cache(P, B, seed=B))
    ps = cache.stride(0)
    v = flashmla.cache_view(cache, B)
    assert v.shape == (P, B, 1, TOKEN_BYTES) and v.stride() == (ps, TOKEN_BYTES, TOKEN_BYTES, 1)
    assert v.data_ptr() == cache.data_ptr()  # a view of the same bytes, not a copy
    assert TOKEN_BYTES * B <= cache.shape[1]  # each page of the view ends inside our page
    flat = cache.as_strided((cache.shape[0] * ps,), (1,), cache.storage_offset())
    for s in range(P * B):
        data, scales = v4_record(v, s)
        d, c = token_data_offset(ps, B, s), token_scale_offset(ps, B, s)
        assert torch.equal(data, flat[d : d + DATA_BYTES]) and torch.equal(scales, flat[c : c + SCALE_BYTES]), s
    # decoded as FlashMLA's format says, they are the rows our reader returns, bit for bit
    every = torch.arange(P * B)
    ours = kv_cache.gather(cache, every, block_size=B, backend="reference")
    assert torch.equal(v4_rows(v, every).to(torch.bfloat16).view(torch.int16), ours.view(torch.int16))


def test_cache_view_refuses_what_flashmla_cannot_read():
    B = 2
    pb = kv_cache.page_bytes(B)
    buf = torch.zeros(3 * pb + 16, dtype=torch.uint8)
    odd = buf[1 : 1 + 3 * pb].view(3, pb)  # pages at odd addresses: ours reads them, FlashMLA does not
    with pytest.raises(ValueError, match=r"^cache: FlashMLA's kernel loads 16-byte vectors"):
        flashmla.cache_view(odd, B)
    gaps = torch.zeros(3, pb + 8, dtype=torch.uint8)[:, :pb]  # page stride pb + 8: not a multiple of 16
    with pytest.raises(ValueError, match=r"^extra_cache: FlashMLA's kernel"):
        flashmla.cache_view(gaps, B, "extra_cache", "extra_block_size")
    with pytest.raises(ValueError, match=r"^extra_cache: pages of"):  # laid out for B = 2, read as B = 4
        flashmla.cache_view(kv_cache.allocate(3, B, device="cpu"), 4, "extra_cache", "extra_block_size")
    with pytest.raises(TypeError, match=r"^extra_block_size:"):
        flashmla.cache_view(kv_cache.allocate(3, B, device="cpu"), True, "extra_cache", "extra_block_size")


@pytest.mark.parametrize("K", [0, 1, 63, 64, 65, 130])
@pytest.mark.parametrize("with_lengths", [True, False])
def test_pad_slots_keeps_which_entries_count(K, with_lengths):
    g = torch.Generator().manual_seed(K)
    T = 6
    slots = torch.randint(-3, 50, (T, K), generator=g)  # int64, with −1, −2, −3
    lengths = torch.tensor([0, K, K // 2, K + 7, -2, 1]) if with_lengths else None  # out of range: clamped
    idx, ln = flashmla.pad_slots(slots, lengths)
    Kp = idx.shape[-1]
    assert idx.shape == (T, 1, Kp) and idx.dtype == torch.int32 and idx.is_contiguous()
    assert Kp % 64 == 0 and max(64, K) <= Kp < max(64, K) + 64
    assert int(idx.min()) >= -1 if idx.numel() else True  # FlashMLA's only "none" is −1
    n = torch.arange(K)
    ours = slots >= 0
    theirs = idx[:, 0] != -1
    if with_lengths:
        assert ln.dtype == torch.int32 and ln.is_contiguous() and int(ln.min()) >= 0 and int(ln.max()) <= K
        ours = ours & (n < lengths.clamp(0, K)[:, None])
        theirs = theirs & (torch.arange(Kp) < ln[:, None])
    else:
        assert ln is None
    assert torch.equal(theirs[:, :K], ours) and not theirs[:, K:].any()
    assert torch.equal(idx[:, 0, :K][ours].long(), slots[ours])  # the same slot wherever an entry counts


@pytest.mark.parametrize("H", [1, 16, 20, 63, 64, 65, 128])
def test_pad_heads(H):
    T = 3
    q = torch.randn(H, T, 512).to(torch.bfloat16).transpose(0, 1)  # heads-major: not contiguous
    sink = torch.randn(H)
    q4, s = flashmla.pad_heads(q, sink)
    Hp = 64 if H <= 64 else 128
    assert q4.shape == (T, 1, Hp, 512) and q4.is_contiguous() and q4.dtype == torch.bfloat16
    assert torch.equal(q4[:, 0, :H], q) and not q4[:, 0, H:].any()
    assert s.shape == (Hp,) and torch.equal(s[:H], sink) and bool((s[H:] == -math.inf).all())
    assert flashmla.pad_heads(q, None)[1] is None
    with pytest.raises(ValueError, match=r"^q: FlashMLA's kernels take at most 128 heads"):
        flashmla.pad_heads(torch.zeros(T, 129, 512, dtype=torch.bfloat16), None)


def test_map_out_and_lse():
    T, Hp, H = 4, 64, 20
    lse_buf = torch.randn(T, 1, Hp)
    lse_buf[1, 0, :] = math.inf  # an empty row: FlashMLA writes +inf
    lse_buf[2, 0, 3] = math.nan
    lse_buf[3, 0, 5] = -math.inf
    want = lse_buf[:, 0, :H].clone()
    want[1] = -math.inf
    for lse in (lse_buf.transpose(1, 2), lse_buf):  # as documented ([T, Hp, 1], a transposed view), and untransposed
        got = flashmla.map_lse(lse, H)
        assert got.shape == (T, H) and got.is_contiguous() and got.dtype == torch.float32
        assert torch.equal(got.nan_to_num(nan=7.0), want.nan_to_num(nan=7.0)) and bool(got[2, 3].isnan())
    out = torch.randn(T, 1, Hp, 512).to(torch.bfloat16)
    o = flashmla.map_out(out, H)
    assert o.shape == (T, H, 512) and o.is_contiguous() and torch.equal(o, out[:, 0, :H])


def _inputs(T=3, H=16, K1=40, K2=10):
    g = torch.Generator().manual_seed(5)
    c1, c2 = filled_cache(4, 16, 1), filled_cache(24, 2, 2)
    return dict(
        q=torch.randn(T, H, 512, generator=g).to(torch.bfloat16),
        cache=c1,
        slots=torch.randint(-1, 64, (T, K1), generator=g, dtype=torch.int32),
        lengths=torch.tensor([K1, 7, 0][:T], dtype=torch.int32),
        block_size=16,
        sink=torch.randn(H, generator=g),
        extra_cache=c2,
        extra_slots=torch.randint(-1, 48, (T, K2), generator=g),
        extra_block_size=2,
    )


def test_map_inputs_gives_flashmla_its_arguments():
    a = _inputs()
    call = flashmla.map_inputs(**a, scale=0.05, extra_lengths=None)
    kw = call.kwargs
    assert (call.heads, call.tokens) == (16, 3) and "tile_scheduler_metadata" not in kw  # made by the first call
    assert kw["q"].shape == (3, 1, 64, 512) and kw["attn_sink"].shape == (64,)
    assert kw["k_cache"].shape == (4, 16, 1, 584) and kw["k_cache"].stride(1) == 584
    assert kw["extra_k_cache"].shape == (24, 2, 1, 584)
    assert kw["indices"].shape == (3, 1, 64) and kw["extra_indices_in_kvcache"].shape == (3, 1, 64)
    assert kw["topk_length"].dtype == torch.int32 and kw["extra_topk_length"] is None
    assert (
        kw["head_dim_v"],
        kw["softmax_scale"],
        kw["kv_format"],
        kw["use_legacy"],
        kw["is_fp8_kvcache"],
        kw["causal"],
        kw["block_table"],
        kw["cache_seqlens"],
        kw["num_splits"],
    ) == (512, 0.05, "V4", True, True, False, None, None, None)
    one_pool = flashmla.map_inputs(**{k: v for k, v in a.items() if not k.startswith("extra_")})
    assert not any(k.startswith("extra_") for k in one_pool.kwargs)


def test_map_inputs_refuses_naming_the_argument():
    a = _inputs()
    with pytest.raises(ValueError, match=r"^q: expected 1\.\.128 heads"):
        flashmla.map_inputs(**(a | dict(q=torch.zeros(3, 129, 512, dtype=torch.bfloat16), sink=None)))
    with pytest.raises(ValueError, match=r"^extra_cache, extra_block_size: the extra pool needs"):
        flashmla.map_inputs(**(a | dict(extra_cache=None, extra_block_size=None)))
    bad = a["slots"].clone()
    bad[1, 2] = 4 * 16  # one past the cache
    with pytest.raises(ValueError, match=r"^slots: entry \(1, 2\) = 64 is out of range"):
        flashmla.map_inputs(**(a | dict(slots=bad)))
    with pytest.raises(TypeError, match=r"^sink: expected dtype torch.float32"):
        flashmla.map_inputs(**(a | dict(sink=a["sink"].double())))
    with pytest.raises(ValueError, match=r"^scale: expected a number > 0"):
        flashmla.map_inputs(**a, scale=0.0)


def test_decode_without_flashmla_says_why():
    ok, why = flashmla.available()
    if ok:
        pytest.skip("flash_mla runs here")
    assert why
    with pytest.raises(RuntimeError, match="FlashMLA peer: not available"):
        flashmla.decode(**_inputs())


# ---------------------------------------------------------------------------------------------------
# the whole adapter, against a plain-torch model of what FlashMLA documents
# ---------------------------------------------------------------------------------------------------


class FlashMLAModel:
    """``flash_mla``'s two functions as its documentation describes them, in fp32 torch: the signature of
    ``sgl-flash-mla==1.0.0``'s ``flash_mla_with_kvcache``, its argument requirements asserted (64 or 128 heads,
    topk a positive multiple of 64, int32 indices where only −1 is none, the V4 page layout, b > 0), its
    outputs in its layout (out ``[b, 1, h, 512]``, lse ``[b, h, 1]``, +inf for a row with no valid entry).
    Not a model of its non-finite behaviour, which it does not document."""

    def __init__(self):
        self.calls = 0

    @staticmethod
    def get_mla_metadata(*args, **kwargs):
        return object(), None

    def flash_mla_with_kvcache(
        self,
        q,
        k_cache,
        block_table,
        cache_seqlens,
        head_dim_v,
        tile_scheduler_metadata,
        num_splits=None,
        softmax_scale=None,
        causal=False,
        is_fp8_kvcache=None,
        indices=None,
        attn_sink=None,
        extra_k_cache=None,
        extra_indices_in_kvcache=None,
        topk_length=None,
        extra_topk_length=None,
        enable_batch_invariant=False,
        use_legacy=False,
        kv_format=None,
        descale_q=None,
        descale_k=None,
    ):
        self.calls += 1
        b, s_q, h, d = q.shape
        assert b > 0 and s_q == 1 and h in (64, 128) and d == 512 == head_dim_v and q.dtype == torch.bfloat16
        assert use_legacy and kv_format == "V4" and is_fp8_kvcache and not causal and num_splits is None
        assert tile_scheduler_metadata is not None and softmax_scale > 0
        assert attn_sink is None or (attn_sink.shape == (h,) and attn_sink.dtype == torch.float32)
        rows, masks = [], []
        for kc, idx, ln in ((k_cache, indices, topk_length), (extra_k_cache, extra_indices_in_kvcache, extra_topk_length)):
            if kc is None:
                assert idx is None and ln is None
                continue
            assert kc.dtype == torch.uint8 and kc.shape[2:] == (1, TOKEN_BYTES) and kc.stride(1) == TOKEN_BYTES
            assert idx.dtype == torch.int32 and idx.shape[:2] == (b, 1) and idx.shape[2] % 64 == 0 and idx.shape[2] > 0
            topk = idx.shape[2]
            valid = idx[:, 0] != -1
            if ln is not None:
                assert ln.dtype == torch.int32 and ln.shape == (b,)
                valid = valid & (torch.arange(topk, device=idx.device) < ln[:, None])
            k = v4_rows(kc, idx[:, 0].clamp_min(0).reshape(-1).long()).view(b, topk, 512)
            rows.append(k.masked_fill(~valid[..., None], 0.0))  # entries that do not count are never read
            masks.append(valid)
        k, valid = torch.cat(rows, 1), torch.cat(masks, 1)
        s = softmax_scale * torch.einsum("bhd,bkd->bhk", q[:, 0].float(), k)
        s = s.masked_fill(~valid[:, None], -math.inf)
        lse = torch.logsumexp(s, -1)  # natural log
        empty = ~valid.any(1)
        out = torch.einsum("bhk,bkd->bhd", torch.exp(s - lse[..., None]).nan_to_num(0.0), k)
        if attn_sink is not None:
            out = out * torch.sigmoid(lse - attn_sink)[..., None]
        out[empty] = 0.0
        lse[empty] = math.inf
        return out.to(torch.bfloat16)[:, None], lse[:, None].transpose(1, 2)


@pytest.fixture
def model(monkeypatch):
    m = FlashMLAModel()
    monkeypatch.setattr(flashmla, "_module", lambda: m)
    monkeypatch.setattr(flashmla, "available", lambda device=None: (True, "a CPU model of flash_mla"))
    return m


def glossary_table() -> dict[tuple[str, str], bool]:
    """{(case, output): expected to pass} from docs/glossary.md's table of FlashMLA through our suite."""
    text = GLOSSARY.read_text()
    section = text.split("### Expected result per case of `sparse_mla.decode`", 1)[1].split("\n### ", 1)[0]
    want = {}
    for case, out, lse in re.findall(r"^\| `(\w+)` \| (PASS|FAIL) \| (PASS|FAIL) \|", section, re.M):
        want[(case, "out")], want[(case, "lse")] = out == "PASS", lse == "PASS"
    return want


def test_the_glossary_table_names_every_case_once():
    want = glossary_table()
    names = [c.name for c in conformance.all_cases("sparse_mla", with_expected=False)]
    assert sorted(want) == sorted((n, o) for n in names for o in ("out", "lse"))
    assert sum(want.values()) == 12 and len(want) == 16
    assert {c for (c, _), ok in want.items() if not ok} == FAILS_BY_CONVENTION


def test_the_adapter_passes_every_convention_case_on_the_model(model):
    """If FlashMLA does what it documents, the adapter's mapping makes it pass every case the glossary expects
    to pass: the mapping is right, whatever the GPU then says about the kernel."""
    rows = conformance.run({"sparse_mla.decode": flashmla.decode}, "sparse_mla")
    want = glossary_table()
    assert {(r.case, r.output) for r in rows} == set(want)
    bad = [(r.case, r.output, r.error or r.report.detail) for r in rows if want[(r.case, r.output)] and not r.passed]
    assert bad == []
    assert model.calls == len(want) // 2 - 1  # one call per case; the empty batch is answered without one


def test_empty_batch_needs_no_call(model):
    a = _inputs()
    a = a | dict(q=a["q"][:0], slots=a["slots"][:0], lengths=a["lengths"][:0], extra_slots=a["extra_slots"][:0])
    out, lse = flashmla.decode(**a)
    assert out.shape == (0, 16, 512) and out.dtype == torch.bfloat16 and lse.shape == (0, 16)
    assert model.calls == 0


def test_prepare_makes_the_metadata_once(model):
    call = flashmla.prepare(**_inputs(), extra_lengths=torch.tensor([10, 3, 0]))
    assert model.calls == 1 and call.kwargs["tile_scheduler_metadata"] is not None
    out, lse = call.result(call.run())
    assert model.calls == 2 and out.shape == (3, 16, 512) and lse.shape == (3, 16)
    assert bool((lse[2] == -math.inf).all()) and not out[2].any()  # row 2 counts nothing: our empty-row answer


def test_value_checks_off_maps_below_minus_one_and_long_lengths(model):
    a = _inputs()
    a["slots"][0, :5] = -7  # ours counts any negative slot as −1 with checks off
    a["lengths"][1] = 99  # clamped to K
    with checking_values(False):
        got = flashmla.decode(**a)
        ref = flashmla.decode(**(a | dict(slots=a["slots"].clamp_min(-1), lengths=a["lengths"].clamp(0, 40))))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


# ---------------------------------------------------------------------------------------------------
# the bench and the ladder file
# ---------------------------------------------------------------------------------------------------


def _rows(times: dict):
    from dsv4ref.tools.harness import BenchCase, BenchRow

    return [
        BenchRow(BenchCase(op, f"T={T} H={H} K={K}", None, 1, 1.0, extra=dict(T=T, H=H, K=K)), us / 1e3, 0, 0, 0)
        for (op, T, H, K), us in times.items()
    ]


def test_bench_grid_holds_the_ladder_and_the_issue_shapes():
    from dsv4ref.tools.cases import sparse_mla as cases

    grid = cases.bench_grid()
    assert grid[:3] == list(cases.BENCH_SHAPES) and sorted(grid) == sorted(set(cases.GRID_SHAPES))
    assert len(grid) == 15 and all(K > cases.WINDOW and (T * (K - cases.WINDOW)) % 64 == 0 for T, H, K in grid)


def test_peer_ratios_and_the_ladder_anchor(tmp_path):
    from dsv4ref.tools.cases import sparse_mla as cases
    from dsv4ref.tools.harness import SUMMARIES, Ceilings

    assert SUMMARIES["sparse_mla"] is cases.peer_ratios
    times = {}
    for T, H, K in cases.GRID_SHAPES:
        times[("sparse_mla.gluon", T, H, K)] = 30.0
        times[(cases.PEER_OP, T, H, K)] = 20.0
    del times[(cases.PEER_OP, 1, 64, 640)]  # the peer failed at one shape
    times[("sparse_mla.fused", 64, 64, 640)] = 80.0  # the gluon time is ours where both ran
    lines = cases.peer_ratios(_rows(times))
    assert lines[0].startswith("sparse_mla: ours / FlashMLA") and len(lines) == 1 + 14
    assert "  T=64 H=64 K=640: sparse_mla.gluon 30.0 us / FlashMLA 20.0 us = 1.50" in lines
    assert cases.peer_ratios(_rows({("sparse_mla.gluon", 64, 64, 640): 30.0})) == []

    d = cases.ladder(Ceilings(4e12, 7e14), _rows(times), device="test", command="test")
    assert d["peer"]["key"] == "flashmla" and d["peer"]["bench_op"] == cases.PEER_OP
    assert d["peer"]["us"] == [20.0] * 3 and d["peer"]["status"] == "measured"
    assert [(g["T"], g["H"], g["K"]) for g in d["peer_grid"]] == list(cases.GRID_SHAPES)
    first = d["peer_grid"][0]
    assert (first["ours_op"], first["ours_us"], first["flashmla_us"], first["ours_over_flashmla"]) == (
        "sparse_mla.gluon",
        30.0,
        None,
        None,
    )
    assert d["peer_grid"][5]["ours_over_flashmla"] == 1.5
    for key in ("device", "date", "command", "ceilings", "accounting", "shapes", "rungs", "others"):
        assert key in d  # the keys notebook 04 reads stay

    # a later run without the peer keeps the measured anchor, and keys it does not write ("diagnostics")
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps(d | {"diagnostics": {"about": "kept"}}))
    again = cases.write_ladder(
        path,
        device="test",
        command="test",
        measured=(Ceilings(4e12, 7e14), _rows({k: v for k, v in times.items() if k[0] != cases.PEER_OP})),
    )
    assert again["peer"] == d["peer"] and again["peer_grid"] == d["peer_grid"]
    assert again["diagnostics"] == {"about": "kept"} and json.loads(path.read_text())["diagnostics"] == {"about": "kept"}
    none = cases.ladder(Ceilings(4e12, 7e14), [], device="test", command="test")
    assert none["peer"]["status"] == "pending" and none["peer"]["us"] == [None] * 3


def _write_results():
    spec = importlib.util.spec_from_file_location("write_results", ROOT / "benchmarks" / "write_results.py")
    mod = sys.modules["write_results"] = importlib.util.module_from_spec(spec)  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def test_the_new_bench_lines_parse_or_are_ignored():
    """RESULTS.md's generator reads the new rows as (op, shape) rows, finds the ladder's rows exactly as before
    beside them, and ignores the skip and ratio lines."""
    W = _write_results()

    def row(op, shape, us, note):  # dsv4ref/tools/cli.py's row format
        return f"{op:<26} {shape:<40} {us:>9.1f} {1234:>8.0f} {12.3:>8.1f} {0.456:>8.1%}  {note}"

    log = "\n".join(
        [
            "cuda (NVIDIA H200); torch 2.11.0+cu130; triton 3.6.0",
            "ceilings measured now: copy 4.11 TB/s (read + write), bf16 matmul 786 TFLOP/s",
            "FlashMLA peer skipped: no CUDA device here (FlashMLA's SM90 kernels need a Hopper GPU)",
            row("sparse_mla.fused", "T=64 H=64 K=640 split=2", 78.5, "584+4 B/row"),
            row("sparse_mla.gluon", "T=64 H=64 K=640", 35.7, "warp-specialised"),
            row(
                "sparse_mla.flashmla",
                "T=64 H=64 K=640",
                20.0,
                "FlashMLA's SM90 kernel (sgl-flash-mla==1.0.0, use_legacy=True), inputs mapped outside the timing",
            ),
            row("sparse_mla.gluon", "T=64 H=64 K=2176", 90.0, "warp-specialised"),
            row("sparse_mla.fused", "T=64 H=64 K=2176 split=4", 120.0, "584+4 B/row"),
            row("sparse_mla.flashmla", "T=64 H=16 K=2048", 40.0, "FlashMLA's SM90 kernel; H 16 runs as 64 heads"),
            "sparse_mla.flashmla T=8 H=64 K=640: FAILED RuntimeError: boom",
            "sparse_mla.flashmla T=8 H=128 K=1152: its lse differs from ours on input set 0 (lse: FAIL (max abs 1)); "
            "timed all the same",
            "sparse_mla: ours / FlashMLA per shape (time ratio, same run, same inputs; above 1 FlashMLA is faster)",
            "  T=64 H=64 K=640: sparse_mla.gluon 35.7 us / FlashMLA 20.0 us = 1.78",
        ]
    )
    parsed = W.parse_bench(log, "x.log")
    assert [(r.op, r.shape) for r in parsed.rows] == [
        ("sparse_mla.fused", "T=64 H=64 K=640 split=2"),
        ("sparse_mla.gluon", "T=64 H=64 K=640"),
        ("sparse_mla.flashmla", "T=64 H=64 K=640"),
        ("sparse_mla.gluon", "T=64 H=64 K=2176"),
        ("sparse_mla.fused", "T=64 H=64 K=2176 split=4"),
        ("sparse_mla.flashmla", "T=64 H=16 K=2048"),
    ]
    assert parsed.failed == ["sparse_mla.flashmla T=8 H=64 K=640: FAILED RuntimeError: boom"]
    assert parsed.find("sparse_mla.gluon", "T=64 H=64 K=640").us == "35.7"
    assert parsed.find("sparse_mla.fused", "T=64 H=64 K=640").us == "78.5"
    assert W.peers(parsed, parsed.find("sparse_mla.gluon", "T=64 H=64 K=640")) == []  # the peer is not a "beside" row


# ---------------------------------------------------------------------------------------------------
# on a Hopper GPU with flash_mla installed: FlashMLA itself
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not flashmla.available()[0], reason=f"FlashMLA peer: {flashmla.available()[1]}")
def test_flashmla_through_the_conformance_suite():
    """FlashMLA's kernel, through the adapter, on every case of sparse_mla.decode: the per-case result must be
    the table in docs/glossary.md (correct the table, with the run's report, when the GPU says otherwise)."""
    rows = conformance.run({"sparse_mla.decode": flashmla.decode}, "sparse_mla")
    got = {(r.case, r.output): r.passed for r in rows}
    assert got == glossary_table(), "\n" + conformance.format_report(rows)


def test_bench_cases_with_the_peer(model, monkeypatch, capsys):
    """``bench sparse_mla``'s cases on a tiny grid (one ladder shape, one other), the peer modelled: every rung
    at the ladder shape, ours and the peer elsewhere, all on the same input sets, each case runnable."""
    from dsv4ref.tools.cases import sparse_mla as cases

    def tiny_inputs(T, H, K, n_sets, device):
        out = []
        for s in range(n_sets):
            g = torch.Generator().manual_seed(s)
            c1, c2 = filled_cache(2 * T, 64, 3 * s), filled_cache(T * (K - cases.WINDOW) // 64, 64, 3 * s + 1)
            s = dict(
                q=torch.randn(T, H, 512, generator=g).to(torch.bfloat16),
                cache=c1,
                slots=torch.randperm(128 * T, generator=g).to(torch.int32).view(T, 128),
                lengths=torch.full((T,), 128, dtype=torch.int32),
                block_size=64,
                sink=torch.randn(H, generator=g),
                extra_cache=c2,
                extra_slots=torch.randperm(T * (K - 128), generator=g).to(torch.int32).view(T, K - 128),
                extra_lengths=torch.full((T,), K - 128, dtype=torch.int32),
                extra_block_size=64,
            )
            out.append({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in s.items()})
        return out

    monkeypatch.setattr(cases, "BENCH_SHAPES", ((2, 16, 192),))
    monkeypatch.setattr(cases, "GRID_SHAPES", ((1, 64, 192), (2, 16, 192)))
    monkeypatch.setattr(cases, "bench_inputs", tiny_inputs)
    monkeypatch.setattr(cases, "n_sets_for", lambda T, K: 2)
    monkeypatch.setattr(cases, "_gluon", lambda: None)  # the portable rungs only, on every device
    got = cases._bench()
    assert [(c.op, c.shape) for c in got] == [
        ("sparse_mla.seed", "T=2 H=16 K=192 split=1"),
        ("sparse_mla.two_pass", "T=2 H=16 K=192 split=1"),
        ("sparse_mla.fused[split=1]", "T=2 H=16 K=192 split=1"),
        ("sparse_mla.fused", "T=2 H=16 K=192 split=1"),
        (cases.PEER_OP, "T=2 H=16 K=192"),
        ("sparse_mla.fused", "T=1 H=64 K=192 split=1"),
        (cases.PEER_OP, "T=1 H=64 K=192"),
    ]
    assert "H 16 runs as 64 heads" in got[4].note and "runs as" not in got[6].note
    assert all(c.n_sets == 2 for c in got) and capsys.readouterr().out == ""  # no skip line, no FAILED line
    calls = model.calls
    got[4].run(1)
    assert model.calls == calls + 1  # a timed call launches FlashMLA only: mapping and metadata were made before
