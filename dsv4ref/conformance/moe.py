"""Conformance cases of the MoE feed-forward: ``moe.route``, ``moe.stage``, ``moe.experts`` and ``moe.forward``
(docs/moe.md; each case's ``why`` names the pitfall it guards against).

The routing cases: ``moe_route.py``. Each case is built by hand so that its inputs hit one rule (the amax floor,
the softplus threshold, duplicate ids, −1 slots, non-finite input); a case is read on its own.
"""

from __future__ import annotations

import torch

from ..moe import MoeShape, example_inputs, reference
from ..testing import generator, randn
from . import moe_fp4
from .moe_route import route_cases, route_more
from .suite import Case

OUTPUTS = {
    "moe.route": lambda res, a: {"ids": res[0], "weights": res[1]},
    "moe.stage": lambda res, a: {"x_fp8": res[0], "x_sf": res[1], "ids": res[2], "weights": res[3]},
    "moe.experts": lambda res, a: {"out": res},
    "moe.forward": lambda res, a: {"out": res},
    **moe_fp4.OUTPUTS,  # moe.experts_fp4: V4's FP4 experts (conformance/moe_fp4.py)
}

STAGE_TOL = {"x_fp8": "exact", "x_sf": "exact", "ids": "exact", "weights": "exact"}
LAYER = ("x", "gate_weight", "bias", "w13", "w2", "shared_w13", "shared_w2")
EXPERTS = ("x", "x_fp8", "x_sf", "ids", "weights", "w13", "w2", "shared_w13", "shared_w2")


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
    out = [
        Case(
            "moe.stage",
            "worked_words_448_pow2_lanes_K6",
            dict(hidden=h.to(torch.bfloat16), ids=ids, weights=w),
            ("hidden", "ids", "weights"),
            tol=STAGE_TOL,
            why="the packed int32 comes out negative when byte 3 ≥ 128 (P7); amax = 448·2^k gives byte 127 + k, not "
            "one more (P8); −0.0 → 0x80; int32 −1 ids → int64 −1; K = 6 masks a tail of 8",
        )
    ]
    x = randn((3, 256), seed=55, block=32, octaves=30, device="cpu")
    out.append(
        Case(
            "moe.stage",
            "thirty_octaves_K1",
            dict(hidden=x, ids=torch.tensor([[7], [-1], [0]]), weights=torch.ones(3, 1)),
            ("hidden", "ids", "weights"),
            tol=STAGE_TOL,
            why="every 32-group its own scale byte over 30 octaves: x_sf bytes are exponents, not values (P6)",
        )
    )
    x = randn((3, 256), seed=58, block=32, octaves=12, device="cpu")
    x[0, 3], x[0, 40], x[1, 64 + 7], x[2, 200], x[2, 255] = float("nan"), float("inf"), -float("inf"), -float("nan"), 448.0
    out.append(
        Case(
            "moe.stage",
            "nonfinite_groups_checks_off",
            dict(hidden=x, ids=torch.tensor([[1, 2], [3, -1], [0, 5]]), weights=torch.full((3, 2), 0.5)),
            ("hidden", "ids", "weights"),
            tol=STAGE_TOL,
            check_values=False,
            why="value checks off: a 32-group holding NaN or ±inf is staged as scale byte 255 (the packed word's "
            "lane) with e4m3 0x7F, or 0xFF for a non-NaN value with its sign bit set; the other groups of the "
            "row are untouched (docs/contract.md, the MoE section)",
        )
    )
    return out


