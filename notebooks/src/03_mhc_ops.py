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
# order: `reference.py` (the whole op in PyTorch), `kernels.py` (Triton: the shared pieces and the first
# design), `kernels_split_k.py` (the second), `kernels_chunked.py` (the GPU's design), `kernels_one_pass.py` (a rung
# between them), `launch.py` (a launch class per design), `fn_split.py` (the kernels' copies of fn), `ops.py` (the launchers).

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
import json

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
ks = [1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30]  # each point reruns the schedule from pass 1
fig, ax = plt.subplots(figsize=(7, 3.5))
for std in (0.3, 1.0, 3.0):
    rows = [float((reference.sinkhorn(batch * std, k).sum(-1) - 1).abs().max()) for k in ks]
    ax.semilogy(ks, rows, marker=".", label=f"logit std {std}")
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
s3 = mhc.fn_split.split3(fn.cpu()).float()
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
same = mhc.default_launch("fused_post_pre").pre_like_fused()  # interpreter: one kernel; GPU: the chunked default
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
# Every measured figure of this section (µs, % of the bound, speed-ups, the copy rate) comes from one data file,
# `benchmarks/mhc_ladder.json`: H200 runs of each design, each entry with its date, device, the copy ceiling
# measured in the same run and the log it was copied from; the prose never types them. The narrative with every
# experiment is `benchmarks/mhc.md`. The bound of an op is its **compulsory bytes** (what it must read and write
# at least) over the copy rate. The next cell counts those bytes at T = 4096 tokens and V4-Flash's Hd = 4096,
# checks them against the count the benchmark divides by, and turns them into the bound at the copy rate of the
# ladder's run. `figures(design)` prints a design's time and fraction of the bound per op; `GOAL` is the
# project's target for pre and fused post+pre (half the bound), a target, not a measurement.

# %%
from dsv4ref.tools.cases.mhc import compulsory_bytes
from dsv4ref.tools.results import RESULTS

MHC_LADDER = RESULTS.with_name("mhc_ladder.json")
measured = json.loads(MHC_LADDER.read_text())
GOAL = 0.50
T8, Hd8, M8 = 4096, 4096, measured["M"]


def entry(design, op, T=T8, source=None):
    """The file's first entry for (design, op, T), from the run `source` if given (None if there is none)."""
    hits = [e for e in measured["entries"] if (e["design"], e["op"], e["T"]) == (design, op, T)]
    return next((e for e in hits if source in (None, e["source"])), None)


def verdict(op, pct):
    if op not in ("pre", "fused"):
        return ""
    return "goal met" if pct >= GOAL * 100 else f"misses the goal by {GOAL * 100 - pct:.1f} points"


def figures(design, versus=None):
    """Print `design`'s µs and % of the bound per op at T = 4096, and its speed-up over the design `versus`
    (timed in the same run when the file has that, else in the ladder's run)."""
    for op in ("pre", "fused", "head"):
        e = entry(design, op)
        gain = ""
        if versus:
            v = entry(versus, op, source=e["source"]) or entry(versus, op)
            gain = f"  {v['us'] / e['us']:4.2f}× {versus}" + ("" if v["source"] == e["source"] else " (another run)")
        print(
            f"  {design:<18} {op:<6} {e['us']:7.1f} µs {e['of_bound_pct']:5.1f} % of the bound{gain:<30} "
            f"{verdict(op, e['of_bound_pct'])}"
        )


stream = T8 * M8 * Hd8 * 2  # the four bf16 streams
row = T8 * Hd8 * 2  # x, or the layer input (bf16)
small = T8 * (M8 + M8 * M8) * 4  # post and comb (fp32)
fn_bytes = M8 * (M8 + 2) * M8 * Hd8 * 4  # fn [24, 4·Hd] fp32
counted = {
    "pre": ("streams + fn", stream + fn_bytes, "layer input + post/comb", row + small),
    "post": ("x + streams + post/comb", row + stream + small, "streams", stream),
    "fused": (
        "x + streams + post/comb + fn",
        row + stream + small + fn_bytes,
        "streams + layer input + post/comb",
        stream + row + small,
    ),
    "head": ("streams + head fn", stream + M8 * M8 * Hd8 * 4, "output", row),
}
bench_bytes = compulsory_bytes(T8, Hd8, M8)
ladder_run = entry("one_kernel", "pre")
copy_rate = ladder_run["copy_tb_s"] * 1e12
print(f"compulsory bytes at T = Hd = {T8}, M = {M8}; bound at the copy rate of the ladder's run ({ladder_run['date']}):")
print(f"  {'op':<6} {'reads':<30} {'MB':>6}   {'writes':<34} {'MB':>6}   {'total MB':>8}  {'bound µs':>8}")
for op, (r_what, r_b, w_what, w_b) in counted.items():
    print(
        f"  {op:<6} {r_what:<30} {r_b / 1e6:6.1f}   {w_what:<34} {w_b / 1e6:6.1f}   {(r_b + w_b) / 1e6:8.1f}  {(r_b + w_b) / copy_rate * 1e6:8.1f}"
    )
