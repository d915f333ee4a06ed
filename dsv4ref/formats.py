"""Every byte layout and format constant in dsv4ref, written once.

Each op imports its sizes and offsets from here; nothing else in the library repeats a layout number.
The byte maps these constants describe are drawn in ``docs/formats.md``.

FP8 e4m3fn with UE8M0 block scales
----------------------------------
A block of values shares one scale byte ``b`` meaning 2^(b − 127) (UE8M0: an unsigned 8-bit exponent,
no sign, no mantissa). Byte 255 is NaN in the E8M0 format; dsv4ref's writers emit 1..254 only.

The paged MLA KV cache (584 bytes per token)
--------------------------------------------
A token's 512-dim latent row is 448 "NoPE" dims stored as e4m3 in 7 blocks of 64 (one UE8M0 scale each)
and 64 RoPE dims stored as bf16 bit for bit. A page of ``B`` tokens is a structure of arrays::

    [0, 576·B)              token data: token t at 576·t  (448 e4m3 | 128 bytes bf16 RoPE)
    [576·B, 584·B)          scales:     token t at 576·B + 8·t  (7 UE8M0 | 1 zero pad byte)
    [584·B, page_bytes)     padding up to a multiple of 576

A slot is ``page · B + offset``; −1 means "no token".

The lightning-indexer K cache (ratio-4 compressed keys, 128 dims)
-----------------------------------------------------------------
Also a structure of arrays per page: all keys' data first, then all keys' scales.

* fp8:   132 bytes per key = 128 e4m3 + a 4-byte fp32 scale (a power of two);
* mxfp4:  68 bytes per key = 64 bytes of packed e2m1 nibbles (low nibble = even dim) + 4 UE8M0 bytes
  (one per 32 dims).
"""

from __future__ import annotations

# ---- FP8 e4m3fn + UE8M0 ------------------------------------------------------------------------------
E4M3_MAX = 448.0  # the largest finite e4m3fn value
UE8M0_BIAS = 127  # byte b means 2^(b - 127)
UE8M0_NAN = 255  # E8M0's NaN encoding
KV_AMAX_FLOOR = 1e-4  # amax is floored here before amax / 448 (the KV cache and the MoE staging)

# ---- the MLA KV cache ---------------------------------------------------------------------------------
HEAD_DIM = 512  # latent (K = V) width
NOPE_DIM = 448  # e4m3 part
ROPE_DIM = 64  # bf16 part (the last 64 dims), GPT-J interleaved pairs
QUANT_BLOCK = 64  # values per UE8M0 scale
N_SCALES = NOPE_DIM // QUANT_BLOCK  # 7
DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576 bytes of token data
SCALE_BYTES = N_SCALES + 1  # 8: 7 scales + 1 zero pad byte
TOKEN_BYTES = DATA_BYTES + SCALE_BYTES  # 584
PAGE_ALIGN = 576  # pages are padded to a multiple of this many bytes


def page_bytes(block_size: int) -> int:
    """Bytes of one KV-cache page of ``block_size`` tokens: round_up(584·B, 576). B = 64 gives 37 440."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected an int >= 1, got {block_size!r}")
    return -(-block_size * TOKEN_BYTES // PAGE_ALIGN) * PAGE_ALIGN


def token_data_offset(page_stride: int, block_size: int, slot: int) -> int:
    """Byte offset of a slot's 576 data bytes from the cache's first byte."""
    return (slot // block_size) * page_stride + (slot % block_size) * DATA_BYTES


def token_scale_offset(page_stride: int, block_size: int, slot: int) -> int:
    """Byte offset of a slot's 8 scale bytes from the cache's first byte."""
    return (slot // block_size) * page_stride + block_size * DATA_BYTES + (slot % block_size) * SCALE_BYTES


# ---- the lightning indexer ------------------------------------------------------------------------------
INDEX_HEAD_DIM = 128  # d_ih
INDEX_ROPE_DIM = 64  # the LAST 64 dims are rotated
INDEX_RATIO = 4  # compress ratio of the layers that have an indexer
FP8_K_RECORD = INDEX_HEAD_DIM + 4  # 132 bytes per key
MXFP4_K_RECORD = INDEX_HEAD_DIM // 2 + 4  # 68 bytes per key
FP4_BLOCK = 32  # values per UE8M0 scale in MXFP4
FP4_MAX = 6.0  # the largest e2m1 value
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude codes 0..7
INDEX_AMAX_FLOOR = 1e-4  # the indexer's FP8 q / k amax floor (the same as the KV cache's)
FP4_AMAX_FLOOR = FP4_MAX * 2.0**-126  # MXFP4 floor: keeps amax / 6 >= 2^-126, so every scale byte is >= 1
INDEX_K_FORMATS = ("fp8", "mxfp4")


def index_k_value_bytes(fmt: str) -> int:
    """Value bytes of one indexer key: 128 e4m3 bytes (fp8) or 64 packed e2m1 bytes (mxfp4)."""
    if fmt not in INDEX_K_FORMATS:
        raise ValueError(f"fmt: expected one of {INDEX_K_FORMATS}, got {fmt!r}")
    return INDEX_HEAD_DIM if fmt == "fp8" else INDEX_HEAD_DIM // 2


def index_k_page_bytes(block_size: int, fmt: str = "fp8") -> int:
    """Bytes of one indexer-K page of ``block_size`` keys: B·132 (fp8) or B·68 (mxfp4), no padding."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected an int >= 1, got {block_size!r}")
    return block_size * (index_k_value_bytes(fmt) + 4)


def index_k_offsets(page_stride, block_size: int, slot, fmt: str):
    """(value offset, scale offset) in bytes of a slot's key from the cache's first byte (ints or tensors).

    A page is ``[B × values][B × 4 scale bytes]``: key j's values at V·j, its scale at V·B + 4·j."""
    v = index_k_value_bytes(fmt)
    base = (slot // block_size) * page_stride
    off = slot % block_size
    return base + off * v, base + block_size * v + off * 4


# ---- the projections' block formats (docs/linear.md) ------------------------------------------------------
ACT_BLOCK = 128  # activations: one fp32 (power-of-two) scale per 1x128 block along K
ACT_AMAX_FLOOR = 1e-4  # act_quant's amax floor (DeepSeek's, the KV cache's): an all-zero block gets 2^-22
WEIGHT_BLOCK = 128  # FP8 weights: one UE8M0 byte per 128x128 tile
FP8_WEIGHT_AMAX_FLOOR = E4M3_MAX * 2.0**-126  # the smallest floor keeping amax / 448 >= 2^-126 (byte >= 1)

# ---- mHC ------------------------------------------------------------------------------------------------
HC_MULT = 4  # M residual streams

# ---- MoE input staging (docs/moe.md#staging) -------------------------------------------------------------
# Per token, each 128-value block of the hidden state gets one int32 word of four UE8M0 bytes, byte j (the
# j-th least significant) scaling the 32 values [32j, 32j + 32) of the block. Byte 3 >= 128 makes the word negative.
STAGE_BLOCK = 128  # hidden values per packed int32 scale word (the launcher rejects Hd % 128 != 0)
STAGE_GROUP = 32  # values per UE8M0 byte
STAGE_GROUPS = STAGE_BLOCK // STAGE_GROUP  # 4 bytes per word
STAGE_AMAX_FLOOR = KV_AMAX_FLOOR  # 1e-4: an all-zero group gets byte 105
