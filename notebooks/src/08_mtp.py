# %% [markdown]
# # 08 · Multi-token prediction: the draft layer, verification, and why greedy output cannot change
#
# DeepSeek-V4 ships one layer more than it uses for the next token: the **MTP layer**. At position q it reads
# the target's last hidden state and the token at q + 1, and guesses the token at q + 2. A serving engine
# uses it as a *draft model*: guess k tokens with the cheap layer, then let the big model check all k in
# **one** step, k + 1 rows per request. This notebook:
#
# 1. builds the draft layer's input and head, and checks the two things that are easy to get wrong
#    (a norm per stream, a projection broadcast to every stream);
# 2. runs one round of speculation on the tiny model and draws the verification row by row;
# 3. measures the acceptance rate on the tiny model;
# 4. shows why speculation cannot change greedy output, and checks it token for token.
#
# Facts and pitfalls: [`docs/mtp.md`](../docs/mtp.md). Code: `dsv4ref/mtp/` (the draft layer's pieces and
# `greedy_accept`) and `dsv4ref/decode/speculation.py` (`Decoder.draft`, `verify`, `speculate`). Everything here runs
# the plain-torch backend, so the numbers are the same on every machine.

# %%
import dsv4ref  # noqa: F401  (first: picks the device, sets TRITON_INTERPRET on a CPU-only machine)
import warnings

warnings.filterwarnings("ignore")
import numpy as np

np.seterr(all="ignore")
import matplotlib.pyplot as plt

# %matplotlib inline
import inspect
import math

import torch

from dsv4ref import decode, mtp
from dsv4ref.config import TINY
from dsv4ref.device import DEVICE, describe
from dsv4ref.testing import assert_close, randn

# %%
# NBVAL_IGNORE_OUTPUT
print(describe())

# %% [markdown]
# ## 1. The draft layer
#
# The inputs of a draft row at position q are the target's **pre-hc_head residual** at q, all M = 4 mHC
# streams `h_prev [M, Hd]`, and the token at q + 1. The embedding and the LM head are the target's own; the
# MTP brings `e_proj`, `h_proj`, three norms, one full V4 block (window attention only, MoE) and its own
# hc head:
#
# $$X_m = h_\text{proj}\big(\text{RMSNorm}(h_m)\cdot w_h\big) + e_\text{proj}\big(\text{RMSNorm}(\text{embed}(t_{q+1}))\cdot w_e\big),\qquad m = 0..M-1$$
#
# then `X = Block(X)`, `logits = lm_head(RMSNorm(HCHead(X)) · norm)`, `draft = argmax(logits)`.

# %%
fig, ax = plt.subplots(figsize=(11, 3.6))
ax.axis("off")
ax.set_xlim(0, 11)
ax.set_ylim(0, 4.2)


def box(x, y, w, h, text, color="#e8e8e8"):
    ax.add_patch(plt.Rectangle((x, y), w, h, color=color))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5)


def arrow(x0, y0, x1, y1):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle="->", lw=0.8))


for m in range(4):  # the four streams of h_prev, each normed and projected on its own
    y = 3.3 - 0.55 * m
    box(0.1, y, 1.3, 0.42, f"h_prev[{m}]", "#cfe3f7")
    box(1.8, y, 1.5, 0.42, "hnorm (per stream)", "#cfe3f7")
    box(3.7, y, 1.1, 0.42, "h_proj", "#cfe3f7")
    box(5.4, y, 0.5, 0.42, "+")
    arrow(1.4, y + 0.21, 1.8, y + 0.21)
    arrow(3.3, y + 0.21, 3.7, y + 0.21)
    arrow(4.8, y + 0.21, 5.4, y + 0.21)
    arrow(5.9, y + 0.21, 6.3, 2.4)
box(0.1, 0.3, 1.3, 0.5, "embed(t[q+1])\nshared", "#fde0c5")
box(1.8, 0.3, 1.5, 0.5, "enorm (0 if q = 0)", "#fde0c5")
box(3.7, 0.3, 1.1, 0.5, "e_proj", "#fde0c5")
arrow(1.4, 0.55, 1.8, 0.55)
arrow(3.3, 0.55, 3.7, 0.55)
for m in range(4):  # e_proj(e) is broadcast: added to every stream
    arrow(4.8, 0.55, 5.65, 3.3 - 0.55 * m)
