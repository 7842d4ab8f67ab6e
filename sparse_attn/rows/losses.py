"""Fenchel-Young losses of the entmax family.

For a regularizer ``Omega = -H_alpha`` (Tsallis entropy
``H_alpha(p) = (1 - sum_j p_j ** alpha) / (alpha (alpha - 1))``, Shannon at ``alpha = 1``)
the loss of logits ``x`` against a target distribution ``y`` is::

    L(x; y) = Omega(y) + Omega*(x) - <x, y> = <p - y, x> + H_alpha(p) - H_alpha(y),

with ``p = alpha-entmax(x)``. It is >= 0, zero iff ``p = y``, and its gradient w.r.t.
``x`` is ``p - y``. At ``alpha = 2`` it is the sparsemax loss of Martins & Astudillo
(2016, "From Softmax to Sparsemax"), including its multi-label form with
label-proportion targets; ``alpha = 1.5`` and general alpha are the entmax losses of
Peters, Niculae & Martins (2019, "Sparse Sequence-to-Sequence Models").

Targets are integer class labels of shape ``(N,)`` (entries equal to ``ignore_index``
are skipped) or label proportions of shape ``(N, C)`` (finite, non-negative rows summing to
1 within 1e-3), on ``X``'s device; a target that breaks this raises ``ValueError`` (reading
it back to the host). Logits of shape ``(N, C)``; ``-inf`` logits are allowed and give finite
losses as long as the target puts no mass on them; a row with a NaN or ``+inf`` logit gives
a NaN loss and NaN gradients (no exception; other rows are unaffected); ignored rows give
loss 0 and gradient 0 whatever their logits. ``alpha`` is treated as a constant (no
gradient). Empty batches (``N = 0``) give an empty ``"none"`` loss and 0 for ``"sum"`` and
``"mean"`` (the mean over no rows is 0, as for a batch whose rows are all ignored).

Losses are returned in the compute dtype: float32 for float16/bfloat16 (and float32)
logits, float64 for float64 ones, because a loss of half-precision logits of magnitude
``1e4`` can exceed the float16 range. Gradients w.r.t. the logits are in their dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from sparse_attn._validation import (
    check_alpha,
    check_choice,
    check_device,
    check_floating,
    check_int_or_0d_tensor,
    check_positive_int,
    check_tensor,
)
from sparse_attn.kernels._args import computed_alpha
from sparse_attn.rows.mappings import _check_alpha_arg, _compute_dtype, entmax15, entmax_bisect, sparsemax

__all__ = [
    "sparsemax_loss",
    "entmax15_loss",
    "entmax_bisect_loss",
    "SparsemaxLoss",
    "Entmax15Loss",
    "EntmaxBisectLoss",
]

_REDUCTIONS = {"none", "sum", "mean", "elementwise_mean"}
_PROPORTION_TOL = 1e-3


def _tsallis_entropy(p: torch.Tensor, alpha: torch.Tensor | float) -> torch.Tensor:
    """Row-wise Tsallis entropy of ``p`` (R, C) with alpha float or (R, 1); Shannon at alpha 1.

    Uses ``H = -sum_j p_j expm1((alpha - 1) log p_j) / ((alpha - 1) alpha)``, which is
    accurate for alpha close to 1 and equals ``-sum p log p`` at ``alpha = 1``.
    """
    support = p > 0
    log_p = torch.log(torch.where(support, p, torch.ones_like(p)))
    if not isinstance(alpha, torch.Tensor):
        alpha = torch.tensor(alpha, dtype=p.dtype, device=p.device)
    e = alpha - 1
    e_safe = torch.where(e == 0, torch.ones_like(e), e)
    term = torch.where(e == 0, log_p, torch.expm1(e * log_p) / e_safe) / alpha
    return -(torch.where(support, p * term, torch.zeros_like(p))).sum(dim=-1)


class _FenchelYoungFunction(torch.autograd.Function):
    """Loss rows ``(R,)`` in ``p``'s dtype from logits ``x`` (R, C), probabilities ``p`` and targets ``y`` (R, C).

    The gradient w.r.t. ``x`` is ``p - y`` in ``x``'s dtype; rows with ``y = p`` give loss 0
    and gradient 0 exactly. A backward under ``create_graph`` recomputes ``p = mapping(x)`` (rows
    ``keep`` only, None = all) with its graph, so that second-order gradients get the mapping's
    Jacobian; a first-order backward reads the saved ``p - y`` only.
    """

    @staticmethod
    def forward(ctx, x, p, y, alpha, mapping, keep):
        cdt = p.dtype
        xc = x.detach().to(cdt)
        xmax = xc.amax(dim=-1, keepdim=True)
        xmax = torch.where(torch.isfinite(xmax), xmax, torch.zeros_like(xmax))
        diff = p - y
        lin = torch.where(diff != 0, diff * (xc - xmax), torch.zeros_like(xc)).sum(dim=-1)
        loss = lin + _tsallis_entropy(p, alpha) - _tsallis_entropy(y, alpha)
        loss = torch.clamp(loss, min=0)
        ctx.x_dtype = x.dtype
        ctx.mapping = mapping
        ctx.keep = keep
        ctx.save_for_backward(x, diff)
        return loss

    @staticmethod
    def backward(ctx, grad):
        x, diff = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph: the same p, now with its graph (ignored rows read zeros: their NaN logits stay out)
            xc = x.to(diff.dtype)
            if ctx.keep is not None:
                xc = torch.where(ctx.keep.unsqueeze(1), xc, torch.zeros_like(xc))
            p = ctx.mapping(xc)
            if ctx.keep is not None:
                p = torch.where(ctx.keep.unsqueeze(1), p, torch.zeros_like(p))
            diff = diff + (p - p.detach())
        return (grad.to(diff.dtype).unsqueeze(-1) * diff).to(ctx.x_dtype), None, None, None, None, None


def _check_proportions(y: torch.Tensor) -> None:
    """Raise unless every entry is finite and >= 0 and every row sums to 1 within 1e-3 (one host sync)."""
    bad_entry = ~((y >= 0) & (y < torch.inf))
    bad_sum = ~((y.sum(-1) - 1).abs() <= _PROPORTION_TOL)
    any_bad_entry, any_bad_sum = torch.stack([bad_entry.any(), bad_sum.any()]).tolist()
    if any_bad_entry:
        raise ValueError(
            "target label proportions must be finite and >= 0, got "
            f"{y[bad_entry][0].item()} in row {int(bad_entry.any(-1).nonzero()[0, 0])}"
        )
    if any_bad_sum:
        row = int(bad_sum.nonzero()[0, 0])
        raise ValueError(
            f"target label proportions must sum to 1 in every row (within {_PROPORTION_TOL}), "
            f"got row {row} summing to {y[row].sum().item()}"
        )


def _fy_loss(X, target, alpha, mapping, ignore_index, reduction):
    check_floating("X", X)
    check_tensor("target", target)
    check_choice("reduction", reduction, _REDUCTIONS)
    ignore_index = check_int_or_0d_tensor("ignore_index", ignore_index)
    if X.ndim != 2:
        raise ValueError(f"X must have shape (N, C), got shape {tuple(X.shape)}")
    check_device("target", target, X.device, "X")
    check_alpha("alpha", alpha, X, 1)
    n_rows, n_cls = X.shape
    cdt = _compute_dtype(X.dtype)
    keep = None
    if target.dtype.is_floating_point:
        if tuple(target.shape) != tuple(X.shape):
            raise ValueError(
                f"target with label proportions must have X's shape {tuple(X.shape)}, got {tuple(target.shape)}"
            )
        y = target.detach().to(cdt)
        if n_rows:
            _check_proportions(y)
    elif target.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        if tuple(target.shape) != (n_rows,):
            raise ValueError(f"target labels must have shape ({n_rows},), got {tuple(target.shape)}")
        labels = target.long()
        if isinstance(ignore_index, torch.Tensor):
            # Compared on the labels' device (a CUDA index with CPU labels is copied over; no other read).
            ignore_index = ignore_index.to(labels.device)
        keep = labels != ignore_index
        if bool(((labels[keep] < 0) | (labels[keep] >= n_cls)).any()):
            shown = int(ignore_index) if isinstance(ignore_index, torch.Tensor) else ignore_index
            raise ValueError(f"target labels must be in [0, {n_cls - 1}] or equal ignore_index={shown}")
        safe = torch.where(keep, labels, torch.zeros_like(labels))
        y = torch.zeros(n_rows, n_cls, dtype=cdt, device=X.device)
        y.scatter_(1, safe.unsqueeze(1), 1.0)
    else:
        raise TypeError(
            f"target must be an integer label tensor or a floating proportion tensor, got dtype {target.dtype}"
        )
    with torch.no_grad():
        p = mapping(X.detach().to(cdt))
    if keep is not None:
        # Ignored rows: p = y = 0 gives loss 0 and gradient 0 whatever the logits (NaN included).
        p = torch.where(keep.unsqueeze(1), p, torch.zeros_like(p))
        y = torch.where(keep.unsqueeze(1), y, torch.zeros_like(y))
    if isinstance(alpha, torch.Tensor):
        alpha_rows = alpha.detach().to(cdt).reshape(-1, 1).expand(n_rows, 1)
    else:
        alpha_rows = computed_alpha(alpha, cdt)
    loss = _FenchelYoungFunction.apply(X, p, y, alpha_rows, mapping, keep)
    if keep is not None:
        loss = torch.where(keep, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    count = keep.sum() if keep is not None else torch.tensor(n_rows, device=X.device)
    return loss.sum() / count.clamp(min=1).to(loss.dtype)


def sparsemax_loss(X: torch.Tensor, target: torch.Tensor, k: int | None = None,
                   ignore_index: int | torch.Tensor = -100, reduction: str = "none") -> torch.Tensor:
    """Sparsemax (Fenchel-Young, alpha = 2) loss.

    Args:
        X: logits ``(N, C)``, floating (a NaN or ``+inf`` in a row gives that row a NaN loss).
        target: labels ``(N,)`` (integer, in ``[0, C)`` or ``ignore_index``) or label
            proportions ``(N, C)`` (floating, finite, >= 0, rows summing to 1), on ``X``'s device.
        k: partial-sort size for :func:`sparsemax`. Default None.
        ignore_index: label whose rows give loss 0 and are left out of the mean: an int or a 0-d
            integer tensor on any device (e.g. ``target[0]``; a CUDA one is compared on the device).
            Default -100.
        reduction: ``"none"`` (default, shape ``(N,)``), ``"sum"``, ``"mean"`` or
            ``"elementwise_mean"`` (both: mean over non-ignored rows, 0 if none).

    Returns:
        Loss in float32 for float16/bfloat16/float32 ``X`` and float64 for float64 ``X``
        (half-precision losses can exceed the fp16 range); the gradient w.r.t. ``X`` is
        ``sparsemax(X) - target`` in ``X``'s dtype, exactly 0 on ignored rows.
    """
    check_positive_int("k", k, allow_none=True)
    return _fy_loss(X, target, 2.0, lambda x: sparsemax(x, dim=-1, k=k), ignore_index, reduction)


def entmax15_loss(X: torch.Tensor, target: torch.Tensor, k: int | None = None,
                  ignore_index: int | torch.Tensor = -100, reduction: str = "none") -> torch.Tensor:
    """1.5-entmax (Fenchel-Young, alpha = 1.5) loss; arguments as :func:`sparsemax_loss`."""
    check_positive_int("k", k, allow_none=True)
    return _fy_loss(X, target, 1.5, lambda x: entmax15(x, dim=-1, k=k), ignore_index, reduction)


def entmax_bisect_loss(X: torch.Tensor, target: torch.Tensor, alpha=1.5, n_iter: int = 50,
                       ignore_index: int | torch.Tensor = -100, reduction: str = "none") -> torch.Tensor:
    """alpha-entmax (Fenchel-Young) loss for any ``alpha > 0``.

    Args:
        X, target, ignore_index, reduction: as :func:`sparsemax_loss`.
        alpha: float, or tensor of shape ``()``, ``(1,)``, ``(N, 1)`` or ``(1, 1)``; values
            > 0. Treated as a constant (no gradient). ``alpha = 1`` is the softmax
            (cross-entropy) loss. Default 1.5.
        n_iter: maximum solver iterations. Default 50.
    """
    return _fy_loss(X, target, alpha, lambda x: entmax_bisect(x, alpha=alpha, dim=-1, n_iter=n_iter),
                    ignore_index, reduction)


class _LossModule(nn.Module):
    def __init__(self, ignore_index: int | torch.Tensor, reduction: str):
        super().__init__()
        check_choice("reduction", reduction, _REDUCTIONS)
        self.ignore_index = check_int_or_0d_tensor("ignore_index", ignore_index)
        self.reduction = reduction


class SparsemaxLoss(_LossModule):
    """Module form of :func:`sparsemax_loss` (``k=None, ignore_index=-100, reduction="elementwise_mean"``)."""

    def __init__(self, k: int | None = None, ignore_index: int | torch.Tensor = -100,
                 reduction: str = "elementwise_mean"):
        super().__init__(ignore_index, reduction)
        check_positive_int("k", k, allow_none=True)
        self.k = k

    def forward(self, X: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return sparsemax_loss(X, target, k=self.k, ignore_index=self.ignore_index, reduction=self.reduction)


class Entmax15Loss(_LossModule):
    """Module form of :func:`entmax15_loss` (``k=None, ignore_index=-100, reduction="elementwise_mean"``)."""

    def __init__(self, k: int | None = None, ignore_index: int | torch.Tensor = -100,
                 reduction: str = "elementwise_mean"):
        super().__init__(ignore_index, reduction)
        check_positive_int("k", k, allow_none=True)
        self.k = k

    def forward(self, X: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return entmax15_loss(X, target, k=self.k, ignore_index=self.ignore_index, reduction=self.reduction)


class EntmaxBisectLoss(_LossModule):
    """Module form of :func:`entmax_bisect_loss`
    (``alpha=1.5, n_iter=50, ignore_index=-100, reduction="elementwise_mean"``)."""

    def __init__(self, alpha=1.5, n_iter: int = 50, ignore_index: int | torch.Tensor = -100,
                 reduction: str = "elementwise_mean"):
        super().__init__(ignore_index, reduction)
        _check_alpha_arg(alpha)
        check_positive_int("n_iter", n_iter)
        self.alpha = alpha
        self.n_iter = n_iter

    def forward(self, X: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return entmax_bisect_loss(X, target, alpha=self.alpha, n_iter=self.n_iter,
                                  ignore_index=self.ignore_index, reduction=self.reduction)
