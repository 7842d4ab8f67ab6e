"""Triton alpha-entmax row kernels against a float64 bisection reference and the PyTorch path.

On a CPU box the kernels run under the Triton interpreter (tests/conftest.py), so shapes
stay small (rows of a few hundred to ~2k columns); vocabulary-sized rows are marked gpu.
"""

import math

import pytest
import torch
from helpers import TOL, max_abs_err, scaled_err

from sparse_attn.kernels.rows.row_entmax import MODE_GENERAL, entmax_rows_bwd, entmax_rows_fwd, row_mode
from sparse_attn.mappings import entmax
from sparse_attn.rows._triton_rows import entmax_rows_triton

ALPHAS = [1.0, 1.25, 1.5, 2.0]

def _ref_row(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """float64 alpha-entmax of one row ``x`` (n,) with a 0-d alpha tensor, differentiable in both.

    tau by bisection to 1e-15 (no grad), then one Newton step, which leaves the value
    unchanged and makes the gradient the implicit-function one. At alpha = 1 (softmax)
    the alpha-derivative is its alpha -> 1 limit (docs/backward.md), added as ``(a - 1) * dp``.
    """
    finite = x > float("-inf")
    if not bool(finite.any()):
        return torch.where(finite, x, torch.zeros_like(x)) * 0.0 + 0.0 * a
    if float(a.detach()) == 1.0:
        p = torch.softmax(x, dim=0)
        log_p = torch.log(torch.where(p > 0, p, torch.ones_like(p))).detach()
        h_log_p = -p.detach() * log_p * log_p
        return p + (a - 1.0) * (h_log_p - p.detach() * h_log_p.sum()) / 2
    xs = torch.where(finite, x - x[finite].max().detach(), torch.zeros_like(x))
    e = a - 1.0
    beta = 1.0 / e
    z = e * xs

    def powers(tau, b):
        w = z - tau
        live = finite & (w > 0)
        return torch.where(live, torch.where(live, w, torch.ones_like(w)) ** b, torch.zeros_like(w))

    with torch.no_grad():
        lo, hi = -1.0, 0.0
        for _ in range(80):
            mid = 0.5 * (lo + hi)
            if float(powers(mid, beta).sum()) >= 1.0:
                lo = mid
            else:
                hi = mid
        tau0 = torch.tensor(lo, dtype=torch.float64)
    tau = tau0 + (powers(tau0, beta).sum() - 1.0) / (beta * powers(tau0, beta - 1.0).sum())
    return powers(tau, beta)


def _ref(x: torch.Tensor, alpha) -> torch.Tensor:
    """Rows ``x`` (R, n) float64; ``alpha`` float or float64 tensor (R,) (differentiable)."""
    rows = []
    for i in range(x.shape[0]):
        a = alpha[i] if isinstance(alpha, torch.Tensor) else torch.tensor(float(alpha), dtype=torch.float64)
        rows.append(_ref_row(x[i], a))
    return torch.stack(rows)


def _inputs(n_rows, n_cols, dtype, device, scale=2.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n_rows, n_cols, generator=gen, dtype=torch.float64) * scale).to(dtype)
    dy = torch.randn(n_rows, n_cols, generator=gen, dtype=torch.float64).to(dtype)
    return x.to(device), dy.to(device)


