"""Conformance cases of the MoE feed-forward: ``moe.route``, ``moe.stage``, ``moe.experts`` and ``moe.forward``
(docs/moe.md; each case's ``why`` names the pitfall it guards against)."""

from __future__ import annotations

import torch

from ..moe import MoeShape, example_inputs, reference
from ..testing import generator, randn
from .suite import Case

OUTPUTS = {
    "moe.route": lambda res, a: {"ids": res[0], "weights": res[1]},
    "moe.stage": lambda res, a: {"x_fp8": res[0], "x_sf": res[1], "ids": res[2], "weights": res[3]},
    "moe.experts": lambda res, a: {"out": res},
    "moe.forward": lambda res, a: {"out": res},
}

ROUTE_TOL = {"ids": "exact", "weights": "route_weights"}
STAGE_TOL = {"x_fp8": "exact", "x_sf": "exact", "ids": "exact", "weights": "exact"}
LAYER = ("x", "gate_weight", "bias", "w13", "w2", "shared_w13", "shared_w2")
EXPERTS = ("x", "x_fp8", "x_sf", "ids", "weights", "w13", "w2", "shared_w13", "shared_w2")


def _gate(z_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 8] one-hot rows and W_gate [E, 8] whose column t holds row t's logits: z = x·Wᵀ exactly."""
    z = torch.tensor(z_rows, dtype=torch.float32)
    T, E = z.shape
    x = torch.eye(T, 8, dtype=torch.bfloat16)
    W = torch.zeros(E, 8, dtype=torch.bfloat16)
    W[:, :T] = z.T.to(torch.bfloat16)
    return x, W


def _route_cases() -> list[Case]:
    out = []
    x, W = _gate([[0, 1, 2, 3, -1, -2, 0.5, 4]] * 3)
    bias = torch.tensor([0, 0, 0, 0, 5.0, 0, 0, -10.0])
    out.append(Case("moe.route", "worked_bias_selects_never_weighs", dict(x=x, gate_weight=W, bias=bias, k=2, routed_scale=1.5),
                    ("x", "gate_weight", "bias"), tol=ROUTE_TOL,
                    why="bias −10 drops the top expert and +5 picks a weak one; weights from the unbiased scores (P1)"))
    x, W = _gate([[-200.0] * 8, [-20.0, -20.0, -30.0, -40.0, -50.0, -60.0, -70.0, -80.0], [0.0] * 8,
                  [0, 0, 1, 0, 0, 1, 4, -1]])
    out.append(Case("moe.route", "softplus_extremes_and_ties", dict(x=x, gate_weight=W, bias=torch.zeros(8), k=2, routed_scale=1.5),
                    ("x", "gate_weight", "bias"), tol=ROUTE_TOL,
                    why="an all-underflow row gives weights 0, not NaN (P3); z = −20 needs log1p (P2); ties go to the "
                        "lower id; ungrouped sqrt(softplus) top-k (P4)"))
    d = example_inputs(6, seed=51, hash_layer=True, vocab=64)
    ids = d["input_ids"].cpu()
    ids[2] = -1
    out.append(Case("moe.route", "hash_layer_padding_nan_bias",
                    dict(x=d["x"].cpu(), gate_weight=d["gate_weight"].cpu(), bias=torch.full((8,), float("nan")), k=2,
                         routed_scale=1.5, hash_table=d["hash_table"].cpu(), input_ids=ids),
                    ("x", "gate_weight", "bias"), tol=ROUTE_TOL,
                    why="ids = tid2eid[input_ids] in table order; the bias (NaN) is never read; input_ids −1 is a "
                        "padding row: ids −1, weights 0"))
    return out


def _stage_cases() -> list[Case]:
    h = torch.zeros(5, 512)
    h[0, 32:34] = torch.tensor([1.0, 0.5])  # block 0: (zeros, amax 1, amax 448, amax 450) → word −2139130007
    h[0, 64], h[0, 96], h[0, 97], h[0, 5] = 448.0, 450.0, -450.0, -0.0
    for r in range(1, 5):  # amax 448·2^k in lane r−1 of block r−1: bytes 127 + k, lane 3 ≥ 128 → negative word
        k = (-20, -1, 3, 20)[r - 1]
        g = slice(128 * (r - 1) + 32 * (r - 1), 128 * (r - 1) + 32 * r)
        h[r, g] = randn((32,), seed=r, block=None, octaves=0, device="cpu").float().clamp(-1, 1) * 448.0 * 2.0**k
        h[r, g.start + r] = 448.0 * 2.0**k
    h[1:, 448:] = randn((4, 64), seed=52, block=32, octaves=24, device="cpu").float()
    ids = torch.randint(-1, 256, (5, 6), generator=generator(53)).to(torch.int32)
    ids[0, 0] = -1
    w = torch.rand(5, 6, generator=generator(54))
    w[0, 1] = -0.0
    w.view(torch.int32)[1, 2] = 0x7FC00123  # a NaN with a payload: weights are a bit copy
    out = [Case("moe.stage", "worked_words_448_pow2_lanes_K6", dict(hidden=h.to(torch.bfloat16), ids=ids, weights=w),
                ("hidden", "ids", "weights"), tol=STAGE_TOL,
                why="the packed int32 comes out negative when byte 3 ≥ 128 (P7); amax = 448·2^k gives byte 127 + k, not "
                    "one more (P8); −0.0 → 0x80; int32 −1 ids → int64 −1; K = 6 masks a tail of 8")]
    x = randn((3, 256), seed=55, block=32, octaves=30, device="cpu")
    out.append(Case("moe.stage", "thirty_octaves_K1", dict(hidden=x, ids=torch.tensor([[7], [-1], [0]]), weights=torch.ones(3, 1)),
                    ("hidden", "ids", "weights"), tol=STAGE_TOL,
                    why="every 32-group its own scale byte over 30 octaves: x_sf bytes are exponents, not values (P6)"))
    x = randn((3, 256), seed=58, block=32, octaves=12, device="cpu")
    x[0, 3], x[0, 40], x[1, 64 + 7], x[2, 200], x[2, 255] = float("nan"), float("inf"), -float("inf"), -float("nan"), 448.0
    out.append(Case("moe.stage", "nonfinite_groups_checks_off", dict(hidden=x, ids=torch.tensor([[1, 2], [3, -1], [0, 5]]),
                                                                     weights=torch.full((3, 2), 0.5)),
                    ("hidden", "ids", "weights"), tol=STAGE_TOL, check_values=False,
                    why="value checks off: a 32-group holding NaN or ±inf is staged as scale byte 255 (the packed word's "
                        "lane) with e4m3 0x7F, or 0xFF for a non-NaN value with its sign bit set; the other groups of the "
                        "row are untouched (docs/contract.md, the MoE section)"))
    return out


