"""The KV compressor of DeepSeek-V4's compressed layers (ratio 4 and ratio 128), as one op with a state.

Every r tokens a compressed layer gains one compressed KV row, a per-channel softmax-weighted sum of the
(projected) tokens of a window, RMS-normed::

    state = allocate_state(num_requests, ratio=4, dim=512)                    # each request's last coff·r tokens
    rows, done = compress(x, wkv, wgate, ape, norm, state.kv, state.score, requests, positions,
                          ratio=4, eps=1e-6)                                  # [T, D] fp32, [T] bool
    # done[t]: token t completed compressed row positions[t] // 4 (the caller rounds it to bf16, rotates it
    # at (p // r)·r and writes it to the compressed cache with slot −1 where not done)

The math, the state and the pitfalls with the tests that catch them: ``docs/compressor.md``.

Where to read what:

* :mod:`dsv4ref.compressor.reference`: the op in plain torch (the stateful form, and the whole-sequence
  form the tests use as their float64 oracle);
* :mod:`dsv4ref.compressor.kernels`: the three Triton kernels (projection, compression, ring update);
* :mod:`dsv4ref.compressor.launch`: :class:`CompressorLaunch`, the workspaces and the custom op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import validate
from ..device import DEVICE, HOST
from . import kernels, reference  # noqa: F401  (dsv4ref.compressor.kernels / .reference, for readers)
from .launch import CompressorLaunch, compressor_compress_op, default_launch
from .reference import RATIOS, compress_sequence, example_inputs, overlap

__all__ = [
    "compress",
    "allocate_state",
    "CompressorState",
    "overlap",
    "compress_sequence",
    "example_inputs",
    "example_step",
    "CompressorLaunch",
    "default_launch",
    "RATIOS",
    "SUPPORTED_BACKENDS",
]

SUPPORTED_BACKENDS = ("reference", "triton")  # "auto" = "triton"


@dataclass
class CompressorState:
    """Per request, the (kv, score) of its last n = coff·r tokens, token p at ring row ``p % n``.

    ``kv`` and ``score``: ``[R, n, coff·D]`` fp32, contiguous; ``score`` starts at −inf ("no token"), but
    rows are only ever read for positions that were stored, so any start value works."""

    kv: torch.Tensor
    score: torch.Tensor


def allocate_state(num_requests: int, ratio: int, dim: int, *, device=None) -> CompressorState:
    """An empty :class:`CompressorState` for ``num_requests`` requests, compressed width ``dim`` (512 for the
    attention path, 128 for the indexer's), on ``device`` (default :data:`dsv4ref.DEVICE`)."""
    coff = overlap(ratio)
    validate.integer(num_requests, "num_requests", lo=1)
    validate.integer(dim, "dim", lo=1)
    n, dev = coff * ratio, device or DEVICE
    return CompressorState(
        kv=torch.zeros(num_requests, n, coff * dim, device=dev),
        score=torch.full((num_requests, n, coff * dim), -math.inf, device=dev),
    )


def _overlapping(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share bytes (metadata only)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check(x, wkv, wgate, ape, norm, state_kv, state_score, requests, positions, valid, ratio, eps):
    coff = overlap(ratio)
    validate.scalar(eps, "eps", gt=0.0)
    validate.tensor(x, "x", dtype=torch.bfloat16, ndim=2)
    T, Hd = x.shape
    validate.tensor(norm, "norm", dtype=torch.float32, ndim=1)
    D = norm.shape[0]
    if D < 16 or D & (D - 1):
        raise ValueError(f"norm: the compressed width D must be a power of two >= 16 (512 or 128), got {D}")
    C, n = coff * D, coff * ratio
    validate.tensor(wkv, "wkv", dtype=torch.bfloat16, shape=(C, Hd))
    validate.tensor(wgate, "wgate", dtype=torch.bfloat16, shape=(C, Hd))
    validate.tensor(ape, "ape", dtype=torch.float32, shape=(ratio, C))
    validate.tensor(state_kv, "state_kv", dtype=torch.float32, shape=(None, n, C), contiguous=True)
    R = state_kv.shape[0]
    validate.tensor(state_score, "state_score", dtype=torch.float32, shape=(R, n, C), contiguous=True)
    validate.tensor(requests, "requests", dtype=(torch.int32, torch.int64), shape=(T,))
    validate.tensor(positions, "positions", dtype=(torch.int32, torch.int64), shape=(T,))
    if valid is not None:
        validate.tensor(valid, "valid", dtype=torch.bool, shape=(T,))
    validate.same_device(
        x=x,
        wkv=wkv,
        wgate=wgate,
        ape=ape,
        norm=norm,
        state_kv=state_kv,
        state_score=state_score,
        requests=requests,
        positions=positions,
        valid=valid,
    )
    validate.not_meta(x, "x")
    if state_kv.numel() and _overlapping(state_kv, state_score):
        raise ValueError("state_score: shares memory with state_kv; the state needs two separate buffers (allocate_state)")
    if validate.check_values() and T:
        ok = torch.ones(T, dtype=torch.bool, device=x.device) if valid is None else valid
        validate.finite(x[ok], "x")
        validate.index_range(requests[ok], "requests", R, allow_minus_one=False)
        p = positions[ok].long()
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= 2**31 - 1):
            raise ValueError(f"positions: expected [0, 2^31 - 1) on valid rows, got {int(p.min())}..{int(p.max())}")
        _check_runs(requests.long(), positions.long(), ok)


def _check_runs(req, pos, ok):
    """The valid rows of one request are ONE run of consecutive rows holding consecutive positions."""
    prev_same = torch.zeros_like(ok)
    prev_same[1:] = ok[1:] & ok[:-1] & (req[1:] == req[:-1]) & (pos[1:] == pos[:-1] + 1)
    starts = ok & ~prev_same
    counts = torch.bincount(req[starts], minlength=1)
    if bool((counts > 1).any()):
        q = int((counts > 1).nonzero()[0, 0])
        raise ValueError(
            f"requests, positions: the rows of request {q} are not one run of consecutive rows with "
            "consecutive positions (a step must hold each request's tokens in order, back to back)"
        )


def compress(
    x, wkv, wgate, ape, norm, state_kv, state_score, requests, positions, *, ratio, eps, valid=None, backend="auto", launch=None
):
    """Run one step's tokens through a compressor: the compressed rows they complete, and the updated state.

    Per token p: ``kv = x·W_kvᵀ``, ``score = x·W_gateᵀ + ape[p % r]`` (fp32). A token with (p + 1) % r == 0
    completes compressed row p // r over the window of n = coff·r positions p − n + 1 … p (coff = 2 for
    ratio 4: the older r tokens give channels [0:D], the newer r tokens [D:2D]; coff = 1 for ratio 128;
    positions < 0 are masked): ``c[d] = Σ_j softmax_j(score[j, d])·kv[j, d]``, then
    ``c · rsqrt(mean(c²) + eps) · norm``. The window comes from this step's tokens where they hold it and
    from the state otherwise; then each request's last n tokens are stored in the state.

    Args:
        x: ``[T, Hd]`` bf16 (any strides), the layer input after ``attn_norm``, one row per token.
        wkv, wgate: ``[coff·D, Hd]`` bf16 (any strides).
        ape: ``[r, coff·D]`` fp32, the score bias of each position inside a block of r tokens.
        norm: ``[D]`` fp32 RMSNorm weight; D a power of two (512 attention path, 128 indexer path).
        state_kv, state_score: ``[R, n, coff·D]`` fp32 contiguous (:func:`allocate_state`), updated in place.
        requests: ``[T]`` int32/int64 in [0, R): the state row of each token.
        positions: ``[T]`` int32/int64 ≥ 0: the absolute position of each token. The valid tokens of one
            request must be one run of consecutive rows holding consecutive positions, continuing what its
            state holds (ValueError otherwise; the state's history itself cannot be checked).
        ratio: 4 or 128 (an int: not bool or float).  eps: the RMSNorm epsilon (1e-6), a finite number > 0.
        valid: ``[T]`` bool or None (all valid); False rows (padding) are ignored entirely, whatever their
            request, position and x.
        backend: ``"auto"`` (= ``"triton"``), ``"triton"`` or ``"reference"`` (plain torch, fp32).
        launch: :class:`CompressorLaunch`; None = :func:`default_launch`.
    Returns:
        ``(rows, done)``: ``[T, D]`` fp32 and ``[T]`` bool; ``done[t]`` when token t is valid and
        (p + 1) % r == 0, and then ``rows[t]`` is compressed row ``p // r`` (RMS-normed, not rounded); rows
        of other tokens are zeros.
    Raises:
        TypeError / ValueError naming the argument, before the state is touched; ``state_score`` sharing
        memory with ``state_kv``. With value checks on (the default): a NaN / ±inf in a valid row of ``x``,
        requests outside [0, R), negative positions, rows of a request that are not one run. With
        ``DSV4REF_CHECK_VALUES=0`` nothing is read on the host; a row whose request is outside [0, R) or whose
        position is negative is treated as padding on every backend (never a read or write outside the
        state); a non-finite x goes through IEEE arithmetic (its kv / score, the rows whose window holds it,
        and its ring row become NaN), the same on every backend.
    """
    backend = validate.backend(backend, SUPPORTED_BACKENDS)
    _check(x, wkv, wgate, ape, norm, state_kv, state_score, requests, positions, valid, ratio, eps)
    if launch is not None and not isinstance(launch, CompressorLaunch):
        raise TypeError(f"launch: expected a CompressorLaunch or None, got {type(launch).__name__}")
    if backend == "reference":
        return reference.compress(
            x, wkv, wgate, ape, norm, state_kv, state_score, requests, positions, valid, ratio=ratio, eps=float(eps)
        )
    T, D = x.shape[0], norm.shape[0]
    rows = torch.empty(T, D, dtype=torch.float32, device=x.device)
    done = torch.empty(T, dtype=torch.bool, device=x.device)
    # padding rows, and (value checks off) requests outside [0, R) or negative positions, become request −1
    ok = (requests >= 0) & (requests < state_kv.shape[0]) & (positions >= 0)
    req = torch.where(ok if valid is None else ok & valid, requests, -1).to(torch.int32)
    compressor_compress_op(
        x,
        wkv,
        wgate,
        ape,
        norm.contiguous(),
        state_kv,
        state_score,
        req.contiguous(),
        positions.to(torch.int32).contiguous(),
        rows,
        done,
        int(ratio),
        float(eps),
        *(launch or default_launch()).op_args(),
    )
    return rows, done


def example_step(
    ratio: int, chunks=(12,), *, dim: int = 512, hidden: int = 256, requests: int = 2, seed: int = 0, device=None
) -> dict:
    """Inputs of one compressor step for tests, notebooks and the conformance suite, drawn on the CPU.

    ``chunks[i]`` tokens of request i at positions 0 … chunks[i] − 1, back to back (a prefill), with a state
    of ``requests`` rows (those past ``len(chunks)`` stay unused). Returns a dict with ``x`` [T, hidden]
    bf16 (one power-of-two scale per row over 2 octaves), the weights of :func:`example_inputs`,
    ``state_kv``/``state_score`` (fresh), ``requests``, ``positions`` (int64), ``ratio`` and ``eps``."""
    from ..seeded import randn

    device = device or DEVICE
    w = example_inputs(ratio, dim=dim, hidden=hidden, seed=seed, device=device)
    T = sum(chunks)
    st = allocate_state(requests, ratio, dim, device=device)
    req = torch.repeat_interleave(torch.arange(len(chunks), device=HOST), torch.tensor(chunks, device=HOST))
    pos = torch.cat([torch.arange(c, device=HOST) for c in chunks])
    return dict(
        x=randn((T, hidden), seed=seed + 1, block=None, octaves=2, device=device),
        **w,
        state_kv=st.kv,
        state_score=st.score,
        requests=req.to(device),
        positions=pos.to(device),
        ratio=ratio,
        eps=1e-6,
    )
