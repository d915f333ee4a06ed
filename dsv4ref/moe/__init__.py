"""The DeepSeek-V4 MoE feed-forward: routing, FP8 input staging, clamped-SwiGLU experts and the combine.

``forward`` = ``route`` → ``stage`` → ``experts``::

    ids, w = route(x, gate_weight, bias, k=6, routed_scale=1.5)          # [T, K] int32, [T, K] fp32
    x_fp8, x_sf, ids64, w32 = stage(x, ids, w)                           # the mega-MoE input contract
    y = experts(x, x_fp8, x_sf, ids64, w32, w13, w2, shared_w13, shared_w2, swiglu_limit=10.0)   # [T, Hd] bf16

The math, the staging byte layout (with the packed int32 that comes out negative), the grouping by expert,
the combine and the pitfalls with the tests that catch them are in ``docs/moe.md``.

Where to read what:

* :mod:`dsv4ref.moe.reference`: the whole op in plain torch (float32, or float64 as the tests' oracle);
* :mod:`dsv4ref.moe.kernels`: the Triton kernels (staging, the two grouped expert GEMMs, the combine);
* :mod:`dsv4ref.moe.launch`: :class:`MoeLaunch`, the grouping by expert and the custom ops;
* :mod:`dsv4ref.moe.experts_v4` / :mod:`dsv4ref.moe.kernels_fp4`: the experts with V4's weights (FP4 routed,
  FP8 shared; :func:`experts_fp4`, ``path="deepseek" | "megamoe"``) and their grouped FP8 × FP4 GEMM kernel.
"""

from __future__ import annotations

import torch

from .. import validate
from ..formats import STAGE_BLOCK
from . import kernels, kernels_fp4, reference  # noqa: F401  (dsv4ref.moe.kernels / .reference, for readers)
from .experts_v4 import PATHS, Fp4Launch, default_fp4_launch, experts_fp4
from .launch import MoeLaunch, default_launch, group_by_expert, moe_experts_op, moe_stage_op
from .reference import FLASH_MOE, TINY_MOE, MoeShape, example_inputs

__all__ = [
    "route",
    "stage",
    "stage_into",
    "experts",
    "forward",
    "example_inputs",
    "experts_fp4",
    "PATHS",
    "Fp4Launch",
    "default_fp4_launch",
    "group_by_expert",
    "MoeLaunch",
    "default_launch",
    "MoeShape",
    "FLASH_MOE",
    "TINY_MOE",
    "ROUTE_BACKENDS",
    "SUPPORTED_BACKENDS",
]

ROUTE_BACKENDS = ("reference",)  # routing is plain torch (a GEMM, a sort, a gather); "auto" = "reference"
SUPPORTED_BACKENDS = ("reference", "triton")  # stage / experts / forward; "auto" = "triton"
INDEX_DTYPES = (torch.int32, torch.int64)


def _checking() -> bool:
    """Whether the value checks run: they read tensors (ranges, duplicates, non-finite data: a host sync), so
    they run only while ``DSV4REF_CHECK_VALUES`` is on (the default; read at call time) and never while
    torch.compile traces. With them off, route / stage / experts do no host sync (a device graph can hold
    them) and non-finite input follows the written rules of docs/contract.md#moe."""
    return validate.check_values() and not torch.compiler.is_compiling()


def _no_nan(t, name, what):
    """Value check: no NaN in ``t`` (±inf allowed: it has a meaning there)."""
    bad = torch.isnan(t)
    if bool(bad.any()):
        i = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name}: NaN at index {i} ({what})")