def _layer_cases() -> list[Case]:
    # small enough for the golden files (about 60 KB of weights per case): Hd 128, E 4, I 16
    shape = MoeShape(hidden=128, experts=4, k=2, intermediate=16, routed_scale=1.5, swiglu_limit=10.0, num_hash_layers=1)
    d = {
        k: (v.cpu() if isinstance(v, torch.Tensor) else v)
        for k, v in example_inputs(10, shape, seed=56, octaves=16, weight_gain=2.0).items()
    }
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
    out = [
        Case(
            "moe.experts",
            "clamp_minus1_duplicate_empty_expert",
            dict(x=d["x"], x_fp8=x_fp8, x_sf=x_sf, ids=ids64, weights=w32, **weights, swiglu_limit=10.0),
            EXPERTS,
            tol={"out": "moe_out"},
            why="pre-activations past ±10 in routed and shared experts (P5); −1 slot with weight 1e6 (P9); a repeated "
            "id (P10); an expert with no token; weight applied before w2; compare with a tolerance (P15)",
        )
    ]
    h = example_inputs(6, shape, seed=57, hash_layer=True, octaves=12, vocab=64)
    h = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in h.items()}
    h["input_ids"][4] = -1
    out.append(
        Case(
            "moe.forward",
            "hash_layer_padding_row",
            dict(
                **{k: h[k] for k in LAYER},
                k=2,
                routed_scale=1.5,
                swiglu_limit=10.0,
                hash_table=h["hash_table"],
                input_ids=h["input_ids"],
            ),
            LAYER,
            tol={"out": "moe_out"},
            why="route through tid2eid, stage, experts, shared expert; the padding row is the shared expert alone",
        )
    )
    out.append(
        Case(
            "moe.forward",
            "routed_scale_zero",
            dict(**{k: d[k] for k in LAYER}, k=2, routed_scale=0.0, swiglu_limit=10.0),
            LAYER,
            tol={"out": "moe_out"},
            why="routed scale 0 leaves exactly the shared expert, which is never scaled (P11)",
        )
    )
    return out


def _stage_more() -> list[Case]:
    out = []
    # the amax floor: byte = ceil(log2(max(amax, 1e-4) / 448)) + 127 = 105 for EVERY group with amax < 1e-4, not
    # only the all-zero one (a floor applied at amax == 0 alone gives bytes 104, 98, 61 ... here)
    amax = (
        3e-5,
        1e-6,
        9.5e-5,
        0.0,
        6e-5,
        1e-20,
        1.5e-4,
        448.0 * 2.0**-22,  # row 0
        1e-4,
        2e-9,
        5e-5,
        1.0,
        7e-7,
        1.2e-5,
        0.0,
        99e-6,
    )  # row 1
    h = torch.zeros(3, 256)
    for i, a in enumerate(amax):
        r, g = divmod(i, 8)
        v = torch.rand(32, generator=generator(70 + i)) * 2 - 1
        h[r, 32 * g : 32 * (g + 1)] = v / v.abs().max() * a
    h[0, 32 * 4 + 5] = -6e-5  # the amax of a group may be a negative value
    h[2] = randn((256,), seed=71, block=32, octaves=8, device="cpu").float() * 2.0**-20  # every group below 1e-4
    out.append(
        Case(
            "moe.stage",
            "amax_floor_groups_below_1e-4",
            dict(
                hidden=h.to(torch.bfloat16),
                ids=torch.tensor([[3, 1], [-1, 0], [2, 2]]),
                weights=torch.tensor([[0.75, 0.75], [0.0, 1.5], [0.5, 1.0]]),
            ),
            ("hidden", "ids", "weights"),
            tol=STAGE_TOL,
            why="groups with 0 < amax < 1e-4 take the floor's byte 105 and codes x·2^22 (e4m3 subnormals, zeros "
            "for amax 1e-20), like an all-zero group: a floor applied only at amax == 0 gives other bytes; "
            "amax just above the floor (1.5e-4, 448·2^-22)",
        )
    )
    x = (
        randn((7, 256), seed=73, block=None, octaves=0, device="cpu")
        * torch.tensor([2.0**k for k in (-30, -9, 0, 5, 9, 15, 40)], dtype=torch.bfloat16)[:, None]
    )
    x = x.T.contiguous().T  # the same values as a column-major view: hidden with any strides
    ids = torch.randint(-1, 256, (7, 8), generator=generator(74))
    w = torch.rand(7, 8, generator=generator(75)) * 1.5
    w[3] = torch.tensor([float("inf"), -float("inf"), 1e-45, -1e38, 0.0, -0.0, 3.0, 2.0])
    out.append(
        Case(
            "moe.stage",
            "transposed_hidden_int64_ids_K8",
            dict(hidden=x, ids=ids, weights=w),
            ("hidden", "ids", "weights"),
            tol=STAGE_TOL,
            why="hidden a transposed view (any strides), 7 rows over 70 octaves (bytes above 128: negative words, "
            "P7); int64 ids stay int64; K = 8; weights a bit copy (±inf, a subnormal, −0.0 kept)",
        )
    )
    out.append(
        Case(
            "moe.stage",
            "empty_batch",
            dict(
                hidden=torch.zeros(0, 384, dtype=torch.bfloat16),
                ids=torch.zeros(0, 6, dtype=torch.int32),
                weights=torch.zeros(0, 6),
            ),
            ("hidden", "ids", "weights"),
            tol=STAGE_TOL,
            why="T = 0: empty outputs of the right shapes and dtypes ([0, 384] e4m3, [0, 3] int32, [0, 6] int64 "
            "and fp32), no launch over zero rows",
        )
    )
    x = randn((2, 4096), seed=76, block=32, octaves=40, device="cpu")
    x[1, 4064:] = 448.0 * 2.0**9  # the last group of the last block: byte 136 in lane 3
    out.append(
        Case(
            "moe.stage",
            "flash_width_4096",
            dict(hidden=x, ids=torch.tensor([[255, 0, 17, 3, 99, 128], [1, 2, 3, 4, 5, -1]]), weights=torch.full((2, 6), 0.25)),
            ("hidden", "ids", "weights"),
            tol=STAGE_TOL,
            why="V4-Flash's Hd = 4096: 32 packed words per token over 40 octaves; the last word of a row, lane 3 "
            "= byte 136 (a negative word, P7), ends exactly at the row's end",
        )
    )
    return out


