"""Helpers shared by the Triton kernels: interpreter detection and the build choices that follow
from it, the kernel arguments every attention kernel takes, row loads and stores, the dropout RNG
two accurate elementwise functions (``log2(1 + v)`` and the series of ``(e^y - 1 - y) / y^2``) and one fast
one (``log2`` on the special-function unit).
Which keys a query may see, the tile ranges that follow and the launch geometry live in
``_masking.py``.

The dropout keep-mask is a pure function of (seed, batch-head, row, column), so the
backward replays exactly the mask the forward drew without storing it.
"""

from __future__ import annotations

import os
import struct

import torch
import triton
import triton.language as tl

from ._masking import mask_spec, score_spec

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# ALPHA_CLASS values of the attention kernels, one compiled path each: softmax (alpha = 1), sparsemax (alpha = 2),
# 1.5-entmax and any other alpha. "mixed" alpha (classes unknown on the host) launches all four, each over every head,
# and a program whose head is of another class has nothing to do (HEAD_FILTER, :func:`alpha_class_id`).
ALPHA_CLASSES = {"softmax": 0, "sparsemax": 1, "entmax15": 2, "general": 3}


def computed_alpha(alpha: float, dtype: torch.dtype = torch.float32) -> float:
    """``alpha`` as a computation in ``dtype`` holds it: rounded to float32, or kept in float64 when ``dtype`` is
    float64 (the kernels and every float32 / float16 / bfloat16 computation hold alpha in float32).

    Every path decides its alpha class from this value, so a Python alpha such as ``1 + 1e-9`` (1.0 in float32) is
    the softmax class rather than a general alpha whose ``alpha - 1`` rounds to 0. The general arithmetic is exact in
    kind for every float32 alpha above 1 (the smallest, ``1 + 2**-23``, included); entmax tends to softmax as
    ``alpha -> 1`` with weights off by ``O((alpha - 1) * s**2)`` (``s``: the scores' spread), below float32's
    resolution wherever rounding makes alpha exactly 1.
    """
    alpha = float(alpha)
    if dtype == torch.float64:
        return alpha
    try:
        return struct.unpack("f", struct.pack("f", alpha))[0]  # on the host: no tensor, nothing read back
    except OverflowError:  # beyond float32's range (no alpha of an attention call): nothing near 1 to decide
        return alpha


def alpha_class_of(alpha_values) -> str:
    """The compile-time alpha class for known per-head alpha values (a sequence of floats in [1, 2]), each taken as
    the kernels hold it (:func:`computed_alpha`)."""
    vals = {computed_alpha(a) for a in alpha_values}
    if vals == {1.0}:
        return "softmax"
    if vals == {2.0}:
        return "sparsemax"
    if vals == {1.5}:
        return "entmax15"
    if vals and all(1.0 < a < 2.0 and a != 1.5 for a in vals):
        return "general"
    return "mixed"


def resolve_alpha_class(alpha, alpha_class: str | None) -> str:
    """``alpha_class`` when given, else from the values of a Python number or a CPU tensor (no device sync), else
    ``"mixed"``."""
    if alpha_class is not None:
        return alpha_class
    if not isinstance(alpha, torch.Tensor):
        return alpha_class_of([alpha])
    return alpha_class_of(alpha.tolist()) if alpha.device.type == "cpu" else "mixed"


def class_launches(alpha_class: str) -> list:
    """``(ALPHA_CLASS, HEAD_FILTER)`` of the launches one call makes: one, or all four filtered ones when mixed."""
    if alpha_class == "mixed":
        return [(c, True) for c in ALPHA_CLASSES.values()]
    return [(ALPHA_CLASSES[alpha_class], False)]


@triton.jit
def alpha_class_id(alpha):
    """The ``ALPHA_CLASS`` of a head with this alpha (an unchecked device alpha outside [1, 2] or NaN: 3, general)."""
    return tl.where(alpha == 1.0, 0, tl.where(alpha == 2.0, 1, tl.where(alpha == 1.5, 2, 3)))


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# compiled kernels may use inline PTX; the interpreter cannot run it (fixed at import, like TRITON_INTERPRET itself)
HW_MATH = tl.constexpr(not interpreting())


