"""Weights as DeepSeek stores them: read and write safetensors checkpoints in DeepSeek-V4's layout.

The names are those of DeepSeek's ``inference/model.py`` state dict (``layers.{i}.attn.wq_a.weight`` with its
``.scale``, ``layers.{i}.ffn.experts.{j}.w1.weight``, ``embed.weight``, ``head.weight``, ``mtp.0....``); the
table, with each tensor's dtype and shape and where it lands in :func:`dsv4ref.decode.make_weights`' dict, is
``docs/checkpoint.md``. Three of our tensors are several of DeepSeek's:

* ``wqkv_a`` = ``attn.wq_a`` rows then ``attn.wkv`` rows (one GEMM here; q_lora_rank is a multiple of 128, so
  the FP8 scale rows split at the same place);
* ``moe.w13[j]`` = ``ffn.experts.{j}.w1`` rows then ``.w3`` rows, ``moe.w2[j]`` = ``ffn.experts.{j}.w2`` (and
  their ``.scale``); ``moe.shared_w13`` = ``ffn.shared_experts.w1`` then ``.w3``;
* ``wo_a`` (G, o_lora, hpg·512) = ``attn.wo_a.weight`` (G·o_lora, hpg·512).

Model level: the ops never import this module. :func:`load_checkpoint` refuses, naming the tensor, a missing
tensor, an unknown one, a wrong dtype and a wrong shape (a scale's included) before it returns anything.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch

from .config import Config
from .device import DEVICE
from .weights import _spec, check_config, layer_ratio, weights_to

__all__ = ["Entry", "checkpoint_entries", "save_checkpoint", "load_checkpoint"]

_F32_OR_BF16 = (torch.float32, torch.bfloat16)  # DeepSeek stores norms, the head and the compressors in bf16
_BYTES = (torch.float4_e2m1fn_x2, torch.float8_e8m0fnu, torch.float8_e4m3fn)


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint: its ``name``, its ``shape``, the dtypes a checkpoint may hold it in
    (``dtypes``; the first is ours), and where it lives in our dict: ``path`` (keys) and ``index`` (a tuple of
    ints / slices into that tensor, ``()`` = all of it; ``view`` = the shape of that part in our tensor)."""

    name: str
    path: tuple
    index: tuple
    shape: tuple
    dtypes: tuple
    view: tuple


def _get(w: dict, path: tuple):
    for k in path:
        w = w[k]
    return w


def _accepted(dtype: torch.dtype) -> tuple:
    """The dtypes a checkpoint tensor may have where ours has ``dtype``: exact formats only for codes and
    scales; fp32 / bf16 either way for the rest (a value that does not round-trip is refused at load)."""
    if dtype == torch.float4_e2m1fn_x2:
        return (dtype, torch.int8, torch.uint8)  # DeepSeek's HF files hold the packed codes as int8
    if dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        return (dtype,)
    if dtype == torch.int64:
        return (dtype, torch.int32)  # tid2eid is int32 in DeepSeek's model
    return (dtype,) + tuple(d for d in _F32_OR_BF16 if d != dtype)


