"""Drive a :class:`~dsv4ref.decode.Decoder` over random prompts and record what :func:`~dsv4ref.decode.agreement`
compares: :func:`run` (prefill, then greedy decoding; or MTP speculation, :func:`run_speculative`), and
:func:`graph_speed` (eager steps against replayed device graphs). ``python -m dsv4ref demo``
(:mod:`.demo`), the tests, the notebooks and the benchmark cases all run the decoder through these.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from ..config import TINY, Config
from ..device import HOST, Timer, synchronize
from ..seeded import generator
from ..validate import checking_values
from ..weights import make_weights
from .model import Decoder

__all__ = ["run", "run_speculative", "SpecStats", "graph_speed"]


def run(
    cfg: Config = TINY,
    *,
    steps: int = 8,
    prompt_lens=(133, 37, 5, 70),
    seed: int = 0,
    capacity: int | None = None,
    decode_backend: str = "auto",
    prefill_backend: str = "reference",
    pad_heads: bool = True,
    inactive: dict | None = None,
    progress=None,
    profile: bool = False,
    speculate: int = 0,
    graph: bool = False,
    mhc_launch=None,
):
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
        return run_speculative(
            cfg,
            steps=steps,
            k=speculate,
            prompt_lens=prompt_lens,
            seed=seed,
            capacity=capacity,
            decode_backend=decode_backend,
            prefill_backend=prefill_backend,
            pad_heads=pad_heads,
            progress=progress,
        )
    R = len(prompt_lens)
    dec, w, rec, logits = _start(
        cfg, prompt_lens, seed, capacity, steps, decode_backend, prefill_backend, pad_heads, graph, mhc_launch
    )
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


def _start(cfg, prompt_lens, seed, capacity, steps, decode_backend, prefill_backend, pad_heads, graph=False, mhc_launch=None):
    """A Decoder with random prompts prefilled: (decoder, weights, first record, logits)."""
    R = len(prompt_lens)
    cap = capacity or (max(prompt_lens) + steps + 15) // 16 * 16
    w = make_weights(cfg, seed)
    dec = Decoder(
        cfg,
        w,
        num_requests=R,
        capacity=cap,
        seed=seed,
        pad_heads=pad_heads,
        backend=decode_backend,
        graph=graph,
        mhc_launch=mhc_launch,
    )
    g = generator(seed + 2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g, device=HOST) for n in prompt_lens]
    logits = dec.prefill(prompts, backend=prefill_backend)
    last = torch.tensor(prompt_lens, device=HOST).cumsum(0) - 1
    rec = (
        -1,
        torch.tensor(prompt_lens, device=HOST) - 1,
        logits.cpu(),
        [a[last.to(a.device)].cpu() for a in dec.attn_out],
        torch.ones(R, dtype=torch.bool, device=HOST),
    )
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


def run_speculative(
    cfg: Config = TINY,
    *,
    steps: int = 8,
    k: int = 2,
    prompt_lens=(133, 37, 5, 70),
    seed: int = 0,
    capacity: int | None = None,
    decode_backend: str = "auto",
    prefill_backend: str = "reference",
    pad_heads: bool = True,
    progress=None,
):
    """:func:`run` with MTP speculation: after the prefill, rounds of :meth:`Decoder.speculate` (k drafts,
    one verification step of k + 1 rows per request) until every request has ``steps`` new tokens past its
    prompt, the prefill's argmax included (a round may emit more; ``dec.tokens`` keeps them all). The draft layer's catch-up over the
    prompt runs with ``prefill_backend``.

    Returns (decoder, weights, records, tokens/s); ``dec.spec`` is the :class:`SpecStats` and
    ``dec.generated`` the list of emitted tokens per request (the first ``steps`` are what plain greedy
    decoding gives). Records: one per verified position j of each round (rows of requests that emitted
    fewer tokens that round are inactive), as :func:`agreement` takes them."""
    R = len(prompt_lens)
    dec, w, rec, logits = _start(
        cfg,
        prompt_lens,
        seed,
        (capacity or max(prompt_lens) + steps + k + 15) // 16 * 16,
        steps,
        decode_backend,
        prefill_backend,
        pad_heads,
    )
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
