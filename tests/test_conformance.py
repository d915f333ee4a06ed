"""The conformance suite (dsv4ref.conformance) and the golden vectors (golden/*.pt).

* every op of this checkout passes the suite through its Triton kernel and through its reference;
* the committed golden files reproduce: the references, re-run on the stored inputs, give the stored
  outputs (exact for bytes, the named tolerance for floats); the stored inputs are the suite's, bit for bit;
* the suite has teeth: deliberately broken implementations (transposed comb, dropped sink, a write to
  slot −1, a top-k without the causal −1s, an implementation that raises) are reported FAIL.
"""

import pathlib

import torch

from dsv4ref import conformance, kv_cache, mhc, sparse_mla
from dsv4ref.tolerances import TOLERANCES

GOLDEN = pathlib.Path(__file__).resolve().parent.parent / "golden"


def _fails(rows, op):
    mine = [r for r in rows if r.op == op]
    assert mine, f"no rows for {op}"
    return [r for r in mine if not r.passed]


def test_kernels_pass_the_suite():
    rows = conformance.run()
    assert rows and all(r.passed for r in rows), conformance.format_report(rows)
    ops = {r.op for r in rows}
    assert {"kv_cache.insert", "sparse_mla.decode", "mhc.post", "rope.qnorm_rope_kv_insert", "indexer.topk"} <= ops


def test_golden_files_reproduce():
    """The references, re-run on the stored inputs, give the stored outputs. The kernels need no second pass
    here: the stored inputs are bit for bit the ones the suite builds now (the next test) and
    ``test_kernels_pass_the_suite`` holds the kernels to the references' outputs on them."""
    cases = conformance.load_golden(GOLDEN)
    assert len(cases) >= 15
    rows = conformance.run(conformance.reference_impls(), cases)
    assert all(r.passed for r in rows), conformance.format_report(rows)


def test_golden_files_match_the_cases_of_this_checkout():
    """The stored inputs are the ones the suite builds now (make_golden.py was re-run after a change)."""
    stored = {(c.op, c.name): c for c in conformance.load_golden(GOLDEN)}
    for c in conformance.all_cases(with_expected=False):
        g = stored[(c.op, c.name)]
        assert list(g.inputs) == list(c.inputs) and g.positional == c.positional
        for k, v in c.inputs.items():
            if isinstance(v, torch.Tensor):  # bit for bit (NaN inputs included)
                w = g.inputs[k]
                assert w.dtype == v.dtype and w.shape == v.shape, (c.op, c.name, k)
                assert torch.equal(w.flatten().contiguous().view(torch.uint8), v.flatten().contiguous().view(torch.uint8)), (
                    c.op,
                    c.name,
                    k,
                )
            else:
                assert g.inputs[k] == v


def test_golden_format():
    paths = sorted(GOLDEN.glob("*.pt"))
    assert max(p.stat().st_size for p in paths) < 2 * 2**20  # no case over 2 MiB
    assert sum(p.stat().st_size for p in paths) < 16 * 2**20  # ~150 cases of ~9 ops: a clone stays small
    d = torch.load(paths[0], weights_only=True)  # loadable without unpickling code
    keys = {"op", "case", "why", "positional", "inputs", "expected", "tolerance", "mass"}
    assert keys <= set(d) <= keys | {"check_values"}  # check_values: absent in files written before it existed
    for t in d["tolerance"].values():
        assert t["name"] in TOLERANCES and {"mode", "atol", "rtol", "cos"} <= set(t)


MIN_CASES = 6  # every public function of the suite has at least this many cases


def test_every_function_has_at_least_six_cases():
    """No op is thin: each function of every op module (MoE and MTP included) has >= 6 cases, so a new op
    cannot enter with one happy-path case and an existing one cannot lose its adversarial ones."""
    import collections

    n = collections.Counter(c.op for c in conformance.all_cases(with_expected=False))
    thin = {op: n[op] for op in conformance.suite.outputs() if n[op] < MIN_CASES}
    assert not thin, f"functions with fewer than {MIN_CASES} conformance cases: {thin}"


def test_amax_floor_only_at_zero_fails():  # moe.md P8's neighbour: the staging floor max(amax, 1e-4)
    """A stage that applies the 1e-4 floor only to all-zero groups (not to 0 < amax < 1e-4) writes other
    scale bytes for tiny groups: the floor case must catch it."""
    from dsv4ref.fp8 import reference as fp8_ref

    def stage_floor_at_zero(hidden, ids, weights, **kw):
        q_floor, b_floor = fp8_ref.quantize_ue8m0(hidden, 32, 1e-4)
        q_raw, b_raw = fp8_ref.quantize_ue8m0(hidden, 32, 1e-35)
        zero = (hidden.float().reshape(*b_floor.shape, 32) == 0).all(-1)
        q = torch.where(zero.repeat_interleave(32, -1), q_floor.view(torch.uint8), q_raw.view(torch.uint8))
        b = torch.where(zero, b_floor, b_raw)
        return q.view(torch.float8_e4m3fn), b.contiguous().view(torch.int32), ids.to(torch.int64), weights.clone()

    bad = {r.case for r in _fails(conformance.run({"moe.stage": stage_floor_at_zero}, "moe.stage"), "moe.stage")}
    assert "amax_floor_groups_below_1e-4" in bad
    assert not bad & {"worked_words_448_pow2_lanes_K6", "thirty_octaves_K1", "nonfinite_groups_checks_off"}


