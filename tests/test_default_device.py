"""The library does not depend on torch's default device.

A reader who writes ``torch.set_default_device("cuda")`` at the top of a notebook (a common habit) must get
the same answers. Every table (cos/sin, inverse frequencies) and every seeded draw is built on the host
(``dsv4ref.device.HOST``, named explicitly), and every device tensor the library makes names its device.
Here the default device is "meta": a factory call that forgets its ``device=`` makes a tensor without data,
which fails the moment it meets real data, so each forgotten ``device=`` on these paths fails a test.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from dsv4ref import compressor, decode, indexer, kv_cache, mhc, moe, rope, sparse_mla
from dsv4ref.config import TINY
from dsv4ref.conformance import suite
from dsv4ref.device import DEVICE


def _no_meta(result) -> None:
    leaves = result if isinstance(result, (tuple, list)) else (result.values() if isinstance(result, dict) else [result])
    for x in leaves:
        if isinstance(x, torch.Tensor):
            assert x.device.type != "meta", "a result was made on torch's default device"


def _decoder_step():
    w = decode.make_weights(TINY, 0, device=DEVICE)
    dec = decode.Decoder(TINY, w, num_requests=2, capacity=40, backend="reference")
    dec.prefill([torch.arange(5, device=DEVICE), torch.arange(7, device=DEVICE)])
    return dec.step(torch.tensor([1, 2], device=DEVICE))


CALLS = {
    "rope.inv_freq": lambda: rope.inv_freq(64, 160000.0, TINY.yarn),
    "rope.cos_sin_rows": lambda: rope.cos_sin_rows(torch.arange(10, device=DEVICE)),
    "rope.cos_sin_cache": lambda: rope.cos_sin_cache(64),
    "rope.example_inputs": lambda: rope.example_inputs(2, 4, 4, 8, seed=0, cos_sin=rope.cos_sin_cache(64, device=DEVICE)),
    "indexer.cos_sin_table": lambda: indexer.cos_sin_table(64),
    "indexer.example_inputs": lambda: indexer.example_inputs(2, 4, 16, block_size=4),
    "kv_cache.example_inputs": lambda: kv_cache.example_inputs(4, 2, 8, seed=1),
    "sparse_mla.example_inputs": lambda: sparse_mla.example_inputs(2, 16, 8, 4),
    "mhc.example_params": lambda: mhc.example_params(64),
    "mhc.example_streams": lambda: mhc.example_streams(3, 64),
    "moe.example_inputs": lambda: moe.example_inputs(4, moe.TINY_MOE, seed=1),
    "compressor.example_inputs": lambda: compressor.example_inputs(4, dim=128, hidden=TINY.hidden_size, seed=1),
    "decode.make_weights": lambda: decode.make_weights(TINY, 0)["embed"],
    "decode.Decoder.step": _decoder_step,
}


@pytest.mark.parametrize("name", list(CALLS))
def test_entry_points_ignore_the_default_device(name):
    with torch.device("meta"):
        _no_meta(CALLS[name]())


def test_reference_suite_holds_under_a_meta_default_device():
    """Every golden case, through each op's plain-torch reference, with "meta" as the default device."""
    cases = suite.load_golden(pathlib.Path(__file__).resolve().parent.parent / "golden")
    with torch.device("meta"):
        rows = suite.run(suite.reference_impls(), cases)
    assert rows and all(r.passed for r in rows), [(r.case, r.output, r.error) for r in rows if not r.passed][:5]
