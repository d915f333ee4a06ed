# %% [markdown]
# # 01 · UE8M0 FP8 and the 584-byte paged KV cache
#
# DeepSeek-V4 keeps its attention KV cache in **8 bits per value**. Each token's 512-dim latent row is split
#
# * dims 0..447 (the "NoPE" part): **FP8 e4m3**, in 7 blocks of 64 values, each block with one
#   **UE8M0** scale, a byte that means a pure power of two, 2^(byte − 127);
# * dims 448..511 (the rotary part, already rotated): kept as **bf16**, bit for bit;
#
# and stored in a **paged** cache whose pages are a *structure of arrays*: a token's 584 bytes live in two
# separate places of its page. This notebook builds it up in the usual order: the number format (what e4m3
# can say, why the scale is a power of two, the one rounding rule that matters), then the library's reference
# and Triton kernels (`dsv4ref/fp8/`, `dsv4ref/kv_cache/`), then the checks, then the gallery of real
# bugs this format caused, then the performance story. The facts are written up in `docs/formats.md` (every
# byte map) and `docs/kv_cache.md` (the cache's math, conventions and pitfalls).

# %%
import dsv4ref  # first: picks the device, sets TRITON_INTERPRET on a CPU-only machine
import warnings

warnings.filterwarnings("ignore")
import numpy as np

np.seterr(all="ignore")
import inspect
import math

import matplotlib.pyplot as plt
import torch

# %matplotlib inline
from dsv4ref import fp8, kv_cache, validate
from dsv4ref.device import DEVICE, describe
from dsv4ref.testing import compare, generator, randn
from dsv4ref.tl.kv_record import kv_record

# %%
# NBVAL_IGNORE_OUTPUT
print(describe())

# %% [markdown]
# ## 1. What e4m3 can represent
#
# An e4m3 byte is `S EEEE MMM`: a sign, a 4-bit exponent with bias 7, and 3 mantissa bits. Normal codes
# (E ≥ 1) mean (1 + M/8)·2^(E−7); E = 0 gives the subnormals (M/8)·2^−6. The "fn" flavour (OCP, torch's
# `float8_e4m3fn`, Triton's `float8e4nv`) has **no infinities**: only `0x7F`/`0xFF` are NaN, which buys one
# more finite binade, up to **448** = 1.75·2^8. Decode every byte and look:

# %%
codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
vals = codes.view(torch.float8_e4m3fn).float()
finite = torch.isfinite(vals)
print("finite codes:", int(finite.sum()), "   NaN codes:", [hex(c) for c in codes[~finite].tolist()])
pos = vals[:127]  # codes 0x00..0x7E: +0 and the 126 positive values, in increasing order
print(
    "max:",
    pos.max().item(),
    "= code",
    hex(int(pos.argmax())),
    "  smallest normal:",
    pos[8].item(),
    "  smallest subnormal:",
    pos[1].item(),
)
print("+0 is", hex(0), "and -0 is", hex(0x80), "-> value", vals[0x80].item())

# %% [markdown]
# The grid is **logarithmic with 8 steps per octave**: each binade [2^k, 2^(k+1)) holds 8 equally spaced
# values, so the relative spacing is between 1/16 and 1/8, and rounding to nearest loses at most half a step:
# a relative error ≤ 2^−4 for normal numbers. Below 2^−6 the spacing stays fixed at 2^−9 (subnormals), so the
# relative error grows.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
p = pos[1:].numpy()
axes[0].semilogy(range(1, 127), p, ".", ms=4)
axes[0].axhline(2**-6, color="gray", ls=":", lw=1)
axes[0].text(2, 2**-5.6, "smallest normal 2^-6", fontsize=8, color="gray")
axes[0].set_xlabel("code (0x01 .. 0x7E)")
axes[0].set_ylabel("value")
axes[0].set_title("the 126 positive e4m3fn values")
spacing = np.diff(pos.numpy())
axes[1].loglog(pos[:-1].numpy()[1:], spacing[1:] / pos[:-1].numpy()[1:], ".", ms=4)
axes[1].axhline(2**-3, color="gray", ls=":", lw=1)
axes[1].axhline(2**-4, color="gray", ls=":", lw=1)
axes[1].set_xlabel("value x")
axes[1].set_ylabel("gap to next value / x")
axes[1].set_title("relative spacing: 1/16 .. 1/8 for normals")
plt.tight_layout()
plt.show()

# %% [markdown]
# **Encoding** (`docs/formats.md#fp8-e4m3fn`) is: clamp to ±448, then round to nearest, ties to even. The clamp is part of the
# contract: torch 2.11 turns 500 into NaN while torch 2.13 saturates, and Triton's interpreter turns 464
# into a NaN code, so every writer clamps first. The library's reference is one line:

