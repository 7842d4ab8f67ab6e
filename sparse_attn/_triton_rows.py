"""Autograd wrapper and entry point of the Triton alpha-entmax row kernels (long rows on CUDA).

``sparse_attn.mappings`` calls :func:`entmax_rows_triton` for CUDA tensors with long rows;
it also runs on CPU tensors under ``TRITON_INTERPRET=1`` (tests). The math and the solver
are described in ``kernels/row_entmax.py`` and ``docs/readme/row_kernels.md``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from sparse_attn._validation import check_alpha, check_dim, check_tensor
from sparse_attn.kernels._common import interpreting
from sparse_attn.kernels.row_entmax import MODE_GENERAL, entmax_rows_bwd, entmax_rows_fwd, row_mode

__all__ = ["EntmaxRowsTritonFunction", "entmax_rows_triton"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class EntmaxRowsTritonFunction(torch.autograd.Function):
    """alpha-entmax over the rows of a ``(n_rows, n_cols)`` contiguous tensor.

    ``forward(x, alpha_rows, alpha_value)``: ``alpha_rows`` is a float32 ``(n_rows,)``
    tensor (differentiable) or ``None``, in which case the Python float ``alpha_value``
    applies to every row. The backward recomputes nothing: it reads the saved output
    (first-order gradients only).
    """

    @staticmethod
    def forward(ctx, x, alpha_rows, alpha_value):
        if alpha_rows is None:
            alpha, mode = alpha_value, row_mode(alpha_value)
        else:
            alpha, mode = alpha_rows.detach(), MODE_GENERAL
        y = entmax_rows_fwd(x, alpha, mode)
        ctx.mode = mode
        ctx.alpha_value = alpha_value
        ctx.save_for_backward(y, alpha if alpha_rows is not None else None)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        y, alpha_rows = ctx.saved_tensors
        alpha = ctx.alpha_value if alpha_rows is None else alpha_rows
        need_dalpha = alpha_rows is not None and ctx.needs_input_grad[1]
        dx, dalpha = entmax_rows_bwd(y, dy.contiguous(), alpha, ctx.mode, need_dalpha=need_dalpha)
        return dx, dalpha, None


def entmax_rows_triton(X: torch.Tensor, alpha, dim: int = -1) -> torch.Tensor:
    """alpha-entmax along ``dim`` with the Triton row kernels (for long rows, e.g. vocabularies).

    ``p = [(alpha - 1) x - tau]_+ ** (1 / (alpha - 1))`` with ``sum p = 1`` along ``dim``;
    alpha = 1 is softmax, 2 sparsemax (exact, Michelot), 1.5 1.5-entmax (no transcendental
    functions), anything else in between Newton on the Tsallis norm to ``|sum p - 1| <= 1e-6``
    followed by renormalization. Differentiable w.r.t. ``X`` and a tensor ``alpha``.

    Args:
        X: float16, bfloat16 or float32 tensor of any shape with at least one dimension, on
            CUDA (or on CPU when ``TRITON_INTERPRET=1``). fp16/bf16 are computed in float32.
        alpha: float in [1, 2], or floating tensor with values in [1, 2] broadcastable to
            ``X`` with size 1 along ``dim`` (one alpha per row, e.g. ``(1, H, 1, 1)``).
        dim: dimension to normalize over. Default -1.

    Returns:
        Tensor of ``X``'s shape and dtype. ``-inf`` entries are exactly 0; a row that is
        entirely ``-inf`` is 0 with zero gradient.
    """
    check_tensor("X", X)
    if X.dtype not in _DTYPES:
        raise TypeError(f"X must be a float16, bfloat16 or float32 tensor, got dtype {X.dtype}")
    if not (X.is_cuda or interpreting()):
        raise ValueError(f"X must be a CUDA tensor (or TRITON_INTERPRET=1 must be set), got device {X.device}")
    d = check_dim("dim", dim, X.ndim)
    check_alpha("alpha", alpha, X, d)
    if isinstance(alpha, torch.Tensor):
        lo, hi = (float(alpha.detach().min()), float(alpha.detach().max())) if alpha.numel() else (1.0, 1.0)
    else:
        lo = hi = float(alpha)
    if lo < 1.0 or hi > 2.0:
        raise ValueError(f"alpha must be in [1, 2] for the Triton row kernels, got values in [{lo}, {hi}]")
    if X.numel() == 0:
        return X.clone()
    n = X.shape[d]
    xr = X.movedim(d, -1)
    batch_shape = xr.shape[:-1]
    xr = xr.reshape(-1, n).contiguous()
    if isinstance(alpha, torch.Tensor):
        shape = (1,) * (X.ndim - alpha.ndim) + tuple(alpha.shape)
        a = alpha.reshape(shape).expand(*X.shape[:d], 1, *X.shape[d + 1:])
        a = a.movedim(d, -1).reshape(-1).to(device=X.device, dtype=torch.float32)
        y = EntmaxRowsTritonFunction.apply(xr, a, None)
    else:
        y = EntmaxRowsTritonFunction.apply(xr, None, float(alpha))
    return y.reshape(*batch_shape, n).movedim(-1, d)
