# %% [markdown]
# # 05 · The lightning indexer: score everything cheaply, attend to the best 512
#
# On DeepSeek-V4's ratio-4 layers (C4A) every 4 tokens are compressed into one 512-dim row. A decode token at
# position p can see n_c = (p+1)//4 such rows: 262 144 of them at a 1M-token context. Attending to all of them
# would read 584 bytes and do two 64-head, 512-dim dot products per row. Instead a **lightning indexer**
# scores every row with a tiny FP8 model and main attention reads only the top K_top = 512 (notebook 04):
#
# $$I_{t,s} = \sum_{h=1}^{64} w_{t,h}\,\mathrm{ReLU}\big(q_{t,h}\cdot k_s\big),\qquad q_{t,h}, k_s \in \mathbb{R}^{128}$$
#
# This notebook builds it piece by piece: the fused query path (RoPE → bf16 round trip → optional Hadamard →
# FP8 with the q scale folded into the weights, or MXFP4), the 132-byte key cache, the logits kernel with
# its causal mask, top-k with the short-context shortcut, and the op registration that lets `torch.compile`
# trace through it. The math is written up in `docs/indexer.md`; the code lives in `dsv4ref/indexer/`:
# `reference.py` (the whole op in torch), `kernels.py` (the Triton kernels) and `launch.py` (their launches).

# %%
import dsv4ref  # first: picks the device, sets TRITON_INTERPRET on a CPU-only machine
import inspect
import warnings

warnings.filterwarnings("ignore")
import numpy as np

np.seterr(all="ignore")
import matplotlib.pyplot as plt
import torch

# %matplotlib inline
from dsv4ref import indexer as ix
from dsv4ref.config import FLASH
from dsv4ref.device import DEVICE, describe
from dsv4ref.testing import compare

# %%
# NBVAL_IGNORE_OUTPUT
print(describe())

# %% [markdown]
# ## 1. Why an indexer: the cost of attending to everything
#
# Count the bytes one decode token must read per layer, and the multiply-adds, for V4-Flash (64 heads,
# K_top = 512). Attention over a compressed row reads its 584-byte record (notebook 01) and does QK and PV
# for 64 heads of 512 dims. The indexer reads a 132-byte key (128 e4m3 + an fp32 scale) and does 64 heads of
# 128 dims, QK only.

# %%
heads, d_lat, d_ih, n_ih, k_top = FLASH.num_heads, FLASH.head_dim, FLASH.index_head_dim, FLASH.index_heads, FLASH.index_topk
print(f"{'context':>9} {'n_c':>8} | {'attend to all':>22} | {'indexer + top-512':>22}")
for ctx in (8192, 131072, 1048576):
    n_c = ctx // 4
    all_b, all_f = n_c * 584, n_c * 2 * heads * d_lat * 2
    idx_b = n_c * ix.FP8_RECORD + min(n_c, k_top) * 584
    idx_f = n_c * 2 * n_ih * d_ih + min(n_c, k_top) * 2 * heads * d_lat * 2
    print(
        f"{ctx:>9} {n_c:>8} | {all_b / 2**20:7.1f} MiB {all_f / 1e9:6.2f} GFLOP | "
        f"{idx_b / 2**20:7.1f} MiB {idx_f / 1e9:6.2f} GFLOP"
    )

# %% [markdown]
# At 1M tokens the indexer reads 4.4× fewer bytes and does 7.8× fewer FLOPs than dense attention over the
# compressed rows, and the main attention that follows reads a constant 512 rows. Below n_c ≤ 512 there is
# nothing to choose: every row is selected (the **short-context shortcut**, section 6).

