"""dsv4ref.moe: routing, the FP8 input staging, the clamped-SwiGLU experts and the combine (docs/moe.md).

Oracles written here, independent of the library's code paths: routing weights from float64 scores of the same
logits, staging bytes from the integer E4M3 encoder and an exponent taken with ``frexp`` (not the bit
tricks the library uses), expert outputs from the float64 reference without any bf16 rounding, compared
under the "moe_out" tolerance (the bf16 roundings of h, of each expert output and of the result bound the
error by 2^-8 of |out| + Σ|h|·|W2|). Every kernel output buffer is poisoned before the kernel runs.

Each MoE pitfall of docs/moe.md#pitfalls has a test named ``test_p<N>_...``.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from dsv4ref import moe
from dsv4ref.device import DEVICE
from dsv4ref.moe import reference as ref
from dsv4ref.moe.launch import tile_table
from dsv4ref.moe.variants.stage import StageVariant
from dsv4ref.moe.variants.stage import stage_into as variant_stage_into
from dsv4ref.testing import assert_close, compare, generator, poison, randn

BACKENDS = ["reference", "triton"]
# staging: "triton-4x256" is the triton backend on 4 × 256 tiles (several column blocks at Hd 256+: only block 0
# copies the top-k)
SMALL_TILE = moe.MoeLaunch(stage_block_t=4, stage_block_h=256)
STAGE_BACKENDS = ["reference", "triton", "triton-4x256"]
SHAPE = moe.TINY_MOE  # Hd 256, E 8, K 2, I 128


# ----------------------------------------------------------------------------------------------------
# oracles
# ----------------------------------------------------------------------------------------------------


def int_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 → e4m3fn byte with integer ops only: clamp ±448, round to nearest even on the code grid; the
    sign bit from the sign of y (−0.0 → 0x80)."""
    a = y.float().abs().clamp(max=448.0)
    bits = a.view(torch.int32).long()
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    sub = torch.round(a.double() * 512).long()  # a < 2^-6: a multiple of 2^-9; torch.round is half-to-even
    code = torch.where(a < 2.0**-6, sub, normal)
    return (code | (torch.signbit(y).long() << 7)).to(torch.uint8)


def oracle_byte(amax: torch.Tensor) -> torch.Tensor:
    """127 + ceil(log2(fp32(max(amax, 1e-4) / 448))) from frexp (s = m·2^x, m in [0.5, 1))."""
    s = amax.float().clamp_min(1e-4) / 448.0
    m, x = torch.frexp(s.double())
    return (x - (m == 0.5).long() + 127).clamp(1, 254)


def oracle_stage(hidden: torch.Tensor):
    """(x_fp8 bytes uint8 [T, Hd], x_sf int32 [T, Hd/128]) from the definitions, on the CPU."""
    g = hidden.detach().cpu().float().reshape(hidden.shape[0], -1, 32)
    byte = oracle_byte(g.abs().amax(-1))  # [T, Hd/32] int64
    q = int_e4m3(g * torch.exp2(127.0 - byte.double()).float()[..., None])
    word = sum(byte.reshape(byte.shape[0], -1, 4)[..., j] << (8 * j) for j in range(4))  # uint32 value
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same 32 bits, as int32
    return q.reshape(hidden.shape), word


def staged_bytes(x_fp8):
    return x_fp8.view(torch.uint8).cpu()


def oracle_out(x, x_fp8, x_sf, ids, w, d, *, limit=None, shared=True, limits=None):
    """(float64 output, mass) of the experts on the staged x (no roundings); ``limits`` = (routed L, shared L)."""
    lr, ls = limits or (d["swiglu_limit"] if limit is None else limit,) * 2
    sw = (d["shared_w13"], d["shared_w2"]) if shared else (None, None)
    kw = dict(dtype=torch.float64)
    out = ref.experts(x, x_fp8, x_sf, ids, w, d["w13"], d["w2"], None, None, swiglu_limit=lr, **kw)
    mass = ref.experts(x, x_fp8, x_sf, ids, w, d["w13"], d["w2"], None, None, swiglu_limit=lr, mass=True, **kw)
    if shared:
        one = torch.ones(x.shape[0], device=x.device)
        out = out + ref.expert_mlp(x, *sw, one, ls, torch.float64)
        mass = mass + ref.expert_mlp(x, *sw, one, ls, torch.float64, mass=True)
    return out, mass


def run_experts(x, staged, d, ids=None, w=None, *, shared=True, limit=None, backend="triton"):
    """The experts (Triton unless ``backend`` says otherwise) into a poisoned output buffer."""
    x_fp8, x_sf, ids0, w0 = staged
    out = poison((x.shape[0], x.shape[1]), torch.bfloat16)
    sw = (d["shared_w13"], d["shared_w2"]) if shared else (None, None)
    moe.experts(
        x,
        x_fp8,
        x_sf,
        ids0 if ids is None else ids,
        w0 if w is None else w,
        d["w13"],
        d["w2"],
        *sw,
        swiglu_limit=d["swiglu_limit"] if limit is None else limit,
        out=out,
        backend=backend,
    )
    return out


def routed(d, T=None):
    ids, w = moe.route(
        d["x"],
        d["gate_weight"],
        d["bias"],
        k=d["k"],
        routed_scale=d["routed_scale"],
        hash_table=d["hash_table"],
        input_ids=d["input_ids"],
    )
    return ids, w


def selector_w2(E, Hd, I):
    """W2 [E, Hd, I] bf16 as a one-hot selector: output dim j is h[j % I], so an expert's output is bf16(h)
    column by column and every down-projection is exact."""
    w2 = torch.zeros(E, Hd, I, dtype=torch.bfloat16)
    w2[:, torch.arange(Hd), torch.arange(Hd) % I] = 1.0
    return w2.to(DEVICE)


