"""GPT-J RoPE on the last 64 dims, with YaRN; the fused Q-norm + RoPE + FP8 KV insert; inverse RoPE on the
attention output. The math and its pitfalls: ``docs/rope.md``.

DeepSeek-V4 rotates only the **last** R = 64 dims of every 512-dim head (dims 448..511) and pairs them
**GPT-J style** (interleaved): pair i is (x[2i], x[2i+1]), read as the complex number x[2i] + j·x[2i+1] and
multiplied by e^{j·p·inv_freq[i]}. NeoX (half-split) pairing, (x[i], x[i+32]), is here only as the
contrast that breaks things.

The cos/sin table is fp32 ``[max_pos, 64]``, row p = ``[cos f_0 … cos f_31 | sin f_0 … sin f_31]`` (not
interleaved), f_i = fp32(p)·inv_freq[i]. Every kernel takes the table as an input; bit-exactness is judged
given the same table.

:func:`dsv4ref.linear.grouped_o_proj`, the attention's output projection that runs on the de-rotated rows,
is a projection and lives with the projections.

Where things are: :mod:`~dsv4ref.rope.reference` (the whole op in torch, read it first),
:mod:`~dsv4ref.rope.kernels` (Triton), :mod:`~dsv4ref.rope.launch` (:class:`RopeLaunch`, custom ops).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .. import kv_cache, validate
from ..device import DEVICE, HOST
from ..formats import HEAD_DIM, ROPE_DIM
from ..seeded import randn
from . import kernels, reference  # noqa: F401  (dsv4ref.rope.kernels / .reference for readers)
from .launch import RopeLaunch, default_launch, qnorm_rope_kv_insert_op, rope_gptj_op

__all__ = [
    "inv_freq",
    "yarn_correction_range",
    "cos_sin_rows",
    "cos_sin_cache",
    "compressed_position",
    "apply_gptj",
    "apply_neox",
    "qnorm_rope_kv_insert",
    "example_inputs",
    "RopeLaunch",
    "default_launch",
    "MAX_HEADS",
    "SUPPORTED_BACKENDS",
]

MAX_HEADS = 128  # FlashMLA-style kernels pad H to 64 or 128; more is rejected
SUPPORTED_BACKENDS = ("reference", "triton")  # backends of apply_gptj and qnorm_rope_kv_insert ("auto" = "triton")
_REFERENCE_ONLY = ("reference",)  # apply_neox

# ----------------------------------------------------------------------------------------------------
# Frequencies and the cos/sin table
# ----------------------------------------------------------------------------------------------------

_YARN_KEYS = ("factor", "original_max_position", "beta_fast", "beta_slow")


def _check_freq_args(rope_dim, theta, yarn) -> None:
    """rope_dim an even int > 0; theta a finite number > 1; yarn None or a dict of four finite numbers > 0
    with beta_fast >= beta_slow (else the ramp runs backwards)."""
    if validate.integer(rope_dim, "rope_dim", lo=1) % 2:
        raise ValueError(f"rope_dim: expected a positive even number, got {rope_dim}")
    if not validate.scalar(theta, "theta") > 1:
        raise ValueError(f"theta: expected a finite number > 1, got {theta}")
    if yarn is None:
        return
    if not isinstance(yarn, Mapping):
        raise TypeError(f"yarn: expected None or a dict, got {type(yarn).__name__}")
    missing = set(_YARN_KEYS) - set(yarn)
    if missing:
        raise ValueError(
            f"yarn: missing keys {sorted(missing)}; expected factor, original_max_position, "
            f"beta_fast, beta_slow (as in dsv4ref.config.Config.yarn)"
        )
    for k in _YARN_KEYS:
        if not validate.scalar(yarn[k], f"yarn['{k}']") > 0:
            raise ValueError(f"yarn['{k}']: expected a finite number > 0, got {yarn[k]!r}")
    if yarn["beta_fast"] < yarn["beta_slow"]:
        raise ValueError(
            f"yarn['beta_fast']: expected >= beta_slow = {yarn['beta_slow']!r} (the ramp runs from "
            f"beta_fast's pair up to beta_slow's), got {yarn['beta_fast']!r}"
        )


def _check_positions_nonneg(positions: torch.Tensor, name: str = "positions") -> None:
    """Value check (skipped when checks are off): every entry >= 0."""
    if validate.check_values() and positions.numel() and bool((positions < 0).any()):
        i = int((positions.reshape(-1) < 0).nonzero()[0][0])
        raise ValueError(f"{name}: entry {i} = {int(positions.reshape(-1)[i])} is negative; expected >= 0")


def yarn_correction_range(rope_dim: int, theta: float, yarn: dict) -> tuple[float, float]:
    """(low, high) pair indices of YaRN's linear ramp (``docs/rope.md#yarn``).

    corr(n) = R·ln(L0 / (2π n)) / (2 ln θ) is the pair index whose wavelength fits n times into the
    original context L0. low = max(floor(corr(β_fast)), 0), high = min(ceil(corr(β_slow)), R − 1); if they
    are equal, high += 0.001 (the ramp needs a non-zero width).

    Args:
        rope_dim: R, the rotary dims (64).
        theta: the RoPE base θ.
        yarn: dict(factor, original_max_position, beta_fast, beta_slow), e.g. ``config.FLASH.yarn``.
    Returns:
        ``(low, high)`` as floats. θ = 160000, L0 = 65536, β = (32, 1): ``(15.0, 25.0)``.
    """
    _check_freq_args(rope_dim, theta, yarn)
    return reference.yarn_correction_range(rope_dim, theta, yarn)


def inv_freq(rope_dim: int = ROPE_DIM, theta: float = 10000.0, yarn: dict | None = None) -> torch.Tensor:
    """The angle per position of each rotary pair.

    Plain RoPE: inv_freq[i] = θ^(−2i/R). With YaRN: pairs below ``low`` keep that (original) frequency,
    pairs above ``high`` are slowed down by ``factor``, and the ramp blends linearly in between
    (:func:`yarn_correction_range`).

    Args:
        rope_dim: R (even). theta: the base θ (> 1). yarn: None, or the dict of :func:`yarn_correction_range`.
    Returns:
        fp32 ``[rope_dim // 2]`` on the CPU.
    """
    _check_freq_args(rope_dim, theta, yarn)
    return reference.inv_freq(rope_dim, theta, yarn)


def cos_sin_rows(
    positions: torch.Tensor, rope_dim: int = ROPE_DIM, theta: float = 10000.0, yarn: dict | None = None
) -> torch.Tensor:
    """The table rows of the given positions only, bit-identical to ``cos_sin_cache(max_pos, …)[positions]``
    (the same fp32 recipe). Lets tests look at position 2^20 − 1 without building the 256 MiB table.

    Args:
        positions: int64 or int32 ``[N]`` (any stride), ≥ 0.
        rope_dim, theta, yarn: as :func:`inv_freq`.
    Returns:
        fp32 ``[N, rope_dim]`` on ``positions.device``, row = ``[cos f_0 … | sin f_0 …]``.
    """
    validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32), ndim=1)
    _check_freq_args(rope_dim, theta, yarn)
    _check_positions_nonneg(positions)
    return reference.cos_sin_rows(positions, rope_dim, theta, yarn)


def cos_sin_cache(
    max_pos: int, rope_dim: int = ROPE_DIM, theta: float = 10000.0, yarn: dict | None = None, *, device=None
) -> torch.Tensor:
    """The cos/sin table of one layer (``docs/rope.md#the-cossin-table``).

    Built on the CPU (so every machine gets the same bits), then moved to ``device``. DSV4 uses θ = 10000
    without YaRN on window-only layers and θ = 160000 with YaRN on compressed layers. No mscale: the values
    are plain cos and sin.

    Args:
        max_pos: rows (≥ 1). rope_dim, theta, yarn: as :func:`inv_freq` (``yarn`` e.g. ``config.FLASH.yarn``).
        device: where the table goes (default: dsv4ref's device).
    Returns:
        fp32 ``[max_pos, rope_dim]``: row p = ``[cos f_0 … cos f_{R/2−1} | sin f_0 … sin f_{R/2−1}]``.
    """
    validate.integer(max_pos, "max_pos", lo=1)
    return cos_sin_rows(torch.arange(max_pos, device=HOST), rope_dim, theta, yarn).to(device or DEVICE)


def compressed_position(p: torch.Tensor | int, ratio: int):
    """The position a compressed key (and the indexer key) is rotated at: (p // r)·r, the first position
    of its window of r tokens (``docs/rope.md#which-position-rotates-what``).

    Args:
        p: a position (int ≥ 0) or an integer tensor of positions (≥ 0).
        ratio: the layer's compress ratio r (an int ≥ 0); 0 or 1 (window-only layers) return p.
    Returns:
        The same type as ``p``.
    """
    validate.integer(ratio, "ratio", lo=0)
    if isinstance(p, torch.Tensor):
        if p.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"p: expected dtype torch.int64 or torch.int32, got {p.dtype}")
        _check_positions_nonneg(p, "p")
    else:
        validate.integer(p, "p", lo=0)
    return reference.compressed_position(p, ratio)


# ----------------------------------------------------------------------------------------------------
# Rotation
# ----------------------------------------------------------------------------------------------------


def _check_table(cos_sin: torch.Tensor) -> int:
    validate.tensor(cos_sin, "cos_sin", dtype=torch.float32, ndim=2)
    R = cos_sin.shape[1]
    if R <= 0 or R % 2 or cos_sin.shape[0] < 1:
        raise ValueError(f"cos_sin: expected [max_pos >= 1, R] with R even, got shape {tuple(cos_sin.shape)}")
    if cos_sin.stride(1) != 1:
        raise ValueError(f"cos_sin: rows must be contiguous (strides {cos_sin.stride()}); any row stride is fine")
    return R


def _check_rotate_args(x, positions, cos_sin, inverse) -> int:
    validate.tensor(x, "x", dtype=(torch.bfloat16, torch.float32))
    R = _check_table(cos_sin)
    if x.dim() < 1 or x.shape[-1] < R:
        raise ValueError(f"x: the last dim must hold the {R} rotary dims, got shape {tuple(x.shape)}")
    validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32))
    shapes = [tuple(x.shape[:-1])] + ([tuple(x.shape[:1])] if x.dim() >= 3 else [])
    if tuple(positions.shape) not in shapes:
        want = f"{shapes[0]} (one per row)" + (f" or {shapes[1]} (one per token)" if len(shapes) > 1 else "")
        raise ValueError(f"positions: expected shape {want}, got {tuple(positions.shape)}")
    if not isinstance(inverse, bool):
        raise TypeError(f"inverse: expected a bool, got {type(inverse).__name__} {inverse!r}")
    validate.same_device(x=x, positions=positions, cos_sin=cos_sin)
    validate.index_range(positions, "positions", cos_sin.shape[0], allow_minus_one=False)
    return R


def _check_launch(launch) -> RopeLaunch:
    if launch is not None and not isinstance(launch, RopeLaunch):
        raise TypeError(f"launch: expected a RopeLaunch or None, got {type(launch).__name__}")
    return launch or default_launch()


def _check_no_overlap(t: torch.Tensor, name: str) -> None:
    """A tensor written in place must not have two elements at one address (an expanded or overlapping
    view): the reference would refuse to write it and a kernel would race."""
    dims = sorted((abs(st), n) for st, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            raise ValueError(
                f"{name}: an overlapping view (strides {t.stride()}, shape {tuple(t.shape)}) cannot be written in place"
            )
        span = st * n


def apply_gptj(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    inverse: bool = False,
    *,
    backend: str = "auto",
    launch: RopeLaunch | None = None,
) -> torch.Tensor:
    """GPT-J (interleaved) RoPE on the LAST ``R = cos_sin.shape[1]`` dims of ``x`` (``docs/rope.md#pairing``).

    x'[2i] = x[2i]·cos f_i − x[2i+1]·sin f_i,  x'[2i+1] = x[2i]·sin f_i + x[2i+1]·cos f_i  (f_i at the
    row's position), on the slice x[..., D−R:]; dims 0..D−R−1 are copied bit for bit. fp32 arithmetic,
    one rounding to x's dtype. Non-finite values follow IEEE arithmetic (a NaN or ±inf in a pair gives
    NaN or ±inf there; NaNs come out as the canonical quiet NaN), on every backend alike, never an error
    (``docs/rope.md#non-finite-input``).

    Args:
        x: ``[..., D]`` bf16 or fp32 (``D ≥ R``, any strides), e.g. q ``[T, H, 512]`` or kv ``[T, 512]``.
        positions: int64 or int32 (any strides), of shape ``x.shape[:-1]`` (one per row) or, when x has
            ≥ 3 dims, ``x.shape[:1]`` (one per token, shared by all heads); each in ``[0, max_pos)``.
        cos_sin: fp32 ``[max_pos, R]`` (R even, rows contiguous, any row stride) from :func:`cos_sin_cache`
            (the layer's own: θ and YaRN differ per layer).
        inverse: a bool; True rotates by −f instead (the attention output, at the query's position:
            ``docs/rope.md#inverse-rope``).
        backend: ``"auto"`` (= ``"triton"``), ``"triton"`` or ``"reference"`` (:func:`reference.apply_gptj`);
            bit-identical results.
        launch: :class:`RopeLaunch` (``rotate_rows``); None = the default.
    Returns:
        A new tensor of x's shape and dtype (contiguous).
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    _check_rotate_args(x, positions, cos_sin, inverse)
    launch = _check_launch(launch)
    if backend == "reference":
        return reference.apply_gptj(x, positions, cos_sin, inverse)
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.numel() and x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = x2.clone(memory_format=torch.contiguous_format)
    per_row = tuple(positions.shape) == tuple(x.shape[:-1])
    pos_div = 1 if per_row or x.dim() == 1 else math.prod(x.shape[1:-1])
    pos = positions.reshape(-1).to(torch.int64).contiguous()  # a strided view must not be read as flat
    rope_gptj_op(x2, pos, cos_sin, out, pos_div, inverse, *launch.op_args("rope_gptj"))
    return out.view(x.shape)


def apply_neox(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False, *, backend: str = "auto"
) -> torch.Tensor:
    """NeoX (half-split) RoPE on the last R dims: pairs (x[i], x[i + R/2]). NOT what DSV4 uses; here to show
    what goes wrong when the pairing is mixed up (``docs/rope.md#pitfalls``).

    Args:
        x, positions, cos_sin, inverse: as :func:`apply_gptj`.
        backend: ``"auto"`` (= ``"reference"``) or ``"reference"`` (the only one).
    Returns:
        A new tensor of x's shape and dtype.
    """
    validate.backend(backend, _REFERENCE_ONLY, auto="reference")
    _check_rotate_args(x, positions, cos_sin, inverse)
    return reference.apply_neox(x, positions, cos_sin, inverse)


# ----------------------------------------------------------------------------------------------------
# The fused Q-norm + RoPE + KV insert
# ----------------------------------------------------------------------------------------------------


def qnorm_rope_kv_insert(
    q: torch.Tensor,
    kv: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    block_size: int,
    eps: float = 1e-6,
    backend: str = "auto",
    launch: RopeLaunch | None = None,
) -> None:
    """The attention prologue's fused step, in place (``docs/rope.md#the-fused-prologue-step``).

    * q is overwritten by RoPE(RMSNorm(q)): weight-free RMSNorm over all 512 dims of each head, then GPT-J
      RoPE on dims 448..511 at the token's position. Every row, padding rows included.
    * kv (already kv_norm'ed) is rotated on dims 448..511 and written to ``cache`` at ``slots[t]`` exactly
      as ``kv_cache.insert(cache, apply_gptj(kv, positions, cos_sin), slots, block_size=block_size)``
      would: 448 e4m3 + 7 UE8M0 of the unrotated NoPE dims, the rotated RoPE dims as bf16. kv is not
      modified. ``slots`` may be shorter than T (rows beyond it are padding); slot −1 writes nothing.

    Non-finite input (``docs/rope.md#non-finite-input``), the same on every backend: a NaN in a q head makes
    that whole head NaN (never an error: it must reach attention as a NaN row); a NaN or ±inf in a kv row
    that is written raises ``ValueError("kv: non-finite values ...")`` before anything is written while value
    checks are on (the default), and with them off (``DSV4REF_CHECK_VALUES=0``) is encoded as
    :func:`dsv4ref.kv_cache.insert` encodes it (the block's scale byte 255, its e4m3 bytes NaN).

    Args:
        q: bf16 ``[T, H, 512]``, H ≤ :data:`MAX_HEADS`, any non-overlapping strides (a non-contiguous last
            dim costs a copy on the Triton path).
        kv: bf16 ``[T, 512]``, any strides.
        cache: uint8 ``[num_blocks, page_bytes(block_size)]`` (:func:`dsv4ref.kv_cache.allocate`; checked by
            :func:`dsv4ref.kv_cache.check_cache`), pages contiguous and at even addresses; written.
        slots: int64 or int32 ``[T'']`` (any stride), T'' ≤ T: ``page · block_size + offset`` per token, −1 = none;
            the entries ≥ 0 distinct.
        positions: int64 or int32 ``[T]`` (any stride), each in ``[0, cos_sin.shape[0])``.
        cos_sin: fp32 ``[max_pos, 64]`` (:func:`cos_sin_cache`) of this layer, rows contiguous.
        block_size: tokens per cache page (required): an int ≥ 1, the one ``cache`` was allocated for.
        eps: rms_norm_eps, a finite number > 0 (1e-6 for DSV4).
        backend: ``"auto"`` (= ``"triton"``), ``"triton"`` (one kernel, :class:`RopeLaunch` picks which) or
            ``"reference"`` (:func:`reference.qnorm_rope_kv_insert`); bit-identical results.
        launch: :class:`RopeLaunch`; None = :func:`default_launch` (2 heads per program, 1 warp; 16 heads
            per program in the interpreter).
    Returns:
        None (q and cache are updated in place; a call that raises has changed neither).
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    validate.tensor(q, "q", dtype=torch.bfloat16, ndim=3)
    T, H, D = q.shape
    if D != HEAD_DIM:
        raise ValueError(f"q: expected [T, H, {HEAD_DIM}], got shape {tuple(q.shape)}")
    if H > MAX_HEADS:
        raise ValueError(f"q: H = {H} query heads; at most {MAX_HEADS} are supported")
    _check_no_overlap(q, "q")
    validate.tensor(kv, "kv", dtype=torch.bfloat16, shape=(T, HEAD_DIM))
    block_size = kv_cache.check_cache(cache, block_size)  # an int >= 1, and the block size of cache's layout
    kv_cache.check_writable(cache)
    validate.tensor(slots, "slots", dtype=(torch.int64, torch.int32), ndim=1)
    if slots.shape[0] > T:
        raise ValueError(f"slots: has {slots.shape[0]} entries but q/kv only {T} rows")
    validate.tensor(positions, "positions", dtype=(torch.int64, torch.int32), shape=(T,))
    if _check_table(cos_sin) != ROPE_DIM:
        raise ValueError(f"cos_sin: expected {ROPE_DIM} columns (cos 0..31 | sin 0..31), got shape {tuple(cos_sin.shape)}")
    if not validate.scalar(eps, "eps") > 0:
        raise ValueError(f"eps: expected a positive finite number, got {eps!r}")
    launch = _check_launch(launch)
    validate.same_device(q=q, kv=kv, cache=cache, slots=slots, positions=positions, cos_sin=cos_sin)
    validate.index_range(slots, "slots", cache.shape[0] * block_size)
    validate.distinct(slots, "slots")  # as kv_cache.insert: two rows must not write one slot
    validate.index_range(positions, "positions", cos_sin.shape[0], allow_minus_one=False)
    if validate.check_values() and slots.numel():  # only rows that are written: padding may hold anything
        bad = ~torch.isfinite(kv[: slots.shape[0]]).all(dim=1) & (slots >= 0)
        if bool(bad.any()):
            i = int(bad.nonzero()[0][0])
            raise ValueError(f"kv: non-finite values (NaN or inf) in row {i}, which goes to slot {int(slots[i])}")
    if backend == "reference":
        reference.qnorm_rope_kv_insert(q, kv, cache, slots, positions, cos_sin, block_size=block_size, eps=eps)
        return
    qc = q if q.stride(2) == 1 else q.contiguous()  # the kernels read rows of 512; written back below
    run = launch.resolve(qc)
    qnorm_rope_kv_insert_op(
        qc,
        kv if kv.stride(1) == 1 else kv.contiguous(),
        cache,
        slots.to(torch.int64).contiguous(),
        positions.to(torch.int64).contiguous(),
        cos_sin,
        float(eps),
        block_size,
        *run.op_args("qnorm_rope_kv_insert"),
    )
    if qc is not q:
        q.copy_(qc)


# ----------------------------------------------------------------------------------------------------
# Example inputs (tests, checks, notebooks)
# ----------------------------------------------------------------------------------------------------


def example_inputs(T: int, H: int, block_size: int, num_blocks: int, *, seed: int, cos_sin: torch.Tensor):
    """Random inputs of :func:`qnorm_rope_kv_insert` on dsv4ref's device.

    Returns:
        ``(q, kv, slots, positions)``: q bf16 ``[T, H, 512]``, kv bf16 ``[T, 512]`` (random over many
        octaves), slots int64 ``[T]`` (distinct, every ``max(1, T // 3)``-th one −1; needs
        ``num_blocks·block_size ≥ T``), positions int64 ``[T]`` in ``[0, cos_sin.shape[0])``.
    """
    q = randn((T, H, HEAD_DIM), seed=seed)
    kv = randn((T, HEAD_DIM), seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, cos_sin.shape[0], (T,), generator=g, device=HOST).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g, device=HOST)[:T].to(DEVICE)
    slots[:: max(1, T // 3)] = -1
    return q, kv, slots, positions
