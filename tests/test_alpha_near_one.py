"""alpha just above 1 on every path: the alpha class is decided from alpha as the computation holds it.

A Python ``alpha = 1 + eps`` with ``eps`` below float32's resolution at 1 (``2**-24``) is 1.0 in float32: every
float32 / float16 / bfloat16 computation (the kernels, the CPU path, the mappings and losses) runs it as softmax
(``kernels._args.computed_alpha``), exactly as it runs a tensor alpha holding that value; float64 computations keep
the float64 value. Above that the general arithmetic runs with ``alpha - 1`` as small as ``2**-23``. Either way the
result is entmax at that alpha up to the dtype's rounding: the tests compare with the float64 reference at the Python
value (entmax is continuous at alpha = 1, ``O((alpha - 1) s**2)`` from softmax, far below these tolerances), never
with a number copied from a run.
"""

import math

import pytest
import torch
import triton
import triton.language as tl
from helpers import BF16, EXACT, F16, F32, F64, TOL, assert_close_to_ref, qkv
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_attn
from sparse_attn import EntmaxMultiheadAttention, entmax, entmax_attention, entmax_bisect_loss
from sparse_attn.decode import entmax_decode
from sparse_attn.kernels._args import alpha_class_of, computed_alpha
from sparse_attn.kernels._common import LOG1P_SERIES_MAX, log2_1p

pytestmark = pytest.mark.usefixtures("poison_uninitialized")

# alpha - 1 from far below float32's resolution at 1 to ordinary values; 2**-24 rounds to 1.0 (ties to even),
# 6e-8 and 2**-23 to the smallest float32 above 1
EPSILONS = [1e-12, 1e-9, 2.0**-24, 6e-8, 2.0**-23, 1e-6, 1e-3]
KERNEL_EPSILONS = [1e-12, 1e-9, 6e-8, 1e-6, 1e-3]


def _ref(q, k, v, alpha, **kw):
    """The float64 reference at the same (Python or tensor) alpha."""
    a = alpha.detach().double() if isinstance(alpha, torch.Tensor) else alpha
    return entmax_attention(q.detach().double(), k.detach().double(), v.detach().double(), a, backend="reference",
                            **kw)


def _eps(dtype, backend):
    if backend == "triton":
        return TOL["eps_attention_kernel"][dtype]
    return TOL["eps_attention_kernel"][dtype] if dtype != F64 else TOL["oracle_f64"]


def test_the_rule():
    assert computed_alpha(1 + 1e-9) == 1.0
    assert computed_alpha(1 + 1e-9, F64) == 1 + 1e-9
    assert computed_alpha(1 + 2.0**-24) == 1.0
    assert computed_alpha(1 + 6e-8) == 1 + 2.0**-23
    assert computed_alpha(1.5 + 1e-9) == 1.5
    assert alpha_class_of([1 + 1e-9]) == "softmax"
    assert alpha_class_of([1 + 2.0**-23]) == "general"
    assert alpha_class_of([2 - 1e-9]) == "sparsemax"
    assert alpha_class_of([1 + 1e-9, 1.0]) == "softmax"


@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("dtype", [F64, F32, BF16, F16], ids=str)
def test_cpu_path(eps, dtype):
    q, k, v = qkv(1, 2, 2, 13, 13, 16, dtype=dtype, seed=1)
    out = entmax_attention(q, k, v, 1 + eps, is_causal=True)
    ref64 = _ref(q, k, v, 1 + eps, is_causal=True)
    assert torch.isfinite(out).all()
    low = None if dtype == F64 else entmax_attention(q, k, v, 1 + eps, is_causal=True, backend="reference")
    assert_close_to_ref(out, ref64, low, eps=_eps(dtype, "auto"))


@pytest.mark.parametrize("eps", KERNEL_EPSILONS)
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_fused_kernels(eps, dtype, kernel_device):
    q, k, v = (t.to(kernel_device) for t in qkv(1, 2, 2, 24, 24, 16, dtype=dtype, seed=2))
    out = entmax_attention(q, k, v, 1 + eps, is_causal=True, backend="triton")
    ref64 = _ref(q, k, v, 1 + eps, is_causal=True)
    low = entmax_attention(q.cpu(), k.cpu(), v.cpu(), 1 + eps, is_causal=True, backend="reference")
    assert_close_to_ref(out, ref64, low, eps=_eps(dtype, "triton"))


