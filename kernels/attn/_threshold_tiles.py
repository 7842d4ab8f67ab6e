"""The threshold algorithm per key tile (its row arithmetic: ``kernels/attn/_threshold.py``): the grid pass's ring of
``GRID_K`` points below the running max (``grid_start``, ``grid_tile``, ``lowest_point``, the reference score
``anchor``) and the first bracket from it (``grid_bracket``), the candidate passes' points, sums and merge
(``cand_points``, ``cand_sums``, ``cand_bracket``), and the per-lane accumulators both use (``point_zeros``,
``lane_total``). Used by the fused forward, the split forward's point passes and the decode kernels; the loops over key
tiles stay with them. Derivation and measurements: docs/kernels.md.
"""

import triton
import triton.language as tl

from ._threshold import ANCHOR_FREE, log_ref, merge_point, open_bracket, phi, point_sums


@triton.jit
def ring_index(j, slot, GRID_K: tl.constexpr):
    """Grid index held by ring slot ``slot`` when the top index is ``j``: ``j - ((j - slot) mod GRID_K)``."""
    d = j - slot
    return j - (d - GRID_K * tl.floor(d / GRID_K))


@triton.jit
def grid_start(BLOCK_M: tl.constexpr, GRID_K: tl.constexpr, LANES: tl.constexpr):
    """The grid pass before its first tile: the grid step ``w_grid``, the ring's slot numbers ``slot [GRID_K]``, and
    the accumulators of ``grid_tile`` with no key yet: ``(w_grid, slot, m, j_top, ref, n_valid, bad, F, G, L)``
    (``[BLOCK_M]``; ``F``, ``G`` ``[BLOCK_M, GRID_K]``, or ``[BLOCK_M, GRID_K, LANES]`` per-lane partials with
    ``LANES > 0``, ``grid_sums``; ``L`` ``[BLOCK_M, GRID_K]``; ``n_valid``, ``bad`` int32 counts / flags)."""
    w_grid = 1.0 / (GRID_K - 1)
    slot = tl.arange(0, GRID_K).to(tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    j_top = tl.full([BLOCK_M], -1e30, tl.float32)  # grid index of the running max (-1e30: no key yet)
    ref = tl.zeros([BLOCK_M], tl.float32)  # the reference score the grid points are relative to (anchor)
    n_valid = tl.zeros([BLOCK_M], tl.int32)
    bad = tl.zeros([BLOCK_M], tl.int32)
    F = point_zeros(BLOCK_M, GRID_K, LANES)
    G = point_zeros(BLOCK_M, GRID_K, LANES)
    L = tl.full([BLOCK_M, GRID_K], -99.65784284662087, tl.float32)  # POW 0: log2 of the max key's base (1e-30)
    return w_grid, slot, m, j_top, ref, n_valid, bad, F, G, L


@triton.jit
def anchor(m, GRID_K: tl.constexpr):
    """The reference score of rows whose ring restarts at the running max ``m`` (``[BLOCK_M]``): 0 while ``|m| <
    ANCHOR_FREE`` (and for a non-finite ``m``), else ``m`` rounded down to a multiple of ``GRID_K``, exactly: a grid
    point (an integer) at most ``GRID_K`` below ``m``, so that ``z - ref`` is exact near the max, and a whole number
    of ring turns (``GRID_K (GRID_K - 1)`` grid steps) away from any other row's or split's reference, so that rings
    with different references merge slot by slot (the decode kernels' splits)."""
    far = (tl.abs(m) >= ANCHOR_FREE) & (tl.abs(m) < float("inf"))
    return tl.where(far, GRID_K * tl.floor(m * (1.0 / GRID_K)), 0.0)


@triton.jit
def lowest_point(j, w_grid, GRID_K: tl.constexpr):
    """The ring's lowest point below the running max of grid index ``j`` (``[BLOCK_M]``), lowered by a few ulps;
    ``-inf`` where fp32 cannot index the grid (``|j| >= 2**22``, and no key yet)."""
    t_low = (j - (GRID_K - 1)) * w_grid
    return tl.where(tl.abs(j) < 4194304.0, t_low - 4.8e-7 * tl.abs(t_low), float("-inf"))


@triton.jit
def grid_tile(z, m, j_top, ref, F, G, L, slot, w_grid, shift, beta, bm1, POW: tl.constexpr, GRID_K: tl.constexpr,
              LANES: tl.constexpr):
    """One score tile ``z [BLOCK_M, BLOCK_N]`` of the grid pass: the running max ``m``, its grid index ``j_top``
    relative to the reference score ``ref`` (``[BLOCK_M]``), and the sums ``F``, ``G`` (and POW 0's reference logs
    ``L``) at the ``GRID_K`` ring points ``ref + i w_grid`` ``[BLOCK_M, GRID_K]`` (``F``, ``G`` per lane:
    ``grid_start``; no count: ``grid_counts``). Returns them updated and ``live``: some score of the tile is above
    the lowest point.

    A rise of the max by ``GRID_K`` grid steps or more (and the first key) restarts every slot: the reference moves
    there (``anchor``), which is exact since no slot keeps a sum, and the scores are taken relative to it."""
    z_max = tl.max(z, 1)
    m_new = tl.maximum(m, z_max)
    j_new = tl.where(m_new > float("-inf"), tl.floor((m_new - ref) / w_grid), j_top)
    restart = (m_new > m) & ((m == float("-inf")) | (j_new - j_top >= GRID_K))
    ref_new = tl.where(restart, anchor(m_new, GRID_K), ref)
    j_new = tl.where(restart, tl.floor((m_new - ref_new) / w_grid), j_new)
    # the lowest point is <= m - 1 <= tau up to rounding: tiles below it are dead (a few ulps of margin; none
    # where fp32 cannot index the grid: lowest_point); a row's max decides it (rounding is monotone)
    t_low = lowest_point(j_new, w_grid, GRID_K)
    live = tl.max(((z_max - ref_new) > t_low).to(tl.int32))
    # a dead tile holds no row's new maximum (it would lie above t_low), so m, j, ref and the ring stay as they are
    if live != 0:
        # ring: slot s holds the point of index i = j - ((j - s) mod K); a slot whose index changes restarts at
        # zero, which is exact: its new point lies above the old maximum, so no earlier key reaches it
        i_old = ring_index(j_top[:, None], slot[None, :], GRID_K)
        i_new = ring_index(j_new[:, None], slot[None, :], GRID_K)
        same = _lane_axis((i_old == i_new) & (restart == 0)[:, None], LANES)
        zr = z - ref_new[:, None]
        if POW == 0:
            # rescale the kept sums to the new maximal key's base
            l_new = log_ref((m_new - ref_new)[:, None], i_new * w_grid + shift)
            F = tl.where(same, F * _lane_axis(tl.exp2(beta * (L - l_new)), LANES), 0.0)
            G = tl.where(same, G * _lane_axis(tl.exp2(bm1 * (L - l_new)), LANES), 0.0)
            L = l_new
            # one point at a time: unrolled, the general class's log2 / exp2 temporaries of all points are live at
            # once and the training forward spills (216 bytes at head dim 128 under triton 3.6, docs/kernels.md)
            for s in range(GRID_K):
                F, G = _grid_point(zr, s, slot, j_new, L, F, G, w_grid, shift, bm1, POW, GRID_K, LANES)
        else:
            F = tl.where(same, F, 0.0)
            G = tl.where(same, G, 0.0)
            for s in tl.static_range(GRID_K):
                F, G = _grid_point(zr, s, slot, j_new, L, F, G, w_grid, shift, bm1, POW, GRID_K, LANES)
    return m_new, j_new, ref_new, F, G, L, live


@triton.jit
def _grid_point(z, s, slot, j_new, L, F, G, w_grid, shift, bm1, POW: tl.constexpr, GRID_K: tl.constexpr,
                LANES: tl.constexpr):
    """Add the per-lane point sums of the (relative) score tile ``z`` at ring slot ``s`` (its point from the row's
    grid index ``j_new``, POW 0's reference log ``L``) to that slot of ``F``, ``G`` (``grid_start``); returns them."""
    sel = (slot == s)[None, :]
    t_s = ring_index(j_new, s, GRID_K) * w_grid + shift
    if POW == 0:
        l_s = tl.sum(tl.where(sel, L, 0.0), 1)
    else:
        l_s = t_s
    f, g, _ = point_sums(z, t_s, POW, bm1, l_s, LANES)
    F += tl.where(_lane_axis(sel, LANES), _at_slot(f, LANES), 0.0)
    G += tl.where(_lane_axis(sel, LANES), _at_slot(g, LANES), 0.0)
    return F, G


@triton.jit
def _lane_axis(x, LANES: tl.constexpr):
    """``x [BLOCK_M, K]`` (or ``[1, K]``) broadcastable to point accumulators with ``LANES`` (``grid_start``)."""
    if LANES == 0:
        out = x
    else:
        out = x[:, :, None]
    return out


@triton.jit
def _at_slot(f, LANES: tl.constexpr):
    """Row sums ``f`` of one point (``[BLOCK_M]``, or ``[BLOCK_M, LANES]`` partials) as a slot of the point
    accumulators (``grid_start``)."""
    if LANES == 0:
        out = f[:, None]
    else:
        out = f[:, None, :]
    return out


@triton.jit
def point_zeros(BLOCK_M: tl.constexpr, K: tl.constexpr, LANES: tl.constexpr):
    """Zero accumulators of point sums: ``[BLOCK_M, K]`` (``[BLOCK_M]`` with ``K == 0``), with a trailing axis of
    per-lane partials when ``LANES > 0`` (``row_sums``)."""
    if K == 0:
        if LANES == 0:
            out = tl.zeros([BLOCK_M], tl.float32)
        else:
            out = tl.zeros([BLOCK_M, LANES], tl.float32)
    elif LANES == 0:
        out = tl.zeros([BLOCK_M, K], tl.float32)
    else:
        out = tl.zeros([BLOCK_M, K, LANES], tl.float32)
    return out


@triton.jit
def lane_total(x, LANES: tl.constexpr):
    """Point accumulators ``x`` (``point_zeros``) summed over their lanes at the end of a pass."""
    if LANES == 0:
        out = x
    else:
        out = tl.sum(x, len(x.shape) - 1)
    return out


@triton.jit
def grid_sums(F, G, LANES: tl.constexpr):
    """The grid's ``[BLOCK_M, GRID_K]`` sums from the accumulators of ``grid_tile``."""
    return lane_total(F, LANES), lane_total(G, LANES)


@triton.jit
def grid_counts(G, POW: tl.constexpr):
    """The counts ``c = #{z > t}`` at the grid points ``[BLOCK_M, GRID_K]`` for ``solve``'s exact-root test: ``g``
    itself at alpha = 2; 0 (unknown: the test never fires on such an end) otherwise, since a count per score and
    point is a whole instruction in a point of four. The candidate passes count their points."""
    if POW == 1:
        C = G
    else:
        C = G * 0.0
    return C


@triton.jit
def cand_points(m, lo, hi, CAND_P: tl.constexpr):
    """The ``[BLOCK_M, CAND_P]`` points of a candidate pass with ``CAND_P >= 2`` points, evenly over the certified
    bracket ``[lo, hi]`` widened by a few ulps, and the log of the max key's base there (POW 0's ``l_p``)."""
    cand = tl.arange(0, CAND_P).to(tl.float32)
    widen = 1e-6 * (1.0 + tl.abs(lo))
    lo2 = lo - widen
    t_p = lo2[:, None] + ((hi + widen - lo2) / (CAND_P - 1))[:, None] * cand[None, :]
    return t_p, log_ref(m[:, None], t_p)


@triton.jit
def cand_sums(z, pts, acc, POW: tl.constexpr, CAND_P: tl.constexpr, bm1, LANES: tl.constexpr = 0,
              COUNT: tl.constexpr = True):
    """Add the point sums of the score tile ``z`` of a candidate pass to the accumulators ``acc = (f1, g1, c1, FP, GP,
    CP)`` and return them. ``pts = (t_1, l_1, t_p, l_p, cand)``: with ``CAND_P == 1`` the point ``t_1`` (POW 0's
    reference log ``l_1``), its sums added to ``f1``, ``g1``, ``c1`` (``[BLOCK_M]``); else the candidate points ``t_p``
    (``l_p``; ``cand`` their column indices as float32, ``[CAND_P]``), their sums added to ``FP``, ``GP``, ``CP``
    (``[BLOCK_M, CAND_P]``). With ``LANES > 0`` per-lane partials (a trailing ``LANES`` axis, ``row_sums``). The unused
    entries of both tuples pass through. Without ``COUNT`` the counts of several points stay 0: at alpha 1.5 "not
    counted" (a count is two more instructions per score and point, read only by the exact-root test); at alpha 2 the
    count is ``g``, which ``cand_bracket`` reads in its place, so no accumulator is spent on it."""
    t_1, l_1, t_p, l_p, cand = pts
    f1, g1, c1, FP, GP, CP = acc
    if CAND_P == 1:
        f, g, c = point_sums(z, t_1, POW, bm1, l_1, LANES)
        f1 += f
        g1 += g
        c1 += c
    else:
        for p in tl.static_range(CAND_P):
            sel_c = (cand == p)[None, :]
            f, g, c = point_sums(z, tl.sum(tl.where(sel_c, t_p, 0.0), 1), POW, bm1,
                                 tl.sum(tl.where(sel_c, l_p, 0.0), 1), LANES)
            FP += tl.where(_lane_axis(sel_c, LANES), _at_slot(f, LANES), 0.0)
            GP += tl.where(_lane_axis(sel_c, LANES), _at_slot(g, LANES), 0.0)
            if POW != 0 and COUNT:
                CP += tl.where(_lane_axis(sel_c, LANES), _at_slot(c, LANES), 0.0)
    return f1, g1, c1, FP, GP, CP


@triton.jit
def grid_bracket(m, j_top, grid_ok, F, G, L, slot, w_grid, shift, am1, POW: tl.constexpr, GRID_K: tl.constexpr):
    """The first bracket of the fused forward's rows (:class:`~._threshold.Bracket`): the grid's ``[BLOCK_M, GRID_K]``
    sums ``F``, ``G`` (``grid_sums``; POW 0's reference logs ``L``) at the ring's points below the row max ``m`` of
    grid index ``j_top``, merged one point at a time. The lowest point has ``phi >= 0`` in exact arithmetic (it is
    <= ``m - 1``); the row max closes the bracket. Rows without ``grid_ok`` keep ``[m - 1, m]`` (``open_bracket``)."""
    br = open_bracket(m, grid_ok, shift)
    C = grid_counts(G, POW)
    for s in tl.static_range(GRID_K):
        sel = (slot == s)[None, :]
        i_s = ring_index(j_top, s, GRID_K)
        f_s = tl.sum(tl.where(sel, F, 0.0), 1)
        g_s = tl.sum(tl.where(sel, G, 0.0), 1)
        ph, dph = phi(f_s, g_s, POW, am1, tl.sum(tl.where(sel, L, 0.0), 1))
        lowest = i_s == j_top - (GRID_K - 1)
        ph = tl.where(lowest, tl.maximum(ph, 0.0), ph)
        br = merge_point(br, tl.where(grid_ok, i_s * w_grid + shift, float("nan")), ph, dph,
                         tl.where(lowest, tl.maximum(f_s, 1.0), f_s), g_s, tl.sum(tl.where(sel, C, 0.0), 1))
    return br


@triton.jit
def cand_bracket(br, pts, acc, am1, POW: tl.constexpr, CAND_P: tl.constexpr, LANES: tl.constexpr):
    """The bracket ``br`` tightened with the points of a candidate pass of the fused forward (``pts`` and the
    accumulators ``acc`` of ``cand_sums``, summed over their lanes here): ``t_1`` with ``CAND_P == 1``, else the
    ``CAND_P`` points ``t_p`` merged one at a time."""
    t_1, l_1, t_p, l_p, cand = pts
    f1, g1, c1, FP, GP, CP = acc
    if CAND_P == 1:
        f1 = lane_total(f1, LANES)
        g1 = lane_total(g1, LANES)
        c1 = lane_total(c1, LANES)
        ph, dph = phi(f1, g1, POW, am1, l_1)
        new = merge_point(br, t_1, ph, dph, f1, g1, c1)
    else:
        new = br
        FP = lane_total(FP, LANES)
        GP = lane_total(GP, LANES)
        if POW == 1:
            CP = GP  # the count at alpha 2 (cand_sums)
        else:
            CP = lane_total(CP, LANES)
        for p in tl.static_range(CAND_P):
            sel_c = (cand == p)[None, :]
            f_p = tl.sum(tl.where(sel_c, FP, 0.0), 1)
            g_p = tl.sum(tl.where(sel_c, GP, 0.0), 1)
            ph, dph = phi(f_p, g_p, POW, am1, tl.sum(tl.where(sel_c, l_p, 0.0), 1))
            new = merge_point(new, tl.sum(tl.where(sel_c, t_p, 0.0), 1), ph, dph, f_p, g_p,
                              tl.sum(tl.where(sel_c, CP, 0.0), 1))
    return new
