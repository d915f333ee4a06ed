import os
import pathlib
import subprocess
import sys

import torch

import dsv4ref
from dsv4ref import device

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_pick_and_interpreter_agree():
    dev = device.pick()
    assert dev == dsv4ref.DEVICE
    assert device.interpreting() == (dev.type == "cpu")


def test_env_override_cpu():
    code = "import dsv4ref, os; print(dsv4ref.DEVICE.type, os.environ['TRITON_INTERPRET'])"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"DSV4REF_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["cpu", "1"]


def test_timer_and_synchronize():
    with device.Timer() as t:
        torch.ones(1000, device=dsv4ref.DEVICE).sum()
    device.synchronize()
    assert t.ms >= 0


def test_no_torch_cuda_outside_device_module():
    """The seed PR monkey-patched torch.cuda.Event to run on XPU; we keep backend namespaces in one file."""
    files = [*(ROOT / "dsv4ref").glob("*.py"), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.py")]
    offenders = [str(p.relative_to(ROOT)) for p in files
                 if p.name != "device.py" and ("torch.cuda" in p.read_text() or "torch.xpu" in p.read_text())]
    assert offenders == []
