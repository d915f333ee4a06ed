# %% [markdown]
# # 06 · One whole decode step: every op, composed, checked against float64
#
# Notebooks 01–05 built the pieces one at a time: the FP8 cache format, RoPE and the fused KV insert,
# mHC, sparse MLA decode with its sink, and the lightning indexer. Here they compose into a decoder
# **layer stack** of the teaching config (4 layers with compress ratios 0, 4, 128, 4) that decodes token
# after token through the real data path, with paged caches behind shuffled block tables, and we check
# it against an **independent float64 dense reference** of the same block.
#
# What this notebook shows:
#
# 1. the step as a pipeline, with shapes, and the compressor that feeds the compressed pools;
# 2. prefill + a few dozen decode steps for a batch of 4 requests of different lengths;
# 3. agreement with the float64 reference per step, and why the tolerance is what it is (the FP8 budget);
# 4. that the check has teeth: the classic bugs, injected, fail it;
# 5. where the bytes go at Flash size for 4k, 128k and 1M tokens of context (the indexer takes over);
# 6. how to point the conformance suite, and its golden vectors, at **your** kernel.
#
# The walk-through with every fact this notebook uses is `docs/decode.md`; the suite of section 6 is
# `docs/conformance.md`. Code: `dsv4ref/decode/` (`model.py` the decode path, `state.py` its caches, `reference.py`
# the float64 dense reference, `compare.py` the agreement, `driver.py` `run`), `dsv4ref/compressor/` (the
# compressor op) and `dsv4ref/conformance/` (one module of cases per op).

# %%
import dsv4ref  # first: picks the device, sets TRITON_INTERPRET on a CPU-only machine
import warnings

warnings.filterwarnings("ignore")
import numpy as np

np.seterr(all="ignore")
import matplotlib.pyplot as plt
import torch

# %matplotlib inline
import inspect

from dsv4ref import compressor, conformance, decode
from dsv4ref.config import FLASH, TINY
from dsv4ref.device import DEVICE, describe

# %%
# NBVAL_IGNORE_OUTPUT
print(describe())

# %% [markdown]
# ## 1. The step as a pipeline
#
# One token per request enters as an id and leaves as 512 logits. Inside, every layer runs the same
# attention prologue, then a ratio-dependent middle (compressor, indexer), then sparse attention over
# the **window ∪ compressed** candidates with the sink, and mHC around attention and around the MoE
# feed-forward (notebook 07: 8 experts, top-2, layer 0 hash-routed). Shapes below are for T = 4 tokens of the teaching config (H = 16 heads, Hd = 256, M = 4 streams,
# W = 16, K_top = 16); the 512-dim latent head keeps the real byte format.

# %%
stages = [
    ("embed", "ids (T) -> h (T, 256) bf16;  Hs = h x M  (T, 4, 256)"),
    ("mHC pre", "Hs -> x (T, 256), post (T, 4), comb (T, 4, 4)"),
    ("RMSNorm + [W_qa; W_kv]", "x -> qr (T, 128), kv (T, 512);  q_norm, kv_norm"),
    ("wq_b", "qr -> q (T, 16, 512) bf16"),
    ("q-norm + RoPE + KV insert", "q in place; kv -> window cache (584 B/token, pages of 16)"),
    ("compressor (r = 4, 128)", "at (p+1) % r == 0: row p//r -> compressed cache (+ indexer K, r = 4)"),
    ("indexer (r = 4)", "q_idx (T, 8, 128) fp8, logits (T, n_c) -> top-16 local ids"),
    ("sparse MLA decode", "q (T, 64, 512) padded; window (T, 16) + comp (T, <=16) slots -> o (T, 64, 512)"),
    ("inverse RoPE", "o[:, :16, 448:512] rotated by -p"),
    ("grouped o-proj", "(T, 2, 4096) -> wo_a -> (T, 256) -> wo_b -> (T, 256)"),
    ("mHC post + pre (ffn)", "Hs' = post*a + comb^T Hs;  next x"),
    ("MoE (8 experts, top-2)", "route -> FP8 stage -> 2 clamped-SwiGLU experts + shared -> (T, 256)"),
    ("... x 4 layers, then", "mHC post; hc_head -> (T, 256); RMSNorm; lm_head -> logits (T, 512)"),
]
fig, ax = plt.subplots(figsize=(11, 6.2))
ax.set_xlim(0, 11)
ax.set_ylim(-0.5, len(stages) - 0.3)
ax.axis("off")
colors = {"compressor (r = 4, 128)": "#fde0c5", "indexer (r = 4)": "#fde0c5", "sparse MLA decode": "#cfe3f7"}
for i, (name, shape) in enumerate(stages):
    y = len(stages) - 1 - i
    ax.add_patch(plt.Rectangle((0.1, y - 0.35), 3.2, 0.7, color=colors.get(name, "#e8e8e8")))
    ax.text(1.7, y, name, ha="center", va="center", fontsize=9, weight="bold")
    ax.text(3.5, y, shape, va="center", fontsize=8.5, family="monospace")
    if i + 1 < len(stages):
        ax.annotate("", xy=(1.7, y - 0.37), xytext=(1.7, y - 0.63), arrowprops=dict(arrowstyle="<-", lw=0.8))