# %% [markdown]
# ## 2. The query path, in torch (the reference)
#
# One row per (token, head), all math in fp32 (`docs/indexer.md`):
#
# 1. **RoPE** on the last 64 of the 128 dims, GPT-J pairs (x[64+2i], x[64+2i+1]), at the token's position;
# 2. a **bf16 round trip** of the rotated dims ("match reference numerics"; skipping it flips bytes);
# 3. optionally the **Hadamard** rotation H₁₂₈·128^-½ (7 butterfly stages), which spreads outliers before
#    low-bit quantisation. It must be applied to q **and** k, or to neither;
# 4. **FP8**: one power-of-two scale 2^e per (token, head) with e = ⌈log₂(max(amax, 10⁻⁴)/448)⌉, and
#    q_fp8 = e4m3(x·2^-e).
#
# The scale is not stored. Because ReLU is positively homogeneous, ReLU(2^e·a) = 2^e·ReLU(a) for any a, so
#
# $$w_{t,h}\,\mathrm{ReLU}(q_{t,h}\cdot k) \;\approx\; \underbrace{w_{t,h}\,2^{e_{t,h}}\,c}_{\texttt{weights\_out}}\;\mathrm{ReLU}(\hat q_{t,h}\cdot k),
# \qquad c = 128^{-1/2}\,n_{ih}^{-1/2}$$
#
# and the per-head q scale rides along in the head weight: the **fold**. Both factors are exact
# (a power of two, then one fp32 multiply by c), so `weights_out` is bit-exact across implementations.
# The weights themselves come from `weights_proj(x)` on the attention **input** x, not on the q-LoRA latent.
#
# The whole query path in torch, from `dsv4ref/indexer/reference.py`:

# %%
print(inspect.getsource(ix.reference.prepare_q))
print(inspect.getsource(ix.reference.quantize_q))

# %%
T, H, N_KEYS, BC = 4, 16, 128, 16
ex = ix.example_inputs(T, H, N_KEYS, block_size=BC, seed=5)
iq, pos, cs, w = ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"]
print("index_q", tuple(iq.shape), iq.dtype, "| positions", pos.cpu().tolist(), "| weights", tuple(w.shape), w.dtype)

x = ix.reference.prepare_q(iq, pos, cs)  # RoPE + bf16 round trip, fp32
q_ref, _, wo_ref = ix.quantize_q(iq, pos, cs, w, backend="reference")
amax = x[0].abs().amax(-1)
e = (wo_ref[0].double() / (w[0].double() * ix.reference.fold(H))).log2()
print("token 0, scale exponent e per head:", e.round().int().cpu().tolist())
print(
    "weights_out == w · 2^e · c exactly:", torch.equal(wo_ref[0], (w[0] * torch.exp2(e.round()).float()) * ix.reference.fold(H))
)
print(
    "every head's largest |q̂| lands in (224, 448]:",
    bool(((amax * torch.exp2(-e.round().float()) > 224) & (amax * torch.exp2(-e.round().float()) <= 448)).all()),
)

# %% [markdown]
# A numerical check of the fold: scale one head's query by 2^k. The FP8 codes do not move at all; only that
# head's weight is multiplied by exactly 2^k (every step — rotation, bf16 rounding, butterflies — commutes
# with a power-of-two scaling). The tests assert this bit for bit, with and without Hadamard.

# %%
iq2 = iq.clone()
iq2[0, 3] *= 2.0**6
q2, _, wo2 = ix.quantize_q(iq2, pos, cs, w, backend="reference")
print("codes unchanged:", torch.equal(q2.view(torch.uint8), q_ref.view(torch.uint8)))
print(
    "weights_out[0, 3] ratio:",
    (wo2[0, 3] / wo_ref[0, 3]).item(),
    "| other heads unchanged:",
    torch.equal(wo2[0, :3], wo_ref[0, :3]) and torch.equal(wo2[1:], wo_ref[1:]),
)

