"""Shared Triton building blocks, correct both compiled and in Triton's CPU interpreter.

Every dsv4ref kernel uses these instead of re-writing them, so each of the interpreter's bugs
(``docs/triton_interpreter.md``) is worked around in exactly one place:

=====================  ============================================  ====================================
helper                 what it does                                  interpreter bug it avoids
=====================  ============================================  ====================================
``e4m3_encode``        fp32 -> float8_e4m3fn, clamp ±448 + RNE       I5: wrong rounding, no saturation
``ue8m0_byte``         amax -> UE8M0 exponent byte (exact ceil)      float log2 off by one at 2^k
``pow2``               byte -> 2^(byte-127) as fp32 (exact)          none; an exponent add, no libdevice
``bf16_rne_bits``      fp32 -> bf16 bits, round half to even         I4: fp32 -> bf16 truncates
``dot``                tl.dot that upcasts to fp32 when interpreted  I2: bf16 tl.dot is garbage
``page_offsets``       slot -> int64 byte offsets in a 584-B page    (int32 overflow past 2^31 bytes)
``e4m3_ue8m0_blocks``  fp32 tile -> e4m3 bytes + UE8M0 bytes, with   (GPU max/min drop NaN; the policy
                       the non-finite policy (NaN block: 255, 0x7F)  is decided on the bits instead)
``ue8m0_value``        any E8M0 byte -> fp32 (0: 2^-127, 255: NaN)   none; readers of others' pages
``e4m3_decode``        e4m3fn byte -> fp32, 0x7F / 0xFF -> NaN       the interpreter decodes 0x7F as 480
``bf16_rne_bits_nan``  ``bf16_rne_bits`` + NaN -> 0x7FC0             GPU NaN 0x7FFFFFFF would round to -0
``bf16_round_nan``     fp32 -> fp32(bf16(x)), NaN -> 0x7FC00000       I4, and the NaN carry above
``canonical_nan``      fp32 NaN -> 0x7FC00000                        NaN payloads differ per device
``ue8m0_byte_bits``    amax bits -> ``ue8m0_byte`` (QMAX 448) in     none; integers only, no division
                       four integer ops
``e4m3_snap``          finite fp32 block -> e4m3 bytes at a given    I5, as ``e4m3_encode``; fewer
                       scale byte, one fma grid-snap per value       instructions per value
``e4m3_nan_codes``     the e4m3 bytes of a non-finite block          (GPU max/min drop NaN)
``e4m3_ue8m0_tile``    ``e4m3_ue8m0_blocks``' bytes; the policy runs  (per-value policy work, paid only by
                       only for a tile holding a NaN / inf block     a tile that needs it)
``e4m3_finite``        finite fp32 -> e4m3 byte; NATIVE: the cast    I5 (NATIVE is False interpreted)
``bf16_bits``          fp32 -> bf16 bits; NATIVE: the cast           I4 (NATIVE is False interpreted)
``page_offsets32``     ``page_offsets`` with an int32 slot division  (int64 division is a slow call)
``dot_e4m3``           e4m3 bytes @ e4m3 bytes, fp32 from zero       I5-like: the fp8 cast reads NaN codes
                       (NATIVE fp8 MMA compiled)                     as 480 (decoded in fp32 instead)
``e2m1_e4m3``          E2M1 code -> e4m3 byte, in integers           none; FP4 weights on an fp8 MMA
=====================  ============================================  ====================================

Arithmetic rule for all kernels (I3): ``.to(tl.float32)`` right after a bf16/fp8 load, do every add,
compare and reduction in fp32, and convert only at the store.
"""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX = 448.0  # for Python callers
_E4M3_MAX = tl.constexpr(448.0)  # for kernels: a jit function may only read constexpr globals


