# %% [markdown]
# # 04 · Sparse MLA decode over the FP8 paged cache, and the ladder to a fast kernel
#
# This is the heart of a DeepSeek-V4 decode step. Every query head of a new token attends to a **sparse**
# set of cached tokens, the sliding window plus the compressed rows the indexer picked, and every one of
# those tokens is stored as a single 512-dim **latent** row in the 584-byte FP8 page format of notebook 01.
# A learned **sink** logit per head sits in the softmax denominator.
#
# Part A says what the op computes: the reference (§1), the sink (§2), the candidate sets (§3) and the online
# softmax (§4). Part B is the **ladder**: five implementations of the same op, each measured on an H200 on
# the same inputs, from the seed's path at a few percent of the hardware bound to a warp-specialised Hopper
# kernel, with what changed at each rung, why it is faster and what still limits it (§5–§10): the fused
# kernel's source, its block sizes and the split/merge scratch format are all here. Part C holds the checks
# (§11), the bytes (§12) and the roofline of every rung (§13), then the lessons (§14).
#
# The math, the conventions, the input contract and the pitfalls are written up in `docs/sparse_mla.md`; the
# code is the folder `dsv4ref/sparse_mla/`: `reference.py` (the whole op in plain torch), `two_pass.py` (the
# seed's design, twice), `kernels.py` (the fused Triton kernel and the split merge), `launch.py` (the launch
# shape `SparseMlaLaunch`, the custom ops) and `gluon/` (the Hopper kernels, launched with a `GluonLaunch`).

# %%
import dsv4ref  # first: picks the device, sets TRITON_INTERPRET on a CPU-only machine
import dataclasses
import inspect
import json
import warnings

warnings.filterwarnings("ignore")
import numpy as np

np.seterr(all="ignore")
import math

import matplotlib.pyplot as plt
import torch

# %matplotlib inline
from dsv4ref import formats, kv_cache, sparse_mla, tl, validate
from dsv4ref.sparse_mla import kernels, reference, two_pass
from dsv4ref.sparse_mla.launch import launch_for_sms
from dsv4ref.config import TINY
from dsv4ref.device import DEVICE, describe
from dsv4ref.testing import compare, generator, randn
from dsv4ref.tools.cases.sparse_mla import LADDER_PATH

# %%
# NBVAL_IGNORE_OUTPUT
print(describe())

# %% [markdown]
# Every measured figure this notebook quotes (µs, % of the bound, speed-ups) comes from one data file,
# `benchmarks/sparse_mla_ladder.json`, loaded here once and drawn whole in §13; the prose never types them.
# `figures(rung)` prints a rung's line per benchmark shape. `FLOOR` is the project's target (35 % of the
# bound) and `FLASHMLA` the level FlashMLA reaches on Hopper (about half of it): targets, not measurements.

# %%
ladder = json.loads(LADDER_PATH.read_text())
bw, peak = ladder["ceilings"]["copy_bytes_per_s"], ladder["ceilings"]["bf16_flops_per_s"]
SHAPE_NAMES = [f"H {sh['H']} K {sh['K']}" for sh in ladder["shapes"]]
US = {r["key"]: r["us"] for r in ladder["rungs"] + ladder["others"]}
FLOOR, FLASHMLA = 0.35, 0.50


def bound_us(i):
    """The bound of benchmark shape i in µs: max(bytes / copy bandwidth, FLOP / bf16 matmul rate)."""
    sh = ladder["shapes"][i]
    return max(sh["bytes"] / bw, sh["flops"] / peak) * 1e6


def figures(key, *versus):
    """Print rung `key`'s time per shape, its fraction of the bound and its speed-up over each rung in `versus`."""
    for i, name in enumerate(SHAPE_NAMES):
        us = US[key][i]
        gains = "".join(f"; {US[v][i] / us:4.2f}× {v}" for v in versus)
        print(f"  {key:<9} {name:<13} {us:6.1f} µs, {bound_us(i) / us:5.1%} of the bound{gains}")


print(f"{LADDER_PATH.name}: {ladder['device']}, {ladder['date']}")

# %% [markdown]
# ## 1. MQA over one latent head, and K = V
#
# Multi-head latent attention (MLA) in its decode ("absorbed") form is **multi-query attention**: the H query
# heads of a token (64 in V4-Flash, 128 in V4-Pro) all read the *same* key/value row per cached token. That
# row is the token's 512-dim latent c, and it plays both parts:
#
# $$s_{h,j} = \sigma_s\,\langle q_h, c_j\rangle,\qquad
#   \mathrm{lse}_h = \ln\sum_{j\in J} e^{s_{h,j}},\qquad
#   o_h = \sum_{j\in J} e^{s_{h,j}-\mathrm{lse}_h}\; c_j \;\cdot\; \sigma(\mathrm{lse}_h - \mathrm{sink}_h)$$
#
# with σ_s = 512^-½ (no YaRN mscale in V4). **K = V = the whole row**: 448 "NoPE" dims, stored as e4m3 with
# one power-of-two scale per 64, plus 64 RoPE dims stored as bf16. Two consequences:
#
# * the key carries position (its last 64 dims were rotated at the key's position when it was written), so
#   the score ⟨q, c⟩ is a relative-position score once q is rotated at the query's position;
# * the **value carries the rotation too**: o[448:512] is a mix of rotated vectors, so the output must be
#   rotated back by −p (notebook 02's inverse RoPE) before the output projection. A kernel that treats the
#   RoPE dims as key-only and returns 448 value dims (the V3.2 habit) silently drops them (pitfall #15).
#
# One fused kernel therefore loads each selected row **once** and uses the tile twice: as K for the scores
# and as V for the weighted sum.
#
# The reference backend is exactly the formula: gather and dequantise the listed slots
# (`kv_cache.gather`), mask what does not count, and attend in fp32. Here it is, whole
# (`dsv4ref/sparse_mla/reference.py`):

# %%
print(inspect.getsource(reference.decode))

# %%
# A small example with the teaching config's sizes: T tokens, H heads, a window pool and a compressed pool.
# example_inputs returns decode's keyword arguments.
T, H, K1, K2 = 3, TINY.num_heads, 16, 16  # K1 window candidates and K2 compressed ones per token
inputs = sparse_mla.example_inputs(T, H, K1=K1, K2=K2, block_size=16, extra_block_size=2, pages=4, extra_pages=24, seed=4)
q, sink = inputs["q"], inputs["sink"]
slots, lengths = inputs["slots"], inputs["lengths"]
out_ref, lse_ref = sparse_mla.decode(**inputs, backend="reference")
print("arguments:", list(inputs))
print(
    "q", tuple(q.shape), q.dtype, "| window slots", tuple(slots.shape), "| compressed slots", tuple(inputs["extra_slots"].shape)
)
print("out", tuple(out_ref.shape), out_ref.dtype, "| lse", tuple(lse_ref.shape), lse_ref.dtype)
print("window lengths", lengths.cpu().tolist(), "| compressed lengths", inputs["extra_lengths"].cpu().tolist())
print("-1 entries inside the window prefixes:", [int((slots[t, : int(lengths[t])] < 0).sum()) for t in range(T)])

# %% [markdown]
# ### The arguments, the results, and which entries count
#
# | name | dtype | shape | meaning |
# |---|---|---|---|
# | `q` | bf16 | `[T, H, 512]` | the absorbed queries, RoPE dims already rotated at the token's position; 1 ≤ H ≤ 128 |
# | `cache`, `extra_cache` | uint8 | `[pages, kv_cache.page_bytes(B)]` | the window pool's and the compressed pool's paged FP8 caches (notebook 01's page format) |
# | `slots`, `extra_slots` | int32 or int64 | `[T, K]`, `[T, K2]` | global slots page · B + offset, −1 = none |
# | `lengths`, `extra_lengths` | int32 or int64, or None | `[T]` | in [0, K] (resp. [0, K2]); None = K (resp. K2) for every token |
# | `block_size`, `extra_block_size` | int | — | B, tokens per page of each cache (keyword-only) |
# | `sink` | fp32, or None | `[H]` | one logit per head in the softmax denominator only (§2); −inf = no sink, +inf = out 0, None = no sink |
# | `scale` | float | — | σ_s, the scale of every score; default `sparse_mla.DEFAULT_SCALE` = 512^-½ |
# | **out** | bf16 | `[T, H, 512]` | Σ_j p_j c_j · σ(lse − sink), contiguous |
# | **lse** | fp32 | `[T, H]` | ln Σ_j e^(s_j), natural log, **without** the sink |
#
# **The rule.** For token t, entry j of a pool counts iff `j < lengths[t]` **and** `slots[t, j] >= 0`
# (for the compressed pool: `j < extra_lengths[t]` and `extra_slots[t, j] >= 0`). So:
#
# * `lengths = None` means every j < K counts: the same as lengths[t] = K for every t;
# * a −1 is skipped wherever it stands, inside the length too;
# * an entry at or past the length is never read, whatever it holds: a valid slot there is ignored (with value
#   checks on it must still be −1 or a slot of its cache);
# * duplicates are **not** removed: a slot listed twice (in one pool or in both) adds its term to both sums
#   twice;
# * the counted entries of both pools form one multiset J(t) and enter **one** softmax;
# * a token whose J(t) is empty gets out = 0 and lse = −inf, whatever its sink.
#
# The cell below checks that rule on five tokens built for it, against a float64 version of the formula
# written from the rule alone (a plain loop, as a port would write it), on every backend.

