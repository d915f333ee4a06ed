"""dsv4ref.mhc: Sinkhorn, pre, post, fused post+pre, head (docs/mhc.md, its checks and pitfalls 22, 23).

Every float result is compared with a float64 oracle running the SAME schedule (docs/mhc.md#sinkhorn: rows are not
exactly doubly stochastic, so "is it doubly stochastic" is not a test). Triton outputs go into poisoned
buffers (NaN), so an element a kernel forgets shows up as a non-finite mismatch.
"""

import dataclasses
import inspect
import math

import pytest
import torch

from dsv4ref import config, mhc, validate
from dsv4ref.mhc import ChunkedLaunch, MhcLaunch, OneKernelLaunch, OnePassLaunch, SplitKLaunch, reference
from dsv4ref.mhc.fn_split import split3, split_fn_wide
from dsv4ref.mhc.launch import MAX_SLICES, ONE_PASS_LAG, OPS, PACKED_OPS
from dsv4ref.device import DEVICE, interpreting
from dsv4ref.testing import assert_close, compare, generator, poison, randn
from dsv4ref.tools.smem import HOPPER_SMEM_PER_PROGRAM, mhc_smem

BACKENDS = ["reference", "triton"]
GPU_ONLY = pytest.mark.skipif(interpreting(), reason="real hidden sizes at many tokens: compiled Triton only")

# Interpreter: the teaching size (and one token block of 19 > 16 tokens, to cross a program boundary).
# GPU: the real hidden sizes, V4-Flash 4096 and V4-Pro 7168, at token counts that leave partial blocks.
SHAPES = [(5, 256), (19, 256)] + ([] if interpreting() else [(33, 4096), (17, 7168), (300, 4096)])


DEFAULT = {op: mhc.default_launch(op) for op in OPS}  # the measured default of each op


# chunked: chunks of 16 tokens in the interpreter (T = 19: two chunks, the second partial), 256 on a GPU (T = 300:
# two; T = 3000: twelve), so that every test of the fixture crosses chunk boundaries
DESIGNS = {
    "one-kernel": OneKernelLaunch(),
    "split-K": SplitKLaunch(),
    "one-pass": OnePassLaunch(),
    "chunked": ChunkedLaunch(tokens=16 if interpreting() else 256),
}


@pytest.fixture(params=["one-kernel", "split-K", "chunked"] + ([] if interpreting() else ["one-pass"]))
def launch(request):
    """The Triton designs of pre / fused / head: the one kernel ``hc_kernel``, the split-K pair
    (``hc_partial_kernel`` + ``hc_finish_kernel``), ``OneKernelLaunch()`` and ``SplitKLaunch()``, the chunked pair
    (``hc_chunk_partial_kernel`` + ``hc_chunk_finish_kernel`` per chunk of tokens, ``ChunkedLaunch``)
    and, compiled only (at the real hidden sizes), the one-pass kernel ``OnePassLaunch()``; the
    interpreter runs the one-pass kernel in ``test_one_pass_matches_fp64_and_fused_equals_post_then_pre``, at
    sizes that keep CI short."""
    return DESIGNS[request.param]


def case(T, Hd, seed=0):
    res = mhc.example_streams(T, Hd, seed=seed)
    x = randn((T, Hd), seed=seed + 1, octaves=8)
    fn, scale, base = mhc.example_params(Hd, seed=seed + 2)
    return res, x, fn, scale, base


def oracle_pre(res, fn, scale, base, **kw):
    return reference.pre(res, fn, scale, base, dtype=torch.float64, **kw)


# -- the Triton paths, writing into poisoned buffers -------------------------------------------------


def triton_pre(res, fn, scale, base, rms_eps=1e-6, hc_eps=1e-6, post_mult=2.0, iters=20, launch=DEFAULT["pre"]):
    T, M, Hd = res.shape
    p, c, out = poison((T, M), torch.float32), poison((T, M, M), torch.float32), poison((T, Hd), torch.bfloat16)
    torch.ops.dsv4ref.mhc_pre(
        res, mhc.split_fn(fn), scale, base, p, c, out, rms_eps, hc_eps, post_mult, iters, *launch.op_args("mhc_pre")
    )
    return p, c, out


def triton_post(x, res, p, c):
    out = poison(tuple(res.shape), torch.bfloat16)
    torch.ops.dsv4ref.mhc_post(x, res, p.reshape(res.shape[:2]).contiguous(), c, out, *DEFAULT["post"].op_args("mhc_post"))
    return out


def triton_fused(x, res, p, c, fn, scale, base, launch=DEFAULT["fused_post_pre"]):
    T, M, Hd = res.shape
    new, p2, c2 = poison(tuple(res.shape), torch.bfloat16), poison((T, M), torch.float32), poison((T, M, M), torch.float32)
    out = poison((T, Hd), torch.bfloat16)
    torch.ops.dsv4ref.mhc_fused_post_pre(
        x, res, p, c, mhc.split_fn(fn), scale, base, new, p2, c2, out, 1e-6, 1e-6, 2.0, 20, *launch.op_args("mhc_fused_post_pre")
    )
    return new, p2, c2, out


def triton_head(res, fn, scale, base, launch=DEFAULT["head"]):
    out = poison((res.shape[0], res.shape[2]), torch.bfloat16)
    torch.ops.dsv4ref.mhc_head(res, mhc.split_fn(fn, head=True), scale, base, out, 1e-6, 1e-6, *launch.op_args("mhc_head"))
    return out


def run_pre(backend, res, fn, scale, base, launch=DEFAULT["pre"], **kw):
    if backend == "triton":
        return triton_pre(res, fn, scale, base, launch=launch, **{k.replace("sinkhorn_iters", "iters"): v for k, v in kw.items()})
    return mhc.pre(res, fn, scale, base, backend="reference", **kw)


def run_post(backend, x, res, p, c):
    return triton_post(x, res, p, c) if backend == "triton" else mhc.post(x, res, p, c, backend="reference")


def zero_params(Hd, comb_base, pre_base=0.0, post_base=0.0):
    """fn = 0 (every logit is its bias), scale = (1, 1, 1), base = [pre | post | comb_base row-major]."""
    fn = torch.zeros(24, 4 * Hd, device=DEVICE)
    base = torch.cat([torch.full((4,), float(pre_base)), torch.full((4,), float(post_base)), comb_base.reshape(16).float()]).to(
        DEVICE
    )
    return fn, torch.ones(3, device=DEVICE), base


# ====================================================================================================
# Sinkhorn (docs/mhc.md#sinkhorn, check 1)
# ====================================================================================================


