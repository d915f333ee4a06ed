"""FlashMLA's Hopper sparse-decode kernel behind :func:`dsv4ref.sparse_mla.decode`'s public signature.

The kernel is ``flash_mla.flash_mla_with_kvcache`` from the ``sgl-flash-mla`` wheel (SGLang's packaging of
FlashMLA: one abi3 wheel built for CUDA 13), which keeps FlashMLA's SM90 kernels and the V4 cache format
behind ``use_legacy=True``. Install it with ``pip install --no-deps sgl-flash-mla==1.0.0`` (its metadata asks
for a newer torch than the one it runs on); ``PEERS=1 bash scripts/fetch_gpu_wheels.sh`` fetches the wheel
for a GPU box without internet. Where it does not import, or the device is not a compute-capability-9 GPU,
:func:`available` says why and nothing else here needs it: the module imports on every machine.

Use::

    from dsv4ref import conformance
    from dsv4ref.tools.peers import flashmla

    ok, why = flashmla.available()
    out, lse = flashmla.decode(q, cache, slots, lengths, block_size=64, sink=sink)    # our conventions
    rows = conformance.run({"sparse_mla.decode": flashmla.decode}, "sparse_mla")
    call = flashmla.prepare(**inputs)      # timing: map once, make the scheduler metadata, run once
    raw = call.run()                       # FlashMLA's kernels only (capturable in a device graph)
    out, lse = call.result(raw)

How our arguments map onto FlashMLA's (each mapping is one of the small pure-torch functions below, tested on a
CPU in ``tests/test_flashmla_peer.py``; long entries wrap onto the lines below):

============================================  ============================================  ============================
ours (``sparse_mla.decode``)                  FlashMLA's (``flash_mla_with_kvcache``)       the mapping
============================================  ============================================  ============================
q [T, H, 512] bf16, 1 ≤ H ≤ 128, any strides  q [T, 1, Hp, 512] bf16, Hp ∈ {64, 128}        pad_heads: zero queries
sink [H] fp32, or None                        attn_sink [Hp] fp32, or None                  pad_heads: −inf
cache uint8 [pages, page_bytes(B)], any       k_cache [pages, B, 1, 584], stride(1) = 584,  cache_view: a view, no copy
page stride (pages padded to 576·n bytes)     the page stride from stride(0)
block_size                                    k_cache.shape[1] (page_block_size)            cache_view
slots [T, K] int32 / int64, K ≥ 0; −1 = none  indices [T, 1, Kp] int32; only −1 = none;     pad_slots: negatives → −1,
(value checks off: any negative)              Kp % 64 == 0, Kp ≥ 64; no bounds check        padded with −1
lengths [T] int32 / int64, or None (= K)      topk_length [T] int32, or None (= all Kp)     pad_slots: clamped to [0, K]
extra_cache, extra_block_size                 extra_k_cache [pages2, B2, 1, 584]            cache_view
extra_slots, extra_lengths                    extra_indices_in_kvcache, extra_topk_length   pad_slots
scale                                         softmax_scale                                 as is
—                                             block_table, cache_seqlens None; head_dim_v   fixed
                                              512; causal False; is_fp8_kvcache True;
                                              kv_format "V4"; use_legacy True
—                                             tile_scheduler_metadata =                     prepare: a fresh one per
                                              get_mla_metadata()[0]; num_splits None        input set, made by its
                                                                                            first call, eagerly
out [T, H, 512] bf16, contiguous              out [T, 1, Hp, 512] bf16                      map_out: the real heads
lse [T, H] fp32, natural log, no sink;        softmax_lse [T, Hp, 1] fp32 ([T, 1, Hp]       map_lse: the real heads,
−inf for a row with no valid entry            transposed), natural log, no sink; +inf       +inf → −inf
                                              for a row with no valid entry
T = 0: out [0, H, 512], lse [0, H]            refused (batch size must be positive)         answered here, no call
============================================  ============================================  ============================

Entry (t, k) of a pool counts after the mapping exactly when it counted before: ``k < lengths[t]`` and
``slots[t, k] ≥ 0`` (:func:`pad_slots` keeps the entries past a length as they are; FlashMLA, like us, never
reads them). The page layout needs no mapping: FlashMLA's V4 page is ours byte for byte (B data rows of 576
bytes — 448 e4m3, 64 bf16 RoPE values —, then B scale rows of 8 bytes — 7 UE8M0, 1 pad —); only its shape
differs, which :func:`cache_view` provides without moving a byte.

Refused (``TypeError`` / ``ValueError`` naming the argument, before any launch): what ours refuses of shapes,
dtypes and layouts (H > 128, a cache not laid out for its block size, ...); a cache whose base address or
page stride is not a multiple of 16 bytes (FlashMLA loads 16-byte vectors; ours also reads odd addresses);
a cache of more than 2^31 slots (FlashMLA's slots are int32); with value checks on, a slot outside its cache
(it would be read out of bounds). ``RuntimeError``: FlashMLA not available here (:func:`available`), or
:func:`decode` called inside a graph capture (make the metadata first: :func:`prepare`).

Not mapped, on purpose: non-finite input. FlashMLA's answer to a NaN query or a cache row holding NaN / inf
is its own, and differs from our rule (out = NaN, lse = NaN for the poisoned (token, head)); the conformance
cases that hold that rule are expected to fail here (``docs/glossary.md``, "FlashMLA through our conformance
suite").
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import math

import torch

from ... import kv_cache, validate
from ...device import capability, capturing
from ...formats import HEAD_DIM, TOKEN_BYTES
from ...sparse_mla import DEFAULT_SCALE

__all__ = [
    "WHEEL",
    "MODULE",
    "HEADS",
    "TOPK_MULTIPLE",
    "available",
    "version",
    "cache_view",
    "pad_slots",
    "pad_heads",
    "map_out",
    "map_lse",
    "Call",
    "map_inputs",
    "prepare",
    "decode",
]

WHEEL = "sgl-flash-mla==1.0.0"  # the wheel measured; pip install --no-deps
DISTRIBUTION = "sgl-flash-mla"
MODULE = "flash_mla"  # its import name
HEADS = (64, 128)  # the head counts FlashMLA's FP8 sparse kernels take
TOPK_MULTIPLE = 64  # its SM90 kernel asserts topk % 64 == 0 (and topk > 0)
ALIGN = 16  # bytes: base address and page stride of a cache it reads
MAX_SLOTS = 2**31  # slots are int32


def _module():
    return importlib.import_module(MODULE)


def version() -> str:
    """The installed wheel's version (or the module's), "" when neither says."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(getattr(_module(), "__version__", ""))
    except Exception:  # noqa: BLE001 - not importable: no version to report
        return ""


