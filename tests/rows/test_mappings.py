"""Row-wise mappings against an independent float64 bisection oracle, gradients, edge cases."""

import math

import pytest
import torch
from helpers import F64, TOL, assert_close_to_ref, randn, reference_entmax

import sparse_attn.mappings as mappings
import sparse_attn.rows._entmax_solver as entmax_solver
import sparse_attn.rows._triton_rows as triton_rows
from sparse_attn.losses import entmax_bisect_loss
from sparse_attn.mappings import (
    Entmax,
    Entmax15,
    EntmaxBisect,
    Sparsemax,
    entmax,
    entmax15,
    entmax_bisect,
    sparsemax,
)

EXACT = {
    "sparsemax": (sparsemax, 2.0),
    "entmax15": (entmax15, 1.5),
}


@pytest.mark.parametrize("name", list(EXACT))
@pytest.mark.parametrize("dim", [0, 1, -1, -2])
def test_exact_paths_match_reference(name, dim):
    fn, alpha = EXACT[name]
    x = randn(5, 7, 6, seed=dim + 3)
    torch.testing.assert_close(fn(x, dim=dim), reference_entmax(x, alpha, dim), atol=TOL["oracle_f64"], rtol=0)
    torch.testing.assert_close(entmax(x, alpha, dim=dim), reference_entmax(x, alpha, dim),
                               atol=TOL["oracle_f64"], rtol=0)


@pytest.mark.parametrize("alpha", [0.3, 0.8, 1.0, 1.1, 1.33, 1.5, 1.75, 2.0, 2.5, 4.0])
def test_bisect_matches_reference(alpha):
    x = randn(6, 11, seed=int(alpha * 100))
    x[0, 3] = -math.inf
    torch.testing.assert_close(entmax_bisect(x, alpha), reference_entmax(x, alpha), atol=TOL["oracle_f64"], rtol=0)
    torch.testing.assert_close(entmax(x, alpha), reference_entmax(x, alpha), atol=TOL["oracle_f64"], rtol=0)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=str)
def test_long_rows_take_the_candidate_solver(dtype, monkeypatch):
    """Rows of at least 4 * _GROUPS entries are solved over their candidates only (entmax_solver._solve_rows):
    narrow and nearly flat rows in one batch, per-row alpha above 2 too, -inf entries, temperatures from 0.3 to 10.
    Against the float64 bisection oracle, with exact zeros off the support and the candidate path checked to have
    run."""
    n, alphas = 700, [1.02, 1.1, 1.3, 1.5, 1.6, 1.9, 2.0, 2.5, 3.5, 1.3, 1.7, 1.25]
    scales = torch.tensor([0.3, 1.0, 3.0, 10.0] * 3, dtype=F64).unsqueeze(1)
    x = randn(len(alphas), n, seed=11) * scales
    x[2, ::3] = -math.inf
    x[5, 100:] = -math.inf
    alpha = torch.tensor(alphas, dtype=F64).unsqueeze(1)
    solved = []
    real = entmax_solver._newton_rows

    def spy(rows, a, *args, **kwargs):
        solved.append((tuple(rows.shape), kwargs.get("t0") is not None))
        return real(rows, a, *args, **kwargs)

    monkeypatch.setattr(entmax_solver, "_newton_rows", spy)
    xd, ad = x.to(dtype), alpha.to(dtype)
    p = entmax_bisect(xd, ad)
    ref = reference_entmax(xd.to(F64), ad.to(F64))
    if dtype == F64:
        torch.testing.assert_close(p, ref, atol=TOL["oracle_f64"], rtol=0)
    else:
        assert_close_to_ref(p, ref, eps=TOL["eps_mapping"])
    assert all(started for _, started in solved) and any(w < n for (_, w), _ in solved), solved
    assert bool((p[ref == 0] == 0).all()), "a weight outside the support"
    # the same rows one at a time (other batch companions, other padding) give the same weights
    for i in (0, 3, 8):
        torch.testing.assert_close(entmax_bisect(xd[i:i + 1], ad[i:i + 1]), p[i:i + 1], atol=TOL["same_values"][dtype],
                                   rtol=0)


def test_per_head_alpha_on_masked_scores():
    b, h, n = 2, 5, 9
    s = randn(b, h, n, n, seed=7)
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)
    s = s.masked_fill(causal, -math.inf)
    s[1, :, 4, :] = -math.inf
    alpha = torch.tensor([1.0, 1.5, 2.0, 1.25, 1.5], dtype=torch.float64).view(1, h, 1, 1)
    p = entmax(s, alpha, dim=-1)
    torch.testing.assert_close(p, reference_entmax(s, alpha, -1), atol=TOL["oracle_f64"], rtol=0)
    assert torch.equal(p[0, 0], torch.softmax(s[0, 0], -1))
    assert bool((p[causal.expand_as(p)] == 0).all())
    assert bool((p[1, :, 4] == 0).all())


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_exact_vs_iterative_fp32(alpha):
    x = randn(64, 50, dtype=torch.float32, seed=11)
    p_exact = entmax(x, alpha)
    p_iter = entmax_bisect(x, alpha)
    assert float(((p_exact - p_iter) ** 2).sum()) < 1e-7
    p_ref = reference_entmax(x, alpha)
    assert float(((p_iter.double() - p_ref) ** 2).sum()) < 1e-7