def one_hot_x(z, Hd=8):
    """x [1, Hd] = e_0 and W_gate [E, Hd] with column 0 = z, so the gate logits are exactly z (bf16 values)."""
    z = torch.as_tensor(z, dtype=torch.float32)
    x = torch.zeros(1, Hd, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    W = torch.zeros(z.numel(), Hd, dtype=torch.bfloat16)
    W[:, 0] = z.to(torch.bfloat16)
    assert torch.equal(W[:, 0].float(), z), "z must be exact in bf16"
    return x.to(DEVICE), W.to(DEVICE)


# ----------------------------------------------------------------------------------------------------
# routing
# ----------------------------------------------------------------------------------------------------

Z = [0, 1, 2, 3, -1, -2, 0.5, 4]
WORKED = {  # case: (bias, ids, weights); E = 8, K = 2, routed scale 1.5
    "A_bias_excludes_top": ({7: -10.0}, [3, 2], [0.8173183, 0.6826817]),
    "B_no_bias": ({}, [7, 3], [0.8016948, 0.6983052]),
    "C_bias_selects_weak": ({4: 5.0}, [4, 7], [0.3274070, 1.1725930]),
    "D_full_tie": ("zero_gate", [0, 1], [0.75, 0.75]),
}


@pytest.mark.parametrize("case", list(WORKED))
def test_route_worked_examples(case):
    b, want_ids, want_w = WORKED[case]
    x, W = one_hot_x([0.0] * 8 if b == "zero_gate" else Z)
    bias = torch.zeros(8, device=DEVICE)
    for e, v in ({} if b == "zero_gate" else b).items():
        bias[e] = v
    ids, w = moe.route(x, W, bias, k=2, routed_scale=1.5)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids[0].tolist() == want_ids
    assert_close(w[0].double(), torch.tensor(want_w, dtype=torch.float64), "route_weights", case)


def test_worked_example_scores():
    s = ref.scores(torch.tensor(Z, dtype=torch.float32))
    want = [0.8325546, 1.1459763, 1.4583992, 1.7460204, 0.5596979, 0.3562696, 0.9869534, 2.0045323]
    assert_close(s.double(), torch.tensor(want, dtype=torch.float64), "route_weights", "s(z)")
    assert s[0].item() == pytest.approx(math.sqrt(math.log(2)), rel=1e-7)


def test_route_properties():
    d = moe.example_inputs(64, SHAPE, seed=3)
    ids, w = routed(d)
    assert (w >= 0).all() and ((ids >= 0) & (ids < SHAPE.experts)).all()
    assert (ids.sort(-1).values.diff(dim=-1) != 0).all(), "ids repeat within a row"
    assert_close(w.sum(-1).double(), torch.full((64,), 1.5, dtype=torch.float64), "route_weights", "row sums")


def test_bias_never_weighs():
    """Spec test 3 (and pitfall P1): recompute the selected weights from the unbiased scores with the same
    fp32 operations; they must be bit-identical to the router's."""
    d = moe.example_inputs(32, SHAPE, seed=4)
    ids, w = routed(d)
    s = ref.scores(d["x"].float() @ d["gate_weight"].float().T)
    g = s.gather(1, ids.long())
    assert_close(w, g / g.sum(-1, keepdim=True).clamp_min(1e-20) * 1.5, "exact", "weights from s alone")


def test_p1_near_uniform_bias_selects_but_does_not_flatten():
    """With V4-Flash's bias (≈ 8.08 on every expert), weights taken from s + b would all be ≈ 1.5/K; the real
    weights follow s and differ from that by far more than rounding."""
    d = moe.example_inputs(32, SHAPE, seed=5)
    ids, w = routed(d)
    s = ref.scores(d["x"].float() @ d["gate_weight"].float().T)
    sb = (s + d["bias"]).gather(1, ids.long())
    flat = sb / sb.sum(-1, keepdim=True) * 1.5
    assert (flat - 0.75).abs().max() < 0.1  # biased weights are nearly uniform ...
    assert (w - flat).abs().max() > 0.3  # ... the router's are not
    assert not compare(w.double(), flat.double(), "route_weights").passed


@pytest.mark.parametrize("K", [1, 2, 3])
def test_ties_lower_id_wins(K):
    x, W = one_hot_x([0.0] * 8)
    ids, _ = moe.route(x, W, torch.zeros(8, device=DEVICE), k=K, routed_scale=1.5)
    assert ids[0].tolist() == list(range(K))
    # two experts equal at the K-th place (s + b): experts 5 and 2 tie after expert 6; 2 must win
    x, W = one_hot_x([0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 4.0, -1.0])
    ids, _ = moe.route(x, W, torch.zeros(8, device=DEVICE), k=2, routed_scale=1.5)
    assert ids[0].tolist() == [6, 2]
    # descending (s + b), ties by ascending id, in the row's order
    x, W = one_hot_x([1.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    ids, _ = moe.route(x, W, torch.zeros(8, device=DEVICE), k=4, routed_scale=1.5)
    assert ids[0].tolist() == [1, 2, 3, 0]


ZS = [-200.0, -104.0, -87.0, -20.0, -16.64, 0.0, 20.0, 20.0001, 30.0, 88.7, 100.0]


def test_p2_softplus_extremes_use_log1p():
    z = torch.tensor(ZS, dtype=torch.float32)
    s = ref.scores(z)
    assert torch.isfinite(s).all() and (s >= 0).all()
    z64 = z.double()
    want = torch.sqrt(torch.where(z64 > 20, z64, torch.log1p(torch.exp(z64))))
    keep = z >= -87
    assert_close(s[keep].double(), want[keep], "route_weights", "s(z), z >= -87")
    assert (s[z <= -104] == 0).all()
    naive = torch.sqrt(torch.log(1 + torch.exp(z)))  # the bug: 0 for z <= -16.6 in fp32
    assert naive[4].item() == 0.0 and s[4].item() > 0
    # a row whose selected logits are all ≈ -20: real weights (0.75 each), where the naive form gives 0/0
    x, W = one_hot_x([-20.0, -20.0, -30.0, -40.0, -50.0, -60.0, -70.0, -80.0])
    ids, w = moe.route(x, W, torch.zeros(8, device=DEVICE), k=2, routed_scale=1.5)
    assert ids[0].tolist() == [0, 1]
    assert_close(w[0].double(), torch.tensor([0.75, 0.75], dtype=torch.float64), "route_weights")


def test_p3_all_underflow_row_gives_zero_weights_not_nan():
    x, W = one_hot_x([-200.0] * 8)
    for hash_table in (None, torch.tensor([[3, 5]], device=DEVICE)):
        ids, w = moe.route(
            x,
            W,
            torch.zeros(8, device=DEVICE),
            k=2,
            routed_scale=1.5,
            hash_table=hash_table,
            input_ids=None if hash_table is None else torch.zeros(1, dtype=torch.int64, device=DEVICE),
        )
        assert torch.equal(w, torch.zeros_like(w)), w


def test_p4_ungrouped_sqrtsoftplus_routing():
    """V4 has no group-limited top-k and no sigmoid: the top-K over all experts of s + b, weighted by
    sqrt(softplus). E = 8 seen as V3's 4 groups of 2: experts 0 and 1 (one group) are the top 2 here, which
    V3's "best groups first" rule with K = 2 out of 2 groups would also allow; so test the weights (sigmoid
    would give other numbers) and a brute-force top-K on random data."""
    d = moe.example_inputs(48, SHAPE, seed=6)
    ids, w = routed(d)
    s = ref.scores(d["x"].double() @ d["gate_weight"].double().T)
    key = s + d["bias"].double()
    brute = key.topk(d["k"], dim=-1).indices
    assert torch.equal(ids.long().sort(-1).values, brute.sort(-1).values)
    z = (d["x"].float() @ d["gate_weight"].float().T).gather(1, ids.long())
    sig = torch.sigmoid(z) / torch.sigmoid(z).sum(-1, keepdim=True) * 1.5
    assert not compare(w.double(), sig.double(), "route_weights").passed


def test_hash_layer_uses_the_table_and_never_reads_the_bias():
    d = moe.example_inputs(16, SHAPE, seed=7, hash_layer=True)
    nan_bias = torch.full((SHAPE.experts,), float("nan"), device=DEVICE)
    for bias in (nan_bias, None):
        ids, w = moe.route(
            d["x"], d["gate_weight"], bias, k=2, routed_scale=1.5, hash_table=d["hash_table"], input_ids=d["input_ids"]
        )
        assert torch.equal(ids.long(), d["hash_table"][d["input_ids"]])  # the table's order, not sorted
        s = ref.scores(d["x"].double() @ d["gate_weight"].double().T).gather(1, ids.long())
        assert_close(w.double(), s / s.sum(-1, keepdim=True) * 1.5, "route_weights", "hash weights")
    with pytest.raises(ValueError, match="input_ids"):
        moe.route(d["x"], d["gate_weight"], None, k=2, routed_scale=1.5, hash_table=d["hash_table"])


def test_hash_table_duplicate_row_rejected():
    d = moe.example_inputs(4, SHAPE, seed=8, hash_layer=True)
    table = d["hash_table"].clone()
    table[d["input_ids"][2]] = torch.tensor([3, 3])
    with pytest.raises(ValueError, match="repeats an expert"):
        moe.route(d["x"], d["gate_weight"], None, k=2, routed_scale=1.5, hash_table=table, input_ids=d["input_ids"])
    with pytest.raises(ValueError, match="hash_table"):
        bad = d["hash_table"].clone()
        bad[d["input_ids"][0], 0] = SHAPE.experts
        moe.route(d["x"], d["gate_weight"], None, k=2, routed_scale=1.5, hash_table=bad, input_ids=d["input_ids"])


@pytest.mark.parametrize("hash_layer", [False, True])
def test_padding_rows(hash_layer):
    d = moe.example_inputs(6, SHAPE, seed=9, hash_layer=hash_layer)
    ids_in = d["input_ids"] if hash_layer else torch.arange(6, device=DEVICE)
    ids_in = ids_in.clone()
    ids_in[[1, 4]] = -1
    ids, w = moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=1.5, hash_table=d["hash_table"], input_ids=ids_in)
    assert (ids[[1, 4]] == -1).all() and torch.equal(w[[1, 4]], torch.zeros(2, 2, device=DEVICE))
    assert (ids[[0, 2, 3, 5]] >= 0).all()


def test_route_signature_and_argument_errors():
    assert str(inspect.signature(moe.route)) == (
        "(x, gate_weight, bias, *, k, routed_scale, hash_table=None, input_ids=None, backend='auto')"
    )
    d = moe.example_inputs(2, SHAPE, seed=10)
    with pytest.raises(ValueError, match="k:"):
        moe.route(d["x"], d["gate_weight"], d["bias"], k=9, routed_scale=1.5)
    with pytest.raises(TypeError, match="bias"):
        moe.route(d["x"], d["gate_weight"], None, k=2, routed_scale=1.5)
    with pytest.raises(ValueError, match="backend"):
        moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=1.5, backend="triton")


# ----------------------------------------------------------------------------------------------------
# staging
# ----------------------------------------------------------------------------------------------------


def stage_with(backend, hidden, ids, w, launch=None):
    """stage() through stage_into on poisoned buffers (so an unwritten byte shows); backend "triton-4x256" is
    "triton" with the SMALL_TILE launch; a ``StageVariant`` launch runs ``dsv4ref.moe.variants.stage``."""
    T, Hd = hidden.shape
    K = ids.shape[1]
    bufs = (
        poison((T, Hd), torch.float8_e4m3fn),
        poison((T, Hd // 128), torch.int32),
        poison((T, K), torch.int64),
        poison((T, K), torch.float32),
    )
    if backend == "triton-4x256":
        backend, launch = "triton", launch or SMALL_TILE
    if isinstance(launch, StageVariant):
        variant_stage_into(hidden, ids, w, *bufs, launch)
    else:
        moe.stage_into(hidden, ids, w, *bufs, backend=backend, launch=launch)
    return bufs


def check_staged(staged, hidden, ids, w):
    q, sf = oracle_stage(hidden)
    assert torch.equal(staged_bytes(staged[0]), q), "x_fp8 bytes"
    assert torch.equal(staged[1].cpu(), sf), "x_sf words"
    assert staged[2].dtype == torch.int64 and torch.equal(staged[2].cpu(), ids.cpu().long())
    assert torch.equal(staged[3].view(torch.int32).cpu(), w.view(torch.int32).cpu()), "weights bits"


def worked_block() -> torch.Tensor:
    """One token, Hd = 256: block 0 = groups (zeros with a −0.0, amax 1.0, amax 448, amax 450), block 1 =
    groups (all zero, amax 1.75, amax 0.01, all zero)."""
    h = torch.zeros(1, 256)
    h[0, 5] = -0.0
    h[0, 32:35] = torch.tensor([1.0, 0.5, -1.0])
    h[0, 64:66] = torch.tensor([448.0, -448.0])
    h[0, 96:98] = torch.tensor([450.0, -450.0])
    h[0, 160] = 1.75
    h[0, 192] = 0.01
    return h.to(torch.bfloat16)


@pytest.mark.parametrize("backend", STAGE_BACKENDS)
def test_stage_worked_table_and_packed_words(backend):
    h = worked_block().to(DEVICE)
    ids = torch.tensor([[3, -1]], dtype=torch.int32, device=DEVICE)
    w = torch.tensor([[1.5, 0.0]], device=DEVICE)
    st = stage_with(backend, h, ids, w)
    check_staged(st, h, ids, w)
    word = st[1][0].cpu()
    assert word[0].item() == -2139130007  # bytes (105, 119, 127, 128) = 0x807F7769: bit 31 set by byte 3
    assert word[1].item() == (105 | 119 << 8 | 112 << 16 | 105 << 24)
    assert torch.equal(
        stage_with(backend, torch.zeros(1, 128, dtype=torch.bfloat16, device=DEVICE), ids, w)[1].cpu(),
        torch.tensor([[1768515945]], dtype=torch.int32),
    )  # 0x69696969
    b = staged_bytes(st[0])[0]
    assert [b[i].item() for i in (0, 5, 32, 33, 64, 96, 97)] == [0x00, 0x80, 0x78, 0x70, 0x7E, 0x76, 0xF6]
    assert b[160].item() == 0x7E  # 1.75 = 448·2^-8 exactly: byte 119, not 120


@pytest.mark.parametrize("backend", STAGE_BACKENDS)
def test_p7_p8_amax_448_pow2_in_each_lane(backend):
    """amax = 448·2^k for k = −20..20 in each of the four lanes (bytes) of a packed word: byte 127 + k
    exactly (a float log2 goes one too high: P8), and lane 3 ≥ 128 makes the word negative (a saturating
    int cast would clamp it: P7)."""
    ks = list(range(-20, 21))
    h = randn((len(ks), 512), seed=11, block=32, octaves=10, device="cpu").float()
    for r, k in enumerate(ks):
        for lane in range(4):  # block `lane`, lane `lane`
            g = slice(128 * lane + 32 * lane, 128 * lane + 32 * lane + 32)
            h[r, g] = h[r, g] / h[r, g].abs().max() * (448.0 * 2.0**k) * 0.5
            h[r, 128 * lane + 32 * lane + (r % 32)] = -448.0 * 2.0**k
    h = h.to(torch.bfloat16).to(DEVICE)
    ids = torch.zeros(len(ks), 2, dtype=torch.int64, device=DEVICE)
    w = torch.ones(len(ks), 2, device=DEVICE)
    st = stage_with(backend, h, ids, w)
    check_staged(st, h, ids, w)
    words = st[1].cpu().long()
    for lane in range(4):
        byte = (words[:, lane] >> (8 * lane)) & 0xFF
        assert byte.tolist() == [127 + k for k in ks], f"lane {lane}"
    assert ((words[:, 3] < 0) == torch.tensor([k >= 1 for k in ks])).all()


@pytest.mark.parametrize("backend", STAGE_BACKENDS)
def test_stage_random_rows_exact_and_decode_bound(backend):
    """Spec tests 9 and 10: groups over 24 octaves, −0.0 entries, all-zero groups (byte 105); the dequant of
    the staged bytes is exact and within max(2^-4·|x|, 2^-10·2^e) of the input."""
    h = randn((24, 384), seed=12, block=32, octaves=24, device="cpu")
    h[3, 64:96] = 0.0
    h[5, 7] = -0.0
    h[5, 9] = -0.0
    h = h.to(DEVICE)
    ids = torch.randint(-1, 8, (24, 6), generator=generator(13)).to(torch.int32).to(DEVICE)
    w = torch.rand(24, 6, generator=generator(14)).to(DEVICE)
    st = stage_with(backend, h, ids, w)
    check_staged(st, h, ids, w)
    words = st[1].cpu().long()
    assert (words[3, 0] >> 16) & 0xFF == 105
    deq = ref.dequantize_staged(st[0], st[1], torch.float64).cpu()
    byte = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], -1).reshape(24, -1)
    e = (byte - 127).double().repeat_interleave(32, dim=1)
    val = staged_bytes(st[0]).view(torch.float8_e4m3fn).double() * torch.exp2(e)
    assert torch.equal(deq, val), "dequant is exact"
    x = h.cpu().double()
    assert ((deq - x).abs() <= torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * torch.exp2(e))).all()


