"""Kernels launch on their inputs' device: Triton launches on the current CUDA device, so every launcher runs under
``_args.device_guard`` of its inputs (a model split over GPUs calls attention with tensors on a device that is not
the current one), and Triton's scratch for in-kernel TMA descriptors comes from the current device."""

import contextlib

import pytest
import torch

import sparse_attn
from sparse_attn.kernels import _args
from sparse_attn.kernels.attn.entmax_decode import entmax_decode_fwd
from sparse_attn.kernels.rows.row_entmax import entmax_rows_bwd, entmax_rows_fwd, row_mode
from sparse_attn.kernels.rows.structured import isotonic_nonincreasing_rows, tv_prox_rows


def test_launches_on_makes_the_tensors_device_current(monkeypatch):
    """``launches_on``: the launcher runs inside ``torch.cuda.device`` of the chosen tensor's device when it is a GPU
    (here a stand-in records it), and with no device switch for CPU tensors."""
    entered = []

    @contextlib.contextmanager
    def fake_cuda_device(device):
        entered.append(("enter", device))
        yield
        entered.append(("exit", device))

    monkeypatch.setattr(torch.cuda, "device", fake_cuda_device)

    class OnGpu1:
        device = torch.device("cuda", 1)

    @_args.launches_on(lambda spec, *args, **kwargs: spec)
    def launcher(spec, scale=1.0):
        entered.append(("run", scale))
        return 7

    assert launcher(OnGpu1(), scale=2.0) == 7
    assert entered == [("enter", torch.device("cuda", 1)), ("run", 2.0), ("exit", torch.device("cuda", 1))]
    entered.clear()
    assert launcher(torch.zeros(1)) == 7 and entered == [("run", 1.0)]
    assert launcher.__name__ == "launcher"


def test_every_launcher_runs_under_the_guard_of_its_inputs(kernel_device, monkeypatch):
    """The forward, backward, decode, row-entmax, TV-prox, isotonic and dropout-mask launchers each enter the guard
    with their inputs' device."""
    seen = []
    guard = _args.device_guard

    def recording_guard(device):
        seen.append(torch.device(device).type)
        return guard(device)

    monkeypatch.setattr(_args, "device_guard", recording_guard)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen).to(kernel_device).requires_grad_() for _ in range(3))
    out = sparse_attn.entmax_attention(q, k, v, 1.5, is_causal=True, backend="triton")
    assert len(seen) == 1
    out.sum().backward()
    assert len(seen) == 2
    cache = torch.randn(2, 1, 8, 16, generator=gen).to(kernel_device)
    entmax_decode_fwd(q.detach()[:, :, :1], cache, cache, torch.tensor([8, 8], dtype=torch.int32,
                      device=kernel_device)[:1], 1.5, 0.25)
    assert len(seen) == 3
    x = torch.randn(3, 40, generator=gen).to(kernel_device)
    y = entmax_rows_fwd(x, 1.5, row_mode(1.5))
    entmax_rows_bwd(y, torch.ones_like(y), 1.5, row_mode(1.5))
    lengths = torch.full((3,), 40, dtype=torch.int32, device=kernel_device)
    tv_prox_rows(x, lengths, 0.1)
    isotonic_nonincreasing_rows(x.sort(dim=-1, descending=True).values, lengths)
    _args.dropout_keep_mask(0, 2, 4, 8, 0.5, kernel_device)
    assert seen == [torch.device(kernel_device).type] * 8


@pytest.mark.gpu
def test_inputs_on_a_gpu_that_is_not_current():
    """With two GPUs: attention (forward and backward) on tensors of ``cuda:1`` while ``cuda:0`` is current gives the
    results of the same call made with ``cuda:1`` current."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(1, 2, 256, 64, generator=gen, dtype=torch.float32).to(torch.bfloat16) for _ in range(3)]

    def run(current):
        with torch.cuda.device(current):
            q, k, v = (t.to("cuda:1").requires_grad_() for t in base)
            out = sparse_attn.entmax_attention(q, k, v, 1.5, is_causal=True, backend="triton")
            out.float().square().sum().backward()
            torch.cuda.synchronize(1)
            return [t.float().cpu() for t in (out, q.grad, k.grad, v.grad)]

    for a, b in zip(run(0), run(1)):
        assert torch.equal(a, b)
