"""The small torch pieces between the decode step's ops: bf16 activations, fp32 math."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "linear", "swiglu_clamped"]


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32 (times ``w`` if given), bf16 out."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float() if w is not None else y).to(torch.bfloat16)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 GEMM, fp32 accumulation, bf16 out."""
    return F.linear(x.to(torch.bfloat16), w)


def swiglu_clamped(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """The experts' activation (vLLM's ``SiluAndMulWithClamp``): gate = the first half of the last dim,
    clamped from above only; up = the second half, clamped both ways; returns silu(gate) · up, half the
    width of ``gate_up``, in its dtype. The MoE applies the same clamp (:func:`dsv4ref.moe.experts`)."""
    d = gate_up.shape[-1] // 2
    gate = gate_up[..., :d].clamp(max=limit)
    up = gate_up[..., d:].clamp(-limit, limit)
    return F.silu(gate) * up