print(
    "  the same as the benchmark's count and the file's:",
    all(r + w == bench_bytes[op] == measured["bytes"][f"T={T8} Hd={Hd8}"][op] for op, (_, r, _, w) in counted.items()),
)
print(
    f"  post then pre, as two ops: {(bench_bytes['post'] + bench_bytes['pre']) / 1e6:.1f} MB against the fused op's {bench_bytes['fused'] / 1e6:.1f} MB"
)
fs_big = mhc.split_fn(mhc.example_params(Hd8)[0], M8)
one_kernel, split_k = (c.for_device(interpreted=False) for c in (mhc.OneKernelLaunch, mhc.SplitKLaunch))  # a GPU's tiles
print(
    f"fn as the kernels read it (bf16 × 3, padded to N = 32): {fs_big.nbytes / 1e6:.1f} MB, read from L2 once per token tile: "
    f"{T8 // one_kernel.block_t} tiles of {one_kernel.block_t} (one kernel) = {T8 // one_kernel.block_t * fs_big.nbytes / 1e9:.1f} GB, "
    f"{T8 // split_k.block_t} tiles of {split_k.block_t} (split-K) = {T8 // split_k.block_t * fs_big.nbytes / 1e9:.1f} GB"
)

# %% [markdown]
# **Post** is a pure stream: each token's new streams are a weighted sum of its old ones and x, with no
# reduction across the hidden dims. Its one kernel runs close to the copy rate, and it has no other design:

# %%
post_run = entry("post_kernel", "post")
print(f"  post   {post_run['us']:7.1f} µs {post_run['of_bound_pct']:5.1f} % of the bound  ({post_run['date']})")

# %% [markdown]
# **Pre, fused post + pre and head** are where the work is. Their first design, **one kernel**, gives each
# program a small tile of tokens and the whole K = 4·Hd = 16 384. The GEMM, not HBM, limits it: N = 24 outputs
# over K = 16 384 must be fp32-exact, so the kernel runs three bf16 MMAs (an exact split of `fn`) padded to N = 32,
# and every token tile streams the whole split `fn` from L2 (the cell above: gigabytes of L2 traffic for a
# fraction of that in HBM bytes). **Split-K** gives each program a slice of K for a bigger tile of tokens and lets
# a second small kernel finish the gates, Sinkhorn and the weighted sum: the `fn` traffic falls by the ratio of
# the tiles, but the streams are read twice. That pays for pre and head, not for the fused op, whose split-K
# form re-reads the new streams the post part has just written:

# %%
figures("one_kernel")
figures("split_k", "one_kernel")

# %% [markdown]
# **A third design, one pass** (`kernels_one_pass.hc_one_pass_kernel`, `mhc.OnePassLaunch`). A tile's streams
# (the next cell prints their size) do not fit on chip across the K loop, and the weighted sum needs the gates,
# which need the whole loop. So the second read must come from **L2**, and therefore soon after the first. One
# launch; work items are (token tile, hidden slice) pairs, taken from an atomic *ticket*:
#
# 1. a program computes its item's partial mix (GEMM + Σ X² of the slice) and counts itself in on the tile's
#    counter; the tile's **last** arrival sums the partials in slice order, runs the gates and Sinkhorn and
#    raises the tile's *ready* flag;
# 2. the same program then writes the layer input of the same slice of the **previous** tile, whose streams
#    were read one program lifetime ago, so they are still in L2.
#
# The ticket is what makes the wait in step 2 safe: every lower ticket belongs to a program that is already
# running (and the interpreter, which runs one program after another, never waits at all). Its GEMM is one
# wide dot (N = 128: hi | mid | lo | zeros) per stream chunk instead of three narrow ones. Its model put both pre
# and fused past the goal. Measured, it beat both designs above on every op and became the GPU's design until
# the chunked one below, but it still missed the goal: the tile's last arrival sums every slice's partial in a
# chain of dependent L2 round trips while the next tile's programs wait on its flag.