@pytest.mark.parametrize("name", list(EXACT))
@pytest.mark.parametrize("k", [1, 2, 5, 40])
@pytest.mark.parametrize("dim", [0, -1])
def test_partial_sort_identical(name, k, dim):
    fn, _ = EXACT[name]
    x = randn(30, 30, dtype=torch.float32, scale=0.3 if k > 2 else 3.0, seed=k)
    full = fn(x, dim=dim)
    part = fn(x, dim=dim, k=k)
    assert torch.equal(full, part)


def test_partial_sort_rows_reaching_k_are_redone():
    x = torch.zeros(3, 20, dtype=torch.float64)
    x[0, 0] = 10.0
    for fn, _ in EXACT.values():
        p = fn(x, k=2)
        torch.testing.assert_close(p[1], torch.full((20,), 1 / 20, dtype=torch.float64))
        assert float(p[0, 0]) == 1.0


@pytest.mark.parametrize("fn", [sparsemax, entmax15, lambda x: entmax_bisect(x, 1.3), lambda x: entmax_bisect(x, 0.7),
                                lambda x: entmax_bisect(x, 2.5), lambda x: entmax(x, 1.0)])
def test_gradcheck_inputs(fn):
    x = randn(3, 4, 6, seed=5).requires_grad_()
    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("values", [[1.0, 1.2, 1.5, 2.0], [0.6, 1.0 + 1e-3, 1.8, 3.0],
                                    [1.0 - 1e-4, 1.0 + 1e-4, 1.0, 1.0]])
def test_gradcheck_alpha_per_row(values):
    x = randn(1, 4, 6, seed=9).requires_grad_()
    alpha = torch.tensor(values, dtype=torch.float64).view(1, 4, 1).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: entmax(a, b), (x, alpha))
    assert torch.autograd.gradcheck(lambda a, b: entmax_bisect(a, b), (x, alpha))


@pytest.mark.parametrize("values", [[1.0, 1.2, 1.5, 2.0], [0.6, 1.0 + 1e-3, 1.8, 3.0]])
def test_gradgradcheck_alpha_per_row(values):
    """Second order in both inputs: the backward's own dependence on alpha (U = p ** (2 - alpha)) is differentiated
    too, not only its dependence through p."""
    x = randn(1, 4, 6, seed=9).requires_grad_()
    alpha = torch.tensor(values, dtype=torch.float64).view(1, 4, 1).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda a, b: entmax(a, b), (x, alpha), **TOL["gradcheck"])
    assert torch.autograd.gradgradcheck(lambda a, b: entmax_bisect(a, b), (x, alpha), **TOL["gradcheck"])


@pytest.mark.parametrize("value", [1.0, 1.37, 2.0])
def test_gradcheck_alpha_scalar_tensor(value):
    x = randn(3, 8, seed=2).requires_grad_()
    alpha = torch.tensor(value, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: entmax(a, b), (x, alpha))


@pytest.mark.parametrize("value", [1.0, 1.0 + 1e-5, 1.0 + 1e-3, 1.6])
def test_alpha_gradient_fp32_matches_fp64(value):
    x = randn(4, 12, seed=4)
    grads = []
    for dt in (torch.float32, torch.float64):
        alpha = torch.tensor([[value]], dtype=dt, requires_grad=True)
        w = randn(4, 12, dtype=dt, seed=8)
        (entmax(x.to(dt), alpha) * w).sum().backward()
        grads.append(alpha.grad.double())
    torch.testing.assert_close(grads[0], grads[1],
                               atol=2e-4, rtol=2e-3)  # why: fp32 dalpha near alpha = 1 (measured 4.3e-7)


def test_alpha_to_one_continuity():
    x = randn(8, 30, seed=12)
    soft = torch.softmax(x, -1)
    for a in (1.0 + 1e-4, 1.0 - 1e-4):
        for dt in (torch.float32, torch.float64):
            p = entmax(x.to(dt), a).double()
            assert float((p - soft).abs().max()) < 1e-3
            assert float((p - 1 / 30).abs().max()) > 0.05
    assert torch.equal(entmax(x, 1.0), soft)
    assert torch.equal(entmax_bisect(x, 1.0), soft)