def test_softplus_without_threshold_fails():  # moe.md P2: softplus(z) = z above 20
    """sqrt(log1p(exp(z))) for every z overflows to inf past z ≈ 88 in fp32: NaN weights on those rows."""

    def route_no_threshold(x, gate_weight, bias, *, k, routed_scale, hash_table=None, input_ids=None, **kw):
        z = x.float() @ gate_weight.float().T
        s = torch.sqrt(torch.log1p(torch.exp(z)))
        ids = torch.sort(s + bias, dim=-1, descending=True, stable=True).indices[:, :k]
        w = s.gather(1, ids)
        return ids.to(torch.int32), w / w.sum(-1, keepdim=True).clamp_min(1e-20) * routed_scale

    cases = [
        c
        for c in conformance.all_cases("moe.route")
        if "hash_table" not in c.inputs and "input_ids" not in c.inputs and c.check_values
    ]
    bad = {r.case for r in _fails(conformance.run({"moe.route": route_no_threshold}, cases), "moe.route")}
    assert bad == {"softplus_threshold_z_above_88"}


def test_transposed_comb_fails():  # pitfall #22
    def post_wrong(x, residual, post, comb, **kw):
        return mhc.post(x, residual, post, comb.transpose(1, 2).contiguous(), backend="reference")

    bad = _fails(conformance.run({"mhc.post": post_wrong}), "mhc.post")
    # the trap, and every other case whose comb is not symmetric (the symmetric ones cannot tell)
    assert {r.case for r in bad} == {"transposed_comb_trap_4cycle", "odd_hidden_random_comb", "transposed_layouts"}


def test_dropped_sink_fails():  # pitfall #17
    def decode_no_sink(q, cache, slots, lengths, *, sink=None, **kw):
        return sparse_mla.decode(q, cache, slots, lengths, sink=None, backend="reference", **kw)

    bad = _fails(conformance.run({"sparse_mla.decode": decode_no_sink}), "sparse_mla.decode")
    assert {r.output for r in bad} == {"out"}  # lse excludes the sink either way


def test_write_to_slot_minus1_fails():  # pitfall #11
    def insert_clamped(cache, kv, slots, *, block_size):
        """Writes the row of the first −1 slot to slot 0, as a kernel that clamps instead of skipping."""
        kv_cache.insert(cache, kv, slots, block_size=block_size, backend="reference")
        i = (slots < 0).nonzero().flatten()[:1]
        kv_cache.insert(cache, kv[i], torch.zeros_like(i), block_size=block_size, backend="reference")

    bad = _fails(conformance.run({"kv_cache.insert": insert_clamped}), "kv_cache.insert")
    with_minus1 = {
        c.name for c in conformance.all_cases("kv_cache.insert", with_expected=False) if bool((c.inputs["slots"] < 0).any())
    }
    assert "B61_minus1_slots_random_bytes" in with_minus1
    assert {r.case for r in bad} == with_minus1  # every case with a −1 slot catches it, no other case fails


def test_topk_without_minus1_fails():  # pitfall #26
    def topk_plain(logits, k):
        return torch.topk(logits, min(k, logits.shape[1]), dim=-1).indices.to(torch.int32)

    assert _fails(conformance.run({"indexer.topk": topk_plain}), "indexer.topk")


def test_an_implementation_that_raises_is_a_fail():
    def broken(*a, **k):
        raise RuntimeError("not implemented for this device")

    rows = conformance.run({"kv_cache.gather": broken})
    assert rows and not any(r.passed for r in rows)
    assert "not implemented" in rows[0].error
    assert "FAIL" in conformance.format_report(rows)


def test_main_exit_code(capsys):
    assert conformance.main(["mhc", "--reference"]) == 0
    out = capsys.readouterr().out
    assert "transposed_comb_trap_4cycle" in out and "0 failed" in out


def test_one_cases_module_per_op():
    """The suite finds its cases through conformance.OPS: one module per op, each exposing OUTPUTS and
    cases(), each case naming a function of its own op."""
    import importlib

    for op in conformance.OPS:
        mod = importlib.import_module(f"dsv4ref.conformance.{op}")
        assert mod.OUTPUTS and all(name.startswith(op + ".") for name in mod.OUTPUTS)
        cs = mod.cases()
        assert cs and all(c.op in mod.OUTPUTS and c.expected == {} for c in cs)
        assert set(c.op for c in cs) == set(mod.OUTPUTS), op  # every function of the op has a case


def test_safetensors_golden_files_hold_the_same_cases():
    """golden/*.safetensors (language-neutral) carry exactly what golden/*.pt carry, bit for bit: so they are
    the suite's cases too, and the kernels that pass the suite pass them."""
    from dsv4ref.conformance import safetensors_io

    pt = {(c.op, c.name): c for c in conformance.load_golden(GOLDEN)}
    st = {(c.op, c.name): c for c in safetensors_io.load(GOLDEN)}
    assert set(st) == set(pt)

    def bits(t):
        return t.flatten().contiguous().view(torch.uint8)

    for key, a in pt.items():
        b = st[key]
        assert (a.positional, a.tol, a.check_values, a.why) == (b.positional, b.tol, b.check_values, b.why), key
        assert set(a.inputs) == set(b.inputs), key
        for k, v in a.inputs.items():
            w = b.inputs[k]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.shape == w.shape and torch.equal(bits(v), bits(w)), (key, k)
            else:
                assert v == w or (v != v and w != w), (key, k)
        for k, v in a.expected.items():
            assert torch.equal(bits(v), bits(b.expected[k])), (key, k)