# %%
print(inspect.getsource(fp8.reference.e4m3_encode))
x = torch.tensor([1.0, 17.0, 19.0, 232.0, 248.0, 448.0, 464.0, 500.0, -500.0, 2**-10, 3 * 2**-10, -0.0])
enc = fp8.reference.e4m3_encode(x)
for a, b, v in zip(x.tolist(), enc.view(torch.uint8).tolist(), enc.float().tolist()):
    print(f"{a:>12g} -> 0x{b:02X} = {v:g}")

# %% [markdown]
# 17 and 19 sit exactly halfway between grid points (16 | 18 | 20): ties go to the **even** code, so 17 → 16
# and 19 → 20. Triton's own fp32 → fp8 cast in the CPU interpreter gets ties, carries and subnormals wrong
# (`docs/triton_interpreter.md`), so the kernels use `dsv4ref.tl.e4m3_encode`, which first snaps |x| onto the e4m3 grid with
# one fp32 add and subtract, and only then casts a value that is already exact.
#
# ## 2. Why the scale is a power of two
#
# 448 is a small range, so real activations are scaled per block of 64 values: store q = e4m3(x / s) and one
# scale s. DeepSeek-V4 restricts s to **powers of two**, stored as a UE8M0 byte b meaning 2^(b − 127)
# (`torch.float8_e8m0fnu`). Two consequences:
#
# * dividing by s and multiplying back are **exact**: they only change the exponent field;
# * so dequantisation x̂ = decode(q) · 2^e is exactly representable in fp32 **and in bf16** (3 mantissa bits
#   fit in bf16's 7). Every implementation must then agree bit for bit, which makes testing easy.
#
# With an arbitrary fp32 scale (amax/448, say) the product needs up to 3 + 24 significant bits; bf16 has 8:

# %%
xs = randn((64, 448), seed=1, octaves=16)  # bf16 rows, per-64 block scales over 16 octaves
q, sb = fp8.quantize_ue8m0(xs, backend="reference")
exact = q.double().reshape(64, 7, 64) * torch.exp2(sb.double() - 127)[..., None]
pow2_bf16 = fp8.dequantize_ue8m0(q, sb, backend="reference").double().reshape(64, 7, 64)
print(
    "power-of-two scales: bf16 dequant values that differ from the exact product:",
    int((pow2_bf16 != exact).sum()),
    "of",
    exact.numel(),
)

# an fp32 scale with a mantissa; div_rn, not `/ 448`: CUDA turns `tensor / 448` into `tensor · fp32(1/448)`
s_any = fp8.reference.div_rn(xs.float().reshape(64, 7, 64).abs().amax(-1), 448)
q_any = fp8.reference.e4m3_encode(xs.float().reshape(64, 7, 64) / s_any[..., None])
exact_any = q_any.double() * s_any.double()[..., None]
bf16_any = (q_any.float() * s_any[..., None]).to(torch.bfloat16).double()
print(
    "arbitrary fp32 scales: bf16 dequant values that differ from the exact product:",
    int((bf16_any != exact_any).sum()),
    "of",
    exact_any.numel(),
)

# %% [markdown]
# The flip side is **pitfall #2**: a kernel that *assumes* power-of-two scales and keeps only the exponent
# silently drops the mantissa of any other scale, a factor between 0.5 and 1 (about 25% on average):

# %%
trunc = torch.exp2(torch.floor(torch.log2(s_any)))  # what an exponent-only reader makes of 1.m·2^e
ratio = (trunc / s_any).flatten()
print(
    f"exponent-only reading of fp32 scales: values scaled by {ratio.min().item():.2f} .. {ratio.max().item():.2f}, "
    f"mean {ratio.mean().item():.2f}"
)

# %% [markdown]
# ## 3. The ceil rule, computed exactly
#
# For a block with largest magnitude amax (`docs/formats.md#ue8m0-scales`):
#
# $$s = \mathrm{fp32}\!\left(\frac{\max(\mathrm{amax}, 10^{-4})}{448}\right),\qquad
#   e = \lceil \log_2 s \rceil,\qquad \mathrm{byte} = e + 127 .$$
#
# **Ceil**, so that amax / 2^e ≤ 448 and nothing clips; and the largest element lands in (224, 448], so the
# block uses the top binade of the grid. The floor 1e-4 gives all-zero blocks a finite scale (byte 105).
# dsv4ref computes the ceiling from the **bits** of s, never with a float log2: the exponent field, plus one
# if any mantissa bit is set.

# %%
print(inspect.getsource(fp8.reference.ue8m0_byte))
amax = torch.tensor([0.0, 0.01, 1.0, 1.75, 3.0, 448.0, 449.0])
print("amax:", amax.tolist())
print("byte:", fp8.reference.ue8m0_byte(amax).tolist(), " (docs/formats.md: 105 112 119 119 120 127 128)")