@pytest.mark.parametrize("fn", [sparsemax, entmax15, lambda x: entmax_bisect(x, 1.3), lambda x: entmax(x, 1.0),
                                lambda x: entmax_bisect(x, 0.5), lambda x: entmax_bisect(x, 3.0)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_neg_inf_entries_and_rows(fn, dtype):
    x = randn(4, 9, dtype=dtype, seed=1)
    x[0, [1, 4]] = -math.inf
    x[2] = -math.inf
    x.requires_grad_()
    p = fn(x)
    assert p.dtype == dtype
    assert not bool(torch.isnan(p).any())
    assert bool((p[0, [1, 4]] == 0).all())
    assert bool((p[2] == 0).all())
    torch.testing.assert_close(p[[0, 1, 3]].double().sum(-1), torch.ones(3, dtype=torch.float64),
                               atol=TOL["sum"][dtype], rtol=0)
    (p * randn(4, 9, dtype=dtype, seed=3)).sum().backward()
    assert not bool(torch.isnan(x.grad).any())
    assert bool((x.grad[2] == 0).all())
    assert bool((x.grad[0, [1, 4]] == 0).all())


@pytest.mark.parametrize("fn,alpha", [(sparsemax, 2.0), (entmax15, 1.5), (lambda x: entmax_bisect(x, 1.3), 1.3),
                                      (lambda x: entmax(x, 1.0), 1.0), (lambda x: entmax_bisect(x, 0.5), 0.5),
                                      (lambda x: entmax_bisect(x, 2.5), 2.5)])
@pytest.mark.parametrize("dtype,scale", [(torch.float16, 1e4), (torch.bfloat16, 1e4), (torch.float32, 1e30)])
def test_large_magnitudes(fn, alpha, dtype, scale):
    x = (randn(6, 40, seed=6, scale=1.0) * scale).to(dtype)
    x[0, 5:9] = x[0].max()
    x[1, 10:12] = x[1].max()
    x.requires_grad_()
    p = fn(x)
    assert bool(torch.isfinite(p).all())
    torch.testing.assert_close(p.double().sum(-1), torch.ones(6, dtype=torch.float64), atol=TOL["sum"][dtype], rtol=0)
    shifted = x.detach().double()
    shifted = (shifted - shifted.amax(-1, keepdim=True)).requires_grad_()
    assert_close_to_ref(p, reference_entmax(shifted.detach(), alpha), eps=TOL["eps_mapping"])
    w = randn(6, 40, seed=9)
    (p.double() * w).sum().backward()
    (fn(shifted) * w.to(dtype).double()).sum().backward()
    assert bool(torch.isfinite(x.grad).all())
    assert_close_to_ref(x.grad, shifted.grad, eps=TOL["eps_mapping"])


@pytest.mark.parametrize("fn", [sparsemax, entmax15, lambda x: entmax_bisect(x, 1.3), lambda x: entmax(x, 1.0),
                                lambda x: entmax_bisect(x, 0.6)])
def test_shift_invariance_and_permutation(fn):
    x = randn(5, 13, seed=10)
    p = fn(x)
    torch.testing.assert_close(fn(x + 7.25), p, atol=TOL["same_values"][F64], rtol=0)
    perm = torch.randperm(13, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fn(x[:, perm]), p[:, perm], atol=TOL["same_values"][F64], rtol=0)


def test_fp16_bf16_match_fp32_reference():
    x = randn(8, 33, dtype=torch.float32, seed=13)
    for dt in (torch.float16, torch.bfloat16):
        xd = x.to(dt)
        for a in (1.0, 1.5, 2.0, 1.2):
            p = entmax(xd, a)
            assert p.dtype == dt
            assert_close_to_ref(p, reference_entmax(xd.double(), a), eps=TOL["eps_mapping"])


def test_modules_and_learnable_alpha():
    x = randn(3, 4, 10, seed=14)
    torch.testing.assert_close(Sparsemax(dim=1)(x), sparsemax(x, dim=1))
    torch.testing.assert_close(Entmax15(dim=0, k=2)(x), entmax15(x, dim=0))
    alpha = torch.nn.Parameter(torch.tensor([[[1.2]], [[1.6]], [[1.9]]], dtype=torch.float64))
    mod = EntmaxBisect(alpha=alpha, dim=-1)
    assert any(p is alpha for p in mod.parameters())
    mod(x).pow(2).sum().backward()
    assert alpha.grad is not None and bool(torch.isfinite(alpha.grad).all())
    torch.testing.assert_close(Entmax(alpha=1.5)(x), entmax15(x))


def test_alpha_beyond_float32_is_argmax_in_float32():
    """A Python alpha above float32's largest (held as float32, it rounded to inf: NaN rows) is held as that largest:
    argmax, as float64 computes it, in the mappings and the losses."""
    x = torch.tensor([[0.5, 1.0, 0.2, 0.999], [3.0, -1.0, 0.0, 2.0]])
    onehot = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    for alpha in (3.5e38, 1e300):
        for fn in (entmax_bisect, entmax):
            torch.testing.assert_close(fn(x, alpha), onehot, atol=0, rtol=0)  # why: argmax, exact
            torch.testing.assert_close(fn(x.double(), alpha), onehot.double(), atol=0, rtol=0)  # why: argmax
        loss = entmax_bisect_loss(x, torch.tensor([1, 3]), alpha=alpha)
        assert torch.isfinite(loss).all()


def test_empty_and_single_column():
    assert entmax(torch.empty(0, 4), 1.5).shape == (0, 4)
    x = randn(4, 1)
    for fn in (sparsemax, entmax15, lambda t: entmax_bisect(t, 1.7), lambda t: entmax_bisect(t, 0.5)):
        assert torch.equal(fn(x), torch.ones_like(x))


class _ReportsCuda(torch.Tensor):
    """CPU tensor whose ``is_cuda`` is True, so the public mappings dispatch it to Triton.

    Operations on it return plain tensors (``__torch_function__`` disabled); under
    ``TRITON_INTERPRET=1`` the row kernels then run on the CPU.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self):
        return True


@pytest.mark.parametrize("dtype,dim,per_row", [(torch.float32, -1, True), (torch.float16, 0, False)])
def test_triton_dispatch_matches_pytorch_path(dtype, dim, per_row, monkeypatch, kernel_device):
    if kernel_device != "cpu":
        pytest.skip("covered on CUDA by test_cuda_long_rows_match_cpu_path")
    calls = []
    kernel = triton_rows.entmax_rows_triton

    def spy(*args, **kwargs):
        calls.append(type(args[0]))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_rows, "entmax_rows_triton", spy)
    monkeypatch.setattr(mappings, "TRITON_MIN_ROW", 32)
    rows = randn(5, 40, dtype=torch.float32, seed=19)
    rows[1, [3, 7]] = -math.inf
    rows[3] = -math.inf
    x = rows.to(dtype).movedim(-1, dim).contiguous()
    alpha = torch.tensor([1.0, 1.25, 1.5, 1.8, 2.0]).view(5, 1).movedim(-1, dim) if per_row else 1.5
    w = randn(*x.shape, seed=20)
    results = []
    for to_triton in (True, False):
        xi = x.clone().as_subclass(_ReportsCuda) if to_triton else x.clone()
        xi.requires_grad_()
        ai = alpha.clone().requires_grad_() if per_row else alpha
        p = entmax(xi, ai, dim=dim)
        (p.double() * w).sum().backward()
        results.append((p, xi.grad, ai.grad if per_row else None))
    assert calls == [_ReportsCuda]
    (pk, gk, ak), (pt, gt, at) = results
    assert pk.dtype == pt.dtype == dtype and gk.dtype == gt.dtype == dtype
    tol = TOL["rows_triton_vs_torch"][dtype]
    torch.testing.assert_close(pk.double(), pt.double(), atol=tol["p"], rtol=0)
    torch.testing.assert_close(gk.double(), gt.double(), atol=tol["dx"], rtol=0)
    if per_row:
        torch.testing.assert_close(ak.double(), at.double(), atol=tol["dalpha"], rtol=0)
    pk_rows = pk.movedim(dim, -1)
    assert bool((pk_rows[1, [3, 7]] == 0).all()) and bool((pk_rows[3] == 0).all())
    assert bool((gk.movedim(dim, -1)[3] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_long_rows_match_cpu_path(dtype):
    x = randn(6, 4096, dtype=torch.float32, seed=17).to(dtype)
    alpha = torch.tensor([1.0, 1.2, 1.5, 1.5, 1.8, 2.0]).view(6, 1)
    xc = x.cuda().requires_grad_()
    ac = alpha.cuda().requires_grad_()
    xh = x.clone().requires_grad_()
    ah = alpha.clone().requires_grad_()
    w = randn(6, 4096, dtype=torch.float32, seed=18)
    pc = entmax(xc, ac)
    ph = entmax(xh, ah)
    tol, grad_tol = TOL["rows_cuda_vs_cpu"][dtype], TOL["rows_cuda_vs_cpu_grad"][dtype]
    torch.testing.assert_close(pc.cpu().float(), ph.float(), atol=tol, rtol=0)
    (pc.float() * w.cuda()).sum().backward()
    (ph.float() * w).sum().backward()
    torch.testing.assert_close(xc.grad.cpu().float(), xh.grad.float(), atol=grad_tol, rtol=0)
    torch.testing.assert_close(ac.grad.cpu(), ah.grad, atol=grad_tol, rtol=1e-2)  # why: dalpha sums 4096 terms
