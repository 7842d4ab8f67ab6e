"""Regularized attention mappings: fusedmax, oscarmax, sq-pnorm-max and sparsemax with temperature.

All follow Niculae & Blondel 2017 (``niculae2017-regularized-sparse-structured-attention.txt``)::

    Pi_Omega(x) = argmax_{y in simplex} y.x - gamma * Omega(y)

* ``gamma_sparsemax``: ``Omega = |y|^2 / 2``, so ``Pi(x) = P_simplex(x / gamma)``.
* ``fusedmax``: ``Omega = |y|^2 / 2 + lam * sum_i |y_{i+1} - y_i|`` (1-d total variation);
  by Prop. 2, ``Pi(x) = P_simplex(P_TV(x / gamma))``. ``P_TV`` is computed exactly by
  Condat's direct algorithm (vectorized over rows here, one Triton program per row on
  CUDA, ``sparse_attn.kernels.structured``).
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
``lengths`` entries along ``dim`` are valid); ``-inf`` entries of ``X`` are masked too.
Masked entries get 0 and the TV chain links consecutive *valid* entries. A row with no
valid entry gives zeros and zero gradient. fp16/bf16 are computed in float32.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import nn

from sparse_attn._validation import check_dim, check_floating, check_tensor
from sparse_attn.mappings import _compute_dtype, sparsemax

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


def _check_real(name: str, value, low: float, low_open: bool, high: float = math.inf) -> float:
    """Check a real scalar in ``(low, high]`` (or ``[low, high]`` when ``low_open`` is False)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(value)
    bad_low = v <= low if low_open else v < low
    if not math.isfinite(v) or bad_low or v > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be finite and in {bracket}{low}, {high}], got {v}")
    return v


def _valid_rows(X: torch.Tensor, d: int, mask, lengths) -> torch.Tensor:
    """Boolean ``(R, n)`` validity of the rows of ``X`` along ``d`` (True = attend).

    Combines ``X > -inf``, an optional boolean ``mask`` broadcastable to ``X`` and optional
    integer ``lengths`` broadcastable to ``X`` without ``dim`` (values in ``[0, n]``).
    """
    n = X.shape[d]
    valid = X != -math.inf
    if mask is not None:
        check_tensor("mask", mask)
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a boolean tensor (True = attend), got dtype {mask.dtype}")
        try:
            valid = valid & mask.to(X.device)
        except RuntimeError:
            raise ValueError(
                f"mask must be broadcastable to the input shape {tuple(X.shape)}, got shape {tuple(mask.shape)}"
            ) from None
        if valid.shape != X.shape:
            raise ValueError(
                f"mask must be broadcastable to the input shape {tuple(X.shape)} without growing it, "
                f"got shape {tuple(mask.shape)}"
            )
    if lengths is not None:
        check_tensor("lengths", lengths)
        if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.is_complex():
            raise TypeError(f"lengths must be an integer tensor, got dtype {lengths.dtype}")
        batch_shape = X.shape[:d] + X.shape[d + 1:]
        try:
            lens = torch.broadcast_to(lengths.to(X.device), batch_shape)
        except RuntimeError:
            raise ValueError(
                f"lengths must be broadcastable to the input shape without dim {d}, "
                f"{tuple(batch_shape)}, got shape {tuple(lengths.shape)}"
            ) from None
        if lens.numel() > 0:
            lo, hi = int(lens.min()), int(lens.max())
            if lo < 0 or hi > n:
                raise ValueError(f"lengths must be in [0, {n}] (the size of dim {d}), got values in [{lo}, {hi}]")
        pos = torch.arange(n, device=X.device)
        valid = valid & (pos < lens.unsqueeze(-1)).movedim(-1, d)
    return _to_rows(valid, d)


def _to_rows(X: torch.Tensor, d: int) -> torch.Tensor:
    """``X`` with ``dim`` moved last and the other dims flattened: ``(R, n)`` (also when n = 0)."""
    return X.movedim(d, -1).reshape(math.prod(X.shape[:d] + X.shape[d + 1:]), X.shape[d])


def _from_rows(rows: torch.Tensor, X: torch.Tensor, d: int) -> torch.Tensor:
    shape = X.movedim(d, -1).shape
    return rows.reshape(shape).movedim(-1, d)