def logits(n, std, seed):
    return (torch.randn(n, 4, 4, generator=generator(seed)) * std).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("std", [0.1, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("iters", [1, 5, 20])
def test_sinkhorn_matches_fp64_oracle(backend, std, iters):
    L = logits(37, std, seed=int(std * 10) + iters)
    got = mhc.sinkhorn(L, iters, 1e-6, backend=backend)
    assert_close(got, reference.sinkhorn(L.double(), iters, 1e-6), "mhc")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("std", [0.1, 1.0, 3.0, 10.0])
def test_sinkhorn_positive_and_column_sums(backend, std):
    """All entries > 0 (the +eps), and the last step normalises columns: |col sum − 1| ≤ 2e-6."""
    c = mhc.sinkhorn(logits(256, std, seed=3), backend=backend).double()
    assert bool((c > 0).all())
    assert float((c.sum(dim=-2) - 1).abs().max()) <= 2e-6


# Stated bound on the worst row-sum error |Σ_j comb[i, j] − 1| over 4096 std-1 logit matrices, as a function
# of the number of passes (measured in fp64 for this seed: 0.69, 0.30, 0.083, 0.012, 0.0036, 0.0012 at
# 1, 2, 5, 10, 15, 20 passes). Rows are NOT normalised last, so they converge, they are not exact.
ROW_BOUND = {1: 0.75, 2: 0.35, 5: 0.1, 10: 0.02, 15: 6e-3, 20: 2e-3}


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinkhorn_row_error_vs_passes(backend):
    # the kernel runs the oracle's schedule (test_sinkhorn_matches_fp64_oracle): on the first quarter of the
    # matrices (a subset: the bounds hold for it too) at a quarter of the interpreter's programs
    n = 4096 if backend == "reference" else 1024
    L = logits(4096, 1.0, seed=11)[:n]
    worst = {}
    for k in ROW_BOUND:
        c = mhc.sinkhorn(L, k, backend=backend).double()
        worst[k] = float((c.sum(dim=-1) - 1).abs().max())
        assert worst[k] <= ROW_BOUND[k], (k, worst[k])
    ks = sorted(worst)
    assert all(worst[a] > worst[b] for a, b in zip(ks, ks[1:])), worst  # more passes, smaller error
    # small logits converge to the eps floor: row error ~1e-6 after 5 passes
    c = mhc.sinkhorn(logits(4096, 0.1, seed=12)[:n], 5, backend=backend).double()
    assert float((c.sum(dim=-1) - 1).abs().max()) <= 2e-6


def _variant(L, iters, eps, kind):
    """Wrong schedules seen in ports (docs/mhc.md#pitfalls, 23)."""
    if kind == "wrong axis":  # the whole schedule with rows and columns swapped (softmax over i)
        return sinkhorn_cols_first(L, iters, eps)
    if kind == "exp+row":  # exp and a row normalisation instead of softmax + eps (here with eps 1e-3)
        c = L.exp()
        c = c / (c.sum(-1, keepdim=True) + eps)
    else:  # "one pass short": 19 passes
        c = torch.softmax(L, -1) + eps
        iters -= 1
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def sinkhorn_cols_first(L, iters, eps):
    return reference.sinkhorn(L.transpose(-1, -2), iters, eps).transpose(-1, -2)


@pytest.mark.parametrize("kind", ["exp+row", "wrong axis", "one pass short"])
def test_sinkhorn_oracle_catches_wrong_schedules(kind):
    """The oracle comparison above can fail: plausible wrong schedules miss the 'mhc' tolerance. (An extra
    row normalisation right after the softmax is NOT among them: the softmax rows already sum to 1 + 4·eps,
    so it changes comb by ~1e-12.)"""
    L = logits(256, 3.0, seed=5).double()
    wrong = _variant(L, 20, 1e-3 if kind == "exp+row" else 1e-6, kind)
    assert not compare(wrong, reference.sinkhorn(L), "mhc").passed


def test_sinkhorn_peaked_permutation():
    """30·P (P a permutation) gives comb ≈ P, about 1e-6 in the zero positions (docs/mhc.md#sinkhorn)."""
    P = torch.eye(4)[[2, 0, 3, 1]].to(DEVICE)
    c = mhc.sinkhorn((30 * P)[None]).cpu()[0].double()
    assert float((c - P.cpu()).abs().max()) < 1e-5
    assert float(c[P.cpu() == 0].max()) < 1e-5 and float(c[P.cpu() == 0].min()) > 0


# ====================================================================================================
# pre / post / fused / head against the fp64 oracle (docs/mhc.md#pre ... #head)
# ====================================================================================================


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,Hd", SHAPES)
def test_pre_matches_fp64(backend, T, Hd, launch):
    res, _, fn, scale, base = case(T, Hd, seed=T + Hd)
    p, c, x = run_pre(backend, res, fn, scale, base, launch)
    p64, c64, x64 = oracle_pre(res, fn, scale, base)
    assert_close(p, p64, "mhc", "post")
    assert_close(c, c64, "mhc", "comb")
    assert_close(x, x64, "bf16_out", "layer_input")


def test_pre_real_hidden_size_one_token_interpreted(launch):
    """V4-Flash Hd = 4096 (K = 16 384 for the mix GEMM) in whatever mode runs here, at T = 2. (Chunked: its
    partial kernel as the fixture's, 32 slices = MAX_SLICES summed by the finish kernel, but one finish part,
    not 32 that each run the gates again: several parts are test_chunked_matches_fp64_and_fused_equals_post_then_pre's.)"""
    if isinstance(launch, ChunkedLaunch):
        launch = dataclasses.replace(launch, finish_h=4096, target_programs=1)
        assert launch.plan(2, 4096)[2] == MAX_SLICES and launch.finish_plan(16, 4096)[0] == 1
    res, _, fn, scale, base = case(2, 4096, seed=41)
    p, c, x = triton_pre(res, fn, scale, base, launch=launch)
    p64, c64, x64 = oracle_pre(res, fn, scale, base)
    assert_close(p, p64, "mhc")
    assert_close(c, c64, "mhc")
    assert_close(x, x64, "bf16_out")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,Hd", SHAPES)
def test_post_matches_fp64(backend, T, Hd):
    res, x, fn, scale, base = case(T, Hd, seed=T + 2 * Hd)
    p, c, _ = mhc.pre(res, fn, scale, base, backend="reference")
    got = run_post(backend, x, res, p, c)
    assert_close(got, reference.post(x, res, p, c, dtype=torch.float64), "bf16_out")


def test_post_accepts_both_post_shapes():
    res, x, fn, scale, base = case(3, 256, seed=1)
    p, c, _ = mhc.pre(res, fn, scale, base)
    assert torch.equal(mhc.post(x, res, p, c).view(torch.int16), mhc.post(x, res, p[:, :, None], c).view(torch.int16))


@pytest.mark.parametrize("T,Hd", SHAPES[:1] + SHAPES[2:])
def test_fused_equals_post_then_pre(T, Hd, launch):
    """docs/mhc.md#fused-post-pre: EXACT on the bf16 outputs (same operation order, explicit FMAs); fp32
    outputs within 1e-6."""
    res, x, fn, scale, base = case(T, Hd, seed=7 * T)
    p, c, _ = mhc.pre(res, fn, scale, base)
    new, p2, c2, li = triton_fused(x, res, p, c, fn, scale, base, launch)
    new_sep = triton_post(x, res, p, c)
    p_sep, c_sep, li_sep = triton_pre(new_sep, fn, scale, base, launch=launch.pre_like_fused())
    assert_close(new, new_sep, "exact")
    assert_close(li, li_sep, "exact")
    assert_close(p2, p_sep, "fp32_reduction")  # abs 1e-6 (or rel 8e-5): docs/mhc.md#fused-post-pre
    assert_close(c2, c_sep, "fp32_reduction")
    # ... and the composition is right in the first place
    assert_close(new, reference.post(x, res, p, c, dtype=torch.float64), "bf16_out")
    p64, c64, x64 = oracle_pre(new_sep, fn, scale, base)
    assert_close(p2, p64, "mhc")
    assert_close(c2, c64, "mhc")
    assert_close(li, x64, "bf16_out")


@pytest.mark.parametrize("splits", [1, 2] + ([] if interpreting() else [3]))
def test_split_k_any_number_of_splits(splits):
    """The split-K path with a forced number of K splits (in the interpreter Hd = 320 is 3 BLOCK_K chunks of
    128, the last one partial: 1 split loops over all three; 2 split them 2/1, so one split loops over two
    chunks and the other is a single partial chunk, which is what 3 splits of one chunk each add; on a GPU, 5
    chunks of 64 split 3/2 or 2/2/1): pre and head match the
    fp64 oracle, fused == post then pre exactly, and T = 19 gives the finish kernel two token tiles and two
    hidden parts (the second one partial), so the part that stores post/comb is not the only one."""
    T, Hd = 19, 320
    res, x, fn, scale, base = case(T, Hd, seed=23)
    launch = SplitKLaunch(splits=splits)
    p, c, li = triton_pre(res, fn, scale, base, launch=launch)
    p64, c64, x64 = oracle_pre(res, fn, scale, base)
    assert_close(p, p64, "mhc")
    assert_close(c, c64, "mhc")
    assert_close(li, x64, "bf16_out")
    # fused (with the same plan) == the separate post then the split-K pre, bit for bit on bf16
    new, p2, c2, li2 = triton_fused(x, res, p, c, fn, scale, base, launch)
    new_sep = triton_post(x, res, p, c)
    p3, c3, li3 = triton_pre(new_sep, fn, scale, base, launch=launch)
    assert_close(new, new_sep, "exact")
    assert_close(li2, li3, "exact")
    assert_close(p2, p3, "fp32_reduction")
    assert_close(c2, c3, "fp32_reduction")
    hfn, hscale, hbase = mhc.example_params(Hd, seed=24, head=True)
    out = triton_head(res, hfn, hscale, hbase, launch)
    assert_close(out, reference.head(res, hfn, hscale, hbase, dtype=torch.float64), "bf16_out")
    # the public functions take the same launch
    assert_close(mhc.head(res, hfn, hscale, hbase, launch=launch), out, "exact")


@pytest.mark.parametrize(
    "T,Hd,bt,bk", [(1, 4096, 64, 64), (19, 320, 64, 128), (4096, 4096, 64, 64), (3000, 7168, 64, 64), (7, 100, 16, 32)]
)
@pytest.mark.parametrize("splits", [None, 1, 5, 1000])
def test_split_plan_covers_every_chunk_once(T, Hd, bt, bk, splits):
    """Every BLOCK_K chunk belongs to exactly one split and no split is empty."""
    n, cps = SplitKLaunch(block_t=bt, block_k=bk, splits=splits).plan(T, Hd)
    chunks = -(-Hd // bk)
    assert 1 <= n <= chunks and cps >= 1
    assert (n - 1) * cps < chunks <= n * cps


@GPU_ONLY
def test_pre_many_tokens_uneven_splits(launch):
    """T = 3000, Hd = 7168 (V4-Pro): split-K plans 12 splits of 10, 10, …, 2 chunks; the one-kernel path
    runs 188 programs over K = 28 672."""
    res, _, fn, scale, base = case(3000, 7168, seed=29)
    p, c, x = triton_pre(res, fn, scale, base, launch=launch)
    p64, c64, x64 = oracle_pre(res, fn, scale, base)
    assert_close(p, p64, "mhc", "post")
    assert_close(c, c64, "mhc", "comb")
    assert_close(x, x64, "bf16_out", "layer_input")


def test_fused_reference_backend_composes():
    res, x, fn, scale, base = case(4, 256, seed=2)
    p, c, _ = mhc.pre(res, fn, scale, base, backend="reference")
    got = mhc.fused_post_pre(x, res, p, c, fn, scale, base, backend="reference")
    new = mhc.post(x, res, p, c, backend="reference")
    for a, b in zip(got, (new, *mhc.pre(new, fn, scale, base, backend="reference"))):
        assert_close(a, b, "exact")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,Hd", SHAPES)
def test_head_matches_fp64(backend, T, Hd, launch):
    res = mhc.example_streams(T, Hd, seed=T)
    fn, scale, base = mhc.example_params(Hd, seed=T + 1, head=True)
    want = reference.head(res, fn, scale, base, dtype=torch.float64)
    if backend == "triton":
        got = triton_head(res, fn, scale, base, launch)
    else:
        got = mhc.head(res, fn, scale, base, backend="reference")
    assert_close(got, want, "bf16_out")


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_hand_computed(backend, launch):
    """docs/mhc.md#checks (7): fn picks X[0] only, scale = ln 3, base = (0, ln 3, −ln 3, 0). Every value is ±1, so the
    RMS is 1 and mix_0 = X[0] = ±1: gate = σ(±ln 3 + base) + 1e-6.
    token A: all streams +1              -> gate (0.75, 0.75, 0.25, 0.5) -> out = 2.25 everywhere
    token B: streams (−1, +1, −1, +1)    -> gate (0.25, 0.75, 0.25, 0.5) -> out = −0.25 + 0.75 − 0.25 + 0.5 = 0.75
    (the 1e-6 terms are far below a bf16 ulp at these values)."""
    Hd = 32
    fn = torch.zeros(4, 4 * Hd, device=DEVICE)
    fn[0, 0] = 1.0
    l3 = math.log(3.0)
    scale = torch.tensor([l3], device=DEVICE)
    base = torch.tensor([0.0, l3, -l3, 0.0], device=DEVICE)
    signs = torch.tensor([[1.0, 1, 1, 1], [-1, 1, -1, 1]])
    hidden = (signs[:, :, None] * torch.ones(2, 4, Hd)).to(torch.bfloat16).to(DEVICE)
    out = mhc.head(hidden, fn, scale, base, backend=backend, launch=launch)
    assert out.cpu().float()[0].unique().tolist() == [2.25]
    assert out.cpu().float()[1].unique().tolist() == [0.75]


# ====================================================================================================
# Structural checks (docs/mhc.md#checks, 2–6)
# ====================================================================================================


def P4():
    """The 4-cycle: P[0,1] = P[1,2] = P[2,3] = P[3,0] = 1 (source i -> destination i+1)."""
    return torch.roll(torch.eye(4), 1, dims=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_post_transpose_4cycle(backend, launch):
    """docs/mhc.md#pitfalls (22): with comb ≈ P (the 4-cycle), new stream j+1 = post·x + stream j. Using comb instead
    of combᵀ moves the streams the other way round, which this test rejects (checked below)."""
    T, Hd = 3, 256
    res = mhc.example_streams(T, Hd, seed=9)
    x = randn((T, Hd), seed=10, octaves=8)
    fn, scale, base = zero_params(Hd, 30 * P4())
    p, c, _ = run_pre(backend, res, fn, scale, base, launch)
    assert float((c.cpu().double() - P4().double()).abs().max()) < 1e-5
    new = run_post(backend, x, res, p, c)
    want = p.double()[:, :, None] * x.double()[:, None, :] + torch.roll(res.double(), 1, dims=1)  # new_{j} = res_{j-1}
    assert_close(new, want, "bf16_out")
    # the bug: Σ_j comb[i, j]·res_j, i.e. comb @ res instead of combᵀ @ res, gives the reverse cycle
    buggy = p.double()[:, :, None] * x.double()[:, None, :] + torch.einsum("tij,tjh->tih", c.double(), res.double())
    assert not compare(buggy, want, "bf16_out").passed
    assert compare(
        buggy, p.double()[:, :, None] * x.double()[:, None, :] + torch.roll(res.double(), -1, dims=1), "bf16_out"
    ).passed


def cycle_inputs(T=3, Hd=64, seed=21):
    """A NON-symmetric comb, ≈ the 4-cycle P (source i -> destination i+1, a 1e-6 leak elsewhere), and post
    weights that differ per stream: a transposed comb, or post applied to the wrong stream, moves values."""
    res = mhc.example_streams(T, Hd, seed=seed)
    x = randn((T, Hd), seed=seed + 1, octaves=8)
    comb = (P4() * (1 - 3e-6) + 1e-6).expand(T, 4, 4).contiguous().to(DEVICE)
    post = torch.tensor([0.25, 0.5, 1.0, 1.5]).expand(T, 4).contiguous().to(DEVICE)
    return res, x, post, comb


@pytest.mark.parametrize("backend", BACKENDS)
def test_public_post_4cycle(backend):
    """The PUBLIC ``mhc.post`` (not torch.ops) on the 4-cycle: new stream j = post_j·x + stream
    j−1. A wrapper that passed comb transposed would give stream j+1 and fail here (checked below)."""
    res, x, post, comb = cycle_inputs()
    for p in (post, post[:, :, None]):  # both accepted shapes
        new = mhc.post(x, res, p, comb, backend=backend)
        want = post.double()[:, :, None] * x.double()[:, None, :] + torch.roll(res.double(), 1, dims=1)
        assert_close(new, want, "bf16_out")
        assert_close(new, reference.post(x, res, post, comb, dtype=torch.float64), "bf16_out")
    wrong = reference.post(x, res, post, comb.transpose(1, 2), dtype=torch.float64)  # what a transposing wrapper gives
    assert not compare(wrong, want, "bf16_out").passed


@pytest.mark.parametrize("backend,design", [("reference", None), ("triton", None), ("triton", "one-pass"), ("triton", "chunked")])
def test_public_fused_post_pre_4cycle(backend, design):
    """The PUBLIC ``mhc.fused_post_pre`` on the 4-cycle: its new residual is post's (stream j−1
    into j), and its pre part is the fp64 pre of exactly those streams."""
    res, x, post, comb = cycle_inputs(T=5, Hd=256, seed=23)
    fn, scale, base = mhc.example_params(256, seed=24)
    new, p2, c2, li = mhc.fused_post_pre(x, res, post, comb, fn, scale, base, backend=backend, launch=DESIGNS.get(design))
    want = post.double()[:, :, None] * x.double()[:, None, :] + torch.roll(res.double(), 1, dims=1)
    assert_close(new, want, "bf16_out")
    wrong = reference.post(x, res, post, comb.transpose(1, 2), dtype=torch.float64)
    assert not compare(wrong, want, "bf16_out").passed
    p64, c64, x64 = oracle_pre(new, fn, scale, base)
    assert_close(p2, p64, "mhc")
    assert_close(c2, c64, "mhc")
    assert_close(li, x64, "bf16_out")


@pytest.mark.parametrize("backend", BACKENDS)
def test_identity_comb_preserves_streams(backend, launch):
    """base_comb = 30·I, fn = 0: comb ≈ I and new stream j = post_j·x + stream j (docs/mhc.md#checks, 3)."""
    T, Hd = 4, 256
    res = mhc.example_streams(T, Hd, seed=12)
    x = randn((T, Hd), seed=13, octaves=8)
    fn, scale, base = zero_params(Hd, 30 * torch.eye(4), post_base=0.3)
    p, c, _ = run_pre(backend, res, fn, scale, base, launch)
    assert float((c.cpu().double() - torch.eye(4, dtype=torch.float64)).abs().max()) < 1e-5
    new = run_post(backend, x, res, p, c)
    assert_close(new, p.double()[:, :, None] * x.double()[:, None, :] + res.double(), "bf16_out")
    # with x = 0 the streams pass through unchanged to within the 1e-6 leak of comb (below a bf16 ulp)
    assert_close(run_post(backend, torch.zeros_like(x), res, p, c), res, "bf16_out")


@pytest.mark.parametrize("backend", BACKENDS)
def test_uniform_comb_averages_streams(backend, launch):
    """fn = 0 and base_comb = 0: every entry of comb is equal (≈ 1/4) and new stream j = post_j·x + mean_i
    stream_i (docs/mhc.md#checks, 2)."""
    T, Hd = 4, 256
    res = mhc.example_streams(T, Hd, seed=14)
    x = randn((T, Hd), seed=15, octaves=8)
    fn, scale, base = zero_params(Hd, torch.zeros(4, 4))
    p, c, _ = run_pre(backend, res, fn, scale, base, launch)
    assert c.cpu().unique().numel() == 1 and abs(float(c.cpu()[0, 0, 0]) - 0.25) < 2e-6
    assert torch.equal(p.cpu(), torch.full((T, 4), 1.0))  # 2·σ(0) = 1 exactly
    new = run_post(backend, x, res, p, c)
    want = p.double()[:, :, None] * x.double()[:, None, :] + res.double().mean(dim=1, keepdim=True)
    assert_close(new, want, "bf16_out")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranges_and_pre_eps(backend, launch):
    """pre ∈ (1e-6, 1 + 1e-6), post ∈ (0, 2) (docs/mhc.md#checks, 5). pre is internal, so it is read through the
    layer input: with pre logits at −30, σ ≈ 9e-14 and pre ≈ hc_eps = 1e-6, so x ≈ 1e-6·Σ_i stream_i; a
    kernel that drops the +eps (docs/mhc.md#pitfalls, 23) returns ~1e7 times less. At +30, pre = 1 + 1e-6."""
    T, Hd = 4, 256
    res = mhc.example_streams(T, Hd, seed=16)
    for pre_base, w in [(-30.0, 1e-6), (30.0, 1.0 + 1e-6)]:
        fn, scale, base = zero_params(Hd, torch.zeros(4, 4), pre_base=pre_base)
        _, _, x = run_pre(backend, res, fn, scale, base, launch)
        assert_close(x, res.double().sum(dim=1) * w, "bf16_out")
    fn, scale, base = case(T, Hd, seed=17)[2:]
    base[4:8] = torch.tensor([-6.0, -2.0, 2.0, 6.0])
    p, c, _ = run_pre(backend, res, fn, scale, base, launch)
    assert bool(((p > 0) & (p < 2)).all()) and bool((c > 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_is_over_flattened_streams_after_gemm(backend, launch):
    """docs/mhc.md#checks (6): scaling ALL streams by k leaves post and comb unchanged and scales x by k (k a power of
    two, so the bf16 inputs scale exactly). Then the oracle rejects an RMS taken per stream, which the
    k-scaling alone cannot catch (a per-stream RMS is scale invariant too)."""
    T, Hd = 5, 256
    res, _, fn, scale, base = case(T, Hd, seed=18)
    p, c, x = run_pre(backend, res, fn, scale, base, launch)
    pk, ck, xk = run_pre(backend, res * 8, fn, scale, base, launch)
    assert_close(pk, p, "mhc")
    assert_close(ck, c, "mhc")
    assert_close(xk, x.double() * 8, "bf16_out")
    # per-stream RMS: mix = Σ_i (X_i @ fn_iᵀ) · rsqrt(mean(X_i²)), on streams of different magnitudes
    X = res.double()
    Xn = X * torch.rsqrt(X.square().mean(dim=-1, keepdim=True) + 1e-6)
    mix = Xn.reshape(T, -1) @ fn.double().T
    wrong_post = torch.sigmoid(mix[:, 4:8] * scale[1].double() + base[4:8].double()) * 2
    assert not compare(wrong_post, p, "mhc").passed


def test_model_constants():
    """docs/mhc.md#pitfalls (23) / #checks (8): defaults are the model's (post_mult 2, eps 1e-6, 20 passes)."""
    for f in (mhc.pre, mhc.fused_post_pre):
        sig = inspect.signature(f).parameters
        assert sig["post_mult"].default == 2.0 and sig["sinkhorn_iters"].default == 20
        assert sig["hc_eps"].default == 1e-6 and sig["rms_eps"].default == 1e-6
    assert inspect.signature(mhc.sinkhorn).parameters["iters"].default == config.FLASH.hc_sinkhorn_iters == 20
    assert config.FLASH.hc_mult == 4 and config.FLASH.hc_mix == 24 and config.FLASH.hc_eps == 1e-6
    # non-model constants (as some unit tests use) change the results well beyond the tolerance
    res, _, fn, scale, base = case(4, 256, seed=19)
    p, c, _ = mhc.pre(res, fn, scale, base)
    p1, _, _ = mhc.pre(res, fn, scale, base, post_mult=1.0)
    _, c3, _ = mhc.pre(res, fn, scale, base, hc_eps=1e-3)
    assert not compare(p1, p, "mhc").passed and not compare(c3, c, "mhc").passed


def test_split_fn_is_exact_and_cached():
    g = generator(20)
    w = torch.randn(24, 1024, generator=g) * torch.exp2(torch.randint(-30, 30, (24, 1024), generator=g).float())
    s = split3(w).float()
    assert torch.equal(s[0] + s[1] + s[2], w)
    fn = w.to(DEVICE)
    a = mhc.split_fn(fn)
    assert mhc.split_fn(fn) is a  # cached
    fn.mul_(2)  # in-place update: the version counter changes, so the cache must not answer
    b = mhc.split_fn(fn)
    assert b is not a and torch.equal(b.float(), a.float() * 2)


def check_design(L, T, Hd, seed, custom_ops=False, between=None):
    """The checks every design's launch ``L`` must pass at [T, 4, Hd] (inputs from ``case(T, Hd, seed)``, the
    head's fn from seed + 1): pre and head match the fp64 oracle; fused == post then a pre of the same
    arithmetic (``pre_like_fused``), bit for bit on bf16, 1e-6 on fp32. ``custom_ops``: through the registered
    ops with poisoned outputs (``triton_*``) instead of the public functions. ``between(res, fn, scale, base,
    (p, c, li))`` runs after the pre checks. Returns what it computed: ((p, c, li), (new, p2, c2, li2), head)."""
    if custom_ops:
        pre_ = lambda r, f, s, b, launch: triton_pre(r, f, s, b, launch=launch)  # noqa: E731
        fused_, post_, head_ = triton_fused, triton_post, triton_head
    else:
        pre_ = lambda r, f, s, b, launch: mhc.pre(r, f, s, b, launch=launch)  # noqa: E731
        fused_ = lambda x, r, p, c, f, s, b, launch: mhc.fused_post_pre(x, r, p, c, f, s, b, launch=launch)  # noqa: E731
        post_ = mhc.post
        head_ = lambda r, f, s, b, launch: mhc.head(r, f, s, b, launch=launch)  # noqa: E731
    res, x, fn, scale, base = case(T, Hd, seed=seed)
    p, c, li = pre_(res, fn, scale, base, launch=L)
    p64, c64, x64 = oracle_pre(res, fn, scale, base)
    assert_close(p, p64, "mhc", "post")
    assert_close(c, c64, "mhc", "comb")
    assert_close(li, x64, "bf16_out", "layer_input")
    if between is not None:
        between(res, fn, scale, base, (p, c, li))
    new, p2, c2, li2 = fused_(x, res, p, c, fn, scale, base, launch=L)
    new_sep = post_(x, res, p, c)
    p3, c3, li3 = pre_(new_sep, fn, scale, base, launch=L.pre_like_fused())
    assert_close(new, new_sep, "exact")
    assert_close(li2, li3, "exact")
    assert_close(p2, p3, "fp32_reduction")
    assert_close(c2, c3, "fp32_reduction")
    hfn, hscale, hbase = mhc.example_params(Hd, seed=seed + 1, head=True)
    out = head_(res, hfn, hscale, hbase, launch=L)
    assert_close(out, reference.head(res, hfn, hscale, hbase, dtype=torch.float64), "bf16_out")
    return (p, c, li), (new, p2, c2, li2), out


# ====================================================================================================
# The one-pass design (OnePassLaunch; kernels_one_pass.py), interpreter-sized
# ====================================================================================================


# the interpreter-sized tiles: 16-token tiles, slices of one 32-wide chunk
SMALL = dict(block_t=16, block_k=32, block_h=32, slice_h=32, maxnreg=None)


@pytest.mark.parametrize("one_dot", [2, 1])
def test_one_pass_matches_fp64_and_fused_equals_post_then_pre(one_dot):
    """The one-pass kernel at T = 19 in 16-token tiles (two tiles, the second partial) × Hd = 56 in two hidden
    slices of one 32-wide chunk (the second partial): every tile's last arrival runs the gates, phase B finishes
    tile g − lag. pre and head match the fp64 oracle; fused == post then a pre of the same arithmetic
    (``pre_like_fused``: the fused op's joined dot, ``one_dot`` 1), bit for bit on bf16, 1e-6 on fp32. ``one_dot``
    2 (pre's one load of the 4 streams' chunk) and 1 (four tiles joined). (Tiny on purpose: the interpreter pays
    ~10 ms per helper call. The compiled kernel: the GPU tests, at the real sizes.)"""
    T, Hd = 19, 56
    L = OnePassLaunch(one_dot=one_dot, **SMALL)
    assert L.plan(T, Hd) == (2, 2, 1, 32)
    check_design(L, T, Hd, seed=31)


# ====================================================================================================
# The chunked design (ChunkedLaunch; kernels_chunked.py), interpreter-sized
# ====================================================================================================


# interpreter-sized tiles: chunks of 16 tokens, slices of one 32-wide BLOCK_K chunk, finish parts of 32 dims
CHUNK_SMALL = dict(
    tokens=16, block_t=16, block_k=32, slice_h=32, finish_block_t=16, finish_h=32, finish_block_h=32, maxnreg=None, small_t=0
)


# The partial kernel's five variants (stream_k, fn_layout) each once; the finish kernel's sum_unroll (which the
# partial kernel does not see) 1 and 4 across them.
@pytest.mark.parametrize(
    "sum_unroll,stream_k,fn_layout",
    [(1, False, 0), (4, True, 0), (1, False, 2), (4, True, 2), (4, True, 3)],
)
def test_chunked_matches_fp64_and_fused_equals_post_then_pre(sum_unroll, stream_k, fn_layout):
    """T = 24 in chunks of 16 (two chunks, the last one partial) × Hd = 56 in two slices of one 32-wide
    chunk (the last partial) and two finish parts (part 0 alone stores post / comb; the other sums only the
    pre columns): pre and head match the fp64 oracle; fused (``post_kernel`` per chunk, then pre's kernels on
    the new streams) == post then pre, bit for bit on bf16, 1e-6 on fp32. ``sum_unroll`` 1 and 4 (the finish
    kernel's rounds; 2 slices: a partial round) give the same bits. ``stream_k``: one stream's chunk per step
    (pre, head); ``fn_layout`` 2: the fn tiles from ``split_fn_wide`` (the same operands, so the same bits as
    0); 3 (with stream_k): 2's copy in two dots, [hi | mid] then lo, folded as (hi + mid) + lo, the order the
    one-dot fold adds them in (the same bits in the interpreter)."""
    T, Hd = 24, 56
    L = ChunkedLaunch(sum_unroll=sum_unroll, stream_k=stream_k, fn_layout=fn_layout, **CHUNK_SMALL)
    assert L.plan(T, Hd) == (16, 2, 2, 1, 32) and L.finish_plan(16, Hd) == (2, 32)

    def same_bits(res, fn, scale, base, got):  # the sum's rounds and the fn copy's layout change no bit
        if sum_unroll == 4 or fn_layout:
            # layout 3 folds its two dots in one fixed order: the same bits as 0 in the interpreter, not
            # necessarily on a GPU's tensor cores (there it is compared with itself, across sum rounds)
            ref_layout = 3 if fn_layout == 3 and not interpreting() else 0
            ref = mhc.pre(
                res,
                fn,
                scale,
                base,
                launch=ChunkedLaunch(sum_unroll=1, stream_k=stream_k, fn_layout=ref_layout, **CHUNK_SMALL),
            )
            for a, b in zip(ref, got):
                assert_close(a, b, "exact")

    check_design(L, T, Hd, seed=33, between=same_bits)


@pytest.mark.parametrize("stream_k", [False, True])
def test_chunked_zigzag_same_bits_every_tile_once(stream_k):
    """``zigzag`` (each kernel of a chunk walks its token tiles opposite to the one before it): T = 56 in chunks
    of 32 tokens, tiles of 16: two chunks (several chunks: the walk counts from each chunk's end, not T's), the
    second of 24 tokens, 2 tiles the last partial (the reversed walk meets a partial tile first, inside a chunk
    of several tiles); two hidden slices (the tile is pid // slices). Through the custom ops with poisoned outputs
    (a tile never walked stays poison): against the fp64 oracle, and equal to the forward walk bit for bit on the
    same inputs (only the order moved; the forward walk's fused == post then pre is
    test_chunked_matches_fp64_and_fused_equals_post_then_pre's). ``stream_k`` (the GPU default's partial kernel;
    slices of two 32-wide chunks, so Hd = 88 for two slices): pre, fused and head. Without it (the wide partial
    kernel): the fused op only, whose partial kernel is the one that walks backward (pre's and head's partial
    kernels walk forward, their finish kernel backward: the finish kernel is the same either way, so the
    ``stream_k`` case has it)."""
    T, Hd = 56, 88 if stream_k else 56
    # Hd = 88 with stream_k: finish parts of 64 dims, so two parts as at Hd = 56 (the walk is the finish grid's
    # other axis)
    small = {**CHUNK_SMALL, "tokens": 32, **({"slice_h": 64, "finish_h": 64} if stream_k else {})}
    fwd = ChunkedLaunch(stream_k=stream_k, fn_layout=0, zigzag=False, **small)
    zz = dataclasses.replace(fwd, zigzag=True)
    assert fwd.plan(T, Hd)[:3] == (32, 2, 2) and fwd.finish_plan(32, Hd)[0] == 2
    res, x, fn, scale, base = case(T, Hd, seed=41)
    if stream_k:
        p, c, li = triton_pre(res, fn, scale, base, launch=zz)
        for a, b, tol in zip((p, c, li), oracle_pre(res, fn, scale, base), ("mhc", "mhc", "bf16_out")):
            assert_close(a, b, tol)
        for a, b in zip(triton_pre(res, fn, scale, base, launch=fwd), (p, c, li)):
            assert_close(b, a, "exact")
    else:
        p, c, _ = mhc.pre(res, fn, scale, base, backend="reference")
    got = triton_fused(x, res, p, c, fn, scale, base, launch=zz)
    assert_close(got[0], reference.post(x, res, p, c, dtype=torch.float64), "bf16_out")
    for a, b, tol in zip(got[1:], oracle_pre(got[0], fn, scale, base), ("mhc", "mhc", "bf16_out")):
        assert_close(a, b, tol)
    for a, b in zip(triton_fused(x, res, p, c, fn, scale, base, launch=fwd), got):
        assert_close(b, a, "exact")
    if stream_k:
        hfn, hscale, hbase = mhc.example_params(Hd, seed=42, head=True)
        head = triton_head(res, hfn, hscale, hbase, launch=zz)
        assert_close(head, reference.head(res, hfn, hscale, hbase, dtype=torch.float64), "bf16_out")
        assert_close(head, triton_head(res, hfn, hscale, hbase, launch=fwd), "exact")


def test_split_fn_wide_is_the_split_transposed_in_gemm_tile_row_order():
    """``split_fn_wide``: row p·G·16 + g·16 + j = [hi | mid | lo | 0] × (gate group | comb group) of ``split_fn``'s
    [G, 3, K, 16], K-major, part 3 zero (head: one group), cached per split tensor."""
    for head in (False, True):
        fn = mhc.example_params(40, seed=37, head=head)[0]
        fs = mhc.split_fn(fn, head=head)
        w = split_fn_wide(fs)
        G, K = fs.shape[0], fs.shape[2]
        assert w.shape == (4 * G * 16, K) and w.dtype == torch.bfloat16 and split_fn_wide(fs) is w
        for p in range(3):
            for g in range(G):
                assert torch.equal(w[p * G * 16 + g * 16 : p * G * 16 + (g + 1) * 16], fs[g, p].t())
        assert not w[3 * G * 16 :].any()


# The chunked design as notebook 03 teaches it, rung by rung, and the GPU default (every other field the GPU's)
CHUNKED_RUNGS = {
    "four streams per dot, fn from split_fn": dict(stream_k=False, fn_layout=0, zigzag=False, block_k=16),
    "one stream per step, K-major fn": dict(stream_k=True, fn_layout=2, zigzag=False),
    "one stream per step, K-major fn, zigzag walk": dict(stream_k=True, fn_layout=2, zigzag=True),
    "default": {},
}


@GPU_ONLY
@pytest.mark.parametrize("chunk_tokens", [1024, 4096])
@pytest.mark.parametrize("rung", list(CHUNKED_RUNGS))
def test_chunked_rungs_gpu(rung, chunk_tokens):
    """Each rung of the chunked design and the default at T = 3000 (chunks of 1024: three, the last partial;
    4096: the default's one chunk), Hd = 4096: pre and head against the fp64 oracle, fused == post then pre bit
    for bit, through the custom ops with poisoned outputs."""
    check_design(ChunkedLaunch(tokens=chunk_tokens, **CHUNKED_RUNGS[rung]), 3000, 4096, seed=35, custom_ops=True)


@pytest.mark.parametrize(
    "T,Hd,C,bt,bk,slice_h",
    [
        (1, 4096, 1024, 128, 16, 256),
        (4096, 4096, 1024, 128, 16, 256),
        (4096, 4096, 512, 64, 16, 256),
        (3000, 7168, 1024, 128, 16, 256),
        (7, 100, 16, 16, 16, 32),
        (40, 88, 16, 16, 32, 32),
        (300, 4096, 256, 128, 32, 128),
    ],
)
def test_chunk_plan_covers_every_token_and_chunk_once(T, Hd, C, bt, bk, slice_h):
    """The chunks cover [0, T) once (C a multiple of the tile; a short call: one chunk); every BLOCK_K chunk
    belongs to exactly one slice, none empty; the finish parts cover [0, Hd) once, none empty."""
    L = ChunkedLaunch(tokens=C, block_t=bt, block_k=bk, slice_h=slice_h, finish_h=max(32, slice_h), finish_block_h=32)
    c, n_chunks, n, cps, got_bk = L.plan(T, Hd)
    bt = L.tile(T)[0]  # a call of at most small_t tokens (GPU) takes 64-token tiles
    assert got_bk == bk and c % bt == 0 and c <= C and (n_chunks - 1) * c < T <= n_chunks * c
    chunks = -(-Hd // bk)
    assert 1 <= n <= min(chunks, max(-(-chunks // (slice_h // bk)), MAX_SLICES)) and cps >= 1
    assert (n - 1) * cps < chunks <= n * cps
    parts, h = L.finish_plan(c, Hd)
    assert h % 32 == 0 and (parts - 1) * h < Hd <= parts * h


@pytest.mark.parametrize(
    "T,Hd,bt,bk,slice_h",
    [
        (1, 4096, 128, 32, 128),
        (4096, 4096, 128, 32, 128),
        (4096, 4096, 128, 16, 128),
        (19, 320, 16, 128, 128),
        (3000, 7168, 64, 32, 256),
        (7, 100, 16, 16, 32),
    ],
)
def test_one_pass_plan_covers_every_chunk_once(T, Hd, bt, bk, slice_h):
    """Every BLOCK_K chunk belongs to exactly one slice and no slice is empty; the grid is (tiles + lag)·slices."""
    L = OnePassLaunch(block_t=bt, block_k=bk, slice_h=slice_h)
    tiles, n, cps, got_bk = L.plan(T, Hd)
    chunks = -(-Hd // bk)
    assert got_bk == bk and tiles == -(-T // bt) and ONE_PASS_LAG >= 1
    assert 1 <= n <= chunks and cps >= 1
    assert (n - 1) * cps < chunks <= n * cps


def test_launch_is_explicit():
    """Every launch choice travels as an argument: each design's launch round-trips through the custom ops'
    ``launch`` int[] (their schema: the design, then its fields), and tiles a kernel cannot take are refused up
    front."""
    for L in (
        *DEFAULT.values(),
        OneKernelLaunch(block_t=32, sinkhorn_block=64),
        SplitKLaunch(target_programs=7, splits=3),
        OnePassLaunch(one_dot=1, maxnreg=None),
        *DESIGNS.values(),
        *(ChunkedLaunch.for_device(interpreted=i, **f) for i in (False, True) for f in CHUNKED_RUNGS.values()),
    ):
        for op in PACKED_OPS:
            back = MhcLaunch.from_op_args(*L.op_args(op), op=op)
            assert back == L and type(back) is type(L)
    assert OnePassLaunch().pre_like_fused() == OnePassLaunch(stages=4, maxnreg=None, one_dot=1)
    for L in (OneKernelLaunch(), SplitKLaunch(), ChunkedLaunch()):
        assert L.pre_like_fused() is L  # the same kernels run the pre part of the fused op (chunked: post then pre)
    # the defaults per device: chunked for every op on a GPU; split-K for pre / head and one kernel for fused in
    # the interpreter, which pays for every program
    want = {op: ChunkedLaunch() for op in OPS} if not interpreting() else {op: SplitKLaunch() for op in OPS}
    if interpreting():
        want["fused_post_pre"] = OneKernelLaunch()
    assert DEFAULT == want
    gpu = ChunkedLaunch.for_device(interpreted=False)
    assert (gpu.tokens, gpu.block_t, gpu.fn_layout, gpu.zigzag) == (4096, 128, 3, True)
    with pytest.raises(ValueError, match="op: expected one of"):
        mhc.default_launch("mix")
    with pytest.raises(TypeError, match="launch: MhcLaunch is the base"):
        MhcLaunch()
    with pytest.raises(ValueError, match="launch.tokens: expected a multiple of the chunked token tiles"):
        ChunkedLaunch(tokens=100, block_t=16, finish_block_t=16)
    with pytest.raises(ValueError, match=r"launch.tokens: expected a multiple of the chunked token tiles \(128\)"):
        ChunkedLaunch.for_device(interpreted=False, tokens=16)
    with pytest.raises(ValueError, match="launch.fn_layout: 3 needs stream_k"):
        ChunkedLaunch(stream_k=False, fn_layout=3)
    with pytest.raises(ValueError, match="launch.fn_layout: expected 0, 2 or 3"):
        ChunkedLaunch(fn_layout=1)
    with pytest.raises(TypeError, match="launch.zigzag: expected a bool"):
        ChunkedLaunch(zigzag=1)
    with pytest.raises(ValueError, match="launch.one_dot: expected an int in"):
        OnePassLaunch(one_dot=3)
    with pytest.raises(ValueError, match="launch.maxnreg: expected an int in"):
        OnePassLaunch(maxnreg=300)
    with pytest.raises(ValueError, match="launch.block_t: expected >= 16"):
        OneKernelLaunch(block_t=8)
    with pytest.raises(ValueError, match="launch.block_k: expected a power of two"):
        SplitKLaunch(block_k=48)
    with pytest.raises(ValueError, match="launch.splits: expected an int"):
        SplitKLaunch(splits=0)
    with pytest.raises(ValueError, match="launch.post_block_h: expected a power of two"):
        ChunkedLaunch(post_block_h=100)
    with pytest.raises(TypeError):  # a design's launch has only its own knobs
        ChunkedLaunch(splits=3)
    with pytest.raises(TypeError, match="launch: expected a OneKernelLaunch"):
        mhc.pre(*case(2, 256)[:1], *case(2, 256)[2:], launch={"split_k": True})


LAUNCH_CLASSES = {c.__name__: c for c in (OneKernelLaunch, SplitKLaunch, OnePassLaunch, ChunkedLaunch)}


def _notebook_launches(path) -> list[tuple[int, type, dict]]:
    """(line, class, fields) of every launch (``OneKernelLaunch(...)``, ``ChunkedLaunch(...)``, …) a notebook
    source builds, and of every ``dataclasses.replace`` of a name bound to one (that launch's fields, then its
    own): keyword arguments only, each a literal, so that what the test checks is what the notebook builds."""
    import ast

    tree = ast.parse(path.read_text())
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    targets = {
        id(n.value): [t.id for t in n.targets if isinstance(t, ast.Name)] for n in ast.walk(tree) if isinstance(n, ast.Assign)
    }
    bound: dict[str, tuple[type, dict]] = {}
    out = []
    for call in calls:
        name = getattr(call.func, "attr", getattr(call.func, "id", ""))
        if name in LAUNCH_CLASSES:
            assert not call.args, f"line {call.lineno}: {name} takes keywords only"
            cls, kw = LAUNCH_CLASSES[name], {}
        elif name == "replace" and call.args and isinstance(call.args[0], ast.Name) and call.args[0].id in bound:
            cls, kw = bound[call.args[0].id][0], dict(bound[call.args[0].id][1])
        else:
            continue
        for k in call.keywords:
            assert k.arg is not None, f"line {call.lineno}: no **kwargs"
            kw[k.arg] = ast.literal_eval(k.value)
        out.append((call.lineno, cls, kw))
        for t in targets.get(id(call), ()):
            bound[t] = (cls, kw)
    return out


def test_notebook_launches_are_legal_on_every_device():
    """Every launch notebook 03 builds is legal with the GPU's defaults and with the interpreter's
    (``for_device``), so the notebook runs unchanged on either: a launch written for the interpreter's tiles
    (chunks of 16 tokens) is refused on a GPU, whose chunked token tile is 128."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "notebooks" / "src" / "03_mhc_ops.py"
    found = _notebook_launches(path)
    assert len(found) >= 5, found
    assert {cls for _line, cls, _kw in found} == set(LAUNCH_CLASSES.values())  # every rung of the ladder
    for _line, cls, kw in found:
        for interpreted in (False, True):
            cls.for_device(interpreted=interpreted, **kw)  # raises, naming the field, where illegal
    with pytest.raises(ValueError, match="launch.tokens"):  # what the guard is for
        ChunkedLaunch.for_device(interpreted=False, tokens=16)


def _gpu_launches() -> list[tuple[str, MhcLaunch]]:
    """(where, launch) of every mHC launch notebook 03 and the GPU runs of this file make, each with the GPU's
    defaults for the fields it leaves out (``for_device``)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "notebooks" / "src" / "03_mhc_ops.py"
    out = [(f"notebook 03 line {line}", cls.for_device(interpreted=False, **kw)) for line, cls, kw in _notebook_launches(path)]
    out += [(f"DESIGNS {k}", type(L).for_device(interpreted=False)) for k, L in DESIGNS.items() if k != "chunked"]
    chunked = lambda **kw: ChunkedLaunch.for_device(interpreted=False, **kw)  # noqa: E731
    out += [("DESIGNS chunked", chunked(tokens=256)), ("DEFAULT", chunked())]
    out += [(f"rung {r}, C {c}", chunked(tokens=c, **kw)) for r, kw in CHUNKED_RUNGS.items() for c in (1024, 4096)]
    out += [(f"one pass SMALL, one_dot {d}", OnePassLaunch.for_device(interpreted=False, one_dot=d, **SMALL)) for d in (1, 2)]
    for stream_k, layout in ((False, 0), (True, 0), (False, 2), (True, 2), (True, 3)):
        out.append((f"CHUNK_SMALL {stream_k} {layout}", chunked(stream_k=stream_k, fn_layout=layout, **CHUNK_SMALL)))
    out.append(("small_t", chunked(tokens=128, block_t=128, small_t=64)))
    return out


def test_gpu_launches_fit_hopper_shared_memory():
    """Every launch notebook 03 and this file's GPU tests make asks for at most a Hopper program's shared memory
    (``dsv4ref.tools.smem``: an estimate from the tiles, their dtypes and the stages), for pre, fused and head, at
    a long call's tiles and a short one's. The interpreter never compiles, so without this a launch too big for
    the GPU (the rung "four streams per dot" at 64-dim steps) passes here and fails there with OutOfResources.
    The estimate gives the two figures the GPU reported for that launch, bit for bit."""
    too_big = ChunkedLaunch.for_device(interpreted=False, stream_k=False, fn_layout=0, block_k=64)
    assert mhc_smem(too_big, "pre") == 458_752 and mhc_smem(too_big, "pre", T=37) == 360_448  # as compiled
    bad = []
    for where, L in _gpu_launches():
        for op in ("pre", "fused", "head"):
            for T in (None, 37):
                if (need := mhc_smem(L, op, T)) > HOPPER_SMEM_PER_PROGRAM:
                    bad.append(f"{where}: {op} at T = {T or 'long'} needs {need} bytes")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("design", list(DESIGNS))
def test_empty_batch_every_function(backend, design):
    """T = 0 on every backend and design: empty outputs of the right shapes and dtypes (the reference once
    crashed here, in ``reshape(T, -1)``)."""
    launch = DESIGNS[design]
    res, x, fn, scale, base = case(0, 256)
    hfn, hscale, hbase = mhc.example_params(256, head=True)
    p0, c0 = torch.zeros(0, 4, device=DEVICE), torch.zeros(0, 4, 4, device=DEVICE)
    kw = dict(backend=backend, launch=launch)
    p, c, li = mhc.pre(res, fn, scale, base, **kw)
    assert (p.shape, c.shape, li.shape) == ((0, 4), (0, 4, 4), (0, 256)) and li.dtype == torch.bfloat16
    new, p2, c2, li2 = mhc.fused_post_pre(x, res, p0, c0, fn, scale, base, **kw)
    assert (new.shape, p2.shape, c2.shape, li2.shape) == ((0, 4, 256), (0, 4), (0, 4, 4), (0, 256))
    assert mhc.post(x, res, p0[:, :, None], c0, **kw).shape == (0, 4, 256)
    assert mhc.head(res, hfn, hscale, hbase, **kw).shape == (0, 256)
    assert mhc.sinkhorn(torch.zeros(0, 4, 4, device=DEVICE), **kw).shape == (0, 4, 4)


# ====================================================================================================
# Bad input
# ====================================================================================================


def test_bad_inputs_name_the_argument():
    res, x, fn, scale, base = case(2, 256)
    p, c, _ = mhc.pre(res, fn, scale, base)
    with pytest.raises(ValueError, match=r"fn: expected 24 rows \(M·\(M\+2\)\)"):
        mhc.pre(res, fn[:20], scale, base)
    with pytest.raises(ValueError, match=r"fn: expected 1024 columns"):
        mhc.pre(res, fn[:, :512], scale, base)
    with pytest.raises(TypeError, match="residual: expected dtype torch.bfloat16"):
        mhc.pre(res.float(), fn, scale, base)
    with pytest.raises(TypeError, match="fn: expected dtype torch.float32"):
        mhc.pre(res, fn.bfloat16(), scale, base)
    with pytest.raises(ValueError, match="scale: expected shape"):
        mhc.pre(res, fn, scale[:2], base)
    with pytest.raises(ValueError, match="base: expected shape"):
        mhc.pre(res, fn, scale, base[:16])
    with pytest.raises(ValueError, match=r"x: expected shape \(2, 256\)"):
        mhc.post(x[:, :128], res, p, c)
    with pytest.raises(ValueError, match="post: expected shape"):
        mhc.post(x, res, p[:, :3], c)
    with pytest.raises(ValueError, match="comb: expected shape"):
        mhc.post(x, res, p, c[:, :3])
    with pytest.raises(ValueError, match=r"fn: expected 4 rows"):
        mhc.head(res, fn, scale[:1], base[:4])
    with pytest.raises(ValueError, match="residual: the Triton kernels are written for M = 4"):
        mhc.post(x, res[:, :3].contiguous(), p[:, :3].contiguous(), c[:, :3, :3].contiguous())
    with pytest.raises(ValueError, match="logits: expected"):
        mhc.sinkhorn(torch.zeros(2, 4, 3, device=DEVICE))
    with pytest.raises(ValueError, match="logits: the Triton kernels are written for M = 4"):  # not "residual"
        mhc.sinkhorn(torch.zeros(2, 5, 5, device=DEVICE))
    with pytest.raises(ValueError, match="hidden: the Triton kernels"):
        mhc.head(res[:, :3].contiguous(), fn[:3, : 3 * 256].contiguous(), scale[:1], base[:3])
    with pytest.raises(ValueError, match="backend"):
        mhc.pre(res, fn, scale, base, backend="cuda")
    bad = res.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="residual: non-finite values"):
        mhc.pre(bad, fn, scale, base)
    bad_fn = fn.clone()
    bad_fn[0, 0] = float("inf")
    with pytest.raises(ValueError, match="fn: non-finite values"):
        mhc.fused_post_pre(x, res, p, c, bad_fn, scale, base)
    bad_x = x.clone()
    bad_x[0, 0] = float("-inf")
    with pytest.raises(ValueError, match="x: non-finite values"):
        mhc.post(bad_x, res, p, c)
    with validate.checking_values(False):  # the value checks cost a sync; they can be off
        mhc.post(bad_x, res, p, c)


def test_split_cache_keeps_every_live_weight_and_drops_freed_ones():
    """``split_fn`` / ``split_fn_wide`` are cached per live weight, with no count limit (a model with 100 mHC
    sites must not rebuild them per call), rebuilt after an in-place update, and dropped when the weight dies."""
    import gc

    from dsv4ref.mhc import fn_split

    fns = [mhc.example_params(40, seed=100 + i)[0] for i in range(40)]
    first = [mhc.split_fn(f) for f in fns]
    wide = [split_fn_wide(fs) for fs in first]
    assert all(mhc.split_fn(f) is fs for f, fs in zip(fns, first))  # all 40 still cached
    assert all(split_fn_wide(fs) is w for fs, w in zip(first, wide))
    fns[0].mul_(2)  # an in-place update: a new split, with the new values
    again = mhc.split_fn(fns[0])
    assert again is not first[0] and torch.equal(again.float().sum(0), 2 * first[0].float().sum(0))
    n = len(fn_split._DERIVED)
    del fns, first, wide, again
    gc.collect()
    assert len(fn_split._DERIVED) <= n - 80  # every freed weight's entries (40 splits, 40 wide copies) gone


def test_chunk_small_t_decode_sized_calls_take_64_token_tiles():
    """``ChunkedLaunch.small_t``: a call of at most that many tokens runs pre's partial kernel (and the fused op's,
    as post + pre) on 64-token tiles at 4 warps, a longer one on ``block_t``; the fused K loop keeps its
    tile. The small-call path against the fp64 oracle, through the custom ops with poisoned outputs."""
    L = ChunkedLaunch(tokens=128, block_t=128, small_t=64)
    assert L.tile(64)[:3] == (64, L.block_k, 4) and L.tile(65)[0] == 128
    assert L.tile() == L.tile(65)
    assert L.plan(37, 88)[0] == 64 and L.plan(100, 88)[0] == 128
    with pytest.raises(ValueError, match="launch.small_t"):
        ChunkedLaunch(small_t=-1)
    (p, c, li), fused, head = check_design(L, 40, 88, seed=47, custom_ops=True)
    # the other walk on the same inputs (one 64-token tile, so the walk is the only change): the same bits as the
    # outputs check_design held to the fp64 oracle
    Z = dataclasses.replace(L, zigzag=not L.zigzag)
    res, x, fn, scale, base = case(40, 88, seed=47)
    hfn, hscale, hbase = mhc.example_params(88, seed=48, head=True)
    for a, b in zip(triton_pre(res, fn, scale, base, launch=Z), (p, c, li)):
        assert_close(a, b, "exact")
    for a, b in zip(triton_fused(x, res, p, c, fn, scale, base, launch=Z), fused):
        assert_close(a, b, "exact")
    assert_close(triton_head(res, hfn, hscale, hbase, launch=Z), head, "exact")
