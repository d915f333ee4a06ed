# %% [markdown]
# # 09 · The number formats of V4's projections: FP8 and FP4 linears
#
# DeepSeek-V4's config says `"dtype": "fp8"`, `"scale_fmt": "ue8m0"`, `"expert_dtype": "fp4"`. So almost every
# projection weight is **e4m3 with one power-of-two scale per 128x128 tile**, the routed experts' weights are
# **E2M1 (4 bits) with one power-of-two scale per 32 values**, and the activations that meet them are
# quantised on the fly to **e4m3 with one scale per 1x128 block**. This notebook takes the recipe apart:
# the byte layouts, why the blocks have the shapes they have, the order in which the GEMM accumulates, and
# the library's op, `dsv4ref.linear`, held to a float64 oracle. The facts are written up in `docs/linear.md`.

# %%
import dsv4ref  # noqa: F401  (first: picks the device, sets TRITON_INTERPRET on a CPU-only machine)
import warnings

warnings.filterwarnings("ignore")
import inspect

import numpy as np
import torch

from dsv4ref import linear
from dsv4ref.device import DEVICE, describe
from dsv4ref.linear import reference
from dsv4ref.testing import compare, randn

# %%
# NBVAL_IGNORE_OUTPUT
print(describe())

# %% [markdown]
# ## 1. Which weight is which
#
# | weights | format |
# |---|---|
# | attention `wq_a`, `wq_b`, `wkv`, `wo_b`; indexer `wq_b`; shared expert `w1/w2/w3`; MTP `e_proj`, `h_proj` | FP8: e4m3 + UE8M0 per 128x128 |
# | routed experts `w1/w2/w3` | FP4: E2M1 packed two a byte + UE8M0 per 1x32 |
# | attention `wo_a` (grouped), indexer `weights_proj` | bf16 |
# | compressor `wkv`, `wgate`, `ape`; the head; `attn_sink`; the gate's bias | fp32 |
#
# A linear with an FP8 or FP4 weight first quantises its input (`act_quant`), then multiplies (`fp8_gemm`,
# `fp4_gemm`); anything else is a plain `F.linear`.
#
# ## 2. The byte layouts
#
# **e4m3** is `S EEEE MMM` (bias 7, no infinities, 0x7F / 0xFF NaN, largest 448; notebook 01 draws it).
# **UE8M0** is one exponent byte: b means 2^(b − 127), nothing else. **E2M1** is `S E1 E0 M`, bias 1, eight
# magnitudes:

# %%
codes = torch.arange(16, dtype=torch.uint8, device=DEVICE)
for c, v in zip(codes.tolist(), linear.e2m1_decode(codes).tolist()):
    print(f"code {c:2d} = 0b{c:04b} -> {v:+g}")

# %% [markdown]
# Two codes share a byte, and the order matters: element 2j goes in the **low** nibble, element 2j + 1 in the
# high one. Packing the codes 0..15 gives bytes whose hex digits read backwards:

# %%
packed = linear.pack_e2m1(codes)
print([f"0x{b:02X}" for b in packed.tolist()])
print("unpacked again:", linear.unpack_e2m1(packed).tolist())

# %% [markdown]
# Encoding clamps to ±6 and rounds to the nearest value, ties to the **even code**. The ties are where a
# port goes wrong: 0.25 lies between codes 0 and 1 and goes to 0; 0.75 between 1 and 2 goes to 2 (= 1.0);
# 2.5 goes to 2.0 (code 4), 5 to 4.0 (code 6):

# %%
ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1], device=DEVICE)
for y, c in zip(ties.tolist(), linear.e2m1_encode(ties).tolist()):
    print(f"{y:+5g} -> code {c:2d} = {linear.e2m1_decode(torch.tensor([c])).item():+g}")

# %% [markdown]
# ## 3. One scale rule, three block shapes
#
# Every block gets the smallest power of two that fits its largest value into the format's range:
# byte = ceil(log2(max(amax, floor) / QMAX)) + 127, computed from the bits of the fp32 quotient (exponent
# field, plus one if any mantissa bit is set), so a block whose amax is exactly 448·2^k gets 2^k.
#
# * **activations, 1x128 along K**, QMAX 448, floor 1e-4: an activation row changes every token, so it is
#   quantised on the fly, one token's 128 channels per scale; an outlier channel coarsens only its block.
# * **FP8 weights, 128x128**, QMAX 448: quantised once; a GEMM tile of 128 output rows reads one weight scale
#   per K block, and the scales cost 1/16 384 of the weight.
# * **FP4 weights, 1x32**, QMAX 6: eight magnitudes cannot absorb a wide block, so the blocks are small (the
#   MX format's 32).
#
# Here is `act_quant` on a row with a zero block, a block below the floor and a block whose amax is 448·2^3:

