"""The public entmax_attention and its reference backend (the oracle).

The reference is checked here against computations that do not share its code path:
SDPA at alpha = 1, and the float64 bisection of tests/helpers.py for alpha > 1; its float16 /
bfloat16 accuracy against PyTorch's own low-precision attention and a FlashAttention-style
pipeline; the non-finite policy; empty problems; the checks switch and host reads. The table of
bad arguments of every entry point is in tests/test_bad_arguments.py.
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import EXACT, F64, TOL, assert_close_to_ref, cu_seqlens, host_reads_outside, qkv, reference_entmax

import sparse_attn._validation as validation
import sparse_attn.attn._attn_autograd as autograd_mod
import sparse_attn.reference as reference_mod
from sparse_attn import BlockSparseMask, checks_enabled, set_checks
from sparse_attn.attention import entmax_attention
from sparse_attn.reference import causal_keep, entmax_attention_reference


@pytest.mark.parametrize("causal", [False, True])
def test_reference_alpha1_is_softmax_attention(causal):
    q, k, v = qkv(nq=7, nk=7)
    mask = torch.rand(2, 1, 7, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True
    out = entmax_attention(q, k, v, alpha=1.0, attn_mask=mask, is_causal=causal)
    full = mask & causal_keep(7, 7, "cpu") if causal else mask
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=full)
    torch.testing.assert_close(out, expected, atol=TOL["same_values"][F64], rtol=0)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0])
def test_reference_matches_bisection(alpha):
    q, k, v = qkv(hk=2, nq=5, nk=13)
    bias = torch.randn(1, 4, 5, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out, stats = entmax_attention(q, k, v, alpha, attn_mask=bias, enable_gqa=True, scale=0.7, return_stats=True)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    p = reference_entmax(0.7 * q @ kk.transpose(-1, -2) + bias, alpha)
    torch.testing.assert_close(out, p @ vv, atol=TOL["oracle_f64"], rtol=0)
    # support agrees away from ties (keys whose weight is below 1e-9 may fall either way)
    assert (stats.nnz >= (p > 1e-9).sum(-1)).all() and (stats.nnz <= (p > 0).sum(-1)).all()
    assert torch.equal(stats.n_valid, torch.full_like(stats.n_valid, 13))
    # tau reproduces the weights: p = [(alpha-1) s - tau]_+^(1/(alpha-1))
    s = 0.7 * q @ kk.transpose(-1, -2) + bias
    p_tau = torch.clamp((alpha - 1) * s - stats.tau[..., None], min=0) ** (1 / (alpha - 1))
    torch.testing.assert_close(p_tau, p, atol=TOL["oracle_f64"], rtol=0)


def test_reference_per_head_alpha_and_bottom_right_causal():
    q, k, v = qkv(hq=3, hk=3, nq=4, nk=9)
    alpha = torch.tensor([1.0, 1.5, 2.0], dtype=torch.float64)
    out = entmax_attention(q, k, v, alpha, is_causal=True)
    keep = causal_keep(4, 9, "cpu")
    assert keep[0].sum() == 6 and keep[-1].all()
    s = (q @ k.transpose(-1, -2)) * 8**-0.5
    s = s.masked_fill(~keep, float("-inf"))
    for h, a in enumerate([1.0, 1.5, 2.0]):
        p = torch.softmax(s[:, h], -1) if a == 1.0 else reference_entmax(s[:, h], a)
        torch.testing.assert_close(out[:, h], p @ v[:, h], atol=TOL["oracle_f64"], rtol=0)


def test_reference_varlen_equals_separate_calls():
    g = torch.Generator().manual_seed(3)
    lens_q = [3, 0, 5]
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 12], dtype=torch.int32)
    q = torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64)
    out = entmax_attention(q, k, v, 1.5, is_causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for s in range(3):
        if lens_q[s] == 0:
            continue
        qs = q[:, :, cu_q[s]:cu_q[s + 1]]
        ks, vs = k[:, :, cu_k[s]:cu_k[s + 1]], v[:, :, cu_k[s]:cu_k[s + 1]]
        torch.testing.assert_close(out[:, :, cu_q[s]:cu_q[s + 1]], entmax_attention(qs, ks, vs, 1.5, is_causal=True))


def test_reference_fully_masked_rows_give_zeros_and_zero_grads():
    q, k, v = qkv(nq=4, nk=5)
    q.requires_grad_(True)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    for alpha in (1.0, 1.5, 2.0, 1.3):
        out, stats = entmax_attention(q, k, v, alpha, attn_mask=mask, return_stats=True)
        assert torch.isfinite(out).all()
        assert (out[:, :, 2] == 0).all()
        assert (stats.nnz[:, :, 2] == 0).all() and torch.isinf(stats.tau[:, :, 2]).all()
        (g,) = torch.autograd.grad(out.sum(), q)
        assert torch.isfinite(g).all() and (g[:, :, 2] == 0).all()


def test_reference_gradcheck_inputs_alpha_and_bias():
    q, k, v = qkv(b=1, hq=2, hk=2, nq=3, nk=5, d=4)
    alpha = torch.tensor([1.3, 1.7], dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 1, 3, 5, dtype=torch.float64, requires_grad=True)
    for t in (q, k, v):
        t.requires_grad_(True)

    def fn(q, k, v, alpha, bias):
        return entmax_attention(q, k, v, alpha, attn_mask=bias, is_causal=True)

    assert torch.autograd.gradcheck(fn, (q, k, v, alpha, bias), **TOL["gradcheck"])
    # second order too (README: double backward on the reference), alpha included
    assert torch.autograd.gradgradcheck(lambda q, alpha: fn(q, k, v, alpha, bias), (q, alpha), **TOL["gradcheck"])


def test_transposed_layout_is_accepted():
    q, k, v = qkv()
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    torch.testing.assert_close(entmax_attention(qt, k, v), entmax_attention(q, k, v))


def test_backend_auto_on_cpu_uses_reference(monkeypatch):
    import sparse_attn.attn._attn_autograd as fused

    def fail(*args, **kwargs):
        raise AssertionError("backend='auto' on CPU tensors must not take the fused path")

    monkeypatch.setattr(fused, "fused_entmax_attention", fail)
    q, k, v = (t.float() for t in qkv())
    out = entmax_attention(q, k, v, backend="auto")
    torch.testing.assert_close(out, entmax_attention(q, k, v, backend="reference"), **EXACT)
    assert out.dtype == torch.float32


def test_backend_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (t.float() for t in qkv(d=16))
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        entmax_attention(q, k, v, backend="triton")


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 1.3])
def test_reference_without_keys_gives_zeros_and_gradients(alpha):
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 0, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 0, 8, dtype=torch.float64, requires_grad=True)
    out, stats = entmax_attention(q, k, v, alpha, return_stats=True)
    assert out.shape == (1, 2, 4, 8) and (out == 0).all()
    assert (stats.nnz == 0).all() and (stats.n_valid == 0).all() and torch.isinf(stats.tau).all()
    out.sum().backward()
    assert (q.grad == 0).all()
    # packed sequences that all have no keys
    q1 = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([0, 0, 0], dtype=torch.int32)
    out = entmax_attention(q1, k, v, alpha, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out.sum().backward()
    assert (out == 0).all() and (q1.grad == 0).all()


def test_reference_softmax_support_counts_every_valid_key():
    q, k, v = qkv(hq=2, hk=2, nq=3, nk=6)
    q = q * 60  # exp underflows for most keys, yet softmax gives each of them a positive weight
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[:, 4:] = False
    alpha = torch.tensor([1.0, 2.0], dtype=torch.float64)
    _, stats = entmax_attention(q, k, v, alpha, attn_mask=mask, return_stats=True)
    assert (stats.nnz[:, 0] == 4).all() and (stats.n_valid == 4).all()
    assert (stats.nnz[:, 1] < 4).any()


def test_alpha_tensor_dtype_and_shape_variants():
    q, k, v = qkv(hq=4, hk=4)
    base = entmax_attention(q, k, v, 1.5)
    for alpha in (torch.tensor(1.5), torch.tensor([1.5]), torch.full((4,), 1.5, dtype=torch.float16)):
        torch.testing.assert_close(entmax_attention(q, k, v, alpha), base)


def _bisect_tau(s: torch.Tensor, alpha: float) -> torch.Tensor:
    """Float64 entmax threshold (z-scale) of each row by bisection; logsumexp at alpha = 1."""
    if alpha == 1.0:
        return torch.logsumexp(s, -1, keepdim=True)
    z = (alpha - 1) * s
    lo, hi = z.amax(-1, keepdim=True) - 1, z.amax(-1, keepdim=True)
    for _ in range(200):
        mid = (lo + hi) / 2
        big = (torch.clamp(z - mid, min=0) ** (1 / (alpha - 1))).sum(-1, keepdim=True) > 1
        lo, hi = torch.where(big, mid, lo), torch.where(big, hi, mid)
    return lo


def _weights_from_tau(s: torch.Tensor, tau: torch.Tensor, alpha: float) -> torch.Tensor:
    if alpha == 1.0:
        return torch.exp(s - tau)
    return torch.clamp((alpha - 1) * s - tau, min=0) ** (1 / (alpha - 1))


def _flash_style(q, k, v, alpha, bias, scale):
    """FlashAttention-style low-precision pipeline: float32 scores of the low-precision inputs, the
    exact float64 threshold rounded to float32, weights rounded to the input dtype before the value
    product (accumulated in float32), output rounded to the input dtype."""
    s64 = q.double() @ k.double().transpose(-1, -2) * scale + bias.double()
    s32 = q.float() @ k.float().transpose(-1, -2) * scale + bias.float()
    p = _weights_from_tau(s32, _bisect_tau(s64, alpha).float(), alpha)
    return (p.to(q.dtype).float() @ v.float()).to(q.dtype)


def _lowp_case(case, dtype, gen):
    """Inputs rounded to ``dtype``: Gaussian, large magnitude (fp16 scores would overflow), ALiBi-like bias ~40."""
    b, h, n, d = 2, 2, 48, 16
    mult = 100.0 if case == "large" else 1.0
    q, k, v = ((torch.randn(b, h, n, d, generator=gen) * (mult if i < 2 else 1.0)).to(dtype) for i in range(3))
    bias = torch.zeros(1, 1, n, n, dtype=dtype)
    if case == "large":
        assert (q.float() @ k.float().transpose(-1, -2)).abs().max() > torch.finfo(torch.float16).max
    if case == "alibi40":
        dist = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs().float()
        bias = (-40.0 * dist / (n - 1)).to(dtype).expand(1, h, n, n)
    return q, k, v, bias


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["gauss", "large", "alibi40"])
@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0])
def test_reference_low_precision_within_twice_the_low_precision_baseline(dtype, case, alpha):
    """err(reference in dtype) <= 2 err(baseline) + eps, both against float64 on the same rounded inputs.

    Baseline at alpha = 1: PyTorch's own SDPA on the low-precision CPU tensors; otherwise the
    FlashAttention-style pipeline above. The float64 oracle is SDPA / bisection in float64."""
    gen = torch.Generator().manual_seed(hash((case, str(dtype), alpha)) % 2**31)
    q, k, v, bias = _lowp_case(case, dtype, gen)
    scale = q.shape[-1] ** -0.5
    s64 = q.double() @ k.double().transpose(-1, -2) * scale + bias.double()
    if alpha == 1.0:
        exact = torch.softmax(s64, -1) @ v.double()
        base = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    else:
        p64 = _weights_from_tau(s64, _bisect_tau(s64, alpha), alpha)
        exact = (p64 / p64.sum(-1, keepdim=True)) @ v.double()
        base = _flash_style(q, k, v, alpha, bias, scale)
    out = entmax_attention(q, k, v, alpha, attn_mask=bias)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert_close_to_ref(out, exact, base, dtype, eps=TOL["eps_attention_lowp"][dtype])


def test_reference_computes_in_float32_and_float64_on_request():
    q, k, v = qkv(dtype=torch.float32, seed=4)
    exact, st64 = entmax_attention_reference(q.double(), k.double(), v.double(), 1.3, return_stats=True)
    out32, st32 = entmax_attention_reference(q, k, v, 1.3, return_stats=True)
    out64, st = entmax_attention_reference(q, k, v, 1.3, return_stats=True, compute_dtype=torch.float64)
    assert out32.dtype == out64.dtype == torch.float32
    assert st32.tau.dtype == torch.float32 and st.tau.dtype == torch.float64
    torch.testing.assert_close(out64, exact.float(), **EXACT)
    assert (out32.double() - exact).abs().max() < 1e-5
    torch.testing.assert_close(st.tau, st64.tau, atol=TOL["same_values"][F64], rtol=0)
    half = entmax_attention_reference(q.half(), k.half(), v.half(), 1.3, return_stats=True)[1]
    assert half.tau.dtype == torch.float32


def test_reference_ignores_autocast():
    q, k, v = qkv(dtype=torch.float32, seed=5)
    plain = entmax_attention(q, k, v, 1.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = entmax_attention(q, k, v, 1.5)
    assert auto.dtype == torch.float32
    torch.testing.assert_close(auto, plain, **EXACT)


def _nan_case(source):
    """float64 inputs with one non-finite entry; returns (q, k, v, mask, bad rows (B, H, Nq), clean inputs)."""
    q, k, v = qkv(b=2, hq=2, hk=2, nq=5, nk=6, seed=6)
    mask = torch.zeros(5, 6, dtype=torch.float64)
    mask[:2, 4] = float("-inf")
    bad = torch.zeros(2, 2, 5, dtype=torch.bool)
    clean = [t.clone() for t in (q, k, v, mask)]
    if source == "q":
        q[1, 0, 3, 2] = float("nan")
        bad[1, 0, 3] = True
    elif source in ("mask_nan", "mask_posinf"):
        mask[3, 1] = float("nan") if source == "mask_nan" else float("inf")
        bad[:, :, 3] = True
    elif source == "k":
        mask = mask == 0  # a keep mask: rows 0 and 1 exclude key 4, so its NaN does not reach them
        clean[3] = mask
        k[0, 1, 4, 0] = float("nan")
        bad[0, 1, 2:] = True
    return q, k, v, mask, bad, clean


@pytest.mark.parametrize("alpha", [1.0, 1.3, 1.5, 2.0])
@pytest.mark.parametrize("source", ["q", "k", "mask_nan", "mask_posinf"])
def test_reference_nonfinite_scores_give_nan_rows(alpha, source):
    """NaN / +inf among a row's scores (from q, k or the float mask): that row NaN (and its q gradient),
    the other rows as if the entry were finite; -inf mask entries stay excluded."""
    q, k, v, mask, bad, clean = _nan_case(source)
    q.requires_grad_(True)
    out, stats = entmax_attention(q, k, v, alpha, attn_mask=mask, return_stats=True)
    ref, ref_stats = entmax_attention(*clean[:3], alpha, attn_mask=clean[3], return_stats=True)
    assert torch.isnan(out[bad]).all()
    torch.testing.assert_close(out[~bad], ref[~bad], **EXACT)
    assert torch.isnan(stats.tau[bad]).all() and (stats.nnz[bad] == 0).all()
    assert torch.equal(stats.n_valid, ref_stats.n_valid)
    assert torch.equal(stats.nnz[~bad], ref_stats.nnz[~bad])
    out.sum().backward()
    assert torch.isnan(q.grad[bad]).all()
    if source != "k":  # a NaN key reaches every dq through dS @ k (0 * NaN)
        assert torch.isfinite(q.grad[~bad]).all()


def test_reference_float_mask_minus_inf_is_exclusion_and_empty_rows_are_zero():
    q, k, v = qkv(b=1, hq=2, hk=2, nq=4, nk=5, seed=7)
    keep = torch.rand(4, 5, generator=torch.Generator().manual_seed(8)) > 0.4
    keep[2] = False
    bias = torch.zeros(4, 5, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    q.requires_grad_(True)
    for alpha in (1.0, 1.5, 2.0, 1.3):
        out_b = entmax_attention(q, k, v, alpha, attn_mask=bias)
        torch.testing.assert_close(out_b, entmax_attention(q, k, v, alpha, attn_mask=keep), **EXACT)
        assert (out_b[:, :, 2] == 0).all()
        (g,) = torch.autograd.grad(out_b.sum(), q)
        assert torch.isfinite(g).all() and (g[:, :, 2] == 0).all()


def test_reference_nonfinite_value_reaches_every_row_of_the_dense_product():
    q, k, v = qkv(b=1, hq=1, hk=1, nq=3, nk=4, seed=9)
    v[0, 0, 1, 0] = float("nan")
    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[0, 1] = False
    out = entmax_attention(q, k, v, 2.0, attn_mask=keep)
    assert torch.isnan(out[0, 0, :, 0]).all() and torch.isfinite(out[0, 0, :, 1:]).all()


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_low_precision_mask_gradient_is_summed_in_float32(packed, dtype):
    """A per-row float mask has gradient 0 (each row of dS sums to 0): summed in float32 it stays at float32
    noise, packed sequences or not (found by tests/test_fuzz.py)."""
    q, k, v = qkv(b=1, hq=4, hk=4, nq=48, nk=48, d=16, dtype=dtype, seed=3)
    bias = torch.randn(1, 1, 48, 1, generator=torch.Generator().manual_seed(4)).to(dtype)
    cot = torch.randn(1, 4, 48, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    kw = dict(cu_seqlens_q=cu_seqlens([20, 28]), cu_seqlens_k=cu_seqlens([30, 18])) if packed else {}
    grads = []
    for dt in (dtype, torch.float64):
        b = bias.to(dt, copy=True).requires_grad_()
        entmax_attention(q.to(dt), k.to(dt), v.to(dt), 1.5, attn_mask=b, **kw).backward(cot.to(dt))
        grads.append(b.grad)
    assert_close_to_ref(grads[0], grads[1], eps=TOL["eps_attention_grad"][torch.float32], name="d attn_mask")


@pytest.mark.parametrize("alpha", [1.0, 1.3, 1.5, 2.0])
@pytest.mark.parametrize("source", ["q", "k"])
def test_triton_nonfinite_scores_give_nan_rows(alpha, source, kernel_device):
    """The fused path follows the non-finite policy like the reference (found by tests/test_fuzz.py)."""
    q, k, v = qkv(b=1, hq=2, hk=2, nq=5, nk=6, d=16, dtype=torch.float32, seed=16)
    bad = torch.zeros(1, 2, 5, dtype=torch.bool)
    if source == "q":
        q[0, 0, 1, 3] = float("nan")
        bad[0, 0, 1] = True
    else:
        k[0, 0, 2, 5] = float("nan")
        bad[0, 0] = True
    out = entmax_attention(*(t.to(kernel_device) for t in (q, k, v)), alpha, backend="triton").cpu()
    ref = entmax_attention(q, k, v, alpha, backend="reference")
    assert torch.isnan(ref[bad]).all() and torch.isfinite(ref[~bad]).all()
    assert torch.isnan(out[bad]).all(), "rows with a NaN score must be NaN"
    tol = TOL["fused_vs_reference_f32"]["out"]
    torch.testing.assert_close(out[~bad], ref[~bad], atol=tol, rtol=tol)


@pytest.mark.parametrize("alpha", [1.0, 1.3, 1.5, 2.0])
def test_triton_bool_masked_nan_key_is_excluded(alpha, kernel_device):
    q, k, v = qkv(b=1, hq=2, hk=2, nq=5, nk=6, d=16, dtype=torch.float32, seed=17)
    k[0, 0, 2, 5] = float("nan")
    keep = torch.ones(5, 6, dtype=torch.bool)
    keep[:, 2] = False
    out = entmax_attention(*(t.to(kernel_device) for t in (q, k, v)), alpha, attn_mask=keep.to(kernel_device),
                           backend="triton").cpu()
    ref = entmax_attention(q, k, v, alpha, attn_mask=keep, backend="reference")
    assert torch.isfinite(ref).all()
    tol = TOL["fused_vs_reference_f32"]["out"]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("alpha", [1.0, 1.3, 1.5, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_large_scores_match_float64(alpha, dtype, kernel_device):
    """Inputs of magnitude 1e4 (scores ~1e8, computed in float32) against float64 (the tolerance rule,
    tests/helpers.py)."""
    q, k, v = qkv(b=1, hq=1, hk=1, nq=20, nk=36, d=24, dtype=torch.float32, seed=18)
    q, k, v = (q * 1e4).to(dtype), (k * 1e4).to(dtype), v.to(dtype)
    out = entmax_attention(*(t.to(kernel_device) for t in (q, k, v)), alpha, is_causal=True, backend="triton").cpu()
    ref64 = entmax_attention(q.double(), k.double(), v.double(), alpha, is_causal=True)
    lowp = entmax_attention(q, k, v, alpha, is_causal=True, backend="reference")
    assert_close_to_ref(out, ref64, lowp, eps=TOL["eps_attention_kernel"][dtype])


@pytest.fixture
def device_like(monkeypatch):
    """Treat CPU tensors like device tensors: their values are read only with set_checks(True)."""
    monkeypatch.setattr(validation, "_FREE_READ_DEVICES", frozenset())
    previous = set_checks(False)
    yield
    set_checks(previous)


def test_unchecked_out_of_range_alpha_gives_nan_heads(device_like):
    q, k, v = qkv(seed=10)
    q.requires_grad_(True)
    alpha = torch.tensor([1.5, float("nan"), 2.5, 1.2], dtype=torch.float64, requires_grad=True)
    out = entmax_attention(q, k, v, alpha)
    good = torch.tensor([True, False, False, True])
    ref = entmax_attention(q, k, v, torch.tensor([1.5, 1.5, 1.5, 1.2], dtype=torch.float64))
    assert torch.isnan(out[:, ~good]).all()
    torch.testing.assert_close(out[:, good], ref[:, good], **EXACT)
    out.sum().backward()
    assert torch.isnan(alpha.grad[~good]).all() and torch.isfinite(alpha.grad[good]).all()
    assert torch.isnan(q.grad[:, ~good]).all() and torch.isfinite(q.grad[:, good]).all()
    set_checks(True)
    with pytest.raises(ValueError, match=r"alpha must be finite and in \[1, 2\]"):
        entmax_attention(q, k, v, alpha)


def test_set_checks_switch_and_environment():
    previous = set_checks(True)
    try:
        assert checks_enabled() is True
        assert set_checks(False) is True and checks_enabled() is False
    finally:
        set_checks(previous)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        set_checks(1)
    code = "import sparse_attn; print(sparse_attn.checks_enabled())"
    for value, expected in (("1", "True"), ("0", "False"), ("", "False")):
        env = {**os.environ, "SPARSE_ATTN_CHECKS": value}
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert res.stdout.strip() == expected


def _fused_inputs(seed=11):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 20, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 20, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 20, 16, generator=g, requires_grad=True)
    return q, k, v


def _calls_reading_device_values():
    """Calls whose argument checks would read tensor values: tensor alpha, float / bool mask, varlen."""
    q, k, v = _fused_inputs()
    alpha = torch.tensor([1.3, 1.8], requires_grad=True)
    bias = torch.randn(1, 1, 20, 20)
    keep = torch.rand(20, 20, generator=torch.Generator().manual_seed(1)) > 0.3
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13, max_seqlen_k=13)
    return [
        lambda: entmax_attention(q, k, v, alpha, backend="triton"),
        lambda: entmax_attention(q, k, v, 1.5, attn_mask=bias, backend="triton"),
        lambda: entmax_attention(q, k, v, 1.5, attn_mask=keep, backend="triton"),
        lambda: entmax_attention(q, k, v, alpha, is_causal=True, backend="triton", **varlen),
        lambda: entmax_attention(q, k, v, alpha, attn_mask=bias, backend="reference"),
    ]


@pytest.mark.parametrize("call", range(5))
def test_device_tensors_are_not_read_back_without_the_switch(device_like, monkeypatch, call):
    """CPU stand-in for the CUDA sync test: with device-like tensors, no argument check reads a value
    (host reads happen only inside the kernel op under the interpreter or the row mapping's own checks)."""
    owner, name = (reference_mod, "entmax") if call == 4 else (autograd_mod, "_fwd_op")
    fn = _calls_reading_device_values()[call]
    assert host_reads_outside(monkeypatch, owner, name, lambda: fn().sum().backward()) == []
    set_checks(True)
    # masks are never value-checked (a NaN / +inf in a float mask gives NaN rows): only alpha and varlen are
    assert host_reads_outside(monkeypatch, owner, name, fn) != [] or call in (1, 2)


@pytest.mark.gpu
def test_cuda_calls_do_not_synchronize():
    """Tensor alpha, float mask, bool mask and varlen with max_seqlen: no host sync on CUDA (forward)."""
    q, k, v = (t.detach().cuda().half() for t in _fused_inputs())
    alpha = torch.tensor([1.3, 1.8], device="cuda")
    bias = torch.randn(1, 1, 20, 20, device="cuda", dtype=torch.float16)
    keep = torch.rand(20, 20, device="cuda") > 0.3
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device="cuda")
    calls = [
        lambda: entmax_attention(q, k, v, alpha),
        lambda: entmax_attention(q, k, v, 1.5, attn_mask=bias),
        lambda: entmax_attention(q, k, v, alpha, attn_mask=keep),
        lambda: entmax_attention(q, k, v, alpha, is_causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                 max_seqlen_q=13, max_seqlen_k=13),
    ]
    for fn in calls:
        fn()  # compiles the kernels outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for fn in calls:
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)


