"""Row helpers of the structured and constrained mappings: row layout, validity masks,
non-finite rows, and the two sequential proximal operators (1-d TV and OSCAR) as custom ops.

Everything works on rows ``(R, n)``: :func:`to_rows` moves the normalized dimension last and
flattens the others. :func:`valid_rows` combines ``-inf`` entries, a boolean ``mask`` and
``lengths`` into one boolean ``(R, n)`` mask. :func:`split_nonfinite` implements the project's
non-finite policy for these mappings: a row holding a NaN or ``+inf`` among its valid entries
is computed as a row of zeros and reported in ``bad``; :func:`poison_rows` then writes NaN over
the whole output row, and the backward gives NaN gradients for it (entries excluded by
``mask``/``lengths`` are not looked at).

The proxes are ``torch.library`` custom ops (``sparse_attn::tv_prox_rows``,
``sparse_attn::oscar_prox_rows``) with fake implementations and registered backwards (the
group Jacobians of Prop. 3 of Niculae & Blondel 2017, "A Regularized Framework for Sparse and Structured Neural
Attention").
Each op holds the Triton kernel (``sparse_attn.kernels.rows.structured``) and the vectorized
PyTorch implementation of the same operation, chosen by its ``use_triton`` flag, so one
autograd formula serves both (``sparse_attn.rows._dispatch`` states the rule;
:func:`use_kernels` is the ``auto`` choice: CUDA tensors use the kernels).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sparse_attn._validation import check_bool_mask, check_device, check_tensor
from sparse_attn.rows._dispatch import load_kernel

_KERNELS = "sparse_attn.kernels.rows.structured"


def valid_rows(X: torch.Tensor, d: int, mask, lengths) -> torch.Tensor:
    """Boolean ``(R, n)`` validity of the rows of ``X`` along ``d`` (True = attend).

    Combines ``X > -inf``, an optional boolean ``mask`` broadcastable to ``X`` and optional
    integer ``lengths`` broadcastable to ``X`` without ``dim`` (values in ``[0, n]``), both on
    ``X``'s device (a 0-d CPU tensor is accepted).
    """
    n = X.shape[d]
    valid = X != -math.inf
    if mask is not None:
        check_bool_mask("mask", mask, X.device, "(True = attend)", "X")
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
        check_device("lengths", lengths, X.device, "X")
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
    return to_rows(valid, d)


class _NonFiniteRows(torch.autograd.Function):
    """Forward: rows flagged in ``bad`` (R, 1) replaced by ``fill``. Backward: NaN gradients on those rows."""

    @staticmethod
    def forward(ctx, x, bad, fill):
        ctx.save_for_backward(bad)
        return torch.where(bad, torch.full_like(x, fill), x)

    @staticmethod
    def backward(ctx, grad):
        (bad,) = ctx.saved_tensors
        return torch.where(bad, torch.full_like(grad, math.nan), grad), None, None


def split_nonfinite(x: torch.Tensor, valid: torch.Tensor):
    """``(x', bad)``: ``bad`` (R, 1) flags rows with a NaN or ``+inf`` among their valid entries,
    which are zeros in ``x'``; the gradient w.r.t. ``x`` is NaN on those rows. No host sync."""
    bad = (valid & ~(x < math.inf)).any(dim=1, keepdim=True)
    return _NonFiniteRows.apply(x, bad, 0.0), bad


def replace_rows(x: torch.Tensor, bad: torch.Tensor, fill: float) -> torch.Tensor:
    """``x`` with the ``bad`` rows set to ``fill`` (NaN gradients on them), for a second input of the same rows."""
    return _NonFiniteRows.apply(x, bad, fill)


def poison_rows(y: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``y`` with every entry of the ``bad`` rows set to NaN."""
    return torch.where(bad, torch.full_like(y, math.nan), y)


def use_kernels(x: torch.Tensor) -> bool:
    """The ``auto`` rule for the prox kernels: CUDA tensors, when Triton can be imported."""
    return x.is_cuda and load_kernel(_KERNELS, "tv_prox_rows") is not None


def to_rows(X: torch.Tensor, d: int) -> torch.Tensor:
    """``X`` with ``dim`` moved last and the other dims flattened: ``(R, n)`` (also when n = 0)."""
    return X.movedim(d, -1).reshape(math.prod(X.shape[:d] + X.shape[d + 1:]), X.shape[d])


def from_rows(rows: torch.Tensor, X: torch.Tensor, d: int) -> torch.Tensor:
    """Inverse of :func:`to_rows`: rows ``(R, n)`` back to ``X``'s layout."""
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


def _contiguous_groups(y: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Group ids (R, n) of runs of equal adjacent values; positions ``>= lengths`` are singletons."""
    pos = torch.arange(y.shape[1], device=y.device)
    boundary = torch.ones_like(y, dtype=torch.bool)
    boundary[:, 1:] = y[:, 1:] != y[:, :-1]
    boundary = boundary | (pos >= lengths.unsqueeze(1))
    return boundary.to(torch.int64).cumsum(dim=1) - 1


@torch.library.custom_op("sparse_attn::tv_prox_rows", mutates_args=())
def _tv_prox_op(x: Tensor, lengths: Tensor, lam: float, use_triton: bool) -> Tensor:
    """``P_TV`` on packed rows ``x`` (R, n) whose valid entries are the first ``lengths``; 0 past them."""
    pos = torch.arange(x.shape[1], device=x.device)
    if lam == 0.0:
        return torch.where(pos < lengths.unsqueeze(1), x, torch.zeros_like(x))
    if use_triton:
        from sparse_attn.kernels.rows.structured import tv_prox_rows

        y = tv_prox_rows(x, lengths, lam)
        return torch.where(pos < lengths.unsqueeze(1), y, torch.zeros_like(y))
    return _tv_prox_torch(x, lengths, lam)


@_tv_prox_op.register_fake
def _tv_prox_fake(x, lengths, lam, use_triton):
    return torch.empty_like(x)


def _tv_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output, inputs[1])


def _tv_backward(ctx, grad):
    """Prop. 3: the gradient averaged over each run of equal output values; 0 past ``lengths``."""
    y, lengths = ctx.saved_tensors
    gx = _group_mean(grad, _contiguous_groups(y, lengths))
    valid = torch.arange(y.shape[1], device=y.device) < lengths.unsqueeze(1)
    return torch.where(valid, gx, torch.zeros_like(gx)), None, None, None


_tv_prox_op.register_autograd(_tv_backward, setup_context=_tv_setup_context)


def tv_prox_valid(x: torch.Tensor, valid: torch.Tensor, lam: float) -> torch.Tensor:
    """Differentiable ``P_TV`` over the ``valid`` entries of rows ``x`` (consecutive valid entries are linked)."""
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    inverse = torch.argsort(order, dim=1)
    y = _tv_prox_op(x.gather(1, order), valid.sum(dim=1), lam, use_kernels(x))
    return y.gather(1, inverse)


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


@torch.library.custom_op("sparse_attn::oscar_prox_rows", mutates_args=())
def _oscar_prox_op(x: Tensor, valid: Tensor, lam: float, on_simplex: bool,
                   use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """OSCAR prox on rows ``x`` (R, n) restricted to the ``valid`` entries (others give 0).

    Returns ``(y, gid, sign)``: the prox, the group id of every entry (groups of equal
    magnitude, Prop. 3) and the sign the backward applies. ``on_simplex=False``: the prox
    itself (magnitudes sorted, clipped at 0, signs restored). ``on_simplex=True``: the prox of
    ``x + c`` for a constant ``c`` large enough that every entry stays positive, minus ``c``
    (values sorted, no clipping, all signs +); followed by the simplex projection this is the
    exact oscarmax for any ``x``, because the constrained problem is invariant to shifting
    ``x``. ``use_triton``: run the isotonic regression in the Triton kernel.
    """
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
        from sparse_attn.kernels.rows.structured import isotonic_nonincreasing_rows

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
    return sign * z_mag, gid, sign


@_oscar_prox_op.register_fake
def _oscar_prox_fake(x, valid, lam, on_simplex, use_triton):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.int64), torch.empty_like(x)


def _oscar_setup_context(ctx, inputs, output):
    _, gid, sign = output
    ctx.mark_non_differentiable(gid, sign)
    ctx.save_for_backward(gid, sign)


def _oscar_backward(ctx, grad, _grad_gid, _grad_sign):
    """Prop. 3: the signed gradient averaged over each group of equal magnitude."""
    gid, sign = ctx.saved_tensors
    return sign * _group_mean(sign * grad, gid), None, None, None, None


_oscar_prox_op.register_autograd(_oscar_backward, setup_context=_oscar_setup_context)


def oscar_prox_rows(x: torch.Tensor, valid: torch.Tensor, lam: float, on_simplex: bool,
                    use_triton: bool | None = None) -> torch.Tensor:
    """Differentiable OSCAR prox over the ``valid`` entries of rows ``x`` (see ``_oscar_prox_op``).

    ``use_triton=None`` applies the ``auto`` rule (:func:`use_kernels`).
    """
    if use_triton is None:
        use_triton = use_kernels(x)
    return _oscar_prox_op(x, valid, lam, on_simplex, use_triton)[0]
