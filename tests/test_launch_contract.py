"""The ``launch=`` contract, the same for every op (docs/layout.md, "One vocabulary"; dsv4ref/op_launch.py).

* a launch of the op's kind reaches its custom op: the op receives ``launch.op_args(op)`` after its other
  arguments, never the default in its place (a dropped launch is the fault these tests catch);
* anything else is refused with a ``TypeError`` starting ``"launch: "``, before any work;
* every registered schema names its trailing arguments as the dataclass names its fields, and the op's body
  rebuilds the same launch from them (``from_op_args`` inverts ``op_args``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dsv4ref
from dsv4ref import compressor, fp8, indexer, kv_cache, mhc, moe, rope, sparse_mla
from dsv4ref.compressor.launch import CompressorLaunch
from dsv4ref.fp8.launch import Fp8Launch
from dsv4ref.indexer.launch import IndexerLaunch
from dsv4ref.kv_cache.launch import KVCacheLaunch
from dsv4ref.linear import LinearLaunch
from dsv4ref.mhc import ChunkedLaunch, MhcLaunch, OneKernelLaunch, OnePassLaunch, SplitKLaunch
from dsv4ref.mhc.launch import DESIGNS, PACKED_OPS
from dsv4ref.moe import Fp4Launch, MoeLaunch
from dsv4ref.op_launch import OpLaunch
from dsv4ref.rope.launch import RopeLaunch
from dsv4ref.sparse_mla import GluonLaunch, SparseMlaLaunch, gluon
from dsv4ref.testing import randn

DEVICE = dsv4ref.DEVICE


class Calls(TorchDispatchMode):
    """Records every ``dsv4ref::`` custom op a block calls, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "dsv4ref":
            self.calls.append((func._schema.name.split("::")[1], args))
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------------------------------
# one call per public function that takes launch=, on small valid inputs
# ----------------------------------------------------------------------------------------------------


def _kv():
    kv, slots = kv_cache.example_inputs(6, 2, 4, seed=1)
    return kv_cache.insert, (kv_cache.allocate(4, 2), kv, slots), dict(block_size=2)


def _gather():
    kv, slots = kv_cache.example_inputs(6, 2, 4, seed=2)
    cache = kv_cache.allocate(4, 2)
    kv_cache.insert(cache, kv, slots, block_size=2, backend="reference")  # the gather's input: no launch to test
    return kv_cache.gather, (cache, slots), dict(block_size=2)


def _rope_gptj():
    x = randn((5, 3, 64), seed=3)
    return rope.apply_gptj, (x, torch.arange(5, device=DEVICE), rope.cos_sin_cache(16)), {}


def _rope_fused():
    cs = rope.cos_sin_cache(64)
    q, kv, slots, pos = rope.example_inputs(3, 4, 2, 4, seed=4, cos_sin=cs)
    return rope.qnorm_rope_kv_insert, (q, kv, kv_cache.allocate(4, 2), slots, pos, cs), dict(block_size=2)


def _sparse():
    return sparse_mla.decode, (), sparse_mla.example_inputs(2, 4, 8, 4, seed=5)