# %%
one_pass = mhc.OnePassLaunch.for_device(interpreted=False)  # a GPU's tiles
print(f"one tile's streams: {one_pass.block_t} tokens × {M8} × {Hd8} bf16 = {one_pass.block_t * M8 * Hd8 * 2 / 1e6:.1f} MB")
figures("one_pass", "split_k")

# %% [markdown]
# **A fourth design, chunked** (`kernels_chunked.hc_chunk_partial_kernel` + `hc_chunk_finish_kernel`,
# `mhc.ChunkedLaunch`): no program ever waits for another. Per chunk of C tokens, two launches: a
# *partial* kernel (exactly one pass's step 1, each (tile, slice) program writing its partial mix) and a
# *finish* kernel whose programs each re-sum their tile's partials in slice order (the same loads in the same
# order in every program, so the same bits), run the gates and Sinkhorn, and make the weighted sum of their
# own hidden range. C was meant to keep a chunk's streams in L2 for the finish's re-read. Measured
# (`benchmarks/mhc.md`), fewer, bigger chunks were faster at *every* size, so the L2 re-read was never what
# limited one pass; one chunk of all 4096 tokens, with the fused op run as `post` then this pre, is the fastest.
#
# What limited the partial kernel was where its copies come from: a warp's `cp.async` of the
# [128 tokens, 4 streams × 16 dims] tile gathered 16-byte pieces from 16 separate 128-byte lines. Reading one
# stream's 64 dims per dot (`stream_k`: 128-byte rows) and `fn` from a K-major copy (`fn_layout=2`)
# makes every copy whole lines:

# %%
figures("chunked", "one_pass")
figures("chunked_contiguous", "chunked")

# %% [markdown]
# **Then the walk order.** One chunk of 4096 tokens holds far more stream bytes than the H200's 50 MB L2 (the
# bytes table above), so the finish kernel re-read them from HBM. But a GPU starts a launch's programs roughly in
# grid order, so the bytes a kernel's *last* programs touched are still in L2 when the next kernel starts. With
# `zigzag`, each kernel of a chunk walks the tokens in the opposite direction to the kernel before it:
# pre runs the partial kernel forward and the finish kernel backward; fused runs `post` forward, the partial
# kernel backward and the finish kernel forward. Only the order moves, so the bits are the same (the cell after
# next checks it). Together with slices of 512 dims, it brought the finish kernel to the copy rate on its own
# bytes, and fused past the goal; pre stayed short of it, held back by its partial kernel.
#
# **The GPU default** also gives the partial kernel's dot a `fn` tile without its zero quarter
# (`fn_layout=3`: fn's three bf16 parts hi, mid and lo as dots of N = 64 and 32, where one dot of N = 128
# had a last quarter of zeros) and a fourth pipeline stage. Pre reads the streams twice (the partial kernel,
# then the finish kernel), so even two kernels at the copy rate would leave it short of the whole bound (the
# next cell computes that ceiling): it sits on the goal's line, within a run's noise of it. The next cell prints
# both rungs, pre's two kernels as a profiler measured them on their own bytes, and the default in each run the
# file holds.

# %%
figures("chunked_zigzag", "chunked_contiguous")
figures("default", "chunked_zigzag")
two_reads = (stream + row) / (2 * stream + row)
print(f"pre's ceiling with two reads of the streams, both kernels at the copy rate: {two_reads:.0%} of the bound")
print("pre's kernels, each on its own bytes (% of copy):")
for p in measured["profiles"]:
    k = ", ".join(
        f"{name.removeprefix('hc_chunk_').removesuffix('_kernel')} {v['of_copy_pct']:5.1f} %" for name, v in p["kernels"].items()
    )
    note = f"; {p['note']}" if "note" in p else ""
    print(f"  {p['design']:<18} {k}   ({p['date']}, copy {p['copy_tb_s']:.2f} TB/s{note})")
print("the default, every run in the file:")
for op in ("pre", "fused", "head"):
    runs = [e for e in measured["entries"] if (e["design"], e["op"], e["T"]) == ("default", op, T8)]
    print(f"  {op:<6}", "; ".join(f"{e['us']:.1f} µs = {e['of_bound_pct']:.1f} % (copy {e['copy_tb_s']:.2f} TB/s)" for e in runs))