@pytest.mark.parametrize(
    "launch",
    [
        moe.MoeLaunch(stage_block_t=16, stage_block_h=256),
        moe.MoeLaunch(stage_block_t=8, stage_block_h=128, stage_warps=1),
    ],
    ids=["16x256", "8x128_w1"],
)
def test_stage_snap_every_finite_bf16(launch):
    """ue8m0_byte_bits + e4m3_snap against the integer oracle on every finite bf16 value (65280, T 255 × Hd 256):
    once in groups of 32 neighbouring bit patterns (the codes of every binade, both signs, the ue8m0 carry at
    mantissa 1.75), once shuffled, so that most groups span many octaves (e4m3 subnormals, values that round to
    ±0: −0 must stay 0x80, and ties to even at every grid spacing). The shuffled pass runs on the first launch
    only: a group's bytes depend on its 32 values, not on the tile that holds it, and the second launch's
    tiling is checked by the ordered pass."""
    bits = torch.arange(0, 0x10000, dtype=torch.int32)
    v = bits[(bits & 0x7F80) != 0x7F80].to(torch.int16).view(torch.bfloat16)  # the finite bit patterns
    ids = torch.zeros(255, 1, dtype=torch.int32, device=DEVICE)
    w = torch.ones(255, 1, device=DEVICE)
    shuffled = v[torch.randperm(v.numel(), generator=generator(40))]
    for h in (v, shuffled) if launch.stage_block_t == 16 else (v,):
        h = h.reshape(255, 256).to(DEVICE)
        check_staged(stage_with("triton", h, ids, w, launch), h, ids, w)


