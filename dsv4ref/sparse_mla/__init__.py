"""Sparse MLA decode over the FP8 paged KV cache, with an attention sink.

Every query head of a decode token attends, through ONE shared 512-dim latent row per candidate (MQA;
K = V, the 64 RoPE dims included), to the slots listed for it in one or two paged caches (the
sliding-window pool and the compressed pool), in one softmax with a learned sink logit per head. The
math, the conventions and the pitfalls: ``docs/sparse_mla.md``.

Read in this order:

* :mod:`~dsv4ref.sparse_mla.reference`: the whole op in plain torch (the definition);
* :mod:`~dsv4ref.sparse_mla.kernels`: the fused Triton kernel and the split merge;
* :mod:`~dsv4ref.sparse_mla.launch`: :class:`SparseMlaLaunch`, the launcher and the custom ops;
* :mod:`~dsv4ref.sparse_mla.two_pass`: the seed's two-pass design, for comparison (and
  ``two_pass.seed_decode``, the seed's own per-token structure: rung 0 of notebook 04's ladder);
* :mod:`~dsv4ref.sparse_mla.gluon`: the Hopper kernels (Gluon), with their own :class:`GluonLaunch`.

Backends (``backend=``, from :data:`dsv4ref.validate.BACKENDS`):

* ``"reference"``: :func:`reference.decode` (fp32 torch);
* ``"two_pass"``: dequantise the listed slots into a bf16 workspace, then a bf16 attention kernel;
* ``"triton"``: one fused kernel that reads the e4m3 bytes, the UE8M0 scale bytes and the bf16 RoPE bytes
  straight from the pages and never writes a bf16 copy of the KV; it runs on every device (the interpreter
  too);
* ``"gluon"`` (:data:`GPU_ONLY`): the warp-specialised Hopper kernels of :mod:`~dsv4ref.sparse_mla.gluon`;
  compiled Triton with Gluon on a compute-capability-9 GPU only.

``"auto"`` picks ``"gluon"`` where it runs (Hopper, pages at 16-byte aligned addresses: every cache
:func:`dsv4ref.kv_cache.allocate` makes), else ``"triton"``; a ``launch`` decides it: a
:class:`SparseMlaLaunch` runs ``"triton"``, a :class:`GluonLaunch` ``"gluon"`` (:func:`auto_backend`).
"""

from __future__ import annotations

import torch

from .. import kv_cache, validate
from ..device import DEVICE, HOST
from ..formats import HEAD_DIM
from ..seeded import randn
from . import gluon, reference
from .gluon import GluonLaunch
from .launch import SparseMlaLaunch, default_launch, fused_decode
from .reference import DEFAULT_SCALE
from .two_pass import two_pass_decode

# The backends this op implements, named from the one list dsv4ref.validate.BACKENDS: SUPPORTED_BACKENDS run on every
# device (the interpreter too); GPU_ONLY need compiled Triton with Gluon on a Hopper GPU. "auto": auto_backend().
SUPPORTED_BACKENDS = ("reference", "two_pass", "triton")
GPU_ONLY = ("gluon",)
MAX_HEADS = 128

__all__ = [
    "decode",
    "auto_backend",
    "example_inputs",
    "SparseMlaLaunch",
    "GluonLaunch",
    "default_launch",
    "SUPPORTED_BACKENDS",
    "GPU_ONLY",
    "DEFAULT_SCALE",
]


def auto_backend(q: torch.Tensor, cache: torch.Tensor, extra_cache: torch.Tensor | None = None, launch=None) -> str:
    """What ``backend="auto"`` runs for these inputs: ``"gluon"`` where :func:`gluon.supports` them (compiled
    Triton with Gluon on a Hopper GPU, pages at 16-byte aligned addresses), else ``"triton"``. A launch
    decides it: a :class:`SparseMlaLaunch` is the Triton kernels' (``"triton"``), a :class:`GluonLaunch` the
    Hopper kernels' (``"gluon"``; a ValueError naming ``launch`` where they cannot run these inputs)."""
    if isinstance(launch, SparseMlaLaunch):
        return "triton"
    runs = gluon.supports(q, cache, extra_cache)
    if isinstance(launch, GluonLaunch) and not runs:
        why = (
            "needs compiled Triton with Gluon on a Hopper GPU" if not gluon.available(q.device) else "needs 16-byte aligned pages"
        )
        raise ValueError(f"launch: a GluonLaunch runs the gluon backend, which {why}; pass a SparseMlaLaunch or None")
    return "gluon" if runs else "triton"