# %% [markdown]
# **A decode step's call is small**, and for it a 128-token tile is mostly masked rows. So calls of at most
# `small_t` tokens take 64-token tiles at 4 warps. At the decode-sized T = 37 every op is far below its
# bound whatever the tiles (its bytes move in well under a microsecond at the copy rate); what is left is
# launches and latency, which the smaller tiles cut:

# %%
chunked = mhc.ChunkedLaunch.for_device(interpreted=False)  # a GPU's default
print(f"small_t on a GPU: {chunked.small_t} tokens; a 128-token tile at T = 37 is {1 - 37 / 128:.0%} masked rows")
for design in ("chunked_zigzag", "chunked_zigzag_small_t", "default"):
    line = []
    for op in ("pre", "fused", "head"):
        e = entry(design, op, T=37)
        bound = measured["bytes"][f"T=37 Hd={Hd8}"][op] / (e["copy_tb_s"] * 1e12) * 1e6
        line.append(f"{op} {e['us']:4.1f} µs ({bound / e['us']:.0%})")
    print(f"  T = 37, {design:<22}", ", ".join(line), f"  [{e['date']}]")

# %% [markdown]
# Which design an op takes is a **launch choice**, as are the tile sizes, warps, chunk and split counts. Each design
# has its own frozen dataclass, holding only its own knobs (and the post and Sinkhorn tiles all four share):
# `mhc.OneKernelLaunch`, `mhc.SplitKLaunch`, `mhc.OnePassLaunch`, `mhc.ChunkedLaunch`, passed explicitly as
# `launch=`; the launch's type picks the kernels. None means the op's measured default, `mhc.default_launch(op)`:
# chunked on a GPU; in the interpreter, which pays for every program, split-K for pre and head and one kernel for
# fused. A class's `for_device` says what a launch means on either device, so the GPU's defaults print here too.
# Every launch this notebook builds is legal on both (a test holds it to that: the chunked token tile is 16 here
# and 128 on a GPU, so a chunk of 16 tokens would not be). Forcing a design changes the speed, never the result.
# The ladder, rung by rung, at the teaching size:

# %%
for device, interpreted in (("GPU", False), ("interpreter", True)):
    d = {op: type(mhc.default_launch(op, interpreted=interpreted)).__name__ for op in ("pre", "fused_post_pre", "head")}
    print(f"default launch on the {device}:", d)
ladder = (
    ("one kernel", mhc.OneKernelLaunch()),
    ("split-K", mhc.SplitKLaunch(splits=2)),
    ("one pass", mhc.OnePassLaunch()),
    ("chunked, four streams per dot", mhc.ChunkedLaunch(stream_k=False, fn_layout=0, zigzag=False, block_k=16)),
    ("chunked, contiguous copies", mhc.ChunkedLaunch(stream_k=True, fn_layout=2, zigzag=False)),
    ("chunked, the GPU default", mhc.ChunkedLaunch(stream_k=True, fn_layout=3, zigzag=True)),
)
for name, launch in ladder:
    p_l, c_l, x_l = mhc.pre(res, fn, scale, base, launch=launch)
    print(
        compare(c_l, comb_w, "mhc", f"pre, {name}: comb").verdict(), "|", compare(x_l, x_ref, "bf16_out", "layer input").verdict()
    )
# the zigzag walk: 20 tokens in one chunk of 32 = 2 tiles of 16, the finish kernel walking them last to first
# (so it meets the partial tile first)
res20 = mhc.example_streams(20, Hd, seed=4)
forward = mhc.ChunkedLaunch(tokens=32, block_t=16, finish_block_t=16, zigzag=False)
zigzag = dataclasses.replace(forward, zigzag=True)
same = all(
    torch.equal(a, b)
    for a, b in zip(mhc.pre(res20, fn, scale, base, launch=forward), mhc.pre(res20, fn, scale, base, launch=zigzag))
)
print("chunked, zigzag walk: the same bits as the forward walk:", same)
print(inspect.getsource(mhc.SplitKLaunch.plan))
tiles, slices, cps, bk = one_pass.plan(4096, 4096)  # the one-pass tiles of a GPU
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
# The latest one-run H200 bench, as `benchmarks/RESULTS.md` records it (date, device and the ceilings measured in
# the same run first), the defaults beside the rung before them and `torch.compile` of the reference:

# %%
from IPython.display import Markdown

from dsv4ref.tools.results import results_header, results_section

Markdown(results_header() + "\n\n" + results_section("mhc"))


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
