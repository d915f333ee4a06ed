"""The small torch pieces between the decode step's ops: bf16 activations, fp32 math; and ``linear``, the one
dispatch every projection goes through (by the weight's dtype, as DeepSeek's ``inference/model.py`` does)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import linear as lin

__all__ = ["rms_norm", "linear", "swiglu_clamped"]


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32 (times ``w`` if given), bf16 out."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float() if w is not None else y).to(torch.bfloat16)


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """``x [.., K] · wᵀ`` → ``[.., N]`` bf16, by the weight's dtype (docs/decode.md#v4s-number-formats):

    * float8_e4m3fn ``[N, K]`` with ``scale`` float8_e8m0fnu ``[⌈N/128⌉, ⌈K/128⌉]``: x through the 1x128 activation
      quantiser, then the FP8 GEMM (:func:`dsv4ref.linear.fp8_linear`);
    * float4_e2m1fn_x2 ``[N, K/2]`` with ``scale`` ``[N, K/32]``: the same quantiser, then the FP4 GEMM
      (:func:`dsv4ref.linear.fp4_linear`);
    * bf16 (no scale): a bf16 GEMM, fp32 accumulation."""
    if w.dtype in (torch.float8_e4m3fn, torch.float4_e2m1fn_x2):
        if scale is None:
            raise ValueError(f"scale: a {w.dtype} weight needs its scale")
        f = lin.fp8_linear if w.dtype == torch.float8_e4m3fn else lin.fp4_linear
        x2 = x.to(torch.bfloat16).reshape(-1, x.shape[-1])
        return f(x2, w, scale, backend=backend).view(*x.shape[:-1], -1)
    return F.linear(x.to(torch.bfloat16), w)


def swiglu_clamped(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """The experts' activation (vLLM's ``SiluAndMulWithClamp``): gate = the first half of the last dim,
    clamped from above only; up = the second half, clamped both ways; returns silu(gate) · up, half the
    width of ``gate_up``, in its dtype. The MoE applies the same clamp (:func:`dsv4ref.moe.experts`)."""
    d = gate_up.shape[-1] // 2
    gate = gate_up[..., :d].clamp(max=limit)
    up = gate_up[..., d:].clamp(-limit, limit)
    return F.silu(gate) * up
