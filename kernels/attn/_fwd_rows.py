"""The fused forward's work on one query tile (``kernels/attn/entmax_attn_fwd.py`` launches it): score tiles, the
online-softmax pass at alpha = 1 and, for alpha in (1, 2], the value pass and the tile helpers of the grid and
candidate passes (``_fwd_entmax.py`` runs those; the module docstring of ``entmax_attn_fwd`` and docs/kernels.md
describe them).

The kernel builds the program's run-time values once as tuples and hands them down: :class:`KeyTiles` (the key and
value slices), :class:`Rows` (the query rows, their sequence and their dropout draw), :class:`Tiles` (the key tile
range and the liveness words), :class:`Scalars`, and ``mods`` (``_masking.program_mods``, read by
``_masking.score_mod`` only). Block sizes are the lengths of their tensors (``BLOCK_M = rows.shape[0]``, ``BLOCK_D
= q.shape[1]``, ``BLOCK_N``, ``BLOCK_DV``: :class:`KeyTiles`); the operands of ``tl.dot`` take ``q``'s dtype (float32
when the kernel upcasts, ``UPCAST``).
"""

from typing import NamedTuple

import triton
import triton.language as tl

from .._common import LN2, LOG2E, dropout_keep, load_tile, two_sum
from .._masking import block_tile_live, key_tile, live_tile, mark_tile, score_mod, sink_tile, visit_tile, word_bits
from ._threshold import FAST_BETA_MAX, pow_weights, weights
from ._threshold_tiles import (
    cand_sums,
)


class KeyTiles(NamedTuple):
    """The key and value slices of a program's kv head: base pointers (key 0 of the sequence) or TMA tensor descriptors
    of the sequence's rows (``_common.rows_source``; ``_score_tile`` and ``_value_tile`` load either), row and head-dim
    strides, the key offsets of one tile ``tl.arange(0, BLOCK_N)`` and the masks of the valid key / value head dims
    (``[BLOCK_D]``, ``[BLOCK_DV]``)."""

    k_base: tl.tensor
    v_base: tl.tensor
    stride_kn: tl.tensor
    stride_kd: tl.tensor
    stride_vn: tl.tensor
    stride_vd: tl.tensor
    offs_n: tl.tensor
    d_ok: tl.tensor
    dv_ok: tl.tensor


class Rows(NamedTuple):
    """The query rows of a program ``[BLOCK_M]`` (sequence-local), its sequence's lengths and first row / key in the
    packed tensors, the key count ``total_k`` and flat batch-head index ``bh`` that index the dropout draw, and the
    dropout's seed, probability and ``1 / (1 - dropout_p)``."""

    rows: tl.tensor
    seqlen_q: tl.tensor
    seqlen_k: tl.tensor
    q_start: tl.tensor
    k_start: tl.tensor
    total_k: tl.tensor
    bh: tl.tensor
    seed: tl.tensor
    dropout_p: tl.tensor
    inv_keep: tl.tensor


class Tiles(NamedTuple):
    """The key tiles of a program: the visible range ``[kt_lo, kt_hi)``, the grid pass's first tile
    (``_masking.max_first_tile``), and the liveness words (``n_words`` from ``live_base``)."""

    kt_lo: tl.tensor
    kt_hi: tl.tensor
    kt_first: tl.tensor
    n_words: tl.tensor
    live_base: tl.tensor


class Scalars(NamedTuple):
    """The run-time scalars of the threshold search: the score scale, the head's alpha, the tolerance and the cap on
    the passes (``entmax_attn_fwd``)."""

    scale: tl.tensor
    alpha: tl.tensor
    tol: tl.tensor
    max_passes: tl.tensor


