"""Which keys a query may see, and the tile ranges that follow: the one place every attention
kernel (forward, dQ, dK/dV, d bias) takes its structural mask and its loop bounds from.

A launcher builds the mask once with ``_args.mask_spec`` and passes it to its kernel as the single
argument ``MASK``; kernels hand ``MASK`` on to the helpers here and never read its fields. It holds
the causal flag and a sliding window ``(left, right)``; a new structural mask (a query offset for a
KV cache, ...) is a new field of ``_args.mask_spec`` read by :func:`visible`, :func:`key_tile_range` and
:func:`query_tile_range`; the kernels do not change.

Coordinates are sequence-local: row ``i`` in ``[0, seqlen_q)``, key ``j`` in ``[0, seqlen_k)``
(with varlen, counted from the sequence's first row / key, see :func:`seq_bounds`). Both are bottom-right
aligned (as flash-attn): with ``d = j - (i + seqlen_k - seqlen_q)``, causal keeps ``d <= 0`` and the
window ``-left <= d <= right`` (a side of ``-1`` is unbounded).
Before masks, scores can be soft-capped (:func:`soft_cap`) and get ALiBi's ``-slope * |d|``
(:func:`mask_scores`), as described by the ``SCORE`` argument of ``_args.score_spec``.
The additive mask (``BIAS``) and a block-sparse mask (``SCORE.blocks``, :func:`block_visible`, :func:`partial_tile`,
:func:`partial_scores`; :func:`block_tile_live` tells the tile loops which key tiles it hides) are applied by
:func:`mask_scores` on top of this. Only ``@triton.jit`` functions live here: the host side (``mask_spec``,
``score_spec``, the launch geometry ``tile_plan``, the mask gradient's reduction ``dbias_mode`` / ``sum_to_mask``)
is ``_args.py``. Loops over the live tiles
of a liveness word (or of any 32 tiles) walk a compacted list built in registers by :func:`word_bits` /
:func:`bit_rank` and :func:`live_tile`, with no branch per tile, so their loads can be pipelined.
"""

from collections import namedtuple

import triton
import triton.language as tl

# The values a program computes once and its helpers read by name (kernel value types, built inside the kernels):
# the score modifications of one program (``program_mods``) and its block mask (``ProgramMods.blocks``).
ProgramMods = namedtuple("ProgramMods", "bias_base stride_bias_m stride_bias_n slope sink blocks")
BlockGrid = namedtuple("BlockGrid", "base stride_m stride_n block_q block_k bits n_words")
# A key tile as a tile loop meets it (:func:`key_tile`): its index ``kt``, its key indices ``cols``, whether it is
# loaded at all (``open``: False for a tile the block mask hides from every row, a dead tile) and whether it lies inside
# the sequences and the structural mask (``inside``, :func:`tile_inside`: a full tile, whose scores :func:`score_mod`
# takes without a per-score step when nothing else modifies them per score); a tile neither dead nor full is partial.
KeyTile = namedtuple("KeyTile", "kt cols open inside")


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
    if MASK.causal or MASK.has_left or MASK.has_right:
        d = cols[None, :] - rows[:, None] - (seqlen_k - seqlen_q)
        if MASK.causal:
            ok = ok & (d <= 0)
        if MASK.has_right:
            ok = ok & (d <= MASK.right)
        if MASK.has_left:
            ok = ok & (d >= -MASK.left)
    return ok


