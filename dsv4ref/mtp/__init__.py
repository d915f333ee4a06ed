"""Multi-token prediction (MTP): DeepSeek-V4's draft layer and greedy verification, for speculative decoding.

::

    X = draft_input(h_prev, embed[tok_next], positions, enorm, hnorm, e_proj, h_proj, eps=1e-6)   # [T, M, Hd]
    X = <one SWA-only V4 block with its own KV cache>                   # dsv4ref.decode.Decoder.draft runs it
    logits = draft_logits(X, hc_fn, hc_scale, hc_base, norm, lm_head)   # [T, V] fp32: own head, shared LM head
    drafts = greedy_tokens(logits)                                      # argmax, ties to the lowest id
    ...
    emitted = greedy_accept(drafts, target)     # drafts [k], target [k+1] = the target's argmax at k+1 rows

With greedy decoding, speculation cannot change the output: every emitted token is the target's own argmax
at its position, computed from the same tokens as plain decoding would (``docs/mtp.md#why-greedy-output-cannot-change``).
The math, the shapes, the cache and the pitfalls with the tests that catch them: ``docs/mtp.md``.

* :mod:`dsv4ref.mtp.reference`: the pieces in plain torch (float32, or float64 as the tests' oracle);
* :class:`dsv4ref.decode.Decoder` (``draft`` / ``verify`` / ``speculate``): the draft layer's block, its
  KV cache, the batched verification and the roll-back of the compressor state after rejected drafts.
* the draft layer's random weights are model-level, drawn beside the target's: :func:`dsv4ref.decode.make_weights`
  stores them under ``"mtp"`` (:func:`dsv4ref.decode.mtp_weights` draws them alone); the functions here take
  them as arguments.
"""

from __future__ import annotations

import torch

from .. import mhc, validate
from . import reference
from .reference import greedy_tokens

__all__ = [
    "greedy_accept",
    "greedy_tokens",
    "accepted_counts",
    "draft_input",
    "draft_logits",
    "SUPPORTED_BACKENDS",
]

SUPPORTED_BACKENDS = ("reference", "triton")  # draft_logits' hc head; "auto" = "triton"
INDEX_DTYPES = (torch.int32, torch.int64)
_HEAD_ARGS = {"hidden": "X", "fn": "hc_fn", "scale": "hc_scale", "base": "hc_base"}  # mhc.head's → draft_logits'