def available(device=None) -> tuple[bool, str]:
    """``(True, "flash_mla <version>")`` where FlashMLA's SM90 kernels can run on ``device`` (default
    :data:`dsv4ref.DEVICE`): a CUDA device of compute capability 9.x and ``flash_mla`` importable with the
    two functions this adapter calls; else ``(False, why)``. Never raises."""
    cap = capability(device)
    if cap is None:
        return False, "no CUDA device here (FlashMLA's SM90 kernels need a Hopper GPU)"
    if cap[0] != 9:
        return False, f"FlashMLA's SM90 kernels need compute capability 9.x; this device is {cap[0]}.{cap[1]}"
    try:
        m = _module()
    except Exception as e:  # noqa: BLE001 - not installed, or built for another CUDA / torch: skip, saying why
        return False, f"`import {MODULE}` failed ({type(e).__name__}: {e}); `pip install --no-deps {WHEEL}`"
    missing = [n for n in ("flash_mla_with_kvcache", "get_mla_metadata") if not hasattr(m, n)]
    if missing:
        return False, f"{MODULE} has no {', '.join(missing)}: not the interface this adapter maps"
    if callable(getattr(m, "has_legacy", None)) and not m.has_legacy():  # the wheel's SM90 / V4 half did not load
        return False, f"{MODULE} {version()} has no legacy kernels (SM90, the V4 cache format) in this build"
    return True, f"{MODULE} {version()}".strip()


