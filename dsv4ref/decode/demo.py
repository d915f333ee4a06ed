"""``python -m dsv4ref demo``: prefill four random prompts, greedy-decode them through the kernels (:func:`run`),
print tokens/s and each step's agreement with the float64 dense reference (:func:`agreement`); optionally
the same with MTP speculation and as replayed device graphs. The library pieces it prints live in
:mod:`.driver` and :mod:`.compare`; this module is the command's printing and argument checks only.
"""

from __future__ import annotations

import sys
import time

from .. import validate
from ..config import TINY, Config
from ..device import DEVICE, describe, interpreting
from .compare import agreement, tolerances
from .driver import graph_speed, run, run_speculative

__all__ = ["demo", "check_demo", "default_steps", "DEMO_PROMPTS", "DEMO_STEPS", "INTERPRETER_DEMO_STEPS"]

#: the demo's prompt lengths (4 requests)
DEMO_PROMPTS = (133, 37, 5, 70)
#: decode steps by default with compiled kernels, and in Triton's CPU interpreter, which pays for every program of
#: every launch: there the decode steps are nearly all of the demo's time (the prefill runs the torch ops), so it
#: takes half as many. Every step is still checked against the float64 reference; ``--steps`` asks for more
DEMO_STEPS = 16
INTERPRETER_DEMO_STEPS = 8


def default_steps() -> int:
    """The demo's decode steps when none are asked for: :data:`DEMO_STEPS` with compiled kernels,
    :data:`INTERPRETER_DEMO_STEPS` in Triton's CPU interpreter."""
    return INTERPRETER_DEMO_STEPS if interpreting() else DEMO_STEPS


def _capacity(prompt_lens, steps: int) -> int:
    """The capacity :func:`run` asks for: the longest prompt + ``steps`` (+ 15, rounded to a multiple of 16)."""
    return (max(prompt_lens) + steps + 15) // 16 * 16


def check_demo(
    steps, speculate=0, graph=False, *, cfg: Config = TINY, prompt_lens=DEMO_PROMPTS, names=("steps", "speculate", "graph")
) -> None:
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
        raise ValueError(
            f"{n_steps}: {steps} decode steps do not fit the caches of {cfg.name} (max_position "
            f"{cfg.max_position}, prompts of up to {max(prompt_lens)} tokens"
            f"{f', {n_spec} {speculate}' if speculate else ''}); expected at most {most}"
        )