def greedy_accept(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Greedy verification of k draft tokens: the tokens the target model emits.

    ``target[j]`` is the target's argmax at verification row j (ties to the lowest id), i.e. its own choice
    for the position that ``drafts[j]`` claims; ``target[k]`` is the bonus token after the last draft. The
    emitted tokens are the agreeing prefix of the drafts, then the target's token at the first disagreement;
    or all k drafts plus the bonus token when every draft agrees. Since the agreeing drafts equal the
    target's tokens, that is ``target[:m + 1]`` with m the number of leading agreements.

    Args:
        drafts: ``[k]`` int64 (or int32) token ids ≥ 0, k ≥ 0 (a float or bool dtype: TypeError).
        target: ``[k + 1]`` int64 (or int32) token ids ≥ 0, on the same device.
    Returns:
        ``[m + 1]`` int64, 1 ≤ m + 1 ≤ k + 1: the emitted tokens, in order.

    >>> greedy_accept(torch.tensor([5, 7, 9]), torch.tensor([5, 7, 8, 2]))
    tensor([5, 7, 8])
    """
    validate.tensor(drafts, "drafts", dtype=INDEX_DTYPES, ndim=1)
    k = drafts.shape[0]
    validate.tensor(target, "target", dtype=INDEX_DTYPES, shape=(k + 1,))
    m = int(accepted_counts(drafts[None], target[None])[0])
    return target[: m + 1].to(torch.int64).clone()


def _check_tokens(drafts, target, dims):
    """drafts ``[R, k]`` / target ``[R, k + 1]`` (``dims`` = 2) or ``[k]`` / ``[k + 1]`` (1): integer token
    ids (int32 / int64: a float or bool id is refused, never truncated), on one real device, ≥ 0 (checks on)."""
    validate.tensor(drafts, "drafts", dtype=INDEX_DTYPES, ndim=dims)
    lead = tuple(drafts.shape[:-1])
    k = drafts.shape[-1]
    validate.tensor(target, "target", dtype=INDEX_DTYPES, ndim=dims)
    if tuple(target.shape) != (*lead, k + 1):
        raise ValueError(
            f"target: expected shape {(*lead, k + 1)} (the k = {k} drafts' rows and the bonus token"
            f"{', one row per row of drafts' if dims == 2 else ''}), got {tuple(target.shape)}"
        )
    validate.same_device(drafts=drafts, target=target)
    validate.not_meta(drafts, "drafts")
    if validate.check_values():
        for t, name in ((drafts, "drafts"), (target, "target")):
            if t.numel() and int(t.min()) < 0:
                raise ValueError(f"{name}: token ids must be >= 0, got a minimum of {int(t.min())}")


def accepted_counts(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """For a batch: ``[R]`` int64, the number of leading drafts of each row that equal the target's token
    (0..k); row r then emits ``target[r, :count + 1]``.

    Args:
        drafts: ``[R, k]`` int32/int64 token ids ≥ 0 (k ≥ 0).
        target: ``[R, k + 1]`` int32/int64 token ids ≥ 0: the same R rows (never broadcast), and the bonus
            token's column.
    Raises:
        TypeError (not a tensor, a float or bool dtype) / ValueError (shapes, devices, the meta device; with
        value checks on, a negative id), naming the argument."""
    _check_tokens(drafts, target, 2)
    agree = (drafts.long() == target[:, : drafts.shape[1]].long()).to(torch.int64)
    return agree.cumprod(dim=1).sum(dim=1)  # leading run of agreements


def draft_input(
    h_prev,
    embed_rows,
    positions,
    enorm,
    hnorm,
    e_proj,
    h_proj,
    *,
    eps,
    hc_mult=None,
    zero_first=False,
    e_proj_scale=None,
    h_proj_scale=None,
):
    """The draft layer's block input ``X = h_proj(hnorm(h_prev[m])) + e_proj(enorm(e))`` for every stream m.

    ``e`` is the shared embedding of the NEXT token (the one at position q + 1), on every row, position 0
    included (DeepSeek's ``MTPBlock``; ``zero_first=True``: vLLM's convention, e = 0 on rows at position 0);
    ``hnorm`` is an RMSNorm over Hd of each stream separately; ``e_proj(e)`` is added to all M streams.
    bf16 GEMMs with fp32 accumulation, each projection's output rounded to bf16, then one bf16 add (DeepSeek
    adds the two bf16 outputs).

    Args:
        h_prev: ``[T, M, Hd]`` bf16, or the flat stash ``[T, M·Hd]`` with ``hc_mult=M``: the target's
            pre-hc_head residual at each row's position q (or the previous draft's output X).
        embed_rows: ``[T, Hd]`` bf16, ``embed[tok_{q+1}]``.
        positions: ``[T]`` int32/int64, q.
        enorm, hnorm: ``[Hd]`` fp32 RMSNorm weights.  e_proj, h_proj: ``[Hd, Hd]`` bf16, or V4's FP8
            (float8_e4m3fn with ``e_proj_scale`` / ``h_proj_scale`` float8_e8m0fnu ``[⌈Hd/128⌉, ⌈Hd/128⌉]``: the
            normed rows then go through the 1x128 activation quantiser and the FP8 GEMM, bf16 out).
        eps: the RMSNorm epsilon (1e-6), a finite number > 0.  hc_mult: M (an int ≥ 1), required when
            ``h_prev`` is flat.  zero_first: a bool; True zeroes e on rows at position 0 (vLLM).
    Returns:
        ``[T, M, Hd]`` bf16.
    Raises:
        TypeError / ValueError naming the argument. With value checks on (the default): a NaN / ±inf in
        ``h_prev`` or ``embed_rows``, a negative position. With ``DSV4REF_CHECK_VALUES=0``: IEEE arithmetic
        (a non-finite row gives a NaN X row; a negative position is not 0, so its embedding is kept).
    """
    validate.tensor(h_prev, "h_prev", dtype=torch.bfloat16)
    if hc_mult is not None:
        validate.integer(hc_mult, "hc_mult", lo=1)
    if h_prev.dim() == 2:
        if hc_mult is None or h_prev.shape[1] % hc_mult:
            raise ValueError(f"hc_mult: a flat h_prev [T, M·Hd] stash needs hc_mult=M dividing {h_prev.shape[1]}, got {hc_mult}")
        h_prev = h_prev.reshape(h_prev.shape[0], hc_mult, -1)
    validate.tensor(h_prev, "h_prev", ndim=3)
    T, M, Hd = h_prev.shape
    validate.tensor(embed_rows, "embed_rows", dtype=torch.bfloat16, shape=(T, Hd))
    validate.tensor(positions, "positions", dtype=INDEX_DTYPES, shape=(T,))
    for t, name in ((enorm, "enorm"), (hnorm, "hnorm")):
        validate.tensor(t, name, dtype=torch.float32, shape=(Hd,))
    for t, sc, name in ((e_proj, e_proj_scale, "e_proj"), (h_proj, h_proj_scale, "h_proj")):
        validate.tensor(t, name, dtype=torch.float8_e4m3fn if sc is not None else torch.bfloat16, shape=(Hd, Hd))
        if sc is not None:
            validate.tensor(sc, f"{name}_scale", dtype=torch.float8_e8m0fnu, shape=(-(-Hd // 128), -(-Hd // 128)))
    if hc_mult is not None and hc_mult != M:
        raise ValueError(f"hc_mult: {hc_mult} does not match h_prev's {M} streams (shape {tuple(h_prev.shape)})")
    validate.scalar(eps, "eps", gt=0.0)
    if not isinstance(zero_first, bool):
        raise TypeError(f"zero_first: expected a bool, got {type(zero_first).__name__} {zero_first!r}")
    validate.same_device(
        h_prev=h_prev, embed_rows=embed_rows, positions=positions, enorm=enorm, hnorm=hnorm, e_proj=e_proj, h_proj=h_proj
    )
    validate.not_meta(h_prev, "h_prev")
    if validate.check_values():
        validate.finite(h_prev, "h_prev")
        validate.finite(embed_rows, "embed_rows")
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"positions: expected positions >= 0, got a minimum of {int(positions.min())}")
    return reference.draft_input(
        h_prev,
        embed_rows,
        positions,
        enorm,
        hnorm,
        e_proj,
        h_proj,
        eps=float(eps),
        zero_first=zero_first,
        e_proj_scale=e_proj_scale,
        h_proj_scale=h_proj_scale,
    )


def draft_logits(X, hc_fn, hc_scale, hc_base, norm, lm_head, *, rms_eps=1e-6, hc_eps=1e-6, backend="auto"):
    """The draft layer's logits: the MTP's OWN hc head and norm, then the SHARED LM head.

    ``y = HCHead(X)`` (:func:`dsv4ref.mhc.head` with the MTP's ``hc_head`` parameters), ``y = RMSNorm(y)·norm``
    rounded to bf16, ``logits = fp32(y) @ fp32(lm_head)ᵀ``: the target's head, with the MTP's parameters.

    Args:
        X: ``[T, M, Hd]`` bf16, the draft block's output streams.
        hc_fn, hc_scale, hc_base: ``[M, M·Hd]``, ``[1]``, ``[M]`` fp32, the MTP's own ``hc_head``.
        norm: ``[Hd]`` fp32, the MTP's own final norm.  lm_head: ``[V, Hd]`` bf16, the target's.
        rms_eps, hc_eps: 1e-6.  backend: for the hc head: "auto" (= "triton") | "reference" | "triton".
    Returns:
        ``[T, V]`` fp32.
    Raises:
        TypeError / ValueError naming this function's arguments (``X``, ``hc_fn``, ``hc_scale``, ``hc_base``,
        ``norm``, ``lm_head``, ...), with the checks and the non-finite policy of :func:`dsv4ref.mhc.head`.
    """
    validate.tensor(X, "X", dtype=torch.bfloat16, ndim=3)
    Hd = X.shape[2]
    validate.tensor(norm, "norm", dtype=torch.float32, shape=(Hd,))
    validate.tensor(lm_head, "lm_head", dtype=torch.bfloat16, shape=(None, Hd))
    for t, name in ((hc_fn, "hc_fn"), (hc_scale, "hc_scale"), (hc_base, "hc_base")):
        validate.tensor(t, name)
    validate.same_device(X=X, hc_fn=hc_fn, hc_scale=hc_scale, hc_base=hc_base, norm=norm, lm_head=lm_head)
    validate.not_meta(X, "X")
    try:
        y = mhc.head(X, hc_fn, hc_scale, hc_base, rms_eps=rms_eps, hc_eps=hc_eps, backend=backend)
    except (TypeError, ValueError) as e:  # mhc.head names its own arguments: say ours
        name, sep, rest = str(e).partition(":")
        if sep and name in _HEAD_ARGS:
            raise type(e)(_HEAD_ARGS[name] + sep + rest) from None
        raise
    y = reference.rms_norm(y, norm, rms_eps).to(torch.bfloat16)
    return y.float() @ lm_head.float().T