def _check_route(x, gate_weight, bias, k, routed_scale, hash_table, input_ids):
    validate.tensor(x, "x", dtype=torch.bfloat16, ndim=2)
    T, Hd = x.shape
    validate.tensor(gate_weight, "gate_weight", dtype=(torch.bfloat16, torch.float32), ndim=2)
    E = gate_weight.shape[0]
    if gate_weight.shape[1] != Hd:
        raise ValueError(f"gate_weight: expected shape (E, {Hd}) to match x {tuple(x.shape)}, got {tuple(gate_weight.shape)}")
    validate.integer(k, "k", lo=1, hi=E)
    validate.scalar(routed_scale, "routed_scale", lo=0.0)
    if hash_table is None:
        validate.tensor(bias, "bias", dtype=torch.float32, shape=(E,))
    else:
        validate.tensor(hash_table, "hash_table", dtype=INDEX_DTYPES, shape=(None, k))
        if input_ids is None:
            raise ValueError("input_ids: required on a hash-routed layer (hash_table given)")
    if input_ids is not None:
        validate.tensor(input_ids, "input_ids", dtype=INDEX_DTYPES, shape=(T,))
        if hash_table is not None and _checking():
            validate.index_range(input_ids, "input_ids", hash_table.shape[0])
    validate.same_device(x=x, gate_weight=gate_weight, bias=bias, hash_table=hash_table, input_ids=input_ids)
    validate.not_meta(x, "x")
    if not _checking():
        return
    validate.finite(x, "x")
    if hash_table is None:
        _no_nan(bias, "bias", "a NaN selection bias would pick its expert silently; ±inf is allowed: never / always")
    if hash_table is not None and T:
        rows = hash_table[input_ids.clamp_min(0).long()]
        validate.index_range(rows, "hash_table", E, allow_minus_one=False)
        srt = rows.sort(dim=-1).values
        dup = (srt[:, 1:] == srt[:, :-1]).any(dim=-1) & (input_ids >= 0)
        if bool(dup.any()):
            t = int(dup.nonzero()[0, 0])
            raise ValueError(
                f"hash_table: row {int(input_ids[t])} (token {t}) repeats an expert id "
                f"{rows[t].tolist()}; each row must hold {k} distinct experts"
            )


def route(x, gate_weight, bias, *, k, routed_scale, hash_table=None, input_ids=None, backend="auto"):
    """Pick K experts per token and their weights (the V4 gate).

    ``z = fp32(x) @ fp32(gate_weight)ᵀ``, ``s = sqrt(softplus(z))``; the K experts with the largest
    ``s + bias`` (ties to the lower id, listed in that order), or ``hash_table[input_ids]`` on a hash-routed
    layer (the table's order); weights = the UNBIASED ``s`` at those ids, divided by max(their sum, 1e-20),
    times ``routed_scale``.

    Args:
        x: ``[T, Hd]`` bf16, the ``ffn_norm`` output.
        gate_weight: ``[E, Hd]`` bf16 (or fp32).
        bias: ``[E]`` fp32 selection bias; not read on a hash-routed layer (may be None there).
        k: experts per token, an int (not bool / float), 1 ≤ k ≤ E.
        routed_scale: the routed scaling factor (1.5 for V4-Flash): a finite number ≥ 0 (not bool / str).
        hash_table: ``[vocab, K]`` int32/int64 token → experts table of a hash-routed layer (layers 0..2 of
            V4-Flash), each row K distinct ids in [0, E) (a repeated id raises ValueError); None otherwise.
        input_ids: ``[T]`` int32/int64 token ids: required with ``hash_table``; on any layer, an entry −1 marks
            a padding row (CUDA-graph / DP padding), which gets ids −1 and weights 0.
        backend: ``"auto"`` (= ``"reference"``) or ``"reference"`` (routing has no Triton kernel).
    Returns:
        ``(ids, weights)``: ids ``[T, K]`` int32 in [0, E) (−1 on padding rows); weights ``[T, K]`` fp32, each
        non-padding row summing to ``routed_scale`` up to rounding (0 for a row whose K scores all underflow).
    Raises:
        TypeError / ValueError naming the argument. With value checks on (the default): a NaN or ±inf in ``x``
        (``"x: non-finite values ..."``), a NaN in ``bias`` (±inf is allowed: never / always selected), a hash
        row with a repeated or out-of-range id, ``input_ids`` past the table. With ``DSV4REF_CHECK_VALUES=0``
        nothing is read on the host, and a row whose scores s are not all finite (a NaN / ±inf in its x or in
        ``gate_weight``), or every row when ``bias`` holds a NaN (not on a hash layer), gets NaN weights (its ids
        are what the stable sort gives: NaN keys rank first), so the layer's output for it is NaN.
    """
    validate.backend(backend, ROUTE_BACKENDS, auto="reference")
    _check_route(x, gate_weight, bias, k, routed_scale, hash_table, input_ids)
    return reference.route(
        x, gate_weight, bias, k=k, routed_scale=float(routed_scale), hash_table=hash_table, input_ids=input_ids
    )


def _check_stage_values(hidden):
    """Value check (checks on): the hidden states are finite (every row is staged, and the shared expert reads
    every row of x)."""
    if _checking():
        validate.finite(hidden, "hidden")


