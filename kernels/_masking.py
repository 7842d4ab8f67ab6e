"""Which keys a query may see, and the tile ranges that follow: the one place every attention
kernel (forward, dQ, dK/dV, d bias) takes its structural mask and its loop bounds from.

A launcher builds the mask once with :func:`mask_spec` and passes it to its kernel as the single
argument ``MASK``; kernels hand ``MASK`` on to the helpers here and never read its fields. Today it
holds one compile-time flag, causal. A new structural mask (a sliding window ``(left, right)``, a
query offset for a KV cache) is a new field of ``mask_spec`` read by :func:`visible`,
:func:`key_tile_range` and :func:`query_tile_range`; the kernels do not change.

Coordinates are sequence-local: row ``i`` in ``[0, seqlen_q)``, key ``j`` in ``[0, seqlen_k)``
(with varlen, counted from the sequence's first row / key, see :func:`seq_bounds`). Causal masking
is bottom-right aligned (as flash-attn): row ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``.
The additive mask (``BIAS``) is applied by :func:`mask_scores` on top of this; on the host,
:func:`dbias_mode` and :func:`sum_to_mask` say how its gradient is reduced to its broadcast shape,
and :func:`tile_plan` gives the launch geometry (grids, tile counts, liveness words). Loops over the live tiles
of a liveness word (or of any 32 tiles) walk a compacted list built in registers by :func:`word_bits` /
:func:`bit_rank` and :func:`live_tile`, with no branch per tile, so their loads can be pipelined.
"""

from typing import NamedTuple

import triton
import triton.language as tl

# CUDA caps launch-grid axes 1 and 2 at 65535 programs; the attention grids are
# (tiles, heads, batch entries or sequences), so heads and batch are each limited to this.
MAX_GRID_YZ = 65535


def mask_spec(is_causal: bool) -> tuple:
    """The ``MASK`` kernel argument: ``(IS_CAUSAL,)``, its entries compile-time constants."""
    return (tl.constexpr(bool(is_causal)),)


class TilePlan(NamedTuple):
    """Launch geometry of one attention call: grid axis 2 (batch entries, or packed sequences), the
    tile sizes, the query / key tiles of the longest sequence (grid axis 0) and the liveness words
    per query tile (one bit per key tile, docs/design.md)."""

    n_seq: int
    block_m: int
    block_n: int
    n_q_tiles: int
    n_k_tiles: int
    n_words: int


def tile_plan(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_m: int, block_n: int) -> TilePlan:
    """The :class:`TilePlan` of ``q (B, Hq, Nq, D)``, ``k (B, Hk, Nk, D)`` (packed when ``cu_seqlens_q`` is
    given; the longest sequences are computed from the offsets unless given).

    Raises ``ValueError`` for more than 65535 heads or batch entries (sequences): CUDA caps grid axes
    1 and 2 at 65535 (their product is not limited).
    """
    n_seq = q.shape[0]
    if cu_seqlens_q is None:
        max_seqlen_q, max_seqlen_k = q.shape[2], k.shape[2]
    else:
        n_seq = cu_seqlens_q.numel() - 1
        max_seqlen_q = _max_seqlen(cu_seqlens_q) if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = _max_seqlen(cu_seqlens_k) if max_seqlen_k is None else max_seqlen_k
    if q.shape[1] > MAX_GRID_YZ or n_seq > MAX_GRID_YZ:
        raise ValueError(f"q: expected at most {MAX_GRID_YZ} heads and {MAX_GRID_YZ} batch entries (sequences), "
                         f"got {q.shape[1]} heads and {n_seq}")
    assert all(b >= 16 and b & (b - 1) == 0 for b in (block_m, block_n)), f"block_m, block_n: got {block_m}, {block_n}"
    n_k_tiles = triton.cdiv(max_seqlen_k, block_n)
    return TilePlan(n_seq, block_m, block_n, triton.cdiv(max_seqlen_q, block_m), n_k_tiles, triton.cdiv(n_k_tiles, 32))


def _max_seqlen(cu_seqlens) -> int:
    """Longest sequence of packed offsets ``cu_seqlens`` (int ``(nseq + 1,)``); 0 without sequences."""
    if cu_seqlens.numel() < 2:
        return 0
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def mask_shape4(bias) -> tuple:
    """The mask's shape left-padded with ones to 4 dims."""
    return (1,) * (4 - bias.ndim) + tuple(bias.shape)


def dbias_mode(bias, full) -> str:
    """How the bias gradient is accumulated without a ``(B, Hq, Nq, Nk)`` buffer unless the mask has that size.

    ``"rows"``: mask broadcast along keys, per-row sums of dS from the dQ kernel (``(B, Hq, Nq)``);
    ``"cols"``: broadcast along queries, per-key sums from the dK/dV kernel (``(B, Hq, Nk)``);
    ``"dense"``: a full ``(B, Hq, Nq, Nk)`` mask (or none), dS written by the dQ kernel;
    ``"blocks"``: broadcast over batch and/or heads only, the dbias kernel sums into the mask's shape.
    """
    if bias is None:
        return "dense"
    shape4 = mask_shape4(bias)
    if shape4[3] == 1:
        return "rows"
    if shape4[2] == 1:
        return "cols"
    if shape4[0] == full[0] and shape4[1] == full[1]:
        return "dense"
    return "blocks"


