"""Sparse MLA decode over the FP8 paged KV cache, with an attention sink.

Every query head of a decode token attends, through ONE shared 512-dim latent row per candidate (MQA;
K = V, the 64 RoPE dims included), to the slots listed for it in one or two paged caches (the
sliding-window pool and the compressed pool), in one softmax with a learned sink logit per head. The
math, the conventions and the pitfalls: ``docs/sparse_mla.md``.

Read in this order:

* :mod:`~dsv4ref.sparse_mla.reference`: the whole op in plain torch (the definition);
* :mod:`~dsv4ref.sparse_mla.kernels`: the fused Triton kernel and the split merge;
* :mod:`~dsv4ref.sparse_mla.launch`: :class:`SparseMlaLaunch`, the launcher and the custom ops;
* :mod:`~dsv4ref.sparse_mla.two_pass`: the seed's two-pass design, for comparison.

Backends (``backend=``, from :data:`dsv4ref.validate.BACKENDS`):

* ``"reference"``: :func:`reference.decode` (fp32 torch);
* ``"two_pass"``: dequantise the listed slots into a bf16 workspace, then a bf16 attention kernel;
* ``"triton"`` (what ``"auto"`` picks): one fused kernel that reads the e4m3 bytes, the UE8M0 scale bytes
  and the bf16 RoPE bytes straight from the pages and never writes a bf16 copy of the KV.
"""

from __future__ import annotations

import torch

from .. import kv_cache, validate
from ..device import DEVICE
from ..formats import HEAD_DIM
from ..testing import randn
from . import reference
from .launch import SparseMlaLaunch, default_launch, fused_decode
from .reference import DEFAULT_SCALE
from .two_pass import two_pass_decode

# The backends this op implements, named from the one list dsv4ref.validate.BACKENDS ("auto" -> "triton").
# "gluon" (a GPU-only backend in sparse_mla/gluon.py) is not wired here yet.
SUPPORTED = ("reference", "two_pass", "triton")
MAX_HEADS = 128

__all__ = ["decode", "example_inputs", "SparseMlaLaunch", "default_launch", "SUPPORTED", "DEFAULT_SCALE"]


def _check_pool(q, cache, slots, lengths, block_size, names):
    cn, sname, lname, bname = names
    T = q.shape[0]
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{bname}: expected a positive int, got {block_size!r}")
    try:
        kv_cache.check_cache(cache, block_size)
    except (TypeError, ValueError) as e:  # name the argument the caller used
        msg = str(e)
        raise type(e)(msg.replace("cache:", f"{cn}:", 1) if msg.startswith("cache:") else f"{cn}: {msg}") from None
    validate.tensor(slots, sname, dtype=(torch.int32, torch.int64), ndim=2)
    if slots.shape[0] != T:
        raise ValueError(f"{sname}: expected {T} rows (one per token of q), got shape {tuple(slots.shape)}")
    if slots.stride(1) != 1:
        raise ValueError(f"{sname}: rows must be contiguous (strides {slots.stride()})")
    validate.index_range(slots, sname, cache.shape[0] * block_size)
    if lengths is not None:
        validate.tensor(lengths, lname, dtype=torch.int32, shape=(T,))
        if not lengths.is_contiguous():
            raise ValueError(f"{lname}: expected a contiguous tensor")
        bad = (lengths < 0) | (lengths > slots.shape[1])
        if validate.CHECK_VALUES and T and bool(bad.any()):
            i = int(bad.nonzero()[0][0])
            raise ValueError(f"{lname}: entry {i} = {int(lengths[i])} is out of range; expected [0, {slots.shape[1]}]")
    validate.same_device(**{cn: cache, sname: slots, lname: lengths})


