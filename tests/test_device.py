import os
import pathlib
import subprocess
import sys

import pytest
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
    files = [*(ROOT / "dsv4ref").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    offenders = [
        str(p.relative_to(ROOT))
        for p in files
        if p.name != "device.py" and ("torch.cuda" in p.read_text() or "torch.xpu" in p.read_text())
    ]
    assert offenders == []


# ---- the Intel XPU branch, the seeds' target, with a mocked torch.xpu (no Intel GPU is lent here) ----------


class _Recorder:
    """Stands in for torch.Event / torch.accelerator.synchronize and remembers how it was used."""

    def __init__(self):
        self.events, self.syncs = [], []

    def event(self, enable_timing=False):
        rec = self

        class _Ev:
            def record(self):
                rec.events.append("record")

            def synchronize(self):
                rec.events.append("sync")

            def elapsed_time(self, other):
                return 1.5

        return _Ev()


def _no_cuda_event(*a, **k):
    raise AssertionError("torch.cuda.Event used: the device layer must not name a backend namespace")


def _xpu_machine(monkeypatch, xpu=True, cuda=False):
    monkeypatch.delenv("DSV4REF_DEVICE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: xpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)


def test_pick_order_xpu_first(monkeypatch):
    _xpu_machine(monkeypatch, xpu=True, cuda=True)
    assert device.pick().type == "xpu"
    _xpu_machine(monkeypatch, xpu=False, cuda=True)
    assert device.pick().type == "cuda"
    _xpu_machine(monkeypatch, xpu=False, cuda=False)
    assert device.pick().type == "cpu"


def test_env_xpu_override(monkeypatch):
    _xpu_machine(monkeypatch, xpu=True, cuda=True)
    monkeypatch.setenv("DSV4REF_DEVICE", "xpu")
    assert device.pick() == torch.device("xpu")
    monkeypatch.setenv("DSV4REF_DEVICE", "cpu")
    assert device.pick().type == "cpu"


def test_env_xpu_absent_is_a_clear_error(monkeypatch):
    _xpu_machine(monkeypatch, xpu=False, cuda=False)
    monkeypatch.setenv("DSV4REF_DEVICE", "xpu")
    with pytest.raises(RuntimeError, match="DSV4REF_DEVICE='xpu'.*no xpu device"):
        device.pick()


def test_timer_on_xpu_uses_generic_events(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(torch, "Event", rec.event)
    monkeypatch.setattr(torch.cuda, "Event", _no_cuda_event)
    with device.Timer(torch.device("xpu")) as t:
        pass
    assert rec.events == ["record", "record", "sync"] and t.ms == 1.5


def test_synchronize_on_xpu_goes_through_torch_accelerator(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda d=None: rec.syncs.append(d))
    monkeypatch.setattr(torch.cuda, "synchronize", _no_cuda_event)
    device.synchronize(torch.device("xpu"))
    assert rec.syncs == [torch.device("xpu")]
    device.synchronize(torch.device("cpu"))  # a no-op
    assert rec.syncs == [torch.device("xpu")]


def test_capture_graph_without_xpu_graphs_returns_none(monkeypatch):
    monkeypatch.delattr(torch.xpu, "XPUGraph", raising=False)
    assert device.capture_graph(lambda: None, torch.device("xpu")) is None
    assert device.capture_graph(lambda: None, torch.device("cpu")) is None
