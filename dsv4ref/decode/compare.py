"""Hold the decode path to the float64 dense reference: the tolerances and their derivation, the row
relative error, and :func:`agreement` of recorded steps (:func:`dsv4ref.decode.run`'s records) with
:func:`dsv4ref.decode.reference_forward` of each request's history (``docs/decode.md#tolerances``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import Config
from ..tolerances import TOLERANCES
from .reference import reference_forward

__all__ = [
    "ATTN_TOL",
    "LOGITS_TOL",
    "AGREEMENT_TOL",
    "ATTN_TOL_V4",
    "LOGITS_TOL_V4",
    "tolerances",
    "rel_err",
    "StepAgreement",
    "agreement",
]

#: Tolerances of the decode path against the float64 reference, on the row relative L2 error
#: ||a − b|| / ||b|| (``docs/decode.md#tolerances``). The only lossy format on the path is the e4m3 KV
#: NoPE part (window and compressed rows): each dequantised value is within the relative half-ulp 2^-4 of
#: the true one (measured RMS over a row ≈ 2^-5). An attention output o = Σ_j P_j v_j · σ(lse − sink) is
#: first-order in that error twice: through the V rows (≤ 2^-4 relative, a convex combination does not
#: amplify it) and through the softmax weights P (the scores q·k_j move by the same relative amount).
#: Hence ATTN_TOL = 2·2^-4 = 2^-3 for every layer's attention output (measured: mean ≈ 0.035, max ≈ 0.066;
#: the row "decode_step" of dsv4ref.tolerances.TOLERANCES). The logits see the FP8 error only through the
#: attention updates of the residual stream, which are a fraction of its norm (the embedding and the FFN
#: carry no FP8 error), so LOGITS_TOL = 2^-4 (measured ≈ 0.015). bf16 activations add ~2^-9 per rounding
#: (≈ 0.4% measured on q and kv): noise at this scale. A missing sink, a missing inverse RoPE, NeoX pairing
#: or dropped compressed rows give attention errors of 0.3–1.2 (tests/test_decode.py). A transposed comb
#: does NOT show here (the random comb is near the identity): the conformance suite's 4-cycle trap catches
#: that one.
ATTN_TOL = 2.0**-3
LOGITS_TOL = 2.0**-4
AGREEMENT_TOL = (ATTN_TOL, LOGITS_TOL)
#: With V4's weight formats (``cfg.weight_format == "v4"``) the float64 reference runs the dequantised weights
#: (the same operand values) on unquantised activations, so the 1x128 e4m3 activation quantiser in front of
#: every FP8 / FP4 GEMM is on the error budget too: the same e4m3 format as the KV NoPE (≤ 2^-4 relative per
#: element). The attention output is first-order in it along the same two paths (its q and kv projections'
#: inputs move the scores; kv's and wo_b's inputs move the values), so it gets the KV's budget 2·2^-4 once
#: more: ATTN_TOL_V4 = 2^-2. The logits see it through the attention updates and, now, the FFN (every expert
#: input is quantised): LOGITS_TOL_V4 = 2·2^-4 = 2^-3 (docs/decode.md#v4s-number-formats has the measured
#: values).
ATTN_TOL_V4 = TOLERANCES["decode_step_v4"].rtol  # 2^-2
LOGITS_TOL_V4 = 2.0**-3


def tolerances(cfg: Config) -> tuple[float, float]:
    """(attention, logits) tolerances of :func:`agreement` for ``cfg``'s weight format."""
    return (ATTN_TOL_V4, LOGITS_TOL_V4) if cfg.weight_format == "v4" else AGREEMENT_TOL


def rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise relative L2 error ||a − b|| / ||b|| over the last dim, float64 on the CPU."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-300)


@dataclass
class StepAgreement:
    """One recorded step against the reference."""

    step: int  # −1 for the prefill's last prompt token
    logits_err: float  # max over requests of the row relative error
    attn_err: float  # max over layers and requests
    top1_agree: int  # requests whose argmax matches the reference
    n: int  # requests compared (active ones)
    tol: tuple = AGREEMENT_TOL  # (attention, logits): :func:`tolerances` of the config

    @property
    def passed(self) -> bool:
        return self.logits_err <= self.tol[1] and self.attn_err <= self.tol[0]


def agreement(cfg: Config, weights: dict, records, history, bugs=()) -> list[StepAgreement]:
    """Compare recorded decode-path outputs with :func:`reference_forward` of each request's history.

    Args:
        records: list of (step, positions (R,) int64, logits (R, V), attn [per layer (R, Hd)], active (R,)
            bool), as :func:`run` returns them.
        history: :meth:`Decoder.history`.
        bugs: passed to the reference (names from ``REFERENCE_BUGS``).

    Returns: one :class:`StepAgreement` per record."""
    toks, topks = history
    experts = getattr(history, "experts", None)  # the MoE's choices (Decoder.history().experts)
    refs = [
        reference_forward(cfg, weights, toks[r], topks[r], bugs=bugs, experts=None if experts is None else experts[r])
        for r in range(len(toks))
    ]
    rows = []
    for step, pos, logits, attn, active in records:
        le, ae, top1, n = 0.0, 0.0, 0, 0
        for r in range(len(toks)):
            if not bool(active[r]):
                continue
            p = int(pos[r])
            ref = refs[r]
            le = max(le, float(rel_err(logits[r], ref["logits"][p])))
            ae = max([ae] + [float(rel_err(attn[li][r], ref["attn"][li][p])) for li in range(len(attn))])
            top1 += int(int(logits[r].argmax()) == int(ref["logits"][p].argmax()))
            n += 1
        rows.append(StepAgreement(step, le, ae, top1, n, tolerances(cfg)))
    return rows