def decode(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor | None, *, block_size: int,
           sink: torch.Tensor | None = None, scale: float = DEFAULT_SCALE, extra_cache: torch.Tensor | None = None,
           extra_slots: torch.Tensor | None = None, extra_lengths: torch.Tensor | None = None,
           extra_block_size: int | None = None, backend: str = "auto",
           launch: SparseMlaLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode: every head of every token attends to its listed slots of one or two FP8 caches.

    Args:
        q: ``[T, H, 512]`` bf16, last dim contiguous (any T and H strides); 1 ≤ H ≤ 128. Heads are padded
            to the kernel's head block inside the kernel (masked rows), never here.
        cache: uint8 pages ``[num_pages, page_stride]`` in the ``dsv4ref.kv_cache`` layout, ``block_size``
            tokens per page.
        slots: ``[T, K]`` int32 or int64 flat slots ``page · block_size + offset``, −1 = none; rows contiguous
            (``slots.stride(1) == 1``).
        lengths: ``[T]`` int32 in ``[0, K]``, contiguous: only the first ``lengths[t]`` entries of row t
            count (None: all K).
        block_size: tokens per page of ``cache`` (keyword-only, required).
        sink: ``[H]`` fp32 sink logits (±inf allowed), in the softmax denominator only; None = no sink.
        scale: softmax scale (DeepSeek-V4: 512^-0.5).
        extra_cache, extra_slots ``[T, K2]``, extra_lengths ``[T]`` (None = all K2), extra_block_size: the
            second pool (the compressed rows next to the window), attended in the same softmax. Give
            extra_cache, extra_slots and extra_block_size together.
        backend: "auto" (= "triton"), "reference", "two_pass" or "triton" (:data:`SUPPORTED`).
        launch: the kernels' :class:`SparseMlaLaunch`; None = :func:`default_launch` for this shape.
    Returns:
        ``(out, lse)``: out ``[T, H, 512]`` bf16, contiguous; lse ``[T, H]`` fp32, natural log, WITHOUT the
        sink. A row with no valid entry gives out = 0 and lse = −inf.

    Every entry of ``slots`` (also past the length) must be −1 or a slot inside its cache: checked here
    with a device sync (``DSV4REF_CHECK_VALUES=0`` skips the value checks).
    """
    backend = validate.backend(backend, SUPPORTED, auto="triton")
    validate.tensor(q, "q", dtype=torch.bfloat16, ndim=3)
    T, H, D = q.shape
    if D != HEAD_DIM:
        raise ValueError(f"q: expected the latent head dim {HEAD_DIM} (448 NoPE + 64 RoPE), got shape {tuple(q.shape)}")
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"q: expected 1..{MAX_HEADS} heads, got {H}")
    if q.stride(2) != 1:
        raise ValueError(f"q: the last dim must be contiguous (strides {q.stride()})")
    _check_pool(q, cache, slots, lengths, block_size, ("cache", "slots", "lengths", "block_size"))
    extras = {"extra_cache": extra_cache, "extra_slots": extra_slots, "extra_block_size": extra_block_size}
    if any(e is not None for e in extras.values()) or extra_lengths is not None:
        missing = [n for n, e in extras.items() if e is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: the extra pool needs extra_cache, extra_slots and "
                             f"extra_block_size together")
        _check_pool(q, extra_cache, extra_slots, extra_lengths, extra_block_size,
                    ("extra_cache", "extra_slots", "extra_lengths", "extra_block_size"))
    if sink is not None:
        validate.tensor(sink, "sink", dtype=torch.float32, shape=(H,))
        sink = sink.contiguous()
    if launch is not None and not isinstance(launch, SparseMlaLaunch):
        raise TypeError(f"launch: expected a SparseMlaLaunch or None, got {type(launch).__name__}")
    validate.same_device(q=q, cache=cache, extra_cache=extra_cache, sink=sink)
    args = dict(block_size=block_size, sink=sink, scale=scale, extra_cache=extra_cache, extra_slots=extra_slots,
                extra_lengths=extra_lengths, extra_block_size=extra_block_size)
    if backend == "reference":
        return reference.decode(q, cache, slots, lengths, **args)
    if backend == "two_pass":
        return two_pass_decode(q, cache, slots, lengths, **args, launch=launch)
    return fused_decode(q, cache, slots, lengths, **args, launch=launch)


def example_inputs(T: int, H: int, K1: int, K2: int = 0, *, block_size: int = 16, extra_block_size: int = 2,
                   pages: int = 4, extra_pages: int = 24, seed: int = 0, device=None) -> dict:
    """Random inputs for :func:`decode`, as its keyword arguments: ``decode(**example_inputs(...))``.

    Caches of ``pages`` / ``extra_pages`` pages whose every slot holds a row with per-64-block magnitudes
    over 2^-3..2^3; ``[T, K1]`` (and ``[T, K2]``) int32 slots with about 10 % −1 holes and random
    duplicates; random lengths in [0, K] except row 0, which is full; q of magnitude ~0.25; a finite sink
    ``[H]``. ``K2 = 0``: one pool. Drawn with seeded CPU generators, then moved to ``device`` (default:
    :data:`dsv4ref.DEVICE`), so every machine gets the same numbers.

    Returns:
        dict with q, cache, slots, lengths, block_size, sink and, when K2 > 0, extra_cache, extra_slots,
        extra_lengths, extra_block_size.
    """
    if K1 < 1:
        raise ValueError(f"K1: expected >= 1, got {K1}")
    device = device or DEVICE
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (K, bs, n_pages, prefix) in enumerate(((K1, block_size, pages, ""), (K2, extra_block_size, extra_pages, "extra_"))):
        if K == 0:
            continue
        n = bs * n_pages
        cache = kv_cache.allocate(n_pages, bs, device=device)
        kv_cache.insert(cache, randn((n, HEAD_DIM), seed=seed + 10 * i, octaves=6, device=device),
                        torch.arange(n, device=device), block_size=bs)
        slots = torch.randint(0, n, (T, K), generator=g, dtype=torch.int32)
        slots[torch.rand(T, K, generator=g) < 0.1] = -1
        lengths = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
        lengths[0] = K
        out.update({f"{prefix}cache": cache, f"{prefix}slots": slots.to(device), f"{prefix}lengths": lengths.to(device),
                    f"{prefix}block_size": bs})
    q = (randn((T, H, HEAD_DIM), seed=seed + 99, octaves=4, device=device).float() * 0.25).to(torch.bfloat16)
    sink = (torch.randn(H, generator=g) * 2).to(device)
    return {"q": q, **out, "sink": sink}
