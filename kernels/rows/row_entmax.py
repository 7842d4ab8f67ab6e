"""Triton row kernels for alpha-entmax over long rows (vocabulary-sized, 32k-256k columns).

Rows are ``(n_rows, n_cols)`` with unit column stride; one program handles one row and
loops over it in ``BLOCK``-wide chunks. With ``eps = alpha - 1``, ``m = max_j x_j`` and a
row scale ``s > 0`` the mapping is written as::

    w_j = 1 + eps * (x_j - m) / s,     p_j = [w_j]_+ ** (1 / eps) / g,     g = sum_j [w_j]_+ ** (1 / eps)

which is ``[(alpha - 1) x_j - tau]_+ ** (1 / (alpha - 1))`` with ``tau = eps * m - s``.
``s`` is found by Newton's method on the Tsallis norm (docs/kernels.md, "The threshold") started from the
left at ``s = 1`` (``tau = max z - 1``), monotone, so a chunk whose largest ``w`` is
``<= 0`` is dead for the rest of the solve and is skipped. The solve stops when
``|s ** (1 / eps) * g - 1| <= tol``, when the Newton step is below float32 resolution, or
after ``max_iter`` sweeps, and the written row is divided by ``g``, so it sums to 1.
For ``alpha = 2`` the step is Michelot's algorithm and terminates exactly; ``alpha = 1.5``
uses no transcendental function; ``alpha = 1`` is a softmax. General ``alpha`` evaluates
``w ** (1 / eps)`` as ``exp2(log2(w) / eps)`` with an accurate ``log2(1 + v)``, so it
tends to softmax as ``alpha -> 1``.

Backward, from the output ``p`` (``U = p ** (2 - alpha)`` on the support, docs/backward.md)::

    dX = U * (dY - delta),                     delta = sum(U dY) / sum(U)
    dalpha = sum_j k_j (dY_j - delta),         k_j = -p_j log(p_j)**2 phi(-eps log p_j)

with ``phi(y) = (exp(y) - 1 - y) / y**2`` (Taylor series for ``y < 0.5``): ``k_j`` is
``p_j`` times the alpha-derivative of ``log p_j`` at a fixed threshold (Correia, Niculae & Martins 2019,
"Adaptively Sparse Transformers", Prop. 1, rearranged so that nothing
cancels as ``alpha -> 1``; at ``alpha = 1`` it is the exact limit).

All arithmetic is float32; fp16/bf16 are converted right after loading (bf16 arithmetic is
broken under the interpreter) and the output is stored in the input dtype.

Non-finite scores: the max pass also flags a NaN or ``+inf`` anywhere in the row (``x < inf``
fails for both); such a row is written as all NaN. A row that is entirely ``-inf`` is written
as zeros. In the backward an output entry that is NaN makes ``U`` NaN, so the row's ``dX`` and
its alpha gradient are NaN too.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparse_attn.kernels._args import computed_alpha, interpreting
from sparse_attn.kernels._common import LN2, LOG2E, expm1mx_series, log2_1p

from .._args import launches_on

__all__ = [
    "MODE_SOFTMAX",
    "MODE_SPARSEMAX",
    "MODE_ENTMAX15",
    "MODE_GENERAL",
    "row_mode",
    "entmax_rows_fwd",
    "entmax_rows_bwd",
]

MODE_SOFTMAX = 0
MODE_SPARSEMAX = 1
MODE_ENTMAX15 = 2
MODE_GENERAL = 3
"""Kernel specializations: alpha == 1, 2, 1.5 for the whole launch, or any alpha in [1, 2] per row."""

# Newton steps below this fraction of s (2**-21) are float32 noise: the solve has converged.
_STALL = tl.constexpr(4.76837158203125e-07)


def row_mode(alpha: float) -> int:
    """Kernel mode for one alpha shared by all rows: the exact routes for 1, 1.5 and 2 (alpha as the kernel holds it:
    ``_args.computed_alpha``)."""
    alpha = computed_alpha(alpha)
    if alpha == 1.0:
        return MODE_SOFTMAX
    if alpha == 2.0:
        return MODE_SPARSEMAX
    if alpha == 1.5:
        return MODE_ENTMAX15
    return MODE_GENERAL


@triton.jit
def _tsallis_pow(v, beta, POW: tl.constexpr):
    """``[1 + v]_+ ** beta`` and ``[1 + v]_+ ** (beta - 1)``; ``POW`` 1 / 2 pin beta to 1 / 2."""
    w = 1.0 + v
    live = w > 0.0
    if POW == 1:
        pw = tl.where(live, w, 0.0)
        pw1 = tl.where(live, 1.0, 0.0)
    elif POW == 2:
        pw1 = tl.where(live, w, 0.0)
        pw = pw1 * pw1
    else:
        vs = tl.where(live, v, 0.0)
        pw = tl.where(live, tl.exp2(beta * log2_1p(vs, False)), 0.0)
        pw1 = tl.where(live, pw / tl.where(live, w, 1.0), 0.0)
    return pw, pw1


@triton.jit
def _scalar_pow(a, e, POW: tl.constexpr):
    """``a ** e`` for a scalar ``a > 0``; ``POW`` 1 / 2 mean ``e`` is 1 / 2 (``e`` unused)."""
    if POW == 1:
        r = a
    elif POW == 2:
        r = a * a
    else:
        r = tl.exp2(e * tl.log2(a))
    return r


@triton.jit
def _fill_row(y_row, value, n_cols, n_chunks, BLOCK: tl.constexpr):
    """Store the scalar ``value`` at every column of the row."""
    offs = tl.arange(0, BLOCK)
    for c in range(0, n_chunks):
        cols = c * BLOCK + offs
        tl.store(y_row + cols, (tl.zeros([BLOCK], dtype=tl.float32) + value).to(y_row.dtype.element_ty),
                 mask=cols < n_cols)


@triton.jit
def _softmax_row(x_row, y_row, n_cols, n_chunks, m, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, n_chunks):
        cols = c * BLOCK + offs
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        acc += tl.exp2((x - m) * LOG2E)
    inv = 1.0 / tl.sum(acc, axis=0)
    for c in range(0, n_chunks):
        cols = c * BLOCK + offs
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        p = tl.exp2((x - m) * LOG2E) * inv
        tl.store(y_row + cols, p.to(y_row.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _entmax_row(x_row, y_row, cmax_row, n_cols, n_chunks, log2_n, m, eps, tol, max_iter,
                POW: tl.constexpr, BLOCK: tl.constexpr):
    """Solve one row for ``s`` (Newton on the Tsallis norm) and store ``p``; ``eps = alpha - 1 > 0``."""
    offs = tl.arange(0, BLOCK)
    beta = 1.0 / eps
    # The bracket s* >= n ** (1 - alpha) (docs/kernels.md, "The threshold") keeps every iterate positive.
    s_lo = tl.exp2(-eps * log2_n)
    s = eps * 0.0 + 1.0
    g = eps * 0.0
    it = 0
    done = 0
    while done == 0:
        rs = 1.0 / s
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(0, n_chunks):
            cm = tl.load(cmax_row + c)
            if 1.0 + (eps * (cm - m)) * rs > 0.0:
                cols = c * BLOCK + offs
                x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
                pw, pw1 = _tsallis_pow((eps * (x - m)) * rs, beta, POW)
                acc += pw
                acc1 += pw1
        g = tl.sum(acc, axis=0)
        g1 = tl.sum(acc1, axis=0)
        f = _scalar_pow(s, beta, POW) * g
        # Tsallis-norm Newton step in s: s <- s - (s g - g ** (1 - eps)) / g1.
        if POW == 1:
            g_root = g * 0.0 + 1.0
        elif POW == 2:
            g_root = tl.sqrt(g)
        else:
            g_root = tl.exp2((1.0 - eps) * tl.log2(g))
        step = (s * g - g_root) / g1
        it += 1
        converged = (tl.abs(f - 1.0) <= tol) | (tl.abs(step) <= _STALL * s) | (it >= max_iter)
        done = converged.to(tl.int32)
        s = tl.where(converged, s, tl.maximum(s - step, s_lo))
    rs = 1.0 / s
    inv = 1.0 / g
    for c in range(0, n_chunks):
        cols = c * BLOCK + offs
        cm = tl.load(cmax_row + c)
        if 1.0 + (eps * (cm - m)) * rs > 0.0:
            x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            pw, pw1 = _tsallis_pow((eps * (x - m)) * rs, beta, POW)
            tl.store(y_row + cols, (pw * inv).to(y_row.dtype.element_ty), mask=cols < n_cols)
        else:
            tl.store(y_row + cols, tl.zeros([BLOCK], dtype=tl.float32).to(y_row.dtype.element_ty),
                     mask=cols < n_cols)


@triton.jit
def _solve_row(x_row, y_row, cmax_row, n_cols, n_chunks, log2_n, m, eps, tol, max_iter, MODE: tl.constexpr,
               BLOCK: tl.constexpr):
    """Store the row's weights by the route of ``MODE`` (``MODE_*``): softmax, or the solve with ``POW = MODE``."""
    if MODE == 0:
        _softmax_row(x_row, y_row, n_cols, n_chunks, m, BLOCK)
    else:
        _entmax_row(x_row, y_row, cmax_row, n_cols, n_chunks, log2_n, m, eps, tol, max_iter, MODE, BLOCK)


