"""The fused forward's threshold search for alpha in (1, 2] on one query tile, split by pass: :func:`grid_pass` (the
row max, the valid keys and the point sums of a grid below the running max, max-first over the key tiles),
:func:`candidate_passes` (the bracket from the grid, then candidate points over the live tiles until every row is
pinned down) and the value pass (``_fwd_rows.value_rows``); :func:`entmax_rows` runs them in order. The program's
values arrive as the tuples of ``_fwd_rows`` (``KeyTiles``, ``Rows``, ``Tiles``, ``Scalars``) and ``mods``
(``_masking.ProgramMods``)."""

from typing import NamedTuple

import triton
import triton.language as tl

from .._masking import walk_words
from ._fwd_rows import (
    _row_span,
    _score_tile,
    _sink_scores,
    mark_live,
    open_tile,
    points_pass,
    tile_screen,
    valid_keys,
    value_rows,
)
from ._threshold import log_ref, more_passes, solve, tighten, width_done
from ._threshold_tiles import (
    cand_bracket,
    cand_points,
    grid_bracket,
    grid_start,
    grid_sums,
    grid_tile,
    lowest_point,
    point_zeros,
)


class GridPass(NamedTuple):
    """What the grid pass leaves (:func:`grid_pass`): the running max ``m``, the grid's top index ``j_top`` and the
    reference score ``ref``; the point sums ``F``, ``G`` (reduced over lanes) and ``L``, the grid's ``slot`` offsets and
    step ``w_grid`` (``_threshold_tiles.grid_start``); the valid-key counts ``n_valid``, the NaN / +inf flags ``bad``
    and the key tiles loaded so far, ``visits``."""

    m: tl.tensor
    j_top: tl.tensor
    ref: tl.tensor
    F: tl.tensor
    G: tl.tensor
    L: tl.tensor
    slot: tl.tensor
    w_grid: tl.tensor
    n_valid: tl.tensor
    bad: tl.tensor
    visits: tl.tensor


@triton.jit
def grid_pass(q, kv, rw, tiles, mods, zs, zc, POW: tl.constexpr, GRID_K: tl.constexpr, LANES: tl.constexpr,
              BIAS_KIND: tl.constexpr, MASK, SCORE, DOT_PRECISION: tl.constexpr):
    """Pass 1: the row max, valid keys, NaN / +inf rows, and f, g, c at ``GRID_K`` points below the running max
    (relative to the reference score ``ref``), every key tile visited once, max-first; ``zs`` the sink's virtual score
    tile, ``zc = (z_scale, am1, shift, beta, bm1)``. Returns a :class:`GridPass` and stores the liveness words
    (``mark_live``).

    The key tiles are visited max-first, from ``kt_first`` (``_masking.max_first_tile``: the diagonal tile when
    causal, else the diagonal / window centre, ascending for unstructured cross-attention) outward
    (``_masking.visit_tile``), so that the running max is final before the far tiles are seen. The ring is exact in
    any order and a tile is skipped only below the current lowest point, which only rises. A tile that is dead and
    plain when visited (``tile_screen``: two row reductions and one CTA-wide compare) skips the per-score NaN/+inf
    flags, the valid-key counts and ``grid_tile``; its valid-key counts come from the row max. A key tile the block
    mask hides from every row is never loaded (``open_tile``)."""
    BLOCK_M: tl.constexpr = rw.rows.shape[0]
    z_scale, am1, shift, beta, bm1 = zc
    w_grid, slot, m, j_top, ref, n_valid, bad, F, G, L = grid_start(BLOCK_M, GRID_K, LANES)
    if SCORE.has_sinks:
        z_sink = am1 * mods.sink
        bad = bad | ((z_sink != z_sink) | (z_sink == float("inf"))).to(tl.int32)
        m, j_top, ref, F, G, L, _ = grid_tile(zs, m, j_top, ref, F, G, L, slot, w_grid, shift, beta, bm1, POW, GRID_K,
                                              LANES)
    t_low = lowest_point(j_top, w_grid, GRID_K)
    walk = walk_words()
    shut = tl.zeros([], tl.int32)
    span = _row_span(rw)
    for i in range(0, tiles.kt_hi - tiles.kt_lo):
        key, shut = open_tile(i, tiles, kv, rw, mods, span, shut, MASK, SCORE)
        live = tl.zeros([], tl.int32)
        if key.open:
            z = _score_tile(q, kv, rw, key, mods, z_scale, am1, BIAS_KIND, MASK, SCORE, DOT_PRECISION)
            code, n_fast, _z_max = tile_screen(z, t_low, ref)
            bad, n_valid = valid_keys(z, code, n_fast, bad, n_valid)
            if code != 0:
                m, j_top, ref, F, G, L, live = grid_tile(z, m, j_top, ref, F, G, L, slot, w_grid, shift, beta, bm1, POW,
                                                         GRID_K, LANES)
                t_low = lowest_point(j_top, w_grid, GRID_K)
        walk = mark_live(tiles, key.kt, live, walk)
    tl.debug_barrier()
    F, G = grid_sums(F, G, LANES)
    return GridPass(m, j_top, ref, F, G, L, slot, w_grid, n_valid, bad, tiles.kt_hi - tiles.kt_lo - shut)