def _block_entries(cfg: Config, spec: dict, prefix: str, path: tuple) -> list[Entry]:
    """The entries of one block (a layer, or the MTP's block) at ``prefix`` (``"layers.3."``, ``"mtp.0."``)."""
    L = _get(spec, path)
    out = []

    def add(name, key, index=(), rows=None):
        t = L[key] if isinstance(key, str) else _get(L, key)
        part = t[index] if index else t
        shape = tuple(part.shape) if rows is None else rows
        out.append(
            Entry(
                prefix + name,
                path + ((key,) if isinstance(key, str) else key),
                index,
                shape,
                _accepted(t.dtype),
                tuple(part.shape),
            )
        )

    def linear(name, key):
        add(name + ".weight", key)
        if key + "_scale" in L:
            add(name + ".scale", key + "_scale")

    for hc in ("attn", "ffn"):
        for f in ("fn", "scale", "base"):
            add(f"hc_{hc}_{f}", (f"hc_{hc}", f))
    add("attn_norm.weight", "attn_norm")
    add("ffn_norm.weight", "ffn_norm")
    q, I = cfg.q_lora_rank, cfg.moe_intermediate_size
    quant = "wqkv_a_scale" in L
    if quant and (q % 128 or I % 128):
        raise ValueError(f"cfg.q_lora_rank / moe_intermediate_size: V4's FP8 scales split at multiples of 128, got {q} / {I}")
    sq = q // 128 if quant else None
    add("attn.wq_a.weight", "wqkv_a", (slice(0, q),))
    add("attn.wkv.weight", "wqkv_a", (slice(q, None),))
    if quant:
        add("attn.wq_a.scale", "wqkv_a_scale", (slice(0, sq),))
        add("attn.wkv.scale", "wqkv_a_scale", (slice(sq, None),))
    add("attn.q_norm.weight", "q_norm")
    add("attn.kv_norm.weight", "kv_norm")
    linear("attn.wq_b", "wq_b")
    add("attn.attn_sink", "sink")
    G, o_lora, width = L["wo_a"].shape
    add("attn.wo_a.weight", "wo_a", (), rows=(G * o_lora, width))
    linear("attn.wo_b", "wo_b")
    for ck, key in (("attn.compressor.", "comp"), ("attn.indexer.compressor.", "idx_comp")):
        if key in L:
            add(ck + "wkv.weight", (key, "wkv"))
            add(ck + "wgate.weight", (key, "wgate"))
            add(ck + "ape", (key, "ape"))
            add(ck + "norm.weight", (key, "norm"))
    if "idx_wq_b" in L:
        linear("attn.indexer.wq_b", "idx_wq_b")
        add("attn.indexer.weights_proj.weight", "idx_weights")
    m = L["moe"]
    add("ffn.gate.weight", ("moe", "gate_weight"))
    if m["bias"] is not None:
        add("ffn.gate.bias", ("moe", "bias"))
    if m["tid2eid"] is not None:
        add("ffn.gate.tid2eid", ("moe", "tid2eid"))
    for j in range(m["w13"].shape[0]):
        for part, sl in (("w1", slice(0, I)), ("w3", slice(I, None))):
            add(f"ffn.experts.{j}.{part}.weight", ("moe", "w13"), (j, sl))
            if "w13_scale" in m:
                add(f"ffn.experts.{j}.{part}.scale", ("moe", "w13_scale"), (j, sl))
        add(f"ffn.experts.{j}.w2.weight", ("moe", "w2"), (j,))
        if "w2_scale" in m:
            add(f"ffn.experts.{j}.w2.scale", ("moe", "w2_scale"), (j,))
    si = I // 128 if "shared_w13_scale" in m else None
    for part, sl, ssl in (("w1", slice(0, I), slice(0, si)), ("w3", slice(I, None), slice(si, None))):
        add(f"ffn.shared_experts.{part}.weight", ("moe", "shared_w13"), (sl,))
        if "shared_w13_scale" in m:
            add(f"ffn.shared_experts.{part}.scale", ("moe", "shared_w13_scale"), (ssl,))
    add("ffn.shared_experts.w2.weight", ("moe", "shared_w2"))
    if "shared_w2_scale" in m:
        add("ffn.shared_experts.w2.scale", ("moe", "shared_w2_scale"))
    return out


def checkpoint_entries(cfg: Config) -> list[Entry]:
    """Every tensor of ``cfg``'s checkpoint in DeepSeek's layout, in order (``cfg.weight_format`` decides
    whether the projections are FP8 / FP4 with ``.scale`` tensors or bf16 without)."""
    check_config(cfg)
    spec = _spec(cfg)
    out = [
        Entry("embed.weight", ("embed",), (), tuple(spec["embed"].shape), _accepted(torch.bfloat16), tuple(spec["embed"].shape)),
    ]
    for i in range(cfg.num_layers):
        out += _block_entries(cfg, spec, f"layers.{i}.", ("layers", i))
    top = [("norm.weight", ("final_norm",)), ("head.weight", ("lm_head",))]
    top += [(f"hc_head_{f}", ("hc_head", f)) for f in ("fn", "scale", "base")]
    if "mtp" in spec:
        out += _block_entries(cfg, spec, "mtp.0.", ("mtp", "block"))
        for name, key in (("e_proj", "e_proj"), ("h_proj", "h_proj")):
            top.append((f"mtp.0.{name}.weight", ("mtp", key)))
            if key + "_scale" in spec["mtp"]:
                top.append((f"mtp.0.{name}.scale", ("mtp", key + "_scale")))
        top += [(f"mtp.0.{n}.weight", ("mtp", n)) for n in ("enorm", "hnorm", "norm")]
        top += [(f"mtp.0.hc_head_{f}", ("mtp", "hc_head", f)) for f in ("fn", "scale", "base")]
    for name, path in top:
        t = _get(spec, path)
        out.append(Entry(name, path, (), tuple(t.shape), _accepted(t.dtype), tuple(t.shape)))
    assert all(layer_ratio(cfg, i) in (0, 4, 128) for i in range(cfg.num_layers))
    return out