def pinned_launch() -> bool:
    """True when the attention kernels launch their one pinned config instead of ``triton.autotune``: under the
    interpreter, or with ``SPARSE_ATTN_PINNED=1`` (a first GPU run: one build per kernel, no tuning runs)."""
    return interpreting() or os.environ.get("SPARSE_ATTN_PINNED", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the attention ``tl.dot``s: fp32 inputs keep fp32 accuracy on tensor cores
    (3xTF32); fp16/bf16 ignore the setting; the interpreter computes in the input dtype whatever it says."""
    if interpreting():
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"


def attention_args(q, k, v, alpha, bias, cu_seqlens_q, cu_seqlens_k, scale, is_causal, dropout_p, seed,
                   window_size=None, alibi_slopes=None, softcap=None, sinks=None, block_mask=None,
                   tiles: tuple | None = None) -> dict:
    """The keyword arguments every attention kernel (forward, dQ, dK/dV, d bias) takes, named as in
    CONTRIBUTING.md ("Naming in kernels/"). ``bias`` (an additive float mask, or a boolean / uint8 keep mask
    read as is: ``BIAS_KIND`` 1 or 2) is broadcast to ``(B, Hq, Nq, Nk)`` by zero strides; ``is_causal`` and
    ``window_size`` become the structural mask ``MASK`` (``_masking.mask_spec``); ``softcap`` and
    ``alibi_slopes`` (float32 ``(Hq,)`` or ``(B or nseq, Hq)``) the score modifications ``SCORE`` and ``ALIBI``
    (``_masking.score_spec``); ``sinks`` (``(Hq,)``, read as float32) the per-head sink logits ``SINKS``;
    ``block_mask`` a ``(mask, (block_q, block_k))`` pair, ``mask`` boolean ``(B or nseq or 1, Hq or 1, q blocks,
    k blocks)``, or a ``(states, (block_q, block_k), bits)`` triple with partial blocks (:func:`block_args`);
    ``tiles``: the ``(block_m, block_n)`` of a launch whose tile loops decide the block mask per tile
    (:func:`blocks_mode`)."""
    is_varlen = cu_seqlens_q is not None
    head_dim = q.shape[3]
    return dict(
        Q=q, K=k, V=v, ALPHA=alpha_arg(alpha, q.shape[1], q.device),
        **mods_args(bias, (*q.shape[:3], k.shape[2]), alibi_slopes, sinks, q, block_mask),
        CU_SEQLENS_Q=cu_seqlens_q if is_varlen else q, CU_SEQLENS_K=cu_seqlens_k if is_varlen else q,
        **stride_args("stride_q", q, "bhmd"), **stride_args("stride_k", k, "bhnd"),
        **stride_args("stride_v", v, "bhnd"),
        n_heads=q.shape[1], kv_group=q.shape[1] // k.shape[1], total_q=q.shape[2], total_k=k.shape[2],
        scale=float(scale), dropout_p=float(dropout_p), seed=int(seed) & 0x7FFFFFFF,
        MASK=mask_spec(is_causal, window_size),
        SCORE=score_spec(softcap, alibi_slopes is not None, sinks is not None, blocks_mode(block_mask, tiles)),
        HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim),
        HEAD_DIM_V=v.shape[3], BLOCK_DV=head_dim_block(v.shape[3]), IS_VARLEN=is_varlen,
        HAS_DROPOUT=float(dropout_p) > 0.0, UPCAST=interpreting(), DOT_PRECISION=dot_precision(q.dtype),
    )


def blocks_mode(block_mask, tiles: tuple | None) -> int:
    """``SCORE[4]`` (``_masking.score_spec``) for a block mask (:func:`block_parts`) and the launch's ``tiles``
    ``(block_m, block_n)``: 0 without a block mask. Every tile lies in one block when ``bq``, ``bk`` are multiples of
    the tiles: then 1 without partial blocks (the tile loops' skip decides alone, the per-score check would only cost,
    and at head dim 128 spill), 3 with them (one state read per tile, bits only in partial tiles). Otherwise, or when
    ``tiles`` is None (a kernel that visits tiles the forward's skip did not decide), 2 without partial blocks and 4
    with them (per-score states)."""
    if block_mask is None:
        return 0
    _, (block_q, block_k), bits = block_parts(block_mask)
    aligned = tiles is not None and block_q % tiles[0] == 0 and block_k % tiles[1] == 0
    return (1 if aligned else 2) + (0 if bits is None else 2)


def block_parts(block_mask) -> tuple:
    """``(grid, (block_q, block_k), bits)`` of a launcher's ``block_mask``: a ``(grid, (block_q, block_k))`` pair (a
    boolean grid, ``bits`` None) or a ``(states, (block_q, block_k), bits)`` triple (``bits`` None or the int32 words
    of the partial blocks, :func:`block_args`)."""
    grid, size, *rest = block_mask
    return grid, size, rest[0] if rest else None


def mods_args(bias, shape: tuple, alibi_slopes, sinks, like, block_mask=None) -> dict:
    """``BIAS_KIND`` and ``MODS``, the tensors of the score modifications as one kernel argument (a tuple, read by
    ``_masking.program_mods`` only): ``(BIAS, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, ALIBI,
    stride_alibi_b, stride_alibi_h, SINKS, BLOCKS, stride_block_b, stride_block_h, stride_block_m, stride_block_n,
    block_q, block_k[, BITS, n_words])`` from :func:`bias_args`, :func:`alibi_args`, :func:`sinks_arg` and
    :func:`block_args`. A new per-program score input is a new entry here and in ``program_mods``; the kernels pass
    ``MODS`` on unread."""
    b = bias_args(bias, shape, like)
    a = alibi_args(alibi_slopes, like)
    mods = (b["BIAS"], b["stride_bias_b"], b["stride_bias_h"], b["stride_bias_m"], b["stride_bias_n"], a["ALIBI"],
            a["stride_alibi_b"], a["stride_alibi_h"], sinks_arg(sinks, like), *block_args(block_mask, like))
    return dict(BIAS_KIND=b["BIAS_KIND"], MODS=mods)


def block_args(block_mask, like) -> tuple:
    """``(BLOCKS, stride_block_b, stride_block_h, stride_block_m, stride_block_n, block_q, block_k)``, and ``(BITS,
    n_words)`` after them with partial blocks: a block mask (:func:`block_parts`) indexed by sequence and q head,
    stride 0 along its broadcast dims. A boolean grid ``(B or nseq or 1, Hq or 1, q blocks, k blocks)`` is read as
    uint8; with partial blocks the grid holds int32 states (0 hidden, 1 full, ``2 + i`` partial block ``i``) and
    ``BITS`` the int32 words ``(n_partial, block_q, n_words)`` of their element masks (``n_words = ceil(block_k /
    32)``; bit ``c % 32`` of word ``c // 32`` of row ``r`` keeps the block's row ``r``, key ``c``). ``like`` and zeros
    (block sizes 1) for none."""
    if block_mask is None:
        return (like, 0, 0, 0, 0, 1, 1)
    mask, (block_q, block_k), bits = block_parts(block_mask)
    if bits is None:
        mask, partial = mask.to(device=like.device, dtype=torch.bool).view(torch.uint8), ()
    else:
        mask = mask.to(device=like.device, dtype=torch.int32)
        partial = (bits.to(device=like.device, dtype=torch.int32).contiguous(), bits.shape[2])
    strides = [0 if n == 1 else st for n, st in zip(mask.shape, mask.stride(), strict=True)]
    return (mask, *strides, int(block_q), int(block_k), *partial)


def bias_args(bias, shape: tuple, like) -> dict:
    """``BIAS``, ``BIAS_KIND`` (0 none, 1 an additive float mask, 2 a boolean / uint8 keep mask read as uint8) and
    ``stride_bias_b/h/m/n``: the mask broadcast to the 4-d ``shape`` by zero strides (``like`` stands in for a
    missing one)."""
    if bias is None:
        return dict(BIAS=like, BIAS_KIND=0, **bias_stride_args(None))
    kind = 2 if bias.dtype in (torch.bool, torch.uint8) else 1
    if bias.dtype == torch.bool:
        bias = bias.view(torch.uint8)
    full = bias.expand(*shape)
    return dict(BIAS=full, BIAS_KIND=kind, **bias_stride_args(full))


def sinks_arg(sinks, like) -> torch.Tensor:
    """The ``SINKS`` kernel argument: the per-head sink logits as contiguous float32 on ``like``'s device (``like``
    stands in for none)."""
    return like if sinks is None else sinks.detach().to(device=like.device, dtype=torch.float32).contiguous()


def alibi_args(alibi_slopes, like) -> dict:
    """``ALIBI`` and ``stride_alibi_b/h``: the slopes ``(Hq,)`` (batch stride 0) or ``(B or nseq, Hq)``."""
    if alibi_slopes is None:
        return dict(ALIBI=like, stride_alibi_b=0, stride_alibi_h=0)
    slopes = alibi_slopes.to(device=like.device, dtype=torch.float32)
    if slopes.dim() == 1:
        return dict(ALIBI=slopes, stride_alibi_b=0, stride_alibi_h=slopes.stride(0))
    return dict(ALIBI=slopes, stride_alibi_b=slopes.stride(0), stride_alibi_h=slopes.stride(1))


def alpha_arg(alpha, n_heads: int, device) -> torch.Tensor:
    """The ``ALPHA`` kernel argument: float32 ``(Hq,)`` on ``device`` (a Python number is broadcast)."""
    if not isinstance(alpha, torch.Tensor):
        alpha = torch.full((n_heads,), float(alpha), dtype=torch.float32, device=device)
    assert alpha.shape == (n_heads,), f"alpha: expected shape ({n_heads},), got {tuple(alpha.shape)}"
    return alpha.detach().to(device=device, dtype=torch.float32).contiguous()


def head_dim_block(head_dim: int) -> int:
    """``BLOCK_D``: the head dim padded to a power of two >= 16 (``tl.dot`` needs >= 16 on a GPU)."""
    return max(16, triton.next_power_of_2(head_dim))


def launch_configs():
    """GPU configs a ``triton.autotune`` of an attention kernel may try: warps and pipeline stages only (the tiles
    are the launcher's); each launch keeps three of them (``prune_to_pinned``)."""
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2, 3)]


