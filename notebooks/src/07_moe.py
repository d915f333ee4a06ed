# %% [markdown]
# # 07 · The MoE feed-forward: routing, FP8 staging, clamped-SwiGLU experts, combine
#
# Every DeepSeek-V4 layer ends in a **mixture of experts**: a gate picks K of E routed experts per token
# (V4-Flash: 6 of 256), each picked expert runs a small clamped-SwiGLU MLP, the outputs are summed with the
# routing weights, and one **shared expert** that every token uses is added on top. This notebook builds it
# in four steps, each as plain PyTorch and as a Triton kernel:
#
# 1. **route**: √softplus scores, a selection bias that selects but never weighs, hash-routed layers;
# 2. **stage**: the FP8 input contract of vLLM's mega-MoE path, with four UE8M0 scale bytes packed in an int32;
# 3. **experts**: tokens grouped by expert, two grouped GEMMs with the clamped SwiGLU in between;
# 4. **combine**: an fp32 sum per token that cannot lose a repeated expert, plus the shared expert.
#
# The facts and the pitfalls are collected in [`docs/moe.md`](../docs/moe.md). The code is in `dsv4ref/moe/`:
# `reference.py` (the whole op in PyTorch), `kernels.py` (Triton), `launch.py` (launch choices and grouping).
# We use the small teaching config: Hd = 256, E = 8 experts, top-2, I = 128.

# %%
import dsv4ref  # first: picks the device, sets TRITON_INTERPRET on a CPU-only machine
import warnings

warnings.filterwarnings("ignore")
import numpy as np

np.seterr(all="ignore")
import matplotlib.pyplot as plt

# %matplotlib inline
import inspect

import torch

from dsv4ref import fp8, moe
from dsv4ref.device import DEVICE, describe
from dsv4ref.moe import reference
from dsv4ref.testing import compare

# %%
# NBVAL_IGNORE_OUTPUT
print(describe())

# %% [markdown]
# ## 1. Routing: the bias selects, the score weighs
#
# The gate is one fp32 GEMM, `z = x · W_gateᵀ` (T × E logits), turned into non-negative affinities
# $s = \sqrt{\mathrm{softplus}(z)}$. A per-expert **bias** b (trained to balance the experts' load) is added
# **only to choose** the top K; the weights come from the unbiased s, renormalised over the K chosen and
# multiplied by the routed scale (1.5):
#
# $$\text{ids}_t = \operatorname{topK}_e(s_{te} + b_e),\qquad w_{tk} = 1.5\cdot\frac{s_{t,\text{ids}_{tk}}}{\max\big(\sum_{k'} s_{t,\text{ids}_{tk'}},\ 10^{-20}\big)}$$
#
# (the floor 10⁻²⁰ only matters for a row whose chosen scores all underflow to 0: it gets weights 0, not 0/0;
# the log1p cell below shows when that happens).
#
# On V4-Flash the bias is large and nearly uniform (about 8.08 for every expert), so weights taken from s + b
# would be flat: about 1.5/K for everyone (pitfall P1). Below, 8 tokens of the teaching config with a bias
# spread a little wider than Flash's, so that it visibly moves some choices.

# %%
T = 8
d = moe.example_inputs(T, moe.TINY_MOE, seed=7)
bias = d["bias"] + 0.3 * torch.linspace(-1, 1, 8, device=DEVICE)  # wider than Flash's spread, to see it act
z = d["x"].float() @ d["gate_weight"].float().T
s = reference.scores(z)
ids, w = moe.route(d["x"], d["gate_weight"], bias, k=2, routed_scale=1.5)
by_s = s.topk(2, dim=-1).indices
print("token  ids (by s + b)  ids (by s alone)  weights")
for t in range(T):
    print(
        f"{t:>5}  {str(ids[t].tolist()):>14}  {str(sorted(by_s[t].tolist(), key=lambda e: -s[t, e].item())):>16}  "
        f"{[round(v, 4) for v in w[t].tolist()]}"
    )
print("every row of weights sums to 1.5:", torch.allclose(w.sum(-1), torch.full((T,), 1.5, device=DEVICE)))

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), gridspec_kw={"width_ratios": [3, 1.2, 3]})
im = axes[0].imshow(s.cpu().numpy(), cmap="viridis", aspect="auto")
for t in range(T):
    for e in ids[t].tolist():
        axes[0].add_patch(plt.Rectangle((e - 0.5, t - 0.5), 1, 1, fill=False, edgecolor="red", lw=2))