def sum_to_mask(grad, bias):
    """Sum a 4-d gradient over the dims the mask broadcasts along; shaped like ``bias`` (or 4-d if None)."""
    if bias is None:
        return grad
    shape4 = mask_shape4(bias)
    dims = [d for d in range(4) if shape4[d] == 1 and grad.shape[d] != 1]
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.reshape(bias.shape)


@triton.jit
def seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, seq, total_q, total_k, IS_VARLEN: tl.constexpr):
    """``(b, q_start, seqlen_q, k_start, seqlen_k)`` of sequence ``seq`` (a batch entry unless varlen).

    With ``IS_VARLEN`` sequence ``seq`` owns rows ``[CU_SEQLENS_Q[seq], CU_SEQLENS_Q[seq + 1])`` and keys
    ``[CU_SEQLENS_K[seq], CU_SEQLENS_K[seq + 1])`` of batch entry ``b = 0``; otherwise it is batch entry
    ``b = seq`` with ``total_q`` rows and ``total_k`` keys starting at 0.
    """
    if IS_VARLEN:
        b = seq * 0
        q_start = tl.load(CU_SEQLENS_Q + seq)
        seqlen_q = tl.load(CU_SEQLENS_Q + seq + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + seq)
        seqlen_k = tl.load(CU_SEQLENS_K + seq + 1) - k_start
    else:
        b = seq
        q_start = seq * 0
        seqlen_q = total_q
        k_start = seq * 0
        seqlen_k = total_k
    return b, q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def tile_indices(tile, start, seqlen, BLOCK: tl.constexpr):
    """``(idx, idx_global, ok)`` of query or key tile ``tile``, each ``[BLOCK]``: sequence-local indices,
    the same in the packed tensors (``start + idx``) and ``idx < seqlen``."""
    idx = tile * BLOCK + tl.arange(0, BLOCK)
    return idx, start + idx, idx < seqlen


@triton.jit
def visible(rows, cols, seqlen_q, seqlen_k, MASK):
    """``[BLOCK_M, BLOCK_N]`` True where row ``rows[i]`` may attend to key ``cols[j]`` (both in the sequence)."""
    ok = (rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
    if MASK[0]:
        ok = ok & (cols[None, :] <= rows[:, None] + (seqlen_k - seqlen_q))
    return ok


@triton.jit
def mask_scores(s, rows, cols, seqlen_q, seqlen_k, bias_base, stride_bias_m, stride_bias_n, bias_scale, MASK,
                BIAS_KIND: tl.constexpr):
    """Scores ``s + bias_scale * bias`` where :func:`visible`, ``-inf`` elsewhere. ``[BLOCK_M, BLOCK_N]``

    ``BIAS_KIND``: 0 no mask, 1 an additive float mask, 2 a boolean keep mask read as uint8 (nonzero =
    may attend; never converted to a float tensor). ``bias_base`` points at the mask of row 0, key 0 of
    this sequence and head.
    """
    ok = visible(rows, cols, seqlen_q, seqlen_k, MASK)
    if BIAS_KIND != 0:
        bias_ptrs = bias_base + rows.to(tl.int64)[:, None] * stride_bias_m + cols.to(tl.int64)[None, :] * stride_bias_n
        if BIAS_KIND == 2:
            ok = ok & (tl.load(bias_ptrs, mask=ok, other=0) != 0)
        else:
            s = s + tl.load(bias_ptrs, mask=ok, other=0.0).to(tl.float32) * bias_scale
    return tl.where(ok, s, float("-inf"))


@triton.jit
def key_tile_range(pid_m, seqlen_q, seqlen_k, MASK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(kt_lo, kt_hi)``: query tile ``pid_m`` may see keys of key tiles ``[kt_lo, kt_hi)`` only.

    Empty for a tile that starts past the sequence end.
    """
    k_hi = seqlen_k
    if MASK[0]:
        last_row = tl.minimum((pid_m + 1) * BLOCK_M, seqlen_q) - 1
        k_hi = tl.minimum(last_row + (seqlen_k - seqlen_q) + 1, seqlen_k)
    k_hi = tl.where(pid_m * BLOCK_M < seqlen_q, tl.maximum(k_hi, 0), 0)
    return 0, tl.cdiv(k_hi, BLOCK_N)


@triton.jit
def query_tile_range(pid_n, seqlen_q, seqlen_k, MASK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(qt_lo, qt_hi)``: key tile ``pid_n`` may be seen by rows of query tiles ``[qt_lo, qt_hi)`` only."""
    qt_lo = 0
    if MASK[0]:
        qt_lo = tl.maximum(pid_n * BLOCK_N - (seqlen_k - seqlen_q), 0) // BLOCK_M
    return qt_lo, tl.cdiv(seqlen_q, BLOCK_M)


@triton.jit
def bit_rank(bits):
    """Exclusive prefix counts of ``bits [32]`` (int32, 0 or 1) and the number set."""
    return tl.cumsum(bits, 0) - bits, tl.sum(bits, 0)


@triton.jit
def word_bits(word):
    """Bits ``[32]`` of a liveness word, their exclusive prefix counts and the number set."""
    bits = (word >> tl.arange(0, 32)) & 1
    rank, n_set = bit_rank(bits)
    return bits, rank, n_set


@triton.jit
def live_tile(bits, rank, i, w):
    """Tile ``32 w + lane`` of the ``i``-th set bit (``bits``, ``rank`` from :func:`word_bits` or :func:`bit_rank`)."""
    lane = tl.arange(0, 32)
    return w * 32 + tl.sum(tl.where((bits != 0) & (rank == i), lane, 0), 0)