# %%
cache1, B1 = inputs["cache"], inputs["block_size"]
a, b, c, d, e, f = 3, 17, 30, 41, 52, 60  # six valid slots of the example's window cache
cases_ = [  # (slots of the token, its length, what it shows)
    ([a, -1, b, c, d, e], 4, "a -1 inside the length is skipped"),
    ([a, b, c, d, e, f], 2, "valid slots past the length are ignored"),
    ([a, a, b, -1, -1, -1], 3, "a duplicate counts twice"),
    ([-1] * 6, 6, "nothing valid: empty"),
    ([a, b, c, d, e, f], 0, "length 0: empty"),
]
S = torch.tensor([r[0] for r in cases_], dtype=torch.int32).to(DEVICE)
L = torch.tensor([r[1] for r in cases_], dtype=torch.int32).to(DEVICE)
q5 = q[[0, 1, 2, 0, 1]].contiguous()


def by_the_rule(q, cache, slots, lengths, block_size, sink, scale):
    """out, lse and mass (Σ p·|c|, for the tolerance) in float64, from the rule alone, one token at a time."""
    T_, H_ = q.shape[:2]
    out = torch.zeros(T_, H_, formats.HEAD_DIM, dtype=torch.float64)
    mass = torch.zeros_like(out)
    lse = torch.full((T_, H_), -math.inf, dtype=torch.float64)
    for t in range(T_):
        n = slots.shape[1] if lengths is None else int(lengths[t])
        J = [int(x) for x in slots[t, :n] if x >= 0]  # the counted entries, duplicates kept
        if not J:
            continue  # empty: out 0, lse -inf
        rows = kv_cache.gather(cache, torch.tensor(J, dtype=torch.int32, device=DEVICE), block_size=block_size)
        rows = rows.double().cpu()  # [n, 512], exact
        s = scale * q[t].double().cpu() @ rows.T  # [H, n]
        lse[t] = torch.logsumexp(s, dim=1)
        p = torch.exp(s - lse[t][:, None]) * torch.sigmoid(lse[t] - sink.double().cpu())[:, None]
        out[t], mass[t] = p @ rows, p @ rows.abs()
    return out, lse, mass


for t, (row, n, what) in enumerate(cases_):
    print(f"token {t}: slots {row}, length {n}: counts {[x for x in row[:n] if x >= 0]} ({what})")
print("scale is 512^-0.5:", sparse_mla.DEFAULT_SCALE == formats.HEAD_DIM**-0.5)
o_rule, l_rule, m_rule = by_the_rule(q5, cache1, S.cpu(), L.cpu(), B1, sink, sparse_mla.DEFAULT_SCALE)
full = torch.full_like(L, S.shape[1])
for backend in sparse_mla.SUPPORTED_BACKENDS:
    o, l = sparse_mla.decode(q5, cache1, S, L, block_size=B1, sink=sink, backend=backend)
    o_none, l_none = sparse_mla.decode(q5, cache1, S, None, block_size=B1, sink=sink, backend=backend)
    o_full, l_full = sparse_mla.decode(q5, cache1, S, full, block_size=B1, sink=sink, backend=backend)
    o_x, l_x = sparse_mla.decode(
        q5,
        cache1,
        torch.full_like(S, -1),
        None,
        block_size=B1,
        sink=sink,
        backend=backend,
        extra_cache=cache1,
        extra_slots=S,
        extra_lengths=L,
        extra_block_size=B1,
    )
    print(
        f"{backend:>9}: the rule: {compare(o, o_rule, 'bf16_weighted_sum', 'out', m_rule).verdict()}, "
        f"{compare(l, l_rule, 'lse', 'lse').verdict()}; tokens 3, 4: out 0 {bool((o[3:] == 0).all())}, "
        f"lse {sorted(set(l[3:].flatten().cpu().tolist()))}"
    )
    print(
        f"{'':>9}  lengths=None equals lengths=K: {torch.equal(o_none.cpu(), o_full.cpu()) and torch.equal(l_none.cpu(), l_full.cpu())}; "
        f"the same rows as the second pool: {compare(o_x, o_rule, 'bf16_weighted_sum', 'out', m_rule).passed and compare(l_x, l_rule, 'lse').passed}"
    )

# %% [markdown]
# The V-width check: zero the NoPE part of every cached row. If V really is 512 wide, the output's last 64
# dims are still non-zero (they come from the RoPE part of V) and the first 448 are exactly zero.

# %%
n_slots = 64
kv = randn((n_slots, 512), seed=11, octaves=6)
kv[:, :448] = 0
cache0 = kv_cache.allocate(4, 16)
kv_cache.insert(cache0, kv, torch.arange(n_slots, device=DEVICE), block_size=16)
idx0 = torch.randint(0, n_slots, (2, 16), generator=generator(3), dtype=torch.int32).to(DEVICE)
len0 = torch.tensor([16, 9], dtype=torch.int32).to(DEVICE)
for backend in sparse_mla.SUPPORTED_BACKENDS:
    o, _ = sparse_mla.decode(q[:2], cache0, idx0, len0, block_size=16, backend=backend)
    print(
        f"{backend:>9}: out[..., :448] all zero: {bool((o[..., :448] == 0).all())}; "
        f"out[..., 448:] non-zero entries: {int((o[..., 448:] != 0).sum())} of {o[..., 448:].numel()}"
    )

# %% [markdown]
# ## 2. The attention sink
#
# Each head has a learned logit sink_h that joins the softmax **denominator only**: it is a "no-op token"
# whose value is zero. It lets a head attend to nothing:
#
# $$o_h = \frac{\sum_j e^{s_j} c_j}{\sum_j e^{s_j} + e^{\mathrm{sink}_h}}
#       = \underbrace{\frac{\sum_j e^{s_j} c_j}{\sum_j e^{s_j}}}_{\text{plain softmax output}}
#         \cdot \sigma(\mathrm{lse} - \mathrm{sink}_h).$$
#
# The right-hand **correction form** is how both Triton paths apply it: compute an ordinary softmax, then
# multiply by σ(lse − sink) = 1 / (1 + e^(sink − lse)). It is exact for sink = −∞ (factor 1: an ordinary
# softmax) and sink = +∞ (factor 0) without ever forming ∞ − ∞, and the returned lse stays the plain one
# (without the sink), which is what a later merge of partial results needs. When sink = lse the output
# halves. The seed's two-pass path accepted the sink argument and never applied it (pitfall #17): the output
# was too large by exactly 1/σ(lse − sink).

# %%
s_demo = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)
lse_demo = float(torch.logsumexp(s_demo, 0))
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
ax = axes[0]
width = 0.25
for i, sk in enumerate([-math.inf, lse_demo, lse_demo + 1.5]):
    p = torch.softmax(s_demo, 0) * torch.sigmoid(torch.tensor(lse_demo - sk, dtype=torch.float64))
    label = "sink = −∞ (plain softmax)" if sk == -math.inf else f"sink = lse{'' if sk == lse_demo else ' + 1.5'}"
    ax.bar(np.arange(5) + (i - 1) * width, p.numpy(), width, label=f"{label}: Σp = {float(p.sum()):.2f}")
ax.set_xlabel("candidate j")
ax.set_ylabel("attention weight")
ax.set_title("weights with a sink: same shape, smaller total")
ax.legend(fontsize=8)
ax = axes[1]
x = np.linspace(-6, 6, 200)
ax.plot(x, 1 / (1 + np.exp(x)))
ax.axvline(0, color="grey", lw=0.5)
ax.set_xlabel("sink − lse")
ax.set_ylabel("σ(lse − sink): factor on the output")
ax.set_title("the correction factor")
plt.tight_layout()
plt.show()

# %%
# The same facts through the library (every backend): sink −inf == no sink, +inf -> 0, sink = lse halves.
for backend in sparse_mla.SUPPORTED_BACKENDS:
    base, lse0 = sparse_mla.decode(**{**inputs, "sink": None}, backend=backend)
    res = {}
    for name, sk in [("-inf", torch.full((H,), -math.inf)), ("+inf", torch.full((H,), math.inf))]:
        o, l = sparse_mla.decode(**{**inputs, "sink": sk.to(DEVICE)}, backend=backend)
        res[name] = (o, l)
    half, _ = sparse_mla.decode(**{**inputs, "sink": lse0[0].clone()}, backend=backend)
    print(
        f"{backend:>9}: sink=-inf equals no sink: {torch.equal(res['-inf'][0].cpu(), base.cpu())}; "
        f"sink=+inf gives zeros: {bool((res['+inf'][0] == 0).all())}; lse unchanged: {torch.equal(res['+inf'][1].cpu(), lse0.cpu())}; "
        f"sink=lse halves token 0: {compare(half[0], base[0].double() * 0.5, 'bf16_out').passed}"
    )

# %% [markdown]
# ## 3. Which tokens a decode token at position p attends to
#
# The candidate multiset J(t) of a token at absolute position p (`docs/sparse_mla.md`, candidate sets) has two parts, each in its own
# paged cache:
#
# * **the window SWA(p)**: positions p − W + 1 … p (W = 128 in V4, 16 in the teaching config), clipped at 0.
#   It includes the current token, whose row was written by the fused RoPE + insert kernel a step earlier.
# * **compressed rows**: one row summarises r consecutive tokens; only complete windows count, so
#   n_c(p) = (p + 1) // r rows are visible. Ratio-128 layers (HCA) use all of them; ratio-4 layers (CSA) use
#   the up-to-K_top rows the lightning indexer picked.
#
# Both lists go to the kernel as **global slots** (page · page_size + offset, −1 = none) with a length each;
# both enter one softmax. Here is the construction for p = 37 in the teaching config, with a toy page table.