axes[0].set_xlabel("expert e")
axes[0].set_ylabel("token t")
axes[0].set_title("scores s = √softplus(z); red: selected (by s + b)")
fig.colorbar(im, ax=axes[0])
axes[1].barh(range(8), (bias - 8.08).cpu().numpy(), color="gray")
axes[1].set_yticks(range(8))
axes[1].set_ylabel("expert e")
axes[1].set_title("bias − 8.08")
t0 = 0
x0 = np.arange(8)
axes[2].bar(x0 - 0.2, s[t0].cpu().numpy(), 0.4, label="s (weighs)")
axes[2].bar(x0 + 0.2, (s[t0] + bias - 8.08).cpu().numpy(), 0.4, label="s + b − 8.08 (selects)")
for e in ids[t0].tolist():
    axes[2].annotate("chosen", (e, float(s[t0, e]) + 0.05), ha="center", color="red")
axes[2].set_xlabel("expert e")
axes[2].set_title(f"token {t0}")
axes[2].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# The worked examples of the docs (E = 8, K = 2), with the logits placed exactly through a one-hot x. Case C
# shows the bias choosing a weak expert (4) whose weight nevertheless stays small, because it comes from s:

# %%
x1 = torch.zeros(1, 8, dtype=torch.bfloat16, device=DEVICE)
x1[0, 0] = 1.0
Wz = torch.zeros(8, 8, dtype=torch.bfloat16, device=DEVICE)
Wz[:, 0] = torch.tensor([0, 1, 2, 3, -1, -2, 0.5, 4], dtype=torch.bfloat16)
for name, b in [("A: b[7] = −10", {7: -10.0}), ("B: no bias", {}), ("C: b[4] = +5", {4: 5.0})]:
    bb = torch.zeros(8, device=DEVICE)
    for e, v in b.items():
        bb[e] = v
    i1, w1 = moe.route(x1, Wz, bb, k=2, routed_scale=1.5)
    print(f"{name:<15} ids {i1[0].tolist()}  weights {[f'{v:.5f}' for v in w1[0].tolist()]}")
# five decimals: an fp32 sqrt / log1p may differ in the last bit between a CPU and a GPU
print("s(0) = √ln 2 =", f"{reference.scores(torch.zeros(1, device=DEVICE))[0].item():.6f}")

# %% [markdown]
# **log1p matters, and so does the threshold.** The score is
#
# $$s = \sqrt{\mathrm{softplus}(z)},\qquad \mathrm{softplus}(z) = \begin{cases} z & z > 20 \\ \log(1 + e^{z}) & \text{otherwise}\end{cases}$$
#
# (20 is torch's default softplus threshold; above it log1p(eᶻ) and z agree to fp32's last bit). Both halves
# matter in fp32:
#
# * **below:** log(1 + exp(z)) is exactly 0 once exp(z) < 2^-24, i.e. z ≲ −16.6; a row whose chosen logits are all
#   that negative would then divide 0 by 0 (P2, P3). `log1p` keeps the scores alive down to z ≈ −104, and the
#   floor max(Σ, 1e-20) turns a fully underflowed row into weights 0 instead of NaN;
# * **above:** exp(z) overflows fp32 for z > 88.7, so a port that evaluates log1p(exp z) everywhere returns
#   **inf** for a large logit, and the row's weights become inf/inf = NaN. The threshold returns z itself.

# %%
zz = torch.tensor([-200.0, -104.0, -87.0, -20.0, -16.5, 0.0, 20.0, 30.0, 88.0, 89.0, 100.0], device=DEVICE)
print("z                     ", [f"{v:g}" for v in zz.tolist()])
print("√softplus(z) (library)", [f"{v:.3g}" for v in reference.scores(zz).tolist()])
print("√log1p(exp z), no cap ", [f"{v:.3g}" for v in torch.sqrt(torch.log1p(torch.exp(zz))).tolist()])
print("√log(1 + exp z)       ", [f"{v:.3g}" for v in torch.sqrt(torch.log(1 + torch.exp(zz))).tolist()])

# %% [markdown]
# **Hash-routed layers.** The first layers of V4-Flash (0, 1, 2) do not choose at all: `ids = tid2eid[token id]`,
# a fixed table, and the bias is not read (pass NaN to prove it). The weights are still the renormalised
# √softplus scores at those ids. A row of `input_ids = −1` marks a padding row: ids −1, weights 0.

