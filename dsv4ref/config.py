"""Model constants: DeepSeek-V4-Flash, DeepSeek-V4-Pro, and the small teaching config.

Facts: ``docs/config.md``. The teaching config keeps every byte format real (head dim
512 = 448 NoPE + 64 RoPE, KV quant block 64, indexer head dim 128, M = 4 streams) and shrinks only the
sizes, so a whole decode step runs in Triton's CPU interpreter in seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .formats import INDEX_K_FORMATS as INDEX_FORMATS  # the indexer formats a config may name: fp8, mxfp4

#: the weight formats a config may name (docs/decode.md#v4s-number-formats): "bf16" = every projection a bf16
#: GEMM; "v4" = DeepSeek-V4's checkpoint formats (FP8 e4m3 with 128x128 UE8M0 scales, the routed experts FP4
#: E2M1 with 1x32 UE8M0 scales, bf16 / fp32 where DeepSeek keeps them), every quantised projection fed by
#: the 1x128 activation quantiser
WEIGHT_FORMATS = ("bf16", "v4")
#: which routed-expert path runs with "v4" weights (docs/moe.md#v4s-formats-in-the-experts): "deepseek" =
#: DeepSeek's inference code (1x128 act_quant before every expert GEMM, gate/up outputs rounded to bf16);
#: "megamoe" = vLLM's mega-MoE contract (moe.stage's 1x32 FP8 input, gate/up kept in fp32)
MOE_PATHS = ("deepseek", "megamoe")


@dataclass(frozen=True)
class Config:
    name: str
    vocab_size: int
    hidden_size: int  # Hd
    num_layers: int
    compress_ratios: tuple[int, ...]  # one per layer: 0 = window only, 4 = C4A (indexer), 128 = C128A
    num_heads: int  # H (query heads; one shared latent KV head)
    head_dim: int = 512  # D = nope_dim + rope_dim, K = V
    rope_dim: int = 64  # R, the LAST 64 dims
    q_lora_rank: int = 1024
    o_groups: int = 8  # G
    o_lora_rank: int = 1024
    window: int = 128  # W, sliding window including the current token
    index_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # the indexer's Q and K format (docs/decode.md#the-indexer-format): "mxfp4" = E2M1 in blocks of 32 with
    # power-of-two scales, what DeepSeek's inference code simulates ("fp4 simulation for q and kv"); "fp8" =
    # e4m3 with one scale per 128 (vLLM's default). The V4 configs take DeepSeek's; TINY keeps "fp8".
    index_format: str = "mxfp4"
    hc_mult: int = 4  # M residual streams
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # window-only layers
    compress_rope_theta: float = 160000.0  # compressed layers, with YaRN below
    yarn: dict = field(default_factory=lambda: dict(factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0))
    max_position: int = 1048576
    kv_block: int = 64  # FP8 quant block of the KV NoPE dims (7 per token)
    window_page: int = 64  # tokens per page of the window (SWA) cache
    c4_page: int = 64  # compressed tokens per page, ratio-4 cache
    c128_page: int = 2  # compressed tokens per page, ratio-128 cache
    index_page: int = 64  # compressed tokens per page, indexer K cache
    ffn_intermediate: int = 2048
    swiglu_limit: float = 10.0
    # the MoE feed-forward (docs/moe.md) and the MTP draft layer (docs/mtp.md)
    n_routed_experts: int = 256  # E
    num_experts_per_tok: int = 6  # K
    moe_intermediate_size: int = 2048  # I, also the one shared expert's
    routed_scaling_factor: float = 1.5
    num_hash_layers: int = 3  # layers 0..n-1 route through a token -> experts table (tid2eid)
    num_nextn_predict_layers: int = 1  # MTP layers (one SWA-only block after the last layer)
    # V4's number formats in the projections (config.json "dtype": "fp8", "expert_dtype": "fp4",
    # "scale_fmt": "ue8m0"): the V4 configs take them; TINY keeps "bf16" (docs/config.md#the-teaching-config-tiny)
    weight_format: str = "v4"
    moe_path: str = "deepseek"

    def __post_init__(self):
        if self.index_format not in INDEX_FORMATS:
            raise ValueError(f"index_format: expected one of {INDEX_FORMATS}, got {self.index_format!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format: expected one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        if self.moe_path not in MOE_PATHS:
            raise ValueError(f"moe_path: expected one of {MOE_PATHS}, got {self.moe_path!r}")

    # derived ------------------------------------------------------------------------------------
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.o_groups

    @property
    def padded_heads(self) -> int:
        """Hp: FlashMLA-style kernels take 64 or 128 query heads."""
        if self.num_heads > 128:
            raise ValueError(f"num_heads={self.num_heads}: more than 128 heads are not supported")
        return 64 if self.num_heads <= 64 else 128

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def hc_mix(self) -> int:
        return self.hc_mult * (self.hc_mult + 2)

    def replace(self, **kw) -> Config:
        return dataclasses.replace(self, **kw)


def _flash_ratios() -> tuple[int, ...]:
    # 43 layers: 0, 0, then 4/128 alternating (even layers 4, odd layers 128); the MTP layer is omitted.
    return (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(2, 43))


FLASH = Config(
    name="DeepSeek-V4-Flash",
    vocab_size=129280,
    hidden_size=4096,
    num_layers=43,
    compress_ratios=_flash_ratios(),
    num_heads=64,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    index_topk=512,
)

PRO = Config(
    name="DeepSeek-V4-Pro",
    vocab_size=129280,
    hidden_size=7168,
    num_layers=61,
    compress_ratios=(128, 128) + tuple(4 if i % 2 == 0 else 128 for i in range(2, 61)),  # no window-only layer
    num_heads=128,
    q_lora_rank=1536,
    o_groups=16,
    o_lora_rank=1024,
    index_topk=1024,
    ffn_intermediate=3072,
    n_routed_experts=384,
    moe_intermediate_size=3072,
    routed_scaling_factor=2.5,
    num_hash_layers=3,
)  # every field: DeepSeek's V4-Pro config.json (docs/config.md#sources)

TINY = Config(
    name="tiny (teaching)",
    vocab_size=512,
    hidden_size=256,
    num_layers=4,
    compress_ratios=(0, 4, 128, 4),
    num_heads=16,
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=128,
    window=16,
    index_heads=8,
    index_head_dim=128,
    index_topk=16,
    max_position=4096,
    window_page=16,
    c4_page=16,
    c128_page=2,
    index_page=16,
    ffn_intermediate=512,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    num_hash_layers=1,  # docs/mtp.md
    index_format="fp8",  # why not DeepSeek's MXFP4: docs/config.md#the-teaching-config-tiny
    weight_format="bf16",  # why not V4's FP8 / FP4: docs/config.md#the-teaching-config-tiny
)

CONFIGS = {"flash": FLASH, "pro": PRO, "tiny": TINY}