@pytest.mark.parametrize(
    "launch",
    [
        StageVariant(block_t=4, block_h=128, programs=5, prefetch=True),  # 16 tiles over 5 programs: 4, 3, 3, 3, 3
        StageVariant(block_t=2, block_h=256, programs=64, prefetch=True, stages=1),  # more programs than tiles
        moe.MoeLaunch(stage_block_t=4, stage_block_h=128, stage_topk_first=True),
        StageVariant(block_t=4, block_h=128, topk_first=True, cache="cs"),
        StageVariant(block_t=8, block_h=256, load="groups", encode="blocks", topk_first=True, cache=""),
        StageVariant(block_t=1, block_h=512, warps=1, topk_first=True, maxnreg=64),
        moe.MoeLaunch(stage_block_t=1, stage_block_h=512, stage_warps=1, stage_topk_first=True),
    ],
    ids=[
        "prefetch-5",
        "prefetch-many",
        "topk-first",
        "topk-first-cs",
        "topk-first-blocks",
        "topk-first-1x512-r64",
        "topk-first-1x512",
    ],
)
def test_stage_launches_and_variants_same_bytes(launch):
    """The shipped kernel's ``stage_topk_first`` (the top-k loads before the tile's) and the variants of
    ``dsv4ref.moe.variants.stage`` (a persistent grid whose programs load their next tile before encoding this one,
    ``.cs`` stores alone, the shared encoder with group loads, a register cap) change when bytes move, never
    which: staged bytes, packed words and top-k copies against the oracle, at T = 13 (a partial last token block)
    and Hd = 512 (several column blocks, only block 0 copies the top-k), from poisoned buffers."""
    h = randn((13, 512), seed=44, block=32, octaves=24, device="cpu")
    h[2, 40] = -0.0
    h = h.to(DEVICE)
    ids = torch.randint(-1, 256, (13, 6), generator=generator(45)).to(torch.int32).to(DEVICE)
    w = torch.rand(13, 6, generator=generator(46)).to(DEVICE)
    check_staged(stage_with("triton", h, ids, w, launch), h, ids, w)


def test_stage_launch_fields_are_checked():
    """MoeLaunch's staging fields and the variants' take only what exists (the contract's encoders: no
    timing-only variant)."""
    for kw, msg in (
        (dict(encode="cast"), "encode"),
        (dict(encode="snap", load="groups"), 'needs "tile"'),
        (dict(maxnreg=8), "maxnreg"),
        (dict(maxnreg=256), "maxnreg"),
        (dict(prefetch=True), "prefetch"),
        (dict(prefetch=True, programs=4, encode="blocks"), "prefetch"),
        (dict(topk_first=True, programs=4), "topk_first"),
        (dict(cache="cs_all"), "cache"),
    ):
        with pytest.raises(ValueError, match=msg):
            StageVariant(**kw)
    with pytest.raises(TypeError, match="prefetch: expected a bool"):
        StageVariant(prefetch=1)
    with pytest.raises(TypeError, match="stage_topk_first: expected a bool"):
        moe.MoeLaunch(stage_topk_first=1)
    with pytest.raises(ValueError, match="stage_block_h"):
        moe.MoeLaunch(stage_block_h=64)
    assert len(SMALL_TILE.op_args("moe_stage")) == 4  # block_t, block_h, warps, topk_first: the schema's order
    with pytest.raises(ValueError, match="op"):
        SMALL_TILE.op_args("moe_route")


def test_stage_snap_bytes_of_a_one_column_x_sf():
    """snap stores scale bytes through a uint8 view of x_sf; at Hd = 128 x_sf has one column whose stride may
    be anything (stage_into accepts it), which a dtype view refuses: the launcher re-strides it first."""
    h = randn((3, 128), seed=42, device=DEVICE)
    ids, w = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE), torch.rand(3, 2, generator=generator(43)).to(DEVICE)
    sf = torch.full((15,), -7777, dtype=torch.int32, device=DEVICE).as_strided((3, 1), (5, 3))
    q, i64, w32 = poison((3, 128), torch.float8_e4m3fn), poison((3, 2), torch.int64), poison((3, 2), torch.float32)
    moe.stage_into(h, ids, w, q, sf, i64, w32, backend="triton", launch=SMALL_TILE)
    check_staged((q, sf, i64, w32), h, ids, w)


