# %% [markdown]
# # 03 · mHC: hyper-connections with a doubly-stochastic stream mix
#
# DeepSeek-V4 does not keep one residual stream per token but **M = 4** of them, and mixes them around every
# attention and FFN sub-layer. This notebook builds the four ops that do it — **pre** (with a 20-pass
# Sinkhorn projection), **post**, the **fused post + pre** and the final **head** — first as plain PyTorch,
# then as Triton kernels, and checks one against the other.
#
# The facts are collected in [`docs/mhc.md`](../docs/mhc.md); the bugs worth knowing are its pitfalls 22 (comb
# applied untransposed) and 23 (Sinkhorn and eps conventions). The code is in `dsv4ref/mhc/`, read in this
# order: `reference.py` (the whole op in PyTorch), `kernels.py` (Triton: the shared pieces and the first two
# designs), `kernels_chunked.py` (the GPU's design), `kernels_one_pass.py` (a rung between them), `launch.py`
# (launch choices).

# %%
import dsv4ref  # first: picks the device, sets TRITON_INTERPRET on a CPU-only machine
import warnings

warnings.filterwarnings("ignore")
import numpy as np

np.seterr(all="ignore")
import matplotlib.pyplot as plt

# %matplotlib inline
import dataclasses
import inspect

import torch

from dsv4ref import mhc
from dsv4ref.device import DEVICE, describe, interpreting
from dsv4ref.mhc import reference
from dsv4ref.testing import compare, generator, randn

# %%
# NBVAL_IGNORE_OUTPUT
print(describe())

# %% [markdown]
# ## 1. From one residual stream to four
#
# A plain pre-norm block updates one stream: $h_{l+1} = h_l + F(\mathrm{norm}(h_l))$. The identity path is
# what lets very deep stacks train.
#
# **Hyper-connections** (HC, arXiv 2409.19606) widen the residual into $n$ streams $H \in \mathbb{R}^{n\times d}$
# and learn how to read from them ($A_m$), how to write the layer output back ($B$) and how to mix the streams
# with each other ($A_r$):
#
# $$H' = A_r^\top H + B^\top F(H^\top A_m).$$
#
# **mHC** (arXiv 2512.24880) makes these weights input-dependent *and constrains the stream mix*: with
# $\tilde x = \mathrm{RMSNorm}(\mathrm{vec}(H))$,
#
# $$\text{pre} = \sigma(\alpha_{pre}\,\tilde x\varphi_{pre} + b_{pre}),\quad
#   \text{post} = 2\,\sigma(\alpha_{post}\,\tilde x\varphi_{post} + b_{post}),\quad
#   \text{comb} = \mathrm{Sinkhorn}(\alpha_{res}\,\mathrm{mat}(\tilde x\varphi_{res}) + b_{res}).$$
#
# In DeepSeek-V4 the 24 logits come from **one GEMM** of the flattened streams `[T, 4·Hd]` with
# `fn [24, 4·Hd]`; the RMS factor is a per-token scalar applied *after* the GEMM; `pre` gets `+1e-6`.
# The index convention matters: `comb[i, j]` is the weight from **source** stream *i* to **destination**
# stream *j*, so the new stream *j* is $\text{post}_j\,x + \sum_i \text{comb}_{ij}\,H_i$ — that is
# $\text{comb}^\top H$.

# %% [markdown]
# ## 2. Why a doubly-stochastic mix keeps deep stacks stable
#
# Over $L$ layers the identity path becomes the product of the $L$ stream mixes. With unconstrained learned
# matrices that product drifts: the mHC paper saw composite gains near 3000 at 27B parameters. A
# doubly-stochastic matrix (non-negative, rows and columns summing to 1) has spectral norm ≤ 1, and products
# of such matrices stay doubly stochastic, so the gain cannot run away.
#
# Below: 60 layers of random 4×4 mixes. "Unconstrained" are $I + 0.25\,N(0,1)$ (close to identity, as a
# trained HC matrix might be); "Sinkhorn" are the same logits pushed through mHC's projection. The gain is
# the largest amplification of any input direction, the spectral norm of the running product.

