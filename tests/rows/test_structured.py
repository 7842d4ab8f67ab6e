"""Tests of fusedmax, oscarmax, sq-pnorm-max, sparsemax with temperature and the TV/OSCAR proxes.

Forward passes are checked against slow solvers written here (projected gradient on the
dual in float64), Jacobians against matrices built explicitly from Prop. 1 and Prop. 3 of
Niculae & Blondel 2017, and the Triton TV kernel
(under the interpreter on CPU) against the PyTorch path.
"""

import math

import pytest
import torch
from helpers import EXACT, F32, F64, TOL, gen
from torch.autograd import gradcheck
from torch.autograd.functional import jacobian, jvp

from sparse_attn.kernels.rows.structured import isotonic_nonincreasing_rows, tv_prox_rows
from sparse_attn.mappings import sparsemax
from sparse_attn.rows._structured_rows import (
    _isotonic_nonincreasing,
    _oscar_prox_op,
    _tv_prox_op,
    _tv_prox_torch,
    oscar_prox_rows,
)
from sparse_attn.structured import (
    Fusedmax,
    Oscarmax,
    fusedmax,
    gamma_sparsemax,
    oscar_prox,
    oscarmax,
    sq_pnorm_max,
    tv_prox,
)


def _simplex(v):
    """Euclidean projection of the rows of ``v`` onto the simplex (sort-based, for the tests)."""
    s, _ = torch.sort(v, dim=-1, descending=True)
    k = torch.arange(1, v.shape[-1] + 1, dtype=v.dtype)
    cs = s.cumsum(-1) - 1
    supp = (s - cs / k > 0).sum(-1, keepdim=True)
    tau = cs.gather(-1, supp - 1) / supp
    return (v - tau).clamp(min=0)


def _slow_solver(x, E, lam, simplex, tol=1e-14, max_iter=20000):
    """``argmin_y |y - x|^2 / 2 + lam |E y|_1`` (over the simplex when ``simplex``), rows of ``x``.

    Projected gradient ascent on the dual ``max_{|w| <= lam} min_y |y - x|^2/2 + w.E y``,
    whose gradient is ``E y(w)`` with ``y(w) = P(x - E^T w)``; stops when ``y`` moves less
    than ``tol`` over 50 iterations.
    """
    step = 1.0 / torch.linalg.matrix_norm(E, ord=2) ** 2
    w = torch.zeros(x.shape[0], E.shape[0], dtype=x.dtype)
    y_prev = None
    for it in range(max_iter):
        v = x - w @ E
        y = _simplex(v) if simplex else v
        if it % 50 == 0:
            if y_prev is not None and (y - y_prev).abs().max() < tol:
                return y
            y_prev = y
        w = (w + step * (y @ E.T)).clamp(-lam, lam)
    raise AssertionError("slow solver did not converge")


def _tv_matrix(d):
    E = torch.zeros(d - 1, d, dtype=F64)
    for i in range(d - 1):
        E[i, i], E[i, i + 1] = -1.0, 1.0
    return E


def _oscar_matrix(d):
    """Rows such that ``|E y|_1 = sum_{i<j} max(|y_i|, |y_j|)`` (``max(|a|,|b|) = (|a+b| + |a-b|)/2``)."""
    rows = []
    for i in range(d):
        for j in range(i + 1, d):
            for s in (1.0, -1.0):
                r = torch.zeros(d, dtype=F64)
                r[i], r[j] = 0.5, 0.5 * s
                rows.append(r)
    return torch.stack(rows)


def _groups(z, contiguous, tol=1e-9):
    """Group matrix ``G`` (d, d): 1 where two entries belong to the same group of equal values."""
    d = z.shape[0]
    same = (z[:, None] - z[None, :]).abs() < tol
    if not contiguous:
        return same.to(F64)
    G = torch.zeros(d, d, dtype=F64)
    for i in range(d):
        for j in range(d):
            lo, hi = min(i, j), max(i, j)
            G[i, j] = float(all(abs(z[k] - z[lo]) < tol for k in range(lo, hi + 1)))
    return G