def _group_mean(g: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """Replace each entry of ``g`` (R, n) by the mean of its group; ``gid`` in ``[0, n)``."""
    sums = torch.zeros_like(g).scatter_add_(-1, gid, g)
    counts = torch.zeros_like(g).scatter_add_(-1, gid, torch.ones_like(g))
    return (sums / counts.clamp(min=1)).gather(-1, gid)


def _tv_prox_torch(x: torch.Tensor, lengths: torch.Tensor, lam: float) -> torch.Tensor:
    """Condat's 1-d TV prox on the first ``lengths[r]`` entries of each row of ``x`` (R, n).

    The per-row scalar state machine of the direct algorithm, advanced one step for all
    rows at once (rows that finished idle). A segment is written by storing its value at
    its first index; a forward fill expands segments at the end. Entries at positions
    ``>= lengths`` are 0.
    """
    rows, n = x.shape
    if rows == 0 or n == 0:
        return torch.zeros_like(x)
    dev = x.device
    seg_val = torch.zeros((rows, n + 1), dtype=x.dtype, device=dev)
    is_start = torch.zeros((rows, n + 1), dtype=torch.bool, device=dev)
    lens = lengths.to(torch.int64)
    last = lens - 1
    k = torch.zeros(rows, dtype=torch.int64, device=dev)
    k0, k_minus, k_plus = k.clone(), k.clone(), k.clone()
    v_min = x[:, 0] - lam
    v_max = x[:, 0] + lam
    u_min = torch.full_like(v_min, lam)
    u_max = torch.full_like(v_min, -lam)
    done = lens <= 0
    dummy = torch.full_like(k, n)

    def at(idx):
        return x.gather(1, idx.clamp(0, n - 1).unsqueeze(1)).squeeze(1)

    while not bool(done.all()):
        active = ~done
        at_end = active & (k == last)
        inner = active & ~at_end
        b_min = at_end & (u_min < 0)
        b_max = at_end & ~b_min & (u_max > 0)
        b_fin = at_end & ~b_min & ~b_max
        x_next = at(k + 1)
        u_min_n = u_min + x_next - v_min
        j_min = inner & (u_min_n < -lam)
        u_max_n = u_max + x_next - v_max
        j_max = inner & ~j_min & (u_max_n > lam)
        step = inner & ~j_min & ~j_max
        w_min = b_min | j_min
        w_max = b_max | j_max
        write = w_min | w_max | b_fin
        v_fin = v_min + u_min / (k - k0 + 1).to(x.dtype)
        w_val = torch.where(w_max, v_max, torch.where(b_fin, v_fin, v_min))
        idx = torch.where(write, k0, dummy).unsqueeze(1)
        seg_val.scatter_(1, idx, w_val.unsqueeze(1))
        is_start.scatter_(1, idx, torch.ones_like(idx, dtype=torch.bool))
        new_k0 = torch.where(w_min, torch.maximum(k_minus, k0) + 1,
                             torch.where(w_max, torch.maximum(k_plus, k0) + 1, k0))
        restart = w_min | w_max
        x_r = at(new_k0)
        k1 = k + 1
        cnt = (k1 - k0 + 1).to(x.dtype)
        up_min = step & (u_min_n >= lam)
        up_max = step & (u_max_n <= -lam)
        jump = j_min | j_max
        new_v_min = torch.where(b_min | j_min, x_r, torch.where(j_max, x_r - 2 * lam,
                                torch.where(up_min, v_min + (u_min_n - lam) / cnt, v_min)))
        new_v_max = torch.where(b_max | j_max, x_r, torch.where(j_min, x_r + 2 * lam,
                                torch.where(up_max, v_max + (u_max_n + lam) / cnt, v_max)))
        new_u_min = torch.where(b_min | jump | up_min, torch.full_like(u_min, lam),
                                torch.where(b_max, x_r - lam - v_min, torch.where(step, u_min_n, u_min)))
        new_u_max = torch.where(b_max | jump | up_max, torch.full_like(u_max, -lam),
                                torch.where(b_min, x_r + lam - v_max, torch.where(step, u_max_n, u_max)))
        k_minus = torch.where(b_min | jump, new_k0, torch.where(up_min, k1, k_minus))
        k_plus = torch.where(b_max | jump, new_k0, torch.where(up_max, k1, k_plus))
        k = torch.where(restart, new_k0, torch.where(step, k1, k))
        k0 = new_k0
        v_min, v_max, u_min, u_max = new_v_min, new_v_max, new_u_min, new_u_max
        done = done | b_fin
    pos = torch.arange(n, device=dev)
    src = torch.where(is_start[:, :n], pos, torch.zeros_like(pos)).cummax(dim=1).values
    y = seg_val.gather(1, src)
    return torch.where(pos < lens.unsqueeze(1), y, torch.zeros_like(y))


def _tv_prox_rows(x: torch.Tensor, lengths: torch.Tensor, lam: float, use_triton: bool) -> torch.Tensor:
    if lam == 0.0:
        pos = torch.arange(x.shape[1], device=x.device)
        return torch.where(pos < lengths.unsqueeze(1), x, torch.zeros_like(x))
    if use_triton:
        from sparse_attn.kernels.structured import tv_prox_rows

        y = tv_prox_rows(x, lengths, lam)
        pos = torch.arange(x.shape[1], device=x.device)
        return torch.where(pos < lengths.unsqueeze(1), y, torch.zeros_like(y))
    return _tv_prox_torch(x, lengths, lam)


def _contiguous_groups(y: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Group ids (R, n) of runs of equal adjacent values; positions ``>= lengths`` are singletons."""
    pos = torch.arange(y.shape[1], device=y.device)
    boundary = torch.ones_like(y, dtype=torch.bool)
    boundary[:, 1:] = y[:, 1:] != y[:, :-1]
    boundary = boundary | (pos >= lengths.unsqueeze(1))
    return boundary.to(torch.int64).cumsum(dim=1) - 1


class _TVProxFunction(torch.autograd.Function):
    """``P_TV`` on packed rows ``x`` (R, n) whose valid entries are the first ``lengths``."""

    @staticmethod
    def forward(ctx, x, lengths, lam, use_triton):
        y = _tv_prox_rows(x, lengths, lam, use_triton)
        gid = _contiguous_groups(y, lengths)
        valid = torch.arange(x.shape[1], device=x.device) < lengths.unsqueeze(1)
        ctx.save_for_backward(gid, valid)
        return y

    @staticmethod
    def backward(ctx, grad):
        gid, valid = ctx.saved_tensors
        gx = _group_mean(grad, gid)
        return torch.where(valid, gx, torch.zeros_like(gx)), None, None, None


def _isotonic_nonincreasing(v: torch.Tensor) -> torch.Tensor:
    """Least-squares non-increasing fit of each row of ``v`` (R, n) by pool adjacent violators.

    A stack of blocks (mean, count) per row; one position is pushed for all rows at a time
    and violating top blocks are merged while any row has one. A merge moves the lower
    mean towards the upper one by a fraction of their difference, so values near the
    floating-point limit do not overflow as a block sum would. ``-inf`` entries (padding at
    the end of a row) never merge.
    """
    rows, n = v.shape
    means = torch.zeros_like(v)
    counts = torch.zeros_like(v)
    top = torch.full((rows,), -1, dtype=torch.int64, device=v.device)
    r = torch.arange(rows, device=v.device)
    for i in range(n):
        top = top + 1
        means[r, top] = v[:, i]
        counts[r, top] = 1
        while True:
            prev = (top - 1).clamp(min=0)
            m_top = means[r, top]
            m_prev = means[r, prev]
            viol = (top > 0) & (m_prev <= m_top) & (m_top > -math.inf)
            if not bool(viol.any()):
                break
            rv, pv, tv = r[viol], prev[viol], top[viol]
            c_top = counts[rv, tv]
            c_new = counts[rv, pv] + c_top
            means[rv, pv] += (means[rv, tv] - means[rv, pv]) * (c_top / c_new)
            counts[rv, pv] = c_new
            counts[rv, tv] = 0
            top = torch.where(viol, top - 1, top)
    starts = (counts.cumsum(dim=1) - counts).to(torch.int64)
    marks = torch.zeros((rows, n + 1), dtype=torch.int64, device=v.device)
    marks.scatter_(1, torch.where(counts > 0, starts, torch.full_like(starts, n)), 1)
    block = marks[:, :n].cumsum(dim=1) - 1
    return means.gather(1, block.clamp(min=0))


class _OscarProxFunction(torch.autograd.Function):
    """OSCAR prox on rows ``x`` (R, n) restricted to the ``valid`` entries (others give 0).

    ``on_simplex=False``: the prox itself (magnitudes sorted, clipped at 0, signs restored;
    Jacobian with signs, Prop. 3). ``on_simplex=True``: the prox of ``x + c`` for a constant
    ``c`` large enough that every entry stays positive, minus ``c`` (values sorted, no
    clipping, all signs +); followed by the simplex projection this is the exact oscarmax
    for any ``x``, because the constrained problem is invariant to shifting ``x``.
    ``use_triton``: run the isotonic regression in the Triton kernel (CUDA tensors, or CPU
    tensors under ``TRITON_INTERPRET=1``).
    """

    @staticmethod
    def forward(ctx, x, valid, lam, on_simplex, use_triton):
        n = x.shape[1]
        n_valid = valid.sum(dim=1, keepdim=True)
        key = x if on_simplex else x.abs()
        key = torch.where(valid, key, torch.full_like(x, -math.inf))
        key_sorted, order = torch.sort(key, dim=1, descending=True)
        pos = torch.arange(n, device=x.device)
        in_row = pos < n_valid
        weights = lam * (n_valid - 1 - pos).clamp(min=0).to(x.dtype)
        v = torch.where(in_row, key_sorted - weights, torch.full_like(x, -math.inf))
        if use_triton:
            from sparse_attn.kernels.structured import isotonic_nonincreasing_rows

            z_sorted = isotonic_nonincreasing_rows(v, n_valid.squeeze(1))
        else:
            z_sorted = _isotonic_nonincreasing(v)
        if not on_simplex:
            z_sorted = z_sorted.clamp(min=0)
        z_sorted = torch.where(in_row, z_sorted, torch.zeros_like(x))
        boundary = torch.ones_like(in_row)
        boundary[:, 1:] = z_sorted[:, 1:] != z_sorted[:, :-1]
        boundary = boundary | ~in_row
        gid_sorted = boundary.to(torch.int64).cumsum(dim=1) - 1
        z_mag = torch.zeros_like(x).scatter_(1, order, z_sorted)
        gid = torch.zeros_like(order).scatter_(1, order, gid_sorted)
        if on_simplex:
            sign = valid.to(x.dtype)
        else:
            sign = torch.where(valid & (z_mag > 0), torch.sign(x), torch.zeros_like(x))
        ctx.save_for_backward(gid, sign)
        return sign * z_mag

    @staticmethod
    def backward(ctx, grad):
        gid, sign = ctx.saved_tensors
        return sign * _group_mean(sign * grad, gid), None, None, None, None


def _prepare(X, dim, mask, lengths, gamma):
    check_floating("X", X)
    d = check_dim("dim", dim, X.ndim)
    gamma = _check_real("gamma", gamma, 0.0, True)
    valid = _valid_rows(X, d, mask, lengths)
    cdt = _compute_dtype(X.dtype)
    x = _to_rows(X, d).to(cdt) / gamma
    x = torch.where(valid, x, torch.zeros_like(x))
    return d, x, valid


def _shift_valid(x: torch.Tensor, valid: torch.Tensor):
    """``(x - m, m)`` with ``m`` (R, 1) the max of the valid entries of each row of ``x``, detached.

    Rows with no valid entry get ``m = 0``. Used before the mappings onto the simplex, which
    are invariant to a shift (so ``m`` carries no gradient): near the top of the row, where
    the support is, the differences between large scores are kept exactly.
    """
    m = torch.where(valid, x, torch.full_like(x, -math.inf)).amax(dim=1, keepdim=True).detach()
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    return torch.where(valid, x - m, torch.zeros_like(x)), m


def _finish(y_rows, valid, X, d):
    y = torch.where(valid, y_rows, torch.full_like(y_rows, -math.inf))
    p = sparsemax(y, dim=-1)
    return _from_rows(p.to(X.dtype), X, d)


def _run(X, dim, mask, lengths, gamma, lam, prox, project):
    """Validate, apply ``prox(rows, valid, lam)`` (or nothing) to ``X / gamma``, optionally project."""
    if lam is not None:
        lam = _check_real("lam", lam, 0.0, False)
    d, x, valid = _prepare(X, dim, mask, lengths, gamma)
    if X.numel() == 0:
        return X.clone()
    if project:
        x, _ = _shift_valid(x, valid)
    y = x if prox is None else prox(x, valid, lam)
    if project:
        return _finish(y, valid, X, d)
    return _from_rows(y.to(X.dtype), X, d)


def _oscar_valid(x, valid, lam):
    return _OscarProxFunction.apply(x, valid, lam, False, x.is_cuda)


def _oscar_on_simplex(x, valid, lam):
    return _OscarProxFunction.apply(x, valid, lam, True, x.is_cuda)


def _pack(valid: torch.Tensor):
    """Order that moves the valid entries of each row to the front (stable), its inverse, lengths."""
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    inverse = torch.argsort(order, dim=1)
    return order, inverse, valid.sum(dim=1)


def _tv_prox_valid(x: torch.Tensor, valid: torch.Tensor, lam: float) -> torch.Tensor:
    order, inverse, lens = _pack(valid)
    packed = x.gather(1, order)
    y = _TVProxFunction.apply(packed, lens, lam, x.is_cuda)
    return y.gather(1, inverse)


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
    return _run(X, dim, mask, lengths, 1.0, lam, _tv_prox_valid, False)


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
    return _run(X, dim, mask, lengths, gamma, lam, _tv_prox_valid, True)


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
    p = _check_real("p", p, 1.0, True, 2.0)
    d, x, valid = _prepare(X, dim, mask, lengths, gamma)
    if X.numel() == 0:
        return X.clone()
    y = _SqPnormFunction.apply(x, valid, p)
    return _from_rows(y.to(X.dtype), X, d)


class _StructuredMax(nn.Module):
    """Shared module form of a ``fn(X, lam, dim, gamma, mask, lengths)`` mapping."""

    def __init__(self, fn, lam: float, dim: int, gamma: float):
        super().__init__()
        self.fn = fn
        self.lam = _check_real("lam", lam, 0.0, False)
        self.gamma = _check_real("gamma", gamma, 0.0, True)
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