@triton.jit
def program_mods(MODS, b, seq, h, q_start, k_start, SCORE):
    """The score modifications of one program (batch entry ``b``, sequence ``seq``, q head ``h``, its first row and key
    at ``q_start``, ``k_start`` of the packed tensors) as one :data:`ProgramMods`, the ``mods`` of :func:`score_mod`:
    the additive / boolean mask of its row 0, key 0 (``bias_base``), the mask's row and key strides, the ALiBi slope
    (:func:`alibi_slope`), the sink logit (:func:`sink_logit`) and the block mask ``blocks`` (a :data:`BlockGrid`:
    ``base``, ``stride_m``, ``stride_n``, ``block_q``, ``block_k``, ``bits``, ``n_words``) of this
    sequence and head: its grid, block sizes, and the element masks of its partial blocks (``n_words`` int32 words per
    block row, :func:`block_state`; with ``SCORE.blocks`` 3 or 4 only); read only with ``SCORE.blocks``
    (:func:`block_visible`, :func:`block_tile_live`).
    ``MODS`` is the kernel argument of ``_args.mods_args`` (an ``_args.ModsArgs``); helpers take ``mods`` and never
    read ``MODS``; a new per-program score input is one more field of both, read by :func:`mask_scores`."""
    bias_base = (MODS.bias + b.to(tl.int64) * MODS.stride_bias_b + h.to(tl.int64) * MODS.stride_bias_h
                 + q_start.to(tl.int64) * MODS.stride_bias_m + k_start.to(tl.int64) * MODS.stride_bias_n)
    if SCORE.blocks >= 3:
        bits = MODS.bits, MODS.n_words
    else:  # no partial blocks: MODS has no bits (the kernel takes no more arguments than without them)
        bits = MODS.blocks, 0
    blocks = BlockGrid(MODS.blocks + seq.to(tl.int64) * MODS.stride_block_b + h.to(tl.int64) * MODS.stride_block_h,
                       MODS.stride_block_m, MODS.stride_block_n, MODS.block_q, MODS.block_k, bits[0], bits[1])
    return ProgramMods(bias_base, MODS.stride_bias_m, MODS.stride_bias_n,
                       alibi_slope(MODS.alibi, seq, h, MODS.stride_alibi_b, MODS.stride_alibi_h, SCORE),
                       sink_logit(MODS.sinks, h, SCORE), blocks)


@triton.jit
def score_mod(s, rows, cols, seqlen_q, seqlen_k, mods, bias_scale, MASK, SCORE, BIAS_KIND: tl.constexpr, ref=None,
              inside=None):
    """Final scores of one tile from the scaled products ``s`` (``bias_scale`` times ``scale * q.k``): soft-capped
    (:func:`soft_cap`, in the same scale), plus ``bias_scale * (bias - slope * |d|)``, ``-inf`` where the structural
    mask or a boolean mask hides the key (:func:`mask_scores`); relative to the rows' reference scores ``ref``
    (``[BLOCK_M]``, subtracted last, after the scores are rounded as without it) when given. ``mods`` from
    :func:`program_mods`. The one place the attention kernels modify scores. [BLOCK_M, BLOCK_N]

    ``inside`` (a run-time flag, :func:`tile_inside` of the tile; ``KeyTile.inside``): when every pair of the tile is
    visible and no modification but the soft cap works per score (no mask tensor, ``SCORE.plain``), the scores skip
    :func:`mask_scores` (a full tile: the per-score check is paid on boundary tiles only). Same values either way."""
    s = soft_cap(s, SCORE.softcap * bias_scale, SCORE)
    if (inside is not None) and (BIAS_KIND == 0) and SCORE.plain:
        if inside:
            if ref is not None:
                s = s - ref[:, None]
        else:
            s = mask_scores(s, rows, cols, seqlen_q, seqlen_k, mods, bias_scale, MASK, BIAS_KIND, SCORE, ref)
    else:
        s = mask_scores(s, rows, cols, seqlen_q, seqlen_k, mods, bias_scale, MASK, BIAS_KIND, SCORE, ref)
    return s


@triton.jit
def score_mod_grad(ds, s, mods, SCORE):
    """The gradient of the scaled products ``s`` (``scale q.k``, before :func:`score_mod`) from ``ds``, that of the
    final scores: :func:`score_mod`'s chain rule, the soft cap's ``1 - tanh^2`` (the masks and biases are added, the
    reference score subtracted: their derivative is 1). ``mods`` from :func:`program_mods`. [BLOCK_M, BLOCK_N]"""
    ds_qk = ds
    if SCORE.has_softcap:
        t = soft_cap(s, SCORE.softcap, SCORE) / SCORE.softcap  # the capped scores score_mod computed (one build: CSE)
        ds_qk = ds * (1.0 - t * t)
    return ds_qk


