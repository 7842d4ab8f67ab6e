"""The split forward of alpha-entmax attention for alpha in (1, 2]: a threshold kernel, then a value kernel that knows
the threshold (design (b) of docs/kernels.md, "Design study: threshold passes").

The threshold kernel holds no output accumulator. Per query tile it runs

1. a **max pass** over the visible key tiles, max-first (``_masking.max_first_tile``): the row max ``m``, the valid-key
   counts, the NaN / +inf rows, and the live bit of each tile (some score above the running max minus 1 when the
   tile is visited: a tile below it is dead for good, since ``tau >= m - 1``);
2. a **bracket pass** over the live tiles: ``f``, ``g`` (and the key counts at alpha 1.5 and 2) at ``SPLIT_POINTS``
   points spread over the certified ``[m - 1, m - n^(1 - alpha)]``, merged into a certified bracket
   (``_threshold.solve``);
3. **refinement passes** while a row of the tile is not pinned down: two points straddling the estimate (a tenth of
   the bracket or half the tolerance each side), so that the tangent and secant bounds from both ends close the
   bracket when the estimate is good.

Every threshold quantity is relative to the row max: the passes work with ``z - m`` and points in ``[-1, 0]`` (plus
the general path's shift 1), so the search is the same whatever the scores' magnitude. The value kernel reads ``m``,
the threshold and the certified lower bound, visits the live tiles once (no running max, no rescale), refines the
bitmap against the lower bound as the fused value pass does, and writes the outputs and statistics of
``entmax_attn_fwd`` (``EntmaxAttnFwdResult``); ``tau`` is ``m`` plus the relative threshold.

Between the two kernels, per row: ``m``, the relative threshold and lower bound in a float32 scratch ``(3, B, Hq, Nq)``
(slot 2 unused), the NaN / +inf flag in ``nnz``, the valid-key count in ``n_valid``; per query tile the passes and
visits so far in ``n_passes`` / ``tile_visits``. The softmax class (alpha = 1) keeps the fused kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import alpha_class_id, load_rows, slice_base, store_rows
from .._masking import (
    block_tile_live,
    key_tile_range,
    live_tile,
    mark_tile,
    max_first_tile,
    program_mods,
    seq_bounds,
    sink_tile,
    visit_tile,
    walk_words,
    word_bits,
)
from ._fwd_rows import KeyTiles, Rows, _apply_dropout, _row_span, _score_tile, _u_weights, _value_tile
from ._threshold import (
    Bracket,
    cand_bracket,
    cand_sums,
    log_ref,
    more_passes,
    open_bracket,
    pick_bracket,
    point_sums,
    point_zeros,
    solve,
    weights,
    width_done,
)

# points of the bracket pass (docs/kernels.md: 4 points and 2-point refinements model cheapest with one code shape)
SPLIT_POINTS = tl.constexpr(4)


@triton.jit
def _max_pass(q, kv, rw, mods, z_scale, am1, live_base, kt_lo, kt_hi, kt_first, zs, BIAS_KIND: tl.constexpr, MASK,
              SCORE, DOT_PRECISION: tl.constexpr):
    """Pass 1: ``(m, n_valid, bad, visits)`` and the live bits stored (a tile is live when some score lies above the
    running max minus 1, a few ulps lower, when it is visited)."""
    BLOCK_M: tl.constexpr = rw.rows.shape[0]
    BLOCK_N: tl.constexpr = kv.offs_n.shape[0]
    m = tl.max(zs, 1)
    n_valid = tl.zeros([BLOCK_M], tl.int32)
    bad = tl.zeros([BLOCK_M], tl.int32)
    word_c, word_lo, w_lo, word_hi, w_hi = walk_words()
    shut = tl.zeros([], tl.int32)
    if SCORE[4]:
        row_lo, row_hi = _row_span(rw)
    for i in range(0, kt_hi - kt_lo):
        kt = visit_tile(i, kt_lo, kt_hi, kt_first)
        live = tl.zeros([], tl.int32)
        tile_open = True
        if SCORE[4]:
            tile_open = block_tile_live(mods, row_lo, row_hi, kt, rw.seqlen_k, SCORE, BLOCK_N)
            shut += tl.where(tile_open, 0, 1)
        if tile_open:
            cols = kt * BLOCK_N + kv.offs_n
            z = _score_tile(q, kv, rw, cols, mods, z_scale, am1, BIAS_KIND, MASK, SCORE, DOT_PRECISION)
            z_max = tl.max(z, 1)
            z_sum = tl.sum(z, 1)
            # a finite row sum: every score finite; sum and max -inf: every score masked; else the exact flags
            plain = (tl.abs(z_sum) < float("inf")) | ((z_sum == float("-inf")) & (z_max == float("-inf")))
            if tl.min(plain.to(tl.int32), 0) == 0:
                bad = bad | tl.max(((z != z) | (z == float("inf"))).to(tl.int32), 1)
                n_valid += tl.sum((z > float("-inf")).to(tl.int32), 1)
            else:
                n_valid += tl.where(z_max > float("-inf"), BLOCK_N, 0)
            m = tl.maximum(m, z_max)
            t_low = m - 1.0
            t_low = t_low - 4.8e-7 * tl.abs(t_low)
            live = tl.max((z_max > t_low).to(tl.int32), 0)
        w, word, word_c, word_lo, w_lo, word_hi, w_hi = mark_tile(kt, live, kt_first, word_c, word_lo, w_lo, word_hi,
                                                                  w_hi)
        tl.store(live_base + w, word)
    return m, n_valid, bad, kt_hi - kt_lo - shut


@triton.jit
def _points_pass(q, kv, rw, mods, pts, acc, st, POW: tl.constexpr, NPTS: tl.constexpr, LANES: tl.constexpr,
                 COUNT: tl.constexpr, BIAS_KIND: tl.constexpr, MASK, SCORE, DOT_PRECISION: tl.constexpr):
    """One pass over the live tiles adding the point sums of ``z - m`` at the points ``pts`` (``cand_sums``) to
    ``acc``; tiles with no score above ``lo_kill`` (relative to ``m``) die. ``st = (m, z_scale, am1, bm1, lo_kill,
    live_base, n_words, zs, visits)``. Returns ``(acc, visits)``."""
    m, z_scale, am1, bm1, lo_kill, live_base, n_words, zs, visits = st
    for wd in range(0, n_words):
        word = tl.load(live_base + wd)
        new_word = tl.zeros([], tl.int32)
        if word != 0:
            bits, rank, n_set = word_bits(word)
            for i in range(0, n_set):
                kt = live_tile(bits, rank, i, wd)
                cols = kt * kv.offs_n.shape[0] + kv.offs_n
                z = _score_tile(q, kv, rw, cols, mods, z_scale, am1, BIAS_KIND, MASK, SCORE, DOT_PRECISION)
                zr = z - m[:, None]
                live = tl.max((zr > lo_kill[:, None]).to(tl.int32))
                new_word = new_word | (live << (kt - wd * 32))
                acc = _point_sums(zr, pts, acc, POW, NPTS, bm1, LANES, COUNT)
                visits += 1
        tl.store(live_base + wd, new_word)
    if SCORE[3]:
        acc = _point_sums(zs - m[:, None], pts, acc, POW, NPTS, bm1, LANES, COUNT)
    tl.debug_barrier()
    return acc, visits


@triton.jit
def _point_sums(zr, pts, acc, POW: tl.constexpr, NPTS: tl.constexpr, bm1, LANES: tl.constexpr,
                COUNT: tl.constexpr):
    """``_threshold.cand_sums`` for ``NPTS >= 2`` points, counting the keys above each point only with ``COUNT``
    (the bracket pass at alpha 1.5 does not: a count is two more instructions per score and point, and only the
    exact-root test reads it; at alpha 2 the count is ``g``)."""
    if COUNT or POW != 2:
        out = cand_sums(zr, pts, acc, POW, NPTS, bm1, LANES)
    else:
        _, _, t_p, l_p, cand = pts
        f1, g1, c1, FP, GP, CP = acc
        for p in tl.static_range(NPTS):
            sel_c = (cand == p)[None, :]
            f, g, _ = point_sums(zr, tl.sum(tl.where(sel_c, t_p, 0.0), 1), POW, bm1, tl.sum(tl.where(sel_c, l_p, 0.0),
                                                                                           1), LANES)
            if LANES == 0:
                FP += tl.where(sel_c, f[:, None], 0.0)
                GP += tl.where(sel_c, g[:, None], 0.0)
            else:
                FP += tl.where(sel_c[:, :, None], f[:, None, :], 0.0)
                GP += tl.where(sel_c[:, :, None], g[:, None, :], 0.0)
        out = (f1, g1, c1, FP, GP, CP)
    return out


@triton.jit
def _relative_bracket(br, shift):
    """``br`` with its lower end at ``m - 1`` (``phi >= 0`` there: the max key alone gives ``f = 1``) where no merged
    point had ``phi >= 0`` (rounding), so that ``solve`` always has a closed bracket."""
    none = br.a == float("-inf")
    zero = tl.zeros_like(br.a)
    return Bracket(tl.where(none, shift - 1.0, br.a), tl.where(none, zero, br.pa), tl.where(none, zero - 1.0, br.da),
                   tl.where(none, zero + 1.0, br.fa), tl.where(none, zero, br.ga), tl.where(none, zero, br.ca), br.b,
                   br.pb, br.db, br.cb, br.top)


@triton.jit
def threshold_rows(q, kv, rw, mods, tiles, sc, POW: tl.constexpr, BIAS_KIND: tl.constexpr, MASK, SCORE,
                   DOT_PRECISION: tl.constexpr):
    """Max pass, bracket pass, refinement passes (module docstring). Returns ``(m, t_rel, lo_rel, bad, n_valid,
    passes, visits)``: ``t_rel`` the threshold to use relative to ``m`` (plus the shift 1 on the general path),
    ``lo_rel`` the certified lower bound relative to ``m`` (no shift) that kills tiles."""
    BLOCK_M: tl.constexpr = rw.rows.shape[0]
    BLOCK_N: tl.constexpr = kv.offs_n.shape[0]
    kt_lo, kt_hi, kt_first, n_words, live_base = tiles
    scale, alpha, tol, max_passes = sc
    am1 = alpha - 1.0
    bm1 = 1.0 / am1 - 1.0
    z_scale = scale * am1
    if POW == 0:
        shift = 1.0
        LANES: tl.constexpr = 0
    else:
        shift = 0.0
        LANES: tl.constexpr = 4
    z_sink = am1 * mods[4]
    sink_bad = (z_sink != z_sink) | (z_sink == float("inf"))
    if SCORE[3]:
        zs = sink_tile(tl.where(sink_bad, float("-inf"), z_sink), BLOCK_M, BLOCK_N)
    else:
        zs = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)

    # ---- pass 1: the row max (the sink's too), valid keys, NaN / +inf rows, tiles below the running max - 1
    m, n_valid, bad, visits = _max_pass(q, kv, rw, mods, z_scale, am1, live_base, kt_lo, kt_hi, kt_first, zs,
                                        BIAS_KIND, MASK, SCORE, DOT_PRECISION)
    if SCORE[3]:
        bad = bad | sink_bad.to(tl.int32)
    tl.debug_barrier()
    valid = n_valid > 0
    usable = valid & (bad == 0)
    m = tl.where(usable, m, 0.0)
    zero = tl.zeros([BLOCK_M], tl.float32)

    # ---- pass 2: f, g at SPLIT_POINTS points over [m - 1, m - n^(1 - alpha)] (the sink counts as a key)
    n_keys = (n_valid + tl.where(tl.max(zs, 1) > float("-inf"), 1, 0)).to(tl.float32)
    span = 1.0 - tl.exp2(-am1 * tl.log2(tl.maximum(n_keys, 1.0)))
    cand = tl.arange(0, SPLIT_POINTS).to(tl.float32)
    t_p = (shift - 1.0) + (span / (SPLIT_POINTS - 1))[:, None] * cand[None, :]  # [BLOCK_M, SPLIT_POINTS]
    pts = (zero, zero, t_p, log_ref(zero[:, None], t_p), cand)
    acc = (zero, zero, zero, point_zeros(BLOCK_M, SPLIT_POINTS, LANES), point_zeros(BLOCK_M, SPLIT_POINTS, LANES),
           point_zeros(BLOCK_M, SPLIT_POINTS, LANES))
    # tiles die at m - 1, a few ulps of m lower (z - m rounds at that scale)
    lo_kill = zero - 1.0 - 4.8e-7 * (1.0 + tl.abs(m))
    acc, visits = _points_pass(q, kv, rw, mods, pts, acc, (m, z_scale, am1, bm1, lo_kill, live_base, n_words, zs,
                                                           visits),
                               POW, SPLIT_POINTS, LANES, False, BIAS_KIND, MASK, SCORE, DOT_PRECISION)
    br = open_bracket(zero, m == m, shift)
    br = _relative_bracket(cand_bracket(br, pts, acc, am1, POW, SPLIT_POINTS, LANES), shift)
    est, lo, hi, exact = solve(br, POW)
    n_passes = tl.full([], 2, tl.int32)
    done = width_done(exact, lo, hi, usable, tol)

    # ---- refinement passes: two points straddling the estimate while a row of the tile is not pinned down
    pair = tl.arange(0, 2).to(tl.float32)
    go = more_passes(done, n_passes, max_passes)
    while go:
        half = tl.maximum(0.1 * (hi - lo), 0.45 * (tol + 4.8e-7 * tl.abs(lo)))
        t_2 = tl.where(pair[None, :] == 0, tl.maximum(est - half, lo)[:, None], tl.minimum(est + half, hi)[:, None])
        pts_2 = (zero, zero, t_2, log_ref(zero[:, None], t_2), pair)
        acc_2 = (zero, zero, zero, point_zeros(BLOCK_M, 2, LANES), point_zeros(BLOCK_M, 2, LANES),
                 point_zeros(BLOCK_M, 2, LANES))
        acc_2, visits = _points_pass(q, kv, rw, mods, pts_2, acc_2,
                                     (m, z_scale, am1, bm1, lo - shift, live_base, n_words, zs, visits),
                                     POW, 2, LANES, True, BIAS_KIND, MASK, SCORE, DOT_PRECISION)
        act = done == 0
        br = pick_bracket(act, cand_bracket(br, pts_2, acc_2, am1, POW, 2, LANES), br)
        n_est, n_lo, n_hi, n_exact = solve(br, POW)
        lo = tl.where(act, tl.maximum(lo, n_lo), lo)
        hi = tl.where(act, tl.minimum(hi, n_hi), hi)
        lo = tl.minimum(lo, hi)
        est = tl.minimum(tl.maximum(tl.where(act, n_est, est), lo), hi)
        exact = tl.where(act, n_exact, exact)
        n_passes += 1
        done = width_done(exact, lo, hi, usable, tol)
        go = more_passes(done, n_passes, max_passes)

    # a threshold at the max would leave no weight: keep it one rounding step of m below (one-hot on the max key)
    t_use = tl.where(usable, tl.minimum(est, shift - tl.maximum(tl.abs(m) * 2.4e-7, 1e-15)), shift)
    lo_rel = tl.minimum(lo, t_use) - shift
    return m, t_use, lo_rel, bad, n_valid, n_passes, visits


@triton.jit
def _value_rows(q, kv, rw, mods, vp, POW: tl.constexpr, BIAS_KIND: tl.constexpr, MASK, SCORE,
                HAS_DROPOUT: tl.constexpr, WITH_P: tl.constexpr, WITH_U: tl.constexpr, HALF_P: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """The value pass at the thresholds ``t_use`` relative to ``m`` (``_fwd_rows._value_pass`` on ``z - m``), ``vp =
    (m, t_use, lo_kill, beta, z_scale, am1, live_base, n_words, visits)``: ``(acc, l_sum, nnz, acc_u, u_sum,
    visits)``, the bitmap words rewritten with ``WITH_P`` (tiles with no score above ``lo_kill`` die)."""
    m, t_use, lo_kill, beta, z_scale, am1, live_base, n_words, visits = vp
    BLOCK_M: tl.constexpr = rw.rows.shape[0]
    BLOCK_DV: tl.constexpr = kv.dv_ok.shape[0]
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
                cols = kt * kv.offs_n.shape[0] + kv.offs_n
                z = _score_tile(q, kv, rw, cols, mods, z_scale, am1, BIAS_KIND, MASK, SCORE, DOT_PRECISION)
                z = z - m[:, None]
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
                p, u = _apply_dropout(p, u, rw, cols, HAS_DROPOUT)
                v = _value_tile(q, kv, cols, rw.seqlen_k)
                if WITH_P:
                    acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                if WITH_U:
                    acc_u += tl.dot(u.to(v.dtype), v, input_precision=DOT_PRECISION)
                visits += 1
        if WITH_P:
            tl.store(live_base + wd, new_word)
    return acc, l_sum, nnz, acc_u, u_sum, visits


@triton.jit(do_not_specialize=["n_q_tiles", "n_words"])
def _entmax_attn_thr_kernel(
    Q, K, V, OUT, OUT_U, ALPHA, TAU, LSUM, NNZ, N_VALID, LIVE, N_PASSES, TILE_VISITS, CU_SEQLENS_Q,
    CU_SEQLENS_K, MODS, SCRATCH,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_oub, stride_ouh, stride_oum, stride_oud,
    n_heads, kv_group, total_q, total_k, n_q_tiles, n_words, n_stat,
    scale, tol, max_passes, seed, dropout_p, inv_keep, MASK, SCORE,
    ALPHA_CLASS: tl.constexpr, HEAD_FILTER: tl.constexpr, GRID_K1: tl.constexpr, CAND_P1: tl.constexpr,
    GRID_K2: tl.constexpr, CAND_P2: tl.constexpr, GRID_K0: tl.constexpr, CAND_P0: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BIAS_KIND: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, NEED_OUT_U: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The threshold kernel: one program per (query tile, q head, batch entry or sequence), as the fused kernel."""
    if HEAD_FILTER:
        if alpha_class_id(tl.load(ALPHA + tl.program_id(1))) != ALPHA_CLASS:
            return
    pid_m = n_q_tiles - 1 - tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.program_id(2)
    b, q_start, seqlen_q, k_start, seqlen_k = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, seq, total_q, total_k, IS_VARLEN)
    h_kv = h // kv_group
    bh = b * n_heads + h
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < seqlen_q
    q_base = slice_base(Q, b, h, q_start, stride_qb, stride_qh, stride_qm)
    q = load_rows(q_base, rows, offs_d, stride_qm, stride_qd, row_ok, offs_d < HEAD_DIM, UPCAST)  # [BLOCK_M, BLOCK_D]
    kv = KeyTiles(slice_base(K, b, h_kv, k_start, stride_kb, stride_kh, stride_kn),
                  slice_base(V, b, h_kv, k_start, stride_vb, stride_vh, stride_vn), stride_kn, stride_kd, stride_vn,
                  stride_vd, tl.arange(0, BLOCK_N), offs_d < HEAD_DIM, offs_dv < HEAD_DIM_V)
    rw = Rows(rows, seqlen_q, seqlen_k, q_start, k_start, total_k, bh, seed, dropout_p, inv_keep)
    mods = program_mods(MODS, b, seq, h, q_start, k_start, SCORE)
    tile_id = (seq.to(tl.int64) * n_heads + h) * n_q_tiles + pid_m
    live_base = LIVE + tile_id * n_words
    kt_lo, kt_hi = key_tile_range(pid_m, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N)
    kt_first = max_first_tile(pid_m, seqlen_q, seqlen_k, kt_lo, kt_hi, MASK, BLOCK_M, BLOCK_N)
    stat_offs = bh.to(tl.int64) * total_q + (q_start + rows).to(tl.int64)
    for wd in range(0, n_words):
        tl.store(live_base + wd, 0)
    tl.debug_barrier()
    alpha = tl.load(ALPHA + h)
    a_ok = (alpha >= 1.0) & (alpha <= 2.0)
    # POW of _threshold: 1 for sparsemax, 2 for 1.5-entmax, 0 for other alpha
    if ALPHA_CLASS == 1:
        POW: tl.constexpr = 1
    elif ALPHA_CLASS == 2:
        POW: tl.constexpr = 2
    else:
        POW: tl.constexpr = 0
    m, t_use, lo_rel, bad, n_valid, passes, visits = threshold_rows(
        q, kv, rw, mods, (kt_lo, kt_hi, kt_first, n_words, live_base),
        (scale, tl.where(a_ok & (alpha > 1.0), alpha, 1.5), tol, max_passes), POW, BIAS_KIND, MASK, SCORE,
        DOT_PRECISION)
    tl.store(SCRATCH + stat_offs, m, mask=row_ok)
    tl.store(SCRATCH + n_stat + stat_offs, t_use, mask=row_ok)
    tl.store(SCRATCH + 2 * n_stat + stat_offs, lo_rel, mask=row_ok)
    tl.store(NNZ + stat_offs, bad, mask=row_ok)
    tl.store(N_VALID + stat_offs, n_valid, mask=row_ok)
    tl.store(N_PASSES + tile_id, passes)
    tl.store(TILE_VISITS + tile_id, visits)


