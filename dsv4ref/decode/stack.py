"""The layer stack of the decode step, as methods of :class:`~dsv4ref.decode.Decoder`: embedding, then per
layer mHC pre → attention (steps 2–9 of ``docs/decode.md#one-step-op-by-op``: projections, the fused q-norm + RoPE
+ KV insert, the compressor, the indexer's top-k, sparse MLA decode, inverse RoPE, the grouped o-projection) → mHC
post / pre → the MoE feed-forward (step 11), then mHC post and the head (hc_head, final norm, lm_head).

:class:`Stack` is a base class of the Decoder, kept in its own module so the Decoder's construction and public API
(:mod:`.model`) read on their own; it uses the Decoder's caches (``layers``, ``bt_swa``, ``cos_sin``), weights
(``w``) and :meth:`~dsv4ref.decode.Decoder._op`. Every write lands through a slot (:meth:`Stack._slots`) or a
record position (:meth:`Stack._record_at`) computed on the device: no host sync inside the step.
"""

from __future__ import annotations

import math

import torch

from .. import compressor as compressor_op
from .. import indexer, kv_cache, mhc, moe, rope, sparse_mla
from .. import linear as lin
from .glue import linear, rms_norm
from .state import LayerState, Rows

__all__ = ["Stack"]


class Stack:
    """The Decoder's device part: the layer stack (mixed into :class:`~dsv4ref.decode.Decoder`)."""

    def _forward(self, ids: torch.Tensor, rows: Rows, backend: str) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        mk = dict(
            rms_eps=cfg.rms_norm_eps,
            hc_eps=cfg.hc_eps,
            sinkhorn_iters=cfg.hc_sinkhorn_iters,
            backend=backend,
            launch=self.mhc_launch,
        )
        self.attn_out = []  # per layer (T, Hd) bf16, for the agreement checks
        input_ids = torch.where(rows.valid, ids, -1)  # the MoE's padding marker (and a hash layer's key)
        h = w["embed"][ids]  # 0: (T, Hd) bf16
        Hs = h[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()  # (T, M, Hd): h repeated, not split
        ffn_out = post = comb = None
        for li, L in enumerate(w["layers"]):
            p = L["hc_attn"]
            if li == 0:  # 1: mHC pre
                post, comb, x = self._op("mhc", mhc.pre, Hs, p["fn"], p["scale"], p["base"], **mk)
            else:  # 10 of the previous layer, fused with this layer's 1
                Hs, post, comb, x = self._op(
                    "mhc", mhc.fused_post_pre, ffn_out, Hs, post, comb, p["fn"], p["scale"], p["base"], **mk
                )
            a = self.attention(li, x, rows, backend)  # 2..9
            self.attn_out.append(a)
            p = L["hc_ffn"]
            Hs, post, comb, x = self._op("mhc", mhc.fused_post_pre, a, Hs, post, comb, p["fn"], p["scale"], p["base"], **mk)
            ffn_out = self._ffn(L, self.layers[li].experts, x, input_ids, rows, backend)  # 11
        Hs = self._op("mhc", mhc.post, ffn_out, Hs, post, comb, backend=backend, launch=self.mhc_launch)  # 12
        self.hidden = Hs  # the pre-hc_head residual: what the draft layer reads
        return self._head(Hs, w["hc_head"], w["final_norm"], backend)

    def _head(self, Hs: torch.Tensor, hc: dict, norm: torch.Tensor, backend: str) -> torch.Tensor:
        """hc_head → RMSNorm → the shared lm_head: (T, V) fp32 (the target's head, or the draft layer's with its
        own ``hc``/``norm``)."""
        cfg = self.cfg
        y = self._op(
            "mhc",
            mhc.head,
            Hs,
            hc["fn"],
            hc["scale"],
            hc["base"],
            rms_eps=cfg.rms_norm_eps,
            hc_eps=cfg.hc_eps,
            backend=backend,
            launch=self.mhc_launch,
        )
        y = rms_norm(y, norm, cfg.rms_norm_eps)
        return self._op("lm_head", lambda: y.float() @ self.w["lm_head"].float().T)

    def _ffn(
        self, L: dict, experts: torch.Tensor, x: torch.Tensor, input_ids: torch.Tensor, rows: Rows, backend: str
    ) -> torch.Tensor:
        """11: the MoE feed-forward on the ffn_norm of ``x``: route (hash layers by token id, padding rows −1),
        stage, experts + shared expert. Records the expert ids of the valid rows in ``experts`` (a layer's
        :attr:`LayerState.experts`)."""
        cfg, m = self.cfg, L["moe"]
        x = rms_norm(x, L["ffn_norm"], cfg.rms_norm_eps)
        ids, wts = self._op(
            "moe",
            moe.route,
            x,
            m["gate_weight"],
            m["bias"],
            k=cfg.num_experts_per_tok,
            routed_scale=cfg.routed_scaling_factor,
            hash_table=m["tid2eid"],
            input_ids=input_ids,
        )
        if m["w13"].dtype == torch.float4_e2m1fn_x2:  # V4's formats: FP4 routed experts, FP8 shared expert
            staged = self._op("moe", moe.stage, x, ids, wts, backend=backend) if cfg.moe_path == "megamoe" else (None,) * 4
            y = self._op(
                "moe",
                moe.experts_fp4,
                x,
                ids,
                wts,
                *(m[k] for k in ("w13", "w13_scale", "w2", "w2_scale")),
                *(m[k] for k in ("shared_w13", "shared_w13_scale", "shared_w2", "shared_w2_scale")),
                swiglu_limit=cfg.swiglu_limit,
                path=cfg.moe_path,
                x_fp8=staged[0],
                x_sf=staged[1],
                backend=backend,
            )
            experts[self._record_at(rows)] = ids.to(torch.int32)
            return y
        staged = self._op("moe", moe.stage, x, ids, wts, backend=backend)
        y = self._op(
            "moe",
            moe.experts,
            x,
            *staged,
            m["w13"],
            m["w2"],
            m["shared_w13"],
            m["shared_w2"],
            swiglu_limit=cfg.swiglu_limit,
            backend=backend,
        )
        experts[self._record_at(rows)] = ids.to(torch.int32)
        return y

    def attention(self, li: int, x: torch.Tensor, rows: Rows, backend: str) -> torch.Tensor:
        """Layer ``li``'s attention block (steps 2–9 of the step map) on the mHC layer input ``x`` (T, Hd)
        bf16 of the step's ``rows``: writes this step's KV rows (window, compressed, indexer K) into the
        caches and returns the block's output (T, Hd) bf16."""
        return self._attention(self.w["layers"][li], self.layers[li], x, rows, backend)

    def _attention(self, L: dict, st: LayerState, x: torch.Tensor, rows: Rows, backend: str) -> torch.Tensor:
        cfg = self.cfg
        r, T, D, H = st.ratio, x.shape[0], cfg.head_dim, self.H
        cos_sin = self.cos_sin["swa" if r == 0 else "comp"]
        eps = cfg.rms_norm_eps
        # 2-3: norm, one GEMM for [qr | kv], their norms, wq_b
        x = rms_norm(x, L["attn_norm"], eps)
        qkv = self._op("proj", linear, x, L["wqkv_a"], L.get("wqkv_a_scale"), backend=backend)
        qr = rms_norm(qkv[:, : cfg.q_lora_rank], L["q_norm"], eps)
        kv = rms_norm(qkv[:, cfg.q_lora_rank :], L["kv_norm"], eps)
        q = self._op("proj", linear, qr, L["wq_b"], L.get("wq_b_scale"), backend=backend).view(T, H, D)
        # 4: fused q-norm + RoPE + KV insert into the window cache (slot −1 for padding rows)
        slots = self._slots(self.bt_swa, rows.req, rows.pos, cfg.window_page, rows.valid)
        self._op(
            "qnorm_rope_kv_insert",
            rope.qnorm_rope_kv_insert,
            q,
            kv,
            st.swa,
            slots,
            rows.pos,
            cos_sin,
            eps=eps,
            block_size=cfg.window_page,
            backend=backend,
        )
        # 5: compressor (before the indexer and attention: a row completed by this token is visible to it)
        if r > 1:
            self._compress(L, st, x, rows, backend)
        # 6: indexer (ratio 4): top-k local compressed ids; ratio 128: every visible compressed row
        extra = {}
        if r > 1:
            n_c = torch.where(rows.valid, (rows.pos + 1) // r, 0)
            if r == 4:
                local = self._indexer(L, st, x, qr, rows, n_c, backend)
            else:
                j = torch.arange(max(1, self.capacity // r), device=self.dev)[None, :]
                local = torch.where(j < n_c[:, None], j, -1)
            ok = local >= 0
            extra = dict(
                extra_cache=st.comp,
                extra_block_size=st.page,
                extra_slots=self._slots(st.bt_c, rows.req, local, st.page, ok).to(torch.int32),
                extra_lengths=ok.sum(1).to(torch.int32),
            )
        # 7: sparse MLA decode over window ∪ compressed rows, sink in the denominator
        W = cfg.window
        swa_len = torch.where(rows.valid, torch.clamp(rows.pos + 1, max=W), 0)
        j = torch.arange(W, device=self.dev)[None, :]
        ok = j < swa_len[:, None]  # packed prefix: [valid…, −1…]
        swa_slots = self._slots(self.bt_swa, rows.req, rows.pos[:, None] - swa_len[:, None] + 1 + j, cfg.window_page, ok)
        sink = L["sink"]
        if self.Hp > H:  # head padding: zero q rows, −inf sinks, sliced off after
            q = torch.cat([q, q.new_zeros(T, self.Hp - H, D)], dim=1)
            sink = torch.cat([sink, sink.new_full((self.Hp - H,), -math.inf)])
        o, _lse = self._op(
            "sparse_mla",
            sparse_mla.decode,
            q,
            st.swa,
            swa_slots.to(torch.int32),
            swa_len.to(torch.int32),
            block_size=cfg.window_page,
            sink=sink,
            scale=cfg.softmax_scale,
            backend=backend,
            **extra,
        )
        # 8: drop padded heads, inverse RoPE at the query position; 9: grouped o-projection
        o = self._op("inv_rope", rope.apply_gptj, o[:, :H].contiguous(), rows.pos, cos_sin, inverse=True, backend=backend)
        fp8 = L.get("wo_b_scale") is not None  # V4's FP8 wo_b: its GEMM on this step's backend; bf16: reference only
        o_proj_backend = backend if fp8 else "reference"
        return self._op("o_proj", lin.grouped_o_proj, o, L["wo_a"], L["wo_b"], L.get("wo_b_scale"), backend=o_proj_backend)

    def _compress(self, L: dict, st: LayerState, x: torch.Tensor, rows: Rows, backend: str) -> None:
        """5: the compressed rows (and, ratio 4, indexer keys) completed by this step, rounded to bf16,
        rotated at (p // r)·r, written through the cache writers. The compressor op returns one row per
        token with a ``done`` flag, so no host sync: rows that complete nothing get slot −1 (not written)."""
        cfg = self.cfg
        r, cos_sin, eps = st.ratio, self.cos_sin["comp"], cfg.rms_norm_eps

        def completed(weights: dict, state: compressor_op.CompressorState, bt: torch.Tensor, page: int):
            """This step's rows: bf16, rotated at (p // r)·r, and their slots (row id p // r, −1 if not done)."""
            out, done = self._op(
                "compressor",
                compressor_op.compress,
                x,
                weights["wkv"],
                weights["wgate"],
                weights["ape"],
                weights["norm"],
                state.kv,
                state.score,
                rows.req,
                rows.pos,
                ratio=r,
                eps=eps,
                valid=rows.valid,
                backend=backend,
            )
            row = rope.apply_gptj(out.to(torch.bfloat16), rope.compressed_position(rows.pos, r), cos_sin, backend=backend)
            return row.contiguous(), self._slots(bt, rows.req, rows.pos // r, page, done)

        row, slots = completed(L["comp"], st.ring, st.bt_c, st.page)
        kv_cache.insert(st.comp, row, slots, block_size=st.page, backend=backend)
        if r == 4:  # the indexer's own compressor (D = 128), into the indexer-K pool
            k, slots = completed(L["idx_comp"], st.idx_ring, st.bt_i, cfg.index_page)
            indexer.insert_k(
                st.idx_cache,
                k,
                slots,
                block_size=cfg.index_page,
                fmt=cfg.index_format,
                hadamard=self.index_hadamard,
                backend=backend,
            )

    def _indexer(
        self, L: dict, st: LayerState, x: torch.Tensor, qr: torch.Tensor, rows: Rows, n_c: torch.Tensor, backend: str
    ) -> torch.Tensor:
        """6: the indexer's top-k local compressed ids (T, K_top) int, a packed prefix, −1 padded. Q and K in
        ``cfg.index_format``: "fp8" (the q scale folded into the head weights, ``q_scales`` None) or "mxfp4"
        (E2M1 blocks of 32 with UE8M0 scales, DeepSeek's FP4; ``docs/decode.md#the-indexer-format``)."""
        cfg = self.cfg
        T = x.shape[0]
        iq = self._op("proj", linear, qr, L["idx_wq_b"], L.get("idx_wq_b_scale"), backend=backend)
        iq = iq.view(T, cfg.index_heads, cfg.index_head_dim)
        wts = self._op("proj", linear, x, L["idx_weights"]).float()  # from x, not qr
        if rows.shortcut:  # short-context shortcut (decided on the host): every visible row, no logits needed
            local = self._op("indexer", indexer.short_context_topk, rows.pos, cfg.index_topk)
        else:
            qq, q_scales, w_out = self._op(
                "indexer",
                indexer.quantize_q,
                iq,
                rows.pos,
                self.cos_sin["comp"],
                wts,
                fmt=cfg.index_format,
                hadamard=self.index_hadamard,
                backend=backend,
            )
            logits = self._op(
                "indexer",
                indexer.logits,
                qq,
                q_scales,
                w_out,
                st.idx_cache,
                rows.pos,
                block_table=st.bt_i[rows.req],
                block_size=cfg.index_page,
                n_out=max(1, self.capacity // 4),
                backend=backend,
            )
            local = self._op("indexer", indexer.topk, logits, cfg.index_topk)
        local = torch.where(rows.valid[:, None], local, -1)
        # packed prefix (valid ids first); order has no meaning for one softmax
        local = torch.gather(local, 1, torch.argsort((local < 0).to(torch.int8), dim=1, stable=True))
        st.topk[self._record_at(rows)] = local.to(torch.int32)
        return local

    # ------------------------------------------------------------------------------------------------
    # cache addressing
    # ------------------------------------------------------------------------------------------------
    def _record_at(self, rows: Rows) -> tuple:
        """Where a step writes its per-position records (``experts``, ``topk``): (request, position), the spare
        column ``capacity`` for padding rows. Device tensors: no host sync."""
        return rows.req, torch.where(rows.valid, rows.pos, self.capacity)

    @staticmethod
    def _slots(bt: torch.Tensor, req: torch.Tensor, local: torch.Tensor, page: int, ok: torch.Tensor) -> torch.Tensor:
        """Flat slots ``page · block_size + offset`` of local row ids ``local`` (any shape, broadcast with
        ``req``) through block table ``bt``: −1 where not ``ok``."""
        loc = torch.where(ok, local, 0).long()
        pages = bt[req.view(-1, *([1] * (loc.dim() - 1))).expand_as(loc), loc // page].long()
        return torch.where(ok, pages * page + loc % page, -1)