# %%
g = generator(0)
L = 60
noise = torch.randn(L, 4, 4, generator=g, dtype=torch.float64)
free = torch.eye(4, dtype=torch.float64) + 0.25 * noise
proj = reference.sinkhorn(noise)  # the same logits, projected (fp64 reference)


def gains(mats):
    prod, out = torch.eye(4, dtype=torch.float64), []
    for m in mats:
        prod = m.T @ prod  # the identity path of one more layer: comb^T applied to the streams
        out.append(float(torch.linalg.matrix_norm(prod, ord=2)))
    return out


g_free, g_proj = gains(free), gains(proj)
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.semilogy(range(1, L + 1), g_free, label="unconstrained  I + 0.25·N(0,1)")
ax.semilogy(range(1, L + 1), g_proj, label="Sinkhorn-projected (20 passes)")
ax.set_xlabel("layer")
ax.set_ylabel("spectral norm of the product")
ax.legend()
ax.grid(True, which="both", alpha=0.3)
plt.show()
print("unconstrained gain after 60 layers > 100:", g_free[-1] > 100)
print("Sinkhorn gain stays within [0.99, 1.01] at every layer:", all(0.99 <= v <= 1.01 for v in g_proj))

# %% [markdown]
# ## 3. The Sinkhorn projection, pass by pass
#
# DSV4's schedule ([`docs/mhc.md#sinkhorn`](../docs/mhc.md#sinkhorn)): **pass 1** is a row softmax plus eps, then a column normalisation;
# **passes 2…20** normalise rows, then columns (each divisor gets `+ eps`). The last step is a column step, so
# columns sum to 1 − O(1e-6) while rows only *converge* towards 1. Watch one matrix of logits (std 2):