EMPTY = {
    "batch0": (0, 2, 2, 3, 4, 16, 16),
    "heads0": (1, 0, 0, 3, 4, 16, 16),
    "nq0": (1, 2, 1, 0, 4, 16, 16),
    "nk0": (1, 2, 2, 3, 0, 16, 16),
    "all0": (0, 0, 0, 0, 0, 16, 16),
    "headdim0_dv0": (1, 2, 2, 3, 4, 0, 0),
}


@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
@pytest.mark.parametrize("name", list(EMPTY))
@pytest.mark.parametrize("alpha", [1.5, "tensor"])
def test_empty_problems_give_empty_or_zero_outputs_and_gradients(backend, name, alpha):
    b, hq, hk, nq, nk, d, dv = EMPTY[name]
    if backend == "triton" and d == 0:
        pytest.skip("head dim 0 is not a triton problem (checked in the bad-argument table)")
    q = torch.randn(b, hq, nq, d, requires_grad=True)
    k = torch.randn(b, hk, nk, d, requires_grad=True)
    v = torch.randn(b, hk, nk, dv, requires_grad=True)
    a = torch.full((hq,), 1.5, requires_grad=True) if alpha == "tensor" else alpha
    out, stats = entmax_attention(q, k, v, a, return_stats=True, enable_gqa=True, is_causal=True, backend=backend)
    assert out.shape == (b, hq, nq, dv) and out.dtype == q.dtype and (out == 0).all()
    assert stats.nnz.shape == stats.tau.shape == stats.n_valid.shape == (b, hq, nq)
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all()