# ----------------------------------------------------------------------------------------------------
# the mapping, one convention per function (pure torch: they run on any device)
# ----------------------------------------------------------------------------------------------------


def cache_view(cache: torch.Tensor, block_size: int, name: str = "cache", bname: str = "block_size") -> torch.Tensor:
    """Our cache as FlashMLA's V4 ``k_cache``: ``[pages, B, 1, 584]`` with strides ``(page stride, 584, 584, 1)``,
    a view of the same bytes (no copy).

    FlashMLA takes the page stride from ``stride(0)`` and finds slot ``page · B + o`` at byte ``576·o`` (its
    data row) and ``576·B + 8·o`` (its scale row) of the page: our layout. The view's rows are therefore
    not records (row o covers bytes ``584·o .. 584·o + 583`` of the page); they are how the kernel is told
    B and the page stride. The view ends 584·B bytes into each page, inside our page (padded to a multiple of
    576), so it never reaches past the cache. Refuses (naming ``name`` / ``bname``) what
    :func:`dsv4ref.kv_cache.check_cache` refuses, and pages whose start is not 16-byte aligned."""
    block_size = validate.integer(block_size, bname, lo=1)
    try:
        kv_cache.check_cache(cache, block_size)
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise type(e)(name + msg[len("cache") :] if msg.startswith("cache:") else f"{name}: {msg}") from None
    if cache.shape[0] and (cache.data_ptr() % ALIGN or (cache.shape[0] > 1 and cache.stride(0) % ALIGN)):
        raise ValueError(
            f"{name}: FlashMLA's kernel loads {ALIGN}-byte vectors: the cache's address and page stride "
            f"must be multiples of {ALIGN} (page stride {cache.stride(0)}, address mod {ALIGN} = "
            f"{cache.data_ptr() % ALIGN}); dsv4ref.kv_cache.allocate gives such a cache"
        )
    return cache.as_strided(
        (cache.shape[0], block_size, 1, TOKEN_BYTES), (cache.stride(0), TOKEN_BYTES, TOKEN_BYTES, 1), cache.storage_offset()
    )


def pad_slots(
    slots: torch.Tensor, lengths: torch.Tensor | None, multiple: int = TOPK_MULTIPLE
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Our ``slots [T, K]`` and ``lengths [T]`` (or None) as FlashMLA's ``indices [T, 1, Kp]`` int32 and
    ``topk_length [T]`` int32 (or None), both contiguous.

    * Kp = K rounded up to a multiple of ``multiple``, at least ``multiple`` (its kernel asserts
      ``topk % 64 == 0`` and ``topk > 0``); entries K..Kp−1 are −1.
    * Every negative slot becomes −1: FlashMLA treats only −1 as "none"; ours (value checks off) counts any
      negative slot as −1.
    * Lengths are clamped to [0, K] (ours are, with value checks off), so no padded entry is ever inside a
      length; None stays None (every entry: the padding is −1).

    Entry (t, k) counts afterwards exactly when it counted before (k < lengths[t] and slots[t, k] ≥ 0);
    entries past a length are kept as they are (neither side reads them)."""
    T, K = slots.shape
    Kp = max(multiple, -(-K // multiple) * multiple)
    idx = torch.full((T, 1, Kp), -1, dtype=torch.int32, device=slots.device)
    idx[:, 0, :K] = slots.clamp_min(-1)
    if lengths is None:
        return idx, None
    return idx, lengths.clamp(0, K).to(torch.int32).contiguous()


def pad_heads(q: torch.Tensor, sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Our ``q [T, H, 512]`` and ``sink [H]`` (or None) as FlashMLA's ``q [T, 1, Hp, 512]`` (contiguous) and
    ``attn_sink [Hp]`` (or None), Hp = 64 for H ≤ 64, else 128: the padded heads get zero queries (a finite
    average of the rows, sliced off by :func:`map_out`) and sink −inf (no sink); an absent sink stays None.
    ``ValueError`` naming ``q`` for H > 128."""
    T, H, D = q.shape
    Hp = next((h for h in HEADS if H <= h), None)
    if Hp is None:
        raise ValueError(f"q: FlashMLA's kernels take at most {HEADS[-1]} heads, got {H}")
    if H == Hp:
        q4 = q.contiguous().unsqueeze(1)
    else:
        q4 = q.new_zeros(T, 1, Hp, D)
        q4[:, 0, :H] = q
    if sink is None:
        return q4, None
    s = sink.new_full((Hp,), -math.inf)
    s[:H] = sink
    return q4, s


def map_out(out: torch.Tensor, heads: int) -> torch.Tensor:
    """FlashMLA's ``out [T, 1, Hp, 512]`` as ours: ``[T, H, 512]`` bf16, contiguous (the real heads)."""
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :heads].contiguous()