@pytest.mark.parametrize("K", [1, 2, 3, 6])
def test_stage_topk_copies_keep_the_masked_tail(K):
    """int32 −1 ids become int64 −1; weights are bit copies (−0.0, a subnormal, a NaN payload); columns K..7 and
    rows T.. of wider buffers keep their sentinel."""
    T, N, Hd = 5, 7, 128
    h = randn((T, Hd), seed=15, device=DEVICE)
    ids = torch.randint(-1, 256, (T, K), generator=generator(16)).to(torch.int32).to(DEVICE)
    ids[0, 0] = -1
    w = torch.rand(T, K, generator=generator(17)).to(DEVICE)
    w[0, 0] = -0.0
    w[1, 0] = 1e-40
    w.view(torch.int32)[2, 0] = 0x7FC00123  # a NaN with a payload
    ids_buf = torch.full((N, 8), -7777, dtype=torch.int64, device=DEVICE)
    w_buf = torch.full((N, 8), -7777, dtype=torch.int32, device=DEVICE)
    q_buf, sf_buf = poison((N, Hd), torch.float8_e4m3fn), poison((N, 1), torch.int32)
    moe.stage_into(h, ids, w, q_buf, sf_buf, ids_buf[:, :K], w_buf.view(torch.float32)[:, :K], backend="triton")
    assert torch.equal(ids_buf[:T, :K], ids.long()) and ids_buf[0, 0].item() == -1
    assert torch.equal(w_buf[:T, :K], w.view(torch.int32))
    assert (ids_buf[:, K:] == -7777).all() and (w_buf[:, K:] == -7777).all()
    assert (ids_buf[T:] == -7777).all() and (sf_buf[T:] == -7777).all()
    assert (staged_bytes(q_buf)[T:] == 0x7F).all()


def test_stage_shapes_strides_and_empty():
    h = randn((6, 256), seed=18, device=DEVICE)
    ids = torch.zeros(6, 2, dtype=torch.int32, device=DEVICE)
    w = torch.ones(6, 2, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 128"):
        moe.stage(randn((6, 200), seed=1, device=DEVICE), ids, w)
    with pytest.raises(ValueError, match="shape of ids"):
        moe.stage(h, ids, torch.ones(6, 3, device=DEVICE))
    # T = 0: outputs untouched, nothing launched
    bufs = (
        poison((3, 256), torch.float8_e4m3fn),
        poison((3, 2), torch.int32),
        poison((3, 2), torch.int64),
        poison((3, 2), torch.float32),
    )
    moe.stage_into(h[:0], ids[:0], w[:0], *bufs)
    assert (staged_bytes(bufs[0]) == 0x7F).all() and (bufs[1] == -7777).all() and (bufs[2] == -7777).all()
    assert [t.shape[0] for t in moe.stage(h[:0], ids[:0], w[:0])] == [0, 0, 0, 0]
    # a strided view (every other column of a wider tensor, and a transposed copy) gives the same bytes
    wide = randn((6, 512), seed=19, device=DEVICE)
    for view in (wide[:, ::2], wide[:, ::2].t().contiguous().t()):
        st = moe.stage(view, ids, w, backend="triton")
        assert not view.is_contiguous()
        check_staged(st, view.contiguous(), ids, w)
    assert str(inspect.signature(moe.stage)) == "(hidden, ids, weights, *, backend='auto')"


def test_p6_scale_bytes_are_exponents_not_values():
    """x_sf holds the exponent bytes (127 + e) of the power-of-two scales; a numeric copy of the scale values
    (2^-7 → 0 as an integer) would lose them. The dequant builds 2^(b − 127) from the byte's bits."""
    h = worked_block().to(DEVICE)
    st = moe.stage(h, torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), torch.ones(1, 1, device=DEVICE))
    byte = (st[1][0, 0].item() >> 8) & 0xFF  # group 1: amax 1.0, scale 2^-8
    assert byte == 119
    assert torch.tensor(2.0**-8).to(torch.uint8).item() == 0  # the numeric copy of that scale
    deq = ref.dequantize_staged(st[0], st[1]).cpu()
    assert deq[0, 32].item() == 1.0 and deq[0, 33].item() == 0.5


# ----------------------------------------------------------------------------------------------------
# experts and combine
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layer():
    """T = 12 tokens of the tiny config with real magnitudes (16 octaves per 32-group) and gate/up weights
    that push pre-activations past ±10; routing and staging done once."""
    d = moe.example_inputs(12, SHAPE, seed=20, octaves=16, weight_gain=2.0)
    ids, w = routed(d)
    for t, row in enumerate(ids.tolist()):  # leave expert 5 without tokens (allowed: it launches no work)
        if 5 in row:
            ids[t, row.index(5)] = next(e for e in range(SHAPE.experts) if e != 5 and e not in row)
    ids[3, 1] = -1  # a −1 slot with a huge weight: must add exactly 0
    w[3, 1] = 1e6
    staged = moe.stage(d["x"], ids, w, backend="reference")
    return d, ids, w, staged


def test_experts_vs_float64_oracle_with_minus_one_slots(layer):
    d, ids, w, staged = layer
    out = run_experts(d["x"], staged, d)
    want, mass = oracle_out(d["x"], *staged, d)
    assert torch.isfinite(out.float()).all()
    assert_close(out, want, "moe_out", "experts", mass=mass)
    assert not (staged[2] == 5).any(), "expert 5 has no token"


def test_p9_minus_one_slot_contributes_exactly_zero(layer):
    """A −1 slot adds exactly 0 whatever its weight (1e6 here), and is not routed to expert E−1 (or 0)."""
    d, ids, w, staged = layer
    out = run_experts(d["x"], staged, d, shared=False)
    keep = torch.where(ids >= 0, ids, 0).long()
    for fake in (0, SHAPE.experts - 1):  # the −1 slot read as expert 0 or wrapped to E−1
        wrong, mass = oracle_out(d["x"], staged[0], staged[1], torch.where(ids >= 0, keep, fake), w, d, shared=False)
        assert not compare(out, wrong, "moe_out", mass=mass).passed
    w0 = w.clone()
    w0[3, 1] = 0.0
    assert torch.equal(run_experts(d["x"], staged, d, w=w0, shared=False), out)


def test_p5_clamp_in_routed_and_shared_experts(layer):
    """Pre-activations cross ±L in both kinds of expert; the output matches the oracle clamped in both,
    and the oracle with either clamp removed is far off (a missing shared clamp: P5)."""
    d, ids, w, staged = layer
    xq = ref.dequantize_staged(staged[0], staged[1], torch.float64)
    a, u = (xq @ d["w13"][ids[0, 0].long()].double().T).chunk(2, dim=-1)
    assert (a[0] > 10).any() and (u[0].abs() > 10).any(), "routed data must cross the clamp"
    a_s, u_s = (d["x"].double() @ d["shared_w13"].double().T).chunk(2, dim=-1)
    assert (a_s > 10).any() and (u_s < -10).any(), "shared data must cross the clamp"
    out = run_experts(d["x"], staged, d)
    for limits, ok in (((10.0, 10.0), True), ((0.0, 10.0), False), ((10.0, 0.0), False)):
        want, mass = oracle_out(d["x"], *staged, d, limits=limits)
        assert compare(out, want, "moe_out", mass=mass).passed == ok, limits