def test_head_dim_zero_attends_uniformly():
    v = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    q, k = torch.zeros(2, 3, 6, 0, dtype=torch.float64), torch.zeros(2, 3, 5, 0, dtype=torch.float64)
    for alpha in (1.0, 1.5, 2.0):
        out = entmax_attention(q, k, v, alpha)
        torch.testing.assert_close(out, v.mean(2, keepdim=True).expand(2, 3, 6, 4))


def test_reference_returns_weights():
    q, k, v = qkv(hq=4, hk=2, nq=5, nk=13, seed=12)
    bias = torch.randn(1, 4, 5, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out, w, stats = entmax_attention_reference(q, k, v, 1.5, attn_mask=bias, scale=0.7, return_weights=True,
                                               return_stats=True)
    kk = k.repeat_interleave(2, 1)
    p = reference_entmax(0.7 * q @ kk.transpose(-1, -2) + bias, 1.5)
    assert w.shape == (2, 4, 5, 13) and w.dtype == torch.float64
    torch.testing.assert_close(w, p, atol=TOL["oracle_f64"], rtol=0)
    torch.testing.assert_close(out, w @ v.repeat_interleave(2, 1))
    assert torch.equal(stats.nnz, (w > 0).sum(-1, dtype=torch.int32))
    keep = torch.rand(2, 4, 5, 13, generator=torch.Generator().manual_seed(3)) > 0.5
    out_d, w_d = entmax_attention_reference(q, k, v, 1.5, attn_mask=bias, scale=0.7, dropout_p=0.5,
                                            dropout_mask=keep, return_weights=True)
    torch.testing.assert_close(w_d, w, **EXACT)
    torch.testing.assert_close(out_d, (w * keep / 0.5) @ v.repeat_interleave(2, 1))
    half = entmax_attention_reference(q.half(), k.half(), v.half(), 1.5, return_weights=True)[1]
    assert half.dtype == torch.float16


def test_reference_varlen_weights_are_block_diagonal():
    cu_q, cu_k = torch.tensor([0, 3, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 6, 12], dtype=torch.int32)
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (8, 12, 12))
    out, w = entmax_attention_reference(q, k, v, 1.5, is_causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                        return_weights=True)
    torch.testing.assert_close(out, w @ v)
    outside = torch.ones(8, 12, dtype=torch.bool)
    for s in range(3):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        outside[q0:q1, k0:k1] = False
        _, ws = entmax_attention_reference(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], 1.5, is_causal=True,
                                           return_weights=True)
        torch.testing.assert_close(w[:, :, q0:q1, k0:k1], ws)
    assert (w[:, :, outside] == 0).all()


