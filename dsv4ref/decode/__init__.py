"""A whole DeepSeek-V4 decode step, end to end, on the teaching config; and a float64 dense reference.

The walk-through is ``docs/decode.md``. Two implementations of the same block of layers live here:

* :class:`Decoder` (:mod:`.model`): the real data path. Paged FP8 caches (584 B/token, shuffled pages
  behind block tables), the fused q-norm + RoPE + KV insert, the stateful compressor op
  (:mod:`dsv4ref.compressor`: ratio 4 with overlap, ratio 128, and the indexer's own ratio-4 compressor),
  the lightning indexer's top-k, sparse MLA decode over window ∪ compressed rows with the attention sink,
  inverse RoPE, the grouped o-projection, mHC around attention and around the MoE feed-forward
  (:mod:`dsv4ref.moe`; 8 experts, top-2, layer 0 hash-routed on the teaching config), and the hc_head +
  final norm + lm_head. Every op is a public library call with a ``backend`` switch. With the MTP draft
  layer (:mod:`dsv4ref.mtp`), :meth:`Decoder.speculate` drafts k tokens and verifies them in one step. With
  ``graph=True`` (value checks off) each step's device part is one replayed device graph (:class:`StepGraph`).
* :func:`reference_forward` (:mod:`.reference`): the same block as a float64 full-sequence forward: no
  FP8 KV, no paging, no sparsity except the causal window, the top-k ids and the expert ids it is given.

:func:`agreement` compares the two under :data:`ATTN_TOL` / :data:`LOGITS_TOL` (:mod:`.compare`); :func:`run`
drives a decoder (:func:`run_speculative` with MTP speculation; :mod:`.driver`); :func:`demo` is
``python -m dsv4ref demo`` (:mod:`.demo`). The weights are random and seeded (:func:`make_weights`, from
:mod:`dsv4ref.weights`; :func:`mtp_weights`, the MTP draft layer's alone).

Modules: :mod:`.model` (the Decoder: caches, the step, its device graph), :mod:`.stack` (the layer stack the
step runs: attention, indexer, MoE, head), :mod:`.state` (the per-layer :class:`LayerState` and the step's
records), :mod:`.speculation` (draft / verify), :mod:`.glue` (small torch pieces), :mod:`.traffic`
(:func:`traffic_per_op`), :mod:`.reference`, :mod:`.compare`, :mod:`.driver`, :mod:`.demo`.

Usage::

    from dsv4ref import decode
    from dsv4ref.config import TINY
    dec = decode.Decoder(TINY, decode.make_weights(TINY), num_requests=2, capacity=64)
    logits = dec.prefill([[1, 2, 3], [4, 5]])          # (2, V) fp32: each request's last prompt token
    logits = dec.step(logits.argmax(-1))               # one token per request
    toks, topks = dec.history()
    ref = decode.reference_forward(TINY, dec.w, toks[0], topks[0])   # float64, the whole sequence
"""

from ..weights import check_config, layer_ratio, make_weights, mtp_weights, weights_to
from .compare import (
    AGREEMENT_TOL,
    ATTN_TOL,
    ATTN_TOL_V4,
    LOGITS_TOL,
    LOGITS_TOL_V4,
    StepAgreement,
    agreement,
    rel_err,
    tolerances,
)
from .demo import demo
from .driver import SpecStats, graph_speed, run, run_speculative
from .v4_formats import FormatError, FormatStep, format_error
from .glue import swiglu_clamped
from .model import Decoder
from .reference import REFERENCE_BUGS, reference_forward
from .speculation import Speculation
from .state import CacheCapacityError, History, LayerState, Rows, StepGraph
from .traffic import traffic_per_op

__all__ = [
    "Decoder",
    "CacheCapacityError",
    "Rows",
    "LayerState",
    "check_config",
    "layer_ratio",
    "make_weights",
    "mtp_weights",
    "weights_to",
    "reference_forward",
    "REFERENCE_BUGS",
    "agreement",
    "StepAgreement",
    "rel_err",
    "ATTN_TOL",
    "LOGITS_TOL",
    "AGREEMENT_TOL",
    "ATTN_TOL_V4",
    "LOGITS_TOL_V4",
    "tolerances",
    "run",
    "run_speculative",
    "SpecStats",
    "demo",
    "traffic_per_op",
    "format_error",
    "FormatError",
    "FormatStep",
    "swiglu_clamped",
    "History",
    "Speculation",
    "StepGraph",
    "graph_speed",
]
