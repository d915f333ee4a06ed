"""Conformance suite: hold ANY implementation of dsv4ref's public ops to the references.

An implementation is a callable with our public signature (an XPU port, a vLLM kernel behind a thin
adapter, a reader's own attempt). :func:`run` feeds it the adversarial cases our tests use and compares
what it returns (or writes, for in-place ops) with the reference's output under a named row of
:data:`dsv4ref.testing.TOLERANCES`::

    from dsv4ref import conformance
    report = conformance.run({"sparse_mla.decode": my_decode})        # only the ops you map are run
    print(conformance.format_report(report))

Cases (see :func:`all_cases`) cover what has broken real DSV4 kernels (``../shared/spec/pitfalls.md``):
per-block scales over many octaves (#1), amax = 448·2^k blocks (#3), odd page sizes B = 61 and B = 2
(#9), −1 slots and slot maps shorter than the batch (#11), −1 inside an index prefix (#12), empty rows
and ±inf sinks (#17, #18), padded heads with −inf sinks (#19), the inverse RoPE on the output (#14),
and mHC's transposed-comb trap (#22). Caches that an op should leave alone start as random bytes, so a
stray write shows.

The same cases, frozen, are the golden vectors (``scripts/make_golden.py`` → ``golden/*.pt``): plain
``torch.save`` dicts of named tensors (inputs, expected outputs, tolerance names) that a C++/SYCL port
can read with libtorch (``torch::pickle_load``) or any .pt reader, without running our Python.

``python -m dsv4ref.conformance [OP_PREFIX] [--golden DIR]`` prints the report (``main``).
"""

from __future__ import annotations

import math
import pathlib
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from .device import DEVICE
from .testing import Report, compare, generator, randn

__all__ = ["Case", "Row", "all_cases", "default_impls", "reference_impls", "run", "format_report", "main",
           "save_golden", "load_golden"]


@dataclass
class Case:
    """One input set for one op. ``inputs`` maps argument names to values, in signature order;
    ``positional`` names those passed positionally (the rest go by keyword). ``expected`` maps output
    names to the reference's tensors, ``tol`` output names to a TOLERANCES row. ``mass`` maps an output
    compared under "bf16_weighted_sum" to its Σ_j p_j·|v_j| (the scale its rounding error grows with)."""

    op: str
    name: str
    inputs: dict
    positional: tuple
    expected: dict = field(default_factory=dict)
    tol: dict = field(default_factory=dict)
    why: str = ""
    mass: dict = field(default_factory=dict)


@dataclass
class Row:
    op: str
    case: str
    output: str
    report: Report | None  # None: the implementation raised
    error: str = ""

    @property
    def passed(self) -> bool:
        return self.report is not None and self.report.passed


# ----------------------------------------------------------------------------------------------------
# outputs of each op: what to compare, taken from the return value and the (mutated) inputs
# ----------------------------------------------------------------------------------------------------

OUTPUTS: dict[str, Callable[[object, dict], dict]] = {
    "kv_cache.insert": lambda res, a: {"cache": a["cache"]},
    "kv_cache.gather": lambda res, a: {"out": res},
    "rope.apply_gptj": lambda res, a: {"out": res},
    "rope.qnorm_rope_kv_insert": lambda res, a: {"q": a["q"], "cache": a["cache"]},
    "rope.grouped_o_proj": lambda res, a: {"out": res},
    "sparse_mla.decode": lambda res, a: {"out": res[0], "lse": res[1]},
    "mhc.pre": lambda res, a: {"post": res[0], "comb": res[1], "layer_input": res[2]},
    "mhc.post": lambda res, a: {"residual": res},
    "mhc.fused_post_pre": lambda res, a: {"residual": res[0], "post": res[1], "comb": res[2], "layer_input": res[3]},
    "mhc.head": lambda res, a: {"out": res},
    "indexer.quantize_q": lambda res, a: {"q": res[0], "weights_out": res[2]},
    "indexer.insert_k": lambda res, a: {"k_cache": a["k_cache"]},
    "indexer.logits": lambda res, a: {"logits": res},
    "indexer.topk": lambda res, a: {"ids_sorted": torch.sort(res.long(), dim=-1).values},
}