@triton.jit
def e4m3_encode(x):
    """fp32 tensor -> float8e4nv tensor: clamp to ±448, then round to nearest, ties to even.

    "Grid-snap": put |x| on the e4m3 grid with one fp32 add/sub (the fp32 adder rounds half-to-even
    onto a grid of spacing ``ulp``), so the final cast only converts an exactly representable value,
    which even the interpreter's cast gets right.
    """
    a = tl.minimum(tl.abs(x), _E4M3_MAX)  # clamp first: saturates ±inf/huge values, keeps c finite
    # biased fp32 exponent of |x|, floored at 121 (2^-6, the smallest normal e4m3): below it the e4m3
    # spacing is fixed at 2^-9 (subnormals).
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)
    # c = 2^(e-127) * 2^(23-3): adding and subtracting c rounds |x| to 3 mantissa bits (spacing 2^(e-130)).
    c = ((e + 20) << 23).to(tl.float32, bitcast=True)
    r = (a + c) - c  # <= 448 still: 448 is on the grid
    # Put the sign back as a bit, not by negation: compiled Triton negates as 0 - r, which turns -0.0 (and
    # every negative value that rounds to zero) into +0, where torch gives the byte 0x80.
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    y = (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return y.to(tl.float8e4nv)


@triton.jit
def ue8m0_byte(amax, FLOOR: tl.constexpr, QMAX: tl.constexpr):
    """UE8M0 scale byte for a block whose max |value| is ``amax`` (fp32), as int32 in [1, 254].

    byte = ceil(log2(max(amax, FLOOR) / QMAX)) + 127, computed on the bits of the IEEE quotient
    (docs/formats.md): the exponent field, plus one if any mantissa bit is set. No float log2, so a
    block whose amax is exactly 448·2^k gets byte 127+k, not 128+k.
    """
    s = tl.math.div_rn(tl.maximum(amax, FLOOR), QMAX)  # correctly rounded: '/' may be approximate on GPUs
    bits = s.to(tl.int32, bitcast=True)
    byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(byte, 1), 254)


@triton.jit
def pow2(byte):
    """2^(byte - 127) as fp32 for an int32 byte in [1, 254]: the float whose exponent field is ``byte``."""
    return (byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def inv_pow2(byte):
    """2^(127 - byte) as fp32 for an int32 byte in [1, 253], exactly."""
    return ((254 - byte) << 23).to(tl.float32, bitcast=True)


@triton.jit
def bf16_rne_bits(x):
    """fp32 -> the 16 bits of bf16(x), rounded to nearest, ties to even (finite inputs), as uint16.

    Store them through a ``torch.int16``/``uint16`` view of the bf16 output. ``x.to(tl.bfloat16)``
    truncates in the interpreter (I4); this is exact on every backend.
    """
    u = x.to(tl.uint32, bitcast=True)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).to(tl.uint16)


@triton.jit
def bf16_round(x):
    """fp32 -> fp32(bf16(x)) with round-to-nearest-even: the "bf16 round trip" some kernels need. Finite and ±inf
    inputs only: a value that may be NaN needs :func:`bf16_round_nan` (compiled, the NaN 0x7FFFFFFF carries
    into −0.0 here, while the interpreter's 0x7FC00000 stays NaN: a bug only a GPU shows)."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def bf16_round_nan(x):
    """:func:`bf16_round` of any fp32, NaN included: a NaN comes out the quiet NaN 0x7FC00000 (compiled NaNs are
    0x7FFFFFFF, which the rounding add would carry into −0.0). The rounding of a bf16 tensor op."""
    return bf16_round(canonical_nan(x))


@triton.jit
def dot(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a @ b with fp32 accumulation.

    ``DOT_FP32`` (set by the launcher to ``interpreting()``) upcasts bf16/fp16 operands to fp32 first:
    the interpreter multiplies bf16 bit patterns as integers (I2). bf16 values are exact in fp32 and in
    tf32, so the upcast changes nothing but speed; compiled kernels keep the native tensor-core path.
    """
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def page_offsets(slot, block_size, page_stride):
    """Byte offsets of a token's two regions in the fp8_ds_mla page layout (docs/formats.md).

    ``slot`` = page·block_size + offset (int64 or int32; −1 must be masked by the caller). Returns
    ``(data, scales)``: ``data`` is the start of the 576 data bytes (448 e4m3 + 128 bytes of bf16 RoPE),
    ``scales`` the start of the 8 scale bytes. All int64, so page·page_stride cannot overflow.
    """
    slot = slot.to(tl.int64)
    page = slot // block_size
    off = slot % block_size
    base = page * page_stride
    return base + off * 576, base + block_size * 576 + off * 8


@triton.jit
def page_offsets32(slot, block_size, page_stride):
    """:func:`page_offsets` with the slot divided in int32, for a cache of fewer than 2^31 slots (the launcher
    checks ``pages · block_size < 2^31``; a 584-byte token makes that a 1.25 TB cache). The products that
    address bytes, ``page · page_stride`` and the offsets inside a page, stay int64."""
    s = slot.to(tl.int32)
    page = s // block_size
    off = (s - page * block_size).to(tl.int64)
    base = page.to(tl.int64) * page_stride
    # block_size · 576 in int32 (< 2^31 by the launcher's check), widened by the int64 sum; no .to() on it: a
    # compiled launch specialises block_size == 1 to the Python int 1, which has no .to()
    return base + off * 576, (base + off * 8) + block_size * 576


