"""Helpers shared by the attention kernels: interpreter detection and the dropout RNG.

The dropout keep-mask is a pure function of (seed, batch-head, row, column), so the
backward replays exactly the mask the forward drew without storing it.
"""

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def dropout_keep(seed, bh, rows, cols, n_cols, p_drop):
    """Keep-mask ``[len(rows), len(cols)]`` for one (batch, head): True where the weight survives.

    ``seed`` is a 31-bit int, ``bh`` the flat batch-head index, ``rows``/``cols`` global
    row/column indices, ``n_cols`` the row length used to linearize the offset.
    """
    key = (seed + bh * 40503) & 0x7FFFFFFF
    offs = rows[:, None] * n_cols + cols[None, :]
    return tl.rand(key, offs) >= p_drop


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
