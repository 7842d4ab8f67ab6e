"""Fenchel-Young losses: value vs closed forms, gradient p - target, reductions, edge cases."""

import math

import pytest
import torch
from helpers import F64, TOL, randn

from sparse_attn.losses import (
    Entmax15Loss,
    EntmaxBisectLoss,
    SparsemaxLoss,
    entmax15_loss,
    entmax_bisect_loss,
    sparsemax_loss,
)
from sparse_attn.mappings import entmax15, entmax_bisect, sparsemax

LOSSES = {
    "sparsemax": (sparsemax_loss, sparsemax),
    "entmax15": (entmax15_loss, entmax15),
    "bisect13": (lambda x, t, **kw: entmax_bisect_loss(x, t, alpha=1.3, **kw), lambda x: entmax_bisect(x, 1.3)),
    "bisect07": (lambda x, t, **kw: entmax_bisect_loss(x, t, alpha=0.7, **kw), lambda x: entmax_bisect(x, 0.7)),
    "bisect25": (lambda x, t, **kw: entmax_bisect_loss(x, t, alpha=2.5, **kw), lambda x: entmax_bisect(x, 2.5)),
}


def _labels(n, c, seed=0):
    return torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(seed))


def _proportions(n, c, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.rand(n, c, generator=g, dtype=torch.float64) * (torch.rand(n, c, generator=g) > 0.5)
    y[:, 0] += 0.1
    return y / y.sum(-1, keepdim=True)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("kind", ["labels", "proportions"])
def test_gradcheck_and_gradient_is_p_minus_target(name, kind):
    loss_fn, mapping = LOSSES[name]
    x = randn(5, 7, seed=1).requires_grad_()
    target = _labels(5, 7, seed=2) if kind == "labels" else _proportions(5, 7, seed=2)
    assert torch.autograd.gradcheck(lambda t: loss_fn(t, target), (x,))
    # second order: the Hessian is the mapping's Jacobian (not zero)
    assert torch.autograd.gradgradcheck(lambda t: loss_fn(t, target), (x,), **TOL["gradcheck"])
    (g,) = torch.autograd.grad(loss_fn(x, target).sum(), x)
    y = torch.nn.functional.one_hot(target, 7).double() if kind == "labels" else target
    torch.testing.assert_close(g, mapping(x.detach()) - y, atol=TOL["same_values"][F64], rtol=0)


@pytest.mark.parametrize("name", list(LOSSES))
def test_nonnegative_and_zero_at_own_prediction(name):
    loss_fn, mapping = LOSSES[name]
    x = randn(40, 9, seed=3)
    assert bool((loss_fn(x, _labels(40, 9, seed=4)) >= 0).all())
    assert bool((loss_fn(x, _proportions(40, 9, seed=5)) >= 0).all())
    torch.testing.assert_close(loss_fn(x, mapping(x)), torch.zeros(40, dtype=torch.float64),
                               atol=TOL["same_values"][F64], rtol=0)


def test_alpha_one_is_cross_entropy():
    x = randn(6, 10, seed=6)
    t = _labels(6, 10, seed=7)
    torch.testing.assert_close(entmax_bisect_loss(x, t, alpha=1.0),
                               torch.nn.functional.cross_entropy(x, t, reduction="none"))
    near = entmax_bisect_loss(x, t, alpha=1.0 + 1e-4)
    torch.testing.assert_close(near, torch.nn.functional.cross_entropy(x, t, reduction="none"),
                               atol=1e-3, rtol=0)  # why: alpha = 1 + 1e-4 is near softmax, not it (3.6e-4)


def test_sparsemax_loss_closed_form():
    x = randn(8, 6, seed=8)
    t = _labels(8, 6, seed=9)
    p = sparsemax(x)
    support = p > 0
    tau = torch.where(support, x - p, torch.zeros_like(x)).sum(-1) / support.sum(-1)
    expected = -x.gather(1, t[:, None]).squeeze(1) + 0.5 * (
        torch.where(support, x ** 2 - tau[:, None] ** 2, torch.zeros_like(x)).sum(-1)) + 0.5
    torch.testing.assert_close(sparsemax_loss(x, t), expected, atol=TOL["same_values"][F64], rtol=0)


def test_entmax15_loss_definition():
    x = randn(8, 6, seed=10)
    y = _proportions(8, 6, seed=11)
    p = entmax15(x)

    def tsallis15(q):
        return (1 - (q ** 1.5).sum(-1)) / 0.75

    expected = ((p - y) * x).sum(-1) + tsallis15(p) - tsallis15(y)
    torch.testing.assert_close(entmax15_loss(x, y), expected, atol=TOL["same_values"][F64], rtol=0)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "elementwise_mean"])
