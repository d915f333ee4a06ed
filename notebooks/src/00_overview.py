# %% [markdown]
# # 00 · Overview: one DeepSeek-V4 decode step, op by op
#
# This project rebuilds the **attention-decode building blocks of DeepSeek-V4** three times over:
#
# 1. a plain **PyTorch reference** you can check by eye,
# 2. a **Triton kernel**, the *same source* compiled on a GPU (CUDA or Intel XPU) and interpreted on a CPU,
# 3. **tests** that hold the kernel to the reference: byte-exact where a format is exact, with a stated
#    tolerance where it is not.
#
# The notebooks are the lessons; `dsv4ref/` is the library they call; `tests/` hold the kernels to account.
# Read them in order:
#
# | notebook | topic |
# |---|---|
# | 01 | UE8M0 FP8 quantisation and the 584-byte paged KV cache |
# | 02 | GPT-J RoPE and the fused Q-norm + RoPE + FP8 KV insert |
# | 03 | mHC hyper-connections: pre (Sinkhorn), post, fused post-pre, head |
# | 04 | sparse MLA decode with an attention sink |
# | 05 | the lightning indexer |
# | 06 | a whole decode step, composed from the above; the compressor |
# | 07 | the V4 MoE: routing, FP8 input staging, clamped-SwiGLU experts, combine |
# | 08 | the MTP draft layer and greedy speculative decoding |
#
# Every op lives in one folder of `dsv4ref/`, read top to bottom in the same order:
#
# | file | what it holds |
# |---|---|
# | `dsv4ref/<op>/__init__.py` | the public functions, with shapes, dtypes and return types in their docstrings |
# | `dsv4ref/<op>/reference.py` | plain torch: the whole op, the formula above the code — **read this first** |
# | `dsv4ref/<op>/kernels.py` | the Triton kernels (`@triton.jit`), each argument's shape and stride documented |
# | `dsv4ref/<op>/launch.py` | block sizes and warps as an explicit launch-config dataclass; custom-op registration |
# | `dsv4ref/formats.py` | every byte layout constant, once; `docs/formats.md` draws the byte maps |
# | `dsv4ref/tl/` | the interpreter-safe Triton helpers every kernel shares |
# | `dsv4ref/tools/` | the check / bench harness and the command line (tools import ops, never the reverse) |
#
# Experimenting in a notebook changes the file (JupyterLab autosaves outputs). To put one back as it was in
# git, run `git checkout notebooks/03_mhc_ops.ipynb` (any notebook name), or `git checkout notebooks/` for all.
#
# Everything runs on the device `dsv4ref` picks when it is imported (Intel XPU, then CUDA, then CPU; override
# with `DSV4REF_DEVICE=cpu|cuda|xpu`). On a CPU the Triton kernels run in Triton's **interpreter**, which is
# what CI has. Import `dsv4ref` *first*: it must switch Triton to the interpreter before any kernel is defined.

# %%
import warnings

warnings.filterwarnings("ignore")
import numpy as np

np.seterr(all="ignore")
import torch

from dsv4ref import config
from dsv4ref.device import DEVICE, describe, interpreting

# %%
# NBVAL_IGNORE_OUTPUT
# (this cell's output differs per machine, so nbval does not compare it)
print(describe())
print("Triton kernels interpreted on the CPU:", interpreting())

# %% [markdown]
# ## The configurations
#
# DeepSeek-V4-Flash and -Pro, and the **teaching config** used by the notebooks and CI. The teaching config
# keeps every *byte format* real — a 512-dim latent head (448 NoPE + 64 RoPE dims), FP8 blocks of 64, an
# indexer head of 128, four residual streams — and shrinks only the *sizes*, so a whole decode step runs in
# the interpreter in seconds.

# %%
keys = [
    "hidden_size",
    "num_layers",
    "num_heads",
    "head_dim",
    "rope_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "window",
    "index_heads",
    "index_head_dim",
    "index_topk",
    "hc_mult",
    "window_page",
    "c4_page",
    "c128_page",
]
cfgs = [config.FLASH, config.PRO, config.TINY]
print(f"{'':<16}" + "".join(f"{c.name:>20}" for c in cfgs))
for k in keys:
    print(f"{k:<16}" + "".join(f"{getattr(c, k):>20}" for c in cfgs))