@pytest.mark.parametrize("eps", [1e-9, 6e-8, 1e-4])
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_decode(eps, backend, kernel_device):
    device = kernel_device if backend == "triton" else "cpu"
    q, k, v = (t.to(device) for t in qkv(2, 4, 2, 1, 40, 16, dtype=F32, seed=3))
    out = entmax_decode(q, k, v, 40, 1 + eps, backend=backend)
    ref64 = _ref(q, k, v, 1 + eps, enable_gqa=True)
    assert_close_to_ref(out, ref64, eps=TOL["eps_attention_kernel"][F32])


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_alpha_gradients_near_one(backend, kernel_device):
    """A learnable float32 alpha at 1, at the smallest float32 above 1 and a little higher: the output and every
    gradient (alpha's included) finite and equal to the float64 reference's at the same float32 values."""
    device = kernel_device if backend == "triton" else "cpu"
    q, k, v = (t.to(device).requires_grad_() for t in qkv(1, 4, 4, 16, 16, 16, dtype=F32, seed=4))
    alpha = torch.tensor([1.0, 1 + 2.0**-23, 1 + 1e-5, 1.5], device=device, requires_grad=True)
    out = entmax_attention(q, k, v, alpha, is_causal=True, backend=backend)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(device)
    grads = torch.autograd.grad((out * do).sum(), (q, k, v, alpha))
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, alpha)]
    out64 = entmax_attention(*leaves64, is_causal=True, backend="reference")
    grads64 = torch.autograd.grad((out64 * do.double()).sum(), leaves64)
    assert_close_to_ref(out, out64, eps=TOL["eps_attention_kernel"][F32])
    for name, g, g64 in zip(("dq", "dk", "dv", "dalpha"), grads, grads64, strict=True):
        assert torch.isfinite(g).all(), name
        rel = TOL["fused_rel_f32"]["dalpha" if name == "dalpha" else "grad"]
        err = float((g.double().cpu() - g64.cpu()).abs().max())
        assert err <= rel * max(1.0, float(g64.abs().max())), f"{name}: {err:.3g}"


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_mappings_losses_and_modules_run_softmax_where_alpha_rounds_to_one(dtype):
    """Where the computation holds alpha as 1.0, a Python ``1 + eps`` gives exactly what ``alpha = 1`` gives."""
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(6), dtype=F64).mul(4).to(dtype)
    for eps in (1e-12, 1e-9, 2.0**-24):
        torch.testing.assert_close(entmax(x, 1 + eps), entmax(x, 1.0), **EXACT)
        y = torch.tensor([0, 5, 39])
        loss = entmax_bisect_loss(x, y, alpha=1 + eps)
        torch.testing.assert_close(loss, entmax_bisect_loss(x, y, alpha=1.0), **EXACT)
        assert torch.isfinite(loss).all()
    torch.manual_seed(7)
    mha = EntmaxMultiheadAttention(16, 2, alpha=1 + 1e-9, batch_first=True, dtype=dtype)
    soft = EntmaxMultiheadAttention(16, 2, alpha=1.0, batch_first=True, dtype=dtype)
    soft.load_state_dict(mha.state_dict())
    h = torch.randn(2, 9, 16, dtype=dtype)
    got = mha(h, h, h, need_weights=False)[0]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, soft(h, h, h, need_weights=False)[0], **EXACT)


def _alpha_in_unit_interval():
    """alpha in [1, 2], crowded at the class boundaries: 1 + 10**-u, 1.5 +- 10**-u, 2 - 10**-u, and uniform."""
    tiny = st.floats(min_value=1.0, max_value=14.0).map(lambda u: 10.0**-u)
    return st.one_of(
        tiny.map(lambda e: 1.0 + e),
        st.tuples(tiny, st.sampled_from([-1.0, 1.0])).map(lambda t: 1.5 + t[1] * t[0]),
        tiny.map(lambda e: 2.0 - e),
        st.floats(min_value=1.0, max_value=2.0),
        st.sampled_from([1.0, 1.5, 2.0]),
    )


