"""The decode path: a batch of requests decoding through the whole layer stack with paged FP8 caches.

Every box of ``docs/decode.md#one-step-op-by-op`` is a call of a public op with a ``backend`` switch
(``"reference"`` = the op's plain-torch reference, ``"triton"`` / ``"auto"`` = its kernel): the fused
q-norm + RoPE + KV insert, the compressor (:mod:`dsv4ref.compressor`), the lightning indexer's top-k,
sparse MLA decode over window ∪ compressed rows with the attention sink, inverse RoPE, the grouped
o-projection, mHC around attention and around the MoE feed-forward (:mod:`dsv4ref.moe`: routing, FP8
staging, clamped-SwiGLU experts), and the hc_head + final norm + lm_head. Activations are bf16, the small
glue (norms, GEMMs) fp32 math.

With MTP (``cfg.num_nextn_predict_layers = 1``), :meth:`Decoder.speculate` drafts k tokens with the draft
layer (:mod:`dsv4ref.mtp`: its own SWA-only block and KV cache), verifies them as k + 1 rows per request of
ONE target step, keeps the target's greedy tokens (:func:`dsv4ref.mtp.greedy_accept`) and rolls the
compressor state back past the rejected rows (``docs/mtp.md#verification``).

This module holds the :class:`Decoder`'s construction, its public API (prefill, the step, its graph capture,
the history) and the host bookkeeping. Its parts beside it: :mod:`.stack` (the layer stack, the step's device
part: mHC, attention with the compressor and the indexer, the MoE feed-forward, the head), :mod:`.state` (each
layer's caches, :class:`~.state.LayerState`; the step's rows; the captured step), :mod:`.glue` (the small torch
pieces between the ops), :mod:`.speculation` (draft / verify / speculate), :mod:`.traffic` (the bytes each op
moves, as formulas).
"""

from __future__ import annotations

import torch

from .. import mhc, rope, validate
from ..config import TINY, Config
from ..device import DEVICE, HOST, Timer, capture_graph
from ..seeded import generator
from ..weights import check_config, check_weights, layer_ratio, make_weights
from .speculation import Speculating
from .stack import Stack
from .state import CacheCapacityError, History, LayerState, Rows, StepGraph

__all__ = ["Decoder"]

#: backends the decode step can pass to every op it calls
SUPPORTED_BACKENDS = ("reference", "triton")