def test_swiglu_clamp_is_one_sided_on_the_gate():
    a = torch.tensor([-30.0, -10.5, 0.0, 9.0, 10.5, 30.0])
    u = torch.tensor([-30.0, -10.5, 1.0, 1.0, 10.5, 30.0])
    got = ref.swiglu(a, u, 10.0)
    want = torch.nn.functional.silu(a.clamp(max=10.0)) * u.clamp(-10.0, 10.0)
    assert torch.equal(got, want)
    assert got[0].item() != 0.0  # the gate is not clamped from below: silu(−30)·(−10) is tiny but not zero


def test_kernel_swiglu_gate_is_not_clamped_from_below():
    """The kernel's side of the test above: gate pre-activations of −12 and −30 (below −L) and ups past ±L. A
    kernel that also clamped the gate from below would give silu(−10)·(±10) ≈ ∓4.5e-3 where the oracle has
    silu(−30)·(±10) ≈ ∓2.8e-12, far past "moe_out" (2^-8 of a tiny mass). x is one-hot per token and W2 a
    one-hot selector, so every GEMM is exact and out = bf16(h) column by column."""
    T, Hd, E, I = 4, 256, 1, 128
    n = torch.arange(I)
    x = torch.zeros(T, Hd, dtype=torch.bfloat16)
    x[torch.arange(T), torch.arange(T)] = 1.0
    w13 = torch.zeros(E, 2 * I, Hd, dtype=torch.bfloat16)
    for t in range(T):
        gate = torch.where(n % 4 == 0, 3.0, torch.where((n + t) % 2 == 0, -30.0, -12.0))
        up = torch.where(n % 3 == 0, 1.0, torch.where(n % 2 == 0, 10.5, -10.5))
        w13[0, :I, t], w13[0, I:, t] = gate.to(torch.bfloat16), up.to(torch.bfloat16)
    d = dict(w13=w13.to(DEVICE), w2=selector_w2(E, Hd, I), swiglu_limit=10.0, shared_w13=None, shared_w2=None)
    x = x.to(DEVICE)
    ids = torch.zeros(T, 1, dtype=torch.int32, device=DEVICE)
    w = torch.ones(T, 1, device=DEVICE)
    staged = moe.stage(x, ids, w)
    assert torch.equal(ref.dequantize_staged(staged[0], staged[1]), x.float()), "x must stage exactly"
    out = run_experts(x, staged, d, shared=False)
    want, mass = oracle_out(x, *staged, d, shared=False)
    assert_close(out, want, "moe_out", "one-sided gate clamp", mass=mass)
    a, u = w13[0].double().T[:T].chunk(2, dim=-1)  # token t's gate and up rows: x = e_t
    two_sided = (torch.nn.functional.silu(a.clamp(-10.0, 10.0)) * u.clamp(-10.0, 10.0)).repeat(1, Hd // I)
    assert (a < -10).sum() > T * I // 2, "the data must sit below -L"
    assert not compare(two_sided.to(DEVICE), want, "moe_out", mass=mass).passed


@pytest.mark.parametrize("backend", moe.SUPPORTED_BACKENDS)
def test_weight_applied_before_the_down_projection(backend):
    """Spec test 14. With W2 a one-hot selector, out = bf16(h) exactly, so the two placements differ only by
    rounding: weight-before rounds silu·u·ω once, weight-after rounds silu·u then multiplies. Integer-valued
    x and W1/W3 make the gate/up GEMMs exact on every backend, and every backend is held to it."""
    T, Hd, E, I = 16, 256, 2, 128
    g = generator(21)
    x = torch.randint(-8, 9, (T, Hd), generator=g).to(torch.bfloat16).to(DEVICE)
    w13 = (torch.randint(-3, 4, (E, 2 * I, Hd), generator=g) / 64.0).to(torch.bfloat16).to(DEVICE)
    d = dict(w13=w13, w2=selector_w2(E, Hd, I), swiglu_limit=10.0, shared_w13=None, shared_w2=None)
    ids = (torch.arange(T) % E).to(torch.int32)[:, None].to(DEVICE)
    w = (0.3 + 1.4 * torch.rand(T, 1, generator=g)).to(DEVICE)  # not powers of two
    staged = moe.stage(x, ids, w)
    assert torch.equal(ref.dequantize_staged(staged[0], staged[1]), x.float()), "x must stage exactly"
    out = run_experts(x, staged, d, shared=False, backend=backend).float()
    a, u = torch.einsum("th,tnh->tn", x.float(), w13[ids[:, 0].long()].float()).chunk(2, -1)  # exact
    act = ref.swiglu(a, u, 10.0)
    before = (act * w).to(torch.bfloat16).float().repeat(1, 2)
    after = (act.to(torch.bfloat16).float() * w).to(torch.bfloat16).float().repeat(1, 2)
    same_before = (out == before).float().mean().item()
    same_after = (out == after).float().mean().item()
    assert same_before > 0.99, same_before
    assert same_after < 0.9, same_after


def test_p10_duplicate_ids_accumulate_both_slots(layer):
    """A row with a repeated expert (the route rejects it, the experts accept it as given): both slots add."""
    d, ids, w, staged = layer
    dup = staged[2].clone()
    dup[0] = torch.tensor([4, 4])
    w2 = staged[3].clone()
    w2[0] = torch.tensor([0.4, 0.9])
    out = run_experts(d["x"], staged, d, ids=dup, w=w2, shared=False)
    want, mass = oracle_out(d["x"], staged[0], staged[1], dup, w2, d, shared=False)
    assert_close(out[0], want[0], "moe_out", "duplicated row", mass=mass[0])
    one, mass1 = oracle_out(d["x"][:1], staged[0][:1], staged[1][:1], dup[:1, :1], w2[:1, :1], d, shared=False)
    assert not compare(out[:1], one, "moe_out", mass=mass1).passed  # a combine that kept one slot would fail
    y = torch.zeros(1, 3)
    y[torch.tensor([0, 0])] += torch.ones(2, 3)  # the pitfall itself: advanced-index += keeps one add
    assert y.sum().item() == 3.0


def test_p11_routed_scale_zero_leaves_exactly_the_shared_expert():
    d = moe.example_inputs(8, SHAPE, seed=22)
    args = (d["x"], d["gate_weight"], d["bias"], d["w13"], d["w2"], d["shared_w13"], d["shared_w2"])
    out = poison((8, SHAPE.hidden), torch.bfloat16)
    moe.forward(*args, k=2, routed_scale=0.0, swiglu_limit=10.0, out=out, backend="triton")
    ids = torch.full((8, 2), -1, dtype=torch.int64, device=DEVICE)
    staged = moe.stage(d["x"], ids, torch.zeros(8, 2, device=DEVICE))
    shared_only = run_experts(d["x"], staged, d)
    assert torch.equal(out, shared_only)
    # and the scale is applied once, to the routed weights only: each row of weights sums to routed_scale
    _, w = moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=2.5)
    assert_close(w.sum(-1).double(), torch.full((8,), 2.5, dtype=torch.float64), "route_weights")


