"""Conformance cases of ``moe.route`` (docs/moe.md; each case's ``why`` names the pitfall it guards against),
gathered into the MoE suite by ``moe.py``."""

from __future__ import annotations

import torch

from ..moe import example_inputs
from .suite import Case

ROUTE_TOL = {"ids": "exact", "weights": "route_weights"}


def _gate(z_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 8] one-hot rows and W_gate [E, 8] whose column t holds row t's logits: z = x·Wᵀ exactly."""
    z = torch.tensor(z_rows, dtype=torch.float32)
    T, E = z.shape
    x = torch.eye(T, 8, dtype=torch.bfloat16)
    W = torch.zeros(E, 8, dtype=torch.bfloat16)
    W[:, :T] = z.T.to(torch.bfloat16)
    return x, W


def route_cases() -> list[Case]:
    out = []
    x, W = _gate([[0, 1, 2, 3, -1, -2, 0.5, 4]] * 3)
    bias = torch.tensor([0, 0, 0, 0, 5.0, 0, 0, -10.0])
    out.append(
        Case(
            "moe.route",
            "worked_bias_selects_never_weighs",
            dict(x=x, gate_weight=W, bias=bias, k=2, routed_scale=1.5),
            ("x", "gate_weight", "bias"),
            tol=ROUTE_TOL,
            why="bias −10 drops the top expert and +5 picks a weak one; weights from the unbiased scores (P1)",
        )
    )
    x, W = _gate([[-200.0] * 8, [-20.0, -20.0, -30.0, -40.0, -50.0, -60.0, -70.0, -80.0], [0.0] * 8, [0, 0, 1, 0, 0, 1, 4, -1]])
    out.append(
        Case(
            "moe.route",
            "softplus_extremes_and_ties",
            dict(x=x, gate_weight=W, bias=torch.zeros(8), k=2, routed_scale=1.5),
            ("x", "gate_weight", "bias"),
            tol=ROUTE_TOL,
            why="an all-underflow row gives weights 0, not NaN (P3); z = −20 needs log1p (P2); ties go to the "
            "lower id; ungrouped sqrt(softplus) top-k (P4)",
        )
    )
    d = example_inputs(6, seed=51, hash_layer=True, vocab=64)
    ids = d["input_ids"].cpu()
    ids[2] = -1
    out.append(
        Case(
            "moe.route",
            "hash_layer_padding_nan_bias",
            dict(
                x=d["x"].cpu(),
                gate_weight=d["gate_weight"].cpu(),
                bias=torch.full((8,), float("nan")),
                k=2,
                routed_scale=1.5,
                hash_table=d["hash_table"].cpu(),
                input_ids=ids,
            ),
            ("x", "gate_weight", "bias"),
            tol=ROUTE_TOL,
            why="ids = tid2eid[input_ids] in table order; the bias (NaN) is never read; input_ids −1 is a "
            "padding row: ids −1, weights 0",
        )
    )
    return out


def route_more() -> list[Case]:
    out = []
    x, W = _gate(
        [
            [90.0, 100.0, 89.0, 200.0, 1000.0, 3.0, -5.0, 95.0],
            [120.0, 0.5, -3.0, 0.0, 20.0, 21.0, -100.0, 2.0],
            [20.0, 19.75, 20.5, 88.0, 89.0, -88.0, 16.0, 0.25],
        ]
    )
    out.append(
        Case(
            "moe.route",
            "softplus_threshold_z_above_88",
            dict(x=x, gate_weight=W, bias=torch.tensor([0.0, 0.1, 0, 0, 0, 0, 0, 0.5]), k=3, routed_scale=1.5),
            ("x", "gate_weight", "bias"),
            tol=ROUTE_TOL,
            why="z > 88: fp32 exp(z) overflows, so log1p(exp(z)) is inf and the row's weights NaN; softplus(z) = z "
            "above the threshold 20 gives s = sqrt(z) (P2); z = 1000 next to z = 0.5 in one row",
        )
    )
    x, W = _gate([[0, 1, 2, 3, -1, -2, 0.5, 4], [6, 5, 4, 3, 2, 1, 0, -1], [-30.0, -40.0, 1, 1, 1, 1, 1, 1]])
    bias = torch.tensor([float("inf"), 0.0, 0.25, 0.0, 0.0, float("inf"), 0.0, -float("inf")])
    out.append(
        Case(
            "moe.route",
            "inf_bias_never_and_always",
            dict(x=x, gate_weight=W, bias=bias, k=3, routed_scale=2.5),
            ("x", "gate_weight", "bias"),
            tol=ROUTE_TOL,
            why="bias +inf always selects (experts 0 and 5, ties to the lower id), −inf never (expert 7, the top "
            "score of row 0); the weights are still the unbiased scores, tiny ones included (P1)",
        )
    )
    x, W = _gate(
        [
            [0, 1, 2, 3, -1, -2, 0.5, 4],
            [6, 5, 4, 3, 2, 1, 0, -1],
            [1, 2, 3, 4, 5, 6, 7, 8],
            [0.5, 0.25, 3, 1, 2, 0, 8, 7],
            [2, 2, 2, 2, 1, 1, 1, 1],
        ]
    )
    x[1, 3], x[2, 0], x[3, 1] = float("nan"), float("inf"), -float("inf")
    out.append(
        Case(
            "moe.route",
            "nonfinite_rows_checks_off",
            dict(x=x, gate_weight=W, bias=torch.tensor([0.0, 0.5, 0, 0, 0, 0, 0.25, 0]), k=2, routed_scale=1.5),
            ("x", "gate_weight", "bias"),
            tol=ROUTE_TOL,
            check_values=False,
            why="value checks off: a row whose scores are not all finite (NaN, +inf, −inf in x) gets NaN weights "
            "and the stable sort's ids (NaN keys first), never plausible numbers; the finite rows are untouched "
            "(docs/contract.md, the MoE section)",
        )
    )
    x, W = _gate(
        [
            [0, 1, 2, 3, -1, -2, 0.5, 4],
            [6, 5, 4, 3, 2, 1, 0, -1],
            [1, 2, 3, 4, 5, 6, 7, 8],
            [0.5, 0.25, 3, 1, 2, 0, 8, 7],
            [2, 2, 2, 2, 1, 1, 1, 1],
            [-1, -2, -3, -4, -5, -6, -7, -8],
        ]
    )
    out.append(
        Case(
            "moe.route",
            "gate_layer_padding_rows_int32",
            dict(
                x=x,
                gate_weight=W,
                bias=torch.tensor([0.0, 0.5, 0, 0, 0, 0, 0.25, 0]),
                k=3,
                routed_scale=1.5,
                input_ids=torch.tensor([17, -1, 3, -1, 0, 9], dtype=torch.int32),
            ),
            ("x", "gate_weight", "bias"),
            tol=ROUTE_TOL,
            why="input_ids −1 marks a padding row on a layer without a hash table too: ids −1, weights exactly 0; "
            "the other ids are not read; int32 input_ids; k = 3",
        )
    )
    return out