@triton.jit
def _score_tile(q, kv, rw, key, mods, z_scale, bias_scale, BIAS_KIND: tl.constexpr, MASK, SCORE,
                DOT_PRECISION: tl.constexpr, ref=None, FULL: tl.constexpr = True):
    """Scores ``z_scale * q.k`` (soft-capped in the same scale) ``+ bias_scale * (bias - slope * |d|)`` of the key
    tile ``key`` (a ``_masking.KeyTile``), ``-inf`` where masked, minus the rows' reference scores ``ref`` when given
    (``_masking.score_mod``). With ``FULL`` a full tile (``key.inside``) skips the per-score mask; each loop decides
    by its sm_90 builds (docs/kernels.md, "Full tiles"). [BLOCK_M, BLOCK_N]"""
    cols = key.cols
    if isinstance(kv.k_base, tl.tensor_descriptor):  # one TMA copy of the tile, zeros past the keys and head dim
        k = tl.trans(kv.k_base.load([key.kt * kv.offs_n.shape[0], 0]))
    else:
        offs_d = tl.arange(0, kv.d_ok.shape[0])
        k_ptrs = kv.k_base + cols.to(tl.int64)[None, :] * kv.stride_kn + offs_d.to(tl.int64)[:, None] * kv.stride_kd
        k = tl.load(k_ptrs, mask=(cols[None, :] < rw.seqlen_k) & kv.d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * z_scale
    inside = None
    if FULL:
        inside = key.inside
    return score_mod(s, rw.rows, cols, rw.seqlen_q, rw.seqlen_k, mods, bias_scale, MASK, SCORE, BIAS_KIND, ref, inside)


@triton.jit
def _value_tile(q, kv, key, seqlen_k):
    """Value rows of the key tile ``key`` (a ``_masking.KeyTile``) in ``q``'s dtype. [BLOCK_N, BLOCK_DV]"""
    offs_d = tl.arange(0, kv.dv_ok.shape[0])
    return load_tile(kv.v_base, key.kt * kv.offs_n.shape[0], key.cols, offs_d, kv.stride_vn, kv.stride_vd,
                     key.cols < seqlen_k, kv.dv_ok, False).to(q.dtype)


@triton.jit
def _apply_dropout(p, u, rw, cols, HAS_DROPOUT: tl.constexpr):
    """Weights ``p`` and ``u`` after one dropout draw (kept ones scaled by ``inv_keep``). [BLOCK_M, BLOCK_N] each"""
    if HAS_DROPOUT:
        keep = dropout_keep(rw.seed, rw.bh, rw.q_start + rw.rows, rw.k_start + cols, rw.total_k, rw.dropout_p)
        p = tl.where(keep, p * rw.inv_keep, 0.0)
        u = tl.where(keep, u * rw.inv_keep, 0.0)
    return p, u


@triton.jit
def _weights_and_u(z, t, POW: tl.constexpr, beta, HALF_P: tl.constexpr, WITH_U: tl.constexpr):
    """The value pass's weights ``p = [z - tau]_+^beta`` at the thresholds ``t`` (``_threshold.weights``) and, with
    ``WITH_U``, ``U = [z - tau]_+^(beta - 1)`` (else ``U = p``). [BLOCK_M, BLOCK_N] each

    The general path with ``WITH_U`` takes both from one ``log2_1p`` (``_threshold.pow_weights``: the same ``p`` as
    without ``U``, no division by ``r``).
    """
    if WITH_U and POW == 0:
        p, u = pow_weights(z - t[:, None], beta)
    else:
        p = weights(z, t, POW, beta, HALF_P)
        u = p
        if WITH_U:
            if POW == 1:
                u = tl.where(z > t[:, None], 1.0, 0.0)
            else:
                u = tl.maximum(z - t[:, None], 0.0)
    return p, u


@triton.jit
def tile_screen(z, t_low, ref):
    """Screen a score tile ``z`` of a first pass (the fused grid pass, the split max pass) with two row reductions,
    before any per-score bookkeeping. Returns ``(code, n_fast, z_max)``: ``code`` (CTA-wide int32) is 0 when the tile
    is dead and plain (the grid pass skips it: ``grid_tile`` would change nothing), 1 when some row has a score above
    its ``ref + t_low``, 2 or more when some row holds a non-finite score and is not all ``-inf`` (then the tile gets
    the exact per-score NaN/+inf flags and valid-key counts, ``valid_keys``); ``n_fast`` the rows' valid-key counts
    when ``code < 2``; ``z_max`` the row maxima.

    Exact: a finite row sum means every score of the row is finite (``BLOCK_N`` valid keys, no NaN or +inf; an
    overflowing sum only sends the tile the exact way); a row sum and a row max both ``-inf`` mean every score is
    ``-inf`` (none valid; a NaN would make the sum NaN, a +inf the max). A dead plain tile cannot raise a row max
    (its max is <= ``t_low`` < ``m``, or ``-inf`` with ``m``), so the ring, the max and the live bit (0) are those
    ``grid_tile`` would give.
    """
    z_max = tl.max(z, 1)
    z_sum = tl.sum(z, 1)
    plain = (tl.abs(z_sum) < float("inf")) | ((z_sum == float("-inf")) & (z_max == float("-inf")))
    code = tl.max(tl.where(plain, tl.where(z_max - ref > t_low, 1, 0), 2), 0)
    return code, tl.where(z_max > float("-inf"), z.shape[1], 0), z_max


@triton.jit
def valid_keys(z, code, n_fast, bad, n_valid):
    """The rows' NaN / +inf flags ``bad`` and valid-key counts ``n_valid`` (``[BLOCK_M]`` int32) after the score tile
    ``z`` screened by ``tile_screen`` (``code``, ``n_fast``): exact per-score flags and counts only when
    ``code > 1``."""
    if code > 1:
        bad = bad | tl.max(((z != z) | (z == float("inf"))).to(tl.int32), 1)
        n_valid += tl.sum((z > float("-inf")).to(tl.int32), 1)
    else:
        n_valid += n_fast
    return bad, n_valid


@triton.jit
def open_tile(i, tiles, kv, rw, mods, span, shut, MASK, SCORE, ASCENDING: tl.constexpr = False):
    """The key tile a first pass visits ``i``-th, as a ``_masking.KeyTile``: max-first from ``tiles.kt_first``
    (``_masking.visit_tile``), or ``tiles.kt_lo + i`` with ``ASCENDING``; it is not loaded (``open`` False, dead from
    the start; ``shut`` counts them) when the block mask (``SCORE.blocks``) hides it from every row of the program's
    rows ``span`` (``_row_span``). Returns ``(key, shut)``."""
    if ASCENDING:
        kt = tiles.kt_lo + i
    else:
        kt = visit_tile(i, tiles.kt_lo, tiles.kt_hi, tiles.kt_first)
    tile_open = True
    if SCORE.blocks:
        tile_open = block_tile_live(mods, span[0], span[1], kt, rw.seqlen_k, SCORE, kv.offs_n.shape[0])
        shut += tl.where(tile_open, 0, 1)
    return key_tile(kt, span[0], rw.seqlen_q, rw.seqlen_k, MASK, rw.rows.shape[0], kv.offs_n.shape[0], tile_open), shut


@triton.jit
def walk_tile(bits, rank, i, wd, kv, rw, row_lo, MASK):
    """The key tile of the ``i``-th set bit of bitmap word ``wd`` (``_masking.word_bits``, ``live_tile``) as a
    ``_masking.KeyTile`` (open; ``row_lo`` the program's first row, ``_row_span``): the later passes' walk."""
    return key_tile(live_tile(bits, rank, i, wd), row_lo, rw.seqlen_q, rw.seqlen_k, MASK, rw.rows.shape[0],
                    kv.offs_n.shape[0])


@triton.jit
def mark_live(tiles, kt, live, walk):
    """Set the live bit ``live`` of key tile ``kt`` in the words a first pass builds in its visiting order
    (``_masking.mark_tile``; ``walk`` the state of ``_masking.walk_words``) and store the word; returns ``walk``."""
    word_c, word_lo, w_lo, word_hi, w_hi = walk
    w, word, word_c, word_lo, w_lo, word_hi, w_hi = mark_tile(kt, live, tiles.kt_first, word_c, word_lo, w_lo, word_hi,
                                                              w_hi)
    tl.store(tiles.live_base + w, word)
    return word_c, word_lo, w_lo, word_hi, w_hi


@triton.jit
def _row_span(rw):
    """``(row_lo, row_hi)``: the first and last row of the program's query tile inside its sequence (for
    ``_masking.block_tile_live``; ``row_hi < row_lo`` for a tile past the sequence end)."""
    return tl.min(rw.rows, 0), tl.minimum(tl.max(rw.rows, 0), rw.seqlen_q - 1)


@triton.jit
def softmax_rows(q, kv, rw, tiles, mods, scale, BIAS_KIND: tl.constexpr, MASK, SCORE, HAS_DROPOUT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """alpha == 1: one online-softmax pass. Returns ``(out, tau, tau_lo, lsum, nnz, n_valid, visits)``.

    The scores and the running max stay in the scores' own scale and each exponent is ``(s - m) log2(e)``: exact
    near the max (Sterbenz) and unchanged by a constant added to a row, where scaling the scores to base 2 first
    would round them at their own magnitude (and overflow beyond 2.4e38). ``tau = m + log(lsum)`` (the logsumexp)
    is returned as two floats, ``tau`` and its rounding residual ``tau_lo``.

    With sinks (``SCORE.has_sinks``) the sink logit (``mods``) starts the running max and the denominator (one more
    term, no value); a NaN or ``+inf`` sink makes every row NaN.
    """
    BLOCK_M: tl.constexpr = rw.rows.shape[0]
    BLOCK_DV: tl.constexpr = kv.dv_ok.shape[0]
    kt_lo, kt_hi, live_base = tiles.kt_lo, tiles.kt_hi, tiles.live_base
    sink = mods.sink
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    if SCORE.has_sinks:
        sink_bad = (sink != sink) | (sink == float("inf"))
        s_sink = tl.where(sink_bad, float("-inf"), sink)
        m = tl.zeros([BLOCK_M], tl.float32) + s_sink
        l_sum = l_sum + tl.where(s_sink > float("-inf"), 1.0, 0.0)
    n_valid = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    word = tl.zeros([], tl.int32)
    shut = tl.zeros([], tl.int32)
    span = _row_span(rw)
    # full tiles skip the per-score mask from head dim 128 on (sm_90: 241 -> 185 registers at head dim 128); at 64 the
    # two code paths take 125 -> 166 registers, one program per SM instead of two (docs/kernels.md, "Full tiles")
    FULL: tl.constexpr = kv.d_ok.shape[0] >= 128
    for i in range(0, kt_hi - kt_lo):
        # a key tile the block mask hides from every row is never loaded (its live bit stays 0)
        key, shut = open_tile(i, tiles, kv, rw, mods, span, shut, MASK, SCORE, True)
        kt = key.kt
        lane = kt % 32
        word = tl.where(lane == 0, 0, word)
        if key.open:
            cols = key.cols
            s = _score_tile(q, kv, rw, key, mods, scale, 1.0, BIAS_KIND, MASK, SCORE, DOT_PRECISION, None, FULL)
            s_max = tl.max(s, 1)
            n_valid += tl.sum((s > float("-inf")).to(tl.int32), 1)
            m_new = tl.maximum(m, s_max)
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            corr = tl.exp2((m - m_safe) * LOG2E)
            p = tl.exp2((s - m_safe[:, None]) * LOG2E)
            l_sum = l_sum * corr + tl.sum(p, 1)
            # the live bit from the row maxima: a CTA-wide max over BLOCK_M flags, not over every score
            word = word | (tl.max((s_max > float("-inf")).to(tl.int32), 0) << lane)
            tl.store(live_base + kt // 32, word)
            p, _ = _apply_dropout(p, p, rw, cols, HAS_DROPOUT)
            v = _value_tile(q, kv, key, rw.seqlen_k)
            acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        else:
            tl.store(live_base + kt // 32, word)
    valid = n_valid > 0
    l_safe = tl.where(valid, l_sum, 1.0)
    out = acc / l_safe[:, None]
    tau, tau_lo = two_sum(tl.where(valid, m, 0.0), tl.log2(l_safe) * LN2)
    tau = tl.where(valid, tau, float("inf"))
    tau_lo = tl.where(valid, tau_lo, 0.0)
    lsum = tl.where(valid, 1.0, 0.0)
    if SCORE.has_sinks:
        out = tl.where(sink_bad, float("nan"), out)
        tau = tl.where(sink_bad, float("nan"), tau)
        lsum = tl.where(sink_bad, float("nan"), lsum)
    return out, tau, tau_lo, lsum, n_valid, n_valid, kt_hi - kt_lo - shut


@triton.jit
def _value_pass(q, kv, rw, tiles, mods, vp, POW: tl.constexpr, BIAS_KIND: tl.constexpr, MASK, SCORE,
                HAS_DROPOUT: tl.constexpr, WITH_P: tl.constexpr, WITH_U: tl.constexpr, HALF_P: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """One pass over the live tiles at the thresholds ``t_use`` (``vp = (t_use, lo_kill, beta, z_scale, am1, ref,
    visits)``; thresholds and scores relative to the rows' reference scores ``ref``):
    with ``WITH_P`` ``acc = sum_j p_ij v_j``,
    ``l_sum = sum_j p_ij``, ``nnz`` and the bitmap's words rewritten (tiles with no score above ``lo_kill`` die);
    with ``WITH_U`` ``acc_u = sum_j U_ij v_j`` and ``u_sum = sum_j U_ij`` (``_weights_and_u``). Returns
    ``(acc, l_sum, nnz, acc_u, u_sum, visits)`` (``visits`` counts on the key tiles loaded), the accumulators not asked
    for zero. ``HALF_P``: the weights are rounded to 16 bits for the value product, so ``_threshold.weights`` may take
    the fast log2."""
    BLOCK_M: tl.constexpr = rw.rows.shape[0]
    BLOCK_DV: tl.constexpr = kv.dv_ok.shape[0]
    t_use, lo_kill, beta, z_scale, am1, ref, visits = vp
    live_base = tiles.live_base
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    nnz = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    u_sum = tl.zeros([BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    row_lo = _row_span(rw)[0]
    for wd in range(0, tiles.n_words):
        word = tl.load(live_base + wd)
        new_word = tl.zeros([], tl.int32)
        if word != 0:
            bits, rank, n_set = word_bits(word)
            for i in range(0, n_set):
                key = walk_tile(bits, rank, i, wd, kv, rw, row_lo, MASK)
                kt = key.kt
                cols = key.cols
                # full tiles skip the per-score mask but in the general class's training forward (its head-dim-128
                # build would spill more inside its loops: 6 -> 8 accesses under triton 3.6, 6 -> 30 under 3.9;
                # docs/kernels.md, "Full tiles" and "General alpha: cheaper weights")
                z = _score_tile(q, kv, rw, key, mods, z_scale, am1, BIAS_KIND, MASK, SCORE, DOT_PRECISION, ref,
                                POW != 0 or not WITH_U)
                p, u = _weights_and_u(z, t_use, POW, beta, HALF_P, WITH_U)
                if WITH_P:
                    # one max per score (not a compare, a select and a max): the row maxima decide
                    live = tl.max((tl.max(z, 1) > lo_kill).to(tl.int32), 0)
                    new_word = new_word | (live << (kt - wd * 32))
                    l_sum += tl.sum(p, 1)
                    nnz += tl.sum((p > 0.0).to(tl.int32), 1)
                if WITH_U:
                    u_sum += tl.sum(u, 1)
                p, u = _apply_dropout(p, u, rw, cols, HAS_DROPOUT)
                v = _value_tile(q, kv, key, rw.seqlen_k)
                if WITH_P:
                    acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                if WITH_U:
                    acc_u += tl.dot(u.to(v.dtype), v, input_precision=DOT_PRECISION)
                visits += 1
        if WITH_P:
            tl.store(live_base + wd, new_word)
    return acc, l_sum, nnz, acc_u, u_sum, visits


@triton.jit
def points_pass(q, kv, rw, mods, pts, acc, st, POW: tl.constexpr, NPTS: tl.constexpr, LANES: tl.constexpr,
                COUNT: tl.constexpr, BIAS_KIND: tl.constexpr, MASK, SCORE, DOT_PRECISION: tl.constexpr):
    """One pass over the live tiles adding the point sums of every score tile at the points ``pts`` to ``acc``
    (``_threshold_tiles.cand_sums`` with ``NPTS`` points, per-lane partials with ``LANES``), then the sink's with
    ``SCORE.has_sinks``; the bitmap's words are rewritten: a tile with no score above ``lo_kill`` dies. The candidate
    passes of the fused forward and the bracket and refinement passes of the split forward (``_fwd_split.py``).

    ``st = (ref, z_scale, am1, bm1, lo_kill, tiles, zs, visits)``: the sums are of ``z - ref`` (``[BLOCK_M]``, the
    rows' reference scores, ``_masking.score_mod``), the points and ``lo_kill`` relative to it; ``zs`` the sink's
    virtual score tile (``_sink_scores``, absolute). ``COUNT`` (constexpr) counts the keys above each point at alpha
    1.5 (``cand_sums``; at alpha 2 the count is ``g``, which ``cand_bracket`` reads). Returns ``(acc, visits)``,
    ``visits`` counting the key tiles loaded."""
    ref, z_scale, am1, bm1, lo_kill, tiles, zs, visits = st
    row_lo = _row_span(rw)[0]
    for wd in range(0, tiles.n_words):
        # a word with no live tile has n_set 0
        bits, rank, n_set = word_bits(tl.load(tiles.live_base + wd))
        new_word = tl.zeros([], tl.int32)
        for i in range(0, n_set):
            key = walk_tile(bits, rank, i, wd, kv, rw, row_lo, MASK)
            z = _score_tile(q, kv, rw, key, mods, z_scale, am1, BIAS_KIND, MASK, SCORE, DOT_PRECISION, ref)
            new_word = new_word | (tl.max((tl.max(z, 1) > lo_kill).to(tl.int32), 0) << (key.kt - wd * 32))
            acc = cand_sums(z, pts, acc, POW, NPTS, bm1, LANES, COUNT)
            visits += 1
        tl.store(tiles.live_base + wd, new_word)
    if SCORE.has_sinks:
        acc = cand_sums(zs - ref[:, None], pts, acc, POW, NPTS, bm1, LANES, COUNT)
    tl.debug_barrier()
    return acc, visits


@triton.jit
def value_rows(q, kv, rw, tiles, mods, vr, POW: tl.constexpr, BIAS_KIND: tl.constexpr, MASK, SCORE,
               HAS_DROPOUT: tl.constexpr, NEED_OUT_U: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """alpha in (1, 2]: the value pass over the live tiles at a known threshold and the rows' results, for the fused
    forward (``entmax_rows``) and the split forward's value kernel (``_fwd_split.py``).

    ``vr = (tau, lo_kill, alpha, z_scale, ref, valid, bad, n_passes, visits)``: ``tau`` the threshold relative to the
    rows' reference scores ``ref`` (the weights use ``tau + shift``, shift 1 on the general path POW 0, formed from it
    exactly as the backward forms it), ``lo_kill`` the certified lower bound below which a tile dies (never above
    ``tau``, relative to ``ref`` too), the rows' valid-key flags and NaN / +inf flags, and the passes and tile visits
    so far. Returns ``(out, out_u, tau, tau_lo, lsum, nnz, n_passes, visits)`` as ``entmax_rows`` returns them
    (``tau + tau_lo = ref + tau`` exactly; ``out_u`` is ``out`` without ``NEED_OUT_U``; the sink, with
    ``SCORE.has_sinks``, adds its weight to ``lsum`` and ``sum_j U_ij``).
    """
    tau_saved, lo_kill, alpha, z_scale, ref, valid, bad, n_passes, visits = vr
    am1 = alpha - 1.0
    beta = 1.0 / am1
    if POW == 0:
        shift = 1.0
    else:
        shift = 0.0
    t_use = tau_saved + shift  # the backward forms the same threshold from the saved tau
    # weights rounded to 16 bits for the value product take the fast log2 (_threshold.weights); not in the training
    # forward, where it makes the general class spill (48-176 bytes under triton 3.6)
    V_DTYPE: tl.constexpr = (kv.v_base.dtype if isinstance(kv.v_base, tl.tensor_descriptor)
                             else kv.v_base.dtype.element_ty)
    HALF_P: tl.constexpr = (V_DTYPE != tl.float32) and not NEED_OUT_U
    # with two head-dim-256 accumulators the training forward spills inside its loops (docs/kernels.md): there the
    # value pass runs twice, out first, then out_u over the tiles still live (the same sums: dead tiles add zeros)
    SPLIT_U: tl.constexpr = NEED_OUT_U and kv.dv_ok.shape[0] > 128
    vp = (t_use, lo_kill, beta, z_scale, am1, ref, visits)
    if HALF_P and POW == 0:
        # the fast log2 rounds 1 + w to float32 first: about 2.3e-7 * beta relative error per weight, kept under an
        # eighth of float16's rounding only up to FAST_BETA_MAX (near alpha = 1, beta reaches 2**23)
        if beta <= FAST_BETA_MAX:
            acc, l_sum, nnz, acc_u, u_sum, visits = _value_pass(
                q, kv, rw, tiles, mods, vp, POW, BIAS_KIND, MASK, SCORE, HAS_DROPOUT, True, False, True, DOT_PRECISION)
        else:
            acc, l_sum, nnz, acc_u, u_sum, visits = _value_pass(
                q, kv, rw, tiles, mods, vp, POW, BIAS_KIND, MASK, SCORE, HAS_DROPOUT, True, False, False,
                DOT_PRECISION)
    else:
        acc, l_sum, nnz, acc_u, u_sum, visits = _value_pass(
            q, kv, rw, tiles, mods, vp, POW, BIAS_KIND, MASK, SCORE, HAS_DROPOUT, True, NEED_OUT_U and not SPLIT_U,
            False, DOT_PRECISION)
    if SPLIT_U:
        n_passes += 1
        _, _, _, acc_u, u_sum, visits = _value_pass(
            q, kv, rw, tiles, mods, (t_use, lo_kill, beta, z_scale, am1, ref, visits), POW, BIAS_KIND, MASK, SCORE,
            HAS_DROPOUT, False, True, False, DOT_PRECISION)
    if SCORE.has_sinks:
        zs = _sink_scores(mods, am1, rw.rows.shape[0], kv.offs_n.shape[0]) - ref[:, None]
        p_s, u_s = _weights_and_u(zs, t_use, POW, beta, False, NEED_OUT_U)
        l_sum += tl.sum(p_s, 1)
        if NEED_OUT_U:
            u_sum += tl.sum(u_s, 1)
    n_passes += 1
    ok = valid & (l_sum > 0.0)
    l_safe = tl.where(ok, l_sum, 1.0)
    is_bad = bad != 0
    out = tl.where(ok[:, None], acc / l_safe[:, None], 0.0)
    out = tl.where(is_bad[:, None], float("nan"), out)
    out_u = out
    if NEED_OUT_U:
        u_ok = ok & (u_sum > 0.0)
        out_u = tl.where(u_ok[:, None], acc_u / tl.where(u_ok, u_sum, 1.0)[:, None], 0.0)
        out_u = tl.where(is_bad[:, None], float("nan"), out_u)
    tau, tau_lo = two_sum(ref, tau_saved)
    tau = tl.where(is_bad, float("nan"), tl.where(ok, tau, float("inf")))
    tau_lo = tl.where(ok & (is_bad == 0), tau_lo, 0.0)
    l_out = tl.where(is_bad, float("nan"), tl.where(ok, l_sum, 0.0))
    return out, out_u, tau, tau_lo, l_out, tl.where(ok, nnz, 0), n_passes, visits


@triton.jit
def _sink_scores(mods, am1, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The sink's virtual score tile in the z-scale (``_masking.sink_tile``), ``-inf`` for a NaN or ``+inf`` sink
    (those rows are flagged bad). [BLOCK_M, BLOCK_N]"""
    z_sink = am1 * mods.sink
    return sink_tile(tl.where((z_sink != z_sink) | (z_sink == float("inf")), float("-inf"), z_sink), BLOCK_M, BLOCK_N)