def _index_q():
    ex = indexer.example_inputs(2, 4, 8, block_size=4, seed=6)
    return indexer.quantize_q, (ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"]), {}


def _index_k():
    return indexer.quantize_k, (indexer.example_inputs(2, 4, 8, block_size=4, seed=7)["k"],), {}


def _index_logits():
    ex = indexer.example_inputs(2, 4, 8, block_size=4, seed=8)
    # the reference's bytes: the logits kernel's inputs, without an interpreted quantize launch
    q, qs, wo = indexer.quantize_q(ex["index_q"], ex["positions"], ex["cos_sin"], ex["weights"], backend="reference")
    return indexer.logits, (q, qs, wo, ex["k_cache"], ex["positions"]), dict(block_size=4, block_table=ex["block_table"])


def _compress():
    ex = compressor.example_step(4, (6,))

    def compress(**kw):  # the compressor updates its state: every call starts from a fresh one
        return compressor.compress(**{k: (v.clone() if k.startswith("state") else v) for k, v in ex.items()}, **kw)

    return compress, (), {}


def _fp8():
    return fp8.quantize_ue8m0, (randn((4, 128), seed=9), 64), {}


def _moe_routed(T=4, seed=17):
    d = moe.example_inputs(T, moe.TINY_MOE, seed=seed)
    ids, w = moe.route(d["x"], d["gate_weight"], d["bias"], k=moe.TINY_MOE.k, routed_scale=moe.TINY_MOE.routed_scale)
    return d, ids, w


def _moe_stage_into():
    d, ids, w = _moe_routed(seed=17)
    return moe.stage_into, (d["x"], ids, w, *moe.stage(d["x"], ids, w, backend="reference")), {}


def _moe_experts():
    d, ids, w = _moe_routed(T=1, seed=18)  # one token: the smallest valid input, its two experts a launch each
    staged = moe.stage(d["x"], ids, w, backend="reference")
    args = (d["x"], *staged, d["w13"], d["w2"], d["shared_w13"], d["shared_w2"])
    return moe.experts, args, dict(swiglu_limit=moe.TINY_MOE.swiglu_limit)


def _moe_experts_fp4():
    from dsv4ref import linear as lin

    d, ids, w = _moe_routed(T=1, seed=19)

    def fp4(t):
        q, s = lin.quantize_fp4_weight(t.reshape(-1, t.shape[-1]))
        return q.view(*t.shape[:-1], -1), s.view(*t.shape[:-1], -1)

    args = (d["x"], ids, w, *fp4(d["w13"]), *fp4(d["w2"]))
    args += lin.quantize_fp8_weight(d["shared_w13"]) + lin.quantize_fp8_weight(d["shared_w2"])
    return moe.experts_fp4, args, dict(swiglu_limit=moe.TINY_MOE.swiglu_limit, path="deepseek")


def _linear_operands(seed):
    from dsv4ref import linear as lin

    x = randn((3, 256), seed=seed, block=128)
    w, ws = lin.quantize_fp8_weight(randn((48, 256), seed=seed + 1, dtype=torch.float32, block=32) * 0.02)
    return lin, x, w, ws


def _fp8_linear():
    lin, x, w, ws = _linear_operands(24)
    return lin.fp8_linear, (x, w, ws), {}


def _fp4_linear():
    lin, x, _, _ = _linear_operands(25)
    w, ws = lin.quantize_fp4_weight(randn((48, 256), seed=26, dtype=torch.float32, block=32) * 0.02)
    return lin.fp4_linear, (x, w, ws), {}


def _o_proj_fp8():
    lin, _, _, _ = _linear_operands(27)
    o = randn((2, 4, 512), seed=28)
    wo_a = randn((2, 32, 1024), seed=29, octaves=0) * 0.02
    wo_b, wo_b_scale = lin.quantize_fp8_weight(randn((48, 64), seed=30, dtype=torch.float32, block=32) * 0.02)
    return lin.grouped_o_proj, (o, wo_a, wo_b, wo_b_scale), {}


def _mhc_streams(seed, head=False):
    res = mhc.example_streams(3, 64, seed=seed)
    return res, *mhc.example_params(64, seed=seed, head=head)


def _mhc_pre():
    return mhc.pre, _mhc_streams(20), {}


def _mhc_post_args(seed):
    res, fn, scale, base = _mhc_streams(seed)
    p, c, x = mhc.pre(res, fn, scale, base, backend="reference")
    return (x, res, p, c), (fn, scale, base)


def _mhc_post():
    return mhc.post, _mhc_post_args(21)[0], {}


def _mhc_fused():
    post_args, params = _mhc_post_args(22)
    return mhc.fused_post_pre, (*post_args, *params), {}


def _mhc_sinkhorn():
    return mhc.sinkhorn, (randn((3, 4, 4), seed=16, dtype=torch.float32, block=None, octaves=0),), {}


def _mhc_head():
    return mhc.head, _mhc_streams(23, head=True), {}


def _bind(make, backend="auto"):
    """``call(launch)`` running the op of ``make`` on its inputs with ``backend`` and ``launch``."""
    fn, args, kwargs = make()
    return lambda launch: fn(*args, **kwargs, backend=backend, launch=launch)


# (how to build the call, a launch of the op's kind that is not the default, the custom ops it reaches)
CASES = {
    "kv_cache.insert": (_kv, "auto", KVCacheLaunch(2, 2, max_registers=64), ("kv_insert",)),
    "kv_cache.gather": (_gather, "auto", KVCacheLaunch(1, 2), ("kv_gather",)),
    "rope.apply_gptj": (_rope_gptj, "auto", RopeLaunch(rotate_rows=4), ("rope_gptj",)),
    "rope.qnorm_rope_kv_insert": (_rope_fused, "auto", RopeLaunch(heads_per_prog=4, num_warps=2), ("qnorm_rope_kv_insert",)),
    "sparse_mla.decode[triton]": (_sparse, "triton", SparseMlaLaunch(16, 16, num_splits=2, num_warps=4), ("sparse_mla_decode",)),
    "sparse_mla.decode[two_pass]": (_sparse, "two_pass", SparseMlaLaunch(16, 32, num_splits=2), ("sparse_mla_attend_bf16",)),
    "sparse_mla.decode[auto]": (_sparse, "auto", SparseMlaLaunch(16, 16, num_splits=4), ("sparse_mla_decode",)),
    "indexer.quantize_q": (_index_q, "auto", IndexerLaunch(quant_rows=4), ("indexer_q_fp8",)),
    "indexer.quantize_k": (_index_k, "auto", IndexerLaunch(quant_rows=4), ()),
    "indexer.logits": (_index_logits, "auto", IndexerLaunch(logits_pages=2), ()),
    "compressor.compress": (_compress, "auto", CompressorLaunch(block_t=32, block_j=4), ("compressor_compress",)),
    "fp8.quantize_ue8m0": (_fp8, "auto", Fp8Launch(rows_per_program=2), ()),
    "moe.stage_into": (_moe_stage_into, "auto", MoeLaunch(stage_block_t=2, stage_block_h=128, stage_warps=2), ("moe_stage",)),
    "moe.experts": (
        _moe_experts,
        "auto",
        MoeLaunch(block_m=32, block_n=32, block_h=256, block_k=32, expert_warps=2, expert_stages=2, combine_block_t=2),
        ("moe_experts",),
    ),
    "mhc.pre": (_mhc_pre, "auto", SplitKLaunch(block_k=64, splits=2, finish_block_h=64), ("mhc_pre",)),
    "mhc.fused_post_pre": (_mhc_fused, "auto", OneKernelLaunch(block_k=64, post_block_t=2), ("mhc_fused_post_pre",)),
    "mhc.head": (_mhc_head, "auto", ChunkedLaunch(tokens=256, finish_block_h=32), ("mhc_head",)),
    "mhc.post": (_mhc_post, "auto", SplitKLaunch(post_block_t=2, post_block_h=64), ("mhc_post",)),
    "mhc.sinkhorn": (_mhc_sinkhorn, "auto", OneKernelLaunch(sinkhorn_block=8), ("mhc_sinkhorn",)),
    "linear.fp8_linear": (_fp8_linear, "auto", LinearLaunch(32, 32, 2, 2), ("linear_act_quant", "linear_fp8_gemm")),
    "linear.fp4_linear": (_fp4_linear, "auto", LinearLaunch(32, 32, 2, 2), ("linear_act_quant", "linear_fp4_gemm")),
    "linear.grouped_o_proj[fp8]": (_o_proj_fp8, "auto", LinearLaunch(32, 16, 2, 2), ("linear_act_quant", "linear_fp8_gemm")),
    "moe.experts_fp4": (
        _moe_experts_fp4,
        "auto",
        Fp4Launch(block_m=32, block_n=32, block_k=128, warps=2, stages=2),
        ("moe_fp4_gemm",),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_launch_of_another_kind_is_refused_naming_it(name):
    make, backend, right, _ = CASES[name]
    call = _bind(make, backend)
    others = [
        KVCacheLaunch(1),
        RopeLaunch(),
        IndexerLaunch(),
        CompressorLaunch(),
        SparseMlaLaunch(16, 16),
        MoeLaunch(),
        Fp4Launch(),
        SplitKLaunch(),
        LinearLaunch(),
    ]
    kind = lambda launch: MhcLaunch if isinstance(launch, MhcLaunch) else type(launch)  # noqa: E731 (mhc: any design)
    for wrong in ("fast", {"num_splits": 2}, 4, *[o for o in others if kind(o) is not kind(right)]):
        with pytest.raises(TypeError, match="^launch: "):
            call(wrong)


@pytest.mark.parametrize("name", sorted(n for n in CASES if CASES[n][3]))
def test_the_launch_reaches_the_custom_op(name):
    """The custom op receives the launch that was passed (its fields, in schema order), not the default."""
    make, backend, right, ops = CASES[name]
    call = _bind(make, backend)
    with Calls() as rec:
        call(right)
    seen = [(op, args) for op, args in rec.calls if op in ops]
    assert seen, f"{name}: none of {ops} ran (ran: {[op for op, _ in rec.calls]})"
    for op, args in seen:
        want = right.op_args(op)
        assert tuple(args[-len(want) :]) == want, (name, op, args[-len(want) :], want)


def _launch_classes():
    return sorted(OpLaunch.__subclasses__(), key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", _launch_classes(), ids=lambda c: c.__name__)
def test_schemas_name_the_launch_fields(cls):
    """Every op a launch serves is registered, and its schema's trailing arguments are the launch's fields by
    name; the op's body rebuilds the launch from them (from_op_args inverts op_args)."""
    assert cls.OP_FIELDS, f"{cls.__name__} lists no custom op"
    launch = _an_instance(cls)
    for op in cls.OP_FIELDS:
        names = cls.op_fields(op)
        schema = getattr(torch.ops.dsv4ref, op).default._schema
        trailing = [a.name for a in schema.arguments][-len(names) :]
        assert trailing == list(names), (op, trailing, names)
        back = cls.from_op_args(*launch.op_args(op), op=op)
        assert all(getattr(back, n) == getattr(launch, n) for n in names)


def _an_instance(cls):
    made = {
        SparseMlaLaunch: SparseMlaLaunch(32, 64, 2, 4, 1),
        GluonLaunch: GluonLaunch("narrow", 4),
        KVCacheLaunch: KVCacheLaunch(8, 2, True, True, False, True, 64),
        RopeLaunch: RopeLaunch(4, 2, 8),
        IndexerLaunch: IndexerLaunch(quant_rows=8),
        CompressorLaunch: CompressorLaunch(block_t=32, block_j=4),
        MoeLaunch: MoeLaunch(2, 256, 2, True, 32, 128, 256, 32, 8, 2, 4, 512, 2),
        Fp4Launch: Fp4Launch(32, 128, 256, 8, 2),
        LinearLaunch: LinearLaunch(32, 64, 8, 3),
        MhcLaunch: ChunkedLaunch(post_block_t=8, post_block_h=128, sinkhorn_block=32),
    }
    if cls not in made:  # a launch this file does not know yet: its defaults, which must be resolved ints
        return cls()
    return made[cls]


def test_every_op_launch_with_custom_ops_is_an_oplaunch():
    """The launch classes of the ops in this contract follow dsv4ref.op_launch."""
    for cls in (
        SparseMlaLaunch,
        GluonLaunch,
        KVCacheLaunch,
        RopeLaunch,
        IndexerLaunch,
        CompressorLaunch,
        MoeLaunch,
        Fp4Launch,
        LinearLaunch,
        MhcLaunch,
    ):
        assert issubclass(cls, OpLaunch), cls.__name__


# ----------------------------------------------------------------------------------------------------
# mhc: four designs, one launch class each; pre, fused and head take the launch packed (docs/layout.md)
# ----------------------------------------------------------------------------------------------------

MHC_LAUNCHES = (
    OneKernelLaunch(block_t=32, block_k=32, warps=2, stages=3, post_block_t=8, sinkhorn_block=64),
    SplitKLaunch(block_t=32, splits=3, target_programs=7, finish_warps=2, post_block_h=128),
    OnePassLaunch(block_t=64, slice_h=512, maxnreg=None, one_dot=1, sinkhorn_block=32),
    ChunkedLaunch.for_device(interpreted=False, tokens=256, stream_k=False, fn_layout=2, zigzag=False, maxnreg=None),
    ChunkedLaunch.for_device(interpreted=True, tokens=128, sum_unroll=4, small_t=32),
)


def test_mhc_packed_schemas_take_the_design_then_its_fields():
    """pre, fused and head end their schema with ``launch: int[]`` (the exception docs/layout.md states): the
    design's index in DESIGNS, then every field of that design in order; their bodies rebuild the same launch,
    of the same design, from it. Post and sinkhorn follow the convention (test_schemas_name_the_launch_fields)."""
    for op in PACKED_OPS:
        last = getattr(torch.ops.dsv4ref, op).default._schema.arguments[-1]
        assert (last.name, str(last.type)) == ("launch", "List[int]"), (op, last)
    assert set(MhcLaunch.OP_FIELDS) | set(PACKED_OPS) == {f"mhc_{o}" for o in mhc.launch.OPS}
    assert {type(L).design for L in MHC_LAUNCHES} == set(DESIGNS)
    for L in MHC_LAUNCHES:
        for op in PACKED_OPS:
            (packed,) = L.op_args(op)
            assert packed[0] == DESIGNS.index(L.design) and len(packed) == 1 + len(dataclasses.fields(L)), (op, L)
            back = MhcLaunch.from_op_args(packed, op=op)
            assert back == L and type(back) is type(L), (op, L, back)
        for op in MhcLaunch.OP_FIELDS:  # the shared tiles: every design carries them, the same names
            back = MhcLaunch.from_op_args(*L.op_args(op), op=op)
            assert all(getattr(back, n) == getattr(L, n) for n in MhcLaunch.op_fields(op)), (op, L)


def test_op_args_refuses_an_unresolved_field():
    with pytest.raises(ValueError, match="^num_warps: None cannot reach a custom op"):
        RopeLaunch(num_warps=None).op_args("qnorm_rope_kv_insert")
    with pytest.raises(ValueError, match="^op: RopeLaunch serves ops of different schemas"):
        RopeLaunch().op_args()
    with pytest.raises(ValueError, match="^op: expected one of"):
        KVCacheLaunch(1).op_args("rope_gptj")


# ----------------------------------------------------------------------------------------------------
# sparse_mla: two kinds of launch, one per kernel family
# ----------------------------------------------------------------------------------------------------


def test_sparse_mla_refuses_the_other_kernels_launch():
    kw = sparse_mla.example_inputs(2, 4, 8, seed=10)
    for backend in ("triton", "two_pass"):
        with pytest.raises(TypeError, match="^launch: backend '.*' runs a SparseMlaLaunch or None, got GluonLaunch"):
            sparse_mla.decode(**kw, backend=backend, launch=GluonLaunch())
    with pytest.raises(TypeError, match="^launch: backend 'gluon' runs a GluonLaunch or None, got SparseMlaLaunch"):
        sparse_mla.decode(**kw, backend="gluon", launch=SparseMlaLaunch(16, 16))
    with pytest.raises(TypeError, match="^launch: expected a GluonLaunch"):
        gluon.decode_op(
            kw["q"],
            kw["cache"],
            kw["slots"],
            kw["lengths"],
            None,
            None,
            None,
            None,
            16,
            None,
            0.1,
            launch=SparseMlaLaunch(16, 16),
        )
    ref = sparse_mla.decode(**kw, backend="reference")
    for launch in (SparseMlaLaunch(16, 16), GluonLaunch()):  # the reference runs no kernel: nothing to shape
        got = sparse_mla.decode(**kw, backend="reference", launch=launch)
        assert torch.equal(got[0].view(torch.int16), ref[0].view(torch.int16))


def test_sparse_mla_auto_with_a_gluon_launch_where_gluon_cannot_run():
    kw = sparse_mla.example_inputs(2, 4, 8, seed=11)
    if gluon.supports(kw["q"], kw["cache"]):
        pytest.skip("Gluon runs here: the GPU test below covers it")
    with pytest.raises(ValueError, match="^launch: a GluonLaunch runs the gluon backend"):
        sparse_mla.decode(**kw, launch=GluonLaunch())


@pytest.mark.gpu
def test_sparse_mla_gluon_launch_reaches_the_gluon_op():
    kw = sparse_mla.example_inputs(2, 20, 64, 16, seed=12)
    if not gluon.supports(kw["q"], kw["cache"], kw["extra_cache"]):
        pytest.skip("needs a Hopper GPU with Gluon")
    launch = GluonLaunch("plain", 2)
    for backend in ("gluon", "auto"):
        with Calls() as rec:
            sparse_mla.decode(**kw, backend=backend, launch=launch)
        assert [args[-2:] for op, args in rec.calls if op == "sparse_mla_decode_gluon"] == [launch.op_args()], backend
    with Calls() as rec:  # a SparseMlaLaunch makes auto run the Triton kernel, on Hopper too
        sparse_mla.decode(**kw, launch=dataclasses.replace(sparse_mla.default_launch(2, 20, 80, DEVICE), num_splits=2))
    assert [op for op, _ in rec.calls] == ["sparse_mla_decode"]


# ----------------------------------------------------------------------------------------------------
# backend="auto": what each op documents is what runs, on this device
# ----------------------------------------------------------------------------------------------------

OPS = ("fp8", "kv_cache", "rope", "sparse_mla", "indexer", "moe", "mhc", "compressor", "mtp")


def _with_backend():
    """(name, function) of every public function of every op that takes ``backend=``."""
    import importlib
    import inspect

    out = []
    for op in OPS:
        mod = importlib.import_module(f"dsv4ref.{op}")
        for name in getattr(mod, "__all__", ()):
            fn = getattr(mod, name)
            if inspect.isfunction(fn) and "backend" in inspect.signature(fn).parameters:
                out.append((f"{op}.{name}", fn))
    return out


def documented_auto(fn) -> list[str]:
    """The backends ``fn``'s docstring says ``"auto"`` picks, in the order it states them: ``"auto" (= "x")``,
    or ``(= "x" where it runs, else "y")``; a docstring that defers (``as in :func:`other```) is followed."""
    import inspect
    import re

    doc = inspect.getdoc(fn) or ""
    m = re.search(r'"auto"`{0,2} \(= ([^)]*)\)', doc)
    if m:
        return re.findall(r'"(\w+)"', m.group(1))
    other = re.search(r"as in :func:`(\w+)`", doc) or (re.search(r":func:`(\w+)`", doc) if "as in" in doc else None)
    if other is None:
        return []
    return documented_auto(getattr(importlib_module(fn), other.group(1)))


def importlib_module(fn):
    import importlib

    return importlib.import_module(fn.__module__.rsplit(".", 1)[0] if fn.__module__.count(".") > 1 else fn.__module__)


@pytest.mark.parametrize("name, fn", _with_backend(), ids=[n for n, _ in _with_backend()])
def test_every_backend_argument_documents_what_auto_picks(name, fn):
    picks = documented_auto(fn)
    assert picks, f'{name}: its docstring does not say what "auto" picks (write "auto" (= "triton"))'
    supported = set(importlib_module(fn).SUPPORTED_BACKENDS) | set(getattr(importlib_module(fn), "GPU_ONLY", ()))
    supported |= set(getattr(importlib_module(fn), "ROUTE_BACKENDS", ()))
    assert set(picks) <= supported, (name, picks)


def _runs(make, backend) -> list[str]:
    fn, args, kwargs = make()
    with Calls() as rec:
        fn(*args, **kwargs, backend=backend)
    return [op for op, _ in rec.calls]


def _moe_stage():
    d = moe.example_inputs(4, moe.TINY_MOE, seed=15)
    ids, w = moe.route(d["x"], d["gate_weight"], d["bias"], k=2, routed_scale=1.5)
    return moe.stage, (d["x"], ids, w), {}


AUTO = {  # the ops run here under "auto", with the public function whose docstring states the pick
    "moe.stage": (_moe_stage, moe.stage),
    "mhc.sinkhorn": (_mhc_sinkhorn, mhc.sinkhorn),
    "kv_cache.insert": (_kv, kv_cache.insert),
    "kv_cache.gather": (_gather, kv_cache.gather),
    "rope.apply_gptj": (_rope_gptj, rope.apply_gptj),
    "rope.qnorm_rope_kv_insert": (_rope_fused, rope.qnorm_rope_kv_insert),
    "sparse_mla.decode": (_sparse, sparse_mla.decode),
    "indexer.quantize_q": (_index_q, indexer.quantize_q),
    "compressor.compress": (_compress, compressor.compress),
}  # indexer.logits / quantize_k and fp8 launch their kernels without a custom op: nothing to record


@pytest.mark.parametrize("name", sorted(AUTO))
def test_auto_runs_what_the_docstring_says(name):
    """On this device, "auto" launches the custom ops of the backend its docstring names: the first pick
    where the op states a condition (sparse_mla: "gluon" where it runs), else the last."""
    make, fn = AUTO[name]
    picks = documented_auto(fn)
    pick = picks[0] if name != "sparse_mla.decode" or _gluon_runs() else picks[-1]
    ran = _runs(make, "auto")
    assert ran == _runs(make, pick), (name, pick, ran)
    assert ran, f"{name}: auto ran no kernel on this device"


def _gluon_runs() -> bool:
    kw = sparse_mla.example_inputs(2, 4, 8, 4, seed=5)
    return gluon.supports(kw["q"], kw["cache"], kw["extra_cache"])


def test_sparse_mla_auto_backend_on_this_device():
    kw = sparse_mla.example_inputs(2, 4, 8, 4, seed=13)
    want = "gluon" if gluon.available(DEVICE) else "triton"
    assert sparse_mla.auto_backend(kw["q"], kw["cache"], kw["extra_cache"]) == want
    assert sparse_mla.auto_backend(kw["q"], kw["cache"], kw["extra_cache"], SparseMlaLaunch(16, 16)) == "triton"


@pytest.mark.gpu
def test_sparse_mla_auto_is_gluon_on_hopper():
    if not gluon.available(DEVICE):
        pytest.skip("needs a Hopper GPU with Gluon")
    assert _runs(_sparse, "auto") == ["sparse_mla_decode_gluon"]
    big = torch.zeros(4 * kv_cache.page_bytes(16) + 8, dtype=torch.uint8, device=DEVICE)
    odd = big[8:].view(4, kv_cache.page_bytes(16))  # pages at 8-byte (not 16-byte) addresses: the Triton kernel
    kw = sparse_mla.example_inputs(2, 4, 8, seed=14)
    odd.copy_(kw["cache"])
    assert sparse_mla.auto_backend(kw["q"], odd) == "triton"
