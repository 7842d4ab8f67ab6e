"""What the ``entmax`` package's own tests check, restated for sparse_attn where the names match.

The package (deep-spin/entmax) tests its losses (non-negative; gradcheck with ``ignore_index`` given as an int or
as ``y[0]``, reductions ``"sum"`` and ``"elementwise_mean"``; ignoring a label lowers the summed loss), its
bisection solvers (agreement with the sort-based sparsemax and 1.5-entmax; gradcheck w.r.t. ``X`` and ``alpha``,
scalar or one per row; any ``dim``) and its partial sort (``k``: the same threshold and support as a full sort;
gradcheck of the modules with ``k``). The same properties are checked here, written for this library's API:

* ``sparsemax_bisect`` / ``SparsemaxBisectLoss`` are ``entmax_bisect(alpha=2)`` / ``EntmaxBisectLoss(alpha=2)``;
* the package's private threshold functions are checked through the public outputs and their support;
* ``normmax_bisect``, ``budget_bisect`` and their losses and modules have no counterpart and are not ported.
"""

import itertools
from functools import partial

import pytest
import torch
from helpers import F64, TOL, assert_close_to_ref, gen, randn

from sparse_attn import (
    Entmax15,
    Entmax15Loss,
    EntmaxBisect,
    EntmaxBisectLoss,
    Sparsemax,
    SparsemaxLoss,
    entmax15,
    entmax15_loss,
    entmax_bisect,
    entmax_bisect_loss,
    sparsemax,
    sparsemax_loss,
)

LOSS_MODULES = {
    "sparsemax": SparsemaxLoss,
    "sparsemax-k5": partial(SparsemaxLoss, k=5),
    "entmax15": Entmax15Loss,
    "entmax15-k5": partial(Entmax15Loss, k=5),
    "sparsemax-bisect": partial(EntmaxBisectLoss, alpha=2.0),
    "entmax-bisect": EntmaxBisectLoss,
    "entmax-bisect-13": partial(EntmaxBisectLoss, alpha=1.3),
}
MAPPINGS = {"sparsemax": (sparsemax, 2.0), "entmax15": (entmax15, 1.5)}


def _batch(seed, n=4, c=10):
    """float64 logits ``(n, c)`` and labels drawn as the argmax of independent noise (as the package's tests do)."""
    g = gen(seed)
    x = torch.randn(n, c, generator=g, dtype=F64)
    labels = torch.randn(n, c, generator=g, dtype=F64).argmax(dim=1)
    return x, labels


def _loss_tol(x):
    """The loss entry of the tolerance table, relative to 1 + the largest |logit| (float64 losses)."""
    return TOL["eps_loss"][F64] * (1 + float(x.detach().abs().max()))


# --- losses (the package's test_losses.py) --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LOSS_MODULES))
def test_losses_are_nonnegative(name):
    for seed in range(5):
        x, y = _batch(seed)
        loss = LOSS_MODULES[name](reduction="none")(x, y)
        assert loss.shape == (4,) and bool((loss >= 0).all())


@pytest.mark.parametrize("name", list(LOSS_MODULES))
@pytest.mark.parametrize("ignore", ["default", "int", "tensor"])
@pytest.mark.parametrize("reduction", ["sum", "elementwise_mean"])
def test_loss_gradcheck_with_ignore_index(name, ignore, reduction):
    """gradcheck of the module losses in float64 with ``ignore_index`` -100, ``int(y[0])`` or the 0-d tensor ``y[0]``;
    rows with the ignored label get a zero gradient."""
    for seed in range(5):
        x, y = _batch(seed + 10)
        x.requires_grad_()
        index = {"default": -100, "int": int(y[0]), "tensor": y[0]}[ignore]
        loss = LOSS_MODULES[name](ignore_index=index, reduction=reduction)
        assert torch.autograd.gradcheck(lambda t, loss=loss, y=y: loss(t, y), (x,), eps=1e-5)
        (g,) = torch.autograd.grad(loss(x, y), x)
        if ignore != "default":
            assert bool((g[y == y[0]] == 0).all())


@pytest.mark.parametrize("name", list(LOSS_MODULES))
def test_ignoring_the_costliest_label_lowers_the_summed_loss(name):
    """Ignoring (as a 0-d tensor ``y[ix]``) the label of the row with the largest loss lowers the summed loss, by
    exactly the losses of the rows with that label."""
    g = gen(40)
    x = torch.randn(20, 6, generator=g, dtype=F64)
    y = torch.randn(20, 6, generator=g, dtype=F64).argmax(dim=1)
    module = LOSS_MODULES[name]
    per_row = module(reduction="none", ignore_index=-100)(x, y)
    ix = per_row.argmax()
    ignored = module(reduction="sum", ignore_index=y[ix])(x, y)
    full = module(reduction="sum", ignore_index=-100)(x, y)
    assert ignored < full
    expected = full - per_row[y == y[ix]].sum()
    torch.testing.assert_close(ignored, expected, atol=TOL["same_values"][F64], rtol=0)