def test_reference_accepts_grouped_heads_without_the_flag():
    q, k, v = qkv(hq=4, hk=2, seed=14)
    torch.testing.assert_close(entmax_attention_reference(q, k, v), entmax_attention(q, k, v, enable_gqa=True))


def test_max_seqlen_upper_bound_gives_the_same_result(kernel_device):
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g).to(kernel_device) for _ in range(3))
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=kernel_device)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, is_causal=True, backend="triton")
    torch.testing.assert_close(entmax_attention(q, k, v, **kw, max_seqlen_q=40, max_seqlen_k=13),
                               entmax_attention(q, k, v, **kw), **EXACT)
    # past the packed length (20) a bound sizes nothing more: 2**40 once sized the kernels' grids by it
    torch.testing.assert_close(entmax_attention(q, k, v, **kw, max_seqlen_q=2**40, max_seqlen_k=2**40),
                               entmax_attention(q, k, v, **kw), **EXACT)
    # a block mask built for such a bound keeps the blocks the packed length reaches
    grid = torch.rand(2, 2, 3, 3, generator=g) > 0.3
    grid[..., 0] = True
    big = BlockSparseMask(grid.to(kernel_device), 16)
    small = BlockSparseMask(grid[:, :, :2, :2].to(kernel_device), 16)
    torch.testing.assert_close(entmax_attention(q, k, v, **kw, max_seqlen_q=40, max_seqlen_k=40, block_mask=big),
                               entmax_attention(q, k, v, **kw, max_seqlen_q=20, max_seqlen_k=20, block_mask=small),
                               **EXACT)