@triton.jit
def candidate_passes(q, kv, rw, tiles, mods, grid, cz, POW: tl.constexpr, GRID_K: tl.constexpr, CAND_P: tl.constexpr,
                     CAND_LANES: tl.constexpr, BIAS_KIND: tl.constexpr, MASK, SCORE, DOT_PRECISION: tl.constexpr):
    """The bracket from the grid pass's sums (``grid`` its results), then candidate passes over the live tiles while
    a row of the tile is not pinned down (``CAND_P`` points each, or the estimate alone with 1), at most
    ``max_passes`` in all; ``grid`` a :class:`GridPass`, ``cz = (z_scale, am1, bm1, shift, tol, max_passes, zs)``
    (``zs`` the sink's virtual score tile). Thresholds carry ``shift``
    (``entmax_rows``) and are relative to the rows' reference scores. Returns ``(m, ref, est, lo, usable, n_passes,
    visits)``: ``m`` and ``ref`` 0 on rows that are not ``usable`` (no valid key, or a NaN / +inf score)."""
    BLOCK_M: tl.constexpr = rw.rows.shape[0]
    z_scale, am1, bm1, shift, tol, max_passes, zs = cz
    visits = grid.visits
    n_passes = tl.full([], 1, tl.int32)

    # ---- bracket from the grid: the lowest point has phi >= 0 in exact arithmetic; the row max closes it
    usable = (grid.n_valid > 0) & (grid.bad == 0)
    ref = tl.where(usable, grid.ref, 0.0)
    # from here on the row max, the points and the thresholds are relative to ref
    m = tl.where(usable, grid.m - ref, 0.0)
    j_top = tl.where(usable, grid.j_top, 0.0)
    # beyond 2**22 grid steps fp32 cannot index the grid: those rows start from [m - 1, m] with phi(m - 1) >= 0
    # unknown (NaN: bisect)
    grid_ok = tl.abs(j_top) < 4194304.0
    zero = tl.zeros([BLOCK_M], tl.float32)
    br = grid_bracket(m, j_top, grid_ok, grid.F, grid.G, grid.L, grid.slot, grid.w_grid, shift, am1, POW, GRID_K)
    est, lo, hi, exact = solve(br, POW)
    done = width_done(exact, lo, hi, usable, tol)

    # ---- candidate passes over the live tiles while a row of the tile is not pinned down
    go = more_passes(done, n_passes, max_passes)
    while go:
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
        pts = (t_1, l_1, t_p, l_p, cand)
        acc, visits = points_pass(q, kv, rw, mods, pts, (f1, g1, c1, FP, GP, CP),
                                  (ref, z_scale, am1, bm1, lo - shift, tiles, zs, visits), POW, CAND_P, CAND_LANES,
                                  POW == 2, BIAS_KIND, MASK, SCORE, DOT_PRECISION)
        br, est, lo, hi, exact = tighten(done == 0, br, cand_bracket(br, pts, acc, am1, POW, CAND_P, CAND_LANES), est,
                                         lo, hi, exact, POW)
        n_passes += 1
        done = width_done(exact, lo, hi, usable, tol)
        go = more_passes(done, n_passes, max_passes)
    return m, ref, est, lo, usable, n_passes, visits