# %% [markdown]
# ## 3. The kernel
#
# `dsv4ref.indexer.kernels.quantize_kernel` handles a tile of 16 rows (a row = one (token, head)) per program
# (`IndexerLaunch.quant_rows`, passed as `launch=`):
#
# * it loads the bf16 row through an int16 view and widens the bits to fp32 in integers (no bf16
#   arithmetic; the interpreter would get it wrong);
# * RoPE needs each element's pair partner, dim d^1: the kernel simply **loads the row a second time at
#   `d ^ 1`** instead of shuffling registers, then computes `e·c − o·s` / `e·s + o·c`. It is launched with
#   `enable_fp_fusion=False`, so each product is rounded before the add exactly as torch does: no FMA
#   contraction can flip an e4m3 byte;
# * the bf16 round trip is `dsv4ref.tl.bf16_round` (integer round-half-even);
# * the Hadamard is 7 calls of a butterfly made of `reshape → permute → split → join(a+b, a−b)` (below);
# * the FP8 step is the shared `ue8m0_byte` (bit-field ceil-log2) and `e4m3_encode` (grid-snap RNE);
# * the same kernel also quantises keys and writes them straight into the paged K cache (a `PAGED` switch).
#
# One butterfly stage, from `dsv4ref/indexer/kernels.py`:

# %%
print(inspect.getsource(ix.kernels.butterfly.fn))  # .fn: the Python function under @triton.jit

# %% [markdown]
# The kernel must match the reference **byte for byte**:

# %%
for fmt in ix.FMTS:
    for had in (False, True):
        ref = ix.quantize_q(iq, pos, cs, w, fmt=fmt, hadamard=had, backend="reference")
        out = ix.quantize_q(iq, pos, cs, w, fmt=fmt, hadamard=had)
        names = ("codes", "scales", "weights_out")
        print(
            f"{fmt:6} hadamard={had!s:5}",
            " | ".join(compare(o, r, "exact", n).verdict() for o, r, n in zip(out, ref, names) if o is not None),
        )

# %% [markdown]
# ## 4. MXFP4: half the key bytes, no fold
#
# The MXFP4 variant quantises each 128-vector in 4 blocks of 32, each with its own UE8M0 scale (QMAX 6, floor
# 6·2^-126), to 4-bit E2M1 codes with magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Two codes share a byte, **even
# element in the low nibble**; the query's 4 scale bytes are packed into one int32, block 0 in the low byte.
# The scales differ per block, so they cannot be pulled out of the dot product: **no fold**, and the kernel
# multiplies each decoded block by 2^(e_q + e_k) before the dot product (done by dequantising both sides,
# which is exact in bf16).

# %%
kb = [0, 3, -2, 1]  # block b holds amax 6·2^kb[b]
vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5, -0.1]
row = torch.zeros(1, 128)
for b in range(4):
    row[0, 32 * b : 32 * b + len(vals)] = torch.tensor(vals) * 2.0 ** kb[b]
packed, sbytes = ix.quantize_k(row.to(torch.bfloat16).to(DEVICE), fmt="mxfp4")
print("values (block 0):   ", vals)
print("codes (block 0):    ", ix.reference.e2m1_encode(torch.tensor(vals)).tolist(), " <- ties go to the even code")
print("packed bytes 0..4:  ", [f"0x{v:02x}" for v in packed[0, :5].cpu().tolist()], " (low nibble = even element)")
print("scale bytes:        ", sbytes[0].cpu().tolist(), " = 127 + k per block")
iq1 = row.reshape(1, 1, 128).to(torch.bfloat16).to(DEVICE)
_, sc_word, _ = ix.quantize_q(
    iq1, torch.zeros(1, dtype=torch.int64, device=DEVICE), cs, torch.ones(1, 1, device=DEVICE), fmt="mxfp4"
)
print("q scale word (int32):", f"0x{int(sc_word[0, 0]) & 0xFFFFFFFF:08x}", " (block 0 in the low byte)")

# %% [markdown]
# **Decoding in the logits kernel.** Hopper has no FP4 tensor-core instruction, so every packed byte is decoded
# before the dot product. The first decode (`fp4_decode="nibble"`) builds each code's fp32 value from its bits,
# multiplies by the block scale and converts to bf16: two float conversions per value, and conversions issue at
# 1/8 the rate of FP32 arithmetic on an H100/H200. The second (`IndexerLaunch(fp4_decode="f16_blocks")`,
# 1.36× faster on the H200; the third, `"f16_scaled"`, the default, builds on it: see the H200 section) uses
# no float instruction at all: shifting the three magnitude bits into the top of fp16's exponent and mantissa
# fields gives exactly value·2⁻¹⁴ for every code (code 1, the value 0.5, lands on an fp16 *subnormal*), so the
# tensor cores can take the result as it is. The scales are applied per 32-block to the partial dot products
# instead (`docs/indexer.md`, "Decoding MXFP4 keys").

