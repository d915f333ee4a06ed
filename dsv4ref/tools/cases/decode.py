"""``python -m dsv4ref check decode``: a whole decode step through the Triton kernels vs the float64 reference;
``python -m dsv4ref bench decode.step``: one warm step, eager and replayed as one device graph."""

from __future__ import annotations

import torch

from ...config import TINY
from ...decode import ATTN_TOL, LOGITS_TOL, Decoder, agreement, make_weights, run, traffic_per_op
from ...device import DEVICE, capturing
from ...testing import generator
from ...tolerances import Report
from ...validate import checking_values
from ..harness import BenchCase, CheckRow, bench, check


@check("decode.step")
def check_decode_step() -> list[CheckRow]:
    """Prefill 2 requests (torch ops), 2 decode steps through the Triton kernels, against the float64
    reference. The tolerance is dsv4ref.decode.ATTN_TOL, the row 'decode_step' of dsv4ref.tolerances.TOLERANCES."""
    dec, w, recs, _ = run(TINY, steps=2, prompt_lens=(40, 9), decode_backend="triton")
    out = []
    for a in agreement(TINY, w, recs, dec.history())[1:]:
        rep = Report(
            f"step {a.step}",
            max(a.attn_err, a.logits_err),
            a.attn_err,
            "decode_step",
            a.passed,
            f"logits {a.logits_err:.3g} (<= {LOGITS_TOL:g}), attention {a.attn_err:.3g} (<= {ATTN_TOL:g})",
        )
        out.append(CheckRow("decode.step", f"tiny, T=2, step {a.step}", rep))
    return out


#: the batches timed: the teaching demo's 4 requests, and 32 requests (prompt lengths cycling through these)
BENCH_PROMPTS = {4: (133, 37, 5, 70), 32: (133, 37, 5, 70, 96, 12, 80, 67) * 4}


def _eager_only(fn):
    """A case that times host work too: it refuses the harness's graph capture (the harness then times it
    eagerly with device events, host gaps included)."""

    def run_eagerly(i):
        if capturing():
            raise RuntimeError("decode.step: timed eagerly (its host part cannot be captured)")
        return fn()

    return run_eagerly


@bench("decode.step")
def _bench() -> list[BenchCase]:
    """Per batch size T: the public step eagerly (value checks off), the public step with graph=True (host
    bookkeeping + one replay), and the replay alone (the device part). tokens/s = T / time. The step is
    launch-bound at the teaching size: the bytes (weights once + traffic_per_op at the mean context, per
    token) make the roofline fraction tiny on purpose."""
    w = make_weights(TINY, 0, DEVICE)
    weight_bytes = sum(t.numel() * t.element_size() for t in _tensors(w))
    cases = []
    for T, prompts in BENCH_PROMPTS.items():
        ctx = sum(prompts) // len(prompts)
        nbytes = weight_bytes + T * sum(traffic_per_op(TINY, ctx).values())
        note = f"tokens/s = {T} / time; weights + caches at context {ctx}"
        for graph in (False, True):
            try:
                dec, ids = _warm_decoder(w, prompts, graph)
            except Exception as e:  # a capture that fails (a host sync in the step) is reported, not fatal
                print(f"decode.step T={T} graph={graph}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                continue

            def step(dec=dec, ids=ids):
                with checking_values(False):
                    ids.copy_(dec.step(ids).argmax(-1).cpu())  # greedy, as the demo: the argmax comes back

            mode = "graph=True (host + replay)" if graph else "eager, checks off"
            cases.append(BenchCase("decode.step", f"tiny T={T} {mode}", _eager_only(step), 1, nbytes, 0, note))
            if graph:
                g = next(iter(dec.graphs.values()))
                cases.append(
                    BenchCase(
                        "decode.step",
                        f"tiny T={T} replay alone",
                        _eager_only(g.replay),
                        1,
                        nbytes,
                        0,
                        "the device part; the rest of a graphed step is host work",
                    )
                )
    return cases


def _warm_decoder(w, prompts, graph: bool):
    """A Decoder with ``prompts`` (random tokens) prefilled through the torch ops and two warm steps (the Triton
    kernels compiled; with ``graph`` the step captured). Capacity for ~160 more steps. Returns (dec, ids)."""
    g = generator(11)
    dec = Decoder(TINY, w, num_requests=len(prompts), capacity=max(prompts) + 192, backend="triton", graph=graph)
    logits = dec.prefill([torch.randint(0, TINY.vocab_size, (n,), generator=g) for n in prompts])
    ids = logits.argmax(-1).cpu()
    with checking_values(False):
        for _ in range(2):
            ids = dec.step(ids).argmax(-1).cpu()
    return dec, ids


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