@triton.jit
def _entmax_rows_fwd_kernel(X, Y, Alpha, Cmax, n_cols, n_chunks, log2_n, stride_x, stride_y, stride_alpha, tol,
                            max_iter,
                            MODE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    cmax_row = Cmax + row * n_chunks
    offs = tl.arange(0, BLOCK)
    m = float("-inf")
    n_bad = 0
    for c in range(0, n_chunks):
        cols = c * BLOCK + offs
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)  # [BLOCK]
        # NaN and +inf both fail x < inf (tl.max may drop NaN on the GPU, so they are counted apart).
        n_bad += tl.sum(tl.where(x < float("inf"), 0, 1), axis=0)
        cm = tl.max(x, axis=0)
        tl.store(cmax_row + c, cm)
        m = tl.maximum(m, cm)
    alpha = tl.load(Alpha + row * stride_alpha).to(tl.float32)
    eps = alpha - 1.0
    if n_bad > 0:
        _fill_row(y_row, float("nan"), n_cols, n_chunks, BLOCK)
    elif m == float("-inf"):
        _fill_row(y_row, 0.0, n_cols, n_chunks, BLOCK)
    elif MODE != 3:
        _solve_row(x_row, y_row, cmax_row, n_cols, n_chunks, log2_n, m, eps, tol, max_iter, MODE, BLOCK)
    else:
        # per-row alpha: the exact routes of alpha = 1, 2, 1.5 where a row has one of them
        if eps == 0.0:
            _solve_row(x_row, y_row, cmax_row, n_cols, n_chunks, log2_n, m, eps, tol, max_iter, 0, BLOCK)
        elif eps == 1.0:
            _solve_row(x_row, y_row, cmax_row, n_cols, n_chunks, log2_n, m, eps, tol, max_iter, 1, BLOCK)
        elif eps == 0.5:
            _solve_row(x_row, y_row, cmax_row, n_cols, n_chunks, log2_n, m, eps, tol, max_iter, 2, BLOCK)
        else:
            _solve_row(x_row, y_row, cmax_row, n_cols, n_chunks, log2_n, m, eps, tol, max_iter, 3, BLOCK)


