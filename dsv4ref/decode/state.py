"""What a :class:`~dsv4ref.decode.Decoder` keeps and passes around: each layer's caches and records
(:class:`LayerState`), the rows of one step (:class:`Rows`), the history the float64 reference follows
(:class:`History`), a captured step (:class:`StepGraph`), and :class:`CacheCapacityError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import indexer, kv_cache
from ..compressor import CompressorState, allocate_state
from ..config import Config

__all__ = ["LayerState", "Rows", "History", "StepGraph", "CacheCapacityError"]


class CacheCapacityError(ValueError):
    """A decode step would write past the space the caches were allocated with."""


@dataclass
class Rows:
    """The T rows of one step: request id, absolute position and validity of each row (on the device), the
    same three on the host (``host``), and ``shortcut``: every row sees at most K_top compressed rows of a
    ratio-4 layer (the indexer's short-context shortcut), decided on the host so the device part never
    reads a position back."""

    req: torch.Tensor  # (T,) int64
    pos: torch.Tensor  # (T,) int64 (0 for padding rows)
    valid: torch.Tensor  # (T,) bool
    shortcut: bool = True
    host: tuple | None = None  # (req, pos, valid) on the CPU


class History(tuple):
    """What :func:`dsv4ref.decode.reference_forward` needs to follow a run: unpacks as ``(tokens, topks)``
    (per request: the tokens (L,) int64 and {ratio-4 layer: (L, K_top) int32 indexer ids}); ``experts``
    holds per request {layer: (L, K) int32 expert ids the MoE used} (key ``"mtp"``: the draft layer's, at
    the positions the draft layer ran on verified rows)."""

    def __new__(cls, tokens, topks, experts):
        h = super().__new__(cls, (tokens, topks))
        h.experts = experts
        return h


@dataclass
class LayerState:
    """One layer's caches and per-position records in a Decoder (``Decoder.layers[l]``; the MTP draft
    layer's is ``Decoder.mtp_state``, window only). Every request owns ``capacity`` tokens of each pool, in
    pages drawn from a shuffled permutation (its block tables).

    * ``ratio``: 0 (window only), 4 or 128.
    * ``swa``: the window pool (``kv_cache.allocate``: pages of ``cfg.window_page`` 584-B tokens), addressed
      through the Decoder's ``bt_swa``; ``experts`` (R, capacity + 1, K) int32: the MoE's expert ids at each
      position (for the reference; the spare column ``capacity`` takes the writes of padding rows).
    * ratio > 1: ``comp``, the compressed pool (pages of ``page`` = ``cfg.c4_page`` / ``cfg.c128_page``
      compressed rows) behind block table ``bt_c`` (R, pages) int32, and ``ring``, the compressor state.
    * ratio 4: ``idx_cache``, the indexer-K pool (``cfg.index_page``) behind ``bt_i``, ``idx_ring``, the
      indexer compressor's state, and ``topk`` (R, capacity + 1, K_top) int32, the ids the indexer chose.

    Fields a layer of its ratio does not have are None."""

    ratio: int
    swa: torch.Tensor
    experts: torch.Tensor
    page: int | None = None
    bt_c: torch.Tensor | None = None
    comp: torch.Tensor | None = None
    ring: CompressorState | None = None
    bt_i: torch.Tensor | None = None
    idx_cache: torch.Tensor | None = None
    idx_ring: CompressorState | None = None
    topk: torch.Tensor | None = None

    @classmethod
    def allocate(cls, cfg: Config, r: int, *, num_requests: int, capacity: int, n_swa: int, table, record, device) -> LayerState:
        """A fresh layer of ratio ``r`` for ``num_requests`` requests of ``capacity`` tokens: ``n_swa`` window
        pages; ``table(rows_per_request, page)`` draws a block table (returns it and the pool's page count),
        ``record(width)`` makes a per-position record."""
        st = cls(ratio=r, swa=kv_cache.allocate(n_swa, cfg.window_page, device=device), experts=record(cfg.num_experts_per_tok))
        if r > 1:
            st.page = cfg.c4_page if r == 4 else cfg.c128_page
            st.bt_c, n_c = table(capacity // r, st.page)
            st.comp = kv_cache.allocate(n_c, st.page, device=device)
            st.ring = allocate_state(num_requests, r, cfg.head_dim, device=device)
        if r == 4:
            st.bt_i, n_i = table(capacity // 4, cfg.index_page)
            st.idx_cache = indexer.allocate_k_cache(n_i, cfg.index_page, cfg.index_format, device=device)
            st.idx_ring = allocate_state(num_requests, 4, cfg.index_head_dim, device=device)
            st.topk = record(cfg.index_topk)
        return st

    def rings(self) -> list[CompressorState]:
        """The compressor states of this layer (``ring``, then ``idx_ring``), those it has."""
        return [s for s in (self.ring, self.idx_ring) if s is not None]


@dataclass
class StepGraph:
    """The device part of :meth:`Decoder.step` over static buffers, captured once (per backend and indexer
    shortcut) and replayed every step (``docs/decode.md#one-step-one-graph``).

    ``ids`` (R,) int64 and ``rows`` are the static inputs (the host copies each step's values in); ``logits``,
    ``attn_out`` and ``hidden`` the static outputs (tensors of the captured call, refreshed by each replay);
    ``replay()`` runs the step; ``captured`` is False where the device has no graphs (CPU), where replay calls
    the same function over the same buffers; ``replays`` counts the steps run."""

    ids: torch.Tensor
    rows: Rows
    logits: torch.Tensor | None = None
    attn_out: list | None = None
    hidden: torch.Tensor | None = None
    replay: object = None
    captured: bool = False
    replays: int = 0

    def stand_in(self, device_part):
        """A replay for devices without graphs: run ``device_part`` again and copy its outputs into the tensors
        of the first call, as a graph's replay refreshes its captured outputs in place (so a caller that keeps
        an output across steps sees what it would see on a GPU)."""
        logits, attn_out, hidden = self.logits, list(self.attn_out), self.hidden

        def replay():
            device_part()
            logits.copy_(self.logits)
            for a, b in zip(attn_out, self.attn_out):
                a.copy_(b)
            hidden.copy_(self.hidden)
            self.logits, self.attn_out, self.hidden = logits, attn_out, hidden

        return replay