# %% [markdown]
# The dangerous inputs are blocks whose amax is **exactly 448·2^k** (448, 224, 1.75, …): then s is an exact
# power of two and log2(s) is an integer, where a fast or approximate log2 may return k + ε, and ceil then
# gives k + 1. Other rules go wrong elsewhere: round() and floor() under-scale, so the largest elements
# exceed 448 and get clipped. Compare four rules on blocks whose amax is 448·2^k, and on random blocks:


# %%
def rule_bytes(amax, rule):
    s = fp8.reference.div_rn(amax.double().clamp(min=1e-4), 448)
    l2 = torch.log2(s)
    e = {
        "bits (dsv4ref)": None,
        "ceil(log2 + eps)": torch.ceil(l2 + 1e-6),
        "round(log2)": torch.round(l2),
        "floor(log2)": torch.floor(l2),
    }[rule]
    return fp8.reference.ue8m0_byte(amax) if e is None else (e + 127).to(torch.uint8)


def quantise_with(x, byte):  # x [n, 64] fp32; returns dequantised values with this scale byte
    e = byte.double() - 127
    y = x.double() / torch.exp2(e)[:, None]
    return fp8.reference.e4m3_encode(y.float()).double() * torch.exp2(e)[:, None], y


g = generator(2)
blocks_pow2 = torch.randn(41, 64, generator=g).clamp(-1, 1) * 300 * torch.exp2(torch.arange(-20.0, 21))[:, None]
blocks_pow2[:, 0] = 448 * torch.exp2(torch.arange(-20.0, 21))
blocks_rand = torch.randn(200, 64, generator=g) * torch.exp2(torch.randint(-16, 17, (200, 1), generator=g).float())
good = {}
print(f"{'rule':<18} {'bytes at amax=448*2^k: k = -1, 0, 1':<36} {'wrong bytes (pow2 / random)':>28} {'clipped values':>15}")
for rule in ["bits (dsv4ref)", "ceil(log2 + eps)", "round(log2)", "floor(log2)"]:
    row = []
    for blocks in (blocks_pow2, blocks_rand):
        b = rule_bytes(blocks.abs().amax(1), rule)
        if rule == "bits (dsv4ref)":
            good[blocks.shape[0]] = b
        _, y = quantise_with(blocks, b)
        row.append((int((b != good[blocks.shape[0]]).sum()), int((y.abs() > 448).sum())))
    show = rule_bytes(torch.tensor([224.0, 448.0, 896.0]), rule).tolist()
    print(f"{rule:<18} {str(show):<36} {f'{row[0][0]} / {row[1][0]}':>28} {row[0][1] + row[1][1]:>15}")

# %% [markdown]
# The ε-rule agrees everywhere **except** at exact powers of two, so random test data never catches it: the
# tests include amax = 448·2^k for k = −20..20 (pitfall #3). Its cost there is one bit of precision per block
# (the largest element lands at 224 instead of 448). round() and floor() clip values at ±448: large errors.
#
# ## 4. Quantise and dequantise: the library calls
#
# `quantize_ue8m0(x, block=64, amax_floor=1e-4)` returns `(q, scale)` (e4m3 values of x's shape, one
# uint8 per block); `dequantize_ue8m0(q, scale)` multiplies back. Each has a torch reference and a Triton
# kernel (one program handles 16 blocks: load, block max, scale byte, scaled encode, store). They agree
# byte for byte:

# %%
x = randn((32, 448), seed=3, octaves=24)  # real magnitudes: per-block scales over 24 octaves
x[0, :64] = 0.0  # an all-zero block
x[1, 64:128] = 448 * 2.0**-3  # an all-equal block at 448·2^k
x[2:4] = randn((2, 448), seed=8, block=1, octaves=28)  # 28 octaves inside each block: e4m3 subnormals too
q_ref, s_ref = fp8.quantize_ue8m0(x, backend="reference")
q_tri, s_tri = fp8.quantize_ue8m0(x, backend="triton")
print("q:", tuple(q_tri.shape), q_tri.dtype, "  scale:", tuple(s_tri.shape), s_tri.dtype)
print(compare(s_tri, s_ref, "exact", "scale bytes").verdict())
print(compare(q_tri, q_ref, "exact", "e4m3 bytes").verdict())
print("distinct scale bytes:", len(set(s_ref.flatten().tolist())), "  row 0:", s_ref[0].tolist(), "  row 1:", s_ref[1].tolist())
d_ref = fp8.dequantize_ue8m0(q_ref, s_ref, backend="reference")
d_tri = fp8.dequantize_ue8m0(q_tri, s_tri, backend="triton")
print(compare(d_tri, d_ref, "exact", "dequantised bf16").verdict())