def _layer_cases() -> list[Case]:
    # small enough for the golden files (about 60 KB of weights per case): Hd 128, E 4, I 16
    shape = MoeShape(hidden=128, experts=4, k=2, intermediate=16, routed_scale=1.5, swiglu_limit=10.0, num_hash_layers=1)
    d = {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
         for k, v in example_inputs(10, shape, seed=56, octaves=16, weight_gain=2.0).items()}
    ids, w = reference.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=1.5)
    # routing weights on a 2^-12 grid: softplus and sqrt differ in the last bit between CPU builds (AVX2 vs
    # AVX-512 torch), and the golden inputs must be the same bytes wherever the case is built
    w = torch.round(w * 4096) / 4096
    for t, row in enumerate(ids.tolist()):  # expert 3 gets no token
        if 3 in row:
            ids[t, row.index(3)] = next(e for e in range(4) if e != 3 and e not in row)
    ids[1, 1], w[1, 1] = -1, 1e6  # a −1 slot with a huge weight adds exactly 0 (P9)
    ids[4] = torch.tensor([2, 2])  # a repeated expert: both slots add (P10)
    x_fp8, x_sf, ids64, w32 = reference.stage(d["x"], ids, w)
    weights = {k: d[k] for k in ("w13", "w2", "shared_w13", "shared_w2")}
    out = [Case("moe.experts", "clamp_minus1_duplicate_empty_expert",
                dict(x=d["x"], x_fp8=x_fp8, x_sf=x_sf, ids=ids64, weights=w32, **weights, swiglu_limit=10.0),
                EXPERTS, tol={"out": "moe_out"},
                why="pre-activations past ±10 in routed and shared experts (P5); −1 slot with weight 1e6 (P9); a repeated "
                    "id (P10); an expert with no token; weight applied before w2; compare with a tolerance (P15)")]
    h = example_inputs(6, shape, seed=57, hash_layer=True, octaves=12, vocab=64)
    h = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in h.items()}
    h["input_ids"][4] = -1
    out.append(Case("moe.forward", "hash_layer_padding_row",
                    dict(**{k: h[k] for k in LAYER}, k=2, routed_scale=1.5, swiglu_limit=10.0, hash_table=h["hash_table"],
                         input_ids=h["input_ids"]),
                    LAYER, tol={"out": "moe_out"},
                    why="route through tid2eid, stage, experts, shared expert; the padding row is the shared expert alone"))
    out.append(Case("moe.forward", "routed_scale_zero",
                    dict(**{k: d[k] for k in LAYER}, k=2, routed_scale=0.0, swiglu_limit=10.0),
                    LAYER, tol={"out": "moe_out"},
                    why="routed scale 0 leaves exactly the shared expert, which is never scaled (P11)"))
    return out


def cases() -> list[Case]:
    return _route_cases() + _stage_cases() + _layer_cases()


def mass(case: Case) -> dict:
    """For the layer outputs (tolerance "moe_out"): Σ over slots and the shared expert of |h|·|W2|ᵀ in float64."""
    a = case.inputs
    if case.op == "moe.experts":
        staged = tuple(a[k] for k in EXPERTS[1:5])
    elif case.op == "moe.forward":
        ids, w = reference.route(a["x"], a["gate_weight"], a["bias"], k=a["k"], routed_scale=a["routed_scale"],
                                 hash_table=a.get("hash_table"), input_ids=a.get("input_ids"))
        staged = reference.stage(a["x"], ids, w)
    else:
        return {}
    return {"out": reference.experts(a["x"], *staged, a["w13"], a["w2"], a["shared_w13"], a["shared_w2"],
                                     swiglu_limit=a["swiglu_limit"], dtype=torch.float64, mass=True)}
