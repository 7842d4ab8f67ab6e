"""Autograd wiring and entry point of the Triton alpha-entmax row kernels (long rows on CUDA).

The launchers of ``kernels/rows/row_entmax.py`` are wrapped as the ``torch.library`` custom ops
``sparse_attn::entmax_rows_fwd`` and ``sparse_attn::entmax_rows_bwd`` with fake
implementations (shapes only) and a registered autograd formula, following the rule of
``sparse_attn.rows._dispatch``. ``sparse_attn.mappings`` calls :func:`entmax_rows_triton` for CUDA
tensors with long rows (the ``auto`` dispatch); called directly it is the forced kernel path
and raises instead of falling back. It also runs on CPU tensors under ``TRITON_INTERPRET=1``
(tests). The math and the solver are described in ``kernels/rows/row_entmax.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparse_attn._validation import check_alpha, check_dim, check_tensor
from sparse_attn.kernels._args import interpreting
from sparse_attn.kernels.rows.row_entmax import MODE_GENERAL, entmax_rows_bwd, entmax_rows_fwd, row_mode

__all__ = ["entmax_rows_triton"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _alpha_and_mode(alpha_rows: Tensor | None, alpha_value: float):
    if alpha_rows is None:
        return alpha_value, row_mode(alpha_value)
    return alpha_rows, MODE_GENERAL


@torch.library.custom_op("sparse_attn::entmax_rows_fwd", mutates_args=())
def _rows_fwd_op(x: Tensor, alpha_rows: Tensor | None, alpha_value: float) -> Tensor:
    """alpha-entmax of the rows of a ``(n_rows, n_cols)`` tensor with unit column stride.

    ``alpha_rows``: float32 ``(n_rows,)`` (one alpha per row) or ``None``, in which case the
    float ``alpha_value`` applies to every row (and selects the exact kernel mode for 1, 1.5, 2).
    """
    alpha, mode = _alpha_and_mode(alpha_rows, alpha_value)
    return entmax_rows_fwd(x, alpha, mode)


@_rows_fwd_op.register_fake
def _rows_fwd_fake(x, alpha_rows, alpha_value):
    return torch.empty_like(x)


@torch.library.custom_op("sparse_attn::entmax_rows_bwd", mutates_args=())
def _rows_bwd_op(y: Tensor, dy: Tensor, alpha_rows: Tensor | None, alpha_value: float,
                 need_dalpha: bool) -> tuple[Tensor, Tensor]:
    """``(dX, dalpha)`` from the forward output ``y``; ``dalpha`` is float32 ``(n_rows,)`` or empty ``(0,)``."""
    alpha, mode = _alpha_and_mode(alpha_rows, alpha_value)
    dx, dalpha = entmax_rows_bwd(y, dy, alpha, mode, need_dalpha=need_dalpha)
    return dx, (dalpha if dalpha is not None else y.new_zeros(0, dtype=torch.float32))


@_rows_bwd_op.register_fake
def _rows_bwd_fake(y, dy, alpha_rows, alpha_value, need_dalpha):
    return torch.empty_like(dy), y.new_empty((y.shape[0],) if need_dalpha else (0,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    _, alpha_rows, alpha_value = inputs
    ctx.save_for_backward(output, alpha_rows)
    ctx.alpha_value = alpha_value


def _backward(ctx, dy):
    if torch.is_grad_enabled():
        raise RuntimeError(
            "the Triton row kernels' backward is first-order only: double backward (create_graph=True) is "
            "not supported; use the PyTorch path (CPU tensors, or rows shorter than TRITON_MIN_ROW)"
        )
    y, alpha_rows = ctx.saved_tensors
    need_dalpha = alpha_rows is not None and ctx.needs_input_grad[1]
    dx, dalpha = _rows_bwd_op(y, dy.contiguous(), alpha_rows, ctx.alpha_value, need_dalpha)
    return dx, (dalpha if need_dalpha else None), None


_rows_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def entmax_rows_triton(X: torch.Tensor, alpha, dim: int = -1) -> torch.Tensor:
    """alpha-entmax along ``dim`` with the Triton row kernels (for long rows, e.g. vocabularies).

    ``p = [(alpha - 1) x - tau]_+ ** (1 / (alpha - 1))`` with ``sum p = 1`` along ``dim``;
    alpha = 1 is softmax, 2 sparsemax (exact, Michelot), 1.5 1.5-entmax (no transcendental
    functions), anything else in between Newton on the Tsallis norm to ``|sum p - 1| <= 1e-6``
    followed by renormalization. Differentiable w.r.t. ``X`` and a tensor ``alpha`` (first
    order). The forced kernel path: input the kernels cannot run raises, it never falls back.

    Args:
        X: float16, bfloat16 or float32 tensor of any shape with at least one dimension, on
            CUDA (or on CPU when ``TRITON_INTERPRET=1``). fp16/bf16 are computed in float32.
        alpha: float in [1, 2], or floating tensor with values in [1, 2] broadcastable to
            ``X`` with size 1 along ``dim`` (one alpha per row, e.g. ``(1, H, 1, 1)``).
        dim: dimension to normalize over. Default -1.

    Returns:
        Tensor of ``X``'s shape and dtype. ``-inf`` entries are exactly 0; a row that is
        entirely ``-inf`` is 0 with zero gradient; a row holding a NaN or ``+inf`` is all NaN
        with NaN gradients. Empty ``X`` gives an empty output.
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
        y = _rows_fwd_op(xr, a, 1.0)
    else:
        y = _rows_fwd_op(xr, None, float(alpha))
    return y.reshape(*batch_shape, n).movedim(-1, d)
