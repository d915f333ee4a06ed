"""``python -m dsv4ref check moe`` / ``bench moe``: the MoE's check rows and benchmark cases.

Checks run on any device (tiny shapes, so the interpreter finishes in seconds). Benchmarks, at V4-Flash
size (Hd 4096, E 256, K 6, I 2048): the staging kernel at T = 4096 against copy bandwidth (beside two
``copy_`` calls moving the same bytes, timed the same way: the part of the gap a copy of that size has too), and the expert
kernels at T = 64 (decode: bound by the expert weights read) and T = 4096 (prefill: bound by the FLOPs),
each beside torch eager and ``torch.compile`` of the reference on the same inputs.
"""

from __future__ import annotations

import torch

from ... import moe, validate
from ...device import DEVICE
from ...formats import STAGE_BLOCK
from ...moe import reference
from ...testing import compare, generator, randn
from ..harness import BenchCase, CheckRow, bench, check, same_size_copy_case

WORKED = [  # gate logits z (E = 8, K = 2, scale 1.5), bias entries, expected ids and weights
    ({}, [7, 3], [0.8016948, 0.6983052]),
    ({7: -10.0}, [3, 2], [0.8173183, 0.6826817]),
    ({4: 5.0}, [4, 7], [0.3274070, 1.1725930]),
]
Z = [0.0, 1.0, 2.0, 3.0, -1.0, -2.0, 0.5, 4.0]


@check("moe.route")
def _check_route() -> list[CheckRow]:
    """The worked examples: logits set exactly through a one-hot x; ids must match, weights to 1e-6 rel."""
    x = torch.zeros(1, 8, dtype=torch.bfloat16, device=DEVICE)
    x[0, 0] = 1.0
    W = torch.zeros(8, 8, dtype=torch.bfloat16, device=DEVICE)
    W[:, 0] = torch.tensor(Z, dtype=torch.bfloat16)
    rows = []
    for b, want_ids, want_w in WORKED:
        bias = torch.zeros(8, device=DEVICE)
        for e, v in b.items():
            bias[e] = v
        ids, w = moe.route(x, W, bias, k=2, routed_scale=1.5)
        rep = compare(w[0].double(), torch.tensor(want_w, dtype=torch.float64), "route_weights", "weights")
        if ids[0].tolist() != want_ids:
            rep.passed, rep.detail = False, f"ids {ids[0].tolist()} != {want_ids}"
        rows.append(CheckRow("moe.route", f"worked bias={b or 'none'}", rep))
    return rows


