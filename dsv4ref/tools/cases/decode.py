"""``python -m dsv4ref check decode``: a whole decode step through the Triton kernels vs the float64 reference."""

from __future__ import annotations

from ...config import TINY
from ...decode import ATTN_TOL, LOGITS_TOL, agreement, run
from ...tolerances import Report
from ..harness import CheckRow, check


@check("decode.step")
def check_decode_step() -> list[CheckRow]:
    """Prefill 2 requests (torch ops), 2 decode steps through the Triton kernels, against the float64
    reference. The tolerance is dsv4ref.decode.ATTN_TOL, the row 'decode_step' of dsv4ref.tolerances.TOLERANCES."""
    dec, w, recs, _ = run(TINY, steps=2, prompt_lens=(40, 9), decode_backend="triton")
    out = []
    for a in agreement(TINY, w, recs, dec.history())[1:]:
        rep = Report(f"step {a.step}", max(a.attn_err, a.logits_err), a.attn_err, "decode_step", a.passed,
                     f"logits {a.logits_err:.3g} (<= {LOGITS_TOL:g}), attention {a.attn_err:.3g} (<= {ATTN_TOL:g})")
        out.append(CheckRow("decode.step", f"tiny, T=2, step {a.step}", rep))
    return out
