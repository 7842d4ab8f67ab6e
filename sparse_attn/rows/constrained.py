"""Constrained softmax / sparsemax and fertility-constrained attention.

Malaviya, Ferreira & Martins 2018, "Sparse and Constrained Attention for Neural Machine Translation"::

    csoftmax(z; u)   = argmin_{a in simplex, a <= u} KL(a || softmax(z))
                     = min(u, exp(z - tau))                      (one scalar tau per row)
    csparsemax(z; u) = argmin_{a in simplex, a <= u} |a - z|^2
                     = clip(z - tau, 0, u)                        (Prop. 1)

Forward passes are exact and sort-based, batched over rows:

* csoftmax: the clipped set is a prefix of the entries sorted by ``z - log u`` (decreasing);
  for every prefix the scale of the free entries follows from a suffix log-sum-exp, and the
  first prefix whose next entry respects its bound is the solution.
* csparsemax: ``f(tau) = sum_j clip(z_j - tau, 0, u_j)`` is piecewise linear with
  breakpoints ``z_j`` and ``z_j - u_j``; sorting them gives ``f`` at every breakpoint by a
  cumulative sum, the crossing ``f = 1`` gives the sets, and ``tau`` follows from Eq. 11.

Backward passes use the closed forms: csparsemax Eq. 7-8 (Appendix A), csoftmax
``dz = 1_F a (g - s)``, ``du = 1_C (g - s)`` with ``F`` the free entries, ``C`` the clipped
ones and ``s = sum_F a g / sum_F a``.

Non-finite scores: a row with a NaN or ``+inf`` score among its valid entries gives an
all-NaN output row and NaN gradients (w.r.t. ``z`` and ``u``); other rows are unaffected.
``-inf`` scores are masked. The bounds ``u`` are validated instead (NaN or negative:
``ValueError``).

Infeasible bounds: a row whose valid bounds sum to less than 1 (beyond a rounding
tolerance) raises ``ValueError``; use a sink entry with ``u = inf`` (as
:class:`FertilityAttention` does with ``sink=True``) to keep every row feasible. This check
reads a flag back to the host. Rows with no valid entry give zeros and zero gradients.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sparse_attn._validation import (
    check_bool,
    check_bool_mask,
    check_choice,
    check_device,
    check_dim,
    check_floating,
    check_positive_int,
    check_real,
    check_tensor,
)
from sparse_attn.rows._structured_rows import from_rows, poison_rows, replace_rows, split_nonfinite, to_rows, valid_rows
from sparse_attn.rows.mappings import _compute_dtype

__all__ = [
    "csoftmax",
    "csparsemax",
    "FertilityPredictor",
    "FertilityAttention",
    "FertilityState",
]

_FEASIBILITY_ULPS = 64


def _check_bounds(u: torch.Tensor, valid: torch.Tensor) -> None:
    """Raise unless bounds are >= 0 (not NaN) on valid entries and each non-empty row is feasible."""
    bad = valid & ~(u >= 0)
    if bool(bad.any()):
        vals = torch.where(valid, u, torch.zeros_like(u))
        got = "nan" if bool(vals.isnan().any()) else f"a minimum of {float(vals.min())}"
        raise ValueError(f"u must be >= 0 (or +inf) on the valid entries, got {got}")
    total = torch.where(valid, u, torch.zeros_like(u)).sum(dim=1)
    nonempty = valid.any(dim=1)
    tol = _bound_tolerance(u)
    short = nonempty & (total < 1.0 - tol)
    if bool(short.any()):
        worst = float(total[short].min())
        raise ValueError(
            "u must sum to at least 1 over the valid entries of every row (otherwise no "
            f"distribution satisfies a <= u); got a row summing to {worst}. Add a sink entry "
            "with u = inf to make every row feasible."
        )


def _bound_tolerance(u: torch.Tensor) -> float:
    return _FEASIBILITY_ULPS * torch.finfo(u.dtype).eps * max(1, u.shape[1])


def _check_reached(found: torch.Tensor, u: torch.Tensor, valid: torch.Tensor, lost_mass: torch.Tensor) -> None:
    """Raise if a row's bounds are below the spacing of ``z`` where they matter (csparsemax): ``found`` ``(R, 1)``,
    whether the breakpoints reach ``f = 1`` (only rows whose bounds sum to 1 within the feasibility tolerance may end
    with every entry at its bound); ``lost_mass`` ``(R, 1)``, the bounds ``f`` misses (``z - u`` rounds to ``z``)."""
    total = torch.where(valid, u, torch.zeros_like(u)).sum(dim=1, keepdim=True)
    tol = _bound_tolerance(u)
    lost = (~found & (total > 1.0 + tol)) | (found & (lost_mass > tol))
    if bool(lost.any()):
        raise ValueError(
            f"csparsemax cannot resolve the bounds u in {u.dtype}: z - u rounds to z for the entries "
            f"that must carry the mass (a row's bounds sum to {float(total[lost].max()):.6g} > 1, yet the "
            "breakpoints miss the mass of bounds below the spacing of z); u must not be below the spacing of z. "
            "Rescale z, raise u or use float64"
        )


def _sort_valid_first(keys, valid: torch.Tensor) -> torch.Tensor:
    """Order sorting each row by ``keys`` (decreasing; later keys break ties of earlier ones)
    with all valid entries before invalid ones."""
    order = torch.arange(valid.shape[1], device=valid.device).expand(valid.shape)
    for key in reversed(keys):
        order = order.gather(1, torch.argsort(key.gather(1, order), dim=1, descending=True, stable=True))
    inval = (~valid).gather(1, order).to(torch.int8)
    return order.gather(1, torch.argsort(inval, dim=1, stable=True))


def _csoftmax_rows(z: torch.Tensor, u: torch.Tensor, valid: torch.Tensor):
    """Constrained softmax of rows ``z`` (R, n) under bounds ``u``; returns (a, clipped).

    Large scores: a shift by the row max ``m`` keeps the differences between the entries
    near ``m`` exactly but rounds the entries far below it to the same value; the unshifted
    scores keep those but lose the differences near a large ``m``. Both are used: the
    entries are sorted by ``z - log u`` (one rounding, so the order is never inverted) with
    ties broken by ``z - m - log u`` and then by ``u`` (equal scores), and each prefix test
    ``log softmax_r(z[r:]) <= log u_r - log(free mass)`` uses the form whose suffix max
    ``M_r`` is better resolved (``|M_r - m|`` or ``|M_r|``, whichever is smaller). float32
    rows select in float64, where the difference of two float32 scores is exact unless their
    magnitudes differ by more than ``2^29``. Left unresolved: a tie of several entries whose
    max ``M_r`` is both above ``~1e14`` in magnitude and more than ``~1e14`` below ``m``
    (the tie's ``log k`` is below the float64 spacing in both frames). The free entries get
    ``(1 - clipped mass) * softmax`` over the free set, shifted by the max of that set.
    """
    out_dtype = z.dtype
    if z.dtype == torch.float32:
        z, u = z.double(), u.double()
    n = z.shape[1]
    neg_inf = torch.full_like(z, -math.inf)
    zv = torch.where(valid, z, neg_inf)
    m = zv.amax(dim=1, keepdim=True)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    zs = zv - m
    uv = torch.where(valid, u, torch.zeros_like(u))
    log_u = torch.log(uv)
    key_raw = torch.where(valid, zv - log_u, neg_inf)
    key_shift = torch.where(valid, zs - log_u, neg_inf)
    order = _sort_valid_first((key_raw, key_shift, -log_u), valid)
    zv_s, zs_s, u_s, log_u_s, valid_s = (t.gather(1, order) for t in (zv, zs, uv, log_u, valid))
    u_fin = torch.where(torch.isinf(u_s), torch.zeros_like(u_s), u_s)
    clipped_mass = u_fin.cumsum(dim=1) - u_fin
    free_mass = 1.0 - clipped_mass
    suffix_max = zv_s.flip(1).cummax(dim=1).values.flip(1)
    share_raw = zv_s - torch.logcumsumexp(zv_s.flip(1), dim=1).flip(1)
    share_shift = zs_s - torch.logcumsumexp(zs_s.flip(1), dim=1).flip(1)
    use_shift = (suffix_max - m).abs() <= suffix_max.abs()
    log_share = torch.where(valid_s, torch.where(use_shift, share_shift, share_raw), torch.zeros_like(zv_s))
    safe_mass = torch.where(free_mass > 0, free_mass, torch.ones_like(free_mass))
    ok = ~valid_s | ((free_mass > 0) & (log_share <= log_u_s - torch.log(safe_mass)))
    ok = torch.cat([ok, torch.ones_like(ok[:, :1])], dim=1)
    r_star = ok.to(torch.int8).argmax(dim=1, keepdim=True)
    pos = torch.arange(n, device=z.device)
    clipped_s = valid_s & (pos < r_star)
    free_s = valid_s & ~clipped_s
    mass = torch.cat([free_mass, torch.zeros_like(free_mass[:, :1])], dim=1).gather(1, r_star)
    zf = torch.where(free_s, zv_s, neg_inf)
    mf = zf.amax(dim=1, keepdim=True)
    mf = torch.where(mf == -math.inf, torch.zeros_like(mf), mf)
    e = torch.exp(zf - mf)
    total = e.sum(dim=1, keepdim=True)
    share = e / torch.where(total > 0, total, torch.ones_like(total))
    a_s = torch.where(clipped_s, u_s, torch.where(free_s, mass.clamp(min=0) * share, torch.zeros_like(zv_s)))
    a = torch.zeros_like(z).scatter_(1, order, a_s)
    clipped = torch.zeros_like(valid).scatter_(1, order, clipped_s)
    return a.to(out_dtype), clipped


class _CSoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, u, valid):
        a, clipped = _csoftmax_rows(z, u, valid)
        ctx.save_for_backward(a, clipped, valid)
        return a

    @staticmethod
    def backward(ctx, grad):
        a, clipped, valid = ctx.saved_tensors
        free = valid & ~clipped
        af = torch.where(free, a, torch.zeros_like(a))
        mass = af.sum(dim=1, keepdim=True)
        s = (af * grad).sum(dim=1, keepdim=True) / torch.where(mass > 0, mass, torch.ones_like(mass))
        diff = grad - s
        gz = af * diff
        gu = torch.where(clipped, diff, torch.zeros_like(diff))
        return gz, gu, None


_SET_NONE, _SET_FREE, _SET_UPPER = 0, 1, 2


def _csparsemax_rows(z: torch.Tensor, u: torch.Tensor, valid: torch.Tensor):
    """Constrained sparsemax of rows ``z`` (R, n) under bounds ``u``; returns (a, sets).

    ``z`` is shifted by its max over the valid entries first (the result is invariant), so
    that ``z - u`` keeps the resolution of the bounds near the top of the row, and by the max
    of the free entries before ``tau`` is computed, so that weights carried by entries far
    below the row max keep theirs. A feasible row whose breakpoints cannot reach ``f = 1``, or
    miss the mass of a bound at or above the threshold (bounds below the spacing of ``z`` in
    the working precision), raises ``ValueError`` instead of returning a wrong result.
    """
    neg_inf = torch.full_like(z, -math.inf)
    m = torch.where(valid, z, neg_inf).amax(dim=1, keepdim=True)
    z = z - torch.where(m == -math.inf, torch.zeros_like(m), m)
    hi = torch.where(valid, z, neg_inf)
    lo = torch.where(valid, z - u, neg_inf)
    bp = torch.cat([hi, lo], dim=1)
    ones = valid.to(torch.int64)
    delta = torch.cat([ones, -ones], dim=1)
    bp_s, order = torch.sort(bp, dim=1, descending=True)
    slope = delta.gather(1, order).cumsum(dim=1)
    same = bp_s[:, :-1] == bp_s[:, 1:]
    gap = torch.where(same, torch.zeros_like(bp_s[:, 1:]), bp_s[:, :-1] - bp_s[:, 1:])
    contrib = torch.where(slope[:, :-1] > 0, slope[:, :-1].to(z.dtype) * gap, torch.zeros_like(gap))
    f = torch.cat([torch.zeros_like(bp_s[:, :1]), contrib.cumsum(dim=1)], dim=1)
    reach = f >= 1.0
    found = reach.any(dim=1, keepdim=True)
    k = reach.to(torch.int8).argmax(dim=1, keepdim=True).clamp(min=1)
    upper = bp_s.gather(1, k - 1)
    lower = bp_s.gather(1, k)
    # f crosses 1 between breakpoints lower < upper: free where an entry's linear piece spans them, at its bound
    # above them (no point between them is needed: one rounds onto a breakpoint when they are adjacent floats)
    free = valid & (lo <= lower) & (hi >= upper) & found
    at_upper = valid & (lo >= upper) & ~free & found
    n_free = free.sum(dim=1, keepdim=True)
    # tau relative to the top free entry, which may lie far below the row max (z - tau would lose the weights)
    top = torch.where(free, z, neg_inf).amax(dim=1, keepdim=True)
    z = z - torch.where(top == -math.inf, torch.zeros_like(top), top)
    u_up = torch.where(at_upper, u, torch.zeros_like(u))
    num = torch.where(free, z, torch.zeros_like(z)).sum(dim=1, keepdim=True) + u_up.sum(dim=1, keepdim=True) - 1.0
    tau = num / n_free.clamp(min=1).to(z.dtype)
    a = torch.minimum(torch.clamp(z - tau, min=0), u)
    # bounds below the spacing of z (z - u == z) add nothing to f: their mass is lost where the threshold reaches them
    lost_mass = torch.where(valid & (lo == hi) & (hi >= upper), u, torch.zeros_like(u)).sum(dim=1, keepdim=True)
    _check_reached(found, u, valid, lost_mass)
    all_upper = valid & ~found
    a = torch.where(all_upper, u, torch.where(valid & found, a, torch.zeros_like(a)))
    sets = torch.where(free, _SET_FREE, torch.where(at_upper | (all_upper & (u > 0)), _SET_UPPER, _SET_NONE))
    return a, sets.to(torch.int8)


class _CSparsemaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, u, valid):
        a, sets = _csparsemax_rows(z, u, valid)
        ctx.save_for_backward(sets)
        return a

    @staticmethod
    def backward(ctx, grad):
        (sets,) = ctx.saved_tensors
        free = sets == _SET_FREE
        n_free = free.sum(dim=1, keepdim=True).clamp(min=1).to(grad.dtype)
        m = torch.where(free, grad, torch.zeros_like(grad)).sum(dim=1, keepdim=True) / n_free
        diff = grad - m
        gz = torch.where(free, diff, torch.zeros_like(diff))
        gu = torch.where(sets == _SET_UPPER, diff, torch.zeros_like(diff))
        return gz, gu, None


def _constrained(fn, z, u, dim, mask, lengths):
    check_floating("z", z)
    check_tensor("u", u)
    if not u.dtype.is_floating_point:
        raise TypeError(f"u must be a floating-point tensor, got dtype {u.dtype}")
    check_device("u", u, z.device, "z")
    d = check_dim("dim", dim, z.ndim)
    try:
        zb, ub = torch.broadcast_tensors(z, u.to(z.device))
    except RuntimeError:
        raise ValueError(f"u must be broadcastable to z's shape {tuple(z.shape)}, got shape {tuple(u.shape)}") from None
    if zb.shape != z.shape:
        raise ValueError(
            f"u must be broadcastable to z's shape {tuple(z.shape)} without growing it, got shape {tuple(u.shape)}"
        )
    valid = valid_rows(z, d, mask, lengths)
    if z.numel() == 0:
        return z.clone()
    cdt = _compute_dtype(z.dtype)
    ur = to_rows(ub, d).to(cdt)
    _check_bounds(ur.detach(), valid)
    zr, bad = split_nonfinite(to_rows(zb, d).to(cdt), valid)
    ur = replace_rows(ur, bad, 1.0)
    zr = torch.where(valid, zr, torch.zeros_like(zr))
    a = fn.apply(zr, ur, valid)
    return from_rows(poison_rows(a, bad).to(z.dtype), z, d)


def csoftmax(z: torch.Tensor, u: torch.Tensor, dim: int = -1, mask=None, lengths=None) -> torch.Tensor:
    """Constrained softmax: the distribution closest in KL to ``softmax(z)`` with ``a <= u``.

    ``a_j = min(u_j, exp(z_j - tau))`` with ``tau`` such that the valid entries sum to 1.
    Differentiable w.r.t. ``z`` and ``u``. Loose bounds (``u >= softmax(z)``) give softmax.

    Args:
        z: scores, floating tensor of any shape.
        u: upper bounds, floating tensor broadcastable to ``z`` with values in ``[0, inf]``
            on the valid entries, summing to at least 1 over them in every non-empty row
            (else ``ValueError``; see the module docstring).
        dim: dimension to normalize over. Default -1.
        mask: optional boolean tensor broadcastable to ``z``; True = attend.
        lengths: optional integer tensor of ``z``'s shape without ``dim``; the first
            ``lengths`` entries along ``dim`` are valid. ``-inf`` scores are masked too.

    Returns:
        Tensor of ``z``'s shape and dtype, ``0 <= a <= u``, summing to 1 over the valid
        entries (rows with no valid entry give zeros).
    """
    return _constrained(_CSoftmaxFunction, z, u, dim, mask, lengths)


def csparsemax(z: torch.Tensor, u: torch.Tensor, dim: int = -1, mask=None, lengths=None) -> torch.Tensor:
    """Constrained sparsemax: the Euclidean projection of ``z`` onto ``{a in simplex, a <= u}``.

    ``a_j = clip(z_j - tau, 0, u_j)`` (Malaviya et al. 2018, Prop. 1). Sparse and bounded;
    differentiable w.r.t. ``z`` and ``u``. Loose bounds give sparsemax.

    Args:
        z, u, dim, mask, lengths: as in :func:`csoftmax`.

    Returns:
        Tensor of ``z``'s shape and dtype, ``0 <= a <= u``, summing to 1 over the valid
        entries (rows with no valid entry give zeros).
    """
    return _constrained(_CSparsemaxFunction, z, u, dim, mask, lengths)


def _broadcast_exact(name: str, x: torch.Tensor, shape) -> torch.Tensor:
    """``x`` broadcast to ``shape`` without growing it (``ValueError`` naming ``name`` otherwise)."""
    shape = tuple(shape)
    try:
        return torch.broadcast_to(x, shape)
    except RuntimeError:
        raise ValueError(f"{name} must be broadcastable to {shape}, got shape {tuple(x.shape)}") from None


def _check_mask_arg(name: str, mask, shape, meaning: str, device: torch.device) -> torch.Tensor:
    """A boolean ``mask`` on ``device`` broadcast to ``shape`` (``TypeError``/``ValueError`` naming ``name``)."""
    check_bool_mask(name, mask, device, meaning, "the scores")
    return _broadcast_exact(name, mask, shape)


class FertilityPredictor(nn.Module):
    """Predicts a fertility per source word: ``max_fertility * sigmoid(MLP(h))``.

    Args:
        input_dim: size of the encoder states ``h``.
        max_fertility: the largest fertility it can predict (> 0). Default 3.0.
        hidden_dim: hidden width of the two-layer MLP; ``None`` gives a single linear
            layer. Default None.

    ``forward(h)``: ``h`` of shape ``(..., J, input_dim)`` -> fertilities ``(..., J)``.
    """

    def __init__(self, input_dim: int, max_fertility: float = 3.0, hidden_dim: int | None = None):
        super().__init__()
        check_positive_int("input_dim", input_dim)
        check_positive_int("hidden_dim", hidden_dim, allow_none=True)
        self.input_dim = input_dim
        self.max_fertility = check_real("max_fertility", max_fertility, 0.0, True)
        if hidden_dim is None:
            self.net = nn.Linear(input_dim, 1)
        else:
            self.net = nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.Tanh(), nn.Linear(hidden_dim, 1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        check_floating("h", h)
        if h.ndim < 2 or h.shape[-1] != self.input_dim:
            raise ValueError(f"h must have shape (..., J, {self.input_dim}), got shape {tuple(h.shape)}")
        return self.max_fertility * torch.sigmoid(self.net(h).squeeze(-1))


class FertilityState:
    """Decoding state of :class:`FertilityAttention`, all tensors of shape ``(..., J')``.

    ``J' = J + 1`` with a sink (the last column). Attributes: ``fertility`` (``inf`` for the
    sink), ``cumulative`` (attention received so far), ``valid`` (boolean source mask).
    """

    def __init__(self, fertility: torch.Tensor, cumulative: torch.Tensor, valid: torch.Tensor):
        self.fertility = fertility
        self.cumulative = cumulative
        self.valid = valid

    @property
    def credit(self) -> torch.Tensor:
        """Remaining attention each source word may receive: ``max(fertility - cumulative, 0)``."""
        return torch.clamp(self.fertility - self.cumulative, min=0)


class FertilityAttention(nn.Module):
    """Fertility-constrained attention for sequence-to-sequence decoders (Malaviya et al. 2018).

    At target step ``t`` with scores ``z_t`` over ``J`` source words::

        u_t = max(fertility - cumulative_{t-1}, 0)
        a_t = rho(z_t + c * u_t, u_t)          rho = csparsemax or csoftmax
        cumulative_t = cumulative_{t-1} + a_t

    so no source word receives more total attention than its fertility over a decode.

    Args:
        transform: ``"csparsemax"`` (default) or ``"csoftmax"``.
        fertility: constant fertility of every word (float > 0), used when no per-word
            fertility is passed and no predictor is set. Default 2.0; ``None`` requires one.
        predictor: optional module mapping encoder states ``(..., J, D)`` to fertilities
            ``(..., J)`` (e.g. :class:`FertilityPredictor`); used when ``encoder_states`` are given.
        sink: append a sink column with unbounded fertility and a learnable score
            (``sink_score``), so decodes longer than the total fertility stay feasible.
            Default True. The sink column is last (index ``J``); its weight is the "null
            alignment" and can be dropped or paired with a learned value vector.
        exhaustion: the constant ``c >= 0`` rewarding words with credit left. Default 0.2.

    Shapes: scores ``(..., J)`` per step or ``(..., T, J)`` for a whole target; ``src_mask``
    boolean ``(..., J)`` (True = real word) or ``src_lengths`` ``(...)``; per-word
    ``fertility`` broadcastable to ``(..., J)``. Outputs have ``J + 1`` columns with a sink.
    Every tensor argument must be on the scores' device. A step whose scores hold a NaN or
    ``+inf`` gives an all-NaN attention row for that batch entry; its cumulative attention is
    then NaN, so its later steps are NaN too (no exception); other batch entries are unaffected.
    """

    def __init__(self, transform: str = "csparsemax", fertility: float | None = 2.0, predictor: nn.Module | None = None,
                 sink: bool = True, exhaustion: float = 0.2):
        super().__init__()
        check_choice("transform", transform, {"csparsemax", "csoftmax"})
        self.transform = transform
        self.fertility = None if fertility is None else check_real("fertility", fertility, 0.0, True)
        if predictor is not None and not callable(predictor):
            raise TypeError(f"predictor must be a module (callable) or None, got {type(predictor).__name__}")
        self.predictor = predictor
        check_bool("sink", sink)
        self.sink = sink
        self.exhaustion = check_real("exhaustion", exhaustion, 0.0, False)
        self.sink_score = nn.Parameter(torch.zeros(())) if sink else None

    def extra_repr(self) -> str:
        return (f"transform={self.transform!r}, fertility={self.fertility}, sink={self.sink}, "
                f"exhaustion={self.exhaustion}")

    def init_state(self, batch_shape, src_len: int, *, src_mask=None, src_lengths=None, fertility=None,
                   encoder_states=None, device=None, dtype=torch.float32) -> FertilityState:
        """Fresh state (zero cumulative attention) for sources of length ``src_len``.

        Args:
            batch_shape: leading shape of the scores (e.g. ``(B,)`` or ``(B, H)``).
            src_len: ``J``, the padded source length.
            src_mask: optional boolean ``(..., J)`` broadcastable to ``batch_shape + (J,)``.
            src_lengths: optional integer tensor broadcastable to ``batch_shape``.
            fertility: optional per-word fertilities broadcastable to ``batch_shape + (J,)``
                (or a float); overrides the predictor and the constant.
            encoder_states: ``(..., J, D)`` inputs of ``predictor`` when it is set.
            device, dtype: of the state tensors. Default CPU, float32.
        """
        check_positive_int("src_len", src_len)
        if not isinstance(batch_shape, (tuple, list, torch.Size)) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in batch_shape):
            raise TypeError(f"batch_shape must be a tuple of non-negative ints, got {batch_shape!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        shape = tuple(batch_shape) + (src_len,)
        dev = torch.device("cpu") if device is None else torch.device(device)
        valid = torch.ones(shape, dtype=torch.bool, device=device)
        if src_mask is not None:
            valid = valid & _check_mask_arg("src_mask", src_mask, shape, "(True = real word)", dev).to(device)
        if src_lengths is not None:
            check_tensor("src_lengths", src_lengths)
            if src_lengths.dtype.is_floating_point or src_lengths.dtype == torch.bool or src_lengths.is_complex():
                raise TypeError(f"src_lengths must be an integer tensor, got dtype {src_lengths.dtype}")
            check_device("src_lengths", src_lengths, dev, "the scores")
            lens = _broadcast_exact("src_lengths", src_lengths.to(device), shape[:-1])
            if lens.numel() > 0:
                lo, hi = int(lens.min()), int(lens.max())
                if lo < 0 or hi > src_len:
                    raise ValueError(f"src_lengths must be in [0, {src_len}] (src_len), got values in [{lo}, {hi}]")
            pos = torch.arange(src_len, device=device)
            valid = valid & (pos < lens.unsqueeze(-1))
        fert = self._resolve_fertility(shape, fertility, encoder_states, dev, dtype)
        fert = torch.where(valid, fert, torch.zeros_like(fert))
        if self.sink:
            fert = torch.cat([fert, torch.full_like(fert[..., :1], math.inf)], dim=-1)
            valid = torch.cat([valid, torch.ones_like(valid[..., :1])], dim=-1)
        return FertilityState(fert, torch.zeros_like(fert), valid)

    def _resolve_fertility(self, shape, fertility, encoder_states, device, dtype):
        if fertility is not None:
            if isinstance(fertility, torch.Tensor):
                if not fertility.dtype.is_floating_point:
                    raise TypeError(
                        f"fertility must be a float or a floating-point tensor, got dtype {fertility.dtype}"
                    )
                check_device("fertility", fertility, device, "the scores")
                try:
                    fert = torch.broadcast_to(fertility.to(device=device, dtype=dtype), shape)
                except RuntimeError:
                    raise ValueError(
                        f"fertility must be broadcastable to {shape}, got shape {tuple(fertility.shape)}"
                    ) from None
                if bool((fert.detach() < 0).any()) or bool(torch.isnan(fert.detach()).any()):
                    raise ValueError("fertility must be >= 0 everywhere, got a negative or NaN value")
                return fert
            return torch.full(shape, check_real("fertility", fertility, 0.0, True), device=device, dtype=dtype)
        if self.predictor is not None and encoder_states is not None:
            check_floating("encoder_states", encoder_states)
            check_device("encoder_states", encoder_states, device, "the scores")
            fert = self.predictor(encoder_states).to(device=device, dtype=dtype)
            try:
                return torch.broadcast_to(fert, shape)
            except RuntimeError:
                raise ValueError(
                    f"predictor output must be broadcastable to {shape}, got shape {tuple(fert.shape)}"
                ) from None
        if self.fertility is not None:
            return torch.full(shape, self.fertility, device=device, dtype=dtype)
        raise ValueError(
            "fertility is unknown: pass fertility=..., or encoder_states with a predictor, "
            "or construct the module with a constant fertility"
        )

    def step(self, scores: torch.Tensor, state: FertilityState | None = None, *, step_mask=None, **init_kwargs):
        """One decoding step.

        Args:
            scores: ``(..., J)`` attention scores of the current target position.
            state: the state returned by the previous step, or ``None`` to start a decode
                (then ``init_kwargs`` go to :meth:`init_state`).
            step_mask: optional boolean ``(...)``; False marks padded target positions,
                which give zero attention and consume no fertility.

        Returns:
            ``(attn, state)``: attention ``(..., J')`` and the updated state.
        """
        check_floating("scores", scores)
        if state is None:
            state = self.init_state(scores.shape[:-1], scores.shape[-1], device=scores.device, dtype=scores.dtype,
                                    **init_kwargs)
        elif init_kwargs:
            raise ValueError(f"init arguments {sorted(init_kwargs)} are only accepted with state=None")
        if not isinstance(state, FertilityState):
            raise TypeError(f"state must be a FertilityState or None, got {type(state).__name__}")
        check_device("scores", scores, state.fertility.device, "the state")
        j_total = state.fertility.shape[-1]
        if scores.shape[-1] + int(self.sink) != j_total:
            raise ValueError(
                f"scores must have {j_total - int(self.sink)} source positions (the state's), got {scores.shape[-1]}"
            )
        z = scores
        if self.sink:
            z = torch.cat([z, self.sink_score.to(z.dtype).expand(*z.shape[:-1], 1)], dim=-1)
        credit = state.credit
        finite_credit = torch.where(torch.isinf(credit), torch.zeros_like(credit), credit)
        z = z + self.exhaustion * finite_credit
        # A NaN credit (from an earlier NaN row) already made z NaN there: the row's output is NaN.
        bound = torch.where(torch.isnan(credit), torch.full_like(credit, math.inf), credit)
        valid = state.valid
        if step_mask is not None:
            step_valid = _check_mask_arg("step_mask", step_mask, scores.shape[:-1], "(False = padded target position)",
                                         scores.device)
            valid = valid & step_valid.to(valid.device).unsqueeze(-1)
        fn = csparsemax if self.transform == "csparsemax" else csoftmax
        attn = fn(z, bound, dim=-1, mask=valid.expand(z.shape))
        return attn, FertilityState(state.fertility, state.cumulative + attn, state.valid)

    def forward(self, scores: torch.Tensor, state: FertilityState | None = None, *, tgt_mask=None, **init_kwargs):
        """Attend for a whole target sequence (teacher forcing), one step after the other.

        Args:
            scores: ``(..., T, J)`` scores for all ``T`` target positions.
            state: optional state to continue from (e.g. after a prefix); ``None`` starts fresh.
            tgt_mask: optional boolean ``(..., T)``; False marks padded target positions.
            init_kwargs: ``src_mask``, ``src_lengths``, ``fertility``, ``encoder_states``
                (see :meth:`init_state`) when ``state`` is None.

        Returns:
            ``(attn, state)``: attention ``(..., T, J')`` and the final state.
        """
        check_floating("scores", scores)
        if scores.ndim < 2:
            raise ValueError(
                f"scores must have shape (..., T, J) with at least 2 dims, got shape {tuple(scores.shape)}"
            )
        if state is None:
            state = self.init_state(scores.shape[:-2], scores.shape[-1], device=scores.device, dtype=scores.dtype,
                                    **init_kwargs)
        elif init_kwargs:
            raise ValueError(f"init arguments {sorted(init_kwargs)} are only accepted with state=None")
        if tgt_mask is not None:
            tgt_mask = _check_mask_arg("tgt_mask", tgt_mask, scores.shape[:-1], "(False = padded target position)",
                                       scores.device)
        outs = []
        for t in range(scores.shape[-2]):
            step_mask = None if tgt_mask is None else tgt_mask[..., t]
            attn, state = self.step(scores[..., t, :], state, step_mask=step_mask)
            outs.append(attn)
        return torch.stack(outs, dim=-2), state