# %% [markdown]
# ### NaN and inf: one policy, every backend
#
# e4m3 has no infinities and a UE8M0 byte no sign, so a block holding a NaN or ±inf has no honest finite
# encoding. dsv4ref's policy (`docs/formats.md#non-finite-values`), the same in the reference and the kernels:
#
# * **value checks on** (the default): the call raises a `ValueError` naming the argument, before writing;
# * **checks off** (`DSV4REF_CHECK_VALUES=0`, the hot path; `dsv4ref.validate.checking_values(False)` for a
#   block of code, as below): the block gets **scale byte 255**, E8M0's NaN, and every code of it is an e4m3 NaN, 0x7F
#   (0xFF for a value that is not a NaN and has its sign bit set). It reads back as NaN, never as a plausible
#   number; the block next to it is untouched.
#
# `kv_cache.insert` and `gather` follow the same rule for the 7 NoPE blocks of a row.

# %%
xn = torch.ones(2, 128, device=DEVICE)  # row 0: block 0 holds a NaN, block 1 a −inf; row 1 is finite
xn[0, 3], xn[0, 64], xn[0, 65] = float("nan"), -float("inf"), -2.0
try:
    fp8.quantize_ue8m0(xn)
except ValueError as e:
    print("checks on: ValueError:", e)
with validate.checking_values(False):
    for backend in ("reference", "triton"):
        qn, sn = fp8.quantize_ue8m0(xn, backend=backend)
        b = qn.view(torch.uint8).cpu()
        back = fp8.dequantize_ue8m0(qn, sn, out_dtype=torch.float32, backend=backend).cpu()
        print(
            f"{backend:<9} scale bytes {sn.cpu().tolist()}; codes in block 0: {sorted(set(b[0, :64].tolist()))}, "
            f"block 1: {sorted(set(b[0, 64:].tolist()))}"
        )
        print(
            f"{'':<9} read back: block 0 all NaN {bool(back[0, :64].isnan().all())}, block 1 all NaN "
            f"{bool(back[0, 64:].isnan().all())}, row 1 starts {back[1, :2].tolist()}"
        )

# %% [markdown]
# A reader must also read pages it did not write, so it decodes **every** scale byte as E8M0 defines it:
# 1..254 are 2^(b − 127), **0 is 2^−127** (an fp32 subnormal, not 0) and **255 is NaN** (not inf, which the
# shortcut "byte << 23 as fp32 bits" would give). Every NaN comes out as the same quiet NaN bits on every
# device. Each row below is 64 codes 0x38 (1.0) under one scale byte:

# %%
s255 = torch.tensor([[0], [1], [127], [254], [255]], dtype=torch.uint8, device=DEVICE)
ones = torch.full((5, 64), 0x38, dtype=torch.uint8, device=DEVICE)
for backend in ("reference", "triton"):
    v = fp8.dequantize_ue8m0(ones, s255, out_dtype=torch.float32, backend=backend).cpu()
    print(
        f"{backend:<9} bytes {s255.flatten().tolist()} read as {v[:, 0].tolist()}; NaN bits "
        f"{hex(v[4, 0:1].view(torch.int32).item())}"
    )

# %% [markdown]
# ## 5. The quantisation error, as a picture
#
# Per element, the error obeys |x̂ − x| ≤ max(2^−4·|x|, 2^−10·2^e) (`docs/formats.md#block-quantisation`): half a grid step,
# relative for normal e4m3 values, absolute (2^−10 of the scale) in the subnormal range. Plotting the error
# against |x| / 2^e, the position of the value within its block's range (up to 448), shows both regimes:

# %%
xd = x.double().cpu()
err = (d_ref.double().cpu() - xd).abs()
pos_in_block = xd.abs() / torch.exp2(s_ref.double().cpu() - 127).repeat_interleave(64, 1)
rel = (err / xd.abs()).flatten()
u = pos_in_block.flatten()
m = u > 0
fig, ax = plt.subplots(figsize=(8, 3.6))
ax.loglog(u[m].numpy(), rel[m].clamp(min=1e-6).numpy(), ".", ms=2, alpha=0.5, label="|x̂ − x| / |x| (1e-6 = exact)")
uu = np.logspace(-9, math.log10(448), 200)
ax.loglog(uu, np.maximum(2**-4, 2**-10 / uu), "k--", lw=1, label="bound max(2^-4, 2^-10 / (|x|/2^e))")
ax.axvline(2**-6, color="gray", ls=":", lw=1)
ax.set_xlabel("|x| / 2^e  (448 = the block's largest value)")
ax.set_ylabel("relative error")
ax.legend(fontsize=8, loc="lower left")
ax.set_title("e4m3 + UE8M0: relative error ≤ 1/16 down to 2^-6, then an absolute floor")
plt.tight_layout()
plt.show()
bound = torch.maximum(xd.abs() * 2.0**-4, torch.exp2(s_ref.double().cpu() - 127 - 10).repeat_interleave(64, 1))
print("every element within the bound:", bool((err <= bound).all()))

