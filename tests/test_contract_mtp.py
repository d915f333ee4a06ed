"""The input contract of dsv4ref.mtp (docs/contract.md#mtp): token ids are integers, never broadcast or
truncated; eps / hc_mult checked as numbers in range; non-finite input refused with value checks on; errors
name this module's own arguments (``X``, ``hc_fn``, ...), not those of the ops it calls.

hypothesis holds :func:`dsv4ref.mtp.accepted_counts` to the written-out loop of the rule
(:func:`dsv4ref.mtp.reference.greedy_accept`) on random batches.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4ref import decode, mtp, validate
from dsv4ref.config import TINY
from dsv4ref.mtp import reference
from dsv4ref.testing import randn

NAN, INF = float("nan"), float("inf")
M, HD = TINY.hc_mult, TINY.hidden_size


# ----------------------------------------------------------------------------------------------------
# accepted_counts / greedy_accept
# ----------------------------------------------------------------------------------------------------


@settings(max_examples=40)
@given(R=st.integers(1, 4), k=st.integers(0, 4), data=st.data())
def test_property_accepted_counts_is_the_rule_row_by_row(R, k, data):
    ids = st.integers(0, 3)  # a small vocabulary: agreements are frequent
    drafts = torch.tensor(
        data.draw(st.lists(st.lists(ids, min_size=k, max_size=k), min_size=R, max_size=R)), dtype=torch.int64
    ).view(R, k)
    target = torch.tensor(data.draw(st.lists(st.lists(ids, min_size=k + 1, max_size=k + 1), min_size=R, max_size=R)))
    got = mtp.accepted_counts(drafts, target.to(torch.int32))
    for r in range(R):
        assert int(got[r]) + 1 == reference.greedy_accept(drafts[r], target[r]).numel()


def test_accepted_counts_never_broadcasts_rows():
    """[[5,7],[1,2],[5,0]] against one target row [[5,7,1]] once gave [2, 0, 1]."""
    with pytest.raises(ValueError, match=r"^target: expected shape \(3, 3\)"):
        mtp.accepted_counts(torch.tensor([[5, 7], [1, 2], [5, 0]]), torch.tensor([[5, 7, 1]]))


def test_accepted_counts_needs_the_bonus_column():
    with pytest.raises(ValueError, match=r"^target: expected shape \(1, 3\)"):
        mtp.accepted_counts(torch.tensor([[5, 7]]), torch.tensor([[5, 7]]))


@pytest.mark.parametrize("which", ["drafts", "target"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_accepted_counts_refuses_float_and_bool_ids(which, dtype):
    d, t = torch.tensor([[5, 7]]), torch.tensor([[5, 7, 1]])
    args = {"drafts": d, "target": t}
    args[which] = args[which].to(dtype)
    with pytest.raises(TypeError, match=f"^{which}: expected dtype"):
        mtp.accepted_counts(**args)


def test_accepted_counts_refuses_negative_ids_with_checks_on_only():
    d, t = torch.tensor([[-1, 7]]), torch.tensor([[5, 7, 1]])
    with pytest.raises(ValueError, match="^drafts: token ids must be >= 0"):
        mtp.accepted_counts(d, t)
    with validate.checking_values(False):
        assert mtp.accepted_counts(d, t).tolist() == [0]


def test_accepted_counts_refuses_meta_tensors():
    with pytest.raises(ValueError, match="^drafts: tensors on the meta device cannot be run"):
        mtp.accepted_counts(
            torch.zeros(1, 2, dtype=torch.int64, device="meta"), torch.zeros(1, 3, dtype=torch.int64, device="meta")
        )


# ----------------------------------------------------------------------------------------------------
# draft_input
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wm():
    return decode.make_weights(TINY, 0, device="cpu")["mtp"]


def _input(wm, T=4, **over):
    args = dict(
        h_prev=randn((T, M, HD), seed=1, device="cpu", block=None, octaves=4),
        embed_rows=randn((T, HD), seed=2, device="cpu", block=None, octaves=0),
        positions=torch.arange(T),
        enorm=wm["enorm"],
        hnorm=wm["hnorm"],
        e_proj=wm["e_proj"],
        h_proj=wm["h_proj"],
        eps=1e-6,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "eps, err",
    [
        (0, ValueError),
        (0.0, ValueError),
        (-1e-6, ValueError),
        (NAN, ValueError),
        (INF, ValueError),
        ("1e-6", TypeError),
        (True, TypeError),
    ],
)
def test_draft_input_eps_is_a_finite_number_above_zero(wm, eps, err):
    """eps = 0 once made every position-0 row NaN (its embedding is zeroed, then RMS-normed by 1/sqrt(0))."""
    with pytest.raises(err, match="^eps:"):
        mtp.draft_input(**_input(wm, eps=eps))


@pytest.mark.parametrize(
    "hc_mult, err", [(0, ValueError), (-1, ValueError), ("4", TypeError), (4.0, TypeError), (True, TypeError), (3, ValueError)]
)
def test_draft_input_hc_mult_is_named(wm, hc_mult, err):
    a = _input(wm)
    flat = a["h_prev"].reshape(a["h_prev"].shape[0], -1)
    with pytest.raises(err, match="^hc_mult:"):
        mtp.draft_input(**{**a, "h_prev": flat}, hc_mult=hc_mult)
    if hc_mult == 3:  # given with an unflattened h_prev, it must match its streams
        with pytest.raises(ValueError, match="^hc_mult: 3 does not match"):
            mtp.draft_input(**a, hc_mult=3)


def test_draft_input_refuses_negative_positions_with_checks_on(wm):
    with pytest.raises(ValueError, match="^positions: expected positions >= 0"):
        mtp.draft_input(**_input(wm, positions=torch.tensor([0, 1, -2, 3])))


@pytest.mark.parametrize("arg", ["h_prev", "embed_rows"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_draft_input_refuses_nonfinite_rows_with_checks_on(wm, arg, bad):
    a = _input(wm, positions=torch.arange(1, 5))  # (a position-0 row reads no embedding)
    a[arg] = a[arg].clone()
    a[arg].view(-1)[5] = bad
    with pytest.raises(ValueError, match=f"^{arg}: non-finite values"):
        mtp.draft_input(**a)
    with validate.checking_values(False):  # checks off: IEEE arithmetic, the row comes out NaN
        X = mtp.draft_input(**a)
    assert bool(X[0].float().isnan().any()) and bool(torch.isfinite(X[1:].float()).all())


def test_draft_input_refuses_meta_tensors(wm):
    a = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in _input(wm).items()}
    with pytest.raises(ValueError, match="^h_prev: tensors on the meta device cannot be run"):
        mtp.draft_input(**a)


# ----------------------------------------------------------------------------------------------------
# draft_logits: its own argument names
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def head():
    w = decode.make_weights(TINY, 0, device="cpu")
    X = randn((3, M, HD), seed=3, device="cpu", block=None, octaves=2)
    return dict(
        X=X,
        hc_fn=w["mtp"]["hc_head"]["fn"],
        hc_scale=w["mtp"]["hc_head"]["scale"],
        hc_base=w["mtp"]["hc_head"]["base"],
        norm=w["mtp"]["norm"],
        lm_head=w["lm_head"],
    )


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(
    "arg, bad, err",
    [
        ("hc_fn", lambda t: t[:, :-1], ValueError),
        ("hc_fn", lambda t: t.double(), TypeError),
        ("hc_scale", lambda t: torch.ones(2), ValueError),
        ("hc_base", lambda t: t[:-1], ValueError),
        ("hc_base", lambda t: t.to(torch.bfloat16), TypeError),
        ("X", lambda t: t.clone().fill_(NAN), ValueError),
        ("hc_fn", lambda t: t.clone().fill_(INF), ValueError),
    ],
)
def test_draft_logits_names_its_own_arguments(head, backend, arg, bad, err):
    """Not mhc.head's ``fn`` / ``scale`` / ``base`` / ``hidden``."""
    a = dict(head)
    a[arg] = bad(a[arg])
    with pytest.raises(err, match=f"^{arg}:"):
        mtp.draft_logits(**a, backend=backend)


def test_draft_logits_refuses_meta_tensors(head):
    a = {k: v.to("meta") for k, v in head.items()}
    with pytest.raises(ValueError, match="^X: tensors on the meta device cannot be run"):
        mtp.draft_logits(**a)


def test_mtp_weights_seed_is_an_int():
    w = decode.make_weights(TINY, 0, device="cpu")
    with pytest.raises(TypeError, match="^seed:"):
        decode.mtp_weights(TINY, w, "a")
    with pytest.raises(ValueError, match="^seed:"):
        decode.mtp_weights(TINY, w, -1)