# %%
print(inspect.getsource(ix.kernels.e2m1_f16.fn))
codes = torch.arange(8, dtype=torch.int32)
f16 = ((codes << 9).to(torch.int16).view(torch.float16).double() * 2.0**14).tolist()
print("code:                ", codes.tolist())
print("fp16 bits · 2^14:    ", f16)
print("E2M1 value (decoder):", ix.reference.e2m1_decode(codes).tolist())

# %% [markdown]
# ## 5. The key cache and the logits
#
# Keys are quantised the same way (one 128-block, the scale stored as the fp32 value 2^e) and written into
# pages that are a **structure of arrays**: `[Bc × 128 e4m3][Bc × 4-byte fp32 scale]`, 132 B per key
# (`[Bc × 64 packed][Bc × 4 UE8M0]`, 68 B, for MXFP4). The logits kernel runs one program per (token, group of
# pages): it loads the token's 64 (here 16) queries once, then per page of Bc keys computes the
# [Bc × 128] · [128 × H] dot product on tensor cores (bf16 operands: e4m3 and scaled e2m1 values are exact in
# bf16; fp32 in the interpreter), applies **ReLU per head, then** the weighted sum over heads, and multiplies
# by the key scale. Rows s ≥ (p+1)//4 come out as −∞.
#
# We compare both formats with the exact scores computed in float64 from the **unquantised** rotated q and
# the bf16 keys, and measure how much of the exact top-16 each keeps.


# %%
def exact_logits(ex):
    x = ix.reference.prepare_q(ex["index_q"], ex["positions"], ex["cos_sin"]).double()
    dots = torch.einsum("thd,sd->ths", x, ex["k"].double()).clamp_min(0)
    out = torch.einsum("th,ths->ts", ex["weights"].double() * ix.reference.fold(x.shape[1]), dots)
    live = torch.arange(ex["k"].shape[0], device=x.device)[None, :] < ix.n_compressed(ex["positions"])[:, None]
    return torch.where(live, out, float("-inf"))


def bucket(v):
    return next(f"< {b:g}" for b in (1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.5, 1.0, float("inf")) if v < b)


K_SEL = 16
results = {}
for fmt in ix.FMTS:
    ex_f = ix.example_inputs(T, H, N_KEYS, block_size=BC, seed=5, fmt=fmt)  # same q, k, positions; cache in `fmt`
    q, qs, wo = ix.quantize_q(ex_f["index_q"], ex_f["positions"], ex_f["cos_sin"], ex_f["weights"], fmt=fmt)
    kw = dict(block_table=ex_f["block_table"], block_size=BC)
    lg = ix.logits(q, qs, wo, ex_f["k_cache"], ex_f["positions"], **kw)
    lg_ref = ix.logits(q, qs, wo, ex_f["k_cache"], ex_f["positions"], backend="reference", **kw)
    exact = exact_logits(ex_f)
    f = torch.isfinite(exact)
    rel = float((lg_ref.double()[f] - exact[f]).norm() / exact[f].norm())
    hits = sum(len(set(ix.topk(lg_ref, K_SEL)[t].tolist()) & set(ix.topk(exact.float(), K_SEL)[t].tolist())) for t in range(T))
    results[fmt] = (ix.FP8_RECORD if fmt == "fp8" else ix.MXFP4_RECORD, rel, hits / (T * K_SEL))
    # kernel vs the float64 oracle, on the scale of Σ_h |w|·Σ_d |q·k| (fp32 summation error; MXFP4 adds the
    # bf16 roundings of DeepSeek's scores, docs/indexer.md#rounding-points)
    args = (q, qs, wo, ex_f["k_cache"], ex_f["positions"], ex_f["block_table"])
    cond = ix.reference.logits_condition(*args, block_size=BC, n_out=lg.shape[1])
    oracle = ix.reference.logits(*args, block_size=BC, n_out=lg.shape[1], dtype=torch.float64)
    if fmt == "fp8":
        verdict = compare(lg.double() / cond, oracle / cond, "fp32_dot", "kernel").verdict()
    else:
        verdict = compare(lg.double(), oracle, "indexer_logits_bf16", "kernel", cond).verdict()
    print(
        f"{fmt:6} {verdict}"
        f" | bytes/key {results[fmt][0]:3d} | rel. L2 error vs exact {bucket(rel):>7} | top-{K_SEL} overlap {hits}/{T * K_SEL}"
    )

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3))
names = list(results)
a1.bar(names, [results[n][0] for n in names], color=["tab:blue", "tab:orange"])
a1.set_ylabel("bytes per key")
a1.set_title("key cache record")
a2.bar(names, [results[n][2] for n in names], color=["tab:blue", "tab:orange"])
a2.set_ylim(0, 1)
a2.set_ylabel(f"overlap with exact top-{K_SEL}")
a2.set_title("selection quality (this example)")
plt.tight_layout()
plt.show()