box(6.3, 1.9, 1.5, 1.0, "V4 block\n(SWA attention,\nMoE, own KV)", "#d9ead3")
box(8.1, 1.9, 1.2, 1.0, "own hc_head\n+ own norm", "#d9ead3")
box(9.6, 1.9, 1.3, 1.0, "lm_head\n(shared)\n→ argmax", "#fde0c5")
arrow(7.8, 2.4, 8.1, 2.4)
arrow(9.3, 2.4, 9.6, 2.4)
ax.set_title("the MTP draft layer: per-stream h path (blue), broadcast embedding path (orange)", fontsize=10)
plt.show()

# %% [markdown]
# The two lines that build X, as the library writes them (the float64 version is the tests' oracle):

# %%
print(inspect.getsource(mtp.reference.draft_input))

# %% [markdown]
# Two checks with the tiny model's MTP weights. With `h_proj = 0` every stream is the same
# `e_proj(enorm(e))` (the broadcast); with `e_proj = 0`, scaling the four input streams by 1, 4, 1/4 and 64
# changes nothing, because each stream is normed on its own. A norm over the flattened M·Hd (pitfall P14)
# would shrink the small streams next to the big one.

# %%
w = decode.make_weights(TINY, 0, device=DEVICE)
wm = w["mtp"]
M, Hd = TINY.hc_mult, TINY.hidden_size
h = randn((3, M, Hd), seed=1, device=DEVICE, block=None, octaves=4)
e = w["embed"][torch.tensor([5, 6, 7], device=DEVICE)]
pos = torch.tensor([10, 11, 12], device=DEVICE)
zero = torch.zeros(Hd, Hd, dtype=torch.bfloat16, device=DEVICE)
X = mtp.draft_input(h, e, pos, wm["enorm"], wm["hnorm"], wm["e_proj"], zero, eps=TINY.rms_norm_eps)
print("h_proj = 0: all 4 streams equal:", all(torch.equal(X[:, m], X[:, 0]) for m in range(M)))
scaled = (h.float() * torch.tensor([1.0, 4.0, 0.25, 64.0], device=DEVICE)[None, :, None]).to(torch.bfloat16)
a = mtp.draft_input(h, e, pos, wm["enorm"], wm["hnorm"], zero, wm["h_proj"], eps=TINY.rms_norm_eps)
b = mtp.draft_input(scaled, e, pos, wm["enorm"], wm["hnorm"], zero, wm["h_proj"], eps=TINY.rms_norm_eps)
print("e_proj = 0: per-stream scales change nothing:", assert_close(b, a, "bf16_out").verdict())
X = mtp.draft_input(h, e, pos, wm["enorm"], wm["hnorm"], wm["e_proj"], wm["h_proj"], eps=TINY.rms_norm_eps)
hc = wm["hc_head"]
logits = mtp.draft_logits(X, hc["fn"], hc["scale"], hc["base"], wm["norm"], w["lm_head"], backend="reference")
print("X", tuple(X.shape), X.dtype, "-> logits", tuple(logits.shape), logits.dtype)
print("the MTP weights hold no embedding and no LM head of their own:", sorted(k for k in wm if k != "block"))

# %% [markdown]
# ## 2. One round of speculation, drawn
#
# Two requests (prompts of 24 and 9 random tokens) are prefilled. `next` is each request's next input: the
# argmax of its last logits, not in the caches yet. Then:
#
# * **draft**: the MTP reads every verified position it has not seen (here the whole prompt: its own window
#   cache gets their KV); its last row's argmax is draft 1; drafts 2 and 3 chain, feeding the MTP its own
#   output X as the next `h_prev`;
# * **verify**: the target runs the 4 rows `[next, d1, d2, d3]` of each request as rows of ONE decode call.
#   Row j's argmax is the target's choice for the position draft j+1 claims. Emitted: the target's tokens up
#   to the first disagreement (or all 4, the last one the *bonus* token).

# %%
# NBVAL_IGNORE_OUTPUT
# (the token ids of a random tiny model follow the device's bf16 GEMMs: a near-tie can flip on a GPU; the
# rules they obey are checked, device-independently, in the next cell)
dec = decode.Decoder(TINY, w, num_requests=2, capacity=64, backend="reference")
g = torch.Generator().manual_seed(8)
prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=g) for n in (24, 9)]
nxt = dec.prefill(prompts).argmax(-1)
rounds = []
for _ in range(3):
    L = dec.lengths.clone()
    sp = dec.speculate(nxt, k=3)
    rounds.append((L, sp))
    nxt = sp.next
