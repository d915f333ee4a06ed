"""Speculative decoding with the MTP draft layer, as methods of :class:`~dsv4ref.decode.Decoder`
(``docs/mtp.md``): :meth:`~Speculating.speculate` = :meth:`~Speculating.draft` k tokens with the draft layer
(:mod:`dsv4ref.mtp`: its own SWA-only block and window cache), then :meth:`~Speculating.verify` them as k + 1
rows per request of ONE target step, keep the target's greedy tokens (:func:`dsv4ref.mtp.greedy_accept`) and
roll the compressor state back past the rejected rows (``docs/mtp.md#verification``).

:class:`Speculating` is a base class of the Decoder, kept in its own module so the decode step
(:mod:`.model`) reads on its own; it uses the Decoder's stack (:mod:`.stack`: ``_forward``, ``_attention``,
``_ffn``, ``_head``) and bookkeeping (``_rows``, ``_keep``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import mhc, mtp, validate
from ..device import HOST
from .state import Rows

__all__ = ["Speculation", "Speculating"]


@dataclass
class Speculation:
    """One :meth:`Decoder.speculate` round: ``drafts`` (R, k) int64, ``target`` (R, k + 1) int64 (the target's
    argmax at the k + 1 verification rows), ``accepted`` (R,) int64 (leading drafts that matched),
    ``emitted`` [per request (accepted + 1,) int64], ``logits`` (R, k + 1, V) fp32 of the verification rows,
    ``next`` (R,) int64 (each request's last emitted token: the next step's input)."""

    drafts: torch.Tensor
    target: torch.Tensor
    accepted: torch.Tensor
    emitted: list
    logits: torch.Tensor
    next: torch.Tensor


class Speculating:
    """The Decoder's speculative-decoding methods (mixed into :class:`~dsv4ref.decode.Decoder`)."""

    def speculate(self, next_ids, k: int, *, backend: str | None = None, draft_backend: str | None = None) -> Speculation:
        """One round of greedy speculative decoding for every request: :meth:`draft` k tokens, then
        :meth:`verify` them in one target step.

        Args: ``next_ids`` (R,) int64, each request's next input token (the argmax of its last logits,
        not yet in the caches); ``k`` drafts per request, 1 ≤ k ≤ 7; ``backend`` for the target step and the
        chained drafts (default: the Decoder's); ``draft_backend`` for the draft layer's catch-up rows
        (default ``backend``; after a prefill those are the whole prompt: "reference" is faster in the CPU
        interpreter). Returns a :class:`Speculation`.

        Every check runs before anything is written: a call that fails (a bad argument, or k + 1 verification
        rows that would go past ``capacity``: :class:`CacheCapacityError`) leaves the caches, ``lengths``,
        ``mtp_done`` and the expert records as they were, so a retry with a smaller k (or :meth:`step`)
        starts from the same state."""
        self._draft_checks(next_ids, k, backend, draft_backend)
        k = validate.integer(k, "k", lo=1, hi=7)
        # the verification writes positions length .. length + k: check them now, before the draft writes
        self._rows(
            torch.arange(self.R, device=HOST),
            self.lengths + k,
            torch.ones(self.R, dtype=torch.bool, device=HOST),
            what="k",
            hint=f"speculating k = {k} drafts verifies k + 1 = {k + 1} rows per request; use a smaller k or step()",
        )
        drafts = self.draft(next_ids, k, backend=backend, catch_up_backend=draft_backend)
        return self.verify(next_ids, drafts, backend=backend)

    def _draft_checks(self, next_ids, k, backend, catch_up_backend) -> tuple:
        """Every check of :meth:`draft`, before it writes anything. Returns (next_ids, k, backend, catch-up
        backend)."""
        if self.mtp_state is None:
            raise ValueError("draft: this Decoder has no MTP layer (cfg.num_nextn_predict_layers = 0 or no 'mtp' weights)")
        next_ids = self._next_ids(next_ids)
        k = validate.integer(k, "k", lo=1, hi=7)
        be = self._backend(backend)
        cbe = be if catch_up_backend is None else self._backend(catch_up_backend)
        if bool((self.lengths - self.mtp_done < 1).any()):
            raise ValueError("draft: every request needs a target step since its last draft (call verify or step)")
        self._rows(
            torch.arange(self.R, device=HOST), self.lengths + k - 2, torch.ones(self.R, dtype=torch.bool, device=HOST)
        )  # capacity
        return next_ids, k, be, cbe

    def draft(self, next_ids, k: int, *, backend: str | None = None, catch_up_backend: str | None = None) -> torch.Tensor:
        """k draft tokens per request from the draft layer. Returns (R, k) int64.

        First the draft layer reads every verified position q it has not seen yet (``mtp_done`` .. length − 1):
        h_prev = the target's pre-head residual at q, the token at q + 1 (``next_ids`` for the last one); its
        window cache gets their KV, and the last row's argmax is draft 1 (the token after ``next_ids``). Then
        draft j (2..k) is one more row per request at the next position, with h_prev = the previous row's
        output X and the token = draft j − 1. Those chained rows write KV at positions the next call
        rewrites from verified rows."""
        next_ids, k, be, cbe = self._draft_checks(next_ids, k, backend, catch_up_backend)
        n = self.lengths - self.mtp_done  # catch-up rows per request
        req = torch.repeat_interleave(torch.arange(self.R, device=HOST), n)
        pos = torch.cat([torch.arange(int(a), int(b), device=HOST) for a, b in zip(self.mtp_done, self.lengths)])
        nxt = torch.where(pos + 1 < self.lengths[req], self.tokens[req, (pos + 1).clamp(max=self.capacity - 1)], next_ids[req])
        rows = self._rows(req, pos, torch.ones_like(pos, dtype=torch.bool))
        X, logits = self._mtp_forward(self.h_hist[rows.req, rows.pos], nxt.to(self.dev), rows, cbe, record=True)
        self.mtp_done = self.lengths.clone()
        last = (torch.cumsum(n, 0) - 1).to(self.dev)
        drafts = [mtp.greedy_tokens(logits[last])]
        X = X[last]
        for j in range(1, k):
            rows = self._rows(
                torch.arange(self.R, device=HOST), self.lengths - 1 + j, torch.ones(self.R, dtype=torch.bool, device=HOST)
            )
            X, logits = self._mtp_forward(X, drafts[-1], rows, be)
            drafts.append(mtp.greedy_tokens(logits))
        return torch.stack(drafts, 1).cpu()

    def verify(self, next_ids, drafts, *, backend: str | None = None) -> Speculation:
        """Greedy verification: ONE target step over the k + 1 rows [next, d_1, …, d_k] of every request (at
        positions length … length + k), the target's argmax at each row, :func:`dsv4ref.mtp.greedy_accept`.

        The accepted rows (next and the m matching drafts) stay in the caches; the rejected ones are rolled
        back: the lengths advance by m + 1 only (their window / compressed-cache / indexer slots are rewritten
        when those positions are decoded again, and nothing reads past a request's length), and the
        compressor states get back the ring rows the rejected tokens overwrote. Returns a
        :class:`Speculation`."""
        next_ids = self._next_ids(next_ids)
        drafts = self._token_ids(drafts, "drafts")
        if drafts.dim() != 2 or drafts.shape[0] != self.R or not 1 <= drafts.shape[1] <= 7:
            raise ValueError(f"drafts: expected shape ({self.R}, k) with 1 <= k <= 7, got {tuple(drafts.shape)}")
        self._check_ids(drafts.flatten(), "drafts")
        be = self._backend(backend)
        k = drafts.shape[1]
        toks = torch.cat([next_ids[:, None], drafts], 1)  # (R, k + 1)
        req = torch.arange(self.R, device=HOST).repeat_interleave(k + 1)
        pos = (self.lengths[:, None] + torch.arange(k + 1, device=HOST)[None, :]).flatten()
        rows = self._rows(req, pos, torch.ones_like(pos, dtype=torch.bool))
        saved = self._ring_rows(rows)
        logits = self._forward(toks.flatten().to(self.dev), rows, be)
        target = mtp.greedy_tokens(logits).view(self.R, k + 1).cpu()
        m = mtp.accepted_counts(drafts, target)
        keep = (torch.arange(k + 1, device=HOST)[None, :] <= m[:, None]).flatten()
        self._restore_ring_rows(saved, rows, ~keep)
        self._keep(rows, keep, toks.flatten())
        self.lengths += m + 1
        emitted = [target[r, : int(m[r]) + 1].clone() for r in range(self.R)]
        return Speculation(
            drafts, target, m, emitted, logits.view(self.R, k + 1, -1), target[torch.arange(self.R, device=HOST), m]
        )

    def _next_ids(self, next_ids) -> torch.Tensor:
        next_ids = self._token_ids(next_ids, "next_ids")
        if tuple(next_ids.shape) != (self.R,):
            raise ValueError(f"next_ids: expected shape ({self.R},), got {tuple(next_ids.shape)}")
        self._check_ids(next_ids, "next_ids")
        return next_ids

    def _mtp_forward(self, h_prev: torch.Tensor, tok: torch.Tensor, rows: Rows, backend: str, record: bool = False):
        """The draft layer on rows at positions ``rows.pos``: input (h_prev (T, M, Hd) bf16, the next token ids
        (T,)), its own block and window cache, its own head. Returns (X (T, M, Hd) bf16, logits (T, V) fp32).
        ``record``: keep the block's expert ids (verified rows only)."""
        cfg, wm, st = self.cfg, self.w["mtp"], self.mtp_state
        B = wm["block"]
        mk = dict(
            rms_eps=cfg.rms_norm_eps,
            hc_eps=cfg.hc_eps,
            sinkhorn_iters=cfg.hc_sinkhorn_iters,
            backend=backend,
            launch=self.mhc_launch,
        )
        X = self._op(
            "mtp",
            mtp.draft_input,
            h_prev,
            self.w["embed"][tok],
            rows.pos,
            wm["enorm"],
            wm["hnorm"],
            wm["e_proj"],
            wm["h_proj"],
            eps=cfg.rms_norm_eps,
            e_proj_scale=wm.get("e_proj_scale"),
            h_proj_scale=wm.get("h_proj_scale"),
        )
        p = B["hc_attn"]
        post, comb, x = self._op("mhc", mhc.pre, X, p["fn"], p["scale"], p["base"], **mk)
        a = self._attention(B, st, x, rows, backend)
        p = B["hc_ffn"]
        X, post, comb, x = self._op("mhc", mhc.fused_post_pre, a, X, post, comb, p["fn"], p["scale"], p["base"], **mk)
        experts = st.experts if record else st.experts.clone()  # a scratch record for the chained drafts
        y = self._ffn(B, experts, x, torch.where(rows.valid, tok, -1), rows, backend)
        X = self._op("mhc", mhc.post, y, X, post, comb, backend=backend, launch=self.mhc_launch)
        return X, self._head(X, wm["hc_head"], wm["norm"], backend)

    def _ring_rows(self, rows: Rows) -> list:
        """The compressor-state rows the step's tokens will overwrite (position p at ring row p % n), saved
        so a rejected token's write can be undone. Returns [(state, saved kv, saved score)]."""
        saved = []
        for st in self.layers:
            for state in st.rings():
                idx = (rows.req, rows.pos % state.kv.shape[1])
                saved.append((state, state.kv[idx].clone(), state.score[idx].clone()))
        return saved

    def _restore_ring_rows(self, saved: list, rows: Rows, undo: torch.Tensor) -> None:
        """Put back the saved ring rows of the step's tokens marked ``undo`` (T,) bool (their positions are
        distinct modulo n as long as k + 1 <= 8, the smallest ring)."""
        u = undo.to(self.dev)
        for state, kv, score in saved:
            idx = (rows.req[u], rows.pos[u] % state.kv.shape[1])
            state.kv[idx] = kv[u]
            state.score[idx] = score[u]