@triton.jit
def splat(cond, like):
    """A scalar condition as a boolean tensor of ``like``'s shape, for use in load/store masks.

    In the interpreter (seen in Triton 3.9) ``scalar_bool & tensor_bool`` comes out as an integer
    array, which ``tl.load``/``tl.store`` reject with "mask has unsupported dtype". Widening the scalar
    to a tensor first keeps the mask boolean on every backend.
    """
    return (tl.zeros_like(like).to(tl.int32) + cond.to(tl.int32)) != 0


# ---- the non-finite policy (docs/formats.md#non-finite-values) ------------------------------------------
# Decided on the bits, never with float compares or tl.max/tl.minimum (compiled, those may drop a NaN).


@triton.jit
def nonfinite(x):
    """fp32 tensor -> bool tensor: NaN or ±inf (the exponent field is all ones)."""
    return (x.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000


@triton.jit
def e4m3_ue8m0_blocks(x, FLOOR: tl.constexpr, AXIS: tl.constexpr):
    """Block-quantise fp32 ``x``, one block per slice along ``AXIS``: ``(q, byte)`` with ``q`` the e4m3 bytes
    (uint8, x's shape) and ``byte`` the UE8M0 scale bytes (int32, x's shape without ``AXIS``).

    Finite blocks: :func:`ue8m0_byte` of max|x| (floored at ``FLOOR``), then ``e4m3(x · 2^(127 − byte))``.
    A block holding any NaN or ±inf gets byte 255 (E8M0's NaN) and every e4m3 byte of it is NaN: 0x7F, or
    0xFF where the value is not a NaN and its sign bit is set. So it reads back as NaN, never as a number.

    max|x| is taken on the bits (|x| as int32 orders like the float, NaN and inf on top): one integer
    reduction finds both the scale and the non-finite blocks, the same on every device (a float max may
    drop a NaN), and x dies before the encoder runs (a kernel tile of 8 KV tokens stays in registers).
    """
    mag = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=AXIS)  # |x| bits: >= 0x7F800000 is NaN / inf
    bad = mag >= 0x7F800000
    # a NaN / inf block is encoded at scale 1, for the signs of its codes only (its byte would be 254, and
    # 2^-127 is not an fp32: inf · 0 would lose the sign of an inf)
    byte = tl.where(bad, 127, ue8m0_byte(mag.to(tl.float32, bitcast=True), FLOOR, _E4M3_MAX))
    # × 2^-e is exact; a NaN is made the positive quiet NaN first, so its code carries no sign on any device
    q = e4m3_encode(canonical_nan(x * tl.expand_dims(inv_pow2(byte), AXIS))).to(tl.uint8, bitcast=True)
    return tl.where(tl.expand_dims(bad, AXIS), q | 0x7F, q), tl.where(bad, 255, byte)


@triton.jit
def e4m3_ue8m0_tile(x, FLOOR: tl.constexpr, AXIS: tl.constexpr, NATIVE: tl.constexpr):
    """:func:`e4m3_ue8m0_blocks` with the same bytes for every input, at the cost of the finite encoder when the
    whole tile is finite: one max of the |x| bits per block (the amax the scale needs anyway) says whether a
    block holds a NaN or ±inf, and one branch per tile (the same for every thread of the program) sends a tile
    with such a block to :func:`e4m3_ue8m0_blocks`. A finite tile skips the policy's per-value work
    (``canonical_nan``, the NaN-code select): there ``ue8m0_byte(amax)`` and ``e4m3(x · 2^(127 − byte))`` are
    exactly what :func:`e4m3_ue8m0_blocks` computes, with ``e4m3`` the hardware's conversion when ``NATIVE``
    (compiled only; see :func:`e4m3_finite`).

    The amax is an integer max, as in :func:`e4m3_ue8m0_blocks`: |x| as int32 orders like the float, NaN and inf
    on top, so it is the bits of a NaN-propagating float max for every input (a float ``tl.max`` may drop a
    NaN; a ``tl.reduce`` with a NaN-propagating combiner runs one Python call per element in the interpreter)."""
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=AXIS)  # >= 0x7F800000: a NaN or ±inf block
    bad = (amax >= 0x7F800000).to(tl.int32)
    if tl.max(bad) == 0:
        byte = ue8m0_byte_bits(amax, FLOOR)  # amax finite here: its bits
        q = e4m3_finite(x * tl.expand_dims(inv_pow2(byte), AXIS), NATIVE)
    else:
        q, byte = e4m3_ue8m0_blocks(x, FLOOR, AXIS)
    return q, byte