class Decoder(Speculating, Stack):
    """A batch of ``num_requests`` requests decoding through the whole layer stack with paged caches.

    >>> dec = Decoder(TINY, make_weights(TINY), num_requests=4, capacity=320)
    >>> logits = dec.prefill([prompt0, prompt1, prompt2, prompt3])    # batched: all prompt tokens at once
    >>> logits = dec.step(next_ids)                                   # one token per request

    Caches (per layer, a :class:`~dsv4ref.decode.state.LayerState` in ``self.layers[l]``): ``swa``, the window
    pool, pages of ``cfg.window_page`` tokens; for ratio r > 1 ``comp``, the compressed pool (pages of
    ``cfg.c4_page`` / ``cfg.c128_page`` compressed rows) and ``ring``, the compressor state; for ratio 4
    ``idx_cache``, the indexer-K pool (``cfg.index_page``), ``idx_ring`` and ``topk``, the ids the indexer
    chose (for the reference). Every request owns ``capacity`` tokens of each, in pages drawn from a shuffled
    permutation (its block tables ``bt_swa``, ``layers[l].bt_c``, ``layers[l].bt_i``). The window pool keeps the whole history (a
    serving engine would free pages that slid out of the window); a step that would go past ``capacity``
    raises :class:`CacheCapacityError` instead of overwriting.

    ``mhc_launch`` (one design's launch, e.g. :class:`~dsv4ref.mhc.ChunkedLaunch`; None = each op's default) is passed
    as ``launch=`` to every mHC call: the design (split-K / one kernel / one pass) the step's mHC ops run.
    ``backend`` ("auto", "triton" or "reference") is passed to every op; ``prefill`` defaults to
    "reference" (the CPU interpreter pays for every program of a kernel launch, too slow for hundreds of
    prompt tokens), ``step`` to ``backend``. After each call ``attn_out`` holds every layer's attention
    output (T, Hd) bf16 and ``hidden`` the pre-hc_head residual (T, M, Hd) bf16; set ``prof = {}`` to
    collect per-op milliseconds.

    Each layer's feed-forward is the MoE (``cfg.n_routed_experts`` experts, top ``cfg.num_experts_per_tok``,
    layers below ``cfg.num_hash_layers`` hash-routed by token id); ``layers[l].experts`` records the ids
    it used at each position (for the reference). With ``cfg.num_nextn_predict_layers = 1`` the draft layer
    has its own window cache ``mtp_state.swa`` (same block tables) and :meth:`speculate` /
    :meth:`draft` / :meth:`verify` run speculative decoding; ``mtp_done`` (R,) counts the positions whose
    verified rows the draft layer has already seen.

    ``graph=True`` (needs ``DSV4REF_CHECK_VALUES=0``): :meth:`step` splits into host bookkeeping (ids, rows,
    positions, the indexer's shortcut decision) and a device part over static buffers, captured once per
    (backend, shortcut) with :func:`dsv4ref.device.capture_graph` into a :class:`StepGraph` (``graphs``) and
    replayed; the tokens are the eager path's, bit for bit (``docs/decode.md#one-step-one-graph``). The
    per-position records (``experts``, ``topk``) live on the device, so the step reads nothing back.
    """

    def __init__(
        self,
        cfg: Config = TINY,
        weights: dict | None = None,
        *,
        num_requests: int = 4,
        capacity: int = 320,
        seed: int = 0,
        pad_heads: bool = True,
        index_hadamard: bool = True,
        backend: str = "auto",
        device=None,
        graph: bool = False,
        mhc_launch: mhc.MhcLaunch | None = None,
    ):
        check_config(cfg)
        validate.integer(num_requests, "num_requests", lo=1)
        validate.integer(capacity, "capacity", lo=1, hi=cfg.max_position)
        validate.integer(seed, "seed", lo=0)
        for name, flag in (("pad_heads", pad_heads), ("index_hadamard", index_hadamard), ("graph", graph)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")
        dev = torch.device(device) if device is not None else DEVICE
        if dev.type == "meta":
            raise ValueError("device: the meta device holds no values; a Decoder runs on a real device")
        if weights is not None:  # metadata only: keys, shapes, dtypes, and the Decoder's device (never moved)
            check_weights(cfg, weights, dev)
        self.cfg, self.dev = cfg, dev
        self.backend = validate.backend(backend, SUPPORTED_BACKENDS)
        if mhc_launch is not None and not isinstance(mhc_launch, mhc.MhcLaunch):
            raise TypeError(f"mhc_launch: expected an MhcLaunch or None, got {type(mhc_launch).__name__}")
        self.mhc_launch = mhc_launch  # every mHC call's launch= (None: each op's own, mhc.default_launch(op))
        self.index_hadamard = index_hadamard  # on both the indexer Q and K sides, or neither
        self.w = weights if weights is not None else make_weights(cfg, seed, self.dev)
        self.R, self.capacity = num_requests, capacity
        self.H = cfg.num_heads
        self.Hp = cfg.padded_heads if pad_heads else cfg.num_heads
        self.lengths = torch.zeros(num_requests, dtype=torch.int64, device=HOST)  # host: tokens already in the caches
        self.prof: dict[str, float] | None = None  # per-op milliseconds when profiling
        self.attn_out: list[torch.Tensor] = []
        g = generator(seed + 1)
        dev = self.dev

        def table(rows_per_req: int, page: int):
            n = max(1, -(-rows_per_req // page))
            perm = torch.randperm(num_requests * n, generator=g, device=HOST).to(torch.int32)
            return perm.view(num_requests, n).to(dev), num_requests * n

        # RoPE tables: theta 10000 for window-only layers, 160000 + YaRN for compressed ones. The MTP draft
        # layer is window-only: it needs the theta-10000 table even where no main layer is (V4-Pro)
        has_mtp = bool(cfg.num_nextn_predict_layers) and "mtp" in self.w
        self.cos_sin = {}
        for r in sorted(set(layer_ratio(cfg, i) for i in range(cfg.num_layers)) | ({0} if has_mtp else set())):
            key = "swa" if r == 0 else "comp"
            if key not in self.cos_sin:
                self.cos_sin[key] = (
                    rope.cos_sin_cache(cfg.max_position, cfg.rope_dim, cfg.rope_theta, device=dev)
                    if r == 0
                    else rope.cos_sin_cache(cfg.max_position, cfg.rope_dim, cfg.compress_rope_theta, yarn=cfg.yarn, device=dev)
                )
        self.bt_swa, n_swa = table(capacity, cfg.window_page)

        def record(width: int):
            """Ids chosen at each position, on the device (written inside the step without a host sync);
            one spare column ``capacity`` takes the writes of padding rows."""
            return torch.full((num_requests, capacity + 1, width), -1, dtype=torch.int32, device=dev)

        alloc = dict(num_requests=num_requests, capacity=capacity, n_swa=n_swa, table=table, record=record, device=dev)
        self.layers = [LayerState.allocate(cfg, layer_ratio(cfg, li), **alloc) for li in range(cfg.num_layers)]
        self.tokens = torch.zeros(num_requests, capacity, dtype=torch.int64, device=HOST)  # host: the token history
        self.hidden: torch.Tensor | None = None
        self.mtp_state = None
        if has_mtp:
            # the draft layer: its own window cache (addressed through the same block tables), the target's
            # pre-head residual of every position (its input), and how far it has read them
            self.mtp_state = LayerState.allocate(cfg, 0, **alloc)  # window only
            self.h_hist = torch.zeros(num_requests, capacity, cfg.hc_mult, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
        self.mtp_done = torch.zeros(num_requests, dtype=torch.int64, device=HOST)  # host
        self.graph = graph  # step() through captured device graphs (StepGraph), one per (backend, shortcut)
        self.graphs: dict[tuple, StepGraph] = {}

    # ------------------------------------------------------------------------------------------------
    # public API
    # ------------------------------------------------------------------------------------------------
    def prefill(self, prompts, *, backend: str = "reference") -> torch.Tensor:
        """Run every prompt token of every request through the stack in ONE batched step (each token is a
        query row with its own window and compressed candidates).

        Args: ``prompts``: ``num_requests`` prompts (a list / tuple, or a 2-d integer tensor), each a 1-d
        sequence or tensor of integer token ids (at least one; float and bool ids are refused, never
        truncated); the Decoder must be fresh. Returns the logits (R, V) fp32 of each request's last prompt
        token. Every check runs before anything is written."""
        if not isinstance(prompts, (list, tuple)) and not (isinstance(prompts, torch.Tensor) and prompts.dim() == 2):
            raise TypeError(
                f"prompts: expected a list of {self.R} prompts (num_requests; each a sequence of token "
                f"ids), got {type(prompts).__name__}"
            )
        if len(prompts) != self.R:
            raise ValueError(f"prompts: expected {self.R} prompts (num_requests), got {len(prompts)}")
        if bool((self.lengths > 0).any()):
            raise ValueError("prefill: the caches already hold tokens; prefill a fresh Decoder")
        seqs = [self._token_ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        for i, t in enumerate(seqs):
            if t.dim() != 1 or t.numel() < 1:
                raise ValueError(
                    f"prompts[{i}]: expected a 1-d sequence of at least one token id (one prompt per "
                    f"request: prefill([[5, 6], [7], ...])), got shape {tuple(t.shape)}"
                )
        lens = torch.tensor([t.numel() for t in seqs], dtype=torch.int64, device=HOST)
        ids = torch.cat(seqs)
        self._check_ids(ids, "prompts")
        req = torch.repeat_interleave(torch.arange(self.R, device=HOST), lens)
        pos = torch.cat([torch.arange(n, device=HOST) for n in lens.tolist()])
        rows = self._rows(req, pos, torch.ones_like(pos, dtype=torch.bool))
        logits = self._forward(ids.to(self.dev), rows, validate.backend(backend, SUPPORTED_BACKENDS))
        self._keep(rows, torch.ones_like(pos, dtype=torch.bool), ids)
        self.lengths += lens
        last = torch.cumsum(lens, 0) - 1
        return logits[last.to(self.dev)]

    def step(self, ids, *, active=None, backend: str | None = None) -> torch.Tensor:
        """Decode one token per request.

        Args: ``ids`` (R,) int64, the tokens at positions ``self.lengths``; ``active`` (R,) bool, False
        marks a padding row (slot −1, all lengths 0: nothing written, its position kept); ``backend``
        (default: the Decoder's). Returns the logits (R, V) fp32 (rows of inactive requests are
        meaningless)."""
        # host bookkeeping: the ids, the rows (request, position, validity), the shortcut decision
        ids = self._token_ids(ids, "ids")
        if tuple(ids.shape) != (self.R,):
            raise ValueError(f"ids: expected shape ({self.R},), got {tuple(ids.shape)}")
        self._check_ids(ids, "ids")
        act = torch.ones(self.R, dtype=torch.bool, device=HOST) if active is None else torch.as_tensor(active)
        if act.dtype != torch.bool:
            raise TypeError(f"active: expected bools (a bool tensor or a list of bools), got dtype {act.dtype}")
        validate.not_meta(act, "active")
        act = act.cpu()
        if tuple(act.shape) != (self.R,):
            raise ValueError(f"active: expected shape ({self.R},), got {tuple(act.shape)}")
        be = self._backend(backend)
        rows = self._rows(torch.arange(self.R, device=HOST), self.lengths.clone(), act)
        # the device part: the whole stack, eagerly or as one replayed graph
        logits = self._replay(ids, rows, be) if self.graph else self._forward(ids.to(self.dev), rows, be)
        self._keep(rows, act, ids)
        self.lengths += act.long()
        return logits

    def _replay(self, ids: torch.Tensor, rows: Rows, backend: str) -> torch.Tensor:
        """The device part of :meth:`step` through a :class:`StepGraph`: copy this step's ids and rows into the
        graph's static inputs, replay (capture first if there is no graph for this backend and shortcut yet).
        Returns a copy of the logits; ``attn_out`` and ``hidden`` are the graph's buffers (overwritten by the
        next replay)."""
        if self.prof is not None:
            raise ValueError("graph: profiling (prof) times each op with host syncs; it cannot run in a graph")
        if validate.check_values():
            raise ValueError(
                "graph: capturing the step needs DSV4REF_CHECK_VALUES=0 (value checks read tensors "
                "on the host); use dsv4ref.validate.checking_values(False)"
            )
        key = (backend, rows.shortcut)
        g = self.graphs.get(key)
        fresh = g is None
        if fresh:
            g = StepGraph(ids.to(self.dev), Rows(rows.req.clone(), rows.pos.clone(), rows.valid.clone(), rows.shortcut))
        else:
            g.ids.copy_(ids)
            g.rows.req.copy_(rows.req)
            g.rows.pos.copy_(rows.pos)
            g.rows.valid.copy_(rows.valid)

        def device_part():
            g.logits = self._forward(g.ids, g.rows, backend)
            g.attn_out, g.hidden = self.attn_out, self.hidden

        if fresh:
            # capture_graph runs the step once (warm-up) and records it; the step is idempotent (every write
            # lands on the same slot / ring row with the same bytes), so the replay below repeats it harmlessly
            g.replay = capture_graph(device_part, self.dev)
            g.captured = g.replay is not None
            if g.replay is None:  # no device graphs here (CPU): a stand-in with a graph's static outputs
                device_part()
                g.replay = g.stand_in(device_part)
            self.graphs[key] = g
        g.replay()
        g.replays += 1
        self.attn_out, self.hidden = list(g.attn_out), g.hidden
        return g.logits.clone()

    def history(self) -> History:
        """Per request: the tokens so far (L,) int64 and, per ratio-4 layer, the top-k local ids
        (L, K_top) int32 the indexer chose at each position; ``.experts``: per layer the MoE's expert ids
        (L, K) int32. What :func:`dsv4ref.decode.reference_forward` needs to follow this run. Returns a
        :class:`History` (unpacks as (tokens list, list of {layer: ids}))."""
        toks, topks, experts = [], [], []
        topk = {li: st.topk.cpu() for li, st in enumerate(self.layers) if st.topk is not None}
        exp = {li: st.experts.cpu() for li, st in enumerate(self.layers)}
        for r in range(self.R):
            n = int(self.lengths[r])
            toks.append(self.tokens[r, :n].clone())
            topks.append({li: t[r, :n].clone() for li, t in topk.items()})
            e = {li: t[r, :n].clone() for li, t in exp.items()}
            if self.mtp_state is not None:
                e["mtp"] = self.mtp_state.experts[r, : int(self.mtp_done[r])].cpu()
            experts.append(e)
        return History(toks, topks, experts)

    def _keep(self, rows: Rows, keep: torch.Tensor, ids: torch.Tensor) -> None:
        """Record the kept rows of the last target call: their tokens and (with MTP) their pre-head residual,
        which the draft layer reads later. ``keep`` (T,) bool on the host, ``ids`` (T,) on the host."""
        hreq, hpos, hvalid = rows.host
        k = keep & hvalid
        req, pos = hreq[k], hpos[k]
        self.tokens[req, pos] = ids[k]
        if self.mtp_state is not None:
            self.h_hist[req.to(self.dev), pos.to(self.dev)] = self.hidden[k.to(self.dev)]

    # ------------------------------------------------------------------------------------------------
    # bookkeeping
    # ------------------------------------------------------------------------------------------------
    def _op(self, name: str, fn, *args, **kw):
        """Call a library op; when profiling, time it (device events) and add to ``self.prof[name]``."""
        if self.prof is None:
            return fn(*args, **kw)
        with Timer(self.dev) as t:
            out = fn(*args, **kw)
        self.prof[name] = self.prof.get(name, 0.0) + t.ms
        return out

    def _backend(self, backend: str | None) -> str:
        """A call's ``backend`` argument checked against :data:`SUPPORTED_BACKENDS`; None: the Decoder's."""
        return self.backend if backend is None else validate.backend(backend, SUPPORTED_BACKENDS)

    @staticmethod
    def _token_ids(ids, name: str) -> torch.Tensor:
        """Token ids as an int64 CPU tensor: from an integer tensor or a (nested) sequence of ints. A float or
        bool id is refused (TypeError naming ``name``), never truncated: ``step(logits.max(-1).values)`` must
        not decode token 2 for 2.91; ``step(logits.argmax(-1))`` is meant."""
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids)
            except (TypeError, ValueError, RuntimeError) as e:
                raise (TypeError if isinstance(e, TypeError) else ValueError)(
                    f"{name}: expected integer token ids (a tensor or a sequence of ints), got {type(ids).__name__} ({e})"
                ) from None
            if ids.numel() == 0:  # an empty list holds no float: torch only calls it float32
                ids = ids.to(torch.int64)
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(
                f"{name}: token ids must be integers, got dtype {ids.dtype} (a float or bool is never "
                "read as a token id; pass e.g. logits.argmax(-1))"
            )
        validate.not_meta(ids, name)
        return ids.to(torch.int64).cpu()

    def _check_ids(self, ids: torch.Tensor, name: str) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"{name}: token ids must be in [0, {self.cfg.vocab_size}), got {int(ids.min())}..{int(ids.max())}")

    def _rows(
        self,
        req: torch.Tensor,
        pos: torch.Tensor,
        valid: torch.Tensor,
        *,
        what: str = "",
        hint: str = "make a Decoder with a larger capacity=",
    ) -> Rows:
        """The step's rows from host tensors (req, pos, valid): the capacity check and the indexer's shortcut
        decision happen here, on the host, before anything runs on the device. ``what``: the argument the
        capacity error names first (e.g. ``"k"``), ``hint``: what to do about it."""
        req, pos, valid = req.cpu(), pos.cpu(), valid.cpu()
        bad = valid & (pos >= self.capacity)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise CacheCapacityError(
                f"{what + ': ' if what else ''}request {int(req[i])}: position {int(pos[i])} is past the cache "
                f"capacity of {self.capacity} tokens per request; nothing was written ({hint})"
            )
        pos = torch.where(valid, pos, 0)
        n_c = (pos[valid] + 1) // 4  # the ratio-4 layers' visible compressed rows
        shortcut = n_c.numel() == 0 or int(n_c.max()) <= self.cfg.index_topk
        return Rows(req.to(self.dev), pos.to(self.dev), valid.to(self.dev), shortcut, (req, pos, valid))