def save_checkpoint(weights: dict, cfg: Config, path) -> None:
    """Write ``weights`` (:func:`dsv4ref.decode.make_weights` of ``cfg``) to the safetensors file ``path`` in
    DeepSeek's layout (:func:`checkpoint_entries`): each tensor in our dtype, on the CPU, contiguous."""
    from safetensors.torch import save_file

    from .weights import check_weights

    first = weights["embed"].device
    check_weights(cfg, weights, first)
    tensors = {}
    for e in checkpoint_entries(cfg):
        t = _get(weights, e.path)
        t = t[e.index] if e.index else t
        tensors[e.name] = t.reshape(e.shape).detach().to("cpu").contiguous().clone()
    save_file(tensors, str(path), metadata={"format": "pt", "weight_format": cfg.weight_format})


def _files(path) -> list[pathlib.Path]:
    p = pathlib.Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"path: no safetensors file at {p}")
    return files


def load_checkpoint(path, cfg: Config, device=None) -> dict:
    """Read a checkpoint in DeepSeek's layout (one safetensors file, or a directory of shards) into the dict
    :func:`dsv4ref.decode.make_weights` gives for ``cfg`` (``cfg.weight_format`` says which formats to expect),
    on ``device`` (default :data:`dsv4ref.DEVICE`).

    Raises ``ValueError`` naming the tensor for a missing or unknown tensor or a wrong shape, ``TypeError`` for a
    dtype outside the accepted ones (:class:`Entry`: codes and scales exactly; fp32 / bf16 either way elsewhere,
    a float that does not round-trip to our bf16 refused as a ``ValueError``). UE8M0 scales are read as bytes,
    never converted by value."""
    from safetensors import safe_open

    entries = checkpoint_entries(cfg)
    want = {e.name: e for e in entries}
    handles = {}
    for f in _files(path):
        h = safe_open(str(f), framework="pt")
        for name in h.keys():
            if name not in want:
                raise ValueError(f"{name}: not a tensor of {cfg.name}'s checkpoint (weight_format {cfg.weight_format!r})")
            handles[name] = h
    missing = [n for n in want if n not in handles]
    if missing:
        raise ValueError(f"{missing[0]}: missing from the checkpoint ({len(missing)} tensors missing)")
    w = _materialise(_spec(cfg))  # real tensors of the spec's shapes and dtypes, filled below
    for e in entries:
        t = handles[e.name].get_tensor(e.name)
        if t.dtype not in e.dtypes:
            raise TypeError(f"{e.name}: dtype {t.dtype}, expected {' or '.join(str(d) for d in e.dtypes)}")
        if tuple(t.shape) != e.shape:
            raise ValueError(f"{e.name}: shape {tuple(t.shape)}, expected {e.shape}")
        dst = _get(w, e.path)
        if dst.dtype in _BYTES:  # codes and scales: moved as bytes, never converted by value
            dst, t = dst.view(torch.uint8), t.view(torch.uint8)
        elif t.dtype != dst.dtype:
            c = t.to(dst.dtype)
            if t.is_floating_point() and not torch.equal(c.to(t.dtype), t):
                raise ValueError(f"{e.name}: {t.dtype} values that {dst.dtype} does not hold exactly")
            t = c
        t = t.reshape(e.view)
        if e.index:
            dst[e.index] = t
        else:
            dst.copy_(t)
    return weights_to(w, device or DEVICE)


def _materialise(obj):
    """Real (uninitialised) CPU tensors with the shapes and dtypes of a fake-tensor spec."""
    if isinstance(obj, torch.Tensor):
        if obj.dtype in _BYTES:
            return torch.empty(tuple(obj.shape), dtype=torch.uint8).view(obj.dtype)
        return torch.empty(tuple(obj.shape), dtype=obj.dtype)
    if isinstance(obj, dict):
        return {k: _materialise(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_materialise(v) for v in obj]
    return obj
