"""One-call GPU sweep of the mHC designs the library keeps (``dsv4ref.tools.cases.mhc.designs``: one kernel,
split-K, one pass, the chunked rungs and the default) and of ``CANDIDATES`` below (``ChunkedLaunch`` fields on top
of the GPU default: tile, chunk and slice choices), with the current default beside them and the decode step run with
the proposal.

    PYTHONPATH=. python3 benchmarks/experiments/mhc/sweep.py              # everything
    PYTHONPATH=. python3 benchmarks/experiments/mhc/sweep.py pre head     # only these ops (and no decode step)
    PYTHONPATH=. python3 benchmarks/experiments/mhc/sweep.py chunked      # only names containing "chunked"
    MHC_SWEEP_SMOKE=1 python3 benchmarks/experiments/mhc/sweep.py C2048 pre   # the flow in the interpreter, on a CPU

Arguments: op names (pre, fused, head) restrict the ops; any other argument restricts the candidates to the
names containing it (the default always runs); a candidate whose fields leave an op's kernels as an earlier
candidate's shares that row (``= ...``). Phases, one process and one GPU:

1. the copy ceiling (512 MiB, as ``python -m dsv4ref bench``);
2. compiling, in parallel: worker processes run each distinct (op, candidate) once on random inputs at the
   sizes the sweep uses, so Triton's on-disk cache serves the main process; one more worker runs decode steps
   of the teaching config. Nothing is timed before they end;
3. checks, before any timing: each candidate against the float64 oracle with the tests' tolerances
   (tests/test_mhc.py) at T = 4096 and at T = 37 (the decode-like plan), Hd = 4096; fused also == post then
   pre (the new streams and the layer input bit for bit, post / comb within 1e-6) with the pre of the same
   arithmetic (``pre_like_fused``). A candidate that fails or does not compile is reported and not
   timed;
4. timing by graph replay (``dsv4ref.tools.harness.time_ms``), two input sets of ~340 MB rotated past the
   L2: µs and % of the copy ceiling over the compulsory bytes ``python -m dsv4ref bench mhc`` counts
   (``dsv4ref.tools.cases.mhc.compulsory_bytes``); the default first; no new candidate starts after
   ``BUDGET_S`` seconds;
5. the proposal: the ONE candidate with the least total time over the ops;
6. the summary, T = 37 rows, per-kernel device times, and the decode step (teaching config) with
   ``Decoder(mhc_launch=proposal)`` against the float64 reference.

A candidate that needs a kernel the library does not have (a new constexpr switch) is written as an experiment
kernel beside this script, built on ``dsv4ref.tl`` and ``dsv4ref.mhc.kernels``' pieces; the ones already tried
are in ``benchmarks/mhc.md``'s table of experiments, with the commit that holds their code.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing as mp
import os
import sys
import time

# MHC_SWEEP_SMOKE=1: a CPU run of the whole flow in the Triton interpreter at toy sizes (no ceiling measured,
# no decode step), to check the script itself; the figures it prints mean nothing
SMOKE = os.environ.get("MHC_SWEEP_SMOKE") == "1"
T_BIG, T_SMALL, HD = (40, 5, 256) if SMOKE else (4096, 37, 4096)
BUDGET_S = 600.0 if SMOKE else 100.0  # no new candidate is timed after this many seconds (the call's limit: 150 s)
OPS = ("pre", "fused", "head")
_OP_NAMES = {"pre": "pre", "fused": "fused_post_pre", "head": "head"}  # the library's names (default_launch)


# ====================================================================================================
# compile workers (run in spawned processes: they import torch / dsv4ref themselves)
# ====================================================================================================

_INPUTS: dict = {}


def _inputs(T: int, k: int = 0):
    """Random inputs of one size, made once per process (``k``: which of several independent sets): (res, x, p,
    c, fs, scale, base, hfs, hscale, hbase)."""
    if (T, k) not in _INPUTS:
        import torch

        from dsv4ref import DEVICE
        from dsv4ref.mhc import example_params, split_fn

        fn, scale, base = example_params(HD)
        hfn, hscale, hbase = example_params(HD, head=True)
        res = torch.randn(T, 4, HD, device=DEVICE, dtype=torch.bfloat16)
        x = torch.randn(T, HD, device=DEVICE, dtype=torch.bfloat16)
        p, c = torch.rand(T, 4, device=DEVICE) * 2, torch.rand(T, 4, 4, device=DEVICE) * 0.5
        _INPUTS[T, k] = (res, x, p, c, split_fn(fn), scale, base, split_fn(hfn, head=True), hscale, hbase)
    return _INPUTS[T, k]


def run_op(op: str, launch, T: int, inputs=None, outs=None):
    """One call of ``op`` ("pre", "fused", "head", "post") through its custom op (no argument checks, as the
    bench), into ``outs`` (made if None). Returns the outputs."""
    import torch

    from dsv4ref.mhc.reference import HC_EPS, POST_MULT, RMS_EPS, SINKHORN_ITERS

    res, x, p, c, fs, scale, base, hfs, hscale, hbase = inputs if inputs is not None else _inputs(T)
    (enc,) = launch.op_args("mhc_pre")  # pre, fused and head: launch: int[]
    if outs is None:
        outs = (torch.empty_like(res), torch.empty_like(p), torch.empty_like(c), torch.empty_like(x))
    new, p2, c2, out = outs
    if op == "pre":
        torch.ops.dsv4ref.mhc_pre(res, fs, scale, base, p2, c2, out, RMS_EPS, HC_EPS, POST_MULT, SINKHORN_ITERS, enc)
    elif op == "fused":
        torch.ops.dsv4ref.mhc_fused_post_pre(
            x, res, p, c, fs, scale, base, new, p2, c2, out, RMS_EPS, HC_EPS, POST_MULT, SINKHORN_ITERS, enc
        )
    elif op == "head":
        torch.ops.dsv4ref.mhc_head(res, hfs, hscale, hbase, out, RMS_EPS, HC_EPS, enc)
    else:
        torch.ops.dsv4ref.mhc_post(x, res, p, c, new, *launch.op_args("mhc_post"))
    return outs


# ChunkedLaunch field candidates on top of its defaults (the GPU default): name -> fields. Each was timed once
# (benchmarks/mhc.md); kept here to re-time on another GPU or after a kernel change.
CANDIDATES: dict[str, dict] = {
    "chunked C2048": {"tokens": 2048},  # two chunks of 64 MB
    "chunked C1024": {"tokens": 1024},  # 32 MB per chunk: fits the 50 MB L2
    "chunked st3": {"stages": 3},  # one stage less
    "chunked slice256": {"slice_h": 256, "target_programs": 256},
    "chunked finish1024": {"finish_h": 1024},  # half the finish's redundant sums
    "chunked bt64 w4": {"block_t": 64, "warps": 4, "maxnreg": None},
}


def _launches() -> dict:
    """name -> launch: the library's designs (``designs()``; "defaults" = pre's default, on a GPU every op's:
    ``ChunkedLaunch()``) and ``CANDIDATES``."""
    from dsv4ref.mhc import ChunkedLaunch
    from dsv4ref.tools.cases.mhc import designs

    out = {("defaults" if n == "default" else n): L for n, L in designs()}
    out.update({n: ChunkedLaunch(**f) for n, f in CANDIDATES.items()})
    return out


def candidate(name: str):
    """The launch of candidate ``name`` ("defaults": the default)."""
    return _launches()[name]


def candidate_fields(name: str) -> dict:
    """The fields candidate ``name`` sets that differ from its launch class's defaults."""
    import dataclasses

    L = candidate(name)
    d = type(L)()
    return {f.name: getattr(L, f.name) for f in dataclasses.fields(L) if getattr(L, f.name) != getattr(d, f.name)}