for i, (L, sp) in enumerate(rounds):
    for r in range(2):
        print(
            f"round {i} request {r}: positions {int(L[r])}..{int(L[r]) + 3}  drafts {sp.drafts[r].tolist()}  "
            f"target {sp.target[r].tolist()}  accepted {int(sp.accepted[r])}  emitted {sp.emitted[r].tolist()}"
        )


# %%
def obeys_the_rule(sp, r):
    """emitted = the target's tokens up to the first disagreement: the drafts before it match the target."""
    m = int(sp.accepted[r])
    return sp.drafts[r, :m].tolist() == sp.target[r, :m].tolist() and sp.emitted[r].tolist() == sp.target[r, : m + 1].tolist()


print(
    "every round, every request: emitted = the target's own tokens up to the first disagreement:",
    all(obeys_the_rule(sp, r) for _, sp in rounds for r in range(2)),
)

# %%
fig, axes = plt.subplots(1, len(rounds), figsize=(12, 2.9))
for ax, (i, (L, sp)) in zip(axes, enumerate(rounds)):
    r = 0
    k = sp.drafts.shape[1]
    inputs = [int(dec.tokens[r, int(L[r])])] + sp.drafts[r].tolist()  # [next, d1, d2, d3]
    ax.axis("off")
    ax.set_xlim(0, 4.2)
    ax.set_ylim(-0.6, k + 1.4)
    for j, head in enumerate(["row input", "target argmax", "next draft", "verdict"]):
        ax.text(0.5 + j, k + 1, head, ha="center", fontsize=8, weight="bold")
    m = int(sp.accepted[r])
    for j in range(k + 1):
        y = k - j
        claim = sp.drafts[r, j].item() if j < k else None
        if j < m:
            verdict, color = "match", "#d9ead3"
        elif j == m:
            verdict, color = ("bonus" if m == k else "reject: emit target"), "#fde0c5"
        else:
            verdict, color = "discarded", "#eeeeee"
        ax.add_patch(plt.Rectangle((0.02, y - 0.4), 4.1, 0.8, color=color))
        ax.text(0.5, y, str(inputs[j]), ha="center", va="center", fontsize=8.5)
        ax.text(1.5, y, str(int(sp.target[r, j])), ha="center", va="center", fontsize=8.5, weight="bold" if j <= m else None)
        ax.text(2.5, y, "-" if claim is None else str(claim), ha="center", va="center", fontsize=8.5)
        ax.text(3.5, y, verdict, ha="center", va="center", fontsize=8)
    ax.set_title(f"round {i}, request 0: {m} of {k} accepted, {m + 1} emitted", fontsize=9)
