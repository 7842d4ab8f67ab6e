"""The split forward (kernels/attn/_fwd_split.py: a threshold kernel, then a value kernel that knows tau) against the
float64 reference and the fused kernel, on the kernel device (the interpreter on CPU)."""

import pytest
import torch
from helpers import TOL

from sparse_attn.kernels.attn.entmax_attn_fwd import entmax_attn_fwd, entmax_attn_fwd_split
from sparse_attn.reference import entmax_attention_reference


def _inputs(dev, b=1, h=2, nq=80, nk=None, d=32, std=1.0, seed=0):
    """float32 ``q (b, h, nq, d)`` and ``k``, ``v (b, h, nk, d)``; scores of std about ``std**2``."""
    g = torch.Generator().manual_seed(seed)
    nk = nq if nk is None else nk
    qk = torch.randn(b, h, nq + nk, d, generator=g) * std
    return qk[:, :, :nq].to(dev), qk[:, :, nq:].to(dev), torch.randn(b, h, nk, d, generator=g).to(dev)


def _live_tiles(live: torch.Tensor) -> torch.Tensor:
    """Live key tiles per query tile of a bitmap ``(S, H, n_qt, words)``."""
    return sum(((live >> bit) & 1).long() for bit in range(32)).sum(-1)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 1.9])
@pytest.mark.parametrize("causal", [False, True])
def test_split_matches_the_reference(kernel_device, alpha, causal):
    q, k, v = _inputs(kernel_device, nq=64, nk=96, std=1.5, seed=3)
    scale = 32 ** -0.5
    a = torch.full((2,), alpha, device=kernel_device)
    res = entmax_attn_fwd_split(q, k, v, a, scale, is_causal=causal)
    out64 = entmax_attention_reference(q.double(), k.double(), v.double(), alpha, is_causal=causal, scale=scale)
    assert (res.out.double() - out64).abs().max().item() <= TOL["eps_attention_kernel"][torch.float32]
    fused = entmax_attn_fwd(q, k, v, a, scale, is_causal=causal, split=False)
    # the same support, valid keys and surviving tiles as the fused kernel; the threshold within the tolerance
    assert torch.equal(res.nnz, fused.nnz) and torch.equal(res.n_valid, fused.n_valid)
    assert torch.equal(res.live, fused.live)
    assert (res.tau - fused.tau).abs().max().item() <= TOL["tau"][torch.float32]
    assert (res.lsum - 1.0).abs().max().item() <= 1e-2
    # passes: max, bracket, refinements, value; visits: every tile once in the max pass
    assert (res.n_passes >= 3).all() and (res.tile_visits >= _live_tiles(res.live)).all()


def test_split_training_outputs_match_the_fused_kernel(kernel_device):
    """``out_u`` (the backward's delta) and the statistics, with sinks, ALiBi and a keep mask."""
    q, k, v = _inputs(kernel_device, nq=48, nk=72, seed=5)
    g = torch.Generator().manual_seed(1)
    keep = (torch.rand(1, 1, 48, 72, generator=g) > 0.3).to(kernel_device)
    keep[..., 7, :] = False
    kw = dict(bias=keep, need_out_u=True, sinks=torch.tensor([0.5, -1.0], device=kernel_device),
              alibi_slopes=torch.tensor([0.1, 0.05], device=kernel_device))
    for alpha in (1.5, 2.0, 1.3):
        a = torch.full((2,), alpha, device=kernel_device)
        got = entmax_attn_fwd_split(q, k, v, a, 32 ** -0.5, **kw)
        want = entmax_attn_fwd(q, k, v, a, 32 ** -0.5, split=False, **kw)
        for name in ("out", "out_u", "lsum"):
            assert (getattr(got, name) - getattr(want, name)).abs().max().item() <= 2e-5, (alpha, name)
        assert torch.equal(got.nnz, want.nnz) and torch.equal(got.n_valid, want.n_valid)
        assert torch.all(got.out[..., 7, :] == 0) and torch.all(got.tau[..., 7] == float("inf"))