@triton.jit
def e4m3_finite(x, NATIVE: tl.constexpr):
    """fp32 with |x| <= 448 (finite) -> its e4m3fn byte (uint8), round to nearest even: :func:`e4m3_encode`, or
    with ``NATIVE`` the compiled cast (``cvt.rn.satfinite.e4m3x2.f32``: one instruction for two values, where
    the grid-snap takes about eight per value). The compiled cast is exact: on the H200 it gives torch's byte
    for every finite bf16, every e4m3 tie and its neighbours, signed zeros and subnormals
    (``tests/test_tl_helpers.py::test_raw_triton_fp8_cast_is_exact``). ``NATIVE`` must be False in the
    interpreter, whose cast misrounds (I5); launchers pass ``not interpreting()``."""
    if NATIVE:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return e4m3_encode(x).to(tl.uint8, bitcast=True)


@triton.jit
def bf16_bits(x, NATIVE: tl.constexpr):
    """fp32 (not NaN) -> the bits of bf16(x), round to nearest even, as int32 in [0, 65535]: :func:`bf16_rne_bits`,
    or with ``NATIVE`` the compiled cast (``cvt.rn.bf16x2.f32``, two values per instruction), exact on the H200
    (``tests/test_tl_helpers.py::test_raw_triton_bf16_cast_rounds``). ``NATIVE`` must be False in the interpreter,
    whose cast truncates (I4). A NaN gives a different NaN per path: callers select 0x7FC0 for it."""
    if NATIVE:
        return x.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        return bf16_rne_bits(x).to(tl.int32)


@triton.jit
def ue8m0_value(byte):
    """Any UE8M0 (E8M0) scale byte -> its fp32 value: 2^(byte − 127) for 1..254, 2^-127 (an fp32
    subnormal, 0x00400000) for 0, NaN for 255. For readers, which must read pages other writers made."""
    b = byte.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_decode(code):
    """e4m3fn byte (uint8) -> fp32, exactly, NaN codes included: 0x7F / 0xFF give NaN (Triton 3.9's
    interpreter decodes them as ±480; compiled, the cast is right and the select costs one instruction)."""
    x = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    nan = (code.to(tl.int32) & 0x7F) == 0x7F
    return tl.where(nan, 0x7FC00000, x.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def bf16_rne_bits_nan(x):
    """:func:`bf16_rne_bits` for every input: ±inf stay ±inf, every NaN gives 0x7FC0. (Compiled, a NaN
    product is 0x7FFFFFFF, which the rounding add would carry into -0.0.)"""
    nan = (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, 0x7FC0, bf16_rne_bits(x).to(tl.int32)).to(tl.uint16)


@triton.jit
def canonical_nan(y):
    """fp32 -> fp32 with every NaN made the quiet NaN 0x7FC00000 (devices differ in NaN payloads)."""
    bits = y.to(tl.int32, bitcast=True)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, 0x7FC00000, bits).to(tl.float32, bitcast=True)


# ---- a cheaper encoder for finite blocks (MoE staging's encoder) -----------------------------
# The same bytes as e4m3_ue8m0_blocks, in fewer instructions per value: the scale byte from the amax bits with
# integers only (no division), one fma grid-snap per value with the rounding grid read off x's own exponent,
# and no per-value non-finite work (the caller overwrites a non-finite block with e4m3_nan_codes / byte 255,
# only in a tile that holds one). Compiled for sm_90a, e4m3_snap is 6.5 SASS instructions per value (and, on
# half of it, the integer ALU pipe 3): and, max, add, fma, sub, or, half a cvt. A whole staging tile with it
# runs 13–17 instructions per value against 27 with e4m3_ue8m0_blocks (benchmarks/experiments/moe_stage_compile_check.py).