def map_lse(lse: torch.Tensor, heads: int) -> torch.Tensor:
    """FlashMLA's ``softmax_lse`` as ours: ``[T, H]`` fp32, contiguous, −inf where FlashMLA wrote +inf.

    FlashMLA returns ``[T, Hp, s_q]`` (its ``[T, s_q, Hp]`` buffer transposed); with s_q = 1 either order
    reshapes to the same ``[T, Hp]``. Both sides use natural-log units and leave the sink out; they differ
    only for a row with no valid entry: +inf there (FlashMLA), −inf here (the log of an empty sum)."""
    x = lse.reshape(lse.shape[0], -1)[:, :heads]
    return torch.where(x == math.inf, -math.inf, x).contiguous()


# ----------------------------------------------------------------------------------------------------
# one call
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Call:
    """One input set in FlashMLA's terms. ``kwargs``: the keyword arguments of ``flash_mla_with_kvcache``
    (``tile_scheduler_metadata`` once :func:`prepare` made it); ``heads``, ``tokens``, ``device``: ours, to map
    the outputs back (``tokens == 0``: nothing to launch)."""

    kwargs: dict
    heads: int
    tokens: int
    device: torch.device

    def run(self):
        """FlashMLA's raw ``(out, lse)`` (None for T = 0). After :func:`prepare`, only FlashMLA's kernels run,
        so a device graph can capture this; the metadata holds while the tensors' shapes and the length
        values stay as they were."""
        if self.tokens == 0:
            return None
        return _module().flash_mla_with_kvcache(**self.kwargs)

    def result(self, raw) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [T, H, 512] bf16, lse [T, H] fp32)`` in our conventions from :meth:`run`'s answer."""
        if self.tokens == 0:
            return (
                torch.empty(0, self.heads, HEAD_DIM, dtype=torch.bfloat16, device=self.device),
                torch.empty(0, self.heads, dtype=torch.float32, device=self.device),
            )
        out, lse = raw
        return map_out(out, self.heads), map_lse(lse, self.heads)


def _pool(T: int, cache, slots, lengths, block_size, names) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One pool's arguments checked and mapped: (k_cache view, indices, topk_length)."""
    cname, sname, lname, bname = names
    view = cache_view(cache, block_size, cname, bname)
    validate.tensor(slots, sname, dtype=(torch.int32, torch.int64), ndim=2)
    if slots.shape[0] != T:
        raise ValueError(f"{sname}: expected {T} rows (one per token of q), got shape {tuple(slots.shape)}")
    if lengths is not None:
        validate.tensor(lengths, lname, dtype=(torch.int32, torch.int64), shape=(T,))
    n = view.shape[0] * view.shape[1]
    if n > MAX_SLOTS:
        raise ValueError(f"{sname}: {cname} holds {n} slots; FlashMLA's int32 slots reach {MAX_SLOTS}")
    validate.index_range(slots, sname, n)  # with value checks on: FlashMLA would read out of bounds
    return (view, *pad_slots(slots, lengths))


