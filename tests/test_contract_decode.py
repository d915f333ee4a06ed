"""The input contract of dsv4ref.decode.Decoder and the demo command (docs/contract.md#decoder): every argument
checked by name before anything is written; token ids are integers (a float or bool is refused, never
truncated); weights of another config or on another device refused by entry; a failed call (speculate
included) leaves the caches, lengths, ``mtp_done`` and the expert records as they were.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dsv4ref.config import TINY
from dsv4ref.decode import CacheCapacityError, Decoder, make_weights
from dsv4ref.tools.cli import main as cli_main


@pytest.fixture(scope="module")
def weights():
    return make_weights(TINY, 0, device="cpu")


def decoder(weights, **kw):
    args = dict(num_requests=2, capacity=32, backend="reference", device="cpu")
    args.update(kw)
    return Decoder(TINY, weights, **args)


def state(dec) -> list:
    """Every buffer a call could write, and the host counters."""
    out = [dec.lengths, dec.mtp_done, dec.tokens, dec.h_hist]
    for st in dec.layers + [dec.mtp_state]:
        for key in ("swa", "comp", "idx_cache", "experts", "topk"):
            if getattr(st, key) is not None:
                out.append(getattr(st, key))
        for ring in st.rings():
            out += [ring.kv, ring.score]
    return [t.clone() for t in out]


def same(a: list, b: list) -> bool:
    return all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------------
# construction
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, err, name",
    [
        (dict(capacity=32.0), TypeError, "capacity"),
        (dict(capacity=True), TypeError, "capacity"),
        (dict(capacity=0), ValueError, "capacity"),
        (dict(num_requests="2"), TypeError, "num_requests"),
        (dict(num_requests=0), ValueError, "num_requests"),
        (dict(seed="a"), TypeError, "seed"),
        (dict(pad_heads=1), TypeError, "pad_heads"),
        (dict(graph="yes"), TypeError, "graph"),
        (dict(device="meta"), ValueError, "device"),
    ],
)
def test_decoder_arguments_are_checked_by_name(weights, kw, err, name):
    with pytest.raises(err, match=f"^{name}:"):
        decoder(weights, **kw)


def test_decoder_weights_must_be_this_configs(weights):
    with pytest.raises(TypeError, match="^weights: expected the dict of make_weights"):
        decoder([weights])
    with pytest.raises(ValueError, match="^weights: missing 'embed'"):
        decoder({})
    other = make_weights(TINY.replace(vocab_size=256), 0, device="cpu")
    with pytest.raises(ValueError, match=r"^weights\['embed'\]: expected shape \(512, 256\)"):
        decoder(other)
    bad = copy.copy(weights)
    bad["layers"] = [dict(L) for L in weights["layers"]]
    bad["layers"][2]["moe"] = dict(bad["layers"][2]["moe"], w13=bad["layers"][2]["moe"]["w13"][:4])
    with pytest.raises(ValueError, match=r"^weights\['layers'\]\[2\]\['moe'\]\['w13'\]: expected shape"):
        decoder(bad)
    no_mtp = {k: v for k, v in weights.items() if k != "mtp"}  # the draft layer's weights are optional
    assert decoder(no_mtp).mtp_state is None


def test_decoder_refuses_weights_on_another_device(weights):
    """Weights made on the CPU for a Decoder on a GPU once failed inside torch; the check runs here with the
    weights on the meta device and the Decoder on the CPU."""
    meta = copy.copy(weights)
    meta["lm_head"] = weights["lm_head"].to("meta")
    with pytest.raises(ValueError, match=r"^weights\['lm_head'\]: on meta, the Decoder runs on cpu"):
        decoder(meta)


def test_make_weights_seed_is_an_int():
    with pytest.raises(TypeError, match="^seed:"):
        make_weights(TINY, "a", device="cpu")


def test_config_scalars_are_checked():
    for field, value, err in (
        ("routed_scaling_factor", float("nan"), ValueError),
        ("routed_scaling_factor", -1.5, ValueError),
        ("swiglu_limit", "10", TypeError),
        ("hc_mult", "4", TypeError),
        ("rms_norm_eps", 0.0, ValueError),
    ):
        with pytest.raises(err, match=f"^cfg.{field}:"):
            Decoder(TINY.replace(**{field: value}), num_requests=1, capacity=16, device="cpu")


# ----------------------------------------------------------------------------------------------------
# token ids
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefilled(weights):
    dec = decoder(weights, capacity=16)
    logits = dec.prefill([list(range(1, 14)), [7, 8, 9]])
    return dec, logits.argmax(-1).cpu()


@pytest.mark.parametrize(
    "prompts, err, match",
    [
        ([5, 6], ValueError, r"^prompts\[0\]: expected a 1-d sequence"),
        ([[1, 2], [3, [4]]], TypeError, r"^prompts\[1\]:"),
        ([[1.0, 2.0], [3]], TypeError, r"^prompts\[0\]: token ids must be integers"),
        ([[True], [1]], TypeError, r"^prompts\[0\]: token ids must be integers"),
        ([[1, 2], []], ValueError, r"^prompts\[1\]:"),
        ("ab", TypeError, "^prompts:"),
        ([[1, 2], torch.tensor([[3]])], ValueError, r"^prompts\[1\]:"),
    ],
)
def test_prefill_prompts_are_integer_sequences(weights, prompts, err, match):
    dec = decoder(weights)
    before = state(dec)
    with pytest.raises(err, match=match):
        dec.prefill(prompts)
    assert same(before, state(dec))


def test_float_and_bool_token_ids_are_refused_never_truncated(prefilled):
    """dec.step(logits.max(-1).values) once decoded token 2 for 2.91."""
    dec, nxt = copy.deepcopy(prefilled)
    before = state(dec)
    with pytest.raises(TypeError, match="^ids: token ids must be integers"):
        dec.step(torch.tensor([2.91, 5.0]))
    with pytest.raises(TypeError, match="^ids: token ids must be integers"):
        dec.step([True, False])
    with pytest.raises(TypeError, match="^active: expected bools"):
        dec.step(nxt, active=torch.tensor([1.0, 0.0]))
    with pytest.raises(TypeError, match="^next_ids: token ids must be integers"):
        dec.speculate(nxt.float(), 1)
    with pytest.raises(TypeError, match="^drafts: token ids must be integers"):
        dec.verify(nxt, torch.tensor([[1.5], [2.0]]))
    with pytest.raises(TypeError, match="^ids: token ids must be integers"):
        dec.step(nxt.to("meta").float())
    with pytest.raises(ValueError, match="^ids: tensors on the meta device"):
        dec.step(nxt.to("meta"))
    assert same(before, state(dec))


def test_a_failed_speculate_changes_nothing_and_a_smaller_k_then_works(prefilled):
    """Request 0 holds 13 of 16 tokens: k = 3 verifies positions 13..16, past the capacity. The draft once ran
    first (mtp_done advanced, the draft layer's cache and expert records written), so the retry failed
    misleadingly; now the capacity of the verification is checked first and k = 2 then works."""
    dec, nxt = copy.deepcopy(prefilled)
    before = state(dec)
    with pytest.raises(CacheCapacityError, match="^k: request 0: position 16 is past the cache capacity of 16"):
        dec.speculate(nxt, 3)
    assert same(before, state(dec))
    sp = dec.speculate(nxt, 2)
    assert int(dec.lengths[0]) == 13 + int(sp.accepted[0]) + 1


def test_speculate_at_the_last_position_says_to_step(prefilled):
    """At length = capacity − 1 there is room for one row: k = 1 needs two, refused with nothing written;
    step() fills the last position."""
    dec, nxt = copy.deepcopy(prefilled)
    dec.step(nxt)
    dec.step(torch.tensor([3, 4]))  # request 0: 15 = capacity − 1 tokens
    before = state(dec)
    with pytest.raises(CacheCapacityError, match=r"^k: .*use a smaller k or step\(\)"):
        dec.speculate(torch.tensor([5, 6]), 1)
    assert same(before, state(dec))
    dec.step(torch.tensor([5, 6]))
    assert dec.lengths.tolist()[0] == 16


# ----------------------------------------------------------------------------------------------------
# the demo command: flags checked before any work
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, flag", [(["--steps", "5000"], "--steps"), (["--steps", "3962", "--speculate", "7"], "--steps")])
def test_demo_refuses_steps_past_the_capacity_before_any_work(argv, flag, capsys):
    assert cli_main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"demo: {flag}:") and "at most" in err