# %%
dh = moe.example_inputs(4, moe.TINY_MOE, seed=8, hash_layer=True)
tok = dh["input_ids"].clone()
tok[3] = -1
ih, wh = moe.route(
    dh["x"],
    dh["gate_weight"],
    torch.full((8,), float("nan"), device=DEVICE),
    k=2,
    routed_scale=1.5,
    hash_table=dh["hash_table"],
    input_ids=tok,
)
for t in range(4):
    row = dh["hash_table"][tok[t]].tolist() if tok[t] >= 0 else "padding"
    print(
        f"token id {int(tok[t]):>4}: table row {row!s:<9} -> ids {ih[t].tolist()}, weights {[round(v, 4) for v in wh[t].tolist()]}"
    )

# %% [markdown]
# ## 2. Staging: FP8 activations with four scale bytes in one int32
#
# vLLM's mega-MoE path does not hand the expert kernel bf16 activations. A staging kernel
# (`_deepseek_v4_stage_mega_moe_inputs_kernel`) quantises x to e4m3 with one UE8M0 scale byte per **32** values,
# packs the four bytes of each 128-value block into **one int32** (byte j in bits 8j … 8j + 7), and copies the
# top-k ids (to int64) and weights. A group whose amax exceeds 448 needs a byte ≥ 128; in lane 3 that byte sets
# the sign bit, so the word comes out **negative**.
#
# **Where it runs.** In the seed's Intel XPU model file this kernel is *unreachable* (the mega-MoE experts raise
# "not supported on XPU" and XPU takes the generic fused-MoE path), and on CUDA its consumer is DeepGEMM's SM100
# (Blackwell) `fp8_fp4_mega_moe`, which an H200 cannot run. So dsv4ref implements the **contract** byte for byte
# and consumes the staged buffers with **its own** expert kernel (section 3).
#
# One token, two 128-blocks: block 0 holds groups with amax 0 (and a −0.0), 1.0, 448 and 450; block 1 groups with
# amax 0, 1.75 (= 448·2^-8 exactly: the quotient amax / 448 is a power of two, byte 119), 0.01 and 0.
#
# **The e4m3 bytes printed below** (float8_e4m3fn, the "fn" variant): sign bit, 4 exponent bits with bias 7,
# 3 mantissa bits. A byte `s eeee mmm` is (−1)^s · 2^(e − 7) · (1 + m/8) for e ≥ 1, and (−1)^s · m · 2^-9 for
# e = 0 (subnormals: 2^-9 … 7·2^-9, then 0). The largest finite value is 0x7E = 0 1111 110 = 2^8 · 1.75 = 448;
# 0x7F and 0xFF are NaN; there is no infinity. So 0x00 is +0, 0x80 is −0, 0x38 is 1.0 and 0xB8 is −1.0.

# %%
h = torch.zeros(1, 256)
h[0, 5] = -0.0
h[0, 32:35] = torch.tensor([1.0, 0.5, -1.0])
h[0, 64:66] = torch.tensor([448.0, -448.0])
h[0, 96:98] = torch.tensor([450.0, -450.0])
h[0, 160] = 1.75
h[0, 192] = 0.01
h = h.to(torch.bfloat16).to(DEVICE)
sid = torch.tensor([[3, -1]], dtype=torch.int32, device=DEVICE)
sw = torch.tensor([[1.5, 0.0]], device=DEVICE)
x_fp8, x_sf, ids64, w32 = moe.stage(h, sid, sw)
words = x_sf[0].tolist()
for kb, word in enumerate(words):
    u = word & 0xFFFFFFFF
    print(f"block {kb}: bytes (byte_0..byte_3) {[(u >> (8 * j)) & 0xFF for j in range(4)]}  word 0x{u:08X} = {word} as int32")
q = x_fp8.view(torch.uint8)[0].tolist()
print("e4m3 bytes at dims 0, 5, 32, 33, 64, 96, 97, 160:", [f"0x{q[i]:02X}" for i in (0, 5, 32, 33, 64, 96, 97, 160)])
print("ids", ids64.dtype, ids64.tolist(), "| weights", w32.tolist())

# %%
fig, ax = plt.subplots(figsize=(12, 2.8))
cmap = plt.get_cmap("coolwarm")
for g in range(8):
    kb, j = divmod(g, 4)
    byte = (words[kb] & 0xFFFFFFFF) >> (8 * j) & 0xFF
    ax.add_patch(plt.Rectangle((g * 32, 1.4), 32, 0.8, color=cmap((byte - 100) / 40), ec="k"))
    ax.text(g * 32 + 16, 1.8, f"g{g}: 32 × e4m3\nbyte {byte}", ha="center", va="center", fontsize=8)
    ax.add_patch(plt.Rectangle((kb * 128 + (3 - j) * 32, 0.2), 32, 0.8, color=cmap((byte - 100) / 40), ec="k"))
    ax.text(kb * 128 + (3 - j) * 32 + 16, 0.6, f"byte_{j}\n{byte}", ha="center", va="center", fontsize=8)
    ax.annotate(
        "",
        xy=(kb * 128 + (3 - j) * 32 + 16, 1.0),
        xytext=(g * 32 + 16, 1.4),
        arrowprops=dict(arrowstyle="->", color="gray", lw=0.8),
    )