def prune_to_pinned(pinned, by_args: bool = False):
    """``early_config_prune`` for ``launch_configs()``: ``pinned(head_dim) -> (num_warps, num_stages)`` (with
    ``by_args``: ``pinned(args)``, the launch's arguments by name) of a launch first, then one more pipeline stage,
    then the other warp count (measured alternatives: docs/kernels.md)."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        warps, stages = pinned(args if by_args else args["HEAD_DIM"])
        keep = [(warps, stages), (warps, stages + 1), ({4: 8, 8: 4}[warps], stages)]
        return [c for w_s in keep for c in configs if (c.num_warps, c.num_stages) == w_s]
    return prune


def stride_args(prefix: str, t: torch.Tensor, dims: str) -> dict:
    """Kernel keyword arguments ``{prefix + dim: stride}``, e.g. ``stride_args("stride_q", q, "bhmd")``."""
    return {prefix + d: st for d, st in zip(dims, t.stride(), strict=True)}


def bias_stride_args(bias: torch.Tensor | None) -> dict:
    """``stride_bias_b/h/m/n`` of a 4-d bias (broadcast dims have stride 0); all 0 without a bias."""
    if bias is None:
        return dict.fromkeys(("stride_bias_b", "stride_bias_h", "stride_bias_m", "stride_bias_n"), 0)
    return stride_args("stride_bias_", bias, "bhmn")


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
def _dropout_mask_kernel(OUT, seed, dropout_p, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    out_base = OUT + bh.to(tl.int64) * n_rows * n_cols
    for start_n in range(0, n_cols, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(seed, bh, rows, cols, n_cols, dropout_p)
        ptrs = out_base + rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


def dropout_keep_mask(seed: int, batch_heads: int, n_rows: int, n_cols: int, dropout_p: float, device) -> torch.Tensor:
    """Materialize the keep-mask the attention kernels draw, shape ``(batch_heads, n_rows, n_cols)``.

    For tests and the reference path only (it is O(N^2)); ``batch_heads`` indexes
    ``b * num_heads + h`` exactly as the kernels do.
    """
    out = torch.empty((batch_heads, n_rows, n_cols), dtype=torch.int8, device=device)
    block_m = 16
    grid = (triton.cdiv(n_rows, block_m), batch_heads)
    _dropout_mask_kernel[grid](OUT=out, seed=seed, dropout_p=dropout_p, n_rows=n_rows, n_cols=n_cols, BLOCK_M=block_m,
                               BLOCK_N=32)
    return out.bool()