def test_split_mixed_heads_and_varlen(kernel_device):
    """One alpha per head (every class launched over every head) on packed sequences."""
    q, k, v = _inputs(kernel_device, b=1, h=4, nq=90, seed=7)
    cu = torch.tensor([0, 37, 90], dtype=torch.int32, device=kernel_device)
    a = torch.tensor([1.0, 1.5, 2.0, 1.3], device=kernel_device)
    got = entmax_attn_fwd_split(q, k, v, a, 32 ** -0.5, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                alpha_class="mixed")
    want = entmax_attn_fwd(q, k, v, a, 32 ** -0.5, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                           alpha_class="mixed", split=False)
    assert (got.out - want.out).abs().max().item() <= 2e-5
    assert torch.equal(got.out[:, 0], want.out[:, 0])  # the softmax head: the fused kernel


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.3])
def test_split_finite_padding_masks_and_huge_scores(kernel_device, alpha):
    """Shift invariance: a finite ``finfo.min`` padding mask and scores offset by 1e4 give the outputs of the
    ``-inf`` mask and of the plain scores (every threshold quantity is relative to the row max)."""
    q, k, v = _inputs(kernel_device, nq=40, nk=56, seed=9)
    a = torch.full((2,), alpha, device=kernel_device)
    pad = torch.zeros(1, 1, 40, 56, device=kernel_device)
    pad[..., 40:] = torch.finfo(torch.float32).min
    inf_pad = torch.zeros_like(pad)
    inf_pad[..., 40:] = float("-inf")
    got = entmax_attn_fwd_split(q, k, v, a, 32 ** -0.5, bias=pad)
    want = entmax_attn_fwd_split(q, k, v, a, 32 ** -0.5, bias=inf_pad)
    assert not torch.isnan(got.out).any()
    assert (got.out - want.out).abs().max().item() <= 2e-5
    shifted = entmax_attn_fwd_split(q, k, v, a, 32 ** -0.5, bias=torch.full_like(pad, 1e4))
    out64 = entmax_attention_reference(q.double(), k.double(), v.double(), alpha, scale=32 ** -0.5)
    # scores near 1e4 carry float32's 1e-3 absolute rounding, which bounds the agreement
    assert (shifted.out.double() - out64).abs().max().item() <= 2e-2


@pytest.mark.parametrize("alpha", [1.5, 1.3])
def test_split_variants_match_the_fused_kernel(kernel_device, alpha):
    """The split forward on every variant at once (a sliding window, soft-capping, a block mask, dropout; causal), the
    general class included (fused by default): its outputs, statistics and bitmap as the fused kernel's."""
    q, k, v = _inputs(kernel_device, nq=64, nk=96, seed=11)
    g = torch.Generator().manual_seed(2)
    blocks = (torch.rand(1, 2, 4, 6, generator=g) > 0.3).to(kernel_device)
    kw = dict(is_causal=True, window_size=(40, 0), softcap=5.0, block_mask=(blocks, (16, 16)), dropout_p=0.2, seed=3,
              need_out_u=True)
    a = torch.full((2,), alpha, device=kernel_device)
    got = entmax_attn_fwd(q, k, v, a, 32 ** -0.5, split=True, **kw)
    want = entmax_attn_fwd(q, k, v, a, 32 ** -0.5, split=False, **kw)
    for name in ("out", "out_u", "lsum"):
        assert (getattr(got, name) - getattr(want, name)).abs().max().item() <= 2e-5, name
    fin = torch.isfinite(want.tau)
    assert torch.equal(fin, torch.isfinite(got.tau))
    assert (got.tau[fin] + got.tau_lo[fin] - want.tau[fin] - want.tau_lo[fin]).abs().max().item() <= TOL["tau"][
        torch.float32]
    assert torch.equal(got.nnz, want.nnz) and torch.equal(got.n_valid, want.n_valid)
    assert torch.equal(got.live, want.live)