plt.suptitle("verification rows [next, d1, d2, d3]: bold = emitted (the target's own tokens)", fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# After a round, the request's length advances by `accepted + 1`. The rejected rows wrote KV into the window,
# compressed and indexer pools: those are addressed by position, so they are rewritten when the positions are
# decoded again and nobody reads past a length meanwhile. The compressor's **ring** is different (token p
# lives in row p % n and evicts p − n, which a later boundary still reads), so `verify` saves the ring rows it
# overwrites and puts back those of rejected tokens (`docs/compressor.md`, pitfall C7).

# %%
# NBVAL_IGNORE_OUTPUT
# (the lengths follow the accepted counts, which follow the device's arithmetic, as above)
print("lengths after the 3 rounds:", dec.lengths.tolist(), " (prompts 24 and 9, plus the emitted tokens)")
print("positions the draft layer has read:", dec.mtp_done.tolist())

# %% [markdown]
# ## 3. The acceptance rate on the tiny model
#
# Random weights would draft at chance (1 in 512). The tiny model's MTP is *built* to guess what a trained
# one approximates for this target: `e_proj` is the identity and the target's residual stream is dominated by
# the current token's embedding, so the draft is the target's "bigram" guess (`docs/mtp.md#the-teaching-weights`).
# `run_speculative` decodes until every request has 12 new tokens, 2 drafts per round:

# %%
# NBVAL_IGNORE_OUTPUT
# (how many drafts a random tiny model gets right follows the device's bf16 GEMMs at near-ties)
spec, _, _, _ = decode.run_speculative(TINY, steps=12, k=2, prompt_lens=(24, 9), decode_backend="reference")
s = spec.spec
print(f"{s.rounds} rounds x 2 requests: {s.accepted} of {s.drafted} drafts accepted, acceptance rate {s.rate:.0%}")
print(
    f"{s.emitted} tokens emitted in {s.rounds} target steps: {s.emitted / (2 * s.rounds):.2f} tokens per request "
    "per step (plain decoding: 1.00)"
)

# %% [markdown]
# With acceptance rate α per draft and k drafts, a round emits on average $1 + α + α^2 + … + α^k$ tokens per
# target step (if acceptances were independent). A memory-bound decode step reads the weights and caches
# once per step, whatever the rows, so that is close to the speed-up. A trained V4 MTP is far better than
# this toy; the curve shows why k stays small:

# %%
alpha = np.linspace(0, 1, 101)
fig, ax = plt.subplots(figsize=(6, 3.2))
for k in (1, 2, 3, 5):
    ax.plot(alpha, sum(alpha**i for i in range(k + 1)), label=f"k = {k}")
ax.axvline(s.rate, color="gray", ls=":", lw=1)
ax.text(s.rate + 0.01, 5.2, "tiny model", fontsize=8, color="gray")
ax.set_xlabel("acceptance rate per draft α")
ax.set_ylabel("tokens per target step")
ax.legend(fontsize=8)
ax.set_title("expected tokens per verification step", fontsize=10)
plt.show()

# %% [markdown]
# ## 4. Why speculation cannot change greedy output
#
# Every token speculation emits is some row's argmax $a_j$: the **target's own** greedy choice at position
# L + j + 1, computed from the tokens at positions ≤ L + j. For the emitted rows those tokens are the accepted
# ones, which (by induction over the rounds) are exactly what plain greedy decoding put there. A wrong draft
# only ends the round early; it never becomes a token. So the two runs must agree token for token. The only
# possible difference is numerical: the verification step batches k + 1 rows where plain decoding has one,
# so a bf16 activation can differ by an ulp, which could flip an argmax only at a near-tie of the top-2 logits
# (closer than the bf16 resolution of the activations that make them). Where the runs differ, the cell says
# whether the plain run's top-2 logits were that close at the first difference.
#
# Plain greedy decoding of the same prompts, 12 tokens, against the speculative run above:

# %%
# NBVAL_IGNORE_OUTPUT
# (the token ids and where a near-tie falls follow the device's arithmetic; the verdict is checked below)
plain, _, recs, _ = decode.run(TINY, steps=12, prompt_lens=(24, 9), decode_backend="reference")
verdicts = []
for r, n in enumerate((24, 9)):
    want = plain.tokens[r, n : n + 12].tolist()
    got = spec.generated[r][:12]
    print(f"request {r}: plain       {want}")
    print(f"           speculative {got}   {'identical' if got == want else 'DIFFERENT'}")
    near_tie = None
    if got != want:  # only at a near-tie: the plain run's top-2 logits closer than one bf16 ulp of the largest
        first = next(i for i in range(12) if got[i] != want[i])
        top2 = recs[first][2][r].double().topk(2).values
        ulp = 2.0 ** (math.floor(math.log2(float(top2[0].abs()))) - 7)
        near_tie = float(top2[0] - top2[1]) < ulp
        print(f"           first difference at token {first}: top-2 logits closer than a bf16 ulp: {near_tie}")
    verdicts.append(got == want or near_tie)

# %%
print("each request: identical to plain greedy decoding, or first different at a near-tie:", all(verdicts))

# %% [markdown]
# **Takeaways.** The draft layer is one V4 block on the target's last residual (per-stream hnorm, `h_proj` per
# stream, `e_proj` broadcast) with its own head and norm and the target's embedding and LM head. Greedy
# verification keeps the agreeing prefix of the drafts and the target's token where they first disagree, so
# it emits exactly what plain greedy decoding emits; the work it adds is the roll-back of the state that is
# not addressed by position (the compressor's ring). The acceptance rate decides the speed-up, never the tokens.