@triton.jit
def alibi_slope(ALIBI, seq, h, stride_alibi_b, stride_alibi_h, SCORE):
    """ALiBi slope of sequence (batch entry) ``seq`` and q head ``h`` (float32, shaped like ``h``; 0 without ALiBi).
    One return statement: a compiled function's returns must agree in shape."""
    slope = 0.0
    if SCORE.has_alibi:
        slope = tl.load(ALIBI + seq.to(tl.int64) * stride_alibi_b + h.to(tl.int64) * stride_alibi_h).to(tl.float32)
    return slope


@triton.jit
def sink_logit(SINKS, h, SCORE):
    """Sink logit of q head ``h`` (float32, shaped like ``h``; not scaled, capped or masked; ``-inf`` without sinks)."""
    sink = float("-inf")
    if SCORE.has_sinks:
        sink = tl.load(SINKS + h).to(tl.float32)
    return sink


@triton.jit
def sink_tile(sink, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A virtual score tile ``[BLOCK_M, BLOCK_N]`` holding the sink logit ``sink`` in column 0, ``-inf`` elsewhere:
    the row helpers of the real tiles take the sink's terms from it."""
    col0 = (tl.arange(0, BLOCK_N) == 0)[None, :] & (tl.arange(0, BLOCK_M) >= 0)[:, None]
    return tl.where(col0, sink, float("-inf"))


@triton.jit
def soft_cap(s, cap, SCORE):
    """``cap * tanh(s / cap)`` of finite scores when ``SCORE`` soft-caps (``cap`` = its softcap times the
    caller's score scale), ``s`` unchanged otherwise and at non-finite entries, with a relative error of a few
    float32 ulps at any ``s / cap``: ``s * tanh(x) / x`` by its Taylor series to ``x^10`` for ``|x| < 0.375``
    (``x = s / cap``), else ``cap * (1 - 2 / (exp(2x) + 1))`` (exact limits at large ``|x|``). The second form
    alone loses the relative accuracy of small ``x`` (``1 - 2 / (e^{2x} + 1)`` cancels: an error of a few ulps of
    ``cap``), which large caps make visible (docs/kernels.md)."""
    if SCORE.has_softcap:
        # tensor-first arithmetic: ``cap`` may be a compile-time constant (a Python float times a constexpr)
        x = s * (1.0 / cap)
        x2 = x * x
        r = x2 * -0.008863235529902197 + 0.021869488536155203
        r = r * x2 - 0.05396825396825397
        r = r * x2 + 0.13333333333333333
        r = r * x2 - 0.3333333333333333
        t_small = s + s * (r * x2)
        t_large = (1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)) * cap
        s = tl.where(tl.abs(s) == float("inf"), s, tl.where(tl.abs(x) < 0.375, t_small, t_large))
    return s


@triton.jit
def mask_scores(s, rows, cols, seqlen_q, seqlen_k, mods, bias_scale, MASK, BIAS_KIND: tl.constexpr, SCORE, ref=None):
    """Scores ``s + bias_scale * (bias - slope * |d|)`` (minus the rows' references ``ref`` when given) where
    :func:`visible` (and the block mask, when ``SCORE.blocks``), ``-inf`` elsewhere. ``[BLOCK_M, BLOCK_N]``

    ``ref`` is subtracted after the bias and ALiBi terms, so that a score is rounded once, as without it, before it
    is made relative (exact near the reference, Sterbenz); without them the subtraction folds into the caller's
    scaling (one FMA).

    ``BIAS_KIND``: 0 no mask, 1 an additive float mask, 2 a boolean keep mask read as uint8 (nonzero =
    may attend; never converted to a float tensor). ``mods`` from :func:`program_mods`: the mask's base (row 0, key 0
    of this sequence and head) and strides, the ALiBi slope, the block mask. The ALiBi term (``SCORE.has_alibi``) uses
    the bottom-right distance ``d = j - (i + seqlen_k - seqlen_q)``.
    """
    blocks = mods.blocks
    ok = visible(rows, cols, seqlen_q, seqlen_k, MASK)
    if SCORE.blocks == 2:
        ok = ok & block_visible(rows, cols, blocks, ok)
    if SCORE.blocks == 3:
        ok = partial_tile(ok, rows, cols, seqlen_q, seqlen_k, blocks)
    if SCORE.has_alibi:
        d = (cols[None, :] - rows[:, None] - (seqlen_k - seqlen_q)).to(tl.float32)
        s = s - (bias_scale * mods.slope) * tl.abs(d)
    if BIAS_KIND != 0:
        bias_ptrs = (mods.bias_base + rows.to(tl.int64)[:, None] * mods.stride_bias_m
                     + cols.to(tl.int64)[None, :] * mods.stride_bias_n)
        if BIAS_KIND == 2:
            ok = ok & (tl.load(bias_ptrs, mask=ok, other=0) != 0)
        else:
            s = s + tl.load(bias_ptrs, mask=ok, other=0.0).to(tl.float32) * bias_scale
    if ref is not None:
        s = s - ref[:, None]
    s = tl.where(ok, s, float("-inf"))
    # mode 4 last, on the final scores: its per-score states and words are not live across the bias terms
    if SCORE.blocks == 4:
        s = partial_scores(s, rows, cols, seqlen_q, seqlen_k, blocks)
    return s