def _sparsemax_jacobian(p):
    s = (p > 1e-9).to(F64)
    return torch.diag(s) - torch.outer(s, s) / s.sum()


# ---------------------------------------------------------------- forward vs slow solvers


@pytest.mark.parametrize("lam", [0.05, 0.3, 1.0])
def test_fusedmax_and_tv_prox_match_slow_solver(lam):
    d = 7
    x = 1.5 * torch.randn(10, d, generator=gen(1), dtype=F64)
    E = _tv_matrix(d)
    torch.testing.assert_close(fusedmax(x, lam=lam), _slow_solver(x, E, lam, True), atol=TOL["slow_solver"], rtol=0)
    torch.testing.assert_close(tv_prox(x, lam=lam), _slow_solver(x, E, lam, False), atol=TOL["slow_solver"], rtol=0)
    gamma = 0.5
    torch.testing.assert_close(fusedmax(x, lam=lam, gamma=gamma), _slow_solver(x / gamma, E, lam, True),
                               atol=TOL["slow_solver"], rtol=0)


@pytest.mark.parametrize("lam", [0.02, 0.3])
def test_oscarmax_and_oscar_prox_match_slow_solver(lam):
    d = 6
    x = 1.5 * torch.randn(10, d, generator=gen(2), dtype=F64)
    x[0] = torch.tensor([-2.3, -0.4, -1.1, 1.0, -0.9, -1.3], dtype=F64)
    E = _oscar_matrix(d)
    torch.testing.assert_close(oscarmax(x, lam=lam), _slow_solver(x, E, lam, True), atol=TOL["slow_solver"], rtol=0)
    torch.testing.assert_close(oscar_prox(x, lam=lam), _slow_solver(x, E, lam, False), atol=TOL["slow_solver"], rtol=0)


def test_sq_pnorm_max_is_optimal():
    """Fixed point of projected gradient (an optimality certificate) and the objective."""
    x = torch.randn(8, 6, generator=gen(3), dtype=F64)
    for p, gamma in [(1.5, 1.0), (1.2, 0.5), (1.8, 2.0)]:
        y = sq_pnorm_max(x, p=p, gamma=gamma)
        assert (y >= 0).all()
        torch.testing.assert_close(y.sum(-1), torch.ones(8, dtype=F64), atol=TOL["sum"][F64], rtol=0)
        norm = (y ** p).sum(-1, keepdim=True) ** (1 / p)
        grad = gamma * y ** (p - 1) / norm ** (p - 2) - x
        for eta in (0.05, 0.5):
            torch.testing.assert_close(_simplex(y - eta * grad), y, atol=TOL["slow_solver"], rtol=0)

        def objective(v, p=p, gamma=gamma):
            return 0.5 * gamma * ((v ** p).sum(-1) ** (2 / p)) - (v * x).sum(-1)

        others = _simplex(y + 0.05 * torch.randn(50, 8, 6, generator=gen(4), dtype=F64))
        assert (objective(others) >= objective(y) - 1e-12).all()


# ---------------------------------------------------------------- Triton kernel (interpreter on CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triton_tv_kernel_matches_torch(kernel_device, dtype):
    n = 20
    x = torch.randn(6, n, generator=gen(5), dtype=dtype)
    x[1] = torch.linspace(-1, 1, n, dtype=dtype)
    x[2, ::2] += 2.0
    lengths = torch.tensor([n, n, n, 1, 0, 13])
    for lam in (0.01, 0.4):
        ref = _tv_prox_torch(x.to(F64), lengths, lam)
        out = tv_prox_rows(x.to(kernel_device), lengths.to(kernel_device), lam).cpu()
        valid = torch.arange(n) < lengths[:, None]
        assert torch.isnan(out[~valid]).all()
        tol = TOL["same_values"][F64] if dtype == F64 else TOL["lowp_vs_f64"][F32]
        torch.testing.assert_close(out[valid].to(F64), ref[valid], atol=tol, rtol=0)