def test_custom_op_boundary_by_name():
    """The forward custom op's arguments are the spec's fields (and the seed), named once: its schema lists them,
    flattening a prepared spec and naming the arguments again round-trips every field, and the differentiable ones
    are op arguments."""
    from sparse_attn.attn.attn_inputs import AttnSpec, prepare_attention

    fields = autograd_mod.FWD_FIELDS
    assert fields == tuple(f.name for f in dataclasses.fields(AttnSpec)) + ("seed",)
    assert tuple(a.name for a in autograd_mod._fwd_op._opoverload._schema.arguments) == fields
    assert set(autograd_mod.DIFFERENTIABLE) <= set(fields)
    q, k, v = (torch.randn(1, 2, 6, 16) for _ in range(3))
    mask, slopes, sinks = torch.randn(6, 6), torch.rand(2), torch.zeros(2)
    inputs = prepare_attention(q, k, v, 1.5, attn_mask=mask, is_causal=True, window_size=(3, 1),
                               alibi_slopes=slopes, sinks=sinks, softcap=4.0, dropout_p=0.1, backend="reference")
    named = autograd_mod.fwd_op_named(autograd_mod.spec_to_op_args(dataclasses.replace(inputs, need_grad=True),
                                                                   seed=7))
    assert named["mask"] is mask and named["alibi_slopes"] is inputs.alibi_slopes and named["sinks"] is inputs.sinks
    assert (named["window_size"], named["softcap"], named["dropout_p"], named["seed"]) == ([3, 1], 4.0, 0.1, 7)
    assert (named["q"], named["k"], named["v"]) == (q, k, v) and named["alpha_class"] == "entmax15"
    assert named["need_grad"] is True
    with pytest.raises(ValueError):
        autograd_mod.fwd_op_named(tuple(named.values())[:-1])