def _experts_case(
    name,
    why,
    *,
    T,
    K,
    seed,
    E=4,
    tweak=None,
    shared=True,
    swiglu_limit=10.0,
    check_values=True,
    layout=None,
    gain=2.0,
    ids_dtype=torch.int64,
):
    """A moe.experts case on the layer shape of the golden files (Hd 128, E 4, I 16): ids and weights drawn,
    weights on a 2^-12 grid, staged by the reference; ``tweak(x, ids, w)`` edits them before staging."""
    shape = MoeShape(hidden=128, experts=E, k=K, intermediate=16, routed_scale=1.5, swiglu_limit=10.0, num_hash_layers=1)
    d = {
        k: (v.cpu() if isinstance(v, torch.Tensor) else v)
        for k, v in example_inputs(T, shape, seed=seed, octaves=16, weight_gain=gain).items()
    }
    g = generator(seed + 100)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.round(torch.rand(T, K, generator=g) * 1.5 * 4096) / 4096
    x = d["x"]
    if tweak is not None:
        x, ids, w = tweak(x.clone(), ids.clone(), w.clone())
    x_fp8, x_sf, _, w32 = reference.stage(x, ids, w)  # the reference writes the checks-off bytes for a NaN group
    weights = {k: d[k] for k in ("w13", "w2", "shared_w13", "shared_w2")}
    if layout is not None:
        weights = layout(weights)
    inputs = dict(x=x, x_fp8=x_fp8, x_sf=x_sf, ids=ids.to(ids_dtype), weights=w32, w13=weights["w13"], w2=weights["w2"])
    pos = EXPERTS[:7]
    if shared:
        inputs.update(shared_w13=weights["shared_w13"], shared_w2=weights["shared_w2"])
        pos = EXPERTS
    inputs["swiglu_limit"] = swiglu_limit
    return Case("moe.experts", name, inputs, pos, tol={"out": "moe_out"}, why=why, check_values=check_values)


