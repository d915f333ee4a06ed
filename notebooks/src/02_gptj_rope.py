# %% [markdown]
# # 02 · GPT-J RoPE on the last 64 dims, and the fused Q-norm + RoPE + FP8 KV insert
#
# DeepSeek-V4's attention works on one 512-dim **latent** per token that serves as both key and value.
# Position enters through rotary embeddings (RoPE) on **only the last 64 dims** (448..511), paired
# **GPT-J style** (adjacent elements), with a per-layer frequency table (θ = 10000 on window-only layers,
# θ = 160000 with YaRN on compressed layers). In the decode prologue one kernel does three things per token:
#
# * normalises every query head (RMSNorm without a weight) and rotates its last 64 dims, in place;
# * rotates the token's KV row and writes it into the FP8 paged cache of notebook 01 (584 bytes per token);
#
# and after attention the output's last 64 dims are rotated **back** at the query's position.
#
# This notebook follows the usual order: the reference (what RoPE is), then the kernel, then the checks, then
# the performance story. The math, conventions and pitfalls are written up in `docs/rope.md`; the code lives in
# `dsv4ref/rope/`: `reference.py` (the whole op in torch), `kernels.py` (Triton), `launch.py` (launch choices).

# %%
import dsv4ref  # first: picks the device, sets TRITON_INTERPRET on a CPU-only machine
import inspect
import warnings

warnings.filterwarnings("ignore")
import numpy as np

np.seterr(all="ignore")
import math

import matplotlib.pyplot as plt
import torch

# %matplotlib inline
from dsv4ref import conformance, kv_cache, linear, rope, validate
from dsv4ref.config import FLASH, TINY
from dsv4ref.conformance.rope import pair_max  # the scale of the q tolerance: each pair's larger magnitude
from dsv4ref.device import DEVICE, describe
from dsv4ref.testing import compare, generator, randn

# %%
# NBVAL_IGNORE_OUTPUT
print(describe())

# %% [markdown]
# ## 1. Two ways to pair 64 numbers
#
# RoPE treats the rotary slice x (R = 64 numbers) as 32 two-dimensional vectors and rotates vector i by the
# angle f_i = p · inv_freq[i], where p is the token's position. The only question is **which two numbers
# form vector i**:
#
# * **GPT-J / interleaved** (what DeepSeek-V4 uses everywhere, the indexer included): (x[2i], x[2i+1]);
# * **NeoX / half-split** (most Llama-family code): (x[i], x[i+32]).
#
# $$x'_{2i} = x_{2i}\cos f_i - x_{2i+1}\sin f_i,\qquad x'_{2i+1} = x_{2i}\sin f_i + x_{2i+1}\cos f_i$$
#
# Both are valid RoPEs; they are simply different functions, and a model trained with one is broken by the
# other. The drawing shows which element pairs with which (for R = 16, so the arcs stay readable).