# %%
x = torch.zeros(1, 384, device=DEVICE)
x[0, 128:256] = torch.linspace(-5e-5, 9e-5, 128, device=DEVICE)
x[0, 256:] = torch.linspace(-1, 1, 128, device=DEVICE) * 400 * 8
x[0, 300] = 448 * 8
q, s = linear.act_quant(x)
print("scales:", [f"2^{int(v)}" for v in torch.log2(s[0]).tolist()])
print("the 448·2^3 value is code", hex(q.view(torch.uint8)[0, 300].item()), "(0x7E = 448, the largest)")

# %% [markdown]
# ## 4. A dozen lines of numpy, byte for byte
#
# The whole FP4 weight quantiser, written from the rule above with nothing from the library, and held to
# `linear.quantize_fp4_weight` byte for byte:


# %%
def numpy_fp4_weight(w):
    """[N, K] float -> (packed uint8 [N, K/2], UE8M0 bytes [N, K/32])."""
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    blocks = w.astype(np.float32).reshape(w.shape[0], -1, 32)
    amax = np.maximum(np.abs(blocks).max(-1), np.float32(6 * 2.0**-126))
    m, e = np.frexp(amax / np.float32(6))  # s = m·2^e, m in [0.5, 1): ceil(log2 s) = e, or e - 1 if m == 0.5
    e = np.where(m == 0.5, e - 1, e)
    y = np.minimum(np.abs(blocks) / np.ldexp(1.0, e)[..., None], 6)
    d = np.abs(y[..., None] - grid)
    near = (d == d.min(-1, keepdims=True)) * (8 - np.arange(8) % 2 * 4)  # ties: prefer the even code
    code = near.argmax(-1) | (np.signbit(blocks) << 3)
    code = code.reshape(w.shape[0], -1).astype(np.uint8)
    return code[:, 0::2] | (code[:, 1::2] << 4), (e + 127).astype(np.uint8)


w = randn((64, 256), seed=9, dtype=torch.float32, block=32, octaves=20) * 0.02
mine_p, mine_s = numpy_fp4_weight(w.cpu().numpy())  # host: numpy runs on the CPU
lib_p, lib_s = linear.quantize_fp4_weight(w)
print("packed bytes:", compare(lib_p.view(torch.uint8).cpu(), torch.from_numpy(mine_p), "exact", "numpy vs library").verdict())
print("scale bytes: ", compare(lib_s.view(torch.uint8).cpu(), torch.from_numpy(mine_s), "exact", "numpy vs library").verdict())

# %% [markdown]
# ## 5. The accumulation order
#
# The GEMM does not simply dequantise and multiply. Per 128-wide K block it multiplies the e4m3 codes
# (exactly: a product of two e4m3 values has at most 8 significant bits), sums the block **from zero**,
# scales that partial sum by the two power-of-two scales (exact), and adds it to a **second** fp32
# accumulator:

# %%
print(inspect.getsource(reference.blockwise_gemm))
print(inspect.getsource(reference.fp8_gemm))

# %% [markdown]
# Why two accumulators: a Hopper fp8 MMA keeps its running sum with fewer bits than fp32 (about 14, by
# DeepSeek-V3's report). A 128-term block stays short enough; the sum over K = 7168 would not. The FP4 GEMM
# is the same over 32-wide blocks (one scale per 32 weights), with the E2M1 codes turned into e4m3 bytes for
# the MMA, which is exact: every E2M1 value is an e4m3 value.
#
# What rounds, then, is only the fp32 sums and the final bf16. The tolerance `linear_out` bounds both against
# the float64 oracle of the same quantised operands: |y − oracle| ≤ 2^-8·(|oracle| + mass), mass = Σ|q·w|·scales.

# %% [markdown]
# ## 6. The kernels against the oracle
#
# The Triton kernels (fp8 MMAs when compiled; fp32-decoded operands in the interpreter) at decode shapes, a K
# that is not a multiple of 128 among them:

# %%
for m, n, k in ((1, 256, 512), (24, 136, 300)):
    x = randn((m, k), seed=m, block=128, octaves=20)
    qx, sx = reference.act_quant(x)
    for fmt in ("fp8", "fp4"):
        wq, ws = (linear.quantize_fp4_weight if fmt == "fp4" else linear.quantize_fp8_weight)(
            randn((n, k), seed=n, dtype=torch.float32) * 0.02
        )
        y = (linear.fp4_linear if fmt == "fp4" else linear.fp8_linear)(x, wq, ws, backend="triton")
        gemm = reference.fp4_gemm if fmt == "fp4" else reference.fp8_gemm
        oracle = gemm(qx, sx, wq, ws, dtype=torch.float64)
        mass = reference.gemm_mass(qx, sx, wq, ws, fp4=fmt == "fp4")
        print(compare(y, oracle, "linear_out", f"{fmt}_linear M={m} N={n} K={k}", mass=mass).verdict())
q_t, s_t = linear.act_quant(x, backend="triton")
print(compare(q_t, qx, "exact", "act_quant e4m3 bytes, Triton vs reference").verdict())
print(compare(s_t, sx, "exact", "act_quant scales, Triton vs reference").verdict())

# %% [markdown]
# The tolerance has teeth: the same check on an answer whose activation scales are taken one K block off
# fails, and so does an FP4 weight with its nibbles swapped:

# %%
m, n, k = 8, 256, 512
x = randn((m, k), seed=3, block=128, octaves=20)
qx, sx = reference.act_quant(x)
w8, s8 = linear.quantize_fp8_weight(randn((n, k), seed=4, dtype=torch.float32) * 0.02)
oracle = reference.fp8_gemm(qx, sx, w8, s8, dtype=torch.float64)
mass = reference.gemm_mass(qx, sx, w8, s8)
print(compare(reference.fp8_gemm(qx, sx.roll(1, 1), w8, s8), oracle, "linear_out", "scales one K block off", mass=mass).verdict())
w4, s4 = linear.quantize_fp4_weight(randn((n, k), seed=5, dtype=torch.float32) * 0.02)
swapped = ((w4.view(torch.uint8) >> 4) | (w4.view(torch.uint8) << 4)).view(w4.dtype)
oracle4 = reference.fp4_gemm(qx, sx, w4, s4, dtype=torch.float64)
mass4 = reference.gemm_mass(qx, sx, w4, s4, fp4=True)
print(compare(reference.fp4_gemm(qx, sx, swapped, s4), oracle4, "linear_out", "nibbles swapped", mass=mass4).verdict())

# %% [markdown]
# ## 7. What the formats cost in accuracy
#
# Against the **unquantised** product (bf16 activations times the fp32 weights before quantisation), the
# formats themselves are the error: e4m3 keeps 3 mantissa bits (half a step: ≤ 2^-4 relative per value), E2M1
# one. Relative L2 error of a projection's output, per format:

# %%
x = randn((16, 512), seed=11, block=128, octaves=4)
w = randn((128, 512), seed=12, dtype=torch.float32, block=None, octaves=0) * 0.03
exact = x.double() @ w.double().T
for fmt in ("fp8", "fp4"):
    wq, ws = (linear.quantize_fp4_weight if fmt == "fp4" else linear.quantize_fp8_weight)(w)
    y = (linear.fp4_linear if fmt == "fp4" else linear.fp8_linear)(x, wq, ws)
    err = ((y.double() - exact).norm() / exact.norm()).item()
    print(f"{fmt}: relative L2 error of the output in [2^{int(np.floor(np.log2(err)))}, 2^{int(np.floor(np.log2(err))) + 1})")

# %% [markdown]
# ## 8. The error the formats add to a decode step
#
# The Decoder takes a `weight_format`: `"v4"` sends every FP8 projection through `fp8_linear` and the routed
# experts through FP4, `"bf16"` runs plain bf16 GEMMs. `dsv4ref.decode.format_error` runs the **same** model
# both ways (the v4 weights, and their exact dequantisation to bf16), so what differs is only the formats of
# the computation: the activation quantiser and the FP8 / FP4 products. The v4 run is fed the bf16 run's
# tokens, so each step compares the logits of the same inputs. On the teaching config, two requests, a prefill
# and one decode step:

# %%
from dsv4ref.config import TINY
from dsv4ref.decode import format_error

fe = format_error(TINY, steps=1, prompt_lens=(5, 3), oracle=False)

# %%
# NBVAL_IGNORE_OUTPUT
for st in fe.steps:
    print(
        f"{'prefill' if st.step < 0 else 'step ' + str(st.step)}: logits relative L2, v4 vs bf16 = {st.v4_vs_bf16:.3f}; same top-1 {st.top1}/{st.n}"
    )

# %%
print("every step within 2^-2 relative L2 of the bf16 run:", all(st.v4_vs_bf16 < 0.25 for st in fe.steps))
print("greedy tokens part at (None = never, in these steps):", fe.parted)