# %% [markdown]
# FP8 keeps nearly all of the exact selection; MXFP4 halves the bytes per key at a visibly higher error —
# the reason vLLM defaults to FP8 and offers MXFP4 as an option. The DeepSeek reference itself *simulates*
# FP4 and scores in bf16, so "exact" is not the model's own behaviour either: what matters is set overlap.
#
# ### Hadamard: both sides or neither
#
# H₁₂₈·128^-½ is orthogonal, so (Hq)·(Hk) = q·k. If the key writer rotates and the query path does not (or the
# reverse), the scores become those of an unrelated pair of vectors and the selection falls apart —
# silently, since short contexts take the shortcut and never look at the scores.

# %%
ex0 = ix.example_inputs(T, H, N_KEYS, block_size=BC, seed=9)
exact0 = exact_logits(ex0)
for hq, hk in [(False, False), (True, True), (True, False)]:
    exh = ix.example_inputs(T, H, N_KEYS, block_size=BC, seed=9, hadamard=hk)
    q, _, wo = ix.quantize_q(exh["index_q"], exh["positions"], exh["cos_sin"], exh["weights"], hadamard=hq)
    lg = ix.logits(
        q, None, wo, exh["k_cache"], exh["positions"], block_table=exh["block_table"], block_size=BC, backend="reference"
    )
    hits = sum(len(set(ix.topk(lg, K_SEL)[t].tolist()) & set(ix.topk(exact0.float(), K_SEL)[t].tolist())) for t in range(T))
    print(f"hadamard on q={hq!s:5} k={hk!s:5}: top-{K_SEL} overlap with the exact ranking {hits}/{T * K_SEL}")

# %% [markdown]
# ## 6. The causal compressed mask, top-k and the shortcut
#
# Compressed row s summarises tokens 4s..4s+3, so it exists only once token 4s+3 has been seen:
# n_c(p) = (p+1)//4, **integer** division. A token at p = 2 sees nothing; p = 3 sees exactly row 0. Reading
# (p+1)/4 as a real number, or using ⌈(p+1)/4⌉, would leak a half-filled window.