# %%
R_draw = 16
fig, axes = plt.subplots(2, 1, figsize=(10, 3.2))
for ax, (name, pairs) in zip(
    axes,
    [
        ("GPT-J (interleaved): (x[2i], x[2i+1])", [(2 * i, 2 * i + 1) for i in range(R_draw // 2)]),
        ("NeoX (half-split): (x[i], x[i+R/2])", [(i, i + R_draw // 2) for i in range(R_draw // 2)]),
    ],
):
    colors = plt.cm.tab10(np.arange(R_draw // 2) % 10)
    for k, (a, b) in enumerate(pairs):
        for d in (a, b):
            ax.add_patch(plt.Rectangle((d, 0), 0.9, 0.9, color=colors[k], alpha=0.8))
            ax.text(d + 0.45, 0.45, str(d), ha="center", va="center", fontsize=8)
        xs = np.linspace(a + 0.45, b + 0.45, 50)
        h = 0.25 + 0.08 * (b - a)
        ax.plot(xs, 0.95 + h * np.sin(np.pi * (xs - xs[0]) / (xs[-1] - xs[0])), color=colors[k])
    ax.set_xlim(-0.5, R_draw + 0.5)
    ax.set_ylim(-0.2, 2.0)
    ax.set_title(name, fontsize=10)
    ax.axis("off")
plt.tight_layout()
plt.show()

# %% [markdown]
# A hand-checkable example (`docs/rope.md#pairing`): x = 0, 1, …, 63 at position p = 1 with θ = 10000. Pair 0 has
# inv_freq = 1, so it turns by 1 radian. GPT-J rotates (x0, x1) = (0, 1) to (−sin 1, cos 1); NeoX rotates
# (x0, x32) = (0, 32) to (−32 sin 1, 32 cos 1).

# %%
table = rope.cos_sin_cache(4096)  # θ = 10000: fp32 [4096, 64] = [cos f_0..f_31 | sin f_0..f_31]
x = torch.arange(64, dtype=torch.float32, device=DEVICE)[None]
p1 = torch.tensor([1], device=DEVICE)
gptj = rope.apply_gptj(x, p1, table)[0].cpu()
neox = rope.apply_neox(x, p1, table)[0].cpu()
print("table:", tuple(table.shape), table.dtype)
print(
    "GPT-J x'[0], x'[1]  :",
    [round(v, 5) for v in gptj[:2].tolist()],
    " expected",
    [round(-math.sin(1), 5), round(math.cos(1), 5)],
)
print(
    "NeoX  x'[0], x'[32] :",
    [round(v, 4) for v in neox[[0, 32]].tolist()],
    " expected",
    [round(-32 * math.sin(1), 4), round(32 * math.cos(1), 4)],
)
print("the two conventions give the same vector:", torch.equal(gptj, neox))

# %% [markdown]
# In the reference the two conventions differ in **one einops pattern**: the last R dims are split into pairs
# as `(i two)` (adjacent: GPT-J) or `(two i)` (halves: NeoX). Everything else — the table lookup, the two
# rounded products per output, the single rounding to the output dtype — is shared:

# %%
for fn in (rope.reference.rotate_pairs, rope.reference.apply_gptj, rope.reference.apply_neox):
    print(inspect.getsource(fn))

# %% [markdown]
# ### Rotation is complex multiplication
#
# Read pair i as the complex number z_i = x[2i] + j·x[2i+1]. Then GPT-J RoPE is just z_i · e^{j f_i}, which is
# how DeepSeek's reference writes it (`view_as_complex` on adjacent pairs). Inverse RoPE multiplies by the
# conjugate e^{−j f_i}.

# %%
xr = randn((4, 64), seed=1, dtype=torch.float32)
pos = torch.tensor([0, 7, 299, 4095], device=DEVICE)
z = torch.view_as_complex(xr.double().reshape(4, 32, 2).contiguous())  # adjacent pairs -> complex
rows = table[pos].double()
w = torch.complex(rows[:, :32], rows[:, 32:])  # e^{j f_i} = cos f_i + j sin f_i, straight from the table
by_complex = torch.view_as_real(z * w).reshape(4, 64)
print(compare(rope.apply_gptj(xr, pos, table), by_complex, "fp32_elementwise", "apply_gptj == z · e^{jf}").verdict())
back = torch.view_as_real(torch.view_as_complex(by_complex.reshape(4, 32, 2).contiguous()) * w.conj()).reshape(4, 64)
print(
    compare(
        rope.apply_gptj(by_complex.float(), pos, table, inverse=True), back, "fp32_elementwise", "inverse == · e^{-jf}"
    ).verdict()
)

# %% [markdown]
# ### The relative-position property
#
# Rotations compose: ⟨Rot(m)q, Rot(n)k⟩ = ⟨q, Rot(n−m)k⟩. So an attention score between a query at m and a key
# at n depends only on the offset n − m, never on where the pair sits in the sequence. Shifting both by Δ leaves
# every score unchanged:

# %%
q = randn((1, 64), seed=2, dtype=torch.float32, octaves=4)
k = randn((1, 64), seed=3, dtype=torch.float32, octaves=4)


def score(m, n):
    qm = rope.apply_gptj(q, torch.tensor([m], device=DEVICE), table)
    kn = rope.apply_gptj(k, torch.tensor([n], device=DEVICE), table)
    return float((qm.double() * kn.double()).sum())


scale = float(q.double().norm() * k.double().norm())
print(f"{'query m':>8} {'key n':>6} {'n-m':>5}   score / (|q||k|)")
for m, n in [(10, 3), (110, 103), (3010, 3003), (10, 4), (2010, 2004)]:
    print(f"{m:>8} {n:>6} {n - m:>5}   {score(m, n) / scale:+.3f}")
same = all(abs(score(10, 3) - score(10 + d, 3 + d)) < 1e-5 * scale for d in (100, 1000, 3000))
print("same offset, same score (within 1e-5·|q||k|):", same)

# %% [markdown]
# ### Why only the last 64 dims
#
# The 512-dim latent is both K and V. Its first 448 dims ("NoPE") carry content only; they are stored as FP8
# with one power-of-two scale per 64 (notebook 01). The last 64 dims carry position; they stay bf16 in the
# cache, because a rotation's small angles do not survive FP8. DeepSeek-V3 rotated the *first* 64 dims; V4
# rotates the **last** — a classic porting bug (`docs/rope.md#pitfalls`). `apply_gptj` rotates `x[..., -R:]` and
# copies the rest bit for bit:

# %%
row = randn((2, 512), seed=4)
out = rope.apply_gptj(row, torch.tensor([5, 300], device=DEVICE), table)
print("dims 0..447 bit-identical:", torch.equal(out[:, :448].view(torch.int16), row[:, :448].view(torch.int16)))
print("dims 448..511 that moved :", int((out[:, 448:] != row[:, 448:]).sum()), "of", 2 * 64)

# %% [markdown]
# ## 2. Frequencies: plain RoPE and YaRN
#
# Plain RoPE uses inv_freq[i] = θ^(−2i/64): pair 0 turns one radian per token, pair 31 almost not at all.
# Compressed layers use θ = 160000 and **YaRN** (factor F = 16, original length L0 = 65536, β_fast = 32,
# β_slow = 1) to reach 1M positions: pairs whose wavelength is short compared with L0 keep their frequency;
# pairs whose wavelength is long are slowed down by F; a linear ramp blends between pair indices
#
# $$\mathrm{corr}(n) = \frac{R\,\ln\!\big(L_0 / (2\pi n)\big)}{2\ln\theta},\quad
# \mathrm{low} = \lfloor \mathrm{corr}(\beta_{fast}) \rfloor,\quad \mathrm{high} = \lceil \mathrm{corr}(\beta_{slow}) \rceil .$$
#
# No "mscale" is applied in DSV4: the table holds plain cos and sin.

# %%
low, high = rope.yarn_correction_range(64, FLASH.compress_rope_theta, FLASH.yarn)
print("YaRN ramp for θ = 160000: low =", low, " high =", high)
# exact digits: inv_freq is built on the host in fp32, the same bits on every machine
yarn_f = rope.inv_freq(64, 160000.0, FLASH.yarn)
plain_f = rope.inv_freq(64, 160000.0)
print(f"{'i':>3} {'YaRN inv_freq':>14} {'plain θ^(-i/32)':>16}   (fp32 values)")
for i in (0, 1, 15, 16, 20, 25, 31):
    print(f"{i:>3} {yarn_f[i].item():>14.7e} {plain_f[i].item():>16.7e}")

# %%
i = np.arange(32)
fig, ax = plt.subplots(figsize=(8, 4))
ax.semilogy(i, rope.inv_freq(64, 10000.0).numpy(), "o-", ms=3, label="θ = 10000 (window-only layers)")
ax.semilogy(i, plain_f.numpy(), "s-", ms=3, label="θ = 160000, no YaRN")
ax.semilogy(i, yarn_f.numpy(), "^-", ms=3, label="θ = 160000 + YaRN (compressed layers)")
ax.axvspan(low, high, color="grey", alpha=0.15, label=f"YaRN ramp [{low:.0f}, {high:.0f}]")
ax.axhline(2 * math.pi / 65536, color="k", lw=0.8, ls=":", label="one turn per 65536 tokens")
ax.set_xlabel("pair index i")
ax.set_ylabel("inv_freq[i] (radians per token)")
ax.legend(fontsize=8)
ax.set_title("RoPE frequencies per pair")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. The fused kernel: Q-norm + RoPE + FP8 KV insert
#
# ### Why fuse: bytes
#
# Decode is memory-bound: the time is the bytes moved. Per token, with H query heads of 512 bf16 values:
#
# | | reads | writes |
# |---|---|---|
# | q (norm + RoPE, in place) | H · 1024 B | H · 1024 B |
# | kv row | 1024 B | — |
# | cache record (notebook 01) | — | 584 B |
# | position, slot, table row | 8 + 8 + 256 B | — |
#
# Done as three passes (norm + RoPE of q; RoPE of kv into a temporary; quantise + insert) the kv row makes an
# extra round trip (write 1 KiB, read 1 KiB) and there are three launches instead of one. With H = 64 the q
# traffic dominates (128 KiB of 131 KiB per token), so fusing saves a few percent of bytes plus launch and
# tail time; the real win is that the prologue costs one pass over q at copy speed.

# %%
for H in (TINY.num_heads, FLASH.num_heads, 128):
    fused = H * 2048 + 1024 + 584 + 8 + 8 + 256
    three = fused + 2048 + 8
    print(f"H = {H:>3}: fused {fused:>7} B/token, three passes {three:>7} B/token ({three / fused - 1:.1%} more)")

# %% [markdown]
# ### What each program does
#
# The grid is **(T, H + 1)**: program (t, h < H) owns query head h of token t; program (t, H) owns token t's
# KV row. (The library's default launch groups 2 heads of a token per program — the same arithmetic, fewer
# and larger programs, faster on a GPU; section 7.) All arithmetic is fp32 after widening the bf16 bits in integers (the interpreter cannot do bf16
# arithmetic), and every bf16 result is rounded to nearest-even in integers (`bf16_rne_bits`).
#
# ```
# Q program (t, h):                                  KV program (t, H), only if t < T'' and slot[t] >= 0:
#   x  = q[t, h, 0:512]  (fp32)                        k = kv[t]                 (fp32, not normalised)
#   rr = 1 / sqrt(Σ x² / 512 + eps)                    NoPE k[0:448]: 7 blocks of 64 -> UE8M0 byte + e4m3
#   y  = x · rr                                        RoPE k[448:512]: rotate pairs, round to bf16
#   d >= 448: y[d] = y[d]·c ∓ y[d^1]·s                 write the 584-B record at slot[t] (page layout of 01)
#   q[t, h] = bf16(y)
# ```
#
# The pair partner of element d is d ^ 1 (flip the lowest bit): one vector load of the partners, no
# shuffles. For the cache the kernel reuses the shared helpers of notebook 01 (`page_offsets`, `ue8m0_byte`,
# `e4m3_encode`), so its bytes are by construction those of `kv_cache.insert(apply_gptj(kv))`.
#
# **The canonical arithmetic** (`docs/rope.md#rounding-rules`). To make the kernel bit-exact against the torch reference on every device,
# the sum of squares is taken in float64 (so the summation order cannot change the fp32 result), the
# reciprocal square root is a correctly rounded sqrt and divide (never the GPU's approximate `rsqrt`), and
# the rotation uses two separately rounded products (`enable_fp_fusion=False`: no FMA). vLLM's torch test
# rounds q to bf16 after the norm and only then rotates; that rounding, up to half an ulp of the *larger*
# element of a pair, is moved by the rotation into both outputs, so a small output beside a large partner
# can be off by far more than 1e-2 of itself. The tolerance for q against any correct form (the row
# `qnorm_rope_q`, `docs/rope.md#exactness`) therefore scales 1e-2 by the pair's larger magnitude. The
# reference's Q side, in full:

# %%
print(inspect.getsource(rope.reference.qnorm_rope))

# %% [markdown]
# And the kernel with one head per program (grid (T, H + 1)), the form drawn above. Its KV program is a
# separate function shared with the default multi-head kernel:

# %%
print(inspect.getsource(rope.kernels.qnorm_rope_kv_insert_kernel.fn))  # .fn: the Python function under @triton.jit

# %% [markdown]
#
# ### Running it on the teaching batch
#
# Four tokens at positions 299, 37, 0 and a padding row (slot −1), H = 16 heads, 16-token pages; the cache
# starts as random bytes, so anything written where it should not be shows.

# %%
T, H, B, n_pages = 4, TINY.num_heads, TINY.window_page, 2
positions = torch.tensor([299, 37, 0, 0], device=DEVICE)
slots = torch.tensor([17, 3, 30, -1], device=DEVICE)
q = randn((T, H, 512), seed=10)
kv = randn((T, 512), seed=11)
start = torch.randint(0, 256, (n_pages, kv_cache.page_bytes(B)), generator=generator(12), dtype=torch.uint8).to(DEVICE)

q_kernel, cache_kernel = q.clone(), start.clone()
rope.qnorm_rope_kv_insert(q_kernel, kv, cache_kernel, slots, positions, table, eps=TINY.rms_norm_eps, block_size=B)

q_ref, cache_ref = q.clone(), start.clone()
rope.qnorm_rope_kv_insert(q_ref, kv, cache_ref, slots, positions, table, eps=TINY.rms_norm_eps, block_size=B, backend="reference")
cache_insert = start.clone()
kv_cache.insert(cache_insert, rope.apply_gptj(kv, positions, table), slots, block_size=B, backend="reference")

print("q:", tuple(q_kernel.shape), q_kernel.dtype, " cache:", tuple(cache_kernel.shape), cache_kernel.dtype)
print(compare(cache_kernel, cache_insert, "exact", "cache bytes vs kv_cache.insert(apply_gptj(kv))").verdict())
print(compare(q_kernel, q_ref, "exact", "q vs the canonical reference").verdict())
xq = q.float()
vllm_style = rope.apply_gptj((xq / torch.sqrt(xq.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16), positions, table)
print(compare(vllm_style, q_kernel, "qnorm_rope_q", "the vLLM-style q vs the kernel's", mass=pair_max(q_kernel)).verdict())
rms = q_kernel.double().pow(2).mean(-1).sqrt()
print("every head has RMS 1 after the kernel (within 1e-2):", bool(((rms - 1).abs() < 1e-2).all()))

# %% [markdown]
# Which bytes changed? Exactly the three records of the tokens with a slot; the padding row (slot −1)
# wrote nothing, and the RoPE bytes read back through the cache reader equal the rotated kv bit for bit:

# %%
flat_new, flat_old = kv_cache.flat_bytes(cache_kernel), kv_cache.flat_bytes(start)
changed_slots = []
for s in range(n_pages * B):
    d, sc = kv_cache.token_offsets(cache_kernel, torch.tensor([s], device=DEVICE), B)
    idx = torch.cat([d + torch.arange(576, device=DEVICE), sc + torch.arange(8, device=DEVICE)])
    if not torch.equal(flat_new[idx], flat_old[idx]):
        changed_slots.append(s)
print("slots whose bytes changed:", changed_slots)
print("bytes outside those records unchanged:", int((cache_kernel != start).sum()) <= 3 * 584)
valid = slots[slots >= 0]
back = kv_cache.gather(cache_kernel, valid, block_size=B)
print(compare(back[:, 448:], rope.apply_gptj(kv, positions, table)[:3, 448:], "exact", "RoPE dims read back").verdict())

# %% [markdown]
# ## 4. Why the output needs inverse RoPE
#
# In DeepSeek-V4 V = K = the whole 512-dim latent, *including* its rotated dims. The attention output's last 64
# dims are therefore a mix of key vectors each rotated by its own position,
# o[448:] = Σ_j P_j · Rot(p_j) k_j[448:]. Rotating that back by the **query's** position gives
# Σ_j P_j · Rot(p_j − p_q) k_j[448:], which depends only on relative offsets — what the output projection was
# trained on. Without the inverse step the same context gives a different output at every position
# (`docs/rope.md#pitfalls`).
#
# Test: one query attending to 8 keys (itself and the 7 before it). Insert them with the fused kernel at
# positions around 1000, attend, and compare with the same tokens shifted by Δ = 896 (a multiple of 128, so
# compressed-window starts would stay aligned).


# %%
def decode_output(delta):
    T, H, B = 8, 2, 16
    pos = (1000 + delta - torch.arange(T)).to(DEVICE)
    q = randn((T, H, 512), seed=20, octaves=4)
    kv = randn((T, 512), seed=21, octaves=4)
    cache = kv_cache.allocate(1, B)
    slots = torch.arange(T, device=DEVICE)
    rope.qnorm_rope_kv_insert(q, kv, cache, slots, pos, table, eps=1e-6, block_size=B)
    k = kv_cache.gather(cache, slots, block_size=B).double()  # K = V = the full 512 dims
    p = torch.softmax((q[0].double() @ k.T) * 512**-0.5, dim=-1)
    o = (p @ k).float()  # (H, 512)
    return rope.apply_gptj(o, pos[:1].expand(H), table, inverse=True), o  # with and without inverse RoPE


def bucket(err):
    return "< 1e-2" if err < 1e-2 else ("< 0.1" if err < 0.1 else "> 0.1")


(a, a0), (b, b0) = decode_output(0), decode_output(896)
rel = lambda u, v: float((u - v).abs().max() / v.abs().max())  # noqa: E731
print("with inverse RoPE,    output change under the shift:", bucket(rel(a, b)))
print("without inverse RoPE, NoPE dims 0..447 change      :", bucket(rel(a0[:, :448], b0[:, :448])))
print("without inverse RoPE, RoPE dims 448..511 change    :", bucket(rel(a0[:, 448:], b0[:, 448:])))

# %% [markdown]
# After the inverse rotation the heads go through the **grouped low-rank output projection**: the H heads
# are cut into G contiguous groups, each group's hpg·512 values are projected to o_lora by its own matrix
# wo_a[g], and wo_b maps the G·o_lora concatenation to the hidden size (V4-Flash: 8 groups of 8 heads,
# 4096 → 1024 per group, 8192 → 4096). It is a projection, not a rotation, so the library keeps it with the
# projections: `linear.grouped_o_proj` (docs/linear.md).

# %%
G, o_lora, Hd = TINY.o_groups, TINY.o_lora_rank, TINY.hidden_size
hpg = TINY.num_heads // G
o = randn((3, TINY.num_heads, 512), seed=30, octaves=4)
wo_a = randn((G, o_lora, hpg * 512), seed=31, octaves=0) * 0.02
wo_b = randn((Hd, G * o_lora), seed=32, octaves=0) * 0.05
y = linear.grouped_o_proj(o, wo_a, wo_b)
z = torch.stack([o[:, g * hpg : (g + 1) * hpg].reshape(3, -1).double() @ wo_a[g].double().T for g in range(G)], 1)
print("o", tuple(o.shape), "-> z", tuple(z.shape), "-> out", tuple(y.shape))
print(compare(y, z.reshape(3, -1) @ wo_b.double().T, "bf16_gemm", "grouped o-proj vs float64").verdict())

# %% [markdown]
# ## 5. What breaks when the pairing is mixed up
#
# Suppose the cache writer used NeoX pairing while the model (and the query side) use GPT-J. Nothing
# crashes; every number is finite and of the right size. But the rotated dims are a different vector:

# %%
ctable = rope.cos_sin_cache(4096, theta=FLASH.compress_rope_theta, yarn=FLASH.yarn)
kr = randn((64, 512), seed=40, octaves=4)
pk = torch.randint(0, 4096, (64,), generator=generator(41)).to(DEVICE)
right = rope.apply_gptj(kr, pk, ctable)[:, 448:].double()
wrong = rope.apply_neox(kr, pk, ctable)[:, 448:].double()
print(
    "relative error of the RoPE dims, NeoX instead of GPT-J:",
    "> 0.5" if float((wrong - right).norm() / right.norm()) > 0.5 else "<= 0.5",
)
qr = rope.apply_gptj(randn((1, 512), seed=42, octaves=0), pk[:1], ctable)[:, 448:].double()
s_right, s_wrong = (right @ qr.T)[:, 0], (wrong @ qr.T)[:, 0]
print(
    "relative error of the RoPE part of the 64 scores       :",
    "> 0.5" if float((s_wrong - s_right).norm() / s_right.norm()) > 0.5 else "<= 0.5",
)
print("same top-1 key by RoPE score:", int(s_right.argmax()) == int(s_wrong.argmax()))

# %% [markdown]
# ## 6. The input contract, and holding a port to the conformance suite
#
# Every backend gives the reference's bits or the same error (`docs/rope.md#input-contract`). Index tensors
# may be int32 or int64 and any view: here `slots` and `positions` are every other entry of longer lists, which
# a kernel that reads `ptr + i` would get wrong (it would write slots 5, 7, 2 instead of 5, 2, 6):

# %%
s_long = torch.tensor([5, 7, 2, 0, 6, 7], device=DEVICE)
p_long = torch.tensor([9, 1, 40, 2, 63, 3], device=DEVICE)
q3, kv3 = randn((3, 2, 512), seed=50), randn((3, 512), seed=51)
out = {}
for backend in ("reference", "triton"):
    qq, cc = q3.clone(), kv_cache.allocate(4, 2)
    rope.qnorm_rope_kv_insert(qq, kv3, cc, s_long[::2], p_long[::2], table, block_size=2, backend=backend)
    out[backend] = qq, cc
written = kv_cache.gather(out["triton"][1], torch.arange(8, device=DEVICE), block_size=2).abs().sum(1) > 0
print("slots written:", written.nonzero()[:, 0].tolist())
print(compare(out["triton"][1], out["reference"][1], "exact", "cache, triton vs reference").verdict())

# %% [markdown]
# Non-finite input has one written-down outcome (`docs/rope.md#non-finite-input`): a NaN in a query head makes
# the whole head NaN on every backend (so attention gives a NaN row, never an empty-looking one); a NaN in a kv
# row that is written is refused while value checks are on, and with them off (the hot path) is encoded as
# the cache writer encodes it, scale byte 255 and e4m3 NaN bytes, so it reads back as NaN:

# %%
qn = q3.clone()
qn[1, 0, 7] = float("nan")
rope.qnorm_rope_kv_insert(qn, kv3, kv_cache.allocate(4, 2), s_long[::2], p_long[::2], table, block_size=2)
print("head (1, 0) all NaN:", bool(qn[1, 0].isnan().all()), "  other heads NaN-free:", not bool(qn[0].isnan().any()))
kvn = kv3.clone()
kvn[0, 70] = float("nan")
try:
    rope.qnorm_rope_kv_insert(q3.clone(), kvn, kv_cache.allocate(4, 2), s_long[::2], p_long[::2], table, block_size=2)
except ValueError as e:
    print("checks on :", str(e))
cn = kv_cache.allocate(4, 2)
with validate.checking_values(False):
    rope.qnorm_rope_kv_insert(q3.clone(), kvn, cn, s_long[::2], p_long[::2], table, block_size=2)
print(
    "checks off: slot 5's scale bytes",
    kv_cache.flat_bytes(cn)[kv_cache.token_offsets(cn, s_long[:1], 2)[1] + torch.arange(7, device=DEVICE)].tolist(),
    "-> reads back NaN in dims 64..127:",
    bool(kv_cache.gather(cn, s_long[:1], block_size=2)[0, 64:128].isnan().all()),
)

# %% [markdown]
# A port is held to the same contract by `dsv4ref.conformance.run`: give it a callable with our signature and it
# runs the suite's cases for that op (odd pages, −1 and short slot lists, int32 indices, strided layouts, a NaN
# head, an empty batch) and compares what the callable writes with the reference. Here is vLLM's own reference
# form in plain torch — RMSNorm with `rsqrt`, q rounded to bf16, then the fp32 rotation — which is not dsv4ref's
# bits but is correct, so it must pass; the same code with NeoX pairing must not.


# %%
def make_port(pairs):
    def rotate(y, positions, cos_sin):
        c, s = cos_sin[positions.long()].chunk(2, dim=-1)
        while c.dim() < y.dim():
            c, s = c.unsqueeze(-2), s.unsqueeze(-2)
        r = y[..., 448:].clone()
        e, o = (r[..., 0::2], r[..., 1::2]) if pairs == "gptj" else (r[..., :32], r[..., 32:])
        a, b = e * c - o * s, e * s + o * c
        y = y.clone()
        if pairs == "gptj":
            y[..., 448::2], y[..., 449::2] = a, b
        else:
            y[..., 448:480], y[..., 480:] = a, b
        return y

    def qnorm_rope_kv_insert(q, kv, cache, slots, positions, cos_sin, *, block_size, eps=1e-6):
        x = q.float()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16).float()
        q.copy_(rotate(x, positions, cos_sin).to(torch.bfloat16))
        k = kv.clone()  # dims 0..447 go to the cache exactly as given
        k[:, 448:] = rotate(kv.float(), positions, cos_sin)[:, 448:].to(torch.bfloat16)
        kv_cache.insert(cache, k, slots, block_size=block_size, backend="reference")

    return qnorm_rope_kv_insert


cases = conformance.all_cases("rope.qnorm_rope_kv_insert")
for pairs in ("gptj", "neox"):
    rows = conformance.run({"rope.qnorm_rope_kv_insert": make_port(pairs)}, cases)
    print(f"vLLM form, {pairs} pairs: {sum(r.passed for r in rows)} of {len(rows)} rows pass")
print(conformance.format_report(conformance.run({"rope.qnorm_rope_kv_insert": make_port("gptj")}, cases), details=False))

# %% [markdown]
# ## 7. The checks
#
# `python -m dsv4ref check rope` runs the Triton kernels against the references (the same call as below);
# `tests/test_rope.py` holds the full list (golden pairings, YaRN table, cache bytes, slot −1, 1M positions,
# inverse, shift invariance, compressed-key position, bad input); `docs/rope.md#pitfalls` says which test
# catches which porting bug.

# %%
from dsv4ref.tools.harness import run_checks

for r in run_checks("rope"):
    print(f"{r.op:<28} {r.shape:<32} {r.report.verdict()}")

# %% [markdown]
# ## 8. Performance
#
# At T = 4096 tokens and H = 64 heads the fused kernel must move about 4096 · 131 KiB ≈ 537 MB, so on a
# GPU with ~4 TB/s of copy bandwidth the bound is about 135 µs. The target is ≥ 70% of that copy bandwidth.
# `python -m dsv4ref bench rope` times both fused kernels (one head per program, grid (T, H + 1); and n heads of
# one token per program, which reads q as packed bf16 pairs so a rotary pair is one 32-bit word) and the three
# separate passes. The latest one-run H200 bench, as `benchmarks/RESULTS.md` records it (date, device and the
# copy ceiling measured in the same run first; what else was tried: `benchmarks/rope.md`):

# %%
from IPython.display import Markdown

from dsv4ref.tools.results import results_header, results_section

Markdown(results_header() + "\n\n" + results_section("rope"))

# %% [markdown]
# Fusing removes two of the three passes' round trips through memory. A one-head program moves only 2 KiB, so
# per-program overhead shows; two heads per program halve the program count, load the table row once for both,
# and need no second load for the rotary partner. On the CPU the kernels are interpreted, so there is nothing
# to time.
#
# The choice is an argument, not a global: `launch=rope.RopeLaunch(heads_per_prog=0)` runs the per-head
# kernel, `RopeLaunch(heads_per_prog=n, num_warps=w)` the multi-head one; `RopeLaunch()` is the measured
# default. Every choice gives the same bits:

# %%
q_per_head, q_multi = q.clone(), q.clone()
for q_out, launch in ((q_per_head, rope.RopeLaunch(heads_per_prog=0)), (q_multi, rope.RopeLaunch(heads_per_prog=4))):
    rope.qnorm_rope_kv_insert(
        q_out, kv, start.clone(), slots, positions, table, eps=TINY.rms_norm_eps, block_size=B, launch=launch
    )
print("default:", rope.RopeLaunch())
print(compare(q_per_head, q_kernel, "exact", "q, per-head kernel vs the default").verdict())
print(compare(q_multi, q_kernel, "exact", "q, 4 heads per program vs the default").verdict())

# %%
# NBVAL_IGNORE_OUTPUT
if not dsv4ref.interpreting():
    from dsv4ref.tools.harness import run_benches

    ceil, rows = run_benches("rope")
    print(f"copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s")
    for r in rows:
        print(
            f"{r.case.op:<18} {r.case.shape:<28} {r.ms * 1e3:8.1f} us  {r.bytes_per_s / 1e9:6.0f} GB/s  {r.fraction:6.1%} of copy"
        )
else:
    print("interpreted on the CPU: no timings")
