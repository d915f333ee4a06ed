"""Run the decoder, hold it to the float64 dense reference, and ``python -m dsv4ref demo``.

* :func:`run`: prefill random prompts, then greedy-decode (plainly, or with MTP speculation), recording
  every step's logits and every layer's attention output;
* :func:`agreement`: compare those records with :func:`dsv4ref.decode.reference_forward` of each
  request's history, under :data:`ATTN_TOL` and :data:`LOGITS_TOL`;
* :func:`demo`: both, printed.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

import torch

from .. import validate
from ..config import TINY, Config
from ..device import DEVICE, HOST, Timer, describe, interpreting, synchronize
from ..validate import checking_values
from ..testing import generator
from .model import Decoder
from .reference import reference_forward
from .weights import make_weights

__all__ = ["ATTN_TOL", "LOGITS_TOL", "AGREEMENT_TOL", "rel_err", "StepAgreement", "agreement", "run", "run_speculative",
           "SpecStats", "demo", "graph_speed", "DEMO_PROMPTS", "check_demo"]

#: the demo's prompt lengths (4 requests)
DEMO_PROMPTS = (133, 37, 5, 70)

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
    experts = getattr(history, "experts", None)  # the MoE's choices (Decoder.history().experts)
    refs = [reference_forward(cfg, weights, toks[r], topks[r], bugs=bugs, experts=None if experts is None else experts[r])
            for r in range(len(toks))]
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
        inactive: dict | None = None, progress=None, profile: bool = False, speculate: int = 0, graph: bool = False,
        mhc_launch=None):
    """Prefill random prompts, then greedy-decode ``steps`` tokens.

    ``inactive``: {step: [request ids]} that sit out that step as padding; ``progress(i, n)`` is called
    after each step; ``profile`` collects per-op milliseconds in the decoder's ``prof``.
    ``speculate = k > 0``: decode with MTP speculation instead (:func:`run_speculative`; ``inactive`` and
    ``profile`` are not supported there). ``graph``: ``Decoder(graph=True)``, the steps run with value checks
    off (``docs/decode.md#one-step-one-graph``). ``mhc_launch``: the mHC calls' :class:`~dsv4ref.mhc.MhcLaunch`
    (``Decoder(mhc_launch=...)``; None: the defaults).
    Returns (decoder, weights, records, tokens/s of the decode loop); records as :func:`agreement` takes
    them, the first one (step −1) the prefill's last prompt token."""
    if speculate:
        if inactive or profile:
            raise ValueError("run: speculate does not take inactive= or profile=")
        return run_speculative(cfg, steps=steps, k=speculate, prompt_lens=prompt_lens, seed=seed, capacity=capacity,
                               decode_backend=decode_backend, prefill_backend=prefill_backend, pad_heads=pad_heads,
                               progress=progress)
    R = len(prompt_lens)
    dec, w, rec, logits = _start(cfg, prompt_lens, seed, capacity, steps, decode_backend, prefill_backend, pad_heads,
                                 graph, mhc_launch)
    records = [rec]
    synchronize()
    t0 = time.perf_counter()
    if profile:
        dec.prof = {}
    checks = checking_values(False) if graph else contextlib.nullcontext()
    for s in range(steps):
        act = torch.ones(R, dtype=torch.bool, device=HOST)
        for r in (inactive or {}).get(s, []):
            act[r] = False
        ids = logits.argmax(-1).cpu()
        pos = dec.lengths.clone()
        with checks:
            logits = dec.step(ids, active=act)
        records.append((s, pos, logits.cpu(), [a.cpu() for a in dec.attn_out], act))
        if progress:
            progress(s + 1, steps)
    synchronize()
    tps = R * steps / (time.perf_counter() - t0)
    return dec, w, records, tps


def _start(cfg, prompt_lens, seed, capacity, steps, decode_backend, prefill_backend, pad_heads, graph=False,
           mhc_launch=None):
    """A Decoder with random prompts prefilled: (decoder, weights, first record, logits)."""
    R = len(prompt_lens)
    cap = capacity or (max(prompt_lens) + steps + 15) // 16 * 16
    w = make_weights(cfg, seed)
    dec = Decoder(cfg, w, num_requests=R, capacity=cap, seed=seed, pad_heads=pad_heads, backend=decode_backend,
                  graph=graph, mhc_launch=mhc_launch)
    g = generator(seed + 2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g, device=HOST) for n in prompt_lens]
    logits = dec.prefill(prompts, backend=prefill_backend)
    last = torch.tensor(prompt_lens, device=HOST).cumsum(0) - 1
    rec = (-1, torch.tensor(prompt_lens, device=HOST) - 1, logits.cpu(), [a[last.to(a.device)].cpu() for a in dec.attn_out],
           torch.ones(R, dtype=torch.bool, device=HOST))
    return dec, w, rec, logits