# %%
P, S = 24, 7
vis = (torch.arange(S)[None, :] < ((torch.arange(P) + 1) // 4)[:, None]).float()
plt.figure(figsize=(7, 3.2))
plt.imshow(vis.t(), cmap="Greens", aspect="auto", origin="lower")
plt.xlabel("token position p")
plt.ylabel("compressed row s")
plt.title("visible: s < (p+1)//4")
plt.xticks(range(0, P, 2))
plt.show()

# %%
pos_m = torch.arange(0, 12, dtype=torch.int64, device=DEVICE)
exm = ix.example_inputs(12, 8, 16, block_size=16, seed=3, positions=pos_m)
q, _, wo = ix.quantize_q(exm["index_q"], pos_m, exm["cos_sin"], exm["weights"])
lg = ix.logits(q, None, wo, exm["k_cache"], pos_m, block_table=exm["block_table"], block_size=16, n_out=4)
full = ix.topk(lg, 4)  # full path: torch.topk, -inf -> -1
short = ix.topk(None, 4, positions=pos_m)  # shortcut: every n_c <= 4, logits never read
for p in (2, 3, 7, 11):
    print(f"p={p:2d}  n_c={(p + 1) // 4}  full path {sorted(full[p].tolist())}  shortcut {short[p].tolist()}")
print("shortcut == full path as sets:", torch.equal(full.sort(1).values, short.sort(1).values))

# %% [markdown]
# Finally the selected **local** ids (positions in the request's compressed sequence) become slots of the
# main compressed KV cache through the request's block table: `page = block_table[l // Bc]`, slot =
# page·Bc + l % Bc. Padding (−1) stays −1, and a padded/invalid token (its own slot −1) gets topk_len 0.

# %%
bt = torch.tensor([[7, 2, 5], [4, 0, 1]], dtype=torch.int32, device=DEVICE)
local = torch.tensor([[0, 17, 40, -1], [3, 35, -1, -1]], dtype=torch.int32, device=DEVICE)
glob, n = ix.to_global(local, bt, torch.tensor([12, -1], device=DEVICE), block_size=16)
print("global ids:", glob.cpu().tolist(), "| topk_len:", n.cpu().tolist())

# %% [markdown]
# ## 7. The input contract: the same answer or the same error on every backend
#
# A reference is the contract a port is held to, so every public function checks its arguments first (a
# `TypeError` or `ValueError` whose message starts with the argument's name, nothing written) and the kernels
# honour strided views (`docs/indexer.md`, "The input contract"). Three cases where an unchecked call used to
# give a plausible wrong answer:

# %%
from dsv4ref import validate

ex16 = ix.example_inputs(2, 4, 32, block_size=16, seed=2)
q16, _, w16 = ix.quantize_q(ex16["index_q"], ex16["positions"], ex16["cos_sin"], ex16["weights"])
try:  # a cache of 16-key pages read as 8-key pages: its "scales" would be key bytes
    ix.logits(q16, None, w16, ex16["k_cache"], ex16["positions"], block_size=8, block_table=ex16["block_table"])
except ValueError as e:
    print("ValueError:", e)
glob, n = ix.to_global(torch.tensor([[0, 1, -1]], dtype=torch.int32), torch.tensor([[2**25]]), block_size=64)
print("page 2^25 of 64-slot pages:", glob.tolist(), glob.dtype, "(int32 would wrap to -2^31)")
scores = torch.tensor([[1.0, float("nan"), 3.0, float("-inf")]])
try:
    ix.topk(scores, 2)
except ValueError as e:
    print("ValueError:", e)

# %% [markdown]
# **Non-finite input.** While value checks are on (the default) a NaN or ±∞ in the data raises. With
# `DSV4REF_CHECK_VALUES=0` (the hot path; `validate.checking_values(False)` in a `with` block) nothing is
# scanned, and every backend writes the same thing: a block holding a NaN or ±∞ reads back as NaN (FP8 codes
# 0x7F, or 0xFF where the sign bit is set, with a NaN scale; MXFP4 scale byte 255), a NaN score stays NaN, and
# top-k ranks a NaN like −∞:

# %%
k_bad = ex16["k"][:2].clone()
k_bad[0, 9] = float("nan")
try:
    ix.quantize_k(k_bad)
except ValueError as e:
    print("ValueError:", e)
with validate.checking_values(False):
    for backend in ("reference", "triton"):
        codes8, scale = ix.quantize_k(k_bad, backend=backend)
        print(
            f"{backend:9} key 0: codes {[hex(b) for b in codes8.view(torch.uint8)[0, :4].tolist()]}…, scale "
            f"{scale[0].item()} | key 1 scale {scale[1].item()}"
        )
    print("top-2 of", scores.tolist(), "->", sorted(ix.topk(scores, 2)[0].tolist()))

# %% [markdown]
# ## 8. A registered op: `torch.compile` traces straight through
#
# The fused query path is registered with `torch.library.custom_op` as `dsv4ref::indexer_q_fp8` and
# `dsv4ref::indexer_q_mxfp4`, each with a `register_fake` that only states output shapes and dtypes. Model
# code calls the op like any torch function; the compiler sees one opaque node instead of a Python kernel
# launch it cannot trace, so `fullgraph=True` holds. (The argument value checks are skipped while compiling,
# since reading a tensor's values would break the graph.) We use the `aot_eager` backend here: it runs
# dynamo and AOTAutograd, which is where the fake implementation is needed, without the C++ build that
# inductor does on a CPU (about 20 s on a 2-core machine; the result is the same).


# %%
def indexer_q(index_q, positions, cos_sin, weights):
    q, _, w_out = ix.quantize_q(index_q, positions, cos_sin, weights)
    return q.view(torch.uint8), w_out


explain = torch._dynamo.explain(indexer_q)(iq, pos, cs, w)
print("graphs:", explain.graph_count, "| graph breaks:", explain.graph_break_count)
print(
    "ops in the graph:",
    sorted(
        {str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function" and "dsv4ref" in str(n.target)}
    ),
)
compiled = torch.compile(indexer_q, fullgraph=True, backend="aot_eager")
got, want = compiled(iq, pos, cs, w), indexer_q(iq, pos, cs, w)
print("compiled == eager:", all(torch.equal(a, b) for a, b in zip(got, want)))

# %% [markdown]
# ## 9. Performance
#
# Each key is used by 64 heads × 128 dims × 2 FLOPs = 16 384 FLOPs: 124 FLOP per key byte for FP8, below
# the H200's ridge point for dense bf16 (≈ 200 FLOP/B), so FP8 logits are bound by the key bytes. MXFP4 halves
# the bytes (241 FLOP/B) and lands near the ridge, so part of its bound is the tensor cores; the harness
# takes the larger of the byte bound and the FLOP bound, using ceilings measured in the same run. For the benchmark case, T = 64 decode tokens (64 requests) each scoring
# n_c = 32 768 keys (a 128K context):

# %%
T_b, n_b = 64, 32768
for fmt, rec in (("fp8", ix.FP8_RECORD), ("mxfp4", ix.MXFP4_RECORD)):
    print(
        f"{fmt:6} keys {T_b * n_b * rec / 1e6:6.1f} MB, logits out {T_b * n_b * 4 / 1e6:4.1f} MB, "
        f"{2 * T_b * n_b * 64 * 128 / 1e9:5.1f} GFLOP"
    )

# %%
# NBVAL_IGNORE_OUTPUT
if not dsv4ref.interpreting():
    from dsv4ref.tools.harness import run_benches

    ceil, rows = run_benches("indexer")
    for r in rows:
        print(f"{r.case.op:22} {r.ms * 1e3:8.1f} us {r.bytes_per_s / 1e12:5.2f} TB/s  {r.fraction:6.1%} of bound")
else:
    print("interpreting on the CPU: no timings here (see benchmarks/indexer.md for the H200 figures)")

# %% [markdown]
# The latest one-run H200 bench, as `benchmarks/RESULTS.md` records it (date, device and the ceilings measured in
# the same run first):

# %%
from IPython.display import Markdown

from dsv4ref.tools.results import results_header, results_section

Markdown(results_header() + "\n\n" + results_section("indexer"))

# %% [markdown]
# Hopper has no FP4 MMA, so an MXFP4 kernel must decode nibbles to a type the tensor cores take. The
# `"nibble"` decode does it with ALU work and float conversions per value; `"f16_blocks"` builds fp16 operands
# per 32-block and runs eight dots per page, each followed by a scale product.
#
# **The default: `fp4_decode="f16_scaled"`.** Each key's (and query head's) block scales, taken relative to its
# largest one, ride inside the fp16 operands, so a page is **one** fp16 dot over all 128 dims with one wait,
# instead of eight dots each followed by a scale product; the largest scales are applied once, to the score. A
# program whose scale bytes fall outside the range where the fold is exact takes the `f16_blocks` arithmetic
# instead. The table above has all three decodes side by side.
# `benchmarks/indexer.md` has the decode's operation count, the sweep and the next suspects.
