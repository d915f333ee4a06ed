"""The decode step's configuration check and its random weights.

Shared by the decode path (:mod:`.model`) and the float64 dense reference (:mod:`.reference`): both
read the same weight dict, so they must agree on its keys and shapes, and on nothing else.

The weights are random (seeded, drawn on the CPU with :func:`dsv4ref.testing.generator`, so every
machine gets the same numbers), with the usual 1/sqrt(fan_in) scales. The KV and compressor norm
weights carry a power-of-two factor per 64-block, so the FP8 scale bytes of a cached row differ from
block to block (see ``docs/decode.md#the-weights``).
"""

from __future__ import annotations

import math

import torch

from ..config import TINY, Config
from ..device import DEVICE
from ..testing import generator

__all__ = ["check_config", "layer_ratio", "make_weights", "weights_to"]


def check_config(cfg: Config) -> Config:
    """Raise ValueError naming the offending field if ``cfg`` cannot run through this decode step.

    Returns ``cfg`` unchanged. TypeError if ``cfg`` is not a :class:`dsv4ref.config.Config`."""
    if not isinstance(cfg, Config):
        raise TypeError(f"cfg: expected a dsv4ref.config.Config, got {type(cfg).__name__}")
    if len(cfg.compress_ratios) != cfg.num_layers:
        raise ValueError(f"cfg.compress_ratios: {len(cfg.compress_ratios)} entries for num_layers={cfg.num_layers}")
    bad = [r for r in cfg.compress_ratios if r not in (0, 1, 4, 128)]
    if bad:
        raise ValueError(f"cfg.compress_ratios: {bad[0]} is not one of 0 (window only), 4 (C4A), 128 (C128A)")
    if (cfg.head_dim, cfg.rope_dim, cfg.kv_block) != (512, 64, 64):
        raise ValueError(f"cfg.head_dim/rope_dim/kv_block: the 584-B cache format needs 512/64/64, got "
                         f"{cfg.head_dim}/{cfg.rope_dim}/{cfg.kv_block}")
    if cfg.index_head_dim != 128:
        raise ValueError(f"cfg.index_head_dim: the indexer K format needs 128, got {cfg.index_head_dim}")
    if cfg.o_groups < 1 or cfg.num_heads % cfg.o_groups:
        raise ValueError(f"cfg.o_groups: {cfg.o_groups} does not divide num_heads={cfg.num_heads}")
    if cfg.num_heads > 128:
        raise ValueError(f"cfg.num_heads: {cfg.num_heads} > 128 is not supported")
    if cfg.window < 1:
        raise ValueError(f"cfg.window: expected >= 1, got {cfg.window}")
    if cfg.hc_mult < 1 or cfg.index_topk < 1:
        raise ValueError("cfg.hc_mult and cfg.index_topk must be >= 1")
    return cfg


def layer_ratio(cfg: Config, layer: int) -> int:
    """The compress ratio of ``layer``: 0 (window only; the config's 0 and 1 both mean that), 4 or 128."""
    r = cfg.compress_ratios[layer]
    return 0 if r <= 1 else r