@triton.jit(do_not_specialize=["n_q_tiles", "n_words"])
def _entmax_attn_val_kernel(
    Q, K, V, OUT, OUT_U, ALPHA, TAU, LSUM, NNZ, N_VALID, LIVE, N_PASSES, TILE_VISITS, CU_SEQLENS_Q,
    CU_SEQLENS_K, MODS, SCRATCH,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_oub, stride_ouh, stride_oum, stride_oud,
    n_heads, kv_group, total_q, total_k, n_q_tiles, n_words, n_stat,
    scale, tol, max_passes, seed, dropout_p, inv_keep, MASK, SCORE,
    ALPHA_CLASS: tl.constexpr, HEAD_FILTER: tl.constexpr, GRID_K1: tl.constexpr, CAND_P1: tl.constexpr,
    GRID_K2: tl.constexpr, CAND_P2: tl.constexpr, GRID_K0: tl.constexpr, CAND_P0: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BIAS_KIND: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, NEED_OUT_U: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The value kernel: the threshold kernel's rows and bitmap in, the outputs and statistics out."""
    if HEAD_FILTER:
        if alpha_class_id(tl.load(ALPHA + tl.program_id(1))) != ALPHA_CLASS:
            return
    pid_m = n_q_tiles - 1 - tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.program_id(2)
    b, q_start, seqlen_q, k_start, seqlen_k = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, seq, total_q, total_k, IS_VARLEN)
    h_kv = h // kv_group
    bh = b * n_heads + h
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < seqlen_q
    q_base = slice_base(Q, b, h, q_start, stride_qb, stride_qh, stride_qm)
    q = load_rows(q_base, rows, offs_d, stride_qm, stride_qd, row_ok, offs_d < HEAD_DIM, UPCAST)  # [BLOCK_M, BLOCK_D]
    kv = KeyTiles(slice_base(K, b, h_kv, k_start, stride_kb, stride_kh, stride_kn),
                  slice_base(V, b, h_kv, k_start, stride_vb, stride_vh, stride_vn), stride_kn, stride_kd, stride_vn,
                  stride_vd, tl.arange(0, BLOCK_N), offs_d < HEAD_DIM, offs_dv < HEAD_DIM_V)
    rw = Rows(rows, seqlen_q, seqlen_k, q_start, k_start, total_k, bh, seed, dropout_p, inv_keep)
    mods = program_mods(MODS, b, seq, h, q_start, k_start, SCORE)
    tile_id = (seq.to(tl.int64) * n_heads + h) * n_q_tiles + pid_m
    live_base = LIVE + tile_id * n_words
    kt_lo, kt_hi = key_tile_range(pid_m, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N)
    stat_offs = bh.to(tl.int64) * total_q + (q_start + rows).to(tl.int64)
    alpha = tl.load(ALPHA + h)
    a_ok = (alpha >= 1.0) & (alpha <= 2.0)
    alpha = tl.where(a_ok & (alpha > 1.0), alpha, 1.5)
    # POW of _threshold: 1 for sparsemax, 2 for 1.5-entmax, 0 for other alpha
    if ALPHA_CLASS == 1:
        POW: tl.constexpr = 1
    elif ALPHA_CLASS == 2:
        POW: tl.constexpr = 2
    else:
        POW: tl.constexpr = 0
    am1 = alpha - 1.0
    beta = 1.0 / am1
    z_scale = scale * am1
    if POW == 0:
        shift = 1.0
    else:
        shift = 0.0
    m = tl.load(SCRATCH + stat_offs, mask=row_ok, other=0.0)
    t_use = tl.load(SCRATCH + n_stat + stat_offs, mask=row_ok, other=shift)
    lo_kill = tl.load(SCRATCH + 2 * n_stat + stat_offs, mask=row_ok, other=0.0)
    bad = tl.load(NNZ + stat_offs, mask=row_ok, other=0)
    n_valid = tl.load(N_VALID + stat_offs, mask=row_ok, other=0)
    passes = tl.load(N_PASSES + tile_id)
    visits = tl.load(TILE_VISITS + tile_id)
    HALF_P: tl.constexpr = (kv.v_base.dtype.element_ty != tl.float32) and not NEED_OUT_U
    SPLIT_U: tl.constexpr = NEED_OUT_U and BLOCK_DV > 128
    acc, l_sum, nnz, acc_u, u_sum, visits = _value_rows(
        q, kv, rw, mods, (m, t_use, lo_kill, beta, z_scale, am1, live_base, n_words, visits), POW, BIAS_KIND, MASK,
        SCORE, HAS_DROPOUT, True, NEED_OUT_U and not SPLIT_U, HALF_P, DOT_PRECISION)
    if SPLIT_U:
        passes += 1
        _, _, _, acc_u, u_sum, visits = _value_rows(
            q, kv, rw, mods, (m, t_use, lo_kill, beta, z_scale, am1, live_base, n_words, visits), POW, BIAS_KIND, MASK,
            SCORE, HAS_DROPOUT, False, True, HALF_P, DOT_PRECISION)
    if SCORE[3]:
        z_sink = am1 * mods[4]
        z_sink = tl.where((z_sink != z_sink) | (z_sink == float("inf")), float("-inf"), z_sink)
        zs = sink_tile(z_sink, BLOCK_M, BLOCK_N) - m[:, None]
        p_s = weights(zs, t_use, POW, beta, HALF_P)
        l_sum += tl.sum(p_s, 1)
        if NEED_OUT_U:
            u_sum += tl.sum(_u_weights(zs, t_use, p_s, POW), 1)
    passes += 1
    valid = n_valid > 0
    ok = valid & (l_sum > 0.0)
    l_safe = tl.where(ok, l_sum, 1.0)
    is_bad = (bad != 0) | (a_ok == 0)
    out = tl.where(ok[:, None], acc / l_safe[:, None], 0.0)
    out = tl.where(is_bad[:, None], float("nan"), out)
    offs_dv = tl.arange(0, BLOCK_DV)
    store_rows(slice_base(OUT, b, h, rw.q_start, stride_ob, stride_oh, stride_om), rw.rows, offs_dv, stride_om,
               stride_od, out, row_ok, offs_dv < HEAD_DIM_V)
    if NEED_OUT_U:
        u_ok = ok & (u_sum > 0.0)
        out_u = tl.where(u_ok[:, None], acc_u / tl.where(u_ok, u_sum, 1.0)[:, None], 0.0)
        out_u = tl.where(is_bad[:, None], float("nan"), out_u)
        store_rows(slice_base(OUT_U, b, h, rw.q_start, stride_oub, stride_ouh, stride_oum), rw.rows, offs_dv,
                   stride_oum, stride_oud, out_u, row_ok, offs_dv < HEAD_DIM_V)
    tau = tl.where(is_bad, float("nan"), tl.where(ok, m + (t_use - shift), float("inf")))
    tl.store(TAU + stat_offs, tau, mask=row_ok)
    tl.store(LSUM + stat_offs, tl.where(is_bad, float("nan"), tl.where(ok, l_sum, 0.0)), mask=row_ok)
    tl.store(NNZ + stat_offs, tl.where(ok, nnz, 0), mask=row_ok)
    tl.store(N_PASSES + tile_id, passes)
    tl.store(TILE_VISITS + tile_id, visits)


def launch_split(grid, launches, options, fused_kernel, result):
    """Run the launches of one forward (``entmax_attn_fwd._plan``): the heads of alpha in (1, 2] by the threshold
    kernel then the value kernel of this module, softmax heads by ``fused_kernel``, each with ``options`` (the fused
    kernel's launch options). Fills ``result`` (an ``EntmaxAttnFwdResult``) and returns it."""
    scratch = torch.empty((3, *result.tau.shape), dtype=torch.float32, device=result.tau.device) if launches else None
    for args in launches:
        if args["ALPHA_CLASS"] == 0:
            fused_kernel[grid](**args, **options)
            continue
        split_args = dict(args, SCRATCH=scratch, n_stat=result.tau.numel())
        _entmax_attn_thr_kernel[grid](**split_args, **options)
        _entmax_attn_val_kernel[grid](**split_args, **options)
    return result