def _fn(op: str, backend: str | None):
    """The library function of ``op`` with ``backend`` bound (None: the op has no backend switch)."""
    import functools
    import importlib

    mod, name = op.split(".")
    f = getattr(importlib.import_module(f"dsv4ref.{mod}"), name)
    return functools.partial(f, backend=backend) if backend else f


_NO_BACKEND = {"rope.grouped_o_proj", "indexer.topk"}


def _available_ops() -> list[str]:
    ops = []
    for op in OUTPUTS:
        try:
            _fn(op, None)
        except (ImportError, AttributeError):
            continue
        ops.append(op)
    return ops


def default_impls() -> dict[str, Callable]:
    """Every op that exists in this checkout, through its Triton kernel (``backend="triton"``)."""
    return {op: _fn(op, None if op in _NO_BACKEND else "triton") for op in _available_ops()}


def reference_impls() -> dict[str, Callable]:
    """Every op through its torch reference: the suite's own oracle (a sanity run; must all PASS)."""
    return {op: _fn(op, None if op in _NO_BACKEND else "reference") for op in _available_ops()}


# ----------------------------------------------------------------------------------------------------
# the cases
# ----------------------------------------------------------------------------------------------------


def _cpu_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=generator(seed), dtype=torch.int64).to(torch.uint8)


def _kv_rows(T: int, seed: int) -> torch.Tensor:
    """bf16 [T, 512] with per-64-block scales over 16 octaves, one all-zero block and blocks whose amax
    is exactly 448·2^k (where a float-log2 scale rule goes one byte too high)."""
    kv = randn((T, 512), seed=seed, device="cpu")
    kv[0, 64:128] = 0.0
    kv[1, 0:64] = kv[1, 0:64] / kv[1, 0:64].abs().max().float() * 448.0
    kv[min(2, T - 1), 128:192] = kv[min(2, T - 1), 128:192] / kv[min(2, T - 1), 128:192].abs().max().float() * 1.75
    return kv


def _random_cache(n_pages: int, B: int, seed: int) -> torch.Tensor:
    from . import kv_cache

    pb = kv_cache.page_bytes(B)
    return _cpu_bytes(n_pages * pb, seed).view(n_pages, pb)


def _filled_cache(n_pages: int, B: int, seed: int) -> torch.Tensor:
    """A cache with every slot written by the reference writer (so every row decodes to finite values)."""
    from . import kv_cache

    cache = kv_cache.allocate(n_pages, B, device="cpu")
    kv = _kv_rows(n_pages * B, seed)
    kv_cache.insert(cache, kv, torch.arange(n_pages * B), block_size=B, backend="reference")
    return cache


def _cases_kv_cache() -> list[Case]:
    g = generator(11)
    out = []
    # insert: B = 61 (odd), 3 pages, −1 slots, random bytes elsewhere (a stray write shows)
    T, B, P = 24, 61, 3
    slots = torch.randperm(P * B, generator=g)[:T]
    slots[::5] = -1
    out.append(Case("kv_cache.insert", "B61_minus1_slots_random_bytes",
                    dict(cache=_random_cache(P, B, 1), kv=_kv_rows(T, 2), slot_mapping=slots, block_size=B),
                    ("cache", "kv", "slot_mapping"), tol={"cache": "exact"},
                    why="odd page size (#9), −1 slots write nothing (#11), 16-octave scales + 448·2^k blocks (#1, #3)"))
    # insert: B = 2, slot_mapping shorter than kv (padding rows at the end)
    T, B, P = 9, 2, 6
    slots = torch.randperm(P * B, generator=g)[:6]
    out.append(Case("kv_cache.insert", "B2_short_slot_mapping",
                    dict(cache=_random_cache(P, B, 3), kv=_kv_rows(T, 4), slot_mapping=slots, block_size=B),
                    ("cache", "kv", "slot_mapping"), tol={"cache": "exact"},
                    why="the 1728-B golden page size; rows beyond slot_mapping are padding (#11)"))
    # gather: B = 61, −1 entries give zero rows
    B, P = 61, 2
    slots = torch.randperm(P * B, generator=g)[:20].to(torch.int32)
    slots[3] = slots[11] = -1
    out.append(Case("kv_cache.gather", "B61_minus1", dict(cache=_filled_cache(P, B, 5), slots=slots, block_size=B),
                    ("cache", "slots"), tol={"out": "exact"}, why="dequant is exact; −1 gives a zero row (#12)"))
    return out