# %%
logits = torch.randn(4, 4, generator=generator(3), dtype=torch.float64) * 2
passes = [1, 2, 3, 5, 10, 20]
fig, axes = plt.subplots(1, len(passes), figsize=(13, 2.6))
for ax, k in zip(axes, passes):
    c = reference.sinkhorn(logits, k)
    ax.imshow(c.numpy(), vmin=0, vmax=1, cmap="viridis")
    ax.set_title(f"{k} pass{'es' if k > 1 else ''}\nmax|row sum−1| {float((c.sum(1) - 1).abs().max()):.0e}", fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
plt.show()

# %% [markdown]
# Over 4096 random matrices (fp64), the worst row-sum error falls with the number of passes; the column sums
# sit at the eps floor from the first pass. The tests pin these bounds (`ROW_BOUND` in `tests/test_mhc.py`).

# %%
batch = torch.randn(4096, 4, 4, generator=generator(11), dtype=torch.float64)
ks = list(range(1, 31))
fig, ax = plt.subplots(figsize=(7, 3.5))
for std in (0.3, 1.0, 3.0):
    rows = [float((reference.sinkhorn(batch * std, k).sum(-1) - 1).abs().max()) for k in ks]
    ax.semilogy(ks, rows, label=f"logit std {std}")
ax.axvline(20, color="gray", ls="--", lw=1)
ax.set_xlabel("passes")
ax.set_ylabel("worst |row sum − 1|")
ax.legend()
ax.grid(True, which="both", alpha=0.3)
plt.show()
c20 = reference.sinkhorn(batch, 20)
print("all entries > 0:", bool((c20 > 0).all()))
print("column sums within 2e-6 of 1:", float((c20.sum(-2) - 1).abs().max()) <= 2e-6)
print("row sums within 2e-3 of 1 (std-1 logits, 20 passes):", float((c20.sum(-1) - 1).abs().max()) <= 2e-3)

# %% [markdown]
# The reference is the schedule written out, nothing more:

# %%
print(inspect.getsource(reference.sinkhorn))

# %% [markdown]
# The Triton version (`dsv4ref.mhc.kernels.sinkhorn_tile`) keeps a `[BLOCK, 4, 4]` tile in registers: `tl.max`/`tl.sum`
# over axis 2 are the row steps, over axis 1 the column steps. The same helper runs inside the pre kernel.

# %%
print(inspect.getsource(dsv4ref.mhc.kernels.sinkhorn_tile.fn))  # .fn: the Python function under @triton.jit
lg = (torch.randn(64, 4, 4, generator=generator(7)) * 3).to(DEVICE)
print(compare(mhc.sinkhorn(lg), reference.sinkhorn(lg.double()), "mhc", "sinkhorn kernel vs fp64").verdict())

# %% [markdown]
# ## 4. `pre`, walked through with shapes
#
# The teaching size: T = 5 tokens, Hd = 256, so the mix GEMM is `[5, 1024] @ [1024, 24]`. The whole op, as the
# library's reference writes it (`dtype=torch.float64` makes it the oracle the kernels are tested against):

# %%
print(inspect.getsource(reference.mix))
print(inspect.getsource(reference.pre))

# %%
T, Hd = 5, 256
res = mhc.example_streams(T, Hd, seed=1)  # [T, 4, Hd] bf16, 64-wide blocks spanning 2^-4..2^4
fn, scale, base = mhc.example_params(Hd, seed=2)
mix = reference.mix(res, fn, dtype=torch.float64)
print(
    "residual", tuple(res.shape), res.dtype, "| fn", tuple(fn.shape), "| scale", tuple(scale.shape), "| base", tuple(base.shape)
)
print("X (flattened streams)", (T, 4 * Hd), "-> mix", tuple(mix.shape), "= [pre 0:4 | post 4:8 | comb 8:24]")
pre_w = torch.sigmoid(mix[:, :4] * scale[0].double() + base[:4].double()) + 1e-6  # the input weights (kept inside pre)
post_w, comb_w, x_ref = reference.pre(res, fn, scale, base, dtype=torch.float64)
print("pre", tuple(pre_w.shape), "in (1e-6, 1+1e-6):", bool(((pre_w > 1e-6) & (pre_w < 1 + 1e-6)).all()))
print("post", tuple(post_w.shape), "in (0, 2):", bool(((post_w > 0) & (post_w < 2)).all()))
print("comb", tuple(comb_w.shape), "columns sum to 1:", float((comb_w.sum(1) - 1).abs().max()) < 2e-6)
print("layer input x = Σ_i pre_i·stream_i", tuple(x_ref.shape))

# %% [markdown]
# ### The kernel
#
# `kernels.hc_kernel` gives each program `BLOCK_T = 16` tokens (the smallest M side of a tensor-core dot):
#
# 1. **Pass 1** walks the hidden dim in chunks of `BLOCK_K`, loading all four streams of the chunk, adding
#    $\sum X^2$ and the GEMM contributions `X_i @ fnᵀ[i·Hd + h]` for each stream.
# 2. The RMS factor `rsqrt(ΣX²/(4·Hd) + eps)` multiplies the 24 accumulated logits — *after* the GEMM.
# 3. Gates and the 20 Sinkhorn passes run in registers on `[16, 4]` and `[16, 4, 4]` tiles.
# 4. **Pass 2** re-reads the chunks, last first (the most recently read are likeliest to still be in L2),
#    and writes `x = Σ_i pre_i·stream_i` as bf16 (integer round-to-nearest-even, `bf16_rne_bits`).
#
# **Precision.** The reference GEMM is fp32; tf32 (10 mantissa bits) errs by ~1e-2 on these logits. The
# streams are bf16 already, so only `fn` must be carried exactly: it is split as `fn = hi + mid + lo`, three
# bf16 numbers with 8 significand bits each, and `X @ fnᵀ = X @ hiᵀ + X @ midᵀ + X @ loᵀ`. Every bf16×bf16
# product is exact in fp32, so three tensor-core dots reproduce the fp32 GEMM.

# %%
s3 = mhc.launch.split3(fn.cpu()).float()
print("hi + mid + lo == fn, bit for bit:", torch.equal(s3[0] + s3[1] + s3[2], fn.cpu()))
tf32 = (fn.cpu().view(torch.int32) & ~0x1FFF).view(torch.float32)  # keep 10 mantissa bits, as tf32 does
post_tf32, comb_tf32, _ = reference.pre(res.cpu(), tf32, scale.cpu(), base.cpu(), dtype=torch.float64)
print("fn rounded to tf32 meets the 1e-5 tolerance on comb:", compare(comb_tf32, comb_w.cpu(), "mhc").passed)

# %% [markdown]
# One more trap, found on the H200: a tensor-core MMA adds into its accumulator with truncation, aligned to the
# largest addend. Feeding it the running sum of all 16 384 columns (V4-Flash) lost up to an ulp of the *whole*
# sum per MMA, and post/comb drifted by 2.6e-5. Each chunk now starts its MMAs from zero and adds the chunk sum
# to the running total with an ordinary fp32 add. (The interpreter computes dots exactly in fp32 and cannot
# show this; `benchmarks/mhc.md` has the numbers.)

# %%
post_k, comb_k, x_k = mhc.pre(res, fn, scale, base)
print(compare(post_k, post_w, "mhc", "pre: post").verdict())
print(compare(comb_k, comb_w, "mhc", "pre: comb").verdict())
print(compare(x_k, x_ref, "bf16_out", "pre: layer input").verdict())

# %% [markdown]
# ## 5. `post`, and the transposed-comb bug
#
# The sub-layer output `x [T, Hd]` is written back into every stream with weight `post_j`, and the streams are
# mixed through **combᵀ**: new stream *j* = `post_j·x + Σ_i comb[i, j]·stream_i`. Each program handles a
# `[4 tokens × 256 dims]` tile of all four streams.

# %%
x_layer = randn((T, Hd), seed=3, octaves=8)
new_k = mhc.post(x_layer, res, post_k, comb_k)
new_ref = reference.post(x_layer, res, post_k, comb_k, dtype=torch.float64)
print("x", tuple(x_layer.shape), "+ residual", tuple(res.shape), "-> new residual", tuple(new_k.shape), new_k.dtype)
print(compare(new_k, new_ref, "bf16_out", "post").verdict())

# %% [markdown]
# **The bug** ([pitfall 22](../docs/mhc.md#pitfalls)): computing `Σ_j comb[i, j]·stream_j` (comb, not combᵀ). With a symmetric comb
# nothing changes, which is how it survives tests. Make comb a 4-cycle — logits `30·P` with
# `P[0,1] = P[1,2] = P[2,3] = P[3,0] = 1` — and follow where each stream goes:

# %%
P = torch.roll(torch.eye(4), 1, dims=1)
fn0 = torch.zeros_like(fn)
base_p = torch.cat([torch.zeros(8), 30 * P.reshape(16)]).to(DEVICE)
post_p, comb_p, _ = mhc.pre(res, fn0, torch.ones(3, device=DEVICE), base_p)
zero_x = torch.zeros_like(x_layer)
right = mhc.post(zero_x, res, post_p, comb_p).double()
wrong = torch.einsum("tij,tjh->tih", comb_p.double(), res.double())  # the bug: comb @ streams


def source_of(new):
    """For each destination stream, the source stream it copies (best match over tokens and dims)."""
    d = (new[:, :, None, :] - res.double()[:, None, :, :]).abs().sum(dim=(0, 3))  # [dest, source]
    return d.argmin(dim=1).tolist()


print("comb ≈ P:", float((comb_p.cpu().double() - P.double()).abs().max()) < 1e-5)
print("correct (combᵀ): destination j takes source", source_of(right), " (new_1 = res_0, new_2 = res_1, ...)")
print("bug (comb):      destination j takes source", source_of(wrong), " (the reverse cycle)")

# %% [markdown]
# Its measured effect on ordinary (random) combs: the buggy output differs from the right one by far more than
# the bf16 tolerance — a stream mix that silently routes the wrong streams.

# %%
buggy = post_k.double()[:, :, None] * x_layer.double()[:, None, :] + torch.einsum("tij,tjh->tih", comb_k.double(), res.double())
rel = float((buggy - new_ref).norm() / new_ref.norm())
print("relative error of the untransposed post:", "> 10%" if rel > 0.1 else "> 1%" if rel > 0.01 else "< 1%")
print(compare(buggy, new_ref, "bf16_out", "untransposed post vs oracle").verdict())

# %% [markdown]
# ## 6. Fused post + pre
#
# Between two sub-layers the model runs post (with the previous sub-layer's post/comb) and immediately pre
# (with the next sub-layer's fn/scale/base). Fusing them saves one full read of the new streams.
#
# The catch: pre's GEMM needs the **whole new residual row** (all 4·Hd values) before any gate is known, and the
# layer input needs the gates. Two designs:
#
# * **split-K + a second kernel**: many programs each own a slice of the 4·Hd columns, write partial logits,
#   and a second kernel finishes the gates and the weighted sum (re-reading the new streams from HBM);
# * **one program per token block, two passes** (the interpreter's default): pass 1 computes the new streams chunk by chunk,
#   stores them and feeds the *stored bf16 values* to the GEMM; pass 2 reads them back (recently written, so
#   often still in L2) for the weighted sum. One launch, no workspace, and — because pass 1 uses exactly the
#   bf16 values a separate pre would read, with the same explicit FMA order — its bf16 outputs equal
#   post-then-pre (a pre of the same design) **bit for bit** (the fp32 post/comb to 1e-6, as [`docs/mhc.md`](../docs/mhc.md#fused-post-pre) asks).
#
# The cost of that design is that every program reads all of `fn` (it is re-read from L2 once per 16
# tokens); on the H200 that, not HBM, limits it (section 8, which also shows the GPU's design: there the fused
# op *is* post then pre, chunk by chunk). Whatever the design, `launch.pre_like_fused()` is the launch under
# which a separate pre runs the fused op's arithmetic:

# %%
fn2, scale2, base2 = mhc.example_params(Hd, seed=5)  # the next sub-layer's parameters
fused = mhc.fused_post_pre(x_layer, res, post_k, comb_k, fn2, scale2, base2)
sep_new = mhc.post(x_layer, res, post_k, comb_k)
same = mhc.MhcLaunch().pre_like_fused()  # interpreter: the one-kernel design; GPU: the chunked default itself
sep = (sep_new, *mhc.pre(sep_new, fn2, scale2, base2, launch=same))
for name, a, b in zip(["new residual", "post'", "comb'", "layer input"], fused, sep):
    if a.dtype == torch.bfloat16:
        print(f"fused {name:<12} {tuple(a.shape)!s:<16} bit-identical to post then pre:", compare(a, b, "exact").passed)
    else:  # fp32 outputs: docs/mhc.md asks for 1e-6 (the GEMM is the same code, so they are usually identical)
        print(f"fused {name:<12} {tuple(a.shape)!s:<16} within 1e-6 of post then pre:", compare(a, b, "fp32_reduction").passed)

# %% [markdown]
# ## 7. The head
#
# After the last layer, `head` folds the four streams into one hidden vector: the same RMS-scaled GEMM with
# `hc_head_fn [4, 4·Hd]`, `gate = σ(mix·scale + base) + 1e-6`, and `out = Σ_m gate_m·stream_m`. No Sinkhorn,
# no post. It is the pre kernel with `HEAD=True`, and its reference is five lines:

# %%
hfn, hscale, hbase = mhc.example_params(Hd, seed=6, head=True)
print(inspect.getsource(reference.head))
h_ref = reference.head(res, hfn, hscale, hbase, dtype=torch.float64)
h_k = mhc.head(res, hfn, hscale, hbase)
print("hidden", tuple(res.shape), "-> head", tuple(h_k.shape), h_k.dtype)
print(compare(h_k, h_ref, "bf16_out", "head").verdict())

# %% [markdown]
# ## 8. The performance story
#
# At T = 4096 tokens and V4-Flash's Hd = 4096 the compulsory traffic is:
#
# | op | reads | writes | total |
# |---|---|---|---|
# | pre | streams 134 MB + fn 1.6 MB | layer input 33.5 MB (+ post/comb 0.3 MB) | ≈ 170 MB |
# | post | x 33.5 MB + streams 134 MB | streams 134 MB | ≈ 302 MB |
# | fused | x + streams 168 MB | streams + layer input 168 MB | ≈ 336 MB (vs 470 MB for post then pre) |
#
# At the H200's measured copy rate (4.11 TB/s) these take ~41, ~74 and ~82 µs. The final H200 run
# (2026-11-30, `benchmarks/RESULTS.md`) measured:
#
# | op | path | time | of bound |
# |---|---|---|---|
# | post | one kernel | 80.2 µs | **91.8 %** |
# | pre | one kernel, 32 tokens per program | 336.5 µs | 12.3 % |
# | pre | **split-K (the default)** | 248.2 µs | 16.6 % |
# | fused post+pre | **one kernel (the default)** | 485.1 µs | 17.0 % |
# | fused post+pre | split-K | 777.2 µs | 10.6 % |
# | head | **split-K (the default)** | 218.0 µs | 18.8 % |
#
# Post meets the target (≥ 60 %); pre and fused **miss it by far**. The reason is the GEMM, not HBM: N = 24
# outputs over K = 16 384 must be fp32-exact, so it runs as three bf16 MMAs (an exact split of `fn`) padded
# to N = 32, and every token tile streams the whole 3.1 MB bf16×3 `fn` from L2. Split-K (each program owns a
# slice of K for 64 tokens, a second small kernel finishes the gates, Sinkhorn and the weighted sum) cuts
# that L2 traffic 4× and buys 1.35×, but reads the streams twice.
#
# **A third design, one pass** (`kernels_one_pass.hc_one_pass_kernel`, `MhcLaunch(one_pass=True)`). A tile's streams
# (128 tokens × 4 × 4096 bf16 = 4 MB) do not fit on chip across the K loop, and the weighted sum needs the
# gates, which need the whole loop. So the second read must come from **L2**, and therefore soon after the
# first. One launch; work items are (128-token tile, 128-dim hidden slice) pairs, taken from an atomic
# *ticket*:
#
# 1. a program computes its item's partial mix (GEMM + Σ X² of the slice) and counts itself in on the tile's
#    counter; the tile's **last** arrival sums the partials in slice order, runs the gates and Sinkhorn and
#    raises the tile's *ready* flag;
# 2. the same program then writes the layer input of the same slice of the **previous** tile, whose streams
#    were read one program lifetime ago (~20 MB of traffic back, inside the 50 MB L2).
#
# The ticket is what makes the wait in step 2 safe: every lower ticket belongs to a program that is already
# running (and the interpreter, which runs one program after another, never waits at all). Its GEMM is one
# wide dot (N = 128: hi | mid | lo | zeros) per stream chunk instead of three narrow ones. Its model expected
# 50–64 % for pre and 70–85 % for fused on the H200. **Measured** on an H200 (2026-11-30, one run beside the
# ceilings, `benchmarks/RESULTS.md`): pre 152.6 µs (**27.5 %**), fused 280.8 µs (**29.8 %**), head 119.2 µs
# (34.9 %) — 1.6×, 2.2× and 1.8× the designs above, so one pass replaced them on a GPU, until the chunked
# design below. The goal (≥ 50 %) was still missed by 20–23 points: the tile's last arrival sums 32 slices'
# partials in a chain of dependent L2 round trips while the next tile's programs wait on its flag.
#
# **A fourth design, chunked** (`kernels_chunked.hc_chunk_partial_kernel` + `hc_chunk_finish_kernel`,
# `MhcLaunch(chunked=True)`): no program ever waits for another. Per chunk of C tokens, two launches: a
# *partial* kernel (exactly one pass's step 1, each (tile, slice) program writing its partial mix) and a
# *finish* kernel whose programs each re-sum their tile's partials in slice order (the same loads in the same
# order in every program, so the same bits), run the gates and Sinkhorn, and make the weighted sum of their
# own hidden range. C was meant to keep a chunk's streams in L2 for the finish's re-read. **Measured** on an
# H200 (2026-12-01, `benchmarks/mhc.md`): fewer, bigger chunks were faster at *every* size, so the L2 re-read
# was never what limited one pass; one chunk of 4096 tokens, with the fused op run as `post` then this pre,
# is the fastest. What limited the partial kernel was where its copies come from: a warp's `cp.async` of the
# [128 tokens, 4 streams × 16 dims] tile gathered 16-byte pieces from 16 separate 128-byte lines. Reading one
# stream's 64 dims per dot (`chunk_stream_k`: 128-byte rows) and `fn` from a K-major copy (`chunk_fn_layout=2`)
# took pre from 124 to **94.6 µs (43.6 %)** and fused from 201 to **170.5 µs (48.1 %)**, against one pass's
# 145.9 / 274.5 µs in the same run.
#
# **Then the walk order.** One chunk of 4096 tokens is 134 MB of streams, past the H200's 50 MB L2,
# so the finish kernel re-read them from HBM. But a GPU starts a launch's programs roughly in grid order, so
# the bytes a kernel's *last* programs touched are still in L2 when the next kernel starts. With
# `chunk_zigzag`, each kernel of a chunk walks the tokens in the opposite direction to the kernel before it:
# pre runs the partial kernel forward and the finish kernel backward; fused runs `post` forward, the partial
# kernel backward and the finish kernel forward. Only the order moves, so the bits are the same (the cell below
# checks it). Together with slices of 512 dims, a per-kernel profile put the finish kernel at 100 % of copy on
# its own bytes (89 % before). On an H200 (2026-12-01), pre went to **87.1 µs (47.2 %)** and fused to
# **157.9 µs (51.8 %)**. That is **the default on a GPU**; in the interpreter the measured per-op designs
# stay, for the lessons' CPU time.
# Fused meets the ≥ 50 % goal; pre missed it by 2.8 points, its partial kernel at ~74 % of copy
# (`benchmarks/mhc.md` has the eight sweeps and what each ruled out). The GPU default now also gives the
# partial kernel's dot a fn tile without its zero quarter (`chunk_fn_layout=3`: fn's three bf16 parts hi, mid
# and lo as dots of N = 64 and 32, where one dot of N = 128 had a last quarter of zeros) and a fourth pipeline
# stage: on an H200 (2026-12-01) the partial kernel went to ~80 % of copy, pre to
# **83.7–84.0 µs (49.5–49.7 %)** and fused to 155.9–156.3 µs (53 %) in two calls. Pre still misses 50 % by
# about half a point: it reads the streams twice (the partial kernel, then the finish kernel), so even two
# kernels at 100 % of copy would give it 56 % of the compulsory bytes' bound. A decode step's call is small, and for
# it a 128-token tile is mostly masked rows. So calls of at most `chunk_small_t` = 64 tokens take 64-token
# tiles at 4 warps: at T = 37, pre went from 15.7 to 13.0 µs.
#
# Which design an op takes is a **launch choice**, as are the tile sizes, warps, chunk and split counts. They are
# the fields of one frozen dataclass, `mhc.MhcLaunch`, passed explicitly as `launch=` (None = the measured
# defaults: chunked on a GPU; in the interpreter, which pays for every program, split-K for pre and head and one
# kernel for fused). `MhcLaunch.for_device` says what a launch means on either device, so the defaults below
# print the same here and on a GPU. Every launch this notebook builds is legal on both (a test holds it to that:
# the chunked token tile is 16 here and 128 on a GPU, so a chunk of 16 tokens would not be). Forcing a design
# changes the speed, never the result. The ladder, rung by rung, at the teaching size:

# %%
for device, interpreted in (("GPU", False), ("interpreter", True)):
    d = mhc.MhcLaunch.for_device(interpreted=interpreted)
    print(f"default design on the {device}: pre / head {d.design(fused=False)}, fused post+pre {d.design(fused=True)}")
ladder = (
    ("one kernel", mhc.MhcLaunch(split_k=False)),
    ("split-K", mhc.MhcLaunch(split_k=True, splits=2)),
    ("one pass", mhc.MhcLaunch(one_pass=True)),
    ("chunked, four streams per dot", mhc.MhcLaunch(chunked=True, chunk_stream_k=False, chunk_fn_layout=0, chunk_zigzag=False)),
    ("chunked, contiguous copies", mhc.MhcLaunch(chunked=True, chunk_stream_k=True, chunk_fn_layout=2, chunk_zigzag=False)),
    ("chunked, the GPU default", mhc.MhcLaunch(chunked=True, chunk_stream_k=True, chunk_fn_layout=3, chunk_zigzag=True)),
)
for name, launch in ladder:
    p_l, c_l, x_l = mhc.pre(res, fn, scale, base, launch=launch)
    print(
        compare(c_l, comb_w, "mhc", f"pre, {name}: comb").verdict(), "|", compare(x_l, x_ref, "bf16_out", "layer input").verdict()
    )
# the zigzag walk: 40 tokens in one chunk of 48 = 3 tiles of 16, the finish kernel walking them last to first
res40 = mhc.example_streams(40, Hd, seed=4)
forward = mhc.MhcLaunch(chunked=True, chunk_tokens=48, chunk_block_t=16, chunk_finish_block_t=16, chunk_zigzag=False)
zigzag = dataclasses.replace(forward, chunk_zigzag=True)
same = all(
    torch.equal(a, b)
    for a, b in zip(mhc.pre(res40, fn, scale, base, launch=forward), mhc.pre(res40, fn, scale, base, launch=zigzag))
)
print("chunked, zigzag walk: the same bits as the forward walk:", same)
print(inspect.getsource(mhc.launch.MhcLaunch.split_plan))
h200 = mhc.MhcLaunch.for_device(interpreted=False, one_pass=True)  # the one-pass tiles of a GPU
tiles, slices, cps, bk = h200.one_pass_plan(4096, 4096)
print(
    f"one pass at T = Hd = 4096 on a GPU: {tiles} tiles × {slices} slices of {cps} × {bk} dims, "
    f"{(tiles + mhc.launch.ONE_PASS_LAG) * slices} programs"
)

# %% [markdown]
# The cell below re-measures on a GPU; it does not run in the interpreter.

# %%
# NBVAL_IGNORE_OUTPUT
if not interpreting():
    from dsv4ref.tools.harness import run_benches

    ceil, rows = run_benches("mhc")
    print(f"copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s")
    for r in rows:
        print(f"{r.case.op:<26} {r.case.shape:<28} {r.ms * 1e3:8.1f} us  {r.fraction:6.1%} of bound")
else:
    print("interpreter: no timings (they would measure numpy)")


# %% [markdown]
# ## 9. The input contract
#
# Every public function checks its arguments before any work and gives, on every backend, the float64
# oracle's answer or the same error naming the argument ([`docs/mhc.md#the-input-contract`](../docs/mhc.md#the-input-contract)).
# Any layout is read as the view it is — here `scale` and `base` as every-other-element views of bigger
# buffers, which the Triton launcher once passed through as if contiguous:

# %%
big_s, big_b = torch.zeros(6, device=DEVICE), torch.zeros(48, device=DEVICE)
big_s[::2], big_b[::2] = scale, base
p_v, c_v, x_v = mhc.pre(res, fn, big_s[::2], big_b[::2])
print("strided scale/base == contiguous, bit for bit:", torch.equal(c_v, comb_k) and torch.equal(x_v, x_k))
for bad in (dict(sinkhorn_iters=0), dict(hc_eps=float("nan"))):
    try:
        mhc.pre(res, fn, scale, base, **bad)
    except ValueError as e:
        print("ValueError:", e)

# %% [markdown]
# mHC gives no meaning to a NaN or an infinity, so with value checks on (the default) one raises. With them
# off (`DSV4REF_CHECK_VALUES=0`, the hot path: no device sync), IEEE arithmetic decides, the same on every
# backend: a NaN in one token's streams makes exactly that token's outputs NaN.

# %%
from dsv4ref import validate

bad_res = res.clone()
bad_res[2, 1, 7] = float("nan")
try:
    mhc.pre(bad_res, fn, scale, base)
except ValueError as e:
    print("checks on: ValueError:", str(e)[:60], "...")
with validate.checking_values(False):
    for backend in ("reference", "triton"):
        p_n, c_n, x_n = mhc.pre(bad_res, fn, scale, base, backend=backend)
        print(
            f"checks off, {backend:<9}: NaN rows of post / comb / layer input:",
            p_n.isnan().all(dim=1).nonzero().flatten().tolist(),
            c_n.isnan().flatten(1).all(dim=1).nonzero().flatten().tolist(),
            x_n.float().isnan().all(dim=1).nonzero().flatten().tolist(),
        )
