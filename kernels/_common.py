"""Device code every kernel shares: row loads and stores, the dropout RNG, the head's alpha class, two accurate
elementwise functions (``log2(1 + v)`` and the series of ``(e^y - 1 - y) / y^2``) and one fast one (``log2`` on the
special-function unit). Only ``@triton.jit`` functions and the constants they read live here; the host code that
builds their arguments is ``_args.py``. Which keys a query may see and the tile ranges that follow live in
``_masking.py``.

The dropout keep-mask is a pure function of (seed, batch-head, row, column), so the
backward replays exactly the mask the forward drew without storing it.
"""

import os

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def alpha_class_id(alpha):
    """The ``ALPHA_CLASS`` (``_args.ALPHA_CLASSES``) of a head with this alpha (an unchecked device alpha outside
    [1, 2] or NaN: 3, general)."""
    return tl.where(alpha == 1.0, 0, tl.where(alpha == 2.0, 1, tl.where(alpha == 1.5, 2, 3)))


# compiled kernels may use inline PTX; the interpreter cannot run it (fixed at import, like TRITON_INTERPRET itself)
HW_MATH = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def slice_base(PTR, b, h, start, stride_b, stride_h, stride_n):
    """Pointer to row ``start`` of batch entry ``b``, head ``h`` of a ``(batch, heads, seq, ...)`` tensor."""
    return PTR + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + start.to(tl.int64) * stride_n


@triton.jit
def bias_base_ptr(BIAS, b, h, q_start, k_start, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n):
    """Pointer to the bias of row ``q_start``, key ``k_start`` of batch entry ``b``, head ``h``."""
    return (slice_base(BIAS, b, h, q_start, stride_bias_b, stride_bias_h, stride_bias_m)
            + k_start.to(tl.int64) * stride_bias_n)


@triton.jit
def _wide(idx):
    """A non-negative int32 index as int64, zero-extended: its high word is the constant 0, which the compiler never
    keeps in (or spills from) a register, as it does a sign extension's."""
    return idx.to(tl.uint32).to(tl.int64)