@triton.jit
def entmax_rows(q, kv, rw, tiles, mods, sc, POW: tl.constexpr, GRID_K: tl.constexpr, CAND_P: tl.constexpr,
                BIAS_KIND: tl.constexpr, MASK, SCORE, HAS_DROPOUT: tl.constexpr, NEED_OUT_U: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """alpha in (1, 2]: the grid pass, the candidate passes, the value pass (module docstring).

    Returns ``(out, out_u, tau, tau_lo, lsum, nnz, n_valid, n_passes, visits)``. Thresholds are carried as
    ``theta = tau + shift`` (shift 1 on the general path POW 0, see kernels/attn/_threshold.py), and, with every
    score and point, relative to the row's reference score ``ref`` (``_threshold_tiles.anchor``, set by the grid
    pass); the threshold ``ref + tau_rel`` is returned as two floats, ``tau`` and its rounding residual ``tau_lo``. With
    ``NEED_OUT_U`` the value pass also accumulates ``sum_j U_ij v_j`` and ``sum_j U_ij`` (``U = p^(2 - alpha)`` up
    to a row factor, dropout applied to the first): ``out_u`` is their ratio, from which the backward's ``delta`` is
    ``dO . out_u`` (docs/backward.md); otherwise ``out_u`` is ``out``.

    With sinks (``SCORE.has_sinks``) the sink is one more score per row, ``(alpha - 1) * sink`` in the z-scale, held by
    a virtual tile (``_masking.sink_tile``): it enters the running max and the grid sums before the real tiles, the
    point sums of every candidate pass and ``lsum`` (and ``sum_j U_ij``) of the value pass, but no output, support
    count, valid-key count or liveness bit. A NaN or ``+inf`` sink makes every row NaN.

    More tiles die in the max-first grid pass than in ascending order; the valid-key counts, the NaN/+inf rows and (on
    finite scores) the final live set are those of the ascending order, but the grid sums are added in another order:
    outputs and thresholds are not bitwise those of the ascending order (they stay within the certified brackets and
    the usual tolerances).
    """
    BLOCK_M: tl.constexpr = rw.rows.shape[0]
    BLOCK_N: tl.constexpr = kv.offs_n.shape[0]
    scale, alpha, tol, max_passes = sc
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
    zs = _sink_scores(mods, am1, BLOCK_M, BLOCK_N)
    grid = grid_pass(q, kv, rw, tiles, mods, zs, (z_scale, am1, shift, beta, bm1), POW, GRID_K, LANES, BIAS_KIND,
                     MASK, SCORE, DOT_PRECISION)
    m, ref, est, lo, usable, n_passes, visits = candidate_passes(
        q, kv, rw, tiles, mods, grid, (z_scale, am1, bm1, shift, tol, max_passes, zs), POW, GRID_K, CAND_P,
        CAND_LANES, BIAS_KIND, MASK, SCORE, DOT_PRECISION)

    # ---- value pass at the estimate; tiles die only below the certified lower bound
    # a threshold at the max would leave no weight: keep it one rounding step below (one-hot on the max key)
    tau_lim = m - tl.maximum(tl.abs(m) * 2.4e-7, 1e-15) + shift
    tau_saved = tl.where(usable, tl.minimum(est, tau_lim), 0.0) - shift
    lo_kill = tl.minimum(lo, tau_saved + shift) - shift
    out, out_u, tau, tau_lo, l_out, nnz, n_passes, visits = value_rows(
        q, kv, rw, tiles, mods, (tau_saved, lo_kill, alpha, z_scale, ref, grid.n_valid > 0, grid.bad, n_passes, visits),
        POW, BIAS_KIND, MASK, SCORE, HAS_DROPOUT, NEED_OUT_U, DOT_PRECISION)
    return out, out_u, tau, tau_lo, l_out, nnz, grid.n_valid, n_passes, visits
