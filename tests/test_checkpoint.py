"""dsv4ref.checkpoint: weights in DeepSeek-V4's safetensors layout (docs/checkpoint.md).

A round trip through a small checkpoint the tests write (the teaching config, both weight formats; no network),
bit for bit, and the refusals: a missing, unknown, mistyped or misshapen tensor is named.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4ref import checkpoint
from dsv4ref.config import TINY
from dsv4ref.decode import make_weights

V4 = TINY.replace(weight_format="v4")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float4_e2m1fn_x2, torch.float8_e8m0fnu, torch.float8_e4m3fn) else t


def _same(a, b, path="weights"):
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert torch.equal(_bits(a.cpu()), _bits(b.cpu())), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    out = {}
    for cfg in (TINY, V4):
        w = make_weights(cfg, 0, "cpu")
        p = d / f"{cfg.weight_format}.safetensors"
        checkpoint.save_checkpoint(w, cfg, p)
        out[cfg.weight_format] = (cfg, w, p)
    return out


@pytest.mark.parametrize("fmt", ["bf16", "v4"])
def test_round_trip_is_bit_exact(written, fmt):
    cfg, w, p = written[fmt]
    _same(checkpoint.load_checkpoint(p, cfg, "cpu"), w)


def test_deepseek_names_dtypes_and_shapes(written):
    """The names and formats of DeepSeek's inference state dict, with our grouped tensors split as DeepSeek
    stores them."""
    _, w, p = written["v4"]
    t = load_file(str(p))
    I, Hd, q = V4.moe_intermediate_size, V4.hidden_size, V4.q_lora_rank
    assert t["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.1.attn.wq_a.scale"].shape == (q // 128, Hd // 128)
    assert t["layers.1.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert t["layers.1.ffn.experts.5.w3.weight"].dtype == torch.float4_e2m1fn_x2
    assert t["layers.1.ffn.experts.5.w3.weight"].shape == (I, Hd // 2)
    assert t["layers.1.ffn.experts.5.w3.scale"].shape == (I, Hd // 32)
    assert torch.equal(
        t["layers.1.ffn.experts.5.w3.weight"].view(torch.uint8), w["layers"][1]["moe"]["w13"][5, I:].view(torch.uint8)
    )
    assert torch.equal(
        t["layers.2.ffn.shared_experts.w3.weight"].view(torch.uint8), w["layers"][2]["moe"]["shared_w13"][I:].view(torch.uint8)
    )
    assert t["layers.0.attn.wo_a.weight"].shape == (V4.o_groups * V4.o_lora_rank, V4.heads_per_group * 512)
    assert t["layers.1.attn.indexer.weights_proj.weight"].dtype == torch.bfloat16
    assert t["layers.1.attn.compressor.ape"].dtype == torch.float32
    assert "layers.0.ffn.gate.tid2eid" in t and "layers.0.ffn.gate.bias" not in t  # a hash-routed layer
    assert t["mtp.0.e_proj.scale"].dtype == torch.float8_e8m0fnu and "mtp.0.hc_head_fn" in t
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn"} <= set(t)


def _rewrite(src, dst, edit):
    t = load_file(str(src))
    edit(t)
    save_file(t, str(dst))
    return dst


@pytest.mark.parametrize(
    "name, edit, err",
    [
        ("layers.2.ffn.experts.3.w2.scale", lambda t, n: t.pop(n), ValueError),  # missing
        ("layers.9.attn.wq_a.weight", lambda t, n: t.__setitem__(n, torch.zeros(2)), ValueError),  # unknown
        ("layers.1.attn.wq_b.weight", lambda t, n: t.__setitem__(n, t[n].to(torch.bfloat16)), TypeError),  # dtype
        ("layers.3.ffn.experts.0.w1.scale", lambda t, n: t.__setitem__(n, t[n][:, :-1].contiguous()), ValueError),  # shape
        ("mtp.0.h_proj.scale", lambda t, n: t.__setitem__(n, t[n].view(torch.uint8).float()), TypeError),  # scale by value
        ("head.weight", lambda t, n: t.__setitem__(n, t[n].float() * (1 + 2.0**-12)), ValueError),  # not bf16-exact
    ],
)
def test_refusals_name_the_tensor(written, tmp_path, name, edit, err):
    cfg, _, p = written["v4"]
    bad = _rewrite(p, tmp_path / "bad.safetensors", lambda t: edit(t, name))
    with pytest.raises(err, match=name.replace(".", r"\.")):
        checkpoint.load_checkpoint(bad, cfg, "cpu")


def test_shards_int8_experts_and_fp32_norms(written, tmp_path):
    """A directory of shards loads like one file; the experts' codes as int8 (DeepSeek's HF files) and bf16-exact
    fp32 copies are accepted."""
    cfg, w, p = written["v4"]
    t = load_file(str(p))
    names = sorted(t)
    for n in names:
        if n.startswith("layers.1.ffn.experts.") and n.endswith(".weight"):
            t[n] = t[n].view(torch.int8)
    t["layers.0.attn.compressor.wkv.weight" if "layers.0.attn.compressor.wkv.weight" in t else "head.weight"] = t[
        "head.weight"
    ].float()
    save_file({n: t[n] for n in names[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: t[n] for n in names[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    _same(checkpoint.load_checkpoint(tmp_path, cfg, "cpu"), w)