@pytest.mark.parametrize("alpha", [2.0, 1.5, 1.3, 0.7, 2.5])
def test_label_loss_equals_its_definition(alpha):
    """``L(x; e_y) = Omega(e_y) - Omega(p) + <p - e_y, x> = H(p) + <p - e_y, x>`` with the Tsallis entropy
    ``H(p) = -Omega(p) = (1 - sum_j p_j ** alpha) / (alpha (alpha - 1))`` (0 at a one-hot ``e_y``) and
    ``p = alpha-entmax(x)`` (the exact mappings at 2 and 1.5, the solver otherwise)."""
    x, y = _batch(50, n=8, c=7)
    x = 2 * x
    if alpha == 2.0:
        loss, p = sparsemax_loss(x, y), sparsemax(x)
    elif alpha == 1.5:
        loss, p = entmax15_loss(x, y), entmax15(x)
    else:
        loss, p = entmax_bisect_loss(x, y, alpha=alpha), entmax_bisect(x, alpha)
    onehot = torch.nn.functional.one_hot(y, 7).to(F64)
    entropy = (1 - (p ** alpha).sum(-1)) / (alpha * (alpha - 1))
    expected = entropy + ((p - onehot) * x).sum(-1)
    torch.testing.assert_close(loss, expected, atol=_loss_tol(x), rtol=0)


@pytest.mark.parametrize("alpha,exact", [(2.0, sparsemax_loss), (1.5, entmax15_loss)], ids=["sparsemax", "entmax15"])
def test_bisect_losses_match_the_exact_ones(alpha, exact):
    """The solver's losses (``EntmaxBisectLoss(alpha=2)`` is the package's ``SparsemaxBisectLoss``) equal the
    sort-based ones: values to the loss tolerance, gradients by the mapping rule."""
    x, y = _batch(60, n=16, c=12)
    x = (3 * x).requires_grad_()
    got, want = entmax_bisect_loss(x, y, alpha=alpha), exact(x, y)
    torch.testing.assert_close(got, want, atol=_loss_tol(x), rtol=0)
    (g_got,) = torch.autograd.grad(got.sum(), x)
    (g_want,) = torch.autograd.grad(want.sum(), x)
    assert_close_to_ref(g_got, g_want, eps=TOL["eps_mapping"], name="dX")


@pytest.mark.parametrize("k", [1, 5, 100])
def test_partial_sort_losses_equal_full_sort(k):
    """The losses with ``k`` (the package's ``Entmax15Loss`` defaults to ``k=100``) equal those of a full sort."""
    x, y = _batch(70, n=6, c=150)
    for loss_fn in (sparsemax_loss, entmax15_loss):
        assert torch.equal(loss_fn(x, y, k=k), loss_fn(x, y))
    assert torch.equal(Entmax15Loss(k=k)(x, y), Entmax15Loss()(x, y))


# --- iterative solver (the package's test_root_finding.py) ----------------------------------------------------


@pytest.mark.parametrize("name", list(MAPPINGS))
def test_bisect_matches_exact_fp32(name):
    """float32 ``entmax_bisect`` at alpha 2 / 1.5 and the sort-based mapping both meet the mapping rule against the
    float64 sort-based result."""
    fn, alpha = MAPPINGS[name]
    x = randn(4, 6, dtype=torch.float32, scale=0.5, seed=80)
    ref64 = fn(x.double(), 1)
    assert_close_to_ref(entmax_bisect(x, alpha=alpha), ref64, eps=TOL["eps_mapping"], name="entmax_bisect")
    assert_close_to_ref(fn(x, 1), ref64, eps=TOL["eps_mapping"], name=name)


