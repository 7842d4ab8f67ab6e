"""Helpers shared by the Triton kernels: interpreter detection, the dropout RNG, the
varlen sequence bounds and two accurate elementwise functions (``log2(1 + v)`` and the
series of ``(e^y - 1 - y) / y^2``).

The dropout keep-mask is a pure function of (seed, batch-head, row, column), so the
backward replays exactly the mask the forward drew without storing it.
"""

import os

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# CUDA caps launch-grid axes 1 and 2 at 65535 programs; the attention grids are
# (tiles, heads, batch entries or sequences), so heads and batch are each limited to this.
MAX_GRID_YZ = 65535


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def dropout_keep(seed, bh, rows, cols, n_cols, p_drop):
    """Keep-mask ``[len(rows), len(cols)]`` for one (batch, head): True where the weight survives.

    ``seed`` is a 31-bit int, ``bh`` the flat batch-head index, ``rows``/``cols`` global
    row/column indices, ``n_cols`` the row length used to linearize the offset. The offset
    ``row * n_cols + col`` is int64 (``tl.rand`` feeds its high 32 bits to the Philox counter), so
    streams do not wrap and repeat once ``total_q * total_k >= 2**31``; below that the mask is
    the one an int32 offset gave.
    """
    key = (seed + bh * 40503) & 0x7FFFFFFF
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :].to(tl.int64)
    return tl.rand(key, offs) >= p_drop


@triton.jit
def seq_bounds(CU_Q, CU_K, seq, n_q, n_k, IS_VARLEN: tl.constexpr):
    """``(batch index, first row, rows, first key, keys)`` of sequence ``seq`` (a batch entry unless varlen).

    With ``IS_VARLEN`` sequence ``seq`` owns rows ``[CU_Q[seq], CU_Q[seq + 1])`` and keys
    ``[CU_K[seq], CU_K[seq + 1])`` of batch entry 0; otherwise it is batch entry ``seq`` with
    ``n_q`` rows and ``n_k`` keys starting at 0.
    """
    if IS_VARLEN:
        b = seq * 0
        q_start = tl.load(CU_Q + seq)
        n_rows = tl.load(CU_Q + seq + 1) - q_start
        k_start = tl.load(CU_K + seq)
        n_keys = tl.load(CU_K + seq + 1) - k_start
    else:
        b = seq
        q_start = seq * 0
        n_rows = n_q
        k_start = seq * 0
        n_keys = n_k
    return b, q_start, n_rows, k_start, n_keys


@triton.jit
def log2_1p(v):
    """``log2(1 + v)`` for ``v > -1``, accurate to float32 relative precision for small ``|v|``.

    Goldberg's trick (tl has no ``log1p``): with ``u = fl(1 + v)``, ``log2(u) * v / (u - 1)``
    corrects the rounding of ``u``; ``u == 1`` gives the first-order term ``v log2(e)``.
    """
    u = 1.0 + v
    u_m1 = u - 1.0
    exact = u_m1 != 0.0
    return tl.where(exact, tl.log2(u) * (v / tl.where(exact, u_m1, 1.0)), v * LOG2E)


@triton.jit
def expm1mx_series(y):
    """``(e^y - 1 - y) / y^2`` by its Taylor series to ``y^10 / 12!``: relative error below 1e-8 for ``|y| < 1``."""
    r = y * (1.0 / 479001600.0) + 1.0 / 39916800.0
    r = r * y + 1.0 / 3628800.0
    r = r * y + 1.0 / 362880.0
    r = r * y + 1.0 / 40320.0
    r = r * y + 1.0 / 5040.0
    r = r * y + 1.0 / 720.0
    r = r * y + 1.0 / 120.0
    r = r * y + 1.0 / 24.0
    r = r * y + 1.0 / 6.0
    return r * y + 0.5


@triton.jit
def _dropout_mask_kernel(Out, seed, p_drop, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    out_base = Out + bh.to(tl.int64) * n_rows * n_cols
    for start_n in range(0, n_cols, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(seed, bh, rows, cols, n_cols, p_drop)
        ptrs = out_base + rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


def dropout_keep_mask(seed: int, batch_heads: int, n_rows: int, n_cols: int, p_drop: float, device) -> torch.Tensor:
    """Materialize the keep-mask the attention kernels draw, shape ``(batch_heads, n_rows, n_cols)``.

    For tests and the reference path only (it is O(N^2)); ``batch_heads`` indexes
    ``b * num_heads + h`` exactly as the kernels do.
    """
    out = torch.empty((batch_heads, n_rows, n_cols), dtype=torch.int8, device=device)
    block_m = 16
    grid = (triton.cdiv(n_rows, block_m), batch_heads)
    _dropout_mask_kernel[grid](out, seed, p_drop, n_rows, n_cols, BLOCK_M=block_m, BLOCK_N=32)
    return out.bool()
