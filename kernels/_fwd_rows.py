"""The fused forward's work on one query tile (``kernels/entmax_attn_fwd.py`` launches it): score tiles, the
online-softmax pass at alpha = 1 and, for alpha in (1, 2], the grid pass, the candidate passes and the value pass
(the module docstring of ``entmax_attn_fwd`` and docs/kernels.md describe them).
"""

import triton
import triton.language as tl

from ._common import LN2, LOG2E, dropout_keep, load_rows
from ._masking import live_tile, mark_tile, mask_scores, sink_tile, soft_cap, visit_tile, walk_words, word_bits
from ._threshold import (
    cand_bracket,
    cand_points,
    cand_sums,
    grid_bracket,
    grid_start,
    grid_sums,
    grid_tile,
    log_ref,
    lowest_point,
    more_passes,
    pick_bracket,
    point_zeros,
    solve,
    weights,
    width_done,
)


@triton.jit
def _score_tile(q, k_base, bias_base, rows, cols, seqlen_q, seqlen_k, stride_kn, stride_kd, stride_bias_m,
                stride_bias_n, z_scale, bias_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BIAS_KIND: tl.constexpr, MASK, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, slope, SCORE):
    """Scores ``z_scale * q.k`` (soft-capped in the same scale) ``+ bias_scale * (bias - slope * |d|)`` of one
    tile, ``-inf`` where masked (``kernels/_masking.py``). [BLOCK_M, BLOCK_N]"""
    offs_d = tl.arange(0, BLOCK_D)
    k_ptrs = k_base + cols.to(tl.int64)[None, :] * stride_kn + offs_d.to(tl.int64)[:, None] * stride_kd
    k = tl.load(k_ptrs, mask=(cols[None, :] < seqlen_k) & (offs_d[:, None] < HEAD_DIM), other=0.0)  # [BLOCK_D, BLOCK_N]
    if UPCAST:
        k = k.to(tl.float32)
    z = soft_cap(tl.dot(q, k, input_precision=DOT_PRECISION) * z_scale, SCORE[1] * bias_scale, SCORE)
    return mask_scores(z, rows, cols, seqlen_q, seqlen_k, bias_base, stride_bias_m, stride_bias_n, bias_scale, MASK,
                       BIAS_KIND, slope, SCORE)


@triton.jit
def _value_tile(v_base, cols, seqlen_k, stride_vn, stride_vd, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                UPCAST: tl.constexpr):
    """Value rows of one key tile (``HEAD_DIM``, ``BLOCK_D``: the value head dim and its block). [BLOCK_N, BLOCK_D]"""
    offs_d = tl.arange(0, BLOCK_D)
    return load_rows(v_base, cols, offs_d, stride_vn, stride_vd, cols < seqlen_k, offs_d < HEAD_DIM, UPCAST)


@triton.jit
def _apply_dropout(p, u, seed, bh, rows_global, cols_global, total_k, dropout_p, inv_keep, HAS_DROPOUT: tl.constexpr):
    """Weights ``p`` and ``u`` after one dropout draw (kept ones scaled by ``inv_keep``). [BLOCK_M, BLOCK_N] each"""
    if HAS_DROPOUT:
        keep = dropout_keep(seed, bh, rows_global, cols_global, total_k, dropout_p)
        p = tl.where(keep, p * inv_keep, 0.0)
        u = tl.where(keep, u * inv_keep, 0.0)
    return p, u


@triton.jit
def _u_weights(z, t, p, POW: tl.constexpr):
    """``U = [z - tau]_+^(beta - 1)`` next to the value pass weights ``p = [z - tau]_+^beta`` at the thresholds ``t``
    (``_threshold.weights``). [BLOCK_M, BLOCK_N]

    The general path divides ``p`` by ``r = 1 + (z - t)``: exact near the threshold (Sterbenz), one rounding near
    alpha = 1, and no second ``log2`` / ``exp2`` per score.
    """
    if POW == 1:
        u = tl.where(z > t[:, None], 1.0, 0.0)
    elif POW == 2:
        u = tl.maximum(z - t[:, None], 0.0)
    else:
        r = 1.0 + (z - t[:, None])
        pos = r > 0.0
        u = tl.where(pos, p / tl.where(pos, r, 1.0), 0.0)
    return u