def test_forward_hash_layer_with_padding_vs_oracle():
    """The whole layer on a hash-routed layer with a padding row, against route → stage → float64 experts."""
    d = moe.example_inputs(6, SHAPE, seed=23, hash_layer=True, octaves=12)
    d["input_ids"][4] = -1
    args = (d["x"], d["gate_weight"], None, d["w13"], d["w2"], d["shared_w13"], d["shared_w2"])
    kw = dict(k=2, routed_scale=1.5, swiglu_limit=10.0, hash_table=d["hash_table"], input_ids=d["input_ids"])
    out = poison((6, SHAPE.hidden), torch.bfloat16)
    moe.forward(*args, **kw, out=out)
    ids, w = moe.route(
        d["x"], d["gate_weight"], None, k=2, routed_scale=1.5, hash_table=d["hash_table"], input_ids=d["input_ids"]
    )
    staged = moe.stage(d["x"], ids, w, backend="reference")
    want, mass = oracle_out(d["x"], *staged, d)
    assert_close(out, want, "moe_out", "forward", mass=mass)
    assert_close(moe.forward(*args, **kw, backend="reference"), want, "moe_out", "reference forward", mass=mass)
    # the padding row is exactly the shared expert (what experts() gives with no routed slot)
    assert (ids[4] == -1).all()


def test_p15_staged_path_is_not_bitwise_the_bf16_reference(layer):
    """The kernel reads the FP8-staged x (variant M); the bf16-x reference (variant R) rounds differently,
    so the two are compared with a tolerance, never bit for bit: the kernel matches M's oracle, R differs."""
    d, ids, w, staged = layer
    out = run_experts(d["x"], staged, d)
    w13, w2 = d["w13"], d["w2"]
    valid = ids >= 0
    r = torch.zeros(12, SHAPE.hidden, dtype=torch.float32, device=DEVICE)
    for t, k in valid.nonzero().tolist():
        e = int(ids[t, k])
        r[t] += ref.expert_mlp(d["x"][t : t + 1], w13[e], w2[e], w[t, k : k + 1], 10.0)[0]
    r += ref.expert_mlp(d["x"], d["shared_w13"], d["shared_w2"], torch.ones(12, device=DEVICE), 10.0)
    variant_r = r.to(torch.bfloat16)
    assert not torch.equal(out, variant_r)
    want, mass = oracle_out(d["x"], *staged, d)
    assert_close(out, want, "moe_out", mass=mass)


def test_experts_empty_batch_and_argument_errors(layer):
    d, ids, w, staged = layer
    z = [t[:0] for t in staged]
    out = moe.experts(d["x"][:0], *z, d["w13"], d["w2"], d["shared_w13"], d["shared_w2"], swiglu_limit=10.0)
    assert out.shape == (0, SHAPE.hidden) and out.dtype == torch.bfloat16
    bad = staged[2].clone()
    bad[0, 0] = SHAPE.experts
    with pytest.raises(ValueError, match="ids"):
        moe.experts(d["x"], staged[0], staged[1], bad, staged[3], d["w13"], d["w2"], swiglu_limit=10.0)
    with pytest.raises(ValueError, match="shared_w13"):
        moe.experts(d["x"], *staged, d["w13"], d["w2"], d["shared_w13"], None, swiglu_limit=10.0)
    with pytest.raises(ValueError, match="block_m"):
        moe.MoeLaunch(block_m=8)


def test_group_by_expert_and_tile_table():
    ids = torch.tensor([[3, 1], [-1, 3], [1, 1], [0, -1]], device=DEVICE)
    order, counts, offsets = moe.group_by_expert(ids, 4)
    assert counts.tolist() == [1, 3, 0, 2] and offsets.tolist() == [0, 1, 4, 4, 6]
    assert order[:6].tolist() == [6, 1, 4, 5, 0, 3]  # stable: slot order within an expert; −1 slots last
    e, r0, r1 = tile_table(counts, offsets, 2, 8)
    real = e < 4
    assert list(zip(e[real].tolist(), r0[real].tolist(), r1[real].tolist())) == [(0, 0, 1), (1, 1, 4), (1, 3, 4), (3, 4, 6)]


def test_custom_ops_opcheck_and_compile():
    shape = moe.MoeShape(hidden=128, experts=2, k=1, intermediate=32, routed_scale=1.5, swiglu_limit=10.0, num_hash_layers=0)
    d = moe.example_inputs(2, shape, seed=24)
    ids, w = moe.route(d["x"], d["gate_weight"], d["bias"], k=1, routed_scale=1.5)
    st = moe.stage(d["x"], ids, w)
    L = moe.default_launch(2, 1, 2)
    torch.library.opcheck(
        torch.ops.dsv4ref.moe_stage.default,
        (
            d["x"],
            ids,
            w,
            torch.empty_like(st[0]).view(torch.uint8),
            *[torch.empty_like(t) for t in st[1:]],
            *L.op_args("moe_stage"),
        ),
        test_utils=("test_schema", "test_faketensor"),
    )
    out = torch.empty(2, 128, dtype=torch.bfloat16, device=DEVICE)
    torch.library.opcheck(
        torch.ops.dsv4ref.moe_experts.default,
        (
            d["x"],
            st[0].view(torch.uint8),
            *st[1:],
            d["w13"],
            d["w2"],
            d["shared_w13"],
            d["shared_w2"],
            out,
            10.0,
            *L.op_args("moe_experts"),
        ),
        test_utils=("test_schema", "test_faketensor"),
    )

    def layer_fn(x):
        return moe.forward(
            x,
            d["gate_weight"],
            d["bias"],
            d["w13"],
            d["w2"],
            d["shared_w13"],
            d["shared_w2"],
            k=1,
            routed_scale=1.5,
            swiglu_limit=10.0,
        )

    explain = torch._dynamo.explain(layer_fn)(d["x"])
    assert explain.graph_break_count == 0, explain.break_reasons


# ----------------------------------------------------------------------------------------------------
# V4's formats in the experts: FP4 routed experts, FP8 shared expert, the deepseek and megamoe paths
# ----------------------------------------------------------------------------------------------------


