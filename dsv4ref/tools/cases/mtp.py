"""``python -m dsv4ref check mtp``: greedy verification on its table, and speculative decoding (the draft layer,
k = 2, verification through the Triton kernels on a GPU) against plain greedy decoding, token for token."""

from __future__ import annotations

import torch

from ... import mtp
from ...config import TINY
from ...device import interpreting
from ...decode import run, run_speculative
from ...tolerances import Report
from ..harness import CheckRow, check

TABLE = [([5, 7, 9], [5, 7, 8, 2], [5, 7, 8]), ([5, 7, 9], [5, 7, 9, 3], [5, 7, 9, 3]), ([4, 7, 9], [5, 7, 9, 3], [5])]


def _verdict(name: str, ok: bool, detail: str = "") -> Report:
    return Report(name, 0.0 if ok else float("inf"), 0.0 if ok else float("inf"), "exact", ok, detail)


@check("mtp.greedy_accept")
def _check_accept() -> list[CheckRow]:
    rows = []
    for d, t, want in TABLE:
        got = mtp.greedy_accept(torch.tensor(d), torch.tensor(t)).tolist()
        rows.append(CheckRow("mtp.greedy_accept", f"{d} vs {t}", _verdict("emitted", got == want, f"{got}")))
    return rows


@check("mtp.speculate")
def _check_speculate() -> list[CheckRow]:
    """2 requests, 4 tokens: speculation (k = 2) emits the plain greedy tokens; the acceptance rate is shown."""
    steps, prompts = 4, (40, 9)
    be = "reference" if interpreting() else "triton"  # the interpreter would take minutes; decode.step runs Triton
    plain, _, _, _ = run(TINY, steps=steps, prompt_lens=prompts, decode_backend=be)
    spec, _, _, _ = run_speculative(TINY, steps=steps, k=2, prompt_lens=prompts, decode_backend=be)
    same = all(plain.tokens[r, n : n + steps].tolist() == spec.generated[r][:steps] for r, n in enumerate(prompts))
    rep = _verdict("tokens", same, f"acceptance {spec.spec.accepted}/{spec.spec.drafted}")
    return [CheckRow("mtp.speculate", f"tiny, k=2, {be} ops, == plain greedy", rep)]
