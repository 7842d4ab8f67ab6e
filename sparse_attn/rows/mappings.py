"""Row-wise sparse probability mappings: sparsemax, 1.5-entmax and alpha-entmax.

For ``alpha != 1`` the mapping of a row ``x`` is (Peters, Niculae & Martins 2019, "Sparse Sequence-to-Sequence
Models"; Correia, Niculae & Martins 2019, "Adaptively Sparse Transformers")::

    p_j = [(alpha - 1) * x_j - tau]_+ ** (1 / (alpha - 1)),   sum_j p_j = 1,

``alpha = 1`` is softmax, ``alpha = 2`` sparsemax (Martins & Astudillo 2016, "From Softmax to Sparsemax") and
``alpha = 1.5`` 1.5-entmax. Internally the row is written as ``p_j = [1 + (alpha - 1) * (x_j - t)]_+ ** (1 / (alpha -
1))`` with ``t`` in the scale of ``x`` (``tau = (alpha - 1) * t - 1``); this form tends to ``exp(x_j - t)`` as
``alpha -> 1`` and is evaluated with ``log1p``/``exp`` so that the mapping is continuous at ``alpha = 1``. A Python
alpha is taken as the computation holds it (``kernels._args.computed_alpha``): ``1 + 1e-9`` is 1.0 in float32, so
float32 / float16 / bfloat16 inputs get softmax there, as a tensor alpha of that value does.

Exact paths (``alpha`` in {1, 1.5, 2}) sort the row (optionally only its top ``k``); other values use a safeguarded
Halley solver on the Tsallis norm over the entries that can be in the support (:mod:`sparse_attn.rows._entmax_solver`,
docs/mappings.md), which stops on ``|sum p - 1| <= tol`` and renormalizes. All paths share one closed-form backward:
with ``U = p ** (2 - alpha)`` on the support, ``dX = U * (g - sum(U g) / sum(U))`` and the alpha gradient of Correia
et al. (Prop. 1) evaluated in a form that stays exact as ``alpha -> 1``.

fp16/bf16 inputs are computed in float32 and returned in their own dtype; float64 is
computed in float64.

Non-finite scores (the project's policy): ``-inf`` entries get exactly 0 and a row that is
entirely ``-inf`` (or has length 0) gives zeros and a zero gradient; a row with a NaN or a
``+inf`` anywhere gives an all-NaN output row and all-NaN gradients (w.r.t. its scores and
its alpha), like ``torch.softmax``. Other rows are unaffected. This is done with elementwise
selects, without reading values back to the host.

Dispatch (``sparse_attn.rows._dispatch`` states the rule for every mapping): CUDA
fp16/bf16/fp32 tensors with rows of at least ``TRITON_MIN_ROW`` entries and alpha in
[1, 2] go to the Triton row kernels of ``sparse_attn.rows._triton_rows`` (a
``torch.library`` custom op); everything else runs the PyTorch path below.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sparse_attn._validation import (
    check_alpha,
    check_bool,
    check_dim,
    check_floating,
    check_int,
    check_positive_int,
    check_real,
)
from sparse_attn.kernels._args import computed_alpha
from sparse_attn.rows._dispatch import load_kernel
from sparse_attn.rows._entmax_solver import _newton_rows, _solve_rows

__all__ = [
    "entmax",
    "sparsemax",
    "entmax15",
    "entmax_bisect",
    "Sparsemax",
    "Entmax15",
    "EntmaxBisect",
    "Entmax",
    "TRITON_MIN_ROW",
]

TRITON_MIN_ROW = 1024
"""Rows at least this long on CUDA go to the Triton row kernels."""

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SERIES_TERMS = 14
_SERIES_RADIUS = 0.5


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _shift_rows(x: torch.Tensor):
    """Subtract the row max. Returns ``(x', empty, bad)``, the masks of shape ``(R, 1)``.

    ``bad`` rows hold a NaN or ``+inf``, ``empty`` rows are entirely ``-inf``; both become
    rows of zeros in ``x'`` (so the solvers see finite rows only) and are overwritten later.
    """
    xmax = x.amax(dim=-1, keepdim=True)  # NaN where the row holds a NaN, +inf where it holds a +inf
    bad = ~(xmax < math.inf)
    empty = xmax == -math.inf
    zero_row = bad | empty
    shifted = x - torch.where(zero_row, torch.zeros_like(xmax), xmax)
    if torch.compiler.is_compiling():
        shifted = torch.where(zero_row, torch.zeros_like(x), shifted)
    elif bool(zero_row.any()):
        shifted.masked_fill_(zero_row, 0.0)
    return shifted, empty, bad


def _sort_threshold(z: torch.Tensor, beta2: bool, k: int | None):
    """Threshold of sparsemax (``beta2=False``) or 1.5-entmax (``beta2=True``) on rows ``z``.

    ``z`` is in the z-scale (``(alpha - 1) * x``), finite, shape ``(R, n)``. Only the top
    ``k`` entries are sorted when ``k < n``; rows whose support reaches ``k`` are redone
    with a full sort. Returns ``tau`` of shape ``(R, 1)``.
    """
    n = z.shape[-1]
    if k is None or k >= n or torch.compiler.is_compiling():
        zs = torch.sort(z, dim=-1, descending=True).values
        tau, supp = _threshold_from_sorted(zs, beta2)
        return tau
    zs = torch.topk(z, k, dim=-1).values
    tau, supp = _threshold_from_sorted(zs, beta2)
    redo = (supp == k).squeeze(-1)
    if bool(redo.any()):
        zs_full = torch.sort(z[redo], dim=-1, descending=True).values
        tau_full, _ = _threshold_from_sorted(zs_full, beta2)
        tau = tau.clone()
        tau[redo] = tau_full
    return tau


def _threshold_from_sorted(zs: torch.Tensor, beta2: bool):
    ks = torch.arange(1, zs.shape[-1] + 1, device=zs.device, dtype=zs.dtype)
    csum = zs.cumsum(dim=-1)
    if beta2:
        mean = csum / ks
        mean_sq = (zs * zs).cumsum(dim=-1) / ks
        ss = ks * (mean_sq - mean * mean)
        delta = (1 - ss) / ks
        tau_k = mean - torch.sqrt(torch.clamp(delta, min=0))
        supp = (tau_k <= zs).sum(dim=-1, keepdim=True)
        tau = tau_k.gather(-1, supp - 1)
    else:
        supp = (1 + ks * zs > csum).sum(dim=-1, keepdim=True)
        tau = (csum.gather(-1, supp - 1) - 1) / supp.to(zs.dtype)
    return tau, supp


def _exact_rows(x: torch.Tensor, alpha_value: float, k: int | None) -> torch.Tensor:
    """Exact mapping for shifted rows ``x`` (max 0, finite or -inf) and alpha in {1, 1.5, 2}."""
    if alpha_value == 1.0:
        return torch.softmax(x, dim=-1)
    z = torch.clamp(x, min=-4.0)
    if alpha_value == 2.0:
        tau = _sort_threshold(z, False, k)
        return torch.clamp(z - tau, min=0)
    z = z * 0.5
    tau = _sort_threshold(z, True, k)
    return torch.clamp(z - tau, min=0) ** 2


def _select_rows(x: torch.Tensor, alpha: torch.Tensor, k: int | None, max_iter: int,
                 ensure_sum_one: bool, exact: bool) -> torch.Tensor:
    """Branch-free form of the per-row routing of :func:`_forward_rows`, used while compiling.

    Every row goes through the solver (alpha = 1 rows with a stand-in alpha of 2) and through
    each exact path; ``torch.where`` then keeps, per row, what the eager routing would compute.
    """
    is_one = alpha == 1.0
    p = _newton_rows(x, torch.where(is_one, torch.full_like(alpha, 2.0), alpha), max_iter, ensure_sum_one)
    p = torch.where(is_one, torch.softmax(x, dim=-1), p)
    if exact:
        for value in (1.5, 2.0):
            p = torch.where(alpha == value, _exact_rows(x, value, k), p)
    return p


def _forward_rows(x: torch.Tensor, alpha_rows: torch.Tensor | float, k: int | None, max_iter: int,
                  ensure_sum_one: bool, exact: bool) -> torch.Tensor:
    """Mapping of rows ``x`` (R, n) in the compute dtype; alpha float or (R, 1) tensor.

    Rows entirely ``-inf`` give zeros, rows holding a NaN or ``+inf`` give NaN.
    """
    xs, empty, bad = _shift_rows(x)
    if isinstance(alpha_rows, float):
        if exact and alpha_rows in (1.0, 1.5, 2.0):
            p = _exact_rows(xs, alpha_rows, k)
        elif alpha_rows == 1.0:
            p = torch.softmax(xs, dim=-1)
        else:
            a = torch.full((x.shape[0], 1), alpha_rows, dtype=x.dtype, device=x.device)
            p = _solve_rows(xs, a, max_iter, ensure_sum_one)
    elif torch.compiler.is_compiling():
        p = _select_rows(xs, alpha_rows, k, max_iter, ensure_sum_one, exact)
    else:
        p = torch.empty_like(xs)
        alpha_flat = alpha_rows.squeeze(-1)
        remaining = torch.ones_like(alpha_flat, dtype=torch.bool)
        special = (1.0, 1.5, 2.0) if exact else (1.0,)
        for value in special:
            sel = alpha_flat == value
            if bool(sel.any()):
                p[sel] = _exact_rows(xs[sel], value, k)
                remaining &= ~sel
        if bool(remaining.any()):
            p[remaining] = _solve_rows(xs[remaining], alpha_rows[remaining], max_iter, ensure_sum_one)
    if torch.compiler.is_compiling():
        p = torch.where(empty, torch.zeros_like(p), p)
        return torch.where(bad, torch.full_like(p, math.nan), p)
    if bool((empty | bad).any()):
        p = p.masked_fill(empty, 0.0).masked_fill_(bad, math.nan)
    return p


def _series_expm1_minus(w: torch.Tensor) -> torch.Tensor:
    """``(exp(w) - 1 - w) / w**2`` by its Taylor series, for ``|w| <= _SERIES_RADIUS``."""
    out = torch.full_like(w, 1.0 / math.factorial(_SERIES_TERMS + 1))
    for j in range(_SERIES_TERMS - 2, -1, -1):
        out = out * w + 1.0 / math.factorial(j + 2)
    return out


def _dp_dalpha_weights(p: torch.Tensor, u: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``p * d(log p)/d(alpha)`` at fixed ``t``, elementwise; 0 off the support.

    Equals ``-(U - p + e p log p) / e**2`` with ``e = alpha - 1``; written as
    ``-p (log p)**2 q(w)``, ``q(w) = (exp(w) - 1 - w) / w**2``, ``w = -e log p``, with the
    Taylor series of ``q`` for small ``|w|`` so it is exact at and near ``alpha = 1``.
    """
    support = p > 0
    log_p = torch.log(torch.where(support, p, torch.ones_like(p)))
    w = -e * log_p
    small = w.abs() <= _SERIES_RADIUS
    series = -p * log_p * log_p * _series_expm1_minus(torch.where(small, w, torch.zeros_like(w)))
    e_safe = torch.where(e == 0, torch.ones_like(e), e)
    direct = -(u - p + e * p * log_p) / (e_safe * e_safe)
    out = torch.where(small, series, direct)
    return torch.where(support, out, torch.zeros_like(out))


def _alpha_grad_rows(p: torch.Tensor, u: torch.Tensor, e: torch.Tensor, g: torch.Tensor,
                     delta: torch.Tensor) -> torch.Tensor:
    """Each row's gradient w.r.t. its alpha, ``sum_j p_j d(log p_j)/d(alpha) (g_j - delta)``, ``(R, 1)``.

    Only the support contributes, so outside tracing the weights are computed on the support's entries alone (the
    series costs ~30 operations an entry; sparse rows have few). A row with a NaN output gets NaN, as ``delta`` does.
    """
    if torch.compiler.is_compiling():
        return (_dp_dalpha_weights(p, u, e) * (g - delta)).sum(dim=-1, keepdim=True)
    rows, cols = (p > 0).nonzero(as_tuple=True)
    weights = _dp_dalpha_weights(p[rows, cols], u[rows, cols], e.expand_as(p)[rows, cols])
    terms = weights * (g[rows, cols] - delta[rows, 0])
    out = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device).index_add_(0, rows, terms)
    return out[:, None] + 0 * delta


