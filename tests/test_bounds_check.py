"""The interpreter's out-of-bounds check (tests/bounds_check.py) catches what a GPU would fault on."""

import pytest
import torch
import triton
import triton.language as tl
from conftest import KERNEL_DEVICE

pytestmark = pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="checks the interpreter")


@pytest.fixture(autouse=True)
def _checked():
    """The check on for each test here, and off again after it unless the session turned it on."""
    import bounds_check

    was_on = bounds_check.installed()
    bounds_check.install()
    yield
    if not was_on:
        bounds_check.uninstall()


@triton.jit
def _copy(X, Y, n, EXTRA: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK) + EXTRA
    if MASKED:
        x = tl.load(X + offs, mask=offs < n, other=0.0)
        tl.store(Y + offs, x, mask=offs < n)
    else:
        x = tl.load(X + offs)
        tl.store(Y + tl.arange(0, BLOCK), x)


@triton.jit
def _add(X, n, EXTRA: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK) + EXTRA
    tl.atomic_add(X + offs, 1.0, mask=offs < n + EXTRA)


def test_in_bounds_and_masked_lanes_pass():
    x = torch.randn(10)
    y = torch.zeros(16)
    _copy[(1,)](x, y, 10, EXTRA=0, MASKED=True, BLOCK=16)  # lanes 10..15 are masked off: never checked
    assert torch.equal(y[:10], x)
    z = torch.zeros(16)
    _copy[(1,)](torch.arange(16.0), z, 16, EXTRA=0, MASKED=False, BLOCK=16)
    assert torch.equal(z, torch.arange(16.0))


@pytest.mark.parametrize("extra", [1, -1])
def test_unmasked_load_past_either_end_fails(extra):
    x, y = torch.randn(16), torch.zeros(16)
    with pytest.raises(Exception, match="OutOfBounds.*load: 1 enabled lane"):
        _copy[(1,)](x, y, 16, EXTRA=extra, MASKED=False, BLOCK=16)


def test_atomic_past_the_end_fails():
    x = torch.zeros(8)
    with pytest.raises(Exception, match="OutOfBounds.*atomic: 2 enabled lane"):
        _add[(1,)](x, 8, EXTRA=2, BLOCK=8)