@triton.jit
def _bwd_terms(p, eps, MODE: tl.constexpr, NEED_DALPHA: tl.constexpr):
    """``U = p ** (2 - alpha)`` and ``k = p * d(log p)/d(alpha)`` at a fixed threshold (0 off the support).

    ``U`` is NaN where ``p`` is NaN (a NaN output row), which makes the whole row's gradients NaN.
    """
    live = p > 0.0
    if MODE == 0:
        u = p
    elif MODE == 1:
        u = tl.where(live, 1.0, 0.0)
    elif MODE == 2:
        u = tl.sqrt(p)
    else:
        lp2 = tl.log2(tl.where(live, p, 1.0))
        u = tl.where(live, tl.exp2((1.0 - eps) * lp2), 0.0)
    u = tl.where(p == p, u, p)
    if NEED_DALPHA:
        lp = tl.log2(tl.where(live, p, 1.0)) * LN2
        y = -eps * lp
        small = y < 0.5
        series = p * lp * lp * expm1mx_series(tl.where(small, y, 0.0))
        eps2 = tl.maximum(eps * eps, 1e-30)
        direct = (u - p - p * y) / eps2
        k = tl.where(live, -tl.where(small, series, direct), 0.0)
    else:
        k = u * 0.0
    return u, k


@triton.jit
def _entmax_rows_bwd_kernel(Y, DY, DX, Alpha, DAlpha, n_cols, n_chunks, stride_y, stride_dy, stride_dx,
                            stride_alpha, MODE: tl.constexpr, NEED_DALPHA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    y_row = Y + row * stride_y
    dy_row = DY + row * stride_dy
    dx_row = DX + row * stride_dx
    offs = tl.arange(0, BLOCK)
    eps = tl.load(Alpha + row * stride_alpha).to(tl.float32) - 1.0
    su = tl.zeros([BLOCK], dtype=tl.float32)
    sug = tl.zeros([BLOCK], dtype=tl.float32)
    sk = tl.zeros([BLOCK], dtype=tl.float32)
    skg = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, n_chunks):
        cols = c * BLOCK + offs
        p = tl.load(y_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)  # [BLOCK]
        dy = tl.load(dy_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        u, k = _bwd_terms(p, eps, MODE, NEED_DALPHA)
        su += u
        sug += u * dy
        if NEED_DALPHA:
            sk += k
            skg += k * dy
    su_tot = tl.sum(su, axis=0)
    delta = tl.sum(sug, axis=0) / tl.where(su_tot > 0.0, su_tot, 1.0)
    if NEED_DALPHA:
        tl.store(DAlpha + row, tl.sum(skg, axis=0) - delta * tl.sum(sk, axis=0))
    for c in range(0, n_chunks):
        cols = c * BLOCK + offs
        p = tl.load(y_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        u, k = _bwd_terms(p, eps, MODE, False)
        tl.store(dx_row + cols, (u * (dy - delta)).to(dx_row.dtype.element_ty), mask=cols < n_cols)


def _launch_config(n_cols: int, block: int | None) -> tuple[int, int]:
    """``(BLOCK, num_warps)``: one pinned config (no autotune, it breaks under the interpreter)."""
    if block is None:
        cap = 1024 if interpreting() else 2048
        block = max(16, min(cap, triton.next_power_of_2(n_cols)))
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    return block, max(1, min(8, block // 256))


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_launch(name: str, x: torch.Tensor, mode: int) -> None:
    """``x`` a 2-d fp16/bf16/fp32 tensor with unit column stride; ``mode`` one of the ``MODE_*``."""
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.dtype not in _DTYPES:
        got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a 2-d float16, bfloat16 or float32 tensor, got {got}")
    if x.stride(1) != 1 and x.shape[1] > 1:  # a single column has no column stride to speak of
        raise ValueError(f"{name} must have unit stride along columns, got strides {tuple(x.stride())}")
    if mode not in (MODE_SOFTMAX, MODE_SPARSEMAX, MODE_ENTMAX15, MODE_GENERAL):
        raise ValueError(f"mode must be one of MODE_SOFTMAX/SPARSEMAX/ENTMAX15/GENERAL (0-3), got {mode!r}")


def _alpha_rows(alpha, n_rows: int, device) -> tuple[torch.Tensor, int]:
    if isinstance(alpha, torch.Tensor):
        if alpha.shape != (n_rows,):
            raise ValueError(f"alpha must be a float or a tensor of shape ({n_rows},), got shape {tuple(alpha.shape)}")
        return alpha.to(device=device, dtype=torch.float32).contiguous(), 1
    return torch.full((1,), float(alpha), dtype=torch.float32, device=device), 0


@launches_on(lambda x, *args, **kwargs: x)
def entmax_rows_fwd(x: torch.Tensor, alpha, mode: int, tol: float = 1e-6, max_iter: int = 64,
                    block: int | None = None) -> torch.Tensor:
    """alpha-entmax of every row of ``x``.

    Args:
        x: ``(n_rows, n_cols)`` float16/bfloat16/float32, unit stride along columns.
        alpha: float, or float tensor ``(n_rows,)`` (one alpha per row), values in [1, 2].
        mode: ``MODE_SOFTMAX`` / ``MODE_SPARSEMAX`` / ``MODE_ENTMAX15`` when every row has
            alpha 1 / 2 / 1.5, else ``MODE_GENERAL`` (dispatches per row, exact routes included).
        tol: stop when ``|sum p - 1| <= tol`` before renormalizing. Default 1e-6.
        max_iter: cap on Newton sweeps per row. Default 64.
        block: chunk width (power of two >= 16); default picked from ``n_cols``.

    Returns:
        ``(n_rows, n_cols)`` tensor in ``x.dtype``; rows sum to 1, all ``-inf`` rows are 0.
    """
    _check_launch("x", x, mode)
    n_rows, n_cols = x.shape
    block, num_warps = _launch_config(n_cols, block)
    n_chunks = triton.cdiv(n_cols, block)
    y = torch.full_like(x, float("nan"))
    cmax = torch.empty((n_rows, n_chunks), dtype=torch.float32, device=x.device)
    alpha_t, stride_alpha = _alpha_rows(alpha, n_rows, x.device)
    _entmax_rows_fwd_kernel[(n_rows,)](
        x, y, alpha_t, cmax, n_cols, n_chunks, math.log2(max(n_cols, 1)), x.stride(0), y.stride(0), stride_alpha,
        float(tol), int(max_iter),
        MODE=mode, BLOCK=block, num_warps=num_warps,
    )
    return y


@launches_on(lambda y, *args, **kwargs: y)
def entmax_rows_bwd(y: torch.Tensor, dy: torch.Tensor, alpha, mode: int, need_dalpha: bool = False,
                    block: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of alpha-entmax rows from the forward output.

    Args:
        y: ``(n_rows, n_cols)`` forward output (float16/bfloat16/float32), unit column stride.
        dy: upstream gradient, same shape, unit column stride.
        alpha: float, or float tensor ``(n_rows,)``; values in [1, 2].
        mode: the forward's mode; ``MODE_GENERAL`` evaluates ``U = p ** (2 - alpha)`` per row.
        need_dalpha: also return the per-row alpha gradient (``mode`` must be ``MODE_GENERAL``).
        block: chunk width (power of two >= 16); default picked from ``n_cols``.

    Returns:
        ``(dx, dalpha)``: ``dx`` ``(n_rows, n_cols)`` in ``dy.dtype``; ``dalpha`` float32
        ``(n_rows,)`` or ``None``.
    """
    _check_launch("y", y, mode)
    _check_launch("dy", dy, mode)
    if dy.shape != y.shape or dy.device != y.device:
        raise ValueError(
            f"dy must match y (shape {tuple(y.shape)} on {y.device}), got shape {tuple(dy.shape)} on {dy.device}"
        )
    n_rows, n_cols = y.shape
    if need_dalpha and mode != MODE_GENERAL:
        raise ValueError(f"need_dalpha requires mode MODE_GENERAL ({MODE_GENERAL}), got {mode}")
    block, num_warps = _launch_config(n_cols, block)
    n_chunks = triton.cdiv(n_cols, block)
    dx = torch.full_like(dy, float("nan"))
    dalpha = torch.full((n_rows,), float("nan"), dtype=torch.float32, device=y.device) if need_dalpha else dx
    alpha_t, stride_alpha = _alpha_rows(alpha, n_rows, y.device)
    _entmax_rows_bwd_kernel[(n_rows,)](
        y, dy, dx, alpha_t, dalpha, n_cols, n_chunks, y.stride(0), dy.stride(0), dx.stride(0), stride_alpha,
        MODE=mode, NEED_DALPHA=need_dalpha, BLOCK=block, num_warps=num_warps,
    )
    return dx, (dalpha if need_dalpha else None)