def test_ignore_index_and_reductions(reduction):
    x = randn(6, 5, seed=12).requires_grad_()
    t = _labels(6, 5, seed=13)
    t[[1, 4]] = -100
    per_row = sparsemax_loss(x, t, reduction="none")
    assert bool((per_row.detach()[[1, 4]] == 0).all())
    out = SparsemaxLoss(reduction=reduction)(x, t)
    expected = {"none": per_row, "sum": per_row.sum(), "mean": per_row.sum() / 4,
                "elementwise_mean": per_row.sum() / 4}[reduction]
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert bool((x.grad[[1, 4]] == 0).all())
    t_custom = _labels(6, 5, seed=13)
    t_custom[0] = 3
    loss = Entmax15Loss(ignore_index=3, reduction="none")(x.detach(), t_custom)
    assert bool((loss[t_custom == 3] == 0).all())


def test_all_ignored_mean_is_zero():
    x = randn(3, 4, seed=14)
    t = torch.full((3,), -100)
    for mod in (SparsemaxLoss(), Entmax15Loss(), EntmaxBisectLoss(alpha=1.2)):
        assert float(mod(x, t)) == 0.0


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_neg_inf_logits_give_finite_losses(name, dtype):
    loss_fn, _ = LOSSES[name]
    x = randn(4, 8, dtype=dtype, seed=15)
    x[:, :3] = -math.inf
    x = x.requires_grad_()
    t = torch.tensor([3, 4, 7, 5])
    loss = loss_fn(x, t)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert bool(torch.isfinite(loss).all()) and bool((loss >= 0).all())
    loss.sum().backward()
    assert bool(torch.isfinite(x.grad).all())
    assert bool((x.grad[:, :3] == 0).all())


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "elementwise_mean"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_ignored_rows_with_neg_inf_logits(name, reduction, dtype):
    loss_fn, mapping = LOSSES[name]
    x = randn(5, 6, seed=17)
    x[1] = -math.inf
    x[3, [0, 2, 5]] = -math.inf
    x[4, 1] = -math.inf
    x = x.to(dtype).requires_grad_()
    t = torch.tensor([2, -100, 4, -100, 0])
    keep = t != -100
    out = loss_fn(x, t, reduction=reduction)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert bool(torch.isfinite(out).all())
    kept = loss_fn(x.detach()[keep].double(), t[keep])
    expected = {"none": torch.zeros(5, dtype=torch.float64).index_put((keep,), kept), "sum": kept.sum(),
                "mean": kept.mean(), "elementwise_mean": kept.mean()}[reduction]
    tol = TOL["same_values"][F64] if dtype == F64 else TOL["lowp_vs_f64"][torch.float32]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    out.sum().backward()
    assert bool(torch.isfinite(x.grad).all())
    assert bool((x.grad[~keep] == 0).all())
    scale = 1.0 / int(keep.sum()) if reduction in ("mean", "elementwise_mean") else 1.0
    xk = x.detach()[keep].double()
    expected_grad = (mapping(xk) - torch.nn.functional.one_hot(t[keep], 6).double()) * scale
    tol = TOL["same_values"][F64] if dtype == F64 else TOL["lowp_vs_f64"][dtype]
    torch.testing.assert_close(x.grad[keep].double(), expected_grad, atol=tol, rtol=0)


