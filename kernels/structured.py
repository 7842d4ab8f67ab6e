"""Triton kernel for the proximal operator of 1-d total variation (one program per row).

Condat's direct algorithm (Condat 2013, cited in
``niculae2017-regularized-sparse-structured-attention.txt``) is sequential within a row: a
scan with occasional backtracking to the start of the current segment. Each program
runs it on one row with scalar state; rows are independent, so the grid is the number of
rows. The PyTorch path in ``sparse_attn.structured`` runs the same state machine
vectorized over rows and is the reference these results are tested against.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _write_segment(y_row, k0, end, value):
    """Store ``value`` at ``y_row[k0 .. max(k0, end)]``; return the index after the segment."""
    tl.store(y_row + k0, value)
    k0 += 1
    while k0 <= end:
        tl.store(y_row + k0, value)
        k0 += 1
    return k0


@triton.jit
def _tv_prox_kernel(X, Y, Lengths, Lam, stride_x, stride_y, IS_FP64: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(Lengths + row).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    if IS_FP64:
        lam = tl.load(Lam).to(tl.float64)
        x0 = tl.load(x_row).to(tl.float64)
    else:
        lam = tl.load(Lam).to(tl.float32)
        x0 = tl.load(x_row).to(tl.float32)
    zero_i = n * 0
    k = zero_i
    k0 = zero_i
    k_minus = zero_i
    k_plus = zero_i
    v_min = x0 - lam
    v_max = x0 + lam
    u_min = lam
    u_max = -lam
    done = (n <= 0).to(tl.int32)
    while done == 0:
        if k == n - 1:
            if u_min < 0.0:
                k0 = _write_segment(y_row, k0, k_minus, v_min.to(Y.dtype.element_ty))
                k = k0
                k_minus = k0
                v_min = tl.load(x_row + k0).to(v_min.dtype)
                u_min = lam
                u_max = v_min + u_min - v_max
            elif u_max > 0.0:
                k0 = _write_segment(y_row, k0, k_plus, v_max.to(Y.dtype.element_ty))
                k = k0
                k_plus = k0
                v_max = tl.load(x_row + k0).to(v_max.dtype)
                u_max = -lam
                u_min = v_max + u_max - v_min
            else:
                v_min = v_min + u_min / (k - k0 + 1).to(v_min.dtype)
                k0 = _write_segment(y_row, k0, k, v_min.to(Y.dtype.element_ty))
                done = done + 1
        else:
            x_next = tl.load(x_row + k + 1).to(v_min.dtype)
            u_min = u_min + x_next - v_min
            if u_min < -lam:
                k0 = _write_segment(y_row, k0, k_minus, v_min.to(Y.dtype.element_ty))
                k = k0
                k_minus = k0
                k_plus = k0
                v_min = tl.load(x_row + k0).to(v_min.dtype)
                v_max = v_min + 2.0 * lam
                u_min = lam
                u_max = -lam
            else:
                u_max = u_max + x_next - v_max
                if u_max > lam:
                    k0 = _write_segment(y_row, k0, k_plus, v_max.to(Y.dtype.element_ty))
                    k = k0
                    k_minus = k0
                    k_plus = k0
                    v_max = tl.load(x_row + k0).to(v_max.dtype)
                    v_min = v_max - 2.0 * lam
                    u_min = lam
                    u_max = -lam
                else:
                    k = k + 1
                    if u_min >= lam:
                        k_minus = k
                        v_min = v_min + (u_min - lam) / (k - k0 + 1).to(v_min.dtype)
                        u_min = lam
                    if u_max <= -lam:
                        k_plus = k
                        v_max = v_max + (u_max + lam) / (k - k0 + 1).to(v_max.dtype)
                        u_max = -lam


def tv_prox_rows(x: torch.Tensor, lengths: torch.Tensor, lam: float) -> torch.Tensor:
    """Prox of ``lam * sum_i |y_{i+1} - y_i|`` on the first ``lengths[r]`` entries of each row.

    Args:
        x: ``(R, N)`` float32 or float64 tensor; rows may be strided (a copy is made only
            when the last dimension is not contiguous).
        lengths: ``(R,)`` integer tensor, entries in ``[0, N]``.
        lam: the TV weight, a float ``>= 0``.

    Returns:
        ``(R, N)`` tensor of ``x``'s dtype; entries at positions ``>= lengths[r]`` are NaN.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    y = torch.full_like(x, float("nan"))
    if rows == 0 or x.shape[1] == 0:
        return y
    lens = lengths.to(device=x.device, dtype=torch.int64).contiguous()
    lam_t = torch.tensor([lam], dtype=x.dtype, device=x.device)
    is_fp64 = x.dtype == torch.float64
    _tv_prox_kernel[(rows,)](x, y, lens, lam_t, x.stride(0), y.stride(0), IS_FP64=is_fp64)
    return y