def _compile_task(op: str, name: str) -> str | None:
    """Compile (by running once) what the main process will run for (op, candidate ``name``; "defaults" =
    the default): both sizes, and for fused the pre of the same arithmetic. None, or the error."""
    try:
        from dsv4ref.device import synchronize
        from dsv4ref.mhc import default_launch

        L = candidate(name)
        for T in (T_BIG, T_SMALL):
            run_op(op, L, T)
            if op == "fused":
                run_op("pre", L.pre_like_fused(), T)
                run_op("post", default_launch("post"), T)
        synchronize()
        return None
    except Exception as e:  # reported by the main process
        return f"{type(e).__name__}: {str(e)[:300]}"


def _decode_task(name: str) -> str | None:
    """One eager and one graphed decode step of the teaching config with candidate ``name`` (compiles the step)."""
    try:
        from dsv4ref.config import TINY
        from dsv4ref.decode import run

        L = candidate(name)
        run(TINY, steps=1, prompt_lens=(133, 37, 5, 70), mhc_launch=L)
        run(TINY, steps=1, prompt_lens=(133, 37, 5, 70), mhc_launch=L, graph=True)
        run(TINY, steps=1, prompt_lens=(133, 37, 5, 70))
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:300]}"


# ====================================================================================================
# main
# ====================================================================================================