for kb, word in enumerate(words):
    ax.text(
        kb * 128 + 64, -0.25, f"x_sf[t, {kb}] = 0x{word & 0xFFFFFFFF:08X} = {word}  (bit 31 … bit 0)", ha="center", fontsize=9
    )
ax.text(-4, 1.8, "x_fp8[t]", ha="right", va="center")
ax.text(-4, 0.6, "x_sf[t]", ha="right", va="center")
ax.set_xlim(-40, 260)
ax.set_ylim(-0.5, 2.4)
ax.axis("off")
ax.set_title("one token, Hd = 256: 8 groups of 32 values, 2 packed int32 words (byte_3 on the left = most significant)")
plt.show()

# %% [markdown]
# ### The encoder, step by step
#
# Everything `stage` writes, for one token row x (bf16, Hd values, Hd a multiple of 128) and its top-k slots:
#
# | output | dtype, shape | what it holds |
# |---|---|---|
# | `x_fp8` | float8_e4m3fn `[T, Hd]` | each value of group g (32 values) as e4m3 of x · 2^(127 − byte_g) |
# | `x_sf` | int32 `[T, Hd / 128]` | word kb = the 4 bytes of groups 4kb … 4kb + 3, byte j in bits 8j … 8j + 7 |
# | `ids` | int64 `[T, K]` | the top-k ids, copied (−1 slots stay −1) |
# | `weights` | fp32 `[T, K]` | the routing weights, copied as given (a −1 slot keeps its weight; the experts never read it) |
#
# Per group g of 32 values, the **scale byte** is
#
# $$\text{byte}_g = \Big\lceil \log_2 \frac{\max(\text{amax}_g,\ 10^{-4})}{448} \Big\rceil + 127,\qquad \text{amax}_g = \max_i |x_i|$$
#
# 1. **The floor 10⁻⁴** applies to *every* group whose amax is below it, not only to all-zero groups: a group with
#    amax 5·10⁻⁵ gets the byte of 10⁻⁴ (105), not 104. It gives an all-zero group a byte at all (log₂ 0 = −∞) and
#    keeps every byte ≥ 105, far from E8M0's smallest scales. For the **e4m3 codes** it does the opposite of
#    keeping them normal: without it, a group's largest value always lands in (224, 448]; with it, a group whose
#    amax is far below 10⁻⁴ is scaled by 2^22 only, so its codes are small, and below amax ≈ 2^-28 (3.7·10⁻⁹)
#    they are e4m3 subnormals (m·2^-9) or 0. Tiny groups lose precision; the cell after the encoder shows it.
# 2. **Exactly, from the bits:** s = fp32(max(amax, 10⁻⁴) / 448) (IEEE division, correctly rounded); then
#    byte = ⌈log₂ s⌉ + 127 is s's **biased** exponent field (bits 23 … 30 of the fp32 word, which already hold
#    the exponent + 127), plus 1 if any mantissa bit is set (s is then above that power of two). A float
#    `ceil(log2(s))` of that same fp32 quotient agrees with the bits for every positive bf16 amax (fp32, numpy
#    and `math.log2` all return −8 exactly for 1.75 / 448 = 2^-8). What goes wrong is splitting the log:
#    ⌈log₂ amax − log₂ 448⌉ rounds the difference, and at amax = 448·2^k it lands a hair above the integer k:
#    one byte too many (the second cell after the encoder counts them).
# 3. **The values:** q = e4m3(clamp(x · 2^(127 − byte), −448, 448)), the multiply exact (a power of two), the
#    cast **round to nearest, ties to even**. The clamp matters: torch versions disagree on what an
#    out-of-range cast gives.
# 4. **Non-finite input.** With value checks on (the default) `stage` refuses NaN/±inf in `hidden` before any
#    write. With them off (`DSV4REF_CHECK_VALUES=0`, the hot path) each group holding a NaN or ±inf is
#    written as byte **255** (E8M0's NaN) with every code **0x7F**, or **0xFF** for a value that is not a NaN and
#    has its sign bit set; other groups are unaffected. It reads back as NaN, never as a plausible number.
#
# Value checks are on unless the environment variable `DSV4REF_CHECK_VALUES` is `0`, read at every call:
# `dsv4ref.validate.checking_values(False)` sets it for a block, and the conformance suite runs its non-finite
# cases inside that block. A port behind the public signature learns the setting the same way, from
# `dsv4ref.validate.check_values()` (or the variable itself), at call time.
#
# The whole encoder in a dozen lines of plain torch, then held byte for byte to the library on rows built to hit
# each rule: a group with 0 < amax < 10⁻⁴, exact powers of two, ties between two e4m3 codes, values above 448·2^k,
# and (value checks off) a group holding a NaN and one holding −inf.