def _experts_more() -> list[Case]:
    def triple(x, ids, w):
        ids[0] = torch.tensor([1, 1, 1])
        ids[2] = torch.tensor([0, 3, 0])
        ids[5] = torch.tensor([2, 2, 1])
        return x, ids, w

    def padding(x, ids, w):
        ids[1, 0], w[1, 0] = -1, float("nan")  # NaN weight on a −1 slot: allowed, never read (checks on too)
        ids[3], w[3] = -1, torch.tensor([1e30, -float("inf")])  # an all-padding row: the shared expert alone
        ids[6, 1], w[6, 1] = -1, 1e6
        return x, ids, w

    def nonfinite(x, ids, w):
        x[1, 70] = float("nan")  # a NaN group: staged as byte 255 / 0x7F, its slots' rows NaN
        x[4, 3] = -float("inf")  # −inf: 0xFF codes; also reaches the shared expert as −inf
        w[6, 0] = float("nan")  # a NaN weight of a slot that is read: the row is NaN
        ids[2], w[2, 1] = torch.tensor([3, -1]), float("nan")  # a NaN weight on a −1 slot: nothing
        return x, ids, w

    def transposed(weights):  # the same values, other strides: w13 / w2 as transposed views
        return dict(
            weights,
            w13=weights["w13"].transpose(1, 2).contiguous().transpose(1, 2),
            w2=weights["w2"].transpose(1, 2).contiguous().transpose(1, 2),
            shared_w2=weights["shared_w2"].T.contiguous().T,
        )

    return [
        _experts_case(
            "duplicate_ids_k3",
            "a row naming one expert three times adds all three slots; rows [0, 3, 0] "
            "and [2, 2, 1]: a scatter `y[idx] += v` keeps one of the repeated contributions (P10)",
            T=7,
            K=3,
            seed=80,
            tweak=triple,
        ),
        _experts_case(
            "minus1_slots_nan_weight_all_padding_row",
            "a −1 slot contributes exactly 0 whatever its weight "
            "(NaN, 1e30, −inf, 1e6: never read, P9); an all-padding row is the shared expert alone",
            T=8,
            K=2,
            seed=81,
            tweak=padding,
        ),
        _experts_case(
            "no_shared_expert",
            "shared_w13 = shared_w2 = None: the routed slots only, nothing added for the shared expert",
            T=6,
            K=2,
            seed=82,
            shared=False,
        ),
        _experts_case(
            "swiglu_limit_off",
            "swiglu_limit 0 disables the clamp: pre-activations past ±10 (gain 4) go "
            "through silu(a)·u unclamped, in routed and shared experts (P5's switch)",
            T=6,
            K=2,
            seed=83,
            swiglu_limit=0.0,
            gain=4.0,
        ),
        _experts_case(
            "nonfinite_staged_checks_off",
            "value checks off: a staged NaN group (byte 255, e4m3 0x7F / 0xFF) "
            "and a NaN weight of a read slot make the token's row NaN (0x7FC0); −inf in x reaches the shared "
            "expert; a NaN weight on a −1 slot does nothing (docs/contract.md, the MoE section)",
            T=8,
            K=2,
            seed=84,
            tweak=nonfinite,
            check_values=False,
        ),
        _experts_case(
            "int32_ids_strided_weights_E8",
            "int32 ids; w13, w2 and shared_w2 column-major views (any strides); E = 8 experts, K = 4, T = 9",
            T=9,
            K=4,
            E=8,
            seed=85,
            layout=transposed,
            ids_dtype=torch.int32,
        ),
    ]