@triton.jit
def _tile_screen(z, t_low):
    """Screen a score tile ``z`` of the grid pass with two row reductions, before any per-score bookkeeping.
    Returns ``(code, n_fast)``: ``code`` (CTA-wide int32) is 0 when the tile is dead and plain (the grid pass
    skips it: ``grid_tile`` would change nothing), 1 when some row has a score above its ``t_low``, 2 or more when
    some row holds a non-finite score and is not all ``-inf`` (then the tile gets the exact per-score NaN/+inf flags
    and valid-key counts); ``n_fast`` the rows' valid-key counts when ``code < 2``.

    Exact: a finite row sum means every score of the row is finite (``BLOCK_N`` valid keys, no NaN or +inf; an
    overflowing sum only sends the tile the exact way); a row sum and a row max both ``-inf`` mean every score is
    ``-inf`` (none valid; a NaN would make the sum NaN, a +inf the max). A dead plain tile cannot raise a row max
    (its max is <= ``t_low`` < ``m``, or ``-inf`` with ``m``), so the ring, the max and the live bit (0) are those
    ``grid_tile`` would give.
    """
    z_max = tl.max(z, 1)
    z_sum = tl.sum(z, 1)
    plain = (tl.abs(z_sum) < float("inf")) | ((z_sum == float("-inf")) & (z_max == float("-inf")))
    code = tl.max(tl.where(plain, tl.where(z_max > t_low, 1, 0), 2), 0)
    return code, tl.where(z_max > float("-inf"), z.shape[1], 0)