@pytest.mark.parametrize("name", list(LOSSES))
def test_neg_inf_logits_with_zero_target_mass(name):
    loss_fn, mapping = LOSSES[name]
    x = randn(4, 7, seed=18)
    y = _proportions(4, 7, seed=19)
    dead = torch.zeros(4, 7, dtype=torch.bool)
    dead[0, [1, 3]] = True
    dead[2, [0, 4, 5, 6]] = True
    dead[3, 6] = True
    y = torch.where(dead, torch.zeros_like(y), y)
    y = y / y.sum(-1, keepdim=True)
    x = x.masked_fill(dead, -math.inf).requires_grad_()
    for reduction in ("none", "sum", "mean"):
        assert bool(torch.isfinite(loss_fn(x, y, reduction=reduction)).all())
    loss = loss_fn(x, y)
    (g,) = torch.autograd.grad(loss.sum(), x)
    assert bool(torch.isfinite(g).all()) and bool((g[dead] == 0).all())
    for i in range(4):
        live = ~dead[i]
        xi = x.detach()[i, live][None]
        torch.testing.assert_close(loss[i], loss_fn(xi, y[i, live][None])[0], atol=TOL["same_values"][F64], rtol=0)
        torch.testing.assert_close(g[i, live], mapping(xi)[0] - y[i, live], atol=TOL["same_values"][F64], rtol=0)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_large_logits_give_finite_float32_losses(name, dtype):
    loss_fn, _ = LOSSES[name]
    x = randn(64, 50, seed=20) * 5e3
    x[0, :2] = torch.tensor([6e4, -6e4])
    x = x.to(dtype).requires_grad_()
    assert bool(torch.isfinite(x).all())
    t = _labels(64, 50, seed=21)
    t[0] = 1
    loss = loss_fn(x, t)
    assert loss.dtype == torch.float32
    assert float(loss[0].detach()) > torch.finfo(torch.float16).max
    ref = loss_fn(x.detach().double(), t)
    torch.testing.assert_close(loss.double(), ref,
                               atol=0, rtol=1e-6)  # why: losses past fp16 max: float32 rounding, relative
    for reduction in ("sum", "mean"):
        out = loss_fn(x, t, reduction=reduction)
        assert out.dtype == torch.float32 and bool(torch.isfinite(out))
    loss.sum().backward()
    assert x.grad.dtype == dtype and bool(torch.isfinite(x.grad).all())


def test_module_learnable_alpha_is_accepted():
    x = randn(4, 6, seed=16)
    alpha = torch.nn.Parameter(torch.tensor(1.4, dtype=torch.float64))
    out = EntmaxBisectLoss(alpha=alpha)(x, _labels(4, 6))
    torch.testing.assert_close(out, entmax_bisect_loss(x, _labels(4, 6), alpha=1.4, reduction="mean"))
    per_row_alpha = torch.tensor([[1.2], [1.5], [2.0], [1.0]], dtype=torch.float64)
    per_row = entmax_bisect_loss(x, _labels(4, 6), alpha=per_row_alpha)
    for i, a in enumerate((1.2, 1.5, 2.0, 1.0)):
        torch.testing.assert_close(per_row[i], entmax_bisect_loss(x[i:i + 1], _labels(4, 6)[i:i + 1], alpha=a)[0])



_IGNORE_LOSSES = {
    "sparsemax": (sparsemax_loss, SparsemaxLoss),
    "entmax15": (entmax15_loss, Entmax15Loss),
    "bisect13": (lambda x, t, **kw: entmax_bisect_loss(x, t, alpha=1.3, **kw),
                 lambda **kw: EntmaxBisectLoss(alpha=1.3, **kw)),
}