ax.set_title("one decode step of the teaching config (per layer: rows 2-12)", fontsize=10)
plt.show()

# %% [markdown]
# The whole attention block is short enough to read in one screen. Each line is a library call with a
# `backend` switch (`"reference"` = the plain-torch op, `"triton"` = the kernel):

# %%
print(inspect.getsource(decode.Decoder.attention))

# %% [markdown]
# Two details matter for correctness, and both are about **order**: the KV row of the current token is
# written (step 4) before attention reads the window, and a compressed row completed by this token
# ((p+1) % r == 0) is written (step 5) before the indexer and attention look for it. Both are
# visible to this very token (pitfall #26: a compressed id is visible once its whole window is in).
#
# ### The compressor
#
# The compressed pools are filled by the compressor (the op `dsv4ref.compressor`, here its torch reference): a
# ring of the last coff·r tokens' (kv, score) per request; at a boundary token ((p+1) % r == 0) a
# **per-channel** softmax over the window's tokens, with overlap on ratio 4 (the older 4 tokens give
# channels 0..511, the newer 4 give 512..1023), then RMSNorm; the decoder then rounds the row to bf16,
# rotates it at (p//r)·r and writes it with the 584-B writer. Feeding a 300-token sequence in any split
# (here a 5-token prefill, then single tokens) gives the same rows as the float64 reference, which computes
# the whole sequence at once in blocks of r tokens:

# %%
w0 = decode.make_weights(TINY, 0)  # drawn on the CPU, moved to the library's device (DEVICE)
x = torch.randn(300, TINY.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(DEVICE)
for r, layer in ((4, 1), (128, 2)):
    cw = w0["layers"][layer]["comp"]
    state = compressor.allocate_state(1, r, TINY.head_dim)
    got, at = [], []
    for a, b in [(0, 5)] + [(p, p + 1) for p in range(5, 300)]:
        n, pos = b - a, torch.arange(a, b, device=DEVICE)
        rows, done = compressor.compress(
            x[a:b],
            cw["wkv"],
            cw["wgate"],
            cw["ape"],
            cw["norm"],
            state.kv,
            state.score,
            torch.zeros(n, dtype=torch.int64, device=DEVICE),
            pos,
            ratio=r,
            eps=TINY.rms_norm_eps,
            backend="reference",
        )
        got.append(rows[done])  # one row per token; done marks the boundary tokens, whose rows are complete
        at += pos[done].tolist()
    want, _ = decode.reference.compress({k: v.double() for k, v in cw.items()}, r, x.double(), TINY.rms_norm_eps)
    err = float(decode.rel_err(torch.cat(got), want).max())
    # the op rounds each pooled row to bf16 before its norm (DeepSeek's order): <= 2^-7 of the row's norm
    print(f"ratio {r:>3}: {len(at)} rows, written at p = {at[:3]} ...; row error vs float64 <= 2^-7: {err <= 2**-7 + 2**-14}")

# %% [markdown]
# ### The compressor as an op
#
# The decode step calls the op directly: `compressor.compress(x, wkv, wgate, ape, norm, state.kv, state.score,
# requests, positions, ratio=, eps=, valid=)` returns **one row per token** and a `done` flag instead of the
# completed rows only, so no host sync is needed: the step rotates all T rows and writes them with slot −1
# where not done. Its Triton path is three launches: a projection GEMM pair (bf16 operands, fp32
# accumulation) into a workspace, one program per token that gathers a boundary token's window from the
# workspace or the ring and runs an online per-channel softmax and the RMSNorm, and the ring update, which
# must come **after** the window reads (a step of more than coff·r tokens overwrites ring rows its own
# boundaries still read). As plain torch (gathers, `torch.where`, a host sync per layer) the compressor
# took the largest share of a decode step on the H200 (`benchmarks/decode.md`); the kernels are not re-measured
# here (the benchmark case is `python -m dsv4ref bench compressor`; its latest H200 figures close this notebook).
# The heart of it, the window of one boundary token:

# %%
src = inspect.getsource(compressor.kernels.compress_kernel.fn)  # .fn: the Python function under @triton.jit
print(src[src.index("    if boundary:") : src.index("    else:")])

# %% [markdown]
# The Triton kernels (interpreted on a CPU-only machine, compiled on a GPU) on a 13-token prefill and then single tokens, both ratios, against
# the float64 whole-sequence oracle (the named tolerance `"compressor"`, `docs/compressor.md`):

# %%
for r, dim in ((4, 512), (4, 128), (128, 512)):
    cw = compressor.example_inputs(r, dim=dim, hidden=TINY.hidden_size, seed=r)  # on DEVICE
    xs = x[:130] if r == 128 else x[:17]
    state = compressor.allocate_state(1, r, dim)
    got, p0 = [], 0
    for n in (128, 1, 1) if r == 128 else (13, 1, 1, 1, 1):
        p = torch.arange(p0, p0 + n, device=DEVICE)
        rows, done = compressor.compress(
            xs[p0 : p0 + n],
            cw["wkv"],
            cw["wgate"],
            cw["ape"],
            cw["norm"],
            state.kv,
            state.score,
            torch.zeros(n, dtype=torch.int64, device=DEVICE),
            p,
            ratio=r,
            eps=TINY.rms_norm_eps,
            backend="triton",
        )
        got.append(rows[done])
        p0 += n
    want, _ = compressor.compress_sequence(xs, cw["wkv"], cw["wgate"], cw["ape"], cw["norm"], ratio=r, eps=TINY.rms_norm_eps)
    rep = decode.rel_err(torch.cat(got), want)
    ok = bool((rep <= 2**-7 + 2**-14).all())  # the "compressor" tolerance: the bf16 rounding before the norm
    print(f"ratio {r:>3}, D = {dim}: {want.shape[0]} rows; Triton vs float64 within 2^-7 per row: {ok}")

# %% [markdown]
#
# ## 2. A batch of 4 requests: prefill, then decode
#
# Prompts of 133, 37, 5 and 70 tokens: the first crosses p = 127, where the ratio-128 layer writes its
# first compressed row, and reaches n_c = 33 > K_top = 16 rows on the ratio-4 layers, so its indexer
# really selects; the 5-token request starts with an empty compressed set. The prefill is one batched
# step (all 245 prompt tokens are query rows, each with its own window and compressed candidates). Then
# 24 greedy decode steps, one token per request; request 2 sits out steps 10 and 11 as a **padding row**
# (slot −1, lengths 0: nothing written, nothing read). In the CPU interpreter a Triton launch costs
# about a millisecond per program, so this cell runs the decode through the torch ops of the same
# library (the cache bytes are identical: the writers are exact); section 4 runs a step through the
# Triton kernels.

# %%
dec, w, recs, _ = decode.run(
    TINY, steps=24, prompt_lens=(133, 37, 5, 70), decode_backend="reference", inactive={10: [2], 11: [2]}
)
print("requests:", dec.R, " tokens now in the caches:", dec.lengths.tolist(), " capacity per request:", dec.capacity)
st1 = dec.layers[1]
print("window cache, layer 0:", tuple(dec.layers[0].swa.shape), "uint8  (pages x page bytes)")
print("compressed cache, layer 1 (r = 4):", tuple(st1.comp.shape), " indexer K cache:", tuple(st1.idx_cache.shape))
print("compressed cache, layer 2 (r = 128):", tuple(dec.layers[2].comp.shape))
print("block table (window) of request 0, first 8 pages:", dec.bt_swa[0, :8].cpu().tolist())

# %% [markdown]
# ## 3. Agreement with the float64 dense reference
#
# `decode.reference_forward` recomputes each request's whole sequence in float64: same weights, same
# equations, but **no FP8, no paging, and no sparsity** except the causal window and the top-k ids the
# indexer chose (fed in, so both sides attend to the same rows). It shares no code with the decode path,
# not even the RoPE tables (its mHC pieces are the mHC op's readable references, run at float64). We compare, per step, the row relative error ‖a − b‖/‖b‖ of every layer's
# attention output and of the logits.
#
# **Why these tolerances.** The one lossy format on the path is e4m3 for the 448 NoPE dims of every KV
# row: a dequantised value is within a relative half-ulp 2^-4 of the truth. An attention output
# o = Σ_j P_j v_j · σ(lse − sink) is first-order in that error twice, through the V rows (a convex
# combination does not amplify it) and through the softmax weights P (the scores q·k_j move by the
# same relative amount): **2^-3 for attention outputs**. The logits see the error only through the
# attention updates of the residual stream, a fraction of its norm: **2^-4 for logits**. bf16 rounding
# (~2^-9 each) is noise at this scale.

# %%
rows = decode.agreement(TINY, w, recs, dec.history())
steps = [a.step for a in rows]
fig, ax = plt.subplots(figsize=(9, 3.6))
ax.semilogy(steps, [a.attn_err for a in rows], "o-", label="attention outputs (max over layers, requests)")
ax.semilogy(steps, [a.logits_err for a in rows], "s-", label="logits (max over requests)")
ax.axhline(decode.ATTN_TOL, color="C0", ls="--", lw=0.8, label="ATTN_TOL = 2^-3")
ax.axhline(decode.LOGITS_TOL, color="C1", ls="--", lw=0.8, label="LOGITS_TOL = 2^-4")
ax.set_xlabel("decode step (-1 = last prompt token)")
ax.set_ylabel("relative L2 error vs float64")
ax.set_ylim(1e-3, 1)
ax.legend(fontsize=8, loc="upper right")
plt.show()
print(f"{len(rows)} steps checked; all within tolerance: {all(a.passed for a in rows)}")
print("requests compared per step:", [a.n for a in rows])

# %% [markdown]
# Is the error really the FP8 budget? Put the cache's quantisation *into* the float64 reference
# (`fp8_kv=True`: e4m3 NoPE with UE8M0 block scales, bf16 RoPE dims) and the distance to the decode path
# shrinks, while the distance between the two float64 references (the FP8 effect alone) is of the same
# size as the decode path's error. Not to zero: the decode path's bf16 activations move some values
# across an e4m3 rounding boundary, so its FP8 rounding is an independent draw of the same size.

# %%
toks, topks = dec.history()
pure = decode.reference_forward(TINY, w, toks[0], topks[0])
sim = decode.reference_forward(TINY, w, toks[0], topks[0], fp8_kv=True)
step, pos, logits, attn, act = recs[-1]
p = int(pos[0])
e_pure = float(decode.rel_err(attn[0][0], pure["attn"][0][p]))
e_sim = float(decode.rel_err(attn[0][0], sim["attn"][0][p]))
budget = float(decode.rel_err(sim["attn"][0][p], pure["attn"][0][p]))
print("layer 0, request 0, last step:")
print("  decode vs float64 reference, FP8 simulated inside is closer:", e_sim < e_pure)
print("  FP8 effect alone (float64 vs float64 + FP8) between 2^-6 and 2^-3:", 2**-6 < budget < 2**-3)
print("  decode error within 3x the FP8 effect:", e_pure < 3 * budget)

# %% [markdown]
# The indexer is checked the same way: its FP8 top-16 should mostly agree with the top-16 of the
# unquantised float64 scores (near-ties may flip, so we count overlap). The reference also scores with q and k
# quantised in the config's own indexer format, simulated in float64 (`index_scores_fmt`): the decode path
# agrees with that at least as well.

# %%
K = TINY.index_topk
hits = tot = 0
for li, ids in topks[0].items():
    sc = pure["index_scores"][li]
    for p in range(4 * K + 3, len(toks[0])):
        hits += len(set(torch.topk(sc[p], K).indices.tolist()) & set(i for i in ids[p].tolist() if i >= 0))
        tot += K
print(f"top-16 overlap with the float64 indexer over {tot // K} selections: >= 80%: {hits / tot >= 0.8}")


def overlap(ids, scores, positions):
    """Fraction of the decode path's top-K ids that are among the top-K of the float64 ``scores``."""
    return sum(len(set(torch.topk(scores[p], K).indices.tolist()) & set(ids[p].tolist())) for p in positions) / (
        K * len(positions)
    )


sel = range(4 * K + 3, len(toks[0]))
print(
    "closer to the float64 scores in its own format (FP8) than to the unquantised ones:",
    overlap(topks[0][1], pure["index_scores_fmt"][1], sel) >= overlap(topks[0][1], pure["index_scores"][1], sel),
)

# %% [markdown]
# ### FP8 or DeepSeek's FP4 in the indexer
#
# DeepSeek's own inference code runs the indexer in **FP4**: q and k are rotated by the Hadamard and rounded to
# E2M1 (1 mantissa bit) in blocks of 32 with power-of-two scales, which is `index_format="mxfp4"`, the
# format of `FLASH` and `PRO`. The teaching config keeps FP8 (`docs/config.md` says why). Same weights, same
# prompts, the prefill once more with the FP4 indexer: on the first ratio-4 layer (layer 1) both decoders see
# the same inputs, so any difference in the selected rows is the format's. (Later layers then see different
# rows, and drift apart further.)

# %%
fp4 = TINY.replace(index_format="mxfp4")
dec4 = decode.Decoder(fp4, w, num_requests=4, capacity=dec.capacity, backend="reference")
dec4.prefill([toks[r][:n] for r, n in enumerate((133, 37, 5, 70))])
ids8, ids4 = topks[0][1], dec4.history()[1][0][1]
sel = range(4 * K + 3, 133)  # request 0's prompt positions with n_c > K_top
shared = sum(len(set(ids8[p].tolist()) & set(ids4[p].tolist())) for p in sel) / (K * len(sel))
print(
    f"indexer K pool, layer 1: {dec.layers[1].idx_cache.shape[1] // TINY.index_page} B/key (FP8), "
    f"{dec4.layers[1].idx_cache.shape[1] // TINY.index_page} B/key (MXFP4)"
)
print(f"top-16 ids shared by FP8 and FP4 on the same step, layer 1: {int(shared * 10) / 10} (rounded down to a tenth)")
print("identical at every position:", all(set(ids8[p].tolist()) == set(ids4[p].tolist()) for p in sel))
ref4 = decode.reference_forward(fp4, w, toks[0][:133], dec4.history()[1][0])
print(
    "FP4's choice closer to the float64 FP4 simulation than to the unquantised scores:",
    overlap(ids4, ref4["index_scores_fmt"][1], sel) >= overlap(ids4, ref4["index_scores"][1], sel),
)

# %% [markdown]
# ### Where DeepSeek rounds: bf16 after the Hadamard
#
# DeepSeek's `rotate_activation` returns a **bf16** tensor, and its FP4 quantiser reads bf16: the indexer's q
# and k are rounded to bf16 after the Hadamard and before the FP4 quant. The indexer's quantisers do the same
# (`indexer.quantize_q`, `insert_k`, `quantize_k` with `hadamard=True`), and score in bf16 where DeepSeek's
# bf16 einsum does (`docs/indexer.md#rounding-points`). What that one rounding changes, at V4-Flash's indexer
# shape (64 heads × 128, top 512 of 2 048 keys): the op's FP4 values and choice, against the same quantiser
# fed the fp32 Hadamard output (the order vLLM's Triton path uses) and scored in float64.

# %%
from dsv4ref import indexer as ix
from dsv4ref.testing import randn

T_ix, H_ix, N_ix, K_ix, B_ix = 8, 64, 2048, 512, 64
cs_ix = ix.cos_sin_table(4 * N_ix)
q_ix = randn((T_ix, H_ix, 128), seed=1, block=None, octaves=2)
k_ix = randn((N_ix, 128), seed=2, block=None, octaves=2)
w_ix = randn((T_ix, H_ix), seed=3, block=None, octaves=0)
pos_ix = torch.full((T_ix,), 4 * N_ix - 1, device=DEVICE)

# the op: bf16 after the Hadamard, bf16 weights and scores (DeepSeek's points)
qq, qs, wo = ix.quantize_q(q_ix, pos_ix, cs_ix, w_ix, fmt="mxfp4", hadamard=True, backend="reference")
cache_ix = ix.allocate_k_cache(N_ix // B_ix, B_ix, "mxfp4")
ix.insert_k(cache_ix, k_ix, torch.arange(N_ix, device=DEVICE), block_size=B_ix, fmt="mxfp4", hadamard=True, backend="reference")
scores_ds = ix.logits(qq, qs, wo, cache_ix, pos_ix, block_size=B_ix, backend="reference")
q_ds = ix.dequantize_q(qq, qs).double()
k_ds = ix.dequantize_k(*ix.read_k(cache_ix, torch.arange(N_ix, device=DEVICE), block_size=B_ix, fmt="mxfp4")).double()

# the same quantiser on the fp32 Hadamard output, fp32 weights, float64 scores
r = ix.reference
q_32 = r.mxfp4_values(*r.quantize_mxfp4(r.hadamard_transform(r.prepare_q(q_ix, pos_ix, cs_ix)))).double()
k_32 = r.mxfp4_values(*r.quantize_mxfp4(r.hadamard_transform(k_ix.float()))).double()
c_ix = r.fold(H_ix)
scores_32 = (torch.einsum("thd,nd->thn", q_32, k_32).clamp_min(0) * (w_ix.double() * c_ix)[..., None]).sum(1)


def top_overlap(a, b, k):
    ta, tb = a.topk(k, dim=1).indices, b.topk(k, dim=1).indices
    return torch.zeros_like(a, dtype=torch.bool).scatter_(1, ta, True).gather(1, tb).double().mean().item()


dq, dk = (100 * (a != b).double().mean().item() for a, b in ((q_ds, q_32), (k_ds, k_32)))
print(f"FP4 values that differ: q {dq:.1f} %, k {dk:.1f} %")
shared_ix = int(100 * top_overlap(scores_ds.double(), scores_32, K_ix))
print(f"top-{K_ix} sets shared by the two roundings: {shared_ix} % (rounded down)")

# %% [markdown]
# ## 4. The check has teeth
#
# A tolerance is only worth something if bugs break it. `reference_forward(bugs=…)` injects the
# classic DSV4 mistakes into the float64 side; each must fail the agreement check (pitfalls #14, #16 and
# #17 of `docs/conformance.md`). One does **not**: a transposed comb (#22) barely moves anything here,
# because the random comb of this model sits near the identity, where comb ≈ combᵀ. That is exactly why
# the conformance suite has a 4-cycle trap (section 6): an end-to-end check is not a substitute for the
# op-level ones. We check the first three records (the prefill's last token and two steps): a missing sink
# scales o by σ(lse − sink), which moves towards 1 as the context, and lse with it, grows, so by the 24th
# step its error has shrunk to the size of the FP8 budget.

# %%
for bug in decode.REFERENCE_BUGS:
    bad = decode.agreement(TINY, w, recs[:3], dec.history(), bugs=(bug,))
    verdict = "caught (FAIL)" if not any(a.passed for a in bad) else "NOT caught (still PASS)"
    print(f"  {bug:<22} {verdict}")

# %% [markdown]
# ### One step through the Triton kernels
#
# Everything above ran the library's torch ops. Now the same decoder takes one step through the Triton
# kernels (interpreted on a CPU-only machine, compiled on a GPU): the fused q-norm/RoPE/KV insert, mHC,
# the indexer's quantiser, logits and the fused sparse-MLA decode kernel. The step must agree with the
# float64 reference just the same.

# %%
ids = recs[-1][2].argmax(-1)
pos = dec.lengths.clone()
got = dec.step(ids, backend="triton")
attn = [a.cpu() for a in dec.attn_out]
one = decode.agreement(TINY, w, recs + [(24, pos, got.cpu(), attn, torch.ones(4, dtype=torch.bool))], dec.history())[-1]
print(
    "Triton step: attention within 2^-3:",
    one.attn_err <= decode.ATTN_TOL,
    "; logits within 2^-4:",
    one.logits_err <= decode.LOGITS_TOL,
)

# %% [markdown]
# Bad input is refused with an error that names the problem, and a decode past the space the caches
# were allocated with raises instead of overwriting another request's pages:

# %%
small = decode.Decoder(TINY, w, num_requests=2, capacity=16, backend="reference")
small.prefill([list(range(16)), [1, 2, 3]])
try:
    small.step(torch.tensor([1, 2]))
except decode.CacheCapacityError as e:
    print("CacheCapacityError:", e)
try:
    decode.Decoder(TINY.replace(compress_ratios=(0, 4, 64, 4)))
except ValueError as e:
    print("ValueError:", e)

# %% [markdown]
# ## 5. Where the bytes go at V4-Flash size
#
# Per decoded token, summed over the 43 layers, caches and activations only (weights are shared by the
# batch). The formulas are in `decode.traffic_per_op` (`docs/decode.md`): sparse MLA reads
# N_sel·584 B, with N_sel = 128 window rows plus min(512, n_c) rows on ratio-4 layers or all n_c = L/128
# on ratio-128 layers; the **indexer's logits kernel reads every visible indexer key**, L/4 of them on
# each of the 21 ratio-4 layers, 68 B each in V4-Flash's MXFP4 (132 B in FP8, vLLM's default). At 4k the
# window and the selected rows dominate; at 1M the indexer moves several times the bytes of attention.

# %%
contexts = [4096, 131072, 1 << 20]
ops = ["sparse_mla", "indexer", "qnorm_rope_kv_insert", "mhc", "compressor"]
table = {c: decode.traffic_per_op(FLASH, c) for c in contexts}
print(f"{'context':>9} " + " ".join(f"{o:>21}" for o in ops) + f" {'total':>9}   (MB per token)")
for c in contexts:
    print(f"{c:>9} " + " ".join(f"{table[c][o] / 1e6:>21.2f}" for o in ops) + f" {sum(table[c].values()) / 1e6:>9.2f}")
for fmt in ("mxfp4", "fp8"):
    t = decode.traffic_per_op(FLASH.replace(index_format=fmt), 1 << 20)
    print(f"at 1M, {fmt} indexer: {t['indexer'] / t['sparse_mla']:.1f}x the bytes of sparse MLA")
fig, ax = plt.subplots(figsize=(7, 3.8))
bottom = np.zeros(len(contexts))
for o in ops:
    v = np.array([table[c][o] / 1e6 for c in contexts])
    ax.bar(["4k", "128k", "1M"], v, bottom=bottom, label=o)
    bottom += v
ax.set_ylabel("MB moved per decoded token (43 layers)")
ax.set_title("DeepSeek-V4-Flash decode traffic by op")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 6. Point the conformance suite at your kernel
#
# `dsv4ref.conformance.run(impls)` takes a mapping from op name to **any callable with our public
# signature** (an XPU port, a vLLM kernel behind a three-line adapter, your own attempt) and runs it on
# the adversarial cases our tests use: per-block scales over 16 octaves, amax = 448·2^k blocks, page
# sizes 61 and 2, −1 slots and short slot maps, −1 inside index prefixes, an empty row, ±∞ sinks,
# padded heads, the causal top-k mask and the transposed-comb 4-cycle. It returns one row per output,
# compared under a named tolerance. Here is someone's `mhc.post` that forgot the transpose:


# %%
def my_post(x, residual, post, comb):
    """new_j = post_j·x + Σ_i comb[j, i]·res_i   <- the bug: should be comb[i, j]"""
    mixed = torch.einsum("tji,tih->tjh", comb.float(), residual.float())
    return (post.reshape(*residual.shape[:2], 1) * x.float()[:, None] + mixed).to(torch.bfloat16)


print(conformance.format_report(conformance.run({"mhc.post": my_post}), details=False))

# %% [markdown]
# The 4-cycle trap and the random combs catch it; a symmetric comb such as the identity cannot, which is
# why a test with one never finds this bug.
#
# And this checkout's own kernels on the cases of one op (`tests/test_conformance.py` and
# `python -m dsv4ref conformance` run every op's; here the sparse-MLA cases, to keep the notebook short):

# %%
report = conformance.run(conformance.default_impls(), "sparse_mla")
print("every sparse_mla case passes:", bool(report) and all(r.passed for r in report), f"({len(report)} rows)")
print("ops with cases:", sorted({c.op.split(".")[0] for c in conformance.all_cases(with_expected=False)}))

# %% [markdown]
# **Without Python.** `scripts/make_golden.py` freezes the same cases into `golden/<op>__<case>.pt`:
# plain `torch.save` dicts of named tensors (`inputs`, `expected`, the `positional` argument order and
# the `tolerance` to compare with). A C++/SYCL port reads them with libtorch (`torch::pickle_load`) and
# never runs our code; in Python, `conformance.run(impls, conformance.load_golden("golden"))` runs them.
# The file format, and how to map a port's own functions, are in `docs/conformance.md`.

# %%
import pathlib

gold = pathlib.Path("../golden/kv_cache.insert__B2_short_slots.pt")
d = torch.load(gold, weights_only=True)
print(gold.name, "| keys:", sorted(d))
print("positional:", d["positional"], "| inputs:", list(d["inputs"]), "| expected:", list(d["expected"]))
print("tolerance:", d["tolerance"])
print("why:", d["why"])

# %% [markdown]
# ## 7. The performance story
#
# The teaching config is tiny, so on a GPU a decode step is a few hundred small launches: it measures
# launch latency and host-side bookkeeping, not bandwidth (the per-op kernels are benchmarked at Flash
# size in their own notebooks and in `benchmarks/`). On a GPU the cell below times the decode loop and
# each op's share (every op synchronised, so shares add up to the step); `python -m dsv4ref demo` prints
# the same. Measured on the H200: `benchmarks/decode.md`, and the last cell of this notebook.

# %%
# NBVAL_IGNORE_OUTPUT
if not dsv4ref.interpreting():
    d2, _, _, tps = decode.run(TINY, steps=32, prompt_lens=(133, 37, 5, 70))
    print(f"{tps:.0f} tokens/s (4 requests, teaching config)")
    d3, _, _, _ = decode.run(TINY, steps=32, prompt_lens=(133, 37, 5, 70), profile=True)
    tot = sum(d3.prof.values())
    for k, v in sorted(d3.prof.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<22} {v / tot:6.1%}")
else:
    print("interpreting Triton on the CPU: timings would measure the interpreter; run on a GPU")

# %% [markdown]
# ## 8. One step, one graph
#
# At this size a step is launch-bound, so the lever is to stop launching: record the whole device part of a
# step once as a **device graph** and replay it. That needs a device part that never reads a value back to the
# host (a host sync cannot be recorded), over buffers that stay put. `Decoder(graph=True)` splits `step` in two
# (`docs/decode.md#one-step-one-graph`):
#
# * **host bookkeeping**, before the graph: the ids, each row's request, position and validity, the capacity
#   check, and the indexer's short-context decision (max n_c ≤ K_top, computed from the host's positions);
#   these are copied into the graph's static inputs;
# * **the device part**: every layer (attention, compressor, indexer, MoE, mHC) and the lm head, captured by
#   `dsv4ref.device.capture_graph` once per (backend, shortcut) and replayed every step. The expert and top-k
#   ids it records are written on the device; value checks must be off (`DSV4REF_CHECK_VALUES=0`).
#
# The tokens are the eager path's, bit for bit. Below: 4 steps of 2 requests, one of which crosses the end of
# the indexer shortcut (n_c goes from 16 to 17), so a second graph is captured. (On a CPU there are no device
# graphs: the same static-buffer step runs eagerly, through the torch ops here; on a GPU, through the Triton
# kernels and real graphs.)

# %%
from dsv4ref.validate import checking_values

be = "reference" if dsv4ref.interpreting() else "triton"
with checking_values(False):
    pair = {}
    for graph in (False, True):
        dg = decode.Decoder(TINY, decode.make_weights(TINY, 0), num_requests=2, capacity=96, backend=be, graph=graph)
        g = torch.Generator().manual_seed(3)
        lg = dg.prefill([torch.randint(0, TINY.vocab_size, (n,), generator=g) for n in (66, 5)])
        for _ in range(4):
            lg = dg.step(lg.argmax(-1).cpu())
        pair[graph] = dg
print(
    "graphs captured (indexer shortcut):",
    [k[1] for k in pair[True].graphs],
    " replays:",
    [g.replays for g in pair[True].graphs.values()],
)
print("graph tokens == eager tokens:", torch.equal(pair[True].tokens, pair[False].tokens))

# %% [markdown]
# On a GPU the cell below times warm steps both ways (`decode.graph_speed`, what `python -m dsv4ref demo --graph`
# prints): tokens/s eager and graphed, and of a graphed step, how long the replay takes alone; the rest is host
# work (the argmax read back, the rows, the copies into the static inputs). Measured on the H200:
# `benchmarks/decode.md`.

# %%
# NBVAL_IGNORE_OUTPUT
import os

if not dsv4ref.interpreting() and os.environ.get("DSV4REF_BENCH") != "0":
    sp = decode.graph_speed(TINY, steps=32)
    print(
        f"eager {sp['eager']:.0f} tokens/s, graph=True {sp['graph']:.0f} tokens/s (4 requests); replay "
        f"{sp['replay_ms']:.2f} ms of a {sp['graph_ms']:.2f} ms graphed step; same tokens: {sp['same']}"
    )
else:
    print("interpreting Triton on the CPU (or DSV4REF_BENCH=0): no timings; run on a GPU")


# %% [markdown]
# The latest one-run H200 bench, as `benchmarks/RESULTS.md` records it (date, device and the ceilings measured in
# the same run first): the teaching config's whole step, eager and as one graph, and the compressor at Flash size.

# %%
from IPython.display import Markdown

from dsv4ref.tools.results import results_header, results_section

Markdown(results_header() + "\n\n" + results_section("decode") + "\n\n" + results_section("compressor"))