@dataclass
class SpecStats:
    """Counts of a speculative run: ``rounds`` (draft + verify per request), ``drafted`` and ``accepted``
    draft tokens, ``emitted`` tokens (accepted + one per round). ``rate`` = accepted / drafted."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / max(self.drafted, 1)


def run_speculative(cfg: Config = TINY, *, steps: int = 8, k: int = 2, prompt_lens=(133, 37, 5, 70), seed: int = 0,
                    capacity: int | None = None, decode_backend: str = "auto", prefill_backend: str = "reference",
                    pad_heads: bool = True, progress=None):
    """:func:`run` with MTP speculation: after the prefill, rounds of :meth:`Decoder.speculate` (k drafts,
    one verification step of k + 1 rows per request) until every request has ``steps`` new tokens past its
    prompt, the prefill's argmax included (a round may emit more; ``dec.tokens`` keeps them all). The draft layer's catch-up over the
    prompt runs with ``prefill_backend``.

    Returns (decoder, weights, records, tokens/s); ``dec.spec`` is the :class:`SpecStats` and
    ``dec.generated`` the list of emitted tokens per request (the first ``steps`` are what plain greedy
    decoding gives). Records: one per verified position j of each round (rows of requests that emitted
    fewer tokens that round are inactive), as :func:`agreement` takes them."""
    R = len(prompt_lens)
    dec, w, rec, logits = _start(cfg, prompt_lens, seed, (capacity or max(prompt_lens) + steps + k + 15) // 16 * 16,
                                 steps, decode_backend, prefill_backend, pad_heads)
    records, stats = [rec], SpecStats()
    gen = [[] for _ in range(R)]
    nxt = logits.argmax(-1).cpu()
    for r in range(R):
        gen[r].append(int(nxt[r]))
    synchronize()
    t0 = time.perf_counter()
    first = True
    while min(len(g) for g in gen) < steps:
        pos0 = dec.lengths.clone()
        sp = dec.speculate(nxt, k, draft_backend=prefill_backend if first else None)
        first = False
        stats.rounds += 1
        stats.drafted += R * k
        stats.accepted += int(sp.accepted.sum())
        stats.emitted += int(sp.accepted.sum()) + R
        for r in range(R):
            gen[r] += sp.emitted[r].tolist()
        for j in range(k + 1):  # row j of each request: position pos0 + j, kept where j <= accepted
            act = sp.accepted >= j
            rows = (torch.arange(R, device=HOST) * (k + 1) + j).to(dec.attn_out[0].device)
            records.append((len(records) - 1, pos0 + j, sp.logits[:, j].cpu(), [a[rows].cpu() for a in dec.attn_out], act))
        nxt = sp.next
        if progress:
            progress(min(min(len(g) for g in gen), steps), steps)
    synchronize()
    tps = stats.emitted / (time.perf_counter() - t0)
    dec.spec, dec.generated = stats, gen
    return dec, w, records, tps


def _capacity(prompt_lens, steps: int) -> int:
    """The capacity :func:`run` asks for: the longest prompt + ``steps`` (+ 15, rounded to a multiple of 16)."""
    return (max(prompt_lens) + steps + 15) // 16 * 16


def check_demo(steps, speculate=0, graph=False, *, cfg: Config = TINY, prompt_lens=DEMO_PROMPTS,
               names=("steps", "speculate", "graph")) -> None:
    """Every check of :func:`demo`'s arguments, before any work: ``steps`` an int ≥ 1 whose caches fit in
    ``cfg.max_position`` (the plain run needs the longest prompt + steps, speculation k more, the graph run one
    more), ``speculate`` an int in [0, 7], ``graph`` a bool. ``names``: what the errors call the three (the
    command line passes its flags, ``--steps`` ...). TypeError / ValueError naming the argument."""
    n_steps, n_spec, n_graph = names
    validate.integer(steps, n_steps, lo=1)
    validate.integer(speculate, n_spec, lo=0, hi=7)
    if not isinstance(graph, bool):
        raise TypeError(f"{n_graph}: expected a bool, got {type(graph).__name__}")
    extra = max(speculate, 1 if graph else 0)  # run_speculative: + k positions; graph_speed: one warm-up step
    most = (cfg.max_position // 16) * 16 - max(prompt_lens) - extra
    if _capacity(prompt_lens, steps + extra) > cfg.max_position:
        raise ValueError(f"{n_steps}: {steps} decode steps do not fit the caches of {cfg.name} (max_position "
                         f"{cfg.max_position}, prompts of up to {max(prompt_lens)} tokens"
                         f"{f', {n_spec} {speculate}' if speculate else ''}); expected at most {most}")


def demo(steps: int = 16, speculate: int = 0, graph: bool = False) -> int:
    """``python -m dsv4ref demo``: prefill 4 requests (prompts of 133, 37, 5 and 70 tokens), decode
    ``steps`` tokens each through the Triton kernels, print tokens/s and per-step agreement.
    ``speculate = k > 0``: then decode the same prompts again with MTP speculation (k drafts per round),
    print the acceptance rate and whether the tokens equal plain greedy decoding's. ``graph``: then decode the
    same prompts eagerly and as replayed device graphs (value checks off for both), print tokens/s of each and
    where the rest of a graphed step's time goes, and check the tokens are the same.
    Returns the exit code: 0 if every step agrees with the reference (and speculation or graphs changed no
    token), else 1. The arguments are checked first (:func:`check_demo`)."""
    cfg = TINY
    check_demo(steps, speculate, graph, cfg=cfg)
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
    if speculate:
        ok = _demo_speculation(cfg, dec, steps, speculate) and ok
    if graph:
        ok = _demo_graph(cfg, steps) and ok
    return 0 if ok else 1


def graph_speed(cfg: Config = TINY, steps: int = 16, prompt_lens=(133, 37, 5, 70), replays: int = 20) -> dict:
    """Warm greedy steps eagerly and with ``Decoder(graph=True)``, value checks off for both: after one untimed
    step (the kernels compiled; the graph captured), ``steps`` timed steps each, every step's argmax read back
    as the demo does. Then the graph's replay alone, ``replays`` times (replaying one step again rewrites the
    same bytes). Returns {"eager", "graph": tokens/s; "eager_ms", "graph_ms", "replay_ms": ms per step;
    "same": the two runs' tokens are equal; "captured": a device graph was captured (False on a CPU)}."""
    out, decs = {}, {}
    R = len(prompt_lens)
    with checking_values(False):
        for graph in (False, True):
            dec, _, _, logits = _start(cfg, prompt_lens, 0, None, steps + 1, "auto", "reference", True, graph)
            ids = dec.step(logits.argmax(-1).cpu()).argmax(-1).cpu()  # warm-up (and capture)
            synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                ids = dec.step(ids).argmax(-1).cpu()
            synchronize()
            dt = time.perf_counter() - t0
            key = "graph" if graph else "eager"
            out[key], out[key + "_ms"], decs[key] = R * steps / dt, dt / steps * 1e3, dec
        g = next(iter(decs["graph"].graphs.values()))
        synchronize()
        with Timer() as t:
            for _ in range(replays):
                g.replay()
    out["replay_ms"], out["captured"] = t.ms / replays, g.captured
    out["same"] = torch.equal(decs["eager"].tokens, decs["graph"].tokens)
    return out


def _demo_graph(cfg: Config, steps: int) -> bool:
    """The graph half of the demo (:func:`graph_speed`), printed. Returns whether the tokens were the same."""
    try:
        s = graph_speed(cfg, steps)
    except Exception as e:  # a host sync in the step makes the capture fail: say so, fail the demo
        print(f"graph=True failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return False
    how = "one device graph per step" if s["captured"] else "no device graphs here: the same static-buffer step, eagerly"
    print(f"value checks off, {steps} warm steps each: eager {s['eager']:.1f} tokens/s ({s['eager_ms']:.2f} ms/step); "
          f"graph=True {s['graph']:.1f} tokens/s ({s['graph_ms']:.2f} ms/step; {how})")
    print(f"  of a graphed step: replay {s['replay_ms']:.2f} ms (the device part: every layer and the lm head), "
          f"host {max(s['graph_ms'] - s['replay_ms'], 0):.2f} ms (ids to the host, rows, copies into the static "
          f"inputs, the argmax read back, the token history)")
    print("graph tokens == eager tokens" if s["same"] else "THE GRAPH CHANGED THE TOKENS")
    return s["same"]


def _demo_speculation(cfg: Config, plain, steps: int, k: int) -> bool:
    """The speculative half of the demo: same prompts, k drafts per round; prints the acceptance rate and
    compares the tokens with the plain run ``plain`` (a Decoder after :func:`run`)."""
    t0 = time.perf_counter()
    dec, _, _, tps = run_speculative(cfg, steps=steps, k=k)
    same = True
    for r in range(dec.R):
        n0 = int(plain.lengths[r]) - steps  # the prompt length: plain decoding fed its steps tokens from there
        want = plain.tokens[r, n0: n0 + steps].tolist()
        got = dec.generated[r][:steps]
        same = same and got == want
    s = dec.spec
    print(f"MTP speculation, k = {k}: {s.rounds} rounds, {s.accepted}/{s.drafted} drafts accepted "
          f"(acceptance rate {s.rate:.1%}), {s.emitted / max(s.rounds * dec.R, 1):.2f} tokens per request per target "
          f"step; {tps:.3g} tokens/s ({time.perf_counter() - t0:.1f} s)")
    print("speculative tokens == plain greedy tokens" if same else "SPECULATION CHANGED THE TOKENS")
    return same