def test_tv_autograd_triton_path_matches_torch_path():
    x = torch.randn(4, 12, generator=gen(6), dtype=F64)
    lengths = torch.tensor([12, 7, 0, 3])
    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    ya = _tv_prox_op(xa, lengths, 0.3, True)
    yb = _tv_prox_op(xb, lengths, 0.3, False)
    torch.testing.assert_close(ya, yb, atol=TOL["same_values"][F64], rtol=0)
    g = torch.randn(4, 12, generator=gen(7), dtype=F64)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, atol=TOL["same_values"][F64], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triton_isotonic_kernel_matches_torch(kernel_device, dtype):
    n = 14
    v = torch.randn(7, n, generator=gen(30), dtype=dtype)
    v[1] = torch.linspace(-1, 1, n, dtype=dtype)
    v[2] = torch.round(2 * v[2])
    v[6] = torch.tensor([3e38, 3e38, -1.0] + [3e38] * (n - 3), dtype=dtype)
    lengths = torch.tensor([n, n, n, 5, 0, 1, n])
    valid = torch.arange(n) < lengths[:, None]
    ref = _isotonic_nonincreasing(torch.where(valid, v, torch.full_like(v, -math.inf)).to(F64))
    out = isotonic_nonincreasing_rows(v.to(kernel_device), lengths.to(kernel_device)).cpu()
    assert torch.isnan(out[~valid]).all() and torch.isfinite(out[valid]).all()
    assert ((out[:, 1:] <= out[:, :-1]) | ~valid[:, 1:]).all()
    tol = TOL["same_values"][F64] if dtype == F64 else TOL["lowp_vs_f64"][F32]
    torch.testing.assert_close(out[valid].to(F64), ref[valid], atol=tol, rtol=tol)


@pytest.mark.parametrize("on_simplex", [False, True])
def test_oscar_autograd_triton_path_matches_torch_path(on_simplex):
    x = torch.randn(5, 9, generator=gen(31), dtype=F64)
    x[1, 3:6] = x[1, 2]
    valid = torch.rand(5, 9, generator=gen(32)) > 0.25
    valid[4] = False
    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    ya = oscar_prox_rows(xa, valid, 0.2, on_simplex, True)
    yb = oscar_prox_rows(xb, valid, 0.2, on_simplex, False)
    torch.testing.assert_close(ya, yb, atol=TOL["same_values"][F64], rtol=0)
    g = torch.randn(5, 9, generator=gen(33), dtype=F64)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, atol=TOL["same_values"][F64], rtol=0)


def test_prox_custom_ops_opcheck(kernel_device):
    """Schema, fake implementation, autograd registration and AOT dispatch of the prox ops, both paths."""
    x = torch.randn(4, 9, generator=gen(34), dtype=torch.float32, device=kernel_device)
    lengths = torch.tensor([9, 4, 0, 1], device=kernel_device)
    valid = torch.rand(4, 9, generator=gen(35)).to(kernel_device) > 0.3
    for use_triton in (False, True):
        torch.library.opcheck(_tv_prox_op, (x.clone().requires_grad_(), lengths, 0.2, use_triton))
        for on_simplex in (False, True):
            torch.library.opcheck(_oscar_prox_op, (x.clone().requires_grad_(), valid, 0.1, on_simplex, use_triton))


@pytest.mark.parametrize("fn", [lambda a: fusedmax(a, lam=0.2), lambda a: oscarmax(a, lam=0.1),
                                lambda a: tv_prox(a, lam=0.3), lambda a: oscar_prox(a, lam=0.1)])