# %%
def window_positions(p, W):
    return list(range(max(0, p - W + 1), p + 1))


def compressed_visible(p, r):
    return list(range((p + 1) // r))


def to_slots(positions, page_table, page_size):
    """position -> global slot through a request's page table: page · page_size + offset."""
    return [page_table[x // page_size] * page_size + x % page_size for x in positions]


p = 37
W = TINY.window
swa = window_positions(p, W)
print(f"p = {p}, W = {W}: window positions {swa[0]}..{swa[-1]} ({len(swa)} entries)")
print("window slots (pages 7, 2, 5 of 16 tokens):", to_slots(swa, [7, 2, 5], TINY.window_page))
c128 = compressed_visible(p, 128)
c4 = compressed_visible(p, 4)
print(f"ratio 128: n_c = {len(c128)} visible rows {c128}")
print(f"ratio 4:   n_c = {len(c4)} visible rows {c4}; the indexer keeps at most K_top = {TINY.index_topk} of them")
print(f"ratio 4, p = 2 -> {compressed_visible(2, 4)}; p = 3 -> {compressed_visible(3, 4)} (complete windows only)")

# %% [markdown]
# The two pools cover overlapping history on purpose (a recent token can be both in the window and inside
# a compressed row); both are kept. Entries are not de-duplicated: a slot listed twice counts twice.
#
# ## 4. Online softmax
#
# A kernel cannot hold all K scores of a head at once when K is in the thousands, and it should not read the
# rows twice (once for the max, once for the sum). The **online softmax** keeps three running values per
# head while it walks the candidate list in chunks: the max m, the sum l = Σ e^(s − m), and the unnormalised
# output acc = Σ e^(s − m) · c. A new chunk with scores s':
#
# $$m' = \max(m, \max s'),\quad \alpha = e^{m - m'},\quad l' = \alpha l + \sum e^{s' - m'},\quad
#   acc' = \alpha\,acc + \sum e^{s' - m'} c.$$
#
# At the end, out = acc / l and lse = m + ln l. Two guards make it NaN-free (pitfall #18): a chunk in
# which every entry is masked leaves m = −∞, and e^(−∞ − (−∞)) is NaN, so exponents use m_safe = 0 in that
# case; and a row with no valid entry at all has l = 0, so it is written as out = 0, lse = −∞ explicitly. The
# same (m, l, acc) states also **merge**: that is how the kernel splits a long list across programs
# (flash-decoding) and combines the pieces, applying the sink once, after the merge (pitfall #20).

# %%
g = generator(0)
s_all = torch.randn(40, generator=g, dtype=torch.float64) * 3
v_all = torch.randn(40, 8, generator=g, dtype=torch.float64)
valid = torch.ones(40, dtype=torch.bool)
valid[:16] = False  # a first chunk with nothing valid
m, l, acc = -math.inf, 0.0, torch.zeros(8, dtype=torch.float64)
for j in range(0, 40, 16):
    s = s_all[j : j + 16].masked_fill(~valid[j : j + 16], -math.inf)
    m_new = max(m, float(s.max()))
    m_safe = 0.0 if m_new == -math.inf else m_new
    alpha = math.exp(m - m_safe)
    pj = torch.exp(s - m_safe)
    l = alpha * l + float(pj.sum())
    acc = alpha * acc + pj @ v_all[j : j + 16]
    m = m_new
full = torch.softmax(s_all.masked_fill(~valid, -math.inf), 0) @ v_all
print(
    "online result equals the one-shot softmax:",
    compare(acc / l, full, "fp32_reduction").passed,
    "| lse equal:",
    abs(m + math.log(l) - float(torch.logsumexp(s_all[valid], 0))) < 1e-12,
)

# %% [markdown]
# ## 5. The ladder
#
# One op, five implementations, all giving the reference's answer (§11). The bound of a case is
# max(bytes / copy bandwidth, FLOPs / bf16 matmul rate) with both ceilings measured in the same run; "of the
# bound" is how close a rung gets to it. The three benchmark shapes have T = 64 decode tokens and H heads
# reading K candidates each (a window pool of 128 plus the compressed pool, pages of 64): H 64, K 640
# (V4-Flash), H 128, K 1152 (V4-Pro) and H 16, K 2048 (tensor parallelism: few heads, long lists).
#
# **One byte accounting for the whole notebook.** Per selected row, a kernel must read the row's 584-byte
# record (`formats.TOKEN_BYTES`: 448 e4m3 bytes, 64 bf16 RoPE values, 8 scale bytes) and its 4-byte int32
# slot. The two-pass paths also write the row as 1024 bytes of bf16 in pass 1, and pass 2 reads it back
# **together with its slot again** (the table entry that says whether the row counts: 4 more bytes). Building
# that −1-masked table is one more elementwise pass over the slots (read 4, write 4 per entry), not counted
# below. Per token, every path also reads q and writes out (bf16), writes lse (fp32) and reads the two lengths.
# The next cell computes these from `dsv4ref.formats` and checks them against the ladder file's compulsory
# bytes.

# %%
SLOT_BYTES = torch.tensor([], dtype=torch.int32).element_size()
ROW_FUSED = formats.TOKEN_BYTES + SLOT_BYTES  # read the record and its slot
ROW_BF16 = formats.HEAD_DIM * torch.tensor([], dtype=torch.bfloat16).element_size()
ROW_TWO_PASS = ROW_FUSED + ROW_BF16 + (ROW_BF16 + SLOT_BYTES)  # pass 1: + write the row; pass 2: read it and its slot


def compulsory(T, H, K):
    """Bytes every path must move: the rows and their slots; q in, out out (bf16); lse (fp32); two lengths."""
    return T * (K * ROW_FUSED + H * formats.HEAD_DIM * 2 * 2 + H * 4 + 2 * SLOT_BYTES)


print(
    f"per selected row: fused {ROW_FUSED} B = {formats.TOKEN_BYTES} record + {SLOT_BYTES} slot; "
    f"two-pass {ROW_TWO_PASS} B = {ROW_FUSED} + {ROW_BF16} written + {ROW_BF16 + SLOT_BYTES} read back (row + slot): "
    f"{ROW_TWO_PASS / ROW_FUSED:.1f}× more"
)
print(
    "compulsory bytes equal the ladder file's:",
    all(compulsory(sh["T"], sh["H"], sh["K"]) == sh["bytes"] for sh in ladder["shapes"]),
)

# %% [markdown]
# | rung | what changed | why it is faster | what still limits it |
# |---|---|---|---|
# | 0. the seed's two-pass path | — (vLLM's first portable port) | — | a Python loop over tokens with a host sync each; 2·T gather launches of a few rows each; 2640 B moved per row |
# | 1. clean two-pass | the index table is one tensor op; one gather launch for all tokens; a reused workspace | 2 launches instead of 2·T + 1, each filling the GPU | still 2640 B per row (588 read, 1024 written, 1024 + 4 read back); a latency-bound attention loop |
# | 2. fused | the attention loop reads the FP8 pages itself and dequantises in registers; the K tile is reused as V | 588 B per row, 4.5× fewer; one launch; no workspace | one program per (token, 64 heads): ≤ one wave of programs; a 64 × 512 fp32 accumulator that spills; load → dequantise → QKᵀ → softmax → P·V in series in every warp |
# | 3. split list (flash-decoding) | the candidate list is split over S programs; a merge kernel folds their partial states | S× more programs in flight where T · head blocks leaves SMs idle | partial-state traffic and a second launch; every program is still the serial chain of rung 2 |
# | 4. warp-specialised (Gluon, Hopper) | producer warps dequantise FP8 pages into shared memory while two consumer warpgroups run the MMAs, each owning 256 of the 512 output dims; at H ≤ 16 a narrow kernel with the heads as the MMAs' N and two producer warpgroups | loads and dequantisation overlap the tensor-core work; the accumulator fits in registers | measured in the GPU run (§13) and taken apart in §10b: latency at one program per SM — a row gather that stays well under the copy rate at this grid, the scorer's serial QKᵀ → softmax → P·V chain, and a fixed cost (query in, output and partials out, the merge) that is a large part of the call |
#
# The rest of this part takes the rungs one by one, on the small example of §1.

# %% [markdown]
# ## 6. Rung 0: the seed's two-pass path
#
# The seed (vLLM's first XPU port) ran sparse MLA in two passes. **Pass 1** dequantises every selected row into
# a bf16 workspace with the KV cache's reader kernel; **pass 2** is a bf16 sparse attention kernel over the
# workspace. Its kernel cut each token's list at one length, so the host first **packed** each token's valid
# slots `[valid compressed…, valid window…, −1…]`: a Python loop over tokens that reads every length on the
# host (a device synchronisation per token) and gathers token by token. It also accepted the sink argument
# and never applied it (pitfall #17).
#
# `two_pass.seed_decode` keeps that structure on our kernels (with the sink applied, so its answer is right
# and its time is comparable). The benchmark builds the plan once per input set and times only the device
# work; the host loop comes on top in real use.

# %%
print(inspect.getsource(two_pass.seed_plan))
print(inspect.getsource(two_pass.seed_decode))

# %%
plan = two_pass.seed_plan(slots, lengths, inputs["extra_slots"], inputs["extra_lengths"])
print(
    "packed rows per token:",
    [int((plan.table[t] >= 0).sum()) for t in range(T)],
    "| gather launches:",
    sum(int(r is not None and r.numel() > 0) for row in plan.per_token for r in row),
)
_, _, mass = reference.decode(**inputs, with_mass=True)
o, l = two_pass.seed_decode(**inputs, scale=sparse_mla.DEFAULT_SCALE, plan=plan)
print(compare(o, out_ref, "bf16_weighted_sum", "seed out", mass).verdict(), "|", compare(l, lse_ref, "lse", "seed lse").verdict())

# %% [markdown]
# **What limits it.** In the ladder's H200 run (§13) this structure's device work alone stays at a few
# percent of the bound on every shape (the next cell; vLLM's own path, timed when the project started, was of
# the same order: `benchmarks/sparse_mla.md`). With T = 64 there are 2·T = 128 gather launches, one per token
# and pool, each of one pool's rows of one token (128 window rows, or the compressed pool's K − 128): at 4 rows
# per single-warp program, each launch occupies a fraction of the 132 SMs for a short while, and the launches run
# one after another. Then every selected row crosses memory three times: its 588 B read, 1024 B of bf16
# written, the same 1024 B read back.

# %%
figures("seed")

# %% [markdown]
# ## 7. Rung 1: the clean two-pass path
#
# The same two passes, without the loop. The index table is one elementwise op per pool (an entry past its
# length or equal to −1 becomes −1, which the reader turns into a zero row and pass 2 into a masked entry),
# pass 1 is **one** gather launch over all T·K entries into a workspace that is reused across calls, and pass 2
# is the fused kernel's own attention loop reading bf16 rows (so the sink, the empty-row rule and the split
# merge are the same code). No host synchronisation: a device graph can capture it.

# %%
print(inspect.getsource(two_pass.two_pass_decode))

# %% [markdown]
# **Why it is faster:** two launches that each fill the GPU instead of 2·T + 1 small ones: several times
# faster than the seed on every shape (the next cell). **What limits it:** the 2640 bytes per row are still
# there, and the attention loop of pass 2 is latency-bound (rung 2 says why). At H 128 that loop is the whole
# story: there the fused kernel of rung 2, which runs the same loop with the dequantisation inside it, is no
# faster than this path.

# %%
figures("two_pass", "seed")
print(f"H 128: the fused kernel (rung 2) is slower than two-pass: {US['fused'][1] > US['two_pass'][1]}")

# %% [markdown]
# ## 8. Rung 2: the fused kernel, walked through
#
# `dsv4ref.sparse_mla.kernels.decode_kernel` runs one program per (token, block of heads, split of the list).
#
# 1. **Q stays resident**: the program loads q for its BLOCK_H heads once ([BLOCK_H, 512]). Heads beyond H
#    (H = 16 run in a block of 64, say) are masked rows: q = 0, sink = −∞, never stored (pitfall #19).
# 2. **Slots, masked**: for a chunk of BLOCK_N entries it loads the slots with `mask = j < length`,
#    other = −1, so entries past the length are never read, not even the slot number.
# 3. **Addresses in int64**: `dsv4ref.tl.page_offsets` turns a slot into the two byte offsets of the 584-byte
#    record (576 data bytes at page_base + off·576, 8 scale bytes at page_base + B·576 + off·8), with
#    page_base = page · page_stride. A page of B tokens is `kv_cache.page_bytes(B)` = 584·B rounded up to a
#    multiple of 576 bytes (B = 64: 37 440), and the kernel takes the stride from `cache.stride(0)`, which may be
#    larger (a view of a bigger buffer). Of a token's 8 scale bytes, 7 are the UE8M0 scales of the 7 NoPE blocks
#    and the 8th is a zero pad that no reader uses (it makes the scales one 8-byte word).
# 4. **Dequantise in registers, 8 tiles of 64** (`load_rows_fp8`): tiles 0..6 are e4m3 bytes × the UE8M0
#    scale 2^(byte − 127) (exact; byte 255 is NaN, as E8M0 defines it), tile 7 is the 64 bf16 RoPE values.
#    Every load is masked by "slot ≥ 0", so a −1 entry or a page holding NaN bytes never reaches the math
#    (0 × NaN would still be NaN: pitfall #12).
# 5. **Scores and online softmax** in fp32 (`attend_pool`): s = q · kᵀ (one dot over 512), masked to −∞, the
#    m/l/acc update of §4 in the log2 domain.
# 6. **The same tile is V**: acc += p · k. Nothing is loaded twice and no bf16 copy of the KV is written.
# 7. Both pools go through the same loop (another base pointer, page size and length).
# 8. **Epilogue** (`finish`): out = acc / l · σ(lse − sink), stored as bf16 with integer round-to-nearest-even;
#    empty rows (l = 0) → 0 and lse = −∞; a poisoned row (l = NaN: a NaN query or a NaN/∞ cache row, §11)
#    → NaN, never the empty-row answer.
#
# Here is the kernel and its helpers, as the library runs them (`.fn` is the Python function under
# `@triton.jit`; `inspect.getsource` of the jit object itself fails in the interpreter), then the three
# byte-level helpers they call: the slot's byte offsets, the e4m3 decode and the UE8M0 scale:

# %%
for kernel in (kernels.decode_kernel, kernels.attend_pool, kernels.load_rows_fp8, kernels.finish):
    print(inspect.getsource(kernel.fn))
for helper in (tl.page_offsets, kernels.e4m3_value, tl.ue8m0_value):
    print(inspect.getsource(helper.fn))
print("page_bytes(B) for B = 1, 2, 16, 64:", [kv_cache.page_bytes(b) for b in (1, 2, 16, 64)])

# %% [markdown]
# **Block sizes.** `SparseMlaLaunch` holds every launch choice, passed as `launch=` (None = the measured
# default). `launch_for_sms` gives the default for a device with a given number of SMs, so this cell shows what
# the H200 (132 SMs) runs on the three benchmark shapes, on any machine. BLOCK_H = 16 heads when H ≤ 16, 32
# when H ≤ 32, else 64 (H = 128 runs two blocks); BLOCK_N = 32 candidates per chunk with 16-head blocks and 64
# with larger ones; 4 warps for 16-head blocks, 8 above; 2 pipeline stages. (In Triton's interpreter the chunk
# is 16 and nothing is split.)

# %%
BENCH = ((64, 64, 640), (64, 128, 1152), (64, 16, 2048))
print(
    f"{'T':>3} {'H':>4} {'K':>5} | {'BLOCK_H':>7} {'BLOCK_N':>7} {'warps':>5} {'stages':>6} {'splits':>6} | "
    f"{'programs unsplit':>16} {'split':>5} | {'acc per program':>16}"
)
for Tb, Hb, Kb in BENCH:
    lb = launch_for_sms(Tb, Hb, Kb, 132)
    progs = Tb * -(-Hb // lb.block_h)
    print(
        f"{Tb:>3} {Hb:>4} {Kb:>5} | {lb.block_h:>7} {lb.block_n:>7} {lb.num_warps:>5} {lb.num_stages:>6} "
        f"{lb.num_splits:>6} | {progs:>16} {progs * lb.num_splits:>5} | {lb.block_h * 512 * 4 // 1024:>11} KB fp32"
    )
print(launch_for_sms(64, 64, 640, 132))

# %% [markdown]
# **What it should buy over two-pass:** 588 bytes per selected row instead of 2640, one launch, no workspace.
# **What it gets:** alone, one program per (token, head block), it is *slower* than rung 1 on every shape of
# the ladder (the next cell); only with the split of rung 3 does it beat rung 1, at H 64 and H 16. **What
# limits it:** it is latency-bound, not bandwidth-bound (a profiler saw neither the issue slots, nor the
# tensor units, nor DRAM near saturation). A 64-head program keeps a 64 × 512 fp32 accumulator: 128 KB,
# about 128 registers per thread at 8 warps before the K tile, q and the dequantisation temporaries, so it
# spills and only one program fits an SM. And every warp runs load → dequantise → QKᵀ → softmax → P·V in
# series: while it waits for the page bytes, no MMA runs, and while it runs MMAs, no bytes arrive. Two cheaper
# fixes were measured and removed as slower (the figures are in `benchmarks/sparse_mla.md`): splitting the 512
# output dims over 2 or 4 programs, each recomputing the scores, and an exact P·V (P as two bf16 halves). And
# with one program per (token, head block), H 64 and H 16 launch only T = 64 programs for 132 SMs (the
# "programs unsplit" column above): an SM with no program is an idle SM. That is rung 3.

# %%
figures("fused", "two_pass")
figures("split", "two_pass")

# %% [markdown]
# ## 9. Rung 3: the split list (flash-decoding)
#
# When T · head blocks would leave SMs idle, the candidate list of each token is split over S programs
# (S a power of two; `launch_for_sms` doubles S while that fills the SMs and every split keeps ≥ 256
# candidates). Split s takes entries `[s·chunk, (s+1)·chunk)` of each pool (chunk = ceil(K / S) rounded up to
# BLOCK_N, per pool) and, instead of finishing, writes its softmax state **without the sink** to two fp32
# scratch tensors, both contiguous:
#
# | tensor | shape | element | holds |
# |---|---|---|---|
# | `part_o` | `[T, S, H, 512]` | fp32 | acc_s = Σ_j 2^(x_j − m_s) · k_j over the split's entries, unnormalised |
# | `part_ml` | `[T, S, H, 2]` | fp32 | (m_s, l_s): m_s = max_j x_j, l_s = Σ_j 2^(x_j − m_s); an empty split has (−∞, 0); a poisoned head (a NaN query, or a counted NaN/∞ row) has l_s = NaN |
#
# with x_j = s_j · log2(e), the log2-domain logit. Head h of split s of token t sits at row (t·S + s)·H + h of
# both. `merge_kernel` (one program per token and 2 heads) computes m = max_s m_s, weighs split s by
# w_s = 2^(m_s − m) (0 for an empty split), sums l = Σ w_s l_s and acc = Σ w_s acc_s, and runs the same
# epilogue once (a NaN l_s survives the sum, even weighed 0: 0 · NaN = NaN, so a NaN query gives a NaN row
# after the merge too, never an empty one, §11): out = acc / l · σ(lse − sink), lse = ln 2 · (m + log2 l). The sink is applied after the
# merge, never per split, and lse stays in one unit until the single exit (pitfall #20).

# %%
print(inspect.getsource(kernels.merge_kernel.fn))

# %% [markdown]
# The same format in a few lines of float64 torch, for token 0 of the example (its window list in 2 splits plus
# its compressed list as a third): write each split's state, merge it as the kernel does, and compare with the
# float64 reference (which, like these lines, does not round P to bf16).


# %%
def split_state(q_t, rows, scale):
    """(acc [H, 512], m [H], l [H]) of one split: the part_o / part_ml entries, log2 domain."""
    x = (q_t @ rows.T) * scale * math.log2(math.e)  # [H, n]
    m = x.max(dim=1).values if rows.shape[0] else torch.full((q_t.shape[0],), -math.inf, dtype=torch.float64)
    p = torch.exp2(x - m[:, None])
    return p @ rows, m, p.sum(dim=1)


q0 = q[0].double()
g1 = kv_cache.gather(
    inputs["cache"], slots[0, : int(lengths[0])][slots[0, : int(lengths[0])] >= 0], block_size=inputs["block_size"]
).double()
es, el = inputs["extra_slots"][0], int(inputs["extra_lengths"][0])
g2 = kv_cache.gather(inputs["extra_cache"], es[:el][es[:el] >= 0], block_size=inputs["extra_block_size"]).double()
parts = [split_state(q0, r, sparse_mla.DEFAULT_SCALE) for r in (g1[: len(g1) // 2], g1[len(g1) // 2 :], g2)]
part_o = torch.stack([p[0] for p in parts])  # [S, H, 512]: this token's slice of part_o
part_ml = torch.stack([torch.stack([p[1], p[2]], dim=-1) for p in parts])  # [S, H, 2]
m = part_ml[..., 0].max(dim=0).values
w = torch.exp2(part_ml[..., 0] - m)  # [S, H]
l_m = (w * part_ml[..., 1]).sum(dim=0)
acc = (w[..., None] * part_o).sum(dim=0)
lse0 = math.log(2) * (m + torch.log2(l_m))
out0 = acc / l_m[:, None] * torch.sigmoid(lse0 - sink.double())[:, None]  # the sink, once, after the merge
print(
    "part_o",
    tuple(part_o.shape),
    "part_ml",
    tuple(part_ml.shape),
    "| per-split m of head 0:",
    [round(float(v), 3) for v in part_ml[:, 0, 0]],
)
out64, lse64 = reference.decode(**inputs, dtype=torch.float64)  # the float64 oracle: P not rounded, as here
print(
    compare(out0, out64[0], "fp32_elementwise", "merged out").verdict(),
    "|",
    compare(lse0, lse64[0], "lse", "merged lse").verdict(),
)

# %% [markdown]
# Scratch bytes at the benchmark shapes (written once, read once by the merge), against the compulsory bytes
# of the op:

# %%
for Tb, Hb, Kb in BENCH:
    S = launch_for_sms(Tb, Hb, Kb, 132).num_splits
    scratch = Tb * S * Hb * (512 + 2) * 4 if S > 1 else 0
    comp = compulsory(Tb, Hb, Kb)
    print(
        f"H={Hb:<3} K={Kb:<5} S={S}: scratch {scratch / 1e6:5.1f} MB written + read, "
        f"compulsory {comp / 1e6:5.1f} MB ({2 * scratch / comp:4.0%} extra traffic)"
    )

# %% [markdown]
# **Why it is faster:** at H 64 the split doubles the programs and at H 16 quadruples them (the block-size
# table of §8), which makes both much faster than unsplit (the next cell, against the `fused[split=1]` rows
# of the same run). H 128 already has two programs of 64 heads per token and does not split. **What limits
# it:** the partial states are big: at H 64 the scratch written and read back is about as many bytes again as
# the compulsory traffic (the cell above); the merge is a second launch; and each program is still the serial
# chain of rung 2: splitting spreads the latency over more SMs, it does not hide it. The fused kernel stays
# far under the floor on every shape.

# %%
figures("split", "fused")

# %% [markdown]
# ## 10. Rung 4: the warp-specialised Hopper kernel
#
# FlashMLA reaches about half of this bound with hand-written FP8 sparse decode on Hopper. Its answer to both
# limits of rung 2 is **warp specialisation**, which Triton 3.6 can express through Gluon
# (`triton.experimental.gluon`: `warp_specialize`, mbarriers, TMA, async warpgroup MMA). The kernel in
# `dsv4ref/sparse_mla/gluon/` (GPU-only: compiled Triton on a Hopper GPU; `backend="auto"` picks it there) is
# built that way. This section gives its design as it runs, then what was measured inside it, what paid, what
# did not, and what is left. The lab journal behind every figure, with its logs, is `benchmarks/sparse_mla.md`.
#
# ### 10a. The design
#
# Two kernels share one structure: producers fill a ring of shared-memory K tiles, consumers run the MMAs, and
# mbarriers pass each stage back and forth (`ready[stage]` when a tile is in, `empty[stage]` when every
# consumer is done with it).
#
# | | 64-row kernel (H > 16) | narrow kernel (H ≤ 16) |
# |---|---|---|
# | one program per | (token, 64 heads, list split); H 128 = two programs | (token, 16 heads, list split) |
# | chunk | 64 candidates | 64 candidates |
# | warps and registers | 12: producer warpgroup (104), scorer warpgroup (the rest, 248), P·V warpgroup (160) | 12: two producer warpgroups (184 each), one MMA warpgroup |
# | shared memory | Q [64, 512], 2 K stages [64, 512], P [2, 64, 64], all bf16: 214.6 KB | Q [16, 512], 3 K stages, Pᵀ [16, 64]: 215.4 KB |
# | QKᵀ | S[64 heads, 64 cand] = Q · Kᵀ, one n = 64 wgmma | Sᵀ[64 cand, 16 heads] = K · Qᵀ, n = 16 |
# | P·V | O[64, 512] += P · V, 256 output dims per warpgroup: 128 fp32 registers each | Oᵀ[512, 16] += Vᵀ · Pᵀ, Vᵀ the same K tile read transposed: 64 registers |
# | programs per SM | 1 | 1 |
#
# * **One program per (token, 64 heads).** wgmma's M is 64 rows per warpgroup, so 64 heads are one MMA tile.
# * **The producer** gathers each chunk's 584-byte rows as int64 words, half a chunk at a time, with the slot
#   indices fetched half a chunk ahead so no index load waits on the critical path. It dequantises
#   e4m3 × 2^(scale − 127) to bf16 and stores the tile into the ring (NVMMA 128-byte swizzle, which wgmma reads
#   directly), then arrives on `ready`.
# * **The scorer** first brings the query into shared memory by `cp.async` while the producer already fetches
#   rows. Per chunk it computes all of S = Q·Kᵀ as one n = 64 wgmma and runs the online softmax inside its own
#   warpgroup, so no row max or sum crosses warpgroups. It hands P (bf16) and the rescale factor α to the
#   second warpgroup through a 2-deep shared buffer (mbarriers `pfull` / `pfree`), and computes its own half of
#   O += P·V.
# * **The P·V warpgroup** only rescales and accumulates the other half. Either way V is the **same tile** as K.
#   Each warpgroup owns **256 of the 512 output dims**, so its accumulator is 64 × 256 fp32 = 128 registers per
#   thread: no spill. Both release the stage on `empty` (two arrivals).
# * **Register budgets per role** (`setmaxnreg`): 512 per thread slot over three warpgroups; the producers
#   need few, the scorer the most.
# * **The list split and the merge of rung 3 stay**, with the same scratch format (fp32 partials, the sink
#   applied once, after the merge).
# * **The epilogue.** Unsplit, the bf16 output leaves through a K stage both consumers have released, as 16-byte
#   row vectors. The accumulator's own register layout would store 4 bytes per thread, rows 8 apart. The
#   query's NaN / ±inf scan runs only after the loop, and only when a head counted no candidate: a non-finite
#   query row already makes every score, hence l, NaN; only an empty row needs the scan to tell NaN from empty.
# * **At H ≤ 16 the products are transposed.** Padding 16 heads to M = 64 would make three quarters of the
#   tensor-core work padding, and the 64 × 512 accumulator would take the registers a second producer needs.
#   With the heads as the MMAs' **N** (which may be as small as 8), the softmax runs down each column. Vᵀ is the
#   same shared K tile read transposed (wgmma reads a bf16 operand from shared memory in either order), and Pᵀ
#   goes through 2 KB of shared memory. Oᵀ takes 64 registers per thread, so two producer warpgroups fit, each
#   dequantising half of every chunk with the next chunk's rows already in flight.
#
# **Why it is faster:** the bytes of chunk i + 1 arrive and are dequantised while the tensor cores work on
# chunk i. The kernel runs at about the slower of the two sides instead of their sum, and the accumulator no
# longer spills.
#
# ### 10b. Where the time goes: time each part alone
#
# A warp-specialised kernel hides one side behind the other, so its total time says little about either side.
# While it was tuned, the kernel took a `DIAG` flag, for timing only (its results were wrong), that removed one part
# at a time: 1 no row loads, 2 no MMAs, 3 neither, 4 no chunks at all, 5 also no query load, 6 also no epilogue
# stores. The flag has left the library (a diagnostic is not a design; it is in git history and its rows in
# `benchmarks/sparse_mla.md`).
# Those readings, a probe of the row gather alone and two profiles set every later step. The readings are
# H200 runs kept in the ladder file under `diagnostics`, each with its log; the next cell prints them.

# %%
diag = ladder["diagnostics"]
roles, fixed, probe = diag["gluon_roles"], diag["gluon_fixed_cost"], diag["gather_probe"]
print(f"µs, T 64, {roles['date']}: {roles['about']}")
print(f"{'what was timed':<50}" + "".join(f"{n:>15}" for n in SHAPE_NAMES))
for row in roles["rows"]:
    print(f"{row['what']:<50}" + "".join(f"{u:>15.1f}" for u in row["us"]))
whole, neither = roles["rows"][0]["us"], roles["rows"][3]["us"]
print("neither, as a share of the whole kernel:", ", ".join(f"{n}: {x / w:.0%}" for n, x, w in zip(SHAPE_NAMES, neither, whole)))
print(
    "each side alone, as a multiple of the whole call's bound:",
    ", ".join(f"{n}: {min(r['us'][i] for r in roles['rows'][1:3]) / bound_us(i):.1f}×" for i, n in enumerate(SHAPE_NAMES)),
)

# %% [markdown]
# * **Each side alone is far off the bound** (well over the whole call's bound, the cell above), and the
#   part that is neither is still a large share of the call. Nsight Compute saw nothing saturated: well under
#   one instruction issued per scheduler per cycle, DRAM at a small fraction of its peak. The kernel is
#   **latency-bound at one program per SM**.
# * **The row gather, timed alone**: as many programs as the decode kernel (one per SM), each fetching random
#   584-byte rows of this cache by `cp.async` into a ring 1 to 4 chunks deep, with 4 to 16 warps. The next
#   cell prints its runs: every random-row variant at that grid reaches about the same fraction of the copy
#   rate, **whatever the bytes in flight**; contiguous rows do a little better; leaving out each row's separate
#   8-byte scale word saves far more time than its share of the bytes; and two or three independent programs
#   per SM, one chunk in flight each, pass the cap. **Independence, not depth, passes the cap**: a program
#   waiting for its oldest copies stalls its own issue. The kernel's producer alone is close to this bare
#   gather's time per chunk, so a deeper ring would not have sped it up.
# * **The fixed cost, taken apart** (DIAG 4 → 5 → 6, the cell after next): at H 128 the query and, most of all,
#   storing the output from the accumulator's register layout; at H 64 the split's fp32 partials and the merge
#   launch.
# * **Per instruction** (Nsight Compute's stall samples, split by partition, H 128): the P·V warpgroup idles
#   most of its time, waiting for the scorer. The scorer waits a little on its own QKᵀ wgmma, a little on the
#   query at the start, and only a little on the producer. What sets the pace at H 128 is the scorer's own
#   chain: QKᵀ → softmax → P → P·V, in series, each step waiting on the one before, per chunk well over
#   the time of its MMAs alone.

# %%
print(f"{probe['date']}: {probe['about']}")
print(f"{'programs × rows':<16} {'rows':<18} {'depth':>5} {'warps':>5} {'µs':>6} {'of copy':>8}")
for r in probe["rows"]:
    print(
        f"{r['programs']:>4} × {r['rows']:<9} {r['rows_order']:<18} {r['depth']:>5} {r['warps']:>5} {r['us']:6.1f} "
        f"{r['fraction_of_copy']:8.1%}"
    )


def probe_range(programs, rows, order, depth=None):
    fr = [
        r["fraction_of_copy"]
        for r in probe["rows"]
        if (r["programs"], r["rows"], r["rows_order"]) == (programs, rows, order) and depth in (None, r["depth"])
    ]
    lo, hi = f"{min(fr):.0%}", f"{max(fr):.0%}"
    return lo if lo == hi else f"{lo}–{hi}"


def probe_us(programs, rows, order, depth, warps):
    return next(
        r["us"]
        for r in probe["rows"]
        if (r["programs"], r["rows"], r["rows_order"], r["depth"], r["warps"]) == (programs, rows, order, depth, warps)
    )


GATHER_RATE = float(
    np.median(
        [r["fraction_of_copy"] for r in probe["rows"] if (r["programs"], r["rows"], r["rows_order"]) == (128, 1152, "random")]
    )
)
print(
    f"one program per SM, 1152 random rows each: {probe_range(128, 1152, 'random')} of copy (median "
    f"{GATHER_RATE:.0%}); contiguous {probe_range(128, 1152, 'contiguous')}; without the scale words "
    f"{probe_range(128, 1152, 'random, no scales')}"
)
saved = 1 - probe_us(128, 1152, "random, no scales", 2, 4) / probe_us(128, 1152, "random", 2, 4)
print(f"the scale words: {formats.SCALE_BYTES / formats.TOKEN_BYTES:.1%} of the bytes, {saved:.0%} of the time")
print(
    f"320 rows each (the H 64 kernel's share): {probe_range(128, 320, 'random')}: the launch and the first "
    f"chunk's round trip weigh on few chunks"
)
print(
    f"two or three programs per SM, one chunk in flight each: {probe_range(256, 576, 'random', 1)}, "
    f"{probe_range(384, 384, 'random', 1)}; two chunks in flight each: {probe_range(256, 576, 'random', 2)}"
)

# %%
print(f"µs, {fixed['date']}: {fixed['about']}")
print(f"{'':<55}" + "".join(f"{n:>15}" for n in SHAPE_NAMES))
for row in fixed["rows"]:
    print(f"{row['what']:<55}" + "".join(f"{u:>15.1f}" for u in row["us"]))
d4, d5, d6 = (row["us"] for row in fixed["rows"])
print(
    "the query (DIAG 4 − 5):",
    " / ".join(f"{x - y:.1f}" for x, y in zip(d4, d5)),
    "µs; the epilogue's stores (DIAG 5 − 6):",
    " / ".join(f"{x - y:.1f}" for x, y in zip(d5, d6)),
    "µs",
)

# %% [markdown]
# ### 10c. What paid, and what did not
#
# Each change was checked against the float64 oracle on the GPU, then timed beside the previous default in the
# same run. These took the kernel to where it is:
#
# | change | what it does | measured (H200) |
# |---|---|---|
# | packed producer | rows kept as int64 words (4 bytes per register, not one byte), a half chunk stored at once | faster at H 64 and H 128 |
# | role-split consumers | one scorer owns QKᵀ and the softmax, instead of both warpgroups splitting every MMA by columns (the softmax's reductions crossing them) | a few % on every shape, in three runs |
# | query loaded by the scorer | the query's `cp.async` runs inside the scorer, while the producer already fetches rows | a little at H 64, nothing elsewhere |
# | narrow kernel | heads as N at H ≤ 16, two producer warpgroups | much faster at H 16 |
# | output staged through shared memory | 16-byte row vectors instead of the accumulator layout's 4-byte pieces | faster at H 128 |
# | the query's scan after the loop | the NaN / ±inf scan only for a head that counted nothing | faster at H 128 |
#
# These were correct and measured no faster, and were removed (the code stays in git's history):
#
# | change | the idea | measured (H200) | why |
# |---|---|---|---|
# | integer dequantisation | `prmt` bytes into bf16 lanes: fewer producer instructions | slower on every shape | the kernel does not wait on the producer's ALU |
# | PTX form of the conversion | fewer conversion instructions | no gain | the same |
# | L2 prefetch of rows ahead | rows asked of L2 2–8 half chunks early, without registers | slower in both forms | the prefetches cost more than they saved |
# | the merge inside the kernel | the last split of a token merges; no second launch | slower at H 64 | only the last splits merge: half the SMs run a serial tail while the others idle; a launch spreads it over all SMs |
# | partials staged as row vectors | the merge launch kept | within noise | the partials cost their bytes, not their layout |
# | scorer on 128 output columns | its freed registers hold the next chunk's QKᵀ, issued behind this P·V | no gain without the overlap, slower with it (H 128) | the chain did not get shorter |
# | the softmax handed to the P·V warpgroup | the scorer starts the next QKᵀ at once | slower at H 128 | the serial chain moved to the other warpgroup, plus a 16 KB hand-off |
# | ping-pong consumers (FlashAttention-3's) | two warpgroups alternating chunks | does not fit | each needs the scorer's registers: two of them and a producer exceed 512 per thread slot |
#
# The figures behind both tables are in `benchmarks/sparse_mla.md`.
#
# ### 10d. Where it stands, and what is left
#
# The latest bench (§13) is printed after this list, against the 35 % floor. Separate runs differ slightly
# (`benchmarks/sparse_mla.md`), so a shape within a point of the floor counts as on it; H 64 is well under it.
#
# * **H 64** is split in two lists, so its fixed cost (launch, query, partials out, the merge launch) is most
#   of the time a call at the floor may take, and the bare gather of its rows at this grid is a large part of
#   the rest (the cell after next). Even chunks at the tensor cores' rate would not bring the call to the
#   floor if the fixed cost stayed in series. What reaches it is a design in which the fixed cost overlaps the
#   chunks, for example a persistent kernel that loads its next work item's query and first rows under this
#   one's epilogue. A cheaper merge does not.
# * **H 128** needs a shorter consumer chain per chunk. Two routes are untried: four consumer warpgroups of 128
#   output columns each, or one program per token across a cluster. Both need a new register and
#   shared-memory plan.
# * **Every shape** would gain from a second, independent producer stream (the gather probe's lesson). It needs
#   a leaner producer first: the registers are spent.

# %%
figures("gluon", "split")
print(
    "at the floor (within a point):",
    ", ".join(f"{n}: {bound_us(i) / US['gluon'][i] >= FLOOR - 0.01}" for i, n in enumerate(SHAPE_NAMES)),
)

# %%
# H 64 against the floor: the time a call at 35 % of the bound may take, and what is spent before any chunk.
i64 = SHAPE_NAMES.index("H 64 K 640")
sh = ladder["shapes"][i64]
target = bound_us(i64) / FLOOR
fixed64 = fixed["rows"][0]["us"][i64]  # DIAG 4: no chunks at all
rows_per_program = sh["K"] // sh["splits"]
gather64 = [r["us"] for r in probe["rows"] if (r["programs"], r["rows"], r["rows_order"]) == (128, rows_per_program, "random")]
chunks = rows_per_program // 64
chunk_mma_us = 2 * 64 * 64 * 2 * formats.HEAD_DIM / (peak / 132) * 1e6  # QKᵀ and P·V of one 64-row chunk, one SM
print(
    f"H 64: a call at the floor takes {target:.1f} µs; the fixed cost (no chunks) is {fixed64:.1f} µs, "
    f"{fixed64 / target:.0%} of it"
)
print(f"the bare gather of {rows_per_program} random rows per program: {min(gather64):.1f}–{max(gather64):.1f} µs")
print(
    f"{chunks} chunks at the tensor cores' rate: {chunks} × {chunk_mma_us:.2f} µs; with the fixed cost in series "
    f"{fixed64 + chunks * chunk_mma_us:.1f} µs: reaches the floor: {fixed64 + chunks * chunk_mma_us <= target}"
)

# %% [markdown]
# Two lessons carry over to any port. Time the memory pattern alone, at your kernel's grid, before designing a
# pipeline for it: the roofline's copy rate is not what random 584-byte rows at one program per SM get. And
# time the fixed cost against the whole budget before optimising the loop: at H 64 it is most of the budget.
#
# A schematic of the difference between rungs 2 and 4 (not a measurement):

# %%
fig, axes = plt.subplots(2, 1, figsize=(10, 3.2), sharex=True)
steps = [("load + dequantise", 3.0, "tab:orange"), ("QKᵀ + softmax + P·V", 2.0, "tab:blue")]
t0 = 0.0
for i in range(4):  # rung 2: one warp does everything in series
    for name, dur, color in steps:
        axes[0].barh(0, dur, left=t0, color=color, edgecolor="white", label=name if i == 0 else None)
        t0 += dur
for i in range(4):  # rung 4: producers and consumers overlap; the slower side sets the pace
    axes[1].barh(1, 3.0, left=3.0 * i, color="tab:orange", edgecolor="white")
    axes[1].barh(0, 2.0, left=3.0 * (i + 1), color="tab:blue", edgecolor="white")
axes[0].set_yticks([0], ["every warp"])
axes[1].set_yticks([0, 1], ["consumer warpgroups", "producer warps"])
axes[0].set_title("rung 2: in series per chunk (4 chunks)")
axes[1].set_title("rung 4: warp-specialised, a ring of shared-memory stages between the roles")
axes[1].set_xlabel("time (arbitrary units)")
axes[0].legend(fontsize=8, loc="upper right")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 11. The checks: every rung against the reference
#
# Every rung on the example of §1 (both pools, −1 holes, duplicates, partial lengths, a finite sink), under the
# tolerances of `dsv4ref.tolerances`: lse with FlashMLA's figure; out with `bf16_weighted_sum`. Compiled, the
# kernels round P to bf16 before P·V (as FlashMLA does), an error of up to 2^-9 per weight, so an output's
# error scales with Σ_j p_j·|v_j| — its "mass" — not with the output itself, which can cancel to near zero.
# The reference gives that mass alongside its result (`with_mass=True`). The launch shape is an explicit
# argument: the last line splits the list in 4 (rung 3 in the interpreter), starting from the default launch for
# T tokens, H heads and K1 + K2 candidates per token (both pools: the split divides the whole list).

# %%
rungs = {
    "seed (rung 0)": lambda: two_pass.seed_decode(**inputs, scale=sparse_mla.DEFAULT_SCALE),
    "two_pass (rung 1)": lambda: sparse_mla.decode(**inputs, backend="two_pass"),
    "triton (rung 2)": lambda: sparse_mla.decode(**inputs, backend="triton"),
    "triton, split in 4 (rung 3)": lambda: sparse_mla.decode(
        **inputs, backend="triton", launch=dataclasses.replace(sparse_mla.default_launch(T, H, K1 + K2, DEVICE), num_splits=4)
    ),
}
for name, run in rungs.items():
    o, l = run()
    print(
        f"{name:<28}",
        compare(o, out_ref, "bf16_weighted_sum", "out", mass).verdict(),
        "|",
        compare(l, lse_ref, "lse", "lse").verdict(),
    )

# %%
# Empty rows and poisoned memory: row 0 has length 0, row 1 only -1 entries; every entry past a length
# points at slot 0, whose bytes we overwrite with NaN codes. No NaN may come out: rows past a length are
# never read.
b1 = inputs["block_size"]
c_bad = inputs["cache"].clone()
c_bad[0, :576] = 0x7F
c_bad[0, b1 * 576 : b1 * 576 + 8] = 0xFF
s_bad = slots.clone()
s_bad[1, :] = -1
l_bad = torch.tensor([0, 16, 9], dtype=torch.int32).to(DEVICE)
for t in range(T):
    s_bad[t, int(l_bad[t]) :] = 0
for backend in sparse_mla.SUPPORTED_BACKENDS:
    o, l = sparse_mla.decode(q, c_bad, s_bad, l_bad, block_size=b1, sink=sink, backend=backend)
    print(
        f"{backend:>9}: NaN in out: {bool(torch.isnan(o).any())}; empty rows zero: {bool((o[:2] == 0).all())}; "
        f"their lse: {sorted(set(l[:2].flatten().cpu().tolist()))}; row 2 finite: {bool(torch.isfinite(l[2]).all())}"
    )

# %% [markdown]
# **A NaN is never an empty row.** A query holding a NaN is refused while value checks are on (the default:
# one device sync per call). With them off (`DSV4REF_CHECK_VALUES=0`, the hot path; here the context manager
# `validate.checking_values(False)`), every backend writes out = NaN and lse = NaN for exactly that
# (token, head), also when the token has no valid candidate, whose honest answer would otherwise be the
# empty row's (0, −∞). The kernels get there without a branch in the loop: a NaN query sets the softmax sum
# l to NaN, and the epilogue treats only l == 0 as empty. The whole input contract is in
# `docs/sparse_mla.md#input-contract`.

# %%
q_nan = q.clone()
q_nan[1, 3, 7] = float("nan")
try:
    sparse_mla.decode(**{**inputs, "q": q_nan})
except ValueError as e:
    print("checks on:", str(e))
empty = {
    **inputs,
    "q": q_nan,
    "lengths": torch.zeros_like(lengths),
    "extra_lengths": torch.zeros_like(inputs["extra_lengths"]),
}  # no token has a valid candidate
with validate.checking_values(False):
    for backend in sparse_mla.SUPPORTED_BACKENDS:
        o, l = sparse_mla.decode(**empty, backend=backend)
        print(
            f"checks off, {backend:>9}: head (1, 3) out NaN: {bool(o[1, 3].isnan().all())}, lse {float(l[1, 3])}; "
            f"the other rows: out 0 {bool((o[~l.isnan()] == 0).all())}, lse {sorted(set(l[~l.isnan()].tolist()))}"
        )

# %% [markdown]
# ## 12. Bytes moved: two-pass against fused
#
# Per selected row, the fused kernel reads the 584-byte record and its 4-byte slot once: 588 bytes. The
# two-pass paths read the same 588 bytes, **write** a 1024-byte bf16 row to the workspace and **read it
# back** with its slot: 2640 bytes, 4.5× more, plus a second launch (§5's cell computes both). In a memory-bound op that is
# the whole story.


# %%
def traffic(T, H, K, per_row):
    """Bytes per call with `per_row` bytes per selected row (the rest as in `compulsory`)."""
    return compulsory(T, H, K) + T * K * (per_row - ROW_FUSED)


shapes = [("V4-Flash\nH=64 K=640", 64, 640), ("V4-Pro\nH=128 K=1152", 128, 1152), ("TP/memory-bound\nH=16 K=2048", 16, 2048)]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
ax = axes[0]
parts_b = [
    ("read FP8 record + slot", ROW_FUSED, ROW_FUSED),
    ("write bf16 workspace", 0, ROW_BF16),
    ("read bf16 workspace", 0, ROW_BF16),
]
bottom = np.zeros(2)
for name, fused_b, two_b in parts_b:
    vals = np.array([fused_b, two_b])
    ax.bar(["fused", "two-pass"], vals, bottom=bottom, label=name)
    bottom += vals
ax.set_ylabel("bytes per selected row")
ax.set_title(f"per row: {ROW_FUSED} vs {ROW_TWO_PASS} bytes")
ax.legend(fontsize=8)
ax = axes[1]
xs = np.arange(len(shapes))
ax.bar(xs - 0.2, [traffic(64, h, k, ROW_FUSED) / 1e6 for _, h, k in shapes], 0.4, label="fused")
ax.bar(xs + 0.2, [traffic(64, h, k, ROW_TWO_PASS) / 1e6 for _, h, k in shapes], 0.4, label="two-pass")
ax.set_xticks(xs, [s[0] for s in shapes], fontsize=8)
ax.set_ylabel("MB per call (T = 64)")
ax.set_title("traffic per decode step of one layer")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
for name, h, k in shapes:
    print(
        f"{name.replace(chr(10), ' '):<30} fused {traffic(64, h, k, ROW_FUSED) / 1e6:6.1f} MB, "
        f"two-pass {traffic(64, h, k, ROW_TWO_PASS) / 1e6:6.1f} MB, "
        f"FLOP/byte (fused) {64 * 2 * h * k * 1024 / traffic(64, h, k, ROW_FUSED):5.0f}"
    )

# %% [markdown]
# ## 13. The roofline: every rung, measured on an H200
#
# The figures come from one file, `benchmarks/sparse_mla_ladder.json`: the µs of every rung on the three
# shapes, the ceilings (copy bandwidth, bf16 matmul rate) and the compulsory bytes and FLOPs of each shape.
# `python -m dsv4ref bench sparse_mla` times every rung on the same inputs (bench cases `sparse_mla.seed`,
# `.two_pass`, `.fused[split=1]`, `.fused`, `.gluon`, and the torch reference under `torch.compile`), and
# `python -m dsv4ref bench --ladder benchmarks/sparse_mla_ladder.json` rewrites the file from that one run. This
# notebook times nothing: it draws the file, so its output is the same on every machine. A rung marked
# "pending" has no figure yet for that shape; each rung names its source. Its `diagnostics` entry (§10b) holds
# figures from other H200 runs, each naming its log.
#
# The x axis is the arithmetic intensity (FLOP per compulsory byte; the same for every rung of a shape,
# since every rung does the same useful work), the y axis the achieved FLOP rate. A point on the roof would
# be at 100 % of the bound.
#
# The dashed roof under it is what the gather itself reaches at these kernels' grid, measured alone (§10b's
# probe, one program per SM, random rows): the median of those runs, `GATHER_RATE`, read from the same file.
# It is a property of the access pattern on this device, not a ceiling a kernel can raise by buffering more;
# the bound keeps the copy rate.

# %%
print(
    f"{ladder['device']}, {ladder['date']}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s; "
    f"ridge at {peak / bw:.0f} FLOP/byte"
)
print("accounting:", ladder["accounting"])

# %%
markers = dict(seed="v", two_pass="s", fused="D", split="o", gluon="*", torch_compile="x")
colors = dict(
    seed="tab:gray", two_pass="tab:brown", fused="tab:orange", split="tab:blue", gluon="tab:green", torch_compile="tab:purple"
)
fig, axes = plt.subplots(1, 2, figsize=(12, 6.2), gridspec_kw=dict(width_ratios=[1.25, 1]))
ax = axes[0]
ai = np.logspace(1, 3, 200)
ax.loglog(ai, np.minimum(ai * bw, peak) / 1e12, color="black", lw=1.2, label="roof: min(AI · copy BW, bf16 peak)")
ax.loglog(
    ai,
    np.minimum(ai * bw * GATHER_RATE, peak) / 1e12,
    color="black",
    lw=0.8,
    ls="--",
    label=f"the gather alone, measured (§10b): {GATHER_RATE:.0%} of copy BW",
)
for sh in ladder["shapes"]:
    x = sh["flops"] / sh["bytes"]
    ax.axvline(x, color="grey", lw=0.4, ls=":")
    ax.annotate(f"H {sh['H']}, K {sh['K']}", (x, 1.2), rotation=90, fontsize=7, ha="right", va="bottom", color="grey")
for r in ladder["rungs"] + ladder["others"]:
    pts = [
        (sh["flops"] / sh["bytes"], sh["flops"] / (us * 1e-6) / 1e12)
        for sh, us in zip(ladder["shapes"], r["us"])
        if us is not None
    ]
    label = r["label"] + ("" if r["status"] == "measured" else f" ({r['status']})")
    if pts:
        ax.scatter(*zip(*pts), marker=markers[r["key"]], color=colors[r["key"]], s=45, label=label, zorder=3)
    else:
        ax.scatter([], [], marker=markers[r["key"]], color=colors[r["key"]], label=label)
ax.set_xlabel("arithmetic intensity (FLOP per compulsory byte)")
ax.set_ylabel("achieved TFLOP/s")
ax.set_ylim(1, 2 * peak / 1e12)
ax.set_title("sparse MLA decode, T = 64: the ladder on the roofline")
ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
ax = axes[1]
width = 0.8 / len(ladder["rungs"])
for i, r in enumerate(ladder["rungs"]):
    frac = [
        0 if us is None else max(sh["bytes"] / bw, sh["flops"] / peak) / (us * 1e-6) for sh, us in zip(ladder["shapes"], r["us"])
    ]
    ax.bar(np.arange(3) + (i - 2) * width, np.array(frac) * 100, width, color=colors[r["key"]], label=r["key"])
ax.axhline(FLASHMLA * 100, color="black", lw=0.6, ls="--")
ax.text(2.45, FLASHMLA * 100 + 1, "FlashMLA's level", fontsize=7, ha="right")
ax.axhline(FLOOR * 100, color="black", lw=0.6, ls=":")
ax.text(2.45, FLOOR * 100 + 1, "the floor", fontsize=7, ha="right")
ax.set_xticks(range(3), [f"H {s['H']}\nK {s['K']}" for s in ladder["shapes"]], fontsize=8)
ax.set_ylabel("% of the bound")
ax.set_ylim(0, 60)
ax.set_title("fraction of max(bytes / BW, FLOP / peak)")
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %%
print(f"{'rung':<14} {'shape':<14} {'µs':>7} {'TFLOP/s':>8} {'TB/s':>6} {'of bound':>9} {'vs last rung':>13}")
prev = [None, None, None]
for r in ladder["rungs"] + ladder["others"]:
    for i, (sh, us) in enumerate(zip(ladder["shapes"], r["us"])):
        shape = f"H {sh['H']} K {sh['K']}"
        if us is None:
            print(f"{r['key']:<14} {shape:<14} {r['status']:>7}")
            continue
        bound = max(sh["bytes"] / bw, sh["flops"] / peak)
        gain = f"{prev[i] / us:5.2f}×" if prev[i] and r in ladder["rungs"] else ""
        print(
            f"{r['key']:<14} {shape:<14} {us:7.1f} {sh['flops'] / us / 1e6:8.1f} {sh['bytes'] / us / 1e6:6.2f} "
            f"{bound / (us * 1e-6):9.1%} {gain:>13}"
        )
        if r in ladder["rungs"]:
            prev[i] = us
for r in ladder["rungs"] + ladder["others"]:
    print(f"- {r['key']}: {r['source']}")

# %% [markdown]
# ## 14. From the seed to FlashMLA's level: what each rung teaches
#
# * **Rung 0 → 1: launches and host syncs first.** Nothing about the math changed; 2·T tiny launches and a
#   host loop became two full-width launches. A kernel developer looks at the launch count before the kernel.
# * **Rung 1 → 2: bytes.** Fusing the dequantisation into the attention loop cut 2640 B per row to 588 and
#   removed the workspace. That only pays where the loop is near the memory roof (H 16, and H 64 with the
#   split); at H 128 the loop itself was the limit.
# * **Rung 2 → 3: occupancy.** T × head blocks programs is often less than one per SM; splitting the list
#   (flash-decoding) buys programs at the price of fp32 partials and a merge. The merge must apply the sink
#   once and keep lse in one unit.
# * **Rung 3 → 4: latency.** A warp that loads, dequantises, multiplies and reduces in series waits most of the
#   time, and a 64 × 512 fp32 accumulator in one warpgroup spills. Give the loads and the dequantisation to
#   producer warps, the MMAs to two consumer warpgroups that each own half the output dims, and connect them
#   with a ring of shared-memory stages and mbarriers: the roles overlap, and the kernel runs at the pace of
#   the slower one. Then make each side fast on its own (the gather at the rate its access pattern allows,
#   measured alone; wide MMAs and few barriers for the consumer): that is the distance between rung 4 and
#   FlashMLA's level.
# * **Inside rung 4: shape the MMAs to the problem, and time what is not the loop.** At H 16, padding the heads
#   to M = 64 wasted the tensor cores and the registers; making them N freed both. At one program per SM the
#   prologue and epilogue are not hidden behind other programs: at H 128 the output's stores were the largest
#   part of the fixed cost (§10b) until they left as whole row vectors.
# * **Do not move work into a tail.** Work that runs once per program at the end (an in-kernel merge done by
#   the last split) runs on as many SMs as there are last programs; a separate launch gives the same bytes to
#   every SM. Measure the fixed cost against the whole budget before optimising it: at H 64 it is most of it
#   (§10d).
#
# On a GPU the next cell times every rung itself (it is skipped on the CPU, where Triton is interpreted).

# %%
# NBVAL_IGNORE_OUTPUT
if not dsv4ref.interpreting():
    from dsv4ref.tools.harness import run_benches

    ceil, rows = run_benches("sparse_mla")
    print(f"copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 {ceil.bf16_flops_per_s / 1e12:.0f} TFLOP/s")
    for r in rows:
        print(
            f"{r.case.op:<26} {r.case.shape:<32} {r.ms * 1e3:8.1f} us {r.bytes_per_s / 1e9:7.0f} GB/s "
            f"{r.flops_per_s / 1e12:6.1f} TFLOP/s {r.fraction:7.1%} of bound"
        )
else:
    print("interpreting: no timings on the CPU")