# %%
def stage_by_hand(x, ids, weights):
    g = x.float().reshape(x.shape[0], -1, 32)  # [T, groups, 32]
    s = g.abs().amax(-1).clamp(min=1e-4) / torch.full_like(g[..., 0], 448.0)  # fp32 IEEE division (not `/ 448`)
    bits = s.view(torch.int32)
    byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()  # ⌈log2 s⌉ + 127
    inv = ((254 - byte) << 23).view(torch.float32)  # 2^(127 - byte), exact
    q = (g * inv[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)  # ties to even
    bad = ~g.isfinite().all(-1)  # the non-finite policy, per group
    nan_code = torch.where(torch.signbit(g) & ~g.isnan(), 0xFF, 0x7F).to(torch.uint8)
    q = torch.where(bad[..., None], nan_code, q)
    byte = torch.where(bad, 255, byte).to(torch.uint8)
    x_sf = byte.reshape(x.shape[0], -1, 4).contiguous().view(torch.int32)[..., 0]  # 4 bytes -> 1 int32
    return q.reshape(x.shape).view(torch.float8_e4m3fn), x_sf, ids.to(torch.int64), weights.clone()


rows = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)) * torch.exp2(
    torch.arange(-12.0, 20.0, 4.0)
).repeat_interleave(32)
rows[0, :32] *= 5e-5 / rows[0, :32].abs().max()  # 0 < amax < 1e-4: the floor applies
rows[1, :32] = 1.75  # an exact power-of-two scale
rows[1, 32:64] = torch.tensor([17.0, 19.0, 232.0, 248.0] * 8)  # halfway between two e4m3 codes (448 = amax)
rows[1, 32] = 448.0
rows[2, 64:96] *= 1e6  # far above 448: the byte grows, the clamp is not hit
xs = rows.to(torch.bfloat16).to(DEVICE)
sid = torch.tensor([[0, 3], [-1, 5], [7, -1], [2, 2]], device=DEVICE)
sw = torch.rand(4, 2, generator=torch.Generator().manual_seed(4)).to(DEVICE)
for name, a, b in zip(("x_fp8", "x_sf", "ids", "weights"), stage_by_hand(xs, sid, sw), moe.stage(xs, sid, sw, backend="triton")):
    print(compare(a, b, "exact", f"by hand vs moe.stage (Triton): {name}").verdict())
byte_floor = stage_by_hand(xs, sid, sw)[1][0, 0].item() & 0xFF
print("byte of the group with amax 5e-5:", byte_floor, "(the floor's byte: 105; without the floor: 104)")

bad_rows = xs.clone()
bad_rows[0, 40], bad_rows[3, 200] = float("nan"), float("-inf")
with dsv4ref.validate.checking_values(False):
    got = moe.stage(bad_rows, sid, sw, backend="triton")
mine = stage_by_hand(bad_rows, sid, sw)
print(
    compare(got[0], mine[0], "exact", "non-finite groups, codes").verdict(),
    "|",
    compare(got[1], mine[1], "exact", "non-finite groups, scale words").verdict(),
)
print(
    "group 1 of token 0 (a NaN inside): byte",
    (got[1][0, 0].item() >> 8) & 0xFF,
    "| codes",
    sorted({f"0x{v:02X}" for v in got[0].view(torch.uint8)[0, 32:64].tolist()}),
)
print(
    "group 6 of token 3 (a -inf inside): byte",
    (got[1][3, 1].item() >> 16) & 0xFF,
    "| codes",
    sorted({f"0x{v:02X}" for v in got[0].view(torch.uint8)[3, 192:224].tolist()}),
)
try:
    moe.stage(bad_rows, sid, sw)
except ValueError as e:
    print("value checks on: ValueError,", str(e).split(" (")[0])

# %% [markdown]
# **The floor and the codes of a tiny group** (rule 1): one group of 32 values spanning 10⁻⁸ … 10⁻¹⁰, coded with
# the floor (the library) and with a byte taken from its amax alone. e4m3 subnormals are the codes whose exponent
# bits are 0 (`code & 0x78 == 0`), zeros included.