@pytest.mark.parametrize("name", list(_IGNORE_LOSSES))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "elementwise_mean"])
def test_ignore_index_as_0d_integer_tensor(name, dtype, reduction):
    """``ignore_index`` given as a 0-d integer tensor (``target[0]``, as the entmax package's tests and many training
    loops pass it) gives exactly the losses and gradients of the same Python int, functional and module forms."""
    loss_fn, module = _IGNORE_LOSSES[name]
    x = randn(7, 5, seed=30).requires_grad_()
    t = _labels(7, 5, seed=31)
    t[[2, 5]] = int(t[0])
    index = t[0].to(dtype)
    assert index.ndim == 0
    want = loss_fn(x, t, ignore_index=int(t[0]), reduction=reduction)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    for got in (loss_fn(x, t, ignore_index=index, reduction=reduction),
                module(ignore_index=index, reduction=reduction)(x, t)):
        assert torch.equal(got, want)
        (grad,) = torch.autograd.grad(got.sum(), x)
        assert torch.equal(grad, want_grad)
    per_row, unmasked = loss_fn(x, t, ignore_index=index), loss_fn(x, t)
    ignored = t == t[0]
    assert bool((per_row[ignored] == 0).all()) and torch.equal(per_row[~ignored], unmasked[~ignored])


def test_ignore_index_tensor_in_module_and_error_message():
    """A CPU tensor index is stored by the module as the int it holds; the out-of-range label error names it."""
    mod = SparsemaxLoss(ignore_index=torch.tensor(3))
    assert mod.ignore_index == 3 and type(mod.ignore_index) is int
    with pytest.raises(ValueError, match=r"target labels must be in \[0, 4\] or equal ignore_index=2"):
        sparsemax_loss(randn(2, 5), torch.tensor([7, 2]), ignore_index=torch.tensor(2))


@pytest.mark.parametrize(
    "bad,exc,got",
    [
        (torch.tensor(3.0), TypeError, "got a tensor of dtype torch.float32"),
        (torch.tensor(True), TypeError, "got a tensor of dtype torch.bool"),
        (torch.tensor([1, 2]), ValueError, r"got a tensor of shape \(2,\)"),
        (torch.tensor([1]), ValueError, r"got a tensor of shape \(1,\)"),
        (3.0, TypeError, "got float"),
        ("pad", TypeError, "got str"),
        (True, TypeError, "got bool"),
        (None, TypeError, "got NoneType"),
    ],
    ids=["float-tensor", "bool-tensor", "two-element-tensor", "1d-tensor", "float", "str", "bool", "none"],
)
def test_ignore_index_rejects_everything_but_an_int_or_0d_integer_tensor(bad, exc, got):
    match = "ignore_index must be an int or a 0-d integer tensor, " + got
    x, t = randn(3, 4), _labels(3, 4)
    for call in (lambda: sparsemax_loss(x, t, ignore_index=bad), lambda: entmax15_loss(x, t, ignore_index=bad),
                 lambda: entmax_bisect_loss(x, t, ignore_index=bad), lambda: SparsemaxLoss(ignore_index=bad),
                 lambda: Entmax15Loss(ignore_index=bad), lambda: EntmaxBisectLoss(ignore_index=bad)):
        with pytest.raises(exc, match=match):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("labels_device", ["cuda", "cpu"])
def test_ignore_index_cuda_tensor(labels_device):
    """A CUDA 0-d index (``target[0]`` of CUDA labels) is compared on the device and kept there by the modules;
    with CPU labels and logits it is copied over. Losses equal those of the int index."""
    x = randn(6, 5, seed=32).to(labels_device)
    t = _labels(6, 5, seed=33).to(labels_device)
    t[3] = int(t[0])
    index = t[0].cuda()
    mod = Entmax15Loss(ignore_index=index, reduction="sum")
    assert isinstance(mod.ignore_index, torch.Tensor) and mod.ignore_index.is_cuda
    want = entmax15_loss(x, t, ignore_index=int(t[0]), reduction="none")
    got = entmax15_loss(x, t, ignore_index=index, reduction="none")
    assert got.device == x.device and torch.equal(got, want)
    assert torch.equal(mod(x, t), want.sum()) and bool((got[[0, 3]] == 0).all())
