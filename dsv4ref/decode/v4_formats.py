"""What V4's number formats change in a decode step: :func:`format_error` runs the same model (one bf16 draw)
with ``weight_format="bf16"`` and ``"v4"`` and measures the difference, step by step
(``docs/decode.md#v4s-number-formats``). A measuring tool beside the decode path, never on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import TINY, Config
from ..device import DEVICE, HOST
from ..seeded import generator
from ..weights import dequantize_weights, make_weights
from .compare import rel_err
from .model import Decoder
from .reference import reference_forward

__all__ = ["FormatError", "FormatStep", "format_error"]


@dataclass
class FormatStep:
    """One step (−1: the prefill's last prompt token), maxima over the requests of the row relative L2 error of
    the logits: ``v4_vs_bf16`` (the two runs on the same tokens), ``bf16_vs_oracle`` / ``v4_vs_oracle`` (each
    run against the float64 reference of the same weights); ``top1``: requests whose v4 argmax equals the bf16
    run's, of ``n``."""

    step: int
    v4_vs_bf16: float
    bf16_vs_oracle: float
    v4_vs_oracle: float
    top1: int
    n: int


@dataclass
class FormatError:
    """:func:`format_error`'s result: ``steps`` (:class:`FormatStep` per step), ``parted``: per request, the
    index of the first generated token (0 = the one the prefill picks) at which greedy decoding with V4's formats
    picks another token than the bf16 run (None: the same tokens throughout), and the config's ``moe_path``."""

    steps: list = field(default_factory=list)
    parted: list = field(default_factory=list)
    moe_path: str = "deepseek"

    def table(self) -> str:
        """The steps as a markdown table."""
        rows = ["| step | v4 vs bf16 | top-1 | bf16 vs float64 | v4 vs float64 |", "|---|---|---|---|---|"]
        for s in self.steps:
            rows.append(
                f"| {'prefill' if s.step < 0 else s.step} | {s.v4_vs_bf16:.4f} | {s.top1}/{s.n} | {s.bf16_vs_oracle:.4f} | "
                f"{s.v4_vs_oracle:.4f} |"
            )
        return "\n".join(rows)


_WEIGHTS: dict = {}


def _weights(cfg: Config, seed: int) -> tuple[dict, dict]:
    """(bf16 dict, v4 dict) of one model: the v4 draw of ``cfg``, and its exact dequantisation in bf16; kept
    per (config, seed, device) (the quantisers take seconds on a CPU)."""
    key = (repr(cfg.replace(weight_format="v4")), seed, str(DEVICE))
    if key not in _WEIGHTS:
        wv = make_weights(cfg.replace(weight_format="v4"), seed)
        _WEIGHTS.clear()
        _WEIGHTS[key] = (dequantize_weights(wv, None), wv)
    return _WEIGHTS[key]


def _decode(cfg, w, prompts, steps, backend, forced=None):
    """Prefill ``prompts`` and decode ``steps`` tokens: greedy, or the tokens ``forced`` (R, steps). Returns
    (decoder, [logits (R, V) per step, the prefill's first])."""
    dec = Decoder(cfg, w, num_requests=len(prompts), capacity=(max(map(len, prompts)) + steps + 15) // 16 * 16, backend=backend)
    logits = [dec.prefill(prompts, backend=backend).cpu()]
    for s in range(steps):
        ids = logits[-1].argmax(-1) if forced is None else forced[:, s]
        logits.append(dec.step(ids, backend=backend).cpu())
    return dec, logits


def format_error(
    cfg: Config = TINY, *, steps: int = 3, prompt_lens=(12, 5), seed: int = 0, backend: str = "reference", oracle: bool = True
) -> FormatError:
    """The error V4's formats add to a decode step, on ``cfg`` (the teaching config by default; with the reference
    backend on a CPU, seconds once the weights are made, which the first call does and keeps).

    One model, two formats: ``make_weights`` of ``cfg`` with ``weight_format="v4"`` (FP8 projections, FP4 experts
    through ``cfg.moe_path``) and the same weights dequantised exactly to bf16 (``weight_format="bf16"``: bf16
    GEMMs, no activation quantiser; :func:`dsv4ref.weights.dequantize_weights`), so the difference is the formats
    of the computation, not of the weights. The bf16 run decodes ``steps`` greedy tokens after random prompts of
    ``prompt_lens``; the v4 run is fed the same tokens (each step compares logits of the same inputs; the first
    step where its argmax differs is where its own greedy tokens would part). With ``oracle``, each run is also
    held to the float64 reference of the same weights (same tokens, indexer and expert choices). Returns a
    :class:`FormatError`."""
    cb, cv = cfg.replace(weight_format="bf16"), cfg.replace(weight_format="v4")
    wb, wv = _weights(cfg, seed)
    g = generator(seed + 2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g, device=HOST) for n in prompt_lens]
    R = len(prompts)
    db, lb = _decode(cb, wb, prompts, steps, backend)
    forced = torch.stack([db.tokens[r, len(prompts[r]) : len(prompts[r]) + steps] for r in range(R)])
    dv, lv = _decode(cv, wv, prompts, steps, backend, forced=forced)
    out = FormatError(moe_path=cfg.moe_path)
    for r in range(R):
        diff = [s for s in range(steps + 1) if int(lv[s][r].argmax()) != int(lb[s][r].argmax())]
        out.parted.append(diff[0] if diff else None)
    refs = {}
    if oracle:  # the float64 reference of the weights both runs hold, on each run's own choices
        for name, c, w, d in (("bf16", cb, wb, db), ("v4", cv, wv, dv)):
            h = d.history()
            refs[name] = [reference_forward(c, w, h[0][r], h[1][r], experts=h.experts[r])["logits"] for r in range(R)]
    for s in range(steps + 1):
        e = [0.0, 0.0, 0.0]
        for r in range(R):
            p = len(prompts[r]) - 1 + s
            e[0] = max(e[0], float(rel_err(lv[s][r], lb[s][r])))
            if oracle:
                e[1] = max(e[1], float(rel_err(lb[s][r], refs["bf16"][r][p])))
                e[2] = max(e[2], float(rel_err(lv[s][r], refs["v4"][r][p])))
        top1 = int((lv[s].argmax(-1) == lb[s].argmax(-1)).sum())
        out.steps.append(FormatStep(s - 1, *e, top1, R))
    return out
