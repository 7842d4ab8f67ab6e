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

The row max ``m`` is the rows' reference score (``_masking.score_mod``'s ``ref``, as the fused forward's anchor): the
threshold passes work with ``z - m`` and points relative to it (in ``[-1, 0]``, plus the general path's shift 1), so
the search is the same whatever the scores' magnitude. The value kernel is the fused forward's value pass
(``_fwd_rows.value_rows``) at the threshold relative to ``m``, rounded as the fused forward rounds it: it visits the
live tiles once (no running max, no rescale), refines the bitmap against the certified lower bound and writes the
outputs and statistics of ``entmax_attn_fwd`` (``EntmaxAttnFwdResult``; ``tau + tau_lo = m + tau_rel`` exactly). Both
kernels are stages of the forward kernel (``entmax_attn_fwd._entmax_attn_fwd_kernel``, ``STAGE`` 1 and 2), so they
share its arguments and program setup.

Between the two stages, in the statistics stage 2 overwrites, per row: ``m`` in ``TAU``, the relative threshold in
``TAU_LO``, the relative certified lower bound in ``LSUM``, the NaN / +inf flag in ``NNZ``, the valid-key count in
``N_VALID``; per query tile the passes and visits so far in ``N_PASSES`` / ``TILE_VISITS``. The softmax class
(alpha = 1) keeps the fused kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._masking import walk_words
from ._fwd_rows import _row_span, _score_tile, _sink_scores, mark_live, open_tile, points_pass, tile_screen, valid_keys
from ._threshold import Bracket, log_ref, more_passes, open_bracket, solve, tighten, width_done
from ._threshold_tiles import cand_bracket, point_zeros

# points of the bracket pass (docs/kernels.md: 4 points and 2-point refinements model cheapest with one code shape)
SPLIT_POINTS = tl.constexpr(4)


@triton.jit
def _max_pass(q, kv, rw, mods, tiles, z_scale, am1, zs, BIAS_KIND: tl.constexpr, MASK, SCORE,
              DOT_PRECISION: tl.constexpr):
    """Pass 1: ``(m, n_valid, bad, visits)`` and the live bits stored (a tile is live when some score lies above the
    running max minus 1, a few ulps lower, when it is visited)."""
    BLOCK_M: tl.constexpr = rw.rows.shape[0]
    m = tl.max(zs, 1)
    t_low = _below_max(m)
    n_valid = tl.zeros([BLOCK_M], tl.int32)
    bad = tl.zeros([BLOCK_M], tl.int32)
    walk = walk_words()
    shut = tl.zeros([], tl.int32)
    span = _row_span(rw)
    for i in range(0, tiles.kt_hi - tiles.kt_lo):
        key, shut = open_tile(i, tiles, kv, rw, mods, span, shut, MASK, SCORE)
        live = tl.zeros([], tl.int32)
        if key.open:
            z = _score_tile(q, kv, rw, key, mods, z_scale, am1, BIAS_KIND, MASK, SCORE, DOT_PRECISION)
            code, n_fast, z_max = tile_screen(z, t_low, 0.0)
            bad, n_valid = valid_keys(z, code, n_fast, bad, n_valid)
            # above the running max - 1 before this tile <=> above the new running max - 1
            live = tl.max((z_max > t_low).to(tl.int32), 0)
            m = tl.maximum(m, z_max)
            t_low = _below_max(m)
        walk = mark_live(tiles, key.kt, live, walk)
    return m, n_valid, bad, tiles.kt_hi - tiles.kt_lo - shut


@triton.jit
def _below_max(m):
    """``m - 1`` a few ulps lower: no threshold lies below it (``[BLOCK_M]``; ``-inf`` before any key)."""
    t_low = m - 1.0
    return t_low - 4.8e-7 * tl.abs(t_low)


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
    """Max pass, bracket pass, refinement passes (module docstring). Returns ``(m, tau, lo_kill, bad, n_valid, passes,
    visits)``: the row max ``m`` (0 on rows with no valid key or a NaN / +inf score), the rows' reference score;
    relative to it ``tau``, the threshold as the fused forward saves it (the value pass uses ``tau + shift``), and
    ``lo_kill``, the certified lower bound (``<= tau``) below which the value pass kills a tile; the rows' NaN / +inf
    flags and valid-key counts, and the passes and tile visits so far. With ``max_passes`` 2 the bracket pass is
    skipped and the estimate is ``m - 1`` (the value pass renormalizes)."""
    BLOCK_M: tl.constexpr = rw.rows.shape[0]
    BLOCK_N: tl.constexpr = kv.offs_n.shape[0]
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
    if SCORE.has_sinks:
        zs = _sink_scores(mods, am1, BLOCK_M, BLOCK_N)
    else:
        zs = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)

    # ---- pass 1: the row max (the sink's too), valid keys, NaN / +inf rows, tiles below the running max - 1
    m, n_valid, bad, visits = _max_pass(q, kv, rw, mods, tiles, z_scale, am1, zs, BIAS_KIND, MASK, SCORE,
                                        DOT_PRECISION)
    if SCORE.has_sinks:
        z_sink = am1 * mods.sink
        bad = bad | ((z_sink != z_sink) | (z_sink == float("inf"))).to(tl.int32)
    tl.debug_barrier()
    valid = n_valid > 0
    usable = valid & (bad == 0)
    m = tl.where(usable, m, 0.0)
    zero = tl.zeros([BLOCK_M], tl.float32)

    # ---- pass 2: f, g at SPLIT_POINTS points over [m - 1, m - n^(1 - alpha)] (the sink counts as a key), unless
    # the cap leaves room for the value pass only (then the estimate is m - 1, certified lower bound, renormalized)
    n_keys = (n_valid + tl.where(tl.max(zs, 1) > float("-inf"), 1, 0)).to(tl.float32)
    span = 1.0 - tl.exp2(-am1 * tl.log2(tl.maximum(n_keys, 1.0)))
    cand = tl.arange(0, SPLIT_POINTS).to(tl.float32)
    t_p = (shift - 1.0) + (span / (SPLIT_POINTS - 1))[:, None] * cand[None, :]  # [BLOCK_M, SPLIT_POINTS]
    pts = (zero, zero, t_p, log_ref(zero[:, None], t_p), cand)
    acc = (zero, zero, zero, point_zeros(BLOCK_M, SPLIT_POINTS, LANES), point_zeros(BLOCK_M, SPLIT_POINTS, LANES),
           point_zeros(BLOCK_M, SPLIT_POINTS, LANES))
    br = open_bracket(zero, m == m, shift)
    n_passes = tl.full([], 1, tl.int32)
    if n_passes + 1 < max_passes:
        # tiles die at m - 1, a few ulps of m lower (z - m rounds at that scale)
        lo_kill = zero - 1.0 - 4.8e-7 * (1.0 + tl.abs(m))
        acc, visits = points_pass(q, kv, rw, mods, pts, acc, (m, z_scale, am1, bm1, lo_kill, tiles, zs, visits), POW,
                                  SPLIT_POINTS, LANES, False, BIAS_KIND, MASK, SCORE, DOT_PRECISION)
        br = cand_bracket(br, pts, acc, am1, POW, SPLIT_POINTS, LANES)
        n_passes += 1
    br = _relative_bracket(br, shift)
    est, lo, hi, exact = solve(br, POW)
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
        st = (m, z_scale, am1, bm1, lo - shift, tiles, zs, visits)
        acc_2, visits = points_pass(q, kv, rw, mods, pts_2, acc_2, st, POW, 2, LANES, POW == 2, BIAS_KIND, MASK,
                                    SCORE, DOT_PRECISION)
        br, est, lo, hi, exact = tighten(done == 0, br, cand_bracket(br, pts_2, acc_2, am1, POW, 2, LANES), est, lo,
                                         hi, exact, POW)
        n_passes += 1
        done = width_done(exact, lo, hi, usable, tol)
        go = more_passes(done, n_passes, max_passes)

    # a threshold at the max would leave no weight: keep it a rounding step below the row max, which is 0 relative to
    # itself exactly (one-hot on the max key); rounded as the fused forward rounds it, so that the value pass and the
    # backward form the same threshold
    tau = tl.where(usable, tl.minimum(est, shift - tl.maximum(shift * 2.4e-7, 1e-15)), 0.0) - shift
    return m, tau, tl.minimum(lo, tau + shift) - shift, bad, n_valid, n_passes, visits