# %% [markdown]
# ## 6. The page layout, byte by byte
#
# A cache page holds B tokens and is laid out as a **structure of arrays** (`docs/formats.md#the-584-byte-kv-cache-page`):
#
# ```
# [0, 576·B)          token data: token t at 576·t = 448 e4m3 bytes | 64 bf16 RoPE values (128 B, little-endian)
# [576·B, 584·B)      scales:     token t at 576·B + 8·t = 7 UE8M0 bytes | 1 zero pad byte
# [584·B, stride)     padding up to a multiple of 576 (FlashMLA requires 576-B alignment)
# ```
#
# So a token's 584 bytes are **not contiguous**, and the page stride is round_up(584·B, 576), not 584·B.
# Kernels take the stride from the tensor (`cache.stride(0)`), never from a formula.

# %%
for B in (1, 2, 16, 61, 64, 256):
    pb = kv_cache.page_bytes(B)
    print(f"B = {B:>3}: page_bytes = {pb:>6}  ({pb / B:.1f} B/token; 584·B = {584 * B:>6}, padding {pb - 584 * B})")

# %% [markdown]
# Now write two tokens into a cache of B = 2 pages with the library and draw page 1, byte by byte. The cache
# starts full of `0xAB` so that untouched bytes stay visible:

# %%
B = 2
cache = torch.full((2, kv_cache.page_bytes(B)), 0xAB, dtype=torch.uint8, device=DEVICE)
kv2 = randn((2, 512), seed=4, octaves=12)
kv_cache.insert(cache, kv2, torch.tensor([2, 3], device=DEVICE), block_size=B)  # slots 2, 3 = page 1, tokens 0, 1
page = cache[1].cpu()
print("page 0 untouched:", bool((cache[0].cpu() == 0xAB).all()))
for name, lo, hi in [("token 0 data", 0, 576), ("token 1 data", 576, 1152), ("scale rows", 1152, 1168), ("padding", 1168, 1728)]:
    print(f"bytes {lo:>4}..{hi - 1:>4} {name:<13}: {int((page[lo:hi] != 0xAB).sum()):>3} of {hi - lo} changed")
print("token 0 scales (bytes 1152..1159):", page[1152:1160].tolist())
print("token 1 scales (bytes 1160..1167):", page[1160:1168].tolist())

# %%
regions = [
    (0, 448, "tok 0 · 448 e4m3 (7 blocks of 64)", "tab:blue"),
    (448, 128, "tok 0 · RoPE bf16", "tab:cyan"),
    (576, 448, "tok 1 · 448 e4m3", "tab:orange"),
    (1024, 128, "tok 1 · RoPE bf16", "tab:olive"),
    (1152, 8, "tok 0 · scales", "tab:red"),
    (1160, 8, "tok 1 · scales", "tab:purple"),
    (1168, 560, "padding (never read)", "lightgray"),
]
fig, axes = plt.subplots(2, 1, figsize=(12, 3.6), gridspec_kw={"height_ratios": [1, 1.2]})
ax = axes[0]
for start, n, label, color in regions:
    ax.broken_barh([(start, n)], (0, 1), color=color)
    if n >= 100:
        ax.text(start + n / 2, 0.5, label, ha="center", va="center", fontsize=7)
for b in range(1, 7):
    for base in (0, 576):
        ax.axvline(base + 64 * b, ymin=0, ymax=1, color="white", lw=0.6)
ax.set_xlim(0, 1728)
ax.set_yticks([])
ax.set_xticks([0, 448, 576, 1024, 1152, 1728])
ax.set_title("one B = 2 page: 1728 bytes (page_bytes(2)); white ticks: the 64-value quant blocks")
ax = axes[1]
zoom = page[1136:1184].numpy()
colors = ["tab:olive"] * 16 + ["tab:red"] * 8 + ["tab:purple"] * 8 + ["lightgray"] * 16
ax.bar(np.arange(1136, 1184), np.ones(48), color=colors, width=0.9)
for i, v in enumerate(zoom):
    ax.text(1136 + i, 0.5, f"{v:02X}", ha="center", va="center", fontsize=6, rotation=90)