def make_weights(cfg: Config = TINY, seed: int = 0, device=None) -> dict:
    """Random weights of the whole stack, drawn on the CPU with a seeded generator, moved to ``device``
    (default :data:`dsv4ref.DEVICE`).

    Returns a dict: ``embed`` (V, Hd) bf16; ``layers``: one dict per layer (``ratio``, ``hc_attn`` /
    ``hc_ffn`` mHC parameters {fn, scale, base}, ``attn_norm``, ``wqkv_a`` = [W_q_a ; W_kv], ``q_norm``,
    ``kv_norm``, ``wq_b``, ``sink`` (H,), ``wo_a`` (G, o_lora, hpg·512), ``wo_b``, ``ffn_norm``,
    ``w_gate_up``, ``w_down``; ratio > 1: ``comp`` (the compressor: wkv, wgate, ape, norm); ratio 4:
    ``idx_comp``, ``idx_wq_b``, ``idx_weights``); ``hc_head``; ``final_norm``; ``lm_head`` (V, Hd).
    Linear weights are bf16 ``[out, in]`` with std 1/sqrt(in); norms, mHC parameters, sinks and
    compressor position biases are fp32."""
    check_config(cfg)
    g = generator(seed)
    Hd, H, D, M = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.hc_mult

    def lin(out_f, in_f, scale=1.0):
        return (torch.randn(out_f, in_f, generator=g) * (scale / math.sqrt(in_f))).to(torch.bfloat16)

    def norm_w(n, octaves=0):
        w = 1.0 + 0.1 * torch.randn(n, generator=g)
        if octaves:  # a power-of-two factor per 64-block: varied FP8 scale bytes
            e = torch.randint(-octaves, octaves + 1, (n // 64,), generator=g).float()
            w = w * torch.exp2(e).repeat_interleave(64)
        return w

    def mhc_params(n_out):
        return dict(fn=torch.randn(n_out, M * Hd, generator=g) / math.sqrt(M * Hd),
                    scale=torch.tensor([0.5, 0.5, 1.0]) if n_out > M else torch.tensor([0.5]),
                    base=torch.cat([0.2 * torch.randn(2 * M, generator=g),
                                    (2.0 * torch.eye(M) + 0.7 * torch.randn(M, M, generator=g)).flatten()])
                    if n_out > M else 0.2 * torch.randn(M, generator=g))

    def compressor(r, d):
        coff = 2 if r == 4 else 1
        return dict(wkv=lin(coff * d, Hd), wgate=lin(coff * d, Hd), ape=0.5 * torch.randn(r, coff * d, generator=g),
                    norm=norm_w(d, octaves=1 if d == D else 0))

    layers = []
    for li in range(cfg.num_layers):
        r = layer_ratio(cfg, li)
        L = dict(
            ratio=r,
            hc_attn=mhc_params(cfg.hc_mix), hc_ffn=mhc_params(cfg.hc_mix),
            attn_norm=norm_w(Hd),
            wqkv_a=lin(cfg.q_lora_rank + D, Hd),  # [W_q_a ; W_kv]: one GEMM
            q_norm=norm_w(cfg.q_lora_rank), kv_norm=norm_w(D, octaves=1),
            wq_b=lin(H * D, cfg.q_lora_rank),
            sink=torch.randn(H, generator=g),
            wo_a=torch.stack([lin(cfg.o_lora_rank, cfg.heads_per_group * D) for _ in range(cfg.o_groups)]),
            wo_b=lin(Hd, cfg.o_groups * cfg.o_lora_rank, scale=0.25),  # updates small next to the stream
            ffn_norm=norm_w(Hd),
            w_gate_up=lin(2 * cfg.ffn_intermediate, Hd, scale=2.0),
            w_down=lin(Hd, cfg.ffn_intermediate, scale=0.25),
        )
        if r > 1:
            L["comp"] = compressor(r, D)
        if r == 4:
            L["idx_comp"] = compressor(4, cfg.index_head_dim)
            L["idx_wq_b"] = lin(cfg.index_heads * cfg.index_head_dim, cfg.q_lora_rank)
            L["idx_weights"] = lin(cfg.index_heads, Hd)
        layers.append(L)
    w = dict(
        embed=torch.randn(cfg.vocab_size, Hd, generator=g).to(torch.bfloat16),
        layers=layers,
        hc_head=mhc_params(M),
        final_norm=norm_w(Hd),
        lm_head=lin(cfg.vocab_size, Hd),
    )
    return weights_to(w, device or DEVICE)


def weights_to(obj, device, dtype: torch.dtype | None = None):
    """A copy of a (nested dict / list of) weights with every tensor moved to ``device`` (and, if
    ``dtype`` is given, converted to it). Non-tensors are returned as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device=device, dtype=dtype or obj.dtype)
    if isinstance(obj, dict):
        return {k: weights_to(v, device, dtype) for k, v in obj.items()}
    if isinstance(obj, list):
        return [weights_to(v, device, dtype) for v in obj]
    return obj
