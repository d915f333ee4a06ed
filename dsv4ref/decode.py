"""A whole DeepSeek-V4 decode step, end to end, on the teaching config; and a float64 dense reference.

Facts: ``../shared/spec/README.md`` §4 (the step map), config.md §5–§6, sparse_mla.md §2 and §8,
indexer.md §5–§8, mhc.md §9, rope.md §4–§7.

Two implementations of the same block live here:

* :class:`Decoder`: the real data path. Paged FP8 caches (584 B/token, shuffled pages behind block
  tables), the fused q-norm + RoPE + KV insert, a stateful compressor (ratio 4 with overlap, ratio 128,
  and the indexer's own ratio-4 compressor), the lightning indexer's top-k, sparse MLA decode over
  window ∪ compressed rows with the attention sink, inverse RoPE, the grouped o-projection, mHC around
  attention and around a small clamped-SwiGLU FFN, and the hc_head + final norm + lm_head. Every op is
  a library call with a ``backend`` switch (``"reference"`` = plain torch, ``"triton"`` = the kernels).
* :func:`reference_forward`: the same block as a float64 full-sequence forward: no FP8, no paging,
  no sparsity except the causal window and the top-k ids it is given (the ones the indexer chose, so
  the sparsity pattern matches). It shares no code with the decode path (not even RoPE tables).

:func:`agreement` compares the two; :func:`demo` is ``python -m dsv4ref demo``.

The weights are random (seeded, drawn on the CPU with :func:`dsv4ref.testing.generator`), with the
usual 1/sqrt(fan_in) scales; the KV and compressor norm weights carry a power-of-two factor per
64-block so the FP8 scale bytes differ between blocks (pitfalls.md #1).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kv_cache
from .config import TINY, Config
from .device import DEVICE, Timer, interpreting, synchronize
from .testing import generator

__all__ = [
    "check_config", "make_weights", "Decoder", "CacheCapacityError", "reference_forward", "agreement",
    "ATTN_TOL", "LOGITS_TOL", "demo", "traffic_per_op", "run", "rel_err", "REFERENCE_BUGS",
]

#: Tolerances of the decode path against the float64 reference, on the row relative L2 error
#: ||a − b|| / ||b||. The only lossy format on the path is the e4m3 KV NoPE part (window and compressed
#: rows): each dequantised value is within the relative half-ulp 2^-4 of the true one (formats.md §3;
#: measured RMS over a row ≈ 2^-5). An attention output o = Σ_j P_j v_j · σ(lse − sink) is first-order
#: in that error twice: through the V rows (≤ 2^-4 relative, a convex combination does not amplify it)
#: and through the softmax weights P (the scores q·k_j move by the same relative amount). Hence
#: ATTN_TOL = 2·2^-4 = 2^-3 for every layer's attention output (measured: mean ≈ 0.035, max ≈ 0.066).
#: The logits see the FP8 error only through the attention updates of the residual stream, which are
#: a fraction of its norm (the embedding and the FFN carry no FP8 error), so LOGITS_TOL = 2^-4
#: (measured ≈ 0.015). bf16 activations add ~2^-9 per rounding (≈ 0.4% measured on q and kv): noise at
#: this scale. A missing sink, a missing inverse RoPE, NeoX pairing or dropped compressed rows give
#: attention errors of 0.3–1.2 (tests/test_decode.py). A transposed comb does NOT show here (the random
#: comb is near the identity): the conformance suite's 4-cycle trap catches that one.
ATTN_TOL = 2.0**-3
LOGITS_TOL = 2.0**-4
AGREEMENT_TOL = (ATTN_TOL, LOGITS_TOL)


# ====================================================================================================
# configuration and weights
# ====================================================================================================


def check_config(cfg: Config) -> Config:
    """Raise ValueError naming the offending field if ``cfg`` cannot run through this decode step."""
    if not isinstance(cfg, Config):
        raise TypeError(f"cfg: expected a dsv4ref.config.Config, got {type(cfg).__name__}")
    if len(cfg.compress_ratios) != cfg.num_layers:
        raise ValueError(f"cfg.compress_ratios: {len(cfg.compress_ratios)} entries for num_layers={cfg.num_layers}")
    bad = [r for r in cfg.compress_ratios if r not in (0, 1, 4, 128)]
    if bad:
        raise ValueError(f"cfg.compress_ratios: {bad[0]} is not one of 0 (window only), 4 (C4A), 128 (C128A)")
    if (cfg.head_dim, cfg.rope_dim, cfg.kv_block) != (512, 64, 64):
        raise ValueError(f"cfg.head_dim/rope_dim/kv_block: the 584-B cache format needs 512/64/64, got "
                         f"{cfg.head_dim}/{cfg.rope_dim}/{cfg.kv_block}")
    if cfg.index_head_dim != 128:
        raise ValueError(f"cfg.index_head_dim: the indexer K format needs 128, got {cfg.index_head_dim}")
    if cfg.o_groups < 1 or cfg.num_heads % cfg.o_groups:
        raise ValueError(f"cfg.o_groups: {cfg.o_groups} does not divide num_heads={cfg.num_heads}")
    if cfg.num_heads > 128:
        raise ValueError(f"cfg.num_heads: {cfg.num_heads} > 128 is not supported")
    if cfg.window < 1:
        raise ValueError(f"cfg.window: expected >= 1, got {cfg.window}")
    if cfg.hc_mult < 1 or cfg.index_topk < 1:
        raise ValueError("cfg.hc_mult and cfg.index_topk must be >= 1")
    return cfg


def _ratio(cfg: Config, layer: int) -> int:
    r = cfg.compress_ratios[layer]
    return 0 if r <= 1 else r


def make_weights(cfg: Config = TINY, seed: int = 0, device=None) -> dict:
    """Random weights of the whole stack, drawn on the CPU with a seeded generator (identical on every
    machine), then moved to ``device``. Linear weights are bf16 ``[out, in]`` with std 1/sqrt(in);
    norm weights, mHC parameters, sinks and compressor position biases are fp32."""
    check_config(cfg)
    g = generator(seed)
    dev = device or DEVICE
    Hd, H, D, M = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.hc_mult

    def lin(out_f, in_f, scale=1.0):
        return (torch.randn(out_f, in_f, generator=g) * (scale / math.sqrt(in_f))).to(torch.bfloat16)

    def norm_w(n, octaves=0):
        w = 1.0 + 0.1 * torch.randn(n, generator=g)
        if octaves:  # a power-of-two factor per 64-block: varied FP8 scale bytes (pitfalls.md #1)
            e = torch.randint(-octaves, octaves + 1, (n // 64,), generator=g).float()
            w = w * torch.exp2(e).repeat_interleave(64)
        return w

    def mhc_params(n_out):
        return dict(fn=torch.randn(n_out, M * Hd, generator=g) / math.sqrt(M * Hd),
                    scale=torch.tensor([0.5, 0.5, 1.0]) if n_out > M else torch.tensor([0.5]),
                    base=torch.cat([0.2 * torch.randn(2 * M, generator=g),
                                    (2.0 * torch.eye(M) + 0.7 * torch.randn(M, M, generator=g)).flatten()])
                    if n_out > M else 0.2 * torch.randn(M, generator=g))

    def compressor(r, d):
        coff = 2 if r == 4 else 1
        return dict(wkv=lin(coff * d, Hd), wgate=lin(coff * d, Hd), ape=0.5 * torch.randn(r, coff * d, generator=g),
                    norm=norm_w(d, octaves=1 if d == D else 0))

    layers = []
    for li in range(cfg.num_layers):
        r = _ratio(cfg, li)
        L = dict(
            ratio=r,
            hc_attn=mhc_params(cfg.hc_mix), hc_ffn=mhc_params(cfg.hc_mix),
            attn_norm=norm_w(Hd),
            wqkv_a=lin(cfg.q_lora_rank + D, Hd),  # [W_q_a ; W_kv]: one GEMM
            q_norm=norm_w(cfg.q_lora_rank), kv_norm=norm_w(D, octaves=1),
            wq_b=lin(H * D, cfg.q_lora_rank),
            sink=torch.randn(H, generator=g),
            wo_a=torch.stack([lin(cfg.o_lora_rank, cfg.heads_per_group * D) for _ in range(cfg.o_groups)]),
            wo_b=lin(Hd, cfg.o_groups * cfg.o_lora_rank, scale=0.25),  # updates small next to the stream
            ffn_norm=norm_w(Hd),
            w_gate_up=lin(2 * cfg.ffn_intermediate, Hd, scale=2.0),
            w_down=lin(Hd, cfg.ffn_intermediate, scale=0.25),
        )
        if r > 1:
            L["comp"] = compressor(r, D)
        if r == 4:
            L["idx_comp"] = compressor(4, cfg.index_head_dim)
            L["idx_wq_b"] = lin(cfg.index_heads * cfg.index_head_dim, cfg.q_lora_rank)
            L["idx_weights"] = lin(cfg.index_heads, Hd)
        layers.append(L)
    w = dict(
        embed=torch.randn(cfg.vocab_size, Hd, generator=g).to(torch.bfloat16),
        layers=layers,
        hc_head=mhc_params(M),
        final_norm=norm_w(Hd),
        lm_head=lin(cfg.vocab_size, Hd),
    )
    return _to(w, dev)


def _to(obj, dev):
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, dict):
        return {k: _to(v, dev) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, dev) for v in obj]
    return obj


# ====================================================================================================
# small torch pieces of the decode path (bf16 activations, fp32 math)
# ====================================================================================================


def _rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float() if w is not None else y).to(torch.bfloat16)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 GEMM, fp32 accumulation, bf16 out."""
    return F.linear(x.to(torch.bfloat16), w)