def demo(
    steps: int | None = None,
    speculate: int = 0,
    graph: bool = False,
    weight_format: str = "bf16",
    moe_path: str = "deepseek",
) -> int:
    """``python -m dsv4ref demo``: prefill 4 requests (prompts of 133, 37, 5 and 70 tokens), decode
    ``steps`` tokens each through the Triton kernels (None: :func:`default_steps`, 16 compiled, 8 in the CPU
    interpreter), print tokens/s and per-step agreement with the float64 reference (every step).
    ``speculate = k > 0``: then decode the same prompts again with MTP speculation (k drafts per round),
    print the acceptance rate and whether the tokens equal plain greedy decoding's. ``graph``: then decode the
    same prompts eagerly and as replayed device graphs (value checks off for both), print tokens/s of each and
    where the rest of a graphed step's time goes, and check the tokens are the same.
    Returns the exit code: 0 if every step agrees with the reference (and speculation or graphs changed no
    token), else 1. The arguments are checked first (:func:`check_demo`). ``weight_format``, ``moe_path``: the
    teaching config's ``Config`` fields (``"v4"``: V4's FP8 projections and FP4 experts; its tolerances,
    :func:`dsv4ref.decode.tolerances`)."""
    cfg = TINY.replace(weight_format=weight_format, moe_path=moe_path)  # ValueError naming a bad one
    steps = default_steps() if steps is None else steps
    check_demo(steps, speculate, graph, cfg=cfg)
    print(
        f"dsv4ref demo: {cfg.name}, {cfg.num_layers} layers, ratios {cfg.compress_ratios}, weights {cfg.weight_format}"
        f"{f' (experts: {cfg.moe_path})' if cfg.weight_format == 'v4' else ''}; {describe()}"
    )

    def bar(i, n):
        k = 30 * i // n
        sys.stdout.write(f"\rdecode [{'#' * k}{'.' * (30 - k)}] {i}/{n}")
        sys.stdout.flush()

    t0 = time.perf_counter()
    if not interpreting():  # compile every kernel first, so the timed loop measures decoding, not the JIT
        run(cfg, steps=1)
    dec, w, recs, tps = run(cfg, steps=steps, progress=bar)
    print(
        f"\ndecoded {steps} steps x {dec.R} requests: {tps:.1f} tokens/s "
        f"({'interpreted Triton' if interpreting() else 'compiled Triton'} kernels; prefill + decode "
        f"{time.perf_counter() - t0:.1f} s)"
    )
    if not interpreting() and DEVICE.type != "cpu":
        dec2, _, _, _ = run(cfg, steps=steps, profile=True)
        tot = sum(dec2.prof.values())
        print("per-op time share (decode steps, each op synchronised):")
        for k, v in sorted(dec2.prof.items(), key=lambda kv: -kv[1]):
            print(f"  {k:<22} {v / tot:6.1%}  ({v / steps * 1e3:8.1f} us/step)")
    rows = agreement(cfg, w, recs, dec.history())
    attn_tol, logits_tol = tolerances(cfg)
    print(
        f"agreement with the float64 dense reference (row relative L2 error; tolerances: attention "
        f"{attn_tol:g}, logits {logits_tol:g}; see dsv4ref.decode.tolerances):"
    )
    print(f"{'step':>6} {'logits':>9} {'attn (max over layers)':>24} {'top-1':>7}  verdict")
    for a in rows:
        print(
            f"{'prefill' if a.step < 0 else a.step:>6} {a.logits_err:>9.2e} {a.attn_err:>24.2e} "
            f"{a.top1_agree:>4}/{a.n}  {'PASS' if a.passed else 'FAIL'}"
        )
    ok = all(a.passed for a in rows)
    print("all steps agree" if ok else "DISAGREEMENT")
    if speculate:
        ok = _demo_speculation(cfg, dec, steps, speculate) and ok
    if graph:
        ok = _demo_graph(cfg, steps) and ok
    return 0 if ok else 1


def _demo_graph(cfg: Config, steps: int) -> bool:
    """The graph half of the demo (:func:`graph_speed`), printed. Returns whether the tokens were the same."""
    try:
        s = graph_speed(cfg, steps)
    except Exception as e:  # a host sync in the step makes the capture fail: say so, fail the demo
        print(f"graph=True failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return False
    how = "one device graph per step" if s["captured"] else "no device graphs here: the same static-buffer step, eagerly"
    print(
        f"value checks off, {steps} warm steps each: eager {s['eager']:.1f} tokens/s ({s['eager_ms']:.2f} ms/step); "
        f"graph=True {s['graph']:.1f} tokens/s ({s['graph_ms']:.2f} ms/step; {how})"
    )
    print(
        f"  of a graphed step: replay {s['replay_ms']:.2f} ms (the device part: every layer and the lm head), "
        f"host {max(s['graph_ms'] - s['replay_ms'], 0):.2f} ms (ids to the host, rows, copies into the static "
        f"inputs, the argmax read back, the token history)"
    )
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
        want = plain.tokens[r, n0 : n0 + steps].tolist()
        got = dec.generated[r][:steps]
        same = same and got == want
    s = dec.spec
    print(
        f"MTP speculation, k = {k}: {s.rounds} rounds, {s.accepted}/{s.drafted} drafts accepted "
        f"(acceptance rate {s.rate:.1%}), {s.emitted / max(s.rounds * dec.R, 1):.2f} tokens per request per target "
        f"step; {tps:.3g} tokens/s ({time.perf_counter() - t0:.1f} s)"
    )
    print("speculative tokens == plain greedy tokens" if same else "SPECULATION CHANGED THE TOKENS")
    return same
