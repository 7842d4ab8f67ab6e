"""The project's input policy: non-finite scores and empty inputs on every row-wise path (the bad-argument
tables are in tests/test_bad_arguments.py).

Non-finite policy (README, "Non-finite values"; docs/design.md): ``-inf`` entries get weight 0, a row
with no finite entry gives zeros and zero gradients, a row with a NaN or ``+inf`` gives an all-NaN row and NaN
gradients, and the other rows of the batch are exactly what they are without the bad rows.
Each path is run on one batch holding every kind of row and compared with the same path on
the good rows alone. The Triton row kernels run under the interpreter on CPU.
"""

import math

import pytest
import torch
from helpers import EXACT, F64, TOL

import sparse_attn as sa
from sparse_attn.rows._triton_rows import entmax_rows_triton

NAN_ROW, POS_INF_ROW, EMPTY_ROW = 1, 2, 3
GOOD_ROWS = [0, 4, 5]  # row 4 has -inf entries
N_ROWS, N_COLS = 6, 7
ROW_ALPHA = torch.tensor([1.3, 1.5, 2.0, 1.0, 1.7, 1.0])


def _scores(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(N_ROWS, N_COLS, generator=g, dtype=torch.float64)).to(dtype)
    x[NAN_ROW, 3] = math.nan
    x[POS_INF_ROW, 5] = math.inf
    x[EMPTY_ROW] = -math.inf
    x[4, [0, 2]] = -math.inf
    return x


def _row_alpha(x, idx, dtype=None):
    return ROW_ALPHA[idx].view(-1, 1).to(dtype or x.dtype).requires_grad_()


def _bounds(x, idx):
    return torch.full_like(x, 0.6)


# name -> (fn(x, idx) returning (y, alpha or None), runs on the kernel device, dtypes)
PATHS = {
    "sparsemax": (lambda x, i: (sa.sparsemax(x), None), False),
    "sparsemax_k2": (lambda x, i: (sa.sparsemax(x, k=2), None), False),
    "entmax15": (lambda x, i: (sa.entmax15(x), None), False),
    "entmax15_k2": (lambda x, i: (sa.entmax15(x, k=2), None), False),
    "entmax_alpha1": (lambda x, i: (sa.entmax(x, 1.0), None), False),
    "entmax_alpha1.3": (lambda x, i: (sa.entmax(x, 1.3), None), False),
    "entmax_bisect_0.7": (lambda x, i: (sa.entmax_bisect(x, 0.7), None), False),
    "entmax_bisect_2.5": (lambda x, i: (sa.entmax_bisect(x, 2.5, ensure_sum_one=False), None), False),
    "entmax_row_alpha": (lambda x, i: (lambda a: (sa.entmax(x, a), a))(_row_alpha(x, i)), False),
    "entmax_bisect_row_alpha": (lambda x, i: (lambda a: (sa.entmax_bisect(x, a), a))(_row_alpha(x, i)), False),
    "Sparsemax": (lambda x, i: (sa.Sparsemax()(x), None), False),
    "Entmax15": (lambda x, i: (sa.Entmax15(k=3)(x), None), False),
    "EntmaxBisect": (lambda x, i: (sa.EntmaxBisect(1.2)(x), None), False),
    "Entmax": (lambda x, i: (sa.Entmax(1.8)(x), None), False),
    "triton_alpha1": (lambda x, i: (entmax_rows_triton(x, 1.0), None), True),
    "triton_alpha1.5": (lambda x, i: (entmax_rows_triton(x, 1.5), None), True),
    "triton_alpha2": (lambda x, i: (entmax_rows_triton(x, 2.0), None), True),
    "triton_alpha1.3": (lambda x, i: (entmax_rows_triton(x, 1.3), None), True),
    "triton_row_alpha": (lambda x, i: (lambda a: (entmax_rows_triton(x, a), a))(_row_alpha(x, i, torch.float32)),
                         True),
    "fusedmax": (lambda x, i: (sa.fusedmax(x, lam=0.3), None), False),
    "oscarmax": (lambda x, i: (sa.oscarmax(x, lam=0.1), None), False),
    "sq_pnorm_max": (lambda x, i: (sa.sq_pnorm_max(x, p=1.5), None), False),
    "gamma_sparsemax": (lambda x, i: (sa.gamma_sparsemax(x, gamma=0.5), None), False),
    "tv_prox": (lambda x, i: (sa.tv_prox(x, lam=0.3), None), False),
    "oscar_prox": (lambda x, i: (sa.oscar_prox(x, lam=0.1), None), False),
    "Fusedmax": (lambda x, i: (sa.Fusedmax(lam=0.2)(x), None), False),
    "Oscarmax": (lambda x, i: (sa.Oscarmax(lam=0.2)(x), None), False),
    "csoftmax": (lambda x, i: (sa.csoftmax(x, _bounds(x, i)), None), False),
    "csparsemax": (lambda x, i: (sa.csparsemax(x, _bounds(x, i)), None), False),
}
# Kernel-device paths (the Triton interpreter on CPU) take float16/bfloat16/float32 only.
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _cases():
    for name, (_, on_kernel) in PATHS.items():
        for dtype in _DTYPES:
            if on_kernel and dtype == torch.float64:
                continue
            if dtype in (torch.float16, torch.bfloat16) and not (on_kernel or name in ("sparsemax", "entmax15",
                                                                                     "entmax_alpha1.3", "fusedmax")):
                continue
            yield pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}")