def _check_launch(launch, backend: str) -> None:
    """``launch`` is None or the launch of the kernels ``backend`` runs (the reference runs none and takes
    either kind), else a TypeError naming it: a launch is never dropped."""
    if launch is None:
        return
    kinds = {"triton": SparseMlaLaunch, "two_pass": SparseMlaLaunch, "gluon": GluonLaunch}
    want = kinds.get(backend, (SparseMlaLaunch, GluonLaunch))
    if not isinstance(launch, want):
        names = " or ".join(k.__name__ for k in (want if isinstance(want, tuple) else (want,)))
        raise TypeError(f"launch: backend {backend!r} runs a {names} or None, got {type(launch).__name__}")


def _one_device(**tensors: torch.Tensor | None) -> None:
    """Every given tensor on q's device (the first keyword), else a ValueError naming the odd one out; and
    not the meta device, whose tensors hold no values to attend over."""
    (ref_name, ref), *rest = [(n, t) for n, t in tensors.items() if t is not None]
    if ref.device.type == "meta":
        raise ValueError(f"{ref_name}: a tensor on the meta device holds no values; decode needs real tensors")
    for name, t in rest:
        if t.device != ref.device:
            raise ValueError(
                f"{name}: on {t.device}, but {ref_name} is on {ref.device} (every tensor argument must be on one device)"
            )


def _check_layout(cache: torch.Tensor, block_size: int, cname: str) -> None:
    """``cache`` is a KV cache laid out for ``block_size`` tokens per page (:func:`dsv4ref.kv_cache.check_cache`:
    pages exactly ``page_bytes(block_size)`` wide, each contiguous), the error naming the caller's argument."""
    try:
        kv_cache.check_cache(cache, block_size)
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise type(e)(msg.replace("cache:", f"{cname}:", 1) if msg.startswith("cache:") else f"{cname}: {msg}") from None


def _check_pool(T, cache, slots, lengths, block_size, names):
    """Metadata checks of one pool (no device sync); returns slots and lengths, made contiguous where they
    were views with other strides (small index tensors: a copy is cheap, and every backend then reads the
    same layout)."""
    cn, sname, lname, bname = names
    block_size = validate.integer(block_size, bname, lo=1)
    _check_layout(cache, block_size, cn)
    validate.tensor(slots, sname, dtype=(torch.int32, torch.int64), ndim=2)
    if slots.shape[0] != T:
        raise ValueError(f"{sname}: expected {T} rows (one per token of q), got shape {tuple(slots.shape)}")
    if slots.stride(1) != 1 and slots.shape[1] > 1:
        slots = slots.contiguous()
    if lengths is not None:
        validate.tensor(lengths, lname, dtype=(torch.int32, torch.int64), shape=(T,))
        lengths = lengths.contiguous()
    return slots, lengths, block_size


def _check_values(q, sink, pools) -> None:
    """The value checks (each a device sync; skipped with ``DSV4REF_CHECK_VALUES=0``): q finite, sink not
    NaN, every slot −1 or inside its cache, every length in [0, K]."""
    if not validate.check_values():
        return
    validate.finite(q, "q")
    if sink is not None and sink.numel() and bool(sink.isnan().any()):
        i = int(sink.isnan().nonzero()[0][0])
        raise ValueError(f"sink: non-finite values: entry {i} is NaN (±inf are allowed: −inf = no sink, +inf silences the head)")
    for cache, slots, lengths, block_size, (_, sname, lname, _) in pools:
        validate.index_range(slots, sname, cache.shape[0] * block_size)
        if lengths is not None and lengths.numel():
            bad = (lengths < 0) | (lengths > slots.shape[1])
            if bool(bad.any()):
                i = int(bad.nonzero()[0][0])
                raise ValueError(f"{lname}: entry {i} = {int(lengths[i])} is out of range; expected [0, {slots.shape[1]}]")


def decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor | None,
    *,
    block_size: int,
    sink: torch.Tensor | None = None,
    scale: float = DEFAULT_SCALE,
    extra_cache: torch.Tensor | None = None,
    extra_slots: torch.Tensor | None = None,
    extra_lengths: torch.Tensor | None = None,
    extra_block_size: int | None = None,
    backend: str = "auto",
    launch: SparseMlaLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode: every head of every token attends to its listed slots of one or two FP8 caches.

    Args:
        q: ``[T, H, 512]`` bf16, any strides (T = 0 is allowed); 1 ≤ H ≤ 128. Heads are padded to the
            kernel's head block inside the kernel (masked rows), never here.
        cache: uint8 pages ``[num_pages, kv_cache.page_bytes(block_size)]`` (exactly that width: the layout
            for ``block_size`` tokens per page), each page contiguous; any page stride ≥ the width (a view of
            a bigger buffer, odd addresses too).
        slots: ``[T, K]`` int32 or int64 flat slots ``page · block_size + offset``, −1 = none; any strides.
        lengths: ``[T]`` int32 or int64 in ``[0, K]``, any stride: only the first ``lengths[t]`` entries of
            row t count (None: all K).
        block_size: tokens per page of ``cache`` (keyword-only, required; an int ≥ 1).
        sink: ``[H]`` fp32 sink logits, any stride, in the softmax denominator only; −inf = no sink, +inf
            silences the head (out 0); NaN is refused. None = no sink.
        scale: softmax scale, a finite number > 0 (DeepSeek-V4: 512^-0.5).
        extra_cache, extra_slots ``[T, K2]``, extra_lengths ``[T]`` (None = all K2), extra_block_size: the
            second pool (the compressed rows next to the window), attended in the same softmax; the same
            rules as the first. Give extra_cache, extra_slots and extra_block_size together.
        backend: "auto" (= "gluon" where it runs, else "triton": :func:`auto_backend`; a launch decides it,
            below), "reference", "two_pass", "triton" (:data:`SUPPORTED_BACKENDS`) or "gluon" (:data:`GPU_ONLY`,
            the warp-specialised Hopper kernels of :mod:`dsv4ref.sparse_mla.gluon`).
        launch: the launch of the kernels that run: a :class:`SparseMlaLaunch` for "triton" and "two_pass"
            (None = :func:`default_launch` for this shape), a :class:`GluonLaunch` for "gluon" (None =
            ``gluon.default_launch``); with "auto", a SparseMlaLaunch runs "triton" and a GluonLaunch "gluon"
            (a ValueError where Gluon cannot run). Any other kind: a TypeError naming ``launch``. The
            reference runs no kernel: it takes either kind and has nothing to shape.
    Returns:
        ``(out, lse)``: out ``[T, H, 512]`` bf16, contiguous; lse ``[T, H]`` fp32, natural log, WITHOUT the
        sink. A row with no valid entry gives out = 0 and lse = −inf (FlashMLA writes +inf there).

    Raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (shape, device, layout or value), the
    message starting with the argument's name, before any work. Every tensor must be on one device. The
    value checks (one device sync; ``DSV4REF_CHECK_VALUES=0`` skips them, read at call time) refuse a
    non-finite q, a NaN sink, a slot that is neither −1 nor inside its cache (entries past the length too)
    and a length outside [0, K]. With them off, every backend gives the same answer
    (``docs/sparse_mla.md#non-finite-input``): a (token, head) whose q holds a NaN or ±inf, or whose token
    counts a cache row holding a NaN or ±inf, gets out = NaN and lse = NaN, never the empty-row answer;
    lengths are clamped to [0, K]; a slot below −1 counts as −1; a slot past the cache is undefined.
    """
    auto = backend == "auto"
    backend = validate.backend(backend, SUPPORTED_BACKENDS + GPU_ONLY, auto="triton")
    if not auto:
        _check_launch(launch, backend)
    elif launch is not None and not isinstance(launch, (SparseMlaLaunch, GluonLaunch)):
        raise TypeError(f"launch: expected a SparseMlaLaunch, a GluonLaunch or None, got {type(launch).__name__}")
    validate.tensor(q, "q", dtype=torch.bfloat16, ndim=3)
    T, H, D = q.shape
    if D != HEAD_DIM:
        raise ValueError(f"q: expected the latent head dim {HEAD_DIM} (448 NoPE + 64 RoPE), got shape {tuple(q.shape)}")
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"q: expected 1..{MAX_HEADS} heads, got {H}")
    names = ("cache", "slots", "lengths", "block_size")
    slots, lengths, block_size = _check_pool(T, cache, slots, lengths, block_size, names)
    pools = [(cache, slots, lengths, block_size, names)]
    extras = {"extra_cache": extra_cache, "extra_slots": extra_slots, "extra_block_size": extra_block_size}
    if any(e is not None for e in extras.values()) or extra_lengths is not None:
        missing = [n for n, e in extras.items() if e is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: the extra pool needs extra_cache, extra_slots and extra_block_size together")
        names2 = ("extra_cache", "extra_slots", "extra_lengths", "extra_block_size")
        extra_slots, extra_lengths, extra_block_size = _check_pool(
            T, extra_cache, extra_slots, extra_lengths, extra_block_size, names2
        )
        pools.append((extra_cache, extra_slots, extra_lengths, extra_block_size, names2))
    if sink is not None:
        validate.tensor(sink, "sink", dtype=torch.float32, shape=(H,))
        sink = sink.contiguous()
    scale = validate.scalar(scale, "scale")
    if scale <= 0:
        raise ValueError(f"scale: expected a number > 0, got {scale}")
    _one_device(
        q=q,
        cache=cache,
        slots=slots,
        lengths=lengths,
        sink=sink,
        extra_cache=extra_cache,
        extra_slots=extra_slots,
        extra_lengths=extra_lengths,
    )
    if q.stride(2) != 1 and q.numel():  # the kernels read q rows as 512 contiguous values: copy the rare other view
        q = q.contiguous()
    if auto:
        backend = auto_backend(q, cache, extra_cache, launch)
    elif backend == "gluon" and not gluon.available(q.device):
        raise ValueError("backend: 'gluon' needs compiled Triton with Gluon on a Hopper GPU")
    _check_values(q, sink, pools)
    args = dict(
        block_size=block_size,
        sink=sink,
        scale=scale,
        extra_cache=extra_cache,
        extra_slots=extra_slots,
        extra_lengths=extra_lengths,
        extra_block_size=extra_block_size,
    )
    if backend == "reference":
        return reference.decode(q, cache, slots, lengths, **args)
    if backend == "two_pass":
        return two_pass_decode(q, cache, slots, lengths, **args, launch=launch)
    if backend == "gluon":
        return gluon.decode_op(
            q,
            cache,
            slots,
            lengths,
            extra_cache,
            extra_slots,
            extra_lengths,
            sink,
            block_size,
            extra_block_size,
            scale,
            launch=launch,
        )
    return fused_decode(q, cache, slots, lengths, **args, launch=launch)


def example_inputs(
    T: int,
    H: int,
    K1: int,
    K2: int = 0,
    *,
    block_size: int = 16,
    extra_block_size: int = 2,
    pages: int = 4,
    extra_pages: int = 24,
    seed: int = 0,
    device=None,
) -> dict:
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
        kv_cache.insert(
            cache,
            randn((n, HEAD_DIM), seed=seed + 10 * i, octaves=6, device=device),
            torch.arange(n, device=device),
            block_size=bs,
            backend="reference",  # the kernel's bytes (tests/test_kv_cache.py), without an interpreted launch
        )
        slots = torch.randint(0, n, (T, K), generator=g, dtype=torch.int32, device=HOST)
        slots[torch.rand(T, K, generator=g, device=HOST) < 0.1] = -1
        lengths = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32, device=HOST)
        lengths[0] = K
        out.update(
            {
                f"{prefix}cache": cache,
                f"{prefix}slots": slots.to(device),
                f"{prefix}lengths": lengths.to(device),
                f"{prefix}block_size": bs,
            }
        )
    q = (randn((T, H, HEAD_DIM), seed=seed + 99, octaves=4, device=device).float() * 0.25).to(torch.bfloat16)
    sink = (torch.randn(H, generator=g, device=HOST) * 2).to(device or DEVICE)
    return {"q": q, **out, "sink": sink}