def _check_against_ref(x, dy, alpha, dtype, check_grad=True):
    """Kernel vs float64 reference on the same (rounded) inputs: forward, dX and dalpha."""
    xk = x.clone().requires_grad_(check_grad)
    ak = alpha.clone().requires_grad_(check_grad) if isinstance(alpha, torch.Tensor) else alpha
    y = entmax_rows_triton(xk, ak.view(-1, 1) if isinstance(ak, torch.Tensor) else ak)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.isfinite(y).all()
    xr = x.detach().cpu().double().requires_grad_(check_grad)
    ar = alpha.detach().cpu().double().requires_grad_(check_grad) if isinstance(alpha, torch.Tensor) else alpha
    ref = _ref(xr, ar)
    assert max_abs_err(y, ref) <= TOL["lowp_vs_f64"][dtype]
    if not check_grad:
        return y
    y.backward(dy)
    ref.backward(dy.cpu().double())
    assert xk.grad.dtype == dtype and torch.isfinite(xk.grad).all()
    assert scaled_err(xk.grad.cpu(), xr.grad) <= TOL["rows_dx"][dtype]
    if isinstance(alpha, torch.Tensor):
        assert torch.isfinite(ak.grad).all()
        assert scaled_err(ak.grad.cpu(), ar.grad) <= TOL["rows_dalpha"][dtype]
    return y


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_backward_scalar_alpha(alpha, dtype, kernel_device):
    x, dy = _inputs(3, 701, dtype, kernel_device, seed=int(alpha * 100))
    y = _check_against_ref(x, dy, alpha, dtype)
    sums = y.detach().double().sum(-1)
    assert float((sums - 1).abs().max()) <= TOL["sum"][dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_row_alpha_mixed(dtype, kernel_device):
    alpha = torch.tensor([1.0, 1.25, 1.5, 2.0, 1.07, 1.83, 1.0005, 1.6], dtype=torch.float32, device=kernel_device)
    x, dy = _inputs(alpha.numel(), 333, dtype, kernel_device, seed=1)
    _check_against_ref(x, dy, alpha, dtype)


def test_continuous_at_alpha_one(kernel_device):
    """alpha = 1 + 1e-6 (general solver) is within O(1e-6) of alpha = 1 (softmax), values and alpha-gradients."""
    x, dy = _inputs(3, 900, torch.float32, kernel_device, scale=4.0, seed=9)
    grads = []
    outs = []
    for a in (1.0, 1.0 + 1e-6):
        ak = torch.full((3, 1), a, device=kernel_device, requires_grad=True)
        y = entmax_rows_triton(x, ak)
        y.backward(dy)
        outs.append(y.detach())
        grads.append(ak.grad.view(-1))
    assert max_abs_err(outs[1], outs[0]) <= 1e-5
    assert scaled_err(grads[1], grads[0]) <= 1e-4


def test_rows_sum_to_one_and_support_matches(kernel_device):
    alpha = torch.tensor([1.2, 1.5, 1.75, 2.0], dtype=torch.float64)
    x, _ = _inputs(4, 1500, torch.float32, kernel_device, scale=3.0, seed=3)
    y = entmax_rows_triton(x, alpha.view(-1, 1).float().to(kernel_device)).double().cpu()
    assert float((y.sum(-1) - 1).abs().max()) <= TOL["sum"][torch.float32]
    ref = _ref(x.double().cpu(), alpha)
    assert (ref >= 0).all() and (y >= 0).all()
    # Away from the threshold the support must agree exactly.
    clear = (ref > 1e-4) | (ref == 0)
    for i in range(4):
        e = float(alpha[i]) - 1
        margin = ref[i] ** e
        clear[i] &= (ref[i] == 0) | (margin > 1e-3)
    assert torch.equal((y > 0)[clear], (ref > 0)[clear])


@pytest.mark.parametrize("n_cols", [1, 2, 17, 100, 1003])
def test_odd_lengths_and_small_blocks(n_cols, kernel_device):
    """Launcher level with BLOCK 16/64: many chunks, dead-chunk skipping, ragged last chunk."""
    x, dy = _inputs(2, n_cols, torch.float32, kernel_device, scale=4.0, seed=n_cols)
    for alpha in (1.0, 1.3, 1.5, 2.0):
        block = 16 if n_cols < 200 else 64
        y = entmax_rows_fwd(x, alpha, row_mode(alpha), block=block)
        ref = _ref(x.double().cpu(), alpha)
        assert max_abs_err(y, ref) <= TOL["lowp_vs_f64"][torch.float32]
        a_rows = torch.full((2,), alpha, device=kernel_device)
        dx, da = entmax_rows_bwd(y, dy, a_rows, MODE_GENERAL, need_dalpha=True, block=block)
        xr = x.double().cpu().requires_grad_()
        ar = torch.full((2,), alpha, dtype=torch.float64, requires_grad=True)
        _ref(xr, ar).backward(dy.double().cpu())
        assert scaled_err(dx.cpu(), xr.grad) <= TOL["rows_dx"][torch.float32]
        if n_cols > 1:
            assert scaled_err(da.cpu(), ar.grad) <= TOL["rows_dalpha"][torch.float32]
        else:
            assert float(da.abs().max()) == 0.0


@pytest.mark.parametrize("alpha", ALPHAS + [1.3])
def test_neg_inf_entries_and_rows(alpha, kernel_device):
    x, dy = _inputs(5, 300, torch.float32, kernel_device, seed=4)
    gen = torch.Generator().manual_seed(5)
    masked = (torch.rand(5, 300, generator=gen) < 0.4).to(kernel_device)
    masked[2] = True
    masked[4, 1:] = True
    x = x.masked_fill(masked, float("-inf"))
    a = torch.full((5, 1), alpha, device=kernel_device, requires_grad=True)
    xk = x.clone().requires_grad_()
    y = entmax_rows_triton(xk, a)
    y.backward(dy)
    assert not torch.isnan(y).any() and not torch.isnan(xk.grad).any() and not torch.isnan(a.grad).any()
    assert (y[masked] == 0).all() and (xk.grad[masked] == 0).all()
    assert (y[2] == 0).all() and (xk.grad[2] == 0).all() and float(a.grad[2]) == 0.0
    assert float(y.detach()[4, 0]) == 1.0
    keep = [0, 1, 3]
    xr = x[keep].double().cpu().requires_grad_()
    ar = torch.full((3,), alpha, dtype=torch.float64, requires_grad=True)
    ref = _ref(xr, ar)
    ref.backward(dy[keep].double().cpu())
    assert max_abs_err(y[keep], ref) <= TOL["lowp_vs_f64"][torch.float32]
    assert scaled_err(xk.grad[keep].cpu(), xr.grad) <= TOL["rows_dx"][torch.float32]
    if alpha != 1.0:
        assert scaled_err(a.grad.view(-1)[keep].cpu(), ar.grad) <= TOL["rows_dalpha"][torch.float32]


@pytest.mark.parametrize(
    "dtype, scale", [(torch.float32, 1e30), (torch.float16, 1e4), (torch.bfloat16, 1e4)]
)
def test_huge_magnitudes(dtype, scale, kernel_device):
    x, dy = _inputs(4, 200, dtype, kernel_device, scale=scale, seed=6)
    x[1] = x[1].abs().neg()
    for alpha in (1.0, 1.3, 1.5, 2.0):
        a = torch.full((4, 1), alpha, device=kernel_device, requires_grad=True)
        xk = x.clone().requires_grad_()
        y = entmax_rows_triton(xk, a)
        y.backward(dy)
        assert torch.isfinite(y).all() and torch.isfinite(xk.grad).all() and torch.isfinite(a.grad).all()
        ref = _ref(x.double().cpu(), alpha)
        assert max_abs_err(y, ref) <= TOL["lowp_vs_f64"][dtype]


def test_dim_and_broadcast_alpha(kernel_device):
    """Normalizing over a middle dim with one alpha per (batch, head), as the mappings do."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 150, 3, generator=gen).to(kernel_device)
    alpha = torch.tensor([[1.0, 1.4, 2.0]], device=kernel_device).view(1, 1, 3).expand(2, 1, 3).contiguous()
    xk = x.clone().requires_grad_()
    ak = alpha.clone().requires_grad_()
    y = entmax_rows_triton(xk, ak, dim=-2)
    dy = torch.randn(y.shape, generator=gen).to(kernel_device)
    y.backward(dy)
    xr = x.double().cpu().movedim(1, -1).reshape(-1, 150).requires_grad_()
    ar = alpha.double().cpu().movedim(1, -1).reshape(-1).requires_grad_()
    ref = _ref(xr, ar)
    ref.backward(dy.double().cpu().movedim(1, -1).reshape(-1, 150))
    got = y.double().cpu().movedim(1, -1).reshape(-1, 150)
    assert max_abs_err(got, ref) <= TOL["lowp_vs_f64"][torch.float32]
    assert scaled_err(xk.grad.cpu().movedim(1, -1).reshape(-1, 150), xr.grad) <= TOL["rows_dx"][torch.float32]
    assert scaled_err(ak.grad.cpu().reshape(-1), ar.grad) <= TOL["rows_dalpha"][torch.float32]
    assert ak.grad.shape == alpha.shape


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 1.37, "rows"])
def test_agrees_with_pytorch_path(alpha, kernel_device):
    """The Triton kernels and ``sparse_attn.mappings.entmax`` (PyTorch path) agree."""
    x, dy = _inputs(4, 512, torch.float32, kernel_device, seed=8)
    if alpha == "rows":
        alpha = torch.tensor([[1.1], [1.5], [1.9], [2.0]], device=kernel_device)
    xk, xp = x.clone().requires_grad_(), x.detach().cpu().clone().requires_grad_()
    if isinstance(alpha, torch.Tensor):
        ak, ap = alpha.clone().requires_grad_(), alpha.detach().cpu().clone().requires_grad_()
    else:
        ak = ap = alpha
    yk, yp = entmax_rows_triton(xk, ak), entmax(xp, ap)
    assert float(((yk.detach().cpu() - yp.detach()) ** 2).sum(-1).max()) < 1e-7
    yk.backward(dy)
    yp.backward(dy.cpu())
    assert scaled_err(xk.grad.cpu(), xp.grad) <= 1e-4
    if isinstance(alpha, torch.Tensor):
        assert scaled_err(ak.grad.cpu(), ap.grad) <= 1e-4


def test_bad_arguments(kernel_device):
    x = torch.randn(2, 20, device=kernel_device)
    with pytest.raises(TypeError, match="X"):
        entmax_rows_triton(x.double(), 1.5)
    with pytest.raises(TypeError, match="X"):
        entmax_rows_triton(torch.ones(2, 3, dtype=torch.int64, device=kernel_device), 1.5)
    with pytest.raises(TypeError, match="X"):
        entmax_rows_triton([1.0, 2.0], 1.5)
    for bad in (0.5, 2.5, math.nan):
        with pytest.raises(ValueError, match="alpha"):
            entmax_rows_triton(x, bad)
    with pytest.raises(ValueError, match="alpha"):
        entmax_rows_triton(x, torch.full((2, 1), 0.9, device=kernel_device))
    with pytest.raises(ValueError, match="alpha"):
        entmax_rows_triton(x, torch.full((2, 20), 1.5, device=kernel_device))
    with pytest.raises(ValueError, match="dim"):
        entmax_rows_triton(x, 1.5, dim=2)
    with pytest.raises(TypeError, match="dim"):
        entmax_rows_triton(x, 1.5, dim=1.0)
    assert entmax_rows_triton(torch.empty(0, 5, device=kernel_device), 1.5).shape == (0, 5)


@pytest.mark.parametrize("shape,dim", [((1, 2), 0), ((2, 1, 3), 1)])
def test_rows_of_length_one_along_any_dim(shape, dim, kernel_device):
    x = torch.randn(*shape, device=kernel_device, requires_grad=True)
    y = entmax_rows_triton(x, 1.5, dim=dim)
    assert torch.equal(y, torch.ones_like(y))
    y.backward(torch.randn_like(y))
    assert (x.grad == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("n_cols", [32768, 131072, 262147])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_rows_gpu(n_cols, dtype):
    alpha = torch.tensor([1.0, 1.2, 1.5, 2.0, 1.7, 1.05], device="cuda")
    x, dy = _inputs(alpha.numel(), n_cols, dtype, "cuda", scale=3.0, seed=n_cols)
    _check_against_ref(x, dy, alpha, dtype)


def test_custom_ops_opcheck(kernel_device):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of the row ops."""
    from sparse_attn.rows._triton_rows import _rows_bwd_op, _rows_fwd_op

    x, dy = _inputs(3, 40, torch.float32, kernel_device, seed=12)
    alpha = torch.tensor([1.0, 1.4, 2.0], device=kernel_device)
    for args in ((x, None, 1.5), (x.clone().requires_grad_(), alpha.clone().requires_grad_(), 1.0)):
        torch.library.opcheck(_rows_fwd_op, args)
    y = _rows_fwd_op(x, alpha, 1.0)
    torch.library.opcheck(_rows_bwd_op, (y, dy, alpha, 1.0, True))
    torch.library.opcheck(_rows_bwd_op, (y, dy, None, 1.3, False))


def test_compiles_fullgraph_and_rejects_double_backward(kernel_device):
    """The custom op traces under torch.compile(fullgraph=True); the kernel backward is first order only."""
    x, dy = _inputs(3, 50, torch.float32, kernel_device, seed=13)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: entmax_rows_triton(t, 1.3), fullgraph=True, backend="aot_eager")
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    yc, ye = compiled(xc), entmax_rows_triton(xe, 1.3)
    yc.backward(dy)
    ye.backward(dy)
    assert torch.equal(yc, ye) and torch.equal(xc.grad, xe.grad)
    xd = x.clone().requires_grad_()
    y = entmax_rows_triton(xd, 1.3)
    with pytest.raises(RuntimeError, match="first-order only"):
        torch.autograd.grad((y * dy).sum(), xd, create_graph=True)