def _table(theta: float, yarn: dict | None, max_pos: int = 512) -> torch.Tensor:
    from . import rope

    return rope.cos_sin_cache(max_pos, 64, theta, yarn, device="cpu")


def _cases_rope() -> list[Case]:
    from .config import TINY

    g = generator(21)
    out = []
    T, H = 5, 16
    x = randn((T, H, 512), seed=22, device="cpu", block=None, octaves=4)
    pos = torch.tensor([0, 1, 299, 511, 37])
    out.append(Case("rope.apply_gptj", "inverse_on_output_yarn",
                    dict(x=x, positions=pos, cos_sin=_table(TINY.compress_rope_theta, TINY.yarn), inverse=True),
                    ("x", "positions", "cos_sin", "inverse"), tol={"out": "bf16_out"},
                    why="inverse RoPE at the query position on dims 448..511 only (#14, #16)"))
    B, P = 16, 2
    q = randn((T, H, 512), seed=23, device="cpu", block=None, octaves=6)
    kv = _kv_rows(T, 24)
    slots = torch.randperm(P * B, generator=g)[:4]
    slots[1] = -1
    out.append(Case("rope.qnorm_rope_kv_insert", "minus1_and_short_slot_mapping",
                    dict(q=q, kv=kv, cache=_random_cache(P, B, 25), slot_mapping=slots, positions=pos,
                         cos_sin=_table(TINY.rope_theta, None), eps=1e-6, block_size=B),
                    ("q", "kv", "cache", "slot_mapping", "positions", "cos_sin"), tol={"q": "bf16_out", "cache": "exact"},
                    why="q-norm over all 512 dims then RoPE; slot −1 and rows past slot_mapping write nothing (#11)"))
    G, o_lora, Hd, H = 2, 64, 128, 4
    o = randn((3, H, 512), seed=26, device="cpu", block=None, octaves=2)
    wo_a = (torch.randn(G, o_lora, H // G * 512, generator=g) / math.sqrt(H // G * 512)).to(torch.bfloat16)
    wo_b = (torch.randn(Hd, G * o_lora, generator=g) / math.sqrt(G * o_lora)).to(torch.bfloat16)
    out.append(Case("rope.grouped_o_proj", "tiny_G2", dict(o=o, wo_a=wo_a, wo_b=wo_b), ("o", "wo_a", "wo_b"),
                    tol={"out": "bf16_gemm"}, why="contiguous head groups (rope.md §7)"))
    return out


def _cases_sparse_mla() -> list[Case]:
    g = generator(31)
    out = []
    B1, P1, B2, P2 = 61, 2, 2, 16
    c1, c2 = _filled_cache(P1, B1, 32), _filled_cache(P2, B2, 33)
    T, H = 5, 16
    q = randn((T, H, 512), seed=34, device="cpu", block=None, octaves=2)
    idx1 = torch.randperm(P1 * B1, generator=g)[: T * 20].view(T, 20).to(torch.int32)
    len1 = torch.tensor([20, 7, 0, 13, 20], dtype=torch.int32)
    idx1[0, 4] = idx1[3, 2] = -1  # −1 inside the prefix (#12)
    idx1[2] = -1  # row 2: empty in both pools
    idx2 = torch.randperm(P2 * B2, generator=g)[: T * 6].view(T, 6).to(torch.int32)
    len2 = torch.tensor([6, 0, 0, 3, 6], dtype=torch.int32)
    idx2[4, 1] = -1
    sink = torch.randn(H, generator=g)
    sink[0], sink[1], sink[2] = -math.inf, math.inf, 0.0
    out.append(Case("sparse_mla.decode", "two_pools_minus1_empty_row_inf_sinks",
                    dict(q=q, cache=c1, indices=idx1, lengths=len1, block_size=B1, sink=sink, scale=512**-0.55,
                         extra_cache=c2, extra_indices=idx2, extra_lengths=len2, extra_block_size=B2),
                    ("q", "cache", "indices", "lengths"), tol={"out": "bf16_weighted_sum", "lse": "lse"},
                    why="B = 61 and B = 2 pools in one softmax; −1 inside prefixes (#12); an empty row (out 0, "
                        "lse −inf; #18); sinks −inf, +inf, 0 and finite (#17); scale 512^-0.55"))
    Hp = 64
    qp = torch.cat([randn((T, H, 512), seed=35, device="cpu", block=None, octaves=2),
                    torch.zeros(T, Hp - H, 512, dtype=torch.bfloat16)], dim=1)
    sinkp = torch.cat([torch.randn(H, generator=g), torch.full((Hp - H,), -math.inf)])
    out.append(Case("sparse_mla.decode", "padded_heads_64",
                    dict(q=qp, cache=c1, indices=idx1, lengths=len1, block_size=B1, sink=sinkp),
                    ("q", "cache", "indices", "lengths"), tol={"out": "bf16_weighted_sum", "lse": "lse"},
                    why="H = 16 padded to 64 with zero q rows and −inf sinks: padded rows finite (#19)"))
    return out


def _cases_mhc() -> list[Case]:
    from .config import TINY

    g = generator(41)
    out = []
    T, M, Hd = 3, TINY.hc_mult, TINY.hidden_size
    res = randn((T, M, Hd), seed=42, device="cpu", block=None, octaves=4)
    x = randn((T, Hd), seed=43, device="cpu", block=None, octaves=2)
    fn = torch.randn(M * (M + 2), M * Hd, generator=g) / math.sqrt(M * Hd)
    scale = torch.tensor([0.7, 0.4, 1.3])
    base = 0.3 * torch.randn(M * (M + 2), generator=g)
    kw = dict(rms_eps=TINY.rms_norm_eps, hc_eps=TINY.hc_eps)
    out.append(Case("mhc.pre", "model_constants", dict(residual=res, fn=fn, scale=scale, base=base, **kw),
                    ("residual", "fn", "scale", "base"), tol={"post": "mhc", "comb": "mhc", "layer_input": "bf16_out"},
                    why="post_mult 2, eps 1e-6, 20 Sinkhorn passes (#23); RMS of the flattened streams"))
    # the 4-cycle trap: comb ≈ P with P[0,1] = P[1,2] = P[2,3] = P[3,0] = 1; new_res_j must be res_{j-1}
    P = torch.zeros(M, M)
    for i in range(M):
        P[i, (i + 1) % M] = 1.0
    comb = (P * (1 - 3e-6) + 1e-6).expand(T, M, M).contiguous()
    post = (2 * torch.rand(T, M, 1, generator=g))
    out.append(Case("mhc.post", "transposed_comb_trap_4cycle", dict(x=x, residual=res, post=post, comb=comb),
                    ("x", "residual", "post", "comb"), tol={"residual": "bf16_out"},
                    why="Σ_i comb[i, j]·res_i, i.e. combᵀ @ res: the 4-cycle catches comb @ res (#22)"))
    fn2 = torch.randn(M * (M + 2), M * Hd, generator=g) / math.sqrt(M * Hd)
    out.append(Case("mhc.fused_post_pre", "cycle_comb_then_pre",
                    dict(x=x, residual=res, post=post, comb=comb, fn=fn2, scale=scale, base=base, **kw),
                    ("x", "residual", "post", "comb", "fn", "scale", "base"),
                    tol={"residual": "bf16_out", "post": "mhc", "comb": "mhc", "layer_input": "bf16_out"},
                    why="post then the next sub-layer's pre (mhc.md §6)"))
    hfn = torch.randn(M, M * Hd, generator=g) / math.sqrt(M * Hd)
    out.append(Case("mhc.head", "hc_head", dict(hidden=res, fn=hfn, scale=torch.tensor([0.5]),
                                                base=0.2 * torch.randn(M, generator=g), **kw),
                    ("hidden", "fn", "scale", "base"), tol={"out": "bf16_out"}, why="mhc.md §7"))
    return out


def _cases_indexer() -> list[Case]:
    from . import indexer
    from .config import TINY

    g = generator(51)
    out = []
    T, nih = 4, TINY.index_heads
    table = _table(TINY.compress_rope_theta, TINY.yarn)
    iq = randn((T, nih, 128), seed=52, device="cpu", block=None, octaves=8)
    iq[0, 0] = iq[0, 0] / iq[0, 0].abs().max().float() * 448.0  # amax = 448·2^k: the exact ceil matters (#3)
    pos = torch.tensor([2, 3, 37, 299])
    wts = torch.randn(T, nih, generator=g)
    for had in (False, True):
        out.append(Case("indexer.quantize_q", f"fp8_hadamard_{had}",
                        dict(index_q=iq, positions=pos, cos_sin=table, weights=wts, fmt="fp8", hadamard=had),
                        ("index_q", "positions", "cos_sin", "weights"), tol={"q": "exact", "weights_out": "exact"},
                        why="RoPE on dims 64..127, bf16 round trip (#4), optional Hadamard (#24), q scale folded "
                            "into the weights (#25)"))
    # indexer K: write 80 keys (two requests' compressed rows) into shuffled 16-key pages, random bytes elsewhere
    Bc, P = 16, 8
    k = randn((80, 128), seed=53, device="cpu", block=None, octaves=8)
    bt = torch.randperm(P, generator=g).to(torch.int32).view(2, 4)
    loc = torch.arange(40)
    slots = torch.cat([bt[0, loc // Bc].long() * Bc + loc % Bc, bt[1, loc // Bc].long() * Bc + loc % Bc])
    slots[5] = -1
    kc = _cpu_bytes(P * indexer.k_page_bytes(Bc), 54).view(P, -1)
    out.append(Case("indexer.insert_k", "soa_pages_minus1", dict(k_cache=kc, k=k, slot_mapping=slots, block_size=Bc,
                                                                  hadamard=True),
                    ("k_cache", "k", "slot_mapping"), tol={"k_cache": "exact"},
                    why="[Bc×128 e4m3][Bc×4 fp32 scale] pages (#9), −1 writes nothing (#11)"))
    kc2 = indexer.allocate_k_cache(P, Bc, device="cpu")
    indexer.insert_k(kc2, k, slots.clamp(min=0), block_size=Bc, hadamard=True, backend="reference")
    q8, _, w_out = indexer.quantize_q(iq, pos.clamp(max=159), table, wts, hadamard=True, backend="reference")
    lpos = torch.tensor([2, 3, 37, 159])  # visible rows n_c = 0, 1, 9, 40
    out.append(Case("indexer.logits", "block_table_causal",
                    dict(q=q8, q_scales=None, weights_out=w_out, k_cache=kc2, positions=lpos,
                         block_table=bt[torch.tensor([0, 1, 0, 1])], block_size=Bc, n_out=40),
                    ("q", "q_scales", "weights_out", "k_cache", "positions"), tol={"logits": "fp32_reduction"},
                    why="per-token block tables; ReLU per head before the weighted sum; −inf for s >= (p+1)//4 (#26)"))
    n, kk = 40, 16
    vals = torch.randperm(T * n, generator=g).float().view(T, n)  # no ties (indexer.md §7)
    vis = torch.arange(n)[None, :] < ((lpos + 1) // 4)[:, None]
    out.append(Case("indexer.topk", "causal_mask_minus1_padding", dict(logits=vals.masked_fill(~vis, -math.inf), k=kk),
                    ("logits", "k"), tol={"ids_sorted": "exact"},
                    why="−inf (not yet visible) ids become −1, rows padded with −1; p = 2 → none, p = 3 → id 0 (#26)"))
    return out


_BUILDERS = {"kv_cache": _cases_kv_cache, "rope": _cases_rope, "sparse_mla": _cases_sparse_mla,
             "mhc": _cases_mhc, "indexer": _cases_indexer}


def all_cases(only: str | None = None, *, with_expected: bool = True) -> list[Case]:
    """Every case of every op present in this checkout (``only``: op-name prefix), with the expected
    outputs computed by the references (on :data:`DEVICE`)."""
    avail = set(_available_ops())
    cases = []
    for mod, build in _BUILDERS.items():
        if only and not (mod.startswith(only) or only.startswith(mod)):
            continue
        if not any(op.startswith(mod + ".") for op in avail):
            continue
        cases += [c for c in build() if c.op in avail and (not only or c.op.startswith(only))]
    if with_expected:
        ref = reference_impls()
        for c in cases:
            c.expected = {k: v.detach().cpu() for k, v in _call(ref[c.op], c).items()}
            if c.op == "sparse_mla.decode":
                c.mass = {"out": _sparse_mla_mass(c)}
    return cases


def _sparse_mla_mass(c: Case) -> torch.Tensor:
    """Σ_j p_j·|v_j| (sink factor included) of a sparse_mla.decode case, from the reference."""
    from . import sparse_mla

    a = c.inputs
    pools = [(a["cache"], a["indices"], a["lengths"], a["block_size"])]
    if a.get("extra_cache") is not None:
        pools.append((a["extra_cache"], a["extra_indices"], a["extra_lengths"], a["extra_block_size"]))
    pools = [tuple(_to_device(v, DEVICE) for v in p) for p in pools]
    sink = _to_device(a.get("sink"), DEVICE) if a.get("sink") is not None else None
    q = _to_device(a["q"], DEVICE)
    return sparse_mla._reference(q, pools, sink, a.get("scale", sparse_mla.DEFAULT_SCALE), with_mass=True)[2].cpu()


# ----------------------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------------------


def _to_device(v, device):
    return v.clone().to(device) if isinstance(v, torch.Tensor) else v


def _call(impl: Callable, case: Case, device=None) -> dict:
    args = {k: _to_device(v, device or DEVICE) for k, v in case.inputs.items()}  # fresh copies: ops mutate
    pos = [args[k] for k in case.positional]
    kw = {k: v for k, v in args.items() if k not in case.positional}
    return OUTPUTS[case.op](impl(*pos, **kw), args)


def run(impls: dict[str, Callable] | None = None, cases: list[Case] | str | None = None) -> list[Row]:
    """Run each case whose op is in ``impls`` (default: :func:`default_impls`) and compare its outputs
    with the case's expected ones. ``cases``: a list of :class:`Case` (e.g. :func:`load_golden`), an
    op-name prefix, or None for all. Returns one :class:`Row` per (case, output); an implementation that
    raises gives FAIL rows carrying the error."""
    impls = default_impls() if impls is None else impls
    if cases is None or isinstance(cases, str):
        cases = all_cases(cases)
    rows = []
    for c in cases:
        if c.op not in impls:
            continue
        try:
            got = _call(impls[c.op], c)
        except Exception as e:  # noqa: BLE001 - a crash is a FAIL, reported with its message
            rows += [Row(c.op, c.name, o, None, f"{type(e).__name__}: {e}") for o in c.expected]
            continue
        for o, exp in c.expected.items():
            if o not in got:
                rows.append(Row(c.op, c.name, o, None, "output missing"))
                continue
            m = c.mass.get(o)
            rows.append(Row(c.op, c.name, o, compare(got[o], exp.to(got[o].device), c.tol[o], o,
                                                     None if m is None else m.to(got[o].device))))
    return rows


def format_report(rows: list[Row], details: bool = True) -> str:
    """A table, one line per (case, output). ``details=False`` leaves out error magnitudes and messages
    (notebooks print only verdicts, so CPU and GPU outputs match)."""
    head = f"{'op':<26} {'case':<40} {'output':<12} {'tolerance':<10} verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        tol = r.report.tol if r.report else "-"
        v = "PASS" if r.passed else "FAIL" + (" " + (r.error or (r.report.detail if r.report else "")) if details else "")
        lines.append(f"{r.op:<26} {r.case:<40} {r.output:<12} {tol:<10} {v}")
    n_fail = sum(not r.passed for r in rows)
    lines.append(f"{len(rows) - n_fail} passed, {n_fail} failed")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# golden vectors
# ----------------------------------------------------------------------------------------------------


def save_golden(directory, cases: list[Case] | None = None) -> list[pathlib.Path]:
    """Write each case to ``directory/<op>__<case>.pt``: a dict with keys op, case, why, positional
    (argument names passed positionally, in order), inputs (name → tensor or number), expected (output
    name → tensor) and tolerance (output name → TOLERANCES row name, plus its numbers)."""
    from .testing import TOLERANCES

    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for c in cases if cases is not None else all_cases():
        p = d / f"{c.op}__{c.name}.pt"
        tol = {o: dict(name=t, mode=TOLERANCES[t].mode, atol=TOLERANCES[t].atol, rtol=TOLERANCES[t].rtol,
                       cos=TOLERANCES[t].cos) for o, t in c.tol.items()}
        torch.save(dict(op=c.op, case=c.name, why=c.why, positional=list(c.positional),
                        inputs={k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in c.inputs.items()},
                        expected={k: v.cpu().clone() for k, v in c.expected.items()}, tolerance=tol,
                        mass={k: v.cpu().clone() for k, v in c.mass.items()}), p)
        paths.append(p)
    return paths


def load_golden(directory) -> list[Case]:
    """The cases stored by :func:`save_golden` (expected outputs as stored, not recomputed)."""
    cases = []
    for p in sorted(pathlib.Path(directory).glob("*.pt")):
        d = torch.load(p, weights_only=True)
        cases.append(Case(d["op"], d["case"], d["inputs"], tuple(d["positional"]), d["expected"],
                          {o: t["name"] for o, t in d["tolerance"].items()}, d["why"], d.get("mass", {})))
    return cases


def main(argv=None) -> int:
    """``python -m dsv4ref.conformance [OP_PREFIX] [--golden DIR] [--reference]``: run the suite on this
    checkout's Triton kernels (or its references) and print the report; exit 1 on any FAIL."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dsv4ref.conformance", description=main.__doc__)
    ap.add_argument("op", nargs="?", help="only ops whose name starts with this")
    ap.add_argument("--golden", help="run the stored golden cases of this directory instead")
    ap.add_argument("--reference", action="store_true", help="check the torch references instead of the kernels")
    a = ap.parse_args(argv)
    impls = reference_impls() if a.reference else default_impls()
    cases = load_golden(a.golden) if a.golden else all_cases(a.op)
    if a.op:
        cases = [c for c in cases if c.op.startswith(a.op)]
    rows = run(impls, cases)
    print(format_report(rows))
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