# %%
tiny = (torch.logspace(-8, -10, 32, dtype=torch.float64) * torch.tensor([1.0, -1.0] * 16, dtype=torch.float64)).to(torch.bfloat16)
tiny_x = torch.cat([tiny, torch.ones(96, dtype=torch.bfloat16)]).to(DEVICE)[None]  # one 128-block: the tiny group first
codes, words = moe.stage(tiny_x, sid[:1], sw[:1])[:2]
with_floor = codes.view(torch.uint8)[0, :32]
amax = tiny.float().abs().max()
byte_own = int(torch.ceil(torch.log2(fp8.reference.div_rn(amax, 448)))) + 127
own = (tiny.float() * 2.0 ** (127 - byte_own)).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
for name, c, byte in (("with the floor", with_floor, words[0, 0].item() & 0xFF), ("byte from amax", own, byte_own)):
    sub = int(((c & 0x78) == 0).sum())
    print(f"{name:<15} byte {byte}: {sub:>2} of 32 codes subnormal or zero, largest code 0x{int(c.max()):02X}")

# %% [markdown]
# **Which float log is wrong** (rule 2): every positive finite bf16 amax (32 640 values), its byte from the bits,
# from a float `ceil(log2)` of the fp32 quotient, and from the split log. Only the split log disagrees, at the 8
# values 448·2^k where its rounding lands above k:

# %%
# host: the float logs are the CPU's (a GPU's log2 may round another way); the bits are the same everywhere
every = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
quot = fp8.reference.div_rn(every.clamp(min=1e-4), 448.0)  # fp32, one IEEE division on every device
qb = quot.view(torch.int32)
by_bits = ((qb >> 23) & 0xFF) + ((qb & 0x7FFFFF) != 0).int()
by_log = torch.ceil(torch.log2(quot)).int() + 127
by_split = torch.ceil(torch.log2(every.clamp(min=1e-4)) - torch.log2(torch.tensor(448.0))).int() + 127
print("ceil(log2(amax / 448)) + 127 differs from the bits:", int((by_log != by_bits).sum()), "times")
wrong = (by_split != by_bits).nonzero()[:, 0]
print(
    "ceil(log2(amax) - log2(448)) + 127 differs:",
    wrong.numel(),
    "times, at amax / 448 =",
    [f"2^{int(torch.log2(quot[i]))}" for i in wrong.tolist()],
)
print("byte of 1.75 by the bits / by the float log of the quotient:", int(by_bits[every == 1.75]), int(by_log[every == 1.75]))

# %% [markdown]
# The Triton staging kernel writes the same bits as the reference, here on random rows whose 32-groups span 24
# octaves, a strided (non-contiguous) view of the hidden states, int32 ids with −1 entries and K = 6:

# %%
big = moe.example_inputs(24, moe.TINY_MOE, seed=9, octaves=24)["x"]
hs = torch.cat([big, big], dim=1)[:, ::2]  # a strided view
gid = torch.randint(-1, 8, (24, 6), generator=torch.Generator().manual_seed(1)).to(torch.int32).to(DEVICE)
gw = torch.rand(24, 6, generator=torch.Generator().manual_seed(2)).to(DEVICE)
got = moe.stage(hs, gid, gw, backend="triton")
want = moe.stage(hs, gid, gw, backend="reference")
for name, a, b in zip(("x_fp8", "x_sf", "ids", "weights"), got, want):
    print(compare(a, b, "exact", f"stage {name}, Triton vs reference").verdict())

# %% [markdown]
# ## 3. The experts: group by expert, two grouped GEMMs
#
# Per slot (token t, slot k) with expert e = ids[t, k] and weight ω, on the dequantised activation
# x̂ = e4m3 · 2^(byte − 127) (exact in bf16):
#
# $$a = \hat x W_1[e]^\top,\quad u = \hat x W_3[e]^\top,\quad h = \mathrm{silu}(\min(a, 10))\cdot\mathrm{clamp}(u, -10, 10)\cdot\omega,\quad o = \mathrm{bf16}(\mathrm{bf16}(h)\,W_2[e]^\top)$$
#
# The routing weight goes in **before** the down projection (V3 multiplied the expert output), and the shared
# expert is clamped the same way (P5). `swiglu_limit` is L; **L ≤ 0 switches the clamp off** (the V4 reference's
# switch: `silu(a) · u` unclamped), which is what `swiglu_limit=0.0` means in the oracle cell below.
#
# **The shared expert** reads the **bf16 x**, not the staged x̂ (that is why `experts` takes x beside the staged
# buffers): h = silu(min(x W₁ˢᵀ, L)) · clamp(x W₃ˢᵀ, −L, L) with ω = 1, rounded to bf16, then its output
# bf16(h W₂ˢᵀ) is **rounded to bf16** like each routed slot's output, before the fp32 sum of the combine. To run many tokens of one expert as one GEMM, the T·K slots are
# **grouped by expert** with device ops only (a stable sort, counts, offsets: no host sync, so a CUDA graph can
# hold it). −1 slots sort last and are never touched:

# %%
d = moe.example_inputs(6, moe.TINY_MOE, seed=10, octaves=12, weight_gain=2.0)
ids, w = moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=1.5)
ids[2, 1] = -1  # a −1 slot ...
w[2, 1] = 1e6  # ... with a huge weight: it must add exactly nothing
order, counts, offsets = moe.group_by_expert(ids, 8)
print("ids per token:", ids.tolist())
print("slots t·K + k sorted by expert:", order.tolist())
print("counts per expert:", counts.tolist(), "| offsets:", offsets.tolist())

# %% [markdown]
# One program of `gate_up_kernel` takes up to `block_m` slots of **one** expert and a block of intermediate
# columns. It unpacks the scale word (byte j of the word scales columns 32j … 32j + 31 of the block), runs both
# GEMMs with fp32 accumulation, applies the clamped SwiGLU and ω, and writes h in bf16. `down_kernel` then
# writes each slot's `bf16(h @ W2ᵀ)` to **that slot's own row**:

# %%
print(inspect.getsource(moe.kernels.gate_up_kernel.fn))  # .fn: the Python function under @triton.jit

# %% [markdown]
# The routed experts plus the shared expert, against a float64 oracle without any rounding (tolerance
# `moe_out`: the bf16 roundings of h, of each expert output and of the result bound the error by
# 2^-8 · (|out| + Σ|h|·|W2|)):

# %%
staged = moe.stage(d["x"], ids, w)
layer_w = (d["w13"], d["w2"], d["shared_w13"], d["shared_w2"])
out = moe.experts(d["x"], *staged, *layer_w, swiglu_limit=10.0, backend="triton")
want = reference.experts(d["x"], *staged, *layer_w, swiglu_limit=10.0, dtype=torch.float64)
mass = reference.experts(d["x"], *staged, *layer_w, swiglu_limit=10.0, dtype=torch.float64, mass=True)
print(compare(out, want, "moe_out", "experts (Triton) vs float64", mass=mass).verdict())
print(
    compare(
        moe.experts(d["x"], *staged, *layer_w, swiglu_limit=10.0, backend="reference"),
        want,
        "moe_out",
        "experts (torch reference) vs float64",
        mass=mass,
    ).verdict()
)
nc = reference.experts(d["x"], *staged, *layer_w, swiglu_limit=0.0, dtype=torch.float64)
print(compare(out, nc, "moe_out", "experts vs an oracle WITHOUT the clamp", mass=mass).verdict(), "<- the clamp is active here")

# %% [markdown]
# ## 4. The combine
#
# `combine_kernel` reads, for each token, its K slot rows (skipping −1 slots: their rows are never read),
# adds the shared expert's output, and rounds once:
#
# $$y_t = \mathrm{bf16}\Big(\sum_{k:\ \text{ids}_{tk}\ge 0} o_{t,k} + \mathrm{Shared}(x_t)\Big)\quad\text{(fp32 sum)}$$
#
# Because each slot has its own row, a token that names the same expert twice gets both contributions. The
# classic scatter `y[idx] += v` with a repeated index keeps only one (PyTorch's advanced-index assignment does
# not accumulate; `index_add_` does):

# %%
y = torch.zeros(1, 3)
y[torch.tensor([0, 0])] += torch.ones(2, 3)
y2 = torch.zeros(1, 3).index_add_(0, torch.tensor([0, 0]), torch.ones(2, 3))
print("y[idx] += v:", y.tolist(), "| index_add_:", y2.tolist())
dup = staged[2].clone()
dup[0] = torch.tensor([4, 4])
out_dup = moe.experts(d["x"], staged[0], staged[1], dup, staged[3], *layer_w, swiglu_limit=10.0)
want_dup = reference.experts(d["x"], staged[0], staged[1], dup, staged[3], *layer_w, swiglu_limit=10.0, dtype=torch.float64)
mass_dup = reference.experts(
    d["x"], staged[0], staged[1], dup, staged[3], *layer_w, swiglu_limit=10.0, dtype=torch.float64, mass=True
)
print(compare(out_dup, want_dup, "moe_out", "a row naming expert 4 twice", mass=mass_dup).verdict())
w0 = staged[3].clone()
w0[2, 1] = 0.0
print(
    "the −1 slot with weight 1e6 adds exactly 0:",
    torch.equal(out, moe.experts(d["x"], staged[0], staged[1], staged[2], w0, *layer_w, swiglu_limit=10.0)),
)

