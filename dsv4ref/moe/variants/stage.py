"""MoE input staging, every mode it was measured in: the candidates of ``benchmarks/moe.md``'s staging table
that are not the default (``dsv4ref.moe.kernels.stage_kernel``, the ``snap`` encoder on whole tiles, one
program per tile). Each writes the same bytes as :func:`dsv4ref.moe.stage_into` (``tests/test_moe.py``,
``tests/test_contract_moe.py`` hold them to it); only when and how they move differs.

:class:`StageVariant` names a variant, :func:`stage_into` runs it into given buffers. The modes, as constexprs of
``stage_variant_kernel``:

* ``ENCODE = "blocks"`` (``_stage_tile_blocks``): the shared helper ``e4m3_ue8m0_blocks`` (scale, encoder and the
  non-finite policy, per value), the four bytes of a word or-ed into the int32 ``x_sf``;

  * ``LOAD = "groups"``: four loads of [BLOCK_T, NB, 32] (group j of every 128-block), one per byte of the word;
  * ``LOAD = "tile"``: one load of the contiguous [BLOCK_T, BLOCK_H] tile (16-byte vectors when the hidden
    stride is 1), seen as [BLOCK_T, BLOCK_H/32, 32] for the group amax;

* ``ENCODE = "snap"`` (the default's encoder, ``LOAD = "tile"``);
* ``PERSISTENT``: a fixed number of programs walks the tiles with a grid stride (no tail wave), else one
  program per (token block, column block);
* ``EVICT`` / ``STORE_CACHE``: cache hints on the streamed input (eviction_policy) and the outputs
  (cache_modifier);
* ``PREFETCH`` (``PERSISTENT``, not "blocks"): each program holds two tiles in registers, the next one's loads in
  flight while this one is encoded and stored;
* ``TOPK_FIRST`` (one program per tile): the top-k loads before the tile's, as the default on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ... import validate
from ...formats import STAGE_AMAX_FLOOR, STAGE_BLOCK
from ...tl import e4m3_ue8m0_blocks
from ..kernels import _snap_load, _stage_bits_snap, _stage_tile_snap, _stage_topk, _topk_load, _topk_store, widen_bf16
from ..launch import scale_bytes

__all__ = ["StageVariant", "stage_into", "constexprs", "stage_variant_kernel"]

LOADS = ("groups", "tile")
ENCODES = ("blocks", "snap")
CACHE_HINTS = {
    "": ("", ""),
    "evict_first": ("evict_first", ""),
    "stream": ("evict_first", ".cs"),
    "cs": ("", ".cs"),
}  # load, store


@dataclass(frozen=True)
class StageVariant:
    """One staging variant (the default's fields first, then the modes).

    Attributes:
        block_t, block_h: tokens and hidden values per tile (powers of two; ``block_h`` a multiple of 128).
        warps: warps per program.
        load: ``"groups"`` (four loads of 32-value groups, one per byte of the packed word; ``encode="blocks"``
            only) or ``"tile"`` (one contiguous [block_t, block_h] load, viewed as groups of 32 for the amax).
        encode: ``"blocks"`` (the shared ``e4m3_ue8m0_blocks``, the non-finite policy per value) or ``"snap"``
            (the default's encoder; ``load="tile"`` only).
        programs: 0 = one program per tile; n ≥ 1 = a persistent grid of n programs walking the tiles.
        stages: software-pipeline stages (only the persistent loop has a loop to pipeline).
        cache: ``""`` (no hints), ``"evict_first"`` (the bf16 input loaded evict-first), ``"stream"`` (that, and the
            outputs stored ``.cs``: the default's hints) or ``"cs"`` (the ``.cs`` stores alone).
        maxnreg: 0 = the registers ptxas picks; n in [16, 255] caps them (Triton's ``maxnreg``).
        topk_first: one program per tile only: column block 0 loads its rows' top-k before its tile.
        prefetch: ``programs`` > 0 and ``encode="snap"``: each program loads its next tile before encoding this one.
    """

    block_t: int = 4
    block_h: int = 256
    warps: int = 2
    load: str = "tile"
    encode: str = "snap"
    programs: int = 0
    stages: int = 3
    cache: str = "stream"
    maxnreg: int = 0
    topk_first: bool = False
    prefetch: bool = False

    def __post_init__(self):
        for name in ("block_t", "block_h", "warps"):
            validate.power_of_two(getattr(self, name), name)
        if self.block_h < STAGE_BLOCK:
            raise ValueError(f"block_h: expected a multiple of {STAGE_BLOCK}, got {self.block_h}")
        validate.integer(self.stages, "stages", lo=1)
        validate.integer(self.programs, "programs", lo=0)
        validate.integer(self.maxnreg, "maxnreg", lo=0, hi=255)
        if 0 < self.maxnreg < 16:
            raise ValueError(f"maxnreg: expected 0 or 16..255, got {self.maxnreg}")
        if self.load not in LOADS:
            raise ValueError(f"load: expected one of {LOADS}, got {self.load!r}")
        if self.encode not in ENCODES:
            raise ValueError(f"encode: expected one of {ENCODES}, got {self.encode!r}")
        if self.encode != "blocks" and self.load != "tile":
            raise ValueError(f'load={self.load!r} does not go with encode={self.encode!r}: "snap" needs "tile"')
        if self.cache not in CACHE_HINTS:
            raise ValueError(f"cache: expected one of {tuple(CACHE_HINTS)}, got {self.cache!r}")
        for name in ("topk_first", "prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {type(getattr(self, name)).__name__}")
        if self.prefetch and not (self.programs and self.encode == "snap"):
            raise ValueError('prefetch: needs programs > 0 and encode="snap"')
        if self.topk_first and self.programs:
            raise ValueError("topk_first: one program per tile only (programs=0)")


def constexprs(Hd: int, K: int, v: StageVariant) -> dict:
    """The constexpr arguments of :func:`stage_variant_kernel` for variant ``v`` (also what
    ``benchmarks/experiments/moe_stage_compile_check.py`` compiles ahead of time)."""
    evict, store_cache = CACHE_HINTS[v.cache]
    return dict(
        FLOOR=STAGE_AMAX_FLOOR,
        BLOCK_T=v.block_t,
        BLOCK_H=min(v.block_h, triton.next_power_of_2(Hd)),
        BLOCK_TOPK=max(1, triton.next_power_of_2(K)),
        LOAD=v.load,
        ENCODE=v.encode,
        PERSISTENT=v.programs > 0,
        EVICT=evict,
        STORE_CACHE=store_cache,
        TOPK_FIRST=v.topk_first and not v.programs,
        PREFETCH=v.prefetch and v.programs > 0 and v.encode != "blocks",
    )


def stage_into(hidden, ids, weights, x_fp8, x_sf, ids_out, weights_out, variant: StageVariant) -> None:
    """:func:`dsv4ref.moe.stage_into`'s outputs (rows [0, T) of the four buffers) with ``variant``: no argument
    checks (the caller passes what ``moe.stage_into`` accepts), no custom op; an experiment's launcher."""
    T, Hd = hidden.shape
    if T == 0:
        return
    K = ids.shape[1]
    const = constexprs(Hd, K, variant)
    wv, wov = weights.view(torch.int32), weights_out.view(torch.int32)
    xv = hidden.view(torch.int16)
    sf = x_sf
    if const["ENCODE"] != "blocks":  # "snap" stores one byte per 32-group, through the bytes of x_sf
        sf = scale_bytes(sf)
    n_t, n_h = triton.cdiv(T, variant.block_t), triton.cdiv(Hd, const["BLOCK_H"])
    grid = (variant.programs,) if variant.programs else (n_t, n_h)
    stage_variant_kernel[grid](
        xv,
        x_fp8.view(torch.uint8),
        sf,
        ids,
        wv,
        ids_out,
        wov,
        T,
        Hd,
        K,
        xv.stride(0),
        xv.stride(1),
        x_fp8.stride(0),
        sf.stride(0),
        ids.stride(0),
        ids.stride(1),
        wv.stride(0),
        wv.stride(1),
        ids_out.stride(0),
        wov.stride(0),
        **const,
        num_warps=variant.warps,
        num_stages=variant.stages,
        **({"maxnreg": variant.maxnreg} if variant.maxnreg else {}),
    )


@triton.jit
def _stage_tile_blocks(
    x_ptr,
    q_ptr,
    sf_ptr,
    T,
    Hd,
    tt,
    th,
    stride_xt,
    stride_xh,
    stride_qt,
    stride_st,
    FLOOR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LOAD: tl.constexpr,
    EVICT: tl.constexpr,
    STORE_CACHE: tl.constexpr,
):
    """ENCODE = "blocks": stage tokens [tt·BLOCK_T, +BLOCK_T) × hidden values [th·BLOCK_H, +BLOCK_H) into e4m3
    bytes and int32 words (sf_ptr: the int32 x_sf). Returns (rows, row_ok, r64) for the top-k copies."""
    NB: tl.constexpr = BLOCK_H // 128  # scale words per tile row
    rows = tt * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    r64 = rows.to(tl.int64)
    kb = th * NB + tl.arange(0, NB)  # [NB] 128-block (= scale word) index
    if LOAD == "tile":
        col = th * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
        m = row_ok[:, None] & (col < Hd)[None, :]
        bits = tl.load(
            x_ptr + r64[:, None] * stride_xt + col[None, :].to(tl.int64) * stride_xh, mask=m, other=0, eviction_policy=EVICT
        )
        q, byte = e4m3_ue8m0_blocks(tl.reshape(widen_bf16(bits), (BLOCK_T, NB * 4, 32)), FLOOR, 2)  # groups of 32
        tl.store(
            q_ptr + r64[:, None] * stride_qt + col[None, :], tl.reshape(q, (BLOCK_T, BLOCK_H)), mask=m, cache_modifier=STORE_CACHE
        )
        lane = (8 * tl.arange(0, 4)).to(tl.uint32)
        word = tl.sum(tl.reshape(byte.to(tl.uint32), (BLOCK_T, NB, 4)) << lane[None, None, :], axis=2)  # disjoint bits
    else:
        i = tl.arange(0, 32)
        word = tl.zeros((BLOCK_T, NB), dtype=tl.uint32)
        for j in tl.static_range(4):  # the four 32-value groups of each block
            col = kb[:, None] * 128 + j * 32 + i[None, :]  # [NB, 32]
            m = row_ok[:, None, None] & (col < Hd)[None, :, :]
            bits = tl.load(
                x_ptr + r64[:, None, None] * stride_xt + col[None, :, :].to(tl.int64) * stride_xh,
                mask=m,
                other=0,
                eviction_policy=EVICT,
            )
            q, byte = e4m3_ue8m0_blocks(widen_bf16(bits), FLOOR, 2)  # [BLOCK_T, NB, 32] uint8, [BLOCK_T, NB] int32
            tl.store(q_ptr + r64[:, None, None] * stride_qt + col[None, :, :], q, mask=m, cache_modifier=STORE_CACHE)
            word = word | (byte.to(tl.uint32) << (8 * j))
    m_sf = row_ok[:, None] & (kb * 128 < Hd)[None, :]
    tl.store(
        sf_ptr + r64[:, None] * stride_st + kb[None, :], word.to(tl.int32, bitcast=True), mask=m_sf, cache_modifier=STORE_CACHE
    )
    return rows, row_ok, r64


@triton.jit
def _stage_tile(
    x_ptr,
    q_ptr,
    sf_ptr,
    T,
    Hd,
    tt,
    th,
    stride_xt,
    stride_xh,
    stride_qt,
    stride_st,
    FLOOR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LOAD: tl.constexpr,
    ENCODE: tl.constexpr,
    EVICT: tl.constexpr,
    STORE_CACHE: tl.constexpr,
):
    """One tile, by ENCODE. Returns (rows, row_ok, r64) for the top-k copies."""
    if ENCODE == "blocks":
        return _stage_tile_blocks(
            x_ptr,
            q_ptr,
            sf_ptr,
            T,
            Hd,
            tt,
            th,
            stride_xt,
            stride_xh,
            stride_qt,
            stride_st,
            FLOOR,
            BLOCK_T,
            BLOCK_H,
            LOAD,
            EVICT,
            STORE_CACHE,
        )
    else:
        return _stage_tile_snap(
            x_ptr,
            q_ptr,
            sf_ptr,
            T,
            Hd,
            tt,
            th,
            stride_xt,
            stride_xh,
            stride_qt,
            stride_st,
            FLOOR,
            BLOCK_T,
            BLOCK_H,
            EVICT,
            STORE_CACHE,
        )


@triton.jit
def stage_variant_kernel(
    x_ptr,  # int16 view of hidden bf16 [T, Hd], any strides (stride_xt, stride_xh)
    q_ptr,  # uint8 view of x_fp8 [≥T, Hd], unit stride along Hd, row stride stride_qt
    sf_ptr,  # ENCODE "blocks": int32 x_sf [≥T, Hd/128], unit stride along Hd/128, row stride stride_st;
    # otherwise its uint8 view [≥T, Hd/32] (little-endian bytes), row stride stride_st in bytes
    ids_ptr,  # int32 or int64 ids [T, K] (stride_it, stride_ik)
    w_ptr,  # int32 view of fp32 weights [T, K] (stride_wt, stride_wk): their bits are copied
    ids_out_ptr,  # int64 [≥T, K], unit stride along K, row stride stride_iot
    w_out_ptr,  # int32 view of fp32 [≥T, K], unit stride along K, row stride stride_wot
    T,
    Hd,
    K,
    stride_xt,
    stride_xh,
    stride_qt,
    stride_st,
    stride_it,
    stride_ik,
    stride_wt,
    stride_wk,
    stride_iot,
    stride_wot,
    FLOOR: tl.constexpr,  # 1e-4, the amax floor
    BLOCK_T: tl.constexpr,  # tokens per tile
    BLOCK_H: tl.constexpr,  # hidden values per tile, a multiple of 128
    BLOCK_TOPK: tl.constexpr,  # next_power_of_2(K)
    LOAD: tl.constexpr,  # "groups" | "tile" (see above)
    ENCODE: tl.constexpr,  # "blocks" | "snap"
    PERSISTENT: tl.constexpr,  # grid-stride loop over the tiles (grid = a fixed number of programs)
    EVICT: tl.constexpr,  # eviction_policy of the input load: "" or "evict_first"
    STORE_CACHE: tl.constexpr,  # cache_modifier of the output stores: "" or ".cs" (streaming)
    TOPK_FIRST: tl.constexpr = False,  # one program per tile: the top-k loads issued before the tile's loads
    PREFETCH: tl.constexpr = False,  # PERSISTENT, ENCODE != "blocks": the next tile loaded before this one is encoded
):
    if PERSISTENT and PREFETCH:
        # registers hold two tiles: the next tile's loads are in flight while this one is encoded and stored.
        # A "next" past the last tile has token block >= cdiv(T, BLOCK_T): every row masked, nothing read.
        n_h = tl.cdiv(Hd, BLOCK_H)
        tile = tl.program_id(0)
        bits = _snap_load(x_ptr, T, Hd, tile // n_h, tile % n_h, stride_xt, stride_xh, BLOCK_T, BLOCK_H, EVICT)
        for _ in range(tl.program_id(0), tl.cdiv(T, BLOCK_T) * n_h, tl.num_programs(0)):
            nxt = tile + tl.num_programs(0)
            nbits = _snap_load(x_ptr, T, Hd, nxt // n_h, nxt % n_h, stride_xt, stride_xh, BLOCK_T, BLOCK_H, EVICT)
            th = tile % n_h
            rows, row_ok, r64 = _stage_bits_snap(
                bits,
                x_ptr,
                q_ptr,
                sf_ptr,
                T,
                Hd,
                tile // n_h,
                th,
                stride_xt,
                stride_xh,
                stride_qt,
                stride_st,
                FLOOR,
                BLOCK_T,
                BLOCK_H,
                STORE_CACHE,
            )
            if th == 0:  # the top-k copies, once per token
                _stage_topk(
                    ids_ptr,
                    w_ptr,
                    ids_out_ptr,
                    w_out_ptr,
                    rows,
                    row_ok,
                    r64,
                    K,
                    stride_it,
                    stride_ik,
                    stride_wt,
                    stride_wk,
                    stride_iot,
                    stride_wot,
                    BLOCK_TOPK,
                )
            bits = nbits
            tile = nxt
    elif PERSISTENT:
        n_h = tl.cdiv(Hd, BLOCK_H)
        for tile in range(tl.program_id(0), tl.cdiv(T, BLOCK_T) * n_h, tl.num_programs(0)):
            th = tile % n_h
            rows, row_ok, r64 = _stage_tile(
                x_ptr,
                q_ptr,
                sf_ptr,
                T,
                Hd,
                tile // n_h,
                th,
                stride_xt,
                stride_xh,
                stride_qt,
                stride_st,
                FLOOR,
                BLOCK_T,
                BLOCK_H,
                LOAD,
                ENCODE,
                EVICT,
                STORE_CACHE,
            )
            if th == 0:  # the top-k copies, once per token
                _stage_topk(
                    ids_ptr,
                    w_ptr,
                    ids_out_ptr,
                    w_out_ptr,
                    rows,
                    row_ok,
                    r64,
                    K,
                    stride_it,
                    stride_ik,
                    stride_wt,
                    stride_wk,
                    stride_iot,
                    stride_wot,
                    BLOCK_TOPK,
                )
    elif TOPK_FIRST:
        # the program of column block 0 loads its rows' ids and weights before its tile, so these small loads
        # share the tile's round trip instead of adding one after its stores; the others load nothing (masked)
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        copy = rows < T - T * tl.minimum(tl.program_id(1), 1)  # rows < T in column block 0, none elsewhere
        ids, wb = _topk_load(ids_ptr, w_ptr, rows.to(tl.int64), copy, K, stride_it, stride_ik, stride_wt, stride_wk, BLOCK_TOPK)
        tl.debug_barrier()  # keeps the compiler from sinking these loads below the tile's (found in the SASS)
        _stage_tile(
            x_ptr,
            q_ptr,
            sf_ptr,
            T,
            Hd,
            tl.program_id(0),
            tl.program_id(1),
            stride_xt,
            stride_xh,
            stride_qt,
            stride_st,
            FLOOR,
            BLOCK_T,
            BLOCK_H,
            LOAD,
            ENCODE,
            EVICT,
            STORE_CACHE,
        )
        _topk_store(ids_out_ptr, w_out_ptr, ids, wb, rows.to(tl.int64), copy, K, stride_iot, stride_wot, BLOCK_TOPK)
    else:
        rows, row_ok, r64 = _stage_tile(
            x_ptr,
            q_ptr,
            sf_ptr,
            T,
            Hd,
            tl.program_id(0),
            tl.program_id(1),
            stride_xt,
            stride_xh,
            stride_qt,
            stride_st,
            FLOOR,
            BLOCK_T,
            BLOCK_H,
            LOAD,
            ENCODE,
            EVICT,
            STORE_CACHE,
        )
        if tl.program_id(1) == 0:  # the top-k copies, once per token
            _stage_topk(
                ids_ptr,
                w_ptr,
                ids_out_ptr,
                w_out_ptr,
                rows,
                row_ok,
                r64,
                K,
                stride_it,
                stride_ik,
                stride_wt,
                stride_wk,
                stride_iot,
                stride_wot,
                BLOCK_TOPK,
            )