@pytest.mark.parametrize("name,dtype", list(_cases()))
def test_nonfinite_rows(name, dtype, kernel_device):
    fn, on_kernel = PATHS[name]
    device = kernel_device if on_kernel else "cpu"
    x = _scores(dtype).to(device).requires_grad_()
    y, alpha = fn(x, list(range(N_ROWS)))
    assert y.shape == x.shape and y.dtype == dtype
    yd = y.detach().cpu()
    for r in (NAN_ROW, POS_INF_ROW):
        assert torch.isnan(yd[r]).all(), f"row {r} must be all NaN"
    assert (yd[EMPTY_ROW] == 0).all()
    assert (yd[4, [0, 2]] == 0).all() and torch.isfinite(yd[GOOD_ROWS]).all()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype).to(device)
    y.backward(g)
    gx = x.grad.cpu()
    for r in (NAN_ROW, POS_INF_ROW):
        assert torch.isnan(gx[r]).all(), f"gradient of row {r} must be all NaN"
    assert (gx[EMPTY_ROW] == 0).all() and (gx[4, [0, 2]] == 0).all()
    assert torch.isfinite(gx[GOOD_ROWS]).all()
    if alpha is not None:
        ga = alpha.grad.view(-1).cpu()
        assert torch.isnan(ga[[NAN_ROW, POS_INF_ROW]]).all() and float(ga[EMPTY_ROW]) == 0.0
    xs = _scores(dtype)[GOOD_ROWS].to(device).requires_grad_()
    ys, alpha_s = fn(xs, GOOD_ROWS)
    ys.backward(g[GOOD_ROWS])
    tol = TOL["same_values"][dtype]
    torch.testing.assert_close(yd[GOOD_ROWS], ys.detach().cpu(), atol=tol, rtol=0)
    torch.testing.assert_close(gx[GOOD_ROWS], xs.grad.cpu(), atol=tol, rtol=0)
    if alpha is not None:
        torch.testing.assert_close(alpha.grad.view(-1)[GOOD_ROWS].cpu(), alpha_s.grad.view(-1).cpu(), atol=tol, rtol=0)


@pytest.mark.parametrize("fn", [sa.fusedmax, sa.oscarmax, sa.sq_pnorm_max, sa.gamma_sparsemax, sa.tv_prox,
                                sa.oscar_prox, lambda x, mask: sa.csparsemax(x, torch.ones_like(x), mask=mask)])
def test_masked_nonfinite_entries_are_not_looked_at(fn):
    """A NaN or +inf at an entry excluded by ``mask`` or ``lengths`` leaves the row finite."""
    x = _scores(torch.float64)[[0, 5]]
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[:, -1] = False
    clean = fn(x, mask=mask)
    x[0, -1], x[1, -1] = math.nan, math.inf
    out = fn(x, mask=mask)
    torch.testing.assert_close(out, clean, **EXACT)


def test_nonfinite_rows_under_compile():
    """The traced PyTorch path (per-row alpha, fullgraph) follows the policy like eager."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, a: sa.entmax(x, a), fullgraph=True, backend="aot_eager")
    x = _scores(torch.float64).requires_grad_()
    a = _row_alpha(x, list(range(N_ROWS)))
    y = compiled(x, a)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y.backward(g)
    xe = _scores(torch.float64).requires_grad_()
    ae = _row_alpha(xe, list(range(N_ROWS)))
    ye = sa.entmax(xe, ae)
    ye.backward(g)
    torch.testing.assert_close(y, ye, atol=TOL["same_values"][F64], rtol=0, equal_nan=True)
    torch.testing.assert_close(x.grad, xe.grad, atol=TOL["same_values"][F64], rtol=0, equal_nan=True)
    torch.testing.assert_close(a.grad, ae.grad, atol=TOL["same_values"][F64], rtol=0, equal_nan=True)
    assert torch.isnan(y[NAN_ROW]).all() and torch.isnan(x.grad[POS_INF_ROW]).all()


def test_fertility_attention_nan_scores_stay_in_their_batch_entry():
    """A NaN score poisons that batch entry's attention (now and in later steps), not the others."""
    scores = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    module = sa.FertilityAttention(fertility=1.0)
    clean, _ = module(scores.clone())
    scores[1, 1, 2] = math.nan
    attn, state = module(scores)
    assert torch.isfinite(attn[1, 0]).all() and torch.isnan(attn[1, 1:]).all()
    torch.testing.assert_close(attn[[0, 2]], clean[[0, 2]], **EXACT)
    assert torch.isnan(state.cumulative[1]).all() and torch.isfinite(state.cumulative[[0, 2]]).all()


