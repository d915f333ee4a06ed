# Import dsv4ref before anything defines a Triton kernel: it picks the device and, on a CPU-only
# machine, switches Triton to its interpreter (which must happen before any @triton.jit).
import dsv4ref  # noqa: F401
import pytest
import torch

from dsv4ref.device import DEVICE, interpreting


@pytest.fixture
def device():
    return DEVICE


def interp_bug(reason: str):
    """Mark a test that demonstrates a Triton-interpreter bug: it must fail when interpreting
    (strict, so a Triton upgrade that fixes the bug turns red and we can drop the workaround)."""
    return pytest.mark.xfail(interpreting(), reason=reason, strict=True)


torch.set_printoptions(precision=6)