print(f"{'nope_dim':<16}" + "".join(f"{c.nope_dim:>20}" for c in cfgs))
print(f"{'padded_heads':<16}" + "".join(f"{c.padded_heads:>20}" for c in cfgs))
print(f"{'ratios (first 6)':<16}" + "".join(f"{str(c.compress_ratios[:6]):>20}" for c in cfgs))

# %% [markdown]
# ## One decode step, as data flowing between ops
#
# For one layer of ratio `r` (0: window only; 4: compressed rows chosen by the indexer; 128: all compressed
# rows), with the teaching config's shapes (`T` tokens in the batch, one per request):

# %%
c = config.TINY
T = 4
steps = [
    (
        "mHC pre (notebook 03)",
        f"residual streams [{T}, {c.hc_mult}, {c.hidden_size}] bf16",
        f"x [{T}, {c.hidden_size}] bf16, post [{T}, {c.hc_mult}], comb [{T}, {c.hc_mult}, {c.hc_mult}]",
    ),
    (
        "RMSNorm + q/kv projections",
        f"x [{T}, {c.hidden_size}]",
        f"q [{T}, {c.num_heads}, {c.head_dim}] bf16, kv [{T}, {c.head_dim}] bf16",
    ),
    ("q-norm + RoPE + FP8 KV insert (02)", "q, kv, slot, pos", "q rotated in place; 584 B/token into the window cache"),
    ("compressor (r > 1)", "kv states of the last r tokens", "one compressed row every r tokens"),
    (
        "lightning indexer (r = 4; 05)",
        f"index q [{T}, {c.index_heads}, {c.index_head_dim}]",
        f"top-{c.index_topk} compressed ids [{T}, {c.index_topk}] int32",
    ),
    (
        "sparse MLA decode + sink (04)",
        "q, window ∪ compressed slots",
        f"o [{T}, {c.num_heads}, {c.head_dim}] bf16, lse [{T}, {c.num_heads}] fp32",
    ),
    (
        "inverse RoPE + grouped o-proj (02)",
        f"o [{T}, {c.num_heads}, {c.head_dim}]",
        f"[{T}, {c.o_groups}, {c.o_lora_rank}] -> [{T}, {c.hidden_size}]",
    ),
    ("mHC post / fused post-pre (03)", "attention output, streams", f"new streams [{T}, {c.hc_mult}, {c.hidden_size}]"),
]
for i, (op, src, dst) in enumerate(steps, 1):
    print(f"{i}. {op}\n     in : {src}\n     out: {dst}")

# %% [markdown]
# ## The FP8 byte format in one number
#
# A cached token is **584 bytes**: 448 e4m3 bytes (the NoPE dims), 128 bytes of bf16 RoPE dims, 7 power-of-two
# scale bytes and one pad byte — stored in two separate regions of its page. Pages are padded to a multiple of
# 576 bytes. Notebook 01 draws it byte by byte.

# %%
from dsv4ref import kv_cache

for B in (2, 16, 64, 256):
    print(f"page of {B:>3} tokens: {kv_cache.page_bytes(B):>7} bytes ({kv_cache.page_bytes(B) / B:.2f} per token)")

# %% [markdown]
# ## Why the interpreter needs care
#
# Triton's CPU interpreter stores bf16 and fp8 values as raw bits and has bugs that matter here: its
# `fp32 → fp8e4nv` cast misrounds (7.78 becomes 4.0; ties round up; no saturation), bf16 `tl.dot` multiplies
# bit patterns, `fp32 → bf16` truncates. Every kernel in `dsv4ref` goes through a handful of shared helpers in
# `dsv4ref/tl/` that are exact on every backend (see `docs/triton_interpreter.md`). Here is the
# fp8 encoder helper against torch's reference cast, on the values that break the raw cast:

# %%
import triton
import triton.language as tl

from dsv4ref.tl import e4m3_encode


