"""Test setup: run Triton kernels under the interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before any module defining a ``@triton.jit``
kernel is imported, so it is set here, at collection time.
"""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Tests use tiny tensors: one thread per (xdist) worker avoids oversubscribing the cores.
    torch.set_num_threads(1)

# The device the Triton kernels run on in this session: a GPU when there is one,
# otherwise CPU tensors through the interpreter.
KERNEL_DEVICE = "cuda" if _HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kernel_device():
    return KERNEL_DEVICE


# Hypothesis profiles (tests/test_fuzz.py): "ci", the default, runs few examples, the same ones on every run,
# and writes nothing to .hypothesis/; HYPOTHESIS_PROFILE=dev runs more, random ones.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", max_examples=200, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
