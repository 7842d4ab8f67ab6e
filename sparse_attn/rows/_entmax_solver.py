"""The iterative alpha-entmax solver of the row mappings (:mod:`sparse_attn.rows.mappings`) for alphas other than 1,
1.5 and 2: safeguarded Halley steps on the Tsallis norm (:func:`_newton_rows`), over the entries that a certified lower
bound of the threshold leaves in play (:func:`_solve_rows`). docs/mappings.md derives and measures it.
"""

from __future__ import annotations

import math

import torch
from torch._higher_order_ops import while_loop

_BASE_TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
# the candidate search (:func:`_solve_rows`): groups per row whose maxima give the lower bound of the threshold, and
# the bound's relative safety margin
_GROUPS, _BOUND_MARGIN = 64, 2.0**-10


def _solver_tol(dtype: torch.dtype, n: int) -> float:
    return _BASE_TOL[dtype] * max(1.0, math.sqrt(n / 1024.0))


def _powers(y: torch.Tensor, inv_e: torch.Tensor) -> torch.Tensor:
    """``(1 + y) ** inv_e`` as ``exp(log1p(y) * inv_e)`` (0 at ``y = -1``), in fresh storage updated in place."""
    if torch.compiler.is_compiling():
        return torch.exp(torch.log1p(y) * inv_e)
    return torch.log1p(y).mul_(inv_e).exp_()


def _newton_rows(x: torch.Tensor, alpha: torch.Tensor, max_iter: int, ensure_sum_one: bool,
                 t0: torch.Tensor | None = None) -> torch.Tensor:
    """Iterative alpha-entmax on shifted rows ``x`` (max 0) with ``alpha != 1`` per row.

    With ``e = alpha - 1`` and ``y_j = max(e (x_j - t), -1)``, ``p_j = exp(log1p(y_j) / e)``
    and ``U_j = p_j ** (2 - alpha) = p_j / (1 + y_j)`` (``-dp_j / dt``).
    Safeguarded Halley steps on the Tsallis norm ``phi(t) = f(t) ** e - 1``, ``f = sum_j p_j``, started from the
    left bracket end ``t0`` (default ``t = max x = 0``), where ``f >= 1``; the bracket
    ``[t0, (1 - n ** -e) / e]`` is kept and a step leaving it is replaced by bisection
    (needed for alpha outside [1, 2]). Stops when ``|f - 1| <= tol`` on every row, when
    no row moves, or after ``max_iter`` steps, then divides by ``f``. While compiling the
    loop is a ``torch._higher_order_ops.while_loop`` with the same condition and step.
    """
    compiling = torch.compiler.is_compiling()
    e = alpha - 1
    inv_e = 1.0 / e
    n_valid = (x > -math.inf).sum(dim=-1, keepdim=True).clamp(min=1).to(x.dtype)
    if compiling or not bool((e > 0).all()):
        # e > 0 maps -inf to y = -1 as it is; e <= 0 would map it to +inf
        x = torch.where(e > 0, torch.maximum(x, -inv_e.clamp(min=0) - 1.0), x)
    ex = e * x
    tol = _solver_tol(x.dtype, x.shape[-1])
    if compiling:  # a symbolic float under dynamic shapes, which while_loop's closures cannot capture: a 0-d tensor
        tol = torch.full((), tol, dtype=x.dtype, device=x.device)
    lo = torch.zeros_like(e) if t0 is None else t0
    hi = -torch.expm1(-e * torch.log(n_valid)) * inv_e
    t = lo.clone()
    y = torch.clamp(ex - e * t, min=-1.0)
    state = (t, lo, hi, torch.ones_like(e, dtype=torch.bool), y, _powers(y, inv_e))

    def row_sum(state):
        return state[5].sum(dim=-1, keepdim=True)

    def still_active(state, f):
        return state[3] & ((f - 1).abs() > tol)

    tiny = torch.finfo(x.dtype).tiny
    half_1me = 0.5 * (1 - e)

    def step(state, f):
        t, lo, hi, active, y, p = state
        active = still_active(state, f)
        big = f > 1
        lo = torch.where(active & big, t, lo)
        hi = torch.where(active & ~big, t, hi)
        # U = p / (1 + y) and W = U / (1 + y) (-dU/dt up to 1 - e): no third transcendental per entry (p = 0
        # wherever 1 + y = 0)
        base = (1.0 + y).clamp_(min=tiny)
        u = p / base
        s = u.sum(dim=-1, keepdim=True)
        sw = u.div_(base).sum(dim=-1, keepdim=True)
        # Halley on phi: Newton's step c f over 1 - r, r = phi phi'' / (2 phi'^2) (f^e = phi + 1), the divisor kept
        # in [0.5, 2]; a step leaving the bracket bisects it (NaN included)
        phi = torch.expm1(e * torch.log(f))
        c = phi * inv_e / ((phi + 1) * s)
        r = c * half_1me * (f * sw / s - s)
        t_new = t + c * f / (1 - r).clamp(min=0.5, max=2.0)
        t_new = torch.where((t_new > lo) & (t_new < hi), t_new, 0.5 * (lo + hi))
        active = active & (t_new != t)
        t = torch.where(active, t_new, t)
        y = (ex - e * t).clamp_(min=-1.0)
        return t, lo, hi, active, y, _powers(y, inv_e)

    if compiling:
        def cond(i, *state):
            return (i < max_iter) & still_active(state, row_sum(state)).any()

        def body(i, *state):
            return (i + 1, *step(state, row_sum(state)))

        state = while_loop(cond, body, (torch.zeros((), dtype=torch.int64, device=x.device), *state))[1:]
    else:
        for _ in range(max_iter):
            f = row_sum(state)
            if not bool(still_active(state, f).any()):
                break
            state = step(state, f)
    p = state[5]
    if ensure_sum_one:
        f = p.sum(dim=-1, keepdim=True)
        p = p / f.clamp(min=torch.finfo(p.dtype).tiny)
    return p


