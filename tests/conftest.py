"""Test setup: run Triton kernels under the interpreter when there is no GPU, and poison memory.

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
    if os.environ.get("SPARSE_ATTN_INTERPRETER_PATCH_ONCE", "1") == "1":
        # triton.language swapped for the interpreter once per launch, not again at every inner @triton.jit call
        # (interpreter_patch_once.py: the same kernels, about half the interpreted time)
        from interpreter_patch_once import install as patch_once

        patch_once()
    if os.environ.get("SPARSE_ATTN_BOUNDS_CHECK", "0") == "1":
        # every interpreted load, store and atomic must stay inside its launch's tensor arguments (bounds_check.py)
        from bounds_check import install

        install()
    if os.environ.get("SPARSE_ATTN_EMULATE_GPU", "0") == "1":
        # the interpreter runs what a GPU launch runs: the GPU's tiles, the dQ kernel's TMA descriptors, up to 32
        # decode splits (a diagnosis mode; tests that count tiles or passes at the interpreter's tiles fail here)
        from bounds_check import emulate_gpu_launches

        emulate_gpu_launches()

# The device the Triton kernels run on in this session: a GPU when there is one,
# otherwise CPU tensors through the interpreter.
KERNEL_DEVICE = "cuda" if _HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    # the tests that must share one worker (``xdist_group``: the demo, the sparsify example) are long and run as one
    # unit: handed out first, so that with ``--dist loadgroup`` the other worker is not left idle while they finish
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kernel_device():
    return KERNEL_DEVICE


@pytest.fixture
def poison_uninitialized():
    """Every ``torch.empty``-like allocation in the test is filled with NaN (floats) or the dtype's max (ints).

    So an output element a kernel fails to write shows up as a mismatch, with no hook in the
    launchers. Uses torch's deterministic mode (``warn_only``: no op is refused) with
    ``torch.utils.deterministic.fill_uninitialized_memory``; both settings are restored afterwards.
    """
    import torch.utils.deterministic as det

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              det.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        det.fill_uninitialized_memory = before[2]


# Hypothesis profiles (tests/test_fuzz.py): "ci", the default, runs few examples, the same ones on every run,
# and writes nothing to .hypothesis/; HYPOTHESIS_PROFILE=dev runs more, random ones.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", max_examples=200, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
