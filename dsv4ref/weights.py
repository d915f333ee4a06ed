"""The decode step's configuration check and the random weights of the whole stack, the MTP draft layer's included.

Model level, as :mod:`dsv4ref.decode` and :mod:`dsv4ref.checkpoint` are: no op imports it (the ops,
:mod:`dsv4ref.mtp` included, take their weights as arguments; ``docs/layout.md``). The decode path and its
float64 dense reference read the same dict, so they must agree on its keys and shapes, and on nothing else;
the MTP draft layer's own weights are one more block drawn like the target's. The public names are
:func:`dsv4ref.decode.make_weights` (the whole stack) and :func:`dsv4ref.decode.mtp_weights` (the draft
layer alone).

The weights are random (seeded, drawn on the CPU with :func:`dsv4ref.seeded.generator`, so every
machine gets the same numbers), with the usual 1/sqrt(fan_in) scales. The KV and compressor norm
weights carry a power-of-two factor per 64-block, so the FP8 scale bytes of a cached row differ from
block to block (see ``docs/decode.md#the-weights``).
"""

from __future__ import annotations

import math

import torch

from . import validate
from .config import TINY, Config
from .device import DEVICE, HOST
from .seeded import generator

__all__ = [
    "check_config",
    "check_weights",
    "layer_ratio",
    "make_weights",
    "block_weights",
    "moe_weights",
    "mtp_weights",
    "Draw",
    "weights_to",
    "V4_FORMATS",
    "to_weight_format",
    "dequantize_weights",
]

# the Config fields the decode step reads as sizes: ints (not bool / float), >= 1 (the two counts: >= 0)
_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "head_dim",
    "rope_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "window",
    "index_heads",
    "index_head_dim",
    "index_topk",
    "hc_mult",
    "hc_sinkhorn_iters",
    "max_position",
    "kv_block",
    "window_page",
    "c4_page",
    "c128_page",
    "index_page",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)


