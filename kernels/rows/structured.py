"""Triton kernels for the sequential proximal operators of fusedmax and oscarmax (one program per row).

* ``tv_prox_rows``: Condat's direct algorithm for 1-d total variation (Condat 2013, as used by Niculae & Blondel
  2017, "A Regularized Framework for Sparse and Structured Neural Attention"), a scan with occasional
  backtracking to the start of the current segment.
* ``isotonic_nonincreasing_rows``: pool adjacent violators for the least-squares
  non-increasing fit, the core of the OSCAR prox (sorted input). The block stack lives in a
  per-row scratch in global memory; the top block is kept in registers.

Inputs must be finite inside the valid prefix of each row (the public mappings replace rows
holding NaN or ``+inf`` before calling; see ``sparse_attn.rows._structured_rows``); the kernels
terminate on any input but their output is then meaningless. Each program runs one row with
scalar state; rows are independent, so the grid is the
number of rows. The PyTorch paths in ``sparse_attn.structured`` (vectorized over rows) are
the references these results are tested against.
"""

import torch
import triton
import triton.language as tl

from .._args import launches_on


def _check_rows(name: str, x: torch.Tensor, lengths: torch.Tensor) -> None:
    """``x`` a 2-d float32/float64 tensor, ``lengths`` an integer ``(R,)`` tensor on its device."""
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.dtype not in (torch.float32, torch.float64):
        got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a 2-d float32 or float64 tensor, got {got}")
    if not isinstance(lengths, torch.Tensor) or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        got = lengths.dtype if isinstance(lengths, torch.Tensor) else type(lengths).__name__
        raise TypeError(f"lengths must be an integer tensor, got {got}")
    if tuple(lengths.shape) != (x.shape[0],) or lengths.device != x.device:
        raise ValueError(
            f"lengths must have shape ({x.shape[0]},) on {name}'s device {x.device}, "
            f"got shape {tuple(lengths.shape)} on {lengths.device}"
        )


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


@launches_on(lambda x, *args, **kwargs: x)
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
    _check_rows("x", x, lengths)
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


@triton.jit
def _isotonic_kernel(V, Y, Means, Counts, Lengths, stride_v, stride_y, stride_s, IS_FP64: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(Lengths + row).to(tl.int64)
    v_row = V + row * stride_v
    y_row = Y + row * stride_y
    m_row = Means + row * stride_s
    c_row = Counts + row * stride_s
    if IS_FP64:
        mean = n.to(tl.float64) * 0.0
    else:
        mean = n.to(tl.float32) * 0.0
    cnt = mean
    top = n * 0 - 1
    i = n * 0
    while i < n:
        mean = tl.load(v_row + i).to(mean.dtype)
        cnt = mean * 0.0 + 1.0
        merging = 1
        while merging == 1:
            merging = 0
            if top >= 0:
                m_prev = tl.load(m_row + top)
                if m_prev <= mean:
                    c_new = tl.load(c_row + top) + cnt
                    mean = m_prev + (mean - m_prev) * (cnt / c_new)
                    cnt = c_new
                    top -= 1
                    merging = 1
        top += 1
        tl.store(m_row + top, mean)
        tl.store(c_row + top, cnt)
        i += 1
    pos = n * 0
    b = n * 0
    while b <= top:
        mean = tl.load(m_row + b)
        end = pos + tl.load(c_row + b).to(tl.int64)
        while pos < end:
            tl.store(y_row + pos, mean.to(Y.dtype.element_ty))
            pos += 1
        b += 1


@launches_on(lambda v, *args, **kwargs: v)
def isotonic_nonincreasing_rows(v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Least-squares non-increasing fit of the first ``lengths[r]`` entries of each row of ``v``.

    Pool adjacent violators; a merge moves the lower block mean towards the upper one by a
    fraction of their difference (the update of the PyTorch path), so it does not overflow.

    Args:
        v: ``(R, N)`` float32 or float64 tensor; rows may be strided (a copy is made only
            when the last dimension is not contiguous).
        lengths: ``(R,)`` integer tensor, entries in ``[0, N]``.

    Returns:
        ``(R, N)`` tensor of ``v``'s dtype; entries at positions ``>= lengths[r]`` are NaN.
    """
    _check_rows("v", v, lengths)
    if v.stride(-1) != 1:
        v = v.contiguous()
    rows, n = v.shape
    y = torch.full_like(v, float("nan"))
    if rows == 0 or n == 0:
        return y
    lens = lengths.to(device=v.device, dtype=torch.int64).contiguous()
    means = torch.empty((rows, n), dtype=v.dtype, device=v.device)
    counts = torch.empty((rows, n), dtype=v.dtype, device=v.device)
    _isotonic_kernel[(rows,)](v, y, means, counts, lens, v.stride(0), y.stride(0), means.stride(0),
                              IS_FP64=v.dtype == torch.float64)
    return y