def map_inputs(
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
) -> Call:
    """Check our arguments (what :func:`dsv4ref.sparse_mla.decode` checks of shapes, dtypes and layouts, plus
    what FlashMLA needs) and map them (the module's table); no launch, no scheduler metadata yet. Runs on
    any device (the mapping is plain torch)."""
    validate.tensor(q, "q", dtype=torch.bfloat16, ndim=3)
    T, H, D = q.shape
    if D != HEAD_DIM:
        raise ValueError(f"q: expected the latent head dim {HEAD_DIM}, got shape {tuple(q.shape)}")
    if not 1 <= H <= HEADS[-1]:
        raise ValueError(f"q: expected 1..{HEADS[-1]} heads, got {H}")
    if sink is not None:
        validate.tensor(sink, "sink", dtype=torch.float32, shape=(H,))
    scale = validate.scalar(scale, "scale", gt=0)
    validate.same_device(
        q=q,
        cache=cache,
        slots=slots,
        lengths=lengths,
        sink=sink,
        extra_cache=extra_cache,
        extra_slots=extra_slots,
        extra_lengths=extra_lengths,
    )
    view, idx, length = _pool(T, cache, slots, lengths, block_size, ("cache", "slots", "lengths", "block_size"))
    q4, sink4 = pad_heads(q, sink)
    kw = dict(
        q=q4,
        k_cache=view,
        block_table=None,
        cache_seqlens=None,
        head_dim_v=HEAD_DIM,
        num_splits=None,
        softmax_scale=scale,
        causal=False,
        is_fp8_kvcache=True,
        indices=idx,
        attn_sink=sink4,
        topk_length=length,
        kv_format="V4",
        use_legacy=True,
    )
    given = {"extra_cache": extra_cache, "extra_slots": extra_slots, "extra_block_size": extra_block_size}
    if any(v is not None for v in given.values()) or extra_lengths is not None:
        missing = [n for n, v in given.items() if v is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: the extra pool needs extra_cache, extra_slots and extra_block_size together")
        names = ("extra_cache", "extra_slots", "extra_lengths", "extra_block_size")
        view2, idx2, length2 = _pool(T, extra_cache, extra_slots, extra_lengths, extra_block_size, names)
        kw.update(extra_k_cache=view2, extra_indices_in_kvcache=idx2, extra_topk_length=length2)
    return Call(kw, H, T, q.device)


def _first_call(call: Call):
    """Check FlashMLA runs here, give the call a fresh scheduler metadata and run it once, eagerly: FlashMLA
    makes the metadata on an input set's first call (a launch of its own), which must not be captured."""
    ok, why = available(call.device)
    if not ok:
        raise RuntimeError(f"FlashMLA peer: not available for tensors on {call.device}: {why}")
    if call.tokens == 0:  # FlashMLA refuses an empty batch; the answer needs no kernel
        return None
    if capturing(call.device):
        raise RuntimeError(
            "FlashMLA peer: an input set's first call makes its scheduler metadata and cannot be "
            "captured in a device graph; call prepare() before the capture and capture Call.run()"
        )
    call.kwargs["tile_scheduler_metadata"] = _module().get_mla_metadata()[0]
    return call.run()


def prepare(
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
) -> Call:
    """Map one input set, make its scheduler metadata and run it once (eagerly), for timing: the returned
    :class:`Call`'s ``run()`` then launches FlashMLA's kernels only (no mapping, no metadata), which a device
    graph can capture. Same arguments as :func:`decode`."""
    call = map_inputs(
        q,
        cache,
        slots,
        lengths,
        block_size=block_size,
        sink=sink,
        scale=scale,
        extra_cache=extra_cache,
        extra_slots=extra_slots,
        extra_lengths=extra_lengths,
        extra_block_size=extra_block_size,
    )
    _first_call(call)
    return call


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dsv4ref.sparse_mla.decode` computed by FlashMLA's SM90 kernel: the same arguments (no ``backend``,
    no ``launch``), the same outputs ``(out [T, H, 512] bf16, lse [T, H] fp32)`` in our conventions (natural
    log, −inf for an empty row), a fresh scheduler metadata per call. Raises as described in the module's
    docstring; not inside a graph capture (use :func:`prepare`)."""
    call = map_inputs(
        q,
        cache,
        slots,
        lengths,
        block_size=block_size,
        sink=sink,
        scale=scale,
        extra_cache=extra_cache,
        extra_slots=extra_slots,
        extra_lengths=extra_lengths,
        extra_block_size=extra_block_size,
    )
    return call.result(_first_call(call))