def _rows_vjp(u: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' vector-Jacobian product of alpha-entmax, ``(dX, delta)`` with ``dX = U * (g - delta)`` and
    ``delta = sum(U g) / sum(U)`` (``U = p ** (2 - alpha)`` on the support, 0 off it; an empty row gives 0)."""
    total = u.sum(dim=-1, keepdim=True)
    delta = (u * g).sum(dim=-1, keepdim=True) / torch.where(total > 0, total, torch.ones_like(total))
    return u * (g - delta), delta


class _EntmaxRowsFunction(torch.autograd.Function):
    """Autograd wrapper for rows ``x`` (R, n) and alpha (float or (R, 1) tensor); PyTorch only.

    The backward reads the saved output; an all-NaN output row (NaN or ``+inf`` scores) gets
    ``U = NaN``, hence NaN gradients w.r.t. that row and its alpha.
    """

    @staticmethod
    def forward(ctx, x, alpha, k, max_iter, ensure_sum_one, exact):
        cdt = _compute_dtype(x.dtype)
        xc = x.to(cdt)
        alpha_c = alpha.detach().to(cdt) if isinstance(alpha, torch.Tensor) else float(alpha)
        p = _forward_rows(xc, alpha_c, k, max_iter, ensure_sum_one, exact)
        ctx.alpha_is_tensor = isinstance(alpha, torch.Tensor)
        ctx.alpha_float = None if ctx.alpha_is_tensor else float(alpha)
        if ctx.alpha_is_tensor:
            # alpha itself, not a detached copy: a backward under create_graph differentiates its own use of alpha
            # (U = p ** (2 - alpha), the alpha gradient's weights), besides the dependence through p
            ctx.save_for_backward(p, alpha)
        else:
            ctx.save_for_backward(p)
        return p.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.alpha_is_tensor:
            p, alpha = ctx.saved_tensors
            alpha_c = alpha.to(p.dtype)
        else:
            (p,) = ctx.saved_tensors
            alpha_c = torch.full((p.shape[0], 1), ctx.alpha_float, dtype=p.dtype, device=p.device)
        g = grad.to(p.dtype)
        e = alpha_c - 1
        support = p > 0
        safe_p = torch.where(support, p, torch.ones_like(p))
        u = torch.where(support, torch.exp((1 - e) * torch.log(safe_p)), torch.zeros_like(p))
        u = torch.where(torch.isnan(p), p, u)
        gx, delta = _rows_vjp(u, g)
        galpha = None
        if ctx.alpha_is_tensor and ctx.needs_input_grad[1]:
            galpha = _alpha_grad_rows(p, u, e, g, delta).to(alpha.dtype)
        return gx.to(grad.dtype), galpha, None, None, None, None


def _use_triton_rows(X: torch.Tensor, n: int, alpha_min: float, alpha_max: float) -> bool:
    """The ``auto`` rule of ``sparse_attn.rows._dispatch`` for the row kernels (NaN alpha bounds, i.e. compiling:
    no)."""
    return (X.is_cuda and n >= TRITON_MIN_ROW and X.dtype in _TRITON_DTYPES and 1.0 <= alpha_min
            and alpha_max <= 2.0 and not torch.compiler.is_compiling())


def _apply(X, alpha, dim, k, max_iter, ensure_sum_one, exact):
    check_floating("X", X)
    d = check_dim("dim", dim, X.ndim)
    alpha_min, alpha_max = check_alpha("alpha", alpha, X, d)
    check_positive_int("k", k, allow_none=True)
    check_positive_int("n_iter", max_iter)
    check_bool("ensure_sum_one", ensure_sum_one)
    compiling = torch.compiler.is_compiling()
    if isinstance(alpha, torch.Tensor) and alpha.numel() == 1 and not alpha.requires_grad and not compiling:
        alpha = float(alpha)
    if X.numel() == 0:
        return X.clone()
    n = X.shape[d]
    if _use_triton_rows(X, n, alpha_min, alpha_max):
        kernel = load_kernel("sparse_attn.rows._triton_rows", "entmax_rows_triton")
        if kernel is not None:
            return kernel(X, alpha, d)
    xr = X.movedim(d, -1)
    batch_shape = xr.shape[:-1]
    xr = xr.reshape(-1, n)
    if isinstance(alpha, torch.Tensor):
        shape = (1,) * (X.ndim - alpha.ndim) + tuple(alpha.shape)
        a = alpha.reshape(shape).expand(*X.shape[:d], 1, *X.shape[d + 1:])
        a = a.movedim(d, -1).reshape(-1, 1)
    else:
        # as the computation holds it: 1 + 1e-9 is softmax in float32 (a tensor alpha is rounded the same way)
        a = computed_alpha(alpha, _compute_dtype(X.dtype))
    p = _EntmaxRowsFunction.apply(xr, a, k, max_iter, ensure_sum_one, exact)
    return p.reshape(*batch_shape, n).movedim(-1, d)


def entmax(X: torch.Tensor, alpha=1.5, dim: int = -1) -> torch.Tensor:
    """alpha-entmax along ``dim``, routed to the exact path when it exists.

    ``alpha = 1`` gives softmax, ``2`` sparsemax, ``1.5`` the exact sort-based 1.5-entmax;
    any other ``alpha > 0`` uses the certified iterative solver. The map is continuous in
    alpha (``alpha = 1 + 1e-4`` is close to softmax).

    Args:
        X: floating tensor of any shape (float16, bfloat16, float32 or float64).
        alpha: float or floating tensor broadcastable to ``X`` with size 1 along ``dim``
            (e.g. ``(1, H, 1, 1)`` for one alpha per head of ``(B, H, Nq, Nk)`` scores);
            every value must be > 0. Differentiable when it is a tensor. Default 1.5.
        dim: dimension to normalize over (any negative or positive index). Default -1.

    Returns:
        Tensor of ``X``'s shape and dtype, non-negative, summing to 1 along ``dim``
        (rows that are entirely ``-inf`` give zeros).
    """
    return _apply(X, alpha, dim, None, 100, True, True)


def sparsemax(X: torch.Tensor, dim: int = -1, k: int | None = None) -> torch.Tensor:
    """Sparsemax (Euclidean projection onto the simplex) along ``dim``.

    Args:
        X: floating tensor of any shape.
        dim: dimension to normalize over. Default -1.
        k: if given, sort only the top ``k`` entries of each row first (rows whose
            support reaches ``k`` are redone with a full sort). Default None (full sort).

    Returns:
        Tensor of ``X``'s shape and dtype: ``[X - tau]_+`` summing to 1 along ``dim``.
    """
    return _apply(X, 2.0, dim, k, 100, True, True)


def entmax15(X: torch.Tensor, dim: int = -1, k: int | None = None) -> torch.Tensor:
    """Exact 1.5-entmax (sort-based, Peters et al. 2019, Algorithm 2) along ``dim``.

    Args:
        X: floating tensor of any shape.
        dim: dimension to normalize over. Default -1.
        k: optional partial sort size as in :func:`sparsemax`. Default None.

    Returns:
        Tensor of ``X``'s shape and dtype: ``[X / 2 - tau]_+ ** 2`` summing to 1 along ``dim``.
    """
    return _apply(X, 1.5, dim, k, 100, True, True)


def entmax_bisect(X: torch.Tensor, alpha=1.5, dim: int = -1, n_iter: int = 50,
                  ensure_sum_one: bool = True) -> torch.Tensor:
    """alpha-entmax for any ``alpha > 0`` by the certified iterative solver.

    Safeguarded Newton on the Tsallis norm with a bisection fallback; stops once
    ``|sum p - 1|`` is within tolerance on every row (``n_iter`` is the maximum number of
    iterations, kept for compatibility with the ``entmax`` package) and renormalizes.
    ``alpha = 1`` rows are exact softmax.

    Args:
        X: floating tensor of any shape.
        alpha: float or floating tensor broadcastable to ``X`` with size 1 along ``dim``,
            values > 0; differentiable when a tensor. Default 1.5.
        dim: dimension to normalize over. Default -1.
        n_iter: maximum solver iterations. Default 50.
        ensure_sum_one: divide by the row sum at the end so rows sum to 1. Default True.

    Returns:
        Tensor of ``X``'s shape and dtype.
    """
    return _apply(X, alpha, dim, None, n_iter, ensure_sum_one, False)


def _check_alpha_arg(alpha) -> None:
    """Module-time check of ``alpha``: a number > 0 or a floating tensor (its shape is checked per call)."""
    if isinstance(alpha, torch.Tensor):
        if not alpha.dtype.is_floating_point:
            raise TypeError(f"alpha must be a float or a floating-point tensor, got dtype {alpha.dtype}")
    else:
        check_real("alpha", alpha, 0.0, True)


class _TopKMapping(nn.Module):
    """Module form of a sort-based mapping ``fn(X, dim, k)`` (:func:`sparsemax`, :func:`entmax15`)."""

    def __init__(self, dim: int = -1, k: int | None = None):
        super().__init__()
        check_int("dim", dim)
        check_positive_int("k", k, allow_none=True)
        self.dim = dim
        self.k = k

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return type(self).fn(X, dim=self.dim, k=self.k)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, k={self.k}"


class Sparsemax(_TopKMapping):
    """Module form of :func:`sparsemax` (``dim=-1``, ``k=None``)."""

    fn = staticmethod(sparsemax)


class Entmax15(_TopKMapping):
    """Module form of :func:`entmax15` (``dim=-1``, ``k=None``)."""

    fn = staticmethod(entmax15)


class EntmaxBisect(nn.Module):
    """Module form of :func:`entmax_bisect`.

    Args:
        alpha: float, tensor or ``nn.Parameter`` (learned when a parameter). Default 1.5.
        dim: dimension to normalize over. Default -1.
        n_iter: maximum solver iterations. Default 50.
    """

    def __init__(self, alpha=1.5, dim: int = -1, n_iter: int = 50):
        super().__init__()
        _check_alpha_arg(alpha)
        check_int("dim", dim)
        check_positive_int("n_iter", n_iter)
        self.alpha = alpha
        self.dim = dim
        self.n_iter = n_iter

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return entmax_bisect(X, alpha=self.alpha, dim=self.dim, n_iter=self.n_iter)

    def extra_repr(self) -> str:
        alpha = self.alpha if not isinstance(self.alpha, torch.Tensor) else f"tensor{tuple(self.alpha.shape)}"
        return f"alpha={alpha}, dim={self.dim}, n_iter={self.n_iter}"


class Entmax(nn.Module):
    """Module form of :func:`entmax` (exact paths for alpha in {1, 1.5, 2}).

    Args:
        alpha: float, tensor or ``nn.Parameter``. Default 1.5.
        dim: dimension to normalize over. Default -1.
    """

    def __init__(self, alpha=1.5, dim: int = -1):
        super().__init__()
        _check_alpha_arg(alpha)
        check_int("dim", dim)
        self.alpha = alpha
        self.dim = dim

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return entmax(X, alpha=self.alpha, dim=self.dim)

    def extra_repr(self) -> str:
        alpha = self.alpha if not isinstance(self.alpha, torch.Tensor) else f"tensor{tuple(self.alpha.shape)}"
        return f"alpha={alpha}, dim={self.dim}"