LOSSES = {
    "sparsemax": lambda x, t, **kw: sa.sparsemax_loss(x, t, **kw),
    "entmax15": lambda x, t, **kw: sa.entmax15_loss(x, t, **kw),
    "bisect1.3": lambda x, t, **kw: sa.entmax_bisect_loss(x, t, alpha=1.3, **kw),
    "bisect_row_alpha": lambda x, t, **kw: sa.entmax_bisect_loss(
        x, t, alpha=torch.linspace(1.1, 1.9, x.shape[0], dtype=torch.float64).view(-1, 1), **kw),
}


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("kind", ["labels", "proportions"])
def test_loss_nonfinite_logits(name, kind):
    """NaN/+inf logits: that row's loss and gradient are NaN, other rows as alone; ignored rows stay 0."""
    loss_fn = LOSSES[name]
    x = _scores(torch.float64)
    x[EMPTY_ROW] = torch.randn(N_COLS, dtype=torch.float64)
    x[EMPTY_ROW, 4] = math.nan
    x = x.requires_grad_()
    if kind == "labels":
        target = torch.tensor([1, 3, 0, -100, 1, 6])
    else:
        target = torch.softmax(torch.randn(N_ROWS, N_COLS, generator=torch.Generator().manual_seed(4),
                                           dtype=torch.float64), -1)
        target[4, [0, 2]] = 0.0
        target[4] /= target[4].sum()
    loss = loss_fn(x, target)
    assert torch.isnan(loss[[NAN_ROW, POS_INF_ROW]]).all()
    assert torch.isfinite(loss[GOOD_ROWS]).all()
    loss.backward(torch.ones_like(loss))
    assert torch.isnan(x.grad[[NAN_ROW, POS_INF_ROW]]).all()
    if kind == "labels":
        assert float(loss.detach()[EMPTY_ROW]) == 0.0 and (x.grad[EMPTY_ROW] == 0).all()
        keep = [0, 4, 5]
    else:
        assert torch.isnan(loss[EMPTY_ROW]) and torch.isnan(x.grad[EMPTY_ROW]).all()
        keep = GOOD_ROWS
    if name == "bisect_row_alpha":
        return
    xs = x.detach()[keep].clone().requires_grad_()
    ls = loss_fn(xs, target[keep])
    ls.backward(torch.ones_like(ls))
    torch.testing.assert_close(loss.detach()[keep], ls.detach(), atol=TOL["same_values"][F64], rtol=0)
    torch.testing.assert_close(x.grad[keep], xs.grad, atol=TOL["same_values"][F64], rtol=0)
    assert torch.isnan(loss_fn(x.detach(), target, reduction="mean"))


@pytest.mark.parametrize("bad,match", [
    (math.nan, "finite and >= 0"), (-0.25, "finite and >= 0"), (math.inf, "finite and >= 0"),
    (0.9, "sum to 1"),
])
def test_loss_bad_proportions(bad, match):
    x = torch.randn(3, 4, dtype=torch.float64)
    y = torch.full((3, 4), 0.25, dtype=torch.float64)
    y[1, 2] = bad
    if bad == -0.25:
        y[1, 3] = 0.75
    for loss_fn in LOSSES.values():
        with pytest.raises(ValueError, match=f"target.*{match}"):
            loss_fn(x, y)


def _empty_inputs():
    return [torch.empty(0, 5), torch.empty(3, 0), torch.empty(2, 0, 4)]


EMPTY_OK = [
    sa.sparsemax, sa.entmax15, lambda x: sa.entmax(x, 1.3), lambda x: sa.entmax_bisect(x, 0.8),
    lambda x: sa.entmax(x, torch.full((1,) * x.ndim, 1.5)), sa.Sparsemax(), sa.Entmax15(), sa.EntmaxBisect(),
    sa.Entmax(), lambda x: entmax_rows_triton(x, 1.5), sa.fusedmax, sa.oscarmax, sa.sq_pnorm_max,
    sa.gamma_sparsemax, sa.tv_prox, sa.oscar_prox,
    lambda x: sa.csoftmax(x, torch.ones_like(x)), lambda x: sa.csparsemax(x, torch.ones_like(x)),
]


@pytest.mark.parametrize("fn", EMPTY_OK)
def test_empty_inputs_give_empty_outputs(fn):
    for x in _empty_inputs():
        xr = x.clone().requires_grad_()
        y = fn(xr)
        assert y.shape == x.shape and y.dtype == x.dtype
        y.sum().backward()
        assert xr.grad.shape == x.shape


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_empty_batch(name):
    loss_fn = LOSSES[name]
    x = torch.empty(0, 5, dtype=torch.float64, requires_grad=True)
    for target in (torch.empty(0, dtype=torch.int64), torch.empty(0, 5, dtype=torch.float64)):
        assert loss_fn(x, target).shape == (0,)
        for reduction in ("sum", "mean"):
            out = loss_fn(x, target, reduction=reduction)
            assert out.shape == () and float(out.detach()) == 0.0
            out.backward()
    for mod in (sa.SparsemaxLoss(), sa.Entmax15Loss(), sa.EntmaxBisectLoss(alpha=1.2)):
        assert float(mod(x, torch.empty(0, dtype=torch.int64)).detach()) == 0.0