@triton.jit
def encode_kernel(x_ptr, out_ptr, n, RAW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    y = x.to(tl.float8e4nv) if RAW else e4m3_encode(x)  # RAW: Triton's own cast
    tl.store(out_ptr + offs, y.to(tl.uint8, bitcast=True), mask=m)


x = torch.tensor([7.78, 126.24, 17.0, 0.001, 448.0, 464.0, 500.0, -0.0])
want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
out = torch.empty(len(x), dtype=torch.uint8, device=DEVICE)
encode_kernel[(1,)](x.to(DEVICE), out, len(x), RAW=False, BLOCK=8)
print("inputs            :", x.tolist())
print("torch (clamp+RNE) :", want.float().tolist())
print("dsv4ref e4m3_encode:", out.cpu().view(torch.float8_e4m3fn).float().tolist())
print("bytes identical   :", torch.equal(out.cpu(), want.view(torch.uint8)))

# %%
# NBVAL_IGNORE_OUTPUT
# Triton's own cast: wrong in the interpreter (CPU), right when compiled (GPU) - so nbval ignores this cell.
encode_kernel[(1,)](x.to(DEVICE), out, len(x), RAW=True, BLOCK=8)
print("raw tl cast       :", out.cpu().view(torch.float8_e4m3fn).float().tolist())

# %% [markdown]
# ## How to run and how this is tested
#
# * `make lab` opens these notebooks; `make test` runs `pytest` (unit tests in `tests/`) **and** `nbval` over
#   every notebook: each cell is re-run and its output must equal the stored output. That is why cells print
#   *verdicts* (PASS/FAIL, shapes, exact bytes) rather than error magnitudes, and why the few cells whose output
#   depends on the machine (device names, timings) carry `# NBVAL_IGNORE_OUTPUT`.
# * Stored outputs come from `make notebooks` (executes `notebooks/src/*.py` on the CPU), never from hand edits.
# * `python -m dsv4ref check` runs every kernel against its reference on this machine's device and prints a
#   table; `python -m dsv4ref bench` times them on a GPU against the device's measured copy bandwidth and
#   matmul rate.

# %%
from dsv4ref.tools.harness import run_checks

for r in run_checks("fp8"):  # the FP8 block quantiser's rows; `check kv_cache`, `check rope`, ... the others
    print(f"{r.op:<18} {r.shape:<22} {r.report.verdict()}")

# %% [markdown]
# ## One device layer: why there is no `torch.cuda` outside `dsv4ref/device.py`
#
# The upstream XPU change inherited an attention class whose `__init__` creates `torch.cuda.Event`s, which
# crash on an Intel GPU. Its workaround swapped the attribute for the duration of the parent's `__init__`:
#
# ```python
# _orig = torch.cuda.Event
# torch.cuda.Event = torch.xpu.Event      # every thread, every library in the process sees this
# try:
#     super().__init__(*args, **kwargs)
# finally:
#     torch.cuda.Event = _orig
# ```
#
# Two things break. Any *later* `torch.cuda.Event` (in `forward`, in a profiler) is the CUDA one again and
# crashes on XPU; and while the swap is in force, any other code in the process that means CUDA gets an XPU
# event. The cell below plays both out on stand-in namespaces (no GPU needed):

# %%
import types


def make_torch_like():
    def cuda_event(**kw):
        raise RuntimeError("CUDA event on a machine without CUDA")

    return types.SimpleNamespace(
        cuda=types.SimpleNamespace(Event=cuda_event), xpu=types.SimpleNamespace(Event=lambda **kw: "xpu-event")
    )


class Parent:  # stands in for the upstream attention class
    def __init__(self, t):
        self.t, self.ev = t, t.cuda.Event(enable_timing=True)

    def forward(self):
        return self.t.cuda.Event(enable_timing=True)  # created later, outside __init__


class SeedStyleXpu(Parent):
    def __init__(self, t):
        orig, t.cuda.Event = t.cuda.Event, t.xpu.Event  # the swap
        try:
            super().__init__(t)
        finally:
            t.cuda.Event = orig


t = make_torch_like()
layer = SeedStyleXpu(t)
print("event made in __init__:", layer.ev)
try:
    layer.forward()
except RuntimeError as e:
    print("event made in forward :", "RuntimeError:", e)

# %% [markdown]
# dsv4ref instead asks the device layer: `dsv4ref.device.Timer` records `torch.Event(enable_timing=True)`,
# which follows the current accelerator (XPU, CUDA, or none), and `dsv4ref.device.synchronize` calls
# `torch.accelerator.synchronize`. `tests/test_device.py` holds the XPU branch to this with a mocked
# `torch.xpu` (pick order, `DSV4REF_DEVICE=xpu`, events, synchronize, and the error when XPU is asked for but
# absent), and a test fails if any other file names `torch.cuda` or `torch.xpu`.

# %%
import inspect

from dsv4ref import device

src = inspect.getsource(device)
print("torch.cuda.Event in dsv4ref.device:", "torch.cuda.Event" in src.replace("no ``torch.cuda.Event``", ""))
print("Timer uses torch.Event            :", "torch.Event(enable_timing=True)" in inspect.getsource(device.Timer))