def check_config(cfg: Config) -> Config:
    """Raise ValueError naming the offending field if ``cfg`` cannot run through this decode step.

    Returns ``cfg`` unchanged. TypeError if ``cfg`` is not a :class:`dsv4ref.config.Config`."""
    if not isinstance(cfg, Config):
        raise TypeError(f"cfg: expected a dsv4ref.config.Config, got {type(cfg).__name__}")
    for f in _INT_FIELDS:
        validate.integer(getattr(cfg, f), f"cfg.{f}", lo=1)
    for f in ("num_hash_layers", "num_nextn_predict_layers"):
        validate.integer(getattr(cfg, f), f"cfg.{f}", lo=0)
    for r in cfg.compress_ratios:
        validate.integer(r, "cfg.compress_ratios")
    validate.scalar(cfg.routed_scaling_factor, "cfg.routed_scaling_factor", lo=0.0)
    validate.scalar(cfg.swiglu_limit, "cfg.swiglu_limit")
    validate.scalar(cfg.rms_norm_eps, "cfg.rms_norm_eps", gt=0.0)
    validate.scalar(cfg.hc_eps, "cfg.hc_eps", lo=0.0)
    if len(cfg.compress_ratios) != cfg.num_layers:
        raise ValueError(f"cfg.compress_ratios: {len(cfg.compress_ratios)} entries for num_layers={cfg.num_layers}")
    bad = [r for r in cfg.compress_ratios if r not in (0, 1, 4, 128)]
    if bad:
        raise ValueError(f"cfg.compress_ratios: {bad[0]} is not one of 0 (window only), 4 (C4A), 128 (C128A)")
    if (cfg.head_dim, cfg.rope_dim, cfg.kv_block) != (512, 64, 64):
        raise ValueError(
            f"cfg.head_dim/rope_dim/kv_block: the 584-B cache format needs 512/64/64, got "
            f"{cfg.head_dim}/{cfg.rope_dim}/{cfg.kv_block}"
        )
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
    if not 1 <= cfg.num_experts_per_tok <= cfg.n_routed_experts:
        raise ValueError(
            f"cfg.num_experts_per_tok: expected 1..n_routed_experts={cfg.n_routed_experts}, got {cfg.num_experts_per_tok}"
        )
    if cfg.hidden_size % 128 or cfg.moe_intermediate_size < 16:
        raise ValueError(
            f"cfg.hidden_size / moe_intermediate_size: the MoE staging needs Hd % 128 == 0 and I >= 16, "
            f"got {cfg.hidden_size} / {cfg.moe_intermediate_size}"
        )
    if not 0 <= cfg.num_hash_layers <= cfg.num_layers or cfg.num_nextn_predict_layers not in (0, 1):
        raise ValueError(
            f"cfg.num_hash_layers / num_nextn_predict_layers: expected 0..num_layers and 0 or 1, got "
            f"{cfg.num_hash_layers} / {cfg.num_nextn_predict_layers}"
        )
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
    ``kv_norm``, ``wq_b``, ``sink`` (H,), ``wo_a`` (G, o_lora, hpg·512), ``wo_b``, ``ffn_norm``, ``moe``
    (the MoE feed-forward: ``gate_weight`` (E, Hd), ``bias`` (E,) fp32 near 8.08 or None on a hash layer,
    ``tid2eid`` (V, K) int64 with distinct ids per row on a hash layer (layers < ``num_hash_layers``) or
    None, ``w13`` (E, 2I, Hd), ``w2`` (E, Hd, I), ``shared_w13`` (2I, Hd), ``shared_w2`` (Hd, I)); ratio > 1:
    ``comp`` (the compressor: wkv, wgate, ape, norm); ratio 4: ``idx_comp``, ``idx_wq_b``, ``idx_weights``);
    ``hc_head``; ``final_norm``; ``lm_head`` (V, Hd); and, when ``cfg.num_nextn_predict_layers`` is 1,
    ``mtp`` (:func:`mtp_weights`, public as :func:`dsv4ref.decode.mtp_weights`: the draft layer's own parameters
    and its SWA-only block;
    it has no embedding or LM head of its own, the draft layer uses ``embed`` and ``lm_head``).
    Linear weights are bf16 ``[out, in]`` with std 1/sqrt(in); norms, mHC parameters, sinks and
    compressor position biases are fp32. The MoE weights of layer l come from their own generator (seed
    ``seed + 1000 + l``), the MTP's from seed ``seed + 2000``. ``seed``: an int >= 0 (TypeError /
    ValueError naming it otherwise).

    With ``cfg.weight_format == "v4"`` the same bf16 draw is then quantised into DeepSeek-V4's formats
    (:func:`to_weight_format`, :data:`V4_FORMATS`): each FP8 / FP4 weight ``k`` becomes its codes and a sibling
    ``k + "_scale"`` (float8_e8m0fnu)."""
    check_config(cfg)
    validate.integer(seed, "seed", lo=0)
    w = _draw_bf16(cfg, seed)
    if cfg.weight_format == "v4":  # quantised from the same bf16 draw: the two formats hold the same model
        w = to_weight_format(w, "v4")
    return weights_to(w, device or DEVICE)


def _draw_bf16(cfg: Config, seed: int) -> dict:
    """The whole stack's weights with every projection in bf16, on the CPU (:func:`make_weights`' draw)."""
    draw = Draw(generator(seed))
    layers = [block_weights(cfg, draw, layer_ratio(cfg, li), li, seed) for li in range(cfg.num_layers)]
    w = dict(
        embed=torch.randn(cfg.vocab_size, cfg.hidden_size, generator=draw.g, device=HOST).to(torch.bfloat16),
        layers=layers,
        hc_head=draw.mhc_params(cfg.hc_mult, cfg),
        final_norm=draw.norm_w(cfg.hidden_size),
        lm_head=draw.lin(cfg.vocab_size, cfg.hidden_size),
    )
    if cfg.num_nextn_predict_layers:
        w["mtp"] = mtp_weights(cfg, w, seed + 2000)
    return w


class Draw:
    """Seeded draws of the weight kinds of a block, in the order the caller asks for them."""

    def __init__(self, g: torch.Generator):
        self.g = g

    def lin(self, out_f: int, in_f: int, scale: float = 1.0) -> torch.Tensor:
        """bf16 ``[out_f, in_f]``, std scale/sqrt(in_f)."""
        return (torch.randn(out_f, in_f, generator=self.g, device=HOST) * (scale / math.sqrt(in_f))).to(torch.bfloat16)

    def norm_w(self, n: int, octaves: int = 0) -> torch.Tensor:
        """fp32 RMSNorm weight 1 + N(0, 0.1²); ``octaves``: a power-of-two factor per 64-block (varied FP8
        scale bytes)."""
        w = 1.0 + 0.1 * torch.randn(n, generator=self.g, device=HOST)
        if octaves:
            e = torch.randint(-octaves, octaves + 1, (n // 64,), generator=self.g, device=HOST).float()
            w = w * torch.exp2(e).repeat_interleave(64)
        return w

    def mhc_params(self, n_out: int, cfg: Config) -> dict:
        """mHC mix parameters {fn, scale, base}: a pre/post mix (n_out = M·(M+2)) or a head (n_out = M)."""
        M, Hd = cfg.hc_mult, cfg.hidden_size
        return dict(
            fn=torch.randn(n_out, M * Hd, generator=self.g, device=HOST) / math.sqrt(M * Hd),
            scale=torch.tensor([0.5, 0.5, 1.0], device=HOST) if n_out > M else torch.tensor([0.5], device=HOST),
            base=torch.cat(
                [
                    0.2 * torch.randn(2 * M, generator=self.g, device=HOST),
                    (2.0 * torch.eye(M, device=HOST) + 0.7 * torch.randn(M, M, generator=self.g, device=HOST)).flatten(),
                ]
            )
            if n_out > M
            else 0.2 * torch.randn(M, generator=self.g, device=HOST),
        )

    def compressor(self, r: int, d: int, cfg: Config) -> dict:
        coff = 2 if r == 4 else 1
        return dict(
            wkv=self.lin(coff * d, cfg.hidden_size),
            wgate=self.lin(coff * d, cfg.hidden_size),
            ape=0.5 * torch.randn(r, coff * d, generator=self.g, device=HOST),
            norm=self.norm_w(d, octaves=1 if d == cfg.head_dim else 0),
        )


def block_weights(cfg: Config, draw: Draw, r: int, layer: int, seed: int) -> dict:
    """One layer's weights (the keys of :func:`make_weights`' ``layers`` entries) for compress ratio ``r``;
    its MoE from the generator of seed ``seed + 1000 + layer``, hash-routed when layer < num_hash_layers."""
    Hd, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    L = dict(
        ratio=r,
        hc_attn=draw.mhc_params(cfg.hc_mix, cfg),
        hc_ffn=draw.mhc_params(cfg.hc_mix, cfg),
        attn_norm=draw.norm_w(Hd),
        wqkv_a=draw.lin(cfg.q_lora_rank + D, Hd),  # [W_q_a ; W_kv]: one GEMM
        q_norm=draw.norm_w(cfg.q_lora_rank),
        kv_norm=draw.norm_w(D, octaves=1),
        wq_b=draw.lin(H * D, cfg.q_lora_rank),
        sink=torch.randn(H, generator=draw.g, device=HOST),
        wo_a=torch.stack([draw.lin(cfg.o_lora_rank, cfg.heads_per_group * D) for _ in range(cfg.o_groups)]),
        wo_b=draw.lin(Hd, cfg.o_groups * cfg.o_lora_rank, scale=0.25),  # updates small next to the stream
        ffn_norm=draw.norm_w(Hd),
        moe=moe_weights(cfg, generator(seed + 1000 + layer), hash_layer=layer < cfg.num_hash_layers),
    )
    if r > 1:
        L["comp"] = draw.compressor(r, D, cfg)
    if r == 4:
        L["idx_comp"] = draw.compressor(4, cfg.index_head_dim, cfg)
        L["idx_wq_b"] = draw.lin(cfg.index_heads * cfg.index_head_dim, cfg.q_lora_rank)
        L["idx_weights"] = draw.lin(cfg.index_heads, Hd)
    return L


def moe_weights(cfg: Config, g: torch.Generator, *, hash_layer: bool) -> dict:
    """One layer's MoE feed-forward (``docs/moe.md``), drawn from ``g``: gate (E, Hd) bf16 std 1/sqrt(Hd);
    on a hash layer ``tid2eid`` (V, K) int64, K distinct experts per token, and no bias; otherwise ``bias``
    ≈ 8.08 + N(0, 0.02²) (the near-uniform bias of V4-Flash); experts and the shared expert with gate/up
    std 1/sqrt(Hd) and down std 0.25/sqrt(I) (updates small next to the residual stream). The gate/up
    pre-activations are then about N(0, 1): the ±swiglu_limit clamp is a no-op here (larger weights make
    the FFN dominate the stream, and the decode step's error budget with it: docs/mtp.md#the-teaching-weights);
    tests/test_moe.py drives the clamp with inputs over many octaves."""
    Hd, E, K, I = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size

    def w(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=HOST) * (scale / math.sqrt(shape[-1]))).to(torch.bfloat16)

    return dict(
        gate_weight=w(E, Hd),
        bias=None if hash_layer else 8.08 + 0.02 * torch.randn(E, generator=g, device=HOST),
        tid2eid=torch.stack([torch.randperm(E, generator=g, device=HOST)[:K] for _ in range(cfg.vocab_size)])
        if hash_layer
        else None,
        w13=w(E, 2 * I, Hd),
        w2=w(E, Hd, I, scale=0.25),
        shared_w13=w(2 * I, Hd),
        shared_w2=w(Hd, I, scale=0.25),
    )


def mtp_weights(cfg: Config, target_weights: dict, seed: int) -> dict:
    """The draft layer's own weights for ``cfg`` (one SWA-only block at layer index ``cfg.num_layers``), as
    :func:`make_weights` stores them under ``"mtp"``; drawn on the CPU. Public as :func:`dsv4ref.decode.mtp_weights`.

    Returns dict(``e_proj``, ``h_proj`` ``[Hd, Hd]`` bf16, ``enorm``, ``hnorm``, ``norm`` ``[Hd]`` fp32,
    ``hc_head`` {fn ``[M, M·Hd]``, scale ``[1]``, base ``[M]``}, ``block``: a layer dict of ratio 0 with a
    non-hash MoE). No embedding and no LM head: the draft layer uses the target's.

    A trained MTP approximates "the target's next token after tok_{q+1}". These random ones are built to
    do the same for the random target, whose residual stream is dominated by the current token's embedding
    (its sub-layer updates are small): ``e_proj`` = the identity, ``h_proj`` small, ``norm`` and ``hc_head``
    the target's own ``final_norm`` and ``hc_head`` perturbed by 10 % (they stay the MTP's OWN parameters,
    different from the target's). ``target_weights``: the target's weight dict (read for those two)."""
    validate.integer(seed, "seed", lo=0)
    g = generator(seed)
    draw = Draw(g)
    Hd = cfg.hidden_size
    hc = target_weights["hc_head"]

    def jitter(t):
        return t * (1.0 + 0.1 * torch.randn(t.shape, generator=g, device=HOST))

    return dict(
        e_proj=torch.eye(Hd, device=HOST).to(torch.bfloat16),
        h_proj=draw.lin(Hd, Hd, scale=0.1),
        enorm=draw.norm_w(Hd),
        hnorm=draw.norm_w(Hd),
        norm=jitter(target_weights["final_norm"].float().cpu()),
        hc_head={k: jitter(v.float().cpu()) for k, v in hc.items()},
        block=block_weights(cfg, draw, 0, cfg.num_layers, seed),
    )


def weights_to(obj, device, dtype: torch.dtype | None = None):
    """A copy of a (nested dict / list of) weights with every tensor moved to ``device`` (and, if
    ``dtype`` is given, every floating-point tensor converted to it). Non-tensors are returned as they are."""
    if isinstance(obj, torch.Tensor):  # integer tensors (tid2eid) keep their dtype
        return obj.to(device=device, dtype=dtype if dtype is not None and obj.is_floating_point() else obj.dtype)
    if isinstance(obj, dict):
        return {k: weights_to(v, device, dtype) for k, v in obj.items()}
    if isinstance(obj, list):
        return [weights_to(v, device, dtype) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------------
# V4's formats (docs/decode.md#v4s-number-formats)
# ----------------------------------------------------------------------------------------------------

#: the weights that V4's checkpoints store quantised, per place in the dict: "fp8" = e4m3 [N, K] with UE8M0
#: scales per 128x128 block [ceil(N/128), ceil(K/128)]; "fp4" = E2M1 two to a byte along K [.., N, K/2]
#: (float4_e2m1fn_x2, element 2k in the low nibble) with UE8M0 scales per 1x32 [.., N, K/32]. Everything else
#: keeps its format: wo_a and the indexer's weights_proj (idx_weights) bf16, the compressors' wkv / wgate, the
#: gate and the head bf16 (DeepSeek's model upcasts the compressors and the head to fp32 at load: the same
#: values), norms, mHC parameters, sinks, ape and the gate bias fp32.
V4_FORMATS = {
    "layer": {"wqkv_a": "fp8", "wq_b": "fp8", "wo_b": "fp8", "idx_wq_b": "fp8"},
    "moe": {"w13": "fp4", "w2": "fp4", "shared_w13": "fp8", "shared_w2": "fp8"},
    "mtp": {"e_proj": "fp8", "h_proj": "fp8"},
}


def _quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of one bf16 weight ``[.., N, K]`` through the linear op's quantisers (a leading expert
    dim is folded into N: FP4 scales are per row, so that is the same as quantising each expert)."""
    from . import linear as lin  # the op; the weights (model level) import it, never the reverse

    if fmt == "fp4":
        q, s = lin.quantize_fp4_weight(w.reshape(-1, w.shape[-1]))
        return q.view(*w.shape[:-1], -1), s.view(*w.shape[:-1], -1)
    return lin.quantize_fp8_weight(w)


def _dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values a quantised weight stands for, ``[.., N, K]`` in ``dtype`` (exact: codes × powers of two)."""
    from . import linear as lin

    if q.dtype == torch.float8_e4m3fn:
        return lin.dequantize_fp8_weight(q, s).to(dtype)
    flat = lin.dequantize_fp4_weight(q.reshape(-1, q.shape[-1]), s.reshape(-1, s.shape[-1]))
    return flat.view(*q.shape[:-1], -1).to(dtype)


def _fake_quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of :func:`_quantize` as empty tensors: shapes and dtypes only (the weight check's spec)."""
    *lead, N, K = w.shape
    if fmt == "fp4":
        return (
            torch.empty(*lead, N, K // 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
            torch.empty(*lead, N, K // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        )
    return torch.empty(N, K, dtype=torch.float8_e4m3fn), torch.empty(-(-N // 128), -(-K // 128), dtype=torch.uint8).view(
        torch.float8_e8m0fnu
    )


def to_weight_format(weights: dict, fmt: str, *, _quant=None) -> dict:
    """A copy of a bf16 weight dict (:func:`make_weights` of a ``weight_format="bf16"`` config) in ``fmt``:
    ``"bf16"`` returns it as it is; ``"v4"`` replaces each weight named in :data:`V4_FORMATS` by its codes and adds
    ``<name>_scale`` beside it. Quantised with :func:`dsv4ref.linear.quantize_fp8_weight` /
    ``quantize_fp4_weight`` (the dims must be multiples of 128 / 32). The tensors stay where they are."""
    if fmt not in ("bf16", "v4"):
        raise ValueError(f"fmt: expected 'bf16' or 'v4', got {fmt!r}")
    if fmt == "bf16":
        return weights
    quant = _quant or _quantize

    def conv(d: dict, table: dict) -> dict:
        out = dict(d)
        for k, f in table.items():
            if k in d:
                if d[k].dtype != torch.bfloat16:
                    raise TypeError(f"weights: {k!r} is {d[k].dtype}, expected bf16 (already in another format?)")
                out[k], out[k + "_scale"] = quant(d[k], f)
        return out

    def layer(L: dict) -> dict:
        out = conv(L, V4_FORMATS["layer"])
        out["moe"] = conv(L["moe"], V4_FORMATS["moe"])
        return out

    w = dict(weights, layers=[layer(L) for L in weights["layers"]])
    if "mtp" in weights:
        w["mtp"] = dict(conv(weights["mtp"], V4_FORMATS["mtp"]), block=layer(weights["mtp"]["block"]))
    return w


def dequantize_weights(weights: dict, dtype: torch.dtype | None = torch.float64) -> dict:
    """The bf16-layout dict of the same model: every quantised weight replaced by the values it stands for
    (codes × scales, exactly) and its ``_scale`` dropped. ``dtype`` given: every floating tensor in ``dtype``, on
    the CPU (float64: what the float64 reference runs, docs/decode.md#the-float64-dense-reference); None: the
    dequantised weights in bf16 (exact: an e4m3 or E2M1 value times a power of two is a bf16 value) and every
    other tensor as it is, on its device: the ``weight_format="bf16"`` dict of the same model, whose bf16 GEMMs
    then differ from V4's only by the activation formats. A bf16 dict comes back converted only."""

    def conv(d):
        if isinstance(d, list):
            return [conv(v) for v in d]
        if not isinstance(d, dict):
            return d if dtype is None else weights_to(d, "cpu", dtype)
        out = {}
        for k, v in d.items():
            if k.endswith("_scale") and k[: -len("_scale")] in d:
                continue
            s = d.get(k + "_scale")
            if isinstance(s, torch.Tensor):
                out[k] = _dequantize(v.cpu(), s.cpu(), dtype or torch.bfloat16)
                out[k] = out[k] if dtype is not None else out[k].to(v.device)
            else:
                out[k] = conv(v)
        return out

    return conv(weights)


_SPECS: dict[str, dict] = {}


def _spec(cfg: Config) -> dict:
    """The weight dict :func:`make_weights` gives for ``cfg``, as fake tensors (shapes and dtypes, no values:
    nothing is drawn or allocated), kept per config."""
    key = repr(cfg)
    if key not in _SPECS:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            w = weights_to(_draw_bf16(cfg, 0), "cpu")
            if cfg.weight_format == "v4":  # shapes and dtypes only: no quantiser runs on fake tensors
                w = to_weight_format(w, "v4", _quant=_fake_quantize)
            _SPECS[key] = w
    return _SPECS[key]


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _compare(got, want, path: str, device: torch.device) -> None:
    """``got`` against the entry ``want`` of :func:`_spec`, recursively; errors name ``path``."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise TypeError(f"{path}: expected a tensor, got {type(got).__name__}")
        if got.dtype != want.dtype:
            raise TypeError(f"{path}: expected dtype {want.dtype}, got {got.dtype}")
        if got.shape != want.shape:
            raise ValueError(
                f"{path}: expected shape {tuple(want.shape)} for this cfg, got {tuple(got.shape)} (weights of another config?)"
            )
        if not _same_device(got.device, device):
            raise ValueError(
                f"{path}: on {got.device}, the Decoder runs on {device}; move the weights there first "
                "(dsv4ref.decode.weights_to(weights, device)) or make them there "
                "(make_weights(cfg, seed, device))"
            )
    elif isinstance(want, dict):
        if not isinstance(got, dict):
            raise TypeError(f"{path}: expected a dict, got {type(got).__name__}")
        missing = [k for k in want if k not in got]
        if missing:
            raise ValueError(
                f"{path}: missing {', '.join(repr(k) for k in missing)} (expected the keys of "
                f"make_weights(cfg): {', '.join(repr(k) for k in want)})"
            )
        for k in want:
            _compare(got[k], want[k], f"{path}[{k!r}]", device)
    elif isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            n = len(got) if isinstance(got, list) else type(got).__name__
            raise ValueError(f"{path}: expected a list of {len(want)} entries (one per layer), got {n}")
        for i, (g, w) in enumerate(zip(got, want)):
            _compare(g, w, f"{path}[{i}]", device)
    elif want is None:
        if got is not None:
            raise ValueError(
                f"{path}: expected None for this cfg (a hash-routed layer has no bias, the others no "
                f"table), got {type(got).__name__}"
            )
    elif got != want:
        raise ValueError(f"{path}: expected {want!r} for this cfg, got {got!r}")


def check_weights(cfg: Config, weights, device) -> dict:
    """Raise naming the entry (``"weights['layers'][0]['moe']['w13']: ..."``) unless ``weights`` has the keys,
    shapes and dtypes :func:`make_weights` gives for ``cfg`` (TypeError: not a dict / tensor, a dtype;
    ValueError: a missing key, a shape, a list length) and every tensor on ``device`` (ValueError: weights are
    never moved silently). ``"mtp"`` may be left out (a Decoder without the draft layer). Metadata only: no
    value is read. Returns ``weights``."""
    if not isinstance(weights, dict):
        raise TypeError(f"weights: expected the dict of make_weights(cfg), got {type(weights).__name__}")
    want = _spec(check_config(cfg))
    if "mtp" not in weights:  # the draft layer's weights are optional (no speculation without them)
        want = {k: v for k, v in want.items() if k != "mtp"}
    _compare(weights, want, "weights", torch.device(device))
    return weights