@triton.jit
def softmax_rows(q, k_base, v_base, bias_base, rows, seqlen_q, seqlen_k, kt_lo, kt_hi,
                  live_base, scale, seed, bh, q_start, k_start, total_k, dropout_p, inv_keep,
                  stride_kn, stride_kd, stride_vn, stride_vd, stride_bias_m, stride_bias_n,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BIAS_KIND: tl.constexpr, MASK,
                  HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, slope, SCORE,
                  HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, sink):
    """alpha == 1: one online-softmax pass (base-2 exponentials). Returns ``(out, tau, lsum, nnz, n_valid, visits)``.

    With sinks (``SCORE[3]``) the sink logit ``sink`` starts the running max and the denominator (one more term,
    no value); a NaN or ``+inf`` sink makes every row NaN.
    """
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    if SCORE[3]:
        sink_bad = (sink != sink) | (sink == float("inf"))
        s_sink = tl.where(sink_bad, float("-inf"), sink * LOG2E)
        m = tl.zeros([BLOCK_M], tl.float32) + s_sink
        l_sum = l_sum + tl.where(s_sink > float("-inf"), 1.0, 0.0)
    n_valid = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    word = tl.zeros([], tl.int32)
    for kt in range(kt_lo, kt_hi):
        cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        s = _score_tile(q, k_base, bias_base, rows, cols, seqlen_q, seqlen_k,
                        stride_kn, stride_kd, stride_bias_m, stride_bias_n, scale * LOG2E, LOG2E,
                        HEAD_DIM, BLOCK_D, BIAS_KIND, MASK, UPCAST, DOT_PRECISION, slope, SCORE)
        ok = s > float("-inf")
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        corr = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_sum = l_sum * corr + tl.sum(p, 1)
        n_valid += tl.sum(ok.to(tl.int32), 1)
        lane = kt % 32
        word = tl.where(lane == 0, 0, word) | (tl.max(ok.to(tl.int32)) << lane)
        tl.store(live_base + kt // 32, word)
        p, _ = _apply_dropout(p, p, seed, bh, q_start + rows, k_start + cols, total_k, dropout_p, inv_keep,
                              HAS_DROPOUT)
        v = _value_tile(v_base, cols, seqlen_k, stride_vn, stride_vd, HEAD_DIM_V, BLOCK_DV, UPCAST)
        acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    valid = n_valid > 0
    l_safe = tl.where(valid, l_sum, 1.0)
    out = acc / l_safe[:, None]
    tau = tl.where(valid, (m + tl.log2(l_safe)) * LN2, float("inf"))
    lsum = tl.where(valid, 1.0, 0.0)
    if SCORE[3]:
        out = tl.where(sink_bad, float("nan"), out)
        tau = tl.where(sink_bad, float("nan"), tau)
        lsum = tl.where(sink_bad, float("nan"), lsum)
    return out, tau, lsum, n_valid, n_valid, kt_hi - kt_lo


@triton.jit
def _value_pass(q, k_base, v_base, bias_base, rows, seqlen_q, seqlen_k, n_words, live_base, t_use, lo_kill, beta,
                z_scale, am1, seed, bh, q_start, k_start, total_k, dropout_p, inv_keep, stride_kn, stride_kd, stride_vn,
                stride_vd, stride_bias_m, stride_bias_n, visits, POW: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BIAS_KIND: tl.constexpr, MASK,
                HAS_DROPOUT: tl.constexpr, WITH_P: tl.constexpr, WITH_U: tl.constexpr, HALF_P: tl.constexpr,
                UPCAST: tl.constexpr,
                DOT_PRECISION: tl.constexpr, slope, SCORE, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One pass over the live tiles at the thresholds ``t_use``: with ``WITH_P`` ``acc = sum_j p_ij v_j``,
    ``l_sum = sum_j p_ij``, ``nnz`` and the bitmap's words rewritten (tiles with no score above ``lo_kill`` die);
    with ``WITH_U`` ``acc_u = sum_j U_ij v_j`` and ``u_sum = sum_j U_ij`` (``_u_weights``). Returns
    ``(acc, l_sum, nnz, acc_u, u_sum, visits)``, the accumulators not asked for zero. ``HALF_P``: the weights are
    rounded to 16 bits for the value product, so ``_threshold.weights`` may take the fast log2."""
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    nnz = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    u_sum = tl.zeros([BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for wd in range(0, n_words):
        word = tl.load(live_base + wd)
        new_word = tl.zeros([], tl.int32)
        if word != 0:
            bits, rank, n_set = word_bits(word)
            for i in range(0, n_set):
                kt = live_tile(bits, rank, i, wd)
                cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
                z = _score_tile(q, k_base, bias_base, rows, cols, seqlen_q, seqlen_k,
                                stride_kn, stride_kd, stride_bias_m, stride_bias_n, z_scale, am1,
                                HEAD_DIM, BLOCK_D, BIAS_KIND, MASK, UPCAST, DOT_PRECISION, slope, SCORE)
                p = weights(z, t_use, POW, beta, HALF_P)
                if WITH_P:
                    live = tl.max((z > lo_kill[:, None]).to(tl.int32))
                    new_word = new_word | (live << (kt - wd * 32))
                    l_sum += tl.sum(p, 1)
                    nnz += tl.sum((p > 0.0).to(tl.int32), 1)
                u = p
                if WITH_U:
                    u = _u_weights(z, t_use, p, POW)
                    u_sum += tl.sum(u, 1)
                p, u = _apply_dropout(p, u, seed, bh, q_start + rows, k_start + cols, total_k, dropout_p,
                                      inv_keep, HAS_DROPOUT)
                v = _value_tile(v_base, cols, seqlen_k, stride_vn, stride_vd, HEAD_DIM_V, BLOCK_DV, UPCAST)
                if WITH_P:
                    acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                if WITH_U:
                    acc_u += tl.dot(u.to(v.dtype), v, input_precision=DOT_PRECISION)
                visits += 1
        if WITH_P:
            tl.store(live_base + wd, new_word)
    return acc, l_sum, nnz, acc_u, u_sum, visits


@triton.jit
def entmax_rows(q, k_base, v_base, bias_base, rows, seqlen_q, seqlen_k, kt_lo, kt_hi, kt_first,
                 n_words, live_base, scale, alpha, tol, max_passes, seed, bh, q_start, k_start, total_k,
                 dropout_p, inv_keep,
                 stride_kn, stride_kd, stride_vn, stride_vd, stride_bias_m, stride_bias_n,
                 POW: tl.constexpr, GRID_K: tl.constexpr, CAND_P: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, BIAS_KIND: tl.constexpr, MASK,
                 HAS_DROPOUT: tl.constexpr, NEED_OUT_U: tl.constexpr, UPCAST: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, slope, SCORE, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                 sink):
    """alpha in (1, 2]: grid pass, candidate passes, value pass (module docstring).

    Returns ``(out, out_u, tau, lsum, nnz, n_valid, n_passes, visits)``. Thresholds are carried as
    ``theta = tau + shift`` (shift 1 on the general path POW 0, see kernels/_threshold.py). With ``NEED_OUT_U``
    the value pass also accumulates ``sum_j U_ij v_j`` and ``sum_j U_ij`` (``U = p^(2 - alpha)`` up to a row
    factor, dropout applied to the first): ``out_u`` is their ratio, from which the backward's ``delta`` is
    ``dO . out_u`` (docs/backward.md); otherwise ``out_u`` is ``out``.

    With sinks (``SCORE[3]``) the sink is one more score per row, ``(alpha - 1) * sink`` in the z-scale, held by a
    virtual tile (``_masking.sink_tile``): it enters the running max and the grid sums before the real tiles, the
    point sums of every candidate pass and ``lsum`` (and ``sum_j U_ij``) of the value pass, but no output, support
    count, valid-key count or liveness bit. A NaN or ``+inf`` sink makes every row NaN.

    The grid pass visits the key tiles max-first, from ``kt_first`` (``_masking.max_first_tile``: the diagonal tile
    when causal, else the diagonal / window centre, ascending for unstructured cross-attention) outward
    (``_masking.visit_tile``), so that the running max is final before the far tiles are seen. The ring is exact in
    any order and a tile is skipped only below the current lowest point, which only rises. More tiles die in the
    grid pass; the valid-key counts, the NaN/+inf rows and (on finite scores) the final live set are those of the
    ascending order, but the grid sums are added in another order: outputs and thresholds are not bitwise those of
    the ascending order (they stay within the certified brackets and the usual tolerances). A tile
    that is dead and plain when visited (``_tile_screen``: two row reductions and one CTA-wide compare) skips the
    per-score NaN/+inf flags, the valid-key counts and ``grid_tile``; its valid-key counts come from the row max.
    """
    am1 = alpha - 1.0
    beta = 1.0 / am1
    bm1 = beta - 1.0
    z_scale = scale * am1
    if POW == 0:
        shift = 1.0
    else:
        shift = 0.0
    # point sums per lane of the quad that holds a row (_threshold.row_sums: one lane reduction per pass, not per
    # tile) where the registers allow it and it pays (sass_cost, sm90_build); else reduced on every tile (LANES 0)
    if POW == 2:
        LANES: tl.constexpr = 4
        CAND_LANES: tl.constexpr = 4
    elif POW == 1:
        LANES: tl.constexpr = 0
        CAND_LANES: tl.constexpr = 4
    else:
        LANES: tl.constexpr = 0
        CAND_LANES: tl.constexpr = 0

    # ---- pass 1: max, valid keys, NaN/+inf rows, and f, g, c at GRID_K absolute points below the running max
    w_grid, slot, m, j_top, n_valid, bad, F, G, L = grid_start(BLOCK_M, GRID_K, LANES)
    z_sink = am1 * sink
    sink_bad = (z_sink != z_sink) | (z_sink == float("inf"))
    zs = sink_tile(tl.where(sink_bad, float("-inf"), z_sink), BLOCK_M, BLOCK_N)
    if SCORE[3]:
        bad = bad | sink_bad.to(tl.int32)
        m, j_top, F, G, L, _ = grid_tile(zs, m, j_top, F, G, L, slot, w_grid, shift, beta, bm1, POW, GRID_K, LANES)
    # max-first order (_masking.max_first_tile): the diagonal / window centre first, then outward; a tile that is
    # dead and plain when visited (_tile_screen) costs its score product and two row reductions
    t_low = lowest_point(j_top, w_grid, GRID_K)
    word_c, word_lo, w_lo, word_hi, w_hi = walk_words()
    for i in range(0, kt_hi - kt_lo):
        kt = visit_tile(i, kt_lo, kt_hi, kt_first)
        cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        z = _score_tile(q, k_base, bias_base, rows, cols, seqlen_q, seqlen_k,
                        stride_kn, stride_kd, stride_bias_m, stride_bias_n, z_scale, am1,
                        HEAD_DIM, BLOCK_D, BIAS_KIND, MASK, UPCAST, DOT_PRECISION, slope, SCORE)
        code, n_fast = _tile_screen(z, t_low)
        if code > 1:
            bad = bad | tl.max(((z != z) | (z == float("inf"))).to(tl.int32), 1)
            n_valid += tl.sum((z > float("-inf")).to(tl.int32), 1)
        else:
            n_valid += n_fast
        live = tl.zeros([], tl.int32)
        if code != 0:
            m, j_top, F, G, L, live = grid_tile(z, m, j_top, F, G, L, slot, w_grid, shift, beta, bm1, POW, GRID_K,
                                                LANES)
            t_low = lowest_point(j_top, w_grid, GRID_K)
        w, word, word_c, word_lo, w_lo, word_hi, w_hi = mark_tile(kt, live, kt_first, word_c, word_lo, w_lo, word_hi,
                                                                  w_hi)
        tl.store(live_base + w, word)
    tl.debug_barrier()
    F, G = grid_sums(F, G, LANES)
    n_passes = tl.full([], 1, tl.int32)
    visits = kt_hi - kt_lo

    # ---- bracket from the grid: the lowest point has phi >= 0 in exact arithmetic; the row max closes it
    valid = n_valid > 0
    usable = valid & (bad == 0)
    m = tl.where(usable, m, 0.0)
    j_top = tl.where(usable, j_top, 0.0)
    # beyond 2**22 grid steps fp32 cannot index the grid: those rows start from [m - 1, m] with phi(m - 1) >= 0
    # unknown (NaN: bisect)
    grid_ok = tl.abs(j_top) < 4194304.0
    zero = tl.zeros([BLOCK_M], tl.float32)
    br = grid_bracket(m, j_top, grid_ok, F, G, L, slot, w_grid, shift, am1, POW, GRID_K)
    est, lo, hi, exact = solve(br, POW)
    done = width_done(exact, lo, hi, usable, tol)

    # ---- candidate passes over the live tiles while a row of the tile is not pinned down
    go = more_passes(done, n_passes, max_passes)
    while go:
        lo_kill = lo - shift
        if CAND_P == 1:
            t_1 = est
            l_1 = log_ref(m, t_1)
            f1 = point_zeros(BLOCK_M, 0, CAND_LANES)
            g1 = point_zeros(BLOCK_M, 0, CAND_LANES)
            c1 = point_zeros(BLOCK_M, 0, CAND_LANES)
            t_p = zero  # the multi-point accumulators are unused with one point
            l_p = zero
            cand = zero
            FP = zero
            GP = zero
            CP = zero
        else:
            t_1 = zero  # the one-point accumulators are unused with several points
            l_1 = zero
            f1 = zero
            g1 = zero
            c1 = zero
            cand = tl.arange(0, CAND_P).to(tl.float32)
            t_p, l_p = cand_points(m, lo, hi, CAND_P)  # [BLOCK_M, CAND_P]
            FP = point_zeros(BLOCK_M, CAND_P, CAND_LANES)
            GP = point_zeros(BLOCK_M, CAND_P, CAND_LANES)
            CP = point_zeros(BLOCK_M, CAND_P, CAND_LANES)
        for wd in range(0, n_words):
            word = tl.load(live_base + wd)
            new_word = tl.zeros([], tl.int32)
            if word != 0:
                bits, rank, n_set = word_bits(word)
                for i in range(0, n_set):
                    kt = live_tile(bits, rank, i, wd)
                    cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
                    z = _score_tile(q, k_base, bias_base, rows, cols, seqlen_q, seqlen_k,
                                    stride_kn, stride_kd, stride_bias_m, stride_bias_n, z_scale, am1,
                                    HEAD_DIM, BLOCK_D, BIAS_KIND, MASK, UPCAST, DOT_PRECISION, slope, SCORE)
                    live = tl.max((z > lo_kill[:, None]).to(tl.int32))
                    new_word = new_word | (live << (kt - wd * 32))
                    f1, g1, c1, FP, GP, CP = cand_sums(z, t_1, l_1, f1, g1, c1, t_p, l_p, cand, FP, GP, CP, POW,
                                                       CAND_P, bm1, CAND_LANES)
                    visits += 1
            tl.store(live_base + wd, new_word)
        if SCORE[3]:
            f1, g1, c1, FP, GP, CP = cand_sums(zs, t_1, l_1, f1, g1, c1, t_p, l_p, cand, FP, GP, CP, POW, CAND_P,
                                               bm1, CAND_LANES)
        tl.debug_barrier()
        act = done == 0
        br = pick_bracket(act, cand_bracket(br, t_1, l_1, f1, g1, c1, t_p, l_p, cand, FP, GP, CP, am1, POW, CAND_P,
                                            CAND_LANES), br)
        n_est, n_lo, n_hi, n_exact = solve(br, POW)
        lo = tl.where(act, tl.maximum(lo, n_lo), lo)
        hi = tl.where(act, tl.minimum(hi, n_hi), hi)
        lo = tl.minimum(lo, hi)
        est = tl.minimum(tl.maximum(tl.where(act, n_est, est), lo), hi)
        exact = tl.where(act, n_exact, exact)
        n_passes += 1
        done = width_done(exact, lo, hi, usable, tol)
        go = more_passes(done, n_passes, max_passes)

    # ---- value pass at the estimate; tiles die only below the certified lower bound
    # a threshold at the max would leave no weight: keep it one rounding step below (one-hot on the max key)
    tau_lim = m - tl.maximum(tl.abs(m) * 2.4e-7, 1e-15) + shift
    t_use = tl.where(usable, tl.minimum(est, tau_lim), 0.0)
    tau_saved = t_use - shift
    t_use = tau_saved + shift  # the backward forms the same threshold from the saved tau
    lo_kill = tl.minimum(lo, t_use) - shift
    # weights rounded to 16 bits for the value product take the fast log2 (_threshold.weights); not in the training
    # forward, where it makes the general class spill (48-176 bytes under triton 3.6)
    HALF_P: tl.constexpr = (v_base.dtype.element_ty != tl.float32) and not NEED_OUT_U
    # with two head-dim-256 accumulators the training forward spills inside its loops (docs/kernels.md): there the
    # value pass runs twice, out first, then out_u over the tiles still live (the same sums: dead tiles add zeros)
    SPLIT_U: tl.constexpr = NEED_OUT_U and BLOCK_DV > 128
    acc, l_sum, nnz, acc_u, u_sum, visits = _value_pass(
        q, k_base, v_base, bias_base, rows, seqlen_q, seqlen_k, n_words, live_base, t_use, lo_kill, beta, z_scale, am1,
        seed, bh, q_start, k_start, total_k, dropout_p, inv_keep, stride_kn, stride_kd, stride_vn, stride_vd,
        stride_bias_m, stride_bias_n, visits, POW, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, BIAS_KIND, MASK, HAS_DROPOUT,
        True, NEED_OUT_U and not SPLIT_U, HALF_P, UPCAST, DOT_PRECISION, slope, SCORE, HEAD_DIM_V, BLOCK_DV)
    if SPLIT_U:
        n_passes += 1
        _, _, _, acc_u, u_sum, visits = _value_pass(
            q, k_base, v_base, bias_base, rows, seqlen_q, seqlen_k, n_words, live_base, t_use, lo_kill, beta, z_scale,
            am1, seed, bh, q_start, k_start, total_k, dropout_p, inv_keep, stride_kn, stride_kd, stride_vn, stride_vd,
            stride_bias_m, stride_bias_n, visits, POW, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, BIAS_KIND, MASK,
            HAS_DROPOUT, False, True, HALF_P, UPCAST, DOT_PRECISION, slope, SCORE, HEAD_DIM_V, BLOCK_DV)
    if SCORE[3]:
        p_s = weights(zs, t_use, POW, beta, HALF_P)
        l_sum += tl.sum(p_s, 1)
        if NEED_OUT_U:
            u_sum += tl.sum(_u_weights(zs, t_use, p_s, POW), 1)
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
    tau = tl.where(is_bad, float("nan"), tl.where(ok, tau_saved, float("inf")))
    l_out = tl.where(is_bad, float("nan"), tl.where(ok, l_sum, 0.0))
    return out, out_u, tau, l_out, tl.where(ok, nnz, 0), n_valid, n_passes, visits