@triton.jit
def ue8m0_byte_bits(amax_bits, FLOOR: tl.constexpr):
    """:func:`ue8m0_byte` with QMAX = 448 from the int32 bits of a finite amax >= 0: four integer operations.

    With a = M·2^E (M in [1, 2)), a / 448 = (M / 1.75)·2^(E − 8) and M / 1.75 lies in [0.57, 1.15), so
    ceil(log2(a / 448)) = E − 8 + (M > 1.75); M > 1.75 is a mantissa field above 0x600000, which adding
    0x1FFFFF carries into the exponent field. This is exact for every normal a, and it is what ``ue8m0_byte``
    reads off the correctly rounded fp32 quotient: that quotient never rounds onto a power of two from above
    (for M > 1.75, M / 1.75 >= 1 + 0.57·2^-23 rounds to >= 1 + 2^-23) nor reaches 1/2 (M / 1.75 >= 0.57). The
    floor (1e-4) gives 105 and the largest bf16 247, so the [1, 254] clamp of ``ue8m0_byte`` never acts.
    """
    floor_bits = tl.full([], FLOOR, tl.float32).to(tl.int32, bitcast=True)
    return ((tl.maximum(amax_bits, floor_bits) + 0x1FFFFF) >> 23) - 8


@triton.jit
def e4m3_snap(x, byte):
    """e4m3 bytes (uint8) of x · 2^(127 − byte) for finite fp32 ``x`` whose block scale byte is ``byte`` (int32,
    broadcast against x), round to nearest, ties to even: the bytes :func:`e4m3_encode` gives for a block
    whose byte came from its own amax (so |x · 2^(127 − byte)| <= 448 and no clamp is needed).

    Grid-snap as in ``e4m3_encode``: c = 2^(max(e_y, −6) + 20), with e_y the exponent of y = x · 2^d
    (d = 127 − byte), and r = (|x| · 2^d + c) − c rounds |y| onto the e4m3 grid of its binade. e_y is read
    off x's own bits: max(E_x + d, 121) + 20 = max(E_x, byte − 6) + (147 − byte) as biased exponent fields, so
    per value this is one and, one max, one add, an fma, a subtraction and the sign or-ed back as a bit (so
    −0.0 and the negative values that round to zero keep their sign, as torch's cast does). The product
    |x| · 2^d is exact (a power-of-two scaling), so the GPU's fused multiply-add and the interpreter's separate
    multiply and add round the same sum once; where the product would underflow fp32 it lies far below half
    the grid spacing (2^-10) and both give 0. Not for NaN / ±inf.
    """
    xb = x.to(tl.int32, bitcast=True)
    c = (tl.maximum(xb & 0x7F800000, (byte - 6) << 23) + ((147 - byte) << 23)).to(tl.float32, bitcast=True)
    r = (tl.abs(x) * inv_pow2(byte) + c) - c
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def e4m3_nan_codes(xb):
    """The e4m3 byte of each value of a non-finite block, from its fp32 bits (int32): 0x7F, or 0xFF where the
    value is not a NaN and its sign bit is set (the bytes e4m3_ue8m0_blocks writes there)."""
    nan = (xb & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, 0x7F, ((xb >> 24) & 0x80) | 0x7F).to(tl.uint8)


# ---- e4m3 matrix products (dsv4ref.linear) -----------------------------------------------------------------


@triton.jit
def dot_e4m3(a, b, DOT_FP32: tl.constexpr):
    """``a @ b`` for e4m3 bytes (uint8) ``a [M, K]``, ``b [K, N]``: an fp32 ``[M, N]`` accumulated from zero.

    Compiled: the operands are reinterpreted as ``float8e4nv`` and multiplied on the tensor cores (an fp8 MMA
    on Hopper). ``DOT_FP32`` (the launcher's ``interpreting()``): both are decoded to fp32 with
    :func:`e4m3_decode` (NaN codes as NaN; the interpreter's fp8 cast reads them as ±480) and multiplied in
    ieee fp32, exact per product (e4m3 · e4m3 has at most 8 significant bits)."""
    if DOT_FP32:
        return tl.dot(e4m3_decode(a), e4m3_decode(b), input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float8e4nv, bitcast=True), b.to(tl.float8e4nv, bitcast=True))


@triton.jit
def e2m1_e4m3(code):
    """E2M1 codes (int32 0..15) -> the e4m3 byte of the same value (uint8), exactly, in integers.

    A magnitude code c = 2E + M (E >= 1) is (1 + M/2)·2^(E−1): e4m3 exponent field E + 6, mantissa M·4, so the
    byte is 8(E + 6) + 4M = 4c + 48; code 1 (0.5, E2M1's subnormal) is 0x30 and code 0 is 0. The sign is bit 3
    of the code and bit 7 of the byte."""
    mag = code & 7
    byte = tl.where(mag >= 2, 4 * mag + 48, mag * 48)
    return (byte | ((code & 8) << 4)).to(tl.uint8)