@check("moe.stage")
def _check_stage() -> list[CheckRow]:
    rows = []
    for T, Hd, K, strided, nonfinite in [(37, 512, 6, False, False), (5, 256, 3, True, False), (9, 512, 6, False, True)]:
        d = moe.example_inputs(T, moe.TINY_MOE, seed=T, octaves=24)
        x = torch.cat([d["x"]] * (Hd // moe.TINY_MOE.hidden), dim=1)
        if strided:
            x = torch.cat([x, x], dim=1)[:, ::2]
        if nonfinite:  # NaN / ±inf groups in lanes 0..3 of the packed words: byte 255, codes 0x7F / 0xFF
            for t, h, v in ((1, 3, "nan"), (2, 39, "inf"), (3, 65, "-inf"), (4, 255, "-nan"), (8, 300, "inf")):
                x[t, h] = float(v)
        ids = torch.randint(-1, 256, (T, K), generator=generator(T)).to(torch.int32).to(DEVICE)
        w = torch.rand(T, K, generator=generator(T + 1)).to(DEVICE)
        with validate.checking_values(not nonfinite):
            got = moe.stage(x, ids, w, backend="triton")
            want = moe.stage(x, ids, w, backend="reference")
        shape = f"T={T} Hd={Hd} K={K}" + (" strided" if strided else "") + (" NaN/inf, checks off" if nonfinite else "")
        for name, g, r in zip(("x_fp8", "x_sf", "ids", "weights"), got, want):
            rows.append(CheckRow("moe.stage", f"{shape} {name}", compare(g, r, "exact", name)))
    return rows


def _oracle(d, x, ids, w):
    staged = moe.stage(x, ids, w, backend="reference")
    args = (x, *staged, d["w13"], d["w2"], d["shared_w13"], d["shared_w2"])
    out = reference.experts(*args, swiglu_limit=d["swiglu_limit"], dtype=torch.float64)
    return staged, out, reference.experts(*args, swiglu_limit=d["swiglu_limit"], dtype=torch.float64, mass=True)


@check("moe.experts")
def _check_experts() -> list[CheckRow]:
    rows = []
    for T, K, seed in [(8, 2, 1), (16, 3, 2)]:
        shape = moe.MoeShape(256, 8, K, 128, 1.5, 10.0, 1)
        d = moe.example_inputs(T, shape, seed=seed, octaves=16, weight_gain=2.0)
        ids, w = moe.route(d["x"], d["gate_weight"], d["bias"], k=K, routed_scale=1.5)
        ids[0, -1] = -1  # a −1 slot
        staged, want, mass = _oracle(d, d["x"], ids, w)
        got = moe.experts(
            d["x"], *staged, d["w13"], d["w2"], d["shared_w13"], d["shared_w2"], swiglu_limit=10.0, backend="triton"
        )
        rows.append(CheckRow("moe.experts", f"T={T} E=8 K={K} Hd=256 I=128", compare(got, want, "moe_out", mass=mass)))
    return rows


@check("moe.forward")
def _check_forward() -> list[CheckRow]:
    d = moe.example_inputs(6, moe.TINY_MOE, seed=3, hash_layer=True, octaves=12)
    d["input_ids"][4] = -1  # a padding row
    ids, w = moe.route(
        d["x"], d["gate_weight"], None, k=2, routed_scale=1.5, hash_table=d["hash_table"], input_ids=d["input_ids"]
    )
    _, want, mass = _oracle(d, d["x"], ids, w)
    got = moe.forward(
        d["x"],
        d["gate_weight"],
        None,
        d["w13"],
        d["w2"],
        d["shared_w13"],
        d["shared_w2"],
        k=2,
        routed_scale=1.5,
        swiglu_limit=10.0,
        hash_table=d["hash_table"],
        input_ids=d["input_ids"],
    )
    return [CheckRow("moe.forward", "T=6 hash layer, a padding row", compare(got, want, "moe_out", mass=mass))]


# ----------------------------------------------------------------------------------------------------
# benchmarks
# ----------------------------------------------------------------------------------------------------


STAGE_BENCH = (4096, 4096, 6, 4)  # T, Hd, K, input sets: 4 × (32 MB in + 16.5 MB out), past the H200's 60 MB L2


def stage_bytes(T: int, Hd: int, K: int) -> int:
    """Compulsory bytes of one staging call: x 2 B + e4m3 1 B + scale 1/32 B per value; ids and weights read
    (4 + 4 B) and written (8 + 4 B) per slot."""
    return T * (Hd * 2 + Hd + Hd // STAGE_BLOCK * 4 + K * (4 + 4 + 8 + 4))


def stage_sets(T: int, Hd: int, K: int, n_sets: int) -> list[tuple]:
    """``n_sets`` argument tuples of ``dsv4ref::moe_stage`` (before the launch fields): x bf16 [T, Hd] with a
    power-of-two scale per 32-group over 16 octaves (so the scale bytes vary as in a model), int32 ids, fp32
    weights, and the four output buffers (x_fp8 as uint8)."""
    sets = []
    for i in range(n_sets):
        x = randn((T, Hd), seed=100 + i, block=STAGE_BLOCK // 4, octaves=16)
        ids = torch.randint(0, 256, (T, K), device=DEVICE, dtype=torch.int32)
        w = torch.rand(T, K, device=DEVICE)
        out = (
            torch.empty(T, Hd, dtype=torch.uint8, device=DEVICE),
            torch.empty(T, Hd // STAGE_BLOCK, dtype=torch.int32, device=DEVICE),
            torch.empty(T, K, dtype=torch.int64, device=DEVICE),
            torch.empty(T, K, dtype=torch.float32, device=DEVICE),
        )
        sets.append((x, ids, w, *out))
    return sets


def same_size_copies(T: int, Hd: int, K: int, n_sets: int) -> list[BenchCase]:
    """Two ``copy_`` baselines moving what staging moves, timed the same way (graph replay, sets rotated):
    ``bf16 -> e4m3``: x [T, Hd] bf16 into an e4m3 [T, Hd] (reads 2 B, writes 1 B per value: staging's bulk traffic
    and its 2:1 read/write split, with torch's conversion instead of the scale search); ``uint8``: a byte copy
    of stage_bytes / 2 (the same total bytes, read = written). Against the 512 MiB copy ceiling they show how
    much a copy of this size loses to launch and tail alone."""
    src = [torch.randn(T, Hd, device=DEVICE, dtype=torch.bfloat16) for _ in range(n_sets)]
    dst = [torch.empty(T, Hd, device=DEVICE, dtype=torch.float8_e4m3fn) for _ in range(n_sets)]
    shape = f"T={T} Hd={Hd} K={K}"
    return [
        BenchCase(
            "moe.stage[same-size copy bf16->e4m3]",
            shape,
            lambda i: dst[i].copy_(src[i]),
            n_sets,
            T * Hd * 3,
            note="torch copy_ with conversion: 2 B read + 1 B written per value",
        ),
        same_size_copy_case(
            "moe.stage[same-size copy uint8]",
            shape,
            stage_bytes(T, Hd, K),
            n_sets,
            note="torch copy_ of stage_bytes / 2 bytes: the same total traffic as staging",
        ),
    ]


@bench("moe.stage")
def _bench_stage() -> list[BenchCase]:
    """The default launch at T = 4096, Hd = 4096, K = 6 (four input sets rotate), and the same-size copies."""
    T, Hd, K, n_sets = STAGE_BENCH
    sets = stage_sets(T, Hd, K, n_sets)
    launch = moe.default_launch(T, K, 256)

    def run(i):
        torch.ops.dsv4ref.moe_stage(*sets[i], *launch.op_args("moe_stage"))

    return [
        BenchCase(
            "moe.stage",
            f"T={T} Hd={Hd} K={K}",
            run,
            n_sets,
            stage_bytes(T, Hd, K),
            note="x 2 B + fp8 1 B + scales 1/32 B per value; ids/weights in and out",
        )
    ] + same_size_copies(T, Hd, K, n_sets)


def flash_weights():
    """V4-Flash expert weights in bf16 (12.9 GB routed + 50 MB shared): one set, far past any cache."""
    s = reference.FLASH_MOE
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = torch.randn(s.experts, 2 * s.intermediate, s.hidden, device=DEVICE, dtype=torch.bfloat16, generator=g) * s.hidden**-0.5
    w2 = torch.randn(s.experts, s.hidden, s.intermediate, device=DEVICE, dtype=torch.bfloat16, generator=g) * s.intermediate**-0.5
    sw13 = torch.randn(2 * s.intermediate, s.hidden, device=DEVICE, dtype=torch.bfloat16, generator=g) * s.hidden**-0.5
    sw2 = torch.randn(s.hidden, s.intermediate, device=DEVICE, dtype=torch.bfloat16, generator=g) * s.intermediate**-0.5
    return w13, w2, sw13, sw2


@bench("moe.experts")
def _bench_experts() -> list[BenchCase]:
    """E = 256, K = 6, Hd = 4096, I = 2048 (bf16 weights; V4-Flash stores MXFP4, 4× fewer bytes). Bytes: the
    weights of the experts that some token uses + the shared expert's, the staged x, x, ids, weights and the
    output; FLOPs: 2·3·Hd·I per slot and per token (shared). Workspaces (h, per-slot outputs) are not counted.
    Beside each: the reference in torch eager (a loop over experts) and with its expert MLP compiled."""
    s = reference.FLASH_MOE
    w13, w2, sw13, sw2 = flash_weights()
    cases = []
    for T in (64, 4096):
        n_sets = 2
        sets = []
        for _ in range(n_sets):
            x = torch.randn(T, s.hidden, device=DEVICE, dtype=torch.bfloat16)
            gate = torch.randn(s.experts, s.hidden, device=DEVICE, dtype=torch.bfloat16) * s.hidden**-0.5
            ids, w = moe.route(x, gate, torch.zeros(s.experts, device=DEVICE), k=s.k, routed_scale=s.routed_scale)
            staged = moe.stage(x, ids, w)
            sets.append((x, *staged, torch.empty(T, s.hidden, dtype=torch.bfloat16, device=DEVICE)))
        used = max(int(torch.unique(st[3]).numel()) for st in sets)
        nbytes = (
            (used + 1) * 3 * s.intermediate * s.hidden * 2
            + T * s.hidden * (1 + 2 + 2)
            + T * s.hidden // STAGE_BLOCK * 4
            + T * s.k * 12
        )
        flops = 2 * 3 * s.hidden * s.intermediate * T * (s.k + 1)
        launch = moe.default_launch(T, s.k, s.experts)
        note = f"{used} experts used; bf16 weights of the used experts + shared, activations, out"

        def run(i, st=sets, launch=launch):  # the custom op itself: no argument checks (they sync), graph-capturable
            x, q, sf, ids, w, out = st[i]
            torch.ops.dsv4ref.moe_experts(
                x, q.view(torch.uint8), sf, ids, w, w13, w2, sw13, sw2, out, s.swiglu_limit, *launch.op_args("moe_experts")
            )

        def eager(i, st=sets):
            x, q, sf, ids, w, _ = st[i]
            reference.experts(x, q, sf, ids, w, w13, w2, sw13, sw2, swiglu_limit=s.swiglu_limit)

        compiled_ref = torch.compile(reference.experts, dynamic=True)

        def compiled(i, st=sets, fn=compiled_ref):
            x, q, sf, ids, w, _ = st[i]
            fn(x, q, sf, ids, w, w13, w2, sw13, sw2, swiglu_limit=s.swiglu_limit)

        compiled(0)  # compile outside the timed region (and outside any graph capture)
        shape = f"T={T} E=256 K=6 Hd=4096 I=2048"
        cases += [
            BenchCase("moe.experts", shape, run, n_sets, nbytes, flops, note),
            BenchCase("moe.experts[torch eager]", shape, eager, n_sets, nbytes, flops, "the reference, torch eager"),
            BenchCase(
                "moe.experts[torch.compile]",
                shape,
                compiled,
                n_sets,
                nbytes,
                flops,
                "the reference under torch.compile (its expert MLP compiled; the loop over experts breaks the graph)",
            ),
        ]
    return cases