def _v4_layer(T=12, seed=3, octaves=2, gain=1.0):
    """A TINY_MOE layer quantised with the linear op's quantisers, routed, and staged for the megamoe path."""
    from dsv4ref import linear as lin

    d = moe.example_inputs(T, SHAPE, seed=seed, octaves=octaves, weight_gain=gain)
    E, Hd, I = SHAPE.experts, SHAPE.hidden, SHAPE.intermediate

    def fp4(w):
        q, s = lin.quantize_fp4_weight(w.reshape(-1, w.shape[-1]))
        return q.view(*w.shape[:-1], -1), s.view(*w.shape[:-1], -1)

    ids, w = moe.route(d["x"], d["gate_weight"], d["bias"], k=SHAPE.k, routed_scale=1.5)
    args = (d["x"], ids, w, *fp4(d["w13"]), *fp4(d["w2"]))
    args += lin.quantize_fp8_weight(d["shared_w13"]) + lin.quantize_fp8_weight(d["shared_w2"])
    x_fp8, x_sf, _, _ = moe.stage(d["x"], ids, w, backend="reference")
    assert args[3].shape == (E, 2 * I, Hd // 2) and args[4].shape == (E, 2 * I, Hd // 32)
    return args, dict(x_fp8=x_fp8, x_sf=x_sf)


@pytest.mark.parametrize("path", moe.PATHS)
def test_experts_fp4_within_the_derived_bound(path):
    """Both paths against the float64 oracle (dequantised weights, x itself, no rounding): every element within
    the first-order worst-case bound of moe.experts_v4.error_bound, and each row's relative L2 within the
    "fp8_activations" row, 2^-3. Why 2^-3: each e4m3 rounding moves a value by at most 2^-4 of it (RMS 2^-4/√3 for errors spread
    evenly over ±half an ulp); a GEMM output with independent input errors keeps that relative RMS; the
    routed output carries three such roundings in quadrature (x reaches h through a and u, then h itself is
    quantised): √3·2^-4/√3 = 2^-4, and 2^-3 leaves a factor 2 (docs/moe.md#tolerance-of-the-v4-experts). The
    L2 check has teeth: swapped nibbles (element 2k read from the high nibble) fail it."""
    from dsv4ref.moe import experts_v4 as v4

    args, staged = _v4_layer()
    oracle = v4.reference(*args, swiglu_limit=10.0, dtype=torch.float64)
    bound = v4.error_bound(*args, swiglu_limit=10.0)
    got = moe.experts_fp4(*args, swiglu_limit=10.0, path=path, **staged, backend="reference").double()
    assert bool(((got - oracle).abs() <= bound).all())
    assert_close(got, oracle, "fp8_activations")  # per row
    assert float((got - oracle).norm() / oracle.norm()) > 2.0**-7  # the activation formats' error is real
    swapped = args[3].view(torch.uint8)
    swapped = ((swapped >> 4) | (swapped << 4)).view(args[3].dtype)
    bad = moe.experts_fp4(
        args[0], args[1], args[2], swapped, *args[4:], swiglu_limit=10.0, path=path, **staged, backend="reference"
    )
    assert not compare(bad.double(), oracle, "fp8_activations").passed


@pytest.mark.parametrize("path", moe.PATHS)
def test_experts_fp4_kernel_is_the_reference(path):
    """The grouped FP8 x FP4 GEMM kernel gives the reference's bits (exact products, fp32 sums of the same
    values; the only rounding points are the reference's)."""
    args, staged = _v4_layer(T=9, seed=5, gain=4.0)
    want = moe.experts_fp4(*args, swiglu_limit=10.0, path=path, **staged, backend="reference")
    got = moe.experts_fp4(*args, swiglu_limit=10.0, path=path, **staged, backend="triton")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_fp4_gemm_op_writes_only_the_rows_its_tiles_cover():
    """The custom op on a poisoned output: every covered row (the slot's own row) is written and equals the
    dequantised product; every other row keeps its NaN poison."""
    from dsv4ref.fp8.reference import quantize_ue8m0
    from dsv4ref.moe.experts_v4 import dequantize_experts
    from dsv4ref.moe.launch import group_by_expert

    args, staged = _v4_layer(T=5, seed=8)
    ids = args[1].clone()
    ids[1, 1] = -1  # an uncovered slot
    T, K = ids.shape
    E = args[3].shape[0]
    order, counts, offsets = group_by_expert(ids, E)
    te, r0, r1 = tile_table(counts, offsets, 16, order.shape[0])
    h = randn((T * K, SHAPE.intermediate), seed=9, block=32, octaves=4).float()
    hq, byte = quantize_ue8m0(h, 32, 1e-4)
    out = poison((T * K, SHAPE.hidden), torch.float32)
    rows = torch.arange(order.shape[0], device=DEVICE)
    torch.ops.dsv4ref.moe_fp4_gemm(
        hq.view(torch.uint8), byte.contiguous().view(torch.int32), rows, order, te, r0, r1,
        args[5].view(torch.uint8), args[6].view(torch.uint8), out, 32, 16, 64, 128, 4, 1,
    )  # fmt: skip
    W2 = dequantize_experts(args[5], args[6], torch.float64)
    xh = ref.dequantize_staged(hq, byte.contiguous().view(torch.int32), torch.float64)
    flat = ids.reshape(-1)
    for r, slot in enumerate(order.tolist()):
        e = int(flat[slot])
        if e < 0:
            continue
        assert_close(out[slot].double(), xh[r] @ W2[e].T, "moe_out", mass=xh[r].abs() @ W2[e].abs().T)
    assert bool(out[1 * K + 1].isnan().all())  # the −1 slot's row: untouched


def test_deepseek_path_rounds_gate_up_to_bf16():
    """DeepSeek's Expert.forward takes w1(x), w3(x) as bf16 GEMM outputs: the deepseek path equals a pipeline
    that rounds them, differs from one that does not."""
    from dsv4ref import linear as lin
    from dsv4ref.moe import experts_v4 as v4

    args, _ = _v4_layer(T=6, seed=11)
    x, ids, w, q13, s13, q2, s2 = args[:7]
    got = moe.experts_fp4(*args, swiglu_limit=10.0, path="deepseek", backend="reference").float()
    shared = v4._shared(x, *args[7:], 10.0, "reference").float()
    W13, W2 = v4.dequantize_experts(q13, s13), v4.dequantize_experts(q2, s2)

    def pipeline(round_gate_up):
        y = shared.clone()
        xq = v4._act_1x128(x)
        for t in range(x.shape[0]):
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                a, u = (xq[t] @ W13[e].T).chunk(2)
                if round_gate_up:
                    a, u = a.bfloat16().float(), u.bfloat16().float()
                h = ref.swiglu(a, u, 10.0) * w[t, k]
                y[t] += (v4._act_1x128(h.bfloat16()[None]) @ W2[e].T).bfloat16().float()[0]
        return y.bfloat16().float()

    assert lin is not None
    assert (got - pipeline(True)).abs().max() <= 2.0**-7 * got.abs().max()  # summation order only
    assert (got - pipeline(False)).abs().max() > (got - pipeline(True)).abs().max()


def test_experts_fp4_refuses_naming_the_argument():
    args, staged = _v4_layer(T=3)
    with pytest.raises(TypeError, match="w13"):
        moe.experts_fp4(args[0], args[1], args[2], args[3].view(torch.uint8), *args[4:], swiglu_limit=10.0)
    with pytest.raises(ValueError, match="w2_scale"):
        moe.experts_fp4(*args[:6], args[6][:, :, :2], *args[7:], swiglu_limit=10.0)
    with pytest.raises(ValueError, match="x_fp8"):
        moe.experts_fp4(*args, swiglu_limit=10.0, path="megamoe")
    with pytest.raises(ValueError, match="path"):
        moe.experts_fp4(*args, swiglu_limit=10.0, path="vllm")


@pytest.mark.parametrize("path", moe.PATHS)
def test_experts_fp4_do_not_sync_with_checks_off(path):
    """The decode step captures experts_fp4 in a device graph: with value checks off its triton path reads no
    device value on the host (the grouping, the tile table, act_quant, the combine), and gives the reference's
    bits."""
    from contract import no_host_sync

    from dsv4ref import validate

    args, staged = _v4_layer(T=6, seed=13)
    with validate.checking_values(False):
        want = moe.experts_fp4(*args, swiglu_limit=10.0, path=path, **staged, backend="reference")
        with no_host_sync([]):
            got = moe.experts_fp4(*args, swiglu_limit=10.0, path=path, **staged, backend="triton")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
