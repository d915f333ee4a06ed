"""The lightning indexer of DeepSeek-V4's ratio-4 (C4A) layers: which compressed rows each query reads.

Facts: ``../shared/spec/indexer.md`` (all), ``formats.md`` §2, §4, §8, ``rope.md`` §1–§4, ``pitfalls.md``
#4 and #24–#26. A decode token at position p can see n_c = (p+1)//4 compressed rows. The indexer scores
every one of them cheaply and keeps the top K_top::

    I[t, s] = Σ_h w_out[t, h] · ReLU(⟨q_fp8[t, h], k_fp8[s]⟩) · k_scale[s]     s < (p_t + 1) // 4
            = −∞                                                           otherwise

Pieces, each with ``backend="reference"`` (plain torch) and ``backend="triton"``:

* :func:`quantize_q` — the fused indexer-Q: GPT-J RoPE on dims 64..127, bf16 round trip, optional
  Hadamard, then FP8 (one UE8M0 scale per (token, head), FOLDED into the head weights) or MXFP4
  (4 blocks of 32, scales packed into one int32, no fold). Registered as torch custom ops.
* :func:`quantize_k`, :func:`insert_k`, :func:`read_k` — the indexer K cache: SoA pages of
  ``[Bc × 128 e4m3][Bc × 4 B fp32 scale]`` (132 B/key) or ``[Bc × 64 packed e2m1][Bc × 4 UE8M0]`` (68 B/key).
* :func:`logits` — the scores above over a paged cache, −∞ beyond each token's complete windows.
* :func:`topk` — local ids of the K_top best rows, −1 padded, with the short-context shortcut;
  :func:`select` does logits + top-k, skipping the logits when the shortcut applies.
* :func:`to_global` — local ids → slots of the main compressed cache, and topk_len.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from . import validate
from .device import DEVICE, interpreting
from .fp8 import e4m3_encode_ref, pow2_ref, ue8m0_byte_ref
from .harness import BenchCase, CheckRow, bench, check
from .kv_cache import flat_bytes
from .testing import compare, generator, randn
from .tl_helpers import bf16_round, dot, e4m3_encode, inv_pow2, pow2, splat, ue8m0_byte

__all__ = [
    "HEAD_DIM", "ROPE_DIM", "FP8_RECORD", "MXFP4_RECORD", "FMTS",
    "head_weights", "rope_ref", "hadamard_ref", "prepare_q_ref", "e2m1_encode_ref", "e2m1_decode_ref",
    "quantize_q", "dequantize_q", "quantize_k", "k_page_bytes", "allocate_k_cache", "insert_k", "read_k",
    "dequantize_k", "n_compressed", "logits", "topk", "short_context_topk", "select", "to_global",
]

HEAD_DIM = 128  # d_ih
ROPE_DIM = 64  # the LAST 64 dims (64..127) are rotated, GPT-J pairs (2i, 2i+1)
RATIO = 4  # compress ratio of the layers that have an indexer
FMTS = ("fp8", "mxfp4")
FP8_RECORD = HEAD_DIM + 4  # 132 B per key: 128 e4m3 + fp32 scale 2^e
MXFP4_RECORD = HEAD_DIM // 2 + 4  # 68 B per key: 64 packed bytes + 4 UE8M0 bytes
FP8_FLOOR = 1e-4
FP4_BLOCK = 32
FP4_FLOOR = 6.0 * 2.0**-126  # keeps amax/6 >= 2^-126, so the scale byte is >= 1
FP4_MAX = 6.0
FP4_FLOOR_C = tl.constexpr(FP4_FLOOR)  # the same floor, usable inside kernels
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude codes 0..7
HAD_SCALE = 128**-0.5  # fp32(2^-3.5), applied after the 7 butterfly stages


def _fold(n_heads: int) -> float:
    """128^-0.5 · n_ih^-0.5 computed in fp64 and rounded to fp32 once (indexer.md §3), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", HEAD_DIM**-0.5 * n_heads**-0.5))[0]


def _inv_pow2_ref(byte: torch.Tensor) -> torch.Tensor:
    return ((254 - byte.to(torch.int32)) << 23).view(torch.float32)


def n_compressed(positions: torch.Tensor) -> torch.Tensor:
    """n_c(p) = (p + 1) // 4: complete ratio-4 windows visible at position p (pitfalls.md #26)."""
    return torch.div(positions.to(torch.int64) + 1, RATIO, rounding_mode="floor")


def head_weights(x: torch.Tensor, weights_proj: torch.Tensor) -> torch.Tensor:
    """The indexer head weights w = x · W_wᵀ (fp32): an unquantised linear on the attention INPUT x
    (the tensor that feeds wq_a / wkv), never on the q-LoRA latent qr (pitfalls.md #25)."""
    return x.float() @ weights_proj.float().t()


# ----------------------------------------------------------------------------------------------------
# Reference building blocks (torch)
# ----------------------------------------------------------------------------------------------------


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE on the LAST 64 dims of x ``[T, H, 128]`` fp32, at each token's position.

    cos_sin rows are ``[cos f_0..f_31 | sin f_0..f_31]`` (rope.md §2). Pairs are (64+2i, 64+2i+1)::

        x'[64+2i]   = e·c_i − o·s_i          e = x[64+2i], o = x[64+2i+1]
        x'[64+2i+1] = e·s_i + o·c_i

    Each product is rounded to fp32 before the add (no FMA); the Triton kernel is launched with
    ``enable_fp_fusion=False`` so it rounds the same way and the bytes match exactly.
    """
    cs = cos_sin[positions.long()]  # [T, 64]
    c, s = cs[:, None, :32], cs[:, None, 32:]
    e, o = x[..., 64::2], x[..., 65::2]
    out = x.clone()
    out[..., 64::2] = e * c - o * s
    out[..., 65::2] = e * s + o * c
    return out


def hadamard_ref(x: torch.Tensor) -> torch.Tensor:
    """Sylvester Hadamard over the last dim (128) as 7 butterfly stages, then × 128^-0.5 (fp32).

    Stage h (= 1, 2, …, 64) replaces each pair (a, b) at distance h inside each 2h-block by (a+b, a−b).
    H·128^-0.5 is symmetric, orthogonal and its own inverse (indexer.md §3.1).
    """
    n = x.shape[-1]
    y = x.float()
    h = 1
    while h < n:
        v = y.reshape(*y.shape[:-1], n // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(*y.shape[:-1], n)
        h *= 2
    return y * torch.tensor(HAD_SCALE, dtype=torch.float32, device=y.device)


def prepare_q_ref(index_q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                  hadamard: bool = False) -> torch.Tensor:
    """The fp32 values that get quantised: RoPE, bf16 round trip of the rotated dims, optional Hadamard."""
    x = rope_ref(index_q.float(), positions, cos_sin)
    x[..., 64:] = x[..., 64:].to(torch.bfloat16).float()  # "match reference numerics" (pitfalls.md #4)
    return hadamard_ref(x) if hadamard else x


_E2M1_MID = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # midpoints between grid values


def e2m1_encode_ref(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit E2M1 codes (uint8 0..15): saturate to ±6, round to nearest, ties to the even code.

    The magnitude code is the number of midpoints below |y|; on a midpoint between codes i and i+1 the
    even one wins. The sign is bit 3, taken from the sign bit (so −0.1 → 0b1000)."""
    mid = _E2M1_MID.to(y.device)
    a = y.float().abs().clamp(max=FP4_MAX)[..., None]
    odd = torch.arange(7, device=y.device) % 2 == 1
    code = (mid < a).sum(-1) + ((mid == a) & odd).sum(-1)
    return (code | (torch.signbit(y).to(code.dtype) << 3)).to(torch.uint8)