def main() -> None:
    t0 = time.perf_counter()
    ops = tuple(a for a in sys.argv[1:] if a in OPS) or OPS
    only = [a for a in sys.argv[1:] if a not in OPS]  # candidate-name filters
    with_decode = not sys.argv[1:] and not SMOKE

    import torch

    from dsv4ref import DEVICE
    from dsv4ref.device import capture_graph, synchronize
    from dsv4ref.mhc import ChunkedLaunch, OnePassLaunch, default_launch, example_params, example_streams, reference, split_fn
    from dsv4ref.mhc.ops import chunk_args, one_pass_args
    from dsv4ref.testing import compare, randn
    from dsv4ref.tools.cases.mhc import compulsory_bytes
    from dsv4ref.tools.harness import measure_ceilings, time_ms

    def el() -> str:
        return f"[{time.perf_counter() - t0:5.1f} s]"

    # ---- 1. ceiling (on a quiet GPU) --------------------------------------------------------------------
    copy = 4.0e12 if SMOKE else measure_ceilings().copy_bytes_per_s
    print(f"{el()} copy ceiling (512 MiB) {copy / 1e12:.2f} TB/s; {DEVICE}", flush=True)

    # ---- 2. compile in parallel ----------------------------------------------------------------------
    every = _launches()
    launches = {n: L for n, L in every.items() if n == "defaults" or not only or any(w in n for w in only)}

    def kernel_key(op: str, name: str) -> tuple:
        """Equal keys: the same kernels at both sizes (a field an op does not use changes nothing for it)."""
        if name == "defaults":
            return op, name
        L, head, fused = launches[name], op == "head", op == "fused"
        if isinstance(L, ChunkedLaunch):
            return (
                op,
                "chunked",
                fused,
                tuple(
                    (plan, *(tuple(sorted(d.items())) for d in (*p, *f)))
                    for plan, p, f, _s in (chunk_args(L, T, HD, head, fused) for T in (T_BIG, T_SMALL))
                ),
            )
        if isinstance(L, OnePassLaunch):
            return op, tuple(
                (tuple(sorted(c.items())), tuple(sorted(o.items())), plan)
                for _g, c, o, _s, plan in (one_pass_args(L, T, HD, head, fused) for T in (T_BIG, T_SMALL))
            )
        return op, name  # one kernel, split-K: its own row

    jobs, same_as, first = [], {}, {}  # same_as: (op, name) -> the earlier candidate with the same kernel
    for op in ops:
        for name in launches:
            key = kernel_key(op, name)
            if key in first:
                same_as[op, name] = first[key]
            else:
                first[key] = name
                jobs.append((op, name))
    workers = max(2, min(14, (os.cpu_count() or 4) - 2))
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    decode_future = pool.submit(_decode_task, "defaults") if with_decode else None
    futures = {job: pool.submit(_compile_task, *job) for job in jobs}
    print(
        f"{el()} compiling {len(jobs)} distinct (op, candidate) kernels in {workers} processes "
        f"({len(same_as)} more pairs run one of them)",
        flush=True,
    )

    # ---- 3. checks (oracles once per op and size) --------------------------------------------------------
    M = 4
    fn, scale, base = example_params(HD, seed=2)
    hfn, hscale, hbase = example_params(HD, seed=3, head=True)
    fs, hfs = split_fn(fn), split_fn(hfn, head=True)
    cases = {}
    for T in (T_BIG, T_SMALL):
        res = example_streams(T, HD, seed=T)
        x = randn((T, HD), seed=T + 1, octaves=8)
        p_in, c_in, _ = reference.pre(res, fn, scale, base)  # realistic post / comb for the fused op (fp32)
        p_in, c_in = p_in.float().contiguous(), c_in.float().contiguous()
        inputs = (res, x, p_in, c_in, fs, scale, base, hfs, hscale, hbase)
        new_sep = run_op("post", default_launch("post"), T, inputs)[0].clone()  # the post kernel: fused must equal it
        o_pre = reference.pre(res, fn, scale, base, dtype=torch.float64)
        o_fused = reference.pre(new_sep, fn, scale, base, dtype=torch.float64)
        o_head = reference.head(res, hfn, hscale, hbase, dtype=torch.float64)
        cases[T] = (inputs, new_sep, o_pre, o_fused, o_head)
    synchronize()
    print(f"{el()} float64 oracles ready", flush=True)

    def check(op: str, L) -> str | None:
        """None if ``op`` under ``L`` passes every check at both sizes, else what failed."""
        for T, (inputs, new_sep, o_pre, o_fused, o_head) in cases.items():
            new, p2, c2, out = (t.clone() for t in run_op(op, L, T, inputs))
            if op == "pre":
                reps = [
                    compare(p2, o_pre[0], "mhc", "post"),
                    compare(c2, o_pre[1], "mhc", "comb"),
                    compare(out, o_pre[2], "bf16_out", "layer_input"),
                ]
            elif op == "head":
                reps = [compare(out, o_head, "bf16_out", "head")]
            else:
                sep = run_op("pre", L.pre_like_fused(), T, (new_sep,) + inputs[1:])
                same_new = torch.equal(new.view(torch.int16), new_sep.view(torch.int16))
                same_li = torch.equal(out.view(torch.int16), sep[3].view(torch.int16))
                if not (same_new and same_li):
                    return f"T={T}: fused != post then pre bit for bit (new streams {same_new}, layer input {same_li})"
                reps = [
                    compare(p2, sep[1], "fp32_reduction", "post == post then pre"),
                    compare(c2, sep[2], "fp32_reduction", "comb == post then pre"),
                    compare(p2, o_fused[0], "mhc", "post"),
                    compare(c2, o_fused[1], "mhc", "comb"),
                    compare(out, o_fused[2], "bf16_out", "layer_input"),
                ]
            bad = [str(r) for r in reps if not r.passed]
            if bad:
                return f"T={T}: " + "; ".join(bad)
        return None

    passed = []
    for (op, name), fut in futures.items():
        try:
            err = fut.result()
        except Exception as e:  # the worker itself died (not the kernel): compile here instead, in check()
            print(f"{el()} compile worker for {op} {name} failed ({type(e).__name__}: {e}); compiling here", flush=True)
            err = None
        if err is None:
            try:
                err = check(op, launches[name])
            except Exception as e:
                err = f"{type(e).__name__}: {str(e)[:300]}"
        design = launches[name].design
        if err is None:
            passed.append((op, name))
        else:
            print(f"{el()} {op:5s} {name:22s} ({design}) FAILED, not timed: {err}", flush=True)
    print(f"{el()} {len(passed)} of {len(jobs)} passed every check", flush=True)
    decode_err = None
    if decode_future is not None:  # it runs decode steps on the GPU: wait for it, so that it disturbs no timing
        try:
            decode_err = decode_future.result(timeout=max(1.0, BUDGET_S - 35 - (time.perf_counter() - t0)))
        except cf.TimeoutError:
            decode_err = "still compiling when the timing had to start (the timings below may be disturbed)"
            print(f"{el()} decode worker: {decode_err}", flush=True)
        except Exception as e:  # the worker died: the decode check below compiles in this process
            print(f"{el()} decode worker failed ({type(e).__name__}: {e})", flush=True)
    pool.shutdown(wait=False, cancel_futures=True)

    # ---- 4. timing ------------------------------------------------------------------------------------
    nb = compulsory_bytes(T_BIG, HD, M)
    sets = [_inputs(T_BIG, 0), _inputs(T_BIG, 1)]  # ~340 MB each with their outputs: together far past the L2
    outs = [run_op("pre", default_launch("pre"), T_BIG, s) for s in sets]
    results: dict[tuple[str, str], float] = {}
    tkw = dict(warmup=1, reps=2) if SMOKE else {}
    print(f"\n{'op':5s} {'candidate':22s} {'design':10s} {'µs':>8s} {'TB/s':>6s} {'of copy':>8s}   launch", flush=True)
    for op, name in passed:
        if time.perf_counter() - t0 > BUDGET_S:
            print(f"{el()} time budget: {op} {name} and later candidates not timed", flush=True)
            break
        L = launches[name]
        graphed = SMOKE or capture_graph(lambda L=L, op=op: run_op(op, L, T_BIG, sets[0], outs[0])) is not None
        ms = time_ms(lambda i, L=L, op=op: run_op(op, L, T_BIG, sets[i], outs[i]), n_sets=2, **tkw)
        # what the graph replays left in outs[1] must equal an eager call bit for bit (PDL edges in a graph)
        eager = run_op(op, L, T_BIG, sets[1], tuple(torch.empty_like(t) for t in outs[1]))
        keep = {"pre": (1, 2, 3), "fused": (0, 1, 2, 3), "head": (3,)}[op]
        same = all(
            torch.equal(
                outs[1][k].view(torch.int32 if outs[1][k].dtype == torch.float32 else torch.int16),
                eager[k].view(torch.int32 if eager[k].dtype == torch.float32 else torch.int16),
            )
            for k in keep
        )
        note = ("" if graphed else " [graph capture failed: timed EAGERLY]") + ("" if same else " [REPLAY != EAGER]")
        if not same:
            print(f"{el()} {op} {name}: the graph-replayed outputs differ from an eager call's: not a candidate", flush=True)
        else:
            results[(op, name)] = ms
        b = nb[op]
        fields = "" if name == "defaults" else ", ".join(f"{k}={v}" for k, v in candidate_fields(name).items())
        twins = [n for (o, n), c in same_as.items() if o == op and c == name]
        print(
            f"{op:5s} {name:22s} {L.design:10s} {ms * 1e3:8.1f} {b / (ms * 1e-3) / 1e12:6.2f} "
            f"{100 * b / (ms * 1e-3) / copy:7.1f} %{note}   {fields}" + (f"  (= {', '.join(twins)})" if twins else ""),
            flush=True,
        )
        for n in twins:
            if same:
                results[(op, n)] = ms

    best = {}
    for op in ops:
        mine = [(ms, name) for (o, name), ms in results.items() if o == op and name != "defaults"]
        if mine:
            best[op] = min(mine)
    # ---- 5. the proposal: ONE candidate for all ops (the per-op winners may set shared fields differently) -
    both = [n for n in launches if n != "defaults" and all((op, n) in results for op in ops)]
    joint = min(both, key=lambda n: sum(results[op, n] for op in ops), default=None)
    proposal = launches[joint] if joint else None

    # ---- 6. summary (before the decode step: what the lead needs, should the call be cut short) ------------
    def pct(op, ms):
        return f"{ms * 1e3:.1f} µs = {100 * nb[op] / (ms * 1e-3) / copy:.1f} %"

    print(f"\nsummary (T = {T_BIG}, Hd = {HD}, % of the copy ceiling over compulsory bytes; goal: pre and fused >= 50 %)")
    for op in ops:
        base = results.get((op, "defaults"))
        line = f"  {op:5s} today's default ({default_launch(_OP_NAMES[op]).design}): {pct(op, base) if base else 'not timed'}"
        if op in best:
            line += f"; fastest candidate {best[op][1]!r}: {pct(op, best[op][0])}"
        if joint:
            line += f"; proposed {joint!r}: {pct(op, results[op, joint])}"
        print(line)
    if joint is None:
        print("no candidate passed and was timed for every op: keep the defaults", flush=True)
    else:
        fields = candidate_fields(joint)
        default_fields = {f.name: f.default for f in dataclasses.fields(type(proposal))}
        diff = {k: v for k, v in fields.items() if default_fields.get(k) != v}
        print(
            f"the proposal: the candidate with the least total time over {', '.join(ops)} ({joint!r}); to make it "
            f"the default, in dsv4ref/mhc/launch.py {type(proposal).__name__}: "
            + (", ".join(f"{k}: ... = {v}" for k, v in diff.items()) or "nothing to change"),
            flush=True,
        )

    # decode-sized rows: T = 37, today's defaults, the fastest candidate and the proposal (µs only)
    for op in ops:
        done = set()
        for name in ("defaults", best.get(op, (0, None))[1], joint):
            canon = same_as.get((op, name), name)
            if name is None or canon in done or (op, canon) not in passed:
                continue
            done.add(canon)
            L = launches[canon]
            small = [_inputs(T_SMALL)] * 2
            small_outs = [run_op(op, L, T_SMALL, s) for s in small]
            ms = time_ms(lambda i, L=L, op=op: run_op(op, L, T_SMALL, small[i], small_outs[i]), n_sets=2, **tkw)
            print(f"{op:5s} T={T_SMALL:<4d} {name:15s} {L.design:10s} {ms * 1e3:8.1f} µs", flush=True)

    # where each op's time goes: device time per kernel (torch.profiler) for today's default and the proposal
    if not SMOKE:
        for op in ops:
            for name in dict.fromkeys(("defaults", joint)):
                if name is not None and (op, name) in results:
                    try:
                        kernel_times(op, name, launches[name], sets, outs, copy)
                    except Exception as e:  # a diagnostic: the figures above stand without it
                        print(f"{el()} {op} {name}: kernel times failed ({type(e).__name__}: {e})", flush=True)

    if with_decode and proposal is not None:
        print(f"\n{el()} decode step, teaching config, mhc_launch = {joint!r}", flush=True)
        if decode_err and not decode_err.startswith("still compiling"):
            print(f"  one-pass decode step FAILED in the compile worker: {decode_err}", flush=True)
        else:
            try:
                decode_check(proposal)
            except Exception as e:
                print(f"  decode step FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"{el()} done", flush=True)


# the bytes each kernel of the chunked design must move at T = Hd (streams [T, 4, Hd] bf16): the partial reads
# the streams; the finish reads them and writes the layer input [T, Hd]; post_kernel reads x and the streams
# and writes the new streams (in units of T·Hd·2 B)
_KERNEL_UNITS = {"hc_chunk_partial_kernel": 4, "hc_chunk_finish_kernel": 5, "post_kernel": 9}


def kernel_times(op: str, name: str, L, sets, outs, copy: float, calls: int = 20) -> None:
    """Print the device time of each kernel ``op`` runs with launch ``L`` (torch.profiler, ``calls`` eager calls
    on the two rotated input sets, so every call starts with the streams out of L2), per call, and for the
    chunked design's kernels the fraction of the copy ceiling their own compulsory bytes make at that time."""
    from torch.profiler import ProfilerActivity, profile

    from dsv4ref.device import synchronize

    for i in range(2):  # warm: compiled, allocator primed
        run_op(op, L, T_BIG, sets[i], outs[i])
    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            run_op(op, L, T_BIG, sets[i % 2], outs[i % 2])
        synchronize()
    total = 0.0
    rows = []
    for ev in prof.key_averages():
        us = ev.device_time_total / calls  # µs per op call (a kernel launched per chunk: all its chunks)
        if us <= 0 or ev.key.startswith(("cudaDeviceSynchronize", "Memcpy", "Memset", "Activity Buffer")):
            continue
        total += us
        rows.append((us, ev.key, ev.count // calls))
    print(f"{op:5s} {name}: kernels, device µs per call (profiler, eager)", flush=True)
    for us, key, n in sorted(rows, reverse=True):
        units = _KERNEL_UNITS.get(key)
        rate = (
            (
                f"{units * T_BIG * HD * 2 / (us * 1e-6) / 1e12:5.2f} TB/s = "
                f"{100 * units * T_BIG * HD * 2 / (us * 1e-6) / copy:5.1f} % of copy"
            )
            if units
            else ""
        )
        print(f"        {key[:40]:40s} ×{n:<3d} {us:8.1f} µs {100 * us / total:5.1f} %   {rate}", flush=True)


def decode_check(L) -> None:
    """3 decode steps (eager) and 2 (graphed) of the teaching config with ``Decoder(mhc_launch=L)``: each step
    against the float64 reference, and the eager logits against today's defaults."""
    from dsv4ref.config import TINY
    from dsv4ref.decode import LOGITS_TOL, agreement, rel_err, run

    prompts = (133, 37, 5, 70)
    t = time.perf_counter()
    dec, w, recs, tps = run(TINY, steps=3, prompt_lens=prompts, mhc_launch=L, profile=True)
    rows = agreement(TINY, w, recs, dec.history())
    mhc_ms = dec.prof.get("mhc", float("nan")) / 3
    _, _, recs0, _ = run(TINY, steps=3, prompt_lens=prompts)
    worst = max(float(rel_err(a[2], b[2]).max()) for a, b in zip(recs[1:], recs0[1:]))
    ok = all(a.passed for a in rows) and worst <= LOGITS_TOL
    print(
        f"  eager, 3 steps: {'PASS' if ok else 'FAIL'}: {sum(a.passed for a in rows)} of {len(rows)} steps agree "
        f"with the float64 reference; logits vs today's defaults: max rel err {worst:.2e} (<= {LOGITS_TOL:g}); "
        f"mHC {mhc_ms:.2f} ms per step (profiled, eager)",
        flush=True,
    )
    dec, w, recs, tps = run(TINY, steps=2, prompt_lens=prompts, mhc_launch=L, graph=True)
    rows = agreement(TINY, w, recs, dec.history())
    print(
        f"  graphed, 2 steps: {'PASS' if all(a.passed for a in rows) else 'FAIL'} ({tps:.0f} tokens/s), "
        f"{time.perf_counter() - t:.1f} s for the decode checks",
        flush=True,
    )


if __name__ == "__main__":
    main()