def _check_stage(hidden, ids, weights):
    validate.tensor(hidden, "hidden", dtype=torch.bfloat16, ndim=2)
    T, Hd = hidden.shape
    if Hd % STAGE_BLOCK:
        raise ValueError(f"hidden: the hidden size must be a multiple of {STAGE_BLOCK}, got shape {tuple(hidden.shape)}")
    validate.tensor(ids, "ids", dtype=INDEX_DTYPES, ndim=2)
    validate.tensor(weights, "weights", dtype=torch.float32, ndim=2)
    if tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"weights: expected the shape of ids {tuple(ids.shape)}, got {tuple(weights.shape)}")
    if ids.shape[0] != T:
        raise ValueError(f"ids: expected {T} rows (one per token of hidden), got shape {tuple(ids.shape)}")
    validate.same_device(hidden=hidden, ids=ids, weights=weights)
    validate.not_meta(hidden, "hidden")
    return T, Hd, ids.shape[1]


def stage(hidden, ids, weights, *, backend="auto"):
    """Stage the MoE inputs for a grouped-expert consumer: FP8 activations with packed UE8M0 scales, plus
    the top-k ids and weights (the contract of vLLM's mega-MoE staging kernel).

    Per token and 32-value group: ``byte = ceil(log2(max(amax, 1e-4) / 448)) + 127`` from the fp32 bits,
    ``x_fp8 = e4m3(clamp(x · 2^(127 − byte), ±448))`` (ties to even); the 4 bytes of each 128-block are one
    little-endian int32 (byte 0 = dims [0, 32)), negative when byte 3 ≥ 128.

    Args:
        hidden: ``[T, Hd]`` bf16, any strides, ``Hd % 128 == 0`` (else ValueError). Finite while value checks
            are on (else ``ValueError("hidden: non-finite values ...")`` before any write); with
            ``DSV4REF_CHECK_VALUES=0`` a 32-group holding a NaN or ±inf is staged as scale byte 255 (E8M0's NaN)
            and e4m3 bytes 0x7F (0xFF for a non-NaN value with its sign bit set), on every backend.
        ids: ``[T, K]`` int32/int64 expert ids (−1 = none: copied unchanged, never read as values).
        weights: ``[T, K]`` fp32, the same shape as ids (else ValueError); any bits (a bit copy).
        backend: ``"auto"`` (= ``"triton"``), ``"triton"`` or ``"reference"``: identical bytes.
    Returns:
        ``(x_fp8, x_sf, ids, weights)``: ``[T, Hd]`` float8_e4m3fn; ``[T, Hd/128]`` int32 (row-major per
        token, "K-major"); ``[T, K]`` int64 (−1 stays −1); ``[T, K]`` fp32, a bit copy. All contiguous.
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    T, Hd, K = _check_stage(hidden, ids, weights)
    if backend == "reference":
        _check_stage_values(hidden)
        q, sf, i64, w = reference.stage(hidden, ids, weights)
        return q, sf, i64.contiguous(), w.contiguous()
    out = _staged_buffers(T, Hd, K, hidden.device)
    stage_into(hidden, ids, weights, *out, backend=backend)
    return out


def _staged_buffers(T, Hd, K, device):
    return (
        torch.empty(T, Hd, dtype=torch.float8_e4m3fn, device=device),
        torch.empty(T, Hd // STAGE_BLOCK, dtype=torch.int32, device=device),
        torch.empty(T, K, dtype=torch.int64, device=device),
        torch.empty(T, K, dtype=torch.float32, device=device),
    )


def stage_into(hidden, ids, weights, x_fp8, x_sf, ids_out, weights_out, *, backend="auto", launch=None):
    """:func:`stage`, written into rows [0, T) of preallocated buffers that may hold more rows (the
    consumer's fixed-size input buffers): rows T.. are left as they are, and T = 0 writes nothing.

    Args:
        hidden, ids, weights: as in :func:`stage`.
        x_fp8: ``[N ≥ T, Hd]`` float8_e4m3fn, unit stride along Hd.
        x_sf: ``[N, Hd/128]`` int32, unit stride along Hd/128.
        ids_out: ``[N, K]`` int64, unit stride along K.
        weights_out: ``[N, K]`` fp32, unit stride along K.
        backend: ``"auto"`` (= ``"triton"``), ``"triton"`` or ``"reference"``.
        launch: :class:`MoeLaunch` (its ``stage_*`` fields); None = :func:`default_launch`.
    Returns:
        None (the buffers are written in place).
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    T, Hd, K = _check_stage(hidden, ids, weights)
    for t, name, dt, cols in (
        (x_fp8, "x_fp8", torch.float8_e4m3fn, Hd),
        (x_sf, "x_sf", torch.int32, Hd // STAGE_BLOCK),
        (ids_out, "ids_out", torch.int64, K),
        (weights_out, "weights_out", torch.float32, K),
    ):
        validate.tensor(t, name, dtype=dt, shape=(None, cols))
        if t.shape[0] < T or (cols > 1 and t.stride(1) != 1):
            raise ValueError(
                f"{name}: expected at least {T} rows and unit stride along dim 1, got shape {tuple(t.shape)} strides {t.stride()}"
            )
    validate.same_device(hidden=hidden, x_fp8=x_fp8, x_sf=x_sf, ids_out=ids_out, weights_out=weights_out)
    if launch is not None and not isinstance(launch, MoeLaunch):
        raise TypeError(f"launch: expected a MoeLaunch or None, got {type(launch).__name__}")
    _check_stage_values(hidden)
    if T == 0:
        return None
    if backend == "reference":
        for buf, ref in zip((x_fp8, x_sf, ids_out, weights_out), reference.stage(hidden, ids, weights)):
            buf[:T].copy_(ref)
        return None
    launch = launch or default_launch(T, K, 1)
    moe_stage_op(hidden, ids, weights, x_fp8.view(torch.uint8), x_sf, ids_out, weights_out, *launch.op_args("moe_stage"))
    return None


def _check_x(x):
    validate.tensor(x, "x", dtype=torch.bfloat16, ndim=2)
    if x.shape[1] % STAGE_BLOCK:
        raise ValueError(f"x: the hidden size must be a multiple of {STAGE_BLOCK}, got shape {tuple(x.shape)}")
    return x.shape


def _check_expert_weights(Hd, w13, w2, shared_w13, shared_w2, swiglu_limit, experts=None):
    """Metadata checks of the layer's expert parameters and ``swiglu_limit``; ``experts``: the E the gate
    routes over (forward), which ``w13`` / ``w2`` must hold. Returns E."""
    validate.tensor(w13, "w13", dtype=torch.bfloat16, ndim=3)
    E, I2 = w13.shape[:2]
    if w13.shape[2] != Hd or I2 % 2:
        raise ValueError(f"w13: expected [E, 2I, {Hd}] ([W1; W3] per expert), got {tuple(w13.shape)}")
    if experts is not None and E != experts:
        raise ValueError(
            f"w13: holds {E} experts, but gate_weight routes over {experts} (its rows); expected "
            f"[{experts}, 2I, {Hd}], got {tuple(w13.shape)}"
        )
    validate.tensor(w2, "w2", dtype=torch.bfloat16, shape=(E, Hd, I2 // 2))
    if (shared_w13 is None) != (shared_w2 is None):
        raise ValueError("shared_w13, shared_w2: give both (the shared expert) or neither")
    if shared_w13 is not None:
        validate.tensor(shared_w13, "shared_w13", dtype=torch.bfloat16, ndim=2)
        if shared_w13.shape[1] != Hd or shared_w13.shape[0] % 2:
            raise ValueError(f"shared_w13: expected [2Is, {Hd}], got {tuple(shared_w13.shape)}")
        validate.tensor(shared_w2, "shared_w2", dtype=torch.bfloat16, shape=(Hd, shared_w13.shape[0] // 2))
    validate.scalar(swiglu_limit, "swiglu_limit")
    return E


def _check_experts(x, x_fp8, x_sf, ids, weights, w13, w2, shared_w13, shared_w2, out, swiglu_limit, launch=None):
    T, Hd = _check_x(x)
    validate.tensor(x_fp8, "x_fp8", dtype=torch.float8_e4m3fn, shape=(T, Hd))
    validate.tensor(x_sf, "x_sf", dtype=torch.int32, shape=(T, Hd // STAGE_BLOCK))
    if x_fp8.stride(1) != 1 or x_sf.stride(1) != 1:
        raise ValueError(f"x_fp8, x_sf: expected unit stride along dim 1, got {x_fp8.stride()} and {x_sf.stride()}")
    validate.tensor(ids, "ids", dtype=INDEX_DTYPES, ndim=2)
    K = ids.shape[1]
    validate.tensor(ids, "ids", shape=(T, K))
    validate.tensor(weights, "weights", dtype=torch.float32, shape=(T, K))
    E = _check_expert_weights(Hd, w13, w2, shared_w13, shared_w2, swiglu_limit)
    if out is not None:
        validate.tensor(out, "out", dtype=torch.bfloat16, shape=(T, Hd))
        if out.stride(1) != 1:
            raise ValueError(f"out: expected unit stride along dim 1, got strides {out.stride()}")
    validate.same_device(
        x=x, x_fp8=x_fp8, x_sf=x_sf, ids=ids, weights=weights, w13=w13, w2=w2, shared_w13=shared_w13, shared_w2=shared_w2, out=out
    )
    validate.not_meta(x, "x")
    if launch is not None and not isinstance(launch, MoeLaunch):
        raise TypeError(f"launch: expected a MoeLaunch or None, got {type(launch).__name__}")
    if _checking() and T:
        validate.index_range(ids, "ids", E)
        _check_experts_values(x, x_fp8, x_sf, ids, weights, shared_w13 is not None)
    return T, Hd, K, E


def _check_experts_values(x, x_fp8, x_sf, ids, weights, shared):
    """Value checks (checks on): the weights of the slots that are read (id ≥ 0) finite; no NaN code or NaN
    scale byte in the staged activations (what :func:`stage` writes for a non-finite group with checks off);
    x finite where the shared expert reads it. The expert weights are parameters: not read here."""
    bad = ~torch.isfinite(weights) & (ids >= 0)
    if bool(bad.any()):
        t, k = bad.nonzero()[0].tolist()
        raise ValueError(f"weights: non-finite value {weights[t, k].item()} at ({t}, {k}), a slot of expert {int(ids[t, k])}")
    nan_code = (x_fp8.view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan_code.any()):
        raise ValueError(
            f"x_fp8: e4m3 NaN codes (0x7F / 0xFF), the first at {tuple(nan_code.nonzero()[0].tolist())}: "
            "a non-finite group staged with value checks off"
        )
    nan_byte = x_sf.view(torch.uint8) == 255
    if bool(nan_byte.any()):
        t, b = nan_byte.nonzero()[0].tolist()
        raise ValueError(
            f"x_sf: scale byte 255 (E8M0 NaN) in row {t}, group {b}: a non-finite group staged with value checks off"
        )
    if shared:
        validate.finite(x, "x")


def experts(
    x, x_fp8, x_sf, ids, weights, w13, w2, shared_w13=None, shared_w2=None, *, swiglu_limit, out=None, backend="auto", launch=None
):
    """The routed experts on the staged activations, the shared expert on ``x``, and the fp32 combine.

    Per slot (t, k) with e = ids[t, k] ≥ 0 and ω = weights[t, k], on x̂ = dequant(x_fp8, x_sf) (exact)::

        a, u = x̂ W1[e]ᵀ, x̂ W3[e]ᵀ;   h = silu(min(a, L)) · clamp(u, −L, L) · ω;   o = bf16(bf16(h) W2[e]ᵀ)

    (the routing weight is applied BEFORE the down projection, as V4 does); ``out[t] = bf16(Σ_k o + shared)``
    accumulated in fp32, where the shared expert is the same clamped SwiGLU on the bf16 ``x`` with ω = 1.
    A −1 slot contributes exactly 0 whatever its weight; a repeated id in a row contributes twice.

    Args:
        x: ``[T, Hd]`` bf16 (the shared expert's input), ``Hd % 128 == 0``.
        x_fp8, x_sf: ``[T, Hd]`` float8_e4m3fn and ``[T, Hd/128]`` int32 from :func:`stage`.
        ids: ``[T, K]`` int32/int64 in [0, E) or −1 (checked while value checks are on; with them off an id
            outside [0, E) is treated as −1 on every backend: it contributes 0 and nothing is read for it).
        weights: ``[T, K]`` fp32 routing weights (already × routed_scale).
        w13: ``[E, 2I, Hd]`` bf16: rows [0, I) = W1 (gate), [I, 2I) = W3 (up), any strides.
        w2: ``[E, Hd, I]`` bf16 (down), any strides.
        shared_w13, shared_w2: ``[2Is, Hd]`` and ``[Hd, Is]`` bf16 of the shared expert, or both None.
        swiglu_limit: L (10 for V4), a finite number (not bool / str; NaN and ±inf refused); ≤ 0 disables the
            clamp.
        out: optional preallocated ``[T, Hd]`` bf16 (unit stride along Hd).
        backend: ``"auto"`` (= ``"triton"``), ``"triton"`` or ``"reference"``.
        launch: :class:`MoeLaunch`; None = :func:`default_launch`.
    Returns:
        ``[T, Hd]`` bf16 (``out`` when given).
    Raises:
        TypeError / ValueError naming the argument, before ``out`` is touched. With value checks on (the
        default): ids out of range, a non-finite weight of a slot with id ≥ 0, e4m3 NaN codes in ``x_fp8`` or
        scale byte 255 in ``x_sf``, a NaN / ±inf in ``x`` when the shared expert is given. The expert weights
        are not value-checked (layer parameters; reading 13 GB per call would double the op's cost).
        With ``DSV4REF_CHECK_VALUES=0`` nothing is read on the host and every backend does IEEE arithmetic
        through the formula: a staged NaN group (or a NaN ω) makes its slot's output row NaN, a non-finite x
        reaches the shared expert's GEMMs as it is, a NaN in an expert's weights reaches every token routed to
        it; the clamp lets NaN through (as torch's does); every NaN in ``out`` is 0x7FC0.
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    T, Hd, K, E = _check_experts(x, x_fp8, x_sf, ids, weights, w13, w2, shared_w13, shared_w2, out, swiglu_limit, launch)
    if backend == "reference":
        y = reference.experts(x, x_fp8, x_sf, ids, weights, w13, w2, shared_w13, shared_w2, swiglu_limit=float(swiglu_limit))
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(T, Hd, dtype=torch.bfloat16, device=x.device)
    launch = launch or default_launch(T, K, E)
    moe_experts_op(
        x,
        x_fp8.view(torch.uint8),
        x_sf,
        ids,
        weights,
        w13,
        w2,
        shared_w13,
        shared_w2,
        out,
        float(swiglu_limit),
        *launch.op_args("moe_experts"),
    )
    return out


def forward(
    x,
    gate_weight,
    bias,
    w13,
    w2,
    shared_w13,
    shared_w2,
    *,
    k,
    routed_scale,
    swiglu_limit,
    hash_table=None,
    input_ids=None,
    out=None,
    backend="auto",
    launch=None,
):
    """One layer's MoE feed-forward: :func:`route` → :func:`stage` → :func:`experts`.

    Args:
        x: ``[T, Hd]`` bf16, the ``ffn_norm`` output, ``Hd % 128 == 0``.
        gate_weight, bias, k, routed_scale, hash_table, input_ids: as in :func:`route`.
        w13, w2, shared_w13, shared_w2, swiglu_limit, out: as in :func:`experts`.
        backend: ``"auto"`` (= ``"triton"``), ``"triton"`` (Triton staging and experts; routing in torch) or
            ``"reference"`` (all torch, fp32).
        launch: :class:`MoeLaunch`; None = :func:`default_launch`.
    Returns:
        ``[T, Hd]`` bf16.
    Raises:
        TypeError / ValueError naming the argument, every one before any work: ``x`` (a hidden size that is
        not a multiple of 128 too), the routing arguments, ``w13`` / ``w2`` holding another number of experts
        than ``gate_weight``'s rows, ``swiglu_limit``, ``out``, ``launch``; then the value checks of route,
        stage and experts.
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    # every argument checked before any work: the ones route checks, then the experts' (their E = the gate's)
    T, Hd = _check_x(x)
    _check_route(x, gate_weight, bias, k, routed_scale, hash_table, input_ids)
    E = _check_expert_weights(Hd, w13, w2, shared_w13, shared_w2, swiglu_limit, experts=gate_weight.shape[0])
    if out is not None:
        validate.tensor(out, "out", dtype=torch.bfloat16, shape=(T, Hd))
        if out.stride(1) != 1:
            raise ValueError(f"out: expected unit stride along dim 1, got strides {out.stride()}")
    validate.same_device(x=x, w13=w13, w2=w2, shared_w13=shared_w13, shared_w2=shared_w2, out=out)
    if launch is not None and not isinstance(launch, MoeLaunch):
        raise TypeError(f"launch: expected a MoeLaunch or None, got {type(launch).__name__}")
    ids, w = route(x, gate_weight, bias, k=k, routed_scale=routed_scale, hash_table=hash_table, input_ids=input_ids)
    launch = launch or default_launch(T, k, E)
    if backend == "reference":
        staged = stage(x, ids, w, backend=backend)
    else:
        staged = _staged_buffers(x.shape[0], x.shape[1], k, x.device)
        stage_into(x, ids, w, *staged, backend=backend, launch=launch)
    return experts(x, *staged, w13, w2, shared_w13, shared_w2, swiglu_limit=swiglu_limit, out=out, backend=backend, launch=launch)