def swiglu_clamped(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """config.md §6 (vLLM ``SiluAndMulWithClamp``): gate clamped from above only, up both ways."""
    d = gate_up.shape[-1] // 2
    gate = gate_up[..., :d].clamp(max=limit)
    up = gate_up[..., d:].clamp(-limit, limit)
    return F.silu(gate) * up


class CacheCapacityError(ValueError):
    """A decode step would write past the space the caches were allocated with."""


# ====================================================================================================
# the decode path
# ====================================================================================================


@dataclass
class Rows:
    """The T rows of one step: request id, absolute position and validity of each row (host + device)."""

    req: torch.Tensor  # (T,) int64, device
    pos: torch.Tensor  # (T,) int64, device (0 for padding rows)
    valid: torch.Tensor  # (T,) bool, device


class Decoder:
    """A batch of ``num_requests`` requests decoding through the whole layer stack with paged caches.

    >>> dec = Decoder(TINY, make_weights(TINY), num_requests=4, capacity=320)
    >>> logits = dec.prefill([prompt0, prompt1, prompt2, prompt3])    # batched: all prompt tokens at once
    >>> logits = dec.step(next_ids)                                   # one token per request

    Caches (per layer): the window (SWA) pool with pages of ``cfg.window_page`` tokens; for ratio r > 1
    the compressed pool (pages of ``cfg.c4_page`` / ``cfg.c128_page`` compressed rows); for ratio 4 the
    indexer-K pool (``cfg.index_page``). Every request owns ``capacity`` tokens of each, in pages drawn
    from a shuffled permutation (its block tables). The window pool keeps the whole history (a serving
    engine would free pages that slid out of the window); a step that would go past ``capacity`` raises
    :class:`CacheCapacityError` instead of overwriting.

    The compressor state is a ring of the last ``coff·r`` tokens' (kv, score) per request, in fp32
    (sparse_mla.md §8). ``backend`` picks "triton" kernels or the "reference" torch ops for every
    library call; ``prefill`` defaults to the reference ops (in the CPU interpreter a kernel launch costs
    ~1 ms per program, too slow for hundreds of prompt tokens), ``step`` to the kernels.
    """

    def __init__(self, cfg: Config = TINY, weights: dict | None = None, *, num_requests: int = 4,
                 capacity: int = 320, seed: int = 0, pad_heads: bool = True, index_hadamard: bool = True,
                 backend: str = "triton", device=None):
        check_config(cfg)
        if num_requests < 1:
            raise ValueError(f"num_requests: expected >= 1, got {num_requests}")
        if capacity < 1 or capacity > cfg.max_position:
            raise ValueError(f"capacity: expected 1..cfg.max_position={cfg.max_position} tokens, got {capacity}")
        if backend not in ("triton", "reference"):
            raise ValueError(f"backend: expected 'triton' or 'reference', got {backend!r}")
        from . import rope  # the op modules are imported here, so the reference above stays importable alone

        self.cfg, self.dev, self.backend = cfg, device or DEVICE, backend
        self.index_hadamard = index_hadamard  # on both the indexer Q and K sides, or neither (pitfalls.md #24)
        self.w = weights if weights is not None else make_weights(cfg, seed, self.dev)
        self.R, self.capacity = num_requests, capacity
        self.H = cfg.num_heads
        self.Hp = cfg.padded_heads if pad_heads else cfg.num_heads
        self.lengths = torch.zeros(num_requests, dtype=torch.int64)  # host: tokens already in the caches
        self.prof: dict[str, float] | None = None  # per-op milliseconds when profiling
        g = generator(seed + 1)
        dev = self.dev

        def table(rows_per_req: int, page: int):
            n = max(1, -(-rows_per_req // page))
            perm = torch.randperm(num_requests * n, generator=g).to(torch.int32)
            return perm.view(num_requests, n).to(dev), num_requests * n

        # RoPE tables: theta 10000 for window-only layers, 160000 + YaRN for compressed ones (rope.md §3)
        self.cos_sin = {}
        for r in set(_ratio(cfg, i) for i in range(cfg.num_layers)):
            key = "swa" if r == 0 else "comp"
            if key not in self.cos_sin:
                self.cos_sin[key] = (rope.cos_sin_cache(cfg.max_position, cfg.rope_dim, cfg.rope_theta).to(dev)
                                     if r == 0 else
                                     rope.cos_sin_cache(cfg.max_position, cfg.rope_dim, cfg.compress_rope_theta,
                                                        yarn=cfg.yarn).to(dev))
        self.bt_swa, n_swa = table(capacity, cfg.window_page)
        self.layers = []
        for li in range(cfg.num_layers):
            r = _ratio(cfg, li)
            st = dict(ratio=r, swa=kv_cache.allocate(n_swa, cfg.window_page, device=dev))
            if r > 1:
                page = cfg.c4_page if r == 4 else cfg.c128_page
                st["page"] = page
                st["bt_c"], n_c = table(capacity // r, page)
                st["comp"] = kv_cache.allocate(n_c, page, device=dev)
                st["ring"] = self._ring(r, cfg.head_dim)
            if r == 4:
                from . import indexer

                st["bt_i"], n_i = table(capacity // 4, cfg.index_page)
                st["idx_cache"] = indexer.allocate_k_cache(n_i, cfg.index_page, device=dev)
                st["idx_ring"] = self._ring(4, cfg.index_head_dim)
                st["topk"] = torch.full((num_requests, capacity, cfg.index_topk), -1, dtype=torch.int32)
            self.layers.append(st)
        self.tokens = torch.zeros(num_requests, capacity, dtype=torch.int64)  # host: the token history

    def _ring(self, r: int, d: int) -> dict:
        coff = 2 if r == 4 else 1
        n = coff * r
        return dict(kv=torch.zeros(self.R, n, coff * d, device=self.dev),
                    score=torch.full((self.R, n, coff * d), -math.inf, device=self.dev))

    # ------------------------------------------------------------------------------------------------
    def _op(self, name: str, fn, *args, **kw):
        """Call a library op; when profiling, time it (device events) and add to ``self.prof[name]``."""
        if self.prof is None:
            return fn(*args, **kw)
        with Timer(self.dev) as t:
            out = fn(*args, **kw)
        self.prof[name] = self.prof.get(name, 0.0) + t.ms
        return out

    def _rows(self, req: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> Rows:
        bad = valid & (pos >= self.capacity)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise CacheCapacityError(
                f"request {int(req[i])}: position {int(pos[i])} is past the cache capacity of {self.capacity} "
                f"tokens per request; nothing was written (make a Decoder with a larger capacity=)")
        return Rows(req.to(self.dev), torch.where(valid, pos, 0).to(self.dev), valid.to(self.dev))

    def _slots(self, bt: torch.Tensor, req: torch.Tensor, local: torch.Tensor, page: int, ok: torch.Tensor):
        """Global slots of local row ids ``local`` (any shape, broadcast with ``req``): −1 where not ``ok``."""
        loc = torch.where(ok, local, 0).long()
        pages = bt[req.view(-1, *([1] * (loc.dim() - 1))).expand_as(loc), loc // page].long()
        return torch.where(ok, pages * page + loc % page, -1)

    # ------------------------------------------------------------------------------------------------
    # public API
    # ------------------------------------------------------------------------------------------------
    def prefill(self, prompts, *, backend: str = "reference") -> torch.Tensor:
        """Run every prompt token of every request through the stack in ONE batched step (each token is a
        query row with its own window and compressed candidates). Returns the logits (R, V) fp32 of each
        request's last prompt token. Requests must be empty (a fresh Decoder)."""
        if len(prompts) != self.R:
            raise ValueError(f"prompts: expected {self.R} prompts (num_requests), got {len(prompts)}")
        if bool((self.lengths > 0).any()):
            raise ValueError("prefill: the caches already hold tokens; prefill a fresh Decoder")
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        if bool((lens < 1).any()):
            raise ValueError("prompts: every prompt needs at least one token")
        ids = torch.cat([torch.as_tensor(p, dtype=torch.int64).cpu() for p in prompts])
        self._check_ids(ids, "prompts")
        req = torch.repeat_interleave(torch.arange(self.R), lens)
        pos = torch.cat([torch.arange(n) for n in lens.tolist()])
        rows = self._rows(req, pos, torch.ones_like(pos, dtype=torch.bool))
        logits = self._forward(ids.to(self.dev), rows, backend)
        self.tokens[req, pos] = ids
        self.lengths += lens
        last = torch.cumsum(lens, 0) - 1
        return logits[last.to(self.dev)]

    def step(self, ids, *, active=None, backend: str | None = None) -> torch.Tensor:
        """Decode one token per request: ``ids`` (R,) int64 at positions ``self.lengths``. ``active`` (R,)
        bool marks padding rows (False: slot −1, all lengths 0, nothing written, position kept).
        Returns the logits (R, V) fp32 (rows of inactive requests are meaningless)."""
        ids = torch.as_tensor(ids, dtype=torch.int64)
        if tuple(ids.shape) != (self.R,):
            raise ValueError(f"ids: expected shape ({self.R},), got {tuple(ids.shape)}")
        self._check_ids(ids.cpu(), "ids")
        act = torch.ones(self.R, dtype=torch.bool) if active is None else torch.as_tensor(active, dtype=torch.bool).cpu()
        if tuple(act.shape) != (self.R,):
            raise ValueError(f"active: expected shape ({self.R},), got {tuple(act.shape)}")
        rows = self._rows(torch.arange(self.R), self.lengths.clone(), act)
        logits = self._forward(ids.to(self.dev), rows, backend or self.backend)
        r = torch.arange(self.R)[act]
        self.tokens[r, self.lengths[act]] = ids.cpu()[act]
        self.lengths += act.long()
        return logits

    def _check_ids(self, ids: torch.Tensor, name: str) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"{name}: token ids must be in [0, {self.cfg.vocab_size}), got "
                             f"{int(ids.min())}..{int(ids.max())}")

    def history(self) -> tuple[list[torch.Tensor], list[dict]]:
        """Per request: the tokens so far (L,) and, per ratio-4 layer, the top-k local ids (L, K_top) the
        indexer chose at each position: what :func:`reference_forward` needs to follow this run."""
        toks, topks = [], []
        for r in range(self.R):
            n = int(self.lengths[r])
            toks.append(self.tokens[r, :n].clone())
            topks.append({li: st["topk"][r, :n].clone() for li, st in enumerate(self.layers) if "topk" in st})
        return toks, topks

    # ------------------------------------------------------------------------------------------------
    # the stack
    # ------------------------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, rows: Rows, backend: str) -> torch.Tensor:
        from . import mhc

        cfg, w = self.cfg, self.w
        mk = dict(rms_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters, backend=backend)
        self.attn_out = []  # per layer (T, Hd) bf16, for the agreement checks
        h = w["embed"][ids]  # 0: (T, Hd) bf16
        Hs = h[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()  # (T, M, Hd): h repeated, not split
        ffn_out = post = comb = None
        for li, L in enumerate(w["layers"]):
            p = L["hc_attn"]
            if li == 0:  # 1: mHC pre
                post, comb, x = self._op("mhc", mhc.pre, Hs, p["fn"], p["scale"], p["base"], **mk)
            else:  # 10 of the previous layer, fused with this layer's 1
                Hs, post, comb, x = self._op("mhc", mhc.fused_post_pre, ffn_out, Hs, post, comb, p["fn"], p["scale"],
                                             p["base"], **mk)
            a = self._attention(li, x, rows, backend)  # 2..9
            self.attn_out.append(a)
            p = L["hc_ffn"]
            Hs, post, comb, x = self._op("mhc", mhc.fused_post_pre, a, Hs, post, comb, p["fn"], p["scale"], p["base"], **mk)
            ffn_out = self._op("ffn", self._ffn, L, x)  # 11
        Hs = self._op("mhc", mhc.post, ffn_out, Hs, post, comb, backend=backend)  # 12
        p = w["hc_head"]
        y = self._op("mhc", mhc.head, Hs, p["fn"], p["scale"], p["base"], rms_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
                     backend=backend)
        y = _rms_norm(y, w["final_norm"], cfg.rms_norm_eps)
        return self._op("lm_head", lambda: y.float() @ w["lm_head"].float().T)

    def _ffn(self, L: dict, x: torch.Tensor) -> torch.Tensor:
        x = _rms_norm(x, L["ffn_norm"], self.cfg.rms_norm_eps)
        gu = F.linear(x, L["w_gate_up"]).float()
        return _linear(swiglu_clamped(gu, self.cfg.swiglu_limit).to(torch.bfloat16), L["w_down"])

    def _attention(self, li: int, x: torch.Tensor, rows: Rows, backend: str) -> torch.Tensor:
        from . import rope, sparse_mla

        cfg, L, st = self.cfg, self.w["layers"][li], self.layers[li]
        r, T, D, H = st["ratio"], x.shape[0], cfg.head_dim, self.H
        cos_sin = self.cos_sin["swa" if r == 0 else "comp"]
        eps = cfg.rms_norm_eps
        # 2-3: norm, one GEMM for [qr | kv], their norms, wq_b
        x = _rms_norm(x, L["attn_norm"], eps)
        qkv = self._op("proj", _linear, x, L["wqkv_a"])
        qr = _rms_norm(qkv[:, :cfg.q_lora_rank], L["q_norm"], eps)
        kv = _rms_norm(qkv[:, cfg.q_lora_rank:], L["kv_norm"], eps)
        q = self._op("proj", _linear, qr, L["wq_b"]).view(T, H, D)
        # 4: fused q-norm + RoPE + KV insert into the window cache (slot −1 for padding rows)
        slot = self._slots(self.bt_swa, rows.req, rows.pos, cfg.window_page, rows.valid)
        self._op("qnorm_rope_kv_insert", rope.qnorm_rope_kv_insert, q, kv, st["swa"], slot, rows.pos, cos_sin,
                 eps=eps, block_size=cfg.window_page, backend=backend)
        # 5: compressor (before the indexer and attention: a row completed by this token is visible to it)
        if r > 1:
            self._op("compressor", self._compress, li, x, rows, backend)
        # 6: indexer (ratio 4): top-k local compressed ids
        extra = {}
        if r > 1:
            n_c = torch.where(rows.valid, (rows.pos + 1) // r, 0)
            if r == 4:
                local = self._indexer(li, x, qr, rows, n_c, backend)
            else:  # ratio 128: every visible compressed row
                width = max(1, self.capacity // r)
                j = torch.arange(width, device=self.dev)[None, :]
                local = torch.where(j < n_c[:, None], j, -1)
            ok = local >= 0
            extra = dict(extra_cache=st["comp"], extra_block_size=st["page"],
                         extra_indices=self._slots(st["bt_c"], rows.req, local, st["page"], ok).to(torch.int32),
                         extra_lengths=ok.sum(1).to(torch.int32))
        # 7: sparse MLA decode over window ∪ compressed rows, sink in the denominator
        W = cfg.window
        swa_len = torch.where(rows.valid, torch.clamp(rows.pos + 1, max=W), 0)
        j = torch.arange(W, device=self.dev)[None, :]
        ok = j < swa_len[:, None]  # packed prefix: [valid…, −1…] (pitfalls.md #13)
        swa_idx = self._slots(self.bt_swa, rows.req, rows.pos[:, None] - swa_len[:, None] + 1 + j, cfg.window_page, ok)
        sink = L["sink"]
        if self.Hp > H:  # head padding (sparse_mla.md §3): zero q rows, −inf sinks, sliced off after
            q = torch.cat([q, q.new_zeros(T, self.Hp - H, D)], dim=1)
            sink = torch.cat([sink, sink.new_full((self.Hp - H,), -math.inf)])
        o, _lse = self._op("sparse_mla", sparse_mla.decode, q, st["swa"], swa_idx.to(torch.int32),
                           swa_len.to(torch.int32), block_size=cfg.window_page, sink=sink,
                           scale=cfg.softmax_scale, backend=backend, **extra)
        # 8: drop padded heads, inverse RoPE at the query position; 9: grouped o-projection
        o = self._op("inv_rope", rope.apply_gptj, o[:, :H].contiguous(), rows.pos, cos_sin, inverse=True, backend=backend)
        return self._op("o_proj", rope.grouped_o_proj, o, L["wo_a"], L["wo_b"])

    # ------------------------------------------------------------------------------------------------
    # 5: the compressor (plain torch, fp32; sparse_mla.md §8, indexer.md §5)
    # ------------------------------------------------------------------------------------------------
    def _compress(self, li: int, x: torch.Tensor, rows: Rows, backend: str) -> None:
        from . import rope

        cfg, L, st = self.cfg, self.w["layers"][li], self.layers[li]
        r = st["ratio"]
        cos_sin = self.cos_sin["comp"]
        for out in self._compressor_rows(L["comp"], st["ring"], r, x, rows):
            c, req, p = out  # c (n, 512) fp32 normed, at boundary tokens p
            row = c.to(torch.bfloat16)
            cpos = (p // r) * r  # compressed K is rotated at the window's first position (rope.md §4)
            row = rope.apply_gptj(row, cpos, cos_sin, backend=backend)
            slot = self._slots(st["bt_c"], req, p // r, st["page"], torch.ones_like(p, dtype=torch.bool))
            kv_cache.insert(st["comp"], row.contiguous(), slot, block_size=st["page"], backend=backend)
        if r == 4:
            from . import indexer

            for c, req, p in self._compressor_rows(L["idx_comp"], st["idx_ring"], 4, x, rows):
                k = rope.apply_gptj(c.to(torch.bfloat16), (p // 4) * 4, cos_sin, backend=backend)
                slot = self._slots(st["bt_i"], req, p // 4, cfg.index_page, torch.ones_like(p, dtype=torch.bool))
                indexer.insert_k(st["idx_cache"], k.contiguous(), slot, block_size=cfg.index_page,
                                 hadamard=self.index_hadamard, backend=backend)

    def _compressor_rows(self, cw: dict, ring: dict, r: int, x: torch.Tensor, rows: Rows):
        """Yield (c, req, pos) for the compressed rows completed by this step's boundary tokens
        ((p+1) % r == 0), then keep the last coff·r tokens' (kv, score) of each request in the ring.

        A boundary token's window is the coff·r positions ending at it: those inside this step (a prefill
        holds many tokens of one request) are read from this step's rows, older ones from the ring."""
        coff = 2 if r == 4 else 1
        n, D = coff * r, cw["norm"].shape[0]
        kv = x.float() @ cw["wkv"].float().T  # (T, coff·D), fp32
        score = x.float() @ cw["wgate"].float().T + cw["ape"][rows.pos % r]
        T, v = x.shape[0], rows.valid
        rowmap = torch.full((self.R, self.capacity), -1, dtype=torch.int64, device=self.dev)
        rowmap[rows.req[v], rows.pos[v]] = torch.arange(T, device=self.dev)[v]
        b = v & ((rows.pos + 1) % r == 0)
        if bool(b.any()):
            req, p = rows.req[b], rows.pos[b]
            j = torch.arange(n, device=self.dev)
            src = p[:, None] - n + 1 + j[None, :]  # (nb, n): the window's positions, oldest first
            srcc = src.clamp(min=0)
            bi = rowmap[req[:, None], srcc]  # row of this step holding that position, or −1
            here = (bi >= 0)[..., None]
            kv_w = torch.where(here, kv[bi.clamp(min=0)], ring["kv"][req[:, None], srcc % n])
            sc_w = torch.where(here, score[bi.clamp(min=0)], ring["score"][req[:, None], srcc % n])
            if coff == 2:  # overlap: the older r tokens give channels [0:D], the newer r tokens [D:2D]
                newer = (j >= r)[None, :, None]
                kv_w = torch.where(newer, kv_w[..., D:], kv_w[..., :D])
                sc_w = torch.where(newer, sc_w[..., D:], sc_w[..., :D])
            before = (src < 0)[..., None]  # positions before the sequence start: masked
            sc_w = sc_w.masked_fill(before, -math.inf)
            kv_w = kv_w.masked_fill(before, 0.0)
            c = (torch.softmax(sc_w, dim=1) * kv_w).sum(1)  # per-channel softmax over the window's tokens
            c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * cw["norm"]
            yield c, req, p
        # the ring keeps each request's last n positions (distinct modulo n, so no write conflicts)
        last = torch.full((self.R,), -1, dtype=torch.int64, device=self.dev)
        last = last.scatter_reduce(0, rows.req[v], rows.pos[v], "amax")
        keep = v & (rows.pos > last[rows.req] - n)
        ring["kv"][rows.req[keep], rows.pos[keep] % n] = kv[keep]
        ring["score"][rows.req[keep], rows.pos[keep] % n] = score[keep]

    # ------------------------------------------------------------------------------------------------
    # 6: the indexer (ratio-4 layers)
    # ------------------------------------------------------------------------------------------------
    def _indexer(self, li: int, x: torch.Tensor, qr: torch.Tensor, rows: Rows, n_c: torch.Tensor,
                 backend: str) -> torch.Tensor:
        from . import indexer

        cfg, L, st = self.cfg, self.w["layers"][li], self.layers[li]
        T = x.shape[0]
        iq = self._op("proj", _linear, qr, L["idx_wq_b"]).view(T, cfg.index_heads, cfg.index_head_dim)
        wts = self._op("proj", _linear, x, L["idx_weights"]).float()  # from x, not qr (indexer.md §2)
        width = max(1, self.capacity // 4)
        if int(n_c.max()) <= cfg.index_topk:  # short-context shortcut (indexer.md §7): no logits needed
            logits = None
        else:
            q8, _, w_out = self._op("indexer", indexer.quantize_q, iq, rows.pos, self.cos_sin["comp"], wts,
                                    hadamard=self.index_hadamard, backend=backend)
            logits = self._op("indexer", indexer.logits, q8, None, w_out, st["idx_cache"], rows.pos,
                              block_table=st["bt_i"][rows.req], block_size=cfg.index_page, n_out=width,
                              backend=backend)
        local = self._op("indexer", indexer.topk, logits, cfg.index_topk, positions=rows.pos)
        local = torch.where(rows.valid[:, None], local, -1)
        # packed prefix (valid ids first); order has no meaning for one softmax
        local = torch.gather(local, 1, torch.argsort((local < 0).to(torch.int8), dim=1, stable=True))
        st["topk"][rows.req.cpu()[rows.valid.cpu()], rows.pos.cpu()[rows.valid.cpu()]] = local.cpu()[rows.valid.cpu()]
        return local


# ====================================================================================================
# the float64 dense reference (independent of everything above)
# ====================================================================================================

#: deliberate bugs :func:`reference_forward` can inject, to show the agreement check has teeth
REFERENCE_BUGS = ("no_sink", "no_inv_rope", "comb_not_transposed", "no_compressed", "rope_neox")


def _inv_freq64(cfg: Config, ratio: int) -> torch.Tensor:
    """inv_freq in float64: θ^(−2i/64), with YaRN for compressed layers (rope.md §3)."""
    R = cfg.rope_dim
    i = torch.arange(R // 2, dtype=torch.float64)
    if ratio == 0:
        return cfg.rope_theta ** (-2 * i / R)
    th, y = cfg.compress_rope_theta, cfg.yarn
    pf = th ** (2 * i / R)
    extra, inter = 1 / pf, 1 / (y["factor"] * pf)

    def corr(n):
        return R * math.log(y["original_max_position"] / (2 * math.pi * n)) / (2 * math.log(th))

    low, high = max(math.floor(corr(y["beta_fast"])), 0), min(math.ceil(corr(y["beta_slow"])), R - 1)
    if low == high:
        high += 0.001
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    return inter * ramp + extra * (1 - ramp)


def _rope64(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse=False, neox=False) -> torch.Tensor:
    """GPT-J rotation of the LAST 64 dims of x (L, ..., D) at positions pos (L,), float64."""
    f = pos.double()[:, None] * inv_freq[None, :]  # (L, 32)
    f = f.view(f.shape[0], *([1] * (x.dim() - 2)), f.shape[1])
    c, s = torch.cos(f), torch.sin(f) * (-1 if inverse else 1)
    r = x[..., -64:]
    e, o = (r[..., :32], r[..., 32:]) if neox else (r[..., 0::2], r[..., 1::2])
    e2, o2 = e * c - o * s, e * s + o * c
    rot = torch.cat([e2, o2], -1) if neox else torch.stack([e2, o2], -1).flatten(-2)
    return torch.cat([x[..., :-64], rot], -1)


def _fp8_sim64(x: torch.Tensor) -> torch.Tensor:
    """What the 584-B cache stores, simulated: dims 0..447 through e4m3 with a power-of-two scale per
    64-block (amax floor 1e-4; formats.md §2-§3), dims 448..511 rounded to bf16."""
    nope = x[..., :448].reshape(*x.shape[:-1], 7, 64)
    amax = nope.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2((amax / 448).float().double())))  # ceil(log2(s)), exact here
    q = (nope / scale).float().clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale
    return torch.cat([q.reshape(*x.shape[:-1], 448), x[..., 448:].to(torch.bfloat16).double()], -1)


def _rms64(x, w, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def _mhc_pre64(Hs, p, cfg):
    """mHC pre in float64: the library's readable torch reference (itself held to an independent float64
    oracle in tests/test_mhc.py), run at float64 here."""
    from .mhc import pre_reference

    _, post, comb, x = pre_reference(Hs, p["fn"], p["scale"], p["base"], rms_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
                                     sinkhorn_iters=cfg.hc_sinkhorn_iters, dtype=torch.float64)
    return post, comb, x


def _mhc_post64(x, Hs, post, comb, bugs):
    mixed = torch.einsum("nji,nih->njh" if "comb_not_transposed" in bugs else "nij,nih->njh", comb, Hs)
    return post[:, :, None] * x[:, None, :] + mixed


def _compress64(cw, r, x, eps):
    """All compressed rows of a sequence: (L // r, D), float64 (sparse_mla.md §8)."""
    L = x.shape[0]
    coff = 2 if r == 4 else 1
    n, D = coff * r, cw["norm"].shape[0]
    pos = torch.arange(L)
    kv = x @ cw["wkv"].T
    score = x @ cw["wgate"].T + cw["ape"][pos % r]
    p = torch.arange(L // r) * r + r - 1  # boundary positions
    src = p[:, None] - n + 1 + torch.arange(n)[None, :]
    ok = (src >= 0)[..., None]
    kv_w, sc_w = kv[src.clamp(min=0)], score[src.clamp(min=0)]
    if coff == 2:
        newer = (torch.arange(n) >= r)[None, :, None]
        kv_w = torch.where(newer, kv_w[..., D:], kv_w[..., :D])
        sc_w = torch.where(newer, sc_w[..., D:], sc_w[..., :D])
    sc_w = torch.where(ok, sc_w, -math.inf)
    kv_w = torch.where(ok, kv_w, 0.0)
    c = (torch.softmax(sc_w, dim=1) * kv_w).sum(1)
    return _rms64(c, cw["norm"], eps), p


def reference_forward(cfg: Config, weights: dict, tokens: torch.Tensor, topk: dict | None = None,
                      bugs=(), fp8_kv: bool = False) -> dict:
    """Float64 full-sequence forward of one request: every position is a query with its causal window
    of ``cfg.window`` keys and its compressed rows: all (n_c = (p+1)//r) for ratio 128, the given
    ``topk[layer]`` local ids (L, K_top), −1 padded, for ratio 4. No FP8, no paging.

    Returns dict(logits (L, V), attn [per layer (L, Hd)], index_scores {layer: (L, n_c) fp64 indexer
    logits without quantisation, −inf where not visible}), all float64 on the CPU.
    ``bugs``: names from :data:`REFERENCE_BUGS`, injected on purpose (to test that checks can fail).
    ``fp8_kv``: store the KV rows (window and compressed) as the cache does (e4m3 NoPE with UE8M0
    scales, bf16 RoPE; simulated in float64), which removes the FP8 part of the error budget."""
    check_config(cfg)
    for b in bugs:
        if b not in REFERENCE_BUGS:
            raise ValueError(f"bugs: {b!r} is not one of {REFERENCE_BUGS}")
    w = _to(weights, "cpu")
    w = {k: v for k, v in w.items()}
    f = lambda t: t.double()  # noqa: E731
    tokens = torch.as_tensor(tokens, dtype=torch.int64).cpu()
    L, H, D, M, W = tokens.shape[0], cfg.num_heads, cfg.head_dim, cfg.hc_mult, cfg.window
    eps = cfg.rms_norm_eps
    pos = torch.arange(L)
    hp = {k: f(v) for k, v in w["hc_head"].items()}
    Hs = f(w["embed"][tokens])[:, None, :].expand(L, M, -1).clone()
    out = dict(attn=[], index_scores={})
    ffn_out = post = comb = None
    for li, Lw in enumerate(w["layers"]):
        r = _ratio(cfg, li)
        inv = _inv_freq64(cfg, r)
        pa = {k: f(v) for k, v in Lw["hc_attn"].items()}
        if li > 0:
            Hs = _mhc_post64(ffn_out, Hs, post, comb, bugs)
        post, comb, x = _mhc_pre64(Hs, pa, cfg)
        # attention
        x = _rms64(x, f(Lw["attn_norm"]), eps)
        qkv = x @ f(Lw["wqkv_a"]).T
        qr = _rms64(qkv[:, :cfg.q_lora_rank], f(Lw["q_norm"]), eps)
        kv = _rms64(qkv[:, cfg.q_lora_rank:], f(Lw["kv_norm"]), eps)
        q = (qr @ f(Lw["wq_b"]).T).view(L, H, D)
        q = _rope64(_rms64(q, None, eps), pos, inv, neox="rope_neox" in bugs)
        k = _rope64(kv, pos, inv, neox="rope_neox" in bugs)
        if fp8_kv:
            k = _fp8_sim64(k)
        # candidates: window keys (L, W) + compressed keys (L, n_sel)
        win = pos[:, None] - W + 1 + torch.arange(W)[None, :]
        cand, ok = [k[win.clamp(min=0)]], [win >= 0]
        if r > 1 and "no_compressed" not in bugs:
            cw = {kk: f(v) for kk, v in Lw["comp"].items()}
            c, cp = _compress64(cw, r, x, eps)
            ck = _rope64(c, cp - (r - 1), inv, neox="rope_neox" in bugs)  # rotated at (p // r)·r
            if fp8_kv:
                ck = _fp8_sim64(ck)
            n_c = (pos + 1) // r
            if r == 4:
                if topk is None or li not in topk:
                    raise ValueError(f"topk: layer {li} has ratio 4; pass the indexer's top-k ids for it")
                sel = torch.as_tensor(topk[li]).long().cpu()
                if tuple(sel.shape[:1]) != (L,):
                    raise ValueError(f"topk[{li}]: expected {L} rows, got shape {tuple(sel.shape)}")
                if bool(((sel >= n_c[:, None]) & (sel >= 0)).any()):
                    raise ValueError(f"topk[{li}]: an id is not yet visible (id >= (p+1)//4): causal mask broken")
                out["index_scores"][li] = _index_scores64(cfg, Lw, x, qr, inv, pos)
            else:
                sel = torch.arange(max(1, L // r))[None, :].expand(L, -1)
                sel = torch.where(sel < n_c[:, None], sel, -1)
            if c.shape[0]:
                cand.append(ck[sel.clamp(min=0)])
                ok.append(sel >= 0)
        kk, okk = torch.cat(cand, 1), torch.cat(ok, 1)  # (L, N, 512), (L, N)
        s = torch.einsum("lhd,lnd->lhn", q, kk) * cfg.softmax_scale
        s = s.masked_fill(~okk[:, None, :], -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        o = torch.einsum("lhn,lnd->lhd", torch.exp(s - lse[..., None]), kk)
        if "no_sink" not in bugs:
            o = o * torch.sigmoid(lse - f(Lw["sink"]))[..., None]
        if "no_inv_rope" not in bugs:
            o = _rope64(o, pos, inv, inverse=True, neox="rope_neox" in bugs)
        G = cfg.o_groups
        z = torch.einsum("lgk,gok->lgo", o.reshape(L, G, -1), f(Lw["wo_a"]))
        a = z.reshape(L, -1) @ f(Lw["wo_b"]).T
        out["attn"].append(a)
        # FFN
        Hs = _mhc_post64(a, Hs, post, comb, bugs)
        post, comb, x = _mhc_pre64(Hs, {kk_: f(v) for kk_, v in Lw["hc_ffn"].items()}, cfg)
        x = _rms64(x, f(Lw["ffn_norm"]), eps)
        ffn_out = swiglu_clamped(x @ f(Lw["w_gate_up"]).T, cfg.swiglu_limit) @ f(Lw["w_down"]).T
    Hs = _mhc_post64(ffn_out, Hs, post, comb, bugs)
    X = Hs.reshape(L, -1)
    gate = torch.sigmoid((X @ hp["fn"].T) * torch.rsqrt(X.pow(2).mean(-1, keepdim=True) + eps) * hp["scale"][0]
                         + hp["base"]) + cfg.hc_eps
    y = _rms64((gate[:, :, None] * Hs).sum(1), f(w["final_norm"]), eps)
    out["logits"] = y @ f(w["lm_head"]).T
    return out


def _index_scores64(cfg, Lw, x, qr, inv, pos):
    """Unquantised indexer logits I[p, s] = Σ_h w[p,h]·ReLU(q[p,h]·k[s]) · 128^-0.5 · n_ih^-0.5, float64;
    −inf for s >= (p+1)//4 (indexer.md §6). For a top-k recall check, not for the forward."""
    L = x.shape[0]
    cw = {k: v.double() for k, v in Lw["idx_comp"].items()}
    c, cp = _compress64(cw, 4, x, cfg.rms_norm_eps)
    k = _rope64(c, cp - 3, inv)
    q = _rope64((qr @ Lw["idx_wq_b"].double().T).view(L, cfg.index_heads, cfg.index_head_dim), pos, inv)
    wts = x @ Lw["idx_weights"].double().T
    s = torch.einsum("lhd,sd->lhs", q, k).clamp(min=0)
    s = (s * wts[..., None]).sum(1) * (cfg.index_head_dim**-0.5 * cfg.index_heads**-0.5)
    vis = torch.arange(k.shape[0])[None, :] < ((pos + 1) // 4)[:, None]
    return s.masked_fill(~vis, -math.inf)


# ====================================================================================================
# agreement
# ====================================================================================================


def rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise relative L2 error ||a − b|| / ||b|| in float64 (last dim)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-300)


@dataclass
class StepAgreement:
    step: int  # −1 for the prefill's last prompt token
    logits_err: float  # max over requests of the row relative error
    attn_err: float  # max over layers and requests
    top1_agree: int  # requests whose argmax matches the reference
    n: int

    @property
    def passed(self) -> bool:
        return self.logits_err <= LOGITS_TOL and self.attn_err <= ATTN_TOL


def agreement(cfg, weights, records, history, bugs=()) -> list[StepAgreement]:
    """Compare recorded decode-path outputs with :func:`reference_forward` of each request's history.

    ``records``: list of (step, positions (R,) int64, logits (R, V), attn [per layer (R, Hd)], active (R,)).
    ``history``: :meth:`Decoder.history`."""
    toks, topks = history
    refs = [reference_forward(cfg, weights, toks[r], topks[r], bugs=bugs) for r in range(len(toks))]
    rows = []
    for step, pos, logits, attn, active in records:
        le, ae, top1, n = 0.0, 0.0, 0, 0
        for r in range(len(toks)):
            if not bool(active[r]):
                continue
            p = int(pos[r])
            ref = refs[r]
            le = max(le, float(rel_err(logits[r], ref["logits"][p])))
            ae = max([ae] + [float(rel_err(attn[li][r], ref["attn"][li][p])) for li in range(len(attn))])
            top1 += int(int(logits[r].argmax()) == int(ref["logits"][p].argmax()))
            n += 1
        rows.append(StepAgreement(step, le, ae, top1, n))
    return rows


def run(cfg: Config = TINY, *, steps: int = 8, prompt_lens=(133, 37, 5, 70), seed: int = 0, capacity: int | None = None,
        decode_backend: str = "triton", prefill_backend: str = "reference", pad_heads: bool = True,
        inactive: dict | None = None, progress=None, profile: bool = False):
    """Prefill random prompts, then greedy-decode ``steps`` tokens. Returns (decoder, weights, records,
    tokens/s of the decode loop). ``inactive``: {step: [request ids]} that sit out that step as padding."""
    R = len(prompt_lens)
    cap = capacity or (max(prompt_lens) + steps + 15) // 16 * 16
    w = make_weights(cfg, seed)
    dec = Decoder(cfg, w, num_requests=R, capacity=cap, seed=seed, pad_heads=pad_heads, backend=decode_backend)
    g = generator(seed + 2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in prompt_lens]
    logits = dec.prefill(prompts, backend=prefill_backend)
    records = [(-1, torch.tensor(prompt_lens) - 1, logits.cpu(), [a[(torch.tensor(prompt_lens).cumsum(0) - 1).to(a.device)].cpu()
                                                                for a in dec.attn_out], torch.ones(R, dtype=torch.bool))]
    synchronize()
    t0 = time.perf_counter()
    if profile:
        dec.prof = {}
    for s in range(steps):
        act = torch.ones(R, dtype=torch.bool)
        for r in (inactive or {}).get(s, []):
            act[r] = False
        ids = logits.argmax(-1).cpu()
        pos = dec.lengths.clone()
        logits = dec.step(ids, active=act)
        records.append((s, pos, logits.cpu(), [a.cpu() for a in dec.attn_out], act))
        if progress:
            progress(s + 1, steps)
    synchronize()
    tps = R * steps / (time.perf_counter() - t0)
    return dec, w, records, tps


def demo(steps: int = 16) -> int:
    """``python -m dsv4ref demo``: prefill 4 requests (prompts of 133, 37, 5 and 70 tokens), decode
    ``steps`` tokens each through the Triton kernels, print tokens/s and per-step agreement."""
    from .device import describe

    cfg = TINY
    print(f"dsv4ref demo: {cfg.name}, {cfg.num_layers} layers, ratios {cfg.compress_ratios}; {describe()}")

    def bar(i, n):
        k = 30 * i // n
        sys.stdout.write(f"\rdecode [{'#' * k}{'.' * (30 - k)}] {i}/{n}")
        sys.stdout.flush()

    t0 = time.perf_counter()
    if not interpreting():  # compile every kernel first, so the timed loop measures decoding, not the JIT
        run(cfg, steps=1)
    dec, w, recs, tps = run(cfg, steps=steps, progress=bar)
    print(f"\ndecoded {steps} steps x {dec.R} requests: {tps:.1f} tokens/s "
          f"({'interpreted Triton' if interpreting() else 'compiled Triton'} kernels; prefill + decode "
          f"{time.perf_counter() - t0:.1f} s)")
    if not interpreting() and DEVICE.type != "cpu":
        dec2, _, _, _ = run(cfg, steps=steps, profile=True)
        tot = sum(dec2.prof.values())
        print("per-op time share (decode steps, each op synchronised):")
        for k, v in sorted(dec2.prof.items(), key=lambda kv: -kv[1]):
            print(f"  {k:<22} {v / tot:6.1%}  ({v / steps * 1e3:8.1f} us/step)")
    rows = agreement(cfg, w, recs, dec.history())
    print(f"agreement with the float64 dense reference (row relative L2 error; tolerances: attention "
          f"{ATTN_TOL:g}, logits {LOGITS_TOL:g}; see dsv4ref.decode.ATTN_TOL):")
    print(f"{'step':>6} {'logits':>9} {'attn (max over layers)':>24} {'top-1':>7}  verdict")
    for a in rows:
        print(f"{'prefill' if a.step < 0 else a.step:>6} {a.logits_err:>9.2e} {a.attn_err:>24.2e} "
              f"{a.top1_agree:>4}/{a.n}  {'PASS' if a.passed else 'FAIL'}")
    ok = all(a.passed for a in rows)
    print("all steps agree" if ok else "DISAGREEMENT")
    return 0 if ok else 1


# ====================================================================================================
# where the bytes go (formulas; for the notebook's stacked bar)
# ====================================================================================================


def traffic_per_op(cfg: Config, context: int) -> dict[str, float]:
    """Compulsory bytes moved per decoded token (one request, all layers) by each op of the step, at a
    context of ``context`` tokens. Caches and activations only: weights are shared by the whole batch
    (at batch B each token pays weights/B) and are left out. Conventions (sparse_mla.md §9, indexer.md):

    * sparse_mla: N_sel·584 (KV rows) + q and out bf16 (H·512·2 each) + lse fp32 + 4-byte indices;
      N_sel = W (+ min(K_top, n_c) on ratio-4 layers, + n_c on ratio-128 layers), n_c = context // r.
    * indexer: the logits kernel reads every visible indexer key (132 B: 128 e4m3 + fp32 scale) and writes
      one fp32 logit per key; top-k reads the logits and writes K_top int32; Q quant reads bf16 q
      (n_ih·128·2) and writes e4m3 q + fp32 weights.
    * qnorm_rope_kv_insert: q read + written (bf16), kv row read (bf16), 584 B written.
    * compressor: the fp32 state (kv, score) of this token written (2·coff·D·4 B), the window's states read
      once per r tokens (amortised: coff·r·2·D·4 / r), the compressed row written once per r tokens
      (584 B; indexer keys 132 B).
    * mhc: two fused post+pre per layer, each reading and writing the M bf16 streams (M·Hd·2 B each way)
      plus reading the sub-layer output (Hd·2).
    """
    check_config(cfg)
    H, W, Hd, M = cfg.num_heads, cfg.window, cfg.hidden_size, cfg.hc_mult
    t = dict(sparse_mla=0.0, indexer=0.0, qnorm_rope_kv_insert=0.0, compressor=0.0, mhc=0.0)
    for li in range(cfg.num_layers):
        r = _ratio(cfg, li)
        n_c = context // r if r else 0
        n_sel = W + (min(cfg.index_topk, n_c) if r == 4 else n_c)
        t["sparse_mla"] += n_sel * (kv_cache.TOKEN_BYTES + 4) + 2 * H * 512 * 2 + 4 * H
        t["qnorm_rope_kv_insert"] += 2 * H * 512 * 2 + 512 * 2 + kv_cache.TOKEN_BYTES
        t["mhc"] += 2 * (2 * M * Hd * 2 + Hd * 2)
        if r > 1:
            coff = 2 if r == 4 else 1
            for d, row in [(512, kv_cache.TOKEN_BYTES)] + ([(cfg.index_head_dim, 132)] if r == 4 else []):
                t["compressor"] += 2 * coff * d * 4 + coff * r * 2 * d * 4 / r + row / r
        if r == 4:
            nih = cfg.index_heads
            t["indexer"] += nih * 128 * 2 + nih * (128 + 4) + n_c * (132 + 4) + n_c * 4 + cfg.index_topk * 4
    return t


# ====================================================================================================
# python -m dsv4ref check
# ====================================================================================================


def _register_check():
    from .harness import CheckRow, check
    from .testing import Report

    @check("decode.step")
    def _check_decode():
        """Prefill 2 requests (torch ops), 2 decode steps through the Triton kernels, against the float64
        reference. The tolerance is this module's ATTN_TOL, the row 'decode_step' of dsv4ref.testing.TOLERANCES."""
        dec, w, recs, _ = run(TINY, steps=2, prompt_lens=(40, 9))
        out = []
        for a in agreement(TINY, w, recs, dec.history())[1:]:
            rep = Report(f"step {a.step}", max(a.attn_err, a.logits_err), a.attn_err, "decode_step", a.passed,
                         f"logits {a.logits_err:.3g} (<= {LOGITS_TOL:g}), attention {a.attn_err:.3g} (<= {ATTN_TOL:g})")
            out.append(CheckRow("decode.step", f"tiny, T=2, step {a.step}", rep))
        return out


_register_check()
