"""Tolerances: every float comparison in dsv4ref names a row of :data:`TOLERANCES`, never a number.

* :data:`TOLERANCES` is the one table, each row with the reason for its figure (``docs/tolerances.md``).
* :func:`compare` returns a :class:`Report` (max abs/rel error, the tolerance used, PASS/FAIL);
  :func:`assert_close` raises with the worst mismatches listed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float
    mode: str  # "exact" | "sum" (|a-b| <= atol + rtol|b|) | "or" (abs <= atol OR rel <= rtol, FlashMLA)
    #            | "mass" (|a-b| <= atol + rtol·(|b| + mass): for weighted sums, mass = Σ_j w_j·|v_j|)
    #            | "rel_l2" (per row of the last dim: ||a-b|| <= rtol·||b|| + atol)
    cos: float | None  # max global cosine difference, or None
    why: str


TOLERANCES: dict[str, Tol] = {
    "exact": Tol(0, 0, "exact", None, "bit patterns: fp8/UE8M0 bytes, exact dequant, integer RNE bf16"),
    "fp32_elementwise": Tol(1e-5, 1e-5, "sum", None, "a few fp32 roundings (RoPE from a cos/sin table)"),
    "fp32_reduction": Tol(1e-6, 8.01 / 65536, "or", None, "only accumulation order differs (FlashMLA's LSE figure)"),
    "fp32_dot": Tol(1e-5, 1e-4, "sum", None, "ieee fp32 dot, order error ~ sqrt(K)*2^-24, K <= 512"),
    "mhc": Tol(1e-5, 1e-5, "sum", None, "docs/mhc.md: fp32 path vs an fp64 oracle of the same schedule"),
    "bf16_out": Tol(
        1e-3, 2.01 / 128, "or", 5e-6, "about 2 bf16 ulps (interpreter truncation <= 1 ulp, plus reordering); FlashMLA's figure"
    ),
    "bf16_gemm": Tol(1e-2, 1e-2, "sum", None, "bf16 GEMM with fp32 accumulation vs an fp32 reference (docs/rope.md)"),
    "lse": Tol(1e-6, 8.01 / 65536, "or", None, "FlashMLA's LSE tolerance"),
    "decode_step": Tol(
        1e-6,
        2.0**-3,
        "rel_l2",
        None,
        "a whole decode step vs the float64 dense reference, per row: the e4m3 KV error (<= 2^-4"
        " relative per value) enters attention twice, through V and through the softmax weights",
    ),
    "decode_step_v4": Tol(
        1e-6,
        2.0**-2,
        "rel_l2",
        None,
        "decode_step with V4's weight formats (the reference runs the dequantised weights on unquantised"
        " activations): the 1x128 e4m3 activation quantiser before every FP8 / FP4 GEMM is the KV's format"
        " (<= 2^-4 relative per value) and reaches attention along the same two paths, so the KV's budget"
        " 2·2^-4 once more; the logits get 2^-3 (docs/decode.md#v4s-number-formats)",
    ),
    "fp8_activations": Tol(
        1e-6,
        2.0**-3,
        "rel_l2",
        None,
        "an output behind e4m3 activation quantisers (V4's expert and MTP projections) vs the float64 oracle on"
        " the same dequantised weights, per row: each e4m3 rounding moves a value by <= 2^-4 of it (RMS"
        " 2^-4/sqrt(3)), a GEMM with independent input errors keeps that relative RMS, and up to three such"
        " roundings add in quadrature (x through the expert's gate and up, then h): 2^-4, doubled for margin"
        " (docs/moe.md#tolerance-of-the-v4-experts)",
    ),
    "bf16_weighted_sum": Tol(
        1e-6,
        2.0**-8,
        "mass",
        None,
        "out = Σ_j p_j·v_j with p rounded to bf16 (rel 2^-9 each, as FlashMLA's kernels do) and"
        " the result rounded to bf16 (2^-9): |err| <= 2^-9·Σ p|v| + 2^-9·|out|, doubled for"
        " accumulation order and exp2; an elementwise relative check fails wherever outputs cancel",
    ),
    "route_weights": Tol(
        0.0,
        1e-6,
        "sum",
        None,
        "MoE routing weights vs float64 on the same gate logits: sqrt(softplus) and a K-term"
        " normalisation in fp32 are a few ulps (6e-8 each); weights of padding rows must be exactly 0",
    ),
    "moe_out": Tol(
        1e-6,
        2.0**-8,
        "mass",
        None,
        "MoE output vs a float64 oracle without roundings: h = swiglu·ω rounded to bf16 (2^-9 of Σ|h||W2|),"
        " each expert output rounded to bf16 (<= 2^-9 of the same mass) and the result rounded to bf16"
        " (2^-9·|out|): |err| <= 2^-8·(|out| + mass), mass = Σ_slots |h|·|W2|ᵀ (+ the shared expert's)",
    ),
    "compressor": Tol(
        1e-6,
        2.0**-7 + 2.0**-14,
        "rel_l2",
        None,
        "compressed rows vs the float64 whole-sequence oracle without roundings, per row: the pooled row is"
        " rounded to bf16 before the RMSNorm (DeepSeek's order): each element moves by <= u = 2^-8 of"
        " itself, the row's rms by <= u, so the normed row by <= 2u = 2^-7 of its norm; plus the fp32 terms"
        " (the projection GEMM over K = Hd, summation-order error ≈ sqrt(K/2)·2^-24 of the row norm: 2.7e-6"
        " at Hd 4096; the softmax and the norm, a few ulps), held to 2^-14; zero rows (no boundary) must"
        " stay below 1e-6",
    ),
    "indexer_logits": Tol(
        1e-30,
        2.0**-14,
        "mass",
        None,
        "indexer scores vs the float64 oracle on the same codes, mass = Σ_h |w_out|·Σ_d |q_d·k_d|"
        "(·k_scale) (reference.logits_condition): the products are exact (e4m3 / scaled e2m1 values"
        " in bf16 or fp16); only the fp32 sums over 128 dims and n_ih <= 64 heads round, at most"
        " ~(128 + 64)·2^-24 = 1.1e-5 of the mass in any order (2^-14 leaves a 5x margin); an"
        " elementwise relative check fails wherever ReLU'd heads of opposite-sign weights cancel",
    ),
    "linear_out": Tol(
        1e-30,
        2.0**-8,
        "mass",
        None,
        "FP8 / FP4 projections (bf16 out) vs the float64 oracle of the same quantised operands, mass ="
        " Σ_i |q_i·w_i|·scales (dsv4ref.linear.reference.gemm_mass): the products are exact in fp32 (e4m3 ·"
        " e4m3 or e4m3 · E2M1 values) and the scales are powers of two, so only the fp32 sums round, at most"
        " (block + K/block)·2^-24 = 2^-16 of the mass at K = 7168 in any order (a Hopper fp8 MMA keeps a"
        " 128-term block sum in a shorter accumulator, ~14 bits by DeepSeek-V3's report: still below 2^-10"
        " of the block's mass), then the bf16 rounding, at most 2^-8·|y|: |err| <= 2^-8·(|y| + mass); a"
        " relative check alone fails wherever a row's products cancel",
    ),
    "indexer_logits_bf16": Tol(
        1e-30,
        3 * 2.0**-8,
        "mass",
        None,
        "MXFP4 indexer scores (DeepSeek's bf16 einsum: each head's dot, each product with its weight and the"
        " head sum rounded to bf16) vs the float64 oracle without roundings, mass as in indexer_logits:"
        " bf16 keeps 8 significant bits (unit roundoff u = 2^-8), so |err| <= u·|score| (the last rounding)"
        " + (2u + u^2)·Σ_h |w|·ReLU(dot) (the first two; Σ_h |w|·ReLU(dot) <= mass) + the fp32 sums"
        " (1.1e-5 of the mass) <= 3u·(|score| + mass)",
    ),
    "qnorm_rope_q": Tol(
        1e-5,
        1e-2,
        "mass",
        None,
        "q of the fused Q-norm + RoPE vs dsv4ref's form (DeepSeek's bf16 norm ops; docs/rope.md#exactness),"
        " mass = the larger |expected| of each (2i, 2i+1) pair: a port may norm in fp32 and round once, round q"
        " to bf16 after the norm and then rotate (vLLM's reference) or use rsqrt / FMA; the bf16 rounding of a pair, up to"
        " 2^-9 of its larger element, is moved by the rotation into BOTH outputs, so a small output"
        " beside a large partner is off by 2^-9·max|pair| (0.0156 seen), which no bound relative to the"
        " element itself accepts (measured worst: 0.48 of this bound; 0.77 with a bf16 table and bf16 arithmetic too)",
    ),
}


@dataclass
class Report:
    name: str
    max_abs: float
    max_rel: float
    tol: str
    passed: bool
    detail: str = ""

    def __str__(self) -> str:
        t = TOLERANCES[self.tol]
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{self.name}: {verdict} (max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}; "
            f"tolerance '{self.tol}' {t.mode} atol={t.atol:g} rtol={t.rtol:g})" + (f" {self.detail}" if self.detail else "")
        )

    def verdict(self) -> str:
        """A device-independent line for notebooks: no error magnitudes, just the verdict."""
        return f"{self.name}: {'PASS' if self.passed else 'FAIL'} (tolerance '{self.tol}')"


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8):
        return t.view(torch.uint8)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def compare(
    actual: torch.Tensor, expected: torch.Tensor, tol: str = "bf16_out", name: str = "result", mass: torch.Tensor | None = None
) -> Report:
    """Compare ``actual`` with ``expected`` (ideally float64) under the named tolerance.

    Non-finite entries must sit at the same positions with the same values (FlashMLA's rule), and are
    then excluded. Mode "or" passes an element if abs err <= atol OR rel err <= rtol; mode "sum" uses
    torch's atol + rtol·|expected|; mode "mass" uses atol + rtol·(|expected| + mass), where ``mass`` (same
    shape) is Σ_j w_j·|v_j| of a weighted sum, the scale its rounding errors grow with. A cosine bound, where
    the row has one, is checked on the whole tensor.
    """
    t = TOLERANCES[tol]
    if tuple(actual.shape) != tuple(expected.shape):
        return Report(name, math.inf, math.inf, tol, False, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a_cpu, e_cpu = actual.detach().cpu(), expected.detach().cpu()
    if t.mode == "exact":
        if a_cpu.dtype != e_cpu.dtype:
            return Report(name, math.inf, math.inf, tol, False, f"dtype {a_cpu.dtype} != {e_cpu.dtype}")
        diff = _bits(a_cpu) != _bits(e_cpu)
        n = int(diff.sum())
        err = 0.0 if n == 0 else math.inf
        return Report(name, err, err, tol, n == 0, "" if n == 0 else f"{n} of {diff.numel()} differ")
    a, e = a_cpu.double(), e_cpu.double()
    fa, fe = torch.isfinite(a), torch.isfinite(e)
    same_nonfinite = torch.equal(fa, fe) and torch.equal(a[~fa].nan_to_num(0.0, 1.0, -1.0), e[~fe].nan_to_num(0.0, 1.0, -1.0))
    if not same_nonfinite:
        return Report(name, math.inf, math.inf, tol, False, "non-finite entries differ in position or value")
    if t.mode == "mass":
        if mass is None:
            raise ValueError(f"tolerance '{tol}' needs the mass argument")
        m = mass.detach().cpu().double()[fe]
    a, e = a[fe], e[fe]
    if a.numel() == 0:
        return Report(name, 0.0, 0.0, tol, True)
    abs_err = (a - e).abs()
    rel_err = abs_err / e.abs().clamp_min(1e-300)
    if t.mode == "or":
        ok = bool(((abs_err <= t.atol) | (rel_err <= t.rtol)).all())
    elif t.mode == "mass":
        ok = bool((abs_err <= t.atol + t.rtol * (e.abs() + m)).all())
    elif t.mode == "rel_l2":
        ar, er = a_cpu.double().reshape(-1, a_cpu.shape[-1]), e_cpu.double().reshape(-1, e_cpu.shape[-1])
        ok = bool(((ar - er).norm(dim=-1) <= t.rtol * er.norm(dim=-1) + t.atol).all())
    else:
        ok = bool((abs_err <= t.atol + t.rtol * e.abs()).all())
    detail = ""
    if t.cos is not None:
        denom = float((a * a).sum() + (e * e).sum())
        cos_diff = 0.0 if denom == 0 else 1.0 - 2.0 * float((a * e).sum()) / denom
        if cos_diff > t.cos:
            ok, detail = False, f"cosine diff {cos_diff:.3g} > {t.cos:g}"
    return Report(
        name, float(abs_err.max()), float(rel_err[e.abs() > 0].max()) if bool((e.abs() > 0).any()) else 0.0, tol, ok, detail
    )


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, tol: str = "bf16_out", name: str = "result", mass: torch.Tensor | None = None
) -> Report:
    """:func:`compare`, raising AssertionError that lists the five worst elements on failure."""
    r = compare(actual, expected, tol, name, mass)
    if not r.passed:
        msg = [str(r)]
        if tuple(actual.shape) == tuple(expected.shape) and actual.numel():
            a, e = actual.detach().cpu().double().flatten(), expected.detach().cpu().double().flatten()
            err = (a - e).abs().nan_to_num(math.inf)
            if TOLERANCES[tol].mode == "exact":
                err = (_bits(actual.detach().cpu()).flatten() != _bits(expected.detach().cpu()).flatten()).double()
            for i in err.topk(min(5, err.numel())).indices.tolist():
                idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), tuple(actual.shape)))
                msg.append(f"  at {idx}: got {a[i].item()!r}, expected {e[i].item()!r}")
        raise AssertionError("\n".join(msg))
    return r