ax.set_yticks([])
ax.set_xlim(1135.5, 1183.5)
ax.set_title("zoom on bytes 1136..1183: the end of token 1's RoPE, the two 8-byte scale rows (7 UE8M0 + 0), padding (0xAB)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 7. The insert kernel, walked through
#
# `kv_cache.insert(cache, kv, slots, *, block_size)` writes row i of kv to slot `slots[i]`
# (slot = page·B + offset; −1 = a padding row, skip it). The Triton kernel runs one program per `TOK`
# tokens (axis 0 of every tile is the token; `TOK` = 1 is the plain "one program per token", and the
# library launches 4 over two warps, which measured fastest on the H200: `kv_cache.KVCacheLaunch` is the
# knob). The kernel itself only loads the slots and the RoPE words, then hands the tile to the record
# encoder. With `EARLY` (the default launch, measured faster on an H200 on 2026-12-01:
# `benchmarks/kv_cache.md`) it first loads *every* row of the tile, masked by the row count alone, and hands
# the encoder the loaded words: otherwise each load waits for the slot (to skip −1 rows) and the NoPE tile
# waits behind the RoPE store, three memory round trips in series per program instead of one (the timings of
# both, and every other launch tried, are in `benchmarks/kv_cache.md`; a row with slot −1 is then read, never
# written):

# %%
print(inspect.getsource(kv_cache.kernels.insert_kernel.fn))

# %% [markdown]
# The encoder `dsv4ref.tl.kv_record.kv_record` is written once for the whole library: the fused Q-norm +
# RoPE + KV insert of notebook 02 calls it too, with a tile of one token whose RoPE values it has just
# rotated. Read it top to bottom:

# %%
print(inspect.getsource(kv_record.fn))

# %% [markdown]
# The points that matter:
#
# * **−1 slots write nothing**: the slot's validity becomes part of every store mask (broadcast to the
#   pointer's full shape: the interpreter rejects a mask of another shape, or an integer mask made from a
#   scalar bool), and the slot is clamped to 0 before any address is formed from it.
# * **bf16 is widened in integers** (`bits << 16`): the interpreter does bf16 arithmetic on raw bits
#   (`docs/triton_interpreter.md`), and this is exact anyway.
# * The 448 NoPE values are a [TOK, 8, 64] tile, one row per quant block (row 7 masked off: `tl.arange`
#   needs a power of two). `tl.max` along a row is the block's amax; `ue8m0_byte` is the bit-exact ceil
#   rule; multiplying by 2^−e is exact; the shared grid-snap encoder `dsv4ref.tl.e4m3_encode` clamps,
#   rounds to nearest even and puts the sign back as a bit, so −0 stays 0x80 on a GPU too.
# * `page_offsets` returns the token's two **int64** byte offsets (data, scales) from the page stride the
#   host passes in (`cache.stride(0)`); int32 would overflow past 2^31 bytes, about 57k pages of B = 64.
# * The RoPE values are copied as 16-bit words (pages start at even addresses: always, for `allocate`; the
#   writers refuse a cache view whose pages do not, and the readers fall back to bytes, low byte first).
#
# The writer is byte-exact against the torch reference. Insert real-magnitude rows into shuffled pages, with
# padding rows and fewer slots than kv rows, into a cache full of random bytes:


# %%
def random_cache(pages, B, seed):
    c = kv_cache.allocate(pages, B)
    c.copy_(torch.randint(0, 256, tuple(c.shape), generator=generator(seed), dtype=torch.uint8))
    return c


B, pages, T = 16, 3, 24
kv = randn((T, 512), seed=5, octaves=24)
slots = torch.randperm(pages * B, generator=generator(6))[:20]
slots[[3, 11]] = -1  # padding rows
slots = slots.to(DEVICE)  # 20 entries for 24 rows: rows 20..23 are padding too
c_ref, c_tri = random_cache(pages, B, 7), random_cache(pages, B, 7)
before = c_ref.clone()
kv_cache.insert(c_ref, kv, slots, block_size=B, backend="reference")
kv_cache.insert(c_tri, kv, slots, block_size=B, backend="triton")
print(compare(c_tri, c_ref, "exact", "cache bytes, Triton vs reference").verdict())
print(
    "bytes changed:",
    int((c_tri != before).sum()),
    " (at most 18 tokens × 584 =",
    18 * 584,
    "; a byte may be rewritten with its old value)",
)

# %% [markdown]
# ## 8. The gather kernel
#
# `kv_cache.gather(cache, slots, *, block_size)` is the reader: one program per `TOK` slots (4), e4m3 byte → fp32, times
# 2^(scale − 127) (exact), stored as bf16 bits; the RoPE words copied back; slot −1 gives a zero row.

# %%
print(inspect.getsource(kv_cache.kernels.gather_kernel.fn))

# %% [markdown]
# Reading back what was written gives exactly dequantise(quantise(kv)), bit for bit, and the input within the
# bound of section 5 (the RoPE dims unchanged):

# %%
read = torch.cat([slots, torch.tensor([-1], device=DEVICE)])
out = kv_cache.gather(c_tri, read, block_size=B)
src = torch.cat([kv[:20], torch.zeros(1, 512, dtype=torch.bfloat16, device=DEVICE)])
qq, ss = fp8.quantize_ue8m0(src[:, :448], backend="reference")
want = torch.cat([fp8.dequantize_ue8m0(qq, ss, backend="reference"), src[:, 448:]], dim=1)
want[read < 0] = 0
print("out:", tuple(out.shape), out.dtype)
print(compare(out, want, "exact", "gather(insert(kv)) vs dequantize(quantize(kv))").verdict())
print(
    compare(
        out, kv_cache.gather(c_tri, read, block_size=B, backend="reference"), "exact", "gather, Triton vs reference"
    ).verdict()
)
print("rows for slot -1 are all zero:", bool((out[read < 0] == 0).all()))
print("RoPE dims bit-identical to the input:", torch.equal(out[read >= 0, 448:].cpu(), src[read >= 0, 448:].cpu()))

# %% [markdown]
# ## 9. Gallery: the bugs this format caused, and the test that catches each
#
# Every entry is a bug class seen in a real DeepSeek-V4 implementation (the pitfalls tables of
# `docs/formats.md` and `docs/kv_cache.md`), and each has a test in `tests/test_fp8.py` or
# `tests/test_kv_cache.py` that fails on it.
#
# | # | bug | what you see | test that catches it |
# |---|---|---|---|
# | 1 | FP8 tests with unit scales only (every byte 127) | tests pass, production breaks when scales vary | `test_inputs_exercise_many_scales`: ≥ 40 distinct bytes, ≥ 5 per row, byte 105, amax = 448·2^k blocks |
# | 2 | a non-power-of-two scale read as its exponent | outputs ~25% off, no crash | `test_every_scale_is_a_power_of_two`: decoded as fp32 bits and as `float8_e8m0fnu`, mantissa 0 |
# | 3 | round/floor/fuzzy log2 instead of an exact ceil; wrong floor | bytes off by one; clipping | `test_amax_448_times_pow2_gets_the_ceil_byte`, `test_scale_bytes_worked_table`, `test_the_tests_catch_a_fuzzy_log2` |
# | 4 | the bf16 round trip before quantising skipped | one-code differences | (compressor/indexer notebooks; here kv arrives as bf16) |
# | 5 | FNUZ vs FN | values halved, −0 read as NaN | `test_fn_not_fnuz`: a fixed byte table decoded as fn |
# | 6 | NaN bytes decoded as ±480 | corruption looks finite | `test_never_emits_nan_codes`; poisoned outputs checked by value |
# | 7 | no FP8 type / a broken FP8 cast | garbage or compile failure | `test_quantize_bytes_equal_the_float64_oracle` (grid-snap encoder vs an independent float64 oracle) |
# | 8 | the cache reshaped as 512 (or 576) bytes per token | garbage (gsm8k ≈ 0%) | `test_wrong_layout_readers_fail` (512/576-B record readers fail on every row) |
# | 9 | AoS record instead of the SoA page, or stride 584·B | all but page 0 / token 0 wrong | `test_golden_page_B2`, `test_golden_page_B2_writer`, `test_wrong_layout_readers_fail`, `test_insert_into_strided_cache_view` |
# | 10 | int32 byte offsets | corruption past ~57k pages | `test_offsets_past_2_pow_31_strided_view` (CPU too), `test_int64_offsets_real_58k_pages` (GPU, 2.2 GB) |
# | 11 | writes for slot −1; slots assumed as long as the batch | page 0 corrupted under padding | `test_short_slots_and_padding_rows`, `test_insert_bytes_exact_and_nothing_else_touched` (snapshot) |
# | — | a NaN / inf block written as a finite number; E8M0 bytes 0 / 255 read as 0 / inf | poison that looks plausible | `tests/test_contract_fp8.py`, `tests/test_contract_kv_cache.py` (`test_probe_*`) |
#
# Two of them, live. An **array-of-structures reader** treats token t's 584 bytes as one record at 584·t,
# and a **512-byte reshape** (the V3.2/BF16 habit) at 512·t. Run both on the page drawn above:


# %%
def aos_reader(page_bytes, t, rec):  # WRONG on purpose: a contiguous record per token
    r = page_bytes[rec * t :][:584]
    nope = r[:448].view(torch.float8_e4m3fn).float().reshape(7, 64) * torch.exp2(r[576:583].float() - 127)[:, None]
    return torch.cat([nope.flatten(), r[448:576].clone().view(torch.bfloat16).float()])


right = kv_cache.gather(cache, torch.tensor([2, 3], device=DEVICE), block_size=2).cpu().float()
for rec in (584, 512):
    wrong = torch.stack([aos_reader(page, t, rec) for t in (0, 1)])
    print(
        f"{rec}-byte record reader: rows equal to the real gather:",
        [bool(torch.equal(wrong[t].nan_to_num(7.0), right[t])) for t in (0, 1)],
    )

# %% [markdown]
# Here even token 0 is wrong: its NoPE bytes are where an AoS reader looks, but its scales are not at
# bytes 576..582. Layout bugs can still hide: a computed page stride of 584·B (pitfall #9) reads page 0
# perfectly and only misaligns from page 1 on, which is why `test_wrong_layout_readers_fail` reads
# slots on several pages, and why the golden test builds a B = 2 page by hand, byte by byte.
#
# ## 9b. Holding your own port to the suite
#
# Porting starts here. Below is the gather written a second time from this notebook alone, in plain
# **numpy** — no torch arithmetic, no Triton — the way a port to another backend starts. It is then held to
# the conformance suite, which runs it on the same adversarial cases the tests use (odd page sizes, −1
# slots, repeated slots, strided slot views, scale bytes 0 and 255, a cache full of random bytes) and
# compares what it returns with the reference, under the tolerance each case names. Swap in your XPU or CUDA
# kernel behind the same signature and the same call holds it to account.

# %%
import numpy as np

from dsv4ref import conformance


def numpy_gather(cache, slots, *, block_size, **unused):
    """kv_cache.gather from the byte map above, in numpy: returns [S, 512] bf16 (as a torch tensor)."""
    raw = cache.cpu().numpy()  # uint8 [pages, page_bytes]
    s = slots.cpu().numpy().astype(np.int64)
    out = np.zeros((len(s), 512), dtype=np.float32)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()  # the 256 codes
    for i, slot in enumerate(s):
        if slot < 0:
            continue  # −1: a zero row
        page, t = divmod(int(slot), block_size)
        data = raw[page, 576 * t : 576 * t + 576]
        scale_bytes = raw[page, 576 * block_size + 8 * t : 576 * block_size + 8 * t + 7].astype(np.int64)
        scales = np.where(scale_bytes == 255, np.nan, np.ldexp(1.0, scale_bytes - 127)).astype(np.float32)
        with np.errstate(over="ignore"):  # e4m3 · 2^127 can exceed fp32: inf, as in fp32 arithmetic anywhere
            out[i, :448] = e4m3[data[:448]] * np.repeat(scales, 64)  # fp32 × fp32, one rounding (E8M0 255: NaN)
    out = torch.from_numpy(out).to(torch.bfloat16)
    out[out.isnan()] = float("nan")  # dequantised NaNs: one bit pattern (0x7FC0), whatever sign they came with
    for i, slot in enumerate(s):  # the RoPE dims are the stored bf16 bits, copied as they are (NaN payloads too)
        if slot >= 0:
            page, t = divmod(int(slot), block_size)
            bits = raw[page, 576 * t + 448 : 576 * t + 576].view(np.int16)
            out[i, 448:] = torch.from_numpy(bits.copy()).view(torch.bfloat16)
    return out.to(cache.device)


rows = conformance.run({"kv_cache.gather": numpy_gather})
print(f"numpy gather: {sum(r.passed for r in rows)} of {len(rows)} conformance rows PASS")
for r in rows:
    print(f"  {r.case:<44} {'PASS' if r.passed else 'FAIL'}")

# %% [markdown]
# A port that reads the scales with a 584-byte stride, or forgets that byte 255 means NaN, fails named rows
# here. The same call takes every op at once: `conformance.run({"kv_cache.gather": ..., "kv_cache.insert":
# ..., "sparse_mla.decode": ...})`, and `python -m dsv4ref conformance --golden golden` replays the frozen
# golden files (`golden/README.md` shows how to load them from C++).
#
# ## 10. Performance
#
# Both kernels are pure data movement, so the roofline is memory bandwidth. Per token, the bytes that must
# move (counted as the benchmark counts them; pitfall #21 warns against 576):
#
# * insert: read 1024 B of bf16 kv + 8 B of slot, write 584 B of cache → 1616 B;
# * gather: read 584 B of cache + 8 B of slot, write 1024 B of bf16 → 1616 B.
#
# The target is ≥ 70% of the device's **measured** copy bandwidth (read + write). `python -m dsv4ref bench
# kv_cache` runs both at 64k and 256k slots with pages of 64 in random order, rotating four input sets so the
# L2 cannot help. Results, the exact command and their analysis are in `benchmarks/kv_cache.md`. On a GPU
# this cell runs the same benchmark here:

# %%
# NBVAL_IGNORE_OUTPUT
if not dsv4ref.interpreting():
    from dsv4ref.tools.harness import run_benches

    ceil, rows = run_benches("kv_cache")
    print(f"copy bandwidth measured now: {ceil.copy_bytes_per_s / 1e12:.2f} TB/s")
    for r in rows:
        print(
            f"{r.case.op:<16} {r.case.shape:<16} {r.ms * 1e3:8.1f} us {r.bytes_per_s / 1e9:6.0f} GB/s  {r.fraction:6.1%} of copy"
        )
else:
    print("interpreting on the CPU: timings would measure numpy, not a kernel; see benchmarks/kv_cache.md")