@triton.jit
def tile_inside(row_lo, col_lo, seqlen_q, seqlen_k, MASK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """True when :func:`visible` keeps every pair of the tile of rows ``row_lo ..`` (``BLOCK_M``) and keys
    ``col_lo ..`` (``BLOCK_N``): all of them in the sequence and inside the structural mask. A kernel may then skip
    the per-score check of :func:`mask_scores` when no other modification (a mask, ALiBi, a per-score block check)
    needs one: the check is paid on boundary tiles only."""
    row_hi = row_lo + BLOCK_M - 1
    col_hi = col_lo + BLOCK_N - 1
    shift = seqlen_k - seqlen_q
    ok = (row_hi < seqlen_q) & (col_hi < seqlen_k)
    if MASK.causal:
        ok = ok & (col_hi - row_lo - shift <= 0)
    if MASK.has_right:
        ok = ok & (col_hi - row_lo - shift <= MASK.right)
    if MASK.has_left:
        ok = ok & (col_lo - row_hi - shift >= -MASK.left)
    return ok


@triton.jit
def key_tile(kt, row_lo, seqlen_q, seqlen_k, MASK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, tile_open=True):
    """The :data:`KeyTile` ``kt`` of the query tile whose first row is ``row_lo`` (``BLOCK_M`` rows): its key indices,
    ``tile_open`` (False: dead, the block mask hides it; :func:`block_tile_live`) and :func:`tile_inside`. Every tile
    loop of the attention kernels takes its tiles from here, in its own order (max-first :func:`visit_tile`, ascending,
    or the live bits of a bitmap word, :func:`live_tile`)."""
    col_lo = kt * BLOCK_N
    return KeyTile(kt, col_lo + tl.arange(0, BLOCK_N), tile_open,
                   tile_inside(row_lo, col_lo, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N))


@triton.jit
def key_range(row_lo, row_hi, seqlen_q, seqlen_k, MASK):
    """``(k_lo, k_hi)``: rows ``row_lo .. row_hi`` (inclusive, in the sequence) may see keys ``[k_lo, k_hi)`` only
    (``k_hi`` may be ``<= k_lo``: no key). The split-K decode kernels take their key range from it directly."""
    shift = seqlen_k - seqlen_q
    k_hi = seqlen_k + row_hi * 0
    if MASK.causal:
        k_hi = tl.minimum(row_hi + shift + 1, k_hi)
    if MASK.has_right:
        k_hi = tl.minimum(row_hi + shift + MASK.right + 1, k_hi)
    k_lo = row_lo * 0
    if MASK.has_left:
        k_lo = tl.maximum(row_lo + shift - MASK.left, 0)
    return k_lo, tl.maximum(k_hi, 0)


@triton.jit
def key_tile_range(pid_m, seqlen_q, seqlen_k, MASK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(kt_lo, kt_hi)``: query tile ``pid_m`` may see keys of key tiles ``[kt_lo, kt_hi)`` only.

    Empty (``kt_lo == kt_hi``) for a tile that starts past the sequence end or whose rows see no key.
    """
    last_row = tl.minimum((pid_m + 1) * BLOCK_M, seqlen_q) - 1
    k_lo, k_hi = key_range(pid_m * BLOCK_M, last_row, seqlen_q, seqlen_k, MASK)
    kt_hi = tl.cdiv(tl.where(pid_m * BLOCK_M < seqlen_q, k_hi, 0), BLOCK_N)
    kt_lo = kt_hi * 0
    if MASK.has_left:  # without a left window the loops start at tile 0, a constant the compiler sees
        kt_lo = tl.minimum(k_lo // BLOCK_N, kt_hi)
    return kt_lo, kt_hi


@triton.jit
def query_tile_range(pid_n, seqlen_q, seqlen_k, MASK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(qt_lo, qt_hi)``: key tile ``pid_n`` may be seen by rows of query tiles ``[qt_lo, qt_hi)`` only
    (possibly empty: ``qt_lo >= qt_hi``)."""
    shift = seqlen_k - seqlen_q
    row_lo = pid_n * 0
    if MASK.causal:
        row_lo = tl.maximum(pid_n * BLOCK_N - shift, row_lo)
    if MASK.has_right:
        row_lo = tl.maximum(pid_n * BLOCK_N - shift - MASK.right, row_lo)
    row_hi = seqlen_q
    if MASK.has_left:
        last_col = tl.minimum((pid_n + 1) * BLOCK_N, seqlen_k) - 1
        row_hi = tl.maximum(tl.minimum(last_col - shift + MASK.left + 1, row_hi), 0)
    return row_lo // BLOCK_M, tl.cdiv(row_hi, BLOCK_M)


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


@triton.jit
def max_first_tile(pid_m, seqlen_q, seqlen_k, kt_lo, kt_hi, MASK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key tile most likely to hold the row maxima of query tile ``pid_m`` (key tiles ``[kt_lo, kt_hi)``): the
    grid pass starts there and walks outward (:func:`visit_tile`), so that the running max is final before the far
    tiles are seen and they take the dead path.

    Causal (with or without a left window): the diagonal tile ``kt_hi - 1``, then descending. Otherwise the tile of
    the diagonal of the query tile's middle row, clamped into the range: the centre of a symmetric window, the
    diagonal band of self-attention. Cross-attention (``seqlen_q != seqlen_k``) without causal mask or window has no
    structure to exploit: ``kt_lo`` (today's ascending order).
    """
    if MASK.causal:
        first = kt_hi - 1
    else:
        mid = tl.minimum(pid_m * BLOCK_M + BLOCK_M // 2, seqlen_q - 1)
        diag = tl.maximum(mid + (seqlen_k - seqlen_q), 0) // BLOCK_N
        first = tl.maximum(tl.minimum(diag, kt_hi - 1), kt_lo)
        if not (MASK.has_left or MASK.has_right):
            first = tl.where(seqlen_q == seqlen_k, first, kt_lo)
    return first


@triton.jit
def visit_tile(i, kt_lo, kt_hi, first):
    """The ``i``-th key tile of the outward walk from ``first`` over ``[kt_lo, kt_hi)``: ``first``, then one below,
    one above, two below, two above, ... and, once a side is used up, the rest of the other side in order.
    ``first == kt_hi - 1`` walks down, ``first == kt_lo`` walks up. Each side is visited monotonically away from
    ``first`` (:func:`mark_tile` relies on it)."""
    below = first - kt_lo
    above = kt_hi - 1 - first
    both = tl.minimum(below, above)
    step = (i + 1) // 2
    alt = tl.where(i % 2 == 1, first - step, first + step)
    rest = tl.where(above == both, first - (i - both), first + (i - both))
    return tl.where(i <= 2 * both, alt, rest)


@triton.jit
def walk_words():
    """:func:`mark_tile`'s state before the first tile: ``(word_c, word_lo, w_lo, word_hi, w_hi)``."""
    zero = tl.zeros([], tl.int32)
    return zero, zero, zero - 1, zero, zero - 1


@triton.jit
def mark_tile(kt, live, first, word_c, word_lo, w_lo, word_hi, w_hi):
    """Set the liveness bit ``live`` (0 or 1) of key tile ``kt`` visited by :func:`visit_tile`'s walk from
    ``first``. The bitmap words are built in registers: ``word_c`` holds the word of ``first``, ``word_lo`` /
    ``word_hi`` the word the walk is in below / above it (word index ``w_lo`` / ``w_hi``, -1 before any); each side
    leaves a word for good, so the word holding ``kt`` is complete in registers after this tile. Returns
    ``(w, word, word_c, word_lo, w_lo, word_hi, w_hi)``: store ``word`` at word ``w`` (overwriting the partial one).
    """
    w = kt // 32
    bit = live << (kt % 32)
    in_c = w == first // 32
    lower = (kt < first) & (in_c == 0)
    upper = (kt > first) & (in_c == 0)
    word_c = tl.where(in_c, word_c | bit, word_c)
    word_lo = tl.where(lower, tl.where(w == w_lo, word_lo, 0) | bit, word_lo)
    w_lo = tl.where(lower, w, w_lo)
    word_hi = tl.where(upper, tl.where(w == w_hi, word_hi, 0) | bit, word_hi)
    w_hi = tl.where(upper, w, w_hi)
    return w, tl.where(in_c, word_c, tl.where(lower, word_lo, word_hi)), word_c, word_lo, w_lo, word_hi, w_hi


@triton.jit
def key_block_range(row_lo, row_hi, seqlen_q, seqlen_k, MASK, BLOCK_N: tl.constexpr):
    """``(kt_lo, kt_hi)``: rows ``row_lo .. row_hi`` (inclusive, in the sequence; any set of rows between them) may see
    keys of the key blocks ``[kt_lo, kt_hi)`` of ``BLOCK_N`` keys only (:func:`key_range` in blocks; ``kt_lo`` the
    constant 0 without a left window). The split-K decode kernels take their key blocks from it."""
    k_lo, k_hi = key_range(row_lo, row_hi, seqlen_q, seqlen_k, MASK)
    kt_hi = tl.cdiv(k_hi, BLOCK_N)
    kt_lo = kt_hi * 0
    if MASK.has_left:  # without a left window the loops start at block 0, a constant the compiler sees
        kt_lo = tl.minimum(k_lo // BLOCK_N, kt_hi)
    return kt_lo, kt_hi


@triton.jit
def block_visible(rows, cols, blocks, ok):
    """``[BLOCK_M, BLOCK_N]`` True where the block mask keeps block ``(rows[i] // block_q, cols[j] // block_k)``
    (``blocks``: ``ProgramMods.blocks``); read only where ``ok``."""
    return tl.load(_block_ptrs(rows, cols, blocks), mask=ok, other=0) != 0


@triton.jit
def _block_ptrs(rows, cols, blocks):
    """``[BLOCK_M, BLOCK_N]`` addresses in the block grid of the blocks of rows ``rows``, keys ``cols``."""
    return (blocks.base + (rows // blocks.block_q).to(tl.int64)[:, None] * blocks.stride_m
            + (cols // blocks.block_k).to(tl.int64)[None, :] * blocks.stride_n)


@triton.jit
def block_state(rows, cols, blocks, ok):
    """``[BLOCK_M, BLOCK_N]`` int32 state of the block of each score (0 elsewhere than ``ok``): 0 hidden, 1 full,
    ``2 + i`` partial block ``i``, whose element mask is the bit ``c % 32`` of word ``BITS[i, r, c // 32]`` (``r``,
    ``c`` the row and key inside the block; ``n_words = ceil(block_k / 32)`` words a row)."""
    return tl.load(_block_ptrs(rows, cols, blocks), mask=ok, other=0).to(tl.int32)


@triton.jit
def partial_tile(ok, rows, cols, seqlen_q, seqlen_k, blocks):
    """``ok`` of a tile lying in one block of a block mask with partial blocks (``SCORE.blocks`` 3), and the block's
    bits of the tile's scores when the block is partial. Decided per tile: one state read (the tile loops skip hidden
    blocks' tiles, so none reaches here); a full block's tile does nothing more, a partial block's tile (a run-time
    branch) loads its rows' words (``ceil(BLOCK_N / 32)`` loads of ``[BLOCK_M]``) and tests the bits. Applied to the
    mask before the bias and ALiBi terms: of the forms measured in the sm_90 builds (docs/design.md) this one keeps
    the tile loops free of spills under triton 3.6 and 3.9. ``[BLOCK_M, BLOCK_N]``"""
    BLOCK_N: tl.constexpr = cols.shape[0]
    N_WORDS: tl.constexpr = (BLOCK_N + 31) // 32
    row0 = tl.min(rows, 0)
    col0 = tl.min(cols, 0)
    state = tl.load(blocks.base + (row0 // blocks.block_q).to(tl.int64) * blocks.stride_m
                    + (col0 // blocks.block_k).to(tl.int64) * blocks.stride_n,
                    mask=(row0 < seqlen_q) & (col0 < seqlen_k), other=0).to(tl.int32)
    if state >= 2:
        block_k = blocks.block_k
        n_words = blocks.n_words
        word0 = (col0 % block_k) // 32
        word_ptrs = (blocks.bits + (state - 2).to(tl.int64) * (blocks.block_q * n_words)
                     + (rows % blocks.block_q).to(tl.int64) * n_words + word0)  # [BLOCK_M]
        in_block = cols % block_k  # [BLOCK_N]
        word = tl.load(word_ptrs)[:, None]
        for j in tl.static_range(1, N_WORDS):
            word = tl.where((in_block // 32 - word0 == j)[None, :], tl.load(word_ptrs + j)[:, None], word)
        ok = ok & (((word >> (in_block % 32)[None, :]) & 1) != 0)
    return ok


@triton.jit
def partial_scores(s, rows, cols, seqlen_q, seqlen_k, blocks):
    """Scores ``s`` with ``-inf`` where a score's block is hidden, or partial with the score's bit clear
    (``SCORE.blocks`` 4: tiles that may meet several blocks): the block state per score (:func:`block_state`), and
    the bits only in a tile that meets a partial block. ``[BLOCK_M, BLOCK_N]``"""
    state = block_state(rows, cols, blocks, (rows < seqlen_q)[:, None] & (cols < seqlen_k)[None, :])
    s = tl.where(state != 0, s, float("-inf"))
    if tl.max(tl.max(state, 1), 0) >= 2:
        partial = state >= 2
        in_block = cols % blocks.block_k
        word_ptrs = (blocks.bits + (state - 2).to(tl.int64) * (blocks.block_q * blocks.n_words)
                     + (rows % blocks.block_q).to(tl.int64)[:, None] * blocks.n_words
                     + (in_block // 32).to(tl.int64)[None, :])
        word = tl.load(word_ptrs, mask=partial, other=0)
        s = tl.where(partial & (((word >> (in_block % 32)[None, :]) & 1) == 0), float("-inf"), s)
    return s


@triton.jit
def block_tile_live(mods, row_lo, row_hi, kt, seqlen_k, SCORE, BLOCK_N: tl.constexpr):
    """Whether the block mask keeps any block that meets rows ``row_lo .. row_hi`` (inclusive, in the sequence) and
    key tile ``kt`` (keys ``kt * BLOCK_N ..`` up to the sequence end): a key tile for which it is False holds no
    visible key for these rows and need not be loaded. Always True without a block mask (``SCORE.blocks`` off).
    ``mods`` from :func:`program_mods`. One ``[BLOCK_N]`` load per query block the rows meet."""
    live = kt >= 0
    if SCORE.blocks:
        block_base, stride_m, stride_n, block_q, block_k, _, _ = mods.blocks
        k_lo = kt * BLOCK_N
        k_hi = tl.minimum(k_lo + BLOCK_N, seqlen_k) - 1
        kb = k_lo // block_k + tl.arange(0, BLOCK_N)
        kb_ok = kb <= k_hi // block_k
        found = tl.zeros([BLOCK_N], tl.int32)
        qb_lo = row_lo // block_q
        for i in range(0, row_hi // block_q + 1 - qb_lo):
            ptrs = block_base + (qb_lo + i).to(tl.int64) * stride_m + kb.to(tl.int64) * stride_n
            found = found | tl.load(ptrs, mask=kb_ok, other=0).to(tl.int32)
        live = (tl.max(found, 0) != 0) & (k_lo <= k_hi)
    return live
