"""Conformance cases of ``moe.experts_fp4``: V4's FP4 routed experts and FP8 shared expert, on both paths
(``docs/moe.md#v4s-formats-in-the-experts``). Part of the "moe" op: :mod:`.moe` adds these cases to its own.

Every case quantises a seeded bf16 layer (Hd 128, I 128, E 4) with the linear op's weight quantisers, so the
weights' scale bytes vary from block to block; the megamoe cases carry ``moe.stage``'s bytes of x.
"""

from __future__ import annotations

import torch

from .. import linear as lin
from ..moe import MoeShape, example_inputs, reference
from ..testing import generator
from .suite import Case

OUTPUTS = {"moe.experts_fp4": lambda res, a: {"out": res}}
ARGS = (
    "x",
    "ids",
    "weights",
    "w13",
    "w13_scale",
    "w2",
    "w2_scale",
    "shared_w13",
    "shared_w13_scale",
    "shared_w2",
    "shared_w2_scale",
)


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = lin.quantize_fp4_weight(w.reshape(-1, w.shape[-1]))
    return q.view(*w.shape[:-1], -1), s.view(*w.shape[:-1], -1)


def _case(name, why, *, T, K, seed, path, E=4, tweak=None, gain=1.0, octaves=8, limit=10.0, ids_dtype=torch.int64, rows=None):
    """A seeded layer quantised to V4's formats; ``tweak(x, ids, w)`` edits the routing inputs; ``rows`` scales
    the expert weights' rows by powers of two (varied 1x32 scale bytes)."""
    shape = MoeShape(hidden=128, experts=E, k=K, intermediate=128, routed_scale=1.5, swiglu_limit=10.0, num_hash_layers=1)
    d = example_inputs(T, shape, seed=seed, octaves=octaves, weight_gain=gain, device="cpu")
    g = generator(seed + 100)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.round(torch.rand(T, K, generator=g) * 6144) / 4096  # routing weights on a 2^-12 grid, below 1.5
    x, ids, w = (d["x"], ids, w) if tweak is None else tweak(d["x"].clone(), ids.clone(), w.clone())
    w13, w2 = d["w13"], d["w2"]
    if rows is not None:
        e = torch.randint(-rows, rows + 1, (*w13.shape[:2], w13.shape[2] // 32), generator=g).float()
        w13 = (w13.float() * torch.exp2(e).repeat_interleave(32, -1)).to(torch.bfloat16)
    q13, s13 = _fp4(w13)
    q2, s2 = _fp4(w2)
    sq13, ss13 = lin.quantize_fp8_weight(d["shared_w13"])
    sq2, ss2 = lin.quantize_fp8_weight(d["shared_w2"])
    inputs = dict(
        x=x,
        ids=ids.to(ids_dtype),
        weights=w,
        w13=q13,
        w13_scale=s13,
        w2=q2,
        w2_scale=s2,
        shared_w13=sq13,
        shared_w13_scale=ss13,
        shared_w2=sq2,
        shared_w2_scale=ss2,
        swiglu_limit=limit,
        path=path,
    )
    if path == "megamoe":
        x_fp8, x_sf, _, _ = reference.stage(x, ids, w)
        inputs.update(x_fp8=x_fp8, x_sf=x_sf)
    return Case("moe.experts_fp4", name, inputs, ARGS, tol={"out": "moe_out"}, why=why)


def _minus1_duplicate(x, ids, w):
    ids[0, 1] = -1
    w[0, 1] = 1e6  # never read
    ids[1, 1] = ids[1, 0]  # the same expert twice: two slots, two contributions
    return x, ids, w


def _empty_expert(x, ids, w):
    return x, torch.where(ids == 3, 2, ids), w  # expert 3 gets no token


def cases() -> list[Case]:
    return [
        _case(
            "deepseek_1x128_bf16_gate_up",
            "DeepSeek's path: 1x128 act_quant before every GEMM, gate/up rounded to bf16 before the clamp, h to bf16",
            T=6,
            K=2,
            seed=71,
            path="deepseek",
        ),
        _case(
            "megamoe_staged_1x32_fp32_gate_up",
            "the mega path reads moe.stage's 1x32 words (byte j scales columns 32j..32j+31), keeps gate/up in fp32 "
            "and quantises h to e4m3 with 1x32 scales",
            T=6,
            K=2,
            seed=72,
            path="megamoe",
        ),
        _case(
            "minus1_slot_and_repeated_expert",
            "a −1 slot with weight 1e6 adds nothing (P9); a row naming one expert twice adds both (P10)",
            T=5,
            K=2,
            seed=73,
            path="deepseek",
            tweak=_minus1_duplicate,
        ),
        _case(
            "empty_expert_clamp_megamoe",
            "an expert with no token costs nothing; pre-activations past ±10 hit the one-sided gate clamp (P5)",
            T=7,
            K=2,
            seed=74,
            path="megamoe",
            tweak=_empty_expert,
            gain=6.0,
        ),
        _case(
            "weight_scale_octaves_x_octaves",
            "1x32 weight scales over ±6 octaves and x over 20 octaves: a scale read from the wrong block or "
            "nibbles swapped (element 2k is the LOW nibble) shows",
            T=4,
            K=2,
            seed=75,
            path="deepseek",
            octaves=20,
            rows=6,
        ),
        _case(
            "single_token_int32_ids_K1",
            "T = 1, K = 1, int32 ids: one tile, most programs past the real tiles",
            T=1,
            K=1,
            seed=76,
            path="megamoe",
            ids_dtype=torch.int32,
        ),
        _case(
            "no_clamp_limit_zero",
            "swiglu_limit 0 turns the clamp off (large pre-activations pass)",
            T=3,
            K=2,
            seed=77,
            path="deepseek",
            gain=6.0,
            limit=0.0,
        ),
    ]


def mass(case: Case) -> dict:
    """Σ over slots and the shared expert of |h|·|W2|ᵀ in float64, on the dequantised weights."""
    a = case.inputs
    deq = reference.experts  # the bf16-layout oracle, fed the dequantised weights and x itself
    from ..moe.experts_v4 import dequantize_experts

    return {
        "out": deq(
            a["x"],
            None,
            None,
            a["ids"],
            a["weights"],
            dequantize_experts(a["w13"], a["w13_scale"], torch.float64),
            dequantize_experts(a["w2"], a["w2_scale"], torch.float64),
            lin.dequantize_fp8_weight(a["shared_w13"], a["shared_w13_scale"]).double(),
            lin.dequantize_fp8_weight(a["shared_w2"], a["shared_w2_scale"]).double(),
            swiglu_limit=a["swiglu_limit"],
            dtype=torch.float64,
            mass=True,
        )
    }