def test_compile_fullgraph_matches_eager(fn):
    """The prox custom ops trace under torch.compile(fullgraph=True), forward and backward."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 8, generator=gen(36), dtype=F64)
    x[1, 2] = -math.inf
    g = torch.randn(3, 8, generator=gen(37), dtype=F64)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    yc, ye = compiled(xc), fn(xe)
    yc.backward(g)
    ye.backward(g)
    torch.testing.assert_close(yc, ye, atol=TOL["ulps"][F64], rtol=0)
    torch.testing.assert_close(xc.grad, xe.grad, atol=TOL["ulps"][F64], rtol=0)


# ---------------------------------------------------------------- gradients


def test_gradcheck_all_mappings():
    x = torch.randn(3, 7, generator=gen(8), dtype=F64, requires_grad=True)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 2] = False
    mask[2, 4:] = False
    fns = [
        lambda a: fusedmax(a, lam=0.2),
        lambda a: fusedmax(a, lam=0.2, gamma=0.7, mask=mask),
        lambda a: oscarmax(a, lam=0.05),
        lambda a: oscarmax(a, lam=0.05, mask=mask),
        lambda a: tv_prox(a, lam=0.2, mask=mask),
        lambda a: oscar_prox(a, lam=0.1),
        lambda a: sq_pnorm_max(a, p=1.5),
        lambda a: sq_pnorm_max(a, p=1.3, gamma=0.5, mask=mask),
        lambda a: gamma_sparsemax(a, gamma=0.5, mask=mask),
    ]
    for fn in fns:
        assert gradcheck(fn, (x,), **TOL["gradcheck"])


def test_fusedmax_jacobian_matches_prop3():
    d, lam = 8, 0.25
    x = torch.randn(4, d, generator=gen(9), dtype=F64)
    z = _slow_solver(x, _tv_matrix(d), lam, False)
    for r in range(4):
        G = _groups(z[r], contiguous=True)
        J_tv = G / G.sum(1, keepdim=True)
        J = _sparsemax_jacobian(_simplex(z[r:r + 1])[0]) @ J_tv
        torch.testing.assert_close(jacobian(lambda a: fusedmax(a, lam=lam), x[r]), J, atol=TOL["jacobian"], rtol=0)
        v = torch.randn(d, generator=gen(10 + r), dtype=F64)
        _, jv = jvp(lambda a: fusedmax(a, lam=lam), x[r], v)
        torch.testing.assert_close(jv, J @ v, atol=TOL["jacobian"], rtol=0)
        torch.testing.assert_close(jacobian(lambda a: tv_prox(a, lam=lam), x[r]), J_tv, atol=TOL["jacobian"], rtol=0)


def test_oscar_jacobians_match_prop3():
    d, lam = 6, 0.15
    x = torch.randn(4, d, generator=gen(11), dtype=F64)
    z = _slow_solver(x, _oscar_matrix(d), lam, False)
    y = _slow_solver(x, _oscar_matrix(d), lam, True)
    shifted = _slow_solver(x + 10.0, _oscar_matrix(d), lam, False)
    for r in range(4):
        G = _groups(z[r].abs(), contiguous=False)
        sgn = torch.sign(z[r])
        J_osc = G * torch.outer(sgn, sgn) / G.sum(1, keepdim=True)
        J_got = jacobian(lambda a: oscar_prox(a, lam=lam), x[r])
        torch.testing.assert_close(J_got, J_osc, atol=TOL["jacobian"], rtol=0)
        # oscarmax: prox of the shifted input, all groups positive (see structured.py)
        Gs = _groups(shifted[r], contiguous=False)
        J = _sparsemax_jacobian(y[r]) @ (Gs / Gs.sum(1, keepdim=True))
        v = torch.randn(d, generator=gen(12 + r), dtype=F64)
        _, jv = jvp(lambda a: oscarmax(a, lam=lam), x[r], v)
        torch.testing.assert_close(jv, J @ v, atol=TOL["jacobian"], rtol=0)


def test_sq_pnorm_jacobian_matches_prop1_system():
    d = 7
    x = torch.randn(3, d, generator=gen(13), dtype=F64)
    for p, gamma in [(1.5, 1.0), (1.25, 0.6)]:
        for r in range(3):
            y = sq_pnorm_max(x[r], p=p, gamma=gamma)
            S = y > 0
            ys = y[S]
            k = ys.numel()
            norm = (ys ** p).sum() ** (1 / p)
            H = torch.diag((p - 1) * ys ** (p - 2) / norm ** (p - 2))
            uvec = math.sqrt(2 - p) * ys ** (p - 1) / norm ** (p - 1)
            B = gamma * (H + torch.outer(uvec, uvec))
            A = torch.eye(k, dtype=F64) - torch.ones(k, k, dtype=F64) / k
            J_S = torch.linalg.solve(torch.eye(k, dtype=F64) + A @ (B - torch.eye(k, dtype=F64)), A)
            J = torch.zeros(d, d, dtype=F64)
            J[S.nonzero()[:, 0][:, None], S.nonzero()[:, 0][None, :]] = J_S
            def fn(a, p=p, gamma=gamma):
                return sq_pnorm_max(a, p=p, gamma=gamma)

            torch.testing.assert_close(jacobian(fn, x[r]), J, atol=TOL["jacobian"], rtol=0)
            v = torch.randn(d, generator=gen(14 + r), dtype=F64)
            _, jv = jvp(fn, x[r], v)
            torch.testing.assert_close(jv, J @ v, atol=TOL["jacobian"], rtol=0)


# ---------------------------------------------------------------- limits and structure


def test_limits_equal_sparsemax():
    x = torch.randn(5, 9, generator=gen(15), dtype=F64)
    sp = sparsemax(x)
    for lam in (0.0, 1e-12):
        torch.testing.assert_close(fusedmax(x, lam=lam), sp, atol=TOL["oracle_f64"], rtol=0)
        torch.testing.assert_close(oscarmax(x, lam=lam), sp, atol=TOL["oracle_f64"], rtol=0)
    torch.testing.assert_close(sq_pnorm_max(x, p=2.0), sp, atol=TOL["same_values"][F64], rtol=0)
    torch.testing.assert_close(sq_pnorm_max(x, p=2.0, gamma=0.3), sparsemax(x / 0.3),
                               atol=TOL["same_values"][F64], rtol=0)
    torch.testing.assert_close(gamma_sparsemax(x, gamma=2.5), sparsemax(x / 2.5), atol=TOL["ulps"][F64], rtol=0)
    torch.testing.assert_close(fusedmax(x, lam=0.0, gamma=2.5), sparsemax(x / 2.5), atol=TOL["ulps"][F64], rtol=0)


def test_fusedmax_equal_weights_on_contiguous_segment():
    noise = 0.05 * torch.randn(4, 12, generator=gen(16), dtype=F64)
    x = noise.clone()
    x[:, 3:7] += 1.0
    p = fusedmax(x, lam=0.2)
    for r in range(4):
        support = (p[r] > 0).nonzero()[:, 0].tolist()
        assert support == [3, 4, 5, 6]
        assert torch.all(p[r, 3:7] == p[r, 3])
        torch.testing.assert_close(p[r, 3:7], torch.full((4,), 0.25, dtype=F64), atol=TOL["same_values"][F64], rtol=0)
    sp = sparsemax(x)
    assert not all(torch.all(sp[r, 3:7] == sp[r, 3]) for r in range(4))
    # on random scores, nonzero weights form runs of equal values: each value occurs in one run
    y = fusedmax(torch.randn(20, 15, generator=gen(17), dtype=F64), lam=0.3)
    for row in y:
        vals = row[row > 0]
        idx = (row > 0).nonzero()[:, 0]
        for v in vals.unique():
            pos = idx[vals == v]
            assert pos.max() - pos.min() + 1 == pos.numel()


def test_oscarmax_groups_equal_weights():
    x = torch.tensor([[1.0, 0.2, 1.02, -0.5, 0.98, 0.1]], dtype=F64)
    p = oscarmax(x, lam=0.05)
    assert p[0, 0] == p[0, 2] == p[0, 4] > 0
    torch.testing.assert_close(p.sum(), torch.tensor(1.0, dtype=F64))


# ---------------------------------------------------------------- masks, lengths, shapes, dtypes


@pytest.mark.parametrize("fn", [lambda a, **k: fusedmax(a, lam=0.3, **k), lambda a, **k: oscarmax(a, lam=0.05, **k),
                                lambda a, **k: sq_pnorm_max(a, p=1.5, **k)])
def test_lengths_and_mask_equal_compressed_rows(fn):
    x = torch.randn(4, 10, generator=gen(18), dtype=F64)
    lengths = torch.tensor([10, 6, 1, 0])
    out = fn(x, lengths=lengths)
    for r, n in enumerate(lengths.tolist()):
        if n:
            torch.testing.assert_close(out[r, :n], fn(x[r:r + 1, :n])[0], atol=TOL["same_values"][F64], rtol=0)
        assert (out[r, n:] == 0).all()
    mask = torch.rand(4, 10, generator=gen(19)) > 0.4
    mask[3] = False
    out = fn(x, mask=mask)
    for r in range(3):
        torch.testing.assert_close(out[r][mask[r]], fn(x[r:r + 1][:, mask[r]])[0], atol=TOL["same_values"][F64], rtol=0)
    assert (out[~mask] == 0).all()
    xi = x.masked_fill(~mask, -math.inf)
    torch.testing.assert_close(fn(xi), out, **EXACT)
    xr = x.clone().requires_grad_()
    fn(xr, mask=mask).mul(torch.randn(4, 10, generator=gen(20), dtype=F64)).sum().backward()
    assert torch.isfinite(xr.grad).all()
    assert (xr.grad[~mask] == 0).all()


def test_empty_and_tiny_rows():
    x = torch.full((2, 5), -math.inf, dtype=F64, requires_grad=True)
    for fn in (fusedmax, oscarmax, sq_pnorm_max, gamma_sparsemax):
        y = fn(x)
        assert (y == 0).all()
        y.sum().backward()
        assert (x.grad == 0).all()
        x.grad = None
    one = torch.randn(3, 1, dtype=F64)
    for fn in (fusedmax, oscarmax, sq_pnorm_max):
        assert (fn(one) == 1).all()
    for fn in (fusedmax, oscarmax, sq_pnorm_max, gamma_sparsemax, tv_prox, oscar_prox):
        assert fn(torch.empty(0, 4)).shape == (0, 4)
        assert fn(torch.empty(3, 0)).shape == (3, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_against_float64(dtype):
    x = (2 * torch.randn(4, 3, 11, generator=gen(21))).to(dtype)
    for fn in (lambda a: fusedmax(a, lam=0.1), lambda a: oscarmax(a, lam=0.02), lambda a: sq_pnorm_max(a)):
        y = fn(x)
        assert y.dtype == dtype and torch.isfinite(y).all()
        torch.testing.assert_close(y.to(F64), fn(x.to(F64)), atol=TOL["lowp_vs_f64"][dtype], rtol=0)


def _offset_rows(offset, dtype, seed, rows=12, n=9):
    """Scores ``offset + k * spacing`` (integers ``|k| <= 6``, exact in ``dtype``), the spacing (a
    power of two) and the exact float64 differences from the row max."""
    spacing = float(torch.finfo(dtype).eps) * 2.0 ** math.frexp(abs(offset))[1]
    k = torch.randint(-6, 7, (rows, n), generator=gen(seed)).to(F64)
    return (offset + spacing * k).to(dtype), spacing, (k - k.amax(-1, keepdim=True)) * spacing


@pytest.mark.parametrize("dtype,offset", [(torch.float32, 2.0 ** 25), (torch.float32, 1e30), (torch.float32, -1e30),
                                          (torch.float16, 1e4), (torch.bfloat16, -1e30)])
def test_large_scores_against_float64(dtype, offset):
    """Shift-invariant mappings of scores far from 0 equal float64 on the (exact) differences."""
    x, spacing, shifted = _offset_rows(offset, dtype, 25)
    fns = (lambda a, g: fusedmax(a, lam=0.3, gamma=g), lambda a, g: oscarmax(a, lam=0.05, gamma=g),
           lambda a, g: gamma_sparsemax(a, gamma=g), lambda a, g: sq_pnorm_max(a, gamma=g))
    for fn in fns:
        y = fn(x, spacing)
        assert y.dtype == dtype and torch.isfinite(y).all()
        torch.testing.assert_close(y.to(F64), fn(shifted, spacing), atol=TOL["lowp_vs_f64"][dtype], rtol=0)
    big = torch.tensor([[3e7, 3e7 - 0.5, 0.0]])
    torch.testing.assert_close(sq_pnorm_max(big), torch.tensor([[0.5, 0.5, 0.0]]), atol=TOL["lowp_vs_f64"][F32],
                               rtol=0)


def test_prox_large_magnitudes_against_float64():
    x = 1e30 * torch.randn(6, 9, generator=gen(26))
    x[0] = torch.tensor([3e38, -3e38, 0.0, 3e38, 1e38, -2e38, 5.0, -3e38, 3e38])
    for fn in (lambda a: tv_prox(a, lam=3e29), lambda a: oscar_prox(a, lam=2e28), lambda a: oscar_prox(a, lam=0.01)):
        y = fn(x)
        assert torch.isfinite(y).all()
        tol = TOL["lowp_vs_f64"][F32]
        torch.testing.assert_close(y.to(F64), fn(x.to(F64)),
                                   atol=1e30 * tol, rtol=tol)  # why: inputs of size 1e30: atol scales with them


def test_triton_tv_path_keeps_nan_inside_rows():
    """Positions past ``lengths`` give 0; a NaN inside a row is not hidden."""
    x = torch.randn(3, 6, generator=gen(27), dtype=F64)
    x[0, 2] = math.nan
    lengths = torch.tensor([6, 4, 0])
    y = _tv_prox_op(x, lengths, 0.2, True)
    valid = torch.arange(6) < lengths[:, None]
    assert (y[~valid] == 0).all()
    assert torch.isnan(y[0]).any() and torch.isfinite(y[1]).all()


def test_dim_and_batch_shapes():
    x = torch.randn(2, 3, 6, 5, generator=gen(22), dtype=F64)
    for fn in (lambda a, d: fusedmax(a, lam=0.2, dim=d), lambda a, d: oscarmax(a, dim=d),
               lambda a, d: sq_pnorm_max(a, dim=d)):
        ref = fn(x, -1)
        torch.testing.assert_close(fn(x.transpose(-1, 1), 1).transpose(-1, 1), ref, atol=TOL["ulps"][F64], rtol=0)
        torch.testing.assert_close(fn(x.movedim(-1, 0), 0).movedim(0, -1), ref, atol=TOL["ulps"][F64], rtol=0)
    lengths = torch.tensor([[5, 2, 0], [1, 3, 4]]).unsqueeze(-1).expand(2, 3, 6)
    out = fusedmax(x, lam=0.2, lengths=lengths)
    assert (out[1, 0, :, 1:] == 0).all() and (out[0, 2] == 0).all()


def test_modules():
    x = torch.randn(2, 4, 7, generator=gen(23), dtype=F64)
    mask = torch.rand(2, 4, 7, generator=gen(24)) > 0.3
    m = Fusedmax(lam=0.2, gamma=0.5)
    torch.testing.assert_close(m(x, mask=mask), fusedmax(x, lam=0.2, gamma=0.5, mask=mask), **EXACT)
    o = Oscarmax(lam=0.03, dim=1)
    torch.testing.assert_close(o(x), oscarmax(x, lam=0.03, dim=1), **EXACT)
    assert "lam=0.2" in repr(m)