def test_sparsemax_bisect_gradcheck():
    x = randn(4, 6, seed=81).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: entmax_bisect(t, 2.0), (x,), eps=1e-5)


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.75, 1.2, 1.5, 1.75, 2.25])
def test_entmax_bisect_gradcheck_scalar_alpha_tensor(alpha):
    x = randn(4, 6, scale=1.0, seed=82).requires_grad_()
    a = torch.tensor(alpha, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(entmax_bisect, (x, a), eps=1e-5)


def _row_alphas(shape, seed):
    """alpha in (0.05, 2.55), as in the package's tests (float64)."""
    return 0.05 + 2.5 * torch.rand(*shape, generator=gen(seed), dtype=F64)


def test_per_row_alphas_equal_row_by_row_calls():
    x = randn(4, 6, scale=1.0, seed=83)
    alpha = _row_alphas((4, 1), 84)
    p = entmax_bisect(x, alpha)
    for i in range(4):
        torch.testing.assert_close(p[i], entmax_bisect(x[i:i + 1], float(alpha[i]))[0],
                                   atol=TOL["same_values"][F64], rtol=0)


def test_per_row_alphas_gradcheck():
    x = randn(4, 6, scale=1.0, seed=85).requires_grad_()
    alpha = _row_alphas((4, 1), 86).requires_grad_()
    assert torch.autograd.gradcheck(entmax_bisect, (x, alpha), eps=1e-5)


def _alpha_shape(shape, dim):
    return [1 if i == dim else s for i, s in enumerate(shape)]


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_any_dim_with_one_alpha_per_row(dim):
    """On a 4-d input, alphas of size 1 along ``dim`` act row by row: every slice along ``dim`` equals the 1-row call
    with its own alpha."""
    shape = [3, 4, 2, 5]
    x = randn(*shape, scale=1.0, seed=87 + dim)
    alphas = _row_alphas(_alpha_shape(shape, dim), 91 + dim)
    p = entmax_bisect(x, alpha=alphas, dim=dim)
    ranges = [[slice(None)] if i == dim else range(s) for i, s in enumerate(shape)]
    for ix in itertools.product(*ranges):
        want = entmax_bisect(x[ix].unsqueeze(0), alpha=float(alphas[ix].reshape(())), dim=-1)[0]
        torch.testing.assert_close(p[ix], want, atol=TOL["same_values"][F64], rtol=0)


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_any_dim_gradcheck(dim):
    shape = [3, 4, 2, 5]
    x = randn(*shape, scale=1.0, seed=95 + dim).requires_grad_()
    alphas = _row_alphas(_alpha_shape(shape, dim), 99 + dim).requires_grad_()
    assert torch.autograd.gradcheck(partial(entmax_bisect, dim=dim), (x, alphas), eps=1e-5)


# --- partial sort (the package's test_topk.py) ----------------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("module", [Sparsemax, Entmax15])
def test_partial_sort_modules_gradcheck(dim, module):
    x = randn(3, 4, 5, scale=1.0, seed=103 + dim).requires_grad_()
    mapping = module(dim=dim, k=3)
    assert torch.autograd.gradcheck(mapping, (x,))
    assert torch.equal(mapping(x), module(dim=dim)(x))


@pytest.mark.parametrize("name", list(MAPPINGS))
@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("coef", [1e-5, 0.5, 1e4])
@pytest.mark.parametrize("k", [1, 2, 5, 30])
def test_partial_sort_equals_full_sort(name, dim, coef, k):
    """Sorting only the top ``k`` (k below, at or above the row length; tiny, moderate and huge scores) gives the
    full sort's output bit for bit, hence the same support."""
    fn, _ = MAPPINGS[name]
    x = randn(3, 4, 5, dtype=torch.float32, scale=coef, seed=107 + dim)
    full, part = fn(x, dim=dim), fn(x, dim=dim, k=k)
    assert torch.equal(part, full)
    assert torch.equal((part > 0).sum(dim), (full > 0).sum(dim))


def test_positional_arguments_follow_the_entmax_package():
    """Code written for the entmax package's positional signatures runs unchanged: ``sparsemax(X, dim, k)``,
    ``entmax15(X, dim, k)``, ``entmax_bisect(X, alpha, dim, n_iter, ensure_sum_one)``, ``sparsemax_loss(X, target,
    k)``, ``entmax_bisect_loss(X, target, alpha, n_iter)``, the modules' ``(k, ignore_index, reduction)``,
    ``(alpha, n_iter, ignore_index, reduction)``, ``(dim, k)`` and ``(alpha, dim, n_iter)``."""
    x = randn(5, 7, seed=110)
    y = _batch(111, n=5, c=7)[1]
    assert torch.equal(sparsemax(x, 0, 3), sparsemax(x, dim=0, k=3))
    assert torch.equal(entmax15(x, 0, 3), entmax15(x, dim=0, k=3))
    assert torch.equal(entmax_bisect(x, 1.3, 0, 80, True), entmax_bisect(x, alpha=1.3, dim=0, n_iter=80))
    assert torch.equal(sparsemax_loss(x, y, 3), sparsemax_loss(x, y, k=3))
    assert torch.equal(entmax15_loss(x, y, 3), entmax15_loss(x, y, k=3))
    assert torch.equal(entmax_bisect_loss(x, y, 1.3, 80), entmax_bisect_loss(x, y, alpha=1.3, n_iter=80))
    per_row = sparsemax_loss(x, y, k=3)
    keep = y != y[0]
    assert torch.equal(SparsemaxLoss(3, y[0], "sum")(x, y), per_row[keep].sum())
    assert torch.equal(Entmax15Loss(3, -100, "none")(x, y), entmax15_loss(x, y))
    assert torch.equal(EntmaxBisectLoss(1.3, 80, y[0], "elementwise_mean")(x, y),
                       entmax_bisect_loss(x, y, 1.3, 80, ignore_index=int(y[0]), reduction="mean"))
    assert torch.equal(Sparsemax(0, 3)(x), sparsemax(x, dim=0))
    assert torch.equal(Entmax15(0, 3)(x), entmax15(x, dim=0))
    assert torch.equal(EntmaxBisect(1.3, 0, 80)(x), entmax_bisect(x, 1.3, dim=0))
