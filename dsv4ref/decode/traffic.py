"""Where the bytes of a decode step go: compulsory traffic per op, as formulas (``docs/decode.md#where-the-bytes-go``;
notebook 06's stacked bar)."""

from __future__ import annotations

from ..compressor import overlap
from ..config import Config
from ..formats import FP8_K_RECORD, MXFP4_K_RECORD, TOKEN_BYTES
from ..weights import check_config, layer_ratio

__all__ = ["traffic_per_op"]


def traffic_per_op(cfg: Config, context: int) -> dict[str, float]:
    """Compulsory bytes moved per decoded token (one request, all layers) by each op of the step, at a
    context of ``context`` tokens. Returns {op name: bytes} for sparse_mla, indexer, qnorm_rope_kv_insert,
    compressor and mhc. Caches and activations only: weights are shared by the whole batch (at batch B
    each token pays weights/B) and are left out. Conventions (``docs/decode.md#where-the-bytes-go``):

    * sparse_mla: N_sel·584 (KV rows) + q and out bf16 (H·512·2 each) + lse fp32 + 4-byte slots;
      N_sel = W (+ min(K_top, n_c) on ratio-4 layers, + n_c on ratio-128 layers), n_c = context // r.
    * indexer: the logits kernel reads every visible indexer key (``cfg.index_format``: 132 B = 128 e4m3 +
      fp32 scale; 68 B = 64 packed e2m1 + 4 UE8M0) and writes one fp32 logit per key; top-k reads the logits
      and writes K_top int32; Q quant reads bf16 q (n_ih·128·2) and writes the quantised q (fp8: 128 B per
      head + fp32 weight; mxfp4: 64 B + 4 scale bytes + fp32 weight).
    * qnorm_rope_kv_insert: q read + written (bf16), kv row read (bf16), 584 B written.
    * compressor: the fp32 state (kv, score) of this token written (2·coff·D·4 B), the window's states read
      once per r tokens (amortised: coff·r·2·D·4 / r), the compressed row written once per r tokens
      (584 B; indexer keys 132 or 68 B).
    * mhc: two fused post+pre per layer, each reading and writing the M bf16 streams (M·Hd·2 B each way)
      plus reading the sub-layer output (Hd·2).
    """
    check_config(cfg)
    H, W, Hd, M = cfg.num_heads, cfg.window, cfg.hidden_size, cfg.hc_mult
    t = dict(sparse_mla=0.0, indexer=0.0, qnorm_rope_kv_insert=0.0, compressor=0.0, mhc=0.0)
    key = FP8_K_RECORD if cfg.index_format == "fp8" else MXFP4_K_RECORD  # bytes per indexer key
    q_head = 128 + 4 if cfg.index_format == "fp8" else 64 + 4 + 4  # a quantised query head + its weight
    for li in range(cfg.num_layers):
        r = layer_ratio(cfg, li)
        n_c = context // r if r else 0
        n_sel = W + (min(cfg.index_topk, n_c) if r == 4 else n_c)
        t["sparse_mla"] += n_sel * (TOKEN_BYTES + 4) + 2 * H * 512 * 2 + 4 * H
        t["qnorm_rope_kv_insert"] += 2 * H * 512 * 2 + 512 * 2 + TOKEN_BYTES
        t["mhc"] += 2 * (2 * M * Hd * 2 + Hd * 2)
        if r > 1:
            coff = overlap(r)
            for d, row in [(512, TOKEN_BYTES)] + ([(cfg.index_head_dim, key)] if r == 4 else []):
                t["compressor"] += 2 * coff * d * 4 + coff * r * 2 * d * 4 / r + row / r
        if r == 4:
            nih = cfg.index_heads
            t["indexer"] += nih * 128 * 2 + nih * q_head + n_c * (key + 4) + n_c * 4 + cfg.index_topk * 4
    return t