def _solve_rows(x: torch.Tensor, alpha: torch.Tensor, max_iter: int, ensure_sum_one: bool) -> torch.Tensor:
    """:func:`_newton_rows` on the entries that can be in the support only (rows ``x`` (R, n), max 0; ``alpha``
    (R, 1), every value above 1). ``x`` is scratch: the caller's own shifted copy, overwritten by the result.

    A subset of a row has its threshold at most the row's (``f`` only grows with more entries), and a Newton step on
    ``phi`` from a point left of a threshold stays left of it, so one step from ``t = 0`` over the ``_GROUPS`` group
    maxima, less a margin, is a certified lower bound ``t_lo``; an entry with
    ``1 + (alpha - 1) (x_j - t_lo) <= 0`` has weight 0 at every threshold from there on. The others (candidates) are
    gathered into rows padded with ``-inf``, solved from ``t_lo`` (fewer Newton steps, each over the candidates
    alone, in two groups of rows each padded to its widest row) and scattered back; the other entries get exact
    zeros. Rows where more than half the entries are candidates (nearly flat rows, alpha close to 1) are solved
    whole from ``t_lo``, apart. Short rows, other alphas and tracing for ``torch.compile`` (data-dependent shapes)
    take the plain solver.
    """
    n = x.shape[-1]
    if torch.compiler.is_compiling() or n < 4 * _GROUPS or x.shape[0] == 0 or not bool((alpha > 1).all()):
        return _newton_rows(x, alpha, max_iter, ensure_sum_one)
    g = n // _GROUPS
    head = x[:, :g * _GROUPS].unflatten(-1, (_GROUPS, g)).amax(-1)
    if g * _GROUPS < n:
        head = torch.cat([head, x[:, g * _GROUPS:].amax(-1, keepdim=True)], dim=-1)
    # one Newton step on phi from t = 0 over the group maxima: it stays left of their threshold (phi is convex and
    # decreasing), hence left of the row's; a loose bound costs a few more candidates, not a wrong result
    e = alpha - 1
    y = (e * head).clamp_(min=-1.0)
    p = _powers(y, 1.0 / e)
    f = p.sum(dim=-1, keepdim=True)
    s = p.div_((1.0 + y).clamp_(min=torch.finfo(x.dtype).tiny)).sum(dim=-1, keepdim=True)
    phi = torch.expm1(e * torch.log(f))
    t_lo = (phi * f / (e * (phi + 1) * s)).clamp_(min=0.0)
    t_lo = t_lo - _BOUND_MARGIN * (1.0 + t_lo)
    flat = (x > t_lo - 1.0 / (alpha - 1)).reshape(-1).nonzero().squeeze(1)
    rows = torch.div(flat, n, rounding_mode="floor")
    counts = torch.bincount(rows, minlength=x.shape[0])
    wide = counts > n // 2
    n_wide = int(wide.sum())
    if n_wide == x.shape[0]:
        return _newton_rows(x, alpha, max_iter, ensure_sum_one, t0=t_lo)
    if n_wide:
        narrow = ~wide[rows]
        flat, rows = flat[narrow], rows[narrow]
        counts = counts.masked_fill(wide, 0)
    pos = torch.arange(flat.numel(), device=x.device) - (counts.cumsum(0) - counts)[rows]
    vals = x.reshape(-1)[flat]
    # two groups of rows, each padded to its own widest row: the rows of at most half the widest count, the others
    width = int(counts.max())
    half = max(1, width // 2)
    short = counts <= half
    p_vals = torch.empty_like(vals)
    for group, w in ((short, half), (~short & (counts > 0), width)):
        sel = group.nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        slot = torch.full((x.shape[0],), -1, dtype=torch.int64, device=x.device)
        slot[sel] = torch.arange(sel.numel(), device=x.device)
        ent = (slot[rows] >= 0).nonzero().squeeze(1)
        r_e, pos_e = slot[rows[ent]], pos[ent]
        cand = torch.full((sel.numel(), w), -math.inf, dtype=x.dtype, device=x.device)
        cand[r_e, pos_e] = vals[ent]
        p_vals[ent] = _newton_rows(cand, alpha[sel], max_iter, ensure_sum_one, t0=t_lo[sel])[r_e, pos_e]
    # the output in x's storage (the caller's shifted copy, not read again): zeros, then the candidates' weights
    x_wide = x[wide.nonzero().squeeze(1)] if n_wide else None
    p = x.zero_()
    p.view(-1)[flat] = p_vals
    if n_wide:
        sel = wide.nonzero().squeeze(1)
        p[sel] = _newton_rows(x_wide, alpha[sel], max_iter, ensure_sum_one, t0=t_lo[sel])
    return p