@triton.jit
def load_rows(base, idx, offs_d, stride_n, stride_d, ok, d_ok, UPCAST: tl.constexpr):
    """Rows ``idx [BLOCK]`` of a ``(seq, head_dim)`` slice as ``[BLOCK, BLOCK_D]`` (0 outside ``ok``, ``d_ok``).

    ``UPCAST`` converts to float32 (the interpreter's bf16 ``tl.dot`` is wrong).
    """
    x = tl.load(base + _wide(idx)[:, None] * stride_n + offs_d[None, :] * stride_d,
                mask=ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def rows_source(X, b, h, start, seqlen, stride_b, stride_h, stride_n, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Where a loop streams ``[BLOCK, BLOCK_D]`` row tiles of one (batch ``b``, head ``h``) slice from: the slice's row
    ``start`` (:func:`slice_base`), or with ``USE_TMA`` a TMA tensor descriptor of its ``seqlen x HEAD_DIM`` rows
    (last dim contiguous, 16-byte aligned rows: the launcher checks, ``_args.tma_rows``), which loads zeros outside
    them. :func:`load_tile` reads either."""
    base = slice_base(X, b, h, start, stride_b, stride_h, stride_n)
    if USE_TMA:
        src = tl.make_tensor_descriptor(base, shape=[seqlen, HEAD_DIM], strides=[stride_n, 1],
                                        block_shape=[BLOCK, BLOCK_D])
    else:
        src = base
    return src


@triton.jit
def load_tile(src, row0, idx, offs_d, stride_n, stride_d, ok, d_ok, UPCAST: tl.constexpr):
    """Rows ``idx`` (``row0 ..``) of a :func:`rows_source` as ``[BLOCK, BLOCK_D]``, 0 outside ``ok``, ``d_ok``: a
    pointer's by :func:`load_rows`; a tensor descriptor's by one asynchronous TMA copy, no address or mask per element
    (the source's type decides when the kernel is built). A descriptor's zeros are those outside its ``seqlen x
    HEAD_DIM`` rows, so ``ok`` / ``d_ok`` must be exactly ``idx < seqlen`` / ``offs_d < HEAD_DIM``: a stricter mask
    needs the pointer source."""
    if isinstance(src, tl.tensor_descriptor):
        x = src.load([row0, 0])
        if UPCAST:
            x = x.to(tl.float32)
    else:
        x = load_rows(src, idx, offs_d, stride_n, stride_d, ok, d_ok, UPCAST)
    return x


@triton.jit
def store_rows(base, idx, offs_d, stride_n, stride_d, x, ok, d_ok):
    """Store ``x [BLOCK, BLOCK_D]`` into rows ``idx`` of a ``(seq, head_dim)`` slice, cast to its dtype."""
    tl.store(base + _wide(idx)[:, None] * stride_n + offs_d[None, :] * stride_d, x.to(base.dtype.element_ty),
             mask=ok[:, None] & d_ok[None, :])


@triton.jit
def dropout_keep(seed, bh, rows, cols, n_cols, dropout_p):
    """Keep-mask ``[len(rows), len(cols)]`` for one (batch, head): True where the weight survives.

    ``seed`` is a 31-bit int, ``bh`` the flat batch-head index, ``rows``/``cols`` global
    row/column indices, ``n_cols`` the row length used to linearize the offset. The offset
    ``row * n_cols + col`` is int64 (``tl.rand`` feeds its high 32 bits to the Philox counter), so
    streams do not wrap and repeat once ``total_q * total_k >= 2**31``; below that the mask is
    the one an int32 offset gave.
    """
    key = (seed + bh * 40503) & 0x7FFFFFFF
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :].to(tl.int64)
    return tl.rand(key, offs) >= dropout_p


@triton.jit
def two_sum(a, b):
    """``(s, e)`` with ``s = fl(a + b)`` and ``e = a + b - s`` exactly (Knuth's TwoSum, six float additions, no
    ordering of ``|a|``, ``|b|`` needed): a sum as two floats. ``e`` is NaN where ``s`` is not finite."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


# log2(1 + v) by its series below this |v| (8 terms: truncation below 2**-27 relative), on the special-function unit
# above it (where every weight r**beta, r = 1 + v <= 7/8, is small enough that its absolute error stays below 6e-7)
LOG1P_SERIES_MAX = tl.constexpr(0.125)


@triton.jit
def log2_1p(v, SFU: tl.constexpr = True):
    """``log2(1 + v)`` for ``v > -1``, with float32 relative precision for small ``|v|``.

    For ``|v| < LOG1P_SERIES_MAX`` the series ``log2(e) (v - v^2/2 + ... - v^8/8)`` (7 FMAs, about 1e-7 relative, no
    rounding of ``1 + v``); above, ``fast_log2(1 + v)`` (one MUFU op, absolute error at most ``2**-22``). The weights
    ``(1 + v)**beta`` built on it (``exp2(beta log2_1p(v))``) then have an absolute error below ``6e-7`` of the
    largest weight for every ``beta >= 1`` (near alpha = 1 only the series' range carries weight; docs/backward.md,
    "``log1p`` form near alpha = 1"), where rounding ``1 + v`` first would cost ``beta`` ulps per weight. ``SFU=False``
    (the row kernels, whose float32 outputs are held to 1e-6 of float64): the accurate ``tl.log2`` above the series.
    """
    small = tl.abs(v) < LOG1P_SERIES_MAX
    x = tl.where(small, v, 0.0)
    c = x * (-LOG2E / 8.0) + LOG2E / 7.0
    c = c * x - LOG2E / 6.0
    c = c * x + LOG2E / 5.0
    c = c * x - LOG2E / 4.0
    c = c * x + LOG2E / 3.0
    c = c * x - LOG2E / 2.0
    c = c * x + LOG2E
    series = c * x
    if SFU:
        big = fast_log2(tl.maximum(1.0 + v, 1e-30))
    else:
        big = tl.log2(tl.maximum(1.0 + v, 1e-30))
    return tl.where(small, series, big)


@triton.jit
def fast_log2(x):
    """``log2(x)`` for ``x > 0`` in one MUFU op (``lg2.approx.ftz.f32``: absolute error at most ``2**-22`` on
    ``[0.5, 2]``, 2 ulp elsewhere; subnormal ``x`` gives ``-inf``) instead of ``tl.log2``'s ~20-instruction
    accurate ``log2f``; ``tl.log2`` under the interpreter (``HW_MATH``). For sums whose ``beta``-th root is taken
    (the threshold's point sums): an error ``e`` in ``log2`` scales a term by ``2**((beta - 1) e)``, which the root
    shrinks back to ``~e``, independent of alpha (docs/kernels.md)."""
    if HW_MATH:
        y = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        y = tl.log2(x)
    return y


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
def dropout_mask_kernel(OUT, seed, dropout_p, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    out_base = OUT + bh.to(tl.int64) * n_rows * n_cols
    for start_n in range(0, n_cols, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(seed, bh, rows, cols, n_cols, dropout_p)
        ptrs = out_base + rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