# %% [markdown]
# The whole layer, `forward` = route → stage → experts, on a hash-routed layer with a padding row, and with the
# routed scale set to 0, which must leave exactly the shared expert (the scale never touches it: P11):

# %%
dh = moe.example_inputs(6, moe.TINY_MOE, seed=11, hash_layer=True, octaves=12)
dh["input_ids"][4] = -1
args = (dh["x"], dh["gate_weight"], None, dh["w13"], dh["w2"], dh["shared_w13"], dh["shared_w2"])
kw = dict(k=2, swiglu_limit=10.0, hash_table=dh["hash_table"], input_ids=dh["input_ids"])
y = moe.forward(*args, routed_scale=1.5, **kw)
ih, wh = moe.route(
    dh["x"], dh["gate_weight"], None, k=2, routed_scale=1.5, hash_table=dh["hash_table"], input_ids=dh["input_ids"]
)
sh = moe.stage(dh["x"], ih, wh, backend="reference")
lw = (dh["w13"], dh["w2"], dh["shared_w13"], dh["shared_w2"])
print(
    compare(
        y,
        reference.experts(dh["x"], *sh, *lw, swiglu_limit=10.0, dtype=torch.float64),
        "moe_out",
        "forward (Triton)",
        mass=reference.experts(dh["x"], *sh, *lw, swiglu_limit=10.0, dtype=torch.float64, mass=True),
    ).verdict()
)
y0 = moe.forward(*args, routed_scale=0.0, **kw)
none = torch.full((6, 2), -1, dtype=torch.int64, device=DEVICE)
shared_only = moe.experts(dh["x"], sh[0], sh[1], none, sh[3], *lw, swiglu_limit=10.0)
print("routed scale 0 gives exactly the shared expert:", torch.equal(y0, shared_only))

# %% [markdown]
# ## 5. On the H200
#
# `python -m dsv4ref bench moe` times, at V4-Flash size (Hd 4096, E 256, K 6, I 2048, bf16 weights), the staging
# kernel at T = 4096 against copy bandwidth, and the expert kernels at T = 64 (decode: bound by the bytes of the
# experts' weights) and T = 4096 (prefill: bound by the FLOPs), each beside the torch reference in eager mode and
# under `torch.compile`. On a CPU this cell only says where the figures are.

# %%
# NBVAL_IGNORE_OUTPUT
if not dsv4ref.interpreting():
    from dsv4ref.tools.harness import run_benches

    ceil, rows = run_benches("moe")
    for r in rows:
        print(f"{r.case.op:28} {r.case.shape:32} {r.ms * 1e3:9.1f} us {r.fraction:6.1%} of bound")
else:
    print("interpreting on the CPU: no timings here (see benchmarks/moe.md for the H200 figures)")

# %% [markdown]
# The latest one-run H200 bench, as `benchmarks/RESULTS.md` records it (date, device and the ceilings measured in
# the same run first; the runs behind each design, and what was tried, in
# [`benchmarks/moe.md`](../benchmarks/moe.md)):

# %%
from IPython.display import Markdown

from dsv4ref.tools.results import results_header, results_section

Markdown(results_header() + "\n\n" + results_section("moe"))

# %% [markdown]
# **Why the staging kernel's encoder looks the way it does.** Staging moves few bytes per value, so a
# straightforward encoder is bound by integer instructions, not by memory, and the per-value non-finite policy
# was a large share of them. The staging kernel's encoder (`moe.kernels.stage_kernel`) takes the scale byte from the
# amax's bits with a few integer operations (no division), rounds each value onto the e4m3 grid with one fused
# multiply-add whose grid constant is read off the value's own exponent, and runs the non-finite policy only in a
# tile that holds a NaN / ±inf group — the same bytes as the step-by-step encoder of §2. The table above puts it
# beside a plain copy of the same size, which is the most a transfer of this size reaches.
#
# The reference's Python loop over 256 experts (one `torch.where` and a host sync each) is what `torch.compile`
# cannot remove: only the per-expert MLP gets compiled. The grouped kernels launch a fixed grid with no sync.