def _forward_more() -> list[Case]:
    shape = MoeShape(hidden=128, experts=4, k=2, intermediate=16, routed_scale=1.5, swiglu_limit=10.0, num_hash_layers=1)

    def layer(T, seed, **kw):
        d = example_inputs(T, shape, seed=seed, **kw)
        return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}

    out = []
    d = layer(12, 90, octaves=10, weight_gain=2.0)
    out.append(
        Case(
            "moe.forward",
            "gate_layer_near_uniform_bias",
            dict(**{k: d[k] for k in LAYER}, k=2, routed_scale=1.5, swiglu_limit=10.0),
            LAYER,
            tol={"out": "moe_out"},
            why="the V4-Flash gate layer: bias ≈ 8.08 selects, the unbiased scores weigh (P1), the routed sum is "
            "scaled by 1.5 and the shared expert is not (P11)",
        )
    )
    d = layer(6, 91, octaves=4, weight_gain=2.0)
    d["gate_weight"] = d["gate_weight"] * 256.0  # exact in bf16: logits of hundreds, past fp32's exp overflow at 88
    out.append(
        Case(
            "moe.forward",
            "large_logits_softplus_threshold",
            dict(**{k: d[k] for k in LAYER}, k=2, routed_scale=1.5, swiglu_limit=10.0),
            LAYER,
            tol={"out": "moe_out"},
            why="gate logits of several hundred: softplus(z) = z above 20 keeps the weights finite where "
            "log1p(exp(z)) overflows (P2)",
        )
    )
    d = layer(6, 92, octaves=8, weight_gain=2.0)
    x = d["x"].clone()
    x[2, 40], x[4, 100] = float("nan"), float("inf")
    out.append(
        Case(
            "moe.forward",
            "nonfinite_x_checks_off",
            dict(**{k: d[k] for k in LAYER}, k=2, routed_scale=1.5, swiglu_limit=10.0) | {"x": x},
            LAYER,
            tol={"out": "moe_out"},
            check_values=False,
            why="value checks off: a NaN / +inf token gets NaN weights, a NaN staged group and a NaN output row "
            "(0x7FC0); the other rows as with finite input (docs/contract.md, the MoE section)",
        )
    )
    d = layer(7, 93, hash_layer=True, octaves=12, vocab=40, weight_gain=2.0)
    ids = d["input_ids"].to(torch.int32)
    ids[0] = -1
    out.append(
        Case(
            "moe.forward",
            "hash_int32_table_no_shared",
            dict(
                **{k: d[k] for k in LAYER[:5]},
                shared_w13=None,
                shared_w2=None,
                k=2,
                routed_scale=1.5,
                swiglu_limit=10.0,
                hash_table=d["hash_table"].to(torch.int32),
                input_ids=ids,
            ),
            LAYER,
            tol={"out": "moe_out"},
            why="an int32 tid2eid table and int32 input_ids; no shared expert (None, None): a padding row is exactly 0",
        )
    )
    return out


def cases() -> list[Case]:
    return (
        route_cases()
        + route_more()
        + _stage_cases()
        + _stage_more()
        + _layer_cases()
        + _experts_more()
        + _forward_more()
        + moe_fp4.cases()
    )


def mass(case: Case) -> dict:
    """For the layer outputs (tolerance "moe_out"): Σ over slots and the shared expert of |h|·|W2|ᵀ in float64."""
    a = case.inputs
    if case.op == "moe.experts_fp4":
        return moe_fp4.mass(case)
    if case.op == "moe.experts":
        staged = tuple(a[k] for k in EXPERTS[1:5])
    elif case.op == "moe.forward":
        ids, w = reference.route(
            a["x"],
            a["gate_weight"],
            a["bias"],
            k=a["k"],
            routed_scale=a["routed_scale"],
            hash_table=a.get("hash_table"),
            input_ids=a.get("input_ids"),
        )
        staged = reference.stage(a["x"], ids, w)
    else:
        return {}
    return {
        "out": reference.experts(
            a["x"],
            *staged,
            a["w13"],
            a["w2"],
            a.get("shared_w13"),
            a.get("shared_w2"),
            swiglu_limit=a["swiglu_limit"],
            dtype=torch.float64,
            mass=True,
        )
    }