META_ALPHAS = [1.0, 1.3, 1.5, 2.0, "per-head tensor", "per-head cpu tensor"]


@pytest.mark.parametrize("alpha", META_ALPHAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_meta_tensors_give_the_shapes_and_dtypes_of_a_real_call(alpha, dtype):
    """Shape inference: on meta tensors every alpha (a general alpha too, whose solver reads values on a real
    device), masks, GQA and ``Dv != D`` give the outputs, statistics and gradients of the CPU call's shapes and
    dtypes, with no value read."""
    def call(device):
        q, k, v = qkv(b=2, hq=4, hk=2, nq=9, nk=11, d=16, dv=24, dtype=dtype, requires_grad=True)
        a = torch.tensor([1.0, 1.3, 1.5, 2.0]) if isinstance(alpha, str) else alpha
        a = a.to(device) if isinstance(a, torch.Tensor) and "cpu" not in alpha else a
        q, k, v = (t.detach().to(device).requires_grad_() for t in (q, k, v))
        mask = torch.ones(9, 11, dtype=torch.bool, device=device)
        out, stats = entmax_attention(q, k, v, a, attn_mask=mask, is_causal=True, enable_gqa=True,
                                      return_stats=True)
        out.float().sum().backward()
        return [out, *stats, q.grad, k.grad, v.grad]

    for real, meta in zip(call("cpu"), call("meta"), strict=True):
        assert meta.device.type == "meta"
        assert (meta.shape, meta.dtype) == (real.shape, real.dtype)


def test_meta_varlen_needs_the_longest_lengths():
    """Packed sequences on meta tensors: ``max_seqlen_*`` give the shapes; without them the offsets would have to be
    read, and the error names the argument."""
    q = torch.empty(1, 2, 9, 16, device="meta")
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device="meta")
    out = entmax_attention(q, q, q, 1.3, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    assert out.shape == q.shape and out.device.type == "meta"
    with pytest.raises(ValueError, match="max_seqlen_q must be given with meta cu_seqlens"):
        entmax_attention(q, q, q, 1.3, cu_seqlens_q=cu, cu_seqlens_k=cu)
