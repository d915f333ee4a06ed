# Import dsv4ref before anything defines a Triton kernel: it picks the device and, on a CPU-only
# machine, switches Triton to its interpreter (which must happen before any @triton.jit).
import dsv4ref  # noqa: F401
import os as _os

import pytest
from hypothesis import HealthCheck, settings
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


# Property-based tests (hypothesis): a small, derandomised profile in `make test` (CI), a long one via
# `make test-long` (HYPOTHESIS_PROFILE=long).

settings.register_profile(
    "ci",
    max_examples=20,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=400,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(_os.environ.get("HYPOTHESIS_PROFILE", "ci"))