def e2m1_decode_ref(code: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(E2M1_GRID, device=code.device)
    c = code.long()
    v = grid[c & 7]
    return torch.where((c & 8) != 0, -v, v)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes, element 2k in the LOW nibble (formats.md §4)."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.uint8)
    return torch.stack([p & 15, p >> 4], dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def _fp8_quant_ref(x: torch.Tensor):
    """One 128-block per row: (e4m3 codes, UE8M0 byte)."""
    byte = ue8m0_byte_ref(x.abs().amax(-1), FP8_FLOOR)
    return e4m3_encode_ref(x * _inv_pow2_ref(byte)[..., None]), byte


def _fp4_quant_ref(x: torch.Tensor):
    """4 blocks of 32 per row: (packed [..., 64] uint8, scale bytes [..., 4] uint8)."""
    xb = x.reshape(*x.shape[:-1], HEAD_DIM // FP4_BLOCK, FP4_BLOCK)
    byte = ue8m0_byte_ref(xb.abs().amax(-1), FP4_FLOOR, FP4_MAX)
    codes = e2m1_encode_ref(xb * _inv_pow2_ref(byte)[..., None])
    return _pack_nibbles(codes.reshape(x.shape)), byte


# ----------------------------------------------------------------------------------------------------
# Triton: the fused quantiser (indexer Q, indexer K, and the paged K writer share it)
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _butterfly(x, ROWS: tl.constexpr, N: tl.constexpr, HALF: tl.constexpr):
    """One Hadamard stage on each row of x [ROWS, N]: pairs (a, b) at distance HALF -> (a+b, a−b)."""
    y = tl.permute(tl.reshape(x, (ROWS, N // (2 * HALF), 2, HALF)), (0, 1, 3, 2))
    a, b = tl.split(y)
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(y, (ROWS, N))


@triton.jit
def _hadamard128(x, ROWS: tl.constexpr, had_scale):
    x = _butterfly(x, ROWS, 128, 1)
    x = _butterfly(x, ROWS, 128, 2)
    x = _butterfly(x, ROWS, 128, 4)
    x = _butterfly(x, ROWS, 128, 8)
    x = _butterfly(x, ROWS, 128, 16)
    x = _butterfly(x, ROWS, 128, 32)
    x = _butterfly(x, ROWS, 128, 64)
    return x * had_scale


@triton.jit
def _e2m1_codes(y):
    """fp32 -> int32 E2M1 codes: clamp ±6, RNE by grid-snap (spacing 0.5 below 2, 1 below 4, 2 above)."""
    a = tl.minimum(tl.abs(y), 6.0)
    c = tl.where(a < 2.0, 4194304.0, tl.where(a < 4.0, 8388608.0, 16777216.0))  # 2^22, 2^23, 2^24
    v = (a + c) - c  # the fp32 adder rounds half-to-even onto the grid; even multiple = even code
    code = tl.where(v < 2.0, v * 2.0, tl.where(v < 4.0, v + 2.0, v * 0.5 + 4.0)).to(tl.int32)
    neg = (y.to(tl.int32, bitcast=True) < 0).to(tl.int32)  # sign bit: −0.1 → 0b1000
    return code | (neg << 3)


@triton.jit
def _e2m1_value(code):
    """int32 E2M1 code -> fp32 value, from bits (exact)."""
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)  # (1 + m/2)·2^(e-1)
    v = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _quant_kernel(
    x_ptr,  # int16 view of bf16 rows [n_rows, 128] (contiguous); row r = t·H + h
    pos_ptr,  # int64 [T] positions (ROPE only)
    cs_ptr,  # fp32 [max_pos, 64] cos/sin table (ROPE only)
    w_ptr,  # fp32 [n_rows] head weights (HAS_W only)
    slot_ptr,  # int64 [n_rows] destination slots, −1 = skip (PAGED only)
    q_ptr,  # uint8 destination of the codes (128 e4m3 bytes or 64 packed bytes per row)
    s_ptr,  # scale destination: fp32 2^e (FP8) or uint8 bytes (FP4, 4 per row)
    wo_ptr,  # fp32 [n_rows] folded weights (HAS_W only)
    n_rows,
    H,  # heads per token (row r belongs to token r // H)
    block_size,  # rows per page (1 when not PAGED)
    q_page_stride,  # elements of q_ptr per page
    s_page_stride,  # elements of s_ptr per page
    fold,  # fp32: 128^-0.5 · H^-0.5
    had_scale,  # fp32: 128^-0.5
    ROWS: tl.constexpr,
    ROPE: tl.constexpr,
    HADAMARD: tl.constexpr,
    FP4: tl.constexpr,
    HAS_W: tl.constexpr,
    PAGED: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, 128)
    row_ok = rows < n_rows
    ok = row_ok[:, None] & (d[None, :] >= 0)
    src = x_ptr + rows[:, None] * 128 + d[None, :]
    # bf16 -> fp32 exactly, in integers (tooling.md I3/I4)
    x = ((tl.load(src, mask=ok, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    if ROPE:
        rot = (d >= 64)[None, :] & ok
        # the pair partner of dim d is d ^ 1; load it again rather than shuffling registers
        xp = ((tl.load(x_ptr + rows[:, None] * 128 + (d[None, :] ^ 1), mask=rot, other=0).to(tl.int32) & 0xFFFF)
              << 16).to(tl.float32, bitcast=True)
        pos = tl.load(pos_ptr + rows // H, mask=row_ok, other=0).to(tl.int64)
        i = tl.maximum(d - 64, 0) >> 1
        c = tl.load(cs_ptr + pos[:, None] * 64 + i[None, :], mask=rot, other=1.0)
        s = tl.load(cs_ptr + pos[:, None] * 64 + 32 + i[None, :], mask=rot, other=0.0)
        even = (d & 1) == 0
        r_even = x * c - xp * s  # e·c − o·s   (x = e, xp = o)
        r_odd = xp * s + x * c  # e·s + o·c   (xp = e, x = o): same products, same order of the add
        x = tl.where(rot, tl.where(even[None, :], r_even, r_odd), x)
        x = bf16_round(x)  # the bf16 round trip (identity on dims 0..63, which are bf16 already)
    if HADAMARD:
        x = _hadamard128(x, ROWS, had_scale)

    if PAGED:
        slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
        row_ok = row_ok & (slot >= 0)
        slot = tl.maximum(slot, 0)
    else:
        slot = rows
    page = slot // block_size
    off = slot % block_size

    if FP4:
        xb = tl.reshape(x, (ROWS, 4, 32))
        byte = ue8m0_byte(tl.max(tl.abs(xb), axis=2), FP4_FLOOR_C, 6.0)  # FLOOR 6·2^-126; [ROWS, 4]
        codes = tl.reshape(_e2m1_codes(xb * inv_pow2(byte)[:, :, None]), (ROWS, 64, 2))
        lo, hi = tl.split(codes)
        j = tl.arange(0, 64)
        qdst = q_ptr + page[:, None] * q_page_stride + off[:, None] * 64 + j[None, :]
        tl.store(qdst, (lo | (hi << 4)).to(tl.uint8), mask=row_ok[:, None] & (j[None, :] >= 0))
        b = tl.arange(0, 4)
        sdst = s_ptr + page[:, None] * s_page_stride + off[:, None] * 4 + b[None, :]
        tl.store(sdst, byte.to(tl.uint8), mask=row_ok[:, None] & (b[None, :] >= 0))
        if HAS_W:
            w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
            tl.store(wo_ptr + rows, w * fold, mask=row_ok)  # no q-scale fold in MXFP4
    else:
        byte = ue8m0_byte(tl.max(tl.abs(x), axis=1), 1e-4, 448.0)  # [ROWS]
        q = e4m3_encode(x * inv_pow2(byte)[:, None])  # × 2^-e is exact
        qdst = q_ptr + page[:, None] * q_page_stride + off[:, None] * 128 + d[None, :]
        tl.store(qdst, q.to(tl.uint8, bitcast=True), mask=row_ok[:, None] & (d[None, :] >= 0))
        if HAS_W:
            w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
            tl.store(wo_ptr + rows, (w * pow2(byte)) * fold, mask=row_ok)  # w·2^e exact, then one rounding
        else:
            tl.store(s_ptr + page * s_page_stride + off, pow2(byte), mask=row_ok)  # K: the fp32 scale 2^e


_QROWS = 16


def _launch_quant(x16, rows, *, positions=None, cos_sin=None, weights=None, H=1, fp4=False, hadamard=False,
                  q_out, s_out, wo_out=None, slots=None, block_size=1, q_page_stride=None, s_page_stride=None):
    if rows == 0:
        return
    rope = positions is not None
    dummy_f = q_out  # never dereferenced when its constexpr switch is off
    _quant_kernel[(triton.cdiv(rows, _QROWS),)](
        x16, positions if rope else dummy_f, cos_sin if rope else dummy_f,
        weights if weights is not None else dummy_f, slots if slots is not None else dummy_f,
        q_out, s_out, wo_out if wo_out is not None else dummy_f,
        rows, H, block_size,
        q_page_stride if q_page_stride is not None else (64 if fp4 else 128),
        s_page_stride if s_page_stride is not None else (4 if fp4 else 1),
        _fold(H), HAD_SCALE,
        ROWS=_QROWS, ROPE=rope, HADAMARD=hadamard, FP4=fp4, HAS_W=weights is not None, PAGED=slots is not None,
        enable_fp_fusion=False,  # RoPE products rounded separately, as in the torch reference
    )


# ----------------------------------------------------------------------------------------------------
# quantize_q: custom ops + public API
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("dsv4ref::indexer_q_fp8", mutates_args=())
def _q_fp8_op(index_q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, weights: torch.Tensor,
              hadamard: bool) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, _ = index_q.shape
    q = torch.empty(T, H, HEAD_DIM, dtype=torch.uint8, device=index_q.device)
    wo = torch.empty(T, H, dtype=torch.float32, device=index_q.device)
    _launch_quant(index_q.contiguous().view(torch.int16), T * H, positions=positions.to(torch.int64).contiguous(),
                  cos_sin=cos_sin.contiguous(), weights=weights.float().contiguous(), H=H, hadamard=hadamard,
                  q_out=q, s_out=wo, wo_out=wo)
    return q, wo


@_q_fp8_op.register_fake
def _(index_q, positions, cos_sin, weights, hadamard):
    T, H, _ = index_q.shape
    return index_q.new_empty(T, H, HEAD_DIM, dtype=torch.uint8), index_q.new_empty(T, H, dtype=torch.float32)


@torch.library.custom_op("dsv4ref::indexer_q_mxfp4", mutates_args=())
def _q_mxfp4_op(index_q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, weights: torch.Tensor,
                hadamard: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, H, _ = index_q.shape
    q = torch.empty(T, H, HEAD_DIM // 2, dtype=torch.uint8, device=index_q.device)
    sc = torch.empty(T, H, 4, dtype=torch.uint8, device=index_q.device)
    wo = torch.empty(T, H, dtype=torch.float32, device=index_q.device)
    _launch_quant(index_q.contiguous().view(torch.int16), T * H, positions=positions.to(torch.int64).contiguous(),
                  cos_sin=cos_sin.contiguous(), weights=weights.float().contiguous(), H=H, fp4=True,
                  hadamard=hadamard, q_out=q, s_out=sc, wo_out=wo)
    return q, sc.view(torch.int32).reshape(T, H), wo


@_q_mxfp4_op.register_fake
def _(index_q, positions, cos_sin, weights, hadamard):
    T, H, _ = index_q.shape
    return (index_q.new_empty(T, H, HEAD_DIM // 2, dtype=torch.uint8), index_q.new_empty(T, H, dtype=torch.int32),
            index_q.new_empty(T, H, dtype=torch.float32))


def _check_fmt(fmt: str) -> str:
    if fmt not in FMTS:
        raise ValueError(f"fmt: expected one of {FMTS}, got {fmt!r}")
    return fmt


def _checking_values() -> bool:
    """Value checks read tensors (a sync, and a graph break under torch.compile): skip them when compiling."""
    return not torch.compiler.is_compiling()


def quantize_q(index_q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, weights: torch.Tensor, *,
               fmt: str = "fp8", hadamard: bool = False, backend: str = "triton"):
    """The fused indexer-Q: RoPE + bf16 round trip (+ Hadamard) + FP8 or MXFP4 quantisation + weight fold.

    Args:
        index_q: ``[T, n_ih, 128]`` bf16, the indexer queries ``wq_b(qr)`` before RoPE.
        positions: ``[T]`` int64 (or int32) absolute positions, each < ``cos_sin.shape[0]``.
        cos_sin: ``[max_pos, 64]`` fp32, rows ``[cos 0..31 | sin 0..31]`` (the layer's table).
        weights: ``[T, n_ih]`` fp32 or bf16 head weights, from ``weights_proj(x)`` (see :func:`head_weights`).
        fmt: ``"fp8"`` or ``"mxfp4"``.
        hadamard: rotate by H_128·128^-0.5 before quantising (the K side must match, pitfalls.md #24).
    Returns:
        fp8: ``(q [T, n_ih, 128] float8_e4m3fn, None, weights_out [T, n_ih] fp32)`` where
        ``weights_out = w · 2^e · 128^-0.5 · n_ih^-0.5`` carries the per-(token, head) q scale 2^e.
        mxfp4: ``(q [T, n_ih, 64] uint8 packed (low nibble = even dim), scales [T, n_ih] int32 (4 UE8M0
        bytes, block 0 in the low byte), weights_out = w · 128^-0.5 · n_ih^-0.5)`` with no fold.
    """
    validate.backend(backend)
    _check_fmt(fmt)
    validate.tensor(index_q, "index_q", dtype=torch.bfloat16, ndim=3)
    T, H, D = index_q.shape
    if D != HEAD_DIM:
        raise ValueError(f"index_q: expected head dim {HEAD_DIM} (shape [T, n_ih, 128]), got shape {tuple(index_q.shape)}")
    validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32), shape=(T,))
    validate.tensor(cos_sin, "cos_sin", dtype=torch.float32, shape=(None, ROPE_DIM))
    validate.tensor(weights, "weights", dtype=(torch.float32, torch.bfloat16), shape=(T, H))
    validate.same_device(index_q=index_q, positions=positions, cos_sin=cos_sin, weights=weights)
    if _checking_values():
        validate.index_range(positions, "positions", cos_sin.shape[0], allow_minus_one=False)
    if backend == "reference":
        x = prepare_q_ref(index_q, positions, cos_sin, hadamard)
        fold = torch.tensor(_fold(H), dtype=torch.float32, device=x.device)
        if fmt == "fp8":
            q, byte = _fp8_quant_ref(x)
            return q, None, (weights.float() * pow2_ref(byte)) * fold
        packed, byte = _fp4_quant_ref(x)
        return packed, byte.contiguous().view(torch.int32).reshape(T, H), weights.float() * fold
    if fmt == "fp8":
        q, wo = torch.ops.dsv4ref.indexer_q_fp8(index_q, positions, cos_sin, weights, hadamard)
        return q.view(torch.float8_e4m3fn), None, wo
    return torch.ops.dsv4ref.indexer_q_mxfp4(index_q, positions, cos_sin, weights, hadamard)


def dequantize_q(q: torch.Tensor, q_scales: torch.Tensor | None) -> torch.Tensor:
    """The values the logits see, fp32: e4m3 codes (FP8, the scale lives in the weights) or
    e2m1 codes × 2^(byte−127) per 32-block (MXFP4). Exact."""
    if q_scales is None:
        return q.float()
    codes = e2m1_decode_ref(_unpack_nibbles(q))  # [T, H, 128]
    byte = q_scales.contiguous().view(torch.uint8).reshape(*q_scales.shape, 4)
    return (codes.reshape(*codes.shape[:-1], 4, FP4_BLOCK) * pow2_ref(byte)[..., None]).reshape(codes.shape)


# ----------------------------------------------------------------------------------------------------
# Indexer K: quantise, paged cache writer and reader
# ----------------------------------------------------------------------------------------------------


def _check_k(k: torch.Tensor) -> None:
    validate.tensor(k, "k", dtype=torch.bfloat16, ndim=2)
    if k.shape[1] != HEAD_DIM:
        raise ValueError(f"k: expected shape [N, {HEAD_DIM}], got {tuple(k.shape)}")


def quantize_k(k: torch.Tensor, *, fmt: str = "fp8", hadamard: bool = False, backend: str = "triton"):
    """Quantise indexer keys ``k [N, 128]`` bf16 (already RoPE'd at (p//4)·4 and bf16-rounded).

    Returns fp8: ``(k [N, 128] float8_e4m3fn, scale [N] fp32 = 2^e)``;
    mxfp4: ``(packed [N, 64] uint8, scale bytes [N, 4] uint8)``.
    ``hadamard`` rotates (in fp32) before quantising; it must match the Q side."""
    validate.backend(backend)
    _check_fmt(fmt)
    _check_k(k)
    if backend == "reference":
        x = hadamard_ref(k.float()) if hadamard else k.float()
        if fmt == "fp8":
            q, byte = _fp8_quant_ref(x)
            return q, pow2_ref(byte)
        return _fp4_quant_ref(x)
    N = k.shape[0]
    fp4 = fmt == "mxfp4"
    q = torch.empty(N, HEAD_DIM // 2 if fp4 else HEAD_DIM, dtype=torch.uint8, device=k.device)
    s = torch.empty((N, 4) if fp4 else (N,), dtype=torch.uint8 if fp4 else torch.float32, device=k.device)
    _launch_quant(k.contiguous().view(torch.int16), N, fp4=fp4, hadamard=hadamard, q_out=q, s_out=s)
    return (q, s) if fp4 else (q.view(torch.float8_e4m3fn), s)


def _record(fmt: str) -> int:
    return FP8_RECORD if fmt == "fp8" else MXFP4_RECORD


def k_page_bytes(block_size: int, fmt: str = "fp8") -> int:
    """Bytes of one indexer-K page: ``block_size · 132`` (fp8) or ``· 68`` (mxfp4). No extra padding."""
    _check_fmt(fmt)
    if block_size < 1:
        raise ValueError(f"block_size: expected >= 1, got {block_size}")
    return block_size * _record(fmt)


def allocate_k_cache(num_blocks: int, block_size: int = 64, fmt: str = "fp8", device=None) -> torch.Tensor:
    """A zeroed indexer-K cache, uint8 ``[num_blocks, k_page_bytes(block_size, fmt)]``."""
    return torch.zeros(num_blocks, k_page_bytes(block_size, fmt), dtype=torch.uint8, device=device or DEVICE)


def _check_k_cache(cache: torch.Tensor, block_size: int, fmt: str) -> None:
    validate.tensor(cache, "k_cache", dtype=torch.uint8, ndim=2)
    if block_size < 1:
        raise ValueError(f"block_size: expected >= 1, got {block_size}")
    need = k_page_bytes(block_size, fmt)
    if cache.shape[1] < need:
        raise ValueError(f"k_cache: pages of {cache.shape[1]} bytes cannot hold block_size={block_size} {fmt} keys "
                         f"({need} bytes needed)")
    if cache.stride(1) != 1 or cache.stride(0) < cache.shape[1] or cache.stride(0) % 4:
        raise ValueError(f"k_cache: pages must be contiguous bytes with a stride that is a multiple of 4 "
                         f"(strides {cache.stride()})")


def _k_offsets(cache, slots, block_size, fmt):
    """int64 byte offsets (values start, scale start) of each slot in ``flat_bytes(cache)``."""
    slots = slots.to(torch.int64)
    vb = HEAD_DIM if fmt == "fp8" else HEAD_DIM // 2
    page, off = slots // block_size, slots % block_size
    base = page * cache.stride(0)
    return base + off * vb, base + block_size * vb + off * 4


def insert_k(k_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, *, block_size: int = 64,
             fmt: str = "fp8", hadamard: bool = False, backend: str = "triton") -> None:
    """Quantise rows of ``k`` and write them at ``slot_mapping`` (−1 = skip) into the SoA pages, in place.

    Page layout (formats.md §8), Bc = block_size::

        fp8:   [Bc × 128 e4m3 bytes][Bc × 4 bytes fp32 scale 2^e]     key j: values at 128·j, scale at 128·Bc + 4·j
        mxfp4: [Bc × 64 packed bytes][Bc × 4 UE8M0 bytes]             key j: values at 64·j,  scales at 64·Bc + 4·j
    """
    validate.backend(backend)
    _check_fmt(fmt)
    _check_k_cache(k_cache, block_size, fmt)
    _check_k(k)
    validate.tensor(slot_mapping, "slot_mapping", dtype=(torch.int64, torch.int32), ndim=1)
    validate.same_device(k_cache=k_cache, k=k, slot_mapping=slot_mapping)
    if slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(f"slot_mapping: has {slot_mapping.shape[0]} entries but k only {k.shape[0]} rows")
    validate.index_range(slot_mapping, "slot_mapping", k_cache.shape[0] * block_size)
    n = slot_mapping.shape[0]
    if backend == "reference":
        keep = slot_mapping >= 0
        q, s = quantize_k(k[:n][keep], fmt=fmt, hadamard=hadamard, backend="reference")
        vals, scales = _k_offsets(k_cache, slot_mapping[keep], block_size, fmt)
        flat = flat_bytes(k_cache)
        dev = k_cache.device
        flat[vals[:, None] + torch.arange(q.shape[1], device=dev)] = q.view(torch.uint8)
        flat[scales[:, None] + torch.arange(4, device=dev)] = s.contiguous().view(torch.uint8).reshape(-1, 4)
        return
    fp4 = fmt == "mxfp4"
    vb = HEAD_DIM // 2 if fp4 else HEAD_DIM
    flat = flat_bytes(k_cache)
    stride = k_cache.stride(0)
    s_region = flat[block_size * vb:] if flat.numel() > block_size * vb else flat
    s_out = s_region if fp4 else s_region[: (s_region.numel() // 4) * 4].view(torch.float32)
    _launch_quant(k.contiguous().view(torch.int16), n, fp4=fp4, hadamard=hadamard, q_out=flat, s_out=s_out,
                  slots=slot_mapping.to(torch.int64).contiguous(), block_size=block_size, q_page_stride=stride,
                  s_page_stride=stride if fp4 else stride // 4)


def read_k(k_cache: torch.Tensor, slots: torch.Tensor, *, block_size: int = 64, fmt: str = "fp8"):
    """Read records back (a byte gather; torch only). Returns what :func:`quantize_k` returns for those
    rows: fp8 ``(k [S, 128] float8_e4m3fn, scale [S] fp32)``, mxfp4 ``(packed [S, 64], bytes [S, 4])``.
    Slots −1 give zero records."""
    _check_fmt(fmt)
    _check_k_cache(k_cache, block_size, fmt)
    validate.tensor(slots, "slots", dtype=(torch.int64, torch.int32), ndim=1)
    validate.index_range(slots, "slots", k_cache.shape[0] * block_size)
    keep = slots >= 0
    vb = HEAD_DIM if fmt == "fp8" else HEAD_DIM // 2
    dev = k_cache.device
    vals = torch.zeros(slots.shape[0], vb, dtype=torch.uint8, device=dev)
    sc = torch.zeros(slots.shape[0], 4, dtype=torch.uint8, device=dev)
    v_off, s_off = _k_offsets(k_cache, slots[keep], block_size, fmt)
    flat = flat_bytes(k_cache)
    vals[keep] = flat[v_off[:, None] + torch.arange(vb, device=dev)]
    sc[keep] = flat[s_off[:, None] + torch.arange(4, device=dev)]
    if fmt == "fp8":
        return vals.view(torch.float8_e4m3fn), sc.view(torch.float32).reshape(-1)
    return vals, sc


def dequantize_k(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 key values as the logits use them: e4m3 codes (fp8; the fp32 scale is applied after the
    head sum) or e2m1 codes × 2^(byte−127) per 32-block (mxfp4)."""
    if values.dtype == torch.float8_e4m3fn:
        return values.float()
    codes = e2m1_decode_ref(_unpack_nibbles(values))
    return (codes.reshape(*codes.shape[:-1], 4, FP4_BLOCK) * pow2_ref(scales)[..., None]).reshape(codes.shape)


# ----------------------------------------------------------------------------------------------------
# logits
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _logits_kernel(
    q_ptr,  # uint8 [T, H, 128] e4m3 bytes (FP8) or [T, H, 64] packed e2m1 (FP4), contiguous
    qs_ptr,  # uint8 [T, H, 4] UE8M0 bytes (FP4 only)
    w_ptr,  # fp32 [T, H] weights_out
    cache_ptr,  # uint8 indexer-K pages (page p at p·page_stride bytes)
    cache_f32_ptr,  # the same bytes viewed as fp32 (FP8 scales)
    bt_ptr,  # int32 [T, bt_stride] per-token block table (the token's request row)
    pos_ptr,  # int64 [T]
    out_ptr,  # fp32 [T, n_out]
    n_out,
    bt_stride,
    page_stride,  # bytes per page (a multiple of 4)
    H,
    HP: tl.constexpr,  # H padded to a power of two >= 16 (tl.dot needs M, N >= 16)
    BC: tl.constexpr,  # keys per page (power of two >= 16)
    PAGES: tl.constexpr,  # pages per program
    FP4: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tl.static_assert(BC >= 16)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)
    d = tl.arange(0, 128)
    j = tl.arange(0, BC)
    hmask = h < H
    n_c = (tl.load(pos_ptr + t).to(tl.int64) + 1) // 4
    w = tl.load(w_ptr + t * H + h, mask=hmask, other=0.0)  # padded heads weigh 0

    # the token's queries, transposed to [128, HP] (the B operand), loaded once
    if FP4:
        pb = tl.arange(0, 64)
        qb = tl.load(q_ptr + (t * H + h[:, None]) * 64 + pb[None, :], mask=hmask[:, None], other=0).to(tl.int32)
        qc = tl.reshape(tl.join(qb & 15, qb >> 4), (HP, 128))  # low nibble = even dim
        qsb = tl.load(qs_ptr + (t * H + h[:, None]) * 4 + tl.arange(0, 4)[None, :], mask=hmask[:, None],
                      other=127).to(tl.int32)
        qv = tl.reshape(tl.reshape(_e2m1_value(qc), (HP, 4, 32)) * pow2(qsb)[:, :, None], (HP, 128))
    else:
        qv = tl.load(q_ptr + (t * H + h[:, None]) * 128 + d[None, :], mask=hmask[:, None], other=0)
        qv = qv.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if DOT_FP32:
        qT = tl.trans(qv)
    else:
        qT = tl.trans(qv.to(tl.bfloat16))  # e4m3 and scaled e2m1 values are exact in bf16

    for p in range(PAGES):
        blk = tl.program_id(1).to(tl.int64) * PAGES + p
        cols = blk * BC + j  # local compressed ids of this page
        live = cols < n_c
        page = tl.load(bt_ptr + t * bt_stride + blk, mask=blk * BC < n_c, other=0).to(tl.int64)
        base = page * page_stride
        if FP4:
            kb = tl.load(cache_ptr + base + j[:, None] * 64 + tl.arange(0, 64)[None, :], mask=live[:, None],
                         other=0).to(tl.int32)
            kc = tl.reshape(tl.join(kb & 15, kb >> 4), (BC, 128))
            ksb = tl.load(cache_ptr + base + BC * 64 + j[:, None] * 4 + tl.arange(0, 4)[None, :],
                          mask=live[:, None], other=127).to(tl.int32)
            kv = tl.reshape(tl.reshape(_e2m1_value(kc), (BC, 4, 32)) * pow2(ksb)[:, :, None], (BC, 128))
            kscale = tl.full((BC,), 1.0, tl.float32)
        else:
            kv = tl.load(cache_ptr + base + j[:, None] * 128 + d[None, :], mask=live[:, None], other=0)
            kv = kv.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            kscale = tl.load(cache_f32_ptr + base // 4 + BC * 32 + j, mask=live, other=1.0)
        if not DOT_FP32:
            kv = kv.to(tl.bfloat16)
        s = dot(kv, qT, tl.zeros((BC, HP), tl.float32), DOT_FP32)  # [BC, HP] = ⟨k_s, q_h⟩
        s = tl.maximum(s, 0.0) * w[None, :]  # ReLU per head, BEFORE the weighted head sum
        logit = tl.sum(s, axis=1) * kscale
        logit = tl.where(live, logit, float("-inf"))
        tl.store(out_ptr + t * n_out + cols, logit, mask=cols < n_out)


def _default_block_table(T: int, n_pages: int, device) -> torch.Tensor:
    return torch.arange(n_pages, dtype=torch.int32, device=device).expand(T, n_pages)


def _logits_ref64(q, q_scales, weights_out, k_cache, positions, block_table, block_size, n_out, fmt):
    """float64 logits from the decoded codes: the oracle."""
    T = q.shape[0]
    dev = q.device
    qv = dequantize_q(q, q_scales).double()  # [T, H, 128]
    s = torch.arange(n_out, device=dev)
    n_c = n_compressed(positions)
    live = s[None, :] < n_c[:, None]  # [T, n_out]
    blk = (s // block_size).clamp(max=block_table.shape[1] - 1)
    page = torch.where(live, block_table.long()[:, blk], 0)
    slots = torch.where(live, page * block_size + s % block_size, -1)
    vals, sc = read_k(k_cache, slots.reshape(-1), block_size=block_size, fmt=fmt)
    kv = dequantize_k(vals, sc).double().reshape(T, n_out, HEAD_DIM)
    dots = torch.einsum("thd,tsd->ths", qv, kv).clamp_min(0)  # ReLU per head
    out = torch.einsum("th,ths->ts", weights_out.double(), dots)
    if fmt == "fp8":
        out = out * sc.double().reshape(T, n_out)
    return torch.where(live, out, float("-inf"))


def logits(q: torch.Tensor, q_scales: torch.Tensor | None, weights_out: torch.Tensor, k_cache: torch.Tensor,
           positions: torch.Tensor, *, block_table: torch.Tensor | None = None, block_size: int = 64,
           n_out: int | None = None, backend: str = "triton") -> torch.Tensor:
    """Indexer scores ``[T, n_out]`` fp32: Σ_h w_out·ReLU(⟨q_h, k_s⟩)(·k_scale_s), −∞ for s ≥ (p+1)//4.

    Args:
        q, q_scales, weights_out: what :func:`quantize_q` returned (q_scales None ⇒ fp8, else mxfp4).
        k_cache: the indexer-K pages of the matching format (:func:`insert_k`).
        positions: ``[T]`` int64 positions; token t sees n_c = (p+1)//4 local rows.
        block_table: ``[T, max_pages]`` int32, row t = the compressed block table of token t's request
            (local row l lives in page ``block_table[t, l // block_size]``). None: page i holds rows
            ``i·block_size ..`` for every token (one request).
        block_size: keys per page, a power of two >= 16 for the Triton kernel (64 in DSV4).
        n_out: columns of the output (default: the largest n_c in the batch).
    """
    validate.backend(backend)
    fmt = "fp8" if q_scales is None else "mxfp4"
    validate.tensor(q, "q", dtype=torch.float8_e4m3fn if fmt == "fp8" else torch.uint8, ndim=3)
    T, H, Dq = q.shape
    if Dq != (HEAD_DIM if fmt == "fp8" else HEAD_DIM // 2):
        raise ValueError(f"q: expected [T, n_ih, {HEAD_DIM if fmt == 'fp8' else HEAD_DIM // 2}] for {fmt}, "
                         f"got {tuple(q.shape)}")
    if q_scales is not None:
        validate.tensor(q_scales, "q_scales", dtype=torch.int32, shape=(T, H))
    validate.tensor(weights_out, "weights_out", dtype=torch.float32, shape=(T, H))
    validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32), shape=(T,))
    _check_k_cache(k_cache, block_size, fmt)
    validate.same_device(q=q, weights_out=weights_out, k_cache=k_cache, positions=positions)
    if backend == "triton" and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(f"block_size: the Triton kernel needs a power of two >= 16, got {block_size}")
    n_c = n_compressed(positions)
    if _checking_values() and T and bool((positions < 0).any()):
        raise ValueError("positions: expected non-negative positions")
    if n_out is None:
        n_out = int(n_c.max()) if T else 0
    if block_table is None:
        block_table = _default_block_table(T, max(1, -(-n_out // block_size)), q.device)
    validate.tensor(block_table, "block_table", dtype=torch.int32, ndim=2)
    if block_table.shape[0] != T:
        raise ValueError(f"block_table: expected one row per token ({T}), got shape {tuple(block_table.shape)}")
    if _checking_values() and T:
        need = -(-int(n_c.max()) // block_size)
        if block_table.shape[1] < need:
            raise ValueError(f"block_table: {block_table.shape[1]} columns cannot address n_c = {int(n_c.max())} "
                             f"rows of {block_size} per page ({need} needed)")
        used = torch.arange(block_table.shape[1], device=q.device)[None, :] < (-(-n_c // block_size))[:, None]
        validate.index_range(block_table[used], "block_table", k_cache.shape[0], allow_minus_one=False)
    if backend == "reference":
        return _logits_ref64(q, q_scales, weights_out, k_cache, positions, block_table, block_size, n_out, fmt).float()
    return _logits_triton(q, q_scales, weights_out, k_cache, positions, block_table, block_size, n_out)


def _logits_triton(q, q_scales, weights_out, k_cache, positions, block_table, block_size, n_out):
    """The kernel launch alone (no checks, no host syncs): what the benchmark times."""
    T, H, _ = q.shape
    fmt = "fp8" if q_scales is None else "mxfp4"
    out = torch.empty(T, n_out, dtype=torch.float32, device=q.device)
    if T == 0 or n_out == 0:
        return out
    qs = q_scales.contiguous().view(torch.uint8) if q_scales is not None else q.view(torch.uint8)
    n_pages = -(-n_out // block_size)
    pages = 1 if interpreting() else 4
    hp = max(16, triton.next_power_of_2(H))
    bt = block_table.contiguous()
    _logits_kernel[(T, triton.cdiv(n_pages, pages))](
        q.contiguous().view(torch.uint8), qs, weights_out.contiguous(), k_cache, k_cache.view(torch.float32),
        bt, positions.to(torch.int64).contiguous(), out, n_out, bt.stride(0), k_cache.stride(0), H,
        HP=hp, BC=block_size, PAGES=pages, FP4=fmt == "mxfp4", DOT_FP32=interpreting(),
    )
    return out


# ----------------------------------------------------------------------------------------------------
# top-k, the short-context shortcut, local -> global
# ----------------------------------------------------------------------------------------------------


def short_context_topk(positions: torch.Tensor, k: int) -> torch.Tensor:
    """The shortcut: row t = [0, 1, …, n_c(t)−1, −1, …] (width k). Valid only when every n_c ≤ k."""
    n_c = n_compressed(positions)
    ids = torch.arange(k, device=positions.device, dtype=torch.int32)
    return torch.where(ids[None, :] < n_c[:, None], ids[None, :], -1).to(torch.int32)


def topk(logits: torch.Tensor | None, k: int, *, positions: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Local ids of the k largest logits per row, int32 ``[T, k]``; −∞ entries and missing columns → −1.

    Order within a row carries no meaning (attention is one softmax); ties are broken by torch.topk.
    Short-context shortcut: if ``positions`` is given and max n_c ≤ k, the logits are not read at all
    (they may be None) and the result is ``[0 … n_c−1, −1 …]``, the same set as the full path.
    ``out``: an optional ``[T, k]`` int32 buffer, reset to −1 on every call.
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected a positive int, got {k!r}")
    if positions is not None:
        validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32), ndim=1)
    if logits is None and positions is None:
        raise ValueError("logits: may be None only when positions are given (the short-context shortcut)")
    if logits is not None:
        validate.tensor(logits, "logits", dtype=torch.float32, ndim=2)
    T = logits.shape[0] if logits is not None else positions.shape[0]
    if positions is not None and positions.shape[0] != T:
        raise ValueError(f"positions: expected {T} entries (one per logits row), got {positions.shape[0]}")
    if out is not None:
        validate.tensor(out, "out", dtype=torch.int32, shape=(T, k))
    dev = logits.device if logits is not None else positions.device
    res = out if out is not None else torch.empty(T, k, dtype=torch.int32, device=dev)
    res.fill_(-1)
    if positions is not None and (T == 0 or int(n_compressed(positions).max()) <= k):
        res.copy_(short_context_topk(positions, k))
        return res
    if logits is None:
        raise ValueError(f"logits: needed, because some n_c exceeds k={k} (no shortcut)")
    kk = min(k, logits.shape[1])
    if kk:
        vals, ids = torch.topk(logits, kk, dim=1)
        res[:, :kk] = torch.where(vals == float("-inf"), -1, ids).to(torch.int32)
    return res


def select(q, q_scales, weights_out, k_cache, positions, k: int, *, block_table=None, block_size: int = 64,
           backend: str = "triton") -> torch.Tensor:
    """logits + top-k, skipping the logits when every token sees at most k rows (the shortcut)."""
    if positions.shape[0] and int(n_compressed(positions).max()) <= k:
        return topk(None, k, positions=positions)
    lg = logits(q, q_scales, weights_out, k_cache, positions, block_table=block_table, block_size=block_size,
                backend=backend)
    return topk(lg, k, positions=positions)


def to_global(topk_local: torch.Tensor, block_table: torch.Tensor, slot_mapping: torch.Tensor | None = None, *,
              block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Local compressed ids → slots of the MAIN compressed KV cache, and the per-token counts.

    ``global = block_table[t, l // Bc]·Bc + l % Bc`` for l ≥ 0, else −1; ``topk_len[t]`` = number of l ≥ 0,
    forced to 0 (and the row to −1) for invalid tokens (``slot_mapping[t] < 0``). ``block_table`` is
    ``[T, max_pages]`` int32, one row per token (its request's row). Returns (int32 [T, k], int32 [T]).
    """
    validate.tensor(topk_local, "topk_local", dtype=torch.int32, ndim=2)
    validate.tensor(block_table, "block_table", dtype=torch.int32, ndim=2)
    T = topk_local.shape[0]
    if block_table.shape[0] != T:
        raise ValueError(f"block_table: expected one row per token ({T}), got shape {tuple(block_table.shape)}")
    if slot_mapping is not None:
        validate.tensor(slot_mapping, "slot_mapping", dtype=(torch.int64, torch.int32), shape=(T,))
    if block_size < 1:
        raise ValueError(f"block_size: expected >= 1, got {block_size}")
    validate.index_range(topk_local, "topk_local", block_table.shape[1] * block_size)
    ok = topk_local >= 0
    if slot_mapping is not None:
        ok = ok & (slot_mapping >= 0)[:, None]
    loc = topk_local.long().clamp_min(0)
    page = torch.gather(block_table.long(), 1, loc // block_size).clamp_min(0)
    glob = torch.where(ok, page * block_size + loc % block_size, -1).to(torch.int32)
    return glob, ok.sum(1).to(torch.int32)


# ----------------------------------------------------------------------------------------------------
# python -m dsv4ref check / bench
# ----------------------------------------------------------------------------------------------------


def cos_sin_table(max_pos: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """A plain (no YaRN) fp32 table ``[max_pos, 64] = [cos | sin]`` for demos and checks; the model's
    tables come from dsv4ref.rope."""
    inv = theta ** (-torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM)
    f = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=1).to(device or DEVICE)


def example(T: int, H: int, n_keys: int, *, block_size: int = 16, fmt: str = "fp8", hadamard: bool = False,
            seed: int = 0, positions: torch.Tensor | None = None):
    """A small consistent problem: queries, weights, a shuffled paged K cache, per-token block tables."""
    g = generator(seed)
    cs = cos_sin_table(4 * n_keys + 8)
    index_q = randn((T, H, HEAD_DIM), seed=seed, block=32, octaves=8)
    w = randn((T, H), seed=seed + 1, dtype=torch.float32, block=None, octaves=4)
    if positions is None:
        positions = 4 * n_keys - 1 - torch.randint(0, 4 * n_keys // 2, (T,), generator=g)
        positions[0] = 4 * n_keys - 1  # one token sees every key
    positions = positions.to(torch.int64).to(DEVICE)
    n_pages = -(-n_keys // block_size)
    perm = torch.randperm(n_pages + 2, generator=g)[:n_pages]
    bt = perm.to(torch.int32).expand(T, n_pages).contiguous().to(DEVICE)
    k = randn((n_keys, HEAD_DIM), seed=seed + 2, block=32, octaves=8)
    cache = allocate_k_cache(n_pages + 2, block_size, fmt)
    s = torch.arange(n_keys)
    slots = (perm[s // block_size] * block_size + s % block_size).to(DEVICE)
    insert_k(cache, k, slots, block_size=block_size, fmt=fmt, hadamard=hadamard)
    return dict(index_q=index_q, positions=positions, cos_sin=cs, weights=w, k=k, k_cache=cache, block_table=bt,
                block_size=block_size, slots=slots)


@check("indexer.quantize_q")
def _check_quantize_q() -> list[CheckRow]:
    rows = []
    for fmt in FMTS:
        for had in (False, True):
            ex = example(5, 16, 16, seed=3, hadamard=had)
            args = (ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"])
            r = quantize_q(*args, fmt=fmt, hadamard=had, backend="reference")
            o = quantize_q(*args, fmt=fmt, hadamard=had)
            shape = f"T=5 H=16 {fmt}{' hadamard' if had else ''}"
            rows.append(CheckRow("indexer.quantize_q", shape, compare(o[0], r[0], "exact", "q bytes")))
            if fmt == "mxfp4":
                rows.append(CheckRow("indexer.quantize_q", shape, compare(o[1], r[1], "exact", "q scales")))
            rows.append(CheckRow("indexer.quantize_q", shape, compare(o[2], r[2], "exact", "weights_out")))
    return rows


@check("indexer.insert_k")
def _check_insert_k() -> list[CheckRow]:
    rows = []
    for fmt in FMTS:
        k = randn((40, HEAD_DIM), seed=5, block=32)
        slots = torch.randperm(64, generator=generator(5))[:40].to(DEVICE)
        slots[::7] = -1
        a, b = allocate_k_cache(4, 16, fmt), allocate_k_cache(4, 16, fmt)
        insert_k(a, k, slots, block_size=16, fmt=fmt, hadamard=True, backend="reference")
        insert_k(b, k, slots, block_size=16, fmt=fmt, hadamard=True)
        rows.append(CheckRow("indexer.insert_k", f"N=40 Bc=16 {fmt}", compare(b, a, "exact", "cache bytes")))
    return rows


@check("indexer.logits")
def _check_logits() -> list[CheckRow]:
    rows = []
    for fmt in FMTS:
        ex = example(4, 16, 40, fmt=fmt, seed=7)
        q, qs, wo = quantize_q(ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"], fmt=fmt)
        kw = dict(block_table=ex["block_table"], block_size=ex["block_size"])
        got = logits(q, qs, wo, ex["k_cache"], ex["positions"], **kw)
        ref = _logits_ref64(q, qs, wo, ex["k_cache"], ex["positions"], ex["block_table"], ex["block_size"],
                            got.shape[1], fmt)
        # normalise by the condition scale Σ_h |w|·Σ_d |q k| so "fp32_dot" (atol 1e-5) bounds the fp32 sum error
        cond = _condition(q, qs, wo, ex, fmt, got.shape[1])
        rows.append(CheckRow("indexer.logits", f"T=4 H=16 n_c<=40 Bc=16 {fmt}",
                             compare(got.double() / cond, ref / cond, "fp32_dot", "logits / condition")))
    return rows


def _condition(q, qs, wo, ex, fmt, n_out):
    """Σ_h |w_out|·Σ_d |q_d·k_d|·k_scale per (t, s): the scale of the fp32 accumulation error."""
    ref_abs = _logits_ref64(_abs_q(q, qs), qs, wo.abs(), _abs_cache(ex["k_cache"], fmt), ex["positions"],
                            ex["block_table"], ex["block_size"], n_out, fmt)
    return torch.where(torch.isfinite(ref_abs), ref_abs.clamp_min(1e-30), 1.0)


def _abs_q(q, qs):
    if qs is None:
        return (q.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    return q & 0x77  # clear both sign bits


def _abs_cache(cache, fmt):
    """A copy of the cache with every value's sign cleared (scales untouched)."""
    c = cache.clone()
    bc = c.shape[1] // _record(fmt)
    vb = HEAD_DIM if fmt == "fp8" else HEAD_DIM // 2
    c[:, : bc * vb] &= 0x7F if fmt == "fp8" else 0x77
    return c


@check("indexer.topk")
def _check_topk() -> list[CheckRow]:
    lg = torch.randn(6, 300, generator=generator(11)).to(DEVICE)
    pos = torch.tensor([3, 40, 400, 1199, 800, 2], dtype=torch.int64, device=DEVICE)
    lg = torch.where(torch.arange(300, device=DEVICE)[None, :] < n_compressed(pos)[:, None], lg, float("-inf"))
    got = topk(lg, 64).sort(dim=1).values
    n_c = n_compressed(pos)
    exp = torch.full((6, 64), -1, dtype=torch.int32)
    for t in range(6):
        ids = torch.topk(lg[t, : int(n_c[t])].cpu(), min(64, int(n_c[t]))).indices.to(torch.int32)
        exp[t, : ids.numel()] = ids
    return [CheckRow("indexer.topk", "T=6 n<=300 k=64", compare(got.cpu(), exp.sort(dim=1).values, "exact", "id sets"))]


@bench("indexer")
def _bench() -> list[BenchCase]:
    T, H, n_c, Bc = 64, 64, 32768, 64
    pages_per_tok = n_c // Bc
    pos = torch.full((T,), 4 * n_c + 2, dtype=torch.int64, device=DEVICE)  # n_c = 32768 for every token
    cases = []
    g = torch.Generator(device=DEVICE).manual_seed(0)
    cs = cos_sin_table(4 * n_c + 8)
    for fmt in FMTS:
        rec = _record(fmt)
        n_sets = 2  # 2 × 277 MB (fp8) / 143 MB (mxfp4) of keys: far beyond the 60 MB L2
        sets = []
        for i in range(n_sets):
            cache = torch.randint(0, 256, (T * pages_per_tok, Bc * rec), dtype=torch.uint8, device=DEVICE,
                                  generator=g)
            if fmt == "fp8":
                cache.view(T * pages_per_tok, Bc, rec)[:, :, :HEAD_DIM] &= 0x77  # no NaN codes (0x7F / 0xFF)
                sc = cache[:, Bc * HEAD_DIM:].view(torch.float32)
                sc.copy_(torch.exp2(torch.randint(-10, 10, sc.shape, device=DEVICE, generator=g).float()))
            else:
                cache[:, Bc * 64:] = torch.randint(117, 137, (T * pages_per_tok, Bc * 4), dtype=torch.uint8,
                                                   device=DEVICE, generator=g)
            bt = torch.randperm(T * pages_per_tok, device=DEVICE, generator=g).to(torch.int32).view(T, pages_per_tok)
            iq = torch.randn(T, H, HEAD_DIM, device=DEVICE, generator=g).to(torch.bfloat16)
            w = torch.randn(T, H, device=DEVICE, generator=g)
            q, qs, wo = quantize_q(iq, pos, cs, w, fmt=fmt)
            sets.append((q, qs, wo, cache, bt))
        nbytes = T * n_c * rec + T * H * (HEAD_DIM if fmt == "fp8" else 68) + T * H * 4 + T * pages_per_tok * 4 \
            + T * n_c * 4
        flops = 2.0 * T * n_c * H * HEAD_DIM

        def run(i, sets=sets):
            q, qs, wo, cache, bt = sets[i]
            return _logits_triton(q, qs, wo, cache, pos, bt, Bc, n_c)

        cases.append(BenchCase(f"indexer.logits.{fmt}", f"T={T} H={H} n_c={n_c} Bc={Bc}", run, n_sets, nbytes,
                               flops, note=f"keys {rec} B/key/token + q + w + block table + fp32 logits out"))
    return cases
