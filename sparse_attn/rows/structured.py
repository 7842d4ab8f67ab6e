"""Regularized attention mappings: fusedmax, oscarmax, sq-pnorm-max and sparsemax with temperature.

All follow Niculae & Blondel 2017, "A Regularized Framework for Sparse and Structured Neural Attention"::

    Pi_Omega(x) = argmax_{y in simplex} y.x - gamma * Omega(y)

* ``gamma_sparsemax``: ``Omega = |y|^2 / 2``, so ``Pi(x) = P_simplex(x / gamma)``.
* ``fusedmax``: ``Omega = |y|^2 / 2 + lam * sum_i |y_{i+1} - y_i|`` (1-d total variation);
  by Prop. 2, ``Pi(x) = P_simplex(P_TV(x / gamma))``. ``P_TV`` is computed exactly by
  Condat's direct algorithm (vectorized over rows here, one Triton program per row on
  CUDA, ``sparse_attn.kernels.rows.structured``).
* ``oscarmax``: ``Omega = |y|^2 / 2 + lam * sum_{i<j} max(|y_i|, |y_j|)``; ``P_OSC`` is the prox
  of an ordered weighted l1 norm (weights ``lam * (n - k)`` on the k-th largest magnitude):
  sort magnitudes, subtract the weights, non-increasing isotonic regression (pool adjacent
  violators, vectorized over rows here, one Triton program per row on CUDA), clip at 0,
  restore order and signs. Composed literally,
  ``P_simplex(P_OSC(x))`` is *not* the minimizer when entries of ``x`` are negative enough
  to be clipped or to outrank positive ones by magnitude (a slow solver of the constrained
  problem finds a lower objective). The constrained problem is invariant to shifting
  ``x`` by a constant, and for a large enough shift the composition is exact; that shifted
  prox is the isotonic step on the *values* sorted in decreasing order, without absolute
  values or clipping, which is what ``oscarmax`` computes (Prop. 3 then has all signs +).
* ``sq_pnorm_max``: ``Omega = |y|_p^2 / 2`` with ``p in (1, 2]``. Forward: the optimality
  conditions give ``y ∝ [x - tau]_+^(1/(p-1))`` with a scalar ``tau`` that is the unique
  root of a monotone equation, found by bisection to machine precision. Backward: the
  linear system of Prop. 1, solved in closed form on the support (Sherman-Morrison).

Backward of fusedmax/oscarmax: the group Jacobians of Prop. 3 (average the incoming
gradient over each group of equal prox values, with signs for OSCAR) composed with the
sparsemax Jacobian (``sparse_attn.mappings.sparsemax``).

Variable lengths: ``mask`` (boolean, True = attend) and/or ``lengths`` (the first
``lengths`` entries along ``dim`` are valid), on ``X``'s device; ``-inf`` entries of ``X``
are masked too. Masked entries get 0 and the TV chain links consecutive *valid* entries. A
row with no valid entry gives zeros and zero gradient. A row with a NaN or ``+inf`` among
its valid entries gives an all-NaN output row and NaN gradients (other rows are unaffected;
masked entries are not looked at). fp16/bf16 are computed in float32. Empty inputs give
empty outputs.

The row helpers and the prox custom ops live in ``sparse_attn.rows._structured_rows``; the
Triton kernels run for CUDA tensors (the ``auto`` rule of ``sparse_attn.rows._dispatch``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sparse_attn._validation import check_dim, check_floating, check_int, check_real
from sparse_attn.rows._structured_rows import (
    from_rows,
    oscar_prox_rows,
    poison_rows,
    split_nonfinite,
    to_rows,
    tv_prox_valid,
    valid_rows,
)
from sparse_attn.rows.mappings import _compute_dtype, sparsemax

__all__ = [
    "fusedmax",
    "oscarmax",
    "sq_pnorm_max",
    "gamma_sparsemax",
    "tv_prox",
    "oscar_prox",
    "Fusedmax",
    "Oscarmax",
]


def _prepare(X, dim, mask, lengths, gamma):
    """Validate and return ``(d, x, valid, bad)``: rows ``x = X / gamma`` (R, n) in the compute dtype,
    0 at invalid entries and on ``bad`` rows (NaN or ``+inf`` among the valid entries; NaN gradients)."""
    check_floating("X", X)
    d = check_dim("dim", dim, X.ndim)
    gamma = check_real("gamma", gamma, 0.0, True)
    valid = valid_rows(X, d, mask, lengths)
    x, bad = split_nonfinite(to_rows(X, d).to(_compute_dtype(X.dtype)), valid)
    x = x / gamma
    x = torch.where(valid, x, torch.zeros_like(x))
    return d, x, valid, bad


def _shift_valid(x: torch.Tensor, valid: torch.Tensor):
    """``(x - m, m)`` with ``m`` (R, 1) the max of the valid entries of each row of ``x``, detached.

    Rows with no valid entry get ``m = 0``. Used before the mappings onto the simplex, which
    are invariant to a shift (so ``m`` carries no gradient): near the top of the row, where
    the support is, the differences between large scores are kept exactly.
    """
    m = torch.where(valid, x, torch.full_like(x, -math.inf)).amax(dim=1, keepdim=True).detach()
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    return torch.where(valid, x - m, torch.zeros_like(x)), m


def _run(X, dim, mask, lengths, gamma, lam, prox, project):
    """Validate, apply ``prox(rows, valid, lam)`` (or nothing) to ``X / gamma``, optionally project."""
    if lam is not None:
        lam = check_real("lam", lam, 0.0, False)
    d, x, valid, bad = _prepare(X, dim, mask, lengths, gamma)
    if X.numel() == 0:
        return X.clone()
    if project:
        x, _ = _shift_valid(x, valid)
    y = x if prox is None else prox(x, valid, lam)
    if project:
        y = sparsemax(torch.where(valid, y, torch.full_like(y, -math.inf)), dim=-1)
    return from_rows(poison_rows(y, bad).to(X.dtype), X, d)


def _oscar_valid(x, valid, lam):
    return oscar_prox_rows(x, valid, lam, False)


def _oscar_on_simplex(x, valid, lam):
    return oscar_prox_rows(x, valid, lam, True)


def tv_prox(X: torch.Tensor, lam: float = 0.1, dim: int = -1, mask=None, lengths=None) -> torch.Tensor:
    """Exact proximal operator of 1-d total variation along ``dim`` (differentiable).

    ``argmin_y |y - x|^2 / 2 + lam * sum_i |y_{i+1} - y_i|`` over the valid entries of each
    row (consecutive valid entries are neighbours). Backward: Prop. 3 of Niculae & Blondel
    (the gradient is averaged over each run of equal output values).

    Args:
        X: floating tensor of any shape.
        lam: TV weight, ``>= 0``. Default 0.1.
        dim: dimension along which the sequence runs. Default -1.
        mask: optional boolean tensor broadcastable to ``X``; True = valid.
        lengths: optional integer tensor of ``X``'s shape without ``dim``; the first
            ``lengths`` entries along ``dim`` are valid.

    Returns:
        Tensor of ``X``'s shape and dtype; invalid entries are 0.
    """
    return _run(X, dim, mask, lengths, 1.0, lam, tv_prox_valid, False)


def oscar_prox(X: torch.Tensor, lam: float = 0.01, dim: int = -1, mask=None, lengths=None) -> torch.Tensor:
    """Exact proximal operator of OSCAR, ``lam * sum_{i<j} max(|y_i|, |y_j|)``, along ``dim``.

    Computed as the prox of the ordered weighted l1 norm with weight ``lam * (n - k)`` on
    the k-th largest magnitude (``n`` = number of valid entries of the row). Backward:
    Prop. 3 of Niculae & Blondel (signed average over groups of equal magnitude).

    Args:
        X: floating tensor of any shape.
        lam: OSCAR weight, ``>= 0``. Default 0.01.
        dim, mask, lengths: as in :func:`tv_prox`.

    Returns:
        Tensor of ``X``'s shape and dtype; invalid entries are 0.
    """
    return _run(X, dim, mask, lengths, 1.0, lam, _oscar_valid, False)


def gamma_sparsemax(X: torch.Tensor, gamma: float = 1.0, dim: int = -1, mask=None, lengths=None) -> torch.Tensor:
    """Sparsemax with temperature: ``P_simplex(X / gamma)`` (``Omega = |y|^2 / 2``).

    Smaller ``gamma`` gives sparser outputs; ``gamma = 1`` is sparsemax.

    Args:
        X: floating tensor of any shape.
        gamma: temperature, ``> 0``. Default 1.0.
        dim, mask, lengths: as in :func:`fusedmax`.

    Returns:
        Tensor of ``X``'s shape and dtype, summing to 1 over the valid entries of each row
        (rows with no valid entry give zeros).
    """
    return _run(X, dim, mask, lengths, gamma, None, None, True)


def fusedmax(X: torch.Tensor, lam: float = 0.1, dim: int = -1, gamma: float = 1.0, mask=None,
             lengths=None) -> torch.Tensor:
    """Fusedmax: ``P_simplex(P_TV(X / gamma))`` along ``dim`` (Niculae & Blondel 2017, Prop. 2).

    Attends to contiguous segments with equal weights. ``lam -> 0`` gives sparsemax.

    Args:
        X: floating tensor of any shape (float16, bfloat16, float32, float64), e.g.
            scores ``(batch, heads, seq_q, seq_k)`` with ``dim=-1``.
        lam: fused-lasso weight, ``>= 0``. Default 0.1.
        dim: dimension to normalize over; the sequence order runs along it. Default -1.
        gamma: temperature, ``> 0``. Default 1.0.
        mask: optional boolean tensor broadcastable to ``X``; True = attend. Masked entries
            get weight 0 and the TV chain skips them.
        lengths: optional integer tensor of ``X``'s shape without ``dim`` (broadcastable);
            only the first ``lengths`` entries along ``dim`` are attended.

    Returns:
        Tensor of ``X``'s shape and dtype, non-negative, summing to 1 over the valid
        entries of each row (rows with no valid entry give zeros).
    """
    return _run(X, dim, mask, lengths, gamma, lam, tv_prox_valid, True)


def oscarmax(X: torch.Tensor, lam: float = 0.01, dim: int = -1, gamma: float = 1.0, mask=None,
             lengths=None) -> torch.Tensor:
    """Oscarmax: ``P_simplex(P_OSC(X / gamma))`` along ``dim`` (Niculae & Blondel 2017, Prop. 2).

    Clusters weights into groups of equal value regardless of position. Computed as
    ``P_simplex(P_OSC(X / gamma + c))`` for a shift ``c`` that keeps every entry positive
    (exact for any input; see the module docstring).

    Args:
        X: floating tensor of any shape.
        lam: OSCAR weight, ``>= 0``. Default 0.01.
        dim, gamma, mask, lengths: as in :func:`fusedmax`.

    Returns:
        Tensor of ``X``'s shape and dtype, non-negative, summing to 1 over the valid
        entries of each row (rows with no valid entry give zeros).
    """
    return _run(X, dim, mask, lengths, gamma, lam, _oscar_on_simplex, True)


def _pnorm_terms(s: torch.Tensor, p: float):
    """``t = s^(1/(p-1))`` and ``g = |t|_p^(p-2) * |t|_1`` for non-negative rows ``s``."""
    t = s ** (1.0 / (p - 1.0))
    tp = (t ** p).sum(dim=1, keepdim=True)
    t1 = t.sum(dim=1, keepdim=True)
    g = torch.where(t1 > 0, tp.clamp(min=torch.finfo(s.dtype).tiny) ** ((p - 2.0) / p) * t1, torch.zeros_like(t1))
    return t, g


def _sq_pnorm_forward(x: torch.Tensor, valid: torch.Tensor, p: float) -> torch.Tensor:
    """sq-pnorm-max of rows ``x`` (already divided by gamma) with gamma = 1.

    With ``s = [x - tau]_+``, ``g(tau) = |s^b|_p^(p-2) |s^b|_1`` (``b = 1/(p-1)``) is
    homogeneous of degree 1 in ``s`` and ``g >= max s``; the root of ``g = 1`` is unique
    (strong convexity) and lies in ``[max x - 1, max x]``. Bisection halves this bracket
    until it stops shrinking in the working precision.
    """
    empty = ~valid.any(dim=1, keepdim=True)
    x, _ = _shift_valid(x, valid)
    lo, hi = torch.full_like(x[:, :1], -1.0), torch.zeros_like(x[:, :1])
    bits = 64 if x.dtype == torch.float64 else 32
    for _ in range(bits + 8):
        mid = 0.5 * (lo + hi)
        s = torch.where(valid, (x - mid).clamp(min=0), torch.zeros_like(x))
        _, g = _pnorm_terms(s, p)
        big = g >= 1.0
        lo = torch.where(big, mid, lo)
        hi = torch.where(big, hi, mid)
    s = torch.where(valid, (x - lo).clamp(min=0), torch.zeros_like(x))
    t, _ = _pnorm_terms(s, p)
    total = t.sum(dim=1, keepdim=True)
    y = t / torch.where(total > 0, total, torch.ones_like(total))
    return torch.where(empty, torch.zeros_like(y), y)


def _sq_pnorm_jvp(y: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """``J v`` for sq-pnorm-max at output ``y`` (gamma = 1), rows (R, n); ``J`` is symmetric.

    Prop. 1: ``(I + A (B - I)) J = A`` with ``A`` the simplex-projection Jacobian at ``y``
    (centering on the support ``S``) and ``B = H_Omega(y) = diag(d) + u u^T``. On ``S`` it
    reduces to ``B w = v + c 1`` with ``1^T w = 0``; ``B^{-1}`` by Sherman-Morrison.
    """
    supp = y > 0
    ys = torch.where(supp, y, torch.ones_like(y))
    norm = (torch.where(supp, y ** p, torch.zeros_like(y))).sum(dim=1, keepdim=True) ** (1.0 / p)
    norm = torch.where(norm > 0, norm, torch.ones_like(norm))
    diag = (p - 1.0) * ys ** (p - 2.0) / norm ** (p - 2.0)
    u = torch.where(supp, math.sqrt(2.0 - p) * ys ** (p - 1.0) / norm ** (p - 1.0), torch.zeros_like(y))
    inv_d = torch.where(supp, 1.0 / diag, torch.zeros_like(y))
    denom = 1.0 + (u * u * inv_d).sum(dim=1, keepdim=True)

    def b_inv(a):
        ad = a * inv_d
        return ad - inv_d * u * (u * ad).sum(dim=1, keepdim=True) / denom

    bv = b_inv(torch.where(supp, v, torch.zeros_like(v)))
    b1 = b_inv(supp.to(y.dtype))
    s1 = b1.sum(dim=1, keepdim=True)
    c = -bv.sum(dim=1, keepdim=True) / torch.where(s1 > 0, s1, torch.ones_like(s1))
    return torch.where(supp, bv + c * b1, torch.zeros_like(bv))


class _SqPnormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, valid, p):
        y = _sq_pnorm_forward(x, valid, p)
        ctx.p = p
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return _sq_pnorm_jvp(y, grad, ctx.p), None, None


def sq_pnorm_max(X: torch.Tensor, p: float = 1.5, dim: int = -1, gamma: float = 1.0, mask=None,
                 lengths=None) -> torch.Tensor:
    """sq-pnorm-max: ``argmin_{y in simplex} gamma/2 |y|_p^2 - y.X`` along ``dim``.

    Niculae & Blondel 2017, section 3.1. Sparse like sparsemax (``p = 2`` is
    :func:`gamma_sparsemax`), with a smoother transition for ``p < 2``. Forward by a
    bisection on the optimality conditions (to machine precision); backward by the linear
    system of Prop. 1 in closed form.

    Args:
        X: floating tensor of any shape.
        p: norm exponent in ``(1, 2]``. Default 1.5. Exponents close to 1 are
            ill-conditioned (``y ∝ [x - tau]_+^(1/(p-1))``).
        dim, gamma, mask, lengths: as in :func:`fusedmax`.

    Returns:
        Tensor of ``X``'s shape and dtype, non-negative, summing to 1 over the valid
        entries of each row (rows with no valid entry give zeros).
    """
    p = check_real("p", p, 1.0, True, 2.0)
    d, x, valid, bad = _prepare(X, dim, mask, lengths, gamma)
    if X.numel() == 0:
        return X.clone()
    y = _SqPnormFunction.apply(x, valid, p)
    return from_rows(poison_rows(y, bad).to(X.dtype), X, d)


class _StructuredMax(nn.Module):
    """Shared module form of a ``fn(X, lam, dim, gamma, mask, lengths)`` mapping."""

    def __init__(self, fn, lam: float, dim: int, gamma: float):
        super().__init__()
        self.fn = fn
        self.lam = check_real("lam", lam, 0.0, False)
        self.gamma = check_real("gamma", gamma, 0.0, True)
        check_int("dim", dim)
        self.dim = dim

    def forward(self, X: torch.Tensor, mask=None, lengths=None) -> torch.Tensor:
        return self.fn(X, lam=self.lam, dim=self.dim, gamma=self.gamma, mask=mask, lengths=lengths)

    def extra_repr(self) -> str:
        return f"lam={self.lam}, dim={self.dim}, gamma={self.gamma}"


class Fusedmax(_StructuredMax):
    """Module form of :func:`fusedmax`; ``forward(X, mask=None, lengths=None)``."""

    def __init__(self, lam: float = 0.1, dim: int = -1, gamma: float = 1.0):
        super().__init__(fusedmax, lam, dim, gamma)


class Oscarmax(_StructuredMax):
    """Module form of :func:`oscarmax`; ``forward(X, mask=None, lengths=None)``."""

    def __init__(self, lam: float = 0.01, dim: int = -1, gamma: float = 1.0):
        super().__init__(oscarmax, lam, dim, gamma)