@settings(max_examples=60, deadline=None, derandomize=True)
@given(alpha=_alpha_in_unit_interval(), dtype=st.sampled_from([F32, BF16, F16]), seed=st.integers(0, 2**16))
def test_property_no_alpha_in_unit_interval_gives_nan_or_a_wrong_row_cpu(alpha, dtype, seed):
    q, k, v = qkv(1, 2, 2, 7, 9, 8, dtype=dtype, seed=seed)
    out = entmax_attention(q, k, v, alpha)
    assert torch.isfinite(out).all()
    low = entmax_attention(q, k, v, alpha, backend="reference")
    assert_close_to_ref(out, _ref(q, k, v, alpha), low, eps=TOL["eps_attention_kernel"][dtype])
    p = entmax(q.float() @ k.float().transpose(-1, -2), alpha)
    assert torch.isfinite(p).all()
    assert float((p.sum(-1) - 1).abs().max()) <= TOL["sum"][F32]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(alpha=_alpha_in_unit_interval(), seed=st.integers(0, 2**16))
def test_property_no_alpha_in_unit_interval_gives_nan_or_a_wrong_row_kernels(alpha, seed):
    kernel_device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (t.to(kernel_device) for t in qkv(1, 2, 2, 20, 20, 16, dtype=F32, seed=seed))
    out = entmax_attention(q, k, v, alpha, is_causal=True, backend="triton")
    assert torch.isfinite(out).all()
    assert_close_to_ref(out, _ref(q, k, v, alpha, is_causal=True), eps=TOL["eps_attention_kernel"][F32])
    # a learnable (tensor) alpha of the same float32 value takes the per-head run-time class and agrees
    a_t = torch.full((2,), alpha, device=kernel_device)
    got_t = entmax_attention(q, k, v, a_t, is_causal=True, backend="triton")
    assert_close_to_ref(got_t, _ref(q, k, v, a_t, is_causal=True), eps=TOL["eps_attention_kernel"][F32])


def test_continuity_with_softmax_in_float64():
    """The float64 oracle itself: entmax at 1 + eps is within O(eps) of softmax (what the rule relies on)."""
    q, k, v = qkv(1, 2, 2, 9, 9, 8, dtype=F64, seed=8)
    soft = entmax_attention(q, k, v, 1.0, backend="reference")
    for eps in (1e-12, 1e-9, 1e-6):
        near = entmax_attention(q, k, v, 1 + eps, backend="reference")
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        bound = eps * float((scores.amax(-1) - scores.amin(-1)).max()) ** 2 * float(v.abs().max())
        assert 0 < float((near - soft).abs().max()) <= bound
    assert sparse_attn.entmax(torch.zeros(3, dtype=F64), 1 + 1e-12).sum() == pytest.approx(1.0)


@triton.jit
def _log2_1p_kernel(V, OUT, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(OUT + offs, log2_1p(tl.load(V + offs)))


def test_log2_1p_relative_accuracy_and_weights(kernel_device):
    """``log2(1 + v)`` as the general-alpha weights take it (``kernels._common.log2_1p``): float32 relative precision
    where the series runs (``|v| < LOG1P_SERIES_MAX``, no rounding of ``1 + v``), and weights ``(1 + v)**beta`` built
    on it within ``6e-7`` of float64 for every ``beta`` down to alpha = 1 + 2**-23 (rounding ``1 + v`` first, as a
    plain ``log2`` would, costs ``beta`` ulps: 0.5 at that alpha)."""
    gen = torch.Generator().manual_seed(11)
    n = 4096
    mags = torch.logspace(-12, 0, n // 2, dtype=F64)[:-1]
    v = torch.cat([-mags, mags[mags < 0.2], -torch.rand(n, generator=gen, dtype=F64)])
    v = v[v > -1].to(F32)
    size = triton.next_power_of_2(v.numel())
    vp = torch.zeros(size, dtype=F32)
    vp[: v.numel()] = v
    out = torch.empty(size, dtype=F32)
    vp, out = vp.to(kernel_device), out.to(kernel_device)
    _log2_1p_kernel[(1,)](vp, out, N=size)
    got = out[: v.numel()].cpu().double()
    v64 = v.double()
    exact = torch.log1p(v64) / math.log(2.0)
    series = v64.abs() < LOG1P_SERIES_MAX.value
    rel = ((got - exact).abs() / exact.abs().clamp_min(1e-300))[series]
    assert float(rel.max()) <= 2 * torch.finfo(F32).eps, float(rel.max())
    for beta in (1.0 / 0.99, 2.0, 4.0, 8.0, 16.0, 64.0, 1e3, 2.0**23):
        w_err = (torch.exp2(beta * got) - torch.exp2(beta * exact)).abs()[v64 <= 0]
        assert float(w_err.max()) <= 6e-7, (beta, float(w_err.max()))
