"""Run the decoder, hold it to the float64 dense reference, and ``python -m dsv4ref demo``.

* :func:`run`: prefill random prompts, then greedy-decode, recording every step's logits and every
  layer's attention output;
* :func:`agreement`: compare those records with :func:`dsv4ref.decode.reference_forward` of each
  request's history, under :data:`ATTN_TOL` and :data:`LOGITS_TOL`;
* :func:`demo`: both, printed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from ..config import TINY, Config
from ..device import DEVICE, describe, interpreting, synchronize
from ..testing import generator
from .model import Decoder
from .reference import reference_forward
from .weights import make_weights

__all__ = ["ATTN_TOL", "LOGITS_TOL", "AGREEMENT_TOL", "rel_err", "StepAgreement", "agreement", "run", "demo"]

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

    @property
    def passed(self) -> bool:
        return self.logits_err <= LOGITS_TOL and self.attn_err <= ATTN_TOL


def agreement(cfg: Config, weights: dict, records, history, bugs=()) -> list[StepAgreement]:
    """Compare recorded decode-path outputs with :func:`reference_forward` of each request's history.

    Args:
        records: list of (step, positions (R,) int64, logits (R, V), attn [per layer (R, Hd)], active (R,)
            bool), as :func:`run` returns them.
        history: :meth:`Decoder.history`.
        bugs: passed to the reference (names from ``REFERENCE_BUGS``).

    Returns: one :class:`StepAgreement` per record."""
    toks, topks = history
    refs = [reference_forward(cfg, weights, toks[r], topks[r], bugs=bugs) for r in range(len(toks))]
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
        rows.append(StepAgreement(step, le, ae, top1, n))
    return rows


def run(cfg: Config = TINY, *, steps: int = 8, prompt_lens=(133, 37, 5, 70), seed: int = 0, capacity: int | None = None,
        decode_backend: str = "auto", prefill_backend: str = "reference", pad_heads: bool = True,
        inactive: dict | None = None, progress=None, profile: bool = False):
    """Prefill random prompts, then greedy-decode ``steps`` tokens.

    ``inactive``: {step: [request ids]} that sit out that step as padding; ``progress(i, n)`` is called
    after each step; ``profile`` collects per-op milliseconds in the decoder's ``prof``.
    Returns (decoder, weights, records, tokens/s of the decode loop); records as :func:`agreement` takes
    them, the first one (step −1) the prefill's last prompt token."""
    R = len(prompt_lens)
    cap = capacity or (max(prompt_lens) + steps + 15) // 16 * 16
    w = make_weights(cfg, seed)
    dec = Decoder(cfg, w, num_requests=R, capacity=cap, seed=seed, pad_heads=pad_heads, backend=decode_backend)
    g = generator(seed + 2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in prompt_lens]
    logits = dec.prefill(prompts, backend=prefill_backend)
    last = (torch.tensor(prompt_lens).cumsum(0) - 1)
    records = [(-1, torch.tensor(prompt_lens) - 1, logits.cpu(), [a[last.to(a.device)].cpu() for a in dec.attn_out],
                torch.ones(R, dtype=torch.bool))]
    synchronize()
    t0 = time.perf_counter()
    if profile:
        dec.prof = {}
    for s in range(steps):
        act = torch.ones(R, dtype=torch.bool)
        for r in (inactive or {}).get(s, []):
            act[r] = False
        ids = logits.argmax(-1).cpu()
        pos = dec.lengths.clone()
        logits = dec.step(ids, active=act)
        records.append((s, pos, logits.cpu(), [a.cpu() for a in dec.attn_out], act))
        if progress:
            progress(s + 1, steps)
    synchronize()
    tps = R * steps / (time.perf_counter() - t0)
    return dec, w, records, tps


def demo(steps: int = 16) -> int:
    """``python -m dsv4ref demo``: prefill 4 requests (prompts of 133, 37, 5 and 70 tokens), decode
    ``steps`` tokens each through the Triton kernels, print tokens/s and per-step agreement.
    Returns the exit code: 0 if every step agrees with the reference, else 1."""
    cfg = TINY
    print(f"dsv4ref demo: {cfg.name}, {cfg.num_layers} layers, ratios {cfg.compress_ratios}; {describe()}")

    def bar(i, n):
        k = 30 * i // n
        sys.stdout.write(f"\rdecode [{'#' * k}{'.' * (30 - k)}] {i}/{n}")
        sys.stdout.flush()

    t0 = time.perf_counter()
    if not interpreting():  # compile every kernel first, so the timed loop measures decoding, not the JIT
        run(cfg, steps=1)
    dec, w, recs, tps = run(cfg, steps=steps, progress=bar)
    print(f"\ndecoded {steps} steps x {dec.R} requests: {tps:.1f} tokens/s "
          f"({'interpreted Triton' if interpreting() else 'compiled Triton'} kernels; prefill + decode "
          f"{time.perf_counter() - t0:.1f} s)")
    if not interpreting() and DEVICE.type != "cpu":
        dec2, _, _, _ = run(cfg, steps=steps, profile=True)
        tot = sum(dec2.prof.values())
        print("per-op time share (decode steps, each op synchronised):")
        for k, v in sorted(dec2.prof.items(), key=lambda kv: -kv[1]):
            print(f"  {k:<22} {v / tot:6.1%}  ({v / steps * 1e3:8.1f} us/step)")
    rows = agreement(cfg, w, recs, dec.history())
    print(f"agreement with the float64 dense reference (row relative L2 error; tolerances: attention "
          f"{ATTN_TOL:g}, logits {LOGITS_TOL:g}; see dsv4ref.decode.ATTN_TOL):")
    print(f"{'step':>6} {'logits':>9} {'attn (max over layers)':>24} {'top-1':>7}  verdict")
    for a in rows:
        print(f"{'prefill' if a.step < 0 else a.step:>6} {a.logits_err:>9.2e} {a.attn_err:>24.2e} "
              f"{a.top1_agree:>4}/{a.n}  {'PASS' if a.passed else 'FAIL'}")
    ok = all(a.passed for a in rows)
    print("all steps agree" if ok else "DISAGREEMENT")
    return 0 if ok else 1
