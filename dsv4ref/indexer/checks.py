"""The indexer's constants and the argument checks its public functions share
(``docs/indexer.md#the-input-contract``); :mod:`dsv4ref.indexer` re-exports the constants."""

from __future__ import annotations

import torch

from .. import validate
from ..formats import FP8_K_RECORD, INDEX_HEAD_DIM, INDEX_K_FORMATS, INDEX_ROPE_DIM, MXFP4_K_RECORD
from .launch import IndexerLaunch, default_launch


HEAD_DIM = INDEX_HEAD_DIM  # d_ih = 128
ROPE_DIM = INDEX_ROPE_DIM  # the LAST 64 dims (64..127) are rotated, GPT-J pairs (2i, 2i+1)
FP8_RECORD = FP8_K_RECORD  # 132 B per key: 128 e4m3 + fp32 scale 2^e
MXFP4_RECORD = MXFP4_K_RECORD  # 68 B per key: 64 packed bytes + 4 UE8M0 bytes
FMTS = INDEX_K_FORMATS  # ("fp8", "mxfp4")
SUPPORTED_BACKENDS = ("reference", "triton")  # the subset of validate.BACKENDS this op supports ("auto" = "triton")


INDEX_DTYPES = (torch.int64, torch.int32)


def _backend(backend: str) -> str:
    return validate.backend(backend, SUPPORTED_BACKENDS, auto="triton")


def _launch_config(launch: IndexerLaunch | None) -> IndexerLaunch:
    if launch is None:
        return default_launch()
    if not isinstance(launch, IndexerLaunch):
        raise TypeError(f"launch: expected an IndexerLaunch or None, got {type(launch).__name__}")
    return launch


def _check_fmt(fmt: str) -> str:
    if not isinstance(fmt, str):
        raise TypeError(f"fmt: expected a str, one of {FMTS}, got {type(fmt).__name__}")
    if fmt not in FMTS:
        raise ValueError(f"fmt: expected one of {FMTS}, got {fmt!r}")
    return fmt


def _check_flag(v, name: str) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__} {v!r}")
    return v


def _checking_values() -> bool:
    """Value checks read tensors (a sync, and a graph break under torch.compile): on unless
    ``DSV4REF_CHECK_VALUES=0`` (read at call time, :func:`dsv4ref.validate.check_values`) or compiling."""
    return validate.check_values() and not torch.compiler.is_compiling()


def _check_k(k: torch.Tensor) -> None:
    validate.tensor(k, "k", dtype=torch.bfloat16, ndim=2)
    if k.shape[1] != HEAD_DIM:
        raise ValueError(f"k: expected shape [N, {HEAD_DIM}], got {tuple(k.shape)}")


def _check_nan_codes(q: torch.Tensor, q_scales: torch.Tensor | None, weights_out: torch.Tensor) -> None:
    """Checks on: the quantised query holds no NaN (e4m3 codes 0x7F / 0xFF, UE8M0 byte 255) and finite weights."""
    if q_scales is None:
        bad = (q.view(torch.uint8) & 0x7F) == 0x7F
        if bool(bad.any()):
            raise ValueError(
                f"q: non-finite values (e4m3 NaN codes; the first at index "
                f"{tuple(bad.nonzero()[0].tolist())}): quantize_q wrote a NaN row"
            )
    elif bool((q_scales.contiguous().view(torch.uint8) == 255).any()):
        i = tuple((q_scales.contiguous().view(torch.uint8).view(*q_scales.shape, 4) == 255).nonzero()[0].tolist())
        raise ValueError(f"q_scales: non-finite values (UE8M0 byte 255 = NaN at [t, h, block] {i})")
    validate.finite(weights_out, "weights_out")
